//! The engine on a real small model (SmolLM2-135M-Instruct from `MUSER_MODELS`): continuous
//! batching gives the same greedy tokens as one request at a time, cancellation and queue
//! limits behave, prompt prefixes are reused without changing the output, stop strings and
//! embeddings work end to end.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use muser_engine::{
    Engine, EngineConfig, Event, FinishReason, GenerateRequest, Progress, SamplingParams,
    SubmitError,
};
use muser_model::{LoadOptions, Model};
use muser_text::Tokenizer;
use tokio::sync::mpsc::UnboundedReceiver;

mod common;

fn loaded() -> (Arc<Model>, Arc<Tokenizer>) {
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

fn engine(n_slots: usize, queue_max: usize) -> Engine {
    let (model, tok) = loaded();
    let cfg = EngineConfig {
        n_slots,
        n_ctx: 160,
        queue_max,
        prefill_chunk: 32,
        ..Default::default()
    };
    Engine::start(model, tok, cfg).unwrap()
}

fn prompt(text: &str) -> Vec<u32> {
    let (_, tok) = loaded();
    let chat = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
    tok.encode(&chat, true, true)
}

fn greedy(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt,
        params: SamplingParams::greedy(),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

#[derive(Debug, Default)]
struct Outcome {
    ids: Vec<u32>,
    text: String,
    reason: Option<FinishReason>,
    n_prompt: usize,
    n_cached: usize,
    n_gen: usize,
    embedding: Option<Vec<f32>>,
    /// Each progress report with the tokens received before it.
    progress: Vec<(Progress, usize)>,
}

fn collect(mut rx: UnboundedReceiver<Event>) -> Outcome {
    let mut o = Outcome::default();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, text, .. } => {
                o.ids.push(id);
                o.text.push_str(&text);
            }
            Event::Embedding(e) => o.embedding = Some(e),
            Event::Done {
                reason,
                n_prompt,
                n_cached,
                n_gen,
                ..
            } => {
                o.reason = Some(reason);
                o.n_prompt = n_prompt;
                o.n_cached = n_cached;
                o.n_gen = n_gen;
                break;
            }
            Event::Error(e) => panic!("engine error: {e}"),
            Event::Progress(p) => o.progress.push((p, o.ids.len())),
        }
    }
    assert!(o.reason.is_some(), "the stream ended without Done");
    o
}

const QUESTIONS: [&str; 8] = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about rain.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "Why is the sky blue?",
    "List two fruits.",
    "Who wrote Hamlet?",
];

#[test]
fn concurrent_greedy_requests_match_sequential_runs() {
    let n = 10;
    let sequential: Vec<Vec<u32>> = {
        let e = engine(1, 8);
        QUESTIONS
            .iter()
            .map(|q| {
                let mut r = greedy(prompt(q), n);
                r.cache_prompt = false;
                collect(e.submit(r).unwrap()).ids
            })
            .collect()
    };
    let e = engine(4, 8);
    let rxs: Vec<_> = QUESTIONS
        .iter()
        .map(|q| e.submit(greedy(prompt(q), n)).unwrap())
        .collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let o = collect(rx);
        assert_eq!(o.ids, sequential[i], "request {i} ({})", QUESTIONS[i]);
        assert_eq!(o.n_gen, o.ids.len());
        assert!(matches!(
            o.reason,
            Some(FinishReason::Length | FinishReason::Eog)
        ));
    }
    let st = e.stats();
    assert_eq!(st.requests_total, 8);
    assert_eq!(st.busy_slots, 0);
    // batching: far fewer forward passes than tokens processed one request at a time
    let tokens: u64 = st.prompt_tokens_total + st.gen_tokens_total;
    assert!(st.forward_total * 2 < tokens, "{st:?}");
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn dropping_the_receiver_cancels_and_frees_the_slot() {
    let e = engine(1, 4);
    let mut rx = e
        .submit(greedy(prompt("Tell me a long story."), 120))
        .unwrap();
    // wait for the first token, then walk away
    assert!(matches!(rx.blocking_recv(), Some(Event::Token { .. })));
    drop(rx);
    wait_until("the slot to free", || e.stats().busy_slots == 0);
    let gen_after_cancel = e.stats().gen_tokens_total;
    assert!(
        gen_after_cancel < 120,
        "generation kept going: {gen_after_cancel}"
    );
    // the freed slot serves the next request
    let o = collect(e.submit(greedy(prompt("What is 2 + 2?"), 4)).unwrap());
    assert_eq!(o.n_gen, 4);
}

#[test]
fn a_full_queue_answers_queue_full() {
    let e = engine(1, 1);
    let mut rxs = Vec::new();
    let mut full = None;
    for _ in 0..4 {
        match e.submit(greedy(prompt("Count to one hundred."), 100)) {
            Ok(rx) => rxs.push(rx),
            Err(err) => {
                full = Some(err);
                break;
            }
        }
    }
    // one request runs, one waits, the next is refused
    match full {
        Some(SubmitError::QueueFull { retry_after_s }) => assert!(retry_after_s >= 1),
        other => panic!("expected QueueFull, got {other:?}"),
    }
    assert!(rxs.len() <= 2);
    drop(rxs);
}

#[test]
fn bad_requests_are_refused() {
    let e = engine(1, 2);
    assert_eq!(
        e.submit(greedy(vec![], 1)).unwrap_err(),
        SubmitError::EmptyPrompt
    );
    assert!(matches!(
        e.submit(greedy(vec![1; 160], 1)),
        Err(SubmitError::PromptTooLong {
            n_prompt: 160,
            n_ctx: 160
        })
    ));
    assert!(matches!(
        e.submit(greedy(vec![1, 10_000_000], 1)),
        Err(SubmitError::BadToken { .. })
    ));
    let mut r = greedy(vec![1, 2], 1);
    r.slot = Some(5);
    assert!(matches!(e.submit(r), Err(SubmitError::NoSuchSlot { .. })));
    let mut r = greedy(vec![1, 2], 1);
    r.params.repeat_penalty = 0.0;
    assert!(matches!(e.submit(r), Err(SubmitError::InvalidParams(_))));
}

#[test]
fn prompt_prefix_reuse_skips_cached_tokens_and_changes_nothing() {
    let first = prompt("What is the capital of France?");
    let follow_up = {
        let (_, tok) = loaded();
        let mut p = first.clone();
        p.extend(tok.encode(
            "Paris.<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
            false,
            true,
        ));
        p
    };
    let cold = {
        let e = engine(1, 2);
        let mut r = greedy(follow_up.clone(), 8);
        r.cache_prompt = false;
        collect(e.submit(r).unwrap())
    };
    assert_eq!(cold.n_cached, 0);

    let e = engine(1, 2);
    let a = collect(e.submit(greedy(first.clone(), 6)).unwrap());
    let kv_after_first = e.slots()[0].n_cached;
    assert_eq!(kv_after_first, first.len() + a.n_gen - 1);
    let warm = collect(e.submit(greedy(follow_up.clone(), 8)).unwrap());
    // the cached prompt plus the generated tokens the follow-up repeats
    let mut held = first.clone();
    held.extend(&a.ids[..a.ids.len() - 1]);
    let common = held
        .iter()
        .zip(&follow_up)
        .take_while(|(x, y)| x == y)
        .count();
    assert!(common >= first.len());
    assert_eq!(warm.n_cached, common);
    assert_eq!(warm.n_prompt, follow_up.len());
    assert_eq!(warm.ids, cold.ids);
    assert_eq!(e.stats().cached_tokens_total, common as u64);

    // the same prompt again: everything but the last token comes from the cache
    let again = collect(e.submit(greedy(follow_up.clone(), 8)).unwrap());
    assert_eq!(again.n_cached, follow_up.len() - 1);
    assert_eq!(again.ids, cold.ids);
}

#[test]
fn idle_slot_with_the_longest_shared_prefix_is_chosen() {
    let e = engine(2, 4);
    let p0 = prompt("Name three colors.");
    let p1 = prompt("Why is the sky blue?");
    // fill both slots, one prompt each
    let r0 = e.submit(greedy(p0.clone(), 2)).unwrap();
    let r1 = e.submit(greedy(p1.clone(), 2)).unwrap();
    collect(r0);
    collect(r1);
    for p in [&p1, &p0, &p1] {
        let o = collect(e.submit(greedy(p.clone(), 2)).unwrap());
        assert_eq!(o.n_cached, p.len() - 1);
    }
}

#[test]
fn stop_strings_end_generation_without_emitting_the_stop() {
    let e = engine(1, 2);
    let p = prompt("Write a haiku about rain.");
    let full = collect(e.submit(greedy(p.clone(), 16)).unwrap());
    assert!(full.text.chars().count() > 8, "{:?}", full.text);
    // a stop string from the middle of the text, likely spanning a token boundary
    let chars: Vec<char> = full.text.chars().collect();
    let start = chars.len() / 2;
    let stop: String = chars[start..start + 3].iter().collect();
    let before = &full.text[..full.text.find(&stop).unwrap()];
    let mut r = greedy(p, 16);
    r.stop = vec![stop.clone()];
    let o = collect(e.submit(r).unwrap());
    assert_eq!(o.reason, Some(FinishReason::Stop));
    assert_eq!(o.text, before, "stop {stop:?}");
}

#[test]
fn max_tokens_and_special_rendering() {
    let e = engine(1, 2);
    let o = collect(
        e.submit(greedy(prompt("Say hello in Spanish."), 3))
            .unwrap(),
    );
    assert_eq!((o.n_gen, o.reason), (3, Some(FinishReason::Length)));
    // max_tokens 0 processes the prompt and generates nothing
    let o = collect(e.submit(greedy(prompt("Say hello."), 0)).unwrap());
    assert_eq!((o.n_gen, o.reason), (0, Some(FinishReason::Length)));
    // run to the end of the turn: with `special` the end token is rendered
    let mut r = greedy(prompt("What is 2 + 2? Answer with one number."), 40);
    r.special = true;
    let o = collect(e.submit(r).unwrap());
    assert_eq!(o.reason, Some(FinishReason::Eog), "{:?}", o.text);
    assert!(o.text.ends_with("<|im_end|>"), "{:?}", o.text);
}

#[test]
fn embeddings_are_unit_length_last_token_states() {
    let (model, _) = loaded();
    let e = engine(1, 2);
    let req = |text: &str| GenerateRequest {
        prompt: prompt(text),
        embeddings: true,
        ..Default::default()
    };
    let a = collect(e.submit(req("The cat sat on the mat.")).unwrap());
    let v = a.embedding.unwrap();
    assert_eq!(v.len(), model.info().n_embd);
    let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    assert_eq!(a.n_gen, 0);
    // the same text again (from the cache) gives the same vector; another text does not
    let b = collect(e.submit(req("The cat sat on the mat.")).unwrap())
        .embedding
        .unwrap();
    let c = collect(e.submit(req("Quantum chromodynamics.")).unwrap())
        .embedding
        .unwrap();
    let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f32>();
    assert!(dot(&v, &b) > 0.999);
    assert!(dot(&v, &c) < 0.99);
}

#[test]
fn seeded_sampling_repeats_and_logprobs_are_reported() {
    let e = engine(2, 4);
    let req = || GenerateRequest {
        prompt: prompt("Write a haiku about rain."),
        params: SamplingParams {
            seed: Some(42),
            temperature: 1.0,
            n_probs: 3,
            ..Default::default()
        },
        max_tokens: Some(8),
        ..Default::default()
    };
    let mut logprobs = Vec::new();
    let mut rx = e.submit(req()).unwrap();
    let mut ids = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        if let Event::Token {
            id, logprobs: lp, ..
        } = ev
        {
            ids.push(id);
            logprobs.push(lp.unwrap());
        }
    }
    assert_eq!(collect(e.submit(req()).unwrap()).ids, ids);
    for lp in &logprobs {
        assert_eq!(lp.top.len(), 3);
        assert!(lp.top[0].logprob >= lp.top[1].logprob && lp.top[1].logprob >= lp.top[2].logprob);
        assert!(lp.token.logprob <= 0.0);
    }
}

#[test]
fn a_request_past_its_timeout_finishes_with_length() {
    let (model, tok) = loaded();
    let cfg = EngineConfig {
        n_slots: 1,
        n_ctx: 160,
        request_timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    };
    let e = Engine::start(model, tok, cfg).unwrap();
    let mut r = greedy(prompt("Count from one to one hundred."), 0);
    r.max_tokens = None; // only the context (about 130 tokens) or the clock stops it
    let t0 = Instant::now();
    let o = collect(e.submit(r).unwrap());
    assert_eq!(o.reason, Some(FinishReason::Length));
    assert!(
        o.n_gen < 100,
        "ran to {} tokens in {:?}",
        o.n_gen,
        t0.elapsed()
    );
}

/// Hostile sampling values reach the chain as numbers no stage can order or normalize
/// (`+inf + -inf` on one token, overflowing penalties and temperatures): each request still
/// finishes, and the engine serves the next one unchanged.
#[test]
fn non_finite_logits_fail_nothing_and_the_engine_serves_on() {
    let e = engine(2, 4);
    let before = collect(e.submit(greedy(prompt("What is 2 + 2?"), 6)).unwrap()).ids;
    let hostile = [
        SamplingParams {
            logit_bias: (0..64)
                .flat_map(|t| [(t * 7, f32::INFINITY), (t * 7, f32::NEG_INFINITY)])
                .collect(),
            top_k: 0,
            seed: Some(1),
            ..Default::default()
        },
        SamplingParams {
            logit_bias: vec![(5, f32::INFINITY), (6, f32::INFINITY)],
            temperature: 1e-38,
            seed: Some(2),
            n_probs: 3,
            ..Default::default()
        },
        SamplingParams {
            frequency_penalty: 3e38,
            presence_penalty: -3e38,
            repeat_penalty: 1e-30,
            top_k: 0,
            seed: Some(3),
            ..Default::default()
        },
    ];
    for params in hostile {
        let o = collect(
            e.submit(GenerateRequest {
                params,
                ..greedy(prompt("Say hello."), 4)
            })
            .unwrap(),
        );
        assert_eq!(o.n_gen, o.ids.len());
    }
    assert!(e.is_running());
    assert_eq!(
        collect(e.submit(greedy(prompt("What is 2 + 2?"), 6)).unwrap()).ids,
        before
    );
}

/// A panic in request-dependent work on the engine thread (here a slot job) fails that work
/// alone: the caller gets the message, the slot is reset, and generation goes on.
#[test]
fn a_panic_on_the_engine_thread_fails_one_job_not_the_engine() {
    let e = engine(1, 4);
    let before = collect(e.submit(greedy(prompt("Name three colors."), 5)).unwrap()).ids;
    let err = e
        .with_slot(0, |_| -> () { panic!("hostile job") })
        .unwrap_err();
    assert!(err.to_string().contains("hostile job"), "{err}");
    wait_until("the slot is reset", || e.slots()[0].n_cached == 0);
    assert!(e.is_running());
    let after = collect(e.submit(greedy(prompt("Name three colors."), 5)).unwrap());
    assert_eq!(after.ids, before);
    assert_eq!(after.n_cached, 0);
}

/// A request submitted reporting progress hears where its prefill stands: first what the
/// caches gave, then after each prefill chunk, the last at the whole prompt, all before its
/// first token. A repeated prompt starts from the prefix its slot kept; a plain submission
/// hears nothing.
#[test]
fn progress_is_reported_per_prefill_chunk_before_the_first_token() {
    let e = engine(1, 4);
    let p = prompt(&"This is a test. ".repeat(12));
    let n = p.len();
    assert!(n > 64, "{n} tokens: at least three chunks of 32");
    let run = || collect(e.submit_reporting_progress(greedy(p.clone(), 2)).unwrap());
    let first = run();
    let processed: Vec<usize> = first.progress.iter().map(|(q, _)| q.processed).collect();
    let chunks = (1..=n.div_ceil(32)).map(|k| (k * 32).min(n));
    assert_eq!(
        processed,
        std::iter::once(0).chain(chunks).collect::<Vec<_>>()
    );
    assert!(first
        .progress
        .iter()
        .all(|&(q, before)| q.total == n && q.cache == 0 && before == 0));
    let again = run();
    let (start, _) = again.progress[0];
    assert!(
        start.cache > 0 && start.processed == start.cache,
        "{start:?}"
    );
    assert_eq!(again.progress.last().unwrap().0.processed, n);
    assert_eq!(again.ids, first.ids);
    assert!(collect(e.submit(greedy(p, 2)).unwrap()).progress.is_empty());
}

#[test]
fn an_idle_engine_drops_its_model_and_the_next_requests_load_it_again() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Mutex, Weak};
    let (_, tok) = loaded();
    let loads = Arc::new(AtomicUsize::new(0));
    let failing = Arc::new(AtomicBool::new(false));
    let last: Arc<Mutex<Weak<Model>>> = Arc::default();
    let reload: muser_engine::ModelLoader = {
        let (loads, failing, last) = (loads.clone(), failing.clone(), last.clone());
        Arc::new(move || {
            if failing.load(Ordering::SeqCst) {
                return Err("the file is gone".into());
            }
            loads.fetch_add(1, Ordering::SeqCst);
            let opts = LoadOptions {
                threads: 2,
                ..Default::default()
            };
            let model =
                Arc::new(Model::load(&common::smollm_path(), &opts).map_err(|e| e.to_string())?);
            *last.lock().unwrap() = Arc::downgrade(&model);
            Ok(model)
        })
    };
    let cfg = EngineConfig {
        n_slots: 2,
        n_ctx: 160,
        prefill_chunk: 32,
        sleep: Some(muser_engine::SleepConfig {
            idle: Duration::from_millis(200),
            reload: reload.clone(),
        }),
        ..Default::default()
    };
    let e = Engine::start(reload().unwrap(), tok, cfg).unwrap();
    let want = collect(e.submit(greedy(prompt("What is 2 + 2?"), 6)).unwrap()).ids;
    wait_until("the engine to sleep", || e.is_sleeping());
    // the weights are gone, not only idle
    wait_until("the model to be dropped", || {
        last.lock().unwrap().upgrade().is_none()
    });
    // requests that arrive asleep wait for the load, then run as before
    let rxs: Vec<_> = (0..2)
        .map(|_| e.submit(greedy(prompt("What is 2 + 2?"), 6)).unwrap())
        .collect();
    assert!(!e.is_sleeping());
    for rx in rxs {
        assert_eq!(collect(rx).ids, want);
    }
    assert_eq!(loads.load(Ordering::SeqCst), 2);
    // a load that fails fails the waiting request with its reason, and the engine sleeps on
    wait_until("the engine to sleep", || e.is_sleeping());
    failing.store(true, Ordering::SeqCst);
    let mut rx = e.submit(greedy(prompt("Hi"), 2)).unwrap();
    match rx.blocking_recv() {
        Some(Event::Error(msg)) => assert!(msg.contains("the file is gone"), "{msg}"),
        other => panic!("expected the load's error, got {other:?}"),
    }
    wait_until("the engine to sleep again", || e.is_sleeping());
    failing.store(false, Ordering::SeqCst);
    // touching wakes it without a request
    e.touch();
    wait_until("the reload", || loads.load(Ordering::SeqCst) == 3);
    assert_eq!(
        collect(e.submit(greedy(prompt("What is 2 + 2?"), 6)).unwrap()).ids,
        want
    );
    assert!(e.is_running());
}
