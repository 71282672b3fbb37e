//! The state API's admin API (its own bearer token, never the filter's): show and list
//! records, and the operator actions, each written to an append-only audit table in the same
//! transaction. `idemctl` is its client.

use serde::{Deserialize, Serialize};

use crate::wire::{RecordView, StoredResponse};

/// `GET ?namespace=&key=&subject=&endpoint=[&body=true]`: one record and its audit trail.
pub const ADMIN_RECORD_PATH: &str = "/v1/admin/record";
/// `GET ?state=&older_than_s=&namespace=&limit=`: records by state and age.
pub const ADMIN_RECORDS_PATH: &str = "/v1/admin/records";
/// `POST` [`AdminAction`]: the key may run again (the record is deleted).
pub const ADMIN_RELEASE_PATH: &str = "/v1/admin/release";
/// `POST` [`AdminAction`] with `response`: the record is completed with it.
pub const ADMIN_RESOLVE_PATH: &str = "/v1/admin/resolve";
/// `POST` [`AdminAction`]: the record is deleted, whatever its state.
pub const ADMIN_PURGE_PATH: &str = "/v1/admin/purge";

/// An operator action on one record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AdminAction {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    /// Why (required: it is the audit trail's point).
    pub reason: String,
    /// Who (an operator's name; `idemctl` sends the login name).
    pub actor: String,
    /// Act although the owner's lease is live, or the record is completed (audited as forced).
    #[serde(default)]
    pub force: bool,
    /// For resolve: the outcome to store (`replayable: false` and no body: not replayable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<StoredResponse>,
}

/// One row of the audit table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditEntry {
    pub id: i64,
    /// RFC 3339, the database clock.
    pub at: String,
    pub actor: String,
    pub action: String,
    pub reason: String,
    pub forced: bool,
    /// The record before and after (no body), as the database held it.
    pub before: Option<serde_json::Value>,
    pub after: Option<serde_json::Value>,
}

/// A record as operators see it, with its audit trail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminRecord {
    /// The record's address (hex of the keyed hash; the key itself is never stored).
    pub scope: String,
    pub namespace: String,
    /// `None`: no record (released or purged; the audit trail stays).
    pub record: Option<RecordView>,
    /// Only with `body=true`, for a replayable completed record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
    pub audit: Vec<AuditEntry>,
}

/// A record in a listing (no key: only its address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListedRecord {
    pub scope: String,
    pub namespace: String,
    pub subject: String,
    pub endpoint: String,
    pub state: crate::wire::RecordState,
    pub token: i64,
    pub age_ms: u64,
    pub lease_remaining_ms: u64,
    pub expires_in_ms: u64,
}

/// What an action did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminActionResult {
    pub action: String,
    pub audit_id: i64,
    pub before: Option<serde_json::Value>,
    pub after: Option<serde_json::Value>,
}
