//! Hosts of their own on this machine, for the partition tests (issue 35).
//!
//! Each host is a network namespace with one address on one bridge. The bridge lives in a
//! namespace of its own (the *switch*), not in the root namespace, where another tool's
//! iptables rules (dockerd's) could see or change the traffic. A link is cut by an nftables
//! drop rule on the switch, in one direction or both (on one port, when given), and healed by
//! removing it; [`Network::prove_cut`] shows a cut is real (a TCP connect across it fails and
//! its rule counted dropped packets), not a sleep.
//!
//! Processes run on a host through [`NetHost::host`] (`ip netns exec <namespace>` as the
//! prefix of their command); the test's own code runs on a host by moving its thread there
//! ([`NetHost::run`], [`Network::enter`]): a socket belongs to the namespace of the thread
//! that opened it, and a thread or process inherits the namespace of the thread that made it.
//!
//! Every host and rule is removed when the [`Network`] is dropped (also after a failed test);
//! a watchdog process removes them when this process is interrupted or killed; and a start
//! sweeps away what an earlier run left when even its watchdog was killed.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::process::{spawn_watchdog, ChildGuard, Host};

/// Every namespace of a run is named `<PREFIX><pid>-<host>`: a later run finds the leftovers of
/// a dead one by it.
const PREFIX: &str = "idp";
/// The bridge inside the switch namespace.
const BRIDGE: &str = "br0";
/// The hosts' network: 10.77.0.0/24 (it exists only inside the switch, so runs do not clash).
const SUBNET: [u8; 3] = [10, 77, 0];
/// The nftables table and chain on the switch that hold the cuts.
const TABLE: &str = "partitions";
const CHAIN: &str = "links";

/// Why the partition tests cannot run here, or what failed while setting hosts up.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(
        "the partition tests need root (network namespaces, veth pairs, nftables): \
         run `sudo make chaos-net`, or `sudo -E cargo test -p stack --test partitions`"
    )]
    NotRoot,
    #[error("`{0}` not found: the partition tests need iproute2 and nftables (apt-get install -y iproute2 nftables)")]
    Missing(&'static str),
    #[error("`{command}` failed: {why}")]
    Command { command: String, why: String },
    #[error("no host named {0}")]
    NoHost(String),
    #[error("cannot move a thread into namespace {netns}: {why}")]
    Setns { netns: String, why: String },
}

/// One host: its namespace and its address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetHost {
    pub name: String,
    pub netns: String,
    pub address: Ipv4Addr,
}

impl NetHost {
    /// Where a launcher runs a process on this host.
    pub fn host(&self) -> Host {
        Host {
            address: self.address.into(),
            prefix: vec![
                "ip".into(),
                "netns".into(),
                "exec".into(),
                self.netns.clone(),
            ],
        }
    }

    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.address, port))
    }

    /// Runs `f` on a thread of its own inside this host's namespace: what it connects to or
    /// binds, and every thread or process it starts, is on this host.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NetError> {
        std::thread::scope(|s| {
            s.spawn(|| {
                enter_netns(&self.netns)?;
                Ok(f())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// Whether a TCP connection from this host to `to` is accepted within `timeout`: the proof
    /// that a link works, or (an error) that it is cut.
    pub fn connect(&self, to: SocketAddr, timeout: Duration) -> Result<(), String> {
        self.run(|| TcpStream::connect_timeout(&to, timeout).map(drop))
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("{} -> {to}: {e}", self.name))
    }
}

/// Which packets a cut drops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub from: String,
    pub to: String,
    /// Only packets to this port of `to` (and, both ways, its answers).
    pub port: Option<u16>,
    /// Both directions, or only `from` → `to`.
    pub both_ways: bool,
}

impl Link {
    /// Nothing passes between `a` and `b`.
    pub fn both(a: &str, b: &str) -> Self {
        Self {
            from: a.to_owned(),
            to: b.to_owned(),
            port: None,
            both_ways: true,
        }
    }

    /// Packets from `from` to `to` are dropped; the other way passes.
    pub fn one_way(from: &str, to: &str) -> Self {
        Self {
            both_ways: false,
            ..Self::both(from, to)
        }
    }

    /// Only this port of `to`.
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    pub fn describe(&self) -> String {
        let port = self.port.map(|p| format!(":{p}")).unwrap_or_default();
        let arrow = if self.both_ways { "<->" } else { "->" };
        format!("{}{arrow}{}{port}", self.from, self.to)
    }
}

/// A cut in place: its rules' comments on the switch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    pub id: u64,
    pub link: Link,
}

/// The hosts of one run, their switch and its cuts.
pub struct Network {
    tag: String,
    switch: String,
    hosts: Vec<NetHost>,
    cuts: Mutex<(u64, BTreeMap<u64, Link>)>,
    /// The namespace this process started in, to go back to.
    home: Option<File>,
    watchdog: Option<ChildGuard>,
}

impl Network {
    /// A switch and one host per name (addresses .2, .3, ... in that order); leftovers of dead
    /// runs are swept first.
    pub fn start(names: &[&str]) -> Result<Self, NetError> {
        require()?;
        sweep_leftovers();
        let tag = format!("{PREFIX}{}", std::process::id());
        let switch = format!("{tag}-switch");
        let mut net = Self {
            switch: switch.clone(),
            hosts: Vec::new(),
            cuts: Mutex::new((0, BTreeMap::new())),
            home: None,
            watchdog: None,
            tag,
        };
        // The watchdog first: whatever is made after it is removed even if this run is killed.
        net.watchdog = Some(
            spawn_watchdog(
                "netns-watchdog",
                WATCHDOG,
                std::path::Path::new(&net.tag),
                true,
            )
            .map_err(|why| NetError::Command {
                command: "sh (the watchdog)".into(),
                why,
            })?,
        );
        run("ip", &["netns", "add", &switch])?;
        ip_in(&switch, &["link", "add", BRIDGE, "type", "bridge"])?;
        ip_in(&switch, &["link", "set", BRIDGE, "up"])?;
        ip_in(&switch, &["link", "set", "lo", "up"])?;
        nft_in(
            &switch,
            &format!(
                "add table bridge {TABLE}\n\
                 add chain bridge {TABLE} {CHAIN} {{ type filter hook forward priority 0; policy accept; }}\n"
            ),
        )?;
        for (i, name) in names.iter().enumerate() {
            let host = NetHost {
                name: (*name).to_owned(),
                netns: format!("{}-{name}", net.tag),
                address: Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], 2 + i as u8),
            };
            net.add_host(&host, i)?;
            net.hosts.push(host);
        }
        Ok(net)
    }

    fn add_host(&self, host: &NetHost, i: usize) -> Result<(), NetError> {
        let port = format!("p{i}");
        run("ip", &["netns", "add", &host.netns])?;
        ip_in(
            &self.switch,
            &[
                "link",
                "add",
                &port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &host.netns,
            ],
        )?;
        ip_in(&self.switch, &["link", "set", &port, "master", BRIDGE])?;
        ip_in(&self.switch, &["link", "set", &port, "up"])?;
        ip_in(
            &host.netns,
            &[
                "addr",
                "add",
                &format!("{}/24", host.address),
                "dev",
                "eth0",
            ],
        )?;
        ip_in(&host.netns, &["link", "set", "eth0", "up"])?;
        ip_in(&host.netns, &["link", "set", "lo", "up"])?;
        Ok(())
    }

    pub fn host(&self, name: &str) -> Result<&NetHost, NetError> {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .ok_or_else(|| NetError::NoHost(name.to_owned()))
    }

    pub fn hosts(&self) -> &[NetHost] {
        &self.hosts
    }

    /// Who Postgres on these hosts trusts: the hosts' network.
    pub fn subnet(&self) -> String {
        format!("{}.{}.{}.0/24", SUBNET[0], SUBNET[1], SUBNET[2])
    }

    /// Moves the calling thread (and every thread and process it makes from now on) onto host
    /// `name`: the harness's own host. Dropping the network moves it back.
    pub fn enter(&mut self, name: &str) -> Result<(), NetError> {
        if self.home.is_none() {
            self.home =
                Some(
                    File::open("/proc/thread-self/ns/net").map_err(|e| NetError::Setns {
                        netns: "(this process's own)".into(),
                        why: e.to_string(),
                    })?,
                );
        }
        let netns = self.host(name)?.netns.clone();
        enter_netns(&netns)
    }

    /// Cuts `link`: from now on its packets are dropped on the switch.
    pub fn cut(&self, link: Link) -> Result<Cut, NetError> {
        let from = self.host(&link.from)?.address;
        let to = self.host(&link.to)?.address;
        let id = {
            let mut cuts = self.cuts.lock().unwrap_or_else(|p| p.into_inner());
            cuts.0 += 1;
            cuts.0
        };
        let (dport, sport) = match link.port {
            Some(p) => (format!("tcp dport {p} "), format!("tcp sport {p} ")),
            None => (String::new(), String::new()),
        };
        let mut script = format!(
            "add rule bridge {TABLE} {CHAIN} ip saddr {from} ip daddr {to} {dport}counter drop comment \"cut-{id}\"\n"
        );
        if link.both_ways {
            script.push_str(&format!(
                "add rule bridge {TABLE} {CHAIN} ip saddr {to} ip daddr {from} {sport}counter drop comment \"cut-{id}\"\n"
            ));
        }
        nft_in(&self.switch, &script)?;
        self.cuts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .insert(id, link.clone());
        Ok(Cut { id, link })
    }

    /// Removes the rules of `cut`: its link works again.
    pub fn heal(&self, cut: &Cut) -> Result<(), NetError> {
        for (handle, _) in self.rules_of(cut.id)? {
            nft_in(
                &self.switch,
                &format!("delete rule bridge {TABLE} {CHAIN} handle {handle}\n"),
            )?;
        }
        self.cuts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .remove(&cut.id);
        Ok(())
    }

    /// Heals every cut.
    pub fn heal_all(&self) -> Result<(), NetError> {
        nft_in(
            &self.switch,
            &format!("flush chain bridge {TABLE} {CHAIN}\n"),
        )?;
        self.cuts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clear();
        Ok(())
    }

    /// The cuts in place.
    pub fn cuts(&self) -> Vec<Cut> {
        self.cuts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .iter()
            .map(|(id, link)| Cut {
                id: *id,
                link: link.clone(),
            })
            .collect()
    }

    /// How many packets the rules of `cut` dropped so far.
    pub fn dropped(&self, cut: &Cut) -> Result<u64, NetError> {
        Ok(self.rules_of(cut.id)?.iter().map(|(_, n)| n).sum())
    }

    /// Shows that `cut` is in force: a TCP connect from `from` to `to` (a listening port on
    /// the other side) fails within a second, and the cut's rules counted dropped packets.
    pub fn prove_cut(&self, cut: &Cut, from: &str, to: SocketAddr) -> Result<u64, String> {
        let before = self.dropped(cut).map_err(|e| e.to_string())?;
        let host = self.host(from).map_err(|e| e.to_string())?;
        if host.connect(to, Duration::from_secs(1)).is_ok() {
            return Err(format!(
                "cut {} is not in force: {from} -> {to} connected",
                cut.link.describe()
            ));
        }
        let after = self.dropped(cut).map_err(|e| e.to_string())?;
        if after <= before {
            return Err(format!(
                "cut {}: the connect from {from} to {to} failed, but the cut's rules dropped nothing \
                 (something else broke the link)",
                cut.link.describe()
            ));
        }
        Ok(after)
    }

    /// Shows that a link works: a TCP connect from `from` to `to` succeeds, retried for up to
    /// `within` (a healed link may take a moment: ARP).
    pub fn prove_works(&self, from: &str, to: SocketAddr, within: Duration) -> Result<(), String> {
        let host = self.host(from).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + within;
        loop {
            match host.connect(to, Duration::from_secs(1)) {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// (handle, packets dropped) of each rule of cut `id`.
    fn rules_of(&self, id: u64) -> Result<Vec<(u64, u64)>, NetError> {
        let out = output(
            Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &self.switch,
                    "nft",
                    "-j",
                    "-a",
                    "list",
                    "chain",
                ])
                .args(["bridge", TABLE, CHAIN]),
        )?;
        let json: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        let wanted = format!("cut-{id}");
        Ok(json["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|item| item.get("rule"))
            .filter(|rule| rule["comment"] == wanted.as_str())
            .filter_map(|rule| {
                let handle = rule["handle"].as_u64()?;
                let packets = rule["expr"]
                    .as_array()?
                    .iter()
                    .find_map(|e| e["counter"]["packets"].as_u64())
                    .unwrap_or(0);
                Some((handle, packets))
            })
            .collect())
    }

    /// Kills what still runs on the hosts and removes every namespace of this run.
    fn remove(&mut self) {
        if let Some(home) = self.home.take() {
            // SAFETY: setns with a namespace file we opened; it only moves this thread.
            unsafe { libc::setns(home.as_raw_fd(), libc::CLONE_NEWNET) };
        }
        remove_run(&self.tag);
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        self.remove();
        if let Some(mut w) = self.watchdog.take() {
            w.kill();
        }
    }
}

/// The watchdog: `sh -c WATCHDOG name <our pid> <tag> remove`. It ignores the signals an
/// interrupt sends to the whole process group and waits for this process to end. Then it kills
/// what runs on this run's hosts, except the parts' own watchdogs (the HA cluster's, which
/// remove their folders once nothing writes to them any more), waits for those, and removes
/// the hosts.
const WATCHDOG: &str = r#"
    trap '' INT TERM HUP
    owner="$1"
    while kill -0 "$owner" 2>/dev/null; do sleep 0.5; done
    # Other watchdogs of the same owner (ours, and its subshells, are netns-watchdog).
    others() { pgrep -f -- "-watchdog $owner " | while read -r p; do
        grep -qa netns-watchdog "/proc/$p/cmdline" 2>/dev/null || echo "$p"; done; }
    spared=" $(others | tr '\n' ' ') "
    for ns in $(ip netns list | awk '{print $1}' | grep "^$2-"); do
        for p in $(ip netns pids "$ns"); do
            case "$spared" in *" $p "*) ;; *) kill -KILL "$p" 2>/dev/null ;; esac
        done
    done
    for i in $(seq 40); do [ -n "$(others)" ] || break; sleep 0.5; done
    for ns in $(ip netns list | awk '{print $1}' | grep "^$2-"); do ip netns del "$ns"; done
"#;

/// Root, `ip` and `nft`, or a message that says what is missing.
pub fn require() -> Result<(), NetError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(NetError::NotRoot);
    }
    for (tool, probe) in [("ip", ["-V"]), ("nft", ["--version"])] {
        let found = Command::new(tool)
            .args(probe)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Err(NetError::Missing(tool));
        }
    }
    Ok(())
}

/// Namespaces of runs whose process is gone (killed with their watchdog): their processes are
/// killed and the namespaces removed.
pub fn sweep_leftovers() -> Vec<String> {
    let list = output(Command::new("ip").args(["netns", "list"])).unwrap_or_default();
    let mut dead_tags: Vec<String> = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|ns| {
            let pid: u32 = ns.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()?;
            let alive = std::path::Path::new(&format!("/proc/{pid}")).exists();
            (!alive).then(|| format!("{PREFIX}{pid}"))
        })
        .collect();
    dead_tags.sort();
    dead_tags.dedup();
    for tag in &dead_tags {
        eprintln!("netns: removing the hosts a dead run left behind ({tag}-*)");
        remove_run(tag);
    }
    dead_tags
}

/// Kills every process on the namespaces `<tag>-*` and removes them.
fn remove_run(tag: &str) {
    let namespaces: Vec<String> = output(Command::new("ip").args(["netns", "list"]))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|ns| ns.starts_with(&format!("{tag}-")))
        .map(str::to_owned)
        .collect();
    let mut killed = false;
    for ns in &namespaces {
        let pids = output(Command::new("ip").args(["netns", "pids", ns])).unwrap_or_default();
        for pid in pids.split_whitespace() {
            killed = true;
            let _ =
                crate::process::send_signal(pid.parse().unwrap_or(0), crate::process::Signal::KILL);
        }
    }
    if killed {
        std::thread::sleep(Duration::from_millis(300));
    }
    for ns in &namespaces {
        let _ = run("ip", &["netns", "del", ns]);
    }
}

/// Moves the calling thread into network namespace `netns`.
pub(crate) fn enter_netns(netns: &str) -> Result<(), NetError> {
    let err = |why: String| NetError::Setns {
        netns: netns.to_owned(),
        why,
    };
    let file = File::open(format!("/run/netns/{netns}")).map_err(|e| err(e.to_string()))?;
    // SAFETY: setns with a namespace file we opened; it only moves the calling thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(err(std::io::Error::last_os_error().to_string()));
    }
    Ok(())
}

fn ip_in(netns: &str, args: &[&str]) -> Result<(), NetError> {
    let mut all = vec!["-n", netns];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// Runs an nft script inside `netns`.
fn nft_in(netns: &str, script: &str) -> Result<(), NetError> {
    let out = crate::process::run_with_stdin(
        "ip",
        &["netns", "exec", netns, "nft", "-f", "-"],
        script.as_bytes(),
    );
    out.map(drop).map_err(|why| NetError::Command {
        command: format!("nft -f - in {netns}: {}", script.trim()),
        why,
    })
}

fn run(program: &str, args: &[&str]) -> Result<(), NetError> {
    output(Command::new(program).args(args)).map(drop)
}

fn output(cmd: &mut Command) -> Result<String, NetError> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NetError::Command {
            command: format!("{cmd:?}"),
            why: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(NetError::Command {
            command: format!("{cmd:?}"),
            why: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
