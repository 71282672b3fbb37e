//! The load: new keys paced on each connection's own clock, replays of keys completed before,
//! and duplicates of a key a slow request holds; each answer checked and counted by minute.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;

/// What the load did in one minute.
#[derive(Debug, Clone, Default)]
pub(super) struct MinuteLoad {
    pub(super) new_keys: u64,
    /// Latencies of the correct new-key answers, microseconds, by reading interval of the
    /// minute (`SOAK_SAMPLE_SECONDS`).
    pub(super) lat_us: Vec<Vec<u32>>,
    pub(super) replays: u64,
    pub(super) conflicts: u64,
    pub(super) failures: BTreeMap<String, u64>,
}

/// The load's counts by minute, and the new keys completed lately (the replays' keys).
pub(super) struct Tally {
    pub(super) start: Instant,
    pub(super) minute: Duration,
    pub(super) per_minute: usize,
    pub(super) minutes: Vec<MinuteLoad>,
    pub(super) recent: VecDeque<(Instant, String)>,
}

impl Tally {
    pub(super) fn minute_at(&mut self, t: Instant) -> &mut MinuteLoad {
        let i = self.index(t).0;
        &mut self.minutes[i]
    }

    /// The minute of `t`, and its reading interval in that minute.
    pub(super) fn index(&self, t: Instant) -> (usize, usize) {
        let x = t.saturating_duration_since(self.start).as_secs_f64() / self.minute.as_secs_f64();
        let i = (x as usize).min(self.minutes.len() - 1);
        let w = ((x - i as f64) * self.per_minute as f64) as usize;
        (i, w.min(self.per_minute - 1))
    }

    pub(super) fn fail(&mut self, t: Instant, kind: String) {
        *self.minute_at(t).failures.entry(kind).or_default() += 1;
    }
}

pub(super) type Shared = Arc<Mutex<Tally>>;
/// The operation a paced connection sends next (`None`: nothing to send yet).
pub(super) type Slot = Arc<Mutex<Option<OpFn>>>;

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Stream {
    New,
    Replay,
    Conflict,
}

impl Stream {
    pub(super) fn label(self) -> &'static str {
        match self {
            Self::New => "new key",
            Self::Replay => "replay",
            Self::Conflict => "409",
        }
    }
}

/// `rate` per second over `connections` connections: the period of each.
pub(super) fn period(rate: f64, connections: usize) -> Duration {
    Duration::from_secs_f64(connections as f64 / rate.max(1e-3))
}

/// How many connections a side stream gets: about 50 requests a second each.
pub(super) fn side_connections(rate: u64) -> usize {
    rate.div_ceil(50).clamp(1, 4) as usize
}

/// One connection sending its slot's operation once per `every`, from `first` until `until`
/// (a late answer does not lower the rate: the missed ticks are sent at once).
#[allow(clippy::too_many_arguments)]
pub(super) async fn paced(
    target: SocketAddr,
    stream: Stream,
    client: usize,
    first: Instant,
    every: Duration,
    until: Instant,
    slot: Slot,
    tally: Shared,
    prefix: Arc<str>,
) {
    let mut ticks = tokio::time::interval_at(first.into(), every);
    let mut conn: Option<Conn> = None;
    let mut seq = 0u64;
    loop {
        let at = ticks.tick().await.into_std();
        if at >= until {
            return;
        }
        let op = lock(&slot).clone();
        let Some(op) = op else {
            continue;
        };
        if conn.is_none() {
            match Conn::open(target).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    let kind = format!("{}: {}", stream.label(), load::short(&e));
                    lock(&tally).fail(at, kind);
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else {
            continue;
        };
        let t0 = Instant::now();
        let outcome = op(c, client, seq).await;
        let lat_us = u32::try_from(t0.elapsed().as_micros()).unwrap_or(u32::MAX);
        let mut t = lock(&tally);
        match outcome {
            Ok(Outcome::Ok) => {
                let (i, w) = t.index(t0);
                let m = &mut t.minutes[i];
                match stream {
                    Stream::New => {
                        m.new_keys += 1;
                        m.lat_us[w].push(lat_us);
                        t.recent
                            .push_back((Instant::now(), new_key(&prefix, client, seq)));
                    }
                    Stream::Replay => m.replays += 1,
                    Stream::Conflict => m.conflicts += 1,
                }
            }
            Ok(Outcome::Wrong(kind)) => t.fail(t0, format!("{}: {kind}", stream.label())),
            Err(e) => {
                t.fail(
                    t0,
                    format!("{}: transport: {}", stream.label(), load::short(&e)),
                );
                conn = None;
            }
        }
        seq += 1;
    }
}

/// Every second, the replays' keys: up to [`REPLAY_KEYS`] of the new keys completed between
/// `min_age` and `max_age` ago (well inside the retention: older ones are forgotten).
pub(super) async fn refresh_replay_keys(
    slot: Slot,
    tally: Shared,
    min_age: Duration,
    max_age: Duration,
    until: Instant,
) {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    loop {
        let now = every.tick().await.into_std();
        if now >= until {
            return;
        }
        let keys: Vec<String> = {
            let mut t = lock(&tally);
            while t
                .recent
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > max_age)
            {
                t.recent.pop_front();
            }
            let old_enough = t
                .recent
                .partition_point(|(at, _)| now.saturating_duration_since(*at) >= min_age);
            let n = old_enough.min(REPLAY_KEYS);
            (0..n)
                .map(|i| t.recent[i * old_enough / n].1.clone())
                .collect()
        };
        *lock(&slot) = (!keys.is_empty()).then(|| op_replay(Arc::new(keys)));
    }
}

/// Keeps a key held by a slow request until `until`: each one holds its key [`HOLD`] (at most
/// until just after `until`) and a new one takes over every [`RENEW`]. The duplicates go to
/// the newest key once a probe has seen it held. Every slow request must end 201.
pub(super) async fn hold_keys(
    envoy: SocketAddr,
    prefix: Arc<str>,
    until: Instant,
    slot: Slot,
    tally: Shared,
) -> usize {
    let mut slow = Vec::new();
    while Instant::now() < until {
        let key = format!("{prefix}-held-{}", slow.len());
        let hold =
            HOLD.min(until.saturating_duration_since(Instant::now()) + Duration::from_secs(2));
        let req = checkout_req(&key).header("x-demo-delay-ms", &hold.as_millis().to_string());
        let t = tally.clone();
        slow.push(tokio::spawn(async move {
            let answer = async { Conn::open(envoy).await?.send(&req).await }.await;
            let wrong = match answer {
                Ok(a) if a.status == 201 && !a.headers.contains_key("idempotent-replayed") => {
                    return;
                }
                Ok(a) => format!("status {}", a.status),
                Err(e) => format!("transport: {}", load::short(&e)),
            };
            lock(&t).fail(Instant::now(), format!("held key's slow request: {wrong}"));
        }));
        // The slow request claims first; then a duplicate must see the key held.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let op = op_inflight(key);
        let mut held = Err("not held within 2 s".to_owned());
        if let Ok(mut probe) = Conn::open(envoy).await {
            for _ in 0..100 {
                match op(&mut probe, 0, 0).await {
                    Ok(Outcome::Ok) => {
                        held = Ok(());
                        break;
                    }
                    Ok(Outcome::Wrong(w)) => held = Err(w),
                    Err(e) => {
                        held = Err(e);
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        match held {
            Ok(()) => *lock(&slot) = Some(op),
            Err(e) => lock(&tally).fail(Instant::now(), format!("held key: {}", load::short(&e))),
        }
        let next = (Instant::now() + RENEW).min(until);
        tokio::time::sleep_until(next.into()).await;
    }
    let n = slow.len();
    for h in slow {
        let done = tokio::time::timeout(HOLD + Duration::from_secs(15), h).await;
        if !matches!(done, Ok(Ok(()))) {
            lock(&tally).fail(
                Instant::now(),
                "held key's slow request: did not end".into(),
            );
        }
    }
    n
}

/// The soak's load from `start` for `settings.seconds`: its counts by minute, and how many slow
/// requests held a key.
pub(super) async fn drive(
    envoy: SocketAddr,
    settings: Settings,
    rate: f64,
    start: Instant,
    prefix: Arc<str>,
) -> (Vec<MinuteLoad>, usize) {
    let until = start + Duration::from_secs(settings.seconds);
    let tally: Shared = Arc::new(Mutex::new(Tally {
        start,
        minute: Duration::from_secs(settings.minute_s),
        per_minute: settings.samples_per_minute,
        minutes: vec![
            MinuteLoad {
                lat_us: vec![Vec::new(); settings.samples_per_minute],
                ..MinuteLoad::default()
            };
            settings.minutes
        ],
        recent: VecDeque::new(),
    }));
    let mut tasks = Vec::new();
    let mut spawn_streams = |stream: Stream, rate: f64, connections: usize, slot: Slot| {
        let every = period(rate, connections);
        for client in 0..connections {
            // Spread over one period, so the connections do not send together.
            let first = start + every.mul_f64(client as f64 / connections as f64);
            tasks.push(tokio::spawn(paced(
                envoy,
                stream,
                client,
                first,
                every,
                until,
                slot.clone(),
                tally.clone(),
                prefix.clone(),
            )));
        }
    };
    let new_slot: Slot = Arc::new(Mutex::new(Some(op_created(prefix.to_string()))));
    spawn_streams(Stream::New, rate, settings.connections, new_slot);
    let replay_slot: Slot = Arc::new(Mutex::new(None));
    let conflict_slot: Slot = Arc::new(Mutex::new(None));
    // The side loads, each on a few connections of its own.
    for (stream, side_rate, slot) in [
        (Stream::Replay, settings.replay_rate, &replay_slot),
        (Stream::Conflict, settings.inflight_rate, &conflict_slot),
    ] {
        if side_rate > 0 {
            spawn_streams(
                stream,
                side_rate as f64,
                side_connections(side_rate),
                slot.clone(),
            );
        }
    }
    let max_age = Duration::from_secs(settings.retention_s) / 2;
    let refresher = tokio::spawn(refresh_replay_keys(
        replay_slot,
        tally.clone(),
        Duration::from_secs(2).min(max_age / 2),
        max_age,
        until,
    ));
    let held = if settings.inflight_rate > 0 {
        hold_keys(envoy, prefix.clone(), until, conflict_slot, tally.clone()).await
    } else {
        0
    };
    for t in tasks {
        if let Err(e) = t.await {
            lock(&tally).fail(until, format!("task: {e}"));
        }
    }
    let _ = refresher.await;
    let minutes = std::mem::take(&mut lock(&tally).minutes);
    (minutes, held)
}
