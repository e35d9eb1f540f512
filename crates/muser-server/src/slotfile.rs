//! Slot images: one slot's cached tokens and K/V, saved to and restored from files under
//! `--slot-save-path`, and carried inside session bundles. Layout (little endian):
//!
//! ```text
//! "muser.slot.v2\n" | n_tokens u32 | tokens u32 × n | kvpack pack (docs/kvpack.md)
//! ```
//!
//! The pack is sealed with the server's operator key and names the model's identity
//! (weights content, tokenizer, template, precision, KV layout, context policy, engine ABI)
//! and the keyed prefix id of the tokens, so a file restores only into the model, cache
//! geometry and server key that wrote it, and only with the tokens it was made from. Restore
//! reads at most the bytes a full slot can take and verifies everything (header, seal,
//! identity, prefix, every segment's SHA-256) into a staging state before the slot's cache
//! and tokens are replaced.

use crate::error::{ApiError, ApiResult};
use muser_engine::{Engine, KvPackContext, PackError};
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

const MAGIC: &[u8] = b"muser.slot.v2\n";

/// Most manifest, header and seal bytes a pack of a slot adds to its K/V.
const PACK_OVERHEAD: u64 = 16 << 20;

fn slot_error(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(axum::http::StatusCode::CONFLICT, "conflict", e.to_string())
}

fn context(ctx: Option<&Arc<KvPackContext>>) -> ApiResult<&Arc<KvPackContext>> {
    ctx.ok_or_else(|| ApiError::internal("slot files need the server's kvpack key"))
}

/// A generation that rises across saves (the replay ledger of a store needs one).
fn generation() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
        .max(1)
}

/// A slot's image: its tokens and their K/V as a sealed pack (the layout above); returns
/// the bytes and the number of tokens.
pub fn image(
    engine: &Engine,
    ctx: Option<&Arc<KvPackContext>>,
    id: usize,
) -> ApiResult<(Vec<u8>, usize)> {
    let ctx = context(ctx)?;
    let tokens = engine.slot_tokens(id).map_err(slot_error)?;
    let pack = engine
        .export_slot_pack(id, ctx, generation())
        .map_err(slot_error)?;
    let mut out = Vec::with_capacity(MAGIC.len() + 4 + 4 * tokens.len() + pack.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in &tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&pack);
    Ok((out, tokens.len()))
}

/// The most bytes an image of one slot of `n_ctx` tokens can take.
pub fn max_image_bytes(ctx: &KvPackContext, n_ctx: usize) -> u64 {
    let n_ctx = n_ctx as u64;
    let row = ctx.identity.layout.row_bytes() as u64;
    MAGIC.len() as u64
        + 4
        + 4 * n_ctx
        + 2 * u64::from(ctx.identity.layout.n_layer) * n_ctx * row
        + PACK_OVERHEAD
}

/// Restores slot `id` from an image (`what` names it in errors); returns the tokens restored.
pub fn restore_image(
    engine: &Engine,
    ctx: Option<&Arc<KvPackContext>>,
    id: usize,
    bytes: &[u8],
    what: &str,
) -> ApiResult<usize> {
    let ctx = context(ctx)?;
    let (tokens, pack) = split(bytes, engine.config().n_ctx)
        .map_err(|m| ApiError::bad_request(format!("{what}: {m}")))?;
    engine
        .import_slot_pack(id, Arc::new(pack.to_vec()), tokens, ctx)
        .map_err(|e| match e {
            PackError::Engine(e) => slot_error(e),
            PackError::Pack(e) => ApiError::bad_request(format!(
                "{what}: verification (checksum, seal or identity) failed: {e}"
            )),
            e => ApiError::bad_request(format!("{what}: {e}")),
        })
}

/// Saves slot `id` to `path`, refused (507) when the files of its directory would exceed
/// `quota_bytes` (the file it replaces not counted); returns the number of tokens saved.
pub fn save(
    engine: &Engine,
    ctx: Option<&Arc<KvPackContext>>,
    id: usize,
    path: &Path,
    quota_bytes: u64,
) -> ApiResult<usize> {
    let (out, n) = image(engine, ctx, id)?;
    let others = dir_bytes_except(path);
    if others.saturating_add(out.len() as u64) > quota_bytes {
        return Err(ApiError::new(
            axum::http::StatusCode::INSUFFICIENT_STORAGE,
            "quota_exceeded",
            format!(
                "saving {} bytes would take the slot files past their quota of {quota_bytes} bytes ({others} used): erase some, or raise --slot-save-quota-mib",
                out.len()
            ),
        ));
    }
    muser_store::write_atomic(path, &out).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(n)
}

/// Bytes of the files beside `path` in its directory, `path` itself not counted.
fn dir_bytes_except(path: &Path) -> u64 {
    let Some(dir) = path.parent().and_then(|d| std::fs::read_dir(d).ok()) else {
        return 0;
    };
    dir.flatten()
        .filter(|e| e.path() != path)
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Restores slot `id` from `path`; returns the number of tokens restored.
pub fn restore(
    engine: &Engine,
    ctx: Option<&Arc<KvPackContext>>,
    id: usize,
    path: &Path,
) -> ApiResult<usize> {
    let limit = max_image_bytes(context(ctx)?, engine.config().n_ctx);
    let what = format!("slot file {}", file_name(path));
    let file = std::fs::File::open(path)
        .map_err(|e| ApiError::not_found("not_found", format!("{what}: {e}")))?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ApiError::bad_request(format!("{what}: {e}")))?;
    if bytes.len() as u64 > limit {
        return Err(ApiError::bad_request(format!(
            "{what} is larger than a slot can hold"
        )));
    }
    restore_image(engine, ctx, id, &bytes, &what)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The tokens and the pack of a slot file.
fn split(bytes: &[u8], n_ctx: usize) -> Result<(Vec<u32>, &[u8]), String> {
    let body = bytes
        .strip_prefix(MAGIC)
        .ok_or("not a muser slot file (v2)")?;
    let (n, rest) = body.split_at_checked(4).ok_or("truncated")?;
    let n = u32::from_le_bytes(n.try_into().map_err(|_| "truncated")?) as usize;
    if n == 0 || n >= n_ctx {
        return Err(format!("{n} tokens do not fit a slot of {n_ctx}"));
    }
    let (toks, pack) = rest.split_at_checked(4 * n).ok_or("truncated")?;
    let tokens = toks
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((tokens, pack))
}
