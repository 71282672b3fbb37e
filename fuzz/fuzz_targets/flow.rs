//! Drives the per-request state machine with arbitrary event sequences and state API answers:
//! it never panics, never forwards and replies on the same stream, and never asks to resume a
//! request it did not pause.
#![no_main]

use filter::config::Config;
use filter::flow::{Callout, Effect, Flow, RequestHead};
use libfuzzer_sys::fuzz_target;
use std::rc::Rc;

const CONFIG: &str = r#"{
  "state_api": {"cluster": "s", "authority": "s", "token": "t"},
  "subject": {"header": "x-jwt-sub"},
  "routes": [
    {"method": "POST", "path": "/checkout", "key": "required"},
    {"method": "POST", "prefix": "/r/", "key": "optional", "on_5xx": "release", "on_state_unavailable": "fail_open"}
  ],
  "max_request_body_bytes": 64,
  "max_stored_body_bytes": 16
}"#;

fn answers(b: u8, rest: &[u8]) -> Callout {
    let canned: [&[u8]; 8] = [
        br#"{"outcome":"claimed","token":7,"lease_ms":1000,"reclaimed":false}"#,
        br#"{"outcome":"in_progress","retry_after_s":0,"lease_remaining_ms":5}"#,
        br#"{"outcome":"mismatch"}"#,
        br#"{"outcome":"completed","response":{"status":201,"headers":[["location","/x"],["set-cookie","a"]],"body_base64":"e30=","replayable":true}}"#,
        br#"{"outcome":"completed","response":{"status":201,"headers":[],"body_base64":"","replayable":false}}"#,
        br#"{"state":"completed"}"#,
        b"",
        rest,
    ];
    match b % 10 {
        8 => Callout::Failed("x".into()),
        9 => Callout::Answer { status: 409, body: rest.to_vec() },
        i => Callout::Answer { status: 200, body: canned[usize::from(i)].to_vec() },
    }
}

fuzz_target!(|data: &[u8]| {
    let (head_bytes, events) = data.split_at(data.len().min(4));
    let b = |i: usize| head_bytes.get(i).copied().unwrap_or(0);
    // Half of the inputs with the response let go before its outcome is stored.
    let config = if b(3) & 2 == 2 {
        CONFIG.replace(r#""max_stored_body_bytes": 16"#, r#""max_stored_body_bytes": 16, "complete_in_background": true"#)
    } else {
        CONFIG.to_owned()
    };
    let Ok(cfg) = Config::parse(config.as_bytes()) else { return };
    let mut flow = Flow::new(Rc::new(cfg));
    let path = ["/checkout", "/r/1", "/other", "/checkout?q=1"][usize::from(b(0) % 4)];
    let key = ["k", "\"k\"", "", "a,b"][usize::from(b(1) % 4)];
    let mut headers = vec![(":method".to_owned(), "POST".to_owned()), (":path".to_owned(), path.to_owned())];
    if b(2) & 1 == 1 {
        headers.push(("idempotency-key".to_owned(), key.to_owned()));
    }
    if b(2) & 2 == 2 {
        headers.push(("x-jwt-sub".to_owned(), "u".to_owned()));
    }
    if b(2) & 4 == 4 {
        headers.push(("content-type".to_owned(), "application/json".to_owned()));
    }
    let mut replied = false;
    let mut resumed = false;
    let mut check = |effects: &[Effect]| {
        for e in effects {
            match e {
                Effect::Reply(_) => {
                    assert!(!resumed, "replied after forwarding");
                    assert!(!replied, "replied twice");
                    replied = true;
                }
                Effect::ResumeRequest => {
                    assert!(!replied, "forwarded after replying");
                    resumed = true;
                }
                _ => {}
            }
        }
    };
    let step = flow.on_request_headers(RequestHead { headers: &headers, metadata_subject: None }, b(3) & 1 == 1);
    check(&step.effects);
    let mut size = 0usize;
    for (i, chunk) in events.chunks(3).enumerate() {
        let op = chunk.first().copied().unwrap_or(0);
        let arg = chunk.get(1).copied().unwrap_or(0);
        let rest = chunk.get(2..).unwrap_or_default();
        let kind = op % 10;
        let step = match kind {
            0 | 1 => {
                size += usize::from(arg % 40);
                flow.on_request_body(size, kind == 1, |n| Some(vec![b'{'; n]))
            }
            2 => flow.on_request_trailers(|n| Some(vec![b' '; n])),
            3 => flow.on_claim_answer(answers(arg, rest)),
            4 => {
                let status = ["200", "201", "404", "500", "503", "x"][usize::from(arg % 6)];
                let details = ["via_upstream", "no_healthy_upstream", "upstream_reset_before_response_started{connection_termination}"][i % 3];
                flow.on_response_headers(&[(":status".to_owned(), status.to_owned())], details, u64::from(arg), arg & 1 == 1)
            }
            5 | 6 => flow.on_response_body(usize::from(arg), kind == 6, |n| if arg & 2 == 2 { Some(vec![0; n]) } else { None }),
            7 => flow.on_write_answer(answers(arg, rest)),
            // The worker's answer to an offered complete (or one out of turn).
            9 => flow.complete_in_background(arg & 1 == 1),
            _ => flow.on_response_trailers(|n| Some(vec![1; n])),
        };
        check(&step.effects);
    }
    let step = flow.on_stream_done();
    check(&step.effects);
});
