//! Curve 1, records in the table: a day of keys at 1,000-2,000 new keys a second is 86 to 172
//! million records. The table is loaded with straight SQL (`generate_series`) to each level
//! (0, 10 M, 50 M, 100 M rows; quick: 0, 200 k, 1 M), every level only if the disk keeps
//! SCALE_RECORDS_KEEP_FREE_GIB (8) free after it (estimated from the bytes per row measured on
//! the way), and at each level the state API's claim+complete is measured at 16 connections:
//! CPU per pair (the state API and Postgres), p50 and p99, the WAL (and its full-page images)
//! and the shared-buffer misses per pair. Goal: at 50 M rows, CPU per pair and p99 within 1.3x
//! of the empty table's.
//!
//! The rows are what a day leaves: addresses are SHA-256 of a counter (random 32-byte keys, as
//! the HMAC addresses are), 99.4 % completed with the response of a real claim+complete made
//! through the state API first (its sealed headers and body copied), 0.5 % in progress, created
//! in the order they are written at a day's rate (100 M a day), each level's oldest 1 % past its
//! retention (the purge takes them: it runs all along, as in production) and so lying together,
//! as a day's oldest rows do. Besides CPU and latency each level reports where its misses were
//! (the table's heap or its indexes), how many heap pages the run's new rows went to per row,
//! and the rows the purge deleted per pair. Every run starts after `VACUUM (ANALYZE)` and `CHECKPOINT`, so each pays
//! the full-page images of the leaves it touches first: the cost of random keys in a B-tree
//! larger than memory, as after every checkpoint in production.
//!
//! Every level runs with the cluster's own settings (`wal_compression` lz4, as `edge run` starts
//! it, named in each row). At the largest level the same run is made again once for each trial
//! (SCALE_RECORDS_AB=0 skips them): `wal_compression` the other way (the lever for those
//! full-page images), `full_page_writes = off`, a diagnosis only (a torn page after a crash
//! could not be repaired: never in production), which shows what the full-page images cost,
//! and `max_wal_size = 16GB`, with which no checkpoint comes within the run (Postgres's 1 GB
//! brings one every half minute or so at this WAL rate, and each makes every leaf's next touch
//! log its whole page again). A trial runs only where the cluster lets the setting change:
//! one on the server's command line (as the stack's `wal_compression` is) is not. The cluster
//! is the stack's throwaway one (never `DATABASE_URL`): it is removed with everything loaded
//! into it at the end.
//! SCALE_RECORDS_LEVELS (rows, comma-separated), SCALE_RECORDS_SECONDS (60; quick 10),
//! SCALE_RECORDS_SHARED_BUFFERS (e.g. `4GB`; default: the stack's, Postgres' 128 MB).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use test_support::stack::{Stack, StackOptions};

use super::{at_most, fig, ratio, table, CurveOutput, Goal, Quiet, Settings};
use crate::load::Conn;
use crate::{addr, claim_complete, env_u64, op_claim_complete, procfs, Bench, Procs};

const CONNECTIONS: usize = 16;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

#[derive(Debug, Clone, Serialize)]
struct Level {
    /// Rows loaded (the table also holds the runs' own keys, a few hundred thousand at most).
    rows: u64,
    /// `wal_compression` for this run.
    wal_compression: String,
    /// The setting this run changed (`name=value`) at the largest level; `None`: the cluster's.
    trial: Option<String>,
    table_mib: f64,
    index_mib: f64,
    bytes_per_row: f64,
    pairs_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
    /// µs of CPU per claim+complete pair: the state API and Postgres, and every process.
    state_api_us: f64,
    postgres_us: f64,
    cpu_us: f64,
    all_us: f64,
    wal_bytes_per_pair: f64,
    fpi_per_pair: f64,
    /// Shared-buffer misses (blocks read from the OS) per pair, and the hit ratio.
    blocks_read_per_pair: f64,
    /// Of those, the records table's heap and its indexes.
    heap_reads_per_pair: f64,
    index_reads_per_pair: f64,
    hit_ratio: f64,
    /// Heap pages the run's new rows were written to, per row: where the free space they fill
    /// lies (about 1/9 when they fill pages one after another, 1 when each lands on a page of
    /// its own).
    pages_per_new_row: f64,
    /// Rows the purge deleted during the run, per pair.
    purged_per_pair: f64,
    /// Buffers written out per pair; checkpoints and autovacuums (and autoanalyzes) of the
    /// table within the window.
    written_per_pair: f64,
    checkpoints: f64,
    autovacuums: f64,
    /// The floor: pgbench's single-row INSERT of the claim (a random key, one commit each) on the
    /// same table right after, Postgres's CPU per row (µs) and rows/s.
    floor_us: Option<f64>,
    floor_tps: Option<f64>,
    load_seconds: f64,
    steal_cores: f64,
    other_cores: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Skipped {
    rows: u64,
    why: String,
}

#[derive(Debug, Clone, Serialize)]
struct Records {
    shared_buffers: String,
    /// The cluster's `wal_compression`, which every level runs with (a trial may change it).
    wal_compression: String,
    measure_s: u64,
    levels: Vec<Level>,
    skipped: Vec<Skipped>,
    /// Disk free after the largest level, GiB.
    free_gib_at_largest: f64,
}

/// The database's cumulative WAL and buffer figures, read by the bench at both ends of each
/// measured window ([`crate::Bench::window_counters`]): WAL bytes and full-page images, the
/// database's shared-buffer misses and hits, and the records table's own misses, heap and
/// indexes. (Until the twenty-second round they were read around the whole run, the VACUUM,
/// ANALYZE and CHECKPOINT that settle it and the warm-up included.)
const COUNTERS_SQL: &str = "SELECT (SELECT wal_bytes FROM pg_stat_wal), (SELECT wal_fpi FROM pg_stat_wal), \
     blks_read, blks_hit, \
     (SELECT heap_blks_read FROM pg_statio_user_tables WHERE relname = 'idempotency_records'), \
     (SELECT idx_blks_read FROM pg_statio_user_tables WHERE relname = 'idempotency_records'), \
     (SELECT buffers_checkpoint + buffers_clean + buffers_backend FROM pg_stat_bgwriter), \
     (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter), \
     (SELECT autovacuum_count + autoanalyze_count FROM pg_stat_user_tables WHERE relname = 'idempotency_records') \
     FROM pg_stat_database WHERE datname = current_database()";

/// [`COUNTERS_SQL`]'s differences over a window, by name.
#[derive(Debug, Clone, Copy, Default)]
struct DbCounters {
    wal_bytes: f64,
    wal_fpi: f64,
    blks_read: f64,
    blks_hit: f64,
    heap_read: f64,
    index_read: f64,
    /// Dirty buffers written out (by the checkpointer, the background writer and backends).
    written: f64,
    checkpoints: f64,
    /// Autovacuums and autoanalyzes of the records table.
    autovacuums: f64,
}

impl DbCounters {
    fn from_window(v: &[f64]) -> Self {
        match v {
            [b, f, r, h, hr, ir, w, c, a] => DbCounters {
                wal_bytes: *b,
                wal_fpi: *f,
                blks_read: *r,
                blks_hit: *h,
                heap_read: *hr,
                index_read: *ir,
                written: *w,
                checkpoints: *c,
                autovacuums: *a,
            },
            _ => DbCounters::default(),
        }
    }
}

/// (rows, table bytes, index bytes).
fn sizes(stack: &Stack) -> Result<(u64, u64, u64), String> {
    let out = stack.postgres.psql(
        stack.database_name(),
        "SELECT reltuples::bigint, pg_relation_size('idempotency_records'), \
         pg_indexes_size('idempotency_records') FROM pg_class WHERE relname = 'idempotency_records'",
    )?;
    let v: Vec<u64> = out
        .split('|')
        .filter_map(|x| x.trim().parse::<i64>().ok())
        .map(|x| x.max(0) as u64)
        .collect();
    match v.as_slice() {
        [r, t, i] => Ok((*r, *t, *i)),
        _ => Err(format!("unexpected table sizes {out:?}")),
    }
}

/// A server setting's value and where it comes from (`pg_settings.source`).
fn setting(stack: &Stack, name: &str) -> Result<(String, String), String> {
    let out = stack.postgres.psql(
        stack.database_name(),
        &format!("SELECT setting || '|' || source FROM pg_settings WHERE name = '{name}'"),
    )?;
    match out.trim().split_once('|') {
        Some((value, source)) => Ok((value.to_owned(), source.to_owned())),
        None => Err(format!("{name}: unexpected {out:?}")),
    }
}

/// Bytes free on the file system of `path`.
fn free_bytes(path: &std::path::Path) -> Result<f64, String> {
    let out = std::process::Command::new("df")
        .args(["-B1", "--output=avail"])
        .arg(path)
        .output()
        .map_err(|e| format!("df: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| {
            format!(
                "df {}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

/// A day of keys: 100 M at about 1,157 new keys a second, one every 864 µs. Loaded rows are
/// created in the order they are written (row `i` before row `i + 1`), as a day's claims are:
/// the heap's physical order is the order of creation and so of expiry.
const DAY_OF_KEYS: u64 = 100_000_000;
const MICROS_PER_KEY: u64 = 86_400_000_000 / DAY_OF_KEYS;

/// The INSERT of rows `chunk` (exclusive end) of a level that loads `level` (exclusive end):
/// each column of the table from the template row `t` (a record the state API made), but for
/// the ones a day of keys makes different. The level's last row is created now, each earlier
/// one [`MICROS_PER_KEY`] before it; the level's oldest 1 % is past its retention (the purge's),
/// as the oldest rows of a day are, and lies together at the start of the level's pages, where
/// a day's oldest rows lie. (Until the twenty-second round the 1 % was every hundredth row and
/// the times cycled by the row's number, which spread the purge's deletions, and so the free
/// space new rows fill, over the whole heap: bench/NOTES.md.)
fn insert_sql(
    columns: &[String],
    chunk: std::ops::Range<u64>,
    level: std::ops::Range<u64>,
    token_base: i64,
) -> String {
    let running = "i % 1000 < 5";
    let created = format!(
        "(now() - ({} - i) * interval '{MICROS_PER_KEY} microseconds')",
        level.end - 1
    );
    let expired_below = level.start + (level.end - level.start) / 100;
    let exprs: Vec<String> = columns
        .iter()
        .map(|c| {
            let e = match c.as_str() {
                "scope_hash" => "sha256(('scale-' || i)::text::bytea)".to_owned(),
                "subject" => "'user-' || (i % 100000)".to_owned(),
                "fingerprint" => "md5(i::text) || md5((-i)::text)".to_owned(),
                "state" => format!("CASE WHEN {running} THEN 'in_progress' ELSE 'completed' END"),
                "fencing_token" => format!("{token_base} + i"),
                "created_at" | "owner_seen_at" => created.clone(),
                "lease_expires_at" => format!("{created} + interval '30 seconds'"),
                // The level's oldest 1 %: past their retention, the purge's.
                "expires_at" => format!(
                    "CASE WHEN i < {expired_below} THEN now() - interval '1 minute' \
                     ELSE {created} + interval '1 day' END"
                ),
                "claim_nonce" => "'scale.' || i".to_owned(),
                "completed_at" => format!(
                    "CASE WHEN {running} THEN NULL ELSE {created} + interval '1 second' END"
                ),
                r if r.starts_with("response_") => {
                    format!("CASE WHEN {running} THEN NULL ELSE t.{r} END")
                }
                other => format!("t.{other}"),
            };
            e
        })
        .collect();
    format!(
        "INSERT INTO idempotency_records ({}) SELECT {} FROM generate_series({}, {}) i, \
         (SELECT * FROM idempotency_records WHERE state = 'completed' LIMIT 1) t",
        columns.join(", "),
        exprs.join(", "),
        chunk.start,
        chunk.end - 1
    )
}

/// Loads rows `from..to` in chunks, printing progress.
fn load(
    stack: &Stack,
    columns: &[String],
    from: u64,
    to: u64,
    token_base: i64,
) -> Result<(), String> {
    const CHUNK: u64 = 500_000;
    let started = Instant::now();
    let mut at = from;
    while at < to {
        let next = (at + CHUNK).min(to);
        stack.postgres.psql(
            stack.database_name(),
            &insert_sql(columns, at..next, from..to, token_base),
        )?;
        at = next;
        eprintln!(
            "    loaded {} rows ({:.0} rows/s)",
            at,
            (at - from) as f64 / started.elapsed().as_secs_f64().max(1e-3)
        );
    }
    stack.postgres.psql(
        stack.database_name(),
        &format!("SELECT setval('idempotency_fencing_token_seq', GREATEST(nextval('idempotency_fencing_token_seq'), {}))", token_base + to as i64 + 1),
    )?;
    Ok(())
}

fn levels(settings: &Settings) -> Vec<u64> {
    settings.levels(
        "SCALE_RECORDS_LEVELS",
        "0,10000000,50000000,100000000",
        "0,200000,1000000",
    )
}

pub fn run(settings: &Settings) -> Result<CurveOutput, String> {
    let mut quiet = Quiet::start();
    let measure_s = env_u64(
        "SCALE_RECORDS_SECONDS",
        if settings.quick { 10 } else { 60 },
    );
    let keep_free = env_u64("SCALE_RECORDS_KEEP_FREE_GIB", 8) as f64 * GIB;
    // The loaded rows carry their own expiry: the purge takes the 1 % past it, as in production.
    let (stack, data_dir, shared_buffers) = start_stack()?;
    let db = stack.database_name().to_owned();
    let api = addr(stack.state_api.port);
    // The template: a record made through the state API.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut conn = Conn::open(api).await?;
        claim_complete(&mut conn, format!("scale-template-{}", std::process::id())).await
    })?;
    let (columns, token_base) = template_facts(&stack, &db)?;
    let find =
        |port: u16| procfs::pid_listening_on(port).ok_or(format!("nothing listens on :{port}"));
    let bench = Bench {
        rt,
        postgres: &stack.postgres,
        database: db.clone(),
        procs: Procs {
            named: vec![("state-api", find(stack.state_api.port)?)],
            postgres: procfs::pid_listening_on(stack.postgres.port()),
        },
        state_api_port: stack.state_api.port,
        tck: procfs::clk_tck(),
        warmup: Duration::from_secs(if settings.quick { 2 } else { 5 }),
        measure: Duration::from_secs(measure_s),
        started: Instant::now(),
        retry_budget_until: if settings.quick {
            Instant::now()
        } else {
            Instant::now() + Duration::from_secs(3_600)
        },
        window_counters: Some(COUNTERS_SQL),
    };
    let floor_s = env_u64(
        "SCALE_RECORDS_FLOOR_SECONDS",
        if settings.quick { 5 } else { 20 },
    );
    let floor = Floor {
        pgbench: if floor_s > 0 {
            Some(crate::pgbench::Pgbench::on(
                &stack.postgres,
                &stack.dir,
                &db,
            )?)
        } else {
            None
        },
        seconds: floor_s,
    };
    let mut loaded = 0u64;
    let (wal_compression, _) = setting(&stack, "wal_compression")?;
    let mut curve = Records {
        shared_buffers,
        wal_compression: wal_compression.clone(),
        measure_s,
        levels: Vec::new(),
        skipped: Vec::new(),
        free_gib_at_largest: 0.0,
    };
    // Bytes a loaded row takes (table and indexes), measured on the way; a first guess for the
    // first level: 1 KiB.
    let mut bytes_per_row = 1024.0;
    let wanted = levels(settings);
    for (n, &rows) in wanted.iter().enumerate() {
        if rows > loaded {
            if let Some(why) = no_room(&data_dir, rows - loaded, bytes_per_row, keep_free)? {
                eprintln!("  {rows} rows: skipped, {why}");
                curve.skipped.extend(wanted[n..].iter().map(|&r| Skipped {
                    rows: r,
                    why: why.clone(),
                }));
                break;
            }
            eprintln!("  loading {} rows ...", rows - loaded);
            let t0 = Instant::now();
            load(&stack, &columns, loaded, rows, token_base)?;
            let load_seconds = t0.elapsed().as_secs_f64();
            stack
                .postgres
                .psql(&db, "VACUUM (ANALYZE) idempotency_records")?;
            let (_, table_b, index_b) = sizes(&stack)?;
            bytes_per_row = (table_b + index_b) as f64 / rows.max(1) as f64;
            loaded = rows;
            let level = measure(
                &bench,
                &stack,
                rows,
                &wal_compression,
                None,
                load_seconds,
                &floor,
            )?;
            quiet.note(level.steal_cores, level.other_cores);
            curve.levels.push(level);
        } else {
            let level = measure(&bench, &stack, rows, &wal_compression, None, 0.0, &floor)?;
            quiet.note(level.steal_cores, level.other_cores);
            curve.levels.push(level);
        }
    }
    if env_u64("SCALE_RECORDS_AB", 1) == 1 && loaded > 0 {
        let other = if wal_compression == "off" {
            "lz4"
        } else {
            "off"
        };
        for (name, value) in [
            ("wal_compression", other),
            ("full_page_writes", "off"),
            ("max_wal_size", "16GB"),
        ] {
            // ALTER SYSTEM does not override a setting on the server's command line.
            let (current, source) = setting(&stack, name)?;
            if source == "command line" {
                eprintln!(
                    "  the trial {name}={value}: not run (the cluster's command line sets {current})"
                );
                continue;
            }
            bench
                .postgres
                .psql(&db, &format!("ALTER SYSTEM SET {name} = '{value}'"))?;
            bench.postgres.psql(&db, "SELECT pg_reload_conf()")?;
            let (compression, _) = setting(&stack, "wal_compression")?;
            let trial = format!("{name}={value}");
            let level = measure(
                &bench,
                &stack,
                loaded,
                &compression,
                Some(&trial),
                0.0,
                &floor,
            );
            bench
                .postgres
                .psql(&db, &format!("ALTER SYSTEM RESET {name}"))?;
            bench.postgres.psql(&db, "SELECT pg_reload_conf()")?;
            let level = level?;
            quiet.note(level.steal_cores, level.other_cores);
            curve.levels.push(level);
        }
    }
    curve.free_gib_at_largest = free_bytes(&data_dir).unwrap_or(0.0) / GIB;
    drop(bench);
    // The throwaway cluster, with everything loaded, goes with the stack.
    drop(stack);
    let goals = goals(&curve);
    Ok(CurveOutput {
        name: "records",
        markdown: markdown(&curve),
        json: serde_json::to_value(&curve).map_err(|e| e.to_string())?,
        goals,
        quiet: quiet.end(),
    })
}

/// A stack on a throwaway cluster of its own (shared_buffers from SCALE_RECORDS_SHARED_BUFFERS
/// if set): its data directory and the shared_buffers it runs with.
fn start_stack() -> Result<(Stack, std::path::PathBuf, String), String> {
    let mut stack = Stack::start(StackOptions::default())?;
    if stack.postgres.is_external() {
        return Err("the records curve loads millions of rows: it runs on a throwaway cluster of its own, not on DATABASE_URL (unset it)".into());
    }
    let data_dir = stack
        .postgres
        .data_dir()
        .ok_or("the throwaway cluster has no data directory")?;
    if let Ok(sb) = std::env::var("SCALE_RECORDS_SHARED_BUFFERS") {
        stack.postgres.psql(
            "postgres",
            &format!("ALTER SYSTEM SET shared_buffers = '{sb}'"),
        )?;
        stack.postgres.restart()?;
    }
    let shared_buffers = stack.postgres.psql("postgres", "SHOW shared_buffers")?;
    Ok((stack, data_dir, shared_buffers))
}

/// The record table's columns (for the loader's copy of the template row) and a fencing token
/// above every one the state API handed out.
fn template_facts(stack: &Stack, db: &str) -> Result<(Vec<String>, i64), String> {
    let columns: Vec<String> = stack
        .postgres
        .psql(
            db,
            "SELECT column_name FROM information_schema.columns \
             WHERE table_name = 'idempotency_records' ORDER BY ordinal_position",
        )?
        .lines()
        .map(str::to_owned)
        .collect();
    let token_base: i64 = stack
        .postgres
        .psql(db, "SELECT last_value FROM idempotency_fencing_token_seq")?
        .trim()
        .parse::<i64>()
        .map_err(|e| e.to_string())?
        + 1_000;
    Ok((columns, token_base))
}

/// Why `more` rows would not fit, keeping `keep_free` bytes free (None: they fit).
fn no_room(
    data_dir: &std::path::Path,
    more: u64,
    bytes_per_row: f64,
    keep_free: f64,
) -> Result<Option<String>, String> {
    let free = free_bytes(data_dir)?;
    let needed = more as f64 * bytes_per_row * 1.1;
    if free - needed >= keep_free {
        return Ok(None);
    }
    Ok(Some(format!(
        "{:.1} GiB more needed ({:.0} bytes a row), {:.1} GiB free: it would leave less than {:.0} GiB",
        needed / GIB,
        bytes_per_row,
        free / GIB,
        keep_free / GIB
    )))
}

/// The floor measured after each level: pgbench's claim INSERT on the loaded table
/// (SCALE_RECORDS_FLOOR_SECONDS, 20; quick 5; 0: none).
struct Floor {
    pgbench: Option<crate::pgbench::Pgbench>,
    seconds: u64,
}

/// One measured run of claim+complete pairs at 16 connections with `rows` loaded.
fn measure(
    bench: &Bench<'_>,
    stack: &Stack,
    rows: u64,
    wal_compression: &str,
    trial: Option<&str>,
    load_seconds: f64,
    floor: &Floor,
) -> Result<Level, String> {
    let prefix = format!(
        "scale-rec-{rows}-{}-{}",
        trial.unwrap_or(wal_compression).replace('=', "-"),
        std::process::id()
    );
    // The run's rows expire a retention (a day) after their complete, later than every row
    // already in the table: they are the rows past this.
    let newest_expiry = stack.postgres.psql(
        stack.database_name(),
        "SELECT COALESCE(max(expires_at), '-infinity') FROM idempotency_records",
    )?;
    let metrics_before = crate::state_api_metrics(stack.state_api.port);
    let (r, cpu, _) = bench.measure(
        addr(stack.state_api.port),
        CONNECTIONS,
        &op_claim_complete(prefix),
    );
    let metrics_after = crate::state_api_metrics(stack.state_api.port);
    // Pairs in the measured window (the database's counters are read at its ends) and over the
    // whole span (the purge's rows, from the state API's metrics before and after): the
    // completes the state API answered.
    let window = DbCounters::from_window(&cpu.window_counters);
    let pairs = cpu
        .state_api_requests
        .get("complete")
        .copied()
        .unwrap_or(0.0)
        .max(1.0);
    let completes = |m: &BTreeMap<String, f64>| {
        m.get("state_api_request_duration_seconds_count{route=\"complete\"}")
            .copied()
            .unwrap_or(0.0)
    };
    let pairs_in_span = (completes(&metrics_after) - completes(&metrics_before)).max(1.0);
    let purged = |m: &BTreeMap<String, f64>| {
        m.iter()
            .filter(|(k, _)| k.starts_with("state_api_purged_rows"))
            .map(|(_, v)| v)
            .sum::<f64>()
    };
    let pages_per_new_row = stack
        .postgres
        .psql(
            stack.database_name(),
            &format!(
                "SELECT count(DISTINCT (ctid::text::point)[0])::float8 / GREATEST(count(*), 1) \
                 FROM idempotency_records WHERE expires_at > '{}'",
                newest_expiry.trim()
            ),
        )?
        .trim()
        .parse::<f64>()
        .map_err(|e| format!("pages per new row: {e}"))?;
    let (_, table_b, index_b) = sizes(stack)?;
    let rate = r.rate();
    let per = |cores: f64| ratio(cores * 1e6, rate);
    let proc = |name: &str| cpu.processes.get(name).copied().unwrap_or(0.0);
    let state_api_us = per(proc("state-api"));
    let postgres_us = per(proc("postgres"));
    let (reads, hits) = (window.blks_read, window.blks_hit);
    let mut level = Level {
        rows,
        wal_compression: wal_compression.to_owned(),
        trial: trial.map(str::to_owned),
        table_mib: table_b as f64 / 1_048_576.0,
        index_mib: index_b as f64 / 1_048_576.0,
        bytes_per_row: ratio((table_b + index_b) as f64, rows as f64),
        pairs_per_s: rate,
        p50_ms: r.pct_ms(50.0),
        p99_ms: r.pct_ms(99.0),
        errors: r.error_count(),
        state_api_us,
        postgres_us,
        cpu_us: state_api_us + postgres_us,
        all_us: per(cpu.machine_cores),
        wal_bytes_per_pair: window.wal_bytes / pairs,
        fpi_per_pair: window.wal_fpi / pairs,
        blocks_read_per_pair: reads / pairs,
        heap_reads_per_pair: window.heap_read / pairs,
        index_reads_per_pair: window.index_read / pairs,
        pages_per_new_row,
        purged_per_pair: (purged(&metrics_after) - purged(&metrics_before)) / pairs_in_span,
        written_per_pair: window.written / pairs,
        checkpoints: window.checkpoints,
        autovacuums: window.autovacuums,
        floor_us: None,
        floor_tps: None,
        hit_ratio: ratio(hits, hits + reads),
        load_seconds,
        steal_cores: cpu.steal_cores,
        other_cores: cpu.other_cores,
    };
    if let Some(pg) = &floor.pgbench {
        let r = pg.measured_run(bench, CONNECTIONS, floor.seconds)?;
        level.floor_us = r.postgres_cpu_us_per_tx;
        level.floor_tps = Some(r.tps);
    }
    eprintln!(
        "  {:>11} rows (wal_compression {}{}): {:>6.0} pairs/s p99 {:>6.2} ms, {:>5.0} µs CPU/pair (state API + Postgres), WAL {:>6.0} B/pair, {:.2} FPI/pair, {:.2} reads/pair (heap {:.2}, index {:.2}), {:.2} pages/new row, {:.2} purged/pair, {:.2} written/pair, {} checkpoints, {} autovacuums; floor {} µs/row at {}/s",
        rows,
        wal_compression,
        trial.map(|t| format!(", {t}")).unwrap_or_default(),
        level.pairs_per_s,
        level.p99_ms,
        level.cpu_us,
        level.wal_bytes_per_pair,
        level.fpi_per_pair,
        level.blocks_read_per_pair,
        level.heap_reads_per_pair,
        level.index_reads_per_pair,
        level.pages_per_new_row,
        level.purged_per_pair,
        level.written_per_pair,
        level.checkpoints,
        level.autovacuums,
        level.floor_us.map_or("-".into(), |v| fig(v, 0)),
        level.floor_tps.map_or("-".into(), |v| fig(v, 0)),
    );
    Ok(level)
}

fn goals(c: &Records) -> Vec<Goal> {
    let plain: Vec<&Level> = c.levels.iter().filter(|l| l.trial.is_none()).collect();
    let Some(empty) = plain.iter().find(|l| l.rows == 0) else {
        return vec![Goal::new(
            "records",
            "CPU per pair and p99 against the empty table",
            "<= 1.3x",
            "no run on the empty table",
            None,
        )];
    };
    let mut goals = Vec::new();
    let at = |l: &Level| {
        let cpu = ratio(l.cpu_us, empty.cpu_us);
        let p99 = ratio(l.p99_ms, empty.p99_ms);
        // What Postgres alone does at this size, for the reading: its single-row INSERT.
        let floor = match (l.floor_us, empty.floor_us) {
            (Some(at), Some(first)) => format!(
                "; the floor (pgbench's INSERT) {}x ({} against {} µs)",
                fig(ratio(at, first), 2),
                fig(at, 0),
                fig(first, 0)
            ),
            _ => String::new(),
        };
        (
            format!(
                "CPU {}x ({} against {} µs), p99 {}x ({} against {} ms){floor}",
                fig(cpu, 2),
                fig(l.cpu_us, 0),
                fig(empty.cpu_us, 0),
                fig(p99, 2),
                fig(l.p99_ms, 2),
                fig(empty.p99_ms, 2)
            ),
            at_most(cpu, 1.3) && at_most(p99, 1.3),
        )
    };
    match plain.iter().find(|l| l.rows == 50_000_000) {
        Some(l) => {
            let (m, pass) = at(l);
            goals.push(Goal::new(
                "records",
                "claim+complete at 50 M rows against 0: CPU per pair and p99",
                "<= 1.3x each",
                m,
                Some(pass),
            ));
        }
        None => {
            let why = c
                .skipped
                .iter()
                .find(|s| s.rows == 50_000_000)
                .map(|s| format!("50 M rows not loaded: {}", s.why))
                .unwrap_or_else(|| "50 M rows not in this run's levels".into());
            goals.push(Goal::new(
                "records",
                "claim+complete at 50 M rows against 0: CPU per pair and p99",
                "<= 1.3x each",
                why,
                None,
            ));
        }
    }
    // The largest level measured, whatever it is (the same bound, for what it shows).
    if let Some(l) = plain
        .iter()
        .filter(|l| l.rows > 0 && l.rows != 50_000_000)
        .max_by_key(|l| l.rows)
    {
        let (m, pass) = at(l);
        goals.push(Goal::new(
            "records",
            format!("the same at {} rows (the largest other level)", l.rows),
            "<= 1.3x each",
            m,
            Some(pass),
        ));
    }
    let errors: u64 = c.levels.iter().map(|l| l.errors).sum();
    goals.push(Goal::new(
        "records",
        "every claim and complete answered 200",
        "0 errors",
        format!("{errors} errors"),
        Some(errors == 0),
    ));
    goals
}

fn markdown(c: &Records) -> String {
    let rows: Vec<Vec<String>> = c
        .levels
        .iter()
        .map(|l| {
            vec![
                l.rows.to_string(),
                match &l.trial {
                    Some(t) => format!("{} ({t})", l.wal_compression),
                    None => l.wal_compression.clone(),
                },
                fig(l.table_mib, 0),
                fig(l.index_mib, 0),
                fig(l.bytes_per_row, 0),
                fig(l.pairs_per_s, 0),
                fig(l.p50_ms, 2),
                fig(l.p99_ms, 2),
                fig(l.state_api_us, 0),
                fig(l.postgres_us, 0),
                fig(l.wal_bytes_per_pair, 0),
                fig(l.fpi_per_pair, 2),
                fig(l.blocks_read_per_pair, 2),
                format!(
                    "{} / {}",
                    fig(l.heap_reads_per_pair, 2),
                    fig(l.index_reads_per_pair, 2)
                ),
                fig(l.pages_per_new_row, 2),
                fig(l.purged_per_pair, 2),
                fig(l.written_per_pair, 2),
                format!("{} / {}", l.checkpoints, l.autovacuums),
                l.floor_us.map_or("-".into(), |v| fig(v, 0)),
                fig(l.hit_ratio, 4),
                fig(l.steal_cores, 2),
            ]
        })
        .collect();
    let skipped: String = c
        .skipped
        .iter()
        .map(|s| format!("\n- {} rows: not loaded, {}.", s.rows, s.why))
        .collect();
    format!(
        "### 1. Records in the table\n\nThe state API's claim+complete at {CONNECTIONS} connections, {} s per level after `VACUUM (ANALYZE)` and `CHECKPOINT`, on a table loaded with straight SQL (random 32-byte addresses; 99.4 % completed with a real sealed response, 0.5 % in progress; created in the order written, one every {MICROS_PER_KEY} µs, a day at {DAY_OF_KEYS} keys; each level's oldest 1 % past retention, together at the start of its pages). shared_buffers {}. µs of CPU per pair; WAL bytes, full-page images (FPI) and shared-buffer misses per pair in the measured window, of them the records table's heap and indexes; the heap pages the run's new rows went to, per row; the rows the purge deleted, per pair; buffers written out per pair, checkpoints and autovacuums (with autoanalyzes) of the table in the window; the floor: Postgres's CPU per row of pgbench's single-row claim INSERT (a random key, one commit each) on the same table right after, at the same connections.{}\n\n{}\nDisk free after the largest level: {:.1} GiB. The loaded cluster was removed at the end.\n",
        c.measure_s,
        c.shared_buffers,
        skipped,
        table(
            &[
                "rows", "wal_compression", "table MiB", "index MiB", "bytes/row", "pairs/s",
                "p50 ms", "p99 ms", "state API µs", "Postgres µs", "WAL B/pair", "FPI/pair",
                "misses/pair", "heap / index misses", "pages/new row", "purged/pair",
                "written/pair", "checkpoints / autovacuums", "floor µs", "hit ratio", "steal"
            ],
            &rows,
            true
        ),
        c.free_gib_at_largest
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_keeps_the_template_but_for_what_a_day_makes_different() {
        let cols: Vec<String> = [
            "scope_hash",
            "endpoint",
            "state",
            "response_body",
            "expires_at",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let sql = insert_sql(&cols, 10..20, 0..1_000, 1_000);
        assert!(sql.contains("generate_series(10, 19)"), "{sql}");
        assert!(
            sql.contains("sha256(('scale-' || i)::text::bytea)"),
            "{sql}"
        );
        assert!(sql.contains("t.endpoint"), "{sql}");
        assert!(
            sql.contains("CASE WHEN i % 1000 < 5 THEN NULL ELSE t.response_body END"),
            "{sql}"
        );
        // The level's oldest 1 % (rows 0..10 of 1,000) is past its retention; the last row
        // is created now, each earlier one a key's interval before it.
        assert!(
            sql.contains("CASE WHEN i < 10 THEN now() - interval '1 minute'"),
            "{sql}"
        );
        assert!(
            sql.contains("(now() - (999 - i) * interval '864 microseconds') + interval '1 day'"),
            "{sql}"
        );
        assert!(sql.starts_with("INSERT INTO idempotency_records (scope_hash, endpoint, state, response_body, expires_at) SELECT"), "{sql}");
    }

    #[test]
    fn levels_come_from_the_environment_or_the_defaults() {
        let quick = Settings {
            quick: true,
            curves: vec![],
        };
        if std::env::var_os("SCALE_RECORDS_LEVELS").is_none() {
            assert_eq!(levels(&quick), vec![0, 200_000, 1_000_000]);
        }
    }
}
