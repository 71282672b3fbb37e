-- Issue 34, path 4: a committed claim whose answer never reached the filter. The claim attempt
-- sends a nonce of its own, kept with the record it makes or takes over; the filter, knowing it
-- forwarded nothing, gives the record back by that nonce (`/v1/abandon`), so the key is usable
-- again at once instead of in progress for a lease and then unknown for its retention. Its form
-- (1 to 64 visible ASCII characters) is checked by the API, as the other fields are.
ALTER TABLE idempotency_records ADD COLUMN claim_nonce text;
