//! The plugin configuration (JSON in the Envoy Wasm filter's `configuration`), parsed and
//! checked once per worker in `on_configure`. An error here makes Envoy refuse the plugin; the
//! message names the field at fault.

use crate::headers;
pub use contract::fingerprint::{Pointer, Selection};
use contract::json::{self, Fields, Value};
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
    pub state_api: StateApi,
    pub subject: SubjectSource,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum KeyPolicy {
    /// No key: 400.
    Required,
    /// No key: passed through untouched.
    Optional,
}

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
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub authority: String,
    #[serde(default = "default_reconcile_method")]
    #[cfg_attr(feature = "schema", schemars(regex(pattern = TOKEN_PATTERN)))]
    pub method: String,
    /// The path, with `{key}` where the key goes (percent-encoded).
    #[cfg_attr(feature = "schema", schemars(regex(pattern = "^/.*\\{key\\}")))]
    pub path: String,
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
    /// This route's own lease, heartbeat and request body limit (the global ones when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = limits::MIN_LEASE_MS, max = limits::MAX_LEASE_MS)))]
    pub lease_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = MAX_HEARTBEAT_MS)))]
    pub heartbeat_ms: Option<u64>,
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

const CONFIG_FIELDS: &[&str] = &[
    "state_api",
    "subject",
    "routes",
    "max_request_body_bytes",
    "max_stored_body_bytes",
    "lease_ms",
    "heartbeat_ms",
    "replay_extra_headers",
    "replay_cache_bytes",
    "replay_cache_ttl_ms",
    "in_flight_cache_ms",
    "complete_retry_ms",
    "complete_retry_bytes",
    "complete_in_background",
    "namespace",
    "max_waiters",
    "batch_max",
    "max_buffered_bytes",
];
const STATE_API_FIELDS: &[&str] = &["cluster", "authority", "token", "timeout_ms"];
const ROUTE_FIELDS: &[&str] = &[
    "method",
    "path",
    "prefix",
    "key",
    "on_5xx",
    "on_state_unavailable",
    "on_unknown",
    "reconcile",
    "lease_ms",
    "heartbeat_ms",
    "max_request_body_bytes",
    "retention_s",
    "max_wait_s",
    "fingerprint",
    "key_from",
];
const RECONCILE_FIELDS: &[&str] = &["cluster", "authority", "method", "path", "timeout_ms"];

impl Config {
    /// The configuration as written, before [`Config::validate`].
    fn read(doc: &Value) -> Result<Self, String> {
        refuse_null(doc, "")?;
        let top = Fields::of(doc, "")?;
        top.deny_unknown(CONFIG_FIELDS)?;
        let s = Fields::of(top.required("state_api")?, "state_api")?;
        s.deny_unknown(STATE_API_FIELDS)?;
        let state_api = StateApi {
            cluster: s.str("cluster")?.to_owned(),
            authority: s.str("authority")?.to_owned(),
            token: s.str("token")?.to_owned(),
            timeout_ms: s.u64_or("timeout_ms", default_timeout_ms())?,
        };
        let subject = Fields::of(top.required("subject")?, "subject")?;
        subject.deny_unknown(&["header", "metadata"])?;
        let subject = match (subject.get("header"), subject.get("metadata")) {
            (Some(_), None) => SubjectSource::Header(subject.str("header")?.to_owned()),
            (None, Some(_)) => SubjectSource::Metadata(subject.strings("metadata")?),
            _ => return Err("subject must have exactly one of `header` or `metadata`".to_owned()),
        };
        let routes = match top.required("routes")? {
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, v)| Route::read(v, &format!("routes[{i}]")))
                .collect::<Result<Vec<_>, _>>()?,
            other => return Err(format!("routes must be an array, not {}", other.kind())),
        };
        Ok(Self {
            state_api,
            subject,
            routes,
            max_request_body_bytes: top.u64_or("max_request_body_bytes", default_max_body())?,
            max_stored_body_bytes: top.u64_or("max_stored_body_bytes", default_max_body())?,
            lease_ms: top.u64_or("lease_ms", default_lease_ms())?,
            heartbeat_ms: top.u64_or("heartbeat_ms", default_heartbeat_ms())?,
            replay_extra_headers: top.strings("replay_extra_headers")?,
            replay_cache_bytes: top.u64_or("replay_cache_bytes", default_replay_cache_bytes())?,
            replay_cache_ttl_ms: top
                .u64_or("replay_cache_ttl_ms", default_replay_cache_ttl_ms())?,
            in_flight_cache_ms: top.u64_or("in_flight_cache_ms", default_in_flight_cache_ms())?,
            complete_retry_ms: top.u64_or("complete_retry_ms", default_complete_retry_ms())?,
            complete_retry_bytes: top
                .u64_or("complete_retry_bytes", default_complete_retry_bytes())?,
            complete_in_background: top.bool_or("complete_in_background", false)?,
            namespace: top.opt_str("namespace")?.unwrap_or("").to_owned(),
            max_waiters: top.u64_or("max_waiters", default_max_waiters())?,
            batch_max: top.u64_or("batch_max", default_batch_max())?,
            max_buffered_bytes: top.opt_u64("max_buffered_bytes")?,
        })
    }
}

/// A route's `fingerprint`: exactly one of `ignore` or `include`, a non-empty list of pointers.
fn read_fingerprint(v: &Value, what: &str) -> Result<Selection, String> {
    let f = Fields::of(v, what)?;
    f.deny_unknown(&["ignore", "include"])?;
    let (name, selection): (&str, fn(Vec<Pointer>) -> Selection) =
        match (f.get("ignore"), f.get("include")) {
            (Some(_), None) => ("ignore", Selection::Ignore),
            (None, Some(_)) => ("include", Selection::Include),
            _ => return Err(format!("{what} needs exactly one of ignore or include")),
        };
    let texts = f.strings(name)?;
    if texts.is_empty() {
        return Err(format!(
            "{}: the list must not be empty (exactly one non-empty list: ignore or include)",
            f.path(name)
        ));
    }
    texts
        .iter()
        .enumerate()
        .map(|(i, p)| Pointer::parse(p).map_err(|e| format!("{}[{i}]: {e}", f.path(name))))
        .collect::<Result<Vec<_>, _>>()
        .map(selection)
}

/// `null` is no value here (the JSON Schema says so too): a field is given or left out.
fn refuse_null(v: &Value, path: &str) -> Result<(), String> {
    match v {
        Value::Null if path.is_empty() => Err("the document is null".to_owned()),
        Value::Null => Err(format!(
            "{path} is null: give it a value, or leave it out for its default"
        )),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| refuse_null(item, &format!("{path}[{i}]"))),
        Value::Object(members) => members.iter().try_for_each(|(name, member)| {
            let dot = if path.is_empty() { "" } else { "." };
            refuse_null(member, &format!("{path}{dot}{name}"))
        }),
        _ => Ok(()),
    }
}

impl Route {
    fn read(v: &Value, what: &str) -> Result<Self, String> {
        let r = Fields::of(v, what)?;
        r.deny_unknown(ROUTE_FIELDS)?;
        Ok(Self {
            method: r.str("method")?.to_owned(),
            path: r.opt_str("path")?.map(str::to_owned),
            prefix: r.opt_str("prefix")?.map(str::to_owned),
            key: r.variant(
                "key",
                &[
                    ("required", KeyPolicy::Required),
                    ("optional", KeyPolicy::Optional),
                ],
                None,
            )?,
            on_5xx: r.variant(
                "on_5xx",
                &[("store", On5xx::Store), ("release", On5xx::Release)],
                Some(On5xx::Store),
            )?,
            on_state_unavailable: r.variant(
                "on_state_unavailable",
                &[
                    ("fail_closed", OnStateUnavailable::FailClosed),
                    ("fail_open", OnStateUnavailable::FailOpen),
                ],
                Some(OnStateUnavailable::FailClosed),
            )?,
            on_unknown: r.variant(
                "on_unknown",
                &[
                    ("hold", OnUnknown::Hold),
                    ("reconcile", OnUnknown::Reconcile),
                    ("reexecute", OnUnknown::Reexecute),
                ],
                Some(OnUnknown::Hold),
            )?,
            reconcile: match r.get("reconcile") {
                None => None,
                Some(v) => {
                    let what = format!("{what}.reconcile");
                    let f = Fields::of(v, &what)?;
                    f.deny_unknown(RECONCILE_FIELDS)?;
                    Some(Reconcile {
                        cluster: f.str("cluster")?.to_owned(),
                        authority: f.str("authority")?.to_owned(),
                        method: f
                            .opt_str("method")?
                            .map_or_else(default_reconcile_method, str::to_owned),
                        path: f.str("path")?.to_owned(),
                        timeout_ms: f.u64_or("timeout_ms", default_timeout_ms())?,
                    })
                }
            },
            lease_ms: r.opt_u64("lease_ms")?,
            heartbeat_ms: r.opt_u64("heartbeat_ms")?,
            max_request_body_bytes: r.opt_u64("max_request_body_bytes")?,
            retention_s: r.opt_u64("retention_s")?,
            max_wait_s: r.u64_or("max_wait_s", default_max_wait_s())?,
            fingerprint: match r.get("fingerprint") {
                None => Selection::Whole,
                Some(v) => read_fingerprint(v, &format!("{what}.fingerprint"))?,
            },
            key_from: match r.opt_str("key_from")? {
                None => None,
                Some(p) => Some(Pointer::parse(p).map_err(|e| format!("{what}.key_from: {e}"))?),
            },
        })
    }
}

/// The JSON Schema of the plugin configuration, generated from [`Config`]'s types, in JSON
/// Schema draft 4: the draft Kong reads (a filter's `config_schema`), which every validator
/// also reads. `null` is no value anywhere: the reader refuses it too.
#[cfg(feature = "schema")]
pub fn json_schema() -> serde_json::Value {
    let generator = schemars::generate::SchemaSettings::draft07()
        .with(|s| {
            s.meta_schema = Some("http://json-schema.org/draft-04/schema#".into());
        })
        .into_generator();
    let mut schema = generator.into_root_schema_for::<Config>().to_value();
    as_draft4(&mut schema);
    schema
}

/// Draft 4 has no `const`: a one-value `enum` says the same. And an optional field is left
/// out, never `null` (schemars lets an `Option` be `null`).
#[cfg(feature = "schema")]
fn as_draft4(v: &mut serde_json::Value) {
    use serde_json::Value as J;
    let is_null_type = |t: &J| t.get("type").and_then(J::as_str) == Some("null");
    match v {
        J::Object(map) => {
            if let Some(c) = map.remove("const") {
                map.insert("enum".into(), J::Array(vec![c]));
            }
            if let Some(J::Array(types)) = map.get_mut("type") {
                types.retain(|t| t != "null");
                if let [only] = types.as_slice() {
                    let only = only.clone();
                    map.insert("type".into(), only);
                }
            }
            if let Some(J::Array(branches)) = map.get_mut("anyOf") {
                branches.retain(|b| !is_null_type(b));
                if branches.len() == 1 {
                    if let Some(branches) = map.remove("anyOf") {
                        map.insert("allOf".into(), branches);
                    }
                }
            }
            map.values_mut().for_each(as_draft4);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(as_draft4),
        _ => {}
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

/// A lease the state API grants, and a heartbeat at most half of it (a lease outlives a lost
/// heartbeat). `what` prefixes the field names (`routes[2].`).
fn check_lease(what: &str, lease_ms: u64, heartbeat_ms: u64) -> Result<(), ConfigError> {
    let dot = if what.is_empty() { "" } else { "." };
    if !(limits::MIN_LEASE_MS..=limits::MAX_LEASE_MS).contains(&lease_ms) {
        return err(format!(
            "{what}{dot}lease_ms must be {} to {} (the leases the state API grants)",
            limits::MIN_LEASE_MS,
            limits::MAX_LEASE_MS
        ));
    }
    if heartbeat_ms == 0 || heartbeat_ms.saturating_mul(2) > lease_ms {
        return err(format!("{what}{dot}heartbeat_ms must be > 0 and at most half of lease_ms (a lease outlives a lost heartbeat)"));
    }
    Ok(())
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

impl Config {
    /// Parse and check a plugin configuration.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let doc = json::parse(bytes).map_err(|e| ConfigError(e.to_string()))?;
        let mut cfg = Config::read(&doc).map_err(ConfigError)?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&mut self) -> Result<(), ConfigError> {
        let s = &self.state_api;
        if s.cluster.is_empty() {
            return err("state_api.cluster must not be empty");
        }
        if s.authority.is_empty() || s.authority.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return err("state_api.authority must be a non-empty host[:port]");
        }
        if s.token.is_empty() || s.token.bytes().any(|b| !(0x20..=0x7e).contains(&b)) {
            return err("state_api.token must be non-empty visible ASCII");
        }
        if s.timeout_ms == 0 {
            return err("state_api.timeout_ms must be > 0 (0 would mean no timeout)");
        }
        if s.timeout_ms > u64::from(u32::MAX) {
            return err("state_api.timeout_ms is too large");
        }
        match &mut self.subject {
            SubjectSource::Header(h) => {
                *h = h.to_ascii_lowercase();
                if !is_token(h) {
                    return err("subject.header must be a header name");
                }
            }
            SubjectSource::Metadata(path) => {
                if path.len() < 2 {
                    return err(
                        "subject.metadata must be [filter namespace, key, ...]: at least two parts",
                    );
                }
                if let Some(i) = path.iter().position(String::is_empty) {
                    return err(format!("subject.metadata[{i}] must not be empty"));
                }
            }
        }
        if self.routes.is_empty() {
            return err("routes must not be empty");
        }
        for (i, r) in self.routes.iter_mut().enumerate() {
            if !is_token(&r.method) {
                return err(format!("routes[{i}].method must be an HTTP method"));
            }
            r.method = r.method.to_ascii_uppercase();
            match (&r.path, &r.prefix) {
                (Some(p), None) | (None, Some(p)) => {
                    let name = if r.path.is_some() { "path" } else { "prefix" };
                    if !p.starts_with('/') || p.contains('?') || p.contains('#') {
                        return err(format!(
                            "routes[{i}].{name} must start with '/' and have no query or fragment"
                        ));
                    }
                }
                _ => return err(format!("routes[{i}] needs exactly one of path or prefix")),
            }
            match (r.on_unknown, &mut r.reconcile) {
                (OnUnknown::Reconcile, Some(rc)) => {
                    if rc.cluster.is_empty() {
                        return err(format!("routes[{i}].reconcile.cluster must not be empty"));
                    }
                    if rc.authority.is_empty() {
                        return err(format!("routes[{i}].reconcile.authority must not be empty"));
                    }
                    if !is_token(&rc.method) {
                        return err(format!(
                            "routes[{i}].reconcile.method must be an HTTP method"
                        ));
                    }
                    rc.method = rc.method.to_ascii_uppercase();
                    if !rc.path.starts_with('/') || !rc.path.contains("{key}") {
                        return err(format!(
                            "routes[{i}].reconcile.path must start with '/' and hold {{key}}"
                        ));
                    }
                    if rc.timeout_ms == 0 || rc.timeout_ms > u64::from(u32::MAX) {
                        return err(format!("routes[{i}].reconcile.timeout_ms must be > 0"));
                    }
                }
                (OnUnknown::Reconcile, None) => {
                    return err(format!(
                        "routes[{i}]: on_unknown \"reconcile\" needs a reconcile endpoint"
                    ))
                }
                (_, Some(_)) => {
                    return err(format!(
                        "routes[{i}].reconcile is only used with on_unknown \"reconcile\""
                    ))
                }
                (_, None) => {}
            }
        }
        if self.max_request_body_bytes == 0 {
            return err("max_request_body_bytes must be > 0");
        }
        // The global lease first: a route without its own inherits it, and the field to name is
        // the global one.
        check_lease("", self.lease_ms, self.heartbeat_ms)?;
        for i in 0..self.routes.len() {
            let what = format!("routes[{i}]");
            check_lease(&what, self.lease_for(i), self.heartbeat_for(i))?;
            if self.max_request_body_for(i) == 0 {
                return err(format!("{what}.max_request_body_bytes must be > 0"));
            }
            if let Some(r) = self.routes.get(i) {
                if r.retention_s == Some(0) {
                    return err(format!("{what}.retention_s must be > 0"));
                }
                if r.max_wait_s.saturating_mul(1000) > limits::MAX_WAIT_MS {
                    return err(format!(
                        "{what}.max_wait_s must be at most {}",
                        limits::MAX_WAIT_MS / 1000
                    ));
                }
            }
        }
        let largest_body = self.largest_request_body();
        if self.max_buffered_bytes() < largest_body {
            return err(format!(
                "max_buffered_bytes must be at least the largest request body a route accepts ({largest_body})"
            ));
        }
        if self.max_stored_body_bytes == 0
            || self.max_stored_body_bytes > limits::MAX_STORED_BODY_BYTES
        {
            return err(format!(
                "max_stored_body_bytes must be > 0 and at most {} (the most a state API stores)",
                limits::MAX_STORED_BODY_BYTES
            ));
        }
        if !limits::valid_namespace(&self.namespace) {
            return err(format!(
                "namespace must be at most {} of a-z 0-9 . _ -",
                limits::MAX_NAMESPACE_LEN
            ));
        }
        if self.max_waiters > MAX_WAITERS {
            return err(format!("max_waiters must be at most {MAX_WAITERS}"));
        }
        let most = contract::wire::MAX_BATCH_CLAIMS as u64;
        if !(1..=most).contains(&self.batch_max) {
            return err(format!("batch_max must be 1 to {most}"));
        }
        if self.in_flight_cache_ms > MAX_IN_FLIGHT_CACHE_MS {
            return err(format!(
                "in_flight_cache_ms must be at most {MAX_IN_FLIGHT_CACHE_MS}"
            ));
        }
        if self.complete_in_background && !self.retries_completes() {
            return err("complete_in_background needs complete_retry_ms and complete_retry_bytes above 0 (the worker stores the outcome)");
        }
        for (i, h) in self.replay_extra_headers.iter_mut().enumerate() {
            *h = h.to_ascii_lowercase();
            if !is_token(h) {
                return err(format!("replay_extra_headers[{i}] must be a header name"));
            }
            if headers::never_replayed(h) {
                return err(format!("replay_extra_headers[{i}]: {h} is never replayed"));
            }
        }
        Ok(())
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

    /// The largest request body of route `i`.
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    pub const EXAMPLE: &str = r#"{
      "state_api": {"cluster": "state_api", "authority": "state-api", "token": "secret", "timeout_ms": 1000},
      "subject": {"header": "x-jwt-sub"},
      "routes": [
        {"method": "POST", "path": "/checkout", "key": "required"},
        {"method": "POST", "path": "/refunds", "key": "required", "on_5xx": "store", "on_state_unavailable": "fail_closed"}
      ],
      "max_request_body_bytes": 1048576,
      "max_stored_body_bytes": 1048576,
      "lease_ms": 30000,
      "heartbeat_ms": 10000,
      "replay_extra_headers": [],
      "replay_cache_bytes": 8388608,
      "replay_cache_ttl_ms": 60000,
      "in_flight_cache_ms": 500,
      "complete_retry_ms": 600000,
      "complete_retry_bytes": 16777216
    }"#;

    fn with(patch: impl FnOnce(&mut serde_json::Value)) -> Result<Config, ConfigError> {
        let Ok(mut v) = serde_json::from_str::<serde_json::Value>(EXAMPLE) else {
            panic!("the example configuration is not JSON");
        };
        patch(&mut v);
        Config::parse(v.to_string().as_bytes())
    }

    #[test]
    fn the_documented_example_parses() {
        let c = Config::parse(EXAMPLE.as_bytes()).unwrap();
        assert_eq!(c.routes.len(), 2);
        assert_eq!(c.subject, SubjectSource::Header("x-jwt-sub".into()));
        assert_eq!(c.timeout(), Duration::from_millis(1000));
        assert_eq!(
            c.route("POST", "/checkout").map(|r| r.key),
            Some(KeyPolicy::Required)
        );
        assert!(c.route("GET", "/checkout").is_none());
        assert!(c.route("POST", "/checkout/x").is_none());
    }

    #[test]
    fn defaults_apply() {
        let c = Config::parse(
            br#"{"state_api":{"cluster":"c","authority":"a","token":"t"},"subject":{"metadata":["envoy.filters.http.jwt_authn","jwt_payload","sub"]},"routes":[{"method":"post","prefix":"/pay/","key":"optional"}]}"#,
        )
        .unwrap();
        assert_eq!(c.max_request_body_bytes, 1 << 20);
        assert_eq!(c.max_stored_body_bytes, 1 << 20);
        assert_eq!(
            (c.lease_ms, c.heartbeat_ms, c.state_api.timeout_ms),
            (30_000, 10_000, 1_000)
        );
        assert_eq!(
            (
                c.replay_cache_bytes,
                c.replay_cache_ttl_ms,
                c.in_flight_cache_ms
            ),
            (8 << 20, 60_000, 500)
        );
        assert_eq!(
            (c.complete_retry_ms, c.complete_retry_bytes),
            (600_000, 16 << 20)
        );
        assert!(c.retries_completes());
        assert!(!c.complete_in_background, "the response is held by default");
        assert_eq!(c.max_buffered_bytes(), 64 << 20);
        let big = with(|v| v["routes"][1]["max_request_body_bytes"] = (100 << 20).into()).unwrap();
        assert_eq!(
            big.max_buffered_bytes(),
            100 << 20,
            "room for the largest body"
        );
        let r = c.route("POST", "/pay/x").unwrap();
        assert_eq!(
            (r.on_5xx, r.on_state_unavailable),
            (On5xx::Store, OnStateUnavailable::FailClosed)
        );
    }

    #[test]
    fn a_route_may_have_its_own_lease_heartbeat_and_body_limit() {
        let c = with(|v| {
            v["routes"][1]["lease_ms"] = 4_000.into();
            v["routes"][1]["heartbeat_ms"] = 1_000.into();
            v["routes"][1]["max_request_body_bytes"] = 64.into();
        })
        .unwrap();
        assert_eq!((c.lease_for(0), c.heartbeat_for(0)), (30_000, 10_000));
        assert_eq!((c.lease_for(1), c.heartbeat_for(1)), (4_000, 1_000));
        assert_eq!(
            (c.max_request_body_for(0), c.max_request_body_for(1)),
            (1 << 20, 64)
        );
        assert_eq!(
            c.tick_period_ms(),
            250,
            "a quarter of the shortest heartbeat"
        );
        // Checked as the global ones are, and named by route.
        let e = with(|v| v["routes"][1]["heartbeat_ms"] = 20_000.into()).unwrap_err();
        assert!(e.to_string().contains("routes[1].heartbeat_ms"), "{e}");
        let e = with(|v| v["routes"][0]["lease_ms"] = 999.into()).unwrap_err();
        assert!(e.to_string().contains("routes[0].lease_ms"), "{e}");
        let e = with(|v| v["routes"][0]["max_request_body_bytes"] = 0.into()).unwrap_err();
        assert!(
            e.to_string().contains("routes[0].max_request_body_bytes"),
            "{e}"
        );
    }

    #[test]
    fn unknown_fields_are_refused_with_their_name() {
        let e = with(|v| v["lease"] = 5.into()).unwrap_err();
        assert!(e.to_string().contains("unknown field `lease`"), "{e}");
        let e = with(|v| v["routes"][0]["methods"] = "GET".into()).unwrap_err();
        assert!(e.to_string().contains("unknown field `methods`"), "{e}");
        let e = with(|v| v["routes"][0]["key"] = "sometimes".into()).unwrap_err();
        assert!(e.to_string().contains("unknown variant `sometimes`"), "{e}");
        assert!(Config::parse(b"not json").is_err());
    }

    #[test]
    fn invalid_values_are_refused() {
        type Patch = Box<dyn FnOnce(&mut serde_json::Value)>;
        let cases: Vec<(Patch, &str)> = vec![
            (
                Box::new(|v| v["state_api"]["timeout_ms"] = 0.into()),
                "timeout_ms",
            ),
            (
                Box::new(|v| v["heartbeat_ms"] = 30_000.into()),
                "heartbeat_ms",
            ),
            (
                Box::new(|v| v["heartbeat_ms"] = 15_001.into()),
                "at most half of lease_ms",
            ),
            (
                Box::new(|v| v["lease_ms"] = 0.into()),
                "lease_ms must be 1000 to 600000",
            ),
            (
                Box::new(|v| {
                    v["lease_ms"] = 2_000_000.into();
                    v["heartbeat_ms"] = 1_000_000.into();
                }),
                "lease_ms must be 1000 to 600000",
            ),
            (
                Box::new(|v| v["max_stored_body_bytes"] = (16 * 1024 * 1024 + 1).into()),
                "max_stored_body_bytes",
            ),
            (
                Box::new(|v| v["in_flight_cache_ms"] = 10_001.into()),
                "in_flight_cache_ms",
            ),
            (
                Box::new(|v| v["max_request_body_bytes"] = 0.into()),
                "max_request_body_bytes",
            ),
            (
                Box::new(|v| v["max_buffered_bytes"] = 1_048_575.into()),
                "max_buffered_bytes must be at least the largest request body a route accepts (1048576)",
            ),
            (
                Box::new(|v| {
                    v["max_buffered_bytes"] = 2_000_000.into();
                    v["routes"][1]["max_request_body_bytes"] = 2_000_001.into();
                }),
                "(2000001)",
            ),
            (
                Box::new(|v| v["max_stored_body_bytes"] = 0.into()),
                "max_stored_body_bytes",
            ),
            (Box::new(|v| v["routes"] = serde_json::json!([])), "routes"),
            (
                Box::new(|v| v["routes"][0]["path"] = "checkout".into()),
                "routes[0]",
            ),
            (
                Box::new(|v| v["routes"][1]["prefix"] = "/r".into()),
                "routes[1]",
            ),
            (
                Box::new(|v| v["state_api"]["cluster"] = "".into()),
                "cluster",
            ),
            (Box::new(|v| v["state_api"]["token"] = "".into()), "token"),
            (
                Box::new(|v| v["subject"] = serde_json::json!({"header": "x y"})),
                "subject",
            ),
            (
                Box::new(|v| {
                    v["subject"] = serde_json::json!({"header": "a", "metadata": ["a", "b"]})
                }),
                "",
            ),
            (
                Box::new(|v| v["replay_extra_headers"] = serde_json::json!(["Set-Cookie"])),
                "set-cookie",
            ),
            (
                Box::new(|v| v["replay_extra_headers"] = serde_json::json!(["connection"])),
                "connection",
            ),
        ];
        for (patch, needle) in cases {
            let e = with(patch).unwrap_err();
            assert!(
                e.to_string().contains(needle),
                "{e} should mention {needle}"
            );
        }
    }

    #[test]
    fn syntax_errors_say_where_and_numbers_are_integers() {
        let e = Config::parse(b"{\n  \"state_api\": }").unwrap_err();
        assert!(e.to_string().contains("at line 2 column 16"), "{e}");
        let e = with(|v| v["lease_ms"] = serde_json::json!(1.5)).unwrap_err();
        assert!(e.to_string().contains("integer"), "{e}");
        let e = with(|v| v["lease_ms"] = "30000".into()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid idempotency filter configuration: lease_ms must be a non-negative integer, not a string"
        );
        let twice = EXAMPLE.replacen(
            r#""lease_ms": 30000,"#,
            r#""lease_ms": 30000, "lease_ms": 1,"#,
            1,
        );
        let e = Config::parse(twice.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("duplicate field `lease_ms`"), "{e}");
        let e = with(|v| v["state_api"]["bogus"] = 1.into()).unwrap_err();
        assert!(
            e.to_string()
                .contains("unknown field `bogus` in state_api, expected one of `cluster`"),
            "{e}"
        );
        let e = with(|v| v["routes"][1]["on_5xx"] = "retry".into()).unwrap_err();
        assert!(
            e.to_string()
                .contains("unknown variant `retry` for routes[1].on_5xx"),
            "{e}"
        );
        let e = with(|v| {
            v.as_object_mut()
                .unwrap()
                .remove("routes")
                .map(|_| ())
                .unwrap()
        })
        .unwrap_err();
        assert!(e.to_string().contains("missing field `routes`"), "{e}");
    }

    #[test]
    fn cache_and_retries_can_be_turned_off() {
        let c = with(|v| {
            v["replay_cache_bytes"] = 0.into();
            v["complete_retry_ms"] = 0.into();
        })
        .unwrap();
        assert_eq!(c.replay_cache_bytes, 0);
        assert!(!c.retries_completes());
        let e = with(|v| v["replay_cache_bytes"] = (-1).into()).unwrap_err();
        assert!(
            e.to_string().contains("replay_cache_bytes") || e.to_string().contains("invalid value"),
            "{e}"
        );
    }

    #[test]
    fn completing_in_background_needs_the_workers_retries() {
        let c = with(|v| v["complete_in_background"] = true.into()).unwrap();
        assert!(c.complete_in_background);
        for field in ["complete_retry_ms", "complete_retry_bytes"] {
            let e = with(|v| {
                v["complete_in_background"] = true.into();
                v[field] = 0.into();
            })
            .unwrap_err();
            assert!(
                e.to_string().contains("complete_in_background needs"),
                "{e}"
            );
        }
        let e = with(|v| v["complete_in_background"] = "yes".into()).unwrap_err();
        assert!(e.to_string().contains("complete_in_background"), "{e}");
    }

    /// Every field away from its default: what serde writes, the reader reads back the same.
    /// The literals name every field, so a new one is written here too.
    fn every_field_set() -> Config {
        let pointer = |p: &str| Pointer::parse(p).unwrap();
        Config {
            state_api: StateApi {
                cluster: "outbound|8081||state-api.idem.svc.cluster.local".into(),
                authority: "state-api.idem.svc.cluster.local:8081".into(),
                token: "a token with spaces".into(),
                timeout_ms: 2_500,
            },
            subject: SubjectSource::Metadata(vec![
                "envoy.filters.http.jwt_authn".into(),
                "payload".into(),
                "sub".into(),
            ]),
            routes: vec![
                Route {
                    method: "POST".into(),
                    path: Some("/orders".into()),
                    prefix: None,
                    key: KeyPolicy::Optional,
                    on_5xx: On5xx::Release,
                    on_state_unavailable: OnStateUnavailable::FailOpen,
                    on_unknown: OnUnknown::Reconcile,
                    reconcile: Some(Reconcile {
                        cluster: "reconcile_0".into(),
                        authority: "orders:8080".into(),
                        method: "POST".into(),
                        path: "/attempts/{key}".into(),
                        timeout_ms: 700,
                    }),
                    lease_ms: Some(4_000),
                    heartbeat_ms: Some(1_000),
                    max_request_body_bytes: Some(4_096),
                    retention_s: Some(3_600),
                    max_wait_s: 3,
                    fingerprint: Selection::Include(vec![pointer("/amount"), pointer("/a~1b")]),
                    key_from: Some(pointer("/idempotency_key")),
                },
                Route {
                    method: "PUT".into(),
                    path: None,
                    prefix: Some("/refunds/".into()),
                    key: KeyPolicy::Required,
                    on_5xx: On5xx::Store,
                    on_state_unavailable: OnStateUnavailable::FailClosed,
                    on_unknown: OnUnknown::Reexecute,
                    reconcile: None,
                    lease_ms: None,
                    heartbeat_ms: None,
                    max_request_body_bytes: None,
                    retention_s: None,
                    max_wait_s: 0,
                    fingerprint: Selection::Ignore(vec![pointer("/sent_at")]),
                    key_from: None,
                },
            ],
            max_request_body_bytes: 2_048,
            max_stored_body_bytes: 3_072,
            lease_ms: 20_000,
            heartbeat_ms: 5_000,
            replay_extra_headers: vec!["x-charge-id".into()],
            replay_cache_bytes: 1_024,
            replay_cache_ttl_ms: 1_000,
            in_flight_cache_ms: 250,
            complete_retry_ms: 5_000,
            complete_retry_bytes: 4_096,
            complete_in_background: true,
            namespace: "shop-eu".into(),
            max_waiters: 7,
            batch_max: 5,
            max_buffered_bytes: Some(1 << 20),
        }
    }

    #[test]
    fn what_serde_writes_the_reader_reads_back_the_same() {
        let written = every_field_set();
        let json = serde_json::to_vec(&written).unwrap();
        assert_eq!(Config::parse(&json).unwrap(), written);
        let mut with_header = written;
        with_header.subject = SubjectSource::Header("x-jwt-sub".into());
        let json = serde_json::to_vec(&with_header).unwrap();
        assert_eq!(Config::parse(&json).unwrap(), with_header);
        // A route's absent options are left out, not written as null.
        let text = String::from_utf8(json).unwrap();
        assert!(!text.contains("null"), "{text}");
    }

    #[test]
    fn null_is_no_value() {
        let e = with(|v| v["lease_ms"] = serde_json::Value::Null).unwrap_err();
        assert!(e.to_string().contains(": lease_ms is null"), "{e}");
        let e = with(|v| v["routes"][1]["on_5xx"] = serde_json::Value::Null).unwrap_err();
        assert!(e.to_string().contains(": routes[1].on_5xx is null"), "{e}");
        let e = with(|v| v["replay_extra_headers"] = serde_json::json!(["a", null])).unwrap_err();
        assert!(
            e.to_string().contains(": replay_extra_headers[1] is null"),
            "{e}"
        );
    }

    #[test]
    fn extra_replay_headers_are_lower_cased() {
        let c = with(|v| v["replay_extra_headers"] = serde_json::json!(["X-Charge-Id"])).unwrap();
        assert_eq!(c.replay_extra_headers, vec!["x-charge-id".to_owned()]);
    }
}
