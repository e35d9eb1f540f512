//! JSON schemas compiled to grammars and run (`muser_fuzz_targets::targets::grammar`).
//!
//!     cargo +nightly fuzz run grammar fuzz/seeds/grammar -- -max_total_time=300 -rss_limit_mb=512

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| muser_fuzz_targets::targets::grammar(data));
