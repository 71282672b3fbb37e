//! The root context: one per worker. It parses the configuration, defines the counters, and
//! on each tick extends the leases of the worker's in-flight claims.

use super::abi::{self, Level};
use super::http::Http;
use super::{callout_result, dispatch, Counters};
use crate::config::Config;
use crate::flow::Callout;
use crate::heartbeat::Registry;
use crate::metrics::Metric;
use contract::wire::{HeartbeatResponse, HEARTBEAT_PATH};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

pub(crate) struct Root {
    context_id: u32,
    cfg: Option<Rc<Config>>,
    counters: Rc<Counters>,
    registry: Rc<RefCell<Registry>>,
    /// Heartbeat callout token → HTTP context id.
    heartbeats: BTreeMap<u32, u32>,
}

impl Root {
    pub(crate) fn new(context_id: u32) -> Self {
        Self {
            context_id,
            cfg: None,
            counters: Rc::new(Counters::default()),
            registry: Rc::new(RefCell::new(Registry::default())),
            heartbeats: BTreeMap::new(),
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
        let Some(http_id) = self.heartbeats.remove(&token_id) else {
            abi::log(
                Level::Warn,
                &format!("idempotency: unexpected callout answer {token_id} on the root context"),
            );
            return;
        };
        let Ok(mut registry) = self.registry.try_borrow_mut() else {
            return;
        };
        registry.answered(http_id);
        match callout_result(num_headers, body_size) {
            Callout::Answer { status, body } if (200..300).contains(&status) => {
                if serde_json::from_slice::<HeartbeatResponse>(&body).is_ok() {
                    self.counters.count(Metric::Heartbeats);
                } else {
                    self.counters.count(Metric::StateApiErrors);
                    abi::log(Level::Warn, "idempotency: unreadable heartbeat answer");
                }
            }
            Callout::Answer { status: 409, .. } => {
                // A newer claim owns the key: stop extending this one.
                registry.remove(http_id);
                self.counters.count(Metric::FencedOut);
                abi::log(
                    Level::Warn,
                    "idempotency: heartbeat fenced out; a newer claim owns the key",
                );
            }
            Callout::Answer { status, .. } => {
                self.counters.count(Metric::StateApiErrors);
                abi::log(
                    Level::Warn,
                    &format!("idempotency: heartbeat answered HTTP {status}"),
                );
            }
            Callout::Failed(why) => {
                self.counters.count(Metric::StateApiErrors);
                abi::log(
                    Level::Warn,
                    &format!("idempotency: heartbeat failed: {why}"),
                );
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
        self.counters = Rc::new(Counters::define());
        abi::log(
            Level::Info,
            &format!(
                "idempotency filter configured (root context {}): {} route(s), state API cluster {:?}, lease {} ms, heartbeat {} ms",
                self.context_id,
                cfg.routes.len(),
                cfg.state_api.cluster,
                cfg.lease_ms,
                cfg.heartbeat_ms
            ),
        );
        self.cfg = Some(Rc::new(cfg));
        true
    }

    fn on_tick(&mut self) {
        let Some(cfg) = self.cfg.clone() else {
            return;
        };
        let due = {
            let Ok(mut registry) = self.registry.try_borrow_mut() else {
                return;
            };
            if registry.is_empty() {
                return;
            }
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
            let tick = u64::try_from(cfg.tick_period().as_millis()).unwrap_or(u64::MAX);
            registry.due(now, cfg.heartbeat_ms, tick, cfg.lease_ms)
        };
        for (http_id, req) in due {
            let body = serde_json::to_vec(&req).unwrap_or_default();
            match dispatch(&cfg, HEARTBEAT_PATH, &body) {
                Ok(token) => {
                    self.heartbeats.insert(token, http_id);
                }
                Err(why) => {
                    if let Ok(mut registry) = self.registry.try_borrow_mut() {
                        registry.answered(http_id);
                    }
                    self.counters.count(Metric::StateApiErrors);
                    abi::log(
                        Level::Warn,
                        &format!("idempotency: heartbeat not sent: {why}"),
                    );
                }
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http::new(
            context_id,
            self.cfg.clone(),
            Rc::clone(&self.counters),
            Rc::clone(&self.registry),
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
