//! `edge render --target istio|envoy-gateway`: the same configuration file as Kubernetes
//! manifests for a mesh's Envoys, printed as one multi-document YAML.
//!
//! - The state API as Kubernetes objects (both targets): a `Namespace`, a `Secret` with its
//!   secrets, a `Deployment` (migrations in an init container, readiness `/readyz`, liveness
//!   `/healthz`, non-root, read-only root file system), a `Service`, a `PodDisruptionBudget` and
//!   a `NetworkPolicy` that admits only the mesh's Envoys. Or, with `[mesh] state_api_url`, an
//!   existing state API outside the cluster.
//! - Istio: the filter as an `EnvoyFilter` (an ECDS extension pulled from the OCI image, pinned
//!   by its digest, inserted before the router, after authentication), a `DestinationRule` for
//!   the state API (and a `ServiceEntry` for one outside the cluster), a `RequestAuthentication`
//!   for the JWT.
//! - Envoy Gateway: an `EnvoyExtensionPolicy` with the Wasm image and its config, an
//!   `EnvoyPatchPolicy`, an `EnvoyProxy` whose bootstrap adds the clusters the filter calls, a
//!   `SecurityPolicy` for the JWT.
//!
//! Why not Istio's `WasmPlugin` alone: neither it nor Envoy Gateway's Wasm API can set the
//! filter's `allow_on_headers_stop_iteration: true` (Envoy >= 1.35), without which Envoy stops
//! the body callbacks of a filter that pauses in the headers, and a protected request with a
//! body never reaches the upstream (tests/tests/mesh.rs shows it in Envoy 1.40). Istio's
//! EnvoyFilter can add a whole extension config with it; Envoy Gateway's EnvoyPatchPolicy can
//! set it on the filter its EnvoyExtensionPolicy made.
//!
//! The filter finds the caller in jwt_authn's dynamic metadata (`subject.metadata`), where each
//! mesh writes the verified payload: no client can forge it, even on a request without a token
//! (both meshes let those through to the filter, which answers 401 on a protected route).

use contract::state_env;
use std::collections::BTreeMap;

use filter_core::config as fc;
use yaml_rust2::{Yaml, YamlEmitter};

pub use crate::config::is_object_name;
use crate::config::{Config, Endpoint, Jwks, OnStateUnavailable, Subject};
use crate::render::{self, duration, map, n, s, Wiring};

/// Where the manifests go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Istio,
    EnvoyGateway,
}

/// The name of every object rendered here, and the state API's labels.
pub const NAME: &str = "idempotency";
pub const STATE_API: &str = "state-api";
/// The root id the filter registers (and the OCI image's runtime config names).
const ROOT_ID: &str = "idempotency";
const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";

/// What pins the module: the manifest digest of its compat image (`make oci`), hex.
pub struct Pins {
    pub image_digest_hex: String,
}

impl Pins {
    /// The digest `make oci` gives this module's compat image: the image is reproducible, so
    /// the module is enough to know it.
    pub fn of_module(module: &[u8]) -> Result<Self, String> {
        let images = oci::build(module, env!("CARGO_PKG_VERSION")).map_err(|e| e.to_string())?;
        let digest = images.compat.manifest.digest();
        Ok(Self {
            image_digest_hex: digest.trim_start_matches("sha256:").to_owned(),
        })
    }
}

/// The manifests for `target`, or why this configuration cannot be rendered for it.
pub fn manifests(cfg: &Config, target: Target, pins: &Pins) -> Result<String, String> {
    if cfg.state.tls.is_some() {
        return Err("[state.tls] is not rendered for a mesh: inside the cluster the state API is reached over the mesh's network, admitted by its NetworkPolicy and token (remove [state.tls], or render --target envoy)".into());
    }
    let m = &cfg.mesh;
    let plugin = render::plugin_config(cfg, &wiring(cfg, target), &secrets(cfg).token);
    let plugin = serde_json::to_value(&plugin).map_err(|e| e.to_string())?;
    // The namespace and the state API first: `kubectl apply -f` creates in this order.
    let mut docs = match m.external_state_api {
        None => state_api_objects(cfg, target),
        Some(_) => Vec::new(),
    };
    docs.extend(match target {
        Target::Istio => istio(cfg, &plugin, pins),
        Target::EnvoyGateway => envoy_gateway(cfg, &plugin, pins),
    });
    let mut out = header(cfg, target);
    for doc in docs {
        let mut text = String::new();
        let mut emitter = YamlEmitter::new(&mut text);
        emitter.multiline_strings(true);
        emitter.dump(&doc).map_err(|e| e.to_string())?;
        out.push_str(&text);
        out.push('\n');
    }
    Ok(out)
}

fn header(cfg: &Config, target: Target) -> String {
    let mut h = String::from(
        "# Rendered by `edge render` from the configuration file. Not applied to a live cluster by\n\
         # its tests: checked against the CRDs' and Kubernetes' schemas, and the filter's part\n\
         # through a real Envoy (README, *Istio and Envoy Gateway*).\n",
    );
    if target == Target::EnvoyGateway {
        let m = &cfg.mesh;
        h.push_str(&format!(
            "# The Gateway `{}` needs `spec.infrastructure.parametersRef` naming the EnvoyProxy `{NAME}` (its\n\
             # clusters), and Envoy Gateway `extensionApis.enableEnvoyPatchPolicy: true` (the EnvoyPatchPolicy).\n",
            m.gateway
        ));
    }
    for (what, placeholder) in [
        (
            "state_api_image",
            cfg.mesh.state_api_image.starts_with("registry.invalid/"),
        ),
        (
            "filter_image",
            cfg.mesh.filter_image.starts_with("registry.invalid/"),
        ),
    ] {
        if placeholder {
            h.push_str(&format!(
                "# [mesh] {what} is a placeholder: set it in the file.\n"
            ));
        }
    }
    h
}

/// Where the filter reaches the state API, as `host:port` in the cluster's DNS.
fn state_api_endpoint(cfg: &Config) -> Endpoint {
    cfg.mesh
        .external_state_api
        .clone()
        .unwrap_or_else(|| Endpoint {
            tls: false,
            host: format!("{STATE_API}.{}.svc.cluster.local", cfg.mesh.namespace),
            port: cfg.state.listen.port(),
        })
}

/// Istio's name for the outbound cluster of a service: `outbound|port||host`.
fn istio_cluster(e: &Endpoint) -> String {
    format!("outbound|{}||{}", e.port, e.host)
}

/// jwt_authn's dynamic metadata, where the claim is: under the key each mesh gives the verified
/// payload (Istio: `payload`; Envoy Gateway: the provider's name), a dotted claim as nested keys.
fn subject_source(cfg: &Config, payload_key: &str) -> fc::SubjectSource {
    match &cfg.subject {
        Subject::Jwt(j) => {
            let mut path = vec![
                "envoy.filters.http.jwt_authn".to_owned(),
                payload_key.to_owned(),
            ];
            path.extend(j.claim.split('.').map(str::to_owned));
            fc::SubjectSource::Metadata(path)
        }
        Subject::Header(h) => fc::SubjectSource::Header(h.clone()),
    }
}

fn wiring(cfg: &Config, target: Target) -> Wiring {
    let state_api = state_api_endpoint(cfg);
    match target {
        Target::Istio => Wiring {
            state_api_cluster: istio_cluster(&state_api),
            state_api_authority: state_api.authority(),
            subject: subject_source(cfg, "payload"),
            reconcile_cluster: |cfg, i| {
                let rc = cfg.routes.get(i).and_then(|r| r.reconcile.as_ref());
                istio_cluster(
                    rc.and_then(|rc| rc.upstream.as_ref())
                        .unwrap_or(&cfg.upstream),
                )
            },
        },
        Target::EnvoyGateway => Wiring {
            state_api_cluster: render::STATE_API_CLUSTER.to_owned(),
            state_api_authority: state_api.authority(),
            subject: subject_source(cfg, render::JWT_PROVIDER),
            reconcile_cluster: |_, i| render::reconcile_cluster(i),
        },
    }
}

/// A fatal error of the module lets requests through only when every route would rather be
/// forwarded unprotected than refused (`on_state_unavailable = "fail_open"` on all).
fn fail_open(cfg: &Config) -> bool {
    cfg.routes
        .iter()
        .all(|r| r.on_state_unavailable == OnStateUnavailable::FailOpen)
}

fn object(
    api_version: &str,
    kind: &str,
    name: &str,
    namespace: &str,
    spec: Vec<(&str, Yaml)>,
) -> Yaml {
    let mut pairs = vec![
        ("apiVersion", s(api_version)),
        ("kind", s(kind)),
        (
            "metadata",
            map(vec![
                ("name", s(name)),
                ("namespace", s(namespace)),
                ("labels", labels()),
            ]),
        ),
    ];
    pairs.extend(spec);
    map(pairs)
}

fn labels() -> Yaml {
    map(vec![("app.kubernetes.io/part-of", s("edge-idempotency"))])
}

fn string_map(m: &BTreeMap<String, String>) -> Yaml {
    map(m.iter().map(|(k, v)| (k.as_str(), s(v.clone()))).collect())
}

/// JSON as YAML (the plugin configuration in a manifest is an object, not a string).
pub fn yaml_of_json(v: &serde_json::Value) -> Yaml {
    use serde_json::Value as J;
    match v {
        J::Null => Yaml::Null,
        J::Bool(b) => Yaml::Boolean(*b),
        J::Number(x) => x
            .as_i64()
            .map_or_else(|| Yaml::Real(x.to_string()), Yaml::Integer),
        J::String(t) => s(t.clone()),
        J::Array(items) => Yaml::Array(items.iter().map(yaml_of_json).collect()),
        J::Object(members) => map(members
            .iter()
            .map(|(k, v)| (k.as_str(), yaml_of_json(v)))
            .collect()),
    }
}

/// YAML as JSON: what a manifest's reader (the API server, a test) sees.
pub fn json_of_yaml(y: &Yaml) -> serde_json::Value {
    use serde_json::Value as J;
    match y {
        Yaml::Boolean(b) => J::Bool(*b),
        Yaml::Integer(i) => J::from(*i),
        Yaml::Real(r) => r.parse::<f64>().map_or(J::Null, J::from),
        Yaml::String(t) => J::String(t.clone()),
        Yaml::Array(items) => J::Array(items.iter().map(json_of_yaml).collect()),
        Yaml::Hash(h) => J::Object(
            h.iter()
                .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), json_of_yaml(v))))
                .collect(),
        ),
        _ => J::Null,
    }
}

fn target_gateway(cfg: &Config) -> Yaml {
    Yaml::Array(vec![map(vec![
        ("group", s("gateway.networking.k8s.io")),
        ("kind", s("Gateway")),
        ("name", s(cfg.mesh.gateway.clone())),
    ])])
}

fn jwks_text(j: &crate::config::Jwt) -> Option<String> {
    match &j.jwks {
        Jwks::File(path) => std::fs::read_to_string(path).ok(),
        Jwks::Url { .. } => None,
    }
}

fn jwks_uri(j: &crate::config::Jwt) -> Option<String> {
    match &j.jwks {
        Jwks::Url { endpoint, path } => Some(format!(
            "{}://{}{path}",
            if endpoint.tls { "https" } else { "http" },
            endpoint.authority()
        )),
        Jwks::File(_) => None,
    }
}

// ---------------------------------------------------------------------------------------------
// Istio

fn istio(cfg: &Config, plugin: &serde_json::Value, pins: &Pins) -> Vec<Yaml> {
    let m = &cfg.mesh;
    let selector = map(vec![("labels", string_map(&m.istio_labels))]);
    let wasm = map(vec![
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
    ]);
    let hcm_match = map(vec![
        ("context", s("GATEWAY")),
        (
            "listener",
            map(vec![(
                "filterChain",
                map(vec![(
                    "filter",
                    map(vec![
                        ("name", s("envoy.filters.network.http_connection_manager")),
                        (
                            "subFilter",
                            map(vec![("name", s("envoy.filters.http.router"))]),
                        ),
                    ]),
                )]),
            )]),
        ),
    ]);
    let mut docs = vec![object(
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
                    ]),
                ),
            ]),
        )],
    )];
    if let Subject::Jwt(j) = &cfg.subject {
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
        docs.push(object(
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
        ));
    }
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

// ---------------------------------------------------------------------------------------------
// Envoy Gateway

fn envoy_gateway(cfg: &Config, plugin: &serde_json::Value, pins: &Pins) -> Vec<Yaml> {
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
    // Envoy Gateway names the filter `envoy.filters.http.wasm/<policy kind>/<ns>/<name>/wasm/<i>`
    // and the listener `<ns>/<gateway>/<listener>`.
    let filter = format!("envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{NAME}/wasm/0");
    let mut docs = vec![
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
        ),
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
                            ("type", s("type.googleapis.com/envoy.config.listener.v3.Listener")),
                            ("name", s(format!("{ns}/{}/{}", m.gateway, m.gateway_listener))),
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
        ),
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
        ),
    ];
    if let Subject::Jwt(j) = &cfg.subject {
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
        docs.push(object(
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
        ));
    }
    docs
}

/// The clusters the filter calls, as Envoy Gateway's bootstrap merges them: the state API's,
/// and each reconcile endpoint's (`reconcile_<i>`, the route's upstream when it names none).
pub fn gateway_bootstrap_clusters(cfg: &Config) -> String {
    let ca = render::DEFAULT_CA_FILE;
    let mut clusters = vec![render::cluster(
        render::STATE_API_CLUSTER,
        &state_api_endpoint(cfg),
        500,
        ca,
    )];
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

// ---------------------------------------------------------------------------------------------
// The state API in the cluster

/// The state API's secrets, from the file or as placeholders that say where to set them.
pub struct Secrets {
    pub token: String,
    pub key_secret: String,
    pub database_url: String,
    pub storage_key: String,
}

pub fn secrets(cfg: &Config) -> Secrets {
    let st = &cfg.state;
    Secrets {
        token: st
            .token
            .clone()
            .unwrap_or_else(|| "SET-state.token-IN-THE-FILE".into()),
        key_secret: st
            .key_secret
            .clone()
            .unwrap_or_else(|| "SET-state.key_secret-IN-THE-FILE".into()),
        database_url: st
            .database_url
            .clone()
            .unwrap_or_else(|| "postgres://USER:PASSWORD@HOST:5432/DATABASE".into()),
        storage_key: st.storage_key.clone().unwrap_or_else(|| {
            "SET-state.storage_key-IN-THE-FILE (openssl rand -base64 32)".into()
        }),
    }
}

/// The state API's environment variables that hold secrets: they go into its Secret.
const SECRET_VARIABLES: &[&str] = &[
    state_env::DATABASE_URL,
    state_env::STATE_API_TOKEN,
    state_env::IDEM_KEY_SECRET,
    state_env::IDEM_PREVIOUS_KEY_SECRET,
    state_env::STATE_API_STORAGE_KEY,
    state_env::STATE_API_PREVIOUS_STORAGE_KEY,
    state_env::STATE_API_ADMIN_TOKEN,
];

fn state_api_objects(cfg: &Config, target: Target) -> Vec<Yaml> {
    let m = &cfg.mesh;
    let ns = &m.namespace;
    let port = cfg.state.listen.port();
    let sec = secrets(cfg);
    let mut env = render::state_api_env(cfg, &sec.database_url, &sec.token, &sec.key_secret);
    if cfg.state.storage_key.is_none() {
        env.push((
            state_env::STATE_API_STORAGE_KEY.into(),
            sec.storage_key.clone(),
        ));
    }
    let (secret_env, plain_env): (Vec<_>, Vec<_>) = env
        .into_iter()
        .filter(|(k, _)| k != state_env::LISTEN_ADDR)
        .partition(|(k, _)| SECRET_VARIABLES.contains(&k.as_str()));
    let mut container_env = vec![map(vec![
        ("name", s(state_env::LISTEN_ADDR)),
        ("value", s(format!("0.0.0.0:{port}"))),
    ])];
    container_env.extend(
        plain_env
            .iter()
            .map(|(k, v)| map(vec![("name", s(k.clone())), ("value", s(v.clone()))])),
    );
    let selector = map(vec![("app.kubernetes.io/name", s(STATE_API))]);
    let non_root = map(vec![
        ("allowPrivilegeEscalation", Yaml::Boolean(false)),
        ("readOnlyRootFilesystem", Yaml::Boolean(true)),
        (
            "capabilities",
            map(vec![("drop", Yaml::Array(vec![s("ALL")]))]),
        ),
    ]);
    let from_secret = Yaml::Array(vec![map(vec![(
        "secretRef",
        map(vec![("name", s(STATE_API))]),
    )])]);
    let probe = |path: &str, period_s: u64| {
        map(vec![
            ("httpGet", map(vec![("path", s(path)), ("port", s("http"))])),
            ("periodSeconds", n(period_s)),
        ])
    };
    let mut pod_labels = vec![("app.kubernetes.io/name", s(STATE_API))];
    if target == Target::Istio {
        // No sidecar: the gateways reach it directly (DestinationRule `tls: DISABLE`), and its
        // migrations run before any sidecar could start.
        pod_labels.push(("sidecar.istio.io/inject", s("false")));
    }
    let image = s(m.state_api_image.clone());
    let pod = map(vec![
        ("metadata", map(vec![("labels", map(pod_labels))])),
        (
            "spec",
            map(vec![
                (
                    "securityContext",
                    map(vec![
                        ("runAsNonRoot", Yaml::Boolean(true)),
                        ("runAsUser", n(10_001)),
                        ("runAsGroup", n(10_001)),
                        ("seccompProfile", map(vec![("type", s("RuntimeDefault"))])),
                    ]),
                ),
                (
                    // The migrations run to the end before the server of a new version
                    // starts (sqlx holds an advisory lock: replicas starting together wait in
                    // turn); with maxUnavailable 0 the old pods serve meanwhile.
                    "initContainers",
                    Yaml::Array(vec![map(vec![
                        ("name", s("migrate")),
                        ("image", image.clone()),
                        ("args", Yaml::Array(vec![s("--migrate-only")])),
                        ("envFrom", from_secret.clone()),
                        ("securityContext", non_root.clone()),
                    ])]),
                ),
                (
                    "containers",
                    Yaml::Array(vec![map(vec![
                        ("name", s(STATE_API)),
                        ("image", image),
                        (
                            "ports",
                            Yaml::Array(vec![map(vec![
                                ("name", s("http")),
                                ("containerPort", n(u64::from(port))),
                            ])]),
                        ),
                        ("env", Yaml::Array(container_env)),
                        ("envFrom", from_secret),
                        ("readinessProbe", probe("/readyz", 5)),
                        ("livenessProbe", probe("/healthz", 10)),
                        (
                            "resources",
                            map(vec![(
                                "requests",
                                map(vec![("cpu", s("250m")), ("memory", s("128Mi"))]),
                            )]),
                        ),
                        ("securityContext", non_root),
                    ])]),
                ),
            ]),
        ),
    ]);
    let secret_data = map(secret_env
        .iter()
        .map(|(k, v)| (k.as_str(), s(v.clone())))
        .collect());
    let (envoy_ns, envoy_labels) = match target {
        Target::Istio => (m.istio_namespace.clone(), m.istio_labels.clone()),
        Target::EnvoyGateway => (
            m.gateway_proxy_namespace.clone(),
            BTreeMap::from([
                (
                    "gateway.envoyproxy.io/owning-gateway-name".into(),
                    m.gateway.clone(),
                ),
                (
                    "gateway.envoyproxy.io/owning-gateway-namespace".into(),
                    m.gateway_namespace.clone(),
                ),
            ]),
        ),
    };
    vec![
        map(vec![
            ("apiVersion", s("v1")),
            ("kind", s("Namespace")),
            (
                "metadata",
                map(vec![("name", s(ns.clone())), ("labels", labels())]),
            ),
        ]),
        object(
            "v1",
            "Secret",
            STATE_API,
            ns,
            vec![("type", s("Opaque")), ("stringData", secret_data)],
        ),
        object(
            "apps/v1",
            "Deployment",
            STATE_API,
            ns,
            vec![(
                "spec",
                map(vec![
                    ("replicas", n(u64::from(m.replicas))),
                    ("selector", map(vec![("matchLabels", selector.clone())])),
                    (
                        "strategy",
                        map(vec![
                            ("type", s("RollingUpdate")),
                            (
                                "rollingUpdate",
                                map(vec![("maxUnavailable", n(0)), ("maxSurge", n(1))]),
                            ),
                        ]),
                    ),
                    ("template", pod),
                ]),
            )],
        ),
        object(
            "v1",
            "Service",
            STATE_API,
            ns,
            vec![(
                "spec",
                map(vec![
                    ("selector", selector.clone()),
                    (
                        "ports",
                        Yaml::Array(vec![map(vec![
                            ("name", s("http")),
                            ("port", n(u64::from(port))),
                            ("targetPort", s("http")),
                        ])]),
                    ),
                ]),
            )],
        ),
        object(
            "policy/v1",
            "PodDisruptionBudget",
            STATE_API,
            ns,
            vec![(
                "spec",
                map(vec![
                    ("minAvailable", n(1)),
                    ("selector", map(vec![("matchLabels", selector.clone())])),
                ]),
            )],
        ),
        object(
            "networking.k8s.io/v1",
            "NetworkPolicy",
            STATE_API,
            ns,
            vec![(
                "spec",
                map(vec![
                    ("podSelector", map(vec![("matchLabels", selector)])),
                    ("policyTypes", Yaml::Array(vec![s("Ingress")])),
                    (
                        "ingress",
                        Yaml::Array(vec![map(vec![
                            (
                                "from",
                                Yaml::Array(vec![map(vec![
                                    (
                                        "namespaceSelector",
                                        map(vec![(
                                            "matchLabels",
                                            map(vec![("kubernetes.io/metadata.name", s(envoy_ns))]),
                                        )]),
                                    ),
                                    (
                                        "podSelector",
                                        map(vec![("matchLabels", string_map(&envoy_labels))]),
                                    ),
                                ])]),
                            ),
                            (
                                "ports",
                                Yaml::Array(vec![map(vec![
                                    ("protocol", s("TCP")),
                                    ("port", n(u64::from(port))),
                                ])]),
                            ),
                        ])]),
                    ),
                ]),
            )],
        ),
    ]
}
