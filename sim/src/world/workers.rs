//! The Envoy workers' lives: a worker VM made as the glue configures it, its ticks and wakes,
//! its death (memory gone, streams vanished, callouts orphaned) and its restart.

use super::{Current, World};
use crate::state_api::Scope;
use filter_core::config::Config;
use filter_core::flow::Verdict;
use filter_core::worker::{StreamId, Worker};

#[derive(Debug)]
pub struct SimWorker {
    pub w: Option<Worker>,
    /// When it last ticked in quiet time (one tick per instant).
    pub ticked_at: Option<u64>,
    pub generation: u32,
    /// How far its wall clock is from the global one (skewed, and stepped either way by the
    /// `skew` fault). The worker does not read it: the glue gives the worker the host's
    /// monotonic clock (the fix of issue 34's path 6), modelled by `steady_ms`.
    pub skew_ms: i64,
    /// Where this life's monotonic clock starts: the worker's time is the global time plus it.
    pub steady_ms: u64,
    pub wake_requested: bool,
    pub next_sid: StreamId,
}

/// Where the monotonic clock of worker `index`'s life `generation` starts (any origin will do:
/// the worker only ever compares its own readings).
pub(super) fn steady_origin(index: usize, generation: u32) -> u64 {
    5_000_000 * (index as u64 + 1) + 1_000 * u64::from(generation)
}

/// A worker VM as the glue configures it: named for its claim nonces, uniquely among the
/// workers and their restarts (the glue uses its clock at configuration and root context).
pub(super) fn new_worker(cfg: &Config, index: usize, generation: u32) -> Worker {
    let mut w = Worker::new(cfg.clone());
    w.set_instance(&format!("w{index}g{generation}"));
    w
}

impl World {
    pub(super) fn tick(&mut self, w: usize) {
        let now = self.worker_now(w);
        if let Some(effects) = self.call(w, |wk| Some(wk.on_tick(now))).flatten() {
            self.perform(w, Current::Root(w), Verdict::Continue, effects);
        }
    }

    pub(super) fn wake(&mut self, w: usize) {
        self.workers[w].wake_requested = false;
        let now = self.worker_now(w);
        if let Some(effects) = self.call(w, |wk| Some(wk.on_wake(now))).flatten() {
            self.perform(w, Current::Root(w), Verdict::Continue, effects);
        }
    }

    /// The wake worker `w` asked for is lost (Envoy could not enqueue it): only its next tick
    /// comes.
    pub(crate) fn lose_wake(&mut self, w: usize) {
        self.reach("sim.wake_lost");
        let deferred = self.workers[w]
            .w
            .as_ref()
            .is_some_and(|wk| wk.usage().deferred_replies > 0);
        if deferred {
            self.reach("region: a wake lost while replies waited for it");
        }
        self.log(format!("worker {w}: its wake is lost"));
        self.workers[w].wake_requested = false;
    }

    /// Envoy is killed: its memory is gone, its streams vanish without `on_done`, its callouts'
    /// answers go nowhere (the calls may still reach the state API).
    pub(super) fn kill(&mut self, w: usize) {
        self.reach("sim.worker_killed");
        self.log(format!("worker {w} is killed"));
        let generation = self.workers[w].generation;
        let open: Vec<Scope> = self
            .ev
            .granted_to
            .iter()
            .filter(|(_, at)| **at == (w, generation))
            .filter_map(|(t, _)| {
                let scope = self.api.issued.get(t)?;
                let (_, rec) = self.api.find(scope)?;
                (rec.token == *t && rec.open()).then(|| scope.clone())
            })
            .collect();
        self.ev.grant_died.extend(open);
        self.workers[w].w = None;
        self.workers[w].wake_requested = false;
        for s in 0..self.streams.len() {
            if self.streams[s].worker == w && !self.streams[s].ended {
                self.streams[s].ended = true;
                let op = self.streams[s].op;
                if self.ops[op].active == Some(s) {
                    self.ops[op].active = None;
                    self.ops[op].next_at = self.now;
                }
            }
        }
        for c in self.callouts.iter_mut() {
            if c.worker == w && !c.orphan {
                c.orphan = true;
                c.orphaned_by = "its worker died";
            }
        }
    }

    pub(super) fn restart(&mut self, w: usize) {
        self.workers[w].generation += 1;
        self.workers[w].next_sid = 0;
        self.workers[w].steady_ms = steady_origin(w, self.workers[w].generation);
        self.workers[w].w = Some(new_worker(&self.cfg, w, self.workers[w].generation));
        self.log(format!("worker {w} starts again"));
    }
}
