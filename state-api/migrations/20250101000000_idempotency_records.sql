-- One record per (key, subject, endpoint), addressed by an HMAC of the three: the raw key is
-- never stored, so a copy of this table does not reveal keys and tenants cannot collide.

-- Fencing tokens for every claim and reclaim of any key: strictly increasing across keys and
-- across purges, so a token is never reused even when a key is deleted and claimed again.
CREATE SEQUENCE idempotency_fencing_token_seq AS bigint START WITH 1 NO CYCLE;

CREATE TABLE idempotency_records (
    -- HMAC-SHA256(key_secret, len|key|len|subject|len|endpoint)
    scope_hash          bytea       PRIMARY KEY CHECK (octet_length(scope_hash) = 32),
    -- Plain text for operators (the key itself is not stored).
    subject             text        NOT NULL CHECK (subject <> ''),
    endpoint            text        NOT NULL CHECK (endpoint <> ''),
    fingerprint_alg     text        NOT NULL CHECK (fingerprint_alg <> ''),
    fingerprint         text        NOT NULL CHECK (fingerprint ~ '^[0-9a-f]{64}$'),
    state               text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    fencing_token       bigint      NOT NULL,
    lease_expires_at    timestamptz NOT NULL,
    created_at          timestamptz NOT NULL,
    completed_at        timestamptz,
    -- Retention expiry: after it the key is treated as new and the purge deletes the row
    -- (an in_progress row only once its lease has run out too).
    expires_at          timestamptz NOT NULL,
    response_status     integer     CHECK (response_status BETWEEN 100 AND 599),
    -- [[name, value], ...] in the order received.
    response_headers    jsonb,
    response_body       bytea,
    response_replayable boolean,
    CONSTRAINT completed_has_response CHECK (
        (state = 'in_progress' AND completed_at IS NULL AND response_status IS NULL
            AND response_headers IS NULL AND response_body IS NULL AND response_replayable IS NULL)
        OR
        (state = 'completed' AND completed_at IS NOT NULL AND response_status IS NOT NULL
            AND response_headers IS NOT NULL AND response_body IS NOT NULL AND response_replayable IS NOT NULL)
    )
);

-- The purge scans by expiry.
CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);
