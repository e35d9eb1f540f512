//! Durable store: publication, lookup, replay ledger, LRU budget, start-up recovery.

mod common;
use common::*;
use muser_kvpack::*;
use std::path::Path;

struct Fixture {
    keys: Keys,
    id: KvIdentity,
    hasher: PrefixHasher,
}

impl Fixture {
    fn new() -> Self {
        let keys = keys();
        let id = identity(swa_layout());
        let hasher = PrefixHasher::new(&keys, &id.digest(&keys));
        Fixture { keys, id, hasher }
    }

    fn pack(&self, toks: &[u32], gen: u64) -> Vec<u8> {
        let chain = self.hasher.chain(toks);
        let st = state(&self.id.layout, 0..toks.len() as u32);
        let spec = PackSpec {
            identity: &self.id,
            chain: &chain,
            generation: gen,
            stream: None,
            base_tokens: 0,
            plan: small_plan(),
            threads: 2,
        };
        PackPlan::new(&st, &self.keys, &spec).unwrap().to_bytes()
    }

    fn publish(&self, store: &mut PackStore, toks: &[u32], gen: u64) -> Result<StoreHit> {
        let chain = self.hasher.chain(toks);
        let st = state(&self.id.layout, 0..toks.len() as u32);
        let spec = PackSpec {
            identity: &self.id,
            chain: &chain,
            generation: gen,
            stream: None,
            base_tokens: 0,
            plan: small_plan(),
            threads: 2,
        };
        store.publish(&PackPlan::new(&st, &self.keys, &spec).unwrap())
    }

    fn open(&self, root: &Path, budget: u64) -> (PackStore, RecoveryReport) {
        PackStore::open(StoreConfig::new(root, budget), Keys::derive(&KEY)).unwrap()
    }
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn publish_lookup_restore_longest_prefix() {
    let f = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = f.open(dir.path(), u64::MAX);
    let conv = tokens(1500, 1);
    f.publish(&mut store, &conv[..512], 1).unwrap();
    f.publish(&mut store, &conv[..1000], 1).unwrap();
    f.publish(&mut store, &tokens(700, 2), 1).unwrap();

    // A later turn of the conversation: longest stored prefix is 1000 tokens.
    let q = f.hasher.chain(&conv);
    let hit = store.lookup(&q, u32::MAX).unwrap();
    assert_eq!(hit.token_count, 1000);
    // Limited to fewer tokens (e.g. to keep one to evaluate): the 512 pack.
    assert_eq!(store.lookup(&q, 999).unwrap().token_count, 512);
    // Diverging at token 600: the 512 pack.
    let mut other = conv.clone();
    other[600] += 1;
    assert_eq!(
        store
            .lookup(&f.hasher.chain(&other), u32::MAX)
            .unwrap()
            .token_count,
        512
    );
    // Nothing shared.
    assert!(store
        .lookup(&f.hasher.chain(&tokens(900, 3)), u32::MAX)
        .is_none());

    let r = store
        .restore(&hit.cut, &f.id, &RestoreControl::default())
        .unwrap();
    assert_eq!(r.state, state(&f.id.layout, 0..1000));
    // Another identity cannot restore it.
    let mut other_id = f.id.clone();
    other_id.tokenizer[0] ^= 1;
    assert!(matches!(
        store.restore(&hit.cut, &other_id, &RestoreControl::default()),
        Err(KvpackError::IdentityMismatch(IdentityField::Tokenizer))
    ));
    assert!(matches!(
        store.restore(&BlockId([0; 32]), &f.id, &RestoreControl::default()),
        Err(KvpackError::NotFound)
    ));
}

#[test]
fn replayed_or_stale_generation_is_refused() {
    let f = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = f.open(dir.path(), u64::MAX);
    let t = tokens(400, 1);
    let g1 = f.pack(&t, 1);
    let g2 = f.pack(&t, 2);
    let cut = store.import(&g1).unwrap().cut;
    // The same pack again.
    assert!(matches!(
        store.import(&g1),
        Err(KvpackError::Replayed {
            generation: 1,
            high_water: 1
        })
    ));
    store.import(&g2).unwrap();
    // Rolling back to generation 1.
    assert!(matches!(
        store.import(&g1),
        Err(KvpackError::Replayed {
            generation: 1,
            high_water: 2
        })
    ));
    assert_eq!(
        files(&dir.path().join("packs")),
        vec![format!("{}.2.kvpack", cut.to_hex())]
    );
    // Survives a restart: the ledger is durable.
    drop(store);
    let (mut store, _) = f.open(dir.path(), u64::MAX);
    assert!(matches!(
        store.import(&g2),
        Err(KvpackError::Replayed {
            generation: 2,
            high_water: 2
        })
    ));
    // An old pack copied over the current file is refused at restore.
    std::fs::write(
        dir.path()
            .join("packs")
            .join(format!("{}.2.kvpack", cut.to_hex())),
        &g1,
    )
    .unwrap();
    assert!(matches!(
        store.restore(&cut, &f.id, &RestoreControl::default()),
        Err(KvpackError::Replayed {
            generation: 1,
            high_water: 2
        })
    ));
    // A tampered import is refused before anything is written.
    let mut bad = f.pack(&tokens(300, 9), 1);
    let n = bad.len();
    bad[n - 1] ^= 1;
    assert!(matches!(
        store.import(&bad),
        Err(KvpackError::SegmentDigest { .. })
    ));
    assert!(files(&dir.path().join("tmp")).is_empty());
}

#[test]
fn budget_evicts_least_recently_used() {
    let f = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let size = f.pack(&tokens(600, 1), 1).len() as u64;
    let (mut store, _) = f.open(dir.path(), 2 * size + size / 2);
    let (a, b, c) = (tokens(600, 1), tokens(600, 2), tokens(600, 3));
    let ha = f.publish(&mut store, &a, 1).unwrap();
    let hb = f.publish(&mut store, &b, 1).unwrap();
    store
        .restore(&ha.cut, &f.id, &RestoreControl::default())
        .unwrap(); // a is now more recent
    let hc = f.publish(&mut store, &c, 1).unwrap();
    assert!(store.contains(&ha.cut) && store.contains(&hc.cut));
    assert!(!store.contains(&hb.cut), "least recently used evicted");
    assert!(store.total_bytes() <= 2 * size + size / 2);
    assert_eq!(files(&dir.path().join("packs")).len(), 2);
    // A pack larger than the whole budget is refused.
    let (mut tiny, _) = f.open(tempfile::tempdir().unwrap().path(), size / 2);
    assert!(matches!(
        f.publish(&mut tiny, &a, 1),
        Err(KvpackError::OverBudget { .. })
    ));
}

#[test]
fn recovery_keeps_complete_packs_and_removes_the_rest() {
    let f = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (mut store, _) = f.open(root, u64::MAX);
    let good: Vec<StoreHit> = (0..4)
        .map(|i| {
            f.publish(&mut store, &tokens(300 + 100 * i, 10 + i as u64), 1)
                .unwrap()
        })
        .collect();
    let t = tokens(500, 20);
    let old = f.pack(&t, 1);
    let cur = f.publish(&mut store, &t, 2).unwrap();
    let corrupt = f.publish(&mut store, &tokens(400, 21), 1).unwrap();
    drop(store);
    let packs = root.join("packs");

    // A partial write left by a crash.
    std::fs::write(root.join("tmp").join("x.partial"), b"half a pack").unwrap();
    // A superseded generation left behind (crash between rename and unlink).
    std::fs::write(packs.join(format!("{}.1.kvpack", cur.cut.to_hex())), &old).unwrap();
    // A damaged pack.
    let p = packs.join(format!("{}.1.kvpack", corrupt.cut.to_hex()));
    let mut b = std::fs::read(&p).unwrap();
    let n = b.len();
    b[n / 2] ^= 0xff;
    std::fs::write(&p, &b).unwrap();
    // A validly sealed pack the ledger never admitted (generation above its high-water).
    let foreign = f.pack(&tokens(300, 10), 7);
    let foreign_name = {
        let m = verify_pack(&foreign[..], &f.keys, &ReadLimits::default()).unwrap();
        format!("{}.7.kvpack", m.cut_id.to_hex())
    };
    std::fs::write(packs.join(&foreign_name), &foreign).unwrap();
    // A stray file.
    std::fs::write(packs.join("notes.txt"), b"hello").unwrap();

    let (mut store, report) = f.open(root, u64::MAX);
    assert_eq!(report.removed_partial, 1);
    assert_eq!(report.removed_stale, 1);
    assert_eq!(report.kept, 5);
    let mut q: Vec<&str> = report.quarantined.iter().map(|(n, _)| n.as_str()).collect();
    q.sort();
    let mut want = vec![
        format!("{}.1.kvpack", corrupt.cut.to_hex()),
        foreign_name.clone(),
        "notes.txt".to_string(),
    ];
    want.sort();
    assert_eq!(q, want);
    assert!(report
        .quarantined
        .iter()
        .any(|(_, why)| why.contains("never admitted")));
    assert!(files(&root.join("tmp")).is_empty());
    for h in good.iter().chain([&cur]) {
        let r = store
            .restore(&h.cut, &f.id, &RestoreControl::default())
            .unwrap();
        assert_eq!(r.state, state(&f.id.layout, 0..h.token_count));
    }
    assert_eq!(
        store
            .restore(&cur.cut, &f.id, &RestoreControl::default())
            .unwrap()
            .manifest
            .generation,
        2
    );
}

#[test]
fn damaged_ledger_refuses_to_open() {
    let f = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = f.open(dir.path(), u64::MAX);
    f.publish(&mut store, &tokens(300, 1), 1).unwrap();
    drop(store);
    let lp = dir.path().join("ledger.bin");
    let good = std::fs::read(&lp).unwrap();
    for i in [0, 9, 20, good.len() - 1] {
        let mut b = good.clone();
        b[i] ^= 1;
        std::fs::write(&lp, &b).unwrap();
        let e = PackStore::open(StoreConfig::new(dir.path(), u64::MAX), keys())
            .err()
            .unwrap();
        assert!(
            matches!(e, KvpackError::LedgerCorrupt(_)),
            "byte {i}: {e:?}"
        );
    }
    std::fs::write(&lp, &good[..good.len() - 3]).unwrap();
    assert!(matches!(
        PackStore::open(StoreConfig::new(dir.path(), u64::MAX), keys())
            .err()
            .unwrap(),
        KvpackError::LedgerCorrupt(_)
    ));
    // Another operator key cannot read (or forge) it.
    std::fs::write(&lp, &good).unwrap();
    assert!(matches!(
        PackStore::open(
            StoreConfig::new(dir.path(), u64::MAX),
            Keys::derive(&[1; 32])
        )
        .err()
        .unwrap(),
        KvpackError::LedgerCorrupt(_)
    ));
    assert!(PackStore::open(StoreConfig::new(dir.path(), u64::MAX), keys()).is_ok());
}

#[test]
fn staged_packs_are_invisible_until_committed_and_removed_when_dropped() {
    let f = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let (mut store, _) = f.open(dir.path(), 1 << 30);
    let toks = tokens(600, 41);
    let chain = f.hasher.chain(&toks);
    let st = state(&f.id.layout, 0..600);
    let spec = |gen| PackSpec {
        identity: &f.id,
        chain: &chain,
        generation: gen,
        stream: None,
        base_tokens: 0,
        plan: small_plan(),
        threads: 2,
    };
    let cut = chain.cut_id(600).unwrap();

    // staged through a stager (no borrow of the store), then dropped: nothing remains
    let stager = store.stager();
    let staged = stager
        .stage(&PackPlan::new(&st, &f.keys, &spec(1)).unwrap())
        .unwrap();
    assert_eq!(files(&dir.path().join("tmp")).len(), 1);
    assert!(!store.contains(&cut) && store.lookup(&chain, 600).is_none());
    drop(staged);
    assert!(files(&dir.path().join("tmp")).is_empty());
    assert!(files(&dir.path().join("packs")).is_empty());

    // staged and committed: visible, durable, restorable
    let staged = stager
        .stage(&PackPlan::new(&st, &f.keys, &spec(2)).unwrap())
        .unwrap();
    assert_eq!(staged.manifest().generation, 2);
    let hit = store.commit(staged).unwrap();
    assert_eq!(hit.token_count, 600);
    assert!(files(&dir.path().join("tmp")).is_empty());
    assert_eq!(files(&dir.path().join("packs")).len(), 1);
    let r = store
        .restore(&cut, &f.id, &RestoreControl::default())
        .unwrap();
    assert_eq!(r.state, st);

    // a stale generation staged before a newer commit is refused at commit
    let old = stager
        .stage(&PackPlan::new(&st, &f.keys, &spec(2)).unwrap())
        .unwrap();
    assert!(matches!(
        store.commit(old),
        Err(KvpackError::Replayed { .. })
    ));
    assert!(
        files(&dir.path().join("tmp")).is_empty(),
        "the refused file is removed"
    );
    drop(store);
    let (store, report) = f.open(dir.path(), 1 << 30);
    assert_eq!((report.kept, store.len()), (1, 1));
}

#[test]
fn a_store_open_in_one_place_is_refused_in_another_until_closed() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = PackStore::open(StoreConfig::new(dir.path(), u64::MAX), keys()).unwrap();
    // Recovery of a second opener would delete the first one's writes in progress.
    let e = PackStore::open(StoreConfig::new(dir.path(), u64::MAX), keys())
        .err()
        .unwrap();
    assert!(matches!(e, KvpackError::StoreBusy(_)), "{e:?}");
    assert!(e.to_string().contains("in use"), "{e}");
    drop(store);
    assert!(PackStore::open(StoreConfig::new(dir.path(), u64::MAX), keys()).is_ok());
}
