//! The fast checks of docker-compose.yml and the Dockerfile, in `make test`: the compose file
//! parses, runs `edge run` on the same configuration file as `make demo` (whose addresses are
//! the public contract), mounts only files that exist, builds from Dockerfile targets that
//! exist (the filter module included), and keeps what `make test-compose` found necessary when
//! it ran the stack for real (tests/compose_stack.rs: the images built, the stack up, stopped
//! and restarted on a private Docker engine).

use e2e::process::workspace_root;
use edge::config::Config;
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

fn dockerfile() -> String {
    std::fs::read_to_string(workspace_root().join("Dockerfile")).unwrap_or_default()
}

#[test]
fn edge_runs_the_demo_configuration_on_the_demo_addresses() {
    let c = compose();
    let edge = &c["services"]["edge"];
    let command = strings(&edge["command"]);
    let at = command
        .iter()
        .position(|a| a == "--config")
        .and_then(|i| command.get(i + 1))
        .unwrap_or_else(|| panic!("edge runs no --config: {command:?}"));
    assert_eq!(command.first().map(String::as_str), Some("run"));
    // The file it runs is examples/demo.toml, mounted where the command reads it.
    let mounts = strings(&edge["volumes"]);
    assert!(
        mounts
            .iter()
            .any(|m| m == &format!("./examples/demo.toml:{at}:ro")),
        "{mounts:?}"
    );
    let demo = Config::load(&workspace_root().join("examples/demo.toml"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(demo.listen.to_string(), "127.0.0.1:10000");
    assert_eq!(
        demo.admin.map(|a| a.to_string()).as_deref(),
        Some("127.0.0.1:9901")
    );
    assert_eq!(demo.state.listen.to_string(), "127.0.0.1:8081");
    assert_eq!(demo.upstream.authority(), "127.0.0.1:8082");
    assert_eq!(demo.state.postgres_port, 54329);
    // Host networking: those addresses are the host's, as with `make demo`.
    for svc in ["edge", "checkout"] {
        assert_eq!(
            c["services"][svc]["network_mode"].as_str(),
            Some("host"),
            "{svc}"
        );
    }
    let checkout_env = &c["services"]["checkout"]["environment"];
    assert_eq!(
        checkout_env["CHECKOUT_LISTEN"].as_str(),
        Some("127.0.0.1:8082")
    );
}

#[test]
fn mounted_files_exist_and_the_jwks_is_where_the_configuration_looks() {
    let c = compose();
    let root = workspace_root();
    for volume in strings(&c["services"]["edge"]["volumes"]) {
        let host = volume.split(':').next().unwrap_or_default();
        if !host.starts_with("./") {
            continue; // a named volume
        }
        assert!(
            root.join(host).is_file(),
            "docker-compose mounts {host}, which does not exist"
        );
    }
    // demo.toml reads ../envoy/demo-jwks.json from its own folder.
    assert!(strings(&c["services"]["edge"]["volumes"])
        .iter()
        .any(|m| m.starts_with("./envoy/demo-jwks.json:/etc/edge/envoy/demo-jwks.json")));
}

#[test]
fn the_images_build_everything_from_source_with_docker_alone() {
    let c = compose();
    let file = dockerfile();
    for svc in ["edge", "checkout"] {
        let target = c["services"][svc]["build"]["target"]
            .as_str()
            .unwrap_or_default();
        assert!(
            file.contains(&format!(" AS {target}")),
            "service {svc} builds target {target:?}, which the Dockerfile does not have"
        );
    }
    // The module is built in a stage, not mounted from a host build.
    assert!(file.contains("rustup target add wasm32-wasip1"));
    assert!(file.contains("-p filter --target wasm32-wasip1"));
    assert!(file.contains(&format!("envoyproxy/envoy:v{}", e2e::envoy::ENVOY_VERSION)));
    let ignore =
        std::fs::read_to_string(workspace_root().join(".dockerignore")).unwrap_or_default();
    assert!(
        ignore.lines().any(|l| l == "target"),
        "the build context leaves target/ out"
    );
}

#[test]
fn what_running_the_stack_for_real_needed_stays() {
    let c = compose();
    let edge = &c["services"]["edge"];
    // The volume's mount point exists in the image, owned by `edge`: Docker creates a new
    // named volume with the owner of the image's folder (root's when the folder is missing).
    let file = dockerfile();
    assert!(
        file.contains("install -d -o edge -g edge -m 0700 /var/lib/edge/run"),
        "the edge image makes /var/lib/edge/run for the edge user"
    );
    assert!(strings(&edge["volumes"])
        .iter()
        .any(|m| m == "edge-data:/var/lib/edge/run"));
    // PID 1 is an init that passes SIGTERM on and reaps; edge gets the time to stop Postgres.
    for svc in ["edge", "checkout"] {
        assert_eq!(c["services"][svc]["init"].as_bool(), Some(true), "{svc}");
        assert_eq!(
            c["services"][svc]["build"]["network"].as_str(),
            Some("host"),
            "{svc}"
        );
    }
    assert_eq!(edge["stop_grace_period"].as_str(), Some("30s"));
    // The health check asks edge itself about the file it runs.
    let health = strings(&edge["healthcheck"]["test"]);
    let command = strings(&edge["command"]);
    let config = command
        .iter()
        .position(|a| a == "--config")
        .and_then(|i| command.get(i + 1))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        health,
        [
            "CMD",
            "/usr/local/bin/edge",
            "health",
            "--config",
            config.as_str()
        ]
    );
    // Files that only describe the build stay out of its context: editing them must not
    // re-run the cargo build.
    let ignore =
        std::fs::read_to_string(workspace_root().join(".dockerignore")).unwrap_or_default();
    for name in ["Dockerfile", "docker-compose.yml", ".git"] {
        assert!(
            ignore.lines().any(|l| l == name),
            ".dockerignore leaves out {name}"
        );
    }
}
