//! `muser bench` on a tiny synthetic model, as a user runs it: llama-bench's lists (`-p`, `-n`,
//! `-pg`, `-d`, `-t`) give its tests by name with one sample per repetition, and `--batched`
//! gives llama-batched-bench's rows; the receipt holds what standard output printed.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;

#[allow(dead_code)] // smollm2 is not used here
mod common;
use common::muser;

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn tiny(dir: &Path) -> PathBuf {
    let model = dir.join("tiny.gguf");
    let args = ["synth", "--preset", "tiny", "--type", "q8_0", "-o"];
    ok(muser().args(args).arg(&model).output().unwrap());
    model
}

fn bench(model: &Path, args: &[&str]) -> Output {
    muser()
        .arg("bench")
        .arg("-m")
        .arg(model)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn lists_and_depths_give_llama_bench_tests() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let receipt = dir.path().join("r.json");
    let args = [
        "-p",
        "16,8",
        "-n",
        "4",
        "-pg",
        "8,2",
        "-d",
        "0,40",
        "-r",
        "2",
        "-t",
        "1,2",
        "-o",
        "json",
        "--receipt",
    ];
    let out = bench(&model, &[&args[..], &[receipt.to_str().unwrap()]].concat());
    let rows: Vec<Value> = serde_json::from_str(&ok(out)).unwrap();
    let names: Vec<(&str, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["test"].as_str().unwrap(),
                r["n_threads"].as_u64().unwrap(),
            )
        })
        .collect();
    let per_threads = [
        "pp16",
        "pp8",
        "tg4",
        "pp8+tg2",
        "pp16 @ d40",
        "pp8 @ d40",
        "tg4 @ d40",
        "pp8+tg2 @ d40",
    ];
    let want: Vec<(&str, u64)> = [1, 2]
        .iter()
        .flat_map(|&t| per_threads.iter().map(move |&n| (n, t)))
        .collect();
    assert_eq!(names, want);
    for r in &rows {
        assert_eq!(r["samples_ns"].as_array().unwrap().len(), 2, "{r}");
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0, "{r}");
    }
    let d = rows.iter().find(|r| r["test"] == "pp8+tg2 @ d40").unwrap();
    assert_eq!(
        (&d["n_prompt"], &d["n_gen"], &d["n_depth"]),
        (&8.into(), &2.into(), &40.into())
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&receipt).unwrap()).unwrap();
    assert_eq!(r["results"], Value::Array(rows));
    assert_eq!(r["settings"]["threads"], serde_json::json!([1, 2]));
}

#[test]
fn batched_mode_gives_a_row_per_sequence_count() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let args = [
        "--batched",
        "-npp",
        "24",
        "-ntg",
        "3",
        "-npl",
        "1,5",
        "-ub",
        "16",
        "-t",
        "2",
        "-o",
        "jsonl",
    ];
    let out = ok(bench(&model, &args));
    let rows: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    for (r, pl) in rows.iter().zip([1u64, 5]) {
        assert_eq!(r["pl"], pl, "{r}");
        assert_eq!(r["n_kv"], pl * 27, "{r}");
        assert!(r.get("error").is_none(), "{r}");
        for k in ["speed_pp", "speed_tg", "speed"] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{r}");
        }
        let (t_pp, t_tg, t) = (&r["t_pp"], &r["t_tg"], &r["t"]);
        let sum = t_pp.as_f64().unwrap() + t_tg.as_f64().unwrap();
        assert!((t.as_f64().unwrap() - sum).abs() < 1e-9, "{r}");
    }
    // llama-bench's tests and the batched mode do not mix
    let e = bench(&model, &["--batched", "-p", "8"]);
    assert!(!e.status.success());
    let e = bench(&model, &["-npl", "4"]);
    assert!(!e.status.success());
}
