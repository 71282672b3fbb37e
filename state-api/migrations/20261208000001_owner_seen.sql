-- Issue 34, path 8: an operator action on a record whose owner may still run. The owner's last
-- sign of life (its claim, a heartbeat, its own unknown mark or release) is kept, shown with the
-- record, and an action needs `force` while it lies within a lease. Older rows count from their
-- lease (`lease_expires_at - lease_ms`).
ALTER TABLE idempotency_records ADD COLUMN owner_seen_at timestamptz;
