//! Bounded, abortable restore: everything is verified into a staging state, which is
//! returned only after the last check passes.

use crate::error::{KvpackError, Result};
use crate::identity::KvIdentity;
use crate::keys::Keys;
use crate::pack::{open_pack, Manifest, OpenedPack, PackKind, PackSource, ReadLimits, SegmentDesc};
use crate::prefix::BlockId;
use crate::state::KvState;
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Bounds on one restore.
#[derive(Debug, Clone, Copy)]
pub struct RestoreControl<'a> {
    /// Most bytes of KV the restore may allocate.
    pub max_bytes: u64,
    /// Checked between segment parts.
    pub deadline: Option<Instant>,
    /// Set to abort; checked between segment parts.
    pub cancel: Option<&'a AtomicBool>,
}

impl Default for RestoreControl<'_> {
    fn default() -> Self {
        RestoreControl {
            max_bytes: 64 << 30,
            deadline: None,
            cancel: None,
        }
    }
}

impl RestoreControl<'_> {
    fn check(&self) -> Result<()> {
        if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(KvpackError::Cancelled);
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(KvpackError::DeadlineExceeded);
        }
        Ok(())
    }
}

/// What the caller expects the pack to be.
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    pub identity: &'a KvIdentity,
    /// Cut id of the caller's tokens at the pack's length, when known.
    pub cut: Option<BlockId>,
}

/// A verified pack and its KV state.
#[derive(Debug)]
pub struct Restored {
    pub manifest: Manifest,
    pub state: KvState,
}

/// Reads every segment part (each layer's K then V rows), checks it against its digest, and
/// hands it to `place`. Control is checked between parts.
fn read_segments<S: PackSource + ?Sized>(
    src: &S,
    pack: &OpenedPack,
    control: &RestoreControl,
    mut place: impl FnMut(&SegmentDesc, usize, bool, &[u8]),
) -> Result<()> {
    let rb = pack.manifest.identity.layout.row_bytes() as u64;
    let mut offset = pack.header.segments_offset();
    let mut scratch = Vec::new();
    for (index, s) in pack.manifest.segments.iter().enumerate() {
        let part = s.positions.len() as u64 * rb;
        // Bounded: a part is at most a segment, and segments are bounded by the limits.
        scratch.resize(part as usize, 0);
        let mut h = Sha256::new();
        for l in s.layer_first as usize..(s.layer_first + s.layer_count) as usize {
            for is_v in [false, true] {
                control.check()?;
                src.read_at(offset, &mut scratch)?;
                offset += part;
                h.update(&scratch);
                place(s, l, is_v, &scratch);
            }
        }
        let d: [u8; 32] = h.finalize().into();
        if d != s.sha256 {
            return Err(KvpackError::SegmentDigest {
                index: index as u32,
            });
        }
    }
    Ok(())
}

/// Verifies a whole pack (header, manifest, seal, Merkle root, every segment) without
/// checking it against an identity. Returns the manifest.
pub fn verify_pack<S: PackSource + ?Sized>(
    src: &S,
    keys: &Keys,
    limits: &ReadLimits,
) -> Result<Manifest> {
    let pack = open_pack(src, keys, limits)?;
    read_segments(src, &pack, &RestoreControl::default(), |_, _, _, _| {})?;
    Ok(pack.manifest)
}

/// Restores a pack: verifies structure, seal, identity (field by field), prefix, budget,
/// then reads and checks every segment into a staging state. A delta pack gives the state
/// of its own positions; [`KvState::append`] puts it on top of the base.
pub fn restore<S: PackSource + ?Sized>(
    src: &S,
    keys: &Keys,
    expect: &Expect,
    limits: &ReadLimits,
    control: &RestoreControl,
) -> Result<Restored> {
    control.check()?;
    let pack = open_pack(src, keys, limits)?;
    let m = &pack.manifest;
    expect.identity.check_matches(&m.identity)?;
    if expect.cut.is_some_and(|c| c != m.cut_id) {
        return Err(KvpackError::PrefixMismatch);
    }
    let needed = m.segment_bytes();
    if needed > control.max_bytes {
        return Err(KvpackError::OverBudget {
            needed,
            budget: control.max_bytes,
        });
    }
    let mut staging = KvState::zeroed(m.identity.layout.clone(), m.positions());
    let rb = staging.layout.row_bytes();
    let ranges: Vec<_> = (0..staging.layers.len())
        .map(|l| staging.layer_range(l))
        .collect();
    read_segments(src, &pack, control, |s, l, is_v, bytes| {
        let at = (s.positions.start - ranges[l].start) as usize * rb;
        let layer = &mut staging.layers[l];
        let dst = if is_v { &mut layer.v } else { &mut layer.k };
        dst[at..at + bytes.len()].copy_from_slice(bytes);
    })?;
    Ok(Restored {
        manifest: pack.manifest,
        state: staging,
    })
}

/// Puts a restored delta on top of `base`, which must hold exactly the delta's base prefix
/// (`base_cut` is the caller's cut id of `base`).
pub fn apply_delta(base: &KvState, base_cut: BlockId, delta: &Restored) -> Result<KvState> {
    match delta.manifest.kind {
        PackKind::Delta {
            base_tokens,
            base_cut: want,
        } => {
            if base_tokens != base.positions.end || want != base_cut {
                return Err(KvpackError::DeltaBase(
                    "the base does not hold the delta's prefix",
                ));
            }
            base.append(&delta.state)
        }
        PackKind::Full => Err(KvpackError::DeltaBase("not a delta pack")),
    }
}
