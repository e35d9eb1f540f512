//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong loading a model or running a batch.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read model file {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: muser_gguf::Error,
    },
    #[error("bad model metadata: {0}")]
    Gguf(#[from] muser_gguf::Error),
    #[error("unsupported architecture {0:?} (muser runs muse-glimmer and llama)")]
    UnsupportedArch(String),
    #[error("bad model: {0}")]
    BadModel(String),
    #[error("tensor {name} is missing")]
    MissingTensor { name: String },
    #[error("tensor {name} has shape {got:?}, expected {want:?}")]
    TensorShape {
        name: String,
        got: Vec<u64>,
        want: Vec<u64>,
    },
    #[error("tensor {name} has type {ty}, which the backend cannot multiply")]
    UnsupportedType { name: String, ty: &'static str },
    #[error("bad batch: {0}")]
    BadBatch(String),
    #[error("KV cache: {0}")]
    Kv(String),
    #[error("KV cache is full for sequence {seq}: no free cell for {n_tokens} more tokens")]
    KvFull { seq: u32, n_tokens: usize },
    #[error("quantization kernel: {0}")]
    Quant(String),
    #[error("device backend: {0}")]
    Device(String),
    #[error("{0}")]
    Numerics(String),
}
