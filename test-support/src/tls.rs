//! Certificates for the TLS tests, made at run time with `rcgen` (none are committed), and
//! small TLS clients that talk to the state API's port directly.
//!
//! [`TestPki::generate`] writes, into a folder of its own: a CA and a second, unrelated CA; a
//! server certificate for `localhost` and `127.0.0.1` (the state API's and Postgres's); Envoy's
//! client certificate; and the certificates a state API must never be trusted with: one from
//! the other CA, one expired. A stack started with [`crate::stack::StackOptions::tls`] uses
//! them: Envoy -> state API with mutual TLS, state API -> Postgres with `verify-full`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::postgres::ServerTls;
use edge::config::{ClientCert, StateTls};

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Every certificate the TLS tests use.
#[derive(Debug, Clone)]
pub struct TestPki {
    pub dir: PathBuf,
    /// The CA Envoy trusts for the state API, the state API for Envoy, sqlx for Postgres.
    pub ca: PathBuf,
    /// A CA nobody here trusts.
    pub other_ca: PathBuf,
    /// `localhost`, `127.0.0.1`; signed by `ca`. The state API's and Postgres's.
    pub server: CertFiles,
    /// Envoy's client certificate, signed by `ca`.
    pub client: CertFiles,
    /// A client certificate signed by `other_ca`.
    pub foreign_client: CertFiles,
    /// A server certificate for `127.0.0.1` signed by `other_ca`.
    pub foreign_server: CertFiles,
    /// A server certificate for `127.0.0.1` signed by `ca` that expired in 2021.
    pub expired_server: CertFiles,
}

struct Authority {
    cert: Certificate,
    key: KeyPair,
}

fn err(e: impl std::fmt::Display) -> String {
    format!("rcgen: {e}")
}

fn authority(name: &str) -> Result<Authority, String> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.self_signed(&key).map_err(err)?;
    Ok(Authority { cert, key })
}

/// An end-entity certificate for `names`, signed by `by`.
fn leaf(
    by: &Authority,
    common_name: &str,
    names: &[&str],
    purpose: &ExtendedKeyUsagePurpose,
    expired: bool,
) -> Result<(String, String), String> {
    let mut params =
        CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
            .map_err(err)?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![purpose.clone()];
    if expired {
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    }
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.signed_by(&key, &by.cert, &by.key).map_err(err)?;
    Ok((cert.pem(), key.serialize_pem()))
}

impl TestPki {
    /// Makes every certificate and writes them into `dir` (created; keys mode 0600).
    pub fn generate(dir: &Path) -> Result<Self, String> {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let write = |name: &str, text: &str, mode: u32| -> Result<PathBuf, String> {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                .map_err(|e| format!("{}: {e}", path.display()))?;
            Ok(path)
        };
        let pair = |name: &str, (cert, key): (String, String)| -> Result<CertFiles, String> {
            Ok(CertFiles {
                cert: write(&format!("{name}.pem"), &cert, 0o644)?,
                key: write(&format!("{name}-key.pem"), &key, 0o600)?,
            })
        };
        let ca = authority("edge test CA")?;
        let other = authority("unrelated test CA")?;
        let server = &ExtendedKeyUsagePurpose::ServerAuth;
        let client = &ExtendedKeyUsagePurpose::ClientAuth;
        Ok(Self {
            dir: dir.to_path_buf(),
            ca: write("ca.pem", &ca.cert.pem(), 0o644)?,
            other_ca: write("other-ca.pem", &other.cert.pem(), 0o644)?,
            server: pair(
                "server",
                leaf(&ca, "state-api", &["localhost", "127.0.0.1"], server, false)?,
            )?,
            client: pair("envoy-client", leaf(&ca, "envoy", &[], client, false)?)?,
            foreign_client: pair(
                "foreign-client",
                leaf(&other, "stranger", &[], client, false)?,
            )?,
            foreign_server: pair(
                "foreign-server",
                leaf(
                    &other,
                    "impostor",
                    &["localhost", "127.0.0.1"],
                    server,
                    false,
                )?,
            )?,
            expired_server: pair(
                "expired-server",
                leaf(&ca, "expired", &["localhost", "127.0.0.1"], server, true)?,
            )?,
        })
    }

    /// Postgres's certificate (the server one), with only TLS connections accepted.
    pub fn postgres_tls(&self) -> Result<ServerTls, String> {
        let read =
            |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
        Ok(ServerTls {
            cert_pem: read(&self.server.cert)?,
            key_pem: read(&self.server.key)?,
            require: true,
        })
    }

    /// `[state.tls]` for a state API serving `served` on 127.0.0.1: Envoy checks it against
    /// `ca` and presents its client certificate, which the state API checks against `ca`.
    pub fn state_tls(&self, served: &CertFiles) -> StateTls {
        StateTls {
            cert_file: served.cert.clone(),
            key_file: served.key.clone(),
            ca_file: self.ca.clone(),
            server_name: "127.0.0.1".into(),
            client_cert: Some(ClientCert {
                cert_file: self.client.cert.clone(),
                key_file: self.client.key.clone(),
            }),
            client_ca_file: Some(self.ca.clone()),
        }
    }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// `GET path` over HTTPS to 127.0.0.1:`port`, trusting `ca`, presenting `client` when given.
/// The whole answer (status line, headers, body), or where it failed: the handshake, or the
/// first read (TLS 1.3 tells a client that its certificate was refused only then).
pub async fn https_get(
    port: u16,
    path: &str,
    ca: &Path,
    client: Option<&CertFiles>,
) -> Result<String, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certificates(ca)? {
        roots.add(c).map_err(|e| e.to_string())?;
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots);
    let config = match client {
        Some(c) => builder
            .with_client_auth_cert(
                certificates(&c.cert)?,
                PrivateKeyDer::from_pem_file(&c.key).map_err(|e| e.to_string())?,
            )
            .map_err(|e| e.to_string())?,
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let io = async {
        let mut tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tls.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .map_err(|e| format!("write: {e}"))?;
        let mut answer = Vec::new();
        tls.read_to_end(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        if answer.is_empty() {
            return Err("read: the connection closed without an answer".to_owned());
        }
        Ok(String::from_utf8_lossy(&answer).into_owned())
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), io)
        .await
        .map_err(|_| "no answer within 10 s".to_owned())?
}

/// A plaintext `GET path` to 127.0.0.1:`port`: whatever bytes come back before the
/// connection closes (at most 5 s).
pub async fn plaintext_get(port: u16, path: &str) -> Result<Vec<u8>, String> {
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(|e| format!("write: {e}"))?;
    let mut answer = Vec::new();
    // A reset after the alert is an answer too: keep what was read.
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        tcp.read_to_end(&mut answer),
    )
    .await
    .map_err(|_| "the connection stayed open for 5 s".to_owned())?;
    Ok(answer)
}
