//! The lane's certificate authority: `muser tls init | issue | revoke`.
//!
//! Everything lives in one directory (`CONFIG/tls`, mode 0700):
//!
//! ```text
//! ca.crt  ca.key            the CA (key 0600), ECDSA P-256
//! issued                    one line per issued certificate: serial and node name
//! revoked                   serials revoked, one a line
//! ca.crl                    the CA's signed revocation list, rewritten on every revoke
//! nodes/NAME.crt NAME.key   a node's certificate (server and client use, DNS name NAME)
//! ```
//!
//! A node name is its identity on the lane: producers check a consumer's certificate is valid
//! for a name they enrolled, consumers connect to a producer by the name they configured.

use std::io::Write;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyIdMethod, KeyPair, KeyUsagePurpose, RevocationReason,
    RevokedCertParams, SerialNumber,
};
use time::{Duration, OffsetDateTime};

use crate::ClusterError;

/// Longest node name (one DNS label).
pub const MAX_NAME_LEN: usize = 63;
/// Most certificates one CA issues (bounds the files read at start-up).
pub const MAX_ISSUED: usize = 100_000;
const CA_NAME: &str = "muser lane CA";

/// A node name: a DNS label of lowercase letters, digits and inner hyphens.
pub fn check_name(name: &str) -> Result<(), ClusterError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(ClusterError::Name(name.to_string()))
    }
}

/// The default configuration directory: `$MUSER_CONFIG_DIR`, else `$XDG_CONFIG_HOME/muser`,
/// else `$HOME/.config/muser`.
pub fn default_config_dir() -> Result<PathBuf, ClusterError> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("MUSER_CONFIG_DIR")
        .or_else(|| var("XDG_CONFIG_HOME").map(|d| d.join("muser")))
        .or_else(|| var("HOME").map(|d| d.join(".config/muser")))
        .ok_or_else(|| ClusterError::Config("set MUSER_CONFIG_DIR or HOME".into()))
}

/// The CA directory under a configuration directory.
pub struct Pki {
    dir: PathBuf,
}

/// What a node presents and trusts: its certificate and key, the CA, the revocation list
/// (PEM text each), and the file the revocation list is read again from when it changes.
#[derive(Clone)]
pub struct NodeCreds {
    pub name: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
    pub crl_pem: String,
    /// `None`: the list is fixed for the life of the configuration.
    pub crl_path: Option<PathBuf>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ClusterError + '_ {
    move |e| ClusterError::Io(format!("{}: {e}", path.display()))
}

fn pki_err(e: rcgen::Error) -> ClusterError {
    ClusterError::Pki(e.to_string())
}

/// Reads a small text file (bounded: the files here are certificates and short lists).
pub(crate) fn read_text(path: &Path) -> Result<String, ClusterError> {
    let md = std::fs::metadata(path).map_err(io(path))?;
    if md.len() > 16 << 20 {
        return Err(ClusterError::Pki(format!(
            "{} is too large",
            path.display()
        )));
    }
    std::fs::read_to_string(path).map_err(io(path))
}

/// Writes `text` atomically with `mode` (temporary file, fsync, rename).
pub(crate) fn write_file(path: &Path, text: &str, mode: u32) -> Result<(), ClusterError> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(text.as_bytes()).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

pub(crate) fn make_dir(path: &Path) -> Result<(), ClusterError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(io(path))
}

impl Pki {
    /// The CA directory of configuration directory `config`.
    pub fn at(config: &Path) -> Pki {
        Pki {
            dir: config.join("tls"),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, f: &str) -> PathBuf {
        self.dir.join(f)
    }

    /// Creates the CA; refuses to overwrite one.
    pub fn init(&self) -> Result<(), ClusterError> {
        if self.path("ca.key").exists() {
            return Err(ClusterError::Config(format!(
                "a CA already exists in {}",
                self.dir.display()
            )));
        }
        make_dir(&self.dir)?;
        make_dir(&self.path("nodes"))?;
        let key = KeyPair::generate().map_err(pki_err)?;
        let now = OffsetDateTime::now_utc();
        let mut params = ca_params();
        params.not_before = now - Duration::minutes(5);
        params.not_after = now + Duration::days(3650);
        let cert = params.self_signed(&key).map_err(pki_err)?;
        write_file(&self.path("ca.key"), &key.serialize_pem(), 0o600)?;
        write_file(&self.path("ca.crt"), &cert.pem(), 0o644)?;
        write_file(&self.path("issued"), "", 0o644)?;
        write_file(&self.path("revoked"), "", 0o644)?;
        self.write_crl(&[])
    }

    /// The CA as an issuer (its certificate rebuilt from the same name and key).
    fn issuer(&self) -> Result<(rcgen::Certificate, KeyPair), ClusterError> {
        let key = KeyPair::from_pem(&read_text(&self.path("ca.key"))?).map_err(pki_err)?;
        let cert = ca_params().self_signed(&key).map_err(pki_err)?;
        Ok((cert, key))
    }

    /// `(serial, name)` of every certificate issued.
    pub fn issued(&self) -> Result<Vec<(u64, String)>, ClusterError> {
        let text = read_text(&self.path("issued"))?;
        let mut out = Vec::new();
        for line in text.lines().filter(|l| !l.is_empty()) {
            let parsed = line
                .split_once(' ')
                .and_then(|(s, n)| Some((s.parse::<u64>().ok()?, n.to_string())));
            match parsed {
                Some(e) if out.len() < MAX_ISSUED => out.push(e),
                _ => return Err(ClusterError::Pki("the issued list is damaged".into())),
            }
        }
        Ok(out)
    }

    /// Serials revoked.
    pub fn revoked(&self) -> Result<Vec<u64>, ClusterError> {
        let text = read_text(&self.path("revoked"))?;
        text.lines()
            .filter(|l| !l.is_empty())
            .take(MAX_ISSUED + 1)
            .map(|l| {
                l.parse()
                    .map_err(|_| ClusterError::Pki("the revoked list is damaged".into()))
            })
            .collect()
    }

    /// Issues a certificate for node `name`, valid from `not_before` for `days` days (server
    /// and client use), into `nodes/NAME.crt` and `nodes/NAME.key`. A new certificate for a
    /// name replaces the files of the old one; the old one stays valid until revoked.
    pub fn issue(
        &self,
        name: &str,
        not_before: OffsetDateTime,
        days: i64,
    ) -> Result<PathBuf, ClusterError> {
        let key = KeyPair::generate().map_err(pki_err)?;
        let (_, pem) = self.sign(name, &key, not_before, days)?;
        let nodes = self.path("nodes");
        make_dir(&nodes)?;
        write_file(
            &nodes.join(format!("{name}.key")),
            &key.serialize_pem(),
            0o600,
        )?;
        let crt = nodes.join(format!("{name}.crt"));
        write_file(&crt, &pem, 0o644)?;
        Ok(crt)
    }

    /// Signs a certificate for node `name` over `public_key` (a key the CA never sees the
    /// private half of: an enrolling node's), valid from `not_before` for `days` days, and
    /// records it as issued; returns its serial and PEM text.
    pub fn sign(
        &self,
        name: &str,
        public_key: &impl rcgen::PublicKeyData,
        not_before: OffsetDateTime,
        days: i64,
    ) -> Result<(u64, String), ClusterError> {
        check_name(name)?;
        let (ca, ca_key) = self.issuer()?;
        let issued = self.issued()?;
        if issued.len() >= MAX_ISSUED {
            return Err(ClusterError::Pki("the CA issued its limit".into()));
        }
        let serial = issued.iter().map(|(s, _)| *s).max().unwrap_or(0) + 1;
        let mut params = CertificateParams::new(vec![name.to_string()]).map_err(pki_err)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.serial_number = Some(SerialNumber::from(serial));
        params.not_before = not_before;
        params.not_after = not_before + Duration::days(days);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let cert = params
            .signed_by(public_key, &ca, &ca_key)
            .map_err(pki_err)?;
        let mut list = read_text(&self.path("issued"))?;
        list.push_str(&format!("{serial} {name}\n"));
        write_file(&self.path("issued"), &list, 0o644)?;
        Ok((serial, cert.pem()))
    }

    /// The CA certificate and its current revocation list (PEM text each).
    pub fn trust(&self) -> Result<(String, String), ClusterError> {
        Ok((
            read_text(&self.path("ca.crt"))?,
            read_text(&self.path("ca.crl"))?,
        ))
    }

    /// The CA's revocation list, which running nodes read again when it changes.
    pub fn crl_path(&self) -> PathBuf {
        self.path("ca.crl")
    }

    /// Revokes every certificate issued to `name`; returns how many. Running nodes that read
    /// this CA directory refuse the certificates from their next handshake on, without a
    /// restart ([`crate::tls`] looks at the revocation list's file on every handshake).
    pub fn revoke(&self, name: &str) -> Result<usize, ClusterError> {
        check_name(name)?;
        let mut revoked = self.revoked()?;
        let new: Vec<u64> = self
            .issued()?
            .into_iter()
            .filter(|(s, n)| n == name && !revoked.contains(s))
            .map(|(s, _)| s)
            .collect();
        if new.is_empty() {
            return Err(ClusterError::Config(format!(
                "no unrevoked certificate was issued to `{name}`"
            )));
        }
        revoked.extend(&new);
        self.write_crl(&revoked)?;
        let text: String = revoked.iter().map(|s| format!("{s}\n")).collect();
        write_file(&self.path("revoked"), &text, 0o644)?;
        Ok(new.len())
    }

    fn write_crl(&self, revoked: &[u64]) -> Result<(), ClusterError> {
        let (ca, ca_key) = self.issuer()?;
        let now = OffsetDateTime::now_utc();
        let crl = CertificateRevocationListParams {
            this_update: now - Duration::minutes(5),
            next_update: now + Duration::days(3650),
            crl_number: SerialNumber::from(revoked.len() as u64 + 1),
            issuing_distribution_point: None,
            revoked_certs: revoked
                .iter()
                .map(|&s| RevokedCertParams {
                    serial_number: SerialNumber::from(s),
                    revocation_time: now,
                    reason_code: Some(RevocationReason::CessationOfOperation),
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: KeyIdMethod::Sha256,
        }
        .signed_by(&ca, &ca_key)
        .map_err(pki_err)?;
        write_file(&self.path("ca.crl"), &crl.pem().map_err(pki_err)?, 0o644)
    }

    /// Node `name`'s credentials, with the CA and its current revocation list.
    pub fn node(&self, name: &str) -> Result<NodeCreds, ClusterError> {
        check_name(name)?;
        let nodes = self.path("nodes");
        let missing = |what: &str| {
            ClusterError::Config(format!(
                "{what} for node `{name}` is missing in {} (run `muser tls init` and `muser tls issue {name}`)",
                self.dir.display()
            ))
        };
        let read = |p: PathBuf, what: &str| {
            if p.exists() {
                read_text(&p)
            } else {
                Err(missing(what))
            }
        };
        Ok(NodeCreds {
            name: name.to_string(),
            cert_pem: read(nodes.join(format!("{name}.crt")), "the certificate")?,
            key_pem: read(nodes.join(format!("{name}.key")), "the key")?,
            ca_pem: read(self.path("ca.crt"), "the CA certificate")?,
            crl_pem: read(self.path("ca.crl"), "the revocation list")?,
            crl_path: Some(self.crl_path()),
        })
    }
}

/// An enrolling node's public key as the CA receives it: an uncompressed P-256 point (the
/// key type every node of the lane uses).
pub struct NodeKey(Vec<u8>);

impl NodeKey {
    pub fn from_raw(raw: &[u8]) -> Result<NodeKey, ClusterError> {
        if raw.len() != 65 || raw[0] != 4 {
            return Err(ClusterError::Pki(
                "a node key is an uncompressed P-256 point (65 bytes)".into(),
            ));
        }
        Ok(NodeKey(raw.to_vec()))
    }
}

impl rcgen::PublicKeyData for NodeKey {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}
