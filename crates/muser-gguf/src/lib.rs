//! GGUF files: a bounds-checked reader over a memory map, a streaming writer, and the table of
//! ggml tensor types.
//!
//! - [`GgmlType`]: every ggml tensor type with its id (as in llama.cpp b11434's `ggml.h`),
//!   name, block size and type size.
//! - [`GgufFile::open`] memory-maps a file and validates the whole header before returning:
//!   every count, length and offset is checked against the file size, and each way a file can
//!   be malformed is its own [`Error`] variant. Metadata is available in file order
//!   ([`GgufFile::metadata`]) and through typed getters (`get_u32`, `get_str`,
//!   `get_opt_f32`, `get_str_array`, ...) whose errors name the key, the expected and the
//!   found type. Tensor bytes are borrowed from the map ([`GgufFile::tensor_data`]).
//! - [`GgufWriter`] streams a file: metadata and tensor infos, then each tensor's bytes in
//!   declaration order (whole or in chunks), padded to the alignment, so a 15 GB model never
//!   sits in memory.
//! - [`report::Report`]: the summary `muser inspect` prints (architecture, geometry,
//!   tokenizer, tensor table, totals).
//!
//! Layout of a GGUF file (versions 2 and 3 are identical on little-endian machines):
//! `"GGUF"`, u32 version, u64 tensor count, u64 metadata count, the metadata entries
//! (string key, u32 type, value), the tensor infos (string name, u32 n_dims, u64 dims in ggml
//! order, u32 type, u64 offset relative to the data section), padding to `general.alignment`
//! (default 32), then the data section.

mod error;
mod reader;
pub mod report;
mod types;
mod value;
mod writer;

pub use error::{Error, Result};
pub use reader::{GgufFile, TensorInfo, MAX_ARRAY_DEPTH};
pub use types::GgmlType;
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, MAX_NAME_BYTES};

/// The four bytes every GGUF file starts with.
pub const MAGIC: &[u8; 4] = b"GGUF";
/// The metadata key that sets the data alignment.
pub const KEY_ALIGNMENT: &str = "general.alignment";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
