//! `muser-cuda-bench check`: the kernels on random data against the host (CPU quantizer and
//! f64 sums), each check printing a line and adding a JSON result.

use std::path::PathBuf;

use muser_cuda::layout::MAX_GEMV_BATCH;
use muser_cuda::runtime::{Arg, Gpu};
use muser_cuda::weights::{DevWeight, QAct, QActBufs, WType};
use muser_cuda::CudaError;
use muser_gguf::GgmlType;
use serde_json::{json, Value};

use super::{rel_err, Rng};

fn ggml(ty: WType) -> GgmlType {
    GgmlType::from_id(ty.ggml_id()).expect("known type")
}

fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// One weight type: random matrix quantized by the CPU quantizer, checked through every GPU path.
fn check_type(
    gpu: &Gpu,
    ty: WType,
    rows: usize,
    cols: usize,
    rng: &mut Rng,
    out: &mut Vec<Value>,
) -> Result<bool, CudaError> {
    let gt = ggml(ty);
    let rb = ty.row_bytes(cols);
    let mut wq = vec![0u8; rows * rb];
    let mut wf = vec![0f32; rows * cols];
    let mut src = vec![0f32; cols];
    for r in 0..rows {
        // Rows of different magnitudes, so per-block scales matter.
        let mag = 0.02 * (1.0 + (r % 7) as f32);
        for v in src.iter_mut() {
            *v = rng.normal() * mag;
        }
        muser_quant::quantize_row(gt, &src, &mut wq[r * rb..(r + 1) * rb])
            .map_err(|e| CudaError::Model(format!("quantize {ty:?}: {e}")))?;
        muser_quant::dequantize_row(
            gt,
            &wq[r * rb..(r + 1) * rb],
            &mut wf[r * cols..(r + 1) * cols],
        )
        .map_err(|e| CudaError::Model(format!("dequantize {ty:?}: {e}")))?;
    }
    let w = DevWeight::upload(gpu, ty, cols, &[&wq])?;
    let bmax = MAX_GEMV_BATCH;
    let x: Vec<f32> = (0..bmax * cols).map(|_| rng.normal()).collect();
    let want = |b: usize, r: usize| -> f64 {
        let wr = &wf[r * cols..(r + 1) * cols];
        let xb = &x[b * cols..(b + 1) * cols];
        wr.iter().zip(xb).map(|(a, c)| *a as f64 * *c as f64).sum()
    };
    let xd = gpu.alloc(4 * x.len())?;
    gpu.upload(&xd, 0, &x)?;
    let qbufs = QActBufs::quantize(gpu, xd.ptr(), cols, bmax)?;
    let qa = qbufs.act();
    let y = gpu.alloc(4 * bmax * rows)?;
    let mut ok = true;
    // Each activation row alone (batch 1): the sums every batch size must give, bit for bit.
    let mut single = vec![0f32; bmax * rows];
    for b in 0..bmax {
        let g = cols / 16;
        let qb = QAct {
            q: qa.q + (b * cols) as u64,
            d: qa.d + (4 * b * g) as u64,
            s: qa.s + (4 * b * g) as u64,
        };
        w.gemv(gpu, 1, qb, xd.ptr() + (4 * b * cols) as u64, y.ptr(), rows)?;
        gpu.download(y.ptr(), &mut single[b * rows..(b + 1) * rows])?;
    }
    // Below, at and past the tiled Q4_K kernel's first batch, whole and partial 8-sequence tiles.
    for batch in [1usize, 3, 5, 8, 13, 16, 21, 32, bmax] {
        gpu.memset(y.ptr(), 0xff, 4 * bmax * rows)?; // NaN poison: every output must be written
        w.gemv(gpu, batch, qa, xd.ptr(), y.ptr(), rows)?;
        let mut got = vec![0f32; batch * rows];
        gpu.download(y.ptr(), &mut got)?;
        let differ = got
            .iter()
            .zip(&single)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let pass = differ == 0;
        ok &= pass;
        let first = got
            .iter()
            .zip(&single)
            .position(|(a, b)| a.to_bits() != b.to_bits())
            .map(|i| {
                format!(
                    " (first: sequence {} row {}: {:e}, alone {:e})",
                    i / rows,
                    i % rows,
                    got[i],
                    single[i]
                )
            })
            .unwrap_or_default();
        println!(
            "check gemv   {:<6} B={batch} {rows}x{cols}  {differ} outputs differ from batch 1{first}  {}",
            format!("{ty:?}"),
            if pass { "ok" } else { "FAIL" }
        );
        out.push(json!({"check": "gemv_equals_batch_1", "type": format!("{ty:?}"), "batch": batch, "rows": rows, "cols": cols, "differ": differ, "pass": pass}));
        let reference: Vec<f64> = (0..batch)
            .flat_map(|b| (0..rows).map(move |r| (b, r)))
            .map(|(b, r)| want(b, r))
            .collect();
        let err = rel_err(&got, &reference);
        let pass = err < 1e-2;
        ok &= pass;
        println!(
            "check gemv   {:<6} B={batch} {rows}x{cols}  rel err {err:.2e}  {}",
            format!("{ty:?}"),
            if pass { "ok" } else { "FAIL" }
        );
        out.push(json!({"check": "gemv", "type": format!("{ty:?}"), "batch": batch, "rows": rows, "cols": cols, "rel_err": err, "pass": pass}));
    }
    // bf16 dequantization (prefill operand) against the CPU dequantization.
    let wb = gpu.alloc(2 * rows * cols)?;
    w.dequant_bf16(gpu, wb.ptr())?;
    let mut got = vec![0u16; rows * cols];
    gpu.download(wb.ptr(), &mut got)?;
    let got: Vec<f32> = got.into_iter().map(bf16_to_f32).collect();
    let reference: Vec<f64> = wf.iter().map(|&v| v as f64).collect();
    let err = rel_err(&got, &reference);
    let pass = err < 1e-2;
    ok &= pass;
    println!(
        "check dequant {:<6} -> bf16          rel err {err:.2e}  {}",
        format!("{ty:?}"),
        if pass { "ok" } else { "FAIL" }
    );
    out.push(
        json!({"check": "dequant_bf16", "type": format!("{ty:?}"), "rel_err": err, "pass": pass}),
    );
    // cuBLAS bf16 GEMM: y[n][rows] = x[n][cols] · Wᵀ, n = 8 (x rounded to bf16 on the host).
    let bmax = 8;
    let xb: Vec<u16> = x[..bmax * cols]
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_bits())
        .collect();
    let xbd = gpu.alloc(2 * xb.len())?;
    gpu.upload(&xbd, 0, &xb)?;
    gpu.gemm_bf16(y.ptr(), rows, xbd.ptr(), wb.ptr(), bmax, rows, cols)?;
    let mut got = vec![0f32; bmax * rows];
    gpu.download(y.ptr(), &mut got)?;
    let reference: Vec<f64> = (0..bmax)
        .flat_map(|b| (0..rows).map(move |r| (b, r)))
        .map(|(b, r)| want(b, r))
        .collect();
    let err = rel_err(&got, &reference);
    let pass = err < 1e-2;
    ok &= pass;
    println!(
        "check gemm   {:<6} n=8 (bf16 cuBLAS) rel err {err:.2e}  {}",
        format!("{ty:?}"),
        if pass { "ok" } else { "FAIL" }
    );
    out.push(
        json!({"check": "gemm_bf16", "type": format!("{ty:?}"), "rel_err": err, "pass": pass}),
    );
    // Embedding rows.
    let ids: Vec<i32> = vec![0, (rows - 1) as i32, (rows / 2) as i32];
    let idd = gpu.alloc(4 * ids.len())?;
    gpu.upload(&idd, 0, &ids)?;
    let xr = gpu.alloc(4 * ids.len() * cols)?;
    w.get_rows(gpu, idd.ptr(), ids.len(), xr.ptr())?;
    let mut got = vec![0f32; ids.len() * cols];
    gpu.download(xr.ptr(), &mut got)?;
    let reference: Vec<f64> = ids
        .iter()
        .flat_map(|&r| {
            wf[r as usize * cols..(r as usize + 1) * cols]
                .iter()
                .map(|&v| v as f64)
        })
        .collect();
    let err = rel_err(&got, &reference);
    let pass = err < 1e-6;
    ok &= pass;
    println!(
        "check rows   {:<6}                   rel err {err:.2e}  {}",
        format!("{ty:?}"),
        if pass { "ok" } else { "FAIL" }
    );
    out.push(json!({"check": "get_rows", "type": format!("{ty:?}"), "rel_err": err, "pass": pass}));
    Ok(ok)
}

pub(super) fn cmd_check(json_out: Option<PathBuf>) -> Result<bool, CudaError> {
    let gpu = Gpu::new(0)?;
    println!("device: {:?}", gpu.info());
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut results = Vec::new();
    // What the decode attention kernels and the tiled Q4_K GEMVs cost in registers, spills
    // and shared memory.
    let loaded = muser_cuda::layout::kernel_names();
    for name in loaded.iter().filter(|n| {
        n.starts_with("gemv_q4k_tile_")
            || n.starts_with("attn_decode_")
            || *n == "attn_prefill_flash"
    }) {
        let (regs, local, smem) = gpu.kernel_resources(name)?;
        println!("{name}: {regs} registers, {local} bytes spilled, {smem} bytes static shared");
        results.push(json!({"kernel": name, "registers": regs, "local_bytes": local, "static_shared_bytes": smem}));
    }
    let mut ok = true;
    for ty in [
        WType::Q4K,
        WType::Q6K,
        WType::Q8_0,
        WType::NvFp4,
        WType::F16,
    ] {
        // 6656 columns: 26 Q4_K super-blocks, an odd tail for the unrolled loops.
        ok &= check_type(&gpu, ty, 300, 6656, &mut rng, &mut results)?;
    }
    // 19968 columns (muse-glimmer's ffn_down): Q4_K rows split over four warps, NVFP4 rows
    // over three passes of the unrolled loads.
    ok &= check_type(&gpu, WType::Q4K, 301, 19968, &mut rng, &mut results)?;
    ok &= check_type(&gpu, WType::NvFp4, 301, 19968, &mut rng, &mut results)?;
    // The tiled kernel's other splits and edges: 30 super-blocks over two warps, and 2 over one
    // (warps with no super-block), 37 rows (a partial 32-row tile).
    ok &= check_type(&gpu, WType::Q4K, 300, 7680, &mut rng, &mut results)?;
    ok &= check_type(&gpu, WType::Q4K, 37, 512, &mut rng, &mut results)?;
    // The batched Q4_K kernels the tiled ones replace from batch 8, at every batch (`tile=65`),
    // on rows split over one and four warps.
    let base = gpu.overrides();
    println!("Q4_K GEMVs with tile=65:");
    gpu.set_overrides(base.parse("tile=65")?);
    ok &= check_type(&gpu, WType::Q4K, 300, 4096, &mut rng, &mut results)?;
    ok &= check_type(&gpu, WType::Q4K, 301, 19968, &mut rng, &mut results)?;
    gpu.set_overrides(base);
    ok &= check_swiglu_norm(&gpu, &mut rng, &mut results)?;
    ok &= check_argmax(&gpu, &mut rng, &mut results)?;
    ok &= check_sampling(&gpu, &mut rng, &mut results)?;
    if let Some(p) = json_out {
        let doc = json!({"kind": "cuda-kernel-checks", "device": gpu.info().name, "all_pass": ok, "results": results});
        std::fs::write(p, serde_json::to_string_pretty(&doc).unwrap_or_default())?;
    }
    println!("checks: {}", if ok { "all passed" } else { "FAILURES" });
    Ok(ok)
}

/// 16 activations quantized as kernels.cu's `quant16` does it (f32: scale max|v| / 127, values
/// rounded half to even, the scale times the integer sum): the host's statement of what every
/// activation-quantizing kernel must write, whatever lanes share a group.
fn quant16_host(v: &[f32]) -> ([i8; 16], f32, f32) {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i8; 16];
    let mut sum = 0i32;
    for (k, x) in v.iter().enumerate() {
        let qi = (x * id).round_ties_even() as i32;
        sum += qi;
        q[k] = qi as i8;
    }
    (q, d, d * sum as f32)
}

/// Device buffers for `n` quantized activations (int8 values, and a scale and scale * sum per
/// 16), as a kernel under check writes them.
struct QuantOut {
    q: muser_cuda::runtime::DevBuf,
    qd: muser_cuda::runtime::DevBuf,
    qs: muser_cuda::runtime::DevBuf,
    n: usize,
}

impl QuantOut {
    fn new(gpu: &Gpu, n: usize) -> Result<QuantOut, CudaError> {
        Ok(QuantOut {
            q: gpu.alloc(n)?,
            qd: gpu.alloc(4 * n / 16)?,
            qs: gpu.alloc(4 * n / 16)?,
            n,
        })
    }

    /// The 16-value groups whose bytes or scales on the device are not exactly `quant16_host`
    /// of the values `v` the same kernel wrote.
    fn mismatches(&self, gpu: &Gpu, v: &[f32]) -> Result<usize, CudaError> {
        let mut q = vec![0i8; self.n];
        let (mut qd, mut qs) = (vec![0f32; self.n / 16], vec![0f32; self.n / 16]);
        gpu.download(self.q.ptr(), &mut q)?;
        gpu.download(self.qd.ptr(), &mut qd)?;
        gpu.download(self.qs.ptr(), &mut qs)?;
        Ok((0..self.n / 16)
            .filter(|&g| {
                let (hq, hd, hs) = quant16_host(&v[16 * g..16 * g + 16]);
                hq[..] != q[16 * g..16 * g + 16]
                    || hd.to_bits() != qd[g].to_bits()
                    || hs.to_bits() != qs[g].to_bits()
            })
            .count())
    }
}

/// The decode step's small kernels on random rows against the host: `swiglu` (values against
/// f64 silu(gate) * up, both gate/up layouts) and `norm_fused8` / `norm_fused` (post-norm and
/// residual, then the norm, in eight slices writing the residual elsewhere, as decode runs
/// them; against f64). Each kernel's quantized activations must be exactly what `quant16`
/// makes of the values it wrote (bytes and scales bit for bit), whatever lanes share a group.
fn check_swiglu_norm(
    gpu: &Gpu,
    rng: &mut Rng,
    results: &mut Vec<Value>,
) -> Result<bool, CudaError> {
    let mut ok = true;
    let (f, t) = (19968usize, 3usize);
    for il in [0, 1] {
        let gu: Vec<f32> = (0..t * 2 * f).map(|_| 3.0 * rng.normal()).collect();
        let dgu = gpu.alloc(4 * gu.len())?;
        gpu.upload(&dgu, 0, &gu)?;
        let (dout, qo) = (gpu.alloc(4 * t * f)?, QuantOut::new(gpu, t * f)?);
        gpu.launch(
            "swiglu",
            ((t * f / 4).div_ceil(64) as u32, 1, 1),
            64,
            &[
                Arg::P(dgu.ptr()),
                Arg::L(f as i64),
                Arg::L(t as i64),
                Arg::P(dout.ptr()),
                Arg::P(0),
                Arg::P(qo.q.ptr()),
                Arg::P(qo.qd.ptr()),
                Arg::P(qo.qs.ptr()),
                Arg::I(il),
            ],
        )?;
        let mut out = vec![0f32; t * f];
        gpu.download(dout.ptr(), &mut out)?;
        let want: Vec<f64> = (0..t * f)
            .map(|i| {
                let (r, c) = (i / f, i % f);
                let (gi, ui) = if il == 1 {
                    let (g, k) = (c / 16, c % 16);
                    (r * 2 * f + 32 * g + k, r * 2 * f + 32 * g + 16 + k)
                } else {
                    (r * 2 * f + c, r * 2 * f + f + c)
                };
                let (a, u) = (gu[gi] as f64, gu[ui] as f64);
                a / (1.0 + (-a).exp()) * u
            })
            .collect();
        let err = rel_err(&out, &want);
        let bad = qo.mismatches(gpu, &out)?;
        let pass = err < 1e-5 && bad == 0;
        println!(
            "swiglu (interleaved {il}): rel err {err:.2e}, quantized groups unlike quant16: {bad} of {} {}",
            t * f / 16,
            if pass { "ok" } else { "FAIL" }
        );
        results.push(json!({"check": "swiglu", "interleaved": il, "rel_err": err, "quant_mismatch_groups": bad, "pass": pass}));
        ok &= pass;
    }
    let (n, rows, slices) = (6656usize, 2usize, 8u32);
    for (kernel, vpt) in [("norm_fused8", 8usize), ("norm_fused", 16)] {
        let x: Vec<f32> = (0..rows * n).map(|_| rng.normal()).collect();
        let y: Vec<f32> = (0..rows * n).map(|_| 20.0 * rng.normal()).collect();
        let wp: Vec<f32> = (0..n).map(|_| 1.0 + 0.3 * rng.normal()).collect();
        let w: Vec<f32> = (0..n).map(|_| 1.0 + 0.3 * rng.normal()).collect();
        let (eps_post, eps) = (1e-8f32, 1e-6f32);
        let [dx, dy, dwp, dw, dxo, dout] = [0; 6].map(|_| gpu.alloc(4 * rows * n));
        let (dx, dy, dwp, dw, dxo, dout) = (dx?, dy?, dwp?, dw?, dxo?, dout?);
        let qo = QuantOut::new(gpu, rows * n)?;
        gpu.upload(&dx, 0, &x)?;
        gpu.upload(&dy, 0, &y)?;
        gpu.upload(&dwp, 0, &wp)?;
        gpu.upload(&dw, 0, &w)?;
        gpu.launch(
            kernel,
            (rows as u32, slices, 1),
            (n / vpt).next_multiple_of(32) as u32,
            &[
                Arg::P(dx.ptr()),
                Arg::P(dy.ptr()),
                Arg::P(dwp.ptr()),
                Arg::F(eps_post),
                Arg::P(dw.ptr()),
                Arg::F(eps),
                Arg::L(n as i64),
                Arg::P(dout.ptr()),
                Arg::P(0),
                Arg::P(qo.q.ptr()),
                Arg::P(qo.qd.ptr()),
                Arg::P(qo.qs.ptr()),
                Arg::P(dxo.ptr()),
            ],
        )?;
        let mut out = vec![0f32; rows * n];
        let mut xo = vec![0f32; rows * n];
        gpu.download(dout.ptr(), &mut out)?;
        gpu.download(dxo.ptr(), &mut xo)?;
        let (mut want_x, mut want) = (vec![0f64; rows * n], vec![0f64; rows * n]);
        for r in 0..rows {
            let row = |v: &[f32]| {
                v[r * n..(r + 1) * n]
                    .iter()
                    .map(|&a| a as f64)
                    .collect::<Vec<_>>()
            };
            let (xr, yr) = (row(&x), row(&y));
            let rms = |v: &[f64], e: f32| {
                1.0 / (v.iter().map(|a| a * a).sum::<f64>() / n as f64 + e as f64).sqrt()
            };
            let sy = rms(&yr, eps_post);
            let x2: Vec<f64> = (0..n).map(|i| xr[i] + yr[i] * sy * wp[i] as f64).collect();
            let sx = rms(&x2, eps);
            for i in 0..n {
                want_x[r * n + i] = x2[i];
                want[r * n + i] = x2[i] * sx * w[i] as f64;
            }
        }
        let (err_x, err) = (rel_err(&xo, &want_x), rel_err(&out, &want));
        let bad = qo.mismatches(gpu, &out)?;
        let pass = err_x < 1e-5 && err < 1e-5 && bad == 0;
        println!(
            "{kernel} ({rows} rows of {n}, {slices} slices): residual rel err {err_x:.2e}, norm rel err {err:.2e}, quantized groups unlike quant16: {bad} of {} {}",
            rows * n / 16,
            if pass { "ok" } else { "FAIL" }
        );
        results.push(json!({"check": kernel, "residual_rel_err": err_x, "rel_err": err, "quant_mismatch_groups": bad, "pass": pass}));
        ok &= pass;
    }
    Ok(ok)
}

/// `logits_argmax` over rows split into 1, 7 or 128 blocks: each row's maximum is planted at
/// two indices in different blocks (and, in one row, two in the same block), so the lowest index
/// must win across the partials; the token must equal the host's argmax of the scaled and
/// capped row, the position advance and the history record it, and a second launch on the
/// same buffers (its arrival counters put back by the first) must give the same tokens.
fn check_argmax(gpu: &Gpu, rng: &mut Rng, results: &mut Vec<Value>) -> Result<bool, CudaError> {
    let mut ok = true;
    let (v, nb, hist_len) = (202_048usize, 4usize, 64usize);
    let (scale, cap) = (0.2f32, 20.0f32);
    for blocks in [1usize, 7, 128] {
        let chunk = v.div_ceil(blocks);
        let mut logits: Vec<f32> = (0..nb * v).map(|_| 3.0 * rng.normal()).collect();
        let mut planted = Vec::new();
        for b in 0..nb {
            let (i, j) = match b {
                0 => (v - 1, v - 2),
                1 => ((2 * chunk + 1).min(v - 1), 3),
                2 => (chunk.min(v - 1), (chunk + 3).min(v - 1)),
                _ => ((rng.next() as usize) % v, (rng.next() as usize) % v),
            };
            logits[b * v + i] = 40.0;
            logits[b * v + j] = 40.0;
            planted.push(i.min(j));
        }
        let pos: Vec<i32> = (0..nb as i32).map(|b| 3 + 5 * b).collect();
        let dl = gpu.alloc(4 * logits.len())?;
        let (dt, dpos) = (gpu.alloc(4 * nb)?, gpu.alloc(4 * nb)?);
        let dh = gpu.alloc_zeroed(4 * nb * hist_len)?;
        let dpart = gpu.alloc(8 * nb * blocks)?;
        let dcnt = gpu.alloc_zeroed(4 * nb)?;
        let mut toks_runs = Vec::new();
        let mut scaled = vec![0f32; nb * v];
        let mut pos2 = vec![0i32; nb];
        let mut hist = vec![0i32; nb * hist_len];
        for run in 0..2 {
            gpu.upload(&dl, 0, &logits)?;
            gpu.upload(&dpos, 0, &pos)?;
            gpu.launch(
                "logits_argmax",
                (blocks as u32, nb as u32, 1),
                if blocks == 1 { 1024 } else { 256 },
                &[
                    Arg::P(dl.ptr()),
                    Arg::L(v as i64),
                    Arg::F(scale),
                    Arg::F(cap),
                    Arg::P(dt.ptr()),
                    Arg::P(dpos.ptr()),
                    Arg::P(dh.ptr()),
                    Arg::I(hist_len as i32),
                    Arg::I(1),
                    Arg::P(dpart.ptr()),
                    Arg::P(dpart.at(4 * nb * blocks)),
                    Arg::P(dcnt.ptr()),
                ],
            )?;
            let mut toks = vec![0i32; nb];
            gpu.download(dt.ptr(), &mut toks)?;
            if run == 0 {
                gpu.download(dl.ptr(), &mut scaled)?;
                gpu.download(dpos.ptr(), &mut pos2)?;
                gpu.download(dh.ptr(), &mut hist)?;
            }
            toks_runs.push(toks);
        }
        let mut case_ok = toks_runs[0] == toks_runs[1];
        let mut detail = Vec::new();
        for b in 0..nb {
            let row = &scaled[b * v..(b + 1) * v];
            // The host's argmax of the device's scaled row (lowest index among equal values).
            let argmax = row
                .iter()
                .enumerate()
                .fold((usize::MAX, f32::NEG_INFINITY), |acc, (i, &x)| {
                    if x > acc.1 {
                        (i, x)
                    } else {
                        acc
                    }
                })
                .0;
            let cap_err = logits[b * v..(b + 1) * v]
                .iter()
                .zip(row)
                .map(|(&x, &y)| (cap * (x * scale / cap).tanh() - y).abs())
                .fold(0f32, f32::max);
            let tok = toks_runs[0][b];
            let advanced =
                pos2[b] == pos[b] + 1 && hist.get(b * hist_len + pos2[b] as usize) == Some(&tok);
            let good = tok as usize == argmax && argmax == planted[b] && advanced && cap_err < 1e-4;
            case_ok &= good;
            detail.push(json!({"token": tok, "host_argmax": argmax, "planted": planted[b], "advanced": advanced, "cap_max_abs_err": cap_err}));
        }
        println!(
            "logits_argmax V={v} over {blocks} blocks per row: {}",
            if case_ok { "ok" } else { "FAIL" }
        );
        results.push(json!({"kernel": "logits_argmax", "vocab": v, "blocks": blocks, "pass": case_ok, "same_tokens_second_launch": toks_runs[0] == toks_runs[1], "sequences": detail}));
        ok &= case_ok;
    }
    Ok(ok)
}

/// `logits_sample` on random logits against the host: the kernel's token must be greedy's
/// argmax when greedy, else a kept logit (among the top k) whose span of the index-order
/// cumulative softmax (f64 on the host, over the logits the kernel scaled and capped) holds the
/// draw `sample_uniform(seed, pos)`, up to f32 rounding. Also checks the position advance.
pub(super) fn check_sampling(
    gpu: &Gpu,
    rng: &mut Rng,
    results: &mut Vec<Value>,
) -> Result<bool, CudaError> {
    use muser_cuda::glimmer::{sample_params, sample_uniform, Sampling};
    let cases: [(usize, f32, u32); 7] = [
        (202_048, 0.0, 40),
        (202_048, 0.8, 1),
        (202_048, 0.8, 40),
        (202_048, 1.0, 0),
        (202_048, 0.3, 256),
        (1_000, 1.5, 7),
        (50, 2.0, 50),
    ];
    let mut ok = true;
    for (ci, &(v, temp, top_k)) in cases.iter().enumerate() {
        let nb = 4;
        let hist_len = 64;
        let mut logits = vec![0f32; nb * v];
        for x in logits.iter_mut() {
            *x = 3.0 * rng.normal();
        }
        let samp: Vec<Sampling> = (0..nb)
            .map(|b| Sampling {
                temp,
                top_k,
                seed: rng.next() ^ b as u64,
            })
            .collect();
        let pos: Vec<i32> = (0..nb).map(|b| 5 + 7 * b as i32 + ci as i32).collect();
        let params: Vec<u8> = samp.iter().flat_map(|s| sample_params(Some(*s))).collect();
        let dl = gpu.alloc(4 * logits.len())?;
        let dp = gpu.alloc(params.len())?;
        let dt = gpu.alloc(4 * nb)?;
        let dpos = gpu.alloc(4 * nb)?;
        let dh = gpu.alloc_zeroed(4 * nb * hist_len)?;
        gpu.upload(&dl, 0, &logits)?;
        gpu.upload(&dp, 0, &params)?;
        gpu.upload(&dpos, 0, &pos)?;
        let (scale, cap) = (0.2f32, 20.0f32);
        gpu.launch(
            "logits_sample",
            (nb as u32, 1, 1),
            1024,
            &[
                Arg::P(dl.ptr()),
                Arg::L(v as i64),
                Arg::F(scale),
                Arg::F(cap),
                Arg::P(dp.ptr()),
                Arg::P(dt.ptr()),
                Arg::P(dpos.ptr()),
                Arg::P(dh.ptr()),
                Arg::I(hist_len as i32),
                Arg::I(1),
            ],
        )?;
        let mut scaled = vec![0f32; nb * v];
        let mut toks = vec![0i32; nb];
        let mut pos2 = vec![0i32; nb];
        let mut hist = vec![0i32; nb * hist_len];
        gpu.download(dl.ptr(), &mut scaled)?;
        gpu.download(dt.ptr(), &mut toks)?;
        gpu.download(dpos.ptr(), &mut pos2)?;
        gpu.download(dh.ptr(), &mut hist)?;
        let mut case_ok = true;
        let mut detail = Vec::new();
        for b in 0..nb {
            let row = &scaled[b * v..(b + 1) * v];
            let tok = toks[b];
            let advanced =
                pos2[b] == pos[b] + 1 && hist.get(b * hist_len + pos2[b] as usize) == Some(&tok);
            // Scale and cap as the kernel does them (f32; tanh may differ in the last bit).
            let cap_err = logits[b * v..(b + 1) * v]
                .iter()
                .zip(row)
                .map(|(&x, &y)| {
                    let want = cap * (x * scale / cap).tanh();
                    (want - y).abs()
                })
                .fold(0f32, f32::max);
            let argmax = row
                .iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |acc, (i, &x)| {
                    if x > acc.1 {
                        (i, x)
                    } else {
                        acc
                    }
                })
                .0;
            let good = if temp <= 0.0 || top_k == 1 {
                tok as usize == argmax
            } else {
                let mut sorted = row.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let thr = if top_k == 0 || top_k as usize >= v {
                    f32::NEG_INFINITY
                } else {
                    sorted[top_k as usize - 1]
                };
                let m = sorted[0] as f64;
                let w: Vec<f64> = row
                    .iter()
                    .map(|&x| {
                        if x >= thr {
                            ((x as f64 - m) / temp as f64).exp()
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let total: f64 = w.iter().sum();
                let target = sample_uniform(samp[b].seed, pos[b]) as f64 * total;
                let t = tok as usize;
                let before: f64 = w[..t.min(v)].iter().sum();
                let tol = 2e-5 * total;
                t < v && w[t] > 0.0 && before <= target + tol && before + w[t] >= target - tol
            };
            case_ok &= good && advanced && cap_err < 1e-4;
            detail.push(json!({"token": tok, "argmax": argmax, "good": good, "advanced": advanced, "cap_max_abs_err": cap_err}));
        }
        println!(
            "logits_sample V={v} temp={temp} top_k={top_k}: {}",
            if case_ok { "ok" } else { "FAIL" }
        );
        results.push(json!({"kernel": "logits_sample", "vocab": v, "temp": temp, "top_k": top_k, "pass": case_ok, "sequences": detail}));
        ok &= case_ok;
    }
    Ok(ok)
}
