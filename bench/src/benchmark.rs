//! `make bench` itself: the settings it reads, the Envoys (and peers) it starts beside the
//! stack, the scenarios at each concurrency, the waiting retries, pgbench and the purge, and what
//! it writes (docs/bench.json, docs/BENCH.md, docs/bench.png).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use test_support::envoy::Envoy;
use test_support::stack::{Stack, StackOptions};

use crate::cpu::Procs;
use crate::fleet::Fleet;
use crate::load::{Conn, Outcome};
use crate::measure::{Bench, ScenarioResult};
use crate::ops::{
    checkout_req, claim_complete, op_claim_complete, op_claim_completed, op_created, op_inflight,
    op_replay,
};
use crate::{
    addr, bench_doc, env_u64, pgbench, plot, procfs, purge, report, wait_for_quiet, waiting,
};

/// Keys completed before the replay runs; the replay clients cycle through them.
const REPLAY_KEYS: usize = 100;

/// The slow requests that hold a key while a crowd retries it; each must end in 201.
type SlowRequest = tokio::task::JoinHandle<Result<u16, String>>;

/// What the environment asks of this run (the module documentation of main.rs lists it).
struct Settings {
    measure_s: u64,
    warmup_s: u64,
    levels: Vec<usize>,
    out_dir: PathBuf,
    /// Extra state API settings for experiments, e.g.
    /// BENCH_STATE_API_ENV="STATE_API_POOL_PING=false".
    state_api_env: Vec<(String, String)>,
    /// BENCH_SCENARIOS="new,replay" runs a subset (for profiling); default: all.
    only: Option<Vec<String>>,
}

impl Settings {
    fn from_env() -> Self {
        Self {
            measure_s: env_u64("BENCH_SECONDS", 8),
            warmup_s: env_u64("BENCH_WARMUP_SECONDS", 2),
            levels: std::env::var("BENCH_CONNECTIONS")
                .unwrap_or_else(|_| "1,16".into())
                .split(',')
                .filter_map(|v| v.trim().parse().ok())
                .filter(|&n| n > 0)
                .collect(),
            out_dir: std::env::var("BENCH_OUT")
                .map(PathBuf::from)
                .unwrap_or_else(|_| test_support::process::workspace_root().join("docs")),
            state_api_env: std::env::var("BENCH_STATE_API_ENV")
                .unwrap_or_default()
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .collect(),
            only: std::env::var("BENCH_SCENARIOS")
                .ok()
                .map(|v| v.split(',').map(|s| s.trim().to_owned()).collect()),
        }
    }

    fn wanted(&self, name: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|s| s == name))
    }

    fn hold_secs(&self) -> u64 {
        hold_secs(self.warmup_s, self.measure_s)
    }
}

pub(crate) fn run() -> Result<(), String> {
    let started = Instant::now();
    // Release builds of the services (`make build-release`), like `make demo`.
    if std::env::var_os("STACK_PROFILE").is_none() {
        std::env::set_var("STACK_PROFILE", "release");
    }
    let settings = Settings::from_env();
    wait_for_quiet(Duration::from_secs(env_u64("BENCH_QUIET_WAIT_SECONDS", 90)));
    let load_before = procfs::loadavg();
    eprintln!(
        "bench: load average before start {:.2} {:.2} {:.2} on {} cores",
        load_before.0,
        load_before.1,
        load_before.2,
        procfs::cpu_count()
    );
    eprintln!("bench: starting the stack (release builds, Envoy --concurrency 1) ...");
    let stack_started = Instant::now();
    let stack = Stack::start(StackOptions {
        state_api_env: settings.state_api_env.clone(),
        ..StackOptions::default()
    })?;
    let fleet = Fleet::start(&stack, |name| settings.wanted(name))?;
    let wasm_bytes = std::fs::metadata(test_support::envoy::filter_wasm()?)
        .map(|m| m.len())
        .map_err(|e| e.to_string())?;
    let procs = fleet.procs(&stack)?;
    eprintln!(
        "bench: stack up in {:.1} s; logs in {}",
        stack_started.elapsed().as_secs_f64(),
        stack.dir.display()
    );

    // A single-threaded load generator (like `wrk -t1`): the machine has two cores to share
    // between it, Envoy, the checkout, the state API and Postgres.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let bench = Bench {
        rt,
        postgres: &stack.postgres,
        database: stack.database_name().to_owned(),
        procs: procs.clone(),
        state_api_port: stack.state_api.port,
        tck: procfs::clk_tck(),
        warmup: Duration::from_secs(settings.warmup_s),
        measure: Duration::from_secs(settings.measure_s),
        started,
        retry_budget_until: started + Duration::from_secs(240),
        window_counters: None,
    };
    let mut session = Session::open(&bench, &stack, &fleet, &settings)?;
    for &c in &settings.levels {
        eprintln!("bench: {c} connection(s)");
        session.level(c)?;
    }
    let waiting = session.waiting()?;
    let pgbench = session.pgbench()?;
    let purge = session.purge()?;
    let slow_statuses = session.slow_statuses();
    let results = session.results;

    let rep = report::Report::build(report::Inputs {
        results,
        pgbench,
        memory: memory(&procs),
        wasm_bytes,
        slow_statuses,
        load_before,
        load_after: procfs::loadavg(),
        warmup_s: settings.warmup_s,
        measure_s: settings.measure_s,
        envoy_version: envoy_version()?,
        total_s: bench.started.elapsed().as_secs_f64(),
        stack_dir: stack.dir.display().to_string(),
        state_api_env: settings.state_api_env.clone(),
        storage: storage(&stack),
        envoy_stats: envoy_stats(&fleet.envoys(&stack)),
        waiting,
        purge,
    });
    write(&rep, &settings.out_dir, started)?;
    drop(fleet);
    drop(stack);
    Ok(())
}

/// The scenarios of one run, on one stack: what they measured, and the slow requests still
/// holding keys.
struct Session<'a> {
    bench: &'a Bench<'a>,
    stack: &'a Stack,
    fleet: &'a Fleet,
    settings: &'a Settings,
    run_id: String,
    envoy_addr: SocketAddr,
    replay_keys: Arc<Vec<String>>,
    results: Vec<ScenarioResult>,
    slow: Vec<SlowRequest>,
}

impl<'a> Session<'a> {
    /// Completes the keys the replay runs send again.
    fn open(
        bench: &'a Bench<'a>,
        stack: &'a Stack,
        fleet: &'a Fleet,
        settings: &'a Settings,
    ) -> Result<Self, String> {
        let run_id = format!("b{}", std::process::id());
        let replay_keys: Arc<Vec<String>> = Arc::new(
            (0..REPLAY_KEYS)
                .map(|i| format!("{run_id}-replay-{i}"))
                .collect(),
        );
        let envoy_addr = addr(fleet.filter_envoy(stack).params.listen_port);
        bench.rt.block_on(async {
            let mut conn = Conn::open(envoy_addr).await?;
            for k in replay_keys.iter() {
                let a = conn.send(&checkout_req(k)).await?;
                if a.status != 201 {
                    return Err(format!(
                        "setting up replay key {k}: status {} {}",
                        a.status,
                        String::from_utf8_lossy(&a.body)
                    ));
                }
            }
            Ok::<(), String>(())
        })?;
        Ok(Self {
            bench,
            stack,
            fleet,
            settings,
            run_id,
            envoy_addr,
            replay_keys,
            results: Vec::new(),
            slow: Vec::new(),
        })
    }

    fn push(&mut self, r: ScenarioResult) {
        eprintln!(
            "  {:<22} c={:<3} {:>8.0}/s  p50 {:>6.3} ms  p99 {:>6.3} ms  errors {}  (other work {:.2} cores)",
            r.label, r.connections, r.rate, r.p50_ms, r.p99_ms, r.error_count, r.cpu.other_cores
        );
        self.results.push(r);
    }

    /// Every scenario at `c` connections, in the report's order.
    fn level(&mut self, c: usize) -> Result<(), String> {
        self.fresh_keys(c);
        if self.settings.wanted("replay") {
            let (r, cpu, n) =
                self.bench
                    .measure(self.envoy_addr, c, &op_replay(self.replay_keys.clone()));
            let op = "POST /checkout, completed key (100 keys)";
            self.push(ScenarioResult::new(
                "replay",
                "replays",
                op,
                "201 + Idempotent-Replayed",
                &r,
                cpu,
                n,
            ));
        }
        self.inflight(c)?;
        if self.settings.wanted("state_api_dup") {
            self.state_api_dup(c)?;
        }
        if self.settings.wanted("state_api") {
            let (r, cpu, n) = self.bench.measure(
                addr(self.stack.state_api.port),
                c,
                &op_claim_complete(format!("{}-api-{c}", self.run_id)),
            );
            let op = "POST /v1/claim then POST /v1/complete, direct";
            self.push(ScenarioResult::new(
                "state_api",
                "state API claim+complete",
                op,
                "200, 200",
                &r,
                cpu,
                n,
            ));
        }
        Ok(())
    }

    /// Scenarios that send a new key with every request.
    fn fresh_keys(&mut self, c: usize) {
        let fleet = self.fleet;
        // (id, label, what is sent, the expected answer, the port it goes to: an Envoy, or the
        // seed design with no Envoy).
        let fresh_keys = [
            ("plain", "plain Envoy", "POST /checkout, router only", "201", Some(port(&fleet.plain))),
            (
                "jwt",
                "Envoy + jwt_authn",
                "POST /checkout, jwt_authn + router (no idempotency filter)",
                "201",
                Some(port(&fleet.jwt)),
            ),
            (
                "new",
                "new keys",
                "POST /checkout, new key: claim, upstream, complete",
                "201, not replayed",
                Some(port(fleet.filter_envoy(self.stack))),
            ),
            (
                "new_bg",
                "new keys (background complete)",
                "POST /checkout, new key, complete_in_background: the response goes on, then the worker stores it",
                "201, not replayed",
                fleet.background.as_ref().map(port),
            ),
            (
                "new_single",
                "new keys (nothing batched)",
                "POST /checkout, new key, batch_max = 1: every claim its own callout",
                "201, not replayed",
                fleet.single.as_ref().map(port),
            ),
            (
                "new_tls",
                "new keys, state API over mTLS",
                "POST /checkout, new key; Envoy -> state API over mutual TLS (a second state API on the same database)",
                "201, not replayed",
                fleet.tls_hop.as_ref().map(|(_, envoy)| port(envoy)),
            ),
            (
                "seed_new",
                "seed design: new keys",
                "POST /checkout, new key, to the seeds' in-app claim (Node + pg, same Postgres; no Envoy)",
                "201, not replayed",
                fleet.seed.as_ref().map(|s| s.port),
            ),
            (
                "seed_edge",
                "seed design behind Envoy",
                "POST /checkout, new key, through an Envoy with jwt_authn (no idempotency filter) to the seeds' in-app claim",
                "201, not replayed",
                fleet.seed_edge.as_ref().map(port),
            ),
        ];
        for (id, label, op, expect, target) in fresh_keys {
            let Some(target) = target.filter(|_| self.settings.wanted(id)) else {
                continue;
            };
            let prefix = format!("{}-{id}-{c}", self.run_id);
            let (r, cpu, n) = self.bench.measure(addr(target), c, &op_created(prefix));
            self.push(ScenarioResult::new(id, label, op, expect, &r, cpu, n));
        }
    }

    /// Duplicates of a key a slow request holds: ours, and the seed design's.
    fn inflight(&mut self, c: usize) -> Result<(), String> {
        let inflight = [
            ("inflight", "in-flight duplicates", Some(self.envoy_addr)),
            (
                "seed_inflight",
                "seed design: in-flight duplicates",
                self.fleet.seed.as_ref().map(|s| addr(s.port)),
            ),
        ];
        for (id, label, target) in inflight {
            let Some(target) = target.filter(|_| self.settings.wanted(id)) else {
                continue;
            };
            // One slow request holds the key while the crowd retries it.
            let held = format!("{}-{id}-held-{c}", self.run_id);
            let hold_ms = self.settings.hold_secs() * 1000;
            self.slow
                .push(hold_key(&self.bench.rt, target, &held, hold_ms, label)?);
            let (r, cpu, n) = self.bench.measure(target, c, &op_inflight(held));
            let op = "POST /checkout, key held by a slow request";
            self.push(ScenarioResult::new(
                id,
                label,
                op,
                "409 + Retry-After",
                &r,
                cpu,
                n,
            ));
        }
        Ok(())
    }

    /// The state API alone, the replay path: keys claimed and completed directly first, then
    /// claimed again in a loop.
    fn state_api_dup(&mut self, c: usize) -> Result<(), String> {
        let keys: Arc<Vec<String>> = Arc::new(
            (0..REPLAY_KEYS)
                .map(|i| format!("{}-apidup-{c}-{i}", self.run_id))
                .collect(),
        );
        let api = addr(self.stack.state_api.port);
        let setup_keys = keys.clone();
        self.bench.rt.block_on(async move {
            let mut conn = Conn::open(api).await?;
            for k in setup_keys.iter() {
                if let Outcome::Wrong(w) = claim_complete(&mut conn, k.clone()).await? {
                    return Err(format!("setting up direct replay keys: {w}"));
                }
            }
            Ok::<(), String>(())
        })?;
        let (r, cpu, n) = self.bench.measure(api, c, &op_claim_completed(keys));
        let op = "POST /v1/claim of a completed key, direct (the replay path without Envoy)";
        self.push(ScenarioResult::new(
            "state_api_dup",
            "state API claim (completed)",
            op,
            "200 completed",
            &r,
            cpu,
            n,
        ));
        Ok(())
    }

    /// What retries that wait for a running key cost, against the same clients retrying at
    /// Retry-After (one request a second each, no wait).
    fn waiting(&mut self) -> Result<Vec<waiting::WaitCost>, String> {
        let mut waiting_results = Vec::new();
        if !self.settings.wanted("waiting") {
            return Ok(waiting_results);
        }
        let held = format!("{}-waited", self.run_id);
        let hold_ms = 2 * self.settings.hold_secs() * 1000 + 10_000;
        self.slow.push(hold_key(
            &self.bench.rt,
            self.envoy_addr,
            &held,
            hold_ms,
            "waiting retries",
        )?);
        let waiters = env_u64("BENCH_WAITERS", 16) as usize;
        let wait_s = 5;
        let runs = [
            (
                "wait",
                checkout_req(&held).header("prefer", &format!("wait={wait_s}")),
                Duration::ZERO,
            ),
            ("poll", checkout_req(&held), Duration::from_secs(1)),
        ];
        for (mode, req, pause) in runs {
            let r = waiting::measure(
                self.bench,
                self.envoy_addr,
                mode,
                waiters,
                wait_s,
                req,
                pause,
            )?;
            eprintln!(
                "  {:<22} waiters={:<3} {:>6.3} claims/waiter/s  {:>6.3} ms CPU/waiter/s  ({} answers)",
                format!("retries ({mode})"),
                r.waiters,
                r.claims_per_waiter_s,
                r.total_cpu_ms_per_waiter_s,
                r.answers
            );
            waiting_results.push(r);
        }
        Ok(waiting_results)
    }

    /// pgbench on the same cluster.
    fn pgbench(&self) -> Result<Vec<pgbench::PgbenchResult>, String> {
        let mut pg_results = Vec::new();
        if !self.settings.wanted("pgbench") {
            return Ok(pg_results);
        }
        let bench = self.bench;
        let pg = pgbench::Pgbench::prepare(&self.stack.postgres, &self.stack.dir)?;
        for &c in &self.settings.levels {
            let r = pg.measured_run(bench, c, self.settings.measure_s)?;
            eprintln!(
                "  {:<22} c={:<3} {:>8.0}/s  p50 {:>6.3} ms  p99 {:>6.3} ms  failed {}",
                "pgbench INSERT", c, r.tps, r.p50_ms, r.p99_ms, r.failed
            );
            pg_results.push(r);
        }
        Ok(pg_results)
    }

    /// The purge against a backlog, after everything else (it deletes rows as fast as it can),
    /// beside the highest new-key rate measured.
    fn purge(&self) -> Result<Option<purge::PurgeCapacity>, String> {
        if !self.settings.wanted("purge") {
            return Ok(None);
        }
        let rows = env_u64("BENCH_PURGE_ROWS", 300_000);
        let (done, seconds) = purge::measure(self.stack, rows)?;
        let (scenario, rate) = self
            .results
            .iter()
            .filter(|r| r.scenario.starts_with("new") || r.scenario == "state_api")
            .map(|r| (format!("{} c={}", r.label, r.connections), r.rate))
            .fold((String::new(), 0.0), |a, b| if b.1 > a.1 { b } else { a });
        let p = purge::PurgeCapacity {
            rows: done,
            seconds,
            rows_per_s: done as f64 / seconds,
            highest_new_keys_per_s: rate,
            highest_new_keys_scenario: scenario,
            ratio: if rate > 0.0 {
                done as f64 / seconds / rate
            } else {
                0.0
            },
        };
        eprintln!(
            "  {:<22} {:>8} rows in {:.1} s: {:>8.0}/s, {:.1}x the highest new-key rate ({:.0}/s, {})",
            "purge backlog", p.rows, p.seconds, p.rows_per_s, p.ratio, p.highest_new_keys_per_s, p.highest_new_keys_scenario
        );
        Ok(Some(p))
    }

    /// The slow requests have finished by now (or finish within their delay): each must be 201.
    fn slow_statuses(&mut self) -> Vec<String> {
        let mut slow_statuses = Vec::new();
        let limit = Duration::from_secs(self.settings.hold_secs() + 10);
        for h in std::mem::take(&mut self.slow) {
            let s = self
                .bench
                .rt
                .block_on(async { tokio::time::timeout(limit, h).await });
            slow_statuses.push(match s {
                Ok(Ok(Ok(status))) => status.to_string(),
                Ok(Ok(Err(e))) => format!("error: {e}"),
                Ok(Err(e)) => format!("task: {e}"),
                Err(_) => "timeout".into(),
            });
        }
        slow_statuses
    }
}

/// Each watched process's peak and current resident memory.
fn memory(procs: &Procs) -> BTreeMap<String, report::Memory> {
    procs
        .named
        .iter()
        .map(|(name, pid)| {
            (
                (*name).to_owned(),
                report::Memory {
                    hwm_kib: procfs::status_kib(*pid, "VmHWM").unwrap_or(0),
                    rss_kib: procfs::status_kib(*pid, "VmRSS").unwrap_or(0),
                },
            )
        })
        .collect()
}

/// What a record costs on disk (table, TOAST and indexes), for docs/SCALING.md.
fn storage(stack: &Stack) -> Option<report::Storage> {
    let db_name = stack.database_name();
    stack
        .postgres
        .psql(
            db_name,
            "SELECT count(*) || ' ' || pg_total_relation_size('idempotency_records') || ' ' || pg_indexes_size('idempotency_records') FROM idempotency_records",
        )
        .ok()
        .and_then(|s| {
            let v: Vec<u64> = s.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            (v.len() == 3).then(|| report::Storage { rows: v[0], total_bytes: v[1], index_bytes: v[2] })
        })
}

/// Each Envoy's connection and request counters to the state API and the checkout, with the
/// filter's batch counters: how many claims and completes shared a callout.
fn envoy_stats(envoys: &[(&'static str, &Envoy)]) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut envoy_stats = BTreeMap::new();
    for (name, envoy) in envoys {
        let body = envoy.admin_get("/stats?filter=^(cluster\\.(state_api|checkout)\\.upstream_(cx_total|rq_total|cx_destroy|cx_max_requests|rq_pending_overflow|rq_timeout)|wasmcustom\\.idempotency\\.(claim_batches|claims_batched|complete_batches|completes_batched|claimed))$").unwrap_or_default();
        let stats: BTreeMap<String, u64> = body
            .lines()
            .filter_map(|l| l.split_once(": "))
            .filter_map(|(k, v)| v.trim().parse().ok().map(|v| (k.to_owned(), v)))
            .collect();
        envoy_stats.insert((*name).to_owned(), stats);
    }
    envoy_stats
}

fn envoy_version() -> Result<String, String> {
    Ok(
        std::process::Command::new(test_support::envoy::envoy_binary()?)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default(),
    )
}

/// docs/bench.json, docs/BENCH.md (the soak's and bench-scale's sections kept) and the plot.
fn write(rep: &report::Report, out_dir: &std::path::Path, started: Instant) -> Result<(), String> {
    println!("{}", rep.text_table());
    std::fs::create_dir_all(out_dir).map_err(|e| e.to_string())?;
    let json_path = out_dir.join("bench.json");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(rep).map_err(|e| e.to_string())? + "\n",
    )
    .map_err(|e| e.to_string())?;
    let md_path = out_dir.join("BENCH.md");
    // The soak's and bench-scale's sections stay: they are runs of their own.
    let previous = std::fs::read_to_string(&md_path).unwrap_or_default();
    let markdown = bench_doc::keep_sections(&previous, rep.markdown());
    std::fs::write(&md_path, markdown).map_err(|e| e.to_string())?;
    let png_path = out_dir.join("bench.png");
    plot(&json_path, &png_path);
    eprintln!(
        "bench: wrote {}, {} in {:.0} s",
        json_path.display(),
        md_path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Sends a request that holds `key` for `hold_ms` and waits (bounded) until a probe answers
/// 409: the key is held. The slow request's own status comes from the returned task.
fn hold_key(
    rt: &tokio::runtime::Runtime,
    target: SocketAddr,
    key: &str,
    hold_ms: u64,
    what: &str,
) -> Result<SlowRequest, String> {
    let slow_req = checkout_req(key).header("x-demo-delay-ms", &hold_ms.to_string());
    let handle = rt.spawn(async move {
        let mut conn = Conn::open(target).await?;
        conn.send(&slow_req).await.map(|a| a.status)
    });
    let probe = checkout_req(key);
    let held = rt.block_on(async {
        let mut conn = Conn::open(target).await?;
        for _ in 0..250 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if conn.send(&probe).await?.status == 409 {
                return Ok(true);
            }
        }
        Ok::<bool, String>(false)
    })?;
    if held {
        Ok(handle)
    } else {
        Err(format!(
            "{what}: the slow request did not hold its key within 5 s"
        ))
    }
}

fn hold_secs(warmup_s: u64, measure_s: u64) -> u64 {
    (warmup_s + measure_s) * 2 + 5
}

fn port(envoy: &Envoy) -> u16 {
    envoy.params.listen_port
}
