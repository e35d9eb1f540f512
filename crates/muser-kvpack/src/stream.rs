//! Restore from a byte stream (a pack arriving over the network): the header, manifest and
//! seal are verified as soon as they have arrived, before any K/V byte is accepted; every
//! segment's bytes go straight into the staging state and its SHA-256 is checked when its
//! last byte arrives. Nothing but the staging state and the manifest is kept, so memory is
//! bounded by the K/V the caller budgeted, whatever the sender does; the state is handed out
//! only after the last check ([`StreamRestore::finish`]).
//!
//! With [`StreamRestore::hash_threads`] above one, segments are hashed on worker threads
//! (segment i on worker i mod n, each fed its segments' bytes in order through a bounded
//! channel) while the caller's thread only copies: a digest that does not match stops the
//! restore at the next segment boundary or, at the latest, in `finish`, and the state is
//! never handed out.

use crate::error::{KvpackError, Region, Result};
use crate::keys::Keys;
use crate::pack::{open_parts, Header, Manifest, ReadLimits, HEADER_BYTES, SEAL_BYTES};
use crate::restore::{Expect, Restored};
use crate::state::KvState;
use bytes::Bytes;
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Pieces of segment bytes queued per hashing worker.
const HASH_QUEUE: usize = 8;

/// A pack being verified as its bytes arrive, in order.
pub struct StreamRestore<'a> {
    keys: &'a Keys,
    expect: Expect<'a>,
    limits: &'a ReadLimits,
    max_bytes: u64,
    received: u64,
    hash_threads: usize,
    /// Where the rows go, when the caller gave one ([`StreamRestore::into_assembly`]).
    assembly: Option<Assembly>,
    phase: Phase,
}

/// A state assembled in place from packs that continue one another (the pieces of one long
/// handoff, each a delta past the one before). Rows of positions below
/// [`filled`](Assembly::filled) are written; a pack writes its rows from there on, and
/// drops the sliding-window rows that fall before the assembly's window, so each received
/// row is copied once and a row written is never moved again.
#[derive(Debug)]
pub struct Assembly {
    state: KvState,
    filled: u32,
}

impl Assembly {
    /// An assembly of `state`'s positions with none written yet (`state` is zero-filled,
    /// e.g. [`KvState::prefaulted`]).
    pub fn new(state: KvState) -> Assembly {
        let filled = state.positions.start;
        Assembly { state, filled }
    }

    /// The positions the finished state holds.
    pub fn positions(&self) -> Range<u32> {
        self.state.positions.clone()
    }

    /// Positions below this are written.
    pub fn filled(&self) -> u32 {
        self.filled
    }

    /// The state, once every position is written.
    pub fn into_state(self) -> Result<KvState> {
        if self.filled != self.state.positions.end {
            return Err(KvpackError::DeltaBase(
                "the pieces do not reach the end of the state",
            ));
        }
        Ok(self.state)
    }

    /// Checks that a pack of `positions` continues what is written and fits: it starts at or
    /// before [`filled`](Self::filled), not before the assembly, and ends inside it.
    fn admit(&self, positions: &Range<u32>) -> Result<()> {
        let mine = &self.state.positions;
        if positions.start < mine.start
            || positions.start > self.filled
            || positions.end < self.filled
            || positions.end > mine.end
        {
            return Err(KvpackError::DeltaBase(
                "the pack does not continue the pieces before it",
            ));
        }
        Ok(())
    }
}

enum Phase {
    /// Header, manifest and seal, gathered until complete.
    Head {
        buf: Vec<u8>,
        header: Option<Header>,
    },
    Body(Box<Body>),
    /// A check failed; nothing more is accepted.
    Failed,
}

struct Body {
    manifest: Manifest,
    file_len: u64,
    /// Where the rows go: a staging state of exactly the pack's positions, or the caller's.
    staging: Assembly,
    row_bytes: usize,
    /// Segment being read, its part (per layer K then V), bytes of that part so far.
    seg: usize,
    part: usize,
    at: usize,
    hashing: Hashing,
}

/// Where segment bytes are hashed: here, or on worker threads.
enum Hashing {
    Inline(Sha256),
    Pool(Pool),
}

struct Pool {
    queues: Vec<SyncSender<Piece>>,
    workers: Vec<JoinHandle<()>>,
    /// The first segment whose digest did not match, plus one (0: none yet).
    failed: Arc<AtomicU64>,
}

fn first_failure(failed: &AtomicU64) -> Result<()> {
    match failed.load(Ordering::Relaxed) {
        0 => Ok(()),
        i => Err(KvpackError::SegmentDigest {
            index: (i - 1) as u32,
        }),
    }
}

enum Piece {
    /// A slice of a received chunk, shared with the receiver rather than copied.
    Bytes(Bytes),
    End {
        index: u32,
        sha256: [u8; 32],
    },
}

impl Pool {
    fn new(threads: usize) -> Pool {
        let failed = Arc::new(AtomicU64::new(0));
        let (queues, workers) = (0..threads)
            .map(|_| {
                let (tx, rx) = sync_channel::<Piece>(HASH_QUEUE);
                let failed = failed.clone();
                let worker = std::thread::spawn(move || {
                    let mut h = Sha256::new();
                    for piece in rx {
                        match piece {
                            Piece::Bytes(b) => h.update(&b),
                            Piece::End { index, sha256 } => {
                                let d: [u8; 32] = std::mem::take(&mut h).finalize().into();
                                if d != sha256 {
                                    let _ = failed.compare_exchange(
                                        0,
                                        u64::from(index) + 1,
                                        Ordering::Relaxed,
                                        Ordering::Relaxed,
                                    );
                                    return;
                                }
                            }
                        }
                    }
                });
                (tx, worker)
            })
            .unzip();
        Pool {
            queues,
            workers,
            failed,
        }
    }

    fn check(&self) -> Result<()> {
        first_failure(&self.failed)
    }

    /// Sends a piece to segment `seg`'s worker; a worker gone means it found a mismatch.
    fn send(&self, seg: usize, piece: Piece) -> Result<()> {
        let q = &self.queues[seg % self.queues.len()];
        q.send(piece)
            .map_err(|_| self.check().err().unwrap_or(KvpackError::Cancelled))
    }

    /// Waits for every digest; the first mismatch, if any.
    fn join(self) -> Result<()> {
        let Pool {
            queues,
            workers,
            failed,
        } = self;
        drop(queues);
        let mut all_ran = true;
        for w in workers {
            all_ran &= w.join().is_ok();
        }
        first_failure(&failed)?;
        // a worker that did not run to the end checked nothing: never a pass
        if all_ran {
            Ok(())
        } else {
            Err(KvpackError::Cancelled)
        }
    }
}

impl<'a> StreamRestore<'a> {
    /// A restore expecting `expect`, allocating at most `max_bytes` of K/V.
    pub fn new(
        keys: &'a Keys,
        expect: Expect<'a>,
        limits: &'a ReadLimits,
        max_bytes: u64,
    ) -> StreamRestore<'a> {
        StreamRestore {
            keys,
            expect,
            limits,
            max_bytes,
            received: 0,
            hash_threads: 1,
            assembly: None,
            phase: Phase::Head {
                buf: Vec::with_capacity(HEADER_BYTES),
                header: None,
            },
        }
    }

    /// Hashes segments on `threads` worker threads (1, the default: on the caller's).
    pub fn hash_threads(mut self, threads: usize) -> Self {
        self.hash_threads = threads.max(1);
        self
    }

    /// Writes the pack's rows into `assembly` (which it must continue: see [`Assembly`])
    /// instead of a staging state of its own; [`finish_assembly`](Self::finish_assembly)
    /// gives it back. An assembly with nothing written is made anew, zero-filled, when the
    /// pack starts before it (a delta on fewer blocks than the caller expected).
    pub fn into_assembly(mut self, assembly: Assembly) -> Self {
        self.assembly = Some(assembly);
        self
    }

    /// Bytes accepted so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The verified manifest, once header, manifest and seal have arrived.
    pub fn manifest(&self) -> Option<&Manifest> {
        match &self.phase {
            Phase::Body(b) => Some(&b.manifest),
            _ => None,
        }
    }

    /// Takes the next bytes of the pack. The first failed check is returned, and every later
    /// call fails too.
    pub fn push(&mut self, data: &[u8]) -> Result<()> {
        self.push_from(data, None)
    }

    /// [`push`](Self::push) for a chunk the caller owns as [`Bytes`] (a network body's
    /// frames): hashing workers get slices of it, so each byte is copied once, into the
    /// staging state.
    pub fn push_bytes(&mut self, data: Bytes) -> Result<()> {
        self.push_from(&data, Some(&data))
    }

    /// `data`, which is `shared`'s bytes when the caller owns them as [`Bytes`].
    fn push_from(&mut self, data: &[u8], shared: Option<&Bytes>) -> Result<()> {
        let r = self.take(data, shared);
        if r.is_err() {
            self.phase = Phase::Failed;
        }
        r
    }

    fn take(&mut self, all: &[u8], shared: Option<&Bytes>) -> Result<()> {
        let mut off = 0;
        while off < all.len() {
            let data = &all[off..];
            let n = match &mut self.phase {
                Phase::Failed => return Err(KvpackError::Cancelled),
                Phase::Head { buf, header } => {
                    let want = match header {
                        None => HEADER_BYTES,
                        Some(h) => HEADER_BYTES + h.manifest_len as usize + SEAL_BYTES,
                    };
                    let n = (want - buf.len()).min(data.len());
                    buf.extend_from_slice(&data[..n]);
                    if buf.len() == want {
                        self.advance_head()?;
                    }
                    n
                }
                Phase::Body(b) => b.take(data, shared.map(|s| s.slice(off..)), self.received)?,
            };
            self.received += n as u64;
            off += n;
        }
        Ok(())
    }

    /// Runs the checks of a complete header, or of complete header, manifest and seal.
    fn advance_head(&mut self) -> Result<()> {
        let Phase::Head { buf, header } = &mut self.phase else {
            return Ok(());
        };
        let hb: &[u8; HEADER_BYTES] = buf[..HEADER_BYTES].try_into().expect("header length");
        let Some(h) = *header else {
            // bounded by max_manifest_bytes before the manifest is gathered
            let h = Header::decode(hb, None, self.limits)?;
            *header = Some(h);
            buf.reserve_exact(h.manifest_len as usize + SEAL_BYTES);
            return Ok(());
        };
        let m_end = HEADER_BYTES + h.manifest_len as usize;
        let sb: &[u8; SEAL_BYTES] = buf[m_end..].try_into().expect("seal length");
        let opened = open_parts(hb, h, &buf[HEADER_BYTES..m_end], sb, self.keys, self.limits)?;
        let m = opened.manifest;
        self.expect.check_identity(&m.identity)?;
        if self.expect.cut.is_some_and(|c| c != m.cut_id) {
            return Err(KvpackError::PrefixMismatch);
        }
        let needed = m.segment_bytes();
        if needed > self.max_bytes {
            return Err(KvpackError::OverBudget {
                needed,
                budget: self.max_bytes,
            });
        }
        let layout = &m.identity.layout;
        let p = m.positions();
        let staging = match self.assembly.take() {
            None => Assembly::new(KvState::zeroed(layout.clone(), p)),
            Some(a) if a.state.layout != *layout => {
                return Err(KvpackError::DeltaBase("layouts differ"));
            }
            Some(a) if a.filled == a.state.positions.start && p.start < a.filled => {
                let end = a.state.positions.end.max(p.end);
                let needed = layout.state_bytes(&(p.start..end));
                if needed > self.max_bytes {
                    return Err(KvpackError::OverBudget {
                        needed,
                        budget: self.max_bytes,
                    });
                }
                Assembly::new(KvState::zeroed(layout.clone(), p.start..end))
            }
            Some(a) => a,
        };
        staging.admit(&m.positions())?;
        self.phase = Phase::Body(Box::new(Body {
            row_bytes: m.identity.layout.row_bytes(),
            file_len: h.file_len,
            manifest: m,
            staging,
            seg: 0,
            part: 0,
            at: 0,
            hashing: match self.hash_threads {
                1 => Hashing::Inline(Sha256::new()),
                n => Hashing::Pool(Pool::new(n)),
            },
        }));
        Ok(())
    }

    /// The verified state, when every declared byte arrived and every segment checked out.
    /// After [`into_assembly`](Self::into_assembly), the assembly must be complete with this
    /// pack; else use [`finish_assembly`](Self::finish_assembly).
    pub fn finish(self) -> Result<Restored> {
        let (manifest, staging) = self.finish_assembly()?;
        Ok(Restored {
            manifest,
            state: staging.into_state()?,
        })
    }

    /// The verified manifest and the assembly with this pack's positions written, when every
    /// declared byte arrived and every segment checked out.
    pub fn finish_assembly(self) -> Result<(Manifest, Assembly)> {
        match self.phase {
            Phase::Body(b) if b.seg == b.manifest.segments.len() => {
                if let Hashing::Pool(pool) = b.hashing {
                    pool.join()?;
                }
                let mut staging = b.staging;
                staging.filled = b.manifest.positions().end;
                Ok((b.manifest, staging))
            }
            Phase::Body(b) => Err(KvpackError::Truncated {
                region: Region::Segments,
                needed: b.file_len,
                available: self.received,
            }),
            Phase::Head { header, .. } => Err(KvpackError::Truncated {
                region: if header.is_some() {
                    Region::Manifest
                } else {
                    Region::Header
                },
                needed: header.map_or(HEADER_BYTES as u64, |h| h.file_len),
                available: self.received,
            }),
            Phase::Failed => Err(KvpackError::Cancelled),
        }
    }
}

impl Body {
    /// Copies what of `data` belongs to the current part into the staging state (the rows
    /// it does not hold yet and keeps); returns the bytes taken. Hashing workers get a slice
    /// of `shared` (the same bytes, owned) or, without it, a copy.
    fn take(&mut self, data: &[u8], shared: Option<Bytes>, received: u64) -> Result<usize> {
        let Some(s) = self.manifest.segments.get(self.seg) else {
            return Err(KvpackError::LengthMismatch {
                declared: self.file_len,
                actual: received + data.len() as u64,
            });
        };
        let rb = self.row_bytes;
        let part_len = s.positions.len() * rb;
        let layer = (s.layer_first + self.part as u32 / 2) as usize;
        let is_v = self.part % 2 == 1;
        let n = (part_len - self.at).min(data.len());
        // the part's rows from `keep` on are written: not written before, and in the layer's
        // range (a sliding-window layer keeps only the assembly's last window); the tiling
        // check put every segment inside the pack's range, which the assembly admitted
        let kept = self.staging.state.layer_range(layer);
        let keep = s
            .positions
            .start
            .max(self.staging.filled)
            .max(kept.start)
            .min(s.positions.end);
        let lo = self.at.max((keep - s.positions.start) as usize * rb);
        let hi = self.at + n;
        if lo < hi {
            let kv = &mut self.staging.state.layers[layer];
            let rows = if is_v { &mut kv.v } else { &mut kv.k };
            let to = s.positions.start as usize * rb + lo - kept.start as usize * rb;
            rows[to..to + hi - lo].copy_from_slice(&data[lo - self.at..hi - self.at]);
        }
        match &mut self.hashing {
            Hashing::Inline(h) => h.update(&data[..n]),
            Hashing::Pool(pool) => {
                let piece =
                    shared.map_or_else(|| Bytes::copy_from_slice(&data[..n]), |s| s.slice(..n));
                pool.send(self.seg, Piece::Bytes(piece))?
            }
        }
        self.at += n;
        if self.at == part_len {
            self.at = 0;
            self.part += 1;
            if self.part == 2 * s.layer_count as usize {
                let index = self.seg as u32;
                match &mut self.hashing {
                    Hashing::Inline(h) => {
                        let d: [u8; 32] = std::mem::take(h).finalize().into();
                        if d != s.sha256 {
                            return Err(KvpackError::SegmentDigest { index });
                        }
                    }
                    Hashing::Pool(pool) => {
                        pool.check()?;
                        pool.send(
                            self.seg,
                            Piece::End {
                                index,
                                sha256: s.sha256,
                            },
                        )?;
                    }
                }
                self.seg += 1;
                self.part = 0;
            }
        }
        Ok(n)
    }
}
