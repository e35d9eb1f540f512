//! JSON values and UTF-8, byte by byte: the automata the matcher runs for `Expr::Json`.

use super::*;

// ---- UTF-8 ---------------------------------------------------------------------------------

/// Continuation bytes still expected and the range the next one must fall in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Utf8 {
    need: u8,
    lo: u8,
    hi: u8,
}

impl Utf8 {
    /// A character is open: continuation bytes are still expected.
    pub(super) fn is_open(&self) -> bool {
        self.need > 0
    }

    /// Feeds a byte >= 0x80 (or any byte while a character is open). False if invalid.
    pub(super) fn step(&mut self, b: u8) -> bool {
        if self.need > 0 {
            if b < self.lo || b > self.hi {
                return false;
            }
            self.need -= 1;
            // a finished character leaves the state as it started (equal states compare equal)
            *self = if self.need == 0 {
                Utf8::default()
            } else {
                Utf8 {
                    need: self.need,
                    lo: 0x80,
                    hi: 0xbf,
                }
            };
            return true;
        }
        let (need, lo, hi) = match b {
            0xc2..=0xdf => (1, 0x80, 0xbf),
            0xe0 => (2, 0xa0, 0xbf),
            0xe1..=0xec | 0xee..=0xef => (2, 0x80, 0xbf),
            0xed => (2, 0x80, 0x9f),
            0xf0 => (3, 0x90, 0xbf),
            0xf1..=0xf3 => (3, 0x80, 0xbf),
            0xf4 => (3, 0x80, 0x8f),
            _ => return false,
        };
        *self = Utf8 { need, lo, hi };
        true
    }
}

// ---- JSON ----------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Expecting a value.
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value inside a container: `,` or the closer.
    After,
    Str,
    Esc,
    /// After `\u` and this many hex digits.
    Hex(u8),
    Utf8,
    NumMinus,
    NumZero,
    NumInt,
    NumDot,
    NumFrac,
    NumE,
    NumESign,
    NumExp,
    /// Inside `true`, `false` or `null`.
    Word,
    Done,
}

pub(super) const WORDS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// A JSON value being read. `Copy`, 24 bytes: the container stack is a bit per level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JsonState {
    /// Bit `d` set: the container at depth `d + 1` is an object (else an array).
    stack: u64,
    depth: u8,
    mode: Mode,
    ws: u8,
    top: JsonKind,
    /// The string being read is an object key.
    key: bool,
    /// Digits in the current number part, or bytes of the current word.
    n: u16,
    /// Which word, or (in `Hex`) whether the first hex digit was `d`.
    word: u8,
    utf8: Utf8,
}

impl JsonState {
    /// Inside a string, between characters: where any plain string byte may follow.
    pub(super) fn in_plain_string(&self) -> bool {
        self.mode == Mode::Str && !self.utf8.is_open()
    }

    pub fn new(top: JsonKind) -> Self {
        JsonState {
            stack: 0,
            depth: 0,
            mode: Mode::Value,
            // no whitespace before the value: the grammar places it
            ws: WS_SPACE,
            top,
            key: false,
            n: 0,
            word: 0,
            utf8: Utf8::default(),
        }
    }

    pub fn is_done(&self) -> bool {
        self.mode == Mode::Done
    }

    /// A top-level number may end here (the next byte belongs to what follows).
    pub fn can_end(&self) -> bool {
        self.depth == 0
            && matches!(
                self.mode,
                Mode::NumZero | Mode::NumInt | Mode::NumFrac | Mode::NumExp
            )
    }

    pub(super) fn in_object(&self) -> bool {
        self.depth > 0 && self.stack >> (self.depth - 1) & 1 == 1
    }

    pub(super) fn enter(&mut self, mode: Mode) {
        self.mode = mode;
        self.ws = WS_FRESH;
    }

    pub(super) fn end_value(&mut self) {
        if self.depth == 0 {
            self.mode = Mode::Done;
        } else {
            self.enter(Mode::After);
        }
    }

    pub(super) fn push(&mut self, object: bool) -> bool {
        if self.depth >= MAX_DEPTH {
            return false;
        }
        if object {
            self.stack |= 1 << self.depth;
        } else {
            self.stack &= !(1 << self.depth);
        }
        self.depth += 1;
        true
    }

    pub(super) fn value_start(&mut self, b: u8) -> bool {
        if self.depth == 0 {
            let ok = match self.top {
                JsonKind::Value => true,
                JsonKind::Object => b == b'{',
                JsonKind::Array => b == b'[',
                JsonKind::String => b == b'"',
                JsonKind::Number | JsonKind::Integer => b == b'-' || b.is_ascii_digit(),
            };
            if !ok {
                return false;
            }
        }
        match b {
            b'{' => {
                if !self.push(true) {
                    return false;
                }
                self.enter(Mode::KeyOrClose);
            }
            b'[' => {
                if !self.push(false) {
                    return false;
                }
                self.enter(Mode::ValueOrClose);
            }
            b'"' => {
                self.key = false;
                self.mode = Mode::Str;
            }
            b'-' => self.mode = Mode::NumMinus,
            b'0' => self.mode = Mode::NumZero,
            b'1'..=b'9' => {
                self.mode = Mode::NumInt;
                self.n = 1;
            }
            b't' | b'f' | b'n' => {
                self.mode = Mode::Word;
                self.word = match b {
                    b't' => 0,
                    b'f' => 1,
                    _ => 2,
                };
                self.n = 1;
            }
            _ => return false,
        }
        true
    }

    pub(super) fn no_fraction(&self) -> bool {
        self.depth == 0 && self.top == JsonKind::Integer
    }

    /// A byte that does not continue the number: ends it inside a container.
    pub(super) fn end_number(&mut self, b: u8) -> bool {
        if self.depth == 0 {
            return false;
        }
        self.end_value();
        self.step(b)
    }

    /// Feeds one byte; false if it cannot continue a valid value (the state is then
    /// unspecified).
    pub fn step(&mut self, b: u8) -> bool {
        match self.mode {
            Mode::Value | Mode::ValueOrClose | Mode::KeyOrClose | Mode::Key | Mode::Colon
                if matches!(b, b' ' | b'\t' | b'\n') =>
            {
                match ws_step(self.ws, b) {
                    Some(w) => {
                        self.ws = w;
                        true
                    }
                    None => false,
                }
            }
            Mode::After if matches!(b, b' ' | b'\t' | b'\n') => match ws_step(self.ws, b) {
                Some(w) => {
                    self.ws = w;
                    true
                }
                None => false,
            },
            Mode::Value => self.value_start(b),
            Mode::ValueOrClose => {
                if b == b']' {
                    self.depth -= 1;
                    self.end_value();
                    true
                } else {
                    self.value_start(b)
                }
            }
            Mode::KeyOrClose | Mode::Key => match b {
                b'"' => {
                    self.key = true;
                    self.mode = Mode::Str;
                    true
                }
                b'}' if self.mode == Mode::KeyOrClose => {
                    self.depth -= 1;
                    self.end_value();
                    true
                }
                _ => false,
            },
            Mode::Colon => {
                if b == b':' {
                    self.enter(Mode::Value);
                    true
                } else {
                    false
                }
            }
            Mode::After => match b {
                b',' => {
                    let next = if self.in_object() {
                        Mode::Key
                    } else {
                        Mode::Value
                    };
                    self.enter(next);
                    true
                }
                b'}' if self.in_object() => {
                    self.depth -= 1;
                    self.end_value();
                    true
                }
                b']' if !self.in_object() => {
                    self.depth -= 1;
                    self.end_value();
                    true
                }
                _ => false,
            },
            Mode::Str => match b {
                b'"' => {
                    if self.key {
                        self.enter(Mode::Colon);
                    } else {
                        self.end_value();
                    }
                    true
                }
                b'\\' => {
                    self.mode = Mode::Esc;
                    true
                }
                0..=0x1f | 0x7f => false,
                0x20..=0x7e => true,
                _ => {
                    if !self.utf8.step(b) {
                        return false;
                    }
                    self.mode = Mode::Utf8;
                    true
                }
            },
            Mode::Utf8 => {
                if !self.utf8.step(b) {
                    return false;
                }
                if self.utf8.need == 0 {
                    self.mode = Mode::Str;
                }
                true
            }
            Mode::Esc => match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                    self.mode = Mode::Str;
                    true
                }
                b'u' => {
                    self.mode = Mode::Hex(0);
                    true
                }
                _ => false,
            },
            Mode::Hex(k) => {
                if !b.is_ascii_hexdigit() {
                    return false;
                }
                match k {
                    0 => self.word = u8::from(b == b'd' || b == b'D'),
                    // \uD800..\uDFFF: a lone surrogate half, refused
                    1 if self.word == 1 && matches!(b, b'8'..=b'9' | b'a'..=b'f' | b'A'..=b'F') => {
                        return false
                    }
                    _ => {}
                }
                self.mode = if k == 3 { Mode::Str } else { Mode::Hex(k + 1) };
                true
            }
            Mode::NumMinus => match b {
                b'0' => {
                    self.mode = Mode::NumZero;
                    true
                }
                b'1'..=b'9' => {
                    self.mode = Mode::NumInt;
                    self.n = 1;
                    true
                }
                _ => false,
            },
            Mode::NumZero | Mode::NumInt => match b {
                b'0'..=b'9' if self.mode == Mode::NumInt && self.n < MAX_INT_DIGITS => {
                    self.n += 1;
                    true
                }
                b'.' if !self.no_fraction() => {
                    self.mode = Mode::NumDot;
                    true
                }
                b'e' | b'E' if !self.no_fraction() => {
                    self.mode = Mode::NumE;
                    true
                }
                b'0'..=b'9' | b'.' | b'e' | b'E' => false,
                _ => self.end_number(b),
            },
            Mode::NumDot => {
                if b.is_ascii_digit() {
                    self.mode = Mode::NumFrac;
                    self.n = 1;
                    true
                } else {
                    false
                }
            }
            Mode::NumFrac => match b {
                b'0'..=b'9' if self.n < MAX_FRAC_DIGITS => {
                    self.n += 1;
                    true
                }
                b'e' | b'E' => {
                    self.mode = Mode::NumE;
                    true
                }
                b'0'..=b'9' | b'.' => false,
                _ => self.end_number(b),
            },
            Mode::NumE => match b {
                b'+' | b'-' => {
                    self.mode = Mode::NumESign;
                    true
                }
                b'0'..=b'9' => {
                    self.mode = Mode::NumExp;
                    self.n = 1;
                    true
                }
                _ => false,
            },
            Mode::NumESign => {
                if b.is_ascii_digit() {
                    self.mode = Mode::NumExp;
                    self.n = 1;
                    true
                } else {
                    false
                }
            }
            Mode::NumExp => match b {
                b'0'..=b'9' if self.n < MAX_EXP_DIGITS => {
                    self.n += 1;
                    true
                }
                b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-' => false,
                _ => self.end_number(b),
            },
            Mode::Word => {
                let w = WORDS[self.word as usize];
                if w.get(self.n as usize) != Some(&b) {
                    return false;
                }
                self.n += 1;
                if self.n as usize == w.len() {
                    self.end_value();
                }
                true
            }
            Mode::Done => false,
        }
    }
}
