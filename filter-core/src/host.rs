//! Carrying out a worker's [`Effect`]s: the one set of rules that turns them into host actions,
//! shared by the proxy-wasm glue (`filter/src/glue`, whose [`Host`] makes the ABI calls) and the
//! deterministic simulation (`sim/`, whose [`Host`] is its model of Envoy). The simulation thus
//! checks the rules the module runs, not a copy of them.
//!
//! The rules: effects are carried out in order; a reply to the stream whose callback is running
//! pauses it; resuming the request (response) of the stream whose request (response) callback is
//! running means returning `Continue`, any other stream is resumed by a host call; a callout is
//! made only from the context Envoy will deliver its answer to (a stream's from that stream's
//! callbacks, the worker's from the root context's), and one that cannot be made is answered at
//! once as failed, the worker's answer to that going first, before the effects still queued;
//! at most [`REPLIES_PER_CALLBACK`] local replies go out in one callback, the rest at the next
//! wake (or tick, if the wake is lost).

use crate::flow::Verdict;
use crate::metrics::Metric;
use crate::reply::LocalReply;
use crate::worker::{
    CallId, CalloutResult, Dispatch, Effect, Level, Owner, Step, StreamId, Worker,
};
use std::collections::VecDeque;

/// Which callback the effects are carried out in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Current {
    /// A request callback of this stream: resuming its request means returning `Continue`.
    Request(StreamId),
    /// A response callback of this stream: resuming its response means returning `Continue`.
    Response(StreamId),
    /// Another callback of this stream (a callout's answer, the end of the stream).
    Stream(StreamId),
    /// A callback of the root context (a tick, a wake, the answer to a worker's callout).
    Root,
}

impl Current {
    /// The stream whose callback runs, if any.
    pub fn stream(self) -> Option<StreamId> {
        match self {
            Current::Request(s) | Current::Response(s) | Current::Stream(s) => Some(s),
            Current::Root => None,
        }
    }

    /// Whether Envoy delivers the answer of a callout of `owner` made now to the context that
    /// made it (so the worker hears of it).
    pub fn may_dispatch_for(self, owner: Owner) -> bool {
        match owner {
            Owner::Stream(s) => self.stream() == Some(s),
            Owner::Worker => self == Current::Root,
        }
    }
}

/// What a host does for the filter: one method per action. Every method acts on the stream it
/// names, from within the callback [`Host::current`] (a host call on another stream needs that
/// stream made the effective context first, and the current one made so again after).
pub trait Host {
    /// The callback the effects are carried out in.
    fn current(&self) -> Current;
    /// Calls into the worker with the host's clock (ms since the epoch); `None` when there is no
    /// worker to call (not configured yet, or gone).
    fn with_worker<T>(&mut self, f: impl FnOnce(&mut Worker, u64) -> T) -> Option<T>;
    /// `send_http_response`: answers the stream itself.
    fn reply(&mut self, stream: StreamId, reply: LocalReply);
    /// Replaces a request header (all its values).
    fn set_request_header(&mut self, stream: StreamId, name: &'static str, value: String);
    fn set_response_header(&mut self, stream: StreamId, name: &'static str, value: String);
    fn remove_request_header(&mut self, stream: StreamId, name: &'static str);
    /// Resumes a stream's request from outside its request callbacks.
    fn resume_request(&mut self, stream: StreamId);
    /// Resumes a stream's response from outside its response callbacks.
    fn resume_response(&mut self, stream: StreamId);
    /// `dispatch_http_call` from the current context. `Err`: it could not be made (why).
    fn dispatch(&mut self, dispatch: Dispatch) -> Result<(), String>;
    /// A callout the worker asked for from a context Envoy would not deliver its answer to (a
    /// bug in the worker): it is not made, and is answered as failed.
    fn misplaced_callout(&mut self, dispatch: &Dispatch);
    /// Wakes the root context soon ([`Worker::on_wake`]). The host may fail to (the glue's
    /// shared-queue enqueue can): the worker's next tick makes up for a lost wake.
    fn wake(&mut self);
    /// The most local replies one callback sends ([`REPLIES_PER_CALLBACK`], what Envoy
    /// needs); a model host lowers it (at least 1) to reach the deferral with few streams.
    fn replies_per_callback(&self) -> usize {
        REPLIES_PER_CALLBACK
    }
    fn count(&mut self, metric: Metric);
    fn log(&mut self, level: Level, message: String);
}

/// The most local replies one callback sends. Envoy sends each after the callback returns,
/// and runs the next one from inside the response callback into the module that the one before
/// caused: replies made in one callback nest as deep as they are many. 250 of them (a crowd of
/// waiting retries answered when their key completed) overflowed V8's stack ("Maximum call
/// stack size exceeded" in `proxy_on_response_headers`), which killed the worker's VM: the
/// streams it held were reset and every later request on the worker answered 503. Past this
/// many, the replies to other streams wait in the worker for the next wake (a callback of its
/// own) or tick, whichever comes first; the current stream's own reply always goes.
pub const REPLIES_PER_CALLBACK: usize = 16;

/// Carries out `effects` in order and returns the verdict of the current callback (`verdict`
/// unless an effect changes it).
pub fn perform<H: Host>(host: &mut H, verdict: Verdict, effects: Vec<Effect>) -> Verdict {
    let current = host.current();
    let bound = host.replies_per_callback().max(1);
    let mut verdict = verdict;
    let mut queue: VecDeque<Effect> = effects.into();
    let mut replies = 0;
    let mut deferred = Vec::new();
    while let Some(effect) = queue.pop_front() {
        match effect {
            Effect::Reply { stream, reply } => {
                let own = current.stream() == Some(stream);
                if !own && replies >= bound {
                    deferred.push((stream, reply));
                    continue;
                }
                replies += 1;
                host.reply(stream, reply);
                if own {
                    verdict = Verdict::Pause;
                }
            }
            Effect::SetRequestHeader {
                stream,
                name,
                value,
            } => host.set_request_header(stream, name, value),
            Effect::RemoveRequestHeader { stream, name } => {
                host.remove_request_header(stream, name)
            }
            Effect::SetResponseHeader {
                stream,
                name,
                value,
            } => host.set_response_header(stream, name, value),
            Effect::ResumeRequest { stream } => {
                if current == Current::Request(stream) {
                    verdict = Verdict::Continue;
                } else {
                    host.resume_request(stream);
                }
            }
            Effect::ResumeResponse { stream } => {
                if current == Current::Response(stream) {
                    verdict = Verdict::Continue;
                } else {
                    host.resume_response(stream);
                }
            }
            Effect::Dispatch(d) => {
                let id = d.id;
                let made = if current.may_dispatch_for(d.owner) {
                    host.dispatch(d)
                } else {
                    host.misplaced_callout(&d);
                    Err("a callout made from a context Envoy would not answer it to (a bug)".into())
                };
                if let Err(why) = made {
                    if let Some(step) = answer_failed(host, id, why) {
                        verdict = step.verdict;
                        for e in step.effects.into_iter().rev() {
                            queue.push_front(e);
                        }
                    }
                }
            }
            Effect::Wake => host.wake(),
            Effect::Count(m) => host.count(m),
            Effect::Log(level, msg) => host.log(level, msg),
        }
    }
    if !deferred.is_empty() {
        host.with_worker(|w, _| w.defer_replies(deferred));
        host.wake();
    }
    verdict
}

/// A callout that could not be made is the callout's answer at once.
fn answer_failed<H: Host>(host: &mut H, id: CallId, why: String) -> Option<Step> {
    host.with_worker(|w, now| w.on_callout_answer(id, CalloutResult::Failed(why), now))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A host that records what it is asked to do; with a worker, it hands it over.
    struct Recorder {
        current: Current,
        done: Vec<String>,
        dispatch_fails: bool,
        worker: Option<Worker>,
    }

    impl Host for Recorder {
        fn current(&self) -> Current {
            self.current
        }
        fn with_worker<T>(&mut self, f: impl FnOnce(&mut Worker, u64) -> T) -> Option<T> {
            self.done.push("worker told".into());
            self.worker.as_mut().map(|w| f(w, 0))
        }
        fn reply(&mut self, stream: StreamId, reply: LocalReply) {
            self.done.push(format!("reply {stream} {}", reply.status));
        }
        fn set_request_header(&mut self, stream: StreamId, name: &'static str, value: String) {
            self.done.push(format!("set {stream} {name}={value}"));
        }
        fn set_response_header(&mut self, stream: StreamId, name: &'static str, value: String) {
            self.done
                .push(format!("set response {stream} {name}={value}"));
        }
        fn remove_request_header(&mut self, stream: StreamId, name: &'static str) {
            self.done.push(format!("remove {stream} {name}"));
        }
        fn resume_request(&mut self, stream: StreamId) {
            self.done.push(format!("resume request {stream}"));
        }
        fn resume_response(&mut self, stream: StreamId) {
            self.done.push(format!("resume response {stream}"));
        }
        fn dispatch(&mut self, d: Dispatch) -> Result<(), String> {
            self.done.push(format!("dispatch {}", d.id.0));
            if self.dispatch_fails {
                Err("no".into())
            } else {
                Ok(())
            }
        }
        fn misplaced_callout(&mut self, d: &Dispatch) {
            self.done.push(format!("misplaced {}", d.id.0));
        }
        fn wake(&mut self) {
            self.done.push("wake".into());
        }
        fn count(&mut self, m: Metric) {
            self.done.push(format!("count {}", m.name()));
        }
        fn log(&mut self, _level: Level, message: String) {
            self.done.push(format!("log {message}"));
        }
    }

    fn recorder(current: Current) -> Recorder {
        Recorder {
            current,
            done: Vec::new(),
            dispatch_fails: false,
            worker: None,
        }
    }

    impl Recorder {
        /// The streams replied to, in order.
        fn replied(&self) -> Vec<StreamId> {
            self.done
                .iter()
                .filter_map(|d| d.strip_prefix("reply "))
                .filter_map(|d| d.split(' ').next()?.parse().ok())
                .collect()
        }

        fn wakes(&self) -> usize {
            self.done.iter().filter(|d| *d == "wake").count()
        }
    }

    fn dispatch(id: u64, owner: Owner) -> Effect {
        Effect::Dispatch(Dispatch {
            id: CallId(id),
            owner,
            cluster: "c".into(),
            headers: Vec::new(),
            body: Vec::new(),
            timeout_ms: 1,
        })
    }

    #[test]
    fn resuming_the_running_callback_is_its_verdict_and_other_streams_are_called() {
        let mut h = recorder(Current::Request(1));
        let v = perform(
            &mut h,
            Verdict::Pause,
            vec![
                Effect::ResumeRequest { stream: 1 },
                Effect::ResumeRequest { stream: 2 },
                Effect::ResumeResponse { stream: 1 },
            ],
        );
        assert_eq!(v, Verdict::Continue);
        assert_eq!(h.done, ["resume request 2", "resume response 1"]);
    }

    #[test]
    fn a_reply_pauses_only_its_own_stream() {
        let reply = LocalReply::problem(contract::ProblemKind::Internal, "x");
        let mut h = recorder(Current::Response(3));
        let v = perform(
            &mut h,
            Verdict::Continue,
            vec![Effect::Reply {
                stream: 4,
                reply: reply.clone(),
            }],
        );
        assert_eq!(v, Verdict::Continue);
        let v = perform(
            &mut h,
            Verdict::Continue,
            vec![Effect::Reply { stream: 3, reply }],
        );
        assert_eq!(v, Verdict::Pause);
    }

    #[test]
    fn a_callback_sends_a_bounded_number_of_replies_and_the_rest_go_at_the_next_wakes() {
        let cfg = crate::config::Config::parse(
            br#"{"state_api": {"cluster": "s", "authority": "s", "token": "t", "timeout_ms": 1000},
                 "subject": {"header": "x-jwt-sub"},
                 "routes": [{"method": "POST", "path": "/checkout", "key": "required"}]}"#,
        )
        .unwrap();
        let mut h = Recorder {
            worker: Some(Worker::new(cfg)),
            ..recorder(Current::Stream(30))
        };
        let reply = LocalReply::problem(contract::ProblemKind::Internal, "x");
        let effects: Vec<Effect> = (1..=40)
            .map(|stream| Effect::Reply {
                stream,
                reply: reply.clone(),
            })
            .collect();
        let v = perform(&mut h, Verdict::Continue, effects);
        // The first 16, and the current stream's own reply although it comes past them.
        let mut first: Vec<StreamId> = (1..=16).collect();
        first.push(30);
        assert_eq!(h.replied(), first);
        assert_eq!(v, Verdict::Pause);
        assert_eq!(h.wakes(), 1);
        // A stream that ended meanwhile gets nothing.
        let worker = h.worker.as_mut().unwrap();
        worker.on_stream_done(40, 0);
        // Each wake sends the next ones, in order, at most the bound.
        h.current = Current::Root;
        for round in 1..=2 {
            let effects = h.worker.as_mut().unwrap().on_wake(0);
            let before = h.replied().len();
            perform(&mut h, Verdict::Continue, effects);
            assert!(
                h.replied().len() - before <= REPLIES_PER_CALLBACK,
                "round {round}"
            );
        }
        let mut rest: Vec<StreamId> = (17..=29).chain(31..=39).collect();
        first.append(&mut rest);
        assert_eq!(h.replied(), first);
        assert_eq!(
            h.wakes(),
            2,
            "one wake a callback that left replies waiting"
        );
        assert!(h
            .worker
            .as_mut()
            .unwrap()
            .on_wake(0)
            .iter()
            .all(|e| !matches!(e, Effect::Reply { .. })));
    }

    #[test]
    fn callouts_are_made_only_where_their_answer_arrives() {
        let mut h = recorder(Current::Stream(5));
        perform(
            &mut h,
            Verdict::Continue,
            vec![
                dispatch(1, Owner::Stream(5)),
                dispatch(2, Owner::Worker),
                dispatch(3, Owner::Stream(6)),
                Effect::Wake,
            ],
        );
        assert_eq!(
            h.done,
            [
                "dispatch 1",
                "misplaced 2",
                "worker told",
                "misplaced 3",
                "worker told",
                "wake"
            ]
        );
        let mut root = recorder(Current::Root);
        root.dispatch_fails = true;
        perform(
            &mut root,
            Verdict::Continue,
            vec![dispatch(7, Owner::Worker)],
        );
        assert_eq!(root.done, ["dispatch 7", "worker told"]);
    }
}
