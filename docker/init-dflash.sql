-- Runs once when the database is first initialised.
CREATE EXTENSION IF NOT EXISTS dflash CASCADE;
SELECT dflash.set_config('socket_path', '/run/dflash/worker.sock');
