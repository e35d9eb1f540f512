//! `muser pull` over HTTP against a loopback server with Range support that can drop a
//! connection mid-chunk, corrupt a chunk, or fail a chunk every time (an interrupted pull).

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use muser_store::pull::{pull, PullOptions, CONNECTIONS_DEFAULT, MAX_BYTES_DEFAULT};
use muser_store::{catalog, StoreError};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::sync::{Arc, Mutex};

const MIB: usize = 1 << 20;

/// What the server does to the request whose range starts at the given offset.
#[derive(Default)]
struct Faults {
    drop_once_at: Option<u64>,
    corrupt_once_at: Option<u64>,
    fail_always_at: Option<u64>,
}

struct Served {
    data: Vec<u8>,
    faults: Mutex<Faults>,
    /// Range starts of the GETs answered.
    gets: Mutex<Vec<u64>>,
}

async fn model(State(s): State<Arc<Served>>, headers: HeaderMap) -> Response {
    let len = s.data.len() as u64;
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .and_then(|v| v.split_once('-'))
        .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)));
    let Some((start, end)) = range.filter(|&(a, b)| a <= b && b < len) else {
        // HEAD (axum drops the body) and plain GETs: the whole file
        return Response::builder()
            .header(header::ACCEPT_RANGES, "bytes")
            .header(header::CONTENT_LENGTH, len)
            .body(Body::from(s.data.clone()))
            .unwrap();
    };
    s.gets.lock().unwrap().push(start);
    let mut bytes = s.data[start as usize..=end as usize].to_vec();
    let builder = Response::builder()
        .status(StatusCode::PARTIAL_CONTENT)
        .header(header::CONTENT_RANGE, format!("bytes {start}-{end}/{len}"))
        .header(header::CONTENT_LENGTH, bytes.len());
    let mut f = s.faults.lock().unwrap();
    if f.fail_always_at == Some(start) {
        return Response::builder()
            .status(StatusCode::FORBIDDEN)
            .body(Body::empty())
            .unwrap();
    }
    if f.corrupt_once_at == Some(start) {
        f.corrupt_once_at = None;
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x5a;
    }
    if f.drop_once_at == Some(start) {
        f.drop_once_at = None;
        let half = bytes[..bytes.len() / 2].to_vec();
        let pieces: Vec<Result<Vec<u8>, std::io::Error>> =
            vec![Ok(half), Err(std::io::Error::other("dropped mid-chunk"))];
        return builder
            .body(Body::from_stream(futures::stream::iter(pieces)))
            .unwrap();
    }
    builder.body(Body::from(bytes)).unwrap()
}

/// Serves `data` at http://127.0.0.1:PORT/model.gguf from a thread of its own.
fn serve(data: Vec<u8>, faults: Faults) -> (String, Arc<Served>) {
    let served = Arc::new(Served {
        data,
        faults: Mutex::new(faults),
        gets: Mutex::new(Vec::new()),
    });
    let app = axum::Router::new()
        .route("/model.gguf", axum::routing::get(model))
        .with_state(served.clone());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}/model.gguf", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    (url, served)
}

/// 4.5 MiB of deterministic bytes (1 MiB chunks: five of them) and their SHA-256.
fn payload() -> (Vec<u8>, String) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..4 * MIB + MIB / 2)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let sha = hex::encode(Sha256::digest(&data));
    (data, sha)
}

fn opts(sha: &str) -> PullOptions {
    PullOptions {
        name: None,
        sha256_hex: Some(sha.into()),
        max_bytes: MAX_BYTES_DEFAULT,
        connections: CONNECTIONS_DEFAULT,
        progress: false,
    }
}

/// Names in the store directory, sidecars included.
fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| {
            r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn survives_a_dropped_connection_and_a_corrupt_chunk() {
    let (data, sha) = payload();
    let faults = Faults {
        drop_once_at: Some(MIB as u64),
        corrupt_once_at: Some(3 * MIB as u64),
        ..Faults::default()
    };
    let (url, served) = serve(data.clone(), faults);
    let store = tempfile::tempdir().unwrap();
    let got = pull(&url, store.path(), &opts(&sha)).unwrap();
    assert_eq!(got.sha256_hex, sha);
    assert_eq!(got.size_bytes, data.len() as u64);
    assert_eq!(std::fs::read(&got.path).unwrap(), data);
    // five chunks, one retried after the drop, then one repair pass over all five
    assert_eq!(served.gets.lock().unwrap().len(), 5 + 1 + 5);
    // published with its stamp and source; the part file and manifest are gone
    assert_eq!(
        files(store.path()),
        [".model.gguf.source", ".model.gguf.verified", "model.gguf"]
    );
    let listed = catalog::list(store.path()).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].sha256_hex.as_deref(), Some(sha.as_str()));
    assert_eq!(listed[0].source.as_deref(), Some(url.as_str()));
    // pulled again with the same digest: nothing fetched
    pull(&url, store.path(), &opts(&sha)).unwrap();
    assert_eq!(served.gets.lock().unwrap().len(), 11);
    // resolved by name for `muser up -m`, then removed with its sidecars
    let by_name = catalog::resolve(Path::new("model.gguf"), store.path()).unwrap();
    assert_eq!(by_name, got.path);
    catalog::remove(store.path(), "model.gguf").unwrap();
    assert!(files(store.path()).is_empty());
}

#[test]
fn an_interrupted_pull_resumes_with_only_the_missing_chunk() {
    let (data, sha) = payload();
    let faults = Faults {
        fail_always_at: Some(2 * MIB as u64),
        ..Faults::default()
    };
    let (url, served) = serve(data.clone(), faults);
    let store = tempfile::tempdir().unwrap();
    let err = pull(&url, store.path(), &opts(&sha)).unwrap_err();
    assert!(
        matches!(&err, StoreError::Http { message, .. } if message.contains("403")),
        "{err}"
    );
    // the part file and manifest stay for the resume; nothing under the final name
    assert_eq!(
        files(store.path()),
        [".model.gguf.part", ".model.gguf.pull"]
    );
    // a chunk recorded as done but damaged on disk is fetched again too
    let part = store.path().join(".model.gguf.part");
    let mut bytes = std::fs::read(&part).unwrap();
    bytes[10] ^= 1;
    std::fs::write(&part, bytes).unwrap();
    served.faults.lock().unwrap().fail_always_at = None;
    served.gets.lock().unwrap().clear();
    let got = pull(&url, store.path(), &opts(&sha)).unwrap();
    assert_eq!(std::fs::read(&got.path).unwrap(), data);
    let mut again = served.gets.lock().unwrap().clone();
    again.sort();
    assert_eq!(again, [0, 2 * MIB as u64]);
}

#[test]
fn refuses_a_wrong_digest_plain_http_unpinned_too_large_busy_and_bad_names() {
    let (data, _) = payload();
    let (url, _served) = serve(data, Faults::default());
    let store = tempfile::tempdir().unwrap();
    let wrong = "ab".repeat(32);
    let err = pull(&url, store.path(), &opts(&wrong)).unwrap_err();
    assert!(matches!(err, StoreError::Digest { .. }), "{err}");
    assert!(files(store.path()).is_empty(), "{:?}", files(store.path()));

    let mut unpinned = opts(&wrong);
    unpinned.sha256_hex = None;
    let err = pull(&url, store.path(), &unpinned).unwrap_err();
    assert!(matches!(err, StoreError::Unpinned(_)), "{err}");

    let mut small = opts(&wrong);
    small.max_bytes = MIB as u64;
    let err = pull(&url, store.path(), &small).unwrap_err();
    assert!(matches!(err, StoreError::TooLarge { .. }), "{err}");

    // another pull of the same name holds the part file
    let part = store.path().join(".model.gguf.part");
    let held = std::fs::File::create(&part).unwrap();
    held.lock().unwrap();
    let err = pull(&url, store.path(), &opts(&wrong)).unwrap_err();
    assert!(matches!(err, StoreError::Busy(_)), "{err}");
    drop(held);
    std::fs::remove_file(&part).unwrap();

    for bad in ["../escape.gguf", ".hidden", "a/b"] {
        let mut named = opts(&wrong);
        named.name = Some(bad.into());
        let err = pull(&url, store.path(), &named).unwrap_err();
        assert!(matches!(err, StoreError::BadName(_)), "{bad}: {err}");
        let err = catalog::remove(store.path(), bad).unwrap_err();
        assert!(matches!(err, StoreError::BadName(_)), "{bad}: {err}");
    }
    assert!(files(store.path()).is_empty());
}
