-- The lease guard looked its timeline up with `timeline_id = idempotency_current_timeline()`: a
-- volatile function in the condition cannot be an index key, so the lookup was a sequential scan,
-- and with the state API's `enable_seqscan = off` its estimate carried the disable cost (1e10),
-- which made Postgres JIT-compile the query on every call (70-170 ms, auto_explain). The state
-- API now turns JIT off for its connections; the lookup also takes the timeline once (an InitPlan)
-- and uses the primary key, for any connection.
CREATE OR REPLACE FUNCTION idempotency_serving_since() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$
    INSERT INTO idempotency_timelines (timeline_id) VALUES (idempotency_current_timeline())
    ON CONFLICT DO NOTHING;
    SELECT GREATEST(
        pg_postmaster_start_time(),
        (SELECT first_seen_at FROM idempotency_timelines
         WHERE timeline_id = (SELECT idempotency_current_timeline())));
$$;
