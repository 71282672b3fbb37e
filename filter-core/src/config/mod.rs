//! The plugin configuration (JSON in the Envoy Wasm filter's `configuration`), parsed and
//! checked once per worker in `on_configure`. An error here makes Envoy refuse the plugin; the
//! message names the field at fault.

pub use contract::fingerprint::{Pointer, Selection};
use contract::json;
// The JSON Schema's bounds are the state API's limits.
#[cfg(feature = "schema")]
use contract::limits;
use serde::Serialize;
use std::fmt;
use std::time::Duration;

pub const DEFAULT_MAX_BODY: u64 = 1024 * 1024;
pub const DEFAULT_LEASE_MS: u64 = 30_000;
pub const DEFAULT_HEARTBEAT_MS: u64 = 10_000;
pub const DEFAULT_TIMEOUT_MS: u64 = 1_000;
pub const DEFAULT_REPLAY_CACHE_BYTES: u64 = 8 * 1024 * 1024;
pub const DEFAULT_REPLAY_CACHE_TTL_MS: u64 = 60_000;
pub const DEFAULT_IN_FLIGHT_CACHE_MS: u64 = 500;
/// Longest `in_flight_cache_ms` accepted: a key finished elsewhere is replayed by this worker
/// at most that late (its retries get 409 with Retry-After meanwhile).
pub const MAX_IN_FLIGHT_CACHE_MS: u64 = 10_000;
/// A bound on `max_waiters` (each waiter holds a buffered request and a callout).
pub const MAX_WAITERS: u64 = 10_000;
pub const DEFAULT_COMPLETE_RETRY_MS: u64 = 600_000;
pub const DEFAULT_COMPLETE_RETRY_BYTES: u64 = 16 * 1024 * 1024;
/// Request body bytes a worker holds at once by default (64 bodies at the default limit), or
/// the largest body a route takes if more.
pub const DEFAULT_MAX_BUFFERED_BYTES: u64 = 64 * 1024 * 1024;

/// The plugin configuration. Unknown fields are refused everywhere.
///
/// The filter reads it with [`Config::parse`] (its own reader: serde's deserializer would cost
/// the module a third of its size); edge writes it with serde ([`Serialize`]), and its JSON
/// Schema is generated from these types (the `schema` feature, never in the module). Tests hold
/// the three to one another: every field written by serde is read back the same, every default
/// in the schema is the reader's, and every configuration the schema refuses the reader refuses,
/// naming the same field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(
    feature = "schema",
    schemars(
        title = "Idempotency filter plugin configuration",
        description = "The JSON configuration of the idempotency filter (proxy-wasm): Envoy's `configuration`, Istio's `pluginConfig`, Envoy Gateway's Wasm `config`. Generated from the filter's own types; docs/filter.md describes every field."
    )
)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// How the filter reaches the state API: its Envoy cluster, authority, token and timeout.
    pub state_api: StateApi,
    /// Where the authenticated subject comes from (a header or jwt_authn's dynamic metadata).
    pub subject: SubjectSource,
    /// The protected routes (at least one); every other request passes through untouched.
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub routes: Vec<Route>,
    /// The largest request body read (413 above); a default for the routes.
    #[serde(default = "default_max_body")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_request_body_bytes: u64,
    /// The largest response body stored to replay.
    #[serde(default = "default_max_body")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = limits::MAX_STORED_BODY_BYTES)))]
    pub max_stored_body_bytes: u64,
    /// The lease claims ask for; a default for the routes.
    #[serde(default = "default_lease_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = limits::MIN_LEASE_MS, max = limits::MAX_LEASE_MS)))]
    pub lease_ms: u64,
    /// How often a running claim's lease is extended (at most half of `lease_ms`); a default for
    /// the routes.
    #[serde(default = "default_heartbeat_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = MAX_HEARTBEAT_MS)))]
    pub heartbeat_ms: u64,
    /// Response headers replayed in addition to the built-in allowlist (lower-cased on load).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(inner(regex(pattern = HEADER_NAME_PATTERN))))]
    pub replay_extra_headers: Vec<String>,
    /// Bytes of completed records each worker keeps to answer replays without a callout
    /// (0: no cache).
    #[serde(default = "default_replay_cache_bytes")]
    pub replay_cache_bytes: u64,
    /// Longest a cached record is answered from memory, whatever its expiry (0: no cache).
    #[serde(default = "default_replay_cache_ttl_ms")]
    pub replay_cache_ttl_ms: u64,
    /// How long a worker answers 409 from memory for a key the state API reported in progress
    /// (never past the reported lease; 0: every duplicate asks the state API). Needs the replay
    /// cache.
    #[serde(default = "default_in_flight_cache_ms")]
    #[cfg_attr(feature = "schema", schemars(range(max = MAX_IN_FLIGHT_CACHE_MS)))]
    pub in_flight_cache_ms: u64,
    /// How long a worker keeps retrying a complete that failed while the response was held
    /// (0: give up after the in-stream retry, as before).
    #[serde(default = "default_complete_retry_ms")]
    pub complete_retry_ms: u64,
    /// Bytes of complete payloads each worker keeps for those retries (0: none).
    #[serde(default = "default_complete_retry_bytes")]
    pub complete_retry_bytes: u64,
    /// Let the response go on at once and store it from the worker (`true`), instead of
    /// holding it until `/v1/complete` has answered (`false`, the default). Needs the worker's
    /// complete retries (`complete_retry_ms` and `complete_retry_bytes` above 0).
    #[serde(default)]
    pub complete_in_background: bool,
    /// This deployment's part of every record's scope (`""`: none), so that several can share
    /// one state API and database without their keys ever meeting.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(regex(pattern = NAMESPACE_PATTERN)))]
    pub namespace: String,
    /// Requests of this worker that wait for a running key at once (`Prefer: wait`); more
    /// get 409 at once (counted).
    #[serde(default = "default_max_waiters")]
    #[cfg_attr(feature = "schema", schemars(range(max = MAX_WAITERS)))]
    pub max_waiters: u64,
    /// Most claims in one `/v1/claims` callout: the claims that queue on this worker while
    /// its previous claim is on its way go together when it is answered (1: every claim is
    /// its own callout).
    #[serde(default = "default_batch_max")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = contract::wire::MAX_BATCH_CLAIMS as u64)))]
    pub batch_max: u64,
    /// Most request body bytes this worker holds at once for protected requests it has not
    /// forwarded yet (counted by their Content-Length as soon as their headers arrive); a
    /// request that would go over gets 503 + Retry-After and nothing is forwarded. At least
    /// the largest request body of any route (the reader checks it; the schema cannot say
    /// it). Left out: 64 MiB, or that largest body if more.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_buffered_bytes: Option<u64>,
    /// Most of `max_buffered_bytes` the requests of one authenticated subject may hold on a
    /// worker at once (by the same count), so that one caller's slow or unfinished bodies
    /// cannot refuse every other caller's: beyond it that subject's request gets 503 +
    /// Retry-After, nothing forwarded. At least the largest request body of any route and at
    /// most `max_buffered_bytes` (the reader checks both). Left out: a quarter of
    /// `max_buffered_bytes`, or the largest body if more. Below `max_buffered_bytes`, the
    /// bound's last eighth is kept for callers who hold little ([`Config::buffer_reserve`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_buffered_bytes_per_subject: Option<u64>,
    /// Where a client asks what became of its key instead of sending the request again:
    /// `GET <path>?method=POST&path=/checkout` with its `Idempotency-Key` and its credentials
    /// (the same subject as the request's). The filter answers from the state API; nothing is
    /// forwarded. Its answer is scoped by the subject: with a `header` subject, require a
    /// verified token on `GET` of this path as on the routes (`edge render` does). Left out: no
    /// such path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(regex(pattern = "^/[!-~]*$")))]
    pub key_state_path: Option<String>,
}

pub const DEFAULT_BATCH_MAX: u64 = 32;

pub const DEFAULT_MAX_WAIT_S: u64 = 10;
pub const DEFAULT_MAX_WAITERS: u64 = 64;
/// A heartbeat is at most half the longest lease.
#[cfg(feature = "schema")]
const MAX_HEARTBEAT_MS: u64 = limits::MAX_LEASE_MS / 2;
/// An HTTP token (RFC 9110), as header names and methods are.
#[cfg(feature = "schema")]
const TOKEN_PATTERN: &str = "^[-!#$%&'*+.^_`|~0-9A-Za-z]+$";
#[cfg(feature = "schema")]
const HEADER_NAME_PATTERN: &str = TOKEN_PATTERN;
#[cfg(feature = "schema")]
const NAMESPACE_PATTERN: &str = "^[-._a-z0-9]{0,64}$";
/// An RFC 6901 pointer: `/` then tokens, `~` only as `~0` or `~1`.
#[cfg(feature = "schema")]
const POINTER_PATTERN: &str = "^(/([^~/]|~[01])*)+$";

// The defaults, read by the reader and named by serde's `default` (so the schema's `default`).
fn default_max_body() -> u64 {
    DEFAULT_MAX_BODY
}
fn default_lease_ms() -> u64 {
    DEFAULT_LEASE_MS
}
fn default_heartbeat_ms() -> u64 {
    DEFAULT_HEARTBEAT_MS
}
fn default_timeout_ms() -> u64 {
    DEFAULT_TIMEOUT_MS
}
fn default_replay_cache_bytes() -> u64 {
    DEFAULT_REPLAY_CACHE_BYTES
}
fn default_replay_cache_ttl_ms() -> u64 {
    DEFAULT_REPLAY_CACHE_TTL_MS
}
fn default_in_flight_cache_ms() -> u64 {
    DEFAULT_IN_FLIGHT_CACHE_MS
}
fn default_complete_retry_ms() -> u64 {
    DEFAULT_COMPLETE_RETRY_MS
}
fn default_complete_retry_bytes() -> u64 {
    DEFAULT_COMPLETE_RETRY_BYTES
}
fn default_max_waiters() -> u64 {
    DEFAULT_MAX_WAITERS
}
fn default_batch_max() -> u64 {
    DEFAULT_BATCH_MAX
}
fn default_max_wait_s() -> u64 {
    DEFAULT_MAX_WAIT_S
}
fn default_reconcile_method() -> String {
    "GET".to_owned()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct StateApi {
    /// An Envoy cluster name (not a URL).
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub cluster: String,
    /// The Envoy cluster for claims that wait (`Prefer: wait`), when it is another: the same
    /// state API over HTTP/2, so that a crowd of waiting claims shares a few connections while
    /// every other call keeps HTTP/1.1 keep-alive (cheaper per call). Unset: `cluster`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub wait_cluster: Option<String>,
    /// The `:authority` of the calls.
    #[cfg_attr(feature = "schema", schemars(regex(pattern = "^[!-~]+$")))]
    pub authority: String,
    /// Sent as `Authorization: Bearer <token>`.
    #[cfg_attr(feature = "schema", schemars(regex(pattern = "^[ -~]+$")))]
    pub token: String,
    /// The call timeout.
    #[serde(default = "default_timeout_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = u32::MAX)))]
    pub timeout_ms: u64,
}

/// Where the authenticated subject comes from: `{"header": ...}` or `{"metadata": [...]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SubjectSource {
    /// A request header set by an earlier filter from a verified token (e.g. jwt_authn
    /// `claim_to_headers`). Protected routes must require that filter's provider.
    Header(#[cfg_attr(feature = "schema", schemars(regex(pattern = HEADER_NAME_PATTERN)))] String),
    /// A path into the stream's dynamic metadata: filter namespace, then keys, e.g.
    /// `["envoy.filters.http.jwt_authn", "jwt_payload", "sub"]` (jwt_authn `payload_in_metadata`).
    Metadata(
        #[cfg_attr(feature = "schema", schemars(length(min = 2), inner(length(min = 1))))]
        Vec<String>,
    ),
}

/// Whether the route requires an `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum KeyPolicy {
    /// No key: 400.
    Required,
    /// No key: passed through untouched.
    Optional,
}

/// What an upstream 5xx does to the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum On5xx {
    /// Keep the 5xx as the outcome (replayed to retries), like Stripe.
    #[default]
    Store,
    /// Give the key back: only where the upstream itself dedupes on the forwarded key.
    Release,
}

/// What a retry of a request whose outcome is unknown (forwarded, never stored) gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnUnknown {
    /// 409 `outcome-unknown` until the owner stores its outcome or an operator resolves it.
    #[default]
    Hold,
    /// Ask the upstream what became of the key (`reconcile` below): replay what it did, 409 while
    /// it runs, run the request once more (with a larger token) if it never did.
    Reconcile,
    /// Run it again with a larger fencing token: only for an upstream that dedupes on the
    /// forwarded key and token itself.
    Reexecute,
}

/// Where the upstream tells what became of a key (the `on_unknown: "reconcile"` route's
/// `reconcile`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Reconcile {
    /// The Envoy cluster of the upstream.
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub cluster: String,
    /// The `:authority` of the reconcile calls.
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub authority: String,
    /// The method of the reconcile calls.
    #[serde(default = "default_reconcile_method")]
    #[cfg_attr(feature = "schema", schemars(regex(pattern = TOKEN_PATTERN)))]
    pub method: String,
    /// The path, with `{key}` where the key goes (percent-encoded).
    #[cfg_attr(feature = "schema", schemars(regex(pattern = "^/.*\\{key\\}")))]
    pub path: String,
    /// The reconcile call's timeout (no usable answer in time: 503, nothing forwarded).
    #[serde(default = "default_timeout_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = u32::MAX)))]
    pub timeout_ms: u64,
}

impl Reconcile {
    /// The path for `key`.
    pub fn path_for(&self, key: &str) -> String {
        let encoded: String = key
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        self.path.replace("{key}", &encoded)
    }
}

/// What the route does while the state API cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnStateUnavailable {
    /// 503 + Retry-After, nothing forwarded.
    #[default]
    FailClosed,
    /// Forward without protection (counted as `failed_open`).
    FailOpen,
}

/// A protected route: `method` and exactly one of `path` or `prefix`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(
    feature = "schema",
    schemars(extend("oneOf" = [{"required": ["path"]}, {"required": ["prefix"]}]))
)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// The HTTP method protected (`POST`).
    #[cfg_attr(feature = "schema", schemars(regex(pattern = TOKEN_PATTERN)))]
    pub method: String,
    /// Exact path match (the query is ignored).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(regex(pattern = ROUTE_PATH_PATTERN)))]
    pub path: Option<String>,
    /// Prefix match, instead of `path`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(regex(pattern = ROUTE_PATH_PATTERN)))]
    pub prefix: Option<String>,
    pub key: KeyPolicy,
    #[serde(default)]
    pub on_5xx: On5xx,
    #[serde(default)]
    pub on_state_unavailable: OnStateUnavailable,
    #[serde(default)]
    pub on_unknown: OnUnknown,
    /// With `on_unknown: reconcile`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reconcile: Option<Reconcile>,
    /// This route's own lease (the global `lease_ms` when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = limits::MIN_LEASE_MS, max = limits::MAX_LEASE_MS)))]
    pub lease_ms: Option<u64>,
    /// This route's own heartbeat interval (the global `heartbeat_ms` when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = MAX_HEARTBEAT_MS)))]
    pub heartbeat_ms: Option<u64>,
    /// This route's own request body limit (the global `max_request_body_bytes` when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_request_body_bytes: Option<u64>,
    /// How long its records are kept (the state API's default when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub retention_s: Option<u64>,
    /// The longest a retry with `Prefer: wait=N` waits for a running key (0: never).
    #[serde(default = "default_max_wait_s")]
    #[cfg_attr(feature = "schema", schemars(range(max = limits::MAX_WAIT_MS / 1000)))]
    pub max_wait_s: u64,
    /// What of a JSON body the fingerprint covers (all of it by default).
    #[serde(
        default,
        skip_serializing_if = "is_whole",
        serialize_with = "serialize_selection"
    )]
    #[cfg_attr(feature = "schema", schemars(with = "Option<FingerprintJson>"))]
    pub fingerprint: Selection,
    /// Take the key from this body member instead of the `Idempotency-Key` header.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_pointer"
    )]
    #[cfg_attr(
        feature = "schema",
        schemars(with = "Option<String>", regex(pattern = POINTER_PATTERN))
    )]
    pub key_from: Option<Pointer>,
}

/// A route's path or prefix: from `/`, without a query or fragment.
#[cfg(feature = "schema")]
const ROUTE_PATH_PATTERN: &str = "^/[^?#]*$";

/// How a [`Selection`] other than the whole body is written: `{"ignore": [...]}` or
/// `{"include": [...]}`, RFC 6901 pointers.
#[derive(Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(
    feature = "schema",
    schemars(
        description = "What of a JSON request body the fingerprint covers: all but some members, or only some (RFC 6901 pointers). The whole body when absent."
    )
)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum FingerprintJson<'a> {
    /// Everything except the values at these pointers (a timestamp, a trace id).
    Ignore(
        #[cfg_attr(
            feature = "schema",
            schemars(length(min = 1), inner(regex(pattern = POINTER_PATTERN)))
        )]
        Vec<&'a str>,
    ),
    /// Only the values at these pointers, in their places.
    Include(
        #[cfg_attr(
            feature = "schema",
            schemars(length(min = 1), inner(regex(pattern = POINTER_PATTERN)))
        )]
        Vec<&'a str>,
    ),
}

fn is_whole(s: &Selection) -> bool {
    *s == Selection::Whole
}

fn serialize_selection<S: serde::Serializer>(s: &Selection, out: S) -> Result<S::Ok, S::Error> {
    fn texts(p: &[Pointer]) -> Vec<&str> {
        p.iter().map(Pointer::as_str).collect()
    }
    match s {
        Selection::Whole => out.serialize_none(),
        Selection::Ignore(p) => FingerprintJson::Ignore(texts(p)).serialize(out),
        Selection::Include(p) => FingerprintJson::Include(texts(p)).serialize(out),
    }
}

fn serialize_pointer<S: serde::Serializer>(p: &Option<Pointer>, out: S) -> Result<S::Ok, S::Error> {
    match p {
        Some(p) => out.serialize_str(p.as_str()),
        None => out.serialize_none(),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid idempotency filter configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(msg.into()))
}

impl Config {
    /// Parse and check a plugin configuration.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let doc = json::parse(bytes).map_err(|e| ConfigError(e.to_string()))?;
        let mut cfg = Config::read(&doc).map_err(ConfigError)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The lease claims of route `i` ask for.
    pub fn lease_for(&self, i: usize) -> u64 {
        self.routes
            .get(i)
            .and_then(|r| r.lease_ms)
            .unwrap_or(self.lease_ms)
    }

    /// How often claims of route `i` are heartbeaten (at most).
    pub fn heartbeat_for(&self, i: usize) -> u64 {
        self.routes
            .get(i)
            .and_then(|r| r.heartbeat_ms)
            .unwrap_or(self.heartbeat_ms)
    }

    /// The largest request body any route accepts.
    fn largest_request_body(&self) -> u64 {
        (0..self.routes.len())
            .map(|i| self.max_request_body_for(i))
            .fold(self.max_request_body_bytes, u64::max)
    }

    /// Request body bytes a worker may hold at once: as configured, else 64 MiB or the largest
    /// body a route accepts if more.
    pub fn max_buffered_bytes(&self) -> u64 {
        self.max_buffered_bytes
            .unwrap_or_else(|| DEFAULT_MAX_BUFFERED_BYTES.max(self.largest_request_body()))
    }

    /// Request body bytes one subject's requests may hold on a worker at once: as configured,
    /// else a quarter of [`Config::max_buffered_bytes`] or the largest body if more.
    pub fn max_buffered_bytes_per_subject(&self) -> u64 {
        self.max_buffered_bytes_per_subject.unwrap_or_else(|| {
            (self.max_buffered_bytes() / 4)
                .max(self.largest_request_body())
                .min(self.max_buffered_bytes())
        })
    }

    /// Of [`Config::max_buffered_bytes`], the part a body may reach into only while its subject
    /// holds little ([`crate::flow::RESERVE_PER_SUBJECT`] with it): an eighth of the bound, but
    /// never so much that the largest body a route accepts no longer fits beside it; none where
    /// one subject may hold the whole bound (a deployment whose callers come as one identity).
    pub fn buffer_reserve(&self) -> u64 {
        let bound = self.max_buffered_bytes();
        if self.max_buffered_bytes_per_subject() >= bound {
            return 0;
        }
        (bound / 8).min(bound.saturating_sub(self.largest_request_body()))
    }

    /// The largest request body of route `i`.
    pub fn max_request_body_for(&self, i: usize) -> u64 {
        self.routes
            .get(i)
            .and_then(|r| r.max_request_body_bytes)
            .unwrap_or(self.max_request_body_bytes)
    }

    /// The first route matching this method and path (query already removed).
    pub fn route(&self, method: &str, path: &str) -> Option<&Route> {
        self.route_index(method, path)
            .and_then(|i| self.routes.get(i))
    }

    pub fn route_index(&self, method: &str, path: &str) -> Option<usize> {
        self.routes.iter().position(|r| {
            r.method == method
                && match (&r.path, &r.prefix) {
                    (Some(p), _) => p == path,
                    (None, Some(p)) => path.starts_with(p.as_str()),
                    (None, None) => false,
                }
        })
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.state_api.timeout_ms)
    }

    /// Whether a complete that failed in-stream is handed over to the worker.
    pub fn retries_completes(&self) -> bool {
        self.complete_retry_ms > 0 && self.complete_retry_bytes > 0
    }

    /// One line for the log when a worker is configured.
    pub fn summary(&self) -> String {
        format!(
            "{} route(s), state API cluster {:?}, lease {} ms, heartbeat {} ms, replay cache {} bytes, in-flight answers {} ms, {}",
            self.routes.len(),
            self.state_api.cluster,
            self.lease_ms,
            self.heartbeat_ms,
            self.replay_cache_bytes,
            self.in_flight_cache_ms,
            if self.complete_in_background {
                "responses go on before their outcome is stored"
            } else {
                "responses held until their outcome is stored"
            },
        )
    }

    /// How often the root context looks for leases to extend (ms): a quarter of the shortest
    /// heartbeat of any route.
    pub fn tick_period_ms(&self) -> u64 {
        let shortest = (0..self.routes.len())
            .map(|i| self.heartbeat_for(i))
            .chain([self.heartbeat_ms])
            .min()
            .unwrap_or(self.heartbeat_ms);
        (shortest / 4).max(50)
    }
}

mod read;
#[cfg(feature = "schema")]
mod schema;
#[cfg(feature = "schema")]
pub use schema::json_schema;
mod validate;

#[cfg(test)]
mod tests;
