//! The schedule's steps: what may happen next (each with its weight), carrying one out, and the
//! drain at the end (no more faults, everything in flight delivered).

use super::faults::{Faults, Outage};
use super::World;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Action {
    NewAttempt(usize),
    SendPart(usize),
    GiveUp(usize),
    Process(usize),
    Deliver(usize),
    FailCallout(usize),
    UpstreamPart(usize),
    Arrive(usize),
    UpstreamFinish(usize),
    Tick(usize),
    Wake(usize),
    LoseWake(usize),
    Kill(usize),
    Restart(usize),
    ToggleApi,
    DatabaseOutage,
    ToggleUpstream,
    SkewClock,
    EnvoyReply(usize),
    RotateSecret,
    DropPreviousSecret,
    Operator,
    Purge,
    Advance,
}

/// The most rounds of a second the drain waits for the workers' pending writes.
const DRAIN_IDLE_ROUNDS: usize = 400;
/// The most steps of a drain (a backstop: each busy step takes work away).
const DRAIN_STEPS: usize = 200_000;

impl World {
    /// Whether the operator may let the previous key secret go (by a drop, or by the next
    /// rotation), as they are told: once the longest retention, the unknown outcomes' horizon
    /// and a lease have passed since the rotation (a record left in progress under the
    /// previous secret by a dead owner is marked unknown at the end of its retention, then
    /// kept the horizon).
    pub(crate) fn previous_secret_may_go(&self) -> bool {
        let api = &self.setup.state_api;
        let lease = self.setup.lease_ms.min(api.max_lease_ms);
        let keep = api.max_retention_ms + api.unknown_retention_ms + lease;
        self.rotated_at.is_none_or(|t| t + keep <= self.now)
    }

    /// One random step; `false` when nothing is left to do.
    pub(crate) fn step(&mut self) -> bool {
        let mut actions: Vec<(u32, Action)> = Vec::new();
        for (i, op) in self.ops.iter().enumerate() {
            if op.attempts_left > 0 && op.next_at <= self.now {
                // A retry, or an impatient duplicate while an attempt is still running.
                let weight = if op.active.is_none() { 8 } else { 1 };
                actions.push((weight, Action::NewAttempt(i)));
            }
        }
        for (i, s) in self.streams.iter().enumerate() {
            if s.ended {
                continue;
            }
            if s.parts_sent < s.request_parts() && s.client.status.is_none() {
                actions.push((10, Action::SendPart(i)));
            }
            if self.fault(Faults::GIVE_UP) && !s.client.complete {
                actions.push((1, Action::GiveUp(i)));
            }
        }
        for (i, c) in self.callouts.iter().enumerate() {
            if c.answer.is_none() {
                actions.push((6, Action::Process(i)));
            } else if !c.orphan {
                actions.push((8, Action::Deliver(i)));
            }
            if self.fault(Faults::CALLOUT) && !c.orphan {
                actions.push((1, Action::FailCallout(i)));
            }
        }
        for (i, s) in self.streams.iter().enumerate() {
            if s.forwarded.is_some() && !s.ended && !s.resp_end_seen && !s.router_reply {
                actions.push((6, Action::UpstreamPart(i)));
            }
        }
        for (i, s) in self.streams.iter().enumerate() {
            if s.in_transit {
                actions.push((4, Action::Arrive(i)));
            }
        }
        for (e, x) in self.upstream.executions.iter().enumerate() {
            let caller = &self.streams[x.stream];
            if !x.finished && (caller.ended || caller.router_reply) {
                // Its caller left: it works on, and finishes in its own time.
                actions.push((2, Action::UpstreamFinish(e)));
            }
        }
        for (i, w) in self.workers.iter().enumerate() {
            if w.w.is_some() {
                actions.push((2, Action::Tick(i)));
                if w.wake_requested {
                    actions.push((4, Action::Wake(i)));
                    if self.fault(Faults::WAKE) {
                        actions.push((1, Action::LoseWake(i)));
                    }
                }
                if self.fault(Faults::KILL) {
                    actions.push((1, Action::Kill(i)));
                }
            } else {
                actions.push((2, Action::Restart(i)));
            }
        }
        if self.fault(Faults::API_DOWN) && matches!(self.outage, Outage::None | Outage::ApiDown) {
            actions.push((1, Action::ToggleApi));
        }
        if self.fault(Faults::DATABASE) && self.outage == Outage::None {
            actions.push((1, Action::DatabaseOutage));
        }
        if self.fault(Faults::SKEW) {
            actions.push((1, Action::SkewClock));
        }
        if self.fault(Faults::UPSTREAM) {
            actions.push((1, Action::ToggleUpstream));
        }
        if self.fault(Faults::ENVOY) {
            for (i, s) in self.streams.iter().enumerate() {
                if s.forwarded.is_some() && !s.ended && s.resp_head.is_none() && !s.router_reply {
                    actions.push((1, Action::EnvoyReply(i)));
                }
            }
        }
        if self.fault(Faults::ROTATE) {
            let settled = self.previous_secret_may_go();
            if settled && self.api.secret < 2 {
                actions.push((1, Action::RotateSecret));
            }
            if settled && self.api.previous_secret.is_some() {
                actions.push((1, Action::DropPreviousSecret));
            }
        }
        if self.fault(Faults::OPERATOR) && self.outage == Outage::None {
            actions.push((1, Action::Operator));
        }
        // The state API's purge runs now and then.
        if self.outage == Outage::None {
            actions.push((1, Action::Purge));
        }
        actions.push((3, Action::Advance));
        let weights: Vec<u32> = actions.iter().map(|a| a.0).collect();
        let pick = self.c.weighted(&weights);
        let action = actions[pick].1;
        self.act(action);
        true
    }

    pub(crate) fn act(&mut self, action: Action) {
        match action {
            Action::NewAttempt(op) => self.new_attempt(op, None),
            Action::SendPart(s) => self.send_part(s),
            Action::GiveUp(s) => {
                self.reach("sim.client_gave_up");
                self.log(format!("client gives up on stream {s}"));
                self.end_stream(s, true);
            }
            Action::Process(i) => self.process(i),
            Action::Deliver(i) => self.deliver(i),
            Action::FailCallout(i) => self.fail_callout(i),
            Action::UpstreamPart(s) => self.upstream_part(s),
            Action::Arrive(s) => {
                self.log(format!("stream {s}: the request reaches the upstream"));
                self.arrive(s);
            }
            Action::UpstreamFinish(e) => {
                self.reach("sim.finished_after_caller_left");
                self.commit(e);
                self.log(format!(
                    "the execution of stream {} finishes, its caller gone",
                    self.upstream.executions[e].stream
                ));
            }
            Action::Tick(w) => self.tick(w),
            Action::Wake(w) => self.wake(w),
            Action::LoseWake(w) => self.lose_wake(w),
            Action::Kill(w) => self.kill(w),
            Action::Restart(w) => self.restart(w),
            Action::ToggleApi => {
                if self.outage == Outage::None {
                    self.start_outage(Outage::ApiDown, None);
                } else {
                    self.end_outage();
                }
            }
            Action::DatabaseOutage => self.database_outage(),
            Action::EnvoyReply(s) => self.envoy_reply(s),
            Action::RotateSecret => self.rotate_secret(),
            Action::DropPreviousSecret => self.drop_previous_secret(),
            Action::Operator => self.operator_action(),
            Action::Purge => self.purge(),
            Action::ToggleUpstream => self.toggle_upstream(),
            Action::SkewClock => self.skew_clock(),
            Action::Advance => {
                let ms = *self
                    .c
                    .pick(&[1u64, 10, 100, 500, 2_000, 10_000, 40_000, 700_000]);
                self.advance(ms);
            }
        }
    }

    /// No more faults: everything in flight is delivered, every worker ticks until its writes
    /// are done, leases run out.
    pub(crate) fn drain(&mut self) {
        self.faults = false;
        if self.outage != Outage::None {
            self.end_outage();
        }
        self.upstream_down = false;
        self.log("drain: no more faults".into());
        for w in 0..self.workers.len() {
            if self.workers[w].w.is_none() {
                self.restart(w);
            }
        }
        if !self.settle() {
            return;
        }
        // Claims still waiting for their key get their answer now: their wait ends before the
        // time skipped below.
        for c in self.callouts.iter_mut() {
            if let Some(p) = c.parked.as_mut() {
                p.until = p.until.min(self.now);
            }
        }
        self.timeouts();
        // Past every lease: a dead owner's key is decided by the state API now, and every
        // execution whose caller left has finished. Time passes as anywhere, with the workers'
        // ticks: a live owner's lease is extended by its heartbeats, never skipped past (seeds
        // 420568878305, 420569411292, 420569457482: a clock moved a lease on without a tick
        // let a live owner's lease lapse).
        self.advance(self.setup.lease_ms + 1);
        if !self.violations.is_empty() {
            return;
        }
        // What that time set going (a wait's answer, a callout timed out and its request
        // forwarded unprotected) is carried through too: nobody is left waiting on it.
        if !self.settle() {
            return;
        }
        for e in 0..self.upstream.executions.len() {
            self.commit(e);
        }
        for w in 0..self.workers.len() {
            self.workers[w].skew_ms = 0;
        }
    }
    /// The drain's work: every busy step takes work away, until none is left (`false`: a
    /// violation, or a drain that never settles).
    fn settle(&mut self) -> bool {
        // Every busy step takes work away (a callout handled or delivered, a part sent, an
        // attempt made), so the drain goes on until none is left: a database stalled for a
        // while leaves a backlog of calls nobody waits for (a heartbeat given up a tick), each
        // two steps during a rotation of the key secret, and a drain that stopped at a count
        // of steps left them, and the final retries behind them, unanswered. Only the rounds
        // it waits for the workers' writes (a second each) are counted; a drain still busy
        // after `DRAIN_STEPS` never settles, which is reported, not passed over.
        let (mut idle, mut taken) = (0, 0);
        loop {
            taken += 1;
            if taken > DRAIN_STEPS {
                self.violations.push(format!(
                    "drain: still busy after {DRAIN_STEPS} steps ({} callouts, {} streams open)",
                    self.callouts.len(),
                    self.streams.iter().filter(|s| !s.ended).count()
                ));
                return false;
            }
            let mut busy = false;
            if let Some(i) = self.ready_callout() {
                self.process(i);
                busy = true;
            } else if let Some(i) = self
                .callouts
                .iter()
                .position(|c| !c.orphan && c.answer.is_some())
            {
                self.deliver(i);
                busy = true;
            } else if let Some(s) = (0..self.streams.len()).find(|&s| {
                let st = &self.streams[s];
                !st.ended && st.parts_sent < st.request_parts() && st.client.status.is_none()
            }) {
                self.send_part(s);
                busy = true;
            } else if let Some(s) = (0..self.streams.len()).find(|&s| self.streams[s].in_transit) {
                self.arrive(s);
                busy = true;
            } else if let Some(s) = (0..self.streams.len()).find(|&s| {
                let st = &self.streams[s];
                st.forwarded.is_some() && !st.ended && !st.resp_end_seen && !st.router_reply
            }) {
                self.upstream_part(s);
                busy = true;
            } else if let Some(w) = (0..self.workers.len())
                .find(|&w| self.workers[w].wake_requested && self.workers[w].w.is_some())
            {
                // A wake asked for comes (Envoy delivers it; only a fault loses one).
                self.wake(w);
                busy = true;
            } else if let Some(op) = (0..self.ops.len())
                .find(|&o| self.ops[o].active.is_none() && self.ops[o].attempts_left > 0)
            {
                self.ops[op].next_at = self.now;
                self.new_attempt(op, None);
                busy = true;
            }
            if !self.violations.is_empty() {
                return false;
            }
            if !busy {
                let pending = self.workers.iter().any(|w| {
                    w.w.as_ref().is_some_and(|wk| {
                        let u = wk.usage();
                        u.writes > 0 || u.claims > 0 || u.batched_claims + u.batched_writes > 0
                    })
                });
                if !pending || idle == DRAIN_IDLE_ROUNDS {
                    break;
                }
                idle += 1;
                self.advance(1_000);
            }
            self.check_step();
        }
        true
    }
}
