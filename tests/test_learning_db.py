"""Issue 12, the database side: generations record their drafter version and token ids; only
consented rows reach training, read by dflash_trainer through dflash.training_rows; the
extraction filters; refusal with too few rows; the adoption rule (a worse drafter is not
adopted, a better one is, recorded in dflash.drafter_versions); dflash.reload_drafter() for
admins; and `dflash serve --learn`, off by default, running a round in a paused-when-busy
child process.

A real PostgreSQL; the worker runs in-process on a tiny target that always writes token 0
(its final norm is zero), with SmolLM2's tokenizer, so a drafter whose final norm is zero too
(`copy`) has every draft kept and a random one (`rand`) almost none."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
import torch
from psycopg import errors

from dflash.engine.drafter import init_random_drafter, save_drafter
from dflash.engine.engine import Engine
from dflash.engine.target.hf import HFTarget
from dflash.engine.versions import label
from dflash.loading import load_versioned
from dflash.errors import DFlashError
from dflash.serve.server import Worker
from dflash.train import from_database
from dflash.train.from_database import Filters, Settings, adopt, read_rows
from tests.conftest import cpu_like_costs, make_tiny_target, tiny_drafter_config, wait_until

VOCAB = 49152
ALICE, BOB, ADMIN, TRAINER = "lrn_alice", "lrn_bob", "lrn_admin", "lrn_trainer"


def connect(dsn, role=None):
    return psycopg.connect(dsn + (f" user={role}" if role else ""), autocommit=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory, smol_dir):
    """The copy target saved as a model folder, and two drafters under one drafter root."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("learn")
    target = make_tiny_target(vocab=VOCAB, context=512, seed=3)
    with torch.no_grad():
        target.model.model.norm.weight.zero_()
    target_dir = root / "copy-target"
    target.model.save_pretrained(target_dir)
    AutoTokenizer.from_pretrained(smol_dir).save_pretrained(target_dir)
    rand = init_random_drafter(tiny_drafter_config(vocab=VOCAB), seed=1, std=0.3)
    copy = init_random_drafter(tiny_drafter_config(vocab=VOCAB), seed=2, std=0.3)
    with torch.no_grad():
        copy.norm.weight.zero_()
    save_drafter(rand, root / "drafters" / "rand")
    save_drafter(copy, root / "drafters" / "copy")
    return {"root": root, "target": target_dir, "rand": root / "drafters" / "rand", "copy": root / "drafters" / "copy"}


@pytest.fixture(scope="module")
def learn_worker(pg_server, pg_dsn, models):
    """A worker on the copy target with the `rand` drafter, which PostgreSQL calls."""
    target = HFTarget.from_pretrained(models["target"])
    drafter, sha = load_versioned(models["rand"])
    engine = Engine(target, drafter, "rand", cost_curve=cpu_like_costs(), drafter_sha256=sha)
    worker = Worker(engine, None, socket_path=str(pg_server.socket_dir / "learn.sock"),
                    socket_group=pg_server.socket_group, drafter_dir=models["rand"], drafter_roots=[models["root"]])
    worker.start()
    with connect(pg_dsn) as su:
        old = dict(su.execute("SELECT key, value FROM dflash.config WHERE key IN ('socket_path', 'remember')"))
        su.execute("SELECT dflash.set_config('socket_path', %s)", (pg_server.server_path(worker.socket_path),))
        su.execute("SELECT dflash.set_config('remember', 'off')")  # this worker has no embedder
        for role in (ALICE, BOB, ADMIN, TRAINER):
            su.execute(f"DO $$ BEGIN CREATE ROLE {role} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
            su.execute(f"CREATE SCHEMA IF NOT EXISTS {role} AUTHORIZATION {role}")
        su.execute(f"GRANT dflash_user TO {ALICE}, {BOB}")
        su.execute(f"GRANT dflash_admin TO {ADMIN}")
        su.execute(f"GRANT dflash_trainer TO {TRAINER}")
    yield worker
    with connect(pg_dsn) as su:
        for key, value in old.items():
            su.execute("SELECT dflash.set_config(%s, %s)", (key, value))
    worker.shutdown(timeout=10)


@pytest.fixture
def db(pg_dsn, learn_worker, models):
    """A clean slate: no generations of these roles, no consent, no drafter versions; the
    worker back on `rand`."""
    with connect(pg_dsn) as su:
        su.execute("DELETE FROM dflash.generations WHERE calling_role IN (%s, %s)", (ALICE, BOB))
        su.execute("DELETE FROM dflash.training_consent")
        su.execute("DELETE FROM dflash.drafter_versions")
    if learn_worker.engine.drafter_name != "rand":
        learn_worker.reload_drafter(str(models["rand"]))
    return pg_dsn


def generate(dsn, role, n, prefix="Question", tokens=10):
    with connect(dsn, role) as conn:
        for i in range(n):
            conn.execute("SELECT dflash_generate(%s, max_new_tokens => %s, block_size => 8)", (f"{prefix} {i}?", tokens))


def trainer_rows(dsn, **filters):
    worker_target = "copy-target"
    with connect(dsn, TRAINER) as conn:
        versions, names = from_database.lineage(conn, worker_target, filters.pop("version", None),
                                                filters.pop("name", "rand"))
        return read_rows(conn, worker_target, versions + filters.pop("extra_versions", []), names, Filters(**filters))


def test_generations_record_the_drafter_version_and_token_ids(db, learn_worker):
    with connect(db, ALICE) as conn:
        stats = conn.execute("SELECT dflash_generate_stats('Hi', max_new_tokens => 6, block_size => 4)").fetchone()[0]
        row = conn.execute("SELECT drafter, drafter_version, output_ids FROM dflash.generations WHERE id = %s",
                           (stats["generation_id"],)).fetchone()
    assert stats["drafter_version"] == learn_worker.engine.drafter_version == label(learn_worker.engine.drafter_sha256)
    assert row == ("rand", stats["drafter_version"], stats["output_ids"])
    assert learn_worker.status()["drafter_version"] == stats["drafter_version"]


def test_only_consented_rows_reach_training(db):
    generate(db, ALICE, 3)
    generate(db, BOB, 3)
    with connect(db, ALICE) as alice:
        alice.execute(f"CREATE TABLE {ALICE}.notes (id serial PRIMARY KEY, q text, a text)")
        alice.execute(f"SELECT dflash.enable_generation('{ALICE}.notes', 'q', 'a', "
                      "'{\"mode\": \"sync\", \"max_new_tokens\": 6}')")
        alice.execute(f"INSERT INTO {ALICE}.notes (q) VALUES ('first'), ('second')")
    try:
        assert trainer_rows(db, any_drafter=True) == []  # nobody consented yet
        with connect(db, ALICE) as alice:
            alice.execute("INSERT INTO dflash.training_consent DEFAULT VALUES")  # alice's direct calls
            with pytest.raises(errors.InsufficientPrivilege):  # not for anyone else
                alice.execute("INSERT INTO dflash.training_consent (calling_role) VALUES (%s)", (BOB,))
        rows = trainer_rows(db, any_drafter=True)
        assert sorted(r["prompt"] for r in rows) == ["Question 0?", "Question 1?", "Question 2?"]
        with connect(db, ALICE) as alice:  # the table's owner shares its rows
            alice.execute("UPDATE dflash.generation_targets SET share_for_training = true "
                          f"WHERE tbl = '{ALICE}.notes'::regclass")
        assert sorted(r["prompt"] for r in trainer_rows(db, any_drafter=True)) == ["Question 0?", "Question 1?", "Question 2?",
                                                                  "first", "second"]
        with connect(db, ADMIN) as admin:  # an admin allows bob's direct calls too
            admin.execute("INSERT INTO dflash.training_consent (calling_role) VALUES (%s)", (BOB,))
            assert admin.execute("SELECT count(*) FROM dflash.training_rows").fetchone()[0] == 8
        with connect(db, TRAINER) as trainer:  # the trainer reads the view and nothing else
            with pytest.raises(errors.InsufficientPrivilege):
                trainer.execute("SELECT prompt FROM dflash.generations")
            with pytest.raises(errors.InsufficientPrivilege):
                trainer.execute("SELECT * FROM dflash.memory")
            with pytest.raises(errors.InsufficientPrivilege):  # records runs only as itself
                trainer.execute("INSERT INTO dflash.drafter_versions (target, adopted, rows_used, heldout_rows, "
                                "steps, train_seconds, margin, trained_by) VALUES ('t', false, 0, 0, 0, 0, 0, %s)",
                                (ADMIN,))
        with connect(db, BOB) as bob:  # members read neither the view nor the versions
            for query in ("SELECT * FROM dflash.training_rows", "SELECT * FROM dflash.drafter_versions"):
                with pytest.raises(errors.InsufficientPrivilege):
                    bob.execute(query)
            assert bob.execute("SELECT count(*) FROM dflash.training_consent").fetchone()[0] == 1  # his own
    finally:
        with connect(db, ALICE) as alice:
            alice.execute(f"DROP TABLE {ALICE}.notes")


def test_extraction_filters(db, learn_worker):
    with connect(db) as su:
        su.execute("INSERT INTO dflash.training_consent (calling_role) VALUES (%s), (%s)", (ALICE, BOB))
    generate(db, ALICE, 4, "Alice asks", tokens=10)
    generate(db, BOB, 3, "Bob asks", tokens=3)
    with connect(db) as su:
        middle = su.execute("SELECT clock_timestamp()").fetchone()[0]
        time.sleep(0.05)
    generate(db, ALICE, 2, "Later", tokens=10)
    with connect(db) as su:  # rows of another drafter and of another target, consented too
        for target, version in (("copy-target", "f" * 16), ("other-target", learn_worker.engine.drafter_version)):
            su.execute("INSERT INTO dflash.generations (mode, status, prompt, output, output_ids, target, drafter, "
                       "drafter_version, new_tokens, calling_role) VALUES ('sync', 'ok', 'x', '', '{0,0,0}', %s, "
                       "'elsewhere', %s, 3, %s)", (target, version, ALICE))
    version = learn_worker.engine.drafter_version
    everything = trainer_rows(db, version=version)
    assert len(everything) == 9  # another drafter's and another target's rows are skipped
    assert [r["id"] for r in everything] == sorted(r["id"] for r in everything)  # oldest first
    assert len(trainer_rows(db, version=version, any_drafter=True)) == 10  # still not another target's
    assert len(trainer_rows(db, version=version, extra_versions=["f" * 16])) == 10
    assert {r["prompt"].split()[0] for r in trainer_rows(db, version=version, role=BOB)} == {"Bob"}
    assert len(trainer_rows(db, version=version, min_new_tokens=5)) == 6  # bob's answers have 3 tokens
    assert [r["prompt"] for r in trainer_rows(db, version=version, since=middle.isoformat())] == ["Later 0?",
                                                                                                   "Later 1?"]
    assert [r["prompt"] for r in trainer_rows(db, version=version, limit=2)] == ["Later 0?", "Later 1?"]
    assert len(trainer_rows(db, version=version, source_table="none")) == 9
    with connect(db, ALICE) as alice:
        alice.execute(f"CREATE TABLE IF NOT EXISTS {ALICE}.empty (id int PRIMARY KEY, q text, a text)")
    assert trainer_rows(db, version=version, source_table=f"{ALICE}.empty") == []
    with pytest.raises(DFlashError) as err:
        trainer_rows(db, version=version, source_table="no_such_table")
    assert err.value.code == "bad_filter" and "no_such_table" in err.value.message
    with pytest.raises(DFlashError) as err:
        trainer_rows(db, version=version, since="not a time")
    assert err.value.code == "bad_filter"
    rows = trainer_rows(db, version=version, role=ALICE)
    assert all(r["output_ids"] == [0] * len(r["output_ids"]) for r in rows)  # stored ids, not re-tokenised


def _run(db, models, tmp_path, **kwargs):
    kwargs.setdefault("init_from", models["rand"])
    return from_database.run(db + f" user={TRAINER}", tmp_path / "run", target_dir=models["target"],
                             default_drafter=models["rand"], **kwargs)


def test_too_few_rows_are_refused_with_a_clear_message(db, models, tmp_path, capsys):
    generate(db, ALICE, 3)  # no consent: none of these count
    with pytest.raises(DFlashError) as err:
        _run(db, models, tmp_path)
    assert err.value.code == "too_few_rows" and "only 0 rows" in err.value.message
    assert "training_consent" in err.value.message
    assert not (tmp_path / "run" / "rows.jsonl").exists()
    from dflash.cli import main

    code = main(["train", "--from-database", db + f" user={TRAINER}", "--out", str(tmp_path / "cli"),
                 "--target", str(models["target"]), "--init-from", str(models["rand"]), "--min-rows", "5"])
    assert code == 2 and "dflash: error: only 0 rows" in capsys.readouterr().err
    with connect(db, ADMIN) as admin:
        assert admin.execute("SELECT count(*) FROM dflash.drafter_versions").fetchone()[0] == 0


def test_from_database_does_not_take_corpus_options(db, models, tmp_path, capsys):
    from dflash.cli import main

    code = main(["train", "--from-database", db, "--out", str(tmp_path), "--prompts", "5"])
    assert code == 2 and "--prompts" in capsys.readouterr().err


def test_the_adoption_rule():
    assert adopt(1.5, 1.6, 0.02) and not adopt(1.5, 1.52, 0.02) and not adopt(1.5, 1.4, 0.0)
    assert not adopt(None, 2.0, 0.0) and not adopt(1.5, None, 0.0)


@pytest.mark.parametrize("start, candidate, adopted", [("copy", "rand", False), ("rand", "copy", True)])
def test_a_worse_drafter_is_not_adopted_and_a_better_one_is(db, models, tmp_path, monkeypatch, start, candidate,
                                                            adopted):
    """The candidate is forced (fine_tune writes a known drafter), so the rule is what is tested."""
    import shutil

    def forced(target, drafter_dir, records, out, cfg, stage):
        shutil.copytree(models[candidate], out / "train" / "drafter")
        return {"step": 3}

    monkeypatch.setattr(from_database, "fine_tune", forced)
    with connect(db) as su:
        su.execute("INSERT INTO dflash.training_consent (calling_role) VALUES (%s)", (ALICE,))
    generate(db, ALICE, 20)
    res = _run(db, models, tmp_path, init_from=models[start], filters=Filters(any_drafter=True),
               settings=Settings(min_rows=20, eval_max_new_tokens=10))
    assert res.adopted is adopted and res.heldout_rows == 2 and res.rows_used == 18 and res.steps == 3
    assert (res.tau_after > res.tau_before) is adopted
    assert res.details["drafter_outputs_differ"] == 0  # the same greedy output with either drafter
    with connect(db, ADMIN) as admin:
        row = admin.execute("SELECT adopted, version, sha256, path, parent_version, rows_used, heldout_rows, steps, "
                            "tau_before, tau_after, trained_by, last_row_id FROM dflash.drafter_versions").fetchone()
        newest = admin.execute("SELECT max(id) FROM dflash.generations WHERE calling_role = %s",
                               (ALICE,)).fetchone()[0]
    want_sha = load_versioned(models[candidate])[1]
    assert row[0] is adopted and row[4] == label(load_versioned(models[start])[1])
    assert row[5:8] == (18, 2, 3) and row[8] == res.tau_before and row[9] == res.tau_after
    assert row[10] == TRAINER and row[11] == newest
    written = list((tmp_path / "run").glob("*-dflash-learned-*"))
    if adopted:
        assert row[1] == label(want_sha) and row[2] == want_sha and written == [Path(row[3])]
        assert load_versioned(row[3])[1] == want_sha
    else:  # nothing of the candidate is kept
        assert row[1:4] == (None, None, None) and written == []
        assert not (tmp_path / "run" / "train" / "drafter").exists()


def test_a_fine_tuned_drafter_is_recorded_and_reloaded_from_sql(db, models, tmp_path, learn_worker):
    """A real (two-step) fine-tune end to end; margin -1 adopts any drafter, so the path from
    training to the worker is what is tested here."""
    with connect(db, ALICE) as alice:
        alice.execute("INSERT INTO dflash.training_consent DEFAULT VALUES")
    generate(db, ALICE, 22)
    res = _run(db, models, tmp_path, settings=Settings(min_rows=20, margin=-1.0, steps=2, eval_max_new_tokens=10))
    assert res.adopted and res.steps >= 2 and res.parent_version == learn_worker.engine.drafter_version
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["version"] == res.version
    records = [json.loads(line) for line in (tmp_path / "run" / "rows.jsonl").read_text().splitlines()]
    assert len(records) == 22 and all(r["stored_ids"] for r in records)
    with connect(db, ALICE) as alice:
        with pytest.raises(errors.InsufficientPrivilege):
            alice.execute("SELECT dflash.reload_drafter()")
    with connect(db, ADMIN) as admin:
        with pytest.raises(psycopg.Error, match="forbidden_path"):  # the run is not under a drafter root yet
            admin.execute("SELECT dflash.reload_drafter()")
        learn_worker.drafter_roots.append(tmp_path.resolve())
        try:
            answer = admin.execute("SELECT dflash.reload_drafter()").fetchone()[0]
        finally:
            learn_worker.drafter_roots.remove(tmp_path.resolve())
        with pytest.raises(errors.InvalidParameterValue):
            admin.execute("SELECT dflash.reload_drafter('0000000000000000')")
    assert answer["drafter_version"] == res.version == learn_worker.status()["drafter_version"]
    assert answer["previous"]["drafter"] == "rand"
    with connect(db, ALICE) as alice:
        stats = alice.execute("SELECT dflash_generate_stats('After', max_new_tokens => 5)").fetchone()[0]
    assert stats["drafter_version"] == res.version and stats["drafter"] == res.drafter
    # The next run starts from the adopted version and still reads the rows its parent served.
    generate(db, ALICE, 2, "More")
    with connect(db, TRAINER) as trainer:
        assert from_database.starting_drafter(trainer, "copy-target", models["rand"]) == Path(res.path)
    assert len(trainer_rows(db, version=res.version, name=res.drafter)) == 25


# --- dflash serve --learn ------------------------------------------------------------------------


def test_learn_is_off_by_default(tiny_text_engine, tmp_path):
    from dflash.cli import build_parser
    from dflash.serve.learn import learner_from_args

    args = build_parser().parse_args(["serve"])
    assert args.learn is False
    worker = Worker(tiny_text_engine, None, socket_path=str(tmp_path / "w.sock"))
    assert worker.learner is None and worker.status()["learn"] is None
    args = build_parser().parse_args(["serve", "--learn"])
    with pytest.raises(DFlashError) as err:
        learner_from_args(worker, args, tmp_path)
    assert "--learn needs a database" in err.value.message
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "off by default" in help_text and "memorises" in help_text


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_learner_pauses_its_round_while_requests_are_in_flight(learn_worker, tmp_path):
    from dflash.serve.learn import Learner, LearnSettings
    from dflash.serve.server import Job

    learner = Learner(learn_worker, LearnSettings(dsn="unused", directory=tmp_path), Path("unused"))
    try:
        learner.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        supervisor = threading.Thread(target=learner._supervise)
        supervisor.start()
        job = Job("fake", "generate", {}, None)
        with learn_worker.lock:
            learn_worker.jobs[job.key] = job  # a request in flight
        assert wait_until(lambda: _proc_state(learner.proc.pid) == "T") and learner.state == "paused"
        with learn_worker.lock:
            del learn_worker.jobs[job.key]
        assert wait_until(lambda: _proc_state(learner.proc.pid) in "RS") and learner.state == "training"
        learner.stop.set()
        supervisor.join(timeout=40)
        assert learner.proc.poll() is not None  # ended with the worker
        learn_worker.last_activity = time.monotonic() - 1000
        learner.settings.idle_s = 60
        assert learner.idle()
        learn_worker.last_activity = time.monotonic()
        assert not learner.idle()
    finally:
        learn_worker.learner = None
        learn_worker.drafter_roots.remove(tmp_path.resolve())
        if learner.proc.poll() is None:
            learner.proc.kill()


def test_a_learning_round_fine_tunes_adopts_and_reloads(db, models, tmp_path, learn_worker):
    from dflash.serve.learn import Learner, LearnSettings

    with connect(db, ALICE) as alice:
        alice.execute("INSERT INTO dflash.training_consent DEFAULT VALUES")
    generate(db, ALICE, 21)
    settings = LearnSettings(dsn=db + f" user={TRAINER}", directory=tmp_path / "learn", idle_s=0, min_new_rows=20,
                             cpu_budget_min=0.2, settings=Settings(min_rows=20, margin=-1.0, steps=2,
                                                                   eval_max_new_tokens=8))
    learner = Learner(learn_worker, settings, models["target"])
    try:
        assert learner.idle() or wait_until(learner.idle)
        assert learner.new_rows() == 21
        summary = learner.run_round()
        assert summary["adopted"], (tmp_path / "learn").glob("*/learn.log")
        assert learn_worker.status()["drafter_version"] == summary["version"]
        assert learn_worker.status()["learn"]["adopted"] == 1
        assert learner.new_rows() == 0  # counted from the run's last row
    finally:
        learn_worker.learner = None
        learn_worker.drafter_roots.remove((tmp_path / "learn").resolve())
