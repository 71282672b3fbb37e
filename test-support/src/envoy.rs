//! Envoy with the built filter, configured as `edge run` configures it: the committed
//! `examples/demo.toml`, with this stack's ports and the test's options, rendered by
//! `edge::render`. The benchmark's baselines (a plain Envoy, a jwt-only one) are rendered from
//! templates instead ([`Envoy::start_with_template`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use edge::config::{Config, Endpoint, Jwks, Subject};
use edge::envoy::EnvoyProcess;

use crate::process::{workspace_root, Host};

pub use crate::net::{http_get_at, http_get_blocking};
pub use edge::envoy::{envoy_binary, filter_wasm, ENVOY_VERSION};

/// A change to the rendered configuration a test makes (a route's policy, a reconcile
/// endpoint of its own).
#[derive(Clone)]
pub struct Tweak(pub Arc<dyn Fn(&mut Config) + Send + Sync>);

impl Tweak {
    pub fn new(f: impl Fn(&mut Config) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }
}

impl std::fmt::Debug for Tweak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tweak(..)")
    }
}

/// What a stack's Envoy differs in: its ports and the options the tests vary. Also the values
/// of the benchmark templates' `{{NAME}}` placeholders.
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
    /// Envoy's worker threads (`--concurrency`).
    pub workers: u32,
    pub filter_wasm: String,
    pub jwks_path: String,
    /// A change to the demo's configuration (none in the demo).
    pub tweak: Option<Tweak>,
}

/// The configuration `make demo` runs.
pub fn demo_config_path() -> PathBuf {
    workspace_root().join("examples/demo.toml")
}

impl EnvoyParams {
    fn addr(host: &str, port: u16) -> Result<SocketAddr, String> {
        format!("{host}:{port}")
            .parse()
            .map_err(|e| format!("{host}:{port}: {e}"))
    }

    /// `examples/demo.toml` with these ports and options.
    pub fn edge_config(&self) -> Result<Config, String> {
        let mut cfg = Config::load(&demo_config_path()).map_err(|e| e.to_string())?;
        cfg.listen = Self::addr(&self.listen_address, self.listen_port)?;
        cfg.admin = Some(Self::addr(&self.admin_address, self.admin_port)?);
        cfg.upstream = Endpoint {
            tls: false,
            host: self.checkout_host.clone(),
            port: self.checkout_port,
        };
        cfg.state.listen = Self::addr(&self.state_api_host, self.state_api_port)?;
        cfg.state.token = Some(self.state_api_token.clone());
        cfg.state.timeout_ms = self.state_api_timeout_ms;
        cfg.filter.lease_ms = self.lease_ms;
        cfg.filter.heartbeat_ms = self.heartbeat_ms;
        cfg.filter.complete_in_background = self.complete_in_background;
        cfg.envoy_workers = self.workers;
        if let Subject::Jwt(j) = &mut cfg.subject {
            j.jwks = Jwks::File(PathBuf::from(&self.jwks_path));
        }
        if let Some(t) = &self.tweak {
            (t.0)(&mut cfg);
        }
        cfg.check().map_err(|e| e.to_string())?;
        Ok(cfg)
    }

    /// The rendered Envoy configuration.
    pub fn render(&self) -> Result<String, String> {
        let inputs = edge::render::Inputs {
            wasm: PathBuf::from(&self.filter_wasm),
            state_token: self.state_api_token.clone(),
            ca_file: edge::render::DEFAULT_CA_FILE.into(),
        };
        Ok(edge::render::envoy_yaml(&self.edge_config()?, &inputs))
    }

    fn values(&self) -> BTreeMap<&'static str, String> {
        BTreeMap::from([
            ("LISTEN_ADDRESS", self.listen_address.clone()),
            ("LISTEN_PORT", self.listen_port.to_string()),
            ("ADMIN_ADDRESS", self.admin_address.clone()),
            ("ADMIN_PORT", self.admin_port.to_string()),
            ("CHECKOUT_HOST", self.checkout_host.clone()),
            ("CHECKOUT_PORT", self.checkout_port.to_string()),
            ("JWKS_PATH", self.jwks_path.clone()),
        ])
    }
}

/// The same listener and checkout cluster with the router only (no jwt_authn, no filter): the
/// benchmark's baseline.
pub fn plain_template_path() -> PathBuf {
    workspace_root().join("envoy/envoy-plain.yaml.tmpl")
}

/// Fills every `{{NAME}}`; an unknown or unfilled placeholder is an error, never left in.
pub fn render_template(template: &str, params: &EnvoyParams) -> Result<String, String> {
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
    process: EnvoyProcess,
}

impl Envoy {
    /// Renders the configuration into `dir`, starts Envoy and waits until it is ready.
    pub fn start(params: EnvoyParams, dir: &Path, name: &str) -> Result<Self, String> {
        Self::start_on(&Host::loopback(), params, dir, name)
    }

    /// [`Envoy::start`] on `host` (its listener and admin addresses are in `params`).
    pub fn start_on(
        host: &Host,
        params: EnvoyParams,
        dir: &Path,
        name: &str,
    ) -> Result<Self, String> {
        let yaml = params.render()?;
        Self::run(host, yaml, params, dir, name)
    }

    /// An Envoy from a benchmark template (e.g. [`plain_template_path`]).
    pub fn start_with_template(
        template: &Path,
        params: EnvoyParams,
        dir: &Path,
        name: &str,
    ) -> Result<Self, String> {
        let text = std::fs::read_to_string(template)
            .map_err(|e| format!("cannot read the Envoy template {}: {e}", template.display()))?;
        let yaml = render_template(&text, &params)?;
        Self::run(&Host::loopback(), yaml, params, dir, name)
    }

    /// An Envoy from this rendered configuration, edited by the test (an HCM option a team
    /// running its own Envoy might set); `params` name its ports.
    pub fn start_with_yaml(
        yaml: String,
        params: EnvoyParams,
        dir: &Path,
        name: &str,
    ) -> Result<Self, String> {
        Self::run(&Host::loopback(), yaml, params, dir, name)
    }

    fn run(
        host: &Host,
        yaml: String,
        params: EnvoyParams,
        dir: &Path,
        name: &str,
    ) -> Result<Self, String> {
        let process = EnvoyProcess::start_on(
            host,
            &yaml,
            params.workers,
            params.listen_port,
            Some(params.admin_port),
            dir,
            name,
        )?;
        Ok(Self {
            config_path: process.config_path.clone(),
            log_path: process.log_path.clone(),
            params,
            process,
        })
    }

    /// A blocking GET on the admin port (the admin server speaks plain HTTP/1.1).
    pub fn admin_get(&self, path: &str) -> Result<String, String> {
        http_get_at(self.admin_addr()?, path)
    }

    fn admin_addr(&self) -> Result<SocketAddr, String> {
        EnvoyParams::addr(&self.params.admin_address, self.params.admin_port)
    }

    pub fn url(&self, path: &str) -> String {
        format!(
            "http://{}:{}{path}",
            self.params.listen_address, self.params.listen_port
        )
    }

    /// Last lines of Envoy's log, for failure messages.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn kill(&mut self) {
        self.process.kill();
    }

    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// Counter value from `/stats?filter=...` (exact stat name), 0 when absent.
    pub fn counter(&self, name: &str) -> u64 {
        self.counters(&format!("^{name}$"))
            .remove(name)
            .unwrap_or(0)
    }

    /// Every numeric stat whose name matches `filter` (a regex, as `/stats?filter=` takes it),
    /// by name; empty when the admin endpoint does not answer.
    pub fn counters(&self, filter: &str) -> BTreeMap<String, u64> {
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
            state_api_token: "test-token".into(),
            state_api_timeout_ms: 1000,
            lease_ms: 30000,
            heartbeat_ms: 10000,
            complete_in_background: false,
            workers: 1,
            filter_wasm: "/x/filter.wasm".into(),
            jwks_path: workspace_root()
                .join("envoy/demo-jwks.json")
                .display()
                .to_string(),
            tweak: None,
        }
    }

    #[test]
    fn the_demo_config_renders_with_these_ports_and_a_tweak() {
        let mut p = params();
        p.listen_port = 11111;
        p.tweak = Some(Tweak::new(|c| c.routes.truncate(1)));
        let yaml = p.render().unwrap_or_else(|e| panic!("{e}"));
        assert!(yaml.contains("port_value: 11111"), "{yaml}");
        assert!(yaml.contains("/checkout/attempts/{key}"));
        assert!(!yaml.contains("/refunds"), "the tweak took a route away");
        assert!(yaml.contains("\"token\": \"test-token\""));
    }

    #[test]
    fn plain_template_renders_without_leftover_placeholders() {
        let template = std::fs::read_to_string(plain_template_path()).unwrap_or_default();
        let rendered = render_template(&template, &params());
        assert!(
            rendered.as_ref().is_ok_and(|r| !r.contains("{{")
                && r.contains("port_value: 10000")
                && !r.contains("wasm")),
            "{rendered:?}"
        );
    }

    #[test]
    fn unknown_placeholder_is_an_error() {
        assert!(render_template("x {{NOPE}} y", &params()).is_err());
        assert!(render_template("x {{LISTEN_PORT", &params()).is_err());
    }
}
