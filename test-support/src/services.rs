//! The project's services as the tests start and handle them: the demo checkout, and what a
//! test does to a running service (signal it, kill it, read its log). The state API's launcher
//! is `edge run`'s own ([`edge_runtime::services`]).

use std::path::Path;

pub use edge_runtime::services::*;

use crate::process::{send_signal, Host, Signal};

/// What the tests do to a running [`Service`] besides what `edge run` does.
pub trait ServiceTestExt {
    /// `http://<its address><path>`.
    fn url(&self, path: &str) -> String;

    /// Its whole log.
    fn log(&self) -> String;

    /// SIGKILL, as a crash would.
    fn kill(&mut self);

    fn pid(&self) -> Option<u32>;

    /// Sends `signal` (SIGSTOP, SIGCONT, SIGHUP, ...): a process frozen alive, as a long GC
    /// pause or a stalled host would leave it, or told to reload.
    fn signal(&self, signal: Signal) -> Result<(), String>;
}

impl ServiceTestExt for Service {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    fn kill(&mut self) {
        self.child.kill();
    }

    fn pid(&self) -> Option<u32> {
        self.child.pid()
    }

    fn signal(&self, signal: Signal) -> Result<(), String> {
        let pid = self
            .child
            .pid()
            .ok_or_else(|| format!("{} is not running", self.name))?;
        send_signal(pid, signal).map_err(|e| format!("{}: {e}", self.name))
    }
}

/// The demo checkout on loopback.
pub fn start_checkout(port: u16, dir: &Path) -> Result<Service, String> {
    start_checkout_on(&Host::loopback(), port, dir)
}

/// The demo checkout on `host`.
pub fn start_checkout_on(host: &Host, port: u16, dir: &Path) -> Result<Service, String> {
    let addr = host.addr(port);
    Service::start_with(
        "checkout",
        host,
        addr,
        &[("CHECKOUT_LISTEN", addr.to_string())],
        dir,
        Ready::Http("/healthz"),
    )
}
