//! The root context: one per worker. It parses the configuration, defines the counters, and
//! on each tick extends the leases of the worker's in-flight claims, retries the completes
//! handed over to it and drops expired entries of the replay cache. With
//! `complete_in_background` a stream wakes it through the worker's shared queue, and it sends
//! the completes handed over to it at once.

use super::abi::{self, Level};
use super::http::Http;
use super::{callout_result, dispatch, Counters, Worker};
use crate::config::Config;
use crate::flow::Callout;
use crate::metrics::Metric;
use crate::retry::{self, Done};
use contract::wire::{COMPLETE_PATH, HEARTBEAT_PATH};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::rc::Rc;

/// What a callout of the root context was for (by fencing token of the claim).
#[derive(Debug, Clone, Copy)]
enum Call {
    Heartbeat(i64),
    Complete(i64),
}

pub(crate) struct Root {
    context_id: u32,
    cfg: Option<Rc<Config>>,
    worker: Rc<Worker>,
    /// Callouts on their way: (callout token, what it is for).
    calls: Vec<(u32, Call)>,
}

impl Root {
    pub(crate) fn new(context_id: u32) -> Self {
        Self {
            context_id,
            cfg: None,
            worker: Rc::new(Worker::unconfigured()),
            calls: Vec::new(),
        }
    }

    fn count(&self, m: Metric) {
        self.worker.counters.count(m);
    }

    fn heartbeat_answered(&self, token: i64, answer: Callout) {
        let Ok(mut registry) = self.worker.registry.try_borrow_mut() else {
            return;
        };
        registry.answered(token);
        match answer {
            Callout::Answer { status, body } if (200..300).contains(&status) => {
                if crate::answers::heartbeat(&body).is_ok() {
                    self.count(Metric::Heartbeats);
                } else {
                    self.count(Metric::StateApiErrors);
                    abi::log(Level::Warn, "idempotency: unreadable heartbeat answer");
                }
            }
            Callout::Answer { status: 409, .. } => {
                // A newer claim owns the key: stop extending this one, and stop completing it.
                registry.remove(token);
                self.count(Metric::FencedOut);
                let pending = match self.worker.retries.try_borrow_mut() {
                    Ok(mut r) => r.remove(token),
                    Err(_) => None,
                };
                let pending = match (pending, self.worker.cache.try_borrow_mut()) {
                    (Some(claim), Ok(mut cache)) => {
                        cache.remove(&retry::cache_id(&claim));
                        true
                    }
                    (pending, _) => pending.is_some(),
                };
                abi::log(
                    Level::Warn,
                    if pending {
                        "idempotency: heartbeat fenced out; a newer claim owns the key (its pending complete is dropped)"
                    } else {
                        "idempotency: heartbeat fenced out; a newer claim owns the key"
                    },
                );
            }
            Callout::Answer { status, .. } => {
                self.count(Metric::StateApiErrors);
                abi::log(
                    Level::Warn,
                    &format!("idempotency: heartbeat answered HTTP {status}"),
                );
            }
            Callout::Failed(why) => {
                self.count(Metric::StateApiErrors);
                abi::log(
                    Level::Warn,
                    &format!("idempotency: heartbeat failed: {why}"),
                );
            }
        }
    }

    fn retry_answered(&self, token: i64, answer: Callout, now: u64) {
        let (verdict, expires_in_ms) = retry::read_answer(&answer);
        let done = match self.worker.retries.try_borrow_mut() {
            Ok(mut r) => r.answered(token, verdict, now),
            Err(_) => return,
        };
        match done {
            None if verdict == retry::Answer::Failed => {
                self.count(Metric::StateApiErrors);
                if let Callout::Failed(why) = answer {
                    abi::log(
                        Level::Debug,
                        &format!("idempotency: complete retry failed: {why}"),
                    );
                }
            }
            None => {}
            Some(done) => self.finish(done, expires_in_ms, now),
        }
    }

    /// A handed-over complete is over: its heartbeat stops, its pending cache entry settles.
    fn finish(&self, done: Done, expires_in_ms: Option<u64>, now: u64) {
        if let (Ok(mut registry), Ok(mut cache)) = (
            self.worker.registry.try_borrow_mut(),
            self.worker.cache.try_borrow_mut(),
        ) {
            retry::finish(&mut registry, &mut cache, &done, expires_in_ms, now);
        }
        let token = done.claim().token;
        match done {
            Done::Stored {
                claim,
                attempts,
                background,
            } => {
                self.count(Metric::Completed);
                // A background complete stored at its first attempt is the normal case.
                let retries = attempts.saturating_sub(u32::from(background));
                if retries > 0 {
                    let endpoint = claim.endpoint;
                    abi::log(
                        Level::Info,
                        &format!("idempotency: complete for {endpoint} stored after {retries} retries (token {token})"),
                    );
                }
            }
            Done::FencedOut { claim } => {
                let endpoint = claim.endpoint;
                self.count(Metric::FencedOut);
                abi::log(
                    Level::Warn,
                    &format!("idempotency: complete for {endpoint} refused, a newer claim owns the key (token {token})"),
                );
            }
            Done::GaveUp {
                claim,
                attempts,
                why,
            } => {
                let endpoint = claim.endpoint;
                self.count(Metric::StateApiErrors);
                self.count(Metric::CompleteGaveUp);
                abi::log(
                    Level::Error,
                    &format!("idempotency: complete for {endpoint} given up after {attempts} retries ({why}; token {token}); the key stays in progress until its lease runs out"),
                );
            }
        }
    }

    /// Sends the completes that are due (within [`retry::MAX_IN_FLIGHT`]) and settles the ones
    /// given up.
    fn send_completes(&mut self, cfg: &Config, now: u64) {
        let due = match self.worker.retries.try_borrow_mut() {
            Ok(mut retries) if !retries.is_empty() => retries.due(now),
            _ => retry::Due::default(),
        };
        for done in due.gave_up {
            self.finish(done, None, now);
        }
        for _ in due.first_attempts..due.send.len() {
            self.count(Metric::CompleteRetries);
        }
        for (token, payload) in due.send {
            match dispatch(cfg, COMPLETE_PATH, &payload) {
                Ok(id) => {
                    self.calls.push((id, Call::Complete(token)));
                }
                Err(why) => self.retry_answered(token, Callout::Failed(why), now),
            }
        }
    }

    /// A shared queue of this worker only: its name carries the host's clock in nanoseconds
    /// at configuration, so the workers (one VM each) do not open each other's queue.
    fn register_wake_queue(&self) {
        let nanos = abi::now_ns().unwrap_or(0);
        let name = format!("idempotency.complete.{}.{nanos}", self.context_id);
        match abi::register_queue(&name) {
            Ok(id) => self.worker.wake_queue.set(Some(id)),
            Err(e) => abi::log(
                Level::Warn,
                &format!(
                    "idempotency: no shared queue ({e}); background completes go at each tick"
                ),
            ),
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let call = self
            .calls
            .iter()
            .position(|(id, _)| *id == token_id)
            .map(|i| self.calls.swap_remove(i).1);
        let Some(call) = call else {
            abi::log(
                Level::Warn,
                &format!("idempotency: unexpected callout answer {token_id} on the root context"),
            );
            return;
        };
        let answer = callout_result(num_headers, body_size);
        match call {
            Call::Heartbeat(token) => self.heartbeat_answered(token, answer),
            Call::Complete(token) => {
                let now = abi::now_ms().unwrap_or(0);
                self.retry_answered(token, answer, now);
                // In background mode a freed slot is used at once, not at the next tick.
                if let Some(cfg) = self.cfg.clone().filter(|c| c.complete_in_background) {
                    self.send_completes(&cfg, now);
                }
            }
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = match abi::get_buffer(abi::BUFFER_PLUGIN_CONFIGURATION, 0, usize::MAX) {
            Ok(Some(b)) => b,
            Ok(None) => Vec::new(),
            Err(e) => {
                abi::log(
                    Level::Critical,
                    &format!("idempotency filter: cannot read the plugin configuration: {e}"),
                );
                return false;
            }
        };
        let cfg = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                abi::log(Level::Critical, &e.to_string());
                return false;
            }
        };
        let tick = u32::try_from(cfg.tick_period().as_millis()).unwrap_or(u32::MAX);
        if let Err(e) = abi::set_tick_period_ms(tick) {
            abi::log(
                Level::Critical,
                &format!("idempotency filter: cannot set the tick period: {e}"),
            );
            return false;
        }
        self.worker = Rc::new(Worker::new(
            Counters::define(),
            cfg.replay_cache_bytes,
            cfg.replay_cache_ttl_ms,
            cfg.complete_retry_bytes,
            cfg.complete_retry_ms,
        ));
        abi::log(
            Level::Info,
            &format!(
                "idempotency filter configured (root context {}): {} route(s), state API cluster {:?}, lease {} ms, heartbeat {} ms, replay cache {} bytes, in-flight answers {} ms, {}",
                self.context_id,
                cfg.routes.len(),
                cfg.state_api.cluster,
                cfg.lease_ms,
                cfg.heartbeat_ms,
                cfg.replay_cache_bytes,
                cfg.in_flight_cache_ms,
                if cfg.complete_in_background {
                    "responses go on before their outcome is stored"
                } else {
                    "responses held until their outcome is stored"
                },
            ),
        );
        if cfg.complete_in_background {
            self.register_wake_queue();
        }
        self.cfg = Some(Rc::new(cfg));
        true
    }

    fn on_tick(&mut self) {
        let Some(cfg) = self.cfg.clone() else {
            return;
        };
        let now = match abi::now_ms() {
            Ok(t) => t,
            Err(e) => {
                abi::log(
                    Level::Warn,
                    &format!("idempotency: no clock for heartbeats: {e}"),
                );
                return;
            }
        };
        if let Ok(mut cache) = self.worker.cache.try_borrow_mut() {
            cache.purge_expired(now);
        }
        let heartbeats = match self.worker.registry.try_borrow_mut() {
            Ok(mut registry) if !registry.is_empty() => {
                let tick = u64::try_from(cfg.tick_period().as_millis()).unwrap_or(u64::MAX);
                registry.due(now, cfg.heartbeat_ms, tick, cfg.lease_ms)
            }
            _ => Vec::new(),
        };
        for req in heartbeats {
            let token = req.token;
            let body = serde_json::to_vec(&req).unwrap_or_default();
            match dispatch(&cfg, HEARTBEAT_PATH, &body) {
                Ok(id) => {
                    self.calls.push((id, Call::Heartbeat(token)));
                }
                Err(why) => {
                    if let Ok(mut registry) = self.worker.registry.try_borrow_mut() {
                        registry.answered(token);
                    }
                    self.count(Metric::StateApiErrors);
                    abi::log(
                        Level::Warn,
                        &format!("idempotency: heartbeat not sent: {why}"),
                    );
                }
            }
        }
        self.send_completes(&cfg, now);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        // Drain it: the completes are found in the worker's list, not in the items.
        self.worker.wake_pending.set(false);
        while let Ok(Some(_)) = abi::dequeue(queue_id) {}
        if let (Some(cfg), Ok(now)) = (self.cfg.clone(), abi::now_ms()) {
            self.send_completes(&cfg, now);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http::new(
            self.cfg.clone(),
            Rc::clone(&self.worker),
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
