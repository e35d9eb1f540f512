//! The listener: accepts connections (TLS when configured), and serves each with HTTP/1.1
//! under the connection limits of [`crate::limits`]: a bounded number of open connections, a
//! deadline for every request head (which also ends idle keep-alive connections), a cap on
//! its size, a TLS handshake deadline, and a deadline on every write the client does not
//! drain (a client that stops reading is dropped). Serving ends when `shutdown` resolves or the
//! engine stops; the latter is an error, so the process exits non-zero.

use crate::limits::{
    CONNECTIONS_MAX, HEADER_BYTES_MAX, HEADER_READ_TIMEOUT, TLS_HANDSHAKE_TIMEOUT,
    WRITE_STALL_TIMEOUT,
};
use crate::state::SharedState;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Sleep;
use tokio_rustls::TlsAcceptor;

/// How long running requests get to finish after shutdown begins.
const DRAIN: Duration = Duration::from_secs(10);

/// A rustls server configuration from PEM files: a certificate chain (leaf first) and its
/// private key (PKCS#8, PKCS#1 or SEC1). Standard PEM, so any CA's certificates work.
pub fn tls_config(cert_pem: &Path, key_pem: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert_pem)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("--tls-cert {}: {e}", cert_pem.display()))?;
    if certs.is_empty() {
        return Err(format!("--tls-cert {}: no certificate", cert_pem.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key_pem)
        .map_err(|e| format!("--tls-key {}: {e}", key_pem.display()))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| format!("--tls-cert/--tls-key: {e}"))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Raises the soft open-file limit to the hard one, so [`CONNECTIONS_MAX`] connections fit.
pub fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit read and write the plain struct passed to them.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the engine stopped; the server exits so that a supervisor can restart it")]
    EngineStopped,
}

/// Serves the router on every one of `listeners` (llama-server's `--host A,B`: one server on
/// several addresses, one connection cap) until `shutdown` resolves (Ok) or the engine stops
/// (Err).
pub async fn serve(
    state: SharedState,
    listeners: Vec<TcpListener>,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let app = crate::routes::router(state.clone());
    let tls = tls.map(TlsAcceptor::from);
    let open = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(HEADER_BYTES_MAX)
        // `Content-Type`, `Access-Control-Allow-Origin`: header names as llama-server (and
        // most servers) write them, for clients that match them case-sensitively
        .title_case_headers(true);
    let http = Arc::new(http);
    let engine_stopped = async {
        while state.engine.is_running() {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    tokio::pin!(shutdown, engine_stopped);
    if listeners.is_empty() {
        return Ok(()); // nothing to accept on
    }
    let result = loop {
        let accepted = futures::future::select_all(listeners.iter().map(|l| Box::pin(l.accept())));
        let (tcp, _) = tokio::select! {
            () = &mut shutdown => break Ok(()),
            () = &mut engine_stopped => break Err(ServeError::EngineStopped),
            (accepted, _, _) = accepted => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // out of descriptors or a connection reset while queued: pause, go on
                    tracing::warn!(error = %e, "accept");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            continue; // over the limit: closed at once
        };
        let _ = tcp.set_nodelay(true);
        let tcp = WriteDeadline::new(tcp);
        let (app, http, tls) = (app.clone(), http.clone(), tls.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let service = TowerToHyperService::new(app);
            match tls {
                None => {
                    let conn = http.serve_connection(TokioIo::new(tcp), service);
                    let _ = watcher.watch(conn).await;
                }
                Some(acceptor) => {
                    let Ok(Ok(stream)) =
                        tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
                    else {
                        return;
                    };
                    let conn = http.serve_connection(TokioIo::new(stream), service);
                    let _ = watcher.watch(conn).await;
                }
            }
            drop(permit);
        });
    };
    drop(listeners);
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
    result
}

/// A connection whose writes must make progress: a write the peer leaves blocked for
/// [`WRITE_STALL_TIMEOUT`] fails, which ends the connection (and, through the dropped
/// response, any generation behind it).
struct WriteDeadline<T> {
    io: T,
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteDeadline<T> {
    fn new(io: T) -> Self {
        WriteDeadline { io, stalled: None }
    }

    /// Passes a finished write through; arms (or checks) the deadline of a blocked one.
    fn watch<R>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<std::io::Result<R>>,
    ) -> Poll<std::io::Result<R>> {
        if r.is_ready() {
            self.stalled = None;
            return r;
        }
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(WRITE_STALL_TIMEOUT)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client stopped reading",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, r)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, r)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that stops reading fails the write after the deadline; one that reads in time
    /// never does.
    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_does_not_drain_fails_at_the_deadline() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut conn = WriteDeadline::new(ours);
        conn.write_all(&[1; 64]).await.unwrap();
        let t0 = tokio::time::Instant::now();
        let err = conn.write_all(&[2; 64]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(t0.elapsed() >= WRITE_STALL_TIMEOUT);

        let (ours, mut theirs2) = tokio::io::duplex(64);
        let mut conn = WriteDeadline::new(ours);
        let reader = tokio::spawn(async move {
            let mut buf = vec![0; 4096];
            let mut n = 0;
            while n < 4096 {
                tokio::time::sleep(WRITE_STALL_TIMEOUT / 2).await;
                n += theirs2.read(&mut buf).await.unwrap();
            }
        });
        conn.write_all(&[3; 4096]).await.unwrap();
        reader.await.unwrap();
        let _ = theirs.read(&mut [0; 8]).await;
    }
}
