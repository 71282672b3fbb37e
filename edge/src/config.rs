//! The configuration file (TOML): which API to protect, where clients connect, who the caller
//! is, and which routes are protected with which options. Unknown fields are refused, and every
//! error names the field and its line.
//!
//! ```toml
//! listen = "127.0.0.1:10000"
//! upstream = "http://127.0.0.1:3000"
//!
//! [subject.jwt]
//! issuer = "https://issuer.example"
//! audiences = ["orders"]
//! jwks_file = "jwks.json"
//!
//! [[route]]
//! method = "POST"
//! path = "/orders"
//! key = "required"
//! ```
//!
//! [`Config::load`] reads and checks a file; the typed [`Config`] can also be built in code
//! (the test harness does) and is checked again by [`Config::check`].

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use filter_core::config as fc;
pub use filter_core::config::{
    KeyPolicy, On5xx, OnStateUnavailable, OnUnknown, Pointer, Selection,
};
use serde::Deserialize;
use toml::Spanned;

/// What is wrong with a configuration file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: {message}")]
    File { file: String, message: String },
    #[error("{file}:{line}: {message}")]
    At {
        file: String,
        line: usize,
        message: String,
    },
    /// A configuration built in code that the filter or the state API would refuse.
    #[error("{0}")]
    Invalid(String),
}

/// An HTTP(S) service the rendered Envoy talks to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub tls: bool,
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// `http://host[:port]` or `https://host[:port]`, nothing after the authority.
    pub fn parse(url: &str) -> Result<Self, String> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else {
            return Err(format!("{url:?} must start with http:// or https://"));
        };
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
            return Err(format!(
                "{url:?} must be scheme://host[:port], without a path, query or user"
            ));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => {
                let port = p
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| format!("{url:?}: the port must be 1 to 65535"))?;
                (h, port)
            }
            _ => (authority, if tls { 443 } else { 80 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty()
            || !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._:".contains(&b))
        {
            return Err(format!("{url:?}: {host:?} is not a host name or address"));
        }
        Ok(Self {
            tls,
            host: host.to_owned(),
            port,
        })
    }

    /// The `:authority` for requests to it (the port only when it is not the scheme's).
    pub fn authority(&self) -> String {
        let default = if self.tls { 443 } else { 80 };
        if self.port == default {
            self.host.clone()
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Where the state API listens and what it runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub listen: SocketAddr,
    /// An existing Postgres; `None`: an embedded cluster under the run folder.
    pub database_url: Option<String>,
    /// The embedded cluster's port (loopback).
    pub postgres_port: u16,
    /// The filter's bearer token for the state API; `None`: made once and kept in the run folder.
    pub token: Option<String>,
    /// The HMAC secret for stored keys; `None`: as `token`.
    pub key_secret: Option<String>,
    /// During a rotation of `key_secret`: the one before (records are looked up under both).
    pub previous_key_secret: Option<String>,
    /// The AES-256 key (32 bytes, base64) sealing stored responses; `None`: made once and kept
    /// in the run folder by `edge run` (`edge render` asks for one).
    pub storage_key: Option<String>,
    /// During a rotation of `storage_key`: the one before (it only opens old records).
    pub previous_storage_key: Option<String>,
    /// The filter's call timeout.
    pub timeout_ms: u64,
    /// How long records are kept (the state API's default when `None`).
    pub retention_s: Option<u64>,
    /// The longest retention a route may ask for (the state API's default when `None`).
    pub max_retention_s: Option<u64>,
    /// The operators' bearer token for the admin API (`idemctl`); `None`: the admin API is off.
    pub admin_token: Option<String>,
    /// HTTPS between Envoy and the state API (`[state.tls]`); `None`: plain HTTP.
    pub tls: Option<StateTls>,
}

/// `[state.tls]`: the state API serves HTTPS, and Envoy's cluster for it verifies the
/// certificate (and, with a client certificate, proves who it is: mutual TLS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateTls {
    /// The state API's certificate chain and private key (PEM).
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// The CA Envoy trusts for the state API's certificate (PEM).
    pub ca_file: PathBuf,
    /// The name Envoy sends as SNI and expects among the certificate's subject alternative
    /// names (a DNS name, or an IP address).
    pub server_name: String,
    /// Envoy's client certificate and key (PEM): mutual TLS, with `client_ca_file`.
    pub client_cert: Option<ClientCert>,
    /// The CA the state API checks client certificates against (PEM).
    pub client_ca_file: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// Who the caller is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// A JWT verified by Envoy's jwt_authn on every protected route; its claim is the subject.
    Jwt(Jwt),
    /// A header set by a trusted layer in front of this Envoy (the risk: whoever reaches the
    /// listener directly chooses the subject).
    Header(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Jwt {
    pub issuer: String,
    pub audiences: Vec<String>,
    pub jwks: Jwks,
    /// The header jwt_authn writes the claim into (removed from every client request first).
    pub header: String,
    pub claim: String,
    /// Whether the token goes on to the upstream.
    pub forward_token: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Jwks {
    File(PathBuf),
    /// Fetched by Envoy through a cluster of its own.
    Url {
        endpoint: Endpoint,
        path: String,
    },
}

/// The filter's options that are the same for every route (and the route defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
    pub max_request_body_bytes: u64,
    pub max_stored_body_bytes: u64,
    pub replay_extra_headers: Vec<String>,
    pub replay_cache_bytes: u64,
    pub replay_cache_ttl_ms: u64,
    pub in_flight_cache_ms: u64,
    pub complete_retry_ms: u64,
    pub complete_retry_bytes: u64,
    pub complete_in_background: bool,
    /// Retries of one Envoy worker that wait for a running key at once (`Prefer: wait`).
    pub max_waiters: u64,
    /// Most claims (or held completes) in one `/v1/claims` (`/v1/completes`) callout (1: each
    /// is its own callout).
    pub batch_max: u64,
    /// Most request body bytes one Envoy worker holds at once before forwarding (over it:
    /// 503 + Retry-After, nothing forwarded). None: the filter's default (64 MiB, or the
    /// largest body a route takes if more).
    pub max_buffered_bytes: Option<u64>,
}

impl Default for Filter {
    fn default() -> Self {
        Self {
            lease_ms: fc::DEFAULT_LEASE_MS,
            heartbeat_ms: fc::DEFAULT_HEARTBEAT_MS,
            max_request_body_bytes: fc::DEFAULT_MAX_BODY,
            max_stored_body_bytes: fc::DEFAULT_MAX_BODY,
            replay_extra_headers: Vec::new(),
            replay_cache_bytes: fc::DEFAULT_REPLAY_CACHE_BYTES,
            replay_cache_ttl_ms: fc::DEFAULT_REPLAY_CACHE_TTL_MS,
            in_flight_cache_ms: fc::DEFAULT_IN_FLIGHT_CACHE_MS,
            complete_retry_ms: fc::DEFAULT_COMPLETE_RETRY_MS,
            complete_retry_bytes: fc::DEFAULT_COMPLETE_RETRY_BYTES,
            complete_in_background: false,
            max_waiters: fc::DEFAULT_MAX_WAITERS,
            batch_max: fc::DEFAULT_BATCH_MAX,
            max_buffered_bytes: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Match {
    Path(String),
    Prefix(String),
}

/// A protected route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub method: String,
    pub matcher: Match,
    pub key: KeyPolicy,
    pub on_5xx: On5xx,
    pub on_state_unavailable: OnStateUnavailable,
    pub on_unknown: OnUnknown,
    pub reconcile: Option<Reconcile>,
    pub lease_ms: Option<u64>,
    pub heartbeat_ms: Option<u64>,
    pub max_request_body_bytes: Option<u64>,
    /// How long its records are kept (`state.retention_s` when `None`).
    pub retention_s: Option<u64>,
    /// The longest a retry with `Prefer: wait` waits for a running key (0: never).
    pub max_wait_s: u64,
    /// What of a JSON body the fingerprint covers.
    pub fingerprint: fc::Selection,
    /// The key from this body member instead of the `Idempotency-Key` header.
    pub key_from: Option<fc::Pointer>,
}

impl Route {
    /// A route with the filter's defaults.
    pub fn new(method: &str, matcher: Match, key: KeyPolicy) -> Self {
        Self {
            method: method.to_owned(),
            matcher,
            key,
            on_5xx: On5xx::Store,
            on_state_unavailable: OnStateUnavailable::FailClosed,
            on_unknown: OnUnknown::Hold,
            reconcile: None,
            lease_ms: None,
            heartbeat_ms: None,
            max_request_body_bytes: None,
            retention_s: None,
            max_wait_s: fc::DEFAULT_MAX_WAIT_S,
            fingerprint: fc::Selection::Whole,
            key_from: None,
        }
    }
}

/// Where the upstream tells what became of a key (`on_unknown = "reconcile"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconcile {
    pub method: String,
    /// With `{key}`.
    pub path: String,
    /// Another service than the upstream, when set.
    pub upstream: Option<Endpoint>,
    pub timeout_ms: u64,
}

/// A checked configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin: Option<SocketAddr>,
    pub upstream: Endpoint,
    /// Envoy's route timeout for every request to the upstream.
    pub upstream_timeout_ms: u64,
    /// Envoy's worker threads (`--concurrency`).
    pub envoy_workers: u32,
    /// This deployment's part of every record's scope (`""`: none): deployments that share a
    /// state API and database never see each other's keys.
    pub namespace: String,
    pub state: State,
    pub subject: Subject,
    pub filter: Filter,
    pub routes: Vec<Route>,
    /// `[mesh]`: what `edge render --target istio|envoy-gateway` needs besides.
    pub mesh: MeshSettings,
    /// The line of each field that was read from a file (`"listen"`, `"state.listen"`, ...), for
    /// errors found later (a port in use).
    pub lines: BTreeMap<String, usize>,
    /// The file it was read from.
    pub file: String,
}

pub const DEFAULT_STATE_LISTEN: &str = "127.0.0.1:8081";
pub const DEFAULT_POSTGRES_PORT: u16 = 54330;
pub const DEFAULT_UPSTREAM_TIMEOUT_MS: u64 = 60_000;
pub const DEFAULT_SUBJECT_HEADER: &str = "x-jwt-sub";
/// The state API's `--max-retention-s` default (30 days) and bound (ten years).
pub const DEFAULT_MAX_RETENTION_S: u64 = 30 * 86_400;
pub const MAX_RETENTION_S: u64 = 10 * 365 * 86_400;

// ---------------------------------------------------------------------------------------------
// The file as written

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    listen: Spanned<String>,
    admin: Option<Spanned<String>>,
    upstream: Spanned<String>,
    upstream_timeout_ms: Option<Spanned<u64>>,
    envoy_workers: Option<Spanned<u32>>,
    namespace: Option<Spanned<String>>,
    #[serde(default)]
    state: RawState,
    subject: Spanned<RawSubject>,
    #[serde(default)]
    filter: RawFilter,
    #[serde(rename = "route", default)]
    routes: Vec<Spanned<RawRoute>>,
    mesh: Option<Spanned<RawMesh>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMesh {
    namespace: Option<Spanned<String>>,
    state_api_image: Option<Spanned<String>>,
    filter_image: Option<Spanned<String>>,
    replicas: Option<Spanned<u32>>,
    state_api_url: Option<Spanned<String>>,
    istio_namespace: Option<Spanned<String>>,
    istio_labels: Option<Spanned<BTreeMap<String, String>>>,
    gateway: Option<Spanned<String>>,
    gateway_namespace: Option<Spanned<String>>,
    gateway_listener: Option<Spanned<String>>,
    gateway_proxy_namespace: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawState {
    listen: Option<Spanned<String>>,
    database_url: Option<Spanned<String>>,
    postgres_port: Option<Spanned<u16>>,
    token: Option<Spanned<String>>,
    key_secret: Option<Spanned<String>>,
    previous_key_secret: Option<Spanned<String>>,
    storage_key: Option<Spanned<String>>,
    previous_storage_key: Option<Spanned<String>>,
    timeout_ms: Option<Spanned<u64>>,
    retention_s: Option<Spanned<u64>>,
    max_retention_s: Option<Spanned<u64>>,
    admin_token: Option<Spanned<String>>,
    tls: Option<Spanned<RawStateTls>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStateTls {
    cert_file: Option<Spanned<String>>,
    key_file: Option<Spanned<String>>,
    ca_file: Option<Spanned<String>>,
    server_name: Option<Spanned<String>>,
    client_cert_file: Option<Spanned<String>>,
    client_key_file: Option<Spanned<String>>,
    client_ca_file: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSubject {
    jwt: Option<Spanned<RawJwt>>,
    header: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJwt {
    issuer: Spanned<String>,
    audiences: Spanned<Vec<String>>,
    jwks_file: Option<Spanned<String>>,
    jwks_url: Option<Spanned<String>>,
    header: Option<Spanned<String>>,
    claim: Option<Spanned<String>>,
    forward_token: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawFilter {
    lease_ms: Option<Spanned<u64>>,
    heartbeat_ms: Option<Spanned<u64>>,
    max_request_body_bytes: Option<Spanned<u64>>,
    max_stored_body_bytes: Option<Spanned<u64>>,
    replay_extra_headers: Option<Spanned<Vec<String>>>,
    replay_cache_bytes: Option<u64>,
    replay_cache_ttl_ms: Option<u64>,
    in_flight_cache_ms: Option<Spanned<u64>>,
    complete_retry_ms: Option<u64>,
    complete_retry_bytes: Option<u64>,
    complete_in_background: Option<Spanned<bool>>,
    max_waiters: Option<Spanned<u64>>,
    batch_max: Option<Spanned<u64>>,
    max_buffered_bytes: Option<Spanned<u64>>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawKey {
    Required,
    Optional,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawOn5xx {
    Store,
    Release,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawOnStateUnavailable {
    FailClosed,
    FailOpen,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawOnUnknown {
    Hold,
    Reconcile,
    Reexecute,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    method: Spanned<String>,
    path: Option<Spanned<String>>,
    prefix: Option<Spanned<String>>,
    key: RawKey,
    on_5xx: Option<RawOn5xx>,
    on_state_unavailable: Option<RawOnStateUnavailable>,
    on_unknown: Option<Spanned<RawOnUnknown>>,
    reconcile: Option<Spanned<RawReconcile>>,
    lease_ms: Option<Spanned<u64>>,
    heartbeat_ms: Option<Spanned<u64>>,
    max_request_body_bytes: Option<Spanned<u64>>,
    retention_s: Option<Spanned<u64>>,
    max_wait_s: Option<Spanned<u64>>,
    fingerprint: Option<Spanned<RawFingerprint>>,
    key_from: Option<Spanned<String>>,
}

/// `{ ignore = [...] }` or `{ include = [...] }`: RFC 6901 JSON pointers.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFingerprint {
    ignore: Option<Vec<String>>,
    include: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReconcile {
    path: Spanned<String>,
    method: Option<Spanned<String>>,
    upstream: Option<Spanned<String>>,
    timeout_ms: Option<Spanned<u64>>,
}

// ---------------------------------------------------------------------------------------------
// Reading and checking

/// Turns byte offsets into line numbers, and errors into [`ConfigError::At`].
struct Source<'a> {
    file: &'a str,
    text: &'a str,
}

impl Source<'_> {
    fn line(&self, offset: usize) -> usize {
        1 + self
            .text
            .get(..offset.min(self.text.len()))
            .unwrap_or("")
            .bytes()
            .filter(|b| *b == b'\n')
            .count()
    }

    fn at<T>(
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

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn is_header_name(s: &str) -> bool {
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

    /// An error about field `name`, at its line when it came from a file.
    pub fn error_at(&self, name: &str, message: String) -> ConfigError {
        match self.lines.get(name) {
            Some(line) => ConfigError::At {
                file: self.file.clone(),
                line: *line,
                message,
            },
            None => ConfigError::Invalid(message),
        }
    }

    /// Whether the state API runs on an embedded Postgres (no `state.database_url`).
    pub fn embedded_postgres(&self) -> bool {
        self.state.database_url.is_none()
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

fn subject(
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

/// `[state.tls]`: every file readable PEM of the right kind (relative to the configuration
/// file's folder), the client certificate and key together, and a client certificate exactly
/// when the state API is told to check one.
fn state_tls(
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
fn check_pem_file(path: &Path, kind: PemKind) -> Result<(), String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
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
    Err(match kind {
        PemKind::Certificate => format!(
            "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            path.display()
        ),
        PemKind::PrivateKey => format!(
            "{} holds no PEM private key (-----BEGIN PRIVATE KEY-----)",
            path.display()
        ),
    })
}

/// A JWKS file Envoy can load: JSON with a non-empty `keys` array.
fn check_jwks_file(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    match v.get("keys").and_then(|k| k.as_array()) {
        Some(keys) if !keys.is_empty() => Ok(()),
        _ => Err(format!(
            "{} has no \"keys\" (a JWKS document)",
            path.display()
        )),
    }
}

/// A lease the state API grants and a heartbeat that comes at least twice within it.
fn check_lease(
    src: &Source<'_>,
    lease: (u64, std::ops::Range<usize>),
    heartbeat: (u64, std::ops::Range<usize>),
    what: &str,
) -> Result<(), ConfigError> {
    if !(contract::limits::MIN_LEASE_MS..=contract::limits::MAX_LEASE_MS).contains(&lease.0) {
        return src.at(
            lease.1,
            format!(
                "{what}lease_ms must be {} to {} (what the state API grants)",
                contract::limits::MIN_LEASE_MS,
                contract::limits::MAX_LEASE_MS
            ),
        );
    }
    if heartbeat.0 == 0 || heartbeat.0.saturating_mul(2) > lease.0 {
        return src.at(
            heartbeat.1,
            format!(
                "{what}lease_ms ({} ms) is shorter than two heartbeats ({what}heartbeat_ms {} ms): one lost heartbeat would let it run out",
                lease.0, heartbeat.0
            ),
        );
    }
    Ok(())
}

fn filter(src: &Source<'_>, raw: &RawFilter) -> Result<Filter, ConfigError> {
    let d = Filter::default();
    let val = |v: &Option<Spanned<u64>>, default: u64| v.as_ref().map_or(default, |s| *s.get_ref());
    let span = |v: &Option<Spanned<u64>>| v.as_ref().map_or(0..0, Spanned::span);
    let f = Filter {
        lease_ms: val(&raw.lease_ms, d.lease_ms),
        heartbeat_ms: val(&raw.heartbeat_ms, d.heartbeat_ms),
        max_request_body_bytes: val(&raw.max_request_body_bytes, d.max_request_body_bytes),
        max_stored_body_bytes: val(&raw.max_stored_body_bytes, d.max_stored_body_bytes),
        replay_extra_headers: raw
            .replay_extra_headers
            .as_ref()
            .map(|h| h.get_ref().iter().map(|n| n.to_ascii_lowercase()).collect())
            .unwrap_or_default(),
        replay_cache_bytes: raw.replay_cache_bytes.unwrap_or(d.replay_cache_bytes),
        replay_cache_ttl_ms: raw.replay_cache_ttl_ms.unwrap_or(d.replay_cache_ttl_ms),
        in_flight_cache_ms: val(&raw.in_flight_cache_ms, d.in_flight_cache_ms),
        complete_retry_ms: raw.complete_retry_ms.unwrap_or(d.complete_retry_ms),
        complete_retry_bytes: raw.complete_retry_bytes.unwrap_or(d.complete_retry_bytes),
        complete_in_background: raw
            .complete_in_background
            .as_ref()
            .is_some_and(|b| *b.get_ref()),
        max_waiters: val(&raw.max_waiters, d.max_waiters),
        batch_max: val(&raw.batch_max, d.batch_max),
        // Checked against the routes' bodies by the filter's own parse of the rendered file.
        max_buffered_bytes: raw.max_buffered_bytes.as_ref().map(|v| *v.get_ref()),
    };
    let most_batched = contract::wire::MAX_BATCH_CLAIMS as u64;
    if !(1..=most_batched).contains(&f.batch_max) {
        return src.at(
            span(&raw.batch_max),
            format!("filter.batch_max must be 1 to {most_batched}"),
        );
    }
    if f.max_waiters > fc::MAX_WAITERS {
        return src.at(
            span(&raw.max_waiters),
            format!("filter.max_waiters must be at most {}", fc::MAX_WAITERS),
        );
    }
    let lease_span = raw
        .lease_ms
        .as_ref()
        .or(raw.heartbeat_ms.as_ref())
        .map_or(0..0, Spanned::span);
    let hb_span = raw
        .heartbeat_ms
        .as_ref()
        .or(raw.lease_ms.as_ref())
        .map_or(0..0, Spanned::span);
    check_lease(
        src,
        (f.lease_ms, lease_span),
        (f.heartbeat_ms, hb_span),
        "filter.",
    )?;
    if f.max_request_body_bytes == 0 {
        return src.at(
            span(&raw.max_request_body_bytes),
            "filter.max_request_body_bytes must be > 0",
        );
    }
    if f.max_stored_body_bytes == 0
        || f.max_stored_body_bytes > contract::limits::MAX_STORED_BODY_BYTES
    {
        return src.at(
            span(&raw.max_stored_body_bytes),
            format!(
                "filter.max_stored_body_bytes must be 1 to {} (the most the state API stores)",
                contract::limits::MAX_STORED_BODY_BYTES
            ),
        );
    }
    if f.in_flight_cache_ms > fc::MAX_IN_FLIGHT_CACHE_MS {
        return src.at(
            span(&raw.in_flight_cache_ms),
            format!(
                "filter.in_flight_cache_ms must be at most {}",
                fc::MAX_IN_FLIGHT_CACHE_MS
            ),
        );
    }
    if let Some(h) = &raw.replay_extra_headers {
        if let Some(bad) = f
            .replay_extra_headers
            .iter()
            .find(|n| !is_header_name(n) || filter_core::headers::never_replayed(n))
        {
            return src.at(
                h.span(),
                format!(
                    "filter.replay_extra_headers: {bad:?} is not a header that can be replayed"
                ),
            );
        }
    }
    if f.complete_in_background && (f.complete_retry_ms == 0 || f.complete_retry_bytes == 0) {
        let at = raw
            .complete_in_background
            .as_ref()
            .map_or(0..0, Spanned::span);
        return src.at(at, "filter.complete_in_background needs complete_retry_ms and complete_retry_bytes above 0");
    }
    Ok(f)
}

fn route(src: &Source<'_>, raw: &Spanned<RawRoute>, filter: &Filter) -> Result<Route, ConfigError> {
    let r = raw.get_ref();
    let method = r.method.get_ref().to_ascii_uppercase();
    if !is_token(&method) {
        return src.at(r.method.span(), "route.method must be an HTTP method");
    }
    let matcher = match (&r.path, &r.prefix) {
        (Some(p), None) => Match::Path(route_path(src, p, "path")?),
        (None, Some(p)) => Match::Prefix(route_path(src, p, "prefix")?),
        (Some(_), Some(p)) => {
            return src.at(p.span(), "a route has either path or prefix, not both")
        }
        (None, None) => {
            return src.at(
                raw.span(),
                "a route needs path = \"...\" or prefix = \"...\"",
            )
        }
    };
    let lease = r.lease_ms.as_ref().map(|l| *l.get_ref());
    let heartbeat = r.heartbeat_ms.as_ref().map(|h| *h.get_ref());
    if lease.is_some() || heartbeat.is_some() {
        let lease_span = r
            .lease_ms
            .as_ref()
            .or(r.heartbeat_ms.as_ref())
            .map_or(0..0, Spanned::span);
        let hb_span = r
            .heartbeat_ms
            .as_ref()
            .or(r.lease_ms.as_ref())
            .map_or(0..0, Spanned::span);
        check_lease(
            src,
            (lease.unwrap_or(filter.lease_ms), lease_span),
            (heartbeat.unwrap_or(filter.heartbeat_ms), hb_span),
            "route.",
        )?;
    }
    let max_body = match &r.max_request_body_bytes {
        Some(m) if *m.get_ref() == 0 => {
            return src.at(m.span(), "route.max_request_body_bytes must be > 0")
        }
        m => m.as_ref().map(|m| *m.get_ref()),
    };
    let retention_s = match &r.retention_s {
        Some(v) if *v.get_ref() == 0 => return src.at(v.span(), "route.retention_s must be > 0"),
        v => v.as_ref().map(|v| *v.get_ref()),
    };
    let max_wait_s = match &r.max_wait_s {
        Some(v) if v.get_ref().saturating_mul(1000) > contract::limits::MAX_WAIT_MS => {
            return src.at(
                v.span(),
                format!(
                    "route.max_wait_s must be at most {}",
                    contract::limits::MAX_WAIT_MS / 1000
                ),
            )
        }
        Some(v) => *v.get_ref(),
        None => fc::DEFAULT_MAX_WAIT_S,
    };
    let pointers = |list: &[String], name: &str| -> Result<Vec<fc::Pointer>, ConfigError> {
        list.iter()
            .map(|p| {
                fc::Pointer::parse(p).or_else(|e| {
                    let at = r.fingerprint.as_ref().map_or(raw.span(), Spanned::span);
                    src.at(at, format!("route.fingerprint.{name}: {e}"))
                })
            })
            .collect()
    };
    let fingerprint = match r.fingerprint.as_ref().map(|f| (f.get_ref(), f.span())) {
        None => fc::Selection::Whole,
        Some((RawFingerprint { ignore: Some(l), include: None }, _)) if !l.is_empty() => {
            fc::Selection::Ignore(pointers(l, "ignore")?)
        }
        Some((RawFingerprint { ignore: None, include: Some(l) }, _)) if !l.is_empty() => {
            fc::Selection::Include(pointers(l, "include")?)
        }
        Some((_, at)) => {
            return src.at(
                at,
                "route.fingerprint needs exactly one non-empty list: { ignore = [\"/pointer\", ...] } or { include = [...] }",
            )
        }
    };
    let key_from = match &r.key_from {
        Some(k) => Some(
            fc::Pointer::parse(k.get_ref())
                .or_else(|e| src.at(k.span(), format!("route.key_from: {e}")))?,
        ),
        None => None,
    };
    let on_unknown = match r.on_unknown.as_ref().map(|o| *o.get_ref()) {
        None | Some(RawOnUnknown::Hold) => OnUnknown::Hold,
        Some(RawOnUnknown::Reconcile) => OnUnknown::Reconcile,
        Some(RawOnUnknown::Reexecute) => OnUnknown::Reexecute,
    };
    let reconcile = match (&r.reconcile, on_unknown) {
        (Some(rc), OnUnknown::Reconcile) => Some(reconcile(src, rc)?),
        (None, OnUnknown::Reconcile) => {
            let at = r.on_unknown.as_ref().map_or(raw.span(), Spanned::span);
            return src.at(at, "on_unknown = \"reconcile\" needs reconcile = { path = \"/.../{key}\" }: where the upstream tells what became of a key");
        }
        (Some(rc), _) => {
            return src.at(
                rc.span(),
                "reconcile is only used with on_unknown = \"reconcile\"",
            )
        }
        (None, _) => None,
    };
    Ok(Route {
        method,
        matcher,
        key: match r.key {
            RawKey::Required => KeyPolicy::Required,
            RawKey::Optional => KeyPolicy::Optional,
        },
        on_5xx: match r.on_5xx {
            None | Some(RawOn5xx::Store) => On5xx::Store,
            Some(RawOn5xx::Release) => On5xx::Release,
        },
        on_state_unavailable: match r.on_state_unavailable {
            None | Some(RawOnStateUnavailable::FailClosed) => OnStateUnavailable::FailClosed,
            Some(RawOnStateUnavailable::FailOpen) => OnStateUnavailable::FailOpen,
        },
        on_unknown,
        reconcile,
        lease_ms: lease,
        heartbeat_ms: heartbeat,
        max_request_body_bytes: max_body,
        retention_s,
        max_wait_s,
        fingerprint,
        key_from,
    })
}

fn route_path(src: &Source<'_>, p: &Spanned<String>, name: &str) -> Result<String, ConfigError> {
    let v = p.get_ref();
    if !v.starts_with('/') || v.contains(['?', '#', ' ']) || v.bytes().any(|b| b.is_ascii_control())
    {
        return src.at(
            p.span(),
            format!("route.{name} must start with '/' and hold no query, fragment or space"),
        );
    }
    if v.len() > contract::limits::MAX_FIELD_LEN - 16 {
        return src.at(
            p.span(),
            format!("route.{name} is longer than the state API's endpoint limit"),
        );
    }
    Ok(v.clone())
}

fn reconcile(src: &Source<'_>, raw: &Spanned<RawReconcile>) -> Result<Reconcile, ConfigError> {
    let rc = raw.get_ref();
    let path = rc.path.get_ref();
    if !path.starts_with('/') || !path.contains("{key}") {
        return src.at(
            rc.path.span(),
            "reconcile.path must start with '/' and hold {key} (where the key goes)",
        );
    }
    let method = match &rc.method {
        Some(m) if !is_token(&m.get_ref().to_ascii_uppercase()) => {
            return src.at(m.span(), "reconcile.method must be an HTTP method")
        }
        Some(m) => m.get_ref().to_ascii_uppercase(),
        None => "GET".to_owned(),
    };
    let upstream = match &rc.upstream {
        Some(u) => Some(
            Endpoint::parse(u.get_ref())
                .or_else(|e| src.at(u.span(), format!("reconcile.upstream: {e}")))?,
        ),
        None => None,
    };
    let timeout_ms = match &rc.timeout_ms {
        Some(t) if *t.get_ref() == 0 || *t.get_ref() > 60_000 => {
            return src.at(t.span(), "reconcile.timeout_ms must be 1 to 60000")
        }
        Some(t) => *t.get_ref(),
        None => fc::DEFAULT_TIMEOUT_MS,
    };
    Ok(Reconcile {
        method,
        path: path.clone(),
        upstream,
        timeout_ms,
    })
}

/// A storage key as the state API takes it: 32 bytes in standard base64.
fn is_storage_key(text: &str) -> bool {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .is_ok_and(|k| k.len() == 32)
}

/// `[mesh]`: names and images the manifests need that `edge run` does not. Every field has a
/// default; the images' defaults are placeholders under `registry.invalid` (never resolvable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshSettings {
    /// The Kubernetes namespace of the state API.
    pub namespace: String,
    /// The state API's container image (the Dockerfile's `state-api` target: user 10001).
    pub state_api_image: String,
    /// The filter's OCI image (`make oci`'s compat tag), without `oci://`.
    pub filter_image: String,
    /// State API replicas: at least 2, so that one can be drained while the other serves.
    pub replicas: u32,
    /// An existing state API outside the cluster: no Kubernetes objects for it, a
    /// `ServiceEntry` (Istio) or a bootstrap cluster (Envoy Gateway) instead.
    pub external_state_api: Option<Endpoint>,
    /// Istio: the namespace and labels of the gateway Envoys the filter goes into.
    pub istio_namespace: String,
    pub istio_labels: BTreeMap<String, String>,
    /// Envoy Gateway: the Gateway (its namespace and HTTP listener) and the namespace its
    /// Envoys run in.
    pub gateway: String,
    pub gateway_namespace: String,
    pub gateway_listener: String,
    pub gateway_proxy_namespace: String,
}

impl Default for MeshSettings {
    fn default() -> Self {
        Self {
            namespace: "idempotency".into(),
            state_api_image: format!(
                "registry.invalid/edge-state-api:{}",
                env!("CARGO_PKG_VERSION")
            ),
            filter_image: format!(
                "registry.invalid/idempotency-filter:{}",
                env!("CARGO_PKG_VERSION")
            ),
            replicas: 2,
            external_state_api: None,
            istio_namespace: "istio-system".into(),
            istio_labels: BTreeMap::from([("istio".into(), "ingressgateway".into())]),
            gateway: "eg".into(),
            gateway_namespace: "default".into(),
            gateway_listener: "http".into(),
            gateway_proxy_namespace: "envoy-gateway-system".into(),
        }
    }
}

/// A Kubernetes object name (RFC 1123 label): what `[mesh]`'s names must be.
pub fn is_object_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Where Envoy reaches a service that listens on `addr` (a wildcard address is this host).
pub(crate) fn reachable(addr: SocketAddr) -> Endpoint {
    let host = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => "127.0.0.1".to_owned(),
        IpAddr::V6(ip) if ip.is_unspecified() => "::1".to_owned(),
        ip => ip.to_string(),
    };
    Endpoint {
        tls: false,
        host,
        port: addr.port(),
    }
}
