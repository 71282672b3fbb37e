//! Test-only (feature `undo-fixes`, which only `sim` turns on): one fix of a reliability issue
//! undone at a time, so that the model checker (`sim/src/model.rs`) and the simulation show
//! that each one is needed. Without the feature every fix is on and this is compiled away.
//!
//! It lives here, in the crate every other one uses, so that a fix in the filter's logic
//! (`filter-core`) and one in the record rules (`state-rules`) are undone by the same switch.

/// The fixes that can be undone: issue 34's paths, then issue 46's findings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fix {
    /// Issue 34, path 1: a record's retention counts from its owner's last sign of life, and a
    /// record in progress never expires by age.
    Retention = 1,
    /// Issue 34, path 4: a claim whose answer never reached the filter is given back (abandon).
    Abandon = 2,
    /// Issue 34, path 5: a heartbeat never makes a record its owner marked unknown in progress
    /// again.
    HeartbeatRevival = 3,
    /// Issue 34, path 9: a write moves the record it found to the current key secret.
    RotationMove = 4,
    /// Issue 46, seed 89644: the filter counts a grant's lease from when it sent the claim: a
    /// grant whose answer came a lease late is given back, not forwarded, and the first
    /// heartbeat is due a heartbeat period after the claim was sent.
    LateGrant = 5,
    /// Issue 46, finding 1: a waiting claim whose look may have committed without its answer
    /// ends its wait with 503 (the filter gives the claim back by its nonce).
    WaitLook = 6,
    /// Issue 46, finding 2: a claim and the abandon of its nonce conflict on one row per nonce,
    /// so they cannot both commit.
    NonceConflict = 7,
    /// Issue 46, finding 3: the filter makes the request it forwards unretriable by Envoy's
    /// router, whatever the route says.
    RouterRetries = 8,
    /// Issue 46, finding 4: an operator's guard counts an owner's silence only while the store
    /// served (the lease guard).
    OperatorServing = 9,
    /// Issue 46, finding 5: an operator's resolve takes a new fencing token.
    ResolveToken = 10,
    /// Issue 46, finding 6: a reconcile `executed` answer must name this request's subject and
    /// key.
    ReconcileScope = 11,
    /// Issue 46, finding 7: local replies deferred past a callback's bound go at the next tick as
    /// well as the next wake.
    TickDrain = 12,
    /// Issue 46, finding 8: an unknown outcome is kept for a horizon of its own, never as short
    /// as a retention.
    UnknownHorizon = 13,
}

impl Fix {
    /// Every fix, in order.
    pub const ALL: [Fix; 13] = [
        Fix::Retention,
        Fix::Abandon,
        Fix::HeartbeatRevival,
        Fix::RotationMove,
        Fix::LateGrant,
        Fix::WaitLook,
        Fix::NonceConflict,
        Fix::RouterRetries,
        Fix::OperatorServing,
        Fix::ResolveToken,
        Fix::ReconcileScope,
        Fix::TickDrain,
        Fix::UnknownHorizon,
    ];

    /// The name `make model-check UNDO=…` gives it.
    pub fn name(self) -> &'static str {
        match self {
            Fix::Retention => "retention",
            Fix::Abandon => "abandon",
            Fix::HeartbeatRevival => "heartbeat",
            Fix::RotationMove => "rotation",
            Fix::LateGrant => "late-grant",
            Fix::WaitLook => "wait-look",
            Fix::NonceConflict => "nonce-conflict",
            Fix::RouterRetries => "router-retries",
            Fix::OperatorServing => "operator-serving",
            Fix::ResolveToken => "resolve-token",
            Fix::ReconcileScope => "reconcile-scope",
            Fix::TickDrain => "tick-drain",
            Fix::UnknownHorizon => "unknown-horizon",
        }
    }

    /// The fix named `name`.
    pub fn named(name: &str) -> Option<Fix> {
        Fix::ALL.into_iter().find(|f| f.name() == name)
    }
}

#[cfg(feature = "undo-fixes")]
static UNDONE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Undoes `fix` (none: every fix on) for the whole process.
#[cfg(feature = "undo-fixes")]
pub fn set(fix: Option<Fix>) {
    UNDONE.store(
        fix.map_or(0, |f| f as u8),
        std::sync::atomic::Ordering::SeqCst,
    );
}

/// Whether `fix` is undone.
#[inline]
pub fn undone(fix: Fix) -> bool {
    #[cfg(feature = "undo-fixes")]
    {
        UNDONE.load(std::sync::atomic::Ordering::Relaxed) == fix as u8
    }
    #[cfg(not(feature = "undo-fixes"))]
    {
        let _ = fix;
        false
    }
}
