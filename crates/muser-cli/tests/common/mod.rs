//! Shared by muser-cli's integration tests: the binary under test and the test model.

use std::path::PathBuf;
use std::process::Command;

/// The `muser` binary this test crate was built with.
pub fn muser() -> Command {
    Command::new(env!("CARGO_BIN_EXE_muser"))
}

/// SmolLM2-135M-Instruct Q4_1 in `$MUSER_MODELS` (default `~/.cache/muser/models`); a missing
/// model fails the test with the command that fetches it.
pub fn smollm2() -> PathBuf {
    let dir = std::env::var_os("MUSER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/muser/models")
        });
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "missing {} (run scripts/fetch-models.sh)",
        p.display()
    );
    p
}
