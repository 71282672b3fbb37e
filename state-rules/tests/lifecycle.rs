//! A record's life through the rules, one step at a time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use state_rules::writes::{complete, heartbeat, owner_unknown, release, Beat, Completion, Marked};
use state_rules::{claim, ClaimOutcome, ClaimTerms, Clock, Fingerprint, Record, RecordState};

fn terms(fp: &str, take_over: bool) -> ClaimTerms {
    ClaimTerms {
        fingerprint: Fingerprint {
            alg: "sha256-jcs-v2".into(),
            value: fp.into(),
        },
        lease_ms: 1_000,
        retention_ms: 60_000,
        unknown_retention_ms: 600_000,
        take_over_unknown: take_over,
        nonce: Some(format!("n-{fp}")),
        abandoned: false,
    }
}

struct Tokens(i64);
impl Tokens {
    fn next(&mut self) -> i64 {
        self.0 += 1;
        self.0
    }
}

fn at(now: u64) -> Clock {
    Clock::serving(now)
}

#[test]
fn claimed_then_completed_then_replayed() {
    let mut slot: Option<Record<&str>> = None;
    let mut t = Tokens(0);
    let first = claim(&mut slot, &terms("aa", false), at(10), &mut || t.next());
    assert_eq!(
        first,
        ClaimOutcome::Claimed {
            token: 1,
            reclaimed: false
        }
    );
    assert_eq!(
        claim(&mut slot, &terms("aa", false), at(20), &mut || t.next()),
        ClaimOutcome::InProgress {
            lease_remaining_ms: 990
        }
    );
    assert_eq!(
        claim(&mut slot, &terms("bb", false), at(20), &mut || t.next()),
        ClaimOutcome::Mismatch
    );
    assert!(matches!(
        complete(&mut slot, 1, "201", 0, at(500)),
        Completion::Done { .. }
    ));
    assert!(matches!(
        complete(&mut slot, 1, "201", 0, at(600)),
        Completion::AlreadyDone { .. }
    ));
    assert!(matches!(
        claim(&mut slot, &terms("aa", false), at(700), &mut || t.next()),
        ClaimOutcome::Completed {
            response: "201",
            ..
        }
    ));
    assert_eq!(
        complete(&mut slot, 2, "500", 0, at(800)),
        Completion::FencedOut
    );
}

#[test]
fn a_lease_run_out_is_unknown_held_or_taken_over_with_a_larger_token() {
    let mut slot: Option<Record<&str>> = None;
    let mut t = Tokens(0);
    claim(&mut slot, &terms("aa", false), at(0), &mut || t.next());
    assert_eq!(
        claim(&mut slot, &terms("aa", false), at(1_500), &mut || t.next()),
        ClaimOutcome::Unknown
    );
    assert_eq!(slot.as_ref().unwrap().state, RecordState::Unknown);
    assert_eq!(
        claim(&mut slot, &terms("aa", true), at(1_600), &mut || t.next()),
        ClaimOutcome::Claimed {
            token: 2,
            reclaimed: true
        }
    );
    // The new owner's release makes it unknown again (the first attempt's outcome is unknown).
    assert!(release(&mut slot, 2, at(1_700)));
    assert_eq!(slot.as_ref().unwrap().state, RecordState::Unknown);
    assert!(
        !release(&mut slot, 1, at(1_700)),
        "the first owner is fenced out"
    );
}

#[test]
fn the_lease_guard_counts_only_while_the_database_served() {
    let mut slot: Option<Record<&str>> = None;
    let mut t = Tokens(0);
    claim(&mut slot, &terms("aa", true), at(0), &mut || t.next());
    // Back at 1,500 after an outage: the owner gets a whole lease to be heard.
    let back = Clock {
        now: 1_500,
        serving_since: 1_200,
    };
    assert!(matches!(
        claim(&mut slot, &terms("aa", true), back, &mut || t.next()),
        ClaimOutcome::InProgress { .. }
    ));
    let later = Clock {
        now: 2_300,
        serving_since: 1_200,
    };
    assert!(matches!(
        claim(&mut slot, &terms("aa", true), later, &mut || t.next()),
        ClaimOutcome::Claimed {
            reclaimed: true,
            ..
        }
    ));
}

#[test]
fn owners_mark_and_heartbeat_their_own_record_only() {
    let mut slot: Option<Record<&str>> = None;
    let mut t = Tokens(0);
    claim(&mut slot, &terms("aa", false), at(0), &mut || t.next());
    assert_eq!(heartbeat(&mut slot, 1, 1_000, at(900)), Beat::Extended);
    assert_eq!(slot.as_ref().unwrap().lease_until, 1_900);
    assert_eq!(heartbeat(&mut slot, 2, 1_000, at(900)), Beat::FencedOut);
    assert_eq!(owner_unknown(&mut slot, 2, at(950)), Marked::FencedOut);
    assert_eq!(owner_unknown(&mut slot, 1, at(950)), Marked::Unknown);
    assert_eq!(slot.as_ref().unwrap().lease_until, 950);
    // A heartbeat its owner sent before the mark, answered after it, revives nothing.
    assert_eq!(heartbeat(&mut slot, 1, 1_000, at(960)), Beat::LeaseEnded);
    assert_eq!(slot.as_ref().unwrap().state, RecordState::Unknown);
    assert_eq!(slot.as_ref().unwrap().lease_until, 950);
    // Its outcome is still accepted.
    assert!(matches!(
        complete(&mut slot, 1, "201", 0, at(970)),
        Completion::Done { .. }
    ));
    // A release by an owner that never took over an unknown outcome frees the key.
    let mut fresh: Option<Record<&str>> = None;
    claim(&mut fresh, &terms("aa", false), at(0), &mut || t.next());
    assert!(release(&mut fresh, 2, at(10)));
    assert!(fresh.is_none());
}

#[test]
fn an_abandoned_claim_gives_its_record_back_and_only_its_own() {
    use state_rules::writes::{abandon, Abandoned};
    let mut slot: Option<Record<&str>> = None;
    let mut t = Tokens(0);
    claim(&mut slot, &terms("aa", false), at(0), &mut || t.next());
    assert_eq!(abandon(&mut slot, "n-other", at(10)), Abandoned::Nothing);
    assert!(slot.is_some());
    assert_eq!(abandon(&mut slot, "n-aa", at(10)), Abandoned::Deleted);
    assert!(slot.is_none(), "the key is free at once");
    // Marked unknown meanwhile (its lease ran out: nobody heartbeated a claim whose answer
    // was lost): still given back.
    claim(&mut slot, &terms("aa", false), at(100), &mut || t.next());
    assert_eq!(
        claim(&mut slot, &terms("aa", false), at(1_200), &mut || t.next()),
        ClaimOutcome::Unknown
    );
    assert_eq!(abandon(&mut slot, "n-aa", at(1_300)), Abandoned::Deleted);
    // A take-over of an unknown outcome goes back to unknown, not free.
    claim(&mut slot, &terms("aa", false), at(2_000), &mut || t.next());
    owner_unknown(&mut slot, 3, at(2_100));
    let taker = ClaimTerms {
        nonce: Some("n-taker".into()),
        ..terms("aa", true)
    };
    assert!(matches!(
        claim(&mut slot, &taker, at(2_200), &mut || t.next()),
        ClaimOutcome::Claimed {
            reclaimed: true,
            ..
        }
    ));
    assert_eq!(
        abandon(&mut slot, "n-aa", at(2_300)),
        Abandoned::Nothing,
        "not the taker's"
    );
    assert_eq!(abandon(&mut slot, "n-taker", at(2_300)), Abandoned::Unknown);
    assert_eq!(slot.as_ref().unwrap().state, RecordState::Unknown);
    // Completed: an abandon changes nothing.
    let mut done: Option<Record<&str>> = None;
    claim(&mut done, &terms("bb", false), at(0), &mut || t.next());
    let token = done.as_ref().unwrap().token;
    complete(&mut done, token, "201", 0, at(5));
    assert_eq!(abandon(&mut done, "n-bb", at(6)), Abandoned::Nothing);
}

#[test]
fn a_claim_attempt_abandoned_before_it_arrives_never_commits() {
    let mut slot: Option<Record<&str>> = None;
    let mut t = Tokens(0);
    let late = ClaimTerms {
        abandoned: true,
        ..terms("aa", true)
    };
    assert_eq!(
        claim(&mut slot, &late, at(0), &mut || t.next()),
        ClaimOutcome::Abandoned
    );
    assert!(slot.is_none());
    // Over an unknown outcome it takes nothing over either; a read-only answer is still given.
    claim(&mut slot, &terms("aa", false), at(0), &mut || t.next());
    owner_unknown(&mut slot, 1, at(10));
    assert_eq!(
        claim(&mut slot, &late, at(20), &mut || t.next()),
        ClaimOutcome::Abandoned
    );
    assert_eq!(slot.as_ref().unwrap().token, 1);
    let held = ClaimTerms {
        take_over_unknown: false,
        ..late
    };
    assert_eq!(
        claim(&mut slot, &held, at(30), &mut || t.next()),
        ClaimOutcome::Unknown
    );
}
