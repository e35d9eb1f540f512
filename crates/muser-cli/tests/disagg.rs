//! The disaggregated prefill lane with real `muser` processes on loopback and certificates
//! made by `muser tls`: a consumer's remote prefill then decode gives the tokens of a plain
//! local server (SmolLM2, and a synthetic sliding-window Muse Glimmer whose ring wraps many
//! times); an unenrolled name and a certificate of another CA are refused and `auto` falls
//! back to a local prefill; with two producers, killing one keeps the consumer serving
//! through the other; with none left, `remote` fails the request clearly and the consumer
//! still answers. A producer's connection cut mid-pack (`auto` falls back with the local
//! tokens, `remote` fails), a producer of an engine ABI not accepted (refused; `--accept-abi`
//! admits it) and a node revoked while both run (refused at its next request) leave the
//! consumer serving. A session migrates between two consumers over the lane and continues
//! with the tokens it would have produced where it was.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

mod common;
use common::{muser, smollm2};

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA in `dir/NAME` with certificates for `nodes`.
fn pki(dir: &Path, nodes: &[&str]) -> PathBuf {
    let cfg = dir.to_path_buf();
    run(muser().args(["tls", "init", "--config-dir"]).arg(&cfg));
    for n in nodes {
        run(muser().args(["tls", "issue", n, "--config-dir"]).arg(&cfg));
    }
    cfg
}

/// A `muser up` child; killed when dropped.
struct Node {
    child: Child,
    port: u16,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn up(model: &Path, log: &Path, args: &[&str]) -> Node {
    let mut child = muser()
        .args([
            "up", "--port", "0", "--slots", "1", "-c", "2048", "-t", "1", "-m",
        ])
        .arg(model)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        line.contains("ready"),
        "no ready line, see {}",
        log.display()
    );
    let addr = line
        .split_whitespace()
        .find(|w| w.starts_with("http"))
        .unwrap();
    let port = addr.rsplit(':').next().unwrap().parse().unwrap();
    Node { child, port }
}

fn http(port: u16, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let body = body.to_string();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let json = out.split_once("\r\n\r\n").unwrap().1;
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

fn complete(port: u16, prompt: &str) -> (u16, Value) {
    http(
        port,
        "POST",
        "/completion",
        &json!({"prompt": prompt, "n_predict": 8, "temperature": 0, "return_tokens": true}),
    )
}

/// About 650 SmolLM2 tokens: one 512-token chunk from a producer, the rest computed here.
fn prompt() -> String {
    (0..40)
        .map(|i| {
            format!(
                "Entry {i}: the courier left {} parcels at the mill. ",
                i * 3 + 1
            )
        })
        .collect()
}

fn key(dir: &Path) -> PathBuf {
    let p = dir.join("kv.key");
    std::fs::write(&p, [5u8; 32]).unwrap();
    p
}

#[test]
fn remote_prefill_equals_local_and_the_consumer_survives_every_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = pki(&d.join("cfg"), &["prod1", "prod2", "cons", "stranger"]);
    let other_ca = pki(&d.join("other"), &["cons"]);
    let key = key(d);
    let model = smollm2();
    let lane = |name: &str, cfg: &Path| {
        vec![
            "--name".to_string(),
            name.to_string(),
            "--config-dir".into(),
            cfg.display().to_string(),
            "--kv-key-file".into(),
            key.display().to_string(),
        ]
    };
    let producer = |name: &str| {
        let mut a = lane(name, &cfg);
        a.extend(["--role", "producer", "--consumer", "cons"].map(String::from));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        up(&model, &d.join(format!("{name}.log")), &a)
    };
    let p1 = producer("prod1");
    let p2 = producer("prod2");
    let consumer = |name: &str, cfg: &Path, mode: &str, producers: &[&Node]| {
        let mut a = lane(name, cfg);
        a.extend(["--prefill", mode, "--remote-min-tokens", "1"].map(String::from));
        for (i, p) in producers.iter().enumerate() {
            a.push("--producer".into());
            a.push(format!("prod{}=https://127.0.0.1:{}", i + 1, p.port));
        }
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        up(&model, &d.join(format!("{name}-{mode}.log")), &a)
    };
    let local = up(&model, &d.join("local.log"), &[]);
    let (s, want) = complete(local.port, &prompt());
    assert_eq!(s, 200, "{want}");
    assert_eq!(want["timings"]["prefill_lane"], "local");

    let c = consumer("cons", &cfg, "remote", &[&p1, &p2]);
    let (s, got) = complete(c.port, &prompt());
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["timings"]["prefill_lane"], "remote");
    assert_eq!(
        got["tokens"], want["tokens"],
        "remote prefill changed the tokens"
    );
    let (_, props) = http(c.port, "GET", "/props", &Value::Null);
    assert_eq!(props["prefill_lane"]["mode"], "remote");

    // a name the producers did not enroll, and a certificate of another CA: refused, and
    // `auto` prefills locally with the same tokens
    for (name, ca) in [("stranger", &cfg), ("cons", &other_ca)] {
        let a = consumer(name, ca, "auto", &[&p1]);
        let (s, v) = complete(a.port, &prompt());
        assert_eq!(s, 200, "{name}: {v}");
        assert_eq!(v["timings"]["prefill_lane"], "local", "{name}: {v}");
        assert_eq!(v["tokens"], want["tokens"], "{name}");
    }

    // a producer killed: the consumer fails over to the other one
    let used = got["timings"]["producer"].as_str().unwrap().to_string();
    let (dead, alive) = if used == "prod1" { (p1, p2) } else { (p2, p1) };
    drop(dead);
    let (s, v) = complete(c.port, &format!("Again. {}", prompt()));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["timings"]["prefill_lane"], "remote");
    assert_ne!(v["timings"]["producer"].as_str().unwrap(), used);
    // none left: `remote` says so, and the consumer still answers
    drop(alive);
    let (s, v) = complete(c.port, &format!("Once more. {}", prompt()));
    assert_eq!(s, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("every producer"),
        "{v}"
    );
    let (s, _) = http(c.port, "GET", "/health", &Value::Null);
    assert_eq!(s, 200);
}

#[test]
fn a_sliding_window_model_whose_ring_wraps_hands_off_exactly_in_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("tiny.gguf");
    run(muser()
        .args([
            "synth",
            "--preset",
            "tiny",
            "--type",
            "q8_0",
            "--vocab-from",
        ])
        .arg(smollm2())
        .arg("-o")
        .arg(&model));
    let cfg = pki(&d.join("cfg"), &["prod", "cons", "cons2"]);
    let key = key(d);
    // 64-token chunks: the ~650-token prompt's handoff is long enough to come in pieces
    let common = |name: &str, chunk: &str| {
        vec![
            "--name".to_string(),
            name.into(),
            "--config-dir".into(),
            cfg.display().to_string(),
            "--kv-key-file".into(),
            key.display().to_string(),
            "--prefill-chunk".into(),
            chunk.into(),
        ]
    };
    let mut a = common("prod", "64");
    a.extend(
        [
            "--role",
            "producer",
            "--consumer",
            "cons",
            "--consumer",
            "cons2",
        ]
        .map(String::from),
    );
    let p = up(
        &model,
        &d.join("prod.log"),
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let consumer = |name: &str, chunk: &str| {
        let mut a = common(name, chunk);
        a.extend(["--prefill", "remote", "--producer"].map(String::from));
        a.push(format!("prod=https://127.0.0.1:{}", p.port));
        up(
            &model,
            &d.join(format!("{name}.log")),
            &a.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    };
    let c = consumer("cons", "64");
    let local = up(&model, &d.join("local.log"), &["--prefill-chunk", "64"]);
    // the window is 32 tokens: the ring wraps about twenty times over the prompt
    let (s, want) = complete(local.port, &prompt());
    assert_eq!(s, 200, "{want}");
    let (s, got) = complete(c.port, &prompt());
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["timings"]["prefill_lane"], "remote");
    assert_eq!(got["tokens"], want["tokens"]);
    let (_, props) = http(c.port, "GET", "/props", &Value::Null);
    let last = &props["prefill_lane"]["producers"][0]["last_handoff"];
    assert!(last["pieces"].as_u64().unwrap() >= 2, "{last}");
    assert_eq!(last["from_token"], 0, "{last}");

    // a prompt that shares the first 5/6 of that one and goes on longer: the producer's slot
    // holds the first prompt, its ring long past the block its first piece would be cut back
    // to, so it computes the prompt again rather than resume from rows the ring dropped
    let text = prompt();
    let more: String = (0..20)
        .map(|i| format!("Later {i}: the mill sent {} crates back. ", i * 7 + 2))
        .collect();
    let short = &format!("{}{more}", &text[..text.len() * 5 / 6]);
    // both from empty slots: a slot's history changes the chunks a prompt is computed in
    for port in [local.port, c.port] {
        http(port, "POST", "/slots/0?action=erase", &json!({}));
    }
    let (s, want) = complete(local.port, short);
    assert_eq!(s, 200, "{want}");
    let (s, got) = complete(c.port, short);
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["timings"]["prefill_lane"], "remote", "{got}");
    assert_eq!(got["tokens"], want["tokens"]);

    // a consumer cutting prompts into other chunks would not get a local prefill's K/V from
    // this producer: it is refused, naming both sizes
    drop(c);
    let other = consumer("cons2", "128");
    let (s, v) = complete(other.port, &prompt());
    assert_eq!(s, 503, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("prefill chunk is 64"), "{msg}");
}

/// A port free on 127.0.0.1 now (for a listener given by number).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A greedy chat turn on slot 0: the answer and the prompt tokens that came from the cache.
fn chat(port: u16, messages: &Value) -> (String, u64) {
    let (s, v) = http(
        port,
        "POST",
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 12, "temperature": 0, "id_slot": 0}),
    );
    assert_eq!(s, 200, "{v}");
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

#[test]
fn a_session_migrates_over_the_lane_and_continues_with_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = pki(&d.join("cfg"), &["a", "b", "c"]);
    let key = key(d);
    let model = smollm2();
    let lane_port = free_port();
    let node = |name: &str, extra: &[String]| {
        let mut a = vec![
            "--name".to_string(),
            name.into(),
            "--config-dir".into(),
            cfg.display().to_string(),
            "--kv-key-file".into(),
            key.display().to_string(),
            "--session-dir".into(),
            d.join(format!("sessions-{name}")).display().to_string(),
        ];
        a.extend_from_slice(extra);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        up(&model, &d.join(format!("{name}.log")), &a)
    };
    let b = node(
        "b",
        &[
            "--lane-port".into(),
            lane_port.to_string(),
            "--lane-peer".into(),
            "a".into(),
        ],
    );
    let to_b = [
        "--migrate-to".to_string(),
        format!("b=https://127.0.0.1:{lane_port}"),
    ];
    let a = node("a", &to_b);
    // `c` is not b's --lane-peer: refused in the handshake
    let c = node("c", &to_b);

    // one turn on A, saved as a session; A then goes on uninterrupted
    let q1 = json!({"role": "user", "content": "Name three colors of the rainbow."});
    let (a1, _) = chat(a.port, &json!([q1]));
    let turn1 = json!([q1, {"role": "assistant", "content": a1}]);
    let (s, created) = http(
        a.port,
        "POST",
        "/v1/sessions",
        &json!({"id": "rainbow", "slot": 0, "messages": turn1}),
    );
    assert_eq!(s, 201, "{created}");
    let n_tokens = created["n_tokens"].as_u64().unwrap();
    let mut turn2 = turn1.as_array().unwrap().clone();
    turn2.push(json!({"role": "user", "content": "And two more?"}));
    let turn2 = Value::from(turn2);
    let (a2, _) = chat(a.port, &turn2);

    // refusals change nothing: an unknown node, a session that does not exist, a peer B
    // did not enroll
    let migrate = |port: u16, id: &str, to: &str| {
        http(
            port,
            "POST",
            &format!("/v1/sessions/{id}/migrate"),
            &json!({ "to": to }),
        )
    };
    assert_eq!(migrate(a.port, "rainbow", "z").0, 400);
    assert_eq!(migrate(a.port, "nothing", "b").0, 404);
    let hi = json!([{"role": "user", "content": "Hi."}]);
    chat(c.port, &hi);
    let (s, v) = http(
        c.port,
        "POST",
        "/v1/sessions",
        &json!({"id": "other", "slot": 0, "messages": hi}),
    );
    assert_eq!(s, 201, "{v}");
    let (s, v) = migrate(c.port, "other", "b");
    assert_eq!(s, 502, "{v}");
    assert_eq!(
        http(c.port, "GET", "/v1/sessions/other", &Value::Null).0,
        200
    );

    // the move: B holds revision 1, A no longer has it
    let (s, v) = migrate(a.port, "rainbow", "b");
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["revision"], 1);
    assert_eq!(v["migrated_to"], "b");
    assert_eq!(
        http(a.port, "GET", "/v1/sessions/rainbow", &Value::Null).0,
        404
    );
    let (s, held) = http(b.port, "GET", "/v1/sessions/rainbow", &Value::Null);
    assert_eq!((s, &held["revision"]), (200, &json!(1)), "{held}");

    // restored on B, the conversation continues with A's tokens, from the moved K/V
    let (s, r) = http(
        b.port,
        "POST",
        "/v1/sessions/rainbow/restore",
        &json!({"slot": 0}),
    );
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["n_restored"].as_u64(), Some(n_tokens));
    let (b2, cached) = chat(b.port, &turn2);
    assert_eq!(b2, a2, "the migrated conversation continues differently");
    assert!(
        cached + 8 >= n_tokens,
        "B recomputed the prompt: {cached} of {n_tokens} tokens from the moved cache"
    );
}

/// Forwards 127.0.0.1 connections to `to`, cutting each after `limit` bytes from `to`: a
/// producer dying in the middle of a pack, as its consumer sees it.
fn cutting_proxy(to: u16, limit: usize) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for down in listener.incoming().flatten() {
            let Ok(up) = TcpStream::connect(("127.0.0.1", to)) else {
                continue;
            };
            let (mut down_w, mut up_r) = (down.try_clone().unwrap(), up.try_clone().unwrap());
            let (mut down_r, mut up_w) = (down, up);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut down_r, &mut up_w);
            });
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 << 10];
                let mut sent = 0;
                while sent < limit {
                    match up_r.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            let n = n.min(limit - sent);
                            if down_w.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            sent += n;
                        }
                    }
                }
                let _ = down_w.shutdown(std::net::Shutdown::Both);
                let _ = up_r.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    port
}

#[test]
fn a_cut_stream_an_unaccepted_abi_and_a_revoked_node_leave_the_consumer_serving() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = pki(&d.join("cfg"), &["prod", "avx2", "cons", "gone"]);
    let key = key(d);
    let model = smollm2();
    let node = |name: &str, log: &str, extra: &[String], env: &[(&str, &str)]| {
        let mut a = vec![
            "--name".to_string(),
            name.into(),
            "--config-dir".into(),
            cfg.display().to_string(),
            "--kv-key-file".into(),
            key.display().to_string(),
        ];
        a.extend_from_slice(extra);
        if !extra.iter().any(|x| x == "--numerics") {
            // one order on every host (the default, the host's, is the AVX2 one on an
            // AVX2-only machine, which would make the AVX2 producer's ABI this node's own)
            a.extend(["--numerics".to_string(), "portable".to_string()]);
        }
        let mut cmd = muser();
        cmd.args([
            "up", "--port", "0", "--slots", "1", "-c", "2048", "-t", "1", "-m",
        ])
        .arg(&model)
        .args(&a)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(d.join(log)).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("ready"), "no ready line, see {log}");
        let port = line
            .split_whitespace()
            .find(|w| w.starts_with("http"))
            .and_then(|w| w.rsplit(':').next()?.trim_end_matches('/').parse().ok())
            .unwrap();
        Node { child, port }
    };
    let s = |x: &str| x.to_string();
    let producer_args = [
        s("--role"),
        s("producer"),
        s("--consumer"),
        s("cons"),
        s("--consumer"),
        s("gone"),
    ];
    let prod = node("prod", "prod.log", &producer_args, &[]);
    // a producer whose numerics differ: the AVX2 order
    let avx2_args = [
        "--role",
        "producer",
        "--consumer",
        "cons",
        "--numerics",
        "host",
    ]
    .map(s);
    let avx2 = node("avx2", "avx2.log", &avx2_args, &[("MUSER_ISA", "avx2")]);
    let consumer = |name: &str, log: &str, mode: &str, producer: String, extra: &[String]| {
        let mut a = vec![
            s("--prefill"),
            s(mode),
            s("--remote-min-tokens"),
            s("1"),
            s("--producer"),
            producer,
        ];
        a.extend_from_slice(extra);
        node(name, log, &a, &[])
    };
    let local = up(&model, &d.join("local.log"), &[]);
    let (st, want) = complete(local.port, &prompt());
    assert_eq!(st, 200, "{want}");

    // the producer's connection cut after 256 KiB of its answer (mid-pack): `auto` logs why
    // and prefills locally with the same tokens, `remote` fails clearly; nothing half-installed
    let cut = cutting_proxy(prod.port, 256 << 10);
    let auto = consumer(
        "cons",
        "cut-auto.log",
        "auto",
        format!("prod=https://127.0.0.1:{cut}"),
        &[],
    );
    let (st, v) = complete(auto.port, &prompt());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["timings"]["prefill_lane"], "local");
    assert_eq!(v["tokens"], want["tokens"]);
    let log = std::fs::read_to_string(d.join("cut-auto.log")).unwrap();
    assert!(log.contains("falling back to local prefill"), "{log}");
    let remote = consumer(
        "cons",
        "cut-remote.log",
        "remote",
        format!("prod=https://127.0.0.1:{cut}"),
        &[],
    );
    let (st, v) = complete(remote.port, &prompt());
    assert_eq!(st, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("every producer"),
        "{v}"
    );
    assert_eq!(http(remote.port, "GET", "/health", &Value::Null).0, 200);

    // a producer of another engine ABI: refused before anything is installed, unless the
    // consumer was told to accept that ABI
    let (st, v) = complete(
        consumer(
            "cons",
            "abi.log",
            "remote",
            format!("avx2=https://127.0.0.1:{}", avx2.port),
            &[],
        )
        .port,
        &prompt(),
    );
    assert_eq!(st, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("engine_abi"),
        "{v}"
    );
    let abi = "muser-cpu:ggml-b11434/x86-avx2/fa-on-f16-v1";
    let accepting = consumer(
        "cons",
        "abi-accept.log",
        "remote",
        format!("avx2=https://127.0.0.1:{}", avx2.port),
        &[s("--accept-abi"), s(abi)],
    );
    let (st, v) = complete(accepting.port, &prompt());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["timings"]["producer"], "avx2");

    // a node revoked while both run: refused from its next request on, no restart
    let gone = consumer(
        "gone",
        "gone.log",
        "remote",
        format!("prod=https://127.0.0.1:{}", prod.port),
        &[],
    );
    let (st, v) = complete(gone.port, &prompt());
    assert_eq!(
        (st, &v["timings"]["prefill_lane"]),
        (200, &json!("remote")),
        "{v}"
    );
    run(muser()
        .args(["tls", "revoke", "gone", "--config-dir"])
        .arg(&cfg));
    let (st, v) = complete(gone.port, &format!("Again. {}", prompt()));
    assert_eq!(st, 503, "{v}");
}
