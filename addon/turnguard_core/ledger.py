"""The SQLite ledger: the only module that speaks SQL.

It records operations (one per request identity), attempts (one per upstream dispatch) and the
response spool of attempts that can be replayed. Claims are atomic across every process that
opens the same file: each admission runs inside ``BEGIN IMMEDIATE``, reads the operation, asks
the pure policy what to do and applies the claim with a conditional ``UPDATE ... RETURNING``.

Contract:
- the file and its WAL are created 0600; an existing world-writable file is refused;
- no raw credential is ever stored (the caller passes hashes only);
- every method raises ``LedgerError`` (never a bare ``sqlite3`` error) when the database
  cannot be used, so the caller can fail closed or degrade.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sqlite3
import stat
import urllib.parse
import uuid
from typing import Callable, Iterable, Literal, TypeVar

from . import circuit, ledger_files, liveness, policy
from .identity import Identity
from .private_files import (
    UnsafePath,
    check_private_file,
    check_private_path,
    create_private_file,
    ensure_private_file,
    open_private,
    shown,
)
from .records import record

SCHEMA_VERSION = 6
SPOOL_CHUNK = 256 * 1024
# A connection that leaves checkpoints to another (``checkpoint_on_commit=False``) still makes
# one itself once the WAL holds this many pages (16 MiB): a backstop, should the other stop.
BACKSTOP_CHECKPOINT_PAGES = 4096
# When SQLite starts the WAL over after a checkpoint, it cuts the file back to this size. Under
# continuous writes the WAL runs to about 10 MiB between restarts; a file cut back below that
# is grown again by the commits after each restart (a block allocation per page) and the cut
# itself (an ftruncate, on the event loop's commit) took 3-4 ms every 0.6 s. At the backstop's
# size the file keeps its blocks and commits overwrite them; the heartbeat empties it once the
# ledger is idle (``truncate_wal``).
WAL_SIZE_LIMIT = 16 * 1024 * 1024
PROBE_BUSY_S = 0.2  # how long check_path's look at an existing file waits for a writer
READ_APART_BUSY_MS = 50  # how long a read on a connection of its own waits (read_apart)
TRUNCATE_BUSY_MS = 10  # longest ``truncate_wal`` keeps new writers waiting for readers to go
MAKE_ANEW_LOCK_WAIT_S = 10.0  # longest a copy made anew waits for another's (a large file)

_MIGRATIONS: dict[int, str] = {
    1: """
    CREATE TABLE instances (
        instance_id  TEXT PRIMARY KEY,
        pid          INTEGER NOT NULL,
        host         TEXT NOT NULL,
        started_at   REAL NOT NULL,
        heartbeat_at REAL NOT NULL
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
        current_attempt      INTEGER,
        replay_attempt       INTEGER,
        attempts             INTEGER NOT NULL DEFAULT 0,
        events_seen          INTEGER NOT NULL DEFAULT 0,
        recovery_dispatches  INTEGER NOT NULL DEFAULT 0,
        circuit_scope        TEXT,
        created_at           REAL NOT NULL,
        updated_at           REAL NOT NULL,
        ended_at             REAL
    );
    CREATE INDEX operations_updated ON operations(updated_at);
    CREATE TABLE attempts (
        attempt_id   INTEGER PRIMARY KEY AUTOINCREMENT,
        op_key       TEXT NOT NULL REFERENCES operations(op_key) ON DELETE CASCADE,
        kind         TEXT NOT NULL,
        instance_id  TEXT NOT NULL,
        flow_id      TEXT,
        started_at   REAL NOT NULL,
        ended_at     REAL,
        status       INTEGER,
        events_seen  INTEGER NOT NULL DEFAULT 0,
        outcome      TEXT NOT NULL DEFAULT 'in_flight',
        detail       TEXT,
        headers      TEXT,
        body_bytes   INTEGER,
        replayable   INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX attempts_op ON attempts(op_key);
    CREATE INDEX attempts_in_flight ON attempts(instance_id) WHERE outcome = 'in_flight';
    CREATE TABLE circuits (
        scope      TEXT PRIMARY KEY,
        failures   INTEGER NOT NULL DEFAULT 0,
        open_until REAL,
        cooldown_s REAL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE sessions (
        session        TEXT PRIMARY KEY,
        durable_id     TEXT NOT NULL,
        owner_instance TEXT NOT NULL,
        owner_epoch    INTEGER NOT NULL,
        lease_until    REAL NOT NULL,
        created_at     REAL NOT NULL,
        updated_at     REAL NOT NULL
    );
    CREATE TABLE spool (
        attempt_id INTEGER NOT NULL REFERENCES attempts(attempt_id) ON DELETE CASCADE,
        seq        INTEGER NOT NULL,
        data       BLOB NOT NULL,
        PRIMARY KEY (attempt_id, seq)
    );
    """,
    # The hash of the original request's values of the headers its response's Vary names: a
    # recording is replayed only to a request with the same values (see negotiation.py).
    2: """
    ALTER TABLE attempts ADD COLUMN vary_key TEXT;
    """,
    # Liveness by proof (see liveness.py): who each instance is; the ledger's generation, so
    # that writes queued for a ledger file that was since replaced are never applied to
    # another; the outcome an attempt reported after it had been ended by someone else.
    3: """
    ALTER TABLE instances ADD COLUMN boot_id TEXT NOT NULL DEFAULT '';
    ALTER TABLE instances ADD COLUMN pid_ns TEXT NOT NULL DEFAULT '';
    ALTER TABLE instances ADD COLUMN start_ticks INTEGER;
    ALTER TABLE instances ADD COLUMN incarnation INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE attempts ADD COLUMN late_outcome TEXT;
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    INSERT INTO meta (key, value) VALUES ('generation', lower(hex(randomblob(16))));
    """,
    # What duplicates of an operation got (held while an attempt was in flight, answered from
    # its recording), for inspection; and the audit of operators' control actions (a circuit
    # cleared, a session released), who did it and what the row was before.
    4: """
    ALTER TABLE operations ADD COLUMN duplicates_held INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE operations ADD COLUMN duplicates_replayed INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE control_audit (
        audit_id INTEGER PRIMARY KEY AUTOINCREMENT,
        at       REAL NOT NULL,
        action   TEXT NOT NULL,
        target   TEXT NOT NULL,
        actor    TEXT NOT NULL,
        before   TEXT,
        after    TEXT
    );
    CREATE INDEX control_audit_at ON control_audit(at);
    """,
    5: """
    ALTER TABLE attempts ADD COLUMN transport TEXT NOT NULL DEFAULT 'http';
    """,
    # The recordings that can still be replayed, by end: found without a scan when the replay
    # window has passed and their bytes are purged (purge_recordings).
    6: """
    CREATE INDEX attempts_replayable ON attempts(ended_at) WHERE replayable = 1;
    """,
}


T = TypeVar("T")


def moved_key(from_generation: str, instance_id: str) -> str:
    """The ``meta`` key by which an instance notes that its attempts in flight in the ledger
    file of ``from_generation`` are registered in this one (both stores)."""
    return f"moved:{from_generation}:{instance_id}"


_INSERT_OPERATION = (
    "INSERT INTO operations (op_key, scope, session, method, path, idempotency_key,"
    " fingerprint, turn_state, previous_response_id, state, circuit_scope,"
    " created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?, 'new', ?, ?, ?)"
)
_INSERT_OPERATION_IF_ABSENT = _INSERT_OPERATION + " ON CONFLICT(op_key) DO NOTHING"


def _generation(db: sqlite3.Connection, file_id: tuple[int, int] | None) -> str:
    """The ledger file's generation: the random id made with it, with the file's identity
    (``file_id``; None: in memory). An older copy of this very file put back in its place (a
    restored backup) has its id, yet not its rows since (attempt ids come again)."""
    made = db.execute("SELECT value FROM meta WHERE key='generation'").fetchone()[0]
    return made if file_id is None else f"{made}@{file_id[0]}:{file_id[1]}"


class LedgerError(Exception):
    """The ledger cannot be used for this decision (locked, read-only, full, corrupt, ...)."""


@record
class Recording:
    """A completed attempt's response, as it went to the original client."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    vary_key: str | None = None  # see negotiation.vary_key; None: unknown
    # when its attempt ended, as the ledger has it (read back from a ledger: ``recording``;
    # None otherwise); not part of what the recording is
    ended_at: float | None = dataclasses.field(default=None, compare=False)


@record
class AttemptEnd:
    """How an attempt ended, for ``Ledger.finish``."""

    outcome: policy.Outcome
    status: int | None
    events_seen: int
    detail: str | None = None
    recording: Recording | None = None  # given only when the response may be replayed


@record
class FinishResult:
    """What ``Ledger.finish`` did: whether the end was applied (not fenced out) and, when the
    operation has a circuit, its state afterwards and whether it opened or reset."""

    applied: bool
    circuit_scope: str | None = None
    circuit: "circuit.CircuitState | None" = None
    transition: "circuit.Transition" = None


HeartbeatResult = Literal["renewed", "reregistered"]


@record
class WalState:
    """What a checkpoint saw: the frames the WAL holds, and the database's ``data_version`` as
    the checkpointing connection sees it (it changes when any other connection commits)."""

    frames: int
    version: int


def _described(error: BaseException) -> str:
    """An error as its log line shows it: SQLite's extended code where it says more than the
    message (a "disk I/O error" may be SQLITE_IOERR_SHMSIZE, SQLITE_IOERR_FSYNC, ...)."""
    code = getattr(error, "sqlite_errorname", None)
    if code and code not in ("SQLITE_ERROR", "SQLITE_OK"):
        return f"{type(error).__name__} ({code}): {error}"
    return f"{type(error).__name__}: {error}"


def _wrap(fn):
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except (sqlite3.Error, OSError) as e:  # OSError: creating the file, read-only folders
            self._rollback()
            raise LedgerError(_described(e)) from e

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class Ledger:
    """One connection to the ledger file, used from one thread at a time (the addon hands it
    between the event loop and a thread of its own, see ``ledger_runner``)."""

    def __init__(
        self, path: str, instance_id: str, *, busy_timeout_ms: int = 5000,
        identity: liveness.ProcessIdentity | None = None, checkpoint_on_commit: bool = True,
    ):
        """``checkpoint_on_commit=False``: this connection's commits leave the WAL to another
        connection's ``checkpoint`` (the heartbeat's thread) instead of SQLite's automatic
        checkpoint, which makes the commit that fills a thousand pages copy them into the
        database and fsync it; so the connection that decides requests never pays for it."""
        self.path = path
        self._checkpoint_on_commit = checkpoint_on_commit
        self.instance_id = instance_id
        self.identity = identity or liveness.read_process_identity()
        self._busy_timeout_ms = busy_timeout_ms
        self._db: sqlite3.Connection | None = None
        self._file_id: tuple[int, int] | None = None  # (device, inode) of the file opened
        self._sidecar_ids: dict[str, tuple[int, int] | None] = {}  # its -wal's and -shm's
        self._batch: _Joined | None = None  # the transaction of batch(), while in one
        self._stamp: tuple[int, ...] | None = None  # the file read immutable (open_readonly)
        self.generation = ""  # this ledger file: a random id made with it, and its identity
        self.incarnation = 0  # this instance's registration; goes up when it re-registers

    # -- opening -------------------------------------------------------------------------------
    @_wrap
    def open(self, now: float, *, register: bool = True) -> None:
        """Create or open the file (0600), migrate the schema and register this instance
        (``register=False``: a control tool that serves no traffic, e.g. ``scripts/turnguard``;
        it appears in no ``instances`` row)."""
        real_path = check_path(self.path)  # SQLite puts -wal and -shm next to the real file
        # (as long as SQLite waits for another process's lock: an open that holds the folder's
        # lock may wait so for SQLite's, another process's first open of a new file, say)
        with ledger_files.FolderLock(real_path, self._busy_timeout_ms / 1000):
            db = self._connect(real_path)
        try:
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            db.execute("PRAGMA secure_delete=ON")  # purged recordings leave no bytes behind
            db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            if not self._checkpoint_on_commit:
                db.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_CHECKPOINT_PAGES}")
            self._db = db
            if self.path != ":memory:":
                st = os.stat(self.path)
                self._file_id = (st.st_dev, st.st_ino)
                self._sidecar_ids = {suffix: ledger_files.file_id(real_path + suffix)
                                     for suffix in ("-wal", "-shm")}
                ledger_files.note_open_here(self, self._file_id)
                ledger_files.forget_sidecars_left()  # (their inodes may be a new file's now)
            self._migrate()
            if register:
                with self._tx() as tx:
                    self.incarnation = self._register(tx, now, keep_incarnation=True)
            with self._tx() as tx:
                self.generation = _generation(tx, self._file_id)
        except BaseException:
            ledger_files.close_here(self, db.close)
            self._db = None
            self._file_id = None
            raise

    def _connect(self, real_path: str) -> sqlite3.Connection:
        """Make the file, or put right the files beside it, and connect, up to SQLite's first
        read of it (its locks taken: on the file, and in WAL mode on the -shm). Run under the
        folder's lock (``FolderLock``), so that no other process of ours looks at the files
        between that look and those locks."""
        if self.path != ":memory:":
            # a file that is no ledger of this turnguard's yet may be put right: an outage,
            # and neither made private nor given SQLite's files beside it meanwhile
            found = None
            if not os.path.lexists(real_path):
                ledger_files.make_file_alone(real_path)
            else:
                ledger_files.remove_stale_sidecars(real_path)
                found = _look(real_path)
            if found is not None and found.not_a_database:
                raise LedgerError(f"{shown(self.path)} is not a SQLite database; left untouched "
                                  "(turnguard opens it again once it is one, or is gone)")
            if found is not None and found.version > SCHEMA_VERSION:
                raise LedgerError(f"ledger schema version {found.version} is newer than this "
                                  f"turnguard ({SCHEMA_VERSION}); left untouched")
            ensure_private_file(real_path)
            _refuse_if_sidecars_deleted(real_path, self.path)
            # SQLite keeps the -wal and -shm it finds (left by a process killed, or copied in
            # with the file: they hold its rows too, made 0600 here) and makes missing ones
            # with O_CREAT: made here first, O_EXCL|O_NOFOLLOW, so that one another user puts
            # there meanwhile (a shared folder) is refused, never SQLite's
            for suffix in ("-wal", "-shm"):
                if not create_private_file(real_path + suffix):
                    ensure_private_file(real_path + suffix, create=False)
        # check_same_thread=False: the addon hands the connection between the event loop and
        # a thread of its own, never using it from both at once (see ledger_runner)
        db = sqlite3.connect(
            real_path, isolation_level=None, timeout=self._busy_timeout_ms / 1000,
            check_same_thread=False,
        )
        try:
            # SQLite's close of the last connection to a file copies the WAL into it, then
            # deletes the -wal and the -shm by their names: a file deleted meanwhile and made
            # again at the path (another process's new ledger, or this one's) loses its WAL,
            # the rows committed to it, while its connections go on writing to the unlinked
            # one. SQLite checks that the file did not move before that copy, not after it.
            # So no connection of ours does so; ``close`` copies the WAL itself.
            db.setconfig(sqlite3.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, True)
            db.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")
            db.execute("PRAGMA journal_mode=WAL")
        except BaseException:
            db.close()
            raise
        return db

    @_wrap
    def open_readonly(self) -> None:
        """Open an existing ledger for reading only (inspection): no file is created, no
        migration runs and no instance row is written. Raises ``LedgerError`` when the file is
        missing or its schema version is not this turnguard's."""
        if self.path == ":memory:" or not os.path.exists(self.path):
            raise LedgerError(f"ledger file {shown(self.path)} does not exist")
        if not os.path.isfile(self.path):
            raise LedgerError(f"ledger {shown(self.path)} is not a file")
        real = os.path.realpath(self.path)  # where SQLite looks for the -wal and the -shm
        _refuse_if_sidecars_deleted(real, self.path)
        if ledger_files.stale_sidecars(real):  # (read through them: that file's rows)
            raise LedgerError(f"the -wal and -shm beside {shown(self.path)} are another "
                              "file's (moved in with them left); read once turnguard opened it")
        try:
            uri, made_shm = _readonly_uri(real, owner=os.stat(real).st_uid)
        except UnsafePath as e:
            raise LedgerError(str(e)) from None
        if not uri.endswith("&immutable=1") and _file_is_no_database(real):
            raise LedgerError(f"{shown(self.path)} is not a SQLite database (read through the "
                              "-wal beside it, it would pass for the ledger that -wal was of)")
        # read as immutable: read_was_stable says if a writer came meanwhile
        self._stamp = _stamp(real) if uri.endswith("&immutable=1") else None
        db = sqlite3.connect(
            uri, uri=True, isolation_level=None, timeout=self._busy_timeout_ms / 1000
        )
        try:
            db.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")
            db.execute("PRAGMA query_only=ON")
            try:
                version = db.execute("PRAGMA user_version").fetchone()[0]
            except sqlite3.DatabaseError as e:
                if getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_NOTADB:
                    raise
                raise LedgerError(f"{shown(self.path)} is not a SQLite database") from None
            if made_shm:  # SQLite gave it the file's mode as it opened it
                os.chmod(real + "-shm", 0o600, follow_symlinks=False)
            if version != SCHEMA_VERSION:
                hint = " (not a turnguard ledger, or never opened by it)" if version == 0 else ""
                raise LedgerError(
                    f"ledger {shown(self.path)} has schema version {version}; this turnguard "
                    f"reads version {SCHEMA_VERSION}{hint}"
                )
            file_id = ledger_files.file_id(real)
            self.generation = _generation(db, file_id)
            self._db = db
            if self._stamp is None:  # (read through its -wal: a connection like the others)
                ledger_files.note_open_here(self, file_id)
        except BaseException:
            db.close()
            self._db = None
            raise

    def read_apart(self, read: Callable[["Ledger"], T]) -> T:
        """``read(ledger)`` on a read-only connection of its own (``read_at``), never queued
        behind the calls on this connection (claims waiting for another connection's write
        lock). Raises ``LedgerError``, also when the file at the path is not the one this
        connection has open (deleted or replaced: what it says is another file's)."""
        return Ledger.read_at(self.path, self.instance_id, read, identity=self.identity,
                              generation=self.generation)

    @staticmethod
    def read_at(path: str, instance_id: str, read: Callable[["Ledger"], T], *,
                identity: liveness.ProcessIdentity | None = None,
                generation: str | None = None) -> T:
        """``read(ledger)`` on a read-only connection (``open_readonly``: its ``generation``
        is the file's) to the ledger file at ``path`` now, in one read transaction, opened and
        closed here, from any thread; when ``generation`` is given, only if the file opened is
        of that generation (the file, with its identity, that the caller has open). Also for a
        process that could not open the ledger (another connection's write lock: an open
        writes): what the others wrote can still be read. Raises ``LedgerError``."""
        other = Ledger(path, instance_id, busy_timeout_ms=READ_APART_BUSY_MS,
                       identity=identity)
        other.open_readonly()
        try:
            if generation is not None and other.generation != generation:
                raise LedgerError(f"ledger file {shown(path)} is not the one in use")
            db = other._conn()
            try:
                db.execute("BEGIN")
                found = read(other)
                db.execute("ROLLBACK")
            except sqlite3.Error as e:
                raise LedgerError(_described(e)) from e
            if not other.read_was_stable():
                raise LedgerError("the ledger changed while it was read")
            return found
        finally:
            other.close()

    def read_was_stable(self) -> bool:
        """Whether what an ``open_readonly`` connection read was the file as one writer left
        it: a writer that opened the file since an immutable read (its -wal appeared, or it
        wrote the file) may have changed pages under it; read again then."""
        if self._stamp is None:
            return True
        real = os.path.realpath(self.path)
        try:
            return not os.path.lexists(real + "-wal") and _stamp(real) == self._stamp
        except OSError:
            return False

    @_wrap
    def set_busy_timeout(self, ms: int | None) -> None:
        """How long a call waits for another process's lock (None: the ledger's own)."""
        ms = self._busy_timeout_ms if ms is None else ms
        self._conn().execute(f"PRAGMA busy_timeout={int(ms)}")

    @_wrap
    def checkpoint(self) -> WalState:
        """Copy what the WAL holds into the database, as far as readers allow (a passive
        checkpoint: it never waits for a lock nor blocks a writer)."""
        db = self._conn()
        _, frames, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return WalState(max(0, frames), db.execute("PRAGMA data_version").fetchone()[0])

    @_wrap
    def truncate_wal(self) -> None:
        """Checkpoint the whole WAL and cut its file to zero bytes (for an idle ledger: while
        it runs, new writers wait, at most ``TRUNCATE_BUSY_MS`` for readers to finish)."""
        db = self._conn()
        db.execute(f"PRAGMA busy_timeout={TRUNCATE_BUSY_MS}")
        try:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            db.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")

    def close(self) -> None:
        """Close the connection; the WAL copied into the file first (through this
        connection's descriptors: never into another file at the path) unless the file was
        deleted or replaced, or a reader keeps part of it (``TRUNCATE_BUSY_MS`` at most). The
        -wal and -shm are left beside the file, never deleted (see ``open``)."""
        if self._db is not None:
            if self._file_id is not None and self.file_replaced() is None:
                with contextlib.suppress(LedgerError):
                    self.truncate_wal()
            ledger_files.close_here(self, self._db.close)
            self._db = None

    @property
    def busy_timeout_ms(self) -> int:
        """How long a call waits for another process's lock, unless told otherwise."""
        return self._busy_timeout_ms

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def _migrate(self) -> None:
        """Bring the schema to ``SCHEMA_VERSION``, one versioned step at a time. Each step
        reads the version inside its write transaction, so processes that open a new ledger
        together migrate it once."""
        while True:
            with self._tx() as db:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise sqlite3.DatabaseError(
                        f"ledger schema version {version} is newer than this turnguard "
                        f"({SCHEMA_VERSION})"
                    )
                if version < 0:  # (never turnguard's: another program's database)
                    raise sqlite3.DatabaseError(f"ledger schema version {version} is not "
                                                "turnguard's")
                if version == SCHEMA_VERSION:
                    return
                for statement in _split_sql(_MIGRATIONS[version + 1]):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version={version + 1}")

    # -- transactions --------------------------------------------------------------------------
    def _tx(self):
        if self._batch is not None:  # inside batch(): its transaction holds this call's writes
            return self._batch
        self._check_file()
        return _Transaction(self._conn())

    @contextlib.contextmanager
    def batch(self):
        """One transaction around several calls (a group commit): their writes commit
        together, or, if any call raises, none of them does. Raises ``LedgerError``."""
        if self._batch is not None:
            raise LedgerError("ledger batches do not nest")
        try:
            with self._tx() as db:
                self._batch = _Joined(db)
                try:
                    yield self
                finally:
                    self._batch = None
        except (sqlite3.Error, OSError) as e:
            self._rollback()
            raise LedgerError(_described(e)) from e

    def _check_file(self) -> None:
        why = self.file_replaced()
        if why is not None:
            raise sqlite3.OperationalError(why)

    claims_in_doubt_pending = False  # a claim's commit in SQLite is never in doubt

    def claims_in_doubt(self) -> list[tuple[int, str]]:
        """See ``PgLedger.claims_in_doubt``: none here (a commit that fails rolled back)."""
        return []

    def claims_in_doubt_left(self) -> list[tuple[int, str]]:
        return []

    def file_replaced(self) -> str | None:
        """Why the file at ``path`` is no longer the one this connection opened (deleted, or
        replaced by another file), or None. Writing on would go to a file nobody else sees, and
        reading a fresh file there as if it were this ledger would forget every attempt in
        flight: the caller treats it as an outage. A stat, no transaction: cheap."""
        if self._file_id is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            ledger_files.note_sidecars_left(self._sidecar_ids.values())
            return f"ledger file {shown(self.path)} was deleted"
        except OSError as e:
            return f"ledger file {shown(self.path)} cannot be checked: {e.strerror}"
        if (st.st_dev, st.st_ino) != self._file_id:
            ledger_files.note_sidecars_left(self._sidecar_ids.values())
            return f"ledger file {shown(self.path)} was replaced by another file"
        return None

    def sidecar_gone(self) -> str | None:
        """Which of the file's -wal and -shm were deleted or replaced since this connection
        opened it (the file itself still in place), or None. This connection and the others
        that had the file open go on with the ones they have, unlinked, but a connection
        opened now would be given new ones: its rows and theirs in two WALs, or one WAL read
        through two indexes, would corrupt the file (``make_anew``). Two stats: the
        heartbeat's thread asks it, not a request."""
        real = os.path.realpath(self.path)
        gone = [suffix for suffix, was in self._sidecar_ids.items()
                if was is not None and ledger_files.file_id(real + suffix) != was]
        return " and ".join(gone) or None

    @_wrap
    def make_anew(self) -> bool:
        """Put a copy of the file, as this connection reads it, in its place with no -wal or
        -shm beside it, when one of them was deleted (``sidecar_gone``): each process on the
        file then finds it replaced and moves to the copy, as to any file put in place (it
        registers its attempts in flight there, and records its own recordings still within
        their window; what another committed after the copy was made is what an older copy
        lacks), and none opens the file with new ones meanwhile (``open`` refuses while a
        connection has it open). Under the folder's lock (``FolderLock``): one process
        makes the copy. Whether this call made it (False: another process
        did, the file at the path is no longer this connection's)."""
        real = os.path.realpath(self.path)
        with ledger_files.FolderLock(real, MAKE_ANEW_LOCK_WAIT_S):
            if self.file_replaced() is not None:
                return False
            copy = f"{real}.copy"
            for stale in (copy, copy + "-journal", copy + "-wal", copy + "-shm"):
                if check_private_file(stale) is not None:
                    os.unlink(stale)
            os.close(open_private(copy, os.O_RDWR))
            try:
                target = sqlite3.connect(copy, isolation_level=None)
                try:
                    self._conn().backup(target)
                finally:
                    target.close()  # (its -wal and -shm, if any, copied in and deleted)
            except BaseException:  # (a full disk: the part made would only take more room)
                for part in (copy, copy + "-journal", copy + "-wal", copy + "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(part)
                raise
            if self.file_replaced() is not None:  # put in place meanwhile (a backup restored)
                os.unlink(copy)
                return False
            for suffix in ("-wal", "-shm"):
                if check_private_file(real + suffix) is not None:
                    os.unlink(real + suffix)
            os.replace(copy, real)
            return True

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise sqlite3.OperationalError("ledger is not open")
        return self._db

    def _rollback(self) -> None:
        if self._db is not None and self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    # -- admission -----------------------------------------------------------------------------
    @_wrap
    def admit(
        self,
        identity: Identity,
        *,
        method: str,
        path: str,
        now: float,
        guard: policy.GuardPolicy,
        flow_id: str | None,
        circuit_scope: str | None = None,
        recovery: policy.RecoveryClaim | None = None,
        once_mode: bool = False,
        transport: str = "http",
    ) -> policy.Admission:
        """Atomically decide and, for a dispatch, claim the operation for a new attempt.

        The decision sees the operation, the circuit of ``circuit_scope`` (a cooling circuit
        fences dispatches) and, for a ``recovery`` claim, the durable session's owner epoch.
        Returns the policy's admission; a ``Dispatch`` comes back with its ``attempt_id``.
        ``transport`` is the attempt's ("http", or "ws": a call on a WebSocket).

        A decision that claims nothing (a replay, a hold, a conflict: what the operation's
        state alone decides) is read without the write lock, in one statement; only a
        dispatch, or a decision the circuit or the session could change, takes it."""
        self._check_file()
        seen = self._snapshot(self._conn(), identity.op_key)
        if seen is not None:
            decision = policy.admit(
                seen, fingerprint=identity.fingerprint,
                has_idempotency_key=identity.idempotency_key is not None, now=now, policy=guard)
            if not isinstance(decision, policy.Dispatch):
                return decision
        # the file was checked a moment ago: the transaction need not stat it again
        with self._tx() if self._batch is not None else _Transaction(self._conn()) as db:
            remaining, open_until = 0.0, None
            if circuit_scope is not None:
                state = self._circuit(db, circuit_scope)
                remaining, open_until = state.remaining_s(now), state.open_until
            if seen is None and recovery is None:
                # A new operation (the common case): what the policy decides for an unknown
                # operation, claimed with one statement less when the row is still absent
                # (inserted now); if another process inserted it meanwhile, read it below.
                decision = policy.admit(
                    None, fingerprint=identity.fingerprint,
                    has_idempotency_key=identity.idempotency_key is not None, now=now,
                    policy=guard, circuit_remaining_s=remaining, once_mode=once_mode)
                if isinstance(decision, policy.Dispatch) and self._insert_operation(
                        db, identity, method, path, circuit_scope, now, if_absent=True):
                    return policy.Dispatch(decision.kind, self._claim(
                        db, identity, decision.kind, flow_id, now, transport))
            snapshot = self._snapshot(db, identity.op_key)
            owner_ok = True
            if recovery is not None:
                owner_ok = self._owns_for_recovery(db, recovery.session, recovery.epoch, now)
            decision = policy.admit(
                snapshot,
                fingerprint=identity.fingerprint,
                has_idempotency_key=identity.idempotency_key is not None,
                now=now,
                policy=guard,
                circuit_remaining_s=remaining,
                recovery_once=None if recovery is None else recovery.once,
                owner_ok=owner_ok,
                once_mode=once_mode,
                circuit_open_until=open_until,
                has_session=identity.session is not None,
            )
            if not isinstance(decision, policy.Dispatch):
                return decision
            if snapshot is None:
                self._insert_operation(db, identity, method, path, circuit_scope, now)
            return policy.Dispatch(
                decision.kind, self._claim(db, identity, decision.kind, flow_id, now, transport)
            )

    @_wrap
    def adopt_attempt(
        self, identity: Identity, *, method: str, path: str, kind: str, flow_id: str | None,
        now: float, circuit_scope: str | None = None, transport: str = "http",
        ended: tuple[int, ...] = (),
    ) -> int | None:
        """Register an attempt this instance has in flight in a ledger that does not know it
        (its file was deleted or replaced under the running process), so that other processes
        hold the operation's duplicates. Returns the new attempt id; None when the operation
        is in flight here already (another process claimed it meanwhile).

        ``ended``: this instance's attempts of the operation that ended while their end could
        not be written (it is owed): one still in flight here is ended now (``unknown``, or
        ``partial`` after an event; its owed end comes too late) and the new attempt claimed,
        so the attempt that runs has a row and the owed end cannot end its operation."""
        with self._tx() as db:
            snapshot = self._snapshot(db, identity.op_key)
            if snapshot is not None and snapshot.state == "in_flight":
                if snapshot.owner_instance != self.instance_id \
                        or snapshot.current_attempt not in ended:
                    return None
                self._finish(db, snapshot.current_attempt, _superseded(snapshot), now, None,
                             False, identity.op_key)
            if snapshot is None:
                self._insert_operation(db, identity, method, path, circuit_scope, now)
            return self._claim(db, identity, kind, flow_id, now, transport)

    def _insert_operation(
        self, db: sqlite3.Connection, identity: Identity, method: str, path: str,
        circuit_scope: str | None, now: float, *, if_absent: bool = False,
    ) -> bool:
        """Insert the operation's row (state ``new``); ``if_absent``: not when it exists
        (then False: nothing was inserted)."""
        cur = db.execute(
            _INSERT_OPERATION_IF_ABSENT if if_absent else _INSERT_OPERATION,
            (
                identity.op_key, identity.scope, identity.session, method,
                path, identity.idempotency_key, identity.fingerprint,
                identity.turn_state, identity.previous_response_id, circuit_scope,
                now, now,
            ),
        )
        return cur.rowcount == 1

    def _claim(
        self, db: sqlite3.Connection, identity: Identity, kind: str, flow_id: str | None,
        now: float, transport: str,
    ) -> int:
        """A new attempt, made the operation's current one (the operation is not in flight)."""
        cur = db.execute(
            "INSERT INTO attempts (op_key, kind, instance_id, flow_id, started_at, transport)"
            " VALUES (?,?,?,?,?,?)",
            (identity.op_key, kind, self.instance_id, flow_id, now, transport),
        )
        attempt_id = cur.lastrowid
        claimed = db.execute(
            "UPDATE operations SET state='in_flight', current_attempt=?, attempts=attempts+1,"
            " recovery_dispatches=recovery_dispatches+?, fingerprint=?, turn_state=?,"
            " previous_response_id=?, updated_at=?, ended_at=NULL"
            " WHERE op_key=? AND state<>'in_flight' RETURNING attempts",
            (
                attempt_id, 1 if kind == "recovery" else 0, identity.fingerprint,
                identity.turn_state, identity.previous_response_id, now, identity.op_key,
            ),
        ).fetchone()
        if claimed is None:  # cannot happen inside BEGIN IMMEDIATE; refuse rather than double
            raise sqlite3.IntegrityError("operation was claimed concurrently")
        return attempt_id

    @staticmethod
    def _snapshot(db: sqlite3.Connection, op_key: str) -> policy.OperationSnapshot | None:
        row = db.execute(
            "SELECT o.state, o.fingerprint, o.current_attempt, a.instance_id, o.ended_at,"
            " o.replay_attempt, o.events_seen, o.recovery_dispatches"
            " FROM operations o LEFT JOIN attempts a"
            " ON a.attempt_id = o.current_attempt WHERE o.op_key=?",
            (op_key,),
        ).fetchone()
        if row is None:
            return None
        return policy.OperationSnapshot(*row)

    @_wrap
    def snapshot(self, op_key: str) -> policy.OperationSnapshot | None:
        """The operation's state now (read only)."""
        return self._snapshot(self._conn(), op_key)

    # -- attempts ------------------------------------------------------------------------------
    @_wrap
    def first_event(self, attempt_id: int, op_key: str | None = None) -> None:
        """Record that the attempt has seen a response event (it has output now).
        ``op_key``: the attempt's operation (see ``finish``)."""
        with self._tx() as db:
            row = db.execute(
                "UPDATE attempts SET events_seen=MAX(events_seen, 1)"
                " WHERE attempt_id=? AND op_key=coalesce(?, op_key) RETURNING op_key",
                (attempt_id, op_key),
            ).fetchone()
            if row is not None:
                db.execute(
                    "UPDATE operations SET events_seen=MAX(events_seen, 1) WHERE op_key=?", row
                )

    @_wrap
    def finish(
        self, attempt_id: int, end: AttemptEnd, *, now: float,
        circuit_cfg: circuit.CircuitConfig | None = None, eventless_failure: bool = False,
        transport: str = "http", op_key: str | None = None,
    ) -> FinishResult:
        """Record an attempt's end, move its operation to the outcome and, with
        ``circuit_cfg``, feed the outcome to the operation's retry circuit (same transaction).

        Fenced: only an attempt still in flight is finished, and only the operation's current
        attempt moves the operation. ``applied`` is False when fenced out (e.g. reaped); the
        outcome is then kept as the attempt's ``late_outcome`` (for the record), and nothing
        else changes. ``op_key``: the attempt's operation, as its writer knows it. An attempt
        id names another operation's attempt in an older copy of the file put back in place
        (its ids are handed out again); such an end is fenced out, never applied there."""
        with self._tx() as db:
            return self._finish(db, attempt_id, end, now, circuit_cfg, eventless_failure,
                                op_key)

    @_wrap
    def record_offline_attempt(
        self, identity: Identity, *, method: str, path: str, kind: str, flow_id: str | None,
        circuit_scope: str | None, end: AttemptEnd, now: float,
        circuit_cfg: circuit.CircuitConfig | None = None, eventless_failure: bool = False,
        transport: str = "http", running: tuple[int, ...] = (), moving: bool = False,
    ) -> FinishResult:
        """Record an attempt this instance dispatched and ended while the ledger could not be
        written (it has no row): its operation, the attempt and its end, as ``finish`` would
        have, so that other processes replay it rather than run it again. When the operation
        is in flight under an attempt of this instance, that attempt is this one's claim (it
        answered after its request was decided without the ledger, or its commit was in doubt:
        this instance runs no other attempt of an operation it ran without a row): the end is
        recorded on it, unless it is one of ``running`` (the rows of this instance's attempts
        of the operation that still run: a retry dispatched after this attempt ended, and
        registered since). Nothing is recorded (``applied`` False) when the operation is in
        flight meanwhile under another instance's attempt, or under one of ``running``; nor,
        ``moving`` (a completed attempt of a file since deleted or replaced, recorded in this
        one), when the operation is in flight or completed here: an end owed and recorded
        whole just before, the older copy's own, or another attempt that runs now decides.
        Ended otherwise here (an attempt the older copy showed in flight, ended as stale),
        it takes this end: the operation completed."""
        with self._tx() as db:
            snapshot = self._snapshot(db, identity.op_key)
            if moving and snapshot is not None and snapshot.state in ("in_flight", "completed"):
                return FinishResult(False)
            if snapshot is not None and snapshot.state == "in_flight":
                if (snapshot.owner_instance != self.instance_id
                        or snapshot.current_attempt is None
                        or snapshot.current_attempt in running):
                    return FinishResult(False)
                return self._finish(db, snapshot.current_attempt, end, now, circuit_cfg,
                                    eventless_failure, identity.op_key)
            if snapshot is None:
                self._insert_operation(db, identity, method, path, circuit_scope, now)
            attempt_id = self._claim(db, identity, kind, flow_id, now, transport)
            return self._finish(db, attempt_id, end, now, circuit_cfg, eventless_failure,
                                identity.op_key)

    def _finish(
        self, db: sqlite3.Connection, attempt_id: int, end: AttemptEnd, now: float,
        circuit_cfg: circuit.CircuitConfig | None, eventless_failure: bool, op_key: str | None,
    ) -> FinishResult:
        rec = end.recording
        row = db.execute(
            "UPDATE attempts SET ended_at=?, status=?, events_seen=MAX(events_seen, ?),"
            " outcome=?, detail=?, headers=?, body_bytes=?, replayable=?, vary_key=?"
            " WHERE attempt_id=? AND op_key=coalesce(?, op_key) AND outcome='in_flight'"
            " RETURNING op_key",
            (
                now, end.status, end.events_seen, end.outcome, end.detail,
                json.dumps(rec.headers) if rec else None,
                len(rec.body) if rec else None, 1 if rec else 0,
                rec.vary_key if rec else None, attempt_id, op_key,
            ),
        ).fetchone()
        if row is None:
            db.execute(
                "UPDATE attempts SET late_outcome=?"
                " WHERE attempt_id=? AND op_key=coalesce(?, op_key) AND late_outcome IS NULL",
                (end.outcome, attempt_id, op_key),
            )
            return FinishResult(False)
        if rec is not None:
            self._spool(db, attempt_id, rec.body)
        moved = db.execute(
            "UPDATE operations SET state=?, updated_at=?, ended_at=?,"
            " events_seen=MAX(events_seen, ?),"
            " replay_attempt=?"  # never an older attempt's recording
            " WHERE op_key=? AND current_attempt=? RETURNING circuit_scope",
            (
                end.outcome, now, now, end.events_seen,
                attempt_id if rec is not None else None, row[0], attempt_id,
            ),
        ).fetchone()
        if moved is None:
            return FinishResult(False)
        if circuit_cfg is None or moved[0] is None:
            return FinishResult(True)
        return self._feed_circuit(db, moved[0], end, now, circuit_cfg, eventless_failure)

    def _feed_circuit(
        self, db: sqlite3.Connection, scope: str, end: AttemptEnd, now: float,
        cfg: circuit.CircuitConfig, eventless_failure: bool,
    ) -> FinishResult:
        """The attempt's end, fed to its operation's retry circuit (inside ``finish``)."""
        before = self._circuit(db, scope)
        after, transition = circuit.record_outcome(
            before, eventless_failure=eventless_failure,
            completed=end.outcome == "completed", now=now, cfg=cfg,
        )
        if after != before:
            db.execute(
                "INSERT INTO circuits (scope, failures, open_until, cooldown_s, updated_at)"
                " VALUES (?,?,?,?,?) ON CONFLICT(scope) DO UPDATE SET failures=excluded.failures,"
                " open_until=excluded.open_until, cooldown_s=excluded.cooldown_s,"
                " updated_at=excluded.updated_at",
                (scope, after.failures, after.open_until, after.cooldown_s, now),
            )
        return FinishResult(True, scope, after, transition)

    @staticmethod
    def _spool(db: sqlite3.Connection, attempt_id: int, body: bytes) -> None:
        """Keep a recording's body, in chunks."""
        db.executemany(
            "INSERT INTO spool (attempt_id, seq, data) VALUES (?,?,?)",
            ((attempt_id, i, body[off: off + SPOOL_CHUNK])
             for i, off in enumerate(range(0, max(len(body), 1), SPOOL_CHUNK))),
        )

    @staticmethod
    def _circuit(db: sqlite3.Connection, scope: str) -> circuit.CircuitState:
        row = db.execute(
            "SELECT failures, open_until, cooldown_s FROM circuits WHERE scope=?", (scope,)
        ).fetchone()
        return circuit.CircuitState(*row) if row else circuit.CircuitState()

    @_wrap
    def circuit_state(self, scope: str) -> circuit.CircuitState:
        """The circuit of a scope (closed when never seen)."""
        return self._circuit(self._conn(), scope)

    @_wrap
    def open_circuits(self, now: float) -> list[tuple[str, circuit.CircuitState]]:
        """Scopes cooling down now, for status."""
        rows = self._conn().execute(
            "SELECT scope, failures, open_until, cooldown_s FROM circuits WHERE open_until>?",
            (now,),
        ).fetchall()
        return [(r[0], circuit.CircuitState(*r[1:])) for r in rows]

    # -- durable sessions ----------------------------------------------------------------------
    @staticmethod
    def _session(db: sqlite3.Connection, session: str) -> policy.SessionOwnership | None:
        row = db.execute(
            "SELECT durable_id, owner_instance, owner_epoch, lease_until FROM sessions"
            " WHERE session=?",
            (session,),
        ).fetchone()
        return policy.SessionOwnership(*row) if row else None

    def _owns(self, db: sqlite3.Connection, session: str, epoch: int) -> bool:
        row = self._session(db, session)
        return row is not None and (row.owner_instance, row.owner_epoch) == (
            self.instance_id, epoch,
        )

    def _owns_for_recovery(self, db: sqlite3.Connection, session: str, epoch: int,
                           now: float) -> bool:
        """Whether this instance owns ``session`` at ``epoch``, for a recovery claim (in the
        claim's transaction). A file with no row of the session (deleted or replaced under
        the running process since its last renewal) does not know it, and no instance took
        it over there: it is registered again, owned by this instance at ``epoch``, its
        lease ending now (any instance may take it over from then on, with a higher epoch;
        this one renews it at its next claim of the session), and the claim is its owner's."""
        if self._session(db, session) is None:
            db.execute(
                "INSERT INTO sessions (session, durable_id, owner_instance, owner_epoch,"
                " lease_until, created_at, updated_at) VALUES (?,?,?,?,?,?,?)",
                (session, uuid.uuid4().hex, self.instance_id, epoch, now, now, now))
            return True
        return self._owns(db, session, epoch)

    @_wrap
    def claim_session(
        self, session: str, *, now: float, lease_s: float, new_id: str
    ) -> tuple[policy.SessionOwnership, policy.SessionClaimResult]:
        """Claim or renew the durable session for this instance (see ``policy.claim_session``)."""
        with self._tx() as db:
            before = self._session(db, session)
            after, result = policy.claim_session(
                before, instance=self.instance_id, now=now, lease_s=lease_s, new_id=new_id
            )
            if result != "owned_by_other":
                db.execute(
                    "INSERT INTO sessions (session, durable_id, owner_instance, owner_epoch,"
                    " lease_until, created_at, updated_at) VALUES (?,?,?,?,?,?,?)"
                    " ON CONFLICT(session) DO UPDATE SET owner_instance=excluded.owner_instance,"
                    " owner_epoch=excluded.owner_epoch, lease_until=excluded.lease_until,"
                    " updated_at=excluded.updated_at",
                    (
                        session, after.durable_id, after.owner_instance, after.owner_epoch,
                        after.lease_until, now, now,
                    ),
                )
            return after, result

    @_wrap
    def session_owned_by(self, session: str, instance_id: str, epoch: int) -> bool:
        """Whether ``instance_id`` still owns ``session`` at ``epoch`` (read only)."""
        row = self._session(self._conn(), session)
        return row is not None and (row.owner_instance, row.owner_epoch) == (instance_id, epoch)

    @_wrap
    def renew_session(self, session: str, epoch: int, *, now: float, lease_s: float) -> bool:
        """Extend the lease of a session this instance owns at ``epoch`` (a fenced write).
        False: ownership was lost (another instance took over with a higher epoch).

        A file that has no row of the session (the ledger was deleted, or replaced by a copy
        made before the session was claimed, under the running process) does not know it: no
        instance took it over there. The session is registered in it again, owned by this
        instance at ``epoch`` (with a new durable id), so that its held requests keep their
        owner proof and their recovery claim stays fenced by that epoch; an instance that
        claims it in this file first owns it, and this one has lost it."""
        with self._tx() as db:
            if db.execute(
                "UPDATE sessions SET lease_until=?, updated_at=? WHERE session=?"
                " AND owner_instance=? AND owner_epoch=? RETURNING session",
                (now + lease_s, now, session, self.instance_id, epoch),
            ).fetchone() is not None:
                return True
            return db.execute(
                "INSERT INTO sessions (session, durable_id, owner_instance, owner_epoch,"
                " lease_until, created_at, updated_at) VALUES (?,?,?,?,?,?,?)"
                " ON CONFLICT(session) DO NOTHING RETURNING session",
                (session, uuid.uuid4().hex, self.instance_id, epoch, now + lease_s, now, now),
            ).fetchone() is not None

    @_wrap
    def recording(self, attempt_id: int, op_key: str | None = None) -> Recording | None:
        """The replayable response of an attempt, or None if it has none (purged, not kept,
        or, with ``op_key``, the attempt is not that operation's: see ``finish``)."""
        db = self._conn()
        row = db.execute(
            "SELECT status, headers, vary_key, ended_at FROM attempts"
            " WHERE attempt_id=? AND op_key=coalesce(?, op_key) AND replayable=1",
            (attempt_id, op_key),
        ).fetchone()
        if row is None:
            return None
        body = b"".join(
            r[0]
            for r in db.execute(
                "SELECT data FROM spool WHERE attempt_id=? ORDER BY seq", (attempt_id,)
            )
        )
        headers = tuple((str(k), str(v)) for k, v in json.loads(row[1] or "[]"))
        return Recording(row[0], headers, body, row[2], row[3])

    # -- duplicates (inspection only) -----------------------------------------------------------

    @_wrap
    def note_duplicates(self, counts: Iterable[tuple[str, int, int]]) -> None:
        """Count duplicates of operations, ``(op_key, held, replayed)`` of each: ``held`` (a
        hold began), ``replayed`` (answered from a recording). For inspection only: no
        decision reads them."""
        with self._tx() as db:
            db.executemany(
                "UPDATE operations SET duplicates_held=duplicates_held+?,"
                " duplicates_replayed=duplicates_replayed+? WHERE op_key=?",
                [(held, replayed, op_key) for op_key, held, replayed in counts],
            )


    # -- instances, restart, retention ----------------------------------------------------------
    def _register(self, db: sqlite3.Connection, now: float, *, keep_incarnation: bool) -> int:
        """Insert or refresh this instance's row; returns its incarnation. A row that exists
        (a script reload in this process) keeps its incarnation when ``keep_incarnation``."""
        me = self.identity
        row = db.execute(
            "INSERT INTO instances (instance_id, pid, host, started_at, heartbeat_at, boot_id,"
            " pid_ns, start_ticks, incarnation) VALUES (?,?,?,?,?,?,?,?,?)"
            " ON CONFLICT(instance_id) DO UPDATE SET heartbeat_at=excluded.heartbeat_at,"
            " pid=excluded.pid, host=excluded.host, boot_id=excluded.boot_id,"
            " pid_ns=excluded.pid_ns, start_ticks=excluded.start_ticks,"
            " incarnation=CASE WHEN ? THEN incarnation ELSE excluded.incarnation END"
            " RETURNING incarnation",
            (
                self.instance_id, me.pid, me.host, now, now, me.boot_id, me.pid_ns,
                me.start_ticks, self.incarnation + 1, keep_incarnation,
            ),
        ).fetchone()
        return row[0]

    @_wrap
    def heartbeat(self, now: float, *, as_probe: bool = False) -> HeartbeatResult:
        """Renew this instance's lease. ``reregistered`` when its row was gone (another
        process judged it dead and reaped its attempts): it is registered again under a new
        incarnation, and the caller must assume its attempts in flight were ended.
        ``as_probe``: the probe of a ledger that failed (``PgLedger.heartbeat``); here its
        write proves that a claim could be written too (one write lock for the file)."""
        with self._tx() as db:
            if db.execute(
                "UPDATE instances SET heartbeat_at=? WHERE instance_id=? RETURNING 1",
                (now, self.instance_id),
            ).fetchone():
                return "renewed"
            self.incarnation = self._register(db, now, keep_incarnation=False)
            return "reregistered"

    @_wrap
    def mark_moved(self, from_generation: str, now: float) -> None:
        """Note in this file that this instance has registered here every attempt it had in
        flight in the ledger file of ``from_generation`` (deleted or replaced since): the
        processes that shared that file wait for it before they decide here
        (``moved_peers``)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?)"
                " ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (moved_key(from_generation, self.instance_id), repr(now)),
            )

    @_wrap
    def moved_peers(self, from_generation: str) -> set[str]:
        """The instances that noted (``mark_moved``) that their attempts in flight in the
        file of ``from_generation`` are registered in this one."""
        prefix = moved_key(from_generation, "")
        rows = self._conn().execute(
            "SELECT substr(key, ?) FROM meta WHERE substr(key, 1, ?) = ?",
            (len(prefix) + 1, len(prefix), prefix),
        ).fetchall()
        return {r[0] for r in rows}

    @_wrap
    def peers_with_attempts_in_flight(self, *, or_replayable: bool = False
                                      ) -> list[liveness.PeerRow]:
        """Other instances that own attempts still in flight (candidates for reaping); with
        ``or_replayable``, also those that own attempts whose recordings may still be
        replayed. An instance without a row (reaped, and not heard of since) has an empty
        identity, and the start of its newest such attempt stands for its heartbeat: it made
        that attempt, so it was alive then."""
        # each kind read through its partial index: the rows of the attempts that ended
        # without a recording (most of a ledger's) are never scanned
        rows = self._conn().execute(
            "SELECT a.instance_id, COALESCE(i.host, ''), COALESCE(i.boot_id, ''),"
            " COALESCE(i.pid_ns, ''), COALESCE(i.pid, -1), i.start_ticks,"
            " COALESCE(i.heartbeat_at, MAX(a.started_at)) FROM ("
            "SELECT instance_id, started_at FROM attempts INDEXED BY attempts_in_flight"
            " WHERE outcome='in_flight' AND instance_id<>?"
            " UNION ALL SELECT instance_id, started_at FROM attempts"
            " INDEXED BY attempts_replayable WHERE replayable=1 AND ? AND instance_id<>?"
            ") a LEFT JOIN instances i ON i.instance_id = a.instance_id"
            " GROUP BY a.instance_id",
            (self.instance_id, or_replayable, self.instance_id),
        ).fetchall()
        return [
            liveness.PeerRow(r[0], liveness.ProcessIdentity(r[1], r[2], r[3], r[4], r[5]), r[6])
            for r in rows
        ]

    @_wrap
    def ops_in_flight_elsewhere(self) -> list[tuple[str, str]]:
        """``(instance_id, op_key)`` of each attempt another instance has in flight here."""
        rows = self._conn().execute(
            "SELECT instance_id, op_key FROM attempts WHERE outcome='in_flight'"
            " AND instance_id<>?", (self.instance_id,)).fetchall()
        return [(r[0], r[1]) for r in rows]

    @_wrap
    def ops_left_elsewhere(self) -> list[tuple[str, str, float | None]]:
        """``(instance_id, op_key, ended_at)`` of each attempt another instance has here in
        flight (``ended_at`` None) or ended with a recording that may still be replayed (its
        end, wall clock)."""
        rows = self._conn().execute(  # through the partial indexes, as above
            "SELECT instance_id, op_key, NULL FROM attempts INDEXED BY attempts_in_flight"
            " WHERE outcome='in_flight' AND instance_id<>?"
            " UNION ALL SELECT instance_id, op_key, ended_at FROM attempts"
            " INDEXED BY attempts_replayable"
            " WHERE replayable=1 AND outcome<>'in_flight' AND instance_id<>?",
            (self.instance_id, self.instance_id)).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    def attempts_left_behind(self) -> tuple[list[liveness.PeerRow],
                                            list[tuple[str, str, float | None]]]:
        """What the other instances have in this ledger as this process leaves it (another
        ledger now at its path): ``peers_with_attempts_in_flight(or_replayable=True)`` and
        ``ops_left_elsewhere()``. The file this connection opened is read, whatever is at its
        path now."""
        return (self.peers_with_attempts_in_flight(or_replayable=True),
                self.ops_left_elsewhere())

    @_wrap
    def end_stale_attempts(self, keep_ops: list[str], *, now: float) -> list[str]:
        """End this instance's attempts that this file shows in flight for operations it has
        no attempt in flight of (an older copy of the ledger put in its place shows attempts
        this process ended since): ``unknown`` when they saw no event, ``partial`` otherwise.
        Returns the keys of the operations that moved."""
        with self._tx() as db:
            ended = db.execute(
                "UPDATE attempts SET ended_at=?, detail='ended by its owner in another file',"
                " outcome=CASE WHEN events_seen>0 THEN 'partial' ELSE 'unknown' END"
                " WHERE instance_id=? AND outcome='in_flight'"
                " AND op_key NOT IN (SELECT value FROM json_each(?))"
                " RETURNING attempt_id, op_key, outcome",
                (now, self.instance_id, json.dumps(keep_ops)),
            ).fetchall()
            return _operations_ended_with(db, ended, now)

    @_wrap
    def reap_instance(
        self, instance_id: str, *, now: float, heartbeat_was: float | None = None,
    ) -> list[str]:
        """End the in-flight attempts of a dead instance: ``unknown`` when they saw no event,
        ``partial`` otherwise. Returns the keys of the operations that moved.

        ``heartbeat_was``: the instance was judged dead by its lease, its heartbeat seen at
        this value (``peers_with_attempts_in_flight``) for a whole lease; the reap happens only
        if it still is inside the transaction (any other value, later or earlier: it renewed
        its lease since). Compares no clocks: see ``liveness.Silences``."""
        with self._tx() as db:
            if heartbeat_was is not None:
                row = db.execute(
                    "SELECT COALESCE((SELECT heartbeat_at FROM instances WHERE instance_id=?),"
                    " (SELECT MAX(started_at) FROM attempts WHERE instance_id=?"
                    " AND outcome='in_flight'))",
                    (instance_id, instance_id),
                ).fetchone()
                if row[0] != heartbeat_was:
                    return []
            ended = db.execute(
                "UPDATE attempts SET ended_at=?, detail='owner process gone',"
                " outcome=CASE WHEN events_seen>0 THEN 'partial' ELSE 'unknown' END"
                " WHERE instance_id=? AND outcome='in_flight' RETURNING attempt_id, op_key, outcome",
                (now, instance_id),
            ).fetchall()
            moved = _operations_ended_with(db, ended, now)
            db.execute("DELETE FROM instances WHERE instance_id=?", (instance_id,))
            return moved

    @_wrap
    def purge_recordings(self, *, now: float, window_s: float) -> int:
        """Delete the bytes of the recordings that can no longer be replayed: those of
        operations without an ``Idempotency-Key`` that ended more than ``window_s`` ago (past
        the replay window a request of theirs is dispatched again; an ``Idempotency-Key``
        keeps its recording for the retention). Their attempts stay, no longer replayable.
        Returns the recordings purged. Reads only the recordings past the window (by index)
        and their operations (by key), never the whole ledger."""
        with self._tx() as db:
            purged = db.execute(
                "UPDATE attempts SET replayable=0, headers=NULL WHERE replayable=1"
                " AND ended_at<? AND EXISTS (SELECT 1 FROM operations o"
                " WHERE o.op_key=attempts.op_key AND o.idempotency_key IS NULL)"
                " RETURNING attempt_id",
                (now - window_s,),
            ).fetchall()
            db.executemany("DELETE FROM spool WHERE attempt_id=?", purged)
            return len(purged)

    @_wrap
    def collect_garbage(self, *, now: float, retention_s: float, instance_stale_s: float) -> int:
        """Delete ended operations (with their attempts and spool), circuits and sessions last
        touched before the retention horizon (a circuit only once its cooldown is over, a
        session only once its lease expired), and instance rows not heard of for
        ``instance_stale_s`` that own nothing in flight. Returns the operations deleted."""
        horizon = now - retention_s
        with self._tx() as db:
            # An operation whose one recovery dispatch ended without a known result stays as
            # a tombstone (its row, without attempts or bodies), so once mode refuses it for
            # good, not only for the retention.
            db.execute(
                "DELETE FROM attempts WHERE op_key IN (SELECT op_key FROM operations"
                f" WHERE {_SPENT} AND updated_at<?)",
                (horizon,),
            )
            n = db.execute(
                "DELETE FROM operations WHERE state<>'in_flight' AND updated_at<?"
                f" AND NOT ({_SPENT})",
                (horizon,),
            ).rowcount
            db.execute(
                "DELETE FROM circuits WHERE updated_at<? AND COALESCE(open_until, 0)<?",
                (horizon, now),
            )
            db.execute(
                "DELETE FROM sessions WHERE updated_at<? AND lease_until<?", (horizon, now)
            )
            db.execute(
                "DELETE FROM instances WHERE heartbeat_at<? AND instance_id<>? AND instance_id"
                " NOT IN (SELECT instance_id FROM attempts WHERE outcome='in_flight')",
                (now - instance_stale_s, self.instance_id),
            )
        if n:  # move the deletions out of the WAL too, so purged bodies are gone from disk
            self._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return n


class _Joined:
    """A call's transaction inside ``Ledger.batch``: the batch's own (begins and ends it)."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        return None


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; rolls back on any exception."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.db.execute("COMMIT")
        elif self.db.in_transaction:
            self.db.execute("ROLLBACK")


def _superseded(snapshot: policy.OperationSnapshot) -> AttemptEnd:
    """The end of an attempt whose owed end a later attempt of its instance overtook
    (``adopt_attempt``)."""
    return AttemptEnd("partial" if snapshot.events_seen else "unknown", None,
                      snapshot.events_seen, "superseded: a later attempt of this instance was "
                      "registered before its end could be written")


def _refuse_if_sidecars_deleted(real: str, path: str) -> None:
    """Raise ``LedgerError`` when a -wal or -shm of the file at ``real`` (the ledger ``path``)
    was deleted while a connection has it open (``sidecars_deleted_under_a_connection``):
    SQLite would give this connection new ones."""
    deleted = ledger_files.sidecars_deleted_under_a_connection(real)
    if deleted is not None:
        raise LedgerError(f"the {deleted} of {shown(path)} was deleted while a connection has "
                          "the file open; opened once a process on it made the file anew (or "
                          "none has it open)")


def _stamp(path: str) -> tuple[int, ...]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def check_path(path: str) -> str:
    """Refuse a ledger path others could write to or redirect, by the rules of
    ``private_files.check_private_path`` (on the path and on its real path); return the real
    path, which is what SQLite opens."""
    if path == ":memory:":
        return path
    try:
        real = check_private_path(path)
    except UnsafePath as e:
        raise LedgerError(str(e)) from None
    try:  # a folder, FIFO or device there can never be opened as the ledger
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return real
    except OSError as e:
        raise LedgerError(f"{shown(path)} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise LedgerError(f"{shown(path)} is not a regular file")
    try:  # SQLite would take them as they are, the look below included
        for suffix in ("-wal", "-shm"):
            check_private_file(real + suffix)
    except UnsafePath as e:
        raise LedgerError(str(e)) from None
    found = _look(real)
    if found is not None and found.foreign:
        raise LedgerError(f"{shown(path)} is not a turnguard ledger (a SQLite database of something"
                          " else); left untouched")
    return real


@record
class _Found:
    """What a read-only look at an existing file found (``_look``)."""

    not_a_database: bool  # no SQLite database at all (a wrong path, junk)
    version: int  # its user_version (0: none set)
    tables: frozenset[str]

    @property
    def foreign(self) -> bool:
        """Another program's database: tables, and no schema version of ours; or a version
        this turnguard knows without turnguard's first tables (many programs set
        ``user_version`` too); or a negative version, which turnguard never sets. A newer
        version is not called foreign: it may be a newer turnguard's ledger."""
        return self.version < 0 or bool(self.tables) and (self.version == 0 or (
            self.version <= SCHEMA_VERSION and not _FIRST_TABLES <= self.tables))


# The tables every turnguard ledger has had since its first schema version.
_FIRST_TABLES = frozenset({"instances", "operations", "attempts"})


def _readonly_uri(real: str, owner: int | None = None) -> tuple[str, bool]:
    """The URI of a read-only open of the ledger at ``real`` that makes nothing beside it,
    and whether a -shm was made for it. Without a -wal no connection has the file open and
    every row is in it: read as immutable, SQLite makes no -wal and -shm (a plain read-only
    open would, with O_CREAT and the file's mode, taking one another user put there first).
    With a -wal (``owner``'s regular file, else ``UnsafePath``) SQLite reads its rows through
    a -shm: a missing one is made 0600, O_EXCL."""
    uri = f"file:{urllib.parse.quote(real)}?mode=ro"
    if check_private_file(real + "-wal", owner=owner) is None:
        return uri + "&immutable=1", False
    return uri, create_private_file(real + "-shm", owner=owner)


def _look(path: str) -> _Found | None:
    """A read-only look at the existing file at ``path`` through SQLite (None: it cannot be
    read now, which the open reports). Never a descriptor of our own: closing one would drop
    every lock SQLite holds on the file in this process. Read as ``_readonly_uri`` says; not
    while a -wal or -shm of it was deleted under a connection (a -shm made for the look would
    be another index of the WAL that connection goes on writing), nor while the ones beside
    it are another file's (``stale_sidecars``: the look would read that file's WAL)."""
    if ledger_files.sidecars_deleted_under_a_connection(path) is not None \
            or ledger_files.stale_sidecars(path):
        return None
    try:
        uri, _ = _readonly_uri(path)
        probe = sqlite3.connect(uri, uri=True, timeout=PROBE_BUSY_S, isolation_level=None)
    except (sqlite3.Error, OSError):
        return None
    try:
        tables = frozenset(row[0] for row in probe.execute(
            "SELECT name FROM sqlite_master WHERE type='table'"))
        found = _Found(False, probe.execute("PRAGMA user_version").fetchone()[0], tables)
    except sqlite3.DatabaseError as e:
        if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_NOTADB:
            return _Found(True, 0, frozenset())
        return None
    except sqlite3.Error:
        return None
    finally:
        probe.close()
    if uri.endswith("&immutable=1") or not _file_is_no_database(path):
        return found
    return _Found(True, 0, frozenset())


def _file_is_no_database(path: str) -> bool:
    """The file itself is no SQLite database, whatever the -wal beside it holds. Read through
    a WAL that holds a ledger's first page (the -wal and -shm of a ledger that a file that is
    no database was moved over), junk looks like that ledger: opened, its reads of the pages
    the WAL lacks would find junk, and its checkpoints write pages into it. Read immutable,
    SQLite ignores the -wal and reads the file's own header."""
    try:
        probe = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro&immutable=1",
                                uri=True, isolation_level=None)
    except (sqlite3.Error, OSError):
        return False
    try:
        probe.execute("PRAGMA schema_version").fetchone()
        return False
    except sqlite3.DatabaseError as e:
        return getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_NOTADB
    except sqlite3.Error:
        return False
    finally:
        probe.close()


# An operation whose once-only recovery claim was spent (policy.once_claim_spent): kept for good.
_SPENT = ("recovery_dispatches>=1 AND state IN ("
          + ",".join(f"'{state}'" for state in policy.SPENT_OUTCOMES) + ")")


def _split_sql(script: str) -> Iterable[str]:
    return (s.strip() for s in script.split(";") if s.strip())


def _dicts(cur: sqlite3.Cursor) -> list[dict]:
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _operations_ended_with(db: sqlite3.Connection, ended: list[tuple[int, str, str]],
                           now: float) -> list[str]:
    """The operations whose current attempt is one of ``ended`` (attempt id, operation,
    outcome), moved to that outcome. Returns their keys."""
    moved = []
    for attempt_id, op_key, outcome in ended:
        if db.execute(
            "UPDATE operations SET state=?, updated_at=?, ended_at=?"
            " WHERE op_key=? AND current_attempt=? RETURNING op_key",
            (outcome, now, now, op_key, attempt_id),
        ).fetchone():
            moved.append(op_key)
    return moved
