//! The faults a schedule may inject (named, added and removed), and what of the state API can
//! be out.

/// The kinds of fault a schedule may inject (all by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Faults(pub u32);

impl Faults {
    pub const KILL: u32 = 1;
    pub const GIVE_UP: u32 = 2;
    pub const API_DOWN: u32 = 4;
    pub const CALLOUT: u32 = 8;
    pub const SKEW: u32 = 16;
    pub const UPSTREAM: u32 = 32;
    pub const CLIENT: u32 = 64;
    /// The database: crash recovery in place, a restart, a pause (each longer than a lease or
    /// not).
    pub const DATABASE: u32 = 128;
    /// Envoy answers a forwarded request itself (408, 413, 503, 504, a reset).
    pub const ENVOY: u32 = 256;
    /// The key secret is rotated (and the previous one dropped) mid-run.
    pub const ROTATE: u32 = 512;
    /// An operator releases or purges a record through the admin API, without force.
    pub const OPERATOR: u32 = 1024;
    /// Envoy loses a wake the worker asked for (the glue's shared-queue enqueue failed): the
    /// worker's next tick must make up for it.
    pub const WAKE: u32 = 2048;
    pub const ALL: Faults = Faults(4095);
    const NAMES: [(&'static str, u32); 12] = [
        ("kill", Self::KILL),
        ("give-up", Self::GIVE_UP),
        ("api-down", Self::API_DOWN),
        ("callout", Self::CALLOUT),
        ("skew", Self::SKEW),
        ("upstream", Self::UPSTREAM),
        ("client", Self::CLIENT),
        ("database", Self::DATABASE),
        ("envoy", Self::ENVOY),
        ("rotate", Self::ROTATE),
        ("operator", Self::OPERATOR),
        ("wake", Self::WAKE),
    ];

    pub fn has(self, f: u32) -> bool {
        self.0 & f != 0
    }

    /// `all`, or names joined by `,` (`kill,give-up`); a leading `-` removes (`all,-kill`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut bits = 0;
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (remove, name) = match part.strip_prefix('-') {
                Some(n) => (true, n),
                None => (false, part),
            };
            let b = if name == "all" {
                Self::ALL.0
            } else {
                Self::NAMES
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, b)| *b)
                    .ok_or_else(|| format!("unknown fault `{name}`"))?
            };
            if remove {
                bits &= !b;
            } else {
                bits |= b;
            }
        }
        Ok(Self(bits))
    }
}

impl std::fmt::Display for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Self::ALL {
            return f.write_str("all");
        }
        let names: Vec<&str> = Self::NAMES
            .iter()
            .filter(|(_, b)| self.has(*b))
            .map(|(n, _)| *n)
            .collect();
        f.write_str(&names.join(","))
    }
}

/// What of the state API is out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    None,
    /// The state API process: connections are refused.
    ApiDown,
    /// Its database: the state API answers 503 until it is back. `in_place`: a crash recovery
    /// in place (the postmaster reinitialises: its start time and timeline stay, so the lease
    /// guard's `serving_since` does not move); otherwise a restart (it moves).
    Database {
        in_place: bool,
    },
    /// The database is paused (stopped, or a stall): calls get no answer until it resumes.
    Paused,
}

/// A silence of the state API's pulse longer than this counts as an outage for the lease
/// guard (`serving_since` moves to its end).
pub const PULSE_SILENCE_MS: u64 = 1_000;
