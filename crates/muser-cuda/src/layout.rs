//! Device layouts of weights and the kernel names, shared with the GPU code but free of CUDA,
//! so they are tested on machines without a GPU.
//!
//! Q4_K and the float types keep the file's bytes (Q4_K blocks are 144 bytes, 16-byte aligned);
//! Q6_K blocks are padded from 210 to 224 bytes; Q8_0 and NVFP4 are split into a quant array
//! followed by a scale array. Every kernel load is then 16-byte aligned.

/// Weight types the kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WType {
    /// f32.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 32 int8 values and one f16 scale.
    Q8_0,
    /// 256-value super-blocks, 4-bit with 6-bit scales and mins.
    Q4K,
    /// 256-value super-blocks, 6-bit with int8 scales.
    Q6K,
    /// 64-value blocks of E2M1 with four UE4M3 scales.
    NvFp4,
}

impl WType {
    /// Every weight type, in declaration order.
    pub const ALL: [WType; 7] = [
        WType::F32,
        WType::F16,
        WType::BF16,
        WType::Q8_0,
        WType::Q4K,
        WType::Q6K,
        WType::NvFp4,
    ];

    /// From a ggml type id.
    pub fn from_ggml(id: u32) -> Option<WType> {
        Some(match id {
            0 => WType::F32,
            1 => WType::F16,
            8 => WType::Q8_0,
            12 => WType::Q4K,
            14 => WType::Q6K,
            30 => WType::BF16,
            40 => WType::NvFp4,
            _ => return None,
        })
    }

    /// The ggml type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            WType::F32 => 0,
            WType::F16 => 1,
            WType::Q8_0 => 8,
            WType::Q4K => 12,
            WType::Q6K => 14,
            WType::BF16 => 30,
            WType::NvFp4 => 40,
        }
    }

    /// (values per block, bytes per block) in the ggml file format.
    pub fn block(self) -> (usize, usize) {
        match self {
            WType::F32 => (1, 4),
            WType::F16 | WType::BF16 => (1, 2),
            WType::Q8_0 => (32, 34),
            WType::Q4K => (256, 144),
            WType::Q6K => (256, 210),
            WType::NvFp4 => (64, 36),
        }
    }

    /// Bytes of one row of `cols` values in the file format.
    pub fn row_bytes(self, cols: usize) -> usize {
        let (n, b) = self.block();
        cols / n * b
    }

    /// Name of its GEMV kernels in kernels.cu (`gemv_<name>_b<batch>`).
    pub fn kernel(self) -> &'static str {
        match self {
            WType::F32 => "f32",
            WType::F16 => "f16",
            WType::BF16 => "bf16",
            WType::Q8_0 => "q80",
            WType::Q4K => "q4k",
            WType::Q6K => "q6k",
            WType::NvFp4 => "nvfp4",
        }
    }

    /// Whether the GEMV reads int8-quantized activations (else f32 activations).
    pub fn int_activations(self) -> bool {
        !matches!(self, WType::F32 | WType::F16 | WType::BF16)
    }

    /// Column count the kernels need to be a multiple of.
    pub fn col_multiple(self) -> usize {
        match self {
            WType::Q4K | WType::Q6K => 256,
            WType::NvFp4 => 64,
            _ => 32,
        }
    }
}

/// Reorders the nibbles of one 16-value NVFP4 group (8 bytes) from the file's order (byte j:
/// value j low, value j + 8 high) to value order (byte j: value 2j low, value 2j + 1 high), so
/// that the GEMV's decoded bytes line up with the activations as they are stored.
fn nvfp4_values_in_order(group: &mut [u8]) {
    let mut v = [0u8; 16];
    for (j, &b) in group.iter().enumerate() {
        v[j] = b & 15;
        v[j + 8] = b >> 4;
    }
    for (j, b) in group.iter_mut().enumerate() {
        *b = v[2 * j] | (v[2 * j + 1] << 4);
    }
}

/// The repacked device bytes of a matrix given as pieces of ggml rows, and the offset of its
/// scale array (0 when none); `None` when the type keeps the file layout.
pub fn repack(ty: WType, rows: usize, cols: usize, pieces: &[&[u8]]) -> Option<(Vec<u8>, usize)> {
    let blocks = pieces.iter().flat_map(|p| p.chunks_exact(ty.block().1));
    match ty {
        WType::F32 | WType::F16 | WType::BF16 | WType::Q4K => None,
        WType::Q6K => {
            let mut host = vec![0u8; rows * cols / 256 * 224];
            for (dst, blk) in host.chunks_exact_mut(224).zip(blocks) {
                dst[..210].copy_from_slice(blk);
            }
            Some((host, 0))
        }
        WType::Q8_0 | WType::NvFp4 => {
            // Q8_0: f16 scale then 32 quants; NVFP4: 4 scale bytes then 32 packed bytes.
            let (nvals, nscale) = if ty == WType::Q8_0 { (32, 2) } else { (64, 4) };
            let nb = rows * cols / nvals;
            let mut host = vec![0u8; nb * (32 + nscale)];
            let (qs, ds) = host.split_at_mut(nb * 32);
            for ((q, d), blk) in qs
                .chunks_exact_mut(32)
                .zip(ds.chunks_exact_mut(nscale))
                .zip(blocks)
            {
                d.copy_from_slice(&blk[..nscale]);
                q.copy_from_slice(&blk[nscale..]);
                if ty == WType::NvFp4 {
                    for group in q.chunks_exact_mut(8) {
                        nvfp4_values_in_order(group);
                    }
                }
            }
            Some((host, nb * 32))
        }
    }
}

/// Largest batch the decode GEMV kernels take: batches up to [`Q4K_SHAPE_MAX_BATCH`] have a
/// kernel per batch size, larger ones the batched kernels ([`seq_gemv`]), which take the batch
/// as an argument. The fused path decodes up to this many sequences per step.
pub const MAX_GEMV_BATCH: usize = 64;

/// Q4_K GEMV shapes instantiated in kernels.cu: (warps per row, unroll), each with two rows per
/// warp for one sequence (`Q4K_R2(w, u)`) and as a batched kernel (`Q4K_SEQS(w, u)`).
pub const Q4K_SHAPES: [(u32, u32); 7] = [(1, 1), (1, 2), (1, 3), (1, 4), (1, 7), (2, 4), (4, 5)];

/// Largest batch the GEMVs have a kernel per batch size for (larger batches take the batched
/// kernels, [`seq_gemv`], or the tiled Q4_K one, [`q4k_tile`]).
pub const Q4K_SHAPE_MAX_BATCH: usize = 4;

/// The shape that covers a row of `nsb` super-blocks in the fewest passes (a warp takes 4
/// super-blocks per unroll step), then with the fewest idle lanes, then the deepest unroll.
pub fn q4k_shape(nsb: usize) -> (u32, u32) {
    best_q4k_shape(nsb, None)
}

/// The Q4_K shape among the instantiated ones with `wpr` warps per row (any when `None`) that
/// covers a row of `nsb` super-blocks in the fewest passes (a warp takes 4 super-blocks per
/// unroll step), then with the fewest idle lanes, then the deepest unroll.
fn best_q4k_shape(nsb: usize, wpr: Option<u32>) -> (u32, u32) {
    let mut best = Q4K_SHAPES[0];
    let mut best_key = (usize::MAX, usize::MAX, 0u32);
    for &(w, u) in Q4K_SHAPES.iter().filter(|s| wpr.is_none_or(|w| s.0 == w)) {
        let cover = 4 * (w * u) as usize;
        let passes = nsb.div_ceil(cover).max(1);
        let key = (passes, passes * cover - nsb, u32::MAX - u);
        if key < best_key {
            best_key = key;
            best = (w, u);
        }
    }
    best
}

/// Sequences the batched kernels take per pass over their registers (`SEQ_CHUNK` in
/// kernels.cu).
pub const SEQ_CHUNK: usize = 4;

/// Rows per warp of the batched Q4_K GEMV (`Q4K_SEQ_RPW` in kernels.cu).
pub const Q4K_SEQ_ROWS_PER_WARP: usize = 2;

/// The batched GEMV (`gemv_*_bn`, for batches above [`Q4K_SHAPE_MAX_BATCH`]) of a `ty` matrix
/// of `cols` columns and its rows per 128-thread block. `q4k_wpr`: the warps per row of the
/// matrix's one-sequence Q4_K GEMV; the batched kernel splits rows the same way, so that each
/// sequence's sums run in the one-sequence order (kernels.cu), with the unroll that covers the
/// row in the fewest passes (the passes after the first re-read their weights per chunk).
pub fn seq_gemv(ty: WType, cols: usize, q4k_wpr: u32) -> (String, usize) {
    match ty {
        WType::Q4K => {
            let (w, u) = best_q4k_shape(cols / 256, Some(q4k_wpr));
            (
                format!("gemv_q4k_w{w}u{u}_bn"),
                4 / w as usize * Q4K_SEQ_ROWS_PER_WARP,
            )
        }
        // gemv_nvfp4<B, 2, 2>: two rows per warp; the others one.
        WType::NvFp4 => ("gemv_nvfp4_bn".to_string(), 8),
        _ => (format!("gemv_{}_bn", ty.kernel()), 4),
    }
}

/// Smallest batch the Q4_K GEMVs run on int8 tensor cores ([`q4k_tile`]; the benchmark
/// override `tile=N`, `plan::Overrides`, moves it).
pub const Q4K_TILE_MIN_BATCH: usize = 8;

/// Sequences per block of the tiled Q4_K GEMV (the N of its mma.m16n8k16).
pub const Q4K_TILE_SEQS: usize = 8;

/// Rows per block of the tiled Q4_K GEMV (`Q4K_TILE_MT` 16-row m-tiles in kernels.cu).
pub const Q4K_TILE_ROWS: usize = 32;

/// Stages per warp of the tiled Q4_K GEMV's cp.async pipeline (`TILE_STAGES` in kernels.cu):
/// each holds half a super-block of its 32 rows and 8 sequences.
pub const Q4K_TILE_STAGES: u32 = 3;

/// Bytes of one stage (`TILE_STAGE_BYTES`): 32 rows x 80 (header and 64 quant bytes), 8
/// sequences x 144 (128 int8 activations) and 2 x 8 x 48 (8 scales, 8 scale * sums).
pub const Q4K_TILE_STAGE_BYTES: u32 = 32 * 80 + 8 * 144 + 2 * 8 * 48;

/// Warps per row of the one-sequence GEMVs the tiled Q4_K GEMV is instantiated for
/// (`Q4K_TILE(w)` in kernels.cu; its blocks have 4 × w warps).
pub const Q4K_TILES: [u32; 3] = [1, 2, 4];

/// A launch of the tiled Q4_K GEMV: a grid of ⌈batch / [`Q4K_TILE_SEQS`]⌉ × ⌈rows /
/// [`Q4K_TILE_ROWS`]⌉ blocks (sequence blocks vary fastest).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileLaunch {
    /// Kernel name (`gemv_q4k_tile_w{w}`).
    pub name: String,
    /// Threads per block.
    pub threads: u32,
    /// Dynamic shared memory per block: [`Q4K_TILE_STAGES`] stages per warp.
    pub smem: u32,
}

/// The tiled Q4_K GEMV whose sums equal those of the one-sequence GEMV with `wpr` warps per
/// row; `None` for a split no tile kernel takes.
pub fn q4k_tile(wpr: u32) -> Option<TileLaunch> {
    Q4K_TILES.contains(&wpr).then(|| TileLaunch {
        name: format!("gemv_q4k_tile_w{wpr}"),
        threads: 128 * wpr,
        smem: 4 * wpr * Q4K_TILE_STAGES * Q4K_TILE_STAGE_BYTES,
    })
}

/// Name of a shaped Q4_K GEMV kernel that takes two rows per warp (load hint L2::256B).
pub fn q4k_kernel_r2(w: u32, u: u32, batch: usize) -> String {
    format!("gemv_q4k_w{w}u{u}l1r2_b{batch}")
}

/// Shapes instantiated with four rows per warp (`Q4K_R4(w, u)`, batches 2-4).
pub const Q4K_R4_SHAPES: [(u32, u32); 3] = [(1, 4), (2, 4), (4, 5)];

/// The four-rows-per-warp shape for rows of `nsb` super-blocks: the one with as many warps per
/// row as `q4k_shape(nsb)`, so that each row sums its super-blocks in the same order as the
/// two-rows-per-warp kernel (a warp's lane group takes super-blocks in ascending steps of
/// 4 * warps-per-row whatever the unroll, and the row's warps are added in the same order).
/// A sequence's tokens then do not depend on how many rows its warp shares.
pub fn q4k_shape_r4(nsb: usize) -> (u32, u32) {
    let (w, _) = q4k_shape(nsb);
    Q4K_R4_SHAPES
        .iter()
        .copied()
        .find(|&(w4, _)| w4 == w)
        .unwrap_or(Q4K_R4_SHAPES[0])
}

/// Name of a shaped Q4_K GEMV kernel that takes four rows per warp (load hint L2::256B).
pub fn q4k_kernel_r4(w: u32, u: u32, batch: usize) -> String {
    format!("gemv_q4k_w{w}u{u}l1r4_b{batch}")
}

/// Tokens (one warp each) per block of the flash prefill attention (`FA_WARPS` in kernels.cu).
pub const FA_WARPS: usize = 8;
/// Keys it stages per pass (`FA_KEYS`).
pub const FA_KEYS: usize = 64;
/// Its dynamic shared memory: two buffers of keys and values (`FA_SMEM`).
pub const FA_SMEM_BYTES: u32 = (2 * 2 * FA_KEYS * 128 * 2) as u32;

/// Floats of one warp's record in the cluster decode attention (`GQC_REC` in kernels.cu:
/// 16 heads x 128 dims of output, then four maxima and sums per lane).
pub const GQC_REC: usize = 2176;
/// Most records it writes per (KV group, sequence): 16 blocks of 8 warps.
pub const GQC_RECORDS: usize = 128;

/// Most flash-decoding splits `attn_combine_gate` merges per head (`MAX_SPLITS` in kernels.cu).
pub const MAX_SPLITS: usize = 256;

/// Kernels other than the GEMVs.
pub const OTHER_KERNELS: [&str; 16] = [
    "dequant_bf16",
    "get_rows",
    "quantize_act",
    "norm_fused",
    "norm_fused8",
    "qk_norm_rope_store",
    "attn_combine_gate",
    "attn_decode_fused_k8",
    "attn_decode_gqr",
    "attn_decode_gqc16n1",
    "attn_decode_gqc16w8",
    "attn_prefill_flash",
    "gate_heads_bf16",
    "swiglu",
    "logits_argmax",
    "logits_sample",
];

/// Every kernel the backend loads from kernels.cu: what some plan (`crate::plan`) launches, for
/// some weight type, matrix width and batch, and the prefill's.
pub fn kernel_names() -> Vec<String> {
    let mut names: Vec<String> = OTHER_KERNELS.iter().map(|s| s.to_string()).collect();
    for t in WType::ALL.into_iter().filter(|&t| t != WType::Q4K) {
        for b in 1..=Q4K_SHAPE_MAX_BATCH {
            names.push(format!("gemv_{}_b{b}", t.kernel()));
        }
        names.push(seq_gemv(t, 256, 1).0);
    }
    for (w, u) in Q4K_SHAPES {
        names.push(q4k_kernel_r2(w, u, 1));
        names.push(format!("gemv_q4k_w{w}u{u}_bn"));
    }
    for (w, u) in Q4K_R4_SHAPES {
        for b in 2..=Q4K_SHAPE_MAX_BATCH {
            names.push(q4k_kernel_r4(w, u, b));
        }
    }
    for w in Q4K_TILES {
        names.extend(q4k_tile(w).map(|t| t.name));
    }
    names
}

/// How a decode step of the fused path picks a sequence's next token on the GPU
/// (`logits_sample` in kernels.cu; `glimmer::CudaGlimmer::set_sampling`): softmax at temperature `temp` over the `top_k` largest logits (0: all), drawn
/// with [`sample_uniform`]`(seed, position)`. Sequences without one are greedy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature (0 or less: greedy).
    pub temp: f32,
    /// Logits kept (0: the whole vocabulary; 1: greedy). Values tied with the k-th are kept.
    pub top_k: u32,
    /// Seed of the draws; the draw of a step depends on the seed and the position only.
    pub seed: u64,
}

/// The draw in [0, 1) that `logits_sample` makes for `seed` at position `pos` (splitmix64,
/// 24 bits), for checks on the host.
pub fn sample_uniform(seed: u64, pos: i32) -> f32 {
    let mut z = seed ^ (pos as u32 as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 * (1.0 / 16_777_216.0)
}

/// A sequence's [`Sampling`] as kernels.cu's `SampleParams` (16 bytes).
pub fn sample_params(s: Option<Sampling>) -> [u8; 16] {
    let mut b = [0u8; 16];
    if let Some(s) = s {
        b[0..4].copy_from_slice(&s.temp.to_le_bytes());
        b[4..8].copy_from_slice(&(s.top_k.min(i32::MAX as u32) as i32).to_le_bytes());
        b[8..16].copy_from_slice(&s.seed.to_le_bytes());
    }
    b
}

/// Splits bulk-copy pieces into batches of at most `cap` bytes (a larger piece split in
/// parts): per batch, (piece index, byte range of the piece, offset in the staging memory).
pub fn staging_batches(
    lens: &[usize],
    cap: usize,
) -> Vec<Vec<(usize, std::ops::Range<usize>, usize)>> {
    let mut out = vec![Vec::new()];
    let mut used = 0;
    for (i, &len) in lens.iter().enumerate() {
        let mut a = 0;
        while a < len {
            if used == cap {
                out.push(Vec::new());
                used = 0;
            }
            let n = (len - a).min(cap - used);
            out.last_mut().expect("one batch").push((i, a..a + n, used));
            used += n;
            a += n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_batches_cover_every_byte_once_in_order() {
        let lens = [5, 0, 12, 3, 7];
        for cap in 1..=16 {
            let batches = staging_batches(&lens, cap);
            let mut seen: Vec<(usize, usize)> = Vec::new();
            for b in &batches {
                let used: usize = b.iter().map(|(_, r, _)| r.len()).sum();
                assert!(used <= cap, "cap {cap}: batch of {used}");
                let mut off = 0;
                for (i, r, o) in b {
                    assert_eq!(*o, off, "cap {cap}: parts packed in order");
                    off += r.len();
                    seen.extend(r.clone().map(|x| (*i, x)));
                }
            }
            let want: Vec<(usize, usize)> = lens
                .iter()
                .enumerate()
                .flat_map(|(i, &n)| (0..n).map(move |x| (i, x)))
                .collect();
            assert_eq!(seen, want, "cap {cap}");
        }
    }

    #[test]
    fn sample_draws_are_uniform_reproducible_and_laid_out_for_the_kernel() {
        let d: Vec<f32> = (0..4000).map(|p| sample_uniform(42, p)).collect();
        assert!(d.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = d.iter().sum::<f32>() / d.len() as f32;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
        assert_eq!(sample_uniform(42, 7), sample_uniform(42, 7));
        assert_ne!(sample_uniform(42, 7), sample_uniform(43, 7));
        assert_ne!(sample_uniform(42, 7), sample_uniform(42, 8));
        let b = sample_params(Some(Sampling {
            temp: 0.5,
            top_k: 40,
            seed: 0x0102_0304_0506_0708,
        }));
        assert_eq!(f32::from_le_bytes([b[0], b[1], b[2], b[3]]), 0.5);
        assert_eq!(i32::from_le_bytes([b[4], b[5], b[6], b[7]]), 40);
        assert_eq!(b[8..16], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(sample_params(None), [0u8; 16], "greedy is all zeros");
    }

    /// Both modules compile with NVRTC for sm_90 and hold every kernel the Rust side loads.
    /// Needs NVRTC and the CUDA headers, no GPU: `scripts/cuda-compile-check.sh` sets them up
    /// and `MUSER_NVRTC_CHECK=1`; without it the test says so and passes.
    #[cfg(feature = "cuda")]
    #[test]
    fn kernels_compile_with_nvrtc() {
        use crate::runtime::{compile_source, KERNELS_CU, OPS_CU};
        if std::env::var_os("MUSER_NVRTC_CHECK").is_none() {
            eprintln!("not compiled: run scripts/cuda-compile-check.sh");
            return;
        }
        let ops: Vec<String> = crate::backend::OPS_KERNELS
            .iter()
            .map(|s| s.to_string())
            .collect();
        for (src, names) in [(KERNELS_CU, kernel_names()), (OPS_CU, ops)] {
            let ptx = match compile_source(src, "sm_90") {
                Ok(p) => p,
                Err(e) => panic!("{e}"),
            };
            for n in &names {
                assert!(
                    ptx.contains(&format!(".entry {n}(")),
                    "kernel {n} missing from the PTX"
                );
            }
            // Nothing compiled that no path loads.
            assert_eq!(ptx.matches(".entry ").count(), names.len());
            eprintln!(
                "{} kernels compiled ({} bytes of PTX)",
                names.len(),
                ptx.len()
            );
        }
    }
    use muser_gguf::GgmlType;

    #[test]
    fn block_table_matches_ggml() {
        for ty in WType::ALL {
            let g = GgmlType::from_id(ty.ggml_id()).expect("ggml id");
            assert_eq!(WType::from_ggml(g.id()), Some(ty));
            assert_eq!(ty.block(), (g.block_size(), g.type_size()), "{ty:?}");
        }
        assert_eq!(WType::from_ggml(2), None, "Q4_0 has no CUDA kernels");
    }

    #[test]
    fn q8_0_splits_quants_and_scales_across_pieces() {
        // Two pieces of one row each, 2 blocks per row: block k has scale [k, 0x80|k], quants k.
        let blk = |k: u8| -> Vec<u8> { [vec![k, 0x80 | k], vec![k; 32]].concat() };
        let p0 = [blk(0), blk(1)].concat();
        let p1 = [blk(2), blk(3)].concat();
        let (host, aux) = repack(WType::Q8_0, 2, 64, &[&p0, &p1]).expect("repacked");
        assert_eq!(aux, 4 * 32);
        for k in 0..4u8 {
            assert!(host[32 * k as usize..32 * (k as usize + 1)]
                .iter()
                .all(|&b| b == k));
            assert_eq!(
                &host[aux + 2 * k as usize..aux + 2 * k as usize + 2],
                &[k, 0x80 | k]
            );
        }
    }

    #[test]
    fn nvfp4_and_q6k_layouts() {
        let blk: Vec<u8> = (0..36).map(|i| (i * 37 + 11) as u8).collect();
        let (host, aux) = repack(WType::NvFp4, 1, 64, &[&blk]).expect("repacked");
        assert_eq!((host.len(), aux), (36, 32));
        assert_eq!(&host[32..], &blk[..4]);
        // Value i of group g: file byte g*8 + i%8, low nibble for i < 8; device byte
        // g*8 + i/2, low nibble for even i.
        for g in 0..4 {
            for i in 0..16 {
                let fb = blk[4 + 8 * g + i % 8];
                let file = if i < 8 { fb & 15 } else { fb >> 4 };
                let db = host[8 * g + i / 2];
                let dev = if i % 2 == 0 { db & 15 } else { db >> 4 };
                assert_eq!(file, dev, "group {g} value {i}");
            }
        }
        let q6: Vec<u8> = (0..420).map(|i| (i % 251) as u8).collect();
        let (host, aux) = repack(WType::Q6K, 1, 512, &[&q6]).expect("repacked");
        assert_eq!((host.len(), aux), (448, 0));
        assert_eq!(&host[..210], &q6[..210]);
        assert!(host[210..224].iter().all(|&b| b == 0));
        assert_eq!(&host[224..434], &q6[210..]);
        assert!(repack(WType::Q4K, 1, 256, &[&[0u8; 144]]).is_none());
    }

    /// A four-rows-per-warp shape splits a row over as many warps as the two-row shape, so
    /// batched steps sum each row in a single step's order (26 super-blocks: one warp, unrolled
    /// 4 instead of 7).
    #[test]
    fn four_row_shapes_keep_the_summation_order() {
        for nsb in 1..200 {
            assert_eq!(q4k_shape_r4(nsb).0, q4k_shape(nsb).0, "{nsb}");
        }
        assert_eq!(q4k_shape_r4(26), (1, 4));
        assert_eq!(q4k_shape_r4(78), (4, 5));
    }

    /// The batched GEMVs split a row over as many warps as the one-sequence GEMV of the
    /// matrix (the condition for equal sums, kernels.cu), cover Muse Glimmer's rows in one pass
    /// (their weights then stay in registers across the sequence chunks) and exist for every
    /// type; the constants match the source.
    #[test]
    fn batched_gemvs_keep_the_one_sequence_row_split() {
        let src = include_str!("kernels.cu");
        assert!(src.contains(&format!("#define SEQ_CHUNK {SEQ_CHUNK}\n")));
        assert!(src.contains(&format!("#define Q4K_SEQ_RPW {Q4K_SEQ_ROWS_PER_WARP}\n")));
        let names = kernel_names();
        for nsb in 1..200 {
            for wpr in [q4k_shape(nsb).0, 1, 2, 4] {
                let (name, rpb) = seq_gemv(WType::Q4K, 256 * nsb, wpr);
                assert!(
                    name.starts_with(&format!("gemv_q4k_w{wpr}u")),
                    "{nsb}: {name}"
                );
                assert_eq!(rpb, 4 / wpr as usize * Q4K_SEQ_ROWS_PER_WARP);
                assert!(names.contains(&name), "{name}");
            }
        }
        // n_embd 6656, n_ff 19968 and 8192-wide attention output: one pass each.
        for (cols, want) in [
            (6656, "gemv_q4k_w1u7_bn"),
            (19968, "gemv_q4k_w4u5_bn"),
            (8192, "gemv_q4k_w2u4_bn"),
        ] {
            let wpr = q4k_shape(cols / 256).0;
            assert_eq!(seq_gemv(WType::Q4K, cols, wpr).0, want, "{cols}");
        }
        for ty in WType::ALL {
            let (name, rpb) = seq_gemv(ty, 4096, 2);
            assert!(names.contains(&name), "{ty:?}: {name}");
            assert!(rpb > 0);
        }
        assert_eq!(
            seq_gemv(WType::Q6K, 6656, 1),
            ("gemv_q6k_bn".to_string(), 4)
        );
        assert_eq!(seq_gemv(WType::NvFp4, 6656, 1).1, 8);
    }

    /// Muse Glimmer's widths get one-pass shapes: 26 super-blocks (n_embd 6656) one warp
    /// unrolled 7, 16 (4096) one warp unrolled 4, 78 (19968) four warps unrolled 5.
    #[test]
    fn q4k_shapes_cover_rows_in_one_pass() {
        assert_eq!(q4k_shape(26), (1, 7));
        assert_eq!(q4k_shape(16), (1, 4));
        assert_eq!(q4k_shape(78), (4, 5));
        assert_eq!(q4k_shape(4), (1, 1));
        assert_eq!(q4k_shape(12), (1, 3));
        for nsb in 1..200 {
            let (w, u) = q4k_shape(nsb);
            assert!(Q4K_SHAPES.contains(&(w, u)));
            if nsb <= 80 {
                assert!(4 * (w * u) as usize >= nsb, "{nsb}: one pass");
            }
        }
    }

    /// PTX `prmt.b32` in its default mode: selector nibble n picks byte (s & 7) of {b, a}
    /// (a's bytes first); with bit 3 set the byte's sign bit fills the result byte.
    fn prmt(a: u32, b: u32, sel: u32) -> u32 {
        let bytes = ((u64::from(b) << 32) | u64::from(a)).to_le_bytes();
        (0..4).fold(0u32, |d, n| {
            let s = (sel >> (4 * n)) & 0xF;
            let byte = bytes[(s & 7) as usize];
            let v = match (s & 8 != 0, byte & 0x80 != 0) {
                (false, _) => byte,
                (true, true) => 0xFF,
                (true, false) => 0,
            };
            d | (u32::from(v) << (8 * n))
        })
    }

    /// The hex literals that follow each occurrence of `key` in kernels.cu, in order.
    fn source_hex(src: &str, key: &str) -> Vec<u32> {
        src.match_indices(key)
            .map(|(i, _)| {
                let rest = src[i + key.len()..].trim_start();
                let digits: String = rest
                    .trim_start_matches("0x")
                    .chars()
                    .take_while(|c| c.is_ascii_hexdigit())
                    .collect();
                u32::from_str_radix(&digits, 16).expect("a hex literal")
            })
            .collect()
    }

    /// The NVFP4 GEMV's unpacking (`fp4_lut8` and `fp4_dot16` in kernels.cu), with its
    /// constants read from the source and `prmt` emulated: every nibble of a word decodes to the
    /// doubled E2M1 table, and a 16-value dot product of a group repacked to value order
    /// (`repack`) against the activation words as stored equals the plain one over the file's
    /// bytes (byte j: value j low, value j + 8 high).
    #[test]
    fn nvfp4_byte_permute_unpacking_matches_the_e2m1_table() {
        use muser_quant::fp::KVALUES_FP4;
        let src = include_str!("kernels.cu");
        let lut_src = src
            .split_once("void fp4_lut8(")
            .and_then(|(_, r)| r.split_once("\n}\n"))
            .expect("fp4_lut8 in kernels.cu")
            .0;
        let t: Vec<u32> = ["t0 = ", "t1 = ", "t2 = ", "t3 = "]
            .iter()
            .map(|k| source_hex(lut_src, k)[0])
            .collect();
        let masks = source_hex(lut_src, "prmt(w, w4, ");
        assert_eq!(masks.len(), 2, "kernels.cu changed shape");
        assert!(
            src.contains("const int xi[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};"),
            "the GEMV reads the activations as stored"
        );
        let lut8 = |w: u32| -> (u32, u32) {
            let w4 = w << 4;
            let (s0, s1) = (w & 0x7777, (w >> 16) & 0x7777);
            let (m0, m1) = (prmt(w, w4, masks[0]), prmt(w, w4, masks[1]));
            let pick = |s: u32, m: u32| (prmt(t[0], t[1], s) & !m) | (prmt(t[2], t[3], s) & m);
            (pick(s0, m0), pick(s1, m1))
        };
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u32
        };
        let mut words: Vec<u32> = (0..16u32).map(|v| v * 0x1111_1111).collect();
        words.extend((0..4096).map(|_| next()));
        for &w in &words {
            let (lo, hi) = lut8(w);
            let got = [lo.to_le_bytes(), hi.to_le_bytes()].concat();
            for (i, &g) in got.iter().enumerate() {
                let nibble = (w >> (4 * i)) & 0xF;
                assert_eq!(
                    g as i8, KVALUES_FP4[nibble as usize],
                    "word {w:#x} nibble {i}"
                );
            }
        }
        let dp4a = |a: u32, b: u32| -> i32 {
            let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
            (0..4)
                .map(|k| i32::from(a[k] as i8) * i32::from(b[k] as i8))
                .sum()
        };
        for _ in 0..4096 {
            let bytes = [next().to_le_bytes(), next().to_le_bytes()].concat(); // file order
            let mut dev = bytes.clone();
            nvfp4_values_in_order(&mut dev);
            let wa = u32::from_le_bytes([dev[0], dev[1], dev[2], dev[3]]);
            let wb = u32::from_le_bytes([dev[4], dev[5], dev[6], dev[7]]);
            let x: Vec<u32> = (0..4).map(|_| next()).collect(); // values 0-3, 4-7, 8-11, 12-15
            let (a0, a1) = lut8(wa);
            let (b0, b1) = lut8(wb);
            let got = dp4a(a0, x[0]) + dp4a(a1, x[1]) + dp4a(b0, x[2]) + dp4a(b1, x[3]);
            let xb: Vec<i8> = x
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .map(|b| b as i8)
                .collect();
            let want: i32 = (0..8)
                .map(|j| {
                    let (lo, hi) = (bytes[j] & 0xF, bytes[j] >> 4);
                    i32::from(KVALUES_FP4[lo as usize]) * i32::from(xb[j])
                        + i32::from(KVALUES_FP4[hi as usize]) * i32::from(xb[j + 8])
                })
                .sum();
            assert_eq!(got, want);
        }
    }

    /// The host side sizes the attention kernels' buffers from the same constants.
    #[test]
    fn attention_constants_match_the_source() {
        let src = include_str!("kernels.cu");
        assert!(src.contains(&format!("#define MAX_SPLITS {MAX_SPLITS}\n")));
        assert!(src.contains(&format!("#define FA_WARPS {FA_WARPS}\n")));
        assert!(src.contains(&format!("#define GQC_REC {GQC_REC}\n")));
        assert_eq!(GQC_REC, 68 * 32);
        assert!(src.contains(&format!("#define FA_KEYS {FA_KEYS}\n")));
        assert!(src.contains("#define FA_SMEM (2 * 2 * FA_KEYS * 128 * 2)\n"));
        assert_eq!(FA_SMEM_BYTES, 65536);
    }

    /// Every kernel name the GPU programs launch or inspect by a string literal is one the
    /// runtime loads (a deleted kernel named there fails here, not on the GPU).
    #[test]
    fn kernel_names_in_the_gpu_programs_are_loaded() {
        let mut loaded = kernel_names();
        loaded.extend(crate::backend::OPS_KERNELS.iter().map(|s| s.to_string()));
        let prefixes = [
            "gemv_",
            "attn_",
            "norm_",
            "logits_",
            "swiglu",
            "quantize_act",
            "get_rows",
        ];
        for src in [
            include_str!("bin/muser-cuda-bench/checks.rs"),
            include_str!("bin/muser-cuda-bench/main.rs"),
            include_str!("bin/muser-fused-check.rs"),
            include_str!("bin/muser-backend-check.rs"),
        ] {
            // Literals are the odd pieces; JSON keys (followed by ':' or indexing) and check
            // names (the value of "check") are not kernels.
            let pieces: Vec<&str> = src.split('"').collect();
            for i in (1..pieces.len().saturating_sub(1)).step_by(2) {
                let lit = pieces[i];
                let key = pieces[i + 1].starts_with(':') || pieces[i - 1].ends_with('[');
                let check_name = i >= 2 && pieces[i - 2] == "check";
                let kernel_like = !key
                    && !check_name
                    && prefixes.iter().any(|p| lit.starts_with(p))
                    && lit.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && !lit.ends_with('_');
                if kernel_like {
                    assert!(
                        loaded.iter().any(|n| n == lit),
                        "{lit} is not a loaded kernel"
                    );
                }
            }
        }
    }

    /// Every kernel the runtime loads is defined in kernels.cu (an extern "C" function, a
    /// GEMV_ENTRIES / Q4_K shape instance or an attention entry), so a renamed kernel fails
    /// here rather than on the GPU.
    #[test]
    fn kernel_names_exist_in_the_source() {
        let src = include_str!("kernels.cu");
        for name in kernel_names() {
            let plain = format!("void {name}(");
            let shaped = name
                .strip_prefix("gemv_q4k_w")
                .and_then(|r| r.split_once('u'))
                .and_then(|(w, r)| Some((w, r.split_once('l')?)))
                .is_some_and(|(w, (u, rest))| match rest {
                    "1r2_b1" => src.contains(&format!("Q4K_R2({w}, {u})\n")),
                    "1r4_b2" | "1r4_b3" | "1r4_b4" => src.contains(&format!("Q4K_R4({w}, {u})\n")),
                    _ => false,
                });
            let gemv = name
                .strip_prefix("gemv_")
                .and_then(|r| r.rsplit_once("_b"))
                .map(|(t, b)| {
                    src.contains(&format!("void gemv_{t}_b##B("))
                        && src.contains(&format!("GEMV_ENTRIES({b})"))
                })
                .unwrap_or(false);
            let attn = src.contains(&format!("ATTN_FUSED_ENTRY({name},"))
                || src.contains(&format!("ATTN_GQR_ENTRY({name},"))
                || src.contains(&format!("ATTN_GQC_ENTRY({name},"));
            let seq = name.strip_suffix("_bn").is_some_and(|n| {
                src.contains(&format!("SEQ_ENTRY({name},"))
                    || n.strip_prefix("gemv_q4k_w")
                        .and_then(|r| r.split_once('u'))
                        .is_some_and(|(w, u)| src.contains(&format!("Q4K_SEQS({w}, {u})\n")))
            });
            let tile = Q4K_TILES.iter().any(|&w| {
                name == format!("gemv_q4k_tile_w{w}") && src.contains(&format!("Q4K_TILE({w}, "))
            });
            assert!(
                src.contains(&plain) || gemv || shaped || attn || seq || tile,
                "kernel {name} not found in kernels.cu"
            );
        }
    }
}
