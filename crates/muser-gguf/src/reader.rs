//! The reader: parses and validates the whole header (metadata and tensor infos) up front,
//! then hands out tensor bytes as slices of the memory map.
//!
//! Every count, length and offset is checked against the bytes that remain before anything is
//! allocated, so a hostile file costs at most a small multiple of its own size in memory.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::types::GgmlType;
use crate::value::{Array, Value, ValueType};
use crate::{DEFAULT_ALIGNMENT, KEY_ALIGNMENT, MAGIC, MAX_DIMS};

/// Arrays nested deeper than this are rejected (the recursion would otherwise be bounded only
/// by the file size).
pub const MAX_ARRAY_DEPTH: usize = 16;

/// Bytes a metadata entry occupies at least: a one-byte key with its length, a type tag, and a
/// one-byte value.
const MIN_KV_BYTES: u64 = 8 + 1 + 4 + 1;
/// Bytes a tensor info occupies at least: a one-byte name, n_dims, type and offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 1 + 4 + 4 + 8;

/// One tensor's description from the header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` (ne0) is the contiguous one.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Bytes of data.
    pub size: usize,
}

impl TensorInfo {
    /// Number of values (the product of the dims; 1 for zero dims).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Values per row (`ne0`).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of all dims after the first).
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
}

enum Backing {
    Map(Mmap),
    Bytes(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Bytes(b) => b,
        }
    }
}

/// A validated GGUF file. Metadata is parsed into owned values; tensor data stays in the map.
pub struct GgufFile {
    backing: Backing,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("file_len", &self.backing.bytes().len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps `path` and validates its header and tensor layout.
    ///
    /// The file must not be modified while the returned value is alive (a memory map reflects
    /// changes to the file underneath).
    pub fn open(path: &Path) -> Result<GgufFile> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let backing = if len == 0 {
            Backing::Bytes(Vec::new())
        } else {
            // SAFETY: the map is read-only; the documented contract is that the file is not
            // modified while mapped, and every access is bounds-checked against its length.
            Backing::Map(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        Self::parse(backing)
    }

    /// Validates a GGUF image held in memory (tests, fuzzing, small generated files).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<GgufFile> {
        Self::parse(Backing::Bytes(bytes.into()))
    }

    fn parse(backing: Backing) -> Result<GgufFile> {
        let header = parse_header(backing.bytes())?;
        Ok(GgufFile {
            backing,
            version: header.version,
            alignment: header.alignment,
            data_offset: header.data_offset,
            key_index: header
                .metadata
                .iter()
                .enumerate()
                .map(|(i, (k, _))| (k.clone(), i))
                .collect(),
            metadata: header.metadata,
            tensor_index: header
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            tensors: header.tensors,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// File offset where the data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Total length of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// All metadata entries in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| Error::MissingKey {
            key: key.to_string(),
        })
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            v => Err(mismatch(key, "string", v)),
        }
    }

    /// A string value, `None` if the key is absent.
    pub fn get_opt_str(&self, key: &str) -> Result<Option<&str>> {
        optional(self.get_str(key))
    }

    /// An array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            v => Err(mismatch(key, "array", v)),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        match self.require(key)? {
            Value::Array(Array::String(v)) => Ok(v.iter().map(String::as_str).collect()),
            v => Err(mismatch(key, "array[string]", v)),
        }
    }

    /// Any non-negative integer value (u8..u64, i8..i64), widened to u64. Useful for keys that
    /// writers store with varying integer types.
    pub fn get_uint(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64_lossless()
            .ok_or_else(|| mismatch(key, "non-negative integer", v))
    }
}

macro_rules! scalar_getters {
    ($($get:ident, $opt:ident, $variant:ident, $t:ty, $name:literal;)*) => {
        impl GgufFile {
            $(
                #[doc = concat!("A `", $name, "` value; any other type is an error naming the key.")]
                pub fn $get(&self, key: &str) -> Result<$t> {
                    match self.require(key)? {
                        Value::$variant(x) => Ok(*x),
                        v => Err(mismatch(key, $name, v)),
                    }
                }

                #[doc = concat!("A `", $name, "` value, `None` if the key is absent.")]
                pub fn $opt(&self, key: &str) -> Result<Option<$t>> {
                    optional(self.$get(key))
                }
            )*
        }
    };
}

scalar_getters! {
    get_u8, get_opt_u8, U8, u8, "u8";
    get_i8, get_opt_i8, I8, i8, "i8";
    get_u16, get_opt_u16, U16, u16, "u16";
    get_i16, get_opt_i16, I16, i16, "i16";
    get_u32, get_opt_u32, U32, u32, "u32";
    get_i32, get_opt_i32, I32, i32, "i32";
    get_u64, get_opt_u64, U64, u64, "u64";
    get_i64, get_opt_i64, I64, i64, "i64";
    get_f32, get_opt_f32, F32, f32, "f32";
    get_f64, get_opt_f64, F64, f64, "f64";
    get_bool, get_opt_bool, Bool, bool, "bool";
}

macro_rules! array_getters {
    ($($get:ident, $variant:ident, $t:ty, $name:literal;)*) => {
        impl GgufFile {
            $(
                #[doc = concat!("An `", $name, "` value as a slice.")]
                pub fn $get(&self, key: &str) -> Result<&[$t]> {
                    match self.require(key)? {
                        Value::Array(Array::$variant(x)) => Ok(x),
                        v => Err(mismatch(key, $name, v)),
                    }
                }
            )*
        }
    };
}

array_getters! {
    get_u32_array, U32, u32, "array[u32]";
    get_i32_array, I32, i32, "array[i32]";
    get_f32_array, F32, f32, "array[f32]";
    get_bool_array, Bool, bool, "array[bool]";
}

impl GgufFile {
    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`, if any.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor, borrowed from the map.
    ///
    /// # Panics
    /// If `info` does not come from this file (its range was validated only for this file).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = self.data_offset + info.offset;
        self.backing
            .bytes()
            .get(start as usize..start as usize + info.size)
            .expect("TensorInfo from another GgufFile")
    }
}

fn mismatch(key: &str, expected: &str, found: &Value) -> Error {
    Error::TypeMismatch {
        key: key.to_string(),
        expected: expected.to_string(),
        found: found.type_desc(),
    }
}

fn optional<T>(r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(Error::MissingKey { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian cursor.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::Truncated {
                what,
                offset: self.pos as u64,
                need: n,
                file_len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &'static str) -> Result<String> {
        let len = self.u64(what)?;
        let offset = self.pos as u64;
        if len > self.remaining() {
            return Err(Error::StringPastEnd {
                offset,
                len,
                remaining: self.remaining(),
            });
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::InvalidUtf8 { offset })
    }
}

fn parse_header(buf: &[u8]) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(Error::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(Error::UnsupportedVersion { version });
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    let room = |min: u64| c.remaining() / min;
    if n_tensors > room(MIN_TENSOR_INFO_BYTES) {
        return Err(Error::TooManyTensors {
            count: n_tensors,
            max: room(MIN_TENSOR_INFO_BYTES),
        });
    }
    if n_kv > room(MIN_KV_BYTES) {
        return Err(Error::TooManyKeys {
            count: n_kv,
            max: room(MIN_KV_BYTES),
        });
    }

    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut seen = HashSet::with_capacity(n_kv as usize);
    for index in 0..n_kv {
        let key = c.string("metadata key")?;
        if key.is_empty() {
            return Err(Error::EmptyKey { index });
        }
        if !seen.insert(key.clone()) {
            return Err(Error::DuplicateKey { key });
        }
        let type_id = c.u32("metadata value type")?;
        let value = read_value(&mut c, &key, type_id, 0)?;
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == KEY_ALIGNMENT) {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
        Some((_, Value::U32(a))) => return Err(Error::BadAlignment { value: (*a).into() }),
        Some((k, v)) => return Err(mismatch(k, "u32", v)),
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut seen = HashSet::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let info = read_tensor_info(&mut c)?;
        if !seen.insert(info.name.clone()) {
            return Err(Error::DuplicateTensor { name: info.name });
        }
        tensors.push(info);
    }

    let mut data_offset = c.pos as u64;
    if n_tensors > 0 {
        data_offset = data_offset.next_multiple_of(alignment);
        if data_offset > buf.len() as u64 {
            return Err(Error::Truncated {
                what: "padding before tensor data",
                offset: c.pos as u64,
                need: data_offset - c.pos as u64,
                file_len: buf.len() as u64,
            });
        }
    }
    check_layout(&tensors, alignment, buf.len() as u64 - data_offset)?;
    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}

fn read_value(c: &mut Cursor, key: &str, type_id: u32, depth: usize) -> Result<Value> {
    let ty = ValueType::from_id(type_id).ok_or_else(|| Error::UnknownValueType {
        key: key.to_string(),
        type_id,
    })?;
    let what = "metadata value";
    Ok(match ty {
        ValueType::U8 => Value::U8(c.array::<1>(what)?[0]),
        ValueType::I8 => Value::I8(i8::from_le_bytes(c.array(what)?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array(what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array(what)?)),
        ValueType::U32 => Value::U32(u32::from_le_bytes(c.array(what)?)),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array(what)?)),
        ValueType::U64 => Value::U64(u64::from_le_bytes(c.array(what)?)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array(what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array(what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array(what)?)),
        ValueType::Bool => Value::Bool(c.array::<1>(what)?[0] != 0),
        ValueType::String => Value::String(c.string("metadata string")?),
        ValueType::Array => Value::Array(read_array(c, key, depth)?),
    })
}

/// Decodes `n` fixed-size little-endian values from one bounds-checked slice.
fn fixed<const N: usize, T>(c: &mut Cursor, n: u64, f: fn([u8; N]) -> T) -> Result<Vec<T>> {
    let bytes = c.take(n * N as u64, "array data")?;
    Ok(bytes
        .chunks_exact(N)
        .map(|b| f(b.try_into().expect("chunk of N bytes")))
        .collect())
}

fn read_array(c: &mut Cursor, key: &str, depth: usize) -> Result<Array> {
    let type_id = c.u32("array element type")?;
    let elem = ValueType::from_id(type_id).ok_or_else(|| Error::UnknownValueType {
        key: key.to_string(),
        type_id,
    })?;
    let n = c.u64("array length")?;
    if n > c.remaining() / elem.min_encoded_len() {
        return Err(Error::ArrayTooLong {
            key: key.to_string(),
            elem: elem.name(),
            len: n,
            remaining: c.remaining(),
        });
    }
    Ok(match elem {
        ValueType::U8 => Array::U8(c.take(n, "array data")?.to_vec()),
        ValueType::I8 => Array::I8(fixed(c, n, i8::from_le_bytes)?),
        ValueType::U16 => Array::U16(fixed(c, n, u16::from_le_bytes)?),
        ValueType::I16 => Array::I16(fixed(c, n, i16::from_le_bytes)?),
        ValueType::U32 => Array::U32(fixed(c, n, u32::from_le_bytes)?),
        ValueType::I32 => Array::I32(fixed(c, n, i32::from_le_bytes)?),
        ValueType::U64 => Array::U64(fixed(c, n, u64::from_le_bytes)?),
        ValueType::I64 => Array::I64(fixed(c, n, i64::from_le_bytes)?),
        ValueType::F32 => Array::F32(fixed(c, n, f32::from_le_bytes)?),
        ValueType::F64 => Array::F64(fixed(c, n, f64::from_le_bytes)?),
        ValueType::Bool => Array::Bool(fixed(c, n, |[b]: [u8; 1]| b != 0)?),
        ValueType::String => Array::String(
            (0..n)
                .map(|_| c.string("array string"))
                .collect::<Result<_>>()?,
        ),
        ValueType::Array => {
            if depth + 1 >= MAX_ARRAY_DEPTH {
                return Err(Error::NestingTooDeep {
                    key: key.to_string(),
                    max: MAX_ARRAY_DEPTH,
                });
            }
            Array::Array(
                (0..n)
                    .map(|_| read_array(c, key, depth + 1))
                    .collect::<Result<_>>()?,
            )
        }
    })
}

fn read_tensor_info(c: &mut Cursor) -> Result<TensorInfo> {
    let name = c.string("tensor name")?;
    let n_dims = c.u32("tensor n_dims")?;
    if n_dims as usize > MAX_DIMS {
        return Err(Error::TooManyDims {
            tensor: name,
            n_dims,
        });
    }
    let dims = (0..n_dims)
        .map(|_| c.u64("tensor dim"))
        .collect::<Result<Vec<u64>>>()?;
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64 && dims.iter().all(|&d| d <= i64::MAX as u64));
    let Some(n_elements) = n_elements else {
        return Err(Error::DimsOverflow { tensor: name, dims });
    };
    let type_id = c.u32("tensor type")?;
    let Some(ty) = GgmlType::from_id(type_id) else {
        return Err(Error::UnknownTensorType {
            tensor: name,
            type_id,
        });
    };
    let ne0 = dims.first().copied().unwrap_or(1);
    if ne0 % ty.block_size() as u64 != 0 {
        return Err(Error::PartialBlock {
            tensor: name,
            ty: ty.name(),
            ne0,
            block: ty.block_size(),
        });
    }
    let size = (n_elements / ty.block_size() as u64)
        .checked_mul(ty.type_size() as u64)
        .and_then(|s| usize::try_from(s).ok());
    let Some(size) = size else {
        return Err(Error::DimsOverflow { tensor: name, dims });
    };
    let offset = c.u64("tensor data offset")?;
    Ok(TensorInfo {
        name,
        dims,
        ty,
        offset,
        size,
    })
}

/// Each tensor aligned, inside the data section, and not overlapping another.
fn check_layout(tensors: &[TensorInfo], alignment: u64, data_len: u64) -> Result<()> {
    let mut ranges = Vec::with_capacity(tensors.len());
    for t in tensors {
        if t.offset % alignment != 0 {
            return Err(Error::MisalignedTensor {
                tensor: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        let end = t.offset.checked_add(t.size as u64);
        match end {
            Some(end) if end <= data_len => ranges.push((t.offset, end, &t.name)),
            _ => {
                return Err(Error::TensorOutOfRange {
                    tensor: t.name.clone(),
                    start: t.offset,
                    end: end.unwrap_or(u64::MAX),
                    data_len,
                })
            }
        }
    }
    ranges.retain(|r| r.0 < r.1);
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(Error::OverlappingTensors {
                first: pair[0].2.clone(),
                second: pair[1].2.clone(),
            });
        }
    }
    Ok(())
}
