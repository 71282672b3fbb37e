//! What a [`Config`] becomes: the Envoy configuration (YAML: the listener, the filters in order,
//! the clusters), the filter's JSON plugin configuration inside it, and the state API's
//! environment. `edge render` prints them for teams that run their own Envoy; `edge run` writes
//! them to its run folder and starts the processes with them.
//!
//! The request path it renders, for every request on the listener:
//!
//! 1. `header_mutation` (with a JWT subject): the subject header is removed from every client
//!    request, so only a verified token can set it, on any route;
//! 2. `jwt_authn` (with a JWT subject): on the protected routes a token is required and verified,
//!    and its claim is written to the subject header;
//! 3. the idempotency filter (Wasm): protected routes are claimed at the state API, everything
//!    else passes untouched;
//! 4. the router: every path goes to the upstream, with `upstream_timeout_ms`, once: no retry,
//!    no hedge, no internal redirect, no mirror (`retry_policy` with `num_retries: 0`, which
//!    also overrides a virtual host's). The filter sends what it forwards under a claim with
//!    `x-envoy-max-retries: 0` whatever the route says (docs/filter.md, *Router retries below
//!    the filter*); the route says it too.

use contract::state_env;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use yaml_rust2::{Yaml, YamlEmitter};

use crate::config::{reachable, Config, Endpoint, Jwks, Jwt, Match, StateTls, Subject};
use crate::yaml::{duration, map, n, s};
use filter_core::config as fc;

/// What the rendering needs besides the file: where Envoy finds the module, the token the filter
/// presents to the state API, and the CA bundle for `https://` upstreams.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub wasm: PathBuf,
    pub state_token: String,
    pub ca_file: String,
}

/// The CA bundle of Debian and Ubuntu (and the distroless images built from them).
pub const DEFAULT_CA_FILE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The cluster names the rendered configuration uses.
pub const UPSTREAM_CLUSTER: &str = "upstream";
pub const STATE_API_CLUSTER: &str = "state_api";
/// The same state API over HTTP/2, for the claims that wait (`Prefer: wait`).
pub const STATE_API_WAIT_CLUSTER: &str = "state_api_wait";
pub const JWKS_CLUSTER: &str = "jwks";
/// The jwt_authn provider.
pub use crate::jwt_rules::JWT_PROVIDER;

fn typed(type_name: &str, mut pairs: Vec<(&str, Yaml)>) -> Yaml {
    pairs.insert(0, ("@type", s(format!("type.googleapis.com/{type_name}"))));
    map(pairs)
}

fn socket_address(addr: SocketAddr) -> Yaml {
    map(vec![(
        "socket_address",
        map(vec![
            ("address", s(addr.ip().to_string())),
            ("port_value", n(u64::from(addr.port()))),
        ]),
    )])
}

pub(crate) fn cluster(name: &str, e: &Endpoint, connect_timeout_ms: u64, ca_file: &str) -> Yaml {
    let mut pairs = vec![
        ("name", s(name)),
        ("type", s("STRICT_DNS")),
        ("connect_timeout", duration(connect_timeout_ms)),
        (
            "load_assignment",
            map(vec![
                ("cluster_name", s(name)),
                (
                    "endpoints",
                    Yaml::Array(vec![map(vec![(
                        "lb_endpoints",
                        Yaml::Array(vec![map(vec![(
                            "endpoint",
                            map(vec![(
                                "address",
                                map(vec![(
                                    "socket_address",
                                    map(vec![
                                        ("address", s(e.host.clone())),
                                        ("port_value", n(u64::from(e.port))),
                                    ]),
                                )]),
                            )]),
                        )])]),
                    )])]),
                ),
            ]),
        ),
    ];
    if e.tls {
        let san_type = if e.host.parse::<IpAddr>().is_ok() {
            "IP_ADDRESS"
        } else {
            "DNS"
        };
        pairs.push((
            "transport_socket",
            map(vec![
                ("name", s("envoy.transport_sockets.tls")),
                (
                    "typed_config",
                    typed(
                        "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                        vec![
                            ("sni", s(e.host.clone())),
                            (
                                "common_tls_context",
                                map(vec![(
                                    "validation_context",
                                    map(vec![
                                        ("trusted_ca", map(vec![("filename", s(ca_file))])),
                                        (
                                            "match_typed_subject_alt_names",
                                            Yaml::Array(vec![map(vec![
                                                ("san_type", s(san_type)),
                                                (
                                                    "matcher",
                                                    map(vec![("exact", s(e.host.clone()))]),
                                                ),
                                            ])]),
                                        ),
                                    ]),
                                )]),
                            ),
                        ],
                    ),
                ),
            ]),
        ));
    }
    map(pairs)
}

/// The state API cluster's TLS (`[state.tls]`): SNI and the SAN to expect are `server_name`,
/// the certificate must chain to `ca_file`, and Envoy presents its client certificate when one
/// is configured. Envoy reads the files when it starts.
fn state_api_tls_socket(tls: &StateTls) -> Yaml {
    let san_type = if tls.server_name.parse::<IpAddr>().is_ok() {
        "IP_ADDRESS"
    } else {
        "DNS"
    };
    let file = |p: &std::path::Path| map(vec![("filename", s(p.display().to_string()))]);
    let mut common = vec![
        (
            "tls_params",
            map(vec![("tls_minimum_protocol_version", s("TLSv1_2"))]),
        ),
        (
            "validation_context",
            map(vec![
                ("trusted_ca", file(&tls.ca_file)),
                (
                    "match_typed_subject_alt_names",
                    Yaml::Array(vec![map(vec![
                        ("san_type", s(san_type)),
                        ("matcher", map(vec![("exact", s(tls.server_name.clone()))])),
                    ])]),
                ),
            ]),
        ),
    ];
    if let Some(c) = &tls.client_cert {
        common.push((
            "tls_certificates",
            Yaml::Array(vec![map(vec![
                ("certificate_chain", file(&c.cert_file)),
                ("private_key", file(&c.key_file)),
            ])]),
        ));
    }
    map(vec![
        ("name", s("envoy.transport_sockets.tls")),
        (
            "typed_config",
            typed(
                "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                vec![
                    ("sni", s(tls.server_name.clone())),
                    ("common_tls_context", map(common)),
                ],
            ),
        ),
    ])
}

/// The clusters of the state API (`name`: [`STATE_API_CLUSTER`] or, over HTTP/2,
/// [`STATE_API_WAIT_CLUSTER`]), over TLS when `[state.tls]` says so.
fn state_api_cluster(cfg: &Config, ca_file: &str, name: &str) -> Yaml {
    let mut c = cluster(name, &reachable(cfg.state.listen), 500, ca_file);
    if let (Some(tls), Yaml::Hash(h)) = (&cfg.state.tls, &mut c) {
        h.insert(s("transport_socket"), state_api_tls_socket(tls));
    }
    state_api_calls(&mut c, name == STATE_API_WAIT_CLUSTER);
    c
}

/// How Envoy calls the state API, wherever its clusters are written (`edge run`'s Envoy, Envoy
/// Gateway's bootstrap): past Envoy's default circuit breakers, and the waiting claims' cluster
/// over HTTP/2. Every other call stays on HTTP/1.1 keep-alive: HTTP/2 cost new keys 7 % of
/// their rate and doubled their p99 at 16 connections (docs/BENCH.md, "Tried and not kept").
pub(crate) fn state_api_calls(cluster: &mut Yaml, http2: bool) {
    if let Yaml::Hash(h) = cluster {
        h.insert(s("circuit_breakers"), state_api_breakers());
    }
    if let (true, Yaml::Hash(h)) = (http2, cluster) {
        h.insert(
            s("typed_extension_protocol_options"),
            map(vec![(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                typed(
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    vec![(
                        "explicit_http_config",
                        map(vec![(
                            "http2_protocol_options",
                            // Below the state API's 200 (hyper's default), so that Envoy opens
                            // another connection before the state API refuses a stream: with
                            // Envoy's own default (2^31 - 1) all went on one connection, and
                            // every waiting claim past the 200th was reset (REFUSED_STREAM).
                            map(vec![(
                                "max_concurrent_streams",
                                n(STATE_API_STREAMS_PER_CONNECTION),
                            )]),
                        )]),
                    )],
                ),
            )]),
        );
    }
}

/// Envoy's default circuit breakers allow 1,024 requests to a cluster at once; past them a
/// callout fails at once. Each waiting retry (`Prefer: wait`) holds a claim callout to the state
/// API for as long as it waits (up to `max_waiters` a worker), so a crowd of them tripped the
/// default (issue 38, curve 6). The state API bounds its own waiters and sheds with 503 +
/// Retry-After, so Envoy's bound only has to stay above them. Waiting claims go over HTTP/2:
/// over HTTP/1.1 each held a connection of its own, and 9,000 opened at once overflowed the
/// state API's listen backlog (bench/NOTES.md, twentieth round); as streams they share a
/// connection per 100 ([`STATE_API_STREAMS_PER_CONNECTION`]).
const STATE_API_MAX_REQUESTS: u64 = 100_000;

/// Streams Envoy puts on one HTTP/2 connection to the state API.
const STATE_API_STREAMS_PER_CONNECTION: u64 = 100;

fn state_api_breakers() -> Yaml {
    map(vec![(
        "thresholds",
        Yaml::Array(vec![map(vec![
            ("max_connections", n(STATE_API_MAX_REQUESTS)),
            ("max_pending_requests", n(STATE_API_MAX_REQUESTS)),
            ("max_requests", n(STATE_API_MAX_REQUESTS)),
        ])]),
    )])
}

/// The cluster of route `i`'s reconcile endpoint when it is another service than the upstream.
pub(crate) fn reconcile_cluster(i: usize) -> String {
    format!("reconcile_{i}")
}

/// How the filter reaches what it calls and finds the caller, in the names of the Envoy it runs
/// in: `edge run`'s own, or a mesh's (`crate::mesh`).
pub struct Wiring {
    /// The Envoy cluster of the state API, and the `:authority` of the calls.
    pub state_api_cluster: String,
    /// The cluster for claims that wait, when the Envoy has one (`fc::StateApi::wait_cluster`).
    pub state_api_wait_cluster: Option<String>,
    pub state_api_authority: String,
    pub subject: fc::SubjectSource,
    /// The Envoy cluster of route `i`'s reconcile endpoint.
    pub reconcile_cluster: fn(&Config, usize) -> String,
}

impl Wiring {
    /// This module's Envoy configuration: its clusters, and the subject in the header
    /// `jwt_authn` (or the layer in front) writes.
    pub fn envoy(cfg: &Config) -> Self {
        let subject_header = match &cfg.subject {
            Subject::Jwt(j) => j.header.clone(),
            Subject::Header(h) => h.clone(),
        };
        Self {
            state_api_cluster: STATE_API_CLUSTER.to_owned(),
            state_api_wait_cluster: Some(STATE_API_WAIT_CLUSTER.to_owned()),
            state_api_authority: reachable(cfg.state.listen).authority(),
            subject: fc::SubjectSource::Header(subject_header),
            reconcile_cluster: |cfg, i| match cfg.routes.get(i).and_then(reconcile_upstream) {
                Some(_) => reconcile_cluster(i),
                None => UPSTREAM_CLUSTER.to_owned(),
            },
        }
    }
}

/// Route `r`'s reconcile endpoint when it is another service than the upstream.
fn reconcile_upstream(r: &crate::config::Route) -> Option<&Endpoint> {
    r.reconcile.as_ref().and_then(|rc| rc.upstream.as_ref())
}

/// The filter's plugin configuration, as the filter's own type: `token` for the state API, and
/// what it calls named by `wiring`.
pub fn plugin_config(cfg: &Config, wiring: &Wiring, token: &str) -> fc::Config {
    let f = &cfg.filter;
    let routes = cfg.routes.iter().enumerate().map(|(i, r)| {
        let (path, prefix) = match &r.matcher {
            Match::Path(p) => (Some(p.clone()), None),
            Match::Prefix(p) => (None, Some(p.clone())),
        };
        let reconcile = r.reconcile.as_ref().map(|rc| fc::Reconcile {
            cluster: (wiring.reconcile_cluster)(cfg, i),
            authority: rc.upstream.as_ref().unwrap_or(&cfg.upstream).authority(),
            method: rc.method.clone(),
            path: rc.path.clone(),
            timeout_ms: rc.timeout_ms,
        });
        fc::Route {
            method: r.method.clone(),
            path,
            prefix,
            key: r.key,
            on_5xx: r.on_5xx,
            on_state_unavailable: r.on_state_unavailable,
            on_unknown: r.on_unknown,
            reconcile,
            lease_ms: r.lease_ms,
            heartbeat_ms: r.heartbeat_ms,
            max_request_body_bytes: r.max_request_body_bytes,
            retention_s: r.retention_s,
            max_wait_s: r.max_wait_s,
            fingerprint: r.fingerprint.clone(),
            key_from: r.key_from.clone(),
        }
    });
    fc::Config {
        state_api: fc::StateApi {
            cluster: wiring.state_api_cluster.clone(),
            wait_cluster: wiring.state_api_wait_cluster.clone(),
            authority: wiring.state_api_authority.clone(),
            token: token.to_owned(),
            timeout_ms: cfg.state.timeout_ms,
        },
        subject: wiring.subject.clone(),
        routes: routes.collect(),
        max_request_body_bytes: f.max_request_body_bytes,
        max_stored_body_bytes: f.max_stored_body_bytes,
        lease_ms: f.lease_ms,
        heartbeat_ms: f.heartbeat_ms,
        replay_extra_headers: f.replay_extra_headers.clone(),
        replay_cache_bytes: f.replay_cache_bytes,
        replay_cache_ttl_ms: f.replay_cache_ttl_ms,
        in_flight_cache_ms: f.in_flight_cache_ms,
        complete_retry_ms: f.complete_retry_ms,
        complete_retry_bytes: f.complete_retry_bytes,
        complete_in_background: f.complete_in_background,
        namespace: cfg.namespace.clone(),
        max_waiters: f.max_waiters,
        batch_max: f.batch_max,
        max_buffered_bytes: Some(max_buffered_bytes(cfg)),
        max_buffered_bytes_per_subject: f.max_buffered_bytes_per_subject,
        key_state_path: f.key_state_path.clone(),
    }
}

/// The request body bytes a worker's filter may hold at once: `[filter] max_buffered_bytes`, or
/// its share of `[limits] memory_budget_mib` ([`crate::config::Limits::body_bytes_per_worker`]).
pub fn max_buffered_bytes(cfg: &Config) -> u64 {
    cfg.filter.max_buffered_bytes.unwrap_or_else(|| {
        cfg.limits
            .body_bytes_per_worker(cfg.envoy_workers, largest_request_body(cfg))
    })
}

/// What one subject's requests may hold of that bound, as the filter reads its rendered
/// configuration (`[filter] max_buffered_bytes_per_subject`, or the filter's default).
pub fn max_buffered_bytes_per_subject(cfg: &Config) -> u64 {
    plugin_config(cfg, &Wiring::envoy(cfg), "").max_buffered_bytes_per_subject()
}

/// The largest request body any route lets the filter read.
fn largest_request_body(cfg: &Config) -> u64 {
    cfg.routes
        .iter()
        .filter_map(|r| r.max_request_body_bytes)
        .chain([cfg.filter.max_request_body_bytes])
        .max()
        .unwrap_or(cfg.filter.max_request_body_bytes)
}

/// The filter's plugin configuration (JSON) for this module's Envoy, with `token` for the
/// state API.
pub fn filter_json(cfg: &Config, token: &str) -> String {
    let plugin = plugin_config(cfg, &Wiring::envoy(cfg), token);
    serde_json::to_string_pretty(&plugin).unwrap_or_default()
}

/// The JSON Schema of the plugin configuration as `edge schema` prints it and
/// `docs/plugin-config.schema.json` holds it.
pub fn plugin_schema_text() -> String {
    serde_json::to_string_pretty(&fc::json_schema()).unwrap_or_default()
}

/// The HTTP filters in order (the module's documentation lists them).
fn http_filters(cfg: &Config, inputs: &Inputs) -> Vec<Yaml> {
    let mut out = Vec::new();
    if let Subject::Jwt(jwt) = &cfg.subject {
        out.push(subject_header_removal(jwt));
        out.push(jwt_authn(cfg, jwt));
    }
    out.push(wasm_filter(cfg, inputs));
    out.push(map(vec![
        ("name", s("envoy.filters.http.router")),
        (
            "typed_config",
            typed("envoy.extensions.filters.http.router.v3.Router", vec![]),
        ),
    ]));
    out
}

/// `header_mutation`: the subject header removed from every client request.
fn subject_header_removal(jwt: &Jwt) -> Yaml {
    map(vec![
        ("name", s("envoy.filters.http.header_mutation")),
        (
            "typed_config",
            typed(
                "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                vec![(
                    "mutations",
                    map(vec![(
                        "request_mutations",
                        Yaml::Array(vec![map(vec![("remove", s(jwt.header.clone()))])]),
                    )]),
                )],
            ),
        ),
    ])
}

/// `jwt_authn`: the provider, and a rule that requires a token on each protected route.
fn jwt_authn(cfg: &Config, jwt: &Jwt) -> Yaml {
    let provider = map(vec![
        ("issuer", s(jwt.issuer.clone())),
        (
            "audiences",
            Yaml::Array(jwt.audiences.iter().map(|a| s(a.clone())).collect()),
        ),
        jwks_source(&jwt.jwks),
        ("forward", Yaml::Boolean(jwt.forward_token)),
        ("jwt_cache_config", map(vec![("jwt_cache_size", n(1000))])),
        (
            "claim_to_headers",
            Yaml::Array(vec![map(vec![
                ("header_name", s(jwt.header.clone())),
                ("claim_name", s(jwt.claim.clone())),
            ])]),
        ),
    ]);
    map(vec![
        ("name", s("envoy.filters.http.jwt_authn")),
        (
            "typed_config",
            typed(
                "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
                vec![
                    ("providers", map(vec![(JWT_PROVIDER, provider)])),
                    (
                        "rules",
                        Yaml::Array(crate::jwt_rules::rules(
                            &cfg.routes,
                            cfg.filter.key_state_path.as_deref(),
                        )),
                    ),
                ],
            ),
        ),
    ])
}

/// Where jwt_authn finds the keys: a local file, or a URL fetched through [`JWKS_CLUSTER`].
fn jwks_source(jwks: &Jwks) -> (&'static str, Yaml) {
    match jwks {
        Jwks::File(path) => (
            "local_jwks",
            map(vec![("filename", s(path.display().to_string()))]),
        ),
        Jwks::Url { endpoint, path } => (
            "remote_jwks",
            map(vec![
                (
                    "http_uri",
                    map(vec![
                        (
                            "uri",
                            s(format!(
                                "{}://{}{path}",
                                if endpoint.tls { "https" } else { "http" },
                                endpoint.authority()
                            )),
                        ),
                        ("cluster", s(JWKS_CLUSTER)),
                        ("timeout", duration(5_000)),
                    ]),
                ),
                ("cache_duration", duration(300_000)),
            ]),
        ),
    }
}

/// The idempotency filter: the module, and its plugin configuration.
fn wasm_filter(cfg: &Config, inputs: &Inputs) -> Yaml {
    map(vec![
        ("name", s("envoy.filters.http.wasm")),
        (
            "typed_config",
            typed(
                "envoy.extensions.filters.http.wasm.v3.Wasm",
                vec![(
                    "config",
                    map(vec![
                        ("name", s("idempotency")),
                        ("root_id", s("idempotency")),
                        // The filter holds the headers while it reads the body (Envoy >= 1.35).
                        ("allow_on_headers_stop_iteration", Yaml::Boolean(true)),
                        (
                            "vm_config",
                            map(vec![
                                ("vm_id", s("idempotency")),
                                ("runtime", s("envoy.wasm.runtime.v8")),
                                (
                                    "code",
                                    map(vec![(
                                        "local",
                                        map(vec![(
                                            "filename",
                                            s(inputs.wasm.display().to_string()),
                                        )]),
                                    )]),
                                ),
                            ]),
                        ),
                        (
                            "configuration",
                            typed(
                                "google.protobuf.StringValue",
                                vec![("value", s(filter_json(cfg, &inputs.state_token)))],
                            ),
                        ),
                    ]),
                )],
            ),
        ),
    ])
}

/// Envoy's own default `stream_idle_timeout` (5 minutes).
const ENVOY_STREAM_IDLE_TIMEOUT_MS: u64 = 300_000;
/// What the connection manager's timeouts leave beyond the longest legitimate wait.
pub const HCM_TIMEOUT_MARGIN_MS: u64 = 5_000;

/// The connection manager's `stream_idle_timeout`: never shorter than the longest a protected
/// request may legitimately stay silent, which is the route timeout (`upstream_timeout_ms`)
/// plus the filter's own waits around it (a state API call before and after, the longest
/// `Prefer: wait` and reconcile of any route), plus a margin. A connection manager timeout
/// that fires first answers for the upstream while it may still execute: at best an unknown
/// outcome. `max_stream_duration` stays unset (Envoy's default: none); `request_timeout` is
/// [`request_timeout_ms`].
pub fn stream_idle_timeout_ms(cfg: &Config) -> u64 {
    cfg.upstream_timeout_ms
        .saturating_add(filter_waits_ms(cfg))
        .max(ENVOY_STREAM_IDLE_TIMEOUT_MS)
}

/// The longest the filter may hold a request before it goes upstream, and a margin: a state
/// API call before and after, the longest `Prefer: wait` and reconcile of any route.
fn filter_waits_ms(cfg: &Config) -> u64 {
    let route_waits = cfg
        .routes
        .iter()
        .map(|r| {
            r.max_wait_s
                .saturating_mul(1_000)
                .saturating_add(r.reconcile.as_ref().map_or(0, |rc| rc.timeout_ms))
        })
        .max()
        .unwrap_or(0);
    route_waits
        .saturating_add(cfg.state.timeout_ms.saturating_mul(2))
        .saturating_add(HCM_TIMEOUT_MARGIN_MS)
}

/// What Envoy reads from a client connection at a time and holds for it before it stops
/// reading (the listener's `per_connection_buffer_limit_bytes`; Envoy's advice for an edge). It
/// bounds the bytes a connection whose request was already answered can push into Envoy: at the
/// stream's buffer limit (4 MiB and more) 500 clients refused at their headers had 533 MiB of
/// bodies read into Envoy at once (bench/NOTES.md, twentieth round).
pub const CONNECTION_READ_BYTES: u64 = 32 * 1024;

/// A client's HTTP/2 connection (h2c: the listener's codec is `AUTO`), as Envoy's edge
/// guidance sets it: at most this many streams at once (Envoy's default: 2^31 - 1), ...
pub const CLIENT_STREAMS_PER_CONNECTION: u64 = 100;
/// ... what a client may send on one stream before Envoy's acknowledgement (Envoy's default:
/// 256 MiB), ...
pub const CLIENT_STREAM_WINDOW_BYTES: u64 = 64 * 1024;
/// ... and on the whole connection.
pub const CLIENT_CONNECTION_WINDOW_BYTES: u64 = 1024 * 1024;
/// A client's HTTP/2 flood limits, written out at Envoy 1.40's own defaults so that another
/// Envoy's defaults cannot loosen them unnoticed: a connection is closed when more than this
/// many frames wait in Envoy's output for a client that does not read them, ...
pub const CLIENT_OUTBOUND_FRAMES: u64 = 10_000;
/// ... or this many of them are control frames (the acknowledgements of a PING or SETTINGS
/// flood: `hostile_load_8_http2_control_frame_flood`), ...
pub const CLIENT_OUTBOUND_CONTROL_FRAMES: u64 = 1_000;
/// ... or it sends more frames in a row without a payload than this (empty DATA, CONTINUATION),
/// ...
pub const CLIENT_EMPTY_FRAMES_IN_A_ROW: u64 = 1;
/// ... or more PRIORITY frames than this x (1 + the streams it opened), ...
pub const CLIENT_PRIORITY_FRAMES_PER_STREAM: u64 = 100;
/// ... or more WINDOW_UPDATEs than 5 + 2 x (the streams it opened + this many x the DATA frames
/// Envoy sent it) (the flood's third kind).
pub const CLIENT_WINDOW_UPDATES_PER_DATA_FRAME: u64 = 10;

/// The connections the listener accepts in one turn of a worker's loop
/// (`max_connections_to_accept_per_socket_event`; Envoy's default: all that wait). Hundreds of
/// connections opened at once are then taken a few at a time, between which the worker serves
/// the connections it already has, so that a burst of new ones does not stall them.
pub const ACCEPTS_PER_EVENT: u64 = 16;

/// The connection manager's `request_timeout`: the time a client has for its whole request,
/// headers and body (`limits.request_body_timeout_ms`). Envoy 1.40 disarms it when the last byte
/// of the request has come from the client, not when it goes upstream (its documentation says
/// the latter): measured with a retry that waits for a running key past it
/// (`tests/tests/hostile_load.rs`, `request_timeout_while_the_filter_waits`), so it never
/// fires while the filter claims, waits or reconciles, nor on a forwarded request; the filter
/// forwards a protected request only once its body is whole. A body never finished is cut
/// (408) and never claims.
pub fn request_timeout_ms(cfg: &Config) -> u64 {
    cfg.limits.request_body_timeout_ms
}

/// `request_timeout` for a mesh's Envoys, whose version is the mesh's: the client's time and
/// the filter's waits, as Envoy's documentation has it run (until the last byte goes upstream),
/// so that an Envoy that does what its documentation says never answers 408 while the filter
/// claims, waits or reconciles. What the pinned 1.40 measured ([`request_timeout_ms`]) is not
/// assumed of another build.
pub fn mesh_request_timeout_ms(cfg: &Config) -> u64 {
    request_timeout_ms(cfg).saturating_add(filter_waits_ms(cfg))
}

/// The name of the listener `edge render` writes (its connection limit's runtime key).
pub const LISTENER_NAME: &str = "edge";

/// The heap bound's share at which each overload action starts (docs/RELIABILITY.md, Hostile
/// load): idle connections' timeout scaled down from 80 % (to a tenth at 95 %), HTTP/1.1
/// keep-alive off from 90 %, new requests refused (503) and new connections refused from 95 %.
/// No buffer accounting (`reset_high_memory_stream`): it cost 12-18 % more of Envoy's CPU per
/// replay in the bench guard, and the filter's buffering bound already bounds held bodies.
pub const OVERLOAD_SHORTEN_IDLE: f64 = 0.80;
pub const OVERLOAD_NO_KEEPALIVE: f64 = 0.90;
pub const OVERLOAD_REFUSE: f64 = 0.95;

fn threshold(monitor: &str, value: f64) -> Yaml {
    map(vec![
        ("name", s(monitor)),
        (
            "threshold",
            map(vec![("value", Yaml::Real(value.to_string()))]),
        ),
    ])
}

fn scaled(monitor: &str, from: f64, to: f64) -> Yaml {
    map(vec![
        ("name", s(monitor)),
        (
            "scaled",
            map(vec![
                ("scaling_threshold", Yaml::Real(from.to_string())),
                ("saturation_threshold", Yaml::Real(to.to_string())),
            ]),
        ),
    ])
}

const FIXED_HEAP: &str = "envoy.resource_monitors.fixed_heap";

/// The overload manager (bootstrap): a heap bound from `[limits]`, Envoy's global connection
/// limit, and the actions at [`OVERLOAD_SHORTEN_IDLE`] and above.
pub fn overload_manager(cfg: &Config) -> Yaml {
    let heap = cfg
        .limits
        .heap_bytes(cfg.envoy_workers, max_buffered_bytes(cfg));
    let action = |name: &str, trigger: Yaml, extra: Option<(&'static str, Yaml)>| {
        let mut pairs = vec![("name", s(name)), ("triggers", Yaml::Array(vec![trigger]))];
        pairs.extend(extra);
        map(pairs)
    };
    map(vec![
        ("refresh_interval", duration(250)),
        (
            "resource_monitors",
            Yaml::Array(vec![
                map(vec![
                    ("name", s(FIXED_HEAP)),
                    (
                        "typed_config",
                        typed(
                            "envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                            vec![("max_heap_size_bytes", n(heap))],
                        ),
                    ),
                ]),
                map(vec![
                    (
                        "name",
                        s("envoy.resource_monitors.global_downstream_max_connections"),
                    ),
                    (
                        "typed_config",
                        typed(
                            "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                            vec![(
                                "max_active_downstream_connections",
                                n(cfg.limits.max_connections),
                            )],
                        ),
                    ),
                ]),
            ]),
        ),
        (
            "actions",
            Yaml::Array(vec![
                action(
                    "envoy.overload_actions.reduce_timeouts",
                    scaled(FIXED_HEAP, OVERLOAD_SHORTEN_IDLE, OVERLOAD_REFUSE),
                    Some((
                        "typed_config",
                        typed(
                            "envoy.config.overload.v3.ScaleTimersOverloadActionConfig",
                            vec![(
                                "timer_scale_factors",
                                // Idle connections' timer, and that of answers whole in Envoy
                                // that their client does not read (stored by then); not a
                                // stream's idle timeout: fired while its request legitimately
                                // waits, it would answer for an upstream that may still
                                // execute (`stream_idle_timeout_ms`).
                                Yaml::Array(
                                    [
                                        "HTTP_DOWNSTREAM_CONNECTION_IDLE",
                                        "HTTP_DOWNSTREAM_STREAM_FLUSH",
                                    ]
                                    .into_iter()
                                    .map(|timer| {
                                        map(vec![
                                            ("timer", s(timer)),
                                            (
                                                "min_scale",
                                                map(vec![(
                                                    "value",
                                                    Yaml::Real("10.0".into()),
                                                )]),
                                            ),
                                        ])
                                    })
                                    .collect(),
                                ),
                            )],
                        ),
                    )),
                ),
                action(
                    "envoy.overload_actions.disable_http_keepalive",
                    threshold(FIXED_HEAP, OVERLOAD_NO_KEEPALIVE),
                    None,
                ),
                action(
                    "envoy.overload_actions.stop_accepting_requests",
                    threshold(FIXED_HEAP, OVERLOAD_REFUSE),
                    None,
                ),
            ]),
        ),
        (
            "loadshed_points",
            Yaml::Array(vec![map(vec![
                ("name", s("envoy.load_shed_points.tcp_listener_accept")),
                (
                    "triggers",
                    Yaml::Array(vec![threshold(FIXED_HEAP, OVERLOAD_REFUSE)]),
                ),
            ])]),
        ),
    ])
}

/// Requests of one connection Envoy starts in one turn of a worker's loop
/// (`http.max_requests_per_io_cycle`, Envoy's mitigation of HTTP/2 rapid reset; its default: no
/// limit). An HTTP/2 connection opening and resetting streams as fast as it can then gets one a
/// turn, like every other connection, instead of the whole worker.
pub const REQUESTS_PER_IO_CYCLE: u64 = 1;

/// The runtime's static layer: the listener's connection limit, the requests a connection
/// starts a turn, and what `jwt_rules` needs.
fn runtime(cfg: &Config) -> Yaml {
    let mut layers = vec![map(vec![
        ("name", s("limits")),
        (
            "static_layer",
            map(vec![
                (
                    format!("envoy.resource_limits.listener.{LISTENER_NAME}.connection_limit")
                        .as_str(),
                    n(cfg.limits.max_connections),
                ),
                ("http.max_requests_per_io_cycle", n(REQUESTS_PER_IO_CYCLE)),
            ]),
        ),
    ])];
    if let Some(Yaml::Hash(h)) = crate::jwt_rules::runtime_layer(cfg) {
        if let Some(Yaml::Array(more)) = h.get(&s("layers")) {
            layers.extend(more.iter().cloned());
        }
    }
    map(vec![("layers", Yaml::Array(layers))])
}

/// The connection manager's limits on its clients (`[limits]`): how long a request may stay
/// silent ([`stream_idle_timeout_ms`]), a slow client's headers, whole request and idle
/// connection, and an HTTP/2 client bounded as an HTTP/1.1 one is by [`CONNECTION_READ_BYTES`]:
/// streams at once, what each may push before Envoy reads it, and the frames it may make Envoy
/// queue or answer. `edge render` writes them into its connection manager (`request_timeout_ms`:
/// [`request_timeout_ms`]); `--target istio` merges them into the gateways' (with
/// [`mesh_request_timeout_ms`]).
pub fn client_connection_manager_limits(
    cfg: &Config,
    request_timeout_ms: u64,
) -> Vec<(&'static str, Yaml)> {
    vec![
        ("stream_idle_timeout", duration(stream_idle_timeout_ms(cfg))),
        (
            "request_headers_timeout",
            duration(cfg.limits.request_headers_timeout_ms),
        ),
        ("request_timeout", duration(request_timeout_ms)),
        (
            "stream_flush_timeout",
            duration(cfg.limits.response_flush_timeout_ms),
        ),
        (
            "common_http_protocol_options",
            map(vec![("idle_timeout", duration(cfg.limits.idle_timeout_ms))]),
        ),
        (
            "http2_protocol_options",
            map(vec![
                ("max_concurrent_streams", n(CLIENT_STREAMS_PER_CONNECTION)),
                ("initial_stream_window_size", n(CLIENT_STREAM_WINDOW_BYTES)),
                (
                    "initial_connection_window_size",
                    n(CLIENT_CONNECTION_WINDOW_BYTES),
                ),
                ("max_outbound_frames", n(CLIENT_OUTBOUND_FRAMES)),
                (
                    "max_outbound_control_frames",
                    n(CLIENT_OUTBOUND_CONTROL_FRAMES),
                ),
                (
                    "max_consecutive_inbound_frames_with_empty_payload",
                    n(CLIENT_EMPTY_FRAMES_IN_A_ROW),
                ),
                (
                    "max_inbound_priority_frames_per_stream",
                    n(CLIENT_PRIORITY_FRAMES_PER_STREAM),
                ),
                (
                    "max_inbound_window_update_frames_per_data_frame_sent",
                    n(CLIENT_WINDOW_UPDATES_PER_DATA_FRAME),
                ),
            ]),
        ),
    ]
}

/// The listener's limits on its clients: what it reads from a connection at a time, and how
/// many new connections it accepts a turn of the loop.
pub fn client_listener_limits() -> Vec<(&'static str, Yaml)> {
    vec![
        (
            "per_connection_buffer_limit_bytes",
            n(CONNECTION_READ_BYTES),
        ),
        (
            "max_connections_to_accept_per_socket_event",
            n(ACCEPTS_PER_EVENT),
        ),
    ]
}

/// What one stream may buffer (the request body the filter fingerprints, the response it
/// captures): twice the largest body the filter reads or stores, so that it answers 413 itself
/// before Envoy would, and a response it captures to store fits with a read to spare (a larger
/// one, which the filter does not store, is still buffered while the filter writes its
/// outcome: docs/filter.md). Set on the virtual host (`request_body_buffer_limit`, which Envoy
/// applies to the stream both ways), not on the listener: see `CONNECTION_READ_BYTES`; the
/// mesh targets set it on the gateways' virtual hosts too.
pub fn stream_buffer_limit(cfg: &Config) -> u64 {
    largest_request_body(cfg)
        .max(cfg.filter.max_stored_body_bytes)
        .saturating_mul(2)
        .saturating_add(1 << 20)
        .max(4 << 20)
}

/// The Envoy configuration (YAML).
pub fn envoy_yaml(cfg: &Config, inputs: &Inputs) -> String {
    let buffer_limit = stream_buffer_limit(cfg);
    // Slow clients and HTTP/2 clients (`[limits]`).
    let mut hcm_fields = vec![("stat_prefix", s("edge")), ("codec_type", s("AUTO"))];
    hcm_fields.extend(client_connection_manager_limits(
        cfg,
        request_timeout_ms(cfg),
    ));
    hcm_fields.extend(vec![
        (
            "route_config",
            map(vec![
                ("name", s("edge")),
                (
                    "virtual_hosts",
                    Yaml::Array(vec![map(vec![
                        ("name", s("upstream")),
                        ("domains", Yaml::Array(vec![s("*")])),
                        ("request_body_buffer_limit", n(buffer_limit)),
                        (
                            "routes",
                            Yaml::Array(vec![map(vec![
                                ("match", map(vec![("prefix", s("/"))])),
                                (
                                    "route",
                                    map(vec![
                                        ("cluster", s(UPSTREAM_CLUSTER)),
                                        ("timeout", duration(cfg.upstream_timeout_ms)),
                                        // Sent once (module documentation).
                                        ("retry_policy", map(vec![("num_retries", n(0))])),
                                    ]),
                                ),
                            ])]),
                        ),
                    ])]),
                ),
            ]),
        ),
        ("http_filters", Yaml::Array(http_filters(cfg, inputs))),
    ]);
    let hcm = typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        hcm_fields,
    );
    let mut listener_fields = vec![
        ("name", s(LISTENER_NAME)),
        ("address", socket_address(cfg.listen)),
    ];
    listener_fields.extend(client_listener_limits());
    listener_fields.push((
        "filter_chains",
        Yaml::Array(vec![map(vec![(
            "filters",
            Yaml::Array(vec![map(vec![
                ("name", s("envoy.filters.network.http_connection_manager")),
                ("typed_config", hcm),
            ])]),
        )])]),
    ));
    let listener = map(listener_fields);
    let mut clusters = vec![
        cluster(UPSTREAM_CLUSTER, &cfg.upstream, 1_000, &inputs.ca_file),
        state_api_cluster(cfg, &inputs.ca_file, STATE_API_CLUSTER),
        state_api_cluster(cfg, &inputs.ca_file, STATE_API_WAIT_CLUSTER),
    ];
    if let Subject::Jwt(j) = &cfg.subject {
        if let Jwks::Url { endpoint, .. } = &j.jwks {
            clusters.push(cluster(JWKS_CLUSTER, endpoint, 2_000, &inputs.ca_file));
        }
    }
    for (i, r) in cfg.routes.iter().enumerate() {
        if let Some(e) = reconcile_upstream(r) {
            clusters.push(cluster(&reconcile_cluster(i), e, 1_000, &inputs.ca_file));
        }
    }
    let mut top = Vec::new();
    if let Some(admin) = cfg.admin {
        top.push(("admin", map(vec![("address", socket_address(admin))])));
    }
    top.push((
        "static_resources",
        map(vec![
            ("listeners", Yaml::Array(vec![listener])),
            ("clusters", Yaml::Array(clusters)),
        ]),
    ));
    top.push(("overload_manager", overload_manager(cfg)));
    top.push(("layered_runtime", runtime(cfg)));
    let doc = map(top);
    let mut out = String::new();
    let mut emitter = YamlEmitter::new(&mut out);
    emitter.multiline_strings(true);
    if emitter.dump(&doc).is_err() {
        return String::new();
    }
    out.push('\n');
    out
}

/// The state API's environment for this configuration (its flags' variables).
pub fn state_api_env(
    cfg: &Config,
    database_url: &str,
    token: &str,
    key_secret: &str,
) -> Vec<(String, String)> {
    let mut env = state_env::required(database_url, cfg.state.listen, token, key_secret);
    if let Some(r) = cfg.state.retention_s {
        env.push((state_env::STATE_API_RETENTION_S.to_owned(), r.to_string()));
    }
    if let Some(r) = cfg.state.max_retention_s {
        env.push((
            state_env::STATE_API_MAX_RETENTION_S.to_owned(),
            r.to_string(),
        ));
    }
    if let Some(t) = &cfg.state.admin_token {
        env.push((state_env::STATE_API_ADMIN_TOKEN.to_owned(), t.clone()));
    }
    if let Some(p) = &cfg.state.previous_key_secret {
        env.push((state_env::IDEM_PREVIOUS_KEY_SECRET.to_owned(), p.clone()));
    }
    if let Some(k) = &cfg.state.storage_key {
        env.push((state_env::STATE_API_STORAGE_KEY.to_owned(), k.clone()));
    }
    if let Some(k) = &cfg.state.previous_storage_key {
        env.push((
            state_env::STATE_API_PREVIOUS_STORAGE_KEY.to_owned(),
            k.clone(),
        ));
    }
    if let Some(tls) = &cfg.state.tls {
        env.extend(state_api_tls_env(tls));
    }
    if cfg.filter.max_stored_body_bytes > fc::DEFAULT_MAX_BODY {
        // The state API stores 1 MiB by default: as much as the filter keeps.
        env.push((
            state_env::STATE_API_MAX_BODY_BYTES.to_owned(),
            cfg.filter.max_stored_body_bytes.to_string(),
        ));
    }
    env
}

/// The state API's HTTPS settings for `[state.tls]` (its certificate, key and client CA).
pub fn state_api_tls_env(tls: &StateTls) -> Vec<(String, String)> {
    let path = |p: &std::path::Path| p.display().to_string();
    let mut env = vec![
        (
            state_env::STATE_API_TLS_CERT.to_owned(),
            path(&tls.cert_file),
        ),
        (state_env::STATE_API_TLS_KEY.to_owned(), path(&tls.key_file)),
    ];
    if let Some(ca) = &tls.client_ca_file {
        env.push((state_env::STATE_API_TLS_CLIENT_CA.to_owned(), path(ca)));
    }
    env
}
