//! The machine's memory bandwidth as the decode loop can use it, measured on the bench's own
//! threads: reading the model's weights from the map, and `memcpy` between two buffers.

use muser_model::Model;
use std::time::Instant;

/// Size of each of the two buffers of the copy probe: several times the last-level cache.
pub const PROBE_BYTES: usize = 64 << 20;

/// The machine's memory bandwidth as the decode loop can use it.
pub struct Bandwidth {
    /// Reading the model's weights from the memory map (what decode does), GB/s.
    pub read_gb_s: f64,
    /// `memcpy` between two buffers, bytes read plus bytes written (STREAM's convention), GB/s.
    pub copy_gb_s: f64,
}

/// Times, on `threads` threads (each its own part), reading every weight byte of `model` and
/// copying `PROBE_BYTES` between two buffers; best of five, after touching every page.
pub fn probe(model: &Model, threads: usize) -> Bandwidth {
    let threads = threads.max(1);
    let g = model.gguf();
    let slices: Vec<&[u8]> = g.tensors().iter().map(|t| g.tensor_data(t)).collect();
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let parts = split_bytes(&slices, total.div_ceil(threads));
    let n = PROBE_BYTES / 8;
    let src: Vec<u64> = (0..n as u64).collect();
    let mut dst = vec![1u64; n];
    let per = n.div_ceil(threads);
    let mut copy_gb_s = 0f64;
    let mut read_gb_s = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(per).zip(src.chunks(per)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        copy_gb_s = copy_gb_s.max(2.0 * PROBE_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        let sum = std::thread::scope(|s| {
            let hs: Vec<_> = parts
                .iter()
                .map(|p| s.spawn(move || p.iter().fold(0u64, |a, x| a.wrapping_add(read_sum(x)))))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        read_gb_s = read_gb_s.max(total as f64 / t.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(sum);
    }
    std::hint::black_box(&dst);
    Bandwidth {
        read_gb_s,
        copy_gb_s,
    }
}

/// `slices` cut into consecutive parts of about `per` bytes each.
fn split_bytes<'a>(slices: &[&'a [u8]], per: usize) -> Vec<Vec<&'a [u8]>> {
    let per = per.max(1);
    let mut parts = vec![Vec::new()];
    let mut room = per;
    for s in slices {
        let mut s: &[u8] = s;
        while !s.is_empty() {
            if room == 0 {
                parts.push(Vec::new());
                room = per;
            }
            let (a, b) = s.split_at(room.min(s.len()));
            if let Some(p) = parts.last_mut() {
                p.push(a);
            }
            room -= a.len();
            s = b;
        }
    }
    parts
}

/// A sum over the bytes of `x` as u64 words with independent lanes, so that it runs at load
/// bandwidth.
fn read_sum(x: &[u8]) -> u64 {
    // SAFETY: any bit pattern is a valid u64.
    let (head, words, tail) = unsafe { x.align_to::<u64>() };
    let mut acc = [0u64; 8];
    let mut chunks = words.chunks_exact(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*v);
        }
    }
    let rest = chunks
        .remainder()
        .iter()
        .fold(0u64, |a, v| a.wrapping_add(*v));
    let bytes = head
        .iter()
        .chain(tail)
        .fold(0u64, |a, &b| a.wrapping_add(u64::from(b)));
    acc.iter()
        .fold(rest.wrapping_add(bytes), |a, v| a.wrapping_add(*v))
}
