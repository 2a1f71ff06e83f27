"""Roles, connections, a setting changed for a while and a queue drain shared by the SQL tests.

Members `sec_alice` and `sec_bob` (each with a schema of their own), `sec_eve` who may log
in but is no member, `sec_admin` (dflash_admin) and the worker's role dflash_worker.
"""

from __future__ import annotations

from contextlib import contextmanager

import psycopg
import pytest

ALICE, BOB, EVE, ADMIN = "sec_alice", "sec_bob", "sec_eve", "sec_admin"


def connect(dsn: str, role: str | None = None) -> psycopg.Connection:
    return psycopg.connect(dsn + (f" user={role}" if role else ""), autocommit=True)


def scalar(conn, query, *args):
    return conn.execute(query, args).fetchone()[0]


@contextmanager
def setting(conn, key: str, value: str):
    """dflash.config's `key` set to `value` for the block (as the superuser `conn` is), then back."""
    before = scalar(conn, "SELECT value FROM dflash.config WHERE key = %s", key)
    conn.execute("SELECT dflash.set_config(%s, %s)", (key, value))
    try:
        yield
    finally:
        conn.execute("SELECT dflash.set_config(%s, %s)", (key, before))


@pytest.fixture(scope="module")
def roles(pg_dsn):
    """The roles above (created once per cluster), each member with a schema of their own."""
    with connect(pg_dsn) as su:
        for role in (ALICE, BOB, EVE, ADMIN):
            su.execute(f"DO $$ BEGIN CREATE ROLE {role} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        su.execute(f"GRANT dflash_user TO {ALICE}, {BOB}")
        su.execute(f"GRANT dflash_admin TO {ADMIN}")
        su.execute("ALTER ROLE dflash_worker LOGIN")
        for role in (ALICE, BOB, EVE, ADMIN):
            su.execute(f"CREATE SCHEMA IF NOT EXISTS {role} AUTHORIZATION {role}")
    return pg_dsn


@pytest.fixture
def su(roles):
    with connect(roles) as conn:
        yield conn


@pytest.fixture
def alice(roles):
    with connect(roles, ALICE) as conn:
        yield conn


@pytest.fixture
def bob(roles):
    with connect(roles, BOB) as conn:
        yield conn


@pytest.fixture(scope="module")
def worker_dsn(roles):
    return roles + " user=dflash_worker"


def drain(worker, dsn: str, backoff_s: float = 0.0, **kwargs):
    """Work the queue as the worker's consumer until nothing is due; returns the consumer."""
    from dflash.serve.queue import QueueConsumer

    consumer = QueueConsumer(worker, dsn, backoff_s=backoff_s, **kwargs)
    with consumer.connect() as conn:
        while consumer.process_one(conn):
            pass
    return consumer
