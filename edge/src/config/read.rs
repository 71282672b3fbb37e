//! Reading the file: the top-level fields, `[state]`, `[mesh]`, each checked on its own, with
//! the line an error names.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use filter_core::config as fc;
use toml::Spanned;

use super::raw::{RawFile, RawMesh};
use super::routes::{filter, route};
use super::state_tls::state_tls;
use super::subject::subject;
use super::*;

/// Turns byte offsets into line numbers, and errors into [`ConfigError::At`].
pub(super) struct Source<'a> {
    file: &'a str,
    text: &'a str,
}

impl Source<'_> {
    pub(super) fn line(&self, offset: usize) -> usize {
        1 + self
            .text
            .get(..offset.min(self.text.len()))
            .unwrap_or("")
            .bytes()
            .filter(|b| *b == b'\n')
            .count()
    }

    pub(super) fn at<T>(
        &self,
        span: std::ops::Range<usize>,
        message: impl Into<String>,
    ) -> Result<T, ConfigError> {
        Err(ConfigError::At {
            file: self.file.to_owned(),
            line: self.line(span.start),
            message: message.into(),
        })
    }
}

pub(super) fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

pub(super) fn is_header_name(s: &str) -> bool {
    is_token(s) && !s.starts_with(':')
}

impl Config {
    /// Parses the text of a file named `file`, in folder `base`, each field checked on its
    /// own ([`Config::parse`] also checks the whole).
    pub(crate) fn read(text: &str, file: &str, base: &Path) -> Result<Self, ConfigError> {
        let src = Source { file, text };
        let raw: RawFile = toml::from_str(text).map_err(|e| {
            let line = e.span().map_or(1, |s| src.line(s.start));
            ConfigError::At {
                file: file.to_owned(),
                line,
                message: e.message().trim().to_owned(),
            }
        })?;
        let mut lines = BTreeMap::new();
        let mut note = |name: &str, span: std::ops::Range<usize>| {
            lines.insert(name.to_owned(), src.line(span.start));
        };

        let listen = socket(&src, &raw.listen, "listen")?;
        note("listen", raw.listen.span());
        let admin = match &raw.admin {
            Some(a) => {
                note("admin", a.span());
                Some(socket(&src, a, "admin")?)
            }
            None => None,
        };
        let upstream = Endpoint::parse(raw.upstream.get_ref())
            .or_else(|e| src.at(raw.upstream.span(), format!("upstream: {e}")))?;
        let upstream_timeout_ms = match &raw.upstream_timeout_ms {
            Some(t) if *t.get_ref() == 0 => {
                return src.at(t.span(), "upstream_timeout_ms must be > 0")
            }
            Some(t) => *t.get_ref(),
            None => DEFAULT_UPSTREAM_TIMEOUT_MS,
        };
        let envoy_workers = match &raw.envoy_workers {
            Some(w) if *w.get_ref() == 0 || *w.get_ref() > 64 => {
                return src.at(w.span(), "envoy_workers must be 1 to 64")
            }
            Some(w) => *w.get_ref(),
            None => 1,
        };
        let namespace = namespace(&src, raw.namespace.as_ref())?;
        let mesh = mesh(&src, raw.mesh.as_ref())?;

        let st = &raw.state;
        let state_listen = match &st.listen {
            Some(l) => {
                note("state.listen", l.span());
                socket(&src, l, "state.listen")?
            }
            None => DEFAULT_STATE_LISTEN
                .parse()
                .map_err(|_| ConfigError::Invalid("default state.listen".into()))?,
        };
        let database_url = match &st.database_url {
            Some(u) => {
                let url = u.get_ref();
                if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                    return src.at(
                        u.span(),
                        "state.database_url must be a postgres:// or postgresql:// URL",
                    );
                }
                Some(url.clone())
            }
            None => None,
        };
        let postgres_port = match &st.postgres_port {
            Some(p) if *p.get_ref() == 0 => {
                return src.at(p.span(), "state.postgres_port must be 1 to 65535")
            }
            Some(p) => {
                if database_url.is_some() {
                    return src.at(
                        p.span(),
                        "state.postgres_port is the embedded cluster's: not with state.database_url",
                    );
                }
                note("state.postgres_port", p.span());
                *p.get_ref()
            }
            None => DEFAULT_POSTGRES_PORT,
        };
        let secret =
            |s: &Option<Spanned<String>>, name: &str| -> Result<Option<String>, ConfigError> {
                match s {
                    Some(v)
                        if v.get_ref().len() < 16
                            || v.get_ref().bytes().any(|b| !(0x21..=0x7e).contains(&b)) =>
                    {
                        src.at(
                            v.span(),
                            format!(
                            "state.{name} must be at least 16 visible ASCII characters, no spaces"
                        ),
                        )
                    }
                    Some(v) => Ok(Some(v.get_ref().clone())),
                    None => Ok(None),
                }
            };
        let token = secret(&st.token, "token")?;
        let key_secret = secret(&st.key_secret, "key_secret")?;
        let previous_key_secret = secret(&st.previous_key_secret, "previous_key_secret")?;
        let admin_token = secret(&st.admin_token, "admin_token")?;
        let storage_key = |v: &Option<Spanned<String>>, name: &str| match v {
            Some(k) if !is_storage_key(k.get_ref()) => src.at(
                k.span(),
                format!(
                    "state.{name} must be 32 bytes in standard base64 (openssl rand -base64 32)"
                ),
            ),
            Some(k) => Ok(Some(k.get_ref().trim().to_owned())),
            None => Ok(None),
        };
        let previous_storage_key = storage_key(&st.previous_storage_key, "previous_storage_key")?;
        let storage_key = storage_key(&st.storage_key, "storage_key")?;
        if let (Some(k), Some(p)) = (&storage_key, &previous_storage_key) {
            if k == p {
                if let Some(span) = st.previous_storage_key.as_ref().map(|p| p.span()) {
                    return src.at(
                        span,
                        "state.previous_storage_key is the same as state.storage_key",
                    );
                }
            }
        }
        if let (Some(a), Some(t)) = (&st.admin_token, &token) {
            if a.get_ref() == t {
                return src.at(
                    a.span(),
                    "state.admin_token must not be the filter's token (state.token)",
                );
            }
        }
        let timeout_ms = match &st.timeout_ms {
            Some(t) if *t.get_ref() == 0 || *t.get_ref() > 60_000 => {
                return src.at(t.span(), "state.timeout_ms must be 1 to 60000")
            }
            Some(t) => *t.get_ref(),
            None => fc::DEFAULT_TIMEOUT_MS,
        };
        let retention_s = match &st.retention_s {
            Some(r) if *r.get_ref() == 0 => {
                return src.at(r.span(), "state.retention_s must be > 0")
            }
            Some(r) => Some(*r.get_ref()),
            None => None,
        };
        let max_retention_s = match &st.max_retention_s {
            Some(r) if *r.get_ref() == 0 || *r.get_ref() > MAX_RETENTION_S => {
                return src.at(
                    r.span(),
                    format!("state.max_retention_s must be 1 to {MAX_RETENTION_S} (ten years)"),
                )
            }
            Some(r) => Some(*r.get_ref()),
            None => None,
        };
        let retention_cap = max_retention_s.unwrap_or(DEFAULT_MAX_RETENTION_S);
        if let Some(r) = st
            .retention_s
            .as_ref()
            .filter(|r| *r.get_ref() > retention_cap)
        {
            return src.at(
                r.span(),
                format!("state.retention_s is over state.max_retention_s ({retention_cap} s)"),
            );
        }

        let tls = match &st.tls {
            Some(t) => {
                note("state.tls", t.span());
                Some(state_tls(&src, t, base, state_listen)?)
            }
            None => None,
        };

        let subject = subject(&src, &raw.subject, base)?;
        let filter = filter(&src, &raw.filter)?;
        if raw.routes.is_empty() {
            return src.at(
                0..0,
                "no [[route]]: name at least one protected route (everything else passes through)",
            );
        }
        let mut routes = Vec::new();
        for r in &raw.routes {
            let route = route(&src, r, &filter)?;
            if let Some(asked) = route.retention_s.filter(|s| *s > retention_cap) {
                let at = r
                    .get_ref()
                    .retention_s
                    .as_ref()
                    .map_or(r.span(), Spanned::span);
                return src.at(
                    at,
                    format!("route.retention_s ({asked} s) is over state.max_retention_s ({retention_cap} s): the state API would keep its records for less"),
                );
            }
            routes.push(route);
        }
        for (i, a) in routes.iter().enumerate() {
            if routes[..i]
                .iter()
                .any(|b| b.method == a.method && b.matcher == a.matcher)
            {
                return src.at(
                    raw.routes[i].span(),
                    "this route is already configured above",
                );
            }
        }
        let cfg = Self {
            listen,
            admin,
            upstream,
            upstream_timeout_ms,
            envoy_workers,
            namespace,
            state: State {
                listen: state_listen,
                database_url,
                postgres_port,
                token,
                key_secret,
                previous_key_secret,
                storage_key,
                previous_storage_key,
                timeout_ms,
                retention_s,
                max_retention_s,
                admin_token,
                tls,
            },
            subject,
            filter,
            routes,
            mesh,
            lines,
            file: file.to_owned(),
        };
        Ok(cfg)
    }
}

fn namespace(src: &Source<'_>, raw: Option<&Spanned<String>>) -> Result<String, ConfigError> {
    match raw {
        Some(n) if !contract::limits::valid_namespace(n.get_ref()) => src.at(
            n.span(),
            format!(
                "namespace must be at most {} of a-z 0-9 . _ -",
                contract::limits::MAX_NAMESPACE_LEN
            ),
        ),
        Some(n) => Ok(n.get_ref().clone()),
        None => Ok(String::new()),
    }
}

/// `[mesh]`, over the defaults: Kubernetes names, images, at least two state API replicas.
fn mesh(src: &Source<'_>, raw: Option<&Spanned<RawMesh>>) -> Result<MeshSettings, ConfigError> {
    let mut m = MeshSettings::default();
    let Some(raw) = raw else { return Ok(m) };
    let r = raw.get_ref();
    let names = [
        (&r.namespace, &mut m.namespace, "namespace"),
        (
            &r.istio_namespace,
            &mut m.istio_namespace,
            "istio_namespace",
        ),
        (&r.gateway, &mut m.gateway, "gateway"),
        (
            &r.gateway_namespace,
            &mut m.gateway_namespace,
            "gateway_namespace",
        ),
        (
            &r.gateway_listener,
            &mut m.gateway_listener,
            "gateway_listener",
        ),
        (
            &r.gateway_proxy_namespace,
            &mut m.gateway_proxy_namespace,
            "gateway_proxy_namespace",
        ),
    ];
    for (given, into, name) in names {
        if let Some(v) = given {
            if !is_object_name(v.get_ref()) {
                return src.at(
                    v.span(),
                    format!("mesh.{name} must be a Kubernetes name: up to 63 of a-z 0-9 -"),
                );
            }
            v.get_ref().clone_into(into);
        }
    }
    for (given, into, name) in [
        (
            &r.state_api_image,
            &mut m.state_api_image,
            "state_api_image",
        ),
        (&r.filter_image, &mut m.filter_image, "filter_image"),
    ] {
        if let Some(v) = given {
            let image = v.get_ref().strip_prefix("oci://").unwrap_or(v.get_ref());
            if image.is_empty() || image.contains(|c: char| c.is_whitespace() || c.is_control()) {
                return src.at(
                    v.span(),
                    format!("mesh.{name} must be an image reference (REGISTRY/REPO:TAG)"),
                );
            }
            image.clone_into(into);
        }
    }
    if let Some(v) = &r.replicas {
        if *v.get_ref() < 2 {
            return src.at(v.span(), "mesh.replicas must be at least 2 (one is drained while the other serves: the PodDisruptionBudget keeps one)");
        }
        m.replicas = *v.get_ref();
    }
    if let Some(u) = &r.state_api_url {
        let e = Endpoint::parse(u.get_ref())
            .or_else(|e| src.at(u.span(), format!("mesh.state_api_url: {e}")))?;
        m.external_state_api = Some(e);
    }
    if let Some(l) = &r.istio_labels {
        if l.get_ref().is_empty()
            || l.get_ref()
                .iter()
                .any(|(k, v)| k.is_empty() || v.is_empty())
        {
            return src.at(
                l.span(),
                "mesh.istio_labels must name at least one label of the gateway Envoys' pods",
            );
        }
        m.istio_labels = l.get_ref().clone();
    }
    Ok(m)
}

fn socket(src: &Source<'_>, v: &Spanned<String>, name: &str) -> Result<SocketAddr, ConfigError> {
    v.get_ref().parse::<SocketAddr>().or_else(|_| {
        src.at(
            v.span(),
            format!(
                "{name} must be an address and port like 127.0.0.1:10000, not {:?}",
                v.get_ref()
            ),
        )
    })
}

/// A storage key as the state API takes it: 32 bytes in standard base64.
fn is_storage_key(text: &str) -> bool {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .is_ok_and(|k| k.len() == 32)
}
