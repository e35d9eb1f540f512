//! One decode step of the fused forward (every sequence one token), its capture as CUDA graphs
//! (one per kernel variant) and the generation loops that replay them.

use super::{CudaGlimmer, Result, HEAD_DIM, MAX_ATTN_SPLITS, MAX_GQA_SPLITS};
use crate::runtime::Arg;
use crate::CudaError;

impl CudaGlimmer {
    /// Whether decode steps at position `at` run layer `il`'s attention with the grouped
    /// kernel (`Tuning::gqa_full_from`, `gqa_swa_from`; groups of at most 16 query heads).
    fn grouped_attn(&self, il: usize, at: usize) -> bool {
        let t = self.gpu.tuning();
        let (nq, nkv) = (self.info.n_head, self.info.n_head_kv);
        let from = if self.info.is_swa[il] {
            t.gqa_swa_from
        } else {
            t.gqa_full_from
        };
        t.fused_attn && from != u32::MAX && at >= from as usize && nq % nkv == 0 && nq / nkv <= 16
    }

    /// The positions from which decode steps change kernels (0 first, ascending): a captured
    /// decode graph holds one variant per entry.
    fn decode_variants(&self) -> Vec<usize> {
        let t = self.gpu.tuning();
        let mut v = vec![0];
        for from in [t.gqa_full_from, t.gqa_swa_from] {
            if from != u32::MAX && (from as usize) < self.opts.n_ctx {
                v.push(from as usize);
            }
        }
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Enqueues one decode step for `nb` sequences: sequence b's token in `tokens[b]` at
    /// `pos[b]`; the greedy next token lands in `tokens[b]`, and when `advance`, `pos[b]`
    /// advances and `history[b][pos]` records it. Reads nothing from the host, so it can be
    /// captured into a graph. `at` (a position at least the latest one's variant threshold)
    /// picks the kernels; every choice gives the same result up to rounding.
    pub(super) fn enqueue_decode(&self, nb: usize, advance: bool, at: usize) -> Result<()> {
        let i = &self.info;
        let g = &self.gpu;
        let s = &self.s;
        let tune = g.tuning();
        let pf = tune.prefetch_mb;
        let (nq, nkv) = (i.n_head, i.n_head_kv);
        let qw = nq * HEAD_DIM;
        let ld = 2 * qw + 2 * nkv * HEAD_DIM;
        self.tok_embd.get_rows(g, s.tokens.ptr(), nb, s.x.ptr())?;
        // Embedding RMSNorm (no weight), in place.
        self.norm(nb, s.x.ptr(), (0, 1), None, 0, s.x.ptr(), 0, false, (0, 0))?;
        self.norm(
            nb,
            s.x.ptr(),
            (0, 1),
            None,
            self.layers[0].attn_norm.ptr(),
            s.hf.ptr(),
            0,
            true,
            self.layers[0].qkvg.prefetch(pf),
        )?;
        for (il, l) in self.layers.iter().enumerate() {
            if !tune.attn_only {
                l.qkvg
                    .gemv(g, nb, self.qact(), s.hf.ptr(), s.y_qkvg.ptr())?;
            }
            let qa = self.qact();
            // What the attention asks the copy engine to bring into L2 while it waits and runs.
            let pf_wo = if tune.attn_prefetch_mb > 0.0 {
                l.gate_up.prefetch(tune.attn_prefetch_mb)
            } else {
                l.wo.prefetch(pf)
            };
            if tune.gemv_only {
                l.wo.gemv(g, nb, qa, s.hf.ptr(), s.y_o.ptr())?;
                l.gate_up.gemv(g, nb, qa, s.hf.ptr(), s.y_gu.ptr())?;
                l.down.gemv(g, nb, qa, s.hf.ptr(), s.y_d.ptr())?;
                continue;
            }
            let grouped = self.grouped_attn(il, at);
            let splits = match tune.attn_swa_splits {
                n if n > 0 && i.is_swa[il] => n,
                _ => tune.attn_splits,
            };
            let splits = (splits as usize).clamp(1, MAX_ATTN_SPLITS);
            if grouped || tune.fused_attn {
                // One kernel per layer: per query head, or per KV group (then the splits are
                // merged by attn_combine_gate; the per-head kernel merges its own).
                // The cluster kernels merge their own splits (no combine, no split records).
                let greg = match tune.gqa_swa_reg {
                    r if r != u32::MAX && i.is_swa[il] => r,
                    _ => tune.gqa_reg,
                };
                // Grouped kernel: name, cluster size (0: none) and block size.
                let (gkernel, cluster, gblock) = match greg {
                    0 => ("attn_decode_gqa", 0, 128),
                    1 => ("attn_decode_gqr", 0, 32),
                    2 => ("attn_decode_gqr2", 0, 32),
                    3 => match tune.gqc_diag {
                        1 => ("attn_decode_gqc16n1_d1", 16, 128),
                        3 => ("attn_decode_gqc16n1_d3", 16, 128),
                        4 => ("attn_decode_gqc16n1_d4", 16, 128),
                        8 => ("attn_decode_gqc16n1_d8", 16, 128),
                        _ => ("attn_decode_gqc16n1", 16, 128),
                    },
                    _ => ("attn_decode_gqc16w8", 16, 256),
                };
                let cluster = if grouped { cluster } else { 0 };
                let reg = grouped && greg > 0 && cluster == 0;
                let (kernel, blocks, splits, kmin) = if grouped {
                    let gs = match cluster {
                        0 => (tune.gqa_splits as usize).clamp(1, MAX_GQA_SPLITS),
                        c => c,
                    };
                    let kmin = match tune.gqa_swa_min_keys {
                        k if k > 0 && i.is_swa[il] => k,
                        _ => tune.gqa_min_keys,
                    };
                    (gkernel, nkv, gs, kmin as usize)
                } else {
                    let kernel = match tune.attn_keys_per_step {
                        16 => "attn_decode_fused_k16",
                        8 => "attn_decode_fused_k8",
                        _ => "attn_decode_fused",
                    };
                    (kernel, nq, splits, tune.attn_min_keys as usize)
                };
                let mut args = vec![
                    Arg::P(s.y_qkvg.ptr()),
                    Arg::L(ld as i64),
                    Arg::I(nq as i32),
                    Arg::I(nkv as i32),
                    Arg::P(l.q_norm.ptr()),
                    Arg::P(l.k_norm.ptr()),
                    Arg::F(i.rms_eps),
                    Arg::P(s.pos.ptr()),
                    Arg::I(i.is_swa[il] as i32),
                    Arg::F(self.theta_scale()),
                    Arg::P(l.k_cache),
                    Arg::P(l.v_cache),
                    Arg::L(self.slot_stride(l) as i64),
                    Arg::P(s.slots.ptr()),
                    Arg::I(self.window(il)),
                    Arg::F(i.attn_scale),
                    Arg::P(s.part.ptr()),
                    Arg::I(splits as i32),
                    Arg::I(kmin as i32),
                ];
                if !grouped {
                    args.push(Arg::P(s.attn_cnt.ptr()));
                }
                if !reg {
                    // (attn_decode_gqr writes split records only: the combine finishes.)
                    args.extend([Arg::P(s.hf.ptr()), Arg::P(qa.q), Arg::P(qa.d), Arg::P(qa.s)]);
                }
                args.extend([Arg::P(pf_wo.0), Arg::L(pf_wo.1), Arg::I(l.ring as i32)]);
                let smem = if reg || cluster > 0 {
                    0
                } else if grouped {
                    args.push(Arg::I(tune.gqa_pass_keys as i32));
                    crate::layout::GQA_SMEM_BYTES
                } else {
                    tune.attn_extra_smem
                };
                let block = if grouped { gblock } else { 128 };
                let grid = (blocks as u32, nb as u32, splits as u32);
                if cluster > 0 {
                    g.launch_cluster(kernel, grid, block, cluster as u32, &args)?;
                } else {
                    g.launch_smem(kernel, grid, block, smem, &args)?;
                }
                if grouped && cluster == 0 {
                    // The register kernel leaves even a single split to the combine.
                    self.combine_gate(il, nb, splits, kmin, !reg)?;
                }
            } else {
                self.qk_norm_rope(l, il, nb, ld, s.q_f.ptr(), 0, -1, pf_wo)?;
                g.launch(
                    "attn_decode",
                    (nq as u32, nb as u32, splits as u32),
                    128,
                    &[
                        Arg::P(s.q_f.ptr()),
                        Arg::P(l.k_cache),
                        Arg::P(l.v_cache),
                        Arg::P(s.pos.ptr()),
                        Arg::I(nq as i32),
                        Arg::I(nkv as i32),
                        Arg::I(self.window(il)),
                        Arg::F(i.attn_scale),
                        Arg::P(s.part.ptr()),
                        Arg::I(splits as i32),
                        Arg::I(tune.attn_min_keys as i32),
                        Arg::L(self.slot_stride(l) as i64),
                        Arg::P(s.slots.ptr()),
                        Arg::I(l.ring as i32),
                    ],
                )?;
                self.combine_gate(il, nb, splits, tune.attn_min_keys as usize, false)?;
            }
            if tune.attn_only {
                continue;
            }
            l.wo.gemv(g, nb, qa, s.hf.ptr(), s.y_o.ptr())?;
            // The residual moves to x2 and back within the layer, so the norms may run in slices.
            let (xa, xb) = (s.x.ptr(), s.x2.ptr());
            if !tune.skip_norm {
                self.norm(
                    nb,
                    xa,
                    (xb, tune.norm_slices),
                    Some((s.y_o.ptr(), l.post_attn_norm.ptr(), 1e-8)),
                    l.ffn_norm.ptr(),
                    s.hf.ptr(),
                    0,
                    true,
                    l.gate_up.prefetch(pf),
                )?;
            } else if tune.skip_as_nop {
                g.launch("pdl_nop", (1, 1, 1), 32, &[])?;
            }
            l.gate_up.gemv(g, nb, qa, s.hf.ptr(), s.y_gu.ptr())?;
            let pf_down = l.down.prefetch(pf);
            if !tune.skip_swiglu {
                self.swiglu(l, nb, 64, (s.hf.ptr(), 0), Some(qa), pf_down)?;
            } else if tune.skip_as_nop {
                g.launch("pdl_nop", (1, 1, 1), 32, &[])?;
            }
            l.down.gemv(g, nb, qa, s.hf.ptr(), s.y_d.ptr())?;
            let (next, pf_next) = match self.layers.get(il + 1) {
                Some(n) => (n.attn_norm.ptr(), n.qkvg.prefetch(pf)),
                None => (self.output_norm.ptr(), self.output.prefetch(pf)),
            };
            if tune.skip_norm {
                if tune.skip_as_nop {
                    g.launch("pdl_nop", (1, 1, 1), 32, &[])?;
                }
                continue;
            }
            self.norm(
                nb,
                xb,
                (xa, tune.norm_slices),
                Some((s.y_d.ptr(), l.post_ffw_norm.ptr(), 1e-8)),
                next,
                s.hf.ptr(),
                0,
                true,
                pf_next,
            )?;
        }
        self.output
            .gemv(g, nb, self.qact(), s.hf.ptr(), s.logits.ptr())?;
        self.finish_logits(nb, advance)
    }

    /// One decode step: `token` at `pos`; returns the logits (after scale and softcap) and the
    /// greedy next token.
    pub fn decode(&mut self, token: u32, pos: usize) -> Result<(Vec<f32>, u32)> {
        self.check_pos(pos, 1)?;
        self.upload_step(&[token], &[pos])?;
        self.enqueue_decode(1, false, pos)?;
        self.read_logits()
    }

    /// Uploads a decode step's inputs (row b: `tokens[b]` at `pos[b]`); returns the latest
    /// position, which picks the graph variant.
    pub(super) fn upload_step(&self, tokens: &[u32], pos: &[usize]) -> Result<usize> {
        let t: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
        let p: Vec<i32> = pos.iter().map(|&x| x as i32).collect();
        self.gpu.upload(&self.s.tokens, 0, &t)?;
        self.gpu.upload(&self.s.pos, 0, &p)?;
        Ok(pos.iter().copied().max().unwrap_or(0))
    }

    /// Captures one decode step (token and position read from device memory) as a graph.
    pub fn capture_decode(&self) -> Result<DecodeGraph> {
        self.capture_decode_batch(1)
    }

    /// Captures one decode step of sequences `0..nb` (one token each) as a graph.
    pub fn capture_decode_batch(&self, nb: usize) -> Result<DecodeGraph> {
        self.capture_steps(nb, true)
    }

    /// Captures one decode step of `nb` rows; with `advance`, each replay moves the positions
    /// on and records the greedy tokens (generation loops), else it only computes the logits.
    pub(super) fn capture_steps(&self, nb: usize, advance: bool) -> Result<DecodeGraph> {
        if nb == 0 || nb > self.opts.n_seq {
            return Err(CudaError::Shape(format!(
                "decode batch {nb} (the cache holds {} sequences)",
                self.opts.n_seq
            )));
        }
        self.gpu.sync()?;
        let mut graphs = Vec::new();
        for at in self.decode_variants() {
            self.gpu.begin_capture()?;
            let r = self.enqueue_decode(nb, advance, at);
            let graph = self.gpu.end_capture();
            r?;
            graphs.push((at, graph?));
        }
        Ok(DecodeGraph { graphs, nb })
    }

    /// Greedy generation for `graph.nb` sequences at once: sequence b continues from
    /// `tokens[b]` at `pos[b]`, `n` steps; returns each sequence's generated tokens.
    pub fn generate_batch(
        &self,
        graph: &DecodeGraph,
        tokens: &[u32],
        pos: &[usize],
        n: usize,
    ) -> Result<Vec<Vec<u32>>> {
        let nb = graph.nb;
        if tokens.len() != nb || pos.len() != nb {
            return Err(CudaError::Shape(format!(
                "{} tokens and {} positions for a batch of {nb}",
                tokens.len(),
                pos.len()
            )));
        }
        for &p in pos {
            self.check_pos(p, n)?;
        }
        let latest = self.upload_step(tokens, pos)?;
        for step in 0..n {
            graph.replay(latest + step)?;
        }
        let hl = self.opts.n_ctx + 1;
        let mut out = Vec::with_capacity(nb);
        for (b, &p0) in pos.iter().enumerate() {
            let mut hist = vec![0i32; n];
            self.gpu
                .download(self.s.history.at(4 * (b * hl + p0 + 1)), &mut hist)?;
            out.push(hist.into_iter().map(|t| t as u32).collect());
        }
        Ok(out)
    }

    /// Greedy generation of `n` tokens after `token` at `pos` by replaying `graph`; returns the
    /// generated tokens. The KV cache must hold positions before `pos`.
    pub fn generate(
        &self,
        graph: &DecodeGraph,
        token: u32,
        pos: usize,
        n: usize,
    ) -> Result<Vec<u32>> {
        let mut out = self.generate_batch(graph, &[token], &[pos], n)?;
        Ok(out.pop().unwrap_or_default())
    }
}

/// A captured decode step: one graph per kernel variant, each with the position from which
/// it is replayed (ascending, the first at 0).
pub struct DecodeGraph {
    graphs: Vec<(usize, cudarc::driver::CudaGraph)>,
    nb: usize,
}

impl DecodeGraph {
    /// The variant for a step whose latest position is `pos`.
    fn for_position(&self, pos: usize) -> &cudarc::driver::CudaGraph {
        let i = self.graphs.partition_point(|(from, _)| *from <= pos);
        &self.graphs[i.saturating_sub(1)].1
    }

    /// Launches the variant for a step whose latest position is `pos`.
    pub(super) fn replay(&self, pos: usize) -> Result<()> {
        self.for_position(pos)
            .launch()
            .map_err(crate::runtime::drv_err)
    }
}
