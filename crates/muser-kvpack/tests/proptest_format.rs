//! Property tests over the pack format: any geometry roundtrips; any single-byte change or
//! truncation is rejected (or, impossibly here, yields the identical state).

mod common;
use common::*;
use muser_kvpack::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    layout: KvLayoutAbi,
    n: u32,
    base_blocks: u32,
    plan: SegmentPlan,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1u32..5,
        any::<u8>(),
        1u32..3,
        1u32..9,
        1u32..600,
        any::<bool>(),
        1u32..900,
        0u32..4,
        1u32..4,
        1u32..3,
    )
        .prop_map(
            |(n_layer, bits, heads, dim, n_swa, f32, n, base_blocks, lps, bps)| {
                let swa_layers: Vec<bool> = (0..n_layer).map(|i| bits >> i & 1 == 1).collect();
                Case {
                    layout: KvLayoutAbi {
                        n_layer,
                        swa_layers,
                        n_head_kv: heads,
                        head_dim: dim,
                        n_swa,
                        dtype: if f32 { KvDtype::F32 } else { KvDtype::F16 },
                        cell_layout: CellLayout::TokenMajor,
                    },
                    n,
                    base_blocks,
                    plan: SegmentPlan {
                        layers_per_segment: lps,
                        tokens_per_segment: bps * BLOCK_TOKENS,
                    },
                }
            },
        )
}

fn build(keys: &Keys, c: &Case, base: u32) -> (KvIdentity, KvState, Vec<u8>) {
    let id = identity(c.layout.clone());
    let toks = tokens(c.n, c.n as u64);
    let chain = PrefixHasher::new(keys, &id.digest(keys)).chain(&toks);
    let st = state(&id.layout, 0..c.n);
    let spec = PackSpec {
        identity: &id,
        chain: &chain,
        generation: 1,
        stream: None,
        base_tokens: base,
        plan: c.plan,
        threads: 2,
    };
    let bytes = PackPlan::new(&st, keys, &spec).unwrap().to_bytes();
    (id, st, bytes)
}

fn rs(bytes: &[u8], keys: &Keys, id: &KvIdentity) -> Result<Restored> {
    restore(
        bytes,
        keys,
        &expect(id),
        &ReadLimits::default(),
        &RestoreControl::default(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn full_and_delta_roundtrip(c in case()) {
        let keys = keys();
        let (id, st, bytes) = build(&keys, &c, 0);
        let r = rs(&bytes, &keys, &id).unwrap();
        prop_assert_eq!(&r.state, &st);
        let base = c.base_blocks.min((c.n - 1) / BLOCK_TOKENS) * BLOCK_TOKENS;
        if base > 0 {
            let (_, _, delta) = build(&keys, &c, base);
            let d = rs(&delta, &keys, &id).unwrap();
            let held = state(&id.layout, 0..base);
            let applied = apply_delta(&held, d.manifest.block_ids[(base / BLOCK_TOKENS) as usize - 1], &d).unwrap();
            prop_assert_eq!(applied, st);
        }
    }

    #[test]
    fn any_byte_change_is_rejected(c in case(), at in any::<prop::sample::Index>(), x in 1u8..=255) {
        let keys = keys();
        let (id, _, mut bytes) = build(&keys, &c, 0);
        let i = at.index(bytes.len());
        bytes[i] ^= x;
        // "Rejected or identical": every byte is covered by a digest, so always rejected.
        prop_assert!(rs(&bytes, &keys, &id).is_err(), "byte {} accepted", i);
    }

    #[test]
    fn any_truncation_is_rejected(c in case(), at in any::<prop::sample::Index>()) {
        let keys = keys();
        let (id, _, bytes) = build(&keys, &c, 0);
        let n = at.index(bytes.len());
        prop_assert!(rs(&bytes[..n], &keys, &id).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..400), magic in any::<bool>()) {
        let keys = keys();
        let id = identity(swa_layout());
        let mut d = data;
        if magic && d.len() >= 8 {
            d[..8].copy_from_slice(b"MUKVPAK\0");
        }
        prop_assert!(rs(&d, &keys, &id).is_err());
    }
}
