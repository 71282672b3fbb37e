//! The configuration file: what it accepts, and the one clear error (field and line) for each
//! kind of mistake.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use contract::state_env;
use std::path::PathBuf;

use edge::config::{Config, ConfigError, Jwks, Match, OnUnknown, Subject};

/// A folder with a JWKS file, for files that name one.
fn folder() -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "edge-config-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("jwks.json"),
        r#"{"keys": [{"kty": "RSA", "n": "x", "e": "AQAB"}]}"#,
    )
    .unwrap();
    dir
}

const GOOD: &str = r#"listen = "127.0.0.1:10000"
upstream = "http://127.0.0.1:3000"

[subject.jwt]
issuer = "https://issuer.example"
audiences = ["orders"]
jwks_file = "jwks.json"

[[route]]
method = "POST"
path = "/orders"
key = "required"
"#;

/// What rendering needs besides the file: a module path, a token and the CA bundle.
fn inputs() -> edge::render::Inputs {
    edge::render::Inputs {
        wasm: "/x/filter.wasm".into(),
        state_token: "t".repeat(16),
        ca_file: edge::render::DEFAULT_CA_FILE.into(),
    }
}

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, "edge.toml", &folder())
}

/// The error's line and message.
fn error(text: &str) -> (usize, String) {
    match parse(text) {
        Err(ConfigError::At {
            line,
            message,
            file,
        }) => {
            assert_eq!(file, "edge.toml");
            (line, message)
        }
        other => panic!("expected an error with a line, got {other:?}"),
    }
}

#[test]
fn the_smallest_file_gets_the_filter_defaults() {
    let c = parse(GOOD).unwrap();
    assert_eq!(c.listen.to_string(), "127.0.0.1:10000");
    assert_eq!(c.admin, None);
    assert_eq!(
        (c.upstream.host.as_str(), c.upstream.port, c.upstream.tls),
        ("127.0.0.1", 3000, false)
    );
    assert_eq!(c.state.listen.to_string(), "127.0.0.1:8081");
    assert!(c.embedded_postgres());
    assert_eq!(c.state.postgres_port, 54330);
    assert_eq!((c.filter.lease_ms, c.filter.heartbeat_ms), (30_000, 10_000));
    let Subject::Jwt(j) = &c.subject else {
        panic!("a JWT subject")
    };
    assert_eq!(
        (j.header.as_str(), j.claim.as_str(), j.forward_token),
        ("x-jwt-sub", "sub", true)
    );
    assert!(matches!(&j.jwks, Jwks::File(p) if p.ends_with("jwks.json") && p.is_absolute()));
    assert_eq!(c.routes.len(), 1);
    assert_eq!(c.routes[0].matcher, Match::Path("/orders".into()));
    assert_eq!(c.routes[0].on_unknown, OnUnknown::Hold);
}

#[test]
fn the_committed_examples_load() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    for f in ["examples/demo.toml", "examples/own-api.toml"] {
        Config::load(&root.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
}

#[test]
fn every_option_is_read() {
    let text = GOOD.replace(
        "[[route]]",
        r#"[filter]
lease_ms = 20000
heartbeat_ms = 5000
max_request_body_bytes = 4096
complete_in_background = true
replay_extra_headers = ["X-Charge-Id"]

[[route]]
method = "POST"
prefix = "/payments/"
key = "optional"
on_5xx = "release"
on_state_unavailable = "fail_open"
on_unknown = "reconcile"
reconcile = { path = "/payments/attempts/{key}", upstream = "https://ledger.example:8443", timeout_ms = 500 }
lease_ms = 60000
heartbeat_ms = 20000
max_request_body_bytes = 100

[[route]]"#,
    );
    let c = parse(&text).unwrap();
    assert_eq!(c.filter.replay_extra_headers, ["x-charge-id"]);
    assert!(c.filter.complete_in_background);
    let r = &c.routes[0];
    assert_eq!(r.matcher, Match::Prefix("/payments/".into()));
    assert_eq!(
        (r.lease_ms, r.heartbeat_ms, r.max_request_body_bytes),
        (Some(60_000), Some(20_000), Some(100))
    );
    let rc = r.reconcile.as_ref().unwrap();
    assert_eq!(rc.method, "GET");
    let up = rc.upstream.as_ref().unwrap();
    assert_eq!(
        (up.tls, up.host.as_str(), up.port),
        (true, "ledger.example", 8443)
    );
    // What the filter makes of it: its own parser accepts the rendered JSON.
    let json = edge::render::filter_json(&c, "t0ken-t0ken-t0ken");
    let f = filter_core::config::Config::parse(json.as_bytes()).unwrap();
    assert_eq!(f.lease_for(0), 60_000);
    assert_eq!(
        f.routes[0].reconcile.as_ref().map(|r| r.cluster.as_str()),
        Some("reconcile_0")
    );
}

#[test]
fn a_missing_upstream_is_named() {
    let (line, msg) = error(&GOOD.replace("upstream = \"http://127.0.0.1:3000\"\n", ""));
    assert!(msg.contains("missing field `upstream`"), "{msg}");
    assert_eq!(line, 1);
}

#[test]
fn a_route_with_both_path_and_prefix_is_refused_at_its_line() {
    let (line, msg) =
        error(&GOOD.replace("key = \"required\"", "key = \"required\"\nprefix = \"/o/\""));
    assert_eq!(line, 13, "{msg}");
    assert!(msg.contains("either path or prefix, not both"), "{msg}");
}

#[test]
fn a_lease_shorter_than_two_heartbeats_is_refused() {
    let (line, msg) = error(&GOOD.replace(
        "key = \"required\"",
        "key = \"required\"\nlease_ms = 5000\nheartbeat_ms = 3000",
    ));
    assert_eq!(line, 14, "{msg}");
    assert!(msg.contains("shorter than two heartbeats"), "{msg}");
    let (line, msg) =
        error(&GOOD.replace("[[route]]", "[filter]\nheartbeat_ms = 20000\n\n[[route]]"));
    assert_eq!(line, 10, "{msg}");
    assert!(
        msg.contains("filter.lease_ms (30000 ms) is shorter than two heartbeats"),
        "{msg}"
    );
}

#[test]
fn an_unreadable_jwks_is_refused_at_its_line() {
    let (line, msg) = error(&GOOD.replace("jwks.json", "missing.json"));
    assert_eq!(line, 7);
    assert!(
        msg.contains("subject.jwt.jwks_file") && msg.contains("cannot read"),
        "{msg}"
    );
    let dir = folder();
    std::fs::write(dir.join("bad.json"), "{\"not\": \"a jwks\"}").unwrap();
    let e = Config::parse(&GOOD.replace("jwks.json", "bad.json"), "edge.toml", &dir).unwrap_err();
    assert!(e.to_string().contains("no \"keys\""), "{e}");
}

#[test]
fn a_port_in_use_is_refused_at_its_line_before_anything_starts() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let c = parse(&GOOD.replace("127.0.0.1:10000", &format!("127.0.0.1:{port}"))).unwrap();
    let e = edge::run::check_ports(&c, false).unwrap_err();
    match e {
        ConfigError::At { line, message, .. } => {
            assert_eq!(line, 1);
            assert!(
                message.contains("listen") && message.contains("in use"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn other_mistakes_are_named_too() {
    let cases: &[(&str, &str, usize, &str)] = &[
        (
            "listen = \"127.0.0.1:10000\"",
            "listen = \"localhost\"",
            1,
            "listen must be an address and port",
        ),
        (
            "upstream = \"http://127.0.0.1:3000\"",
            "upstream = \"ftp://x\"",
            2,
            "http:// or https://",
        ),
        (
            "upstream = \"http://127.0.0.1:3000\"",
            "upstream = \"http://x/api\"",
            2,
            "without a path",
        ),
        (
            "key = \"required\"",
            "key = \"always\"",
            12,
            "unknown variant `always`",
        ),
        (
            "key = \"required\"",
            "key = \"required\"\nmethods = \"GET\"",
            13,
            "unknown field `methods`",
        ),
        (
            "path = \"/orders\"",
            "path = \"orders\"",
            11,
            "must start with '/'",
        ),
        (
            "key = \"required\"",
            "key = \"required\"\non_unknown = \"reconcile\"",
            13,
            "needs reconcile",
        ),
        (
            "key = \"required\"",
            "key = \"required\"\nreconcile = { path = \"/x/{key}\" }",
            13,
            "only used with on_unknown",
        ),
        (
            "key = \"required\"",
            "key = \"required\"\non_unknown = \"reconcile\"\nreconcile = { path = \"/x\" }",
            14,
            "hold {key}",
        ),
        (
            "audiences = [\"orders\"]",
            "audiences = []",
            6,
            "at least one audience",
        ),
        (
            "[subject.jwt]",
            "[subject]\nheader = \"x-user\"\n\n[subject.jwt]",
            4,
            "exactly one of",
        ),
        (
            "jwks_file = \"jwks.json\"",
            "jwks_file = \"jwks.json\"\njwks_url = \"https://issuer.example/jwks\"",
            4,
            "exactly one of jwks_file or jwks_url",
        ),
    ];
    for (from, to, want_line, want) in cases {
        let (line, msg) = error(&GOOD.replace(from, to));
        assert!(msg.contains(want), "{to:?}: {msg}");
        assert_eq!(line, *want_line, "{to:?}: {msg}");
    }
    // No route at all, a route twice.
    let (_, msg) = error(GOOD.split("[[route]]").next().unwrap());
    assert!(msg.contains("no [[route]]"), "{msg}");
    let twice =
        format!("{GOOD}\n[[route]]\nmethod = \"post\"\npath = \"/orders\"\nkey = \"optional\"\n");
    let (line, msg) = error(&twice);
    assert_eq!(line, 14, "{msg}");
    assert!(msg.contains("already configured"), "{msg}");
    // The same port twice.
    let (_, msg) = match parse(&GOOD.replace(
        "[subject.jwt]",
        "[state]\nlisten = \"127.0.0.1:10000\"\n\n[subject.jwt]",
    )) {
        Err(ConfigError::At { line, message, .. }) => (line, message),
        other => panic!("{other:?}"),
    };
    assert!(msg.contains("same address as listen"), "{msg}");
}

#[test]
fn a_header_subject_is_allowed() {
    let text = GOOD.replace(
        "[subject.jwt]\nissuer = \"https://issuer.example\"\naudiences = [\"orders\"]\njwks_file = \"jwks.json\"",
        "[subject]\nheader = \"X-User-Id\"",
    );
    let c = parse(&text).unwrap();
    assert_eq!(c.subject, Subject::Header("x-user-id".into()));
}

#[test]
fn the_options_users_ask_for_are_read_and_rendered() {
    let text = GOOD
        .replace(
            "upstream = \"http://127.0.0.1:3000\"",
            "upstream = \"http://127.0.0.1:3000\"\nnamespace = \"shop-eu\"",
        )
        .replace(
            "[subject.jwt]",
            "[state]\nadmin_token = \"operators-0123456789\"\nmax_retention_s = 604800\n\n[filter]\nmax_waiters = 8\n\n[subject.jwt]",
        )
        .replace(
            "key = \"required\"",
            r#"key = "required"
retention_s = 3600
max_wait_s = 5
fingerprint = { ignore = ["/meta/sent_at", "/items/0/trace"] }
key_from = "/idempotency_key""#,
        );
    let c = parse(&text).unwrap();
    assert_eq!(c.namespace, "shop-eu");
    assert_eq!(c.state.admin_token.as_deref(), Some("operators-0123456789"));
    assert_eq!(c.state.max_retention_s, Some(604_800));
    assert_eq!(c.filter.max_waiters, 8);
    let r = &c.routes[0];
    assert_eq!((r.retention_s, r.max_wait_s), (Some(3_600), 5));
    assert_eq!(
        r.key_from.as_ref().map(|p| p.as_str()),
        Some("/idempotency_key")
    );
    let json = edge::render::filter_json(&c, "t0ken-t0ken-t0ken");
    let f = filter_core::config::Config::parse(json.as_bytes()).unwrap();
    assert_eq!((f.namespace.as_str(), f.max_waiters), ("shop-eu", 8));
    let fr = &f.routes[0];
    assert_eq!((fr.retention_s, fr.max_wait_s), (Some(3_600), 5));
    assert_eq!(fr.fingerprint, r.fingerprint);
    assert!(matches!(&fr.fingerprint, filter_core::config::Selection::Ignore(l) if l.len() == 2));
    assert_eq!(fr.key_from, r.key_from);
    // The state API gets the admin token and the retention bound.
    let env = edge::render::state_api_env(&c, "postgres://x", "filter-token-0123456", "secret");
    assert!(env.contains(&(
        state_env::STATE_API_ADMIN_TOKEN.into(),
        "operators-0123456789".into()
    )));
    assert!(env.contains(&(state_env::STATE_API_MAX_RETENTION_S.into(), "604800".into())));
    // Without them: no namespace, no admin API, the route's defaults.
    let c = parse(GOOD).unwrap();
    assert_eq!(
        (c.namespace.as_str(), c.state.admin_token.as_ref()),
        ("", None)
    );
    assert_eq!(c.routes[0].max_wait_s, 10);
    assert!(
        !edge::render::state_api_env(&c, "postgres://x", "filter-token-0123456", "s")
            .iter()
            .any(|(k, _)| k == state_env::STATE_API_ADMIN_TOKEN)
    );
}

#[test]
fn the_new_options_refuse_what_cannot_work_at_their_line() {
    let route = |extra: &str| {
        GOOD.replace(
            "key = \"required\"",
            &format!("key = \"required\"\n{extra}"),
        )
    };
    let cases: Vec<(String, usize, &str)> = vec![
        (route("fingerprint = { ignore = [\"meta\"] }"), 13, "JSON pointer"),
        (route("fingerprint = { ignore = [] }"), 13, "exactly one non-empty list"),
        (
            route("fingerprint = { ignore = [\"/a\"], include = [\"/b\"] }"),
            13,
            "exactly one non-empty list",
        ),
        (route("fingerprint = { only = [\"/a\"] }"), 13, "unknown field `only`"),
        (route("key_from = \"idempotency_key\""), 13, "route.key_from"),
        (route("max_wait_s = 61"), 13, "max_wait_s must be at most 60"),
        (route("retention_s = 0"), 13, "retention_s must be > 0"),
        (route("retention_s = 99999999"), 13, "over state.max_retention_s"),
        (
            GOOD.replace("upstream = \"http://127.0.0.1:3000\"", "upstream = \"http://127.0.0.1:3000\"\nnamespace = \"Shop EU\""),
            3,
            "namespace must be",
        ),
        (
            GOOD.replace("[subject.jwt]", "[state]\nadmin_token = \"short\"\n\n[subject.jwt]"),
            5,
            "admin_token must be at least 16",
        ),
        (
            GOOD.replace(
                "[subject.jwt]",
                "[state]\ntoken = \"same-token-0123456789\"\nadmin_token = \"same-token-0123456789\"\n\n[subject.jwt]",
            ),
            6,
            "must not be the filter's token",
        ),
        (
            GOOD.replace("[subject.jwt]", "[filter]\nmax_waiters = 100000\n\n[subject.jwt]"),
            5,
            "max_waiters must be at most",
        ),
    ];
    for (text, want_line, want) in cases {
        let (line, msg) = error(&text);
        assert!(msg.contains(want), "{want}: {msg}");
        assert_eq!(line, want_line, "{want}: {msg}");
    }
}

/// `[state.tls]` with PEM files in the folder (only their labels are checked here; the TLS
/// end-to-end suite, tests/tests/tls.rs, runs real certificates).
fn tls_folder() -> PathBuf {
    let dir = folder();
    for (name, label) in [
        ("state.pem", "CERTIFICATE"),
        ("state-key.pem", "PRIVATE KEY"),
        ("ca.pem", "CERTIFICATE"),
        ("envoy.pem", "CERTIFICATE"),
        ("envoy-key.pem", "EC PRIVATE KEY"),
    ] {
        std::fs::write(
            dir.join(name),
            format!("-----BEGIN {label}-----\nAAAA\n-----END {label}-----\n"),
        )
        .unwrap();
    }
    dir
}

fn with_state_tls(tls: &str) -> String {
    format!("{GOOD}\n[state.tls]\n{tls}")
}

#[test]
fn state_tls_is_read_and_rendered_as_an_upstream_tls_context() {
    let dir = tls_folder();
    let text = with_state_tls(
        "cert_file = \"state.pem\"\nkey_file = \"state-key.pem\"\nca_file = \"ca.pem\"\n\
         server_name = \"state-api.internal\"\nclient_cert_file = \"envoy.pem\"\n\
         client_key_file = \"envoy-key.pem\"\nclient_ca_file = \"ca.pem\"\n",
    );
    let c = Config::parse(&text, "edge.toml", &dir).unwrap();
    let tls = c.state.tls.clone().unwrap();
    assert_eq!(tls.server_name, "state-api.internal");
    assert!(tls.cert_file.is_absolute() && tls.cert_file.ends_with("state.pem"));
    assert!(tls.client_cert.is_some() && tls.client_ca_file.is_some());
    let inputs = inputs();
    let yaml = edge::render::envoy_yaml(&c, &inputs);
    let state_cluster = &yaml[yaml.find("name: state_api").unwrap()..];
    let state_cluster =
        &state_cluster[..state_cluster.find("- name:").unwrap_or(state_cluster.len())];
    for wanted in [
        "UpstreamTlsContext",
        "sni: state-api.internal",
        "san_type: DNS",
        "exact: state-api.internal",
        "tls_certificates",
        "envoy.pem",
        "envoy-key.pem",
        "ca.pem",
        "tls_minimum_protocol_version: TLSv1_2",
    ] {
        assert!(
            state_cluster.contains(wanted),
            "{wanted} in\n{state_cluster}"
        );
    }
    let env = edge::render::state_api_env(&c, "postgres://x@h/db", "t", "k");
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert!(get(state_env::STATE_API_TLS_CERT).is_some_and(|v| v.ends_with("state.pem")));
    assert!(get(state_env::STATE_API_TLS_KEY).is_some_and(|v| v.ends_with("state-key.pem")));
    assert!(get(state_env::STATE_API_TLS_CLIENT_CA).is_some_and(|v| v.ends_with("ca.pem")));

    // Without a name, SNI and the SAN are the state API's address; without a client
    // certificate, Envoy presents none and the state API asks for none.
    let text = with_state_tls(
        "cert_file = \"state.pem\"\nkey_file = \"state-key.pem\"\nca_file = \"ca.pem\"\n",
    );
    let c = Config::parse(&text, "edge.toml", &dir).unwrap();
    let yaml = edge::render::envoy_yaml(&c, &inputs);
    assert!(yaml.contains("sni: 127.0.0.1") && yaml.contains("san_type: IP_ADDRESS"));
    assert!(!yaml.contains("tls_certificates"));
    let env = edge::render::state_api_env(&c, "postgres://x@h/db", "t", "k");
    assert!(!env
        .iter()
        .any(|(k, _)| k == state_env::STATE_API_TLS_CLIENT_CA));
}

#[test]
fn plain_http_to_the_state_api_stays_the_default() {
    let c = parse(GOOD).unwrap();
    assert_eq!(c.state.tls, None);
    let inputs = inputs();
    assert!(!edge::render::envoy_yaml(&c, &inputs).contains("UpstreamTlsContext"));
    let env = edge::render::state_api_env(&c, "postgres://x@h/db", "t", "k");
    assert!(!env.iter().any(|(k, _)| k.starts_with("STATE_API_TLS")));
}

#[test]
fn state_tls_mistakes_are_refused_at_their_line() {
    let dir = tls_folder();
    let err = |tls: &str| match Config::parse(&with_state_tls(tls), "edge.toml", &dir) {
        Err(ConfigError::At { line, message, .. }) => (line, message),
        other => panic!("expected an error with a line, got {other:?}"),
    };
    // GOOD has 12 lines, then a blank one and [state.tls] (line 14).
    let base = "cert_file = \"state.pem\"\nkey_file = \"state-key.pem\"\nca_file = \"ca.pem\"\n";
    let (line, m) = err("cert_file = \"state.pem\"\nkey_file = \"state-key.pem\"\n");
    assert!(m.contains("needs ca_file"), "{line}: {m}");
    let (line, m) =
        err("cert_file = \"missing.pem\"\nkey_file = \"state-key.pem\"\nca_file = \"ca.pem\"\n");
    assert!(
        line == 15 && m.contains("state.tls.cert_file") && m.contains("cannot read"),
        "{line}: {m}"
    );
    let (line, m) =
        err("cert_file = \"state-key.pem\"\nkey_file = \"state-key.pem\"\nca_file = \"ca.pem\"\n");
    assert!(
        line == 15 && m.contains("no PEM certificate"),
        "{line}: {m}"
    );
    let (line, m) =
        err("cert_file = \"state.pem\"\nkey_file = \"state.pem\"\nca_file = \"ca.pem\"\n");
    assert!(
        line == 16 && m.contains("no PEM private key"),
        "{line}: {m}"
    );
    let (line, m) = err(&format!(
        "{base}client_cert_file = \"envoy.pem\"\nclient_ca_file = \"ca.pem\"\n"
    ));
    assert!(line == 18 && m.contains("go together"), "{line}: {m}");
    let (line, m) = err(&format!(
        "{base}client_cert_file = \"envoy.pem\"\nclient_key_file = \"envoy-key.pem\"\n"
    ));
    assert!(
        line == 18 && m.contains("would not check it"),
        "{line}: {m}"
    );
    let (line, m) = err(&format!("{base}client_ca_file = \"ca.pem\"\n"));
    assert!(
        line == 18 && m.contains("would refuse Envoy"),
        "{line}: {m}"
    );
    let (line, m) = err(&format!("{base}server_name = \"bad name\"\n"));
    assert!(line == 18 && m.contains("server_name"), "{line}: {m}");
    let (_, m) = err(&format!("{base}sni = \"x\"\n"));
    assert!(m.contains("unknown field"), "{m}");
}

#[test]
fn the_storage_keys_are_checked_and_given_to_the_state_api() {
    const KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const OLD: &str = "ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";
    let with = |state: &str| format!("{GOOD}\n[state]\n{state}\n");
    let c = parse(&with(&format!(
        "storage_key = \"{KEY}\"\nprevious_storage_key = \"{OLD}\""
    )))
    .unwrap();
    let env = edge::render::state_api_env(&c, "postgres://x", "filter-token-0123456", "s");
    assert!(env.contains(&(state_env::STATE_API_STORAGE_KEY.into(), KEY.into())));
    assert!(env.contains(&(state_env::STATE_API_PREVIOUS_STORAGE_KEY.into(), OLD.into())));
    // Not 32 bytes of base64, or the same key twice: refused at its line.
    let text = with("storage_key = \"c2hvcnQ=\"");
    let (line, message) = error(&text);
    assert_eq!(
        text.lines().nth(line - 1),
        Some("storage_key = \"c2hvcnQ=\"")
    );
    assert!(message.contains("32 bytes"), "{message}");
    let (_, message) = error(&with(&format!(
        "storage_key = \"{KEY}\"\nprevious_storage_key = \"{KEY}\""
    )));
    assert!(message.contains("same"), "{message}");
    // Without one, `edge run` makes one (the run folder's storage-key) and render asks for it.
    assert_eq!(parse(GOOD).unwrap().state.storage_key, None);
}

/// Envoy's duration (`310s`, `1.500s`) in milliseconds.
fn duration_ms(text: &str) -> u64 {
    let seconds: f64 = text.trim().trim_end_matches('s').parse().unwrap();
    (seconds * 1000.0).round() as u64
}

/// A connection manager timeout shorter than the route's answers for the upstream while it may
/// still execute (issue 34): the rendered `stream_idle_timeout` outlasts `upstream_timeout_ms`
/// plus the filter's own waits and a margin, and nothing sets a shorter stream timeout.
#[test]
fn no_connection_manager_timeout_is_shorter_than_the_route_timeout() {
    let inputs = inputs();
    for upstream_timeout_ms in [1_000, 60_000, 299_000, 600_000, 3_600_000] {
        let mut c = parse(GOOD).unwrap();
        c.upstream_timeout_ms = upstream_timeout_ms;
        let yaml = edge::render::envoy_yaml(&c, &inputs);
        let value = |name: &str| -> Vec<u64> {
            yaml.lines()
                .filter_map(|l| l.trim().strip_prefix(name))
                .map(duration_ms)
                .collect()
        };
        let idle = value("stream_idle_timeout:");
        assert_eq!(idle.len(), 1, "{yaml}");
        let filter_waits = c.routes[0].max_wait_s * 1000 + 2 * c.state.timeout_ms;
        assert!(
            idle[0] >= upstream_timeout_ms + filter_waits + edge::render::HCM_TIMEOUT_MARGIN_MS,
            "stream_idle_timeout {} ms for a route timeout of {upstream_timeout_ms} ms",
            idle[0]
        );
        assert!(idle[0] >= 300_000, "never shorter than Envoy's default");
        assert_eq!(value("timeout:"), [upstream_timeout_ms], "the route's own");
        assert!(
            value("max_stream_duration:").is_empty(),
            "left unset (none)"
        );
        // `request_timeout` is the client's time for its whole request: Envoy disarms it when
        // the last byte has come (measured: tests/tests/hostile_load.rs), before any claim.
        assert_eq!(
            value("request_timeout:"),
            [c.limits.request_body_timeout_ms]
        );
        assert_eq!(
            value("request_headers_timeout:"),
            [c.limits.request_headers_timeout_ms]
        );
    }
}

/// `[limits]` (issue 49): Envoy's overload manager with a heap bound from the memory budget,
/// its actions, the connection limits, the client timeouts, and the filter's buffering bound
/// from the budget unless `[filter]` sets one.
#[test]
fn limits_render_the_overload_manager_connection_limits_and_client_timeouts() {
    const MIB: i64 = 1 << 20;
    let inputs = inputs();
    let doc_of = |c: &edge::config::Config| {
        yaml_rust2::YamlLoader::load_from_str(&edge::render::envoy_yaml(c, &inputs))
            .unwrap()
            .remove(0)
    };
    let c = parse(GOOD).unwrap();
    assert_eq!(c.limits, edge::config::Limits::default());
    let doc = doc_of(&c);
    let om = &doc["overload_manager"];
    let monitors = om["resource_monitors"].as_vec().unwrap();
    assert_eq!(
        monitors[0]["typed_config"]["max_heap_size_bytes"].as_i64(),
        Some(48 * MIB + 80 * MIB),
        "the heap bound: Envoy at rest and the budget"
    );
    assert_eq!(
        monitors[1]["typed_config"]["max_active_downstream_connections"].as_i64(),
        Some(12_288)
    );
    let actions: Vec<&str> = om["actions"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        [
            "envoy.overload_actions.reduce_timeouts",
            "envoy.overload_actions.disable_http_keepalive",
            "envoy.overload_actions.stop_accepting_requests"
        ]
    );
    // Only idle connections' timer and that of answers their client does not read are ever
    // shortened, never a stream's idle timeout (its request may be waiting on the filter).
    let scaled: Vec<&str> = om["actions"][0]["typed_config"]["timer_scale_factors"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|t| t["timer"].as_str().unwrap())
        .collect();
    assert_eq!(
        scaled,
        [
            "HTTP_DOWNSTREAM_CONNECTION_IDLE",
            "HTTP_DOWNSTREAM_STREAM_FLUSH"
        ]
    );
    // No buffer accounting: its cost per replay failed the bench guard (docs/RELIABILITY.md).
    assert!(om["buffer_factory_config"].is_badvalue());
    let layers = doc["layered_runtime"]["layers"].as_vec().unwrap();
    assert_eq!(
        layers[0]["static_layer"]["envoy.resource_limits.listener.edge.connection_limit"].as_i64(),
        Some(12_288)
    );
    let hcm =
        &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(
        hcm["common_http_protocol_options"]["idle_timeout"].as_str(),
        Some("60s")
    );
    assert_eq!(hcm["request_headers_timeout"].as_str(), Some("10s"));
    assert_eq!(hcm["stream_flush_timeout"].as_str(), Some("60s"));
    // The filter holds half the budget's worth of bodies (one worker).
    let plugin: serde_json::Value =
        serde_json::from_str(&edge::render::filter_json(&c, "t")).unwrap();
    assert_eq!(plugin["max_buffered_bytes"], 40 * MIB);

    // Set: the budget, the connections, the timeouts; two workers share the bodies.
    let mut text = GOOD.to_owned();
    text += "\n[limits]\nmemory_budget_mib = 200\nmax_connections = 1000\nrequest_headers_timeout_ms = 3000\nrequest_body_timeout_ms = 20000\nidle_timeout_ms = 15000\nresponse_flush_timeout_ms = 7000\n";
    let mut c = parse(&text).unwrap();
    c.envoy_workers = 2;
    let plugin: serde_json::Value =
        serde_json::from_str(&edge::render::filter_json(&c, "t")).unwrap();
    assert_eq!(plugin["max_buffered_bytes"], 50 * MIB);
    let doc = doc_of(&c);
    assert_eq!(
        doc["overload_manager"]["resource_monitors"][0]["typed_config"]["max_heap_size_bytes"]
            .as_i64(),
        Some(48 * MIB + 200 * MIB)
    );
    let hcm =
        &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(hcm["request_headers_timeout"].as_str(), Some("3s"));
    assert_eq!(hcm["stream_flush_timeout"].as_str(), Some("7s"));
    assert_eq!(
        hcm["common_http_protocol_options"]["idle_timeout"].as_str(),
        Some("15s")
    );
    assert_eq!(
        doc["layered_runtime"]["layers"][0]["static_layer"]
            ["envoy.resource_limits.listener.edge.connection_limit"]
            .as_i64(),
        Some(1000)
    );
    // One new request a connection a turn of the loop (the HTTP/2 rapid reset's mitigation).
    assert_eq!(
        doc["layered_runtime"]["layers"][0]["static_layer"]["http.max_requests_per_io_cycle"]
            .as_i64(),
        Some(edge::render::REQUESTS_PER_IO_CYCLE as i64)
    );
    // A buffering bound set above the budget's share raises the heap bound with it.
    c.filter.max_buffered_bytes = Some(1 << 30);
    let doc = doc_of(&c);
    assert_eq!(
        doc["overload_manager"]["resource_monitors"][0]["typed_config"]["max_heap_size_bytes"]
            .as_i64(),
        Some(48 * MIB + (2 << 30) * 8 / 5 + 16 * MIB)
    );

    // Out of range: refused at its line.
    for (field, value) in [
        ("memory_budget_mib", "8"),
        ("max_connections", "0"),
        ("request_headers_timeout_ms", "10"),
        ("request_body_timeout_ms", "100"),
        ("idle_timeout_ms", "0"),
        ("response_flush_timeout_ms", "999"),
    ] {
        let text = format!("{GOOD}\n[limits]\n{field} = {value}\n");
        let (line, message) = error(&text);
        assert_eq!(line, text.lines().count(), "{message}");
        assert!(message.contains(&format!("limits.{field}")), "{message}");
    }
}

/// Past 16 routes of one method, jwt_authn gets one rule for them whose path is one RE2
/// pattern (its rules are tried in order on every request), and Envoy's runtime the room to
/// compile it; a method with fewer keeps a rule a route.
#[test]
fn many_routes_of_a_method_are_one_jwt_rule_with_one_pattern() {
    let mut text = GOOD.replace(
        "[[route]]\nmethod = \"POST\"\npath = \"/orders\"\nkey = \"required\"\n",
        "",
    );
    for i in 0..40 {
        let (kind, path) = if i % 2 == 0 {
            ("path", format!("/api/v1/orders-{i}/pay"))
        } else {
            ("prefix", format!("/api/v2/tenant.{i}+(x)/"))
        };
        text +=
            &format!("\n[[route]]\nmethod = \"POST\"\n{kind} = \"{path}\"\nkey = \"required\"\n");
    }
    text += "\n[[route]]\nmethod = \"PUT\"\npath = \"/carts\"\nkey = \"required\"\n";
    let c = parse(&text).unwrap();
    let inputs = inputs();
    let yaml = edge::render::envoy_yaml(&c, &inputs);
    let doc = &yaml_rust2::YamlLoader::load_from_str(&yaml).unwrap()[0];
    let filters = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"]
        .as_vec()
        .unwrap();
    let jwt = filters
        .iter()
        .find(|f| f["name"].as_str() == Some("envoy.filters.http.jwt_authn"))
        .unwrap();
    let rules = jwt["typed_config"]["rules"].as_vec().unwrap();
    assert_eq!(rules.len(), 2, "{rules:?}");
    assert_eq!(rules[0]["match"]["path"].as_str(), Some("/carts"));
    let pattern = rules[1]["match"]["safe_regex"]["regex"].as_str().unwrap();
    assert!(
        pattern.starts_with("(?s:/api/v1/orders\\-0/pay|")
            || pattern.starts_with("(?s:/api/v1/orders-0/pay|"),
        "{pattern}"
    );
    assert!(
        pattern.contains("|/api/v2/tenant\\.1\\+\\(x\\)/.*|"),
        "{pattern}"
    );
    assert_eq!(
        rules[1]["match"]["headers"][0]["string_match"]["exact"].as_str(),
        Some("POST")
    );
    let size = doc["layered_runtime"]["layers"][1]["static_layer"]
        ["re2.max_program_size.error_level"]
        .as_i64()
        .unwrap();
    assert!(size >= 4 * pattern.len() as i64, "{size}");
    // A few routes: a rule each, and no room for a pattern in the runtime.
    let few = parse(GOOD).unwrap();
    let yaml = edge::render::envoy_yaml(&few, &inputs);
    assert!(!yaml.contains("safe_regex") && !yaml.contains("re2.max_program_size"));
}

/// The state API's cluster allows far more requests at once than Envoy's default 1,024: each
/// waiting retry holds a claim callout for as long as it waits.
#[test]
fn the_state_api_cluster_is_not_bounded_by_envoys_default_circuit_breakers() {
    let c = parse(GOOD).unwrap();
    let inputs = inputs();
    let yaml = edge::render::envoy_yaml(&c, &inputs);
    let doc = &yaml_rust2::YamlLoader::load_from_str(&yaml).unwrap()[0];
    let clusters = doc["static_resources"]["clusters"].as_vec().unwrap();
    let state = clusters
        .iter()
        .find(|c| c["name"].as_str() == Some("state_api"))
        .unwrap();
    let thresholds = &state["circuit_breakers"]["thresholds"][0];
    for field in ["max_connections", "max_pending_requests", "max_requests"] {
        assert!(
            thresholds[field].as_i64().unwrap() >= 10 * 1024,
            "{field}: {thresholds:?}"
        );
    }
}

/// Claims that wait go to a cluster of their own over HTTP/2, in `edge run`'s Envoy and in
/// Envoy Gateway's bootstrap alike: a crowd of them is streams on a few connections, not a
/// connection each (over HTTP/1.1, 9,000 at once overflowed the state API's listen backlog).
/// Every other call stays on the HTTP/1.1 cluster, cheaper per call.
#[test]
fn waiting_claims_reach_the_state_api_over_http2_and_the_rest_over_http1() {
    let c = parse(GOOD).unwrap();
    let inputs = inputs();
    let edge_run = edge::render::envoy_yaml(&c, &inputs);
    let gateway = edge::mesh::gateway_bootstrap_clusters(&c);
    for (who, yaml) in [("edge run", &edge_run), ("gateway", &gateway)] {
        let doc = &yaml_rust2::YamlLoader::load_from_str(yaml).unwrap()[0];
        let clusters = doc["static_resources"]["clusters"].as_vec().unwrap();
        let named = |name: &str| {
            clusters
                .iter()
                .find(|c| c["name"].as_str() == Some(name))
                .unwrap_or_else(|| panic!("{who}: no cluster {name}"))
        };
        let http2 = |c: &yaml_rust2::Yaml| {
            !c["typed_extension_protocol_options"]
                ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
                ["http2_protocol_options"]
                .is_badvalue()
        };
        let (plain, wait) = (named("state_api"), named("state_api_wait"));
        assert!(!http2(plain) && http2(wait), "{who}: {plain:?} {wait:?}");
        // Fewer streams a connection than the state API allows (hyper's 200): past them Envoy
        // opens another connection instead of having its streams refused.
        let streams = wait["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
            ["http2_protocol_options"]["max_concurrent_streams"]
            .as_i64()
            .unwrap();
        assert!((1..200).contains(&streams), "{who}: {streams}");
        for c in [plain, wait] {
            assert!(
                c["circuit_breakers"]["thresholds"][0]["max_requests"]
                    .as_i64()
                    .unwrap()
                    >= 10 * 1024,
                "{who}: {c:?}"
            );
            // The same state API behind both.
            assert_eq!(
                c["load_assignment"]["endpoints"], plain["load_assignment"]["endpoints"],
                "{who}"
            );
        }
    }
    // The filter is told which is which.
    let plugin = edge::render::plugin_config(&c, &edge::render::Wiring::envoy(&c), "t");
    assert_eq!(plugin.state_api.cluster, "state_api");
    assert_eq!(
        plugin.state_api.wait_cluster.as_deref(),
        Some("state_api_wait")
    );
}

#[test]
fn envoy_reads_a_connection_32_kib_at_a_time_and_a_stream_buffers_the_largest_body() {
    let text = GOOD.replace(
        "key = \"required\"",
        "key = \"required\"\nmax_request_body_bytes = 3000000",
    );
    let c = parse(&text).unwrap();
    let yaml = edge::render::envoy_yaml(&c, &inputs());
    let doc = &yaml_rust2::YamlLoader::load_from_str(&yaml).unwrap()[0];
    let listener = &doc["static_resources"]["listeners"][0];
    // What a client connection pushes into Envoy is read this much at a time, also after its
    // request was answered (bench/NOTES.md, twentieth round: 533 MiB at 4 MiB, 92 at 32 KiB).
    assert_eq!(
        listener["per_connection_buffer_limit_bytes"].as_i64(),
        Some(edge::render::CONNECTION_READ_BYTES as i64)
    );
    // Connections opened by the thousand are accepted a few at a time, so that the worker
    // serves its open connections between (tests/tests/hostile_load.rs: the legitimate keys'
    // p99 during 10,000 idle connections went from 34-377 ms to 28-31 ms).
    assert_eq!(
        listener["max_connections_to_accept_per_socket_event"].as_i64(),
        Some(edge::render::ACCEPTS_PER_EVENT as i64)
    );
    let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    let h2 = &hcm["http2_protocol_options"];
    assert_eq!(
        (
            h2["max_concurrent_streams"].as_i64(),
            h2["initial_stream_window_size"].as_i64(),
            h2["initial_connection_window_size"].as_i64()
        ),
        (Some(100), Some(65_536), Some(1_048_576)),
        "a client's HTTP/2 connection bounded as Envoy's edge guidance says"
    );
    // Its flood limits written out, so that another Envoy's defaults do not loosen them.
    assert_eq!(
        (
            h2["max_outbound_frames"].as_i64(),
            h2["max_outbound_control_frames"].as_i64(),
            h2["max_consecutive_inbound_frames_with_empty_payload"].as_i64(),
            h2["max_inbound_priority_frames_per_stream"].as_i64(),
            h2["max_inbound_window_update_frames_per_data_frame_sent"].as_i64()
        ),
        (Some(10_000), Some(1_000), Some(1), Some(100), Some(10)),
        "a client's HTTP/2 flood limits"
    );
    let vhost = &listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
        ["virtual_hosts"][0];
    // The stream itself buffers a whole body (and a captured response) above the largest the
    // filter reads, so that the filter answers 413 before Envoy does.
    let stream_limit = vhost["request_body_buffer_limit"].as_i64().unwrap();
    assert!(stream_limit > 3_000_000, "{stream_limit}");
}

/// Issue 46, finding 3: the rendered route sends a request once, as the filter does with what it
/// forwards under a claim (`x-envoy-max-retries: 0`): no retry (`num_retries: 0`, which also
/// overrides a virtual host's policy), no hedge, no internal redirect, no mirror.
#[test]
fn the_rendered_route_never_retries_hedges_redirects_or_mirrors() {
    let c = parse(GOOD).unwrap();
    let yaml = edge::render::envoy_yaml(&c, &inputs());
    let doc = &yaml_rust2::YamlLoader::load_from_str(&yaml).unwrap()[0];
    let hcm =
        &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let vhosts = hcm["route_config"]["virtual_hosts"].as_vec().unwrap();
    for vhost in vhosts {
        for absent in ["retry_policy", "hedge_policy"] {
            assert!(vhost[absent].is_badvalue(), "{absent} on the virtual host");
        }
        for route in vhost["routes"].as_vec().unwrap() {
            let action = &route["route"];
            assert_eq!(action["retry_policy"]["num_retries"].as_i64(), Some(0));
            assert!(action["retry_policy"]["retry_on"].is_badvalue());
            for absent in [
                "hedge_policy",
                "internal_redirect_policy",
                "request_mirror_policies",
            ] {
                assert!(action[absent].is_badvalue(), "{absent} on {route:?}");
            }
        }
    }
}
