//! Reading the file: the top-level fields, `[mesh]` and the list of routes, each checked on its
//! own, with the line an error names; the sections in the files beside it.

use std::path::Path;

use toml::Spanned;

use super::raw::{RawFile, RawMesh, RawRoute};
use super::routes::{filter, route};
use super::source::{socket, Lines, Source};
use super::state::state;
use super::subject::subject;
use super::*;

impl Config {
    /// Parses the text of a file named `file`, in folder `base`, each field checked on its
    /// own ([`Config::parse`] also checks the whole). The fields are checked in the file's
    /// order, so that the first error reported is the first a reader meets.
    pub(crate) fn read(text: &str, file: &str, base: &Path) -> Result<Self, ConfigError> {
        let src = Source { file, text };
        let raw = toml_file(&src)?;
        let mut lines = Lines::default();
        let listen = socket(&src, &raw.listen, "listen")?;
        lines.note(&src, "listen", raw.listen.span());
        let admin = match &raw.admin {
            Some(a) => {
                lines.note(&src, "admin", a.span());
                Some(socket(&src, a, "admin")?)
            }
            None => None,
        };
        let upstream = Endpoint::parse(raw.upstream.get_ref())
            .or_else(|e| src.at(raw.upstream.span(), format!("upstream: {e}")))?;
        let upstream_timeout_ms = upstream_timeout_ms(&src, raw.upstream_timeout_ms.as_ref())?;
        let envoy_workers = envoy_workers(&src, raw.envoy_workers.as_ref())?;
        let namespace = namespace(&src, raw.namespace.as_ref())?;
        let mesh = mesh(&src, raw.mesh.as_ref())?;
        let state = state(&src, &raw.state, base, &mut lines)?;
        let subject = subject(&src, &raw.subject, base)?;
        let filter = filter(&src, &raw.filter)?;
        let limits = super::limits::limits(&src, &raw.limits)?;
        let retention_cap = state.max_retention_s.unwrap_or(DEFAULT_MAX_RETENTION_S);
        let routes = routes(&src, &raw.routes, &filter, retention_cap)?;
        Ok(Self {
            listen,
            admin,
            upstream,
            upstream_timeout_ms,
            envoy_workers,
            namespace,
            state,
            subject,
            filter,
            limits,
            routes,
            mesh,
            lines: lines.0,
            file: file.to_owned(),
        })
    }
}

/// The TOML parsed into the file's types; a syntax error or an unknown field at its line.
fn toml_file(src: &Source<'_>) -> Result<RawFile, ConfigError> {
    toml::from_str(src.text).map_err(|e| {
        let line = e.span().map_or(1, |s| src.line(s.start));
        ConfigError::At {
            file: src.file.to_owned(),
            line,
            message: e.message().trim().to_owned(),
        }
    })
}

fn upstream_timeout_ms(src: &Source<'_>, raw: Option<&Spanned<u64>>) -> Result<u64, ConfigError> {
    match raw {
        Some(t) if *t.get_ref() == 0 => src.at(t.span(), "upstream_timeout_ms must be > 0"),
        Some(t) => Ok(*t.get_ref()),
        None => Ok(DEFAULT_UPSTREAM_TIMEOUT_MS),
    }
}

fn envoy_workers(src: &Source<'_>, raw: Option<&Spanned<u32>>) -> Result<u32, ConfigError> {
    match raw {
        Some(w) if *w.get_ref() == 0 || *w.get_ref() > 64 => {
            src.at(w.span(), "envoy_workers must be 1 to 64")
        }
        Some(w) => Ok(*w.get_ref()),
        None => Ok(1),
    }
}

/// The `[[route]]`s: at least one, each within the longest retention, none twice.
fn routes(
    src: &Source<'_>,
    raw: &[Spanned<RawRoute>],
    filter: &Filter,
    retention_cap: u64,
) -> Result<Vec<Route>, ConfigError> {
    if raw.is_empty() {
        return src.at(
            0..0,
            "no [[route]]: name at least one protected route (everything else passes through)",
        );
    }
    let mut routes = Vec::new();
    for r in raw {
        let route = route(src, r, filter)?;
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
            return src.at(raw[i].span(), "this route is already configured above");
        }
    }
    Ok(routes)
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
