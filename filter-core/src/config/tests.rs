//! Tests of the plugin configuration: its reader, its checks, and its serde form and schema
//! held to the reader.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use super::*;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

pub const EXAMPLE: &str = r#"{
      "state_api": {"cluster": "state_api", "authority": "state-api", "token": "secret", "timeout_ms": 1000},
      "subject": {"header": "x-jwt-sub"},
      "routes": [
        {"method": "POST", "path": "/checkout", "key": "required"},
        {"method": "POST", "path": "/refunds", "key": "required", "on_5xx": "store", "on_state_unavailable": "fail_closed"}
      ],
      "max_request_body_bytes": 1048576,
      "max_stored_body_bytes": 1048576,
      "lease_ms": 30000,
      "heartbeat_ms": 10000,
      "replay_extra_headers": [],
      "replay_cache_bytes": 8388608,
      "replay_cache_ttl_ms": 60000,
      "in_flight_cache_ms": 500,
      "complete_retry_ms": 600000,
      "complete_retry_bytes": 16777216
    }"#;

fn with(patch: impl FnOnce(&mut serde_json::Value)) -> Result<Config, ConfigError> {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(EXAMPLE) else {
        panic!("the example configuration is not JSON");
    };
    patch(&mut v);
    Config::parse(v.to_string().as_bytes())
}

#[test]
fn the_documented_example_parses() {
    let c = Config::parse(EXAMPLE.as_bytes()).unwrap();
    assert_eq!(c.routes.len(), 2);
    assert_eq!(c.subject, SubjectSource::Header("x-jwt-sub".into()));
    assert_eq!(c.timeout(), Duration::from_millis(1000));
    assert_eq!(
        c.route("POST", "/checkout").map(|r| r.key),
        Some(KeyPolicy::Required)
    );
    assert!(c.route("GET", "/checkout").is_none());
    assert!(c.route("POST", "/checkout/x").is_none());
}

#[test]
fn defaults_apply() {
    let c = Config::parse(
        br#"{"state_api":{"cluster":"c","authority":"a","token":"t"},"subject":{"metadata":["envoy.filters.http.jwt_authn","jwt_payload","sub"]},"routes":[{"method":"post","prefix":"/pay/","key":"optional"}]}"#,
    )
    .unwrap();
    assert_eq!(c.max_request_body_bytes, 1 << 20);
    assert_eq!(c.max_stored_body_bytes, 1 << 20);
    assert_eq!(
        (c.lease_ms, c.heartbeat_ms, c.state_api.timeout_ms),
        (30_000, 10_000, 1_000)
    );
    assert_eq!(
        (
            c.replay_cache_bytes,
            c.replay_cache_ttl_ms,
            c.in_flight_cache_ms
        ),
        (8 << 20, 60_000, 500)
    );
    assert_eq!(
        (c.complete_retry_ms, c.complete_retry_bytes),
        (600_000, 16 << 20)
    );
    assert!(c.retries_completes());
    assert!(!c.complete_in_background, "the response is held by default");
    assert_eq!(c.max_buffered_bytes(), 64 << 20);
    assert_eq!(c.max_buffered_bytes_per_subject(), 16 << 20, "a quarter");
    let big = with(|v| v["routes"][1]["max_request_body_bytes"] = (100 << 20).into()).unwrap();
    assert_eq!(
        big.max_buffered_bytes(),
        100 << 20,
        "room for the largest body"
    );
    assert_eq!(
        big.max_buffered_bytes_per_subject(),
        100 << 20,
        "a subject may send the largest body"
    );
    // The bound's reserve for callers who hold little: an eighth, never crowding out the
    // largest body, none where one subject may hold the whole bound.
    assert_eq!(c.buffer_reserve(), 8 << 20, "an eighth");
    assert_eq!(big.buffer_reserve(), 0, "one subject may hold it all");
    let tight = with(|v| {
        v["max_buffered_bytes"] = ((1 << 20) + 1000).into();
        v["max_buffered_bytes_per_subject"] = (1 << 20).into();
    })
    .unwrap();
    assert_eq!(
        tight.buffer_reserve(),
        1000,
        "the largest body still fits beside it"
    );
    let exact = with(|v| {
        v["max_buffered_bytes"] = (1 << 20).into();
    })
    .unwrap();
    assert_eq!(exact.buffer_reserve(), 0);
    let one_identity = with(|v| {
        v["max_buffered_bytes"] = (8 << 20).into();
        v["max_buffered_bytes_per_subject"] = (8 << 20).into();
    })
    .unwrap();
    assert_eq!(
        one_identity.buffer_reserve(),
        0,
        "no reserve where one subject may hold the whole bound (an eighth otherwise)"
    );
    let r = c.route("POST", "/pay/x").unwrap();
    assert_eq!(
        (r.on_5xx, r.on_state_unavailable),
        (On5xx::Store, OnStateUnavailable::FailClosed)
    );
}

#[test]
fn a_route_may_have_its_own_lease_heartbeat_and_body_limit() {
    let c = with(|v| {
        v["routes"][1]["lease_ms"] = 4_000.into();
        v["routes"][1]["heartbeat_ms"] = 1_000.into();
        v["routes"][1]["max_request_body_bytes"] = 64.into();
    })
    .unwrap();
    assert_eq!((c.lease_for(0), c.heartbeat_for(0)), (30_000, 10_000));
    assert_eq!((c.lease_for(1), c.heartbeat_for(1)), (4_000, 1_000));
    assert_eq!(
        (c.max_request_body_for(0), c.max_request_body_for(1)),
        (1 << 20, 64)
    );
    assert_eq!(
        c.tick_period_ms(),
        250,
        "a quarter of the shortest heartbeat"
    );
    // Checked as the global ones are, and named by route.
    let e = with(|v| v["routes"][1]["heartbeat_ms"] = 20_000.into()).unwrap_err();
    assert!(e.to_string().contains("routes[1].heartbeat_ms"), "{e}");
    let e = with(|v| v["routes"][0]["lease_ms"] = 999.into()).unwrap_err();
    assert!(e.to_string().contains("routes[0].lease_ms"), "{e}");
    let e = with(|v| v["routes"][0]["max_request_body_bytes"] = 0.into()).unwrap_err();
    assert!(
        e.to_string().contains("routes[0].max_request_body_bytes"),
        "{e}"
    );
}

#[test]
fn unknown_fields_are_refused_with_their_name() {
    let e = with(|v| v["lease"] = 5.into()).unwrap_err();
    assert!(e.to_string().contains("unknown field `lease`"), "{e}");
    let e = with(|v| v["routes"][0]["methods"] = "GET".into()).unwrap_err();
    assert!(e.to_string().contains("unknown field `methods`"), "{e}");
    let e = with(|v| v["routes"][0]["key"] = "sometimes".into()).unwrap_err();
    assert!(e.to_string().contains("unknown variant `sometimes`"), "{e}");
    assert!(Config::parse(b"not json").is_err());
}

#[test]
fn invalid_values_are_refused() {
    type Patch = Box<dyn FnOnce(&mut serde_json::Value)>;
    let cases: Vec<(Patch, &str)> = vec![
        (
            Box::new(|v| v["state_api"]["timeout_ms"] = 0.into()),
            "timeout_ms",
        ),
        (
            Box::new(|v| v["heartbeat_ms"] = 30_000.into()),
            "heartbeat_ms",
        ),
        (
            Box::new(|v| v["heartbeat_ms"] = 15_001.into()),
            "at most half of lease_ms",
        ),
        (
            Box::new(|v| v["lease_ms"] = 0.into()),
            "lease_ms must be 1000 to 600000",
        ),
        (
            Box::new(|v| {
                v["lease_ms"] = 2_000_000.into();
                v["heartbeat_ms"] = 1_000_000.into();
            }),
            "lease_ms must be 1000 to 600000",
        ),
        (
            Box::new(|v| v["max_stored_body_bytes"] = (16 * 1024 * 1024 + 1).into()),
            "max_stored_body_bytes",
        ),
        (
            Box::new(|v| v["in_flight_cache_ms"] = 10_001.into()),
            "in_flight_cache_ms",
        ),
        (
            Box::new(|v| v["max_request_body_bytes"] = 0.into()),
            "max_request_body_bytes",
        ),
        (
            Box::new(|v| v["max_buffered_bytes"] = 1_048_575.into()),
            "max_buffered_bytes must be at least the largest request body a route accepts (1048576)",
        ),
        (
            Box::new(|v| {
                v["max_buffered_bytes"] = 2_000_000.into();
                v["routes"][1]["max_request_body_bytes"] = 2_000_001.into();
            }),
            "(2000001)",
        ),
        (
            Box::new(|v| v["max_buffered_bytes_per_subject"] = 1_048_575.into()),
            "max_buffered_bytes_per_subject must be at least the largest request body a route accepts (1048576)",
        ),
        (
            Box::new(|v| {
                v["max_buffered_bytes"] = 2_000_000.into();
                v["max_buffered_bytes_per_subject"] = 2_000_001.into();
            }),
            "at most max_buffered_bytes (2000000)",
        ),
        (
            Box::new(|v| v["max_stored_body_bytes"] = 0.into()),
            "max_stored_body_bytes",
        ),
        (Box::new(|v| v["routes"] = serde_json::json!([])), "routes"),
        (
            Box::new(|v| v["routes"][0]["path"] = "checkout".into()),
            "routes[0]",
        ),
        (
            Box::new(|v| v["routes"][1]["prefix"] = "/r".into()),
            "routes[1]",
        ),
        (
            Box::new(|v| v["state_api"]["cluster"] = "".into()),
            "cluster",
        ),
        (Box::new(|v| v["state_api"]["token"] = "".into()), "token"),
        (
            Box::new(|v| v["subject"] = serde_json::json!({"header": "x y"})),
            "subject",
        ),
        (
            Box::new(|v| {
                v["subject"] = serde_json::json!({"header": "a", "metadata": ["a", "b"]})
            }),
            "",
        ),
        (
            Box::new(|v| v["replay_extra_headers"] = serde_json::json!(["Set-Cookie"])),
            "set-cookie",
        ),
        (
            Box::new(|v| v["replay_extra_headers"] = serde_json::json!(["connection"])),
            "connection",
        ),
    ];
    for (patch, needle) in cases {
        let e = with(patch).unwrap_err();
        assert!(
            e.to_string().contains(needle),
            "{e} should mention {needle}"
        );
    }
}

#[test]
fn syntax_errors_say_where_and_numbers_are_integers() {
    let e = Config::parse(b"{\n  \"state_api\": }").unwrap_err();
    assert!(e.to_string().contains("at line 2 column 16"), "{e}");
    let e = with(|v| v["lease_ms"] = serde_json::json!(1.5)).unwrap_err();
    assert!(e.to_string().contains("integer"), "{e}");
    let e = with(|v| v["lease_ms"] = "30000".into()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid idempotency filter configuration: lease_ms must be a non-negative integer, not a string"
    );
    let twice = EXAMPLE.replacen(
        r#""lease_ms": 30000,"#,
        r#""lease_ms": 30000, "lease_ms": 1,"#,
        1,
    );
    let e = Config::parse(twice.as_bytes()).unwrap_err();
    assert!(e.to_string().contains("duplicate field `lease_ms`"), "{e}");
    let e = with(|v| v["state_api"]["bogus"] = 1.into()).unwrap_err();
    assert!(
        e.to_string()
            .contains("unknown field `bogus` in state_api, expected one of `cluster`"),
        "{e}"
    );
    let e = with(|v| v["routes"][1]["on_5xx"] = "retry".into()).unwrap_err();
    assert!(
        e.to_string()
            .contains("unknown variant `retry` for routes[1].on_5xx"),
        "{e}"
    );
    let e = with(|v| {
        v.as_object_mut()
            .unwrap()
            .remove("routes")
            .map(|_| ())
            .unwrap()
    })
    .unwrap_err();
    assert!(e.to_string().contains("missing field `routes`"), "{e}");
}

#[test]
fn cache_and_retries_can_be_turned_off() {
    let c = with(|v| {
        v["replay_cache_bytes"] = 0.into();
        v["complete_retry_ms"] = 0.into();
    })
    .unwrap();
    assert_eq!(c.replay_cache_bytes, 0);
    assert!(!c.retries_completes());
    let e = with(|v| v["replay_cache_bytes"] = (-1).into()).unwrap_err();
    assert!(
        e.to_string().contains("replay_cache_bytes") || e.to_string().contains("invalid value"),
        "{e}"
    );
}

#[test]
fn completing_in_background_needs_the_workers_retries() {
    let c = with(|v| v["complete_in_background"] = true.into()).unwrap();
    assert!(c.complete_in_background);
    for field in ["complete_retry_ms", "complete_retry_bytes"] {
        let e = with(|v| {
            v["complete_in_background"] = true.into();
            v[field] = 0.into();
        })
        .unwrap_err();
        assert!(
            e.to_string().contains("complete_in_background needs"),
            "{e}"
        );
    }
    let e = with(|v| v["complete_in_background"] = "yes".into()).unwrap_err();
    assert!(e.to_string().contains("complete_in_background"), "{e}");
}

/// Every field away from its default: what serde writes, the reader reads back the same.
/// The literals name every field, so a new one is written here too.
fn every_field_set() -> Config {
    let pointer = |p: &str| Pointer::parse(p).unwrap();
    Config {
        state_api: StateApi {
            cluster: "outbound|8081||state-api.idem.svc.cluster.local".into(),
            wait_cluster: Some("outbound|8082||state-api.idem.svc.cluster.local".into()),
            authority: "state-api.idem.svc.cluster.local:8081".into(),
            token: "a token with spaces".into(),
            timeout_ms: 2_500,
        },
        subject: SubjectSource::Metadata(vec![
            "envoy.filters.http.jwt_authn".into(),
            "payload".into(),
            "sub".into(),
        ]),
        routes: vec![
            Route {
                method: "POST".into(),
                path: Some("/orders".into()),
                prefix: None,
                key: KeyPolicy::Optional,
                on_5xx: On5xx::Release,
                on_state_unavailable: OnStateUnavailable::FailOpen,
                on_unknown: OnUnknown::Reconcile,
                reconcile: Some(Reconcile {
                    cluster: "reconcile_0".into(),
                    authority: "orders:8080".into(),
                    method: "POST".into(),
                    path: "/attempts/{key}".into(),
                    timeout_ms: 700,
                }),
                lease_ms: Some(4_000),
                heartbeat_ms: Some(1_000),
                max_request_body_bytes: Some(4_096),
                retention_s: Some(3_600),
                max_wait_s: 3,
                fingerprint: Selection::Include(vec![pointer("/amount"), pointer("/a~1b")]),
                key_from: Some(pointer("/idempotency_key")),
            },
            Route {
                method: "PUT".into(),
                path: None,
                prefix: Some("/refunds/".into()),
                key: KeyPolicy::Required,
                on_5xx: On5xx::Store,
                on_state_unavailable: OnStateUnavailable::FailClosed,
                on_unknown: OnUnknown::Reexecute,
                reconcile: None,
                lease_ms: None,
                heartbeat_ms: None,
                max_request_body_bytes: None,
                retention_s: None,
                max_wait_s: 0,
                fingerprint: Selection::Ignore(vec![pointer("/sent_at")]),
                key_from: None,
            },
        ],
        max_request_body_bytes: 2_048,
        max_stored_body_bytes: 3_072,
        lease_ms: 20_000,
        heartbeat_ms: 5_000,
        replay_extra_headers: vec!["x-charge-id".into()],
        replay_cache_bytes: 1_024,
        replay_cache_ttl_ms: 1_000,
        in_flight_cache_ms: 250,
        complete_retry_ms: 5_000,
        complete_retry_bytes: 4_096,
        complete_in_background: true,
        namespace: "shop-eu".into(),
        max_waiters: 7,
        batch_max: 5,
        max_buffered_bytes: Some(1 << 20),
        max_buffered_bytes_per_subject: Some(1 << 20),
        key_state_path: Some("/idempotency/key-state".into()),
    }
}

#[test]
fn what_serde_writes_the_reader_reads_back_the_same() {
    let written = every_field_set();
    let json = serde_json::to_vec(&written).unwrap();
    assert_eq!(Config::parse(&json).unwrap(), written);
    let mut with_header = written;
    with_header.subject = SubjectSource::Header("x-jwt-sub".into());
    let json = serde_json::to_vec(&with_header).unwrap();
    assert_eq!(Config::parse(&json).unwrap(), with_header);
    // A route's absent options are left out, not written as null.
    let text = String::from_utf8(json).unwrap();
    assert!(!text.contains("null"), "{text}");
}

#[test]
fn null_is_no_value() {
    let e = with(|v| v["lease_ms"] = serde_json::Value::Null).unwrap_err();
    assert!(e.to_string().contains(": lease_ms is null"), "{e}");
    let e = with(|v| v["routes"][1]["on_5xx"] = serde_json::Value::Null).unwrap_err();
    assert!(e.to_string().contains(": routes[1].on_5xx is null"), "{e}");
    let e = with(|v| v["replay_extra_headers"] = serde_json::json!(["a", null])).unwrap_err();
    assert!(
        e.to_string().contains(": replay_extra_headers[1] is null"),
        "{e}"
    );
}

#[test]
fn extra_replay_headers_are_lower_cased() {
    let c = with(|v| v["replay_extra_headers"] = serde_json::json!(["X-Charge-Id"])).unwrap();
    assert_eq!(c.replay_extra_headers, vec!["x-charge-id".to_owned()]);
}
