//! Time per fingerprint of a small JSON body, for the opt-level the filter's module is built
//! with (`Cargo.toml`, `[profile.release.package.contract]`):
//! `cargo run --release -p contract --example fingerprint_speed [--config 'profile.release.package.contract.opt-level=3']`.

use std::time::Instant;

fn main() {
    let body = br#"{"amount":4500,"currency":"BRL","card":{"number":"4242424242424242","exp":"12/30"},"items":[{"sku":"a","qty":1},{"sku":"b","qty":2}],"meta":{"sent_at":1733000000}}"#;
    let n: u32 = 200_000;
    let started = Instant::now();
    let mut bytes = 0usize;
    for _ in 0..n {
        let fp = contract::fingerprint::fingerprint(
            "POST",
            "/checkout",
            "",
            Some("application/json"),
            body,
        );
        bytes += fp.map_or(0, |f| f.hex.len());
    }
    let per = started.elapsed() / n;
    println!(
        "{} ns per fingerprint of a {}-byte JSON body ({bytes} hex characters made)",
        per.as_nanos(),
        body.len()
    );
}
