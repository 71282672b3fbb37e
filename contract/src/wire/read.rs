//! Reading the state API's answers (the filter, the tests and the tools all read them here),
//! with the project's own JSON reader; and the answers as the state API builds them.

use super::{
    AnswerError, BatchResponse, ClaimItem, ClaimResponse, HeartbeatResponse, Item, StoredResponse,
    WriteItem, WriteResponse, WriteState,
};
use crate::json::{self, Fields};
use base64::Engine as _;

fn document(body: &[u8]) -> Result<json::Value, AnswerError> {
    Ok(json::parse(body)?)
}

impl ClaimResponse {
    /// This caller owns the key (the state API adds its limits before answering).
    pub fn claimed(token: i64, lease_ms: u64, reclaimed: bool) -> Self {
        Self::Claimed {
            token,
            lease_ms,
            reclaimed,
            max_body_bytes: None,
            retention_s: None,
        }
    }

    /// Another owner's lease has `lease_remaining_ms` left: retry when it runs out, at the
    /// earliest in a second (the state API caps it for pollers).
    pub fn in_progress(lease_remaining_ms: u64) -> Self {
        Self::InProgress {
            retry_after_s: u32::try_from(lease_remaining_ms.div_ceil(1000).max(1))
                .unwrap_or(u32::MAX),
            lease_remaining_ms,
            waited_ms: None,
        }
    }

    /// The first request finished with `response`, kept for `expires_in_ms` more.
    pub fn completed(response: StoredResponse, expires_in_ms: u64) -> Self {
        Self::Completed {
            response,
            expires_in_ms: Some(expires_in_ms),
            waited_ms: None,
        }
    }

    /// Every [`ClaimResponse::label`].
    pub const LABELS: [&'static str; 6] = [
        "claimed",
        "reclaimed",
        "in_progress",
        "completed",
        "mismatch",
        "unknown",
    ];

    /// The outcome's name in metrics and logs (a reclaim is told apart from a first claim).
    pub fn label(&self) -> &'static str {
        match self {
            Self::Claimed {
                reclaimed: true, ..
            } => "reclaimed",
            Self::Claimed { .. } => "claimed",
            Self::InProgress { .. } => "in_progress",
            Self::Completed { .. } => "completed",
            Self::Mismatch => "mismatch",
            Self::Unknown => "unknown",
        }
    }

    /// Reads the answer to `/v1/claim`.
    pub fn read(body: &[u8]) -> Result<Self, AnswerError> {
        Self::from_value(&document(body)?)
    }

    fn from_value(doc: &json::Value) -> Result<Self, AnswerError> {
        let f = Fields::of(doc, "the claim answer")?;
        Ok(match f.str("outcome")? {
            "claimed" => ClaimResponse::Claimed {
                token: f.i64("token")?,
                lease_ms: f.u64("lease_ms")?,
                reclaimed: f.bool("reclaimed")?,
                max_body_bytes: f.opt_u64("max_body_bytes")?,
                retention_s: f.opt_u64("retention_s")?,
            },
            "in_progress" => ClaimResponse::InProgress {
                retry_after_s: u32::try_from(f.u64("retry_after_s")?)
                    .map_err(|_| AnswerError("retry_after_s is out of range".into()))?,
                lease_remaining_ms: f.u64("lease_remaining_ms")?,
                waited_ms: f.opt_u64("waited_ms")?,
            },
            "completed" => ClaimResponse::Completed {
                response: StoredResponse::read(&Fields::of(f.required("response")?, "response")?)?,
                expires_in_ms: f.opt_u64("expires_in_ms")?,
                waited_ms: f.opt_u64("waited_ms")?,
            },
            "mismatch" => ClaimResponse::Mismatch,
            "unknown" => ClaimResponse::Unknown,
            other => return Err(AnswerError(format!("unknown claim outcome `{other}`"))),
        })
    }
}

impl BatchResponse {
    /// Reads the answer to `/v1/claims` sent with `claims` claims: one item each, in order.
    pub fn read_claims(body: &[u8], claims: usize) -> Result<Vec<ClaimItem>, AnswerError> {
        Ok(Self::read_both(body, claims, 0)?.0)
    }

    /// Reads the answer to `/v1/completes` sent with `completes` completes.
    pub fn read_writes(body: &[u8], completes: usize) -> Result<Vec<WriteItem>, AnswerError> {
        Ok(Self::read_both(body, 0, completes)?.1)
    }

    /// Reads the answer to `/v1/writes` sent with `claims` claims and `completes` completes.
    pub fn read_both(
        body: &[u8],
        claims: usize,
        completes: usize,
    ) -> Result<(Vec<ClaimItem>, Vec<WriteItem>), AnswerError> {
        let doc = document(body)?;
        let mut items = Self::items(&doc, claims.saturating_add(completes))?;
        let writes = items.split_off(claims);
        let claims = items.into_iter().map(|(status, answer)| Item {
            status,
            answer: answer.and_then(ClaimResponse::from_value),
        });
        let writes = writes.into_iter().map(|(status, answer)| Item {
            status,
            answer: answer.and_then(WriteResponse::from_value),
        });
        Ok((claims.collect(), writes.collect()))
    }

    /// Each item's status, and its document for a 2xx (its problem's detail otherwise).
    #[allow(clippy::type_complexity)]
    fn items(
        doc: &json::Value,
        sent: usize,
    ) -> Result<Vec<(u16, Result<&json::Value, AnswerError>)>, AnswerError> {
        let f = Fields::of(doc, "the batch answer")?;
        let json::Value::Array(items) = f.required("answers")? else {
            return Err(AnswerError("answers is not an array".into()));
        };
        if items.len() != sent {
            return Err(AnswerError(format!(
                "the batch answer has {} answers for {sent} requests",
                items.len()
            )));
        }
        items
            .iter()
            .map(|item| {
                let f = Fields::of(item, "a batch answer")?;
                let status = u16::try_from(f.u64("status")?)
                    .map_err(|_| AnswerError("status is out of range".into()))?;
                let doc = f.required("answer")?;
                let answer = if (200..300).contains(&status) {
                    Ok(doc)
                } else {
                    let problem = Fields::of(doc, "a batch answer's problem")?;
                    Err(AnswerError(
                        problem.opt_str("detail")?.unwrap_or("no detail").to_owned(),
                    ))
                };
                Ok((status, answer))
            })
            .collect()
    }
}

impl StoredResponse {
    /// Reads a stored response inside an answer (members added later are ignored).
    fn read(f: &Fields<'_>) -> Result<Self, AnswerError> {
        let status = u16::try_from(f.u64("status")?)
            .map_err(|_| AnswerError("response.status is out of range".into()))?;
        if f.get("headers").is_none() {
            return Err(AnswerError("missing field `headers` in response".into()));
        }
        Ok(Self {
            status,
            headers: f.string_pairs("headers")?,
            body: base64::engine::general_purpose::STANDARD
                .decode(f.opt_str("body_base64")?.unwrap_or(""))
                .map_err(|_| AnswerError("response.body_base64 is not standard base64".into()))?,
            replayable: f.bool("replayable")?,
        })
    }
}

impl WriteResponse {
    /// Reads the answer to `/v1/complete` or `/v1/release`.
    pub fn read(body: &[u8]) -> Result<Self, AnswerError> {
        Self::from_value(&document(body)?)
    }

    fn from_value(doc: &json::Value) -> Result<Self, AnswerError> {
        let f = Fields::of(doc, "the write answer")?;
        let state = match f.str("state")? {
            "completed" => WriteState::Completed,
            "released" => WriteState::Released,
            "unknown" => WriteState::Unknown,
            other => return Err(AnswerError(format!("unknown write state `{other}`"))),
        };
        Ok(Self {
            state,
            expires_in_ms: f.opt_u64("expires_in_ms")?,
        })
    }
}

impl HeartbeatResponse {
    /// Reads the answer to `/v1/heartbeat`.
    pub fn read(body: &[u8]) -> Result<Self, AnswerError> {
        let doc = document(body)?;
        let f = Fields::of(&doc, "the heartbeat answer")?;
        Ok(Self {
            lease_ms: f.u64("lease_ms")?,
        })
    }
}
