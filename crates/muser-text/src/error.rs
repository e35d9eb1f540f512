//! One error type for the text layer.

/// Why a tokenizer or template could not be built, or a render failed.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A required metadata key is absent.
    #[error("GGUF metadata key `{0}` is missing")]
    MissingKey(String),
    /// A metadata key has a type other than the one llama.cpp reads.
    #[error("GGUF metadata key `{key}` has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer Muser does not implement.
    #[error("unknown tokenizer model `{0}` (Muser knows `gpt2` and `llama`)")]
    UnknownModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer Muser does not implement.
    #[error("unknown pre-tokenizer `{0}` (Muser knows gpt-2, llama-bpe/llama3, smollm, qwen2 and their aliases)")]
    UnknownPreTokenizer(String),
    /// A vocabulary array is inconsistent (length mismatch, empty, too large).
    #[error("invalid vocabulary: {0}")]
    InvalidVocab(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// The GGUF file could not be read.
    #[error(transparent)]
    Gguf(#[from] muser_gguf::Error),
}

pub type Result<T, E = TextError> = std::result::Result<T, E>;
