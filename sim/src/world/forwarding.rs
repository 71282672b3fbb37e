//! A forwarded request at the model upstream ([`crate::upstream`]): it arrives (or is refused for
//! its fencing token), executes, commits and answers part by part; and the upstream's reconcile
//! endpoint, asked through Envoy.

use super::callouts::Callout;
use super::faults::Faults;
use super::{problem_type, World};
use crate::upstream::{Ending, Execution, Plan, Produced};
use contract::wire::FENCING_TOKEN_HEADER;
use filter_core::outcome::flags;
use filter_core::worker::CalloutResult;

/// Bytes standing for a gzip body (only their identity matters here).
pub(super) fn gzipish(body: &[u8]) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 0x08, 0x00];
    out.extend(body.iter().map(|b| b ^ 0x5a));
    out
}

impl World {
    /// The request reaches the upstream, which executes it (or refuses a fenced token).
    pub(super) fn arrive(&mut self, s: usize) {
        self.streams[s].in_transit = false;
        let st = &self.streams[s];
        let op = &self.ops[st.op];
        let scope = op.scope();
        let token = st
            .headers
            .iter()
            .find(|(n, _)| n == FENCING_TOKEN_HEADER)
            .and_then(|(_, v)| v.parse::<i64>().ok());
        let key_sent = st
            .headers
            .iter()
            .find(|(n, _)| n == "idempotency-key")
            .map(|(_, v)| v.clone());
        let request = st.request.clone();
        let st_headers = st.headers.clone();
        let protected = self.cfg.route_index("POST", &request.path).is_some();
        // The reference records an attempt of a key before it runs it (a careful upstream
        // knows the key, from the header or the body), and refuses a stale token.
        let key = (protected && !scope.0.is_empty()).then_some(scope.0.as_str());
        let forwarded = |name: &str| {
            st_headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        let named = crate::upstream::RequestNamed {
            endpoint: &scope.2,
            subject: &scope.1,
            endpoint_header: forwarded(contract::wire::ENDPOINT_HEADER),
            fingerprint: forwarded(contract::wire::FINGERPRINT_HEADER),
        };
        if let (true, Some(t)) = (protected, token) {
            // One claim, one request upstream: whatever the upstream does with a second one
            // (the reference refuses a token it saw running, and runs one whose try failed
            // again), an upstream that does not know the key would run it twice.
            let earlier = self.ev.arrivals.entry(t).or_default();
            if !earlier.is_empty() {
                let line = format!(
                    "1: stream {s}'s request reached the upstream again under token {t} (it arrived before from stream(s) {earlier:?})"
                );
                earlier.push(s);
                self.found(vec![line]);
            } else {
                earlier.push(s);
            }
        }
        let (attempt, arrival) = self.upstream.start(named, key, token);
        if let crate::upstream::Arrival::Answered(answer) = arrival {
            self.log(format!(
                "stream {s}: the upstream runs nothing for token {token:?} and answers {} {}",
                answer.status,
                problem_type(&answer.body)
            ));
            self.upstream
                .refused
                .push((scope.clone(), request.clone(), answer.clone()));
            let mut hs = vec![(":status".to_owned(), answer.status.to_string())];
            hs.extend(answer.headers.iter().cloned());
            self.streams[s].refused_by_upstream = true;
            self.reach(if problem_type(&answer.body).contains("stale") {
                "sim.upstream_refused_stale_token"
            } else {
                "sim.upstream_answered_without_running"
            });
            if self.streams[s].ended {
                return;
            }
            let end = answer.body.is_empty();
            self.response_headers(s, answer.clone(), &hs, "via_upstream", 0, end);
            if !end && !self.streams[s].ended {
                self.response_body(s, answer.body, true);
            }
            return;
        }
        let plan = self.plan_response();
        let index = self.upstream.executions.len();
        self.log(format!(
            "stream {s}: forwarded, upstream executes (token {token:?}, key {key_sent:?}); it will answer {} with {} body bytes{}",
            plan.response.status,
            plan.response.body.len(),
            match plan.ending {
                Ending::WithLastChunk => String::new(),
                ref e => format!(", {e:?}"),
            }
        ));
        if protected {
            let found = self.invariants.execution(self, &scope, token, s);
            self.found(found);
        } else {
            let headers = self.streams[s].headers.clone();
            let found = self.invariants.unprotected(self, &headers, s);
            self.found(found);
        }
        self.upstream.executions.push(Execution {
            scope,
            token,
            request,
            plan,
            at: self.now,
            stream: s,
            finished: false,
            attempt,
            charged: false,
        });
        self.streams[s].forwarded = Some(index);
    }

    /// Execution `e` commits at the upstream (by the reference's rules): a charge, checked.
    pub(super) fn commit(&mut self, e: usize) {
        match self.upstream.commit(e) {
            crate::upstream::Commit::Charged => {
                let found = self.invariants.charge(self, e);
                self.found(found);
            }
            crate::upstream::Commit::Answered => {
                let x = &self.upstream.executions[e];
                let line = format!(
                    "the execution of stream {} runs nothing at its commit: the upstream answers {} {}",
                    x.stream,
                    x.plan.response.status,
                    problem_type(&x.plan.response.body)
                );
                self.log(line);
            }
            crate::upstream::Commit::NoEffect | crate::upstream::Commit::Done => {}
        }
    }

    pub(super) fn plan_response(&mut self) -> Plan {
        let faults = self.fault(Faults::UPSTREAM);
        let status = *self.c.pick(&[201u16, 201, 201, 402, 500, 503, 700]);
        let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
        if status == 201 {
            let long = faults && self.c.chance(10);
            let location = if long {
                format!("/charges/{}", "l".repeat(9_000))
            } else {
                format!("/charges/{}", self.upstream.executions.len() + 1)
            };
            headers.push(("location".to_owned(), location));
        }
        headers.push(("set-cookie".to_owned(), "session=1".to_owned()));
        let gzip = self.c.chance(10);
        if gzip {
            headers.push(("content-encoding".to_owned(), "gzip".to_owned()));
            headers.push(("vary".to_owned(), "accept-encoding".to_owned()));
        }
        let body: Vec<u8> = match self.c.weighted(&[6, 2, 1, 1]) {
            0 => format!("{{\"id\":{}}}", self.upstream.executions.len() + 1).into_bytes(),
            1 => Vec::new(),
            // Over the filter's max_stored_body_bytes: stored without its body.
            2 => vec![b'x'; self.setup.max_stored_body_bytes + 20],
            // Under the filter's limit, over a small state API's.
            _ => vec![b'y'; 70],
        };
        let body = if gzip { gzipish(&body) } else { body };
        let len = body.len();
        let chunks = self.chunks_of(len);
        let ending = if faults {
            match self.c.weighted(&[10, 2, 1, 1, 1]) {
                0 => Ending::WithLastChunk,
                1 => Ending::EmptyFrame,
                2 => Ending::Trailers,
                3 => Ending::ResetAfter(self.c.below(chunks.len() as u32 + 1) as usize),
                _ => Ending::StallAfter(self.c.below(chunks.len() as u32 + 1) as usize),
            }
        } else {
            Ending::WithLastChunk
        };
        Plan {
            reset_before_headers: faults && self.c.chance(5),
            response: Produced {
                status,
                headers,
                body,
            },
            chunks,
            ending,
        }
    }

    /// The upstream's next response part reaches Envoy.
    pub(crate) fn upstream_part(&mut self, s: usize) {
        let st = self.streams[s].clone();
        let Some(e) = st.forwarded else { return };
        let w = st.worker;
        if st.ended || self.workers[w].w.is_none() || self.workers[w].generation != st.generation {
            return;
        }
        if st.resp_head.is_none() && !self.upstream.executions[e].plan.reset_before_headers {
            // Its response leaves: it commits now (or answers 409 if a larger token overtook it).
            self.commit(e);
            if !self.violations.is_empty() {
                return;
            }
        }
        let plan = self.upstream.executions[e].plan.clone();
        if st.resp_head.is_none() {
            if plan.reset_before_headers {
                self.log(format!("stream {s}: upstream resets before its response"));
                if self.router_retry(s, "reset") {
                    return;
                }
                self.router_reply(
                    s,
                    503,
                    "upstream_reset_before_response_started{remote_reset}",
                    flags::UPSTREAM_REMOTE_RESET,
                );
                return;
            }
            if plan.response.status >= 500
                && plan.response.status < 600
                && self.router_retry(s, &format!("a {} answer", plan.response.status))
            {
                return;
            }
            let end = plan.chunks.is_empty() && plan.ending == Ending::WithLastChunk;
            let mut hs = vec![(":status".to_owned(), plan.response.status.to_string())];
            hs.extend(plan.response.headers.iter().cloned());
            self.log(format!(
                "stream {s}: response headers {}",
                plan.response.status
            ));
            self.response_headers(s, plan.response.clone(), &hs, "via_upstream", 0, end);
            return;
        }
        let sent = st.resp_chunks_sent;
        match plan.ending {
            Ending::ResetAfter(n) if sent >= n => {
                self.log(format!("stream {s}: upstream resets in the body"));
                self.end_stream(s, false);
                return;
            }
            Ending::StallAfter(n) if sent >= n => {
                // Stalled: only the client giving up ends it. Nothing to send.
                if !self.faults {
                    self.end_stream(s, true);
                }
                return;
            }
            _ => {}
        }
        if sent < plan.chunks.len() {
            let start: usize = plan.chunks[..sent].iter().sum();
            let chunk = &plan.response.body[start..start + plan.chunks[sent]];
            let end = sent + 1 == plan.chunks.len() && plan.ending == Ending::WithLastChunk;
            self.streams[s].resp_chunks_sent += 1;
            self.response_body(s, chunk.to_vec(), end);
        } else {
            self.streams[s].resp_chunks_sent += 1;
            match plan.ending {
                Ending::Trailers => self.response_trailers(s),
                // An empty data frame, or end of stream after a headers-only answer.
                _ => self.response_body(s, Vec::new(), true),
            }
        }
    }

    /// The upstream's reconcile endpoint (through Envoy: down, it is the router's 503).
    pub(super) fn reconcile(&mut self, c: &Callout) -> CalloutResult {
        let header = |name: &str| {
            c.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let (Some(key), Some(subject), Some(token)) = (
            header("idempotency-key"),
            header(contract::wire::SUBJECT_HEADER),
            header(FENCING_TOKEN_HEADER).and_then(|t| t.parse::<i64>().ok()),
        ) else {
            self.violations.push(format!(
                "a reconcile without its key, subject or token: {:?}",
                c.headers
            ));
            return CalloutResult::Failed("bad reconcile".into());
        };
        // The reference's reconcile endpoints; the key is the path's last segment (the subject,
        // token, endpoint and fingerprint come as headers).
        let served = matches!(
            c.path.rsplit_once("/attempts/"),
            Some(("/checkout" | "/shop" | "/donate", k)) if k == key
        );
        if !served {
            self.violations
                .push(format!("a reconcile at {} for key {key}", c.path));
            return CalloutResult::Failed("bad reconcile".into());
        }
        if self.upstream_down {
            return CalloutResult::answer(503, b"upstream connect error".to_vec());
        }
        if self.fault(Faults::UPSTREAM) && self.c.chance(5) {
            // A reconcile endpoint that answers garbage.
            self.reach("sim.reconcile_garbage");
            return CalloutResult::Response {
                status: 200,
                headers: vec![(contract::wire::OUTCOME_HEADER.into(), "perhaps".into())],
                body: b"<html>".to_vec(),
            };
        }
        let (Some(endpoint), Some(fingerprint)) = (
            header(contract::wire::ENDPOINT_HEADER),
            header(contract::wire::FINGERPRINT_HEADER),
        ) else {
            // The reference refuses a reconcile that does not name its request.
            return CalloutResult::answer(400, b"{\"type\":\"/problems/bad-reconcile\"}".to_vec());
        };
        if let Some(answer) =
            self.careless_reconcile(c, &key, &subject, &endpoint, &fingerprint, token)
        {
            return answer;
        }
        let mut a = self.upstream.reconcile(
            crate::upstream::AttemptScope {
                endpoint,
                subject: subject.clone(),
                key: key.clone(),
                fingerprint: Some(fingerprint),
            },
            token,
        );
        // As the reference checkout does, an `executed` answer names the request it describes
        // by its subject and key too (issue 46, finding 6: the fingerprint does not cover the
        // subject).
        let executed = a.headers.iter().any(|(n, v)| {
            n == contract::wire::OUTCOME_HEADER && v == contract::wire::OUTCOME_EXECUTED
        });
        if executed {
            a.headers
                .push((contract::wire::SUBJECT_HEADER.into(), subject));
            a.headers.push(("idempotency-key".into(), key));
        }
        if let Some(s) = c.stream {
            let scope = self.ops[self.streams[s].op].scope();
            if scope.2 != "POST /checkout" {
                self.reach("region: a reconcile on a prefix or key_from route");
            }
            self.ev.reconcile_answers.push((
                scope,
                Produced {
                    status: a.status,
                    headers: a.headers.clone(),
                    body: a.body.clone(),
                },
            ));
        }
        CalloutResult::Response {
            status: a.status,
            headers: a.headers,
            body: a.body,
        }
    }

    /// A careless upstream (issue 46, finding 6), with upstream faults, half the times it can:
    /// it looks an attempt up by key, endpoint and fingerprint, not by subject, and answers with
    /// another subject's execution of an identical request (the fingerprint does not cover the
    /// subject), naming it truthfully: its token, and the subject and key it recorded. The
    /// filter must not store it (it is another customer's charge); with the fix undone it
    /// does, and the check finds a replay no execution of the asker's request produced. No
    /// choice is drawn unless such an execution exists, so other schedules are unchanged.
    fn careless_reconcile(
        &mut self,
        c: &Callout,
        key: &str,
        subject: &str,
        endpoint: &str,
        fingerprint: &str,
        token: i64,
    ) -> Option<CalloutResult> {
        if !self.careless_upstream && !self.fault(Faults::UPSTREAM) {
            return None;
        }
        let other = self.upstream.executions.iter().rev().find(|e| {
            let (k, sub, ep) = &e.scope;
            k == key
                && sub != subject
                && ep == endpoint
                && e.charged
                && e.token.is_some_and(|t| t < token)
                && self.streams[e.stream]
                    .headers
                    .iter()
                    .any(|(n, v)| n == contract::wire::FINGERPRINT_HEADER && v == fingerprint)
        })?;
        let (other_token, other_subject) = (other.token?, other.scope.1.clone());
        let produced = other.plan.response.clone();
        if !self.careless_upstream && !self.c.chance(50) {
            return None;
        }
        self.reach("sim.reconcile_careless");
        self.log(format!(
            "the upstream's reconcile answers carelessly with {other_subject}'s execution (token {other_token})"
        ));
        let mut headers = produced.headers.clone();
        headers.extend([
            (
                contract::wire::OUTCOME_HEADER.into(),
                contract::wire::OUTCOME_EXECUTED.into(),
            ),
            (FENCING_TOKEN_HEADER.into(), other_token.to_string()),
            (contract::wire::ENDPOINT_HEADER.into(), endpoint.to_owned()),
            (
                contract::wire::FINGERPRINT_HEADER.into(),
                fingerprint.to_owned(),
            ),
            (contract::wire::SUBJECT_HEADER.into(), other_subject),
            ("idempotency-key".into(), key.to_owned()),
        ]);
        if let Some(s) = c.stream {
            let scope = self.ops[self.streams[s].op].scope();
            self.ev.reconcile_answers.push((scope, produced.clone()));
        }
        Some(CalloutResult::Response {
            status: produced.status,
            headers,
            body: produced.body,
        })
    }

    /// The upstream goes down, or comes back.
    pub(super) fn toggle_upstream(&mut self) {
        self.upstream_down = !self.upstream_down;
        self.log(format!(
            "upstream {}",
            if self.upstream_down { "down" } else { "up" }
        ));
    }
}
