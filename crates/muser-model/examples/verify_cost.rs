//! What a speculative verification's rows cost, per component, on the CPU backend: one
//! sequence at a realistic depth runs batches of `1 + k` rows computed alone (as the engine
//! verifies `k` drafts), and every op is timed through a wrapping backend. Prints, per `k`,
//! the pass time in one-row passes and each component's share of the row cost `c`
//! (`pass(1 + k) = pass(1) · (1 + c·k)`):
//! `cargo run --release -p muser-model --example verify_cost -- MODEL [DEPTH] [THREADS] [REPS]`.
//! Components: the Q4/Q5/Q8 matrices of the layers, the output matrix, the attention, the
//! activation quantization (timed apart: each matmul's input quantized once more into a
//! scratch buffer, the time taken out of the matmul's), and everything else (norms, RoPE,
//! adds, SwiGLU, embedding rows). On one thread the times are the thread's CPU time (robust on
//! a shared machine), on more the wall clock; best of `REPS` per component, the `k`
//! interleaved so that a noisy neighbour hits every `k` alike. Read the ratios, not the
//! milliseconds.

use muser_gguf::GgmlType;
use muser_model::cpu::Mat;
use muser_model::{
    AttnInput, Backend, Batch, CpuBackend, KvCache, KvType, Model, ModelError, RopeMode, Weight,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// What the wrapper times apart.
#[derive(Clone, Copy)]
enum Part {
    Layers,
    Output,
    Attention,
    Quantize,
    Other,
    /// The whole pass.
    Pass,
}
/// The parts' names, in [`Part`]'s order.
const PARTS: [&str; 5] = [
    "layer matrices",
    "output matrix",
    "attention",
    "act. quantization",
    "other ops",
];

/// The CPU backend with every op timed into `ns[part]`.
struct Timed {
    cpu: CpuBackend,
    ns: Arc<Counters>,
}

/// Nanoseconds on this thread's clock: its CPU time on one thread (a neighbour's processes on
/// the same core then cost nothing), the wall clock otherwise.
fn now_ns(one_thread: bool) -> u64 {
    if one_thread {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid timespec to write.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
    } else {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// Nanoseconds per [`Part`].
type Counters = [AtomicU64; 6];

/// The counters in milliseconds, zeroed.
fn take(ns: &Counters) -> [f64; 6] {
    std::array::from_fn(|i| ns[i].swap(0, Ordering::Relaxed) as f64 / 1e6)
}

impl Timed {
    fn clock(&self) -> u64 {
        now_ns(self.cpu.threads() == 1)
    }

    fn time<R>(&self, part: Part, f: impl FnOnce() -> R) -> R {
        let t = self.clock();
        let r = f();
        self.ns[part as usize].fetch_add(self.clock() - t, Ordering::Relaxed);
        r
    }
}

impl Backend for Timed {
    type Act = Mat;
    fn numerics(&self) -> String {
        self.cpu.numerics()
    }
    fn supports(&self, ty: GgmlType) -> bool {
        self.cpu.supports(ty)
    }
    fn computes_rows_alone(&self) -> bool {
        self.cpu.computes_rows_alone()
    }
    fn compute_alone(&self, x: &mut Mat, rows: &[bool]) -> Result<(), ModelError> {
        self.cpu.compute_alone(x, rows)
    }
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        // the whole pass, on the thread that runs it
        self.cpu.run(|| self.time(Part::Pass, f))
    }
    fn threads(&self) -> usize {
        self.cpu.threads()
    }
    fn upload(&self, r: usize, c: usize, d: Vec<f32>) -> Result<Mat, ModelError> {
        self.cpu.upload(r, c, d)
    }
    fn download(&self, a: &Mat) -> Result<Vec<f32>, ModelError> {
        self.cpu.download(a)
    }
    fn dims(&self, a: &Mat) -> (usize, usize) {
        self.cpu.dims(a)
    }
    fn get_rows(&self, t: &Weight, ids: &[u32]) -> Result<Mat, ModelError> {
        self.time(Part::Other, || self.cpu.get_rows(t, ids))
    }
    fn matmul(&self, w: &Weight, x: &Mat) -> Result<Mat, ModelError> {
        let part = match w.name {
            "output.weight" | "token_embd.weight" => Part::Output,
            _ => Part::Layers,
        };
        let vt = muser_quant::vec_dot_type(w.ty);
        let quantized = vt != w.ty && muser_quant::can_quantize(vt);
        let q_ns = if quantized {
            let rb = muser_quant::row_size(vt, w.n_in).expect("row size");
            let mut buf = vec![0u8; rb * x.rows];
            let t = self.clock();
            for (src, dst) in x.data.chunks_exact(w.n_in).zip(buf.chunks_exact_mut(rb)) {
                muser_quant::quantize_activations(vt, src, dst).expect("quantize");
            }
            self.clock() - t
        } else {
            0
        };
        self.ns[Part::Quantize as usize].fetch_add(q_ns, Ordering::Relaxed);
        let t = self.clock();
        let y = self.cpu.matmul(w, x);
        let ns = (self.clock() - t).saturating_sub(q_ns);
        self.ns[part as usize].fetch_add(ns, Ordering::Relaxed);
        y
    }
    fn rms_norm(&self, x: &Mat, g: usize, e: f32, w: Option<&[f32]>) -> Result<Mat, ModelError> {
        self.time(Part::Other, || self.cpu.rms_norm(x, g, e, w))
    }
    fn rms_norm_mut(
        &self,
        x: &mut Mat,
        g: usize,
        e: f32,
        w: Option<&[f32]>,
    ) -> Result<(), ModelError> {
        self.time(Part::Other, || self.cpu.rms_norm_mut(x, g, e, w))
    }
    fn rope(
        &self,
        x: &mut Mat,
        hd: usize,
        n_rot: usize,
        pos: &[u32],
        base: f32,
        mode: RopeMode,
    ) -> Result<(), ModelError> {
        self.time(Part::Other, || self.cpu.rope(x, hd, n_rot, pos, base, mode))
    }
    fn add(&self, x: &mut Mat, y: &Mat) -> Result<(), ModelError> {
        self.time(Part::Other, || self.cpu.add(x, y))
    }
    fn add_row(&self, x: &mut Mat, b: &[f32]) -> Result<(), ModelError> {
        self.time(Part::Other, || self.cpu.add_row(x, b))
    }
    fn mul_sigmoid(&self, x: &mut Mat, g: &Mat) -> Result<(), ModelError> {
        self.time(Part::Other, || self.cpu.mul_sigmoid(x, g))
    }
    fn swiglu(&self, g: &mut Mat, u: &Mat) -> Result<(), ModelError> {
        self.time(Part::Other, || self.cpu.swiglu(g, u))
    }
    fn scale(&self, x: &mut Mat, s: f32) -> Result<(), ModelError> {
        self.time(Part::Other, || self.cpu.scale(x, s))
    }
    fn softcap(&self, x: &mut Mat, cap: f32) -> Result<(), ModelError> {
        self.time(Part::Other, || self.cpu.softcap(x, cap))
    }
    fn select_rows(&self, x: &Mat, rows: &[usize]) -> Result<Mat, ModelError> {
        self.time(Part::Other, || self.cpu.select_rows(x, rows))
    }
    fn attention(
        &self,
        kv: &mut KvCache,
        at: &AttnInput,
        q: &Mat,
        k: &Mat,
        v: &Mat,
    ) -> Result<Mat, ModelError> {
        self.time(Part::Attention, || self.cpu.attention(kv, at, q, k, v))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        return Err("usage: verify_cost MODEL [DEPTH] [THREADS] [REPS]".into());
    };
    let depth: u32 = args.get(2).map_or(Ok(400), |s| s.parse())?;
    let threads: usize = args.get(3).map_or(Ok(1), |s| s.parse())?;
    let reps: usize = args.get(4).map_or(Ok(20), |s| s.parse())?;
    let ks = [0u32, 1, 2, 4, 8];
    let ns: Arc<Counters> = Arc::default();
    let timed = Timed {
        cpu: CpuBackend::new(threads)?,
        ns: ns.clone(),
    };
    let model = Model::load_with(path.as_ref(), timed)?;
    let n_vocab = model.info().n_vocab as u32;
    // Tokens of no meaning: the costs do not depend on them.
    let token = |i: u32| (i.wrapping_mul(2_654_435_761) >> 8) % (n_vocab - 1) + 1;
    let mut kv = model.new_kv(depth as usize + 64, 1, KvType::F16)?;
    let prompt: Vec<u32> = (0..depth).map(token).collect();
    for (i, c) in prompt.chunks(256).enumerate() {
        model.forward(&mut kv, &Batch::single(0, c, i as u32 * 256, true))?;
    }
    take(&ns);
    // best[k][part] (the last: time outside the ops)
    let mut best = vec![[f64::INFINITY; PARTS.len() + 1]; ks.len()];
    for _ in 0..reps {
        for (i, &k) in ks.iter().enumerate() {
            let mut b = Batch::default();
            for j in 0..=k {
                b.push(token(depth + j), depth + j, 0, true);
            }
            b.lone_seqs = vec![0];
            model.forward(&mut kv, &b)?;
            let mut parts = take(&ns).to_vec();
            let pass = parts.pop().expect("the pass");
            // the scratch quantization ran on top of the matmul's own
            let quant = parts[Part::Quantize as usize];
            // (clamped: the pass and the ops are timed on different threads)
            parts.push((pass - parts.iter().sum::<f64>() - quant).max(0.0));
            for (m, p) in best[i].iter_mut().zip(parts) {
                *m = m.min(p);
            }
            kv.truncate(0, depth);
        }
    }
    // A pass: the best of each part, added (a neighbour's burst lands in one part of one rep).
    let best_pass: Vec<f64> = best.iter().map(|b| b.iter().sum()).collect();
    let one = best_pass[0];
    println!(
        "depth {depth}, {threads} thread(s), best of {reps}; one-row pass {one:.3} ms \
         (components: {})",
        PARTS
            .iter()
            .copied()
            .chain(["outside ops"])
            .zip(best[0])
            .map(|(n, t)| format!("{n} {:.0}%", 100.0 * t / one))
            .collect::<Vec<_>>()
            .join(", ")
    );
    print!("| drafts k | pass / one-row pass | c |");
    for n in PARTS {
        print!(" {n} |");
    }
    println!(
        " outside ops |\n|---|---|---|{}",
        "---|".repeat(PARTS.len() + 1)
    );
    for (i, &k) in ks.iter().enumerate().skip(1) {
        let c = (best_pass[i] / one - 1.0) / k as f64;
        print!("| {k} | {:.2} | {c:.3} |", best_pass[i] / one);
        for (b, b0) in best[i].iter().zip(&best[0]) {
            print!(" {:.3} |", (b - b0) / one / k as f64);
        }
        println!();
    }
    Ok(())
}
