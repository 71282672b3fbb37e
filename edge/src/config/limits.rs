//! `[limits]`: what the edge lets hostile traffic hold in Envoy (issue 49): a memory budget
//! (the filter's buffering bound and the heap bound the overload manager acts on come from it),
//! the connections a listener accepts, and how long a client may take over its headers, its
//! body, an idle connection and reading its answer.

use toml::Spanned;

use super::raw::RawLimits;
use super::source::Source;
use super::ConfigError;

const MIB: u64 = 1 << 20;

/// `[limits]`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// What Envoy's memory may grow by above its idle footprint under load, in bytes: the
    /// filter's buffering bound and the overload manager's heap bound are derived from it
    /// ([`Limits::body_bytes_per_worker`], [`Limits::heap_bytes`]).
    pub memory_budget_bytes: u64,
    /// Connections the listener accepts at once (and Envoy in all).
    pub max_connections: u64,
    /// From a connection's first byte of a request to its last header.
    pub request_headers_timeout_ms: u64,
    /// How long a client may take to send a whole request, headers and body (Envoy's
    /// `request_timeout`).
    pub request_body_timeout_ms: u64,
    /// A connection with no request in progress is closed after this.
    pub idle_timeout_ms: u64,
    /// How long an answer Envoy holds whole may wait for a client that does not read it
    /// (Envoy's `stream_flush_timeout`).
    pub response_flush_timeout_ms: u64,
}

pub const DEFAULT_MEMORY_BUDGET_BYTES: u64 = 80 * MIB;
/// About 6 KiB of Envoy's heap each when idle (measured): 12,288 take 72 MiB, which with Envoy's
/// own 28 MiB after a burst stays below 80 % of the default heap bound (the first action).
pub const DEFAULT_MAX_CONNECTIONS: u64 = 12_288;
pub const DEFAULT_REQUEST_HEADERS_TIMEOUT_MS: u64 = 10_000;
pub const DEFAULT_REQUEST_BODY_TIMEOUT_MS: u64 = 60_000;
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 60_000;
pub const DEFAULT_RESPONSE_FLUSH_TIMEOUT_MS: u64 = 60_000;
/// Envoy's heap at rest with the filter loaded (12 MiB allocated, measured), what the overload
/// manager counts besides (the allocator's fragments), and a margin: the heap bound is this and
/// the budget, so that the budget's worth of held bodies stays below the first action's 80 %
/// (docs/RELIABILITY.md, Hostile load).
pub const HEAP_BASE_BYTES: u64 = 48 * MIB;
/// Envoy's heap per request body byte the filter holds, measured: 40 MiB of held 1 MiB bodies
/// took 64 MiB of heap (1.6; the codec's slices), 64 MiB took 88 MiB (1.38).
pub const HEAP_PER_BODY_BYTE: (u64, u64) = (8, 5);
/// What the budget keeps for the connections and Envoy's own growth when it sizes the bodies:
/// the bodies get half of it.
pub const BODY_SHARE: (u64, u64) = (1, 2);

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_budget_bytes: DEFAULT_MEMORY_BUDGET_BYTES,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            request_headers_timeout_ms: DEFAULT_REQUEST_HEADERS_TIMEOUT_MS,
            request_body_timeout_ms: DEFAULT_REQUEST_BODY_TIMEOUT_MS,
            idle_timeout_ms: DEFAULT_IDLE_TIMEOUT_MS,
            response_flush_timeout_ms: DEFAULT_RESPONSE_FLUSH_TIMEOUT_MS,
        }
    }
}

impl Limits {
    /// The filter's `max_buffered_bytes` when `[filter]` does not set it: half the budget
    /// shared by the workers, and never below the largest body a route takes (one must fit).
    pub fn body_bytes_per_worker(&self, workers: u32, largest_body: u64) -> u64 {
        (self.memory_budget_bytes * BODY_SHARE.0 / BODY_SHARE.1 / u64::from(workers.max(1)))
            .max(largest_body)
    }

    /// The overload manager's heap bound: Envoy's heap at rest ([`HEAP_BASE_BYTES`]) and the
    /// budget, or what the bodies the filter may hold cost in Envoy's heap
    /// ([`HEAP_PER_BODY_BYTE`]) and 16 MiB if that is more (a `max_buffered_bytes` set above the budget's share raises the bound with it).
    pub fn heap_bytes(&self, workers: u32, max_buffered_bytes: u64) -> u64 {
        let bodies = max_buffered_bytes
            .saturating_mul(u64::from(workers))
            .saturating_mul(HEAP_PER_BODY_BYTE.0)
            / HEAP_PER_BODY_BYTE.1;
        HEAP_BASE_BYTES.saturating_add(
            self.memory_budget_bytes
                .max(bodies.saturating_add(16 * MIB)),
        )
    }
}

fn ms(
    src: &Source<'_>,
    v: Option<&Spanned<u64>>,
    name: &str,
    range: (u64, u64),
    default: u64,
) -> Result<u64, ConfigError> {
    match v {
        Some(t) if *t.get_ref() < range.0 || *t.get_ref() > range.1 => src.at(
            t.span(),
            format!("limits.{name} must be {} to {}", range.0, range.1),
        ),
        Some(t) => Ok(*t.get_ref()),
        None => Ok(default),
    }
}

/// `[limits]` read and checked, each field on its own.
pub(super) fn limits(src: &Source<'_>, raw: &RawLimits) -> Result<Limits, ConfigError> {
    let memory_budget_bytes = match &raw.memory_budget_mib {
        Some(m) if *m.get_ref() < 16 || *m.get_ref() > 1 << 20 => {
            return src.at(m.span(), "limits.memory_budget_mib must be 16 to 1048576");
        }
        Some(m) => m.get_ref() * MIB,
        None => DEFAULT_MEMORY_BUDGET_BYTES,
    };
    Ok(Limits {
        memory_budget_bytes,
        max_connections: ms(
            src,
            raw.max_connections.as_ref(),
            "max_connections",
            (16, 10_000_000),
            DEFAULT_MAX_CONNECTIONS,
        )?,
        request_headers_timeout_ms: ms(
            src,
            raw.request_headers_timeout_ms.as_ref(),
            "request_headers_timeout_ms",
            (100, 600_000),
            DEFAULT_REQUEST_HEADERS_TIMEOUT_MS,
        )?,
        request_body_timeout_ms: ms(
            src,
            raw.request_body_timeout_ms.as_ref(),
            "request_body_timeout_ms",
            (1_000, 86_400_000),
            DEFAULT_REQUEST_BODY_TIMEOUT_MS,
        )?,
        idle_timeout_ms: ms(
            src,
            raw.idle_timeout_ms.as_ref(),
            "idle_timeout_ms",
            (1_000, 86_400_000),
            DEFAULT_IDLE_TIMEOUT_MS,
        )?,
        response_flush_timeout_ms: ms(
            src,
            raw.response_flush_timeout_ms.as_ref(),
            "response_flush_timeout_ms",
            (1_000, 86_400_000),
            DEFAULT_RESPONSE_FLUSH_TIMEOUT_MS,
        )?,
    })
}
