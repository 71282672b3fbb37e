//! A Stripe-shaped charge and refund (`POST /v1/charges`, `POST /v1/refunds`), for the suites
//! that drive Stripe's own SDKs through the edge: a form-encoded body as Stripe's v1 API takes
//! it, a charge or refund object or a Stripe error object in return, and the demo's test hooks as `metadata[...]` parameters,
//! since an SDK sends no custom headers:
//! * `metadata[demo_delay_ms]=N`: the charge completes N ms after it starts;
//! * `metadata[demo_reset]=1`: the charge runs, then the connection drops without an answer.
//!
//! A charge once started always completes, whether or not its caller is still there (as a
//! payment processor's does): what a client timeout leaves behind is a charge that ran.
//! `source=tok_chargeDeclined` is declined (Stripe's test token), `402 card_error`.

use axum::http::{HeaderMap, HeaderValue};
use serde_json::{json, Map, Value};

/// Stripe's test token for a declined card.
pub const DECLINED_SOURCE: &str = "tok_chargeDeclined";

/// The form's parameters as Stripe reads them: `metadata[k]=v` nested under `metadata`,
/// `amount` a number when it is one, every other value a string.
pub(crate) fn params(body: &[u8]) -> Value {
    let mut top = Map::new();
    for (name, value) in form_urlencoded::parse(body) {
        let value = value.into_owned();
        match name.split_once('[') {
            Some((outer, rest)) if rest.ends_with(']') => {
                let inner = rest.trim_end_matches(']').to_owned();
                let slot = top
                    .entry(outer.to_owned())
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Value::Object(m) = slot {
                    m.insert(inner, Value::String(value));
                }
            }
            _ => {
                let v = match (name.as_ref(), value.parse::<u64>()) {
                    ("amount", Ok(n)) => Value::from(n),
                    _ => Value::String(value),
                };
                top.insert(name.into_owned(), v);
            }
        }
    }
    Value::Object(top)
}

/// The demo's hooks the parameters ask for, as the headers [`crate::run`] reads: the delay,
/// the reset, and always detached (the charge completes without its caller).
pub(crate) fn with_hooks(mut headers: HeaderMap, params: &Value) -> HeaderMap {
    let metadata = |k: &str| {
        params
            .pointer(&format!("/metadata/{k}"))
            .and_then(Value::as_str)
    };
    headers.insert("x-demo-detach", HeaderValue::from_static("1"));
    if let Some(v) = metadata("demo_delay_ms").and_then(|v| HeaderValue::from_str(v).ok()) {
        headers.insert("x-demo-delay-ms", v);
    }
    if metadata("demo_reset") == Some("1") {
        headers.insert("x-demo-reset", HeaderValue::from_static("1"));
    }
    headers
}

/// Whether the request is valid (a charge: an amount and a currency; a refund: the charge it
/// refunds) and declined: `(valid, declined)`.
pub(crate) fn judge(kind: &str, params: &Value) -> (bool, bool) {
    let valid = match kind {
        "refund" => params.get("charge").is_some_and(Value::is_string),
        _ => {
            params.get("amount").is_some_and(Value::is_u64)
                && params.get("currency").is_some_and(Value::is_string)
        }
    };
    let declined = params.get("source").and_then(Value::as_str) == Some(DECLINED_SOURCE);
    (valid, declined)
}

/// The answer's body: a charge or refund object, or Stripe's error object.
pub(crate) fn body(kind: &str, outcome: &str, id: u64, params: &Value) -> Value {
    match (kind, outcome) {
        ("refund", "succeeded") => json!({
            "id": format!("re_demo{id}"),
            "object": "refund",
            "amount": params.get("amount"),
            "charge": params.get("charge"),
            "status": "succeeded",
            "metadata": params.get("metadata").cloned().unwrap_or_else(|| json!({})),
        }),
        (_, "succeeded") => json!({
            "id": format!("ch_demo{id}"),
            "object": "charge",
            "amount": params.get("amount"),
            "currency": params.get("currency"),
            "status": "succeeded",
            "paid": true,
            "captured": true,
            "metadata": params.get("metadata").cloned().unwrap_or_else(|| json!({})),
        }),
        (_, "declined") => json!({ "error": {
            "type": "card_error",
            "code": "card_declined",
            "message": "Your card was declined.",
            "charge": format!("ch_demo{id}"),
        }}),
        ("refund", "invalid") => json!({ "error": {
            "type": "invalid_request_error",
            "message": "Missing required param: charge.",
            "param": "charge",
        }}),
        (_, "invalid") => json!({ "error": {
            "type": "invalid_request_error",
            "message": "Missing required param: amount and currency.",
            "param": "amount",
        }}),
        _ => json!({ "error": { "type": "api_error", "message": "The demo was asked to fail." } }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_form_reads_as_stripe_reads_it() {
        let p = params(b"amount=2000&currency=usd&source=tok_visa&metadata[order]=o%201&metadata[demo_delay_ms]=300");
        assert_eq!(p["amount"], 2000);
        assert_eq!(p["currency"], "usd");
        assert_eq!(p["metadata"]["order"], "o 1");
        assert_eq!(judge("charge", &p), (true, false));
        let h = with_hooks(HeaderMap::new(), &p);
        assert_eq!(
            h.get("x-demo-delay-ms").map(|v| v.as_bytes()),
            Some(&b"300"[..])
        );
        assert_eq!(
            h.get("x-demo-detach").map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        assert!(h.get("x-demo-reset").is_none());
        let declined = params(b"amount=5&currency=usd&source=tok_chargeDeclined");
        assert_eq!(judge("charge", &declined), (true, true));
        assert_eq!(judge("charge", &params(b"currency=usd")), (false, false));
        assert_eq!(body("charge", "succeeded", 7, &p)["id"], "ch_demo7");
        let refund = params(b"charge=ch_demo7");
        assert_eq!(judge("refund", &refund), (true, false));
        assert_eq!(
            body("refund", "succeeded", 8, &refund)["charge"],
            "ch_demo7"
        );
    }
}
