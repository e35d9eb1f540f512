//! `muser bench --device cuda --fused`: Muse Glimmer through muser-cuda's fused forward
//! (`muser_cuda::glimmer`: quantized GEMVs, each decode step one CUDA graph replay, bf16 cuBLAS
//! prefill), the path `docs/benchmarks.md` measures beside llama.cpp. The engine's `Model` on
//! `CudaBackend` (`--device cuda` without `--fused`) runs every architecture and serves; this
//! one runs only muse-glimmer, greedily, and decodes at most `MAX_GEMV_BATCH` sequences per
//! step (a batched row with more says so).

use crate::cmd_bench::batched::{Config, Outcome, Times};
use crate::cmd_bench::Tokens;
use anyhow::Context;
use muser_cuda::glimmer::{CudaGlimmer, DecodeGraph, GpuOptions};
use muser_cuda::layout::MAX_GEMV_BATCH;
use muser_cuda::runtime::Gpu;
use muser_gguf::GgufFile;
use muser_model::ModelInfo;
use std::path::Path;
use std::time::Instant;

/// Largest prefill chunk the fused model is built for (its scratch grows with it).
const MAX_CHUNK: usize = 2048;

/// A muse-glimmer model on the first GPU, sized for the run's tests.
pub struct FusedBench {
    g: GgufFile,
    m: CudaGlimmer,
    /// Captured decode steps, index `sequences - 1`.
    graphs: Vec<Option<DecodeGraph>>,
}

impl FusedBench {
    /// Loads `path` for sequences of up to `n_ctx` positions, prompt chunks of `chunk` tokens
    /// (at most [`MAX_CHUNK`]) and `n_seq` sequences (at most `MAX_GEMV_BATCH`).
    pub fn load(path: &Path, n_ctx: usize, chunk: usize, n_seq: usize) -> anyhow::Result<Self> {
        let g = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
        let gpu = Gpu::new(0).context("starting CUDA")?;
        let opts = GpuOptions {
            n_ctx: n_ctx.max(16),
            max_chunk: chunk.clamp(1, MAX_CHUNK),
            n_seq: n_seq.clamp(1, MAX_GEMV_BATCH),
            swa_ring: true,
        };
        let m = CudaGlimmer::load(gpu, &g, opts).context("loading the fused muse-glimmer model")?;
        Ok(FusedBench {
            g,
            m,
            graphs: Vec::new(),
        })
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.g
    }

    pub fn info(&self) -> &ModelInfo {
        self.m.info()
    }

    /// The captured decode step of `nb` sequences.
    fn graph(&mut self, nb: usize) -> anyhow::Result<&DecodeGraph> {
        if self.graphs.len() < nb {
            self.graphs.resize_with(nb, || None);
        }
        let slot = &mut self.graphs[nb - 1];
        if slot.is_none() {
            *slot = Some(self.m.capture_decode_batch(nb)?);
        }
        slot.as_ref().context("no decode graph")
    }

    /// Prefill of `tokens` (none: nothing) into sequence 0 at positions `pos..`; returns
    /// when the device is done.
    pub fn prefill(&mut self, tokens: &[u32], pos: usize) -> anyhow::Result<()> {
        if !tokens.is_empty() {
            self.m.prefill(tokens, pos)?;
        }
        Ok(())
    }

    /// `n` greedy tokens of sequence 0 after `token` at `pos` (graph replays).
    pub fn generate(&mut self, token: u32, pos: usize, n: usize) -> anyhow::Result<()> {
        if n > 0 {
            self.graph(1)?;
            let g = self.graphs[0].as_ref().context("no decode graph")?;
            self.m.generate(g, token, pos, n)?;
        }
        Ok(())
    }

    /// One llama-batched-bench row: each sequence's prompt (one prefill per sequence), then
    /// `tg` decode steps of all `pl` sequences (graph replays).
    pub fn batched(&mut self, c: Config, rng: &mut Tokens) -> Outcome {
        if c.pl > MAX_GEMV_BATCH {
            return Outcome::Unsupported(format!(
                "the fused forward decodes 1..={MAX_GEMV_BATCH} sequences per step"
            ));
        }
        match self.batched_times(c, rng) {
            Ok(t) => Outcome::Timed(t),
            Err(e) => Outcome::Failed(format!("{e:#}")),
        }
    }

    fn batched_times(&mut self, c: Config, rng: &mut Tokens) -> anyhow::Result<Times> {
        let n_vocab = self.info().n_vocab;
        let prompts: Vec<Vec<u32>> = (0..c.pl).map(|_| rng.take(c.pp, n_vocab)).collect();
        let firsts: Vec<u32> = (0..c.pl).map(|_| rng.next(n_vocab)).collect();
        self.graph(c.pl)?;
        self.m.sync()?;
        let start = Instant::now();
        for (seq, p) in prompts.iter().enumerate() {
            self.m.prefill_seq(p, 0, seq)?;
        }
        let t_pp = start.elapsed().as_secs_f64();
        let g = self.graphs[c.pl - 1].as_ref().context("no decode graph")?;
        let start = Instant::now();
        self.m.generate_batch(g, &firsts, &vec![c.pp; c.pl], c.tg)?;
        let t_tg = start.elapsed().as_secs_f64();
        Ok(Times { t_pp, t_tg })
    }
}
