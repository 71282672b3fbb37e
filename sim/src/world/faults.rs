//! The faults a schedule may inject, and those of the state API and of Envoy itself: outages of
//! the state API or its database, Envoy answering a forwarded request on its own.

use super::envoy::{DURATION_TIMEOUT, STREAM_IDLE_TIMEOUT};
use super::World;
use crate::check;
use filter_core::outcome::flags;

/// The kinds of fault a schedule may inject (all by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Faults(pub u32);

impl Faults {
    pub const KILL: u32 = 1;
    pub const GIVE_UP: u32 = 2;
    pub const API_DOWN: u32 = 4;
    pub const CALLOUT: u32 = 8;
    pub const SKEW: u32 = 16;
    pub const UPSTREAM: u32 = 32;
    pub const CLIENT: u32 = 64;
    /// The database: crash recovery in place, a restart, a pause (each longer than a lease or
    /// not).
    pub const DATABASE: u32 = 128;
    /// Envoy answers a forwarded request itself (408, 413, 503, 504, a reset).
    pub const ENVOY: u32 = 256;
    /// The key secret is rotated (and the previous one dropped) mid-run.
    pub const ROTATE: u32 = 512;
    /// An operator releases or purges a record through the admin API, without force.
    pub const OPERATOR: u32 = 1024;
    pub const ALL: Faults = Faults(2047);
    const NAMES: [(&'static str, u32); 11] = [
        ("kill", Self::KILL),
        ("give-up", Self::GIVE_UP),
        ("api-down", Self::API_DOWN),
        ("callout", Self::CALLOUT),
        ("skew", Self::SKEW),
        ("upstream", Self::UPSTREAM),
        ("client", Self::CLIENT),
        ("database", Self::DATABASE),
        ("envoy", Self::ENVOY),
        ("rotate", Self::ROTATE),
        ("operator", Self::OPERATOR),
    ];

    pub fn has(self, f: u32) -> bool {
        self.0 & f != 0
    }

    /// `all`, or names joined by `,` (`kill,give-up`); a leading `-` removes (`all,-kill`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut bits = 0;
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (remove, name) = match part.strip_prefix('-') {
                Some(n) => (true, n),
                None => (false, part),
            };
            let b = if name == "all" {
                Self::ALL.0
            } else {
                Self::NAMES
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, b)| *b)
                    .ok_or_else(|| format!("unknown fault `{name}`"))?
            };
            if remove {
                bits &= !b;
            } else {
                bits |= b;
            }
        }
        Ok(Self(bits))
    }
}

impl std::fmt::Display for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Self::ALL {
            return f.write_str("all");
        }
        let names: Vec<&str> = Self::NAMES
            .iter()
            .filter(|(_, b)| self.has(*b))
            .map(|(n, _)| *n)
            .collect();
        f.write_str(&names.join(","))
    }
}

/// What of the state API is out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    None,
    /// The state API process: connections are refused.
    ApiDown,
    /// Its database: the state API answers 503 until it is back. `in_place`: a crash recovery
    /// in place (the postmaster reinitialises: its start time and timeline stay, so the lease
    /// guard's `serving_since` does not move); otherwise a restart (it moves).
    Database {
        in_place: bool,
    },
    /// The database is paused (stopped, or a stall): calls get no answer until it resumes.
    Paused,
}

/// A silence of the state API's pulse longer than this counts as an outage for the lease
/// guard (`serving_since` moves to its end).
pub const PULSE_SILENCE_MS: u64 = 1_000;

impl World {
    /// The state API or its database goes out (`lasts`: until it comes back by itself).
    pub(crate) fn start_outage(&mut self, kind: Outage, lasts: Option<u64>) {
        self.outage = kind;
        self.outage_since = self.now;
        self.outage_until = lasts.map(|l| self.now + l);
        self.log(match kind {
            Outage::ApiDown => "state API down".to_owned(),
            Outage::Database { in_place: true } => format!(
                "database down: a backend crashed, the postmaster reinitialises in place (for {} ms)",
                lasts.unwrap_or(0)
            ),
            Outage::Database { in_place: false } => {
                format!("database restarts (for {} ms)", lasts.unwrap_or(0))
            }
            Outage::Paused => format!("database paused (for {} ms)", lasts.unwrap_or(0)),
            Outage::None => "state API up".to_owned(),
        });
    }

    pub(super) fn end_outage(&mut self) {
        let (kind, since) = (self.outage, self.outage_since);
        self.outage = Outage::None;
        self.outage_until = None;
        let lasted = self.now - since;
        let over_lease = lasted > self.setup.lease_ms;
        match kind {
            Outage::Database { in_place: false } => {
                // A restart: the postmaster's start time moves, and with it serving_since.
                self.api.serving_since = self.now;
                self.reach("region: the database restarted");
            }
            Outage::Database { in_place: true } => {
                // A crash recovery in place empties the unlogged serving marker, which the
                // first check after it fills again (migration ..._serving_since_counts_from_
                // crash_recovery): serving_since moves too.
                self.api.serving_since = self.now;
                self.reach(if over_lease {
                    "region: a crash recovery in place longer than a lease"
                } else {
                    "region: a crash recovery in place"
                });
            }
            Outage::Paused | Outage::ApiDown => {
                // The state API's pulse (a beat every 250 ms) was silent: past 1 s, the lease
                // guard counts it as an outage too (the fix of path 2 without a crash).
                if lasted > PULSE_SILENCE_MS {
                    self.api.serving_since = self.now;
                }
                if kind == Outage::Paused && over_lease {
                    self.reach("region: the database paused longer than a lease");
                }
            }
            Outage::None => {}
        }
        self.log(format!("state API back after {lasted} ms ({kind:?})"));
        check::outage_ended(self, since, kind);
    }

    /// Envoy answers a forwarded request itself before the upstream's response: one of its
    /// timeouts, a payload over its limit, a reset.
    pub(super) fn envoy_reply(&mut self, s: usize) {
        let (status, details, fl) = *self.c.pick(&[
            (408u16, "stream_idle_timeout", STREAM_IDLE_TIMEOUT),
            (408, "request_overall_timeout", 0),
            (408, "max_duration_timeout", DURATION_TIMEOUT),
            (413, "request_payload_too_large", 0),
            (
                503,
                "upstream_reset_before_response_started{connection_termination}",
                flags::UPSTREAM_CONNECTION_TERMINATION,
            ),
            (
                504,
                "upstream_per_try_timeout",
                flags::UPSTREAM_REQUEST_TIMEOUT,
            ),
            (0, "reset", 0),
        ]);
        if status == 0 {
            self.reach("region: Envoy reset a forwarded stream");
            self.log(format!("stream {s}: Envoy resets the stream"));
            self.end_stream(s, false);
            return;
        }
        self.router_reply(s, status, details, fl);
    }
}
