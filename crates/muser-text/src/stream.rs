//! Incremental detokenization that only ever emits whole UTF-8 characters.

use crate::tokenizer::Tokenizer;

/// Turns a stream of token ids into text. A character whose bytes are split across tokens is
/// held back until it is complete, then emitted once, whole. Bytes that can never become valid
/// UTF-8 are emitted as U+FFFD.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    special: bool,
    utf8: Utf8Buffer,
}

impl<'a> StreamDecoder<'a> {
    /// `special`: render control tokens (as `token_to_piece(id, true)` does).
    pub fn new(tok: &'a Tokenizer, special: bool) -> Self {
        StreamDecoder {
            tok,
            special,
            utf8: Utf8Buffer::default(),
        }
    }

    /// Adds one token; returns the text that became complete.
    pub fn push(&mut self, id: u32) -> String {
        self.utf8.push(self.tok.token_to_piece(id, self.special))
    }

    /// Flushes what is left (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        self.utf8.finish()
    }
}

/// Bytes in, complete UTF-8 text out.
#[derive(Default, Debug, Clone)]
pub struct Utf8Buffer {
    pending: Vec<u8>,
}

impl Utf8Buffer {
    /// Appends bytes and returns the longest complete text now available.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just checked to be valid UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Returns what is left, lossily.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_character_is_emitted_once_whole() {
        let mut b = Utf8Buffer::default();
        let bytes = "a€b".as_bytes();
        assert_eq!(b.push(&bytes[..2]), "a");
        assert_eq!(b.push(&bytes[2..3]), "");
        assert_eq!(b.push(&bytes[3..]), "€b");
        assert_eq!(b.push(&[0xFF, b'x']), "\u{FFFD}x");
        assert_eq!(b.push(&[0xE2, 0x82]), "");
        assert_eq!(b.finish(), "\u{FFFD}");
    }
}
