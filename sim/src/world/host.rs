//! This model of Envoy as the host of the shared interpreter of effects
//! ([`filter_core::host::perform`]): calls into a worker (a panic is a violation), and each host
//! action carried out on the world.

use super::callouts::Callout;
use super::clients::ClientView;
use super::faults::Faults;
use super::{problem_type, Current, World, UPSTREAM_CLUSTER};
use filter_core::flow::Verdict;
use filter_core::host::{Current as HostCurrent, Host};
use filter_core::metrics::Metric;
use filter_core::reply::LocalReply;
use filter_core::worker::{Dispatch, Effect, Level, Owner, StreamId, Worker};

/// Envoy around one callback of worker `w`: the host the shared interpreter carries the
/// worker's effects out with.
struct Envoy<'a> {
    world: &'a mut World,
    w: usize,
    current: HostCurrent,
}

impl Envoy<'_> {
    /// The index of stream `sid` of this worker (its current life).
    fn stream_of(&self, sid: StreamId) -> Option<usize> {
        let world = &*self.world;
        let w = self.w;
        world.streams.iter().position(|s| {
            s.worker == w && s.generation == world.workers[w].generation && s.sid == sid
        })
    }
}

impl Host for Envoy<'_> {
    fn current(&self) -> HostCurrent {
        self.current
    }

    fn with_worker<T>(&mut self, f: impl FnOnce(&mut Worker, u64) -> T) -> Option<T> {
        let now = self.world.worker_now(self.w);
        self.world.call(self.w, |wk| f(wk, now))
    }

    fn reply(&mut self, stream: StreamId, reply: LocalReply) {
        let Some(s) = self.stream_of(stream) else {
            return;
        };
        let world = &mut *self.world;
        if world.streams[s].forwarded.is_some() && world.streams[s].resp_head_passed {
            world.violations.push(format!(
                "stream {s}: a local reply after the response began"
            ));
        }
        // A deferred reply goes a callback or more later: never to a stream that ended
        // meanwhile, never a second one.
        if world.streams[s].ended {
            world
                .violations
                .push(format!("4: stream {s}: a local reply after it ended"));
        }
        if world.streams[s].client.complete && world.streams[s].client.local {
            world
                .violations
                .push(format!("4: stream {s}: a second local reply"));
        }
        world.log(format!(
            "stream {s}: filter answers {} {}{}",
            reply.status,
            problem_type(&reply.body),
            if reply
                .headers
                .iter()
                .any(|(n, _)| n == "idempotent-replayed")
            {
                " (replay)"
            } else {
                ""
            }
        ));
        world.streams[s].client = ClientView {
            status: Some(reply.status),
            headers: reply.headers,
            body: reply.body,
            complete: true,
            local: true,
        };
    }

    fn set_request_header(&mut self, stream: StreamId, name: &'static str, value: String) {
        if let Some(s) = self.stream_of(stream) {
            let hs = &mut self.world.streams[s].headers;
            hs.retain(|(n, _)| n != name);
            hs.push((name.to_owned(), value));
        }
    }

    /// Envoy replaces a header of a response it has not sent yet; the filter sets one only in
    /// the response headers callback, before they go on.
    fn set_response_header(&mut self, stream: StreamId, name: &'static str, value: String) {
        if let Some(s) = self.stream_of(stream) {
            let st = &mut self.world.streams[s];
            match &mut st.resp_head {
                Some(head) if !st.resp_head_passed => {
                    head.headers.retain(|(n, _)| n != name);
                    head.headers.push((name.to_owned(), value));
                }
                _ => {
                    let found = vec![format!(
                        "stream {s}: the filter set the response header {name} once the response headers were sent"
                    )];
                    self.world.found(found);
                }
            }
        }
    }

    fn remove_request_header(&mut self, stream: StreamId, name: &'static str) {
        if let Some(s) = self.stream_of(stream) {
            self.world.streams[s].headers.retain(|(n, _)| n != name);
        }
    }

    fn resume_request(&mut self, stream: StreamId) {
        if let Some(s) = self.stream_of(stream) {
            self.world.forward(s);
        }
    }

    fn resume_response(&mut self, stream: StreamId) {
        if let Some(s) = self.stream_of(stream) {
            self.world.streams[s].resp_paused = false;
            self.world.pass_response(s);
            self.world.end_if_answered(s);
        }
    }

    fn dispatch(&mut self, d: Dispatch) -> Result<(), String> {
        let stream = match d.owner {
            Owner::Stream(sid) => self.stream_of(sid),
            Owner::Worker => None,
        };
        let world = &mut *self.world;
        if world.fault(Faults::CALLOUT) && world.c.chance(2) {
            world.heartbeat_failed(&d.body, d.header(":path").unwrap_or(""));
            return Err("dispatch failed".into());
        }
        if world.partitioned == Some(self.w) && d.cluster != UPSTREAM_CLUSTER {
            // Cut off from the state API (the model checker's partition).
            world.heartbeat_failed(&d.body, d.header(":path").unwrap_or(""));
            return Err("no route to the state API".into());
        }
        let path = d.header(":path").unwrap_or("").to_owned();
        let seq = world.next_seq();
        world.callouts.push(Callout {
            id: d.id,
            worker: self.w,
            generation: world.workers[self.w].generation,
            owner: d.owner,
            stream,
            cluster: d.cluster,
            path,
            headers: d.headers,
            body: d.body,
            deadline: world.now + d.timeout_ms,
            answer: None,
            orphan: false,
            orphaned_by: "",
            parked: None,
            seq,
            sent_at: world.now,
            looked_at: 0,
            looked_up: None,
            detached: false,
            detached_at: 0,
            snapshot_abandoned: None,
        });
        Ok(())
    }

    fn misplaced_callout(&mut self, d: &Dispatch) {
        let current = self.current;
        self.world.violations.push(format!(
            "a callout of {:?} made from {current:?} (Envoy would answer it elsewhere)",
            d.owner
        ));
    }

    fn wake(&mut self) {
        self.world.workers[self.w].wake_requested = true;
    }

    fn replies_per_callback(&self) -> usize {
        self.world.setup.replies_per_callback
    }

    fn count(&mut self, m: Metric) {
        self.world.reach(m.name());
        match m {
            Metric::SubjectBuffersFull503 => self
                .world
                .reach("region: a body refused by its subject's share of the buffering bound"),
            Metric::BuffersFull503 => self
                .world
                .reach("region: a body refused by the worker's buffering bound"),
            _ => {}
        }
    }

    fn log(&mut self, level: Level, msg: String) {
        if msg.contains("given up")
            || msg.contains("was not stored after")
            || msg.contains("is not sent")
            || (msg.contains(" refused (") && msg.contains(filter_core::flow::UNSTORED))
        {
            // A write given up (a complete, a release, an abandon, an unknown mark; failed
            // too often or refused by the state API): the endpoint it names (its log names no
            // key) is left out of invariant 8.
            let endpoint = msg
                .find("POST /")
                .map(|at| msg[at..].split(' ').take(2).collect::<Vec<_>>().join(" "));
            match endpoint {
                Some(e) => {
                    self.world.ev.gave_up_for.insert(e);
                }
                None => self.world.ev.gave_up_a_write = true,
            }
        }
        if let Some(token) = given_up_for_time(&msg) {
            self.world
                .reach("region: a write given up after complete_retry_ms");
            let found = self.world.invariants.gave_up(self.world, self.w, token);
            self.world.found(found);
        }
        let world = &mut *self.world;
        let routine = msg.starts_with("heartbeat failed");
        if !routine && matches!(level, Level::Warn | Level::Error) {
            let msg: String = if msg.len() > 240 {
                format!("{}…", msg.chars().take(240).collect::<String>())
            } else {
                msg
            };
            world.log(format!("worker {} logs: {msg}", self.w));
        }
    }
}

/// The token of a write the worker gave up because `complete_retry_ms` passed (its log line:
/// "... given up after N retries (still failing after M ms; token T) ...").
pub(super) fn given_up_for_time(msg: &str) -> Option<i64> {
    if !msg.contains("still failing after") {
        return None;
    }
    let rest = &msg[msg.find("; token ")? + "; token ".len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

impl World {
    /// Calls into a worker, catching a panic (a violation: it would kill the Wasm VM).
    pub(super) fn call<T>(&mut self, w: usize, f: impl FnOnce(&mut Worker) -> T) -> Option<T> {
        let wk = self.workers[w].w.as_mut()?;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(wk))) {
            Ok(v) => Some(v),
            Err(e) => {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                self.violations.push(format!("the filter panicked: {msg}"));
                self.workers[w].w = None;
                None
            }
        }
    }

    /// Carries out effects with the glue's own rules ([`filter_core::host::perform`]), this
    /// model of Envoy as the host; returns the callback's verdict.
    pub(super) fn perform(
        &mut self,
        w: usize,
        current: Current,
        verdict: Verdict,
        effects: Vec<Effect>,
    ) -> Verdict {
        let sid = |s: usize| self.streams[s].sid;
        let own = match current {
            Current::Request(s) | Current::Response(s) | Current::Stream(s) => Some(s),
            Current::Root(_) => None,
        };
        let open: Vec<usize> = (0..self.streams.len())
            .filter(|&s| {
                Some(s) != own && !self.streams[s].ended && !self.streams[s].client.complete
            })
            .collect();
        let current = match current {
            Current::Request(s) => HostCurrent::Request(sid(s)),
            Current::Response(s) => HostCurrent::Response(sid(s)),
            Current::Stream(s) => HostCurrent::Stream(sid(s)),
            Current::Root(_) => HostCurrent::Root,
        };
        let mut envoy = Envoy {
            world: self,
            w,
            current,
        };
        let verdict = filter_core::host::perform(&mut envoy, verdict, effects);
        // Another stream answered from this callback (a waiter woken, a batch's answers, a
        // deferred reply) is over when the callback returns, as Envoy ends it: judged now,
        // while what made its answer right still holds (seed 407115896655: an operator's
        // resolved answer replayed to a waiter was judged two seconds later, after the
        // record had been reused as a new key).
        for s in open {
            if self.streams[s].client.complete {
                self.end_if_answered(s);
            }
        }
        verdict
    }
}
