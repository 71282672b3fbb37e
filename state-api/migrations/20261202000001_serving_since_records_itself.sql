-- The lease guard records the primary's timeline itself the first time it is asked, as well as
-- on every new connection (store::register_timeline): a pool connection opened to a standby
-- records nothing, and after that standby's promotion no lease would ever run out on it until a
-- new connection came. Recording at the first check is later than the promotion, so the guard
-- only errs towards waiting longer.
CREATE OR REPLACE FUNCTION idempotency_serving_since() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$
    INSERT INTO idempotency_timelines (timeline_id) VALUES (idempotency_current_timeline())
    ON CONFLICT DO NOTHING;
    SELECT GREATEST(
        pg_postmaster_start_time(),
        (SELECT first_seen_at FROM idempotency_timelines
         WHERE timeline_id = idempotency_current_timeline()));
$$;
