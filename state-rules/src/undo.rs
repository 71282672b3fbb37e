//! Test-only (feature `undo-fixes`, which only `sim` turns on): one fix of issue 34 undone at a
//! time, so that the model checker (`sim/src/model.rs`) shows that each one is needed. Without
//! the feature every fix is on and this is compiled away.

/// The fixes that can be undone, by the path of issue 34 they close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fix {
    /// Path 1: a record's retention counts from its owner's last sign of life, and a record in
    /// progress never expires by age.
    Retention = 1,
    /// Path 4: a claim whose answer never reached the filter is given back (abandon).
    Abandon = 2,
    /// Path 5: a heartbeat never makes a record its owner marked unknown in progress again.
    HeartbeatRevival = 3,
    /// Path 9: a write moves the record it found to the current key secret.
    RotationMove = 4,
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
