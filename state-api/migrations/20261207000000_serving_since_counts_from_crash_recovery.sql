-- The lease guard across a crash recovery in place (issue 34). When a backend dies (an OOM
-- kill, a segfault), the postmaster stops every backend and replays the WAL without
-- restarting: neither pg_postmaster_start_time() nor the timeline changes, so every lease that
-- ran out during the recovery counted as run out the moment the database answered again, and a
-- route that takes unknown outcomes over took the key from an owner that was alive and about to
-- heartbeat. An UNLOGGED table is emptied by every crash recovery (and is empty on a promoted
-- standby, and after any unclean stop): it holds when this server was first asked after the
-- last of them, and the guard counts from the latest of the three.
CREATE UNLOGGED TABLE idempotency_serving_marker (
    only_row      boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    first_used_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Filled at the first check after a recovery, which is later than the recovery: the guard only
-- errs towards waiting longer, as for the timelines.
CREATE OR REPLACE FUNCTION idempotency_serving_since() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$
    INSERT INTO idempotency_timelines (timeline_id) VALUES (idempotency_current_timeline())
    ON CONFLICT DO NOTHING;
    INSERT INTO idempotency_serving_marker DEFAULT VALUES ON CONFLICT DO NOTHING;
    SELECT GREATEST(
        pg_postmaster_start_time(),
        (SELECT first_seen_at FROM idempotency_timelines
         WHERE timeline_id = (SELECT idempotency_current_timeline())),
        (SELECT first_used_at FROM idempotency_serving_marker));
$$;

INSERT INTO idempotency_serving_marker DEFAULT VALUES ON CONFLICT DO NOTHING;
