//! The canonical JSON form: never panics (nor overflows the stack), accepts what serde_json
//! accepts, its output is valid JSON and its own canonical form, and the fingerprint is
//! answered for any body.
#![no_main]

use contract::fingerprint::{canonicalize, fingerprint, CanonError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let ours = canonicalize(data);
    let _ = fingerprint("POST", "/checkout", "", Some("application/json"), data);
    let _ = fingerprint("POST", "/checkout", "", None, data);
    match &ours {
        Ok(canon) => {
            assert!(
                serde_json::from_slice::<serde_json::Value>(canon).is_ok(),
                "canonical output is not JSON"
            );
            assert_eq!(
                canonicalize(canon).as_ref(),
                Ok(canon),
                "canonical form is not a fixed point"
            );
        }
        Err(CanonError::TooDeep) => return,
        Err(_) => {}
    }
    // Exponents longer than 9 digits are out of scope (serde_json reads 1e-9999999999 as 0).
    if data.windows(10).any(|w| w.iter().all(u8::is_ascii_digit)) {
        return;
    }
    let accepted = matches!(ours, Ok(_) | Err(CanonError::DuplicateMember(_)));
    let theirs = serde_json::from_slice::<serde_json::Value>(data);
    // serde_json has its own depth limit (128); past it, no comparison.
    if let Err(e) = &theirs {
        if e.to_string().contains("recursion limit") {
            return;
        }
    }
    assert_eq!(
        accepted,
        theirs.is_ok(),
        "acceptance differs from serde_json: {ours:?} vs {theirs:?}"
    );
});
