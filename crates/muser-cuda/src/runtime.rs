//! Device start-up, kernel compilation (NVRTC, cached on disk), device buffers, launches and
//! cuBLAS calls. Everything runs on one stream, so a decode step can be captured as a graph.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaGraph, CudaModule, CudaStream,
    DriverError,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::CudaError;

/// The kernel source, compiled at start-up for the device's architecture.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// The kernels of [`crate::backend::CudaBackend`]'s per-op path, a second module loaded by
/// [`Gpu::load_module`] only when that backend starts.
pub const OPS_CU: &str = include_str!("ops.cu");

type Result<T> = std::result::Result<T, CudaError>;

pub(crate) fn drv_err(e: DriverError) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

fn blas_err(e: blas::CublasError) -> CudaError {
    CudaError::Blas(format!("{e:?}"))
}

/// What the device is.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// Marketing name, e.g. "NVIDIA H200".
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem: usize,
    /// Number of multiprocessors.
    pub sm_count: i32,
}

/// Checks that the driver, NVRTC and cuBLAS libraries can be loaded, without panicking
/// (cudarc panics on first use of a missing library).
pub fn check_libraries() -> Result<()> {
    // SAFETY: these only try to open the shared libraries.
    unsafe {
        if !drv_sys::is_culib_present() {
            return Err(CudaError::LibraryMissing {
                lib: "libcuda.so",
                hint: "the NVIDIA driver",
            });
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Err(CudaError::LibraryMissing {
                lib: "libnvrtc.so",
                hint: "the CUDA toolkit (NVRTC)",
            });
        }
        if !blas_sys::is_culib_present() {
            return Err(CudaError::LibraryMissing {
                lib: "libcublas.so",
                hint: "the CUDA toolkit (cuBLAS)",
            });
        }
    }
    Ok(())
}

/// The CUDA include folder: `$CUDA_HOME/include`, `$CUDA_PATH/include`, or `/usr/local/cuda/include`.
pub fn cuda_include_dir() -> Result<PathBuf> {
    let mut tried = Vec::new();
    let roots = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|k| std::env::var_os(k).map(PathBuf::from))
        .chain(std::iter::once(PathBuf::from("/usr/local/cuda")));
    for root in roots {
        let inc = root.join("include");
        if inc.join("cuda_fp16.h").is_file() {
            return Ok(inc);
        }
        tried.push(inc.display().to_string());
    }
    Err(CudaError::HeadersMissing(tried.join(", ")))
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MUSER_CACHE") {
        return Some(PathBuf::from(d).join("kernels"));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("muser").join("kernels"));
    }
    std::env::var_os("HOME").map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("muser")
            .join("kernels")
    })
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Compiles the kernels to PTX for `arch` (e.g. "sm_90"), or reads them from the disk cache
/// (keyed by source, architecture and NVRTC version). Needs no device, only NVRTC and headers.
pub fn compile_kernels(arch: &str) -> Result<String> {
    compile_source(KERNELS_CU, arch)
}

/// The prelude every module starts with (types, warp and block sums, programmatic-launch waits).
pub const COMMON_CUH: &str = include_str!("common.cuh");

/// [`compile_kernels`] for any kernel source (compiled after [`COMMON_CUH`]).
pub fn compile_source(src: &str, arch: &str) -> Result<String> {
    let full = format!("{COMMON_CUH}\n{src}");
    let src = full.as_str();
    // SAFETY: probing the library only.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::LibraryMissing {
            lib: "libnvrtc.so",
            hint: "the CUDA toolkit (NVRTC)",
        });
    }
    let include = cuda_include_dir()?;
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    let version = (major, minor);
    let key = fnv1a(&[
        src.as_bytes(),
        arch.as_bytes(),
        format!("{version:?}").as_bytes(),
    ]);
    let cached = cache_dir().map(|d| d.join(format!("muser-{key:016x}.ptx")));
    if let Some(path) = &cached {
        if let Ok(ptx) = std::fs::read_to_string(path) {
            return Ok(ptx);
        }
    }
    let opts = CompileOptions {
        include_paths: vec![include.display().to_string()],
        options: vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            "-lineinfo".into(),
        ],
        fmad: Some(true),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            CudaError::Compile(log.to_string_lossy().into_owned())
        }
        other => CudaError::Compile(format!("{other:?}")),
    })?;
    let bytes = ptx.as_bytes().unwrap_or_default();
    let text = String::from_utf8_lossy(bytes)
        .trim_end_matches('\0')
        .to_string();
    if let Some(path) = cached {
        write_cache(&path, &text);
    }
    Ok(text)
}

fn write_cache(path: &Path, text: &str) {
    // The cache is an optimisation: failing to write it is not an error.
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

pub use crate::layout::MAX_GEMV_BATCH;

/// How the Q4_K decode GEMV is shaped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q4kShape {
    /// The first version: 2 or 4 warps per row, 4 super-blocks of loads in flight.
    Legacy,
    /// Per matrix, the instantiated shape that covers a row in one pass with the fewest idle
    /// lanes (`crate::layout::q4k_shape`).
    Tuned,
    /// A fixed (warps per row, unroll) shape, for benchmarks.
    Fixed(u32, u32),
}

/// Run-time choices of the decode path, for A/B measurements in one process. The default is
/// the measured best; `MUSER_CUDA_TUNE` (`key=value,...`, keys as in [`Tuning::parse`])
/// changes it at start-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tuning {
    /// Q4_K GEMV shape.
    pub q4k: Q4kShape,
    /// Smallest batch the Q4_K GEMVs run on tensor cores (`gemv_q4k_tile_w*`; default
    /// [`crate::layout::Q4K_TILE_MIN_BATCH`]); above it the batch kernels `gemv_q4k_w*u*_bn`
    /// (`tile=65` keeps those at every batch, for A/B runs).
    pub q4k_tile_from: usize,
    /// Q4_K weight loads ask L2 for 256-byte fetches.
    pub l2_256: bool,
    /// Megabytes of the next matrix each latency-bound kernel asks the copy engine to bring
    /// into L2 while it waits for its predecessor (0: off).
    pub prefetch_mb: f32,
    /// Megabytes of the layer's gate+up matrix the decode attention asks the copy engine to
    /// bring into L2 (instead of `prefetch_mb` of `wo`); 0: off. At depth the attention leaves
    /// the memory bus mostly idle for several microseconds per layer, which this would fill.
    /// Not yet measured; `prefetch_mb` on every kernel was much slower at depth 0.
    pub attn_prefetch_mb: f32,
    /// One attention kernel per layer (Q/K norm, RoPE, cache store, flash-decoding, merge,
    /// gate) instead of three.
    pub fused_attn: bool,
    /// Flash-decoding splits per (head, sequence) (at most 128; each split takes at least
    /// `attn_min_keys` keys, so short contexts use fewer).
    pub attn_splits: u32,
    /// The same on the sliding-window layers (0: `attn_splits`).
    pub attn_swa_splits: u32,
    /// Fewest keys a flash-decoding split takes (short contexts use fewer splits).
    pub attn_min_keys: u32,
    /// Diagnostics only (wrong results): a decode step runs its GEMVs and nothing between
    /// them, to time the matrix streaming alone.
    pub gemv_only: bool,
    /// Diagnostics only (wrong results): a decode step runs only the attention kernels.
    pub attn_only: bool,
    /// Rows per warp of the shaped Q4_K GEMVs in one-sequence steps (1, 2 or 4; they share each
    /// activation load; with 4 the shape is `layout::q4k_shape_r4`'s). 0: 2 (measured best for
    /// one sequence on the H200: four are 7.7% slower there).
    pub rows_per_warp: u32,
    /// Rows per warp of the shaped Q4_K GEMVs in steps of two or more sequences (0: as
    /// `rows_per_warp`). Every choice sums each row in the same order (`layout::q4k_shape_r4`
    /// keeps the warps per row), so batched tokens equal single ones whatever this is. 4
    /// measured best on the H200 (16-layer model of the 30B's geometry, four sequences:
    /// 1168 → 1271 tok/s aggregate; the 4-row gate+up GEMV 88.3 → 76.5 µs).
    pub batch_rows_per_warp: u32,
    /// Blocks per row of a decode step's two per-layer norms: each computes the row's sums
    /// and writes a slice (1: one block per row). 8 measured best on the H200 (4 to
    /// 13 alike); the results are bit-identical for every count.
    pub norm_slices: u32,
    /// Cached keys each warp of the fused decode attention takes per step (4, 8 or 16; their
    /// loads are in flight together). 8 with 16 splits measured best on the H200: 3.6% faster
    /// than 4 with 32 at depth 8192 (16-layer model), the same at depth 0.
    pub attn_keys_per_step: u32,
    /// Diagnostics only (wrong results): the per-layer norms are skipped.
    pub skip_norm: bool,
    /// Diagnostics only (wrong results): the SwiGLU kernel is skipped.
    pub skip_swiglu: bool,
    /// Diagnostics only: a skipped norm or SwiGLU launches an empty kernel (`pdl_nop`) in its
    /// place, so the difference from skipping it is what a kernel boundary costs.
    pub skip_as_nop: bool,
    /// Values per thread of the decode norms: 8 (`norm_fused8`, one barrier per sum; rows of
    /// at most 8192 values, longer ones take 16) or 16 (`norm_fused`, as before session 15;
    /// 0.5 us slower per norm on the H200, and a different rounding order).
    pub norm_vpt: u32,
    /// Blocks the greedy argmax spreads each logits row over (0: about one per 1024 logits, at
    /// most 128; 1: one block per row, as before session 15).
    pub argmax_blocks: u32,
    /// Decode steps whose latest position is at least this run the full-attention layers with
    /// a grouped tensor-core kernel (`gqa_reg`: each cached key and value read once per KV
    /// group, not once per query head) instead of the per-head one (`u32::MAX`: never).
    /// A captured decode graph holds one variant per threshold and replays the one that fits.
    /// 1024 with the cluster kernel (`gqa_reg` 3) on the H200: below about a thousand keys the
    /// per-head kernel's shorter start wins (docs/benchmarks.md, session 14). Before sm_90
    /// (no clusters) `fit_device` puts back 4096 with `attn_decode_gqr`, measured best there
    /// in session 8 on the H200 (1.2% slower at position 512, even at 4096, 2.3% faster at 8192).
    pub gqa_full_from: u32,
    /// The same for the sliding-window layers (1024 with the cluster kernel; before sm_90
    /// never: the register kernel's separate split merge costs more than it saves there).
    pub gqa_swa_from: u32,
    /// Splits of the grouped decode attention per (KV group, sequence) (at most 256).
    pub gqa_splits: u32,
    /// Fewest keys a grouped decode attention split takes (64 and 128 splits measured best at
    /// 8192 keys; 16 and 32 splits, or splits of 32 keys, were slower).
    pub gqa_min_keys: u32,
    /// The same on the sliding-window layers (0: `gqa_min_keys`).
    pub gqa_swa_min_keys: u32,
    /// Diagnostics: preferred shared-memory carveout of every kernel but the GEMVs, in percent
    /// of the configurable on-chip memory (-1: the driver's choice per kernel). One value for
    /// all lets a kernel that needs much shared memory start beside another; on the H200 that
    /// costs the GEMVs more than it saves (docs/benchmarks.md, session 7).
    pub carveout: i32,
    /// The same for the GEMV kernels.
    pub gemv_carveout: i32,
    /// NVFP4 GEMV shape (rows per warp, chunks in flight per row) for batches up to 4, one of
    /// `layout::NVFP4_SHAPES` (None: two rows per warp, 2 chunks).
    pub nvfp4: Option<(u32, u32)>,
    /// Diagnostics only: bytes of unused dynamic shared memory the per-head decode attention
    /// asks for (to measure what a kernel's shared memory costs in the decode graph).
    pub attn_extra_smem: u32,
    /// Keys `attn_decode_gqa` stages in shared memory per pass (16 to 128, a multiple of 16;
    /// a split longer than this takes several passes, the first staged before the wait).
    pub gqa_pass_keys: u32,
    /// The grouped decode attention keeps everything in registers (`attn_decode_gqr`: one warp
    /// per split, no shared memory, so it starts beside the GEMV before it) with this many
    /// 16-key tiles loaded per step (1 or 2; 1 measured best); 0: `attn_decode_gqa`
    /// (shared-memory staging). 3, 4: the cluster kernels (`attn_decode_gqc16n1`,
    /// `attn_decode_gqc16w8`: 16 blocks of 4 or 8 warps per KV group in one thread-block
    /// cluster, one key range per warp, merged in the same launch after a cluster barrier, no
    /// combine kernel; `gqa_min_keys` still bounds the ranges). 4 is the default on sm_90 for
    /// the full-attention layers: twice the key ranges halve each warp's dependent tiles at
    /// depth, 0.5% faster per token at 8192 on the 16-layer model and 0.2% slower at 2048
    /// (docs/benchmarks.md, session 15).
    pub gqa_reg: u32,
    /// The same for the sliding-window layers (`u32::MAX`: as `gqa_reg`); 3 by default (a
    /// 2048-key window is 32 keys per warp with four warps per block).
    pub gqa_swa_reg: u32,
    /// Diagnostics only (wrong results): parts of `attn_decode_gqc16n1` left out, to time the
    /// rest in the decode graph (0: none; 1: the merge; 3: the cluster barrier and the merge;
    /// 4: the key tiles; 8: the Q norm and rotation).
    pub gqc_diag: u32,
    /// Prefill attention in one kernel (`attn_prefill_flash`: online softmax over staged key
    /// tiles, no score matrix; the default) instead of two bf16 GEMMs around a masked softmax
    /// over scores in memory (`fa=0`, whose score buffers are allocated on first use).
    pub flash_prefill: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            q4k: Q4kShape::Tuned,
            q4k_tile_from: crate::layout::Q4K_TILE_MIN_BATCH,
            l2_256: true,
            prefetch_mb: 0.0,
            attn_prefetch_mb: 0.0,
            fused_attn: true,
            attn_splits: 16,
            attn_swa_splits: 0,
            attn_min_keys: 64,
            gemv_only: false,
            attn_only: false,
            rows_per_warp: 0,
            batch_rows_per_warp: 4,
            norm_slices: 8,
            attn_keys_per_step: 8,
            skip_norm: false,
            skip_swiglu: false,
            skip_as_nop: false,
            norm_vpt: 8,
            argmax_blocks: 0,
            gqa_full_from: 1024,
            gqa_swa_from: 1024,
            gqa_splits: 128,
            gqa_min_keys: 64,
            gqa_swa_min_keys: 32,
            gqa_pass_keys: 128,
            carveout: -1,
            gemv_carveout: -1,
            nvfp4: None,
            attn_extra_smem: 0,
            gqa_reg: 4,
            gqa_swa_reg: 3,
            gqc_diag: 0,
            flash_prefill: true,
        }
    }
}

impl Tuning {
    /// These choices as a device of compute capability `cc` can run them: before sm_90 (no
    /// thread-block clusters) the cluster decode attention gives way to `attn_decode_gqr` on
    /// the full-attention layers from position 4096 and to the per-head kernel on the
    /// sliding-window ones.
    pub fn fit_device(mut self, cc: (i32, i32)) -> Tuning {
        if cc.0 < 9 {
            if self.gqa_reg >= 3 {
                self.gqa_reg = 1;
                self.gqa_full_from = self.gqa_full_from.max(4096);
                self.gqa_swa_from = u32::MAX;
            }
            if self.gqa_swa_reg >= 3 && self.gqa_swa_reg != u32::MAX {
                self.gqa_swa_reg = 1;
            }
        }
        self
    }

    /// Applies `key=value` pairs separated by commas: `q4k=legacy|tuned|W,U`, `tile=N`, `l2=0|1`,
    /// `pf=MB`, `apf=MB`, `fattn=0|1`, `splits=N`, `swasplits=N`, `gemvonly=0|1`, `attnonly=0|1`,
    /// `rpw=0|1|2|4`, `kmin=N`, `nsl=N`, `akeys=4|8|16`, `skipnorm=0|1`, `skipswiglu=0|1`, `skipnop=0|1`, `nvpt=8|16`, `amb=N`,
    /// `gqa=POS|off` (full layers), `gqaswa=POS|off`, `gqasplits=N`, `gqamin=N`, `gqaswamin=N`, `gqapass=N`,
    /// `asmem=BYTES`, `carve=-1..100`, `gcarve=-1..100`, `nv=RxU`, `gqr=0..4`, `gqrswa=0..4`, `gqcdiag=0|1|3|4|8`, `fa=0|1`.
    pub fn parse(mut self, spec: &str) -> Result<Tuning> {
        let bad = || CudaError::Shape(format!("tuning '{spec}'"));
        for kv in spec.split([',', ' ']).filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(bad)?;
            match k {
                "q4k" => {
                    self.q4k = match v {
                        "legacy" => Q4kShape::Legacy,
                        "tuned" => Q4kShape::Tuned,
                        _ => {
                            let (w, u) = v.split_once(['x', ':']).ok_or_else(bad)?;
                            Q4kShape::Fixed(
                                w.parse().map_err(|_| bad())?,
                                u.parse().map_err(|_| bad())?,
                            )
                        }
                    }
                }
                "tile" => self.q4k_tile_from = v.parse::<usize>().map_err(|_| bad())?.max(1),
                "l2" => self.l2_256 = v == "1",
                "pf" => self.prefetch_mb = v.parse().map_err(|_| bad())?,
                "apf" => self.attn_prefetch_mb = v.parse().map_err(|_| bad())?,
                "fattn" => self.fused_attn = v == "1",
                "gemvonly" => self.gemv_only = v == "1",
                "rpw" => self.rows_per_warp = v.parse::<u32>().map_err(|_| bad())?.min(4),
                "brpw" => self.batch_rows_per_warp = v.parse::<u32>().map_err(|_| bad())?.min(4),
                "attnonly" => self.attn_only = v == "1",
                "nsl" => self.norm_slices = v.parse::<u32>().map_err(|_| bad())?.clamp(1, 32),
                "akeys" => self.attn_keys_per_step = one_of(v, &[4, 8, 16]).ok_or_else(bad)?,
                "skipnorm" => self.skip_norm = v == "1",
                "skipswiglu" => self.skip_swiglu = v == "1",
                "skipnop" => self.skip_as_nop = v == "1",
                "nvpt" => self.norm_vpt = one_of(v, &[8, 16]).ok_or_else(bad)?,
                "amb" => self.argmax_blocks = v.parse::<u32>().map_err(|_| bad())?.min(128),
                "fa" => self.flash_prefill = one_of(v, &[0, 1]).ok_or_else(bad)? == 1,
                "kmin" => {
                    self.attn_min_keys = v.parse::<u32>().map_err(|_| bad())?.clamp(16, 1 << 20)
                }
                "gqa" | "gqaswa" => {
                    let from = match v {
                        "off" => u32::MAX,
                        _ => v.parse::<u32>().map_err(|_| bad())?,
                    };
                    if k == "gqa" {
                        self.gqa_full_from = from;
                    } else {
                        self.gqa_swa_from = from;
                    }
                }
                "asmem" => {
                    self.attn_extra_smem = v.parse::<u32>().map_err(|_| bad())?.min(200 << 10)
                }
                "nv" => {
                    let (r, u) = v.split_once('x').ok_or_else(bad)?;
                    let shape = (r.parse().map_err(|_| bad())?, u.parse().map_err(|_| bad())?);
                    if !crate::layout::NVFP4_SHAPES.contains(&shape) {
                        return Err(bad());
                    }
                    self.nvfp4 = Some(shape);
                }
                "gcarve" => {
                    self.gemv_carveout = v.parse::<i32>().map_err(|_| bad())?.clamp(-1, 100)
                }
                "carve" => self.carveout = v.parse::<i32>().map_err(|_| bad())?.clamp(-1, 100),
                "gqapass" => {
                    self.gqa_pass_keys = v.parse::<u32>().map_err(|_| bad())?.clamp(16, 128) & !15
                }
                "gqr" => self.gqa_reg = one_of(v, &[0, 1, 2, 3, 4]).ok_or_else(bad)?,
                "gqrswa" => self.gqa_swa_reg = one_of(v, &[0, 1, 2, 3, 4]).ok_or_else(bad)?,
                "gqcdiag" => self.gqc_diag = one_of(v, &[0, 1, 3, 4, 8]).ok_or_else(bad)?,
                "gqasplits" => self.gqa_splits = v.parse::<u32>().map_err(|_| bad())?.clamp(1, 256),
                "gqaswamin" => {
                    self.gqa_swa_min_keys = v.parse::<u32>().map_err(|_| bad())?.clamp(16, 1 << 20)
                }
                "gqamin" => {
                    self.gqa_min_keys = v.parse::<u32>().map_err(|_| bad())?.clamp(16, 1 << 20)
                }
                "swasplits" => {
                    self.attn_swa_splits = v.parse::<u32>().map_err(|_| bad())?.clamp(1, 128)
                }
                "splits" => self.attn_splits = v.parse::<u32>().map_err(|_| bad())?.clamp(1, 128),
                _ => return Err(bad()),
            }
        }
        Ok(self)
    }
}

/// `v` as a number when it is one of `allowed`.
fn one_of(v: &str, allowed: &[u32]) -> Option<u32> {
    v.parse().ok().filter(|n| allowed.contains(n))
}

/// Element type of a GEMM's inputs ([`Gpu::gemm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmIn {
    Bf16,
    F32,
}

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// Device pointer (0 for a null pointer).
    P(u64),
    /// C `int`.
    I(i32),
    /// C `long` (64-bit on the platforms we build for).
    L(i64),
    /// C `float`.
    F(f32),
}

/// A device allocation, stream-ordered on the [`Gpu`]'s stream: it may be used by work
/// enqueued on that stream, and dropping it frees it after all work enqueued before the drop
/// (so a temporary can be dropped right after the kernels that read it are launched).
pub struct DevBuf {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl DevBuf {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Address `off` bytes in (checked against the size).
    pub fn at(&self, off: usize) -> u64 {
        assert!(
            off <= self.bytes,
            "offset {off} past a {} byte buffer",
            self.bytes
        );
        self.ptr + off as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from malloc_async on this stream and is freed once, in stream
            // order: after every launch that was enqueued while the buffer was alive.
            let _ = unsafe { drv::free_async(self.ptr, self.stream.cu_stream()) };
        }
    }
}

/// The device, its stream, the compiled kernels and a cuBLAS handle.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<String, CudaFunction>,
    blas: CudaBlas,
    info: DeviceInfo,
    pdl: bool,
    tuning: std::sync::Mutex<Tuning>,
    /// The shared-memory carveout last set on each kernel (`Tuning::carveout`).
    carveouts: std::sync::Mutex<HashMap<String, i32>>,
    /// Kernels already allowed clusters past the portable 8 blocks.
    wide_clusters: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Whether any launch has asked for a carveout other than the driver's.
    carveout_set: std::sync::atomic::AtomicBool,
    /// Page-locked host memory for bulk copies ([`Gpu::download_many`],
    /// [`Gpu::upload_many`]), made on first use and grown to what a copy needs.
    pub(crate) staging: std::sync::Mutex<Option<crate::staging::Staging>>,
}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads cached) kernels, creates a cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        check_libraries()?;
        let count =
            CudaContext::device_count().map_err(|e| CudaError::NoDevice(format!("{e:?}")))?;
        if count <= 0 {
            return Err(CudaError::NoDevice("the driver reports 0 devices".into()));
        }
        if ordinal >= count as usize {
            return Err(CudaError::NoDevice(format!(
                "device {ordinal} asked for, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::NoDevice(format!("{e:?}")))?;
        // One stream and raw pointers: the library's per-buffer events would only get in the way
        // of graph capture.
        // SAFETY: no CudaSlice of this context is shared across streams.
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx.compute_capability().map_err(drv_err)?;
        let info = DeviceInfo {
            name: ctx.name().map_err(drv_err)?,
            compute_capability: cc,
            total_mem: ctx.total_mem().map_err(drv_err)?,
            sm_count: ctx
                .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(drv_err)?,
        };
        if cc.0 < 7 || (cc.0 == 7 && cc.1 < 5) {
            return Err(CudaError::Unsupported(format!(
                "compute capability {}.{} (need 7.5 or newer)",
                cc.0, cc.1
            )));
        }
        let arch = format!("sm_{}{}", cc.0, cc.1);
        let ptx = compile_kernels(&arch)?;
        let module = ctx.load_module(Ptx::from_src(ptx)).map_err(drv_err)?;
        let mut funcs = HashMap::new();
        let names = crate::layout::kernel_names();
        for n in names {
            let f = module.load_function(&n).map_err(drv_err)?;
            funcs.insert(n, f);
        }
        let stream = ctx.new_stream().map_err(drv_err)?;
        // Buffers come from the device's stream-ordered pool (DevBuf); keep freed memory in
        // the pool instead of returning it to the driver at every synchronization, so the
        // per-op backend's temporaries are recycled without a driver allocation each time.
        // SAFETY: the device handle is the context's own; the attribute takes a u64.
        unsafe {
            let pool = drv::device::get_default_mem_pool(ctx.cu_device()).map_err(drv_err)?;
            let mut keep = u64::MAX;
            drv::mem_pool::set_attribute(
                pool,
                drv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut std::ffi::c_void,
            )
            .map_err(drv_err)?;
        }
        let blas = CudaBlas::new(stream.clone()).map_err(blas_err)?;
        let pdl = cc.0 >= 9 && std::env::var("MUSER_CUDA_PDL").map_or(true, |v| v != "0");
        let tuning = match std::env::var("MUSER_CUDA_TUNE") {
            Ok(spec) => Tuning::default().parse(&spec)?,
            Err(_) => Tuning::default(),
        }
        .fit_device(cc);
        Ok(Gpu {
            ctx,
            stream,
            _module: module,
            funcs,
            blas,
            info,
            pdl,
            tuning: std::sync::Mutex::new(tuning),
            carveouts: std::sync::Mutex::new(HashMap::new()),
            wide_clusters: std::sync::Mutex::new(Default::default()),
            carveout_set: std::sync::atomic::AtomicBool::new(false),
            staging: std::sync::Mutex::new(None),
        })
    }

    /// The decode-path choices in force (read when work is enqueued or captured).
    pub fn tuning(&self) -> Tuning {
        *self.tuning.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the decode-path choices; graphs captured before keep the old ones.
    pub fn set_tuning(&self, t: Tuning) {
        let t = t.fit_device(self.info.compute_capability);
        *self.tuning.lock().unwrap_or_else(|e| e.into_inner()) = t;
    }

    /// Compiles `src` for this device (cached like the main kernels) and adds its kernels
    /// `names` to the ones [`Self::launch`] finds.
    pub fn load_module(&mut self, src: &str, names: &[&str]) -> Result<()> {
        let (major, minor) = self.info.compute_capability;
        let ptx = compile_source(src, &format!("sm_{major}{minor}"))?;
        self.ctx.bind_to_thread().map_err(drv_err)?;
        let module = self.ctx.load_module(Ptx::from_src(ptx)).map_err(drv_err)?;
        for n in names {
            let f = module.load_function(n).map_err(drv_err)?;
            self.funcs.insert(n.to_string(), f);
        }
        Ok(())
    }

    /// Makes the device's context current on the calling thread (every call below does it;
    /// this is for callers that use raw driver calls).
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv_err)
    }

    /// Whether a kernel of this name was compiled.
    pub fn has_kernel(&self, name: &str) -> bool {
        self.funcs.contains_key(name)
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Allocates `bytes` of device memory (uninitialised), in stream order (see [`DevBuf`]).
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        self.ctx.bind_to_thread().map_err(drv_err)?;
        // SAFETY: stream-ordered allocation on our stream, used only through it.
        let ptr =
            unsafe { drv::malloc_async(self.stream.cu_stream(), bytes.max(256)) }.map_err(|e| {
                CudaError::Driver(format!(
                    "allocating {:.1} MiB: {e:?}",
                    bytes as f64 / 1048576.0
                ))
            })?;
        Ok(DevBuf {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
            stream: self.stream.clone(),
        })
    }

    /// Allocates and zero-fills.
    pub fn alloc_zeroed(&self, bytes: usize) -> Result<DevBuf> {
        let b = self.alloc(bytes)?;
        self.memset(b.ptr, 0, bytes)?;
        Ok(b)
    }

    /// Sets `bytes` bytes at `ptr` to `value` (stream ordered).
    pub fn memset(&self, ptr: u64, value: u8, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes a range inside one allocation.
        unsafe { drv::memset_d8_async(ptr, value, bytes, self.stream.cu_stream()) }.map_err(drv_err)
    }

    /// Copies host data to `dst + off`, in stream order. `src` is pageable memory (no Muser
    /// buffer is pinned), which the driver stages before the call returns, so the caller may
    /// drop or reuse it at once; the device copy lands before any later work on the stream.
    pub fn upload<T: Copy>(&self, dst: &DevBuf, off: usize, src: &[T]) -> Result<()> {
        let n = std::mem::size_of_val(src);
        if off + n > dst.bytes {
            return Err(CudaError::Shape(format!(
                "upload of {n} bytes at {off} into {} bytes",
                dst.bytes
            )));
        }
        self.bind()?;
        // SAFETY: range checked above; a pageable source is staged before the call returns.
        unsafe { drv::memcpy_htod_async(dst.ptr + off as u64, src, self.stream.cu_stream()) }
            .map_err(drv_err)
    }

    /// Copies `bytes` from device address `src` to `dst` on the stream (ordered with launches).
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller passes ranges inside live allocations of at least `bytes`.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(drv_err)
    }

    /// Copies device data at `src` into `dst` and waits.
    pub fn download<T: Copy>(&self, src: u64, dst: &mut [T]) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes a device range at least as large as dst.
        unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.map_err(drv_err)?;
        self.sync()
    }

    /// Waits for all work on the stream.
    pub fn sync(&self) -> Result<()> {
        self.bind()?;
        self.stream.synchronize().map_err(drv_err)
    }

    /// Launches kernel `name` with a 1-D block. On sm_90+ every launch allows programmatic
    /// dependent launch (each kernel waits for its predecessor with `griddepcontrol.wait` before
    /// touching its results; the GEMVs start streaming weights before that); `MUSER_CUDA_PDL=0`
    /// turns it off.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_smem(name, grid, block, 0, args)
    }

    /// Registers per thread, local (spilled) bytes per thread and static shared bytes of the
    /// kernel `name`, as the driver compiled it for this device.
    pub fn kernel_resources(&self, name: &str) -> Result<(i32, i32, i32)> {
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| CudaError::Unsupported(format!("no kernel named {name}")))?;
        let e = |e| CudaError::Driver(format!("{name}: attributes: {e:?}"));
        Ok((
            f.num_regs().map_err(e)?,
            f.local_size_bytes().map_err(e)?,
            f.shared_size_bytes().map_err(e)?,
        ))
    }

    /// [`Self::launch`] with `smem` bytes of dynamic shared memory (past 48 KiB the kernel is
    /// allowed that much first; the device's per-block limit applies).
    pub fn launch_smem(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_ex(name, grid, block, smem, 0, args)
    }

    /// [`Self::launch`] with the blocks grouped in thread-block clusters of `cluster` blocks
    /// along z (sm_90; the grid's z a multiple of it; past 8, the kernel is allowed a
    /// non-portable size first).
    pub fn launch_cluster(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        cluster: u32,
        args: &[Arg],
    ) -> Result<()> {
        if cluster == 0 || !grid.2.is_multiple_of(cluster) {
            return Err(CudaError::Shape(format!(
                "{name}: cluster of {cluster} blocks over a grid z of {}",
                grid.2
            )));
        }
        self.launch_ex(name, grid, block, 0, cluster, args)
    }

    fn launch_ex(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        cluster: u32,
        args: &[Arg],
    ) -> Result<()> {
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| CudaError::Unsupported(format!("no kernel named {name}")))?;
        let tune = self.tuning();
        let carve = if name.starts_with("gemv_") {
            tune.gemv_carveout
        } else {
            tune.carveout
        };
        // Kernels keep the driver's carveout unless a diagnostic asked for another: only then
        // is the per-kernel record consulted.
        if carve != -1 || self.carveout_set.load(std::sync::atomic::Ordering::Relaxed) {
            self.carveout_set
                .store(true, std::sync::atomic::Ordering::Relaxed);
            let mut set = self.carveouts.lock().unwrap_or_else(|e| e.into_inner());
            if set.get(name).copied().unwrap_or(-1) != carve {
                f.set_attribute(
                    drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    carve,
                )
                .map_err(|e| CudaError::Driver(format!("{name}: carveout {carve}: {e:?}")))?;
                set.insert(name.to_string(), carve);
            }
        }
        if smem > 48 * 1024 {
            f.set_attribute(
                drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| {
                CudaError::Driver(format!("{name}: {smem} bytes of shared memory: {e:?}"))
            })?;
        }
        // One 8-byte slot per argument; 4-byte arguments sit in the low half (little-endian).
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::P(v) => v,
                Arg::I(v) => v as u32 as u64,
                Arg::L(v) => v as u64,
                Arg::F(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        if cluster > 8 {
            let mut set = self.wide_clusters.lock().unwrap_or_else(|e| e.into_inner());
            if !set.contains(name) {
                f.set_attribute(
                    drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                )
                .map_err(|e| CudaError::Driver(format!("{name}: cluster of {cluster}: {e:?}")))?;
                set.insert(name.to_string());
            }
        }
        // SAFETY: a zeroed attribute is a valid "ignore" value; we set the fields we use.
        let mut attrs: [drv_sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut nattr = 0usize;
        if cluster > 0 {
            attrs[nattr].id = drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[nattr].value.clusterDim.x = 1;
            attrs[nattr].value.clusterDim.y = 1;
            attrs[nattr].value.clusterDim.z = cluster;
            nattr += 1;
        }
        if self.pdl {
            attrs[nattr].id =
                drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[nattr].value.programmaticStreamSerializationAllowed = 1;
            nattr += 1;
        }
        let cfg = drv_sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: nattr as u32,
        };
        self.ctx.bind_to_thread().map_err(drv_err)?;
        // SAFETY: argument lists match the kernel signatures in kernels.cu (kept side by side);
        // `slots` outlives the call, which copies the parameters.
        unsafe {
            drv_sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| CudaError::Driver(format!("launch {name}: {e:?}")))
    }

    /// Row-major `y[n][m] (f32) = x[n][k] (bf16) · w[m][k]^T (bf16)`, with `ldy` floats per y row.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16(
        &self,
        y: u64,
        ldy: usize,
        x: u64,
        w: u64,
        n: usize,
        m: usize,
        k: usize,
    ) -> Result<()> {
        self.gemm(y, ldy, x, w, (n, m, k), GemmIn::Bf16)
    }

    /// Row-major `y[n][m] (f32) = x[n][k] · w[m][k]^T` with `x` and `w` both `ty`, f32
    /// accumulation (no TF32: with `GemmIn::F32` the products are the f32 ones the per-op
    /// backend's exact precision needs).
    pub fn gemm(
        &self,
        y: u64,
        ldy: usize,
        x: u64,
        w: u64,
        (n, m, k): (usize, usize, usize),
        ty: GemmIn,
    ) -> Result<()> {
        let ty = match ty {
            GemmIn::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
            GemmIn::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        };
        self.bind()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: shapes come from the weights and buffers sized for them.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                ty,
                k as i32,
                x as *const c_void,
                ty,
                k as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldy as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err)
    }

    /// Column-major strided-batched `C = op(A) · op(B) + beta · C` with f16 inputs and f32 output.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_f16_batched(
        &self,
        trans_a: bool,
        m: usize,
        n: usize,
        k: usize,
        a: u64,
        lda: usize,
        stride_a: usize,
        b: u64,
        ldb: usize,
        stride_b: usize,
        c: u64,
        ldc: usize,
        stride_c: usize,
        batch: usize,
        beta: f32,
    ) -> Result<()> {
        let alpha = 1.0f32;
        let op_a = if trans_a {
            blas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas_sys::cublasOperation_t::CUBLAS_OP_N
        };
        // SAFETY: shapes checked by the callers against their scratch buffers.
        unsafe {
            blas::gemm_strided_batched_ex(
                *self.blas.handle(),
                op_a,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                lda as i32,
                stride_a as i64,
                b as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                ldb as i32,
                stride_b as i64,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldc as i32,
                stride_c as i64,
                batch as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err)
    }

    /// Starts capturing the stream's work into a graph.
    pub fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(drv_err)
    }

    /// Ends the capture and instantiates the graph.
    pub fn end_capture(&self) -> Result<CudaGraph> {
        self.stream
            .end_capture(drv_sys::CUgraphInstantiate_flags(0))
            .map_err(drv_err)?
            .ok_or_else(|| CudaError::Driver("graph capture produced no graph".into()))
    }

    /// A timing event pair helper: records an event on the stream.
    pub fn event(&self) -> Result<cudarc::driver::CudaEvent> {
        self.stream
            .record_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv_err)
    }
}

#[cfg(test)]
mod tests {
    use super::Tuning;

    #[test]
    fn tuning_specs_parse_and_bad_ones_are_errors() {
        let t = Tuning::default()
            .parse("splits=16,kmin=128,rpw=1,fattn=0")
            .unwrap();
        assert_eq!(
            (
                t.attn_splits,
                t.attn_min_keys,
                t.rows_per_warp,
                t.fused_attn
            ),
            (16, 128, 1, false)
        );
        let t = Tuning::default().parse("brpw=2").unwrap();
        assert_eq!((t.rows_per_warp, t.batch_rows_per_warp), (0, 2));
        // Clamped to what the kernels handle.
        let t = Tuning::default().parse("splits=999,kmin=1").unwrap();
        assert_eq!((t.attn_splits, t.attn_min_keys), (128, 16));
        let t = Tuning::default()
            .parse("nsl=1,akeys=4,skipnorm=1,skipswiglu=1")
            .unwrap();
        assert_eq!((t.norm_slices, t.attn_keys_per_step), (1, 4));
        assert!(t.skip_norm && t.skip_swiglu);
        assert_eq!(Tuning::default().norm_slices, 8);
        assert_eq!(Tuning::default().parse("").unwrap(), Tuning::default());
        let t = Tuning::default()
            .parse("gqa=1024,gqaswa=off,gqasplits=500,gqamin=8")
            .unwrap();
        assert_eq!((t.gqa_full_from, t.gqa_swa_from), (1024, u32::MAX));
        assert_eq!((t.gqa_splits, t.gqa_min_keys), (256, 16));
        assert_eq!(
            Tuning::default().parse("gqapass=70").unwrap().gqa_pass_keys,
            64
        );
        let t = Tuning::default()
            .parse("nv=2x4,carve=-1,gcarve=14,asmem=0,apf=24")
            .unwrap();
        assert_eq!(
            (t.nvfp4, t.gemv_carveout, t.attn_prefetch_mb),
            (Some((2, 4)), 14, 24.0)
        );
        assert_eq!(Tuning::default().parse("gqr=2").unwrap().gqa_reg, 2);
        assert_eq!(Tuning::default().parse("gqr=4").unwrap().gqa_reg, 4);
        assert_eq!(Tuning::default().parse("gqcdiag=8").unwrap().gqc_diag, 8);
        assert!(Tuning::default().parse("gqcdiag=2").is_err());
        // Without clusters (before sm_90) the cluster kernels give way to the register one.
        let old = Tuning::default().fit_device((8, 0));
        assert_eq!(
            (
                old.gqa_reg,
                old.gqa_swa_reg,
                old.gqa_full_from,
                old.gqa_swa_from
            ),
            (1, 1, 4096, u32::MAX)
        );
        let h = Tuning::default().fit_device((9, 0));
        assert_eq!(
            (h.gqa_reg, h.gqa_swa_reg, h.gqa_full_from, h.gqa_swa_from),
            (4, 3, 1024, 1024)
        );
        assert_eq!(Tuning::default().parse("nvpt=16").unwrap().norm_vpt, 16);
        assert!(Tuning::default().parse("nvpt=4").is_err());
        let swa = Tuning::default()
            .parse("gqrswa=3")
            .unwrap()
            .fit_device((8, 6));
        assert_eq!(swa.gqa_swa_reg, 1);
        assert!(!Tuning::default().parse("fa=0").unwrap().flash_prefill);
        assert!(Tuning::default().parse("fa=2").is_err());
        assert_eq!(
            Tuning::default().parse("tile=65").unwrap().q4k_tile_from,
            65
        );
        assert_eq!(Tuning::default().parse("tile=0").unwrap().q4k_tile_from, 1);
        for bad in [
            "kmin", "kmin=x", "nosuch=1", "q4k=1", "akeys=5", "nsl=x", "gqa=-1", "nv=2x2", "nv=2",
            "carve=x", "gqr=5", "tile=x",
        ] {
            assert!(Tuning::default().parse(bad).is_err(), "{bad}");
        }
    }
}
