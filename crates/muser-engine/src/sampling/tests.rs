//! The sampler's unit tests.
use super::*;

fn ids(c: &Candidates) -> Vec<u32> {
    c.data.iter().map(|c| c.id).collect()
}

fn logits_of(probs: &[f32]) -> Vec<f32> {
    probs.iter().map(|p| p.ln()).collect()
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let mut s = Sampler::new(&SamplingParams::greedy(), 64).unwrap();
    assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9]).id, 1);
    assert_eq!(s.sample(&[1.0, 5.0, 5.0, 5.0]).id, 1);
    assert_eq!(s.sample(&[f32::NAN, 0.5, 0.25]).id, 1);
    // the full chain at temperature 0 agrees with the fast path on ties
    let mut c = Candidates::from_logits(&[1.0, 5.0, 5.0, 5.0]);
    top_k(&mut c, 40);
    top_p(&mut c, 0.95, 0);
    temperature(&mut c, 0.0);
    let i = dist(&mut c, &mut Mt19937::new(1)).unwrap();
    assert_eq!(c.data[i].id, 1);
}

#[test]
fn raw_row_argmax_equals_the_candidate_argmax_on_every_row() {
    // Rows with ties, NaN and infinities (the fast greedy path against the list's).
    let mut rng = Mt19937::new(7);
    let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, 3.0];
    for n in [0usize, 1, 2, 3, 17, 1000] {
        for _ in 0..200 {
            let row: Vec<f32> = (0..n)
                .map(|_| {
                    let r = rng.next_u32();
                    match r % 8 {
                        0 => specials[(r as usize / 8) % specials.len()],
                        1 => 3.0,
                        _ => (r % 1000) as f32 / 100.0 - 5.0,
                    }
                })
                .collect();
            let slow = argmax(&Candidates::from_logits(&row).data);
            assert_eq!(argmax_logits(&row), slow, "{row:?}");
        }
    }
    assert_eq!(argmax_logits(&[f32::NAN, f32::NEG_INFINITY]), 0);
    assert_eq!(argmax_logits(&[f32::NEG_INFINITY, 2.0, f32::NAN, 2.0]), 1);
}

#[test]
fn greedy_fast_path_gives_the_full_path_tokens() {
    // A run through `sample` (fast path) and through the chain with penalties present but
    // neutral (repeat 1.0 with a window: the list path) gives the same tokens.
    let mut fast = Sampler::new(&SamplingParams::greedy(), 64).unwrap();
    let mut listed = Sampler::new(&SamplingParams::greedy(), 64).unwrap();
    listed.params.n_probs = 1;
    let mut rng = Mt19937::new(11);
    for _ in 0..50 {
        let row: Vec<f32> = (0..500).map(|_| (rng.next_u32() % 64) as f32).collect();
        let a = fast.sample(&row);
        let b = listed.sample(&row);
        assert!(a.logprobs.is_none() && b.logprobs.is_some());
        assert_eq!(a.id, b.id);
    }
}

#[test]
fn logit_bias_applies_before_everything() {
    let mut params = SamplingParams::greedy();
    params.logit_bias = vec![(1, f32::NEG_INFINITY), (2, 0.5), (99, 10.0)];
    let mut s = Sampler::new(&params, 64).unwrap();
    // 3.0 banned; 2.9 + 0.5 = 3.4 beats 3.2; id 99 is outside the vocabulary and ignored
    assert_eq!(s.sample(&[0.0, 3.0, 2.9, 3.2]).id, 2);
}

#[test]
fn repeat_penalty_divides_positive_and_multiplies_negative_logits() {
    let mut pen = Penalties::new(64, 2.0, 0.0, 0.0);
    pen.accept(0);
    pen.accept(1);
    let mut c = Candidates::from_logits(&[2.0, -1.0, 0.5]);
    pen.apply(&mut c);
    let l: Vec<f32> = c.data.iter().map(|c| c.logit).collect();
    assert_eq!(l, vec![1.0, -2.0, 0.5]);
}

#[test]
fn frequency_and_presence_penalties_count_occurrences_in_the_window() {
    let mut pen = Penalties::new(3, 1.0, 0.5, 1.0);
    for t in [2, 0, 0, 1] {
        pen.accept(t); // window of 3: token 2 falls out
    }
    let mut c = Candidates::from_logits(&[4.0, 4.0, 4.0]);
    pen.apply(&mut c);
    let l: Vec<f32> = c.data.iter().map(|c| c.logit).collect();
    // token 0: 2 occurrences -> 4 - 2*0.5 - 1 = 2; token 1: 4 - 0.5 - 1 = 2.5; token 2: gone
    assert_eq!(l, vec![2.0, 2.5, 4.0]);
}

#[test]
fn penalties_change_the_greedy_choice() {
    let mut params = SamplingParams::greedy();
    params.repeat_penalty = 1.5;
    let mut s = Sampler::new(&params, 64).unwrap();
    s.accept(0);
    // 3.0 / 1.5 = 2.0 < 2.5
    assert_eq!(s.sample(&[3.0, 2.5]).id, 1);
}

#[test]
fn top_k_keeps_the_k_best_sorted() {
    let mut c = Candidates::from_logits(&[0.1, 0.9, 0.5, 0.7, 0.9]);
    top_k(&mut c, 3);
    assert_eq!(ids(&c), vec![1, 4, 3]);
    assert!(c.sorted);
    let mut c = Candidates::from_logits(&[0.1, 0.9]);
    top_k(&mut c, 0);
    assert_eq!(ids(&c), vec![0, 1]);
}

#[test]
fn top_p_keeps_the_smallest_prefix_reaching_p() {
    let l = logits_of(&[0.2, 0.5, 0.3]);
    let mut c = Candidates::from_logits(&l);
    top_p(&mut c, 0.75, 0);
    assert_eq!(ids(&c), vec![1, 2]); // 0.5 + 0.3 = 0.8 >= 0.75
    let mut c = Candidates::from_logits(&l);
    top_p(&mut c, 0.45, 0);
    assert_eq!(ids(&c), vec![1]);
    let mut c = Candidates::from_logits(&l);
    top_p(&mut c, 0.45, 2);
    assert_eq!(ids(&c), vec![1, 2]); // min_keep
    let mut c = Candidates::from_logits(&l);
    top_p(&mut c, 0.85, 0);
    assert_eq!(ids(&c), vec![1, 2, 0]);
}

#[test]
fn top_p_on_a_large_unsorted_vocabulary_widens_past_the_head() {
    // 2000 equal tokens: 95% of the mass needs 1900 of them, beyond the 256-token head
    let l = vec![0.0f32; 2000];
    let mut c = Candidates::from_logits(&l);
    top_p(&mut c, 0.95, 0);
    let n = c.data.len();
    assert!((1899..=1901).contains(&n), "{n}");
    assert_eq!(c.data[0].id, 0);
    // and a peaked one stops inside the head
    let mut l = vec![-10.0f32; 2000];
    l[1234] = 10.0;
    let mut c = Candidates::from_logits(&l);
    top_p(&mut c, 0.95, 0);
    assert_eq!(ids(&c), vec![1234]);
}

#[test]
fn min_p_keeps_tokens_within_a_ratio_of_the_best() {
    let l = logits_of(&[0.01, 0.5, 0.3, 0.19]);
    let mut c = Candidates::from_logits(&l);
    min_p(&mut c, 0.1, 0); // keep p >= 0.05
    assert_eq!(ids(&c), vec![1, 2, 3]);
    // sorted input takes the prefix path, min_keep honoured
    let mut c = Candidates::from_logits(&l);
    top_k(&mut c, 4);
    min_p(&mut c, 0.9, 2);
    assert_eq!(ids(&c), vec![1, 2]);
}

#[test]
fn typical_keeps_tokens_near_the_entropy_and_can_drop_the_argmax() {
    // p = [0.6, 0.38, 0.02]: entropy 0.7524; |−ln p − H| = 0.2416, 0.2152, 3.16
    let l = logits_of(&[0.6, 0.38, 0.02]);
    let mut c = Candidates::from_logits(&l);
    typical(&mut c, 0.3, 0);
    assert_eq!(ids(&c), vec![1]);
    let mut c = Candidates::from_logits(&l);
    typical(&mut c, 0.9, 0);
    assert_eq!(ids(&c), vec![1, 0]); // 0.38 + 0.6 = 0.98 > 0.9
    assert!(!c.sorted);
    // in the chain at temperature 0 the greedy pick is then token 1
    let mut params = SamplingParams::greedy();
    params.typical_p = 0.3;
    let mut s = Sampler::new(&params, 64).unwrap();
    assert_eq!(s.sample(&l).id, 1);
}

#[test]
fn temperature_scales_logits_and_zero_keeps_only_the_first_best() {
    let mut c = Candidates::from_logits(&[1.0, 2.0, -4.0]);
    temperature(&mut c, 0.5);
    let l: Vec<f32> = c.data.iter().map(|c| c.logit).collect();
    assert_eq!(l, vec![2.0, 4.0, -8.0]);
    let mut c = Candidates::from_logits(&[1.0, 2.0, 2.0]);
    temperature(&mut c, 0.0);
    let l: Vec<f32> = c.data.iter().map(|c| c.logit).collect();
    assert_eq!(l, vec![f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY]);
}

#[test]
fn dist_follows_the_probabilities() {
    let l = logits_of(&[0.25, 0.75]);
    let mut rng = Mt19937::new(7);
    let mut hits = [0u32; 2];
    for _ in 0..4000 {
        let mut c = Candidates::from_logits(&l);
        let i = dist(&mut c, &mut rng).unwrap();
        hits[c.data[i].id as usize] += 1;
        assert!((c.data[1].p - 0.75).abs() < 1e-6);
    }
    assert!((2850..=3150).contains(&hits[1]), "{hits:?}");
}

#[test]
fn dist_picks_where_the_cumulative_mass_crosses_the_draw() {
    let l = logits_of(&[0.25, 0.75]);
    let mut rng = Mt19937::new(3);
    let u = rng.clone().next_f64();
    let mut c = Candidates::from_logits(&l);
    let i = dist(&mut c, &mut rng).unwrap();
    assert_eq!(i, usize::from(u > 0.25));
}

#[test]
fn seeded_sampling_is_deterministic() {
    let params = SamplingParams {
        seed: Some(1234),
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        ..Default::default()
    };
    let logits: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 * 0.3).collect();
    let run = |params: &SamplingParams| {
        let mut s = Sampler::new(params, 64).unwrap();
        (0..32).map(|_| s.sample(&logits).id).collect::<Vec<_>>()
    };
    let a = run(&params);
    assert_eq!(a, run(&params));
    let other = SamplingParams {
        seed: Some(4321),
        ..params.clone()
    };
    assert_ne!(a, run(&other));
    // not degenerate: several distinct tokens
    let mut d = a.clone();
    d.sort();
    d.dedup();
    assert!(d.len() > 3);
}

#[test]
fn raw_logprobs_are_the_log_softmax_of_the_raw_logits() {
    let mut params = SamplingParams::greedy();
    params.n_probs = 2;
    params.logit_bias = vec![(0, 100.0)]; // bias does not enter the reported probabilities
    let mut s = Sampler::new(&params, 64).unwrap();
    let l = logits_of(&[0.25, 0.75, 0.0]);
    let out = s.sample(&l);
    assert_eq!(out.id, 0);
    let lp = out.logprobs.unwrap();
    assert!(!lp.post_sampling);
    assert!((lp.token.prob - 0.25).abs() < 1e-6);
    assert!((lp.token.logprob - 0.25f32.ln()).abs() < 1e-5);
    assert_eq!(lp.top.iter().map(|t| t.id).collect::<Vec<_>>(), vec![1, 0]);
    assert!((lp.top[0].logprob - 0.75f32.ln()).abs() < 1e-5);
    // a zero probability is reported as f32::MIN, not -inf
    let lp = raw_logprobs(&l, 2, 3);
    assert_eq!(lp.token.logprob, f32::MIN);
}

#[test]
fn post_sampling_probs_come_from_the_chain() {
    let params = SamplingParams {
        n_probs: 5,
        post_sampling_probs: true,
        top_k: 2,
        top_p: 1.0,
        min_p: 0.0,
        temperature: 1.0,
        seed: Some(1),
        ..Default::default()
    };
    let mut s = Sampler::new(&params, 64).unwrap();
    let out = s.sample(&logits_of(&[0.1, 0.6, 0.3]));
    let lp = out.logprobs.unwrap();
    assert!(lp.post_sampling);
    // top-2 renormalized: 0.6/0.9, 0.3/0.9
    assert_eq!(lp.top.len(), 2);
    assert_eq!(lp.top[0].id, 1);
    assert!((lp.top[0].prob - 2.0 / 3.0).abs() < 1e-6);
    assert!((lp.top[1].prob - 1.0 / 3.0).abs() < 1e-6);
    assert_eq!(lp.token.id, out.id);
    // greedy: one token with probability 1
    let mut s = Sampler::new(
        &SamplingParams {
            temperature: 0.0,
            ..params
        },
        64,
    )
    .unwrap();
    let lp = s.sample(&logits_of(&[0.1, 0.6, 0.3])).logprobs.unwrap();
    assert_eq!(lp.top, vec![TokenProb::new(1, 1.0)]);
}

/// A toy vocabulary: JSON-ish pieces, the last one end-of-generation.
fn toy_constraint() -> Constraint {
    use crate::constraint::Grammar;
    let words: Vec<&[u8]> = vec![
        b"hello",
        b"{",
        b"}",
        b"\"",
        b"a",
        b":",
        b" ",
        b"1",
        b"{\"a\": 1}",
        b"x",
        b"",
    ];
    let eog = words.len() as u32 - 1;
    Constraint {
        grammar: Arc::new(Grammar::json_object()),
        vocab: Arc::new(Vocab::new(&words, |i| i == eog)),
    }
}

#[test]
fn constrained_greedy_takes_the_best_allowed_token() {
    let params = SamplingParams {
        constraint: Some(toy_constraint()),
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, 64).unwrap();
    // "hello" (0) is best but not JSON; "x" (9) next; then "{" (1)
    let mut l = vec![0.0f32; 11];
    l[0] = 9.0;
    l[9] = 8.0;
    l[1] = 7.0;
    l[8] = 6.0;
    let out = s.sample(&l);
    assert_eq!(out.id, 1);
    s.accept(out.id);
    assert_eq!(s.constraint_complete(), Some(false));
    // only `"`, whitespace or `}` may follow `{`; end-of-generation may not
    l[10] = 100.0;
    let out = s.sample(&l);
    assert_eq!(
        out.id, 2,
        "the best of the allowed: the closing brace (0.0, lowest id of the tied)"
    );
    s.accept(out.id);
    assert_eq!(s.constraint_complete(), Some(true));
    assert_eq!(s.sample(&l).id, 10, "complete: end of generation");
    // masking the whole vocabulary agrees: a vocabulary larger than the probe
    let mut big = vec![b"x".as_slice(); 100];
    big.push(b"{");
    big.push(b"");
    let c = Constraint {
        grammar: Arc::new(crate::constraint::Grammar::json_object()),
        vocab: Arc::new(Vocab::new(&big, |i| i == 101)),
    };
    let mut s = Sampler::new(
        &SamplingParams {
            constraint: Some(c),
            ..SamplingParams::greedy()
        },
        64,
    )
    .unwrap();
    let mut l: Vec<f32> = (0..102).map(|i| 10.0 - i as f32 * 0.01).collect();
    l[100] = -5.0;
    assert_eq!(s.sample(&l).id, 100);
    assert_eq!(s.masked_steps(), 1);
}

#[test]
fn constrained_sampling_only_draws_allowed_tokens() {
    let params = SamplingParams {
        constraint: Some(toy_constraint()),
        seed: Some(5),
        temperature: 1.5,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        ..Default::default()
    };
    for seed in 0..20u64 {
        let mut s = Sampler::new(
            &SamplingParams {
                seed: Some(seed),
                ..params.clone()
            },
            64,
        )
        .unwrap();
        let mut m = Matcher::new(Arc::new(crate::constraint::Grammar::json_object()));
        let v = toy_constraint().vocab;
        let l = vec![0.0f32; 11];
        for _ in 0..40 {
            let id = s.sample(&l).id;
            assert!(m.allows_token(&v, id), "seed {seed}: token {id}");
            m.accept_token(&v, id);
            s.accept(id);
            if id == 10 {
                break;
            }
        }
    }
}

#[test]
fn unconstrained_sampling_is_unchanged_by_the_constraint_code() {
    // the same seeded draws as before constraints existed (the chain is shared)
    let params = SamplingParams {
        seed: Some(99),
        temperature: 0.9,
        ..Default::default()
    };
    let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 * 0.05).collect();
    let mut a = Sampler::new(&params, 64).unwrap();
    let mut rng = Mt19937::new(99);
    for _ in 0..50 {
        let mut c = Candidates::from_logits(&logits);
        top_k(&mut c, 40);
        typical(&mut c, 1.0, 0);
        top_p(&mut c, 0.95, 0);
        min_p(&mut c, 0.05, 0);
        temperature(&mut c, 0.9);
        let i = dist(&mut c, &mut rng).unwrap();
        assert_eq!(a.sample(&logits).id, c.data[i].id);
    }
}

#[test]
fn invalid_parameters_are_rejected() {
    for p in [
        SamplingParams {
            repeat_penalty: 0.0,
            ..Default::default()
        },
        SamplingParams {
            frequency_penalty: f32::INFINITY,
            ..Default::default()
        },
        SamplingParams {
            top_p: f32::NAN,
            ..Default::default()
        },
        SamplingParams {
            repeat_last_n: -2,
            ..Default::default()
        },
    ] {
        assert!(Sampler::new(&p, 64).is_err());
    }
}
