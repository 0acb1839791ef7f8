"""The PostgreSQL ledger: ``ledger.Ledger``'s contract on a database several hosts share.

Every public method has the contract of the ``Ledger`` method of the same name (read those
docstrings); the decisions are the same pure functions (``policy``, ``circuit``), called inside
the write transaction. What differs is how a transaction is made atomic across processes and
hosts, since PostgreSQL does not serialize writers the way SQLite's ``BEGIN IMMEDIATE`` does:

- a claim (``admit``, ``adopt_attempt``, ``record_offline_attempt``) holds a transaction-scoped
  advisory lock on its operation key (``pg_advisory_xact_lock``) while it reads the operation,
  asks the policy and writes; the claim itself is the conditional
  ``UPDATE ... WHERE state<>'in_flight' RETURNING``, so no two attempts are ever in flight;
- a recovery claim reads its durable session ``FOR SHARE``, so a takeover (``FOR UPDATE``)
  cannot slip between the epoch check and the claim: fenced;
- an attempt's end feeds its retry circuit with the circuit's row locked (``FOR UPDATE``), so
  every replica's failure counts and none overwrites another's; ``circuit.record_outcome``
  never moves an open cooldown's end earlier (no replica can shorten another's cooldown, whatever
  its clock or its ``turnguard_cooldown_ms``);
- an operation that leaves ``in_flight`` sends ``NOTIFY turnguard_attempt_ended`` with
  ``OP_KEY ATTEMPT_ID STATE`` (delivered on commit; ``completed_unrecorded`` for a completed
  end with no recording to replay): processes holding its duplicates are woken by
  ``AttemptEndListener`` instead of polling;
- schema migrations run one versioned step per transaction under an advisory lock, so
  processes that start together migrate once; ``meta`` holds the schema version and the
  database's ``generation`` (a database dropped and made again is another ledger: kept writes
  for the old one are never applied to it);
- a connection that broke (a PostgreSQL restart, a network fault) is made again on the next
  call; a claim whose commit may or may not have landed when the connection broke is a claim
  in doubt: ``claims_in_doubt`` tells which of them landed and are still in flight, for the
  caller to settle (the row of the attempt it runs without one, else given back), never the
  ledger alone: its request may have been dispatched meanwhile, decided without the ledger.

Raises ``LedgerError`` (never a bare ``psycopg`` error); deadlocks and serialization failures
are retried a few times first. The URL's password is never shown: ``path`` is the URL as
``ledger_location.display`` shows it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import select
import threading
import time
import uuid
from typing import Callable, Iterable, TypeVar

import psycopg
from psycopg import errors as pg_errors

from . import circuit, liveness, policy
from .identity import Identity
from .ledger import (
    SPOOL_CHUNK,
    _SPENT,
    _superseded,
    AttemptEnd,
    FinishResult,
    HeartbeatResult,
    READ_APART_BUSY_MS,
    LedgerError,
    Recording,
    WalState,
    moved_key,
)
from .ledger_admin import (
    COUNT_BOUND_MS,
    CircuitRow,
    SessionRow,
    _circuit_json,
    _one_by_prefix,
    _session_dict,
)
from .ledger_location import display, scrub

logger = logging.getLogger("turnguard")
T = TypeVar("T")

SCHEMA_VERSION = 3
NOTIFY_CHANNEL = "turnguard_attempt_ended"
# Longest a probe of a ledger that failed waits for the lock a claim takes (``heartbeat``)
PROBE_LOCK_WAIT_MS = 100
READERS_KEPT = 4  # read-only connections kept for reads apart (``read_apart``)
MIGRATION_LOCK = 0x74675F6D6967  # pg_advisory_xact_lock key of schema migrations ("tg_mig")
CONNECT_TIMEOUT_S = 5
TRANSIENT_RETRIES = 3  # deadlock / serialization failure: the transaction is run again
# libpq keeps a TCP connection to a vanished server from hanging a call for minutes
_TCP_OPTIONS = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                "keepalives_count": 3, "tcp_user_timeout": 10000}

_MIGRATIONS: dict[int, str] = {
    # The SQLite ledger's schema 4, as one step (PostgreSQL ledgers start here).
    1: """
    CREATE TABLE instances (
        instance_id  TEXT PRIMARY KEY,
        pid          INTEGER NOT NULL,
        host         TEXT NOT NULL,
        started_at   DOUBLE PRECISION NOT NULL,
        heartbeat_at DOUBLE PRECISION NOT NULL,
        boot_id      TEXT NOT NULL DEFAULT '',
        pid_ns       TEXT NOT NULL DEFAULT '',
        start_ticks  BIGINT,
        incarnation  INTEGER NOT NULL DEFAULT 1
    );
    CREATE TABLE operations (
        op_key               TEXT PRIMARY KEY,
        scope                TEXT NOT NULL,
        session              TEXT,
        method               TEXT NOT NULL,
        path                 TEXT NOT NULL,
        idempotency_key      TEXT,
        fingerprint          TEXT NOT NULL,
        turn_state           TEXT,
        previous_response_id TEXT,
        state                TEXT NOT NULL,
        current_attempt      BIGINT,
        replay_attempt       BIGINT,
        attempts             INTEGER NOT NULL DEFAULT 0,
        events_seen          INTEGER NOT NULL DEFAULT 0,
        recovery_dispatches  INTEGER NOT NULL DEFAULT 0,
        circuit_scope        TEXT,
        created_at           DOUBLE PRECISION NOT NULL,
        updated_at           DOUBLE PRECISION NOT NULL,
        ended_at             DOUBLE PRECISION,
        duplicates_held      INTEGER NOT NULL DEFAULT 0,
        duplicates_replayed  INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX operations_updated ON operations(updated_at);
    CREATE TABLE attempts (
        attempt_id   BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        op_key       TEXT NOT NULL REFERENCES operations(op_key) ON DELETE CASCADE,
        kind         TEXT NOT NULL,
        instance_id  TEXT NOT NULL,
        flow_id      TEXT,
        started_at   DOUBLE PRECISION NOT NULL,
        ended_at     DOUBLE PRECISION,
        status       INTEGER,
        events_seen  INTEGER NOT NULL DEFAULT 0,
        outcome      TEXT NOT NULL DEFAULT 'in_flight',
        detail       TEXT,
        headers      TEXT,
        body_bytes   INTEGER,
        replayable   INTEGER NOT NULL DEFAULT 0,
        vary_key     TEXT,
        late_outcome TEXT
    );
    CREATE INDEX attempts_op ON attempts(op_key);
    CREATE INDEX attempts_in_flight ON attempts(instance_id) WHERE outcome = 'in_flight';
    CREATE TABLE circuits (
        scope      TEXT PRIMARY KEY,
        failures   INTEGER NOT NULL DEFAULT 0,
        open_until DOUBLE PRECISION,
        cooldown_s DOUBLE PRECISION,
        updated_at DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE sessions (
        session        TEXT PRIMARY KEY,
        durable_id     TEXT NOT NULL,
        owner_instance TEXT NOT NULL,
        owner_epoch    INTEGER NOT NULL,
        lease_until    DOUBLE PRECISION NOT NULL,
        created_at     DOUBLE PRECISION NOT NULL,
        updated_at     DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE spool (
        attempt_id BIGINT NOT NULL REFERENCES attempts(attempt_id) ON DELETE CASCADE,
        seq        INTEGER NOT NULL,
        data       BYTEA NOT NULL,
        PRIMARY KEY (attempt_id, seq)
    );
    CREATE TABLE control_audit (
        audit_id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        at       DOUBLE PRECISION NOT NULL,
        action   TEXT NOT NULL,
        target   TEXT NOT NULL,
        actor    TEXT NOT NULL,
        before   TEXT,
        after    TEXT
    );
    CREATE INDEX control_audit_at ON control_audit(at);
    INSERT INTO meta (key, value) VALUES ('generation', md5(random()::text || clock_timestamp()::text))
        ON CONFLICT (key) DO NOTHING;
    """,
    # The SQLite ledger's schema 5: each attempt's transport.
    2: """
    ALTER TABLE attempts ADD COLUMN transport TEXT NOT NULL DEFAULT 'http';
    """,
    # The SQLite ledger's schema 6: the recordings that can still be replayed, by end (purged
    # past the replay window by purge_recordings).
    3: """
    CREATE INDEX attempts_replayable ON attempts(ended_at) WHERE replayable = 1;
    """,
}

_CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)


def _ended_while_idle(db: psycopg.Connection) -> bool:
    """An idle connection with something to read: the server ended it (its FATAL message and
    the end of the stream wait there: pg_terminate_backend, a pooler, idle_session_timeout, a
    restart). Nothing else is sent to an idle connection that does not LISTEN, bar a rare
    notice or parameter change; then it is only made again needlessly."""
    if db.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return False
    try:  # poll, not select: a busy mitmproxy has descriptors past select's 1024
        waiting = select.poll()
        waiting.register(db.fileno(), select.POLLIN)
        return bool(waiting.poll(0))
    except (OSError, ValueError, psycopg.Error):
        return True


def lock_key(kind: str, key: str) -> int:
    """A signed 64-bit advisory lock key for ``kind:key`` (a collision only serializes two
    unrelated claims, never mixes them)."""
    digest = hashlib.blake2b(f"{kind}:{key}".encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big", signed=True)


def _wrap(fn):
    """Run a ledger method, retrying a transaction PostgreSQL aborted to break a deadlock or a
    serialization conflict; any other database error becomes ``LedgerError`` (a broken
    connection is dropped, to be made again by the next call)."""

    @functools.wraps(fn)
    def wrapper(self: "PgLedger", *args, **kwargs):
        for attempt in range(TRANSIENT_RETRIES):
            try:
                return fn(self, *args, **kwargs)
            except (pg_errors.DeadlockDetected, pg_errors.SerializationFailure) as e:
                self._rollback()
                if attempt == TRANSIENT_RETRIES - 1:
                    raise LedgerError(self._message(e)) from None
            except psycopg.Error as e:
                self._after_error(e)
                raise LedgerError(self._message(e)) from None
        raise AssertionError("unreachable")

    return wrapper


def _check_generation(path: str, found: str, expected: str) -> None:
    """Raises ``LedgerError`` when the database read (generation ``found``) is not the one
    opened (``expected``): it was dropped and made again, what it says is another's."""
    if found != expected:
        raise LedgerError(f"ledger database {path} was replaced")


class _ReaderBroke(LedgerError):
    """A read apart failed because its connection broke (``PgLedger.read_apart``)."""


class _Transaction:
    """``BEGIN`` with the call's timeouts (one round trip) ... ``COMMIT``; rolls back on any
    exception. ``claimed`` lists the attempts this transaction claimed (attempt id, operation):
    if the connection breaks before the commit is known to have landed, the ledger gives them
    back later.

    In the same round trip as ``BEGIN`` it reads the database's generation (``checked``,
    once the ledger has one): a database whose tables were dropped and made again while this
    connection stayed open is another ledger, and nothing of this process is written there
    before it has noticed (``file_replaced`` says so and this raises). Else an attempt's end
    or first event, written by its id, would land on another attempt of the new tables (their
    ids start again), and an end would be lost, its turn then run again elsewhere."""

    def __init__(self, ledger: "PgLedger", lock: int | None, checked: bool = True):
        self.ledger = ledger
        self.lock = lock
        self.checked = checked and bool(ledger.generation)
        self.claimed: list[tuple[int, str]] = []

    def __enter__(self) -> "_Transaction":
        ledger = self.ledger
        kept = ledger._db
        db = ledger._conn()
        ms = max(1, int(ledger._timeout_ms))
        begin = (f"BEGIN; SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}")
        if self.lock is not None:
            begin += f"; SELECT pg_advisory_xact_lock({int(self.lock)})"
        if self.checked:
            begin += "; SELECT value FROM meta WHERE key='generation'"
        try:
            try:
                cur = db.execute(begin)
            except _CONNECTION_ERRORS:
                if db is not kept or not (db.broken or db.closed):
                    raise
                # A kept connection the server ended while it was idle (pg_terminate_backend,
                # a pooler, idle_session_timeout, a restart): nothing of this transaction ran,
                # and the server may well be up. Made again once, rather than deciding
                # without it.
                ledger._drop()
                db = ledger._conn()
                cur = db.execute(begin)
        except pg_errors.UndefinedTable:  # (on the connection made again too)
            ledger._rollback()
            ledger._still_the_one_opened("")  # its tables are gone: raises
            raise
        if self.checked:
            while cur.nextset():
                pass
            row = cur.fetchone()
            generation = row[0] if row else ""
            if generation != ledger.generation:
                ledger._rollback()
                ledger._still_the_one_opened(generation)
        self.db = db
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
            except _CONNECTION_ERRORS:
                self.ledger._doubtful_claims.extend(self.claimed)
                raise
            return
        if isinstance(exc, _CONNECTION_ERRORS):
            self.ledger._doubtful_claims.extend(self.claimed)
        self.ledger._rollback()


class PgLedger:
    """One connection to a PostgreSQL ledger, used from one thread at a time (the addon runs it
    on the ledger's thread: ``ledger_runner.LedgerRunner(..., fast_path=False)``)."""

    def __init__(
        self, url: str, instance_id: str, *, busy_timeout_ms: int = 5000,
        identity: liveness.ProcessIdentity | None = None,
    ):
        self._url = url
        self.path = display(url)  # shown in logs and status: never the password
        self.instance_id = instance_id
        self.identity = identity or liveness.read_process_identity()
        self._busy_timeout_ms = busy_timeout_ms
        self._timeout_ms: float = busy_timeout_ms
        self._db: psycopg.Connection | None = None
        self._opened = False
        self._readonly = False
        self._replaced: str | None = None
        self._doubtful_claims: list[tuple[int, str]] = []
        self._session_ms: int | None = None  # the connection's own statement and lock timeout
        # read-only connections kept for reads apart (``read_apart``), at most READERS_KEPT
        self._readers: list[PgLedger] = []
        self._readers_lock = threading.Lock()
        self.generation = ""
        self.incarnation = 0

    def _message(self, error: Exception) -> str:
        """An error as a ``LedgerError``'s message: never the URL's password (libpq may echo
        part of a connection string it cannot parse)."""
        return scrub(f"{type(error).__name__}: {str(error).strip()}", self._url)

    # -- connecting ----------------------------------------------------------------------------
    def _connect(self) -> psycopg.Connection:
        kwargs = {"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S,
                  "application_name": "turnguard"}
        return psycopg.connect(self._url, **kwargs, **_TCP_OPTIONS)  # ignored on a Unix socket

    def _conn(self) -> psycopg.Connection:
        """The connection, made again if it broke; a database that is no longer the one opened
        (another generation) is an error, never an empty ledger."""
        if not self._opened:
            raise psycopg.OperationalError("ledger is not open")
        if self._replaced is not None:
            raise psycopg.OperationalError(self._replaced)
        if self._db is not None and not self._db.closed and not self._db.broken \
                and not _ended_while_idle(self._db):
            return self._db
        self._drop()
        db = self._connect()
        try:
            self._bound(db)  # the reads below too: a locked meta never holds the thread
            if self._readonly:
                db.execute("SET default_transaction_read_only = on")
            generation = _generation(db)
            self._still_the_one_opened(generation)
        except BaseException:
            db.close()
            raise
        self._db = db
        return db

    def _still_the_one_opened(self, generation: str) -> None:
        """Raise when ``generation``, the database's as just read, is not the one opened (its
        tables dropped and made again): ``file_replaced`` says so from then on."""
        if generation != self.generation:
            self._replaced = (f"ledger database {self.path} was replaced (generation "
                              f"{generation or 'none'}, opened {self.generation})")
            raise psycopg.OperationalError(self._replaced)

    def _read(self) -> psycopg.Connection:
        """The connection for a read outside a transaction, its statements bounded by the
        call's timeout (``set_busy_timeout``) as a transaction's are (``SET LOCAL``): a table
        another session holds locked (``LOCK TABLE ... ACCESS EXCLUSIVE``, ``VACUUM FULL``)
        fails the read within the call's bound, never holding the ledger's thread, and every
        call queued behind it (other turns' claims), until the lock goes."""
        db = self._conn()
        self._bound(db)
        return db

    def _bound(self, db: psycopg.Connection) -> None:
        """Make the call's timeout the session's own ``statement_timeout`` and
        ``lock_timeout`` (one round trip, only when it changed)."""
        ms = max(1, int(self._timeout_ms))
        if ms != self._session_ms:
            db.execute(f"SET statement_timeout = {ms}; SET lock_timeout = {ms}")
            self._session_ms = ms

    @property
    def claims_in_doubt_pending(self) -> bool:
        """Claims are in doubt (``claims_in_doubt`` has not told of them yet); read from any
        thread."""
        return bool(self._doubtful_claims)

    def claims_in_doubt_left(self) -> list[tuple[int, str]]:
        """The claims in doubt ``claims_in_doubt`` has not told, taken out of this ledger (it
        is closed: another connection settles them)."""
        left = list(self._doubtful_claims)
        del self._doubtful_claims[:len(left)]
        return left

    @_wrap
    def claims_in_doubt(self) -> list[tuple[int, str]]:
        """The claims whose commit was in doubt when the connection broke that landed and are
        still their operation's attempt in flight, as ``(attempt_id, op_key)``; told once.
        Their requests were decided without them (in memory), and may be running: the caller
        makes each the row of the attempt it runs of the operation, or gives it back."""
        doubtful = list(self._doubtful_claims)
        landed = []
        with self._tx() as tx:
            for attempt_id, op_key in doubtful:
                if tx.db.execute(
                        "SELECT 1 FROM operations WHERE op_key=%s AND state='in_flight'"
                        " AND current_attempt=%s", (op_key, attempt_id)).fetchone():
                    landed.append((attempt_id, op_key))
        del self._doubtful_claims[:len(doubtful)]
        return landed

    def _drop(self) -> None:
        self._session_ms = None
        if self._db is not None:
            try:
                self._db.close()
            except psycopg.Error:
                pass
            self._db = None

    def _after_error(self, error: psycopg.Error) -> None:
        # a write refused as read-only: the connection's session was made read-only (the
        # database's or role's default_transaction_read_only when it was made, or a standby):
        # made again, it takes the database as it is now, writable once the fault is over
        refused = isinstance(error, pg_errors.ReadOnlySqlTransaction) and not self._readonly
        if refused or isinstance(error, _CONNECTION_ERRORS) \
                or (self._db is not None and self._db.broken):
            self._drop()
        else:
            self._rollback()

    def _rollback(self) -> None:
        db = self._db
        if db is None or db.closed:
            return
        try:
            if db.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                db.execute("ROLLBACK")
        except psycopg.Error:
            self._drop()

    def _tx(self, lock: int | None = None, *, checked: bool = True) -> _Transaction:
        return _Transaction(self, lock, checked)

    # -- opening -------------------------------------------------------------------------------
    @_wrap
    def open(self, now: float, *, register: bool = True) -> None:
        """Connect, migrate the schema (once, whoever else starts now) and register this
        instance (``register=False``: a control tool, no ``instances`` row)."""
        db = self._connect()
        try:
            self._db, self._opened, self._session_ms = db, True, None
            self._bound(db)
            self._migrate(db)
            self.generation = _generation(db)
            if db.execute("SHOW synchronous_commit").fetchone()[0] == "off":
                logger.warning("turnguard: ledger %s runs with synchronous_commit=off: a server "
                               "crash may lose claims it acknowledged (an operation could then "
                               "run twice); turn it on for the ledger's database", self.path)
            if register:
                with self._tx() as tx:
                    self.incarnation = self._register(tx, now, keep_incarnation=True)
        except BaseException:
            self.close()
            raise

    @_wrap
    def open_readonly(self) -> None:
        """Connect for reading only: no migration, no instance row. ``LedgerError`` when the
        database holds no turnguard ledger of this schema version."""
        db = self._connect()
        try:
            self._session_ms = None
            self._bound(db)
            db.execute("SET default_transaction_read_only = on")
            version = _schema_version(db)
            if version != SCHEMA_VERSION:
                hint = " (not a turnguard ledger, or never opened by it)" if version == 0 else ""
                raise LedgerError(f"ledger {self.path} has schema version {version}; this "
                                  f"turnguard reads version {SCHEMA_VERSION}{hint}")
            self.generation = _generation(db)
            self._db, self._opened, self._readonly = db, True, True
        except BaseException:
            db.close()
            raise

    def _migrate(self, db: psycopg.Connection) -> None:
        """Bring the schema to ``SCHEMA_VERSION``, one step per transaction under the migration
        lock: processes that start together migrate once."""
        while True:
            with self._tx(MIGRATION_LOCK):
                db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                version = _schema_version(db)
                if version > SCHEMA_VERSION:
                    raise psycopg.DataError(f"ledger schema version {version} is newer than this "
                                            f"turnguard ({SCHEMA_VERSION})")
                if version == SCHEMA_VERSION:
                    return
                db.execute(_MIGRATIONS[version + 1])
                db.execute(
                    "INSERT INTO meta (key, value) VALUES ('schema_version', %s) ON CONFLICT (key)"
                    " DO UPDATE SET value = excluded.value", (str(version + 1),))

    def read_apart(self, read: Callable[["PgLedger"], T]) -> T:
        """``read(ledger)`` on a read-only connection of its own, from any thread (see
        ``Ledger.read_apart``): never queued behind this connection's calls. Raises
        ``LedgerError``, also when the database is not the one opened (its generation, read
        each time).

        Such connections are kept (``READERS_KEPT`` at most) for the next read: connecting
        costs a server process each time (about 6 ms here, 28 ms on a busy machine, against
        0.4 and 12 ms on a kept one), and reads apart come in an outage, many at once. One
        that fails is closed, never kept, and a kept one whose connection broke (the server
        ended it while it waited) gives way to a new one; ``close`` closes them all."""
        with self._readers_lock:
            reader = self._readers.pop() if self._readers else None
        if reader is not None:
            try:
                return self._read_on(reader, read)
            except _ReaderBroke:
                pass  # (the server ended it while it was kept: a new one reads)
        reader = PgLedger(self._url, self.instance_id, busy_timeout_ms=READ_APART_BUSY_MS,
                          identity=self.identity)
        reader.open_readonly()
        return self._read_on(reader, read)

    def _read_on(self, reader: "PgLedger", read: Callable[["PgLedger"], T]) -> T:
        """``read(reader)``, once the database is still the one opened; ``reader`` kept after
        (``READERS_KEPT``), or closed. ``_ReaderBroke`` when its connection broke."""
        kept = False
        try:
            _check_generation(self.path, reader.generation_now(), self.generation)
            found = read(reader)
            kept = self._keep_reader(reader)
            return found
        except LedgerError as e:
            if reader._db is None:  # (dropped: its connection broke, ``_after_error``)
                raise _ReaderBroke(str(e)) from None
            raise
        finally:
            if not kept:
                reader.close()

    def _keep_reader(self, reader: "PgLedger") -> bool:
        with self._readers_lock:
            if not self._opened or len(self._readers) >= READERS_KEPT:
                return False
            self._readers.append(reader)
            return True

    @_wrap
    def generation_now(self) -> str:
        """The database's generation as it is now (one query)."""
        return _generation(self._read())

    @classmethod
    def read_at(cls, url: str, instance_id: str, read: Callable[["PgLedger"], T], *,
                identity: liveness.ProcessIdentity | None = None,
                busy_timeout_ms: int = READ_APART_BUSY_MS, generation: str | None = None) -> T:
        """``read(ledger)`` on a short-lived read-only connection (``open_readonly``: its
        ``generation`` the database's) to the ledger at ``url``, its statements bounded by
        ``busy_timeout_ms``; when ``generation`` is given, only if the database is of that
        generation (see ``Ledger.read_at``). Raises ``LedgerError``."""
        other = cls(url, instance_id, busy_timeout_ms=busy_timeout_ms, identity=identity)
        other.open_readonly()
        try:
            if generation is not None:
                _check_generation(display(url), other.generation, generation)
            return read(other)
        finally:
            other.close()

    def read_was_stable(self) -> bool:
        """Always: PostgreSQL's reads need no second look (see ``Ledger.read_was_stable``)."""
        return True

    def set_busy_timeout(self, ms: int | None) -> None:
        """How long the next call's statements may wait for a lock (None: the ledger's own);
        applied with the call's transaction, no round trip of its own."""
        self._timeout_ms = self._busy_timeout_ms if ms is None else ms

    def close(self) -> None:
        with self._readers_lock:
            self._opened = False
            readers, self._readers = self._readers, []
        for reader in readers:
            reader.close()
        self._drop()

    @property
    def busy_timeout_ms(self) -> int:
        return self._busy_timeout_ms

    @property
    def is_open(self) -> bool:
        return self._opened

    def file_replaced(self) -> str | None:
        """Why the database is no longer the one opened (found at a reconnection or a
        heartbeat), or None. No query of its own."""
        return self._replaced

    def sidecar_gone(self) -> str | None:
        """A server keeps no file beside the database: never (see ``Ledger.sidecar_gone``)."""
        return None

    # -- admission -----------------------------------------------------------------------------
    @_wrap
    def admit(
        self, identity: Identity, *, method: str, path: str, now: float,
        guard: policy.GuardPolicy, flow_id: str | None, circuit_scope: str | None = None,
        recovery: policy.RecoveryClaim | None = None, once_mode: bool = False,
        transport: str = "http",
    ) -> policy.Admission:
        """See ``Ledger.admit``. Four round trips for a claim: the lock (with ``BEGIN``), one read
        of the operation, its circuit and the database's generation, the claim, ``COMMIT``.

        A database whose tables were dropped and made again (another turnguard, an operator's
        restore) while this connection stayed open is another ledger: nothing is decided from
        it, nor claimed in it, before this process has noticed (``file_replaced`` says so and
        this raises), as an SQLite ledger's file is checked before each call. Else a duplicate
        of a turn in flight in a peer that has not registered it there yet (a peer notices at
        its next heartbeat) would be taken for new and dispatched a second time."""
        # the generation is read with the snapshot: the claim's one read
        with self._tx(lock_key("op", identity.op_key), checked=False) as tx:
            db = tx.db
            snapshot, state, generation = self._snapshot_and_circuit(
                db, identity.op_key, circuit_scope)
            self._still_the_one_opened(generation)
            remaining = state.remaining_s(now)
            owner_ok = True
            if recovery is not None:
                owner_ok = self._owns_for_recovery(db, recovery.session, recovery.epoch, now)
            decision = policy.admit(
                snapshot, fingerprint=identity.fingerprint,
                has_idempotency_key=identity.idempotency_key is not None, now=now,
                policy=guard, circuit_remaining_s=remaining,
                recovery_once=None if recovery is None else recovery.once,
                owner_ok=owner_ok, once_mode=once_mode, circuit_open_until=state.open_until,
                has_session=identity.session is not None,
            )
            if not isinstance(decision, policy.Dispatch):
                return decision
            if snapshot is None:
                attempt_id = self._create_claimed(tx, identity, method, path, circuit_scope,
                                                  decision.kind, flow_id, now, transport)
            else:
                attempt_id = self._claim(tx, identity, decision.kind, flow_id, now, transport)
            return policy.Dispatch(decision.kind, attempt_id)

    @staticmethod
    def _snapshot_and_circuit(
        db: psycopg.Connection, op_key: str, circuit_scope: str | None,
    ) -> tuple[policy.OperationSnapshot | None, circuit.CircuitState, str]:
        """The operation (None: unknown), the circuit of ``circuit_scope`` (closed when
        never seen, or no scope) and the database's generation ("" if none), in one read."""
        row = db.execute(
            "SELECT c.failures, c.open_until, c.cooldown_s, o.op_key IS NOT NULL, o.state,"
            " o.fingerprint, o.current_attempt, a.instance_id, o.ended_at, o.replay_attempt,"
            " o.events_seen, o.recovery_dispatches,"
            " (SELECT value FROM meta WHERE key='generation') FROM (SELECT %s::text AS op_key,"
            " %s::text AS scope) k LEFT JOIN operations o ON o.op_key = k.op_key"
            " LEFT JOIN attempts a ON a.attempt_id = o.current_attempt"
            " LEFT JOIN circuits c ON c.scope = k.scope",
            (op_key, circuit_scope),
        ).fetchone()
        state = circuit.CircuitState(*row[:3]) if row[0] is not None else circuit.CircuitState()
        return (policy.OperationSnapshot(*row[4:12]) if row[3] else None), state, row[12] or ""

    def _create_claimed(
        self, tx: _Transaction, identity: Identity, method: str, path: str,
        circuit_scope: str | None, kind: str, flow_id: str | None, now: float, transport: str,
    ) -> int:
        """A new operation with its first attempt in flight, in one statement (the caller holds
        the operation's lock and saw no row; the attempt's foreign key is checked at the
        statement's end, when both rows exist)."""
        attempt_id = tx.db.execute(
            "WITH a AS (INSERT INTO attempts (op_key, kind, instance_id, flow_id, started_at,"
            " transport) VALUES (%s,%s,%s,%s,%s,%s) RETURNING attempt_id)"
            " INSERT INTO operations (op_key, scope, session, method, path, idempotency_key,"
            " fingerprint, turn_state, previous_response_id, state, current_attempt, attempts,"
            " recovery_dispatches, circuit_scope, created_at, updated_at)"
            " SELECT %s,%s,%s,%s,%s,%s,%s,%s,%s,'in_flight',a.attempt_id,1,%s,%s,%s,%s FROM a"
            " RETURNING current_attempt",
            (identity.op_key, kind, self.instance_id, _text(flow_id), now, _text(transport),
             identity.op_key, identity.scope, identity.session, _text(method), _text(path),
             identity.idempotency_key, identity.fingerprint, identity.turn_state,
             _text(identity.previous_response_id), 1 if kind == "recovery" else 0,
             circuit_scope, now, now),
        ).fetchone()[0]
        tx.claimed.append((attempt_id, identity.op_key))
        return attempt_id

    @_wrap
    def adopt_attempt(
        self, identity: Identity, *, method: str, path: str, kind: str, flow_id: str | None,
        now: float, circuit_scope: str | None = None, transport: str = "http",
        ended: tuple[int, ...] = (),
    ) -> int | None:
        """See ``Ledger.adopt_attempt``."""
        with self._tx(lock_key("op", identity.op_key)) as tx:
            snapshot = self._snapshot(tx.db, identity.op_key)
            if snapshot is not None and snapshot.state == "in_flight":
                if snapshot.owner_instance != self.instance_id \
                        or snapshot.current_attempt not in ended:
                    return None
                self._finish(tx, snapshot.current_attempt, _superseded(snapshot), now, None,
                             False, identity.op_key)
            if snapshot is None:
                self._insert_operation(tx.db, identity, method, path, circuit_scope, now)
            return self._claim(tx, identity, kind, flow_id, now, transport)

    @staticmethod
    def _insert_operation(
        db: psycopg.Connection, identity: Identity, method: str, path: str,
        circuit_scope: str | None, now: float,
    ) -> None:
        db.execute(
            "INSERT INTO operations (op_key, scope, session, method, path, idempotency_key,"
            " fingerprint, turn_state, previous_response_id, state, circuit_scope,"
            " created_at, updated_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,'new',%s,%s,%s)",
            (identity.op_key, identity.scope, identity.session, _text(method), _text(path),
             identity.idempotency_key, identity.fingerprint, identity.turn_state,
             _text(identity.previous_response_id), circuit_scope, now, now),
        )

    def _claim(self, tx: _Transaction, identity: Identity, kind: str, flow_id: str | None,
               now: float, transport: str) -> int:
        """A new attempt, made the operation's current one, in one statement (the caller holds
        the operation's lock and saw it not in flight)."""
        claimed = tx.db.execute(
            "WITH a AS (INSERT INTO attempts (op_key, kind, instance_id, flow_id, started_at,"
            " transport) VALUES (%s,%s,%s,%s,%s,%s) RETURNING attempt_id)"
            " UPDATE operations SET state='in_flight', current_attempt=a.attempt_id,"
            " attempts=attempts+1, recovery_dispatches=recovery_dispatches+%s, fingerprint=%s,"
            " turn_state=%s, previous_response_id=%s, updated_at=%s, ended_at=NULL FROM a"
            " WHERE op_key=%s AND state<>'in_flight' RETURNING a.attempt_id",
            (identity.op_key, kind, self.instance_id, _text(flow_id), now, _text(transport),
             1 if kind == "recovery" else 0, identity.fingerprint, identity.turn_state,
             _text(identity.previous_response_id), now, identity.op_key),
        ).fetchone()
        if claimed is None:  # cannot happen under the operation's lock; refuse rather than double
            raise psycopg.IntegrityError("operation was claimed concurrently")
        tx.claimed.append((claimed[0], identity.op_key))
        return claimed[0]

    @staticmethod
    def _snapshot(db: psycopg.Connection, op_key: str) -> policy.OperationSnapshot | None:
        row = db.execute(
            "SELECT o.state, o.fingerprint, o.current_attempt, a.instance_id, o.ended_at,"
            " o.replay_attempt, o.events_seen, o.recovery_dispatches"
            " FROM operations o LEFT JOIN attempts a"
            " ON a.attempt_id = o.current_attempt WHERE o.op_key=%s",
            (op_key,),
        ).fetchone()
        return None if row is None else policy.OperationSnapshot(*row)

    @_wrap
    def snapshot(self, op_key: str) -> policy.OperationSnapshot | None:
        """The operation's state now (read only). Also what a process polls for while it
        cannot be notified (see ``AttemptEndListener``)."""
        return self._snapshot(self._read(), op_key)

    # -- attempts ------------------------------------------------------------------------------
    @_wrap
    def first_event(self, attempt_id: int, op_key: str | None = None) -> None:
        """See ``Ledger.first_event``."""
        with self._tx() as tx:
            row = tx.db.execute(
                "UPDATE attempts SET events_seen=GREATEST(events_seen, 1)"
                " WHERE attempt_id=%s AND op_key=COALESCE(%s, op_key) RETURNING op_key",
                (attempt_id, op_key),
            ).fetchone()
            if row is not None:
                tx.db.execute(
                    "UPDATE operations SET events_seen=GREATEST(events_seen, 1) WHERE op_key=%s",
                    row)

    @_wrap
    def finish(
        self, attempt_id: int, end: AttemptEnd, *, now: float,
        circuit_cfg: circuit.CircuitConfig | None = None, eventless_failure: bool = False,
        op_key: str | None = None,
    ) -> FinishResult:
        """See ``Ledger.finish``; also notifies the processes holding its duplicates."""
        with self._tx() as tx:
            return self._finish(tx, attempt_id, end, now, circuit_cfg, eventless_failure,
                                op_key)

    @_wrap
    def record_offline_attempt(
        self, identity: Identity, *, method: str, path: str, kind: str, flow_id: str | None,
        circuit_scope: str | None, end: AttemptEnd, now: float,
        circuit_cfg: circuit.CircuitConfig | None = None, eventless_failure: bool = False,
        transport: str = "http", running: tuple[int, ...] = (), moving: bool = False,
    ) -> FinishResult:
        """See ``Ledger.record_offline_attempt``."""
        with self._tx(lock_key("op", identity.op_key)) as tx:
            snapshot = self._snapshot(tx.db, identity.op_key)
            if moving and snapshot is not None and snapshot.state in ("in_flight", "completed"):
                return FinishResult(False)
            if snapshot is not None and snapshot.state == "in_flight":
                if (snapshot.owner_instance != self.instance_id
                        or snapshot.current_attempt is None
                        or snapshot.current_attempt in running):
                    return FinishResult(False)
                return self._finish(tx, snapshot.current_attempt, end, now, circuit_cfg,
                                    eventless_failure, identity.op_key)
            if snapshot is None:
                self._insert_operation(tx.db, identity, method, path, circuit_scope, now)
            attempt_id = self._claim(tx, identity, kind, flow_id, now, transport)
            tx.claimed.remove((attempt_id, identity.op_key))  # ended here: nothing to give back
            return self._finish(tx, attempt_id, end, now, circuit_cfg, eventless_failure,
                                identity.op_key)

    def _finish(
        self, tx: _Transaction, attempt_id: int, end: AttemptEnd, now: float,
        circuit_cfg: circuit.CircuitConfig | None, eventless_failure: bool, op_key: str | None,
    ) -> FinishResult:
        db, rec = tx.db, end.recording
        row = db.execute(
            "UPDATE attempts SET ended_at=%s, status=%s, events_seen=GREATEST(events_seen, %s),"
            " outcome=%s, detail=%s, headers=%s, body_bytes=%s, replayable=%s, vary_key=%s"
            " WHERE attempt_id=%s AND op_key=COALESCE(%s, op_key) AND outcome='in_flight'"
            " RETURNING op_key",
            (now, end.status, end.events_seen, end.outcome, _text(end.detail),
             json.dumps(rec.headers) if rec else None, len(rec.body) if rec else None,
             1 if rec else 0, rec.vary_key if rec else None, attempt_id, op_key),
        ).fetchone()
        if row is None:
            db.execute(
                "UPDATE attempts SET late_outcome=%s WHERE attempt_id=%s"
                " AND op_key=COALESCE(%s, op_key) AND late_outcome IS NULL",
                (end.outcome, attempt_id, op_key))
            return FinishResult(False)
        if rec is not None:
            self._spool(db, attempt_id, rec.body)
        moved = db.execute(
            "UPDATE operations SET state=%s, updated_at=%s, ended_at=%s,"
            " events_seen=GREATEST(events_seen, %s), replay_attempt=%s"
            " WHERE op_key=%s AND current_attempt=%s"
            f" RETURNING circuit_scope, {_NOTIFY}",
            (end.outcome, now, now, end.events_seen,
             attempt_id if rec is not None else None, row[0], attempt_id),
        ).fetchone()
        if moved is None:
            return FinishResult(False)
        if circuit_cfg is None or moved[0] is None:
            return FinishResult(True)
        return self._feed_circuit(db, moved[0], end, now, circuit_cfg, eventless_failure)

    def _feed_circuit(
        self, db: psycopg.Connection, scope: str, end: AttemptEnd, now: float,
        cfg: circuit.CircuitConfig, eventless_failure: bool,
    ) -> FinishResult:
        """The attempt's end, fed to its circuit with the circuit's row locked: every replica's
        failure counts (no lost update)."""
        row = db.execute(  # made if missing, and locked either way: one round trip
            "INSERT INTO circuits AS c (scope, failures, updated_at) VALUES (%s, 0, %s)"
            " ON CONFLICT (scope) DO UPDATE SET scope = c.scope"
            " RETURNING failures, open_until, cooldown_s", (scope, now)).fetchone()
        before = circuit.CircuitState(*row)
        after, transition = circuit.record_outcome(
            before, eventless_failure=eventless_failure,
            completed=end.outcome == "completed", now=now, cfg=cfg,
        )
        if after != before:
            db.execute(
                "UPDATE circuits SET failures=%s, open_until=%s, cooldown_s=%s, updated_at=%s"
                " WHERE scope=%s",
                (after.failures, after.open_until, after.cooldown_s, now, scope))
        return FinishResult(True, scope, after, transition)

    @staticmethod
    def _spool(db: psycopg.Connection, attempt_id: int, body: bytes) -> None:
        with db.cursor() as cur:
            cur.executemany(
                "INSERT INTO spool (attempt_id, seq, data) VALUES (%s,%s,%s)",
                [(attempt_id, i, body[off: off + SPOOL_CHUNK])
                 for i, off in enumerate(range(0, max(len(body), 1), SPOOL_CHUNK))],
            )

    @staticmethod
    def _circuit(db: psycopg.Connection, scope: str, *, lock: bool = False) -> circuit.CircuitState:
        row = db.execute(
            "SELECT failures, open_until, cooldown_s FROM circuits WHERE scope=%s"
            + (" FOR UPDATE" if lock else ""), (scope,),
        ).fetchone()
        return circuit.CircuitState(*row) if row else circuit.CircuitState()

    @_wrap
    def circuit_state(self, scope: str) -> circuit.CircuitState:
        return self._circuit(self._read(), scope)

    @_wrap
    def open_circuits(self, now: float) -> list[tuple[str, circuit.CircuitState]]:
        rows = self._read().execute(
            "SELECT scope, failures, open_until, cooldown_s FROM circuits WHERE open_until>%s",
            (now,)).fetchall()
        return [(r[0], circuit.CircuitState(*r[1:])) for r in rows]

    # -- durable sessions ----------------------------------------------------------------------
    @staticmethod
    def _session(db: psycopg.Connection, session: str, *, lock: str = "") -> policy.SessionOwnership | None:
        row = db.execute(
            "SELECT durable_id, owner_instance, owner_epoch, lease_until FROM sessions"
            " WHERE session=%s" + (f" FOR {lock}" if lock else ""), (session,),
        ).fetchone()
        return policy.SessionOwnership(*row) if row else None

    def _owns(self, db: psycopg.Connection, session: str, epoch: int, *, lock: bool = False) -> bool:
        row = self._session(db, session, lock="SHARE" if lock else "")
        return row is not None and (row.owner_instance, row.owner_epoch) == (self.instance_id, epoch)

    def _owns_for_recovery(self, db: psycopg.Connection, session: str, epoch: int,
                           now: float) -> bool:
        """See ``Ledger._owns_for_recovery``: a database made again that has no row of the
        session gets it again, owned by this instance at ``epoch`` (its lease ending now);
        one inserted meanwhile by another instance decides as any row."""
        if db.execute(
            "INSERT INTO sessions (session, durable_id, owner_instance, owner_epoch,"
            " lease_until, created_at, updated_at) VALUES (%s,%s,%s,%s,%s,%s,%s)"
            " ON CONFLICT (session) DO NOTHING RETURNING session",
            (session, uuid.uuid4().hex, self.instance_id, epoch, now, now, now),
        ).fetchone() is not None:
            return True
        return self._owns(db, session, epoch, lock=True)

    @_wrap
    def claim_session(
        self, session: str, *, now: float, lease_s: float, new_id: str
    ) -> tuple[policy.SessionOwnership, policy.SessionClaimResult]:
        """See ``Ledger.claim_session``: the row is read ``FOR UPDATE`` (a session created by
        another process meanwhile is read again, once)."""
        with self._tx() as tx:
            db = tx.db
            for _ in range(2):
                before = self._session(db, session, lock="UPDATE")
                after, result = policy.claim_session(
                    before, instance=self.instance_id, now=now, lease_s=lease_s, new_id=new_id)
                if result == "owned_by_other":
                    return after, result
                if before is None:
                    if db.execute(
                        "INSERT INTO sessions (session, durable_id, owner_instance, owner_epoch,"
                        " lease_until, created_at, updated_at) VALUES (%s,%s,%s,%s,%s,%s,%s)"
                        " ON CONFLICT (session) DO NOTHING RETURNING session",
                        (session, after.durable_id, after.owner_instance, after.owner_epoch,
                         after.lease_until, now, now),
                    ).fetchone() is None:
                        continue  # created by another process meanwhile: decide again
                    return after, result
                db.execute(
                    "UPDATE sessions SET owner_instance=%s, owner_epoch=%s, lease_until=%s,"
                    " updated_at=%s WHERE session=%s",
                    (after.owner_instance, after.owner_epoch, after.lease_until, now, session))
                return after, result
            raise psycopg.IntegrityError("session claimed concurrently")

    @_wrap
    def session_owned_by(self, session: str, instance_id: str, epoch: int) -> bool:
        row = self._session(self._read(), session)
        return row is not None and (row.owner_instance, row.owner_epoch) == (instance_id, epoch)

    @_wrap
    def renew_session(self, session: str, epoch: int, *, now: float, lease_s: float) -> bool:
        """See ``Ledger.renew_session`` (a fenced write; a database made again that has no
        row of the session gets it again, owned by this instance at ``epoch``)."""
        with self._tx() as tx:
            if tx.db.execute(
                "UPDATE sessions SET lease_until=%s, updated_at=%s WHERE session=%s"
                " AND owner_instance=%s AND owner_epoch=%s RETURNING session",
                (now + lease_s, now, session, self.instance_id, epoch),
            ).fetchone() is not None:
                return True
            return tx.db.execute(
                "INSERT INTO sessions (session, durable_id, owner_instance, owner_epoch,"
                " lease_until, created_at, updated_at) VALUES (%s,%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (session) DO NOTHING RETURNING session",
                (session, uuid.uuid4().hex, self.instance_id, epoch, now + lease_s, now, now),
            ).fetchone() is not None

    @_wrap
    def recording(self, attempt_id: int, op_key: str | None = None) -> Recording | None:
        """See ``Ledger.recording``."""
        db = self._read()
        row = db.execute(
            "SELECT status, headers, vary_key, ended_at FROM attempts"
            " WHERE attempt_id=%s AND op_key=COALESCE(%s, op_key) AND replayable=1",
            (attempt_id, op_key)).fetchone()
        if row is None:
            return None
        body = b"".join(bytes(r[0]) for r in db.execute(
            "SELECT data FROM spool WHERE attempt_id=%s ORDER BY seq", (attempt_id,)))
        headers = tuple((str(k), str(v)) for k, v in json.loads(row[1] or "[]"))
        return Recording(row[0], headers, body, row[2], row[3])

    @_wrap
    def note_duplicates(self, counts: Iterable[tuple[str, int, int]]) -> None:
        with self._tx() as tx, tx.db.cursor() as cur:
            cur.executemany(
                "UPDATE operations SET duplicates_held=duplicates_held+%s,"
                " duplicates_replayed=duplicates_replayed+%s WHERE op_key=%s",
                [(held, replayed, op_key) for op_key, held, replayed in counts])

    # -- instances, restart, retention ---------------------------------------------------------
    def _register(self, tx: _Transaction, now: float, *, keep_incarnation: bool) -> int:
        me = self.identity
        return tx.db.execute(
            "INSERT INTO instances (instance_id, pid, host, started_at, heartbeat_at, boot_id,"
            " pid_ns, start_ticks, incarnation) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)"
            " ON CONFLICT (instance_id) DO UPDATE SET heartbeat_at=excluded.heartbeat_at,"
            " pid=excluded.pid, host=excluded.host, boot_id=excluded.boot_id,"
            " pid_ns=excluded.pid_ns, start_ticks=excluded.start_ticks,"
            " incarnation=CASE WHEN %s THEN instances.incarnation ELSE excluded.incarnation END"
            " RETURNING incarnation",
            (self.instance_id, me.pid, me.host, now, now, me.boot_id, me.pid_ns,
             me.start_ticks, self.incarnation + 1, keep_incarnation),
        ).fetchone()[0]

    @_wrap
    def heartbeat(self, now: float, *, as_probe: bool = False) -> HeartbeatResult:
        """See ``Ledger.heartbeat``. Also checks that the database is still the one opened
        (its generation): if not, ``file_replaced`` says so and this raises.

        ``as_probe``: first takes the lock a claim takes on ``operations`` and ``attempts``,
        waiting ``PROBE_LOCK_WAIT_MS`` at most (the call's bound, if shorter): another
        session's lock of those against writes (``LOCK TABLE ... IN EXCLUSIVE MODE``) lets
        ``instances`` be written, and the ledger was taken for usable again while no claim
        could be (each then waited for the lock, and the requests queued behind it were
        decided without the ledger)."""
        with self._tx() as tx:
            if as_probe:
                wait_ms = max(1, min(int(self._timeout_ms), PROBE_LOCK_WAIT_MS))
                tx.db.execute(f"SET LOCAL lock_timeout = {wait_ms};"
                              " LOCK TABLE operations, attempts IN ROW EXCLUSIVE MODE")
            if tx.db.execute("UPDATE instances SET heartbeat_at=%s WHERE instance_id=%s"
                             " RETURNING 1", (now, self.instance_id)).fetchone():
                return "renewed"
            self.incarnation = self._register(tx, now, keep_incarnation=False)
            return "reregistered"

    @_wrap
    def mark_moved(self, from_generation: str, now: float) -> None:
        """See ``Ledger.mark_moved``."""
        with self._tx() as tx:
            tx.db.execute(
                "INSERT INTO meta (key, value) VALUES (%s, %s)"
                " ON CONFLICT (key) DO UPDATE SET value=excluded.value",
                (moved_key(from_generation, self.instance_id), repr(now)))

    @_wrap
    def moved_peers(self, from_generation: str) -> set[str]:
        """See ``Ledger.moved_peers``."""
        prefix = moved_key(from_generation, "")
        rows = self._read().execute(
            "SELECT substr(key, %s) FROM meta WHERE left(key, %s) = %s",
            (len(prefix) + 1, len(prefix), prefix)).fetchall()
        return {r[0] for r in rows}

    @_wrap
    def peers_with_attempts_in_flight(self, *, or_replayable: bool = False
                                      ) -> list[liveness.PeerRow]:
        """See ``Ledger.peers_with_attempts_in_flight``."""
        rows = self._read().execute(
            "SELECT a.instance_id, COALESCE(i.host, ''), COALESCE(i.boot_id, ''),"
            " COALESCE(i.pid_ns, ''), COALESCE(i.pid, -1), i.start_ticks,"
            " COALESCE(i.heartbeat_at, MAX(a.started_at)) FROM attempts a LEFT JOIN instances i"
            " ON i.instance_id = a.instance_id"
            " WHERE (a.outcome='in_flight' OR (%s AND a.replayable=1)) AND a.instance_id<>%s"
            " GROUP BY a.instance_id, i.host, i.boot_id, i.pid_ns, i.pid, i.start_ticks,"
            " i.heartbeat_at",
            (or_replayable, self.instance_id)).fetchall()
        return [liveness.PeerRow(r[0], liveness.ProcessIdentity(r[1], r[2], r[3], r[4], r[5]), r[6])
                for r in rows]

    @_wrap
    def ops_in_flight_elsewhere(self) -> list[tuple[str, str]]:
        """See ``Ledger.ops_in_flight_elsewhere``."""
        rows = self._read().execute(
            "SELECT instance_id, op_key FROM attempts WHERE outcome='in_flight'"
            " AND instance_id<>%s", (self.instance_id,)).fetchall()
        return [(r[0], r[1]) for r in rows]

    @_wrap
    def ops_left_elsewhere(self) -> list[tuple[str, str, float | None]]:
        """See ``Ledger.ops_left_elsewhere``."""
        rows = self._read().execute(
            "SELECT instance_id, op_key,"
            " CASE WHEN outcome='in_flight' THEN NULL ELSE ended_at END FROM attempts"
            " WHERE (outcome='in_flight' OR replayable=1) AND instance_id<>%s",
            (self.instance_id,)).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    @_wrap
    def attempts_left_behind(self) -> tuple[list[liveness.PeerRow],
                                            list[tuple[str, str, float | None]]]:
        """See ``Ledger.attempts_left_behind``. The database's generation is read after the
        rows: tables dropped and made again since this process opened them (another
        turnguard made them, or a peer found them gone) hold nothing of the turns in flight
        in the old ones, so their rows are an error (``file_replaced``), never an answer
        that no peer had a turn in flight."""
        found = (self.peers_with_attempts_in_flight(or_replayable=True),
                 self.ops_left_elsewhere())
        self._still_the_one_opened(_generation(self._read()))
        return found

    @_wrap
    def end_stale_attempts(self, keep_ops: list[str], *, now: float) -> list[str]:
        """See ``Ledger.end_stale_attempts``."""
        with self._tx() as tx:
            db = tx.db
            ended = db.execute(
                "UPDATE attempts SET ended_at=%s, detail='ended by its owner in another file',"
                " outcome=CASE WHEN events_seen>0 THEN 'partial' ELSE 'unknown' END"
                " WHERE instance_id=%s AND outcome='in_flight' AND NOT (op_key = ANY(%s))"
                " RETURNING attempt_id, op_key, outcome",
                (now, self.instance_id, list(keep_ops))).fetchall()
            return _operations_ended_with(db, ended, now)

    @_wrap
    def reap_instance(self, instance_id: str, *, now: float,
                      heartbeat_was: float | None = None) -> list[str]:
        """See ``Ledger.reap_instance``. The instance's row is locked first, so a heartbeat
        that lands meanwhile is seen (a lease reap then does nothing)."""
        with self._tx(lock_key("instance", instance_id)) as tx:
            db = tx.db
            db.execute("SELECT 1 FROM instances WHERE instance_id=%s FOR UPDATE", (instance_id,))
            if heartbeat_was is not None:
                row = db.execute(
                    "SELECT COALESCE((SELECT heartbeat_at FROM instances WHERE instance_id=%s),"
                    " (SELECT MAX(started_at) FROM attempts WHERE instance_id=%s"
                    " AND outcome='in_flight'))",
                    (instance_id, instance_id)).fetchone()
                if row[0] != heartbeat_was:
                    return []
            ended = db.execute(
                "UPDATE attempts SET ended_at=%s, detail='owner process gone',"
                " outcome=CASE WHEN events_seen>0 THEN 'partial' ELSE 'unknown' END"
                " WHERE instance_id=%s AND outcome='in_flight' RETURNING attempt_id, op_key, outcome",
                (now, instance_id)).fetchall()
            moved = _operations_ended_with(db, ended, now)
            db.execute("DELETE FROM instances WHERE instance_id=%s", (instance_id,))
            return moved

    @_wrap
    def purge_recordings(self, *, now: float, window_s: float) -> int:
        """See ``Ledger.purge_recordings``."""
        with self._tx() as tx:
            purged = [row[0] for row in tx.db.execute(
                "UPDATE attempts SET replayable=0, headers=NULL WHERE replayable=1"
                " AND ended_at<%s AND EXISTS (SELECT 1 FROM operations o"
                " WHERE o.op_key=attempts.op_key AND o.idempotency_key IS NULL)"
                " RETURNING attempt_id",
                (now - window_s,),
            ).fetchall()]
            if purged:
                tx.db.execute("DELETE FROM spool WHERE attempt_id = ANY(%s)", (purged,))
            return len(purged)

    def checkpoint(self) -> WalState:
        """Nothing to do: PostgreSQL makes its own checkpoints (see ``Ledger.checkpoint``);
        there is no WAL file to empty (no frames)."""
        return WalState(0, 0)

    def truncate_wal(self) -> None:
        """Nothing to do (see ``checkpoint``)."""

    @_wrap
    def collect_garbage(self, *, now: float, retention_s: float, instance_stale_s: float) -> int:
        """See ``Ledger.collect_garbage`` (a spent once-claim stays as a tombstone for good)."""
        horizon = now - retention_s
        with self._tx() as tx:
            db = tx.db
            db.execute("DELETE FROM attempts WHERE op_key IN (SELECT op_key FROM operations"
                       f" WHERE {_SPENT} AND updated_at<%s)", (horizon,))
            n = db.execute("DELETE FROM operations WHERE state<>'in_flight' AND updated_at<%s"
                           f" AND NOT ({_SPENT})", (horizon,)).rowcount
            db.execute("DELETE FROM circuits WHERE updated_at<%s AND COALESCE(open_until, 0)<%s",
                       (horizon, now))
            db.execute("DELETE FROM sessions WHERE updated_at<%s AND lease_until<%s", (horizon, now))
            db.execute(
                "DELETE FROM instances WHERE heartbeat_at<%s AND instance_id<>%s AND instance_id"
                " NOT IN (SELECT instance_id FROM attempts WHERE outcome='in_flight')",
                (now - instance_stale_s, self.instance_id))
        return n


class PgLedgerAdmin(PgLedger):
    """``ledger_admin.LedgerAdmin``'s inspection queries and audited control actions, on
    PostgreSQL (same contracts; control actions lock the rows they change)."""

    @_wrap
    def clear_circuits(self, scope: str | None, *, now: float, actor: str) -> list[CircuitRow]:
        """See ``LedgerAdmin.clear_circuits``."""
        with self._tx() as tx:
            db = tx.db
            if scope is None:
                rows = db.execute(
                    "SELECT scope, failures, open_until, cooldown_s, updated_at FROM circuits"
                    " WHERE failures>0 OR open_until>%s ORDER BY scope FOR UPDATE", (now,),
                ).fetchall()
            else:
                rows = [_one_by_prefix(db.execute(
                    "SELECT scope, failures, open_until, cooldown_s, updated_at FROM circuits"
                    " WHERE starts_with(scope, %s) ORDER BY scope LIMIT 2 FOR UPDATE", (scope,),
                ).fetchall(), scope, missing=f"no circuit whose scope starts with {scope!r}",
                    ambiguous=f"circuit scope {scope!r} is ambiguous; give more of it")]
            cleared = [CircuitRow(r[0], circuit.CircuitState(*r[1:4]), r[4]) for r in rows]
            for row in cleared:
                db.execute("UPDATE circuits SET failures=0, open_until=CASE WHEN open_until"
                           " IS NULL THEN NULL ELSE LEAST(open_until, %s) END, cooldown_s=NULL,"
                           " updated_at=%s WHERE scope=%s", (now, now, row.scope))
                self._audit(db, now, "circuit_clear", row.scope, actor,
                            _circuit_json(row.state, now), _circuit_json(circuit.CircuitState(), now))
            return cleared

    @_wrap
    def release_session(self, session: str, *, now: float, actor: str
                        ) -> tuple[str, policy.SessionOwnership, policy.SessionOwnership]:
        """See ``LedgerAdmin.release_session``."""
        with self._tx() as tx:
            db = tx.db
            key = _one_by_prefix(db.execute(
                "SELECT session FROM sessions WHERE starts_with(session, %s) ORDER BY session"
                " LIMIT 2", (session,)).fetchall(), session,
                missing=f"no durable session whose id starts with {session!r}",
                ambiguous=f"session {session!r} is ambiguous; give more of it")[0]
            before = self._session(db, key, lock="UPDATE")
            after = policy.release_session(before, now=now)
            db.execute("UPDATE sessions SET owner_instance=%s, owner_epoch=%s, lease_until=%s,"
                       " updated_at=%s WHERE session=%s",
                       (after.owner_instance, after.owner_epoch, after.lease_until, now, key))
            self._audit(db, now, "session_release", key, actor,
                        json.dumps(_session_dict(before)), json.dumps(_session_dict(after)))
            return key, before, after

    @staticmethod
    def _audit(db, now, action, target, actor, before, after) -> None:
        db.execute("INSERT INTO control_audit (at, action, target, actor, before, after)"
                   " VALUES (%s,%s,%s,%s,%s,%s)", (now, action, target, _text(actor), before, after))

    # -- inspection ----------------------------------------------------------------------------
    @_wrap
    def counts(self) -> dict[str, int]:
        return {state: n for state, n in self._read().execute(
            "SELECT state, COUNT(*) FROM operations GROUP BY state")}

    def counts_apart(self) -> dict[str, int]:
        """See ``LedgerAdmin.counts_apart``: a short-lived read-only connection of its own,
        its statement bounded by ``COUNT_BOUND_MS``; a database that is not the one opened
        (another generation) is an error, never its counts."""
        return PgLedgerAdmin.read_at(self._url, self.instance_id, lambda other: other.counts(),
                                     identity=self.identity, busy_timeout_ms=COUNT_BOUND_MS,
                                     generation=self.generation)

    @_wrap
    def list_operations(self, limit: int = 50) -> list[dict]:
        return _dicts(self._read().execute(
            "SELECT op_key, state, method, path, session, attempts, created_at, updated_at,"
            " (replay_attempt IS NOT NULL)::int AS replayable FROM operations"
            " ORDER BY updated_at DESC LIMIT %s", (limit,)))

    @_wrap
    def find_operation(self, op_prefix: str) -> dict | None:
        db = self._read()
        ops = _dicts(db.execute("SELECT * FROM operations WHERE starts_with(op_key, %s)"
                                " ORDER BY op_key LIMIT 2", (op_prefix,)))
        if len(ops) != 1:
            return None if not ops else {"ambiguous": [o["op_key"] for o in ops]}
        op = ops[0]
        op["attempt_rows"] = _dicts(db.execute(
            "SELECT a.*, (SELECT COUNT(*) FROM spool s WHERE s.attempt_id=a.attempt_id)"
            " AS spool_chunks FROM attempts a WHERE op_key=%s ORDER BY attempt_id",
            (op["op_key"],)))
        return op

    @_wrap
    def duplicate_totals(self) -> dict[str, int]:
        held, replayed = self._read().execute(
            "SELECT COALESCE(SUM(duplicates_held), 0), COALESCE(SUM(duplicates_replayed), 0)"
            " FROM operations").fetchone()
        return {"held": int(held), "replayed": int(replayed)}

    @_wrap
    def circuits(self, now: float) -> list[CircuitRow]:
        rows = self._read().execute(
            "SELECT scope, failures, open_until, cooldown_s, updated_at FROM circuits"
            " WHERE failures>0 OR open_until>%s ORDER BY updated_at DESC", (now,)).fetchall()
        return [CircuitRow(r[0], circuit.CircuitState(*r[1:4]), r[4]) for r in rows]

    @_wrap
    def sessions(self, limit: int = 100) -> list[SessionRow]:
        rows = self._read().execute(
            "SELECT session, durable_id, owner_instance, owner_epoch, lease_until, updated_at"
            " FROM sessions ORDER BY updated_at DESC LIMIT %s", (limit,)).fetchall()
        return [SessionRow(r[0], policy.SessionOwnership(*r[1:5]), r[5]) for r in rows]

    @_wrap
    def instances(self) -> list[liveness.PeerRow]:
        rows = self._read().execute(
            "SELECT instance_id, host, boot_id, pid_ns, pid, start_ticks, heartbeat_at"
            " FROM instances ORDER BY heartbeat_at DESC").fetchall()
        return [liveness.PeerRow(r[0], liveness.ProcessIdentity(*r[1:6]), r[6]) for r in rows]

    @_wrap
    def audit_log(self, limit: int = 50) -> list[dict]:
        return _dicts(self._read().execute(
            "SELECT audit_id, at, action, target, actor, before, after FROM control_audit"
            " ORDER BY audit_id DESC LIMIT %s", (limit,)))

    @_wrap
    def integrity_check(self) -> str:
        """PostgreSQL checks its own pages; this says whether the ledger's tables answer."""
        self._read().execute("SELECT count(*) FROM meta").fetchone()
        return "ok"


class AttemptEndListener:
    """``LISTEN turnguard_attempt_ended`` on a connection and a thread of its own.

    ``on_end(op_key, attempt_id, state)`` for each attempt that ended in any process sharing
    the database (this one included), delivered after its transaction committed;
    ``on_live(bool)`` when the listener starts or stops listening (a broken connection, a
    PostgreSQL restart: it connects again every ``retry_s``). While it is not live, ends may
    have been missed: the caller falls back to polling, and re-checks what it waits on once
    it is live again. Both callbacks run on the thread: they must only hand over to the event
    loop (``loop.call_soon_threadsafe``). ``notifications`` counts what it received."""

    def __init__(self, url: str, *, on_end: Callable[[str, int, str], None],
                 on_live: Callable[[bool], None], retry_s: float = 1.0, poll_s: float = 0.5):
        self._url = url
        self._on_end = on_end
        self._on_live = on_live
        self._retry_s = retry_s
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._db: psycopg.Connection | None = None
        self.live = False
        self.notifications = 0
        self._thread = threading.Thread(target=self._run, name="turnguard-listen", daemon=True)

    def start(self) -> None:
        """Listen (the first connection is made here: raises ``LedgerError``), then go on on the
        thread."""
        try:
            self._db = self._listen()
        except psycopg.Error as e:
            raise LedgerError(scrub(f"{type(e).__name__}: {e}", self._url)) from None
        self._set_live(True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening (the thread ends within ``poll_s``; not waited for)."""
        self._stop.set()

    def _listen(self) -> psycopg.Connection:
        db = psycopg.connect(self._url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                             application_name="turnguard-listen", **_TCP_OPTIONS)
        try:
            # This session idles by design: a server's idle_session_timeout would end it once
            # per timeout (notifications lost, polling, two warnings each time).
            try:
                db.execute("SET idle_session_timeout = 0")
            except pg_errors.UndefinedObject:  # PostgreSQL before 14 has no such timeout
                pass
            db.execute(f"LISTEN {NOTIFY_CHANNEL}")
        except BaseException:  # not listening: closed now, not left to the garbage collector
            db.close()
            raise
        return db

    def _set_live(self, live: bool) -> None:
        if live != self.live:
            self.live = live
            self._on_live(live)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._db is None:
                    try:
                        self._db = self._listen()
                    except psycopg.Error as e:
                        logger.debug("turnguard: listener cannot connect (%s)", scrub(str(e).strip(), self._url))
                        self._stop.wait(self._retry_s)
                        continue
                    self._set_live(True)
                try:
                    for note in self._db.notifies(timeout=self._poll_s):
                        self._deliver(note.payload)
                        if self._stop.is_set():
                            break
                except psycopg.Error as e:
                    logger.debug("turnguard: listener connection lost (%s)", scrub(str(e).strip(), self._url))
                    self._set_live(False)
                    try:
                        self._db.close()
                    except psycopg.Error:
                        pass
                    self._db = None
                    self._stop.wait(self._retry_s)
        except Exception:  # a thread's exception would only reach stderr
            logger.exception("turnguard: attempt-end listener failed")
            self._set_live(False)
        finally:
            if self._db is not None:
                self._db.close()

    def _deliver(self, payload: str) -> None:
        parts = payload.split(" ")
        if len(parts) != 3 or not parts[1].isdigit():
            return
        self.notifications += 1
        self._on_end(parts[0], int(parts[1]), parts[2])


# In the RETURNING list of an UPDATE of operations that moves one out of in_flight: tells the
# listeners, on commit, which attempt of which operation ended and how. A completed end with
# no recording to replay (too large, say) is ``completed_unrecorded``: its duplicates are
# dispatched, where one with a recording is replayed and never run again. (One word: a
# listener of an older version takes any third word for an end.)
_NOTIFY = (f"pg_notify('{NOTIFY_CHANNEL}', op_key || ' ' || current_attempt::text || ' ' ||"
           " CASE WHEN state = 'completed' AND replay_attempt IS NULL"
           " THEN 'completed_unrecorded' ELSE state END)")


def _text(value: str | None) -> str | None:
    """Text as PostgreSQL can store it: a NUL (which SQLite keeps and PostgreSQL refuses, so a
    write carrying one would be kept and retried for ever, and a claim carrying one, from a
    client's ``previous_response_id``, taken for an outage) becomes U+FFFD."""
    return None if value is None else value.replace("\x00", "\ufffd")


def _schema_version(db: psycopg.Connection) -> int:
    if db.execute("SELECT to_regclass('meta')").fetchone()[0] is None:
        return 0
    row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return int(row[0]) if row else 0


def _generation(db: psycopg.Connection) -> str:
    """The database's generation ("" when it holds no ledger: dropped and made again)."""
    if db.execute("SELECT to_regclass('meta')").fetchone()[0] is None:
        return ""
    row = db.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
    return row[0] if row else ""


def _dicts(cur) -> list[dict]:
    names = [d.name for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _operations_ended_with(db: psycopg.Connection, ended: list[tuple[int, str, str]],
                           now: float) -> list[str]:
    """See ``ledger._operations_ended_with``; each moved operation is notified."""
    moved = []
    for attempt_id, op_key, outcome in ended:
        if db.execute(
            "UPDATE operations SET state=%s, updated_at=%s, ended_at=%s"
            f" WHERE op_key=%s AND current_attempt=%s RETURNING op_key, {_NOTIFY}",
            (outcome, now, now, op_key, attempt_id)).fetchone():
            moved.append(op_key)
    return moved
