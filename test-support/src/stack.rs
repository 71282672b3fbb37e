//! The whole stack on loopback: Postgres, the state API, the checkout and Envoy with the filter.

use contract::state_env;
use std::path::PathBuf;
use std::sync::Arc;

use crate::envoy::{filter_wasm, Envoy, EnvoyParams};
use crate::net::free_port;
use crate::postgres::TempCluster;
use crate::process::workspace_root;
use crate::services::{
    start_checkout, start_state_api, Service, ServiceTestExt as _, StateApiSettings,
};
use crate::tls::{CertFiles, TestPki};

/// The bearer token Envoy's filter presents to the state API in tests.
pub const TEST_API_TOKEN: &str = "test-filter-token";
pub const TEST_KEY_SECRET: &str = "test-key-secret-not-for-production";
/// The end-to-end stacks' storage key (32 bytes, base64; not for production): every stored
/// response of the suites is sealed.
pub const TEST_STORAGE_KEY: &str = "dGVzdC1zdG9yYWdlLWtleS1ub3QtZm9yLXByb2QhISE=";

/// `env` with the test storage key unless it names one.
pub fn with_storage_key(mut env: Vec<(String, String)>) -> Vec<(String, String)> {
    if !env
        .iter()
        .any(|(k, _)| k == state_env::STATE_API_STORAGE_KEY)
    {
        env.push((
            state_env::STATE_API_STORAGE_KEY.into(),
            TEST_STORAGE_KEY.into(),
        ));
    }
    env
}

#[derive(Debug, Clone)]
pub struct StackOptions {
    /// Lease of a claim: short in tests that wait for a lease to run out.
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
    /// The filter's callout timeout to the state API.
    pub state_api_timeout_ms: u64,
    /// Extra environment for the state API (e.g. a retention for purge tests).
    pub state_api_env: Vec<(String, String)>,
    /// The filter's `complete_in_background`.
    pub complete_in_background: bool,
    /// Envoy's worker threads.
    pub envoy_workers: u32,
    /// A change to the demo's configuration (`examples/demo.toml`): routes, policies.
    pub tweak: Option<crate::envoy::Tweak>,
    /// TLS on every hop with these certificates: Envoy -> state API with mutual TLS (the
    /// state API serves `server`), state API -> Postgres with `sslmode=verify-full` (a private
    /// cluster that accepts TLS connections only). `None`: plain, as the demo.
    pub tls: Option<Arc<TestPki>>,
}

impl Default for StackOptions {
    fn default() -> Self {
        Self {
            lease_ms: 30_000,
            heartbeat_ms: 10_000,
            state_api_timeout_ms: 1_000,
            state_api_env: Vec::new(),
            complete_in_background: false,
            envoy_workers: 1,
            tweak: None,
            tls: None,
        }
    }
}

pub struct Stack {
    pub options: StackOptions,
    /// Where configs and logs of this stack go (kept after the run for debugging).
    pub dir: PathBuf,
    pub postgres: TempCluster,
    pub database_url: String,
    pub state_api: Service,
    pub checkout: Service,
    pub envoy: Envoy,
}

impl Stack {
    /// The name of this stack's database (the last part of `database_url`), for `psql`.
    pub fn database_name(&self) -> &str {
        let path = self.database_url.rsplit('/').next().unwrap_or_default();
        path.split('?').next().unwrap_or_default()
    }

    pub fn start(options: StackOptions) -> Result<Self, String> {
        let dir = run_dir("stack")?;
        let postgres = match &options.tls {
            Some(pki) => TempCluster::start_private_tls(&pki.postgres_tls()?)?,
            None => TempCluster::start()?,
        };
        // Its own database, so stacks stay apart even on a shared DATABASE_URL server.
        let database_url = postgres.fresh_database("stack")?;
        let database_url = match &options.tls {
            Some(pki) => format!(
                "{database_url}?sslmode=verify-full&sslrootcert={}",
                pki.ca.display()
            ),
            None => database_url,
        };
        let state_api = start_state_api(
            &Self::state_api_settings(&options, &database_url, free_port(), None),
            &dir,
        )?;
        let checkout = start_checkout(free_port(), &dir)?;
        let envoy = Envoy::start(
            Self::envoy_params_for(&options, state_api.port, checkout.port)?,
            &dir,
            "envoy",
        )?;
        Ok(Self {
            options,
            dir,
            postgres,
            database_url,
            state_api,
            checkout,
            envoy,
        })
    }

    /// Over TLS (`served`: this CA's certificates, serving this one) when given, else when the
    /// stack runs over TLS (its server certificate).
    fn state_api_settings(
        options: &StackOptions,
        database_url: &str,
        port: u16,
        served: Option<(&TestPki, &CertFiles)>,
    ) -> StateApiSettings {
        let mut extra_env = with_storage_key(options.state_api_env.clone());
        let served = served.or_else(|| options.tls.as_deref().map(|pki| (pki, &pki.server)));
        if let Some((pki, cert)) = served {
            extra_env.extend(edge::render::state_api_tls_env(&pki.state_tls(cert)));
        }
        StateApiSettings {
            port,
            database_url: database_url.to_owned(),
            api_token: TEST_API_TOKEN.into(),
            key_secret: TEST_KEY_SECRET.into(),
            listen: None,
            extra_env,
        }
    }

    /// Envoy's parameters for these options, talking to these ports (free listener and admin
    /// ports): for a test that starts an Envoy by itself.
    pub fn envoy_params_for(
        options: &StackOptions,
        state_api_port: u16,
        checkout_port: u16,
    ) -> Result<EnvoyParams, String> {
        Ok(EnvoyParams {
            listen_address: "127.0.0.1".into(),
            listen_port: free_port(),
            admin_address: "127.0.0.1".into(),
            admin_port: free_port(),
            checkout_host: "127.0.0.1".into(),
            checkout_port,
            state_api_host: "127.0.0.1".into(),
            state_api_port,
            state_api_token: TEST_API_TOKEN.into(),
            state_api_timeout_ms: options.state_api_timeout_ms,
            lease_ms: options.lease_ms,
            heartbeat_ms: options.heartbeat_ms,
            complete_in_background: options.complete_in_background,
            workers: options.envoy_workers,
            filter_wasm: filter_wasm()?.display().to_string(),
            jwks_path: workspace_root()
                .join("envoy/demo-jwks.json")
                .display()
                .to_string(),
            tweak: Self::tweak_for(options),
        })
    }

    /// The options' change to the demo's configuration, with `[state.tls]` first when the
    /// stack runs over TLS.
    fn tweak_for(options: &StackOptions) -> Option<crate::envoy::Tweak> {
        let Some(pki) = &options.tls else {
            return options.tweak.clone();
        };
        let tls = pki.state_tls(&pki.server);
        let then = options.tweak.clone();
        Some(crate::envoy::Tweak::new(move |cfg| {
            cfg.state.tls = Some(tls.clone());
            if let Some(t) = &then {
                (t.0)(cfg);
            }
        }))
    }

    /// Another state API process on the same database (how users scale out).
    pub fn start_extra_state_api(&self) -> Result<Service, String> {
        start_state_api(
            &Self::state_api_settings(&self.options, &self.database_url, free_port(), None),
            &self.dir,
        )
    }

    /// Another state API on the same database with `env` on top of this stack's (the
    /// benchmark's purge).
    pub fn start_extra_state_api_with(&self, env: &[(&str, &str)]) -> Result<Service, String> {
        let mut settings =
            Self::state_api_settings(&self.options, &self.database_url, free_port(), None);
        settings
            .extra_env
            .extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        start_state_api(&settings, &self.dir)
    }

    /// Another state API with this stack's options on another `DATABASE_URL` (the same
    /// database with other TLS settings).
    pub fn start_extra_state_api_on(&self, database_url: &str) -> Result<Service, String> {
        start_state_api(
            &Self::state_api_settings(&self.options, database_url, free_port(), None),
            &self.dir,
        )
    }

    /// Another state API on the same database serving HTTPS with `served`, checking client
    /// certificates against `pki`'s CA (a TLS stack's wrong certificates; the benchmark's TLS
    /// hop next to a plain stack).
    pub fn start_extra_state_api_tls(
        &self,
        pki: &TestPki,
        served: &CertFiles,
    ) -> Result<Service, String> {
        start_state_api(
            &Self::state_api_settings(
                &self.options,
                &self.database_url,
                free_port(),
                Some((pki, served)),
            ),
            &self.dir,
        )
    }

    /// Starts the state API again on its old port (after a kill).
    pub fn restart_state_api(&mut self) -> Result<(), String> {
        self.state_api.kill();
        let settings =
            Self::state_api_settings(&self.options, &self.database_url, self.state_api.port, None);
        self.state_api = start_state_api(&settings, &self.dir)?;
        Ok(())
    }

    /// Another Envoy with the filter, talking to the given state API (and the same checkout).
    pub fn start_extra_envoy(&self, state_api_port: u16, name: &str) -> Result<Envoy, String> {
        Envoy::start(
            Self::envoy_params_for(&self.options, state_api_port, self.checkout.port)?,
            &self.dir,
            name,
        )
    }

    /// [`Stack::start_extra_envoy`] with every claim and complete its own callout
    /// (`batch_max = 1`): for a fake state API that answers the single calls only.
    pub fn start_extra_envoy_unbatched(
        &self,
        state_api_port: u16,
        name: &str,
    ) -> Result<Envoy, String> {
        let mut params = Self::envoy_params_for(&self.options, state_api_port, self.checkout.port)?;
        params.tweak = Some(crate::envoy::Tweak::new(|cfg| cfg.filter.batch_max = 1));
        Envoy::start(params, &self.dir, name)
    }

    /// Starts Envoy again with the same config and ports (after a kill).
    pub fn restart_envoy(&mut self) -> Result<(), String> {
        self.envoy.kill();
        self.envoy = Envoy::start(self.envoy.params.clone(), &self.dir, "envoy-restarted")?;
        Ok(())
    }

    /// Logs of every part, for a failure message.
    pub fn logs(&self) -> String {
        format!(
            "{}\n{}\n{}",
            self.envoy.log_tail(),
            self.state_api.log_tail(),
            self.checkout.log_tail()
        )
    }
}

/// A fresh folder under `target/stack-runs/` for one stack's configs and logs.
pub fn run_dir(prefix: &str) -> Result<PathBuf, String> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("target"));
    let dir = target.join("stack-runs").join(format!(
        "{prefix}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

/// A token for `sub` that expires at `exp` (Unix seconds), signed like the demo's with the demo
/// key (`envoy/demo-keys/demo-signing-key.pem`, committed on purpose) by the `openssl` command,
/// as `envoy/demo-keys/make-tokens.py` does. For tests that need an expiry relative to now.
pub fn mint_token(sub: &str, exp: u64) -> String {
    use base64::engine::{general_purpose::URL_SAFE_NO_PAD, Engine};
    let part = |v: serde_json::Value| URL_SAFE_NO_PAD.encode(v.to_string());
    let signing_input = format!(
        "{}.{}",
        part(serde_json::json!({"alg": "RS256", "typ": "JWT", "kid": "demo-2026"})),
        part(serde_json::json!({
            "iss": "https://demo-issuer.edge-idempotency.invalid",
            "aud": "checkout",
            "sub": sub,
            "iat": 1_764_000_000u64,
            "exp": exp,
        }))
    );
    let key = workspace_root().join("envoy/demo-keys/demo-signing-key.pem");
    let signature = crate::process::run_with_stdin(
        "openssl",
        &["dgst", "-sha256", "-sign", &key.to_string_lossy()],
        signing_input.as_bytes(),
    )
    .unwrap_or_else(|e| {
        panic!("cannot sign a test token with openssl (apt-get install openssl): {e}")
    });
    format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(signature))
}

/// Tokens: the demo's (`envoy/demo-tokens.json`: alice, bob) and the tests' bad ones
/// (`tests/fixtures/tokens.json`: expired, wrong_key, wrong_issuer, wrong_audience, tampered, carol).
pub fn token(name: &str) -> String {
    let read = |path: PathBuf| -> serde_json::Value {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or_default()
    };
    let demo = read(workspace_root().join("envoy/demo-tokens.json"));
    let fixtures = read(workspace_root().join("tests/fixtures/tokens.json"));
    demo.get(name)
        .or_else(|| fixtures.get(name))
        .and_then(|v| v.as_str())
        .map(str::to_owned)
        .unwrap_or_else(|| {
            panic!("no token named {name} in envoy/demo-tokens.json or tests/fixtures/tokens.json")
        })
}
