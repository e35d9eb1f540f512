//! Tokenizer throughput, Muser beside llama.cpp b11434's `llama-tokenize` on the same text.
//!
//! `cargo bench -p muser-text --bench tokenize` builds a ~2 MB text from the golden corpus
//! (crates/muser-text/tests/golden/tokenize.json, repeated), tokenizes it with each test model
//! (best of 5 runs), times `llama-tokenize -f FILE --ids` on the same file minus the time it
//! takes on a one-byte file (model loading), checks both produced the same ids, prints a table
//! and writes a JSON receipt to docs/receipts/text-tokenize.json.
//! Env: MUSER_MODELS (model dir), LLAMA_BIN (comparator bin dir; default the comparator cache).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use muser_gguf::GgufFile;
use muser_text::Tokenizer;

const TARGET_BYTES: usize = 2 << 20;
const RUNS: usize = 5;

fn home() -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
}

fn corpus_text(root: &Path) -> String {
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("crates/muser-text/tests/golden/tokenize.json"))
            .expect("golden corpus"),
    )
    .expect("golden JSON");
    let parts: Vec<&str> = g["corpus"]
        .as_array()
        .expect("corpus")
        .iter()
        .filter_map(|s| s.as_str())
        .collect();
    let mut text = String::with_capacity(TARGET_BYTES + 4096);
    while text.len() < TARGET_BYTES {
        for p in &parts {
            text.push_str(p);
            text.push('\n');
        }
    }
    text
}

fn time_llama(bin: &Path, model: &Path, file: &Path) -> Option<(f64, Vec<u32>)> {
    let t = Instant::now();
    let out = Command::new(bin.join("llama-tokenize"))
        .args([
            "-m",
            model.to_str()?,
            "-f",
            file.to_str()?,
            "--ids",
            "--no-escape",
            "--log-disable",
        ])
        .output()
        .ok()?;
    let secs = t.elapsed().as_secs_f64();
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8_lossy(&out.stdout);
    let line = s
        .lines()
        .last()?
        .trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let ids = line
        .split(", ")
        .filter(|x| !x.is_empty())
        .filter_map(|x| x.parse().ok())
        .collect();
    Some((secs, ids))
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let models = std::env::var_os("MUSER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cache/muser/models"));
    let bin = std::env::var_os("LLAMA_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cache/muser/llama.cpp-11434/build-cpu/bin"));
    let text = corpus_text(&root);
    let dir = std::env::temp_dir().join(format!("muser-tokenize-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let big = dir.join("big.txt");
    let tiny = dir.join("tiny.txt");
    std::fs::write(&big, &text).expect("write corpus");
    std::fs::write(&tiny, "x").expect("write tiny");
    let mb = text.len() as f64 / 1e6;

    println!("| model | tokens | Muser MB/s | llama.cpp MB/s | ratio | same ids |");
    println!("|---|---:|---:|---:|---:|---|");
    let mut rows = Vec::new();
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        let path = models.join(file);
        let Ok(gguf) = GgufFile::open(&path) else {
            eprintln!("skipping {file}: not found in {}", models.display());
            continue;
        };
        let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
        let mut best = f64::INFINITY;
        let mut ids = Vec::new();
        for _ in 0..RUNS {
            let t = Instant::now();
            ids = tok.encode(&text, tok.add_bos(), true);
            best = best.min(t.elapsed().as_secs_f64());
        }
        let muser = mb / best;
        let llama = match (
            time_llama(&bin, &path, &tiny),
            time_llama(&bin, &path, &big),
            time_llama(&bin, &path, &big),
        ) {
            (Some((t0, _)), Some((t1, ref_ids)), Some((t2, _))) => {
                Some((mb / (t1.min(t2) - t0).max(1e-6), ref_ids == ids))
            }
            _ => None,
        };
        let (llama_s, ratio_s, same_s) = match llama {
            Some((l, same)) => (
                format!("{l:.2}"),
                format!("{:.2}x", muser / l),
                same.to_string(),
            ),
            None => ("n/a".into(), "n/a".into(), "n/a".into()),
        };
        println!(
            "| {file} | {} | {muser:.2} | {llama_s} | {ratio_s} | {same_s} |",
            ids.len()
        );
        rows.push(serde_json::json!({
            "model": file, "bytes": text.len(), "tokens": ids.len(), "muser_mb_per_s": muser,
            "muser_best_s": best, "llama_cpp_mb_per_s": llama.map(|l| l.0), "same_ids": llama.map(|l| l.1),
        }));
    }
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(&root)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let receipt = serde_json::json!({
        "bench": "tokenizer throughput",
        "command": "cargo bench -p muser-text --bench tokenize",
        "commit": commit,
        "machine": {"cpu": cpu, "threads": 1},
        "comparator": "llama.cpp b11434 llama-tokenize --ids (time on the corpus minus time on a 1-byte file)",
        "corpus": "tests/golden/tokenize.json corpus repeated to >= 2 MiB, special tokens parsed, BOS as the model asks",
        "runs": RUNS,
        "results": rows,
    });
    let out = root.join("docs/receipts/text-tokenize.json");
    std::fs::create_dir_all(out.parent().expect("receipts dir")).expect("receipts dir");
    std::fs::write(
        &out,
        serde_json::to_string_pretty(&receipt).expect("json") + "\n",
    )
    .expect("write receipt");
    println!("receipt: docs/receipts/text-tokenize.json");
    let _ = std::fs::remove_dir_all(&dir);
}
