//! The Idempotency-Key header parser never panics, and whatever it accepts is a valid key that
//! round-trips through both header forms.
#![no_main]

use filter_core::key::parse_key_header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Up to three header lines, separated by '\n'.
    let values: Vec<&str> = text.splitn(3, '\n').collect();
    if let Ok(Some(key)) = parse_key_header(&values) {
        assert_eq!(values.len(), 1);
        assert!(contract::validate_key(&key).is_ok());
        assert!(!key.contains(['"', ',']));
        assert_eq!(parse_key_header(&[key.as_str()]), Ok(Some(key.clone())));
        let quoted = format!("\"{}\"", key.replace('\\', "\\\\"));
        assert_eq!(parse_key_header(&[quoted.as_str()]), Ok(Some(key.clone())));
    }
});
