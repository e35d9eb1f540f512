//! Shared by the integration tests: where the test models are.

use std::path::PathBuf;

/// SmolLM2-135M-Instruct Q4_1 in `$MUSER_MODELS` (default `~/.cache/muser/models`); a missing
/// model fails the test with the command that fetches it.
pub fn smollm2_path() -> PathBuf {
    let dir = std::env::var_os("MUSER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/muser/models")
        });
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "missing test model {} (run scripts/fetch-models.sh)",
        path.display()
    );
    path
}
