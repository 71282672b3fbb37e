//! Time: the global clock advancing, the workers' ticks on their period, a wall clock stepped,
//! and every timeout that runs out on the way (callouts, waits at the state API, Envoy's own
//! timeouts).

use super::callouts::DETACHED_MAX_MS;
use super::envoy::{DURATION_TIMEOUT, STREAM_IDLE_TIMEOUT};
use super::faults::Outage;
use super::World;
use filter_core::outcome::flags;
use filter_core::worker::{CallId, Owner};

impl World {
    /// Time passes: each worker ticks at its tick period whenever a tick has work (heartbeats,
    /// writes), and its callouts go and come back at once (a quiet network); callouts already
    /// on their way and requests upstream time out as they would.
    pub(crate) fn advance(&mut self, ms: u64) {
        let end = self.now + ms;
        for _ in 0..100_000 {
            let mut next = end;
            for w in 0..self.workers.len() {
                if let Some(t) = self.next_tick(w) {
                    next = next.min(t.max(self.now));
                }
            }
            for c in &self.callouts {
                if !c.orphan {
                    next = next.min(c.deadline.max(self.now));
                }
                if let Some(p) = c.parked {
                    next = next.min(p.until.max(self.now));
                }
            }
            for s in 0..self.streams.len() {
                if let Some((at, ..)) = self.envoy_deadline(s) {
                    next = next.min(at.max(self.now));
                }
            }
            if let Some(t) = self.outage_until {
                next = next.min(t.max(self.now));
            }
            self.now = next;
            self.timeouts();
            for w in 0..self.workers.len() {
                if self.next_tick(w).is_some_and(|t| t <= self.now) {
                    self.quiet_tick(w);
                }
            }
            if self.now >= end {
                return;
            }
            if !self.violations.is_empty() {
                return;
            }
        }
    }

    /// When worker `w` next ticks with work to do (global time, on its tick period).
    pub fn next_tick(&self, w: usize) -> Option<u64> {
        let sw = &self.workers[w];
        let due = sw.w.as_ref()?.next_due()?;
        let period = self.cfg.tick_period_ms().max(1);
        let due = due.saturating_sub(sw.steady_ms);
        // The host ticks on its period: the first tick at or after the work is due, and never
        // twice at one instant.
        let t = due.div_ceil(period) * period;
        Some(if t <= self.now {
            self.now
                + if sw.ticked_at == Some(self.now) {
                    period
                } else {
                    0
                }
        } else {
            t
        })
    }

    /// A tick in quiet time: the callouts it makes are answered at once (routine heartbeats
    /// are left out of the trace).
    pub(super) fn quiet_tick(&mut self, w: usize) {
        self.workers[w].ticked_at = Some(self.now);
        self.quiet = true;
        let before = self.callouts.len();
        self.tick(w);
        while self.callouts.len() > before {
            let i = self.callouts.len() - 1;
            if self.callouts[i].worker != w || self.callouts[i].owner != Owner::Worker {
                break;
            }
            // Looked up, then handled (two steps during a rotation of the key secret).
            for _ in 0..2 {
                if self.callouts.get(i).is_some_and(|c| c.answer.is_none()) {
                    self.process(i);
                }
            }
            if self.callouts.get(i).is_some_and(|c| c.answer.is_some()) {
                self.deliver(i);
            } else {
                break;
            }
        }
        self.quiet = false;
    }

    /// Callouts past their deadline fail (Envoy's callout timeout); the route timeout answers
    /// 504 for requests whose upstream has not answered.
    pub(crate) fn timeouts(&mut self) {
        if self.outage_until.is_some_and(|t| t <= self.now) {
            self.end_outage();
        }
        // A statement given up at the stall limit that has not reached the database
        // [`DETACHED_MAX_MS`] later never will: its connection was reset (a paused database
        // holds what it received, and runs it when it resumes).
        if self.outage != Outage::Paused {
            let now = self.now;
            let before = self.callouts.len();
            self.callouts.retain(|c| {
                !(c.detached && c.answer.is_none() && c.detached_at + DETACHED_MAX_MS <= now)
            });
            let dropped = before - self.callouts.len();
            if dropped > 0 {
                self.log(format!(
                    "{dropped} statement(s) given up at the stall limit never reached the database (their connections reset)"
                ));
            }
        }
        // Waits that reach their end are answered first (the state API's own deadline).
        if self.outage != Outage::Paused {
            let due: Vec<(usize, u32, CallId)> = self
                .callouts
                .iter()
                .filter(|c| c.parked.is_some_and(|p| p.until <= self.now))
                .map(|c| (c.worker, c.generation, c.id))
                .collect();
            for (w, g, id) in due {
                if let Some(i) = self
                    .callouts
                    .iter()
                    .position(|c| (c.worker, c.generation, c.id) == (w, g, id))
                {
                    self.process(i);
                }
            }
        }
        while let Some(i) = self
            .callouts
            .iter()
            .position(|c| !c.orphan && c.deadline <= self.now)
        {
            self.fail_callout_with(i, "timeout");
        }
        for s in 0..self.streams.len() {
            if let Some((at, status, details, fl)) = self.envoy_deadline(s) {
                if at <= self.now {
                    self.router_reply(s, status, details, fl);
                }
            }
        }
    }

    /// The first of Envoy's timeouts that runs out for a forwarded request still without its
    /// response: the route's (504), or the connection manager's (408).
    pub(super) fn envoy_deadline(&self, s: usize) -> Option<(u64, u16, &'static str, u64)> {
        let st = &self.streams[s];
        let e = st.forwarded?;
        if st.ended || st.resp_head.is_some() || st.router_reply {
            return None;
        }
        let at = self.upstream.executions.get(e)?.at;
        let su = &self.setup;
        [
            Some((
                su.route_timeout_ms,
                504,
                "upstream_response_timeout",
                flags::UPSTREAM_REQUEST_TIMEOUT,
            )),
            Some((
                su.idle_timeout_ms,
                408,
                "stream_idle_timeout",
                STREAM_IDLE_TIMEOUT,
            )),
            su.request_timeout_ms
                .map(|t| (t, 408, "request_overall_timeout", 0)),
            su.max_stream_duration_ms
                .map(|t| (t, 408, "max_duration_timeout", DURATION_TIMEOUT)),
        ]
        .into_iter()
        .flatten()
        .map(|(after, status, details, fl)| (at + after, status, details, fl))
        .min_by_key(|d| d.0)
    }

    /// A worker's wall clock is skewed a little, or stepped (NTP, a VM resumed) either way.
    pub(super) fn skew_clock(&mut self) {
        let w = self.c.below(self.workers.len() as u32) as usize;
        // A little skew, or the wall clock stepped (NTP, a VM resumed), either way.
        let to: i64 = match self.c.weighted(&[4, 1, 1, 1, 1]) {
            0 => i64::from(self.c.below(300)),
            1 => -5_000,
            2 => -120_000,
            3 => 5_000,
            _ => 900_000,
        };
        let by = to - self.workers[w].skew_ms;
        self.workers[w].skew_ms = to;
        if by.abs() >= 1_000 {
            let holds = self.workers[w]
                .w
                .as_ref()
                .is_some_and(|wk| !wk.held_tokens().is_empty() || !wk.write_tokens().is_empty());
            if holds {
                self.reach(if by < 0 {
                    "region: a clock stepped back while its worker held a claim"
                } else {
                    "region: a clock stepped forward while its worker held a claim"
                });
            }
            self.ev
                .clock_steps
                .entry(w)
                .or_default()
                .push((self.now, by));
        }
        self.log(format!("worker {w} clock skew {to} ms ({by:+} ms)"));
    }
}
