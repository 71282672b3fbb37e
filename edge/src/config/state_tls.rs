//! `[state.tls]`: the PEM files of HTTPS (and mutual TLS) between Envoy and the state API.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use toml::Spanned;

use super::raw::RawStateTls;
use super::source::Source;
use super::*;

/// `[state.tls]`: every file readable PEM of the right kind (relative to the configuration
/// file's folder), the client certificate and key together, and a client certificate exactly
/// when the state API is told to check one.
pub(super) fn state_tls(
    src: &Source<'_>,
    raw: &Spanned<RawStateTls>,
    base: &Path,
    state_listen: SocketAddr,
) -> Result<StateTls, ConfigError> {
    let t = raw.get_ref();
    let pem = |v: &Option<Spanned<String>>,
               name: &str,
               kind: PemKind|
     -> Result<Option<PathBuf>, ConfigError> {
        let Some(v) = v else { return Ok(None) };
        let path = base.join(v.get_ref());
        check_pem_file(&path, kind)
            .or_else(|e| src.at(v.span(), format!("state.tls.{name}: {e}")))?;
        // Envoy and the state API read it from wherever they run.
        Ok(Some(path.canonicalize().unwrap_or(path)))
    };
    let required = |v: Option<PathBuf>, name: &str| -> Result<PathBuf, ConfigError> {
        v.map_or_else(
            || {
                src.at(
                    raw.span(),
                    format!("[state.tls] needs {name}: {}", required_why(name)),
                )
            },
            Ok,
        )
    };
    let cert_file = required(
        pem(&t.cert_file, "cert_file", PemKind::Certificate)?,
        "cert_file",
    )?;
    let key_file = required(
        pem(&t.key_file, "key_file", PemKind::PrivateKey)?,
        "key_file",
    )?;
    let ca_file = required(pem(&t.ca_file, "ca_file", PemKind::Certificate)?, "ca_file")?;
    let client_cert_file = pem(
        &t.client_cert_file,
        "client_cert_file",
        PemKind::Certificate,
    )?;
    let client_key_file = pem(&t.client_key_file, "client_key_file", PemKind::PrivateKey)?;
    let client_ca_file = pem(&t.client_ca_file, "client_ca_file", PemKind::Certificate)?;
    let client_cert = match (client_cert_file, client_key_file) {
        (Some(cert_file), Some(key_file)) => Some(ClientCert {
            cert_file,
            key_file,
        }),
        (None, None) => None,
        _ => {
            let at = t
                .client_cert_file
                .as_ref()
                .or(t.client_key_file.as_ref())
                .map_or(raw.span(), Spanned::span);
            return src.at(
                at,
                "state.tls.client_cert_file and client_key_file go together (Envoy's client certificate)",
            );
        }
    };
    match (&client_cert, &client_ca_file) {
        (Some(_), None) => {
            let at = t
                .client_cert_file
                .as_ref()
                .map_or(raw.span(), Spanned::span);
            return src.at(
                at,
                "state.tls.client_cert_file without client_ca_file: the state API would not check it (set client_ca_file, the CA that signed it)",
            );
        }
        (None, Some(_)) => {
            let at = t.client_ca_file.as_ref().map_or(raw.span(), Spanned::span);
            return src.at(
                at,
                "state.tls.client_ca_file without client_cert_file and client_key_file: the state API would refuse Envoy",
            );
        }
        _ => {}
    }
    let server_name = match &t.server_name {
        Some(n) => {
            let name = n.get_ref();
            let valid = !name.is_empty()
                && name.len() <= 253
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.:".contains(&b));
            if !valid {
                return src.at(
                    n.span(),
                    "state.tls.server_name must be a DNS name or an IP address (what the state API's certificate names)",
                );
            }
            name.clone()
        }
        None => reachable(state_listen).host,
    };
    Ok(StateTls {
        cert_file,
        key_file,
        ca_file,
        server_name,
        client_cert,
        client_ca_file,
    })
}

fn required_why(name: &str) -> &'static str {
    match name {
        "cert_file" => "the state API's certificate chain (PEM)",
        "key_file" => "the state API's private key (PEM)",
        _ => "the CA Envoy trusts for the state API's certificate (PEM)",
    }
}

#[derive(Clone, Copy)]
enum PemKind {
    Certificate,
    PrivateKey,
}

/// A PEM file of this kind: readable, with a `-----BEGIN ...` block of it. Only the labels are
/// looked at (the key's bytes are never part of an error).
fn check_pem_file(path: &Path, kind: PemKind) -> Result<(), NamedFileError> {
    let text = NamedFileError::read(path)?;
    let found = text.lines().any(|l| {
        let l = l.trim();
        l.starts_with("-----BEGIN ")
            && match kind {
                PemKind::Certificate => l == "-----BEGIN CERTIFICATE-----",
                PemKind::PrivateKey => l.ends_with("PRIVATE KEY-----"),
            }
    });
    if found {
        return Ok(());
    }
    let path = path.to_owned();
    Err(match kind {
        PemKind::Certificate => NamedFileError::NoCertificate { path },
        PemKind::PrivateKey => NamedFileError::NoPrivateKey { path },
    })
}
