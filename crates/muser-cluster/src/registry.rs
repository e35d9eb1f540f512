//! The consumer's enrolled nodes: `CONFIG/nodes.toml`, written whole (temporary file, fsync,
//! rename; mode 0600), read with a size bound. A node is recorded only after its enrollment
//! passed every step (`muser node add`), and removed with its certificates revoked. Each
//! node's recent failures are kept beside it ([`FailureLog`]).
//!
//! ```toml
//! consumer = "cons"          # this consumer's certificate name on the lane
//!
//! [[node]]
//! name = "prod"
//! url = "https://127.0.0.1:4950"
//! device = "cpu"
//! engine_abi = "muser-cpu:ggml-b11434/x86-avx512/fa-on-f16-v1"
//! model_weights = "9f2c..."
//! enrolled_unix = 1764633600
//! handoff = { tokens = 512, kv_bytes = 9437184, ms = 41.5 }
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::pki::{read_text, write_file};
use crate::{check_name, ClusterError, Endpoint};

/// Most nodes one registry holds.
pub const MAX_NODES: usize = 256;
/// Largest registry file read.
const MAX_BYTES: u64 = 1 << 20;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registry {
    /// This consumer's certificate name (set by its first enrollment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    #[serde(default, rename = "node")]
    pub nodes: Vec<NodeEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    pub name: String,
    /// `https://HOST:PORT`.
    pub url: String,
    pub device: String,
    /// The engine ABI the node computes with (its packs carry it).
    pub engine_abi: String,
    /// The weights digest (hex) both ends verified equal at enrollment.
    pub model_weights: String,
    pub enrolled_unix: u64,
    /// The enrollment's handoff (or the latest qualification's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff: Option<HandoffRecord>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandoffRecord {
    pub tokens: u64,
    pub kv_bytes: u64,
    /// Request to verified state, milliseconds.
    pub ms: f64,
}

impl HandoffRecord {
    /// K/V bytes per second of the handoff, in GB/s.
    pub fn gb_per_s(&self) -> f64 {
        if self.ms > 0.0 {
            self.kv_bytes as f64 / self.ms / 1e6
        } else {
            0.0
        }
    }
}

impl NodeEntry {
    /// The node as the lane dials it.
    pub fn endpoint(&self) -> Result<Endpoint, ClusterError> {
        Endpoint::parse(&format!("{}={}", self.name, self.url))
    }
}

impl Registry {
    /// The registry file of configuration directory `config`.
    pub fn path(config: &Path) -> PathBuf {
        config.join("nodes.toml")
    }

    /// The registry in `config` (empty when there is none yet); every entry checked.
    pub fn load(config: &Path) -> Result<Registry, ClusterError> {
        let path = Self::path(config);
        let bad = |why: String| ClusterError::Config(format!("{}: {why}", path.display()));
        match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Registry::default()),
            Err(e) => return Err(bad(e.to_string())),
            Ok(md) if md.len() > MAX_BYTES => return Err(bad("too large".into())),
            Ok(_) => {}
        }
        let reg: Registry = toml::from_str(&read_text(&path)?).map_err(|e| bad(e.to_string()))?;
        reg.check().map_err(|e| bad(e.to_string()))?;
        Ok(reg)
    }

    fn check(&self) -> Result<(), ClusterError> {
        if self.nodes.len() > MAX_NODES {
            return Err(ClusterError::Config(format!("more than {MAX_NODES} nodes")));
        }
        if let Some(c) = &self.consumer {
            check_name(c)?;
        }
        for (i, n) in self.nodes.iter().enumerate() {
            n.endpoint()?;
            if self.nodes[..i].iter().any(|m| m.name == n.name) {
                return Err(ClusterError::Config(format!(
                    "node `{}` is listed twice",
                    n.name
                )));
            }
        }
        Ok(())
    }

    /// Writes the registry whole into `config` (mode 0600).
    pub fn save(&self, config: &Path) -> Result<(), ClusterError> {
        self.check()?;
        crate::pki::make_dir(config)?;
        let text = toml::to_string(self).map_err(|e| ClusterError::Config(e.to_string()))?;
        write_file(&Self::path(config), &text, 0o600)
    }

    pub fn get(&self, name: &str) -> Option<&NodeEntry> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// Removes node `name`; whether it was there.
    pub fn remove(&mut self, name: &str) -> bool {
        let before = self.nodes.len();
        self.nodes.retain(|n| n.name != name);
        self.nodes.len() != before
    }
}

/// Failures kept per node (the latest).
pub const MAX_FAILURES: usize = 20;
/// Longest reason kept, in bytes.
const MAX_WHY: usize = 512;

/// A node's recent failures, newest last: `CONFIG/failures/NAME.toml`, beside the registry
/// and apart from it (supervision writes it while `muser node` commands rewrite the registry),
/// at most [`MAX_FAILURES`] entries, written whole like the registry. An enrollment step that
/// failed, a status probe or a prefill that failed are kept here for `muser node status`.
///
/// ```toml
/// [[failure]]
/// unix_ms = 1764633600123
/// what = "probe"
/// why = "producer `prod` did not answer within 5000 ms"
/// ```
pub struct FailureLog {
    path: PathBuf,
    name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Failure {
    pub unix_ms: u64,
    /// The enrollment step (`enroll preflight`, ...) or `probe` or `prefill`.
    pub what: String,
    pub why: String,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FailureFile {
    #[serde(default, rename = "failure")]
    failures: Vec<Failure>,
}

impl FailureLog {
    /// Node `name`'s log in configuration directory `config`.
    pub fn at(config: &Path, name: &str) -> FailureLog {
        FailureLog {
            path: config.join("failures").join(format!("{name}.toml")),
            name: name.to_string(),
        }
    }

    /// The failures kept, oldest first (none when there is no log).
    pub fn load(&self) -> Result<Vec<Failure>, ClusterError> {
        let bad = |why: String| ClusterError::Config(format!("{}: {why}", self.path.display()));
        match std::fs::metadata(&self.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(bad(e.to_string())),
            Ok(md) if md.len() > MAX_BYTES => return Err(bad("too large".into())),
            Ok(_) => {}
        }
        let file: FailureFile =
            toml::from_str(&read_text(&self.path)?).map_err(|e| bad(e.to_string()))?;
        if file.failures.len() > MAX_FAILURES {
            return Err(bad(format!("more than {MAX_FAILURES} failures")));
        }
        Ok(file.failures)
    }

    /// Adds a failure of `what` now, dropping the oldest beyond [`MAX_FAILURES`]. A log that
    /// does not read (damaged) is started again.
    pub fn push(&self, what: &str, why: &str) -> Result<(), ClusterError> {
        check_name(&self.name)?;
        let mut failures = self.load().unwrap_or_default();
        let mut why = why.to_string();
        if why.len() > MAX_WHY {
            let mut cut = MAX_WHY;
            while !why.is_char_boundary(cut) {
                cut -= 1;
            }
            why.truncate(cut);
        }
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        failures.push(Failure {
            unix_ms,
            what: what.to_string(),
            why,
        });
        let drop_n = failures.len().saturating_sub(MAX_FAILURES);
        failures.drain(..drop_n);
        let dir = self.path.parent().expect("a file in failures/");
        crate::pki::make_dir(dir)?;
        let text = toml::to_string(&FailureFile { failures })
            .map_err(|e| ClusterError::Config(e.to_string()))?;
        write_file(&self.path, &text, 0o600)
    }

    /// Forgets the node's failures (it was removed).
    pub fn clear(&self) -> Result<(), ClusterError> {
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(ClusterError::Io(format!("{}: {e}", self.path.display())))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str) -> NodeEntry {
        NodeEntry {
            name: name.into(),
            url: "https://127.0.0.1:4950".into(),
            device: "cpu".into(),
            engine_abi: "muser-cpu:x".into(),
            model_weights: "ab".repeat(32),
            enrolled_unix: 1,
            handoff: Some(HandoffRecord {
                tokens: 512,
                kv_bytes: 1 << 20,
                ms: 2.0,
            }),
        }
    }

    #[test]
    fn the_failure_log_keeps_the_latest_bounded_and_restarts_when_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let log = FailureLog::at(dir.path(), "prod");
        assert!(log.load().unwrap().is_empty());
        for i in 0..MAX_FAILURES + 5 {
            log.push("probe", &format!("attempt {i}")).unwrap();
        }
        let got = log.load().unwrap();
        assert_eq!(got.len(), MAX_FAILURES);
        assert_eq!(got[0].why, "attempt 5");
        assert_eq!(
            got.last().unwrap().why,
            format!("attempt {}", MAX_FAILURES + 4)
        );
        assert!(got.windows(2).all(|w| w[0].unix_ms <= w[1].unix_ms));
        log.push("prefill", &"é".repeat(400)).unwrap();
        assert!(log.load().unwrap().last().unwrap().why.len() <= MAX_WHY);

        let path = dir.path().join("failures/prod.toml");
        std::fs::write(&path, "[[failure]]\nsurprise = 1\n").unwrap();
        assert!(log.load().is_err());
        log.push("enroll handoff", "tokens differ").unwrap();
        assert_eq!(log.load().unwrap().len(), 1);
        log.clear().unwrap();
        log.clear().unwrap();
        assert!(log.load().unwrap().is_empty());
        assert!(FailureLog::at(dir.path(), "../x")
            .push("probe", "no")
            .is_err());
    }

    #[test]
    fn the_registry_round_trips_privately_and_refuses_damage() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Registry::load(dir.path()).unwrap(), Registry::default());
        let mut reg = Registry {
            consumer: Some("cons".into()),
            nodes: vec![entry("prod"), entry("prod2")],
        };
        reg.save(dir.path()).unwrap();
        let path = Registry::path(dir.path());
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(Registry::load(dir.path()).unwrap(), reg);
        assert!(reg.remove("prod"));
        assert!(!reg.remove("prod"));
        assert_eq!(reg.get("prod2").unwrap().endpoint().unwrap().port, 4950);

        let twice = Registry {
            consumer: None,
            nodes: vec![entry("a"), entry("a")],
        };
        assert!(twice.save(dir.path()).is_err());
        for bad in [
            "consumer = \"Bad Name\"\n",
            "[[node]]\nname = \"x\"\n",
            "surprise = 1\n",
            "[[node]]\nname = \"x\"\nurl = \"http://h:1\"\ndevice = \"cpu\"\nengine_abi = \"a\"\nmodel_weights = \"b\"\nenrolled_unix = 1\n",
        ] {
            std::fs::write(&path, bad).unwrap();
            assert!(Registry::load(dir.path()).is_err(), "{bad}");
        }
    }
}
