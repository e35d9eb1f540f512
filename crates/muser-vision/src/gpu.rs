//! The encoder on a CUDA GPU with its activations on the device (feature `cuda`): the weights
//! are uploaded once when the [`GpuEncoder`] is made, an encode uploads the patches, the
//! position embeddings, the window order and the RoPE table once ([`Projector::prepare`], the
//! CPU encoder's own), runs every step of `encoder.rs` as kernels on one stream, and downloads
//! the embeddings once.
//!
//! Numerics: an f16 weight stays f16 and its activations are rounded to f16 (what the CPU's
//! F16 dot product does), multiplied by cuBLAS with f32 accumulation on tensor cores: the
//! products are exact, only their summation order differs from the CPU's. Any other weight
//! type is dequantized to f32 on the host and its activations rounded as the CPU rounds them
//! for that type (ops.cu's `op_fakequant`), then multiplied in f32. Attention is f32 (cuBLAS
//! strided batches without TF32: `S = Q·Kᵀ` per head and window, a row softmax, `S·V`),
//! LayerNorm, RoPE, GELU and the adds are f32 kernels (`muser-cuda`'s `vision.cu`, `ops.cu`).

use std::sync::Mutex;
use std::time::Instant;

use muser_cuda::backend::{fakequant_block, grid_1d, DevMat as Act, OPS_KERNELS};
use muser_cuda::runtime::{Arg, DevBuf, GemmIn, Gpu, Strided, OPS_CU};
use muser_cuda::vision::{weight_form, WeightForm, VISION_CU, VISION_KERNELS};
use muser_cuda::CudaError;
use muser_model::Weight;

use crate::device::Stages;
use crate::encoder::{Embeddings, Prepared};
use crate::preprocess::Pixels;
use crate::projector::{Norm, Projector};
use crate::VisionError;

/// Bytes of attention scores one strided batch may hold: a layer's heads are taken in groups
/// whose `len² · 4` bytes each fit (at least one head a pass).
const SCORES_BYTES_MAX: usize = 1 << 30;

fn dev(e: CudaError) -> VisionError {
    VisionError::Device(e.to_string())
}

/// Which [`Stages`] field a step adds to.
#[derive(Clone, Copy)]
enum Stage {
    Products,
    Attention,
    Rest,
}

/// The optional per-stage clock of one encode.
struct Clock<'a> {
    gpu: &'a Gpu,
    stages: Option<(Stages, Instant)>,
}

impl Clock<'_> {
    /// Ends a step: waits for the device and adds the time since the last lap to `stage`.
    fn lap(&mut self, stage: Stage) -> Result<(), VisionError> {
        if let Some((st, t)) = &mut self.stages {
            self.gpu.sync().map_err(dev)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            *t = Instant::now();
            match stage {
                Stage::Products => st.products_ms += ms,
                Stage::Attention => st.attention_ms += ms,
                Stage::Rest => st.rest_ms += ms,
            }
        }
        Ok(())
    }
}

/// A matrix (and its bias) in device memory.
struct DevLinear {
    w: DevBuf,
    form: WeightForm,
    n_in: usize,
    n_out: usize,
    b: Option<DevBuf>,
}

/// A LayerNorm's weight and bias in device memory.
struct DevNorm {
    w: DevBuf,
    b: Option<DevBuf>,
}

struct DevLayer {
    ln1: DevNorm,
    ln2: DevNorm,
    q: DevLinear,
    k: DevLinear,
    v: DevLinear,
    o: DevLinear,
    up: DevLinear,
    down: DevLinear,
}

/// An activation matrix rounded for one weight form's products.
enum Rounded {
    /// f16 values (for f16 weights).
    F16(DevBuf),
    /// The activations themselves (f32 weights).
    AsIs,
    /// f32 values rounded as a quantized type's activations are.
    F32(Act),
}

/// A projector's weights on a GPU and the kernels that encode with them.
pub struct GpuEncoder {
    gpu: Gpu,
    patch: DevLinear,
    pre_ln: Option<DevNorm>,
    post_ln: Option<DevNorm>,
    layers: Vec<DevLayer>,
    mm: [DevLinear; 3],
    /// One encode at a time: the stream, its cuBLAS handle and the device memory are shared.
    busy: Mutex<()>,
}

impl GpuEncoder {
    /// Opens device 0, loads the kernels and uploads every weight of `p`.
    pub fn new(p: &Projector) -> Result<GpuEncoder, VisionError> {
        let mut gpu = Gpu::new(0).map_err(dev)?;
        gpu.load_module(OPS_CU, &OPS_KERNELS).map_err(dev)?;
        gpu.load_module(VISION_CU, &VISION_KERNELS).map_err(dev)?;
        let up = Uploader { gpu: &gpu };
        let layers = p
            .layers
            .iter()
            .map(|l| {
                Ok(DevLayer {
                    ln1: up.norm(&l.ln1)?,
                    ln2: up.norm(&l.ln2)?,
                    q: up.linear(p.weight(&l.q.w), l.q.b.as_deref())?,
                    k: up.linear(p.weight(&l.k.w), l.k.b.as_deref())?,
                    v: up.linear(p.weight(&l.v.w), l.v.b.as_deref())?,
                    o: up.linear(p.weight(&l.o.w), l.o.b.as_deref())?,
                    up: up.linear(p.weight(&l.up.w), l.up.b.as_deref())?,
                    down: up.linear(p.weight(&l.down.w), l.down.b.as_deref())?,
                })
            })
            .collect::<Result<Vec<_>, VisionError>>()?;
        let enc = GpuEncoder {
            patch: up.linear(p.patch_weight(), p.patch.b.as_deref())?,
            pre_ln: p.pre_ln.as_ref().map(|n| up.norm(n)).transpose()?,
            post_ln: p.post_ln.as_ref().map(|n| up.norm(n)).transpose()?,
            layers,
            mm: [
                up.linear(p.weight(&p.mm[0]), None)?,
                up.linear(p.weight(&p.mm[1]), None)?,
                up.linear(p.weight(&p.mm[2]), None)?,
            ],
            busy: Mutex::new(()),
            gpu,
        };
        enc.gpu.sync().map_err(dev)?;
        Ok(enc)
    }

    /// Encodes one preprocessed image of `p` (the projector this encoder was made from);
    /// with `stages`, also where the device time went.
    pub fn encode(
        &self,
        p: &Projector,
        px: &Pixels,
        stages: bool,
    ) -> Result<(Embeddings, Option<Stages>), VisionError> {
        let _one = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let t = Instant::now();
        let prep = p.prepare(px)?;
        let prepare_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut clock = Clock {
            gpu: &self.gpu,
            stages: stages.then(|| {
                let s = Stages {
                    prepare_ms,
                    ..Stages::default()
                };
                (s, Instant::now())
            }),
        };
        let emb = self.encode_in(p, prep, &mut clock)?;
        Ok((emb, clock.stages.map(|(s, _)| s)))
    }

    fn encode_in(
        &self,
        p: &Projector,
        prep: Prepared,
        clock: &mut Clock,
    ) -> Result<Embeddings, VisionError> {
        let hp = &p.hp;
        let (e, gw, gh) = (hp.n_embd, prep.gw, prep.gh);
        let n = gw * gh;
        let lay = &prep.layout;
        let patches = self.upload(n, self.patch.n_in, &prep.patches)?;
        let pos = self.upload(n, e, &prep.pos)?;
        let to_i32 = |v: &[usize]| -> Vec<i32> { v.iter().map(|&i| i as i32).collect() };
        let perm = self.ints(&to_i32(&lay.perm))?;
        let mut inv = vec![0usize; n];
        lay.perm.iter().enumerate().for_each(|(i, &g)| inv[g] = i);
        let inv = self.ints(&to_i32(&inv))?;
        let table: Vec<f32> = prep.rope.iter().flat_map(|&(c, s)| [c, s]).collect();
        let rope = self.gpu.alloc(4 * table.len()).map_err(dev)?;
        self.gpu.upload(&rope, 0, &table).map_err(dev)?;
        clock.lap(Stage::Rest)?;

        let x = self.linear(&self.patch, &patches, clock)?;
        self.add(&x, &pos)?;
        let mut x = self.select_rows(&x, &perm)?;
        if let Some(norm) = &self.pre_ln {
            self.layer_norm(&x, &x, norm, hp.eps)?;
        }
        clock.lap(Stage::Rest)?;
        let windows = lay.windows();
        let cur = self.alloc(n, e)?;
        for (il, layer) in self.layers.iter().enumerate() {
            self.layer_norm(&x, &cur, &layer.ln1, hp.eps)?;
            clock.lap(Stage::Rest)?;
            let (q, k, v) = if layer.q.form == layer.k.form && layer.q.form == layer.v.form {
                // One rounding of the input for the three products.
                let r = self.round(layer.q.form, &cur)?;
                let q = self.product(&layer.q, &cur, &r, clock)?;
                let k = self.product(&layer.k, &cur, &r, clock)?;
                (q, k, self.product(&layer.v, &cur, &r, clock)?)
            } else {
                let q = self.linear(&layer.q, &cur, clock)?;
                let k = self.linear(&layer.k, &cur, clock)?;
                (q, k, self.linear(&layer.v, &cur, clock)?)
            };
            for t in [&q, &k] {
                self.gpu
                    .launch(
                        "vis_rope_2d",
                        (grid_1d(n * e / 2), 1, 1),
                        256,
                        &[
                            Arg::P(t.ptr()),
                            Arg::P(rope.ptr()),
                            Arg::L(n as i64),
                            Arg::I(hp.n_head as i32),
                            Arg::I(hp.head_dim as i32),
                        ],
                    )
                    .map_err(dev)?;
            }
            clock.lap(Stage::Rest)?;
            let spans = if hp.is_global(il) {
                vec![(0, n)]
            } else {
                windows.clone()
            };
            let a = self.attention(&q, &k, &v, &spans, hp.n_head, hp.head_dim)?;
            drop((q, k, v));
            clock.lap(Stage::Attention)?;
            let o = self.linear(&layer.o, &a, clock)?;
            self.add(&x, &o)?;
            self.layer_norm(&x, &cur, &layer.ln2, hp.eps)?;
            clock.lap(Stage::Rest)?;
            let f = self.linear(&layer.up, &cur, clock)?;
            self.gelu(&f)?;
            clock.lap(Stage::Rest)?;
            let f = self.linear(&layer.down, &f, clock)?;
            self.add(&x, &f)?;
            clock.lap(Stage::Rest)?;
        }
        if let Some(norm) = &self.post_ln {
            self.layer_norm(&x, &x, norm, hp.eps)?;
        }
        x = self.select_rows(&x, &inv)?;

        let f = hp.n_merge;
        let (ow, oh) = (gw / f, gh / f);
        let merged = self.alloc(ow * oh, e * f * f)?;
        self.gpu
            .launch(
                "vis_pixel_shuffle",
                (grid_1d(merged.len()), 1, 1),
                256,
                &[
                    Arg::P(x.ptr()),
                    Arg::P(merged.ptr()),
                    Arg::I(gw as i32),
                    Arg::I(e as i32),
                    Arg::I(f as i32),
                    Arg::L(merged.len() as i64),
                ],
            )
            .map_err(dev)?;
        clock.lap(Stage::Rest)?;
        let y = self.linear(&self.mm[0], &merged, clock)?;
        self.gelu(&y)?;
        clock.lap(Stage::Rest)?;
        let y = self.linear(&self.mm[1], &y, clock)?;
        self.gelu(&y)?;
        clock.lap(Stage::Rest)?;
        let y = self.linear(&self.mm[2], &y, clock)?;
        let mut data = vec![0f32; y.len()];
        self.gpu.download(y.ptr(), &mut data).map_err(dev)?;
        clock.lap(Stage::Rest)?;
        Ok(Embeddings {
            n_x: ow,
            n_y: oh,
            width: hp.proj_dim,
            data,
        })
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<Act, VisionError> {
        Act::alloc(&self.gpu, rows, cols).map_err(dev)
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Act, VisionError> {
        let a = self.alloc(rows, cols)?;
        self.gpu.upload(a.buf(), 0, data).map_err(dev)?;
        Ok(a)
    }

    fn ints(&self, v: &[i32]) -> Result<DevBuf, VisionError> {
        let b = self.gpu.alloc(4 * v.len()).map_err(dev)?;
        self.gpu.upload(&b, 0, v).map_err(dev)?;
        Ok(b)
    }

    /// A grid-stride kernel over `n` values.
    fn each(&self, name: &str, n: usize, args: &[Arg]) -> Result<(), VisionError> {
        let mut a = args.to_vec();
        a.push(Arg::L(n as i64));
        self.gpu
            .launch(name, (grid_1d(n), 1, 1), 256, &a)
            .map_err(dev)
    }

    /// `x += y`.
    fn add(&self, x: &Act, y: &Act) -> Result<(), VisionError> {
        self.each("op_add", x.len(), &[Arg::P(x.ptr()), Arg::P(y.ptr())])
    }

    fn gelu(&self, x: &Act) -> Result<(), VisionError> {
        self.each("vis_gelu_erf", x.len(), &[Arg::P(x.ptr())])
    }

    /// Rows `rows[i]` of `x`, in that order.
    fn select_rows(&self, x: &Act, rows: &DevBuf) -> Result<Act, VisionError> {
        let y = self.alloc(rows.bytes() / 4, x.cols())?;
        self.gpu
            .launch(
                "op_select_rows",
                (grid_1d(y.len()), 1, 1),
                256,
                &[
                    Arg::P(x.ptr()),
                    Arg::P(y.ptr()),
                    Arg::P(rows.ptr()),
                    Arg::L(x.cols() as i64),
                    Arg::L(y.len() as i64),
                ],
            )
            .map_err(dev)?;
        Ok(y)
    }

    /// `y = LayerNorm(x)` row by row (`y` may be `x`).
    fn layer_norm(&self, x: &Act, y: &Act, n: &DevNorm, eps: f32) -> Result<(), VisionError> {
        self.gpu
            .launch(
                "vis_layer_norm",
                (x.rows() as u32, 1, 1),
                256,
                &[
                    Arg::P(x.ptr()),
                    Arg::P(y.ptr()),
                    Arg::P(n.w.ptr()),
                    Arg::P(n.b.as_ref().map_or(0, DevBuf::ptr)),
                    Arg::I(x.cols() as i32),
                    Arg::F(eps),
                ],
            )
            .map_err(dev)
    }

    /// `x · Wᵀ + b`, the activations rounded as the weight's [`WeightForm`] says.
    fn linear(&self, l: &DevLinear, x: &Act, clock: &mut Clock) -> Result<Act, VisionError> {
        let r = self.round(l.form, x)?;
        self.product(l, x, &r, clock)
    }

    /// `x` rounded as the products of weights of `form` take it.
    fn round(&self, form: WeightForm, x: &Act) -> Result<Rounded, VisionError> {
        let (n, k) = (x.rows(), x.cols());
        Ok(match form {
            WeightForm::F16 => {
                let xh = self.gpu.alloc(2 * n * k).map_err(dev)?;
                self.each("vis_to_f16", n * k, &[Arg::P(x.ptr()), Arg::P(xh.ptr())])?;
                Rounded::F16(xh)
            }
            WeightForm::F32 { kind: 0 } => Rounded::AsIs,
            WeightForm::F32 { kind } => {
                let xr = self.alloc(n, k)?;
                self.gpu.copy(xr.ptr(), x.ptr(), 4 * n * k).map_err(dev)?;
                let work = n * (k / fakequant_block(kind));
                self.gpu
                    .launch(
                        "op_fakequant",
                        (grid_1d(work), 1, 1),
                        256,
                        &[
                            Arg::P(xr.ptr()),
                            Arg::L(n as i64),
                            Arg::L(k as i64),
                            Arg::I(kind),
                            Arg::P(0),
                        ],
                    )
                    .map_err(dev)?;
                Rounded::F32(xr)
            }
        })
    }

    /// `x · Wᵀ + b` from `r`, `x` rounded as `l.form` says ([`GpuEncoder::round`]).
    fn product(
        &self,
        l: &DevLinear,
        x: &Act,
        r: &Rounded,
        clock: &mut Clock,
    ) -> Result<Act, VisionError> {
        if x.cols() != l.n_in {
            return Err(VisionError::Device(format!(
                "{} inputs for a matrix of {}",
                x.cols(),
                l.n_in
            )));
        }
        let (n, k, m) = (x.rows(), l.n_in, l.n_out);
        let y = self.alloc(n, m)?;
        let (input, kind) = match r {
            Rounded::F16(xh) => (xh.ptr(), GemmIn::F16),
            Rounded::AsIs => (x.ptr(), GemmIn::F32),
            Rounded::F32(xr) => (xr.ptr(), GemmIn::F32),
        };
        self.gpu
            .gemm(y.ptr(), m, input, l.w.ptr(), (n, m, k), kind)
            .map_err(dev)?;
        if let Some(b) = &l.b {
            let args = [
                Arg::P(y.ptr()),
                Arg::P(b.ptr()),
                Arg::L(y.len() as i64),
                Arg::L(m as i64),
            ];
            self.gpu
                .launch("op_add_row", (grid_1d(y.len()), 1, 1), 256, &args)
                .map_err(dev)?;
        }
        clock.lap(Stage::Products)?;
        Ok(y)
    }

    /// Softmax(Q·Kᵀ / √hd)·V of every head within each span of rows (the windows, or the
    /// whole image), f32.
    fn attention(
        &self,
        q: &Act,
        k: &Act,
        v: &Act,
        spans: &[(usize, usize)],
        n_head: usize,
        hd: usize,
    ) -> Result<Act, VisionError> {
        let e = n_head * hd;
        let out = self.alloc(q.rows(), e)?;
        let scale = 1.0 / (hd as f32).sqrt();
        for &(lo, hi) in spans {
            let len = hi - lo;
            let per_head = len * len;
            let group = (SCORES_BYTES_MAX / (4 * per_head)).clamp(1, n_head);
            let s = self.gpu.alloc(4 * per_head * group).map_err(dev)?;
            for h0 in (0..n_head).step_by(group) {
                let heads = group.min(n_head - h0);
                let at = |a: &Act| a.ptr() + 4 * (lo * e + h0 * hd) as u64;
                let rows = |ptr| Strided {
                    ptr,
                    ld: e,
                    stride: hd,
                };
                let scores = Strided {
                    ptr: s.ptr(),
                    ld: len,
                    stride: per_head,
                };
                // S[i][j] = scale · q_i · k_j
                self.gpu
                    .gemm_strided(
                        scores,
                        rows(at(q)),
                        rows(at(k)),
                        (len, len, hd),
                        true,
                        heads,
                        scale,
                    )
                    .map_err(dev)?;
                self.gpu
                    .launch(
                        "vis_softmax",
                        ((heads * len) as u32, 1, 1),
                        256,
                        &[Arg::P(s.ptr()), Arg::I(len as i32)],
                    )
                    .map_err(dev)?;
                // O[i] = Σ_j P[i][j] · v_j
                self.gpu
                    .gemm_strided(
                        rows(at(&out)),
                        scores,
                        rows(at(v)),
                        (len, hd, len),
                        false,
                        heads,
                        1.0,
                    )
                    .map_err(dev)?;
            }
        }
        Ok(out)
    }
}

/// Uploads a projector's tensors.
struct Uploader<'a> {
    gpu: &'a Gpu,
}

impl Uploader<'_> {
    fn floats(&self, v: &[f32]) -> Result<DevBuf, VisionError> {
        let b = self.gpu.alloc(4 * v.len()).map_err(dev)?;
        self.gpu.upload(&b, 0, v).map_err(dev)?;
        Ok(b)
    }

    fn norm(&self, n: &Norm) -> Result<DevNorm, VisionError> {
        Ok(DevNorm {
            w: self.floats(&n.w)?,
            b: n.b.as_deref().map(|b| self.floats(b)).transpose()?,
        })
    }

    fn linear(&self, w: Weight, b: Option<&[f32]>) -> Result<DevLinear, VisionError> {
        let form = weight_form(w.ty, w.n_in)
            .map_err(|m| VisionError::Device(format!("{}: {m}", w.name)))?;
        let buf = match form {
            // the file's f16 values as they are
            WeightForm::F16 => {
                let b = self.gpu.alloc(w.data.len()).map_err(dev)?;
                self.gpu.upload(&b, 0, w.data).map_err(dev)?;
                b
            }
            WeightForm::F32 { .. } => {
                let mut rows = vec![0f32; w.n_in * w.n_out];
                let rb = w.row_bytes();
                for (r, out) in rows.chunks_exact_mut(w.n_in).enumerate() {
                    muser_quant::dequantize_row(w.ty, &w.data[r * rb..(r + 1) * rb], out)
                        .map_err(|e| VisionError::Projector(format!("{}: {e}", w.name)))?;
                }
                self.floats(&rows)?
            }
        };
        Ok(DevLinear {
            w: buf,
            form,
            n_in: w.n_in,
            n_out: w.n_out,
            b: b.map(|b| self.floats(b)).transpose()?,
        })
    }
}
