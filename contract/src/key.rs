//! What a valid Idempotency-Key value is, once unwrapped from its header syntax.
//!
//! Both the filter (before it claims) and the state API (before it writes) apply this, so a
//! key that one side accepts the other side accepts too.

use thiserror::Error;

/// Stripe's limit, also used by ACP; the IETF draft leaves it to the server.
pub const MAX_KEY_LEN: usize = 255;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum KeyError {
    #[error("the idempotency key is empty")]
    Empty,
    #[error("the idempotency key is longer than {MAX_KEY_LEN} characters")]
    TooLong,
    #[error("the idempotency key may contain only visible ASCII characters (0x21-0x7E)")]
    InvalidCharacter,
}

/// Accepts 1 to 255 visible ASCII characters (0x21..=0x7E): no spaces, no control characters,
/// no non-ASCII. Quotes and commas are rejected earlier, by the header parser in the filter.
pub fn validate_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(KeyError::InvalidCharacter);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_uuid_and_max_length() {
        assert_eq!(validate_key("8e03978e-40d5-43e8-bc93-6894a57f9324"), Ok(()));
        assert_eq!(validate_key(&"k".repeat(MAX_KEY_LEN)), Ok(()));
    }

    #[test]
    fn rejects_empty_long_control_space_and_non_ascii() {
        assert_eq!(validate_key(""), Err(KeyError::Empty));
        assert_eq!(
            validate_key(&"k".repeat(MAX_KEY_LEN + 1)),
            Err(KeyError::TooLong)
        );
        assert_eq!(validate_key("a\u{7}b"), Err(KeyError::InvalidCharacter));
        assert_eq!(validate_key("a b"), Err(KeyError::InvalidCharacter));
        assert_eq!(validate_key("caf\u{e9}"), Err(KeyError::InvalidCharacter));
        assert_eq!(validate_key("a\u{7f}"), Err(KeyError::InvalidCharacter));
    }
}
