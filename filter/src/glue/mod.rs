//! The proxy-wasm glue: the entry point, the root context and the HTTP contexts. Each host
//! callback reads what the worker needs, calls [`Worker`] once, and has the effects it returns
//! carried out by [`filter_core::host::perform`] (the rules the simulation checks too) through
//! the ABI calls of [`Glue`].

mod abi;
mod http;
mod root;

use abi::Level;
use filter_core::flow::Verdict;
pub(crate) use filter_core::host::Current;
use filter_core::host::Host;
use filter_core::metrics::Metric;
use filter_core::reply::LocalReply;
use filter_core::worker::{CallId, CalloutResult, Dispatch, Effect, StreamId, Worker};
use std::cell::{Cell, RefCell};

proxy_wasm::main! {{
    std::panic::set_hook(Box::new(|info| {
        abi::log(Level::Critical, &format!("idempotency filter panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::new(context_id))
    });
}}

/// What the root context and the HTTP contexts of one worker VM share. The VM is single
/// threaded: the worker is borrowed for one call into it at a time, and never while effects are
/// carried out, so a host call that called back into the module would find it free.
pub(crate) struct Shared {
    root_id: u32,
    /// `None` until the configuration is read.
    worker: RefCell<Option<Worker>>,
    counters: RefCell<Counters>,
    /// With `subject.metadata`: the property path of the subject.
    metadata_path: RefCell<Option<Vec<String>>>,
    /// This worker's shared queue: an item wakes the root context (`on_queue_ready`).
    wake_queue: Cell<Option<u32>>,
}

impl Shared {
    fn new(root_id: u32) -> Self {
        Self {
            root_id,
            worker: RefCell::new(None),
            counters: RefCell::new(Counters::default()),
            metadata_path: RefCell::new(None),
            wake_queue: Cell::new(None),
        }
    }

    /// Calls into the worker; `None` before the configuration. The worker is never re-entered
    /// (effects are carried out after the call), so the borrow cannot fail; if it did, that is
    /// a bug, logged as one.
    fn with_worker<T>(&self, f: impl FnOnce(&mut Worker) -> T) -> Option<T> {
        match self.worker.try_borrow_mut() {
            Ok(mut w) => w.as_mut().map(f),
            Err(_) => {
                abi::log(
                    Level::Critical,
                    "idempotency filter: the worker was re-entered from a host call (a bug); this event is dropped",
                );
                None
            }
        }
    }

    fn count(&self, m: Metric) {
        if let Ok(c) = self.counters.try_borrow() {
            c.count(m);
        }
    }
}

/// The worker's time, in ms: the host's monotonic clock, so that a wall clock stepped back
/// pauses no heartbeat and one stepped forward gives up no pending write early (issue 34,
/// path 6). Without one (a host that lacks it), the wall clock, never going back.
pub(crate) fn clock_ms() -> u64 {
    thread_local! {
        static LAST: Cell<u64> = const { Cell::new(0) };
        /// The source chosen at the first reading: the two clocks count from different
        /// origins, so one VM never mixes them.
        static WALL: Cell<Option<bool>> = const { Cell::new(None) };
    }
    let wall = WALL.with(|w| match w.get() {
        Some(wall) => wall,
        None => {
            let wall = abi::monotonic_ns().is_err();
            if wall {
                abi::log(
                    Level::Warn,
                    "idempotency: the host has no monotonic clock; the worker follows the wall clock",
                );
            }
            w.set(Some(wall));
            wall
        }
    });
    let reading = if wall {
        abi::now_ms().ok()
    } else {
        abi::monotonic_ns().ok().map(|ns| ns / 1_000_000)
    };
    LAST.with(|last| {
        let now = reading.unwrap_or(0).max(last.get());
        last.set(now);
        now
    })
}

/// The host actions of one callback of this worker VM: the ABI calls behind
/// [`filter_core::host::perform`], which decides what to call. Callouts it makes are recorded
/// in `pending` (Envoy answers them to the current context).
pub(crate) struct Glue<'a> {
    pub(crate) shared: &'a Shared,
    pub(crate) current: Current,
    pub(crate) pending: &'a mut Vec<(u32, CallId)>,
}

/// Carries out the effects of one callback and returns its verdict.
pub(crate) fn perform(
    shared: &Shared,
    current: Current,
    verdict: Verdict,
    effects: Vec<Effect>,
    pending: &mut Vec<(u32, CallId)>,
) -> Verdict {
    let mut glue = Glue {
        shared,
        current,
        pending,
    };
    filter_core::host::perform(&mut glue, verdict, effects)
}

impl Host for Glue<'_> {
    fn current(&self) -> Current {
        self.current
    }

    fn with_worker<T>(&mut self, f: impl FnOnce(&mut Worker, u64) -> T) -> Option<T> {
        let now = clock_ms();
        self.shared.with_worker(|w| f(w, now))
    }

    fn reply(&mut self, stream: StreamId, reply: LocalReply) {
        self.on_stream(
            stream,
            || {
                abi::send_response(
                    u32::from(reply.status),
                    reply.reason,
                    &reply.headers,
                    &reply.body,
                )
            },
            "sending a local reply",
        );
    }

    fn set_request_header(&mut self, stream: StreamId, name: &'static str, value: String) {
        self.on_stream(
            stream,
            || abi::replace_header(abi::MAP_REQUEST_HEADERS, name, &value),
            "setting a request header",
        );
    }

    fn set_response_header(&mut self, stream: StreamId, name: &'static str, value: String) {
        self.on_stream(
            stream,
            || abi::replace_header(abi::MAP_RESPONSE_HEADERS, name, &value),
            "setting a response header",
        );
    }

    fn remove_request_header(&mut self, stream: StreamId, name: &'static str) {
        self.on_stream(
            stream,
            || abi::remove_header(abi::MAP_REQUEST_HEADERS, name),
            "removing a request header",
        );
    }

    fn resume_request(&mut self, stream: StreamId) {
        self.on_stream(stream, abi::resume_request, "resuming the request");
    }

    fn resume_response(&mut self, stream: StreamId) {
        self.on_stream(stream, abi::resume_response, "resuming the response");
    }

    fn dispatch(&mut self, d: Dispatch) -> Result<(), String> {
        let headers: Vec<(&str, &str)> = d
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let token = proxy_wasm::hostcalls::dispatch_http_call(
            &d.cluster,
            headers,
            Some(&d.body),
            vec![],
            std::time::Duration::from_millis(d.timeout_ms),
        )
        .map_err(|s| format!("dispatch to cluster {:?} failed: {s:?}", d.cluster))?;
        self.pending.push((token, d.id));
        Ok(())
    }

    fn misplaced_callout(&mut self, _d: &Dispatch) {
        // The worker hears of it as a failed callout (`perform` answers it).
        abi::log(
            Level::Critical,
            "idempotency filter: a callout made from a context Envoy would not answer it to (a bug)",
        );
    }

    fn wake(&mut self) {
        wake(self.shared);
    }

    fn count(&mut self, m: Metric) {
        self.shared.count(m);
    }

    fn log(&mut self, level: filter_core::worker::Level, msg: String) {
        let level = match level {
            filter_core::worker::Level::Debug => Level::Debug,
            filter_core::worker::Level::Info => Level::Info,
            filter_core::worker::Level::Warn => Level::Warn,
            filter_core::worker::Level::Error => Level::Error,
        };
        abi::log(level, &format!("idempotency: {msg}"));
    }
}

impl Glue<'_> {
    /// A host call on `stream`: made with that stream as the effective context when another
    /// context is current.
    fn on_stream(
        &self,
        stream: StreamId,
        call: impl FnOnce() -> Result<(), abi::HostError>,
        what: &str,
    ) {
        let elsewhere = self.current.stream() != Some(stream);
        if elsewhere {
            if let Err(e) = abi::set_effective_context(stream) {
                abi::log(
                    Level::Error,
                    &format!("idempotency: {what} on stream {stream}: {e}"),
                );
                return;
            }
        }
        if let Err(e) = call() {
            abi::log(Level::Error, &format!("idempotency: {what} failed: {e}"));
        }
        if elsewhere {
            let back = self.current.stream().unwrap_or(self.shared.root_id);
            if let Err(e) = abi::set_effective_context(back) {
                abi::log(
                    Level::Error,
                    &format!("idempotency: restoring the context: {e}"),
                );
            }
        }
    }
}

/// Wakes the root context (`on_queue_ready`, later on this thread). Without a queue, or if it
/// fails, the writes go at the next tick instead.
fn wake(shared: &Shared) {
    if let Some(queue) = shared.wake_queue.get() {
        if let Err(e) = abi::enqueue(queue, b"wake") {
            abi::log(
                Level::Warn,
                &format!(
                    "idempotency: cannot wake the worker ({e}); its writes go at the next tick"
                ),
            );
        }
    }
}

/// Counter ids of one worker VM, by [`Metric::index`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    ids: Vec<Option<u32>>,
}

impl Counters {
    pub(crate) fn define() -> Self {
        let ids = Metric::ALL
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

    pub(crate) fn count(&self, m: Metric) {
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

/// The answer to a callout being delivered (`on_http_call_response`).
pub(crate) fn callout_result(num_headers: usize, body_size: usize) -> CalloutResult {
    let headers = match abi::get_headers(abi::MAP_HTTP_CALL_RESPONSE_HEADERS) {
        Ok(h) => h,
        Err(e) => return CalloutResult::Failed(format!("cannot read the answer's headers: {e}")),
    };
    let status = headers
        .iter()
        .find(|(n, _)| n == ":status")
        .and_then(|(_, v)| v.parse::<u16>().ok());
    let Some(status) = status else {
        // Envoy reports a reset or an oversized answer as a callback without headers.
        return CalloutResult::Failed(format!(
            "no response (reset or failure; {num_headers} headers)"
        ));
    };
    let body = if body_size == 0 {
        Vec::new()
    } else {
        match abi::get_buffer(abi::BUFFER_HTTP_CALL_RESPONSE_BODY, 0, body_size) {
            Ok(Some(b)) => b,
            Ok(None) => Vec::new(),
            Err(e) => return CalloutResult::Failed(format!("cannot read the answer's body: {e}")),
        }
    };
    let headers = headers
        .into_iter()
        .filter(|(n, _)| !n.starts_with(':'))
        .collect();
    CalloutResult::Response {
        status,
        headers,
        body,
    }
}

/// The callout a context made with this token, taken out of its list.
pub(crate) fn take_pending(pending: &mut Vec<(u32, CallId)>, token: u32) -> Option<CallId> {
    let i = pending.iter().position(|(t, _)| *t == token)?;
    Some(pending.swap_remove(i).1)
}
