//! Small builders for the YAML that `render` and `mesh` write: a string, a number, a map in
//! the order given, and Envoy's duration syntax.

use yaml_rust2::yaml::Hash;
use yaml_rust2::Yaml;

pub(crate) fn s(v: impl Into<String>) -> Yaml {
    Yaml::String(v.into())
}

pub(crate) fn n(v: u64) -> Yaml {
    Yaml::Integer(i64::try_from(v).unwrap_or(i64::MAX))
}

pub(crate) fn map(pairs: Vec<(&str, Yaml)>) -> Yaml {
    let mut h = Hash::new();
    for (k, v) in pairs {
        h.insert(s(k), v);
    }
    Yaml::Hash(h)
}

/// Envoy's duration syntax (`1.500s`).
pub(crate) fn duration(ms: u64) -> Yaml {
    if ms.is_multiple_of(1000) {
        s(format!("{}s", ms / 1000))
    } else {
        s(format!("{}.{:03}s", ms / 1000, ms % 1000))
    }
}
