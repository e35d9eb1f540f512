//! Token ids to text pieces for one stream, never splitting a UTF-8 character.

use muser_text::{StreamDecoder, Tokenizer};

/// Turns sampled ids into text. Without a tokenizer (synthetic models) every piece is empty.
pub(crate) struct Detok<'t>(Option<StreamDecoder<'t>>);

impl<'t> Detok<'t> {
    pub fn new(tok: Option<&'t Tokenizer>, special: bool) -> Self {
        Detok(tok.map(|t| StreamDecoder::new(t, special)))
    }

    /// The complete characters this token finishes.
    pub fn push(&mut self, id: u32) -> String {
        self.0.as_mut().map(|d| d.push(id)).unwrap_or_default()
    }

    /// Whatever is left, an incomplete character written as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.0.as_mut().map(|d| d.finish()).unwrap_or_default()
    }
}
