//! `[state]`: where the state API listens, its database, its secrets and keys, its timeouts and
//! retention, and `[state.tls]` (read by `state_tls.rs`).

use std::path::Path;

use filter_core::config as fc;
use toml::Spanned;

use super::raw::RawState;
use super::source::{socket, Lines, Source};
use super::state_tls::state_tls;
use super::*;

/// `[state]`, each field checked on its own and against the others it must differ from.
pub(super) fn state(
    src: &Source<'_>,
    st: &RawState,
    base: &Path,
    lines: &mut Lines,
) -> Result<State, ConfigError> {
    let listen = match &st.listen {
        Some(l) => {
            lines.note(src, "state.listen", l.span());
            socket(src, l, "state.listen")?
        }
        None => DEFAULT_STATE_LISTEN
            .parse()
            .map_err(|_| ConfigError::Invalid("default state.listen".into()))?,
    };
    let database_url = database_url(src, st.database_url.as_ref())?;
    let postgres_port = postgres_port(src, st.postgres_port.as_ref(), &database_url, lines)?;
    let token = secret(src, &st.token, "token")?;
    let key_secret = secret(src, &st.key_secret, "key_secret")?;
    let previous_key_secret = secret(src, &st.previous_key_secret, "previous_key_secret")?;
    let admin_token = secret(src, &st.admin_token, "admin_token")?;
    let previous_storage_key = storage_key(src, &st.previous_storage_key, "previous_storage_key")?;
    let storage_key = storage_key(src, &st.storage_key, "storage_key")?;
    distinct_keys(src, st, &storage_key, &previous_storage_key, &token)?;
    let timeout_ms = match &st.timeout_ms {
        Some(t) if *t.get_ref() == 0 || *t.get_ref() > 60_000 => {
            return src.at(t.span(), "state.timeout_ms must be 1 to 60000")
        }
        Some(t) => *t.get_ref(),
        None => fc::DEFAULT_TIMEOUT_MS,
    };
    let (retention_s, max_retention_s) = retention(src, st)?;
    let tls = match &st.tls {
        Some(t) => {
            lines.note(src, "state.tls", t.span());
            Some(state_tls(src, t, base, listen)?)
        }
        None => None,
    };
    Ok(State {
        listen,
        database_url,
        postgres_port,
        token,
        key_secret,
        previous_key_secret,
        storage_key,
        previous_storage_key,
        timeout_ms,
        retention_s,
        max_retention_s,
        admin_token,
        tls,
    })
}

fn database_url(
    src: &Source<'_>,
    raw: Option<&Spanned<String>>,
) -> Result<Option<String>, ConfigError> {
    match raw {
        Some(u) => {
            let url = u.get_ref();
            if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                return src.at(
                    u.span(),
                    "state.database_url must be a postgres:// or postgresql:// URL",
                );
            }
            Ok(Some(url.clone()))
        }
        None => Ok(None),
    }
}

/// The embedded cluster's port: only without `state.database_url`.
fn postgres_port(
    src: &Source<'_>,
    raw: Option<&Spanned<u16>>,
    database_url: &Option<String>,
    lines: &mut Lines,
) -> Result<u16, ConfigError> {
    match raw {
        Some(p) if *p.get_ref() == 0 => src.at(p.span(), "state.postgres_port must be 1 to 65535"),
        Some(p) => {
            if database_url.is_some() {
                return src.at(
                    p.span(),
                    "state.postgres_port is the embedded cluster's: not with state.database_url",
                );
            }
            lines.note(src, "state.postgres_port", p.span());
            Ok(*p.get_ref())
        }
        None => Ok(DEFAULT_POSTGRES_PORT),
    }
}

/// A token or HMAC secret: at least 16 visible ASCII characters.
fn secret(
    src: &Source<'_>,
    s: &Option<Spanned<String>>,
    name: &str,
) -> Result<Option<String>, ConfigError> {
    match s {
        Some(v)
            if v.get_ref().len() < 16
                || v.get_ref().bytes().any(|b| !(0x21..=0x7e).contains(&b)) =>
        {
            src.at(
                v.span(),
                format!("state.{name} must be at least 16 visible ASCII characters, no spaces"),
            )
        }
        Some(v) => Ok(Some(v.get_ref().clone())),
        None => Ok(None),
    }
}

fn storage_key(
    src: &Source<'_>,
    v: &Option<Spanned<String>>,
    name: &str,
) -> Result<Option<String>, ConfigError> {
    match v {
        Some(k) if !is_storage_key(k.get_ref()) => src.at(
            k.span(),
            format!("state.{name} must be 32 bytes in standard base64 (openssl rand -base64 32)"),
        ),
        Some(k) => Ok(Some(k.get_ref().trim().to_owned())),
        None => Ok(None),
    }
}

/// A rotation's previous storage key is another key, and the operators' token is not the
/// filter's.
fn distinct_keys(
    src: &Source<'_>,
    st: &RawState,
    storage_key: &Option<String>,
    previous_storage_key: &Option<String>,
    token: &Option<String>,
) -> Result<(), ConfigError> {
    if let (Some(k), Some(p)) = (storage_key, previous_storage_key) {
        if k == p {
            if let Some(span) = st.previous_storage_key.as_ref().map(|p| p.span()) {
                return src.at(
                    span,
                    "state.previous_storage_key is the same as state.storage_key",
                );
            }
        }
    }
    if let (Some(a), Some(t)) = (&st.admin_token, token) {
        if a.get_ref() == t {
            return src.at(
                a.span(),
                "state.admin_token must not be the filter's token (state.token)",
            );
        }
    }
    Ok(())
}

/// `retention_s` and `max_retention_s`: the first within the second (or its default).
fn retention(src: &Source<'_>, st: &RawState) -> Result<(Option<u64>, Option<u64>), ConfigError> {
    let retention_s = match &st.retention_s {
        Some(r) if *r.get_ref() == 0 => return src.at(r.span(), "state.retention_s must be > 0"),
        Some(r) => Some(*r.get_ref()),
        None => None,
    };
    let max_retention_s = match &st.max_retention_s {
        Some(r) if *r.get_ref() == 0 || *r.get_ref() > MAX_RETENTION_S => {
            return src.at(
                r.span(),
                format!("state.max_retention_s must be 1 to {MAX_RETENTION_S} (ten years)"),
            )
        }
        Some(r) => Some(*r.get_ref()),
        None => None,
    };
    let retention_cap = max_retention_s.unwrap_or(DEFAULT_MAX_RETENTION_S);
    if let Some(r) = st
        .retention_s
        .as_ref()
        .filter(|r| *r.get_ref() > retention_cap)
    {
        return src.at(
            r.span(),
            format!("state.retention_s is over state.max_retention_s ({retention_cap} s)"),
        );
    }
    Ok((retention_s, max_retention_s))
}

/// A storage key as the state API takes it: 32 bytes in standard base64.
fn is_storage_key(text: &str) -> bool {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .is_ok_and(|k| k.len() == 32)
}
