//! The address of a record: HMAC-SHA256 over (key, subject, endpoint).
//!
//! The parts are framed by [`contract::scope::frame`] (each prefixed by its length), so no two
//! different triples give the same input. The secret keeps a copy of the table from
//! revealing keys: without it, nobody can test a guessed key against a hash.

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub type ScopeHash = [u8; 32];

#[derive(Clone)]
pub struct Scoper {
    mac: Hmac<Sha256>,
    /// The secret before a rotation, while records addressed with it may still be looked up.
    previous: Option<Hmac<Sha256>>,
    /// The key that stored fingerprints are keyed under (derived from the key secret, so it
    /// rotates with it), and the previous one during a rotation.
    fingerprint_key: [u8; 32],
    previous_fingerprint_key: Option<[u8; 32]>,
}

/// The fingerprint key of a key secret: HKDF-SHA256 with a label of its own, independent of
/// the addresses' HMAC.
fn fingerprint_key(secret: &[u8]) -> [u8; 32] {
    let mut key = [0u8; 32];
    // 32 bytes is always a valid HKDF-SHA256 output length.
    let _ =
        hkdf::Hkdf::<Sha256>::new(None, secret).expand(b"idempotency fingerprint key v1", &mut key);
    key
}

impl Scoper {
    /// HMAC accepts keys of any length; the error exists only in the trait's signature.
    pub fn new(secret: &[u8]) -> Result<Self, hmac::digest::InvalidLength> {
        Ok(Self {
            mac: <Hmac<Sha256> as Mac>::new_from_slice(secret)?,
            previous: None,
            fingerprint_key: fingerprint_key(secret),
            previous_fingerprint_key: None,
        })
    }

    /// Also looks up records addressed with `previous` (a rotation of the secret).
    pub fn with_previous(mut self, previous: &[u8]) -> Result<Self, hmac::digest::InvalidLength> {
        self.previous = Some(<Hmac<Sha256> as Mac>::new_from_slice(previous)?);
        self.previous_fingerprint_key = Some(fingerprint_key(previous));
        Ok(self)
    }

    /// A request's fingerprint keyed as records store it, and as they may have stored it
    /// under the previous key secret.
    pub fn keyed_fingerprint(&self, alg: &str, plain: &str) -> state_rules::fingerprint::Keyed {
        state_rules::fingerprint::Keyed::new(
            alg,
            plain,
            &self.fingerprint_key,
            self.previous_fingerprint_key.as_ref().map(|k| &k[..]),
        )
    }

    /// The address under the previous secret, during a rotation.
    pub fn previous_hash_in(
        &self,
        namespace: &str,
        key: &str,
        subject: &str,
        endpoint: &str,
    ) -> Option<ScopeHash> {
        let mut mac = self.previous.clone()?;
        contract::scope::frame_in(&mut mac, namespace, key, subject, endpoint);
        Some(mac.finalize().into_bytes().into())
    }

    pub fn hash(&self, key: &str, subject: &str, endpoint: &str) -> ScopeHash {
        self.hash_in("", key, subject, endpoint)
    }

    /// The address in a namespace (the empty one: [`Scoper::hash`]).
    pub fn hash_in(&self, namespace: &str, key: &str, subject: &str, endpoint: &str) -> ScopeHash {
        let mut mac = self.mac.clone();
        contract::scope::frame_in(&mut mac, namespace, key, subject, endpoint);
        mac.finalize().into_bytes().into()
    }
}

/// A short, non-reversible label for logs: the first 8 bytes of the scope hash in hex.
pub fn log_label(hash: &ScopeHash) -> String {
    hash[..8].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_length_prefixed_and_keyed() {
        let s = Scoper::new(b"0123456789abcdef").unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(s.hash("ab", "c", "e"), s.hash("a", "bc", "e"));
        assert_ne!(s.hash("k", "alice", "e"), s.hash("k", "bob", "e"));
        assert_eq!(s.hash("k", "alice", "e"), s.hash("k", "alice", "e"));
        let other = Scoper::new(b"another secret!!").unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(s.hash("k", "alice", "e"), other.hash("k", "alice", "e"));
        assert_eq!(log_label(&s.hash("k", "alice", "e")).len(), 16);
    }
}
