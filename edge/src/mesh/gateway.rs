//! Envoy Gateway: an `EnvoyExtensionPolicy` with the Wasm image and its config, an
//! `EnvoyPatchPolicy` (what the extension policy cannot say), an `EnvoyProxy` whose bootstrap adds
//! the clusters the filter calls, a `SecurityPolicy` for the JWT.

use yaml_rust2::{Yaml, YamlEmitter};

use super::*;

pub(super) fn envoy_gateway(cfg: &Config, plugin: &serde_json::Value, pins: &Pins) -> Vec<Yaml> {
    let mut docs = vec![
        extension_policy(cfg, plugin, pins),
        patch_policy(cfg),
        proxy(cfg),
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
/// made.
fn patch_policy(cfg: &Config) -> Yaml {
    let m = &cfg.mesh;
    let ns = &m.gateway_namespace;
    // Envoy Gateway names the filter `envoy.filters.http.wasm/<policy kind>/<ns>/<name>/wasm/<i>`
    // and the listener `<ns>/<gateway>/<listener>`.
    let filter = format!("envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{NAME}/wasm/0");
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
                    Yaml::Array(vec![map(vec![
                        (
                            "type",
                            s("type.googleapis.com/envoy.config.listener.v3.Listener"),
                        ),
                        (
                            "name",
                            s(format!("{ns}/{}/{}", m.gateway, m.gateway_listener)),
                        ),
                        (
                            "operation",
                            map(vec![
                                ("op", s("add")),
                                (
                                    "jsonPath",
                                    s(format!(
                                        "..http_filters[?(@.name=='{filter}')].typed_config.config"
                                    )),
                                ),
                                ("path", s("allow_on_headers_stop_iteration")),
                                ("value", Yaml::Boolean(true)),
                            ]),
                        ),
                    ])]),
                ),
            ]),
        )],
    )
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
