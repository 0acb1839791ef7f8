"""Fixtures for the PostgreSQL ledger (``tests/conftest.py`` imports them) and the two stores as
test backends.

- ``pg_server_url``: the throwaway server's URL: ``$TURNGUARD_TEST_PG`` (``scripts/test`` starts
  one for the run, see ``tests/pg_server.py``), else a server this test process starts itself.
  A test that needs it is skipped only when no server can start at all, and says so loudly.
- ``pg_url``: a database of the test's own on it (dropped afterwards).
- ``own_pg``: a server of the test's own (``pg_server.PgServer``), for tests that restart it.
- ``ledger_backend``: each store in turn (``sqlite``, ``postgres``), for tests of the ledger
  contract that both must keep.
"""

from __future__ import annotations

import os
import sys
import uuid

import pytest

from pg_server import PgServer, PgUnavailable

_started: list[PgServer] = []


def _unavailable(why: str) -> None:
    message = f"POSTGRESQL UNAVAILABLE, PostgreSQL tests SKIPPED: {why}"
    print(f"\n{'!' * 78}\n{message}\n{'!' * 78}", file=sys.stderr)
    pytest.skip(message)


@pytest.fixture(scope="session")
def pg_server_url():
    url = os.environ.get("TURNGUARD_TEST_PG")
    if url:
        yield url
        return
    try:
        server = PgServer().start()
    except (PgUnavailable, OSError) as e:
        _unavailable(str(e))
    try:
        yield server.url
    finally:
        server.destroy()


def _admin(url: str):
    import psycopg

    return psycopg.connect(url, autocommit=True, connect_timeout=10)


def _base(url: str) -> str:
    return url.rsplit("/", 1)[0]


def create_database(server_url: str) -> str:
    """A new empty database on the server; its URL."""
    name = "tg_" + uuid.uuid4().hex[:16]
    with _admin(server_url) as db:
        db.execute(f"CREATE DATABASE {name}")
    return f"{_base(server_url)}/{name}"


def drop_database(server_url: str, url: str) -> None:
    name = url.rsplit("/", 1)[1]
    with _admin(server_url) as db:
        db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def pg_url(pg_server_url):
    url = create_database(pg_server_url)
    yield url
    drop_database(pg_server_url, url)


@pytest.fixture
def own_pg(tmp_path_factory):
    """A PostgreSQL server of the test's own (it may stop and restart it)."""
    try:
        server = PgServer().start()
    except (PgUnavailable, OSError) as e:
        _unavailable(str(e))
    try:
        yield server
    finally:
        server.destroy()


class SqliteBackend:
    """The SQLite ledger as a test backend: ``fresh()`` moves to a new file."""

    name = "sqlite"

    def __init__(self, folder):
        self._folder = folder
        self._n = 0
        self.location = ""
        self.fresh()

    def fresh(self) -> None:
        self._n += 1
        self.location = str(self._folder / f"l{self._n}.sqlite3")

    def open(self, instance: str, now: float = 1000.0, *, busy_timeout_ms: int = 5000):
        from turnguard_core.ledger_admin import LedgerAdmin

        led = LedgerAdmin(self.location, instance, busy_timeout_ms=busy_timeout_ms)
        led.open(now)
        return led

    def rows(self, sql: str) -> list[tuple]:
        import sqlite3

        db = sqlite3.connect(self.location)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()

    def execute(self, sql: str) -> None:
        import sqlite3

        db = sqlite3.connect(self.location)
        try:
            db.execute(sql)
            db.commit()
        finally:
            db.close()


class PgBackend:
    """The PostgreSQL ledger as a test backend: ``fresh()`` empties the test's database."""

    name = "postgres"

    def __init__(self, url: str):
        self.location = url
        self._db = None  # the test's own connection (a state machine's invariants read rows
        # after every step: a connection each was most of their time)

    def _conn(self):
        if self._db is None or self._db.closed:
            self._db = _admin(self.location)
        return self._db

    def _run(self, sql: str):
        import psycopg

        try:
            return self._conn().execute(sql)
        except psycopg.OperationalError:  # (a server restarted under it): once more, anew
            self._db = None
            return self._conn().execute(sql)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def fresh(self) -> None:
        if self._run("SELECT to_regclass('operations')").fetchone()[0] is not None:
            self._run("TRUNCATE operations, attempts, spool, instances, circuits, sessions,"
                      " control_audit RESTART IDENTITY CASCADE")

    def open(self, instance: str, now: float = 1000.0, *, busy_timeout_ms: int = 5000):
        from turnguard_core.pg_ledger import PgLedgerAdmin

        led = PgLedgerAdmin(self.location, instance, busy_timeout_ms=busy_timeout_ms)
        led.open(now)
        return led

    def rows(self, sql: str) -> list[tuple]:
        return self._run(sql).fetchall()

    def execute(self, sql: str) -> None:
        self._run(sql)


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_backend(request, tmp_path):
    if request.param == "sqlite":
        yield SqliteBackend(tmp_path)
        return
    backend = PgBackend(request.getfixturevalue("pg_url"))
    try:
        yield backend
    finally:
        backend.close()  # before pg_url drops its database
