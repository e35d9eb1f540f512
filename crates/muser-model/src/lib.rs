//! Model hyperparameters and forward passes, the KV cache pool, and the backend they run on.
//!
//! - [`Model::load`] maps a GGUF file (weights stay in the map), reads its geometry
//!   ([`ModelInfo`]) and binds the architecture's tensors (`models/muse_glimmer.rs`,
//!   `models/llama.rs`).
//! - [`Model::new_kv`] sizes a [`KvCache`] pool once: `n_seq` sequences of `n_ctx` positions.
//! - [`Model::forward`] runs a [`Batch`] (any mix of sequences, prefill chunks and decode
//!   tokens) and returns logits for the rows that asked for them.
//! - [`Model::with_fused`] puts a device's own whole-model forward pass ([`FusedForward`])
//!   behind the same face: the engine, the server and kvpack use it unchanged.
//!
//! Numerics follow llama.cpp b11434's CPU backend with its defaults (flash attention on, F16
//! KV cache, no weight repacking), so greedy decoding matches it token for token; see
//! `tests/parity.rs` and `scripts/goldens.sh`.

pub mod backend;
mod batch;
pub mod cpu;
mod error;
mod executor;
mod fused;
mod info;
pub mod kv;
mod logits;
pub mod models;
pub mod synth;
#[cfg(test)]
mod tests;
mod validate;

pub use backend::{AttnInput, Backend, RopeMode, Weight};
pub use batch::{Batch, InputEmbd, Output};
pub use cpu::numerics::{FlashAttn, Numerics, NumericsMode, Order};
pub use cpu::CpuBackend;
pub use error::ModelError;
pub use fused::{FusedForward, FusedOutput};
pub use info::{Arch, ModelInfo};
pub use kv::{HostKv, KvCache, KvLayout, KvMark, KvSnapshot, KvStore, KvType, LayerKv, Placement};
pub use logits::argmax_logits;

use executor::{Executor, Net, On};
use fused::Fused;
use models::{llama::Llama, muse_glimmer::MuseGlimmer, Capture, Tensors};
use muser_gguf::GgufFile;
use std::path::Path;

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Compute threads; 0 = one per core.
    pub threads: usize,
    /// The CPU backend's numerics profile ([`Numerics::resolve`]); portable by default.
    pub numerics: Numerics,
}

/// A loaded model, ready to run batches on its backend (the CPU unless loaded with
/// [`Model::load_with`]).
pub struct Model {
    gguf: GgufFile,
    info: ModelInfo,
    net: Net,
    exec: Box<dyn Executor>,
}

/// Default largest batch per forward pass (llama.cpp's default `n_ubatch`).
pub const DEFAULT_UBATCH: u32 = 512;

impl Model {
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Model, ModelError> {
        let gguf = GgufFile::open(path).map_err(|source| ModelError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Model::from_gguf(gguf, opts)
    }

    /// A model over an already opened file, on the CPU backend.
    pub fn from_gguf(gguf: GgufFile, opts: &LoadOptions) -> Result<Model, ModelError> {
        Model::from_gguf_with(
            gguf,
            CpuBackend::with_numerics(opts.threads, opts.numerics)?,
        )
    }

    /// [`Model::load`] onto `backend`.
    pub fn load_with<B: Backend + 'static>(path: &Path, backend: B) -> Result<Model, ModelError> {
        let gguf = GgufFile::open(path).map_err(|source| ModelError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Model::from_gguf_with(gguf, backend)
    }

    /// [`Model::from_gguf`] onto `backend`: every weight matrix is handed to
    /// [`Backend::prepare_weight`] once here.
    pub fn from_gguf_with<B: Backend + 'static>(
        gguf: GgufFile,
        backend: B,
    ) -> Result<Model, ModelError> {
        Model::with_executor(gguf, Box::new(On(backend)))
    }

    /// A model over `gguf` whose forward passes `fused` runs whole. The file's tensors are
    /// still bound (and checked) as for any backend; its caches place cells by position.
    pub fn with_fused(gguf: GgufFile, fused: Box<dyn FusedForward>) -> Result<Model, ModelError> {
        Model::with_executor(gguf, Box::new(Fused(fused)))
    }

    fn with_executor(gguf: GgufFile, exec: Box<dyn Executor>) -> Result<Model, ModelError> {
        let info = ModelInfo::from_gguf(&gguf, gguf.file_len())?;
        let supports = |ty| exec.supports(ty);
        let t = Tensors::new(&gguf, &supports);
        let net = match info.arch {
            Arch::MuseGlimmer => Net::MuseGlimmer(MuseGlimmer::load(&t, &info)?),
            Arch::Llama => Net::Llama(Llama::load(&t, &info)?),
        };
        let mut seen = std::collections::HashSet::new();
        for w in t.mats.borrow().iter() {
            let w = w.view(&gguf);
            if seen.insert(w.name.to_string()) {
                exec.prepare_weight(&w)?;
            }
        }
        drop(t);
        Ok(Model {
            gguf,
            info,
            net,
            exec,
        })
    }

    /// The embedding table and output matrix (in the file's memory map, whatever the
    /// backend) that a DFlash drafter without its own borrows.
    pub fn head(&self) -> models::Head {
        match &self.net {
            Net::MuseGlimmer(m) => m.head(),
            Net::Llama(m) => m.head(),
        }
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.gguf
    }

    /// Bytes of weights one single-token forward pass reads from the file: every matrix once,
    /// and of the token embedding one row (all of it when it doubles as the output matrix).
    pub fn decode_weight_bytes(&self) -> u64 {
        let tied = self.gguf.tensor("output.weight").is_none();
        self.gguf
            .tensors()
            .iter()
            .map(|t| {
                let rows = t.dims.get(1).copied().unwrap_or(1).max(1);
                if t.name == "token_embd.weight" && !tied {
                    t.size as u64 / rows
                } else {
                    t.size as u64
                }
            })
            .sum()
    }

    /// Whether batches may ask for rows computed alone ([`Batch::lone_seqs`]): true on the CPU
    /// backend, false on a device (its multi-row batches run the prefill kernels).
    pub fn computes_rows_alone(&self) -> bool {
        self.exec.computes_rows_alone()
    }

    /// Compute threads in use.
    pub fn threads(&self) -> usize {
        self.exec.threads()
    }

    /// The numerics profile the forward pass computes in (`ggml-b11434/x86-avx512/fa-on` on the
    /// CPU backend), or `None` on a backend that reproduces none of llama.cpp's CPU orders.
    /// Part of a KV pack's identity: a pack computed under one order must not resume under
    /// another.
    pub fn numerics_tag(&self) -> Option<String> {
        self.exec.numerics_tag()
    }

    /// Names the numerics that fill this model's caches of element type `kv_type`: the
    /// executor's tag ([`Backend::numerics`], [`FusedForward::numerics`]) and the K/V type.
    /// A kvpack identity carries it as `engine_abi`, so a cache computed by other numerics is
    /// never resumed as this model's own.
    pub fn engine_abi(&self, kv_type: KvType) -> String {
        format!("muser-{}-{}-v1", self.exec.numerics(), kv_type.name())
    }

    /// The cache layout this model needs for element type `dtype`.
    pub fn kv_layout(&self, dtype: KvType) -> KvLayout {
        let i = &self.info;
        KvLayout {
            n_layer: i.n_layer,
            is_swa: i.is_swa.clone(),
            n_head_kv: i.n_head_kv,
            head_dim: i.head_dim,
            n_swa: i.n_swa,
            dtype,
        }
    }

    /// A KV pool for `n_seq` sequences of `n_ctx_per_seq` positions, for batches of up to
    /// [`DEFAULT_UBATCH`] tokens.
    pub fn new_kv(
        &self,
        n_ctx_per_seq: usize,
        n_seq: usize,
        kv_type: KvType,
    ) -> Result<KvCache, ModelError> {
        self.new_kv_ubatch(n_ctx_per_seq, n_seq, kv_type, DEFAULT_UBATCH)
    }

    /// [`Model::new_kv`] with an explicit largest batch size.
    pub fn new_kv_ubatch(
        &self,
        n_ctx_per_seq: usize,
        n_seq: usize,
        kv_type: KvType,
        n_ubatch: u32,
    ) -> Result<KvCache, ModelError> {
        let n_ctx = u32::try_from(n_ctx_per_seq)
            .map_err(|_| ModelError::Kv(format!("n_ctx {n_ctx_per_seq} too large")))?;
        Ok(KvCache::with_store(
            self.kv_layout(kv_type),
            n_ctx,
            n_seq,
            n_ubatch,
            |l, c, n| self.exec.new_kv_store(l, c, n),
        )?
        .with_placement(self.exec.placement()))
    }

    /// Run a batch, writing its K/V into `kv`.
    pub fn forward(&self, kv: &mut KvCache, batch: &Batch) -> Result<Output, ModelError> {
        let prep = self.prepare(kv, batch)?;
        let mut cap = Capture::new(&batch.capture_layers, self.info.n_layer);
        let a = self.exec.forward(
            &self.net, &self.gguf, &self.info, kv, &prep, batch, &mut cap,
        )?;
        self.check_answer(batch, &prep.out_rows, &a)?;
        Ok(Output {
            logits: a.logits,
            embeddings: a.hidden,
            rows: a.rows,
            argmax: a.argmax,
            layer_inp: cap.into_rows(batch.len(), self.info.n_embd),
        })
    }
}
