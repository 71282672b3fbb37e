//! The plugin configuration's values checked, after [`Config::read`]: what each field may
//! hold, and what only the whole shows (leases, body limits, the worker's bounds).

use super::{
    err, Config, ConfigError, OnUnknown, Route, StateApi, SubjectSource, MAX_IN_FLIGHT_CACHE_MS,
    MAX_WAITERS,
};
use crate::headers;
use contract::limits;

/// A lease the state API grants, and a heartbeat at most half of it (a lease outlives a lost
/// heartbeat). `what` prefixes the field names (`routes[2].`).
fn check_lease(what: &str, lease_ms: u64, heartbeat_ms: u64) -> Result<(), ConfigError> {
    let dot = if what.is_empty() { "" } else { "." };
    if !(limits::MIN_LEASE_MS..=limits::MAX_LEASE_MS).contains(&lease_ms) {
        return err(format!(
            "{what}{dot}lease_ms must be {} to {} (the leases the state API grants)",
            limits::MIN_LEASE_MS,
            limits::MAX_LEASE_MS
        ));
    }
    if heartbeat_ms == 0 || heartbeat_ms.saturating_mul(2) > lease_ms {
        return err(format!("{what}{dot}heartbeat_ms must be > 0 and at most half of lease_ms (a lease outlives a lost heartbeat)"));
    }
    Ok(())
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

impl Config {
    /// Checks every value, always in the same order: the first fault found is the one named.
    /// Header names and methods are put in their canonical case on the way.
    pub(super) fn validate(&mut self) -> Result<(), ConfigError> {
        self.state_api.validate()?;
        self.subject.validate()?;
        if self.routes.is_empty() {
            return err("routes must not be empty");
        }
        for (i, r) in self.routes.iter_mut().enumerate() {
            r.validate(i)?;
        }
        self.validate_leases_and_bodies()?;
        self.validate_worker_bounds()?;
        self.validate_replay_extra_headers()
    }

    /// The leases and request body limits, global then each route's.
    fn validate_leases_and_bodies(&self) -> Result<(), ConfigError> {
        if self.max_request_body_bytes == 0 {
            return err("max_request_body_bytes must be > 0");
        }
        // The global lease first: a route without its own inherits it, and the field to name is
        // the global one.
        check_lease("", self.lease_ms, self.heartbeat_ms)?;
        for i in 0..self.routes.len() {
            let what = format!("routes[{i}]");
            check_lease(&what, self.lease_for(i), self.heartbeat_for(i))?;
            if self.max_request_body_for(i) == 0 {
                return err(format!("{what}.max_request_body_bytes must be > 0"));
            }
            if let Some(r) = self.routes.get(i) {
                if r.retention_s == Some(0) {
                    return err(format!("{what}.retention_s must be > 0"));
                }
                if r.max_wait_s.saturating_mul(1000) > limits::MAX_WAIT_MS {
                    return err(format!(
                        "{what}.max_wait_s must be at most {}",
                        limits::MAX_WAIT_MS / 1000
                    ));
                }
            }
        }
        Ok(())
    }

    /// What bounds the worker and what it sends: buffered and stored bodies, the namespace,
    /// waiters, batches, the in-flight memory and taken-over completes.
    fn validate_worker_bounds(&self) -> Result<(), ConfigError> {
        let largest_body = self.largest_request_body();
        if self.max_buffered_bytes() < largest_body {
            return err(format!(
                "max_buffered_bytes must be at least the largest request body a route accepts ({largest_body})"
            ));
        }
        let share = self.max_buffered_bytes_per_subject();
        if share < largest_body || share > self.max_buffered_bytes() {
            return err(format!(
                "max_buffered_bytes_per_subject must be at least the largest request body a route accepts ({largest_body}) and at most max_buffered_bytes ({})",
                self.max_buffered_bytes()
            ));
        }
        if self.max_stored_body_bytes == 0
            || self.max_stored_body_bytes > limits::MAX_STORED_BODY_BYTES
        {
            return err(format!(
                "max_stored_body_bytes must be > 0 and at most {} (the most a state API stores)",
                limits::MAX_STORED_BODY_BYTES
            ));
        }
        if let Some(p) = &self.key_state_path {
            let visible = p.bytes().all(|b| b.is_ascii_graphic());
            if !p.starts_with('/') || !visible || p.contains('?') || p.contains('#') {
                return err(
                    "key_state_path must be a path: starting with /, visible ASCII, no ? or #"
                        .to_owned(),
                );
            }
            let shadowed = self.routes.iter().any(|r| {
                r.method == "GET"
                    && (r.path.as_deref() == Some(p.as_str())
                        || r.prefix.as_deref().is_some_and(|pre| p.starts_with(pre)))
            });
            if shadowed {
                return err(format!(
                    "key_state_path {p} is also a GET route: a client could not tell its answers apart"
                ));
            }
        }
        if !limits::valid_namespace(&self.namespace) {
            return err(format!(
                "namespace must be at most {} of a-z 0-9 . _ -",
                limits::MAX_NAMESPACE_LEN
            ));
        }
        if self.max_waiters > MAX_WAITERS {
            return err(format!("max_waiters must be at most {MAX_WAITERS}"));
        }
        let most = contract::wire::MAX_BATCH_CLAIMS as u64;
        if !(1..=most).contains(&self.batch_max) {
            return err(format!("batch_max must be 1 to {most}"));
        }
        if self.in_flight_cache_ms > MAX_IN_FLIGHT_CACHE_MS {
            return err(format!(
                "in_flight_cache_ms must be at most {MAX_IN_FLIGHT_CACHE_MS}"
            ));
        }
        if self.complete_in_background && !self.retries_completes() {
            return err("complete_in_background needs complete_retry_ms and complete_retry_bytes above 0 (the worker stores the outcome)");
        }
        Ok(())
    }

    /// Extra replayed headers: header names, lower-cased, none that is never replayed.
    fn validate_replay_extra_headers(&mut self) -> Result<(), ConfigError> {
        for (i, h) in self.replay_extra_headers.iter_mut().enumerate() {
            *h = h.to_ascii_lowercase();
            if !is_token(h) {
                return err(format!("replay_extra_headers[{i}] must be a header name"));
            }
            if headers::never_replayed(h) {
                return err(format!("replay_extra_headers[{i}]: {h} is never replayed"));
            }
        }
        Ok(())
    }
}

impl StateApi {
    fn validate(&self) -> Result<(), ConfigError> {
        let s = self;
        if s.cluster.is_empty() {
            return err("state_api.cluster must not be empty");
        }
        if s.wait_cluster.as_ref().is_some_and(String::is_empty) {
            return err("state_api.wait_cluster must not be empty (leave it out to use `cluster`)");
        }
        if s.authority.is_empty() || s.authority.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return err("state_api.authority must be a non-empty host[:port]");
        }
        if s.token.is_empty() || s.token.bytes().any(|b| !(0x20..=0x7e).contains(&b)) {
            return err("state_api.token must be non-empty visible ASCII");
        }
        if s.timeout_ms == 0 {
            return err("state_api.timeout_ms must be > 0 (0 would mean no timeout)");
        }
        if s.timeout_ms > u64::from(u32::MAX) {
            return err("state_api.timeout_ms is too large");
        }
        Ok(())
    }
}

impl SubjectSource {
    fn validate(&mut self) -> Result<(), ConfigError> {
        match self {
            SubjectSource::Header(h) => {
                *h = h.to_ascii_lowercase();
                if !is_token(h) {
                    return err("subject.header must be a header name");
                }
            }
            SubjectSource::Metadata(path) => {
                if path.len() < 2 {
                    return err(
                        "subject.metadata must be [filter namespace, key, ...]: at least two parts",
                    );
                }
                if let Some(i) = path.iter().position(String::is_empty) {
                    return err(format!("subject.metadata[{i}] must not be empty"));
                }
            }
        }
        Ok(())
    }
}

impl Route {
    /// Route `i`'s method, path or prefix, and reconcile endpoint (method upper-cased).
    fn validate(&mut self, i: usize) -> Result<(), ConfigError> {
        let r = self;
        if !is_token(&r.method) {
            return err(format!("routes[{i}].method must be an HTTP method"));
        }
        r.method = r.method.to_ascii_uppercase();
        match (&r.path, &r.prefix) {
            (Some(p), None) | (None, Some(p)) => {
                let name = if r.path.is_some() { "path" } else { "prefix" };
                if !p.starts_with('/') || p.contains('?') || p.contains('#') {
                    return err(format!(
                        "routes[{i}].{name} must start with '/' and have no query or fragment"
                    ));
                }
            }
            _ => return err(format!("routes[{i}] needs exactly one of path or prefix")),
        }
        match (r.on_unknown, &mut r.reconcile) {
            (OnUnknown::Reconcile, Some(rc)) => {
                if rc.cluster.is_empty() {
                    return err(format!("routes[{i}].reconcile.cluster must not be empty"));
                }
                if rc.authority.is_empty() {
                    return err(format!("routes[{i}].reconcile.authority must not be empty"));
                }
                if !is_token(&rc.method) {
                    return err(format!(
                        "routes[{i}].reconcile.method must be an HTTP method"
                    ));
                }
                rc.method = rc.method.to_ascii_uppercase();
                if !rc.path.starts_with('/') || !rc.path.contains("{key}") {
                    return err(format!(
                        "routes[{i}].reconcile.path must start with '/' and hold {{key}}"
                    ));
                }
                if rc.timeout_ms == 0 || rc.timeout_ms > u64::from(u32::MAX) {
                    return err(format!("routes[{i}].reconcile.timeout_ms must be > 0"));
                }
            }
            (OnUnknown::Reconcile, None) => {
                return err(format!(
                    "routes[{i}]: on_unknown \"reconcile\" needs a reconcile endpoint"
                ))
            }
            (_, Some(_)) => {
                return err(format!(
                    "routes[{i}].reconcile is only used with on_unknown \"reconcile\""
                ))
            }
            (_, None) => {}
        }
        Ok(())
    }
}
