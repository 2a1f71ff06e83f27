-- Every setting with its value: the default, unless dflash.set_config changed it
-- (dflash.settings, 00_schema.sql). The one place for the defaults. A function file: an
-- upgrade runs it again.
CREATE OR REPLACE VIEW dflash.config AS
SELECT d.key, coalesce(s.value, d.value) AS value
FROM (VALUES
    ('socket_path', '/run/dflash/worker.sock'),  -- the worker's default socket
    ('connect_timeout_ms', '2000'),              -- how long a call waits to get through to the worker
    ('default_timeout_ms', '0'),                 -- 0: only statement_timeout limits a call
    ('remember', 'on'),                          -- store generations in dflash.memory
    ('queue_max_attempts', '5')                  -- tries per queued row before dflash.queue_failed
) AS d (key, value)
LEFT JOIN dflash.settings s ON s.key = d.key;
COMMENT ON VIEW dflash.config IS
    'dflash''s settings: socket_path, connect_timeout_ms, default_timeout_ms, remember, queue_max_attempts '
    '(change one with dflash.set_config; a superuser''s right).';
