//! The lane's PKI and transport on loopback: an enrolled peer gets an answer; a wrong CA,
//! an expired or revoked certificate, an unenrolled name and a producer presenting another
//! name are refused before any request is served, both ways; a revocation reaches running
//! producers and consumers at their next handshake, and a damaged revocation list refuses
//! everyone.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use muser_cluster::transport::next_chunk;
use muser_cluster::*;
use time::OffsetDateTime;

fn ca(dir: &std::path::Path) -> Pki {
    let pki = Pki::at(dir);
    pki.init().unwrap();
    pki
}

fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc() - time::Duration::minutes(1)
}

/// Starts a producer named `name` from `pki` serving `/ping` to `enrolled`.
async fn producer(pki: &Pki, name: &str, enrolled: &[&str]) -> u16 {
    let creds = pki.node(name).unwrap();
    let cfg = server_config(&creds).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let router = axum::Router::new().route(
        "/ping",
        axum::routing::post(|axum::Extension(p): axum::Extension<PeerName>| async move {
            format!("pong {}", p.0)
        }),
    );
    let enrolled: Arc<[String]> = enrolled.iter().map(|s| s.to_string()).collect();
    tokio::spawn(serve(
        listener,
        cfg,
        enrolled,
        router,
        std::future::pending(),
    ));
    port
}

async fn ping(pki: &Pki, me: &str, producer: &str, port: u16) -> Result<String, String> {
    let client = LaneClient::new(client_config(&pki.node(me).unwrap()).unwrap());
    ping_with(&client, producer, port).await
}

async fn ping_with(client: &LaneClient, producer: &str, port: u16) -> Result<String, String> {
    let ep = Endpoint::parse(&format!("{producer}=https://127.0.0.1:{port}")).unwrap();
    let req = hyper::Request::post("/ping")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let mut resp = client
        .send(&ep, req, Duration::from_secs(5))
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    while let Some(c) = next_chunk(resp.body_mut()).await {
        out.extend_from_slice(&c.map_err(|e| e.to_string())?);
    }
    Ok(String::from_utf8(out).unwrap())
}

#[tokio::test]
async fn enrolled_peers_talk_and_every_other_certificate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = ca(dir.path());
    for n in ["prod", "cons", "stranger", "late", "gone"] {
        pki.issue(n, now(), 30).unwrap();
    }
    // an expired certificate
    pki.issue("old", now() - time::Duration::days(10), 2)
        .unwrap();
    let port = producer(&pki, "prod", &["cons", "old", "late", "gone"]).await;
    assert_eq!(ping(&pki, "cons", "prod", port).await.unwrap(), "pong cons");

    // a name the producer did not enroll
    assert!(ping(&pki, "stranger", "prod", port).await.is_err());
    // an expired certificate
    assert!(ping(&pki, "old", "prod", port).await.is_err());
    // the consumer dials a name the producer's certificate does not carry
    assert!(ping(&pki, "cons", "late", port).await.is_err());

    // a certificate of another CA with an enrolled name, both ways: a foreign consumer is
    // refused by the producer, a foreign producer by the consumer
    let other = tempfile::tempdir().unwrap();
    let pki2 = ca(other.path());
    pki2.issue("cons", now(), 30).unwrap();
    pki2.issue("prod", now(), 30).unwrap();
    assert!(ping(&pki2, "cons", "prod", port).await.is_err());
    let foreign = producer(&pki2, "prod", &["cons"]).await;
    assert_eq!(
        ping(&pki2, "cons", "prod", foreign).await.unwrap(),
        "pong cons"
    );
    assert!(ping(&pki, "cons", "prod", foreign).await.is_err());

    // revocation: a producer started after the revoke refuses the revoked consumer
    assert_eq!(pki.revoke("gone").unwrap(), 1);
    let port2 = producer(&pki, "prod", &["cons", "gone"]).await;
    assert!(ping(&pki, "gone", "prod", port2).await.is_err());
    assert_eq!(
        ping(&pki, "cons", "prod", port2).await.unwrap(),
        "pong cons"
    );
    // and a consumer refuses a revoked producer
    pki.revoke("prod").unwrap();
    assert!(ping(&pki, "cons", "prod", port2).await.is_err());
}

#[tokio::test]
async fn a_revocation_takes_effect_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let pki = ca(dir.path());
    for n in ["prod", "cons", "gone"] {
        pki.issue(n, now(), 30).unwrap();
    }
    // both sides configured before the revocations
    let port = producer(&pki, "prod", &["cons", "gone"]).await;
    let cons = LaneClient::new(client_config(&pki.node("cons").unwrap()).unwrap());
    let gone = LaneClient::new(client_config(&pki.node("gone").unwrap()).unwrap());
    assert_eq!(ping_with(&gone, "prod", port).await.unwrap(), "pong gone");
    assert_eq!(ping_with(&cons, "prod", port).await.unwrap(), "pong cons");

    // the running producer refuses a consumer revoked after it started
    pki.revoke("gone").unwrap();
    assert!(ping_with(&gone, "prod", port).await.is_err());
    assert_eq!(ping_with(&cons, "prod", port).await.unwrap(), "pong cons");

    // the running consumer refuses a producer revoked after it was configured
    pki.revoke("prod").unwrap();
    assert!(ping_with(&cons, "prod", port).await.is_err());

    // a revocation list that no longer parses refuses every peer (never fails open)
    for n in ["p2", "c2"] {
        pki.issue(n, now(), 30).unwrap();
    }
    let port2 = producer(&pki, "p2", &["c2"]).await;
    let c2 = LaneClient::new(client_config(&pki.node("c2").unwrap()).unwrap());
    assert_eq!(ping_with(&c2, "p2", port2).await.unwrap(), "pong c2");
    std::fs::write(pki.crl_path(), "not a list").unwrap();
    assert!(ping_with(&c2, "p2", port2).await.is_err());
}

#[test]
fn ca_files_are_private_and_names_are_checked() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let pki = ca(dir.path());
    assert!(pki.init().is_err(), "init never overwrites a CA");
    pki.issue("node-1", now(), 1).unwrap();
    let mode = |p: &str| {
        std::fs::metadata(pki.dir().join(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode("ca.key"), 0o600);
    assert_eq!(mode("nodes/node-1.key"), 0o600);
    assert_eq!(mode(""), 0o700);
    for bad in ["", "Node", "a/b", "-x", "x-", "a.b", &"a".repeat(64)] {
        assert!(pki.issue(bad, now(), 1).is_err(), "{bad:?}");
    }
    assert!(pki.revoke("nobody").is_err());
    assert!(Endpoint::parse("p=http://127.0.0.1:1").is_err());
    assert!(Endpoint::parse("p=https://127.0.0.1").is_err());
    assert_eq!(
        Endpoint::parse("p1=https://[::1]:8443/")
            .unwrap()
            .to_string(),
        "p1=https://[::1]:8443"
    );
}
