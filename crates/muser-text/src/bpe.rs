//! Byte-level BPE: pre-tokenized words, GPT-2 byte characters, lowest-rank merge first.
//!
//! Strings are interned once at load: every vocabulary token, every merge side and every merge
//! result gets a piece id, so encoding compares integers only. The merge order is llama.cpp's:
//! the lowest rank first, ties to the leftmost pair, until no adjacent pair has a rank.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::pretok::PreTokenizer;
use crate::unicode::byte_to_char_table;

pub(crate) struct Bpe {
    pre: PreTokenizer,
    ignore_merges: bool,
    piece_text: Vec<String>,
    piece_token: Vec<Option<u32>>,
    /// (left piece, right piece) -> (rank, merged piece); the first rank of a duplicate wins.
    merges: HashMap<(u32, u32), (u32, u32)>,
    byte_piece: [u32; 256],
}

#[derive(Clone, Copy)]
struct Sym {
    piece: u32,
    /// Raw bytes covered; only sums are compared, to detect stale pairs.
    n: u32,
    prev: i32,
    next: i32,
}

struct Interner {
    ids: HashMap<String, u32>,
    texts: Vec<String>,
}

impl Interner {
    fn id(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.ids.get(s) {
            return id;
        }
        let id = self.texts.len() as u32;
        self.ids.insert(s.to_string(), id);
        self.texts.push(s.to_string());
        id
    }
}

impl Bpe {
    pub fn new(
        pre: PreTokenizer,
        ignore_merges: bool,
        merges: &[String],
        token_to_id: &HashMap<String, u32>,
    ) -> Bpe {
        let mut int = Interner {
            ids: HashMap::with_capacity(token_to_id.len() + merges.len()),
            texts: Vec::with_capacity(token_to_id.len() + merges.len()),
        };
        let mut byte_piece = [0u32; 256];
        for (b, &c) in byte_to_char_table().iter().enumerate() {
            byte_piece[b] = int.id(c.encode_utf8(&mut [0u8; 4]));
        }
        let mut table = HashMap::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            // Split at the first space found from byte 1 (a merge without one maps "" + "").
            let (first, second) = match m.as_bytes().iter().skip(1).position(|&b| b == b' ') {
                Some(p) => (&m[..p + 1], &m[p + 2..]),
                None => ("", ""),
            };
            let l = int.id(first);
            let r = int.id(second);
            let merged = int.id(&format!("{first}{second}"));
            table.entry((l, r)).or_insert((rank as u32, merged));
        }
        for t in token_to_id.keys() {
            int.id(t);
        }
        let piece_token = int
            .texts
            .iter()
            .map(|t| token_to_id.get(t).copied())
            .collect();
        Bpe {
            pre,
            ignore_merges,
            piece_text: int.texts,
            piece_token,
            merges: table,
            byte_piece,
        }
    }

    /// Encodes one raw fragment (no special tokens inside) and appends the ids; stops after the
    /// first word that takes `out` past `limit` tokens.
    pub fn encode(
        &self,
        text: &str,
        token_to_id: &HashMap<String, u32>,
        out: &mut Vec<u32>,
        limit: usize,
    ) {
        let chars = byte_to_char_table();
        let mut syms: Vec<Sym> = Vec::new();
        let mut heap = BinaryHeap::new();
        let mut encoded = String::new();
        for range in self.pre.split(text) {
            if out.len() > limit {
                return;
            }
            let word = &text.as_bytes()[range];
            if self.ignore_merges {
                encoded.clear();
                encoded.extend(word.iter().map(|&b| chars[b as usize]));
                if let Some(&id) = token_to_id.get(encoded.as_str()) {
                    out.push(id);
                    continue;
                }
            }
            syms.clear();
            heap.clear();
            let len = word.len() as i32;
            syms.extend(word.iter().enumerate().map(|(i, &b)| Sym {
                piece: self.byte_piece[b as usize],
                n: 1,
                prev: i as i32 - 1,
                next: if i as i32 + 1 == len {
                    -1
                } else {
                    i as i32 + 1
                },
            }));
            for i in 1..syms.len() {
                self.push_pair(&syms, i - 1, i, &mut heap);
            }
            while let Some(Reverse((_, left, right, size))) = heap.pop() {
                let (l, r) = (left as usize, right as usize);
                if syms[l].n == 0 || syms[r].n == 0 || syms[l].n + syms[r].n != size {
                    continue;
                }
                let merged = self.merges[&(syms[l].piece, syms[r].piece)].1;
                syms[l].piece = merged;
                syms[l].n += syms[r].n;
                syms[r].n = 0;
                syms[l].next = syms[r].next;
                let after = syms[r].next;
                if after >= 0 {
                    syms[after as usize].prev = left as i32;
                }
                if syms[l].prev >= 0 {
                    self.push_pair(&syms, syms[l].prev as usize, l, &mut heap);
                }
                if syms[l].next >= 0 {
                    self.push_pair(&syms, l, syms[l].next as usize, &mut heap);
                }
            }
            for s in syms.iter().filter(|s| s.n > 0) {
                match self.piece_token[s.piece as usize] {
                    Some(id) => out.push(id),
                    None => {
                        // Fall back to one-byte tokens for each byte of the symbol's text;
                        // only ASCII bytes can name a token.
                        for b in self.piece_text[s.piece as usize]
                            .bytes()
                            .filter(|b| b.is_ascii())
                        {
                            if let Some(&id) =
                                token_to_id.get(std::str::from_utf8(&[b]).unwrap_or(""))
                            {
                                out.push(id);
                            }
                        }
                    }
                }
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn push_pair(
        &self,
        syms: &[Sym],
        l: usize,
        r: usize,
        heap: &mut BinaryHeap<Reverse<(u32, u32, u32, u32)>>,
    ) {
        if let Some(&(rank, _)) = self.merges.get(&(syms[l].piece, syms[r].piece)) {
            heap.push(Reverse((rank, l as u32, r as u32, syms[l].n + syms[r].n)));
        }
    }
}
