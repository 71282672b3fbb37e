//! A small JSON reader for the two kinds of documents the filter reads: its configuration and
//! the state API's answers.
//!
//! serde_json's deserializer, with the visitor code generated for every type it reads, its float
//! parsing and the float formatting its error messages pull in, was more than a third of the
//! module Envoy loads (about 160 KiB of 470). What the filter reads is small and flat, so it is
//! read here into a plain tree, and [`Fields`] takes objects apart with errors that name the
//! field. Writing JSON stays with serde_json (its serializer is small).
//!
//! Accepted: RFC 8259 JSON in UTF-8, except that numbers must be integers (no fraction, no
//! exponent: neither the configuration nor the wire has any) that fit in 64 bits, and nesting is
//! limited to [`MAX_DEPTH`].

/// Deepest nesting accepted (the configuration is 4 levels deep, the answers 4).
pub const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Null,
    Bool(bool),
    /// An integer, as sign and magnitude (fits both `i64` and `u64` values).
    Int {
        negative: bool,
        magnitude: u64,
    },
    Str(String),
    Array(Vec<Value>),
    /// Members in document order (duplicates kept; [`Fields`] refuses them).
    Object(Vec<(String, Value)>),
}

impl Value {
    /// What it is, for messages ("a string", ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Int { .. } => "an integer",
            Value::Str(_) => "a string",
            Value::Array(_) => "an array",
            Value::Object(_) => "an object",
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Int {
                negative: false,
                magnitude,
            } => Some(magnitude),
            Value::Int {
                negative: true,
                magnitude: 0,
            } => Some(0),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::Int {
                negative: false,
                magnitude,
            } => i64::try_from(magnitude).ok(),
            Value::Int {
                negative: true,
                magnitude,
            } => 0i64.checked_sub_unsigned(magnitude),
            _ => None,
        }
    }
}

/// Parses a whole document.
pub fn parse(bytes: &[u8]) -> Result<Value, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let at = e.valid_up_to();
        format!("invalid UTF-8 at {}", position(bytes, at))
    })?;
    let mut p = Parser {
        s: text.as_bytes(),
        text,
        pos: 0,
    };
    p.ws();
    let v = p.value(0)?;
    p.ws();
    if p.pos < p.s.len() {
        return Err(p.error("trailing characters"));
    }
    Ok(v)
}

/// `line L column C` (1-based, columns in bytes) of a byte offset.
fn position(s: &[u8], at: usize) -> String {
    let before = s.get(..at).unwrap_or(s);
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let column = at
        - before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1)
        + 1;
    format!("line {line} column {column}")
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn error(&self, what: &str) -> String {
        format!("{what} at {}", position(self.s, self.pos))
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn literal(&mut self, word: &str, v: Value) -> Result<Value, String> {
        if self.s.get(self.pos..self.pos + word.len()) == Some(word.as_bytes()) {
            self.pos += word.len();
            Ok(v)
        } else {
            Err(self.error("expected a value"))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, String> {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().map(Value::Str),
            Some(b't') => self.literal("true", Value::Bool(true)),
            Some(b'f') => self.literal("false", Value::Bool(false)),
            Some(b'n') => self.literal("null", Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.error("expected a value")),
            None => Err(self.error("unexpected end of input")),
        }
    }

    fn nested(&self, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            Err(self.error("nested too deeply"))
        } else {
            Ok(())
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, String> {
        self.nested(depth)?;
        self.pos += 1;
        let mut members = Vec::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Object(members));
        }
        loop {
            self.ws();
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a member name"));
            }
            let name = self.string()?;
            self.ws();
            if self.peek() != Some(b':') {
                return Err(self.error("expected `:`"));
            }
            self.pos += 1;
            self.ws();
            let v = self.value(depth)?;
            members.push((name, v));
            self.ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(Value::Object(members));
                }
                _ => return Err(self.error("expected `,` or `}`")),
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, String> {
        self.nested(depth)?;
        self.pos += 1;
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.ws();
            items.push(self.value(depth)?);
            self.ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.error("expected `,` or `]`")),
            }
        }
    }

    fn number(&mut self) -> Result<Value, String> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let start = self.pos;
        let mut magnitude: u64 = 0;
        while let Some(d @ b'0'..=b'9') = self.peek() {
            magnitude = magnitude
                .checked_mul(10)
                .and_then(|m| m.checked_add(u64::from(d - b'0')))
                .ok_or_else(|| self.error("number out of range"))?;
            self.pos += 1;
        }
        let digits = self.pos - start;
        if digits == 0 || (digits > 1 && self.s.get(start) == Some(&b'0')) {
            return Err(self.error("invalid number"));
        }
        if matches!(self.peek(), Some(b'.' | b'e' | b'E')) {
            return Err(self.error("expected an integer (no fraction or exponent)"));
        }
        Ok(Value::Int {
            negative,
            magnitude,
        })
    }

    fn hex4(&mut self) -> Result<u32, String> {
        let mut v = 0u32;
        for _ in 0..4 {
            let d = match self.peek() {
                Some(c @ b'0'..=b'9') => c - b'0',
                Some(c @ b'a'..=b'f') => c - b'a' + 10,
                Some(c @ b'A'..=b'F') => c - b'A' + 10,
                _ => return Err(self.error("invalid \\u escape")),
            };
            v = v * 16 + u32::from(d);
            self.pos += 1;
        }
        Ok(v)
    }

    /// A string starting at its opening quote.
    fn string(&mut self) -> Result<String, String> {
        self.pos += 1;
        let mut out = String::new();
        loop {
            let run = self.pos;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            // Cut on ASCII bytes only, so the run is whole UTF-8.
            out.push_str(self.text.get(run..self.pos).unwrap_or(""));
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let c = match self.peek() {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            self.pos += 1;
                            let hi = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&hi) {
                                if self.s.get(self.pos..self.pos + 2) != Some(b"\\u") {
                                    return Err(self.error("lone surrogate"));
                                }
                                self.pos += 2;
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return Err(self.error("lone surrogate"));
                                }
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            } else {
                                hi
                            };
                            out.push(
                                char::from_u32(code).ok_or_else(|| self.error("lone surrogate"))?,
                            );
                            continue;
                        }
                        _ => return Err(self.error("invalid escape")),
                    };
                    out.push(c);
                    self.pos += 1;
                }
                Some(_) => return Err(self.error("control character in a string")),
                None => return Err(self.error("unterminated string")),
            }
        }
    }
}

/// The members of an object, read by name. `what` names the object in messages (`state_api`,
/// `routes[1]`).
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    members: &'a [(String, Value)],
    what: &'a str,
}

impl<'a> Fields<'a> {
    /// `v` must be an object without duplicate member names.
    pub fn of(v: &'a Value, what: &'a str) -> Result<Self, String> {
        let Value::Object(members) = v else {
            let what = if what.is_empty() {
                "the document"
            } else {
                what
            };
            return Err(format!("{what} must be an object, not {}", v.kind()));
        };
        let f = Self { members, what };
        for (i, (name, _)) in members.iter().enumerate() {
            if members.iter().take(i).any(|(n, _)| n == name) {
                return Err(format!("duplicate field `{name}`{}", f.within()));
            }
        }
        Ok(f)
    }

    /// ` in <what>`, or nothing at the top level.
    fn within(&self) -> String {
        if self.what.is_empty() {
            String::new()
        } else {
            format!(" in {}", self.what)
        }
    }

    /// `<what>.<name>`, or `<name>` at the top level.
    fn path(&self, name: &str) -> String {
        if self.what.is_empty() {
            name.to_owned()
        } else {
            format!("{}.{name}", self.what)
        }
    }

    fn missing(&self, name: &str) -> String {
        format!("missing field `{name}`{}", self.within())
    }

    fn wrong(&self, name: &str, expected: &str, v: &Value) -> String {
        format!("{} must be {expected}, not {}", self.path(name), v.kind())
    }

    /// Refuses a member not in `known`.
    pub fn deny_unknown(&self, known: &[&str]) -> Result<(), String> {
        match self
            .members
            .iter()
            .find(|(n, _)| !known.contains(&n.as_str()))
        {
            Some((name, _)) => Err(format!(
                "unknown field `{name}`{}, expected one of {}",
                self.within(),
                quoted(known)
            )),
            None => Ok(()),
        }
    }

    /// The member, `None` when absent or `null`.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.members
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .filter(|v| **v != Value::Null)
    }

    pub fn required(&self, name: &str) -> Result<&'a Value, String> {
        self.get(name).ok_or_else(|| self.missing(name))
    }

    pub fn opt_u64(&self, name: &str) -> Result<Option<u64>, String> {
        self.get(name)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong(name, "a non-negative integer", v))
            })
            .transpose()
    }

    pub fn u64(&self, name: &str) -> Result<u64, String> {
        self.opt_u64(name)?.ok_or_else(|| self.missing(name))
    }

    pub fn u64_or(&self, name: &str, default: u64) -> Result<u64, String> {
        Ok(self.opt_u64(name)?.unwrap_or(default))
    }

    pub fn i64(&self, name: &str) -> Result<i64, String> {
        let v = self.required(name)?;
        v.as_i64()
            .ok_or_else(|| self.wrong(name, "a 64-bit integer", v))
    }

    pub fn bool(&self, name: &str) -> Result<bool, String> {
        self.opt_bool(name)?.ok_or_else(|| self.missing(name))
    }

    pub fn bool_or(&self, name: &str, default: bool) -> Result<bool, String> {
        Ok(self.opt_bool(name)?.unwrap_or(default))
    }

    pub fn opt_bool(&self, name: &str) -> Result<Option<bool>, String> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(name, "a boolean", v)),
        }
    }

    pub fn opt_str(&self, name: &str) -> Result<Option<&'a str>, String> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Str(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(name, "a string", v)),
        }
    }

    pub fn str(&self, name: &str) -> Result<&'a str, String> {
        self.opt_str(name)?.ok_or_else(|| self.missing(name))
    }

    /// An array of strings (absent: empty).
    pub fn strings(&self, name: &str) -> Result<Vec<String>, String> {
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| self.wrong(name, "an array of strings", v))
                })
                .collect(),
            Some(v) => Err(self.wrong(name, "an array of strings", v)),
        }
    }

    /// One of `variants` by name (a string member); `default` when absent.
    pub fn variant<T: Copy>(
        &self,
        name: &str,
        variants: &[(&str, T)],
        default: Option<T>,
    ) -> Result<T, String> {
        let v = match (self.get(name), default) {
            (None, Some(d)) => return Ok(d),
            (None, None) => return Err(self.missing(name)),
            (Some(v), _) => v,
        };
        let s = v.as_str().ok_or_else(|| self.wrong(name, "a string", v))?;
        variants
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, t)| *t)
            .ok_or_else(|| {
                let names: Vec<&str> = variants.iter().map(|(n, _)| *n).collect();
                format!(
                    "unknown variant `{s}` for {}, expected one of {}",
                    self.path(name),
                    quoted(&names)
                )
            })
    }
}

fn quoted(names: &[&str]) -> String {
    let mut out = String::new();
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push('`');
        out.push_str(n);
        out.push('`');
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
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
        let v =
            parse(r#""a\"b\\c\/d\b\f\n\r\t\u00e9\u20ac\ud83d\ude00 \u0000 é""#.as_bytes()).unwrap();
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
            let e = parse(bad).unwrap_err();
            assert!(
                e.contains(needle),
                "{:?}: {e}",
                String::from_utf8_lossy(bad)
            );
        }
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert!(parse(deep.as_bytes()).unwrap_err().contains("deeply"));
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(parse(ok.as_bytes()).is_ok());
        // Never a stack overflow, whatever the depth.
        assert!(parse("[".repeat(100_000).as_bytes()).is_err());
    }

    #[test]
    fn errors_say_where() {
        let e = parse(b"{\n  \"a\": 1,\n  \"b\": x\n}").unwrap_err();
        assert!(e.ends_with("at line 3 column 8"), "{e}");
    }

    #[test]
    fn fields_name_what_is_wrong() {
        let v = parse(
            br#"{"n": 5, "s": "x", "b": true, "l": ["a"], "z": null, "neg": -3, "e": "two"}"#,
        )
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
}
