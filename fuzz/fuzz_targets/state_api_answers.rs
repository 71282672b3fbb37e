//! The project's JSON reader (`contract::json`) and the state API answers read with it
//! (`contract::wire::*::read`): never panic on any bytes; whatever the reader accepts,
//! serde_json reads to the same value; whatever an answer reader accepts is JSON, and the
//! answer written back with serde reads back to the same answer.
#![no_main]

use contract::json::{self, Value};
use contract::wire::{BatchResponse, ClaimResponse, HeartbeatResponse, WriteResponse};
use libfuzzer_sys::fuzz_target;

fn to_serde(v: &Value) -> Option<serde_json::Value> {
    Some(match v {
        Value::Null => serde_json::Value::Null,
        Value::Bool(b) => serde_json::Value::Bool(*b),
        Value::Int {
            negative: false,
            magnitude,
        } => serde_json::Value::from(*magnitude),
        // serde_json reads `-0` as the float -0.0 (contract::json as the integer 0): no comparison.
        Value::Int {
            negative: true,
            magnitude: 0,
        } => return None,
        Value::Int {
            negative: true,
            magnitude,
        } => {
            let n = i64::try_from(*magnitude)
                .ok()
                .map(|m| -m)
                .or((*magnitude == 1u64 << 63).then_some(i64::MIN))?;
            serde_json::Value::from(n)
        }
        Value::Str(s) => serde_json::Value::String(s.clone()),
        Value::Array(items) => {
            serde_json::Value::Array(items.iter().map(to_serde).collect::<Option<_>>()?)
        }
        Value::Object(members) => {
            let mut m = serde_json::Map::new();
            for (k, v) in members {
                // Duplicates: serde_json keeps the last; no comparison then.
                if m.insert(k.clone(), to_serde(v)?).is_some() {
                    return None;
                }
            }
            serde_json::Value::Object(m)
        }
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(ours) = json::parse(data) {
        let theirs = serde_json::from_slice::<serde_json::Value>(data);
        assert!(
            theirs.is_ok(),
            "contract::json accepts what serde_json refuses: {theirs:?}"
        );
        if let (Some(ours), Ok(theirs)) = (to_serde(&ours), theirs) {
            assert_eq!(
                ours, theirs,
                "contract::json and serde_json read different values"
            );
        }
    }
    if let Ok(claim) = ClaimResponse::read(data) {
        let again = serde_json::to_vec(&claim).unwrap_or_default();
        assert_eq!(
            ClaimResponse::read(&again).ok(),
            Some(claim),
            "claim answer round trip"
        );
    }
    if let Ok(write) = WriteResponse::read(data) {
        let again = serde_json::to_vec(&write).unwrap_or_default();
        assert_eq!(
            WriteResponse::read(&again).ok(),
            Some(write),
            "write answer round trip"
        );
    }
    // A batch answer read for 0 to 3 requests: never a panic, and one item per request.
    for n in 0..4 {
        if let Ok(items) = BatchResponse::read_claims(data, n) {
            assert_eq!(items.len(), n, "one item per claim");
        }
        if let Ok(items) = BatchResponse::read_writes(data, n) {
            assert_eq!(items.len(), n, "one item per complete");
        }
        if let Ok((claims, writes)) = BatchResponse::read_both(data, n, 3 - n) {
            assert_eq!((claims.len(), writes.len()), (n, 3 - n), "claims, then completes");
        }
    }
    if let Ok(hb) = HeartbeatResponse::read(data) {
        let again = serde_json::to_vec(&hb).unwrap_or_default();
        assert_eq!(
            HeartbeatResponse::read(&again).ok(),
            Some(hb),
            "heartbeat answer round trip"
        );
    }
});
