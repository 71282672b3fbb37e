//! Tests of the wire contract: what serde writes the own reader reads back the same, answers
//! from later versions are read, wrong ones refused.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use super::*;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn every_claim_answer() -> Vec<ClaimResponse> {
    vec![
        ClaimResponse::Claimed {
            token: 9_007_199_254_740_993,
            lease_ms: 30_000,
            reclaimed: true,
            max_body_bytes: Some(1 << 20),
            retention_s: Some(86_400),
        },
        ClaimResponse::Claimed {
            token: 1,
            lease_ms: 1_000,
            reclaimed: false,
            max_body_bytes: None,
            retention_s: None,
        },
        ClaimResponse::InProgress {
            retry_after_s: 2,
            lease_remaining_ms: 1_500,
            waited_ms: None,
        },
        ClaimResponse::InProgress {
            retry_after_s: 1,
            lease_remaining_ms: 900,
            waited_ms: Some(10_000),
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
            waited_ms: None,
        },
        ClaimResponse::Completed {
            response: StoredResponse::new(201, vec![], b"", false),
            expires_in_ms: None,
            waited_ms: None,
        },
        ClaimResponse::Mismatch,
        ClaimResponse::Unknown,
    ]
}

#[test]
fn a_batch_answer_reads_back_as_each_claim_answer_and_problem_in_order() {
    let mut answers: Vec<BatchItem> = every_claim_answer()
        .iter()
        .map(|a| BatchItem {
            status: 200,
            answer: serde_json::to_value(a).unwrap(),
        })
        .collect();
    let problem = crate::Problem::new(crate::ProblemKind::BadRequest, "key: too long");
    answers.push(BatchItem {
        status: 400,
        answer: serde_json::from_slice(&problem.to_json()).unwrap(),
    });
    let n = answers.len();
    let body = serde_json::to_vec(&BatchResponse { answers }).unwrap();
    let items = BatchResponse::read_claims(&body, n).unwrap();
    for (item, want) in items.iter().zip(every_claim_answer()) {
        assert_eq!(item.status, 200);
        assert_eq!(item.answer, Ok(want));
    }
    let last = items.last().unwrap();
    assert_eq!(last.status, 400);
    assert_eq!(last.answer, Err(AnswerError("key: too long".into())));
    // A write batch reads the same way.
    let writes = BatchResponse {
        answers: vec![
            BatchItem {
                status: 200,
                answer: serde_json::to_value(WriteResponse::completed(5_000)).unwrap(),
            },
            BatchItem {
                status: 409,
                answer: serde_json::json!({"detail": "fenced out"}),
            },
        ],
    };
    let read = BatchResponse::read_writes(&serde_json::to_vec(&writes).unwrap(), 2).unwrap();
    assert_eq!(read[0].answer, Ok(WriteResponse::completed(5_000)));
    assert_eq!(
        (read[1].status, read[1].answer.clone()),
        (409, Err(AnswerError("fenced out".into())))
    );
    // A `/v1/writes` answer: the claims' items, then the completes'.
    let mut both = serde_json::to_value(BatchResponse {
        answers: vec![BatchItem {
            status: 200,
            answer: serde_json::to_value(ClaimResponse::Mismatch).unwrap(),
        }],
    })
    .unwrap();
    let write_items = serde_json::to_value(&writes).unwrap()["answers"].clone();
    for item in write_items.as_array().unwrap() {
        both["answers"].as_array_mut().unwrap().push(item.clone());
    }
    let both = serde_json::to_vec(&both).unwrap();
    let (claims, written) = BatchResponse::read_both(&both, 1, 2).unwrap();
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].answer, Ok(ClaimResponse::Mismatch));
    assert_eq!(written, read);
    assert!(BatchResponse::read_both(&both, 2, 2).is_err());
    assert!(BatchResponse::read_both(&both, 0, 2).is_err());
    // An answer for a different number of claims is refused whole.
    assert!(BatchResponse::read_claims(&body, n - 1).is_err());
    assert!(BatchResponse::read_claims(br#"{"answers":{}}"#, 0).is_err());
    assert!(
        BatchResponse::read_claims(br#"{"answers":[{"status":70000,"answer":{}}]}"#, 1).is_err()
    );
}

#[test]
fn claim_response_is_tagged_by_outcome() {
    let json = serde_json::to_string(&ClaimResponse::InProgress {
        retry_after_s: 2,
        lease_remaining_ms: 1500,
        waited_ms: None,
    })
    .unwrap();
    assert_eq!(
        json,
        r#"{"outcome":"in_progress","retry_after_s":2,"lease_remaining_ms":1500}"#
    );
    assert_eq!(
        ClaimResponse::read(br#"{"outcome":"mismatch"}"#),
        Ok(ClaimResponse::Mismatch)
    );
}

#[test]
fn reads_what_serde_writes() {
    for a in every_claim_answer() {
        let json = serde_json::to_vec(&a).unwrap();
        assert_eq!(ClaimResponse::read(&json), Ok(a));
    }
    for w in [
        WriteResponse::completed(5),
        WriteResponse::released(),
        WriteResponse::unknown(),
    ] {
        assert_eq!(WriteResponse::read(&serde_json::to_vec(&w).unwrap()), Ok(w));
    }
    let hb = HeartbeatResponse { lease_ms: 30_000 };
    assert_eq!(
        HeartbeatResponse::read(&serde_json::to_vec(&hb).unwrap()),
        Ok(hb)
    );
}

#[test]
fn every_claim_answer_has_a_listed_label() {
    for a in every_claim_answer() {
        assert!(ClaimResponse::LABELS.contains(&a.label()), "{a:?}");
    }
}

#[test]
fn stored_response_round_trips_body_bytes() {
    let body = [0u8, 159, 146, 150, 255];
    let stored = StoredResponse::new(
        201,
        vec![("location".into(), "/charges/1".into())],
        &body,
        true,
    );
    let json = serde_json::to_vec(&stored).unwrap();
    let back: StoredResponse = serde_json::from_slice(&json).unwrap();
    assert_eq!(back.body, body.to_vec());
    assert!(String::from_utf8_lossy(&json).contains(r#""body_base64":"AJ+Slv8=""#));
    assert_eq!(
        ClaimResponse::read(
            &serde_json::to_vec(&ClaimResponse::Completed {
                response: stored.clone(),
                expires_in_ms: None,
                waited_ms: None
            })
            .unwrap()
        )
        .ok(),
        Some(ClaimResponse::Completed {
            response: stored.clone(),
            expires_in_ms: None,
            waited_ms: None
        })
    );
    let bad: Result<StoredResponse, _> =
        serde_json::from_str(r#"{"status":200,"headers":[],"body_base64":"!!","replayable":true}"#);
    assert!(bad.is_err());
    assert_eq!(back, stored);
}

#[test]
fn expiry_is_optional_both_ways() {
    // An older state API's answers still read (no expiry), and a newer one's carry it.
    let old = ClaimResponse::read(
        br#"{"outcome":"completed","response":{"status":200,"headers":[],"body_base64":"","replayable":true}}"#,
    )
    .unwrap();
    assert!(
        matches!(
            old,
            ClaimResponse::Completed {
                expires_in_ms: None,
                ..
            }
        ),
        "{old:?}"
    );
    let new = ClaimResponse::Completed {
        response: StoredResponse::new(200, vec![], b"", true),
        expires_in_ms: Some(86_399_000),
        waited_ms: None,
    };
    let json = serde_json::to_string(&new).unwrap();
    assert!(json.ends_with(r#","expires_in_ms":86399000}"#), "{json}");
    assert_eq!(ClaimResponse::read(json.as_bytes()), Ok(new));
    let w = WriteResponse::read(br#"{"state":"completed"}"#).unwrap();
    assert_eq!(w.expires_in_ms, None);
    assert_eq!(
        serde_json::to_string(&WriteResponse::released()).unwrap(),
        r#"{"state":"released"}"#
    );
    assert_eq!(
        WriteResponse::read(br#"{"state":"completed","expires_in_ms":5}"#),
        Ok(WriteResponse::completed(5))
    );
}

#[test]
fn record_states_have_one_name_each_in_the_database_and_on_the_wire() {
    for state in RecordState::ALL {
        assert_eq!(state.as_str().parse::<RecordState>(), Ok(state));
        assert_eq!(
            serde_json::to_string(&state).unwrap_or_default(),
            format!("\"{}\"", state.as_str())
        );
    }
    assert!("released".parse::<RecordState>().is_err());
    assert!(WriteResponse::read(br#"{"state":"gone"}"#).is_err());
}

#[test]
fn answers_tolerate_members_added_later_at_every_level() {
    assert_eq!(
        HeartbeatResponse::read(br#"{"lease_ms":1,"future":[1]}"#),
        Ok(HeartbeatResponse { lease_ms: 1 })
    );
    assert_eq!(
        ClaimResponse::read(br#"{"outcome":"mismatch","why":{"deep":[1]}}"#),
        Ok(ClaimResponse::Mismatch)
    );
    assert_eq!(
        WriteResponse::read(br#"{"state":"completed","expires_in_ms":null,"later":1}"#),
        Ok(WriteResponse {
            state: WriteState::Completed,
            expires_in_ms: None
        })
    );
    // Inside the stored response too: the answer is tolerant as a whole.
    let a = ClaimResponse::read(
        br#"{"outcome":"completed","response":{"status":204,"headers":[],"replayable":true,"encoding":"x"}}"#,
    );
    assert!(
        matches!(&a, Ok(ClaimResponse::Completed { response, .. }) if response.body.is_empty()),
        "{a:?}"
    );
}

#[test]
fn answers_that_are_wrong_are_refused() {
    for bad in [
        &br#"{"outcome":"maybe"}"#[..],
        br#"{"outcome":"claimed","token":1,"lease_ms":-1,"reclaimed":false}"#,
        br#"{"outcome":"claimed","token":1.5,"lease_ms":1,"reclaimed":false}"#,
        br#"{"outcome":"in_progress","retry_after_s":4294967296,"lease_remaining_ms":1}"#,
        br#"{"outcome":"completed"}"#,
        br#"{"outcome":"completed","response":{"status":70000,"headers":[],"replayable":true}}"#,
        br#"{"outcome":"completed","response":{"status":200,"headers":[["a"]],"replayable":true}}"#,
        br#"{"outcome":"completed","response":{"status":200,"headers":{},"replayable":true}}"#,
        br#"{"outcome":"completed","response":{"status":200,"replayable":true}}"#,
        br#"{"outcome":"completed","response":{"status":200,"headers":[],"body_base64":"!!","replayable":true}}"#,
        br#"{"outcome":"mismatch","outcome":"claimed"}"#,
        br#"[]"#,
        b"",
    ] {
        assert!(
            ClaimResponse::read(bad).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    assert!(WriteResponse::read(br#"{"expires_in_ms":1}"#).is_err());
    assert!(HeartbeatResponse::read(br#"{"lease_ms":"1"}"#).is_err());
}

#[test]
fn requests_refuse_unknown_fields() {
    let r: Result<ReleaseRequest, _> =
        serde_json::from_str(r#"{"key":"k","subject":"s","endpoint":"e","token":1,"extra":true}"#);
    assert!(r.is_err());
}
