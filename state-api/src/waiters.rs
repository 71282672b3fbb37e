//! Claims that wait for a running key's outcome (`Prefer: wait`), in this process: at most
//! `--max-waiters` at once. A write that settles a record (complete, release, unknown, an
//! operator's action) wakes the claims waiting on it at once; for writes made by another state
//! API process the waiting claims look again every poll (`--wait-poll-ms`). That costs one read-only
//! statement per waiter per poll, and no database trigger on the write path: a `NOTIFY` from
//! every complete would take Postgres' notification lock at every commit, waiters or not.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::scope::ScopeHash;

#[derive(Debug)]
pub struct Waiters {
    max: usize,
    /// How often a waiting claim looks again for a write it was not told of.
    poll: Duration,
    by_scope: Mutex<HashMap<ScopeHash, (Arc<Notify>, usize)>>,
    total: std::sync::atomic::AtomicUsize,
}

/// A place among the waiters of one scope; leaves it when dropped.
pub struct Slot<'a> {
    waiters: &'a Waiters,
    scope: ScopeHash,
    pub notify: Arc<Notify>,
}

impl Waiters {
    pub fn new(max: usize, poll: Duration) -> Self {
        Self {
            max,
            poll,
            by_scope: Mutex::new(HashMap::new()),
            total: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    pub fn poll(&self) -> Duration {
        self.poll
    }

    /// Joins the waiters of `scope`; `None` when as many claims as allowed wait already.
    pub fn enter(&self, scope: ScopeHash) -> Option<Slot<'_>> {
        use std::sync::atomic::Ordering;
        let mut map = self.by_scope.lock().ok()?;
        if self.total.load(Ordering::SeqCst) >= self.max {
            return None;
        }
        self.total.fetch_add(1, Ordering::SeqCst);
        let entry = map
            .entry(scope)
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        Some(Slot {
            waiters: self,
            scope,
            notify: Arc::clone(&entry.0),
        })
    }

    /// A write settled the record of `scope`: its waiters look again now.
    pub fn settled(&self, scope: &ScopeHash) {
        if let Ok(map) = self.by_scope.lock() {
            if let Some((notify, _)) = map.get(scope) {
                notify.notify_waiters();
            }
        }
    }

    /// How many claims wait now.
    pub fn len(&self) -> usize {
        self.total.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.waiters
            .total
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if let Ok(mut map) = self.waiters.by_scope.lock() {
            if let Some(entry) = map.get_mut(&self.scope) {
                entry.1 -= 1;
                if entry.1 == 0 {
                    map.remove(&self.scope);
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bounded_and_woken_by_a_settling_write() {
        let w = Waiters::new(2, Duration::from_millis(250));
        let a = w.enter([1; 32]).unwrap();
        let b = w.enter([1; 32]).unwrap();
        assert!(w.enter([2; 32]).is_none(), "over the bound");
        assert_eq!(w.len(), 2);
        let notify = Arc::clone(&a.notify);
        let woken = notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        w.settled(&[1; 32]);
        tokio::time::timeout(Duration::from_secs(1), woken)
            .await
            .unwrap();
        drop(a);
        drop(b);
        assert!(w.is_empty());
        assert!(w.by_scope.lock().unwrap().is_empty());
        assert!(w.enter([2; 32]).is_some());
    }
}
