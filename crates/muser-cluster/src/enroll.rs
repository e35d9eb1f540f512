//! Enrollment: a new node joins a consumer's lane without anyone copying a secret by hand.
//!
//! The node (`muser up --role producer --enroll`) generates its own key, makes a temporary
//! self-signed certificate with it and prints a one-time code: `mu1-` then the first 16
//! bytes of the certificate's SHA-256 and a 16-byte random secret, in hex. The consumer
//! (`muser node add`) dials the node trusting only the certificate the code pins, so it
//! talks to that node and nobody else; both sides then prove they know the secret with an
//! HMAC-SHA256 over the exchange (each side's label, both nonces, both names, the node's
//! public key and what is being sent), compared in constant time. Only after the
//! consumer's proof does the node accept what its CA signed for the node's key, the CA
//! certificate, the revocation list and the kvpack operator key; the private key never
//! leaves the node. A code works once, for a limited time, and dies after a few wrong proofs.
//!
//! What an enrolled node keeps (`CONFIG/enrolled/NAME/`, mode 0700; keys 0600):
//!
//! ```text
//! node.key node.crt        its key and the certificate the consumer's CA signed for it
//! ca.crt ca.crl            the CA it trusts and its revocation list
//! kv.key                   the kvpack operator key (64 hex digits)
//! consumers                the consumer names it serves, one a line
//! ```

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use rcgen::{CertificateParams, DnType, KeyPair};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, ServerConfig, SignatureScheme};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::pki::{make_dir, read_text, write_file};
use crate::tls::provider;
use crate::{check_name, ClusterError, NodeCreds, Pki};

/// The enrollment protocol's version (both sides must speak the same).
pub const PROTOCOL: u32 = 1;
/// Wrong proofs a code survives; the next one burns it.
pub const MAX_BAD_PROOFS: u32 = 3;
const CODE_PREFIX: &str = "mu1-";
/// Most consumer names an enrolled node keeps.
pub const MAX_CONSUMERS: usize = 64;

/// Who proves: the labels keep a node's proof from passing as a consumer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Node,
    Consumer,
}

impl Side {
    fn label(self) -> &'static [u8] {
        match self {
            Side::Node => b"muser enroll node v1",
            Side::Consumer => b"muser enroll consumer v1",
        }
    }
}

/// A one-time enrollment code: the node certificate's pin and the shared secret.
#[derive(Clone, PartialEq, Eq)]
pub struct EnrollCode {
    pub fingerprint: [u8; 16],
    secret: [u8; 16],
}

impl fmt::Debug for EnrollCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "EnrollCode({}, secret redacted)",
            hex::encode(self.fingerprint)
        )
    }
}

impl EnrollCode {
    /// Parses `mu1-` and 64 hex digits (surrounding white space ignored).
    pub fn parse(text: &str) -> Result<EnrollCode, ClusterError> {
        let bad = || {
            ClusterError::Config(
                "an enrollment code is `mu1-` and 64 hex digits, as `muser up --enroll` prints it"
                    .into(),
            )
        };
        let hex_part = text.trim().strip_prefix(CODE_PREFIX).ok_or_else(bad)?;
        let mut raw = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut raw).map_err(|_| bad())?;
        let mut code = EnrollCode {
            fingerprint: [0; 16],
            secret: [0; 16],
        };
        code.fingerprint.copy_from_slice(&raw[..16]);
        code.secret.copy_from_slice(&raw[16..]);
        raw.fill(0);
        Ok(code)
    }

    /// The code as a user types it.
    pub fn text(&self) -> String {
        format!(
            "{CODE_PREFIX}{}{}",
            hex::encode(self.fingerprint),
            hex::encode(self.secret)
        )
    }

    /// `side`'s proof over `parts` (each length-prefixed, so no two lists collide).
    pub fn prove(&self, side: Side, parts: &[&[u8]]) -> [u8; 32] {
        self.mac(side, parts).finalize().into_bytes().into()
    }

    /// Whether `proof` is `side`'s proof over `parts` (constant-time comparison).
    pub fn verify(&self, side: Side, parts: &[&[u8]], proof: &[u8]) -> bool {
        self.mac(side, parts).verify_slice(proof).is_ok()
    }

    fn mac(&self, side: Side, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret)
            .expect("HMAC takes a key of any length");
        m.update(side.label());
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }
}

/// The pin of a certificate: the first 16 bytes of the SHA-256 of its DER.
pub fn fingerprint(cert_der: &[u8]) -> [u8; 16] {
    let d = Sha256::digest(cert_der);
    let mut out = [0u8; 16];
    out.copy_from_slice(&d[..16]);
    out
}

/// `n` random bytes from the operating system.
pub fn random<const N: usize>() -> Result<[u8; N], ClusterError> {
    let mut out = [0u8; N];
    getrandom::getrandom(&mut out).map_err(|e| ClusterError::Io(format!("random bytes: {e}")))?;
    Ok(out)
}

/// A node waiting to be enrolled: its new key, the temporary certificate the code pins, and
/// the code's state (single use, expiry, wrong proofs).
pub struct Enrollment {
    name: String,
    key: KeyPair,
    cert_der: CertificateDer<'static>,
    code: EnrollCode,
    expires: Instant,
    state: Mutex<CodeState>,
}

#[derive(Default)]
struct CodeState {
    used: bool,
    bad_proofs: u32,
}

impl Enrollment {
    /// A new key and temporary identity for node `name`, and a code valid for `ttl`.
    pub fn new(name: &str, ttl: Duration) -> Result<Enrollment, ClusterError> {
        check_name(name)?;
        let pki = |e: rcgen::Error| ClusterError::Pki(e.to_string());
        let key = KeyPair::generate().map_err(pki)?;
        let mut params = CertificateParams::new(vec![name.to_string()]).map_err(pki)?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} (enrolling)"));
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + time::Duration::days(1);
        let cert = params.self_signed(&key).map_err(pki)?;
        let cert_der = cert.der().clone();
        let code = EnrollCode {
            fingerprint: fingerprint(&cert_der),
            secret: random()?,
        };
        Ok(Enrollment {
            name: name.to_string(),
            key,
            cert_der,
            code,
            expires: Instant::now() + ttl,
            state: Mutex::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The code to show the operator (once: it is the secret).
    pub fn code_text(&self) -> String {
        self.code.text()
    }

    /// The node's public key, an uncompressed P-256 point.
    pub fn public_key(&self) -> &[u8] {
        self.key.public_key_raw()
    }

    /// The TLS configuration of the enrollment listener: the temporary certificate, no
    /// client certificate (the consumer proves itself with the code's secret).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, ClusterError> {
        let tls = |e: rustls::Error| ClusterError::Tls(e.to_string());
        let key = PrivateKeyDer::from_pem_slice(self.key.serialize_pem().as_bytes())
            .map_err(|e| ClusterError::Tls(e.to_string()))?;
        let mut cfg = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .with_no_client_auth()
            .with_single_cert(vec![self.cert_der.clone()], key)
            .map_err(tls)?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CodeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses a code that was used, burned by wrong proofs, or expired.
    pub fn usable(&self) -> Result<(), ClusterError> {
        let st = self.lock();
        if st.used {
            Err(ClusterError::Config(
                "the enrollment code was already used".into(),
            ))
        } else if st.bad_proofs >= MAX_BAD_PROOFS {
            Err(ClusterError::Config(
                "the enrollment code was burned by wrong proofs".into(),
            ))
        } else if Instant::now() >= self.expires {
            Err(ClusterError::Config(
                "the enrollment code expired (start the node with --enroll again)".into(),
            ))
        } else {
            Ok(())
        }
    }

    /// The node's proof over `parts`.
    pub fn prove(&self, parts: &[&[u8]]) -> [u8; 32] {
        self.code.prove(Side::Node, parts)
    }

    /// Checks the consumer's proof over `parts` and, when it holds, spends the code. A wrong
    /// proof counts towards burning it.
    pub fn accept(&self, parts: &[&[u8]], proof: &[u8]) -> Result<(), ClusterError> {
        self.usable()?;
        let mut st = self.lock();
        if !self.code.verify(Side::Consumer, parts, proof) {
            st.bad_proofs += 1;
            return Err(ClusterError::Config(
                "the consumer's proof does not match the enrollment code".into(),
            ));
        }
        st.used = true;
        Ok(())
    }

    /// What the node keeps once the consumer's CA signed `cert_pem` for its key.
    pub fn save(&self, config: &Path, grant: &Grant) -> Result<(), ClusterError> {
        save_enrolled(config, &self.name, &self.key.serialize_pem(), grant)
    }
}

/// What a consumer grants an enrolling node.
pub struct Grant {
    pub cert_pem: String,
    pub ca_pem: String,
    pub crl_pem: String,
    /// The kvpack operator key file's text (64 hex digits).
    pub kv_key_hex: String,
    pub consumers: Vec<String>,
}

/// A consumer's TLS configuration for dialing an enrolling node: it trusts exactly the
/// certificate whose pin the code carries (and checks the handshake's signature by it).
pub fn pinned_client_config(code: &EnrollCode) -> Result<Arc<ClientConfig>, ClusterError> {
    let tls = |e: rustls::Error| ClusterError::Tls(e.to_string());
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Pinned {
            pin: code.fingerprint,
        }))
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

#[derive(Debug)]
struct Pinned {
    pin: [u8; 16],
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if fingerprint(end_entity) == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "the node's certificate is not the one the enrollment code pins (a used or \
                 stale code, or another node)"
                    .into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General(
            "enrollment speaks TLS 1.3 only".into(),
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Serves `router` over HTTP/2 and TLS without client certificates (the enrollment
/// listener) until `until` resolves; the listener stays open for what comes next.
pub async fn serve_open(
    listener: &TcpListener,
    tls: Arc<ServerConfig>,
    router: axum::Router,
    until: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(tls);
    tokio::pin!(until);
    loop {
        let (tcp, addr) = tokio::select! {
            r = listener.accept() => r?,
            () = &mut until => return Ok(()),
        };
        let (acceptor, router) = (acceptor.clone(), router.clone());
        tokio::spawn(async move {
            let accepted =
                tokio::time::timeout(crate::transport::HANDSHAKE_TIMEOUT, acceptor.accept(tcp));
            let stream = match accepted.await {
                Ok(Ok(s)) => s,
                _ => {
                    tracing::warn!(peer = %addr, "enrollment: TLS handshake failed");
                    return;
                }
            };
            let svc = TowerToHyperService::new(router);
            if let Err(e) = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(peer = %addr, error = %e, "enrollment: connection ended");
            }
        });
    }
}

/// Where node `name` keeps what its enrollment granted.
pub fn enrolled_dir(config: &Path, name: &str) -> PathBuf {
    config.join("enrolled").join(name)
}

fn save_enrolled(config: &Path, name: &str, key_pem: &str, g: &Grant) -> Result<(), ClusterError> {
    check_name(name)?;
    if g.consumers.is_empty() || g.consumers.len() > MAX_CONSUMERS {
        return Err(ClusterError::Config(format!(
            "an enrollment names 1 to {MAX_CONSUMERS} consumers"
        )));
    }
    for c in &g.consumers {
        check_name(c)?;
    }
    let dir = enrolled_dir(config, name);
    make_dir(&dir)?;
    write_file(&dir.join("node.key"), key_pem, 0o600)?;
    write_file(&dir.join("kv.key"), &g.kv_key_hex, 0o600)?;
    write_file(&dir.join("ca.crt"), &g.ca_pem, 0o644)?;
    write_file(&dir.join("ca.crl"), &g.crl_pem, 0o644)?;
    let consumers: String = g.consumers.iter().map(|c| format!("{c}\n")).collect();
    write_file(&dir.join("consumers"), &consumers, 0o644)?;
    // last: its presence says the enrollment is complete
    write_file(&dir.join("node.crt"), &g.cert_pem, 0o644)
}

/// What an enrolled node runs with.
pub struct EnrolledNode {
    pub creds: NodeCreds,
    /// The operator key file the enrollment provisioned.
    pub kv_key_file: PathBuf,
    pub consumers: Vec<String>,
}

/// Node `name`'s enrollment, when one completed in `config`.
pub fn load_enrolled(config: &Path, name: &str) -> Result<Option<EnrolledNode>, ClusterError> {
    check_name(name)?;
    let dir = enrolled_dir(config, name);
    if !dir.join("node.crt").exists() {
        return Ok(None);
    }
    let consumers: Vec<String> = read_text(&dir.join("consumers"))?
        .lines()
        .filter(|l| !l.is_empty())
        .take(MAX_CONSUMERS)
        .map(str::to_string)
        .collect();
    for c in &consumers {
        check_name(c)?;
    }
    Ok(Some(EnrolledNode {
        creds: NodeCreds {
            name: name.to_string(),
            cert_pem: read_text(&dir.join("node.crt"))?,
            key_pem: read_text(&dir.join("node.key"))?,
            ca_pem: read_text(&dir.join("ca.crt"))?,
            crl_pem: read_text(&dir.join("ca.crl"))?,
            // the copy enrollment left; reloaded on change like the CA's own
            crl_path: Some(dir.join("ca.crl")),
        },
        kv_key_file: dir.join("kv.key"),
        consumers,
    }))
}

/// Node `name`'s credentials: from its enrollment when it has one, else from the CA
/// directory (`muser tls issue`).
pub fn node_creds(config: &Path, name: &str) -> Result<NodeCreds, ClusterError> {
    match load_enrolled(config, name)? {
        Some(e) => Ok(e.creds),
        None => Pki::at(config).node(name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_code_round_trips_and_proofs_bind_side_and_parts() {
        let e = Enrollment::new("prod", Duration::from_secs(60)).unwrap();
        let code = EnrollCode::parse(&e.code_text()).unwrap();
        assert_eq!(code.fingerprint, fingerprint(&e.cert_der));
        let parts: [&[u8]; 2] = [b"cons", b"nonce"];
        let node = e.prove(&parts);
        assert!(code.verify(Side::Node, &parts, &node));
        assert!(!code.verify(Side::Consumer, &parts, &node));
        assert!(!code.verify(Side::Node, &[b"cons", b"nonc", b"e"], &node));
        assert!(format!("{code:?}").contains("redacted"));
        for bad in ["", "mu1-", "mu2-00", &e.code_text()[..60], "mu1-zz"] {
            assert!(EnrollCode::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_code_is_spent_once_and_burned_by_wrong_proofs() {
        let e = Enrollment::new("prod", Duration::from_secs(60)).unwrap();
        let code = EnrollCode::parse(&e.code_text()).unwrap();
        let parts: [&[u8]; 1] = [b"x"];
        let good = code.prove(Side::Consumer, &parts);
        assert!(e.accept(&parts, &[0u8; 32]).is_err());
        e.accept(&parts, &good).unwrap();
        let again = e.accept(&parts, &good).unwrap_err().to_string();
        assert!(again.contains("already used"), "{again}");

        let e = Enrollment::new("prod", Duration::from_secs(60)).unwrap();
        let code = EnrollCode::parse(&e.code_text()).unwrap();
        for _ in 0..MAX_BAD_PROOFS {
            assert!(e.accept(&parts, &[1u8; 32]).is_err());
        }
        let good = code.prove(Side::Consumer, &parts);
        let burned = e.accept(&parts, &good).unwrap_err().to_string();
        assert!(burned.contains("burned"), "{burned}");

        let e = Enrollment::new("prod", Duration::ZERO).unwrap();
        let expired = e.usable().unwrap_err().to_string();
        assert!(expired.contains("expired"), "{expired}");
    }

    #[test]
    fn an_enrollment_is_kept_with_private_keys() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        assert!(load_enrolled(dir.path(), "prod").unwrap().is_none());
        let e = Enrollment::new("prod", Duration::from_secs(60)).unwrap();
        let pki = Pki::at(dir.path());
        pki.init().unwrap();
        let (ca_pem, crl_pem) = pki.trust().unwrap();
        let key = rcgen::KeyPair::from_pem(&e.key.serialize_pem()).unwrap();
        let (_, cert_pem) = pki
            .sign("prod", &key, time::OffsetDateTime::now_utc(), 1)
            .unwrap();
        let grant = Grant {
            cert_pem,
            ca_pem,
            crl_pem,
            kv_key_hex: "ab".repeat(32),
            consumers: vec!["cons".into()],
        };
        e.save(dir.path(), &grant).unwrap();
        let got = load_enrolled(dir.path(), "prod").unwrap().unwrap();
        assert_eq!(got.consumers, ["cons"]);
        crate::server_config(&got.creds).unwrap();
        for f in ["node.key", "kv.key"] {
            let mode = std::fs::metadata(enrolled_dir(dir.path(), "prod").join(f))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{f}");
        }
        assert_eq!(
            node_creds(dir.path(), "prod").unwrap().cert_pem,
            got.creds.cert_pem
        );
    }
}
