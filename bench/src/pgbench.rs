//! The physical limit of the database: pgbench running the claim's single-row
//! `INSERT ... ON CONFLICT DO NOTHING RETURNING` into the same table (own database, same
//! cluster, same server settings), as the postgres user when we are root.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Serialize;
use test_support::postgres::TempCluster;

/// The statement: the INSERT branch of the state API's claim (state-api/src/store/claim.rs CLAIM_SQL),
/// with a random 32-byte scope hash, so every transaction inserts a new row and commits.
pub const SCRIPT: &str = "INSERT INTO idempotency_records
    (scope_hash, subject, endpoint, fingerprint_alg, fingerprint, state, fencing_token,
     lease_expires_at, created_at, expires_at)
VALUES (sha256(convert_to(random()::text || clock_timestamp()::text, 'UTF8')), 'bench', 'POST /checkout',
        'sha256-jcs-v2', repeat('ab', 32), 'in_progress', nextval('idempotency_fencing_token_seq'),
        clock_timestamp() + interval '30 s', clock_timestamp(), clock_timestamp() + interval '1 day')
ON CONFLICT (scope_hash) DO NOTHING
RETURNING fencing_token;
";

#[derive(Debug, Clone, Serialize)]
pub struct PgbenchResult {
    pub clients: usize,
    pub transactions: u64,
    pub failed: u64,
    pub tps: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Percentile curve, for the plot: [percentile, ms].
    pub percentiles: Vec<(f64, f64)>,
    /// Postgres's CPU (postmaster and backends) per transaction, µs: the baseline of the state
    /// API's Postgres share per new key.
    pub postgres_cpu_us_per_tx: Option<f64>,
}

pub struct Pgbench {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    db: String,
    run_as: Option<(u32, u32)>,
}

impl Pgbench {
    /// Creates the database with the state API's schema (its migration file) and the script.
    pub fn prepare(cluster: &TempCluster, run_dir: &Path) -> Result<Self, String> {
        let db = "bench_pgbench";
        cluster.create_database(db)?;
        let migrations = test_support::process::workspace_root().join("state-api/migrations");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&migrations)
            .map_err(|e| format!("{}: {e}", migrations.display()))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "sql"))
            .collect();
        files.sort();
        for f in files {
            let sql = std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
            cluster.psql(db, &sql)?;
        }
        Self::on(cluster, run_dir, db)
    }

    /// The script against a database that already has the state API's schema (bench-scale's
    /// records curve: its loaded table).
    pub fn on(cluster: &TempCluster, run_dir: &Path, db: &str) -> Result<Self, String> {
        let bin = test_support::postgres::find_bin_dir()?.join("pgbench");
        if !bin.is_file() {
            return Err(format!(
                "{} not found (it comes with the postgresql-15 package)",
                bin.display()
            ));
        }
        let dir = run_dir.join("pgbench");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("claim_insert.sql"), SCRIPT).map_err(|e| e.to_string())?;
        let run_as = postgres_ids()?;
        if let Some((uid, gid)) = run_as {
            let ok = Command::new("chown")
                .arg("-R")
                .arg(format!("{uid}:{gid}"))
                .arg(&dir)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                return Err(format!(
                    "cannot chown {} to the postgres user",
                    dir.display()
                ));
            }
        }
        Ok(Self {
            bin,
            dir,
            port: cluster.port(),
            db: db.to_owned(),
            run_as,
        })
    }

    /// A run after the bench's settling and a second's warm-up, with Postgres's CPU per
    /// transaction (its backends' CPU is the postmaster's reaped children's once they exit).
    pub(crate) fn measured_run(
        &self,
        bench: &crate::Bench<'_>,
        clients: usize,
        seconds: u64,
    ) -> Result<PgbenchResult, String> {
        bench.settle();
        self.run(clients, 1, "warmup")?;
        let postgres_ticks = || bench.procs.postgres.map(crate::procfs::tree_ticks);
        let before = postgres_ticks();
        let mut r = self.run(clients, seconds, "measure")?;
        std::thread::sleep(std::time::Duration::from_millis(200));
        if let (Some(a), Some(b)) = (before, postgres_ticks()) {
            let secs = b.saturating_sub(a) as f64 / bench.tck;
            r.postgres_cpu_us_per_tx = Some(secs * 1e6 / r.transactions.max(1) as f64);
        }
        Ok(r)
    }

    /// One pgbench run of `seconds` with `clients` connections (prepared statements, 2 threads
    /// at most: the machine has 2 cores). Latencies come from pgbench's per-transaction log.
    pub fn run(&self, clients: usize, seconds: u64, label: &str) -> Result<PgbenchResult, String> {
        let prefix = format!("log-{label}-{clients}");
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let threads = clients.min(2);
        let mut cmd = Command::new(&self.bin);
        cmd.current_dir(&self.dir)
            .args(["-n", "-M", "prepared", "-h", "127.0.0.1", "-U", "postgres"])
            .args(["-p", &self.port.to_string()])
            .args([
                "-c",
                &clients.to_string(),
                "-j",
                &threads.to_string(),
                "-T",
                &seconds.to_string(),
            ])
            .args([
                "-f",
                "claim_insert.sql",
                "--log",
                &format!("--log-prefix={prefix}"),
            ])
            .arg(&self.db)
            .stdin(Stdio::null());
        if let Some((uid, gid)) = self.run_as {
            use std::os::unix::process::CommandExt as _;
            cmd.uid(uid).gid(gid);
        }
        let out = cmd
            .output()
            .map_err(|e| format!("cannot run pgbench: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(format!(
                "pgbench failed: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let tps = stdout
            .lines()
            .find(|l| l.starts_with("tps = "))
            .and_then(|l| l.trim_start_matches("tps = ").split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| format!("no tps in pgbench output: {stdout}"))?;
        let failed = stdout
            .lines()
            .find(|l| l.starts_with("number of failed transactions"))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut lat_us: Vec<u32> = Vec::new();
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            if !e.file_name().to_string_lossy().starts_with(&prefix) {
                continue;
            }
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            // client_id transaction_no time(us) script_no time_epoch time_us
            lat_us.extend(
                text.lines()
                    .filter_map(|l| l.split_whitespace().nth(2))
                    .filter_map(|v| v.parse::<u32>().ok()),
            );
            let _ = std::fs::remove_file(e.path());
        }
        lat_us.sort_unstable();
        let pct = |p: f64| crate::load::percentile(&lat_us, p) / 1000.0;
        Ok(PgbenchResult {
            clients,
            transactions: lat_us.len() as u64,
            failed,
            tps,
            p50_ms: pct(50.0),
            p90_ms: pct(90.0),
            p99_ms: pct(99.0),
            max_ms: pct(100.0),
            percentiles: crate::PERCENTILES.iter().map(|&p| (p, pct(p))).collect(),
            postgres_cpu_us_per_tx: None,
        })
    }
}

/// uid and gid of `postgres` when we are root (the cluster's own user), else None.
fn postgres_ids() -> Result<Option<(u32, u32)>, String> {
    let id = |args: &[&str]| -> Result<u32, String> {
        let out = Command::new("id")
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|_| {
                format!(
                    "id {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            })
    };
    if id(&["-u"])? != 0 {
        return Ok(None);
    }
    let user = std::env::var("PG_RUN_AS").unwrap_or_else(|_| "postgres".into());
    Ok(Some((id(&["-u", &user])?, id(&["-g", &user])?)))
}
