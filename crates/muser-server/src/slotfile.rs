//! Slot files: one slot's cached tokens and K/V, saved to and restored from
//! `--slot-save-path`. Layout (little endian):
//!
//! ```text
//! "muser.slot.v1\n" | identity [32] | n_tokens u32 | tokens u32 × n | n_layer u32 |
//! per layer: k_len u64, k bytes, v_len u64, v bytes | sha256 of everything before [32]
//! ```
//!
//! The identity is a SHA-256 over the model's vocabulary size, file size and KV layout, so a
//! file restores only into the model and cache geometry that wrote it. Restore reads at most
//! the bytes a full slot can take, checks the digest and identity before touching the cache,
//! and the K/V import validates every layer size.

use crate::error::{ApiError, ApiResult};
use muser_engine::{Engine, SlotKv};
use muser_model::{KvLayout, KvSnapshot, LayerKv};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

const MAGIC: &[u8] = b"muser.slot.v1\n";

fn identity(s: &SlotKv<'_>) -> [u8; 32] {
    let info = s.model.info();
    let mut h = Sha256::new();
    h.update(format!("{}|{:?}|{:?}", info.n_vocab, info.file_bytes, s.kv.layout()).as_bytes());
    h.finalize().into()
}

/// Largest valid file for this cache: used to bound the read.
fn max_file_bytes(s: &SlotKv<'_>) -> u64 {
    let layout = s.kv.layout();
    let n_ctx = u64::from(s.kv.n_ctx());
    let rows = n_ctx * layout.row_bytes() as u64;
    MAGIC.len() as u64 + 32 + 4 + 4 * n_ctx + 4 + layout.n_layer as u64 * 2 * (8 + rows) + 32
}

fn slot_error(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(axum::http::StatusCode::CONFLICT, "conflict", e.to_string())
}

/// Saves slot `id` to `path`; returns the number of tokens saved.
pub fn save(engine: &Engine, id: usize, path: &Path) -> ApiResult<usize> {
    let bytes = engine
        .with_slot(id, |s| -> Result<Vec<u8>, String> {
            let n = s.tokens.len() as u32;
            let snap = s.kv.export(s.seq, 0..n).map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            out.extend_from_slice(MAGIC);
            out.extend_from_slice(&identity(&s));
            out.extend_from_slice(&n.to_le_bytes());
            for t in s.tokens.iter() {
                out.extend_from_slice(&t.to_le_bytes());
            }
            out.extend_from_slice(&(snap.layers.len() as u32).to_le_bytes());
            for layer in &snap.layers {
                for part in [&layer.k, &layer.v] {
                    out.extend_from_slice(&(part.len() as u64).to_le_bytes());
                    out.extend_from_slice(part);
                }
            }
            let digest: [u8; 32] = Sha256::digest(&out).into();
            out.extend_from_slice(&digest);
            Ok(out)
        })
        .map_err(slot_error)?
        .map_err(slot_error)?;
    let n_tokens = u32::from_le_bytes(
        bytes[MAGIC.len() + 32..MAGIC.len() + 36]
            .try_into()
            .unwrap_or_default(),
    );
    crate::store::write_atomic(path, &bytes).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(n_tokens as usize)
}

/// Restores slot `id` from `path`; returns the number of tokens restored.
pub fn restore(engine: &Engine, id: usize, path: &Path) -> ApiResult<usize> {
    let file = std::fs::File::open(path).map_err(|e| {
        ApiError::not_found("not_found", format!("slot file {}: {e}", file_name(path)))
    })?;
    let path_name = file_name(path);
    engine
        .with_slot(id, move |s| -> ApiResult<usize> {
            let limit = max_file_bytes(&s);
            let mut bytes = Vec::new();
            file.take(limit + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| ApiError::bad_request(format!("slot file {path_name}: {e}")))?;
            if bytes.len() as u64 > limit {
                return Err(ApiError::bad_request(format!(
                    "slot file {path_name} is larger than a slot can hold"
                )));
            }
            let (tokens, snap) = parse(&bytes, &identity(&s), s.kv.layout().clone())
                .map_err(|m| ApiError::bad_request(format!("slot file {path_name}: {m}")))?;
            if tokens.len() > s.kv.n_ctx() as usize {
                return Err(ApiError::bad_request(
                    "slot file holds more tokens than a slot",
                ));
            }
            s.kv.clear(s.seq);
            s.tokens.clear();
            s.kv.import(s.seq, &snap)
                .map_err(|e| ApiError::bad_request(format!("slot file {path_name}: {e}")))?;
            *s.tokens = tokens;
            Ok(s.tokens.len())
        })
        .map_err(slot_error)?
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A bounds-checked reader over the file's bytes.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.0.len() {
            return Err("truncated".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().map_err(|_| "truncated")?,
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().map_err(|_| "truncated")?,
        ))
    }
}

fn parse(
    bytes: &[u8],
    want_identity: &[u8; 32],
    layout: KvLayout,
) -> Result<(Vec<u32>, KvSnapshot), String> {
    if bytes.len() < MAGIC.len() + 32 + 32 || !bytes.starts_with(MAGIC) {
        return Err("not a muser slot file".into());
    }
    let (body, digest) = bytes.split_at(bytes.len() - 32);
    if Sha256::digest(body).as_slice() != digest {
        return Err("checksum mismatch (corrupt or truncated)".into());
    }
    let mut c = Cursor(&body[MAGIC.len()..]);
    if c.take(32)? != want_identity {
        return Err("written for another model or cache layout".into());
    }
    let n = c.u32()? as usize;
    if n > c.0.len() / 4 {
        return Err("truncated".into());
    }
    let tokens = (0..n).map(|_| c.u32()).collect::<Result<Vec<_>, _>>()?;
    let n_layer = c.u32()? as usize;
    if n_layer > c.0.len() / 16 {
        return Err("truncated".into());
    }
    let mut layers = Vec::with_capacity(n_layer);
    for _ in 0..n_layer {
        let k_len = usize::try_from(c.u64()?).map_err(|_| "bad length")?;
        let k = c.take(k_len)?.to_vec();
        let v_len = usize::try_from(c.u64()?).map_err(|_| "bad length")?;
        let v = c.take(v_len)?.to_vec();
        layers.push(LayerKv { k, v });
    }
    if !c.0.is_empty() {
        return Err("trailing bytes".into());
    }
    Ok((
        tokens,
        KvSnapshot {
            layout,
            positions: 0..n as u32,
            layers,
        },
    ))
}
