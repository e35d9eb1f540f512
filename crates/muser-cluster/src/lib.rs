//! muser-cluster: the disaggregated prefill lane's PKI and mutual-TLS transport.
//!
//! - [`pki`]: the lane's certificate authority (`muser tls init | issue | revoke`): a CA in
//!   the configuration directory, node certificates for server and client use, a signed
//!   revocation list.
//! - [`tls`]: rustls configurations that check the peer both ways: the CA, validity dates, the
//!   revocation list, and the peer's node name (a producer serves only the consumers it
//!   enrolled; a consumer talks to a producer only under the name it configured).
//! - [`enroll`]: a new node joins without secrets copied by hand: a one-time code pins the
//!   node's temporary certificate and carries a secret both sides prove they know; the
//!   node's own key is signed by the consumer's CA, and the node keeps what it was granted.
//! - [`registry`]: the consumer's enrolled nodes (`nodes.toml`, written atomically).
//! - [`supervise`]: a producer's health as a consumer sees it (healthy, degraded, down) and
//!   the backoff of its probes.
//! - [`transport`]: HTTP/2 over those connections: a producer serves an axum router to
//!   authenticated peers (the peer's name in each request's extensions); a consumer sends a
//!   request to a named producer and reads the answer's body as it streams.
//!
//! The crate moves bytes and proves who sent them; what the bytes are (kvpack packs) and
//! which wire types carry requests are the server's business.

pub mod enroll;
pub mod pki;
pub mod registry;
pub mod supervise;
pub mod tls;
pub mod transport;

pub use pki::{check_name, default_config_dir, NodeCreds, NodeKey, Pki};
pub use tls::{client_config, server_config, PeerName};
pub use transport::{serve, Endpoint, LaneClient};

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("`{0}` is not a node name (lowercase letters, digits and inner hyphens, at most 63)")]
    Name(String),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Io(String),
    #[error("certificate authority: {0}")]
    Pki(String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{0}")]
    Http(String),
    #[error("producer `{name}` did not answer within {ms} ms")]
    Timeout { name: String, ms: u64 },
}
