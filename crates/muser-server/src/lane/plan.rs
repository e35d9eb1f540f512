//! How a handoff is planned: when `auto` sends a prompt to a producer (the threshold from the
//! measured rates), how the local prefill rate is measured, and where a long handoff is cut
//! into pieces.

use std::sync::Arc;
use std::time::Instant;

use muser_engine::Engine;

/// `auto`'s threshold before the rates are known.
pub(super) const DEFAULT_MIN_TOKENS: usize = 1024;
/// A handoff's cost that does not grow with the prompt (round trips, sealing, the install).
const HANDOFF_FIXED_S: f64 = 0.05;
/// Payload rate assumed before a producer's first handoff (bytes per second).
pub(super) const DEFAULT_PAYLOAD_B_S: f64 = 1e9;

/// The shortest prompt (at least one chunk) for which a producer prefilling at `remote`
/// tokens/s, plus `transfer_s_per_token` and [`HANDOFF_FIXED_S`], beats `local` tokens/s;
/// usize::MAX when it never does.
pub fn threshold(local: f64, remote: f64, transfer_s_per_token: f64, chunk: usize) -> usize {
    let gain = 1.0 / local - 1.0 / remote - transfer_s_per_token;
    if gain.is_nan() || gain <= 0.0 {
        return usize::MAX;
    }
    let n = (HANDOFF_FIXED_S / gain).ceil();
    if n >= usize::MAX as f64 {
        usize::MAX
    } else {
        (n as usize).max(chunk)
    }
}

/// `n` token ids spread over a vocabulary of `n_vocab`: the prompt a prefill rate is timed
/// with at start-up (this engine's, and a producer's warm-up).
pub fn synthetic_prompt(n: usize, n_vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((i * 2_654_435_761 + 17) % n_vocab.max(1) as u64) as u32)
        .collect()
}

/// Prefills `n` prompt tokens (ids spread over the vocabulary) on a free slot of `engine`,
/// computing nothing else, and returns the rate in tokens per second.
pub async fn measure_prefill(
    engine: &Arc<Engine>,
    n_vocab: usize,
    n: usize,
) -> Result<f64, String> {
    let prompt = synthetic_prompt(n, n_vocab);
    let t = Instant::now();
    let mut rx = engine
        .submit(muser_engine::GenerateRequest {
            prompt,
            max_tokens: Some(0),
            cache_prompt: true,
            ..Default::default()
        })
        .map_err(|e| e.to_string())?;
    loop {
        match rx.recv().await {
            Some(muser_engine::Event::Done {
                n_prompt,
                n_cached,
                timings,
                ..
            }) => {
                let secs = t.elapsed().as_secs_f64() - timings.queue_ms / 1e3;
                return Ok((n_prompt - n_cached) as f64 / secs.max(1e-6));
            }
            Some(muser_engine::Event::Error(e)) => return Err(e.to_string()),
            Some(_) => {}
            None => return Err("the engine stopped".into()),
        }
    }
}

/// Where a handoff is cut into pieces: the ends of the pieces of tokens `base..n`, each a
/// multiple of `chunk` but the last (which is `n`). From the end, pieces of 4, 16, 64...
/// chunks: each piece's prefill on the producer then takes several times longer than the
/// transfer of the piece before it (K/V moves an order of magnitude faster than a prefill
/// makes it), and the last piece, the only transfer left on the time to first token, is
/// small. A prompt under 8 chunks past `base` is one piece; a first piece under 2 chunks
/// joins the next.
pub fn pieces(base: usize, n: usize, chunk: usize) -> Vec<usize> {
    let mut ends = vec![n];
    if chunk == 0 || n < base + 8 * chunk {
        return ends;
    }
    let mut size = 4 * chunk;
    let mut end = n;
    loop {
        let cut = end.saturating_sub(size) / chunk * chunk;
        if cut < base + 2 * chunk {
            break;
        }
        ends.push(cut);
        end = cut;
        size *= 4;
    }
    ends.reverse();
    ends
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_shrink_toward_the_end_on_chunk_boundaries() {
        // under 8 chunks: one piece
        assert_eq!(pieces(0, 4095, 512), vec![4095]);
        assert_eq!(pieces(1024, 4096, 512), vec![4096]);
        // a 32k prompt: the last piece 4 chunks, the one before 16, the rest first
        assert_eq!(pieces(0, 32256, 512), vec![22016, 30208, 32256]);
        assert_eq!(pieces(0, 7680, 512), vec![5632, 7680]);
        // a held prefix moves the start, never a cut below it
        assert_eq!(pieces(20480, 32256, 512), vec![22016, 30208, 32256]);
        assert_eq!(pieces(29184, 32256, 512), vec![32256]);
        for (base, n, chunk) in [(0, 131_071, 512), (256, 9000, 64), (0, 100_000, 1000)] {
            let ends = pieces(base, n, chunk);
            assert_eq!(*ends.last().unwrap(), n);
            let mut from = base;
            for (i, &e) in ends.iter().enumerate() {
                assert!(e > from, "{ends:?}");
                if i + 1 < ends.len() {
                    assert_eq!(e % chunk, 0, "{ends:?}");
                    assert!(e - from >= 2 * chunk, "{ends:?}");
                }
                from = e;
            }
            // each piece but the first at most a quarter of what comes before it
            for w in ends.windows(3) {
                assert!(w[2] - w[1] <= (w[1] - w[0]), "{ends:?}");
            }
        }
    }

    #[test]
    fn the_threshold_grows_as_the_producer_gains_less() {
        // a producer 10x faster, transfer free: 50 ms / (1/100 - 1/1000) s = 5.6 tokens,
        // at least a chunk
        assert_eq!(threshold(100.0, 1000.0, 0.0, 512), 512);
        let slow_gain = threshold(1000.0, 1100.0, 0.0, 512);
        assert!(slow_gain > 512 && slow_gain < 1000, "{slow_gain}");
        // not faster, or eaten by the transfer: never
        assert_eq!(threshold(1000.0, 1000.0, 0.0, 512), usize::MAX);
        assert_eq!(threshold(1000.0, 2000.0, 1e-3, 512), usize::MAX);
        assert_eq!(threshold(f64::NAN, 2000.0, 0.0, 512), usize::MAX);
    }
}
