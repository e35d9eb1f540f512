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

use super::math::{fma_fn, soft_max_tile, vec_dot, LANES};
use super::numerics::{Numerics, Order};
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
        let mut s = vec_dot(order, k, &qh);
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

/// Attention for all groups of a batch on one layer, in `numerics` (flash attention on: the
/// kernels above; off: [`unfused`]). Called by the CPU backend after K/V are stored. Returns
/// `[tokens × n_head·hd]`.
pub fn run(
    numerics: Numerics,
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
    assert!(q.len() >= n_tokens * qw);
    for (g, idx) in at.groups.iter().enumerate() {
        assert!(idx.1.iter().all(|&t| t < n_tokens));
        views[g].check(n_kvs[g], at.n_head_kv);
    }
    let order = numerics.order;
    if !numerics.flash_attn {
        return unfused::run(order, at, views, n_kvs, q, n_tokens);
    }
    let mut out = vec![0f32; n_tokens * qw];
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

/// The AVX512 kernels (`attention/x86.rs`).
#[cfg(target_arch = "x86_64")]
mod x86;

/// The AVX2 kernels, in either order (`attention/x86_avx2.rs`).
#[cfg(target_arch = "x86_64")]
mod x86_avx2;

/// Flash attention off: llama.cpp's unfused graph (`attention/unfused.rs`).
#[allow(clippy::needless_range_loop)]
mod unfused;

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
