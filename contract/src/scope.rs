//! How the parts of a hashed input are framed: each part is prefixed by its length (u64,
//! big-endian), so no two different tuples share an input (`("ab", "c")` vs `("a", "bc")`).
//! The state API's record address (an HMAC of key, subject and endpoint), the filter's memory
//! address of a record (SHA-256 of the same) and the request fingerprint all frame this way.

use sha2::digest::Update;

/// Feeds `parts` into `hasher`, each preceded by its length.
pub fn frame_parts<H: Update>(hasher: &mut H, parts: &[&[u8]]) {
    for part in parts {
        hasher.update(&(part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
}

/// Feeds a record's scope (key, subject, endpoint) into `hasher`.
pub fn frame<H: Update>(hasher: &mut H, key: &str, subject: &str, endpoint: &str) {
    frame_parts(
        hasher,
        &[key.as_bytes(), subject.as_bytes(), endpoint.as_bytes()],
    );
}

/// The same in a namespace: (namespace, key, subject, endpoint); the empty namespace frames as
/// [`frame`], so records made before namespaces keep their address. Four framed parts never
/// equal three (an endpoint holds no NUL, and every length prefix starts with one).
pub fn frame_in<H: Update>(
    hasher: &mut H,
    namespace: &str,
    key: &str,
    subject: &str,
    endpoint: &str,
) {
    if namespace.is_empty() {
        return frame(hasher, key, subject, endpoint);
    }
    frame_parts(
        hasher,
        &[
            namespace.as_bytes(),
            key.as_bytes(),
            subject.as_bytes(),
            endpoint.as_bytes(),
        ],
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn boundaries_are_part_of_the_input() {
        let h = |k: &str, s: &str, e: &str| {
            let mut d = Sha256::new();
            frame(&mut d, k, s, e);
            d.finalize()
        };
        assert_ne!(h("ab", "c", "e"), h("a", "bc", "e"));
        assert_eq!(h("k", "alice", "e"), h("k", "alice", "e"));
    }

    #[test]
    fn a_namespace_is_part_of_the_scope_and_none_is_the_old_address() {
        let h = |n: &str, k: &str| {
            let mut d = Sha256::new();
            frame_in(&mut d, n, k, "alice", "POST /x");
            d.finalize()
        };
        let old = {
            let mut d = Sha256::new();
            frame(&mut d, "k", "alice", "POST /x");
            d.finalize()
        };
        assert_eq!(h("", "k"), old);
        assert_ne!(h("a", "k"), old);
        assert_ne!(h("a", "k"), h("b", "k"));
    }
}
