//! Prompt-lookup drafting: continue the sequence as it went after the last time its current
//! ending appeared.

/// Looks for the sequence's last `n` tokens (from `n_max` down to `n_min`) earlier in the
/// sequence, most recent occurrence first, and proposes what followed.
#[derive(Clone, Copy, Debug)]
pub struct Ngram {
    pub n_max: usize,
    pub n_min: usize,
    /// Tokens searched back from the end (bounds the cost of one proposal).
    pub window: usize,
}

impl Default for Ngram {
    fn default() -> Self {
        Ngram {
            n_max: 4,
            n_min: 2,
            window: 1 << 14,
        }
    }
}

impl Ngram {
    /// Up to `max` tokens that followed the most recent earlier occurrence of the longest
    /// matching suffix of `history`; empty when none matches.
    pub fn draft(&self, history: &[u32], max: usize) -> Vec<u32> {
        let len = history.len();
        let from = len.saturating_sub(self.window);
        let hay = &history[from..];
        for n in (self.n_min.max(1)..=self.n_max).rev() {
            if n >= hay.len() {
                continue;
            }
            let key = &hay[hay.len() - n..];
            // the most recent occurrence that ends before the suffix itself
            let found = (0..hay.len() - n).rev().find(|&i| &hay[i..i + n] == key);
            if let Some(i) = found {
                let next = i + n;
                let end = (next + max).min(hay.len());
                return hay[next..end].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_last_occurrence_of_the_longest_suffix() {
        let g = Ngram::default();
        // "a b c d e ... a b c" -> "d e"
        let h = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3];
        assert_eq!(g.draft(&h, 2), vec![4, 5]);
        assert_eq!(g.draft(&h, 16), vec![4, 5, 9, 9, 1, 2, 3]);
        // the most recent occurrence wins
        let h = [7, 8, 1, 7, 8, 2, 7, 8];
        assert_eq!(g.draft(&h, 1), vec![2]);
        // nothing repeats: no draft
        assert!(g.draft(&[1, 2, 3, 4], 8).is_empty());
        assert!(g.draft(&[], 8).is_empty());
        assert!(g.draft(&[5], 8).is_empty());
        assert!(g.draft(&h, 0).is_empty());
    }

    #[test]
    fn the_search_stays_in_its_window() {
        let g = Ngram {
            window: 4,
            ..Ngram::default()
        };
        // the earlier `1 2` is 6 tokens back, outside the window of 4
        assert!(g.draft(&[1, 2, 3, 9, 9, 9, 1, 2], 4).is_empty());
        assert!(g.draft(&[1, 2, 3, 1, 2], 4).is_empty());
        let wider = Ngram { window: 5, ..g };
        assert_eq!(wider.draft(&[1, 2, 3, 1, 2], 4), vec![3, 1, 2]);
    }
}
