-- Issue 46, finding 2: an abandon and its claim in flight both committed. The claim read the
-- tombstone (`idempotency_abandoned`) in its statement's snapshot, taken before the abandon
-- committed, and the abandon could not see the claim's uncommitted insert: a record in progress
-- under a nonce nobody owned, beside a tombstone that protected nothing.
--
-- Now one row per nonce, whoever writes it first: every claim statement that inserts or takes
-- over a record under a nonce first upserts (nonce, 'claimed') and writes the record only if
-- that row came back (`ON CONFLICT DO UPDATE ... WHERE kind = 'claimed'`: a committed
-- 'abandoned' row returns nothing), in the same statement; the abandon upserts
-- (nonce, 'abandoned') and then, in the same transaction, gives back the record made under it.
-- The unique index makes the second writer wait for the first one's commit, and
-- `ON CONFLICT DO UPDATE` then sees the committed row, whatever its statement's snapshot. The
-- tombstones already there keep their meaning ('abandoned').
ALTER TABLE idempotency_abandoned RENAME TO idempotency_nonces;
ALTER INDEX idempotency_abandoned_pkey RENAME TO idempotency_nonces_pkey;
ALTER TABLE idempotency_nonces RENAME COLUMN abandoned_at TO noted_at;
-- The purge's lookup (rows older than ten minutes, oldest first).
ALTER INDEX idempotency_abandoned_at RENAME TO idempotency_nonces_noted_at;
ALTER TABLE idempotency_nonces ADD COLUMN kind text NOT NULL DEFAULT 'abandoned';
ALTER TABLE idempotency_nonces ALTER COLUMN kind DROP DEFAULT;
