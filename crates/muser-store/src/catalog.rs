//! The store's contents: list them, remove one, resolve a bare name given to `muser up -m`.

use crate::{check_name, io_err, sidecar, stamped_digest, StoreError};
use std::fs;
use std::path::{Path, PathBuf};

/// One model file in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub size_bytes: u64,
    /// The digest of a stamp that still matches the file; `None`: not verified since it changed.
    pub sha256_hex: Option<String>,
    /// Where it came from (a URL or a PyPI requirement), when recorded.
    pub source: Option<String>,
}

/// The model files in `dir`, by name (none when the store does not exist yet).
pub fn list(dir: &Path) -> Result<Vec<Entry>, StoreError> {
    let read = match fs::read_dir(dir) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(dir)(e)),
    };
    let mut entries = Vec::new();
    for item in read {
        let item = item.map_err(io_err(dir))?;
        let name = item.file_name().to_string_lossy().into_owned();
        let meta = item.metadata().map_err(io_err(&item.path()))?;
        if name.starts_with('.') || !meta.is_file() {
            continue;
        }
        let path = item.path();
        entries.push(Entry {
            sha256_hex: stamped_digest(&path)?,
            source: fs::read_to_string(sidecar(&path, "source"))
                .ok()
                .map(|s| s.trim().to_owned()),
            size_bytes: meta.len(),
            name,
        });
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(entries)
}

/// Removes model `name` from `dir` with its stamp, source record and any unfinished pull.
pub fn remove(dir: &Path, name: &str) -> Result<(), StoreError> {
    check_name(name)?;
    let path = dir.join(name);
    if !path.is_file() {
        return Err(StoreError::NotFound {
            name: name.into(),
            dir: dir.into(),
        });
    }
    fs::remove_file(&path).map_err(io_err(&path))?;
    for kind in ["verified", "source", "part", "pull"] {
        let _ = fs::remove_file(sidecar(&path, kind));
    }
    Ok(())
}

/// What `muser up -m ARG` loads: ARG itself when it exists (a path, as before), else the store's
/// model of that name; an error names both places.
pub fn resolve(arg: &Path, dir: &Path) -> Result<PathBuf, StoreError> {
    if arg.exists() {
        return Ok(arg.into());
    }
    let name = arg.to_string_lossy();
    if check_name(&name).is_ok() && dir.join(arg).is_file() {
        return Ok(dir.join(arg));
    }
    Err(StoreError::NoModel {
        arg: arg.into(),
        dir: dir.into(),
    })
}
