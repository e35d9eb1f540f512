//! Token sampling in llama.cpp's default chain order.
//!
//! The chain (llama.cpp b11434 `common_sampler_init` with default `samplers`) is:
//!
//! ```text
//! logit bias -> penalties -> [dry: off] -> [top_n_sigma: off] -> top_k -> typical -> top_p
//!            -> min_p -> [xtc: off] -> temperature -> dist
//! ```
//!
//! Each stage is a function over [`Candidates`] with llama.cpp's semantics (which tokens
//! survive, in which order they are summed). A temperature `<= 0` keeps only the candidate with
//! the highest logit, the first one in candidate order on a tie, which for the default chain is
//! the lowest token id: greedy decoding is an exact argmax.
//!
//! Ties between equal logits are broken by token id everywhere (llama.cpp leaves their order to
//! `std::partial_sort`), so a run is fully determined by its logits and seed. The `dist` stage
//! draws from the same MT19937 stream as llama.cpp's, seeded with the low 32 bits of the seed.

use std::cmp::Ordering;
use std::collections::{HashMap, VecDeque};

use crate::constraint::{Constraint, Matcher, Vocab};
use crate::rng::Mt19937;
use std::sync::Arc;

/// Sampling settings of one request. `Default` gives llama.cpp's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// `<= 0` samples greedily.
    pub temperature: f32,
    /// `<= 0` keeps the whole vocabulary.
    pub top_k: i32,
    /// `1.0` disables.
    pub top_p: f32,
    /// `0.0` disables.
    pub min_p: f32,
    /// `1.0` disables.
    pub typical_p: f32,
    /// `1.0` disables.
    pub repeat_penalty: f32,
    /// Tokens (prompt and generated) the penalties look back over; `0` disables, `-1` means
    /// the whole context.
    pub repeat_last_n: i32,
    /// `0.0` disables.
    pub presence_penalty: f32,
    /// `0.0` disables.
    pub frequency_penalty: f32,
    /// Added to the raw logits before anything else; `f32::NEG_INFINITY` bans a token. Ids
    /// outside the vocabulary are ignored, as llama.cpp does.
    pub logit_bias: Vec<(u32, f32)>,
    /// `None` draws a fresh seed. Only the low 32 bits are used (llama.cpp seeds are 32-bit).
    pub seed: Option<u64>,
    /// Report this many most likely tokens with each sampled token (0: no log-probabilities).
    pub n_probs: usize,
    /// The filtering stages keep at least this many candidates (0: no minimum).
    pub min_keep: usize,
    /// Report probabilities after the sampling chain instead of the softmax of the raw
    /// logits (llama.cpp server's `post_sampling_probs`; off by default).
    pub post_sampling_probs: bool,
    /// Only tokens that keep the output a valid prefix of this grammar may be sampled, and
    /// end-of-generation only once it is complete (`None`: unconstrained).
    pub constraint: Option<Constraint>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            n_probs: 0,
            min_keep: 0,
            post_sampling_probs: false,
            constraint: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0, everything else default.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Checks the values llama.cpp rejects, plus non-finite filters.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |what: &str| Err(SamplingError::InvalidParam(what.to_string()));
        if !self.repeat_penalty.is_finite()
            || self.repeat_penalty <= 0.0
            || !(1.0 / self.repeat_penalty).is_finite()
        {
            return bad("repeat_penalty must be finite and greater than 0");
        }
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty must be finite");
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty must be finite");
        }
        if self.repeat_last_n < -1 {
            return bad("repeat_last_n must be -1, 0 or positive");
        }
        for (name, v) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("typical_p", self.typical_p),
        ] {
            if v.is_nan() {
                return Err(SamplingError::InvalidParam(format!("{name} is NaN")));
            }
        }
        if self.logit_bias.iter().any(|(_, b)| b.is_nan()) {
            return bad("logit_bias values must not be NaN");
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("invalid sampling parameter: {0}")]
    InvalidParam(String),
}

/// One token with its probability; `logprob` is `ln(prob)`, or `f32::MIN` when `prob` is 0
/// (llama.cpp server's convention, which keeps the value representable in JSON).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenProb {
    pub id: u32,
    pub prob: f32,
    pub logprob: f32,
}

impl TokenProb {
    fn new(id: u32, prob: f32) -> Self {
        let logprob = if prob == 0.0 { f32::MIN } else { prob.ln() };
        TokenProb { id, prob, logprob }
    }
}

/// Probabilities reported with a sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The sampled token.
    pub token: TokenProb,
    /// The `n_probs` most likely tokens, most likely first.
    pub top: Vec<TokenProb>,
    /// Whether these are post-chain probabilities (else softmax of the raw logits).
    pub post_sampling: bool,
}

/// The result of one sampling step.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub id: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// One candidate token: its (possibly modified) logit and its probability once a stage has
/// computed one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub id: u32,
    pub logit: f32,
    pub p: f32,
}

/// The candidate list every stage reads and narrows; `sorted` means by logit, descending.
#[derive(Clone, Debug, Default)]
pub struct Candidates {
    pub data: Vec<Candidate>,
    pub sorted: bool,
}

/// A logit as every stage keeps it: NaN (`inf - inf` from a bias, `0 * inf` from a
/// penalty) becomes -inf and +inf the largest finite value, so the comparisons below are a
/// total order and a softmax never divides infinities.
fn clean(l: f32) -> f32 {
    if l.is_nan() {
        f32::NEG_INFINITY
    } else {
        l.min(f32::MAX)
    }
}

/// Descending logit, then ascending id: a total order (every stage writes logits through
/// [`clean`]).
fn by_logit_desc(a: &Candidate, b: &Candidate) -> Ordering {
    if a.logit > b.logit {
        Ordering::Less
    } else if a.logit < b.logit {
        Ordering::Greater
    } else {
        a.id.cmp(&b.id)
    }
}

impl Candidates {
    /// All tokens of a logits row, in id order. NaN logits become -inf.
    pub fn from_logits(logits: &[f32]) -> Self {
        let mut c = Candidates::default();
        c.fill(logits);
        c
    }

    fn fill(&mut self, logits: &[f32]) {
        self.data.clear();
        self.data
            .extend(logits.iter().enumerate().map(|(i, &l)| Candidate {
                id: i as u32,
                logit: clean(l),
                p: 0.0,
            }));
        self.sorted = false;
    }

    /// Sorts the `k` best candidates to the front (descending logit) and drops the rest.
    fn truncate_sorted(&mut self, k: usize) {
        let k = k.min(self.data.len());
        if k == 0 {
            self.data.clear();
        } else if !self.sorted {
            if k < self.data.len() {
                self.data.select_nth_unstable_by(k - 1, by_logit_desc);
                self.data.truncate(k);
            }
            self.data.sort_unstable_by(by_logit_desc);
        } else {
            self.data.truncate(k);
        }
        self.sorted = true;
    }

    fn sort(&mut self) {
        let n = self.data.len();
        self.truncate_sorted(n);
    }

    fn max_logit(&self) -> f32 {
        if self.sorted {
            return self.data.first().map_or(f32::NEG_INFINITY, |c| c.logit);
        }
        self.data.iter().fold(
            f32::NEG_INFINITY,
            |m, c| if c.logit > m { c.logit } else { m },
        )
    }

    /// `p = softmax(logit)` over the current candidates, f32 sums in candidate order.
    fn softmax(&mut self) {
        let max = self.max_logit();
        let mut sum = 0.0f32;
        for c in &mut self.data {
            c.p = (c.logit - max).exp();
            sum += c.p;
        }
        for c in &mut self.data {
            c.p /= sum;
        }
    }
}

/// Adds each bias to its token's logit (unknown ids are ignored).
pub fn apply_logit_bias(cands: &mut Candidates, bias: &[(u32, f32)]) {
    for &(id, b) in bias {
        // the candidate list is still in id order when the bias applies
        if let Some(c) = cands.data.get_mut(id as usize) {
            debug_assert_eq!(c.id, id);
            c.logit = clean(c.logit + b);
        }
    }
}

/// Repetition, frequency and presence penalties over a window of recent tokens.
#[derive(Clone, Debug)]
pub struct Penalties {
    window: usize,
    repeat: f32,
    frequency: f32,
    presence: f32,
    history: VecDeque<u32>,
    counts: HashMap<u32, u32>,
}

impl Penalties {
    pub fn new(window: usize, repeat: f32, frequency: f32, presence: f32) -> Self {
        Penalties {
            window,
            repeat,
            frequency,
            presence,
            history: VecDeque::with_capacity(window.min(1 << 16)),
            counts: HashMap::new(),
        }
    }

    /// Whether [`Penalties::apply`] would change nothing now.
    pub fn is_noop(&self) -> bool {
        self.disabled() || self.counts.is_empty()
    }

    fn disabled(&self) -> bool {
        self.window == 0 || (self.repeat == 1.0 && self.frequency == 0.0 && self.presence == 0.0)
    }

    /// Records a token (of the prompt or of the output) in the window.
    pub fn accept(&mut self, id: u32) {
        if self.window == 0 {
            return;
        }
        *self.counts.entry(id).or_insert(0) += 1;
        if self.history.len() >= self.window {
            if let Some(old) = self.history.pop_front() {
                if let Some(n) = self.counts.get_mut(&old) {
                    *n -= 1;
                    if *n == 0 {
                        self.counts.remove(&old);
                    }
                }
            }
        }
        self.history.push_back(id);
    }

    /// A positive logit is divided by the repeat penalty and a non-positive one multiplied,
    /// then `count * frequency + presence` is subtracted.
    pub fn apply(&self, cands: &mut Candidates) {
        if self.disabled() || self.counts.is_empty() {
            return;
        }
        for c in &mut cands.data {
            let Some(&count) = self.counts.get(&c.id) else {
                continue;
            };
            if c.logit <= 0.0 {
                c.logit *= self.repeat;
            } else {
                c.logit /= self.repeat;
            }
            c.logit = clean(c.logit - (count as f32 * self.frequency + self.presence));
        }
        cands.sorted = false;
    }
}

/// Keeps the `k` highest logits, sorted; `k <= 0` does nothing.
pub fn top_k(cands: &mut Candidates, k: i32) {
    if k <= 0 {
        return;
    }
    cands.truncate_sorted(k as usize);
}

/// Locally typical sampling: keeps the tokens whose surprise is closest to the entropy until
/// their mass exceeds `p`. Leaves the candidates in that order (not sorted by logit).
pub fn typical(cands: &mut Candidates, p: f32, min_keep: usize) {
    if p >= 1.0 || cands.data.is_empty() {
        return;
    }
    cands.sort();
    cands.softmax();
    let entropy: f32 = cands.data.iter().map(|c| -c.p * c.p.ln()).sum();
    let shifted: Vec<f32> = cands
        .data
        .iter()
        .map(|c| (-c.p.ln() - entropy).abs())
        .collect();
    let mut order: Vec<usize> = (0..cands.data.len()).collect();
    order.sort_by(|&a, &b| shifted[a].total_cmp(&shifted[b]));

    let mut cum = 0.0f32;
    let mut keep = order.len();
    for (i, &idx) in order.iter().enumerate() {
        cum += cands.data[idx].p;
        if cum > p && (min_keep == 0 || i + 1 >= min_keep) {
            keep = i + 1;
            break;
        }
    }
    let kept: Vec<Candidate> = order[..keep].iter().map(|&i| cands.data[i]).collect();
    cands.data = kept;
    cands.sorted = false;
}

/// Nucleus sampling: keeps the smallest prefix (by descending probability) whose mass reaches
/// `p`, and at least `min_keep` tokens.
pub fn top_p(cands: &mut Candidates, p: f32, min_keep: usize) {
    if p >= 1.0 || cands.data.is_empty() {
        return;
    }
    // probabilities over every candidate, before any sorting (as llama.cpp sums them)
    cands.softmax();
    if !cands.sorted {
        // most of the mass sits in few tokens: sort a head first and widen only if needed
        let head = 256.min(cands.data.len());
        let mut sorted_head = cands.data.clone();
        if head < sorted_head.len() {
            sorted_head.select_nth_unstable_by(head - 1, by_logit_desc);
            sorted_head.truncate(head);
        }
        sorted_head.sort_unstable_by(by_logit_desc);
        let mut cum = 0.0f32;
        for (i, c) in sorted_head.iter().enumerate() {
            cum += c.p;
            if cum >= p && i + 1 >= min_keep {
                sorted_head.truncate(i + 1);
                cands.data = sorted_head;
                cands.sorted = true;
                return;
            }
        }
        cands.sort();
    }
    let mut cum = 0.0f32;
    let mut keep = cands.data.len();
    for (i, c) in cands.data.iter().enumerate() {
        cum += c.p;
        if cum >= p && i + 1 >= min_keep {
            keep = i + 1;
            break;
        }
    }
    cands.data.truncate(keep);
}

/// Keeps the tokens whose probability is at least `p` times the best one's
/// (`logit >= max_logit + ln p`), and at least `min_keep`.
pub fn min_p(cands: &mut Candidates, p: f32, min_keep: usize) {
    if p <= 0.0 || cands.data.is_empty() {
        return;
    }
    let min_logit = cands.max_logit() + p.ln();
    if !cands.sorted {
        let n_pass = cands.data.iter().filter(|c| c.logit >= min_logit).count();
        if n_pass > 0 && n_pass >= min_keep {
            cands.data.retain(|c| c.logit >= min_logit);
            return;
        }
        cands.sort();
    }
    let mut keep = 1;
    while keep < cands.data.len() && (cands.data[keep].logit >= min_logit || keep < min_keep) {
        keep += 1;
    }
    cands.data.truncate(keep);
}

/// Divides the logits by `t`; `t <= 0` keeps only the best candidate's logit (first in
/// candidate order on a tie) and sets every other to -inf.
pub fn temperature(cands: &mut Candidates, t: f32) {
    if cands.data.is_empty() {
        return;
    }
    if t <= 0.0 {
        let mut best = 0;
        for i in 1..cands.data.len() {
            if cands.data[i].logit > cands.data[best].logit {
                cands.data[best].logit = f32::NEG_INFINITY;
                best = i;
            } else {
                cands.data[i].logit = f32::NEG_INFINITY;
            }
        }
        return;
    }
    for c in &mut cands.data {
        c.logit = clean(c.logit / t);
    }
}

/// Draws one candidate in proportion to `softmax(logit)` and returns its index; leaves the
/// normalized probabilities in `p`. Consumes exactly one uniform double per call.
pub fn dist(cands: &mut Candidates, rng: &mut Mt19937) -> Option<usize> {
    if cands.data.is_empty() {
        return None;
    }
    let u = rng.next_f64();
    if cands.data.len() == 1 {
        cands.data[0].p = 1.0;
        return Some(0);
    }
    let max = cands.max_logit();
    let mut sum = 0.0f64;
    for c in &mut cands.data {
        c.p = (c.logit - max).exp();
        sum += c.p as f64;
    }
    let target = sum * u;
    let mut run = 0.0f64;
    let mut selected = None;
    for (i, c) in cands.data.iter_mut().enumerate() {
        if selected.is_none() {
            run += c.p as f64;
            if run >= target {
                selected = Some(i);
            }
        }
        c.p = (c.p as f64 / sum) as f32;
    }
    Some(selected.unwrap_or(cands.data.len() - 1))
}

/// The `n` most likely tokens of a raw logits row (softmax over the whole row, f32), most
/// likely first, and the probability of token `id`.
pub fn raw_logprobs(logits: &[f32], id: u32, n: usize) -> TokenLogprobs {
    let mut cands = Candidates::from_logits(logits);
    cands.softmax();
    let token = TokenProb::new(id, cands.data.get(id as usize).map_or(0.0, |c| c.p));
    cands.truncate_sorted(n);
    TokenLogprobs {
        token,
        top: cands
            .data
            .iter()
            .map(|c| TokenProb::new(c.id, c.p))
            .collect(),
        post_sampling: false,
    }
}

/// A sampling chain with its state (penalty window, random stream, grammar) for one
/// generation.
pub struct Sampler {
    params: SamplingParams,
    penalties: Penalties,
    rng: Mt19937,
    cands: Candidates,
    guide: Option<Guide>,
}

/// The grammar state of a constrained generation.
struct Guide {
    matcher: Matcher,
    vocab: Arc<Vocab>,
    mask: Vec<bool>,
    /// Steps that needed the whole-vocabulary mask (the first candidate was refused).
    n_masked: u64,
}

/// How many of the best candidates a constrained greedy step checks one by one before it
/// masks the whole vocabulary.
const GREEDY_PROBE: usize = 32;

impl Sampler {
    /// `n_ctx` resolves `repeat_last_n = -1`.
    pub fn new(params: &SamplingParams, n_ctx: usize) -> Result<Self, SamplingError> {
        params.validate()?;
        let window = match params.repeat_last_n {
            -1 => n_ctx,
            n => n.max(0) as usize,
        };
        let seed = params.seed.map_or_else(Mt19937::entropy_seed, |s| s as u32);
        Ok(Sampler {
            penalties: Penalties::new(
                window,
                params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            ),
            params: params.clone(),
            rng: Mt19937::new(seed),
            cands: Candidates::default(),
            guide: params.constraint.as_ref().map(|c| Guide {
                matcher: Matcher::new(c.grammar.clone()),
                vocab: c.vocab.clone(),
                mask: Vec::new(),
                n_masked: 0,
            }),
        })
    }

    /// The constrained output is complete (`None` without a constraint).
    pub fn constraint_complete(&self) -> Option<bool> {
        self.guide.as_ref().map(|g| g.matcher.is_complete())
    }

    /// Constrained steps that had to mask the whole vocabulary.
    pub fn masked_steps(&self) -> u64 {
        self.guide.as_ref().map_or(0, |g| g.n_masked)
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token: for the penalties, and as output of the grammar.
    pub fn accept(&mut self, id: u32) {
        self.penalties.accept(id);
        if let Some(g) = &mut self.guide {
            g.matcher.accept_token(&g.vocab, id);
        }
    }

    /// Records the prompt; only its last `repeat_last_n` tokens can matter.
    pub fn accept_prompt(&mut self, prompt: &[u32]) {
        let from = prompt.len().saturating_sub(self.penalties.window);
        for &id in &prompt[from..] {
            self.penalties.accept(id);
        }
    }

    /// Whether the next token is the argmax of the raw logits row: greedy, and nothing
    /// changes the row (no grammar, logit bias or active penalties) or asks for more than the
    /// token (logprobs). Then the model may hand over the argmax instead of the row.
    pub fn plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature <= 0.0
            && p.typical_p >= 1.0
            && self.guide.is_none()
            && p.logit_bias.is_empty()
            && p.n_probs == 0
            && self.penalties.is_noop()
    }

    /// Samples the next token from one logits row. Does not `accept` it.
    ///
    /// With a constraint, the token the unconstrained chain picks is checked first; only if
    /// the grammar refuses it is the vocabulary masked and the chain run again over the
    /// allowed tokens (llama.cpp's rejection order). Greedy decoding checks the best few
    /// candidates in order before masking, which gives the same token as the argmax of the
    /// masked logits.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        if self.plain_greedy() {
            // Nothing changes the raw row: its argmax, without building the candidate list
            // (on a 200k vocabulary that list costs more than the GPU's whole output layer).
            return Sampled {
                id: argmax_logits(logits),
                logprobs: None,
            };
        }
        let p = &self.params;
        let greedy = p.temperature <= 0.0 && p.typical_p >= 1.0;
        let cands = &mut self.cands;
        cands.fill(logits);
        apply_logit_bias(cands, &p.logit_bias);
        self.penalties.apply(cands);

        let (id, post) = match &mut self.guide {
            None if greedy => {
                // top-k, top-p and min-p always keep the best token: greedy is an argmax
                let best = argmax(&cands.data);
                (best, vec![TokenProb::new(best, 1.0)])
            }
            None => chain(cands, p, &mut self.rng),
            Some(g) if greedy => {
                let best = guided_argmax(cands, g);
                (best, vec![TokenProb::new(best, 1.0)])
            }
            Some(g) => {
                let first = chain(cands, p, &mut self.rng);
                if g.matcher.allows_token(&g.vocab, first.0) {
                    first
                } else {
                    g.n_masked += 1;
                    let n = g.matcher.fill_mask(&g.vocab, &mut g.mask);
                    cands.fill(logits);
                    apply_logit_bias(cands, &p.logit_bias);
                    self.penalties.apply(cands);
                    if n == 0 {
                        // nothing fits (cannot happen with a grammar whose every prefix
                        // extends): end the generation if the model can
                        let id = g.vocab.eog_ids().first().copied().unwrap_or(first.0);
                        (id, Vec::new())
                    } else {
                        let mask = &g.mask;
                        cands
                            .data
                            .retain(|c| mask.get(c.id as usize).copied().unwrap_or(false));
                        chain(cands, p, &mut self.rng)
                    }
                }
            }
        };

        let logprobs = (p.n_probs > 0).then(|| {
            if p.post_sampling_probs {
                let token = post
                    .iter()
                    .find(|t| t.id == id)
                    .copied()
                    .unwrap_or(TokenProb::new(id, 0.0));
                TokenLogprobs {
                    token,
                    top: post.into_iter().take(p.n_probs).collect(),
                    post_sampling: true,
                }
            } else {
                raw_logprobs(logits, id, p.n_probs)
            }
        });
        Sampled { id, logprobs }
    }
}

/// The sampling chain after penalties: top-k, typical, top-p, min-p, temperature, dist.
/// Returns the token and, when post-sampling probabilities are asked for, the candidates'
/// probabilities, most likely first.
fn chain(cands: &mut Candidates, p: &SamplingParams, rng: &mut Mt19937) -> (u32, Vec<TokenProb>) {
    top_k(cands, p.top_k);
    typical(cands, p.typical_p, p.min_keep);
    top_p(cands, p.top_p, p.min_keep);
    min_p(cands, p.min_p, p.min_keep);
    temperature(cands, p.temperature);
    let i = dist(cands, rng).unwrap_or(0);
    let id = cands.data.get(i).map_or(0, |c| c.id);
    let post = if p.n_probs > 0 && p.post_sampling_probs {
        let mut by_p = cands.data.clone();
        by_p.sort_by(|a, b| b.p.total_cmp(&a.p));
        by_p.iter()
            .take_while(|c| c.p != 0.0)
            .map(|c| TokenProb::new(c.id, c.p))
            .collect()
    } else {
        Vec::new()
    };
    (id, post)
}

/// The allowed token with the highest logit (lowest id on a tie): the argmax if allowed,
/// else the best of the top [`GREEDY_PROBE`] that is, else the argmax over the mask.
fn guided_argmax(cands: &Candidates, g: &mut Guide) -> u32 {
    let best = argmax(&cands.data);
    if g.matcher.allows_token(&g.vocab, best) {
        return best;
    }
    // the best few in one pass (by_logit_desc is a total order, so the first allowed of
    // them is the best allowed overall)
    let mut top: Vec<Candidate> = Vec::with_capacity(GREEDY_PROBE + 1);
    for c in &cands.data {
        if top.len() == GREEDY_PROBE && by_logit_desc(c, &top[GREEDY_PROBE - 1]) != Ordering::Less {
            continue;
        }
        let at = top.partition_point(|t| by_logit_desc(t, c) == Ordering::Less);
        top.insert(at, *c);
        top.truncate(GREEDY_PROBE);
    }
    for c in top.iter().filter(|c| c.id != best) {
        if g.matcher.allows_token(&g.vocab, c.id) {
            return c.id;
        }
    }
    g.n_masked += 1;
    let n = g.matcher.fill_mask(&g.vocab, &mut g.mask);
    if n == 0 {
        return g.vocab.eog_ids().first().copied().unwrap_or(best);
    }
    let mut pick: Option<Candidate> = None;
    for c in &cands.data {
        if g.mask.get(c.id as usize).copied().unwrap_or(false)
            && pick.is_none_or(|b| by_logit_desc(c, &b) == Ordering::Less)
        {
            pick = Some(*c);
        }
    }
    pick.map_or(best, |c| c.id)
}

/// The id of the highest logit of a raw row (muser-model's, the rule of every greedy pick).
pub use muser_model::argmax_logits;

fn argmax(data: &[Candidate]) -> u32 {
    let mut best = 0;
    for i in 1..data.len() {
        if data[i].logit > data[best].logit {
            best = i;
        }
    }
    data.get(best).map_or(0, |c| c.id)
}

#[cfg(test)]
mod tests;
