//! Tests of the JSON reader: the deterministic ones natively and in wasm, the property tests
//! natively.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use super::*;
use std::borrow::Cow;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn int(n: i64) -> Value {
    Value::Int {
        negative: n < 0,
        magnitude: n.unsigned_abs(),
    }
}

#[test]
fn reads_every_kind_of_value() {
    let v = parse(
        br#" { "a" : [1, -2, 0, 18446744073709551615, true, false, null, "x"], "b": {}, "c": [] } "#,
    )
    .unwrap();
    assert_eq!(
        v,
        Value::Object(vec![
            (
                "a".into(),
                Value::Array(vec![
                    int(1),
                    int(-2),
                    int(0),
                    Value::Int {
                        negative: false,
                        magnitude: u64::MAX
                    },
                    Value::Bool(true),
                    Value::Bool(false),
                    Value::Null,
                    Value::Str("x".into()),
                ])
            ),
            ("b".into(), Value::Object(vec![])),
            ("c".into(), Value::Array(vec![])),
        ])
    );
    assert_eq!(int(-9_223_372_036_854_775_807 - 1).as_i64(), Some(i64::MIN));
    assert_eq!(int(-1).as_u64(), None);
    assert_eq!(parse(b"-0").unwrap().as_u64(), Some(0));
}

#[test]
fn strings_unescape_like_json() {
    let v = parse(r#""a\"b\\c\/d\b\f\n\r\t\u00e9\u20ac\ud83d\ude00 \u0000 é""#.as_bytes()).unwrap();
    assert_eq!(
        v.as_str(),
        Some("a\"b\\c/d\u{8}\u{c}\n\r\t\u{e9}\u{20ac}\u{1F600} \u{0} é")
    );
}

#[test]
fn refuses_what_is_not_json_or_not_for_us() {
    for (bad, needle) in [
        (&b""[..], "unexpected end"),
        (b"{", "member name"),
        (b"{\"a\" 1}", "`:`"),
        (b"{\"a\":1,}", "member name"),
        (b"[1,]", "expected a value"),
        (b"[1 2]", "`,` or `]`"),
        (b"1.5", "integer"),
        (b"1e3", "integer"),
        (b"01", "invalid number"),
        (b"-", "invalid number"),
        (b"18446744073709551616", "out of range"),
        (b"\"a", "unterminated"),
        (b"\"a\nb\"", "control character"),
        (b"\"\\x\"", "invalid escape"),
        (b"\"\\ud800\"", "lone surrogate"),
        (b"\"\\udc00\"", "lone surrogate"),
        (b"\"\\u12\"", "\\u escape"),
        (b"tru", "expected a value"),
        (b"{} {}", "trailing"),
        (b"\"\xff\"", "UTF-8"),
    ] {
        let e = parse(bad).unwrap_err().to_string();
        assert!(
            e.contains(needle),
            "{:?}: {e}",
            String::from_utf8_lossy(bad)
        );
    }
    let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
    assert_eq!(parse(deep.as_bytes()).unwrap_err().kind, ErrorKind::TooDeep);
    let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
    assert!(parse(ok.as_bytes()).is_ok());
    // Never a stack overflow, whatever the depth.
    assert!(parse("[".repeat(100_000).as_bytes()).is_err());
}

#[test]
fn errors_say_where() {
    let e = parse(b"{\n  \"a\": 1,\n  \"b\": x\n}").unwrap_err();
    assert_eq!((e.line, e.column, e.offset), (3, 8, 19));
    assert!(e.to_string().ends_with("at line 3 column 8"), "{e}");
}

#[test]
fn fields_name_what_is_wrong() {
    let v =
        parse(br#"{"n": 5, "s": "x", "b": true, "l": ["a"], "z": null, "neg": -3, "e": "two"}"#)
            .unwrap();
    let f = Fields::of(&v, "thing").unwrap();
    assert_eq!(f.u64("n"), Ok(5));
    assert_eq!(f.u64_or("zz", 7), Ok(7));
    assert_eq!(f.opt_u64("z"), Ok(None), "null is absent");
    assert_eq!(f.i64("neg"), Ok(-3));
    assert_eq!(f.str("s"), Ok("x"));
    assert_eq!(f.bool("b"), Ok(true));
    assert_eq!(f.bool_or("b", false), Ok(true));
    assert_eq!(f.bool_or("z", true), Ok(true), "null is absent");
    assert!(f
        .bool_or("s", false)
        .is_err_and(|e| e.contains("a boolean")));
    assert!(f.bool("zz").is_err());
    assert_eq!(f.strings("l"), Ok(vec!["a".to_owned()]));
    assert_eq!(f.strings("none"), Ok(vec![]));
    assert_eq!(
        f.u64("s").unwrap_err(),
        "thing.s must be a non-negative integer, not a string"
    );
    assert_eq!(
        f.u64("neg").unwrap_err(),
        "thing.neg must be a non-negative integer, not an integer"
    );
    assert_eq!(
        f.str("missing").unwrap_err(),
        "missing field `missing` in thing"
    );
    assert_eq!(f.variant("e", &[("one", 1), ("two", 2)], None), Ok(2));
    assert_eq!(f.variant("nope", &[("one", 1)], Some(9)), Ok(9));
    assert_eq!(
        f.variant("s", &[("one", 1), ("two", 2)], None).unwrap_err(),
        "unknown variant `x` for thing.s, expected one of `one`, `two`"
    );
    assert!(f
        .deny_unknown(&["n", "s", "b", "l", "z", "neg", "e"])
        .is_ok());
    assert_eq!(
        f.deny_unknown(&["n", "s"]).unwrap_err(),
        "unknown field `b` in thing, expected one of `n`, `s`"
    );
    let dup = parse(br#"{"a": 1, "a": 2}"#).unwrap();
    assert_eq!(
        Fields::of(&dup, "x").unwrap_err(),
        "duplicate field `a` in x"
    );
    assert_eq!(
        Fields::of(&int(1), "x").unwrap_err(),
        "x must be an object, not an integer"
    );
    // The top level has no name.
    let top = Fields::of(&v, "").unwrap();
    assert_eq!(
        top.u64("s").unwrap_err(),
        "s must be a non-negative integer, not a string"
    );
    assert_eq!(top.str("missing").unwrap_err(), "missing field `missing`");
    assert_eq!(
        top.deny_unknown(&["n"]).unwrap_err(),
        "unknown field `s`, expected one of `n`"
    );
}

fn events(doc: &str) -> Result<Vec<Event<'_>>, Error> {
    let mut p = Parser::new(doc.as_bytes(), 4)?;
    let mut out = Vec::new();
    while let Some(e) = p.next()? {
        out.push(e);
    }
    Ok(out)
}

#[test]
fn events_come_in_document_order() {
    use Event::*;
    assert_eq!(
        events(r#" {"a": [1, "x\n", true], "b": {}, "c": null} "#).unwrap(),
        vec![
            ObjectStart,
            Name("a".into()),
            ArrayStart,
            Number("1"),
            Str("x\n".into()),
            Bool(true),
            ArrayEnd,
            Name("b".into()),
            ObjectStart,
            ObjectEnd,
            Name("c".into()),
            Null,
            ObjectEnd,
        ]
    );
    // Numbers keep their text; strings without escapes borrow from the input.
    assert_eq!(events("-0.50e+3").unwrap(), vec![Number("-0.50e+3")]);
    assert!(matches!(
        events(r#""plain""#).unwrap().as_slice(),
        [Str(Cow::Borrowed("plain"))]
    ));
    // The depth limit counts open containers.
    assert!(events("[[[[]]]]").is_ok());
    assert_eq!(events("[[[[[]]]]]").unwrap_err().kind, ErrorKind::TooDeep);
    // A duplicate name is the reader's business, not the parser's.
    assert_eq!(events(r#"{"a":1,"a":2}"#).unwrap().len(), 6);
    assert_eq!(
        events(r#"{"a":1 "b":2}"#).unwrap_err().kind,
        ErrorKind::ExpectedCommaOrBrace
    );
}

#[cfg(not(target_arch = "wasm32"))]
mod props {
    use super::*;
    use proptest::prelude::*;

    fn to_serde(v: &Value) -> serde_json::Value {
        match v {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => (*b).into(),
            Value::Int {
                negative: false,
                magnitude,
            } => (*magnitude).into(),
            Value::Int { .. } => v.as_i64().map_or(serde_json::Value::Null, Into::into),
            Value::Str(s) => s.clone().into(),
            Value::Array(items) => items.iter().map(to_serde).collect(),
            Value::Object(members) => members
                .iter()
                .map(|(k, v)| (k.clone(), to_serde(v)))
                .collect::<serde_json::Map<_, _>>()
                .into(),
        }
    }

    fn json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(Into::into),
            any::<i64>().prop_map(Into::into),
            any::<u64>().prop_map(Into::into),
            "\\PC{0,20}".prop_map(Into::into),
            any::<String>().prop_map(Into::into),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(Into::into),
                prop::collection::btree_map("\\PC{0,8}", inner, 0..8)
                    .prop_map(|m| m.into_iter().collect::<serde_json::Map<_, _>>().into()),
            ]
        })
    }

    proptest! {
        #[test]
        fn reads_what_serde_json_writes(v in json(), pretty in any::<bool>()) {
            let text = if pretty {
                serde_json::to_string_pretty(&v).unwrap()
            } else {
                serde_json::to_string(&v).unwrap()
            };
            prop_assert_eq!(to_serde(&parse(text.as_bytes()).unwrap()), v);
        }

        #[test]
        fn never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn agrees_with_serde_json_on_documents_without_floats(s in "[\\[\\]{}\":,0-9a-z \\\\-]{0,24}") {
            // serde_json reads integers beyond 64 bits as floats; this reader refuses them.
            let floats = |b: &serde_json::Value| b.to_string().contains(['.', 'e']);
            match (parse(s.as_bytes()), serde_json::from_str::<serde_json::Value>(&s)) {
                (Ok(a), Ok(b)) if !floats(&b) => prop_assert_eq!(to_serde(&a), b),
                (Ok(_), Ok(_)) | (Err(_), Err(_)) => {}
                (Err(e), Ok(b)) => prop_assert!(floats(&b), "{s:?}: ours {e}, serde_json {b}"),
                (Ok(a), Err(e)) => prop_assert!(false, "{s:?}: ours {a:?}, serde_json {e}"),
            }
        }
    }
}
