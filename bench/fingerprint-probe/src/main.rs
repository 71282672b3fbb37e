//! `fingerprint-probe [MIN_MS]`: the fingerprint's cost at every size of the body curve, one
//! JSON line ([`fingerprint_probe::Cost`]) a size on stdout, each figure timed over at least
//! MIN_MS milliseconds (default 500). Built for wasm32-wasip1 and run by `node run.mjs`, it
//! measures the cost in V8; natively, on this CPU.

use std::process::ExitCode;
use std::time::Duration;

fn main() -> ExitCode {
    let min_ms = match std::env::args().nth(1).map(|a| a.parse::<u64>()) {
        None => 500,
        Some(Ok(ms)) => ms,
        Some(Err(e)) => {
            eprintln!("fingerprint-probe: MIN_MS is a number of milliseconds: {e}");
            return ExitCode::from(2);
        }
    };
    let min = Duration::from_millis(min_ms);
    for bytes in fingerprint_probe::SIZES {
        let line = fingerprint_probe::measure(bytes, min)
            .map_err(|e| e.to_string())
            .and_then(|cost| serde_json::to_string(&cost).map_err(|e| e.to_string()));
        match line {
            Ok(line) => println!("{line}"),
            Err(e) => {
                eprintln!("fingerprint-probe: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
