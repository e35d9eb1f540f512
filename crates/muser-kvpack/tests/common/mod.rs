#![allow(dead_code)]
//! Shared fixtures: small layouts, deterministic pseudo-random states, keys.

use muser_kvpack::*;

pub const KEY: [u8; 32] = [7; 32];

pub fn keys() -> Keys {
    Keys::derive(&KEY)
}

/// xorshift64*: deterministic bytes without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// 6 layers, every third one sliding (window 300, deliberately not a block multiple),
/// 2 KV heads × 8 dims, F16.
pub fn swa_layout() -> KvLayoutAbi {
    KvLayoutAbi {
        n_layer: 6,
        swa_layers: vec![true, true, false, true, true, false],
        n_head_kv: 2,
        head_dim: 8,
        n_swa: 300,
        dtype: KvDtype::F16,
        cell_layout: CellLayout::TokenMajor,
    }
}

pub fn full_layout() -> KvLayoutAbi {
    KvLayoutAbi {
        n_layer: 3,
        swa_layers: vec![false; 3],
        n_head_kv: 1,
        head_dim: 4,
        n_swa: 0,
        dtype: KvDtype::F32,
        cell_layout: CellLayout::TokenMajor,
    }
}

pub fn identity(layout: KvLayoutAbi) -> KvIdentity {
    KvIdentity {
        model_weights: field_digest("weights", b"w"),
        tokenizer: field_digest("tokenizer", b"t"),
        chat_template: field_digest("template", b"c"),
        weight_precision: "Q4_1".into(),
        layout,
        context_policy: field_digest("context", b"n_ctx=4096"),
        engine_abi: "muser-cpu-f16-v1".into(),
        adapter: None,
    }
}

pub fn tokens(n: u32, seed: u64) -> Vec<u32> {
    let mut r = Rng(seed.wrapping_mul(2).wrapping_add(1));
    (0..n).map(|_| r.below(50_000) as u32).collect()
}

/// A state over `positions` whose rows depend only on (layer, position), so that the
/// same position always has the same bytes whichever state it comes from.
pub fn state(layout: &KvLayoutAbi, positions: std::ops::Range<u32>) -> KvState {
    let rb = layout.row_bytes();
    let layers = (0..layout.n_layer as usize)
        .map(|l| {
            let r = layout.layer_range(l, &positions);
            let mut k = vec![0u8; r.len() * rb];
            let mut v = vec![0u8; r.len() * rb];
            for (i, p) in r.enumerate() {
                Rng(((l as u64) << 32 | p as u64) * 2 + 1).fill(&mut k[i * rb..(i + 1) * rb]);
                Rng(((l as u64) << 32 | p as u64) * 2 + 0x9e37_79b9)
                    .fill(&mut v[i * rb..(i + 1) * rb]);
            }
            LayerKv { k, v }
        })
        .collect();
    KvState {
        layout: layout.clone(),
        positions,
        layers,
    }
}

pub fn small_plan() -> SegmentPlan {
    SegmentPlan {
        layers_per_segment: 2,
        tokens_per_segment: BLOCK_TOKENS,
    }
}

/// A full pack of `n` tokens of the SWA layout, generation `gen`, with its identity.
pub fn full_pack(
    keys: &Keys,
    n: u32,
    seed: u64,
    gen: u64,
) -> (Vec<u8>, KvIdentity, KvState, Vec<u32>) {
    let id = identity(swa_layout());
    let toks = tokens(n, seed);
    let hasher = PrefixHasher::new(keys, &id.digest(keys));
    let chain = hasher.chain(&toks);
    let st = state(&id.layout, 0..n);
    let spec = PackSpec {
        identity: &id,
        chain: &chain,
        generation: gen,
        stream: None,
        base_tokens: 0,
        plan: small_plan(),
        threads: 2,
    };
    let bytes = PackPlan::new(&st, keys, &spec).unwrap().to_bytes();
    (bytes, id, st, toks)
}

pub fn expect(id: &KvIdentity) -> Expect<'_> {
    Expect {
        identity: id,
        cut: None,
        other_abis: &[],
    }
}
