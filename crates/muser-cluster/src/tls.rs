//! rustls configurations for the lane: TLS 1.3, HTTP/2 by ALPN, certificates checked both
//! ways against the lane's CA and revocation list.

use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

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
    let crls = CertificateRevocationListDer::pem_slice_iter(creds.crl_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(tls_err)?;
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
    let verifier = WebPkiClientVerifier::builder_with_provider(p.roots, provider())
        .with_crls(p.crls)
        .only_check_end_entity_revocation()
        .build()
        .map_err(tls_err)?;
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(p.chain, p.key)
        .map_err(tls_err)?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// A consumer's configuration: it presents its certificate, and accepts a producer's only
/// from the lane's CA, in date, not revoked and valid for the name it dials.
pub fn client_config(creds: &NodeCreds) -> Result<Arc<ClientConfig>, ClusterError> {
    let p = parse(creds)?;
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(p.roots, provider())
        .with_crls(p.crls)
        .only_check_end_entity_revocation()
        .build()
        .map_err(tls_err)?;
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_webpki_verifier(verifier)
        .with_client_auth_cert(p.chain, p.key)
        .map_err(tls_err)?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
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
