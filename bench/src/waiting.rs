//! What a waiting retry costs (`Prefer: wait`): a slow request holds a key while `waiters`
//! clients keep a `Prefer: wait=N` retry of it open (each asks again as soon as its wait ends
//! at the deadline). Over the measured window: the CPU of each process and the claim callouts
//! Envoy made, per waiter and second. The same clients retrying at `Retry-After` without
//! waiting (one request a second each) are measured too, for comparison.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::load::{Conn, Req};
use crate::{cpu_between, Bench, CpuUse, Snapshot};

/// One measured way of retrying a running key.
#[derive(Debug, Clone, Serialize)]
pub struct WaitCost {
    /// `wait`: `Prefer: wait=N`; `poll`: a retry every second (its `Retry-After`), no wait.
    pub mode: String,
    pub waiters: usize,
    pub wait_s: u64,
    pub window_s: f64,
    /// Answers received in the window (409s: the key stays held throughout).
    pub answers: u64,
    /// Claim callouts the state API received per waiter and second (from its /metrics).
    pub claims_per_waiter_s: f64,
    /// Milliseconds of CPU per second per waiter (= thousandths of a core), by process.
    pub cpu_ms_per_waiter_s: std::collections::BTreeMap<String, f64>,
    pub total_cpu_ms_per_waiter_s: f64,
    pub cpu: CpuUse,
}

/// `waiters` clients retrying `req` in a loop (a pause of `pause` between answers) while the
/// key is held; the window is measured after `warmup`.
pub fn measure(
    bench: &Bench,
    envoy: std::net::SocketAddr,
    mode: &str,
    waiters: usize,
    wait_s: u64,
    req: Req,
    pause: Duration,
) -> Result<WaitCost, String> {
    let stop = Arc::new(AtomicBool::new(false));
    let answers = Arc::new(AtomicU64::new(0));
    let wrong = Arc::new(AtomicU64::new(0));
    let (warmup, window) = (bench.warmup, bench.measure);
    let procs = bench.procs.clone();
    let port = bench.state_api_port;
    let tck = bench.tck;
    let cpu = bench.rt.block_on(async {
        let mut tasks = Vec::new();
        for _ in 0..waiters {
            let (stop, answers, wrong, req) =
                (stop.clone(), answers.clone(), wrong.clone(), req.clone());
            tasks.push(tokio::spawn(async move {
                let mut conn = Conn::open(envoy).await?;
                while !stop.load(Relaxed) {
                    let a = conn.send(&req).await?;
                    if a.status == 409 {
                        answers.fetch_add(1, Relaxed);
                    } else {
                        wrong.fetch_add(1, Relaxed);
                    }
                    tokio::time::sleep(pause).await;
                }
                Ok::<(), String>(())
            }));
        }
        tokio::time::sleep(warmup).await;
        let p = procs.clone();
        let a = tokio::task::spawn_blocking(move || Snapshot::take(&p, port))
            .await
            .map_err(|e| e.to_string())?;
        let counted = answers.load(Relaxed);
        tokio::time::sleep(window).await;
        let b = tokio::task::spawn_blocking(move || Snapshot::take(&procs, port))
            .await
            .map_err(|e| e.to_string())?;
        let in_window = answers.load(Relaxed) - counted;
        stop.store(true, Relaxed);
        // The waiting ones end at their deadline; none is needed any more.
        for t in tasks {
            t.abort();
        }
        Ok::<(CpuUse, u64), String>((cpu_between(&a, &b, tck), in_window))
    })?;
    let (cpu, in_window) = cpu;
    if wrong.load(Relaxed) > 0 {
        return Err(format!(
            "{} answers other than 409 while the key was held ({mode})",
            wrong.load(Relaxed)
        ));
    }
    let cpu_ms = cpu.thousandths_each(waiters);
    let total = cpu_ms.values().sum();
    let claims = cpu.state_api_requests.get("claim").copied().unwrap_or(0.0);
    Ok(WaitCost {
        mode: mode.into(),
        waiters,
        wait_s,
        window_s: cpu.window_s,
        answers: in_window,
        claims_per_waiter_s: claims / waiters.max(1) as f64 / cpu.window_s.max(1e-9),
        cpu_ms_per_waiter_s: cpu_ms,
        total_cpu_ms_per_waiter_s: total,
        cpu,
    })
}
