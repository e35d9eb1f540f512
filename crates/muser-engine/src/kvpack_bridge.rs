//! The bridge between the engine's slots and `muser-kvpack`: the identity of a loaded model,
//! conversion between the model's [`KvSnapshot`] and kvpack's [`KvState`], and slot export
//! and import as sealed packs (full, or a delta against the blocks a receiver holds).
//!
//! A pack carries K/V and the keyed ids of the tokens, not the tokens themselves; an import
//! takes the tokens from the caller and checks them against the pack's cut id, so a pack
//! restores only for the exact token sequence (and identity, and operator key) it was made
//! from. Every check runs on a staging state; the slot's K/V and token list are replaced only
//! after all of them passed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use muser_kvpack::{
    apply_delta, field_digest, restore, BlockId, CellLayout, Digest32, Expect, FileStamp, Keys,
    KvDtype, KvIdentity, KvLayoutAbi, KvState, KvpackError, PackKind, PackPlan, PackSpec,
    PrefixChain, PrefixHasher, ReadLimits, RestoreControl, SegmentPlan,
};
use muser_model::{KvLayout, KvSnapshot, KvType, LayerKv, Model};

use crate::engine::{Engine, EngineError, SlotKv};

#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error(transparent)]
    Pack(#[from] KvpackError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("K/V copy: {0}")]
    Kv(String),
    #[error("slot {slot} holds no tokens to pack")]
    EmptySlot { slot: usize },
    #[error("the pack covers {n_tokens} tokens but a slot holds {n_ctx}")]
    TooLong { n_tokens: usize, n_ctx: usize },
    #[error("the slot does not hold the {base} base tokens the delta builds on")]
    MissingBase { base: u32 },
}

/// What packs of one engine need: the operator keys, the model's identity and the prefix
/// hasher rooted in it. Built once per loaded model ([`KvPackContext::new`]).
pub struct KvPackContext {
    pub keys: Keys,
    pub identity: KvIdentity,
    pub hasher: PrefixHasher,
    pub limits: ReadLimits,
}

impl KvPackContext {
    /// `model_path` (when the model came from a file) lets the weights digest be cached by the
    /// file's stamp; `kv_type` is the engine's K/V element type.
    pub fn new(
        model: &Model,
        model_path: Option<&Path>,
        kv_type: KvType,
        keys: Keys,
    ) -> Result<KvPackContext, PackError> {
        let identity = model_identity(model, model_path, kv_type);
        identity.validate()?;
        let hasher = PrefixHasher::new(&keys, &identity.digest(&keys));
        Ok(KvPackContext {
            keys,
            identity,
            hasher,
            limits: ReadLimits::default(),
        })
    }
}

/// The kvpack layout of a cache layout.
pub fn layout_abi(l: &KvLayout) -> KvLayoutAbi {
    KvLayoutAbi {
        n_layer: l.n_layer as u32,
        swa_layers: l.is_swa.clone(),
        n_head_kv: l.n_head_kv as u32,
        head_dim: l.head_dim as u32,
        n_swa: l.n_swa,
        dtype: match l.dtype {
            KvType::F16 => KvDtype::F16,
            KvType::F32 => KvDtype::F32,
        },
        cell_layout: CellLayout::TokenMajor,
    }
}

/// The model's snapshot as kvpack's state (same shape: the rows move, nothing is copied).
pub fn snapshot_to_state(s: KvSnapshot) -> KvState {
    KvState {
        layout: layout_abi(&s.layout),
        positions: s.positions,
        layers: s
            .layers
            .into_iter()
            .map(|l| muser_kvpack::LayerKv { k: l.k, v: l.v })
            .collect(),
    }
}

/// kvpack's state as a snapshot for a cache of layout `layout` (which must match).
pub fn state_to_snapshot(s: KvState, layout: &KvLayout) -> Result<KvSnapshot, PackError> {
    if s.layout != layout_abi(layout) {
        return Err(PackError::Kv(
            "the state's layout differs from the cache's".into(),
        ));
    }
    s.validate()?;
    Ok(KvSnapshot {
        layout: layout.clone(),
        positions: s.positions,
        layers: s
            .layers
            .into_iter()
            .map(|l| LayerKv { k: l.k, v: l.v })
            .collect(),
    })
}

/// Everything the K/V of `model` depends on.
pub fn model_identity(model: &Model, model_path: Option<&Path>, kv_type: KvType) -> KvIdentity {
    let g = model.gguf();
    KvIdentity {
        model_weights: weights_digest(model, model_path),
        tokenizer: tokenizer_digest(model),
        chat_template: field_digest(
            "template",
            g.get_str("tokenizer.chat_template")
                .unwrap_or_default()
                .as_bytes(),
        ),
        weight_precision: precision_summary(model),
        layout: layout_abi(&model.kv_layout(kv_type)),
        context_policy: context_digest(model),
        engine_abi: model.engine_abi(kv_type),
        adapter: None,
    }
}

/// Weights digests already computed in this process, by file path and stamp.
static WEIGHTS_CACHE: Mutex<Option<HashMap<PathBuf, (FileStamp, Digest32)>>> = Mutex::new(None);

/// Content digest of the model's tensors (kvpack's [`muser_kvpack::WeightsHasher`]). With a
/// path, the digest is remembered for the file's current stamp and reused while it holds.
pub fn weights_digest(model: &Model, model_path: Option<&Path>) -> Digest32 {
    let stamp = model_path.and_then(|p| Some((p.to_path_buf(), FileStamp::of(p).ok()?)));
    if let Some((path, stamp)) = &stamp {
        let cache = WEIGHTS_CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((s, d)) = cache.as_ref().and_then(|m| m.get(path)) {
            if s == stamp {
                return *d;
            }
        }
    }
    let g = model.gguf();
    let mut h = muser_kvpack::WeightsHasher::new();
    for t in g.tensors() {
        h.add_tensor(&t.name, &t.dims, t.ty.id(), g.tensor_data(t));
    }
    let d = h.finish();
    if let Some((path, stamp)) = stamp {
        let mut cache = WEIGHTS_CACHE.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .get_or_insert_with(HashMap::new)
            .insert(path, (stamp, d));
    }
    d
}

/// Digest of every `tokenizer.*` metadata entry but the chat template, in file order.
fn tokenizer_digest(model: &Model) -> Digest32 {
    let mut bytes = Vec::new();
    for (k, v) in model.gguf().metadata() {
        if k.starts_with("tokenizer.") && k != "tokenizer.chat_template" {
            let text = format!("{v:?}");
            for part in [k.as_bytes(), text.as_bytes()] {
                bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
                bytes.extend_from_slice(part);
            }
        }
    }
    field_digest("tokenizer", &bytes)
}

/// `Q4_1` when every quantized tensor has one type, else `mixed:` and the sorted type names.
fn precision_summary(model: &Model) -> String {
    let mut names: Vec<&'static str> = model
        .gguf()
        .tensors()
        .iter()
        .filter(|t| t.ty.is_quantized())
        .map(|t| t.ty.name())
        .collect();
    names.sort_unstable();
    names.dedup();
    let s = match names.as_slice() {
        [] => "float".to_string(),
        [one] => one.to_uppercase(),
        many => format!("mixed:{}", many.join(",")),
    };
    // the identity bounds this text
    if s.len() > 64 {
        format!("mixed:{}", &short_hex(s.as_bytes())[..32])
    } else {
        s
    }
}

fn short_hex(b: &[u8]) -> String {
    field_digest("precision", b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Digest of what positions and attention depend on besides the weights: architecture,
/// training context, RoPE bases and dimensions, window, scales and caps.
fn context_digest(model: &Model) -> Digest32 {
    let i = model.info();
    let text = format!(
        "arch={};n_ctx_train={};n_rot={};rope_base={:08x};rope_base_swa={:08x};n_swa={};\
         attn_scale={:08x};logit_scale={:08x};softcap={:08x};rms_eps={:08x}",
        i.arch.name(),
        i.n_ctx_train,
        i.n_rot,
        i.rope_base.to_bits(),
        i.rope_base_swa.to_bits(),
        i.n_swa,
        i.attn_scale.to_bits(),
        i.logit_scale.to_bits(),
        i.softcap.to_bits(),
        i.rms_eps.to_bits(),
    );
    field_digest("context", text.as_bytes())
}

fn kv_err(e: impl std::fmt::Display) -> PackError {
    PackError::Kv(e.to_string())
}

/// A slot's K/V ready to be packed: positions `base..` of the tokens `chain` covers.
pub struct SlotExport {
    pub state: KvState,
    pub chain: PrefixChain,
    pub base: u32,
    /// From the request to the engine thread taking it up (a forward pass in progress).
    pub waited: std::time::Duration,
    /// Copying the rows out of the cache.
    pub copied: std::time::Duration,
}

impl SlotExport {
    /// The pack's spec: replay `stream` (the cut id when `None`) at `generation`.
    pub fn spec<'a>(
        &'a self,
        ctx: &'a KvPackContext,
        generation: u64,
        stream: Option<Digest32>,
    ) -> PackSpec<'a> {
        PackSpec {
            identity: &ctx.identity,
            chain: &self.chain,
            generation,
            stream,
            base_tokens: self.base,
            plan: SegmentPlan::default(),
            threads: muser_kvpack::default_threads(),
        }
    }
}

/// The slot's K/V from `base` (0: full; else past the longest block prefix of `held`) to its
/// end.
fn export_slot(
    s: &SlotKv<'_>,
    ctx: &KvPackContext,
    held: Option<&[BlockId]>,
    slot: usize,
) -> Result<SlotExport, PackError> {
    let n = s.tokens.len() as u32;
    if n == 0 {
        return Err(PackError::EmptySlot { slot });
    }
    let chain = ctx.hasher.chain(s.tokens);
    let base = held.map_or(0, |h| chain.delta_base(h, n));
    let t = std::time::Instant::now();
    let state = snapshot_to_state(s.kv.export(s.seq, base..n).map_err(kv_err)?);
    Ok(SlotExport {
        state,
        chain,
        base,
        waited: std::time::Duration::ZERO,
        copied: t.elapsed(),
    })
}

/// Packs the slot's K/V from `base` (0: full) to its end.
fn pack_slot(
    s: &SlotKv<'_>,
    ctx: &KvPackContext,
    generation: u64,
    held: Option<&[BlockId]>,
    slot: usize,
) -> Result<Vec<u8>, PackError> {
    let e = export_slot(s, ctx, held, slot)?;
    Ok(PackPlan::new(&e.state, &ctx.keys, &e.spec(ctx, generation, None))?.to_bytes())
}

/// Verifies `bytes` against `tokens` into a staging state, then replaces the slot's K/V and
/// tokens. A delta applies on the slot's own first `base` tokens, which must equal
/// `tokens[..base]`.
fn unpack_into_slot(
    s: SlotKv<'_>,
    ctx: &KvPackContext,
    bytes: &[u8],
    tokens: Vec<u32>,
) -> Result<usize, PackError> {
    let n_ctx = s.kv.n_ctx() as usize;
    if tokens.len() >= n_ctx || tokens.is_empty() {
        return Err(PackError::TooLong {
            n_tokens: tokens.len(),
            n_ctx,
        });
    }
    let chain = ctx.hasher.chain(&tokens);
    let expect = Expect {
        identity: &ctx.identity,
        cut: chain.cut_id(tokens.len() as u32),
        other_abis: &[],
    };
    let control = RestoreControl {
        max_bytes: s.kv.bytes() as u64,
        ..Default::default()
    };
    let restored = restore(bytes, &ctx.keys, &expect, &ctx.limits, &control)?;
    let state = match restored.manifest.kind {
        PackKind::Full => restored.state,
        PackKind::Delta { base_tokens, .. } => {
            let b = base_tokens as usize;
            if s.tokens.len() < b || s.tokens[..b] != tokens[..b] {
                return Err(PackError::MissingBase { base: base_tokens });
            }
            let base_cut = chain
                .cut_id(base_tokens)
                .ok_or(PackError::MissingBase { base: base_tokens })?;
            let base =
                s.kv.export(s.seq, 0..base_tokens)
                    .map_err(|_| PackError::MissingBase { base: base_tokens })?;
            apply_delta(&snapshot_to_state(base), base_cut, &restored)?
        }
    };
    if state.positions != (0..tokens.len() as u32) {
        return Err(PackError::Kv("the pack does not cover the tokens".into()));
    }
    let snap = state_to_snapshot(state, s.kv.layout())?;
    // every check passed: replace the slot
    s.kv.clear(s.seq);
    s.tokens.clear();
    s.kv.import(s.seq, &snap).map_err(kv_err)?;
    *s.tokens = tokens;
    Ok(s.tokens.len())
}

impl Engine {
    /// The slot's cached K/V as a full pack sealed with `ctx`'s key. `generation` must rise
    /// with every pack of the same prefix a store or receiver is to accept.
    pub fn export_slot_pack(
        &self,
        slot: usize,
        ctx: &Arc<KvPackContext>,
        generation: u64,
    ) -> Result<Vec<u8>, PackError> {
        let ctx = ctx.clone();
        self.with_slot(slot, move |s| pack_slot(&s, &ctx, generation, None, slot))?
    }

    /// A delta pack for a receiver holding the block ids `held` (its
    /// [`Engine::slot_block_ids`]): only what lies beyond the longest shared block prefix.
    /// A full pack when nothing is shared.
    pub fn export_slot_delta_pack(
        &self,
        slot: usize,
        ctx: &Arc<KvPackContext>,
        generation: u64,
        held: Vec<BlockId>,
    ) -> Result<Vec<u8>, PackError> {
        let ctx = ctx.clone();
        self.with_slot(slot, move |s| {
            pack_slot(&s, &ctx, generation, Some(&held), slot)
        })?
    }

    /// The slot's K/V past the longest block prefix of `held` (all of it when nothing is
    /// shared), for the caller to seal and send off the engine thread.
    pub fn export_slot_state(
        &self,
        slot: usize,
        ctx: &Arc<KvPackContext>,
        held: Vec<BlockId>,
    ) -> Result<SlotExport, PackError> {
        let ctx = ctx.clone();
        let asked = std::time::Instant::now();
        self.with_slot(slot, move |s| {
            let waited = asked.elapsed();
            export_slot(&s, &ctx, Some(&held), slot).map(|e| SlotExport { waited, ..e })
        })?
    }

    /// Restores a full or delta pack of `tokens` into the slot; returns the tokens now cached.
    /// On any failure the slot is left as it was.
    pub fn import_slot_pack(
        &self,
        slot: usize,
        bytes: Arc<Vec<u8>>,
        tokens: Vec<u32>,
        ctx: &Arc<KvPackContext>,
    ) -> Result<usize, PackError> {
        let ctx = ctx.clone();
        self.with_slot(slot, move |s| unpack_into_slot(s, &ctx, &bytes, tokens))?
    }

    /// Ids of the full 256-token blocks the slot holds (what a sender needs for a delta).
    pub fn slot_block_ids(
        &self,
        slot: usize,
        ctx: &Arc<KvPackContext>,
    ) -> Result<Vec<BlockId>, EngineError> {
        let ctx = ctx.clone();
        self.with_slot(slot, move |s| {
            ctx.hasher.chain(s.tokens).block_ids().to_vec()
        })
    }

    /// The tokens whose K/V the slot holds.
    pub fn slot_tokens(&self, slot: usize) -> Result<Vec<u32>, EngineError> {
        self.with_slot(slot, |s| s.tokens.clone())
    }
}
