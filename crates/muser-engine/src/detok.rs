//! Token ids to text pieces for one stream, never splitting a UTF-8 character.

use muser_text::Tokenizer;

/// Turns sampled ids into text. Without a tokenizer (synthetic models) every piece is empty.
pub(crate) struct Detok<'t> {
    tok: Option<&'t Tokenizer>,
    special: bool,
    pending: Vec<u8>,
}

impl<'t> Detok<'t> {
    pub fn new(tok: Option<&'t Tokenizer>, special: bool) -> Self {
        Detok {
            tok,
            special,
            pending: Vec::new(),
        }
    }

    /// The complete characters this token finishes.
    pub fn push(&mut self, id: u32) -> String {
        let Some(tok) = self.tok else {
            return String::new();
        };
        self.pending
            .extend_from_slice(tok.token_to_piece(id, self.special));
        take_complete(&mut self.pending)
    }

    /// Whatever is left, an incomplete character written as U+FFFD.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Removes and returns the longest prefix of `buf` that does not end inside a character that
/// may still be completed; invalid bytes become U+FFFD.
fn take_complete(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
                break;
            }
            Err(e) => {
                let valid = start + e.valid_up_to();
                out.push_str(std::str::from_utf8(&buf[start..valid]).unwrap_or_default());
                match e.error_len() {
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        start = valid + n;
                    }
                    None => {
                        start = valid;
                        break;
                    }
                }
            }
        }
    }
    buf.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_characters_wait_for_their_last_byte() {
        let mut buf = "hé".as_bytes()[..2].to_vec(); // 'h' and the first byte of 'é'
        assert_eq!(take_complete(&mut buf), "h");
        assert_eq!(buf.len(), 1);
        buf.push("é".as_bytes()[1]);
        assert_eq!(take_complete(&mut buf), "é");
        assert!(buf.is_empty());
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut buf = vec![b'a', 0xff, b'b'];
        assert_eq!(take_complete(&mut buf), "a\u{fffd}b");
        assert!(buf.is_empty());
    }
}
