//! The admin API over HTTP: one call per command, problems read into [`AdminError`].

use contract::admin::{
    AdminAction, AdminActionResult, AdminRecord, ListedRecord, ADMIN_PURGE_PATH,
    ADMIN_RECORDS_PATH, ADMIN_RECORD_PATH, ADMIN_RELEASE_PATH, ADMIN_RESOLVE_PATH,
};
use serde::de::DeserializeOwned;

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("cannot reach the state API at {url}: {why}")]
    Unreachable { url: String, why: String },
    /// The admin API answered with a problem document (or another error status).
    #[error("HTTP {status} {title}: {detail}")]
    Refused {
        status: u16,
        /// The problem's type (`/problems/lease-live`, ...), empty when the body was not one.
        kind: String,
        title: String,
        detail: String,
    },
    #[error("unreadable answer from the state API: {0}")]
    Unreadable(String),
}

impl AdminError {
    /// The process's exit code: 3 not found, 4 refused as it stands (live lease, completed;
    /// `--force` would act), 5 authentication, 1 anything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            AdminError::Refused { status: 404, .. } => 3,
            AdminError::Refused { status: 409, .. } => 4,
            AdminError::Refused {
                status: 401 | 403, ..
            } => 5,
            _ => 1,
        }
    }
}

/// The operations an action can be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Release,
    Resolve,
    Purge,
}

impl Action {
    fn path(self) -> &'static str {
        match self {
            Action::Release => ADMIN_RELEASE_PATH,
            Action::Resolve => ADMIN_RESOLVE_PATH,
            Action::Purge => ADMIN_PURGE_PATH,
        }
    }
}

/// Which records to list.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    pub state: Option<String>,
    pub namespace: Option<String>,
    pub older_than_s: u64,
    pub limit: Option<u32>,
}

/// A record's address.
#[derive(Debug, Clone)]
pub struct Address {
    pub namespace: String,
    pub key: String,
    pub subject: String,
    pub endpoint: String,
}

pub struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    pub fn new(base: &str, token: &str, timeout: std::time::Duration) -> Result<Self, AdminError> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| AdminError::Unreachable {
                url: base.to_owned(),
                why: e.to_string(),
            })?;
        Ok(Self {
            http,
            base: base.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
        })
    }

    pub async fn show(&self, at: &Address, body: bool) -> Result<AdminRecord, AdminError> {
        let mut query = vec![
            ("key", at.key.clone()),
            ("subject", at.subject.clone()),
            ("endpoint", at.endpoint.clone()),
        ];
        if !at.namespace.is_empty() {
            query.push(("namespace", at.namespace.clone()));
        }
        if body {
            query.push(("body", "true".into()));
        }
        self.get(ADMIN_RECORD_PATH, &query).await
    }

    pub async fn list(&self, l: &Listing) -> Result<Vec<ListedRecord>, AdminError> {
        let mut query = vec![("older_than_s", l.older_than_s.to_string())];
        if let Some(s) = &l.state {
            query.push(("state", s.clone()));
        }
        if let Some(n) = &l.namespace {
            query.push(("namespace", n.clone()));
        }
        if let Some(n) = l.limit {
            query.push(("limit", n.to_string()));
        }
        self.get(ADMIN_RECORDS_PATH, &query).await
    }

    pub async fn act(
        &self,
        action: Action,
        body: &AdminAction,
    ) -> Result<AdminActionResult, AdminError> {
        let url = format!("{}{}", self.base, action.path());
        let req = self.http.post(&url).bearer_auth(&self.token).json(body);
        self.answer(&url, req).await
    }

    async fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T, AdminError> {
        let url = format!("{}{path}", self.base);
        let req = self.http.get(&url).bearer_auth(&self.token).query(query);
        self.answer(&url, req).await
    }

    async fn answer<T: DeserializeOwned>(
        &self,
        url: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<T, AdminError> {
        let resp = req.send().await.map_err(|e| AdminError::Unreachable {
            url: url.to_owned(),
            why: e.to_string(),
        })?;
        let status = resp.status().as_u16();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| AdminError::Unreadable(e.to_string()))?;
        if !(200..300).contains(&status) {
            let doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            let text = |name: &str| doc[name].as_str().unwrap_or_default().to_owned();
            return Err(AdminError::Refused {
                status,
                kind: text("type"),
                title: text("title"),
                detail: if doc.is_object() {
                    text("detail")
                } else {
                    String::from_utf8_lossy(&bytes).into_owned()
                },
            });
        }
        serde_json::from_slice(&bytes).map_err(|e| AdminError::Unreadable(e.to_string()))
    }
}
