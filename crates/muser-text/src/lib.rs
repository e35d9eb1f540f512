//! The text layer of Muser: text to the exact token ids llama.cpp b11434 produces for the same
//! GGUF and back, chat templates rendered as llama-server renders them, and the Muse Glimmer
//! output parser that splits generated text into reasoning, content and tool calls.
//!
//! - [`Tokenizer`]: built from `tokenizer.ggml.*` metadata; BPE with llama.cpp's pre-tokenizers
//!   (`gpt-2`, `llama-bpe`, `smollm`, `qwen2`, ...) or SentencePiece-style (`llama`).
//! - [`StreamDecoder`]: token ids to text that never splits a UTF-8 character.
//! - [`ChatTemplate`]: a GGUF's `tokenizer.chat_template` rendered with minijinja.
//! - [`muse`]: Muse Glimmer's special tokens, template and output parser.

mod bpe;
mod error;
mod meta;
pub mod muse;
mod pretok;
mod spm;
mod stream;
mod template;
mod tokenizer;
mod unicode;
mod unicode_tables;

pub use error::{Result, TextError};
pub use pretok::PreTokenizer;
pub use stream::{StreamDecoder, Utf8Buffer};
pub use template::{
    builtin_template, unix_from_date, ChatRequest, ChatTemplate, BUILTIN_TEMPLATES, CHATML_TEMPLATE,
};
pub use tokenizer::{attr, Fim, Tokenizer, TokenizerKind};
