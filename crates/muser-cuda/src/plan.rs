//! The decode plan: which kernel, in which launch shape, runs each step of a decode step of the
//! fused forward, derived once from the device and the model (and at most three benchmark
//! overrides). Free of CUDA, so the choices are tested on machines without a GPU.
//!
//! What a plan holds, per layer kind (full attention, sliding window) and batch-size bucket:
//! - the GEMVs ([`gemv`]): one sequence, a Q4_K shape covering a row in one pass with two rows
//!   per warp; 2-4 sequences, the four-rows-per-warp shape with as many warps per row; 5 up to
//!   the tile threshold, the batched kernels (`gemv_*_bn`); from the threshold (8), Q4_K on
//!   int8 tensor cores (`gemv_q4k_tile_w*`). Every choice sums each row in its one-sequence
//!   order, so a sequence's tokens do not depend on the batch.
//! - the attention ([`LayerAttn`]): one kernel per layer that normalizes and rotates Q and K,
//!   stores K and V, runs flash-decoding and gates the output: per query head
//!   (`attn_decode_fused_k8`) below a position threshold, per KV group above it
//!   (on sm_90 the thread-block cluster kernels, before sm_90 the register kernel whose splits
//!   `attn_combine_gate` merges). A captured decode graph holds one variant per threshold.
//! - the norms (`norm_fused8`, or `norm_fused` for rows wider than 8192 values; eight slices
//!   per row in the decode layers) and the greedy argmax's blocks per row.

use crate::layout::{
    q4k_kernel_r2, q4k_kernel_r4, q4k_shape, q4k_shape_r4, q4k_tile, seq_gemv, WType,
    MAX_GEMV_BATCH, Q4K_SHAPE_MAX_BATCH, Q4K_TILE_MIN_BATCH, Q4K_TILE_ROWS, Q4K_TILE_SEQS,
};
use crate::CudaError;

/// Most flash-decoding splits per (head, sequence) of the per-head attention.
pub const MAX_ATTN_SPLITS: u32 = 128;

/// Most blocks the greedy argmax spreads a logits row over.
pub const MAX_ARGMAX_BLOCKS: usize = 128;

/// Benchmark overrides of the plan, from `MUSER_CUDA_TUNE` (`key=value,...`; [`Self::parse`]).
/// The defaults are the measured best (docs/benchmarks.md); nothing else is switchable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overrides {
    /// `tile=N`: smallest batch the Q4_K GEMVs run on tensor cores (65: never, the batched
    /// kernels at every batch above 4).
    pub tile_from: usize,
    /// `splits=N`: flash-decoding splits per (head, sequence) of the per-head attention (each
    /// split takes at least 64 keys, so short contexts use fewer).
    pub attn_splits: u32,
    /// `gqa=POS|off`: the position from which decode steps run the grouped attention on every
    /// layer kind that has it (None: the device's threshold; `usize::MAX`, `off`: never).
    pub grouped_from: Option<usize>,
}

impl Default for Overrides {
    fn default() -> Self {
        Overrides {
            tile_from: Q4K_TILE_MIN_BATCH,
            attn_splits: 16,
            grouped_from: None,
        }
    }
}

impl Overrides {
    /// Applies `key=value` pairs separated by commas or spaces: `tile=N`, `splits=N`,
    /// `gqa=POS|off`. Values are clamped to what the kernels take.
    pub fn parse(mut self, spec: &str) -> Result<Overrides, CudaError> {
        let bad = || {
            CudaError::Shape(format!(
                "MUSER_CUDA_TUNE '{spec}' (keys: tile=N, splits=N, gqa=POS|off)"
            ))
        };
        for kv in spec.split([',', ' ']).filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(bad)?;
            match k {
                "tile" => self.tile_from = v.parse::<usize>().map_err(|_| bad())?.max(1),
                "splits" => {
                    self.attn_splits = v
                        .parse::<u32>()
                        .map_err(|_| bad())?
                        .clamp(1, MAX_ATTN_SPLITS)
                }
                "gqa" => {
                    self.grouped_from = Some(match v {
                        "off" => usize::MAX,
                        _ => v.parse::<usize>().map_err(|_| bad())?,
                    })
                }
                _ => return Err(bad()),
            }
        }
        Ok(self)
    }
}

/// One launch of a decode GEMV over a `[rows][cols]` matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemvLaunch {
    /// Kernel name in kernels.cu.
    pub kernel: String,
    /// Grid (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory per block, bytes.
    pub smem: u32,
    /// Whether the kernel takes the batch as its last argument (the kernels for batches above
    /// [`Q4K_SHAPE_MAX_BATCH`]; the others are instantiated per batch size).
    pub takes_batch: bool,
}

/// The decode GEMV of a `ty` matrix of `rows` x `cols` for `batch` sequences (1 to
/// [`MAX_GEMV_BATCH`]), Q4_K on tensor cores from `tile_from` sequences.
pub fn gemv(ty: WType, rows: usize, cols: usize, batch: usize, tile_from: usize) -> GemvLaunch {
    let nsb = cols / 256;
    let blocks = |rows_per_block: usize| (rows.div_ceil(rows_per_block) as u32, 1, 1);
    if batch > Q4K_SHAPE_MAX_BATCH {
        // The batched kernels split a Q4_K row over as many warps as the one-sequence GEMV,
        // so each sequence gets its one-sequence sums.
        let wpr = q4k_shape(nsb).0;
        if ty == WType::Q4K && batch >= tile_from {
            if let Some(t) = q4k_tile(wpr) {
                // Sequence blocks vary fastest: a row tile's blocks run together.
                return GemvLaunch {
                    kernel: t.name,
                    grid: (
                        batch.div_ceil(Q4K_TILE_SEQS) as u32,
                        rows.div_ceil(Q4K_TILE_ROWS) as u32,
                        1,
                    ),
                    block: t.threads,
                    smem: t.smem,
                    takes_batch: true,
                };
            }
        }
        let (kernel, rows_per_block) = seq_gemv(ty, cols, wpr);
        return GemvLaunch {
            kernel,
            grid: blocks(rows_per_block),
            block: 128,
            smem: 0,
            takes_batch: true,
        };
    }
    // Rows per 4-warp block. Q4_K: two rows per warp for one sequence, four (sharing each
    // activation load) for 2-4; both split a row over the same warps, so they sum it in the
    // same order (`layout::q4k_shape_r4`).
    let (kernel, rows_per_block) = match ty {
        WType::Q4K if batch == 1 => {
            let (w, u) = q4k_shape(nsb);
            (q4k_kernel_r2(w, u, 1), 2 * 4 / w as usize)
        }
        WType::Q4K => {
            let (w, u) = q4k_shape_r4(nsb);
            (q4k_kernel_r4(w, u, batch), 4 * 4 / w as usize)
        }
        // gemv_nvfp4_b*: two rows per warp.
        WType::NvFp4 => (format!("gemv_nvfp4_b{batch}"), 8),
        _ => (format!("gemv_{}_b{batch}", ty.kernel()), 4),
    };
    GemvLaunch {
        kernel,
        grid: blocks(rows_per_block),
        block: 128,
        smem: 0,
        takes_batch: false,
    }
}

/// The layer kinds whose attention differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Attention over every earlier position.
    Full,
    /// Attention over the last `n_swa` positions.
    Sliding,
}

/// One launch of the decode attention of a layer (kernels.cu: Q/K norm, RoPE, K/V store,
/// flash-decoding, split merge, sigmoid gate, int8 activations for the output GEMV).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnLaunch {
    /// Kernel name.
    pub kernel: &'static str,
    /// Blocks along x: one per KV group (the grouped kernels) or one per query head.
    pub per_group: bool,
    /// Threads per block.
    pub block: u32,
    /// Blocks per thread-block cluster along z (0: no cluster).
    pub cluster: u32,
    /// Splits per (head or group, sequence): the grid's z.
    pub splits: u32,
    /// Fewest keys a split takes (short contexts use fewer splits).
    pub min_keys: u32,
    /// The kernel leaves split records that `attn_combine_gate` merges and gates (else it
    /// writes the gated output itself).
    pub combine: bool,
}

/// A layer kind's decode attention: the per-head kernel, and the grouped one from a position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerAttn {
    /// Below the grouped kernel's position (or everywhere without one).
    pub per_head: AttnLaunch,
    /// (first position, kernel): the grouped kernel, reading each cached key and value once
    /// per KV group instead of once per query head.
    pub grouped: Option<(usize, AttnLaunch)>,
}

/// One launch of a row norm (`norm_fused8`: 8 values per thread, one barrier per sum;
/// `norm_fused`: 16, for rows of more than 8192 values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormLaunch {
    /// Kernel name.
    pub kernel: &'static str,
    /// Threads per block (one block per row slice).
    pub block: u32,
}

/// What the plan needs of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Logits per row.
    pub n_vocab: usize,
}

/// Every choice of a decode step, derived at load ([`DecodePlan::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// Compute capability the plan is for.
    pub compute_capability: (i32, i32),
    /// The overrides in force.
    pub overrides: Overrides,
    /// The row norms (embedding, per layer, output).
    pub norm: NormLaunch,
    /// Blocks per row of the two norms inside each decode layer (each computes the row's sums
    /// and writes a slice; bit-identical for every count, 8 measured best on the H200).
    pub norm_slices: u32,
    /// Threads per block of the decode SwiGLU.
    pub swiglu_block: u32,
    /// Blocks per logits row of the greedy argmax (about 1024 logits each) and their threads.
    pub argmax: (u32, u32),
    /// The full-attention layers' decode attention.
    pub full: LayerAttn,
    /// The sliding-window layers'.
    pub sliding: LayerAttn,
}

/// The per-head decode attention: `splits` splits of at least 64 keys, eight cached keys per
/// warp per step in flight (16 splits of 8 keys measured best on the H200).
fn per_head(splits: u32) -> AttnLaunch {
    AttnLaunch {
        kernel: "attn_decode_fused_k8",
        per_group: false,
        block: 128,
        cluster: 0,
        splits: splits.clamp(1, MAX_ATTN_SPLITS),
        min_keys: 64,
        combine: false,
    }
}

/// The thread-block cluster kernels (sm_90): 16 blocks per KV group, one key range per warp,
/// merged in the launch. Full layers: blocks of 8 warps (`attn_decode_gqc16w8`: twice the key
/// ranges halve each warp's dependent tiles at depth); sliding layers: 4 warps and ranges of
/// at least 32 keys (a 2048-key window is 32 keys per warp).
fn cluster(kind: LayerKind) -> AttnLaunch {
    let (kernel, block, min_keys) = match kind {
        LayerKind::Full => ("attn_decode_gqc16w8", 256, 64),
        LayerKind::Sliding => ("attn_decode_gqc16n1", 128, 32),
    };
    AttnLaunch {
        kernel,
        per_group: true,
        block,
        cluster: 16,
        splits: 16,
        min_keys,
        combine: false,
    }
}

/// The register kernel (before sm_90): one warp per split, no shared memory, 128 splits of at
/// least 64 keys merged by `attn_combine_gate`.
fn register() -> AttnLaunch {
    AttnLaunch {
        kernel: "attn_decode_gqr",
        per_group: true,
        block: 32,
        cluster: 0,
        splits: 128,
        min_keys: 64,
        combine: true,
    }
}

impl DecodePlan {
    /// The plan for a device of compute capability `cc` and a model of geometry `g`.
    pub fn new(cc: (i32, i32), g: Geometry, o: Overrides) -> DecodePlan {
        let n = g.n_embd;
        let (kernel, vpt) = if n / 8 <= 1024 {
            ("norm_fused8", 8)
        } else {
            ("norm_fused", 16)
        };
        let argmax_blocks = g.n_vocab.div_ceil(1024).clamp(1, MAX_ARGMAX_BLOCKS) as u32;
        // The grouped kernels take up to 16 query heads per KV group.
        let groups =
            g.n_head_kv > 0 && g.n_head.is_multiple_of(g.n_head_kv) && g.n_head / g.n_head_kv <= 16;
        // From 1024 keys on sm_90 (below, the per-head kernel's shorter start wins); before
        // sm_90 (no clusters) the register kernel from 4096 on the full layers only (its
        // separate split merge costs more than it saves on the sliding ones).
        let from = |device: usize| match o.grouped_from.unwrap_or(device) {
            usize::MAX => None,
            p => Some(p),
        };
        let grouped = |kind: LayerKind| -> Option<(usize, AttnLaunch)> {
            if !groups {
                return None;
            }
            if cc.0 >= 9 {
                Some((from(1024)?, cluster(kind)))
            } else if kind == LayerKind::Full {
                Some((from(4096)?, register()))
            } else {
                None
            }
        };
        DecodePlan {
            compute_capability: cc,
            overrides: o,
            norm: NormLaunch {
                kernel,
                block: (n / vpt).next_multiple_of(32) as u32,
            },
            norm_slices: 8,
            swiglu_block: 64,
            argmax: (argmax_blocks, if argmax_blocks == 1 { 1024 } else { 256 }),
            full: LayerAttn {
                per_head: per_head(o.attn_splits),
                grouped: grouped(LayerKind::Full),
            },
            sliding: LayerAttn {
                per_head: per_head(o.attn_splits),
                grouped: grouped(LayerKind::Sliding),
            },
        }
    }

    /// The attention of a `kind` layer in a decode step whose latest position is `at`.
    pub fn attention(&self, kind: LayerKind, at: usize) -> AttnLaunch {
        let l = match kind {
            LayerKind::Full => &self.full,
            LayerKind::Sliding => &self.sliding,
        };
        match l.grouped {
            Some((from, g)) if at >= from => g,
            _ => l.per_head,
        }
    }

    /// The positions from which decode steps change kernels (0 first, ascending, each inside
    /// a cache of `n_ctx` positions): a captured decode graph holds one variant per entry.
    pub fn variants(&self, n_ctx: usize) -> Vec<usize> {
        let mut v = vec![0];
        for l in [&self.full, &self.sliding] {
            if let Some((from, _)) = l.grouped {
                if from < n_ctx {
                    v.push(from);
                }
            }
        }
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The batch sizes whose GEMVs differ: 1, 2-4, 5 to the tile threshold, the rest up to
    /// [`MAX_GEMV_BATCH`] (empty ranges left out).
    pub fn buckets(&self) -> Vec<(usize, usize)> {
        let tile = self.overrides.tile_from.max(Q4K_SHAPE_MAX_BATCH + 1);
        [
            (1, 1),
            (2, Q4K_SHAPE_MAX_BATCH),
            (Q4K_SHAPE_MAX_BATCH + 1, tile - 1),
            (tile, MAX_GEMV_BATCH),
        ]
        .into_iter()
        .filter(|(a, b)| a <= b && *a <= MAX_GEMV_BATCH)
        .map(|(a, b)| (a, b.min(MAX_GEMV_BATCH)))
        .collect()
    }

    /// The plan as text, one line per layer kind and batch bucket: the norm, each GEMV of
    /// `matrices` (name, type, rows, columns) and the attention at each position variant.
    pub fn describe(&self, matrices: &[(&str, WType, usize, usize)]) -> Vec<String> {
        let (major, minor) = self.compute_capability;
        let mut lines = vec![format!(
            "decode plan for sm_{major}{minor}: norms {} x{} threads ({} slices in the layers), argmax {} blocks x{}, swiglu x{}, overrides {:?}",
            self.norm.kernel,
            self.norm.block,
            self.norm_slices,
            self.argmax.0,
            self.argmax.1,
            self.swiglu_block,
            self.overrides
        )];
        let attn = |a: &AttnLaunch| {
            format!(
                "{} ({} x{} threads{}, {} splits >= {} keys{})",
                a.kernel,
                if a.per_group { "per group" } else { "per head" },
                a.block,
                if a.cluster > 0 {
                    format!(", clusters of {}", a.cluster)
                } else {
                    String::new()
                },
                a.splits,
                a.min_keys,
                if a.combine { ", attn_combine_gate" } else { "" }
            )
        };
        for (kind, l) in [("full", &self.full), ("sliding", &self.sliding)] {
            let mut a = format!("attn {}", attn(&l.per_head));
            if let Some((from, g)) = &l.grouped {
                a.push_str(&format!(", from position {from} {}", attn(g)));
            }
            for (lo, hi) in self.buckets() {
                let gemvs: Vec<String> = matrices
                    .iter()
                    .map(|&(name, ty, rows, cols)| {
                        let g = gemv(ty, rows, cols, lo, self.overrides.tile_from);
                        format!("{name} {} {:?}x{}", g.kernel, g.grid, g.block)
                    })
                    .collect();
                lines.push(format!(
                    "{kind:<7} batch {lo:>2}-{hi:<2}: {a}; {}",
                    gemvs.join(", ")
                ));
            }
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Muse Glimmer 30B's geometry (and the 16-layer check model's: the same layers).
    const G30B: Geometry = Geometry {
        n_embd: 6656,
        n_head: 32,
        n_head_kv: 2,
        n_vocab: 202_048,
    };

    fn launch(kernel: &str, grid: (u32, u32, u32), block: u32, takes_batch: bool) -> GemvLaunch {
        GemvLaunch {
            kernel: kernel.to_string(),
            grid,
            block,
            smem: 0,
            takes_batch,
        }
    }

    /// A tiled launch: three stages of 4480 bytes per warp.
    fn tiled(kernel: &str, grid: (u32, u32, u32), block: u32, smem: u32) -> GemvLaunch {
        GemvLaunch {
            smem,
            ..launch(kernel, grid, block, true)
        }
    }

    /// The GEMVs of the 30B's matrices (qkv+gate 8704 x 6656, output projection 6656 x 4096,
    /// gate+up 39936 x 6656, down 6656 x 19968, vocabulary 202048 x 6656) per batch bucket:
    /// the kernels and launch shapes `Tuning::default()` and `DevWeight::gemv` chose before
    /// the plan (commit of this test).
    #[test]
    fn gemvs_of_the_30b_are_the_measured_defaults() {
        let q = WType::Q4K;
        let t = Q4K_TILE_MIN_BATCH;
        let cases = [
            // one sequence: two rows per warp, the one-pass shape
            (
                (8704, 6656, 1),
                launch("gemv_q4k_w1u7l1r2_b1", (1088, 1, 1), 128, false),
            ),
            (
                (6656, 4096, 1),
                launch("gemv_q4k_w1u4l1r2_b1", (832, 1, 1), 128, false),
            ),
            (
                (39936, 6656, 1),
                launch("gemv_q4k_w1u7l1r2_b1", (4992, 1, 1), 128, false),
            ),
            (
                (6656, 19968, 1),
                launch("gemv_q4k_w4u5l1r2_b1", (3328, 1, 1), 128, false),
            ),
            (
                (202_048, 6656, 1),
                launch("gemv_q4k_w1u7l1r2_b1", (25256, 1, 1), 128, false),
            ),
            // 2-4: four rows per warp, as many warps per row
            (
                (8704, 6656, 2),
                launch("gemv_q4k_w1u4l1r4_b2", (544, 1, 1), 128, false),
            ),
            (
                (6656, 4096, 3),
                launch("gemv_q4k_w1u4l1r4_b3", (416, 1, 1), 128, false),
            ),
            (
                (39936, 6656, 4),
                launch("gemv_q4k_w1u4l1r4_b4", (2496, 1, 1), 128, false),
            ),
            (
                (6656, 19968, 4),
                launch("gemv_q4k_w4u5l1r4_b4", (1664, 1, 1), 128, false),
            ),
            // 5-7: the batched kernels
            (
                (8704, 6656, 5),
                launch("gemv_q4k_w1u7_bn", (1088, 1, 1), 128, true),
            ),
            (
                (6656, 4096, 7),
                launch("gemv_q4k_w1u4_bn", (832, 1, 1), 128, true),
            ),
            (
                (6656, 19968, 6),
                launch("gemv_q4k_w4u5_bn", (3328, 1, 1), 128, true),
            ),
            // 8-64: int8 tensor cores, 8 sequences x 32 rows per block
            (
                (8704, 6656, 8),
                tiled("gemv_q4k_tile_w1", (1, 272, 1), 128, 53_760),
            ),
            (
                (39936, 6656, 64),
                tiled("gemv_q4k_tile_w1", (8, 1248, 1), 128, 53_760),
            ),
            (
                (6656, 19968, 33),
                tiled("gemv_q4k_tile_w4", (5, 208, 1), 512, 215_040),
            ),
            (
                (202_048, 6656, 16),
                tiled("gemv_q4k_tile_w1", (2, 6314, 1), 128, 53_760),
            ),
        ];
        for ((rows, cols, batch), want) in cases {
            assert_eq!(
                gemv(q, rows, cols, batch, t),
                want,
                "{rows}x{cols} batch {batch}"
            );
        }
        // `tile=65` keeps the batched kernels at every batch; other types: a kernel per batch
        // up to 4, then the batched one
        let others = [
            ((q, 8704, 6656, 64, 65), ("gemv_q4k_w1u7_bn", 1088, true)),
            ((WType::Q6K, 512, 6656, 3, 8), ("gemv_q6k_b3", 128, false)),
            ((WType::Q6K, 512, 6656, 9, 8), ("gemv_q6k_bn", 128, true)),
            (
                (WType::NvFp4, 6656, 19968, 1, 8),
                ("gemv_nvfp4_b1", 832, false),
            ),
            (
                (WType::NvFp4, 6656, 19968, 8, 8),
                ("gemv_nvfp4_bn", 832, true),
            ),
            ((WType::F32, 100, 1024, 2, 8), ("gemv_f32_b2", 25, false)),
        ];
        for ((ty, rows, cols, batch, tile), (name, blocks, batched)) in others {
            assert_eq!(
                gemv(ty, rows, cols, batch, tile),
                launch(name, (blocks, 1, 1), 128, batched),
                "{ty:?} {rows}x{cols} batch {batch}"
            );
        }
    }

    /// The attention, norms and argmax of the 30B (and the 16-layer model) on sm_90 and before
    /// it: what `Tuning::default().fit_device(cc)` and `enqueue_decode` chose before the plan.
    #[test]
    fn attention_norms_and_argmax_of_the_30b_are_the_measured_defaults() {
        let k8 = AttnLaunch {
            kernel: "attn_decode_fused_k8",
            per_group: false,
            block: 128,
            cluster: 0,
            splits: 16,
            min_keys: 64,
            combine: false,
        };
        let h = DecodePlan::new((9, 0), G30B, Overrides::default());
        assert_eq!(
            h.norm,
            NormLaunch {
                kernel: "norm_fused8",
                block: 832
            }
        );
        assert_eq!(
            (h.norm_slices, h.swiglu_block, h.argmax),
            (8, 64, (128, 256))
        );
        let w8 = AttnLaunch {
            kernel: "attn_decode_gqc16w8",
            per_group: true,
            block: 256,
            cluster: 16,
            splits: 16,
            min_keys: 64,
            combine: false,
        };
        let n1 = AttnLaunch {
            kernel: "attn_decode_gqc16n1",
            block: 128,
            min_keys: 32,
            ..w8
        };
        assert_eq!(
            h.full,
            LayerAttn {
                per_head: k8,
                grouped: Some((1024, w8))
            }
        );
        assert_eq!(
            h.sliding,
            LayerAttn {
                per_head: k8,
                grouped: Some((1024, n1))
            }
        );
        assert_eq!(h.attention(LayerKind::Full, 1023), k8);
        assert_eq!(h.attention(LayerKind::Full, 1024), w8);
        assert_eq!(h.attention(LayerKind::Sliding, 5000), n1);
        assert_eq!(h.variants(4096), vec![0, 1024]);
        // Before sm_90: the register kernel on the full layers from 4096, merged by the combine.
        let a = DecodePlan::new((8, 0), G30B, Overrides::default());
        let gqr = AttnLaunch {
            kernel: "attn_decode_gqr",
            per_group: true,
            block: 32,
            cluster: 0,
            splits: 128,
            min_keys: 64,
            combine: true,
        };
        assert_eq!(
            a.full,
            LayerAttn {
                per_head: k8,
                grouped: Some((4096, gqr))
            }
        );
        assert_eq!(
            a.sliding,
            LayerAttn {
                per_head: k8,
                grouped: None
            }
        );
        assert_eq!(a.variants(4096), vec![0], "4096 is not inside the cache");
        assert_eq!(a.variants(10368), vec![0, 4096]);
        assert_eq!(a.norm, h.norm);
    }

    /// The small synthetic model (embd 1024, 8 heads, 2 KV heads, vocabulary 8192) and a model
    /// too wide for `norm_fused8` or with too many heads per group for the grouped kernels.
    #[test]
    fn other_geometries() {
        let small = Geometry {
            n_embd: 1024,
            n_head: 8,
            n_head_kv: 2,
            n_vocab: 8192,
        };
        let p = DecodePlan::new((9, 0), small, Overrides::default());
        assert_eq!(
            p.norm,
            NormLaunch {
                kernel: "norm_fused8",
                block: 128
            }
        );
        assert_eq!(p.argmax, (8, 256));
        assert_eq!(p.variants(1024), vec![0], "1024 is not inside the cache");
        assert_eq!(p.variants(1025), vec![0, 1024]);
        let wide = Geometry {
            n_embd: 12288,
            n_head: 64,
            n_head_kv: 2,
            n_vocab: 1000,
        };
        let p = DecodePlan::new((9, 0), wide, Overrides::default());
        assert_eq!(
            p.norm,
            NormLaunch {
                kernel: "norm_fused",
                block: 768
            }
        );
        assert_eq!(p.argmax, (1, 1024));
        assert_eq!((p.full.grouped, p.sliding.grouped), (None, None));
        assert_eq!(p.variants(8192), vec![0]);
    }

    #[test]
    fn overrides_parse_and_bad_ones_are_errors() {
        let o = Overrides::default()
            .parse("tile=65,splits=999,gqa=off")
            .unwrap();
        assert_eq!(
            (o.tile_from, o.attn_splits, o.grouped_from),
            (65, 128, Some(usize::MAX))
        );
        assert_eq!(
            Overrides::default().parse("").unwrap(),
            Overrides::default()
        );
        assert_eq!(
            Overrides::default()
                .parse("tile=0 splits=0")
                .unwrap()
                .tile_from,
            1
        );
        let p = DecodePlan::new((9, 0), G30B, Overrides::default().parse("gqa=off").unwrap());
        assert_eq!(p.variants(8192), vec![0]);
        assert_eq!(
            p.attention(LayerKind::Full, 4000).kernel,
            "attn_decode_fused_k8"
        );
        let p = DecodePlan::new(
            (9, 0),
            G30B,
            Overrides::default().parse("gqa=0,splits=32").unwrap(),
        );
        assert_eq!(
            p.attention(LayerKind::Sliding, 0).kernel,
            "attn_decode_gqc16n1"
        );
        assert_eq!(p.full.per_head.splits, 32);
        for bad in ["tile", "tile=x", "gqa=-1", "splits=", "q4k=legacy", "fa=0"] {
            assert!(Overrides::default().parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn buckets_follow_the_tile_threshold_and_the_plan_prints_one_line_each() {
        let p = DecodePlan::new((9, 0), G30B, Overrides::default());
        assert_eq!(p.buckets(), vec![(1, 1), (2, 4), (5, 7), (8, 64)]);
        let o = Overrides::default().parse("tile=65").unwrap();
        let q = DecodePlan::new((9, 0), G30B, o);
        assert_eq!(q.buckets(), vec![(1, 1), (2, 4), (5, 64)]);
        let o = Overrides::default().parse("tile=5").unwrap();
        let q = DecodePlan::new((9, 0), G30B, o);
        assert_eq!(q.buckets(), vec![(1, 1), (2, 4), (5, 64)]);
        let lines = p.describe(&[("qkvg", WType::Q4K, 8704, 6656)]);
        assert_eq!(lines.len(), 1 + 2 * 4);
        assert!(
            lines[1].starts_with("full    batch  1-1 : attn attn_decode_fused_k8"),
            "{}",
            lines[1]
        );
        assert!(
            lines[1].contains("qkvg gemv_q4k_w1u7l1r2_b1 (1088, 1, 1)x128"),
            "{}",
            lines[1]
        );
        assert!(lines[8].contains("attn_decode_gqc16n1"), "{}", lines[8]);
        // Every kernel a plan names is one the runtime loads.
        let names = crate::layout::kernel_names();
        for l in [p.full, p.sliding] {
            assert!(names.iter().any(|n| n == l.per_head.kernel));
            assert!(l
                .grouped
                .is_some_and(|(_, g)| names.iter().any(|n| n == g.kernel)));
        }
        for (lo, _) in p.buckets() {
            for (rows, cols) in [(8704, 6656), (6656, 4096), (6656, 19968)] {
                let k = super::gemv(WType::Q4K, rows, cols, lo, 8).kernel;
                assert!(names.contains(&k), "{k}");
            }
        }
    }

    /// Every GEMV kernel the runtime loads is one a plan launches for some weight type, row
    /// width (up to 320 super-blocks) and batch, with or without tensor cores.
    #[test]
    fn every_loaded_gemv_is_one_some_plan_launches() {
        let mut seen = std::collections::BTreeSet::new();
        for ty in WType::ALL {
            for nsb in 1..=320 {
                for b in 1..=MAX_GEMV_BATCH {
                    for tile in [Q4K_TILE_MIN_BATCH, MAX_GEMV_BATCH + 1] {
                        seen.insert(super::gemv(ty, 64, 256 * nsb, b, tile).kernel);
                    }
                }
            }
        }
        let loaded = crate::layout::kernel_names();
        let gemvs: Vec<&String> = loaded.iter().filter(|n| n.starts_with("gemv_")).collect();
        for n in &gemvs {
            assert!(seen.contains(*n), "{n} is loaded but no plan launches it");
        }
        assert_eq!(seen.len(), gemvs.len(), "every launched GEMV is loaded");
    }
}
