//! Reads the real SmolLM2-135M-Instruct Q4_1 GGUF (fetched by scripts/fetch-models.sh) and
//! checks facts that gguf-py reports for the same file.

use std::path::PathBuf;

use muser_gguf::report::Report;
use muser_gguf::{GgmlType, GgufFile};

fn model(name: &str) -> PathBuf {
    let dir = std::env::var_os("MUSER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/muser/models")
        });
    let path = dir.join(name);
    assert!(
        path.exists(),
        "test model {} is missing: run scripts/fetch-models.sh (or set MUSER_MODELS)",
        path.display()
    );
    path
}

#[test]
fn smollm2_header_matches_gguf_py() {
    let f = GgufFile::open(&model("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.file_len(), 98_362_432);
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100_000.0);
    assert!(!f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
        49152
    );
    assert_eq!(
        f.get_str_array("tokenizer.ggml.merges").unwrap().len(),
        48900
    );
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 2);
    assert!(f
        .get_str("tokenizer.chat_template")
        .unwrap()
        .contains("im_start"));

    assert_eq!(f.tensors().len(), 272);
    let count = |ty| f.tensors().iter().filter(|t| t.ty == ty).count();
    assert_eq!(
        (
            count(GgmlType::Q4_1),
            count(GgmlType::F32),
            count(GgmlType::Q8_0)
        ),
        (210, 61, 1)
    );
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (embd.ty, embd.dims.as_slice()),
        (GgmlType::Q8_0, &[576, 49152][..])
    );
    assert_eq!(f.data_offset() + embd.offset, 1_785_664);
    assert_eq!(embd.size, 30_081_024);
    let norm = f.tensor("blk.0.attn_norm.weight").unwrap();
    let norm: Vec<f32> = f
        .tensor_data(norm)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(norm.len(), 576);
    assert!(norm.iter().all(|x| x.is_finite()) && norm.iter().any(|&x| x != 0.0));

    let report = Report::new(&f);
    assert_eq!(report.n_params, 134_515_008);
    let tok = report.tokenizer.as_ref().unwrap();
    assert_eq!(
        (tok.model.as_str(), tok.n_tokens, tok.bos, tok.eos),
        ("gpt2", 49152, Some(1), Some(2))
    );
    assert!(report
        .geometry
        .contains(&("block_count".to_string(), "30".to_string())));
    let text = report.to_string();
    assert!(text.contains("parameters    134,515,008"), "{text}");
}

/// The fuzz seeds were written by llama.cpp's gguf-py (`GGUFWriter`), one with a nested array
/// and one with `general.alignment = 64`.
#[test]
fn reads_files_written_by_gguf_py() {
    let seeds =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/gguf_reader");
    let f = GgufFile::open(&seeds.join("small.bin")).unwrap();
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.get_i64("x.i64").unwrap(), -5);
    assert_eq!(f.get_f64("x.f64").unwrap(), 0.25);
    assert_eq!(f.get_u8("x.u8").unwrap(), 7);
    assert_eq!(
        f.get_bool_array("llama.attention.sliding_window_pattern")
            .unwrap(),
        &[true, false]
    );
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "b", "ab", "<|eot|>"]
    );
    let nested = muser_gguf::Array::Array(vec![vec![1i32, 2].into(), vec![3i32].into()]);
    assert_eq!(f.get_array("x.nested").unwrap(), &nested);
    let a = f.tensor("a.weight").unwrap();
    assert_eq!((a.ty, a.dims.as_slice()), (GgmlType::F32, &[32, 2][..]));
    let a: Vec<f32> = f
        .tensor_data(a)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(a, (0..64).map(|x| x as f32).collect::<Vec<_>>());
    assert_eq!(f.tensor("c.weight").unwrap().dims, vec![32, 1]);

    let f = GgufFile::open(&seeds.join("aligned64.bin")).unwrap();
    assert_eq!(f.alignment(), 64);
    assert!(f
        .tensors()
        .iter()
        .all(|t| (f.data_offset() + t.offset).is_multiple_of(64)));
    assert_eq!(f.tensor("b.weight").unwrap().ty, GgmlType::F16);
}
