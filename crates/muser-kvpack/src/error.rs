//! The one error type of the crate. Every rejection names what failed.

use crate::identity::IdentityField;

/// Where in a pack a structural problem was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    Header,
    Manifest,
    Seal,
    Segments,
}

impl std::fmt::Display for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Region::Header => "header",
            Region::Manifest => "manifest",
            Region::Seal => "seal",
            Region::Segments => "segments",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KvpackError {
    #[error("pack truncated: the {region} needs {needed} bytes, the file has {available}")]
    Truncated {
        region: Region,
        needed: u64,
        available: u64,
    },
    #[error("pack length {actual} differs from the {declared} bytes the header declares")]
    LengthMismatch { declared: u64, actual: u64 },
    #[error("not a kvpack file (bad magic)")]
    BadMagic,
    #[error("unsupported kvpack version {0} (this build reads version 1)")]
    UnsupportedVersion(u32),
    #[error("header digest mismatch: the header was altered")]
    HeaderDigest,
    #[error("invalid header field `{0}`")]
    HeaderField(&'static str),
    #[error("{what} declares {declared}, above the limit {limit}")]
    TooLarge {
        what: &'static str,
        declared: u64,
        limit: u64,
    },
    #[error("manifest digest mismatch: the manifest was altered")]
    ManifestDigest,
    #[error("seal (HMAC-SHA256) mismatch: wrong operator key or tampered pack")]
    SealMismatch,
    #[error("malformed {region}: {reason}")]
    Malformed {
        region: Region,
        reason: &'static str,
    },
    #[error("identity mismatch: field `{0}` differs")]
    IdentityMismatch(IdentityField),
    #[error("Merkle root over the segment digests does not match the manifest")]
    MerkleMismatch,
    #[error("segment {index} digest mismatch")]
    SegmentDigest { index: u32 },
    #[error("pack covers a different token prefix than requested")]
    PrefixMismatch,
    #[error("generation {generation} replayed or stale (high-water mark {high_water})")]
    Replayed { generation: u64, high_water: u64 },
    #[error("generation {generation} was never admitted by the replay ledger")]
    NotAdmitted { generation: u64 },
    #[error("restore cancelled")]
    Cancelled,
    #[error("restore deadline exceeded")]
    DeadlineExceeded,
    #[error("restore needs {needed} bytes, budget is {budget}")]
    OverBudget { needed: u64, budget: u64 },
    #[error("invalid KV state: {0}")]
    InvalidState(String),
    #[error("delta does not apply: {0}")]
    DeltaBase(&'static str),
    #[error("replay ledger is corrupt: {0}")]
    LedgerCorrupt(&'static str),
    #[error("no such pack in the store")]
    NotFound,
    #[error("the store at {0} is in use by another process (it holds the store's lock)")]
    StoreBusy(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = KvpackError> = std::result::Result<T, E>;

/// Wraps an I/O error with what was being done.
pub(crate) fn io_ctx(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> KvpackError {
    let context = context.into();
    move |source| KvpackError::Io { context, source }
}
