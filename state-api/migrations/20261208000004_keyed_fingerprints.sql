-- Issue 34, path 12: a request's fingerprint is stored keyed (HMAC-SHA256 under a key derived
-- from the key secret, `state_rules::fingerprint`), with the id of that key, so that a copy of
-- the table confirms no guess of a body where few are possible. Rows from before keep their
-- plain SHA-256 and no id, and are compared as such: they keep matching.
ALTER TABLE idempotency_records ADD COLUMN fingerprint_key_id bigint;
