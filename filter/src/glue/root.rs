//! The root context: one per worker. It reads the configuration, and hands the worker its
//! ticks, its wakes and the answers to the worker's own callouts.

use super::abi::{self, Level};
use super::http::Http;
use super::{callout_result, perform, take_pending, Counters, Current, Shared};
use filter_core::config::{Config, SubjectSource};
use filter_core::flow::Verdict;
use filter_core::worker::{CallId, Worker};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::rc::Rc;

pub(crate) struct Root {
    shared: Rc<Shared>,
    /// The worker's callouts on their way (Envoy token, the worker's id).
    pending: Vec<(u32, CallId)>,
}

impl Root {
    pub(crate) fn new(context_id: u32) -> Self {
        Self {
            shared: Rc::new(Shared::new(context_id)),
            pending: Vec::new(),
        }
    }

    fn perform(&mut self, effects: Vec<filter_core::worker::Effect>) {
        perform(
            &self.shared,
            Current::Root,
            Verdict::Continue,
            effects,
            &mut self.pending,
        );
    }

    fn now() -> Option<u64> {
        Some(super::clock_ms())
    }

    /// A shared queue of this worker only: its name carries the host's clock in nanoseconds
    /// at configuration, so the workers (one VM each) do not open each other's queue.
    fn register_wake_queue(&self) {
        let nanos = abi::now_ns().unwrap_or(0);
        let name = format!("idempotency.wake.{}.{nanos}", self.shared.root_id);
        match abi::register_queue(&name) {
            Ok(id) => self.shared.wake_queue.set(Some(id)),
            Err(e) => abi::log(
                Level::Warn,
                &format!("idempotency: no shared queue ({e}); handed-over writes go at each tick"),
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
        let Some(id) = take_pending(&mut self.pending, token_id) else {
            abi::log(
                Level::Warn,
                &format!("idempotency: unexpected callout answer {token_id} on the root context"),
            );
            return;
        };
        let result = callout_result(num_headers, body_size);
        let Some(now) = Self::now() else { return };
        if let Some(step) = self
            .shared
            .with_worker(|w| w.on_callout_answer(id, result, now))
        {
            self.perform(step.effects);
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
        let tick = u32::try_from(cfg.tick_period_ms()).unwrap_or(u32::MAX);
        if let Err(e) = abi::set_tick_period_ms(tick) {
            abi::log(
                Level::Critical,
                &format!("idempotency filter: cannot set the tick period: {e}"),
            );
            return false;
        }
        abi::log(
            Level::Info,
            &format!(
                "idempotency filter configured (root context {}): {}",
                self.shared.root_id,
                cfg.summary()
            ),
        );
        // Writes handed over untried (complete_in_background, unknown outcomes) go at once.
        self.register_wake_queue();
        if let SubjectSource::Metadata(path) = &cfg.subject {
            *self.shared.metadata_path.borrow_mut() = Some(path.clone());
        }
        *self.shared.counters.borrow_mut() = Counters::define();
        let mut worker = Worker::new(cfg);
        // Claim nonces are unique across this worker's VMs and restarts: its clock at
        // configuration (ns) and its root context.
        worker.set_instance(&format!(
            "{:x}-{}",
            abi::now_ns().unwrap_or(0),
            self.shared.root_id
        ));
        *self.shared.worker.borrow_mut() = Some(worker);
        true
    }

    fn on_tick(&mut self) {
        let Some(now) = Self::now() else { return };
        if let Some(effects) = self.shared.with_worker(|w| w.on_tick(now)) {
            self.perform(effects);
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        // Drain it: the writes are in the worker, not in the items.
        while let Ok(Some(_)) = abi::dequeue(queue_id) {}
        let Some(now) = Self::now() else { return };
        if let Some(effects) = self.shared.with_worker(|w| w.on_wake(now)) {
            self.perform(effects);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http::new(context_id, Rc::clone(&self.shared))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
