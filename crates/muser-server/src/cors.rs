//! Cross-origin requests from browsers (llama-server's `--cors-*` flags). A preflight
//! (`OPTIONS`) is answered before authentication, as browsers send no credentials with it; an
//! origin the rule does not allow gets no `Access-Control-Allow-Origin`, so the browser keeps
//! the page from sending the request or reading the answer. Without an API key the default
//! allows pages served from this machine only (`localhost`), not any site the user happens to
//! visit: nothing else stands between such a page and the server. With a key any origin is
//! reflected, as llama-server does: a page must then hold the key, and the key is what
//! protects the server (`Origins::default_for`).

use axum::http::{header, HeaderMap, HeaderValue};

/// Which origins may call the server from a browser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origins {
    /// `*`: any origin (echoed back when credentials are allowed, llama-server's default).
    Any,
    /// `localhost`: origins whose host is `localhost`, `127.0.0.1` or `::1`.
    Localhost,
    /// These origins exactly (`scheme://host[:port]`).
    List(Vec<String>),
}

impl Origins {
    /// The origins allowed when `--cors-origins` is not given: any with an API key (the key
    /// guards every route but the public ones, whoever's page sends the request), only this
    /// machine's pages without one.
    pub fn default_for(api_key: bool) -> Origins {
        if api_key {
            Origins::Any
        } else {
            Origins::Localhost
        }
    }

    /// `--cors-origins`: `*`, `localhost`, or a comma-separated list of origins.
    pub fn parse(spec: &str) -> Result<Origins, String> {
        match spec.trim() {
            "*" => Ok(Origins::Any),
            "localhost" => Ok(Origins::Localhost),
            list => {
                let origins: Vec<String> = list
                    .split(',')
                    .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
                    .filter(|o| !o.is_empty())
                    .collect();
                match origins.iter().find(|o| url_host(o).is_none()) {
                    Some(bad) => Err(format!(
                        "--cors-origins: `{bad}` is not an origin (scheme://host[:port]), `*` or `localhost`"
                    )),
                    None if origins.is_empty() => Err("--cors-origins is empty".into()),
                    None => Ok(Origins::List(origins)),
                }
            }
        }
    }
}

/// The CORS answer of one server.
#[derive(Debug, Clone)]
pub struct Cors {
    pub origins: Origins,
    /// `Access-Control-Allow-Methods` of a preflight.
    pub methods: String,
    /// `Access-Control-Allow-Headers` of a preflight.
    pub headers: String,
    pub credentials: bool,
}

impl Default for Cors {
    fn default() -> Self {
        Cors {
            origins: Origins::Localhost,
            methods: "GET, POST, DELETE, OPTIONS".into(),
            headers: "*".into(),
            credentials: true,
        }
    }
}

impl Cors {
    /// The `Access-Control-Allow-Origin` for a request's `Origin`, if it is allowed.
    pub fn allow_origin(&self, origin: Option<&str>) -> Option<String> {
        let origin = origin?;
        let allowed = match &self.origins {
            Origins::Any if !self.credentials => return Some("*".into()),
            Origins::Any => true,
            Origins::Localhost => {
                url_host(origin).is_some_and(|h| ["localhost", "127.0.0.1", "::1"].contains(&h))
            }
            Origins::List(list) => list.iter().any(|o| o.eq_ignore_ascii_case(origin)),
        };
        allowed.then(|| origin.to_string())
    }

    /// Adds the headers a response to a request from `origin` carries: the allowed origin, and for a
    /// preflight the methods, headers and credentials.
    pub fn apply(&self, origin: Option<&HeaderValue>, preflight: bool, response: &mut HeaderMap) {
        let Some(allowed) = self.allow_origin(origin.and_then(|v| v.to_str().ok())) else {
            return;
        };
        let mut set = |name: header::HeaderName, value: &str| {
            if let Ok(v) = HeaderValue::from_str(value) {
                response.insert(name, v);
            }
        };
        set(header::ACCESS_CONTROL_ALLOW_ORIGIN, &allowed);
        set(header::VARY, "Origin");
        if preflight {
            set(
                header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
                if self.credentials { "true" } else { "false" },
            );
            set(header::ACCESS_CONTROL_ALLOW_METHODS, &self.methods);
            set(header::ACCESS_CONTROL_ALLOW_HEADERS, &self.headers);
        }
    }
}

/// The host of `scheme://host[:port][/...]` (IPv6 without brackets), or `None` when the text
/// is not such a URL.
fn url_host(url: &str) -> Option<&str> {
    let (_, rest) = url.split_once("://")?;
    let authority = rest.split('/').next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split_once(']')?.0,
        None => authority.split(':').next().unwrap_or(""),
    };
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn localhost_rule_matches_only_loopback_hosts() {
        let cors = Cors::default();
        for ok in [
            "http://localhost",
            "http://localhost:8080",
            "http://127.0.0.1",
            "http://127.0.0.1:3000",
            "http://[::1]",
            "http://[::1]:3000",
        ] {
            assert_eq!(cors.allow_origin(Some(ok)).as_deref(), Some(ok));
        }
        for bad in [
            "http://web.mydomain.fr",
            "http://evil.com",
            "http://notlocalhost",
            "http://localhost.evil.com",
            "localhost",
            "http://[::1",
            "",
        ] {
            assert_eq!(cors.allow_origin(Some(bad)), None, "{bad}");
        }
        assert_eq!(cors.allow_origin(None), None);
    }

    #[test]
    fn any_and_lists() {
        let any = Cors {
            origins: Origins::parse("*").unwrap(),
            ..Cors::default()
        };
        assert_eq!(
            any.allow_origin(Some("web.mydomain.fr")).as_deref(),
            Some("web.mydomain.fr")
        );
        let star = Cors {
            credentials: false,
            ..any
        };
        assert_eq!(
            star.allow_origin(Some("http://x.org")).as_deref(),
            Some("*")
        );
        let list = Cors {
            origins: Origins::parse("https://a.example, http://b.example:8080/").unwrap(),
            ..Cors::default()
        };
        assert!(list.allow_origin(Some("https://a.example")).is_some());
        assert!(list.allow_origin(Some("http://b.example:8080")).is_some());
        assert!(list.allow_origin(Some("http://a.example")).is_none());
        assert!(Origins::parse("a.example").is_err());
        assert!(Origins::parse(" , ").is_err());
    }

    #[test]
    fn preflight_headers() {
        let origin = HeaderValue::from_static("http://localhost:5173");
        let mut res = HeaderMap::new();
        Cors::default().apply(Some(&origin), true, &mut res);
        assert_eq!(
            res[header::ACCESS_CONTROL_ALLOW_ORIGIN],
            "http://localhost:5173"
        );
        assert_eq!(res[header::ACCESS_CONTROL_ALLOW_CREDENTIALS], "true");
        assert_eq!(
            res[header::ACCESS_CONTROL_ALLOW_METHODS],
            "GET, POST, DELETE, OPTIONS"
        );
        assert_eq!(res[header::ACCESS_CONTROL_ALLOW_HEADERS], "*");
        let mut res = HeaderMap::new();
        let evil = HeaderValue::from_static("http://evil.com");
        Cors::default().apply(Some(&evil), true, &mut res);
        assert!(res.is_empty());
    }
}
