use super::presets::{preset, Init, QK_NORM_SCALE};
use super::*;

fn plan(name: &str, wt: WeightType, seed: u64) -> Plan {
    Plan::new(preset(name).unwrap(), wt, seed, None)
}

fn write(plan: &Plan) -> Vec<u8> {
    plan.write(Vec::new(), &mut |_| {}).unwrap()
}

fn values(f: &GgufFile, name: &str) -> Vec<f32> {
    let t = f.tensor(name).unwrap();
    let mut v = vec![0.0; t.n_elements() as usize];
    muser_quant::dequantize_row(t.ty, f.tensor_data(t), &mut v).unwrap();
    v
}

fn std_dev(v: &[f32]) -> f32 {
    let mean = v.iter().sum::<f32>() / v.len() as f32;
    (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32).sqrt()
}

#[test]
fn muse_glimmer_30b_has_the_published_parameter_count() {
    let p = plan("muse-glimmer-30b", WeightType::Q4_K, 0);
    assert_eq!(p.n_params(), 27_854_794_240);
    assert_eq!(p.tensors.len(), 3 + 52 * 14);
    assert!(p.preset.raw_blocks);
    // Q4_K everywhere except the F32 norms: 4.5 bits per weight plus 0.4 MB of norms.
    let gib = p.n_bytes() as f64 / (1u64 << 30) as f64;
    assert!((14.5..14.7).contains(&gib), "{gib} GiB");
}

#[test]
fn bench_310m_parameter_count() {
    assert_eq!(
        plan("bench-310m", WeightType::Q4_K, 0).n_params(),
        310_449_152
    );
}

#[test]
fn q4_k_m_follows_llama_quantize() {
    let p = plan("muse-glimmer-30b", WeightType::Q4_K_M, 0);
    let ty = |name: &str| p.tensors.iter().find(|t| t.spec.name == name).unwrap().ty;
    let more: Vec<usize> = (0..52)
        .filter(|&i| ty(&format!("blk.{i}.attn_v.weight")) == GgmlType::Q6_K)
        .collect();
    let expect: Vec<usize> = (0..6).chain((8..=41).step_by(3)).chain(44..52).collect();
    assert_eq!(more, expect);
    for i in 0..52 {
        let down = ty(&format!("blk.{i}.ffn_down.weight"));
        assert_eq!(down == GgmlType::Q6_K, expect.contains(&i));
        assert_eq!(ty(&format!("blk.{i}.attn_q.weight")), GgmlType::Q4_K);
        assert_eq!(ty(&format!("blk.{i}.attn_norm.weight")), GgmlType::F32);
    }
    assert_eq!(ty("output.weight"), GgmlType::Q6_K);
    assert_eq!(ty("token_embd.weight"), GgmlType::Q4_K);

    // The 4-layer case the spec verified against llama-quantize: layers 2 and 3.
    let p = plan("tiny", WeightType::Q4_K_M, 0);
    let six: Vec<&str> = p
        .tensors
        .iter()
        .filter(|t| t.ty == GgmlType::Q6_K)
        .map(|t| t.spec.name.as_str())
        .collect();
    assert_eq!(
        six,
        [
            "output.weight",
            "blk.2.attn_v.weight",
            "blk.2.ffn_down.weight",
            "blk.3.attn_v.weight",
            "blk.3.ffn_down.weight"
        ]
    );
}

#[test]
fn rows_that_are_not_whole_blocks_fall_back_like_llama_quantize() {
    assert_eq!(fallback(GgmlType::Q4_K, 384), GgmlType::Q5_0);
    assert_eq!(fallback(GgmlType::Q6_K, 384), GgmlType::Q8_0);
    assert_eq!(fallback(GgmlType::NVFP4, 96), GgmlType::F16);
    assert_eq!(fallback(GgmlType::Q4_K, 100), GgmlType::F16);
    assert_eq!(fallback(GgmlType::Q4_K, 512), GgmlType::Q4_K);
}

#[test]
fn every_type_writes_a_readable_tiny_model() {
    for wt in WeightType::ALL {
        let p = plan("tiny", wt, 1);
        let bytes = write(&p);
        let f = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(f.architecture().unwrap(), "muse-glimmer");
        assert_eq!(f.tensors().len(), 3 + 4 * 14);
        let params: u64 = f.tensors().iter().map(|t| t.n_elements()).sum();
        assert_eq!(params, p.n_params(), "{}", wt.name());
        assert_eq!(
            f.get_u32("muse-glimmer.attention.sliding_window_pattern")
                .unwrap(),
            4
        );
        assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "none");
        assert_eq!(f.get_u32("muse-glimmer.vocab_size").unwrap(), 512);
        assert_eq!(
            f.tensor("blk.0.attn_q.weight").unwrap().ty,
            tensor_type(wt, &p.tensors[4].spec, 4)
        );
        // A projection of fan-in 256 has std 1/16 whatever the encoding.
        let q = values(&f, "blk.1.attn_q.weight");
        assert!(q.iter().all(|x| x.is_finite()));
        let s = std_dev(&q);
        assert!((s - 0.0625).abs() < 0.01, "{}: std {s}", wt.name());
        assert_eq!(
            values(&f, "blk.0.attn_q_norm.weight"),
            vec![QK_NORM_SCALE; 64]
        );
        assert_eq!(values(&f, "blk.0.attn_k_norm.weight"), vec![1.0; 64]);
        let norm = values(&f, "blk.3.ffn_norm.weight");
        assert!(norm.iter().all(|x| (0.5..1.5).contains(x)) && std_dev(&norm) > 0.05);
    }
}

#[test]
fn tiny_array_writes_the_bool_pattern() {
    let f = GgufFile::from_bytes(write(&plan("tiny-array", WeightType::Q8_0, 2))).unwrap();
    assert_eq!(
        f.get_bool_array("muse-glimmer.attention.sliding_window_pattern")
            .unwrap(),
        &[true, false, true, true, false]
    );
    assert_eq!(
        f.get_f32("muse-glimmer.rope.freq_base_swa").unwrap(),
        10_000.0
    );
    assert_eq!(
        f.tensor("blk.4.attn_k.weight").unwrap().dims,
        vec![512, 128]
    );
    assert_eq!(f.tensor("blk.4.attn_q_norm.weight").unwrap().dims, vec![32]);
}

#[test]
fn output_is_deterministic_in_the_seed() {
    let a = write(&plan("tiny", WeightType::Q4_0, 9));
    assert_eq!(a, write(&plan("tiny", WeightType::Q4_0, 9)));
    let b = write(&plan("tiny", WeightType::Q4_0, 10));
    assert_eq!(a.len(), b.len());
    assert_ne!(a, b);
}

#[test]
fn raw_block_mode_writes_valid_blocks_of_the_same_scale() {
    for wt in [WeightType::Q4_K_M, WeightType::NVFP4, WeightType::F16] {
        let mut p = preset("tiny").unwrap();
        p.raw_blocks = true;
        let f = GgufFile::from_bytes(write(&Plan::new(p, wt, 3, None))).unwrap();
        for name in [
            "blk.2.attn_v.weight",
            "blk.0.ffn_gate.weight",
            "output.weight",
        ] {
            let v = values(&f, name);
            let t = f.tensor(name).unwrap();
            let expect = match Plan::new(preset("tiny").unwrap(), wt, 3, None)
                .tensors
                .iter()
                .find(|x| x.spec.name == name)
                .unwrap()
                .spec
                .init
            {
                Init::Normal { std } => std,
                _ => unreachable!(),
            };
            let s = std_dev(&v);
            assert!(v.iter().all(|x| x.is_finite()));
            assert!(
                s > expect * 0.5 && s < expect * 1.5,
                "{} {name} ({}): std {s}, want {expect}",
                wt.name(),
                t.ty
            );
        }
        assert_eq!(values(&f, "blk.0.attn_k_norm.weight"), vec![1.0; 64]);
    }
}

#[test]
fn donor_vocabulary_gets_the_muse_specials() {
    let mut w = GgufWriter::new(Vec::new(), 3).unwrap();
    w.add_str("general.architecture", "llama").unwrap();
    w.add_str("tokenizer.ggml.model", "gpt2").unwrap();
    w.add_str("tokenizer.ggml.pre", "smollm").unwrap();
    w.add_str_array("tokenizer.ggml.tokens", &["<|endoftext|>", "a", "b"])
        .unwrap();
    w.add_array("tokenizer.ggml.token_type", vec![3i32, 1, 1])
        .unwrap();
    w.add_str_array("tokenizer.ggml.merges", &["a b"]).unwrap();
    w.add_u32("tokenizer.ggml.eos_token_id", 0).unwrap();
    w.add_str("tokenizer.chat_template", "old").unwrap();
    let donor = GgufFile::from_bytes(w.finish().unwrap()).unwrap();

    let specials = [
        "<|start|>",
        "<|message|>",
        "<|eom|>",
        "<|eot|>",
        "<|endoftext|>",
    ];
    let vocab = Vocab::from_donor(&donor, &specials, "TEMPLATE").unwrap();
    assert_eq!(vocab.n_tokens, 7);
    let p = Plan::new(preset("tiny").unwrap(), WeightType::F16, 0, Some(vocab));
    let f = GgufFile::from_bytes(write(&p)).unwrap();
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap(),
        [
            "<|endoftext|>",
            "a",
            "b",
            "<|start|>",
            "<|message|>",
            "<|eom|>",
            "<|eot|>"
        ]
    );
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type").unwrap(),
        &[3, 1, 1, 3, 3, 3, 3]
    );
    assert_eq!(f.get_u32("tokenizer.ggml.eot_token_id").unwrap(), 6);
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 0);
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(f.get_str_array("tokenizer.ggml.merges").unwrap(), ["a b"]);
    assert_eq!(f.get_str("tokenizer.chat_template").unwrap(), "TEMPLATE");
    assert_eq!(f.get_u32("muse-glimmer.vocab_size").unwrap(), 7);
    assert_eq!(f.tensor("token_embd.weight").unwrap().dims, vec![256, 7]);
    assert_eq!(f.tensor("output.weight").unwrap().dims, vec![256, 7]);
}

/// A vocabulary-only file keeps the geometry and the tokenizer, has no tensors, and is a donor
/// that gives the same vocabulary again (its specials are already there).
#[test]
fn a_vocabulary_only_file_is_a_donor_again() {
    let mut w = GgufWriter::new(Vec::new(), 3).unwrap();
    w.add_str("general.architecture", "llama").unwrap();
    w.add_str("tokenizer.ggml.model", "gpt2").unwrap();
    w.add_str_array("tokenizer.ggml.tokens", &["a", "b"])
        .unwrap();
    w.add_array("tokenizer.ggml.token_type", vec![1i32, 1])
        .unwrap();
    let donor = GgufFile::from_bytes(w.finish().unwrap()).unwrap();
    let specials = ["<|start|>", "<|eot|>"];
    let vocab = Vocab::from_donor(&donor, &specials, "T").unwrap();
    let p = Plan::new(
        preset("tiny").unwrap(),
        WeightType::Q8_0,
        0,
        Some(vocab.clone()),
    );
    let only = GgufFile::from_bytes(write(&p.clone().without_tensors())).unwrap();
    assert!(only.tensors().is_empty());
    assert_eq!(only.get_u32("muse-glimmer.vocab_size").unwrap(), 4);
    assert_eq!(
        only.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "b", "<|start|>", "<|eot|>"]
    );
    let again = Vocab::from_donor(&only, &specials, "T").unwrap();
    assert_eq!(again, vocab);
}

#[test]
fn unknown_names_are_errors() {
    assert!(matches!(
        preset("huge"),
        Err(SynthError::UnknownPreset { .. })
    ));
    assert!(matches!(
        WeightType::from_name("q3_k"),
        Err(SynthError::UnknownType { .. })
    ));
    assert_eq!(WeightType::from_name("Q4_K_M").unwrap(), WeightType::Q4_K_M);
    for name in WeightType::NAMES {
        assert_eq!(WeightType::from_name(name).unwrap().name(), name);
    }
}
