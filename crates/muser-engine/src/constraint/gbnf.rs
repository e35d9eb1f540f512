//! GBNF, llama.cpp's grammar format, parsed into rules of [`Expr`]s for
//! [`Grammar::compile_rules`], with llama.cpp's syntax (`src/llama-grammar.cpp`):
//!
//! ```text
//! root  ::= item ("," item)*      # a comment
//! item  ::= [a-z]+ | "\"" [^"\n]* "\"" | num{1,3} | .
//! num   ::= [0-9]
//! ```
//!
//! Rules `name ::= alternatives` (names of letters, digits and `-`; one rule per line, a
//! newline allowed inside parentheses and after `|`), sequences, `|`, `( )`, postfix `*`,
//! `+`, `?`, `{m}`, `{m,}`, `{m,n}`, string literals, character classes `[...]` / `[^...]`
//! with ranges, `.` (any character), escapes `\x..`, `\u....`, `\U........`, `\t`, `\r`,
//! `\n`, `\\`, `\"`, `\[`, `\]`, `\-`, and `#` comments. `root` is where the output starts.
//! Token references (`<...>`, `!<...>`) are refused. Every size is bounded: the text, the
//! rules, nesting, repetition counts, and the compiled program (`MAX_PROGRAM`).

use super::{ConstraintError, Expr, Grammar};

/// Longest grammar text, in bytes.
pub const MAX_TEXT: usize = 256 << 10;
/// Most rules one grammar defines or refers to.
pub const MAX_RULES: usize = 4096;
/// Deepest nesting of parentheses.
pub const MAX_NESTING: usize = 32;
/// Largest count in `{m,n}`.
pub const MAX_REPEAT: u32 = 4096;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GbnfError {
    #[error("grammar: {msg} at line {line}, column {column}")]
    Syntax {
        msg: String,
        line: usize,
        column: usize,
    },
    #[error("grammar: the text is {0} bytes, at most {MAX_TEXT}")]
    TooLong(usize),
    #[error("grammar: more than {MAX_RULES} rules")]
    TooManyRules,
    #[error("grammar: rule `{0}` is used but not defined")]
    Undefined(String),
    #[error("grammar: rule `{0}` is defined twice")]
    Duplicate(String),
    #[error("grammar: no `root` rule")]
    NoRoot,
    #[error(
        "grammar: rule `{0}` is left-recursive (it can reach itself before reading a character)"
    )]
    LeftRecursion(String),
    #[error("grammar: {0}")]
    Compile(ConstraintError),
}

/// A parsed grammar: its rules by index, their names, and the index of `root`.
#[derive(Debug, Clone, PartialEq)]
pub struct Gbnf {
    pub rules: Vec<Expr>,
    pub names: Vec<String>,
    pub root: u32,
}

impl Gbnf {
    pub fn parse(src: &str) -> Result<Gbnf, GbnfError> {
        if src.len() > MAX_TEXT {
            return Err(GbnfError::TooLong(src.len()));
        }
        let mut p = Parser {
            text: src,
            src: src.as_bytes(),
            pos: 0,
            names: Vec::new(),
            rules: Vec::new(),
            depth: 0,
        };
        p.pos = p.space(true);
        while p.pos < p.src.len() {
            p.rule()?;
        }
        let rules = p
            .rules
            .into_iter()
            .zip(&p.names)
            .map(|(r, name)| r.ok_or_else(|| GbnfError::Undefined(name.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        let root = p
            .names
            .iter()
            .position(|n| n == "root")
            .ok_or(GbnfError::NoRoot)? as u32;
        Ok(Gbnf {
            rules,
            names: p.names,
            root,
        })
    }

    /// The root rule, as an expression to place in a start expression.
    pub fn root(&self) -> Expr {
        Expr::Rule(self.root)
    }

    /// Compiles `start` (which refers to these rules, [`Gbnf::root`] usually) into a grammar.
    pub fn compile(&self, start: &Expr) -> Result<Grammar, GbnfError> {
        Grammar::compile_rules(start, &self.rules).map_err(|e| match e {
            ConstraintError::LeftRecursion(i) => {
                GbnfError::LeftRecursion(self.names[i as usize].clone())
            }
            e => GbnfError::Compile(e),
        })
    }
}

/// Parses `src` and compiles its `root` as the whole output.
pub fn compile(src: &str) -> Result<Grammar, GbnfError> {
    let g = Gbnf::parse(src)?;
    g.compile(&g.root())
}

struct Parser<'a> {
    text: &'a str,
    src: &'a [u8],
    pos: usize,
    names: Vec<String>,
    /// `None` while only referred to.
    rules: Vec<Option<Expr>>,
    depth: usize,
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-'
}

impl Parser<'_> {
    fn peek(&self, at: usize) -> u8 {
        self.src.get(at).copied().unwrap_or(0)
    }

    fn err<T>(&self, msg: impl Into<String>) -> Result<T, GbnfError> {
        let before = &self.src[..self.pos.min(self.src.len())];
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let start = before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |p| p + 1);
        let column = String::from_utf8_lossy(&before[start..]).chars().count() + 1;
        Err(GbnfError::Syntax {
            msg: msg.into(),
            line,
            column,
        })
    }

    /// The position after spaces, tabs, comments and (`newline`) line ends from `self.pos`.
    fn space(&self, newline: bool) -> usize {
        let mut p = self.pos;
        loop {
            match self.peek(p) {
                b' ' | b'\t' => p += 1,
                b'\r' | b'\n' if newline => p += 1,
                b'#' => {
                    while p < self.src.len() && !matches!(self.src[p], b'\r' | b'\n') {
                        p += 1;
                    }
                }
                _ => return p,
            }
        }
    }

    fn skip(&mut self, newline: bool) {
        self.pos = self.space(newline);
    }

    fn name(&mut self) -> Result<String, GbnfError> {
        let start = self.pos;
        while is_word(self.peek(self.pos)) {
            self.pos += 1;
        }
        if start == self.pos {
            return self.err("expecting a rule name");
        }
        Ok(String::from_utf8_lossy(&self.src[start..self.pos]).into_owned())
    }

    fn symbol(&mut self, name: String) -> Result<u32, GbnfError> {
        if let Some(i) = self.names.iter().position(|n| *n == name) {
            return Ok(i as u32);
        }
        if self.names.len() >= MAX_RULES {
            return Err(GbnfError::TooManyRules);
        }
        self.names.push(name);
        self.rules.push(None);
        Ok(self.names.len() as u32 - 1)
    }

    fn rule(&mut self) -> Result<(), GbnfError> {
        let name = self.name()?;
        self.skip(false);
        if !self.src[self.pos..].starts_with(b"::=") {
            return self.err("expecting ::=");
        }
        self.pos += 3;
        self.skip(true);
        let body = self.alternates(false)?;
        match self.peek(self.pos) {
            b'\r' if self.peek(self.pos + 1) == b'\n' => self.pos += 2,
            b'\r' | b'\n' => self.pos += 1,
            _ if self.pos >= self.src.len() => {}
            _ => return self.err("expecting the end of the line"),
        }
        self.skip(true);
        let i = self.symbol(name)? as usize;
        if self.rules[i].is_some() {
            return Err(GbnfError::Duplicate(self.names[i].clone()));
        }
        self.rules[i] = Some(body);
        Ok(())
    }

    fn alternates(&mut self, nested: bool) -> Result<Expr, GbnfError> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek(self.pos) == b'|' {
            self.pos += 1;
            self.skip(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().expect("one alternative")
        } else {
            Expr::Choice(alts)
        })
    }

    fn sequence(&mut self, nested: bool) -> Result<Expr, GbnfError> {
        let mut items: Vec<Expr> = Vec::new();
        // the last item is a repetition: another would nest without parentheses, unbounded
        let mut repeated = false;
        while self.pos < self.src.len() {
            let c = self.peek(self.pos);
            let repetition = matches!(c, b'*' | b'+' | b'?' | b'{');
            if repetition && repeated {
                return self.err("a repetition of a repetition: group it in parentheses");
            }
            repeated = repetition;
            let item = match c {
                b'"' => {
                    self.pos += 1;
                    let mut s = String::new();
                    while self.peek(self.pos) != b'"' {
                        if self.pos >= self.src.len() {
                            return self.err("unterminated string literal");
                        }
                        s.push(self.char()?);
                    }
                    self.pos += 1;
                    Expr::Lit(s.into_bytes())
                }
                b'[' => self.class()?,
                b'.' => {
                    self.pos += 1;
                    Expr::Class {
                        ranges: Vec::new(),
                        negated: true,
                    }
                }
                b'(' => {
                    if self.depth >= MAX_NESTING {
                        return self.err(format!("parentheses nested deeper than {MAX_NESTING}"));
                    }
                    self.pos += 1;
                    self.skip(true);
                    self.depth += 1;
                    let inner = self.alternates(true)?;
                    self.depth -= 1;
                    if self.peek(self.pos) != b')' {
                        return self.err("expecting ')'");
                    }
                    self.pos += 1;
                    inner
                }
                b'<' | b'!' => return self.err("token references are not supported"),
                b'*' | b'+' | b'?' | b'{' => {
                    let Some(last) = items.pop() else {
                        return self.err(format!("`{}` follows nothing", c as char));
                    };
                    let (min, max) = self.repetition()?;
                    Expr::Repeat {
                        inner: Box::new(last),
                        min,
                        max,
                    }
                }
                c if is_word(c) => {
                    let name = self.name()?;
                    Expr::Rule(self.symbol(name)?)
                }
                _ => break,
            };
            items.push(item);
            self.skip(nested);
        }
        Ok(if items.len() == 1 {
            items.pop().expect("one item")
        } else {
            Expr::Seq(items)
        })
    }

    /// `*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}` at `self.pos`.
    fn repetition(&mut self) -> Result<(u32, Option<u32>), GbnfError> {
        let c = self.peek(self.pos);
        self.pos += 1;
        match c {
            b'*' => return Ok((0, None)),
            b'+' => return Ok((1, None)),
            b'?' => return Ok((0, Some(1))),
            _ => {}
        }
        self.skip(false);
        let min = self.count()?;
        self.skip(false);
        let max = match self.peek(self.pos) {
            b'}' => Some(min),
            b',' => {
                self.pos += 1;
                self.skip(false);
                let max = if self.peek(self.pos).is_ascii_digit() {
                    Some(self.count()?)
                } else {
                    None
                };
                self.skip(false);
                if self.peek(self.pos) != b'}' {
                    return self.err("expecting '}'");
                }
                max
            }
            _ => return self.err("expecting ',' or '}'"),
        };
        self.pos += 1;
        if max.is_some_and(|m| m < min) {
            return self.err(format!(
                "repetition {{{min},{}}} runs backwards",
                max.unwrap_or(0)
            ));
        }
        Ok((min, max))
    }

    fn count(&mut self) -> Result<u32, GbnfError> {
        let start = self.pos;
        while self.peek(self.pos).is_ascii_digit() {
            self.pos += 1;
        }
        if start == self.pos {
            return self.err("expecting a number");
        }
        let digits = std::str::from_utf8(&self.src[start..self.pos]).unwrap_or("");
        match digits.parse::<u32>() {
            Ok(n) if n <= MAX_REPEAT => Ok(n),
            _ => self.err(format!("a repetition count is at most {MAX_REPEAT}")),
        }
    }

    fn class(&mut self) -> Result<Expr, GbnfError> {
        self.pos += 1;
        let negated = self.peek(self.pos) == b'^';
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        while self.peek(self.pos) != b']' {
            if self.pos >= self.src.len() {
                return self.err("unterminated character class");
            }
            let lo = u32::from(self.char()?);
            let mut hi = lo;
            if self.peek(self.pos) == b'-' && self.peek(self.pos + 1) != b']' {
                self.pos += 1;
                if self.pos >= self.src.len() {
                    return self.err("unterminated character class");
                }
                hi = u32::from(self.char()?);
                if hi < lo {
                    return self.err("a character range runs backwards");
                }
            }
            ranges.push((lo, hi));
        }
        self.pos += 1;
        Ok(Expr::Class { ranges, negated })
    }

    /// One character of a literal or class, escapes decoded.
    fn char(&mut self) -> Result<char, GbnfError> {
        let c = self.peek(self.pos);
        if c != b'\\' {
            let Some(ch) = self.text.get(self.pos..).and_then(|r| r.chars().next()) else {
                return self.err("expecting a character");
            };
            self.pos += ch.len_utf8();
            return Ok(ch);
        }
        let e = self.peek(self.pos + 1);
        self.pos += 2;
        let hex = match e {
            b'x' => 2,
            b'u' => 4,
            b'U' => 8,
            b't' => return Ok('\t'),
            b'r' => return Ok('\r'),
            b'n' => return Ok('\n'),
            b'\\' | b'"' | b'[' | b']' | b'-' => return Ok(e as char),
            _ => {
                self.pos -= 2;
                return self.err("unknown escape");
            }
        };
        let digits = self.src.get(self.pos..self.pos + hex).unwrap_or_default();
        let value = std::str::from_utf8(digits)
            .ok()
            .filter(|d| d.len() == hex && d.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|d| u32::from_str_radix(d, 16).ok());
        let Some(value) = value else {
            return self.err(format!("expecting {hex} hex digits"));
        };
        let Some(ch) = char::from_u32(value) else {
            return self.err(format!("{value:#x} is not a character"));
        };
        self.pos += hex;
        Ok(ch)
    }
}

#[cfg(test)]
mod tests;
