//! The pack format: header, manifest, seal, segments.
//!
//! ```text
//! offset 0    header (128 B)   magic "MUKVPAK\0", version, header length, flags, reserved,
//!                              manifest length, segments length, file length,
//!                              SHA-256 of the manifest, reserved, SHA-256 of bytes 0..96
//! 128         manifest         identity, keyed identity digest, kind (full | delta from a
//!                              block boundary), token count, block ids, cut id, stream,
//!                              generation, segment table, Merkle root
//! 128+M       seal (32 B)      HMAC-SHA256(seal key, domain ‖ header ‖ manifest)
//! 160+M       segments         for each segment (a group of consecutive layers of one
//!                              attention kind × a position range): per layer K rows, V rows
//! ```
//! All integers are little-endian; every encoding is canonical (one byte string per value).

use crate::codec::{Dec, Enc};
use crate::error::{io_ctx, KvpackError, Region, Result};
use crate::identity::{Digest32, KvIdentity, KvLayoutAbi};
use crate::keys::{ct_eq, Keys};
use crate::prefix::{BlockId, PrefixChain, BLOCK_TOKENS};
use crate::state::KvState;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::ops::Range;

pub const MAGIC: [u8; 8] = *b"MUKVPAK\0";
pub const VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 128;
pub const SEAL_BYTES: usize = 32;
const HEADER_DIGEST_AT: usize = 96;
const SEAL_DOMAIN: &[u8] = b"muser-kvpack seal v1\0";

/// Bounds a reader applies to every size it reads, before allocating for it.
#[derive(Debug, Clone)]
pub struct ReadLimits {
    pub max_manifest_bytes: u64,
    pub max_segments: u32,
    pub max_segment_bytes: u64,
    pub max_file_bytes: u64,
    pub max_tokens: u32,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            max_manifest_bytes: 16 << 20,
            max_segments: 1 << 16,
            max_segment_bytes: 1 << 30,
            max_file_bytes: 1 << 40,
            max_tokens: 1 << 22,
        }
    }
}

/// How a writer cuts a state into segments.
#[derive(Debug, Clone, Copy)]
pub struct SegmentPlan {
    /// Consecutive layers of one attention kind per segment.
    pub layers_per_segment: u32,
    /// Positions per segment; a multiple of [`BLOCK_TOKENS`]. Ranges are aligned to it.
    pub tokens_per_segment: u32,
}

impl Default for SegmentPlan {
    fn default() -> Self {
        SegmentPlan {
            layers_per_segment: 4,
            tokens_per_segment: 8 * BLOCK_TOKENS,
        }
    }
}

/// A full pack restores positions `0..token_count`; a delta restores
/// `base_tokens..token_count` on top of a state holding the prefix named `base_cut`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackKind {
    Full,
    Delta { base_tokens: u32, base_cut: BlockId },
}

impl PackKind {
    pub fn from_position(&self) -> u32 {
        match self {
            PackKind::Full => 0,
            PackKind::Delta { base_tokens, .. } => *base_tokens,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentDesc {
    pub layer_first: u32,
    pub layer_count: u32,
    pub positions: Range<u32>,
    pub len: u64,
    pub sha256: Digest32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub identity: KvIdentity,
    pub identity_digest: Digest32,
    pub kind: PackKind,
    pub token_count: u32,
    /// Ids of the full blocks of `0..token_count`.
    pub block_ids: Vec<BlockId>,
    /// Id of the exact prefix `0..token_count`.
    pub cut_id: BlockId,
    /// Replay stream: the ledger keeps one high-water generation per stream.
    pub stream: Digest32,
    pub generation: u64,
    pub segments: Vec<SegmentDesc>,
    pub merkle_root: Digest32,
}

impl Manifest {
    /// Positions the pack restores.
    pub fn positions(&self) -> Range<u32> {
        self.kind.from_position()..self.token_count
    }

    /// Bytes of all segments together.
    pub fn segment_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }

    fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        self.identity.encode(&mut e);
        e.bytes(&self.identity_digest);
        match self.kind {
            PackKind::Full => {
                e.u8(0);
                e.u32(0);
                e.bytes(&[0; 32]);
            }
            PackKind::Delta {
                base_tokens,
                base_cut,
            } => {
                e.u8(1);
                e.u32(base_tokens);
                e.bytes(&base_cut.0);
            }
        }
        e.u32(self.token_count);
        e.u32(self.block_ids.len() as u32);
        for b in &self.block_ids {
            e.bytes(&b.0);
        }
        e.bytes(&self.cut_id.0);
        e.bytes(&self.stream);
        e.u64(self.generation);
        e.u32(self.segments.len() as u32);
        for s in &self.segments {
            e.u32(s.layer_first);
            e.u32(s.layer_count);
            e.u32(s.positions.start);
            e.u32(s.positions.end);
            e.u64(s.len);
            e.bytes(&s.sha256);
        }
        e.bytes(&self.merkle_root);
        e.0
    }

    fn decode(bytes: &[u8], limits: &ReadLimits) -> Result<Manifest> {
        let mut d = Dec::new(bytes, Region::Manifest);
        let identity = KvIdentity::decode(&mut d)?;
        let identity_digest = d.arr32()?;
        let kind_code = d.u8()?;
        let base_tokens = d.u32()?;
        let base_cut = BlockId(d.arr32()?);
        let token_count = d.u32()?;
        if token_count == 0 || token_count > limits.max_tokens {
            return Err(d.malformed("token count out of range"));
        }
        let n_blocks = d.count(
            (token_count / BLOCK_TOKENS) as u64,
            "more block ids than full blocks",
        )?;
        if n_blocks != (token_count / BLOCK_TOKENS) as usize {
            return Err(d.malformed("block id count does not match the token count"));
        }
        let block_ids = (0..n_blocks)
            .map(|_| d.arr32().map(BlockId))
            .collect::<Result<Vec<_>>>()?;
        let kind = match kind_code {
            0 if base_tokens == 0 && base_cut.0 == [0; 32] => PackKind::Full,
            1 if base_tokens > 0
                && base_tokens % BLOCK_TOKENS == 0
                && base_tokens < token_count =>
            {
                if block_ids[(base_tokens / BLOCK_TOKENS) as usize - 1] != base_cut {
                    return Err(d.malformed("delta base is not a block of this prefix"));
                }
                PackKind::Delta {
                    base_tokens,
                    base_cut,
                }
            }
            _ => return Err(d.malformed("invalid pack kind")),
        };
        let cut_id = BlockId(d.arr32()?);
        if token_count % BLOCK_TOKENS == 0 && block_ids.last() != Some(&cut_id) {
            return Err(d.malformed("cut id is not the last block id"));
        }
        let stream = d.arr32()?;
        let generation = d.u64()?;
        if generation == 0 {
            return Err(d.malformed("generation 0"));
        }
        let n_seg = d.count(limits.max_segments as u64, "too many segments")?;
        if n_seg == 0 {
            return Err(d.malformed("no segments"));
        }
        let mut segments = Vec::with_capacity(n_seg);
        for _ in 0..n_seg {
            let layer_first = d.u32()?;
            let layer_count = d.u32()?;
            let start = d.u32()?;
            let end = d.u32()?;
            let len = d.u64()?;
            if len > limits.max_segment_bytes {
                return Err(KvpackError::TooLarge {
                    what: "segment length",
                    declared: len,
                    limit: limits.max_segment_bytes,
                });
            }
            segments.push(SegmentDesc {
                layer_first,
                layer_count,
                positions: start..end,
                len,
                sha256: d.arr32()?,
            });
        }
        let merkle_root = d.arr32()?;
        d.finish()?;
        let m = Manifest {
            identity,
            identity_digest,
            kind,
            token_count,
            block_ids,
            cut_id,
            stream,
            generation,
            segments,
            merkle_root,
        };
        check_tiling(&m.identity.layout, &m.positions(), &m.segments)?;
        Ok(m)
    }
}

/// Segments must cover, for every layer, exactly the positions the layer keeps, in order
/// and without overlap, with lengths that match the geometry.
fn check_tiling(
    layout: &KvLayoutAbi,
    positions: &Range<u32>,
    segments: &[SegmentDesc],
) -> Result<()> {
    let bad = |reason| {
        Err(KvpackError::Malformed {
            region: Region::Manifest,
            reason,
        })
    };
    let n_layer = layout.n_layer as usize;
    let mut cursor: Vec<u32> = (0..n_layer)
        .map(|l| layout.layer_range(l, positions).start)
        .collect();
    let rb = layout.row_bytes() as u64;
    for s in segments {
        let first = s.layer_first as usize;
        let count = s.layer_count as usize;
        if count == 0 || first >= n_layer || count > n_layer - first {
            return bad("segment layers out of range");
        }
        if s.positions.start >= s.positions.end || s.positions.end > positions.end {
            return bad("segment positions out of range");
        }
        for c in &mut cursor[first..first + count] {
            if *c != s.positions.start {
                return bad("segments do not tile the layer's positions");
            }
            *c = s.positions.end;
        }
        let want = (s.positions.len() as u64)
            .checked_mul(rb)
            .and_then(|b| b.checked_mul(2 * count as u64));
        if want != Some(s.len) {
            return bad("segment length disagrees with its geometry");
        }
    }
    if cursor.iter().any(|&c| c != positions.end) {
        return bad("segments leave positions uncovered");
    }
    Ok(())
}

/// Merkle root over segment digests: leaves `SHA-256(0 ‖ index ‖ digest)`, nodes
/// `SHA-256(1 ‖ left ‖ right)`, an odd node is carried up unchanged.
pub fn merkle_root(digests: &[Digest32]) -> Digest32 {
    let mut level: Vec<Digest32> = digests
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut h = Sha256::new();
            h.update([0u8]);
            h.update((i as u32).to_le_bytes());
            h.update(d);
            h.finalize().into()
        })
        .collect();
    if level.is_empty() {
        return Sha256::digest(b"muser-kvpack empty").into();
    }
    while level.len() > 1 {
        level = level
            .chunks(2)
            .map(|p| match p {
                [l, r] => {
                    let mut h = Sha256::new();
                    h.update([1u8]);
                    h.update(l);
                    h.update(r);
                    h.finalize().into()
                }
                [one] => *one,
                _ => unreachable!(),
            })
            .collect();
    }
    level[0]
}

/// Sizes read from the header.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Header {
    pub manifest_len: u64,
    pub segments_len: u64,
    pub file_len: u64,
    pub manifest_sha256: Digest32,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
        // 16..20 flags, 20..24 reserved: zero.
        h[24..32].copy_from_slice(&self.manifest_len.to_le_bytes());
        h[32..40].copy_from_slice(&self.segments_len.to_le_bytes());
        h[40..48].copy_from_slice(&self.file_len.to_le_bytes());
        h[48..80].copy_from_slice(&self.manifest_sha256);
        // 80..96 reserved: zero.
        let d: Digest32 = Sha256::digest(&h[..HEADER_DIGEST_AT]).into();
        h[HEADER_DIGEST_AT..].copy_from_slice(&d);
        h
    }

    /// Decodes and bounds a header; `actual_len` is the source's length when known (a stream
    /// checks the declared length when it ends).
    pub(crate) fn decode(
        h: &[u8; HEADER_BYTES],
        actual_len: Option<u64>,
        limits: &ReadLimits,
    ) -> Result<Header> {
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap());
        if h[0..8] != MAGIC {
            return Err(KvpackError::BadMagic);
        }
        if u32_at(8) != VERSION {
            return Err(KvpackError::UnsupportedVersion(u32_at(8)));
        }
        let d: Digest32 = Sha256::digest(&h[..HEADER_DIGEST_AT]).into();
        if !ct_eq(&d, &h[HEADER_DIGEST_AT..]) {
            return Err(KvpackError::HeaderDigest);
        }
        if u32_at(12) != HEADER_BYTES as u32 {
            return Err(KvpackError::HeaderField("header_len"));
        }
        if u32_at(16) != 0 {
            return Err(KvpackError::HeaderField("flags"));
        }
        if u32_at(20) != 0 || h[80..96].iter().any(|&b| b != 0) {
            return Err(KvpackError::HeaderField("reserved"));
        }
        let hd = Header {
            manifest_len: u64_at(24),
            segments_len: u64_at(32),
            file_len: u64_at(40),
            manifest_sha256: h[48..80].try_into().unwrap(),
        };
        for (what, declared, limit) in [
            (
                "manifest length",
                hd.manifest_len,
                limits.max_manifest_bytes,
            ),
            ("segments length", hd.segments_len, limits.max_file_bytes),
            ("file length", hd.file_len, limits.max_file_bytes),
        ] {
            if declared > limit {
                return Err(KvpackError::TooLarge {
                    what,
                    declared,
                    limit,
                });
            }
        }
        if let Some(actual) = actual_len.filter(|&a| a != hd.file_len) {
            return Err(KvpackError::LengthMismatch {
                declared: hd.file_len,
                actual,
            });
        }
        if HEADER_BYTES as u64 + hd.manifest_len + SEAL_BYTES as u64 + hd.segments_len
            != hd.file_len
        {
            return Err(KvpackError::HeaderField("file_len"));
        }
        Ok(hd)
    }

    pub fn segments_offset(&self) -> u64 {
        HEADER_BYTES as u64 + self.manifest_len + SEAL_BYTES as u64
    }
}

fn seal(keys: &Keys, header: &[u8], manifest: &[u8]) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(&keys.seal).expect("HMAC takes any key length");
    mac.update(SEAL_DOMAIN);
    mac.update(header);
    mac.update(manifest);
    mac
}

/// Something a pack can be read from with positional reads.
pub trait PackSource {
    fn len(&self) -> Result<u64>;
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()>;
    fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}

impl PackSource for [u8] {
    fn len(&self) -> Result<u64> {
        Ok(<[u8]>::len(self) as u64)
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let start = usize::try_from(offset)
            .ok()
            .filter(|&s| s <= <[u8]>::len(self));
        match start.and_then(|s| self.get(s..s.checked_add(buf.len())?)) {
            Some(src) => {
                buf.copy_from_slice(src);
                Ok(())
            }
            None => Err(KvpackError::Truncated {
                region: Region::Segments,
                needed: offset + buf.len() as u64,
                available: <[u8]>::len(self) as u64,
            }),
        }
    }
}

#[cfg(unix)]
impl PackSource for std::fs::File {
    fn len(&self) -> Result<u64> {
        Ok(self.metadata().map_err(io_ctx("stat pack"))?.len())
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset).map_err(io_ctx("read pack"))
    }
}

/// A pack whose header, manifest and seal have been verified; segments not yet read.
#[derive(Debug)]
pub struct OpenedPack {
    pub manifest: Manifest,
    pub(crate) header: Header,
}

/// Reads and verifies the header, manifest, seal, identity digest and Merkle root.
pub fn open_pack<S: PackSource + ?Sized>(
    src: &S,
    keys: &Keys,
    limits: &ReadLimits,
) -> Result<OpenedPack> {
    let actual = src.len()?;
    if actual < HEADER_BYTES as u64 {
        return Err(KvpackError::Truncated {
            region: Region::Header,
            needed: HEADER_BYTES as u64,
            available: actual,
        });
    }
    let mut hb = [0u8; HEADER_BYTES];
    src.read_at(0, &mut hb)?;
    let header = Header::decode(&hb, Some(actual), limits)?;
    // Bounded by max_manifest_bytes and by the file length.
    let mut mb = vec![0u8; header.manifest_len as usize];
    src.read_at(HEADER_BYTES as u64, &mut mb)?;
    let mut sb = [0u8; SEAL_BYTES];
    src.read_at(HEADER_BYTES as u64 + header.manifest_len, &mut sb)?;
    open_parts(&hb, header, &mb, &sb, keys, limits)
}

/// Verifies the manifest of a decoded header against its digest, the seal, the identity
/// digest and the Merkle root (the checks before any segment is read).
pub(crate) fn open_parts(
    hb: &[u8; HEADER_BYTES],
    header: Header,
    mb: &[u8],
    sb: &[u8; SEAL_BYTES],
    keys: &Keys,
    limits: &ReadLimits,
) -> Result<OpenedPack> {
    let md: Digest32 = Sha256::digest(mb).into();
    if !ct_eq(&md, &header.manifest_sha256) {
        return Err(KvpackError::ManifestDigest);
    }
    seal(keys, hb, mb)
        .verify_slice(sb)
        .map_err(|_| KvpackError::SealMismatch)?;
    let manifest = Manifest::decode(mb, limits)?;
    if manifest.identity.digest(keys) != manifest.identity_digest {
        return Err(KvpackError::Malformed {
            region: Region::Manifest,
            reason: "identity digest does not match its fields",
        });
    }
    if manifest.segment_bytes() != header.segments_len {
        return Err(KvpackError::Malformed {
            region: Region::Manifest,
            reason: "segment lengths disagree with the header",
        });
    }
    let digests: Vec<Digest32> = manifest.segments.iter().map(|s| s.sha256).collect();
    if merkle_root(&digests) != manifest.merkle_root {
        return Err(KvpackError::MerkleMismatch);
    }
    Ok(OpenedPack { manifest, header })
}

/// What to pack.
pub struct PackSpec<'a> {
    pub identity: &'a KvIdentity,
    /// Chain of the tokens the state was computed from (at least `state.positions.end`).
    pub chain: &'a PrefixChain,
    /// Replay generation, at least 1 and above every earlier one of the same stream.
    pub generation: u64,
    /// Replay stream; the cut id when `None`.
    pub stream: Option<Digest32>,
    /// 0 for a full pack; otherwise a block boundary the receiver already holds.
    pub base_tokens: u32,
    pub plan: SegmentPlan,
    /// Threads hashing segments ([`crate::default_threads`]).
    pub threads: usize,
}

/// The segment geometry a writer uses: groups of consecutive same-kind layers, ranges split
/// at multiples of `tokens_per_segment`.
fn plan_segments(
    layout: &KvLayoutAbi,
    positions: &Range<u32>,
    plan: &SegmentPlan,
) -> Vec<(u32, u32, Range<u32>)> {
    let mut out = Vec::new();
    let n = layout.n_layer as usize;
    let mut first = 0;
    while first < n {
        let mut count = 1;
        while first + count < n
            && count < plan.layers_per_segment as usize
            && layout.is_swa(first + count) == layout.is_swa(first)
        {
            count += 1;
        }
        let r = layout.layer_range(first, positions);
        let mut p = r.start;
        while p < r.end {
            let next = ((p / plan.tokens_per_segment + 1) * plan.tokens_per_segment).min(r.end);
            out.push((first as u32, count as u32, p..next));
            p = next;
        }
        first += count;
    }
    out
}

/// A pack ready to be written: header, manifest and seal computed, segments still in the
/// state they will be copied from.
pub struct PackPlan<'s> {
    header: [u8; HEADER_BYTES],
    manifest_bytes: Vec<u8>,
    seal: [u8; SEAL_BYTES],
    manifest: Manifest,
    state: &'s KvState,
}

impl<'s> PackPlan<'s> {
    /// Hashes the segments of `state` and seals the manifest.
    pub fn new(state: &'s KvState, keys: &Keys, spec: &PackSpec) -> Result<PackPlan<'s>> {
        let invalid = |m: &str| Err(KvpackError::InvalidState(m.to_string()));
        state.validate()?;
        spec.identity.validate()?;
        if state.layout != spec.identity.layout {
            return invalid("state layout differs from the identity's layout");
        }
        let end = state.positions.end;
        let from = spec.base_tokens;
        if end == 0 || spec.chain.n_tokens() < end {
            return invalid("the prefix chain must cover the state's positions");
        }
        if from > 0 && (!from.is_multiple_of(BLOCK_TOKENS) || from >= end) {
            return invalid("a delta base must be a block boundary before the end");
        }
        if state.positions.start > from {
            return invalid("the state does not hold the positions to pack");
        }
        if spec.generation == 0 {
            return invalid("generation must be at least 1");
        }
        if spec.plan.layers_per_segment == 0
            || spec.plan.tokens_per_segment == 0
            || !spec.plan.tokens_per_segment.is_multiple_of(BLOCK_TOKENS)
        {
            return invalid("segment plan must use whole blocks and at least one layer");
        }
        let block_ids = spec.chain.block_ids()[..(end / BLOCK_TOKENS) as usize].to_vec();
        let cut_id = spec
            .chain
            .cut_id(end)
            .expect("end checked against the chain");
        let kind = if from == 0 {
            PackKind::Full
        } else {
            PackKind::Delta {
                base_tokens: from,
                base_cut: block_ids[(from / BLOCK_TOKENS) as usize - 1],
            }
        };
        let positions = from..end;
        let planned = plan_segments(&state.layout, &positions, &spec.plan);
        let segments: Vec<SegmentDesc> =
            crate::par::par_map(planned, spec.threads, |_, (lf, lc, r)| {
                let mut h = Sha256::new();
                let mut len = 0u64;
                for l in lf..lf + lc {
                    let (k, v) = state.rows(l as usize, &r);
                    h.update(k);
                    h.update(v);
                    len += (k.len() + v.len()) as u64;
                }
                SegmentDesc {
                    layer_first: lf,
                    layer_count: lc,
                    positions: r,
                    len,
                    sha256: h.finalize().into(),
                }
            });
        let digests: Vec<Digest32> = segments.iter().map(|s| s.sha256).collect();
        let manifest = Manifest {
            identity: spec.identity.clone(),
            identity_digest: spec.identity.digest(keys),
            kind,
            token_count: end,
            block_ids,
            cut_id,
            stream: spec.stream.unwrap_or(cut_id.0),
            generation: spec.generation,
            merkle_root: merkle_root(&digests),
            segments,
        };
        let manifest_bytes = manifest.encode();
        let segments_len = manifest.segment_bytes();
        let manifest_len = manifest_bytes.len() as u64;
        let header = Header {
            manifest_len,
            segments_len,
            file_len: HEADER_BYTES as u64 + manifest_len + SEAL_BYTES as u64 + segments_len,
            manifest_sha256: Sha256::digest(&manifest_bytes).into(),
        }
        .encode();
        let seal: [u8; SEAL_BYTES] = seal(keys, &header, &manifest_bytes)
            .finalize()
            .into_bytes()
            .into();
        Ok(PackPlan {
            header,
            manifest_bytes,
            seal,
            manifest,
            state,
        })
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn file_len(&self) -> u64 {
        (HEADER_BYTES + self.manifest_bytes.len() + SEAL_BYTES) as u64
            + self.manifest.segment_bytes()
    }

    /// Streams the pack; segment bytes are copied straight from the state.
    pub fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> std::io::Result<()> {
        w.write_all(&self.header)?;
        w.write_all(&self.manifest_bytes)?;
        w.write_all(&self.seal)?;
        for s in &self.manifest.segments {
            for l in s.layer_first..s.layer_first + s.layer_count {
                let (k, v) = self.state.rows(l as usize, &s.positions);
                w.write_all(k)?;
                w.write_all(v)?;
            }
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.file_len() as usize);
        self.write_to(&mut out)
            .expect("writing to a Vec cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::{CellLayout, KvDtype};

    fn fixture() -> (Keys, Vec<u8>, KvIdentity) {
        let keys = Keys::derive(&[3; 32]);
        let layout = KvLayoutAbi {
            n_layer: 2,
            swa_layers: vec![false, true],
            n_head_kv: 1,
            head_dim: 4,
            n_swa: 100,
            dtype: KvDtype::F16,
            cell_layout: CellLayout::TokenMajor,
        };
        let id = KvIdentity {
            model_weights: [1; 32],
            tokenizer: [2; 32],
            chat_template: [3; 32],
            weight_precision: "F16".into(),
            layout: layout.clone(),
            context_policy: [4; 32],
            engine_abi: "test".into(),
            adapter: None,
        };
        let toks: Vec<u32> = (0..600).collect();
        let hasher = crate::PrefixHasher::new(&keys, &id.digest(&keys));
        let chain = hasher.chain(&toks);
        let mut st = KvState::zeroed(layout, 0..600);
        for (i, l) in st.layers.iter_mut().enumerate() {
            l.k.iter_mut()
                .enumerate()
                .for_each(|(j, b)| *b = (i * 7 + j) as u8);
            l.v.iter_mut()
                .enumerate()
                .for_each(|(j, b)| *b = (i * 3 + j * 5) as u8);
        }
        let spec = PackSpec {
            identity: &id,
            chain: &chain,
            generation: 1,
            stream: None,
            base_tokens: 0,
            plan: SegmentPlan {
                layers_per_segment: 1,
                tokens_per_segment: 256,
            },
            threads: 2,
        };
        let bytes = PackPlan::new(&st, &keys, &spec).unwrap().to_bytes();
        (keys, bytes, id)
    }

    /// Re-encodes a changed manifest with a valid header and seal, as the key holder could.
    fn reseal(keys: &Keys, bytes: &[u8], edit: impl FnOnce(&mut Manifest)) -> Vec<u8> {
        reseal_raw(keys, bytes, |mb| {
            let mut m = Manifest::decode(mb, &ReadLimits::default()).unwrap();
            edit(&mut m);
            *mb = m.encode();
        })
    }

    /// Same, editing the manifest bytes directly (to write values the encoder cannot).
    fn reseal_raw(keys: &Keys, bytes: &[u8], edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let p = open_pack(bytes, keys, &ReadLimits::default()).unwrap();
        let segs = &bytes[p.header.segments_offset() as usize..];
        let mut mb = bytes[HEADER_BYTES..HEADER_BYTES + p.header.manifest_len as usize].to_vec();
        edit(&mut mb);
        let header = Header {
            manifest_len: mb.len() as u64,
            segments_len: segs.len() as u64,
            file_len: (HEADER_BYTES + mb.len() + SEAL_BYTES + segs.len()) as u64,
            manifest_sha256: Sha256::digest(&mb).into(),
        }
        .encode();
        let s: [u8; 32] = seal(keys, &header, &mb).finalize().into_bytes().into();
        [&header[..], &mb, &s, segs].concat()
    }

    fn open(keys: &Keys, b: &[u8]) -> Result<OpenedPack> {
        open_pack(b, keys, &ReadLimits::default())
    }

    #[test]
    fn reseal_without_edit_is_accepted() {
        let (keys, bytes, _) = fixture();
        assert_eq!(reseal(&keys, &bytes, |_| {}), bytes);
    }

    #[test]
    fn unknown_codes_and_stray_bits_are_rejected() {
        let (keys, bytes, _) = fixture();
        // Identity: 3 digests, precision "F16" (4 + 3), layout: n_layer (4), SWA bits (1),
        // heads (4), head dim (4), window (4), dtype (1), cell layout (1).
        let swa_bits = 32 * 3 + 7 + 4;
        let dtype = swa_bits + 1 + 12;
        let cell = dtype + 1;
        for (at, value) in [(cell, 2u8), (cell, 0), (dtype, 3), (swa_bits, 0b110)] {
            let b = reseal_raw(&keys, &bytes, |mb| mb[at] = value);
            assert!(
                matches!(open(&keys, &b), Err(KvpackError::Malformed { .. })),
                "byte {at} = {value}: {:?}",
                open(&keys, &b).map(|_| ())
            );
        }
        // Trailing bytes after the Merkle root.
        let b = reseal_raw(&keys, &bytes, |mb| mb.push(0));
        assert!(matches!(
            open(&keys, &b),
            Err(KvpackError::Malformed { .. })
        ));
    }

    #[test]
    fn merkle_root_mismatch_is_rejected() {
        let (keys, bytes, _) = fixture();
        let b = reseal(&keys, &bytes, |m| m.merkle_root[0] ^= 1);
        assert!(matches!(open(&keys, &b), Err(KvpackError::MerkleMismatch)));
    }

    #[test]
    fn oversized_segment_length_is_rejected() {
        let (keys, bytes, _) = fixture();
        let b = reseal(&keys, &bytes, |m| m.segments[0].len = u64::MAX);
        assert!(matches!(
            open(&keys, &b),
            Err(KvpackError::TooLarge {
                what: "segment length",
                ..
            })
        ));
    }

    #[test]
    fn non_tiling_segments_are_rejected() {
        let (keys, bytes, _) = fixture();
        for edit in [
            (|m: &mut Manifest| m.segments[0].positions.end -= 1) as fn(&mut Manifest),
            |m| m.segments[1].layer_first = 5,
            |m| {
                m.segments.pop();
            },
            |m| m.segments.swap(0, 1),
            |m| m.generation = 0,
            |m| m.block_ids.truncate(1),
            |m| m.identity_digest[0] ^= 1,
            |m| {
                m.kind = PackKind::Delta {
                    base_tokens: 100,
                    base_cut: m.block_ids[0],
                }
            },
        ] {
            let b = reseal(&keys, &bytes, edit);
            assert!(
                matches!(open(&keys, &b), Err(KvpackError::Malformed { .. })),
                "{:?}",
                open(&keys, &b)
            );
        }
    }

    #[test]
    fn merkle_root_depends_on_order_and_count() {
        let d = [[1u8; 32], [2; 32], [3; 32]];
        assert_ne!(merkle_root(&d), merkle_root(&[d[1], d[0], d[2]]));
        assert_ne!(merkle_root(&d), merkle_root(&d[..2]));
        assert_ne!(merkle_root(&d[..1]), d[0]);
    }
}
