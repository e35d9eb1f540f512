//! API-key checks and the bind policy.

use crate::error::ApiError;
use std::net::IpAddr;

/// Bearer-token check: `expected` is the configured key; `header` the raw Authorization value.
pub fn check_bearer(expected: &str, header: Option<&str>) -> Result<(), ApiError> {
    let given = header
        .and_then(|h| {
            h.strip_prefix("Bearer ")
                .or_else(|| h.strip_prefix("bearer "))
        })
        .map(str::trim)
        .unwrap_or("");
    check_key(expected, given)
}

/// A bare key check: Anthropic clients send the key as `x-api-key: KEY`.
pub fn check_key(expected: &str, given: &str) -> Result<(), ApiError> {
    if constant_time_eq(expected.as_bytes(), given.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

/// Compares two byte strings in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0xff);
        diff |= u64::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

/// Whether a `Host` header (name or address, with or without a port) names this server.
pub fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let host = host.trim().to_ascii_lowercase();
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host.as_str(), |(h, _)| h),
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    allowed.iter().any(|a| a == name)
}

/// The API key: from a file (its first line), else `key` as given (`--api-key` or
/// `MUSER_API_KEY`).
pub fn load_api_key(
    file: Option<&std::path::Path>,
    key: Option<String>,
) -> Result<Option<String>, String> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--api-key-file {}: {e}", path.display()))?;
        let key = text.lines().next().unwrap_or("").trim().to_string();
        return Ok(Some(key));
    }
    Ok(key)
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BindError {
    #[error("refusing to listen on {0} without an API key and TLS: anyone on the network could use this server or read its traffic. Give --api-key-file (or MUSER_API_KEY) and --tls-cert/--tls-key, bind 127.0.0.1, or add --insecure-public")]
    InsecureBind(IpAddr),
    #[error("the API key must be 16 to 4096 visible characters")]
    BadKey,
}

/// A non-loopback bind needs an API key and TLS unless the operator forces it; a key is
/// 16..=4096 visible ASCII characters.
pub fn check_bind(
    host: IpAddr,
    api_key: Option<&str>,
    tls: bool,
    insecure_public: bool,
) -> Result<(), BindError> {
    if let Some(key) = api_key {
        let visible = key.bytes().all(|b| b.is_ascii_graphic());
        if !(16..=4096).contains(&key.len()) || !visible {
            return Err(BindError::BadKey);
        }
    }
    if host.is_loopback() || insecure_public || (api_key.is_some() && tls) {
        Ok(())
    } else {
        Err(BindError::InsecureBind(host))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_checks() {
        assert!(check_bearer("k3y", Some("Bearer k3y")).is_ok());
        assert!(check_bearer("k3y", Some("Bearer k3z")).is_err());
        assert!(check_bearer("k3y", Some("Bearer k3")).is_err());
        assert!(check_bearer("k3y", Some("k3y")).is_err());
        assert!(check_bearer("k3y", None).is_err());
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"a", b""));
    }

    #[test]
    fn bind_policy() {
        let lan: IpAddr = "0.0.0.0".parse().unwrap();
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let key = Some("0123456789abcdef");
        assert!(check_bind(lo, None, false, false).is_ok());
        assert_eq!(
            check_bind(lan, None, false, false),
            Err(BindError::InsecureBind(lan))
        );
        assert_eq!(
            check_bind(lan, key, false, false),
            Err(BindError::InsecureBind(lan))
        );
        assert_eq!(
            check_bind(lan, None, true, false),
            Err(BindError::InsecureBind(lan))
        );
        assert!(check_bind(lan, key, true, false).is_ok());
        assert!(check_bind(lan, None, false, true).is_ok());
        assert_eq!(
            check_bind(lo, Some("has space in the key"), false, false),
            Err(BindError::BadKey)
        );
        assert_eq!(
            check_bind(lo, Some("short"), false, false),
            Err(BindError::BadKey)
        );
        assert!(check_bind("::1".parse().unwrap(), None, false, false).is_ok());
    }

    #[test]
    fn hosts() {
        let allowed: Vec<String> = ["localhost", "127.0.0.1", "::1", "box.lan"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        for ok in [
            "localhost",
            "LOCALHOST:4949",
            "127.0.0.1:80",
            "[::1]:4949",
            "[::1]",
            "box.lan.",
            "box.lan:1",
        ] {
            assert!(host_allowed(ok, &allowed), "{ok}");
        }
        for bad in [
            "evil.com",
            "localhost.evil.com",
            "127.0.0.2",
            "[::2]:1",
            "",
            "box.lan.evil:80",
        ] {
            assert!(!host_allowed(bad, &allowed), "{bad}");
        }
    }

    #[test]
    fn key_sources() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("key");
        std::fs::write(&f, "from-the-file-0123\nignored\n").unwrap();
        let got = load_api_key(Some(&f), Some("arg".into())).unwrap();
        assert_eq!(got.as_deref(), Some("from-the-file-0123"));
        assert_eq!(
            load_api_key(None, Some("arg".into())).unwrap().as_deref(),
            Some("arg")
        );
        assert!(load_api_key(Some(&dir.path().join("missing")), None).is_err());
    }
}
