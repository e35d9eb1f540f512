//! Node onboarding with real `muser` processes on loopback: a producer started with
//! `--enroll` prints a one-time code, `muser node add` enrolls it (preflight, model, keys,
//! handoff), a consumer already running takes it into its lane without a restart, `muser
//! node list` shows it healthy and a plain `muser up` of the consumer (a new process: the
//! registry survives restarts) prefills on it; the code does not work twice; `qualify`
//! writes its receipt; `DELETE /v1/nodes/{name}` revokes it and every running consumer
//! stops using it at once, and a consumer started later refuses it in the handshake. An
//! expired code, a node serving another model (through `POST /v1/nodes`), a node that is
//! gone, a forged secret, a node that dies once its keys are issued and a node whose handoff
//! gives other tokens each fail naming their step and leave no node recorded (and the last
//! two, no certificate in force; their failure shows in `muser node status`). A node killed
//! once enrolled shows its failed probes in `muser node status`, and serves again from the
//! enrollment it kept when restarted.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, ChildStdout, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use muser_kvpack::KvState;
use muser_server::lane::{LaneRole, LaneSetup};
use muser_server::producer::KvFault;
use muser_server::server::{self, ServeConfig};
use serde_json::{json, Value};

mod common;
use common::{muser, smollm2};

/// A `muser up` child; killed when dropped.
struct Proc {
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn line(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line
    }
}

/// `muser up` with `args` (on port 0 unless they give `--port`).
fn spawn(d: &Path, log: &str, model: &Path, args: &[&str]) -> Proc {
    let port = (!args.contains(&"--port")).then_some(["--port", "0"]);
    let mut child = muser()
        .args(["up", "--slots", "1", "-c", "2048", "-t", "1", "-m"])
        .arg(model)
        .args(port.iter().flatten())
        .args(args)
        .env("MUSER_HOME", d.join("home"))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(d.join(log)).unwrap())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    Proc { child, stdout }
}

/// A producer waiting for enrollment: the process, its port and its code.
fn enrolling(d: &Path, model: &Path, extra: &[&str]) -> (Proc, u16, String) {
    let cfg = d.join("prod-cfg");
    let mut args = vec![
        "--role",
        "producer",
        "--name",
        "prod",
        "--enroll",
        "--config-dir",
    ];
    args.push(cfg.to_str().unwrap());
    args.extend(extra);
    let mut p = spawn(d, "prod.log", model, &args);
    let line = p.line();
    assert!(line.contains("enrolling"), "{line}: see prod.log");
    let port = line
        .split("https://127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap()
        .parse()
        .unwrap();
    let code = line.trim_end().rsplit(' ').next().unwrap().to_string();
    assert!(code.starts_with("mu1-"), "{line}");
    (p, port, code)
}

fn node(d: &Path, args: &[&str]) -> Output {
    muser()
        .arg("node")
        .args(args)
        .arg("--config-dir")
        .arg(d.join("cons-cfg"))
        .env("MUSER_HOME", d.join("home"))
        .output()
        .unwrap()
}

fn add(d: &Path, name: &str, port: u16, code: &str) -> (bool, String) {
    let url = format!("https://127.0.0.1:{port}");
    let key = d.join("kv.key");
    let out = node(
        d,
        &[
            "add",
            name,
            &url,
            "--code",
            code,
            "-t",
            "1",
            "--kv-key-file",
            key.to_str().unwrap(),
            "-m",
            smollm2().to_str().unwrap(),
        ],
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kv.key"), "07".repeat(32)).unwrap();
    dir
}

fn complete(port: u16, prompt: &str) -> (u16, Value) {
    let body = json!({"prompt": prompt, "n_predict": 4, "temperature": 0});
    http(port, "POST", "/completion", &body)
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

/// About 650 SmolLM2 tokens: one 512-token chunk prefilled by the producer.
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

fn consumer(d: &Path, extra: &[&str]) -> (Proc, u16) {
    let cfg = d.join("cons-cfg");
    let key = d.join("kv.key");
    let mut args = vec![
        "--config-dir",
        cfg.to_str().unwrap(),
        "--kv-key-file",
        key.to_str().unwrap(),
    ];
    args.extend(extra);
    let mut c = spawn(d, "cons.log", &smollm2(), &args);
    let line = c.line();
    assert!(line.contains("muser ready"), "{line}: see cons.log");
    let addr = line
        .split_whitespace()
        .find(|w| w.starts_with("http"))
        .unwrap();
    let port = addr.rsplit(':').next().unwrap().parse().unwrap();
    (c, port)
}

/// Polls `f` every 200 ms for at most 20 s; whether it came true.
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    (0..100).any(|_| {
        f() || {
            std::thread::sleep(Duration::from_millis(200));
            false
        }
    })
}

/// The health of producer `name` in the running consumer's lane (`/props`).
fn lane_health(port: u16, name: &str) -> Value {
    let (_, props) = http(port, "GET", "/props", &Value::Null);
    props["prefill_lane"]["producers"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == name))
        .map_or(Value::Null, |p| p["health"].clone())
}

/// A `muser node status` line of a failed probe: `  YYYY-MM-DD HH:MM:SSZ  probe  why`.
fn probe_failure(line: &str) -> bool {
    let mut words = line.split_whitespace();
    let (Some(date), Some(time), Some(what)) = (words.next(), words.next(), words.next()) else {
        return false;
    };
    let digits = |s: &str, seps: &[usize]| {
        s.char_indices().all(|(i, c)| {
            if seps.contains(&i) {
                !c.is_ascii_digit()
            } else {
                c.is_ascii_digit()
            }
        })
    };
    date.len() == 10
        && digits(date, &[4, 7])
        && time.len() == 9
        && time.ends_with('Z')
        && digits(&time[..8], &[2, 5])
        && what == "probe"
}

/// Every certificate the consumer's CA issued to `name` is revoked (and there was one).
fn all_revoked(d: &Path, name: &str) -> bool {
    let tls = d.join("cons-cfg/tls");
    let issued = std::fs::read_to_string(tls.join("issued")).unwrap_or_default();
    let revoked = std::fs::read_to_string(tls.join("revoked")).unwrap_or_default();
    let serials: Vec<&str> = issued
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some(name))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    !serials.is_empty()
        && serials
            .iter()
            .all(|s| revoked.lines().any(|r| r.trim() == *s))
}

#[test]
fn an_enrolled_node_is_healthy_used_by_up_and_refused_once_removed() {
    let dir = setup();
    let d = dir.path();
    let (mut prod, port, code) = enrolling(d, &smollm2(), &[]);
    // a consumer running before anything is enrolled: the node joins it when enrolled
    let (live, live_port) = consumer(d, &["--prefill", "remote"]);
    let (ok, out) = add(d, "prod", port, &code);
    assert!(ok, "{out}");
    for step in ["preflight", "model", "keys", "handoff", "record"] {
        assert!(out.contains(&format!("{step} ")), "{step} missing: {out}");
    }
    assert!(out.contains("tokens identical"), "{out}");
    let ready = prod.line();
    assert!(ready.contains("muser producer ready"), "{ready}");
    assert!(
        eventually(|| lane_health(live_port, "prod") == "healthy"),
        "the running consumer did not take the node in: see cons.log"
    );
    let (s, got) = complete(live_port, &prompt());
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["timings"]["prefill_lane"], "remote", "{got}");
    assert_eq!(got["timings"]["producer"], "prod", "{got}");

    // the code worked once
    let (ok, out) = add(d, "prod", port, &code);
    assert!(
        !ok && out.contains("preflight") && out.contains("already enrolled"),
        "{out}"
    );
    let reg = d.join("cons-cfg/nodes.toml");
    let text = std::fs::read_to_string(&reg).unwrap();
    std::fs::remove_file(&reg).unwrap();
    let (ok, out) = add(d, "prod", port, &code);
    assert!(
        !ok && out.contains("preflight") && out.contains("pins"),
        "{out}"
    );
    std::fs::write(&reg, text).unwrap();

    let list = node(d, &["list"]);
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(list.contains("prod") && list.contains("healthy"), "{list}");

    // qualify (small sizes): identical tokens, TTFT both ways, a receipt
    let receipt = d.join("qualify.json");
    let key = d.join("kv.key");
    let out = node(
        d,
        &[
            "qualify",
            "prod",
            "--sizes",
            "600",
            "--reps",
            "1",
            "-t",
            "1",
            "--kv-key-file",
            key.to_str().unwrap(),
            "-m",
            smollm2().to_str().unwrap(),
            "-o",
            receipt.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&receipt).unwrap()).unwrap();
    assert_eq!(r["tokens_identical"], true, "{r}");
    assert_eq!(r["runs"][0]["tokens"], 600, "{r}");
    assert!(
        r["runs"][0]["remote_ttft_ms"].as_f64().unwrap() > 0.0,
        "{r}"
    );
    assert!(r["runs"][0]["kv_bytes"].as_u64().unwrap() > 0, "{r}");

    // --local ignores the registry
    let (c, cport) = consumer(d, &["--local"]);
    let (s, got) = complete(cport, &prompt());
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["timings"]["prefill_lane"], "local", "{got}");
    drop(c);

    // a new consumer process takes the node from the registry
    let (c, cport) = consumer(d, &["--prefill", "remote"]);
    let (s, got) = complete(cport, &prompt());
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["timings"]["prefill_lane"], "remote", "{got}");
    assert_eq!(got["timings"]["producer"], "prod", "{got}");
    let (s, nodes) = http(cport, "GET", "/v1/nodes", &Value::Null);
    assert_eq!(s, 200, "{nodes}");
    assert_eq!(nodes["nodes"][0]["name"], "prod", "{nodes}");
    assert_eq!(nodes["nodes"][0]["state"], "healthy", "{nodes}");

    // the node dies: the running consumers' probes fail, and `muser node status` shows
    // those failures with their time; restarted without --enroll, it serves again from the
    // enrollment it kept
    drop(prod);
    let mut status = String::new();
    assert!(
        eventually(|| {
            status = String::from_utf8_lossy(&node(d, &["status", "prod"]).stdout).into();
            status.lines().any(probe_failure)
        }),
        "{status}"
    );
    assert!(status.contains("now:           down"), "{status}");
    let port_arg = port.to_string();
    let cfg = d.join("prod-cfg");
    let args = [
        "--role",
        "producer",
        "--name",
        "prod",
        "--port",
        &port_arg,
        "--config-dir",
        cfg.to_str().unwrap(),
    ];
    let mut prod = spawn(d, "prod2.log", &smollm2(), &args);
    let ready = prod.line();
    assert!(
        ready.contains("muser producer ready"),
        "{ready}: see prod2.log"
    );
    let out = node(d, &["status", "prod"]);
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(status.contains("now:           healthy"), "{status}");

    // removed through the running consumer: revoked, forgotten, and not used from now on
    let (s, got) = http(cport, "DELETE", "/v1/nodes/prod", &Value::Null);
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["certificates_revoked"], 1, "{got}");
    // (another prompt: the slot holds the last one, which needs no producer)
    let (s, got) = complete(cport, &format!("Again. {}", prompt()));
    assert_eq!(s, 503, "{got}");
    assert!(got.to_string().contains("no producer is healthy"), "{got}");
    drop(c);
    let list = node(d, &["list"]);
    assert!(String::from_utf8_lossy(&list.stdout).contains("no node is enrolled"));
    let out = node(d, &["remove", "prod"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not enrolled"));

    // the consumer that took the node in live saw it removed from the registry
    assert!(
        eventually(|| lane_health(live_port, "prod") == "down"),
        "the running consumer still routes to a removed node"
    );
    let (s, got) = complete(live_port, &format!("Again. {}", prompt()));
    assert_eq!(s, 503, "{got}");
    drop(live);

    // a consumer started afterwards refuses the revoked certificate in the handshake
    let url = format!("prod=https://127.0.0.1:{port}");
    let args = [
        "--prefill",
        "remote",
        "--name",
        "consumer",
        "--producer",
        &url,
    ];
    let (_c, cport) = consumer(d, &args);
    let (s, got) = complete(cport, &prompt());
    assert_eq!(s, 503, "{got}");
    assert!(got.to_string().contains("every producer"), "{got}");
}

#[test]
fn a_bad_enrollment_names_its_step_and_records_nothing() {
    let dir = setup();
    let d = dir.path();
    let tiny = d.join("tiny.gguf");
    let out = muser()
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
        .arg(&tiny)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // another model, enrolled through the running consumer's POST /v1/nodes: refused at
    // the model step, nothing issued
    let (p, port, code) = enrolling(d, &tiny, &[]);
    let (c, cport) = consumer(d, &[]);
    let url = format!("https://127.0.0.1:{port}");
    let add_req = json!({"name": "prod", "url": url, "code": code});
    let (s, got) = http(cport, "POST", "/v1/nodes", &add_req);
    assert_eq!(s, 422, "{got}");
    assert_eq!(got["error"]["step"], "model", "{got}");
    assert!(got.to_string().contains("model_weights: expected"), "{got}");
    assert_eq!(got["steps"][0]["step"], "preflight", "{got}");
    let (s, got) = http(cport, "DELETE", "/v1/nodes/prod", &Value::Null);
    assert_eq!(s, 404, "{got}");
    drop((c, p));

    // an expired code
    let (p, port, code) = enrolling(d, &smollm2(), &["--enroll-ttl-s", "1"]);
    std::thread::sleep(Duration::from_millis(1500));
    let (ok, out) = add(d, "prod", port, &code);
    assert!(
        !ok && out.contains("preflight") && out.contains("expired"),
        "{out}"
    );

    // a node that is gone
    drop(p);
    let (ok, out) = add(d, "prod", port, &code);
    assert!(
        !ok && out.contains("preflight") && out.contains("connect"),
        "{out}"
    );

    // a code of the right shape but another secret: the node's proof fails
    let (_p, port, code) = enrolling(d, &smollm2(), &[]);
    let forged = format!("{}{}", &code[..36], "0".repeat(32));
    let (ok, out) = add(d, "prod", port, &forged);
    assert!(
        !ok && out.contains("preflight") && out.contains("proof"),
        "{out}"
    );

    let list = node(d, &["list"]);
    assert!(String::from_utf8_lossy(&list.stdout).contains("no node is enrolled"));
}

/// `muser node add` as a child whose progress lines are read as they come.
fn add_child(d: &Path, port: u16, code: &str) -> Child {
    let url = format!("https://127.0.0.1:{port}");
    let key = d.join("kv.key");
    muser()
        .args(["node", "add", "prod", &url, "--code", code, "-t", "1"])
        .arg("--kv-key-file")
        .arg(&key)
        .arg("-m")
        .arg(smollm2())
        .arg("--config-dir")
        .arg(d.join("cons-cfg"))
        .env("MUSER_HOME", d.join("home"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Nothing of `prod` is in force after a failed enrollment: not in the registry, every
/// certificate issued to it revoked, and `muser node status` shows the failed step.
fn left_nothing(d: &Path, step: &str) {
    let list = node(d, &["list"]);
    assert!(String::from_utf8_lossy(&list.stdout).contains("no node is enrolled"));
    assert!(
        all_revoked(d, "prod"),
        "a certificate of prod is still in force"
    );
    let status = node(d, &["status", "prod"]);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(!status.status.success(), "{text}");
    assert!(text.contains(&format!("enroll {step}")), "{text}");
}

#[test]
fn a_node_that_dies_once_its_keys_are_issued_fails_at_the_handoff_revoked() {
    let dir = setup();
    let d = dir.path();

    // the node dies once its keys are issued: the handoff fails within its bounds (a
    // connection refused, retried for 5 s)
    let (mut prod, port, code) = enrolling(d, &smollm2(), &[]);
    let started = std::time::Instant::now();
    let mut child = add_child(d, port, &code);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let keys = line.starts_with("keys ");
        seen.push(line);
        if keys {
            prod.child.kill().unwrap();
            break;
        }
    }
    seen.extend(lines.map(Result::unwrap));
    let ok = child.wait().unwrap().success();
    let out = seen.join("\n");
    assert!(!ok, "{out}");
    assert!(out.contains("handoff    FAILED"), "{out}");
    assert!(!out.contains("record "), "{out}");
    assert!(started.elapsed() < Duration::from_secs(60), "{out}");
    left_nothing(d, "handoff");
}

/// A producer waiting for enrollment in this process, built from the library as `muser up
/// --role producer --enroll` builds it (`enroll_producer`, then `serve_producer`), whose
/// exported K/V goes through `fault` before it is sealed: its port and its code. It serves
/// until the test process ends.
fn faulty_enrolling(d: &Path, fault: KvFault) -> (u16, String) {
    std::fs::write(d.join("prod.key"), "09".repeat(32)).unwrap();
    let setup = LaneSetup {
        config_dir: d.join("prod-cfg"),
        node: "prod".into(),
        role: LaneRole::Producer {
            consumers: Vec::new(),
            max_queue: 16,
            fault: Some(fault),
        },
        listen: None,
    };
    let mut cfg = ServeConfig::new(smollm2());
    cfg.n_slots = 1;
    cfg.n_ctx = 2048;
    cfg.threads = 1;
    cfg.kv_key_file = Some(d.join("prod.key"));
    cfg.lane = Some(setup.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let state = server::load(&cfg).unwrap();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let show = move |code: &str| tx.send((port, code.to_string())).unwrap();
            let ttl = Duration::from_secs(600);
            let (state, setup) =
                muser_server::enroll::enroll_producer(&state, &setup, &listener, ttl, show)
                    .await
                    .unwrap();
            server::serve_producer(state, &setup, listener, std::future::pending())
                .await
                .unwrap();
        });
    });
    rx.recv_timeout(Duration::from_secs(300))
        .expect("the in-process producer did not start")
}

#[test]
fn a_node_whose_handoff_differs_fails_at_the_handoff_revoked() {
    let dir = setup();
    let d = dir.path();
    // a consumer running all along, following the registry
    let (live, live_port) = consumer(d, &[]);

    // a faulty node: its K/V comes out as zeros, sealed as if right, so the pack verifies
    // and only the decoded tokens tell
    let zeros = KvFault(Arc::new(|s: &mut KvState| {
        for l in &mut s.layers {
            l.k.fill(0);
            l.v.fill(0);
        }
    }));
    let (port, code) = faulty_enrolling(d, zeros);
    let (ok, out) = add(d, "prod", port, &code);
    assert!(!ok, "{out}");
    for step in ["preflight  ok", "model      ok", "keys       ok"] {
        assert!(out.contains(step), "{step} missing: {out}");
    }
    assert!(
        out.contains("handoff    FAILED: tokens differ from position"),
        "{out}"
    );
    assert!(
        out.contains("(local prefill), found [") && out.contains("(the node's prefill)"),
        "{out}"
    );
    assert!(!out.contains("record "), "{out}");
    left_nothing(d, "handoff");

    // the running consumer never took the node in and prefills a long prompt itself
    let (s, nodes) = http(live_port, "GET", "/v1/nodes", &Value::Null);
    assert_eq!(s, 200, "{nodes}");
    assert_eq!(nodes["nodes"], json!([]), "{nodes}");
    assert_eq!(lane_health(live_port, "prod"), Value::Null);
    let (s, got) = complete(live_port, &prompt());
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["timings"]["prefill_lane"], "local", "{got}");
    drop(live);
}
