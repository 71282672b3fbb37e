//! The stack with every part on a host of its own (issue 35, the partition tests): a client
//! host, two Envoys, two state APIs, the Patroni cluster as `HA=1` runs it (etcd, two nodes with
//! their Patroni and Postgres, HAProxy: one host each) and the demo checkout, each with its own
//! address on one switch ([`crate::netns`]), started by the same launchers as everywhere else
//! (the host is a parameter). The harness itself works from a host of its own.
//!
//! Envoy *i* talks to state API *i* through a relay on the state API's host
//! ([`DelayProxy`]), which passes traffic until a test slows or stalls it; every other link is
//! direct, and cut with nftables on the switch.

use std::path::PathBuf;

use test_support::ha::{HaCluster, HaClusterTestExt as _, HaHosts, HaPorts};

use crate::envoy::Envoy;
use crate::faults::{DelayProxy, ProxyMode};
use crate::ha::DATABASE;
use crate::netns::{NetHost, Network};
use crate::services::{start_checkout_on, start_state_api_on, Service, StateApiSettings};
use crate::stack::{
    run_dir, with_storage_key, Stack, StackOptions, TEST_API_TOKEN, TEST_KEY_SECRET,
};

/// Where the harness runs (starts processes, probes them, reads their ledgers).
pub const HARNESS: &str = "harness";
/// Where the clients run.
pub const CLIENT: &str = "client";
pub const ENVOYS: [&str; 2] = ["envoy1", "envoy2"];
pub const STATE_APIS: [&str; 2] = ["api1", "api2"];
pub const ETCD: &str = "etcd";
/// The two Postgres nodes, each with its Patroni.
pub const NODES: [&str; 2] = ["pg1", "pg2"];
pub const HAPROXY: &str = "haproxy";
pub const CHECKOUT: &str = "checkout";

/// Every host has an address of its own, so every part keeps its usual port.
pub const ENVOY_PORT: u16 = 10000;
pub const ENVOY_ADMIN_PORT: u16 = 9901;
pub const STATE_API_PORT: u16 = 8081;
/// The relay on each state API's host that its Envoy goes through.
pub const RELAY_PORT: u16 = 8181;
pub const CHECKOUT_PORT: u16 = 8082;
pub const POSTGRES_PORT: u16 = 5432;
pub const PATRONI_PORT: u16 = 8008;
pub const HAPROXY_PORT: u16 = 5000;
pub const ETCD_PORT: u16 = 2379;

const ALL_HOSTS: [&str; 11] = [
    HARNESS,
    CLIENT,
    ENVOYS[0],
    ENVOYS[1],
    STATE_APIS[0],
    STATE_APIS[1],
    ETCD,
    NODES[0],
    NODES[1],
    HAPROXY,
    CHECKOUT,
];

/// A port something listens on at `host`: the target of a connect that proves a link up or
/// down.
pub fn listening_port(host: &str) -> Option<u16> {
    match host {
        h if ENVOYS.contains(&h) => Some(ENVOY_PORT),
        h if STATE_APIS.contains(&h) => Some(STATE_API_PORT),
        h if NODES.contains(&h) => Some(POSTGRES_PORT),
        ETCD => Some(ETCD_PORT),
        HAPROXY => Some(HAPROXY_PORT),
        CHECKOUT => Some(CHECKOUT_PORT),
        _ => None,
    }
}

pub struct NetStack {
    pub options: StackOptions,
    pub dir: PathBuf,
    pub envoys: Vec<Envoy>,
    /// `relays[i]`: Envoy *i*'s way to state API *i*, on the state API's host.
    pub relays: Vec<DelayProxy>,
    pub state_apis: Vec<Service>,
    pub checkout: Service,
    pub ha: HaCluster,
    pub database_url: String,
    /// Last: the hosts go once every process on them has stopped.
    pub net: Network,
}

impl NetStack {
    /// The hosts, then every part on its own (the calling thread moves to the harness's host).
    pub fn start(options: StackOptions) -> Result<Self, String> {
        let mut net = Network::start(&ALL_HOSTS).map_err(|e| e.to_string())?;
        net.enter(HARNESS).map_err(|e| e.to_string())?;
        let dir = run_dir("partitions")?;
        let host = |name: &str| net.host(name).map_err(|e| e.to_string());
        let ha = HaCluster::start_on(
            HaHosts {
                etcd: host(ETCD)?.host(),
                nodes: [host(NODES[0])?.host(), host(NODES[1])?.host()],
                haproxy: host(HAPROXY)?.host(),
                trusted: net.subnet(),
            },
            HaPorts {
                etcd_client: ETCD_PORT,
                etcd_peer: ETCD_PORT + 1,
                rest: [PATRONI_PORT; 2],
                postgres: [POSTGRES_PORT; 2],
                proxy: HAPROXY_PORT,
            },
        )?;
        let database_url = ha.ensure_database(DATABASE)?;
        let checkout = start_checkout_on(&host(CHECKOUT)?.host(), CHECKOUT_PORT, &dir)?;
        let (mut state_apis, mut relays, mut envoys) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..2 {
            let api_host = host(STATE_APIS[i])?;
            let api = start_state_api_on(
                &api_host.host(),
                &StateApiSettings {
                    port: STATE_API_PORT,
                    database_url: database_url.clone(),
                    api_token: TEST_API_TOKEN.into(),
                    key_secret: TEST_KEY_SECRET.into(),
                    listen: None,
                    extra_env: with_storage_key(options.state_api_env.clone()),
                },
                &dir,
            )?;
            let relay = DelayProxy::start_on(
                Some(api_host.netns.clone()),
                api_host.addr(RELAY_PORT),
                api_host.addr(STATE_API_PORT),
                ProxyMode::Pass,
            )?;
            let envoy_host = host(ENVOYS[i])?;
            let mut params = Stack::envoy_params_for(&options, RELAY_PORT, CHECKOUT_PORT)?;
            params.listen_address = envoy_host.address.to_string();
            params.listen_port = ENVOY_PORT;
            params.admin_address = envoy_host.address.to_string();
            params.admin_port = ENVOY_ADMIN_PORT;
            params.checkout_host = host(CHECKOUT)?.address.to_string();
            params.state_api_host = api_host.address.to_string();
            let envoy = Envoy::start_on(&envoy_host.host(), params, &dir, ENVOYS[i])?;
            state_apis.push(api);
            relays.push(relay);
            envoys.push(envoy);
        }
        Ok(Self {
            options,
            dir,
            envoys,
            relays,
            state_apis,
            checkout,
            ha,
            database_url,
            net,
        })
    }

    pub fn host(&self, name: &str) -> &NetHost {
        self.net
            .host(name)
            .unwrap_or_else(|e| panic!("the partition stack has no host: {e}"))
    }

    /// The host of Postgres node `i` (its Patroni's too).
    pub fn node_host(&self, i: usize) -> &NetHost {
        self.host(NODES[i])
    }

    /// Every log's last lines, for a failure message.
    pub fn logs(&self) -> String {
        crate::ha::logs_of(&self.ha, &self.state_apis, &self.envoys, &self.checkout)
    }
}
