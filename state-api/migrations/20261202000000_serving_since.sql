-- The lease guard across a failover. A lease counts as run out only once this server has been
-- the primary for a whole lease. pg_postmaster_start_time() alone is not that: a promoted
-- standby keeps the start time of its postmaster, which may be days old, so right after a
-- failover longer than the lease every in_progress record would look abandoned while its owner
-- is alive and about to heartbeat. Each promotion starts a new WAL timeline: the state API
-- records when it first saw each timeline (on every new connection, and here), and the guard is
-- the later of the two.
CREATE TABLE idempotency_timelines (
    timeline_id   bigint PRIMARY KEY,
    first_seen_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The timeline this primary writes WAL on (errors on a standby, which cannot write anyway).
CREATE FUNCTION idempotency_current_timeline() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint
$$;

-- Since when this server has been the primary, as far as a lease is concerned. A timeline not
-- recorded yet counts as beginning now: no lease runs out on it until it is recorded.
CREATE FUNCTION idempotency_serving_since() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$
    SELECT GREATEST(
        pg_postmaster_start_time(),
        COALESCE(
            (SELECT first_seen_at FROM idempotency_timelines
             WHERE timeline_id = idempotency_current_timeline()),
            clock_timestamp()))
$$;

INSERT INTO idempotency_timelines (timeline_id) VALUES (idempotency_current_timeline())
ON CONFLICT DO NOTHING;
