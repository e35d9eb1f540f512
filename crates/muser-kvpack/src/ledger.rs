//! Replay ledger: the highest admitted generation of every stream, kept durably.
//!
//! A pack is admitted only with a generation above its stream's high-water mark, so a
//! captured pack can be neither replayed nor rolled back to an older one. The file is
//! rewritten atomically (temporary file, fsync, rename, directory fsync) and sealed with an
//! HMAC under the ledger key; a damaged or forged ledger refuses to load. Deleting the
//! ledger re-opens every old generation to replay: never reset it.

use crate::error::{io_ctx, KvpackError, Result};
use crate::identity::Digest32;
use crate::keys::{ct_eq, Keys};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"MUKVLDG1";
const ENTRY_BYTES: u64 = 40;
/// Most streams one ledger tracks.
pub const MAX_LEDGER_ENTRIES: u64 = 1 << 20;

pub struct Ledger {
    path: PathBuf,
    key: [u8; 32],
    entries: BTreeMap<Digest32, u64>,
}

impl Ledger {
    /// Loads the ledger at `path`; a missing file is an empty ledger.
    pub fn open(path: &Path, keys: &Keys) -> Result<Ledger> {
        let mut ledger = Ledger {
            path: path.to_path_buf(),
            key: keys.ledger,
            entries: BTreeMap::new(),
        };
        let bytes = match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ledger),
            Err(e) => return Err(io_ctx(format!("stat {}", path.display()))(e)),
            Ok(md) if !md.is_file() => {
                return Err(KvpackError::LedgerCorrupt("not a regular file"))
            }
            Ok(md) if md.len() > 12 + 32 + MAX_LEDGER_ENTRIES * ENTRY_BYTES => {
                return Err(KvpackError::LedgerCorrupt(
                    "file larger than the entry limit allows",
                ))
            }
            Ok(_) => std::fs::read(path).map_err(io_ctx(format!("read {}", path.display())))?,
        };
        if bytes.len() < 12 + 32 || &bytes[..8] != MAGIC {
            return Err(KvpackError::LedgerCorrupt("bad magic or too short"));
        }
        let n = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as u64;
        if n > MAX_LEDGER_ENTRIES || bytes.len() as u64 != 12 + n * ENTRY_BYTES + 32 {
            return Err(KvpackError::LedgerCorrupt(
                "length disagrees with the entry count",
            ));
        }
        let (body, tag) = bytes.split_at(bytes.len() - 32);
        if !ct_eq(&ledger.mac(body), tag) {
            return Err(KvpackError::LedgerCorrupt("seal mismatch"));
        }
        let mut prev: Option<Digest32> = None;
        for e in body[12..].chunks_exact(ENTRY_BYTES as usize) {
            let stream: Digest32 = e[..32].try_into().unwrap();
            let generation = u64::from_le_bytes(e[32..].try_into().unwrap());
            if prev.is_some_and(|p| p >= stream) || generation == 0 {
                return Err(KvpackError::LedgerCorrupt("entries not canonical"));
            }
            prev = Some(stream);
            ledger.entries.insert(stream, generation);
        }
        Ok(ledger)
    }

    fn mac(&self, body: &[u8]) -> [u8; 32] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.key).expect("any key length");
        m.update(body);
        m.finalize().into_bytes().into()
    }

    pub fn high_water(&self, stream: &Digest32) -> Option<u64> {
        self.entries.get(stream).copied()
    }

    /// `Ok` when `generation` is above the stream's high-water mark.
    pub fn admit(&self, stream: &Digest32, generation: u64) -> Result<()> {
        let hw = self.high_water(stream).unwrap_or(0);
        if generation <= hw {
            return Err(KvpackError::Replayed {
                generation,
                high_water: hw,
            });
        }
        Ok(())
    }

    /// `Ok` when `generation` was admitted for the stream at some point (it is at most the
    /// high-water mark). A crash after the ledger recorded a newer generation but before
    /// that pack was renamed into place leaves the previous pack current, so a store serves
    /// any admitted generation; it checks separately that it is the one it indexed.
    pub fn check_admitted(&self, stream: &Digest32, generation: u64) -> Result<()> {
        match self.high_water(stream) {
            Some(hw) if generation <= hw => Ok(()),
            _ => Err(KvpackError::NotAdmitted { generation }),
        }
    }

    /// Admits `generation` and makes it durable before returning.
    pub fn record(&mut self, stream: Digest32, generation: u64) -> Result<()> {
        self.admit(&stream, generation)?;
        if !self.entries.contains_key(&stream) && self.entries.len() as u64 >= MAX_LEDGER_ENTRIES {
            return Err(KvpackError::LedgerCorrupt("entry limit reached"));
        }
        let old = self.entries.insert(stream, generation);
        if let Err(e) = self.persist() {
            match old {
                Some(g) => self.entries.insert(stream, g),
                None => self.entries.remove(&stream),
            };
            return Err(e);
        }
        Ok(())
    }

    fn persist(&self) -> Result<()> {
        let mut body = Vec::with_capacity(12 + self.entries.len() * ENTRY_BYTES as usize + 32);
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for (s, g) in &self.entries {
            body.extend_from_slice(s);
            body.extend_from_slice(&g.to_le_bytes());
        }
        let tag = self.mac(&body);
        body.extend_from_slice(&tag);
        write_atomic(&self.path, &body)
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.key.fill(0);
        std::hint::black_box(&self.key);
    }
}

/// Writes `bytes` to `path` so that after a crash the path holds either the old or the new
/// contents: temporary file, fsync, rename, fsync of the directory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    let ctx = |what: &str| io_ctx(format!("{what} {}", tmp.display()));
    let mut f = std::fs::File::create(&tmp).map_err(ctx("create"))?;
    f.write_all(bytes).map_err(ctx("write"))?;
    f.sync_all().map_err(ctx("fsync"))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(ctx("rename"))?;
    sync_dir(dir)
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_ctx(format!("fsync directory {}", dir.display())))
}
