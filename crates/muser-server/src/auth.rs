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

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BindError {
    #[error("refusing to listen on {0} without --api-key: anyone on the network could use this server. Pass --api-key KEY, bind 127.0.0.1, or add --force-insecure")]
    InsecureBind(IpAddr),
    #[error("--api-key must be 1 to 4096 visible characters")]
    BadKey,
}

/// A non-loopback bind needs an API key unless the operator forces it.
pub fn check_bind(
    host: IpAddr,
    api_key: Option<&str>,
    force_insecure: bool,
) -> Result<(), BindError> {
    if let Some(key) = api_key {
        let visible = key.bytes().all(|b| b.is_ascii_graphic());
        if key.is_empty() || key.len() > 4096 || !visible {
            return Err(BindError::BadKey);
        }
        return Ok(());
    }
    if host.is_loopback() || force_insecure {
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
        assert!(check_bind(lo, None, false).is_ok());
        assert_eq!(
            check_bind(lan, None, false),
            Err(BindError::InsecureBind(lan))
        );
        assert!(check_bind(lan, None, true).is_ok());
        assert!(check_bind(lan, Some("secret"), false).is_ok());
        assert_eq!(
            check_bind(lo, Some("has space"), false),
            Err(BindError::BadKey)
        );
        assert!(check_bind("::1".parse().unwrap(), None, false).is_ok());
    }
}
