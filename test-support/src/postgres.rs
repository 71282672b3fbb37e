//! The tests' Postgres: `DATABASE_URL` when it is set, else a private throwaway cluster
//! ([`edge_runtime::postgres::Cluster`]) in a fresh temporary directory on a free loopback
//! port. When the server binaries are missing the caller fails with a message that says how to
//! get them: tests never skip silently.
//!
//! Starting a cluster takes a second or two, so a test binary usually shares one
//! ([`shared`]) and gives every test its own database ([`TempCluster::fresh_database`]).
//!
//! Cleanup: dropping the guard stops the server and removes the directory. A cluster that is
//! never dropped (the shared one lives in a `static`) is stopped and removed by a small
//! watchdog process once the test process has exited.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use edge_runtime::postgres::{create_database_sql, run_psql, unique_database_name};
pub use edge_runtime::postgres::{find_bin_dir, Cluster};

use crate::process::{children_of, send_signal, Signal, SignalError};

/// A Postgres server for tests: a private cluster, or an external one from `DATABASE_URL`.
#[derive(Debug)]
pub struct TempCluster {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Local(Cluster),
    External { url: String },
}

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
        Cluster::start_private().map(|c| Self {
            inner: Inner::Local(c),
        })
    }

    /// A private throwaway cluster with `ssl=on` and this certificate (clients connect with
    /// `sslmode=verify-full&sslrootcert=<its CA>`).
    pub fn start_private_tls(tls: &ServerTls) -> Result<Self, String> {
        Cluster::start_private_prepared(&|root, run_as| write_tls_files(root, run_as, tls)).map(
            |c| Self {
                inner: Inner::Local(c),
            },
        )
    }

    /// URL of database `db` on this server.
    pub fn url_for(&self, db: &str) -> String {
        match &self.inner {
            Inner::Local(c) => c.url_for(db),
            Inner::External { url } => replace_database(url, db),
        }
    }

    /// The server's port (of the URL's, for an external server: 5432 when it names none).
    pub fn port(&self) -> u16 {
        port_of_url(&self.url_for("postgres"))
    }

    /// True when this is the server from `DATABASE_URL`.
    pub fn is_external(&self) -> bool {
        matches!(self.inner, Inner::External { .. })
    }

    /// The data directory (private clusters only).
    pub fn data_dir(&self) -> Option<PathBuf> {
        match &self.inner {
            Inner::Local(c) => Some(c.data_dir()),
            Inner::External { .. } => None,
        }
    }

    /// The postmaster's process id (private clusters only, while it runs): a test signals its
    /// children (a backend to SIGKILL, the startup process to hold during crash recovery).
    pub fn postmaster_pid(&self) -> Option<u32> {
        match &self.inner {
            Inner::Local(c) => c.postmaster().and_then(|s| s.pid()),
            Inner::External { .. } => None,
        }
    }

    /// Creates database `name` (letters, digits and `_` only) and returns its URL.
    pub fn create_database(&self, name: &str) -> Result<String, String> {
        self.psql("postgres", &create_database_sql(name)?)?;
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
        self.create_database(&unique_database_name(prefix))
    }

    /// Runs one SQL command with `psql` in database `db`; returns its unaligned output.
    pub fn psql(&self, db: &str, sql: &str) -> Result<String, String> {
        match &self.inner {
            Inner::Local(c) => c.psql(db, sql),
            Inner::External { url } => run_psql(&psql_on_path(), &replace_database(url, db), sql),
        }
    }

    /// SIGKILL to the postmaster, as a crash would (private clusters only).
    pub fn kill_postmaster(&mut self) -> Result<(), String> {
        if let Some(s) = self.local_mut()?.postmaster_mut() {
            s.kill();
        }
        Ok(())
    }

    /// SIGKILL to the postmaster, then waits (10 s at most) until its backends, orphaned, have
    /// exited too: the whole server down, as after its host crashed. Right after
    /// [`TempCluster::kill_postmaster`] alone an orphaned backend may still answer a pooled
    /// connection for a few milliseconds (a test calling the state API in process got a claim
    /// through in that window).
    pub fn kill_server(&mut self) -> Result<(), String> {
        let backends = self.postmaster_pid().map(children_of).unwrap_or_default();
        self.kill_postmaster()?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while backends
            .iter()
            .any(|pid| Path::new(&format!("/proc/{pid}")).exists())
        {
            if std::time::Instant::now() > deadline {
                return Err(format!(
                    "backends of the killed postmaster still run: {backends:?}"
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Ok(())
    }

    /// Freezes every process of the server (SIGSTOP: a stalled host or disk, the statements
    /// in flight hang without an error) or thaws it (SIGCONT). Private clusters only.
    pub fn signal_all(&mut self, signal: Signal) -> Result<(), String> {
        let pid = self
            .local_mut()?
            .postmaster()
            .and_then(|s| s.pid())
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

    /// Starts the server again on the same port and data (after `kill_postmaster`); crash
    /// recovery runs as after a real crash. Private clusters only.
    pub fn restart(&mut self) -> Result<(), String> {
        self.local_mut()?.restart()
    }

    fn local_mut(&mut self) -> Result<&mut Cluster, String> {
        match &mut self.inner {
            Inner::Local(c) => Ok(c),
            Inner::External { .. } => Err(
                "not possible on the DATABASE_URL server: use TempCluster::start_private()".into(),
            ),
        }
    }
}

/// The certificate and key for `ssl=on` (the key readable by the server's user only, or
/// Postgres refuses it) in the cluster's folder `root`, `ssl` turned on in its configuration,
/// and `hostssl` instead of `host` when only TLS is accepted.
fn write_tls_files(root: &Path, run_as: Option<(u32, u32)>, tls: &ServerTls) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt as _;
    let write = |name: &str, text: &str, mode: u32| -> Result<(), String> {
        let path = root.join(name);
        fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .map_err(|e| format!("cannot chmod {}: {e}", path.display()))?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                .map_err(|e| format!("cannot chown {}: {e}", path.display()))?;
        }
        Ok(())
    };
    write(TLS_CERT_FILE, &tls.cert_pem, 0o644)?;
    write(TLS_KEY_FILE, &tls.key_pem, 0o600)?;
    let conf = root.join("data/postgresql.conf");
    let settings = format!(
        "\nssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
        root.join(TLS_CERT_FILE).display(),
        root.join(TLS_KEY_FILE).display()
    );
    fs::OpenOptions::new()
        .append(true)
        .open(&conf)
        .and_then(|mut f| std::io::Write::write_all(&mut f, settings.as_bytes()))
        .map_err(|e| format!("cannot write {}: {e}", conf.display()))?;
    if tls.require {
        let hba = root.join("data/pg_hba.conf");
        let text =
            fs::read_to_string(&hba).map_err(|e| format!("cannot read {}: {e}", hba.display()))?;
        let only_tls: String = text
            .lines()
            .map(|l| match l.strip_prefix("host ") {
                Some(rest) => format!("hostssl {rest}\n"),
                None => format!("{l}\n"),
            })
            .collect();
        fs::write(&hba, only_tls).map_err(|e| format!("cannot write {}: {e}", hba.display()))?;
    }
    Ok(())
}

fn psql_on_path() -> PathBuf {
    find_bin_dir()
        .map(|d| d.join("psql"))
        .unwrap_or_else(|_| PathBuf::from("psql"))
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

/// The port a Postgres URL names (5432 when it names none).
fn port_of_url(url: &str) -> u16 {
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
    use super::*;

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
        assert_eq!(port_of_url("postgres://u:p@h:6543/db"), 6543);
        assert_eq!(port_of_url("postgres://h/db"), 5432);
        assert_eq!(port_of_url("postgres://postgres@127.0.0.1:40001/x"), 40001);
    }
}
