//! `edge render --target istio|envoy-gateway`, as far as it can be tested without a cluster:
//! every object parses into its kind's known fields (the custom resources against their CRDs'
//! schemas, the state API's objects through the Kubernetes API's own types), the plugin
//! configuration in them passes the plugin schema and the filter, the image is pinned by the
//! digest `make oci` gives it, the state API runs as the issue asks, and Envoy takes the
//! clusters Envoy Gateway's bootstrap gets. tests/tests/mesh.rs runs the filter's part through
//! a real Envoy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use contract::state_env;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use edge::config::Config;
use edge::mesh::{json_of_yaml, manifests, Pins, Target};
use serde_json::{json, Value};
use yaml_rust2::YamlLoader;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const MODULE: &[u8] = b"\0asm\x01\0\0\0";

fn pins() -> Pins {
    Pins::of_module(MODULE).unwrap()
}

/// The rendered documents, as JSON.
fn render(cfg: &Config, target: Target) -> Vec<Value> {
    let text = manifests(cfg, target, &pins()).unwrap();
    YamlLoader::load_from_str(&text)
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
        .iter()
        .map(json_of_yaml)
        .collect()
}

fn load(file: &str) -> Config {
    Config::load(&root().join(file)).unwrap()
}

fn parse(text: &str) -> Result<Config, edge::config::ConfigError> {
    let dir = root().join("examples");
    Config::parse(text, "mesh.toml", &dir)
}

/// A file with what the others lack: a header subject, a reconcile endpoint of its own, a route
/// that fails open, names of its own.
const OWN: &str = r#"
listen = "127.0.0.1:10000"
upstream = "http://orders.shop.svc.cluster.local:8080"
[state]
token = "a-token-of-16-chars-or-more"
key_secret = "a-key-secret-of-16-chars"
admin_token = "an-admin-token-of-16-chars"
retention_s = 3600
[subject]
header = "x-user"
[[route]]
method = "POST"
path = "/orders"
key = "required"
on_unknown = "reconcile"
on_state_unavailable = "fail_open"
reconcile = { path = "/attempts/{key}", upstream = "http://ledger.shop.svc.cluster.local:9000" }
[mesh]
namespace = "shop-idempotency"
state_api_image = "registry.example/shop/state-api:1.2.3"
filter_image = "oci://registry.example/shop/idempotency-filter:1.2.3"
replicas = 3
istio_namespace = "shop-gateways"
istio_labels = { app = "shop-gateway" }
gateway = "shop"
gateway_namespace = "shop"
gateway_listener = "https"
gateway_proxy_namespace = "shop-proxies"
"#;

/// The same with the state API outside the cluster.
fn external() -> Config {
    parse(&format!(
        "{}state_api_url = \"https://state.shop.example:8443\"\n",
        OWN
    ))
    .unwrap()
}

fn configs() -> Vec<(&'static str, Config)> {
    vec![
        ("examples/own-api.toml", load("examples/own-api.toml")),
        ("examples/demo.toml", load("examples/demo.toml")),
        ("a file of its own", parse(OWN).unwrap()),
        ("a state API outside the cluster", external()),
    ]
}

fn crd_schema(api_version: &str, kind: &str) -> Option<Value> {
    let (group, version) = api_version.split_once('/')?;
    let path = root().join(format!("edge/tests/crds/{group}_{version}_{kind}.json"));
    let text = std::fs::read_to_string(path).ok()?;
    let mut schema: Value = serde_json::from_str(&text).unwrap();
    // Every object has these (Istio's CRDs list `spec` and `status` only); metadata as rendered.
    let root = schema["properties"].as_object_mut().unwrap();
    root.insert("apiVersion".into(), json!({"type": "string"}));
    root.insert("kind".into(), json!({"type": "string"}));
    root.insert(
        "metadata".into(),
        json!({"type": "object", "properties": {
            "name": {"type": "string"}, "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}),
    );
    refuse_unknown_members(&mut schema);
    Some(schema)
}

/// What the API server prunes, refused: an object schema that lists its properties and does not
/// keep unknown fields takes no others.
fn refuse_unknown_members(v: &mut Value) {
    match v {
        Value::Object(map) => {
            let keeps = map.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true));
            if map.contains_key("properties") && !map.contains_key("additionalProperties") && !keeps
            {
                map.insert("additionalProperties".into(), json!(false));
            }
            map.values_mut().for_each(refuse_unknown_members);
        }
        Value::Array(items) => items.iter_mut().for_each(refuse_unknown_members),
        _ => {}
    }
}

/// `doc` read into the Kubernetes API's type `T` and written back: a field the type does not
/// know is dropped, so the two differ.
fn through<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value) -> Result<(), String> {
    let typed: T = serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    if &back == doc {
        Ok(())
    } else {
        Err(format!("the Kubernetes type reads it as {back:#}"))
    }
}

fn check_known_fields(doc: &Value) -> Result<(), String> {
    use k8s_openapi::api::{apps, core, networking, policy};
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    match (api_version, kind) {
        ("v1", "Namespace") => through::<core::v1::Namespace>(doc),
        ("v1", "Secret") => through::<core::v1::Secret>(doc),
        ("v1", "Service") => through::<core::v1::Service>(doc),
        ("apps/v1", "Deployment") => through::<apps::v1::Deployment>(doc),
        ("policy/v1", "PodDisruptionBudget") => through::<policy::v1::PodDisruptionBudget>(doc),
        ("networking.k8s.io/v1", "NetworkPolicy") => through::<networking::v1::NetworkPolicy>(doc),
        _ => {
            let schema = crd_schema(api_version, kind)
                .ok_or_else(|| format!("no schema for {api_version} {kind} in edge/tests/crds"))?;
            let validator = jsonschema::draft4::new(&schema).map_err(|e| e.to_string())?;
            let errors: Vec<String> = validator
                .iter_errors(doc)
                .map(|e| format!("{} at {}", e, e.instance_path))
                .collect();
            if errors.is_empty() {
                Ok(())
            } else {
                Err(errors.join("; "))
            }
        }
    }
}

fn kinds(docs: &[Value]) -> BTreeSet<String> {
    docs.iter()
        .map(|d| d["kind"].as_str().unwrap().to_owned())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

#[test]
fn every_object_parses_into_its_kinds_known_fields() {
    let state_api = [
        "Namespace",
        "Secret",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    ];
    for (what, cfg) in configs() {
        for (target, mesh_kinds) in [
            (Target::Istio, &["EnvoyFilter", "DestinationRule"][..]),
            (
                Target::EnvoyGateway,
                &[
                    "EnvoyExtensionPolicy",
                    "EnvoyPatchPolicy",
                    "EnvoyProxy",
                    "ClientTrafficPolicy",
                ][..],
            ),
        ] {
            let docs = render(&cfg, target);
            for doc in &docs {
                check_known_fields(doc)
                    .unwrap_or_else(|e| panic!("{what}, {target:?}, {}: {e}", doc["kind"]));
            }
            let found = kinds(&docs);
            let external = cfg.mesh.external_state_api.is_some();
            for kind in mesh_kinds {
                assert!(
                    found.contains(*kind),
                    "{what}, {target:?}: no {kind} in {found:?}"
                );
            }
            for kind in state_api {
                assert_eq!(
                    found.contains(kind),
                    !external,
                    "{what}, {target:?}: {kind}"
                );
            }
            let jwt = matches!(cfg.subject, edge::config::Subject::Jwt(_));
            let auth = if target == Target::Istio {
                "RequestAuthentication"
            } else {
                "SecurityPolicy"
            };
            assert_eq!(found.contains(auth), jwt, "{what}, {target:?}: {auth}");
            if target == Target::Istio {
                assert_eq!(
                    found.contains("ServiceEntry"),
                    external,
                    "{what}: ServiceEntry"
                );
            }
        }
    }
}

/// The plugin configuration a manifest holds: Istio's as the EnvoyFilter's JSON string, Envoy
/// Gateway's as the policy's object.
fn plugin_configs(docs: &[Value]) -> Vec<Value> {
    let mut out = Vec::new();
    for doc in docs {
        match doc["kind"].as_str() {
            Some("EnvoyFilter") => {
                let text = doc["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]
                    ["config"]["configuration"]["value"]
                    .as_str()
                    .unwrap();
                out.push(serde_json::from_str(text).unwrap());
            }
            Some("EnvoyExtensionPolicy") => out.push(doc["spec"]["wasm"][0]["config"].clone()),
            _ => {}
        }
    }
    out
}

#[test]
fn the_plugin_configuration_passes_the_schema_and_the_filter() {
    let validator = jsonschema::draft4::new(&filter_core::config::json_schema()).unwrap();
    let mut seen = 0;
    for (what, cfg) in configs() {
        for target in [Target::Istio, Target::EnvoyGateway] {
            for plugin in plugin_configs(&render(&cfg, target)) {
                let errors: Vec<String> = validator
                    .iter_errors(&plugin)
                    .map(|e| e.to_string())
                    .collect();
                assert!(errors.is_empty(), "{what}, {target:?}: {errors:?}");
                let read = filter_core::config::Config::parse(plugin.to_string().as_bytes())
                    .unwrap_or_else(|e| panic!("{what}, {target:?}: {e}"));
                // The caller from jwt_authn's metadata, where each mesh writes the payload.
                if let edge::config::Subject::Jwt(_) = cfg.subject {
                    let key = if target == Target::Istio {
                        "payload"
                    } else {
                        "edge"
                    };
                    assert_eq!(
                        read.subject,
                        filter_core::config::SubjectSource::Metadata(vec![
                            "envoy.filters.http.jwt_authn".into(),
                            key.into(),
                            "sub".into()
                        ]),
                        "{what}, {target:?}"
                    );
                }
                seen += 1;
            }
        }
    }
    assert_eq!(seen, 8);
}

#[test]
fn istio_calls_the_services_by_their_mesh_clusters() {
    let docs = render(&parse(OWN).unwrap(), Target::Istio);
    let plugin = &plugin_configs(&docs)[0];
    assert_eq!(
        plugin["state_api"]["cluster"],
        "outbound|8081||state-api.shop-idempotency.svc.cluster.local"
    );
    assert_eq!(
        plugin["routes"][0]["reconcile"]["cluster"],
        "outbound|9000||ledger.shop.svc.cluster.local"
    );
    let external = render(&external(), Target::Istio);
    assert_eq!(
        plugin_configs(&external)[0]["state_api"]["cluster"],
        "outbound|8443||state.shop.example"
    );
    let entry = find(&external, "ServiceEntry");
    assert_eq!(entry["spec"]["hosts"], json!(["state.shop.example"]));
    assert_eq!(
        find(&external, "DestinationRule")["spec"]["trafficPolicy"]["tls"]["mode"],
        "SIMPLE"
    );
}

#[test]
fn the_image_is_pinned_by_the_digest_make_oci_gives_it() {
    let images = oci::build(MODULE, env!("CARGO_PKG_VERSION")).unwrap();
    let digest = images.compat.manifest.digest();
    let hex = digest.trim_start_matches("sha256:");
    assert_eq!(pins().image_digest_hex, hex);
    let cfg = parse(OWN).unwrap();
    let istio = render(&cfg, Target::Istio);
    let remote = &find(&istio, "EnvoyFilter")["spec"]["configPatches"][0]["patch"]["value"]
        ["typed_config"]["config"]["vm_config"]["code"]["remote"];
    assert_eq!(remote["sha256"], hex);
    assert_eq!(
        remote["http_uri"]["uri"],
        "oci://registry.example/shop/idempotency-filter:1.2.3"
    );
    let eg = render(&cfg, Target::EnvoyGateway);
    let image = &find(&eg, "EnvoyExtensionPolicy")["spec"]["wasm"][0]["code"]["image"];
    assert_eq!(image["sha256"], hex);
    assert_eq!(
        image["url"],
        "registry.example/shop/idempotency-filter:1.2.3"
    );
    // Another module, another digest.
    let other = Pins::of_module(b"\0asm\x01\0\0\0\0").unwrap();
    assert_ne!(other.image_digest_hex, hex);
}

#[test]
fn the_state_api_runs_as_asked() {
    let cfg = parse(OWN).unwrap();
    for target in [Target::Istio, Target::EnvoyGateway] {
        let docs = render(&cfg, target);
        let deployment = find(&docs, "Deployment");
        let spec = &deployment["spec"];
        assert_eq!(spec["replicas"], 3);
        assert_eq!(spec["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
        let pod = &spec["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        let init = &pod["initContainers"][0];
        assert_eq!(init["args"], json!(["--migrate-only"]));
        let container = &pod["containers"][0];
        assert_eq!(container["image"], "registry.example/shop/state-api:1.2.3");
        assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
        assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
        for c in [init, container] {
            assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
            assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
            assert_eq!(c["envFrom"][0]["secretRef"]["name"], "state-api");
        }
        // The secrets in the Secret only, never in the pod's own environment.
        let secret = &find(&docs, "Secret")["stringData"];
        for name in [
            state_env::DATABASE_URL,
            state_env::STATE_API_TOKEN,
            state_env::IDEM_KEY_SECRET,
            state_env::STATE_API_STORAGE_KEY,
            state_env::STATE_API_ADMIN_TOKEN,
        ] {
            assert!(secret.get(name).is_some(), "{name} not in the Secret");
        }
        assert_eq!(
            secret[state_env::STATE_API_TOKEN],
            "a-token-of-16-chars-or-more"
        );
        let env: Vec<&str> = container["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            env,
            [state_env::LISTEN_ADDR, state_env::STATE_API_RETENTION_S]
        );
        assert_eq!(
            find(&docs, "PodDisruptionBudget")["spec"]["minAvailable"],
            1
        );
        // Only the mesh's Envoys reach it.
        let from = &find(&docs, "NetworkPolicy")["spec"]["ingress"][0]["from"];
        let (namespace, labels) = match target {
            Target::Istio => ("shop-gateways", json!({"app": "shop-gateway"})),
            Target::EnvoyGateway => (
                "shop-proxies",
                json!({
                    "gateway.envoyproxy.io/owning-gateway-name": "shop",
                    "gateway.envoyproxy.io/owning-gateway-namespace": "shop"
                }),
            ),
        };
        assert_eq!(
            from,
            &json!([{
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "podSelector": {"matchLabels": labels}
            }])
        );
        // The Envoys' own access to it and the module's failure policy.
        let fail_open = match target {
            Target::Istio => {
                find(&docs, "EnvoyFilter")["spec"]["configPatches"][0]["patch"]["value"]
                    ["typed_config"]["config"]["failure_policy"]
                    == "FAIL_OPEN"
            }
            Target::EnvoyGateway => {
                find(&docs, "EnvoyExtensionPolicy")["spec"]["wasm"][0]["failOpen"] == true
            }
        };
        assert!(
            fail_open,
            "{target:?}: every route fails open, so does the module"
        );
    }
    let demo = render(&load("examples/demo.toml"), Target::Istio);
    assert_eq!(
        find(&demo, "EnvoyFilter")["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]
            ["config"]["failure_policy"],
        "FAIL_CLOSED"
    );
}

#[test]
fn envoy_takes_the_clusters_envoy_gateways_bootstrap_gets() {
    let dir = std::env::temp_dir().join(format!("mesh-bootstrap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (what, cfg) in configs() {
        let docs = render(&cfg, Target::EnvoyGateway);
        let bootstrap = find(&docs, "EnvoyProxy")["spec"]["bootstrap"]["value"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(bootstrap.contains("name: state_api"), "{what}: {bootstrap}");
        let path = dir.join("bootstrap.yaml");
        std::fs::write(&path, &bootstrap).unwrap();
        edge::envoy::validate(&path).unwrap_or_else(|e| panic!("{what}\n{bootstrap}\n{e}"));
    }
    let reconciling = render(&parse(OWN).unwrap(), Target::EnvoyGateway);
    let bootstrap = find(&reconciling, "EnvoyProxy")["spec"]["bootstrap"]["value"]
        .as_str()
        .unwrap();
    assert!(
        bootstrap.contains("name: reconcile_0")
            && bootstrap.contains("ledger.shop.svc.cluster.local")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fields of `edge render`'s own Envoy configuration at `pointer` (its connection manager,
/// its listener), as JSON.
fn rendered_fields(cfg: &Config, pointer: &str) -> serde_json::Map<String, Value> {
    let inputs = edge::render::Inputs {
        wasm: "/x/filter.wasm".into(),
        state_token: "t".repeat(16),
        ca_file: edge::render::DEFAULT_CA_FILE.into(),
    };
    let text = edge::render::envoy_yaml(cfg, &inputs);
    let doc = json_of_yaml(&YamlLoader::load_from_str(&text).unwrap()[0]);
    doc.pointer(pointer).unwrap().as_object().unwrap().clone()
}

/// The objects an Envoy Gateway `jsonPath` of the form our operations use selects in `doc`:
/// `..key[?(@.name=='value')]`, then `.field` steps (only that form; anything else panics).
fn gateway_json_path<'a>(doc: &'a Value, path: &str) -> Vec<&'a Value> {
    let rest = path.strip_prefix("..").expect("a recursive descent");
    let (key, rest) = rest.split_once("[?(@.name=='").expect("a name filter");
    let (name, rest) = rest.split_once("')]").expect("a closed filter");
    let mut found = Vec::new();
    fn descend<'a>(v: &'a Value, key: &str, name: &str, found: &mut Vec<&'a Value>) {
        match v {
            Value::Object(m) => {
                for (k, child) in m {
                    if k == key {
                        if let Some(items) = child.as_array() {
                            found.extend(items.iter().filter(|i| i["name"] == name));
                        }
                    }
                    descend(child, key, name, found);
                }
            }
            Value::Array(items) => items.iter().for_each(|i| descend(i, key, name, found)),
            _ => {}
        }
    }
    descend(doc, key, name, &mut found);
    rest.split('.')
        .filter(|f| !f.is_empty())
        .fold(found, |at, field| {
            at.into_iter().filter_map(|v| v.get(field)).collect()
        })
}

/// A duration as Envoy writes it in YAML (`2.5s`), in ms.
fn secs(v: &Value) -> u64 {
    let t = v.as_str().unwrap();
    (t.trim_end_matches('s').parse::<f64>().unwrap() * 1_000.0).round() as u64
}

/// A duration of Envoy Gateway's API (`300s`, `2500ms`), in ms.
fn gateway_ms(v: &Value) -> u64 {
    let t = v.as_str().unwrap();
    match t.strip_suffix("ms") {
        Some(ms) => ms.parse().unwrap(),
        None => t.strip_suffix('s').unwrap().parse::<u64>().unwrap() * 1_000,
    }
}

/// `[limits]` reach each mesh's Envoys as `edge render` writes them into its own: Istio's
/// patches merge the very fields into the gateways' connection manager, listeners and virtual
/// hosts (the stream's buffer limit), and Envoy takes them (a listener with them validates);
/// Envoy Gateway's `ClientTrafficPolicy` says the same values in its API, its timeouts never
/// shorter, and its `EnvoyPatchPolicy` sets the stream's buffer limit.
#[test]
fn the_client_limits_reach_each_mesh_as_edge_render_writes_them() {
    let dir = std::env::temp_dir().join(format!("mesh-limits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    const HCM: &str = "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config";
    for (what, mut cfg) in configs() {
        cfg.limits.request_headers_timeout_ms = 2_500;
        let hcm = rendered_fields(&cfg, HCM);
        let listener = rendered_fields(&cfg, "/static_resources/listeners/0");

        let docs = render(&cfg, Target::Istio);
        let patches = find(&docs, "EnvoyFilter")["spec"]["configPatches"]
            .as_array()
            .unwrap()
            .clone();
        let merged = |apply_to: &str| {
            let p = patches
                .iter()
                .find(|p| p["applyTo"] == apply_to)
                .unwrap_or_else(|| panic!("{what}: no {apply_to} patch"));
            assert_eq!(p["patch"]["operation"], "MERGE", "{what}");
            assert_eq!(p["match"]["context"], "GATEWAY", "{what}");
            p["patch"]["value"].clone()
        };
        let hcm_patch = merged("NETWORK_FILTER")["typed_config"].clone();
        let listener_patch = merged("LISTENER");
        // A stream buffers what it does in edge render's own Envoy: with the listener's 32 KiB
        // alone, a larger request would get Envoy's 413 and a larger response its 500.
        let vhost_patch = merged("VIRTUAL_HOST");
        let buffer_limit =
            hcm["route_config"]["virtual_hosts"][0]["request_body_buffer_limit"].clone();
        assert!(buffer_limit.as_u64().unwrap() >= 4 << 20, "{what}");
        assert_eq!(
            vhost_patch,
            json!({"request_body_buffer_limit": buffer_limit}),
            "{what}"
        );
        // A mesh's Envoy is not the pinned one: its whole-request timeout also covers the
        // filter's waits, as Envoy's documentation has it run.
        let mesh_request_ms = edge::render::mesh_request_timeout_ms(&cfg);
        assert!(mesh_request_ms > edge::render::request_timeout_ms(&cfg) + 5_000);
        for (name, value) in hcm_patch.as_object().unwrap() {
            match name.as_str() {
                "@type" => {}
                "request_timeout" => assert_eq!(
                    secs(value),
                    mesh_request_ms,
                    "{what}: the mesh's request_timeout"
                ),
                _ => assert_eq!(Some(value), hcm.get(name), "{what}: {name}"),
            }
        }
        for name in [
            "stream_idle_timeout",
            "stream_flush_timeout",
            "request_headers_timeout",
            "request_timeout",
            "common_http_protocol_options",
            "http2_protocol_options",
        ] {
            assert!(
                hcm_patch.get(name).is_some(),
                "{what}: Istio gets no {name}"
            );
        }
        for (name, value) in listener_patch.as_object().unwrap() {
            assert_eq!(Some(value), listener.get(name), "{what}: {name}");
        }
        // Envoy takes the fields as merged: a gateway-like listener with them validates.
        let mut typed_config = json!({
            "stat_prefix": "gateway",
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                "request_body_buffer_limit": vhost_patch["request_body_buffer_limit"],
                "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type":
                "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        });
        for (name, value) in hcm_patch.as_object().unwrap() {
            typed_config[name] = value.clone();
        }
        let mut gateway_listener = json!({
            "name": "gateway",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                "typed_config": typed_config}]}],
        });
        for (name, value) in listener_patch.as_object().unwrap() {
            gateway_listener[name] = value.clone();
        }
        let bootstrap = json!({"static_resources": {"listeners": [gateway_listener]}});
        let path = dir.join("gateway.json");
        std::fs::write(&path, bootstrap.to_string()).unwrap();
        edge::envoy::validate(&path)
            .unwrap_or_else(|e| panic!("{what}: Istio's merged limits\n{bootstrap:#}\n{e}"));

        let docs = render(&cfg, Target::EnvoyGateway);
        let ops = find(&docs, "EnvoyPatchPolicy")["spec"]["jsonPatches"]
            .as_array()
            .unwrap()
            .clone();
        let vhosts = ops
            .iter()
            .find(|p| p["type"] == "type.googleapis.com/envoy.config.route.v3.RouteConfiguration")
            .unwrap_or_else(|| panic!("{what}: no route configuration patch"));
        assert_eq!(vhosts["operation"]["path"], "request_body_buffer_limit");
        assert_eq!(vhosts["operation"]["value"], buffer_limit, "{what}");
        let flush = ops
            .iter()
            .find(|p| p["operation"]["path"] == "stream_flush_timeout")
            .unwrap_or_else(|| panic!("{what}: no stream flush timeout patch"));
        assert_eq!(
            flush["type"],
            "type.googleapis.com/envoy.config.listener.v3.Listener"
        );
        assert_eq!(
            flush["operation"]["value"], hcm["stream_flush_timeout"],
            "{what}"
        );
        // The operation finds the connection manager, once, in a listener of the shape Envoy
        // Gateway generates (`edge render`'s own stands in).
        let json_path = flush["operation"]["jsonPath"].as_str().unwrap();
        let shaped = Value::Object(listener.clone());
        let at = gateway_json_path(&shaped, json_path);
        assert_eq!(at.len(), 1, "{what}: {json_path} selects {}", at.len());
        assert_eq!(
            at[0]["@type"],
            "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "{what}"
        );
        let policy = &find(&docs, "ClientTrafficPolicy")["spec"];
        assert_eq!(policy["targetRefs"][0]["name"], cfg.mesh.gateway.as_str());
        let connection = &policy["connection"];
        assert_eq!(
            connection["connectionLimit"]["value"],
            json!(cfg.limits.max_connections),
            "{what}"
        );
        assert_eq!(connection["bufferLimit"], "32Ki", "{what}");
        assert_eq!(
            connection["maxAcceptPerSocketEvent"],
            listener["max_connections_to_accept_per_socket_event"]
        );
        let http = &policy["timeout"]["http"];
        for (ours, theirs) in [
            (
                secs(&hcm["request_headers_timeout"]),
                "requestHeadersReceivedTimeout",
            ),
            (mesh_request_ms, "requestReceivedTimeout"),
            (secs(&hcm["stream_idle_timeout"]), "streamIdleTimeout"),
        ] {
            let theirs_ms = gateway_ms(&http[theirs]);
            assert!(
                theirs_ms >= ours && theirs_ms < ours + 1_000,
                "{what}: {theirs} {theirs_ms} ms against {ours}"
            );
        }
        assert_eq!(
            gateway_ms(&http["idleTimeout"]),
            secs(&hcm["common_http_protocol_options"]["idle_timeout"])
        );
        let h2 = &hcm["http2_protocol_options"];
        assert_eq!(
            policy["http2"]["maxConcurrentStreams"],
            h2["max_concurrent_streams"]
        );
        assert_eq!(policy["http2"]["initialStreamWindowSize"], "64Ki");
        assert_eq!(policy["http2"]["initialConnectionWindowSize"], "1Mi");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn what_a_mesh_cannot_take_is_refused() {
    let mut cfg = load("examples/own-api.toml");
    cfg.state.tls = Some(edge::config::StateTls {
        cert_file: "c.pem".into(),
        key_file: "k.pem".into(),
        ca_file: "ca.pem".into(),
        server_name: "state".into(),
        client_cert: None,
        client_ca_file: None,
    });
    let e = manifests(&cfg, Target::Istio, &pins())
        .unwrap_err()
        .to_string();
    assert!(e.contains("[state.tls]"), "{e}");
    for (bad, line, says) in [
        ("replicas = 1", 2, "mesh.replicas must be at least 2"),
        (
            "namespace = \"Shop\"",
            2,
            "mesh.namespace must be a Kubernetes name",
        ),
        ("filter_image = \"oci://\"", 2, "mesh.filter_image"),
        ("state_api_url = \"state:8081\"", 2, "mesh.state_api_url"),
        ("istio_labels = {}", 2, "mesh.istio_labels"),
        ("bogus = 1", 2, "unknown field `bogus`"),
    ] {
        let base = "listen = \"127.0.0.1:10000\"\nupstream = \"http://127.0.0.1:3000\"\n[subject]\nheader = \"x-user\"\n[[route]]\nmethod = \"POST\"\npath = \"/o\"\nkey = \"required\"\n";
        let text = format!("{base}[mesh]\n{bad}\n");
        let e = parse(&text).unwrap_err().to_string();
        assert!(e.contains(says), "{bad}: {e}");
        assert!(
            e.contains(&format!("mesh.toml:{}:", 9 + line - 1)),
            "{bad}: {e}"
        );
    }
}

/// The checks above would see a field the kind does not know, at any depth.
#[test]
fn the_known_field_checks_see_an_unknown_field() {
    let cfg = parse(OWN).unwrap();
    let mut docs = render(&cfg, Target::Istio);
    docs.extend(render(&cfg, Target::EnvoyGateway));
    for (kind, pointer) in [
        ("Deployment", "/spec/template/spec/containers/0"),
        ("NetworkPolicy", "/spec/ingress/0"),
        ("PodDisruptionBudget", "/spec"),
        ("Secret", ""),
        ("EnvoyFilter", "/spec/configPatches/1/match"),
        ("DestinationRule", "/spec/trafficPolicy"),
        ("EnvoyExtensionPolicy", "/spec/wasm/0/code/image"),
        ("EnvoyPatchPolicy", "/spec/jsonPatches/0/operation"),
        ("EnvoyProxy", "/spec/bootstrap"),
    ] {
        let mut doc = find(&docs, kind).clone();
        check_known_fields(&doc).unwrap();
        doc.pointer_mut(pointer)
            .and_then(Value::as_object_mut)
            .unwrap()
            .insert("bogus".into(), json!(1));
        assert!(
            check_known_fields(&doc).is_err(),
            "{kind}{pointer}: bogus taken"
        );
    }
}

/// Issue 46, finding 3: the manifests say how the mesh's own route objects keep a protected
/// request from being sent twice (the filter's `x-envoy-max-retries: 0` whatever they say).
#[test]
fn the_manifests_say_protected_routes_are_never_retried() {
    for (what, cfg) in configs() {
        for (target, says) in [
            (Target::Istio, "`retries: {attempts: 0}`"),
            (Target::EnvoyGateway, "`retry: {numRetries: 0}`"),
        ] {
            let text = manifests(&cfg, target, &pins()).unwrap();
            let head: String = text
                .lines()
                .take_while(|l| l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n");
            assert!(
                head.contains("`x-envoy-max-retries: 0`") && head.contains(says),
                "{what}, {target:?}: {head}"
            );
        }
    }
}
