//! No Docker engine runs here, so docker-compose.yml is checked as far as this machine allows:
//! it parses, it names the four services on the demo's public addresses, and every file it
//! mounts or builds from exists.

use stack::process::workspace_root;
use yaml_rust2::{Yaml, YamlLoader};

fn compose() -> Yaml {
    let text =
        std::fs::read_to_string(workspace_root().join("docker-compose.yml")).unwrap_or_default();
    let docs = YamlLoader::load_from_str(&text)
        .unwrap_or_else(|e| panic!("docker-compose.yml is not valid YAML: {e}"));
    docs.into_iter().next().unwrap_or(Yaml::Null)
}

fn strings(y: &Yaml) -> Vec<String> {
    y.as_vec()
        .map(|v| {
            v.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn services_publish_the_demo_addresses() {
    let c = compose();
    let services = &c["services"];
    let expected = [
        ("postgres", "127.0.0.1:54329:5432"),
        ("state-api", "127.0.0.1:8081:8081"),
        ("checkout", "127.0.0.1:8082:8082"),
        ("envoy", "127.0.0.1:10000:10000"),
    ];
    for (name, port) in expected {
        let ports = strings(&services[name]["ports"]);
        assert!(
            ports.iter().any(|p| p == port),
            "service {name} must publish {port}: {ports:?}"
        );
    }
}

#[test]
fn mounted_and_built_files_exist() {
    let c = compose();
    let root = workspace_root();
    for volume in strings(&c["services"]["envoy"]["volumes"]) {
        let host = volume.split(':').next().unwrap_or_default();
        // The filter module is a build output (make build-filter); the rest are committed files.
        if host.ends_with("filter.wasm") {
            continue;
        }
        assert!(
            root.join(host).is_file(),
            "docker-compose mounts {host}, which does not exist"
        );
    }
    assert!(root.join("Dockerfile").is_file());
    for svc in ["state-api", "checkout"] {
        let bin = c["services"][svc]["build"]["args"]["BIN"]
            .as_str()
            .unwrap_or_default();
        assert!(
            root.join(bin).join("Cargo.toml").is_file(),
            "{svc} builds crate {bin}, which is not in the workspace"
        );
    }
}

#[test]
fn state_api_settings_match_the_envoy_config() {
    let c = compose();
    let env = &c["services"]["state-api"]["environment"];
    let token = env["STATE_API_TOKEN"].as_str().unwrap_or_default();
    let envoy = std::fs::read_to_string(workspace_root().join("envoy/envoy-docker.yaml"))
        .unwrap_or_default();
    assert!(
        !token.is_empty() && envoy.contains(&format!("\"token\": \"{token}\"")),
        "Envoy must present the state API's token"
    );
    assert!(env["DATABASE_URL"]
        .as_str()
        .is_some_and(|u| u.contains("@postgres:5432/")));
}
