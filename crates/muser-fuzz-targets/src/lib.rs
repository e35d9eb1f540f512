//! muser-fuzz-targets: the parsers that read untrusted bytes, as fuzz targets, and a
//! time-bounded mutation fuzzer that runs them on stable Rust. The cargo-fuzz binaries in
//! `fuzz/` call the same target functions for long local runs; `tests/stable.rs` replays the
//! seeds under `fuzz/seeds/<target>/` and mutates them for `MUSER_FUZZ_SECS` seconds each
//! (default 4) on every `cargo test`.
//!
//! A target returns normally for any input (an error is a normal answer); a panic, a hang or
//! an allocation far beyond the input's size is the bug a fuzzer finds.

use std::time::{Duration, Instant};

pub mod targets;

/// The wall time each target gets in the test suite: `MUSER_FUZZ_SECS`, default 4 seconds.
pub fn budget() -> Duration {
    let secs = std::env::var("MUSER_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(4.0);
    Duration::from_secs_f64(secs.clamp(0.0, 3600.0))
}

/// The seed inputs of a target: every file under `fuzz/seeds/<name>/`.
pub fn seeds(name: &str) -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds")
        .join(name);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    files.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

/// A small deterministic generator (xorshift64*), so a failure repeats with its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Bytes a mutation may write: boundary integers and the characters parsers branch on.
const SMASH: [u64; 8] = [0, 1, 0x7f, 0xff, 1 << 31, 1 << 32, 1 << 63, u64::MAX];
const TOKENS: [&[u8]; 12] = [
    b"[", b"]", b"{", b"}", b"\"", b",", b":", b"-1", b"1e999", b"null", b"\\u0000", b"\xff",
];

/// One mutation of `b`, drawing material from `other` (another seed).
fn mutate(rng: &mut Rng, b: &mut Vec<u8>, other: &[u8]) {
    match rng.below(7) {
        _ if b.is_empty() => b.push(rng.next() as u8),
        0 => {
            let i = rng.below(b.len());
            b[i] ^= 1 << rng.below(8);
        }
        1 => b.truncate(rng.below(b.len() + 1)),
        2 if b.len() >= 8 => {
            let i = rng.below(b.len() - 7);
            let v = SMASH[rng.below(SMASH.len())] ^ (rng.next() & 0xf);
            b[i..i + 8].copy_from_slice(&v.to_le_bytes());
        }
        3 => {
            let i = rng.below(b.len() + 1);
            let t = TOKENS[rng.below(TOKENS.len())];
            let long = rng.below(8) == 0;
            let n = 1 + rng.below(if long { 4096 } else { 4 });
            let run: Vec<u8> = t.iter().copied().cycle().take(t.len() * n).collect();
            b.splice(i..i, run);
        }
        4 if !other.is_empty() => {
            // splice a piece of another seed in
            let (a, z) = (rng.below(other.len()), rng.below(other.len()));
            let piece = &other[a.min(z)..a.max(z)];
            let i = rng.below(b.len() + 1);
            b.splice(i..i, piece.iter().copied());
        }
        5 => {
            let i = rng.below(b.len());
            let n = rng.below(b.len() - i + 1);
            b.drain(i..i + n);
        }
        _ => {
            let i = rng.below(b.len());
            b[i] = rng.next() as u8;
        }
    }
}

/// Runs `target` on every seed, then on mutations of them (1 to 4 stacked) until `budget`
/// has passed; returns how many inputs ran. A panic names the input that caused it.
pub fn fuzz(seeds: &[Vec<u8>], budget: Duration, mut target: impl FnMut(&[u8])) -> u64 {
    assert!(!seeds.is_empty(), "no seeds");
    let mut ran = 0u64;
    let mut check = |input: &[u8]| {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(input)));
        if let Err(e) = result {
            let head: String = input.iter().take(256).map(|b| format!("{b:02x}")).collect();
            panic!(
                "fuzz target panicked on a {}-byte input (hex head {head}): {:?}",
                input.len(),
                e.downcast_ref::<String>()
                    .map(String::as_str)
                    .or(e.downcast_ref::<&str>().copied())
            );
        }
    };
    for s in seeds {
        check(s);
        ran += 1;
    }
    let seed = std::env::var("MUSER_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9e37_79b9_7f4a_7c15u64);
    let mut rng = Rng(seed | 1);
    let start = Instant::now();
    while start.elapsed() < budget {
        let mut b = seeds[rng.below(seeds.len())].clone();
        let other = &seeds[rng.below(seeds.len())];
        for _ in 0..1 + rng.below(4) {
            mutate(&mut rng, &mut b, other);
        }
        check(&b);
        ran += 1;
    }
    ran
}
