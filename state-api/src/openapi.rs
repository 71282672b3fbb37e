//! The OpenAPI document, generated from the handlers' annotations and the contract's types
//! (`utoipa`): what `/openapi.json` serves is what the code accepts and answers.

use std::sync::LazyLock;

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::{admin, http};
use contract::admin::{AdminAction, AdminActionResult, AdminRecord, AuditEntry, ListedRecord};
use contract::problem::Problem;
use contract::wire::{
    ClaimRequest, ClaimResponse, CompleteRequest, HeartbeatRequest, HeartbeatResponse, OnUnknown,
    RecordState, RecordView, ReleaseRequest, StoredResponse, WriteResponse, WriteState,
};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Idempotency state API",
        version = "1.3.0",
        description = r#"The single source of truth for every Idempotency-Key, used by the Envoy filter. One record per (key, subject, endpoint). A claim is committed (durably) before it is answered; a duplicate is answered at once from the committed row and never waits for the first request. Writes of an owner (heartbeat, complete, release) are fenced by the token of its claim. All times use the database clock. Every `/v1` call needs `Authorization: Bearer <token>`; every error is an RFC 9457 problem document (`application/problem+json`). The Rust types are in `contract/src/wire.rs`. Answers may gain optional members in later versions: readers ignore members they do not know (requests stay strict: an unknown member is a 400)."#
    ),
    servers((url = "http://127.0.0.1:8081", description = "The demo's state API")),
    paths(
        http::claim,
        http::heartbeat,
        http::complete,
        http::release,
        http::outcome_unknown,
        http::record,
        http::healthz,
        http::readyz,
        http::metrics_text,
        http::openapi,
        admin::show,
        admin::list,
        admin::release,
        admin::resolve,
        admin::purge,
    ),
    components(schemas(
        ClaimRequest,
        OnUnknown,
        ClaimResponse,
        StoredResponse,
        HeartbeatRequest,
        HeartbeatResponse,
        CompleteRequest,
        ReleaseRequest,
        RecordState,
        WriteState,
        WriteResponse,
        RecordView,
        Problem,
        AdminAction,
        AuditEntry,
        AdminRecord,
        ListedRecord,
        AdminActionResult,
    )),
    modifiers(&BearerTokens)
)]
pub struct ApiDoc;

/// The two bearer tokens: the filter's and the operators'.
struct BearerTokens;

impl Modify for BearerTokens {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        let bearer = |description: &str| {
            let mut http = Http::new(HttpAuthScheme::Bearer);
            http.description = Some(description.to_owned());
            SecurityScheme::Http(http)
        };
        components.add_security_scheme("bearer", bearer("--api-token / STATE_API_TOKEN"));
        components.add_security_scheme(
            "admin",
            bearer("The admin token (--admin-token), never the filter's."),
        );
    }
}

/// The document as served, rendered once.
pub fn json() -> &'static str {
    static JSON: LazyLock<String> =
        LazyLock::new(|| ApiDoc::openapi().to_pretty_json().unwrap_or_default());
    &JSON
}
