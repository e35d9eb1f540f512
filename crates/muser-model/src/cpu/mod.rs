//! The CPU backend: ggml's CPU numerics, multi-threaded with rayon. Weights stay in the memory
//! map; activations are plain row-major `Vec<f32>`.

// Lane loops index several arrays in step, mirroring the SIMD lanes they model.
#[allow(clippy::needless_range_loop)]
mod attention;
#[allow(clippy::needless_range_loop)]
mod kquant;
#[allow(clippy::needless_range_loop)]
pub(crate) mod math;
#[allow(clippy::needless_range_loop)]
mod matmul;
pub mod numerics;

use crate::backend::{AttnInput, Backend, RopeMode, Weight};
use crate::error::ModelError;
use crate::kv::{HostKv, KvCache};
use math::fma_fn;
/// ggml's `ggml_vec_soft_max_f32` in an order's lanes, for other CPU code that reproduces ggml
/// (the image encoder's attention).
pub use math::soft_max_tile;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A row-major f32 matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
    /// Empty, or per row: computed as a one-row batch computes it
    /// ([`Backend::compute_alone`]).
    pub alone: Vec<bool>,
}

impl Mat {
    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// Multi-threaded CPU implementation of [`Backend`].
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
    /// The floating-point order of the kernels that depend on it (see [`numerics`]).
    numerics: numerics::Numerics,
    /// RoPE cos/sin per (base, n_rot), by position: computed once, shared by Q and K of every
    /// layer and every later batch.
    rope: Mutex<Vec<RopeTable>>,
}

struct RopeTable {
    base: u32,
    n_rot: usize,
    /// `[pos][n_rot]`: cos, sin of each pair's angle.
    cs: Arc<Vec<f32>>,
}

/// Positions a RoPE table grows by.
const ROPE_GROW: usize = 256;

/// Idle polls after which a pool thread stops spinning through a forward pass (a few ms).
const SPIN_IDLE_MAX: u32 = 1 << 16;

/// Elements below which an element-wise op runs on the calling thread alone.
const PAR_MIN: usize = 1 << 13;

impl CpuBackend {
    /// A backend running on `threads` threads (0 = one per core), in the portable order.
    pub fn new(threads: usize) -> Result<CpuBackend, ModelError> {
        CpuBackend::with_numerics(threads, numerics::Numerics::PORTABLE)
    }

    /// A backend computing in `numerics` (a profile [`numerics::Numerics::resolve`] accepted).
    pub fn with_numerics(
        threads: usize,
        numerics: numerics::Numerics,
    ) -> Result<CpuBackend, ModelError> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("muser-cpu-{i}"))
            .build()
            .map_err(|e| {
                ModelError::BadModel(format!("cannot start {threads} CPU threads: {e}"))
            })?;
        Ok(CpuBackend {
            pool,
            threads,
            numerics,
            rope: Mutex::new(Vec::new()),
        })
    }

    /// Calls `f(first_unit, chunk)` on `data` cut into chunks of whole `unit`-element units,
    /// in parallel when there is enough work. Each unit is processed exactly as it would be
    /// alone, so the split never changes a result.
    fn par_units(&self, data: &mut [f32], unit: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
        use rayon::prelude::*;
        let unit = unit.max(1);
        let n_units = data.len() / unit;
        let parts = (data.len() / PAR_MIN).min(4 * self.threads).min(n_units);
        if self.threads == 1 || parts < 2 {
            f(0, data);
            return;
        }
        let per = n_units.div_ceil(parts);
        self.pool.install(|| {
            data.par_chunks_mut(per * unit)
                .enumerate()
                .for_each(|(i, c)| f(i * per, c))
        });
    }

    /// The cos/sin table of `base` for positions `0..=max_pos` (at least).
    fn rope_table(&self, base: f32, n_rot: usize, max_pos: usize) -> Arc<Vec<f32>> {
        let mut tables = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        let at = match tables
            .iter()
            .position(|t| t.base == base.to_bits() && t.n_rot == n_rot)
        {
            Some(i) => i,
            None => {
                tables.push(RopeTable {
                    base: base.to_bits(),
                    n_rot,
                    cs: Arc::new(Vec::new()),
                });
                tables.len() - 1
            }
        };
        let t = &mut tables[at];
        let have = t.cs.len() / n_rot.max(1);
        if have <= max_pos {
            let want = (max_pos + 1).next_multiple_of(ROPE_GROW);
            let mut cs = Vec::with_capacity(want * n_rot);
            cs.extend_from_slice(&t.cs);
            cs.resize(want * n_rot, 0.0);
            rope_fill(&mut cs[have * n_rot..], have, n_rot, base);
            t.cs = Arc::new(cs);
        }
        t.cs.clone()
    }
}

fma_fn! {
/// cos, sin of every pair's angle for positions `first..` (`cs` holds whole positions), as
/// ggml's RoPE cache: `theta = pos · theta_scale^i`, multiplied up pair by pair.
fn rope_fill(cs: &mut [f32], first: usize, n_rot: usize, base: f32) {
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    for (p, c) in cs.chunks_exact_mut(n_rot).enumerate() {
        let mut theta = (first + p) as f32;
        for i in (0..n_rot).step_by(2) {
            c[i] = theta.cos();
            c[i + 1] = theta.sin();
            theta *= theta_scale;
        }
    }
}
}

fma_fn! {
fn rope_rows(data: &mut [f32], cols: usize, head_dim: usize, n_rot: usize, pos: &[u32], table: &[f32], neox: bool) {
    for (r, row) in data.chunks_exact_mut(cols).enumerate() {
        let p = pos[r] as usize;
        let cs = &table[p * n_rot..(p + 1) * n_rot];
        for head in row.chunks_exact_mut(head_dim) {
            for i in (0..n_rot).step_by(2) {
                let (a, b) = if neox { (i / 2, i / 2 + n_rot / 2) } else { (i, i + 1) };
                let (c, s) = (cs[i], cs[i + 1]);
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0.mul_add(c, -(x1 * s));
                head[b] = x0.mul_add(s, x1 * c);
            }
        }
    }
}
}

impl Backend for CpuBackend {
    type Act = Mat;

    /// The CPU backend's numerics: `cpu:` and the numerics profile's tag, so caches computed
    /// under two orders never share an engine ABI.
    fn numerics(&self) -> String {
        format!("cpu:{}", self.numerics_tag().unwrap_or_default())
    }

    fn supports(&self, ty: muser_gguf::GgmlType) -> bool {
        matmul::supported(ty)
    }

    fn computes_rows_alone(&self) -> bool {
        true
    }

    fn compute_alone(&self, x: &mut Mat, rows: &[bool]) -> Result<(), ModelError> {
        if rows.len() != x.rows {
            return Err(ModelError::BadBatch(format!(
                "{} row marks for {} rows",
                rows.len(),
                x.rows
            )));
        }
        x.alone = rows.to_vec();
        Ok(())
    }

    fn threads(&self) -> usize {
        self.threads
    }

    fn numerics_tag(&self) -> Option<String> {
        Some(self.numerics.tag())
    }

    /// Runs `f` (a whole forward pass) on one of the pool's threads, so that every op inside
    /// splits its work among the pool directly instead of handing it over from outside. The
    /// other threads stay awake until `f` returns, taking each op's work as soon as it is
    /// offered (as ggml's threads spin through a graph): waking a sleeping thread per op costs
    /// about as long as a decode matmul takes.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.threads == 1 {
            return self.pool.install(f);
        }
        let done = AtomicBool::new(false);
        let f = Mutex::new(Some(f));
        let out = Mutex::new(None);
        self.pool.broadcast(|ctx| {
            if ctx.index() == 0 {
                /// Releases the other threads even when `f` panics.
                struct Done<'a>(&'a AtomicBool);
                impl Drop for Done<'_> {
                    fn drop(&mut self) {
                        self.0.store(true, Ordering::Release);
                    }
                }
                let _done = Done(&done);
                let f = f.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(f) = f {
                    let r = f();
                    *out.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                }
            } else {
                let mut idle = 0u32;
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Executed) {
                        idle = 0;
                    } else {
                        idle += 1;
                        // A long serial stretch: fall back to rayon's own idle loop (which
                        // sleeps and is woken for new work) for the rest of the pass.
                        if idle > SPIN_IDLE_MAX {
                            break;
                        }
                        // Give the core away now and then: on a busy machine the thread
                        // doing the work may be waiting for it.
                        if idle.is_multiple_of(64) {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                }
            }
        });
        out.into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .expect("thread 0 of the pool ran the forward pass")
    }

    fn upload(&self, rows: usize, cols: usize, data: Vec<f32>) -> Result<Mat, ModelError> {
        if data.len() != rows * cols {
            return Err(ModelError::BadBatch(format!(
                "{} values for a {rows}×{cols} matrix",
                data.len()
            )));
        }
        Ok(Mat {
            rows,
            cols,
            data,
            alone: Vec::new(),
        })
    }

    fn download(&self, a: &Mat) -> Result<Vec<f32>, ModelError> {
        Ok(a.data.clone())
    }

    fn dims(&self, a: &Mat) -> (usize, usize) {
        (a.rows, a.cols)
    }

    fn get_rows(&self, table: &Weight, ids: &[u32]) -> Result<Mat, ModelError> {
        let rb = table.row_bytes();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.n_out) {
            return Err(ModelError::BadBatch(format!(
                "token id {id} >= n_vocab {}",
                table.n_out
            )));
        }
        let mut data = vec![0f32; ids.len() * table.n_in];
        let err = Mutex::new(None);
        self.par_units(&mut data, table.n_in, |first, chunk| {
            for (i, out) in chunk.chunks_exact_mut(table.n_in).enumerate() {
                let id = ids[first + i] as usize;
                if let Err(e) =
                    muser_quant::dequantize_row(table.ty, &table.data[id * rb..(id + 1) * rb], out)
                {
                    *err.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                }
            }
        });
        if let Some(e) = err.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(ModelError::Quant(format!("{}: {e}", table.name)));
        }
        Ok(Mat {
            rows: ids.len(),
            cols: table.n_in,
            data,
            alone: Vec::new(),
        })
    }

    fn matmul(&self, w: &Weight, x: &Mat) -> Result<Mat, ModelError> {
        let data = self
            .pool
            .install(|| matmul::matmul(self.numerics.order, w, &x.data, x.rows, &x.alone))?;
        Ok(Mat {
            rows: x.rows,
            cols: w.n_out,
            data,
            alone: x.alone.clone(),
        })
    }

    fn rms_norm(
        &self,
        x: &Mat,
        group: usize,
        eps: f32,
        weight: Option<&[f32]>,
    ) -> Result<Mat, ModelError> {
        let mut y = x.clone();
        self.rms_norm_mut(&mut y, group, eps, weight)?;
        Ok(y)
    }

    fn rms_norm_mut(
        &self,
        x: &mut Mat,
        group: usize,
        eps: f32,
        weight: Option<&[f32]>,
    ) -> Result<(), ModelError> {
        self.par_units(&mut x.data, group, |_, c| {
            math::rms_norm_groups(c, group, eps, weight)
        });
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Mat,
        head_dim: usize,
        n_rot: usize,
        pos: &[u32],
        base: f32,
        mode: RopeMode,
    ) -> Result<(), ModelError> {
        let Some(&max_pos) = pos.iter().max() else {
            return Ok(());
        };
        let table = self.rope_table(base, n_rot, max_pos as usize);
        let cols = x.cols;
        self.par_units(&mut x.data, cols, |first, c| {
            rope_rows(
                c,
                cols,
                head_dim,
                n_rot,
                &pos[first..],
                &table,
                mode == RopeMode::Neox,
            )
        });
        Ok(())
    }

    fn add(&self, x: &mut Mat, y: &Mat) -> Result<(), ModelError> {
        self.par_units(&mut x.data, 1, |first, c| {
            c.iter_mut()
                .zip(&y.data[first..])
                .for_each(|(a, b)| *a += b)
        });
        Ok(())
    }

    fn add_row(&self, x: &mut Mat, b: &[f32]) -> Result<(), ModelError> {
        self.par_units(&mut x.data, x.cols, |_, c| {
            for row in c.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(a, b)| *a += b);
            }
        });
        Ok(())
    }

    fn mul_sigmoid(&self, x: &mut Mat, gate: &Mat) -> Result<(), ModelError> {
        self.par_units(&mut x.data, 1, |first, c| {
            c.iter_mut()
                .zip(&gate.data[first..])
                .for_each(|(a, &g)| *a *= 1.0 / (1.0 + (-g).exp()))
        });
        Ok(())
    }

    fn swiglu(&self, gate: &mut Mat, up: &Mat) -> Result<(), ModelError> {
        // Whole rows: the order's vector body and libm tail are counted from each row's start.
        let (cols, order) = (gate.cols, self.numerics.order);
        self.par_units(&mut gate.data, cols, |first, c| {
            for (i, g) in c.chunks_exact_mut(cols).enumerate() {
                let at = (first + i) * cols;
                math::swiglu_fast(order, g, &up.data[at..at + cols]);
            }
        });
        Ok(())
    }

    fn scale(&self, x: &mut Mat, s: f32) -> Result<(), ModelError> {
        self.par_units(&mut x.data, 1, |_, c| c.iter_mut().for_each(|v| *v *= s));
        Ok(())
    }

    fn softcap(&self, x: &mut Mat, cap: f32) -> Result<(), ModelError> {
        let inv = 1.0 / cap;
        self.par_units(&mut x.data, 1, |_, c| {
            c.iter_mut().for_each(|v| *v = (*v * inv).tanh() * cap)
        });
        Ok(())
    }

    fn select_rows(&self, x: &Mat, rows: &[usize]) -> Result<Mat, ModelError> {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            data.extend_from_slice(x.row(r));
        }
        let alone = match x.alone.is_empty() {
            true => Vec::new(),
            false => rows.iter().map(|&r| x.alone[r]).collect(),
        };
        Ok(Mat {
            rows: rows.len(),
            cols: x.cols,
            data,
            alone,
        })
    }

    fn attention(
        &self,
        kv: &mut KvCache,
        at: &AttnInput,
        q: &Mat,
        k: &Mat,
        v: &Mat,
    ) -> Result<Mat, ModelError> {
        let layout = kv.layout().clone();
        let il = at.layer;
        let swa = layout.is_swa[il];
        let row = at.n_head_kv * at.head_dim;
        let not_host = || ModelError::Kv("the CPU backend needs a host KV cache".into());
        // Store this batch's K and V (converted to the cache type) into their cells.
        let host = kv
            .store_mut()
            .as_any_mut()
            .downcast_mut::<HostKv>()
            .ok_or_else(not_host)?;
        for (seq, idx) in at.groups {
            let (kb, vb) = host.layer_mut(*seq, il);
            for &t in idx {
                let cell = if swa {
                    at.plan.swa_cell[t]
                } else {
                    at.plan.base_cell[t]
                } as usize;
                attention::store(kb, layout.dtype, cell * row, k.row(t));
                attention::store(vb, layout.dtype, cell * row, v.row(t));
            }
        }
        let kv_ro: &KvCache = kv;
        let host = kv_ro
            .store()
            .as_any()
            .downcast_ref::<HostKv>()
            .ok_or_else(not_host)?;
        // A sequence computed alone attends row by row, each row as the one-token step at its
        // position: a group of its own over the cells that step would visit.
        let pick = |(nb, ns): (u32, u32)| if swa { ns } else { nb } as usize;
        let mut n_kvs: Vec<usize> = at.plan.n_kv.iter().map(|&(_, b, s)| pick((b, s))).collect();
        let split: Vec<(u32, Vec<usize>)>;
        let mut groups = at.groups;
        if at.plan.alone_n_kv.iter().any(|a| !a.is_empty()) {
            n_kvs.clear();
            let mut rows = Vec::with_capacity(at.pos.len());
            for (g, (seq, idx)) in at.groups.iter().enumerate() {
                match at.plan.alone_n_kv.get(g).filter(|a| !a.is_empty()) {
                    None => {
                        rows.push((*seq, idx.clone()));
                        n_kvs.push(pick((at.plan.n_kv[g].1, at.plan.n_kv[g].2)));
                    }
                    Some(steps) => {
                        for (&t, &step) in idx.iter().zip(steps) {
                            rows.push((*seq, vec![t]));
                            n_kvs.push(pick(step));
                        }
                    }
                }
            }
            split = rows;
            groups = &split;
        }
        let views: Vec<attention::View> = groups
            .iter()
            .map(|(seq, _)| {
                let (kb, vb) = host.layer(*seq, il);
                attention::View {
                    k: kb,
                    v: vb,
                    cell_pos: kv_ro.cell_pos(*seq, il),
                    dtype: layout.dtype,
                    row,
                    head_dim: at.head_dim,
                    n_swa: if swa { layout.n_swa } else { 0 },
                }
            })
            .collect();
        let at = AttnInput { groups, ..*at };
        let data = self.pool.install(|| {
            attention::run(
                self.numerics,
                &at,
                &views,
                &n_kvs,
                self.threads,
                &q.data,
                q.rows,
            )
        });
        Ok(Mat {
            rows: q.rows,
            cols: at.n_head * at.head_dim,
            data,
            alone: q.alone.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mat(rows: usize, cols: usize, seed: u32) -> Mat {
        let mut s = seed;
        let data = (0..rows * cols)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0
            })
            .collect();
        Mat {
            rows,
            cols,
            data,
            alone: Vec::new(),
        }
    }

    /// Every element-wise op gives the same bits split over the pool as on one thread, for
    /// rows whose length is not a multiple of the 16-lane body (SwiGLU's libm tail).
    #[test]
    fn split_ops_equal_one_thread() {
        let (one, two) = (CpuBackend::new(1).unwrap(), CpuBackend::new(2).unwrap());
        let (rows, cols, hd) = (700, 40, 8);
        let x = mat(rows, cols, 1);
        let y = mat(rows, cols, 2);
        let w: Vec<f32> = (0..cols).map(|i| 0.5 + i as f32 / 32.0).collect();
        let pos: Vec<u32> = (0..rows as u32).map(|p| p * 3 + 1).collect();
        let run = |be: &CpuBackend| {
            let mut a = x.clone();
            be.swiglu(&mut a, &y).unwrap();
            let n = be.rms_norm(&a, cols, 1e-6, Some(&w)).unwrap();
            let mut h = be.rms_norm(&y, hd, 1e-6, Some(&w[..hd])).unwrap();
            be.rope(&mut h, hd, hd, &pos, 10_000.0, RopeMode::Norm)
                .unwrap();
            let mut g = x.clone();
            be.rope(&mut g, hd, hd, &pos, 500.0, RopeMode::Neox)
                .unwrap();
            be.mul_sigmoid(&mut g, &y).unwrap();
            be.add(&mut g, &n).unwrap();
            be.add_row(&mut g, &w).unwrap();
            be.scale(&mut g, 0.7).unwrap();
            be.softcap(&mut g, 3.0).unwrap();
            (a, n, h, g)
        };
        let (want, got) = (run(&one), run(&two));
        assert_eq!(want, got);
        // The op really runs: SwiGLU changed the values.
        assert_ne!(want.0, x);
    }

    /// The RoPE table holds the same angles as computing them per row.
    #[test]
    fn rope_table_equals_direct_angles() {
        let be = CpuBackend::new(1).unwrap();
        let table = be.rope_table(10_000.0, 8, 300);
        let theta_scale = 10_000f32.powf(-2.0 / 8.0);
        for p in [0usize, 1, 17, 255, 256, 300] {
            let mut theta = p as f32;
            for i in (0..8).step_by(2) {
                assert_eq!(table[p * 8 + i], theta.cos());
                assert_eq!(table[p * 8 + i + 1], theta.sin());
                theta *= theta_scale;
            }
        }
        assert!(table.len() >= 301 * 8);
    }
}
