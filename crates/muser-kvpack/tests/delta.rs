//! Delta packs: only the suffix blocks (and, for sliding-window layers, only what the window
//! still needs) move; base + delta equals a full restore byte for byte.

mod common;
use common::*;
use muser_kvpack::*;

fn pack(
    keys: &Keys,
    id: &KvIdentity,
    chain: &PrefixChain,
    st: &KvState,
    base: u32,
    gen: u64,
) -> Vec<u8> {
    let spec = PackSpec {
        identity: id,
        chain,
        generation: gen,
        stream: None,
        base_tokens: base,
        plan: small_plan(),
        threads: 2,
    };
    PackPlan::new(st, keys, &spec).unwrap().to_bytes()
}

fn run(layout: KvLayoutAbi, base: u32, end: u32) {
    let keys = keys();
    let id = identity(layout);
    let toks = tokens(end, 42);
    let hasher = PrefixHasher::new(&keys, &id.digest(&keys));
    let chain = hasher.chain(&toks);
    let full_state = state(&id.layout, 0..end);
    let lim = ReadLimits::default();
    let ctl = RestoreControl::default();

    // Receiver: holds the base prefix, restored from a full pack of it.
    let base_state = state(&id.layout, 0..base);
    let base_chain = hasher.chain(&toks[..base as usize]);
    let base_bytes = pack(&keys, &id, &base_chain, &base_state, 0, 1);
    let held = restore(&base_bytes[..], &keys, &expect(&id), &lim, &ctl).unwrap();

    let full = pack(&keys, &id, &chain, &full_state, 0, 1);
    let delta = pack(&keys, &id, &chain, &full_state, base, 1);
    let d = restore(&delta[..], &keys, &expect(&id), &lim, &ctl).unwrap();
    assert_eq!(
        d.manifest.kind,
        PackKind::Delta {
            base_tokens: base,
            base_cut: chain.cut_id(base).unwrap()
        }
    );

    let applied = apply_delta(&held.state, held.manifest.cut_id, &d).unwrap();
    let from_full = restore(&full[..], &keys, &expect(&id), &lim, &ctl)
        .unwrap()
        .state;
    assert_eq!(applied, from_full, "base {base} end {end}");
    assert_eq!(applied, full_state);

    // What moved: full-attention layers from `base`, window layers from max(base, end - n_swa).
    let rb = id.layout.row_bytes() as u64;
    let want: u64 = (0..id.layout.n_layer as usize)
        .map(|l| {
            let from = if id.layout.is_swa(l) {
                base.max(end.saturating_sub(id.layout.n_swa))
            } else {
                base
            };
            2 * rb * (end - from) as u64
        })
        .sum();
    assert_eq!(d.manifest.segment_bytes(), want);
    assert!(delta.len() < full.len());
}

#[test]
fn delta_equals_full_restore_with_sliding_window() {
    // Suffix shorter than the window (old window rows come from the base), longer than it,
    // and exactly at it.
    for (base, end) in [
        (256, 300),
        (256, 512),
        (512, 700),
        (256, 1100),
        (512, 812),
        (768, 1024),
    ] {
        run(swa_layout(), base, end);
    }
}

#[test]
fn delta_equals_full_restore_without_sliding_window() {
    for (base, end) in [(256, 257), (512, 1000)] {
        run(full_layout(), base, end);
    }
}

#[test]
fn delta_on_the_wrong_base_is_rejected() {
    let keys = keys();
    let id = identity(swa_layout());
    let toks = tokens(800, 1);
    let hasher = PrefixHasher::new(&keys, &id.digest(&keys));
    let chain = hasher.chain(&toks);
    let st = state(&id.layout, 0..800);
    let delta = pack(&keys, &id, &chain, &st, 512, 1);
    let d = restore(
        &delta[..],
        &keys,
        &expect(&id),
        &ReadLimits::default(),
        &RestoreControl::default(),
    )
    .unwrap();
    let base = state(&id.layout, 0..512);
    // Right length, other tokens.
    let other = hasher.chain(&tokens(512, 2));
    assert!(matches!(
        apply_delta(&base, other.cut_id(512).unwrap(), &d),
        Err(KvpackError::DeltaBase(_))
    ));
    // Right tokens, shorter base.
    let short = state(&id.layout, 0..256);
    assert!(matches!(
        apply_delta(&short, chain.cut_id(256).unwrap(), &d),
        Err(KvpackError::DeltaBase(_))
    ));
    assert!(apply_delta(&base, chain.cut_id(512).unwrap(), &d).is_ok());
}

#[test]
fn delta_base_is_the_shared_block_prefix_below_the_end() {
    let keys = keys();
    let id = identity(swa_layout());
    let hasher = PrefixHasher::new(&keys, &id.digest(&keys));
    let sender = tokens(1100, 4);
    let chain = hasher.chain(&sender);
    // The receiver holds the first 600 tokens of the same conversation: 2 shared blocks.
    let held = hasher.chain(&sender[..600]);
    assert_eq!(chain.delta_base(held.block_ids(), 1100), 512);
    // Diverging inside block 1: only block 0 is shared.
    let mut other = sender[..600].to_vec();
    other[300] ^= 1;
    assert_eq!(
        chain.delta_base(hasher.chain(&other).block_ids(), 1100),
        256
    );
    // Holding everything up to the end still leaves the last block to send.
    assert_eq!(chain.delta_base(chain.block_ids(), 1024), 768);
    // Nothing shared: a full pack.
    assert_eq!(
        chain.delta_base(hasher.chain(&tokens(600, 5)).block_ids(), 1100),
        0
    );
    assert_eq!(chain.delta_base(&[], 1100), 0);
}
