//! HTTP/2 over the lane's mutual TLS: [`serve`] on a producer, [`LaneClient`] on a consumer.
//! No framing of our own: requests and answers are plain HTTP/2 messages, and a pack is an
//! answer's body, read chunk by chunk as it arrives.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::tls::{peer_name, PeerName};
use crate::{check_name, ClusterError};

/// Longest TLS handshake a producer waits for.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// HTTP/2 flow control of the lane, both sides: a pack is tens of MB to GB moved as one
/// answer, so the receive windows cover several milliseconds of a fast link (the protocol's
/// 64 KiB default stalls the sender every few frames), and frames are large enough that
/// their headers cost nothing. Memory stays bounded: at most a window per stream is
/// buffered unread.
pub const STREAM_WINDOW_BYTES: u32 = 16 << 20;
pub const CONNECTION_WINDOW_BYTES: u32 = 32 << 20;
pub const MAX_FRAME_BYTES: u32 = 1 << 20;
/// A producer buffers at most this much of an answer ahead of the consumer's window.
pub const SEND_BUFFER_BYTES: usize = 8 << 20;

/// A producer as a consumer names it: `NAME=https://HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub name: String,
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    pub fn parse(spec: &str) -> Result<Endpoint, ClusterError> {
        let bad = || {
            ClusterError::Config(format!(
                "`{spec}` is not NAME=https://HOST:PORT (NAME the producer's certificate name)"
            ))
        };
        let (name, url) = spec.split_once('=').ok_or_else(bad)?;
        check_name(name)?;
        let rest = url.strip_prefix("https://").ok_or_else(bad)?;
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.contains('/') {
            return Err(bad());
        }
        Ok(Endpoint {
            name: name.to_string(),
            host: host.to_string(),
            port: port.parse().map_err(|_| bad())?,
        })
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "{}=https://[{}]:{}", self.name, self.host, self.port)
        } else {
            write!(f, "{}=https://{}:{}", self.name, self.host, self.port)
        }
    }
}

/// Serves `router` over HTTP/2 to peers whose certificate passes `tls` and is valid for one
/// of `enrolled`, until `shutdown` resolves. Each request carries the peer's [`PeerName`].
/// A peer that fails the handshake or is not enrolled is dropped before any request is read.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    enrolled: Arc<[String]>,
    router: axum::Router,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(tls);
    tokio::pin!(shutdown);
    loop {
        let (tcp, addr) = tokio::select! {
            r = listener.accept() => r?,
            () = &mut shutdown => return Ok(()),
        };
        let (acceptor, enrolled, router) = (acceptor.clone(), enrolled.clone(), router.clone());
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::warn!(peer = %addr, error = %e, "lane: TLS handshake refused");
                    return;
                }
                Err(_) => {
                    tracing::warn!(peer = %addr, "lane: TLS handshake timed out");
                    return;
                }
            };
            let name = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|c| peer_name(c, &enrolled))
                .map(Arc::<str>::from);
            let Some(name) = name else {
                tracing::warn!(peer = %addr, "lane: refused a certificate whose name is not enrolled");
                return;
            };
            let svc = TowerToHyperService::new(router.layer(axum::Extension(PeerName(name))));
            if let Err(e) = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .initial_stream_window_size(STREAM_WINDOW_BYTES)
                .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
                .max_frame_size(MAX_FRAME_BYTES)
                .max_send_buf_size(SEND_BUFFER_BYTES)
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(peer = %addr, error = %e, "lane: connection ended");
            }
        });
    }
}

/// A consumer's side of the lane: one HTTP/2 connection per request, to a producer
/// authenticated under its configured name.
#[derive(Clone)]
pub struct LaneClient {
    connector: TlsConnector,
}

impl LaneClient {
    pub fn new(tls: Arc<ClientConfig>) -> LaneClient {
        LaneClient {
            connector: TlsConnector::from(tls),
        }
    }

    /// Sends `req` (its URI a path) to `ep`; returns the answer once its head arrived, within
    /// `timeout` (connect, handshake and head together). The body streams afterwards.
    pub async fn send(
        &self,
        ep: &Endpoint,
        req: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, ClusterError> {
        let ms = timeout.as_millis() as u64;
        tokio::time::timeout(timeout, self.send_inner(ep, req))
            .await
            .map_err(|_| ClusterError::Timeout {
                name: ep.name.clone(),
                ms,
            })?
    }

    async fn send_inner(
        &self,
        ep: &Endpoint,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, ClusterError> {
        let net = |what: &str, e: &dyn std::fmt::Display| {
            ClusterError::Http(format!("producer `{}` ({ep}): {what}: {e}", ep.name))
        };
        let tcp = TcpStream::connect((ep.host.as_str(), ep.port))
            .await
            .map_err(|e| net("connect", &e))?;
        let _ = tcp.set_nodelay(true);
        let server = ServerName::try_from(ep.name.clone()).map_err(|e| net("name", &e))?;
        let tls = self
            .connector
            .connect(server, tcp)
            .await
            .map_err(|e| net("TLS", &e))?;
        let (mut sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(STREAM_WINDOW_BYTES)
            .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
            .max_frame_size(MAX_FRAME_BYTES)
            .max_send_buf_size(SEND_BUFFER_BYTES)
            .handshake(TokioIo::new(tls))
            .await
            .map_err(|e| net("HTTP/2", &e))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "lane: producer connection ended");
            }
        });
        let uri = format!("https://{}:{}{}", ep.name, ep.port, req.uri().path());
        *req.uri_mut() = uri.parse().map_err(|e| net("uri", &e))?;
        sender
            .send_request(req)
            .await
            .map_err(|e| net("request", &e))
    }
}

/// The next data chunk of a streaming body; `None` at its end.
pub async fn next_chunk(body: &mut Incoming) -> Option<Result<Bytes, ClusterError>> {
    loop {
        match body.frame().await? {
            Ok(f) => match f.into_data() {
                Ok(d) => return Some(Ok(d)),
                Err(_) => continue, // trailers
            },
            Err(e) => return Some(Err(ClusterError::Http(format!("body: {e}")))),
        }
    }
}
