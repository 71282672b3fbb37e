//! What the load generator sends, one function an operation: each returns whether the answer
//! was the one expected (a first execution, a replay, an in-flight duplicate, the state API
//! alone).

use std::sync::Arc;

use bytes::Bytes;
use contract::wire::{
    ClaimRequest, ClaimResponse, CompleteRequest, StoredResponse, CLAIM_PATH, COMPLETE_PATH,
};
use test_support::stack::{token, TEST_API_TOKEN};

use crate::load::{self, Conn, OpFn, Outcome, Req};

pub(crate) const CHARGE_BODY: &str =
    r#"{"amount":4990,"currency":"BRL","card":{"number":"4242424242424242","exp":"12/30"}}"#;

pub(crate) fn checkout_req(key: &str) -> Req {
    Req::post("/checkout", Bytes::from_static(CHARGE_BODY.as_bytes()))
        .header("authorization", &format!("Bearer {}", alice()))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
}

pub(crate) fn alice() -> &'static str {
    use std::sync::OnceLock;
    static T: OnceLock<String> = OnceLock::new();
    T.get_or_init(|| token("alice"))
}

pub(crate) fn header_is(a: &load::Answer, name: &str, value: &str) -> bool {
    a.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(value))
}

pub(crate) fn wrong_status(status: u16) -> Outcome {
    Outcome::Wrong(format!("status {status}"))
}

/// The key `op_created(prefix)` sends as operation `seq` of `client`.
pub(crate) fn new_key(prefix: &str, client: usize, seq: u64) -> String {
    format!("{prefix}-{client}-{seq}")
}

/// A first execution: 201 and not a replay.
pub(crate) fn op_created(prefix: String) -> OpFn {
    Arc::new(move |conn: &mut Conn, client: usize, seq: u64| {
        let req = checkout_req(&new_key(&prefix, client, seq));
        Box::pin(async move {
            let a = conn.send(&req).await?;
            Ok(if a.status != 201 {
                wrong_status(a.status)
            } else if a.headers.contains_key("idempotent-replayed") {
                Outcome::Wrong("replayed a new key".into())
            } else {
                Outcome::Ok
            })
        })
    })
}

/// A replay of a completed key: 201 with `Idempotent-Replayed: true`.
pub(crate) fn op_replay(keys: Arc<Vec<String>>) -> OpFn {
    Arc::new(move |conn: &mut Conn, client: usize, seq: u64| {
        let key = &keys[(client * 7 + seq as usize) % keys.len()];
        let req = checkout_req(key);
        Box::pin(async move {
            let a = conn.send(&req).await?;
            Ok(if a.status != 201 {
                wrong_status(a.status)
            } else if !header_is(&a, "idempotent-replayed", "true") {
                Outcome::Wrong("201 without Idempotent-Replayed".into())
            } else {
                Outcome::Ok
            })
        })
    })
}

/// A duplicate of a request still in flight: 409 with Retry-After.
pub(crate) fn op_inflight(key: String) -> OpFn {
    let req = checkout_req(&key);
    Arc::new(move |conn: &mut Conn, _client: usize, _seq: u64| {
        let req = req.clone();
        Box::pin(async move {
            let a = conn.send(&req).await?;
            Ok(if a.status != 409 {
                wrong_status(a.status)
            } else if !a.headers.contains_key("retry-after") {
                Outcome::Wrong("409 without Retry-After".into())
            } else {
                Outcome::Ok
            })
        })
    })
}

pub(crate) fn claim_body(key: &str) -> Req {
    let claim = ClaimRequest {
        key: key.to_owned(),
        subject: "bench".into(),
        endpoint: "POST /checkout".into(),
        fingerprint: "ab".repeat(32),
        fingerprint_alg: "sha256-jcs-v2".into(),
        lease_ms: Some(30_000),
        on_unknown: Default::default(),
        namespace: String::new(),
        retention_s: None,
        wait_ms: None,
        nonce: None,
    };
    Req::post(
        CLAIM_PATH,
        Bytes::from(serde_json::to_vec(&claim).unwrap_or_default()),
    )
    .header("authorization", &format!("Bearer {TEST_API_TOKEN}"))
    .header("content-type", "application/json")
}

/// The state API alone, the replay path: a claim of a completed key (answer `completed`).
pub(crate) fn op_claim_completed(keys: Arc<Vec<String>>) -> OpFn {
    Arc::new(move |conn: &mut Conn, client: usize, seq: u64| {
        let req = claim_body(&keys[(client * 7 + seq as usize) % keys.len()]);
        Box::pin(async move {
            let a = conn.send(&req).await?;
            if a.status != 200 {
                return Ok(Outcome::Wrong(format!("claim status {}", a.status)));
            }
            Ok(match serde_json::from_slice::<serde_json::Value>(&a.body) {
                Ok(v) if v.get("outcome").and_then(|o| o.as_str()) == Some("completed") => {
                    Outcome::Ok
                }
                Ok(v) => Outcome::Wrong(format!(
                    "claim: {}",
                    v.get("outcome").cloned().unwrap_or_default()
                )),
                Err(e) => Outcome::Wrong(format!("claim body: {e}")),
            })
        })
    })
}

/// The state API alone: claim a new key, then complete it (two requests on the connection).
pub(crate) fn op_claim_complete(prefix: String) -> OpFn {
    Arc::new(move |conn: &mut Conn, client: usize, seq: u64| {
        Box::pin(claim_complete(conn, format!("{prefix}-{client}-{seq}")))
    })
}

pub(crate) async fn claim_complete(conn: &mut Conn, key: String) -> Result<Outcome, String> {
    let a = conn.send(&claim_body(&key)).await?;
    if a.status != 200 {
        return Ok(Outcome::Wrong(format!("claim status {}", a.status)));
    }
    let token = match ClaimResponse::read(&a.body) {
        Ok(ClaimResponse::Claimed { token, .. }) => token,
        Ok(other) => {
            let outcome = serde_json::to_value(&other)
                .ok()
                .and_then(|v| v.get("outcome").cloned())
                .unwrap_or_default();
            return Ok(Outcome::Wrong(format!("claim: {outcome}")));
        }
        Err(e) => return Ok(Outcome::Wrong(format!("claim body: {e}"))),
    };
    let complete = CompleteRequest {
        namespace: String::new(),
        key,
        subject: "bench".into(),
        endpoint: "POST /checkout".into(),
        token,
        response: StoredResponse::new(
            201,
            vec![
                ("content-type".into(), "application/json".into()),
                ("location".into(), "/charges/1".into()),
            ],
            br#"{"id":1,"kind":"charge","status":"succeeded","amount":4990}"#,
            true,
        ),
    };
    let complete_req = Req::post(
        COMPLETE_PATH,
        Bytes::from(serde_json::to_vec(&complete).unwrap_or_default()),
    )
    .header("authorization", &format!("Bearer {TEST_API_TOKEN}"))
    .header("content-type", "application/json");
    let b = conn.send(&complete_req).await?;
    Ok(if b.status == 200 {
        Outcome::Ok
    } else {
        Outcome::Wrong(format!("complete status {}", b.status))
    })
}
