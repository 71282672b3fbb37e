//! Scenario tests of the worker and its flows (natively and in wasm): events in, effects out.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use crate::flow::{RequestHead, ResponseHead, Verdict, RESERVE_PER_SUBJECT};
use crate::metrics::Metric;
use crate::reply::LocalReply;
use contract::wire::{
    ClaimRequest, ClaimResponse, CompleteRequest, HeartbeatRequest, ReleaseRequest, StoredResponse,
    UnknownRequest, WriteResponse, CLAIM_PATH, COMPLETE_PATH, ENDPOINT_HEADER,
    FENCING_TOKEN_HEADER, FINGERPRINT_HEADER, HEARTBEAT_PATH, OUTCOME_EXECUTED, OUTCOME_HEADER,
    OUTCOME_NOT_EXECUTED, OUTCOME_RUNNING, RELEASE_PATH, SUBJECT_HEADER, UNKNOWN_PATH,
};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// Every claim is its own callout here (`batch_max: 1`), so a scenario reads each
/// stream's claim; batching has its scenarios in `batching.rs`.
const CONFIG: &str = r#"{
  "state_api": {"cluster": "state_api", "authority": "state-api", "token": "t", "timeout_ms": 1000},
  "batch_max": 1,
  "subject": {"header": "x-jwt-sub"},
  "routes": [
    {"method": "POST", "path": "/checkout", "key": "required"},
    {"method": "POST", "path": "/refunds", "key": "required", "on_5xx": "release", "on_state_unavailable": "fail_open"},
    {"method": "POST", "prefix": "/carts/", "key": "optional"}
  ],
  "max_request_body_bytes": 100,
  "max_stored_body_bytes": 10,
  "replay_extra_headers": ["x-charge-id"]
}"#;

fn with(patch: &str) -> String {
    CONFIG.replacen(
        "\"max_request_body_bytes\"",
        &format!("{patch} \"max_request_body_bytes\""),
        1,
    )
}

fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect()
}

fn req_headers(path: &str, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v = h(&[
        (":method", "POST"),
        (":path", path),
        (":authority", "shop"),
        ("x-jwt-sub", "user-1"),
    ]);
    v.extend(h(extra));
    v
}

fn answer<T: serde::Serialize>(v: &T) -> CalloutResult {
    CalloutResult::answer(200, serde_json::to_vec(v).unwrap())
}

fn status(status: u16, body: &[u8]) -> CalloutResult {
    CalloutResult::answer(status, body.to_vec())
}

fn written() -> CalloutResult {
    answer(&WriteResponse::completed(86_400_000))
}

fn claimed(token: i64) -> CalloutResult {
    answer(&ClaimResponse::Claimed {
        token,
        lease_ms: 30_000,
        reclaimed: false,
        max_body_bytes: None,
        retention_s: None,
    })
}

fn stored_201() -> StoredResponse {
    StoredResponse::new(
        201,
        h(&[
            ("content-type", "application/json"),
            ("location", "/c/1"),
            ("set-cookie", "s=1"),
            ("x-charge-id", "ch_1"),
        ]),
        b"{\"id\":1}",
        true,
    )
}

/// A worker with a clock, and the streams it has seen.
struct Harness {
    w: Worker,
    now: u64,
    next_stream: StreamId,
}

/// What a step did, with the helpers the tests read it with.
#[derive(Debug, Clone)]
struct Seen {
    verdict: Verdict,
    effects: Vec<Effect>,
}

impl From<Step> for Seen {
    fn from(s: Step) -> Self {
        Self {
            verdict: s.verdict,
            effects: s.effects,
        }
    }
}

impl From<Vec<Effect>> for Seen {
    fn from(effects: Vec<Effect>) -> Self {
        Self {
            verdict: Verdict::Continue,
            effects,
        }
    }
}

impl Seen {
    fn reply(&self) -> &LocalReply {
        self.effects
            .iter()
            .find_map(|e| match e {
                Effect::Reply { reply, .. } => Some(reply),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no reply in {self:?}"))
    }
    fn replied(&self) -> bool {
        self.effects
            .iter()
            .any(|e| matches!(e, Effect::Reply { .. }))
    }
    fn dispatches(&self, path: &str) -> Vec<&Dispatch> {
        self.effects
            .iter()
            .filter_map(|e| match e {
                Effect::Dispatch(d) if d.header(":path") == Some(path) => Some(d),
                _ => None,
            })
            .collect()
    }
    fn dispatch(&self, path: &str) -> &Dispatch {
        let all = self.dispatches(path);
        assert_eq!(all.len(), 1, "one {path} in {self:?}");
        all[0]
    }
    fn claims(&self) -> bool {
        !self.dispatches(CLAIM_PATH).is_empty()
    }
    fn claim(&self) -> ClaimRequest {
        serde_json::from_slice(&self.dispatch(CLAIM_PATH).body).unwrap()
    }
    fn complete(&self) -> CompleteRequest {
        serde_json::from_slice(&self.dispatch(COMPLETE_PATH).body).unwrap()
    }
    fn counts(&self) -> Vec<Metric> {
        self.effects
            .iter()
            .filter_map(|e| match e {
                Effect::Count(m) => Some(*m),
                _ => None,
            })
            .collect()
    }
    fn resumes_request(&self) -> bool {
        self.effects
            .iter()
            .any(|e| matches!(e, Effect::ResumeRequest { .. }))
    }
    fn resumes_response(&self) -> bool {
        self.effects
            .iter()
            .any(|e| matches!(e, Effect::ResumeResponse { .. }))
    }
    fn last(&self) -> Option<&Effect> {
        self.effects
            .iter()
            .rev()
            .find(|e| !matches!(e, Effect::Log(..)))
    }
}

fn problem_type(r: &LocalReply) -> String {
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    v["type"].as_str().unwrap().to_owned()
}

fn header<'a>(r: &'a LocalReply, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

impl Harness {
    fn new(config: &str) -> Self {
        Self {
            w: Worker::new(Config::parse(config.as_bytes()).unwrap()),
            now: 1_000_000,
            next_stream: 0,
        }
    }

    fn stream(&mut self) -> StreamId {
        self.next_stream += 1;
        self.next_stream
    }

    fn advance(&mut self, ms: u64) {
        self.now += ms;
    }

    fn headers(&mut self, s: StreamId, hs: &[(String, String)], eos: bool) -> Seen {
        self.head(
            s,
            RequestHead {
                headers: hs,
                metadata_subject: None,
            },
            eos,
        )
    }

    fn head(&mut self, s: StreamId, head: RequestHead<'_>, eos: bool) -> Seen {
        self.w.on_request_headers(s, head, eos, self.now).into()
    }

    /// The whole body at once (cumulative size, end of stream).
    fn body(&mut self, s: StreamId, body: &[u8]) -> Seen {
        let mut read = |n: usize| Some(body[..n].to_vec());
        self.w
            .on_request_body(s, body.len(), true, &mut read, self.now)
            .into()
    }

    fn body_part(&mut self, s: StreamId, size: usize) -> Seen {
        self.w
            .on_request_body(
                s,
                size,
                false,
                &mut |_| panic!("not before the end"),
                self.now,
            )
            .into()
    }

    /// A protected request through headers and body: the step that ends the body.
    fn send(&mut self, s: StreamId, path: &str, who: &str, body: &[u8]) -> Seen {
        let hs = h(&[
            (":method", "POST"),
            (":path", path),
            ("x-jwt-sub", who),
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
        ]);
        assert_eq!(self.headers(s, &hs, false).verdict, Verdict::Pause);
        self.body(s, body)
    }

    fn answer(&mut self, d: &Dispatch, result: CalloutResult) -> Seen {
        self.w.on_callout_answer(d.id, result, self.now).into()
    }

    /// The claim of the step's stream answered.
    fn answer_claim(&mut self, step: &Seen, result: CalloutResult) -> Seen {
        let d = step.dispatch(CLAIM_PATH).clone();
        self.answer(&d, result)
    }

    /// A request of `path` with body `body` and key `k1` on a new stream, claimed with `token`.
    fn claimed(&mut self, path: &str, body: &[u8], token: i64) -> (StreamId, ClaimRequest) {
        self.claimed_key("k1", path, body, token)
    }

    fn claimed_key(
        &mut self,
        key: &str,
        path: &str,
        body: &[u8],
        token: i64,
    ) -> (StreamId, ClaimRequest) {
        let (s, step) = self.keyed(key, path, body);
        assert_eq!(step.verdict, Verdict::Pause);
        let claim = step.claim();
        let step = self.answer_claim(&step, claimed(token));
        assert!(step.resumes_request());
        assert!(self.w.awaits_response(s));
        (s, claim)
    }

    /// A request to `path` with `key` and `body` on a new stream, through its body.
    fn keyed(&mut self, key: &str, path: &str, body: &[u8]) -> (StreamId, Seen) {
        let s = self.stream();
        let hs = req_headers(
            path,
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ],
        );
        assert_eq!(self.headers(s, &hs, false).verdict, Verdict::Pause);
        (s, self.body(s, body))
    }

    fn response_headers(
        &mut self,
        s: StreamId,
        hs: &[(String, String)],
        details: &str,
        flags: u64,
        eos: bool,
    ) -> Seen {
        self.w
            .on_response_headers(
                s,
                ResponseHead {
                    headers: hs,
                    details,
                    flags,
                },
                eos,
                self.now,
            )
            .into()
    }

    fn ok_response(&mut self, s: StreamId, code: &str, eos: bool) -> Seen {
        self.response_headers(s, &h(&[(":status", code)]), "via_upstream", 0, eos)
    }

    fn response_body(
        &mut self,
        s: StreamId,
        size: usize,
        eos: bool,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
    ) -> Seen {
        self.w.on_response_body(s, size, eos, read, self.now).into()
    }

    fn done(&mut self, s: StreamId) -> Seen {
        self.w.on_stream_done(s, self.now).into()
    }

    fn tick(&mut self) -> Seen {
        self.w.on_tick(self.now).into()
    }
}

fn never(_: usize) -> Option<Vec<u8>> {
    panic!("must not read")
}

// ---------------------------------------------------------------------------------------------
// Request

#[test]
fn unprotected_routes_and_methods_pass_untouched() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.headers(s, &h(&[(":method", "GET"), (":path", "/checkout")]), true);
    assert_eq!((step.verdict, step.effects.len()), (Verdict::Continue, 0));
    assert_eq!(t.w.flow_state(s), Some("passthrough"));
    let step: Seen = t.w.on_request_body(s, 10, true, &mut never, t.now).into();
    assert_eq!((step.verdict, step.effects.len()), (Verdict::Continue, 0));
    assert!(!t.w.awaits_response(s));
    for path in ["/other", "/checkout/1"] {
        let s = t.stream();
        let step = t.headers(s, &req_headers(path, &[("idempotency-key", "k")]), false);
        assert_eq!(step.verdict, Verdict::Continue, "{path}");
    }
}

#[test]
fn optional_route_without_key_passes_but_loses_a_forged_fencing_token() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.headers(
        s,
        &req_headers("/carts/9?x=1", &[("idempotency-fencing-token", "999")]),
        false,
    );
    assert_eq!(step.verdict, Verdict::Continue);
    assert_eq!(
        step.effects,
        vec![Effect::RemoveRequestHeader {
            stream: s,
            name: FENCING_TOKEN_HEADER
        }]
    );
    // With a key the optional route is protected.
    let s = t.stream();
    let step = t.headers(
        s,
        &req_headers("/carts/9", &[("idempotency-key", "k")]),
        false,
    );
    assert_eq!(step.verdict, Verdict::Pause);
}

#[test]
fn missing_or_bad_key_is_400() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.headers(s, &req_headers("/checkout", &[]), false);
    let r = step.reply();
    assert_eq!(r.status, 400);
    assert_eq!(problem_type(r), "/problems/missing-idempotency-key");
    assert_eq!(header(r, "content-type"), Some("application/problem+json"));
    assert_eq!(header(r, "cache-control"), Some("no-store"));
    assert_eq!(step.counts(), vec![Metric::BadKey400]);
    assert_eq!(t.w.flow_state(s), Some("replied"));
    // Response callbacks after our own reply leave it alone.
    assert!(!t.w.awaits_response(s));
    let step = t.response_body(s, 10, true, &mut never);
    assert_eq!((step.verdict, step.effects.len()), (Verdict::Continue, 0));

    for bad in [
        vec![("idempotency-key", "a,b")],
        vec![("idempotency-key", "a"), ("idempotency-key", "a")],
        vec![("idempotency-key", "")],
    ] {
        let s = t.stream();
        let step = t.headers(s, &req_headers("/checkout", &bad), false);
        let r = step.reply();
        assert_eq!(
            (r.status, problem_type(r).as_str()),
            (400, "/problems/invalid-idempotency-key"),
            "{bad:?}"
        );
    }
}

#[test]
fn no_subject_is_401() {
    let mut t = Harness::new(CONFIG);
    for hs in [
        h(&[
            (":method", "POST"),
            (":path", "/checkout"),
            ("idempotency-key", "k"),
        ]),
        h(&[
            (":method", "POST"),
            (":path", "/checkout"),
            ("idempotency-key", "k"),
            ("x-jwt-sub", ""),
        ]),
        h(&[
            (":method", "POST"),
            (":path", "/checkout"),
            ("idempotency-key", "k"),
            ("x-jwt-sub", "a"),
            ("x-jwt-sub", "b"),
        ]),
    ] {
        let s = t.stream();
        let step = t.headers(s, &hs, false);
        assert_eq!(step.reply().status, 401);
        assert_eq!(step.counts(), vec![Metric::Unauthenticated401]);
    }
}

#[test]
fn subject_from_metadata() {
    let cfg = CONFIG.replace(
        r#""subject": {"header": "x-jwt-sub"}"#,
        r#""subject": {"metadata": ["envoy.filters.http.jwt_authn", "jwt_payload", "sub"]}"#,
    );
    let mut t = Harness::new(&cfg);
    let hs = req_headers("/checkout", &[("idempotency-key", "k")]);
    // The header is ignored: only the metadata counts.
    let s = t.stream();
    assert_eq!(t.headers(s, &hs, true).reply().status, 401);
    let s = t.stream();
    let step = t.head(
        s,
        RequestHead {
            headers: &hs,
            metadata_subject: Some("meta-user"),
        },
        true,
    );
    assert_eq!(step.claim().subject, "meta-user");
}

#[test]
fn too_large_is_413_from_content_length_or_while_buffering() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.headers(
        s,
        &req_headers(
            "/checkout",
            &[("idempotency-key", "k"), ("content-length", "101")],
        ),
        false,
    );
    assert_eq!(step.reply().status, 413);
    assert_eq!(step.counts(), vec![Metric::TooLarge413]);

    let s = t.stream();
    let step = t.headers(
        s,
        &req_headers("/checkout", &[("idempotency-key", "k")]),
        false,
    );
    assert_eq!((step.verdict, step.effects.len()), (Verdict::Pause, 0));
    assert_eq!(t.body_part(s, 60).verdict, Verdict::Pause);
    let step = t.body_part(s, 101);
    assert_eq!(step.reply().status, 413);
    assert_eq!(t.w.flow_state(s), Some("replied"));
}

/// Issue 38: the request bodies a worker holds before forwarding are bounded in total
/// (`max_buffered_bytes`, here 250 bytes: two bodies of the 100-byte limit and a half; one
/// subject may hold all of it here).
#[test]
fn request_bodies_held_are_bounded_per_worker_and_over_it_is_503_nothing_claimed() {
    let mut t = Harness::new(&with(
        r#""max_buffered_bytes": 250, "max_buffered_bytes_per_subject": 250,"#,
    ));
    let announced = |t: &mut Harness, key: &str, len: &str| {
        let s = t.stream();
        let hs = req_headers(
            "/checkout",
            &[("idempotency-key", key), ("content-length", len)],
        );
        (s, t.headers(s, &hs, false))
    };
    let (a, step) = announced(&mut t, "a", "100");
    assert_eq!((step.verdict, step.effects.len()), (Verdict::Pause, 0));
    let (b, _) = announced(&mut t, "b", "100");
    assert_eq!(
        t.w.usage().held_request_bytes,
        200,
        "held from the headers on"
    );
    // A third announced body does not fit: 503 + Retry-After at its headers, nothing claimed.
    let (c, step) = announced(&mut t, "c", "60");
    assert_eq!(step.reply().status, 503);
    assert_eq!(header(step.reply(), "retry-after"), Some("1"));
    assert_eq!(problem_type(step.reply()), "/problems/edge-buffers-full");
    assert_eq!(step.counts(), vec![Metric::BuffersFull503]);
    assert!(!step.claims());
    assert_eq!(t.w.flow_state(c), Some("replied"));
    // One without a Content-Length is counted as its body arrives, and refused when it
    // would go over.
    let (d, step) = announced(&mut t, "d", "");
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(t.body_part(d, 40).verdict, Verdict::Pause);
    assert_eq!(t.w.usage().held_request_bytes, 240);
    let step = t.body_part(d, 60);
    assert_eq!(step.reply().status, 503);
    assert!(!step.claims());
    assert_eq!(t.w.usage().held_request_bytes, 200, "its bytes are let go");
    // A body that ends is claimed and no longer held; a stream that ends lets go of its bytes.
    let body = [b' '; 100];
    let step = t.body(a, &body);
    assert!(step.claims());
    assert_eq!(t.w.usage().held_request_bytes, 100);
    t.w.on_stream_done(b, t.now);
    assert_eq!(t.w.usage().held_request_bytes, 0);
    let (_, step) = announced(&mut t, "e", "100");
    assert_eq!(step.verdict, Verdict::Pause, "room again");
}

/// Issue 49: one subject's requests hold at most `max_buffered_bytes_per_subject` of the
/// worker's bound (here 150 of 400 bytes), so that one caller's slow or unfinished bodies
/// (declaring the largest body, sending a byte a second) cannot refuse every other caller's.
#[test]
fn one_subject_holds_at_most_its_share_of_the_bound_and_others_still_fit() {
    let mut t = Harness::new(&with(
        r#""max_buffered_bytes": 400, "max_buffered_bytes_per_subject": 150,"#,
    ));
    let announced = |t: &mut Harness, who: &str, key: &str, len: &str| {
        let s = t.stream();
        let mut hs = req_headers(
            "/checkout",
            &[("idempotency-key", key), ("content-length", len)],
        );
        for (name, value) in &mut hs {
            if name == "x-jwt-sub" {
                *value = who.to_owned();
            }
        }
        (s, t.headers(s, &hs, false))
    };
    let (m1, step) = announced(&mut t, "mallory", "m1", "100");
    assert_eq!(step.verdict, Verdict::Pause);
    // Mallory's second body would take her over her share: 503 + Retry-After, nothing
    // claimed, counted apart from a full worker.
    let (m2, step) = announced(&mut t, "mallory", "m2", "100");
    assert_eq!(step.reply().status, 503);
    assert_eq!(header(step.reply(), "retry-after"), Some("1"));
    assert_eq!(problem_type(step.reply()), "/problems/edge-buffers-full");
    assert_eq!(step.counts(), vec![Metric::SubjectBuffersFull503]);
    assert!(!step.claims());
    assert_eq!(t.w.flow_state(m2), Some("replied"));
    // What is left of her share still fits.
    let (_, step) = announced(&mut t, "mallory", "m3", "50");
    assert_eq!(step.verdict, Verdict::Pause);
    // Other subjects fit in the rest of the bound.
    let (a1, step) = announced(&mut t, "alice", "a1", "100");
    assert_eq!(
        step.verdict,
        Verdict::Pause,
        "alice is not refused for mallory"
    );
    let (b1, step) = announced(&mut t, "bob", "b1", "100");
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(t.w.usage().held_request_bytes, 350);
    // The worker's bound still holds for everyone (50 bytes of room left).
    let (_, step) = announced(&mut t, "carol", "c1", "100");
    assert_eq!(step.counts(), vec![Metric::BuffersFull503]);
    // A body without a Content-Length counts against its subject as it arrives.
    t.w.on_stream_done(b1, t.now);
    let (a2, step) = announced(&mut t, "alice", "a2", "");
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(t.body_part(a2, 40).verdict, Verdict::Pause);
    assert_eq!(t.w.usage().held_request_bytes, 290);
    let step = t.body_part(a2, 60);
    assert_eq!(step.counts(), vec![Metric::SubjectBuffersFull503]);
    assert_eq!(t.w.usage().held_request_bytes, 250, "its bytes are let go");
    // A body that ends is claimed and no longer held: room in mallory's share again.
    let step = t.body(m1, &[b' '; 100]);
    assert!(step.claims());
    let (_, step) = announced(&mut t, "mallory", "m4", "100");
    assert_eq!(step.verdict, Verdict::Pause, "room in her share again");
    t.w.on_stream_done(a1, t.now);
    assert_eq!(t.w.usage().held_request_bytes, 150);
    // A stream that ends gives its subject's bytes back: alice's whole share is free again.
    let (_, step) = announced(&mut t, "alice", "a3", "100");
    assert_eq!(step.verdict, Verdict::Pause, "alice's share is free again");
    let (_, step) = announced(&mut t, "alice", "a4", "50");
    assert_eq!(step.verdict, Verdict::Pause, "all of it");
}

/// Issue 49: many callers' large bodies held open together, each within its share, fill the
/// bound but its reserve (an eighth: 1 of 8 MiB here): a caller who holds little still gets
/// in, a large body or a caller who already holds much does not.
#[test]
fn the_bound_s_reserve_is_kept_for_callers_who_hold_little() {
    const MIB: u64 = 1 << 20;
    let cfg = with(r#""max_buffered_bytes": 8388608,"#).replacen(
        "\"max_request_body_bytes\": 100",
        "\"max_request_body_bytes\": 1048576",
        1,
    );
    let mut t = Harness::new(&cfg);
    let announced = |t: &mut Harness, who: &str, key: &str, len: Option<u64>| {
        let s = t.stream();
        let len = len.map(|n| n.to_string()).unwrap_or_default();
        let mut hs = req_headers(
            "/checkout",
            &[("idempotency-key", key), ("content-length", len.as_str())],
        );
        for (name, value) in &mut hs {
            if name == "x-jwt-sub" {
                *value = who.to_owned();
            }
        }
        (s, t.headers(s, &hs, false))
    };
    // Seven callers hold 1 MiB each: the bound but its reserve.
    for i in 0..7 {
        let (_, step) = announced(&mut t, &format!("burst-{i}"), &format!("b{i}"), Some(MIB));
        assert_eq!(step.verdict, Verdict::Pause, "caller {i}");
    }
    assert_eq!(t.w.usage().held_request_bytes, 7 * MIB);
    // An eighth caller's large body would reach into the reserve: refused, counted apart.
    let (_, step) = announced(&mut t, "burst-7", "b7", Some(MIB));
    assert_eq!(step.counts(), vec![Metric::ReserveBuffersFull503]);
    assert_eq!(step.reply().status, 503);
    assert_eq!(header(step.reply(), "retry-after"), Some("1"));
    assert_eq!(problem_type(step.reply()), "/problems/edge-buffers-full");
    // So is a small body of a caller who already holds a large one.
    let (_, step) = announced(&mut t, "burst-0", "b0-small", Some(200));
    assert_eq!(step.counts(), vec![Metric::ReserveBuffersFull503]);
    // A caller who holds little gets in, up to RESERVE_PER_SUBJECT in all.
    let (a1, step) = announced(&mut t, "alice", "a1", Some(200));
    assert_eq!(step.verdict, Verdict::Pause, "alice's ordinary request");
    let (_, step) = announced(&mut t, "alice", "a2", Some(200));
    assert_eq!(step.verdict, Verdict::Pause, "and a second at once");
    let (_, step) = announced(&mut t, "alice", "a3", Some(RESERVE_PER_SUBJECT));
    assert_eq!(
        step.counts(),
        vec![Metric::ReserveBuffersFull503],
        "not past it"
    );
    let (_, step) = announced(&mut t, "alice", "a3b", Some(RESERVE_PER_SUBJECT - 400));
    assert_eq!(step.verdict, Verdict::Pause, "up to it, this body included");
    let (c1, step) = announced(&mut t, "carol", "c1", Some(1000));
    assert_eq!(
        step.verdict,
        Verdict::Pause,
        "another caller who holds little"
    );
    // A body without a Content-Length is counted as it arrives, and refused on the way once
    // it would take its caller past what the reserve lets one caller hold.
    let (d1, step) = announced(&mut t, "dave", "d1", None);
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(t.body_part(d1, 60_000).verdict, Verdict::Pause);
    let step = t.body_part(d1, 70_000);
    assert_eq!(step.counts(), vec![Metric::ReserveBuffersFull503]);
    // A body that ends is claimed and lets go of the reserve it held.
    let step = t.body(a1, &[b' '; 200]);
    assert!(step.claims());
    t.w.on_stream_done(c1, t.now);
    assert_eq!(
        t.w.usage().held_request_bytes,
        7 * MIB + 200 + RESERVE_PER_SUBJECT - 400
    );
    let (_, step) = announced(&mut t, "alice", "a4", Some(200));
    assert_eq!(
        step.verdict,
        Verdict::Pause,
        "room in alice's part of the reserve again"
    );
}

#[test]
fn claim_carries_key_subject_endpoint_and_canonical_fingerprint() {
    let mut t = Harness::new(CONFIG);
    let (_, a) = t.claimed("/checkout?b=2", br#"{"amount":1,"card":{"n":"4111"}}"#, 42);
    assert_eq!(a.key, "k1");
    assert_eq!(a.subject, "user-1");
    assert_eq!(a.endpoint, "POST /checkout");
    assert_eq!(a.fingerprint_alg, "sha256-jcs-v2");
    assert_eq!(a.lease_ms, Some(30_000));
    let (_, b) = t.claimed(
        "/checkout?b=2",
        b"{ \"card\": {\"n\": \"4111\"}, \"amount\": 1.0 }",
        43,
    );
    assert_eq!(a.fingerprint, b.fingerprint);
    let (_, c) = t.claimed("/checkout?b=3", br#"{"amount":1,"card":{"n":"4111"}}"#, 44);
    assert_ne!(a.fingerprint, c.fingerprint);
    // A quoted key is the same key, and it is forwarded in bare form with the fencing token.
    let s = t.stream();
    let step = t.headers(
        s,
        &req_headers("/checkout", &[("idempotency-key", "\"k1\"")]),
        true,
    );
    assert_eq!(step.claim().key, "k1");
    let d = step.dispatch(CLAIM_PATH).clone();
    assert_eq!(d.owner, Owner::Stream(s));
    assert_eq!(d.header("authorization"), Some("Bearer t"));
    assert_eq!(d.header(":authority"), Some("state-api"));
    let step = t.answer(
        &d,
        answer(&ClaimResponse::Claimed {
            token: 7,
            lease_ms: 30_000,
            reclaimed: true,
            max_body_bytes: None,
            retention_s: None,
        }),
    );
    assert!(step.effects.contains(&Effect::SetRequestHeader {
        stream: s,
        name: "idempotency-key",
        value: "k1".into()
    }));
    assert!(step.effects.contains(&Effect::SetRequestHeader {
        stream: s,
        name: FENCING_TOKEN_HEADER,
        value: "7".into()
    }));
    assert_eq!(step.counts(), vec![Metric::Claimed]);
    assert_eq!(step.last(), Some(&Effect::ResumeRequest { stream: s }));
    assert_eq!(
        t.w.usage().claims,
        4,
        "every claim is extended by the worker"
    );
}

#[test]
fn duplicate_json_members_are_400() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", br#"{"amount":1,"amount":1000}"#);
    let r = step.reply();
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (400, "/problems/duplicate-json-member")
    );
    assert_eq!(step.counts(), vec![Metric::BadBody400]);
}

#[test]
fn trailers_end_the_body() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    t.headers(
        s,
        &req_headers("/checkout", &[("idempotency-key", "k")]),
        false,
    );
    assert_eq!(t.body_part(s, 3).verdict, Verdict::Pause);
    let step: Seen =
        t.w.on_request_trailers(
            s,
            &mut |n| {
                assert_eq!(n, 3);
                Some(b"abc".to_vec())
            },
            t.now,
        )
        .into();
    assert_eq!(step.claim().fingerprint_alg, "sha256-raw-v2");
}

#[test]
fn unreadable_body_is_answered() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    t.headers(
        s,
        &req_headers("/checkout", &[("idempotency-key", "k")]),
        false,
    );
    let step: Seen = t.w.on_request_body(s, 3, true, &mut |_| None, t.now).into();
    assert_eq!(step.reply().status, 500);
}

// ---------------------------------------------------------------------------------------------
// The claim's answer

fn asked(t: &mut Harness) -> Seen {
    let s = t.stream();
    t.headers(
        s,
        &req_headers("/checkout", &[("idempotency-key", "k")]),
        true,
    )
}

#[test]
fn in_progress_is_409_with_retry_after() {
    let mut t = Harness::new(CONFIG);
    let step = asked(&mut t);
    let step = t.answer_claim(
        &step,
        answer(&ClaimResponse::InProgress {
            retry_after_s: 0,
            lease_remaining_ms: 10,
            waited_ms: None,
        }),
    );
    let r = step.reply();
    assert_eq!((r.status, header(r, "retry-after")), (409, Some("1")));
    assert_eq!(problem_type(r), "/problems/request-in-progress");
    assert_eq!(step.counts(), vec![Metric::InProgress409]);
}

#[test]
fn mismatch_is_422() {
    let mut t = Harness::new(CONFIG);
    let step = asked(&mut t);
    let step = t.answer_claim(&step, answer(&ClaimResponse::Mismatch));
    let r = step.reply();
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (422, "/problems/idempotency-key-reused")
    );
    assert_eq!(step.counts(), vec![Metric::Mismatch422]);
}

#[test]
fn completed_is_replayed_with_allowlisted_headers() {
    let mut t = Harness::new(CONFIG);
    let step = asked(&mut t);
    let step = t.answer_claim(
        &step,
        answer(&ClaimResponse::Completed {
            response: stored_201(),
            expires_in_ms: None,
            waited_ms: None,
        }),
    );
    let r = step.reply();
    assert_eq!(r.status, 201);
    assert_eq!(r.body, b"{\"id\":1}");
    assert_eq!(
        r.headers,
        h(&[
            ("content-type", "application/json"),
            ("location", "/c/1"),
            ("x-charge-id", "ch_1"),
            ("idempotent-replayed", "true")
        ])
    );
    assert_eq!(step.counts(), vec![Metric::Replayed]);
}

#[test]
fn completed_but_not_replayable_is_409_with_location() {
    let mut t = Harness::new(CONFIG);
    let step = asked(&mut t);
    let stored = StoredResponse::new(201, h(&[("location", "/c/1")]), b"", false);
    let step = t.answer_claim(
        &step,
        answer(&ClaimResponse::Completed {
            response: stored,
            expires_in_ms: None,
            waited_ms: None,
        }),
    );
    let r = step.reply();
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (409, "/problems/outcome-not-replayable")
    );
    assert_eq!(header(r, "location"), Some("/c/1"));
    assert_eq!(header(r, "retry-after"), None);
    assert_eq!(step.counts(), vec![Metric::NotReplayable]);
}

#[test]
fn state_api_trouble_fails_closed_with_503() {
    for bad in [
        CalloutResult::Failed("reset".into()),
        status(500, b"oops"),
        status(429, b"{}"),
        status(200, b"{\"outcome\":\"maybe\"}"),
        status(
            200,
            br#"{"outcome":"completed","response":{"status":200,"headers":[],"body_base64":"!!","replayable":true}}"#,
        ),
    ] {
        let mut t = Harness::new(CONFIG);
        let step = asked(&mut t);
        let sent = step.claim();
        let step = t.answer_claim(&step, bad.clone());
        let r = step.reply();
        assert_eq!(
            (r.status, header(r, "retry-after")),
            (503, Some("1")),
            "{bad:?}"
        );
        assert_eq!(problem_type(r), "/problems/idempotency-state-unavailable");
        // The claim may have been committed all the same: nothing was forwarded, so the
        // worker gives it back by its nonce (issue 34, path 4), from the root context.
        assert_eq!(
            step.counts(),
            vec![Metric::StateApiErrors, Metric::ClaimsAbandoned]
        );
        assert!(!step.resumes_request());
        let woken = t.tick();
        let abandon: contract::wire::AbandonRequest =
            serde_json::from_slice(&woken.dispatch(contract::wire::ABANDON_PATH).body).unwrap();
        assert_eq!(Some(abandon.nonce), sent.nonce, "{bad:?}");
        assert_eq!(
            (abandon.key.as_str(), abandon.endpoint.as_str()),
            ("k", "POST /checkout")
        );
    }
}

/// A stream that ends while its claim is on its way (Envoy cancels the callout): its answer
/// never comes, so the claim is given back by its nonce; a claim that failed where the route
/// fails open gives nothing back (the request went on).
#[test]
fn a_claim_whose_answer_never_comes_is_given_back() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.headers(
        s,
        &req_headers("/checkout", &[("idempotency-key", "gone")]),
        true,
    );
    let sent = step.claim();
    let nonce = sent.nonce.clone().unwrap();
    assert!(nonce.starts_with("w."), "{nonce}");
    let effects = t.w.on_stream_done(s, t.now);
    assert!(effects.contains(&Effect::Count(Metric::ClaimsAbandoned)));
    let abandon: contract::wire::AbandonRequest =
        serde_json::from_slice(&t.tick().dispatch(contract::wire::ABANDON_PATH).body).unwrap();
    assert_eq!(abandon.nonce, nonce);
    // Nonces differ from one claim to the next.
    let step = asked(&mut t);
    assert_ne!(step.claim().nonce, Some(nonce));
    // `/refunds` fails open: the request goes on unprotected, nothing is given back.
    let s = t.stream();
    let step = t.headers(
        s,
        &req_headers("/refunds", &[("idempotency-key", "open")]),
        true,
    );
    let step = t.answer_claim(&step, CalloutResult::Failed("reset".into()));
    assert!(step.resumes_request());
    assert!(!step.counts().contains(&Metric::ClaimsAbandoned));
}

#[test]
fn a_refused_claim_is_500_and_never_fails_open() {
    for route in ["/checkout", "/refunds"] {
        let mut t = Harness::new(CONFIG);
        let s = t.stream();
        let step = t.headers(s, &req_headers(route, &[("idempotency-key", "k")]), true);
        // A wrong bearer token, a field the state API does not accept: not an outage.
        let step = t.answer_claim(&step, status(401, b"{}"));
        let r = step.reply();
        assert_eq!(
            (r.status, problem_type(r).as_str()),
            (500, "/problems/internal-error"),
            "{route}"
        );
        assert_eq!(
            step.counts(),
            vec![Metric::ClaimRefused, Metric::StateApiErrors]
        );
        assert!(!step.resumes_request());
    }
}

#[test]
fn an_endpoint_too_long_for_a_record_is_414_before_any_claim() {
    let cfg = with(r#""routes": [{"method": "POST", "prefix": "/pay/", "key": "required", "on_state_unavailable": "fail_open"}],"#)
        .replacen(
            r#""routes": [
    {"method": "POST", "path": "/checkout", "key": "required"},
    {"method": "POST", "path": "/refunds", "key": "required", "on_5xx": "release", "on_state_unavailable": "fail_open"},
    {"method": "POST", "prefix": "/carts/", "key": "optional"}
  ],"#,
            "",
            1,
        );
    let mut t = Harness::new(&cfg);
    let path = format!("/pay/{}", "p".repeat(1100));
    let s = t.stream();
    let step = t.headers(s, &req_headers(&path, &[("idempotency-key", "k")]), true);
    let r = step.reply();
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (414, "/problems/endpoint-too-long")
    );
    assert!(!step.claims() && !step.resumes_request());
    // Exactly at the limit: claimed as usual.
    let path = format!("/pay/{}", "p".repeat(1024 - "POST /pay/".len()));
    let s = t.stream();
    assert!(t
        .headers(s, &req_headers(&path, &[("idempotency-key", "k")]), true)
        .claims());
}

#[test]
fn a_client_sent_fencing_token_never_passes_on_any_route() {
    let mut t = Harness::new(CONFIG);
    for (path, key) in [("/other", Some("k")), ("/carts/1", None)] {
        let s = t.stream();
        let mut extra = vec![(FENCING_TOKEN_HEADER, "999")];
        if let Some(k) = key {
            extra.push(("idempotency-key", k));
        }
        let step = t.headers(s, &req_headers(path, &extra), true);
        assert_eq!(step.verdict, Verdict::Continue, "{path}");
        assert_eq!(
            step.effects,
            vec![Effect::RemoveRequestHeader {
                stream: s,
                name: FENCING_TOKEN_HEADER
            }],
            "{path}"
        );
    }
    // Without one, nothing to remove.
    let s = t.stream();
    assert!(t
        .headers(s, &req_headers("/other", &[]), true)
        .effects
        .is_empty());
}

#[test]
fn a_claim_that_cannot_be_dispatched_is_answered_as_failed() {
    let mut t = Harness::new(CONFIG);
    let step = asked(&mut t);
    let d = step.dispatch(CLAIM_PATH).clone();
    // What the glue does when dispatch_http_call fails.
    let step = t.answer(&d, CalloutResult::Failed("no cluster".into()));
    assert_eq!(step.reply().status, 503);
    // An answer nobody waits for is logged, nothing else.
    let step = t.answer(&d, written());
    assert!(matches!(
        step.effects.as_slice(),
        [Effect::Log(Level::Debug, _)]
    ));
}

#[test]
fn fail_open_route_forwards_and_counts() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.headers(
        s,
        &req_headers(
            "/refunds",
            &[("idempotency-key", "k"), ("idempotency-fencing-token", "1")],
        ),
        true,
    );
    let step = t.answer_claim(&step, CalloutResult::Failed("unreachable".into()));
    assert_eq!(
        step.counts(),
        vec![Metric::StateApiErrors, Metric::FailedOpen]
    );
    assert!(step.effects.contains(&Effect::RemoveRequestHeader {
        stream: s,
        name: FENCING_TOKEN_HEADER
    }));
    assert_eq!(step.last(), Some(&Effect::ResumeRequest { stream: s }));
    assert!(!step.replied());
    // The response is not captured.
    assert!(!t.w.awaits_response(s));
}

// ---------------------------------------------------------------------------------------------
// The response

#[test]
fn upstream_response_is_captured_and_completed_holding_the_last_chunk() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let resp = h(&[
        (":status", "201"),
        ("content-type", "application/json"),
        ("set-cookie", "a"),
        ("location", "/c/1"),
    ]);
    let step = t.response_headers(s, &resp, "via_upstream", 0, false);
    assert_eq!((step.verdict, step.effects.len()), (Verdict::Continue, 0));
    // Every chunk is held (cumulative sizes), the whole body is read once at the end.
    assert_eq!(
        t.response_body(s, 5, false, &mut never).verdict,
        Verdict::Pause
    );
    assert_eq!(
        t.response_body(s, 8, false, &mut never).verdict,
        Verdict::Pause
    );
    let step = t.response_body(s, 8, true, &mut |n| {
        assert_eq!(n, 8);
        Some(b"{\"id\":1}".to_vec())
    });
    assert_eq!(
        step.verdict,
        Verdict::Pause,
        "the response is held until the store answers"
    );
    let c = step.complete();
    assert_eq!(
        (
            c.key.as_str(),
            c.subject.as_str(),
            c.endpoint.as_str(),
            c.token
        ),
        ("k1", "user-1", "POST /checkout", 42)
    );
    assert_eq!(c.response.status, 201);
    assert!(c.response.replayable);
    assert_eq!(c.response.body, b"{\"id\":1}");
    assert_eq!(
        c.response.headers,
        h(&[("content-type", "application/json"), ("location", "/c/1")])
    );
    assert_eq!(step.dispatch(COMPLETE_PATH).owner, Owner::Stream(s));
    // Anything arriving meanwhile is held too.
    let held: Seen = t.w.on_response_trailers(s, &mut never, t.now).into();
    assert_eq!(held.verdict, Verdict::Pause);
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, written());
    assert_eq!(step.counts(), vec![Metric::Completed]);
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
    assert_eq!(t.w.usage().claims, 0, "the heartbeat stops");
}

#[test]
fn headers_only_response_completes_at_once() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.ok_response(s, "204", true);
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(step.complete().response.status, 204);
}

#[test]
fn response_trailers_end_the_capture() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    t.ok_response(s, "200", false);
    assert_eq!(
        t.response_body(s, 2, false, &mut never).verdict,
        Verdict::Pause
    );
    let step: Seen =
        t.w.on_response_trailers(s, &mut |n| Some(b"ok"[..n].to_vec()), t.now)
            .into();
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(step.complete().response.body, b"ok");
}

#[test]
fn too_large_response_is_stored_without_body_and_not_replayable() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    t.response_headers(
        s,
        &h(&[(":status", "201"), ("location", "/c/9")]),
        "via_upstream",
        0,
        false,
    );
    assert_eq!(
        t.response_body(s, 8, false, &mut never).verdict,
        Verdict::Pause
    );
    // Over the limit (10): stored at once without a body while the response is held...
    let step = t.response_body(s, 16, false, &mut never);
    assert_eq!(step.verdict, Verdict::Pause);
    let c = step.complete();
    assert!(!c.response.replayable);
    assert_eq!(c.response.status, 201);
    assert!(c.response.body.is_empty());
    assert_eq!(c.response.headers, h(&[("location", "/c/9")]));
    assert_eq!(step.counts(), vec![Metric::StoredWithoutBody]);
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, written());
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
    // ...then the rest streams on untouched.
    assert_eq!(
        t.response_body(s, 4096, false, &mut never).verdict,
        Verdict::Continue
    );
    assert_eq!(
        t.response_body(s, 0, true, &mut never).verdict,
        Verdict::Continue
    );
}

#[test]
fn unreadable_response_body_is_stored_as_not_replayable() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    t.ok_response(s, "200", false);
    let step = t.response_body(s, 3, true, &mut |_| None);
    assert!(!step.complete().response.replayable);
}

#[test]
fn never_reached_upstream_releases_the_key() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.response_headers(
        s,
        &h(&[(":status", "503")]),
        "no_healthy_upstream",
        0x2,
        false,
    );
    assert_eq!(step.verdict, Verdict::Pause);
    let d = step.dispatch(RELEASE_PATH).clone();
    let r: ReleaseRequest = serde_json::from_slice(&d.body).unwrap();
    assert_eq!((r.key.as_str(), r.token), ("k1", 42));
    assert_eq!(
        t.response_body(s, 19, true, &mut never).verdict,
        Verdict::Pause
    );
    let step = t.answer(&d, answer(&WriteResponse::released()));
    assert_eq!(step.counts(), vec![Metric::Released]);
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
}

#[test]
fn five_hundreds_are_stored_or_released_per_route() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    assert_eq!(
        t.ok_response(s, "502", true).complete().response.status,
        502
    );
    let (s, _) = t.claimed("/refunds", b"{}", 43);
    assert!(!t
        .ok_response(s, "502", true)
        .dispatches(RELEASE_PATH)
        .is_empty());
}

// ---------------------------------------------------------------------------------------------
// Writes

#[test]
fn failed_complete_is_retried_once_then_handed_to_the_worker_and_the_response_goes_on() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.ok_response(s, "200", true);
    let first = step.complete();
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, CalloutResult::Failed("timeout".into()));
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(step.complete(), first);
    assert_eq!(step.counts(), vec![Metric::StateApiErrors]);
    assert!(!step.resumes_response());
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, status(503, b""));
    assert_eq!(step.counts(), vec![Metric::StateApiErrors]);
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
    assert_eq!(t.w.flow_state(s), Some("finished"));
    // The claim stays registered (its lease is kept alive) and the worker has the write.
    let u = t.w.usage();
    assert_eq!((u.claims, u.writes), (1, 1));
    // It is retried from the tick, not before the first delay, by the worker.
    t.advance(writes::FIRST_DELAY_MS - 1);
    assert!(t.tick().dispatches(COMPLETE_PATH).is_empty());
    t.advance(1);
    let step = t.tick();
    let retry = step.dispatch(COMPLETE_PATH).clone();
    assert_eq!(retry.owner, Owner::Worker);
    assert_eq!(
        serde_json::from_slice::<CompleteRequest>(&retry.body).unwrap(),
        first
    );
    assert_eq!(step.counts(), vec![Metric::CompleteRetries]);
    let step = t.answer(&retry, written());
    assert_eq!(step.counts(), vec![Metric::Completed]);
    let u = t.w.usage();
    assert_eq!((u.claims, u.writes), (0, 0));
}

fn background() -> String {
    with(r#""complete_in_background": true,"#)
}

#[test]
fn in_background_the_response_goes_on_and_the_worker_sends_the_untried_complete() {
    let mut t = Harness::new(&background());
    let (s, claim) = t.claimed("/checkout", b"{}", 42);
    let step = t.response_headers(
        s,
        &h(&[(":status", "201"), ("content-type", "application/json")]),
        "via_upstream",
        0,
        false,
    );
    assert_eq!(step.verdict, Verdict::Continue);
    assert_eq!(
        t.response_body(s, 4, false, &mut never).verdict,
        Verdict::Pause
    );
    let step = t.response_body(s, 9, true, &mut |n| Some(b"{\"id\":\"c\"}"[..n].to_vec()));
    // Nothing is sent from the stream; the response goes on, and the worker asks to be woken.
    assert_eq!(step.verdict, Verdict::Continue);
    assert!(step.dispatches(COMPLETE_PATH).is_empty());
    assert!(step.effects.contains(&Effect::Wake));
    assert!(step.resumes_response());
    assert_eq!(t.w.flow_state(s), Some("finished"));
    assert!(t.done(s).effects.is_empty());
    // The claim stays registered: the worker keeps its lease alive until it is stored.
    assert_eq!(t.w.usage().claims, 1);
    let woken: Seen = t.w.on_wake(t.now).into();
    let d = woken.dispatch(COMPLETE_PATH).clone();
    assert_eq!(d.owner, Owner::Worker);
    let handed: CompleteRequest = serde_json::from_slice(&d.body).unwrap();
    assert_eq!(
        (handed.key.as_str(), handed.token, handed.response.status),
        (claim.key.as_str(), 42, 201)
    );
    assert!(woken.counts().is_empty(), "a first attempt is not a retry");
    assert_eq!(t.answer(&d, written()).counts(), vec![Metric::Completed]);
    assert_eq!(t.w.usage().claims, 0);
}

#[test]
fn in_background_one_wake_for_a_burst() {
    let mut t = Harness::new(&background());
    let mut wakes = 0;
    for token in 1..=3 {
        let (s, _) = t.claimed_key(&format!("k{token}"), "/checkout", b"{}", token);
        wakes += t
            .ok_response(s, "201", true)
            .effects
            .iter()
            .filter(|e| **e == Effect::Wake)
            .count();
    }
    assert_eq!(
        wakes, 1,
        "the completes handed over meanwhile go with the pending wake"
    );
    let woken: Seen = t.w.on_wake(t.now).into();
    assert_eq!(woken.dispatches(COMPLETE_PATH).len(), 3);
    // A wake the host lost: the tick sends what is due, and wakes are asked for again.
    let (s, _) = t.claimed_key("k9", "/checkout", b"{}", 9);
    assert!(t
        .ok_response(s, "201", true)
        .effects
        .contains(&Effect::Wake));
    assert_eq!(t.tick().dispatches(COMPLETE_PATH).len(), 1);
    let (s, _) = t.claimed_key("k10", "/checkout", b"{}", 10);
    assert!(t
        .ok_response(s, "201", true)
        .effects
        .contains(&Effect::Wake));
}

#[test]
fn in_background_a_full_worker_means_the_stream_stores_and_holds_as_usual() {
    let cfg = with(r#""complete_in_background": true, "complete_retry_bytes": 10,"#);
    let mut t = Harness::new(&cfg);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.ok_response(s, "200", true);
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(step.counts(), vec![Metric::CompleteHeld]);
    assert_eq!(step.complete().response.status, 200);
    assert_eq!(step.dispatch(COMPLETE_PATH).owner, Owner::Stream(s));
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, written());
    assert_eq!(step.counts(), vec![Metric::Completed]);
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
    assert_eq!(t.w.flow_state(s), Some("finished"));
}

#[test]
fn in_background_releases_are_still_held() {
    let mut t = Harness::new(&background());
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.response_headers(
        s,
        &h(&[(":status", "503")]),
        "no_healthy_upstream",
        0x2,
        true,
    );
    assert_eq!(step.dispatch(RELEASE_PATH).owner, Owner::Stream(s));
    assert!(!step.effects.contains(&Effect::Wake));
}

#[test]
fn without_retries_a_failed_complete_is_given_up_after_one_retry() {
    let cfg = with(r#""complete_retry_ms": 0,"#);
    let mut t = Harness::new(&cfg);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.ok_response(s, "200", true);
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, CalloutResult::Failed("timeout".into()));
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, CalloutResult::Failed("timeout".into()));
    assert_eq!(
        step.counts(),
        vec![Metric::StateApiErrors, Metric::CompleteGaveUp]
    );
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
    let u = t.w.usage();
    assert_eq!((u.claims, u.writes), (0, 0));
    // The stream ending during a complete: the heartbeat stops, nothing is handed over.
    let (s, _) = t.claimed("/checkout", b"{}", 43);
    t.ok_response(s, "200", true);
    t.done(s);
    let u = t.w.usage();
    assert_eq!((u.claims, u.writes, u.callouts), (0, 0, 0));
}

#[test]
fn a_refused_complete_stores_the_status_alone_then_gives_up() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.response_headers(
        s,
        &h(&[(":status", "201"), ("location", "/c/1")]),
        "via_upstream",
        0,
        true,
    );
    let d = step.dispatch(COMPLETE_PATH).clone();
    assert!(step.complete().response.replayable);
    // A limit the filter could not know (the state API's own body limit, say): the key must
    // not be left free, so its status alone is stored, not replayable.
    let step = t.answer(&d, status(413, b"{}"));
    assert_eq!(step.counts(), vec![Metric::CompleteRefused]);
    assert!(
        !step.resumes_response(),
        "still held until an outcome is stored"
    );
    let minimal = step.complete();
    assert_eq!(
        (
            minimal.response.status,
            minimal.response.replayable,
            minimal.response.headers.len()
        ),
        (201, false, 0)
    );
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, written());
    assert_eq!(step.counts(), vec![Metric::Completed]);
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
    // A retry on this worker gets 409 not replayable from memory, never a second run.
    let retry = retry_of_claimed(&mut t);
    assert!(!retry.claims());
    assert_eq!(retry.reply().status, 409);

    // Refused again: given up (the key stays held until its lease runs out).
    let (s, _) = t.claimed_key("k2", "/checkout", b"{}", 43);
    let step = t.ok_response(s, "201", true);
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, status(400, b"{}"));
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, status(400, b"{}"));
    assert_eq!(
        step.counts(),
        vec![Metric::StateApiErrors, Metric::CompleteGaveUp]
    );
    assert!(step.dispatches(COMPLETE_PATH).is_empty());
    assert_eq!(t.w.usage().writes, 0);
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
}

#[test]
fn a_response_the_state_api_would_refuse_is_stored_not_replayable_at_once() {
    let mut t = Harness::new(CONFIG);
    // A Location over the stored header limit: a replay without it would not be the response.
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let long = format!(
        "/3ds/{}",
        "x".repeat(contract::limits::MAX_HEADER_VALUE_LEN)
    );
    let step = t.response_headers(
        s,
        &h(&[(":status", "303"), ("location", &long), ("etag", "e")]),
        "via_upstream",
        0,
        true,
    );
    let c = step.complete();
    assert!(!c.response.replayable);
    assert_eq!(c.response.headers, h(&[("etag", "e")]));
    assert_eq!(step.counts(), vec![Metric::StoredWithoutBody]);
    // A three-digit status outside 100-599 is stored (any three digits are).
    let (s, _) = t.claimed_key("k2", "/checkout", b"{}", 43);
    let c = t.ok_response(s, "799", true).complete();
    assert_eq!((c.response.status, c.response.replayable), (799, true));
    // The state API's own body limit (told with the claim), below the configured one.
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let hs = req_headers("/checkout", &[("idempotency-key", "k3")]);
    let step = t.headers(s, &hs, true);
    t.answer_claim(
        &step,
        answer(&ClaimResponse::Claimed {
            token: 9,
            lease_ms: 30_000,
            reclaimed: false,
            max_body_bytes: Some(4),
            retention_s: None,
        }),
    );
    t.ok_response(s, "200", false);
    let step = t.response_body(s, 5, false, &mut never);
    let c = step.complete();
    assert!(!c.response.replayable, "5 bytes are over the state API's 4");
}

#[test]
fn an_empty_body_ended_by_an_empty_data_frame_is_replayable() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    t.ok_response(s, "201", false);
    // Envoy has no buffer for an empty body: nothing is read.
    let step = t.response_body(s, 0, true, &mut never);
    let c = step.complete();
    assert!(c.response.replayable);
    assert_eq!(c.response.body, b"");
}

#[test]
fn a_failed_release_is_retried_once_then_handed_to_the_worker() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.response_headers(
        s,
        &h(&[(":status", "503")]),
        "no_healthy_upstream",
        0x2,
        true,
    );
    let d = step.dispatch(RELEASE_PATH).clone();
    let step = t.answer(&d, CalloutResult::Failed("reset".into()));
    let d = step.dispatch(RELEASE_PATH).clone();
    let step = t.answer(&d, CalloutResult::Failed("reset".into()));
    assert_eq!(step.counts(), vec![Metric::StateApiErrors]);
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
    assert_eq!(t.w.usage().writes, 1);
    t.advance(writes::FIRST_DELAY_MS);
    let step = t.tick();
    let d = step.dispatch(RELEASE_PATH).clone();
    assert_eq!(d.owner, Owner::Worker);
    assert_eq!(
        t.answer(&d, answer(&WriteResponse::released())).counts(),
        vec![Metric::Released]
    );
    assert_eq!(t.w.usage().claims, 0);
}

#[test]
fn stream_ending_while_completing_hands_the_complete_to_the_worker() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let payload = t.ok_response(s, "201", true).complete();
    t.done(s);
    let u = t.w.usage();
    assert_eq!((u.claims, u.writes, u.callouts), (1, 1, 0));
    t.advance(writes::FIRST_DELAY_MS);
    let step = t.tick();
    let d = step.dispatch(COMPLETE_PATH);
    assert_eq!(
        serde_json::from_slice::<CompleteRequest>(&d.body).unwrap(),
        payload
    );
    // Cut short in the body (a reset, the client gone): the status and headers are stored,
    // not replayable. The upstream answered; it must not run again.
    let (s, _) = t.claimed_key("k2", "/checkout", b"{}", 43);
    t.response_headers(
        s,
        &h(&[(":status", "201"), ("location", "/c/2")]),
        "via_upstream",
        0,
        false,
    );
    t.response_body(s, 3, false, &mut never);
    let step = t.done(s);
    assert_eq!(step.counts(), vec![Metric::StoredWithoutBody]);
    let u = t.w.usage();
    assert_eq!((u.claims, u.writes), (2, 2));
    t.advance(writes::FIRST_DELAY_MS);
    let step = t.tick();
    let cut: Vec<CompleteRequest> = step
        .dispatches(COMPLETE_PATH)
        .iter()
        .map(|d| serde_json::from_slice(&d.body).unwrap())
        .filter(|c: &CompleteRequest| c.token == 43)
        .collect();
    assert_eq!(cut.len(), 1);
    assert_eq!(
        (cut[0].response.status, cut[0].response.replayable),
        (201, false)
    );
    assert_eq!(cut[0].response.headers, h(&[("location", "/c/2")]));
}

#[test]
fn fenced_out_write_is_counted_and_the_response_goes_on() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.ok_response(s, "200", true);
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, status(409, b"{\"type\":\"/problems/fenced-out\"}"));
    assert_eq!(step.counts(), vec![Metric::FencedOut]);
    assert_eq!(step.last(), Some(&Effect::ResumeResponse { stream: s }));
}

#[test]
fn client_gone_after_forwarding_marks_the_outcome_unknown() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.done(s);
    assert!(step.dispatches(RELEASE_PATH).is_empty());
    assert!(step.dispatches(COMPLETE_PATH).is_empty());
    assert_eq!(step.counts(), vec![Metric::OutcomeUnknown]);
    assert!(step.effects.contains(&Effect::Wake), "sent at once");
    let u = t.w.usage();
    assert_eq!(
        (u.streams, u.claims, u.writes),
        (0, 0, 1),
        "no heartbeat: only the mark waits"
    );
    let step: Seen = t.w.on_wake(t.now).into();
    let d = step.dispatch(UNKNOWN_PATH).clone();
    assert_eq!(d.owner, Owner::Worker);
    let mark: UnknownRequest = serde_json::from_slice(&d.body).unwrap();
    assert_eq!((mark.key.as_str(), mark.token), ("k1", 42));
    let step = t.answer(&d, answer(&WriteResponse::unknown()));
    assert!(step.counts().is_empty(), "not a complete: {step:?}");
    assert_eq!(t.w.usage().writes, 0);
    // The state API down for good: given up without calling it a lost complete.
    let (s, _) = t.claimed("/checkout", b"{}", 43);
    t.done(s);
    let step: Seen = t.w.on_wake(t.now).into();
    let d = step.dispatch(UNKNOWN_PATH).clone();
    t.answer(&d, CalloutResult::Failed("reset".into()));
    t.advance(700_000);
    let step = t.tick();
    assert!(!step.counts().contains(&Metric::CompleteGaveUp), "{step:?}");
    assert_eq!(t.w.usage().writes, 0);
}

#[test]
fn envoys_own_5xx_after_forwarding_is_an_unknown_outcome() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.response_headers(
        s,
        &h(&[(":status", "504")]),
        "upstream_response_timeout",
        crate::outcome::flags::UPSTREAM_REQUEST_TIMEOUT,
        false,
    );
    assert_eq!(step.verdict, Verdict::Continue, "Envoy's answer goes on");
    assert_eq!(step.counts(), vec![Metric::OutcomeUnknown]);
    assert!(step.dispatches(COMPLETE_PATH).is_empty());
    assert_eq!(t.w.usage().claims, 0);
    let step: Seen = t.w.on_wake(t.now).into();
    assert_eq!(step.dispatches(UNKNOWN_PATH).len(), 1);
    // Before the connection existed: released, as before.
    let (s, _) = t.claimed("/checkout", b"{}", 43);
    let step = t.response_headers(
        s,
        &h(&[(":status", "503")]),
        "upstream_reset_before_response_started{remote_connection_failure}",
        crate::outcome::flags::UPSTREAM_CONNECTION_FAILURE,
        false,
    );
    assert_eq!(step.dispatches(RELEASE_PATH).len(), 1);
}

const RECONCILING: &str = r#"{
  "state_api": {"cluster": "state_api", "authority": "state-api", "token": "t", "timeout_ms": 1000},
  "subject": {"header": "x-jwt-sub"},
  "routes": [
    {"method": "POST", "path": "/checkout", "key": "required", "on_unknown": "reconcile",
     "reconcile": {"cluster": "checkout", "authority": "checkout", "path": "/checkout/attempts/{key}", "timeout_ms": 700}},
    {"method": "POST", "path": "/refunds", "key": "required"},
    {"method": "POST", "path": "/pay", "key": "required", "on_unknown": "reexecute"}
  ],
  "max_request_body_bytes": 100,
  "max_stored_body_bytes": 100
}"#;

fn took_over(token: i64) -> CalloutResult {
    answer(&ClaimResponse::Claimed {
        token,
        lease_ms: 30_000,
        reclaimed: true,
        max_body_bytes: None,
        retention_s: None,
    })
}

fn reconcile_answer(
    status: u16,
    outcome: &str,
    extra: &[(&str, &str)],
    body: &[u8],
) -> CalloutResult {
    let mut headers = h(extra);
    headers.push((OUTCOME_HEADER.into(), outcome.into()));
    CalloutResult::Response {
        status,
        headers,
        body: body.to_vec(),
    }
}

/// The fingerprint of the request [`Harness::taken_over`] sends to `path` (`{}`, no content
/// type).
fn fingerprint_of(path: &str) -> String {
    contract::fingerprint::fingerprint("POST", path, "", None, b"{}")
        .unwrap()
        .hex
}

/// An `executed` answer that names the attempt it describes: its token, endpoint and
/// fingerprint, as the upstream recorded them, and the subject and key of
/// [`Harness::taken_over`]'s request.
fn executed_by(
    token: &str,
    endpoint: &str,
    fingerprint: &str,
    status: u16,
    extra: &[(&str, &str)],
    body: &[u8],
) -> CalloutResult {
    let mut named = vec![
        (FENCING_TOKEN_HEADER, token),
        (ENDPOINT_HEADER, endpoint),
        (FINGERPRINT_HEADER, fingerprint),
        (SUBJECT_HEADER, "user-1"),
        ("idempotency-key", "k1"),
    ];
    named.extend_from_slice(extra);
    reconcile_answer(status, OUTCOME_EXECUTED, &named, body)
}

/// An `executed` answer about an earlier attempt (token 5) of the request
/// `taken_over("/checkout", ..)` sends.
fn executed_earlier(status: u16, extra: &[(&str, &str)], body: &[u8]) -> CalloutResult {
    let fp = fingerprint_of("/checkout");
    executed_by("5", "POST /checkout", &fp, status, extra, body)
}

impl Seen {
    /// The one callout to the upstream's reconcile endpoint (cluster `checkout`).
    fn reconcile(&self) -> Dispatch {
        let all: Vec<&Dispatch> = self
            .effects
            .iter()
            .filter_map(|e| match e {
                Effect::Dispatch(d) if d.cluster == "checkout" => Some(d),
                _ => None,
            })
            .collect();
        assert_eq!(all.len(), 1, "one reconcile in {self:?}");
        all[0].clone()
    }
}

impl Harness {
    /// A request of `path` whose claim took an unknown outcome over with `token`.
    fn taken_over(&mut self, path: &str, token: i64) -> (StreamId, Seen) {
        let s = self.stream();
        let hs = req_headers(path, &[("idempotency-key", "k1")]);
        self.headers(s, &hs, false);
        let step = self.body(s, b"{}");
        assert_eq!(step.claim().on_unknown, contract::wire::OnUnknown::TakeOver);
        let step = self.answer_claim(&step, took_over(token));
        (s, step)
    }
}

#[test]
fn the_held_route_answers_409_outcome_unknown() {
    let mut t = Harness::new(RECONCILING);
    let s = t.stream();
    t.headers(
        s,
        &req_headers("/refunds", &[("idempotency-key", "k1")]),
        false,
    );
    let step = t.body(s, b"{}");
    assert_eq!(step.claim().on_unknown, contract::wire::OnUnknown::Hold);
    let step = t.answer_claim(&step, answer(&ClaimResponse::Unknown));
    let r = step.reply();
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (409, "/problems/outcome-unknown")
    );
    assert!(String::from_utf8_lossy(&r.body).contains("do not retry with a new key"));
    assert_eq!(step.counts(), vec![Metric::OutcomeUnknown409]);
    assert!(!step.resumes_request());
}

#[test]
fn a_reconciled_execution_is_stored_and_replayed_without_forwarding() {
    let mut t = Harness::new(RECONCILING);
    let (s, step) = t.taken_over("/checkout", 77);
    assert!(
        !step.resumes_request(),
        "nothing forwarded before the upstream tells"
    );
    let d = step.reconcile();
    assert_eq!(d.owner, Owner::Stream(s));
    assert_eq!(d.header(":method"), Some("GET"));
    assert_eq!(d.header(":path"), Some("/checkout/attempts/k1"));
    assert_eq!(d.header(":authority"), Some("checkout"));
    assert_eq!(d.header("idempotency-key"), Some("k1"));
    assert_eq!(d.header(FENCING_TOKEN_HEADER), Some("77"));
    assert_eq!(d.header(SUBJECT_HEADER), Some("user-1"));
    assert_eq!(d.timeout_ms, 700);
    assert_eq!(
        t.w.usage().claims,
        1,
        "the lease is kept while the upstream answers"
    );
    let step = t.answer(
        &d,
        executed_earlier(201, &[("location", "/charges/9")], b"{\"id\":9}"),
    );
    assert!(!step.replied(), "stored first");
    let complete = step.complete();
    assert_eq!(complete.token, 77);
    assert_eq!(complete.response.status, 201);
    assert_eq!(complete.response.headers, h(&[("location", "/charges/9")]));
    assert_eq!(step.counts(), vec![Metric::ReconcileExecuted]);
    let step = t.answer(step.dispatch(COMPLETE_PATH), written());
    let r = step.reply();
    assert_eq!(
        (r.status, r.body.as_slice()),
        (201, b"{\"id\":9}".as_slice())
    );
    assert_eq!(header(r, "idempotent-replayed"), Some("true"));
    assert_eq!(header(r, OUTCOME_HEADER), None);
    assert!(!step.resumes_request());
    assert_eq!(t.w.usage().claims, 0);
}

#[test]
fn a_running_or_unverifiable_reconcile_answers_without_forwarding_and_marks_it_unknown() {
    for (answer_, status, kind, metric) in [
        (
            reconcile_answer(409, OUTCOME_RUNNING, &[("retry-after", "4")], b""),
            409,
            "/problems/request-in-progress",
            Metric::ReconcileRunning,
        ),
        (
            reconcile_answer(200, "perhaps", &[], b"<html>"),
            503,
            "/problems/reconcile-unavailable",
            Metric::ReconcileFailed,
        ),
        (
            CalloutResult::answer(503, b"no healthy upstream".to_vec()),
            503,
            "/problems/reconcile-unavailable",
            Metric::ReconcileFailed,
        ),
        (
            CalloutResult::Failed("timeout".into()),
            503,
            "/problems/reconcile-unavailable",
            Metric::ReconcileFailed,
        ),
    ] {
        let mut t = Harness::new(RECONCILING);
        let (s, step) = t.taken_over("/checkout", 77);
        let d = step.reconcile();
        let step = t.answer(&d, answer_);
        if metric == Metric::ReconcileRunning {
            assert_eq!(header(step.reply(), "retry-after"), Some("4"));
        }
        t.answered_and_marked_unknown(s, &step, (status, kind), metric, kind);
    }
}

impl Harness {
    /// A reconcile answered with `status` and problem `kind` (counted in `metric`), nothing
    /// forwarded, and the record marked unknown again under the new token (77) once the stream
    /// ends: the key kept.
    fn answered_and_marked_unknown(
        &mut self,
        s: StreamId,
        step: &Seen,
        (status, kind): (u16, &str),
        metric: Metric,
        label: &str,
    ) {
        let r = step.reply();
        assert_eq!(
            (r.status, problem_type(r).as_str()),
            (status, kind),
            "{label}"
        );
        assert!(header(r, "retry-after").is_some(), "{label}");
        assert_eq!(step.counts(), vec![metric], "{label}");
        assert!(!step.resumes_request(), "{label}: nothing forwarded");
        assert_eq!(self.w.usage().claims, 0, "{label}");
        self.done(s);
        let step: Seen = self.w.on_wake(self.now).into();
        let mark: UnknownRequest =
            serde_json::from_slice(&step.dispatch(UNKNOWN_PATH).body).unwrap();
        assert_eq!(mark.token, 77, "{label}: fenced by the new token");
    }
}

#[test]
fn never_executed_runs_once_with_the_new_token() {
    let mut t = Harness::new(RECONCILING);
    let (s, step) = t.taken_over("/checkout", 77);
    let d = step.reconcile();
    let step = t.answer(&d, reconcile_answer(404, OUTCOME_NOT_EXECUTED, &[], b""));
    assert!(step.resumes_request());
    for (name, value) in [
        (FENCING_TOKEN_HEADER, "77".to_owned()),
        (FINGERPRINT_HEADER, fingerprint_of("/checkout")),
    ] {
        assert!(step.effects.contains(&Effect::SetRequestHeader {
            stream: s,
            name,
            value
        }));
    }
    assert_eq!(
        step.counts(),
        vec![Metric::Claimed, Metric::ReconcileNotExecuted]
    );
    assert!(t.w.awaits_response(s));
    // The stream ending while the reconcile is asked: marked unknown again.
    let (s, _) = t.taken_over("/checkout", 78);
    let step = t.done(s);
    assert!(step.effects.contains(&Effect::Wake));
}

#[test]
fn the_reexecuting_route_runs_a_taken_over_key_again() {
    let mut t = Harness::new(RECONCILING);
    let (_, step) = t.taken_over("/pay", 77);
    assert!(step.resumes_request());
    assert!(step.counts().contains(&Metric::Reexecuted));
}

#[test]
fn a_reconciled_outcome_the_state_api_cannot_take_is_still_the_answer() {
    let mut t = Harness::new(RECONCILING);
    let (_, step) = t.taken_over("/checkout", 77);
    let d = step.reconcile();
    let step = t.answer(&d, executed_earlier(200, &[], b"{}"));
    let step = t.answer(
        step.dispatch(COMPLETE_PATH),
        CalloutResult::Failed("reset".into()),
    );
    let step = t.answer(
        step.dispatch(COMPLETE_PATH),
        CalloutResult::Failed("reset".into()),
    );
    let r = step.reply();
    assert_eq!(
        (r.status, header(r, "idempotent-replayed")),
        (200, Some("true"))
    );
    let u = t.w.usage();
    assert_eq!(
        (u.writes, u.claims),
        (1, 1),
        "the worker stores it, the lease kept"
    );
}

#[test]
fn the_reconcile_call_names_the_request_s_endpoint_and_fingerprint() {
    let mut t = Harness::new(RECONCILING);
    let (_, step) = t.taken_over("/checkout", 77);
    let d = step.reconcile();
    assert_eq!(d.header(ENDPOINT_HEADER), Some("POST /checkout"));
    assert_eq!(
        d.header(FINGERPRINT_HEADER),
        Some(fingerprint_of("/checkout").as_str()),
        "the fingerprint the claim was made with"
    );
    assert_eq!(d.header(FENCING_TOKEN_HEADER), Some("77"));
}

#[test]
fn an_executed_answer_that_does_not_name_an_earlier_attempt_of_this_request_is_not_stored() {
    // Issue 34 path 11: a reconcile answer about another request of the key (a prefix route's
    // other path, a retention reuse with another body) or another attempt was stored and
    // replayed, and this request never ran.
    let ours = fingerprint_of("/checkout");
    let other_body = contract::fingerprint::fingerprint("POST", "/checkout", "", None, b"[]")
        .unwrap()
        .hex;
    let endpoint = "POST /checkout";
    let body = b"{\"id\":9}";
    let no_token = reconcile_answer(
        201,
        OUTCOME_EXECUTED,
        &[
            (ENDPOINT_HEADER, endpoint),
            (FINGERPRINT_HEADER, &ours),
            (SUBJECT_HEADER, "user-1"),
            ("idempotency-key", "k1"),
        ],
        body,
    );
    let no_endpoint = reconcile_answer(
        201,
        OUTCOME_EXECUTED,
        &[
            (FENCING_TOKEN_HEADER, "5"),
            (FINGERPRINT_HEADER, &ours),
            (SUBJECT_HEADER, "user-1"),
            ("idempotency-key", "k1"),
        ],
        body,
    );
    let no_fingerprint = reconcile_answer(
        201,
        OUTCOME_EXECUTED,
        &[
            (FENCING_TOKEN_HEADER, "5"),
            (ENDPOINT_HEADER, endpoint),
            (SUBJECT_HEADER, "user-1"),
            ("idempotency-key", "k1"),
        ],
        body,
    );
    let two_tokens = reconcile_answer(
        201,
        OUTCOME_EXECUTED,
        &[
            (FENCING_TOKEN_HEADER, "5"),
            (FENCING_TOKEN_HEADER, "6"),
            (ENDPOINT_HEADER, endpoint),
            (FINGERPRINT_HEADER, &ours),
            (SUBJECT_HEADER, "user-1"),
            ("idempotency-key", "k1"),
        ],
        body,
    );
    for (label, answer_) in [
        ("no token", no_token),
        (
            "a token that is no number",
            executed_by("five", endpoint, &ours, 201, &[], body),
        ),
        (
            "the reconciling claim's own token",
            executed_by("77", endpoint, &ours, 201, &[], body),
        ),
        (
            "a later token",
            executed_by("78", endpoint, &ours, 201, &[], body),
        ),
        ("two tokens", two_tokens),
        (
            "another endpoint (a prefix route's other path)",
            executed_by("5", "POST /refunds", &ours, 201, &[], body),
        ),
        (
            "another body (a retention reuse)",
            executed_by("5", endpoint, &other_body, 201, &[], body),
        ),
        ("no endpoint echoed", no_endpoint),
        ("no fingerprint echoed", no_fingerprint),
    ] {
        let mut t = Harness::new(RECONCILING);
        let (s, step) = t.taken_over("/checkout", 77);
        let d = step.reconcile();
        let step = t.answer(&d, answer_);
        assert!(
            step.dispatches(COMPLETE_PATH).is_empty(),
            "{label}: not stored: {step:?}"
        );
        assert!(
            step.effects.iter().any(|e| matches!(
                e,
                Effect::Log(Level::Warn, line) if line.contains("not stored")
                    && !line.contains("k1")
                    && !line.contains(&ours)
                    && !line.contains(&other_body)
            )),
            "{label}: a warning says why, without the key or a fingerprint: {step:?}"
        );
        let unavailable = (503, "/problems/reconcile-unavailable");
        t.answered_and_marked_unknown(s, &step, unavailable, Metric::ReconcileFailed, label);
    }
}

#[test]
fn a_claimed_request_is_forwarded_with_its_endpoint_and_fingerprint() {
    let mut t = Harness::new(RECONCILING);
    let (s, step) = t.keyed("k1", "/checkout", b"{\"a\":1}");
    let fingerprint = step.claim().fingerprint;
    let step = t.answer_claim(&step, claimed(42));
    assert!(step.resumes_request());
    for (name, value) in [
        (ENDPOINT_HEADER, "POST /checkout"),
        (FINGERPRINT_HEADER, fingerprint.as_str()),
        (FENCING_TOKEN_HEADER, "42"),
    ] {
        assert!(
            step.effects.contains(&Effect::SetRequestHeader {
                stream: s,
                name,
                value: value.into()
            }),
            "{name}: {step:?}"
        );
    }
}

#[test]
fn a_client_s_endpoint_and_fingerprint_headers_never_pass() {
    let mut t = Harness::new(RECONCILING);
    let forged = [(ENDPOINT_HEADER, "POST /other"), (FINGERPRINT_HEADER, "00")];
    // Not protected: removed all the same (the upstream may act on them).
    let s = t.stream();
    let step = t.headers(s, &req_headers("/other", &forged), true);
    assert_eq!(step.verdict, Verdict::Continue);
    for name in [ENDPOINT_HEADER, FINGERPRINT_HEADER] {
        assert!(
            step.effects
                .contains(&Effect::RemoveRequestHeader { stream: s, name }),
            "{name}: {step:?}"
        );
    }
    // Protected: removed at once, the filter's own set when it forwards.
    let s = t.stream();
    let mut hs = req_headers("/checkout", &forged);
    hs.extend(h(&[("idempotency-key", "k1")]));
    let step = t.headers(s, &hs, false);
    assert_eq!(step.verdict, Verdict::Pause);
    for name in [ENDPOINT_HEADER, FINGERPRINT_HEADER] {
        assert!(
            step.effects
                .contains(&Effect::RemoveRequestHeader { stream: s, name }),
            "{name}: {step:?}"
        );
    }
}

#[test]
fn the_stream_ending_cancels_its_callouts() {
    let mut t = Harness::new(CONFIG);
    let step = asked(&mut t);
    let d = step.dispatch(CLAIM_PATH).clone();
    let Owner::Stream(s) = d.owner else {
        panic!("a stream's claim")
    };
    t.done(s);
    assert_eq!(t.w.usage().callouts, 0);
    // Envoy never delivers it; if it did, nobody waits for it.
    let late = t.answer(&d, claimed(5));
    assert!(!late.resumes_request());
}

// ---------------------------------------------------------------------------------------------
// Heartbeats

#[test]
fn heartbeats_extend_the_leases_of_held_claims() {
    let mut t = Harness::new(CONFIG);
    let (_, _) = t.claimed("/checkout", b"{}", 5);
    // heartbeat 10 s, tick 2.5 s: due once 7.5 s have passed.
    t.advance(7_499);
    assert!(t.tick().dispatches(HEARTBEAT_PATH).is_empty());
    t.advance(1);
    let step = t.tick();
    let d = step.dispatch(HEARTBEAT_PATH).clone();
    assert_eq!(d.owner, Owner::Worker);
    assert_eq!(
        serde_json::from_slice::<HeartbeatRequest>(&d.body).unwrap(),
        HeartbeatRequest {
            namespace: String::new(),
            key: "k1".into(),
            subject: "user-1".into(),
            endpoint: "POST /checkout".into(),
            token: 5,
            lease_ms: Some(30_000)
        }
    );
    // Not twice while on its way.
    t.advance(20_000);
    assert!(t.tick().dispatches(HEARTBEAT_PATH).is_empty());
    let step = t.answer(
        &d,
        answer(&contract::wire::HeartbeatResponse { lease_ms: 30_000 }),
    );
    assert_eq!(step.counts(), vec![Metric::Heartbeats]);
    assert_eq!(t.tick().dispatches(HEARTBEAT_PATH).len(), 1);
}

#[test]
fn a_route_asks_for_its_own_lease_heartbeats_on_its_terms_and_limits_its_body() {
    let cfg = CONFIG.replacen(
        r#"{"method": "POST", "path": "/checkout", "key": "required"}"#,
        r#"{"method": "POST", "path": "/checkout", "key": "required", "lease_ms": 4000, "heartbeat_ms": 1000, "max_request_body_bytes": 8}"#,
        1,
    );
    let mut t = Harness::new(&cfg);
    assert_eq!(t.w.tick_period_ms(), 250);
    let s = t.stream();
    t.headers(
        s,
        &req_headers("/checkout", &[("idempotency-key", "k1")]),
        false,
    );
    let step = t.body(s, b"{\"a\":1234}");
    assert_eq!(step.reply().status, 413, "over this route's 8 bytes");
    let (_, claim) = t.claimed("/checkout", b"{}", 5);
    assert_eq!(claim.lease_ms, Some(4_000));
    t.advance(750);
    let step = t.tick();
    let hb: HeartbeatRequest = serde_json::from_slice(&step.dispatch(HEARTBEAT_PATH).body).unwrap();
    assert_eq!(
        hb.lease_ms,
        Some(4_000),
        "every 1 s, less a tick, asking for 4 s"
    );
    // Another route keeps the global terms.
    let (_, refund) = t.claimed("/refunds", b"{}", 6);
    assert_eq!(refund.lease_ms, Some(30_000));
}

#[test]
fn a_fenced_out_heartbeat_stops_the_claim_and_drops_its_pending_complete() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 5);
    let step = t.ok_response(s, "201", true);
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, CalloutResult::Failed("x".into()));
    let d = step.dispatch(COMPLETE_PATH).clone();
    t.answer(&d, CalloutResult::Failed("x".into()));
    assert_eq!(t.w.usage().writes, 1);
    t.advance(7_500);
    let step = t.tick();
    let hb = step.dispatch(HEARTBEAT_PATH).clone();
    let step = t.answer(&hb, status(409, b"{}"));
    assert_eq!(step.counts(), vec![Metric::FencedOut]);
    let u = t.w.usage();
    assert_eq!((u.claims, u.writes, u.replay_bytes), (0, 0, 0));
}

/// Issue 34, path 6: a failed heartbeat goes again at the next tick, not a whole interval
/// later: two lost heartbeats in a row used to cost a lease of 30 s with a 10 s interval.
#[test]
fn a_failed_heartbeat_is_sent_again_at_the_next_tick() {
    let mut t = Harness::new(CONFIG);
    let (_, _) = t.claimed("/checkout", b"{}", 5);
    t.advance(7_500);
    let mut hb = t.tick().dispatch(HEARTBEAT_PATH).clone();
    for failure in [CalloutResult::Failed("timeout".into()), status(503, b"{}")] {
        let step = t.answer(&hb, failure);
        assert_eq!(step.counts(), vec![Metric::StateApiErrors]);
        assert_eq!(t.w.next_due(), Some(0), "due at once");
        t.advance(2_500);
        hb = t.tick().dispatch(HEARTBEAT_PATH).clone();
    }
    t.answer(
        &hb,
        answer(&contract::wire::HeartbeatResponse { lease_ms: 30_000 }),
    );
    // Answered: back to its interval.
    t.advance(2_500);
    assert!(t.tick().dispatches(HEARTBEAT_PATH).is_empty());
}

/// Issue 34, path 6's residual (simulation seed 112809): a heartbeat that neither fails nor
/// answers is given up when the next one would be due, not after the state API callout's
/// timeout (which may be longer than the lease), so it is sent again while the lease lasts.
#[test]
fn a_heartbeat_is_given_up_when_the_next_one_would_be_due() {
    let cfg = CONFIG.replacen(r#""timeout_ms": 1000}"#, r#""timeout_ms": 60000}"#, 1);
    let mut t = Harness::new(&cfg);
    let (_, _) = t.claimed("/checkout", b"{}", 5);
    t.advance(7_500);
    let hb = t.tick().dispatch(HEARTBEAT_PATH).clone();
    assert_eq!(
        hb.timeout_ms, 7_500,
        "the interval (10 s less a tick), not 60 s"
    );
    let caller = hb
        .headers
        .iter()
        .find(|(n, _)| n == contract::wire::CALLER_TIMEOUT_HEADER)
        .map(|(_, v)| v.as_str());
    assert_eq!(caller, Some("7500"), "the state API is told the same");
    let claim = t.stream();
    t.headers(
        claim,
        &req_headers("/checkout", &[("idempotency-key", "k2")]),
        false,
    );
    let step = t.body(claim, b"{}");
    let c = step.dispatch(CLAIM_PATH).clone();
    assert_eq!(
        c.timeout_ms, 60_000,
        "other calls keep the configured timeout"
    );
}

/// Issue 34, path 5: a heartbeat that finds the record marked unknown under its own token
/// (`lease-ended`) stops the heartbeats of that claim, and its outcome is still stored: the
/// pending complete stays and is sent again, never dropped as a fenced-out one is.
#[test]
fn a_heartbeat_refused_for_a_marked_record_stops_heartbeats_and_keeps_the_complete() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 5);
    let step = t.ok_response(s, "201", true);
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, CalloutResult::Failed("x".into()));
    let d = step.dispatch(COMPLETE_PATH).clone();
    t.answer(&d, CalloutResult::Failed("x".into()));
    assert_eq!(t.w.usage().writes, 1);
    t.advance(7_500);
    let step = t.tick();
    let hb = step.dispatch(HEARTBEAT_PATH).clone();
    // The complete's retry goes in the same tick.
    let retry = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(
        &hb,
        status(
            409,
            &contract::Problem::new(contract::ProblemKind::LeaseEnded, "marked").to_json(),
        ),
    );
    assert_eq!(step.counts(), vec![Metric::FencedOut]);
    assert_eq!(t.w.usage().writes, 1, "the outcome is still to be stored");
    // No heartbeat for that claim any more.
    for _ in 0..8 {
        t.advance(2_500);
        assert!(t.tick().dispatches(HEARTBEAT_PATH).is_empty());
    }
    t.answer(
        &retry,
        answer(&contract::wire::WriteResponse::completed(86_400_000)),
    );
    assert_eq!(t.w.usage().writes, 0, "stored");
}

// ---------------------------------------------------------------------------------------------
// The replay cache

#[test]
fn a_completed_claim_fills_the_cache_and_replays_need_no_callout() {
    let mut t = Harness::new(CONFIG);
    let body = br#"{"amount":1}"#;
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", body);
    assert!(step.claims(), "nothing cached yet: {step:?}");
    t.advance(5);
    let step = t.answer_claim(
        &step,
        answer(&ClaimResponse::Completed {
            response: stored_201(),
            expires_in_ms: Some(86_400_000),
            waited_ms: None,
        }),
    );
    assert_eq!(step.counts(), vec![Metric::Replayed]);
    let from_api = step.reply().clone();
    assert!(t.w.usage().replay_bytes > 0);

    // The same request again: the same answer, from memory, at the end of the body.
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", br#"{ "amount" : 1.0 }"#);
    assert!(!step.claims());
    // The same answer: the key's horizon counts from the claim both ways (the claim was
    // answered 5 ms after it was sent: a second less, rounded down).
    assert_eq!(step.reply(), &from_api);
    assert_eq!(
        header(&from_api, "idempotency-key-expires-in"),
        Some("86399")
    );
    assert_eq!(
        step.counts(),
        vec![Metric::Replayed, Metric::ReplayCacheHits]
    );
    assert!(!t.w.awaits_response(s), "our own replay is never captured");

    // Another body under the same key: 422, still without a callout.
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", br#"{"amount":2}"#);
    assert!(!step.claims());
    let r = step.reply();
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (422, "/problems/idempotency-key-reused")
    );
    assert_eq!(
        step.counts(),
        vec![Metric::Mismatch422, Metric::ReplayCacheHits]
    );

    // Another subject or another endpoint is another record: claimed at the state API.
    let s = t.stream();
    assert!(t.send(s, "/checkout", "user-2", body).claims());
    let s = t.stream();
    assert!(t.send(s, "/refunds", "user-1", body).claims());

    // The TTL (60 s by default) bounds a long retention: after it, the state API is asked.
    t.advance(59_990);
    let s = t.stream();
    assert!(!t.send(s, "/checkout", "user-1", body).claims());
    t.advance(10);
    let s = t.stream();
    assert!(t.send(s, "/checkout", "user-1", body).claims());
}

#[test]
fn the_cache_never_outlives_the_record() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", b"{}");
    let claimed_at = t.now;
    // The answer takes 300 ms; the expiry counts from when the claim was sent.
    t.advance(300);
    t.answer_claim(
        &step,
        answer(&ClaimResponse::Completed {
            response: stored_201(),
            expires_in_ms: Some(2_000),
            waited_ms: None,
        }),
    );
    t.now = claimed_at + 1_999;
    let s = t.stream();
    assert!(!t.send(s, "/checkout", "user-1", b"{}").claims());
    t.now = claimed_at + 2_000;
    let s = t.stream();
    assert!(t.send(s, "/checkout", "user-1", b"{}").claims());
}

#[test]
fn without_an_expiry_or_a_cache_nothing_is_kept() {
    // An older state API: replays work, each one asks the state API.
    for (cfg, expires) in [
        (CONFIG.to_owned(), None),
        (with(r#""replay_cache_bytes": 0,"#), Some(86_400_000)),
    ] {
        let mut t = Harness::new(&cfg);
        for _ in 0..2 {
            let s = t.stream();
            let step = t.send(s, "/checkout", "user-1", b"{}");
            assert!(step.claims());
            let step = t.answer_claim(
                &step,
                answer(&ClaimResponse::Completed {
                    response: stored_201(),
                    expires_in_ms: expires,
                    waited_ms: None,
                }),
            );
            assert_eq!(step.counts(), vec![Metric::Replayed]);
        }
        assert_eq!(t.w.usage().replay_bytes, 0);
    }
}

/// The request `claimed()` sends, again: the step that ends its body.
fn retry_of_claimed(t: &mut Harness) -> Seen {
    let s = t.stream();
    let hs = req_headers(
        "/checkout",
        &[
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
        ],
    );
    t.headers(s, &hs, false);
    t.body(s, b"{}")
}

#[test]
fn an_own_complete_fills_the_cache_with_what_a_state_api_replay_would_give() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let upstream = h(&[
        (":status", "201"),
        ("content-type", "application/json"),
        ("location", "/c/1"),
        ("set-cookie", "s=1"),
        ("x-charge-id", "ch_1"),
    ]);
    t.response_headers(s, &upstream, "via_upstream", 0, false);
    let step = t.response_body(s, 8, true, &mut |_| Some(b"{\"id\":1}".to_vec()));
    let stored = step.complete().response;
    assert_eq!(
        t.w.usage().replay_bytes,
        0,
        "not before the state API stored it"
    );
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, answer(&WriteResponse::completed(30_000)));
    assert_eq!(step.counts(), vec![Metric::Completed]);

    // The retry of the same request (same key, subject, endpoint and body)...
    let cached = retry_of_claimed(&mut t);
    assert!(!cached.claims());
    assert_eq!(
        cached.counts(),
        vec![Metric::Replayed, Metric::ReplayCacheHits]
    );
    // ...gets exactly what a replay through the state API gives.
    let mut other = Harness::new(CONFIG);
    let step = retry_of_claimed(&mut other);
    let via_api = other.answer_claim(
        &step,
        answer(&ClaimResponse::Completed {
            response: stored,
            expires_in_ms: Some(30_000),
            waited_ms: None,
        }),
    );
    assert_eq!(cached.reply(), via_api.reply());
    assert_eq!(header(cached.reply(), "set-cookie"), None);

    // The record's expiry (30 s) is shorter than the TTL: it is the bound.
    t.advance(30_000);
    assert!(retry_of_claimed(&mut t).claims());
}

#[test]
fn not_replayable_outcomes_are_cached_as_409() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    t.response_headers(
        s,
        &h(&[(":status", "201"), ("location", "/c/9")]),
        "via_upstream",
        0,
        false,
    );
    let step = t.response_body(s, 16, false, &mut never);
    assert!(!step.complete().response.replayable);
    let d = step.dispatch(COMPLETE_PATH).clone();
    t.answer(&d, written());
    let step = retry_of_claimed(&mut t);
    assert!(!step.claims());
    let r = step.reply();
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (409, "/problems/outcome-not-replayable")
    );
    assert_eq!(header(r, "location"), Some("/c/9"));
    assert_eq!(
        step.counts(),
        vec![Metric::NotReplayable, Metric::ReplayCacheHits]
    );
}

#[test]
fn a_complete_answer_without_expiry_caches_nothing() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    let step = t.ok_response(s, "200", true);
    let d = step.dispatch(COMPLETE_PATH).clone();
    t.answer(&d, status(200, br#"{"state":"completed"}"#));
    assert_eq!(t.w.usage().replay_bytes, 0);
}

#[test]
fn a_handed_over_complete_answers_retries_on_this_worker_while_it_waits() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    t.response_headers(
        s,
        &h(&[(":status", "201"), ("location", "/c/1")]),
        "via_upstream",
        0,
        false,
    );
    let step = t.response_body(s, 2, true, &mut |_| Some(b"ok".to_vec()));
    let d = step.dispatch(COMPLETE_PATH).clone();
    let step = t.answer(&d, CalloutResult::Failed("reset".into()));
    let d = step.dispatch(COMPLETE_PATH).clone();
    t.answer(&d, CalloutResult::Failed("reset".into()));
    assert_eq!(t.w.usage().writes, 1);
    // The state API is still down: a retry of the request is answered from memory, a changed
    // one gets 422; either would otherwise be a claim that fails (503).
    t.advance(3_600_000);
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", b"{}");
    assert!(!step.claims());
    let r = step.reply();
    assert_eq!((r.status, r.body.as_slice()), (201, b"ok".as_slice()));
    assert_eq!(header(r, "idempotent-replayed"), Some("true"));
    let s = t.stream();
    assert_eq!(t.send(s, "/checkout", "user-1", b"[]").reply().status, 422);
}

#[test]
fn a_late_owner_fenced_by_its_heartbeat_answers_no_retry_with_its_response() {
    // Found by the simulation (seed 7001329883): the lease ran out, a retry elsewhere took the
    // key over with a larger token, the upstream refused this stream's stale token with a 409,
    // and the client left while that 409's complete was on its way. Handed over, the 409 was
    // replayed to the next retry on this worker although nothing had executed.
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    t.advance(7_500);
    let step = t.tick();
    let hb = step.dispatch(HEARTBEAT_PATH).clone();
    let step = t.answer(&hb, status(409, b"{}"));
    assert_eq!(step.counts(), vec![Metric::FencedOut]);
    assert!(
        t.tick().dispatches(HEARTBEAT_PATH).is_empty(),
        "a fenced claim is not extended"
    );
    t.response_headers(
        s,
        &h(&[
            (":status", "409"),
            ("content-type", "application/problem+json"),
        ]),
        "via_upstream",
        0,
        false,
    );
    let step = t.response_body(s, 2, true, &mut |_| Some(b"no".to_vec()));
    step.dispatch(COMPLETE_PATH);
    t.done(s);
    let u = t.w.usage();
    assert_eq!((u.claims, u.writes, u.replay_bytes), (0, 0, 0));
    // The retry asks the state API, which knows the newer owner.
    let s = t.stream();
    assert!(t.send(s, "/checkout", "user-1", b"{}").claims());
}

// ---------------------------------------------------------------------------------------------
// In-progress keys answered from memory

#[test]
fn a_reported_in_progress_key_is_answered_409_from_memory_for_a_short_time() {
    let mut t = Harness::new(CONFIG);
    let body = br#"{"amount":1}"#;
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", body);
    let step = t.answer_claim(
        &step,
        answer(&ClaimResponse::InProgress {
            retry_after_s: 2,
            lease_remaining_ms: 29_000,
            waited_ms: None,
        }),
    );
    let from_api = step.reply().clone();
    assert_eq!(step.counts(), vec![Metric::InProgress409]);

    // The same request (member order and whitespace aside) again: the same 409 without a
    // callout, until in_flight_cache_ms (500 by default) has passed since the claim was sent.
    t.advance(499);
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", br#"{ "amount" : 1 }"#);
    assert!(!step.claims(), "{step:?}");
    assert_eq!(step.reply(), &from_api);
    assert_eq!(header(step.reply(), "retry-after"), Some("2"));
    assert_eq!(
        step.counts(),
        vec![Metric::InProgress409, Metric::InFlightCacheHits]
    );

    // Another body asks the state API (the key may have been released and claimed again with
    // it, so a 422 from memory could be wrong); so does another subject.
    let s = t.stream();
    assert!(t
        .send(s, "/checkout", "user-1", br#"{"amount":2}"#)
        .claims());
    let s = t.stream();
    assert!(t.send(s, "/checkout", "user-2", body).claims());

    // After in_flight_cache_ms: the state API again.
    t.advance(1);
    let s = t.stream();
    assert!(t.send(s, "/checkout", "user-1", body).claims());
}

#[test]
fn a_409_from_memory_never_outlives_the_reported_lease() {
    let mut t = Harness::new(CONFIG);
    let body = br#"{"amount":1}"#;
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", body);
    // The owner's lease runs out in 40 ms: after that the state API must decide again.
    t.answer_claim(
        &step,
        answer(&ClaimResponse::InProgress {
            retry_after_s: 1,
            lease_remaining_ms: 40,
            waited_ms: None,
        }),
    );
    t.advance(39);
    let s = t.stream();
    assert!(!t.send(s, "/checkout", "user-1", body).claims());
    t.advance(1);
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", body);
    assert!(step.claims(), "the lease has run out: {step:?}");
    // This worker reclaims it: what it remembered is gone.
    let step = t.answer_claim(
        &step,
        answer(&ClaimResponse::Claimed {
            token: 9,
            lease_ms: 30_000,
            reclaimed: true,
            max_body_bytes: None,
            retention_s: None,
        }),
    );
    assert!(step.resumes_request());
    assert_eq!(t.w.usage().running_keys, 0);
}

#[test]
fn a_key_completed_or_released_here_is_no_longer_answered_409_from_memory() {
    for release in [false, true] {
        let mut t = Harness::new(CONFIG);
        let body = br#"{"amount":1}"#;
        // The first request claims the key on this worker...
        let owner = t.stream();
        let step = t.send(owner, "/checkout", "user-1", body);
        t.answer_claim(&step, claimed(7));
        // ... a retry meanwhile is told "in progress" by the state API ...
        let dup = t.stream();
        let step = t.send(dup, "/checkout", "user-1", body);
        t.answer_claim(
            &step,
            answer(&ClaimResponse::InProgress {
                retry_after_s: 2,
                lease_remaining_ms: 30_000,
                waited_ms: None,
            }),
        );
        assert_eq!(t.w.usage().running_keys, 1);
        // ... and then the first one is stored (or its key given back).
        let (step, path, done) = if release {
            (
                t.response_headers(
                    owner,
                    &h(&[(":status", "503")]),
                    "no_healthy_upstream",
                    0x2,
                    true,
                ),
                RELEASE_PATH,
                answer(&WriteResponse::released()),
            )
        } else {
            (t.ok_response(owner, "201", true), COMPLETE_PATH, written())
        };
        let d = step.dispatch(path).clone();
        t.answer(&d, done);
        assert_eq!(t.w.usage().running_keys, 0, "release: {release}");
        let s = t.stream();
        let step = t.send(s, "/checkout", "user-1", body);
        if release {
            assert!(step.claims(), "a released key is claimed anew: {step:?}");
        } else {
            assert!(!step.claims());
            assert_eq!(
                step.counts(),
                vec![Metric::Replayed, Metric::ReplayCacheHits]
            );
        }
    }
}

#[test]
fn without_the_replay_cache_or_with_in_flight_cache_ms_0_every_duplicate_asks() {
    for patch in [r#""replay_cache_bytes": 0,"#, r#""in_flight_cache_ms": 0,"#] {
        let mut t = Harness::new(&with(patch));
        let body = br#"{"amount":1}"#;
        let s = t.stream();
        let step = t.send(s, "/checkout", "user-1", body);
        t.answer_claim(
            &step,
            answer(&ClaimResponse::InProgress {
                retry_after_s: 2,
                lease_remaining_ms: 30_000,
                waited_ms: None,
            }),
        );
        let s = t.stream();
        assert!(t.send(s, "/checkout", "user-1", body).claims(), "{patch}");
    }
}

mod batching;
mod expiry;
mod features;
mod issue46;
mod key_state;
