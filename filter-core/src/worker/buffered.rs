//! The request body bytes a worker's streams hold before forwarding (each stream's
//! [`Flow::held_request_bytes`]): in all, bounded by `max_buffered_bytes`, and by subject, each
//! bounded by `max_buffered_bytes_per_subject`, so that one caller's unfinished bodies cannot
//! take the whole bound.

use std::collections::HashMap;

use crate::config::Config;
use crate::flow::{Flow, Room};

pub(super) struct Buffered {
    /// The sum over the streams counted in.
    total: u64,
    /// Of `total`, each subject's streams' (no entry: none).
    by_subject: HashMap<String, u64>,
    /// [`Config::max_buffered_bytes`], computed once.
    max: u64,
    /// [`Config::max_buffered_bytes_per_subject`], computed once.
    share: u64,
    /// [`Config::buffer_reserve`], computed once.
    reserve: u64,
}

impl Buffered {
    pub(super) fn new(cfg: &Config) -> Self {
        Self {
            total: 0,
            by_subject: HashMap::new(),
            max: cfg.max_buffered_bytes(),
            share: cfg.max_buffered_bytes_per_subject(),
            reserve: cfg.buffer_reserve(),
        }
    }

    pub(super) fn total(&self) -> u64 {
        self.total
    }

    /// What a stream not counted in (a new one, or one taken out for an event) may still hold.
    pub(super) fn room(&self) -> Room<'_> {
        Room {
            worker: self.max.saturating_sub(self.total),
            reserve: self.reserve,
            share: self.share,
            held_by_subject: &self.by_subject,
        }
    }

    /// Counts `flow`'s bytes in (after an event, or its headers).
    pub(super) fn put(&mut self, flow: &Flow) {
        let held = flow.held_request_bytes();
        self.total += held;
        if let Some(subject) = flow.buffering_subject().filter(|_| held > 0) {
            match self.by_subject.get_mut(subject) {
                Some(count) => *count += held,
                None => {
                    self.by_subject.insert(subject.to_owned(), held);
                }
            }
        }
    }

    /// Takes `flow`'s bytes out (before an event changes them, or at its end); a subject whose
    /// count reaches nothing goes.
    pub(super) fn take(&mut self, flow: &Flow) {
        let held = flow.held_request_bytes();
        self.total = self.total.saturating_sub(held);
        let Some(subject) = flow.buffering_subject() else {
            return;
        };
        if let Some(count) = self.by_subject.get_mut(subject) {
            *count = count.saturating_sub(held);
            if *count == 0 {
                self.by_subject.remove(subject);
            }
        }
    }
}
