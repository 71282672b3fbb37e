//! The jwt_authn rules `edge render` writes: a verified token is required on each protected
//! route, one rule a route, or one RE2 pattern a method past [`RULES_PER_METHOD`].

use yaml_rust2::Yaml;

use crate::config::{Config, Match, Route, Subject};
use crate::yaml::{map, n, s};

/// The jwt_authn provider.
pub const JWT_PROVIDER: &str = "edge";

/// Up to this many protected routes of one method each have a jwt_authn rule of their own (the
/// rendered configuration reads as the file does). Past it, the method's routes are one rule
/// whose path is one RE2 pattern: jwt_authn tries its rules in order on every request, so a
/// rule a route made Envoy's CPU per request grow with the routes (issue 38, curve 4), while
/// RE2 matches the pattern in the length of the path. Every rule requires the same provider,
/// so their order does not change which requests need a token.
const RULES_PER_METHOD: usize = 16;

/// The methods with more than [`RULES_PER_METHOD`] routes, in the order they first appear,
/// each with the one pattern of its routes.
fn patterns(routes: &[Route]) -> Vec<(&str, String)> {
    let mut methods: Vec<&str> = Vec::new();
    for r in routes {
        if !methods.contains(&r.method.as_str()) {
            methods.push(&r.method);
        }
    }
    methods
        .into_iter()
        .filter(|m| routes.iter().filter(|r| r.method == *m).count() > RULES_PER_METHOD)
        .map(|m| (m, paths_pattern(routes.iter().filter(|r| r.method == m))))
        .collect()
}

/// The jwt_authn rules: a verified token is required on each protected route, and on a `GET`
/// of the key state path (its answer is scoped by the caller's subject).
pub(crate) fn rules(routes: &[Route], key_state_path: Option<&str>) -> Vec<Yaml> {
    let patterns = patterns(routes);
    let mut rules: Vec<Yaml> = routes
        .iter()
        .filter(|r| !patterns.iter().any(|(m, _)| *m == r.method))
        .map(|r| {
            let (kind, p) = match &r.matcher {
                Match::Path(p) => ("path", s(p.clone())),
                Match::Prefix(p) => ("prefix", s(p.clone())),
            };
            rule(kind, p, &r.method)
        })
        .collect();
    for (method, pattern) in patterns {
        rules.push(rule("safe_regex", map(vec![("regex", s(pattern))]), method));
    }
    if let Some(path) = key_state_path {
        rules.push(rule("path", s(path.to_owned()), "GET"));
    }
    rules
}

/// One RE2 pattern that matches a whole path exactly when one of `routes` matches it (Envoy
/// matches `safe_regex` against the whole path without the query, as `path` and `prefix`).
fn paths_pattern<'a>(routes: impl Iterator<Item = &'a Route>) -> String {
    let alternatives: Vec<String> = routes
        .map(|r| match &r.matcher {
            Match::Path(p) => re2_literal(p),
            Match::Prefix(p) => format!("{}.*", re2_literal(p)),
        })
        .collect();
    format!("(?s:{})", alternatives.join("|"))
}

/// `text` as an RE2 literal: every character that means something in a pattern escaped.
fn re2_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A jwt_authn rule: requests of `method` whose path `kind` (`path`, `prefix` or `safe_regex`)
/// matches need a verified token.
fn rule(kind: &str, path: Yaml, method: &str) -> Yaml {
    map(vec![
        (
            "match",
            map(vec![
                (kind, path),
                (
                    "headers",
                    Yaml::Array(vec![map(vec![
                        ("name", s(":method")),
                        ("string_match", map(vec![("exact", s(method))])),
                    ])]),
                ),
            ]),
        ),
        ("requires", map(vec![("provider_name", s(JWT_PROVIDER))])),
    ])
}

/// Envoy refuses an RE2 pattern whose program is larger than its runtime's
/// `re2.max_program_size.error_level` (100 by default): room for the routes' pattern, when
/// there is one (an RE2 program is at most a few instructions a character).
pub(crate) fn runtime_layer(cfg: &Config) -> Option<Yaml> {
    let Subject::Jwt(_) = &cfg.subject else {
        return None;
    };
    let longest = patterns(&cfg.routes).iter().map(|(_, p)| p.len()).max()?;
    let program_size = u64::try_from(longest)
        .unwrap_or(u64::MAX)
        .saturating_mul(4)
        .max(1_000);
    Some(map(vec![(
        "layers",
        Yaml::Array(vec![map(vec![
            ("name", s("routes-pattern")),
            (
                "static_layer",
                map(vec![("re2.max_program_size.error_level", n(program_size))]),
            ),
        ])]),
    )]))
}
