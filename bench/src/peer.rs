//! The peer users would otherwise build: the seeds' own design, an in-app claim in a Node
//! checkout on the same Postgres (bench/peers/seed-node, from `../shared/peers/seed-node`), driven
//! by the same load generator and body as our scenarios so both are measured in one run.

use contract::state_env;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use test_support::process::{workspace_root, ChildGuard};
use test_support::stack::Stack;

/// The seeds' table, as its bench.sh creates it.
const SEED_TABLE: &str = "CREATE TABLE IF NOT EXISTS idempotency_keys (key text NOT NULL, \
    subject_id text NOT NULL, endpoint text NOT NULL, request_hash text NOT NULL, \
    status text NOT NULL, response_code int, response_body jsonb, \
    created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (key, subject_id, endpoint))";

pub struct SeedNode {
    pub port: u16,
    pub pid: u32,
    _child: ChildGuard,
}

/// A writable copy of the peer with its one dependency (`pg`) installed from the lock file.
fn prepared_copy() -> Result<PathBuf, String> {
    let root = workspace_root();
    let source = root.join("bench/peers/seed-node");
    let copy = root.join("target/peers/seed-node");
    std::fs::create_dir_all(&copy).map_err(|e| format!("{}: {e}", copy.display()))?;
    for file in ["server.mjs", "package.json", "package-lock.json"] {
        std::fs::copy(source.join(file), copy.join(file))
            .map_err(|e| format!("copying the seed peer's {file}: {e}"))?;
    }
    if !copy.join("node_modules/pg/package.json").is_file() {
        eprintln!("bench: installing the seed peer's dependencies (npm ci) ...");
        let status = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--silent"])
            .current_dir(&copy)
            .stdin(Stdio::null())
            .status()
            .map_err(|e| format!("cannot run npm ({e}): the seed peer needs Node 20 and npm (apt install nodejs npm)"))?;
        if !status.success() {
            return Err(format!("npm ci in {} failed ({status})", copy.display()));
        }
    }
    Ok(copy)
}

impl SeedNode {
    /// Starts `node server.mjs` (MODE=seed) on the stack's database, with an empty table.
    pub fn start(stack: &Stack, dir: &Path) -> Result<Self, String> {
        let copy = prepared_copy()?;
        stack.postgres.psql(
            stack.database_name(),
            &format!("{SEED_TABLE}; TRUNCATE idempotency_keys"),
        )?;
        let port = test_support::net::free_port();
        let log_path = dir.join(format!("seed-node-{port}.log"));
        let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new("node");
        cmd.arg("server.mjs")
            .current_dir(&copy)
            .env("PORT", port.to_string())
            .env("MODE", "seed")
            .env(state_env::DATABASE_URL, &stack.database_url)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        let mut child = ChildGuard::spawn("seed-node", &mut cmd)?;
        if let Err(e) = test_support::net::wait_for_port(port, Duration::from_secs(15)) {
            let tail = test_support::process::log_tail(&log_path);
            child.kill();
            return Err(format!(
                "the seed peer did not listen on :{port}: {e}\n{tail}"
            ));
        }
        let pid = child
            .pid()
            .ok_or_else(|| "the seed peer exited during start-up".to_owned())?;
        Ok(Self {
            port,
            pid,
            _child: child,
        })
    }
}
