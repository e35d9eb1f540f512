//! Malformed files: one test per failure class, each asserting the error kind; then a bounded
//! deterministic mutation fuzz over valid files asserting the reader never panics.

use muser_gguf::{Error, GgmlType, GgufFile, GgufWriter};

/// Hand-assembles GGUF bytes, so each test can put exactly one thing wrong.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(n_tensors: u64, n_kv: u64) -> Raw {
        Raw::default()
            .bytes(b"GGUF")
            .u32(3)
            .u64(n_tensors)
            .u64(n_kv)
    }
    fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    fn u32(self, v: u32) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(self, v: u64) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    /// A u32 metadata entry.
    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(4).u32(v)
    }
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Raw {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(ty).u64(offset)
    }
    /// Pads to 32 and appends `n` data bytes.
    fn data(mut self, n: usize) -> Raw {
        self.0.resize(self.0.len().next_multiple_of(32) + n, 0);
        self
    }
    fn parse(self) -> Result<GgufFile, Error> {
        GgufFile::from_bytes(self.0)
    }
}

fn valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new(Vec::new(), 3).unwrap();
    w.add_str("general.architecture", "test").unwrap();
    w.add_u32("test.block_count", 2).unwrap();
    w.add_f32("test.eps", 1e-5).unwrap();
    w.add_str_array("tokenizer.ggml.tokens", &["a", "bb", "ccc"])
        .unwrap();
    w.add_array("test.pattern", vec![true, false, true])
        .unwrap();
    w.add_array(
        "test.nested",
        muser_gguf::Array::Array(vec![vec![1u32, 2].into(), vec!["x".to_string()].into()]),
    )
    .unwrap();
    w.add_tensor_info("a.weight", &[32, 2], GgmlType::Q8_0)
        .unwrap();
    w.add_tensor_info("b.weight", &[5], GgmlType::F32).unwrap();
    w.add_tensor_info("c.weight", &[256], GgmlType::Q4_K)
        .unwrap();
    w.write_header().unwrap();
    w.write_tensor_data("a.weight", &[1; 68]).unwrap();
    w.write_tensor_data("b.weight", &[2; 20]).unwrap();
    w.write_tensor_data("c.weight", &[3; 144]).unwrap();
    w.finish().unwrap()
}

#[test]
fn valid_file_parses() {
    let f = GgufFile::from_bytes(valid_file()).unwrap();
    assert_eq!(f.tensors().len(), 3);
    assert_eq!(f.tensor_data(f.tensor("c.weight").unwrap()), &[3; 144]);
}

#[test]
fn truncated_file() {
    let bytes = valid_file();
    let header_end = GgufFile::from_bytes(bytes.clone()).unwrap().data_offset() as usize;
    for cut in [0, 3, 10, 23, 200, 250, header_end - 40] {
        let e = GgufFile::from_bytes(&bytes[..cut]).unwrap_err();
        assert!(
            matches!(e, Error::Truncated { .. } | Error::StringPastEnd { .. }),
            "cut {cut}: {e}"
        );
    }
    // Cut right after the counts, the claimed entries cannot fit in what is left.
    let e = GgufFile::from_bytes(&bytes[..30]).unwrap_err();
    assert!(
        matches!(e, Error::TooManyTensors { count: 3, max: 0 }),
        "{e}"
    );
    assert!(matches!(
        GgufFile::from_bytes(&bytes[..10]).unwrap_err(),
        Error::Truncated {
            what: "tensor count",
            ..
        }
    ));
}

#[test]
fn truncated_tensor_data_is_out_of_range() {
    let bytes = valid_file();
    let e = GgufFile::from_bytes(&bytes[..bytes.len() - 200]).unwrap_err();
    assert!(matches!(e, Error::TensorOutOfRange { .. }), "{e}");
}

#[test]
fn bad_magic() {
    let mut bytes = valid_file();
    bytes[..4].copy_from_slice(b"GGML");
    assert!(matches!(
        GgufFile::from_bytes(bytes).unwrap_err(),
        Error::BadMagic { found } if &found == b"GGML"
    ));
}

#[test]
fn bad_version() {
    for v in [0u32, 1, 4, 0x0300_0000] {
        let mut bytes = valid_file();
        bytes[4..8].copy_from_slice(&v.to_le_bytes());
        assert!(matches!(
            GgufFile::from_bytes(bytes).unwrap_err(),
            Error::UnsupportedVersion { version } if version == v
        ));
    }
}

#[test]
fn string_length_past_end() {
    let e = Raw::header(0, 1)
        .u64(1 << 40)
        .bytes(b"key")
        .data(64)
        .parse()
        .unwrap_err();
    assert!(
        matches!(e, Error::StringPastEnd { len, .. } if len == 1 << 40),
        "{e}"
    );
    let e = Raw::header(0, 1)
        .str("k")
        .u32(8)
        .u64(u64::MAX)
        .data(64)
        .parse()
        .unwrap_err();
    assert!(matches!(e, Error::StringPastEnd { .. }), "{e}");
}

#[test]
fn absurd_tensor_and_key_counts() {
    let e = Raw::header(1 << 60, 0).data(64).parse().unwrap_err();
    assert!(
        matches!(e, Error::TooManyTensors { count, .. } if count == 1 << 60),
        "{e}"
    );
    let e = Raw::header(0, 1 << 60).data(64).parse().unwrap_err();
    assert!(
        matches!(e, Error::TooManyKeys { count, .. } if count == 1 << 60),
        "{e}"
    );
    let e = Raw::header(u64::MAX, u64::MAX).parse().unwrap_err();
    assert!(matches!(e, Error::TooManyTensors { .. }), "{e}");
}

#[test]
fn absurd_array_length() {
    for (elem, len) in [
        (4u32, 1u64 << 62),
        (8, 1 << 40),
        (9, 1 << 36),
        (0, u64::MAX),
    ] {
        let e = Raw::header(0, 1)
            .str("arr")
            .u32(9)
            .u32(elem)
            .u64(len)
            .data(100)
            .parse()
            .unwrap_err();
        assert!(
            matches!(e, Error::ArrayTooLong { ref key, .. } if key == "arr"),
            "{e}"
        );
    }
}

#[test]
fn arrays_nested_too_deep() {
    let mut r = Raw::header(0, 1).str("deep").u32(9);
    for _ in 0..40 {
        r = r.u32(9).u64(1);
    }
    let e = r.u32(4).u64(0).parse().unwrap_err();
    assert!(matches!(e, Error::NestingTooDeep { .. }), "{e}");
}

#[test]
fn unknown_value_type() {
    let e = Raw::header(0, 1)
        .str("k")
        .u32(13)
        .u32(0)
        .parse()
        .unwrap_err();
    assert!(
        matches!(e, Error::UnknownValueType { type_id: 13, .. }),
        "{e}"
    );
    let e = Raw::header(0, 1)
        .str("k")
        .u32(9)
        .u32(77)
        .u64(0)
        .parse()
        .unwrap_err();
    assert!(
        matches!(e, Error::UnknownValueType { type_id: 77, .. }),
        "{e}"
    );
}

#[test]
fn empty_duplicate_and_non_utf8_keys() {
    let e = Raw::header(0, 1).kv_u32("", 1).parse().unwrap_err();
    assert!(matches!(e, Error::EmptyKey { index: 0 }), "{e}");
    let e = Raw::header(0, 2)
        .kv_u32("k", 1)
        .kv_u32("k", 2)
        .parse()
        .unwrap_err();
    assert!(
        matches!(e, Error::DuplicateKey { ref key } if key == "k"),
        "{e}"
    );
    let e = Raw::header(0, 1)
        .u64(2)
        .bytes(&[0xff, 0xfe])
        .u32(4)
        .u32(0)
        .parse()
        .unwrap_err();
    assert!(matches!(e, Error::InvalidUtf8 { offset: 32 }), "{e}");
}

#[test]
fn bad_alignment() {
    let e = Raw::header(0, 1)
        .kv_u32("general.alignment", 48)
        .parse()
        .unwrap_err();
    assert!(matches!(e, Error::BadAlignment { value: 48 }), "{e}");
    let e = Raw::header(0, 1)
        .kv_u32("general.alignment", 0)
        .parse()
        .unwrap_err();
    assert!(matches!(e, Error::BadAlignment { value: 0 }), "{e}");
    let e = Raw::header(0, 1)
        .str("general.alignment")
        .u32(10)
        .u64(64)
        .parse()
        .unwrap_err();
    assert!(
        matches!(e, Error::TypeMismatch { ref expected, .. } if expected == "u32"),
        "{e}"
    );
}

#[test]
fn too_many_dims() {
    let e = Raw::header(1, 0)
        .tensor("t", &[1, 1, 1, 1, 1], 0, 0)
        .data(4)
        .parse()
        .unwrap_err();
    assert!(matches!(e, Error::TooManyDims { n_dims: 5, .. }), "{e}");
}

#[test]
fn overflowing_dims() {
    for dims in [
        &[1u64 << 32, 1 << 32][..],
        &[1 << 63],
        &[u64::MAX, 0],
        &[1 << 40, 1 << 30],
    ] {
        let e = Raw::header(1, 0)
            .tensor("t", dims, 0, 0)
            .data(4)
            .parse()
            .unwrap_err();
        assert!(matches!(e, Error::DimsOverflow { .. }), "{dims:?}: {e}");
    }
    // Elements fit in i64 but bytes do not fit in 64 bits.
    let e = Raw::header(1, 0)
        .tensor("t", &[1 << 61, 4], 0, 0)
        .data(4)
        .parse()
        .unwrap_err();
    assert!(matches!(e, Error::DimsOverflow { .. }), "{e}");
}

#[test]
fn unknown_tensor_type() {
    for ty in [4u32, 31, 43, 9999] {
        let e = Raw::header(1, 0)
            .tensor("t", &[32], ty, 0)
            .data(64)
            .parse()
            .unwrap_err();
        assert!(
            matches!(e, Error::UnknownTensorType { type_id, .. } if type_id == ty),
            "{e}"
        );
    }
}

#[test]
fn partial_block() {
    let e = Raw::header(1, 0)
        .tensor("t", &[100], 12, 0)
        .data(144)
        .parse()
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::PartialBlock {
                ne0: 100,
                block: 256,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn misaligned_tensor() {
    let e = Raw::header(1, 0)
        .tensor("t", &[4], 0, 4)
        .data(64)
        .parse()
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::MisalignedTensor {
                offset: 4,
                alignment: 32,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn overlapping_tensors() {
    let e = Raw::header(2, 0)
        .tensor("a", &[16], 0, 0)
        .tensor("b", &[16], 0, 32)
        .data(128)
        .parse()
        .unwrap_err();
    assert!(
        matches!(e, Error::OverlappingTensors { ref first, ref second } if first == "a" && second == "b"),
        "{e}"
    );
}

#[test]
fn tensor_out_of_range() {
    let e = Raw::header(1, 0)
        .tensor("t", &[16], 0, 0)
        .data(63)
        .parse()
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::TensorOutOfRange {
                end: 64,
                data_len: 63,
                ..
            }
        ),
        "{e}"
    );
    let e = Raw::header(1, 0)
        .tensor("t", &[16], 0, u64::MAX - 31)
        .data(64)
        .parse()
        .unwrap_err();
    assert!(matches!(e, Error::TensorOutOfRange { .. }), "{e}");
}

#[test]
fn duplicate_tensor_names() {
    let e = Raw::header(2, 0)
        .tensor("a", &[8], 0, 0)
        .tensor("a", &[8], 0, 32)
        .data(64)
        .parse()
        .unwrap_err();
    assert!(
        matches!(e, Error::DuplicateTensor { ref name } if name == "a"),
        "{e}"
    );
}

#[test]
fn opens_files_and_reports_io_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    std::fs::write(&path, valid_file()).unwrap();
    assert_eq!(GgufFile::open(&path).unwrap().tensors().len(), 3);
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        GgufFile::open(&empty).unwrap_err(),
        Error::Truncated { .. }
    ));
    let e = GgufFile::open(&dir.path().join("missing.gguf")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }) && e.to_string().contains("missing.gguf"));
}

/// xorshift64*: a fixed, dependency-free sequence so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Touches everything a valid parse exposes, so lazily wrong offsets would panic here.
fn exercise(f: &GgufFile) {
    for (k, _) in f.metadata() {
        let _ = f.get_u32(k);
        let _ = f.get_str_array(k);
    }
    for t in f.tensors() {
        assert_eq!(f.tensor_data(t).len(), t.size);
    }
}

#[test]
fn mutation_fuzz_never_panics() {
    let base = valid_file();
    let smash = [
        0u64,
        1,
        0xff,
        1 << 31,
        1 << 32,
        1 << 40,
        1 << 62,
        1 << 63,
        u64::MAX,
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut parsed_ok = 0;
    for _ in 0..5000 {
        let mut b = base.clone();
        for _ in 0..1 + rng.below(3) {
            match rng.below(4) {
                _ if b.is_empty() => b.push(rng.next() as u8),
                0 => {
                    let i = rng.below(b.len());
                    b[i] ^= 1 << rng.below(8);
                }
                1 => b.truncate(rng.below(b.len() + 1)),
                2 if b.len() >= 8 => {
                    let i = rng.below(b.len() - 7);
                    let v = smash[rng.below(smash.len())] ^ (rng.next() & 0xf);
                    b[i..i + 8].copy_from_slice(&v.to_le_bytes());
                }
                _ => {
                    let i = rng.below(b.len() + 1);
                    let n = rng.below(9);
                    let junk: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                    b.splice(i..i, junk);
                }
            }
        }
        if let Ok(f) = GgufFile::from_bytes(b) {
            exercise(&f);
            parsed_ok += 1;
        }
    }
    // Some mutations land in tensor data or padding and must still parse.
    assert!(parsed_ok > 100, "only {parsed_ok} mutants parsed");
}
