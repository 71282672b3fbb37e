-- Issue 34, path 4: an abandon that reaches the state API before its claim does (the claim
-- queued behind a slow database while its filter gave up and sent `/v1/abandon`) finds nothing
-- to give back; the claim would then commit for nobody and hold its key for a lease, then as
-- unknown. The abandon leaves a tombstone instead, and a claim attempt whose nonce is here never
-- inserts or takes a record over. A nonce names one claim attempt (unique per attempt), whatever
-- the key's address. Kept ten minutes (the purge), far longer than any claim waits.
CREATE TABLE idempotency_abandoned (
    nonce        text        PRIMARY KEY,
    scope_hash   bytea       NOT NULL,
    abandoned_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX idempotency_abandoned_at ON idempotency_abandoned (abandoned_at);
