//! Property test: whatever the writer writes, the reader reads back identically (metadata of
//! every type including nested arrays, tensor infos, tensor bytes, alignment, both versions).

use muser_gguf::{Array, GgmlType, GgufFile, GgufWriter, Value};
use proptest::prelude::*;

fn finite_f32() -> impl Strategy<Value = f32> {
    any::<f32>().prop_filter("NaN never compares equal", |x| !x.is_nan())
}

fn finite_f64() -> impl Strategy<Value = f64> {
    any::<f64>().prop_filter("NaN never compares equal", |x| !x.is_nan())
}

fn arb_array(depth: u32) -> BoxedStrategy<Array> {
    use proptest::collection::vec;
    let n = 0..6usize;
    let flat = prop_oneof![
        vec(any::<u8>(), n.clone()).prop_map(Array::U8),
        vec(any::<i8>(), n.clone()).prop_map(Array::I8),
        vec(any::<u16>(), n.clone()).prop_map(Array::U16),
        vec(any::<i16>(), n.clone()).prop_map(Array::I16),
        vec(any::<u32>(), n.clone()).prop_map(Array::U32),
        vec(any::<i32>(), n.clone()).prop_map(Array::I32),
        vec(any::<u64>(), n.clone()).prop_map(Array::U64),
        vec(any::<i64>(), n.clone()).prop_map(Array::I64),
        vec(finite_f32(), n.clone()).prop_map(Array::F32),
        vec(finite_f64(), n.clone()).prop_map(Array::F64),
        vec(any::<bool>(), n.clone()).prop_map(Array::Bool),
        vec("\\PC{0,12}", n.clone()).prop_map(Array::String),
    ];
    if depth == 0 {
        flat.boxed()
    } else {
        prop_oneof![
            3 => flat,
            1 => vec(arb_array(depth - 1), 0..4).prop_map(Array::Array),
        ]
        .boxed()
    }
}

fn arb_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        finite_f32().prop_map(Value::F32),
        finite_f64().prop_map(Value::F64),
        any::<bool>().prop_map(Value::Bool),
        "\\PC{0,40}".prop_map(Value::String),
        arb_array(2).prop_map(Value::Array),
    ]
}

/// A tensor: type, dims (ne0 a whole number of blocks), and a seed for its bytes.
fn arb_tensor() -> impl Strategy<Value = (GgmlType, Vec<u64>, u64)> {
    let types = prop::sample::select(vec![
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::I8,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::NVFP4,
        GgmlType::MXFP4,
    ]);
    (
        types,
        1..4u64,
        prop::collection::vec(0..4u64, 0..4),
        any::<u64>(),
    )
        .prop_map(|(ty, blocks, mut rest, seed)| {
            rest.truncate(3);
            let mut dims = vec![blocks * ty.block_size() as u64];
            dims.extend(rest);
            (ty, dims, seed)
        })
}

fn bytes_from_seed(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn writer_output_reads_back_identically(
        version in 2..=3u32,
        alignment in prop::option::of(prop::sample::select(vec![1u32, 8, 32, 64, 256])),
        metadata in prop::collection::btree_map("[a-z][a-z0-9._]{0,15}", arb_value(), 0..10),
        tensors in prop::collection::vec(arb_tensor(), 0..6),
        chunked in any::<bool>(),
    ) {
        let mut w = GgufWriter::new(Vec::new(), version).unwrap();
        let mut expect_meta: Vec<(String, Value)> = Vec::new();
        if let Some(a) = alignment {
            w.add_u32("general.alignment", a).unwrap();
            expect_meta.push(("general.alignment".into(), Value::U32(a)));
        }
        for (k, v) in &metadata {
            if k == "general.alignment" { continue; }
            w.add(k, v.clone()).unwrap();
            expect_meta.push((k.clone(), v.clone()));
        }
        let names: Vec<String> = (0..tensors.len()).map(|i| format!("t{i}.weight")).collect();
        for ((ty, dims, _), name) in tensors.iter().zip(&names) {
            w.add_tensor_info(name, dims, *ty).unwrap();
        }
        w.write_header().unwrap();
        let mut datas = Vec::new();
        for ((_, _, seed), name) in tensors.iter().zip(&names) {
            let size = w.tensor_size(name).unwrap() as usize;
            let data = bytes_from_seed(*seed, size);
            if chunked && size > 1 {
                let (a, b) = data.split_at(size / 3);
                w.write_tensor_chunk(name, a).unwrap();
                w.write_tensor_chunk(name, b).unwrap();
            } else {
                w.write_tensor_data(name, &data).unwrap();
            }
            datas.push(data);
        }
        let bytes = w.finish().unwrap();

        let f = GgufFile::from_bytes(bytes).unwrap();
        prop_assert_eq!(f.version(), version);
        prop_assert_eq!(f.alignment(), u64::from(alignment.unwrap_or(32)));
        prop_assert_eq!(f.metadata(), &expect_meta[..]);
        for (k, v) in &expect_meta {
            prop_assert_eq!(f.get(k), Some(v));
        }
        prop_assert_eq!(f.tensors().len(), tensors.len());
        for (((ty, dims, _), name), data) in tensors.iter().zip(&names).zip(&datas) {
            let t = f.tensor(name).unwrap();
            prop_assert_eq!(t.ty, *ty);
            prop_assert_eq!(&t.dims, dims);
            prop_assert_eq!(t.size, data.len());
            prop_assert_eq!((f.data_offset() + t.offset) % f.alignment(), 0);
            prop_assert_eq!(f.tensor_data(t), &data[..]);
        }
    }
}

#[test]
fn typed_getters_name_key_expected_and_found() {
    let mut w = GgufWriter::new(Vec::new(), 3).unwrap();
    w.add_u32("a.count", 7).unwrap();
    w.add_str("a.name", "x").unwrap();
    w.add_array("a.list", vec![1i32, 2, 3]).unwrap();
    w.add_str_array("a.words", &["p", "q"]).unwrap();
    let f = GgufFile::from_bytes(w.finish().unwrap()).unwrap();

    assert_eq!(f.get_u32("a.count").unwrap(), 7);
    assert_eq!(f.get_opt_u32("a.count").unwrap(), Some(7));
    assert_eq!(f.get_opt_u32("a.absent").unwrap(), None);
    assert_eq!(f.get_uint("a.count").unwrap(), 7);
    assert_eq!(f.get_str("a.name").unwrap(), "x");
    assert_eq!(f.get_i32_array("a.list").unwrap(), &[1, 2, 3]);
    assert_eq!(f.get_str_array("a.words").unwrap(), vec!["p", "q"]);

    let err = f.get_i32("a.count").unwrap_err().to_string();
    assert_eq!(err, "metadata key 'a.count' should be i32 but is u32");
    let err = f.get_opt_f32("a.name").unwrap_err().to_string();
    assert_eq!(err, "metadata key 'a.name' should be f32 but is string");
    let err = f.get_str_array("a.list").unwrap_err().to_string();
    assert_eq!(
        err,
        "metadata key 'a.list' should be array[string] but is array[i32]"
    );
    let err = f.get_u32("a.absent").unwrap_err().to_string();
    assert_eq!(err, "metadata key 'a.absent' is missing");
}

#[test]
fn writer_rejects_misuse() {
    let mut w = GgufWriter::new(Vec::new(), 3).unwrap();
    assert!(GgufWriter::new(Vec::new(), 1).is_err());
    w.add_u32("k", 1).unwrap();
    assert!(matches!(
        w.add_u32("k", 2),
        Err(muser_gguf::Error::DuplicateKey { .. })
    ));
    assert!(matches!(
        w.add_u32("general.alignment", 24),
        Err(muser_gguf::Error::BadAlignment { value: 24 })
    ));
    assert!(matches!(
        w.add_tensor_info("q", &[100], GgmlType::Q4_K),
        Err(muser_gguf::Error::PartialBlock { .. })
    ));
    let long = "x".repeat(64);
    assert!(matches!(
        w.add_tensor_info(&long, &[1], GgmlType::F32),
        Err(muser_gguf::Error::NameTooLong { .. })
    ));
    w.add_tensor_info("a", &[4], GgmlType::F32).unwrap();
    w.add_tensor_info("b", &[4], GgmlType::F32).unwrap();
    assert!(matches!(
        w.add_tensor_info("a", &[4], GgmlType::F32),
        Err(muser_gguf::Error::DuplicateTensor { .. })
    ));
    assert!(
        w.write_tensor_data("a", &[0; 16]).is_err(),
        "data before header"
    );
    w.write_header().unwrap();
    assert!(w.add_u32("late", 1).is_err());
    assert!(w.write_tensor_data("b", &[0; 16]).is_err(), "out of order");
    assert!(matches!(
        w.write_tensor_data("a", &[0; 12]),
        Err(muser_gguf::Error::TensorSize {
            expected: 16,
            got: 12,
            ..
        })
    ));
    w.write_tensor_data("a", &[0; 16]).unwrap();
    assert!(w.finish().is_err(), "b was never written");
}
