//! Resident cache: KV blocks in memory, shared across requests by longest-prefix match.
//!
//! Each node is one 256-token block, keyed by its block id. Because a block id chains over
//! every earlier block (and the identity), the map of ids with parent links *is* the radix
//! tree: a node's id determines its whole path. Blocks are reference counted (`Arc`): a hit
//! pins the blocks it returns, and eviction under the byte budget takes only unpinned
//! leaves, least recently used first.
//!
//! Sliding-window layers keep only the last `n_swa` positions of a state, so a block may
//! lack those layers' rows. A hit ending at block k needs them only for the blocks inside
//! the window before k; the match is shortened until that holds.

use crate::error::{KvpackError, Result};
use crate::identity::KvLayoutAbi;
use crate::prefix::{BlockId, BLOCK_TOKENS};
use crate::state::{KvState, LayerKv};
use std::collections::HashMap;
use std::sync::Arc;

/// Rows of one layer within a block: positions `first..256` (block-relative). Full-attention
/// layers hold the whole block; a sliding-window layer may hold only the part of the block
/// that was inside the window when it was inserted (`first == 256`: none).
#[derive(Debug, Clone)]
pub struct BlockRows {
    pub first: u32,
    pub kv: LayerKv,
}

/// KV rows of one block, per layer.
#[derive(Debug)]
pub struct ResidentBlock {
    pub index: u32,
    pub layers: Vec<BlockRows>,
}

impl ResidentBlock {
    fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| (l.kv.k.len() + l.kv.v.len()) as u64)
            .sum()
    }
    /// True when every layer holds the block from block-relative position `from` on.
    fn holds_from(&self, from: u32) -> bool {
        self.layers.iter().all(|l| l.first <= from)
    }
}

struct Node {
    parent: Option<BlockId>,
    children: u32,
    block: Arc<ResidentBlock>,
    last_used: u64,
}

/// A longest-prefix hit: the pinned blocks `0..n_blocks`.
pub struct ResidentHit {
    pub blocks: Vec<Arc<ResidentBlock>>,
}

impl ResidentHit {
    pub fn n_tokens(&self) -> u32 {
        self.blocks.len() as u32 * BLOCK_TOKENS
    }

    /// The KV state of positions `0..n_tokens`.
    pub fn to_state(&self, layout: &KvLayoutAbi) -> KvState {
        let positions = 0..self.n_tokens();
        let rb = layout.row_bytes();
        let layers = (0..layout.n_layer as usize)
            .map(|l| {
                let r = layout.layer_range(l, &positions);
                let mut out = LayerKv::default();
                for b in &self.blocks {
                    let bs = b.index * BLOCK_TOKENS;
                    let (lo, hi) = (r.start.max(bs), r.end.min(bs + BLOCK_TOKENS));
                    if lo >= hi {
                        continue;
                    }
                    let rows = &b.layers[l];
                    debug_assert!(lo - bs >= rows.first, "hit checked the window");
                    let (a, z) = (
                        (lo - bs - rows.first) as usize * rb,
                        (hi - bs - rows.first) as usize * rb,
                    );
                    out.k.extend_from_slice(&rows.kv.k[a..z]);
                    out.v.extend_from_slice(&rows.kv.v[a..z]);
                }
                out
            })
            .collect();
        KvState {
            layout: layout.clone(),
            positions,
            layers,
        }
    }
}

pub struct ResidentCache {
    layout: KvLayoutAbi,
    budget_bytes: u64,
    used_bytes: u64,
    nodes: HashMap<BlockId, Node>,
    tick: u64,
}

impl ResidentCache {
    /// A cache for states of `layout` (one identity: block ids are namespaced by it).
    pub fn new(layout: KvLayoutAbi, budget_bytes: u64) -> Result<Self> {
        layout.validate()?;
        Ok(ResidentCache {
            layout,
            budget_bytes,
            used_bytes: 0,
            nodes: HashMap::new(),
            tick: 0,
        })
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Inserts the full blocks of `state` (which must start at position 0), `block_ids`
    /// being the chain of its tokens. Existing blocks are kept and completed with window
    /// rows they lacked. Evicts to the budget afterwards (never the blocks just inserted).
    pub fn insert(&mut self, state: &KvState, block_ids: &[BlockId]) -> Result<()> {
        state.validate()?;
        if state.layout != self.layout || state.positions.start != 0 {
            return Err(KvpackError::InvalidState(
                "state does not fit this cache".into(),
            ));
        }
        let n_blocks = ((state.positions.end / BLOCK_TOKENS) as usize).min(block_ids.len());
        self.tick += 1;
        let mut parent = None;
        // Held while evicting so that the blocks just inserted stay.
        let mut pinned = Vec::with_capacity(n_blocks);
        for (i, id) in block_ids[..n_blocks].iter().enumerate() {
            let pos = i as u32 * BLOCK_TOKENS..(i as u32 + 1) * BLOCK_TOKENS;
            let layers: Vec<BlockRows> = (0..self.layout.n_layer as usize)
                .map(|l| {
                    let r = state.layer_range(l);
                    let held = r.start.max(pos.start)..r.end.min(pos.end);
                    if held.is_empty() {
                        return BlockRows {
                            first: BLOCK_TOKENS,
                            kv: LayerKv::default(),
                        };
                    }
                    let (k, v) = state.rows(l, &held);
                    BlockRows {
                        first: held.start - pos.start,
                        kv: LayerKv {
                            k: k.to_vec(),
                            v: v.to_vec(),
                        },
                    }
                })
                .collect();
            match self.nodes.get_mut(id) {
                Some(node) => {
                    node.last_used = self.tick;
                    if node
                        .block
                        .layers
                        .iter()
                        .zip(&layers)
                        .any(|(o, n)| n.first < o.first)
                    {
                        let merged: Vec<BlockRows> = node
                            .block
                            .layers
                            .iter()
                            .zip(layers)
                            .map(|(o, n)| if n.first < o.first { n } else { o.clone() })
                            .collect();
                        let block = ResidentBlock {
                            index: i as u32,
                            layers: merged,
                        };
                        self.used_bytes = self.used_bytes - node.block.bytes() + block.bytes();
                        node.block = Arc::new(block);
                    }
                    pinned.push(node.block.clone());
                }
                None => {
                    let block = Arc::new(ResidentBlock {
                        index: i as u32,
                        layers,
                    });
                    self.used_bytes += block.bytes();
                    if let Some(p) = parent {
                        if let Some(pn) = self.nodes.get_mut(&p) {
                            pn.children += 1;
                        }
                    }
                    pinned.push(block.clone());
                    self.nodes.insert(
                        *id,
                        Node {
                            parent,
                            children: 0,
                            block,
                            last_used: self.tick,
                        },
                    );
                }
            }
            parent = Some(*id);
        }
        self.evict();
        drop(pinned);
        Ok(())
    }

    /// The longest cached prefix of `block_ids` of at most `max_tokens` tokens that can be
    /// restored (window rows present), with its blocks pinned.
    pub fn lookup(&mut self, block_ids: &[BlockId], max_tokens: u32) -> Option<ResidentHit> {
        let max_blocks = (max_tokens / BLOCK_TOKENS) as usize;
        let matched: Vec<Arc<ResidentBlock>> = block_ids
            .iter()
            .take(max_blocks)
            .map_while(|id| self.nodes.get(id).map(|n| n.block.clone()))
            .collect();
        let has_swa = self.layout.swa_layers.iter().any(|&s| s);
        // Every layer must hold the window before the end: from `end - n_swa` on.
        let ok = |k: usize| {
            let end = k as u32 * BLOCK_TOKENS;
            let start = if has_swa {
                end.saturating_sub(self.layout.n_swa)
            } else {
                end
            };
            (start / BLOCK_TOKENS..end / BLOCK_TOKENS)
                .all(|j| matched[j as usize].holds_from(start.saturating_sub(j * BLOCK_TOKENS)))
        };
        let k = (1..=matched.len()).rev().find(|&k| ok(k))?;
        self.tick += 1;
        for id in &block_ids[..k] {
            if let Some(n) = self.nodes.get_mut(id) {
                n.last_used = self.tick;
            }
        }
        let mut blocks = matched;
        blocks.truncate(k);
        Some(ResidentHit { blocks })
    }

    /// Evicts unpinned leaves, least recently used first, until within budget. Returns the
    /// number of blocks evicted.
    pub fn evict(&mut self) -> usize {
        let mut n = 0;
        while self.used_bytes > self.budget_bytes {
            let victim = self
                .nodes
                .iter()
                .filter(|(_, node)| node.children == 0 && Arc::strong_count(&node.block) == 1)
                .min_by_key(|(_, node)| node.last_used)
                .map(|(id, _)| *id);
            let Some(id) = victim else { break };
            let node = self.nodes.remove(&id).expect("victim exists");
            self.used_bytes -= node.block.bytes();
            if let Some(p) = node.parent.and_then(|p| self.nodes.get_mut(&p)) {
                p.children -= 1;
            }
            n += 1;
        }
        n
    }
}
