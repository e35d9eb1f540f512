//! muser-sessions: a conversation and its exact K/V kept as an encrypted, revisioned bundle.
//!
//! A session is a bundle file ([`bundle`]): the conversation (bytes the server chooses,
//! its messages as JSON) and a slot image (the tokens and their K/V as a sealed kvpack
//! pack, which the engine verifies again on restore), encrypted with XChaCha20-Poly1305
//! under a key derived from the operator key, its id, revision and model identity
//! authenticated as associated data. The [`SessionStore`] keeps one bundle per session with
//! revisions (a write naming an old revision is refused) and atomic writes; [`Idempotency`]
//! makes retried writes safe. This crate knows no HTTP, no JSON and no engine.

pub mod bundle;
pub mod idempotency;
pub mod store;

pub use bundle::{Contents, Header};
pub use idempotency::{Answer, Idempotency, Seen};
pub use store::{SessionStore, SessionWrite, MAX_MESSAGES_BYTES, MAX_SESSIONS};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("session {0} does not exist")]
    NotFound(String),
    #[error("session ids are 1 to 64 of A-Z a-z 0-9 _ -, got {0:?}")]
    BadId(String),
    #[error("session {id} is at revision {current:?}; this write expected {expected:?}")]
    Stale {
        id: String,
        current: Option<u64>,
        expected: Option<u64>,
    },
    #[error("the bundle does not authenticate under this server's key: it was changed, or sealed with another operator key")]
    Unauthentic,
    #[error(
        "the bundle was made for another model (weights, tokenizer, template or KV layout differ)"
    )]
    ForeignModel,
    #[error("malformed bundle: {0}")]
    Malformed(&'static str),
    #[error("{0} is larger than this server accepts")]
    TooLarge(String),
    #[error("the store holds its maximum of {0} sessions; delete one first")]
    Full(usize),
    #[error("Idempotency-Key must be 1 to 128 visible ASCII characters")]
    BadIdempotencyKey,
    #[error("this Idempotency-Key was used with a different request body")]
    IdempotencyKeyReused,
    #[error("sealing the bundle failed")]
    Seal,
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}
