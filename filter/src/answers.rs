//! The state API's answers (`contract::wire`), read with [`crate::json`] instead of serde_json's
//! deserializer (see there why). Like the contract's own readers, members added later are
//! ignored; the tests check both agree on every answer the state API sends.

use crate::json::{self, Fields, Value};
use contract::wire::{ClaimResponse, HeartbeatResponse, StoredResponse, WriteResponse};

fn fields<'a>(v: &'a Value, what: &'a str) -> Result<Fields<'a>, String> {
    Fields::of(v, what)
}

/// The answer to `/v1/claim`.
pub fn claim(body: &[u8]) -> Result<ClaimResponse, String> {
    let doc = json::parse(body)?;
    let f = fields(&doc, "the claim answer")?;
    match f.str("outcome")? {
        "claimed" => Ok(ClaimResponse::Claimed {
            token: f.i64("token")?,
            lease_ms: f.u64("lease_ms")?,
            reclaimed: f.bool("reclaimed")?,
        }),
        "in_progress" => Ok(ClaimResponse::InProgress {
            retry_after_s: u32::try_from(f.u64("retry_after_s")?)
                .map_err(|_| "retry_after_s is out of range".to_owned())?,
            lease_remaining_ms: f.u64("lease_remaining_ms")?,
        }),
        "completed" => Ok(ClaimResponse::Completed {
            response: stored(f.required("response")?)?,
            expires_in_ms: f.opt_u64("expires_in_ms")?,
        }),
        "mismatch" => Ok(ClaimResponse::Mismatch),
        other => Err(format!("unknown claim outcome `{other}`")),
    }
}

fn stored(v: &Value) -> Result<StoredResponse, String> {
    let f = fields(v, "response")?;
    let status = u16::try_from(f.u64("status")?).map_err(|_| "response.status is out of range")?;
    let headers = match f.required("headers")? {
        Value::Array(items) => items
            .iter()
            .map(|h| match h {
                Value::Array(pair) => match pair.as_slice() {
                    [Value::Str(n), Value::Str(v)] => Ok((n.clone(), v.clone())),
                    _ => Err("response.headers must hold [name, value] string pairs".to_owned()),
                },
                _ => Err("response.headers must hold [name, value] string pairs".to_owned()),
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => {
            return Err(format!(
                "response.headers must be an array, not {}",
                other.kind()
            ))
        }
    };
    Ok(StoredResponse {
        status,
        headers,
        body_base64: f.opt_str("body_base64")?.unwrap_or("").to_owned(),
        replayable: f.bool("replayable")?,
    })
}

/// The answer to `/v1/complete` or `/v1/release`.
pub fn write(body: &[u8]) -> Result<WriteResponse, String> {
    let doc = json::parse(body)?;
    let f = fields(&doc, "the write answer")?;
    Ok(WriteResponse {
        state: f.str("state")?.to_owned(),
        expires_in_ms: f.opt_u64("expires_in_ms")?,
    })
}

/// The answer to `/v1/heartbeat`.
pub fn heartbeat(body: &[u8]) -> Result<HeartbeatResponse, String> {
    let doc = json::parse(body)?;
    let f = fields(&doc, "the heartbeat answer")?;
    Ok(HeartbeatResponse {
        lease_ms: f.u64("lease_ms")?,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn every_answer() -> Vec<ClaimResponse> {
        vec![
            ClaimResponse::Claimed {
                token: 9_007_199_254_740_993,
                lease_ms: 30_000,
                reclaimed: true,
            },
            ClaimResponse::InProgress {
                retry_after_s: 2,
                lease_remaining_ms: 1_500,
            },
            ClaimResponse::Completed {
                response: StoredResponse::new(
                    201,
                    vec![
                        ("content-type".into(), "application/json".into()),
                        ("x-multi".into(), "a \"quoted\" \\ value é €".into()),
                    ],
                    &[0, 1, 2, 255],
                    true,
                ),
                expires_in_ms: Some(86_399_999),
            },
            ClaimResponse::Completed {
                response: StoredResponse::new(201, vec![], b"", false),
                expires_in_ms: None,
            },
            ClaimResponse::Mismatch,
        ]
    }

    #[test]
    fn reads_what_serde_writes() -> Result<(), serde_json::Error> {
        for a in every_answer() {
            let json = serde_json::to_vec(&a)?;
            assert_eq!(claim(&json), Ok(a));
        }
        for w in [WriteResponse::completed(5), WriteResponse::released()] {
            assert_eq!(write(&serde_json::to_vec(&w)?), Ok(w));
        }
        let hb = HeartbeatResponse { lease_ms: 30_000 };
        assert_eq!(heartbeat(&serde_json::to_vec(&hb)?), Ok(hb));
        Ok(())
    }

    #[test]
    fn tolerates_members_added_later_and_refuses_what_is_wrong() {
        assert_eq!(
            claim(br#"{"outcome":"mismatch","why":{"deep":[1]}}"#),
            Ok(ClaimResponse::Mismatch)
        );
        assert_eq!(
            write(br#"{"state":"completed","expires_in_ms":null,"later":1}"#),
            Ok(WriteResponse {
                state: "completed".into(),
                expires_in_ms: None
            })
        );
        for bad in [
            &br#"{"outcome":"maybe"}"#[..],
            br#"{"outcome":"claimed","token":1,"lease_ms":-1,"reclaimed":false}"#,
            br#"{"outcome":"claimed","token":1.5,"lease_ms":1,"reclaimed":false}"#,
            br#"{"outcome":"in_progress","retry_after_s":4294967296,"lease_remaining_ms":1}"#,
            br#"{"outcome":"completed"}"#,
            br#"{"outcome":"completed","response":{"status":70000,"headers":[],"replayable":true}}"#,
            br#"{"outcome":"completed","response":{"status":200,"headers":[["a"]],"replayable":true}}"#,
            br#"{"outcome":"completed","response":{"status":200,"headers":{},"replayable":true}}"#,
            br#"{"outcome":"mismatch","outcome":"claimed"}"#,
            br#"[]"#,
            b"",
        ] {
            assert!(claim(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(write(br#"{"expires_in_ms":1}"#).is_err());
        assert!(heartbeat(br#"{"lease_ms":"1"}"#).is_err());
        // Absent body: an empty one (serde's default).
        let a = claim(
            br#"{"outcome":"completed","response":{"status":204,"headers":[],"replayable":true}}"#,
        );
        assert!(
            matches!(&a, Ok(ClaimResponse::Completed { response, .. }) if response.body_base64.is_empty()),
            "{a:?}"
        );
    }
}
