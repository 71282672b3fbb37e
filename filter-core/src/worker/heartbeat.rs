//! The heartbeats that extend the leases of the claims this worker holds: sent when due (at a
//! tick), and their answers.

use super::{ids, Purpose, Worker};
use crate::effect::{CalloutResult, Effect, Level, Owner};
use crate::metrics::Metric;
use contract::wire::{HeartbeatResponse, HEARTBEAT_PATH};
use contract::ProblemKind;

impl Worker {
    /// Sends the heartbeats that are due, each given up in time to be sent again before its
    /// lease runs out ([`Registry::answer_within`](super::registry::Registry::answer_within)).
    pub(super) fn send_heartbeats(&mut self, now_ms: u64, effects: &mut Vec<Effect>) {
        if !self.registry.is_empty() {
            let due = self
                .registry
                .due(now_ms, self.cfg.tick_period_ms(), &self.cfg.namespace);
            for hb in due {
                let token = hb.token;
                let body = crate::effect::to_json(&hb);
                let within = self
                    .registry
                    .answer_within(token, self.cfg.tick_period_ms())
                    .unwrap_or(u64::MAX);
                let timeout_ms = self.cfg.state_api.timeout_ms.min(within);
                let call = self.state_api_call_within(HEARTBEAT_PATH, body, timeout_ms);
                self.dispatch(Owner::Worker, Purpose::Heartbeat(token), call, effects);
            }
        }
    }

    pub(super) fn heartbeat_answered(&mut self, token: i64, result: CalloutResult) -> Vec<Effect> {
        self.registry.answered(token);
        match result {
            CalloutResult::Response { status, body, .. } if (200..300).contains(&status) => {
                if let Ok(hb) = HeartbeatResponse::read(&body) {
                    self.registry.granted(token, hb.lease_ms);
                    vec![Effect::Count(Metric::Heartbeats)]
                } else {
                    vec![
                        Effect::Count(Metric::StateApiErrors),
                        Effect::Log(Level::Warn, "unreadable heartbeat answer".into()),
                    ]
                }
            }
            CalloutResult::Response {
                status: 409, body, ..
            } if ProblemKind::LeaseEnded.names(&body) => {
                // Marked unknown under this token (the lease ran out and a claim, the purge or
                // this worker marked it): nothing extends it any more, but the outcome this
                // claim may still learn is stored (a complete of its token is accepted).
                self.registry.lease_ended(token);
                vec![
                    Effect::Count(Metric::FencedOut),
                    Effect::Log(
                        Level::Warn,
                        "heartbeat refused: the record is marked unknown (its lease ran out); its outcome is still stored".into(),
                    ),
                ]
            }
            CalloutResult::Response { status: 409, .. } => {
                // A newer claim owns the key: stop extending this one, and stop completing it.
                let pending = self.writes.remove(token);
                if let Some(claim) = &pending {
                    self.registry.remove(token);
                    self.replays
                        .remove(&ids::id(&claim.key, &claim.subject, &claim.endpoint));
                } else {
                    // Its stream still runs: what it hands over later is dropped (`hand_over`).
                    self.registry.fence(token);
                }
                vec![
                    Effect::Count(Metric::FencedOut),
                    Effect::Log(
                        Level::Warn,
                        if pending.is_some() {
                            "heartbeat fenced out; a newer claim owns the key (its pending complete is dropped)".into()
                        } else {
                            "heartbeat fenced out; a newer claim owns the key".into()
                        },
                    ),
                ]
            }
            CalloutResult::Response { status, .. } => {
                self.registry.failed(token);
                vec![
                    Effect::Count(Metric::StateApiErrors),
                    Effect::Log(
                        Level::Warn,
                        format!("heartbeat answered HTTP {status}; sent again at the next tick"),
                    ),
                ]
            }
            CalloutResult::Failed(why) => {
                self.registry.failed(token);
                vec![
                    Effect::Count(Metric::StateApiErrors),
                    Effect::Log(
                        Level::Warn,
                        format!("heartbeat failed: {why}; sent again at the next tick"),
                    ),
                ]
            }
        }
    }
}
