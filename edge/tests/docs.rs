//! The docs site's generated Reference pages (docs/reference/, written by `edge docs` in
//! `make docs`) are committed so that the repository reads the same as the site: each must be
//! what the code generates today. The state API's OpenAPI document they render is committed
//! too, and must be what the state API serves (`UPDATE_OPENAPI=1 cargo test -p edge --test
//! docs` writes it). Every problem type has its page.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

fn docs() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs")
}

fn committed(name: &str) -> String {
    std::fs::read_to_string(docs().join(name))
        .unwrap_or_else(|e| panic!("docs/{name}: {e} (run `make docs` and commit it)"))
}

#[test]
fn the_committed_openapi_document_is_what_the_state_api_serves() {
    let served = format!("{}\n", state_api::openapi::json());
    let path = docs().join(edge::docs::OPENAPI_JSON);
    if std::env::var_os("UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &served).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    assert!(
        committed(edge::docs::OPENAPI_JSON) == served,
        "docs/{} differs from what the state API serves: `make docs-openapi`, then `make docs`, and commit both",
        edge::docs::OPENAPI_JSON
    );
}

#[test]
fn the_committed_reference_pages_are_what_the_code_generates() {
    let openapi = committed(edge::docs::OPENAPI_JSON);
    let pages = [
        (
            edge::docs::CONFIGURATION_PAGE,
            edge::docs::configuration_page(),
        ),
        (
            edge::docs::PLUGIN_CONFIGURATION_PAGE,
            edge::docs::plugin_configuration_page(),
        ),
        (edge::docs::PROBLEMS_PAGE, Ok(edge::docs::problems_page())),
        (edge::docs::OPENAPI_PAGE, edge::docs::openapi_page(&openapi)),
    ];
    for (name, generated) in pages {
        let generated = generated.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            committed(name) == generated,
            "docs/{name} is not what `edge docs` generates today: run `make docs` and commit it"
        );
    }
}

#[test]
fn every_problem_type_has_its_page() {
    edge::docs::check_problem_pages(&docs()).unwrap_or_else(|e| panic!("{e}"));
}
