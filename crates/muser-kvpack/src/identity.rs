//! What a KV state is valid for: the identity a restore must match exactly.
//!
//! A KV cache is only meaningful for the exact weights, tokenizer, chat template, numeric
//! precision, cache layout and engine that produced it. [`KvIdentity`] lists these inputs;
//! [`KvIdentity::check_matches`] names the first field that differs, and
//! [`KvIdentity::digest`] folds all of them, under the operator's identity key, into the
//! namespace that roots every prefix chain (so caches of different identities can never
//! address each other's blocks).

use crate::codec::{Dec, Enc};
use crate::error::{KvpackError, Result};
use crate::keys::Keys;

/// A 32-byte digest (BLAKE3 or SHA-256 output).
pub type Digest32 = [u8; 32];

/// Longest accepted text field (precision name, engine ABI).
pub const MAX_NAME_BYTES: usize = 64;
/// Most layers a layout may declare.
pub const MAX_LAYERS: u32 = 4096;
/// Most KV heads per layer.
pub const MAX_HEADS: u32 = 4096;
/// Largest head dimension.
pub const MAX_HEAD_DIM: u32 = 65536;

/// Element type of the K and V cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F16,
    F32,
}

impl KvDtype {
    pub fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
    fn code(self) -> u8 {
        match self {
            KvDtype::F16 => 1,
            KvDtype::F32 => 2,
        }
    }
    fn from_code(c: u8) -> Option<Self> {
        match c {
            1 => Some(KvDtype::F16),
            2 => Some(KvDtype::F32),
            _ => None,
        }
    }
}

/// How one layer's K (or V) bytes are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CellLayout {
    /// One row per position, positions ascending; a row holds `n_head_kv × head_dim`
    /// elements, head-major (head h at `[h·head_dim, (h+1)·head_dim)`). V is not transposed.
    TokenMajor,
}

impl CellLayout {
    fn code(self) -> u8 {
        match self {
            CellLayout::TokenMajor => 1,
        }
    }
    fn from_code(c: u8) -> Option<Self> {
        match c {
            1 => Some(CellLayout::TokenMajor),
            _ => None,
        }
    }
}

/// The geometry of a KV cache, independent of any model code.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvLayoutAbi {
    pub n_layer: u32,
    /// Per layer: true when the layer uses sliding-window attention.
    pub swa_layers: Vec<bool>,
    pub n_head_kv: u32,
    pub head_dim: u32,
    /// Sliding window in tokens (a query sees itself and `n_swa - 1` earlier keys); 0 when
    /// no layer slides.
    pub n_swa: u32,
    pub dtype: KvDtype,
    pub cell_layout: CellLayout,
}

impl KvLayoutAbi {
    /// Bytes of one K (or V) row: one position of one layer.
    pub fn row_bytes(&self) -> usize {
        self.n_head_kv as usize * self.head_dim as usize * self.dtype.size()
    }

    pub fn is_swa(&self, layer: usize) -> bool {
        self.swa_layers[layer]
    }

    /// Checks the layout's own consistency and bounds.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(KvpackError::InvalidState(format!("layout: {m}")));
        if self.n_layer == 0 || self.n_layer > MAX_LAYERS {
            return bad("layer count out of range");
        }
        if self.swa_layers.len() != self.n_layer as usize {
            return bad("per-layer SWA flags do not match the layer count");
        }
        if self.n_head_kv == 0 || self.n_head_kv > MAX_HEADS {
            return bad("KV head count out of range");
        }
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM {
            return bad("head dimension out of range");
        }
        if self.swa_layers.iter().any(|&s| s) && self.n_swa == 0 {
            return bad("SWA layers need a window");
        }
        Ok(())
    }

    /// Positions of layer `layer` that a state covering `positions` holds: every position
    /// for a full-attention layer, the last `n_swa` for a sliding-window layer.
    pub fn layer_range(
        &self,
        layer: usize,
        positions: &std::ops::Range<u32>,
    ) -> std::ops::Range<u32> {
        if self.is_swa(layer) {
            positions
                .start
                .max(positions.end.saturating_sub(self.n_swa))..positions.end
        } else {
            positions.clone()
        }
    }

    /// K+V bytes of a state covering `positions`.
    pub fn state_bytes(&self, positions: &std::ops::Range<u32>) -> u64 {
        (0..self.n_layer as usize)
            .map(|l| 2 * (self.layer_range(l, positions).len() * self.row_bytes()) as u64)
            .sum()
    }

    fn encode(&self, e: &mut Enc) {
        e.u32(self.n_layer);
        let mut bits = vec![0u8; (self.swa_layers.len()).div_ceil(8)];
        for (i, &s) in self.swa_layers.iter().enumerate() {
            if s {
                bits[i / 8] |= 1 << (i % 8);
            }
        }
        e.bytes(&bits);
        e.u32(self.n_head_kv);
        e.u32(self.head_dim);
        e.u32(self.n_swa);
        e.u8(self.dtype.code());
        e.u8(self.cell_layout.code());
    }

    fn decode(d: &mut Dec) -> Result<Self> {
        let n_layer = d.u32()?;
        if n_layer == 0 || n_layer > MAX_LAYERS {
            return Err(d.malformed("layer count out of range"));
        }
        let bits = d.take((n_layer as usize).div_ceil(8))?;
        let swa_layers: Vec<bool> = (0..n_layer as usize)
            .map(|i| bits[i / 8] >> (i % 8) & 1 == 1)
            .collect();
        if n_layer % 8 != 0 && bits[bits.len() - 1] >> (n_layer % 8) != 0 {
            return Err(d.malformed("unused SWA bits are set"));
        }
        let layout = KvLayoutAbi {
            n_layer,
            swa_layers,
            n_head_kv: d.u32()?,
            head_dim: d.u32()?,
            n_swa: d.u32()?,
            dtype: KvDtype::from_code(d.u8()?).ok_or_else(|| d.malformed("unknown KV dtype"))?,
            cell_layout: CellLayout::from_code(d.u8()?)
                .ok_or_else(|| d.malformed("unknown cell layout"))?,
        };
        layout
            .validate()
            .map_err(|_| d.malformed("layout out of range"))?;
        Ok(layout)
    }
}

/// Every input a KV state depends on. Two states are interchangeable only when all fields
/// are equal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvIdentity {
    /// Content digest of the weights ([`WeightsHasher`]), never a path.
    pub model_weights: Digest32,
    /// Digest of the tokenizer metadata (vocabulary, merges, types, special ids, flags).
    pub tokenizer: Digest32,
    /// Digest of the chat template text.
    pub chat_template: Digest32,
    /// Weight precision / quantization name, e.g. `Q4_1` or `mixed:q4_K,q6_K`.
    pub weight_precision: String,
    /// KV dtype and cell layout ABI.
    pub layout: KvLayoutAbi,
    /// Digest of the context policy (context length, RoPE scaling, SWA handling, ...).
    pub context_policy: Digest32,
    /// Engine ABI: names the numerics of the code that computed the cache.
    pub engine_abi: String,
    /// Adapter digest; `None` when no adapter is applied.
    pub adapter: Option<Digest32>,
}

/// The fields of [`KvIdentity`], as a rejection names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityField {
    ModelWeights,
    Tokenizer,
    ChatTemplate,
    WeightPrecision,
    KvDtype,
    LayerCount,
    SwaPattern,
    KvHeads,
    HeadDim,
    SwaWindow,
    CellLayout,
    ContextPolicy,
    EngineAbi,
    Adapter,
}

impl IdentityField {
    pub const ALL: [IdentityField; 14] = [
        IdentityField::ModelWeights,
        IdentityField::Tokenizer,
        IdentityField::ChatTemplate,
        IdentityField::WeightPrecision,
        IdentityField::KvDtype,
        IdentityField::LayerCount,
        IdentityField::SwaPattern,
        IdentityField::KvHeads,
        IdentityField::HeadDim,
        IdentityField::SwaWindow,
        IdentityField::CellLayout,
        IdentityField::ContextPolicy,
        IdentityField::EngineAbi,
        IdentityField::Adapter,
    ];

    pub fn name(self) -> &'static str {
        match self {
            IdentityField::ModelWeights => "model_weights",
            IdentityField::Tokenizer => "tokenizer",
            IdentityField::ChatTemplate => "chat_template",
            IdentityField::WeightPrecision => "weight_precision",
            IdentityField::KvDtype => "kv_dtype",
            IdentityField::LayerCount => "n_layer",
            IdentityField::SwaPattern => "swa_layers",
            IdentityField::KvHeads => "n_head_kv",
            IdentityField::HeadDim => "head_dim",
            IdentityField::SwaWindow => "n_swa",
            IdentityField::CellLayout => "cell_layout",
            IdentityField::ContextPolicy => "context_policy",
            IdentityField::EngineAbi => "engine_abi",
            IdentityField::Adapter => "adapter",
        }
    }
}

impl std::fmt::Display for IdentityField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl KvIdentity {
    /// Checks bounds of the text fields and the layout.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("weight_precision", &self.weight_precision),
            ("engine_abi", &self.engine_abi),
        ] {
            if v.is_empty() || v.len() > MAX_NAME_BYTES {
                return Err(KvpackError::InvalidState(format!(
                    "identity: {name} must be 1..={MAX_NAME_BYTES} bytes"
                )));
            }
        }
        self.layout.validate()
    }

    /// `Ok` when `other` equals `self`; otherwise the first differing field.
    pub fn check_matches(&self, other: &KvIdentity) -> Result<()> {
        let (a, b) = (&self.layout, &other.layout);
        let checks = [
            (
                IdentityField::ModelWeights,
                self.model_weights == other.model_weights,
            ),
            (IdentityField::Tokenizer, self.tokenizer == other.tokenizer),
            (
                IdentityField::ChatTemplate,
                self.chat_template == other.chat_template,
            ),
            (
                IdentityField::WeightPrecision,
                self.weight_precision == other.weight_precision,
            ),
            (IdentityField::KvDtype, a.dtype == b.dtype),
            (IdentityField::LayerCount, a.n_layer == b.n_layer),
            (IdentityField::SwaPattern, a.swa_layers == b.swa_layers),
            (IdentityField::KvHeads, a.n_head_kv == b.n_head_kv),
            (IdentityField::HeadDim, a.head_dim == b.head_dim),
            (IdentityField::SwaWindow, a.n_swa == b.n_swa),
            (IdentityField::CellLayout, a.cell_layout == b.cell_layout),
            (
                IdentityField::ContextPolicy,
                self.context_policy == other.context_policy,
            ),
            (
                IdentityField::EngineAbi,
                self.engine_abi == other.engine_abi,
            ),
            (IdentityField::Adapter, self.adapter == other.adapter),
        ];
        match checks.iter().find(|(_, eq)| !eq) {
            Some((field, _)) => Err(KvpackError::IdentityMismatch(*field)),
            None => Ok(()),
        }
    }

    /// Canonical encoding: fixed order, length-prefixed strings, so that moving a field
    /// boundary changes the bytes.
    pub(crate) fn encode(&self, e: &mut Enc) {
        e.bytes(&self.model_weights);
        e.bytes(&self.tokenizer);
        e.bytes(&self.chat_template);
        e.str(&self.weight_precision);
        self.layout.encode(e);
        e.bytes(&self.context_policy);
        e.str(&self.engine_abi);
        match &self.adapter {
            None => e.u8(0),
            Some(a) => {
                e.u8(1);
                e.bytes(a);
            }
        }
    }

    pub(crate) fn decode(d: &mut Dec) -> Result<Self> {
        let model_weights = d.arr32()?;
        let tokenizer = d.arr32()?;
        let chat_template = d.arr32()?;
        let weight_precision = d.str(MAX_NAME_BYTES)?;
        let layout = KvLayoutAbi::decode(d)?;
        let context_policy = d.arr32()?;
        let engine_abi = d.str(MAX_NAME_BYTES)?;
        let adapter = if d.bool()? { Some(d.arr32()?) } else { None };
        let id = KvIdentity {
            model_weights,
            tokenizer,
            chat_template,
            weight_precision,
            layout,
            context_policy,
            engine_abi,
            adapter,
        };
        id.validate()
            .map_err(|_| d.malformed("identity field out of range"))?;
        Ok(id)
    }

    /// Keyed digest of every field (keyed BLAKE3 under the identity key).
    pub fn digest(&self, keys: &Keys) -> Digest32 {
        let mut e = Enc::default();
        e.bytes(b"muser-kvpack identity v1\0");
        self.encode(&mut e);
        *blake3::keyed_hash(&keys.identity, &e.0).as_bytes()
    }
}

/// Digest of an identity input (tokenizer metadata, chat template text, context policy),
/// domain-separated by `domain` so equal bytes under different roles give different digests.
pub fn field_digest(domain: &str, data: &[u8]) -> Digest32 {
    let mut h = blake3::Hasher::new_derive_key(&format!("muser-kvpack field v1 {domain}"));
    h.update(data);
    *h.finalize().as_bytes()
}

/// Streaming content digest of model weights: BLAKE3 over every tensor's name, shape, type
/// and data bytes in the file's tensor order. The path and the metadata other than tensors
/// do not enter. Hashing 20 GB takes tens of seconds; callers cache the result keyed by a
/// [`FileStamp`] and rehash when the stamp changes.
pub struct WeightsHasher {
    h: blake3::Hasher,
    n_tensors: u64,
}

impl Default for WeightsHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl WeightsHasher {
    pub fn new() -> Self {
        WeightsHasher {
            h: blake3::Hasher::new_derive_key("muser-kvpack weights v1"),
            n_tensors: 0,
        }
    }

    /// Starts a tensor: its name, dimensions (ggml order), type id and data length.
    pub fn begin_tensor(&mut self, name: &str, dims: &[u64], type_id: u32, data_len: u64) {
        let mut e = Enc::default();
        e.str(name);
        e.u32(dims.len() as u32);
        for &d in dims {
            e.u64(d);
        }
        e.u32(type_id);
        e.u64(data_len);
        self.h.update(&e.0);
        self.n_tensors += 1;
    }

    /// Feeds (part of) the current tensor's data.
    pub fn update(&mut self, data: &[u8]) {
        self.h.update(data);
    }

    /// Convenience: a whole tensor at once.
    pub fn add_tensor(&mut self, name: &str, dims: &[u64], type_id: u32, data: &[u8]) {
        self.begin_tensor(name, dims, type_id, data.len() as u64);
        self.update(data);
    }

    pub fn finish(mut self) -> Digest32 {
        self.h.update(&self.n_tensors.to_le_bytes());
        *self.h.finalize().as_bytes()
    }
}

/// What identifies a file's contents cheaply: size, modification time and inode. A cached
/// weights digest is reused only while the stamp is unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileStamp {
    pub len: u64,
    pub mtime_ns: i128,
    pub inode: u64,
}

impl FileStamp {
    pub fn of(path: &std::path::Path) -> std::io::Result<FileStamp> {
        let md = std::fs::metadata(path)?;
        let mtime_ns = match md.modified()?.duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => d.as_nanos() as i128,
            Err(e) => -(e.duration().as_nanos() as i128),
        };
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(&md);
        #[cfg(not(unix))]
        let inode = 0;
        Ok(FileStamp {
            len: md.len(),
            mtime_ns,
            inode,
        })
    }
}
