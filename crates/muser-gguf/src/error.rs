//! The one error type of this crate. Every way a file can be malformed is its own variant, so
//! callers and tests can tell them apart; messages name what was being read and where.

use std::path::PathBuf;

/// A GGUF read, write or metadata-access error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("write failed: {0}")]
    Write(#[from] std::io::Error),

    // ---- header
    #[error("file truncated: {what} at byte {offset} needs {need} bytes, file has {file_len}")]
    Truncated {
        what: &'static str,
        offset: u64,
        need: u64,
        file_len: u64,
    },
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {version} (supported: 2 and 3)")]
    UnsupportedVersion { version: u32 },
    #[error("header claims {count} tensors; the file has room for at most {max}")]
    TooManyTensors { count: u64, max: u64 },
    #[error("header claims {count} metadata entries; the file has room for at most {max}")]
    TooManyKeys { count: u64, max: u64 },

    // ---- metadata
    #[error("string at byte {offset} claims {len} bytes, only {remaining} remain in the file")]
    StringPastEnd {
        offset: u64,
        len: u64,
        remaining: u64,
    },
    #[error("string at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: u64 },
    #[error("metadata key #{index} is empty")]
    EmptyKey { index: u64 },
    #[error("duplicate metadata key '{key}'")]
    DuplicateKey { key: String },
    #[error("metadata key '{key}' has unknown value type {type_id}")]
    UnknownValueType { key: String, type_id: u32 },
    #[error("metadata key '{key}': array of {len} {elem} elements cannot fit in the {remaining} bytes left")]
    ArrayTooLong {
        key: String,
        elem: &'static str,
        len: u64,
        remaining: u64,
    },
    #[error("metadata key '{key}': arrays nested deeper than {max}")]
    NestingTooDeep { key: String, max: usize },
    #[error("general.alignment = {value} is not a non-zero power of two")]
    BadAlignment { value: u64 },

    // ---- tensor infos
    #[error("duplicate tensor name '{name}'")]
    DuplicateTensor { name: String },
    #[error("tensor '{tensor}' has {n_dims} dimensions (at most 4)")]
    TooManyDims { tensor: String, n_dims: u32 },
    #[error("tensor '{tensor}' dims {dims:?} overflow the element count")]
    DimsOverflow { tensor: String, dims: Vec<u64> },
    #[error("tensor '{tensor}' has unknown ggml type id {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },
    #[error("tensor '{tensor}' of type {ty}: row of {ne0} values is not a multiple of the block size {block}")]
    PartialBlock {
        tensor: String,
        ty: &'static str,
        ne0: u64,
        block: usize,
    },
    #[error(
        "tensor '{tensor}' data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor '{tensor}' data [{start}, {end}) lies outside the data section of {data_len} bytes"
    )]
    TensorOutOfRange {
        tensor: String,
        start: u64,
        end: u64,
        data_len: u64,
    },
    #[error("tensors '{first}' and '{second}' overlap in the data section")]
    OverlappingTensors { first: String, second: String },

    // ---- typed access
    #[error("metadata key '{key}' is missing")]
    MissingKey { key: String },
    #[error("metadata key '{key}' should be {expected} but is {found}")]
    TypeMismatch {
        key: String,
        expected: String,
        found: String,
    },

    // ---- writer
    #[error("writer: {0}")]
    WriterState(String),
    #[error("tensor '{name}' should have {expected} bytes of data, got {got}")]
    TensorSize {
        name: String,
        expected: u64,
        got: u64,
    },
    #[error("tensor name '{name}' is {len} bytes; ggml allows at most 63")]
    NameTooLong { name: String, len: usize },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
