-- Records live for their retention and are then deleted by the purge, and every complete
-- rewrites its row: the table turns over all the time. With the default thresholds (20 % of the
-- table dead) autovacuum waits until a large part of it is garbage, and the table and its
-- indexes grow until it catches up (`make soak`, docs/BENCH.md). Vacuum it after 1 % plus a
-- thousand dead rows instead; the launcher's `autovacuum_naptime` still bounds how often.
ALTER TABLE idempotency_records SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02
);
