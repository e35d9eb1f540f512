//! The greedy pick over a row of logits: one rule for every argmax in the system.

/// The id of the highest logit of a raw row, as the engine's sampler picks it over its candidates: NaN
/// counts as -inf and a tie goes to the lowest id (0 for an empty or all -inf/NaN row). Two
/// passes the compiler vectorizes: the maximum (`f32::max` skips NaN), then its first index.
pub fn argmax_logits(logits: &[f32]) -> u32 {
    // 16 running maxima (a comparison, so NaN never wins), merged at the end.
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = logits.chunks_exact(16);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let m = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a });
    if m == f32::NEG_INFINITY {
        return 0;
    }
    // The first 16-value chunk holding it (a branch-free test per chunk), then its index.
    let at = logits
        .chunks(16)
        .position(|c| c.iter().fold(false, |a, &v| a | (v == m)))
        .unwrap_or(0);
    let c = &logits[16 * at..];
    (16 * at + c.iter().position(|&v| v == m).unwrap_or(0)) as u32
}
