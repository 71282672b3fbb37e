//! The stack on a highly available Postgres (issue 16): Patroni with a synchronous standby and
//! HAProxy ([`test_support::ha::HaCluster`]), state APIs connected through HAProxy, the demo checkout and
//! Envoys with the filter. For the HA tests (`tests/tests/ha.rs`).

use std::path::PathBuf;

use test_support::ha::{HaCluster, HaClusterTestExt as _};

use crate::envoy::Envoy;
use crate::net::free_port;
use crate::services::{start_checkout, start_state_api, Service, StateApiSettings};
use crate::stack::{run_dir, Stack, StackOptions, TEST_API_TOKEN, TEST_KEY_SECRET};

/// The database the state APIs use on the HA cluster.
pub const DATABASE: &str = "idempotency";

pub struct HaStack {
    pub options: StackOptions,
    pub dir: PathBuf,
    pub ha: HaCluster,
    pub database_url: String,
    /// One state API per Envoy (`state_apis[i]` serves `envoys[i]`).
    pub state_apis: Vec<Service>,
    pub checkout: Service,
    pub envoys: Vec<Envoy>,
}

impl HaStack {
    /// The HA cluster, then `edges` pairs of a state API and an Envoy, all on one checkout.
    pub fn start(options: StackOptions, edges: usize) -> Result<Self, String> {
        let dir = run_dir("ha")?;
        let ha = HaCluster::start()?;
        let database_url = ha.ensure_database(DATABASE)?;
        let checkout = start_checkout(free_port(), &dir)?;
        let mut state_apis = Vec::new();
        let mut envoys = Vec::new();
        for i in 0..edges {
            let api = start_state_api(
                &StateApiSettings {
                    port: free_port(),
                    database_url: database_url.clone(),
                    api_token: TEST_API_TOKEN.into(),
                    key_secret: TEST_KEY_SECRET.into(),
                    listen: None,
                    extra_env: crate::stack::with_storage_key(options.state_api_env.clone()),
                },
                &dir,
            )?;
            let envoy = Envoy::start(
                Stack::envoy_params_for(&options, api.port, checkout.port)?,
                &dir,
                &format!("envoy{i}"),
            )?;
            state_apis.push(api);
            envoys.push(envoy);
        }
        Ok(Self {
            options,
            dir,
            ha,
            database_url,
            state_apis,
            checkout,
            envoys,
        })
    }

    /// Runs one SQL command on the primary (through HAProxy).
    pub fn psql(&self, sql: &str) -> Result<String, String> {
        self.ha.psql(DATABASE, sql)
    }

    /// Every log, for a failure message.
    pub fn logs(&self) -> String {
        logs_of(&self.ha, &self.state_apis, &self.envoys, &self.checkout)
    }
}

/// The last lines of the cluster's, the state APIs', the Envoys' and the checkout's logs.
pub fn logs_of(
    ha: &HaCluster,
    state_apis: &[Service],
    envoys: &[Envoy],
    checkout: &Service,
) -> String {
    let mut out = ha.log_tails();
    for api in state_apis {
        out.push_str(&api.log_tail());
        out.push('\n');
    }
    for envoy in envoys {
        out.push_str(&envoy.log_tail());
        out.push('\n');
    }
    out.push_str(&checkout.log_tail());
    out
}
