-- The storage key that sealed a completed record's headers and body (AES-256-GCM, see
-- state-api/src/sealing.rs); NULL: stored in clear (no storage key configured).
ALTER TABLE idempotency_records ADD COLUMN response_key_id bigint;
