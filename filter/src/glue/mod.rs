//! The proxy-wasm glue: entry point, root context (configuration, counters, heartbeats) and
//! HTTP context (performs what [`crate::flow::Flow`] asks for). Compiled for wasm32-wasip1 only.

mod abi;
mod http;
mod root;

use abi::Level;

proxy_wasm::main! {{
    std::panic::set_hook(Box::new(|info| {
        abi::log(Level::Critical, &format!("idempotency filter panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::new(context_id))
    });
}}

/// What the root context and the HTTP contexts of one worker VM share. The VM is single
/// threaded: plain `Rc`/`RefCell`, borrowed only for the length of one call.
pub(crate) struct Worker {
    pub(crate) counters: Counters,
    /// Claims whose lease the root context extends.
    pub(crate) registry: std::cell::RefCell<crate::heartbeat::Registry>,
    /// Completes the root context retries.
    pub(crate) retries: std::cell::RefCell<crate::retry::Retries>,
    /// Completed records answered without a callout.
    pub(crate) cache: std::rc::Rc<std::cell::RefCell<crate::cache::ReplayCache>>,
    /// The host's clock, for the flows.
    pub(crate) clock: crate::flow::Clock,
    /// This worker's shared queue (`complete_in_background`): an item wakes the root context,
    /// which sends the completes handed over to it at once.
    pub(crate) wake_queue: std::cell::Cell<Option<u32>>,
    /// A wake is on its way: the completes handed over meanwhile go with it (one host
    /// callback for a burst, not one per request).
    pub(crate) wake_pending: std::cell::Cell<bool>,
}

impl Worker {
    /// Before the configuration: nothing counted, kept, nor retried.
    pub(crate) fn unconfigured() -> Self {
        Self::new(Counters::default(), 0, 0, 0, 0)
    }

    pub(crate) fn new(
        counters: Counters,
        cache_bytes: u64,
        cache_ttl_ms: u64,
        retry_bytes: u64,
        retry_ms: u64,
    ) -> Self {
        Self {
            counters,
            registry: Default::default(),
            retries: std::cell::RefCell::new(crate::retry::Retries::new(retry_bytes, retry_ms)),
            cache: std::rc::Rc::new(std::cell::RefCell::new(crate::cache::ReplayCache::new(
                cache_bytes,
                cache_ttl_ms,
            ))),
            clock: std::rc::Rc::new(|| abi::now_ms().unwrap_or(0)),
            wake_queue: std::cell::Cell::new(None),
            wake_pending: std::cell::Cell::new(false),
        }
    }

    /// Wakes the root context (`on_queue_ready`, later on this thread). Without a queue, or if
    /// it fails, the handed-over complete goes at the next tick instead.
    pub(crate) fn wake(&self) {
        if self.wake_pending.get() {
            return;
        }
        if let Some(queue) = self.wake_queue.get() {
            self.wake_pending.set(true);
            if let Err(e) = abi::enqueue(queue, b"complete") {
                self.wake_pending.set(false);
                abi::log(
                    Level::Warn,
                    &format!("idempotency: cannot wake the worker ({e}); the complete goes at the next tick"),
                );
            }
        }
    }
}

/// Counter ids of one worker VM, by [`crate::metrics::Metric::index`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    ids: Vec<Option<u32>>,
}

impl Counters {
    pub(crate) fn define() -> Self {
        let ids = crate::metrics::Metric::ALL
            .iter()
            .map(|m| match abi::define_counter(m.name()) {
                Ok(id) => Some(id),
                Err(e) => {
                    abi::log(
                        Level::Error,
                        &format!("idempotency: cannot define counter {}: {e}", m.name()),
                    );
                    None
                }
            })
            .collect();
        Self { ids }
    }

    pub(crate) fn count(&self, m: crate::metrics::Metric) {
        if let Some(Some(id)) = self.ids.get(m.index()) {
            if let Err(e) = abi::increment(*id) {
                abi::log(
                    Level::Warn,
                    &format!("idempotency: cannot increment {}: {e}", m.name()),
                );
            }
        }
    }
}

/// POST a JSON body to the state API; the token of the callout.
pub(crate) fn dispatch(
    cfg: &crate::config::Config,
    path: &str,
    body: &[u8],
) -> Result<u32, String> {
    let auth = format!("Bearer {}", cfg.state_api.token);
    let headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", cfg.state_api.authority.as_str()),
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
        ("accept", "application/json"),
    ];
    proxy_wasm::hostcalls::dispatch_http_call(
        &cfg.state_api.cluster,
        headers,
        Some(body),
        vec![],
        cfg.timeout(),
    )
    .map_err(|s| {
        format!(
            "dispatch to cluster {:?} failed: {s:?}",
            cfg.state_api.cluster
        )
    })
}

/// The state API's answer to the callout being delivered (`on_http_call_response`).
pub(crate) fn callout_result(num_headers: usize, body_size: usize) -> crate::flow::Callout {
    use crate::flow::Callout;
    let headers = match abi::get_headers(abi::MAP_HTTP_CALL_RESPONSE_HEADERS) {
        Ok(h) => h,
        Err(e) => return Callout::Failed(format!("cannot read the answer's headers: {e}")),
    };
    let status = headers
        .iter()
        .find(|(n, _)| n == ":status")
        .and_then(|(_, v)| v.parse::<u16>().ok());
    let Some(status) = status else {
        // Envoy reports a reset or an oversized answer as a callback without headers (C-4).
        return Callout::Failed(format!(
            "no response (reset or failure; {num_headers} headers)"
        ));
    };
    let body = if body_size == 0 {
        Vec::new()
    } else {
        match abi::get_buffer(abi::BUFFER_HTTP_CALL_RESPONSE_BODY, 0, body_size) {
            Ok(Some(b)) => b,
            Ok(None) => Vec::new(),
            Err(e) => return Callout::Failed(format!("cannot read the answer's body: {e}")),
        }
    };
    Callout::Answer { status, body }
}
