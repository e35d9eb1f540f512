//! The prefill lane's requests between a consumer and a producer (over mutual TLS; see
//! `muser-cluster`). The answer to a prefill is a kvpack pack as the response body.

use serde::{Deserialize, Serialize};

/// `POST /v1/prefill`: compute the K/V of `tokens` and send it sealed, as a delta past the
/// blocks `held` names when the producer's cache shares them.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillRequest {
    pub tokens: Vec<u32>,
    /// Ids (hex) of the leading 256-token blocks of `tokens` the consumer holds.
    #[serde(default)]
    pub held: Vec<String>,
    /// The replay generation the pack must carry (above every earlier one of this stream).
    pub generation: u64,
}

/// `GET /v1/lane/status`: what a consumer routes by.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaneStatus {
    pub name: String,
    pub engine_abi: String,
    /// Prefills waiting or running now.
    pub queue_depth: u64,
    /// Prompt tokens per second of recent prefills (0 before the first).
    pub prefill_tok_s: f64,
    pub n_ctx: u64,
    /// Most prompt tokens per forward pass (0: not reported).
    #[serde(default)]
    pub prefill_chunk: u64,
}
