//! The consumer's enrolled nodes: `CONFIG/nodes.toml`, written whole (temporary file, fsync,
//! rename; mode 0600), read with a size bound. A node is recorded only after its enrollment
//! passed every step (`muser node add`), and removed with its certificates revoked.
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
