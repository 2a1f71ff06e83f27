-- Nothing is callable by PUBLIC; dflash_user gets what a user needs, dflash_worker what the
-- worker's queue consumer needs. Grant the roles to people: GRANT dflash_user TO alice;

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON FUNCTION dflash_generate(text, int, float8, int, float8, int, bigint, boolean),
                       dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean),
                       dflash_generate(text[], int, float8, int, float8, int, bigint, boolean),
                       dflash_generate_block(text, int),
                       dflash_embed(text), dflash_embed(text[]),
                       dflash_recall(text, int),
                       dflash_worker_status()
    FROM PUBLIC;

GRANT EXECUTE ON FUNCTION dflash_generate(text, int, float8, int, float8, int, bigint, boolean),
                          dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean),
                          dflash_generate(text[], int, float8, int, float8, int, bigint, boolean),
                          dflash_generate_block(text, int),
                          dflash_embed(text), dflash_embed(text[]),
                          dflash_recall(text, int),
                          dflash_worker_status(),
                          dflash.enable_generation(regclass, name, name, jsonb),
                          dflash.disable_generation(regclass)
    TO dflash_user;
GRANT EXECUTE ON FUNCTION dflash.record_generation(text, text, jsonb, jsonb, float8, float8, regclass, name)
    TO dflash_user, dflash_worker;
GRANT USAGE ON SCHEMA dflash TO dflash_user, dflash_worker;
GRANT SELECT ON dflash.config, dflash.acceptance_daily TO dflash_user, dflash_worker;
-- The synchronous path records rows in the caller's transaction, as the caller.
GRANT SELECT, INSERT ON dflash.generations, dflash.memory TO dflash_user;
GRANT USAGE ON SEQUENCE dflash.generations_id_seq, dflash.memory_id_seq TO dflash_user, dflash_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON dflash.generation_targets TO dflash_user;
GRANT SELECT ON dflash.queue, dflash.queue_failed TO dflash_user;
-- The worker takes queue items, writes results, retries or gives up.
GRANT SELECT ON dflash.generation_targets TO dflash_worker;
GRANT SELECT, UPDATE, DELETE ON dflash.queue TO dflash_worker;
GRANT SELECT, INSERT ON dflash.queue_failed, dflash.generations, dflash.memory TO dflash_worker;
