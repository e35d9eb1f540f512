//! `/v1/sessions` request bodies.

use serde::Deserialize;
use serde_json::Value;

/// `POST /v1/sessions`: a new session from slot `slot`'s cached conversation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// 1 to 64 of `[A-Za-z0-9_-]`; default: generated.
    pub id: Option<String>,
    pub slot: usize,
    /// The conversation the slot holds (chat messages, kept as given).
    pub messages: Vec<Value>,
}

/// `PUT /v1/sessions/{id}`: the session's next revision, from the slot again.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateSession {
    pub slot: usize,
    pub messages: Vec<Value>,
    /// The revision this write replaces; another one is 409.
    pub expected_revision: u64,
}

/// `POST /v1/sessions/{id}/restore`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreSession {
    pub slot: usize,
}

/// `DELETE /v1/sessions/{id}?expected_revision=N`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteSession {
    pub expected_revision: u64,
}

/// `POST /v1/sessions/{id}/migrate`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateSession {
    /// A node of `--migrate-to` (its certificate name).
    pub to: String,
}
