//! Summaries for people (`--json` prints the admin API's answer as it is).

use contract::admin::{AdminActionResult, AdminRecord, AuditEntry, ListedRecord};
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

fn span(ms: u64) -> String {
    // Whole seconds read better than "1h 2m 3s 456ms".
    humantime::format_duration(Duration::from_secs(ms / 1000)).to_string()
}

/// The wall-clock time `ms` from now (this machine's clock; the state API counts by the
/// database's).
fn at(ms: u64) -> String {
    let when = SystemTime::now() + Duration::from_millis(ms);
    humantime::format_rfc3339_seconds(when).to_string()
}

pub fn record(r: &AdminRecord) -> String {
    let mut out = String::new();
    let ns = if r.namespace.is_empty() {
        String::new()
    } else {
        format!(" (namespace {})", r.namespace)
    };
    let _ = writeln!(out, "record {}{ns}", r.scope);
    match &r.record {
        None => {
            let _ = writeln!(out, "  no record (released or purged); its audit trail:");
        }
        Some(v) => {
            let _ = writeln!(out, "  state        {}", v.state.as_str());
            let _ = writeln!(out, "  subject      {}", v.subject);
            let _ = writeln!(out, "  endpoint     {}", v.endpoint);
            let _ = writeln!(out, "  token        {}", v.token);
            let _ = writeln!(out, "  fingerprint  {}", v.fingerprint_alg);
            let _ = writeln!(out, "  age          {}", span(v.age_ms));
            if v.state == contract::wire::RecordState::InProgress {
                let lease = if v.lease_remaining_ms == 0 {
                    "run out (its outcome is unknown)".to_owned()
                } else {
                    format!("{} left", span(v.lease_remaining_ms))
                };
                let _ = writeln!(out, "  lease        {lease}");
            }
            if let Some(ago) = v.owner_seen_ms_ago {
                let within = if ago < v.lease_ms {
                    " (within its lease: its request may still run; an action needs --force)"
                } else {
                    ""
                };
                let _ = writeln!(out, "  owner seen   {} ago{within}", span(ago));
            }
            if let Some(status) = v.response_status {
                let replay = match v.replayable {
                    Some(false) => " (not replayable)",
                    _ => "",
                };
                let _ = writeln!(out, "  response     {status}{replay}");
            }
            let _ = writeln!(
                out,
                "  expires      in {} (about {})",
                span(v.expires_in_ms),
                at(v.expires_in_ms)
            );
        }
    }
    if let Some(b) = &r.body_base64 {
        let _ = writeln!(out, "  body_base64  {b}");
    }
    if r.audit.is_empty() {
        let _ = writeln!(out, "  audit        none");
    }
    for a in &r.audit {
        out.push_str(&audit(a));
    }
    out
}

fn audit(a: &AuditEntry) -> String {
    let forced = if a.forced { " (forced)" } else { "" };
    let state = |v: &Option<serde_json::Value>| {
        v.as_ref()
            .and_then(|v| v["state"].as_str().map(str::to_owned))
            .unwrap_or_else(|| "-".into())
    };
    format!(
        "  audit #{}     {} {} by {}{forced}: {} -> {}; reason: {}\n",
        a.id,
        a.at,
        a.action,
        a.actor,
        state(&a.before),
        state(&a.after),
        a.reason
    )
}

pub fn listing(rows: &[ListedRecord]) -> String {
    if rows.is_empty() {
        return "no records\n".into();
    }
    let mut out = format!(
        "{:<16} {:<12} {:>8} {:>10} {:>10}  {:<16} {}\n",
        "scope", "state", "token", "age", "lease", "subject", "endpoint"
    );
    for r in rows {
        let lease = if r.state == contract::wire::RecordState::InProgress {
            span(r.lease_remaining_ms)
        } else {
            "-".into()
        };
        let ns = if r.namespace.is_empty() {
            String::new()
        } else {
            format!("  [{}]", r.namespace)
        };
        let _ = writeln!(
            out,
            "{:<16} {:<12} {:>8} {:>10} {:>10}  {:<16} {}{ns}",
            r.scope.get(..16).unwrap_or(&r.scope),
            r.state.as_str(),
            r.token,
            span(r.age_ms),
            lease,
            r.subject,
            r.endpoint
        );
    }
    out
}

pub fn action(r: &AdminActionResult) -> String {
    let state = |v: &Option<serde_json::Value>| {
        v.as_ref()
            .and_then(|v| v["state"].as_str().map(str::to_owned))
            .unwrap_or_else(|| "no record".into())
    };
    format!(
        "{}: {} -> {} (audit #{})\n",
        r.action,
        state(&r.before),
        state(&r.after),
        r.audit_id
    )
}
