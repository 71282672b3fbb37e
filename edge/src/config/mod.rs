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
use std::path::PathBuf;

use filter_core::config as fc;
pub use filter_core::config::{
    KeyPolicy, On5xx, OnStateUnavailable, OnUnknown, Pointer, Selection,
};

mod endpoint;
mod limits;
mod raw;
mod read;
mod routes;
mod source;
mod state;
mod state_tls;
mod subject;

/// The JSON Schema of the configuration file, generated from the types it is read into
/// (`raw.rs`): their doc comments are each field's reference text (`edge docs` renders it into
/// docs/reference/configuration.md).
pub fn file_schema() -> serde_json::Value {
    schemars::generate::SchemaSettings::draft07()
        .into_generator()
        .into_root_schema_for::<raw::RawFile>()
        .to_value()
}

pub use endpoint::{Endpoint, EndpointError};
pub use limits::Limits;

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
    /// A configuration built in code that the state API would refuse, or an address in use.
    #[error("{0}")]
    Invalid(String),
    /// The plugin configuration it renders, as the filter's own reader refuses it.
    #[error("{0}")]
    Filter(#[from] fc::ConfigError),
}

/// What is wrong with a file the configuration names (a PEM file, the JWKS): the
/// [`ConfigError`] that names it says which field and line.
#[derive(Debug, thiserror::Error)]
pub enum NamedFileError {
    #[error("cannot read {}: {source}", .path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", .path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} holds no PEM private key (-----BEGIN PRIVATE KEY-----)", .path.display())]
    NoPrivateKey { path: PathBuf },
    #[error("{} is not JSON: {source}", .path.display())]
    NotJson {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{} has no \"keys\" (a JWKS document)", .path.display())]
    NoKeys { path: PathBuf },
}

impl NamedFileError {
    /// The file's text, or why it cannot be read.
    fn read(path: &std::path::Path) -> Result<String, Self> {
        std::fs::read_to_string(path).map_err(|source| Self::Unreadable {
            path: path.to_owned(),
            source,
        })
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
    /// Most of those bytes one subject's requests hold at once (over it: that subject's
    /// request gets 503 + Retry-After). None: the filter's default (a quarter of the bound, or
    /// the largest body if more).
    pub max_buffered_bytes_per_subject: Option<u64>,
    /// Where a client asks what became of its key (`GET <path>?method=..&path=..`); None: off.
    pub key_state_path: Option<String>,
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
            max_buffered_bytes_per_subject: None,
            key_state_path: None,
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
    /// `[limits]`: Envoy's heap bound, connections and client timeouts.
    pub limits: Limits,
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

impl Config {
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
