//! Postgres crash recovery *in place*, held open on purpose: a backend is SIGKILLed (as an OOM
//! kill or a segfault would end it), the postmaster stops every other backend and reinitialises
//! without restarting (neither `pg_postmaster_start_time()` nor the timeline changes), and its
//! startup process replays the WAL. [`crash_and_hold_recovery`] catches that startup process and
//! stops it (SIGSTOP), so the database stays in recovery for as long as the test wants;
//! [`HeldRecovery::release`] lets it finish.
//!
//! Processes are signalled one by one (`rustix`), never by name.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::process::{send_signal, Signal};

/// How long the postmaster may take to stop its children and start the startup process.
const CATCH_WITHIN: Duration = Duration::from_secs(20);

/// Sends `signal` to the process `pid` ([`send_signal`], its error as text).
fn signal(pid: u32, signal: Signal) -> Result<(), String> {
    send_signal(pid, signal).map_err(|e| e.to_string())
}

/// The children of `parent` with their command lines (`postgres: startup recovering ...`,
/// `postgres: postgres stack_db 127.0.0.1(4242) idle`, ...). Linux only: it reads
/// `/proc/<pid>/task/<pid>/children`.
pub fn children(parent: u32) -> Result<Vec<(u32, String)>, String> {
    let list = PathBuf::from(format!("/proc/{parent}/task/{parent}/children"));
    let text = std::fs::read_to_string(&list).map_err(|e| {
        format!(
            "cannot read {} (a Linux kernel with CONFIG_PROC_CHILDREN is needed): {e}",
            list.display()
        )
    })?;
    Ok(text
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .filter_map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let title = String::from_utf8_lossy(&cmdline)
                .replace('\0', " ")
                .trim()
                .to_owned();
            Some((pid, title))
        })
        .collect())
}

/// The one-letter state of a process (`T` when stopped), from `/proc/<pid>/stat`.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": the comm may hold spaces and parentheses; the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// A crash recovery whose startup process is stopped.
#[derive(Debug)]
pub struct HeldRecovery {
    /// The backend that was SIGKILLed.
    pub killed_backend: u32,
    pub startup_pid: u32,
    /// Its title when caught (`postgres: startup recovering <WAL file>`).
    pub startup_title: String,
    /// From the SIGKILL to the SIGSTOP.
    pub caught_after: Duration,
    /// When it was stopped.
    pub held_since: Instant,
    released: bool,
}

impl HeldRecovery {
    /// SIGCONT: the replay goes on. Returns how long it was held.
    pub fn release(&mut self) -> Result<Duration, String> {
        signal(self.startup_pid, Signal::CONT)?;
        self.released = true;
        Ok(self.held_since.elapsed())
    }
}

impl Drop for HeldRecovery {
    /// Never leaves a server stopped behind a failed test.
    fn drop(&mut self) {
        if !self.released {
            let _ = signal(self.startup_pid, Signal::CONT);
        }
    }
}

/// SIGKILLs one backend of the postmaster `postmaster` whose title contains `backend_of` (a
/// database name: a connection of the state API's pool), then polls the postmaster's children
/// until the startup process appears and stops it (SIGSTOP). Errors when no such backend runs,
/// or when the replay ended before it could be caught (write more WAL before the kill).
pub fn crash_and_hold_recovery(postmaster: u32, backend_of: &str) -> Result<HeldRecovery, String> {
    let before = children(postmaster)?;
    let (backend, _) = before
        .iter()
        .find(|(_, title)| title.contains(backend_of))
        .ok_or_else(|| {
            format!("no backend of {backend_of} among the postmaster's children: {before:?}")
        })?;
    let killed_backend = *backend;
    signal(killed_backend, Signal::KILL)?;
    let killed_at = Instant::now();
    while killed_at.elapsed() < CATCH_WITHIN {
        for (pid, title) in children(postmaster)? {
            if title.starts_with("postgres: startup") {
                signal(pid, Signal::STOP)?;
                wait_stopped(pid)?;
                return Ok(HeldRecovery {
                    killed_backend,
                    startup_pid: pid,
                    startup_title: title,
                    caught_after: killed_at.elapsed(),
                    held_since: Instant::now(),
                    released: false,
                });
            }
        }
        // A tight poll: the replay of a few hundred MB of WAL takes about a second.
        std::thread::sleep(Duration::from_micros(200));
    }
    Err(format!(
        "no startup process within {CATCH_WITHIN:?} of the SIGKILL of backend {killed_backend}: \
         the replay may have ended before it was caught (write more WAL before the kill)"
    ))
}

/// Waits until `pid` is stopped (a signal is delivered asynchronously).
fn wait_stopped(pid: u32) -> Result<(), String> {
    let asked = Instant::now();
    loop {
        match process_state(pid) {
            Some('T') => return Ok(()),
            None => return Err(format!("process {pid} ended before it stopped")),
            Some(other) if asked.elapsed() > Duration::from_secs(2) => {
                return Err(format!(
                    "process {pid} still in state {other} 2 s after SIGSTOP"
                ))
            }
            Some(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}
