//! The listener: accepts connections (TLS when configured), and serves each with HTTP/1.1
//! under the connection limits of [`crate::limits`]: a bounded number of open connections, a
//! deadline for every request head (which also ends idle keep-alive connections), a cap on
//! its size, and a TLS handshake deadline. Serving ends when `shutdown` resolves or the
//! engine stops; the latter is an error, so the process exits non-zero.

use crate::limits::{
    CONNECTIONS_MAX, HEADER_BYTES_MAX, HEADER_READ_TIMEOUT, TLS_HANDSHAKE_TIMEOUT,
};
use crate::state::SharedState;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
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

/// Serves the router on `listener` until `shutdown` resolves (Ok) or the engine stops (Err).
pub async fn serve(
    state: SharedState,
    listener: TcpListener,
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
        .max_buf_size(HEADER_BYTES_MAX);
    let http = Arc::new(http);
    let engine_stopped = async {
        while state.engine.is_running() {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    tokio::pin!(shutdown, engine_stopped);
    let result = loop {
        let (tcp, _) = tokio::select! {
            () = &mut shutdown => break Ok(()),
            () = &mut engine_stopped => break Err(ServeError::EngineStopped),
            accepted = listener.accept() => match accepted {
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
    drop(listener);
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
    result
}
