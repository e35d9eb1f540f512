//! Comparisons of two runs' outputs for the GPU checks (`muser-cuda-bench`,
//! `muser-backend-check`, `muser-fused-check`), and the rule that decides how many blocks a
//! decode norm may use. Plain host code, tested without a GPU.

use muser_model::{Batch, KvCache, Model, ModelError};

/// Blocks per row for `norm_fused` (kernels.cu) that reads the residual at `x` and writes the
/// new one to `x_out` (0: in place) and the normalized row to `out_f`, when `want` are asked
/// for. Every block of a row reads the whole row, so more than one block is safe only when no
/// block writes where another reads: not in place, and `out_f` not aliasing `x`.
pub fn norm_slices(x: u64, x_out: u64, out_f: u64, want: u32) -> u32 {
    if x_out == 0 || x_out == x || out_f == x {
        1
    } else {
        want.clamp(1, 32)
    }
}

/// Whether the greedy choices `n1` (from logits `a`) and `n2` (from `b`) of two runs that
/// should agree up to rounding differ only by rounding: the two candidates' logits in `a` are
/// closer than twice the runs' largest logit difference. A wrong row or a wrong cache entry
/// moves logits far more than that.
pub fn near_tie(a: &[f32], b: &[f32], n1: u32, n2: u32) -> bool {
    if n1 == n2 {
        return true;
    }
    let (Some(&x1), Some(&x2)) = (a.get(n1 as usize), a.get(n2 as usize)) else {
        return false;
    };
    (x1 - x2).abs() <= 2.0 * max_abs_diff(a, b)
}

/// The largest absolute difference between two runs' values (over the shorter length).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// max |want - got| / max |want|: the relative error the checks report (infinite when the
/// lengths differ or `got` holds a non-finite value).
pub fn rel_err(want: &[f32], got: &[f32]) -> f64 {
    if want.len() != got.len() || got.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let (mut d, mut m) = (0f64, 0f64);
    for (a, b) in want.iter().zip(got) {
        d = d.max((*a as f64 - *b as f64).abs());
        m = m.max((*a as f64).abs());
    }
    d / m.max(1e-30)
}

/// Index of the largest value (the first of equals; 0 when empty).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Runs `tokens` of sequence `seq` from where its cache ends, in batches of `chunk`; the last
/// row's logits.
pub fn prefill_chunks(
    m: &Model,
    kv: &mut KvCache,
    seq: u32,
    tokens: &[u32],
    chunk: usize,
) -> Result<Vec<f32>, ModelError> {
    let mut last = Vec::new();
    let mut p = kv.seq_len(seq);
    for c in tokens.chunks(chunk.max(1)) {
        last = m.forward(kv, &Batch::single(seq, c, p, true))?.logits;
        p += c.len() as u32;
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_err_and_argmax() {
        assert_eq!(rel_err(&[2.0, -4.0], &[2.0, -3.0]), 0.25);
        assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[1.0], &[f32::NAN]), f64::INFINITY);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn norm_slices_only_when_no_block_overwrites_what_another_reads() {
        let (x, x2, hf) = (0x1000, 0x2000, 0x3000);
        assert_eq!(norm_slices(x, 0, hf, 8), 1, "in place (no destination)");
        assert_eq!(norm_slices(x, x, hf, 8), 1, "in place (destination is x)");
        assert_eq!(norm_slices(x, x2, x, 8), 1, "the output aliases x");
        assert_eq!(norm_slices(x, x2, hf, 8), 8);
        assert_eq!(norm_slices(x, x2, 0, 0), 1);
        assert_eq!(norm_slices(x, x2, hf, 99), 32);
    }

    #[test]
    fn near_ties_are_told_from_real_disagreements() {
        let a = [1.0, 5.00, 4.99, 0.0];
        let b = [1.0, 4.98, 4.995, 0.0];
        // Rounding moved 0.02 and the candidates were 0.01 apart: a tie.
        assert!(near_tie(&a, &b, 1, 2));
        // The same choice is never a problem.
        assert!(near_tie(&a, &b, 1, 1));
        // Candidates 5.0 apart with runs 0.02 apart: a real disagreement.
        assert!(!near_tie(&a, &b, 1, 3));
        // An index past the logits is not a tie.
        assert!(!near_tie(&a, &b, 1, 9));
        assert!((max_abs_diff(&a, &b) - 0.02).abs() < 1e-6);
    }
}
