//! Tests of the canonical fingerprint. The deterministic tests run natively (`cargo test`) and in
//! wasm (`--target wasm32-unknown-unknown` with wasm-bindgen-test-runner); the property tests
//! run natively.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use std::cmp::Ordering;

#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn canon(s: &str) -> String {
    String::from_utf8(canonicalize(s.as_bytes()).unwrap()).unwrap()
}

fn fp_json(body: &str) -> Fingerprint {
    fingerprint(
        "POST",
        "/checkout",
        "",
        Some("application/json"),
        body.as_bytes(),
    )
    .unwrap()
}

#[test]
fn rfc8785_section_3_2_2_example() {
    // The RFC's example, with its first number written as the shortest form of its double
    // (333333333.33333329 in the RFC; see `exact_decimals_are_kept` for why that differs here).
    let input = "{\n  \"numbers\": [333333333.3333333, 1E30, 4.50,\n              2e-3, 0.000000000000000000000000001],\n  \"string\": \"\\u20ac$\\u000F\\u000aA'\\u0042\\u0022\\u005c\\\\\\\"\\/\",\n  \"literals\": [null, true, false]\n}";
    let expected = "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"\u{20ac}$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";
    assert_eq!(canon(input), expected);
}

#[test]
fn rfc8785_section_3_2_3_sorting() {
    let input = r#"{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "1": "One",
  "\ud83d\ude00": "Emoji: Grinning Face",
  "\u0080": "Control",
  "\u00f6": "Latin Small Letter O With Diaeresis"
}"#;
    let expected = "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\"\u{1f600}\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}";
    assert_eq!(canon(input), expected);
}

/// RFC 8785 Appendix B: IEEE-754 bit patterns and their JCS text. The shortest decimal of
/// each double (Rust's `{:e}`) must canonicalize to exactly the RFC's text.
#[test]
fn rfc8785_appendix_b_numbers() {
    let cases: &[(u64, &str)] = &[
        (0x0000000000000000, "0"),
        (0x8000000000000000, "0"),
        (0x0000000000000001, "5e-324"),
        (0x8000000000000001, "-5e-324"),
        (0x7fefffffffffffff, "1.7976931348623157e+308"),
        (0xffefffffffffffff, "-1.7976931348623157e+308"),
        (0x4340000000000000, "9007199254740992"),
        (0xc340000000000000, "-9007199254740992"),
        (0x4430000000000000, "295147905179352830000"),
        (0x44b52d02c7e14af5, "9.999999999999997e+22"),
        (0x44b52d02c7e14af6, "1e+23"),
        (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
        (0x444b1ae4d6e2ef4e, "999999999999999700000"),
        (0x444b1ae4d6e2ef4f, "999999999999999900000"),
        (0x444b1ae4d6e2ef50, "1e+21"),
        (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
        (0x3eb0c6f7a0b5ed8d, "0.000001"),
        (0x41b3de4355555553, "333333333.3333332"),
        (0x41b3de4355555554, "333333333.33333325"),
        (0x41b3de4355555555, "333333333.3333333"),
        (0x41b3de4355555556, "333333333.3333334"),
        (0x41b3de4355555557, "333333333.33333343"),
        (0xbecbf647612f3696, "-0.0000033333333333333333"),
        (0x43143ff3c1cb0959, "1424953923781206.2"),
    ];
    for &(bits, expected) in cases {
        let v = f64::from_bits(bits);
        let mut forms = vec![expected.to_owned(), expected.replace('e', "E")];
        // Rust prints the shortest digits too, but where two 17-digit decimals round-trip it
        // may pick the other one than ECMAScript (1424953923781206.3 vs .2): a different
        // decimal, so a different canonical form here (documented deviation from JCS).
        if bits != 0x43143ff3c1cb0959 {
            forms.extend([format!("{v:e}"), format!("{v:E}"), format!("{v}")]);
        }
        for written in forms {
            assert_eq!(
                canon(&written),
                expected,
                "{bits:016x} written as {written}"
            );
        }
    }
}

#[test]
fn equal_numbers_written_differently_are_equal() {
    for n in [
        "1", "1.0", "1e0", "1E+0", "10e-1", "0.1e1", "1.000", "100e-2",
    ] {
        assert_eq!(canon(n), "1", "{n}");
    }
    assert_eq!(canon("-0"), "0");
    assert_eq!(canon("0.0e10"), "0");
    assert_eq!(canon("1e21"), "1e+21");
    assert_eq!(canon("123e18"), "123000000000000000000");
    assert_eq!(canon("0.0000001"), "1e-7");
    assert_eq!(fp_json(r#"{"amount":1}"#), fp_json(r#"{"amount":1.0}"#));
    assert_eq!(fp_json(r#"{"amount":1}"#), fp_json(r#"{"amount":1e0}"#));
}

#[test]
fn exact_decimals_are_kept() {
    // Both round to the same double; a payment amount must never be silently rounded.
    assert_eq!(canon("9007199254740993"), "9007199254740993");
    assert_ne!(
        fp_json(r#"{"amount":9007199254740993}"#),
        fp_json(r#"{"amount":9007199254740992}"#)
    );
    assert_ne!(fp_json("0.30000000000000004"), fp_json("0.3"));
    assert_eq!(canon("333333333.33333329"), "333333333.33333329");
    assert_eq!(
        canon("123456789012345678901234567890"),
        "1.2345678901234567890123456789e+29"
    );
}

#[test]
fn whitespace_and_member_order_do_not_matter_at_any_depth() {
    let a = fp_json(r#"{"a":1,"b":{"x":[1,{"p":true,"q":null}],"y":"z"}}"#);
    let b = fp_json("{ \"b\" : { \"y\" : \"z\" ,\n\t\"x\" : [ 1 , { \"q\" : null , \"p\" : true } ] } , \"a\" : 1 }\r\n");
    assert_eq!(a, b);
    assert_eq!(a.alg, ALG_JCS);
    assert_eq!(a.hex.len(), 64);
}

#[test]
fn the_seed_bug_is_gone_nested_values_and_names_count() {
    // The seed's JSON.stringify(body, Object.keys(body).sort()) dropped nested members whose
    // names are not top-level names: these pairs all hashed the same there.
    assert_ne!(
        fp_json(r#"{"card":{"number":"4111"}}"#),
        fp_json(r#"{"card":{"number":"4242"}}"#)
    );
    assert_ne!(
        fp_json(r#"{"card":{"number":"4111"}}"#),
        fp_json(r#"{"card":{"numbr":"4111"}}"#)
    );
    assert_ne!(
        fp_json(r#"{"items":[{"sku":"a","qty":1}]}"#),
        fp_json(r#"{"items":[{"sku":"a","qty":2}]}"#)
    );
    assert_ne!(fp_json(r#"[1,2]"#), fp_json(r#"[2,1]"#));
}

#[test]
fn duplicate_members_are_refused_at_any_depth() {
    assert_eq!(
        fingerprint(
            "POST",
            "/p",
            "",
            Some("application/json"),
            br#"{"a":1,"a":2}"#
        ),
        Err(FingerprintError::DuplicateMember("a".into()))
    );
    assert_eq!(
        canonicalize(br#"{"x":[{"b":1,"c":2,"b":1}]}"#),
        Err(CanonError::DuplicateMember("b".into()))
    );
    // Escapes are decoded before comparing: "\u0061" is "a".
    assert_eq!(
        canonicalize(br#"{"a":1,"\u0061":2}"#),
        Err(CanonError::DuplicateMember("a".into()))
    );
    // A duplicate inside an otherwise invalid document is just invalid JSON (hashed raw).
    let fp = fingerprint(
        "POST",
        "/p",
        "",
        Some("application/json"),
        br#"{"a":1,"a":2"#,
    )
    .unwrap();
    assert_eq!(fp.alg, ALG_RAW);
}

#[test]
fn deep_nesting_never_overflows_and_is_hashed_raw() {
    for (open, close) in [("[", "]"), ("{\"a\":", "}")] {
        let depth = 100_000;
        let body = format!("{}1{}", open.repeat(depth), close.repeat(depth));
        assert_eq!(canonicalize(body.as_bytes()), Err(CanonError::TooDeep));
        let fp = fingerprint("POST", "/p", "", Some("application/json"), body.as_bytes()).unwrap();
        assert_eq!(fp.alg, ALG_RAW);
        // Unterminated deep input is answered too.
        let fp = fingerprint(
            "POST",
            "/p",
            "",
            Some("application/json"),
            open.repeat(depth).as_bytes(),
        )
        .unwrap();
        assert_eq!(fp.alg, ALG_RAW);
    }
    let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
    assert!(canonicalize(ok.as_bytes()).is_ok());
    let too = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
    assert_eq!(canonicalize(too.as_bytes()), Err(CanonError::TooDeep));
}

#[test]
fn not_canonicalizable_bodies_are_hashed_raw() {
    for body in [
        &b"{\"a\":\"\\ud800\"}"[..], // lone high surrogate
        b"\"\\udc00\"",              // lone low surrogate
        b"\"\\ud800\\u0041\"",       // high surrogate then not a low one
        b"\"\xff\"",                 // invalid UTF-8
        b"{\"a\":1,}",               // trailing comma
        b"1e400",                    // beyond a double
        b"1e-99999999999",           // absurd exponent
        b"",                         // empty
        b"{'a':1}",
        b"01",
        b"\"tab\there\"",
        b"[1] [2]",
    ] {
        let fp = fingerprint("POST", "/p", "", Some("application/json"), body).unwrap();
        assert_eq!(fp.alg, ALG_RAW, "{:?}", String::from_utf8_lossy(body));
        assert!(canonicalize(body).is_err());
    }
    assert_eq!(canon(r#""\ud83d\ude00""#), "\"\u{1f600}\"");
}

#[test]
fn other_content_types_are_hashed_raw() {
    let a = fingerprint("POST", "/p", "", Some("text/plain"), br#"{"a":1,"b":2}"#).unwrap();
    let b = fingerprint("POST", "/p", "", Some("text/plain"), br#"{"b":2,"a":1}"#).unwrap();
    assert_eq!(a.alg, ALG_RAW);
    assert_ne!(a, b);
    let none = fingerprint("POST", "/p", "", None, br#"{"a":1}"#).unwrap();
    assert_eq!(none.alg, ALG_RAW);
    // Duplicates only matter when the body is read as JSON.
    assert!(fingerprint("POST", "/p", "", Some("text/plain"), br#"{"a":1,"a":2}"#).is_ok());
}

#[test]
fn json_content_types() {
    for ct in [
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/merge-patch+json",
        "application/vnd.api+json",
    ] {
        assert!(is_json_content_type(ct), "{ct}");
    }
    for ct in [
        "text/plain",
        "application/jsonx",
        "+json",
        "application/+json",
        "application/x-www-form-urlencoded",
        "",
    ] {
        assert!(!is_json_content_type(ct), "{ct}");
    }
}

#[test]
fn fields_are_framed_unambiguously() {
    let f = |m: &str, p: &str, q: &str, b: &[u8]| fingerprint(m, p, q, None, b).unwrap();
    assert_ne!(f("POST", "/a", "b", b""), f("POST", "/ab", "", b""));
    assert_ne!(f("POST", "/a", "", b"b"), f("POST", "/a", "b", b""));
    assert_ne!(f("POS", "T/a", "", b""), f("POST", "/a", "", b""));
    assert_ne!(f("POST", "/a", "x=1", b""), f("POST", "/a", "x=2", b""));
    // The algorithm is part of the input: a raw body equal to a canonical one still differs.
    let raw = fingerprint("POST", "/a", "", None, br#"{"a":1}"#).unwrap();
    let jcs = fingerprint("POST", "/a", "", Some("application/json"), br#"{"a":1}"#).unwrap();
    assert_ne!(raw.hex, jcs.hex);
}

#[test]
fn the_media_type_is_part_of_the_request() {
    let f = |ct: Option<&str>, b: &[u8]| fingerprint("POST", "/a", "", ct, b).unwrap();
    // The same bytes as two media types (neither canonicalized here) are two requests...
    assert_ne!(f(Some("text/plain"), b""), f(Some("application/json"), b""));
    assert_ne!(f(Some("text/plain"), b"x"), f(None, b"x"));
    assert_ne!(
        f(Some("application/json"), b"{}"),
        f(Some("application/merge-patch+json"), b"{}")
    );
    // ...but its parameters and case are not.
    assert_eq!(
        f(Some("Text/Plain; charset=utf-8"), b"x"),
        f(Some("text/plain"), b"x")
    );
    assert_eq!(
        media_type_essence(" Application/JSON ;q=1"),
        "application/json"
    );
}

#[test]
fn known_answer() {
    // Pins the framing so a change of it is noticed (and the algorithm renamed).
    let fp = fingerprint(
        "POST",
        "/checkout",
        "",
        Some("application/json"),
        br#"{"b":2,"a":1}"#,
    )
    .unwrap();
    let mut input = Vec::new();
    for field in [
        &b"sha256-jcs-v2"[..],
        b"POST",
        b"/checkout",
        b"",
        b"application/json",
        br#"{"a":1,"b":2}"#,
    ] {
        input.extend_from_slice(&(field.len() as u64).to_be_bytes());
        input.extend_from_slice(field);
    }
    let expected: String = Sha256::digest(&input)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(fp.hex, expected);
}

#[test]
fn members_sort_by_utf16_code_units_not_code_points() {
    // U+10000 is D800 DC00 in UTF-16: before U+E000 there, after it by code point.
    assert_eq!(utf16_cmp("\u{10000}", "\u{e000}"), Ordering::Less);
    assert_eq!(utf16_cmp("a\u{ffff}", "a\u{1f600}"), Ordering::Greater);
    assert_eq!(utf16_cmp("ab", "a"), Ordering::Greater);
    assert_eq!(utf16_cmp("\u{e9}", "\u{e9}"), Ordering::Equal);
    assert_eq!(
        canon("{\"\u{e000}\":1,\"\u{10000}\":2,\"a\":3}"),
        "{\"a\":3,\"\u{10000}\":2,\"\u{e000}\":1}"
    );
}

#[test]
fn strings_are_reescaped_the_jcs_way() {
    assert_eq!(
        canon(r#""\u0041\/\u001f\u007f\u2028""#),
        "\"A/\\u001f\u{7f}\u{2028}\""
    );
    assert_eq!(canon(r#""\b\f\n\r\t\"\\""#), r#""\b\f\n\r\t\"\\""#);
}

#[cfg(not(target_arch = "wasm32"))]
mod props {
    use super::*;
    use proptest::prelude::*;
    use proptest::sample::Index;
    use serde_json::{Map, Value};

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            (-1.0e12f64..1.0e12)
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            "[a-z\\\\\"\u{0}-\u{1f}\u{e9}\u{20ac}\u{1f600}]{0,6}".prop_map(Value::String),
        ]
    }

    fn json() -> impl Strategy<Value = Value> {
        leaf().prop_recursive(5, 48, 5, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map("[a-e\u{e9}\u{1f600}]{0,3}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
            ]
        })
    }

    /// Writes `v` with members in a shuffled order and random whitespace.
    fn scramble(v: &Value, seed: &mut u64, out: &mut String) {
        fn step(seed: &mut u64) -> u64 {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            *seed
        }
        fn ws(n: u64, out: &mut String) {
            for i in 0..(n % 3) {
                out.push([' ', '\n', '\t', '\r'][((n >> (i * 2 + 2)) % 4) as usize]);
            }
        }
        match v {
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(step(seed), out);
                    scramble(item, seed, out);
                    ws(step(seed), out);
                }
                out.push(']');
            }
            Value::Object(m) => {
                let mut members: Vec<_> = m.iter().collect();
                let n = members.len();
                for i in (1..n).rev() {
                    members.swap(i, (step(seed) % (i as u64 + 1)) as usize);
                }
                out.push('{');
                for (i, (k, item)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(step(seed), out);
                    out.push_str(&serde_json::to_string(k).unwrap());
                    ws(step(seed), out);
                    out.push(':');
                    ws(step(seed), out);
                    scramble(item, seed, out);
                }
                ws(step(seed), out);
                out.push('}');
            }
            leaf => out.push_str(&serde_json::to_string(leaf).unwrap()),
        }
    }

    /// Paths to every leaf and every member name.
    fn targets(
        v: &Value,
        path: &mut Vec<(bool, String, usize)>,
        acc: &mut Vec<Vec<(bool, String, usize)>>,
    ) {
        match v {
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    path.push((false, String::new(), i));
                    targets(item, path, acc);
                    path.pop();
                }
            }
            Value::Object(m) => {
                for (k, item) in m {
                    path.push((true, k.clone(), 0));
                    acc.push(path.clone()); // the member name itself
                    path.pop();
                    path.push((false, k.clone(), 0));
                    targets(item, path, acc);
                    path.pop();
                }
            }
            _ => acc.push(path.clone()),
        }
    }

    fn mutate(v: &mut Value, path: &[(bool, String, usize)]) {
        match path.split_first() {
            None => {
                *v = match v.take() {
                    Value::Null => Value::from(0),
                    Value::Bool(b) => Value::Bool(!b),
                    Value::Number(n) => {
                        if n.as_f64() == Some(0.0) {
                            Value::from(1)
                        } else {
                            Value::from(0)
                        }
                    }
                    Value::String(s) => Value::String(format!("{s}x")),
                    other => other,
                }
            }
            Some(((true, name, _), _)) => {
                if let Value::Object(m) = v {
                    let mut new_name = format!("{name}~");
                    while m.contains_key(&new_name) {
                        new_name.push('~');
                    }
                    if let Some(item) = m.remove(name) {
                        m.insert(new_name, item);
                    }
                }
            }
            Some(((false, name, i), rest)) => match v {
                Value::Array(items) => {
                    if let Some(item) = items.get_mut(*i) {
                        mutate(item, rest);
                    }
                }
                Value::Object(m) => {
                    if let Some(item) = m.get_mut(name) {
                        mutate(item, rest);
                    }
                }
                _ => {}
            },
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn reordering_and_whitespace_never_change_it(v in json(), seed in 1u64..) {
            let plain = serde_json::to_string(&v).unwrap();
            let mut seed = seed;
            let mut scrambled = String::new();
            scramble(&v, &mut seed, &mut scrambled);
            prop_assert_eq!(fp_json(&plain), fp_json(&scrambled), "{} vs {}", plain, scrambled);
            // And the canonical form is valid JSON, and its own canonical form.
            let canon = canonicalize(plain.as_bytes()).unwrap();
            prop_assert!(serde_json::from_slice::<Value>(&canon).is_ok());
            prop_assert_eq!(canonicalize(&canon).unwrap(), canon);
        }

        #[test]
        fn changing_any_leaf_or_name_anywhere_changes_it(v in json(), pick in any::<Index>()) {
            let mut acc = Vec::new();
            targets(&v, &mut Vec::new(), &mut acc);
            prop_assume!(!acc.is_empty());
            let path = pick.get(&acc).clone();
            let mut changed = v.clone();
            mutate(&mut changed, &path);
            prop_assume!(changed != v);
            let a = serde_json::to_string(&v).unwrap();
            let b = serde_json::to_string(&changed).unwrap();
            prop_assert_ne!(fp_json(&a), fp_json(&b), "{} vs {}", a, b);
        }

        #[test]
        fn member_order_is_utf16_code_unit_order(a in "[a\u{7f}\u{80}\u{ff}\u{d7ff}\u{e000}\u{ffff}\u{10000}\u{1f600}\u{10ffff}]{0,4}", b in "[a\u{7f}\u{80}\u{ff}\u{d7ff}\u{e000}\u{ffff}\u{10000}\u{1f600}\u{10ffff}]{0,4}") {
            prop_assert_eq!(utf16_cmp(&a, &b), a.encode_utf16().cmp(b.encode_utf16()));
        }

        /// The range check on decimal digits agrees with the float parser it replaced, most of
        /// all next to the overflow threshold (2^1024 − 2^970 ≈ 1.7976931348623158e308).
        #[test]
        fn the_range_check_agrees_with_parsing_a_double(
            mantissa in "1\\.797693134862315[0-9]{0,30}|[1-9]\\.[0-9]{0,20}",
            exp in 300i64..320,
            minus in any::<bool>(),
        ) {
            let text = format!("{}{mantissa}e{exp}", if minus { "-" } else { "" });
            let parsed_infinite = text.parse::<f64>().map_or(true, |v| v.is_infinite());
            let refused = matches!(canonical_number(&text), Err(CanonError::NumberOutOfRange));
            prop_assert_eq!(refused, parsed_infinite, "{}", text);
        }

        /// A decimal without an exponent is often its own canonical text (a fast path): it
        /// must be exactly what the general layout writes for the same value (`e0` forces it).
        #[test]
        fn decimals_as_written_match_the_general_layout(
            int in "0|[1-9][0-9]{0,23}",
            frac in "0{0,8}([1-9][0-9]{0,6})?0{0,2}",
            last in "[0-9]",
            minus in any::<bool>(),
        ) {
            let text = format!("{}{int}.{frac}{last}", if minus { "-" } else { "" });
            let general = canonical_number(&format!("{text}e0")).map(|c| c.into_owned());
            prop_assert_eq!(canonical_number(&text).map(|c| c.into_owned()), general, "{}", text);
        }

        #[test]
        fn integers_are_exact(a in any::<i128>(), b in any::<i128>()) {
            prop_assume!(a != b);
            prop_assert_ne!(fp_json(&a.to_string()), fp_json(&b.to_string()));
            if a.unsigned_abs() < 10u128.pow(21) {
                prop_assert_eq!(canon(&a.to_string()), a.to_string());
            }
        }

        #[test]
        fn doubles_in_shortest_form_match_the_es_layout(bits in any::<u64>()) {
            let v = f64::from_bits(bits);
            prop_assume!(v.is_finite());
            // `{:e}` and `{}` both print the shortest round-trip digits; the canonical text
            // must be one and the same, and read back as the same double.
            let a = canon(&format!("{v:e}"));
            let b = canon(&format!("{v}"));
            prop_assert_eq!(&a, &b);
            let back: f64 = a.parse().unwrap();
            prop_assert_eq!(back, if v == 0.0 { 0.0 } else { v });
        }

        #[test]
        fn accepts_exactly_what_serde_json_accepts(s in "[\\[\\]{}\",:0-9.eE+\\- \\\\u0aftrnls\u{e9}]{0,16}") {
            cross_check(s.as_bytes())?;
        }

        #[test]
        fn accepts_exactly_what_serde_json_accepts_near_valid(v in json(), at in any::<Index>(), byte in any::<u8>(), op in 0u8..3) {
            let mut s = serde_json::to_vec(&v).unwrap();
            let i = at.index(s.len() + 1);
            match op {
                0 => s.insert(i, byte),
                1 if i < s.len() => { s.remove(i); }
                _ if i < s.len() => s[i] = byte,
                _ => s.push(byte),
            }
            cross_check(&s)?;
        }
    }

    fn cross_check(s: &[u8]) -> Result<(), TestCaseError> {
        // Out of scope: exponents longer than our limit (serde_json reads 1e-99999999999 as 0).
        let long_run = s
            .windows(MAX_EXPONENT_DIGITS + 1)
            .any(|w| w.iter().all(u8::is_ascii_digit));
        prop_assume!(!long_run);
        let ours = match canonicalize(s) {
            Ok(_) | Err(CanonError::DuplicateMember(_)) => true,
            Err(CanonError::TooDeep) => return Ok(()),
            Err(_) => false,
        };
        let theirs = serde_json::from_slice::<Value>(s).is_ok();
        prop_assert_eq!(ours, theirs, "{:?}", String::from_utf8_lossy(s));
        Ok(())
    }
}

#[test]
fn the_overflow_threshold_itself_and_its_neighbours() {
    let t = std::str::from_utf8(super::DOUBLE_OVERFLOW).unwrap_or_default();
    let at = |digits: &str| format!("0.{digits}e309");
    for (text, out) in [
        (at(t), true),
        (
            format!("{}1", at(t).trim_end_matches("e309")) + "e309",
            true,
        ),
        (at(&t[..t.len() - 1]), false),
        ("1.7976931348623157e308".to_owned(), false),
        ("1.7976931348623159e308".to_owned(), true),
        ("1e309".to_owned(), true),
        ("9.99e307".to_owned(), false),
    ] {
        let refused = matches!(
            super::canonical_number(&text),
            Err(super::CanonError::NumberOutOfRange)
        );
        let parsed = text.parse::<f64>().map_or(true, |v| v.is_infinite());
        assert_eq!((refused, parsed), (out, out), "{text}");
    }
}

fn fp_sel(body: &str, sel: &super::Selection) -> super::Fingerprint {
    super::fingerprint_with(
        "POST",
        "/orders",
        "",
        Some("application/json"),
        body.as_bytes(),
        sel,
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn pointers(list: &[&str]) -> Vec<super::Pointer> {
    list.iter()
        .map(|p| super::Pointer::parse(p).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

#[test]
fn ignored_members_do_not_change_it_anywhere_else_does() {
    let sel = super::Selection::Ignore(pointers(&["/meta/sent_at", "/trace", "/items/1/note"]));
    let a = r#"{"amount":5,"meta":{"sent_at":"10:00","v":1},"trace":"t1","items":[{"sku":"a"},{"sku":"b","note":"x"}]}"#;
    let b = r#"{"trace":"t2","items":[{"sku":"a"},{"note":"y","sku":"b"}],"meta":{"v":1,"sent_at":"10:05"},"amount":5}"#;
    assert_eq!(
        fp_sel(a, &sel),
        fp_sel(b, &sel),
        "only ignored members differ"
    );
    // An ignored member that is absent is the same as any value of it.
    let c = r#"{"amount":5,"meta":{"v":1},"items":[{"sku":"a"},{"sku":"b"}]}"#;
    assert_eq!(fp_sel(a, &sel), fp_sel(c, &sel));
    // Anything else, however deep, still counts.
    for other in [
        r#"{"amount":6,"meta":{"sent_at":"10:00","v":1},"trace":"t1","items":[{"sku":"a"},{"sku":"b","note":"x"}]}"#,
        r#"{"amount":5,"meta":{"sent_at":"10:00","v":2},"trace":"t1","items":[{"sku":"a"},{"sku":"b","note":"x"}]}"#,
        r#"{"amount":5,"meta":{"sent_at":"10:00","v":1},"trace":"t1","items":[{"sku":"a","note":"x"},{"sku":"b","note":"x"}]}"#,
    ] {
        assert_ne!(fp_sel(a, &sel), fp_sel(other, &sel), "{other}");
    }
    // The selection is in the algorithm: never equal to the whole body's, and another list is
    // another algorithm (its order aside).
    let whole = fp_sel(a, &super::Selection::Whole);
    assert_ne!(whole.alg, fp_sel(a, &sel).alg);
    assert!(fp_sel(a, &sel).alg.starts_with("sha256-jcs-v2;ignore="));
    let reordered =
        super::Selection::Ignore(pointers(&["/trace", "/items/1/note", "/meta/sent_at"]));
    assert_eq!(fp_sel(a, &sel).alg, fp_sel(a, &reordered).alg);
    let fewer = super::Selection::Ignore(pointers(&["/trace"]));
    assert_ne!(fp_sel(a, &sel).alg, fp_sel(a, &fewer).alg);
}

#[test]
fn included_members_are_all_that_counts() {
    let sel =
        super::Selection::Include(pointers(&["/amount", "/currency", "/card", "/items/0/sku"]));
    let a = r#"{"amount":5,"currency":"BRL","card":{"number":"4242","exp":"12/30"},"items":[{"sku":"a","qty":1}],"sent_at":"10:00"}"#;
    let b = r#"{"sent_at":"11:00","card":{"exp":"12/30","number":"4242"},"currency":"BRL","amount":5,"items":[{"qty":9,"sku":"a"}],"trace":"x"}"#;
    assert_eq!(fp_sel(a, &sel), fp_sel(b, &sel));
    for other in [
        r#"{"amount":5,"currency":"BRL","card":{"number":"0000","exp":"12/30"},"items":[{"sku":"a"}]}"#,
        r#"{"amount":5,"currency":"USD","card":{"number":"4242","exp":"12/30"},"items":[{"sku":"a"}]}"#,
        r#"{"amount":5,"currency":"BRL","card":{"number":"4242","exp":"12/30"},"items":[{"sku":"b"}]}"#,
        r#"{"currency":"BRL","card":{"number":"4242","exp":"12/30"},"items":[{"sku":"a"}]}"#,
        r#"{"amount":null,"currency":"BRL","card":{"number":"4242","exp":"12/30"},"items":[{"sku":"a"}]}"#,
    ] {
        assert_ne!(fp_sel(a, &sel), fp_sel(other, &sel), "{other}");
    }
    assert!(fp_sel(a, &sel).alg.starts_with("sha256-jcs-v2;include="));
    // Non-JSON bodies are hashed whole, as without a selection.
    let raw =
        super::fingerprint_with("POST", "/orders", "", Some("text/plain"), b"x", &sel).unwrap();
    assert_eq!(raw.alg, super::ALG_RAW);
}

#[test]
fn pointers_are_rfc_6901_without_the_root_or_the_end_of_an_array() {
    let p = super::Pointer::parse("/a~1b/c~0d/0").unwrap();
    let body = r#"{"a/b":{"c~d":["found",2]}}"#;
    assert_eq!(
        super::string_at(body.as_bytes(), &p).as_deref(),
        Some("found")
    );
    assert_eq!(
        super::string_at(br#"{"a/b":{"c~d":[1]}}"#, &p),
        None,
        "not a string"
    );
    assert_eq!(super::string_at(b"not json", &p), None);
    for bad in ["", "a/b", "/items/-", "/x~2"] {
        assert!(super::Pointer::parse(bad).is_err(), "{bad:?}");
    }
    // An index is decimal without a leading zero; a member named like one is a member.
    let body = br#"{"items":["x","y"],"m":{"01":"named"}}"#;
    assert_eq!(
        super::string_at(body, &super::Pointer::parse("/items/1").unwrap()).as_deref(),
        Some("y")
    );
    assert_eq!(
        super::string_at(body, &super::Pointer::parse("/items/01").unwrap()),
        None
    );
    assert_eq!(
        super::string_at(body, &super::Pointer::parse("/m/01").unwrap()).as_deref(),
        Some("named")
    );
}
