-- Postgres checks each CHECK constraint of a row it writes, and prepares the constraints again
-- for every statement (ExecConstraints: 14 % of Postgres's CPU at 16 connections, perf). These
-- repeat checks the state API makes before any write (http.rs: check_text, check_fingerprint,
-- checked_response; Config::lease_for; the scope hash is a [u8; 32]), and nothing else writes
-- the table. Kept: the state list and `completed_has_response`, which hold the state machine's
-- invariants (a completed record has its response, an open one has none) that no single
-- request's validation can see.
ALTER TABLE idempotency_records
    DROP CONSTRAINT idempotency_records_scope_hash_check,
    DROP CONSTRAINT idempotency_records_subject_check,
    DROP CONSTRAINT idempotency_records_endpoint_check,
    DROP CONSTRAINT idempotency_records_fingerprint_alg_check,
    DROP CONSTRAINT idempotency_records_fingerprint_check,
    DROP CONSTRAINT idempotency_records_response_status_check,
    DROP CONSTRAINT idempotency_records_lease_ms_check;
