//! The engine over a forward pass that answers plain greedy rows with their argmax instead of
//! their logits (as the fused CUDA decode step does): the same tokens as the CPU engine, and
//! only plain greedy decode rows are asked for an argmax. The forward here is SmolLM2 on the
//! CPU behind `Model::with_fused` (from `MUSER_MODELS`, as tests/engine.rs).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use muser_engine::sampling::argmax_logits;
use muser_engine::{Engine, EngineConfig, Event, GenerateRequest, SamplingParams};
use muser_gguf::GgufFile;
use muser_model::{
    Batch, FusedForward, FusedOutput, HostKv, KvCache, KvLayout, KvStore, KvType, LoadOptions,
    Model, ModelError,
};
use muser_text::Tokenizer;

mod common;

/// The CPU model run on its own cache, mirroring the outer cache's sequences (a batch that
/// starts a sequence lower than the inner cache holds truncates it first); output rows marked
/// `argmax_only` are answered with the argmax of their logits.
struct ArgmaxForward {
    inner: Model,
    kv: Mutex<KvCache>,
    answered: Arc<AtomicUsize>,
}

impl FusedForward for ArgmaxForward {
    fn numerics(&self) -> String {
        "argmax-test".to_string()
    }
    fn forward(
        &self,
        _kv: &mut KvCache,
        batch: &Batch,
        groups: &[(u32, Vec<usize>)],
        out_rows: &[usize],
    ) -> Result<FusedOutput, ModelError> {
        let mut kv = self.kv.lock().unwrap();
        for (seq, idx) in groups {
            let p0 = batch.pos[idx[0]];
            if kv.seq_len(*seq) > p0 {
                kv.truncate(*seq, p0);
            }
        }
        let plain = Batch {
            argmax_only: Vec::new(),
            ..batch.clone()
        };
        let out = self.inner.forward(&mut kv, &plain)?;
        let v = self.inner.info().n_vocab;
        let mut a = FusedOutput::default();
        for (r, &i) in out_rows.iter().enumerate() {
            let row = out.row(r, v);
            if batch.argmax_only.get(i).copied().unwrap_or(false) {
                a.argmax.push((i, argmax_logits(row)));
            } else {
                a.rows.push(i);
                a.logits.extend_from_slice(row);
            }
        }
        self.answered.fetch_add(a.argmax.len(), Ordering::Relaxed);
        Ok(a)
    }

    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError> {
        Ok(Box::new(HostKv::new(layout, cells, n_seq)?))
    }

    fn accepts(&self, _kv: &KvCache) -> Result<(), ModelError> {
        Ok(())
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        n_slots: 1,
        n_ctx: 160,
        queue_max: 8,
        prefill_chunk: 32,
        ..Default::default()
    }
}

fn ids(e: &Engine, prompt: Vec<u32>, params: SamplingParams) -> Vec<u32> {
    let req = GenerateRequest {
        prompt,
        params,
        max_tokens: Some(12),
        cache_prompt: false,
        ..Default::default()
    };
    let mut rx = e.submit(req).unwrap();
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, .. } => out.push(id),
            Event::Done { .. } => break,
            Event::Error(e) => panic!("engine error: {e}"),
            _ => {}
        }
    }
    out
}

#[test]
fn argmax_answers_give_the_cpu_engines_tokens() {
    let path = common::smollm_path();
    let opts = LoadOptions {
        threads: 2,
        ..Default::default()
    };
    let cpu = Arc::new(Model::load(&path, &opts).unwrap());
    let tok = Arc::new(Tokenizer::from_gguf(cpu.gguf()).unwrap());
    let inner = Model::load(&path, &opts).unwrap();
    let kv = Mutex::new(inner.new_kv(160, 1, KvType::F16).unwrap());
    let answered = Arc::new(AtomicUsize::new(0));
    let fused = Model::with_fused(
        GgufFile::open(&path).unwrap(),
        Box::new(ArgmaxForward {
            inner,
            kv,
            answered: answered.clone(),
        }),
    )
    .unwrap();
    let (a, b) = (
        Engine::start(cpu, tok.clone(), config()).unwrap(),
        Engine::start(Arc::new(fused), tok.clone(), config()).unwrap(),
    );
    let chat = |q: &str| {
        let text = format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n");
        tok.encode(&text, true, true)
    };
    let mut decoded = 0;
    for q in ["What is the capital of France?", "Name three colors."] {
        let want = ids(&a, chat(q), SamplingParams::greedy());
        assert_eq!(ids(&b, chat(q), SamplingParams::greedy()), want, "{q}");
        decoded += want.len() - 1;
    }
    // Every token but the first (the prompt's last row: logits) came from a decode row.
    assert!(decoded > 0);
    assert_eq!(answered.load(Ordering::Relaxed), decoded);
    // A penalty changes the row: those steps take the logits, with the same tokens.
    let penalized = SamplingParams {
        repeat_penalty: 1.3,
        ..SamplingParams::greedy()
    };
    let before = answered.load(Ordering::Relaxed);
    let want = ids(&a, chat("Write a haiku about rain."), penalized.clone());
    assert_eq!(ids(&b, chat("Write a haiku about rain."), penalized), want);
    assert_eq!(answered.load(Ordering::Relaxed), before);
}
