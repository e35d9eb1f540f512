//! Bounded, abortable restore: everything is verified into a staging state, which is
//! returned only after the last check passes.

use crate::error::{KvpackError, Result};
use crate::identity::KvIdentity;
use crate::keys::Keys;
use crate::pack::{open_pack, Manifest, OpenedPack, PackKind, PackSource, ReadLimits, SegmentDesc};
use crate::par::{default_threads, par_map};
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
    /// Threads verifying segments (segments are independent).
    pub threads: usize,
}

impl Default for RestoreControl<'_> {
    fn default() -> Self {
        RestoreControl {
            max_bytes: 64 << 30,
            deadline: None,
            cancel: None,
            threads: default_threads(),
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
    /// Engine ABIs accepted besides the identity's own (a consumer's configured producers);
    /// every other field must still match exactly.
    pub other_abis: &'a [String],
}

impl Expect<'_> {
    /// Checks a pack's identity field by field; its `engine_abi` may also be one of
    /// `other_abis`.
    pub fn check_identity(&self, found: &KvIdentity) -> Result<()> {
        if found.engine_abi != self.identity.engine_abi
            && self.other_abis.contains(&found.engine_abi)
        {
            let mut own = self.identity.clone();
            own.engine_abi.clone_from(&found.engine_abi);
            return own.check_matches(found);
        }
        self.identity.check_matches(found)
    }
}

/// A verified pack and its KV state.
#[derive(Debug)]
pub struct Restored {
    pub manifest: Manifest,
    pub state: KvState,
}

/// Destination of one segment: per layer of its group, the K and V rows it fills.
type Parts<'a> = Vec<(&'a mut [u8], &'a mut [u8])>;

/// Splits the staging state into the disjoint slices each segment fills. Relies on the
/// tiling checked at open: per layer, segments come in position order and cover it exactly.
fn split_staging<'a>(staging: &'a mut KvState, segments: &[SegmentDesc]) -> Vec<Parts<'a>> {
    let rb = staging.layout.row_bytes();
    let mut rest: Vec<(&'a mut [u8], &'a mut [u8])> = staging
        .layers
        .iter_mut()
        .map(|l| (&mut l.k[..], &mut l.v[..]))
        .collect();
    segments
        .iter()
        .map(|s| {
            (s.layer_first..s.layer_first + s.layer_count)
                .map(|l| {
                    let n = s.positions.len() * rb;
                    let (k, v) = std::mem::take(&mut rest[l as usize]);
                    let (k0, k1) = k.split_at_mut(n);
                    let (v0, v1) = v.split_at_mut(n);
                    rest[l as usize] = (k1, v1);
                    (k0, v0)
                })
                .collect()
        })
        .collect()
}

/// Reads segment `index` at `offset` part by part (each layer's K, then V rows), into
/// `parts` when given (else a scratch buffer), and checks its digest. Control is checked
/// before every part.
fn check_segment<S: PackSource + ?Sized>(
    src: &S,
    index: usize,
    s: &SegmentDesc,
    offset: u64,
    rb: usize,
    parts: Option<Parts>,
    control: &RestoreControl,
) -> Result<()> {
    let part = s.positions.len() * rb;
    let mut h = Sha256::new();
    let mut at = offset;
    let mut read = |buf: &mut [u8]| -> Result<()> {
        control.check()?;
        src.read_at(at, buf)?;
        at += part as u64;
        h.update(&*buf);
        Ok(())
    };
    match parts {
        Some(parts) => {
            for (k, v) in parts {
                read(k)?;
                read(v)?;
            }
        }
        None => {
            // Bounded: a part is at most a segment, and segments are bounded by the limits.
            let mut scratch = vec![0u8; part];
            for _ in 0..2 * s.layer_count {
                read(&mut scratch)?;
            }
        }
    }
    let d: [u8; 32] = h.finalize().into();
    if d != s.sha256 {
        return Err(KvpackError::SegmentDigest {
            index: index as u32,
        });
    }
    Ok(())
}

/// Checks every segment, in parallel, filling `staging` when given. Workers stop at the
/// first failure; the failure of the lowest segment index is reported.
fn read_segments<S: PackSource + Sync + ?Sized>(
    src: &S,
    pack: &OpenedPack,
    control: &RestoreControl,
    staging: Option<&mut KvState>,
) -> Result<()> {
    let segs = &pack.manifest.segments;
    let rb = pack.manifest.identity.layout.row_bytes();
    let mut offsets = Vec::with_capacity(segs.len());
    let mut at = pack.header.segments_offset();
    for s in segs {
        offsets.push(at);
        at += s.len;
    }
    let parts: Vec<Option<Parts>> = match staging {
        Some(st) => split_staging(st, segs).into_iter().map(Some).collect(),
        None => (0..segs.len()).map(|_| None).collect(),
    };
    let failed = AtomicBool::new(false);
    let results = par_map(parts, control.threads, |i, p| {
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let r = check_segment(src, i, &segs[i], offsets[i], rb, p, control);
        if r.is_err() {
            failed.store(true, Ordering::Relaxed);
        }
        r
    });
    results.into_iter().collect()
}

/// Verifies a whole pack (header, manifest, seal, Merkle root, every segment) without
/// checking it against an identity. Returns the manifest.
pub fn verify_pack<S: PackSource + Sync + ?Sized>(
    src: &S,
    keys: &Keys,
    limits: &ReadLimits,
) -> Result<Manifest> {
    let pack = open_pack(src, keys, limits)?;
    read_segments(src, &pack, &RestoreControl::default(), None)?;
    Ok(pack.manifest)
}

/// Restores a pack: verifies structure, seal, identity (field by field), prefix, budget,
/// then reads and checks every segment into a staging state. A delta pack gives the state
/// of its own positions; [`KvState::append`] puts it on top of the base.
pub fn restore<S: PackSource + Sync + ?Sized>(
    src: &S,
    keys: &Keys,
    expect: &Expect,
    limits: &ReadLimits,
    control: &RestoreControl,
) -> Result<Restored> {
    control.check()?;
    let pack = open_pack(src, keys, limits)?;
    let m = &pack.manifest;
    expect.check_identity(&m.identity)?;
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
    read_segments(src, &pack, control, Some(&mut staging))?;
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
