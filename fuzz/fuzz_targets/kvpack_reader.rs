//! Feeds bytes to the kvpack reader (`muser_kvpack::restore`). With an even first byte the
//! input is the pack itself; with an odd one the rest of the input is XORed into a valid
//! sealed pack, so mutations start from a well-formed file. The reader must return an error
//! (or, for an unchanged pack, the original state); it must never panic or allocate beyond
//! the bounds the limits and the file length give.
//!
//!     cargo +nightly fuzz run kvpack_reader -- -max_total_time=300 -rss_limit_mb=512

#![no_main]

use libfuzzer_sys::fuzz_target;
use muser_kvpack::*;
use std::sync::OnceLock;

struct Fixture {
    keys: Keys,
    id: KvIdentity,
    state: KvState,
    pack: Vec<u8>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let keys = Keys::derive(&[5; 32]);
        let layout = KvLayoutAbi {
            n_layer: 3,
            swa_layers: vec![true, false, true],
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
            engine_abi: "fuzz".into(),
            adapter: None,
        };
        let n = 300u32;
        let tokens: Vec<u32> = (0..n).collect();
        let chain = PrefixHasher::new(&keys, &id.digest(&keys)).chain(&tokens);
        let layers = (0..3)
            .map(|l| {
                let len = layout.layer_range(l, &(0..n)).len() * layout.row_bytes();
                LayerKv {
                    k: (0..len).map(|i| (i * 7 + l) as u8).collect(),
                    v: (0..len).map(|i| (i * 13 + l) as u8).collect(),
                }
            })
            .collect();
        let state = KvState {
            layout,
            positions: 0..n,
            layers,
        };
        let spec = PackSpec {
            identity: &id,
            chain: &chain,
            generation: 1,
            stream: None,
            base_tokens: 0,
            plan: SegmentPlan {
                layers_per_segment: 2,
                tokens_per_segment: BLOCK_TOKENS,
            },
            threads: 1,
        };
        let pack = PackPlan::new(&state, &keys, &spec).unwrap().to_bytes();
        Fixture { keys, id, state, pack }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let input = match data.first() {
        Some(b) if b & 1 == 1 => {
            let mut p = f.pack.clone();
            for (i, x) in data[1..].iter().enumerate() {
                let at = i % p.len();
                p[at] ^= x;
            }
            p
        }
        _ => data.to_vec(),
    };
    let limits = ReadLimits {
        max_manifest_bytes: 1 << 16,
        max_segment_bytes: 1 << 20,
        max_file_bytes: 1 << 24,
        ..ReadLimits::default()
    };
    let expect = Expect {
        identity: &f.id,
        cut: None,
        other_abis: &[],
    };
    match restore(&input[..], &f.keys, &expect, &limits, &RestoreControl::default()) {
        Ok(r) => {
            assert_eq!(input, f.pack, "a changed pack was accepted");
            assert_eq!(r.state, f.state);
        }
        Err(_) => {
            let _ = verify_pack(&input[..], &f.keys, &limits);
        }
    }
});
