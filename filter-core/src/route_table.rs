//! The protected routes as a byte trie per method, so that finding a request's route costs the
//! length of its path, not the number of routes (issue 38, curve 4: a linear scan made Envoy's
//! CPU per request 2.4-2.6x at 1,000 routes).
//!
//! It answers exactly what [`Config::route_index`] answers (the first route in configuration
//! order whose method is the request's and whose path equals, or prefix begins, the request's
//! path): every route that matches a path lies on the trie's walk along it, so the smallest
//! index met on the walk is the first match. `Config::route_index` stays the specification;
//! a property test holds the two to the same answers.

use crate::config::{Config, Route};

/// One trie node: its children by next byte (sorted), and the first route index that ends here
/// as a prefix or as an exact path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Node {
    children: Vec<(u8, u32)>,
    prefix: Option<usize>,
    exact: Option<usize>,
}

/// The routes of one method.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Trie {
    nodes: Vec<Node>,
}

impl Trie {
    fn new() -> Self {
        Self {
            nodes: vec![Node::default()],
        }
    }

    fn child(&self, at: usize, byte: u8) -> Option<usize> {
        let children = &self.nodes.get(at)?.children;
        let found = children.binary_search_by_key(&byte, |&(b, _)| b).ok()?;
        children.get(found).map(|&(_, child)| child as usize)
    }

    /// The node for `text`, made if missing.
    fn node_for(&mut self, text: &str) -> usize {
        let mut at = 0;
        for &byte in text.as_bytes() {
            at = match self.child(at, byte) {
                Some(child) => child,
                None => {
                    let child = self.nodes.len();
                    self.nodes.push(Node::default());
                    if let Some(node) = self.nodes.get_mut(at) {
                        let slot = node.children.partition_point(|&(b, _)| b < byte);
                        node.children.insert(slot, (byte, child as u32));
                    }
                    child
                }
            };
        }
        at
    }

    /// Keeps the first index that ends at `text` (routes are added in configuration order).
    fn add(&mut self, text: &str, index: usize, exact: bool) {
        let at = self.node_for(text);
        if let Some(node) = self.nodes.get_mut(at) {
            let slot = if exact {
                &mut node.exact
            } else {
                &mut node.prefix
            };
            slot.get_or_insert(index);
        }
    }

    fn first_match(&self, path: &str) -> Option<usize> {
        let mut best: Option<usize> = None;
        let mut keep = |found: Option<usize>| {
            if let Some(i) = found {
                best = Some(best.map_or(i, |b| b.min(i)));
            }
        };
        let mut at = 0;
        for &byte in path.as_bytes() {
            keep(self.nodes.get(at).and_then(|n| n.prefix));
            match self.child(at, byte) {
                Some(child) => at = child,
                None => return best,
            }
        }
        if let Some(node) = self.nodes.get(at) {
            keep(node.prefix);
            keep(node.exact);
        }
        best
    }
}

/// The routes by method, each method's in a trie.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteTable {
    methods: Vec<(String, Trie)>,
}

impl RouteTable {
    pub fn new(routes: &[Route]) -> Self {
        let mut table = Self::default();
        for (index, route) in routes.iter().enumerate() {
            let (text, exact) = match (&route.path, &route.prefix) {
                (Some(path), _) => (path, true),
                (None, Some(prefix)) => (prefix, false),
                (None, None) => continue,
            };
            let trie = match table.methods.iter().position(|(m, _)| *m == route.method) {
                Some(i) => table.methods.get_mut(i).map(|(_, t)| t),
                None => {
                    table.methods.push((route.method.clone(), Trie::new()));
                    table.methods.last_mut().map(|(_, t)| t)
                }
            };
            if let Some(trie) = trie {
                trie.add(text, index, exact);
            }
        }
        table
    }

    pub fn of(cfg: &Config) -> Self {
        Self::new(&cfg.routes)
    }

    /// The index of the first route matching this method and path (query already removed).
    pub fn find(&self, method: &str, path: &str) -> Option<usize> {
        self.methods
            .iter()
            .find(|(m, _)| m == method)
            .and_then(|(_, trie)| trie.first_match(path))
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::config::KeyPolicy;
    use proptest::prelude::*;

    fn route(method: &str, text: &str, exact: bool) -> Route {
        let doc = serde_json::json!({
            "state_api": {"cluster": "c", "authority": "a", "token": "t"},
            "subject": {"header": "x-sub"},
            "routes": [if exact {
                serde_json::json!({"method": method, "path": text, "key": "required"})
            } else {
                serde_json::json!({"method": method, "prefix": text, "key": "required"})
            }],
        });
        let cfg = Config::parse(doc.to_string().as_bytes()).unwrap();
        cfg.routes.into_iter().next().unwrap()
    }

    fn config(routes: Vec<Route>) -> Config {
        let mut cfg = Config::parse(
            br#"{"state_api":{"cluster":"c","authority":"a","token":"t"},"subject":{"header":"x-sub"},"routes":[{"method":"POST","path":"/x","key":"required"}]}"#,
        )
        .unwrap();
        cfg.routes = routes;
        cfg
    }

    #[test]
    fn the_first_route_in_configuration_order_wins_prefix_or_exact() {
        let cfg = config(vec![
            route("POST", "/pay/", false),
            route("POST", "/pay/card", true),
            route("POST", "/pay", false),
            route("GET", "/pay/card", true),
            route("POST", "/checkout", true),
        ]);
        let table = RouteTable::of(&cfg);
        for (method, path, want) in [
            ("POST", "/pay/card", Some(0)),
            ("POST", "/pay", Some(2)),
            ("POST", "/payment", Some(2)),
            ("GET", "/pay/card", Some(3)),
            ("GET", "/pay/card/x", None),
            ("POST", "/checkout", Some(4)),
            ("POST", "/checkout/", None),
            ("POST", "/check", None),
            ("PUT", "/checkout", None),
            ("POST", "", None),
        ] {
            assert_eq!(table.find(method, path), want, "{method} {path}");
            assert_eq!(cfg.route_index(method, path), want, "{method} {path}");
        }
        assert_eq!(cfg.routes.first().map(|r| r.key), Some(KeyPolicy::Required));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, failure_persistence: None, ..ProptestConfig::default() })]

        /// The table answers what the configuration's scan answers, for routes and paths drawn
        /// from a small alphabet so that they share prefixes often.
        #[test]
        fn the_table_answers_what_the_scan_answers(
            routes in proptest::collection::vec(("(POST|GET)", "/[ab/é]{0,5}", any::<bool>()), 1..12),
            paths in proptest::collection::vec(("(POST|GET|PUT)", "/[ab/é]{0,6}"), 1..12),
        ) {
            let cfg = config(routes.iter().map(|(m, t, exact)| route(m, t, *exact)).collect());
            let table = RouteTable::of(&cfg);
            for (method, path) in &paths {
                prop_assert_eq!(table.find(method, path), cfg.route_index(method, path), "{} {}", method, path);
            }
        }
    }
}
