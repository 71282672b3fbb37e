//! What /proc says about the processes under test: who listens on a port, memory high-water
//! marks, CPU time (per process, per thread, and for the whole machine).

use std::collections::BTreeMap;
use std::fs;

/// The pid that holds a listening TCP socket on 127.0.0.1:`port` (or 0.0.0.0).
pub fn pid_listening_on(port: u16) -> Option<u32> {
    let inodes = listening_inodes(port);
    if inodes.is_empty() {
        return None;
    }
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = fs::read_link(fd.path()) {
                let t = target.to_string_lossy();
                if let Some(inode) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                    if inodes.iter().any(|i| i == inode) {
                        return Some(pid);
                    }
                }
            }
        }
    }
    None
}

fn listening_inodes(port: u16) -> Vec<String> {
    let text = fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let want = format!(":{port:04X}");
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // local_address rem_address st ... inode (field 9); 0A = LISTEN
            (f.len() > 9 && f[1].ends_with(&want) && f[3] == "0A").then(|| f[9].to_owned())
        })
        .collect()
}

/// A field of /proc/<pid>/status in KiB (e.g. `VmHWM`, `VmRSS`).
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field).and_then(|r| r.strip_prefix(':')))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Fields of a /proc/.../stat line after the `(comm)`: index 0 is the state (field 3).
fn stat_fields(path: &str) -> Option<(String, Vec<u64>)> {
    let text = fs::read_to_string(path).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text[open + 1..close].to_owned();
    let nums = text[close + 2..]
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse::<i64>().unwrap_or(0).max(0) as u64)
        .collect();
    Some((comm, nums))
}

// After the state field: ppid is field 4 (index 0 here), utime 14 (10), stime 15 (11),
// cutime 16 (12), cstime 17 (13).
const PPID: usize = 0;
const UTIME: usize = 10;
const STIME: usize = 11;
const CUTIME: usize = 12;
const CSTIME: usize = 13;

/// CPU ticks used by a process (user + system), optionally with its reaped children.
pub fn cpu_ticks(pid: u32, with_reaped_children: bool) -> u64 {
    stat_fields(&format!("/proc/{pid}/stat"))
        .map(|(_, f)| {
            let own = f.get(UTIME).copied().unwrap_or(0) + f.get(STIME).copied().unwrap_or(0);
            let reaped = if with_reaped_children {
                f.get(CUTIME).copied().unwrap_or(0) + f.get(CSTIME).copied().unwrap_or(0)
            } else {
                0
            };
            own + reaped
        })
        .unwrap_or(0)
}

/// Live children of `pid`.
pub fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Some((_, f)) = stat_fields(&format!("/proc/{child}/stat")) {
            if f.get(PPID).copied() == Some(u64::from(pid)) {
                out.push(child);
            }
        }
    }
    out
}

/// CPU ticks of a process and all its live children, plus the children it has reaped
/// (Postgres: the postmaster and its backends).
pub fn tree_ticks(pid: u32) -> u64 {
    cpu_ticks(pid, true)
        + children(pid)
            .into_iter()
            .map(|c| cpu_ticks(c, false))
            .sum::<u64>()
}

/// CPU ticks per thread name (threads of the same name summed), e.g. Envoy's `wrk:worker_0`.
pub fn thread_ticks(pid: u32) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for entry in fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Some((comm, f)) = stat_fields(&format!("{}/stat", entry.path().display())) {
            *out.entry(comm).or_default() +=
                f.get(UTIME).copied().unwrap_or(0) + f.get(STIME).copied().unwrap_or(0);
        }
    }
    out
}

/// The machine's CPU ticks by kind (user, nice, system, idle, iowait, irq, softirq, ...), from
/// the first line of /proc/stat; empty when it cannot be read.
fn machine_cpu_ticks() -> Vec<u64> {
    let text = fs::read_to_string("/proc/stat").unwrap_or_default();
    text.lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect()
}

/// (busy, total) ticks of the whole machine.
pub fn machine_ticks() -> (u64, u64) {
    let nums = machine_cpu_ticks();
    let total: u64 = nums.iter().take(8).sum();
    // idle + iowait
    let idle = nums.get(3).copied().unwrap_or(0) + nums.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

/// Interrupt and softirq ticks of the whole machine (mostly loopback TCP here).
pub fn irq_ticks() -> u64 {
    let nums = machine_cpu_ticks();
    nums.get(5).copied().unwrap_or(0) + nums.get(6).copied().unwrap_or(0)
}

/// Ticks in which the hypervisor ran other guests while this VM's CPUs wanted to run (steal).
pub fn steal_ticks() -> u64 {
    machine_cpu_ticks().get(7).copied().unwrap_or(0)
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 on Linux).
pub fn clk_tck() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// The 1-minute load average.
pub fn loadavg() -> (f64, f64, f64) {
    let text = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let v: Vec<f64> = text
        .split_whitespace()
        .take(3)
        .filter_map(|s| s.parse().ok())
        .collect();
    (
        v.first().copied().unwrap_or(0.0),
        v.get(1).copied().unwrap_or(0.0),
        v.get(2).copied().unwrap_or(0.0),
    )
}

pub fn cpu_count() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
