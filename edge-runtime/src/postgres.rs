//! A Postgres cluster of our own, kept across runs in a folder for `edge run` and the demo
//! ([`Cluster::start_at`]), or throwaway in a fresh temporary folder ([`Cluster::start_private`]:
//! `edge with-postgres`, and the tests through crate `test-support`).
//!
//! A cluster runs `initdb` when its folder holds none and starts `postgres` on its port
//! (`fsync` left on, trust authentication, user `postgres`). When we are root, the server runs as
//! the unprivileged `postgres` user (initdb refuses root). The server binaries are found in
//! `PG_BIN`, `pg_config --bindir` or `/usr/lib/postgresql/<version>/bin`; when none is found
//! the caller fails with a message that says how to get them.
//!
//! Cleanup: dropping the guard stops the server and, for a throwaway cluster, removes the
//! directory. A cluster that is never dropped (one that lives in a `static`) is stopped and
//! removed by a small watchdog process once this process has exited.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::net::free_port;
use crate::process::{ChildGuard, Signal, Stopped};

const INSTALL_HINT: &str = "install the Postgres server (`apt-get install postgresql-15`), set PG_BIN to the \
     directory holding initdb/postgres, or set DATABASE_URL to a server where this user may CREATE DATABASE";

/// A Postgres server of our own (see the module docs).
#[derive(Debug)]
pub struct Cluster {
    local: Local,
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
    server: Option<ChildGuard>,
    watchdog: Option<ChildGuard>,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Called once a new cluster's folder holds its data (initdb ran), before its server first
/// starts: the folder and the server's user (uid, gid) when we are root. The tests write a
/// server certificate there and turn `ssl` on.
pub type Prepare<'a> = &'a dyn Fn(&Path, Option<(u32, u32)>) -> Result<(), String>;

impl Cluster {
    /// A private throwaway cluster on a free port.
    pub fn start_private() -> Result<Self, String> {
        Self::start_private_prepared(&|_, _| Ok(()))
    }

    /// The same, with `prepare` run on its folder before the server starts.
    pub fn start_private_prepared(prepare: Prepare<'_>) -> Result<Self, String> {
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
                prepare,
            ) {
                Ok(local) => return Ok(Self { local }),
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
        Local::create(bin, root, port, false, &|_, _| Ok(())).map(|local| Self { local })
    }

    /// URL of database `db` on this server.
    pub fn url_for(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.local.port)
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.local.root.join("data")
    }

    /// The postmaster, while it runs.
    pub fn postmaster(&self) -> Option<&ChildGuard> {
        self.local.server.as_ref()
    }

    /// The postmaster, to signal or stop (a test kills it as a crash would).
    pub fn postmaster_mut(&mut self) -> Option<&mut ChildGuard> {
        self.local.server.as_mut()
    }

    /// Creates database `name` (letters, digits and `_` only) and returns its URL.
    pub fn create_database(&self, name: &str) -> Result<String, String> {
        self.psql("postgres", &create_database_sql(name)?)?;
        Ok(self.url_for(name))
    }

    /// Creates a database with a unique name starting with `prefix` and returns its URL.
    pub fn fresh_database(&self, prefix: &str) -> Result<String, String> {
        self.create_database(&unique_database_name(prefix))
    }

    /// Runs one SQL command with `psql` in database `db`; returns its unaligned output.
    pub fn psql(&self, db: &str, sql: &str) -> Result<String, String> {
        run_psql(&self.local.bin.join("psql"), &self.url_for(db), sql)
    }

    /// Starts the server again on the same port and data (after a crash or a stop); crash
    /// recovery runs as after a real crash.
    pub fn restart(&mut self) -> Result<(), String> {
        let l = &mut self.local;
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

    /// Whether the server runs. A server that exited is reaped.
    pub fn is_running(&mut self) -> bool {
        self.postmaster_mut().is_some_and(ChildGuard::is_running)
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
}

/// `CREATE DATABASE "name"`, for a name of letters, digits and `_` only.
pub fn create_database_sql(name: &str) -> Result<String, String> {
    if name.is_empty()
        || name.len() > 63
        || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        return Err(format!("invalid database name {name:?}"));
    }
    Ok(format!("CREATE DATABASE \"{name}\""))
}

/// A database name unique to this process and moment, starting with `prefix` (cleaned).
pub fn unique_database_name(prefix: &str) -> String {
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
    format!("{clean}_{}_{n}_{nanos:x}", std::process::id())
}

/// Runs one SQL command with the `psql` at `program` on `conn` (a URL); its unaligned output.
pub fn run_psql(program: &Path, conn: &str, sql: &str) -> Result<String, String> {
    let out = Command::new(program)
        .args([
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            conn,
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

impl Local {
    fn create(
        bin: PathBuf,
        root: PathBuf,
        port: u16,
        throwaway: bool,
        prepare: Prepare<'_>,
    ) -> Result<Self, String> {
        let run_as = unprivileged_ids()?;
        let data = root.join("data");
        let mut local = Self {
            bin,
            root,
            port,
            run_as,
            remove_on_drop: throwaway,
            server: None,
            watchdog: None,
        };
        if let Some((uid, gid)) = run_as {
            chown_recursive(&local.root, uid, gid)?;
        }
        if !data.join("PG_VERSION").is_file() {
            local.initdb(throwaway)?;
            prepare(&local.root, run_as)?;
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
                // Records are addressed by random 32-byte keys, so after each checkpoint almost
                // every write touches an index leaf for the first time and logs its whole page:
                // compressed, that WAL is about half (bench/NOTES.md, nineteenth round).
                "-c",
                "wal_compression=lz4",
            ]);
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

/// When we are root: the uid and gid of `postgres` (initdb and postgres refuse root).
pub fn unprivileged_ids() -> Result<Option<(u32, u32)>, String> {
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
pub fn chown_recursive(dir: &Path, uid: u32, gid: u32) -> Result<(), String> {
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

/// A fresh folder under the system's temporary directory (a throwaway cluster's).
pub fn unique_temp_dir() -> Result<PathBuf, String> {
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
            let mut c = Cluster::start_at(&dir, port).unwrap_or_else(|e| panic!("{e}"));
            let url = c.create_database("keep").unwrap();
            assert_eq!(url, format!("postgres://postgres@127.0.0.1:{port}/keep"));
            c.psql("keep", "CREATE TABLE t (v int); INSERT INTO t VALUES (42)")
                .unwrap();
            c.postmaster_mut().unwrap().kill();
            assert!(c.psql("keep", "SELECT 1").is_err());
            c.restart().unwrap();
            assert_eq!(c.psql("keep", "SELECT v FROM t").unwrap(), "42");
        }
        let c = Cluster::start_at(&dir, port).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.psql("keep", "SELECT v FROM t").unwrap(), "42");
        assert_eq!(c.psql("postgres", "SHOW fsync").unwrap(), "on");
        drop(c);
        assert!(
            dir.join("data/PG_VERSION").is_file(),
            "start_at keeps its directory"
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
