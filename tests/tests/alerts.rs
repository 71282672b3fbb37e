//! `make test-alerts`: the alert rules of examples/prometheus on a real Prometheus (Debian's
//! `prometheus`) scraping a real stack. Prometheus runs the example's own configuration, with
//! the stack's ports for the targets and 1 s intervals, and the rules file as committed; the
//! test drives an unknown outcome (a client that gives up while the checkout runs) and sees the
//! IdempotencyOutcomeUnknown expression, read from alerts.yml, become true through
//! Prometheus's query API, and the alert fire. (promtool's unit tests of every alert run in
//! the same make target.)

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use e2e::client::{unique_key, urlencode, Client};
use e2e::net::free_port;
use e2e::process::{workspace_root, ChildGuard};
use e2e::stack::{run_dir, Stack, StackOptions};
use e2e::testkit::{block_on, charge_body, checkout};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::Value;
use yaml_rust2::{Yaml, YamlEmitter, YamlLoader};

const ALERT: &str = "IdempotencyOutcomeUnknown";

fn main() {
    let args = Arguments::from_args();
    let trials = vec![Trial::test(
        "an_unknown_outcome_makes_the_alert_true_on_a_real_prometheus",
        unknown_outcome_alert,
    )];
    libtest_mimic::run(&args, trials).exit();
}

fn examples() -> PathBuf {
    workspace_root().join("examples/prometheus")
}

fn load_yaml(path: &Path) -> Result<Yaml, Failed> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    YamlLoader::load_from_str(&text)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .into_iter()
        .next()
        .ok_or_else(|| format!("{} is empty", path.display()).into())
}

/// The expression of alert `name` in alerts.yml.
fn alert_expr(name: &str) -> Result<String, Failed> {
    let rules = load_yaml(&examples().join("alerts.yml"))?;
    rules["groups"]
        .as_vec()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_vec().cloned().unwrap_or_default())
        .find(|r| r["alert"].as_str() == Some(name))
        .and_then(|r| r["expr"].as_str().map(str::to_owned))
        .ok_or_else(|| format!("alerts.yml has no alert {name}").into())
}

/// examples/prometheus/prometheus.yml for this stack: its jobs' targets on the stack's ports
/// (the Patroni job dropped: this stack has one Postgres), 1 s intervals, the rules file by
/// its absolute path.
fn config_for(stack: &Stack) -> Result<String, Failed> {
    let mut config = load_yaml(&examples().join("prometheus.yml"))?;
    let Yaml::Hash(ref mut top) = config else {
        return Err("prometheus.yml is not a mapping".into());
    };
    let key = |k: &str| Yaml::String(k.to_owned());
    if let Some(Yaml::Hash(global)) = top.get_mut(&key("global")) {
        global.insert(key("scrape_interval"), key("1s"));
        global.insert(key("evaluation_interval"), key("1s"));
    }
    top.insert(
        key("rule_files"),
        Yaml::Array(vec![key(&examples()
            .join("alerts.yml")
            .display()
            .to_string())]),
    );
    let targets = |job: &str| match job {
        "envoy" => Some(format!("127.0.0.1:{}", stack.envoy.params.admin_port)),
        "state-api" => Some(format!("127.0.0.1:{}", stack.state_api.port)),
        _ => None,
    };
    let jobs = top
        .get(&key("scrape_configs"))
        .and_then(Yaml::as_vec)
        .cloned()
        .unwrap_or_default();
    let mut kept = Vec::new();
    for mut job in jobs {
        let name = job["job_name"].as_str().unwrap_or_default().to_owned();
        let Some(target) = targets(&name) else {
            continue;
        };
        if let Yaml::Hash(ref mut j) = job {
            let mut statics = yaml_rust2::yaml::Hash::new();
            statics.insert(key("targets"), Yaml::Array(vec![key(&target)]));
            j.insert(
                key("static_configs"),
                Yaml::Array(vec![Yaml::Hash(statics)]),
            );
        }
        kept.push(job);
    }
    if kept.len() != 2 {
        return Err(
            format!("prometheus.yml should scrape the envoy and state-api jobs: {kept:?}").into(),
        );
    }
    top.insert(key("scrape_configs"), Yaml::Array(kept));
    let mut out = String::new();
    YamlEmitter::new(&mut out)
        .dump(&config)
        .map_err(|e| format!("cannot write YAML: {e:?}"))?;
    Ok(out)
}

fn prometheus_binary() -> Result<String, Failed> {
    let found = Command::new("prometheus")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        Ok("prometheus".into())
    } else {
        Err("`prometheus` not found: apt-get install prometheus (`make test-alerts` installs it as root)".into())
    }
}

/// A running Prometheus on a free port, removed with its data when dropped.
struct Prometheus {
    port: u16,
    dir: PathBuf,
    _process: ChildGuard,
}

impl Prometheus {
    fn start(config: &str, dir: PathBuf) -> Result<Self, Failed> {
        let bin = prometheus_binary()?;
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).map_err(|e| e.to_string())?;
        let port = free_port();
        let log = std::fs::File::create(dir.join("prometheus.log")).map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let process = ChildGuard::spawn(
            "prometheus",
            Command::new(bin)
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log2),
        )?;
        Ok(Self {
            port,
            dir,
            _process: process,
        })
    }

    fn log(&self) -> String {
        e2e::process::log_tail(&self.dir.join("prometheus.log"))
    }

    async fn get(&self, path: &str) -> Result<Value, String> {
        let url = format!("http://127.0.0.1:{}{path}", self.port);
        let body = reqwest::get(&url)
            .await
            .map_err(|e| e.to_string())?
            .text()
            .await
            .map_err(|e| e.to_string())?;
        serde_json::from_str(&body).map_err(|e| format!("{url}: {e}: {body}"))
    }

    /// The result vector of an instant query.
    async fn query(&self, promql: &str) -> Result<Vec<Value>, String> {
        let answer = self
            .get(&format!("/api/v1/query?query={}", urlencode(promql)))
            .await?;
        if answer["status"] != "success" {
            return Err(format!("{promql}: {answer}"));
        }
        Ok(answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Polls `check` every 500 ms until it says yes, or fails after `limit` with the log.
    async fn until<F, Fut>(&self, what: &str, limit: Duration, mut check: F) -> Duration
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let started = Instant::now();
        while started.elapsed() < limit {
            if check().await {
                return started.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!("{what}: not within {limit:?}\n{}", self.log());
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.dir.join("data"));
    }
}

fn unknown_outcome_alert() -> Result<(), Failed> {
    let expr = alert_expr(ALERT)?;
    let stack = Stack::start(StackOptions::default()).map_err(Failed::from)?;
    let dir = run_dir("prometheus").map_err(Failed::from)?;
    let prometheus = Prometheus::start(&config_for(&stack)?, dir)?;
    block_on(async move {
        let p = &prometheus;
        let scraped = p
            .until("both targets up", Duration::from_secs(60), || async {
                p.query("up == 1").await.is_ok_and(|r| r.len() == 2)
            })
            .await;
        eprintln!("prometheus: envoy and state-api scraped after {scraped:?}");
        // The filter's counter is exported (a counter that never moved shows 0 here).
        p.until(
            "idempotency_outcome_unknown scraped",
            Duration::from_secs(30),
            || async {
                p.query("idempotency_outcome_unknown")
                    .await
                    .is_ok_and(|r| !r.is_empty())
            },
        )
        .await;
        let before = p.query(&expr).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            before.is_empty(),
            "{ALERT} is true before anything happened: {before:?}"
        );

        // The client gives up after 1 s while the checkout takes 3 s: the outcome is unknown.
        let impatient = Client::impatient(&stack.envoy.url(""), Duration::from_secs(1));
        let key = unique_key("alert");
        let gave_up = impatient
            .try_send(checkout(&key, "alice", &charge_body(700)).delay_ms(3000))
            .await;
        assert!(
            gave_up.is_err(),
            "the request should have timed out: {gave_up:?}"
        );
        let driven = Instant::now();

        let true_after = p
            .until(
                &format!("{ALERT}'s expression true"),
                Duration::from_secs(30),
                || async { p.query(&expr).await.is_ok_and(|r| !r.is_empty()) },
            )
            .await;
        p.until(
            &format!("{ALERT} firing"),
            Duration::from_secs(30),
            || async {
                p.get("/api/v1/alerts").await.is_ok_and(|a| {
                    a["data"]["alerts"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|alert| {
                            alert["labels"]["alertname"] == ALERT && alert["state"] == "firing"
                        })
                })
            },
        )
        .await;
        eprintln!(
            "prometheus: {ALERT}'s expression true {true_after:?} and firing {:?} after the unknown outcome",
            driven.elapsed()
        );
    })
}
