//! SentencePiece-style encoding (`tokenizer.ggml.model = "llama"`): start from UTF-8
//! characters, repeatedly merge the adjacent pair whose concatenation is the vocabulary token
//! with the highest score (ties to the leftmost), then emit tokens, falling back to `<0xXX>`
//! byte tokens for anything that is not one.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::tokenizer::Tokenizer;

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    n: usize,
    prev: i64,
    next: i64,
}

#[derive(PartialEq)]
struct Pair {
    score: f32,
    left: Reverse<usize>,
    right: usize,
    size: usize,
}

impl Eq for Pair {}
impl PartialOrd for Pair {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pair {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(self.left.cmp(&o.left))
    }
}

/// Encodes `text` (spaces already escaped as U+2581) and appends the ids.
pub(crate) fn encode(text: &str, tok: &Tokenizer, out: &mut Vec<u32>) {
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    let count = text.chars().count();
    for (i, (start, c)) in text.char_indices().enumerate() {
        syms.push(Sym {
            start,
            n: c.len_utf8(),
            prev: i as i64 - 1,
            next: if i + 1 == count { -1 } else { i as i64 + 1 },
        });
    }
    let mut heap = BinaryHeap::new();
    let try_pair = |syms: &[Sym], l: i64, r: i64, heap: &mut BinaryHeap<Pair>| {
        if l < 0 || r < 0 {
            return;
        }
        let (ls, rs) = (syms[l as usize], syms[r as usize]);
        let s = &text[ls.start..ls.start + ls.n + rs.n];
        if let Some(id) = tok.token_id(s) {
            heap.push(Pair {
                score: tok.score(id),
                left: Reverse(l as usize),
                right: r as usize,
                size: s.len(),
            });
        }
    };
    for i in 1..syms.len() {
        try_pair(&syms, i as i64 - 1, i as i64, &mut heap);
    }
    while let Some(p) = heap.pop() {
        let (l, r) = (p.left.0, p.right);
        if syms[l].n == 0 || syms[r].n == 0 || syms[l].n + syms[r].n != p.size {
            continue;
        }
        syms[l].n += syms[r].n;
        syms[r].n = 0;
        syms[l].next = syms[r].next;
        let after = syms[r].next;
        if after >= 0 {
            syms[after as usize].prev = l as i64;
        }
        try_pair(&syms, syms[l].prev, l as i64, &mut heap);
        try_pair(&syms, l as i64, syms[l].next, &mut heap);
    }
    let mut i: i64 = if syms.is_empty() { -1 } else { 0 };
    while i >= 0 {
        let s = syms[i as usize];
        let piece = &text[s.start..s.start + s.n];
        match tok.token_id(piece) {
            Some(id) => out.push(id),
            None => {
                for b in piece.bytes() {
                    let hex = format!("<0x{b:02X}>");
                    let id = tok.token_id(&hex).or_else(|| {
                        if b.is_ascii() {
                            tok.token_id(std::str::from_utf8(&[b]).unwrap_or(""))
                        } else {
                            None
                        }
                    });
                    // llama.cpp aborts when a byte has no token; Muser drops the byte.
                    out.extend(id);
                }
            }
        }
        i = s.next;
    }
}
