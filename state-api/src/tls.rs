//! HTTPS on the state API's port (rustls, the ring provider): the certificate chain and key
//! from files, reloaded on SIGHUP; with `--tls-client-ca`, only clients that present a
//! certificate signed by that CA finish the handshake (mutual TLS). The bearer token is still
//! checked on every call: the certificate says which machine, the token which caller.
//!
//! A connection that does not complete a TLS handshake (plaintext HTTP, an unknown client
//! certificate, none when one is required) is closed before any HTTP is read.

use contract::state_env;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// The flags (and their variables) that turn HTTPS on.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// Serve HTTPS with this certificate chain (PEM, the server's certificate first); needs
    /// `--tls-key`. Both files are read again on SIGHUP.
    #[arg(long, env = state_env::STATE_API_TLS_CERT)]
    pub tls_cert: Option<PathBuf>,

    /// The private key of `--tls-cert` (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = state_env::STATE_API_TLS_KEY)]
    pub tls_key: Option<PathBuf>,

    /// Require a client certificate signed by a CA in this file (PEM): mutual TLS. Read again
    /// on SIGHUP too.
    #[arg(long, env = state_env::STATE_API_TLS_CLIENT_CA)]
    pub tls_client_ca: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--tls-cert and --tls-key go together (STATE_API_TLS_CERT, STATE_API_TLS_KEY)")]
    Incomplete,
    #[error("--tls-client-ca needs --tls-cert and --tls-key: client certificates are checked in a TLS handshake")]
    ClientCaWithoutTls,
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
    #[error("{path}: no certificate in it (PEM \"BEGIN CERTIFICATE\")")]
    NoCertificate { path: String },
    #[error("the certificate and key: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("{path}: the client CA: {reason}")]
    ClientCa { path: String, reason: String },
}

/// The files HTTPS is served from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The files, when HTTPS is asked for (`None`: plain HTTP).
    pub fn files(&self) -> Result<Option<TlsFiles>, TlsError> {
        match (&self.tls_cert, &self.tls_key, &self.tls_client_ca) {
            (None, None, None) => Ok(None),
            (None, None, Some(_)) => Err(TlsError::ClientCaWithoutTls),
            (Some(cert), Some(key), client_ca) => Ok(Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: client_ca.clone(),
            })),
            _ => Err(TlsError::Incomplete),
        }
    }
}

fn file_error(path: &Path, reason: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, e))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.display().to_string(),
        });
    }
    Ok(certs)
}

impl TlsFiles {
    /// Reads the files into a server configuration (HTTP/2 and HTTP/1.1 offered by ALPN).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = certificates(&self.cert)?;
        // The error names the file, never the key's bytes.
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| file_error(&self.key, e))?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for cert in certificates(ca)? {
                    roots.add(cert).map_err(|e| TlsError::ClientCa {
                        path: ca.display().to_string(),
                        reason: e.to_string(),
                    })?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| TlsError::ClientCa {
                            path: ca.display().to_string(),
                            reason: e.to_string(),
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The server configuration in use, swapped whole on a reload (connections already open keep
/// theirs).
#[derive(Clone)]
pub struct Reloadable {
    files: TlsFiles,
    current: Arc<RwLock<Arc<ServerConfig>>>,
}

impl Reloadable {
    pub fn new(files: TlsFiles) -> Result<Self, TlsError> {
        let config = files.server_config()?;
        Ok(Self {
            files,
            current: Arc::new(RwLock::new(config)),
        })
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    pub fn current(&self) -> Arc<ServerConfig> {
        match self.current.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Reads the files again; on an error the configuration in use stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let config = self.files.server_config()?;
        match self.current.write() {
            Ok(mut c) => *c = config,
            Err(poisoned) => *poisoned.into_inner() = config,
        }
        Ok(())
    }

    /// Reloads on every SIGHUP, for as long as the process runs.
    pub fn reload_on_sighup(&self) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        let this = self.clone();
        Ok(tokio::spawn(async move {
            while hangup.recv().await.is_some() {
                match this.reload() {
                    Ok(()) => tracing::info!(
                        cert = %this.files.cert.display(),
                        "SIGHUP: TLS certificate, key and client CA reloaded"
                    ),
                    Err(e) => tracing::warn!(
                        error = %e,
                        "SIGHUP: TLS reload failed; the certificate in use stays"
                    ),
                }
            }
        }))
    }
}

/// Longest a client may take to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; more connections wait in the kernel's accept queue.
const MAX_HANDSHAKES: usize = 512;

/// A listener that hands axum only connections whose TLS handshake succeeded. Handshakes run
/// on tasks of their own, so a slow or hostile client never holds up the others.
pub struct TlsListener {
    incoming: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accept_task: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub fn new(listener: TcpListener, tls: Reloadable) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, incoming) = mpsc::channel(64);
        let accept_task = tokio::spawn(accept_loop(listener, tls, tx));
        Ok(Self {
            incoming,
            local,
            accept_task,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Reloadable,
    tx: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let Ok(permit) = handshakes.clone().acquire_owned().await else {
            return;
        };
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: wait a moment instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // The filter's calls are small request/response exchanges: no Nagle delay.
        let _ = tcp.set_nodelay(true);
        let acceptor = TlsAcceptor::from(tls.current());
        let tx = tx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    let _ = tx.send((stream, peer)).await;
                }
                // Plaintext on the TLS port, an unknown client certificate, a version or
                // cipher we do not speak. The reason, never anything the client sent.
                // A port probe (connect, close) is no refusal worth a warning.
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    tracing::debug!(%peer, "connection closed before a TLS handshake");
                }
                Ok(Err(e)) => tracing::warn!(%peer, error = %e, "TLS handshake refused"),
                Err(_) => tracing::warn!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.incoming.recv().await {
            Some(connection) => connection,
            // The accept task ended (it only does when the process stops): no more connections.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn args(cert: Option<&str>, key: Option<&str>, ca: Option<&str>) -> TlsArgs {
        TlsArgs {
            tls_cert: cert.map(PathBuf::from),
            tls_key: key.map(PathBuf::from),
            tls_client_ca: ca.map(PathBuf::from),
        }
    }

    #[test]
    fn the_flags_go_together() {
        assert_eq!(args(None, None, None).files().unwrap(), None);
        assert!(matches!(
            args(Some("c"), None, None).files(),
            Err(TlsError::Incomplete)
        ));
        assert!(matches!(
            args(None, Some("k"), None).files(),
            Err(TlsError::Incomplete)
        ));
        assert!(matches!(
            args(None, None, Some("ca")).files(),
            Err(TlsError::ClientCaWithoutTls)
        ));
        let files = args(Some("c"), Some("k"), Some("ca")).files().unwrap();
        assert_eq!(files.map(|f| f.client_ca), Some(Some(PathBuf::from("ca"))));
    }

    /// Two self-signed certificates for localhost, written into a folder of their own.
    fn two_certificates(label: &str) -> (PathBuf, [(PathBuf, PathBuf); 2]) {
        let dir =
            std::env::temp_dir().join(format!("state-api-tls-{label}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut made = Vec::new();
        for i in 0..2 {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
                .unwrap()
                .self_signed(&key)
                .unwrap();
            let (c, k) = (
                dir.join(format!("cert{i}.pem")),
                dir.join(format!("key{i}.pem")),
            );
            std::fs::write(&c, cert.pem()).unwrap();
            std::fs::write(&k, key.serialize_pem()).unwrap();
            made.push((c, k));
        }
        let [a, b]: [(PathBuf, PathBuf); 2] = made.try_into().unwrap();
        (dir, [a, b])
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let (dir, [(cert0, _), (_, key1)]) = two_certificates("mismatch");
        let files = TlsFiles {
            cert: cert0,
            key: key1,
            client_ca: None,
        };
        let e = files.server_config().err().map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|e| e.contains("KeyMismatch")),
            "{e:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_reload_swaps_the_configuration_and_a_failed_one_keeps_it() {
        let (dir, [(cert0, key0), (cert1, key1)]) = two_certificates("reload");
        let files = TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            client_ca: Some(cert0.clone()),
        };
        std::fs::copy(&cert0, &files.cert).unwrap();
        std::fs::copy(&key0, &files.key).unwrap();
        let tls = Reloadable::new(files.clone()).unwrap();
        let first = tls.current();
        std::fs::write(&files.key, "not a key").unwrap();
        assert!(tls.reload().is_err());
        assert!(
            Arc::ptr_eq(&first, &tls.current()),
            "a failed reload keeps the old one"
        );
        std::fs::copy(&cert1, &files.cert).unwrap();
        std::fs::copy(&key1, &files.key).unwrap();
        tls.reload().unwrap();
        assert!(
            !Arc::ptr_eq(&first, &tls.current()),
            "the new files are in use"
        );
        assert_eq!(
            tls.current().alpn_protocols,
            [b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_or_empty_file_is_named() {
        let dir = std::env::temp_dir().join(format!("state-api-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let files = TlsFiles {
            cert: empty.clone(),
            key: dir.join("missing-key.pem"),
            client_ca: None,
        };
        let e = files.server_config().err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("empty.pem") && e.contains("no certificate")),
            "{e:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
