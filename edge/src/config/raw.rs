//! The file as written: serde's types for the TOML, unknown fields refused, each value with
//! its span (for the line an error names).

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFile {
    pub(super) listen: Spanned<String>,
    pub(super) admin: Option<Spanned<String>>,
    pub(super) upstream: Spanned<String>,
    pub(super) upstream_timeout_ms: Option<Spanned<u64>>,
    pub(super) envoy_workers: Option<Spanned<u32>>,
    pub(super) namespace: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) state: RawState,
    pub(super) subject: Spanned<RawSubject>,
    #[serde(default)]
    pub(super) filter: RawFilter,
    #[serde(rename = "route", default)]
    pub(super) routes: Vec<Spanned<RawRoute>>,
    pub(super) mesh: Option<Spanned<RawMesh>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMesh {
    pub(super) namespace: Option<Spanned<String>>,
    pub(super) state_api_image: Option<Spanned<String>>,
    pub(super) filter_image: Option<Spanned<String>>,
    pub(super) replicas: Option<Spanned<u32>>,
    pub(super) state_api_url: Option<Spanned<String>>,
    pub(super) istio_namespace: Option<Spanned<String>>,
    pub(super) istio_labels: Option<Spanned<BTreeMap<String, String>>>,
    pub(super) gateway: Option<Spanned<String>>,
    pub(super) gateway_namespace: Option<Spanned<String>>,
    pub(super) gateway_listener: Option<Spanned<String>>,
    pub(super) gateway_proxy_namespace: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawState {
    pub(super) listen: Option<Spanned<String>>,
    pub(super) database_url: Option<Spanned<String>>,
    pub(super) postgres_port: Option<Spanned<u16>>,
    pub(super) token: Option<Spanned<String>>,
    pub(super) key_secret: Option<Spanned<String>>,
    pub(super) previous_key_secret: Option<Spanned<String>>,
    pub(super) storage_key: Option<Spanned<String>>,
    pub(super) previous_storage_key: Option<Spanned<String>>,
    pub(super) timeout_ms: Option<Spanned<u64>>,
    pub(super) retention_s: Option<Spanned<u64>>,
    pub(super) max_retention_s: Option<Spanned<u64>>,
    pub(super) admin_token: Option<Spanned<String>>,
    pub(super) tls: Option<Spanned<RawStateTls>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStateTls {
    pub(super) cert_file: Option<Spanned<String>>,
    pub(super) key_file: Option<Spanned<String>>,
    pub(super) ca_file: Option<Spanned<String>>,
    pub(super) server_name: Option<Spanned<String>>,
    pub(super) client_cert_file: Option<Spanned<String>>,
    pub(super) client_key_file: Option<Spanned<String>>,
    pub(super) client_ca_file: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSubject {
    pub(super) jwt: Option<Spanned<RawJwt>>,
    pub(super) header: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawJwt {
    pub(super) issuer: Spanned<String>,
    pub(super) audiences: Spanned<Vec<String>>,
    pub(super) jwks_file: Option<Spanned<String>>,
    pub(super) jwks_url: Option<Spanned<String>>,
    pub(super) header: Option<Spanned<String>>,
    pub(super) claim: Option<Spanned<String>>,
    pub(super) forward_token: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFilter {
    pub(super) lease_ms: Option<Spanned<u64>>,
    pub(super) heartbeat_ms: Option<Spanned<u64>>,
    pub(super) max_request_body_bytes: Option<Spanned<u64>>,
    pub(super) max_stored_body_bytes: Option<Spanned<u64>>,
    pub(super) replay_extra_headers: Option<Spanned<Vec<String>>>,
    pub(super) replay_cache_bytes: Option<u64>,
    pub(super) replay_cache_ttl_ms: Option<u64>,
    pub(super) in_flight_cache_ms: Option<Spanned<u64>>,
    pub(super) complete_retry_ms: Option<u64>,
    pub(super) complete_retry_bytes: Option<u64>,
    pub(super) complete_in_background: Option<Spanned<bool>>,
    pub(super) max_waiters: Option<Spanned<u64>>,
    pub(super) batch_max: Option<Spanned<u64>>,
    pub(super) max_buffered_bytes: Option<Spanned<u64>>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawKey {
    Required,
    Optional,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawOn5xx {
    Store,
    Release,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawOnStateUnavailable {
    FailClosed,
    FailOpen,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawOnUnknown {
    Hold,
    Reconcile,
    Reexecute,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) method: Spanned<String>,
    pub(super) path: Option<Spanned<String>>,
    pub(super) prefix: Option<Spanned<String>>,
    pub(super) key: RawKey,
    pub(super) on_5xx: Option<RawOn5xx>,
    pub(super) on_state_unavailable: Option<RawOnStateUnavailable>,
    pub(super) on_unknown: Option<Spanned<RawOnUnknown>>,
    pub(super) reconcile: Option<Spanned<RawReconcile>>,
    pub(super) lease_ms: Option<Spanned<u64>>,
    pub(super) heartbeat_ms: Option<Spanned<u64>>,
    pub(super) max_request_body_bytes: Option<Spanned<u64>>,
    pub(super) retention_s: Option<Spanned<u64>>,
    pub(super) max_wait_s: Option<Spanned<u64>>,
    pub(super) fingerprint: Option<Spanned<RawFingerprint>>,
    pub(super) key_from: Option<Spanned<String>>,
}

/// `{ ignore = [...] }` or `{ include = [...] }`: RFC 6901 JSON pointers.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFingerprint {
    pub(super) ignore: Option<Vec<String>>,
    pub(super) include: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReconcile {
    pub(super) path: Spanned<String>,
    pub(super) method: Option<Spanned<String>>,
    pub(super) upstream: Option<Spanned<String>>,
    pub(super) timeout_ms: Option<Spanned<u64>>,
}
