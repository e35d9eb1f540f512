//! rustls configurations for the lane: TLS 1.3, HTTP/2 by ALPN, certificates checked both
//! ways against the lane's CA and revocation list.
//!
//! The revocation list is live: each handshake looks at its file's metadata (one `stat`), and
//! when the file changed (`muser tls revoke`, or [`crate::Pki::revoke`] from another process)
//! the verifier is rebuilt from it before the peer is checked, so a revoked certificate is
//! refused from the next connection on, by either side, without a restart. A list that no
//! longer reads or parses refuses every peer until it is fixed: revocation never fails open.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::UnixTime;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};

use crate::{ClusterError, NodeCreds};

/// The authenticated name of a connection's peer, in each request's extensions.
#[derive(Clone, Debug)]
pub struct PeerName(pub Arc<str>);

pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(e: impl std::fmt::Display) -> ClusterError {
    ClusterError::Tls(e.to_string())
}

struct Parsed {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
    crls: Vec<CertificateRevocationListDer<'static>>,
}

/// The CA's revocation list: at least one list (the CA always writes one, empty or not), so a
/// damaged file never reads as "nothing revoked".
fn parse_crls(pem: &str) -> Result<Vec<CertificateRevocationListDer<'static>>, ClusterError> {
    let crls = CertificateRevocationListDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(tls_err)?;
    if crls.is_empty() {
        return Err(ClusterError::Tls(
            "the revocation list file holds no list".into(),
        ));
    }
    Ok(crls)
}

fn parse(creds: &NodeCreds) -> Result<Parsed, ClusterError> {
    let certs = |pem: &str| {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(tls_err)
    };
    let chain = certs(&creds.cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(creds.key_pem.as_bytes()).map_err(tls_err)?;
    let mut roots = RootCertStore::empty();
    for ca in certs(&creds.ca_pem)? {
        roots.add(ca).map_err(tls_err)?;
    }
    let crls = parse_crls(&creds.crl_pem)?;
    if chain.is_empty() || roots.is_empty() {
        return Err(ClusterError::Tls(
            "a node needs its certificate and the CA certificate".into(),
        ));
    }
    Ok(Parsed {
        chain,
        key,
        roots: Arc::new(roots),
        crls,
    })
}

/// A producer's configuration: clients must present a certificate of the lane's CA that is
/// in date and not revoked ([`crate::transport::serve`] then checks its name).
pub fn server_config(creds: &NodeCreds) -> Result<Arc<ServerConfig>, ClusterError> {
    let p = parse(creds)?;
    let roots = p.roots.clone();
    let build = move |crls| -> Result<Arc<dyn ClientCertVerifier>, ClusterError> {
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .with_crls(crls)
            .only_check_end_entity_revocation()
            .build()
            .map_err(tls_err)
    };
    let verifier = Arc::new(LiveCrl::new(creds.crl_path.clone(), p.crls, build)?);
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(p.chain, p.key)
        .map_err(tls_err)?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    // every connection proves its certificate again (a resumed session would skip the check
    // against a revocation list that changed since)
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    cfg.send_tls13_tickets = 0;
    Ok(Arc::new(cfg))
}

/// A consumer's configuration: it presents its certificate, and accepts a producer's only
/// from the lane's CA, in date, not revoked and valid for the name it dials.
pub fn client_config(creds: &NodeCreds) -> Result<Arc<ClientConfig>, ClusterError> {
    let p = parse(creds)?;
    let roots = p.roots.clone();
    let build = move |crls| -> Result<Arc<dyn ServerCertVerifier>, ClusterError> {
        let v =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots.clone(), provider())
                .with_crls(crls)
                .only_check_end_entity_revocation()
                .build()
                .map_err(tls_err)?;
        Ok(v)
    };
    let verifier = Arc::new(LiveCrl::new(creds.crl_path.clone(), p.crls, build)?);
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(p.chain, p.key)
        .map_err(tls_err)?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    cfg.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(cfg))
}

/// The first of `names` the (already CA-verified) end-entity certificate is valid for.
pub fn peer_name<'n>(cert: &CertificateDer<'_>, names: &'n [String]) -> Option<&'n str> {
    let ee = webpki::EndEntityCert::try_from(cert).ok()?;
    names.iter().map(String::as_str).find(|n| {
        ServerName::try_from(*n)
            .ok()
            .is_some_and(|sn| ee.verify_is_valid_for_subject_name(&sn).is_ok())
    })
}

/// What tells a revocation list file's versions apart: modification time, length, inode
/// (the CA replaces the file by a rename, so every write is a new inode).
type Stamp = (SystemTime, u64, u64);

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(path).ok()?;
    Some((md.modified().ok()?, md.len(), md.ino()))
}

type Build<V> = dyn Fn(Vec<CertificateRevocationListDer<'static>>) -> Result<Arc<V>, ClusterError>
    + Send
    + Sync;

/// A certificate verifier (client or server side) rebuilt whenever the revocation list file
/// changes. `base` answers what does not depend on the list (signatures, hints).
struct LiveCrl<V: ?Sized> {
    path: Option<PathBuf>,
    build: Box<Build<V>>,
    base: Arc<V>,
    current: Mutex<Loaded<V>>,
}

/// The file version a verifier was built from, and the verifier (or why there is none).
type Loaded<V> = (Option<Stamp>, Result<Arc<V>, String>);

impl<V: ?Sized> std::fmt::Debug for LiveCrl<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveCrl").field("path", &self.path).finish()
    }
}

impl<V: ?Sized> LiveCrl<V> {
    fn new(
        path: Option<PathBuf>,
        crls: Vec<CertificateRevocationListDer<'static>>,
        build: impl Fn(Vec<CertificateRevocationListDer<'static>>) -> Result<Arc<V>, ClusterError>
            + Send
            + Sync
            + 'static,
    ) -> Result<LiveCrl<V>, ClusterError> {
        let base = build(crls)?;
        Ok(LiveCrl {
            path,
            build: Box::new(build),
            // no stamp yet: the first handshake reads the file once
            current: Mutex::new((None, Ok(base.clone()))),
            base,
        })
    }

    /// The verifier for this handshake, rebuilt first when the list's file changed.
    fn current(&self) -> Result<Arc<V>, rustls::Error> {
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(path) = &self.path {
            let now = stamp(path);
            if now.is_none() || now != cur.0 {
                let rebuilt = crate::pki::read_text(path)
                    .and_then(|pem| parse_crls(&pem))
                    .and_then(|crls| (self.build)(crls))
                    .map_err(|e| e.to_string());
                match &rebuilt {
                    Ok(_) if cur.0.is_some() => {
                        tracing::info!(file = %path.display(), "lane: revocation list reloaded")
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(file = %path.display(), error = %e, "lane: revocation list unreadable; refusing every peer")
                    }
                }
                *cur = (now, rebuilt);
            }
        }
        cur.1
            .clone()
            .map_err(|e| rustls::Error::General(format!("revocation list: {e}")))
    }
}

impl ClientCertVerifier for LiveCrl<dyn ClientCertVerifier> {
    fn offer_client_auth(&self) -> bool {
        self.base.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.base.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.base.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current()?
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.base.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.base.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.base.supported_verify_schemes()
    }
}

impl ServerCertVerifier for LiveCrl<dyn ServerCertVerifier> {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.current()?.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.base.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.base.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.base.supported_verify_schemes()
    }
}
