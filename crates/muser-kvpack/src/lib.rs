//! muser-kvpack: exact KV-cache state as authenticated, prefix-addressed packs.
//!
//! - [`KvIdentity`]: everything a KV state depends on; a restore must match it exactly.
//! - [`PrefixHasher`]: keyed hash chain over 256-token blocks, so caches address prefixes
//!   without holding the text.
//! - [`PackPlan`] / [`restore()`]: the pack format (header, manifest, SHA-256 per segment,
//!   Merkle root, HMAC seal) and its bounded, abortable, staged restore; delta packs carry
//!   only what a receiver lacks.
//! - [`PackStore`]: durable directory of immutable packs with crash-safe publication, a
//!   replay ledger, a byte budget and start-up recovery.
//! - [`ResidentCache`]: in-memory radix of reference-counted blocks.
//! - [`StreamRestore`]: the same checks on a pack arriving as a byte stream, segment by
//!   segment into a staging state, for packs sent over the network.
//!
//! The crate knows no model: the engine converts its KV snapshot to [`KvState`].
//! docs/kvpack.md describes the format and the threat model.

mod codec;
pub mod error;
pub mod identity;
pub mod keys;
pub mod ledger;
pub mod pack;
mod par;
pub mod prefix;
pub mod radix;
pub mod restore;
pub mod state;
pub mod store;
pub mod stream;

pub use error::{KvpackError, Region, Result};
pub use identity::{
    field_digest, CellLayout, Digest32, FileStamp, IdentityField, KvDtype, KvIdentity, KvLayoutAbi,
    WeightsHasher,
};
pub use keys::{parse_operator_key, Keys};
pub use ledger::Ledger;
pub use pack::{
    merkle_root, open_pack, Manifest, PackKind, PackPlan, PackSource, PackSpec, ReadLimits,
    SegmentDesc, SegmentPlan,
};
pub use par::default_threads;
pub use prefix::{BlockId, PrefixChain, PrefixHasher, BLOCK_TOKENS};
pub use radix::{BlockRows, ResidentBlock, ResidentCache, ResidentHit};
pub use restore::{apply_delta, restore, verify_pack, Expect, RestoreControl, Restored};
pub use state::{KvState, LayerKv};
pub use store::{PackStore, PackTicket, RecoveryReport, StagedPack, Stager, StoreConfig, StoreHit};
pub use stream::{Assembly, StreamRestore};
