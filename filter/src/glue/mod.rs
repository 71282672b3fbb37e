//! The proxy-wasm glue: the entry point, the root context and the HTTP contexts. Each host
//! callback reads what the worker needs, calls [`Worker`] once, and carries out the effects it
//! returns ([`perform`]); a callout that cannot be dispatched is the callout's answer at once.

mod abi;
mod http;
mod root;

use abi::Level;
use filter_core::flow::Verdict;
use filter_core::metrics::Metric;
use filter_core::worker::{CallId, CalloutResult, Effect, Owner, StreamId, Worker};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

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

/// Which callback the effects are carried out in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Current {
    /// A request callback of this stream: resuming its request means returning Continue.
    Request(StreamId),
    /// A response callback of this stream: resuming its response means returning Continue.
    Response(StreamId),
    /// Another callback of this stream (a callout's answer, the end of the stream).
    Stream(StreamId),
    /// A callback of the root context.
    Root,
}

impl Current {
    fn stream(self) -> Option<StreamId> {
        match self {
            Current::Request(s) | Current::Response(s) | Current::Stream(s) => Some(s),
            Current::Root => None,
        }
    }
}

/// Carries out the effects in order and returns the verdict of the current callback. Callouts
/// dispatched here are recorded in `pending` (Envoy answers them to the current context).
pub(crate) fn perform(
    shared: &Shared,
    current: Current,
    verdict: Verdict,
    effects: Vec<Effect>,
    pending: &mut Vec<(u32, CallId)>,
) -> Verdict {
    let mut verdict = verdict;
    let mut queue: VecDeque<Effect> = effects.into();
    while let Some(effect) = queue.pop_front() {
        match effect {
            Effect::Reply { stream, reply } => {
                on_stream(
                    shared,
                    current,
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
                if current.stream() == Some(stream) {
                    verdict = Verdict::Pause;
                }
            }
            Effect::SetRequestHeader {
                stream,
                name,
                value,
            } => on_stream(
                shared,
                current,
                stream,
                || abi::replace_header(abi::MAP_REQUEST_HEADERS, name, &value),
                "setting a request header",
            ),
            Effect::RemoveRequestHeader { stream, name } => on_stream(
                shared,
                current,
                stream,
                || abi::remove_header(abi::MAP_REQUEST_HEADERS, name),
                "removing a request header",
            ),
            Effect::ResumeRequest { stream } => {
                if current == Current::Request(stream) {
                    verdict = Verdict::Continue;
                } else {
                    on_stream(
                        shared,
                        current,
                        stream,
                        abi::resume_request,
                        "resuming the request",
                    );
                }
            }
            Effect::ResumeResponse { stream } => {
                if current == Current::Response(stream) {
                    verdict = Verdict::Continue;
                } else {
                    on_stream(
                        shared,
                        current,
                        stream,
                        abi::resume_response,
                        "resuming the response",
                    );
                }
            }
            Effect::Dispatch(d) => {
                let id = d.id;
                // Envoy answers a callout to the context that made it: a stream's callouts are
                // made in its callbacks, the worker's in the root context's.
                let made_here = match d.owner {
                    Owner::Stream(s) => current.stream() == Some(s),
                    Owner::Worker => current == Current::Root,
                };
                let result = if made_here {
                    let headers: Vec<(&str, &str)> = d
                        .headers
                        .iter()
                        .map(|(n, v)| (n.as_str(), v.as_str()))
                        .collect();
                    proxy_wasm::hostcalls::dispatch_http_call(
                        &d.cluster,
                        headers,
                        Some(&d.body),
                        vec![],
                        std::time::Duration::from_millis(d.timeout_ms),
                    )
                    .map_err(|s| format!("dispatch to cluster {:?} failed: {s:?}", d.cluster))
                } else {
                    Err("a callout made from a context Envoy would not answer it to (a bug)".into())
                };
                match result {
                    Ok(token) => pending.push((token, id)),
                    Err(why) => {
                        let now = clock_ms();
                        if let Some(step) = shared.with_worker(|w| {
                            w.on_callout_answer(id, CalloutResult::Failed(why), now)
                        }) {
                            verdict = step.verdict;
                            for e in step.effects.into_iter().rev() {
                                queue.push_front(e);
                            }
                        }
                    }
                }
            }
            Effect::Wake => wake(shared),
            Effect::Count(m) => shared.count(m),
            Effect::Log(level, msg) => {
                let level = match level {
                    filter_core::worker::Level::Debug => Level::Debug,
                    filter_core::worker::Level::Info => Level::Info,
                    filter_core::worker::Level::Warn => Level::Warn,
                    filter_core::worker::Level::Error => Level::Error,
                };
                abi::log(level, &format!("idempotency: {msg}"));
            }
        }
    }
    verdict
}

/// A host call on `stream`: made with that stream as the effective context when another
/// context is current.
fn on_stream(
    shared: &Shared,
    current: Current,
    stream: StreamId,
    call: impl FnOnce() -> Result<(), abi::HostError>,
    what: &str,
) {
    let elsewhere = current.stream() != Some(stream);
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
        let back = current.stream().unwrap_or(shared.root_id);
        if let Err(e) = abi::set_effective_context(back) {
            abi::log(
                Level::Error,
                &format!("idempotency: restoring the context: {e}"),
            );
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
