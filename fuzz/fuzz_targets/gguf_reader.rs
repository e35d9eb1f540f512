//! The GGUF reader on arbitrary bytes (`muser_fuzz_targets::targets::gguf_reader`).
//!
//!     cargo +nightly fuzz run gguf_reader fuzz/seeds/gguf_reader -- -max_total_time=300 -rss_limit_mb=512

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| muser_fuzz_targets::targets::gguf_reader(data));
