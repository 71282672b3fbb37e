//! The plugin configuration's own JSON reader: each field by name, unknown ones refused,
//! `null` no value; [`Config::validate`] checks the values after it.

use super::{
    default_batch_max, default_complete_retry_bytes, default_complete_retry_ms,
    default_heartbeat_ms, default_in_flight_cache_ms, default_lease_ms, default_max_body,
    default_max_wait_s, default_max_waiters, default_reconcile_method, default_replay_cache_bytes,
    default_replay_cache_ttl_ms, default_timeout_ms, Config, KeyPolicy, On5xx, OnStateUnavailable,
    OnUnknown, Pointer, Reconcile, Route, Selection, StateApi, SubjectSource,
};
use contract::json::{Fields, Value};

const CONFIG_FIELDS: &[&str] = &[
    "state_api",
    "subject",
    "routes",
    "max_request_body_bytes",
    "max_stored_body_bytes",
    "lease_ms",
    "heartbeat_ms",
    "replay_extra_headers",
    "replay_cache_bytes",
    "replay_cache_ttl_ms",
    "in_flight_cache_ms",
    "complete_retry_ms",
    "complete_retry_bytes",
    "complete_in_background",
    "namespace",
    "max_waiters",
    "batch_max",
    "max_buffered_bytes",
    "max_buffered_bytes_per_subject",
    "key_state_path",
];
const STATE_API_FIELDS: &[&str] = &[
    "cluster",
    "wait_cluster",
    "authority",
    "token",
    "timeout_ms",
];
const ROUTE_FIELDS: &[&str] = &[
    "method",
    "path",
    "prefix",
    "key",
    "on_5xx",
    "on_state_unavailable",
    "on_unknown",
    "reconcile",
    "lease_ms",
    "heartbeat_ms",
    "max_request_body_bytes",
    "retention_s",
    "max_wait_s",
    "fingerprint",
    "key_from",
];
const RECONCILE_FIELDS: &[&str] = &["cluster", "authority", "method", "path", "timeout_ms"];

impl Config {
    /// The configuration as written, before [`Config::validate`].
    pub(super) fn read(doc: &Value) -> Result<Self, String> {
        refuse_null(doc, "")?;
        let top = Fields::of(doc, "")?;
        top.deny_unknown(CONFIG_FIELDS)?;
        let s = Fields::of(top.required("state_api")?, "state_api")?;
        s.deny_unknown(STATE_API_FIELDS)?;
        let state_api = StateApi {
            cluster: s.str("cluster")?.to_owned(),
            wait_cluster: s.opt_str("wait_cluster")?.map(str::to_owned),
            authority: s.str("authority")?.to_owned(),
            token: s.str("token")?.to_owned(),
            timeout_ms: s.u64_or("timeout_ms", default_timeout_ms())?,
        };
        let subject = Fields::of(top.required("subject")?, "subject")?;
        subject.deny_unknown(&["header", "metadata"])?;
        let subject = match (subject.get("header"), subject.get("metadata")) {
            (Some(_), None) => SubjectSource::Header(subject.str("header")?.to_owned()),
            (None, Some(_)) => SubjectSource::Metadata(subject.strings("metadata")?),
            _ => return Err("subject must have exactly one of `header` or `metadata`".to_owned()),
        };
        let routes = match top.required("routes")? {
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, v)| Route::read(v, &format!("routes[{i}]")))
                .collect::<Result<Vec<_>, _>>()?,
            other => return Err(format!("routes must be an array, not {}", other.kind())),
        };
        Ok(Self {
            state_api,
            subject,
            routes,
            max_request_body_bytes: top.u64_or("max_request_body_bytes", default_max_body())?,
            max_stored_body_bytes: top.u64_or("max_stored_body_bytes", default_max_body())?,
            lease_ms: top.u64_or("lease_ms", default_lease_ms())?,
            heartbeat_ms: top.u64_or("heartbeat_ms", default_heartbeat_ms())?,
            replay_extra_headers: top.strings("replay_extra_headers")?,
            replay_cache_bytes: top.u64_or("replay_cache_bytes", default_replay_cache_bytes())?,
            replay_cache_ttl_ms: top
                .u64_or("replay_cache_ttl_ms", default_replay_cache_ttl_ms())?,
            in_flight_cache_ms: top.u64_or("in_flight_cache_ms", default_in_flight_cache_ms())?,
            complete_retry_ms: top.u64_or("complete_retry_ms", default_complete_retry_ms())?,
            complete_retry_bytes: top
                .u64_or("complete_retry_bytes", default_complete_retry_bytes())?,
            complete_in_background: top.bool_or("complete_in_background", false)?,
            namespace: top.opt_str("namespace")?.unwrap_or("").to_owned(),
            max_waiters: top.u64_or("max_waiters", default_max_waiters())?,
            batch_max: top.u64_or("batch_max", default_batch_max())?,
            max_buffered_bytes: top.opt_u64("max_buffered_bytes")?,
            max_buffered_bytes_per_subject: top.opt_u64("max_buffered_bytes_per_subject")?,
            key_state_path: top.opt_str("key_state_path")?.map(str::to_owned),
        })
    }
}

/// A route's `fingerprint`: exactly one of `ignore` or `include`, a non-empty list of pointers.
fn read_fingerprint(v: &Value, what: &str) -> Result<Selection, String> {
    let f = Fields::of(v, what)?;
    f.deny_unknown(&["ignore", "include"])?;
    let (name, selection): (&str, fn(Vec<Pointer>) -> Selection) =
        match (f.get("ignore"), f.get("include")) {
            (Some(_), None) => ("ignore", Selection::Ignore),
            (None, Some(_)) => ("include", Selection::Include),
            _ => return Err(format!("{what} needs exactly one of ignore or include")),
        };
    let texts = f.strings(name)?;
    if texts.is_empty() {
        return Err(format!(
            "{}: the list must not be empty (exactly one non-empty list: ignore or include)",
            f.path(name)
        ));
    }
    texts
        .iter()
        .enumerate()
        .map(|(i, p)| Pointer::parse(p).map_err(|e| format!("{}[{i}]: {e}", f.path(name))))
        .collect::<Result<Vec<_>, _>>()
        .map(selection)
}

/// `null` is no value here (the JSON Schema says so too): a field is given or left out.
fn refuse_null(v: &Value, path: &str) -> Result<(), String> {
    match v {
        Value::Null if path.is_empty() => Err("the document is null".to_owned()),
        Value::Null => Err(format!(
            "{path} is null: give it a value, or leave it out for its default"
        )),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| refuse_null(item, &format!("{path}[{i}]"))),
        Value::Object(members) => members.iter().try_for_each(|(name, member)| {
            let dot = if path.is_empty() { "" } else { "." };
            refuse_null(member, &format!("{path}{dot}{name}"))
        }),
        _ => Ok(()),
    }
}

impl Route {
    fn read(v: &Value, what: &str) -> Result<Self, String> {
        let r = Fields::of(v, what)?;
        r.deny_unknown(ROUTE_FIELDS)?;
        Ok(Self {
            method: r.str("method")?.to_owned(),
            path: r.opt_str("path")?.map(str::to_owned),
            prefix: r.opt_str("prefix")?.map(str::to_owned),
            key: r.variant(
                "key",
                &[
                    ("required", KeyPolicy::Required),
                    ("optional", KeyPolicy::Optional),
                ],
                None,
            )?,
            on_5xx: r.variant(
                "on_5xx",
                &[("store", On5xx::Store), ("release", On5xx::Release)],
                Some(On5xx::Store),
            )?,
            on_state_unavailable: r.variant(
                "on_state_unavailable",
                &[
                    ("fail_closed", OnStateUnavailable::FailClosed),
                    ("fail_open", OnStateUnavailable::FailOpen),
                ],
                Some(OnStateUnavailable::FailClosed),
            )?,
            on_unknown: r.variant(
                "on_unknown",
                &[
                    ("hold", OnUnknown::Hold),
                    ("reconcile", OnUnknown::Reconcile),
                    ("reexecute", OnUnknown::Reexecute),
                ],
                Some(OnUnknown::Hold),
            )?,
            reconcile: match r.get("reconcile") {
                None => None,
                Some(v) => {
                    let what = format!("{what}.reconcile");
                    let f = Fields::of(v, &what)?;
                    f.deny_unknown(RECONCILE_FIELDS)?;
                    Some(Reconcile {
                        cluster: f.str("cluster")?.to_owned(),
                        authority: f.str("authority")?.to_owned(),
                        method: f
                            .opt_str("method")?
                            .map_or_else(default_reconcile_method, str::to_owned),
                        path: f.str("path")?.to_owned(),
                        timeout_ms: f.u64_or("timeout_ms", default_timeout_ms())?,
                    })
                }
            },
            lease_ms: r.opt_u64("lease_ms")?,
            heartbeat_ms: r.opt_u64("heartbeat_ms")?,
            max_request_body_bytes: r.opt_u64("max_request_body_bytes")?,
            retention_s: r.opt_u64("retention_s")?,
            max_wait_s: r.u64_or("max_wait_s", default_max_wait_s())?,
            fingerprint: match r.get("fingerprint") {
                None => Selection::Whole,
                Some(v) => read_fingerprint(v, &format!("{what}.fingerprint"))?,
            },
            key_from: match r.opt_str("key_from")? {
                None => None,
                Some(p) => Some(Pointer::parse(p).map_err(|e| format!("{what}.key_from: {e}"))?),
            },
        })
    }
}
