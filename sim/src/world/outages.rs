//! The state API or its database out (for a time, or until it comes back by itself), and back:
//! what a restart, a crash recovery in place or a pause does to `serving_since`.

use super::faults::Outage;
use super::{evidence, World, PULSE_SILENCE_MS};

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
        evidence::outage_ended(self, since, kind);
    }

    /// The database goes out: a crash recovery in place, a restart or a pause, for some leases
    /// or not.
    pub(super) fn database_outage(&mut self) {
        let kind = match self.c.weighted(&[3, 1, 2]) {
            0 => Outage::Database { in_place: true },
            1 => Outage::Database { in_place: false },
            _ => Outage::Paused,
        };
        let lease = self.setup.lease_ms;
        let lasts = *self.c.pick(&[lease / 2, lease * 3 / 2, lease * 3, 40_000]);
        self.start_outage(kind, Some(lasts.max(1)));
    }
}
