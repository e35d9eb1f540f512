//! Muse Glimmer on the GPU: the forward pass of spec §2.2 with fused kernels.
//!
//! Decode (one token) runs integer GEMVs over the quantized weights, each weight byte read
//! once; the whole step (embedding to greedy argmax) can be captured as one CUDA graph whose
//! inputs (token, position) live in device memory, so a generation loop is graph replays.
//! Which kernels a decode step runs is the model's [`DecodePlan`], derived at load.
//! Prefill dequantizes each weight matrix to bf16 and multiplies with cuBLAS; attention for
//! a chunk is one flash kernel.
//!
//! The KV cache is F16 in device memory with the CPU cache's logical row layout
//! (`[position][n_head_kv * head_dim]` per layer, K after norm and RoPE, V raw), one block of
//! rows per sequence. Full-attention layers hold `n_ctx` positions; sliding layers (with
//! `GpuOptions::swa_ring`) a ring of `n_swa + max_chunk` rows, position p in row p % ring.

use muser_gguf::GgufFile;
use muser_model::{Arch, ModelInfo};

pub use crate::layout::{sample_params, sample_uniform, Sampling};
use crate::plan::{DecodePlan, Geometry, LayerKind, Overrides, MAX_ARGMAX_BLOCKS};
use crate::runtime::{Arg, DevBuf, Gpu};
use crate::weights::{DevWeight, QAct, WType};
use crate::CudaError;

mod decode;
mod engine;
mod prefill;

pub use decode::DecodeGraph;
pub use engine::FusedGlimmer;

type Result<T> = std::result::Result<T, CudaError>;

const HEAD_DIM: usize = 128;

/// A linear layer made of row blocks that may differ in type (e.g. Q6_K V rows beside Q4_K
/// Q rows); consecutive blocks of one type share one matrix.
struct Linear {
    segs: Vec<(DevWeight, usize)>,
    rows: usize,
    cols: usize,
}

impl Linear {
    fn load(gpu: &Gpu, g: &GgufFile, names: &[String], cols: usize) -> Result<Linear> {
        let mut groups: Vec<(WType, Vec<&[u8]>, usize)> = Vec::new();
        let mut rows = 0;
        for n in names {
            let t = g
                .tensor(n)
                .ok_or_else(|| CudaError::Model(format!("tensor {n} is missing")))?;
            let ty = WType::from_ggml(t.ty.id()).ok_or_else(|| {
                CudaError::Unsupported(format!("tensor {n} has type {}", t.ty.name()))
            })?;
            if t.dims.first().copied() != Some(cols as u64) || t.dims.len() != 2 {
                return Err(CudaError::Model(format!(
                    "tensor {n} has dims {:?}, expected [{cols}, _]",
                    t.dims
                )));
            }
            let r = t.dims[1] as usize;
            let data = g.tensor_data(t);
            match groups.last_mut() {
                Some((gty, parts, grows)) if *gty == ty => {
                    parts.push(data);
                    *grows += r;
                }
                _ => groups.push((ty, vec![data], r)),
            }
            rows += r;
        }
        let mut segs = Vec::new();
        let mut off = 0;
        for (ty, parts, r) in groups {
            segs.push((DevWeight::upload(gpu, ty, cols, &parts)?, off));
            off += r;
        }
        Ok(Linear { segs, rows, cols })
    }

    /// Gate and up projections as one matrix with rows interleaved in groups of 16 (16 gate
    /// rows, then the same 16 up rows), so a GEMV block group sees both halves of 16 SwiGLU
    /// outputs; or `[gate | up]` (second value false) when the two differ in type or shape.
    fn load_gate_up(
        gpu: &Gpu,
        g: &GgufFile,
        gate: &str,
        up: &str,
        cols: usize,
    ) -> Result<(Linear, bool)> {
        let (tg, tu) = match (g.tensor(gate), g.tensor(up)) {
            (Some(a), Some(b)) => (a, b),
            _ => {
                return Ok((
                    Linear::load(gpu, g, &[gate.to_string(), up.to_string()], cols)?,
                    false,
                ))
            }
        };
        let ty = WType::from_ggml(tg.ty.id());
        let same = ty.is_some()
            && tg.ty.id() == tu.ty.id()
            && tg.dims == tu.dims
            && tg.dims.len() == 2
            && tg.dims[0] == cols as u64
            && tg.dims[1] % 16 == 0;
        let Some(ty) = ty.filter(|_| same) else {
            return Ok((
                Linear::load(gpu, g, &[gate.to_string(), up.to_string()], cols)?,
                false,
            ));
        };
        let (dg, du) = (g.tensor_data(tg), g.tensor_data(tu));
        let group = 16 * ty.row_bytes(cols);
        if dg.len() != du.len() || dg.len() % group != 0 {
            return Err(CudaError::Model(format!(
                "{gate}/{up}: sizes do not match their shape"
            )));
        }
        let mut pieces: Vec<&[u8]> = Vec::with_capacity(2 * dg.len() / group);
        for (a, b) in dg.chunks_exact(group).zip(du.chunks_exact(group)) {
            pieces.push(a);
            pieces.push(b);
        }
        let rows = 2 * tg.dims[1] as usize;
        let w = DevWeight::upload(gpu, ty, cols, &pieces)?;
        Ok((
            Linear {
                segs: vec![(w, 0)],
                rows,
                cols,
            },
            true,
        ))
    }

    fn device_bytes(&self) -> usize {
        self.segs.iter().map(|(w, _)| w.device_bytes()).sum()
    }

    /// Decode: `y[b][0..rows]` (row stride `rows`) for `batch` activation rows.
    fn gemv(&self, gpu: &Gpu, batch: usize, qa: QAct, xf: u64, y: u64) -> Result<()> {
        for (w, off) in &self.segs {
            w.gemv(gpu, batch, qa, xf, y + 4 * *off as u64, self.rows)?;
        }
        Ok(())
    }

    /// Prefill: `y[n][rows] = x[n][cols] (bf16) · Wᵀ`, dequantizing through `wbuf`.
    fn gemm(&self, gpu: &Gpu, n: usize, x: u64, y: u64, wbuf: u64) -> Result<()> {
        for (w, off) in &self.segs {
            w.dequant_bf16(gpu, wbuf)?;
            gpu.gemm_bf16(
                y + 4 * *off as u64,
                self.rows,
                x,
                wbuf,
                n,
                w.rows,
                self.cols,
            )?;
        }
        Ok(())
    }
}

struct Layer {
    attn_norm: DevBuf,
    q_norm: DevBuf,
    k_norm: DevBuf,
    /// Rows: q (n_head·hd) | k | v (n_head_kv·hd each) | gate (n_head·hd).
    qkvg: Linear,
    wo: Linear,
    post_attn_norm: DevBuf,
    ffn_norm: DevBuf,
    /// Rows: ffn_gate and ffn_up interleaved in groups of 16 when `gu_il`, else gate | up.
    gate_up: Linear,
    gu_il: bool,
    down: Linear,
    post_ffw_norm: DevBuf,
    /// Device addresses of the layer's K and V cache (`[n_seq][cache_rows][n_head_kv · 128]`
    /// f16): the model's own buffers, or a bound `CudaKv`'s.
    k_cache: u64,
    v_cache: u64,
    /// Rows of the cache per sequence: `n_ctx`, or for a sliding layer with a ring
    /// `n_swa + max_chunk` (position p in row p % ring).
    cache_rows: usize,
    /// Ring length (0: position p in row p).
    ring: usize,
}

/// Scratch for one decode step of up to `max_batch` tokens, and for prefill chunks.
struct Scratch {
    x: DevBuf,
    hf: DevBuf,
    q8: DevBuf,
    q8d: DevBuf,
    q8s: DevBuf,
    y_qkvg: DevBuf,
    part: DevBuf,
    /// Per-(sequence, head) split counters of the fused attention kernel (zero between launches).
    attn_cnt: DevBuf,
    /// `logits_argmax`'s per-block (value, index) partials ([sequence][ARGMAX_BLOCKS] floats,
    /// then as many ints) and per-sequence arrival counters (zero between launches).
    argmax_part: DevBuf,
    argmax_cnt: DevBuf,
    /// The residual stream between a layer's two norms (decode), so that no norm updates it in
    /// place and the norms may run in slices.
    x2: DevBuf,
    y_o: DevBuf,
    y_gu: DevBuf,
    y_d: DevBuf,
    logits: DevBuf,
    tokens: DevBuf,
    pos: DevBuf,
    history: DevBuf,
    /// Per-sequence `SampleParams` (kernels.cu), zero (greedy) until set.
    sample: DevBuf,
    /// Decode row b's sequence (cache block): `0..MAX_GEMV_BATCH` unless the engine's forward
    /// (`FusedGlimmer`) runs a subset of its slots.
    slots: DevBuf,
    /// Decode rows (sequences) and positions the buffers were sized for.
    batch: usize,
    history_ctx: usize,
    // prefill
    hb: DevBuf,
    q_h: DevBuf,
    o_heads: DevBuf,
    wbuf: DevBuf,
}

/// Sizes the GPU model is built for.
#[derive(Clone, Copy, Debug)]
pub struct GpuOptions {
    /// Positions the KV cache holds.
    pub n_ctx: usize,
    /// Largest prefill chunk (tokens per forward pass).
    pub max_chunk: usize,
    /// Sequences the KV cache holds (decode steps batch up to this many, one per sequence).
    pub n_seq: usize,
    /// Sliding-window layers keep a ring of `n_swa + max_chunk` positions instead of `n_ctx`.
    pub swa_ring: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            n_ctx: 4096,
            max_chunk: 512,
            n_seq: 1,
            swa_ring: true,
        }
    }
}

/// A Muse Glimmer model resident on one GPU, with its KV cache (`GpuOptions::n_seq`
/// sequences), or bound to an engine's cache (`FusedGlimmer`).
pub struct CudaGlimmer {
    gpu: std::sync::Arc<Gpu>,
    info: ModelInfo,
    opts: GpuOptions,
    tok_embd: DevWeight,
    output_norm: DevBuf,
    output: Linear,
    logit_scale: f32,
    layers: Vec<Layer>,
    /// Which kernels and launch shapes a decode step runs.
    plan: DecodePlan,
    s: Scratch,
    weight_bytes: usize,
    /// Per-sequence sampling choices as uploaded to `Scratch::sample` (None: greedy).
    sampling: std::sync::Mutex<Vec<Option<Sampling>>>,
    /// The model's own K/V buffers (empty when bound to an engine's cache).
    _own_kv: Vec<DevBuf>,
    /// Sequences the cache in use holds.
    kv_seqs: usize,
}

fn norm_vec(gpu: &Gpu, g: &GgufFile, name: &str, n: usize) -> Result<DevBuf> {
    let t = g
        .tensor(name)
        .ok_or_else(|| CudaError::Model(format!("tensor {name} is missing")))?;
    if t.n_elements() != n as u64 || t.ty.id() != 0 {
        return Err(CudaError::Model(format!(
            "tensor {name}: want {n} f32 values"
        )));
    }
    let buf = gpu.alloc(4 * n)?;
    gpu.upload(&buf, 0, g.tensor_data(t))?;
    Ok(buf)
}

fn f32_scalar(g: &GgufFile, name: &str) -> Option<f32> {
    let t = g.tensor(name)?;
    let d = g.tensor_data(t);
    (t.ty.id() == 0 && d.len() == 4).then(|| f32::from_le_bytes([d[0], d[1], d[2], d[3]]))
}

impl CudaGlimmer {
    /// Uploads a muse-glimmer GGUF to the GPU and allocates its KV cache and scratch.
    pub fn load(gpu: Gpu, g: &GgufFile, opts: GpuOptions) -> Result<CudaGlimmer> {
        Self::load_shared(std::sync::Arc::new(gpu), g, opts, true)
    }

    /// [`Self::load`] on a shared device; without `own_kv` no cache is allocated (one must be
    /// bound with [`Self::bind_kv`] before running).
    pub(crate) fn load_shared(
        gpu: std::sync::Arc<Gpu>,
        g: &GgufFile,
        opts: GpuOptions,
        own_kv: bool,
    ) -> Result<CudaGlimmer> {
        let info =
            ModelInfo::from_gguf(g, g.file_len()).map_err(|e| CudaError::Model(e.to_string()))?;
        if info.arch != Arch::MuseGlimmer {
            return Err(CudaError::Unsupported(format!(
                "architecture {} (CUDA runs muse-glimmer)",
                info.arch.name()
            )));
        }
        if info.head_dim != HEAD_DIM || info.n_rot != HEAD_DIM {
            return Err(CudaError::Unsupported(format!(
                "head_dim {} (kernels need 128)",
                info.head_dim
            )));
        }
        if info.n_embd % 256 != 0 || info.n_ff % 256 != 0 || info.n_embd > 16384 {
            return Err(CudaError::Unsupported(
                "n_embd and n_ff must be multiples of 256, n_embd at most 16384".into(),
            ));
        }
        for t in g.tensors() {
            if t.name.ends_with(".bias") {
                return Err(CudaError::Unsupported(format!("bias tensor {}", t.name)));
            }
        }
        let (e, nq, nkv, f) = (info.n_embd, info.n_head, info.n_head_kv, info.n_ff);
        let qw = nq * HEAD_DIM;
        let kvw = nkv * HEAD_DIM;
        let tok_embd = {
            let t = g
                .tensor("token_embd.weight")
                .ok_or_else(|| CudaError::Model("token_embd.weight is missing".into()))?;
            let ty = WType::from_ggml(t.ty.id()).ok_or_else(|| {
                CudaError::Unsupported(format!("token_embd type {}", t.ty.name()))
            })?;
            DevWeight::upload(&gpu, ty, e, &[g.tensor_data(t)])?
        };
        let output_norm = norm_vec(&gpu, g, "output_norm.weight", e)?;
        let output = Linear::load(&gpu, g, &["output.weight".to_string()], e)?;
        // Per-tensor output scale (NVFP4 checkpoints) multiplies the logits (spec §2.3).
        let logit_scale = info.logit_scale * f32_scalar(g, "output.scale").unwrap_or(1.0);
        if opts.n_seq == 0 || opts.n_seq > crate::layout::MAX_GEMV_BATCH {
            return Err(CudaError::Shape(format!(
                "{} sequences (1..={})",
                opts.n_seq,
                crate::layout::MAX_GEMV_BATCH
            )));
        }

        let mut layers = Vec::with_capacity(info.n_layer);
        let mut kv_bufs = Vec::new();
        for il in 0..info.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}.weight");
            // A prefill chunk reads keys [p0 - n_swa + 1, p0 + chunk): a ring of n_swa + chunk
            // rows holds them all at distinct rows.
            let ring_len = info.n_swa as usize + opts.max_chunk.max(1);
            let ring = if opts.swa_ring && info.is_swa[il] && ring_len < opts.n_ctx {
                ring_len
            } else {
                0
            };
            let cache_rows = if ring > 0 { ring } else { opts.n_ctx };
            let (k_cache, v_cache) = if own_kv {
                let cache_bytes = opts.n_seq * cache_rows * kvw * 2;
                let (k, v) = (
                    gpu.alloc_zeroed(cache_bytes)?,
                    gpu.alloc_zeroed(cache_bytes)?,
                );
                let ptrs = (k.ptr(), v.ptr());
                kv_bufs.extend([k, v]);
                ptrs
            } else {
                (0, 0)
            };
            let (gate_up, gu_il) = Linear::load_gate_up(&gpu, g, &n("ffn_gate"), &n("ffn_up"), e)?;
            layers.push(Layer {
                attn_norm: norm_vec(&gpu, g, &n("attn_norm"), e)?,
                q_norm: norm_vec(&gpu, g, &n("attn_q_norm"), HEAD_DIM)?,
                k_norm: norm_vec(&gpu, g, &n("attn_k_norm"), HEAD_DIM)?,
                qkvg: Linear::load(
                    &gpu,
                    g,
                    &[n("attn_q"), n("attn_k"), n("attn_v"), n("attn_gate")],
                    e,
                )?,
                wo: Linear::load(&gpu, g, &[n("attn_output")], qw)?,
                post_attn_norm: norm_vec(&gpu, g, &n("post_attention_norm"), e)?,
                ffn_norm: norm_vec(&gpu, g, &n("ffn_norm"), e)?,
                gate_up,
                gu_il,
                down: Linear::load(&gpu, g, &[n("ffn_down")], f)?,
                post_ffw_norm: norm_vec(&gpu, g, &n("post_ffw_norm"), e)?,
                k_cache,
                v_cache,
                cache_rows,
                ring,
            });
        }
        let weight_bytes = tok_embd.device_bytes()
            + output.device_bytes()
            + layers
                .iter()
                .map(|l| {
                    l.qkvg.device_bytes()
                        + l.wo.device_bytes()
                        + l.gate_up.device_bytes()
                        + l.down.device_bytes()
                })
                .sum::<usize>();
        let s = Self::scratch(&gpu, &info, &opts)?;
        let plan = Self::derive_plan(&gpu, &info);
        Ok(CudaGlimmer {
            gpu,
            info,
            opts,
            tok_embd,
            output_norm,
            output,
            logit_scale,
            layers,
            plan,
            s,
            weight_bytes,
            sampling: std::sync::Mutex::new(vec![None; opts.n_seq]),
            _own_kv: kv_bufs,
            kv_seqs: if own_kv { opts.n_seq } else { 0 },
        })
    }

    /// Runs on an engine's cache from now on: per layer the K and V addresses of `n_seq`
    /// blocks of `cells[il]` rows each (`[n_seq][cells][n_head_kv · 128]` f16, `CudaKv`'s
    /// layout), position p of a sliding layer in row `p % cells`, of a full layer in row p.
    /// Positions up to `n_ctx`; decode steps of up to `MAX_GEMV_BATCH` sequences. Drops the
    /// model's own cache; graphs captured before no longer apply.
    pub(crate) fn bind_kv(
        &mut self,
        k: &[u64],
        v: &[u64],
        cells: &[usize],
        n_seq: usize,
        n_ctx: usize,
    ) -> Result<()> {
        let n = self.layers.len();
        if k.len() != n || v.len() != n || cells.len() != n || n_seq == 0 {
            return Err(CudaError::Shape(format!(
                "a cache of {} layers and {n_seq} sequences for a model of {n} layers",
                cells.len()
            )));
        }
        for (il, (&c, &swa)) in cells.iter().zip(&self.info.is_swa).enumerate() {
            if !swa && c < n_ctx {
                return Err(CudaError::Shape(format!(
                    "layer {il}: {c} cells for {n_ctx} positions"
                )));
            }
        }
        let batch = n_seq.min(crate::layout::MAX_GEMV_BATCH);
        // The scratch depends on n_ctx only through the generation history (and the GEMM
        // attention's buffers, sized when used): kept when large enough, so that a new cache
        // of the same size costs no reallocation.
        if n_ctx > self.s.history_ctx || batch > self.s.batch {
            self.opts.n_ctx = n_ctx;
            self.opts.n_seq = batch;
            self.s = Self::scratch(&self.gpu, &self.info, &self.opts)?;
        }
        self.opts.n_ctx = n_ctx;
        self.opts.n_seq = batch;
        *self.sampling.lock().unwrap_or_else(|e| e.into_inner()) = vec![None; batch];
        for (il, l) in self.layers.iter_mut().enumerate() {
            let full = !self.info.is_swa[il];
            l.k_cache = k[il];
            l.v_cache = v[il];
            l.cache_rows = cells[il];
            l.ring = if full { 0 } else { cells[il] };
        }
        self._own_kv.clear();
        self.kv_seqs = n_seq;
        Ok(())
    }

    /// Sets decode row b's sequence to `seqs[b]` (the others keep theirs).
    pub(crate) fn set_decode_slots(&self, seqs: &[u32]) -> Result<()> {
        if seqs.len() > crate::layout::MAX_GEMV_BATCH
            || seqs.iter().any(|&q| q as usize >= self.kv_seqs)
        {
            return Err(CudaError::Shape(format!(
                "decode rows for sequences {seqs:?} of {}",
                self.kv_seqs
            )));
        }
        let v: Vec<i32> = seqs.iter().map(|&q| q as i32).collect();
        self.gpu.upload(&self.s.slots, 0, &v)
    }

    fn scratch(gpu: &Gpu, i: &ModelInfo, o: &GpuOptions) -> Result<Scratch> {
        let t = o.max_chunk.max(o.n_seq).max(1);
        let ns = o.n_seq.max(1);
        let (e, f, v) = (i.n_embd, i.n_ff, i.n_vocab);
        let qw = i.n_head * HEAD_DIM;
        let rows_qkvg = 2 * qw + 2 * i.n_head_kv * HEAD_DIM;
        let widest = e.max(f).max(qw);
        let max_w = [rows_qkvg * e, e * qw, 2 * f * e, e * f]
            .into_iter()
            .max()
            .unwrap_or(0);
        Ok(Scratch {
            x: gpu.alloc(4 * t * e)?,
            hf: gpu.alloc(4 * t * widest)?,
            q8: gpu.alloc(t * widest)?,
            q8d: gpu.alloc(4 * t * widest / 16)?,
            q8s: gpu.alloc(4 * t * widest / 16)?,
            y_qkvg: gpu.alloc(4 * t * rows_qkvg)?,
            part: gpu.alloc(
                4 * ns
                    * (i.n_head * crate::layout::MAX_SPLITS * 130)
                        .max(i.n_head_kv * crate::layout::GQC_RECORDS * crate::layout::GQC_REC),
            )?,
            attn_cnt: gpu.alloc_zeroed(4 * ns * i.n_head)?,
            argmax_part: gpu.alloc(8 * ns * MAX_ARGMAX_BLOCKS)?,
            argmax_cnt: gpu.alloc_zeroed(4 * ns)?,
            x2: gpu.alloc(4 * ns * e)?,
            y_o: gpu.alloc(4 * t * e)?,
            y_gu: gpu.alloc(4 * t * 2 * f)?,
            y_d: gpu.alloc(4 * t * e)?,
            logits: gpu.alloc(4 * v * ns)?,
            tokens: gpu.alloc_zeroed(4 * t)?,
            pos: gpu.alloc_zeroed(4 * t)?,
            history: gpu.alloc_zeroed(4 * (o.n_ctx + 1) * ns)?,
            sample: gpu.alloc_zeroed(16 * ns)?,
            slots: {
                let n = crate::layout::MAX_GEMV_BATCH;
                let b = gpu.alloc(4 * n)?;
                gpu.upload(&b, 0, &(0..n as i32).collect::<Vec<i32>>())?;
                b
            },
            hb: gpu.alloc(2 * t * widest)?,
            q_h: gpu.alloc(2 * t * qw)?,
            batch: ns,
            history_ctx: o.n_ctx,
            o_heads: gpu.alloc(4 * t * qw)?,
            wbuf: gpu.alloc(2 * max_w)?,
        })
    }

    fn derive_plan(gpu: &Gpu, i: &ModelInfo) -> DecodePlan {
        let g = Geometry {
            n_embd: i.n_embd,
            n_head: i.n_head,
            n_head_kv: i.n_head_kv,
            n_vocab: i.n_vocab,
        };
        DecodePlan::new(gpu.info().compute_capability, g, gpu.overrides())
    }

    /// Which kernels and launch shapes a decode step runs.
    pub fn plan(&self) -> &DecodePlan {
        &self.plan
    }

    /// The plan as text (`DecodePlan::describe` over the first layer's matrices and the
    /// vocabulary projection): one line per layer kind and batch bucket.
    pub fn describe_plan(&self) -> Vec<String> {
        let mut m = Vec::new();
        if let Some(l) = self.layers.first() {
            for (name, lin) in [
                ("qkvg", &l.qkvg),
                ("wo", &l.wo),
                ("gate_up", &l.gate_up),
                ("down", &l.down),
            ] {
                m.extend(lin.segs.iter().map(|(w, _)| (name, w.ty, w.rows, w.cols)));
            }
        }
        let out = self.output.segs.iter();
        m.extend(out.map(|(w, _)| ("output", w.ty, w.rows, w.cols)));
        self.plan.describe(&m)
    }

    /// Benchmark overrides from now on (on the device too, for its GEMVs): the plan is derived
    /// again; graphs captured before keep the old choices.
    pub fn set_overrides(&mut self, o: Overrides) {
        self.gpu.set_overrides(o);
        self.plan = Self::derive_plan(&self.gpu, &self.info);
    }

    /// The model's hyperparameters.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Bytes of weights one decode step reads (all matrices once; the embedding row is noise).
    pub fn decode_weight_bytes(&self) -> usize {
        self.weight_bytes - self.tok_embd.device_bytes()
    }

    fn qact(&self) -> QAct {
        QAct {
            q: self.s.q8.ptr(),
            d: self.s.q8d.ptr(),
            s: self.s.q8s.ptr(),
        }
    }

    /// `norm_fused` (see kernels.cu): optional post-norm + residual into x, then the norm of x.
    /// The new x goes to `to.0` (0: in place) in `to.1` row slices (more than one only with a
    /// separate destination, see `compare::norm_slices`).
    #[allow(clippy::too_many_arguments)]
    fn norm(
        &self,
        rows: usize,
        x: u64,
        to: (u64, u32),
        post: Option<(u64, u64, f32)>,
        w: u64,
        out_f: u64,
        out_b: u64,
        quant: bool,
    ) -> Result<()> {
        let (y, wp, ep) = post.unwrap_or((0, 0, 0.0));
        let qa = self.qact();
        let (q, qd, qs) = if quant { (qa.q, qa.d, qa.s) } else { (0, 0, 0) };
        let slices = crate::compare::norm_slices(x, to.0, out_f, to.1);
        let n = self.plan.norm;
        self.gpu.launch(
            n.kernel,
            (rows as u32, slices, 1),
            n.block,
            &[
                Arg::P(x),
                Arg::P(y),
                Arg::P(wp),
                Arg::F(ep),
                Arg::P(w),
                Arg::F(self.info.rms_eps),
                Arg::L(self.info.n_embd as i64),
                Arg::P(out_f),
                Arg::P(out_b),
                Arg::P(q),
                Arg::P(qd),
                Arg::P(qs),
                Arg::P(to.0),
            ],
        )
    }

    /// `swiglu` (kernels.cu) over `rows` rows of layer `l`'s gate+up output: to f32 and/or bf16
    /// (`out`: addresses, 0 for none) and/or int8 activations, `block` threads per block.
    fn swiglu(
        &self,
        l: &Layer,
        rows: usize,
        block: usize,
        out: (u64, u64),
        quant: Option<QAct>,
    ) -> Result<()> {
        let f = self.info.n_ff;
        let qa = quant.unwrap_or(QAct { q: 0, d: 0, s: 0 });
        self.gpu.launch(
            "swiglu",
            ((rows * f / 4).div_ceil(block) as u32, 1, 1),
            block as u32,
            &[
                Arg::P(self.s.y_gu.ptr()),
                Arg::L(f as i64),
                Arg::L(rows as i64),
                Arg::P(out.0),
                Arg::P(out.1),
                Arg::P(qa.q),
                Arg::P(qa.d),
                Arg::P(qa.s),
                Arg::I(l.gu_il as i32),
            ],
        )
    }

    /// Halves between two sequences' caches in layer `l`.
    fn slot_stride(&self, l: &Layer) -> usize {
        l.cache_rows * self.info.n_head_kv * HEAD_DIM
    }

    fn theta_scale(&self) -> f32 {
        self.info.rope_base_swa.powf(-2.0 / self.info.n_rot as f32)
    }

    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        &self,
        l: &Layer,
        il: usize,
        t: usize,
        ld: usize,
        q_h: u64,
        slot: i32,
    ) -> Result<()> {
        let i = &self.info;
        self.gpu.launch(
            "qk_norm_rope_store",
            (t as u32, (i.n_head + 2 * i.n_head_kv) as u32, 1),
            32,
            &[
                Arg::P(self.s.y_qkvg.ptr()),
                Arg::L(ld as i64),
                Arg::I(i.n_head as i32),
                Arg::I(i.n_head_kv as i32),
                Arg::P(l.q_norm.ptr()),
                Arg::P(l.k_norm.ptr()),
                Arg::F(i.rms_eps),
                Arg::P(self.s.pos.ptr()),
                Arg::I(i.is_swa[il] as i32),
                Arg::F(self.theta_scale()),
                Arg::P(0),
                Arg::P(q_h),
                Arg::I(t as i32),
                Arg::P(l.k_cache),
                Arg::P(l.v_cache),
                Arg::L(self.slot_stride(l) as i64),
                Arg::P(self.s.slots.ptr()),
                Arg::I(slot),
                Arg::I(l.ring as i32),
            ],
        )
    }

    /// `attn_combine_gate`: merges the attention splits of layer `il`, applies the sigmoid gate
    /// and quantizes into the GEMV activations. `kmin` is the fewest keys per split the
    /// attention kernel took.
    fn combine_gate(&self, il: usize, nb: usize, splits: usize, kmin: usize) -> Result<()> {
        let i = &self.info;
        let s = &self.s;
        let qa = self.qact();
        let (nq, nkv) = (i.n_head, i.n_head_kv);
        let qw = nq * HEAD_DIM;
        let ld = 2 * qw + 2 * nkv * HEAD_DIM;
        self.gpu.launch(
            "attn_combine_gate",
            (nq as u32, nb as u32, 1),
            128,
            &[
                Arg::P(s.part.ptr()),
                Arg::I(nq as i32),
                Arg::I(splits as i32),
                Arg::I(kmin as i32),
                Arg::P(s.pos.ptr()),
                Arg::I(self.window(il)),
                Arg::P(s.y_qkvg.at(4 * (qw + 2 * nkv * HEAD_DIM))),
                Arg::L(ld as i64),
                Arg::P(s.hf.ptr()),
                Arg::P(qa.q),
                Arg::P(qa.d),
                Arg::P(qa.s),
            ],
        )
    }

    fn kind(&self, il: usize) -> LayerKind {
        if self.info.is_swa[il] {
            LayerKind::Sliding
        } else {
            LayerKind::Full
        }
    }

    fn window(&self, il: usize) -> i32 {
        if self.info.is_swa[il] {
            self.info.n_swa as i32
        } else {
            0
        }
    }

    /// Sets how sequence `seq` picks its tokens from the next decode step on (None: greedy).
    /// A captured decode graph keeps the kernel it was captured with (greedy argmax, or the
    /// sampler once any sequence samples), so capture after choosing; the parameters
    /// themselves live in device memory and may change between replays.
    pub fn set_sampling(&self, seq: usize, s: Option<Sampling>) -> Result<()> {
        if seq >= self.opts.n_seq {
            return Err(CudaError::Shape(format!(
                "sequence {seq} of {}",
                self.opts.n_seq
            )));
        }
        if let Some(s) = s {
            if !s.temp.is_finite() {
                return Err(CudaError::Shape(format!("sampling temperature {}", s.temp)));
            }
        }
        self.gpu
            .upload(&self.s.sample, 16 * seq, &sample_params(s))?;
        self.sampling.lock().unwrap_or_else(|e| e.into_inner())[seq] = s;
        Ok(())
    }

    fn samples(&self) -> bool {
        self.sampling
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|s| s.is_some_and(|s| s.temp > 0.0 && s.top_k != 1))
    }

    fn finish_logits(&self, nb: usize, advance: bool) -> Result<()> {
        let sample = self.samples();
        let mut args = vec![
            Arg::P(self.s.logits.ptr()),
            Arg::L(self.info.n_vocab as i64),
            Arg::F(self.logit_scale),
            Arg::F(self.info.softcap),
        ];
        if sample {
            args.push(Arg::P(self.s.sample.ptr()));
        }
        args.extend([
            Arg::P(self.s.tokens.ptr()),
            Arg::P(self.s.pos.ptr()),
            Arg::P(self.s.history.ptr()),
            Arg::I(self.opts.n_ctx as i32 + 1),
            Arg::I(advance as i32),
        ]);
        if sample {
            return self
                .gpu
                .launch("logits_sample", (nb as u32, 1, 1), 1024, &args);
        }
        let (blocks, block) = self.plan.argmax;
        let ns = self.opts.n_seq;
        args.extend([
            Arg::P(self.s.argmax_part.ptr()),
            Arg::P(self.s.argmax_part.at(4 * ns * MAX_ARGMAX_BLOCKS)),
            Arg::P(self.s.argmax_cnt.ptr()),
        ]);
        self.gpu
            .launch("logits_argmax", (blocks, nb as u32, 1), block, &args)
    }

    fn check_pos(&self, pos: usize, n: usize) -> Result<()> {
        if pos + n > self.opts.n_ctx {
            return Err(CudaError::Shape(format!(
                "positions {pos}..{} exceed the KV cache of {} positions",
                pos + n,
                self.opts.n_ctx
            )));
        }
        Ok(())
    }

    /// The last decode step's tokens (rows `0..out.len()`): the argmax of each row's logits,
    /// or the sampled token with sampling set.
    pub(super) fn download_tokens(&self, out: &mut [i32]) -> Result<()> {
        if out.len() > self.opts.n_seq {
            return Err(CudaError::Shape(format!("{} token rows", out.len())));
        }
        self.gpu.download(self.s.tokens.ptr(), out)
    }

    fn read_logits(&self) -> Result<(Vec<f32>, u32)> {
        let mut logits = vec![0f32; self.info.n_vocab];
        self.gpu.download(self.s.logits.ptr(), &mut logits)?;
        let mut tok = [0i32];
        self.gpu.download(self.s.tokens.ptr(), &mut tok)?;
        Ok((logits, tok[0] as u32))
    }

    /// Waits for the GPU.
    pub fn sync(&self) -> Result<()> {
        self.gpu.sync()
    }
}
