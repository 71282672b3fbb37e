//! A Postgres cluster of our own: throwaway for tests (or the one in `DATABASE_URL`), or kept
//! across runs in a folder for `edge run` and the demo ([`TempCluster::start_at`]).
//!
//! `TempCluster::start()` uses `DATABASE_URL` when it is set; otherwise it runs `initdb` into a
//! fresh temporary directory and starts `postgres` on a free loopback port (`fsync` left on,
//! trust authentication, user `postgres`). When the tests run as root, the server runs as the
//! unprivileged `postgres` user (initdb refuses root). The server binaries are found in
//! `PG_BIN`, `pg_config --bindir` or `/usr/lib/postgresql/<version>/bin`; when none is found
//! the caller fails with a message that says how to get them: tests never skip silently.
//!
//! Starting a cluster takes a second or two, so a test binary usually shares one
//! ([`shared`]) and gives every test its own database ([`TempCluster::fresh_database`]).
//!
//! Cleanup: dropping the guard stops the server and removes the directory. A cluster that is
//! never dropped (the shared one lives in a `static`) is stopped and removed by a small
//! watchdog process once the test process has exited.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::net::free_port;
use crate::process::{children_of, send_signal, ChildGuard, Signal, SignalError, Stopped};

const INSTALL_HINT: &str = "install the Postgres server (`apt-get install postgresql-15`), set PG_BIN to the \
     directory holding initdb/postgres, or set DATABASE_URL to a server where this user may CREATE DATABASE";

/// A Postgres server for tests: a private cluster, or an external one from `DATABASE_URL`.
#[derive(Debug)]
pub struct TempCluster {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Local(Local),
    External { url: String },
}

#[derive(Debug)]
struct Local {
    bin: PathBuf,
    /// Holds `data/`, the socket and `postgres.log`.
    root: PathBuf,
    port: u16,
    /// Unix user to run the server as (when we are root).
    run_as: Option<(u32, u32)>,
    /// Remove `root` when dropped (not for `start_at`).
    remove_on_drop: bool,
    /// `ssl=on` with the certificate written into `root` ([`ServerTls`]).
    ssl: bool,
    server: Option<ChildGuard>,
    watchdog: Option<ChildGuard>,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A server certificate for a private cluster: it runs with `ssl=on`.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The certificate chain (PEM), the server's first.
    pub cert_pem: String,
    /// Its private key (PEM); written readable by the server's user only, as Postgres asks.
    pub key_pem: String,
    /// Only TLS connections are accepted (`hostssl` in `pg_hba.conf`): a client that does not
    /// ask for TLS is refused.
    pub require: bool,
}

/// The certificate files' names in the cluster's folder.
const TLS_CERT_FILE: &str = "server.crt";
const TLS_KEY_FILE: &str = "server.key";

/// One cluster per test process, started on first use (see the module docs for cleanup).
pub fn shared() -> Result<&'static TempCluster, String> {
    static SHARED: OnceLock<Result<TempCluster, String>> = OnceLock::new();
    SHARED
        .get_or_init(TempCluster::start)
        .as_ref()
        .map_err(Clone::clone)
}

impl TempCluster {
    /// `DATABASE_URL` when set, else a private throwaway cluster.
    pub fn start() -> Result<Self, String> {
        match std::env::var("DATABASE_URL") {
            Ok(url) if !url.trim().is_empty() => {
                let c = Self {
                    inner: Inner::External { url },
                };
                c.psql("postgres", "SELECT 1")
                    .map_err(|e| format!("DATABASE_URL is set but unusable: {e}"))?;
                Ok(c)
            }
            _ => Self::start_private(),
        }
    }

    /// Always a private throwaway cluster, whatever `DATABASE_URL` says (crash tests need
    /// to kill and restart the server).
    pub fn start_private() -> Result<Self, String> {
        Self::start_private_with(None)
    }

    /// A private throwaway cluster with `ssl=on` and this certificate (clients connect with
    /// `sslmode=verify-full&sslrootcert=<its CA>`).
    pub fn start_private_tls(tls: &ServerTls) -> Result<Self, String> {
        Self::start_private_with(Some(tls.clone()))
    }

    fn start_private_with(tls: Option<ServerTls>) -> Result<Self, String> {
        let bin = find_bin_dir()?;
        let run_as = unprivileged_ids()?;
        let mut last_err = String::new();
        // A free port can be taken between our probe and the server's bind: try a few.
        // (A failed attempt removes its directory when its guard drops.)
        for _ in 0..3 {
            match Local::create(
                bin.clone(),
                crate::data_home::throwaway_home(unique_temp_dir()?, run_as)?,
                free_port(),
                true,
                tls.clone(),
            ) {
                Ok(local) => {
                    return Ok(Self {
                        inner: Inner::Local(local),
                    })
                }
                Err(e) => last_err = e,
            }
        }
        Err(last_err)
    }

    /// A cluster in `dir` on `port` that keeps its data across runs (for the demo): `initdb`
    /// only when `dir` holds no cluster yet. Stopped, not removed, when dropped.
    pub fn start_at(dir: &Path, port: u16) -> Result<Self, String> {
        let bin = find_bin_dir()?;
        let root = crate::data_home::cluster_home(dir, unprivileged_ids()?, |d| {
            d.join("data/PG_VERSION").is_file()
        })?;
        Local::create(bin, root, port, false, None).map(|local| Self {
            inner: Inner::Local(local),
        })
    }

    /// URL of the `postgres` database.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// URL of database `db` on this server.
    pub fn url_for(&self, db: &str) -> String {
        match &self.inner {
            Inner::Local(l) => format!("postgres://postgres@127.0.0.1:{}/{db}", l.port),
            Inner::External { url } => replace_database(url, db),
        }
    }

    /// The server's port (of the URL's, for an external server: 5432 when it names none).
    pub fn port(&self) -> u16 {
        match &self.inner {
            Inner::Local(l) => l.port,
            Inner::External { url } => external_port(url),
        }
    }

    /// True when this is the server from `DATABASE_URL`.
    pub fn is_external(&self) -> bool {
        matches!(self.inner, Inner::External { .. })
    }

    /// The data directory (private clusters only).
    pub fn data_dir(&self) -> Option<PathBuf> {
        match &self.inner {
            Inner::Local(l) => Some(l.root.join("data")),
            Inner::External { .. } => None,
        }
    }

    /// The postmaster's process id (private clusters only, while it runs): a test signals its
    /// children (a backend to SIGKILL, the startup process to hold during crash recovery).
    pub fn postmaster_pid(&self) -> Option<u32> {
        match &self.inner {
            Inner::Local(l) => l.server.as_ref().and_then(ChildGuard::pid),
            Inner::External { .. } => None,
        }
    }

    /// Creates database `name` (letters, digits and `_` only) and returns its URL.
    pub fn create_database(&self, name: &str) -> Result<String, String> {
        if name.is_empty()
            || name.len() > 63
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(format!("invalid database name {name:?}"));
        }
        self.psql("postgres", &format!("CREATE DATABASE \"{name}\""))?;
        Ok(self.url_for(name))
    }

    /// Drops database `name`, disconnecting its sessions (Postgres 13+).
    pub fn drop_database(&self, name: &str) -> Result<(), String> {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(format!("invalid database name {name:?}"));
        }
        self.psql(
            "postgres",
            &format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"),
        )
        .map(drop)
    }

    /// Creates a database with a unique name starting with `prefix` and returns its URL.
    pub fn fresh_database(&self, prefix: &str) -> Result<String, String> {
        let clean: String = prefix
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
            .take(30)
            .collect::<String>()
            .to_lowercase();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        self.create_database(&format!("{clean}_{}_{n}_{nanos:x}", std::process::id()))
    }

    /// Runs one SQL command with `psql` in database `db`; returns its unaligned output.
    pub fn psql(&self, db: &str, sql: &str) -> Result<String, String> {
        let (program, conn) = match &self.inner {
            Inner::Local(l) => (l.bin.join("psql"), self.url_for(db)),
            Inner::External { url } => (psql_on_path(), replace_database(url, db)),
        };
        let out = Command::new(&program)
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                &conn,
                "-c",
                sql,
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e} ({INSTALL_HINT})", program.display()))?;
        if !out.status.success() {
            return Err(format!(
                "psql failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// SIGKILL to the postmaster, as a crash would (private clusters only).
    pub fn kill_postmaster(&mut self) -> Result<(), String> {
        let l = self.local_mut()?;
        if let Some(mut s) = l.server.take() {
            s.kill();
        }
        Ok(())
    }

    /// Freezes every process of the server (SIGSTOP: a stalled host or disk, the statements
    /// in flight hang without an error) or thaws it (SIGCONT). Private clusters only.
    pub fn signal_all(&mut self, signal: Signal) -> Result<(), String> {
        let pid = self
            .local_mut()?
            .server
            .as_ref()
            .and_then(ChildGuard::pid)
            .ok_or("the server is not running")?;
        // The postmaster, then its children (backends, walwriter, checkpointer, ...); a child
        // that ended meanwhile is no failure.
        send_signal(pid, signal).map_err(|e| e.to_string())?;
        for child in children_of(pid) {
            match send_signal(child, signal) {
                Ok(()) | Err(SignalError::Gone { .. }) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    }

    /// Starts the server again on the same port and data (after `kill_postmaster` or `stop`);
    /// crash recovery runs as after a real crash.
    pub fn restart(&mut self) -> Result<(), String> {
        let l = self.local_mut()?;
        if let Some(mut s) = l.server.take() {
            s.terminate(Duration::from_secs(10));
        }
        // Backends orphaned by a SIGKILLed postmaster exit on their own within moments; the
        // new postmaster refuses to start while they still hold the old shared memory.
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            match l.launch() {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the server runs (an external one: always, as far as this process knows). A
    /// server that exited is reaped.
    pub fn is_running(&mut self) -> bool {
        match &mut self.inner {
            Inner::Local(l) => l.server.as_mut().is_some_and(ChildGuard::is_running),
            Inner::External { .. } => true,
        }
    }

    /// Creates database `name` unless it exists; its URL.
    pub fn ensure_database(&self, name: &str) -> Result<String, String> {
        let exists = self.psql(
            "postgres",
            &format!(
                "SELECT 1 FROM pg_database WHERE datname = '{}'",
                name.replace('\'', "")
            ),
        )?;
        if exists.trim() == "1" {
            return Ok(self.url_for(name));
        }
        self.create_database(name)
    }

    /// Fast shutdown (private clusters only); `restart` starts it again.
    pub fn stop(&mut self) -> Result<(), String> {
        let l = self.local_mut()?;
        if let Some(mut s) = l.server.take() {
            s.terminate(Duration::from_secs(10));
        }
        Ok(())
    }

    fn local_mut(&mut self) -> Result<&mut Local, String> {
        match &mut self.inner {
            Inner::Local(l) => Ok(l),
            Inner::External { .. } => Err(
                "not possible on the DATABASE_URL server: use TempCluster::start_private()".into(),
            ),
        }
    }
}

impl Local {
    fn create(
        bin: PathBuf,
        root: PathBuf,
        port: u16,
        throwaway: bool,
        tls: Option<ServerTls>,
    ) -> Result<Self, String> {
        let run_as = unprivileged_ids()?;
        let data = root.join("data");
        let mut local = Self {
            bin,
            root,
            port,
            run_as,
            remove_on_drop: throwaway,
            ssl: tls.is_some(),
            server: None,
            watchdog: None,
        };
        if let Some((uid, gid)) = run_as {
            chown_recursive(&local.root, uid, gid)?;
        }
        if !data.join("PG_VERSION").is_file() {
            local.initdb(throwaway)?;
        }
        if let Some(tls) = &tls {
            local.write_tls_files(tls)?;
        }
        local.launch()?;
        local.watchdog = Some(spawn_watchdog(&local.root, throwaway)?);
        Ok(local)
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin.join(program));
        // The server user may not be allowed into the caller's working directory.
        cmd.current_dir(&self.root).stdin(Stdio::null());
        if let Some((uid, gid)) = self.run_as {
            use std::os::unix::process::CommandExt as _;
            cmd.uid(uid).gid(gid);
        }
        cmd
    }

    /// Why `program` did not start, and what to do: a missing binary is an install hint; a
    /// folder the server's user cannot enter is named (it runs in `root`, as that user).
    fn cannot_run(&self, program: &str, e: &std::io::Error) -> String {
        let path = self.bin.join(program);
        if e.kind() == std::io::ErrorKind::NotFound {
            return format!("cannot run {}: {e} ({INSTALL_HINT})", path.display());
        }
        match self.run_as.and_then(|(uid, gid)| {
            crate::data_home::first_closed(&self.root, uid, gid).map(|c| (uid, c))
        }) {
            Some((uid, closed)) => format!(
                "cannot run {program} as uid {uid}: it cannot enter {closed}, on the way to {}; \
                 let that user through (chmod o+x) or run from a folder it can reach",
                self.root.display()
            ),
            None => format!("cannot run {}: {e}", path.display()),
        }
    }

    fn initdb(&self, throwaway: bool) -> Result<(), String> {
        let data = self.root.join("data");
        let mut cmd = self.command("initdb");
        cmd.arg("-D").arg(&data).args([
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C.UTF-8",
            "--username=postgres",
        ]);
        if throwaway {
            // Only skips fsync of the freshly made files; the server itself runs with fsync=on.
            cmd.arg("--no-sync");
        }
        let out = cmd.output().map_err(|e| self.cannot_run("initdb", &e))?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed in {}: {}{}",
                data.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(())
    }

    /// The certificate and key for `ssl=on` (the key readable by the server's user only, or
    /// Postgres refuses it), and `hostssl` instead of `host` when only TLS is accepted.
    fn write_tls_files(&self, tls: &ServerTls) -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt as _;
        let write = |name: &str, text: &str, mode: u32| -> Result<(), String> {
            let path = self.root.join(name);
            fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                .map_err(|e| format!("cannot chmod {}: {e}", path.display()))?;
            if let Some((uid, gid)) = self.run_as {
                std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                    .map_err(|e| format!("cannot chown {}: {e}", path.display()))?;
            }
            Ok(())
        };
        write(TLS_CERT_FILE, &tls.cert_pem, 0o644)?;
        write(TLS_KEY_FILE, &tls.key_pem, 0o600)?;
        if tls.require {
            let hba = self.root.join("data/pg_hba.conf");
            let text = fs::read_to_string(&hba)
                .map_err(|e| format!("cannot read {}: {e}", hba.display()))?;
            let only_tls: String = text
                .lines()
                .map(|l| match l.strip_prefix("host ") {
                    Some(rest) => format!("hostssl {rest}\n"),
                    None => format!("{l}\n"),
                })
                .collect();
            fs::write(&hba, only_tls)
                .map_err(|e| format!("cannot write {}: {e}", hba.display()))?;
        }
        Ok(())
    }

    /// Starts the postmaster and waits until it accepts queries.
    fn launch(&mut self) -> Result<(), String> {
        let log_path = self.root.join("postgres.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(self.root.join("data"))
            .args(["-p", &self.port.to_string(), "-h", "127.0.0.1", "-k"])
            .arg(&self.root)
            // Many tests share one cluster, each with its own pool.
            .args([
                "-c",
                "max_connections=300",
                "-c",
                "fsync=on",
                "-c",
                "synchronous_commit=on",
                // The records table turns over every retention period: vacuum it often
                // (with the table's own thresholds, see the migrations), not once a minute.
                "-c",
                "autovacuum_naptime=10s",
            ]);
        if self.ssl {
            cmd.args(["-c", "ssl=on", "-c"])
                .arg(format!(
                    "ssl_cert_file={}",
                    self.root.join(TLS_CERT_FILE).display()
                ))
                .arg("-c")
                .arg(format!(
                    "ssl_key_file={}",
                    self.root.join(TLS_KEY_FILE).display()
                ));
        }
        cmd.stdout(log).stderr(log2);
        let mut server = ChildGuard::spawn("postgres", &mut cmd)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if !server.is_running() {
                return Err(format!(
                    "postgres exited at start; log:\n{}",
                    tail(&log_path, 20)
                ));
            }
            let ready = Command::new(self.bin.join("pg_isready"))
                .args([
                    "-q",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "postgres",
                    "-t",
                    "1",
                ])
                .stdin(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ready {
                self.server = Some(server);
                return Ok(());
            }
            if Instant::now() > deadline {
                server.kill();
                return Err(format!(
                    "postgres did not become ready in 30 s; log:\n{}",
                    tail(&log_path, 20)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        if let Some(mut s) = self.server.take() {
            // SIGTERM is a smart shutdown that waits for clients; SIGINT (fast) does not.
            if s.stop_with(Signal::INT, Duration::from_secs(10)) == Stopped::Killed {
                eprintln!(
                    "postgres in {} did not stop within 10 s of SIGINT: SIGKILLed (crash recovery at the next start)",
                    self.root.display()
                );
            }
        }
        if let Some(mut w) = self.watchdog.take() {
            w.kill();
        }
        if self.remove_on_drop {
            let _ = fs::remove_dir_all(&self.root);
        }
    }
}

/// A shell that waits for this process to end, then stops the server (SIGQUIT: immediate
/// shutdown) and, for a throwaway cluster, removes its directory.
fn spawn_watchdog(root: &Path, remove: bool) -> Result<ChildGuard, String> {
    let script = r#"
        while kill -0 "$1" 2>/dev/null; do sleep 0.5; done
        pidfile="$2/data/postmaster.pid"
        if [ -f "$pidfile" ]; then
            pm=$(head -n 1 "$pidfile")
            kill -QUIT "$pm" 2>/dev/null
            for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pm" 2>/dev/null || break; sleep 0.5; done
            kill -KILL "$pm" 2>/dev/null
        fi
        if [ "$3" = remove ]; then rm -rf "$2"; fi
    "#;
    crate::process::spawn_watchdog("stack-pg-watchdog", script, root, remove)
}

/// The directory with `initdb`, `postgres`, `pg_isready` and `psql`.
pub fn find_bin_dir() -> Result<PathBuf, String> {
    find_bin_dir_from(std::env::var("PG_BIN").ok())
}

fn find_bin_dir_from(pg_bin: Option<String>) -> Result<PathBuf, String> {
    let has_server = |d: &Path| d.join("initdb").is_file() && d.join("postgres").is_file();
    if let Some(p) = pg_bin {
        let p = PathBuf::from(p);
        return if has_server(&p) {
            Ok(p)
        } else {
            Err(format!(
                "PG_BIN={} has no initdb/postgres: {INSTALL_HINT}",
                p.display()
            ))
        };
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && has_server(&p) {
            return Ok(p);
        }
    }
    // The highest installed version.
    let mut found: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            has_server(&bin).then_some((version, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, p)| p)
        .ok_or_else(|| format!("no Postgres server binaries found: {INSTALL_HINT}"))
}

fn psql_on_path() -> PathBuf {
    find_bin_dir()
        .map(|d| d.join("psql"))
        .unwrap_or_else(|_| PathBuf::from("psql"))
}

/// When we are root: the uid and gid of `postgres` (initdb and postgres refuse root).
pub(crate) fn unprivileged_ids() -> Result<Option<(u32, u32)>, String> {
    if id(&["-u"])? != 0 {
        return Ok(None);
    }
    let user = std::env::var("PG_RUN_AS").unwrap_or_else(|_| "postgres".into());
    let uid = id(&["-u", &user])
        .map_err(|e| format!("running as root needs an unprivileged user `{user}`: {e}"))?;
    let gid = id(&["-g", &user])?;
    Ok(Some((uid, gid)))
}

fn id(args: &[&str]) -> Result<u32, String> {
    let out = Command::new("id")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run id: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| format!("id {args:?}: {e}"))
}

/// `chown -R uid:gid dir` through the OS (symbolic links themselves, never their targets).
pub(crate) fn chown_recursive(dir: &Path, uid: u32, gid: u32) -> Result<(), String> {
    std::os::unix::fs::lchown(dir, Some(uid), Some(gid))
        .map_err(|e| format!("cannot chown {}: {e}", dir.display()))?;
    let is_dir = fs::symlink_metadata(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .is_dir();
    if is_dir {
        for entry in fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
            let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
            chown_recursive(&entry.path(), uid, gid)?;
        }
    }
    Ok(())
}

pub(crate) fn unique_temp_dir() -> Result<PathBuf, String> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!(
        "stack-pg-{}-{}-{:x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        nanos & 0xffff_ffff
    ));
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

pub(crate) fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `postgres://u@h:1/old?x=y` with the database replaced by `db`.
fn replace_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let after_scheme = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_part_end = base[after_scheme..]
        .find('/')
        .map(|i| after_scheme + i)
        .unwrap_or(base.len());
    let mut out = format!("{}/{db}", &base[..host_part_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

fn external_port(url: &str) -> u16 {
    let after_scheme = url.find("://").map(|i| i + 3).unwrap_or(0);
    let rest = &url[after_scheme..];
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let host_port = authority.rsplit('@').next().unwrap_or("");
    host_port
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(5432)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn missing_binaries_say_how_to_get_them() {
        let e = find_bin_dir_from(Some("/nonexistent".into())).unwrap_err();
        assert!(
            e.contains("apt-get install postgresql-15") && e.contains("DATABASE_URL"),
            "{e}"
        );
    }

    /// The demo's cluster: data survives a stop and a new start on the same directory, and a
    /// SIGKILLed postmaster comes back with its committed data.
    #[test]
    fn start_at_keeps_data_and_survives_a_kill() {
        let dir = unique_temp_dir().unwrap();
        let port = free_port();
        {
            let mut c = TempCluster::start_at(&dir, port).unwrap_or_else(|e| panic!("{e}"));
            let url = c.create_database("keep").unwrap();
            assert_eq!(url, format!("postgres://postgres@127.0.0.1:{port}/keep"));
            c.psql("keep", "CREATE TABLE t (v int); INSERT INTO t VALUES (42)")
                .unwrap();
            c.kill_postmaster().unwrap();
            assert!(c.psql("keep", "SELECT 1").is_err());
            c.restart().unwrap();
            assert_eq!(c.psql("keep", "SELECT v FROM t").unwrap(), "42");
        }
        let c = TempCluster::start_at(&dir, port).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.psql("keep", "SELECT v FROM t").unwrap(), "42");
        assert_eq!(c.psql("postgres", "SHOW fsync").unwrap(), "on");
        drop(c);
        assert!(
            dir.join("data/PG_VERSION").is_file(),
            "start_at keeps its directory"
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn urls() {
        assert_eq!(
            replace_database("postgres://u:p@h:5/old?sslmode=disable", "new"),
            "postgres://u:p@h:5/new?sslmode=disable"
        );
        assert_eq!(
            replace_database("postgres://u@h", "new"),
            "postgres://u@h/new"
        );
        assert_eq!(external_port("postgres://u:p@h:6543/db"), 6543);
        assert_eq!(external_port("postgres://h/db"), 5432);
    }
}
