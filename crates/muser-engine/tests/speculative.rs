//! Speculative decoding with the n-gram drafter gives plain decoding's tokens: greedy token for
//! token (SmolLM2 with four slots at once, stop strings, a grammar constraint, generations
//! past positions 256 and 1024, and the synthetic sliding-window Muse Glimmer with its ring
//! wrapping), and seeded sampling token for token with the same log-probabilities (each row is
//! sampled as a plain step samples it, so the distribution is plain sampling's). A request's
//! own `speculative` settings turn it off, on, or resize it.

use std::sync::{Arc, OnceLock};

use muser_engine::SubmitError;
use muser_engine::{
    Constraint, Engine, EngineConfig, Event, Expr, FinishReason, GenerateRequest, Grammar,
    SamplingParams, TokenLogprobs, Vocab,
};
use muser_model::synth::{presets, Plan, WeightType};
use muser_model::{LoadOptions, Model};
use muser_spec::{SpecConfig, SpecMode, SpecOverride};
use muser_text::Tokenizer;

mod common;

fn smollm() -> (Arc<Model>, Arc<Tokenizer>) {
    static M: OnceLock<(Arc<Model>, Arc<Tokenizer>)> = OnceLock::new();
    M.get_or_init(|| {
        let model = Model::load(
            &common::smollm_path(),
            &LoadOptions {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap();
        let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
        (Arc::new(model), Arc::new(tok))
    })
    .clone()
}

fn config(n_slots: usize, spec: bool) -> EngineConfig {
    EngineConfig {
        n_slots,
        n_ctx: 1152,
        // below 64 rows, so that a prompt chunk's attention takes the same kernel however
        // many rows other slots add to its batch (from 64 rows of one sequence it is tiled):
        // the prompts' K/V, and with them the tokens, do not depend on the batching
        prefill_chunk: 48,
        // drafts as long as the drafter finds (not as many as pay): the most rows to verify
        spec: spec.then(|| SpecConfig {
            adaptive: false,
            ..SpecConfig::new(SpecMode::Ngram)
        }),
        ..Default::default()
    }
}

fn chat(text: &str) -> Vec<u32> {
    let (_, tok) = smollm();
    let chat = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
    tok.encode(&chat, true, true)
}

#[derive(Debug, PartialEq)]
struct Outcome {
    ids: Vec<u32>,
    text: String,
    logprobs: Vec<Option<TokenLogprobs>>,
    reason: FinishReason,
    n_gen: usize,
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> (Outcome, (usize, usize)) {
    let (mut ids, mut text, mut logprobs) = (Vec::new(), String::new(), Vec::new());
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token {
                id,
                text: t,
                logprobs: l,
            } => {
                ids.push(id);
                text.push_str(&t);
                logprobs.push(l);
            }
            Event::Done {
                reason,
                n_gen,
                timings,
                ..
            } => {
                let o = Outcome {
                    ids,
                    text,
                    logprobs,
                    reason,
                    n_gen,
                };
                return (o, (timings.draft_n, timings.draft_n_accepted));
            }
            other => panic!("{other:?}"),
        }
    }
    panic!("stream ended without Done")
}

/// Every request on a plain engine one at a time, and all at once on a speculating one.
fn both(reqs: &[GenerateRequest], n_slots: usize) -> (Vec<Outcome>, Vec<Outcome>, usize) {
    let (model, tok) = smollm();
    let plain = Engine::start(model.clone(), tok.clone(), config(1, false)).unwrap();
    let want: Vec<Outcome> = reqs
        .iter()
        .map(|r| collect(plain.submit(r.clone()).unwrap()).0)
        .collect();
    let spec = Engine::start(model, tok, config(n_slots, true)).unwrap();
    let rxs: Vec<_> = reqs
        .iter()
        .map(|r| spec.submit(r.clone()).unwrap())
        .collect();
    let mut got = Vec::new();
    let mut accepted = 0;
    for rx in rxs {
        let (o, (n, a)) = collect(rx);
        assert!(a <= n);
        accepted += a;
        got.push(o);
    }
    let st = spec.stats();
    assert_eq!(st.draft_accepted_total as usize, accepted);
    assert!(st.draft_tokens_total >= st.draft_accepted_total);
    (want, got, accepted)
}

fn request(prompt: Vec<u32>, params: SamplingParams, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt,
        params,
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

const CODE: &str = "Rename the function add to sum and return the code:\n\
def add(a, b):\n    return a + b\n\nprint(add(1, 2))\nprint(add(3, 4))\n";

#[test]
fn greedy_speculation_equals_plain_decoding_with_four_slots_and_stop_strings() {
    let mut stopped = request(chat(CODE), SamplingParams::greedy(), 48);
    stopped.stop = vec!["(3".to_string()];
    let reqs = vec![
        request(chat(CODE), SamplingParams::greedy(), 48),
        request(
            chat("Repeat this line three times: one two three four five six"),
            SamplingParams::greedy(),
            40,
        ),
        stopped,
        request(
            chat("What is the capital of France?"),
            SamplingParams::greedy(),
            16,
        ),
        request(
            chat("Copy this list: apple, banana, cherry, apple, banana, cherry"),
            SamplingParams::greedy(),
            32,
        ),
        // past position 256: 512 cells in view, where a lone decode row's attention splits
        // the cells across threads
        request(chat(&CODE.repeat(6)), SamplingParams::greedy(), 48),
        // past 1024 positions
        request(chat(&CODE.repeat(22)), SamplingParams::greedy(), 40),
    ];
    let n = (reqs[5].prompt.len(), reqs[6].prompt.len());
    assert!(n.0 > 256 && n.1 > 1024, "{n:?}");
    let (want, got, accepted) = both(&reqs, 4);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(g, w, "request {i}");
    }
    assert_eq!(got[2].reason, FinishReason::Stop);
    assert!(accepted > 10, "drafts were accepted ({accepted})");
}

/// The drafter copies a previous turn's answer and, after it, the chat template's turn end and
/// the next turn's header; drafts stop before the end of generation (the row before it samples
/// it), so every drafted row is taken and none is verified past the answer's end.
#[test]
fn drafts_stop_at_an_end_of_generation() {
    let (_, tok) = smollm();
    let turn = "<|im_start|>user\nSay exactly: hello world<|im_end|>\n<|im_start|>assistant\n";
    let prompt = format!("{turn}hello world<|im_end|>\n{turn}");
    let req = request(
        tok.encode(&prompt, true, true),
        SamplingParams::greedy(),
        16,
    );
    let (want, got, _) = both(std::slice::from_ref(&req), 1);
    assert_eq!(got, want);
    assert_eq!(got[0].reason, FinishReason::Eog);
    let (model, tok) = smollm();
    let spec = Engine::start(model, tok, config(1, true)).unwrap();
    let (_, (drafted, accepted)) = collect(spec.submit(req).unwrap());
    assert!(
        accepted > 0 && drafted == accepted,
        "{drafted} drafted, {accepted} taken"
    );
}

#[test]
fn a_requests_own_speculative_settings_turn_it_off_on_or_resize_it() {
    let (model, tok) = smollm();
    let req = |speculative: SpecOverride| GenerateRequest {
        speculative,
        ..request(chat(CODE), SamplingParams::greedy(), 32)
    };
    let spec = Engine::start(model.clone(), tok.clone(), config(1, true)).unwrap();
    let run = |e: &Engine, o: SpecOverride| collect(e.submit(req(o)).unwrap());
    let (want, (n, a)) = run(&spec, SpecOverride::default());
    assert!(a > 0 && n > 0, "{n} {a}");
    let off = SpecOverride {
        draft_max: Some(0),
        ..Default::default()
    };
    let (got, (n, _)) = run(&spec, off);
    assert_eq!((&got, n), (&want, 0));
    // a draft of at most 2 tokens per verification
    let small = SpecOverride {
        draft_max: Some(2),
        ..Default::default()
    };
    let (got, (n2, a2)) = run(&spec, small);
    assert_eq!(got, want);
    assert!(n2 > 0 && a2 > 0, "{n2} {a2}");
    let bad = SpecOverride {
        draft_max: Some(64),
        ..Default::default()
    };
    assert!(matches!(
        spec.submit(req(bad)),
        Err(SubmitError::Speculative(_))
    ));
    // a plain engine speculates for a request that names a drafter
    let plain = Engine::start(model, tok, config(1, false)).unwrap();
    let on = SpecOverride {
        mode: Some(Some(SpecMode::Ngram)),
        ..Default::default()
    };
    let (got, (n, a)) = run(&plain, on);
    assert_eq!(got, want);
    assert!(a > 0 && n > 0, "{n} {a}");
    assert_eq!(run(&plain, SpecOverride::default()).1, (0, 0));
}

#[test]
fn seeded_sampling_and_a_grammar_give_plain_decodings_tokens_and_logprobs() {
    let (_, tok) = smollm();
    let sampled = SamplingParams {
        temperature: 0.7,
        seed: Some(11),
        n_probs: 3,
        ..SamplingParams::greedy()
    };
    let grammar = Grammar::compile(&Expr::Seq(vec![
        Expr::lit("def sum(a, b):\n    return a + b\n\nprint(sum(1, 2))\nprint(sum("),
        Expr::lit("3, 4))"),
    ]))
    .unwrap();
    let constrained = SamplingParams {
        constraint: Some(Constraint {
            grammar: Arc::new(grammar),
            vocab: Arc::new(Vocab::from_tokenizer(&tok, false)),
        }),
        ..SamplingParams::greedy()
    };
    let reqs = vec![
        request(chat(CODE), sampled, 40),
        request(chat(CODE), constrained, 40),
    ];
    let (want, got, accepted) = both(&reqs, 2);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(g, w, "request {i}");
    }
    assert!(got[0].logprobs.iter().all(|l| l.is_some()));
    assert!(got[1].text.starts_with("def sum(a, b)"), "{}", got[1].text);
    assert!(accepted > 0);
}

#[test]
fn greedy_speculation_on_a_sliding_window_model_equals_plain_decoding() {
    let dir = std::env::temp_dir().join(format!("muser-spec-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny-q8_0-7.gguf");
    let plan = Plan::new(
        presets::preset("tiny").unwrap(),
        WeightType::from_name("q8_0").unwrap(),
        7,
        None,
    );
    plan.write_file(&path, &mut |_| {}).unwrap();
    let model = Model::load(
        &path,
        &LoadOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let model = Arc::new(model);
    let n_vocab = model.info().n_vocab;
    assert_eq!(model.info().n_swa, 32);
    // a ring of 256 cells (window 32 + batches of 32, padded), wrapped four times by 100
    // prompt tokens and 960 generated, past 1024 positions and 512 cells in view of the
    // global layers; four slots at once
    let cfg = |spec: Option<SpecConfig>| EngineConfig {
        n_slots: 4,
        n_ctx: 1088,
        prefill_chunk: 32,
        spec,
        ..Default::default()
    };
    let mut periodic = muser_model::synth::random_tokens(20, n_vocab, 5);
    periodic = periodic.iter().cycle().take(100).copied().collect();
    let prompts = [
        periodic,
        muser_model::synth::random_tokens(100, n_vocab, 6),
        muser_model::synth::random_tokens(100, n_vocab, 7),
        muser_model::synth::random_tokens(100, n_vocab, 8),
    ];
    let run = |spec: Option<SpecConfig>| {
        let e = Engine::start_without_tokenizer(model.clone(), cfg(spec)).unwrap();
        let rxs: Vec<_> = prompts
            .iter()
            .map(|p| {
                e.submit(request(p.clone(), SamplingParams::greedy(), 960))
                    .unwrap()
            })
            .collect();
        let out: Vec<Outcome> = rxs.into_iter().map(|rx| collect(rx).0).collect();
        (out, e.stats())
    };
    let (want, _) = run(None);
    // drafting whenever the drafter finds a match, as long as it finds, and the defaults
    // (as many as pay, the off-switch)
    let always = SpecConfig {
        min_acceptance: 0.0,
        adaptive: false,
        ..SpecConfig::new(SpecMode::Ngram)
    };
    for spec in [always, SpecConfig::new(SpecMode::Ngram)] {
        let (got, st) = run(Some(spec));
        assert_eq!(got, want, "{spec:?}");
        assert!(st.draft_tokens_total > 0, "{st:?}");
    }
}
