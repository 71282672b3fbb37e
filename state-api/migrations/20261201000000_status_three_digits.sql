-- Any three-digit status is stored (contract::limits::STATUS): Envoy passes statuses up to 999
-- through, and a complete refused for its status would leave the key without an outcome.
ALTER TABLE idempotency_records DROP CONSTRAINT idempotency_records_response_status_check;
ALTER TABLE idempotency_records
    ADD CONSTRAINT idempotency_records_response_status_check CHECK (response_status BETWEEN 100 AND 999);
