//! Node onboarding's messages: the enrollment exchange between a consumer and an enrolling
//! node (over TLS pinned by the one-time code; see `muser_cluster::enroll`).

use serde::{Deserialize, Serialize};

/// `POST /v1/enroll/hello`: the consumer introduces itself with a fresh nonce.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnrollHello {
    pub consumer: String,
    /// 32 random bytes, hex.
    pub nonce: String,
}

/// The enrolling node's answer to a hello: what preflight and model verification check,
/// its public key, and its proof of the code's secret over all of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HelloAnswer {
    pub facts: NodeFacts,
    /// The node's HMAC over the consumer's name and nonce and `facts` (hex).
    pub proof: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeFacts {
    pub node: String,
    pub protocol: u32,
    pub muser_version: String,
    pub device: String,
    pub free_memory_bytes: u64,
    pub free_disk_bytes: u64,
    pub time_unix_ms: u64,
    pub model: ModelFacts,
    /// The node's new public key (uncompressed P-256 point, hex); its private half stays
    /// on the node.
    pub public_key: String,
    /// The node's nonce, 32 random bytes, hex.
    pub nonce: String,
}

/// The model identity a kvpack pack carries (docs/kvpack.md), field by field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFacts {
    pub model_weights: String,
    pub tokenizer: String,
    pub chat_template: String,
    pub weight_precision: String,
    pub kv_layout: String,
    pub context_policy: String,
    pub engine_abi: String,
}

/// `POST /v1/enroll/finish`: what the consumer's CA grants, with the consumer's proof.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnrollFinish {
    /// The node's nonce from the hello answer.
    pub nonce: String,
    pub grant: GrantWire,
    /// The consumer's HMAC over both names and nonces, the node's key and `grant` (hex).
    pub proof: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantWire {
    /// The node's certificate, signed by the consumer's CA for the node's key.
    pub cert: String,
    pub ca: String,
    pub crl: String,
    /// The kvpack operator key, 64 hex digits.
    pub kv_key: String,
    /// The consumer names the node serves.
    pub consumers: Vec<String>,
}
