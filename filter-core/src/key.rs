//! The `Idempotency-Key` request header.
//!
//! The IETF draft (draft-ietf-httpapi-idempotency-key-header) makes the value a Structured
//! Field sf-string: `Idempotency-Key: "8e03978e-40d5"`. Many APIs (Stripe) send a bare token:
//! `Idempotency-Key: 8e03978e-40d5`. Both are accepted and mean the same key.
//!
//! Rules: the header at most once; an sf-string has only `\"` and `\\` as escapes and nothing
//! after its closing quote (no list, no parameters); the key inside is 1 to 255 visible ASCII
//! characters ([`contract::validate_key`]) and contains no `"` and no `,` (so a key is never
//! mistaken for a list or a quoted string, whichever form it came in).

use contract::{validate_key, KeyError};
use std::fmt;

pub const HEADER: &str = "idempotency-key";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyHeaderError {
    /// The header appears more than once.
    Repeated,
    /// A list (a comma outside a quoted string).
    List,
    /// A quoted string that is not a valid sf-string (bad escape, unterminated, trailing text).
    MalformedString,
    /// A `"` in a bare key, or a `"` or `,` inside the key.
    ForbiddenCharacter,
    Key(KeyError),
}

impl fmt::Display for KeyHeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Repeated => f.write_str("the Idempotency-Key header must appear once"),
            Self::List => f.write_str("the Idempotency-Key header must hold one key, not a list"),
            Self::MalformedString => f.write_str(
                "the Idempotency-Key header is not a valid quoted string (only \\\" and \\\\ escapes, nothing after the closing quote)",
            ),
            Self::ForbiddenCharacter => f.write_str("the idempotency key may not contain '\"' or ','"),
            Self::Key(e) => e.fmt(f),
        }
    }
}

/// The key from all values of the header (one entry per header line, as Envoy gives them):
/// `Ok(None)` when the header is absent.
pub fn parse_key_header(values: &[&str]) -> Result<Option<String>, KeyHeaderError> {
    match values {
        [] => Ok(None),
        [one] => parse_value(one).map(Some),
        _ => Err(KeyHeaderError::Repeated),
    }
}

fn parse_value(raw: &str) -> Result<String, KeyHeaderError> {
    let v = raw.trim_matches(|c| c == ' ' || c == '\t');
    let key = if let Some(rest) = v.strip_prefix('"') {
        let mut key = String::new();
        let mut chars = rest.chars();
        loop {
            match chars.next() {
                None => return Err(KeyHeaderError::MalformedString),
                Some('"') => break,
                Some('\\') => match chars.next() {
                    Some(c @ ('"' | '\\')) => key.push(c),
                    _ => return Err(KeyHeaderError::MalformedString),
                },
                // sf-string characters: SP and visible ASCII.
                Some(c) if (' '..='~').contains(&c) => key.push(c),
                Some(_) => return Err(KeyHeaderError::MalformedString),
            }
        }
        let after = chars.as_str();
        if after.starts_with(',') || after.trim_start_matches([' ', '\t']).starts_with(',') {
            return Err(KeyHeaderError::List);
        }
        if !after.is_empty() {
            return Err(KeyHeaderError::MalformedString);
        }
        key
    } else {
        if v.contains(',') {
            return Err(KeyHeaderError::List);
        }
        if v.contains('"') {
            return Err(KeyHeaderError::ForbiddenCharacter);
        }
        v.to_owned()
    };
    validate_key(&key).map_err(KeyHeaderError::Key)?;
    if key.contains(['"', ',']) {
        return Err(KeyHeaderError::ForbiddenCharacter);
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn one(v: &str) -> Result<Option<String>, KeyHeaderError> {
        parse_key_header(&[v])
    }

    #[test]
    fn bare_and_quoted_forms_mean_the_same_key() {
        assert_eq!(one("abc-123"), Ok(Some("abc-123".into())));
        assert_eq!(one("\"abc-123\""), Ok(Some("abc-123".into())));
        assert_eq!(one("  \"abc-123\"\t"), Ok(Some("abc-123".into())));
        assert_eq!(one(r#""a\\b""#), Ok(Some(r"a\b".into())));
        assert_eq!(one(r"a\b"), Ok(Some(r"a\b".into())));
        assert_eq!(parse_key_header(&[]), Ok(None));
        let max = "k".repeat(255);
        assert_eq!(one(&max), Ok(Some(max.clone())));
        assert_eq!(one(&format!("\"{max}\"")), Ok(Some(max)));
    }

    #[test]
    fn malformed_values_are_refused() {
        assert_eq!(one(""), Err(KeyHeaderError::Key(KeyError::Empty)));
        assert_eq!(one("\"\""), Err(KeyHeaderError::Key(KeyError::Empty)));
        assert_eq!(
            one(&"k".repeat(256)),
            Err(KeyHeaderError::Key(KeyError::TooLong))
        );
        assert_eq!(
            one(&format!("\"{}\"", "k".repeat(256))),
            Err(KeyHeaderError::Key(KeyError::TooLong))
        );
        assert_eq!(
            one("a\u{1}b"),
            Err(KeyHeaderError::Key(KeyError::InvalidCharacter))
        );
        assert_eq!(
            one("a b"),
            Err(KeyHeaderError::Key(KeyError::InvalidCharacter))
        );
        assert_eq!(
            one("\"a b\""),
            Err(KeyHeaderError::Key(KeyError::InvalidCharacter))
        );
        assert_eq!(
            one("caf\u{e9}"),
            Err(KeyHeaderError::Key(KeyError::InvalidCharacter))
        );
        assert_eq!(one("\"caf\u{e9}\""), Err(KeyHeaderError::MalformedString));
        assert_eq!(one("\"a\u{7}\""), Err(KeyHeaderError::MalformedString));
        assert_eq!(one("a,b"), Err(KeyHeaderError::List));
        assert_eq!(one("\"a\", \"b\""), Err(KeyHeaderError::List));
        assert_eq!(one("\"a\",\"b\""), Err(KeyHeaderError::List));
        assert_eq!(one("\"a,b\""), Err(KeyHeaderError::ForbiddenCharacter));
        assert_eq!(one(r#""a\"b""#), Err(KeyHeaderError::ForbiddenCharacter));
        assert_eq!(one(r#""a\nb""#), Err(KeyHeaderError::MalformedString));
        assert_eq!(one(r#""abc"#), Err(KeyHeaderError::MalformedString));
        assert_eq!(one(r#""abc\"#), Err(KeyHeaderError::MalformedString));
        assert_eq!(one(r#""abc";p=1"#), Err(KeyHeaderError::MalformedString));
        assert_eq!(one(r#""abc"x"#), Err(KeyHeaderError::MalformedString));
        assert_eq!(one(r#"ab"c"#), Err(KeyHeaderError::ForbiddenCharacter));
        assert_eq!(parse_key_header(&["a", "a"]), Err(KeyHeaderError::Repeated));
        assert_eq!(parse_key_header(&["a", ""]), Err(KeyHeaderError::Repeated));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn never_panics_and_accepted_keys_are_valid(s in "\\PC{0,300}") {
                if let Ok(Some(k)) = one(&s) {
                    prop_assert!(validate_key(&k).is_ok());
                    prop_assert!(!k.contains(['"', ',']));
                }
            }

            #[test]
            fn every_valid_key_round_trips_in_both_forms(k in "[!#-+\\--~]{1,255}") {
                prop_assert_eq!(one(&k), Ok(Some(k.clone())));
                let quoted = format!("\"{}\"", k.replace('\\', "\\\\"));
                prop_assert_eq!(one(&quoted), Ok(Some(k)));
            }
        }
    }
}
