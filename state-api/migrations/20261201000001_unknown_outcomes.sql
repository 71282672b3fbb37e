-- A record whose request was forwarded and whose outcome was never stored is `unknown`: its
-- owner said it lost sight of the request (/v1/unknown), or its lease ran out. It is never
-- reclaimed silently: a claim takes it over only when it asks to (to reconcile with the
-- upstream, or on a route that re-runs), and always with a new, larger fencing token.
ALTER TABLE idempotency_records DROP CONSTRAINT idempotency_records_state_check;
ALTER TABLE idempotency_records
    ADD CONSTRAINT idempotency_records_state_check
    CHECK (state IN ('in_progress', 'completed', 'unknown'));
ALTER TABLE idempotency_records DROP CONSTRAINT completed_has_response;
ALTER TABLE idempotency_records ADD CONSTRAINT completed_has_response CHECK (
    (state IN ('in_progress', 'unknown') AND completed_at IS NULL AND response_status IS NULL
        AND response_headers IS NULL AND response_body IS NULL AND response_replayable IS NULL)
    OR
    (state = 'completed' AND completed_at IS NOT NULL AND response_status IS NOT NULL
        AND response_headers IS NOT NULL AND response_body IS NOT NULL AND response_replayable IS NOT NULL)
);
-- Set once an attempt's outcome was unknown: a later owner that releases the key (its own
-- attempt never reached the upstream) gives it back as unknown, not as free, since the earlier
-- attempt's outcome is still unknown.
ALTER TABLE idempotency_records ADD COLUMN unknown_before boolean NOT NULL DEFAULT false;
