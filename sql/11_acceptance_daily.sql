-- Acceptance and latency by model, block size and day, over the rows the reader may see.
-- tau is pooled as dflash.engine.stats.pooled_tau pools it (the one definition): accepted
-- drafts plus one token per step, over the steps, summed over the day's generations, so a
-- long generation weighs by its steps (a mean of each row's tau would weigh a 3-step answer
-- as much as a 300-step one). A row's accepted + steps is its tau * steps, an integer (rounded
-- back from the float8 tau); rows without steps (no tau) add nothing to either sum.
-- CREATE OR REPLACE: the upgrade from 0.2.0, whose view averaged tau, runs this file too
-- (extension/Makefile); the columns are 0.2.0's, so the view is replaced in place.
CREATE OR REPLACE VIEW dflash.acceptance_daily WITH (security_invoker = true) AS
SELECT date_trunc('day', created_at)::date AS day,
       target,
       drafter,
       block_size,
       count(*)                                   AS generations,
       sum(new_tokens)                            AS new_tokens,
       sum(round(tau * steps)) / nullif(sum(steps) FILTER (WHERE tau IS NOT NULL), 0) AS mean_tau,
       avg(acceptance_rate)                       AS mean_acceptance_rate,
       percentile_cont(0.5)  WITHIN GROUP (ORDER BY total_ms) AS p50_ms,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY total_ms) AS p95_ms,
       sum(new_tokens) / nullif(sum(decode_ms) / 1000.0, 0)   AS tokens_per_s
FROM dflash.generations
WHERE status = 'ok'
GROUP BY 1, 2, 3, 4;
