//! Issue 46, finding 3: Envoy's router retries, hedges or re-sends below the filter under the
//! same claim. Through the real Envoy, state API, Postgres and checkout, a route whose own
//! `retry_policy` (or hedge policy) would send a protected request again: a 503 the checkout
//! answered after charging, a reset after charging, Istio's default retry policy (retriable
//! status code 503, connect failures, refused streams), a per-try timeout shorter than the
//! checkout's work, a hedge on that timeout, and a client that asks for retries itself. In
//! every case the checkout sees the request once: one attempt of the key, at most one charge.
//!
//! The filter sends what it forwards under a claim with `x-envoy-max-retries: 0`, which the
//! router takes over the route's policy (docs/filter.md, *Router retries below the filter*).
//! Without it (the module built with that code off) every case showed two or three attempts of
//! one key under one fencing token, and where the checkout refused the second one (409, "fencing
//! token reused, nothing was charged") the client got that refusal for a request that charged.

use std::time::{Duration, Instant};

use e2e::client::{unique_key, Client, Request};
use e2e::envoy::Envoy;
use e2e::faults::record_figures;
use e2e::stack::Stack;
use e2e::testkit::*;
use libtest_mimic::{Arguments, Trial};
use yaml_rust2::{Yaml, YamlEmitter, YamlLoader};

const SUITE: &str = "router_retries";

static SHARED: SharedStack = SharedStack::new(default_stack);

/// How a route would send a protected request again, and how the checkout gives it reason to.
struct Case {
    name: &'static str,
    /// The route's own policies (YAML members of its `route` action).
    route: &'static str,
    /// Options of the connection manager (YAML members), replacing the rendered ones.
    hcm: &'static str,
    /// What the request carries (the checkout's test hooks, the client's own headers).
    request: fn(Request) -> Request,
    /// What the client gets: the checkout's answer, or Envoy's for a try it cut or lost.
    answer: u16,
    /// How long the checkout works on it: later attempts, if any, come within this and a bit.
    runs: Duration,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            // The checkout charged and answered 503: `5xx` retries it.
            name: "retry_on_5xx_after_a_charge_answered_503",
            route: "retry_policy:\n  retry_on: 5xx\n  num_retries: 2",
            request: |r| r.header("x-demo-status", "503"),
            hcm: "",
            answer: 503,
            runs: Duration::ZERO,
        },
        Case {
            // The checkout charged and dropped the connection: `reset` retries it.
            name: "retry_on_reset_after_a_charge",
            route: "retry_policy:\n  retry_on: reset\n  num_retries: 2",
            request: |r| r.header("x-demo-reset", "1"),
            hcm: "",
            answer: 503,
            runs: Duration::ZERO,
        },
        Case {
            // What Istio gives a route without `retries`: 2 attempts on these conditions, 503
            // among the retriable status codes.
            name: "istio_s_default_policy_retriable_status_503",
            route: "retry_policy:\n  retry_on: connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes\n  \
                    retriable_status_codes: [503]\n  num_retries: 2",
            request: |r| r.header("x-demo-status", "503"),
            hcm: "",
            answer: 503,
            runs: Duration::ZERO,
        },
        Case {
            // The try is cut at 300 ms while the checkout works 1.5 s (and charges: it runs
            // detached from its caller): `5xx` retries a per-try timeout.
            name: "per_try_timeout_shorter_than_the_checkout_s_work",
            route: "retry_policy:\n  retry_on: 5xx\n  num_retries: 2\n  per_try_timeout: 0.3s",
            request: |r| r.delay_ms(1_500).header("x-demo-detach", "1"),
            hcm: "",
            answer: 504,
            runs: Duration::from_millis(1_500),
        },
        Case {
            // The same, hedged: the first try runs on and another one starts beside it.
            name: "hedge_on_per_try_timeout",
            route: "retry_policy:\n  retry_on: 5xx\n  num_retries: 2\n  per_try_timeout: 0.3s\n\
                    hedge_policy:\n  hedge_on_per_try_timeout: true",
            request: |r| r.delay_ms(1_500).header("x-demo-detach", "1"),
            hcm: "",
            answer: 201,
            runs: Duration::from_millis(1_500),
        },
        Case {
            // No policy on the route: the client asks for retries by the headers the router
            // reads. The connection manager strips them from a client it does not trust; this
            // one it does (its address is internal here, as a mesh's sidecar or a team's own
            // network can be), so they reach the router.
            name: "the_client_s_own_retry_headers_from_an_internal_address",
            route: "",
            request: |r| {
                r.header("x-demo-status", "503")
                    .header("x-envoy-retry-on", "5xx")
                    .header("x-envoy-max-retries", "2")
            },
            hcm: "use_remote_address: true\n\
                  internal_address_config:\n  cidr_ranges:\n    - address_prefix: 127.0.0.0\n      prefix_len: 8",
            answer: 503,
            runs: Duration::ZERO,
        },
    ]
}

fn main() {
    let args = Arguments::from_args();
    let trials: Vec<Trial> = cases()
        .into_iter()
        .map(|case| {
            SHARED.trial(
                case.name,
                move |stack| async move { once(&stack, case).await },
            )
        })
        .collect();
    SHARED.run(&args, trials);
}

/// Where the connection manager's options are in the rendered configuration.
const HCM: &[&str] = &[
    "static_resources",
    "listeners",
    "0",
    "filter_chains",
    "0",
    "filters",
    "0",
    "typed_config",
];

/// Where the route's action is, under the connection manager.
const ROUTE: &[&str] = &["route_config", "virtual_hosts", "0", "routes", "0", "route"];

/// The rendered configuration with `members` (YAML) set in the mapping at `path`.
fn with_members(yaml: &str, path: &[&str], members: &str) -> String {
    if members.is_empty() {
        return yaml.to_owned();
    }
    let mut docs = YamlLoader::load_from_str(yaml).unwrap_or_else(|e| panic!("{e}"));
    let extra = YamlLoader::load_from_str(members).unwrap_or_else(|e| panic!("{members}: {e}"));
    let Some(Yaml::Hash(extra)) = extra.into_iter().next() else {
        panic!("{members}: not a mapping");
    };
    let mut at = &mut docs[0];
    for step in path {
        at = match at {
            Yaml::Hash(h) => h
                .get_mut(&Yaml::String((*step).into()))
                .unwrap_or_else(|| panic!("no `{step}` in the rendered configuration")),
            Yaml::Array(a) => &mut a[step.parse::<usize>().unwrap_or(0)],
            _ => panic!("`{step}`: the rendered configuration has another shape"),
        };
    }
    let Yaml::Hash(map) = at else {
        panic!("{path:?} is not a mapping");
    };
    for (k, v) in extra {
        map.insert(k, v);
    }
    let mut out = String::new();
    let mut emitter = YamlEmitter::new(&mut out);
    emitter.multiline_strings(true);
    emitter.dump(&docs[0]).unwrap_or_else(|e| panic!("{e}"));
    out.push('\n');
    out
}

async fn once(stack: &Stack, case: Case) {
    let name = case.name;
    let params = Stack::envoy_params_for(&stack.options, stack.state_api.port, stack.checkout.port)
        .unwrap_or_else(|e| panic!("{e}"));
    let route: Vec<&str> = HCM.iter().chain(ROUTE).copied().collect();
    let yaml = params.render().unwrap_or_else(|e| panic!("{e}"));
    let yaml = with_members(&with_members(&yaml, &route, case.route), HCM, case.hcm);
    let envoy = Envoy::start_with_yaml(yaml, params, &stack.dir, &format!("envoy-{name}"))
        .unwrap_or_else(|e| panic!("{e}"));
    let c = Client::new(&envoy.url(""));
    let key = unique_key(name);
    let sent = Instant::now();
    let first = c
        .send((case.request)(checkout(&key, "alice", &charge_body(4090))))
        .await;
    let answered = sent.elapsed();
    // Whatever the router would still send (a hedge, a retry after a backoff) has come by the
    // time the checkout's work is over, and a moment more.
    tokio::time::sleep(case.runs + Duration::from_millis(1_000)).await;
    let attempts = attempts(stack, &key).await;
    let charges = executions(stack, &key).await;
    let tokens: Vec<_> = attempts
        .iter()
        .map(|a| a["fencing_token"].clone())
        .collect();
    let states: Vec<_> = attempts.iter().map(|a| a["state"].clone()).collect();
    let cluster = edge::render::UPSTREAM_CLUSTER;
    record_figures(
        SUITE,
        name,
        serde_json::json!({
            "first": first.status, "answered_ms": answered.as_millis() as u64,
            "attempts": attempts.len(), "attempt_states": states, "fencing_tokens": tokens,
            "charges": charges.len(),
            "envoy_upstream_rq_retry": envoy.counter(&format!("cluster.{cluster}.upstream_rq_retry")),
            "envoy_upstream_rq_total": envoy.counter(&format!("cluster.{cluster}.upstream_rq_total")),
            "outcome_unknown": envoy.filter_counter("outcome_unknown"),
        }),
    );
    assert_eq!(
        attempts.len(),
        1,
        "{name}: Envoy's router sent the claimed request {} times under one claim (attempts \
         {states:?}, fencing tokens {tokens:?}); the client got {}\n{}",
        attempts.len(),
        first.describe(),
        envoy.log_tail()
    );
    assert_eq!(charges.len(), 1, "{name}: charges {charges:?}");
    // Not the checkout's refusal of a second attempt under the same token (409, "nothing was
    // charged") passed off as the outcome of a request that charged.
    assert_eq!(first.status, case.answer, "{name}: {}", first.describe());
    assert_eq!(
        envoy.counter(&format!("cluster.{cluster}.upstream_rq_retry")),
        0,
        "{name}: Envoy counted a retry to the checkout"
    );
}
