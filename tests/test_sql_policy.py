"""Block length auto from SQL: workload priors pooled from dflash.generations, and the
dflash.block_policy view that explains them. A workload whose drafts are never kept starts
its next call with plain steps; one whose drafts are always kept starts at the full block."""

import psycopg
import pytest
import torch

from tests.conftest import cpu_like_costs, make_tiny_target, tiny_drafter_config


@pytest.fixture(scope="module")
def copy_text_engine(smol_dir):
    """SmolLM2's tokenizer over a tiny target and drafter that always agree (both final norms
    zero: every logit 0, so both always pick token 0): every draft is kept."""
    from transformers import AutoTokenizer

    from dflash.engine.drafter import init_random_drafter
    from dflash.engine.engine import Engine

    vocab = 49152
    target = make_tiny_target(vocab=vocab, context=512, seed=3)
    target.tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    target.eos_ids = [2]
    drafter = init_random_drafter(tiny_drafter_config(vocab=vocab), seed=2, std=0.3)
    with torch.no_grad():
        target.model.model.norm.weight.zero_()
        drafter.norm.weight.zero_()
    return Engine(target, drafter, "copy-drafter", cost_curve=cpu_like_costs())


@pytest.fixture
def member(pg_dsn, sql_worker, request):
    """A fresh member role (so its direct calls are a workload of their own), connected."""
    role = f"pol_{request.node.name[-40:].lower().replace('[', '_').replace(']', '')}"[:60]
    with psycopg.connect(pg_dsn, autocommit=True) as su:
        su.execute(f"DROP ROLE IF EXISTS {role}")
        su.execute(f"CREATE ROLE {role} LOGIN IN ROLE dflash_user")
    with psycopg.connect(pg_dsn + f" user={role}", autocommit=True) as conn:
        yield role, conn


def _first_step_length(conn) -> int:
    """The drafter's first step under the workload's prior (proposals off: the suffix
    proposer, which drafts from the workload's outputs, is not what these tests are about)."""
    stats = conn.execute("SELECT dflash_generate_stats('Tell me about tables.', max_new_tokens => 24,"
                         " proposals => false)").fetchone()[0]
    assert stats["block_policy"] == "auto"
    return len(stats["steps"][0]["draft_ids"]) + 1


def _policy_row(conn, role):
    return conn.execute("SELECT generations, acceptance, expected_tau, tokens_per_s, relative_cost, start_block_size"
                        " FROM dflash.block_policy WHERE calling_role = %s", (role,)).fetchone()


def test_a_workload_whose_drafts_are_never_kept_starts_plain(member, tiny_text_engine):
    role, conn = member
    for i in range(20):
        conn.execute("SELECT dflash_generate(%s, max_new_tokens => 24, block_size => 4)", (f"Question {i}?",))
    prior = conn.execute("SELECT dflash.workload_prior(NULL)").fetchone()[0]
    assert prior["generations"] == 20 and sum(prior["accepted"]) <= 2  # a random drafter: ~never kept
    assert len(prior["judged"]) == 3 and prior["judged"][0] > 100
    n, acceptance, tau, tps, cost, start = _policy_row(conn, role)
    assert n == 20 and start == 1
    assert len(tau) == tiny_text_engine.block_size and tau[0] == 1.0 and acceptance[0] < 0.05
    assert cost[0] == 1.0 and tps[0] == max(tps)  # plain steps pay best
    assert _first_step_length(conn) == 1


def test_a_workload_whose_drafts_are_always_kept_starts_at_the_full_block(member, pg_dsn, pg_server, sql_worker,
                                                                           copy_text_engine):
    from dflash.serve.server import Worker

    role, conn = member
    worker = Worker(copy_text_engine, None, socket_path=str(sql_worker.socket_path.parent / "copy.sock"),
                    socket_group=sql_worker.socket_group)
    worker.start()
    with psycopg.connect(pg_dsn, autocommit=True) as su:
        old = su.execute("SELECT value FROM dflash.config WHERE key = 'socket_path'").fetchone()[0]
        su.execute("SELECT dflash.set_config('socket_path', %s)", (pg_server.server_path(worker.socket_path),))
        su.execute("SELECT dflash.set_config('remember', 'off')")
        try:
            for i in range(20):
                conn.execute("SELECT dflash_generate(%s, max_new_tokens => 24, block_size => 8)", (f"Question {i}?",))
            n, acceptance, tau, tps, cost, start = _policy_row(conn, role)
            assert n == 20 and start == copy_text_engine.block_size
            assert min(acceptance) > 0.9 and tau[-1] > 7
            assert _first_step_length(conn) == copy_text_engine.block_size
        finally:
            su.execute("SELECT dflash.set_config('socket_path', %s)", (old,))
            su.execute("SELECT dflash.set_config('remember', 'on')")
            worker.shutdown(timeout=10)


def test_priors_are_per_workload_and_per_member(member, pg_dsn):
    role, conn = member
    conn.execute("SELECT dflash_generate('Hello', max_new_tokens => 6, block_size => 2)")
    mine = conn.execute("SELECT dflash.workload_prior(NULL)").fetchone()[0]
    assert mine["generations"] == 1
    with psycopg.connect(pg_dsn, autocommit=True) as su:
        # The superuser's own direct calls are another workload.
        theirs = su.execute("SELECT dflash.workload_prior(NULL)").fetchone()[0]
        assert su.execute("SELECT dflash.workload_prior(NULL, %s)", (role,)).fetchone()[0] == mine
    assert theirs != mine
    # A member pools only rows they may see: asking for another role's workload gives nothing.
    assert conn.execute("SELECT dflash.workload_prior(NULL, 'postgres')").fetchone()[0]["generations"] == 0
    assert {r[0] for r in conn.execute("SELECT calling_role FROM dflash.block_policy")} == {role}


def test_a_seeded_sample_ignores_the_prior_and_bad_priors_are_refused(member, sql_worker):
    from dflash.serve.client import Client, WorkerError

    role, conn = member
    a = conn.execute("SELECT dflash_generate('Hi', max_new_tokens => 12, temperature => 0.8, seed => 5)").fetchone()[0]
    for i in range(3):
        conn.execute("SELECT dflash_generate(%s, max_new_tokens => 12)", (f"q{i}",))
    b = conn.execute("SELECT dflash_generate('Hi', max_new_tokens => 12, temperature => 0.8, seed => 5)").fetchone()[0]
    assert a == b
    with Client(str(sql_worker.socket_path)) as c:
        with pytest.raises(WorkerError) as err:
            c.call("generate", {"prompt": "Hi", "prior": {"accepted": [-1], "judged": [1]}})
        assert err.value.code == "bad_prior"
        with pytest.raises(WorkerError) as err:
            c.call("explain_policy", {"prior": "nope"})
        assert err.value.code == "bad_prior"
