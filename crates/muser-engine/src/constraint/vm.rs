//! The VM: a [`Matcher`] runs a [`Grammar`] as threads with hash-consed return stacks, and
//! masks a [`Vocab`] by walking its pieces in byte order.

use super::compile::Inst;
use super::json::Utf8;
use muser_text::Tokenizer;

use super::*;

// ---- free text up to a stop string ---------------------------------------------------------

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct UntilState {
    /// Bytes of the stop string matched at the end of the text so far.
    matched: u16,
    /// The last byte was `<`.
    lt: bool,
    len: u32,
    utf8: Utf8,
}

enum UntilStep {
    Fail,
    More,
    Done,
}

/// The longest prefix of `stop` that is a suffix of `stop[..m] + b`.
fn stop_progress(stop: &[u8], m: usize, b: u8) -> usize {
    if m < stop.len() && stop[m] == b {
        return m + 1;
    }
    (1..=m)
        .rev()
        .find(|&k| stop[k - 1] == b && stop[..k - 1] == stop[m + 1 - k..m])
        .unwrap_or(0)
}

impl UntilState {
    fn step(&mut self, stop: &[u8], max_len: u32, b: u8) -> UntilStep {
        self.len += 1;
        if self.len > max_len {
            return UntilStep::Fail;
        }
        if self.utf8.is_open() || b >= 0x80 {
            if !self.utf8.step(b) {
                return UntilStep::Fail;
            }
        } else if (b < 0x20 && !matches!(b, b'\t' | b'\n' | b'\r')) || b == 0x7f {
            return UntilStep::Fail;
        }
        let m = self.matched as usize;
        let next = stop_progress(stop, m, b);
        if next == stop.len() {
            return UntilStep::Done;
        }
        let ctrl_stop = stop.starts_with(b"<|");
        // `<|` in the text only as the start of the stop string
        if self.lt && b == b'|' && !(ctrl_stop && next == 2) {
            return UntilStep::Fail;
        }
        if ctrl_stop && m >= 2 && next != m + 1 {
            return UntilStep::Fail;
        }
        self.lt = b == b'<';
        self.matched = next as u16;
        UntilStep::More
    }
}

// ---- the matcher ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sub {
    Lit(u32),
    Ws(u8),
    Json(JsonState),
    Until(UntilState),
    Char(CharState),
}

/// A character being read: its code point so far and the UTF-8 still expected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct CharState {
    cp: u32,
    utf8: Utf8,
}

impl CharState {
    /// Feeds one byte: `None` if invalid UTF-8, `Some(Some(cp))` when the character is whole.
    fn step(&mut self, b: u8) -> Option<Option<u32>> {
        if !self.utf8.is_open() && b < 0x80 {
            return Some(Some(u32::from(b)));
        }
        let first = !self.utf8.is_open();
        if !self.utf8.step(b) {
            return None;
        }
        self.cp = if first {
            u32::from(b & (0x7f >> b.leading_ones()))
        } else {
            self.cp << 6 | u32::from(b & 0x3f)
        };
        Some((!self.utf8.is_open()).then_some(self.cp))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Thread {
    pc: u32,
    /// The return stack (an id of [`Stacks`]; 0: outside every rule).
    stack: u32,
    sub: Sub,
}

/// Return stacks, hash-consed: node `i` is (return address, parent stack, depth); 0 is empty.
#[derive(Debug)]
struct Stacks {
    nodes: Vec<(u32, u32, u16)>,
    ids: std::collections::HashMap<(u32, u32), u32>,
}

impl Default for Stacks {
    fn default() -> Self {
        Stacks {
            nodes: vec![(0, 0, 0)],
            ids: std::collections::HashMap::new(),
        }
    }
}

impl Stacks {
    /// The stack `parent` with `ret` pushed; `None` past the depth or count bound.
    fn push(&mut self, ret: u32, parent: u32) -> Option<u32> {
        if let Some(&id) = self.ids.get(&(ret, parent)) {
            return Some(id);
        }
        let depth = self.nodes[parent as usize].2 + 1;
        if depth > MAX_CALL_DEPTH || self.nodes.len() >= MAX_STACKS {
            return None;
        }
        let id = self.nodes.len() as u32;
        self.nodes.push((ret, parent, depth));
        self.ids.insert((ret, parent), id);
        Some(id)
    }

    /// (return address, the stack below) of a non-empty stack.
    fn pop(&self, stack: u32) -> Option<(u32, u32)> {
        (stack != 0).then(|| {
            let (ret, parent, _) = self.nodes[stack as usize];
            (ret, parent)
        })
    }
}

/// Scratch space of the closure: per instruction the generation and stack it was last
/// visited with (other stacks at the same instruction in `more`), a work stack, and the
/// matcher's return stacks.
#[derive(Debug, Default)]
struct Closure {
    seen: Vec<(u32, u32)>,
    more: std::collections::HashSet<(u32, u32)>,
    gen: u32,
    work: Vec<(u32, u32)>,
    stacks: Stacks,
}

impl Closure {
    fn begin(&mut self, n: usize) {
        if self.seen.len() != n {
            self.seen = vec![(0, 0); n];
            self.gen = 0;
        }
        self.more.clear();
        self.gen = self.gen.wrapping_add(1);
        if self.gen == 0 {
            self.seen.iter_mut().for_each(|s| *s = (0, 0));
            self.gen = 1;
        }
    }

    /// True the first time (`pc`, `stack`) is visited in this closure.
    fn visit(&mut self, pc: u32, stack: u32) -> bool {
        let seen = &mut self.seen[pc as usize];
        if seen.0 != self.gen {
            *seen = (self.gen, stack);
            return true;
        }
        seen.1 != stack && self.more.insert((pc, stack))
    }
}

/// Adds the threads reachable from `pc` with `stack` without consuming a byte; true if
/// `Match` is reached.
fn add(g: &Grammar, pc: u32, stack: u32, out: &mut Vec<Thread>, cl: &mut Closure) -> bool {
    let mut complete = false;
    cl.work.push((pc, stack));
    while let Some((pc, stack)) = cl.work.pop() {
        let Some(inst) = g.prog.get(pc as usize) else {
            continue;
        };
        if !cl.visit(pc, stack) {
            continue;
        }
        let thread = |sub| Thread { pc, stack, sub };
        match *inst {
            Inst::Split(a, b) => {
                cl.work.push((b, stack));
                cl.work.push((a, stack));
            }
            Inst::Jmp(a) => cl.work.push((a, stack)),
            Inst::Call(entry) => {
                if let Some(inner) = cl.stacks.push(pc + 1, stack) {
                    cl.work.push((entry, inner));
                }
            }
            Inst::Ret => {
                if let Some(back) = cl.stacks.pop(stack) {
                    cl.work.push(back);
                }
            }
            Inst::Match => complete = true,
            Inst::Lit { len: 0, .. } => cl.work.push((pc + 1, stack)),
            Inst::Lit { .. } => out.push(thread(Sub::Lit(0))),
            Inst::Ws => {
                out.push(thread(Sub::Ws(WS_FRESH)));
                cl.work.push((pc + 1, stack));
            }
            Inst::Json(k) => out.push(thread(Sub::Json(JsonState::new(k)))),
            Inst::Until { .. } => out.push(thread(Sub::Until(UntilState::default()))),
            Inst::Class { .. } => out.push(thread(Sub::Char(CharState::default()))),
        }
    }
    complete
}

/// Whether `cp` is in one of `ranges`.
fn in_ranges(ranges: &[(u32, u32)], cp: u32) -> bool {
    ranges.iter().any(|&(lo, hi)| (lo..=hi).contains(&cp))
}

/// Steps every thread over one byte into `out` (cleared first); true if the result is
/// complete.
fn step_all(g: &Grammar, from: &[Thread], b: u8, out: &mut Vec<Thread>, cl: &mut Closure) -> bool {
    out.clear();
    cl.begin(g.prog.len());
    let mut complete = false;
    for t in from {
        let inst = g.prog[t.pc as usize];
        let next = t.pc + 1;
        let stay = |sub| Thread { sub, ..*t };
        match (inst, t.sub) {
            (Inst::Lit { start, len }, Sub::Lit(off)) => {
                if g.pool[(start + off) as usize] != b {
                    continue;
                }
                if off + 1 == len {
                    complete |= add(g, next, t.stack, out, cl);
                } else {
                    out.push(stay(Sub::Lit(off + 1)));
                }
            }
            (Inst::Ws, Sub::Ws(w)) => {
                if let Some(w) = ws_step(w, b) {
                    if ws_more(w) {
                        out.push(stay(Sub::Ws(w)));
                    }
                    complete |= add(g, next, t.stack, out, cl);
                }
            }
            (Inst::Json(_), Sub::Json(mut j)) => {
                if !j.step(b) {
                    continue;
                }
                if j.is_done() {
                    complete |= add(g, next, t.stack, out, cl);
                } else {
                    out.push(stay(Sub::Json(j)));
                    if j.can_end() {
                        complete |= add(g, next, t.stack, out, cl);
                    }
                }
            }
            (
                Inst::Class {
                    start,
                    len,
                    negated,
                },
                Sub::Char(mut c),
            ) => match c.step(b) {
                None => {}
                Some(None) => out.push(stay(Sub::Char(c))),
                Some(Some(cp)) => {
                    let ranges = &g.ranges[start as usize..(start + len) as usize];
                    if in_ranges(ranges, cp) != negated {
                        complete |= add(g, next, t.stack, out, cl);
                    }
                }
            },
            (
                Inst::Until {
                    start,
                    len,
                    max_len,
                },
                Sub::Until(mut u),
            ) => {
                let stop = &g.pool[start as usize..(start + len) as usize];
                match u.step(stop, max_len, b) {
                    UntilStep::Fail => {}
                    UntilStep::More => out.push(stay(Sub::Until(u))),
                    UntilStep::Done => complete |= add(g, next, t.stack, out, cl),
                }
            }
            _ => {}
        }
    }
    // duplicates (alternatives that met again) and the bound
    let mut i = 0;
    while i < out.len() {
        if out[..i].contains(&out[i]) {
            out.swap_remove(i);
        } else {
            i += 1;
        }
    }
    out.truncate(MAX_THREADS);
    complete
}

/// The state of one constrained generation.
#[derive(Debug)]
pub struct Matcher {
    grammar: Arc<Grammar>,
    threads: Vec<Thread>,
    complete: bool,
    cl: Closure,
    a: Vec<Thread>,
    b: Vec<Thread>,
    /// Per depth of the vocabulary walk, the threads after that many bytes.
    levels: Vec<Vec<Thread>>,
    /// Recent masks by state: inside a long string the state repeats token after token.
    masks: Vec<CachedMask>,
    next_slot: usize,
}

/// How many masks a matcher remembers.
const MASK_CACHE: usize = 4;

#[derive(Debug)]
struct CachedMask {
    threads: Vec<Thread>,
    complete: bool,
    mask: Vec<bool>,
    n: usize,
}

impl Matcher {
    pub fn new(grammar: Arc<Grammar>) -> Self {
        let mut cl = Closure::default();
        cl.begin(grammar.prog.len());
        let mut threads = Vec::new();
        let complete = add(&grammar, 0, 0, &mut threads, &mut cl);
        Matcher {
            grammar,
            threads,
            complete,
            cl,
            a: Vec::new(),
            b: Vec::new(),
            levels: Vec::new(),
            masks: Vec::new(),
            next_slot: 0,
        }
    }

    /// The output so far is a whole sentence of the grammar (end of generation allowed).
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// No byte can follow (only the end is allowed, if complete).
    pub fn is_closed(&self) -> bool {
        self.threads.is_empty()
    }

    /// Whether `bytes` (non-empty) can follow the output so far.
    pub fn allows(&mut self, bytes: &[u8]) -> bool {
        if bytes.is_empty() {
            return false;
        }
        self.a.clear();
        self.a.extend_from_slice(&self.threads);
        for &byte in bytes {
            let complete = step_all(&self.grammar, &self.a, byte, &mut self.b, &mut self.cl);
            if self.b.is_empty() && !complete {
                return false;
            }
            std::mem::swap(&mut self.a, &mut self.b);
        }
        true
    }

    /// Appends `bytes` to the output; false (and nothing changes) if they cannot follow.
    pub fn advance(&mut self, bytes: &[u8]) -> bool {
        self.a.clear();
        self.a.extend_from_slice(&self.threads);
        let mut complete = self.complete;
        for &byte in bytes {
            complete = step_all(&self.grammar, &self.a, byte, &mut self.b, &mut self.cl);
            if self.b.is_empty() && !complete {
                return false;
            }
            std::mem::swap(&mut self.a, &mut self.b);
        }
        std::mem::swap(&mut self.threads, &mut self.a);
        self.complete = complete;
        true
    }

    /// Whether token `id` may come next.
    pub fn allows_token(&mut self, vocab: &Vocab, id: u32) -> bool {
        if vocab.is_eog(id) {
            return self.complete;
        }
        match vocab.piece(id) {
            Some(p) if !p.is_empty() => self.allows(p),
            _ => false,
        }
    }

    /// Records token `id`. An end-of-generation token completes; a token the grammar refuses
    /// closes the matcher (only the end is allowed afterwards) and returns false.
    pub fn accept_token(&mut self, vocab: &Vocab, id: u32) -> bool {
        if vocab.is_eog(id) {
            let ok = self.complete;
            self.close();
            return ok;
        }
        let ok = vocab
            .piece(id)
            .is_some_and(|p| !p.is_empty() && self.advance(p));
        if !ok {
            self.close();
        }
        ok
    }

    fn close(&mut self) {
        self.threads.clear();
        self.complete = true;
    }

    /// Sets `mask[id]` for every token that may come next (`mask` is resized to the
    /// vocabulary). Returns how many are allowed.
    pub fn fill_mask(&mut self, vocab: &Vocab, mask: &mut Vec<bool>) -> usize {
        if let Some(c) = self.masks.iter().find(|c| {
            c.complete == self.complete && c.threads == self.threads && c.mask.len() == vocab.len()
        }) {
            mask.clone_from(&c.mask);
            return c.n;
        }
        let n = self.compute_mask(vocab, mask);
        let entry = CachedMask {
            threads: self.threads.clone(),
            complete: self.complete,
            mask: mask.clone(),
            n,
        };
        if self.masks.len() < MASK_CACHE {
            self.masks.push(entry);
        } else {
            self.masks[self.next_slot] = entry;
            self.next_slot = (self.next_slot + 1) % MASK_CACHE;
        }
        n
    }

    fn compute_mask(&mut self, vocab: &Vocab, mask: &mut Vec<bool>) -> usize {
        mask.clear();
        mask.resize(vocab.len(), false);
        let mut n = 0;
        if self.complete {
            for &id in &vocab.eog {
                mask[id as usize] = true;
                n += 1;
            }
        }
        if self.threads.is_empty() {
            return n;
        }
        let g = self.grammar.clone();
        if self.levels.is_empty() {
            self.levels.push(Vec::new());
        }
        self.levels[0].clear();
        self.levels[0].extend_from_slice(&self.threads);
        // `depth`: levels 1..=depth hold the threads after prev[..k]; `dead`: prev[..depth+1]
        // leads nowhere.
        let mut prev: &[u8] = &[];
        let mut prev_ok = false;
        let mut depth = 0usize;
        let mut dead = false;
        let sorted = &vocab.sorted;
        let mut i = 0;
        while i < sorted.len() {
            let id = sorted[i];
            i += 1;
            let p = vocab.piece_unchecked(id);
            if p == prev {
                // the same text as the previous token: the same answer
                if prev_ok {
                    mask[id as usize] = true;
                    n += 1;
                }
                continue;
            }
            let lcp = prev.iter().zip(p).take_while(|(a, b)| a == b).count();
            if dead && lcp > depth {
                continue;
            }
            let mut d = lcp.min(depth);
            dead = false;
            let mut ok = true;
            while d < p.len() {
                // inside a JSON string, plain ASCII leaves the state as it is
                if p.len() - d <= vocab.plain_tail[id as usize] as usize
                    && in_plain_string(&self.levels[d])
                {
                    break;
                }
                if self.levels.len() <= d + 1 {
                    self.levels.push(Vec::new());
                }
                let (lo, hi) = self.levels.split_at_mut(d + 1);
                let complete = step_all(&g, &lo[d], p[d], &mut hi[0], &mut self.cl);
                if hi[0].is_empty() {
                    // nothing extends p[..=d]; p itself may still end the grammar
                    ok = complete && d + 1 == p.len();
                    dead = true;
                    break;
                }
                d += 1;
            }
            // levels deeper than `d` were not computed when the shortcut was taken
            depth = d;
            prev = p;
            prev_ok = ok;
            if ok {
                mask[id as usize] = true;
                n += 1;
            }
            if dead {
                // the tokens with the same text get the same answer; every other token that
                // starts with the dead prefix is refused: jump past them (they are adjacent)
                while i < sorted.len() && vocab.piece_unchecked(sorted[i]) == p {
                    if ok {
                        mask[sorted[i] as usize] = true;
                        n += 1;
                    }
                    i += 1;
                }
                let q = &p[..=depth];
                i += sorted[i..].partition_point(|&t| vocab.piece_unchecked(t).starts_with(q));
            }
        }
        n
    }
}

/// One thread, reading the inside of a JSON string between characters.
fn in_plain_string(threads: &[Thread]) -> bool {
    matches!(threads, [Thread { sub: Sub::Json(j), .. }] if j.in_plain_string())
}

// ---- the vocabulary ------------------------------------------------------------------------

/// Every token's bytes, its end-of-generation flag, and the ids of the tokens with text
/// sorted by their bytes (for the mask walk).
#[derive(Debug)]
pub struct Vocab {
    offsets: Vec<u32>,
    bytes: Vec<u8>,
    eog_flag: Vec<bool>,
    eog: Vec<u32>,
    sorted: Vec<u32>,
    /// Per token, how many of its last bytes are printable ASCII other than `"` and `\\`
    /// (bytes a JSON string takes without changing state), capped at 255.
    plain_tail: Vec<u8>,
}

/// A byte a JSON string holds as itself.
fn plain_string_byte(b: u8) -> bool {
    (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\'
}

impl Vocab {
    /// `pieces[id]` is the text of token `id` as the output shows it (empty: never allowed,
    /// unless end-of-generation).
    pub fn new(pieces: &[&[u8]], is_eog: impl Fn(u32) -> bool) -> Self {
        let mut offsets = Vec::with_capacity(pieces.len() + 1);
        let mut bytes = Vec::new();
        offsets.push(0);
        for p in pieces {
            bytes.extend_from_slice(p);
            offsets.push(bytes.len() as u32);
        }
        let n = pieces.len() as u32;
        let eog_flag: Vec<bool> = (0..n).map(&is_eog).collect();
        let eog = (0..n).filter(|&i| eog_flag[i as usize]).collect();
        let mut sorted: Vec<u32> = (0..n)
            .filter(|&i| !eog_flag[i as usize] && !pieces[i as usize].is_empty())
            .collect();
        sorted.sort_by(|&a, &b| pieces[a as usize].cmp(pieces[b as usize]).then(a.cmp(&b)));
        let plain_tail = pieces
            .iter()
            .map(|p| {
                p.iter()
                    .rev()
                    .take_while(|&&b| plain_string_byte(b))
                    .count()
                    .min(255) as u8
            })
            .collect();
        Vocab {
            offsets,
            bytes,
            eog_flag,
            eog,
            sorted,
            plain_tail,
        }
    }

    /// The pieces a stream with `special` rendering shows (control tokens are empty without
    /// it, so they are never allowed).
    pub fn from_tokenizer(tok: &Tokenizer, special: bool) -> Self {
        let n = tok.n_vocab() as u32;
        let pieces: Vec<&[u8]> = (0..n).map(|i| tok.token_to_piece(i, special)).collect();
        Vocab::new(&pieces, |i| tok.is_eog(i))
    }

    pub fn len(&self) -> usize {
        self.eog_flag.len()
    }

    pub fn is_empty(&self) -> bool {
        self.eog_flag.is_empty()
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog_flag.get(id as usize).copied().unwrap_or(false)
    }

    /// The end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn piece(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        if i + 1 >= self.offsets.len() {
            return None;
        }
        Some(&self.bytes[self.offsets[i] as usize..self.offsets[i + 1] as usize])
    }

    fn piece_unchecked(&self, id: u32) -> &[u8] {
        self.piece(id).unwrap_or_default()
    }
}
