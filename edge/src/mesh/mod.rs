//! `edge render --target istio|envoy-gateway`: the same configuration file as Kubernetes
//! manifests for a mesh's Envoys, printed as one multi-document YAML.
//!
//! - The state API as Kubernetes objects (both targets): a `Namespace`, a `Secret` with its
//!   secrets, a `Deployment` (migrations in an init container, readiness `/readyz`, liveness
//!   `/healthz`, non-root, read-only root file system), a `Service`, a `PodDisruptionBudget` and
//!   a `NetworkPolicy` that admits only the mesh's Envoys. Or, with `[mesh] state_api_url`, an
//!   existing state API outside the cluster.
//! - Istio: the filter as an `EnvoyFilter` (an ECDS extension pulled from the OCI image, pinned
//!   by its digest, inserted before the router, after authentication; `[limits]` merged into
//!   the gateways' connection manager and listeners), a `DestinationRule` for the state API
//!   (and a `ServiceEntry` for one outside the cluster), a `RequestAuthentication` for the JWT.
//! - Envoy Gateway: an `EnvoyExtensionPolicy` with the Wasm image and its config, an
//!   `EnvoyPatchPolicy`, an `EnvoyProxy` whose bootstrap adds the clusters the filter calls, a
//!   `ClientTrafficPolicy` with `[limits]`, a `SecurityPolicy` for the JWT.
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

use std::collections::BTreeMap;

use filter_core::config as fc;
use yaml_rust2::{Yaml, YamlEmitter};

pub use crate::config::is_object_name;
use crate::config::{Config, Endpoint, Jwks, OnStateUnavailable, Subject};
use crate::render::{self, Wiring};
use crate::yaml::{map, s};

mod gateway;
mod istio;
mod state_api;

use gateway::envoy_gateway;
pub use gateway::gateway_bootstrap_clusters;
use istio::istio;
use state_api::state_api_objects;
pub use state_api::{secrets, Secrets};

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

/// Why a configuration or a module cannot be rendered as manifests.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("[state.tls] is not rendered for a mesh: inside the cluster the state API is reached over the mesh's network, admitted by its NetworkPolicy and token (remove [state.tls], or render --target envoy)")]
    StateTls,
    /// The module's image (whose digest the manifests pin) cannot be built.
    #[error("{0}")]
    Image(#[from] oci::OciError),
    #[error("{0}")]
    PluginJson(#[from] serde_json::Error),
    #[error("{0}")]
    Yaml(#[from] yaml_rust2::EmitError),
}

/// For callers that report errors as text (the end-to-end harness's `Result<_, String>`).
impl From<MeshError> for String {
    fn from(e: MeshError) -> Self {
        e.to_string()
    }
}

/// What pins the module: the manifest digest of its compat image (`make oci`), hex.
pub struct Pins {
    pub image_digest_hex: String,
}

impl Pins {
    /// The digest `make oci` gives this module's compat image: the image is reproducible, so
    /// the module is enough to know it.
    pub fn of_module(module: &[u8]) -> Result<Self, MeshError> {
        let images = oci::build(module, env!("CARGO_PKG_VERSION"))?;
        let digest = images.compat.manifest.digest();
        Ok(Self {
            image_digest_hex: digest.trim_start_matches("sha256:").to_owned(),
        })
    }
}

/// The manifests for `target`, or why this configuration cannot be rendered for it.
pub fn manifests(cfg: &Config, target: Target, pins: &Pins) -> Result<String, MeshError> {
    if cfg.state.tls.is_some() {
        return Err(MeshError::StateTls);
    }
    let m = &cfg.mesh;
    let plugin = render::plugin_config(cfg, &wiring(cfg, target), &secrets(cfg).token);
    let plugin = serde_json::to_value(&plugin)?;
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
        emitter.dump(&doc)?;
        out.push_str(&text);
        out.push('\n');
    }
    Ok(out)
}

fn header(cfg: &Config, target: Target) -> String {
    let mut h = String::from(
        "# Rendered by `edge render` from the configuration file. Not applied to a live cluster by\n\
         # its tests: checked against the CRDs' and Kubernetes' schemas, and the filter's part\n\
         # through a real Envoy (docs/deploying/mesh.md).\n",
    );
    // Issue 46, finding 3: a route's retries are the mesh's objects, not these; the filter
    // makes what it forwards unretriable whatever they say, and they should say it too.
    h.push_str(
        "# The routes this protects (the file's [[route]]s) must be sent once: the filter forwards\n\
         # them with `x-envoy-max-retries: 0`, which the router takes over any retry policy\n\
         # (docs/filter.md, *Router retries below the filter*). Say so on their routes too:\n",
    );
    h.push_str(match target {
        Target::Istio => {
            "# `retries: {attempts: 0}` in their VirtualService's `http` routes (without it Istio\n\
             # retries connect failures, refused streams and 503 twice), and no `mirror`.\n"
        }
        Target::EnvoyGateway => {
            "# no `retry` in their HTTPRoute's rules (or `attempts: 0`), `retry: {numRetries: 0}` in\n\
             # a BackendTrafficPolicy that targets them, and no RequestMirror filter.\n"
        }
    });
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
            // Istio names one cluster per Service port, with that port's protocol: waiting
            // claims share the HTTP/1.1 one (a second, HTTP/2 port is not rendered).
            state_api_wait_cluster: None,
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
            state_api_wait_cluster: Some(render::STATE_API_WAIT_CLUSTER.to_owned()),
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
