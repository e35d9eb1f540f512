//! Pre-tokenizers: split a raw fragment into words before BPE, with the same semantics as
//! llama.cpp's hand-written matchers for the GPT-2, Llama-3 and Qwen2 regexes.
//!
//! Each splitter walks one segment of codepoints and records the end of every word. Words never
//! cross segment boundaries; a later splitter refines the segments of an earlier one.

use crate::unicode::{flags, to_lower_ascii, Flags};

/// The pre-tokenizers Muser implements, by what they do (many GGUF names map to each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    Llama3,
    /// Llama-3's pattern with single digits (`\p{N}` instead of `\p{N}{1,3}`).
    Qwen2,
    /// Every digit isolated (`\p{N}`), then the GPT-2 pattern inside each piece.
    SmolLm,
}

impl PreTokenizer {
    /// Splits `text` into word byte ranges.
    pub(crate) fn split(self, text: &str) -> Vec<std::ops::Range<usize>> {
        let mut cpts = Vec::with_capacity(text.len());
        let mut starts = Vec::with_capacity(text.len() + 1);
        for (i, c) in text.char_indices() {
            cpts.push(c as u32);
            starts.push(i);
        }
        starts.push(text.len());
        let whole = [cpts.len()];
        let ends = match self {
            PreTokenizer::Gpt2 => run(&cpts, &whole, split_gpt2),
            PreTokenizer::Llama3 => run(&cpts, &whole, |s, o| split_llama3(s, o, 3)),
            PreTokenizer::Qwen2 => run(&cpts, &whole, |s, o| split_llama3(s, o, 1)),
            PreTokenizer::SmolLm => {
                let digits = run(&cpts, &whole, split_digits);
                run(&cpts, &digits, split_gpt2)
            }
        };
        let mut prev = 0;
        ends.into_iter()
            .map(|e| {
                let r = starts[prev]..starts[e];
                prev = e;
                r
            })
            .collect()
    }
}

/// One segment of codepoints; positions outside it read as "no codepoint".
struct Seg<'a> {
    cpts: &'a [u32],
    ini: usize,
    end: usize,
    prev_end: usize,
}

const OUT_OF_RANGE: u32 = u32::MAX;

impl Seg<'_> {
    fn cpt(&self, pos: usize) -> u32 {
        if self.ini <= pos && pos < self.end {
            self.cpts[pos]
        } else {
            OUT_OF_RANGE
        }
    }
    fn flags(&self, pos: usize) -> Flags {
        if self.ini <= pos && pos < self.end {
            flags(self.cpts[pos])
        } else {
            Flags::NONE
        }
    }
    /// Ends a word at `end` (empty words are dropped).
    fn cut(&mut self, end: usize, out: &mut Vec<usize>) {
        if end > self.prev_end {
            out.push(end);
        }
        self.prev_end = end;
    }
}

/// Applies `f` to every segment (given by lengths) and returns word end positions.
fn run(
    cpts: &[u32],
    seg_ends_or_lens: &[usize],
    f: impl Fn(&mut Seg<'_>, &mut Vec<usize>),
) -> Vec<usize> {
    let mut out = Vec::with_capacity(cpts.len() / 3 + 1);
    let mut start = 0;
    for &end in seg_ends_or_lens {
        let mut seg = Seg {
            cpts,
            ini: start,
            end,
            prev_end: start,
        };
        f(&mut seg, &mut out);
        start = end;
    }
    out
}

/// `\p{N}` as a split: each digit alone, the gaps between digits kept.
fn split_digits(s: &mut Seg<'_>, out: &mut Vec<usize>) {
    for pos in s.ini..s.end {
        if s.flags(pos).is_number() {
            s.cut(pos, out);
            s.cut(pos + 1, out);
        }
    }
    let end = s.end;
    s.cut(end, out);
}

/// Length of a contraction (`'s`, `'t`, `'m`, `'d`: 2; `'re`, `'ve`, `'ll`: 3) at `pos`.
fn contraction(s: &Seg<'_>, pos: usize, fold_case: bool) -> Option<usize> {
    if s.cpt(pos) != u32::from(b'\'') || pos + 1 >= s.end {
        return None;
    }
    let lower = |c: u32| if fold_case { to_lower_ascii(c) } else { c };
    let is = |c: u32, ch: u8| c == u32::from(ch);
    let next = lower(s.cpt(pos + 1));
    if is(next, b's') || is(next, b't') || is(next, b'm') || is(next, b'd') {
        return Some(2);
    }
    if pos + 2 < s.end {
        let nn = lower(s.cpt(pos + 2));
        if (is(next, b'r') && is(nn, b'e'))
            || (is(next, b'v') && is(nn, b'e'))
            || (is(next, b'l') && is(nn, b'l'))
        {
            return Some(3);
        }
    }
    None
}

fn other(f: Flags) -> bool {
    !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.any()
}

fn split_gpt2(s: &mut Seg<'_>, out: &mut Vec<usize>) {
    let mut pos = s.ini;
    while pos < s.end {
        let cpt = s.cpt(pos);
        let fl = s.flags(pos);
        if let Some(n) = contraction(s, pos, false) {
            pos += n;
            s.cut(pos, out);
            continue;
        }
        let space = cpt == u32::from(b' ');
        let mut f2 = if space { s.flags(pos + 1) } else { fl };
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
        let class: Option<fn(Flags) -> bool> = if f2.is_letter() {
            Some(Flags::is_letter)
        } else if f2.is_number() {
            Some(Flags::is_number)
        } else if other(f2) {
            Some(other)
        } else {
            None
        };
        if let Some(class) = class {
            pos += usize::from(space);
            while class(f2) {
                pos += 1;
                f2 = s.flags(pos);
            }
            s.cut(pos, out);
            continue;
        }
        pos = whitespace_run(s, pos, out, false);
    }
}

/// The `\s*[\r\n]+` (when `newlines`), `\s+(?!\S)`, `\s+` alternatives and the no-match step.
fn whitespace_run(s: &mut Seg<'_>, mut pos: usize, out: &mut Vec<usize>, newlines: bool) -> usize {
    let mut n = 0;
    let mut last_newline_end = 0;
    while s.flags(pos + n).is_whitespace() {
        let c = s.cpt(pos + n);
        if newlines && (c == u32::from(b'\r') || c == u32::from(b'\n')) {
            last_newline_end = pos + n + 1;
        }
        n += 1;
    }
    if last_newline_end > 0 {
        pos = last_newline_end;
    } else if n > 1 && s.cpt(pos + n) != OUT_OF_RANGE {
        pos += n - 1;
    } else if n > 0 {
        pos += n;
    } else {
        pos += 1;
    }
    s.cut(pos, out);
    pos
}

/// Llama-3 (`max_digits` 3) and Qwen2 (`max_digits` 1).
fn split_llama3(s: &mut Seg<'_>, out: &mut Vec<usize>, max_digits: usize) {
    let is_nl = |c: u32| c == u32::from(b'\r') || c == u32::from(b'\n');
    let mut pos = s.ini;
    while pos < s.end {
        let cpt = s.cpt(pos);
        let fl = s.flags(pos);
        if let Some(n) = contraction(s, pos, true) {
            pos += n;
            s.cut(pos, out);
            continue;
        }
        // `[^\r\n\p{L}\p{N}]?\p{L}+`
        if !(is_nl(cpt) || fl.is_number()) && (fl.is_letter() || s.flags(pos + 1).is_letter()) {
            pos += 1;
            while s.flags(pos).is_letter() {
                pos += 1;
            }
            s.cut(pos, out);
            continue;
        }
        // `\p{N}{1,max_digits}`
        if fl.is_number() {
            let mut ini = pos;
            while s.flags(pos).is_number() {
                pos += 1;
                if pos - ini >= max_digits {
                    s.cut(pos, out);
                    ini = pos;
                }
            }
            s.cut(pos, out);
            continue;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let space = cpt == u32::from(b' ');
        let mut f2 = if space { s.flags(pos + 1) } else { fl };
        if !(f2.is_whitespace() || f2.is_letter() || f2.is_number()) && fl.any() {
            pos += usize::from(space);
            while other(f2) {
                pos += 1;
                f2 = s.flags(pos);
            }
            while is_nl(s.cpt(pos)) {
                pos += 1;
            }
            s.cut(pos, out);
            continue;
        }
        pos = whitespace_run(s, pos, out, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(p: PreTokenizer, t: &str) -> Vec<&str> {
        p.split(t).into_iter().map(|r| &t[r]).collect()
    }

    #[test]
    fn gpt2_words() {
        assert_eq!(
            words(PreTokenizer::Gpt2, "Hello world's  end  \n x1234 ++a"),
            ["Hello", " world", "'s", " ", " end", "  \n", " x", "1234", " ++", "a"]
        );
        assert_eq!(words(PreTokenizer::Gpt2, "a   "), ["a", "   "]);
    }

    #[test]
    fn smollm_isolates_digits() {
        assert_eq!(
            words(PreTokenizer::SmolLm, "x 1234y"),
            ["x", " ", "1", "2", "3", "4", "y"]
        );
    }

    #[test]
    fn llama3_words() {
        assert_eq!(
            words(PreTokenizer::Llama3, "I'M 12345 fine!!\n\n  ok"),
            ["I", "'M", " ", "123", "45", " fine", "!!\n\n", " ", " ok"]
        );
        assert_eq!(words(PreTokenizer::Qwen2, "a123"), ["a", "1", "2", "3"]);
    }
}
