-- A namespace (part of the scope hash; kept here to list records by it), and each record's own
-- retention (a route's, capped by the state API's maximum), used again when it completes.
ALTER TABLE idempotency_records ADD COLUMN namespace text NOT NULL DEFAULT '';
ALTER TABLE idempotency_records ADD COLUMN retention_ms bigint;

-- Every operator action, in the transaction of the action: who, when, why, and the record
-- before and after (never its body). Append-only: updates and deletes are refused.
CREATE TABLE idempotency_audit (
    id          bigserial PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor       text NOT NULL CHECK (length(actor) > 0),
    action      text NOT NULL CHECK (action IN ('release', 'resolve', 'purge')),
    reason      text NOT NULL CHECK (length(reason) > 0),
    forced      boolean NOT NULL DEFAULT false,
    scope_hash  bytea NOT NULL,
    namespace   text NOT NULL,
    subject     text NOT NULL,
    endpoint    text NOT NULL,
    before      jsonb,
    after       jsonb
);
CREATE INDEX idempotency_audit_by_scope ON idempotency_audit (scope_hash, id);

CREATE FUNCTION idempotency_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'idempotency_audit is append-only';
END
$$;
CREATE TRIGGER idempotency_audit_append_only
    BEFORE UPDATE OR DELETE OR TRUNCATE ON idempotency_audit
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency_audit_append_only();
