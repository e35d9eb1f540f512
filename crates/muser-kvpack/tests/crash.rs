//! Crash safety: a child process publishing packs is SIGKILLed at random points; the store
//! afterwards holds only complete, verifiable packs and every pack whose publication was
//! acknowledged.

mod common;
use common::*;
use muser_kvpack::*;
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD_DIR: &str = "MUSER_KVPACK_CRASH_DIR";
const CHILD_SEED: &str = "MUSER_KVPACK_CRASH_SEED";

/// 8 layers × 2 heads × 64 dims F16, one sliding: packs of 1–4 MB, so that a kill lands
/// inside writes as well as between them.
fn layout() -> KvLayoutAbi {
    KvLayoutAbi {
        n_layer: 8,
        swa_layers: vec![false, false, false, true, false, false, false, true],
        n_head_kv: 2,
        head_dim: 64,
        n_swa: 512,
        dtype: KvDtype::F16,
        cell_layout: CellLayout::TokenMajor,
    }
}

/// The i-th publication of child `seed`: its tokens, and its generation. Every fourth one
/// republishes the previous prompt with the next generation.
fn job(seed: u64, i: u64) -> (Vec<u32>, u64) {
    let base = if i % 4 == 3 { i - 1 } else { i };
    let n = 256 + (Rng(seed * 1000 + base + 1).below(768) as u32);
    (
        tokens(n, seed * 1000 + base),
        if i % 4 == 3 { 2 } else { 1 },
    )
}

/// Child entry point: does nothing unless started by the crash test.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let seed: u64 = std::env::var(CHILD_SEED).unwrap().parse().unwrap();
    let keys = keys();
    let id = identity(layout());
    let hasher = PrefixHasher::new(&keys, &id.digest(&keys));
    let (mut store, _) =
        PackStore::open(StoreConfig::new(&dir, u64::MAX), Keys::derive(&KEY)).unwrap();
    let mut out = std::io::stdout();
    writeln!(out, "READY").unwrap();
    out.flush().unwrap();
    for i in 0.. {
        let (toks, gen) = job(seed, i);
        let chain = hasher.chain(&toks);
        let st = state(&id.layout, 0..toks.len() as u32);
        let spec = PackSpec {
            identity: &id,
            chain: &chain,
            generation: gen,
            stream: None,
            base_tokens: 0,
            plan: SegmentPlan::default(),
            threads: 2,
        };
        let hit = store
            .publish(&PackPlan::new(&st, &keys, &spec).unwrap())
            .unwrap();
        writeln!(out, "ACK {seed} {i} {}", hit.cut.to_hex()).unwrap();
        out.flush().unwrap();
    }
}

#[test]
fn sigkill_during_publication_loses_nothing_published() {
    let exe = std::env::current_exe().unwrap();
    let keys = keys();
    let id = identity(layout());
    let hasher = PrefixHasher::new(&keys, &id.digest(&keys));
    let started = Instant::now();
    let mut rng = Rng(0x5eed);
    // cut → (seed, i, generation) of the latest acknowledged publication.
    let mut acked: HashMap<BlockId, (u64, u64, u64)> = HashMap::new();
    let (mut kills, mut partial_seen, mut total_acks) = (0, 0, 0);
    let mut dir = tempfile::tempdir().unwrap();
    let mut seed = 0;
    while started.elapsed() < Duration::from_secs(20) && seed < 60 {
        seed += 1;
        if seed % 15 == 0 {
            // A fresh store now and then keeps recovery (which verifies everything) quick.
            dir = tempfile::tempdir().unwrap();
            acked.clear();
        }
        let mut child = Command::new(&exe)
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR, dir.path())
            .env(CHILD_SEED, seed.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        // Wait until the child has opened the store, then let it publish for a while.
        for l in lines.by_ref() {
            // libtest may print "test crash_child ... " before it on the same line.
            if l.unwrap().ends_with("READY") {
                break;
            }
        }
        std::thread::sleep(Duration::from_micros(rng.below(150_000)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        kills += 1;
        for l in lines {
            let l = l.unwrap();
            let w: Vec<&str> = l.split_whitespace().collect();
            if w.first() != Some(&"ACK") {
                continue;
            }
            let (s, i): (u64, u64) = (w[1].parse().unwrap(), w[2].parse().unwrap());
            let (toks, gen) = job(s, i);
            let cut = hasher.chain(&toks).cut_id(toks.len() as u32).unwrap();
            assert_eq!(cut.to_hex(), w[3]);
            acked.insert(cut, (s, i, gen));
            total_acks += 1;
        }

        let (mut store, report) =
            PackStore::open(StoreConfig::new(dir.path(), u64::MAX), Keys::derive(&KEY)).unwrap();
        partial_seen += report.removed_partial;
        assert!(
            report.quarantined.is_empty(),
            "seed {seed}: {:?}",
            report.quarantined
        );
        assert_eq!(
            std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
            0
        );
        for (cut, &(s, i, gen)) in &acked {
            let r = store
                .restore(cut, &id, &RestoreControl::default())
                .unwrap_or_else(|e| panic!("seed {seed}: acknowledged pack {s}/{i} lost: {e}"));
            assert!(r.manifest.generation >= gen);
            let (toks, _) = job(s, i);
            assert_eq!(r.state, state(&id.layout, 0..toks.len() as u32));
        }
        // Every pack present verifies (recovery verified them; check the files directly).
        for e in std::fs::read_dir(dir.path().join("packs")).unwrap() {
            let bytes = std::fs::read(e.unwrap().path()).unwrap();
            verify_pack(&bytes[..], &keys, &ReadLimits::default()).unwrap();
        }
    }
    eprintln!("{kills} kills, {total_acks} acknowledged publications, {partial_seen} partial files recovered");
    assert!(kills >= 10, "only {kills} kills in the time budget");
    assert!(total_acks > 0);
}
