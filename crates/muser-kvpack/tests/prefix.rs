//! Prefix chain: ids depend on every earlier token, the identity and the key, and nothing else.

mod common;
use common::*;
use muser_kvpack::*;

#[test]
fn chain_ids_name_exact_prefixes() {
    let keys = keys();
    let id = identity(swa_layout());
    let h = PrefixHasher::new(&keys, &id.digest(&keys));
    let t = tokens(1000, 1);
    let c = h.chain(&t);
    assert_eq!(c.block_ids().len(), 3);
    assert_eq!(c.cut_id(256), Some(c.block_ids()[0]));
    assert_eq!(c.cut_id(768), Some(c.block_ids()[2]));
    assert_eq!(c.cut_id(0), None);
    assert_eq!(c.cut_id(1001), None);
    // Deterministic, and a prefix's ids do not depend on what follows it.
    let c2 = h.chain(&t[..600]);
    assert_eq!(c2.block_ids(), &c.block_ids()[..2]);
    assert_eq!(c2.cut_id(600), c.cut_id(600));
    // All cut ids of one sequence are distinct.
    let mut all: Vec<BlockId> = (1..=1000).map(|n| c.cut_id(n).unwrap()).collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 1000);
    // A change in block 0 changes every later block id.
    let mut u = t.clone();
    u[3] ^= 1;
    let cu = h.chain(&u);
    for i in 0..3 {
        assert_ne!(cu.block_ids()[i], c.block_ids()[i]);
    }
    // A change in block 2 keeps blocks 0 and 1.
    let mut w = t.clone();
    w[700] ^= 1;
    let cw = h.chain(&w);
    assert_eq!(&cw.block_ids()[..2], &c.block_ids()[..2]);
    assert_ne!(cw.block_ids()[2], c.block_ids()[2]);
}

#[test]
fn chain_is_namespaced_by_identity_and_key() {
    let keys = keys();
    let id = identity(swa_layout());
    let t = tokens(512, 2);
    let a = PrefixHasher::new(&keys, &id.digest(&keys)).chain(&t);
    let mut other = id.clone();
    other.context_policy[0] ^= 1;
    let b = PrefixHasher::new(&keys, &other.digest(&keys)).chain(&t);
    let k2 = Keys::derive(&[9; 32]);
    let c = PrefixHasher::new(&k2, &id.digest(&keys)).chain(&t);
    assert_ne!(a.block_ids()[0], b.block_ids()[0]);
    assert_ne!(a.block_ids()[0], c.block_ids()[0]);
    assert_ne!(a.cut_id(5), b.cut_id(5));
}

#[test]
fn weights_digest_covers_names_shapes_types_and_data() {
    let base = {
        let mut h = WeightsHasher::new();
        h.add_tensor("a", &[4, 2], 1, &[1; 16]);
        h.add_tensor("b", &[8], 0, &[2; 32]);
        h.finish()
    };
    let variants: Vec<fn(&mut WeightsHasher)> = vec![
        |h| {
            h.add_tensor("a", &[4, 2], 1, &[1; 16]);
            h.add_tensor("c", &[8], 0, &[2; 32]);
        },
        |h| {
            h.add_tensor("a", &[2, 4], 1, &[1; 16]);
            h.add_tensor("b", &[8], 0, &[2; 32]);
        },
        |h| {
            h.add_tensor("a", &[4, 2], 2, &[1; 16]);
            h.add_tensor("b", &[8], 0, &[2; 32]);
        },
        |h| {
            h.add_tensor("a", &[4, 2], 1, &[1; 16]);
            h.add_tensor("b", &[8], 0, &[3; 32]);
        },
        |h| {
            h.add_tensor("b", &[8], 0, &[2; 32]);
            h.add_tensor("a", &[4, 2], 1, &[1; 16]);
        },
    ];
    for (i, v) in variants.iter().enumerate() {
        let mut h = WeightsHasher::new();
        v(&mut h);
        assert_ne!(h.finish(), base, "variant {i}");
    }
    // Streaming in pieces equals one update.
    let mut h = WeightsHasher::new();
    h.begin_tensor("a", &[4, 2], 1, 16);
    h.update(&[1; 5]);
    h.update(&[1; 11]);
    h.add_tensor("b", &[8], 0, &[2; 32]);
    assert_eq!(h.finish(), base);
    // File stamps change with the contents' length.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w");
    std::fs::write(&p, b"abc").unwrap();
    let s1 = FileStamp::of(&p).unwrap();
    assert_eq!(s1, FileStamp::of(&p).unwrap());
    std::fs::write(&p, b"abcd").unwrap();
    assert_ne!(s1, FileStamp::of(&p).unwrap());
}
