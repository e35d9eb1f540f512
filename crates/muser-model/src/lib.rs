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
pub mod cpu;
mod error;
mod info;
pub mod kv;
mod logits;
pub mod models;
pub mod synth;

pub use backend::{AttnInput, Backend, RopeMode, Weight};
pub use cpu::numerics::{FlashAttn, Numerics, NumericsMode, Order};
pub use cpu::CpuBackend;
pub use error::ModelError;
pub use info::{Arch, ModelInfo};
pub use kv::{HostKv, KvCache, KvLayout, KvMark, KvSnapshot, KvStore, KvType, LayerKv, Placement};
pub use logits::argmax_logits;

use models::{llama::Llama, muse_glimmer::MuseGlimmer, Capture, Prepared, Tensors};
use muser_gguf::{GgmlType, GgufFile};
use std::path::Path;

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Compute threads; 0 = one per core.
    pub threads: usize,
    /// The CPU backend's numerics profile ([`Numerics::resolve`]); portable by default.
    pub numerics: Numerics,
}

/// Tokens to run through the model: token `i` of sequence `seq[i]` at position `pos[i]`; its
/// logits are returned when `logits[i]`. Within a sequence, positions must continue the cache
/// (`kv.seq_len(seq)`, `+1`, ...) in batch order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub pos: Vec<u32>,
    pub seq: Vec<u32>,
    pub logits: Vec<bool>,
    /// Also return the final-norm hidden state of the output rows.
    pub embeddings: bool,
    /// Empty, or per token: the caller needs only the argmax of this output row (the highest
    /// logit, the lowest id on a tie, NaN as -inf). A forward pass may then answer the row with
    /// that token in [`Output::argmax`] instead of its logits (the fused CUDA decode step
    /// does: its graph already takes the argmax, so 4 bytes cross instead of the whole row);
    /// others return the logits as usual.
    pub argmax_only: Vec<bool>,
    /// Rows given as embeddings instead of token embeddings (an image's rows).
    pub input_embd: InputEmbd,
    /// Sequences whose rows are each computed as a one-row batch at the same position
    /// computes it (the kernels a lone row takes, its view of the cache), so that their logits
    /// and K/V equal one-token steps bit for bit whatever else the batch holds: speculative
    /// verification. Only where [`Model::computes_rows_alone`]; a batch asking elsewhere is
    /// refused.
    pub lone_seqs: Vec<u32>,
    /// Layers whose input (the residual stream entering the layer, llama.cpp's
    /// `t_layer_inp`) to return for every row of the batch, in this order
    /// ([`Output::layer_inp`]): the target features a DFlash drafter reads. Empty: nothing is
    /// copied.
    pub capture_layers: Vec<u32>,
}

/// Batch rows whose input is an embedding (`n_embd` values each, e.g. an image encoder's
/// output) rather than their token's row of the embedding table; their token ids are ignored.
/// The architecture treats the row as it treats a token embedding from there on (Muse
/// Glimmer RMS-normalizes it, as llama.cpp does for multimodal rows).
#[derive(Clone, Debug, Default)]
pub struct InputEmbd {
    /// Batch rows, ascending.
    pub rows: Vec<usize>,
    /// `rows.len() × n_embd` values, row by row.
    pub values: Vec<f32>,
}

impl InputEmbd {
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// Equal when the same rows hold the same bits.
impl PartialEq for InputEmbd {
    fn eq(&self, other: &InputEmbd) -> bool {
        self.rows == other.rows
            && self.values.len() == other.values.len()
            && self
                .values
                .iter()
                .zip(&other.values)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

impl Eq for InputEmbd {}

impl Batch {
    /// `tokens` of one sequence starting at `start_pos`; logits for every token, or only the
    /// last when `last_logits_only`.
    pub fn single(seq: u32, tokens: &[u32], start_pos: u32, last_logits_only: bool) -> Batch {
        let n = tokens.len();
        Batch {
            tokens: tokens.to_vec(),
            pos: (0..n as u32).map(|i| start_pos + i).collect(),
            seq: vec![seq; n],
            logits: (0..n).map(|i| !last_logits_only || i + 1 == n).collect(),
            embeddings: false,
            argmax_only: Vec::new(),
            input_embd: InputEmbd::default(),
            lone_seqs: Vec::new(),
            capture_layers: Vec::new(),
        }
    }

    /// Append one token.
    pub fn push(&mut self, token: u32, pos: u32, seq: u32, logits: bool) {
        self.tokens.push(token);
        self.pos.push(pos);
        self.seq.push(seq);
        self.logits.push(logits);
        if !self.argmax_only.is_empty() {
            self.argmax_only.push(false);
        }
    }

    /// Append one token whose output the caller needs only as its argmax
    /// ([`Batch::argmax_only`]).
    pub fn push_argmax(&mut self, token: u32, pos: u32, seq: u32) {
        self.push(token, pos, seq, true);
        self.argmax_only.resize(self.tokens.len(), false);
        if let Some(last) = self.argmax_only.last_mut() {
            *last = true;
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Results of a forward pass, one row per batch entry with `logits[i] == true`, in batch order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Output {
    /// `n_out × n_vocab`.
    pub logits: Vec<f32>,
    /// `n_out × n_embd` when the batch asked for embeddings, else empty.
    pub embeddings: Vec<f32>,
    /// Batch indices of the rows, in order.
    pub rows: Vec<usize>,
    /// (batch index, token) of the output rows answered by their argmax instead of logits
    /// (only rows marked in [`Batch::argmax_only`]; they are not in `rows`).
    pub argmax: Vec<(usize, u32)>,
    /// `n_tokens × capture_layers.len() × n_embd`: for every batch row (output or not), the
    /// inputs of [`Batch::capture_layers`] side by side.
    pub layer_inp: Vec<f32>,
}

/// What a whole forward pass returns ([`FusedForward::forward`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FusedOutput {
    /// `rows.len() × n_vocab`.
    pub logits: Vec<f32>,
    /// `rows.len() × n_embd` when the batch asked for embeddings, else empty.
    pub hidden: Vec<f32>,
    /// Batch indices of the logits rows, ascending.
    pub rows: Vec<usize>,
    /// (batch index, token) of the output rows answered by their argmax instead; the batch's
    /// output rows are exactly `rows` and these.
    pub argmax: Vec<(usize, u32)>,
}

impl Output {
    /// Logits of output row `r`.
    pub fn row(&self, r: usize, n_vocab: usize) -> &[f32] {
        &self.logits[r * n_vocab..(r + 1) * n_vocab]
    }
}

/// A device that runs a model's whole forward pass itself (fused kernels) instead of the model
/// files op by op on a [`Backend`]. [`Model::with_fused`] validates every batch and places its
/// K/V cells (by position: [`Placement::Positional`]) before calling it, so an implementation
/// sees only well-formed batches whose positions continue their sequences.
pub trait FusedForward: Send + Sync {
    /// Runs `batch` with its K/V rows in `kv` (made by [`FusedForward::new_kv_store`]).
    /// `groups` lists per sequence its batch indices in position order; returns the logits of
    /// `out_rows` and, when `batch.embeddings`, their final-norm hidden states, on the host;
    /// rows marked in `batch.argmax_only` may come back as their argmax token instead.
    fn forward(
        &self,
        kv: &mut KvCache,
        batch: &Batch,
        groups: &[(u32, Vec<usize>)],
        out_rows: &[usize],
    ) -> Result<FusedOutput, ModelError>;

    /// Storage for the K/V rows of a pool (as [`Backend::new_kv_store`]).
    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError>;

    /// Whether `kv` can run here (its rows in a store this forward made), checked before a
    /// batch changes anything.
    fn accepts(&self, kv: &KvCache) -> Result<(), ModelError>;

    /// Names the numerics of this forward ([`Backend::numerics`]).
    fn numerics(&self) -> String;

    /// Whether [`FusedForward::forward`] takes rows given as embeddings
    /// ([`Batch::input_embd`]: an image's rows); a batch with them is refused where not.
    fn takes_input_embd(&self) -> bool {
        false
    }
}

enum Net {
    MuseGlimmer(MuseGlimmer),
    Llama(Llama),
}

/// A backend with the model code bound to it, behind an object-safe face so that [`Model`]
/// holds any backend. [`On`] implements it for every [`Backend`] by calling the same model
/// files with that backend.
trait Executor: Send + Sync {
    /// Runs a validated batch; returns the logits and (when asked) the final hidden states of
    /// the output rows, on the host (some `argmax_only` rows possibly as their argmax), and
    /// fills `cap` with the layer inputs the batch asked for.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        net: &Net,
        g: &GgufFile,
        info: &ModelInfo,
        kv: &mut KvCache,
        prep: &Prepared,
        batch: &Batch,
        cap: &mut Capture,
    ) -> Result<FusedOutput, ModelError>;
    fn threads(&self) -> usize;
    /// See [`Backend::numerics_tag`].
    fn numerics_tag(&self) -> Option<String> {
        None
    }
    fn numerics(&self) -> String;
    fn supports(&self, ty: GgmlType) -> bool;
    /// See [`Backend::computes_rows_alone`].
    fn computes_rows_alone(&self) -> bool {
        false
    }
    /// Whether batches may give rows as embeddings ([`Batch::input_embd`]); the model files
    /// take them on every backend.
    fn takes_input_embd(&self) -> bool {
        true
    }
    fn prepare_weight(&self, w: &Weight) -> Result<(), ModelError>;
    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError>;
    /// How caches for this executor place cells.
    fn placement(&self) -> Placement {
        Placement::LlamaCpp
    }
    /// Refuses a cache this executor cannot run (before anything is placed).
    fn accepts(&self, _kv: &KvCache) -> Result<(), ModelError> {
        Ok(())
    }
}

/// A [`FusedForward`] as an executor: the model files are not run.
struct Fused(Box<dyn FusedForward>);

impl Executor for Fused {
    fn forward(
        &self,
        _net: &Net,
        _g: &GgufFile,
        _info: &ModelInfo,
        kv: &mut KvCache,
        prep: &Prepared,
        batch: &Batch,
        _cap: &mut Capture,
    ) -> Result<FusedOutput, ModelError> {
        if !batch.capture_layers.is_empty() {
            return Err(ModelError::BadBatch(
                "layer inputs (a DFlash drafter's features) are captured on the op-by-op \
                 backends only"
                    .into(),
            ));
        }
        self.0.forward(kv, batch, &prep.groups, &prep.out_rows)
    }

    fn threads(&self) -> usize {
        1
    }

    fn takes_input_embd(&self) -> bool {
        self.0.takes_input_embd()
    }

    fn numerics(&self) -> String {
        self.0.numerics()
    }

    fn supports(&self, _ty: GgmlType) -> bool {
        true
    }

    fn prepare_weight(&self, _w: &Weight) -> Result<(), ModelError> {
        Ok(())
    }

    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError> {
        self.0.new_kv_store(layout, cells, n_seq)
    }

    fn placement(&self) -> Placement {
        Placement::Positional
    }

    fn accepts(&self, kv: &KvCache) -> Result<(), ModelError> {
        if kv.placement() != Placement::Positional {
            return Err(ModelError::BadBatch(
                "this model runs on caches that place cells by position (Model::new_kv)".into(),
            ));
        }
        self.0.accepts(kv)
    }
}

/// The model code run on backend `B`.
struct On<B>(B);

impl<B: Backend> Executor for On<B> {
    fn forward(
        &self,
        net: &Net,
        g: &GgufFile,
        i: &ModelInfo,
        kv: &mut KvCache,
        prep: &Prepared,
        batch: &Batch,
        cap: &mut Capture,
    ) -> Result<FusedOutput, ModelError> {
        let be = &self.0;
        let (tokens, pos) = (&batch.tokens[..], &batch.pos[..]);
        let embd = &batch.input_embd;
        let (hidden, logits) = be.run(|| match net {
            Net::MuseGlimmer(m) => m.forward(be, g, i, kv, prep, tokens, embd, pos, cap),
            Net::Llama(m) => m.forward(be, g, i, kv, prep, tokens, embd, pos, cap),
        })?;
        let embeddings = if batch.embeddings {
            be.download(&hidden)?
        } else {
            Vec::new()
        };
        Ok(FusedOutput {
            logits: be.download(&logits)?,
            hidden: embeddings,
            rows: prep.out_rows.clone(),
            argmax: Vec::new(),
        })
    }

    fn numerics(&self) -> String {
        self.0.numerics()
    }

    fn threads(&self) -> usize {
        self.0.threads()
    }

    fn numerics_tag(&self) -> Option<String> {
        self.0.numerics_tag()
    }

    fn supports(&self, ty: GgmlType) -> bool {
        self.0.supports(ty)
    }

    fn computes_rows_alone(&self) -> bool {
        self.0.computes_rows_alone()
    }

    fn prepare_weight(&self, w: &Weight) -> Result<(), ModelError> {
        self.0.prepare_weight(w)
    }

    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError> {
        self.0.new_kv_store(layout, cells, n_seq)
    }
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

    fn prepare(&self, kv: &mut KvCache, b: &Batch) -> Result<Prepared, ModelError> {
        let n = b.tokens.len();
        if n == 0 {
            return Err(ModelError::BadBatch("empty batch".into()));
        }
        if b.pos.len() != n || b.seq.len() != n || b.logits.len() != n {
            return Err(ModelError::BadBatch(
                "tokens, pos, seq and logits differ in length".into(),
            ));
        }
        if !b.argmax_only.is_empty() {
            if b.argmax_only.len() != n {
                return Err(ModelError::BadBatch(
                    "argmax_only is neither empty nor one flag per token".into(),
                ));
            }
            if let Some(i) = (0..n).find(|&i| b.argmax_only[i] && !b.logits[i]) {
                return Err(ModelError::BadBatch(format!(
                    "token {i} asks for its argmax but not for an output"
                )));
            }
        }
        if let Some(&l) = b
            .capture_layers
            .iter()
            .find(|&&l| l as usize >= self.info.n_layer)
        {
            return Err(ModelError::BadBatch(format!(
                "layer {l}'s input cannot be captured: the model has {} layers",
                self.info.n_layer
            )));
        }
        if n > kv.n_ubatch() as usize {
            return Err(ModelError::BadBatch(format!(
                "{n} tokens exceed the cache's batch limit {}",
                kv.n_ubatch()
            )));
        }
        if *kv.layout() != self.kv_layout(kv.layout().dtype) {
            return Err(ModelError::BadBatch(
                "the KV cache was made for another model".into(),
            ));
        }
        self.exec.accepts(kv)?;
        let mut groups: Vec<(u32, Vec<usize>)> = Vec::new();
        for i in 0..n {
            let (tok, seq, pos) = (b.tokens[i], b.seq[i], b.pos[i]);
            if tok as usize >= self.info.n_vocab && b.input_embd.rows.binary_search(&i).is_err() {
                return Err(ModelError::BadBatch(format!(
                    "token {tok} >= n_vocab {}",
                    self.info.n_vocab
                )));
            }
            if seq as usize >= kv.n_seq() {
                return Err(ModelError::BadBatch(format!(
                    "seq {seq} >= n_seq {}",
                    kv.n_seq()
                )));
            }
            if pos >= kv.n_ctx() {
                return Err(ModelError::BadBatch(format!(
                    "position {pos} >= n_ctx {}",
                    kv.n_ctx()
                )));
            }
            match groups.iter_mut().find(|(s, _)| *s == seq) {
                Some((_, idx)) => {
                    let prev = b.pos[*idx.last().unwrap_or(&i)];
                    if pos != prev + 1 {
                        return Err(ModelError::BadBatch(format!(
                            "seq {seq}: position {pos} does not follow {prev}"
                        )));
                    }
                    idx.push(i);
                }
                None => {
                    let next = kv.seq_len(seq);
                    if pos != next {
                        return Err(ModelError::BadBatch(format!(
                            "seq {seq}: first position {pos} but the cache holds {next}"
                        )));
                    }
                    groups.push((seq, vec![i]));
                }
            }
        }
        let ie = &b.input_embd;
        if !ie.is_empty() && !self.exec.takes_input_embd() {
            return Err(ModelError::BadBatch(
                "this fused forward takes no embedding rows (images)".into(),
            ));
        }
        if ie.rows.windows(2).any(|w| w[0] >= w[1])
            || ie.rows.last().is_some_and(|&r| r >= n)
            || ie.values.len() != ie.rows.len() * self.info.n_embd
        {
            return Err(ModelError::BadBatch(format!(
                "embedding rows must ascend within the batch and hold {} values each",
                self.info.n_embd
            )));
        }
        if !b.lone_seqs.is_empty() && !self.exec.computes_rows_alone() {
            return Err(ModelError::BadBatch(
                "this backend cannot compute a sequence's rows alone (lone_seqs)".into(),
            ));
        }
        if let Some(s) = b.lone_seqs.iter().find(|&&s| s as usize >= kv.n_seq()) {
            return Err(ModelError::BadBatch(format!(
                "lone seq {s} >= n_seq {}",
                kv.n_seq()
            )));
        }
        let alone: Vec<bool> = groups
            .iter()
            .map(|(seq, _)| b.lone_seqs.contains(seq))
            .collect();
        let lone = match alone.iter().any(|&a| a) {
            true => b.seq.iter().map(|s| b.lone_seqs.contains(s)).collect(),
            false => Vec::new(),
        };
        let out_rows: Vec<usize> = (0..n).filter(|&i| b.logits[i]).collect();
        let plan = kv.place(&groups, &b.pos, &alone)?;
        Ok(Prepared {
            groups,
            plan,
            out_rows,
            lone,
        })
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

    /// A forward pass's answer covers the batch's output rows exactly once (logits rows in
    /// order, argmax only where it was asked for) with buffers of the right sizes.
    fn check_answer(
        &self,
        batch: &Batch,
        out_rows: &[usize],
        a: &FusedOutput,
    ) -> Result<(), ModelError> {
        let bad = |what: &str| Err(ModelError::Device(format!("the forward pass {what}")));
        let (v, e) = (self.info.n_vocab, self.info.n_embd);
        if a.logits.len() != a.rows.len() * v {
            return bad("returned logits of the wrong size");
        }
        if a.hidden.len()
            != if batch.embeddings {
                a.rows.len() * e
            } else {
                0
            }
        {
            return bad("returned hidden states of the wrong size");
        }
        if a.rows.windows(2).any(|w| w[0] >= w[1]) {
            return bad("returned rows out of order");
        }
        for &(i, t) in &a.argmax {
            if !batch.argmax_only.get(i).copied().unwrap_or(false) || t as usize >= v {
                return bad("answered a row with an argmax it was not asked for");
            }
        }
        let mut got = a.rows.to_vec();
        got.extend(a.argmax.iter().map(|&(i, _)| i));
        got.sort_unstable();
        if got != out_rows {
            return bad("did not answer exactly the output rows");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{AttnInput, RopeMode};
    use crate::cpu::Mat;
    use crate::synth::{presets::preset, random_tokens, Plan, WeightType};
    use std::sync::{Arc, Mutex};

    /// The CPU backend seen through another type, recording the weights it is handed at load.
    struct Wrapped {
        cpu: CpuBackend,
        prepared: Arc<Mutex<Vec<String>>>,
    }

    impl Backend for Wrapped {
        type Act = Mat;
        fn numerics(&self) -> String {
            self.cpu.numerics()
        }
        fn supports(&self, ty: GgmlType) -> bool {
            self.cpu.supports(ty)
        }
        fn prepare_weight(&self, w: &Weight) -> Result<(), ModelError> {
            self.prepared.lock().unwrap().push(w.name.to_string());
            Ok(())
        }
        fn upload(&self, r: usize, c: usize, d: Vec<f32>) -> Result<Mat, ModelError> {
            self.cpu.upload(r, c, d)
        }
        fn download(&self, a: &Mat) -> Result<Vec<f32>, ModelError> {
            self.cpu.download(a)
        }
        fn dims(&self, a: &Mat) -> (usize, usize) {
            self.cpu.dims(a)
        }
        fn get_rows(&self, t: &Weight, ids: &[u32]) -> Result<Mat, ModelError> {
            self.cpu.get_rows(t, ids)
        }
        fn matmul(&self, w: &Weight, x: &Mat) -> Result<Mat, ModelError> {
            self.cpu.matmul(w, x)
        }
        fn rms_norm(
            &self,
            x: &Mat,
            g: usize,
            eps: f32,
            w: Option<&[f32]>,
        ) -> Result<Mat, ModelError> {
            self.cpu.rms_norm(x, g, eps, w)
        }
        fn rms_norm_mut(
            &self,
            x: &mut Mat,
            g: usize,
            eps: f32,
            w: Option<&[f32]>,
        ) -> Result<(), ModelError> {
            self.cpu.rms_norm_mut(x, g, eps, w)
        }
        fn rope(
            &self,
            x: &mut Mat,
            hd: usize,
            n_rot: usize,
            pos: &[u32],
            base: f32,
            mode: RopeMode,
        ) -> Result<(), ModelError> {
            self.cpu.rope(x, hd, n_rot, pos, base, mode)
        }
        fn add(&self, x: &mut Mat, y: &Mat) -> Result<(), ModelError> {
            self.cpu.add(x, y)
        }
        fn add_row(&self, x: &mut Mat, b: &[f32]) -> Result<(), ModelError> {
            self.cpu.add_row(x, b)
        }
        fn mul_sigmoid(&self, x: &mut Mat, g: &Mat) -> Result<(), ModelError> {
            self.cpu.mul_sigmoid(x, g)
        }
        fn swiglu(&self, g: &mut Mat, u: &Mat) -> Result<(), ModelError> {
            self.cpu.swiglu(g, u)
        }
        fn scale(&self, x: &mut Mat, s: f32) -> Result<(), ModelError> {
            self.cpu.scale(x, s)
        }
        fn softcap(&self, x: &mut Mat, cap: f32) -> Result<(), ModelError> {
            self.cpu.softcap(x, cap)
        }
        fn select_rows(&self, x: &Mat, rows: &[usize]) -> Result<Mat, ModelError> {
            self.cpu.select_rows(x, rows)
        }
        fn attention(
            &self,
            kv: &mut KvCache,
            at: &AttnInput,
            q: &Mat,
            k: &Mat,
            v: &Mat,
        ) -> Result<Mat, ModelError> {
            self.cpu.attention(kv, at, q, k, v)
        }
    }

    fn tiny() -> Vec<u8> {
        Plan::new(preset("tiny").unwrap(), WeightType::Q8_0, 5, None)
            .write(Vec::new(), &mut |_| {})
            .unwrap()
    }

    /// A model over another backend type runs the same model code (same bits), and that
    /// backend is handed every weight matrix exactly once at load.
    #[test]
    fn load_with_any_backend_runs_the_same_code_and_prepares_each_matrix_once() {
        let bytes = tiny();
        let cpu = Model::from_gguf(
            GgufFile::from_bytes(bytes.clone()).unwrap(),
            &LoadOptions {
                threads: 1,
                ..Default::default()
            },
        )
        .unwrap();
        let prepared = Arc::new(Mutex::new(Vec::new()));
        let wrapped = Wrapped {
            cpu: CpuBackend::new(1).unwrap(),
            prepared: prepared.clone(),
        };
        let other = Model::from_gguf_with(GgufFile::from_bytes(bytes).unwrap(), wrapped).unwrap();
        let toks = random_tokens(12, cpu.info().n_vocab, 9);
        let run = |m: &Model| {
            let mut kv = m.new_kv(64, 1, KvType::F16).unwrap();
            m.forward(&mut kv, &Batch::single(0, &toks, 0, false))
                .unwrap()
                .logits
        };
        assert_eq!(run(&cpu), run(&other));
        let mut got = prepared.lock().unwrap().clone();
        got.sort();
        let mut want: Vec<String> = cpu
            .gguf()
            .tensors()
            .iter()
            .filter(|t| t.dims.len() == 2)
            .map(|t| t.name.clone())
            .collect();
        want.sort();
        assert_eq!(got, want);
    }

    /// What a fused forward was handed: sequence groups, output rows, the cache's placement.
    type Call = (Vec<(u32, Vec<usize>)>, Vec<usize>, Placement);

    /// A whole-model forward that records what it is handed and answers with the position of
    /// each output row as its logits.
    struct Recorder {
        n_vocab: usize,
        seen: Arc<Mutex<Vec<Call>>>,
        /// Its answer to `takes_input_embd`.
        takes_embd: bool,
    }

    impl FusedForward for Recorder {
        fn numerics(&self) -> String {
            "recorder".to_string()
        }
        fn takes_input_embd(&self) -> bool {
            self.takes_embd
        }
        fn forward(
            &self,
            kv: &mut KvCache,
            batch: &Batch,
            groups: &[(u32, Vec<usize>)],
            out_rows: &[usize],
        ) -> Result<FusedOutput, ModelError> {
            self.seen
                .lock()
                .unwrap()
                .push((groups.to_vec(), out_rows.to_vec(), kv.placement()));
            // Rows asked for their argmax get the position as their token.
            let argmax_only = |r: usize| batch.argmax_only.get(r).copied().unwrap_or(false);
            let rows: Vec<usize> = out_rows
                .iter()
                .copied()
                .filter(|&r| !argmax_only(r))
                .collect();
            let logits = rows
                .iter()
                .flat_map(|&r| std::iter::repeat_n(batch.pos[r] as f32, self.n_vocab))
                .collect();
            let argmax = out_rows
                .iter()
                .filter(|&&r| argmax_only(r))
                .map(|&r| (r, batch.pos[r]))
                .collect();
            Ok(FusedOutput {
                logits,
                hidden: Vec::new(),
                rows,
                argmax,
            })
        }

        fn new_kv_store(
            &self,
            layout: &KvLayout,
            cells: &[usize],
            n_seq: usize,
        ) -> Result<Box<dyn KvStore>, ModelError> {
            Ok(Box::new(HostKv::new(layout, cells, n_seq)?))
        }

        fn accepts(&self, kv: &KvCache) -> Result<(), ModelError> {
            match kv.store().as_any().is::<HostKv>() {
                true => Ok(()),
                false => Err(ModelError::Device("not a host cache".into())),
            }
        }
    }

    /// `Model::with_fused` validates and places every batch before the fused forward sees it
    /// (by position), hands it the sequence groups and output rows, and returns its logits.
    #[test]
    fn a_fused_forward_gets_validated_batches_on_a_positional_cache() {
        let bytes = tiny();
        let n_vocab = Model::from_gguf(
            GgufFile::from_bytes(bytes.clone()).unwrap(),
            &LoadOptions {
                threads: 1,
                ..Default::default()
            },
        )
        .unwrap()
        .info()
        .n_vocab;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let rec = Recorder {
            n_vocab,
            seen: seen.clone(),
            takes_embd: false,
        };
        let m = Model::with_fused(GgufFile::from_bytes(bytes).unwrap(), Box::new(rec)).unwrap();
        let mut kv = m.new_kv(64, 2, KvType::F16).unwrap();
        assert_eq!(kv.placement(), Placement::Positional);
        let mut b = Batch::single(1, &[3, 4, 5], 0, true);
        b.push(7, 0, 0, true);
        let out = m.forward(&mut kv, &b).unwrap();
        assert_eq!(out.rows, vec![2, 3]);
        assert_eq!(out.row(0, n_vocab)[0], 2.0);
        assert_eq!(out.row(1, n_vocab)[0], 0.0);
        assert_eq!((kv.seq_len(0), kv.seq_len(1)), (1, 3));
        assert_eq!(kv.cell_pos(1, 0)[..3], [0, 1, 2]);
        // A position that does not continue its sequence never reaches the device, nor does
        // a cache placed another way (nothing is placed in it).
        let bad = Batch::single(0, &[1], 5, true);
        assert!(m.forward(&mut kv, &bad).is_err());
        let mut other = m
            .new_kv(64, 1, KvType::F16)
            .unwrap()
            .with_placement(Placement::LlamaCpp);
        let e = m
            .forward(&mut other, &Batch::single(0, &[1], 0, true))
            .unwrap_err();
        assert!(e.to_string().contains("by position"), "{e}");
        assert_eq!(other.seq_len(0), 0);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].0, vec![(1, vec![0, 1, 2]), (0, vec![3])]);
        assert_eq!(seen[0].1, vec![2, 3]);
        assert_eq!(seen[0].2, Placement::Positional);
    }

    /// Rows given as embeddings (an image's, with ids past the vocabulary) reach a fused
    /// forward that takes them, validated; one that does not is refused before anything is
    /// placed in the cache.
    #[test]
    fn embedding_rows_reach_only_a_fused_forward_that_takes_them() {
        let bytes = tiny();
        let g = GgufFile::from_bytes(bytes.clone()).unwrap();
        let (n_vocab, n_embd) = {
            let i = Model::from_gguf(g, &LoadOptions::default())
                .unwrap()
                .info()
                .clone();
            (i.n_vocab, i.n_embd)
        };
        let mut b = Batch::single(0, &[3, n_vocab as u32 + 7, 5], 0, true);
        b.input_embd = InputEmbd {
            rows: vec![1],
            values: vec![0.5; n_embd],
        };
        for takes_embd in [false, true] {
            let seen = Arc::new(Mutex::new(Vec::new()));
            let rec = Recorder {
                n_vocab,
                seen: seen.clone(),
                takes_embd,
            };
            let g = GgufFile::from_bytes(bytes.clone()).unwrap();
            let m = Model::with_fused(g, Box::new(rec)).unwrap();
            let mut kv = m.new_kv(64, 1, KvType::F16).unwrap();
            let got = m.forward(&mut kv, &b);
            assert_eq!(got.is_ok(), takes_embd, "{got:?}");
            assert_eq!(kv.seq_len(0), if takes_embd { 3 } else { 0 });
            assert_eq!(seen.lock().unwrap().len(), usize::from(takes_embd));
        }
    }

    /// Rows marked `argmax_only` may come back as tokens (a fused forward), or as logits (the
    /// op-by-op path, which ignores the mark); a batch whose marks do not fit is refused, and
    /// an answer that does not cover the output rows exactly is an error.
    #[test]
    fn argmax_only_rows_come_back_as_tokens_or_logits() {
        let bytes = tiny();
        let cpu = Model::from_gguf(
            GgufFile::from_bytes(bytes.clone()).unwrap(),
            &LoadOptions {
                threads: 1,
                ..Default::default()
            },
        )
        .unwrap();
        let n_vocab = cpu.info().n_vocab;
        let rec = Recorder {
            n_vocab,
            seen: Arc::new(Mutex::new(Vec::new())),
            takes_embd: false,
        };
        let fused = Model::with_fused(GgufFile::from_bytes(bytes).unwrap(), Box::new(rec)).unwrap();
        let mut first = Batch::default();
        first.push_argmax(9, 0, 0);
        first.push(8, 1, 0, false);
        assert_eq!(first.argmax_only, vec![true, false]);
        let mut b = Batch::single(0, &[3, 4], 0, true);
        b.push_argmax(5, 0, 1);
        b.push(6, 0, 2, true);
        assert_eq!(b.argmax_only, vec![false, false, true, false]);
        let mut kv = fused.new_kv(64, 3, KvType::F16).unwrap();
        let out = fused.forward(&mut kv, &b).unwrap();
        assert_eq!(out.rows, vec![1, 3]);
        assert_eq!(out.argmax, vec![(2, 0)]);
        assert_eq!(out.logits.len(), 2 * n_vocab);
        let mut kv = cpu.new_kv(64, 3, KvType::F16).unwrap();
        let out = cpu.forward(&mut kv, &b).unwrap();
        assert_eq!(out.rows, vec![1, 2, 3]);
        assert!(out.argmax.is_empty());
        // Marks that do not fit the batch change nothing.
        let mut kv = cpu.new_kv(64, 3, KvType::F16).unwrap();
        let mut short = b.clone();
        short.argmax_only.pop();
        assert!(cpu.forward(&mut kv, &short).is_err());
        let mut silent = b.clone();
        silent.logits[2] = false;
        assert!(cpu.forward(&mut kv, &silent).is_err());
        assert_eq!(kv.seq_len(0), 0);
        // An answer with a row twice, or an argmax nobody asked for, is refused.
        let mut a = FusedOutput {
            logits: vec![0.0; 2 * n_vocab],
            hidden: Vec::new(),
            rows: vec![1, 3],
            argmax: vec![(2, 7)],
        };
        assert!(cpu.check_answer(&b, &[1, 2, 3], &a).is_ok());
        a.argmax.push((3, 7));
        assert!(cpu.check_answer(&b, &[1, 2, 3], &a).is_err());
        a.argmax = vec![(1, 7)];
        a.rows = vec![2, 3];
        assert!(cpu.check_answer(&b, &[1, 2, 3], &a).is_err());
        a.argmax = vec![(2, n_vocab as u32)];
        a.rows = vec![1, 3];
        assert!(cpu.check_answer(&b, &[1, 2, 3], &a).is_err());
    }

    /// On the CPU a positional cache gives llama.cpp's logits bit for bit in order (the same
    /// cells). After a truncation whose dropped tail wraps the ring it still does what a run
    /// that never went past the cut does, bit for bit (llama.cpp's search restarts at cell 0
    /// there, which reorders the attention's f16 sums).
    #[test]
    fn positional_cells_give_the_same_logits_on_the_cpu() {
        let m = Model::from_gguf(
            GgufFile::from_bytes(tiny()).unwrap(),
            &LoadOptions {
                threads: 1,
                ..Default::default()
            },
        )
        .unwrap();
        let toks = random_tokens(400, m.info().n_vocab, 3);
        let swa_layer = m.info().is_swa.iter().position(|&s| s).unwrap();
        // Chunks of 16 over `range`, last-token logits of each.
        let feed = |kv: &mut KvCache, range: std::ops::Range<usize>| -> Vec<f32> {
            let mut logits = Vec::new();
            for (c, chunk) in toks[range.clone()].chunks(16).enumerate() {
                let p0 = (range.start + 16 * c) as u32;
                logits.extend(
                    m.forward(kv, &Batch::single(0, chunk, p0, true))
                        .unwrap()
                        .logits,
                );
            }
            logits
        };
        let new = |placement| {
            m.new_kv_ubatch(512, 1, KvType::F16, 16)
                .unwrap()
                .with_placement(placement)
        };
        let (mut a, mut b) = (new(Placement::LlamaCpp), new(Placement::Positional));
        let ring = a.cell_pos(0, swa_layer).len();
        assert!(ring + 10 < 400);
        assert_eq!(feed(&mut a, 0..ring + 10), feed(&mut b, 0..ring + 10));
        // Back to a cut whose dropped positions sit in the ring's last and first cells.
        let cut = ring - 6;
        b.truncate(0, cut as u32);
        let after_cut = feed(&mut b, cut..cut + 60);
        let mut fresh = new(Placement::LlamaCpp);
        feed(&mut fresh, 0..cut);
        assert_eq!(after_cut, feed(&mut fresh, cut..cut + 60));
    }
}
