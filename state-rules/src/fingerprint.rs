//! How a request's fingerprint is stored. A plain SHA-256 of the canonical request, stored as
//! it is, lets a copy of the table confirm a guess wherever few bodies are possible (an amount,
//! a card's last digits); so the record keeps an HMAC of it under a key of its own instead
//! (issue 34, path 12), with that key's id, and records from before (no id) keep matching.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The stored form: HMAC-SHA256 under `key` over the algorithm and the plain fingerprint (each
/// prefixed by its length), in lower-case hex (64 characters, as the plain one).
pub fn keyed(key: &[u8], alg: &str, plain: &str) -> String {
    let mut mac = match <Hmac<Sha256> as Mac>::new_from_slice(key) {
        Ok(m) => m,
        // HMAC takes keys of any length; the error exists only in the trait's signature.
        Err(_) => return String::new(),
    };
    for part in [alg.as_bytes(), plain.as_bytes()] {
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part);
    }
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A fingerprint key's id, stored with each record keyed under it: the first 8 bytes of the
/// key's SHA-256.
pub fn key_id(key: &[u8]) -> i64 {
    let digest = Sha256::digest(key);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// A request's fingerprint as a claim compares and stores it: keyed under the current key, and
/// under the previous one during a rotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyed {
    pub plain: String,
    /// What a new record stores, and the id it stores with it.
    pub stored: String,
    pub key_id: i64,
    pub previous: Option<(i64, String)>,
}

impl Keyed {
    pub fn new(alg: &str, plain: &str, current: &[u8], previous: Option<&[u8]>) -> Self {
        Self {
            plain: plain.to_owned(),
            stored: keyed(current, alg, plain),
            key_id: key_id(current),
            previous: previous.map(|p| (key_id(p), keyed(p, alg, plain))),
        }
    }

    /// Whether a record's stored fingerprint (and the id of the key it was stored under; none:
    /// a plain one from before keying) is this request's. A key this process no longer has
    /// matches nothing: a mismatch (422), never a replay of another request.
    pub fn matches(&self, stored: &str, key_id: Option<i64>) -> bool {
        match key_id {
            None => stored == self.plain,
            Some(id) if id == self.key_id => stored == self.stored,
            Some(id) => self
                .previous
                .as_ref()
                .is_some_and(|(prev, keyed)| *prev == id && stored == keyed),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn the_stored_form_is_not_the_plain_one_and_matches_across_a_rotation() {
        let plain = "ab".repeat(32);
        let now = Keyed::new(
            "sha256-jcs-v2",
            &plain,
            b"new key 0123456789abcdef",
            Some(b"old"),
        );
        assert_ne!(now.stored, plain);
        assert_eq!(now.stored.len(), 64);
        assert!(now.matches(&now.stored, Some(now.key_id)));
        assert!(
            now.matches(&plain, None),
            "records from before keying still match"
        );
        let before = Keyed::new("sha256-jcs-v2", &plain, b"old", None);
        assert!(now.matches(&before.stored, Some(before.key_id)));
        // Another body, another algorithm, or a key this process lacks: no match.
        let other = Keyed::new("sha256-jcs-v2", &"cd".repeat(32), b"old", None);
        assert!(!now.matches(&other.stored, Some(other.key_id)));
        let alg = Keyed::new("sha256-raw-v2", &plain, b"old", None);
        assert!(!now.matches(&alg.stored, Some(alg.key_id)));
        let gone = Keyed::new("sha256-jcs-v2", &plain, b"dropped", None);
        assert!(!now.matches(&gone.stored, Some(gone.key_id)));
    }
}
