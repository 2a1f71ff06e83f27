-- What happened: one row per generation, a vector memory, the trigger queue.
-- Every row belongs to a role (`calling_role`, set from current_user: the policies in
-- 15_policies.sql let a member write rows only under their own role and see only those).

CREATE TABLE dflash.generations (
    id              bigserial PRIMARY KEY,
    mode            text NOT NULL CHECK (mode IN ('sync', 'trigger', 'trigger-sync')),
    status          text NOT NULL CHECK (status IN ('ok', 'error')),
    error           text,
    prompt          text NOT NULL,
    output          text,
    target          text,
    drafter         text,
    drafter_version text,         -- the drafter's weights digest, 16 hex digits (dflash.drafter_versions)
    params          jsonb NOT NULL DEFAULT '{}',
    block_size      int,          -- the fixed block size; NULL for block length auto (see verify_lengths)
    steps           int,
    new_tokens      int,
    tau             float8,
    acceptance_rate float8,
    accepted_per_position int[],  -- steps whose draft at position i was kept
    judged_per_position int[],    -- steps that verified position i with every earlier draft kept
    block_policy    text CHECK (block_policy IN ('auto', 'fixed')),
    verify_lengths  jsonb,        -- {"L": steps}: how often each verify length was chosen
    prefill_ms      float8,
    decode_ms       float8,
    queue_ms        float8,
    total_ms        float8,
    tokens_per_s    float8,
    output_ids      int[],        -- the answer as the target's token ids (drafter training reads them)
    calling_role    name NOT NULL DEFAULT current_user,
    source_table    regclass,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    proposers       jsonb,        -- {"dflash": {"steps", "drafted", "accepted"}, "suffix": {...}}: who drafted what
    backend         text,         -- what computed it: the worker's target backend ("hf", ...) or remote engine
    forced_tokens   int,          -- tokens a json_schema / regex / choices grammar forced, drafted as such and kept
    truncated       boolean       -- with a constraint: cut short of a whole answer (NULL: no constraint)
);
CREATE INDEX generations_created_at ON dflash.generations (created_at);
CREATE INDEX generations_calling_role ON dflash.generations (calling_role);
-- A workload's recent generations (dflash.workload_prior): by table, or a role's direct calls.
CREATE INDEX generations_workload ON dflash.generations (source_table, calling_role, id);

CREATE TABLE dflash.memory (
    id            bigserial PRIMARY KEY,
    generation_id bigint REFERENCES dflash.generations (id) ON DELETE CASCADE,
    prompt        text NOT NULL,
    output        text NOT NULL,
    embedding     vector(384) NOT NULL,
    embedder      text,
    calling_role  name NOT NULL DEFAULT current_user,
    shared        boolean NOT NULL DEFAULT false,  -- set by dflash_admin: recalled by every member
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX memory_embedding_hnsw ON dflash.memory USING hnsw (embedding vector_cosine_ops);

-- Tables with generate-on-insert enabled (by their owners). The row stays when generation
-- is disabled (enabled = false), so rows already queued are still filled.
CREATE TABLE dflash.generation_targets (
    tbl                regclass PRIMARY KEY,
    prompt_column      name NOT NULL,
    output_column      name NOT NULL,
    key_column         name NOT NULL,
    mode               text NOT NULL CHECK (mode IN ('async', 'sync')),
    options            jsonb NOT NULL DEFAULT '{}',
    enabled            boolean NOT NULL DEFAULT true,
    share_for_training boolean NOT NULL DEFAULT false,  -- the owner lets this table's rows train drafters
    created_at         timestamptz NOT NULL DEFAULT now(),
    -- Names the table's writer, dflash.write_<writer_id>: unlike the table's OID it survives
    -- pg_dump and restore (40_triggers.sql).
    writer_id          bigserial NOT NULL UNIQUE
);

-- One item per inserted row: the key and prompt as text (read by the inserting role),
-- the generation options come from generation_targets when the item is worked on.
CREATE TABLE dflash.queue (
    id              bigserial PRIMARY KEY,
    tbl             regclass NOT NULL,
    key_value       text NOT NULL,
    prompt          text,
    calling_role    name NOT NULL DEFAULT current_user,
    attempts        int NOT NULL DEFAULT 0,   -- counted when an attempt starts, so a killed one counts
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX queue_next_attempt ON dflash.queue (next_attempt_at, id);

CREATE TABLE dflash.queue_failed (
    id           bigint PRIMARY KEY,
    tbl          regclass NOT NULL,
    key_value    text NOT NULL,
    prompt       text,
    options      jsonb NOT NULL,
    calling_role name NOT NULL,
    attempts     int NOT NULL,
    error        text,
    created_at   timestamptz NOT NULL,
    failed_at    timestamptz NOT NULL DEFAULT now()
);
