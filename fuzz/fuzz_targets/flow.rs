//! Drives one worker with arbitrary event sequences of one stream, state API answers, ticks and
//! wakes: it never panics, never forwards and replies on the same stream, never replies twice,
//! and makes a stream's callouts only for that stream.
#![no_main]

use filter_core::config::Config;
use filter_core::flow::{RequestHead, ResponseHead};
use filter_core::worker::{CallId, CalloutResult, Effect, Owner, Worker};
use libfuzzer_sys::fuzz_target;

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

fn answers(b: u8, rest: &[u8]) -> CalloutResult {
    let canned: [&[u8]; 8] = [
        br#"{"outcome":"claimed","token":7,"lease_ms":1000,"reclaimed":false}"#,
        br#"{"outcome":"in_progress","retry_after_s":0,"lease_remaining_ms":5}"#,
        br#"{"outcome":"mismatch"}"#,
        br#"{"outcome":"completed","response":{"status":201,"headers":[["location","/x"],["set-cookie","a"]],"body_base64":"e30=","replayable":true},"expires_in_ms":100}"#,
        br#"{"outcome":"completed","response":{"status":201,"headers":[],"body_base64":"","replayable":false}}"#,
        br#"{"state":"completed","expires_in_ms":50}"#,
        b"",
        rest,
    ];
    match b % 10 {
        8 => CalloutResult::Failed("x".into()),
        9 => CalloutResult::answer(409, rest.to_vec()),
        i => CalloutResult::answer(200, canned[usize::from(i)].to_vec()),
    }
}

struct Check {
    replied: bool,
    resumed: bool,
    calls: Vec<CallId>,
}

impl Check {
    fn effects(&mut self, stream: u32, effects: &[Effect]) {
        for e in effects {
            match e {
                Effect::Reply { stream: s, .. } => {
                    assert_eq!(*s, stream);
                    assert!(!self.resumed, "replied after forwarding");
                    assert!(!self.replied, "replied twice");
                    self.replied = true;
                }
                Effect::ResumeRequest { stream: s } => {
                    assert_eq!(*s, stream);
                    assert!(!self.replied, "forwarded after replying");
                    self.resumed = true;
                }
                Effect::Dispatch(d) => self.calls.push(d.id),
                _ => {}
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (head_bytes, events) = data.split_at(data.len().min(4));
    let b = |i: usize| head_bytes.get(i).copied().unwrap_or(0);
    // Half of the inputs with the response let go before its outcome is stored.
    let config = if b(3) & 2 == 2 {
        CONFIG.replace(
            r#""max_stored_body_bytes": 16"#,
            r#""max_stored_body_bytes": 16, "complete_in_background": true"#,
        )
    } else {
        CONFIG.to_owned()
    };
    let Ok(cfg) = Config::parse(config.as_bytes()) else {
        return;
    };
    let mut w = Worker::new(cfg);
    const S: u32 = 7;
    let path = ["/checkout", "/r/1", "/other", "/checkout?q=1"][usize::from(b(0) % 4)];
    let key = ["k", "\"k\"", "", "a,b"][usize::from(b(1) % 4)];
    let mut headers = vec![
        (":method".to_owned(), "POST".to_owned()),
        (":path".to_owned(), path.to_owned()),
    ];
    if b(2) & 1 == 1 {
        headers.push(("idempotency-key".to_owned(), key.to_owned()));
    }
    if b(2) & 2 == 2 {
        headers.push(("x-jwt-sub".to_owned(), "u".to_owned()));
    }
    if b(2) & 4 == 4 {
        headers.push(("content-type".to_owned(), "application/json".to_owned()));
    }
    let mut check = Check {
        replied: false,
        resumed: false,
        calls: Vec::new(),
    };
    let mut now = 1_000u64;
    let step = w.on_request_headers(
        S,
        RequestHead {
            headers: &headers,
            metadata_subject: None,
        },
        b(3) & 1 == 1,
        now,
    );
    check.effects(S, &step.effects);
    let mut size = 0usize;
    for (i, chunk) in events.chunks(3).enumerate() {
        let op = chunk.first().copied().unwrap_or(0);
        let arg = chunk.get(1).copied().unwrap_or(0);
        let rest = chunk.get(2..).unwrap_or_default();
        now += u64::from(arg) * 7;
        let kind = op % 10;
        let effects = match kind {
            0 | 1 => {
                size += usize::from(arg % 40);
                w.on_request_body(S, size, kind == 1, &mut |n| Some(vec![b'{'; n]), now)
                    .effects
            }
            2 => {
                w.on_request_trailers(S, &mut |n| Some(vec![b' '; n]), now)
                    .effects
            }
            3 | 7 => {
                // The answer to one of the callouts made so far (or to one never made).
                let id = check
                    .calls
                    .get(usize::from(arg) % (check.calls.len() + 1))
                    .copied()
                    .unwrap_or(CallId(999));
                w.on_callout_answer(id, answers(arg, rest), now).effects
            }
            4 => {
                let status = ["200", "201", "404", "500", "503", "x"][usize::from(arg % 6)];
                let details = [
                    "via_upstream",
                    "no_healthy_upstream",
                    "upstream_reset_before_response_started{connection_termination}",
                ][i % 3];
                w.on_response_headers(
                    S,
                    ResponseHead {
                        headers: &[(":status".to_owned(), status.to_owned())],
                        details,
                        flags: u64::from(arg),
                    },
                    arg & 1 == 1,
                    now,
                )
                .effects
            }
            5 | 6 => {
                w.on_response_body(
                    S,
                    usize::from(arg),
                    kind == 6,
                    &mut |n| if arg & 2 == 2 { Some(vec![0; n]) } else { None },
                    now,
                )
                .effects
            }
            8 => {
                let effects = if arg & 1 == 1 {
                    w.on_tick(now)
                } else {
                    w.on_wake(now)
                };
                // The root context's callouts are the worker's own.
                for e in &effects {
                    if let Effect::Dispatch(d) = e {
                        assert_eq!(d.owner, Owner::Worker);
                    }
                }
                effects
            }
            _ => {
                w.on_response_trailers(S, &mut |n| Some(vec![1; n]), now)
                    .effects
            }
        };
        check.effects(S, &effects);
    }
    let effects = w.on_stream_done(S, now);
    check.effects(S, &effects);
    for e in &effects {
        if let Effect::Dispatch(d) = e {
            assert_eq!(
                d.owner,
                Owner::Worker,
                "a stream that ended makes no callout of its own"
            );
        }
    }
});
