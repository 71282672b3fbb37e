-- The length of the current lease, so a reclaim can wait until the database server has been up
-- for a whole lease: after an outage longer than the lease, a live owner first gets the time to
-- heartbeat or store its outcome.
ALTER TABLE idempotency_records
    ADD COLUMN lease_ms bigint NOT NULL DEFAULT 30000 CHECK (lease_ms > 0);
