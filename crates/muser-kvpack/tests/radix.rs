//! Resident radix cache: longest-prefix match, pinning, budgeted LRU eviction.

mod common;
use common::*;
use muser_kvpack::*;

#[test]
fn longest_prefix_across_requests() {
    let keys = keys();
    let id = identity(full_layout());
    let hasher = PrefixHasher::new(&keys, &id.digest(&keys));
    let mut cache = ResidentCache::new(id.layout.clone(), u64::MAX).unwrap();
    let a = tokens(1000, 1);
    let ca = hasher.chain(&a);
    cache
        .insert(&state(&id.layout, 0..1000), ca.block_ids())
        .unwrap();
    assert_eq!(cache.len(), 3);

    // Shares the first two blocks, then diverges.
    let mut b = a[..600].to_vec();
    b[550] ^= 1;
    b.extend(tokens(400, 9));
    let hit = cache
        .lookup(hasher.chain(&b).block_ids(), u32::MAX)
        .unwrap();
    assert_eq!(hit.n_tokens(), 512);
    assert_eq!(hit.to_state(&id.layout), state(&id.layout, 0..512));

    // Capped by max_tokens (e.g. prompt length - 1).
    assert_eq!(cache.lookup(ca.block_ids(), 700).unwrap().n_tokens(), 512);
    // Unrelated prompt: miss. Same tokens under another identity: miss.
    assert!(cache
        .lookup(hasher.chain(&tokens(600, 5)).block_ids(), u32::MAX)
        .is_none());
    let mut other_id = id.clone();
    other_id.engine_abi = "other".into();
    let h2 = PrefixHasher::new(&keys, &other_id.digest(&keys));
    assert!(cache.lookup(h2.chain(&a).block_ids(), u32::MAX).is_none());
}

#[test]
fn sliding_window_rows_bound_the_hit() {
    let keys = keys();
    let id = identity(swa_layout()); // window 300
    let hasher = PrefixHasher::new(&keys, &id.digest(&keys));
    let mut cache = ResidentCache::new(id.layout.clone(), u64::MAX).unwrap();
    let t = tokens(1300, 3);
    let chain = hasher.chain(&t);
    // State of 1300 tokens: window rows cover 1000..1300; no block end k*256 has its whole
    // window (k*256 - 300 .. k*256) held.
    cache
        .insert(&state(&id.layout, 0..1300), chain.block_ids())
        .unwrap();
    assert!(cache.lookup(chain.block_ids(), u32::MAX).is_none());
    // A state ending at 512 holds the window 212..512: a hit of 512 tokens.
    cache
        .insert(&state(&id.layout, 0..512), &chain.block_ids()[..2])
        .unwrap();
    let hit = cache.lookup(chain.block_ids(), u32::MAX).unwrap();
    assert_eq!(hit.n_tokens(), 512);
    assert_eq!(hit.to_state(&id.layout), state(&id.layout, 0..512));
    // A state ending at 1280 adds the window 980..1280: a hit of 1280.
    cache
        .insert(&state(&id.layout, 0..1280), chain.block_ids())
        .unwrap();
    let hit = cache.lookup(chain.block_ids(), u32::MAX).unwrap();
    assert_eq!(hit.n_tokens(), 1280);
    assert_eq!(hit.to_state(&id.layout), state(&id.layout, 0..1280));
}

#[test]
fn eviction_respects_budget_pins_and_recency() {
    let keys = keys();
    let id = identity(full_layout());
    let hasher = PrefixHasher::new(&keys, &id.digest(&keys));
    let block_bytes = 2 * 256 * id.layout.row_bytes() as u64 * id.layout.n_layer as u64;
    let mut cache = ResidentCache::new(id.layout.clone(), 4 * block_bytes).unwrap();
    let a = tokens(512, 1);
    let b = tokens(512, 2);
    let c = tokens(512, 3);
    let (ca, cb, cc) = (hasher.chain(&a), hasher.chain(&b), hasher.chain(&c));
    cache
        .insert(&state(&id.layout, 0..512), ca.block_ids())
        .unwrap();
    cache
        .insert(&state(&id.layout, 0..512), cb.block_ids())
        .unwrap();
    assert_eq!(cache.used_bytes(), 4 * block_bytes);
    // Pin b's blocks (a hit held by a running request); inserting c must then evict a,
    // the least recently used unpinned chain, leaf first.
    let pin_b = cache.lookup(cb.block_ids(), u32::MAX).unwrap();
    cache
        .insert(&state(&id.layout, 0..512), cc.block_ids())
        .unwrap();
    assert!(cache.used_bytes() <= 4 * block_bytes);
    assert_eq!(
        cache.lookup(cb.block_ids(), u32::MAX).unwrap().n_tokens(),
        512,
        "pinned survive"
    );
    assert_eq!(
        cache.lookup(cc.block_ids(), u32::MAX).unwrap().n_tokens(),
        512,
        "new survive"
    );
    assert!(
        cache.lookup(ca.block_ids(), u32::MAX).is_none(),
        "unpinned evicted"
    );
    drop(pin_b);
    // Inner nodes go only after their children: a chain is evicted from its tail.
    let mut small = ResidentCache::new(id.layout.clone(), block_bytes).unwrap();
    small
        .insert(&state(&id.layout, 0..512), ca.block_ids())
        .unwrap();
    assert_eq!(
        small.len(),
        2,
        "just-inserted blocks are pinned during insert"
    );
    assert_eq!(small.evict(), 1);
    assert_eq!(
        small.lookup(ca.block_ids(), u32::MAX).unwrap().n_tokens(),
        256
    );
}
