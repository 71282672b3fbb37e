//! The plugin configuration parser never panics; an accepted configuration satisfies the
//! documented invariants.
#![no_main]

use filter_core::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(c) = Config::parse(data) {
        assert!(c.state_api.timeout_ms > 0);
        assert!(c.heartbeat_ms > 0 && c.heartbeat_ms < c.lease_ms);
        assert!(c.max_request_body_bytes > 0 && c.max_stored_body_bytes > 0);
        assert!(!c.routes.is_empty());
        assert!(c.tick_period_ms() > 0);
    }
});
