//! The plugin configuration's JSON Schema against the filter's own reader: the schema is the
//! committed one, every example and rendered configuration passes it, and every configuration
//! it refuses the filter refuses too, naming the same field.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use edge::config::Config;
use filter_core::config::{self as fc, json_schema};
use jsonschema::error::ValidationErrorKind;
use jsonschema::{ValidationError, Validator};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn validator() -> Validator {
    jsonschema::draft4::new(&json_schema()).expect("the generated schema compiles as draft 4")
}

/// `/routes/0/lease_ms` as the filter writes it: `routes[0].lease_ms`.
fn dotted(pointer: &str) -> String {
    let mut out = String::new();
    for segment in pointer.split('/').skip(1) {
        let segment = segment.replace("~1", "/").replace("~0", "~");
        if segment.parse::<usize>().is_ok() {
            out.push_str(&format!("[{segment}]"));
        } else {
            out = join(&out, &segment);
        }
    }
    out
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}.{name}")
    }
}

/// The fields a schema error names. A `oneOf` that no branch matched names what is wrong inside
/// the branch the document meant (the only one whose errors are all inside the value: a
/// `subject` with a bad `header` is about `subject.header`), else what every branch names (an
/// unknown member), else the value itself.
fn named_by_schema(e: &ValidationError<'_>) -> Vec<String> {
    let pointer = e.instance_path.to_string();
    let at = dotted(&pointer);
    match &e.kind {
        ValidationErrorKind::AdditionalProperties { unexpected } => {
            unexpected.iter().map(|n| join(&at, n)).collect()
        }
        ValidationErrorKind::Required { property } => {
            vec![join(&at, property.as_str().unwrap_or_default())]
        }
        ValidationErrorKind::OneOfNotValid { context } => {
            let inside = |b: &&Vec<ValidationError<'_>>| {
                b.iter().all(|e| {
                    e.instance_path
                        .to_string()
                        .starts_with(&format!("{pointer}/"))
                })
            };
            if let [meant] = context.iter().filter(inside).collect::<Vec<_>>().as_slice() {
                return meant.iter().flat_map(named_by_schema).collect();
            }
            let named: Vec<Vec<String>> = context
                .iter()
                .map(|branch| branch.iter().flat_map(named_by_schema).collect())
                .collect();
            let everywhere: Vec<String> = named
                .first()
                .into_iter()
                .flatten()
                .filter(|f| named.iter().all(|b| b.contains(f)))
                .cloned()
                .collect();
            if everywhere.is_empty() {
                vec![at]
            } else {
                everywhere
            }
        }
        _ => vec![at],
    }
}

/// The field a refusal of the filter names: `unknown field `x` in routes[1]` names
/// `routes[1].x`, `unknown variant `v` for routes[0].key` names `routes[0].key`, any other
/// message names the field it starts with.
fn named_by_filter(error: &fc::ConfigError) -> String {
    let m = error.0.as_str();
    for lead in ["unknown field `", "missing field `"] {
        if let Some(rest) = m.strip_prefix(lead) {
            let (name, rest) = rest.split_once('`').unwrap_or((rest, ""));
            let within = rest
                .strip_prefix(" in ")
                .map_or("", |w| w.split(',').next().unwrap_or_default());
            return join(within, name);
        }
    }
    if let Some(rest) = m.strip_prefix("unknown variant `") {
        let path = rest.split_once(" for ").map_or("", |(_, p)| p);
        return path.split(',').next().unwrap_or_default().to_owned();
    }
    if m.starts_with("the document ") {
        return String::new();
    }
    m.split(' ')
        .next()
        .unwrap_or_default()
        .trim_end_matches(':')
        .to_owned()
}

/// A refusal of the document's syntax (a number with a fraction) names a place, `at line L
/// column C`: the member whose value is there, by its name (the text is one line).
fn named_by_place(error: &fc::ConfigError, text: &str) -> Option<String> {
    let column: usize = error.0.rsplit_once(" column ")?.1.parse().ok()?;
    let before = text.get(..column.checked_sub(1)?)?;
    let start = before.rfind("\":")?;
    let name_start = before[..start].rfind('"')? + 1;
    Some(before[name_start..start].to_owned())
}

/// What the schema says of `doc`: `None` when it passes, else the fields its errors name.
fn schema_refusal(v: &Validator, doc: &Value) -> Option<Vec<String>> {
    let named: Vec<String> = v
        .iter_errors(doc)
        .flat_map(|e| named_by_schema(&e))
        .collect();
    (!named.is_empty()).then_some(named)
}

fn render(toml: &str) -> Value {
    let dir = std::env::temp_dir();
    let cfg = Config::parse(toml, "test.toml", &dir).unwrap();
    serde_json::from_str(&edge::render::filter_json(&cfg, "t0ken-t0ken-t0ken")).unwrap()
}

/// A configuration with every kind of field set: the base the bad ones are made from.
const RICH: &str = r#"
listen = "127.0.0.1:10000"
upstream = "http://127.0.0.1:3000"
namespace = "shop-eu"
[state]
timeout_ms = 700
[subject]
header = "x-user"
[filter]
replay_extra_headers = ["x-charge-id"]
complete_in_background = true
batch_max = 8
max_waiters = 5
in_flight_cache_ms = 300
[[route]]
method = "POST"
path = "/orders"
key = "required"
lease_ms = 4000
heartbeat_ms = 1000
max_request_body_bytes = 2048
retention_s = 3600
max_wait_s = 3
on_5xx = "release"
on_state_unavailable = "fail_open"
on_unknown = "reconcile"
reconcile = { path = "/attempts/{key}", upstream = "http://127.0.0.1:3001", timeout_ms = 500 }
fingerprint = { include = ["/amount", "/currency"] }
key_from = "/idempotency_key"
[[route]]
method = "PUT"
prefix = "/refunds/"
key = "optional"
on_unknown = "reexecute"
fingerprint = { ignore = ["/sent_at"] }
"#;

/// The same with the subject from jwt_authn's metadata, as a mesh renders it.
fn bases() -> Vec<Value> {
    let rich = render(RICH);
    let mut metadata = rich.clone();
    metadata["subject"] = json!({"metadata": ["envoy.filters.http.jwt_authn", "payload", "sub"]});
    vec![rich, metadata]
}

#[test]
fn the_committed_schema_is_the_generated_one() {
    let path = root().join("docs/plugin-config.schema.json");
    let committed = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        committed.trim_end(),
        edge::render::plugin_schema_text(),
        "{} is not what the types generate: run `make schema` and commit it",
        path.display()
    );
}

#[test]
fn the_schema_is_a_valid_draft_4_schema_with_defaults_the_reader_uses() {
    let schema = json_schema();
    assert_eq!(schema["$schema"], "http://json-schema.org/draft-04/schema#");
    jsonschema::draft4::meta::validate(&schema).unwrap();
    // Each `default` in the schema is what the reader takes when the field is left out.
    let smallest = json!({
        "state_api": {"cluster": "c", "authority": "a", "token": "t"},
        "subject": {"header": "x-jwt-sub"},
        "routes": [{"method": "POST", "path": "/p", "key": "required",
                    "on_unknown": "reconcile",
                    "reconcile": {"cluster": "c", "authority": "a", "path": "/r/{key}"}}],
    });
    let read = fc::Config::parse(smallest.to_string().as_bytes()).unwrap();
    let read = serde_json::to_value(&read).unwrap();
    let objects = [
        ("", &schema),
        ("/state_api", &schema["definitions"]["StateApi"]),
        ("/routes/0", &schema["definitions"]["Route"]),
        ("/routes/0/reconcile", &schema["definitions"]["Reconcile"]),
    ];
    let mut defaults = 0;
    for (pointer, object) in objects {
        let (given, value) = (
            &smallest.pointer(pointer).unwrap(),
            &read.pointer(pointer).unwrap(),
        );
        for (name, property) in object["properties"].as_object().unwrap() {
            if let Some(default) = property
                .get("default")
                .filter(|_| given.get(name).is_none())
            {
                assert_eq!(&value[name], default, "the default of {name}");
                defaults += 1;
            }
        }
    }
    assert!(defaults >= 20, "only {defaults} defaults in the schema");
}

#[test]
fn every_example_and_rendered_configuration_passes_the_schema() {
    let v = validator();
    let mut checked = Vec::new();
    for file in ["examples/demo.toml", "examples/own-api.toml"] {
        let cfg = Config::load(&root().join(file)).unwrap();
        checked.push((
            file.to_owned(),
            edge::render::filter_json(&cfg, "t0ken-t0ken-t0ken"),
        ));
    }
    checked.extend(
        bases()
            .into_iter()
            .map(|b| ("a rendered configuration".to_owned(), b.to_string())),
    );
    // The example in docs/filter.md's *Configuration*.
    let doc = std::fs::read_to_string(root().join("docs/filter.md")).unwrap();
    let example = doc
        .split("## Configuration\n\n```json\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .unwrap();
    checked.push(("docs/filter.md".to_owned(), example.to_owned()));
    for (what, json) in checked {
        let doc: Value = serde_json::from_str(&json).unwrap();
        let errors: Vec<String> = v.iter_errors(&doc).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{what}: {errors:?}");
        fc::Config::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

/// Refused by the schema: then refused by the filter, naming one of the fields the schema
/// names. Returns whether the schema refused it.
fn refused_alike(v: &Validator, doc: &Value, what: &str) -> bool {
    let Some(fields) = schema_refusal(v, doc) else {
        return false;
    };
    match fc::Config::parse(doc.to_string().as_bytes()) {
        Ok(_) => panic!("{what}: the schema refuses it ({fields:?}), the filter takes it"),
        Err(e) if e.0.contains(" at line 1 column ") => {
            let named = named_by_place(&e, &doc.to_string());
            let last = |f: &String| f.rsplit(['.', ']']).next().map(str::to_owned);
            assert!(
                named.is_some() && fields.iter().any(|f| last(f) == named),
                "{what}: the schema names {fields:?}, the filter the place of {named:?}: {e}"
            );
        }
        Err(e) => {
            let named = named_by_filter(&e);
            assert!(
                fields.contains(&named),
                "{what}: the schema names {fields:?}, the filter {named:?}: {e}"
            );
        }
    }
    true
}

/// `doc` with the value at `pointer` replaced, or added to its object.
fn set(doc: &Value, pointer: &str, value: Value) -> Value {
    let mut doc = doc.clone();
    if let Some(there) = doc.pointer_mut(pointer) {
        *there = value;
        return doc;
    }
    let (parent, name) = pointer.rsplit_once('/').unwrap();
    doc.pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .unwrap()
        .insert(name.to_owned(), value);
    doc
}

fn remove(doc: &Value, pointer: &str) -> Value {
    let mut doc = doc.clone();
    let (parent, name) = pointer.rsplit_once('/').unwrap();
    doc.pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .unwrap()
        .remove(name);
    doc
}

#[test]
fn bad_configurations_are_refused_alike_and_the_same_field_named() {
    let v = validator();
    let base = &bases()[0];
    let table: Vec<(&str, Value)> = vec![
        ("an unknown top-level field", set(base, "/lease", json!(5))),
        (
            "an unknown route field",
            set(base, "/routes/0/methods", json!("GET")),
        ),
        ("no routes", remove(base, "/routes")),
        ("empty routes", set(base, "/routes", json!([]))),
        ("a lease too short", set(base, "/lease_ms", json!(999))),
        ("a lease too long", set(base, "/lease_ms", json!(600_001))),
        (
            "a route's lease too short",
            set(base, "/routes/0/lease_ms", json!(0)),
        ),
        ("no heartbeat", set(base, "/heartbeat_ms", json!(0))),
        (
            "a string for a number",
            set(base, "/lease_ms", json!("30000")),
        ),
        ("a fraction", set(base, "/replay_cache_bytes", json!(1.5))),
        (
            "a negative number",
            set(base, "/complete_retry_ms", json!(-1)),
        ),
        ("null", set(base, "/max_waiters", Value::Null)),
        (
            "a null route option",
            set(base, "/routes/1/lease_ms", Value::Null),
        ),
        ("too many waiters", set(base, "/max_waiters", json!(10_001))),
        ("batch_max 0", set(base, "/batch_max", json!(0))),
        ("batch_max too large", set(base, "/batch_max", json!(129))),
        (
            "a stored body too large",
            set(base, "/max_stored_body_bytes", json!(16_777_217)),
        ),
        (
            "no request body",
            set(base, "/max_request_body_bytes", json!(0)),
        ),
        (
            "in-flight answers too long",
            set(base, "/in_flight_cache_ms", json!(10_001)),
        ),
        (
            "a namespace in capitals",
            set(base, "/namespace", json!("Shop EU")),
        ),
        (
            "a header name with a space",
            set(base, "/replay_extra_headers", json!(["x y"])),
        ),
        (
            "an empty cluster",
            set(base, "/state_api/cluster", json!("")),
        ),
        (
            "an authority with a space",
            set(base, "/state_api/authority", json!("a b")),
        ),
        (
            "a token with a control character",
            set(base, "/state_api/token", json!("t\u{1}")),
        ),
        ("no timeout", set(base, "/state_api/timeout_ms", json!(0))),
        (
            "a timeout over 32 bits",
            set(base, "/state_api/timeout_ms", json!(4_294_967_296u64)),
        ),
        ("no token", remove(base, "/state_api/token")),
        (
            "a subject header with a space",
            set(base, "/subject", json!({"header": "x y"})),
        ),
        (
            "two subjects",
            set(
                base,
                "/subject",
                json!({"header": "a", "metadata": ["a", "b"]}),
            ),
        ),
        ("no subject", set(base, "/subject", json!({}))),
        (
            "one metadata part",
            set(base, "/subject", json!({"metadata": ["a"]})),
        ),
        (
            "an empty metadata part",
            set(base, "/subject", json!({"metadata": ["a", ""]})),
        ),
        (
            "a method with a space",
            set(base, "/routes/0/method", json!("PO ST")),
        ),
        (
            "a path without /",
            set(base, "/routes/0/path", json!("orders")),
        ),
        (
            "a prefix with a query",
            set(base, "/routes/1/prefix", json!("/r?x")),
        ),
        (
            "path and prefix",
            set(base, "/routes/0/prefix", json!("/o")),
        ),
        ("neither path nor prefix", remove(base, "/routes/1/prefix")),
        (
            "an unknown key policy",
            set(base, "/routes/0/key", json!("sometimes")),
        ),
        (
            "an unknown 5xx policy",
            set(base, "/routes/1/on_5xx", json!("retry")),
        ),
        ("no key policy", remove(base, "/routes/0/key")),
        ("retention 0", set(base, "/routes/0/retention_s", json!(0))),
        (
            "a wait too long",
            set(base, "/routes/0/max_wait_s", json!(61)),
        ),
        (
            "a reconcile path without {key}",
            set(base, "/routes/0/reconcile/path", json!("/a")),
        ),
        (
            "a reconcile without cluster",
            set(base, "/routes/0/reconcile/cluster", json!("")),
        ),
        (
            "an unknown reconcile field",
            set(base, "/routes/0/reconcile/url", json!("/x")),
        ),
        (
            "no reconcile timeout",
            set(base, "/routes/0/reconcile/timeout_ms", json!(0)),
        ),
        (
            "an empty fingerprint list",
            set(base, "/routes/1/fingerprint", json!({"ignore": []})),
        ),
        (
            "two fingerprint lists",
            set(
                base,
                "/routes/1/fingerprint",
                json!({"ignore": ["/a"], "include": ["/b"]}),
            ),
        ),
        (
            "an unknown fingerprint list",
            set(base, "/routes/1/fingerprint", json!({"only": ["/a"]})),
        ),
        (
            "a pointer without /",
            set(base, "/routes/1/fingerprint/ignore/0", json!("meta")),
        ),
        (
            "a bad escape in a pointer",
            set(base, "/routes/0/key_from", json!("/a~2")),
        ),
        (
            "a key pointer without /",
            set(base, "/routes/0/key_from", json!("idempotency_key")),
        ),
        ("the document an array", json!([])),
    ];
    for (what, doc) in &table {
        assert!(refused_alike(&v, doc, what), "{what}: the schema takes it");
    }
}

/// Every field of the base configurations given wrong values of every kind, and every object
/// an unknown member or a member less: whatever the schema refuses, the filter refuses alike.
#[test]
fn whatever_the_schema_refuses_the_filter_refuses_naming_the_same_field() {
    let v = validator();
    let numbers = [
        json!(-1),
        json!(0),
        json!(1.5),
        json!(61),
        json!(129),
        json!(999),
        json!(10_001),
        json!(300_001),
        json!(600_001),
        json!(16_777_217),
        json!(4_294_967_296u64),
        json!("5"),
    ];
    let strings = [
        json!(""),
        json!(" "),
        json!("a b"),
        json!("x"),
        json!("UP"),
        json!("t\u{1}"),
        json!("/a?b"),
        json!("/a~2"),
        json!(5),
        json!(["/a"]),
    ];
    let (mut tried, mut refused, mut only_by_the_filter) = (0, 0, 0);
    for base in bases() {
        let mut leaves = Vec::new();
        walk(&base, String::new(), &mut leaves);
        for (pointer, value) in leaves {
            let mut candidates: Vec<Value> = match &value {
                Value::Number(_) => numbers.to_vec(),
                Value::String(_) => strings.to_vec(),
                Value::Bool(_) => vec![json!("yes"), json!(1)],
                Value::Array(_) => vec![json!([]), json!({}), json!([5]), json!([""])],
                Value::Object(map) => {
                    let mut c = vec![json!([]), json!("x")];
                    let mut bogus = map.clone();
                    bogus.insert("bogus".into(), json!(1));
                    c.push(Value::Object(bogus));
                    for name in map.keys() {
                        let mut less = map.clone();
                        less.remove(name);
                        c.push(Value::Object(less));
                    }
                    c
                }
                Value::Null => Vec::new(),
            };
            candidates.push(Value::Null);
            for candidate in candidates {
                let doc = if pointer.is_empty() {
                    candidate.clone()
                } else {
                    set(&base, &pointer, candidate.clone())
                };
                tried += 1;
                if refused_alike(&v, &doc, &format!("{pointer} = {candidate}")) {
                    refused += 1;
                } else if fc::Config::parse(doc.to_string().as_bytes()).is_err() {
                    // What the schema cannot say: a heartbeat within the lease, a
                    // reconcile endpoint exactly with `on_unknown: reconcile`, ...
                    only_by_the_filter += 1;
                }
            }
        }
    }
    println!(
        "{tried} configurations tried, {refused} refused by the schema and the filter alike, \
         {only_by_the_filter} by the filter only"
    );
    assert!(refused > 300, "only {refused} of {tried} refused");
}

/// Every value in `v` with its JSON pointer, `v` itself first.
fn walk(v: &Value, pointer: String, out: &mut Vec<(String, Value)>) {
    out.push((pointer.clone(), v.clone()));
    match v {
        Value::Object(map) => {
            for (name, member) in map {
                walk(member, format!("{pointer}/{name}"), out);
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                walk(item, format!("{pointer}/{i}"), out);
            }
        }
        _ => {}
    }
}
