//! The disaggregated prefill lane with real `muser` processes on loopback and certificates
//! made by `muser tls`: a consumer's remote prefill then decode gives the tokens of a plain
//! local server (SmolLM2, and a synthetic sliding-window Muse Glimmer whose ring wraps many
//! times); an unenrolled name and a certificate of another CA are refused and `auto` falls
//! back to a local prefill; with two producers, killing one keeps the consumer serving
//! through the other; with none left, `remote` fails the request clearly and the consumer
//! still answers.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

fn muser() -> Command {
    Command::new(env!("CARGO_BIN_EXE_muser"))
}

fn models_dir() -> PathBuf {
    std::env::var_os("MUSER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/muser/models")
        })
}

fn smollm2() -> PathBuf {
    let p = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "missing {} (run scripts/fetch-models.sh)",
        p.display()
    );
    p
}

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
fn a_sliding_window_model_whose_ring_wraps_hands_off_exactly() {
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
    let cfg = pki(&d.join("cfg"), &["prod", "cons"]);
    let key = key(d);
    let common = |name: &str| {
        vec![
            "--name".to_string(),
            name.into(),
            "--config-dir".into(),
            cfg.display().to_string(),
            "--kv-key-file".into(),
            key.display().to_string(),
        ]
    };
    let mut a = common("prod");
    a.extend(["--role", "producer", "--consumer", "cons"].map(String::from));
    let p = up(
        &model,
        &d.join("prod.log"),
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let mut a = common("cons");
    a.extend(["--prefill", "remote", "--producer"].map(String::from));
    a.push(format!("prod=https://127.0.0.1:{}", p.port));
    let c = up(
        &model,
        &d.join("cons.log"),
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let local = up(&model, &d.join("local.log"), &[]);
    // the window is 32 tokens: the ring wraps about twenty times over the prompt
    let (s, want) = complete(local.port, &prompt());
    assert_eq!(s, 200, "{want}");
    let (s, got) = complete(c.port, &prompt());
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["timings"]["prefill_lane"], "remote");
    assert_eq!(got["tokens"], want["tokens"]);
}
