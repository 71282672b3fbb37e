//! The body curve's fingerprint cost (`make bench-scale`, curve 3): the filter's fingerprint
//! (`contract::fingerprint::fingerprint_with`, the function the filter calls) of a JSON body
//! (canonicalized, `sha256-jcs-v2`) and of an opaque one (`sha256-raw-v2`), against the
//! physical floor, SHA-256 of the same bytes, timed by the same loop.
//!
//! One copy of the bodies and of the loop, run twice by the bench: natively (in the bench's own
//! process) and in V8, the engine Envoy runs the filter in, as this crate's wasm32-wasip1 binary
//! under Node.js (`run.mjs`). The two differ in more than speed: natively `sha2` uses the CPU's
//! SHA instructions when it has them (SHA-NI), while wasm has none, so the ratio against
//! SHA-256 is not the same in both and only the V8 one is what the filter pays.

use std::time::{Duration, Instant};

use contract::fingerprint::{fingerprint_with, Selection, ALG_JCS, ALG_RAW};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const MIB: usize = 1024 * 1024;

/// The body sizes of the curve, from 100 bytes to the default 1 MiB route limit.
pub const SIZES: [usize; 6] = [100, 1024, 16 * 1024, 128 * 1024, 512 * 1024, MIB];

/// The fingerprint's cost at one body size, µs per call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    pub bytes: usize,
    pub json_us: f64,
    pub opaque_us: f64,
    /// SHA-256 of the JSON body's bytes alone.
    pub sha256_us: f64,
}

/// Why a size could not be measured: the figure would not be the one it claims to be.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("the {kind} body of {bytes} bytes was fingerprinted as {got:?}, not {want:?}")]
    WrongAlgorithm {
        kind: &'static str,
        bytes: usize,
        got: String,
        want: &'static str,
    },
    #[error("the {kind} body of {bytes} bytes was refused: {source}")]
    Refused {
        kind: &'static str,
        bytes: usize,
        source: contract::fingerprint::FingerprintError,
    },
}

/// A JSON order of about `size` bytes: nested objects, arrays, strings and numbers, members in
/// no sorted order (the canonical form reorders them).
pub fn json_body(size: usize) -> Vec<u8> {
    let mut out = String::from(r#"{"currency":"EUR","amount":4990,"items":["#);
    let mut i = 0u64;
    // An item is at most about 130 bytes: stop with room for one more and the tail.
    while out.len() + 200 < size {
        if i > 0 {
            out.push(',');
        }
        out += &format!(
            r#"{{"sku":"sku-{i:06}","qty":{},"price":{}.{:02},"name":"Item {i} of the order, a line of text","tags":["x","y{}"],"gift":{}}}"#,
            i % 7 + 1,
            i % 500,
            i % 100,
            i % 13,
            i.is_multiple_of(2)
        );
        i += 1;
    }
    out += r#"],"note":""#;
    while out.len() + 2 < size {
        out.push('n');
    }
    out += "\"}";
    out.into_bytes()
}

/// `size` bytes that are not JSON (a cheap generator: the content does not matter to SHA-256).
pub fn opaque_body(size: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// How long a timed batch of calls lasts: short enough that most batches run without being
/// preempted on a shared machine, long enough for the clock's own cost (a WASI host call in
/// the module) to vanish beside it.
const BATCH: Duration = Duration::from_micros(200);

/// µs per call of `f` in its fastest batch, batches timed for at least `min` (and 3 batches):
/// the cost of the work itself, without the time other processes took the CPU.
fn fastest_us(min: Duration, mut f: impl FnMut()) -> f64 {
    let once = Instant::now();
    f();
    let per_batch =
        (BATCH.as_secs_f64() / once.elapsed().as_secs_f64().max(1e-9)).clamp(1.0, 1e6) as u64;
    let started = Instant::now();
    let mut batches = 0u64;
    let mut fastest = f64::INFINITY;
    while batches < 3 || started.elapsed() < min {
        let t = Instant::now();
        for _ in 0..per_batch {
            f();
        }
        fastest = fastest.min(t.elapsed().as_secs_f64() * 1e6 / per_batch as f64);
        batches += 1;
    }
    fastest
}

fn fingerprint_body(
    content_type: &str,
    body: &[u8],
) -> Result<String, contract::fingerprint::FingerprintError> {
    fingerprint_with(
        "POST",
        "/checkout",
        "",
        Some(content_type),
        std::hint::black_box(body),
        &Selection::Whole,
    )
    .map(|f| f.alg.into_owned())
}

/// Checks that `body` is fingerprinted with `want` (else the figure would be another path's).
fn check_algorithm(
    kind: &'static str,
    content_type: &str,
    body: &[u8],
    want: &'static str,
) -> Result<(), ProbeError> {
    let bytes = body.len();
    let got = fingerprint_body(content_type, body).map_err(|source| ProbeError::Refused {
        kind,
        bytes,
        source,
    })?;
    if got == want {
        Ok(())
    } else {
        Err(ProbeError::WrongAlgorithm {
            kind,
            bytes,
            got,
            want,
        })
    }
}

/// Rounds of the three figures, interleaved, so that a change in what else the machine runs
/// (its caches and memory bandwidth are shared too) lands on all three alike.
const ROUNDS: u32 = 5;

/// The cost at `bytes`: each figure its fastest batch over [`ROUNDS`] rounds of at least
/// `min / ROUNDS`.
pub fn measure(bytes: usize, min: Duration) -> Result<Cost, ProbeError> {
    let json = json_body(bytes);
    let opaque = opaque_body(bytes);
    check_algorithm("JSON", "application/json", &json, ALG_JCS)?;
    check_algorithm("opaque", "application/octet-stream", &opaque, ALG_RAW)?;
    let mut sha256 = || {
        std::hint::black_box(Sha256::digest(std::hint::black_box(&json)));
    };
    let mut json_fingerprint = || {
        let _ = std::hint::black_box(fingerprint_body("application/json", &json));
    };
    let mut opaque_fingerprint = || {
        let _ = std::hint::black_box(fingerprint_body("application/octet-stream", &opaque));
    };
    let round = min / ROUNDS;
    let mut cost = Cost {
        bytes,
        json_us: f64::INFINITY,
        opaque_us: f64::INFINITY,
        sha256_us: f64::INFINITY,
    };
    for _ in 0..ROUNDS {
        cost.sha256_us = cost.sha256_us.min(fastest_us(round, &mut sha256));
        cost.json_us = cost.json_us.min(fastest_us(round, &mut json_fingerprint));
        cost.opaque_us = cost
            .opaque_us
            .min(fastest_us(round, &mut opaque_fingerprint));
    }
    Ok(cost)
}

/// [`measure`] at every size of [`SIZES`].
pub fn measure_all(min: Duration) -> Result<Vec<Cost>, ProbeError> {
    SIZES.iter().map(|&bytes| measure(bytes, min)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bodies_have_the_asked_size_and_the_json_one_is_json() {
        for size in SIZES {
            let j = json_body(size);
            assert_eq!(j.len(), size);
            assert!(
                serde_json::from_slice::<serde_json::Value>(&j).is_ok(),
                "{size}"
            );
            assert_eq!(opaque_body(size).len(), size);
        }
    }

    #[test]
    fn every_size_is_measured_on_the_path_it_names() -> Result<(), ProbeError> {
        let costs = measure_all(Duration::ZERO)?;
        assert_eq!(costs.len(), SIZES.len());
        for c in costs {
            assert!(
                c.json_us > 0.0 && c.opaque_us > 0.0 && c.sha256_us > 0.0,
                "{c:?}"
            );
        }
        Ok(())
    }

    #[test]
    fn a_body_fingerprinted_raw_where_json_was_meant_is_an_error() {
        let not_json = opaque_body(100);
        let e = check_algorithm("JSON", "application/json", &not_json, ALG_JCS);
        assert!(
            matches!(e, Err(ProbeError::WrongAlgorithm { ref got, .. }) if got == ALG_RAW),
            "{e:?}"
        );
    }
}
