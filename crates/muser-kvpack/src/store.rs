//! Durable store: a directory of immutable full packs with a byte budget, LRU eviction, a
//! replay ledger and start-up recovery.
//!
//! ```text
//! root/ledger.bin              replay ledger (see ledger.rs)
//! root/packs/<cut>.<gen>.kvpack   published packs, never modified
//! root/tmp/                    packs being written; emptied at start-up
//! root/quarantine/             packs that failed verification at start-up
//! ```
//! Publication: write `tmp/…`, fsync it, record the generation in the ledger (durable),
//! rename into `packs/`, fsync `packs/`. A pack is visible only once complete and durable;
//! a crash at any point leaves either no new pack or a complete one.

use crate::error::{io_ctx, KvpackError, Result};
use crate::identity::Digest32;
use crate::identity::KvIdentity;
use crate::keys::Keys;
use crate::ledger::{sync_dir, Ledger};
use crate::pack::{open_pack, Manifest, PackKind, PackPlan, ReadLimits};
use crate::prefix::{BlockId, PrefixChain};
use crate::restore::{restore, verify_pack, Expect, RestoreControl, Restored};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub root: PathBuf,
    /// Most bytes of packs kept; the least recently used are evicted beyond it.
    pub budget_bytes: u64,
    pub limits: ReadLimits,
    /// Verify every segment of every pack at start-up (otherwise header, manifest and seal).
    pub verify_segments_on_open: bool,
}

impl StoreConfig {
    pub fn new(root: impl Into<PathBuf>, budget_bytes: u64) -> Self {
        StoreConfig {
            root: root.into(),
            budget_bytes,
            limits: ReadLimits::default(),
            verify_segments_on_open: true,
        }
    }
}

/// What start-up recovery did.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    pub kept: usize,
    pub removed_partial: usize,
    pub removed_stale: usize,
    /// File name and reason of each pack moved to `quarantine/`.
    pub quarantined: Vec<(String, String)>,
    pub evicted: usize,
}

#[derive(Debug, Clone)]
struct Entry {
    file: String,
    token_count: u32,
    generation: u64,
    bytes: u64,
    last_used: u64,
}

/// Writes packs into a store's `tmp/` ([`PackStore::stager`]).
#[derive(Debug, Clone)]
pub struct Stager {
    tmp: PathBuf,
    budget_bytes: u64,
    seq: Arc<AtomicU64>,
}

impl Stager {
    /// Writes `plan` under `tmp/` and fsyncs it (the replay ledger is checked at commit).
    pub fn stage(&self, plan: &PackPlan) -> Result<StagedPack> {
        self.stage_with(plan.manifest().clone(), plan.file_len(), |w| {
            plan.write_to(w)
        })
    }

    fn stage_with(
        &self,
        m: Manifest,
        file_len: u64,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<StagedPack> {
        if m.kind != PackKind::Full {
            return Err(KvpackError::InvalidState(
                "the store keeps full packs only".into(),
            ));
        }
        if file_len > self.budget_bytes {
            return Err(KvpackError::OverBudget {
                needed: file_len,
                budget: self.budget_bytes,
            });
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let name = file_name(&m.cut_id, m.generation);
        let tmp = self
            .tmp
            .join(format!("{name}.{}.{seq}.partial", std::process::id()));
        // from here on, dropping `staged` removes the file
        let staged = StagedPack {
            tmp,
            name,
            manifest: m,
            file_len,
        };
        let ctx = |what: &str| io_ctx(format!("{what} {}", staged.tmp.display()));
        let mut f = std::io::BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(&staged.tmp).map_err(ctx("create"))?,
        );
        write(&mut f).map_err(ctx("write"))?;
        let f = f.into_inner().map_err(|e| ctx("write")(e.into_error()))?;
        f.sync_all().map_err(ctx("fsync"))?;
        Ok(staged)
    }
}

/// A stored pack opened for a restore outside the store ([`PackStore::ticket`]).
pub struct PackTicket {
    pub cut: BlockId,
    /// The generation the store indexed for the cut.
    indexed: u64,
    file: std::fs::File,
    keys: Keys,
    limits: ReadLimits,
}

impl PackTicket {
    /// Verifies the pack completely (identity, seal, Merkle root, every segment) into a
    /// staging state, and checks that it is the generation the store published (not an
    /// older one copied over it).
    pub fn restore(&self, identity: &KvIdentity, control: &RestoreControl) -> Result<Restored> {
        let expect = Expect {
            identity,
            cut: Some(self.cut),
            other_abis: &[],
        };
        let r = restore(&self.file, &self.keys, &expect, &self.limits, control)?;
        let generation = r.manifest.generation;
        if generation < self.indexed {
            return Err(KvpackError::Replayed {
                generation,
                high_water: self.indexed,
            });
        }
        if generation > self.indexed {
            return Err(KvpackError::NotAdmitted { generation });
        }
        Ok(r)
    }
}

/// A pack written and fsynced under `tmp/` by [`PackStore::stage`], not yet visible. Dropping
/// it uncommitted removes the file.
#[derive(Debug)]
pub struct StagedPack {
    tmp: PathBuf,
    name: String,
    manifest: Manifest,
    file_len: u64,
}

impl StagedPack {
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }
}

impl Drop for StagedPack {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A stored pack that matches a prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreHit {
    pub cut: BlockId,
    pub token_count: u32,
}

pub struct PackStore {
    cfg: StoreConfig,
    keys: Keys,
    ledger: Ledger,
    index: HashMap<BlockId, Entry>,
    /// token count → number of packs of that length (lookup tries each length once).
    lengths: BTreeMap<u32, usize>,
    total_bytes: u64,
    tick: u64,
    tmp_seq: Arc<AtomicU64>,
    /// Held (an exclusive advisory lock on `root/lock`) while the store is open: recovery
    /// removes partial files, which must not be another live process's writes in progress.
    _lock: std::fs::File,
}

/// Takes the store's exclusive lock, or says who holds it. The lock goes with the process.
fn lock_root(root: &Path) -> Result<std::fs::File> {
    let p = root.join("lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .map_err(io_ctx(format!("open {}", p.display())))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => {
            Err(KvpackError::StoreBusy(root.display().to_string()))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(io_ctx(format!("lock {}", p.display()))(e)),
    }
}

fn file_name(cut: &BlockId, generation: u64) -> String {
    format!("{}.{generation}.kvpack", cut.to_hex())
}

impl PackStore {
    /// Opens (creating if needed) the store and recovers it: removes partial files, keeps
    /// every complete pack that verifies and is the current generation of its stream,
    /// removes superseded generations, quarantines the rest, then enforces the budget.
    pub fn open(cfg: StoreConfig, keys: Keys) -> Result<(PackStore, RecoveryReport)> {
        for d in ["packs", "tmp", "quarantine"] {
            let p = cfg.root.join(d);
            std::fs::create_dir_all(&p).map_err(io_ctx(format!("create {}", p.display())))?;
        }
        let lock = lock_root(&cfg.root)?;
        let ledger = Ledger::open(&cfg.root.join("ledger.bin"), &keys)?;
        let mut store = PackStore {
            cfg,
            keys,
            ledger,
            index: HashMap::new(),
            lengths: BTreeMap::new(),
            total_bytes: 0,
            tick: 0,
            tmp_seq: Arc::new(AtomicU64::new(0)),
            _lock: lock,
        };
        let mut report = RecoveryReport::default();
        let tmp = store.dir("tmp");
        for name in list(&tmp)? {
            let p = tmp.join(&name);
            std::fs::remove_file(&p).map_err(io_ctx(format!("remove {}", p.display())))?;
            report.removed_partial += 1;
        }
        sync_dir(&tmp)?;

        let packs = store.dir("packs");
        let mut found: Vec<(Entry, BlockId, std::time::SystemTime)> = Vec::new();
        for name in list(&packs)? {
            let path = packs.join(&name);
            match store.check_file(&path, &name) {
                Ok((m, bytes)) => {
                    let mtime = std::fs::metadata(&path)
                        .and_then(|md| md.modified())
                        .unwrap_or(std::time::UNIX_EPOCH);
                    found.push((
                        Entry {
                            file: name,
                            token_count: m.token_count,
                            generation: m.generation,
                            bytes,
                            last_used: 0,
                        },
                        m.cut_id,
                        mtime,
                    ));
                }
                Err(e) => {
                    let q = store.dir("quarantine").join(&name);
                    std::fs::rename(&path, &q)
                        .map_err(io_ctx(format!("quarantine {}", path.display())))?;
                    report.quarantined.push((name, e.to_string()));
                }
            }
        }
        // Oldest first, so that the last-used ticks follow modification times.
        found.sort_by_key(|(e, _, t)| (*t, e.generation));
        for (entry, cut, _) in found {
            if let Some(old) = store.index.get(&cut) {
                // Two admitted generations of one prefix: a crash between publishing the new
                // one and removing the old one. Keep the newer.
                let (drop_file, keep_new) = if old.generation < entry.generation {
                    (old.file.clone(), true)
                } else {
                    (entry.file.clone(), false)
                };
                std::fs::remove_file(packs.join(&drop_file))
                    .map_err(io_ctx("remove superseded pack"))?;
                report.removed_stale += 1;
                if !keep_new {
                    continue;
                }
                store.forget(&cut);
            }
            store.insert(cut, entry);
        }
        report.kept = store.index.len();
        report.evicted = store.evict(None)?;
        report.kept -= report.evicted;
        sync_dir(&packs)?;
        Ok((store, report))
    }

    fn dir(&self, d: &str) -> PathBuf {
        self.cfg.root.join(d)
    }

    /// Verifies a pack file found at start-up and checks it against its name and the ledger.
    fn check_file(&self, path: &Path, name: &str) -> Result<(Manifest, u64)> {
        let f = std::fs::File::open(path).map_err(io_ctx(format!("open {}", path.display())))?;
        let m = if self.cfg.verify_segments_on_open {
            verify_pack(&f, &self.keys, &self.cfg.limits)?
        } else {
            open_pack(&f, &self.keys, &self.cfg.limits)?.manifest
        };
        if m.kind != PackKind::Full {
            return Err(KvpackError::InvalidState("delta pack in the store".into()));
        }
        if file_name(&m.cut_id, m.generation) != name {
            return Err(KvpackError::InvalidState(
                "file name does not match the manifest".into(),
            ));
        }
        self.ledger.check_admitted(&m.stream, m.generation)?;
        let bytes = f.metadata().map_err(io_ctx("stat pack"))?.len();
        Ok((m, bytes))
    }

    fn insert(&mut self, cut: BlockId, mut entry: Entry) {
        self.tick += 1;
        entry.last_used = self.tick;
        self.total_bytes += entry.bytes;
        *self.lengths.entry(entry.token_count).or_default() += 1;
        self.index.insert(cut, entry);
    }

    fn forget(&mut self, cut: &BlockId) -> Option<Entry> {
        let e = self.index.remove(cut)?;
        self.total_bytes -= e.bytes;
        if let Some(n) = self.lengths.get_mut(&e.token_count) {
            *n -= 1;
            if *n == 0 {
                self.lengths.remove(&e.token_count);
            }
        }
        Some(e)
    }

    /// Evicts least recently used packs (never `keep`) until within budget.
    fn evict(&mut self, keep: Option<BlockId>) -> Result<usize> {
        let mut n = 0;
        while self.total_bytes > self.cfg.budget_bytes {
            let victim = self
                .index
                .iter()
                .filter(|(c, _)| Some(**c) != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(c, _)| *c);
            let Some(cut) = victim else { break };
            let e = self.forget(&cut).expect("victim is indexed");
            let p = self.dir("packs").join(&e.file);
            std::fs::remove_file(&p).map_err(io_ctx(format!("evict {}", p.display())))?;
            n += 1;
        }
        Ok(n)
    }

    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn contains(&self, cut: &BlockId) -> bool {
        self.index.contains_key(cut)
    }

    /// Publishes a pack built from a local state. Returns once the pack is durable.
    pub fn publish(&mut self, plan: &PackPlan) -> Result<StoreHit> {
        let staged = self.stage(plan)?;
        self.commit(staged)
    }

    /// Publishes pack bytes from elsewhere, after verifying every byte.
    pub fn import(&mut self, bytes: &[u8]) -> Result<StoreHit> {
        let m = verify_pack(bytes, &self.keys, &self.cfg.limits)?;
        let staged = self.stage_with(m, bytes.len() as u64, |w| w.write_all(bytes))?;
        self.commit(staged)
    }

    /// The slow half of a publication: writes the pack under `tmp/` and fsyncs it. The pack
    /// becomes visible with [`PackStore::commit`]; a dropped [`StagedPack`] removes its file.
    pub fn stage(&self, plan: &PackPlan) -> Result<StagedPack> {
        self.ledger
            .admit(&plan.manifest().stream, plan.manifest().generation)?;
        self.stager().stage(plan)
    }

    fn stage_with(
        &self,
        m: Manifest,
        file_len: u64,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<StagedPack> {
        self.ledger.admit(&m.stream, m.generation)?;
        self.stager().stage_with(m, file_len, write)
    }

    /// A handle that stages packs for this store without borrowing it, so that a caller
    /// sharing the store behind a lock writes and fsyncs unlocked and locks only to commit.
    pub fn stager(&self) -> Stager {
        Stager {
            tmp: self.dir("tmp"),
            budget_bytes: self.cfg.budget_bytes,
            seq: self.tmp_seq.clone(),
        }
    }

    /// Makes a staged pack visible: records its generation in the ledger (durably), renames
    /// it into `packs/`, fsyncs the directory, replaces an older generation of the same
    /// prefix and evicts to the budget (never this pack).
    pub fn commit(&mut self, mut staged: StagedPack) -> Result<StoreHit> {
        let m = &staged.manifest;
        // another publication of the stream may have committed since staging
        self.ledger.admit(&m.stream, m.generation)?;
        self.ledger.record(m.stream, m.generation)?;
        let dst = self.dir("packs").join(&staged.name);
        std::fs::rename(&staged.tmp, &dst)
            .map_err(io_ctx(format!("rename {}", staged.tmp.display())))?;
        // renamed away: nothing for the drop to remove
        staged.tmp = PathBuf::new();
        sync_dir(&self.dir("packs"))?;
        let (cut, token_count, generation) = (
            staged.manifest.cut_id,
            staged.manifest.token_count,
            staged.manifest.generation,
        );
        if let Some(old) = self.forget(&cut) {
            let p = self.dir("packs").join(&old.file);
            std::fs::remove_file(&p)
                .map_err(io_ctx(format!("remove superseded {}", p.display())))?;
        }
        self.insert(
            cut,
            Entry {
                file: staged.name.clone(),
                token_count,
                generation,
                bytes: staged.file_len,
                last_used: 0,
            },
        );
        self.evict(Some(cut))?;
        Ok(StoreHit { cut, token_count })
    }

    /// The longest stored prefix of `chain`'s tokens, at most `max_tokens` long. The store
    /// sees only cut ids.
    pub fn lookup(&self, chain: &PrefixChain, max_tokens: u32) -> Option<StoreHit> {
        let limit = max_tokens.min(chain.n_tokens());
        self.lengths.range(..=limit).rev().find_map(|(&len, _)| {
            let cut = chain.cut_id(len)?;
            self.index.get(&cut).map(|_| StoreHit {
                cut,
                token_count: len,
            })
        })
    }

    /// Restores the pack named `cut`, checking it completely (identity, seal, segments),
    /// that it is the generation the store published and that the ledger admitted it.
    pub fn restore(
        &mut self,
        cut: &BlockId,
        identity: &KvIdentity,
        control: &RestoreControl,
    ) -> Result<Restored> {
        let ticket = self.ticket(cut)?;
        let r = ticket.restore(identity, control)?;
        self.confirm(&ticket, &r)?;
        Ok(r)
    }

    /// Opens the pack named `cut` for a restore that runs without borrowing the store
    /// ([`PackTicket::restore`], then [`PackStore::confirm`]): a caller sharing the store behind
    /// a lock holds it only to take the ticket and to confirm. The open file stays readable
    /// even if the pack is evicted meanwhile.
    pub fn ticket(&self, cut: &BlockId) -> Result<PackTicket> {
        let entry = self.index.get(cut).ok_or(KvpackError::NotFound)?;
        let path = self.dir("packs").join(&entry.file);
        let file =
            std::fs::File::open(&path).map_err(io_ctx(format!("open {}", path.display())))?;
        Ok(PackTicket {
            cut: *cut,
            indexed: entry.generation,
            file,
            keys: self.keys.clone(),
            limits: self.cfg.limits.clone(),
        })
    }

    /// The ledger's word on a ticket's restored pack (it must have admitted the generation),
    /// and a use for the least-recently-used order.
    pub fn confirm(&mut self, ticket: &PackTicket, restored: &Restored) -> Result<()> {
        self.ledger
            .check_admitted(&restored.manifest.stream, restored.manifest.generation)?;
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.index.get_mut(&ticket.cut) {
            e.last_used = tick;
        }
        Ok(())
    }

    /// Removes a pack (its ledger entry stays, so it cannot be re-imported).
    pub fn remove(&mut self, cut: &BlockId) -> Result<()> {
        let e = self.forget(cut).ok_or(KvpackError::NotFound)?;
        let p = self.dir("packs").join(&e.file);
        std::fs::remove_file(&p).map_err(io_ctx(format!("remove {}", p.display())))?;
        sync_dir(&self.dir("packs"))
    }

    /// High-water generation of a stream in the replay ledger.
    pub fn high_water(&self, stream: &Digest32) -> Option<u64> {
        self.ledger.high_water(stream)
    }
}

fn list(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io_ctx(format!("list {}", dir.display())))? {
        let e = e.map_err(io_ctx(format!("list {}", dir.display())))?;
        out.push(e.file_name().to_string_lossy().into_owned());
    }
    out.sort();
    Ok(out)
}
