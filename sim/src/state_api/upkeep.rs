//! What happens to records besides the filter's calls: a claim released for a caller gone, the
//! purge, an operator's action, a rotation of the key secret; and what the world asks of a
//! record (is it running, is its outcome unknown).

use state_rules::operator::{self, Refusal};
use state_rules::purge::Purge;
use state_rules::writes::{self};
use state_rules::RecordState;

use super::{Address, Deleter, Event, ModelStateApi, Record, Scope, TOMBSTONE_MS};
use contract::wire::StoredResponse;

impl ModelStateApi {
    /// A claim granted `token` to a caller that was gone when it was answered: the state API
    /// releases it at once (as a release by its owner would). Whether it did.
    pub fn release_for_gone_caller(&mut self, token: i64, now: u64) -> bool {
        let Some(scope) = self.issued.get(&token).cloned() else {
            return false;
        };
        let Some((address, _)) = self.find(&scope).filter(|(_, r)| r.token == token) else {
            return false;
        };
        let clock = self.clock(now);
        let mut slot = self.records.remove(&address);
        let state = slot.as_ref().map(|s| s.state);
        let released = writes::release(&mut slot, token, clock);
        match slot {
            Some(rec) => {
                self.put_back(address, Some(rec), released);
            }
            None if released => self.delete_noted(address, token, Deleter::GoneCaller, state),
            None => {}
        }
        released
    }

    /// The purge's pass: every record past its expiry with an outcome is deleted, and one in
    /// progress whose owner is silent (the lease guard) is marked unknown. Returns how many it
    /// deleted and marked.
    pub fn purge(&mut self, now: u64) -> (usize, usize) {
        let clock = self.clock(now);
        // Tombstones outlive any claim that could still arrive by minutes.
        self.tombstones
            .retain(|_, at| at.saturating_add(TOMBSTONE_MS) >= now);
        let addresses: Vec<Address> = self.records.keys().cloned().collect();
        let (mut deleted, mut marked) = (0, 0);
        for a in addresses {
            let mut slot = self.records.remove(&a);
            let before = slot.clone();
            let done = state_rules::purge::apply(&mut slot, clock);
            if let Some(rec) = slot {
                self.records.insert(a.clone(), rec);
            }
            let Some(r) = before else { continue };
            match done {
                Purge::Keep => {}
                Purge::MarkUnknown => {
                    marked += 1;
                    self.events.push(Event::Lapsed {
                        token: r.token,
                        scope: a.1.clone(),
                        lease_ms: r.lease_ms,
                        by: "found by the purge, which marked it unknown",
                    });
                }
                Purge::Delete => {
                    deleted += 1;
                    if r.state == RecordState::InProgress {
                        self.events.push(Event::Lapsed {
                            token: r.token,
                            scope: a.1.clone(),
                            lease_ms: r.lease_ms,
                            by: "found by the purge, which deleted the expired record",
                        });
                    }
                    self.delete_noted(a, r.token, Deleter::Purge, Some(r.state));
                }
            }
        }
        (deleted, marked)
    }

    /// An operator's release, purge or resolve (with `resolved`, the outcome the operator
    /// established) of the record of `scope` through the admin API, without `force`: `Ok` with
    /// the record as it was, or why it was refused (`None`: no record).
    pub fn operator(
        &mut self,
        scope: &Scope,
        action: operator::Action,
        resolved: Option<StoredResponse>,
        now: u64,
    ) -> Result<Record, Option<Refusal>> {
        let address = self.lookup(scope);
        let clock = self.clock(now);
        let Some(rec) = self.records.get(&address) else {
            return Err(None);
        };
        operator::allowed(rec, action, false, clock).map_err(Some)?;
        let before = rec.clone();
        if action == operator::Action::Resolve {
            let response = resolved.ok_or(None)?;
            let mut slot = self.records.remove(&address);
            let retention_ms = self.cfg.retention_ms;
            let mut next = || self.token(scope);
            operator::resolve(&mut slot, response, retention_ms, clock, &mut next);
            if let Some(r) = slot {
                self.records.insert(address, r);
            }
            return Ok(before);
        }
        self.records.remove(&address);
        let by = if action == operator::Action::Release {
            Deleter::OperatorRelease
        } else {
            Deleter::OperatorPurge
        };
        self.delete_noted(address, before.token, by, Some(before.state));
        Ok(before)
    }

    /// Rotates the key secret: new records are addressed with a new one, records under the
    /// current one are looked up as the previous one's (a third rotation drops the oldest).
    pub fn rotate_secret(&mut self) {
        self.previous_secret = Some(self.secret);
        self.secret += 1;
    }

    /// Drops the previous secret ("once the longest retention, the unknown horizon and a lease
    /// have passed"): records under it are no longer found.
    pub fn drop_previous_secret(&mut self) {
        self.previous_secret = None;
    }

    /// Whether the record of `scope` is held by a live lease as of `now` (a claim finds it in
    /// progress).
    pub fn running(&self, scope: &Scope, now: u64) -> bool {
        let address = self.lookup(scope);
        self.records.get(&address).is_some_and(|r| {
            r.state == RecordState::InProgress
                && !r.lease_expired(self.clock(now))
                && !r.retention_expired(self.clock(now))
        })
    }

    /// Whether the record of `scope` has an unknown outcome as of `now` (marked so, or a lease
    /// that ran out).
    pub fn outcome_unknown(&self, scope: &Scope, now: u64) -> bool {
        let address = self.lookup(scope);
        match self.records.get(&address) {
            Some(r) if r.state == RecordState::Unknown => true,
            Some(r) => r.lease_expired(self.clock(now)),
            None => false,
        }
    }
}
