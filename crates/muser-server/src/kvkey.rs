//! The server's operator key: read from `--kv-key-file`, or generated on first use and kept
//! (mode 0600) as `kv.key` in the model store. kvpack's keys and the session bundle key are
//! derived from it, each under its own context string.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Where a generated key is kept.
pub fn default_key_path() -> Result<PathBuf, String> {
    muser_store::default_store_dir()
        .map(|d| d.join("kv.key"))
        .map_err(|e| e.to_string())
}

/// The operator key from `file`, or from the default key file, generating it when absent.
pub fn load_or_create(file: Option<&Path>) -> Result<[u8; 32], String> {
    let path = match file {
        Some(p) => p.to_path_buf(),
        None => {
            let p = default_key_path()?;
            if !p.exists() {
                create(&p)?;
            }
            p
        }
    };
    let mut bytes = Vec::new();
    std::fs::File::open(&path)
        .and_then(|f| f.take(256).read_to_end(&mut bytes))
        .map_err(|e| format!("kv key file {}: {e}", path.display()))?;
    let key = muser_kvpack::parse_operator_key(&bytes);
    bytes.fill(0);
    key.map_err(|e| format!("kv key file {}: {e}", path.display()))
}

fn create(path: &Path) -> Result<(), String> {
    let err = |e: std::io::Error| format!("creating kv key file {}: {e}", path.display());
    if let Some(dir) = path.parent() {
        muser_store::private_dir(dir).map_err(err)?;
    }
    let mut key = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .map_err(err)?;
    let text: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    match opts.open(path) {
        Ok(mut f) => f
            .write_all(text.as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(err),
        // another process created it first: use theirs
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(err(e)),
    }
}
