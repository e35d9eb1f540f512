//! Attention over the KV cache with llama.cpp's CPU flash-attention numerics
//! (`ggml_compute_forward_flash_attn_ext_f16`, b11434). `flash_attn = auto` resolves to enabled
//! on the CPU backend, so this is the path llama-completion and llama-server take by default.
//!
//! ggml picks one of three kernels per call; the numbers differ between them, so we pick the
//! same one from the same facts (query rows of the sequence, cells in view, threads):
//! - **tiled** (`q_rows >= 64`, F16/F32 cache): Q stays f32, K is widened to f32, scores are
//!   sequential FMAs over the head dim, softmax runs per 64-cell tile with ggml's vector exp,
//!   and V is accumulated in f32 per tile.
//! - **one chunk** (fewer query rows): Q is rounded to the cache type, scores use ggml's f16 dot,
//!   the online softmax uses libm `expf`, and for an F16 cache the V accumulator itself is F16.
//! - **split KV** (one query row, `n_kv >= 512`): the one-chunk kernel over `threads` equal cell
//!   ranges, merged in f32.

use super::math::{dot_f16, fma_fn, soft_max_tile, LANES};
use super::numerics::Order;
use crate::backend::AttnInput;
use crate::kv::KvType;
use half::f16;

/// ggml_fa_tile_config: query rows and cells per tile.
const TILE_Q: usize = 64;
const TILE_KV: usize = 64;

/// What one query row sees: the cache of its sequence for the layer.
pub struct View<'a> {
    pub k: &'a [u8],
    pub v: &'a [u8],
    /// Positions of cells `0..n_kv` (-1 = empty).
    pub cell_pos: &'a [i32],
    pub dtype: KvType,
    /// Row stride (elements) of a cell: n_head_kv · head_dim.
    pub row: usize,
    pub head_dim: usize,
    /// Sliding window (0 = none).
    pub n_swa: u32,
}

impl View<'_> {
    /// Panics unless every cell `< n_kv` of every kv head lies inside the buffers (the kernels
    /// read them unchecked).
    fn check(&self, n_kv: usize, n_head_kv: usize) {
        let need = n_kv * self.row * self.dtype.size();
        assert!(
            self.k.len() >= need
                && self.v.len() >= need
                && self.cell_pos.len() >= n_kv
                && n_head_kv * self.head_dim <= self.row
        );
    }

    fn visible(&self, c: usize, q_pos: i32) -> bool {
        let p = self.cell_pos[c];
        p >= 0 && p <= q_pos && (self.n_swa == 0 || q_pos - p < self.n_swa as i32)
    }

    fn k_f32(&self, c: usize, kvh: usize, out: &mut [f32]) {
        load(self.k, self.dtype, c * self.row + kvh * self.head_dim, out);
    }

    fn v_f32(&self, c: usize, kvh: usize, out: &mut [f32]) {
        load(self.v, self.dtype, c * self.row + kvh * self.head_dim, out);
    }

    fn f16_row<'b>(&self, buf: &'b [u8], c: usize, kvh: usize, tmp: &'b mut Vec<f16>) -> &'b [f16] {
        let at = (c * self.row + kvh * self.head_dim) * self.dtype.size();
        let bytes = &buf[at..at + self.head_dim * self.dtype.size()];
        tmp.clear();
        match self.dtype {
            KvType::F16 => tmp.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]]))),
            ),
            // ggml casts an F32 cache to F16 before flash attention on the CPU.
            KvType::F32 => tmp.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
            ),
        }
        tmp
    }
}

fn load(buf: &[u8], dtype: KvType, elem: usize, out: &mut [f32]) {
    match dtype {
        KvType::F16 => {
            let b = &buf[elem * 2..elem * 2 + out.len() * 2];
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        KvType::F32 => {
            let b = &buf[elem * 4..elem * 4 + out.len() * 4];
            for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// Store one K or V row (f32) into a cache row.
pub fn store(buf: &mut [u8], dtype: KvType, elem: usize, src: &[f32]) {
    match dtype {
        KvType::F16 => {
            #[cfg(target_arch = "x86_64")]
            if super::math::has_avx512() {
                let dst = &mut buf[elem * 2..(elem + src.len()) * 2];
                // SAFETY: features detected; `dst` holds exactly `src.len()` F16 values.
                unsafe { x86::store_f16(dst, src) };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if muser_quant::detected_isa() >= muser_quant::Isa::Avx2 {
                let dst = &mut buf[elem * 2..(elem + src.len()) * 2];
                // SAFETY: as above.
                unsafe { x86_avx2::store_f16(dst, src) };
                return;
            }
            for (i, &x) in src.iter().enumerate() {
                let at = (elem + i) * 2;
                buf[at..at + 2].copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        KvType::F32 => {
            for (i, &x) in src.iter().enumerate() {
                let at = (elem + i) * 4;
                buf[at..at + 4].copy_from_slice(&x.to_le_bytes());
            }
        }
    }
}

/// Which kernel ggml runs for a sequence's query rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Tiled,
    OneChunk,
    SplitKv { parts: usize },
}

pub fn choose(q_rows: usize, n_kv: usize, threads: usize) -> Kernel {
    if q_rows == 1 && n_kv >= 512 {
        Kernel::SplitKv {
            parts: threads.max(1),
        }
    } else if q_rows >= TILE_Q {
        Kernel::Tiled
    } else {
        Kernel::OneChunk
    }
}

/// Running state of one query head over a range of cells (the "partials" of ggml).
struct Partial {
    m: f32,
    s: f32,
    acc: Vec<f32>,
}

fma_fn! {
/// The one-chunk kernel for one query head over cells `range`: returns (M, S, unnormalised V).
fn one_chunk(order: Order, view: &View, kvh: usize, q: &[f32], q_pos: i32, scale: f32, range: std::ops::Range<usize>) -> (f32, f32, Vec<f32>) {
    let hd = view.head_dim;
    let qh: Vec<f16> = q.iter().map(|&x| f16::from_f32(x)).collect();
    let mut s_sum = 0f32;
    let mut m = f32::NEG_INFINITY;
    let mut acc16 = vec![f16::ZERO; hd];
    let mut tmp = Vec::with_capacity(hd);
    for c in range {
        if !view.visible(c, q_pos) {
            continue;
        }
        let k = view.f16_row(view.k, c, kvh, &mut tmp);
        let mut s = dot_f16(order, k, &qh);
        s *= scale;
        let m_old = m;
        let mut ms = 1f32;
        let mut vs = 1f32;
        if s > m {
            m = s;
            ms = (m_old - m).exp();
            for a in acc16.iter_mut() {
                *a = f16::from_f32(a.to_f32() * ms);
            }
        } else {
            vs = (s - m).exp();
        }
        let vrow = view.f16_row(view.v, c, kvh, &mut tmp);
        for (a, &x) in acc16.iter_mut().zip(vrow) {
            *a = f16::from_f32(x.to_f32().mul_add(vs, a.to_f32()));
        }
        s_sum = s_sum.mul_add(ms, vs);
    }
    (m, s_sum, acc16.iter().map(|a| a.to_f32()).collect())
}
}

/// Attention for the query rows of one sequence and one query head `h`.
/// `q(r)` gives query row `r`'s head slice; results go to `out(r)`.
#[allow(clippy::too_many_arguments)]
pub fn attend_head(
    order: Order,
    view: &View,
    kernel: Kernel,
    n_kv: usize,
    kvh: usize,
    scale: f32,
    q_rows: &[(&[f32], i32)],
    out: &mut [&mut [f32]],
) {
    match kernel {
        Kernel::OneChunk => {
            for ((q, p), o) in q_rows.iter().zip(out.iter_mut()) {
                let (_, s, mut acc) = one_chunk(order, view, kvh, q, *p, scale, 0..n_kv);
                finish(&mut acc, s, o);
            }
        }
        Kernel::SplitKv { parts } => {
            let chunk = n_kv.div_ceil(parts);
            for ((q, p), o) in q_rows.iter().zip(out.iter_mut()) {
                let partials: Vec<Partial> = (0..parts)
                    .filter(|i| i * chunk < n_kv)
                    .map(|i| {
                        let (m, s, acc) = one_chunk(
                            order,
                            view,
                            kvh,
                            q,
                            *p,
                            scale,
                            i * chunk..((i + 1) * chunk).min(n_kv),
                        );
                        Partial { m, s, acc }
                    })
                    .collect();
                merge(&partials, view.head_dim, o);
            }
        }
        Kernel::Tiled => tiled(order, view, n_kv, kvh, scale, q_rows, out),
    }
}

fn finish(acc: &mut [f32], s: f32, out: &mut [f32]) {
    let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = a * inv;
    }
}

fma_fn! {
/// `ggml_flash_attn_ext_reduce_partials` for one head.
fn merge(parts: &[Partial], hd: usize, out: &mut [f32]) {
    let mut m = f32::NEG_INFINITY;
    let mut s = 0f32;
    let mut acc = vec![0f32; hd];
    for p in parts {
        if p.s == 0.0 {
            continue;
        }
        let m_new = m.max(p.m);
        let so = (m - m_new).exp();
        let sn = (p.m - m_new).exp();
        for (a, &x) in acc.iter_mut().zip(&p.acc) {
            *a = a.mul_add(so, x * sn);
        }
        s = s.mul_add(so, p.s * sn);
        m = m_new;
    }
    if s != 0.0 {
        let inv = 1.0 / s;
        for a in acc.iter_mut() {
            *a *= inv;
        }
    }
    out.copy_from_slice(&acc);
}
}

fma_fn! {
/// The tiled kernel for up to 64 query rows of one head.
fn tiled(order: Order, view: &View, n_kv: usize, kvh: usize, scale: f32, q_rows: &[(&[f32], i32)], out: &mut [&mut [f32]]) {
    let hd = view.head_dim;
    for (tile_q, tile_out) in q_rows.chunks(TILE_Q).zip(out.chunks_mut(TILE_Q)) {
        let nq = tile_q.len();
        let mut m = vec![f32::NEG_INFINITY; nq];
        let mut s = vec![0f32; nq];
        let mut acc = vec![0f32; nq * hd];
        let mut kt = vec![0f32; hd * TILE_KV]; // K transposed: [d][cell]
        let mut vt = vec![0f32; TILE_KV * hd];
        let mut kq = vec![0f32; TILE_KV];
        let mut mask = vec![0f32; nq * TILE_KV];
        let mut row = vec![0f32; hd];
        let mut c0 = 0;
        while c0 < n_kv {
            let nc = TILE_KV.min(n_kv - c0);
            let mut any = false;
            for (r, (_, p)) in tile_q.iter().enumerate() {
                for t in 0..TILE_KV {
                    let vis = t < nc && view.visible(c0 + t, *p);
                    mask[r * TILE_KV + t] = if vis { 0.0 } else { f32::NEG_INFINITY };
                    any |= vis;
                }
            }
            if !any {
                c0 += TILE_KV;
                continue;
            }
            kt.fill(0.0);
            vt.fill(0.0);
            for t in 0..nc {
                view.k_f32(c0 + t, kvh, &mut row);
                for d in 0..hd {
                    kt[d * TILE_KV + t] = row[d];
                }
                view.v_f32(c0 + t, kvh, &mut vt[t * hd..(t + 1) * hd]);
            }
            for (r, (q, _)) in tile_q.iter().enumerate() {
                kq.fill(0.0);
                for d in 0..hd {
                    let qd = q[d];
                    let krow = &kt[d * TILE_KV..(d + 1) * TILE_KV];
                    for t in 0..TILE_KV {
                        kq[t] = qd.mul_add(krow[t], kq[t]);
                    }
                }
                for t in 0..TILE_KV {
                    kq[t] *= scale;
                    kq[t] = if t < nc { kq[t] + mask[r * TILE_KV + t] } else { f32::NEG_INFINITY };
                }
                let tile_max = kq.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let a = &mut acc[r * hd..(r + 1) * hd];
                if tile_max == f32::NEG_INFINITY {
                    continue;
                }
                let m_new = m[r].max(tile_max);
                if m_new > m[r] {
                    let ms = (m[r] - m_new).exp();
                    for x in a.iter_mut() {
                        *x *= ms;
                    }
                    s[r] *= ms;
                }
                m[r] = m_new;
                // `S += (double) sum` on a float S: the add happens in f64.
                s[r] = (f64::from(s[r]) + soft_max_tile(order, &mut kq, m_new)) as f32;
                for t in 0..TILE_KV {
                    let w = kq[t];
                    let vrow = &vt[t * hd..(t + 1) * hd];
                    for d in 0..hd {
                        a[d] = w.mul_add(vrow[d], a[d]);
                    }
                }
            }
            c0 += TILE_KV;
        }
        for (r, o) in tile_out.iter_mut().enumerate() {
            let inv = if s[r] == 0.0 { 0.0 } else { 1.0 / s[r] };
            for d in 0..hd {
                o[d] = acc[r * hd + d] * inv;
            }
        }
    }
}
}

// The tile softmax works on 16-lane groups.
const _: () = assert!(TILE_KV.is_multiple_of(LANES));

/// A raw pointer to the output matrix shared by the attention tasks; each task writes only the
/// columns of its head in the rows of its tokens, so the writes never overlap.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint ranges (see above) and the matrix outlives the parallel loop.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Query rows per tiled task (ggml's Q tile: results per row do not depend on the split).
const TASK_Q: usize = TILE_Q;

/// Attention for all groups of a batch on one layer. Called by the CPU backend after K/V are
/// stored. Returns `[tokens × n_head·hd]`.
pub fn run(
    order: Order,
    at: &AttnInput,
    views: &[View],
    n_kvs: &[usize],
    threads: usize,
    q: &[f32],
    n_tokens: usize,
) -> Vec<f32> {
    use rayon::prelude::*;
    let hd = at.head_dim;
    let qw = at.n_head * hd;
    let group = at.n_head / at.n_head_kv;
    let mut out = vec![0f32; n_tokens * qw];
    assert!(q.len() >= n_tokens * qw);
    for (g, idx) in at.groups.iter().enumerate() {
        assert!(idx.1.iter().all(|&t| t < n_tokens));
        views[g].check(n_kvs[g], at.n_head_kv);
    }
    // One task per (sequence, head, block of query rows).
    let mut tasks: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (g, (_, idx)) in at.groups.iter().enumerate() {
        let kernel = choose(idx.len(), n_kvs[g], threads);
        let step = match kernel {
            Kernel::Tiled => TASK_Q,
            _ => idx.len().max(1),
        };
        for h in 0..at.n_head {
            for r0 in (0..idx.len()).step_by(step) {
                tasks.push((g, h, r0, (r0 + step).min(idx.len())));
            }
        }
    }
    let dst = OutPtr(out.as_mut_ptr());
    let work = |&(g, h, r0, r1): &(usize, usize, usize, usize)| {
        let idx = &at.groups[g].1[r0..r1];
        let view = &views[g];
        let kernel = choose(at.groups[g].1.len(), n_kvs[g], threads);
        let rows: Vec<(&[f32], i32)> = idx
            .iter()
            .map(|&t| (&q[t * qw + h * hd..t * qw + (h + 1) * hd], at.pos[t] as i32))
            .collect();
        let mut emit = |r: usize, vals: &[f32]| {
            let t = idx[r];
            debug_assert_eq!(vals.len(), hd);
            // SAFETY: `t < n_tokens` (checked above) and head `h`'s columns of row `t` belong
            // to this task alone.
            unsafe {
                std::ptr::copy_nonoverlapping(vals.as_ptr(), dst.at(t * qw + h * hd), hd);
            }
        };
        attend_rows(
            order,
            view,
            kernel,
            n_kvs[g],
            h / group,
            at.scale,
            &rows,
            &mut emit,
        );
    };
    if tasks.len() == 1 {
        tasks.iter().for_each(work);
    } else {
        tasks.par_iter().for_each(work);
    }
    out
}

/// Attention of some query rows of one head; row `r`'s result goes to `emit(r, values)`.
#[allow(clippy::too_many_arguments)]
fn attend_rows(
    order: Order,
    view: &View,
    kernel: Kernel,
    n_kv: usize,
    kvh: usize,
    scale: f32,
    q_rows: &[(&[f32], i32)],
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    let isa = muser_quant::detected_isa();
    attend_rows_isa(isa, order, view, kernel, n_kv, kvh, scale, q_rows, emit);
}

/// [`attend_rows`] with the kernel family `isa` (at most what the CPU has): every family gives
/// the same bits.
#[allow(clippy::too_many_arguments)]
fn attend_rows_isa(
    isa: muser_quant::Isa,
    order: Order,
    view: &View,
    kernel: Kernel,
    n_kv: usize,
    kvh: usize,
    scale: f32,
    q_rows: &[(&[f32], i32)],
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    let isa = isa.min(muser_quant::hardware_isa());
    // One dispatch for both SIMD families (`x86`: AVX512 order only; `x86_avx2`: either order,
    // its first argument), which otherwise share signatures.
    #[cfg(target_arch = "x86_64")]
    macro_rules! simd {
        ($m:ident $(, $o:expr)?) => {{
            // SAFETY: the features were detected; `View::check` bounded every cell access.
            unsafe {
                match kernel {
                    Kernel::Tiled => $m::tiled($($o,)? view, n_kv, kvh, scale, q_rows, emit),
                    Kernel::OneChunk => {
                        for (r, (q, p)) in q_rows.iter().enumerate() {
                            let (_, s, mut acc) =
                                $m::one_chunk($($o,)? view, kvh, q, *p, scale, 0..n_kv);
                            let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
                            acc.iter_mut().for_each(|a| *a *= inv);
                            emit(r, &acc);
                        }
                    }
                    Kernel::SplitKv { parts } => {
                        let chunk = n_kv.div_ceil(parts);
                        let mut o = vec![0f32; view.head_dim];
                        for (r, (q, p)) in q_rows.iter().enumerate() {
                            let partials: Vec<Partial> = (0..parts)
                                .filter(|i| i * chunk < n_kv)
                                .map(|i| {
                                    let range = i * chunk..((i + 1) * chunk).min(n_kv);
                                    let (m, s, acc) = $m::one_chunk($($o,)? view, kvh, q, *p, scale, range);
                                    Partial { m, s, acc }
                                })
                                .collect();
                            merge(&partials, view.head_dim, &mut o);
                            emit(r, &o);
                        }
                    }
                }
            }
            return;
        }};
    }
    #[cfg(target_arch = "x86_64")]
    if view.head_dim.is_multiple_of(LANES) {
        match (isa, order) {
            (muser_quant::Isa::Avx512, Order::GgmlAvx512) => simd!(x86),
            (muser_quant::Isa::Avx512 | muser_quant::Isa::Avx2, _) => simd!(x86_avx2, order),
            (muser_quant::Isa::Scalar, _) => {}
        }
    }
    let mut buf = vec![0f32; q_rows.len() * view.head_dim];
    {
        let mut outs: Vec<&mut [f32]> = buf.chunks_mut(view.head_dim).collect();
        attend_head(order, view, kernel, n_kv, kvh, scale, q_rows, &mut outs);
    }
    for (r, o) in buf.chunks(view.head_dim).enumerate() {
        emit(r, o);
    }
}

/// The AVX512 kernels: the same operations in the same order as the scalar models above
/// (`tiled`, `one_chunk`), with query rows (tiled) or head dims (one chunk) in the lanes.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{View, TILE_KV, TILE_Q};
    use crate::cpu::math::x86::{reduce_add, v_expf};
    use crate::cpu::math::LANES;
    use crate::kv::KvType;
    use std::arch::x86_64::*;

    /// 16 cache values at element `elem` as f32; `round16` rounds F32 values through F16 (ggml
    /// casts an F32 cache to F16 for the one-chunk kernel).
    #[inline(always)]
    unsafe fn load16(buf: &[u8], dtype: KvType, elem: usize, round16: bool) -> __m512 {
        match dtype {
            KvType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(
                buf.as_ptr().add(elem * 2) as *const __m256i
            )),
            KvType::F32 => {
                let v = _mm512_loadu_ps(buf.as_ptr().add(elem * 4) as *const f32);
                if round16 {
                    round_f16(v)
                } else {
                    v
                }
            }
        }
    }

    /// Round to F16 and back (round to nearest even, as `f16::from_f32` and ggml's F16 stores).
    #[inline(always)]
    unsafe fn round_f16(v: __m512) -> __m512 {
        _mm512_cvtph_ps(_mm512_cvtps_ph::<
            { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
        >(v))
    }

    /// `src` as F16 (round to nearest even, as `f16::from_f32`) into `dst` (2 bytes each).
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,fma,f16c")]
    pub unsafe fn store_f16(dst: &mut [u8], src: &[f32]) {
        assert_eq!(dst.len(), src.len() * 2);
        let n = src.len();
        let body = n - n % LANES;
        let mut i = 0;
        while i < body {
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_loadu_ps(src.as_ptr().add(i)),
            );
            _mm256_storeu_si256(dst.as_mut_ptr().add(i * 2) as *mut __m256i, h);
            i += LANES;
        }
        for i in body..n {
            dst[i * 2..i * 2 + 2]
                .copy_from_slice(&half::f16::from_f32(src[i]).to_bits().to_le_bytes());
        }
    }

    /// A cell's K or V row for kv head `kvh` as f32 (`hd` values, a multiple of 16).
    #[inline(always)]
    unsafe fn load_row(view: &View, buf: &[u8], c: usize, kvh: usize, out: &mut [f32]) {
        let base = c * view.row + kvh * view.head_dim;
        for (i, o) in out.chunks_exact_mut(LANES).enumerate() {
            _mm512_storeu_ps(
                o.as_mut_ptr(),
                load16(buf, view.dtype, base + i * LANES, false),
            );
        }
    }

    /// The tiled kernel (`super::tiled`) for up to 64 query rows: rows in the lanes of four
    /// 16-lane groups for the scores and the softmax, then row by row for V.
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,fma,f16c")]
    pub unsafe fn tiled(
        view: &View,
        n_kv: usize,
        kvh: usize,
        scale: f32,
        q_rows: &[(&[f32], i32)],
        emit: &mut dyn FnMut(usize, &[f32]),
    ) {
        for (b, rows) in q_rows.chunks(TILE_Q).enumerate() {
            let mut sub = |r: usize, v: &[f32]| emit(b * TILE_Q + r, v);
            match rows.len().div_ceil(LANES) {
                1 => tile::<1>(view, n_kv, kvh, scale, rows, &mut sub),
                2 => tile::<2>(view, n_kv, kvh, scale, rows, &mut sub),
                3 => tile::<3>(view, n_kv, kvh, scale, rows, &mut sub),
                _ => tile::<4>(view, n_kv, kvh, scale, rows, &mut sub),
            }
        }
    }

    /// One tile of `nq <= 16·G` query rows.
    #[inline(always)]
    unsafe fn tile<const G: usize>(
        view: &View,
        n_kv: usize,
        kvh: usize,
        scale: f32,
        q_rows: &[(&[f32], i32)],
        emit: &mut dyn FnMut(usize, &[f32]),
    ) {
        const W: usize = TILE_Q; // row stride of the lane-major buffers
        let hd = view.head_dim;
        let nq = q_rows.len();
        debug_assert!(nq <= G * LANES);
        // Q transposed: qt[d·W + r], gathered 16 rows at a time from a contiguous copy.
        let mut qc = vec![0f32; G * LANES * hd];
        let mut qpos = [i32::MIN; TILE_Q];
        for (r, (q, p)) in q_rows.iter().enumerate() {
            qc[r * hd..(r + 1) * hd].copy_from_slice(&q[..hd]);
            qpos[r] = *p;
        }
        let mut qt = vec![0f32; hd * W];
        let gidx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(hd as i32),
        );
        for g in 0..G {
            let src = qc.as_ptr().add(g * LANES * hd);
            for d in 0..hd {
                let v = _mm512_i32gather_ps::<4>(gidx, src.add(d));
                _mm512_storeu_ps(qt.as_mut_ptr().add(d * W + g * LANES), v);
            }
        }
        let qp: [__m512i; G] =
            std::array::from_fn(|g| _mm512_loadu_si512(qpos.as_ptr().add(g * LANES) as *const _));
        let real: [__mmask16; G] = std::array::from_fn(|g| {
            let n = nq.saturating_sub(g * LANES).min(LANES);
            ((1u32 << n) - 1) as __mmask16
        });
        let mut m = [_mm512_set1_ps(f32::NEG_INFINITY); G];
        let mut s = [_mm512_setzero_ps(); G];
        // TILE_Q rows, so that the 4-row V blocks never run past the end.
        let mut acc = vec![0f32; TILE_Q * hd];
        let mut kf = vec![0f32; TILE_KV * hd];
        let mut vf = vec![0f32; TILE_KV * hd];
        // Scores, lane-major: sc[t·W + r].
        let mut sc = vec![0f32; TILE_KV * W];
        let mut vis = [[0 as __mmask16; G]; TILE_KV];
        let n_swa = view.n_swa as i32;
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let zero = _mm512_setzero_ps();
        let vscale = _mm512_set1_ps(scale);
        let mut c0 = 0;
        while c0 < n_kv {
            let nc = TILE_KV.min(n_kv - c0);
            let mut any = false;
            for t in 0..TILE_KV {
                for g in 0..G {
                    vis[t][g] = 0;
                }
                if t >= nc {
                    continue;
                }
                let p = view.cell_pos[c0 + t];
                if p < 0 {
                    continue;
                }
                let vp = _mm512_set1_epi32(p);
                for g in 0..G {
                    // p <= q_pos && (n_swa == 0 || q_pos - p < n_swa)
                    let mut k = _mm512_mask_cmple_epi32_mask(real[g], vp, qp[g]);
                    if n_swa != 0 {
                        let dist = _mm512_sub_epi32(qp[g], vp);
                        k &= _mm512_cmplt_epi32_mask(dist, _mm512_set1_epi32(n_swa));
                    }
                    vis[t][g] = k;
                    any |= k != 0;
                }
            }
            if !any {
                c0 += TILE_KV;
                continue;
            }
            for t in 0..nc {
                load_row(view, view.k, c0 + t, kvh, &mut kf[t * hd..(t + 1) * hd]);
                load_row(view, view.v, c0 + t, kvh, &mut vf[t * hd..(t + 1) * hd]);
            }
            // kq[t] = Σ_d q[d]·k[t][d] (FMA in d order), ·scale, + mask.
            let mut t = 0;
            while t < nc {
                let mut a = [[zero; G]; 4];
                let kp = kf.as_ptr().add(t * hd);
                for d in 0..hd {
                    let qv: [__m512; G] = std::array::from_fn(|g| {
                        _mm512_loadu_ps(qt.as_ptr().add(d * W + g * LANES))
                    });
                    for (c, ac) in a.iter_mut().enumerate() {
                        let kb = _mm512_set1_ps(*kp.add(c * hd + d));
                        for g in 0..G {
                            ac[g] = _mm512_fmadd_ps(qv[g], kb, ac[g]);
                        }
                    }
                }
                for (c, ac) in a.iter().enumerate() {
                    let tc = t + c;
                    if tc >= nc {
                        break;
                    }
                    for g in 0..G {
                        let mask = _mm512_mask_blend_ps(vis[tc][g], neg_inf, zero);
                        let v = _mm512_add_ps(_mm512_mul_ps(ac[g], vscale), mask);
                        _mm512_storeu_ps(sc.as_mut_ptr().add(tc * W + g * LANES), v);
                    }
                }
                t += 4;
            }
            for t in nc..TILE_KV {
                for g in 0..G {
                    _mm512_storeu_ps(sc.as_mut_ptr().add(t * W + g * LANES), neg_inf);
                }
            }
            // Per row: tile max, rescale on a new maximum, softmax of the tile, sum.
            let mut valid = [0 as __mmask16; G];
            let mut grow = [0 as __mmask16; G];
            let mut ms = [[1f32; LANES]; G];
            let mut m_new = [zero; G];
            for g in 0..G {
                let mut tmax = neg_inf;
                for t in 0..TILE_KV {
                    tmax = _mm512_max_ps(tmax, _mm512_loadu_ps(sc.as_ptr().add(t * W + g * LANES)));
                }
                valid[g] = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(tmax, neg_inf) & real[g];
                let mn = _mm512_max_ps(m[g], tmax);
                grow[g] = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(mn, m[g]) & valid[g];
                if grow[g] != 0 {
                    let mut mo = [0f32; LANES];
                    let mut mnv = [0f32; LANES];
                    _mm512_storeu_ps(mo.as_mut_ptr(), m[g]);
                    _mm512_storeu_ps(mnv.as_mut_ptr(), mn);
                    for l in 0..LANES {
                        if grow[g] >> l & 1 == 1 {
                            ms[g][l] = (mo[l] - mnv[l]).exp();
                        }
                    }
                    let vms = _mm512_loadu_ps(ms[g].as_ptr());
                    s[g] = _mm512_mask_mul_ps(s[g], grow[g], s[g], vms);
                }
                m[g] = _mm512_mask_mov_ps(m[g], valid[g], mn);
                m_new[g] = mn;
                // soft_max_tile: exp(x - max) per 16 cells, each group reduced by the
                // `_mm512_reduce_add_ps` tree, the groups summed in f64.
                let mut sum_lo = _mm512_setzero_pd();
                let mut sum_hi = _mm512_setzero_pd();
                for k in 0..TILE_KV / LANES {
                    let mut v = [zero; LANES];
                    for (i, vi) in v.iter_mut().enumerate() {
                        let at = sc.as_mut_ptr().add((k * LANES + i) * W + g * LANES);
                        *vi = v_expf(_mm512_sub_ps(_mm512_loadu_ps(at), mn));
                        _mm512_storeu_ps(at, *vi);
                    }
                    let t8: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(v[i + 8], v[i]));
                    let t4: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t8[i + 4], t8[i]));
                    let r = _mm512_add_ps(_mm512_add_ps(t4[0], t4[2]), _mm512_add_ps(t4[1], t4[3]));
                    sum_lo = _mm512_add_pd(sum_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(r)));
                    sum_hi = _mm512_add_pd(sum_hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(r)));
                }
                let s_lo = _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(s[g])), sum_lo);
                let s_hi =
                    _mm512_add_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(s[g])), sum_hi);
                let s_new = _mm512_insertf32x8::<1>(
                    _mm512_castps256_ps512(_mm512_cvtpd_ps(s_lo)),
                    _mm512_cvtpd_ps(s_hi),
                );
                s[g] = _mm512_mask_mov_ps(s[g], valid[g], s_new);
            }
            // V: acc[r] = acc[r]·ms + Σ_t w[t]·v[t] (FMA in t order; the padding cells of a
            // partial tile add w = 0 times v = 0, i.e. +0). Four rows at a time share each V
            // load; rows without a visible cell here are computed but not stored.
            for r0 in (0..nq).step_by(4) {
                let mut store = 0u8;
                let mut scale_by = [1f32; 4];
                for j in 0..4 {
                    let r = r0 + j;
                    let (g, l) = (r / LANES, r % LANES);
                    if r < nq && valid[g] >> l & 1 == 1 {
                        store |= 1 << j;
                        if grow[g] >> l & 1 == 1 {
                            // ×1 leaves a value unchanged, so rows without a new max use it.
                            scale_by[j] = ms[g][l];
                        }
                    }
                }
                if store == 0 {
                    continue;
                }
                let a = acc.as_mut_ptr().add(r0 * hd);
                let w = sc.as_ptr().add(r0);
                let mut d = 0;
                while d < hd {
                    let step = match (hd - d) / LANES {
                        n if n >= 4 => 4,
                        n if n >= 2 => 2,
                        _ => 1,
                    };
                    match step {
                        4 => v_block::<4>(a, d, hd, &vf, w, nc, scale_by, store),
                        2 => v_block::<2>(a, d, hd, &vf, w, nc, scale_by, store),
                        _ => v_block::<1>(a, d, hd, &vf, w, nc, scale_by, store),
                    }
                    d += step * LANES;
                }
            }
            c0 += TILE_KV;
        }
        let mut sv = [[0f32; LANES]; G];
        for g in 0..G {
            _mm512_storeu_ps(sv[g].as_mut_ptr(), s[g]);
        }
        let mut o = vec![0f32; hd];
        for r in 0..nq {
            let sr = sv[r / LANES][r % LANES];
            let inv = _mm512_set1_ps(if sr == 0.0 { 0.0 } else { 1.0 / sr });
            for d in (0..hd).step_by(LANES) {
                let a = _mm512_loadu_ps(acc.as_ptr().add(r * hd + d));
                _mm512_storeu_ps(o.as_mut_ptr().add(d), _mm512_mul_ps(a, inv));
            }
            emit(r, &o);
        }
    }

    /// `N` vectors from dim `d` of the V accumulators of four rows (`acc` at the first, rows
    /// `hd` apart; weights `w[t·TILE_Q + j]`): rescale, FMA over the cells in order, then store
    /// the rows whose bit is set in `store`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn v_block<const N: usize>(
        acc: *mut f32,
        d: usize,
        hd: usize,
        vf: &[f32],
        w: *const f32,
        nc: usize,
        scale_by: [f32; 4],
        store: u8,
    ) {
        let mut a: [[__m512; N]; 4] = std::array::from_fn(|j| {
            let m = _mm512_set1_ps(scale_by[j]);
            std::array::from_fn(|i| {
                _mm512_mul_ps(_mm512_loadu_ps(acc.add(j * hd + d + i * LANES)), m)
            })
        });
        let vp = vf.as_ptr().add(d);
        for t in 0..nc {
            let v: [__m512; N] =
                std::array::from_fn(|i| _mm512_loadu_ps(vp.add(t * hd + i * LANES)));
            for (j, aj) in a.iter_mut().enumerate() {
                let wt = _mm512_set1_ps(*w.add(t * TILE_Q + j));
                for i in 0..N {
                    aj[i] = _mm512_fmadd_ps(wt, v[i], aj[i]);
                }
            }
        }
        if nc < TILE_KV {
            for aj in a.iter_mut() {
                for x in aj.iter_mut() {
                    *x = _mm512_add_ps(*x, _mm512_setzero_ps());
                }
            }
        }
        for (j, aj) in a.iter().enumerate() {
            if store >> j & 1 == 1 {
                for (i, x) in aj.iter().enumerate() {
                    _mm512_storeu_ps(acc.add(j * hd + d + i * LANES), *x);
                }
            }
        }
    }

    /// The one-chunk kernel (`super::one_chunk`): Q rounded to F16, `ggml_vec_dot_f16` scores,
    /// online softmax with libm `expf`, and an accumulator rounded to F16 after every update.
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,fma,f16c")]
    pub unsafe fn one_chunk(
        view: &View,
        kvh: usize,
        q: &[f32],
        q_pos: i32,
        scale: f32,
        range: std::ops::Range<usize>,
    ) -> (f32, f32, Vec<f32>) {
        let hd = view.head_dim;
        let nv = hd / LANES;
        let body = hd - hd % (4 * LANES);
        let qf: Vec<__m512> = (0..nv)
            .map(|i| round_f16(_mm512_loadu_ps(q.as_ptr().add(i * LANES))))
            .collect();
        let mut qs = vec![0f32; hd];
        for (i, v) in qf.iter().enumerate() {
            _mm512_storeu_ps(qs.as_mut_ptr().add(i * LANES), *v);
        }
        let mut acc = vec![_mm512_setzero_ps(); nv];
        let mut s_sum = 0f32;
        let mut m = f32::NEG_INFINITY;
        let mut kt = vec![0f32; hd];
        for c in range {
            if !view.visible(c, q_pos) {
                continue;
            }
            let base = c * view.row + kvh * hd;
            // ggml_vec_dot_f16: four accumulators over 64-value steps, the tail in f64.
            let mut a4 = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            while i < body {
                for (j, a) in a4.iter_mut().enumerate() {
                    let o = i + j * LANES;
                    let k = load16(view.k, view.dtype, base + o, true);
                    *a = _mm512_fmadd_ps(k, qf[o / LANES], *a);
                }
                i += 4 * LANES;
            }
            let s16 = _mm512_add_ps(_mm512_add_ps(a4[0], a4[2]), _mm512_add_ps(a4[1], a4[3]));
            let mut sum = f64::from(reduce_add(s16));
            if body < hd {
                for o in (body..hd).step_by(LANES) {
                    let k = load16(view.k, view.dtype, base + o, true);
                    _mm512_storeu_ps(kt.as_mut_ptr().add(o), _mm512_mul_ps(k, qf[o / LANES]));
                }
                for &p in &kt[body..hd] {
                    sum += f64::from(p);
                }
            }
            let s = sum as f32 * scale;
            let m_old = m;
            let mut ms = 1f32;
            let mut vs = 1f32;
            if s > m {
                m = s;
                ms = (m_old - m).exp();
                let v = _mm512_set1_ps(ms);
                for a in acc.iter_mut() {
                    *a = round_f16(_mm512_mul_ps(*a, v));
                }
            } else {
                vs = (s - m).exp();
            }
            let vv = _mm512_set1_ps(vs);
            for (i, a) in acc.iter_mut().enumerate() {
                let x = load16(view.v, view.dtype, base + i * LANES, true);
                *a = round_f16(_mm512_fmadd_ps(x, vv, *a));
            }
            s_sum = s_sum.mul_add(ms, vs);
        }
        let mut out = vec![0f32; hd];
        for (i, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(i * LANES), *a);
        }
        (m, s_sum, out)
    }
}

/// The AVX2 kernels, in either order. In the AVX512 order: the AVX512 kernels' operations in the
/// same order on eight lanes. In the tiled kernel the lanes are query rows (no lane ever meets
/// another), so eight at a time give the same bits; in the one-chunk kernel the lanes are head
/// dims, so each 16-lane AVX512 accumulator is a pair of registers and reduced by the same tree.
/// In the AVX2 order: ggml's AVX2 `expf`, softmax groups of 8 cells, one register per
/// `vec_dot_f16` accumulator and the `hadd` tree.
#[cfg(target_arch = "x86_64")]
mod x86_avx2 {
    use super::{View, TILE_KV, TILE_Q};
    use crate::cpu::math::x86_avx2::{reduce_add_16, reduce_hadd_8, v_expf, v_expf_avx2_order};
    use crate::cpu::math::LANES;
    use crate::cpu::numerics::Order;
    use crate::kv::KvType;
    use std::arch::x86_64::*;

    /// Lanes of a register.
    const L: usize = 8;

    /// 8 cache values at element `elem` as f32; `round16` rounds F32 values through F16.
    #[inline(always)]
    unsafe fn load8(buf: &[u8], dtype: KvType, elem: usize, round16: bool) -> __m256 {
        match dtype {
            KvType::F16 => {
                _mm256_cvtph_ps(_mm_loadu_si128(buf.as_ptr().add(elem * 2) as *const __m128i))
            }
            KvType::F32 => {
                let v = _mm256_loadu_ps(buf.as_ptr().add(elem * 4) as *const f32);
                if round16 {
                    round_f16(v)
                } else {
                    v
                }
            }
        }
    }

    /// Round to F16 and back (round to nearest even).
    #[inline(always)]
    unsafe fn round_f16(v: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
    }

    /// `src` as F16 (round to nearest even, as `f16::from_f32`) into `dst` (2 bytes each).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn store_f16(dst: &mut [u8], src: &[f32]) {
        assert_eq!(dst.len(), src.len() * 2);
        let n = src.len();
        let body = n - n % L;
        let mut i = 0;
        while i < body {
            let h =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i * 2) as *mut __m128i, h);
            i += L;
        }
        for i in body..n {
            dst[i * 2..i * 2 + 2]
                .copy_from_slice(&half::f16::from_f32(src[i]).to_bits().to_le_bytes());
        }
    }

    /// A cell's K or V row for kv head `kvh` as f32 (`hd` values, a multiple of 8).
    #[inline(always)]
    unsafe fn load_row(view: &View, buf: &[u8], c: usize, kvh: usize, out: &mut [f32]) {
        let base = c * view.row + kvh * view.head_dim;
        for (i, o) in out.chunks_exact_mut(L).enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr(), load8(buf, view.dtype, base + i * L, false));
        }
    }

    /// Lane mask (all ones where bit `l` of `m` is set) of an 8-bit mask.
    #[inline(always)]
    unsafe fn lanes_of(m: u8) -> __m256 {
        let bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let v = _mm256_and_si256(_mm256_set1_epi32(m as i32), bits);
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, bits))
    }

    #[inline(always)]
    unsafe fn mask_of(v: __m256) -> u8 {
        _mm256_movemask_ps(v) as u8
    }

    /// The tiled kernel for up to 64 query rows: rows in the lanes of eight 8-lane groups.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tiled(
        order: Order,
        view: &View,
        n_kv: usize,
        kvh: usize,
        scale: f32,
        q_rows: &[(&[f32], i32)],
        emit: &mut dyn FnMut(usize, &[f32]),
    ) {
        for (b, rows) in q_rows.chunks(TILE_Q).enumerate() {
            let mut sub = |r: usize, v: &[f32]| emit(b * TILE_Q + r, v);
            tile(order, view, n_kv, kvh, scale, rows, &mut sub);
        }
    }

    /// One tile of `nq <= 64` query rows.
    #[inline(always)]
    unsafe fn tile(
        order: Order,
        view: &View,
        n_kv: usize,
        kvh: usize,
        scale: f32,
        q_rows: &[(&[f32], i32)],
        emit: &mut dyn FnMut(usize, &[f32]),
    ) {
        const W: usize = TILE_Q; // row stride of the lane-major buffers
        const GMAX: usize = TILE_Q / L;
        let hd = view.head_dim;
        let nq = q_rows.len();
        let ng = nq.div_ceil(L);
        debug_assert!(nq <= TILE_Q);
        // Q transposed: qt[d·W + r].
        let mut qt = vec![0f32; hd * W];
        let mut qpos = [i32::MIN; TILE_Q];
        for (r, (q, p)) in q_rows.iter().enumerate() {
            for d in 0..hd {
                qt[d * W + r] = q[d];
            }
            qpos[r] = *p;
        }
        let qp: [__m256i; GMAX] =
            std::array::from_fn(|g| _mm256_loadu_si256(qpos.as_ptr().add(g * L) as *const _));
        let real: [u8; GMAX] = std::array::from_fn(|g| {
            let n = nq.saturating_sub(g * L).min(L);
            ((1u32 << n) - 1) as u8
        });
        let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); GMAX];
        let mut s = [_mm256_setzero_ps(); GMAX];
        let mut acc = vec![0f32; TILE_Q * hd];
        let mut kf = vec![0f32; TILE_KV * hd];
        let mut vf = vec![0f32; TILE_KV * hd];
        // Scores, lane-major: sc[t·W + r].
        let mut sc = vec![0f32; TILE_KV * W];
        let mut vis = [[0u8; GMAX]; TILE_KV];
        let n_swa = view.n_swa as i32;
        let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
        let zero = _mm256_setzero_ps();
        let vscale = _mm256_set1_ps(scale);
        let mut c0 = 0;
        while c0 < n_kv {
            let nc = TILE_KV.min(n_kv - c0);
            let mut any = false;
            for t in 0..TILE_KV {
                vis[t] = [0; GMAX];
                if t >= nc {
                    continue;
                }
                let p = view.cell_pos[c0 + t];
                if p < 0 {
                    continue;
                }
                let vp = _mm256_set1_epi32(p);
                for g in 0..ng {
                    // p <= q_pos && (n_swa == 0 || q_pos - p < n_swa)
                    let le = _mm256_xor_si256(_mm256_cmpgt_epi32(vp, qp[g]), _mm256_set1_epi32(-1));
                    let mut k = mask_of(_mm256_castsi256_ps(le)) & real[g];
                    if n_swa != 0 {
                        let dist = _mm256_sub_epi32(qp[g], vp);
                        let lt = _mm256_cmpgt_epi32(_mm256_set1_epi32(n_swa), dist);
                        k &= mask_of(_mm256_castsi256_ps(lt));
                    }
                    vis[t][g] = k;
                    any |= k != 0;
                }
            }
            if !any {
                c0 += TILE_KV;
                continue;
            }
            for t in 0..nc {
                load_row(view, view.k, c0 + t, kvh, &mut kf[t * hd..(t + 1) * hd]);
                load_row(view, view.v, c0 + t, kvh, &mut vf[t * hd..(t + 1) * hd]);
            }
            // kq[t] = Σ_d q[d]·k[t][d] (FMA in d order), ·scale, + mask; 8 cells at a time.
            for g in 0..ng {
                let mut t = 0;
                while t < nc {
                    let mut a = [zero; 8];
                    let kp = kf.as_ptr().add(t * hd);
                    let cells = (nc - t).min(8);
                    for d in 0..hd {
                        let qv = _mm256_loadu_ps(qt.as_ptr().add(d * W + g * L));
                        for (c, ac) in a.iter_mut().enumerate().take(cells) {
                            *ac = _mm256_fmadd_ps(qv, _mm256_set1_ps(*kp.add(c * hd + d)), *ac);
                        }
                    }
                    for (c, ac) in a.iter().enumerate().take(cells) {
                        let tc = t + c;
                        let mask = _mm256_blendv_ps(neg_inf, zero, lanes_of(vis[tc][g]));
                        let v = _mm256_add_ps(_mm256_mul_ps(*ac, vscale), mask);
                        _mm256_storeu_ps(sc.as_mut_ptr().add(tc * W + g * L), v);
                    }
                    t += 8;
                }
            }
            for t in nc..TILE_KV {
                for g in 0..ng {
                    _mm256_storeu_ps(sc.as_mut_ptr().add(t * W + g * L), neg_inf);
                }
            }
            // Per row: tile max, rescale on a new maximum, softmax of the tile, sum.
            let mut valid = [0u8; GMAX];
            let mut grow = [0u8; GMAX];
            let mut ms = [[1f32; L]; GMAX];
            for g in 0..ng {
                let mut tmax = neg_inf;
                for t in 0..TILE_KV {
                    tmax = _mm256_max_ps(tmax, _mm256_loadu_ps(sc.as_ptr().add(t * W + g * L)));
                }
                valid[g] = mask_of(_mm256_cmp_ps::<_CMP_NEQ_OQ>(tmax, neg_inf)) & real[g];
                let mn = _mm256_max_ps(m[g], tmax);
                grow[g] = mask_of(_mm256_cmp_ps::<_CMP_GT_OQ>(mn, m[g])) & valid[g];
                if grow[g] != 0 {
                    let mut mo = [0f32; L];
                    let mut mnv = [0f32; L];
                    _mm256_storeu_ps(mo.as_mut_ptr(), m[g]);
                    _mm256_storeu_ps(mnv.as_mut_ptr(), mn);
                    for l in 0..L {
                        if grow[g] >> l & 1 == 1 {
                            ms[g][l] = (mo[l] - mnv[l]).exp();
                        }
                    }
                    let vms = _mm256_loadu_ps(ms[g].as_ptr());
                    s[g] = _mm256_blendv_ps(s[g], _mm256_mul_ps(s[g], vms), lanes_of(grow[g]));
                }
                m[g] = _mm256_blendv_ps(m[g], mn, lanes_of(valid[g]));
                // soft_max_tile: exp(x - max) per 16 cells, each group reduced by the
                // `_mm512_reduce_add_ps` tree (across cells here), the groups summed in f64.
                // (groups of `order.lanes()` cells: 16 in the AVX512 order, 8 in the AVX2 one)
                let mut sum_lo = _mm256_setzero_pd();
                let mut sum_hi = _mm256_setzero_pd();
                let gw = order.lanes();
                for k in 0..TILE_KV / gw {
                    let mut v = [zero; LANES];
                    for (i, vi) in v[..gw].iter_mut().enumerate() {
                        let at = sc.as_mut_ptr().add((k * gw + i) * W + g * L);
                        let x = _mm256_sub_ps(_mm256_loadu_ps(at), mn);
                        *vi = match order {
                            Order::GgmlAvx512 => v_expf(x),
                            Order::GgmlAvx2 => v_expf_avx2_order(x),
                        };
                        _mm256_storeu_ps(at, *vi);
                    }
                    let mut w = gw;
                    while w > 4 {
                        w /= 2;
                        for i in 0..w {
                            v[i] = _mm256_add_ps(v[i + w], v[i]);
                        }
                    }
                    let r = _mm256_add_ps(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3]));
                    sum_lo = _mm256_add_pd(sum_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(r)));
                    sum_hi = _mm256_add_pd(sum_hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(r)));
                }
                let s_lo = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s[g])), sum_lo);
                let s_hi = _mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(s[g])), sum_hi);
                let s_new = _mm256_set_m128(_mm256_cvtpd_ps(s_hi), _mm256_cvtpd_ps(s_lo));
                s[g] = _mm256_blendv_ps(s[g], s_new, lanes_of(valid[g]));
            }
            // V: acc[r] = acc[r]·ms + Σ_t w[t]·v[t] (FMA in t order; the padding cells of a
            // partial tile add w = 0 times v = 0, i.e. +0). Four rows at a time share each V
            // load; rows without a visible cell here are computed but not stored.
            for r0 in (0..nq).step_by(4) {
                let mut store = 0u8;
                let mut scale_by = [1f32; 4];
                for j in 0..4 {
                    let r = r0 + j;
                    let (g, l) = (r / L, r % L);
                    if r < nq && valid[g] >> l & 1 == 1 {
                        store |= 1 << j;
                        if grow[g] >> l & 1 == 1 {
                            scale_by[j] = ms[g][l];
                        }
                    }
                }
                if store == 0 {
                    continue;
                }
                let a = acc.as_mut_ptr().add(r0 * hd);
                let w = sc.as_ptr().add(r0);
                let mut d = 0;
                while d < hd {
                    if hd - d >= 2 * L {
                        v_block::<2>(a, d, hd, &vf, w, nc, scale_by, store);
                        d += 2 * L;
                    } else {
                        v_block::<1>(a, d, hd, &vf, w, nc, scale_by, store);
                        d += L;
                    }
                }
            }
            c0 += TILE_KV;
        }
        let mut sv = [[0f32; L]; GMAX];
        for g in 0..ng {
            _mm256_storeu_ps(sv[g].as_mut_ptr(), s[g]);
        }
        let mut o = vec![0f32; hd];
        for r in 0..nq {
            let sr = sv[r / L][r % L];
            let inv = _mm256_set1_ps(if sr == 0.0 { 0.0 } else { 1.0 / sr });
            for d in (0..hd).step_by(L) {
                let a = _mm256_loadu_ps(acc.as_ptr().add(r * hd + d));
                _mm256_storeu_ps(o.as_mut_ptr().add(d), _mm256_mul_ps(a, inv));
            }
            emit(r, &o);
        }
    }

    /// `N` vectors from dim `d` of the V accumulators of four rows: rescale, FMA over the
    /// cells in order, then store the rows whose bit is set in `store`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn v_block<const N: usize>(
        acc: *mut f32,
        d: usize,
        hd: usize,
        vf: &[f32],
        w: *const f32,
        nc: usize,
        scale_by: [f32; 4],
        store: u8,
    ) {
        let mut a: [[__m256; N]; 4] = std::array::from_fn(|j| {
            let m = _mm256_set1_ps(scale_by[j]);
            std::array::from_fn(|i| _mm256_mul_ps(_mm256_loadu_ps(acc.add(j * hd + d + i * L)), m))
        });
        let vp = vf.as_ptr().add(d);
        for t in 0..nc {
            let v: [__m256; N] = std::array::from_fn(|i| _mm256_loadu_ps(vp.add(t * hd + i * L)));
            for (j, aj) in a.iter_mut().enumerate() {
                let wt = _mm256_set1_ps(*w.add(t * TILE_Q + j));
                for i in 0..N {
                    aj[i] = _mm256_fmadd_ps(wt, v[i], aj[i]);
                }
            }
        }
        if nc < TILE_KV {
            for aj in a.iter_mut() {
                for x in aj.iter_mut() {
                    *x = _mm256_add_ps(*x, _mm256_setzero_ps());
                }
            }
        }
        for (j, aj) in a.iter().enumerate() {
            if store >> j & 1 == 1 {
                for (i, x) in aj.iter().enumerate() {
                    _mm256_storeu_ps(acc.add(j * hd + d + i * L), *x);
                }
            }
        }
    }

    /// The one-chunk kernel: Q rounded to F16, `ggml_vec_dot_f16` scores (16-lane accumulators
    /// as register pairs), online softmax with libm `expf`, and an accumulator rounded to F16
    /// after every update. `hd` is a multiple of 16.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn one_chunk(
        order: Order,
        view: &View,
        kvh: usize,
        q: &[f32],
        q_pos: i32,
        scale: f32,
        range: std::ops::Range<usize>,
    ) -> (f32, f32, Vec<f32>) {
        let hd = view.head_dim;
        let nv = hd / L;
        // Accumulator width `w`: 16 lanes (a register pair) in the AVX512 order, 8 in the AVX2 one.
        let w = order.lanes();
        let body = hd - hd % (4 * w);
        let qf: Vec<__m256> = (0..nv)
            .map(|i| round_f16(_mm256_loadu_ps(q.as_ptr().add(i * L))))
            .collect();
        let mut acc = vec![_mm256_setzero_ps(); nv];
        let mut s_sum = 0f32;
        let mut m = f32::NEG_INFINITY;
        let mut kt = vec![0f32; hd];
        for c in range {
            if !view.visible(c, q_pos) {
                continue;
            }
            let base = c * view.row + kvh * hd;
            // ggml_vec_dot_f16: four `w`-lane accumulators over `4w`-value steps, the tail in f64.
            let mut a4 = [[_mm256_setzero_ps(); 2]; 4];
            let mut i = 0;
            while i < body {
                for (j, a) in a4.iter_mut().enumerate() {
                    for (h, ah) in a[..w / L].iter_mut().enumerate() {
                        let o = i + j * w + h * L;
                        let k = load8(view.k, view.dtype, base + o, true);
                        *ah = _mm256_fmadd_ps(k, qf[o / L], *ah);
                    }
                }
                i += 4 * w;
            }
            let s16: [__m256; 2] = std::array::from_fn(|h| {
                _mm256_add_ps(
                    _mm256_add_ps(a4[0][h], a4[2][h]),
                    _mm256_add_ps(a4[1][h], a4[3][h]),
                )
            });
            let mut sum = f64::from(match order {
                Order::GgmlAvx512 => reduce_add_16(s16[0], s16[1]),
                Order::GgmlAvx2 => reduce_hadd_8(s16[0]),
            });
            if body < hd {
                for o in (body..hd).step_by(L) {
                    let k = load8(view.k, view.dtype, base + o, true);
                    _mm256_storeu_ps(kt.as_mut_ptr().add(o), _mm256_mul_ps(k, qf[o / L]));
                }
                for &p in &kt[body..hd] {
                    sum += f64::from(p);
                }
            }
            let s = sum as f32 * scale;
            let m_old = m;
            let mut ms = 1f32;
            let mut vs = 1f32;
            if s > m {
                m = s;
                ms = (m_old - m).exp();
                let v = _mm256_set1_ps(ms);
                for a in acc.iter_mut() {
                    *a = round_f16(_mm256_mul_ps(*a, v));
                }
            } else {
                vs = (s - m).exp();
            }
            let vv = _mm256_set1_ps(vs);
            for (i, a) in acc.iter_mut().enumerate() {
                let x = load8(view.v, view.dtype, base + i * L, true);
                *a = round_f16(_mm256_fmadd_ps(x, vv, *a));
            }
            s_sum = s_sum.mul_add(ms, vs);
        }
        let mut out = vec![0f32; hd];
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(i * L), *a);
        }
        (m, s_sum, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn f(&mut self, scale: f32) -> f32 {
            ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        }
    }

    /// The SIMD kernels (`attend_rows`) against the scalar models (`attend_head`), bit for bit,
    /// over cache types, head sizes, windows, ring-ordered cells with holes, and every kernel.
    #[test]
    fn simd_kernels_equal_the_scalar_models() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for &dtype in &[KvType::F16, KvType::F32] {
            for &(hd, n_head_kv) in &[(32usize, 2usize), (64, 1), (128, 2)] {
                for &n_swa in &[0u32, 40] {
                    for &(n_kv, nq) in &[
                        (1usize, 1usize),
                        (70, 1),
                        (600, 1),
                        (150, 3),
                        (130, 64),
                        (200, 100),
                        (64, 130),
                    ] {
                        let row = n_head_kv * hd;
                        let mut k = vec![0u8; n_kv * row * dtype.size()];
                        let mut v = vec![0u8; n_kv * row * dtype.size()];
                        let vals: Vec<f32> = (0..n_kv * row).map(|_| rng.f(2.0)).collect();
                        store(&mut k, dtype, 0, &vals);
                        let vals: Vec<f32> = (0..n_kv * row).map(|_| rng.f(3.0)).collect();
                        store(&mut v, dtype, 0, &vals);
                        // Positions: a rotated ring with a few empty cells.
                        let base = 1000;
                        let rot = n_kv / 3;
                        let cell_pos: Vec<i32> = (0..n_kv)
                            .map(|c| {
                                if c % 17 == 5 {
                                    -1
                                } else {
                                    (base + (c + rot) % n_kv) as i32
                                }
                            })
                            .collect();
                        let view = View {
                            k: &k,
                            v: &v,
                            cell_pos: &cell_pos,
                            dtype,
                            row,
                            head_dim: hd,
                            n_swa,
                        };
                        let q: Vec<f32> = (0..nq * hd).map(|_| rng.f(4.0)).collect();
                        let last = (base + n_kv) as i32 - 1;
                        let rows: Vec<(&[f32], i32)> = (0..nq)
                            .map(|r| (&q[r * hd..(r + 1) * hd], last - (nq - 1 - r) as i32))
                            .collect();
                        let kernels = [
                            Kernel::Tiled,
                            Kernel::OneChunk,
                            Kernel::SplitKv { parts: 2 },
                            Kernel::SplitKv { parts: 3 },
                        ];
                        let cases = Order::ALL.into_iter().flat_map(|o| kernels.map(|k| (o, k)));
                        for (order, kernel) in cases {
                            for kvh in 0..n_head_kv {
                                let mut want = vec![0f32; nq * hd];
                                {
                                    let mut outs: Vec<&mut [f32]> = want.chunks_mut(hd).collect();
                                    attend_head(
                                        order, &view, kernel, n_kv, kvh, 0.125, &rows, &mut outs,
                                    );
                                }
                                // AVX2 runs on AVX512 hosts too; a missing family falls back
                                for isa in [muser_quant::Isa::Avx2, muser_quant::Isa::Avx512] {
                                    let mut got = vec![f32::NAN; nq * hd];
                                    attend_rows_isa(
                                        isa,
                                        order,
                                        &view,
                                        kernel,
                                        n_kv,
                                        kvh,
                                        0.125,
                                        &rows,
                                        &mut |r, o| got[r * hd..(r + 1) * hd].copy_from_slice(o),
                                    );
                                    let same = want
                                        .iter()
                                        .zip(&got)
                                        .all(|(a, b)| a.to_bits() == b.to_bits());
                                    assert!(same, "{dtype:?} hd={hd} n_swa={n_swa} n_kv={n_kv} nq={nq} {order:?} {kernel:?} {isa:?}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
