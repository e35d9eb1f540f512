//! The fused forward as muser-model's [`FusedForward`], so that the engine, the server and
//! kvpack run Muse Glimmer through [`CudaGlimmer`]'s kernels.
//!
//! The K/V rows live in a [`CudaKv`] (the CUDA backend's store: per layer
//! `[n_seq][cells][n_head_kv · 128]` f16), which the engine's `KvCache` owns and places by
//! position, so the kernels' row addressing (position p in row p, or p % ring on a sliding
//! layer) holds for every cell the cache hands out, and kvpack export/import read and write
//! the same rows. A batch runs as:
//! - each sequence with two or more tokens, or with a row given as an embedding (an image's
//!   row, `Batch::input_embd`): prefill chunks (`enqueue_prefill_seq`, the embedding rows
//!   copied over the gathered token rows) with its output rows' logits computed from the
//!   chunk's final residual;
//! - the other sequences with one token: decode steps of up to `MAX_GEMV_BATCH` rows, each a
//!   replay of a graph captured (once per row count) over a slot table in device memory. The
//!   graph ends with each row's argmax (`logits_argmax`), so a row the batch marks
//!   `argmax_only` comes back as that token (4 bytes) instead of its logits.

use std::sync::{Arc, Mutex};

use muser_gguf::GgufFile;
use muser_model::{
    Batch, FusedForward, FusedOutput, InputEmbd, KvCache, KvLayout, KvStore, ModelError,
};

use super::{CudaGlimmer, DecodeGraph, GpuOptions, HEAD_DIM};
use crate::backend::CudaKv;
use crate::layout::MAX_GEMV_BATCH;
use crate::runtime::Gpu;
use crate::CudaError;

/// Largest prefill chunk the fused forward runs at once (longer runs of one sequence in a
/// batch are split).
pub const FUSED_MAX_CHUNK: usize = 2048;

/// Muse Glimmer's fused CUDA forward behind `muser_model::Model::with_fused`.
pub struct FusedGlimmer {
    gpu: Arc<Gpu>,
    st: Mutex<State>,
}

struct State {
    m: CudaGlimmer,
    /// The cache the model is bound to: its K buffers, cells per layer, sequences, positions.
    bound: Option<(Vec<u64>, Vec<usize>, usize, u32)>,
    /// Captured decode steps, index `rows - 1`.
    graphs: Vec<Option<DecodeGraph>>,
    /// The slot table as last uploaded (decode row b's sequence).
    slots: Vec<u32>,
}

// SAFETY: the only non-Send parts are the graphs' driver handles. cudarc's `CudaGraph`
// binds its context to the calling thread before launching or destroying them, and the state
// is reached only through the mutex, so one thread at a time uses them.
unsafe impl Send for State {}

impl FusedGlimmer {
    /// Uploads the weights of a muse-glimmer file to `gpu` (no cache yet: the engine's
    /// `Model::new_kv` makes one through [`FusedForward::new_kv_store`]).
    pub fn load(gpu: Gpu, g: &GgufFile) -> Result<FusedGlimmer, CudaError> {
        let gpu = Arc::new(gpu);
        let opts = GpuOptions {
            n_ctx: 4096,
            max_chunk: FUSED_MAX_CHUNK,
            n_seq: 1,
            swa_ring: true,
        };
        let m = CudaGlimmer::load_shared(gpu.clone(), g, opts, false)?;
        Ok(FusedGlimmer {
            gpu,
            st: Mutex::new(State {
                m,
                bound: None,
                graphs: Vec::new(),
                slots: Vec::new(),
            }),
        })
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Bytes of weights one decode step reads.
    pub fn decode_weight_bytes(&self) -> usize {
        self.lock().m.decode_weight_bytes()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Where a forward pass's outputs go: the rows whose logits are asked for (batch indices,
/// ascending), their logits and hidden states, which are written, and the rows answered by
/// their argmax (batch indices in `by_argmax`, ascending; tokens in `argmax`).
struct Outputs {
    rows: Vec<usize>,
    logits: Vec<f32>,
    hidden: Vec<f32>,
    done: Vec<bool>,
    vocab: usize,
    embd: usize,
    by_argmax: Vec<usize>,
    argmax: Vec<(usize, u32)>,
}

impl Outputs {
    /// Copies device output rows to the places of their batch indices (`(row, batch index)`
    /// pairs; rows not asked for are skipped), one transfer per run of consecutive rows.
    fn take(&mut self, m: &CudaGlimmer, rows: &[(usize, usize)]) -> Result<(), ModelError> {
        let pairs = rows
            .iter()
            .filter_map(|&(j, i)| self.rows.binary_search(&i).ok().map(|k| (j, k)));
        let (v, e) = (self.vocab, self.embd);
        for (j, k, n) in muser_model::kv::runs(pairs) {
            let hidden = (!self.hidden.is_empty()).then(|| &mut self.hidden[k * e..(k + n) * e]);
            m.download_outputs(j, n, &mut self.logits[k * v..(k + n) * v], hidden)?;
            self.done[k..k + n].fill(true);
        }
        Ok(())
    }
}

impl State {
    /// Binds the model to `kv`'s rows unless it already is.
    fn bind(&mut self, kv: &KvCache) -> Result<(), ModelError> {
        let store = cuda_kv(kv)?;
        let n_layer = kv.layout().n_layer;
        let mut k = Vec::with_capacity(n_layer);
        let mut v = Vec::with_capacity(n_layer);
        let mut cells = Vec::with_capacity(n_layer);
        for il in 0..n_layer {
            let (kp, vp) = store
                .layer_ptrs(il)
                .ok_or_else(|| ModelError::Device(format!("the KV store lacks layer {il}")))?;
            k.push(kp);
            v.push(vp);
            cells.push(kv.cell_pos(0, il).len());
        }
        let key = (k.clone(), cells.clone(), kv.n_seq(), kv.n_ctx());
        if self.bound.as_ref() == Some(&key) {
            return Ok(());
        }
        self.graphs.clear();
        self.bound = None;
        self.slots.clear();
        self.m
            .bind_kv(&k, &v, &cells, kv.n_seq(), kv.n_ctx() as usize)?;
        self.bound = Some(key);
        Ok(())
    }

    /// Prefill of one sequence's tokens (`idx`, batch indices in position order), with the
    /// outputs of the rows that want them.
    fn prefill(
        &mut self,
        batch: &Batch,
        seq: u32,
        idx: &[usize],
        out: &mut Outputs,
    ) -> Result<(), ModelError> {
        let max_rows = self.m.opts.n_seq;
        let (e, ie) = (self.m.info.n_embd, &batch.input_embd);
        for chunk in idx.chunks(self.m.opts.max_chunk) {
            let tokens: Vec<u32> = chunk.iter().map(|&i| batch.tokens[i]).collect();
            let p0 = batch.pos[chunk[0]] as usize;
            // the chunk's embedding rows, chunk-relative
            let mut embd = InputEmbd::default();
            for (k, &i) in chunk.iter().enumerate() {
                if let Ok(j) = ie.rows.binary_search(&i) {
                    embd.rows.push(k);
                    embd.values
                        .extend_from_slice(&ie.values[j * e..(j + 1) * e]);
                }
            }
            self.m
                .enqueue_prefill_seq(&tokens, p0, seq as usize, false, &embd)?;
            // Runs of consecutive wanted rows, at most `max_rows` at once.
            let wanted: Vec<usize> = (0..chunk.len())
                .filter(|&k| batch.logits[chunk[k]])
                .collect();
            let mut k = 0;
            while k < wanted.len() {
                let mut end = k + 1;
                while end < wanted.len() && wanted[end] == wanted[end - 1] + 1 && end - k < max_rows
                {
                    end += 1;
                }
                let rows = wanted[k]..wanted[end - 1] + 1;
                self.m.chunk_outputs(rows.clone())?;
                let taken: Vec<(usize, usize)> =
                    rows.enumerate().map(|(j, r)| (j, chunk[r])).collect();
                out.take(&self.m, &taken)?;
                k = end;
            }
        }
        Ok(())
    }

    /// One decode step for `rows` (batch index, sequence), at most `MAX_GEMV_BATCH`.
    fn decode(
        &mut self,
        batch: &Batch,
        rows: &[(usize, u32)],
        out: &mut Outputs,
    ) -> Result<(), ModelError> {
        let nb = rows.len();
        let tokens: Vec<u32> = rows.iter().map(|&(i, _)| batch.tokens[i]).collect();
        let pos: Vec<usize> = rows.iter().map(|&(i, _)| batch.pos[i] as usize).collect();
        let seqs: Vec<u32> = rows.iter().map(|&(_, s)| s).collect();
        let m = &self.m;
        let latest = m.upload_step(&tokens, &pos)?;
        // The slot table changes only when the set of decoding sequences does.
        if !self.slots.starts_with(&seqs) {
            m.set_decode_slots(&seqs)?;
            self.slots = seqs;
        }
        if self.graphs.len() < nb {
            self.graphs.resize_with(nb, || None);
        }
        if self.graphs[nb - 1].is_none() {
            self.graphs[nb - 1] = Some(self.m.capture_steps(nb, false)?);
        }
        if let Some(g) = &self.graphs[nb - 1] {
            g.replay(latest)?;
        }
        let taken: Vec<(usize, usize)> =
            rows.iter().enumerate().map(|(j, &(i, _))| (j, i)).collect();
        if rows
            .iter()
            .any(|(i, _)| out.by_argmax.binary_search(i).is_ok())
        {
            // The step's greedy tokens (the graph's last kernel); a row with no finite logit
            // has none (the host's rule gives token 0 then).
            let mut tok = vec![0i32; nb];
            self.m.download_tokens(&mut tok)?;
            for (j, &(i, _)) in rows.iter().enumerate() {
                if out.by_argmax.binary_search(&i).is_ok() {
                    let t = u32::try_from(tok[j])
                        .ok()
                        .filter(|&t| (t as usize) < out.vocab);
                    out.argmax.push((i, t.unwrap_or(0)));
                }
            }
        }
        out.take(&self.m, &taken)
    }
}

/// `kv`'s rows as the CUDA store they must be.
fn cuda_kv(kv: &KvCache) -> Result<&CudaKv, ModelError> {
    kv.store()
        .as_any()
        .downcast_ref::<CudaKv>()
        .ok_or_else(|| ModelError::Device("the KV cache was not made by a CUDA model".into()))
}

impl FusedForward for FusedGlimmer {
    fn numerics(&self) -> String {
        "cuda-fused".to_string()
    }

    fn forward(
        &self,
        kv: &mut KvCache,
        batch: &Batch,
        groups: &[(u32, Vec<usize>)],
        out_rows: &[usize],
    ) -> Result<FusedOutput, ModelError> {
        let mut st = self.lock();
        st.bind(kv)?;
        let (vocab, embd) = (st.m.info.n_vocab, st.m.info.n_embd);
        // Decode rows that want only their argmax, when the graph's last kernel takes it.
        let greedy_graph = !st.m.samples();
        // a sequence's lone row is a decode step unless it is given as an embedding
        let decodes = |i: usize| batch.input_embd.rows.binary_search(&i).is_err();
        let mut by_argmax: Vec<usize> = groups
            .iter()
            .filter_map(|(_, idx)| match idx[..] {
                [i] if greedy_graph
                    && decodes(i)
                    && batch.argmax_only.get(i).copied().unwrap_or(false) =>
                {
                    Some(i)
                }
                _ => None,
            })
            .collect();
        by_argmax.sort_unstable();
        let rows: Vec<usize> = out_rows
            .iter()
            .copied()
            .filter(|i| by_argmax.binary_search(i).is_err())
            .collect();
        let n = rows.len();
        let mut out = Outputs {
            rows,
            logits: vec![0f32; n * vocab],
            hidden: if batch.embeddings {
                vec![0f32; n * embd]
            } else {
                Vec::new()
            },
            done: vec![false; n],
            vocab,
            embd,
            by_argmax,
            argmax: Vec::new(),
        };
        let mut single = Vec::new();
        for (seq, idx) in groups {
            match idx[..] {
                [i] if decodes(i) => single.push((i, *seq)),
                _ => st.prefill(batch, *seq, idx, &mut out)?,
            }
        }
        for rows in single.chunks(MAX_GEMV_BATCH.min(st.m.opts.n_seq)) {
            st.decode(batch, rows, &mut out)?;
        }
        if out.done.contains(&false) || out.argmax.len() != out.by_argmax.len() {
            return Err(ModelError::Device(
                "the fused forward left output rows unwritten".into(),
            ));
        }
        out.argmax.sort_unstable();
        Ok(FusedOutput {
            logits: out.logits,
            hidden: out.hidden,
            rows: out.rows,
            argmax: out.argmax,
        })
    }

    fn accepts(&self, kv: &KvCache) -> Result<(), ModelError> {
        cuda_kv(kv).map(drop)
    }

    fn takes_input_embd(&self) -> bool {
        true
    }

    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError> {
        if layout.head_dim != HEAD_DIM {
            return Err(ModelError::Device(format!(
                "head_dim {} (the fused kernels need {HEAD_DIM})",
                layout.head_dim
            )));
        }
        let mut st = self.lock();
        st.bound = None;
        st.graphs.clear();
        st.slots.clear();
        Ok(Box::new(CudaKv::new(
            self.gpu.clone(),
            layout,
            cells,
            n_seq,
        )?))
    }
}
