//! The file as written: serde's types for the TOML, unknown fields refused, each value with
//! its span (for the line an error names). Their doc comments are the file's reference: `edge
//! docs` renders them (through the JSON Schema [`super::file_schema`] generates from these
//! types) into docs/reference/configuration.md, and refuses a field without one. A field's last
//! paragraph, when it starts with `Default:`, is its default column there.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFile {
    /// Where clients connect, `host:port`.
    #[schemars(with = "String")]
    pub(super) listen: Spanned<String>,
    /// Envoy's admin interface (`/ready`, `/stats`), `host:port`. Keep it on loopback:
    /// `/config_dump` shows the filter's token and `/quitquitquit` stops Envoy.
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) admin: Option<Spanned<String>>,
    /// The API being protected, `http://host[:port]` or `https://host[:port]` (TLS verified against
    /// `/etc/ssl/certs/ca-certificates.crt`, SAN = host).
    #[schemars(with = "String")]
    pub(super) upstream: Spanned<String>,
    /// Envoy's timeout for every request to the upstream. The connection manager's
    /// `stream_idle_timeout` is rendered above it (and above the filter's own waits, never below
    /// Envoy's 5 minutes), and no `request_timeout` or `max_stream_duration` is set, so none of
    /// Envoy's stream timeouts cuts a request the route's timeout still allows.
    ///
    /// Default: 60000.
    #[schemars(with = "Option<u64>")]
    pub(super) upstream_timeout_ms: Option<Spanned<u64>>,
    /// Envoy's worker threads.
    ///
    /// Default: 1.
    #[schemars(with = "Option<u32>")]
    pub(super) envoy_workers: Option<Spanned<u32>>,
    /// This deployment's part of every record's scope (up to 64 of `a-z 0-9 . _ -`): deployments
    /// that share one state API and database never meet ([Namespaces](features.md#namespaces)).
    ///
    /// Default: `""`.
    #[schemars(with = "Option<String>")]
    pub(super) namespace: Option<Spanned<String>>,
    /// `[state]`: the state API and its database.
    ///
    /// Default: every field's own default.
    #[serde(default)]
    pub(super) state: RawState,
    /// `[subject]`: who the caller is: `[subject.jwt]` (Envoy verifies a JWT) or `[subject] header`
    /// (a trusted layer in front sets it).
    #[schemars(with = "RawSubject")]
    pub(super) subject: Spanned<RawSubject>,
    /// `[filter]`: the filter's settings, defaults for every route.
    ///
    /// Default: every field's own default.
    #[serde(default)]
    pub(super) filter: RawFilter,
    /// `[limits]`: what hostile traffic may hold in Envoy: a memory budget (the filter's
    /// buffering bound and Envoy's heap bound), the connections it accepts, and how long a client
    /// may take
    /// ([Hostile load](../RELIABILITY.md#hostile-load-issue-49)).
    ///
    /// Default: every field's own default.
    #[serde(default)]
    pub(super) limits: RawLimits,
    /// `[[route]]`: a protected route, one table each. Only these are protected: every other
    /// request passes through untouched, except that the subject header is removed from every
    /// request so that only a verified token can set it.
    ///
    /// Default: none.
    #[schemars(with = "Vec<RawRoute>")]
    #[serde(rename = "route", default)]
    pub(super) routes: Vec<Spanned<RawRoute>>,
    /// `[mesh]`: for `edge render --target istio|envoy-gateway` only (`edge run` ignores it).
    /// `[state.tls]` is refused for a mesh target: inside the cluster the state API is reached over
    /// the cluster's network, admitted by the NetworkPolicy and the token ([Istio and Envoy
    /// Gateway](../deploying/mesh.md)).
    ///
    /// Default: none.
    #[schemars(with = "Option<RawMesh>")]
    pub(super) mesh: Option<Spanned<RawMesh>>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    /// What Envoy's memory may grow by above its idle footprint under load, in MiB (16 to
    /// 1048576). Half of it is the filter's buffering bound when `filter.max_buffered_bytes` is
    /// not set (shared by the workers, at least the largest body); Envoy's heap bound (the
    /// overload manager's `fixed_heap`) is 48 MiB more than the budget, or what a larger
    /// `max_buffered_bytes` costs (1.6 bytes of heap a byte held, and 16 MiB). As the heap nears
    /// the bound Envoy shortens idle connections' timeout (from 80 %), closes HTTP/1.1
    /// connections after their response and resets the streams that buffer the most (from 90 %;
    /// a reset stream that was forwarded is an unknown outcome), and refuses new requests (503)
    /// and connections (from 95 %). The Wasm VMs (about 50 MiB a worker) are not in the heap.
    ///
    /// Default: 80.
    #[schemars(with = "Option<u64>")]
    pub(super) memory_budget_mib: Option<Spanned<u64>>,
    /// Client connections Envoy accepts at once (the listener's limit and Envoy's global one,
    /// 16 to 10000000); past it a new connection is closed at once. An idle connection takes
    /// about 6 KiB of Envoy's heap: raise `memory_budget_mib` with it. Keep it below Envoy's open
    /// files limit (`ulimit -n`) less what its upstream connections need.
    ///
    /// Default: 12288.
    #[schemars(with = "Option<u64>")]
    pub(super) max_connections: Option<Spanned<u64>>,
    /// How long a client may take over a request's headers, from their first byte (Envoy's
    /// `request_headers_timeout`; 100 to 600000): past it, 408 and the connection closed. Nothing
    /// is claimed before the headers and the body are whole.
    ///
    /// Default: 10000.
    #[schemars(with = "Option<u64>")]
    pub(super) request_headers_timeout_ms: Option<Spanned<u64>>,
    /// How long a client may take over a whole request, headers and body (Envoy's
    /// `request_timeout`, 1000 to 86400000): a body sent a byte a second is cut there (408),
    /// before it is whole, so it never claims. Envoy disarms it when the last byte has come from
    /// the client (measured on 1.40), so it never fires while the filter claims, waits
    /// (`Prefer: wait`) or reconciles, nor on a forwarded request.
    ///
    /// Default: 60000.
    #[schemars(with = "Option<u64>")]
    pub(super) request_body_timeout_ms: Option<Spanned<u64>>,
    /// A client connection with no request in progress is closed after this (Envoy's
    /// `idle_timeout`, 1000 to 86400000); from 80 % of the heap bound it is shortened, down to a
    /// tenth at 95 %.
    ///
    /// Default: 60000.
    #[schemars(with = "Option<u64>")]
    pub(super) idle_timeout_ms: Option<Spanned<u64>>,
    /// How long an answer, whole in Envoy, may wait for a client that does not read it (an
    /// HTTP/2 client that keeps its window shut; Envoy's `stream_flush_timeout`, 1000 to
    /// 86400000): past it the stream is reset and its memory freed. The filter has stored the
    /// answer by then (or handed it to its worker to store, with `complete_in_background`), so
    /// the key's retry gets it replayed. Without it, such an answer waited for the stream's idle
    /// timeout, which the filter's waits set at 5 minutes or more. HTTP/1.1 clients are bounded
    /// by `idle_timeout_ms` instead. In `edge render`'s Envoy, from 80 % of the heap bound it is
    /// shortened, down to a tenth at 95 %.
    ///
    /// Default: 60000.
    #[schemars(with = "Option<u64>")]
    pub(super) response_flush_timeout_ms: Option<Spanned<u64>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMesh {
    /// The state API's namespace.
    ///
    /// Default: `idempotency`.
    #[schemars(with = "Option<String>")]
    pub(super) namespace: Option<Spanned<String>>,
    /// The state API's image.
    ///
    /// Default: `registry.invalid/edge-state-api:VERSION` (a placeholder).
    #[schemars(with = "Option<String>")]
    pub(super) state_api_image: Option<Spanned<String>>,
    /// The filter's OCI image (`oci://` optional).
    ///
    /// Default: `registry.invalid/idempotency-filter:VERSION` (a placeholder).
    #[schemars(with = "Option<String>")]
    pub(super) filter_image: Option<Spanned<String>>,
    /// State API replicas (at least 2).
    ///
    /// Default: 2.
    #[schemars(with = "Option<u32>")]
    pub(super) replicas: Option<Spanned<u32>>,
    /// A state API outside the cluster, `http(s)://host:port`: no Kubernetes objects for it.
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) state_api_url: Option<Spanned<String>>,
    /// Istio: the gateway Envoys' namespace.
    ///
    /// Default: `istio-system`.
    #[schemars(with = "Option<String>")]
    pub(super) istio_namespace: Option<Spanned<String>>,
    /// Istio: the gateway Envoys' labels.
    ///
    /// Default: `{ istio = "ingressgateway" }`.
    #[schemars(with = "Option<BTreeMap<String, String>>")]
    pub(super) istio_labels: Option<Spanned<BTreeMap<String, String>>>,
    /// Envoy Gateway: the Gateway.
    ///
    /// Default: `eg`.
    #[schemars(with = "Option<String>")]
    pub(super) gateway: Option<Spanned<String>>,
    /// Envoy Gateway: the Gateway's namespace.
    ///
    /// Default: `default`.
    #[schemars(with = "Option<String>")]
    pub(super) gateway_namespace: Option<Spanned<String>>,
    /// Envoy Gateway: its HTTP listener.
    ///
    /// Default: `http`.
    #[schemars(with = "Option<String>")]
    pub(super) gateway_listener: Option<Spanned<String>>,
    /// Envoy Gateway: where its Envoys run.
    ///
    /// Default: `envoy-gateway-system`.
    #[schemars(with = "Option<String>")]
    pub(super) gateway_proxy_namespace: Option<Spanned<String>>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawState {
    /// Where the state API listens (Envoy reaches it there).
    ///
    /// Default: `127.0.0.1:8081`.
    #[schemars(with = "Option<String>")]
    pub(super) listen: Option<Spanned<String>>,
    /// An existing Postgres (`postgres://…`; the user may create tables: migrations run at start;
    /// `?sslmode=verify-full&sslrootcert=…` for TLS). None: the embedded cluster.
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) database_url: Option<Spanned<String>>,
    /// The embedded cluster's loopback port.
    ///
    /// Default: 54330.
    #[schemars(with = "Option<u16>")]
    pub(super) postgres_port: Option<Spanned<u16>>,
    /// The filter's bearer token for the state API.
    ///
    /// Default: made once, kept in the run folder.
    #[schemars(with = "Option<String>")]
    pub(super) token: Option<Spanned<String>>,
    /// The HMAC secret for stored keys (16+ visible characters; the same on every state API
    /// replica; never changed without a rotation).
    ///
    /// Default: made once, kept in the run folder.
    #[schemars(with = "Option<String>")]
    pub(super) key_secret: Option<Spanned<String>>,
    /// During a rotation of `key_secret`: the one before; records are found under both, new ones
    /// use the new (drop it after the longest retention plus the unknown horizon and a lease;
    /// [Key rotation](../operating/key-rotation.md)).
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) previous_key_secret: Option<Spanned<String>>,
    /// The AES-256 key (32 bytes, base64: `openssl rand -base64 32`) that seals stored responses
    /// (headers and body) in the database.
    ///
    /// Default: made once by `edge run` and kept in the run folder (`storage-key`, 0600); `edge
    /// render` asks for one.
    #[schemars(with = "Option<String>")]
    pub(super) storage_key: Option<Spanned<String>>,
    /// During a rotation of `storage_key`: the one before; it only opens records sealed under it
    /// (drop it after the longest retention).
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) previous_storage_key: Option<Spanned<String>>,
    /// The filter's call timeout to the state API.
    ///
    /// Default: 1000.
    #[schemars(with = "Option<u64>")]
    pub(super) timeout_ms: Option<Spanned<u64>>,
    /// How long records are kept (a route may ask for its own).
    ///
    /// Default: 86400.
    #[schemars(with = "Option<u64>")]
    pub(super) retention_s: Option<Spanned<u64>>,
    /// The longest retention a route may ask for (a route asking more is refused here; the state
    /// API caps what it is sent).
    ///
    /// Default: 2592000 (30 days).
    #[schemars(with = "Option<u64>")]
    pub(super) max_retention_s: Option<Spanned<u64>>,
    /// The operators' bearer token for the admin API and `idemctl` (16+ visible characters, not the
    /// filter's token).
    ///
    /// Default: none: the admin API is off.
    #[schemars(with = "Option<String>")]
    pub(super) admin_token: Option<Spanned<String>>,
    /// `[state.tls]`: HTTPS between Envoy and the state API, mutual with a client certificate
    /// ([TLS](../deploying/tls.md)).
    ///
    /// Default: none: plain HTTP.
    #[schemars(with = "Option<RawStateTls>")]
    pub(super) tls: Option<Spanned<RawStateTls>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStateTls {
    /// The state API serves HTTPS with this certificate chain (PEM; relative to the file; reloaded
    /// on SIGHUP: `STATE_API_TLS_CERT`). Goes with `key_file`.
    ///
    /// Default: none: plain HTTP.
    #[schemars(with = "Option<String>")]
    pub(super) cert_file: Option<Spanned<String>>,
    /// The certificate's private key (PEM; relative to the file; reloaded on SIGHUP:
    /// `STATE_API_TLS_KEY`).
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) key_file: Option<Spanned<String>>,
    /// The CA Envoy verifies the state API's certificate against (PEM).
    ///
    /// Default: required with `[state.tls]`.
    #[schemars(with = "Option<String>")]
    pub(super) ca_file: Option<Spanned<String>>,
    /// The SNI Envoy sends and the subject alternative name it requires (a DNS name, or an IP
    /// address).
    ///
    /// Default: the host of `state.listen`.
    #[schemars(with = "Option<String>")]
    pub(super) server_name: Option<Spanned<String>>,
    /// Mutual TLS: the certificate Envoy presents (PEM). `client_cert_file`, `client_key_file` and
    /// `client_ca_file` go together.
    ///
    /// Default: none: no client certificate.
    #[schemars(with = "Option<String>")]
    pub(super) client_cert_file: Option<Spanned<String>>,
    /// Mutual TLS: its private key (PEM).
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) client_key_file: Option<Spanned<String>>,
    /// Mutual TLS: the state API accepts only clients signed by this CA
    /// (`STATE_API_TLS_CLIENT_CA`).
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) client_ca_file: Option<Spanned<String>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSubject {
    /// `[subject.jwt]`: Envoy's `jwt_authn` verifies a token on protected routes and the filter
    /// takes the subject from it; the subject header is removed from every client request.
    ///
    /// Default: one of `jwt` or `header` required.
    #[schemars(with = "Option<RawJwt>")]
    pub(super) jwt: Option<Spanned<RawJwt>>,
    /// Instead of `[subject.jwt]`: a header a trusted layer in front sets (an API gateway that
    /// verified the caller). **The risk:** whoever reaches the listener directly chooses the
    /// subject, so only use it when nothing else can.
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) header: Option<Spanned<String>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawJwt {
    /// The issuer of the tokens Envoy's `jwt_authn` accepts on protected routes.
    #[schemars(with = "String")]
    pub(super) issuer: Spanned<String>,
    /// The audiences accepted (at least one).
    #[schemars(with = "Vec<String>")]
    pub(super) audiences: Spanned<Vec<String>>,
    /// The keys, from a file (relative to the configuration file). One of `jwks_file` or `jwks_url`
    /// is required.
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) jwks_file: Option<Spanned<String>>,
    /// The keys, from a URL Envoy fetches through a cluster of its own (cached 5 min).
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) jwks_url: Option<Spanned<String>>,
    /// The header the subject is passed in (to the filter and the upstream).
    ///
    /// Default: `x-jwt-sub`.
    #[schemars(with = "Option<String>")]
    pub(super) header: Option<Spanned<String>>,
    /// The claim that is the subject.
    ///
    /// Default: `sub`.
    #[schemars(with = "Option<String>")]
    pub(super) claim: Option<Spanned<String>>,
    /// Whether the token goes on to the upstream.
    ///
    /// Default: true.
    pub(super) forward_token: Option<bool>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFilter {
    /// The lease claims ask for (1 s to 10 min); a default for the routes.
    ///
    /// Default: 30000.
    #[schemars(with = "Option<u64>")]
    pub(super) lease_ms: Option<Spanned<u64>>,
    /// How often a running claim's lease is extended (at most half of it); a default for the
    /// routes.
    ///
    /// Default: 10000.
    #[schemars(with = "Option<u64>")]
    pub(super) heartbeat_ms: Option<Spanned<u64>>,
    /// The largest request body (413 above); a default for the routes.
    ///
    /// Default: 1 MiB.
    #[schemars(with = "Option<u64>")]
    pub(super) max_request_body_bytes: Option<Spanned<u64>>,
    /// The largest response body kept to replay (up to 16 MiB; the state API is told the same).
    ///
    /// Default: 1 MiB.
    #[schemars(with = "Option<u64>")]
    pub(super) max_stored_body_bytes: Option<Spanned<u64>>,
    /// Response headers replayed besides the built-in list.
    ///
    /// Default: `[]`.
    #[schemars(with = "Option<Vec<String>>")]
    pub(super) replay_extra_headers: Option<Spanned<Vec<String>>>,
    /// Each worker's memory of completed records, to answer replays without a callout ([the replay
    /// cache](../filter.md#the-replay-cache)).
    ///
    /// Default: 8 MiB.
    pub(super) replay_cache_bytes: Option<u64>,
    /// The longest a cached record is answered from memory.
    ///
    /// Default: 60000.
    pub(super) replay_cache_ttl_ms: Option<u64>,
    /// How long a worker answers 409 from memory for a key the state API reported in progress
    /// (never past the reported lease).
    ///
    /// Default: 500.
    #[schemars(with = "Option<u64>")]
    pub(super) in_flight_cache_ms: Option<Spanned<u64>>,
    /// How long a failed `complete` is retried from the worker.
    ///
    /// Default: 600000.
    pub(super) complete_retry_ms: Option<u64>,
    /// Bytes of completes each worker keeps for those retries.
    ///
    /// Default: 16 MiB.
    pub(super) complete_retry_bytes: Option<u64>,
    /// Whether the response goes on at once and is stored right after (`true`), instead of waiting
    /// for its outcome to be stored ([holding the response, or
    /// not](parts.md#holding-the-response-or-not)).
    ///
    /// Default: false.
    #[schemars(with = "Option<bool>")]
    pub(super) complete_in_background: Option<Spanned<bool>>,
    /// Retries of one Envoy worker that may wait for a running key at once (`Prefer: wait`); more
    /// get 409 at once (up to 10,000; 0: nobody waits).
    ///
    /// Default: 64.
    #[schemars(with = "Option<u64>")]
    pub(super) max_waiters: Option<Spanned<u64>>,
    /// Most claims, and most held completes, one Envoy worker sends in one `/v1/writes` callout:
    /// those that come while another claim or held complete is on its way queue and go together
    /// when it is answered, with no timer (1: each is its own callout).
    ///
    /// Default: 32.
    #[schemars(with = "Option<u64>")]
    pub(super) batch_max: Option<Spanned<u64>>,
    /// Request body bytes one Envoy worker holds at once before forwarding (counted from each
    /// request's `Content-Length` as its headers arrive); a request that would go over gets `503
    /// edge-buffers-full` + `Retry-After: 1`, nothing claimed or forwarded. At least the largest
    /// body a route accepts. Bounds what the filter holds and forwards; Envoy's own memory is
    /// bounded by `[limits]` (a refused request's connection is closed, so what its client sent
    /// is not held).
    ///
    /// Default: half of `limits.memory_budget_mib` shared by the workers (40 MiB with one), or the
    /// largest route body if more.
    #[schemars(with = "Option<u64>")]
    pub(super) max_buffered_bytes: Option<Spanned<u64>>,
    /// Most of `max_buffered_bytes` the requests of one authenticated subject hold at once on a
    /// worker, by the same count: beyond it that subject's next request gets `503
    /// edge-buffers-full` + `Retry-After: 1`, while other subjects' requests still fit. One
    /// caller's slow or unfinished bodies (declaring 1 MiB and sending a byte a second) then
    /// cannot refuse every other caller's new keys. At least the largest body a route accepts,
    /// at most `max_buffered_bytes`. Below `max_buffered_bytes`, the last eighth of the bound
    /// (less if the largest body would not fit beside it) is kept for callers who hold little: a
    /// body reaching into it is admitted only while its caller then holds at most 64 KiB; set it
    /// to `max_buffered_bytes` where all callers come as one subject (no reserve then).
    ///
    /// Default: a quarter of `max_buffered_bytes`, or the largest route body if more.
    #[schemars(with = "Option<u64>")]
    pub(super) max_buffered_bytes_per_subject: Option<Spanned<u64>>,
    /// Where a client or a support tool asks what became of a key instead of sending the request
    /// again: `GET <path>?method=POST&path=/checkout` with the `Idempotency-Key` and the same
    /// credentials as the request (its subject scopes the answer). Answered by the filter from the
    /// state API, never forwarded; a verified token is required on it as on the routes ([Behaviour:
    /// asking about a key](behaviour.md#asking-about-a-key)).
    ///
    /// Default: none (off).
    #[schemars(with = "Option<String>")]
    pub(super) key_state_path: Option<Spanned<String>>,
}

#[derive(Deserialize, Clone, Copy, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawKey {
    Required,
    Optional,
}

#[derive(Deserialize, Clone, Copy, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawOn5xx {
    Store,
    Release,
}

#[derive(Deserialize, Clone, Copy, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawOnStateUnavailable {
    FailClosed,
    FailOpen,
}

#[derive(Deserialize, Clone, Copy, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawOnUnknown {
    Hold,
    Reconcile,
    Reexecute,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    /// The method protected (`POST`).
    #[schemars(with = "String")]
    pub(super) method: Spanned<String>,
    /// The exact path protected (no query). One of `path` or `prefix` is required.
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) path: Option<Spanned<String>>,
    /// A path prefix protected, instead of `path`.
    ///
    /// Default: none.
    #[schemars(with = "Option<String>")]
    pub(super) prefix: Option<Spanned<String>>,
    /// `required` (no key: 400) or `optional` (no key: passed through).
    pub(super) key: RawKey,
    /// `store` keeps the upstream's 5xx as the outcome (replayed); `release` gives the key back on
    /// a 5xx (only where the upstream dedupes on the key itself).
    ///
    /// Default: `store`.
    pub(super) on_5xx: Option<RawOn5xx>,
    /// `fail_closed`: 503 + `Retry-After` while the state API cannot be used, nothing forwarded;
    /// `fail_open`: forwarded unprotected (counted in `idempotency_failed_open`).
    ///
    /// Default: `fail_closed`.
    pub(super) on_state_unavailable: Option<RawOnStateUnavailable>,
    /// What a retry of an unknown outcome gets: `hold` (409 `outcome-unknown`), `reconcile` (ask
    /// the upstream), `reexecute` (run again with a larger fencing token; safe only for an upstream
    /// that keeps [the `reexecute`
    /// contract](../RELIABILITY.md#what-an-upstream-must-do-for-each-policy)).
    ///
    /// Default: `hold`.
    #[schemars(with = "Option<RawOnUnknown>")]
    pub(super) on_unknown: Option<Spanned<RawOnUnknown>>,
    /// With `on_unknown = "reconcile"`: `{ path = "/orders/attempts/{key}", method = "GET",
    /// upstream = "https://…", timeout_ms = 1000 }`, the endpoint that implements [the reconcile
    /// contract](../RELIABILITY.md#the-reconcile-contract).
    ///
    /// Default: none.
    #[schemars(with = "Option<RawReconcile>")]
    pub(super) reconcile: Option<Spanned<RawReconcile>>,
    /// This route's own lease.
    ///
    /// Default: `[filter] lease_ms`.
    #[schemars(with = "Option<u64>")]
    pub(super) lease_ms: Option<Spanned<u64>>,
    /// This route's own heartbeat interval.
    ///
    /// Default: `[filter] heartbeat_ms`.
    #[schemars(with = "Option<u64>")]
    pub(super) heartbeat_ms: Option<Spanned<u64>>,
    /// This route's own request body limit.
    ///
    /// Default: `[filter] max_request_body_bytes`.
    #[schemars(with = "Option<u64>")]
    pub(super) max_request_body_bytes: Option<Spanned<u64>>,
    /// How long this route's records are kept (at most `max_retention_s`), counted from the
    /// outcome.
    ///
    /// Default: `[state] retention_s`.
    #[schemars(with = "Option<u64>")]
    pub(super) retention_s: Option<Spanned<u64>>,
    /// The longest a retry with `Prefer: wait=N` waits for a running key (0: never; at most 60, and
    /// the state API's `STATE_API_MAX_WAIT_MS`, 30 s by default).
    ///
    /// Default: 10.
    #[schemars(with = "Option<u64>")]
    pub(super) max_wait_s: Option<Spanned<u64>>,
    /// What of a JSON body the fingerprint covers: `{ ignore = ["/meta/sent_at", "/trace"] }` or `{
    /// include = ["/amount", "/currency", "/card"] }`, RFC 6901 JSON pointers (array items by
    /// index, no `-`); an invalid pointer refuses the file.
    ///
    /// Default: the whole body.
    #[schemars(with = "Option<RawFingerprint>")]
    pub(super) fingerprint: Option<Spanned<RawFingerprint>>,
    /// `"/idempotency_key"`: the key is this string member of the JSON body instead (the header is
    /// then ignored).
    ///
    /// Default: the `Idempotency-Key` header.
    #[schemars(with = "Option<String>")]
    pub(super) key_from: Option<Spanned<String>>,
}

/// `{ ignore = [...] }` or `{ include = [...] }`: RFC 6901 JSON pointers.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFingerprint {
    /// Everything except the values at these pointers (a timestamp, a trace id).
    pub(super) ignore: Option<Vec<String>>,
    /// Only the values at these pointers, in their places.
    pub(super) include: Option<Vec<String>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReconcile {
    /// The path, with `{key}` where the key goes.
    #[schemars(with = "String")]
    pub(super) path: Spanned<String>,
    /// The method of the reconcile call.
    ///
    /// Default: `GET`.
    #[schemars(with = "Option<String>")]
    pub(super) method: Option<Spanned<String>>,
    /// Where the reconcile endpoint is, `http(s)://host[:port]`.
    ///
    /// Default: the route's own upstream.
    #[schemars(with = "Option<String>")]
    pub(super) upstream: Option<Spanned<String>>,
    /// The reconcile call's timeout.
    ///
    /// Default: 1000.
    #[schemars(with = "Option<u64>")]
    pub(super) timeout_ms: Option<Spanned<u64>>,
}
