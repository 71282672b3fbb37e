//! The stack on a highly available Postgres (issue 16): Patroni, a synchronous standby, HAProxy
//! on the port the state API connects to. The primary is lost under a duplicate storm (its
//! Patroni and its postmaster SIGKILLed together), the old primary rejoins as a standby and a
//! second failover goes back to it; a postmaster killed alone is restarted in place; an owner
//! alive through a failover longer than its lease keeps its key. Through the real Envoy, filter,
//! state API and checkout: 0 double charges, 0 completed records lost, every answer during the
//! switch a 503 + `Retry-After` or correct.
//!
//! Each test has a cluster of its own and they run one at a time (failover timings on 2 cores).
//! Figures go to target/fault-figures.jsonl (docs/RELIABILITY.md quotes them).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use e2e::client::{unique_key, Answer, Client, Request};
use e2e::envoy::Tweak;
use e2e::faults::{executions_per_key, ledger, record_figures, Rng};
use e2e::ha::HaStack;
use e2e::process::Signal;
use e2e::services::ServiceTestExt as _;
use e2e::stack::StackOptions;
use e2e::testkit::*;
use edge::config::OnUnknown;
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::json;
use test_support::ha::HaClusterTestExt as _;

const SUITE: &str = "ha";

fn main() {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    let trials = vec![
        ha_trial(
            "a_duplicate_storm_through_the_loss_of_the_primary_and_back_charges_once_and_loses_nothing",
            storm_options(),
            1,
            storm_through_two_failovers,
        ),
        ha_trial(
            "a_postmaster_killed_alone_is_restarted_in_place_by_its_patroni_under_a_storm",
            storm_options(),
            1,
            storm_through_a_postmaster_crash,
        ),
        ha_trial(
            "an_owner_alive_through_a_failover_longer_than_its_lease_keeps_its_key_a_retry_elsewhere_gets_409",
            StackOptions {
                lease_ms: 4_000,
                heartbeat_ms: 1_000,
                // The dangerous policy: a lease taken for run out would run the charge again.
                tweak: Some(Tweak::new(|c| {
                    let route = &mut c.routes[0];
                    route.on_unknown = OnUnknown::Reexecute;
                    route.reconcile = None;
                })),
                ..StackOptions::default()
            },
            2,
            lease_guard_across_failover,
        ),
        Trial::test(
            "what_the_synchronous_standby_costs_per_commit",
            sync_commit_cost,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// Short leases, so that a claim whose answer the failover lost frees its key within seconds.
fn storm_options() -> StackOptions {
    StackOptions {
        lease_ms: 5_000,
        heartbeat_ms: 1_500,
        ..StackOptions::default()
    }
}

fn ha_trial<F, Fut>(name: &'static str, options: StackOptions, edges: usize, body: F) -> Trial
where
    F: FnOnce(HaStack) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    Trial::test(name, move || {
        let stack = HaStack::start(options, edges).map_err(Failed::from)?;
        block_on(body(stack))
    })
}

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

// ---------------------------------------------------------------------------------------------
// The storm

/// One client's story with one key: it retries on 409 and 503 (after a short pause) until it
/// gets the outcome, as a well-behaved client does.
struct Story {
    key: String,
    answers: Vec<&'static str>,
    last: Answer,
}

async fn persist(c: Client, key: String, amount: u64, delay_ms: u64) -> Story {
    let give_up = Instant::now() + Duration::from_secs(120);
    let mut answers = Vec::new();
    loop {
        let mut req = checkout(&key, "alice", &charge_body(amount));
        if delay_ms > 0 {
            req = req.delay_ms(delay_ms);
        }
        let a = match c.try_send(req).await {
            Ok(a) => a,
            Err(e) => panic!("{key}: the request failed without an answer: {e}"),
        };
        let kind = classify(&a);
        answers.push(kind);
        if matches!(kind, "executed" | "replay") || kind == "other" || Instant::now() > give_up {
            return Story {
                key,
                answers,
                last: a,
            };
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Keys × duplicates, a third of them slow (2 s in the checkout), sent over `spread` while
/// `fault` runs once `fault_after` has passed. Returns every story, and the time from the fault
/// to the first new key executed after it.
async fn storm<F: FnOnce(&mut test_support::ha::HaCluster)>(
    stack: &mut HaStack,
    label: &str,
    fault_after: Duration,
    fault: F,
) -> (Vec<Story>, Duration, BTreeMap<&'static str, usize>) {
    const KEYS: usize = 48;
    const DUPLICATES: usize = 4;
    let c = Client::new(&stack.envoys[0].url(""));
    let mut rng = Rng::from_env(label);
    let mut tasks = Vec::new();
    let started = Instant::now();
    let spread = fault_after * 2;
    for i in 0..KEYS {
        let key = unique_key(&format!("{label}{i}"));
        let delay_ms = if rng.below(3) == 0 { 2_000 } else { 0 };
        let at = spread.mul_f64(i as f64 / KEYS as f64);
        for _ in 0..DUPLICATES {
            let (c, key) = (c.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(at).await;
                persist(c, key, 100 + i as u64, delay_ms).await
            }));
        }
    }
    tokio::time::sleep(fault_after.saturating_sub(started.elapsed())).await;
    blocking(|| fault(&mut stack.ha));
    let faulted = Instant::now();
    // A probe: a new key every 200 ms until one executes.
    let probe = {
        let c = c.clone();
        let label = label.to_owned();
        tokio::spawn(async move {
            loop {
                let a = c
                    .send(checkout(
                        &unique_key(&format!("{label}-probe")),
                        "alice",
                        &charge_body(1),
                    ))
                    .await;
                if a.status == 201 {
                    return faulted.elapsed();
                }
                assert_eq!(
                    classify(&a),
                    "unavailable_503",
                    "a new key during the switch: {}",
                    a.describe()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let mut stories = Vec::new();
    for t in tasks {
        stories.push(t.await.unwrap_or_else(|e| panic!("a client task: {e}")));
    }
    let recovered = probe.await.unwrap_or_else(|e| panic!("probe: {e}"));
    let mut tally = BTreeMap::new();
    for s in &stories {
        for a in &s.answers {
            *tally.entry(*a).or_insert(0) += 1;
        }
    }
    (stories, recovered, tally)
}

/// Every story ended with its outcome, each key ran once, and every key replays now (from
/// whichever node leads): nothing acknowledged was lost.
async fn assert_once_and_replayed(stack: &HaStack, stories: &[Story]) -> usize {
    let per_key = executions_per_key(&ledger(&stack.checkout.url("")).await);
    let mut outcome_of: BTreeMap<&str, Vec<u8>> = BTreeMap::new();
    for s in stories {
        assert!(
            matches!(classify(&s.last), "executed" | "replay"),
            "{}: ended with {} after {:?}\n{}",
            s.key,
            s.last.describe(),
            s.answers,
            stack.logs()
        );
        let body = outcome_of
            .entry(&s.key)
            .or_insert_with(|| s.last.body.clone());
        assert_eq!(
            *body, s.last.body,
            "{}: two clients of one key saw two outcomes",
            s.key
        );
    }
    for key in outcome_of.keys() {
        assert_eq!(
            per_key.get(*key).copied(),
            Some(1),
            "{key}: charged {:?} times",
            per_key.get(*key)
        );
    }
    // Through a fresh client after the switch: every key is a replay of what its clients saw.
    let c = Client::new(&stack.envoys[0].url(""));
    let mut replays = 0;
    for s in stories {
        if !outcome_of.contains_key(s.key.as_str()) {
            continue;
        }
        let amount = s.last.json()["amount"].as_u64().unwrap_or(0);
        // A client may have had its 201 while the outcome's complete could not be stored (the
        // state API answered 503 through the switch): the filter then lets the response go and
        // its worker retries the complete, with delays of up to 8 s (`worker::writes`), so the
        // key is in progress until that retry lands. Wait that out, never longer.
        let patience = Instant::now() + Duration::from_secs(20);
        let a = loop {
            let a = c
                .send(checkout(&s.key, "alice", &charge_body(amount)))
                .await;
            if classify(&a) != "in_progress_409" || Instant::now() > patience {
                break a;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        assert!(
            replayed(&a) && Some(&a.body) == outcome_of.get(s.key.as_str()),
            "{}: completed before or during the failover, not replayed after it: {}",
            s.key,
            a.describe()
        );
        outcome_of.remove(s.key.as_str());
        replays += 1;
    }
    replays
}

fn double_charges(per_key: &BTreeMap<String, usize>) -> usize {
    per_key.values().filter(|n| **n > 1).count()
}

async fn storm_through_two_failovers(mut stack: HaStack) {
    let first = blocking(|| stack.ha.leader()).unwrap_or_else(|| panic!("no leader"));
    let (stories, recovered, tally) = storm(&mut stack, "failover", Duration::from_secs(3), |ha| {
        ha.lose_node(first)
    })
    .await;
    let promoted = blocking(|| stack.ha.leader());
    assert_eq!(
        promoted,
        Some(1 - first),
        "the standby must lead now\n{}",
        stack.logs()
    );
    let replays = assert_once_and_replayed(&stack, &stories).await;
    // Meanwhile the old primary is down: the new one goes on alone (the storm's probe executed
    // a new key; synchronous mode, not strict) and its state API says so.
    let api_port = stack.state_apis[0].port;
    let alone = blocking(|| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let ready = e2e::net::http_get_blocking(api_port, "/readyz").unwrap_or_default();
            if ready.contains("no standby") || Instant::now() > deadline {
                return ready;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    assert!(alone.contains("no standby"), "readyz: {alone}");

    // The old primary comes back as a standby (rewound), and a second failover goes back to it.
    let rejoin_started = Instant::now();
    blocking(|| stack.ha.start_node(first)).unwrap_or_else(|e| panic!("{e}"));
    blocking(|| stack.ha.wait_healthy(Duration::from_secs(120))).unwrap_or_else(|e| panic!("{e}"));
    let rejoined = rejoin_started.elapsed();
    let (back, recovered_back, tally_back) =
        storm(&mut stack, "failback", Duration::from_secs(3), |ha| {
            ha.lose_node(1 - first)
        })
        .await;
    assert_eq!(blocking(|| stack.ha.leader()), Some(first));
    let replays_back = assert_once_and_replayed(&stack, &back).await;
    // The keys of the first storm survived both failovers too.
    let replays_first_again = assert_once_and_replayed(&stack, &stories).await;

    let per_key = executions_per_key(&ledger(&stack.checkout.url("")).await);
    let timeline: String = stack
        .psql("SELECT max(timeline_id) FROM idempotency_timelines")
        .unwrap_or_default();
    record_figures(
        SUITE,
        "primary_lost_under_a_storm",
        json!({"keys_per_storm": 48, "duplicates_per_key": 4, "patroni_ttl_s": test_support::ha::TTL_S,
               "patroni_loop_wait_s": test_support::ha::LOOP_WAIT_S,
               "first_failover": {"answers": tally, "new_keys_again_after_ms": recovered.as_millis() as u64, "completed_replayed_after": replays},
               "rejoined_as_sync_standby_after_ms": rejoined.as_millis() as u64,
               "failover_back": {"answers": tally_back, "new_keys_again_after_ms": recovered_back.as_millis() as u64, "completed_replayed_after": replays_back},
               "first_storm_replayed_after_both": replays_first_again,
               "keys_charged_twice": double_charges(&per_key), "timelines_seen": timeline}),
    );
    assert_eq!(double_charges(&per_key), 0);
}

async fn storm_through_a_postmaster_crash(mut stack: HaStack) {
    let leader = blocking(|| stack.ha.leader()).unwrap_or_else(|| panic!("no leader"));
    let mut killed = None;
    let (stories, recovered, tally) = storm(&mut stack, "pgcrash", Duration::from_secs(3), |ha| {
        killed = Some(ha.kill_postmaster(leader).unwrap_or_else(|e| panic!("{e}")));
    })
    .await;
    let old_pid = killed;
    // Restarted in place: the same node leads, with a new postmaster.
    blocking(|| stack.ha.wait_healthy(Duration::from_secs(60))).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        blocking(|| stack.ha.leader()),
        Some(leader),
        "no failover for a crash alone"
    );
    assert_ne!(blocking(|| stack.ha.postmaster_pid(leader)), old_pid);
    let replays = assert_once_and_replayed(&stack, &stories).await;
    let per_key = executions_per_key(&ledger(&stack.checkout.url("")).await);
    record_figures(
        SUITE,
        "postmaster_killed_alone_under_a_storm",
        json!({"answers": tally, "new_keys_again_after_ms": recovered.as_millis() as u64,
               "completed_replayed_after": replays, "keys_charged_twice": double_charges(&per_key)}),
    );
    assert_eq!(double_charges(&per_key), 0);
}

// ---------------------------------------------------------------------------------------------
// The lease guard across a failover

/// A 30 s charge through Envoy 0. Its state API is frozen (SIGSTOP) while the primary is lost,
/// so no heartbeat reaches the promoted standby: by the clock the lease (4 s) has run out long
/// before the new primary serves. Retries through Envoy 1 (on a route that re-executes unknown
/// outcomes) must get 409 for a whole lease after the new primary's timeline began, which gives
/// the owner, thawed, the time to heartbeat and store its outcome: charged once, then replayed.
async fn lease_guard_across_failover(mut stack: HaStack) {
    let owner = Client::new(&stack.envoys[0].url(""));
    let elsewhere = Client::new(&stack.envoys[1].url(""));
    let key = unique_key("guard");
    let body = charge_body(3030);
    let first = send_in_background(&owner, checkout(&key, "alice", &body).delay_ms(30_000));
    let deadline = Instant::now() + Duration::from_secs(10);
    while attempt_states_at(&stack, &key).await != ["running"] {
        assert!(Instant::now() < deadline, "the first attempt never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    stack.state_apis[0]
        .signal(Signal::STOP)
        .unwrap_or_else(|e| panic!("{e}"));
    let leader = blocking(|| stack.ha.leader()).unwrap_or_else(|| panic!("no leader"));
    let lost_at = Instant::now();
    blocking(|| stack.ha.lose_node(leader));
    // Retries from elsewhere while the standby takes over, until it serves.
    let mut answers: BTreeMap<&'static str, usize> = BTreeMap::new();
    let served_at = loop {
        let a = elsewhere.send(checkout(&key, "alice", &body)).await;
        let kind = classify(&a);
        *answers.entry(kind).or_insert(0) += 1;
        match kind {
            "unavailable_503" => {}
            // Served by the promoted standby. (A 409 can also come before the promotion, from
            // a backend of the lost primary that has not noticed its postmaster's death yet, on
            // a loaded machine: that one says nothing of the guard, so the loop goes on.)
            "in_progress_409" if blocking(|| stack.ha.leader()) == Some(1 - leader) => {
                break Instant::now()
            }
            "in_progress_409" => {}
            _ => panic!("during the failover: {}\n{}", a.describe(), stack.logs()),
        }
        assert!(
            lost_at.elapsed() < Duration::from_secs(60),
            "no failover\n{}",
            stack.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let failover = served_at - lost_at;
    // By the clock the lease has run out (its last heartbeat came before the freeze): the
    // guard is what holds the key now.
    assert!(
        failover > Duration::from_millis(stack.options.lease_ms),
        "the test needs a failover longer than the lease"
    );
    // More retries within the lease after the promotion: still 409, never a second execution.
    for _ in 0..5 {
        let a = elsewhere.send(checkout(&key, "alice", &body)).await;
        assert_eq!(
            classify(&a),
            "in_progress_409",
            "a retry elsewhere right after the failover: {}",
            a.describe()
        );
        *answers.entry("in_progress_409").or_insert(0) += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The database agrees, read after the retries: a psql through HAProxy right after a
    // failover may wait for a connection, and the retries above must fall within the guard.
    let lease_over: String = stack
        .psql("SELECT bool_and(lease_expires_at < clock_timestamp()) FROM idempotency_records")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(lease_over, "t", "no heartbeat while the owner was frozen");
    // The owner thaws, heartbeats on the new primary, and stores its outcome.
    stack.state_apis[0]
        .signal(Signal::CONT)
        .unwrap_or_else(|e| panic!("{e}"));
    let a = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.status, 201, "the owner's answer: {}", a.describe());
    let again = elsewhere.send(checkout(&key, "alice", &body)).await;
    assert!(
        replayed(&again) && again.body == a.body,
        "{}",
        again.describe()
    );
    let attempts = attempt_states_at(&stack, &key).await;
    assert_eq!(attempts, ["executed"], "one attempt, executed once");
    record_figures(
        SUITE,
        "lease_guard_across_failover",
        json!({"lease_ms": stack.options.lease_ms, "failover_ms": failover.as_millis() as u64,
               "answers_elsewhere": answers, "attempts": attempts, "charges": 1}),
    );
}

/// The checkout's attempts for `key`: their states, oldest first.
async fn attempt_states_at(stack: &HaStack, key: &str) -> Vec<String> {
    let all = Client::new(&stack.checkout.url(""))
        .send(Request::get("/attempts"))
        .await
        .json();
    all.as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["idempotency_key"] == key)
        .filter_map(|a| a["state"].as_str().map(str::to_owned))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// What the synchronous standby costs

/// One-row INSERT commits, one client, on the primary: with the synchronous standby
/// (`synchronous_commit=on`) and without waiting for it (`local`), in the same run.
fn sync_commit_cost() -> Result<(), Failed> {
    let ha = test_support::ha::HaCluster::start()?;
    ha.psql(
        "postgres",
        "CREATE TABLE commit_cost (id bigserial PRIMARY KEY, at timestamptz DEFAULT now())",
    )?;
    let leader = ha.leader().ok_or("no leader")?;
    let run = |mode: &str| -> Result<f64, String> {
        let script = std::env::temp_dir().join(format!("commit-cost-{}.sql", std::process::id()));
        std::fs::write(&script, "INSERT INTO commit_cost DEFAULT VALUES;\n")
            .map_err(|e| e.to_string())?;
        let bin = test_support::postgres::find_bin_dir()?;
        let out = std::process::Command::new(bin.join("pgbench"))
            .args(["-n", "-c", "1", "-T", "4", "-f"])
            .arg(&script)
            .arg(format!(
                "postgres://postgres@127.0.0.1:{}/postgres",
                ha.ports().postgres[leader]
            ))
            .env("PGOPTIONS", format!("-c synchronous_commit={mode}"))
            .output()
            .map_err(|e| format!("cannot run pgbench: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| {
                l.strip_prefix("tps = ")
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|n| n.parse::<f64>().ok())
            })
            .ok_or_else(|| {
                format!(
                    "pgbench said: {text}{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })
    };
    let local = run("local")?;
    let sync = run("on")?;
    let local_again = run("local")?;
    let local = (local + local_again) / 2.0;
    record_figures(
        SUITE,
        "synchronous_standby_commit_cost",
        json!({"commits_per_s_local": local.round(), "commits_per_s_sync": sync.round(),
               "ms_per_commit_local": (1000.0 / local * 1000.0).round() / 1000.0,
               "ms_per_commit_sync": (1000.0 / sync * 1000.0).round() / 1000.0,
               "sync_over_local": (local / sync * 100.0).round() / 100.0}),
    );
    if sync <= 0.0 || local <= 0.0 {
        return Err("no commits measured".into());
    }
    Ok(())
}
