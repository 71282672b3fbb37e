//! Istio: the filter as an `EnvoyFilter` (an ECDS extension pulled from the OCI image, and
//! `[limits]` merged into the gateways), a `RequestAuthentication` for the JWT, and how the
//! gateways reach the state API (`DestinationRule`, and a `ServiceEntry` for one outside the
//! cluster).

use yaml_rust2::Yaml;

use super::*;
use crate::yaml::{duration, n};

pub(super) fn istio(cfg: &Config, plugin: &serde_json::Value, pins: &Pins) -> Vec<Yaml> {
    let mut docs = vec![envoy_filter(cfg, plugin, pins)];
    docs.extend(request_authentication(cfg));
    docs.extend(state_api_route(cfg));
    docs
}

/// The filter as an ECDS extension (pulled from the OCI image, pinned by its digest), and the
/// patch that inserts it before the router.
fn envoy_filter(cfg: &Config, plugin: &serde_json::Value, pins: &Pins) -> Yaml {
    let m = &cfg.mesh;
    let selector = map(vec![("labels", string_map(&m.istio_labels))]);
    let wasm = extension_config(cfg, plugin, pins);
    let hcm_match = map(vec![
        ("context", s("GATEWAY")),
        (
            "listener",
            map(vec![(
                "filterChain",
                map(vec![(
                    "filter",
                    map(vec![
                        ("name", s(HCM)),
                        (
                            "subFilter",
                            map(vec![("name", s("envoy.filters.http.router"))]),
                        ),
                    ]),
                )]),
            )]),
        ),
    ]);
    object(
        "networking.istio.io/v1alpha3",
        "EnvoyFilter",
        NAME,
        &m.istio_namespace,
        vec![(
            "spec",
            map(vec![
                ("workloadSelector", selector),
                (
                    "configPatches",
                    Yaml::Array(vec![
                        map(vec![
                            ("applyTo", s("EXTENSION_CONFIG")),
                            ("patch", map(vec![("operation", s("ADD")), ("value", wasm)])),
                        ]),
                        map(vec![
                            ("applyTo", s("HTTP_FILTER")),
                            ("match", hcm_match),
                            (
                                "patch",
                                map(vec![
                                    ("operation", s("INSERT_BEFORE")),
                                    (
                                        "value",
                                        map(vec![
                                            ("name", s(NAME)),
                                            (
                                                "config_discovery",
                                                map(vec![
                                                    (
                                                        "config_source",
                                                        map(vec![("ads", map(vec![]))]),
                                                    ),
                                                    ("type_urls", Yaml::Array(vec![s(WASM_TYPE)])),
                                                ]),
                                            ),
                                        ]),
                                    ),
                                ]),
                            ),
                        ]),
                        client_limits_patch(cfg),
                        listener_limits_patch(),
                        stream_buffer_patch(cfg),
                    ]),
                ),
            ]),
        )],
    )
}

const HCM: &str = "envoy.filters.network.http_connection_manager";

/// A patch that merges `value` into what `apply_to` names on the gateways (`matching`: what
/// narrows it beside the gateway context).
fn gateway_merge(apply_to: &str, matching: Vec<(&str, Yaml)>, value: Yaml) -> Yaml {
    let mut matched = vec![("context", s("GATEWAY"))];
    matched.extend(matching);
    map(vec![
        ("applyTo", s(apply_to)),
        ("match", map(matched)),
        (
            "patch",
            map(vec![("operation", s("MERGE")), ("value", value)]),
        ),
    ])
}

/// `[limits]` as `edge render` writes them into its connection manager, merged into the
/// gateways': a slow client's headers, whole request (with the filter's waits: the mesh's
/// Envoy is not the pinned one) and idle connection, how long a request may stay silent (never
/// shorter than the filter's waits), and the HTTP/2 clients' limits.
fn client_limits_patch(cfg: &Config) -> Yaml {
    let mut typed_config = vec![(
        "@type",
        s("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"),
    )];
    typed_config.extend(render::client_connection_manager_limits(
        cfg,
        render::mesh_request_timeout_ms(cfg),
    ));
    gateway_merge(
        "NETWORK_FILTER",
        vec![(
            "listener",
            map(vec![(
                "filterChain",
                map(vec![("filter", map(vec![("name", s(HCM))]))]),
            )]),
        )],
        map(vec![("typed_config", map(typed_config))]),
    )
}

/// What a stream of the gateways may buffer, as `edge render` sets it on its virtual host:
/// above the largest body the filter reads and a stored response (with the listener's 32 KiB,
/// Envoy would answer 413 to a larger request and 500 to a larger response the upstream gave).
fn stream_buffer_patch(cfg: &Config) -> Yaml {
    gateway_merge(
        "VIRTUAL_HOST",
        vec![],
        map(vec![(
            "request_body_buffer_limit",
            n(render::stream_buffer_limit(cfg)),
        )]),
    )
}

/// The gateways' listeners read a client connection 32 KiB at a time and accept 16 new
/// connections a turn of the loop, as `edge render`'s.
fn listener_limits_patch() -> Yaml {
    gateway_merge("LISTENER", vec![], map(render::client_listener_limits()))
}

/// The JWT's `RequestAuthentication` on the gateways (none with a header subject).
fn request_authentication(cfg: &Config) -> Option<Yaml> {
    let m = &cfg.mesh;
    let Subject::Jwt(j) = &cfg.subject else {
        return None;
    };
    let mut rule = vec![
        ("issuer", s(j.issuer.clone())),
        (
            "audiences",
            Yaml::Array(j.audiences.iter().map(|a| s(a.clone())).collect()),
        ),
        ("forwardOriginalToken", Yaml::Boolean(j.forward_token)),
        (
            "outputClaimToHeaders",
            Yaml::Array(vec![map(vec![
                ("header", s(j.header.clone())),
                ("claim", s(j.claim.clone())),
            ])]),
        ),
    ];
    match (jwks_uri(j), jwks_text(j)) {
        (Some(uri), _) => rule.push(("jwksUri", s(uri))),
        (None, Some(text)) => rule.push(("jwks", s(text))),
        (None, None) => {}
    }
    Some(object(
        "security.istio.io/v1",
        "RequestAuthentication",
        NAME,
        &m.istio_namespace,
        vec![(
            "spec",
            map(vec![
                (
                    "selector",
                    map(vec![("matchLabels", string_map(&m.istio_labels))]),
                ),
                ("jwtRules", Yaml::Array(vec![map(rule)])),
            ]),
        )],
    ))
}

/// How the gateways reach the state API: a `DestinationRule`, after a `ServiceEntry` for one
/// outside the cluster.
fn state_api_route(cfg: &Config) -> Vec<Yaml> {
    let m = &cfg.mesh;
    let mut docs = Vec::new();
    let state_api = state_api_endpoint(cfg);
    let tls = if state_api.tls {
        map(vec![
            ("mode", s("SIMPLE")),
            ("sni", s(state_api.host.clone())),
        ])
    } else {
        // The state API's pods have no sidecar: plain HTTP, admitted by the NetworkPolicy and
        // the token (auto mTLS would not be used either; this says so).
        map(vec![("mode", s("DISABLE"))])
    };
    let namespace = if m.external_state_api.is_some() {
        &m.istio_namespace
    } else {
        &m.namespace
    };
    if m.external_state_api.is_some() {
        docs.push(object(
            "networking.istio.io/v1",
            "ServiceEntry",
            STATE_API,
            namespace,
            vec![(
                "spec",
                map(vec![
                    ("hosts", Yaml::Array(vec![s(state_api.host.clone())])),
                    ("location", s("MESH_EXTERNAL")),
                    ("resolution", s("DNS")),
                    (
                        "ports",
                        Yaml::Array(vec![map(vec![
                            ("number", n(u64::from(state_api.port))),
                            ("name", s(if state_api.tls { "https" } else { "http" })),
                            ("protocol", s(if state_api.tls { "TLS" } else { "HTTP" })),
                        ])]),
                    ),
                ]),
            )],
        ));
    }
    docs.push(object(
        "networking.istio.io/v1",
        "DestinationRule",
        STATE_API,
        namespace,
        vec![(
            "spec",
            map(vec![
                ("host", s(state_api.host.clone())),
                (
                    "trafficPolicy",
                    map(vec![
                        ("tls", tls),
                        (
                            "connectionPool",
                            map(vec![("tcp", map(vec![("connectTimeout", duration(500))]))]),
                        ),
                    ]),
                ),
            ]),
        )],
    ));
    docs
}

/// The ECDS extension: the module from the OCI image, pinned by its digest, and its
/// configuration.
fn extension_config(cfg: &Config, plugin: &serde_json::Value, pins: &Pins) -> Yaml {
    let m = &cfg.mesh;
    map(vec![
        ("name", s(NAME)),
        (
            "typed_config",
            map(vec![
                ("@type", s(WASM_TYPE)),
                (
                    "config",
                    map(vec![
                        ("name", s(NAME)),
                        ("root_id", s(ROOT_ID)),
                        // What Istio's WasmPlugin cannot say (module documentation).
                        ("allow_on_headers_stop_iteration", Yaml::Boolean(true)),
                        (
                            "failure_policy",
                            s(if fail_open(cfg) {
                                "FAIL_OPEN"
                            } else {
                                "FAIL_CLOSED"
                            }),
                        ),
                        (
                            "vm_config",
                            map(vec![
                                ("vm_id", s(NAME)),
                                ("runtime", s("envoy.wasm.runtime.v8")),
                                (
                                    "code",
                                    map(vec![(
                                        "remote",
                                        map(vec![
                                            (
                                                "http_uri",
                                                map(vec![
                                                    // istio-agent pulls oci:// itself (so
                                                    // Istio's WasmPlugin does): no cluster.
                                                    ("uri", s(format!("oci://{}", m.filter_image))),
                                                    ("cluster", s("_")),
                                                    ("timeout", duration(30_000)),
                                                ]),
                                            ),
                                            ("sha256", s(pins.image_digest_hex.clone())),
                                        ]),
                                    )]),
                                ),
                            ]),
                        ),
                        (
                            "configuration",
                            map(vec![
                                (
                                    "@type",
                                    s("type.googleapis.com/google.protobuf.StringValue"),
                                ),
                                (
                                    "value",
                                    s(serde_json::to_string_pretty(plugin).unwrap_or_default()),
                                ),
                            ]),
                        ),
                    ]),
                ),
            ]),
        ),
    ])
}
