//! Grammar-constrained sampling on bytes.
//!
//! A [`Grammar`] is a small program compiled from an [`Expr`]: literals, bounded whitespace,
//! JSON values (a pushdown automaton with a bit stack), free text up to a stop string, and
//! choice / repetition. A [`Matcher`] runs it as a set of threads (a Pike VM: every live
//! alternative is one thread, so choices sharing a prefix need no backtracking) and answers
//! one question: does this token's text keep the output a valid prefix? End-of-generation
//! tokens are allowed only once the grammar is complete.
//!
//! The sampler asks about the token it would pick first and masks the vocabulary only when
//! that token is refused. The mask walks the vocabulary in byte order ([`Vocab`] keeps the
//! pieces sorted), so tokens sharing a prefix share the work and a dead prefix skips every
//! token below it, as a trie walk would.
//!
//! JSON follows llama.cpp's `grammars/json.gbnf`: whitespace between tokens is empty, one
//! space, or a newline followed by at most 20 spaces or tabs; an integer part has at most 16
//! digits; strings are valid UTF-8 without control characters or DEL. Escapes of UTF-16
//! surrogates (`\uD800`..`\uDFFF`) are refused so every accepted text parses with strict JSON
//! parsers. Nesting is bounded by [`MAX_DEPTH`].
//!
//! Rules ([`Grammar::compile_rules`], what GBNF compiles to, `gbnf.rs`) are subroutines: a
//! thread inside a rule carries its return stack, hash-consed in the matcher (equal stacks
//! are one id, so threads that met again still compare equal). Left recursion is refused at
//! compile time; stacks deeper than [`MAX_CALL_DEPTH`] or beyond [`MAX_STACKS`] distinct ones
//! are dropped (the language shrinks, never grows).
//!
//! The compiler is `compile.rs` ([`Grammar`]), the VM `vm.rs` ([`Matcher`], [`Vocab`]); JSON's
//! pushdown automaton `json.rs`, rule checks `rules.rs`, GBNF's parser `gbnf.rs`.

use std::sync::Arc;

/// Deepest JSON nesting a grammar accepts.
pub const MAX_DEPTH: u8 = 64;
/// Most instructions in one grammar.
pub const MAX_PROGRAM: usize = 1 << 16;
/// Most live alternatives a matcher keeps (beyond that the rest are dropped: the matcher then
/// accepts a subset of the language, never more).
pub const MAX_THREADS: usize = 64;
/// Deepest rule nesting a thread may reach.
pub const MAX_CALL_DEPTH: u16 = 256;
/// Most distinct return stacks one matcher records.
pub const MAX_STACKS: usize = 1 << 18;
const MAX_INT_DIGITS: u16 = 16;
const MAX_FRAC_DIGITS: u16 = 64;
const MAX_EXP_DIGITS: u16 = 16;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConstraintError {
    #[error("the grammar is too large ({0} instructions, at most {MAX_PROGRAM})")]
    TooLarge(usize),
    #[error("a choice needs at least one alternative")]
    EmptyChoice,
    #[error("a stop string must not be empty")]
    EmptyStop,
    #[error("rule {0} is not defined")]
    UnknownRule(u32),
    #[error("rule {0} is left-recursive (it can reach itself before reading a character)")]
    LeftRecursion(u32),
    #[error("a character range must not run backwards ({0:#x}-{1:#x})")]
    BackwardRange(u32, u32),
}

/// What a JSON value may be at the top of a [`Expr::Json`]; nested values are unrestricted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JsonKind {
    Value,
    Object,
    Array,
    String,
    Number,
    Integer,
}

/// A grammar as built by callers; [`Grammar::compile`] turns it into a program.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// These exact bytes.
    Lit(Vec<u8>),
    /// Optional whitespace: nothing, one space, or a newline and at most 20 spaces or tabs.
    Ws,
    /// One JSON value (its own inner whitespace included, none before or after).
    Json(JsonKind),
    /// Valid UTF-8 text (no control characters but tab, CR and LF) up to and including the
    /// first occurrence of `stop`, at most `max_len` bytes in all. The text never contains
    /// `<|` except as the start of `stop`, so control-token markup cannot appear inside.
    Until {
        stop: Vec<u8>,
        max_len: u32,
    },
    Seq(Vec<Expr>),
    Choice(Vec<Expr>),
    /// Zero or more.
    Star(Box<Expr>),
    Opt(Box<Expr>),
    /// A JSON object with these members, in this order; members not `required` may be left
    /// out. No other member is produced.
    Object(Vec<Member>),
    /// A JSON array whose items all match the expression.
    Array(Box<Expr>),
    /// One character (UTF-8) within one of the inclusive code point ranges, or, `negated`,
    /// within none of them (`negated` with no range: any character).
    Class {
        ranges: Vec<(u32, u32)>,
        negated: bool,
    },
    /// `min` or more copies (at most `max`; `None`: no bound).
    Repeat {
        inner: Box<Expr>,
        min: u32,
        max: Option<u32>,
    },
    /// The rule of this index among [`Grammar::compile_rules`]'s rules.
    Rule(u32),
}

/// One member of an [`Expr::Object`].
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    pub key: String,
    pub value: Expr,
    pub required: bool,
}

impl Expr {
    pub fn lit(s: &str) -> Expr {
        Expr::Lit(s.as_bytes().to_vec())
    }

    /// A JSON string literal holding `s`, escaped.
    pub fn json_string(s: &str) -> Expr {
        Expr::Lit(json_quote(s).into_bytes())
    }
}

/// `s` as a JSON string literal (quotes included).
pub fn json_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    out.push_str(&json_escape(s));
    out.push('"');
    out
}

/// `s` escaped for the inside of a JSON string.
pub fn json_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out
}

// ---- whitespace ----------------------------------------------------------------------------

/// Whitespace state: 0 nothing yet, 1 one space (no more), 2 + k a newline and k spaces/tabs.
const WS_FRESH: u8 = 0;
const WS_SPACE: u8 = 1;
const WS_NL: u8 = 2;
const WS_FULL: u8 = WS_NL + 20;

fn ws_step(w: u8, b: u8) -> Option<u8> {
    match b {
        b' ' if w == WS_FRESH => Some(WS_SPACE),
        b'\n' if w == WS_FRESH => Some(WS_NL),
        b' ' | b'\t' if (WS_NL..WS_FULL).contains(&w) => Some(w + 1),
        _ => None,
    }
}

fn ws_more(w: u8) -> bool {
    w == WS_FRESH || (WS_NL..WS_FULL).contains(&w)
}

mod compile;
pub mod gbnf;
mod json;
mod rules;
mod vm;
pub use compile::Grammar;
pub use json::JsonState;
pub use vm::{Matcher, Vocab};

/// A grammar with the vocabulary it constrains; what [`crate::SamplingParams`] carries.
/// Equality is identity (the same shared grammar and vocabulary).
#[derive(Clone)]
pub struct Constraint {
    pub grammar: Arc<Grammar>,
    pub vocab: Arc<Vocab>,
}

impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.grammar, &other.grammar) && Arc::ptr_eq(&self.vocab, &other.vocab)
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("instructions", &self.grammar.len())
            .field("vocab", &self.vocab.len())
            .finish()
    }
}

#[cfg(test)]
mod tests;
