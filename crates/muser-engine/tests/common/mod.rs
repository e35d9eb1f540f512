//! What the engine's integration tests share.

use std::path::PathBuf;

/// SmolLM2-135M-Instruct Q4_1 in `MUSER_MODELS` (default `~/.cache/muser/models`), fetched by
/// scripts/fetch-models.sh.
pub fn smollm_path() -> PathBuf {
    let dir = std::env::var_os("MUSER_MODELS")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/muser/models")))
        .expect("set MUSER_MODELS or HOME");
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "test model {} is missing: run scripts/fetch-models.sh (or set MUSER_MODELS)",
        path.display()
    );
    path
}
