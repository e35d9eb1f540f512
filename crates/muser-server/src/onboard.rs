//! Adding a node to a consumer (`muser node add`): four steps, each reported as it ends, and
//! a node recorded only when all passed.
//!
//! 1. **preflight**: the node answers over TLS pinned by the code, proves the code's secret,
//!    and speaks this protocol and muser version, under the name asked for, with a clock
//!    within [`MAX_CLOCK_SKEW_MS`] and some disk free; its device and free memory are shown.
//! 2. **model**: its model identity equals this consumer's field by field (weights digest,
//!    tokenizer, template, precision, K/V layout, context policy), and its engine ABI is this
//!    engine's or an accepted one.
//! 3. **keys**: this consumer's CA signs the node's own key; the certificate, the CA, the
//!    revocation list and the kvpack operator key go to the node with this consumer's proof.
//! 4. **handoff**: one bounded remote prefill of a fixed prompt over the lane's mutual TLS,
//!    verified, installed and decoded here, gives the greedy tokens of a local prefill.
//!
//! Then the node is written to the registry (`nodes.toml`). A failure names its step, what
//! was expected and what was found; after the keys step it revokes the node's certificate,
//! so a failed enrollment leaves nothing the lane would accept.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use muser_cluster::enroll::{pinned_client_config, random, EnrollCode, Side, PROTOCOL};
use muser_cluster::registry::{FailureLog, HandoffRecord, NodeEntry, Registry};
use muser_cluster::{Endpoint, LaneClient, NodeKey, Pki};
use muser_engine::{Event, GenerateRequest, Prefilled, SamplingParams};

use crate::enroll::{finish_parts, hello_parts, model_facts, unix_ms};
use crate::lane::{ConsumerConfig, Lane, PrefillMode};
use crate::state::SharedState;
use crate::wire::nodes::{EnrollFinish, EnrollHello, GrantWire, HelloAnswer, ModelFacts};

/// Largest clock difference accepted between the node and the consumer.
pub const MAX_CLOCK_SKEW_MS: u64 = 60_000;
/// Least free disk a node needs (its credentials and ledger).
const MIN_FREE_DISK: u64 = 16 << 20;
/// Longest an enrollment message may take, connect to answer.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the handoff may take, waiting for the node's lane included.
const HANDOFF_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest a qualification's prefill may take per prompt token, each way (a loaded CPU
/// prefills a few dozen tokens a second; an 8,000-token trial gets 800 s).
const QUALIFY_TIMEOUT_PER_TOKEN: Duration = Duration::from_millis(100);
/// Tokens the handoff decodes.
const HANDOFF_TOKENS: u32 = 8;
/// Days an enrolled node's certificate is valid.
const CERT_DAYS: i64 = 365;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Preflight,
    Model,
    Keys,
    Handoff,
    Record,
}

impl Step {
    pub fn name(self) -> &'static str {
        match self {
            Step::Preflight => "preflight",
            Step::Model => "model",
            Step::Keys => "keys",
            Step::Handoff => "handoff",
            Step::Record => "record",
        }
    }
}

/// A failed step: which, and what was expected and found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", step.name())]
pub struct StepError {
    pub step: Step,
    pub message: String,
}

fn fail(step: Step) -> impl Fn(String) -> StepError {
    move |message| StepError { step, message }
}

/// The consumer side of an enrollment.
pub struct Onboarding {
    pub app: SharedState,
    /// Holds `tls/` (the CA and this consumer's certificate), the ledger and `nodes.toml`.
    pub config_dir: PathBuf,
    /// This consumer's certificate name.
    pub consumer: String,
    /// The kvpack operator key file's contents (64 hex digits), provisioned to the node.
    pub operator_key_hex: String,
    /// Engine ABIs accepted besides this engine's own.
    pub accept_abis: Vec<String>,
}

/// The fixed handoff prompt (about 600 tokens: one 512-token chunk crosses the lane).
fn handoff_prompt(node: &str) -> String {
    let mut s = format!("Handoff check for node {node}. ");
    for i in 0..48 {
        s.push_str(&format!(
            "Line {i}: the lighthouse keeper logged {} ships and {} gulls. ",
            i * 7 + 3,
            i * 5 + 1
        ));
    }
    s
}

impl Onboarding {
    /// Runs every step for node `name` at `url` with `code`; `progress` hears each step's
    /// result. Returns the registry entry written; a failure is also kept in the node's
    /// failure log (`muser node status`).
    pub async fn add(
        &self,
        name: &str,
        url: &str,
        code: &EnrollCode,
        progress: &mut (dyn FnMut(Step, &str) + Send),
    ) -> Result<NodeEntry, StepError> {
        let result = self.steps(name, url, code, progress).await;
        if let Err(e) = &result {
            let what = format!("enroll {}", e.step.name());
            if let Err(log) = FailureLog::at(&self.config_dir, name).push(&what, &e.message) {
                tracing::warn!(node = name, error = %log, "node failure log");
            }
        }
        result
    }

    async fn steps(
        &self,
        name: &str,
        url: &str,
        code: &EnrollCode,
        progress: &mut (dyn FnMut(Step, &str) + Send),
    ) -> Result<NodeEntry, StepError> {
        let pre = fail(Step::Preflight);
        let ep = Endpoint::parse(&format!("{name}={url}")).map_err(|e| pre(e.to_string()))?;
        let registry = Registry::load(&self.config_dir).map_err(|e| pre(e.to_string()))?;
        if registry.get(name).is_some() {
            return Err(pre(format!(
                "node `{name}` is already enrolled (`muser node remove {name}` first)"
            )));
        }
        let client = LaneClient::new(pinned_client_config(code).map_err(|e| pre(e.to_string()))?);
        let nonce = hex::encode(random::<32>().map_err(|e| pre(e.to_string()))?);
        let hello = self.hello(&client, &ep, code, &nonce).await?;
        progress(Step::Preflight, &preflight_summary(&hello));

        let own = model_facts(
            &self
                .app
                .kvpack
                .as_ref()
                .ok_or_else(|| fail(Step::Model)("this server has no model identity".into()))?
                .identity,
        );
        self.verify_model(&own, &hello.facts.model)?;
        progress(
            Step::Model,
            &format!(
                "ok: weights {}, {}, engine ABI {}",
                &own.model_weights[..16],
                own.weight_precision,
                hello.facts.model.engine_abi
            ),
        );

        let pki = Pki::at(&self.config_dir);
        self.send_keys(&pki, &client, &ep, code, &hello, &nonce)
            .await?;
        progress(
            Step::Keys,
            "ok: certificate issued, operator key provisioned",
        );

        let result = self.handoff(&ep).await;
        let handoff = match result {
            Ok(h) => h,
            Err(e) => {
                rollback(&pki, name);
                return Err(e);
            }
        };
        progress(
            Step::Handoff,
            &format!(
                "ok: {} tokens prefilled remotely, {} KiB verified in {:.1} ms, tokens identical",
                handoff.tokens,
                handoff.kv_bytes >> 10,
                handoff.ms
            ),
        );

        let entry = NodeEntry {
            name: name.to_string(),
            url: url.trim_end_matches('/').to_string(),
            device: hello.facts.device.clone(),
            engine_abi: hello.facts.model.engine_abi.clone(),
            model_weights: hello.facts.model.model_weights.clone(),
            enrolled_unix: unix_ms() / 1000,
            handoff: Some(handoff),
        };
        let mut registry = Registry::load(&self.config_dir).map_err(|e| {
            rollback(&pki, name);
            fail(Step::Record)(e.to_string())
        })?;
        registry.consumer = Some(self.consumer.clone());
        registry.nodes.push(entry.clone());
        registry.save(&self.config_dir).map_err(|e| {
            rollback(&pki, name);
            fail(Step::Record)(e.to_string())
        })?;
        progress(Step::Record, "ok: healthy, in nodes.toml");
        Ok(entry)
    }

    async fn hello(
        &self,
        client: &LaneClient,
        ep: &Endpoint,
        code: &EnrollCode,
        nonce: &str,
    ) -> Result<HelloAnswer, StepError> {
        let pre = fail(Step::Preflight);
        let body = serde_json::to_vec(&EnrollHello {
            consumer: self.consumer.clone(),
            nonce: nonce.to_string(),
        })
        .map_err(|e| pre(e.to_string()))?;
        let text = exchange(client, ep, "/v1/enroll/hello", body)
            .await
            .map_err(&pre)?;
        let answer: HelloAnswer = serde_json::from_str(&text)
            .map_err(|e| pre(format!("the node's hello answer: {e}")))?;
        let json = serde_json::to_vec(&answer.facts).map_err(|e| pre(e.to_string()))?;
        let mut proof = [0u8; 32];
        let proved = hex::decode_to_slice(&answer.proof, &mut proof).is_ok()
            && code.verify(
                Side::Node,
                &hello_parts(&self.consumer, nonce, &json),
                &proof,
            );
        if !proved {
            return Err(pre(
                "the node's proof does not match the enrollment code".into()
            ));
        }
        let f = &answer.facts;
        let expect = |what: &str, want: &str, got: &str| {
            if want == got {
                Ok(())
            } else {
                Err(pre(format!("{what}: expected {want}, found {got}")))
            }
        };
        expect("node name", &ep.name, &f.node)?;
        expect(
            "enrollment protocol",
            &PROTOCOL.to_string(),
            &f.protocol.to_string(),
        )?;
        expect("muser version", env!("CARGO_PKG_VERSION"), &f.muser_version)?;
        let skew = unix_ms().abs_diff(f.time_unix_ms);
        if skew > MAX_CLOCK_SKEW_MS {
            return Err(pre(format!(
                "clock skew: expected at most {MAX_CLOCK_SKEW_MS} ms, found {skew} ms"
            )));
        }
        if f.free_disk_bytes < MIN_FREE_DISK {
            return Err(pre(format!(
                "free disk: expected at least {} MiB, found {} MiB",
                MIN_FREE_DISK >> 20,
                f.free_disk_bytes >> 20
            )));
        }
        Ok(answer)
    }

    fn verify_model(&self, own: &ModelFacts, node: &ModelFacts) -> Result<(), StepError> {
        let fields = [
            ("model_weights", &own.model_weights, &node.model_weights),
            ("tokenizer", &own.tokenizer, &node.tokenizer),
            ("chat_template", &own.chat_template, &node.chat_template),
            (
                "weight_precision",
                &own.weight_precision,
                &node.weight_precision,
            ),
            ("kv_layout", &own.kv_layout, &node.kv_layout),
            ("context_policy", &own.context_policy, &node.context_policy),
        ];
        for (field, want, got) in fields {
            if want != got {
                return Err(fail(Step::Model)(format!(
                    "{field}: expected {want}, found {got}"
                )));
            }
        }
        if node.engine_abi != own.engine_abi && !self.accept_abis.contains(&node.engine_abi) {
            return Err(fail(Step::Model)(format!(
                "engine_abi: expected {} (or one given with --accept-abi), found {}",
                own.engine_abi, node.engine_abi
            )));
        }
        Ok(())
    }

    async fn send_keys(
        &self,
        pki: &Pki,
        client: &LaneClient,
        ep: &Endpoint,
        code: &EnrollCode,
        hello: &HelloAnswer,
        nonce: &str,
    ) -> Result<(), StepError> {
        let keys = fail(Step::Keys);
        let raw = hex::decode(&hello.facts.public_key).map_err(|e| keys(e.to_string()))?;
        let node_key = NodeKey::from_raw(&raw).map_err(|e| keys(e.to_string()))?;
        let not_before = time::OffsetDateTime::now_utc() - time::Duration::minutes(1);
        let (_, cert) = pki
            .sign(&ep.name, &node_key, not_before, CERT_DAYS)
            .map_err(|e| keys(e.to_string()))?;
        // from here on a failure revokes what was just issued
        let sent = async {
            let (ca, crl) = pki.trust().map_err(|e| e.to_string())?;
            let grant = GrantWire {
                cert,
                ca,
                crl,
                kv_key: self.operator_key_hex.clone(),
                consumers: vec![self.consumer.clone()],
            };
            let grant_json = serde_json::to_vec(&grant).map_err(|e| e.to_string())?;
            let proof = code.prove(
                Side::Consumer,
                &finish_parts(
                    &ep.name,
                    &self.consumer,
                    (nonce, &hello.facts.nonce),
                    &hello.facts.public_key,
                    &grant_json,
                ),
            );
            let body = serde_json::to_vec(&EnrollFinish {
                nonce: hello.facts.nonce.clone(),
                grant,
                proof: hex::encode(proof),
            })
            .map_err(|e| e.to_string())?;
            exchange(client, ep, "/v1/enroll/finish", body).await
        };
        match sent.await {
            Ok(_) => Ok(()),
            Err(e) => {
                rollback(pki, &ep.name);
                Err(keys(e))
            }
        }
    }

    /// One remote prefill of the fixed prompt from the newly enrolled node, decoded here,
    /// against a local prefill of the same prompt.
    async fn handoff(&self, ep: &Endpoint) -> Result<HandoffRecord, StepError> {
        let hand = fail(Step::Handoff);
        let lane = self.lane_to(ep, HANDOFF_TIMEOUT).map_err(&hand)?;
        let prompt = self
            .app
            .tokenizer
            .encode(&handoff_prompt(&ep.name), true, false);
        // the node restarts its listener with the new identity: give it a moment
        let started = Instant::now();
        let trial = loop {
            match self.trial(&lane, &prompt, HANDOFF_TIMEOUT).await {
                Ok(t) => break t,
                Err(e) if started.elapsed() < Duration::from_secs(5) => {
                    tracing::debug!(error = %e, "handoff: retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(hand(e)),
            }
        };
        compare_tokens(&trial.local_tokens, &trial.remote_tokens).map_err(hand)?;
        Ok(trial.handoff)
    }

    /// A lane of this consumer to `ep` alone, every prompt prefilled there within
    /// `deadline`.
    fn lane_to(&self, ep: &Endpoint, deadline: Duration) -> Result<Lane, String> {
        let ctx = self.app.kvpack.clone().ok_or("no kvpack context")?;
        let creds = muser_cluster::enroll::node_creds(&self.config_dir, &self.consumer)
            .map_err(|e| e.to_string())?;
        let cfg = ConsumerConfig {
            mode: PrefillMode::Remote,
            producers: vec![ep.clone()],
            min_tokens: Some(0),
            deadline,
            accept_abis: self.accept_abis.clone(),
            migrate_to: Vec::new(),
        };
        Lane::open(
            &cfg,
            &creds,
            &self.config_dir,
            ctx,
            self.app.options.n_ctx,
            self.app.engine.config().prefill_chunk,
        )
    }

    /// `prompt` prefilled by the lane's producer and decoded here, then prefilled and
    /// decoded here, each decode within `timeout`.
    async fn trial(&self, lane: &Lane, prompt: &[u32], timeout: Duration) -> Result<Trial, String> {
        let app = &self.app;
        let t0 = Instant::now();
        let prefilled = lane
            .prefill(&app.engine, prompt)
            .await
            .map_err(|e| e.message)?
            .ok_or("the prompt was held locally; nothing crossed")?;
        let handoff = HandoffRecord {
            tokens: u64::from(prefilled.state.positions.end),
            kv_bytes: prefilled
                .state
                .layers
                .iter()
                .map(|l| (l.k.len() + l.v.len()) as u64)
                .sum(),
            ms: prefilled.took.as_secs_f64() * 1e3,
        };
        let (remote_tokens, first) =
            decode(app, prompt, Some(Arc::new(prefilled)), timeout).await?;
        let remote_ttft_ms = (first - t0).as_secs_f64() * 1e3;
        let t0 = Instant::now();
        let (local_tokens, first) = decode(app, prompt, None, timeout).await?;
        Ok(Trial {
            handoff,
            remote_ttft_ms,
            local_ttft_ms: (first - t0).as_secs_f64() * 1e3,
            remote_tokens,
            local_tokens,
        })
    }

    /// `reps` trials of remote against local prefill at each prompt length of `sizes`
    /// (tokens; each trial's prompt is its own, so no cache on either side serves it).
    pub async fn qualify(
        &self,
        ep: &Endpoint,
        sizes: &[usize],
        reps: u32,
    ) -> Result<Vec<(usize, Trial)>, String> {
        let largest = sizes.iter().copied().max().unwrap_or(0) as u32;
        let timeout = (QUALIFY_TIMEOUT_PER_TOKEN * largest).max(HANDOFF_TIMEOUT);
        let lane = self.lane_to(ep, timeout)?;
        let mut out = Vec::new();
        for &n in sizes {
            if n + HANDOFF_TOKENS as usize >= self.app.options.n_ctx {
                return Err(format!(
                    "{n} tokens do not fit the context of {} with the decoded tokens",
                    self.app.options.n_ctx
                ));
            }
            for rep in 0..reps {
                let prompt = self.prompt_of(&format!("qualify {} {n} {rep}", ep.name), n);
                out.push((n, self.trial(&lane, &prompt, timeout).await?));
            }
        }
        Ok(out)
    }

    /// A prompt of exactly `n` tokens starting with `head`.
    fn prompt_of(&self, head: &str, n: usize) -> Vec<u32> {
        let mut text = handoff_prompt(head);
        loop {
            let tokens = self.app.tokenizer.encode(&text, true, false);
            if tokens.len() >= n {
                return tokens[..n].to_vec();
            }
            text.push_str(&handoff_prompt(&tokens.len().to_string()));
        }
    }
}

/// One remote-against-local comparison.
pub struct Trial {
    pub handoff: HandoffRecord,
    /// From the request to the first token, remote prefill (handoff included) and local.
    pub remote_ttft_ms: f64,
    pub local_ttft_ms: f64,
    pub remote_tokens: Vec<u32>,
    pub local_tokens: Vec<u32>,
}

impl Trial {
    pub fn identical(&self) -> bool {
        compare_tokens(&self.local_tokens, &self.remote_tokens).is_ok()
    }
}

/// A node's greedy tokens against a local prefill's: equal, or the first position where
/// they part and both lists.
pub fn compare_tokens(local: &[u32], remote: &[u32]) -> Result<(), String> {
    let parted = local
        .iter()
        .zip(remote)
        .position(|(a, b)| a != b)
        .or_else(|| (local.len() != remote.len()).then(|| local.len().min(remote.len())));
    match parted {
        None => Ok(()),
        Some(at) => Err(format!(
            "tokens differ from position {at}: expected {local:?} (local prefill), found {remote:?} (the node's prefill)"
        )),
    }
}

/// Greedy tokens of `prompt` (with a producer's prefill, or computed here, the whole prompt:
/// no cached prefix) and when the first came, within `timeout`.
async fn decode(
    app: &SharedState,
    prompt: &[u32],
    prefilled: Option<Arc<Prefilled>>,
    timeout: Duration,
) -> Result<(Vec<u32>, Instant), String> {
    let mut rx = app
        .engine
        .submit(GenerateRequest {
            prompt: prompt.to_vec(),
            params: SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            max_tokens: Some(HANDOFF_TOKENS),
            cache_prompt: false,
            prefilled,
            ..Default::default()
        })
        .map_err(|e| e.to_string())?;
    let mut tokens = Vec::new();
    let mut first = None;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Err(_) => return Err("the decode did not finish in time".into()),
            Ok(Some(Event::Token { id, .. })) => {
                first.get_or_insert_with(Instant::now);
                tokens.push(id);
            }
            Ok(Some(Event::Done { .. })) => {
                return Ok((tokens, first.unwrap_or_else(Instant::now)))
            }
            Ok(Some(Event::Error(e))) => return Err(e),
            Ok(Some(_)) => {}
            Ok(None) => return Err("the engine stopped".into()),
        }
    }
}

/// One enrollment message over the pinned channel; the answer's body, or why it failed.
async fn exchange(
    client: &LaneClient,
    ep: &Endpoint,
    path: &str,
    body: Vec<u8>,
) -> Result<String, String> {
    let req = hyper::Request::post(path)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let mut resp = client
        .send(ep, req, EXCHANGE_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    let text = tokio::time::timeout(EXCHANGE_TIMEOUT, crate::lane::small_body(resp.body_mut()))
        .await
        .map_err(|_| format!("the node did not answer {path} in time"))??;
    if !resp.status().is_success() {
        let msg = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        return Err(format!(
            "the node refused ({}): {msg}",
            resp.status().as_u16()
        ));
    }
    Ok(text)
}

fn preflight_summary(h: &HelloAnswer) -> String {
    let f = &h.facts;
    format!(
        "ok: reachable, protocol {}, muser {}, device {}, {:.1} GiB memory and {:.1} GiB disk free, clock skew {} ms",
        f.protocol,
        f.muser_version,
        f.device,
        f.free_memory_bytes as f64 / (1u64 << 30) as f64,
        f.free_disk_bytes as f64 / (1u64 << 30) as f64,
        unix_ms().abs_diff(f.time_unix_ms)
    )
}

/// This consumer's certificate name (`flag`, else the registry's, else `consumer`) and its
/// certificate: the lane CA and the certificate are created on first use.
pub fn consumer_identity(
    config: &std::path::Path,
    flag: Option<String>,
) -> Result<String, muser_cluster::ClusterError> {
    let registry = Registry::load(config)?;
    let name = match (flag, registry.consumer) {
        (Some(f), Some(r)) if f != r => {
            return Err(muser_cluster::ClusterError::Config(format!(
                "this consumer enrolled its nodes as `{r}`, not `{f}`"
            )))
        }
        (f, r) => f.or(r).unwrap_or_else(|| "consumer".into()),
    };
    muser_cluster::check_name(&name)?;
    let pki = Pki::at(config);
    if !pki.dir().join("ca.key").exists() {
        pki.init()?;
        tracing::info!(dir = %pki.dir().display(), "created the lane CA");
    }
    if muser_cluster::enroll::node_creds(config, &name).is_err() {
        let now = time::OffsetDateTime::now_utc() - time::Duration::minutes(1);
        pki.issue(&name, now, CERT_DAYS)?;
        tracing::info!(consumer = %name, "issued this consumer's certificate");
    }
    Ok(name)
}

/// Revokes what a failed enrollment issued to `name` (its only certificates: a name is
/// enrolled once).
fn rollback(pki: &Pki, name: &str) {
    match pki.revoke(name) {
        Ok(n) => tracing::info!(node = name, revoked = n, "enrollment rolled back"),
        Err(e) => tracing::warn!(node = name, error = %e, "enrollment rollback"),
    }
}

#[cfg(test)]
mod tests {
    use super::compare_tokens;

    #[test]
    fn equal_tokens_pass() {
        assert_eq!(compare_tokens(&[5, 6, 7], &[5, 6, 7]), Ok(()));
        assert_eq!(compare_tokens(&[], &[]), Ok(()));
    }

    #[test]
    fn a_difference_names_its_first_position_and_both_lists() {
        let e = compare_tokens(&[5, 6, 7, 8], &[5, 6, 9, 1]).unwrap_err();
        assert!(e.contains("from position 2"), "{e}");
        assert!(e.contains("expected [5, 6, 7, 8] (local prefill)"), "{e}");
        assert!(e.contains("found [5, 6, 9, 1] (the node's prefill)"), "{e}");
        let e = compare_tokens(&[9], &[1]).unwrap_err();
        assert!(e.contains("from position 0"), "{e}");
    }

    #[test]
    fn a_shorter_list_parts_where_it_ends() {
        let e = compare_tokens(&[5, 6, 7], &[5, 6]).unwrap_err();
        assert!(e.contains("from position 2"), "{e}");
        let e = compare_tokens(&[], &[3]).unwrap_err();
        assert!(e.contains("from position 0"), "{e}");
    }
}
