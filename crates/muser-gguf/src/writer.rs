//! The streaming writer. Metadata and tensor infos are declared first; `write_header` emits
//! them, then tensor bytes are written one tensor at a time, in declaration order, optionally
//! in chunks, each tensor padded to the alignment. Nothing but the header is held in memory.

use std::collections::HashSet;
use std::io::Write;

use crate::error::{Error, Result};
use crate::types::GgmlType;
use crate::value::{Array, Value};
use crate::{DEFAULT_ALIGNMENT, KEY_ALIGNMENT, MAGIC, MAX_DIMS};

/// ggml's limit on tensor name length (`GGML_MAX_NAME`, including the terminating NUL).
pub const MAX_NAME_BYTES: usize = 64;

struct Decl {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    size: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Declaring,
    /// Header written; `next` is the tensor being written, `done` its bytes so far.
    Data {
        next: usize,
        done: u64,
    },
}

/// Writes a GGUF file to any `Write` (a `BufWriter<File>` for real files).
///
/// ```
/// # use muser_gguf::{GgufWriter, GgufFile, GgmlType};
/// let mut w = GgufWriter::new(Vec::new(), 3).unwrap();
/// w.add_str("general.architecture", "demo").unwrap();
/// w.add_tensor_info("x", &[4], GgmlType::F32).unwrap();
/// w.write_header().unwrap();
/// w.write_tensor_data("x", &[0u8; 16]).unwrap();
/// let bytes = w.finish().unwrap();
/// let f = GgufFile::from_bytes(bytes).unwrap();
/// assert_eq!(f.get_str("general.architecture").unwrap(), "demo");
/// ```
pub struct GgufWriter<W: Write> {
    out: W,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<Decl>,
    names: HashSet<String>,
    state: State,
    written: u64,
}

macro_rules! scalar_adders {
    ($($add:ident, $t:ty;)*) => {
        impl<W: Write> GgufWriter<W> {
            $(
                #[doc = concat!("Adds a `", stringify!($t), "` metadata value.")]
                pub fn $add(&mut self, key: &str, value: $t) -> Result<()> {
                    self.add(key, value)
                }
            )*
        }
    };
}

scalar_adders! {
    add_u8, u8; add_i8, i8; add_u16, u16; add_i16, i16; add_u32, u32; add_i32, i32;
    add_u64, u64; add_i64, i64; add_f32, f32; add_f64, f64; add_bool, bool;
}

impl<W: Write> GgufWriter<W> {
    /// A writer for GGUF `version` (2 or 3; the layouts are identical).
    pub fn new(out: W, version: u32) -> Result<Self> {
        if !(2..=3).contains(&version) {
            return Err(Error::UnsupportedVersion { version });
        }
        Ok(GgufWriter {
            out,
            version,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            state: State::Declaring,
            written: 0,
        })
    }

    fn declaring(&self, what: &str) -> Result<()> {
        match self.state {
            State::Declaring => Ok(()),
            _ => Err(Error::WriterState(format!(
                "{what} after the header was written"
            ))),
        }
    }

    /// Adds a metadata entry of any type. Setting `general.alignment` (u32, a power of two)
    /// changes the tensor data alignment.
    pub fn add(&mut self, key: &str, value: impl Into<Value>) -> Result<()> {
        self.declaring("metadata")?;
        let value = value.into();
        if key.is_empty() {
            return Err(Error::EmptyKey {
                index: self.metadata.len() as u64,
            });
        }
        if self.keys.contains(key) {
            return Err(Error::DuplicateKey {
                key: key.to_string(),
            });
        }
        if key == KEY_ALIGNMENT {
            match value {
                Value::U32(a) if a.is_power_of_two() => self.alignment = a.into(),
                Value::U32(a) => return Err(Error::BadAlignment { value: a.into() }),
                ref v => {
                    return Err(Error::TypeMismatch {
                        key: key.to_string(),
                        expected: "u32".to_string(),
                        found: v.type_desc(),
                    })
                }
            }
        }
        self.keys.insert(key.to_string());
        self.metadata.push((key.to_string(), value));
        Ok(())
    }

    /// Adds a string metadata value.
    pub fn add_str(&mut self, key: &str, value: &str) -> Result<()> {
        self.add(key, value)
    }

    /// Adds an array metadata value.
    pub fn add_array(&mut self, key: &str, value: impl Into<Array>) -> Result<()> {
        self.add(key, Value::Array(value.into()))
    }

    /// Adds an array of strings.
    pub fn add_str_array<S: AsRef<str>>(&mut self, key: &str, items: &[S]) -> Result<()> {
        let items = items.iter().map(|s| s.as_ref().to_string()).collect();
        self.add(key, Value::Array(Array::String(items)))
    }

    /// Declares a tensor; `dims` in ggml order (ne0 first). Data follows in declaration order.
    pub fn add_tensor_info(&mut self, name: &str, dims: &[u64], ty: GgmlType) -> Result<()> {
        self.declaring("tensor info")?;
        if name.len() >= MAX_NAME_BYTES {
            return Err(Error::NameTooLong {
                name: name.to_string(),
                len: name.len(),
            });
        }
        if self.names.contains(name) {
            return Err(Error::DuplicateTensor {
                name: name.to_string(),
            });
        }
        if dims.len() > MAX_DIMS {
            return Err(Error::TooManyDims {
                tensor: name.to_string(),
                n_dims: dims.len() as u32,
            });
        }
        let ne0 = dims.first().copied().unwrap_or(1);
        if ne0 % ty.block_size() as u64 != 0 {
            return Err(Error::PartialBlock {
                tensor: name.to_string(),
                ty: ty.name(),
                ne0,
                block: ty.block_size(),
            });
        }
        let size = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .and_then(|n| (n / ty.block_size() as u64).checked_mul(ty.type_size() as u64))
            .ok_or_else(|| Error::DimsOverflow {
                tensor: name.to_string(),
                dims: dims.to_vec(),
            })?;
        self.names.insert(name.to_string());
        self.tensors.push(Decl {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            size,
        });
        Ok(())
    }

    /// Bytes the data of the tensor called `name` must have.
    pub fn tensor_size(&self, name: &str) -> Option<u64> {
        self.tensors.iter().find(|t| t.name == name).map(|t| t.size)
    }

    /// Writes magic, counts, metadata and tensor infos, padded to the alignment.
    pub fn write_header(&mut self) -> Result<()> {
        self.declaring("write_header")?;
        let mut buf = Vec::new();
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&self.version.to_le_bytes());
        buf.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        buf.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut buf, key);
            buf.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut buf, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut buf, &t.name);
            buf.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                buf.extend_from_slice(&d.to_le_bytes());
            }
            buf.extend_from_slice(&t.ty.id().to_le_bytes());
            buf.extend_from_slice(&offset.to_le_bytes());
            offset += t.size.next_multiple_of(self.alignment);
        }
        if !self.tensors.is_empty() {
            buf.resize(
                (buf.len() as u64).next_multiple_of(self.alignment) as usize,
                0,
            );
        }
        self.out.write_all(&buf)?;
        self.written = buf.len() as u64;
        self.state = State::Data { next: 0, done: 0 };
        Ok(())
    }

    /// Tensors with no elements need no data: moves past those before the current one unless
    /// it is the one named.
    fn skip_empty_tensors(&mut self, name: Option<&str>) {
        while let State::Data { next, done: 0 } = self.state {
            match self.tensors.get(next) {
                Some(t) if t.size == 0 && Some(t.name.as_str()) != name => {
                    self.state = State::Data {
                        next: next + 1,
                        done: 0,
                    }
                }
                _ => break,
            }
        }
    }

    fn current(&mut self, name: &str) -> Result<(usize, u64)> {
        self.skip_empty_tensors(Some(name));
        let State::Data { next, done } = self.state else {
            return Err(Error::WriterState(
                "tensor data before write_header".to_string(),
            ));
        };
        match self.tensors.get(next) {
            Some(t) if t.name == name => Ok((next, done)),
            Some(t) => Err(Error::WriterState(format!(
                "tensor data for '{name}' while '{}' is next",
                t.name
            ))),
            None => Err(Error::WriterState(format!(
                "tensor data for '{name}' after the last tensor"
            ))),
        }
    }

    /// Writes the whole data of tensor `name`, which must be the next one declared.
    pub fn write_tensor_data(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let (i, done) = self.current(name)?;
        let expected = self.tensors[i].size;
        if done != 0 || bytes.len() as u64 != expected {
            return Err(Error::TensorSize {
                name: name.to_string(),
                expected,
                got: done + bytes.len() as u64,
            });
        }
        self.write_tensor_chunk(name, bytes)
    }

    /// Appends `bytes` to the data of tensor `name` (the next one declared); when its data is
    /// complete the padding is written and the next tensor becomes current.
    pub fn write_tensor_chunk(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let (i, done) = self.current(name)?;
        let size = self.tensors[i].size;
        let total = done + bytes.len() as u64;
        if total > size {
            return Err(Error::TensorSize {
                name: name.to_string(),
                expected: size,
                got: total,
            });
        }
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        if total < size {
            self.state = State::Data {
                next: i,
                done: total,
            };
            return Ok(());
        }
        let pad = self.written.next_multiple_of(self.alignment) - self.written;
        self.out.write_all(&vec![0u8; pad as usize])?;
        self.written += pad;
        self.state = State::Data {
            next: i + 1,
            done: 0,
        };
        Ok(())
    }

    /// Checks every tensor was written, flushes, and returns the output.
    pub fn finish(mut self) -> Result<W> {
        if self.state == State::Declaring {
            self.write_header()?;
        }
        self.skip_empty_tensors(None);
        if let State::Data { next, .. } = self.state {
            if let Some(t) = self.tensors.get(next) {
                return Err(Error::WriterState(format!(
                    "finish before the data of tensor '{}' was complete",
                    t.name
                )));
            }
        }
        self.out.flush()?;
        Ok(self.out)
    }

    /// Bytes written so far.
    pub fn bytes_written(&self) -> u64 {
        self.written
    }
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => buf.push(*v),
        Value::I8(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => buf.push(u8::from(*v)),
        Value::String(s) => put_str(buf, s),
        Value::Array(a) => put_array(buf, a),
    }
}

fn put_array(buf: &mut Vec<u8>, a: &Array) {
    fn each<T: Copy, const N: usize>(buf: &mut Vec<u8>, v: &[T], f: fn(T) -> [u8; N]) {
        for &x in v {
            buf.extend_from_slice(&f(x));
        }
    }
    buf.extend_from_slice(&a.elem_type().id().to_le_bytes());
    buf.extend_from_slice(&(a.len() as u64).to_le_bytes());
    match a {
        Array::U8(v) => buf.extend_from_slice(v),
        Array::I8(v) => each(buf, v, i8::to_le_bytes),
        Array::U16(v) => each(buf, v, u16::to_le_bytes),
        Array::I16(v) => each(buf, v, i16::to_le_bytes),
        Array::U32(v) => each(buf, v, u32::to_le_bytes),
        Array::I32(v) => each(buf, v, i32::to_le_bytes),
        Array::U64(v) => each(buf, v, u64::to_le_bytes),
        Array::I64(v) => each(buf, v, i64::to_le_bytes),
        Array::F32(v) => each(buf, v, f32::to_le_bytes),
        Array::F64(v) => each(buf, v, f64::to_le_bytes),
        Array::Bool(v) => each(buf, v, |b| [u8::from(b)]),
        Array::String(v) => v.iter().for_each(|s| put_str(buf, s)),
        Array::Array(v) => v.iter().for_each(|inner| put_array(buf, inner)),
    }
}
