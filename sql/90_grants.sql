-- Nothing is callable by PUBLIC; dflash_user gets what a member needs, dflash_admin what an
-- administrator of dflash's data needs, dflash_worker what the queue consumer needs. Which
-- rows each may touch is up to the policies in 15_policies.sql. Grant the roles to people:
-- GRANT dflash_user TO alice;  The README's security section has the whole matrix.

REVOKE ALL ON SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.dflash_generate(text, int, float8, int, float8, int, bigint, boolean, boolean, jsonb, text, text[]),
                       @extschema@.dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean, boolean, jsonb, text, text[]),
                       @extschema@.dflash_generate(text[], int, float8, int, float8, int, bigint, boolean, boolean, jsonb, text, text[]),
                       @extschema@.dflash_generate_json(text, jsonb, int, float8, int, float8, int, bigint, boolean,
                                                        boolean),
                       @extschema@.dflash_classify(text, text[], int, float8, int, float8, int, bigint, boolean,
                                                   boolean),
                       @extschema@.dflash_generate_block(text, int),
                       @extschema@.dflash_embed(text), @extschema@.dflash_embed(text[]),
                       @extschema@.dflash_recall(text, int, boolean),
                       @extschema@.dflash_worker_status()
    FROM PUBLIC;
REVOKE ALL ON FUNCTION dflash.reload_drafter(text) FROM PUBLIC;

GRANT USAGE ON SCHEMA dflash TO dflash_user, dflash_worker;

-- Members: the SQL API, generation on their own tables, their own rows.
GRANT EXECUTE ON FUNCTION @extschema@.dflash_generate(text, int, float8, int, float8, int, bigint, boolean, boolean, jsonb, text, text[]),
                          @extschema@.dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean, boolean, jsonb, text, text[]),
                          @extschema@.dflash_generate(text[], int, float8, int, float8, int, bigint, boolean, boolean, jsonb, text, text[]),
                          @extschema@.dflash_generate_json(text, jsonb, int, float8, int, float8, int, bigint,
                                                           boolean, boolean),
                          @extschema@.dflash_classify(text, text[], int, float8, int, float8, int, bigint, boolean,
                                                      boolean),
                          @extschema@.dflash_generate_block(text, int),
                          @extschema@.dflash_embed(text), @extschema@.dflash_embed(text[]),
                          @extschema@.dflash_recall(text, int, boolean),
                          @extschema@.dflash_worker_status(),
                          dflash._recall(vector, int, boolean),
                          dflash.record_generation(text, text, jsonb, jsonb, float8, float8, regclass, name),
                          dflash.enable_generation(regclass, name, name, jsonb),
                          dflash.disable_generation(regclass),
                          dflash._owned_table(text, regclass),
                          dflash._drop_trigger(regclass),
                          dflash._make_trigger(regclass),
                          dflash._primary_key(regclass),
                          dflash._make_writer(regclass),
                          dflash._check_options(jsonb),
                          dflash._enqueue(),
                          dflash._generate_row(),
                          dflash.workload_prior(regclass, name),
                          dflash.workload_history(regclass, name, int),
                          dflash._block_policy()
    TO dflash_user;
GRANT SELECT ON dflash.block_policy TO dflash_user;
GRANT SELECT ON dflash.config, dflash.acceptance_daily TO dflash_user;
-- The synchronous path records rows in the caller's transaction, as the caller.
GRANT SELECT, INSERT ON dflash.generations TO dflash_user;
GRANT SELECT, INSERT, DELETE ON dflash.memory TO dflash_user;
GRANT USAGE ON SEQUENCE dflash.generations_id_seq, dflash.memory_id_seq, dflash.queue_id_seq,
                        dflash.generation_targets_writer_id_seq TO dflash_user;
-- The queueing trigger runs as the inserting member; the other columns take their defaults.
GRANT SELECT, DELETE ON dflash.queue TO dflash_user;
GRANT INSERT (tbl, key_value, prompt) ON dflash.queue TO dflash_user;
GRANT SELECT ON dflash.queue_failed TO dflash_user;
GRANT SELECT, INSERT, UPDATE, DELETE ON dflash.generation_targets TO dflash_user;

-- Admins (also members): every row; they mark memory rows shared.
GRANT SELECT, UPDATE, DELETE ON dflash.generations, dflash.memory, dflash.queue, dflash.queue_failed,
                                dflash.generation_targets TO dflash_admin;

-- The worker takes queue items, writes results through each table's writer (granted to it
-- by dflash._make_writer), records the generations, retries or gives up.
GRANT EXECUTE ON FUNCTION dflash.record_generation(text, text, jsonb, jsonb, float8, float8, regclass, name)
    TO dflash_worker;
GRANT SELECT ON dflash.config, dflash.generation_targets TO dflash_worker;
GRANT EXECUTE ON FUNCTION dflash._writer_name(regclass) TO dflash_worker;
GRANT SELECT, UPDATE, DELETE ON dflash.queue TO dflash_worker;
GRANT INSERT ON dflash.queue_failed, dflash.generations, dflash.memory TO dflash_worker;
GRANT USAGE ON SEQUENCE dflash.generations_id_seq, dflash.memory_id_seq TO dflash_worker;
-- Block length auto's prior for a table's rows: the counts, never the prompts or outputs.
GRANT EXECUTE ON FUNCTION dflash.workload_prior(regclass, name) TO dflash_worker;
-- The suffix proposer's memory of a table's rows: one role's past outputs as token ids (the
-- worker generated them; it reads them back per role, never to answer another member).
GRANT EXECUTE ON FUNCTION dflash.workload_history(regclass, name, int) TO dflash_worker;
GRANT SELECT (id, status, drafter, steps, accepted_per_position, judged_per_position, source_table, calling_role,
              output_ids, proposers)
    ON dflash.generations TO dflash_worker;

-- Learning from the workload (50_drafter_versions.sql). Members consent for their own direct
-- calls; admins manage consent, read the drafter versions and make the worker load one; the
-- trainer reads the consented rows (through dflash.training_rows only) and records its runs.
GRANT SELECT, INSERT, DELETE ON dflash.training_consent TO dflash_user;
GRANT UPDATE ON dflash.training_consent TO dflash_admin;
GRANT SELECT, DELETE ON dflash.drafter_versions TO dflash_admin;
GRANT EXECUTE ON FUNCTION dflash.reload_drafter(text) TO dflash_admin;
GRANT USAGE ON SCHEMA dflash TO dflash_trainer;
GRANT SELECT ON dflash.training_rows, dflash.drafter_versions TO dflash_trainer;
GRANT INSERT ON dflash.drafter_versions TO dflash_trainer;
GRANT USAGE ON SEQUENCE dflash.drafter_versions_id_seq TO dflash_trainer;
