//! Dot-product and dequantization throughput per format, scalar vs the best SIMD kernel.
//!
//! `cargo bench -p muser-quant --bench kernels` prints criterion's report, then a table, and
//! writes the receipt `docs/receipts/quant-kernels.json` (command, commit, machine, numbers;
//! `quant-kernels-avx2.json` with `MUSER_ISA=avx2`).
//! `scripts/quant-bench.sh` runs it beside ggml's own kernels and adds their times and the
//! ratio. Rates are from the fastest criterion sample (the machine is shared).
//! The weight matrix (64 rows × 4096 values) stays in L2, so these are compute rates of the
//! kernels, the ceiling for prefill; decode is bound by memory bandwidth instead.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{Criterion, Throughput};
use muser_quant::{
    dequantize_row, detected_isa, quantize_activations, quantize_row, vec_dot_isa, vec_dot_type,
    GgmlType, Isa,
};

const N: usize = 4096;
const ROWS: usize = 64;

const TYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
];

fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// A weight matrix of `ty`: quantized floats, or (Q2_K, Q3_K: no quantizer here) bytes with
/// small finite scales.
fn weights(ty: GgmlType) -> Vec<u8> {
    let bytes = N * ROWS / ty.block_size() * ty.type_size();
    let x = pseudo_random(N * ROWS, 7);
    let mut w = vec![0u8; bytes];
    if quantize_row(ty, &x, &mut w).is_err() {
        w = pseudo_random(bytes, 9)
            .iter()
            .map(|v| (v.to_bits() >> 8) as u8)
            .collect();
        let d_at: &[usize] = if ty == GgmlType::Q2_K {
            &[80, 82]
        } else {
            &[108]
        };
        for b in w.chunks_exact_mut(ty.type_size()) {
            for &at in d_at {
                b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            }
        }
    }
    w
}

/// CPU time of the calling thread: on a shared machine, time spent descheduled does not count
/// (wall time there measures the neighbours). `scripts/quant/bench_ggml.c` uses the same clock.
struct ThreadCpuTime;

fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

impl Measurement for ThreadCpuTime {
    type Intermediate = u64;
    type Value = u64;
    fn start(&self) -> u64 {
        thread_cpu_ns()
    }
    fn end(&self, start: u64) -> u64 {
        thread_cpu_ns() - start
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, v: &u64) -> f64 {
        *v as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        static WALL: WallTime = WallTime;
        WALL.formatter()
    }
}

fn main() {
    let mut c = Criterion::default()
        .with_measurement(ThreadCpuTime)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(800))
        .sample_size(20)
        .configure_from_args();
    let simd = detected_isa();
    for ty in TYPES {
        let w = weights(ty);
        let vt = vec_dot_type(ty);
        let mut a = vec![0u8; N / vt.block_size() * vt.type_size()];
        quantize_activations(vt, &pseudo_random(N, 3), &mut a).unwrap();
        let row = N / ty.block_size() * ty.type_size();
        let mut g = c.benchmark_group(format!("dot_{}", ty.name()));
        g.throughput(Throughput::Elements((N * ROWS) as u64));
        for (id, isa) in [("scalar", Isa::Scalar), ("simd", simd)] {
            g.bench_function(id, |b| {
                b.iter(|| {
                    let mut s = 0.0f32;
                    for r in w.chunks_exact(row) {
                        s += vec_dot_isa(isa, ty, N, black_box(r), black_box(&a));
                    }
                    s
                })
            });
        }
        g.finish();
        let mut g = c.benchmark_group(format!("dequant_{}", ty.name()));
        g.throughput(Throughput::Elements((N * ROWS) as u64));
        let mut out = vec![0f32; N * ROWS];
        g.bench_function("scalar", |b| {
            b.iter(|| dequantize_row(ty, black_box(&w), &mut out).unwrap())
        });
        g.finish();
    }
    c.final_summary();
    if let Err(e) = write_receipt(simd) {
        eprintln!("no receipt written: {e}");
    }
}

/// The fastest criterion sample for one benchmark, in ns per iteration (from `sample.json`;
/// the minimum is robust on a busy machine, where the mean is not).
fn best_ns(criterion_dir: &Path, group: &str, id: &str) -> Option<f64> {
    let text =
        std::fs::read_to_string(criterion_dir.join(group).join(id).join("new/sample.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let (iters, times) = (v["iters"].as_array()?, v["times"].as_array()?);
    iters
        .iter()
        .zip(times)
        .filter_map(|(i, t)| Some(t.as_f64()? / i.as_f64()?))
        .reduce(f64::min)
}

/// ggml's kernel timings from `scripts/quant-bench.sh` (type name -> ns per pass), if given.
fn ggml_timings() -> Option<serde_json::Value> {
    let path = std::env::var("MUSER_GGML_KERNELS").ok()?;
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

fn write_receipt(simd: Isa) -> Result<(), String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    let crit = target.join("criterion");
    let ggml = ggml_timings();
    let gval = |ns: f64| (N * ROWS) as f64 / ns;
    let mut rows = Vec::new();
    println!("\n| type | dot scalar | dot SIMD | ggml | SIMD/scalar | ggml time / muser time | dequant |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for ty in TYPES {
        let g = format!("dot_{}", ty.name());
        let (Some(s), Some(v)) = (best_ns(&crit, &g, "scalar"), best_ns(&crit, &g, "simd")) else {
            continue;
        };
        let d = best_ns(&crit, &format!("dequant_{}", ty.name()), "scalar").unwrap_or(f64::NAN);
        let gg = ggml
            .as_ref()
            .and_then(|j| j[ty.name()].as_f64())
            .unwrap_or(f64::NAN);
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.1}x | {:.2} | {:.2} |",
            ty.name(),
            gval(s),
            gval(v),
            gval(gg),
            s / v,
            gg / v,
            gval(d)
        );
        rows.push(serde_json::json!({
            "type": ty.name(), "dot_scalar_ns": s, "dot_simd_ns": v, "dot_ggml_ns": gg, "dequant_ns": d,
            "dot_scalar_gvals": gval(s), "dot_simd_gvals": gval(v), "dot_ggml_gvals": gval(gg),
            "simd_over_scalar": s / v, "ggml_time_over_muser_time": gg / v, "dequant_gvals": gval(d),
        }));
    }
    if rows.is_empty() {
        return Err("no criterion samples found (run without a filter)".into());
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(&root)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| {
        t.lines()
            .find(|l| l.starts_with("model name"))
            .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
    });
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.trim().to_string());
    let receipt = serde_json::json!({
        "command": if ggml.is_some() { "scripts/quant-bench.sh" } else { "cargo bench -p muser-quant --bench kernels" },
        "commit": commit,
        "machine": cpu,
        "loadavg_at_end": load,
        "simd": format!("{simd:?}"),
        "unit": "ns per pass: one activation row of row_values against rows weight rows (fastest sample); gvals = 1e9 values/s",
        "row_values": N,
        "rows": ROWS,
        "results": rows,
    });
    // MUSER_RECEIPT_DIR: where to write when the bench binary runs away from its checkout
    let dir = std::env::var("MUSER_RECEIPT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("docs/receipts"));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(&receipt).map_err(|e| e.to_string())?;
    // one receipt per kernel family: `MUSER_ISA=avx2` (scripts/quant-bench.sh with
    // QUANT_ISA=avx2) writes quant-kernels-avx2.json beside the native one
    let name = match simd {
        Isa::Avx512 => "quant-kernels.json".to_string(),
        other => format!("quant-kernels-{}.json", other.name()),
    };
    std::fs::write(dir.join(name), text + "\n").map_err(|e| e.to_string())
}
