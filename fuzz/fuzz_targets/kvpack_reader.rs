//! The kvpack reader (`muser_fuzz_targets::targets::kvpack_reader`): an even first byte gives
//! the pack itself, an odd one XORs the rest into a valid sealed pack.
//!
//!     cargo +nightly fuzz run kvpack_reader fuzz/seeds/kvpack_reader -- -max_total_time=300 -rss_limit_mb=512

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| muser_fuzz_targets::targets::kvpack_reader(data));
