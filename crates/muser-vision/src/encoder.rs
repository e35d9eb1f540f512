//! The encoder's forward pass, in the order of `clip_graph_muse_glimmer::build` and the
//! host-side inputs `clip_image_batch_encode` computes for it (window permutation, 1-indexed
//! RoPE positions, block-diagonal mask, pixel-shuffle gather).

use muser_model::cpu::soft_max_tile;
use muser_model::{Backend, Order, Weight};
use rayon::prelude::*;

use crate::preprocess::Pixels;
use crate::projector::{Linear, Norm, Projector};
use crate::VisionError;

/// An image's embeddings: `n_x × n_y` tokens (row-major) of the text model's width.
#[derive(Clone, Debug, PartialEq)]
pub struct Embeddings {
    pub n_x: usize,
    pub n_y: usize,
    pub width: usize,
    /// `n_x·n_y × width`, token `y·n_x + x`.
    pub data: Vec<f32>,
}

impl Embeddings {
    /// Number of tokens the image takes in the context.
    pub fn n_tokens(&self) -> usize {
        self.n_x * self.n_y
    }
}

/// The host-side inputs of one encode ([`Projector::prepare`]).
pub(crate) struct Prepared {
    /// The patch grid's sides.
    pub gw: usize,
    pub gh: usize,
    /// `gw·gh × patch²·3`: each patch as the conv kernel's inputs, grid order.
    pub patches: Vec<f32>,
    /// `gw·gh × n_embd`, grid order.
    pub pos: Vec<f32>,
    pub layout: Layout,
    /// [`rope_table`] in window order.
    pub rope: Vec<(f32, f32)>,
}

/// The host-side index tables of one image grid (`clip.cpp`, `set_input`).
pub(crate) struct Layout {
    /// Window order: `perm[i]` is the grid index of the i-th token in window order.
    pub perm: Vec<usize>,
    /// The window of each token in window order, as a range of window-order indices.
    pub window: Vec<(usize, usize)>,
    /// 1-indexed (x, y) RoPE positions in window order.
    pub pos: Vec<(i32, i32)>,
}

impl Layout {
    /// The windows in order, each once, as ranges of window-order indices (the GPU encoder's
    /// attention spans).
    #[cfg(any(test, feature = "cuda"))]
    pub fn windows(&self) -> Vec<(usize, usize)> {
        let mut w = self.window.clone();
        w.dedup();
        w
    }
}

fn layout(grid_w: usize, grid_h: usize, win: usize) -> Layout {
    let n = grid_w * grid_h;
    let mut perm = Vec::with_capacity(n);
    let mut window = Vec::with_capacity(n);
    for wy in 0..grid_h.div_ceil(win) {
        for wx in 0..grid_w.div_ceil(win) {
            let start = perm.len();
            for hh in 0..win {
                for ww in 0..win {
                    let (gy, gx) = (wy * win + hh, wx * win + ww);
                    if gy < grid_h && gx < grid_w {
                        perm.push(gy * grid_w + gx);
                    }
                }
            }
            let end = perm.len();
            window.extend(std::iter::repeat_n((start, end), end - start));
        }
    }
    let pos = perm
        .iter()
        .map(|&g| ((g % grid_w) as i32 + 1, (g / grid_w) as i32 + 1))
        .collect();
    Layout { perm, window, pos }
}

/// An image as the text model takes it: its embeddings and the digest of its decoded pixels
/// (the identity of its rows in a prompt).
#[derive(Clone, Debug, PartialEq)]
pub struct EncodedImage {
    pub digest: [u8; 32],
    pub embeddings: Embeddings,
}

impl Projector {
    /// Encodes one preprocessed image (its sides multiples of [`crate::Hparams::cell`]) into
    /// text-model embeddings, matrix products on `backend`, host work in its thread pool.
    pub fn encode<B: Backend + Sync>(
        &self,
        backend: &B,
        px: &Pixels,
    ) -> Result<Embeddings, VisionError> {
        backend.run(|| self.encode_in(backend, px))
    }

    /// The host-side inputs of an encode: the checked grid, the patches as rows of the conv
    /// kernel's inputs, the position embeddings for this grid, the window layout and the RoPE
    /// table (one statement of each for the CPU and the GPU encoder).
    pub(crate) fn prepare(&self, px: &Pixels) -> Result<Prepared, VisionError> {
        let hp = &self.hp;
        let (ps, cell) = (hp.patch_size, hp.cell() as usize);
        let (w, h) = (px.width as usize, px.height as usize);
        if w == 0 || h == 0 || w % cell != 0 || h % cell != 0 || px.data.len() != w * h * 3 {
            return Err(VisionError::Image(format!(
                "encoder input {w}x{h} is not a whole number of {cell}-pixel cells"
            )));
        }
        let (gw, gh) = (w / ps, h / ps);
        let n = gw * gh;

        // conv2d patch embedding: each patch as [channel][row][col], dotted with the kernel
        let k = ps * ps * 3;
        let mut patches = vec![0f32; n * k];
        patches
            .par_chunks_exact_mut(k)
            .enumerate()
            .for_each(|(t, row)| {
                let (py, pxi) = (t / gw, t % gw);
                for c in 0..3 {
                    for ky in 0..ps {
                        for kx in 0..ps {
                            let (x, y) = (pxi * ps + kx, py * ps + ky);
                            row[c * ps * ps + ky * ps + kx] = px.data[(y * w + x) * 3 + c];
                        }
                    }
                }
            });
        let layout = layout(gw, gh, hp.pos_side);
        let rope = rope_table(&layout.pos, hp.head_dim, hp.rope_theta);
        Ok(Prepared {
            gw,
            gh,
            patches,
            pos: self.position_embeddings(gw, gh),
            layout,
            rope,
        })
    }

    fn encode_in<B: Backend>(&self, backend: &B, px: &Pixels) -> Result<Embeddings, VisionError> {
        let hp = &self.hp;
        let e = hp.n_embd;
        let Prepared {
            gw,
            gh,
            patches,
            pos,
            layout: lay,
            rope,
        } = self.prepare(px)?;
        let n = gw * gh;
        let mut x = matmul(backend, self.patch_weight(), patches, n)?;
        if let Some(b) = &self.patch.b {
            add_bias(&mut x, b);
        }
        x.iter_mut().zip(&pos).for_each(|(a, p)| *a += p);

        // window order, pre-norm, the layers, post-norm, back to grid order
        let mut x = gather(&x, &lay.perm, e);
        if let Some(norm) = &self.pre_ln {
            layer_norm(&mut x, norm, e, hp.eps);
        }
        for (il, layer) in self.layers.iter().enumerate() {
            let mut cur = x.clone();
            layer_norm(&mut cur, &layer.ln1, e, hp.eps);
            // one upload for the three projections
            let cur = backend.upload(n, e, cur)?;
            let mut q = self.linear(backend, &layer.q, &cur)?;
            let mut kk = self.linear(backend, &layer.k, &cur)?;
            let v = self.linear(backend, &layer.v, &cur)?;
            rope_2d(&mut q, &rope, hp.head_dim);
            rope_2d(&mut kk, &rope, hp.head_dim);
            let global = hp.is_global(il);
            let a = attention(&q, &kk, &v, &lay.window, global, hp.n_head, hp.head_dim);
            let a = self.linear(backend, &layer.o, &backend.upload(n, e, a)?)?;
            add_all(&mut x, &a);

            let mut cur = x.clone();
            layer_norm(&mut cur, &layer.ln2, e, hp.eps);
            let mut f = self.linear(backend, &layer.up, &backend.upload(n, e, cur)?)?;
            gelu_all(&mut f);
            let f = self.linear(backend, &layer.down, &backend.upload(n, hp.n_ff, f)?)?;
            add_all(&mut x, &f);
        }
        if let Some(norm) = &self.post_ln {
            layer_norm(&mut x, norm, e, hp.eps);
        }
        let mut grid = vec![0f32; n * e];
        for (i, &g) in lay.perm.iter().enumerate() {
            grid[g * e..(g + 1) * e].copy_from_slice(&x[i * e..(i + 1) * e]);
        }

        // pixel shuffle: out[o][c·f² + s] = grid[token s of cell o][c]
        let f = hp.n_merge;
        let (ow, oh) = (gw / f, gh / f);
        let ss = f * f;
        let mut merged = vec![0f32; ow * oh * e * ss];
        for oy in 0..oh {
            for ox in 0..ow {
                let o = oy * ow + ox;
                let out = &mut merged[o * e * ss..(o + 1) * e * ss];
                for ry in 0..f {
                    for rx in 0..f {
                        let s = ry * f + rx;
                        let t = (oy * f + ry) * gw + ox * f + rx;
                        for c in 0..e {
                            out[c * ss + s] = grid[t * e + c];
                        }
                    }
                }
            }
        }

        let n_out = ow * oh;
        let mut y = matmul(backend, self.weight(&self.mm[0]), merged, n_out)?;
        gelu_all(&mut y);
        let mut y = matmul(backend, self.weight(&self.mm[1]), y, n_out)?;
        gelu_all(&mut y);
        let y = matmul(backend, self.weight(&self.mm[2]), y, n_out)?;
        Ok(Embeddings {
            n_x: ow,
            n_y: oh,
            width: hp.proj_dim,
            data: y,
        })
    }

    /// `x · Wᵀ + b` of an uploaded `x`, downloaded.
    fn linear<B: Backend>(
        &self,
        backend: &B,
        l: &Linear,
        x: &B::Act,
    ) -> Result<Vec<f32>, VisionError> {
        let mut y = backend.download(&backend.matmul(&self.weight(&l.w), x)?)?;
        if let Some(b) = &l.b {
            add_bias(&mut y, b);
        }
        Ok(y)
    }

    /// The learned grid resized to `gw × gh` with ggml's bilinear `interpolate` (half-pixel
    /// centres, edges clamped), or as stored when the sizes agree.
    pub(crate) fn position_embeddings(&self, gw: usize, gh: usize) -> Vec<f32> {
        let (side, e) = (self.hp.pos_side, self.hp.n_embd);
        if gw == side && gh == side {
            return self.pos_embd.clone();
        }
        let src = &self.pos_embd;
        let (sf0, sf1) = (gw as f32 / side as f32, gh as f32 / side as f32);
        let mut out = vec![0f32; gw * gh * e];
        let last = side as i64 - 1;
        // output index `i` of an axis scaled by `sf`: its two source indices, the second's weight
        let axis = |i: usize, sf: f32| {
            let v = (i as f32 + 0.5) / sf - 0.5;
            let lo = v.floor() as i64;
            let (a, b) = (lo.clamp(0, last) as usize, (lo + 1).clamp(0, last) as usize);
            (a, b, (v - a as f32).clamp(0.0, 1.0))
        };
        out.par_chunks_exact_mut(e)
            .enumerate()
            .for_each(|(t, row)| {
                let ((y0, y1, dy), (x0, x1, dx)) = (axis(t / gw, sf1), axis(t % gw, sf0));
                for (c, o) in row.iter_mut().enumerate() {
                    let at = |yy: usize, xx: usize| src[(yy * side + xx) * e + c];
                    let (a, b, cc, d) = (at(y0, x0), at(y0, x1), at(y1, x0), at(y1, x1));
                    // ggml's C++ is compiled with FMA contraction, which fuses these so
                    let t = (a * (1.0 - dx)).mul_add(1.0 - dy, b * dx * (1.0 - dy));
                    *o = (d * dx).mul_add(dy, (cc * (1.0 - dx)).mul_add(dy, t));
                }
            });
        out
    }
}

fn matmul<B: Backend>(
    backend: &B,
    w: Weight,
    x: Vec<f32>,
    rows: usize,
) -> Result<Vec<f32>, VisionError> {
    let a = backend.upload(rows, w.n_in, x)?;
    let y = backend.matmul(&w, &a)?;
    Ok(backend.download(&y)?)
}

fn add_bias(x: &mut [f32], b: &[f32]) {
    x.par_chunks_exact_mut(b.len())
        .for_each(|row| row.iter_mut().zip(b).for_each(|(v, b)| *v += b));
}

/// `x += y`, in parallel pieces.
fn add_all(x: &mut [f32], y: &[f32]) {
    x.par_chunks_mut(1 << 14)
        .zip(y.par_chunks(1 << 14))
        .for_each(|(x, y)| x.iter_mut().zip(y).for_each(|(a, b)| *a += b));
}

fn gather(x: &[f32], idx: &[usize], e: usize) -> Vec<f32> {
    idx.iter()
        .flat_map(|&i| x[i * e..(i + 1) * e].iter().copied())
        .collect()
}

/// `ggml_norm` as its AVX512 build computes it (the CPU backend's default order): the sum in
/// f64 rounded to f32 and divided in f32; the variance summed per 16 values
/// (`_mm512_reduce_add_ps` of the squares, into f64), the tail one by one; scale
/// `1/sqrtf(var + eps)`; then the weight and the bias.
fn layer_norm(x: &mut [f32], n: &Norm, e: usize, eps: f32) {
    x.par_chunks_exact_mut(e).for_each(|row| {
        let sum = row.iter().map(|&v| f64::from(v)).sum::<f64>() as f32;
        let mean = sum / e as f32;
        row.iter_mut().for_each(|v| *v -= mean);
        let mut sum2 = 0f64;
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            let mut sq = [0f32; 16];
            sq.iter_mut().zip(c).for_each(|(s, v)| *s = v * v);
            sum2 += f64::from(reduce16(sq));
        }
        for v in chunks.remainder() {
            sum2 += f64::from(v * v);
        }
        let var = (sum2 / e as f64) as f32;
        let scale = 1.0 / (var + eps).sqrt();
        for (i, v) in row.iter_mut().enumerate() {
            *v *= scale;
            *v *= n.w[i];
            if let Some(b) = &n.b {
                *v += b[i];
            }
        }
    });
}

/// `_mm512_reduce_add_ps`: halves added down to four lanes, then `(t0 + t2) + (t1 + t3)`.
#[inline(always)]
fn reduce16(mut t: [f32; 16]) -> f32 {
    let mut w = 16;
    while w > 4 {
        w /= 2;
        for i in 0..w {
            t[i] += t[i + w];
        }
    }
    (t[0] + t[2]) + (t[1] + t[3])
}

/// [`gelu_erf`] on every value, in parallel pieces.
fn gelu_all(x: &mut [f32]) {
    x.par_chunks_mut(1 << 14)
        .for_each(|row| row.iter_mut().for_each(|v| *v = gelu_erf(*v)));
}

/// `ggml_gelu_erf` on f32.
fn gelu_erf(x: f32) -> f32 {
    const SQRT_2_INV: f32 = std::f32::consts::FRAC_1_SQRT_2;
    0.5 * x * (1.0 + libm::erff(x * SQRT_2_INV))
}

/// The (cos, sin) of every rotated pair of `build_rope_2d`, `hd / 2` a row: two NORM-mode
/// (adjacent pairs) rotations of `hd / 2` dims each, the first half of every head by the x
/// position, the second by y; ggml's iterative f32 angles.
pub(crate) fn rope_table(pos: &[(i32, i32)], hd: usize, base: f32) -> Vec<(f32, f32)> {
    let half = hd / 2;
    let theta_scale = base.powf(-2.0 / half as f32);
    pos.par_iter()
        .flat_map_iter(|&(px, py)| {
            [px, py].into_iter().flat_map(move |p| {
                let mut theta = p as f32;
                (0..half / 2).map(move |_| {
                    let cs = (theta.cos(), theta.sin());
                    theta *= theta_scale;
                    cs
                })
            })
        })
        .collect()
}

/// [`rope_table`]'s rotations on every head of every row of `x`.
fn rope_2d(x: &mut [f32], table: &[(f32, f32)], hd: usize) {
    let pairs = hd / 2;
    let e = x.len() / (table.len() / pairs).max(1);
    x.par_chunks_exact_mut(e)
        .zip(table.par_chunks_exact(pairs))
        .for_each(|(row, cache)| {
            for head in row.chunks_exact_mut(hd) {
                for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(cache) {
                    let (x0, x1) = (pair[0], pair[1]);
                    // ggml's C++ is compiled with FMA contraction
                    pair[0] = x0.mul_add(c, -(x1 * s));
                    pair[1] = x0.mul_add(s, x1 * c);
                }
            }
        });
}

/// `build_attn` without flash attention, as ggml's AVX512 CPU build computes it (the
/// backend's default order): `kq = k·q` (`ggml_vec_dot_f32`: q is a permuted view, so never
/// tinyBLAS), `soft_max_ext(kq·scale + mask)` over the whole row (-inf outside a token's
/// window on windowed layers; exponentials in 16 lanes), then `v·kq` over the whole row
/// (tinyBLAS when the row is a whole number of lanes, else `ggml_vec_dot_f32`).
///
/// Outside a token's window the probabilities are exactly 0, which leaves every lane sum of
/// the softmax and every accumulator of the dots as it was; so a windowed row visits only the
/// lane-aligned span around its window, with the same bits as the whole row.
fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    window: &[(usize, usize)],
    global: bool,
    n_head: usize,
    hd: usize,
) -> Vec<f32> {
    let (n, e) = (window.len(), n_head * hd);
    // K's rows padded by a block of keys, so that every block reads 16 values
    let (kt, vt) = (transpose(k, n, e, n + KEYS), transpose(v, n, e, n));
    let heads = Heads {
        q,
        kt: &kt,
        vt: &vt,
        n,
        n_head,
        hd,
    };
    let mut out = vec![0f32; n * e];
    out.par_chunks_exact_mut(e)
        .enumerate()
        .for_each(|(i, orow)| {
            let span = if global { (0, n) } else { window[i] };
            attend_row(&heads, i, span, orow)
        });
    out
}

/// `n` rows of `e` values as `e` rows of `n`, each `stride >= n` long (zeros after the `n`);
/// per head, v so is the rows `ggml_cont(ggml_permute(v))` holds.
fn transpose(x: &[f32], n: usize, e: usize, stride: usize) -> Vec<f32> {
    let mut t = vec![0f32; stride * e];
    t.par_chunks_exact_mut(stride)
        .enumerate()
        .for_each(|(c, row)| {
            for (j, y) in row[..n].iter_mut().enumerate() {
                *y = x[j * e + c];
            }
        });
    t
}

/// One layer's attention inputs: Q rows in window order, K and V transposed per channel.
struct Heads<'a> {
    q: &'a [f32],
    kt: &'a [f32],
    vt: &'a [f32],
    n: usize,
    n_head: usize,
    hd: usize,
}

/// Every head of query row `i` attending to keys `lo..hi` (the rest masked).
fn attend_row(h: &Heads, i: usize, (lo, hi): (usize, usize), orow: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the features `attend_row_fma` is compiled for were detected just above.
        return unsafe { attend_row_fma(h, i, (lo, hi), orow) };
    }
    attend_row_in(h, i, (lo, hi), orow)
}

/// [`attend_row`] compiled with FMA, so that the lanes' `mul_add`s are instructions, not calls.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_row_fma(h: &Heads, i: usize, span: (usize, usize), orow: &mut [f32]) {
    attend_row_in(h, i, span, orow)
}

#[inline(always)]
fn attend_row_in(h: &Heads, i: usize, (lo, hi): (usize, usize), orow: &mut [f32]) {
    let (n, hd) = (h.n, h.hd);
    let e = h.n_head * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let tinyblas = n >= 2 && n.is_multiple_of(LANES);
    // the softmax's lane groups that hold the window (the tail, past the last whole group,
    // is taken whole: libm's exponentials there)
    let body = n - n % LANES;
    let a = lo / LANES * LANES;
    let b = if hi > body {
        n
    } else {
        hi.next_multiple_of(LANES)
    };
    let mut p = vec![0f32; n];
    for head in 0..h.n_head {
        let qh = &h.q[i * e + head * hd..i * e + (head + 1) * hd];
        let stride = n + KEYS;
        let kt = &h.kt[head * hd * stride..(head + 1) * hd * stride];
        p[a..lo].fill(f32::NEG_INFINITY);
        p[hi..b].fill(f32::NEG_INFINITY);
        let mut j = lo;
        while j < hi {
            let keys = (hi - j).min(KEYS);
            let dots = key_dots(kt, stride, qh, j);
            for (s, d) in p[j..j + keys].iter_mut().zip(dots) {
                *s = d * scale;
            }
            j += keys;
        }
        let max = p[a..b].iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let sum = soft_max_tile(Order::GgmlAvx512, &mut p[a..b], max);
        let inv = (1.0 / sum) as f32;
        p[a..b].iter_mut().for_each(|s| *s *= inv);
        for (d, o) in orow[head * hd..(head + 1) * hd].iter_mut().enumerate() {
            let row = &h.vt[(head * hd + d) * n..(head * hd + d + 1) * n];
            *o = if tinyblas {
                tinyblas_dot(row, &p, (a, b))
            } else {
                vec_dot_f32(row, &p, (a, b))
            };
        }
    }
}

/// Lanes of ggml's AVX512 f32 vectors.
const LANES: usize = 16;

/// Keys whose dots with one query [`key_dots`] computes together.
const KEYS: usize = 16;

/// [`vec_dot_f32`] of `q` with each of the [`KEYS`] keys from `j0`, given as the head's
/// channels of K transposed (`kt[t·stride + j]`, `j0 + KEYS <= stride`): the same operations
/// on every key, each key in a lane of its own (the keys' dots are independent chains, so they
/// run side by side where one dot's unfused tail would wait on itself). A caller with fewer
/// keys left ignores the other lanes.
#[allow(clippy::needless_range_loop)] // lane loops mirror the SIMD lanes
#[inline(always)]
fn key_dots(kt: &[f32], stride: usize, q: &[f32], j0: usize) -> [f32; KEYS] {
    let hd = q.len();
    let np = hd - hd % (4 * LANES);
    // a fixed-size view: loads, not a copy call per row
    let row = |t: usize| -> &[f32; KEYS] {
        let at = t * stride + j0;
        kt[at..at + KEYS].try_into().expect("KEYS values")
    };
    // accumulator `slot` of `ggml_vec_dot_f32` (vector slot / 16, lane slot % 16), per key
    let mut acc = [[0f32; KEYS]; 4 * LANES];
    for (slot, a) in acc.iter_mut().enumerate() {
        for i in (0..np).step_by(4 * LANES) {
            let (x, y) = (row(i + slot), q[i + slot]);
            for k in 0..KEYS {
                a[k] = x[k].mul_add(y, a[k]);
            }
        }
    }
    let mut s = [[0f32; KEYS]; LANES];
    for l in 0..LANES {
        for k in 0..KEYS {
            s[l][k] =
                (acc[l][k] + acc[2 * LANES + l][k]) + (acc[LANES + l][k] + acc[3 * LANES + l][k]);
        }
    }
    // `reduce16` in every key's lane
    let mut w = LANES;
    while w > 4 {
        w /= 2;
        for l in 0..w {
            for k in 0..KEYS {
                s[l][k] += s[l + w][k];
            }
        }
    }
    let mut sum = [0f32; KEYS];
    for k in 0..KEYS {
        sum[k] = (s[0][k] + s[2][k]) + (s[1][k] + s[3][k]);
    }
    for t in np..hd {
        let (x, y) = (row(t), q[t]);
        for k in 0..KEYS {
            sum[k] += x[k] * y;
        }
    }
    sum
}

/// `ggml_vec_dot_f32` (AVX512): four 16-lane FMA accumulators over steps of 64, reduced
/// `(a0 + a2) + (a1 + a3)` then across lanes, the rest added to that sum one by one (not
/// fused). Only the steps that meet `lo..hi` are taken: the products outside it are 0 and
/// would leave the accumulators as they are.
#[allow(clippy::needless_range_loop)] // lane loops mirror the SIMD lanes
#[inline(always)]
fn vec_dot_f32(x: &[f32], y: &[f32], (lo, hi): (usize, usize)) -> f32 {
    let n = x.len();
    let np = n - n % (4 * LANES);
    let mut acc = [[0f32; LANES]; 4];
    let from = lo / (4 * LANES) * (4 * LANES);
    let to = hi.next_multiple_of(4 * LANES).min(np);
    for i in (from..to.max(from)).step_by(4 * LANES) {
        for (j, a) in acc.iter_mut().enumerate() {
            for l in 0..LANES {
                let t = i + j * LANES + l;
                a[l] = x[t].mul_add(y[t], a[l]);
            }
        }
    }
    let mut s = [0f32; LANES];
    for l in 0..LANES {
        s[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut sum = reduce16(s);
    for t in np..n {
        sum += x[t] * y[t];
    }
    sum
}

/// One tinyBLAS f32 dot (`n` a multiple of 16): lane `l` fuses elements `l, l+16, ...`,
/// then the lanes are reduced as `_mm512_reduce_add_ps`; only the lane groups that meet
/// `lo..hi` are taken (the products outside it are 0).
#[allow(clippy::needless_range_loop)] // lane loops mirror the SIMD lanes
#[inline(always)]
fn tinyblas_dot(x: &[f32], y: &[f32], (lo, hi): (usize, usize)) -> f32 {
    let (from, to) = (lo / LANES * LANES, hi.next_multiple_of(LANES).min(x.len()));
    let mut acc = [0f32; LANES];
    for (cx, cy) in x[from..to]
        .chunks_exact(LANES)
        .zip(y[from..to].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] = cx[l].mul_add(cy[l], acc[l]);
        }
    }
    reduce16(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_groups_windows_and_counts_from_one() {
        let l = layout(3, 2, 2);
        // windows: (x0..2, y0..2) then (x2, y0..2)
        assert_eq!(l.perm, vec![0, 1, 3, 4, 2, 5]);
        assert_eq!(
            l.window,
            vec![(0, 4), (0, 4), (0, 4), (0, 4), (4, 6), (4, 6)]
        );
        assert_eq!(l.pos[2], (1, 2));
        assert_eq!(l.pos[4], (3, 1));
        assert_eq!(l.windows(), vec![(0, 4), (4, 6)]);
    }

    /// At the real geometry's 1024×1024 grid (74×74 patches, windows of 32): the windows tile
    /// window order without gaps, each holds the tokens of one 32×32 block of the grid, and
    /// the order is a permutation of the grid (what the GPU encoder's gathers assume).
    #[test]
    fn windows_tile_the_grid_in_blocks() {
        let (gw, gh, win) = (74, 74, 32);
        let l = layout(gw, gh, win);
        let w = l.windows();
        assert_eq!(w.len(), 9);
        assert_eq!(w.first().map(|w| w.0), Some(0));
        assert_eq!(w.last().map(|w| w.1), Some(gw * gh));
        assert!(w.windows(2).all(|p| p[0].1 == p[1].0));
        assert_eq!(w[0].1 - w[0].0, win * win);
        assert_eq!(w[8].1 - w[8].0, 10 * 10);
        for &(lo, hi) in &w {
            let block = |i: usize| (l.perm[i] % gw / win, l.perm[i] / gw / win);
            assert!((lo..hi).all(|i| block(i) == block(lo)));
        }
        let mut seen = l.perm.clone();
        seen.sort_unstable();
        assert!(seen.iter().enumerate().all(|(i, &g)| i == g));
    }

    /// The RoPE table holds `hd / 2` (cos, sin) pairs a token: the x angles, then the y
    /// angles, each from the position itself down by `base^(-4/hd)` a pair.
    #[test]
    fn rope_table_turns_x_then_y() {
        let t = rope_table(&[(3, 5)], 8, 10000.0);
        assert_eq!(t.len(), 4);
        assert_eq!(t[0], (3f32.cos(), 3f32.sin()));
        assert_eq!(t[2], (5f32.cos(), 5f32.sin()));
        let step = 10000f32.powf(-0.5);
        assert_eq!(t[1], ((3.0 * step).cos(), (3.0 * step).sin()));
    }
}
