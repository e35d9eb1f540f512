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

use crate::backend::{AttnInput, Backend, RopeMode, Weight};
use crate::error::ModelError;
use crate::kv::KvCache;
use math::fma_fn;

/// A row-major f32 matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
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
}

impl CpuBackend {
    /// A backend running on `threads` threads (0 = one per core).
    pub fn new(threads: usize) -> Result<CpuBackend, ModelError> {
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
        Ok(CpuBackend { pool, threads })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Whether the CPU backend can multiply weights of this type.
    pub fn supports(ty: muser_gguf::GgmlType) -> bool {
        matmul::supported(ty)
    }
}

fma_fn! {
fn rope_rows(data: &mut [f32], cols: usize, head_dim: usize, n_rot: usize, pos: &[u32], base: f32, neox: bool) {
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    let mut cs = vec![0f32; n_rot];
    for (r, row) in data.chunks_exact_mut(cols).enumerate() {
        let mut theta = pos[r] as f32;
        for i in (0..n_rot).step_by(2) {
            cs[i] = theta.cos();
            cs[i + 1] = theta.sin();
            theta *= theta_scale;
        }
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

fma_fn! {
fn swiglu_rows(g: &[f32], u: &[f32], out: &mut [f32], cols: usize) {
    for ((gr, ur), orow) in g.chunks_exact(cols).zip(u.chunks_exact(cols)).zip(out.chunks_exact_mut(cols)) {
        math::swiglu(gr, ur, orow);
    }
}
}

impl Backend for CpuBackend {
    type Act = Mat;

    fn upload(&self, rows: usize, cols: usize, data: Vec<f32>) -> Mat {
        debug_assert_eq!(data.len(), rows * cols);
        Mat { rows, cols, data }
    }

    fn download(&self, a: &Mat) -> Vec<f32> {
        a.data.clone()
    }

    fn dims(&self, a: &Mat) -> (usize, usize) {
        (a.rows, a.cols)
    }

    fn get_rows(&self, table: &Weight, ids: &[u32]) -> Result<Mat, ModelError> {
        let rb = table.row_bytes();
        let mut data = vec![0f32; ids.len() * table.n_in];
        for (&id, out) in ids.iter().zip(data.chunks_exact_mut(table.n_in)) {
            let id = id as usize;
            if id >= table.n_out {
                return Err(ModelError::BadBatch(format!(
                    "token id {id} >= n_vocab {}",
                    table.n_out
                )));
            }
            muser_quant::dequantize_row(table.ty, &table.data[id * rb..(id + 1) * rb], out)
                .map_err(|e| ModelError::Quant(format!("{}: {e}", table.name)))?;
        }
        Ok(Mat {
            rows: ids.len(),
            cols: table.n_in,
            data,
        })
    }

    fn matmul(&self, w: &Weight, x: &Mat) -> Result<Mat, ModelError> {
        let data = self.pool.install(|| matmul::matmul(w, &x.data, x.rows))?;
        Ok(Mat {
            rows: x.rows,
            cols: w.n_out,
            data,
        })
    }

    fn rms_norm(&self, x: &Mat, group: usize, eps: f32, weight: Option<&[f32]>) -> Mat {
        let mut data = x.data.clone();
        for g in data.chunks_exact_mut(group) {
            let scale = math::rms_scale(g, eps);
            match weight {
                Some(w) => g.iter_mut().zip(w).for_each(|(v, &w)| *v = *v * scale * w),
                None => g.iter_mut().for_each(|v| *v *= scale),
            }
        }
        Mat {
            rows: x.rows,
            cols: x.cols,
            data,
        }
    }

    fn rope(
        &self,
        x: &mut Mat,
        head_dim: usize,
        n_rot: usize,
        pos: &[u32],
        base: f32,
        mode: RopeMode,
    ) {
        rope_rows(
            &mut x.data,
            x.cols,
            head_dim,
            n_rot,
            pos,
            base,
            mode == RopeMode::Neox,
        );
    }

    fn add(&self, x: &mut Mat, y: &Mat) {
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
    }

    fn add_row(&self, x: &mut Mat, b: &[f32]) {
        for row in x.data.chunks_exact_mut(x.cols) {
            row.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        }
    }

    fn mul_sigmoid(&self, x: &mut Mat, gate: &Mat) {
        x.data
            .iter_mut()
            .zip(&gate.data)
            .for_each(|(a, &g)| *a *= 1.0 / (1.0 + (-g).exp()));
    }

    fn swiglu(&self, gate: &Mat, up: &Mat) -> Mat {
        let mut data = vec![0f32; gate.data.len()];
        swiglu_rows(&gate.data, &up.data, &mut data, gate.cols);
        Mat {
            rows: gate.rows,
            cols: gate.cols,
            data,
        }
    }

    fn scale(&self, x: &mut Mat, s: f32) {
        x.data.iter_mut().for_each(|v| *v *= s);
    }

    fn softcap(&self, x: &mut Mat, cap: f32) {
        let inv = 1.0 / cap;
        x.data.iter_mut().for_each(|v| *v = (*v * inv).tanh() * cap);
    }

    fn select_rows(&self, x: &Mat, rows: &[usize]) -> Mat {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            data.extend_from_slice(x.row(r));
        }
        Mat {
            rows: rows.len(),
            cols: x.cols,
            data,
        }
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
        // Store this batch's K and V (converted to the cache type) into their cells.
        for (seq, idx) in at.groups {
            let (kb, vb) = kv.layer_mut(*seq, il);
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
        let mut views = Vec::with_capacity(at.groups.len());
        let mut n_kvs = Vec::with_capacity(at.groups.len());
        for (g, (seq, _)) in at.groups.iter().enumerate() {
            let (_, nb, ns) = at.plan.n_kv[g];
            let n_kv = if swa { ns } else { nb } as usize;
            let (kb, vb) = kv_ro.layer(*seq, il);
            views.push(attention::View {
                k: kb,
                v: vb,
                cell_pos: kv_ro.cell_pos(*seq, il),
                dtype: layout.dtype,
                row,
                head_dim: at.head_dim,
                n_swa: if swa { layout.n_swa } else { 0 },
            });
            n_kvs.push(n_kv);
        }
        let data = self
            .pool
            .install(|| attention::run(at, &views, &n_kvs, self.threads, &q.data, q.rows));
        Ok(Mat {
            rows: q.rows,
            cols: at.n_head * at.head_dim,
            data,
        })
    }
}
