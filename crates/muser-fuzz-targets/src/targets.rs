//! One function per fuzz target: untrusted bytes in, no panic out.

use muser_engine::constraint::{Grammar, Matcher, Vocab};
use muser_gguf::{report::Report, GgufFile};
use muser_kvpack::*;
use std::sync::{Arc, OnceLock};

/// The GGUF reader: an error, or a file whose every accessor works.
pub fn gguf_reader(data: &[u8]) {
    let Ok(file) = GgufFile::from_bytes(data) else {
        return;
    };
    for (key, _) in file.metadata() {
        let _ = file.get_u32(key);
        let _ = file.get_str(key);
        let _ = file.get_str_array(key);
        let _ = file.get_uint(key);
    }
    for t in file.tensors() {
        assert_eq!(file.tensor_data(t).len(), t.size);
        assert_eq!(file.tensor(&t.name), Some(t));
    }
    let _ = Report::new(&file).to_string();
}

struct PackFixture {
    keys: Keys,
    id: KvIdentity,
    state: KvState,
    pack: Vec<u8>,
}

/// A valid sealed pack of 300 tokens over three layers.
fn pack_fixture() -> &'static PackFixture {
    static F: OnceLock<PackFixture> = OnceLock::new();
    F.get_or_init(|| {
        let keys = Keys::derive(&[5; 32]);
        let layout = KvLayoutAbi {
            n_layer: 3,
            swa_layers: vec![true, false, true],
            n_head_kv: 1,
            head_dim: 4,
            n_swa: 100,
            dtype: KvDtype::F16,
            cell_layout: CellLayout::TokenMajor,
        };
        let id = KvIdentity {
            model_weights: [1; 32],
            tokenizer: [2; 32],
            chat_template: [3; 32],
            weight_precision: "F16".into(),
            layout: layout.clone(),
            context_policy: [4; 32],
            engine_abi: "fuzz".into(),
            adapter: None,
        };
        let n = 300u32;
        let tokens: Vec<u32> = (0..n).collect();
        let chain = PrefixHasher::new(&keys, &id.digest(&keys)).chain(&tokens);
        let layers = (0..3)
            .map(|l| {
                let len = layout.layer_range(l, &(0..n)).len() * layout.row_bytes();
                LayerKv {
                    k: (0..len).map(|i| (i * 7 + l) as u8).collect(),
                    v: (0..len).map(|i| (i * 13 + l) as u8).collect(),
                }
            })
            .collect();
        let state = KvState {
            layout,
            positions: 0..n,
            layers,
        };
        let spec = PackSpec {
            identity: &id,
            chain: &chain,
            generation: 1,
            stream: None,
            base_tokens: 0,
            plan: SegmentPlan {
                layers_per_segment: 2,
                tokens_per_segment: BLOCK_TOKENS,
            },
            threads: 1,
        };
        let pack = PackPlan::new(&state, &keys, &spec)
            .expect("the fixture pack")
            .to_bytes();
        PackFixture {
            keys,
            id,
            state,
            pack,
        }
    })
}

/// The valid pack the kvpack target's odd-first-byte inputs mutate.
pub fn kvpack_seed() -> Vec<u8> {
    pack_fixture().pack.clone()
}

/// The kvpack reader. With an even first byte the input is the pack itself; with an odd one
/// the rest is XORed into a valid sealed pack, so mutations start from a well-formed file.
/// Only the unchanged pack may restore, to the state it was made from.
pub fn kvpack_reader(data: &[u8]) {
    let f = pack_fixture();
    let input = match data.first() {
        Some(b) if b & 1 == 1 => {
            let mut p = f.pack.clone();
            for (i, x) in data[1..].iter().enumerate() {
                let at = i % p.len();
                p[at] ^= x;
            }
            p
        }
        _ => data.to_vec(),
    };
    let limits = ReadLimits {
        max_manifest_bytes: 1 << 16,
        max_segment_bytes: 1 << 20,
        max_file_bytes: 1 << 24,
        ..ReadLimits::default()
    };
    let expect = Expect {
        identity: &f.id,
        cut: None,
        other_abis: &[],
    };
    match restore(
        &input[..],
        &f.keys,
        &expect,
        &limits,
        &RestoreControl::default(),
    ) {
        Ok(r) => {
            assert_eq!(input, f.pack, "a changed pack was accepted");
            assert_eq!(r.state, f.state);
        }
        Err(_) => {
            let _ = verify_pack(&input[..], &f.keys, &limits);
        }
    }
}

/// Request bodies: every wire type the server parses; the error of a refused one names a
/// status the server sends (400 or 415), never a panic.
pub fn json_request(data: &[u8]) {
    use muser_server::json::parse;
    use muser_server::wire::{llama, ollama, openai};
    fn one<T: serde::de::DeserializeOwned>(data: &[u8]) {
        if let Err(e) = parse::<T>(data) {
            assert!(matches!(e.status.as_u16(), 400 | 415), "{}", e.status);
        }
    }
    one::<openai::ChatCompletionRequest>(data);
    one::<openai::CompletionRequest>(data);
    one::<openai::EmbeddingRequest>(data);
    one::<llama::CompletionRequest>(data);
    one::<llama::TokenizeRequest>(data);
    one::<llama::DetokenizeRequest>(data);
    one::<ollama::GenerateRequest>(data);
    one::<ollama::ChatRequest>(data);
}

/// JSON schemas to grammars: a schema that compiles gives a matcher that runs over any bytes
/// and masks a small vocabulary without panicking.
pub fn grammar(data: &[u8]) {
    let Ok(schema) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(expr) = muser_server::structured::schema_expr(&schema, 0) else {
        return;
    };
    if let Ok(grammar) = Grammar::compile(&expr) {
        run(grammar, data);
    }
}

/// GBNF text to grammars: a grammar that compiles gives a matcher that runs over any bytes
/// and masks a small vocabulary without panicking.
pub fn gbnf(data: &[u8]) {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(grammar) = muser_engine::constraint::gbnf::compile(src) {
        run(grammar, data);
    }
}

/// Masks and advances a matcher of `grammar` over `data`, three bytes at a time.
fn run(grammar: Grammar, data: &[u8]) {
    static VOCAB: OnceLock<Vocab> = OnceLock::new();
    let vocab = VOCAB.get_or_init(|| {
        let pieces: [&[u8]; 12] = [
            b"{",
            b"}",
            b"\"",
            b"a",
            b":",
            b",",
            b"1",
            b"true",
            b"[",
            b"]",
            b" ",
            b"\xe2\x82",
        ];
        Vocab::new(&pieces, |i| i == 11)
    });
    let mut m = Matcher::new(Arc::new(grammar));
    let mut mask = Vec::new();
    for chunk in data.chunks(3).take(256) {
        m.fill_mask(vocab, &mut mask);
        if !m.advance(chunk) {
            break;
        }
    }
    let _ = m.is_complete();
}
