//! GGUF files: a bounds-checked reader over a memory map and a streaming writer.
//!
//! CONTRACT (other crates code against these names; the owner of this crate fills the bodies):
//! - `GgmlType`: every ggml tensor type we know, with `id()`, `from_id()`, `name()`,
//!   `block_size()` (values per block) and `type_size()` (bytes per block), `row_bytes(n)`.
//! - `GgufFile::open(path)` memory-maps and validates; `metadata()`, typed getters
//!   `get_u32/get_i32/get_f32/get_bool/get_str/get_u64`, `get(key) -> Option<&Value>`,
//!   `get_array`, `tensors()`, `tensor(name) -> Option<&TensorInfo>`, `tensor_data(&TensorInfo) -> &[u8]`.
//! - `GgufWriter` streams a file: metadata then tensor infos, then tensor data written one
//!   tensor at a time (so a 15 GB model never sits in memory).
//! - `Error`: one typed error; metadata type mismatches name key, expected and found type.
