//! The OpenAPI document, generated from the handlers' annotations and the contract's types
//! (`utoipa`): what `/openapi.json` serves is what the code accepts and answers.

use std::sync::LazyLock;

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use crate::{admin, http};
use contract::admin::{
    AdminAction, AdminActionResult, AdminRecord, AuditEntry, ListedRecord, ADMIN_PURGE_PATH,
    ADMIN_RECORDS_PATH, ADMIN_RECORD_PATH, ADMIN_RELEASE_PATH, ADMIN_RESOLVE_PATH,
};
use contract::problem::Problem;
use contract::wire::{
    AbandonRequest, BatchItem, BatchResponse, ClaimBatchRequest, ClaimRequest, ClaimResponse,
    CompleteBatchRequest, CompleteRequest, HeartbeatRequest, HeartbeatResponse, OnUnknown,
    RecordState, RecordView, ReleaseRequest, StoredResponse, WriteBatchRequest, WriteResponse,
    WriteState, ABANDON_PATH, CLAIMS_PATH, CLAIM_PATH, COMPLETES_PATH, COMPLETE_PATH,
    HEARTBEAT_PATH, RECORDS_PATH, RELEASE_PATH, UNKNOWN_PATH, WRITES_PATH,
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
        http::claims::claim,
        http::claims::claims,
        http::writes::heartbeat,
        http::writes::complete,
        http::writes::completes,
        http::writes::writes,
        http::release::release,
        http::release::outcome_unknown,
        http::release::abandon,
        http::records::record,
        http::health::healthz,
        http::health::readyz,
        http::health::metrics_text,
        openapi,
        admin::show,
        admin::list,
        admin::release,
        admin::resolve,
        admin::purge,
    ),
    components(schemas(
        ClaimRequest,
        ClaimBatchRequest,
        CompleteBatchRequest,
        WriteBatchRequest,
        BatchResponse,
        BatchItem,
        OnUnknown,
        ClaimResponse,
        StoredResponse,
        HeartbeatRequest,
        HeartbeatResponse,
        CompleteRequest,
        ReleaseRequest,
        AbandonRequest,
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
    modifiers(&BearerTokens, &ProblemAnswers)
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

type Route = (&'static str, &'static str);

const FILTER_ROUTES: &[Route] = &[
    ("post", CLAIM_PATH),
    ("post", CLAIMS_PATH),
    ("post", HEARTBEAT_PATH),
    ("post", COMPLETE_PATH),
    ("post", COMPLETES_PATH),
    ("post", WRITES_PATH),
    ("post", RELEASE_PATH),
    ("post", UNKNOWN_PATH),
    ("post", ABANDON_PATH),
    ("get", RECORDS_PATH),
];
const FENCED_ROUTES: &[Route] = &[
    ("post", HEARTBEAT_PATH),
    ("post", COMPLETE_PATH),
    ("post", RELEASE_PATH),
    ("post", UNKNOWN_PATH),
];
const ADMIN_ROUTES: &[Route] = &[
    ("get", ADMIN_RECORD_PATH),
    ("get", ADMIN_RECORDS_PATH),
    ("post", ADMIN_RELEASE_PATH),
    ("post", ADMIN_RESOLVE_PATH),
    ("post", ADMIN_PURGE_PATH),
];
const ADMIN_ACTIONS: &[Route] = &[
    ("post", ADMIN_RELEASE_PATH),
    ("post", ADMIN_RESOLVE_PATH),
    ("post", ADMIN_PURGE_PATH),
];
const ADMIN_ONE_RECORD: &[Route] = &[
    ("get", ADMIN_RECORD_PATH),
    ("post", ADMIN_RELEASE_PATH),
    ("post", ADMIN_RESOLVE_PATH),
    ("post", ADMIN_PURGE_PATH),
];

/// Every problem answer (`application/problem+json`), described once, and the routes that
/// give it: added to their operations by [`ProblemAnswers`].
const PROBLEMS: &[(u16, &str, &[Route])] = &[
    (400, "Malformed JSON, unknown field, invalid key (`/problems/invalid-idempotency-key`) or field value (`/problems/bad-request`). Nothing written.", FILTER_ROUTES),
    (401, "Missing or wrong bearer token (`/problems/unauthenticated`).", FILTER_ROUTES),
    (404, "No record (`/problems/not-found`), said with the header `idempotency-record: absent`: the filter tells a client `absent` on that header only.", &[("get", RECORDS_PATH)]),
    (409, "Fenced out (`/problems/fenced-out`): this token no longer owns an in-progress record for the key (a newer claim took over, or it was completed, released or purged). Nothing written; the event is counted in `state_api_fenced_out_total`.", FENCED_ROUTES),
    (413, "Request body over the HTTP limit, or stored body over --max-body-bytes (`/problems/payload-too-large`). Nothing written.", FILTER_ROUTES),
    (500, "Unexpected failure, or a stored response that does not open under this state API's storage keys (`/problems/internal-error`): nothing is replayed.", FILTER_ROUTES),
    (503, "The database cannot be reached or is overloaded (`/problems/idempotency-state-unavailable`, with `Retry-After: 1`). The filter fails closed.", FILTER_ROUTES),
    (503, "Database unreachable, or read-only (a standby, or a failover under way).", &[("get", "/readyz")]),
    (400, "Bad input (`/problems/bad-request`, `/problems/invalid-idempotency-key`): a missing reason or actor, malformed JSON. Nothing written.", ADMIN_ROUTES),
    (401, "No or another token, or the admin API is off (no --admin-token): `/problems/unauthenticated`.", ADMIN_ROUTES),
    (403, "The filter's token (`--api-token`): `/problems/forbidden`.", ADMIN_ROUTES),
    (404, "No record for this key, subject and endpoint: `/problems/not-found`.", ADMIN_ONE_RECORD),
    (409, "The owner's lease is live (`/problems/lease-live`), or resolving a completed record (`/problems/already-completed`), without `force`. Nothing written.", ADMIN_ACTIONS),
    (500, "Unexpected failure, or a stored body that does not open under this state API's storage keys (`/problems/internal-error`).", ADMIN_ROUTES),
    (503, "The database is unreachable: `/problems/idempotency-state-unavailable`.", ADMIN_ROUTES),
];

struct ProblemAnswers;

impl Modify for ProblemAnswers {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        for (status, description, routes) in PROBLEMS {
            for (method, path) in *routes {
                let Some(item) = doc.paths.paths.get_mut(*path) else {
                    continue;
                };
                let op = match *method {
                    "get" => item.get.as_mut(),
                    _ => item.post.as_mut(),
                };
                let Some(op) = op else { continue };
                let answer = ResponseBuilder::new()
                    .description(*description)
                    .content(
                        "application/problem+json",
                        ContentBuilder::new()
                            .schema(Some(Ref::from_schema_name("Problem")))
                            .build(),
                    )
                    .build();
                op.responses
                    .responses
                    .insert(status.to_string(), answer.into());
            }
        }
    }
}

/// The document as served, rendered once.
pub fn json() -> &'static str {
    static JSON: LazyLock<String> =
        LazyLock::new(|| ApiDoc::openapi().to_pretty_json().unwrap_or_default());
    &JSON
}

#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    summary = r#"This document"#,
    responses(
        (status = 200, description = r#"OpenAPI 3.1"#, content_type = "application/json")
    )
)]
pub(crate) async fn openapi() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        json(),
    )
        .into_response()
}
