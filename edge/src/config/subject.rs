//! `[subject]`: who the caller is, a JWT Envoy verifies (its JWKS file checked) or a header a
//! trusted layer sets.

use std::path::Path;

use toml::Spanned;

use super::raw::RawSubject;
use super::source::{is_header_name, Source};
use super::*;

pub(super) fn subject(
    src: &Source<'_>,
    raw: &Spanned<RawSubject>,
    base: &Path,
) -> Result<Subject, ConfigError> {
    match (&raw.get_ref().jwt, &raw.get_ref().header) {
        (Some(jwt), None) => {
            let j = jwt.get_ref();
            if j.issuer.get_ref().is_empty() {
                return src.at(j.issuer.span(), "subject.jwt.issuer must not be empty");
            }
            if j.audiences.get_ref().is_empty() || j.audiences.get_ref().iter().any(String::is_empty) {
                return src.at(
                    j.audiences.span(),
                    "subject.jwt.audiences must name at least one audience (tokens for other services are refused)",
                );
            }
            let jwks = match (&j.jwks_file, &j.jwks_url) {
                (Some(f), None) => {
                    let path = base.join(f.get_ref());
                    check_jwks_file(&path).or_else(|e| src.at(f.span(), format!("subject.jwt.jwks_file: {e}")))?;
                    // Envoy reads it from wherever it runs.
                    Jwks::File(path.canonicalize().unwrap_or(path))
                }
                (None, Some(u)) => {
                    let url = u.get_ref();
                    let (origin, path) = match url.find("://").and_then(|i| url[i + 3..].find('/').map(|j| i + 3 + j)) {
                        Some(at) => (&url[..at], &url[at..]),
                        None => (url.as_str(), "/"),
                    };
                    let endpoint = Endpoint::parse(origin)
                        .or_else(|e| src.at(u.span(), format!("subject.jwt.jwks_url: {e}")))?;
                    Jwks::Url {
                        endpoint,
                        path: path.to_owned(),
                    }
                }
                _ => {
                    return src.at(
                        jwt.span(),
                        "[subject.jwt] needs exactly one of jwks_file or jwks_url",
                    )
                }
            };
            let header = match &j.header {
                Some(h) if !is_header_name(&h.get_ref().to_ascii_lowercase()) => {
                    return src.at(h.span(), "subject.jwt.header must be a header name")
                }
                Some(h) => h.get_ref().to_ascii_lowercase(),
                None => DEFAULT_SUBJECT_HEADER.to_owned(),
            };
            let claim = match &j.claim {
                Some(c) if c.get_ref().is_empty() => {
                    return src.at(c.span(), "subject.jwt.claim must not be empty")
                }
                Some(c) => c.get_ref().clone(),
                None => "sub".to_owned(),
            };
            Ok(Subject::Jwt(Jwt {
                issuer: j.issuer.get_ref().clone(),
                audiences: j.audiences.get_ref().clone(),
                jwks,
                header,
                claim,
                forward_token: j.forward_token.unwrap_or(true),
            }))
        }
        (None, Some(h)) => {
            let name = h.get_ref().to_ascii_lowercase();
            if !is_header_name(&name) {
                return src.at(h.span(), "subject.header must be a header name");
            }
            Ok(Subject::Header(name))
        }
        _ => src.at(
            raw.span(),
            "[subject] needs exactly one of [subject.jwt] (a token Envoy verifies) or header = \"...\" (set by a trusted layer in front)",
        ),
    }
}

/// A JWKS file Envoy can load: JSON with a non-empty `keys` array.
fn check_jwks_file(path: &Path) -> Result<(), NamedFileError> {
    let text = NamedFileError::read(path)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| NamedFileError::NotJson {
            path: path.to_owned(),
            source,
        })?;
    match v.get("keys").and_then(|k| k.as_array()) {
        Some(keys) if !keys.is_empty() => Ok(()),
        _ => Err(NamedFileError::NoKeys {
            path: path.to_owned(),
        }),
    }
}
