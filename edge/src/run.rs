//! `edge run`: checks that every address is free, then starts Postgres (embedded under the run
//! folder unless the file names one), the state API and Envoy in front of the upstream; prints
//! one `ready:` line; restarts any part that dies (Postgres included); stops everything on
//! Ctrl-C or SIGTERM, Envoy first.
//!
//! The run folder (`.run/<config name>/` by default) keeps the embedded cluster's data, the
//! secrets made for a file that names none, the rendered Envoy configuration and every log.
//!
//! With `--ha` (`HA=1 make run`) the embedded Postgres is highly available instead
//! ([`crate::ha`]): etcd, two nodes under Patroni with a synchronous standby, and HAProxy on
//! `postgres_port` in front of whichever node is primary; its data is under `<run folder>/ha/`.

use contract::state_env;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{Config, ConfigError};
use crate::envoy::EnvoyProcess;
use crate::ha::{HaCluster, HaPorts};
use crate::postgres::Cluster;
use crate::process::Stopped;
use crate::render;
use crate::services::{start_state_api, Service, StateApiSettings};

/// The database the state API uses on the embedded cluster.
pub const EMBEDDED_DATABASE: &str = "idempotency";

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("{part} did not start: {why}")]
    Start { part: &'static str, why: String },
    #[error("{0}")]
    Folder(String),
}

/// Where and with what `edge run` runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// The run folder.
    pub dir: PathBuf,
    /// The filter module.
    pub wasm: PathBuf,
    /// The embedded Postgres under Patroni, with a synchronous standby and HAProxy.
    pub ha: bool,
}

/// Where the state API's records live.
enum Database {
    Embedded(Cluster),
    Ha(Box<HaCluster>),
    /// The file's `database_url`: not ours to supervise.
    External,
}

/// The secrets the state API and the filter share: from the file, or made once and kept in the
/// run folder (readable by this user only).
#[derive(Debug, Clone)]
pub struct Secrets {
    pub token: String,
    pub key_secret: String,
    /// The storage key (base64), unless the file names one (then it is in the environment).
    pub storage_key: Option<String>,
}

impl Secrets {
    fn for_config(cfg: &Config, dir: &Path) -> Result<Self, RunError> {
        Ok(Self {
            token: match &cfg.state.token {
                Some(t) => t.clone(),
                None => kept_secret(&dir.join("state-api-token"))?,
            },
            key_secret: match &cfg.state.key_secret {
                Some(k) => k.clone(),
                None => kept_secret(&dir.join("key-secret"))?,
            },
            storage_key: match &cfg.state.storage_key {
                Some(_) => None,
                None => Some(kept_storage_key(&dir.join("storage-key"))?),
            },
        })
    }
}

/// A random secret kept in `path` (made on first use, mode 0600).
fn kept_secret(path: &Path) -> Result<String, RunError> {
    if let Ok(s) = std::fs::read_to_string(path) {
        let s = s.trim().to_owned();
        if s.len() >= 32 {
            return Ok(s);
        }
    }
    let secret: String = random_bytes()?.iter().map(|b| format!("{b:02x}")).collect();
    keep(path, &secret)?;
    Ok(secret)
}

/// A random AES-256 storage key (base64) kept in `path` (made on first use, mode 0600).
fn kept_storage_key(path: &Path) -> Result<String, RunError> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    if let Ok(s) = std::fs::read_to_string(path) {
        let s = s.trim().to_owned();
        if b64.decode(&s).is_ok_and(|k| k.len() == 32) {
            return Ok(s);
        }
    }
    let key = b64.encode(random_bytes()?);
    keep(path, &key)?;
    Ok(key)
}

fn random_bytes() -> Result<[u8; 32], RunError> {
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| RunError::Folder(format!("cannot read /dev/urandom: {e}")))?;
    Ok(bytes)
}

/// Writes a secret to `path`, readable by this user only.
fn keep(path: &Path, secret: &str) -> Result<(), RunError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| RunError::Folder(format!("cannot write {}: {e}", path.display())))?;
    f.write_all(secret.as_bytes())
        .map_err(|e| RunError::Folder(format!("cannot write {}: {e}", path.display())))
}

/// Every address this run will listen on must be free: the first taken one is an error at its
/// line, before anything starts.
pub fn check_ports(cfg: &Config, ha: bool) -> Result<(), ConfigError> {
    let mut wanted: Vec<(&str, SocketAddr)> =
        vec![("listen", cfg.listen), ("state.listen", cfg.state.listen)];
    if let Some(a) = cfg.admin {
        wanted.push(("admin", a));
    }
    let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
    if cfg.embedded_postgres() {
        wanted.push(("state.postgres_port", loopback(cfg.state.postgres_port)));
        if ha {
            // The other parts of the HA cluster sit on fixed ports (HaPorts::demo).
            for (_, port) in HaPorts::demo(cfg.state.postgres_port).all() {
                if port != cfg.state.postgres_port {
                    wanted.push(("state.postgres_port", loopback(port)));
                }
            }
        }
    }
    for (field, addr) in wanted {
        if let Err(e) = TcpListener::bind(addr) {
            return Err(cfg.error_at(
                field,
                format!("{field}: {addr} is in use or cannot be bound ({e}); stop what listens there or choose another port"),
            ));
        }
    }
    Ok(())
}

/// The running parts.
pub struct Running {
    pub cfg: Config,
    pub options: Options,
    pub secrets: Secrets,
    pub database_url: String,
    database: Database,
    pub state_api: Service,
    pub envoy: EnvoyProcess,
}

impl Running {
    /// Checks the ports, then starts every part (a part that fails stops the ones started).
    pub fn start(cfg: Config, options: Options) -> Result<Self, RunError> {
        check_ports(&cfg, options.ha)?;
        std::fs::create_dir_all(options.dir.join("logs")).map_err(|e| {
            RunError::Folder(format!("cannot create {}: {e}", options.dir.display()))
        })?;
        let secrets = Secrets::for_config(&cfg, &options.dir)?;
        let start_err = |why| RunError::Start {
            part: "Postgres",
            why,
        };
        let (database, database_url) = match &cfg.state.database_url {
            Some(url) => (Database::External, url.clone()),
            None if options.ha => {
                let ha = HaCluster::start_at(
                    &options.dir.join("ha"),
                    HaPorts::demo(cfg.state.postgres_port),
                )
                .map_err(start_err)?;
                let url = ha.ensure_database(EMBEDDED_DATABASE).map_err(start_err)?;
                (Database::Ha(Box::new(ha)), url)
            }
            None => {
                let cluster =
                    Cluster::start_at(&options.dir.join("postgres"), cfg.state.postgres_port)
                        .map_err(|why| RunError::Start {
                            part: "Postgres",
                            why,
                        })?;
                let url =
                    cluster
                        .ensure_database(EMBEDDED_DATABASE)
                        .map_err(|why| RunError::Start {
                            part: "Postgres",
                            why,
                        })?;
                (Database::Embedded(cluster), url)
            }
        };
        let state_api = start_state_api(
            &state_settings(&cfg, &database_url, &secrets),
            &options.dir.join("logs"),
        )
        .map_err(|why| RunError::Start {
            part: "the state API",
            why,
        })?;
        let envoy = start_envoy(&cfg, &options, &secrets)?;
        Ok(Self {
            cfg,
            options,
            secrets,
            database_url,
            database,
            state_api,
            envoy,
        })
    }

    /// One line for the operator: every address, and where the logs are.
    pub fn ready_line(&self) -> String {
        let admin = self
            .cfg
            .admin
            .map(|a| format!(" (admin {a})"))
            .unwrap_or_default();
        let db = match &self.database {
            Database::Embedded(_) => format!(
                "embedded Postgres 127.0.0.1:{} ({})",
                self.cfg.state.postgres_port,
                self.options.dir.join("postgres").display()
            ),
            Database::Ha(ha) => {
                let p = ha.ports();
                format!(
                    "HA Postgres via HAProxy 127.0.0.1:{} (Patroni REST :{}/:{}, Postgres :{}/:{}, etcd :{}; {})",
                    p.proxy,
                    p.rest[0],
                    p.rest[1],
                    p.postgres[0],
                    p.postgres[1],
                    p.etcd_client,
                    ha.root().display()
                )
            }
            Database::External => format!("Postgres {}", redact(&self.database_url)),
        };
        let state_api = match &self.cfg.state.tls {
            Some(t) if t.client_cert.is_some() => {
                format!("https://{} (mutual TLS)", self.cfg.state.listen)
            }
            Some(_) => format!("https://{}", self.cfg.state.listen),
            None => self.cfg.state.listen.to_string(),
        };
        format!(
            "ready: Envoy http://{}{admin} -> filter -> upstream {}; state API {state_api}; {db}; logs {}",
            self.cfg.listen,
            self.cfg.upstream.authority(),
            self.options.dir.join("logs").display()
        )
    }

    /// Restarts the parts that died; says which, in the order they depend on each other.
    pub fn supervise(&mut self) -> Vec<String> {
        let mut said = Vec::new();
        match &mut self.database {
            Database::Embedded(pg) => {
                if !pg.is_running() {
                    said.push("Postgres died; restarting it (crash recovery runs)".to_owned());
                    if let Err(e) = pg.restart() {
                        said.push(format!("Postgres restart failed, will retry: {e}"));
                        return said;
                    }
                }
            }
            // Patroni restarts its own Postgres; a part of the cluster that died is restarted.
            Database::Ha(ha) => said.extend(ha.supervise()),
            Database::External => {}
        }
        if !self.state_api.is_running() {
            said.push(format!(
                "the state API died (log: {}); restarting it",
                self.state_api.log_path.display()
            ));
            match start_state_api(
                &state_settings(&self.cfg, &self.database_url, &self.secrets),
                &self.options.dir.join("logs"),
            ) {
                Ok(s) => self.state_api = s,
                Err(e) => said.push(format!("state API restart failed, will retry: {e}")),
            }
        }
        if !self.envoy.is_running() {
            said.push(format!(
                "Envoy died (log: {}); restarting it",
                self.envoy.log_path.display()
            ));
            match start_envoy(&self.cfg, &self.options, &self.secrets) {
                Ok(e) => self.envoy = e,
                Err(e) => said.push(format!("Envoy restart failed, will retry: {e}")),
            }
        }
        said
    }

    /// Stops Envoy (no new requests), then the state API, then Postgres; says which part
    /// did not stop on SIGTERM and was killed.
    pub fn stop(mut self) {
        if self.envoy.terminate(Duration::from_secs(5)) == Stopped::Killed {
            eprintln!("Envoy did not stop within 5 s of SIGTERM: killed");
        }
        if self.state_api.terminate(Duration::from_secs(5)) == Stopped::Killed {
            eprintln!("the state API did not stop within 5 s of SIGTERM: killed");
        }
        drop(std::mem::replace(&mut self.database, Database::External));
    }
}

fn state_settings(cfg: &Config, database_url: &str, secrets: &Secrets) -> StateApiSettings {
    let mut env = render::state_api_env(cfg, database_url, &secrets.token, &secrets.key_secret);
    if let Some(k) = &secrets.storage_key {
        env.push((state_env::STATE_API_STORAGE_KEY.to_owned(), k.clone()));
    }
    StateApiSettings {
        port: cfg.state.listen.port(),
        database_url: database_url.to_owned(),
        api_token: secrets.token.clone(),
        key_secret: secrets.key_secret.clone(),
        listen: Some(cfg.state.listen),
        extra_env: env
            .into_iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    state_env::DATABASE_URL
                        | state_env::LISTEN_ADDR
                        | state_env::STATE_API_TOKEN
                        | state_env::IDEM_KEY_SECRET
                )
            })
            .collect(),
    }
}

fn start_envoy(
    cfg: &Config,
    options: &Options,
    secrets: &Secrets,
) -> Result<EnvoyProcess, RunError> {
    let inputs = render::Inputs {
        wasm: options.wasm.clone(),
        state_token: secrets.token.clone(),
        ca_file: render::DEFAULT_CA_FILE.into(),
    };
    let yaml = render::envoy_yaml(cfg, &inputs);
    EnvoyProcess::start(
        &yaml,
        cfg.envoy_workers,
        cfg.listen.port(),
        cfg.admin.map(|a| a.port()),
        &options.dir.join("logs"),
        "envoy",
    )
    .map_err(|why| RunError::Start { part: "Envoy", why })
}

/// `postgres://user:password@host/db` without the password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// Runs until Ctrl-C or SIGTERM, supervising once a second; `also` is called each round too
/// (the demo supervises its checkout with it).
pub async fn until_signal(
    running: &mut Running,
    mut also: impl FnMut() -> Vec<String>,
) -> Result<(), String> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("cannot listen for SIGTERM: {e}"))?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = term.recv() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                for line in running.supervise().into_iter().chain(also()) {
                    eprintln!("{line}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn passwords_are_not_printed() {
        assert_eq!(
            redact("postgres://u:secret@h:5/db"),
            "postgres://u:***@h:5/db"
        );
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
    }
}
