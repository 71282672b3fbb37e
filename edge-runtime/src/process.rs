//! Child processes that die with their owner, the host they run on, and signals sent to
//! processes.
//!
//! Signals go through the kernel (`kill(2)` via rustix), never through a `kill` command: the
//! slim container image has no procps, and a stop that was not delivered must be seen.

use std::ffi::OsStr;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command};

pub use rustix::process::Signal;

/// Why a signal was not delivered.
#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("process {pid} does not exist (it ended already)")]
    Gone { pid: u32 },
    #[error("cannot send signal {signal:?} to process {pid}: {source}")]
    Refused {
        pid: u32,
        signal: Signal,
        source: std::io::Error,
    },
    #[error("{pid} is not a process id")]
    InvalidPid { pid: u32 },
}

/// How a process ended when it was asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// It exited within the grace period after SIGTERM.
    Cleanly,
    /// It was still running at the end of the grace period (or SIGTERM could not be
    /// delivered) and was SIGKILLed.
    Killed,
    /// There was nothing to stop.
    NotRunning,
}

/// Where a process runs and answers: this machine's loopback (what every launcher does unless
/// told otherwise), or a host of its own with its own address, such as a network namespace of
/// the partition tests, whose programs are started through a prefix (`ip netns exec <name>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    pub address: IpAddr,
    /// The command a program is run through on this host (empty: run it directly).
    pub prefix: Vec<String>,
}

impl Default for Host {
    fn default() -> Self {
        Self::loopback()
    }
}

impl Host {
    /// 127.0.0.1, programs run directly.
    pub fn loopback() -> Self {
        Self {
            address: IpAddr::V4(Ipv4Addr::LOCALHOST),
            prefix: Vec::new(),
        }
    }

    /// `port` at this host's address.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.address, port)
    }

    /// A command that runs `program` on this host.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        self.command_as(program, None)
    }

    /// The same, as the unprivileged user `run_as` (uid, gid) when given. A prefix such as
    /// `ip netns exec` needs root, so there the user changes after it, through `setpriv`.
    pub fn command_as(&self, program: impl AsRef<OsStr>, run_as: Option<(u32, u32)>) -> Command {
        let Some((first, rest)) = self.prefix.split_first() else {
            let mut cmd = Command::new(program);
            if let Some((uid, gid)) = run_as {
                use std::os::unix::process::CommandExt as _;
                cmd.uid(uid).gid(gid);
            }
            return cmd;
        };
        let mut cmd = Command::new(first);
        cmd.args(rest);
        if let Some((uid, gid)) = run_as {
            cmd.args([
                "setpriv".to_owned(),
                format!("--reuid={uid}"),
                format!("--regid={gid}"),
                "--clear-groups".to_owned(),
                "--".to_owned(),
            ]);
        }
        cmd.arg(program);
        cmd
    }
}

/// A spawned process, killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct ChildGuard {
    pub name: String,
    child: Option<Child>,
}

impl ChildGuard {
    pub fn spawn(name: &str, cmd: &mut Command) -> Result<Self, String> {
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {name} ({cmd:?}): {e}"))?;
        Ok(Self {
            name: name.to_owned(),
            child: Some(child),
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then wait up to `grace` for a clean exit, then SIGKILL; says which it took.
    pub fn terminate(&mut self, grace: std::time::Duration) -> Stopped {
        self.stop_with(Signal::TERM, grace)
    }

    /// `signal` (SIGTERM, or SIGINT for Postgres's fast shutdown), then wait up to `grace`
    /// for the process to exit, then SIGKILL.
    pub fn stop_with(&mut self, signal: Signal, grace: std::time::Duration) -> Stopped {
        let Some(c) = self.child.as_mut() else {
            return Stopped::NotRunning;
        };
        if let Ok(Some(_)) = c.try_wait() {
            self.child = None;
            return Stopped::NotRunning;
        }
        // Not delivered (a zombie that just exited is reaped below): waiting is pointless.
        let delivered = send_signal(c.id(), signal).is_ok();
        let deadline = std::time::Instant::now() + grace;
        while delivered && std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                self.child = None;
                return Stopped::Cleanly;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if let Ok(Some(_)) = c.try_wait() {
            self.child = None;
            return Stopped::Cleanly;
        }
        self.kill();
        Stopped::Killed
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends `signal` to process `pid` (`kill(2)`); whether it was delivered.
pub fn send_signal(pid: u32, signal: Signal) -> Result<(), SignalError> {
    let raw = i32::try_from(pid).map_err(|_| SignalError::InvalidPid { pid })?;
    let target = rustix::process::Pid::from_raw(raw).ok_or(SignalError::InvalidPid { pid })?;
    rustix::process::kill_process(target, signal).map_err(|e| {
        if e == rustix::io::Errno::SRCH {
            SignalError::Gone { pid }
        } else {
            SignalError::Refused {
                pid,
                signal,
                source: e.into(),
            }
        }
    })
}

/// A shell running `script` as `sh -c script name <our pid> <root> remove|keep`: it waits for
/// this process to end, then stops what it was told to and, when asked, removes `root` (a
/// cluster that lives in a `static` is never dropped).
pub fn spawn_watchdog(
    name: &str,
    script: &str,
    root: &std::path::Path,
    remove: bool,
) -> Result<ChildGuard, String> {
    use std::process::Stdio;
    let mut cmd = Command::new("sh");
    // `sh -c script name a b c`: $0 = name, $1.. = the rest.
    cmd.args(["-c", script, name])
        .arg(std::process::id().to_string())
        .arg(root)
        .arg(if remove { "remove" } else { "keep" })
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    ChildGuard::spawn(name, &mut cmd)
}

/// The workspace root (the parent of this crate's folder).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A built binary of this workspace: `<NAME>_BIN` (e.g. `STATE_API_BIN`) when set; else the one
/// beside the running executable (unless `STACK_PROFILE` names a profile); else
/// `target/<profile>/<name>` (profile from `STACK_PROFILE`, default `debug`, honouring
/// CARGO_TARGET_DIR).
pub fn workspace_binary(name: &str) -> Result<PathBuf, String> {
    let env_name = format!("{}_BIN", name.to_uppercase().replace('-', "_"));
    if let Ok(p) = std::env::var(&env_name) {
        return Ok(PathBuf::from(p));
    }
    // Installed side by side (`edge` and `state-api` in one folder, as cargo builds them).
    if std::env::var("STACK_PROFILE").is_err() {
        if let Some(beside) = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join(name)))
            .filter(|p| p.is_file())
        {
            return Ok(beside);
        }
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("target"));
    let profile = std::env::var("STACK_PROFILE").unwrap_or_else(|_| "debug".into());
    let p = target.join(&profile).join(name);
    if p.is_file() {
        return Ok(p);
    }
    Err(format!(
        "the `{name}` binary is not built ({} missing): run `make build` (or `cargo build -p {name}`), or set {env_name}",
        p.display()
    ))
}

/// The last lines of a log file (each cut to 300 characters), for failure messages.
pub fn log_tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<String> = text
        .lines()
        .map(|l| l.chars().take(300).collect())
        .collect();
    let from = lines.len().saturating_sub(30);
    format!(
        "--- last lines of {} ---\n{}",
        path.display(),
        lines[from..].join("\n")
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::time::Duration;

    fn sleeper() -> ChildGuard {
        ChildGuard::spawn("sleep", Command::new("sleep").arg("30")).unwrap()
    }

    #[test]
    fn signals_reach_the_process_and_a_stop_says_how_it_ended() {
        let mut child = sleeper();
        let pid = child.pid().unwrap();
        send_signal(pid, Signal::STOP).unwrap();
        send_signal(pid, Signal::CONT).unwrap();
        assert_eq!(child.terminate(Duration::from_secs(5)), Stopped::Cleanly);
        assert_eq!(child.terminate(Duration::from_secs(5)), Stopped::NotRunning);
        assert!(matches!(
            send_signal(pid, Signal::TERM),
            Err(SignalError::Gone { .. })
        ));
    }

    #[test]
    fn a_process_that_ignores_sigterm_is_killed_after_the_grace() {
        let mut child = ChildGuard::spawn(
            "sh",
            Command::new("sh").args(["-c", "trap '' TERM; while :; do sleep 0.1; done"]),
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(child.terminate(Duration::from_millis(300)), Stopped::Killed);
    }

    fn argv(cmd: &Command) -> Vec<String> {
        std::iter::once(cmd.get_program())
            .chain(cmd.get_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn a_host_runs_its_programs_through_its_prefix_and_changes_user_after_it() {
        assert_eq!(argv(&Host::loopback().command("etcd")), ["etcd"]);
        let host = Host {
            address: "10.77.0.9"
                .parse()
                .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            prefix: vec!["ip".into(), "netns".into(), "exec".into(), "pg1".into()],
        };
        assert_eq!(host.addr(5432).to_string(), "10.77.0.9:5432");
        assert_eq!(
            argv(&host.command("etcd")),
            ["ip", "netns", "exec", "pg1", "etcd"]
        );
        assert_eq!(
            argv(&host.command_as("patroni", Some((105, 110)))),
            [
                "ip",
                "netns",
                "exec",
                "pg1",
                "setpriv",
                "--reuid=105",
                "--regid=110",
                "--clear-groups",
                "--",
                "patroni"
            ]
        );
    }
}
