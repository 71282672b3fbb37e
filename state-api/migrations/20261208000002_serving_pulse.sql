-- The lease guard across a database that stopped serving without a crash (issue 34): frozen
-- (SIGSTOP, a paused VM, a storage stall), or cut off from every state API. Its start time, its
-- timeline and the crash marker all stay the same, so every lease that ran out meanwhile
-- counted as run out the moment it answered again, and a route that takes unknown outcomes
-- over took the key from an owner that was alive and could not be heard. Every state API beats
-- this pulse every 250 ms; a beat after a silence of more than a second starts a new serving
-- period, and while the silence lasts (no beat for a second: no state API got through) the
-- database counts as having just come back. UNLOGGED: no WAL, emptied by a crash recovery and
-- empty on a promoted standby, which the guard reads as "just came back" as well.
CREATE UNLOGGED TABLE idempotency_pulse (
    only_row   boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    beat_at    timestamptz NOT NULL,
    resumed_at timestamptz NOT NULL
);

CREATE FUNCTION idempotency_pulse() RETURNS void LANGUAGE sql VOLATILE AS $$
    INSERT INTO idempotency_pulse (beat_at, resumed_at) VALUES (clock_timestamp(), clock_timestamp())
    ON CONFLICT (only_row) DO UPDATE SET
        resumed_at = CASE WHEN idempotency_pulse.beat_at < clock_timestamp() - interval '1 second'
                          THEN clock_timestamp() ELSE idempotency_pulse.resumed_at END,
        beat_at = clock_timestamp();
$$;

-- Since when the database has served without interruption: the latest of its start, its
-- timeline's first sight, the first use after a crash recovery, and the pulse's serving period
-- (now, while no beat has come for a second).
CREATE OR REPLACE FUNCTION idempotency_serving_since() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$
    INSERT INTO idempotency_timelines (timeline_id) VALUES (idempotency_current_timeline())
    ON CONFLICT DO NOTHING;
    INSERT INTO idempotency_serving_marker DEFAULT VALUES ON CONFLICT DO NOTHING;
    SELECT GREATEST(
        pg_postmaster_start_time(),
        (SELECT first_seen_at FROM idempotency_timelines
         WHERE timeline_id = (SELECT idempotency_current_timeline())),
        (SELECT first_used_at FROM idempotency_serving_marker),
        COALESCE(
            (SELECT CASE WHEN beat_at < clock_timestamp() - interval '1 second'
                         THEN clock_timestamp() ELSE resumed_at END
             FROM idempotency_pulse),
            clock_timestamp()));
$$;
