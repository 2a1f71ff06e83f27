"""ALTER EXTENSION dflash UPDATE from each released version (0.1.0 as released at commit
026bb26, 0.2.0 as shipped at 6371f7e) to the current one (extension/dflash.control),
through the chain of upgrade scripts: the upgraded database's catalog is the one a fresh
install makes, the old rows are still there for their owners, and tables with generation
enabled under the old version keep working, through the current triggers and the owner's
writer.

Each old install script is built from its commit with that commit's Makefile and installed
beside the current files (the local back end: the server's share directory is this
machine's; `make install-extension` must have installed the current version). Its
PL/Python module is not: the bridge's folder has no version, and nothing here calls
PL/Python under an old version. The test runs on a cluster of its own, so the roles 0.1.0
lacked really are missing before its upgrade.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
from io import BytesIO
from pathlib import Path

import psycopg
import pytest

from tests.conftest import unavailable

pytestmark = pytest.mark.pg

REPO = Path(__file__).resolve().parents[1]

RELEASES = {"0.1.0": "026bb26", "0.2.0": "6371f7e"}  # each version's release commit
ALICE, BOB, EVE = "upg_alice", "upg_bob", "upg_eve"  # members alice and bob; eve is none
OLD_PROMPT = "queued before the upgrade"


def current_version() -> str:
    control = (REPO / "extension" / "dflash.control").read_text()
    return re.search(r"^default_version\s*=\s*'([^']+)'", control, re.M).group(1)


def released_script(version: str) -> Path:
    """The released install script, frozen (as built by the release commit's own Makefile for
    Debian's PostgreSQL 15), so the test needs no git history (CI may clone shallowly)."""
    return REPO / "tests" / "fixtures" / f"dflash--{version}.sql"


def has_commit(commit: str) -> bool:
    return subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_the_frozen_release_script_is_what_the_release_built(tmp_path, version):
    if not has_commit(RELEASES[version]):
        pytest.skip(f"commit {RELEASES[version]} is not in this clone (a shallow clone): nothing to compare with")
    assert build_old_install_script(tmp_path, version).read_bytes() == released_script(version).read_bytes()


def test_the_frozen_upgrade_step_is_what_0_2_0_shipped(tmp_path):
    """sql/upgrade/dflash--0.1.0--0.2.0.sql is the script 0.2.0 built, its bridge lines a placeholder."""
    commit = RELEASES["0.2.0"]
    if not has_commit(commit):
        pytest.skip(f"commit {commit} is not in this clone (a shallow clone): nothing to compare with")
    built = (build_old_install_script(tmp_path, "0.2.0", "dflash--0.1.0--0.2.0.sql")).read_text()
    ours = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(REPO / "extension"),
                           "dflash--0.1.0--0.2.0.sql"], capture_output=True, text=True, check=True)
    assert ours.returncode == 0
    frozen = (REPO / "extension" / "dflash--0.1.0--0.2.0.sql").read_text()
    assert frozen.split("\n")[2:] == built.split("\n")[1:]  # all but their first comment lines


def build_old_install_script(workdir: Path, version: str, name: str | None = None) -> Path:
    """dflash--VERSION.sql (or another of its scripts) built from the release commit by its own Makefile."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", RELEASES[version], "sql",
                              "extension"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(workdir, filter="data")
    name = name or f"dflash--{version}.sql"
    subprocess.run(["make", "-s", "-C", str(workdir / "extension"), name], check=True, capture_output=True)
    return workdir / "extension" / name


def install_beside(script: Path, share: Path) -> None:
    """Put the old script into the server's extension folder (atomically: other sessions may
    be creating the extension at the same time; the default version stays the current one)."""
    target = share / script.name
    if target.exists() and target.read_bytes() == script.read_bytes():
        return
    if not os.access(share, os.W_OK):
        unavailable("the upgrade", f"cannot write {target} (run the test as the user who ran `make install-extension`)")
    tmp = share / f".{script.name}.{os.getpid()}"
    shutil.copyfile(script, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)


@pytest.fixture(scope="module")
def cluster(pg_backend):
    from dflash.localpg import start_local_cluster

    if pg_backend != "local":
        pytest.skip("the upgrade test installs the 0.1.0 script into the server's share directory, which only "
                    "the local back end can (DFLASH_TEST_BACKEND=local; CI runs it in its local stage)")
    share = Path(subprocess.check_output(["pg_config", "--sharedir"], text=True).strip()) / "extension"
    new = current_version()
    control = share / "dflash.control"
    installed = re.search(r"^default_version\s*=\s*'([^']+)'", control.read_text(), re.M) if control.exists() else None
    steps = ("dflash--0.1.0--0.2.0.sql", f"dflash--0.2.0--{new}.sql")
    if not installed or installed.group(1) != new or not all((share / f).exists() for f in steps):
        unavailable("the upgrade", f"dflash {new} and its upgrades are not installed in {share}: "
                    "run `make install-extension`")
    for version in RELEASES:
        install_beside(released_script(version), share)
    server = start_local_cluster()
    yield server
    server.stop()


def connect(server, db: str, user: str | None = None) -> psycopg.Connection:
    return psycopg.connect(server.dsn(db, user), autocommit=True)


def worker_answer(text: str) -> str:
    """A worker's generate answer (protocol v1) with a memory embedding, as record_generation takes it."""
    return json.dumps({"text": text, "target": "t", "drafter": "d", "block_size": 16, "num_steps": 2,
                       "new_tokens": 3, "tau": 1.5, "accepted_per_position": [1, 0],
                       "memory": {"embedder": "e", "embedding": [0.05] * 384}})


def roles_and_schema(su) -> None:
    su.execute(f"GRANT dflash_user TO {ALICE}, {BOB}")
    su.execute(f"CREATE SCHEMA alice AUTHORIZATION {ALICE}")


def user_tables(server, su, db: str) -> None:
    """alice's tables: `notes` (queued), `instant` (filled within the INSERT), `strict`
    (enabled only under 0.1.0, which let a string through where a number belongs)."""
    with connect(server, db, ALICE) as alice:
        for name in ("notes", "instant", "strict"):
            alice.execute(f"CREATE TABLE alice.{name} (id bigint PRIMARY KEY, prompt text, answer text)")
    su.execute("SELECT dflash.enable_generation('alice.notes', 'prompt', 'answer', '{\"max_new_tokens\": 16}')")
    su.execute("SELECT dflash.enable_generation('alice.instant', 'prompt', 'answer', '{\"mode\": \"sync\"}')")


def make_upgraded(server, old: str, db: str):
    """A database of an old version with alice's tables, a queued row and a generation, then
    updated. Returns the roles that existed before the update and the update's notices."""
    with connect(server, "postgres") as su:
        su.execute(f"CREATE DATABASE {db}")
        for role in (ALICE, BOB, EVE):  # one cluster for every old version: made once
            if su.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None:
                su.execute(f"CREATE ROLE {role} LOGIN")
    with connect(server, db) as su:
        su.execute(f"CREATE EXTENSION dflash VERSION '{old}' CASCADE")
        assert su.execute("SELECT extversion FROM pg_extension WHERE extname = 'dflash'").fetchone()[0] == old
        roles_and_schema(su)
        # 0.1.0's enable_generation only worked for superusers (it created a trigger on a
        # function members could not execute), so the superuser enables alice's tables.
        user_tables(server, su, db)
        if old == "0.1.0":  # it let a string through where a number belongs; 0.2.0 refuses it
            su.execute("SELECT dflash.enable_generation('alice.strict', 'prompt', 'answer', '{\"temperature\": \"0\"}')")
        with connect(server, db, ALICE) as alice:
            alice.execute("CREATE TABLE alice.gone (id int PRIMARY KEY, prompt text, answer text)")
            su.execute("SELECT dflash.enable_generation('alice.gone', 'prompt', 'answer')")
            alice.execute("DROP TABLE alice.gone")  # 0.1.0 kept its target, pointing nowhere
            alice.execute("INSERT INTO alice.notes (id, prompt) VALUES (1, %s)", (OLD_PROMPT,))
            alice.execute("SELECT dflash.record_generation('sync', 'hi', '{}', %s::jsonb, 1, 2)",
                          (worker_answer("hello"),))
        roles_before = {r for (r,) in su.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'dflash%'")}
    with connect(server, db) as su:  # a session of its own, as an administrator's would be
        notices = []
        su.add_notice_handler(lambda d: notices.append((d.severity, d.message_primary)))
        su.execute(f"ALTER EXTENSION dflash UPDATE TO '{current_version()}'")
    return roles_before, notices


def make_fresh(server, db: str = "fresh") -> None:
    """The current version installed fresh in the same cluster, with the same user tables."""
    with connect(server, "postgres") as su:
        su.execute(f"CREATE DATABASE {db}")
    with connect(server, db) as su:
        su.execute("CREATE EXTENSION dflash CASCADE")
        roles_and_schema(su)
        user_tables(server, su, db)


@pytest.fixture(scope="module", params=sorted(RELEASES))
def upgraded(cluster, request):
    """(server, roles before, notices, database, old version) for a database updated from each release."""
    old = request.param
    db = "upgraded_" + old.replace(".", "_")
    return (cluster, *make_upgraded(cluster, old, db), db, old)


@pytest.fixture(scope="module")
def fresh(cluster):
    make_fresh(cluster)
    return cluster


# --- the catalog of what dflash made, oids of user tables written as their names -------------

EXT = "(SELECT e.oid FROM pg_extension e WHERE e.extname = 'dflash')"
MEMBERS = f"SELECT d.classid, d.objid FROM pg_depend d WHERE d.refobjid = {EXT} AND d.deptype = 'e'"
DFLASH_FUNCTIONS = f"""(SELECT p.oid FROM pg_proc p WHERE p.pronamespace = 'dflash'::regnamespace
                        OR (p.tableoid, p.oid) IN ({MEMBERS}))"""
GRANTEE = "CASE x.grantee WHEN 0 THEN 'PUBLIC' ELSE x.grantee::regrole::text END"
ACL = f"x.grantor::regrole::text, {GRANTEE}, x.privilege_type, x.is_grantable"

CATALOG = {
    "extension members": f"""
        SELECT pg_describe_object(d.classid, d.objid, d.objsubid) FROM pg_depend d
        WHERE d.refobjid = {EXT} AND d.deptype = 'e'""",
    "functions": f"""
        SELECT p.oid::regprocedure::text, pg_get_function_result(p.oid), l.lanname, p.prosecdef, p.proconfig,
               p.provolatile, p.proparallel, p.proisstrict, p.proowner::regrole::text, pg_get_functiondef(p.oid),
               obj_description(p.oid, 'pg_proc')
        FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang WHERE p.oid IN {DFLASH_FUNCTIONS}""",
    "relations": """
        SELECT c.oid::regclass::text, c.relkind, c.relpersistence, c.relrowsecurity, c.relforcerowsecurity,
               c.reloptions, c.relowner::regrole::text, obj_description(c.oid, 'pg_class'),
               CASE WHEN c.relkind = 'v' THEN pg_get_viewdef(c.oid) END
        FROM pg_class c WHERE c.relnamespace = 'dflash'::regnamespace""",
    # As a set: columns an upgrade adds come last in their table, where a fresh install has
    # them in between (nothing reads these tables by position).
    "columns": """
        SELECT a.attrelid::regclass::text, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated, col_description(a.attrelid, a.attnum)
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = 'dflash'::regnamespace AND a.attnum > 0 AND NOT a.attisdropped""",
    "constraints": """
        SELECT co.conrelid::regclass::text, co.conname, co.contype, pg_get_constraintdef(co.oid)
        FROM pg_constraint co WHERE co.connamespace = 'dflash'::regnamespace""",
    "indexes": """
        SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE c.relnamespace = 'dflash'::regnamespace""",
    "policies": """
        SELECT tablename, policyname, permissive, roles::text, cmd, qual, with_check
        FROM pg_policies WHERE schemaname = 'dflash'""",
    "schema": """
        SELECT n.nspname, n.nspowner::regrole::text, obj_description(n.oid, 'pg_namespace')
        FROM pg_namespace n WHERE n.nspname = 'dflash'""",
    "privileges": f"""
        SELECT 'schema dflash', {ACL} FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) x
        WHERE n.nspname = 'dflash'
        UNION ALL
        SELECT c.oid::regclass::text, {ACL} FROM pg_class c,
               aclexplode(coalesce(c.relacl, acldefault((CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END)::"char", c.relowner))) x
        WHERE c.relnamespace = 'dflash'::regnamespace AND c.relkind <> 'i'
        UNION ALL
        SELECT a.attrelid::regclass::text || '.' || a.attname, {ACL} FROM pg_attribute a, aclexplode(a.attacl) x
        WHERE a.attrelid IN (SELECT c.oid FROM pg_class c WHERE c.relnamespace IN ('dflash'::regnamespace,
                                                                                  'alice'::regnamespace))
        UNION ALL
        SELECT p.oid::regprocedure::text, {ACL} FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) x
        WHERE p.oid IN {DFLASH_FUNCTIONS}""",
    # Users' tables keep the ACL they had: NULL stays NULL.
    "user table acls": """
        SELECT c.oid::regclass::text, c.relacl::text FROM pg_class c WHERE c.relnamespace = 'alice'::regnamespace""",
    # What pg_dump takes for the extension's own grants (it writes only the difference).
    "initial privileges": f"""
        SELECT pg_describe_object(ip.classoid, ip.objoid, ip.objsubid), ip.privtype, {ACL}
        FROM pg_init_privs ip, aclexplode(ip.initprivs) x
        WHERE (ip.classoid, ip.objoid) IN ({MEMBERS}) OR ip.objoid IN {DFLASH_FUNCTIONS}""",
    "triggers": """
        SELECT t.tgrelid::regclass::text, t.tgname, t.tgfoid::regprocedure::text, t.tgtype, t.tgenabled,
               encode(t.tgargs, 'escape')
        FROM pg_trigger t WHERE NOT t.tgisinternal""",
    "event triggers": """
        SELECT evtname, evtevent, evtfoid::regprocedure::text, evttags::text, evtenabled, evtowner::regrole::text
        FROM pg_event_trigger""",
    "sequences": """
        SELECT sequencename, sequenceowner, data_type::text, start_value, min_value, max_value, increment_by, cycle
        FROM pg_sequences WHERE schemaname = 'dflash'""",
    "settings": "SELECT key, value FROM dflash.config",
}


def oid_names(conn) -> dict[str, str]:
    names = {str(oid): name for oid, name in conn.execute(
        "SELECT c.oid, c.oid::regclass::text FROM pg_class c WHERE c.relnamespace = 'alice'::regnamespace")}
    # A writer is named by its target's writer_id, which differs between databases made differently.
    names.update({f"write_{w}": f"write_<{t}>" for w, t in conn.execute(
        "SELECT g.writer_id, g.tbl::text FROM dflash.generation_targets g")})
    return names


def normalise(value, names: dict[str, str]):
    """A user table's oid (in a writer's body, a trigger's arguments) and a writer's name as
    the table's name."""
    if isinstance(value, str):
        value = re.sub(r"write_\d+", lambda m: names.get(m[0], m[0]), value)
        return re.sub(r"(?<!\d)\d{4,}(?!\d)", lambda m: f"<{names[m[0]]}>" if m[0] in names else m[0], value)
    if isinstance(value, (list, tuple)):
        return tuple(normalise(v, names) for v in value)
    return value


def catalog(server, db: str) -> dict[str, list]:
    with connect(server, db) as conn:
        names = oid_names(conn)
        return {part: sorted((normalise(row, names) for row in conn.execute(query)), key=repr)
                for part, query in CATALOG.items()}


def schema_dump(server, db: str) -> list[str]:
    """pg_dump --schema-only as sorted lines: comments, blank lines and the per-run
    \\restrict key dropped, user tables' oids as names."""
    from dflash.localpg import pg_bindir

    out = subprocess.run([str(pg_bindir() / "pg_dump"), "--schema-only", "--no-comments", "-d", server.dsn(db)],
                         check=True, capture_output=True, text=True).stdout
    with connect(server, db) as conn:
        names = oid_names(conn)
    keep = (line for line in out.splitlines()
            if line.strip() and not line.startswith(("--", "\\restrict", "\\unrestrict")))
    return sorted(normalise(line, names) for line in keep)


# --- the tests ---------------------------------------------------------------------------------


def test_update_paths_are_installed(cluster):
    with connect(cluster, "postgres") as su:
        paths = {src: dict(su.execute("SELECT target, path FROM pg_extension_update_paths('dflash') WHERE source = %s",
                                      (src,)).fetchall()) for src in RELEASES}
    new = current_version()
    assert paths["0.1.0"].get(new) == f"0.1.0--0.2.0--{new}" and paths["0.2.0"].get(new) == f"0.2.0--{new}"


@pytest.mark.parametrize("step", ["0.1.0--0.2.0", "0.2.0--CURRENT"])
def test_the_upgrade_scripts_refuse_to_run_outside_alter_extension(cluster, step):
    """Fed to psql, each says to use ALTER EXTENSION and changes nothing."""
    from dflash.localpg import pg_bindir

    share = Path(subprocess.check_output(["pg_config", "--sharedir"], text=True).strip()) / "extension"
    db = "guard_" + step.replace(".", "_").replace("-", "_").lower()
    with connect(cluster, "postgres") as su:
        su.execute(f"CREATE DATABASE {db}")
    out = subprocess.run([str(pg_bindir() / "psql"), "-v", "ON_ERROR_STOP=1", "-d", cluster.dsn(db), "-f", "-"],
                         input=(share / f"dflash--{step.replace('CURRENT', current_version())}.sql").read_text(),
                         capture_output=True, text=True)
    assert 'Use "ALTER EXTENSION dflash UPDATE' in out.stdout + out.stderr
    with connect(cluster, db) as guard:
        assert guard.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'dflash'").fetchone()[0] == 0
        assert guard.execute("SELECT count(*) FROM pg_tables WHERE tablename = 'generations'").fetchone()[0] == 0


def test_catalog_equals_a_fresh_install(upgraded, fresh):
    server, db = upgraded[0], upgraded[3]
    got, want = catalog(server, db), catalog(server, "fresh")
    assert set(got) == set(want) == set(CATALOG)
    for part in CATALOG:
        assert want[part], f"{part}: the fresh install has none (a query that cannot fail)"
        assert got[part] == want[part], f"{part} differs after the upgrade"


def test_schema_dump_equals_a_fresh_install(upgraded, fresh):
    server, db = upgraded[0], upgraded[3]
    assert schema_dump(server, db) == schema_dump(server, "fresh")


def test_roles_created(upgraded):
    server, before, _, db, old = upgraded
    if old == "0.1.0":
        assert before == {"dflash_user", "dflash_worker"}  # what 0.1.0 made
    with connect(server, db) as su:
        member = su.execute("SELECT pg_has_role('dflash_admin', 'dflash_user', 'MEMBER'), "
                            "pg_has_role('dflash_admin', 'dflash_trainer', 'MEMBER')").fetchone()
    assert member == (True, True)


def test_old_rows_stay_their_owners(upgraded):
    server, db = upgraded[0], upgraded[3]
    with connect(server, db, ALICE) as alice:
        assert alice.execute("SELECT prompt, output, calling_role FROM dflash.generations").fetchall() == [
            ("hi", "hello", ALICE)]
        assert alice.execute("SELECT prompt, calling_role, shared FROM dflash.memory").fetchall() == [
            ("hi", ALICE, False)]
        assert alice.execute("SELECT key_value, prompt, calling_role FROM dflash.queue").fetchall() == [
            ("1", OLD_PROMPT, ALICE)]
    with connect(server, db, BOB) as bob:  # row-level security: another member sees none of them
        for table in ("generations", "memory", "queue"):
            assert bob.execute(f"SELECT count(*) FROM dflash.{table}").fetchone()[0] == 0, table


def test_enabled_tables_move_to_the_new_triggers(upgraded):
    server, _, notices, db, old = upgraded
    with connect(server, db) as su:
        targets = dict(su.execute("SELECT tbl::text, enabled FROM dflash.generation_targets").fetchall())
        # The dropped table's target is gone; strict's options are refused, so it is disabled.
        if old == "0.1.0":
            assert targets == {"alice.notes": True, "alice.instant": True, "alice.strict": False}
            assert any(sev == "WARNING" and "alice.strict" in msg for sev, msg in notices), notices
        else:
            assert targets == {"alice.notes": True, "alice.instant": True}
        triggers = dict(su.execute("SELECT tgrelid::regclass::text, tgfoid::regprocedure::text FROM pg_trigger "
                                   "WHERE tgname = 'dflash_generate'").fetchall())
        assert triggers == {"alice.notes": "dflash._enqueue()", "alice.instant": "dflash._generate_row()"}
        assert su.execute("SELECT prosecdef FROM pg_proc WHERE oid = 'dflash._enqueue()'::regprocedure").fetchone()[0] \
            is False
        writer, owner, member = su.execute(
            "SELECT p.oid::regprocedure::text, p.proowner::regrole::text, "
            "       EXISTS (SELECT FROM pg_depend d WHERE d.objid = p.oid AND d.deptype = 'e') "
            "FROM pg_proc p WHERE p.proname = dflash._writer_name('alice.notes')").fetchone()
        assert (owner, member) == (ALICE, False)
        # 0.1.0 granted the worker the key and output columns; the current version grants it nothing.
        assert su.execute("SELECT has_any_column_privilege('dflash_worker', 'alice.notes', 'SELECT, UPDATE')"
                          ).fetchone()[0] is False
        su.execute("ALTER ROLE dflash_worker LOGIN")
        fill_through_the_new_path(server, db, writer.split("(")[0])
        # The trigger runs as the inserting role now, who must be a member (0.1.0 queued rows
        # for anyone who could insert). Rolled back: the catalog test compares alice's ACLs.
        with su.transaction(force_rollback=True):
            su.execute(f"GRANT USAGE ON SCHEMA alice TO {EVE}")
            su.execute(f"GRANT INSERT ON alice.notes TO {EVE}")
            su.execute(f"SET LOCAL ROLE {EVE}")
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="dflash_user"), su.transaction():
                su.execute("INSERT INTO alice.notes (id, prompt) VALUES (3, 'not a member')")


def fill_through_the_new_path(server, db: str, writer: str) -> None:
    with connect(server, db, ALICE) as alice:
        alice.execute("INSERT INTO alice.notes (id, prompt) VALUES (2, 'after the upgrade')")
        assert alice.execute("SELECT key_value, calling_role FROM dflash.queue ORDER BY id").fetchall() == [
            ("1", ALICE), ("2", ALICE)]
    with connect(server, db, "dflash_worker") as worker:  # the row queued under the old version, filled
        assert worker.execute(f"SELECT {writer}('1', 'filled', %s)", (OLD_PROMPT,)).fetchone()[0] == 1
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            worker.execute("SELECT answer FROM alice.notes")
    with connect(server, db, ALICE) as alice:
        assert alice.execute("SELECT answer FROM alice.notes WHERE id = 1").fetchone()[0] == "filled"
