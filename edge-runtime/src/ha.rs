//! Postgres that survives the loss of its primary: one etcd member, two Postgres nodes managed by
//! Patroni with synchronous replication, and HAProxy on one port routing to whichever node
//! Patroni reports as primary. All from Debian's packages (`patroni`, `etcd-server`,
//! `haproxy`), started here as plain processes (there is no service manager), as root or not:
//! when we are root, every part runs as the unprivileged `postgres` user (initdb refuses root).
//!
//! `HaCluster::start_at` keeps its folder across runs (`HA=1 make demo`); the tests make
//! throwaway ones ([`HaCluster::launch`], through crate `test-support`), stopped and removed by a
//! watchdog once the test process has exited, like a throwaway [`crate::postgres::Cluster`].
//!
//! Every part runs on loopback, or, for the partition tests, each on a host of its own
//! ([`HaHosts`]): etcd, each node (its Patroni and Postgres) and HAProxy.
//!
//! Patroni's timings are tuned for a test (`ttl` 10 s, `loop_wait` 1 s, `retry_timeout` 4 s):
//! a lost primary is replaced after about `ttl`. docs/RELIABILITY.md says what to use in
//! production.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::net::{http_get_at, wait_for_addr};
use crate::postgres::{chown_recursive, find_bin_dir, tail, unprivileged_ids};
use crate::process::{send_signal, ChildGuard, Host, Signal};

const INSTALL_HINT: &str = "HA needs Debian's `patroni`, `etcd-server` and `haproxy` packages: \
     `make tools HA=1` installs them as root, or run `sudo apt-get install -y patroni etcd-server haproxy`";

/// Patroni's leader key lifetime (s): how long a lost primary keeps it.
pub const TTL_S: u64 = 10;
/// How often each Patroni runs its loop (s).
pub const LOOP_WAIT_S: u64 = 1;

/// The ports of the parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HaPorts {
    pub etcd_client: u16,
    pub etcd_peer: u16,
    /// Patroni's REST API, per node.
    pub rest: [u16; 2],
    /// Postgres, per node.
    pub postgres: [u16; 2],
    /// HAProxy: where clients connect (the primary, whichever node that is).
    pub proxy: u16,
}

impl HaPorts {
    /// The demo's: etcd :2379/:2380, Patroni :8008/:8009, Postgres :54331/:54332, HAProxy `proxy`.
    pub fn demo(proxy: u16) -> Self {
        Self {
            etcd_client: 2379,
            etcd_peer: 2380,
            rest: [8008, 8009],
            postgres: [54331, 54332],
            proxy,
        }
    }

    /// Every port, with its name, for a check that they are free.
    pub fn all(&self) -> Vec<(&'static str, u16)> {
        vec![
            ("etcd", self.etcd_client),
            ("etcd peer", self.etcd_peer),
            ("Patroni node1 REST", self.rest[0]),
            ("Patroni node2 REST", self.rest[1]),
            ("Postgres node1", self.postgres[0]),
            ("Postgres node2", self.postgres[1]),
            ("HAProxy", self.proxy),
        ]
    }
}

/// Where each part of the cluster runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaHosts {
    pub etcd: Host,
    /// Each node: its Patroni and its Postgres.
    pub nodes: [Host; 2],
    pub haproxy: Host,
    /// Who Postgres lets in without a password (`pg_hba`), as an address range.
    pub trusted: String,
}

impl HaHosts {
    /// Everything on 127.0.0.1.
    pub fn loopback() -> Self {
        Self {
            etcd: Host::loopback(),
            nodes: [Host::loopback(), Host::loopback()],
            haproxy: Host::loopback(),
            trusted: "127.0.0.1/32".to_owned(),
        }
    }
}

/// What a node's Patroni says it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary,
    SyncStandby,
    /// Running, neither of the above (an async replica, starting, or stopped Postgres).
    Other,
    /// Its REST API does not answer.
    Down,
}

#[derive(Debug)]
struct Node {
    name: &'static str,
    dir: PathBuf,
    rest_port: u16,
    patroni: Option<ChildGuard>,
}

/// The running HA cluster (see the module docs).
#[derive(Debug)]
pub struct HaCluster {
    root: PathBuf,
    ports: HaPorts,
    hosts: HaHosts,
    run_as: Option<(u32, u32)>,
    bin: PathBuf,
    remove_on_drop: bool,
    etcd: Option<ChildGuard>,
    nodes: [Node; 2],
    haproxy: Option<ChildGuard>,
    watchdog: Option<ChildGuard>,
}

/// The programs HA needs, or how to get them.
pub fn check_installed() -> Result<(), String> {
    for program in ["patroni", "etcd", "haproxy"] {
        let found = Command::new("sh")
            .args([
                "-c",
                &format!("command -v {program} || test -x /usr/sbin/{program}"),
            ])
            .stdout(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !found {
            return Err(format!("`{program}` not found: {INSTALL_HINT}"));
        }
    }
    Ok(())
}

impl HaCluster {
    /// A cluster in `dir` that keeps its data across runs (the demo, `edge run`).
    pub fn start_at(dir: &Path, ports: HaPorts) -> Result<Self, String> {
        let root = crate::data_home::cluster_home(dir, unprivileged_ids()?, |d| {
            ["node1", "node2"]
                .iter()
                .any(|n| d.join(n).join("data/PG_VERSION").is_file())
        })?;
        Self::launch(root, ports, HaHosts::loopback(), false)
    }

    /// Starts a cluster in `root` (made) on `ports`, its parts on `hosts`; `throwaway`: initdb
    /// skips nothing, but the folder is removed when the cluster is dropped (or, never dropped,
    /// by the watchdog once this process has exited).
    pub fn launch(
        root: PathBuf,
        ports: HaPorts,
        hosts: HaHosts,
        throwaway: bool,
    ) -> Result<Self, String> {
        check_installed()?;
        let bin = find_bin_dir()?;
        let run_as = unprivileged_ids()?;
        let node = |i: usize, name| Node {
            name,
            dir: root.join(name),
            rest_port: ports.rest[i],
            patroni: None,
        };
        let mut cluster = Self {
            nodes: [node(0, "node1"), node(1, "node2")],
            root,
            ports,
            hosts,
            run_as,
            bin,
            remove_on_drop: throwaway,
            etcd: None,
            haproxy: None,
            watchdog: None,
        };
        for dir in ["etcd", "node1", "node2", "pids"] {
            let d = cluster.root.join(dir);
            fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        }
        cluster.write_configs()?;
        if let Some((uid, gid)) = run_as {
            chown_recursive(&cluster.root, uid, gid)?;
        }
        cluster.watchdog = Some(spawn_watchdog(&cluster.root, throwaway)?);
        cluster.start_etcd()?;
        cluster.start_haproxy()?;
        // Both at once: on a fresh folder one wins the initialize key and the other clones it;
        // on a kept one, the node with the newest data leads (either may have been last).
        cluster.start_node(0)?;
        cluster.start_node(1)?;
        cluster.wait_healthy(Duration::from_secs(120))?;
        Ok(cluster)
    }

    pub fn ports(&self) -> HaPorts {
        self.ports
    }

    /// The folder with every part's data, configuration and log.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// URL of database `db` through HAProxy (the primary).
    pub fn url_for(&self, db: &str) -> String {
        format!(
            "postgres://postgres@{}/{db}",
            self.hosts.haproxy.addr(self.ports.proxy)
        )
    }

    /// Runs one SQL command with `psql` through HAProxy; its unaligned output. Right after a
    /// failover HAProxy may have no primary for a moment: a connection that fails is tried
    /// again, three times at most (an SQL error is not).
    pub fn psql(&self, db: &str, sql: &str) -> Result<String, String> {
        let mut tries = 0;
        loop {
            match self.psql_at(self.hosts.haproxy.addr(self.ports.proxy), db, sql) {
                Err(e) if tries < 3 && e.contains("connection to server") => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(500));
                }
                done => return done,
            }
        }
    }

    fn psql_at(&self, at: std::net::SocketAddr, db: &str, sql: &str) -> Result<String, String> {
        let out = Command::new(self.bin.join("psql"))
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d"])
            .arg(format!("postgres://postgres@{at}/{db}?connect_timeout=3"))
            .args(["-c", sql])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run psql: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "psql failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Creates database `name` unless it exists; its URL (through HAProxy).
    pub fn ensure_database(&self, name: &str) -> Result<String, String> {
        if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') || name.is_empty() {
            return Err(format!("invalid database name {name:?}"));
        }
        let exists = self.psql(
            "postgres",
            &format!("SELECT 1 FROM pg_database WHERE datname = '{name}'"),
        )?;
        if exists != "1" {
            self.psql("postgres", &format!("CREATE DATABASE \"{name}\""))?;
        }
        Ok(self.url_for(name))
    }

    /// What node `i`'s Patroni says it is.
    pub fn role(&self, i: usize) -> Role {
        let rest = self.hosts.nodes[i].addr(self.nodes[i].rest_port);
        if http_get_at(rest, "/primary").is_ok() {
            return Role::Primary;
        }
        if http_get_at(rest, "/synchronous").is_ok() {
            return Role::SyncStandby;
        }
        match http_get_at(rest, "/health") {
            Err(e) if e.contains("refused") || e.contains("os error") => Role::Down,
            _ => Role::Other,
        }
    }

    /// The node that leads, if one does.
    pub fn leader(&self) -> Option<usize> {
        (0..2).find(|&i| self.role(i) == Role::Primary)
    }

    /// True when one node leads and the other is its synchronous standby.
    pub fn is_healthy(&self) -> bool {
        match self.leader() {
            Some(l) => self.role(1 - l) == Role::SyncStandby,
            None => false,
        }
    }

    /// Waits for a primary with a synchronous standby, and for HAProxy to route to it.
    pub fn wait_healthy(&self, timeout: Duration) -> Result<usize, String> {
        self.wait_for(timeout, "a primary with a synchronous standby", |c| {
            c.is_healthy()
                && c.psql("postgres", "SELECT NOT pg_is_in_recovery()")
                    .is_ok_and(|s| s == "t")
        })?;
        self.leader()
            .ok_or_else(|| "the primary went away again".to_owned())
    }

    /// Waits until `ready` holds, or says what the logs say.
    pub fn wait_for(
        &self,
        timeout: Duration,
        what: &str,
        ready: impl Fn(&Self) -> bool,
    ) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if ready(self) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!(
            "no {what} within {timeout:?}; roles {:?}\n{}",
            [self.role(0), self.role(1)],
            self.log_tails()
        ))
    }

    /// The last lines of every log, for failure messages.
    pub fn log_tails(&self) -> String {
        let mut out = String::new();
        for name in ["etcd", "haproxy", "node1", "node2"] {
            let path = self.root.join(format!("{name}.log"));
            out.push_str(&format!(
                "--- {} ---\n{}\n",
                path.display(),
                tail(&path, 15)
            ));
        }
        for node in &self.nodes {
            let logs = node.dir.join("data/log");
            let newest = fs::read_dir(&logs).ok().and_then(|d| {
                d.flatten()
                    .map(|e| e.path())
                    .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
            });
            if let Some(p) = newest {
                out.push_str(&format!("--- {} ---\n{}\n", p.display(), tail(&p, 10)));
            }
        }
        out
    }

    /// The postmaster's pid of node `i`, from its pid file.
    pub fn postmaster_pid(&self, i: usize) -> Option<u32> {
        fs::read_to_string(self.nodes[i].dir.join("data/postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// Starts node `i`'s Patroni (again): a node that was lost rejoins as a standby, rewound
    /// with pg_rewind (or cloned again when that fails).
    pub fn start_node(&mut self, i: usize) -> Result<(), String> {
        let node = &self.nodes[i];
        let config = node.dir.join("patroni.yml");
        let log = node.dir.with_extension("log");
        let mut cmd = self.command(&self.hosts.nodes[i], "patroni");
        cmd.arg(&config);
        redirect(&mut cmd, &log)?;
        let guard = ChildGuard::spawn(&format!("patroni {}", node.name), &mut cmd)?;
        self.write_pid(node.name, &guard);
        self.nodes[i].patroni = Some(guard);
        let rest = self.hosts.nodes[i].addr(self.nodes[i].rest_port);
        wait_for_addr(rest, Duration::from_secs(20)).map_err(|e| format!("{e}\n{}", tail(&log, 20)))
    }

    /// Node `i`'s Patroni, while it runs (a test kills it to lose the node).
    pub fn patroni_mut(&mut self, i: usize) -> Option<&mut ChildGuard> {
        self.nodes[i].patroni.as_mut()
    }

    /// Restarts the parts that died; says which (`edge run` supervises with it).
    pub fn supervise(&mut self) -> Vec<String> {
        let mut said = Vec::new();
        if !self.etcd.as_mut().is_some_and(ChildGuard::is_running) {
            said.push("etcd died; restarting it".to_owned());
            if let Err(e) = self.start_etcd() {
                said.push(format!("etcd restart failed, will retry: {e}"));
            }
        }
        for i in 0..2 {
            if !self.patroni_mut(i).is_some_and(ChildGuard::is_running) {
                said.push(format!(
                    "Patroni {} died; restarting it (it rejoins as a standby if another node leads)",
                    self.nodes[i].name
                ));
                if let Err(e) = self.start_node(i) {
                    said.push(format!("restart failed, will retry: {e}"));
                }
            }
        }
        if !self.haproxy.as_mut().is_some_and(ChildGuard::is_running) {
            said.push("HAProxy died; restarting it".to_owned());
            if let Err(e) = self.start_haproxy() {
                said.push(format!("HAProxy restart failed, will retry: {e}"));
            }
        }
        said
    }

    /// `program` on `host`, as the unprivileged user when we are root.
    fn command(&self, host: &Host, program: &str) -> Command {
        let mut cmd = host.command_as(program, self.run_as);
        cmd.current_dir(&self.root).stdin(Stdio::null());
        // Patroni's own Postgres must not see the caller's PG* settings.
        for var in ["PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGPASSWORD"] {
            cmd.env_remove(var);
        }
        if self.run_as.is_some() {
            cmd.env("HOME", &self.root);
        }
        cmd
    }

    fn write_pid(&self, name: &str, guard: &ChildGuard) {
        if let Some(pid) = guard.pid() {
            let _ = fs::write(self.root.join("pids").join(name), pid.to_string());
        }
    }

    fn start_etcd(&mut self) -> Result<(), String> {
        let p = self.ports;
        let etcd = &self.hosts.etcd;
        let client = format!("http://{}", etcd.addr(p.etcd_client));
        let peer = format!("http://{}", etcd.addr(p.etcd_peer));
        let mut cmd = self.command(etcd, "etcd");
        cmd.args(["--name", "idem-etcd", "--data-dir"])
            .arg(self.root.join("etcd/data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("idem-etcd={peer}")])
            .args(["--enable-v2=true"]);
        redirect(&mut cmd, &self.root.join("etcd.log"))?;
        let guard = ChildGuard::spawn("etcd", &mut cmd)?;
        self.write_pid("etcd", &guard);
        self.etcd = Some(guard);
        wait_for_addr(etcd.addr(p.etcd_client), Duration::from_secs(20))
            .map_err(|e| format!("{e}\n{}", tail(&self.root.join("etcd.log"), 20)))
    }

    fn start_haproxy(&mut self) -> Result<(), String> {
        let program = if Path::new("/usr/sbin/haproxy").is_file() {
            "/usr/sbin/haproxy"
        } else {
            "haproxy"
        };
        let mut cmd = self.command(&self.hosts.haproxy, program);
        cmd.arg("-db").arg("-f").arg(self.root.join("haproxy.cfg"));
        redirect(&mut cmd, &self.root.join("haproxy.log"))?;
        let guard = ChildGuard::spawn("haproxy", &mut cmd)?;
        self.write_pid("haproxy", &guard);
        self.haproxy = Some(guard);
        wait_for_addr(
            self.hosts.haproxy.addr(self.ports.proxy),
            Duration::from_secs(10),
        )
        .map_err(|e| format!("{e}\n{}", tail(&self.root.join("haproxy.log"), 20)))
    }

    fn write_configs(&self) -> Result<(), String> {
        let write = |path: PathBuf, text: String| {
            fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
        };
        for (i, node) in self.nodes.iter().enumerate() {
            write(node.dir.join("patroni.yml"), self.patroni_yaml(i, node))?;
        }
        write(self.root.join("haproxy.cfg"), self.haproxy_cfg())
    }

    fn patroni_yaml(&self, i: usize, node: &Node) -> String {
        let p = self.ports;
        let pg_port = p.postgres[i];
        let address = self.hosts.nodes[i].address;
        format!(
            r#"# Written by edge (edge-runtime/src/ha.rs); rewritten at every start.
scope: idempotency
namespace: /edge/
name: {name}
log:
  level: INFO
restapi:
  listen: {address}:{rest}
  connect_address: {address}:{rest}
etcd3:
  host: {etcd}
bootstrap:
  dcs:
    ttl: {ttl}
    loop_wait: {loop_wait}
    retry_timeout: 4
    maximum_lag_on_failover: 1048576
    # A commit is acknowledged only once the standby has it, and only the synchronous standby
    # may be promoted. With the standby gone, Patroni degrades to one node rather than blocking
    # every commit (not synchronous_mode_strict): docs/RELIABILITY.md says why.
    synchronous_mode: true
    postgresql:
      use_pg_rewind: true
      remove_data_directory_on_rewind_failure: true
      remove_data_directory_on_diverged_timelines: true
      parameters:
        max_connections: 300
        wal_log_hints: "on"
        synchronous_commit: "on"
        fsync: "on"
        wal_keep_size: 256MB
        # A primary cut off from its standby without a reset (a black-holed link) shuts down
        # only once its walsender gives up on the standby: with the default 60 s, Patroni's
        # demotion of a primary that lost etcd outlasted its loop, Patroni demoted it a second
        # time meanwhile, two postmasters raced, pg_rewind failed and the node never rejoined
        # (tests/tests/partitions.rs, the zombie primary).
        wal_sender_timeout: 5s
        autovacuum_naptime: 10s
        # Full-page images of random-key index leaves, compressed (bench/NOTES.md, nineteenth round).
        wal_compression: lz4
  initdb:
    - encoding: UTF8
    - locale: C.UTF-8
    - data-checksums
  pg_hba:
    - local all all trust
    - host replication all {trusted} trust
    - host all all {trusted} trust
postgresql:
  listen: {address}:{pg_port}
  connect_address: {address}:{pg_port}
  data_dir: {data}
  bin_dir: {bin}
  pgpass: {dir}/pgpass
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: postgres
      password: postgres
    rewind:
      username: postgres
      password: postgres
  parameters:
    unix_socket_directories: {dir}
    logging_collector: "on"
    log_directory: log
watchdog:
  mode: off
"#,
            name = node.name,
            rest = node.rest_port,
            etcd = self.hosts.etcd.addr(p.etcd_client),
            trusted = self.hosts.trusted,
            ttl = TTL_S,
            loop_wait = LOOP_WAIT_S,
            data = node.dir.join("data").display(),
            bin = self.bin.display(),
            dir = node.dir.display(),
        )
    }

    fn haproxy_cfg(&self) -> String {
        let p = self.ports;
        format!(
            r#"# Written by edge (edge-runtime/src/ha.rs): one port to whichever node Patroni says is primary.
global
    maxconn 2000
defaults
    mode tcp
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    # A Patroni REST check on a loaded machine can take more than a second; a primary marked
    # down by a slow check loses its sessions (below), so a check is given 2 s and 3 tries.
    timeout check 2s
listen postgres_primary
    bind {proxy}
    option httpchk GET /primary
    http-check expect status 200
    # A node that stops being primary loses its sessions at once: the state API reconnects
    # to the new one instead of writing into a demoted server.
    default-server inter 500ms fall 3 rise 1 on-marked-down shutdown-sessions
    server node1 {pg1} check port {rest1}
    server node2 {pg2} check port {rest2}
"#,
            proxy = self.hosts.haproxy.addr(p.proxy),
            pg1 = self.hosts.nodes[0].addr(p.postgres[0]),
            pg2 = self.hosts.nodes[1].addr(p.postgres[1]),
            rest1 = p.rest[0],
            rest2 = p.rest[1],
        )
    }

    /// Stops everything: HAProxy, the standby, the primary (Patroni stops its Postgres), then
    /// etcd. The standby first: stopped second, it would take the leader key the primary had
    /// just released, and the next start would wait for it.
    pub fn stop(&mut self) {
        if let Some(mut h) = self.haproxy.take() {
            h.terminate(Duration::from_secs(5));
        }
        let leader = self.leader().unwrap_or(0);
        for i in [1 - leader, leader] {
            if let Some(mut p) = self.nodes[i].patroni.take() {
                // SIGTERM: Patroni shuts its Postgres down (fast) and releases the leader key.
                p.terminate(Duration::from_secs(20));
            }
        }
        for i in 0..2 {
            if let Some(pid) = self.postmaster_pid(i) {
                let _ = send_signal(pid, Signal::QUIT);
            }
        }
        if let Some(mut e) = self.etcd.take() {
            e.terminate(Duration::from_secs(5));
        }
    }
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        self.stop();
        if let Some(mut w) = self.watchdog.take() {
            w.kill();
        }
        if self.remove_on_drop {
            let _ = fs::remove_dir_all(&self.root);
        }
    }
}

fn redirect(cmd: &mut Command, log: &Path) -> Result<(), String> {
    let file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("cannot open {}: {e}", log.display()))?;
    let file2 = file.try_clone().map_err(|e| e.to_string())?;
    cmd.stdout(file).stderr(file2);
    Ok(())
}

/// A shell that waits for this process to end, then kills every part it started (their pids
/// are in `pids/`, the postmasters' in their pid files) and, for a throwaway cluster, removes
/// the folder.
fn spawn_watchdog(root: &Path, remove: bool) -> Result<ChildGuard, String> {
    let script = r#"
        while kill -0 "$1" 2>/dev/null; do sleep 0.5; done
        for f in "$2"/pids/*; do [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null; done
        for f in "$2"/node*/data/postmaster.pid; do
            [ -f "$f" ] && kill -QUIT "$(head -n 1 "$f")" 2>/dev/null
        done
        sleep 2
        for f in "$2"/node*/data/postmaster.pid; do
            [ -f "$f" ] && kill -KILL "$(head -n 1 "$f")" 2>/dev/null
        done
        if [ "$3" = remove ]; then rm -rf "$2"; fi
    "#;
    crate::process::spawn_watchdog("edge-ha-watchdog", script, root, remove)
}
