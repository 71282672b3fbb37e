//! The address of a record in the worker's memory: SHA-256 of its scope (key, subject,
//! endpoint), framed like the state API's address ([`contract::scope`]), so two scopes never
//! share an entry (isolation does not rest on a non-cryptographic hash).

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};

/// SHA-256 of a record's scope.
pub type Id = [u8; 32];

/// The address of (key, subject, endpoint).
pub fn id(key: &str, subject: &str, endpoint: &str) -> Id {
    let mut h = Sha256::new();
    contract::scope::frame(&mut h, key, subject, endpoint);
    h.finalize().into()
}

/// A map key that is already a uniform hash: its first 8 bytes are the map's hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key(pub Id);

impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        let mut first = [0u8; 8];
        first.copy_from_slice(self.0.get(..8).unwrap_or(&[0; 8]));
        h.write_u64(u64::from_le_bytes(first));
    }
}

/// Passes [`Key`]'s hash through (no random seed: nothing to defend, the keys are SHA-256).
#[derive(Debug, Default)]
pub struct Prehashed(u64);

impl Hasher for Prehashed {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map by record address.
pub type IdMap<V> = HashMap<Key, V, BuildHasherDefault<Prehashed>>;

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn scopes_never_share_an_address() {
        assert_eq!(id("k", "alice", "POST /a"), id("k", "alice", "POST /a"));
        assert_ne!(id("k", "alice", "POST /a"), id("k", "bob", "POST /a"));
        assert_ne!(id("k", "alice", "POST /a"), id("k", "alice", "POST /b"));
        // Length prefixes: moving a boundary is another scope.
        assert_ne!(id("ka", "lice", "e"), id("k", "alice", "e"));
    }
}
