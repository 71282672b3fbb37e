//! Envoy Gateway: an `EnvoyExtensionPolicy` with the Wasm image and its config, an
//! `EnvoyPatchPolicy` (what the extension policy cannot say), an `EnvoyProxy` whose bootstrap adds
//! the clusters the filter calls, a `ClientTrafficPolicy` with `[limits]`, a `SecurityPolicy` for
//! the JWT.

use yaml_rust2::{Yaml, YamlEmitter};

use super::*;
use crate::yaml::{duration, n};

pub(super) fn envoy_gateway(cfg: &Config, plugin: &serde_json::Value, pins: &Pins) -> Vec<Yaml> {
    let mut docs = vec![
        extension_policy(cfg, plugin, pins),
        patch_policy(cfg),
        proxy(cfg),
        client_traffic_policy(cfg),
    ];
    docs.extend(security_policy(cfg));
    docs
}

/// The Wasm image (pinned by its digest) and its configuration on the Gateway.
fn extension_policy(cfg: &Config, plugin: &serde_json::Value, pins: &Pins) -> Yaml {
    let m = &cfg.mesh;
    let ns = &m.gateway_namespace;
    let wasm = map(vec![
        ("name", s(NAME)),
        ("rootID", s(ROOT_ID)),
        (
            "code",
            map(vec![
                ("type", s("Image")),
                (
                    "image",
                    map(vec![
                        ("url", s(m.filter_image.clone())),
                        ("sha256", s(pins.image_digest_hex.clone())),
                    ]),
                ),
            ]),
        ),
        ("config", yaml_of_json(plugin)),
        ("failOpen", Yaml::Boolean(fail_open(cfg))),
    ]);
    object(
        "gateway.envoyproxy.io/v1alpha1",
        "EnvoyExtensionPolicy",
        NAME,
        ns,
        vec![(
            "spec",
            map(vec![
                ("targetRefs", target_gateway(cfg)),
                ("wasm", Yaml::Array(vec![wasm])),
            ]),
        )],
    )
}

/// What the extension policy cannot say: `allow_on_headers_stop_iteration` on the filter it
/// made, and the stream buffer limit on the listener's virtual hosts.
fn patch_policy(cfg: &Config) -> Yaml {
    let m = &cfg.mesh;
    let ns = &m.gateway_namespace;
    // Envoy Gateway names the filter `envoy.filters.http.wasm/<policy kind>/<ns>/<name>/wasm/<i>`
    // and the listener `<ns>/<gateway>/<listener>`.
    let filter = format!("envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{NAME}/wasm/0");
    // Its route configuration has the listener's name.
    let listener = format!("{ns}/{}/{}", m.gateway, m.gateway_listener);
    object(
        "gateway.envoyproxy.io/v1alpha1",
        "EnvoyPatchPolicy",
        NAME,
        ns,
        vec![(
            "spec",
            map(vec![
                (
                    "targetRef",
                    map(vec![
                        ("group", s("gateway.networking.k8s.io")),
                        ("kind", s("Gateway")),
                        ("name", s(m.gateway.clone())),
                    ]),
                ),
                ("type", s("JSONPatch")),
                (
                    "jsonPatches",
                    Yaml::Array(vec![
                        add_at(
                            LISTENER,
                            &listener,
                            &format!("..http_filters[?(@.name=='{filter}')].typed_config.config"),
                            "allow_on_headers_stop_iteration",
                            Yaml::Boolean(true),
                        ),
                        // What a stream may buffer, as `edge render` sets it: Envoy Gateway's
                        // connections buffer 32 KiB (its default, and the ClientTrafficPolicy's),
                        // which would make Envoy answer 413 to a larger request and 500 to a
                        // larger response the upstream gave.
                        add_at(
                            "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
                            &listener,
                            "..virtual_hosts[*]",
                            "request_body_buffer_limit",
                            n(render::stream_buffer_limit(cfg)),
                        ),
                        // How long an answer may wait for a client that does not read it: the
                        // ClientTrafficPolicy has no field for it.
                        add_at(
                            LISTENER,
                            &listener,
                            "..filters[?(@.name=='envoy.filters.network.http_connection_manager')].typed_config",
                            "stream_flush_timeout",
                            duration(cfg.limits.response_flush_timeout_ms),
                        ),
                    ]),
                ),
            ]),
        )],
    )
}

const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// An `EnvoyPatchPolicy` operation: `value` added as `path` in each object `json_path` selects in
/// the xDS resource of `kind` named `name`.
fn add_at(kind: &str, name: &str, json_path: &str, path: &str, value: Yaml) -> Yaml {
    map(vec![
        ("type", s(kind)),
        ("name", s(name)),
        (
            "operation",
            map(vec![
                ("op", s("add")),
                ("jsonPath", s(json_path)),
                ("path", s(path)),
                ("value", value),
            ]),
        ),
    ])
}

/// The `EnvoyProxy` whose bootstrap adds the clusters the filter calls.
fn proxy(cfg: &Config) -> Yaml {
    let ns = &cfg.mesh.gateway_namespace;
    object(
        "gateway.envoyproxy.io/v1alpha1",
        "EnvoyProxy",
        NAME,
        ns,
        vec![(
            "spec",
            map(vec![(
                "bootstrap",
                map(vec![
                    ("type", s("Merge")),
                    ("value", s(gateway_bootstrap_clusters(cfg))),
                ]),
            )]),
        )],
    )
}

/// `[limits]` on the Gateway's clients, as `edge render` writes them into its own Envoy: the
/// listener's connection limit, what it reads from a connection at a time and the connections
/// it accepts a turn of the loop; a slow client's headers, whole request (with the filter's
/// waits: [`render::mesh_request_timeout_ms`]) and idle connection;
/// how long a request may stay silent (never shorter than the filter's waits); the HTTP/2
/// clients' streams and windows (their flood limits are Envoy's defaults, which Envoy Gateway
/// keeps). Envoy Gateway takes one `ClientTrafficPolicy` per Gateway: where one is there
/// already, merge these fields into it.
fn client_traffic_policy(cfg: &Config) -> Yaml {
    let l = &cfg.limits;
    object(
        "gateway.envoyproxy.io/v1alpha1",
        "ClientTrafficPolicy",
        NAME,
        &cfg.mesh.gateway_namespace,
        vec![(
            "spec",
            map(vec![
                ("targetRefs", target_gateway(cfg)),
                (
                    "connection",
                    map(vec![
                        (
                            "connectionLimit",
                            map(vec![("value", n(l.max_connections))]),
                        ),
                        ("bufferLimit", s(size(render::CONNECTION_READ_BYTES))),
                        ("maxAcceptPerSocketEvent", n(render::ACCEPTS_PER_EVENT)),
                    ]),
                ),
                (
                    "timeout",
                    map(vec![(
                        "http",
                        map(vec![
                            (
                                "requestHeadersReceivedTimeout",
                                s(gateway_duration(l.request_headers_timeout_ms)),
                            ),
                            (
                                "requestReceivedTimeout",
                                s(gateway_duration(render::mesh_request_timeout_ms(cfg))),
                            ),
                            ("idleTimeout", s(gateway_duration(l.idle_timeout_ms))),
                            (
                                "streamIdleTimeout",
                                s(gateway_duration(render::stream_idle_timeout_ms(cfg))),
                            ),
                        ]),
                    )]),
                ),
                (
                    "http2",
                    map(vec![
                        (
                            "maxConcurrentStreams",
                            n(render::CLIENT_STREAMS_PER_CONNECTION),
                        ),
                        (
                            "initialStreamWindowSize",
                            s(size(render::CLIENT_STREAM_WINDOW_BYTES)),
                        ),
                        (
                            "initialConnectionWindowSize",
                            s(size(render::CLIENT_CONNECTION_WINDOW_BYTES)),
                        ),
                    ]),
                ),
            ]),
        )],
    )
}

/// A duration as Envoy Gateway's API takes it (at most five digits a unit): milliseconds
/// where they fit, else the smallest of seconds, minutes and hours that holds it, rounded up (a
/// timeout never shorter than asked).
fn gateway_duration(ms: u64) -> String {
    if ms <= 99_999 && !ms.is_multiple_of(1_000) {
        return format!("{ms}ms");
    }
    let mut value = ms.div_ceil(1_000);
    for (unit, next) in [("s", 60), ("m", 60)] {
        if value <= 99_999 {
            return format!("{value}{unit}");
        }
        value = value.div_ceil(next);
    }
    format!("{}h", value.min(99_999))
}

/// A size as Envoy Gateway's API takes it: `Mi` or `Ki` where exact, else bytes.
fn size(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{}Mi", bytes >> 20)
    } else if bytes.is_multiple_of(1 << 10) {
        format!("{}Ki", bytes >> 10)
    } else {
        bytes.to_string()
    }
}

/// The JWT's `SecurityPolicy` on the Gateway (none with a header subject).
fn security_policy(cfg: &Config) -> Option<Yaml> {
    let ns = &cfg.mesh.gateway_namespace;
    let Subject::Jwt(j) = &cfg.subject else {
        return None;
    };
    let mut provider = vec![
        ("name", s(render::JWT_PROVIDER)),
        ("issuer", s(j.issuer.clone())),
        (
            "audiences",
            Yaml::Array(j.audiences.iter().map(|a| s(a.clone())).collect()),
        ),
        (
            "claimToHeaders",
            Yaml::Array(vec![map(vec![
                ("header", s(j.header.clone())),
                ("claim", s(j.claim.clone())),
            ])]),
        ),
    ];
    match (jwks_uri(j), jwks_text(j)) {
        (Some(uri), _) => provider.push(("remoteJWKS", map(vec![("uri", s(uri))]))),
        (None, Some(text)) => provider.push((
            "localJWKS",
            map(vec![("type", s("Inline")), ("inline", s(text))]),
        )),
        (None, None) => {}
    }
    Some(object(
        "gateway.envoyproxy.io/v1alpha1",
        "SecurityPolicy",
        NAME,
        ns,
        vec![(
            "spec",
            map(vec![
                ("targetRefs", target_gateway(cfg)),
                (
                    "jwt",
                    // A request without a token reaches the filter, which answers 401 on
                    // a protected route and lets the others pass (as `edge run`).
                    map(vec![
                        ("optional", Yaml::Boolean(true)),
                        ("providers", Yaml::Array(vec![map(provider)])),
                    ]),
                ),
            ]),
        )],
    ))
}

/// The clusters the filter calls, as Envoy Gateway's bootstrap merges them: the state API's,
/// and each reconcile endpoint's (`reconcile_<i>`, the route's upstream when it names none).
pub fn gateway_bootstrap_clusters(cfg: &Config) -> String {
    let ca = render::DEFAULT_CA_FILE;
    let mut clusters = Vec::new();
    for (name, http2) in [
        (render::STATE_API_CLUSTER, false),
        (render::STATE_API_WAIT_CLUSTER, true),
    ] {
        let mut c = render::cluster(name, &state_api_endpoint(cfg), 500, ca);
        render::state_api_calls(&mut c, http2);
        clusters.push(c);
    }
    for (i, r) in cfg.routes.iter().enumerate() {
        if let Some(rc) = &r.reconcile {
            let e = rc.upstream.as_ref().unwrap_or(&cfg.upstream);
            clusters.push(render::cluster(&render::reconcile_cluster(i), e, 1_000, ca));
        }
    }
    let doc = map(vec![(
        "static_resources",
        map(vec![("clusters", Yaml::Array(clusters))]),
    )]);
    let mut text = String::new();
    let mut emitter = YamlEmitter::new(&mut text);
    if emitter.dump(&doc).is_err() {
        return String::new();
    }
    text.trim_start_matches("---\n").to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_fit_envoy_gateway_s_five_digits_and_never_round_down() {
        for (ms, text) in [
            (2_500, "2500ms"),
            (60_000, "60s"),
            (300_000, "300s"),
            (150_500, "151s"),
            (99_999_000, "99999s"),
            (100_000_000, "1667m"),
            (10_000_000_000, "2778h"),
        ] {
            assert_eq!(gateway_duration(ms), text, "{ms}");
        }
    }

    #[test]
    fn sizes_in_envoy_gateway_s_units() {
        assert_eq!(size(32 * 1024), "32Ki");
        assert_eq!(size(1 << 20), "1Mi");
        assert_eq!(size(1_000), "1000");
    }
}
