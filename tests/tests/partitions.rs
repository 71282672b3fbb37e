//! Partitions, not just crashes (issue 35): every part on a host of its own
//! (`e2e::netstack`), links cut with nftables on the switch or slowed and stalled by a relay,
//! under a storm of retrying clients, and a history checker (`e2e::history`).
//!
//! 1. An Envoy cut off from both state APIs while its upstream requests run (its heartbeats
//!    are lost; its clients give up and retry through the other Envoy); healed after two leases.
//! 2. The zombie primary: the Postgres primary cut off from etcd and from the standby, still
//!    reachable through HAProxy and directly from a state API's host. The standby is promoted;
//!    the old primary acknowledges no commit once the new one serves; healed, it rejoins as the
//!    synchronous standby.
//! 3. A state API's link to Postgres black-holed while its commits are on the way (the answers
//!    of some are dropped: it never learns whether they committed), then healed.
//! 4. A state API's answers to its Envoy delayed past the filter's timeout (the claims
//!    commit, their answers come too late), then prompt again.
//! 5. An Envoy's link to the upstream black-holed mid-request (no reset, no FIN), then healed.
//! 6. Asymmetric cuts: an Envoy reaches its state API but the answers do not come back; then
//!    HAProxy's health checks cannot reach the primary's Patroni while the primary itself is
//!    reachable.
//! 7. Everything at once, chosen by a seed (`PARTITION_SEED`): random cuts, heals, slowed and
//!    stalled links, for `PARTITION_SECONDS` (60 by default; `make test` runs it shorter).
//!
//! Each shows its cut is real (a TCP connect across it fails and the rule counted the dropped
//! packets; a slowed link measured slow), and each history is checked: at most one execution
//! per key, every replay byte for byte the execution's response, no replay without an
//! execution, no outcome a client saw lost after healing, no key that was never forwarded
//! unusable for more than a lease after healing. A violation prints the history around it.
//! Figures: target/fault-figures.jsonl (docs/RELIABILITY.md).
//!
//! Needs root (network namespaces, nftables): `sudo make chaos-net`. The scenarios share one
//! set of hosts and run one at a time; each starts from a healed network and a healthy cluster.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e::client::{unique_key, Client, Request};
use e2e::faults::{record_figures, ProxyMode, Rng};
use e2e::history::{CheckInput, History, Kind, Ms, Phase, Policy, Verdict};
use e2e::netns::{Cut, Link, NetHost};
use e2e::netstack::*;
use e2e::services::ServiceTestExt as _;
use e2e::stack::StackOptions;
use e2e::testkit::{block_on, charge_body, checkout, refund};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::json;

const SUITE: &str = "partitions";
const LEASE_MS: u64 = 3_000;
const HEARTBEAT_MS: u64 = 1_000;
/// The filter's timeout for a call to the state API (the demo's).
const STATE_API_TIMEOUT_MS: u64 = 1_000;
/// Envoy's timeout for a request to the checkout: a black-holed upstream answers 504 after it.
const UPSTREAM_TIMEOUT_MS: u64 = 5_000;
/// How long a storm client waits for an answer before it gives up and retries.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(4);
/// The same for a client that asked to wait (`Prefer: wait=10`).
const WAITING_CLIENT_TIMEOUT: Duration = Duration::from_secs(15);
/// A key's clients pause this long between tries, each through the other Envoy.
const RETRY_PAUSE: Duration = Duration::from_millis(250);
/// When a scenario makes its fault (ms into its run): its storm is under way by then.
const FAULT_AT: Ms = 1_500;
/// After healing: how long verification retries a key that is still settling (a pending
/// complete retried with back-off, a reconcile).
const VERIFY_FOR: Duration = Duration::from_secs(15);

type Scenario = for<'a> fn(&'a NetStack) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

static STACK: Mutex<Option<Result<NetStack, String>>> = Mutex::new(None);

fn main() {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    let scenarios: [(&str, Scenario); 7] = [
        (
            "1_envoy_cut_off_from_both_state_apis_while_its_requests_run",
            |s| Box::pin(envoy_cut_off_from_state_apis(s)),
        ),
        ("2_zombie_primary_cut_off_from_etcd_and_standby", |s| {
            Box::pin(zombie_primary(s))
        }),
        ("3_state_api_to_postgres_black_holed_mid_commit", |s| {
            Box::pin(state_api_to_postgres_black_holed(s))
        }),
        ("4_state_api_answers_delayed_past_the_filter_timeout", |s| {
            Box::pin(state_api_answers_delayed(s))
        }),
        ("5_envoy_to_upstream_black_holed_mid_request", |s| {
            Box::pin(envoy_to_upstream_black_holed(s))
        }),
        ("6_asymmetric_answers_lost_and_health_checks_cut", |s| {
            Box::pin(asymmetric_cuts(s))
        }),
        ("7_random_cuts_and_heals_from_a_seed", |s| {
            Box::pin(random_cuts(s))
        }),
    ];
    let mut trials: Vec<Trial> = scenarios
        .into_iter()
        .map(|(name, scenario)| Trial::test(name, move || run_scenario(scenario)))
        .collect();
    if let Err(why) = e2e::netns::require() {
        // `make test` as a normal user says so and runs the rest; run alone, they fail.
        if std::env::var("PARTITIONS_WITHOUT_ROOT").as_deref() == Ok("ignore") {
            eprintln!("partitions: not run: {why}");
            trials = trials
                .into_iter()
                .map(|t| t.with_ignored_flag(true))
                .collect();
        }
    }
    let conclusion = libtest_mimic::run(&args, trials);
    // Stops every part and removes the hosts.
    drop(STACK.lock().unwrap_or_else(|p| p.into_inner()).take());
    conclusion.exit();
}

/// The stack's options; `PARTITION_STATE_API_ENV=K=V,K=V` runs the state APIs with other
/// settings (a shorter `STATE_API_STATEMENT_TIMEOUT_MS`, say).
fn options() -> StackOptions {
    let state_api_env = std::env::var("PARTITION_STATE_API_ENV")
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    StackOptions {
        state_api_env,
        lease_ms: LEASE_MS,
        heartbeat_ms: HEARTBEAT_MS,
        state_api_timeout_ms: STATE_API_TIMEOUT_MS,
        tweak: Some(e2e::envoy::Tweak::new(|c| {
            c.upstream_timeout_ms = UPSTREAM_TIMEOUT_MS;
        })),
        ..StackOptions::default()
    }
}

/// Starts the hosts and the stack once, brings them back to whole and healthy, runs `scenario`.
fn run_scenario(scenario: Scenario) -> Result<(), Failed> {
    let mut slot = STACK.lock().unwrap_or_else(|p| p.into_inner());
    if slot.is_none() {
        let started = Instant::now();
        *slot = Some(NetStack::start(options()));
        if let Some(Ok(_)) = slot.as_ref() {
            eprintln!(
                "partitions: 11 hosts and the stack up in {:?}",
                started.elapsed()
            );
        }
    }
    let stack = match slot.as_ref() {
        Some(Ok(stack)) => stack,
        Some(Err(why)) => return Err(why.clone().into()),
        None => return Err("no stack".into()),
    };
    make_whole(stack)?;
    block_on(scenario(stack))
}

/// Every link healed, every relay passing, a primary with its synchronous standby, every
/// state API ready: where each scenario starts.
fn make_whole(stack: &NetStack) -> Result<(), String> {
    stack.net.heal_all().map_err(|e| e.to_string())?;
    for relay in &stack.relays {
        relay.set_mode(ProxyMode::Pass);
    }
    stack.ha.wait_healthy(Duration::from_secs(90))?;
    for api in &stack.state_apis {
        let deadline = Instant::now() + Duration::from_secs(30);
        while e2e::envoy::http_get_at(api.addr, "/readyz").is_err() {
            if Instant::now() > deadline {
                return Err(format!("{} not ready\n{}", api.addr, stack.logs()));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(())
}

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

// ---------------------------------------------------------------------------------------------
// The client host

/// A Tokio runtime whose threads live on the client's host: every connection a task on it
/// opens comes from the client's address.
struct ClientRuntime(Option<tokio::runtime::Runtime>);

impl ClientRuntime {
    fn on(host: &NetHost) -> Self {
        let rt = host
            .run(|| {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
            })
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("a runtime on the client host: {e}"));
        Self(Some(rt))
    }

    fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match &self.0 {
            Some(rt) => rt.spawn(f),
            None => panic!("the client runtime is gone"),
        }
    }
}

impl Drop for ClientRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One scenario's run: the storm, the probes, the faults, the verification and the checks

/// What a key's request is: its endpoint, its body's amount, and whether its client asks to
/// wait for a running first request (`Prefer: wait=N`, N s).
#[derive(Debug, Clone)]
struct KeySpec {
    endpoint: &'static str,
    amount: u64,
    prefer_wait_s: Option<u64>,
}

fn request_for(key: &str, spec: &KeySpec, delay_ms: u64) -> Request {
    let body = charge_body(spec.amount);
    let mut req = if spec.endpoint == "/refunds" {
        refund(key, "alice", &body)
    } else {
        checkout(key, "alice", &body)
    };
    if let Some(n) = spec.prefer_wait_s {
        req = req.header("prefer", &format!("wait={n}"));
    }
    if delay_ms > 0 {
        // Detached: the checkout finishes what it started even when Envoy gives up on it, as
        // most servers do.
        req.delay_ms(delay_ms).header("x-demo-detach", "1")
    } else {
        req
    }
}

/// The clients of each Envoy: impatient ones, and patient ones for requests that ask to wait.
struct Clients {
    quick: [Client; 2],
    patient: [Client; 2],
}

impl Clients {
    fn new(stack: &NetStack) -> Self {
        let url = |i: usize| stack.envoys[i].url("");
        Self {
            quick: [0, 1].map(|i| Client::impatient(&url(i), CLIENT_TIMEOUT)),
            patient: [0, 1].map(|i| Client::impatient(&url(i), WAITING_CLIENT_TIMEOUT)),
        }
    }

    fn of(&self, spec: &KeySpec, envoy: usize) -> &Client {
        if spec.prefer_wait_s.is_some() {
            &self.patient[envoy]
        } else {
            &self.quick[envoy]
        }
    }
}

/// The storm's shape.
#[derive(Debug, Clone)]
struct Storm {
    label: &'static str,
    keys: usize,
    clients_per_key: usize,
    /// Keys start evenly over this long.
    spread: Duration,
    /// One key in `slow_every` takes `slow_ms` in the checkout.
    slow_every: u64,
    slow_ms: u64,
    /// Every key's first try goes through this Envoy (else a random one).
    first_envoy: Option<usize>,
    /// One key in `refunds_every` is a refund (a held route) instead of a charge (reconciled).
    refunds_every: u64,
    /// One key in `wait_every` has clients that send `Prefer: wait=10` (0: none).
    wait_every: u64,
}

impl Storm {
    fn new(label: &'static str) -> Self {
        Self {
            label,
            keys: 32,
            clients_per_key: 3,
            spread: Duration::from_secs(3),
            slow_every: 3,
            slow_ms: 1_500,
            first_envoy: None,
            refunds_every: 4,
            wait_every: 0,
        }
    }
}

struct Run<'a> {
    stack: &'a NetStack,
    name: &'static str,
    history: Arc<History>,
    rt: ClientRuntime,
    clients: Arc<Clients>,
    keys: Arc<Mutex<BTreeMap<String, KeySpec>>>,
    rng: Arc<Mutex<Rng>>,
    stop_storm: Arc<AtomicBool>,
    stop_probes: Arc<AtomicBool>,
    storm: Vec<tokio::task::JoinHandle<()>>,
    probes: Vec<tokio::task::JoinHandle<()>>,
    counters_before: Vec<BTreeMap<String, u64>>,
    /// What the scenario measured besides the checks' figures (proofs, timings).
    figures: serde_json::Map<String, serde_json::Value>,
}

impl<'a> Run<'a> {
    fn new(stack: &'a NetStack, name: &'static str, seed: u64) -> Self {
        eprintln!("{name}: seed {seed}");
        let rt = ClientRuntime::on(stack.host(CLIENT));
        let mut figures = serde_json::Map::new();
        figures.insert("seed".into(), json!(seed));
        Self {
            stack,
            name,
            history: Arc::new(History::new()),
            rt,
            clients: Arc::new(Clients::new(stack)),
            keys: Arc::new(Mutex::new(BTreeMap::new())),
            rng: Arc::new(Mutex::new(Rng::new(seed))),
            stop_storm: Arc::new(AtomicBool::new(false)),
            stop_probes: Arc::new(AtomicBool::new(false)),
            storm: Vec::new(),
            probes: Vec::new(),
            counters_before: blocking(|| filter_counters(stack)),
            figures,
        }
    }

    /// A run whose storm and probes have started, once the storm is under way
    /// ([`FAULT_AT`]): where each scenario makes its fault.
    async fn start(stack: &'a NetStack, name: &'static str, storm: &Storm) -> Self {
        let mut run = Self::new(stack, name, seed_from_env());
        run.probes();
        run.storm(storm);
        run.sleep_until(FAULT_AT).await;
        run
    }

    /// A fault lasts two leases: every lease taken before it runs out meanwhile.
    async fn for_two_leases(&self) {
        tokio::time::sleep(Duration::from_millis(2 * LEASE_MS)).await;
    }

    fn below(&self, n: u64) -> u64 {
        self.rng.lock().unwrap_or_else(|p| p.into_inner()).below(n)
    }

    /// Starts `storm`'s keys, each with its clients, over its spread (from now).
    fn storm(&mut self, storm: &Storm) {
        for i in 0..storm.keys {
            let key = unique_key(&format!("{}-{i}", storm.label));
            let spec = KeySpec {
                endpoint: if self.below(storm.refunds_every.max(1)) == 0 {
                    "/refunds"
                } else {
                    "/checkout"
                },
                amount: 100 + i as u64,
                prefer_wait_s: (storm.wait_every > 0 && self.below(storm.wait_every) == 0)
                    .then_some(10),
            };
            let delay_ms = if self.below(storm.slow_every.max(1)) == 0 {
                storm.slow_ms
            } else {
                0
            };
            self.keys
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(key.clone(), spec.clone());
            let at = storm.spread.mul_f64(i as f64 / storm.keys.max(1) as f64);
            for _ in 0..storm.clients_per_key {
                let first = storm.first_envoy.unwrap_or_else(|| self.below(2) as usize);
                let (h, c, stop) = (
                    Arc::clone(&self.history),
                    Arc::clone(&self.clients),
                    Arc::clone(&self.stop_storm),
                );
                let (key, spec) = (key.clone(), spec.clone());
                self.storm.push(self.rt.spawn(async move {
                    tokio::time::sleep(at).await;
                    story(h, c, key, spec, delay_ms, first, stop).await;
                }));
            }
        }
    }

    /// A new key every 250 ms through each Envoy, until the run ends.
    fn probes(&mut self) {
        for envoy in 0..2 {
            let (h, c, stop, keys) = (
                Arc::clone(&self.history),
                Arc::clone(&self.clients),
                Arc::clone(&self.stop_probes),
                Arc::clone(&self.keys),
            );
            self.probes.push(self.rt.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let key = unique_key("probe");
                    let spec = KeySpec {
                        endpoint: "/checkout",
                        amount: 1,
                        prefer_wait_s: None,
                    };
                    keys.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(key.clone(), spec.clone());
                    let sent = h.now();
                    let answer = send(c.of(&spec, envoy), request_for(&key, &spec, 0)).await;
                    h.request(&key, spec.endpoint, envoy, Phase::Probe, sent, &answer);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }));
        }
    }

    async fn sleep_until(&self, at: Ms) {
        let now = self.history.now();
        if at > now {
            tokio::time::sleep(Duration::from_millis(at - now)).await;
        }
    }

    /// Cuts `link` and proves it: a connect from its first host to the other's port fails and
    /// its rules counted the packets. `upstream_of`: the Envoy whose link to the checkout it is.
    fn cut(&mut self, link: Link, upstream_of: Option<usize>) -> Cut {
        self.cut_all(vec![(link, upstream_of)]).remove(0)
    }

    /// Cuts every link at once, then proves each cut.
    fn cut_all(&mut self, links: Vec<(Link, Option<usize>)>) -> Vec<Cut> {
        let mut cuts = Vec::new();
        for (link, upstream_of) in links {
            let what = link.describe();
            let cut = self
                .stack
                .net
                .cut(link)
                .unwrap_or_else(|e| panic!("cannot cut {what}: {e}"));
            self.history.fault(&what, false, upstream_of);
            cuts.push(cut);
        }
        for cut in &cuts {
            let link = &cut.link;
            let port = link
                .port
                .or_else(|| listening_port(&link.to))
                .unwrap_or_else(|| panic!("nothing listens on {} to prove a cut with", link.to));
            let to = self.stack.host(&link.to).addr(port);
            let dropped = blocking(|| self.stack.net.prove_cut(cut, &link.from, to))
                .unwrap_or_else(|e| panic!("{e}"));
            self.proof(
                &link.describe(),
                json!({"connect_failed": true, "packets_dropped_by_then": dropped}),
            );
        }
        cuts
    }

    /// Heals `cut`, proves the link works again, and says how many packets the cut dropped.
    fn heal(&mut self, cut: &Cut) -> Ms {
        self.heal_all(std::slice::from_ref(cut))
    }

    /// Heals every cut at once (two halves of one link, say), then proves each link works;
    /// when the last was healed.
    fn heal_all(&mut self, cuts: &[Cut]) -> Ms {
        let mut at = 0;
        for cut in cuts {
            let what = cut.link.describe();
            let dropped = self.stack.net.dropped(cut).unwrap_or(0);
            self.stack
                .net
                .heal(cut)
                .unwrap_or_else(|e| panic!("cannot heal {what}: {e}"));
            at = self.history.fault(&what, true, None);
            self.proof(&what, json!({"packets_dropped": dropped}));
        }
        for cut in cuts {
            let link = &cut.link;
            if let Some(port) = link.port.or_else(|| listening_port(&link.to)) {
                let to = self.stack.host(&link.to).addr(port);
                blocking(|| {
                    self.stack
                        .net
                        .prove_works(&link.from, to, Duration::from_secs(5))
                })
                .unwrap_or_else(|e| panic!("healed {}, yet: {e}", link.describe()));
            }
        }
        at
    }

    fn proof(&mut self, what: &str, value: serde_json::Value) {
        let proofs = self.figures.entry("proofs").or_insert_with(|| json!({}));
        if let Some(map) = proofs.as_object_mut() {
            let entry = map.entry(what.to_owned()).or_insert_with(|| json!({}));
            if let (Some(e), Some(v)) = (entry.as_object_mut(), value.as_object()) {
                e.extend(v.clone());
            }
        }
    }

    /// The rest of the run: the clients go on for a lease and a bit after `healed_at`, then
    /// every key is asked again through both Envoys, and the history is checked.
    async fn finish(mut self, healed_at: Ms) -> Verdict {
        self.sleep_until(healed_at + LEASE_MS + 2_000).await;
        self.stop_storm.store(true, Ordering::Relaxed);
        for t in std::mem::take(&mut self.storm) {
            let _ = t.await;
        }
        // The probes go on until new keys are served again through both Envoys.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline
            && (0..2).any(|e| {
                !self.history.requests().iter().any(|r| {
                    r.phase == Phase::Probe
                        && r.envoy == e
                        && r.sent >= healed_at
                        && r.kind == Kind::Executed
                })
            })
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.stop_probes.store(true, Ordering::Relaxed);
        for t in std::mem::take(&mut self.probes) {
            let _ = t.await;
        }
        let verify_started = Instant::now();
        self.verify().await;
        self.figures.insert(
            "verification_ms".into(),
            json!(verify_started.elapsed().as_millis() as u64),
        );

        let listed = Client::new(&self.stack.checkout.url(""))
            .send(Request::get("/attempts"))
            .await
            .json();
        let attempts = self.history.attempts_from(&listed);
        let policies = BTreeMap::from([
            ("/checkout".to_owned(), Policy::Reconcile),
            ("/refunds".to_owned(), Policy::Hold),
        ]);
        let verdict = Verdict::check(
            &self.history,
            &CheckInput {
                attempts: &attempts,
                policies: &policies,
                lease_ms: LEASE_MS,
                healed_at,
                envoys: 2,
                tolerance_ms: 1_500,
            },
        );
        let records = self.record_states().await;
        let counters = blocking(|| counter_deltas(self.stack, &self.counters_before));
        let mut figures = verdict.figures();
        if let Some(f) = figures.as_object_mut() {
            f.extend(std::mem::take(&mut self.figures));
            f.insert("records_at_the_end".into(), json!(records));
            f.insert("filter_counters".into(), counters);
            f.insert("lease_ms".into(), json!(LEASE_MS));
            f.insert("healed_at_ms".into(), json!(healed_at));
        }
        record_figures(SUITE, self.name, figures);
        // PARTITION_HISTORY_DIR keeps every history to read later.
        if let Ok(dir) = std::env::var("PARTITION_HISTORY_DIR") {
            let path = std::path::Path::new(&dir).join(format!("{}.txt", self.name));
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::write(&path, self.history.dump(&attempts));
            eprintln!("history: {}", path.display());
        }
        eprintln!("{}:\n  {}", self.name, verdict.summary());
        if !verdict.passed() {
            let mut message = format!(
                "{}: {} violation(s)\n{}",
                self.name,
                verdict.violations.len(),
                verdict.summary()
            );
            // The first three with the history around them, the rest in a line each.
            for (i, v) in verdict.violations.iter().enumerate() {
                message.push_str(&format!("\n{} at {} ms: {}", v.key, v.at, v.what));
                if i < 3 {
                    message.push('\n');
                    message.push_str(&self.history.window(&v.key, v.at, 3_000, &attempts));
                }
            }
            panic!("{message}");
        }
        verdict
    }

    /// Every key asked again through each Envoy, until it gets an outcome (or
    /// [`VERIFY_FOR`]), a few dozen keys at a time.
    async fn verify(&self) {
        let keys: Vec<(String, KeySpec)> = self
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect();
        let gate = Arc::new(tokio::sync::Semaphore::new(32));
        let mut tasks = Vec::new();
        for (key, spec) in keys {
            let (h, c, gate) = (
                Arc::clone(&self.history),
                Arc::clone(&self.clients),
                Arc::clone(&gate),
            );
            tasks.push(self.rt.spawn(async move {
                let Ok(_permit) = gate.acquire().await else {
                    return;
                };
                for envoy in 0..2 {
                    let until = Instant::now() + VERIFY_FOR;
                    loop {
                        let sent = h.now();
                        let answer = send(c.of(&spec, envoy), request_for(&key, &spec, 0)).await;
                        let kind =
                            h.request(&key, spec.endpoint, envoy, Phase::Verify, sent, &answer);
                        if kind.is_outcome()
                            || kind == Kind::OutcomeUnknown
                            || Instant::now() > until
                        {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                }
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
    }

    /// How many of this run's records are in each state at the end (the state API's view).
    async fn record_states(&self) -> BTreeMap<String, usize> {
        let keys: Vec<(String, KeySpec)> = self
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect();
        let api = Client::new(&self.stack.state_apis[0].url(""));
        let mut states = BTreeMap::new();
        for (key, spec) in keys {
            let path = format!(
                "{}?key={}&subject=alice&endpoint={}",
                contract::wire::RECORDS_PATH,
                e2e::client::urlencode(&key),
                e2e::client::urlencode(&format!("POST {}", spec.endpoint))
            );
            let state = match api
                .try_send(Request::get(&path).token(e2e::stack::TEST_API_TOKEN))
                .await
            {
                Ok(a) if a.status == 200 => a.json()["state"].as_str().unwrap_or("?").to_owned(),
                Ok(a) => format!("http_{}", a.status),
                Err(_) => "unreachable".to_owned(),
            };
            *states.entry(state).or_insert(0) += 1;
        }
        states
    }
}

/// Sends `req`: `Ok(None)` when the client gave up waiting, `Err` without an HTTP answer.
async fn send(c: &Client, req: Request) -> Result<Option<e2e::client::Answer>, String> {
    match c.try_send(req).await {
        Ok(a) => Ok(Some(a)),
        Err(e) if e.is_timeout() => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// One client of one key: it retries (through the other Envoy each time) until it gets the
/// key's outcome or the storm ends.
async fn story(
    h: Arc<History>,
    clients: Arc<Clients>,
    key: String,
    spec: KeySpec,
    delay_ms: u64,
    first_envoy: usize,
    stop: Arc<AtomicBool>,
) {
    let mut envoy = first_envoy;
    loop {
        let sent = h.now();
        let answer = send(clients.of(&spec, envoy), request_for(&key, &spec, delay_ms)).await;
        let kind = h.request(&key, spec.endpoint, envoy, Phase::Storm, sent, &answer);
        if kind.is_outcome() || stop.load(Ordering::Relaxed) {
            return;
        }
        tokio::time::sleep(RETRY_PAUSE).await;
        envoy = 1 - envoy;
    }
}

/// The filter's counters of every Envoy.
fn filter_counters(stack: &NetStack) -> Vec<BTreeMap<String, u64>> {
    stack
        .envoys
        .iter()
        .map(|e| e.counters("wasmcustom.idempotency"))
        .collect()
}

/// What each Envoy's filter counted during the run (the counters that moved).
fn counter_deltas(stack: &NetStack, before: &[BTreeMap<String, u64>]) -> serde_json::Value {
    let after = filter_counters(stack);
    let per: Vec<BTreeMap<String, u64>> = after
        .iter()
        .zip(before)
        .map(|(a, b)| {
            a.iter()
                .filter_map(|(k, v)| {
                    let d = v.saturating_sub(b.get(k).copied().unwrap_or(0));
                    let name = k.trim_start_matches("wasmcustom.idempotency.");
                    (d > 0).then(|| (name.to_owned(), d))
                })
                .collect()
        })
        .collect();
    json!(per)
}

fn seed_from_env() -> u64 {
    std::env::var("PARTITION_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64 % 1_000_000_007)
                .unwrap_or(7)
        })
}

// ---------------------------------------------------------------------------------------------
// The scenarios

/// 1. Envoy 1 loses both state APIs while slow requests it forwarded run upstream: their
///    heartbeats and completes are lost, their clients give up and retry through Envoy 2,
///    which finds the leases run out and reconciles. Healed after two leases.
async fn envoy_cut_off_from_state_apis(stack: &NetStack) {
    let storm = Storm {
        first_envoy: Some(0),
        slow_every: 2,
        // Longer than two leases: they still run when the link heals.
        slow_ms: 7_000,
        spread: Duration::from_secs(2),
        ..Storm::new("s1")
    };
    let mut run = Run::start(stack, "envoy_cut_off_from_both_state_apis", &storm).await;
    let cuts = run.cut_all(vec![
        (Link::both(ENVOYS[0], STATE_APIS[0]), None),
        (Link::both(ENVOYS[0], STATE_APIS[1]), None),
    ]);
    run.for_two_leases().await;
    let healed_at = run.heal_all(&cuts);
    run.finish(healed_at).await;
}

/// One commit on the old primary, tried directly from a state API's host.
#[derive(Debug, Clone)]
struct ZombieCommit {
    sent: Ms,
    ended: Ms,
    /// The row's id when the commit was acknowledged.
    acked: Option<i64>,
    /// Postgres said the commit was cancelled while it waited for the standby, after it had
    /// committed locally.
    committed_locally_warning: bool,
    /// `acked`, or the first line psql wrote on failing.
    outcome: String,
}

/// Tries a commit on `node` every 200 ms from `host` (with the state API's own settings:
/// `synchronous_commit = on`, a 5 s `statement_timeout`) until `stop`.
fn zombie_probe(
    host: NetHost,
    node: std::net::SocketAddr,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<ZombieCommit>> {
    std::thread::spawn(move || {
        let psql = test_support::postgres::find_bin_dir()
            .map(|d| d.join("psql"))
            .unwrap_or_else(|e| panic!("{e}"));
        let url = format!(
            "postgres://postgres@{node}/{}?connect_timeout=2&options=-c%20statement_timeout%3D5000%20-c%20synchronous_commit%3Don",
            e2e::ha::DATABASE
        );
        host.run(|| {
            let mut tries = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let sent = history.now();
                let out = std::process::Command::new(&psql)
                    .args(["-X", "-q", "-A", "-t", "-d", &url, "-c"])
                    .arg("INSERT INTO zombie_probe (note) VALUES ('zombie') RETURNING id")
                    .output();
                let (acked, warning, outcome) = match &out {
                    Ok(o) => {
                        let stderr = String::from_utf8_lossy(&o.stderr);
                        let acked: Option<i64> = o
                            .status
                            .success()
                            .then(|| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
                            .flatten();
                        let first = stderr.lines().next().unwrap_or("failed").to_owned();
                        (
                            acked,
                            stderr.contains("committed locally"),
                            if acked.is_some() {
                                "acked".to_owned()
                            } else {
                                first
                            },
                        )
                    }
                    Err(e) => (None, false, e.to_string()),
                };
                tries.push(ZombieCommit {
                    sent,
                    ended: history.now(),
                    acked,
                    committed_locally_warning: warning,
                    outcome: outcome
                        .split_once(": ")
                        .map_or(outcome.clone(), |(_, why)| why.to_owned())
                        .chars()
                        .take(90)
                        .collect(),
                });
                std::thread::sleep(Duration::from_millis(200));
            }
            tries
        })
        .unwrap_or_else(|e| panic!("{e}"))
    })
}

/// 2. The zombie primary: cut off from etcd and from the standby, still reachable through
///    HAProxy and directly from a state API's host. Patroni promotes the standby; the old
///    primary must acknowledge no commit once the new one serves (a probe commits on it
///    directly all along); healed, it rejoins as the synchronous standby.
async fn zombie_primary(stack: &NetStack) {
    let old = blocking(|| stack.ha.leader()).unwrap_or_else(|| panic!("no leader"));
    let new = 1 - old;
    blocking(|| {
        stack.ha.psql(
            e2e::ha::DATABASE,
            "CREATE TABLE IF NOT EXISTS zombie_probe (id bigserial PRIMARY KEY, note text, at timestamptz DEFAULT clock_timestamp())",
        )
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let storm = Storm {
        spread: Duration::from_secs(6),
        // Clients that ask to wait give the claim's callout ten more seconds: longer than the
        // state API's statement timeout, so a commit the standby never confirmed could reach
        // them.
        wait_every: 3,
        ..Storm::new("s2")
    };
    let mut run = Run::start(stack, "zombie_primary", &storm).await;
    let stop_zombie = Arc::new(AtomicBool::new(false));
    let zombie = zombie_probe(
        stack.host(STATE_APIS[0]).clone(),
        stack.node_host(old).addr(POSTGRES_PORT),
        Arc::clone(&run.history),
        Arc::clone(&stop_zombie),
    );
    let cuts = run.cut_all(vec![
        (Link::both(NODES[old], ETCD), None),
        (Link::both(NODES[old], NODES[new]), None),
    ]);
    let cut_at = run.history.now();
    // Still reachable: HAProxy reaches it, and a state API's host reaches it directly.
    blocking(|| {
        for (from, to) in [
            (STATE_APIS[0], stack.host(HAPROXY).addr(HAPROXY_PORT)),
            (HAPROXY, stack.node_host(old).addr(POSTGRES_PORT)),
            (STATE_APIS[0], stack.node_host(old).addr(POSTGRES_PORT)),
        ] {
            stack
                .net
                .prove_works(from, to, Duration::from_secs(2))
                .unwrap_or_else(|e| panic!("the zombie must stay reachable: {e}"));
        }
    });
    // Until the standby serves as the new primary; when the old one stopped calling itself so.
    let (mut old_demoted_at, mut new_serves_at) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(60);
    while new_serves_at.is_none() {
        assert!(Instant::now() < deadline, "no failover\n{}", stack.logs());
        let (old_role, new_role) = blocking(|| (stack.ha.role(old), stack.ha.role(new)));
        let now = run.history.now();
        if old_demoted_at.is_none() && old_role != test_support::ha::Role::Primary {
            old_demoted_at = Some(now);
        }
        if new_role == test_support::ha::Role::Primary {
            new_serves_at = Some(now);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let new_serves_at = new_serves_at.unwrap_or(0);
    run.history.fault(
        &format!("{} promoted: serves as the primary", NODES[new]),
        false,
        None,
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let healed_at = run.heal_all(&cuts);
    // The old primary rejoins as the synchronous standby.
    let rejoin = Instant::now();
    blocking(|| stack.ha.wait_healthy(Duration::from_secs(120))).unwrap_or_else(|e| {
        panic!(
            "{e}\nthe old primary's Patroni on rewinding:\n{}\n{}",
            patroni_rewind_lines(stack, old),
            keep_cluster_logs(stack)
        )
    });
    let rejoined_ms = rejoin.elapsed().as_millis() as u64;
    assert_eq!(
        blocking(|| (stack.ha.leader(), stack.ha.role(old))),
        (Some(new), test_support::ha::Role::SyncStandby),
        "after healing the old primary must be the new one's synchronous standby\n{}",
        stack.logs()
    );
    stop_zombie.store(true, Ordering::Relaxed);
    let tries = zombie
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
    let surviving: Vec<i64> = blocking(|| {
        stack
            .ha
            .psql(e2e::ha::DATABASE, "SELECT id FROM zombie_probe")
    })
    .unwrap_or_else(|e| panic!("{e}"))
    .lines()
    .filter_map(|l| l.trim().parse().ok())
    .collect();
    let acked_after_cut: Vec<&ZombieCommit> = tries
        .iter()
        .filter(|t| t.acked.is_some() && t.ended > cut_at)
        .collect();
    let acked_once_new_served: Vec<&ZombieCommit> = acked_after_cut
        .iter()
        .copied()
        .filter(|t| t.ended >= new_serves_at)
        .collect();
    let acked_then_lost: Vec<&ZombieCommit> = acked_after_cut
        .iter()
        .copied()
        .filter(|t| t.acked.is_some_and(|id| !surviving.contains(&id)))
        .collect();
    run.figures.insert(
        "zombie".into(),
        json!({
            "cut_at_ms": cut_at, "old_demoted_itself_at_ms": old_demoted_at,
            "new_primary_serves_at_ms": new_serves_at, "rejoined_as_sync_standby_after_heal_ms": rejoined_ms,
            "direct_commits_tried": tries.len(),
            "acked_after_the_cut": acked_after_cut.iter().map(|t| json!({"sent_ms": t.sent, "acked_ms": t.ended})).collect::<Vec<_>>(),
            "acked_once_the_new_primary_served": acked_once_new_served.len(),
            "acked_after_the_cut_then_lost": acked_then_lost.len(),
            "committed_locally_warnings": tries.iter().filter(|t| t.committed_locally_warning).count(),
            "direct_commit_outcomes": tries.iter().fold(BTreeMap::<String, usize>::new(), |mut m, t| {
                *m.entry(t.outcome.clone()).or_insert(0) += 1;
                m
            }),
        }),
    );
    eprintln!(
        "zombie: cut at {cut_at} ms, old primary demoted itself at {old_demoted_at:?} ms, new primary serves at {new_serves_at} ms; \
         direct commits on the old primary acknowledged after the cut: {:?}",
        acked_after_cut
    );
    assert!(
        acked_once_new_served.is_empty(),
        "the old primary acknowledged commits once the new one served: {acked_once_new_served:?}"
    );
    run.finish(healed_at).await;
}

/// What node `i`'s Patroni said about timelines, rewinding and following: why a node did or
/// did not rejoin.
fn patroni_rewind_lines(stack: &NetStack, i: usize) -> String {
    let log = stack.ha.root().join(format!("node{}.log", i + 1));
    std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            [
                "timeline",
                "rewind",
                "demot",
                "Local ",
                "following",
                "history",
                "diverged",
            ]
            .iter()
            .any(|w| l.contains(w))
        })
        .map(|l| l.chars().take(240).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Copies the cluster's logs (Patroni's, etcd's, HAProxy's, Postgres's) out of its folder,
/// which goes with the cluster: where they are.
fn keep_cluster_logs(stack: &NetStack) -> String {
    let to = stack.dir.join("cluster-logs");
    let copied = std::process::Command::new("sh")
        .arg("-c")
        .arg(r#"mkdir -p "$2" && cd "$1" && cp --parents *.log node*/data/log/* "$2"/"#)
        .arg("sh")
        .arg(stack.ha.root())
        .arg(&to)
        .status()
        .is_ok_and(|s| s.success());
    if copied {
        format!("the cluster's logs: {}", to.display())
    } else {
        format!("could not copy the cluster's logs to {}", to.display())
    }
}

/// 3. State API 1's link to Postgres (through HAProxy) black-holed while its commits are on
///    the way: both directions are cut, so the answers of commits Postgres already made are
///    dropped (counted), and the state API never learns whether they committed. Healed after
///    two leases.
async fn state_api_to_postgres_black_holed(stack: &NetStack) {
    let storm = Storm {
        first_envoy: Some(0),
        spread: Duration::from_secs(4),
        keys: 40,
        ..Storm::new("s3")
    };
    let mut run = Run::start(stack, "state_api_to_postgres_black_holed", &storm).await;
    // Two one-way cuts, so that the answers dropped on their way back are counted apart.
    let cuts = run.cut_all(vec![
        (Link::one_way(STATE_APIS[0], HAPROXY), None),
        (Link::one_way(HAPROXY, STATE_APIS[0]), None),
    ]);
    run.for_two_leases().await;
    let answers_dropped = stack.net.dropped(&cuts[1]).unwrap_or(0);
    run.figures.insert(
        "answers_from_postgres_dropped_packets".into(),
        json!(answers_dropped),
    );
    let healed_at = run.heal_all(&cuts);
    assert!(
        answers_dropped > 0,
        "no answer from Postgres was on its way when the link was cut: the scenario did not cut a commit"
    );
    run.finish(healed_at).await;
}

/// 4. State API 1's answers to Envoy 1 held back past the filter's timeout (a relay on the
///    link): the claims commit, their answers come too late. Then prompt again.
async fn state_api_answers_delayed(stack: &NetStack) {
    let storm = Storm {
        first_envoy: Some(0),
        spread: Duration::from_secs(4),
        ..Storm::new("s4")
    };
    let mut run = Run::start(stack, "state_api_answers_delayed", &storm).await;
    let delay = Duration::from_millis(STATE_API_TIMEOUT_MS + 700);
    let what = format!(
        "answers {}->{} held {} ms",
        STATE_APIS[0],
        ENVOYS[0],
        delay.as_millis()
    );
    let delayed_before = stack.relays[0].delayed_chunks();
    stack.relays[0].set_mode(ProxyMode::DelayAnswers(delay));
    run.history.fault(&what, false, None);
    // The proof: an answer through the relay, from Envoy 1's host, takes at least the delay.
    let through = stack.host(STATE_APIS[0]).addr(RELAY_PORT);
    let took = blocking(|| {
        stack
            .host(ENVOYS[0])
            .run(|| {
                let t = Instant::now();
                e2e::envoy::http_get_at(through, "/healthz").map(|_| t.elapsed())
            })
            .unwrap_or_else(|e| panic!("{e}"))
    })
    .unwrap_or_else(|e| panic!("through the slowed link: {e}"));
    assert!(
        took >= delay,
        "the link is not slow: an answer took {took:?}"
    );
    run.for_two_leases().await;
    stack.relays[0].set_mode(ProxyMode::Pass);
    let healed_at = run.history.fault(&what, true, None);
    run.proof(
        &what,
        json!({"healthz_through_it_ms": took.as_millis() as u64,
               "answer_chunks_held": stack.relays[0].delayed_chunks() - delayed_before}),
    );
    run.finish(healed_at).await;
}

/// 5. Envoy 1's link to the checkout black-holed (both ways: no reset, no FIN) while requests
///    it forwarded run; Envoy answers them itself after its upstream timeout. Healed after
///    two leases (longer than that timeout).
async fn envoy_to_upstream_black_holed(stack: &NetStack) {
    let storm = Storm {
        first_envoy: Some(0),
        slow_every: 2,
        slow_ms: 1_500,
        spread: Duration::from_secs(3),
        ..Storm::new("s5")
    };
    let mut run = Run::start(stack, "envoy_to_upstream_black_holed", &storm).await;
    let cut = run.cut(Link::both(ENVOYS[0], CHECKOUT), Some(0));
    run.for_two_leases().await;
    let healed_at = run.heal(&cut);
    run.finish(healed_at).await;
}

/// 6. Asymmetric: (a) Envoy 1 reaches state API 1, but nothing comes back (its claims arrive
///    and commit; their answers are lost); healed. (b) HAProxy's health checks cannot reach
///    the primary's Patroni, while HAProxy, and the state APIs through it, reach the primary
///    itself; healed.
async fn asymmetric_cuts(stack: &NetStack) {
    let leader = blocking(|| stack.ha.leader()).unwrap_or_else(|| panic!("no leader"));
    let storm = Storm {
        spread: Duration::from_secs(12),
        keys: 48,
        ..Storm::new("s6")
    };
    let mut run = Run::start(stack, "asymmetric_cuts", &storm).await;
    let answers = run.cut(Link::one_way(STATE_APIS[0], ENVOYS[0]), None);
    run.for_two_leases().await;
    run.heal(&answers);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let checks = run.cut(
        Link::one_way(HAPROXY, NODES[leader]).port(PATRONI_PORT),
        None,
    );
    blocking(|| {
        stack.net.prove_works(
            HAPROXY,
            stack.node_host(leader).addr(POSTGRES_PORT),
            Duration::from_secs(2),
        )
    })
    .unwrap_or_else(|e| panic!("the primary itself must stay reachable: {e}"));
    // HAProxy takes the primary out once three checks have failed: until then nothing changes.
    let api = stack.state_apis[0].addr;
    let cut_at = Instant::now();
    while blocking(|| e2e::envoy::http_get_at(api, "/readyz")).is_ok() {
        assert!(
            cut_at.elapsed() < Duration::from_secs(30),
            "HAProxy never took the primary out\n{}",
            stack.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out_after = cut_at.elapsed().as_millis() as u64;
    run.history.fault(
        "HAProxy took the primary out (state API 1 not ready)",
        false,
        None,
    );
    run.figures.insert(
        "haproxy_took_the_primary_out_after_ms".into(),
        json!(out_after),
    );
    run.for_two_leases().await;
    let healed_at = run.heal(&checks);
    blocking(|| stack.ha.wait_healthy(Duration::from_secs(60))).unwrap_or_else(|e| panic!("{e}"));
    run.finish(healed_at).await;
}

/// The links scenario 7 chooses from: every hop of a request and of the cluster.
fn random_links() -> Vec<(&'static str, &'static str)> {
    let mut links = Vec::new();
    for envoy in ENVOYS {
        for api in STATE_APIS {
            links.push((envoy, api));
        }
        links.push((envoy, CHECKOUT));
    }
    for api in STATE_APIS {
        links.push((api, HAPROXY));
    }
    for node in NODES {
        links.push((HAPROXY, node));
        links.push((node, ETCD));
    }
    links.push((NODES[0], NODES[1]));
    links
}

/// A fault scenario 7 has in place.
enum Active {
    Cut(Cut),
    /// Relay `i` (Envoy i's way to its state API) slowed or stalled.
    Relay(usize, String),
}

/// 7. Everything at once: for `PARTITION_SECONDS`, every 0.5-2.5 s the seed cuts a random link
///    (both ways or one, maybe one port), heals one, or slows or stalls an Envoy's way to its
///    state API, with at most three faults at once, under a storm that never stops. Then
///    everything heals and the history is checked.
async fn random_cuts(stack: &NetStack) {
    let seed = seed_from_env();
    let seconds: u64 = std::env::var("PARTITION_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    eprintln!("random_cuts: PARTITION_SEED={seed} PARTITION_SECONDS={seconds}");
    let mut run = Run::new(stack, "random_cuts", seed);
    run.figures.insert("seconds".into(), json!(seconds));
    run.probes();
    let links = random_links();
    let mut active: Vec<Active> = Vec::new();
    let started = Instant::now();
    let mut wave = 0;
    let mut faults_made = 0;
    while started.elapsed() < Duration::from_secs(seconds) {
        // A new wave of keys every 2 s, so the storm covers the whole minute.
        if run.history.now() >= wave * 2_000 {
            run.storm(&Storm {
                keys: 6,
                clients_per_key: 2,
                spread: Duration::from_secs(2),
                ..Storm::new("s7")
            });
            wave += 1;
        }
        let choice = run.below(10);
        if active.len() >= 3 || (choice < 3 && !active.is_empty()) {
            let i = run.below(active.len() as u64) as usize;
            match active.remove(i) {
                Active::Cut(c) => {
                    run.heal(&c);
                }
                Active::Relay(r, what) => {
                    stack.relays[r].set_mode(ProxyMode::Pass);
                    run.history.fault(&what, true, None);
                }
            }
        } else if choice < 8 {
            let (a, b) = links[run.below(links.len() as u64) as usize];
            let (from, to) = if run.below(2) == 0 { (a, b) } else { (b, a) };
            let link = match run.below(3) {
                0 => Link::one_way(from, to),
                _ => Link::both(from, to),
            };
            let upstream_of = ENVOYS
                .iter()
                .position(|e| (from, to) == (*e, CHECKOUT) || (from, to) == (CHECKOUT, *e));
            // One cut per pair of hosts at a time: a second one's packets would be dropped by
            // the first's rules, and its proof could not tell them apart.
            let pair_cut = run.stack.net.cuts().iter().any(|c| {
                (c.link.from.as_str(), c.link.to.as_str()) == (a, b)
                    || (c.link.from.as_str(), c.link.to.as_str()) == (b, a)
            });
            if !pair_cut {
                active.push(Active::Cut(run.cut(link, upstream_of)));
                faults_made += 1;
            }
        } else {
            let r = run.below(2) as usize;
            if !active
                .iter()
                .any(|a| matches!(a, Active::Relay(x, _) if *x == r))
            {
                let (mode, what) = if run.below(2) == 0 {
                    (
                        ProxyMode::DelayAnswers(Duration::from_millis(STATE_API_TIMEOUT_MS + 500)),
                        format!("answers {}->{} held", STATE_APIS[r], ENVOYS[r]),
                    )
                } else {
                    (
                        ProxyMode::Stall,
                        format!("{}->{} stalled", ENVOYS[r], STATE_APIS[r]),
                    )
                };
                stack.relays[r].set_mode(mode);
                run.history.fault(&what, false, None);
                active.push(Active::Relay(r, what));
                faults_made += 1;
            }
        }
        let pause = 500 + run.below(2_000);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    for a in active {
        match a {
            Active::Cut(c) => {
                run.heal(&c);
            }
            Active::Relay(r, what) => {
                stack.relays[r].set_mode(ProxyMode::Pass);
                run.history.fault(&what, true, None);
            }
        }
    }
    let healed_at = run.history.now();
    run.figures.insert("faults_made".into(), json!(faults_made));
    blocking(|| stack.ha.wait_healthy(Duration::from_secs(120))).unwrap_or_else(|e| panic!("{e}"));
    run.figures.insert(
        "cluster_healthy_after_heal_ms".into(),
        json!(run.history.now() - healed_at),
    );
    run.finish(healed_at).await;
}
