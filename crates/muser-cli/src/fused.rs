//! `muser bench --device cuda --fused`: Muse Glimmer through muser-cuda's fused forward
//! (`muser_cuda::glimmer`: quantized GEMVs, each decode step one CUDA graph replay, bf16 cuBLAS
//! prefill), the path `docs/benchmarks.md` measures beside llama.cpp. The engine's `Model` on
//! `CudaBackend` (`--device cuda` without `--fused`) runs every architecture and serves; this
//! one runs only muse-glimmer, greedily, one sequence.

use anyhow::Context;
use muser_cuda::glimmer::{CudaGlimmer, DecodeGraph, GpuOptions};
use muser_cuda::runtime::Gpu;
use muser_gguf::GgufFile;
use muser_model::ModelInfo;
use std::path::Path;
use std::time::Instant;

/// Largest prefill chunk the fused model is built for (its scratch grows with it).
const MAX_CHUNK: usize = 2048;

/// A muse-glimmer model on the first GPU, sized for one `pp n_prompt` and one `tg n_gen` test.
pub struct FusedBench {
    g: GgufFile,
    m: CudaGlimmer,
    graph: DecodeGraph,
}

impl FusedBench {
    pub fn load(path: &Path, n_prompt: usize, n_gen: usize) -> anyhow::Result<FusedBench> {
        let g = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
        let gpu = Gpu::new(0).context("starting CUDA")?;
        let opts = GpuOptions {
            // Generation starts at position 0 and may take n_gen + 1 steps with its warm-up.
            n_ctx: n_prompt.max(n_gen + 1).max(16),
            max_chunk: n_prompt.clamp(1, MAX_CHUNK),
            n_seq: 1,
            swa_ring: true,
        };
        let m = CudaGlimmer::load(gpu, &g, opts).context("loading the fused muse-glimmer model")?;
        let graph = m.capture_decode()?;
        Ok(FusedBench { g, m, graph })
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.g
    }

    pub fn info(&self) -> &ModelInfo {
        self.m.info()
    }

    /// Weight bytes one decode step reads.
    pub fn decode_weight_bytes(&self) -> u64 {
        self.m.decode_weight_bytes() as u64
    }

    /// Prefill of `tokens` into an empty cache; tokens per second.
    pub fn prefill(&mut self, tokens: &[u32]) -> anyhow::Result<f64> {
        self.m.sync()?;
        let t = Instant::now();
        self.m.prefill(tokens, 0)?;
        Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
    }

    /// `n` greedy tokens after `token` from position 0 (graph replays); tokens per second.
    pub fn generate(&mut self, token: u32, n: usize) -> anyhow::Result<f64> {
        self.m.sync()?;
        let t = Instant::now();
        self.m.generate(&self.graph, token, 0, n)?;
        Ok(n as f64 / t.elapsed().as_secs_f64())
    }
}
