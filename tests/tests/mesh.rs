//! The filter's part of `edge render --target istio|envoy-gateway`, through a real Envoy (1.40)
//! as each mesh would configure it, since no cluster can be had here: the plugin configuration
//! of the rendered EnvoyFilter or EnvoyExtensionPolicy, the clusters it names (Istio's
//! `outbound|port||host`, Envoy Gateway's bootstrap clusters from the rendered EnvoyProxy),
//! and jwt_authn as each mesh sets it up from the rendered RequestAuthentication or
//! SecurityPolicy (the verified payload in dynamic metadata under `payload` or the provider's
//! name; a request without a token let through). Through it: the demo's smoke (201, replay,
//! 422, 409 while running), a forged subject header that changes nothing, 401 without a token.
//! And why the manifests set `allow_on_headers_stop_iteration`: without it, as Istio's
//! WasmPlugin and Envoy Gateway's EnvoyExtensionPolicy alone load the filter, a protected
//! request with a body gets no answer.

use std::time::Duration;

use e2e::client::{unique_key, Client};
use e2e::envoy::{filter_wasm, Envoy};
use e2e::stack::{Stack, StackOptions};
use e2e::testkit::{block_on, charge_body, checkout, is_problem, replayed};
use edge::config::{Config, Endpoint};
use edge::mesh::{json_of_yaml, manifests, Pins, Target};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{json, Value};

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test("istio_s_wiring_runs_the_smoke", || {
            as_the_mesh(Target::Istio, true)
        }),
        Trial::test("envoy_gateway_s_wiring_runs_the_smoke", || {
            as_the_mesh(Target::EnvoyGateway, true)
        }),
        Trial::test(
            "without_allow_on_headers_stop_iteration_a_body_gets_no_answer",
            || as_the_mesh(Target::EnvoyGateway, false),
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn docs(cfg: &Config, target: Target) -> Result<Vec<Value>, String> {
    let module = std::fs::read(filter_wasm()?).map_err(|e| e.to_string())?;
    let text = manifests(cfg, target, &Pins::of_module(&module)?)?;
    let loaded = yaml_rust2::YamlLoader::load_from_str(&text).map_err(|e| e.to_string())?;
    Ok(loaded.iter().map(json_of_yaml).collect())
}

fn find<'a>(docs: &'a [Value], kind: &str) -> Result<&'a Value, String> {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .ok_or_else(|| format!("no {kind} rendered"))
}

fn yaml_to_json(text: &str) -> Result<Value, String> {
    let loaded = yaml_rust2::YamlLoader::load_from_str(text).map_err(|e| e.to_string())?;
    loaded
        .first()
        .map(json_of_yaml)
        .ok_or_else(|| "empty YAML".to_owned())
}

/// What each mesh's Envoy gets from the rendered manifests, in this stack's Envoy configuration.
struct Wiring {
    plugin: Value,
    /// jwt_authn's provider settings and the metadata key of the payload.
    payload_key: &'static str,
    forward: bool,
    claim_header: (String, String),
    /// The clusters the plugin configuration names.
    clusters: Vec<Value>,
    /// What the manifests set on the gateway's listener, connection manager and virtual hosts
    /// (Istio: its patches' values, merged; Envoy Gateway: the buffers its ClientTrafficPolicy
    /// and EnvoyPatchPolicy give), in place of `edge render`'s own.
    listener: serde_json::Map<String, Value>,
    hcm: serde_json::Map<String, Value>,
    vhost: serde_json::Map<String, Value>,
}

/// The value of the patch of the rendered EnvoyFilter that applies to `apply_to`.
fn istio_patch(filter: &Value, apply_to: &str) -> Result<serde_json::Map<String, Value>, String> {
    filter["spec"]["configPatches"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["applyTo"] == apply_to)
        .and_then(|p| p["patch"]["value"].as_object().cloned())
        .ok_or_else(|| format!("no {apply_to} patch in the EnvoyFilter"))
}

/// Envoy Gateway's size (`32Ki`, `1Mi`, bytes), in bytes.
fn gateway_size(v: &Value) -> Option<u64> {
    let t = v.as_str()?;
    let (n, unit) = match t.strip_suffix("Ki") {
        Some(n) => (n, 1 << 10),
        None => match t.strip_suffix("Mi") {
            Some(n) => (n, 1 << 20),
            None => (t, 1),
        },
    };
    n.parse::<u64>().ok().map(|n| n * unit)
}

fn wiring(cfg: &Config, target: Target) -> Result<Wiring, String> {
    let docs = docs(cfg, target)?;
    let upstream_cluster = |name: &str, e: &Endpoint| {
        json!({"name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint":
            {"address": {"socket_address": {"address": e.host, "port_value": e.port}}}}]}]}})
    };
    match target {
        Target::Istio => {
            let filter = find(&docs, "EnvoyFilter")?;
            let config =
                &filter["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"];
            let plugin: Value = serde_json::from_str(
                config["configuration"]["value"]
                    .as_str()
                    .unwrap_or_default(),
            )
            .map_err(|e| e.to_string())?;
            let rule = &find(&docs, "RequestAuthentication")?["spec"]["jwtRules"][0];
            // Istio makes `outbound|port||host` of each service: here the stack's.
            let state_api = cfg.mesh.external_state_api.clone().ok_or("no state API")?;
            let cluster = plugin["state_api"]["cluster"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            Ok(Wiring {
                payload_key: "payload",
                forward: rule["forwardOriginalToken"] == true,
                claim_header: (
                    rule["outputClaimToHeaders"][0]["header"]
                        .as_str()
                        .unwrap_or_default()
                        .into(),
                    rule["outputClaimToHeaders"][0]["claim"]
                        .as_str()
                        .unwrap_or_default()
                        .into(),
                ),
                clusters: vec![upstream_cluster(&cluster, &state_api)],
                plugin,
                listener: istio_patch(filter, "LISTENER")?,
                hcm: istio_patch(filter, "NETWORK_FILTER")?["typed_config"]
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
                vhost: istio_patch(filter, "VIRTUAL_HOST")?,
            })
        }
        Target::EnvoyGateway => {
            let policy = find(&docs, "EnvoyExtensionPolicy")?;
            let bootstrap = find(&docs, "EnvoyProxy")?["spec"]["bootstrap"]["value"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let provider = &find(&docs, "SecurityPolicy")?["spec"]["jwt"]["providers"][0];
            Ok(Wiring {
                plugin: policy["spec"]["wasm"][0]["config"].clone(),
                payload_key: "edge",
                // Envoy Gateway always forwards the token.
                forward: true,
                claim_header: (
                    provider["claimToHeaders"][0]["header"]
                        .as_str()
                        .unwrap_or_default()
                        .into(),
                    provider["claimToHeaders"][0]["claim"]
                        .as_str()
                        .unwrap_or_default()
                        .into(),
                ),
                clusters: yaml_to_json(&bootstrap)?["static_resources"]["clusters"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
                listener: [(
                    "per_connection_buffer_limit_bytes".to_owned(),
                    json!(gateway_size(
                        &find(&docs, "ClientTrafficPolicy")?["spec"]["connection"]["bufferLimit"]
                    )
                    .ok_or("no bufferLimit in the ClientTrafficPolicy")?),
                )]
                .into_iter()
                .collect(),
                hcm: serde_json::Map::new(),
                vhost: find(&docs, "EnvoyPatchPolicy")?["spec"]["jsonPatches"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|p| p["operation"]["jsonPath"] == "..virtual_hosts[*]")
                    .filter_map(|p| {
                        Some((
                            p["operation"]["path"].as_str()?.to_owned(),
                            p["operation"]["value"].clone(),
                        ))
                    })
                    .collect(),
            })
        }
    }
}

/// This stack's Envoy configuration, with the filter, jwt_authn and the clusters as the mesh
/// would have them.
fn mesh_envoy_config(stack: &Stack, w: &Wiring, stop_iteration: bool) -> Result<Value, String> {
    let text = std::fs::read_to_string(&stack.envoy.config_path).map_err(|e| e.to_string())?;
    let mut c = yaml_to_json(&text)?;
    // The buffers and client limits as the manifests set them, not as `edge render` does: its
    // own buffer limits taken out, the mesh's put in.
    const LISTENER: &str = "/static_resources/listeners/0";
    const HCM: &str = "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config";
    for (pointer, edge_own, mesh) in [
        (
            LISTENER.to_owned(),
            Some("per_connection_buffer_limit_bytes"),
            &w.listener,
        ),
        (
            format!("{HCM}/route_config/virtual_hosts/0"),
            Some("request_body_buffer_limit"),
            &w.vhost,
        ),
        (HCM.to_owned(), None, &w.hcm),
    ] {
        let fields = c
            .pointer_mut(&pointer)
            .and_then(Value::as_object_mut)
            .ok_or_else(|| format!("nothing at {pointer}"))?;
        if let Some(name) = edge_own {
            fields.remove(name);
        }
        fields.extend(
            mesh.iter()
                .filter(|(name, _)| *name != "@type")
                .map(|(name, value)| (name.clone(), value.clone())),
        );
    }
    let hcm = c.pointer_mut(HCM).ok_or("no connection manager")?;
    let filters = hcm["http_filters"]
        .as_array_mut()
        .ok_or("no http_filters")?;
    // Neither mesh strips the claim header from client requests (edge run does).
    filters.retain(|f| f["name"] != "envoy.filters.http.header_mutation");
    for f in filters.iter_mut() {
        if f["name"] == "envoy.filters.http.jwt_authn" {
            let provider = &mut f["typed_config"]["providers"]["edge"];
            provider["payload_in_metadata"] = json!(w.payload_key);
            provider["forward"] = json!(w.forward);
            provider["claim_to_headers"] =
                json!([{"header_name": w.claim_header.0, "claim_name": w.claim_header.1}]);
            // A request without a token goes on (Istio's default, Envoy Gateway's `optional`);
            // a bad token is refused.
            f["typed_config"]["rules"] = json!([{"match": {"prefix": "/"}, "requires":
                {"requires_any": {"requirements": [{"provider_name": "edge"}, {"allow_missing": {}}]}}}]);
        }
        if f["name"] == "envoy.filters.http.wasm" {
            let config = &mut f["typed_config"]["config"];
            config["allow_on_headers_stop_iteration"] = json!(stop_iteration);
            config["configuration"]["value"] = json!(w.plugin.to_string());
        }
    }
    let clusters = c
        .pointer_mut("/static_resources/clusters")
        .and_then(Value::as_array_mut)
        .ok_or("no clusters")?;
    clusters.retain(|k| k["name"] == "upstream");
    clusters.extend(w.clusters.iter().cloned());
    Ok(c)
}

fn as_the_mesh(target: Target, stop_iteration: bool) -> Result<(), Failed> {
    let stack = Stack::start(StackOptions::default()).map_err(Failed::from)?;
    let mut cfg = stack.envoy.params.edge_config()?;
    // The state API the filter calls: this stack's, as the mesh would name it.
    cfg.mesh.external_state_api = Some(Endpoint {
        tls: false,
        host: "127.0.0.1".into(),
        port: stack.state_api.port,
    });
    let w = wiring(&cfg, target)?;
    let mut params = stack.envoy.params.clone();
    params.listen_port = test_support::net::free_port();
    params.admin_port = test_support::net::free_port();
    let mut config = mesh_envoy_config(&stack, &w, stop_iteration)?;
    for (pointer, port) in [
        (
            "/static_resources/listeners/0/address/socket_address/port_value",
            params.listen_port,
        ),
        (
            "/admin/address/socket_address/port_value",
            params.admin_port,
        ),
    ] {
        *config.pointer_mut(pointer).ok_or(pointer)? = json!(port);
    }
    let name = format!("{target:?}-mesh").to_lowercase();
    let envoy = Envoy::start_with_yaml(config.to_string(), params, &stack.dir, &name)?;
    let result = if stop_iteration {
        block_on(smoke(Client::new(&envoy.url(""))))
    } else {
        block_on(no_answer(Client::impatient(
            &envoy.url(""),
            Duration::from_secs(5),
        )))
    };
    if result.is_err() {
        eprintln!("{}", envoy.log_tail());
    }
    result
}

async fn smoke(c: Client) {
    e2e::testkit::smoke(&c, "mesh").await;
    let body = charge_body(4990);
    let key = unique_key("mesh-subject");
    let first = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(first.status, 201, "{}", first.describe());

    // The subject is the token's, whatever header the client sends: bob's token and alice's
    // key are another record, alice's token with a forged header is alice's.
    let forged = c
        .send(checkout(&key, "alice", &body).header("x-jwt-sub", "bob"))
        .await;
    assert!(
        forged.status == 201 && replayed(&forged),
        "{}",
        forged.describe()
    );
    let bobs = c.send(checkout(&key, "bob", &body)).await;
    assert!(
        bobs.status == 201 && !replayed(&bobs),
        "{}",
        bobs.describe()
    );
    // A body larger than a connection's buffer (32 KiB), and an answer as large, over
    // HTTP/1.1 and HTTP/2: the stream's own limit, from the manifests, lets the filter read the
    // one whole and capture the other (with the connection's limit alone: Envoy's 413 to the
    // request, and its 500 to the answer after the charge ran).
    let large = json!({"amount": 7, "currency": "BRL", "note": "n".repeat(200_000)});
    for (protocol, client) in [("HTTP/1.1", c.clone()), ("HTTP/2", Client::http2(&c.base))] {
        let key = unique_key("mesh-large");
        let send = || {
            client.send(checkout(&key, "alice", &large).header("x-demo-response-bytes", "200000"))
        };
        let first = send().await;
        assert_eq!(first.status, 201, "{protocol}: {}", first.describe());
        assert!(
            first.body.len() > 200_000,
            "{protocol}: {}",
            first.body.len()
        );
        let again = send().await;
        assert!(
            again.status == 201 && replayed(&again) && again.body == first.body,
            "{protocol}: {}",
            again.describe()
        );
    }
    // No token: jwt_authn lets it through, the filter finds no subject.
    let anonymous = e2e::client::Request::post("/checkout")
        .key(&unique_key("mesh-anon"))
        .header("x-jwt-sub", "alice")
        .json(&body);
    let anonymous = c.send(anonymous).await;
    assert!(
        is_problem(&anonymous, 401, "unauthenticated"),
        "{}",
        anonymous.describe()
    );
}

async fn no_answer(c: Client) {
    let started = std::time::Instant::now();
    let answer = c
        .try_send(checkout(
            &unique_key("mesh-stuck"),
            "alice",
            &charge_body(10),
        ))
        .await;
    assert!(
        answer.is_err(),
        "answered after {:?}: {}",
        started.elapsed(),
        answer.map(|a| a.describe()).unwrap_or_default()
    );
}
