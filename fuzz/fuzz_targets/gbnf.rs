//! GBNF grammars compiled and run (`muser_fuzz_targets::targets::gbnf`).
//!
//!     cargo +nightly fuzz run gbnf fuzz/seeds/gbnf -- -max_total_time=300 -rss_limit_mb=512

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| muser_fuzz_targets::targets::gbnf(data));
