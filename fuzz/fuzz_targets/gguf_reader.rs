//! Feeds arbitrary bytes to the in-memory GGUF reader. It must return an error or a file whose
//! every accessor works; it must never panic, loop or allocate far beyond the input's size.
//!
//!     cargo +nightly fuzz run gguf_reader fuzz/seeds -- -max_total_time=300 -rss_limit_mb=512

#![no_main]

use libfuzzer_sys::fuzz_target;
use muser_gguf::{report::Report, GgufFile};

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data) else {
        return;
    };
    for (key, _) in file.metadata() {
        let _ = file.get_u32(key);
        let _ = file.get_str(key);
        let _ = file.get_str_array(key);
        let _ = file.get_uint(key);
    }
    for t in file.tensors() {
        assert_eq!(file.tensor_data(t).len(), t.size);
        assert_eq!(file.tensor(&t.name), Some(t));
    }
    let _ = Report::new(&file).to_string();
});
