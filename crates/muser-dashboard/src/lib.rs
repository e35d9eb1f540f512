//! muser-dashboard: the web dashboard's static assets, embedded in the binary.
//!
//! Hand-written HTML, CSS and JavaScript with no dependencies, no CDN and no build step: the
//! page reads `/v1/telemetry/stream`, `/v1/sessions`, `/v1/nodes` and streams chat from
//! `/v1/chat/completions`, all same-origin with JSON bodies. The server serves [`INDEX`] at
//! `/` and [`asset`] under `/assets/`.

/// One embedded file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asset {
    pub content_type: &'static str,
    pub body: &'static [u8],
}

/// The page served at `/`.
pub const INDEX: Asset = Asset {
    content_type: "text/html; charset=utf-8",
    body: include_bytes!("../assets/index.html"),
};

const ASSETS: &[(&str, Asset)] = &[
    (
        "app.js",
        Asset {
            content_type: "text/javascript; charset=utf-8",
            body: include_bytes!("../assets/app.js"),
        },
    ),
    (
        "app.css",
        Asset {
            content_type: "text/css; charset=utf-8",
            body: include_bytes!("../assets/app.css"),
        },
    ),
    (
        "icon.svg",
        Asset {
            content_type: "image/svg+xml",
            body: include_bytes!("../assets/icon.svg"),
        },
    ),
];

/// The file `/assets/{name}`, if there is one.
pub fn asset(name: &str) -> Option<Asset> {
    ASSETS.iter().find(|(n, _)| *n == name).map(|(_, a)| *a)
}

/// The Content-Security-Policy of the page: everything from this origin only, no inline
/// script, no framing.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
     form-action 'self'; frame-ancestors 'none'";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_only_embedded_assets() {
        let html = std::str::from_utf8(INDEX.body).unwrap();
        for part in html.split("/assets/").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.')
                .collect();
            assert!(asset(&name).is_some(), "index.html names /assets/{name}");
        }
        assert!(asset("../lib.rs").is_none());
        // nothing loads from elsewhere (an example address in a placeholder is text)
        for attr in [
            "src=\"http",
            "href=\"http",
            "url(http",
            "src='http",
            "href='http",
        ] {
            assert!(!html.contains(attr), "index.html loads {attr}…");
        }
        let js = std::str::from_utf8(asset("app.js").unwrap().body).unwrap();
        assert!(
            !js.contains("innerHTML"),
            "text goes in with textContent only"
        );
        assert!(!js.contains("localStorage"), "the API key stays in memory");
    }
}
