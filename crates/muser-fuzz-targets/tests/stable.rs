//! Every fuzz target on stable Rust: its seeds under `fuzz/seeds/<target>/` replayed, then
//! mutated for `MUSER_FUZZ_SECS` seconds (default 4) each.

use muser_fuzz_targets::{budget, fuzz, seeds, targets};

#[test]
fn gguf_reader() {
    let n = fuzz(&seeds("gguf_reader"), budget(), targets::gguf_reader);
    eprintln!("gguf_reader: {n} inputs");
}

#[test]
fn kvpack_reader() {
    let mut s = seeds("kvpack_reader");
    s.push(targets::kvpack_seed());
    let n = fuzz(&s, budget(), targets::kvpack_reader);
    eprintln!("kvpack_reader: {n} inputs");
}

#[test]
fn json_request() {
    let n = fuzz(&seeds("json_request"), budget(), targets::json_request);
    eprintln!("json_request: {n} inputs");
}

#[test]
fn gbnf() {
    let n = fuzz(&seeds("gbnf"), budget(), targets::gbnf);
    eprintln!("gbnf: {n} inputs");
}

#[test]
fn grammar() {
    let n = fuzz(&seeds("grammar"), budget(), targets::grammar);
    eprintln!("grammar: {n} inputs");
}
