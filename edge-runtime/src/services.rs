//! The project's own services as real processes: the state API (`edge run`; the tests start the
//! demo checkout the same way, through crate `test-support`).

use contract::state_env;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use crate::net::{http_get_at, wait_for_addr};
use crate::process::{workspace_binary, ChildGuard, Host};

/// A running service binary of this workspace, on a loopback port or on a host of its own.
pub struct Service {
    pub name: String,
    pub port: u16,
    /// Where it answers (`127.0.0.1:<port>` on loopback).
    pub addr: SocketAddr,
    pub log_path: std::path::PathBuf,
    /// The process (tests signal and kill it).
    pub child: ChildGuard,
}

/// When a started service counts as ready.
#[derive(Debug, Clone, Copy)]
pub enum Ready<'a> {
    /// A plain HTTP GET of this path answers 200.
    Http(&'a str),
    /// Its port accepts connections (an HTTPS service: the state API binds only once its
    /// migrations ran and its certificate loaded).
    Listening,
}

impl Service {
    /// Starts `name` on `host`, ready once it answers at `addr`.
    pub fn start_with(
        name: &str,
        host: &Host,
        addr: SocketAddr,
        envs: &[(&str, String)],
        dir: &Path,
        ready: Ready<'_>,
    ) -> Result<Self, String> {
        let bin = workspace_binary(name)?;
        let port = addr.port();
        let log_path = if host.prefix.is_empty() {
            dir.join(format!("{name}-{port}.log"))
        } else {
            dir.join(format!("{name}-{}-{port}.log", host.address))
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = host.command(bin);
        cmd.envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .env(
                "RUST_LOG",
                std::env::var("STACK_RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        let child = ChildGuard::spawn(name, &mut cmd)?;
        let mut service = Self {
            name: name.to_owned(),
            port,
            addr,
            log_path,
            child,
        };
        service.wait_ready(ready, Duration::from_secs(30))?;
        Ok(service)
    }

    fn wait_ready(&mut self, ready: Ready<'_>, timeout: Duration) -> Result<(), String> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if !self.child.is_running() {
                return Err(format!(
                    "{} exited during start-up\n{}",
                    self.name,
                    self.log_tail()
                ));
            }
            let up = wait_for_addr(self.addr, Duration::from_millis(100)).is_ok();
            if up
                && match ready {
                    Ready::Http(path) => http_get_at(self.addr, path).is_ok(),
                    Ready::Listening => true,
                }
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "{} was not ready on {} within {timeout:?}\n{}",
            self.name,
            self.addr,
            self.log_tail()
        ))
    }

    pub fn log_tail(&self) -> String {
        crate::process::log_tail(&self.log_path)
    }

    /// SIGTERM, then SIGKILL after `grace`; says which it took.
    pub fn terminate(&mut self, grace: Duration) -> crate::process::Stopped {
        self.child.terminate(grace)
    }

    pub fn is_running(&mut self) -> bool {
        self.child.is_running()
    }
}

/// Settings of a state API process.
#[derive(Debug, Clone)]
pub struct StateApiSettings {
    pub port: u16,
    pub database_url: String,
    pub api_token: String,
    pub key_secret: String,
    /// Where it binds (the host's address and `port` when `None`); it is probed there, or at
    /// the host's address when it binds every address (`0.0.0.0`).
    pub listen: Option<std::net::SocketAddr>,
    pub extra_env: Vec<(String, String)>,
}

pub fn start_state_api(s: &StateApiSettings, dir: &Path) -> Result<Service, String> {
    start_state_api_on(&Host::loopback(), s, dir)
}

/// [`start_state_api`] on `host`.
pub fn start_state_api_on(
    host: &Host,
    s: &StateApiSettings,
    dir: &Path,
) -> Result<Service, String> {
    let listen = s.listen.unwrap_or_else(|| host.addr(s.port));
    let probe = if listen.ip().is_unspecified() {
        host.addr(listen.port())
    } else {
        listen
    };
    let mut envs = vec![
        (state_env::DATABASE_URL, s.database_url.clone()),
        (state_env::LISTEN_ADDR, listen.to_string()),
        (state_env::STATE_API_TOKEN, s.api_token.clone()),
        (state_env::IDEM_KEY_SECRET, s.key_secret.clone()),
    ];
    envs.extend(s.extra_env.iter().map(|(k, v)| (k.as_str(), v.clone())));
    // Over HTTPS the plain probe cannot ask /readyz: it waits for the port.
    let ready = if envs
        .iter()
        .any(|(k, _)| *k == state_env::STATE_API_TLS_CERT)
    {
        Ready::Listening
    } else {
        Ready::Http("/readyz")
    };
    Service::start_with("state-api", host, probe, &envs, dir, ready)
}
