//! Prefix addressing: a keyed hash chain over fixed 256-token blocks.
//!
//! `root = H(key, "root" ‖ identity digest)`, `block[i] = H(key, "block" ‖ block[i-1] ‖ i ‖
//! tokens of block i)` with `block[-1] = root`. A prefix whose length is not a multiple of 256
//! ends with a tail id `H(key, "tail" ‖ last block ‖ n ‖ tail tokens)`. The id of the last
//! block (or the tail) is the prefix's *cut id*: it names the exact token sequence and the
//! identity, and reveals neither without the key. Stores and caches index cut ids and
//! block ids only; the tokens stay with the caller.

use crate::identity::Digest32;
use crate::keys::Keys;

/// Tokens per prefix block.
pub const BLOCK_TOKENS: u32 = 256;

/// A node of the prefix chain.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub [u8; 32]);

impl BlockId {
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl std::fmt::Debug for BlockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockId({}…)", &self.to_hex()[..12])
    }
}

/// Computes prefix chains for one identity.
#[derive(Clone)]
pub struct PrefixHasher {
    key: [u8; 32],
    root: BlockId,
}

impl PrefixHasher {
    pub fn new(keys: &Keys, identity_digest: &Digest32) -> PrefixHasher {
        let key = keys.prefix;
        let mut h = blake3::Hasher::new_keyed(&key);
        h.update(b"root");
        h.update(identity_digest);
        PrefixHasher {
            key,
            root: BlockId(*h.finalize().as_bytes()),
        }
    }

    pub fn root(&self) -> BlockId {
        self.root
    }

    fn block(&self, parent: &BlockId, index: u32, tokens: &[u32]) -> BlockId {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(b"block");
        h.update(&parent.0);
        h.update(&index.to_le_bytes());
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        BlockId(*h.finalize().as_bytes())
    }

    fn tail(&self, parent: &BlockId, tokens: &[u32]) -> BlockId {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(b"tail");
        h.update(&parent.0);
        h.update(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        BlockId(*h.finalize().as_bytes())
    }

    /// The chain of `tokens`: one id per full block, and cut ids on demand.
    pub fn chain(&self, tokens: &[u32]) -> PrefixChain {
        let mut blocks = Vec::with_capacity(tokens.len() / BLOCK_TOKENS as usize);
        let mut parent = self.root;
        for (i, b) in tokens.chunks_exact(BLOCK_TOKENS as usize).enumerate() {
            parent = self.block(&parent, i as u32, b);
            blocks.push(parent);
        }
        PrefixChain {
            hasher: self.clone(),
            tokens: tokens.to_vec(),
            blocks,
        }
    }
}

/// The block ids of one token sequence. Holds the tokens so that cut ids of any length can
/// be computed; only ids ever leave it.
#[derive(Clone)]
pub struct PrefixChain {
    hasher: PrefixHasher,
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
}

impl PrefixChain {
    pub fn n_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// Ids of the full blocks, in order.
    pub fn block_ids(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Tokens of the longest block prefix shared with `held` (the block ids a receiver
    /// reports), capped below `end` so that a delta up to `end` has something to carry: the
    /// `base_tokens` of a delta pack for that receiver, or 0 when a full pack is needed.
    pub fn delta_base(&self, held: &[BlockId], end: u32) -> u32 {
        let shared = self
            .blocks
            .iter()
            .zip(held)
            .take_while(|(a, b)| a == b)
            .count() as u32;
        let below_end = end.saturating_sub(1) / BLOCK_TOKENS;
        shared.min(below_end) * BLOCK_TOKENS
    }

    /// Id of the prefix of length `len` (1..=n_tokens), or `None` when out of range.
    pub fn cut_id(&self, len: u32) -> Option<BlockId> {
        if len == 0 || len > self.n_tokens() {
            return None;
        }
        let full = (len / BLOCK_TOKENS) as usize;
        let tail = len % BLOCK_TOKENS;
        let parent = if full == 0 {
            self.hasher.root
        } else {
            self.blocks[full - 1]
        };
        if tail == 0 {
            Some(parent)
        } else {
            let start = full * BLOCK_TOKENS as usize;
            Some(self.hasher.tail(&parent, &self.tokens[start..len as usize]))
        }
    }
}
