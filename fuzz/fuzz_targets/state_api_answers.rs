//! The filter's own JSON reader (`filter::json`) and the state API answers read with it
//! (`filter::answers`): never panic on any bytes; whatever the reader accepts, serde_json reads
//! to the same value; whatever the answer readers accept, the contract's serde types read the
//! same way (but for members the filter ignores and a strict serde type refuses).
#![no_main]

use filter::json::{self, Value};
use libfuzzer_sys::fuzz_target;

fn to_serde(v: &Value) -> Option<serde_json::Value> {
    Some(match v {
        Value::Null => serde_json::Value::Null,
        Value::Bool(b) => serde_json::Value::Bool(*b),
        Value::Int {
            negative: false,
            magnitude,
        } => serde_json::Value::from(*magnitude),
        // serde_json reads `-0` as the float -0.0 (filter::json as the integer 0): no comparison.
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
            "filter::json accepts what serde_json refuses: {theirs:?}"
        );
        if let (Some(ours), Ok(theirs)) = (to_serde(&ours), theirs) {
            assert_eq!(
                ours, theirs,
                "filter::json and serde_json read different values"
            );
        }
    }
    // The filter reads answers tolerantly (members added later are ignored, also inside the
    // stored response, whose serde type is strict because the filter sends it in /v1/complete):
    // an `unknown field` refusal by serde is allowed, and so is `-0` read as 0.
    fn same<T: PartialEq + std::fmt::Debug>(
        ours: &T,
        theirs: Result<T, serde_json::Error>,
        what: &str,
    ) {
        match theirs {
            Ok(t) => assert_eq!(&t, ours, "{what} read differently"),
            Err(e) if e.to_string().contains("unknown field") => {}
            // `-0` where an unsigned integer is expected: the filter reads 0, serde a float.
            Err(e) if e.to_string().contains("`-0.0`") => {}
            Err(e) => {
                panic!("{what}: the filter accepts what serde refuses: {e}; filter read {ours:?}")
            }
        }
    }
    if let Ok(claim) = filter::answers::claim(data) {
        same(
            &claim,
            serde_json::from_slice::<contract::wire::ClaimResponse>(data),
            "claim answer",
        );
    }
    if let Ok(write) = filter::answers::write(data) {
        same(
            &write,
            serde_json::from_slice::<contract::wire::WriteResponse>(data),
            "write answer",
        );
    }
    if let Ok(hb) = filter::answers::heartbeat(data) {
        same(
            &hb,
            serde_json::from_slice::<contract::wire::HeartbeatResponse>(data),
            "heartbeat answer",
        );
    }
});
