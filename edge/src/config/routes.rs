//! `[filter]` and `[[route]]`: the filter's options and the protected routes, with the lease and
//! heartbeat each gets.

use filter_core::config as fc;
use toml::Spanned;

use super::raw::*;
use super::source::{is_header_name, is_token, Source};
use super::*;

/// A lease the state API grants and a heartbeat that comes at least twice within it.
fn check_lease(
    src: &Source<'_>,
    lease: (u64, std::ops::Range<usize>),
    heartbeat: (u64, std::ops::Range<usize>),
    what: &str,
) -> Result<(), ConfigError> {
    if !(contract::limits::MIN_LEASE_MS..=contract::limits::MAX_LEASE_MS).contains(&lease.0) {
        return src.at(
            lease.1,
            format!(
                "{what}lease_ms must be {} to {} (what the state API grants)",
                contract::limits::MIN_LEASE_MS,
                contract::limits::MAX_LEASE_MS
            ),
        );
    }
    if heartbeat.0 == 0 || heartbeat.0.saturating_mul(2) > lease.0 {
        return src.at(
            heartbeat.1,
            format!(
                "{what}lease_ms ({} ms) is shorter than two heartbeats ({what}heartbeat_ms {} ms): one lost heartbeat would let it run out",
                lease.0, heartbeat.0
            ),
        );
    }
    Ok(())
}

pub(super) fn filter(src: &Source<'_>, raw: &RawFilter) -> Result<Filter, ConfigError> {
    let d = Filter::default();
    let val = |v: &Option<Spanned<u64>>, default: u64| v.as_ref().map_or(default, |s| *s.get_ref());
    let span = |v: &Option<Spanned<u64>>| v.as_ref().map_or(0..0, Spanned::span);
    let f = Filter {
        lease_ms: val(&raw.lease_ms, d.lease_ms),
        heartbeat_ms: val(&raw.heartbeat_ms, d.heartbeat_ms),
        max_request_body_bytes: val(&raw.max_request_body_bytes, d.max_request_body_bytes),
        max_stored_body_bytes: val(&raw.max_stored_body_bytes, d.max_stored_body_bytes),
        replay_extra_headers: raw
            .replay_extra_headers
            .as_ref()
            .map(|h| h.get_ref().iter().map(|n| n.to_ascii_lowercase()).collect())
            .unwrap_or_default(),
        replay_cache_bytes: raw.replay_cache_bytes.unwrap_or(d.replay_cache_bytes),
        replay_cache_ttl_ms: raw.replay_cache_ttl_ms.unwrap_or(d.replay_cache_ttl_ms),
        in_flight_cache_ms: val(&raw.in_flight_cache_ms, d.in_flight_cache_ms),
        complete_retry_ms: raw.complete_retry_ms.unwrap_or(d.complete_retry_ms),
        complete_retry_bytes: raw.complete_retry_bytes.unwrap_or(d.complete_retry_bytes),
        complete_in_background: raw
            .complete_in_background
            .as_ref()
            .is_some_and(|b| *b.get_ref()),
        max_waiters: val(&raw.max_waiters, d.max_waiters),
        batch_max: val(&raw.batch_max, d.batch_max),
        // Checked against the routes' bodies by the filter's own parse of the rendered file.
        max_buffered_bytes: raw.max_buffered_bytes.as_ref().map(|v| *v.get_ref()),
        max_buffered_bytes_per_subject: raw
            .max_buffered_bytes_per_subject
            .as_ref()
            .map(|v| *v.get_ref()),
        key_state_path: raw.key_state_path.as_ref().map(|v| v.get_ref().clone()),
    };
    if let (Some(path), Some(raw_path)) = (&f.key_state_path, &raw.key_state_path) {
        let visible = path.bytes().all(|b| b.is_ascii_graphic());
        if !path.starts_with('/') || !visible || path.contains('?') || path.contains('#') {
            return src.at(
                raw_path.span(),
                "filter.key_state_path must be a path: starting with /, visible ASCII, no ? or #",
            );
        }
    }
    let most_batched = contract::wire::MAX_BATCH_CLAIMS as u64;
    if !(1..=most_batched).contains(&f.batch_max) {
        return src.at(
            span(&raw.batch_max),
            format!("filter.batch_max must be 1 to {most_batched}"),
        );
    }
    if f.max_waiters > fc::MAX_WAITERS {
        return src.at(
            span(&raw.max_waiters),
            format!("filter.max_waiters must be at most {}", fc::MAX_WAITERS),
        );
    }
    let lease_span = raw
        .lease_ms
        .as_ref()
        .or(raw.heartbeat_ms.as_ref())
        .map_or(0..0, Spanned::span);
    let hb_span = raw
        .heartbeat_ms
        .as_ref()
        .or(raw.lease_ms.as_ref())
        .map_or(0..0, Spanned::span);
    check_lease(
        src,
        (f.lease_ms, lease_span),
        (f.heartbeat_ms, hb_span),
        "filter.",
    )?;
    if f.max_request_body_bytes == 0 {
        return src.at(
            span(&raw.max_request_body_bytes),
            "filter.max_request_body_bytes must be > 0",
        );
    }
    if f.max_stored_body_bytes == 0
        || f.max_stored_body_bytes > contract::limits::MAX_STORED_BODY_BYTES
    {
        return src.at(
            span(&raw.max_stored_body_bytes),
            format!(
                "filter.max_stored_body_bytes must be 1 to {} (the most the state API stores)",
                contract::limits::MAX_STORED_BODY_BYTES
            ),
        );
    }
    if f.in_flight_cache_ms > fc::MAX_IN_FLIGHT_CACHE_MS {
        return src.at(
            span(&raw.in_flight_cache_ms),
            format!(
                "filter.in_flight_cache_ms must be at most {}",
                fc::MAX_IN_FLIGHT_CACHE_MS
            ),
        );
    }
    if let Some(h) = &raw.replay_extra_headers {
        if let Some(bad) = f
            .replay_extra_headers
            .iter()
            .find(|n| !is_header_name(n) || filter_core::headers::never_replayed(n))
        {
            return src.at(
                h.span(),
                format!(
                    "filter.replay_extra_headers: {bad:?} is not a header that can be replayed"
                ),
            );
        }
    }
    if f.complete_in_background && (f.complete_retry_ms == 0 || f.complete_retry_bytes == 0) {
        let at = raw
            .complete_in_background
            .as_ref()
            .map_or(0..0, Spanned::span);
        return src.at(at, "filter.complete_in_background needs complete_retry_ms and complete_retry_bytes above 0");
    }
    Ok(f)
}

pub(super) fn route(
    src: &Source<'_>,
    raw: &Spanned<RawRoute>,
    filter: &Filter,
) -> Result<Route, ConfigError> {
    let r = raw.get_ref();
    let method = r.method.get_ref().to_ascii_uppercase();
    if !is_token(&method) {
        return src.at(r.method.span(), "route.method must be an HTTP method");
    }
    let matcher = route_matcher(src, raw)?;
    let lease = r.lease_ms.as_ref().map(|l| *l.get_ref());
    let heartbeat = r.heartbeat_ms.as_ref().map(|h| *h.get_ref());
    if lease.is_some() || heartbeat.is_some() {
        let lease_span = r
            .lease_ms
            .as_ref()
            .or(r.heartbeat_ms.as_ref())
            .map_or(0..0, Spanned::span);
        let hb_span = r
            .heartbeat_ms
            .as_ref()
            .or(r.lease_ms.as_ref())
            .map_or(0..0, Spanned::span);
        check_lease(
            src,
            (lease.unwrap_or(filter.lease_ms), lease_span),
            (heartbeat.unwrap_or(filter.heartbeat_ms), hb_span),
            "route.",
        )?;
    }
    let max_body = match &r.max_request_body_bytes {
        Some(m) if *m.get_ref() == 0 => {
            return src.at(m.span(), "route.max_request_body_bytes must be > 0")
        }
        m => m.as_ref().map(|m| *m.get_ref()),
    };
    let retention_s = match &r.retention_s {
        Some(v) if *v.get_ref() == 0 => return src.at(v.span(), "route.retention_s must be > 0"),
        v => v.as_ref().map(|v| *v.get_ref()),
    };
    let max_wait_s = match &r.max_wait_s {
        Some(v) if v.get_ref().saturating_mul(1000) > contract::limits::MAX_WAIT_MS => {
            return src.at(
                v.span(),
                format!(
                    "route.max_wait_s must be at most {}",
                    contract::limits::MAX_WAIT_MS / 1000
                ),
            )
        }
        Some(v) => *v.get_ref(),
        None => fc::DEFAULT_MAX_WAIT_S,
    };
    let fingerprint = fingerprint(src, raw)?;
    let key_from = match &r.key_from {
        Some(k) => Some(
            fc::Pointer::parse(k.get_ref())
                .or_else(|e| src.at(k.span(), format!("route.key_from: {e}")))?,
        ),
        None => None,
    };
    let (on_unknown, reconcile) = on_unknown(src, raw)?;
    Ok(Route {
        method,
        matcher,
        key: match r.key {
            RawKey::Required => KeyPolicy::Required,
            RawKey::Optional => KeyPolicy::Optional,
        },
        on_5xx: match r.on_5xx {
            None | Some(RawOn5xx::Store) => On5xx::Store,
            Some(RawOn5xx::Release) => On5xx::Release,
        },
        on_state_unavailable: match r.on_state_unavailable {
            None | Some(RawOnStateUnavailable::FailClosed) => OnStateUnavailable::FailClosed,
            Some(RawOnStateUnavailable::FailOpen) => OnStateUnavailable::FailOpen,
        },
        on_unknown,
        reconcile,
        lease_ms: lease,
        heartbeat_ms: heartbeat,
        max_request_body_bytes: max_body,
        retention_s,
        max_wait_s,
        fingerprint,
        key_from,
    })
}

/// `path` or `prefix`, exactly one.
fn route_matcher(src: &Source<'_>, raw: &Spanned<RawRoute>) -> Result<Match, ConfigError> {
    let r = raw.get_ref();
    match (&r.path, &r.prefix) {
        (Some(p), None) => Ok(Match::Path(route_path(src, p, "path")?)),
        (None, Some(p)) => Ok(Match::Prefix(route_path(src, p, "prefix")?)),
        (Some(_), Some(p)) => src.at(p.span(), "a route has either path or prefix, not both"),
        (None, None) => src.at(
            raw.span(),
            "a route needs path = \"...\" or prefix = \"...\"",
        ),
    }
}

/// What of a JSON body the fingerprint covers: the whole, or one non-empty list of pointers.
fn fingerprint(src: &Source<'_>, raw: &Spanned<RawRoute>) -> Result<fc::Selection, ConfigError> {
    let r = raw.get_ref();
    let pointers = |list: &[String], name: &str| -> Result<Vec<fc::Pointer>, ConfigError> {
        list.iter()
            .map(|p| {
                fc::Pointer::parse(p).or_else(|e| {
                    let at = r.fingerprint.as_ref().map_or(raw.span(), Spanned::span);
                    src.at(at, format!("route.fingerprint.{name}: {e}"))
                })
            })
            .collect()
    };
    Ok(match r.fingerprint.as_ref().map(|f| (f.get_ref(), f.span())) {
        None => fc::Selection::Whole,
        Some((RawFingerprint { ignore: Some(l), include: None }, _)) if !l.is_empty() => {
            fc::Selection::Ignore(pointers(l, "ignore")?)
        }
        Some((RawFingerprint { ignore: None, include: Some(l) }, _)) if !l.is_empty() => {
            fc::Selection::Include(pointers(l, "include")?)
        }
        Some((_, at)) => {
            return src.at(
                at,
                "route.fingerprint needs exactly one non-empty list: { ignore = [\"/pointer\", ...] } or { include = [...] }",
            )
        }
    })
}

/// `on_unknown`, and the `reconcile` endpoint that goes with `"reconcile"` (and only with it).
fn on_unknown(
    src: &Source<'_>,
    raw: &Spanned<RawRoute>,
) -> Result<(OnUnknown, Option<Reconcile>), ConfigError> {
    let r = raw.get_ref();
    let on_unknown = match r.on_unknown.as_ref().map(|o| *o.get_ref()) {
        None | Some(RawOnUnknown::Hold) => OnUnknown::Hold,
        Some(RawOnUnknown::Reconcile) => OnUnknown::Reconcile,
        Some(RawOnUnknown::Reexecute) => OnUnknown::Reexecute,
    };
    let reconcile = match (&r.reconcile, on_unknown) {
        (Some(rc), OnUnknown::Reconcile) => Some(reconcile(src, rc)?),
        (None, OnUnknown::Reconcile) => {
            let at = r.on_unknown.as_ref().map_or(raw.span(), Spanned::span);
            return src.at(at, "on_unknown = \"reconcile\" needs reconcile = { path = \"/.../{key}\" }: where the upstream tells what became of a key");
        }
        (Some(rc), _) => {
            return src.at(
                rc.span(),
                "reconcile is only used with on_unknown = \"reconcile\"",
            )
        }
        (None, _) => None,
    };
    Ok((on_unknown, reconcile))
}

fn route_path(src: &Source<'_>, p: &Spanned<String>, name: &str) -> Result<String, ConfigError> {
    let v = p.get_ref();
    if !v.starts_with('/') || v.contains(['?', '#', ' ']) || v.bytes().any(|b| b.is_ascii_control())
    {
        return src.at(
            p.span(),
            format!("route.{name} must start with '/' and hold no query, fragment or space"),
        );
    }
    if v.len() > contract::limits::MAX_FIELD_LEN - 16 {
        return src.at(
            p.span(),
            format!("route.{name} is longer than the state API's endpoint limit"),
        );
    }
    Ok(v.clone())
}

fn reconcile(src: &Source<'_>, raw: &Spanned<RawReconcile>) -> Result<Reconcile, ConfigError> {
    let rc = raw.get_ref();
    let path = rc.path.get_ref();
    if !path.starts_with('/') || !path.contains("{key}") {
        return src.at(
            rc.path.span(),
            "reconcile.path must start with '/' and hold {key} (where the key goes)",
        );
    }
    let method = match &rc.method {
        Some(m) if !is_token(&m.get_ref().to_ascii_uppercase()) => {
            return src.at(m.span(), "reconcile.method must be an HTTP method")
        }
        Some(m) => m.get_ref().to_ascii_uppercase(),
        None => "GET".to_owned(),
    };
    let upstream = match &rc.upstream {
        Some(u) => Some(
            Endpoint::parse(u.get_ref())
                .or_else(|e| src.at(u.span(), format!("reconcile.upstream: {e}")))?,
        ),
        None => None,
    };
    let timeout_ms = match &rc.timeout_ms {
        Some(t) if *t.get_ref() == 0 || *t.get_ref() > 60_000 => {
            return src.at(t.span(), "reconcile.timeout_ms must be 1 to 60000")
        }
        Some(t) => *t.get_ref(),
        None => fc::DEFAULT_TIMEOUT_MS,
    };
    Ok(Reconcile {
        method,
        path: path.clone(),
        upstream,
        timeout_ms,
    })
}
