//! Every request body type of the server (`muser_fuzz_targets::targets::json_request`).
//!
//!     cargo +nightly fuzz run json_request fuzz/seeds/json_request -- -max_total_time=300 -rss_limit_mb=512

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| muser_fuzz_targets::targets::json_request(data));
