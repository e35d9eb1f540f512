//! `muser up`'s configuration through the real binary: a TOML file (`--config`,
//! `MUSER_CONFIG`), `MUSER_*` environment variables and the command line, in that order of
//! precedence, for a scalar and for a repeatable flag (seen through `--print-config`, which
//! starts nothing); each kind of bad file exits 2 with a message naming the file and line and
//! starts nothing; the sample file under docs/ parses; and a server started from a config
//! file on SmolLM2 answers `/props` with the file's and the environment's values.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

mod common;
use common::{muser, smollm2};

/// Environment variables: (name, value).
type Env<'a> = &'a [(&'a str, &'a str)];

/// `muser up ARGS --print-config` with only the `MUSER_*` variables of `env`.
fn print_config(args: &[&str], env: Env) -> Output {
    let mut cmd = muser();
    cmd.arg("up").args(args).arg("--print-config");
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("MUSER_")) {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().copied()).output().unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The line of `key` in `--print-config`'s output (commented out when it is a default).
fn line_of(out: &str, key: &str) -> String {
    let prefix = format!("{key} = ");
    out.lines()
        .find(|l| l.trim_start_matches("# ").starts_with(&prefix))
        .unwrap_or_else(|| panic!("no `{key}` in\n{out}"))
        .to_string()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

#[test]
fn command_line_beats_environment_beats_file_beats_default() {
    let d = tempfile::tempdir().unwrap();
    let file = write(
        d.path(),
        "muser.toml",
        "# a comment\nport = 1111\nhost = [\"127.0.0.2\", \"127.0.0.3\"]\nmetrics = true\n",
    );
    let f = file.to_str().unwrap();
    let at = |line: usize| format!("# {f}:{line}");
    // (arguments, environment, the port line, the host line)
    let cases: [(&[&str], Env, &str, &str); 4] = [
        (
            &["--config", f, "--port", "3333", "--host", "127.0.0.9"],
            &[
                ("MUSER_PORT", "2222"),
                ("MUSER_HOST", "127.0.0.7,127.0.0.8"),
            ],
            "port = 3333  # command line",
            "host = [\"127.0.0.9\"]  # command line",
        ),
        (
            &["--config", f],
            &[
                ("MUSER_PORT", "2222"),
                ("MUSER_HOST", "127.0.0.7,127.0.0.8"),
            ],
            "port = 2222  # environment MUSER_PORT",
            "host = [\"127.0.0.7\", \"127.0.0.8\"]  # environment MUSER_HOST",
        ),
        (
            &[],
            &[("MUSER_CONFIG", f)],
            &format!("port = 1111  {}", at(2)),
            &format!("host = [\"127.0.0.2\", \"127.0.0.3\"]  {}", at(3)),
        ),
        (
            &[],
            &[],
            "# port = 4949  # default",
            "# host = [\"127.0.0.1\"]  # default",
        ),
    ];
    for (args, env, port, host) in cases {
        let out = stdout(&print_config(args, env));
        assert_eq!(line_of(&out, "port"), port, "{args:?} {env:?}");
        assert_eq!(line_of(&out, "host"), host, "{args:?} {env:?}");
    }
    // a switch: from the file, turned off by the environment (`0`, as `false`, `no`, `off`)
    let out = stdout(&print_config(&["--config", f], &[]));
    assert_eq!(
        line_of(&out, "metrics"),
        format!("metrics = true  {}", at(4))
    );
    let out = stdout(&print_config(&["--config", f], &[("MUSER_METRICS", "0")]));
    assert_eq!(
        line_of(&out, "metrics"),
        "metrics = false  # environment MUSER_METRICS"
    );
    // the printed settings are themselves a config file that reads back the same
    // (defaults commented out), with the same values
    assert!(
        out.contains("\n# prefill-chunk = 512  # default\n"),
        "{out}"
    );
    let again = write(d.path(), "again.toml", &out);
    let reread = stdout(&print_config(&["--config", again.to_str().unwrap()], &[]));
    let line = 1 + out.lines().position(|l| l.starts_with("host =")).unwrap();
    assert_eq!(
        line_of(&reread, "host"),
        format!(
            "host = [\"127.0.0.2\", \"127.0.0.3\"]  # {}:{line}",
            again.display()
        )
    );
}

/// `muser up --config FILE --print-config` fails with status 2, nothing on stdout, and a
/// message containing each of `wants`.
fn refused(file: &Path, wants: &[&str]) {
    let out = print_config(&["--config", file.to_str().unwrap()], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}: {err}", file.display());
    assert!(out.stdout.is_empty(), "{}", file.display());
    for want in wants {
        assert!(
            err.contains(want),
            "{}: want {want:?} in {err}",
            file.display()
        );
    }
}

#[test]
fn a_bad_file_exits_2_naming_the_file_line_and_key() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let f = |name: &str, text: &str| write(dir, name, text);
    let unknown = f("unknown.toml", "port = 1\n\nctx_size = 512\n");
    refused(
        &unknown,
        &[
            &format!("{}:3", unknown.display()),
            "unknown key `ctx_size`",
            "did you mean `ctx-size`?",
        ],
    );
    let t = f("type1.toml", "port = true\n");
    refused(
        &t,
        &[
            &format!("{}:1", t.display()),
            "`port` takes a string or a number, not boolean",
        ],
    );
    let t = f("type2.toml", "\nmetrics = \"yes\"\n");
    refused(
        &t,
        &[
            &format!("{}:2", t.display()),
            "`metrics` is a switch: true or false, not string",
        ],
    );
    let t = f("type3.toml", "port = [1, 2]\n");
    refused(&t, &["`port` takes one value, not an array"]);
    let t = f("type4.toml", "[server]\nport = 1\n");
    refused(&t, &["unknown key `server`"]);
    let toml = f("broken.toml", "port = = 1\n");
    refused(
        &toml,
        &[&format!("config {}: not valid TOML", toml.display())],
    );
    let missing = dir.join("missing.toml");
    refused(
        &missing,
        &[&format!("config {}", missing.display()), "No such file"],
    );
    let parser = f("range.toml", "threads = 2\nport = 70000\n");
    refused(
        &parser,
        &[&format!("`port` ({}:2)", parser.display()), "70000"],
    );
    // the rules between flags hold for a file's settings too
    let requires = f("requires.toml", "tls-cert = \"c.pem\"\n");
    refused(
        &requires,
        &["with the settings of the config file", "--tls-key <PEM>"],
    );
    let meta = f("meta.toml", "config = \"other.toml\"\n");
    refused(&meta, &["`config` belongs on the command line"]);
    // a secret in a file others can read is refused; in a private one it is used, not shown
    let secret = f("secret.toml", "api-key = \"0123456789abcdef-secret\"\n");
    let out = stdout(&print_config(&["--config", secret.to_str().unwrap()], &[]));
    assert_eq!(
        line_of(&out, "api-key"),
        format!("api-key = \"(redacted)\"  # {}:1", secret.display())
    );
    assert!(!out.contains("0123456789abcdef-secret"));
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    refused(&secret, &["other users can read (mode 644)", "chmod 600"]);
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn the_sample_config_file_parses() {
    let sample = root().join("docs/muser.example.toml");
    let out = stdout(&print_config(&["--config", sample.to_str().unwrap()], &[]));
    assert!(line_of(&out, "ctx-size").starts_with("ctx-size = 8192  # "));
    assert!(line_of(&out, "host").starts_with("host = [\"127.0.0.1\", \"::1\"]  # "));
    assert!(line_of(&out, "temp").starts_with("temp = 0.7  # "));
}

#[test]
fn a_server_started_from_a_config_file_reports_its_settings() {
    let d = tempfile::tempdir().unwrap();
    let model = smollm2();
    let file = write(
        d.path(),
        "muser.toml",
        &format!(
            "model = {:?}\nslots = 2\nctx-size = 1024\nalias = \"house-model\"\nn-predict = 7\ntemp = 0.25\nport = 0\nthreads = 1\n",
            model.to_str().unwrap()
        ),
    );
    let mut child = muser()
        .args(["up", "--config"])
        .arg(&file)
        .args(["--temp", "0.5"])
        .env("MUSER_SEED", "42")
        .env("MUSER_HOME", d.path().join("home"))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(d.path().join("up.log")).unwrap())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    let addr = ready
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| {
            let log = std::fs::read_to_string(d.path().join("up.log")).unwrap_or_default();
            panic!("no ready line: {ready:?}; stderr: {log}")
        })
        .to_string();
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "GET /props HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let body = resp.split("\r\n\r\n").nth(1).unwrap();
    let props: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(props["total_slots"], 2, "{props}");
    assert_eq!(props["default_generation_settings"]["n_ctx"], 512);
    assert_eq!(props["model_alias"], "house-model");
    let params = &props["default_generation_settings"]["params"];
    assert_eq!(params["n_predict"], 7, "{params}");
    assert_eq!(params["seed"], 42, "{params}");
    assert_eq!(params["temperature"], 0.5, "{params}");
}

#[test]
fn an_api_key_and_a_key_file_are_taken_by_precedence() {
    let d = tempfile::tempdir().unwrap();
    let short = write(d.path(), "short.key", "short\n");
    let good = write(d.path(), "good.key", "0123456789abcdef-good\n");
    let short_file = format!("api-key-file = {:?}\n", short.to_str().unwrap());
    let file = write(d.path(), "muser.toml", &short_file);
    // each stops before loading the (missing) model: at the key check when a short key wins
    let up = |args: &[&str], env: Env| {
        let mut cmd = muser();
        cmd.args(["up", "--model"])
            .arg(d.path().join("none.gguf"))
            .args(args);
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("MUSER_")) {
            cmd.env_remove(k);
        }
        cmd.env("MUSER_CONFIG_DIR", d.path().join("config"))
            .env("MUSER_HOME", d.path().join("home"));
        let out = cmd.envs(env.iter().copied()).output().unwrap();
        assert!(!out.status.success());
        String::from_utf8(out.stderr).unwrap()
    };
    let bad_key = "the API key must be 16 to 4096 visible characters";
    let on_the_command_line = "--api-key puts the key in the process list";
    let env_short: Env = &[("MUSER_API_KEY", "short")];
    let err = up(&[], env_short);
    assert!(
        err.contains(bad_key) && !err.contains(on_the_command_line),
        "{err}"
    );
    let err = up(&["--api-key-file", good.to_str().unwrap()], env_short);
    assert!(!err.contains(bad_key), "{err}");
    let err = up(&["--api-key", "short"], &[]);
    assert!(
        err.contains(bad_key) && err.contains(on_the_command_line),
        "{err}"
    );
    // the file's key file loses to the environment's key, and wins over nothing
    let config = ["--config", file.to_str().unwrap()];
    let err = up(&config, &[("MUSER_API_KEY", "0123456789abcdef-env")]);
    assert!(!err.contains(bad_key), "{err}");
    assert!(up(&config, &[]).contains(bad_key));
}
