"""The one owner of "the ledger is down": try the ledger, fall back to memory, come back.

``FailoverStore`` gives the shell typed answers whether or not the ledger can be read:

- decisions (``admit``, ``recording``, sessions, circuits) go to the ``Store`` when it is
  usable, within the caller's deadline; when it is not (locked, full, gone, owing writes),
  a failed ledger is first tried again (``recover``: the moment a fault ends, decisions read it
  again), and otherwise ``MemoryStore`` decides from what this process learned durably;
- writes that decide the future (an attempt's end, its first event) are sent when the ledger
  is usable and otherwise kept, in order, and applied before it is read again; writes for a
  ledger file that was replaced meanwhile are dropped (their attempt ids mean nothing there);
- its lifecycle: opening (and re-opening after a fault), the heartbeat thread, a ledger file
  deleted or replaced under the process (an outage, never an empty ledger: this process's
  attempts in flight are registered in the new file before decisions read it), a
  registration that a peer reaped;
- which ledger: ``turnguard_ledger`` names an SQLite file, or a PostgreSQL database
  (``postgresql://...``) shared by several hosts. On PostgreSQL, the ends of other processes'
  attempts are notified (``pg_ledger.AttemptEndListener``, LISTEN/NOTIFY) and handed to
  ``on_attempt_ended``, so duplicates held on them are woken without polling;
  ``attempt_ends_notified`` says whether that works now (else the ticker polls).

Outages are said once each (``ledger_unavailable`` ... ``ledger_recovered``) through ``emit``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol, TypeVar

from . import circuit, liveness, policy
from .counting import OperationCounts
from .ending import AttemptEnding
from .heartbeat import Heartbeat
from .identity import Identity
from .knowledge import KnownRecording, MemoryStore
from .ledger import AttemptEnd, FinishResult, Ledger, LedgerError, Recording
from .ledger_admin import LedgerAdmin
from .ledger_location import display, is_postgres
from .ledger_runner import LedgerRunner, LedgerTimeout, contended, writes_refused
from .records import record
from .store import (
    AppliedOnce,
    DuplicatesWrite,
    FinishWrite,
    FirstEventWrite,
    OfflineEndWrite,
    GiveBackWrite,
    LedgerStore,
    Store,
    Write,
    loop_running,
)

logger = logging.getLogger("turnguard")

LEDGER_BUSY_MS = 500  # SQLite busy timeout: claims by other processes take milliseconds
LEDGER_LATE_S = 0.25  # grace for a call that started in time to finish
PROBE_S = 0.1  # longest a probe of a failed ledger that no request waits for waits for a lock
# Longest a request waits for its read of a ledger that cannot be written (another
# connection's lock, a full disk, read-only files, a standby), on a connection of its own
# (``_read_apart_while_down``; a few milliseconds): short of a request's ledger step (0.5 s),
# so that it leaves the time to go on as before.
READ_APART_WHILE_DOWN_S = 0.15
# ... on PostgreSQL, where such a read may connect to the server first (a few ms on a quiet
# machine, a few hundred on a busy one; ``PgLedger.read_apart`` keeps connections for the
# next ones)
READ_APART_WHILE_DOWN_PG_S = 0.6
# At most this many such reads at a time (each opens a connection: a flood of requests in an
# outage must not add one for each; on PostgreSQL each connects to the server: one at a time
# left the requests that came together, but for the first, decided blind in memory; on
# SQLite a request's admission past them waits for one to end: ``_read_apart_slot``)
READS_APART_MAX = 4
# A call the ledger's connection has been in this long waits for a lock (or a server): claims
# take milliseconds. The calls queued behind it come back unread, whatever their ledger says;
# a read apart can still answer them (a lock this process had not met yet, on PostgreSQL too).
STUCK_CALL_S = 0.3
CLOSE_WRITES_S = 2.0  # at close, writes still owed are tried this long at most
REOPEN_S = 5.0  # a ledger that could not be opened is tried again this often
# ... and this often while the process owes it rows, or a request would be decided without it
# (an SQLite file: a try to open one that is no database fails at once)
REOPEN_SOON_S = 0.1
HEARTBEAT_S = 5.0  # this instance's lease is renewed this often (on a thread of its own)
# After the ledger file was deleted or replaced: how long decisions in the new file wait for
# the processes that had attempts in flight or recordings in the old one to register them
# there (each notices within a second, then opens the new file and registers them at once).
PEERS_REGISTERING_S = 5.0
# the peers awaited when the file left could not be read: a name no process notes
UNREAD_PEERS = "(unknown)"
PEERS_READ_S = 0.2  # longest the event loop waits to read them from the old file
# How long a process spends recording its own recordings in the new file as it moves there
# (newest first), before it notes that it moved: within the peers' wait, and short, since
# its own requests are decided in memory meanwhile (``_record_own_recordings``).
MOVE_RECORDINGS_S = 2.0
# recordings moved a transaction (``_move_batches``), at most so many, or more bytes than this
# only when one alone is: one transaction each made 10,000 (what memory keeps) 1-4 s of the
# event loop's; 100 together take about 35 us each, and the loop runs in between
MOVE_BATCH = 100
MOVE_BATCH_BYTES = 1024 * 1024
# A request whose hold would end sooner than this is not held for them: past its hold bound a
# held request gets 409 turn_in_progress, which is a duplicate's answer (re-admissions come
# every 0.2 s).
PEERS_HOLD_MARGIN_S = 0.5
MAX_UNWRITTEN_COUNTS = 1000  # operations whose duplicate counts wait for the ticker, at most
# recordings carried by the attempts' ends owed to the ledger (kept while it is locked, full or
# gone), at most: past it an end is kept without its recording (see ``FailoverStore.finish``)
MAX_OWED_RECORDING_BYTES = 64 * 1024 * 1024

Emit = Callable[..., None]  # telemetry: emit(event, **fields)

# The call a ledger write is, as ``ledger_unavailable`` names it (``during``) and the metrics
# count it (``metrics.LEDGER_CALLS``): an end recorded, a first event, duplicate counts, a
# claim given back.
WRITE_CALLS: dict[type, str] = {
    FinishWrite: "finish", OfflineEndWrite: "finish", FirstEventWrite: "first_event",
    DuplicatesWrite: "note_duplicates", GiveBackWrite: "give_back",
}
T = TypeVar("T")


def _recording_bytes(write: Write) -> int:
    """The bytes of the recording a write carries (an attempt's end), else 0."""
    if isinstance(write, (FinishWrite, OfflineEndWrite)) and write.end.recording is not None:
        return len(write.end.recording.body)
    return 0


def _settle(task: asyncio.Future) -> None:
    """Retrieve the outcome of a ledger call its caller stopped waiting for."""
    if not task.cancelled():
        task.exception()


class ControlError(Exception):
    """An operator's control action could not be run (the message says why)."""


class AttemptInFlight(Protocol):
    """What the store needs of an attempt this process has in flight."""

    ident: Identity
    attempt_id: int | None
    generation: str  # of the ledger file that holds attempt_id
    kind: str
    flow_id: str
    method: str
    route: str
    circuit_scope: str
    transport: str


ANY_LEDGER = ""  # a kept write that names no ledger file (it needs no row of one)


@dataclass
class KeptWrite:
    generation: str  # the ledger file whose rows it names (ANY_LEDGER: none)
    write: Write
    landed: Callable[[Any, bool], None] | None = None
    # what to write instead into another file (an attempt's end, recorded whole); None: the
    # write is dropped there
    elsewhere: Callable[[], Write] | None = None
    # applied at most once to a file, however often it is sent (a write of it may still be
    # under way, and land, after the catch-up that sent it stopped waiting: ``AppliedOnce``)
    once: AppliedOnce = field(default_factory=AppliedOnce, repr=False, compare=False)

    def belongs_to(self, generation: str) -> bool:
        return self.generation in (ANY_LEDGER, generation)

    def for_ledger(self, generation: str) -> Write | None:
        """The write to apply to the ledger file of ``generation``; None: none (dropped)."""
        if self.belongs_to(generation):
            return self.write
        return None if self.elsewhere is None else self.elsewhere()


@record
class Unread:
    """The ledger could not be read now (say nothing, decide nothing from it)."""


UNREAD = Unread()


@record
class _Carried:
    """An admission decided from what an earlier ledger file said (``MemoryStore.carried``)."""

    decision: policy.Admission | policy.ReplayFromMemory


class Listener(Protocol):
    """What the store needs of a notification listener (``pg_ledger.AttemptEndListener``)."""

    live: bool

    def stop(self) -> None: ...


@dataclass
class _Opened:
    """An open ledger: the store, its heartbeat and (PostgreSQL) its attempt-end listener."""

    store: Store
    heartbeat: Heartbeat
    listener: Listener | None = None

    def close(self) -> None:
        if self.listener is not None:
            self.listener.stop()
        self.heartbeat.stop()
        self.store.close()


@dataclass
class PeersAwaited:
    """The peers awaited in the ledger file opened after one was left (deleted or replaced):
    the file left (``left``, its generation), the peers that had attempts in flight there
    and have not yet noted they registered them in the new one (``peers``, until ``until``,
    monotonic; ``behind``: the new file could not be opened at once), and of those the ones
    proven alive with the operations each had in flight, or recorded for a replay
    (``live``, ``live_ops``: op key -> instance id and the recorded attempt's end, wall
    clock, or None for one in flight), and the files left that showed each so
    (``live_left``: instance id -> their generations; a process may leave several files in a
    row, each of its peers notes the file it last used); and the operations those files
    showed in flight in any peer awaited, proven alive or not (``in_flight``: op key -> those
    peers), and those they showed recorded there (``recorded``): until the wait for the
    peers is over. The process's, not an addon instance's (``ProcessState``): the instance a
    script reload loads must go on waiting, or it would take a retry of a paused peer's turn
    for a new turn and run it a second time."""

    left: str = ""
    peers: set[str] = dataclasses.field(default_factory=set)
    until: float = 0.0
    behind: bool = False
    live: dict[str, liveness.PeerRow] = dataclasses.field(default_factory=dict)
    live_ops: dict[str, tuple[str, float | None]] = dataclasses.field(default_factory=dict)
    live_left: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    in_flight: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    recorded: set[str] = dataclasses.field(default_factory=set)

    def forget(self, instance_id: str) -> None:
        """The live peer ``instance_id`` registered its attempts, or is gone: none of its
        operations is held for it any more."""
        self.live.pop(instance_id, None)
        self.live_left.pop(instance_id, None)
        self.live_ops = {op: held for op, held in self.live_ops.items()
                         if held[0] != instance_id}


def _awaited(name: str) -> property:
    """A field of the process's ``PeersAwaited``, read and set as the store's own."""
    return property(lambda self: getattr(self._awaited, name),
                    lambda self, value: setattr(self._awaited, name, value))


class FailoverStore:
    _left = _awaited("left")
    _peers = _awaited("peers")
    _peers_until = _awaited("until")
    _peers_behind = _awaited("behind")
    _live_peers = _awaited("live")
    _live_peer_ops = _awaited("live_ops")
    _live_peer_left = _awaited("live_left")

    def __init__(
        self, *, instance_id: str, identity: liveness.ProcessIdentity, emit: Emit,
        memory: MemoryStore, kept: collections.deque[KeptWrite],
        attempts: Callable[[], Iterable[AttemptInFlight]],
        on_reregistered: Callable[[int], None],
        on_attempt_ended: Callable[[str, int, str], None] | None = None,
        peers_awaited: PeersAwaited | None = None,
        claims_in_doubt: list[tuple[int, str, str]] | None = None,
    ):
        # the process's (kept across script reloads): see ``PeersAwaited``
        self._awaited = PeersAwaited() if peers_awaited is None else peers_awaited
        self._instance_id = instance_id
        self._identity = identity
        self._emit = emit
        self.memory = memory
        self._kept = kept  # outlives a script reload, with the attempts it concerns
        self._kept_bytes = sum(_recording_bytes(k.write) for k in kept)  # of their recordings
        self._recording_not_kept_said = False  # the warning, once until nothing is owed
        self._sent: dict[asyncio.Future, KeptWrite] = {}  # sent, not yet known written
        self._attempts = attempts
        self._on_reregistered = on_reregistered
        self._on_attempt_ended = on_attempt_ended
        self._store: Store | None = None
        self._heartbeat: Heartbeat | None = None
        self._listener: Listener | None = None
        self.recheck_foreign = False  # notifications resumed: ends may have been missed
        self._notifications_lost = False
        self.polls = 0  # operations read to learn whether another process's attempt ended
        self.path = ""
        self.error: str | None = None  # the fault noted last; None: the ledger works
        # when the ledger last became usable again after a fault (time.monotonic(); -inf:
        # never failed): a peer's silence before then may be the ledger's, not the peer's
        self._answering_since = float("-inf")
        self._silences = liveness.Silences()  # how long each peer was seen silent
        self._reopen_at = 0.0
        self._opened_last = float("-inf")  # when a try to open it last began (monotonic)
        # attempts in flight that name another ledger file (a script reload opened the file
        # now at the path): registered in this one before any decision reads it
        self._adoption_due = False
        self._stale_attempts_due = False
        # claims in doubt not settled yet, (attempt id, operation, generation): those the
        # store told landed, and those of a store closed before it told (which may not have:
        # settling one that did not is giving back nothing). The process's: a script reload
        # closes the store, and the instance loaded settles them.
        self._claims_in_doubt = [] if claims_in_doubt is None else claims_in_doubt
        self._deciding: dict[str, int] = {}  # operations being decided here (``admit``)
        self._reopening: asyncio.Task | None = None  # a request's try to open the ledger
        # a try to open it under way (the ticker's or a request's: ``reopen_if_due``)
        self._reopen_under_way: asyncio.Future | None = None
        # closed for good (its addon instance was unloaded: ``close(final=True)``): nothing
        # opens a ledger for it again, not even a call of a request it was still deciding
        self._retired = False
        # opened at shutdown only to write what is owed (``open_to_write_owed``): the close's
        # writes have what is left of its ``CLOSE_WRITES_S`` (time.monotonic()); None: their own
        self._writes_due_by: float | None = None
        # the ledger file this process left (deleted or replaced): it notes in the new one,
        # once its attempts in flight are registered there, that it has (``mark_moved``)
        self._moved_from = ""
        # how long an operation's recording may be replayed (the shell's settings; None:
        # never): this process's own recordings within it are recorded in a new file as it
        # moves there (``_record_own_recordings``)
        self.replay_window_of: Callable[[Identity], float | None] = lambda ident: None
        # the peers that had attempts in flight in the file left (``_left``), awaited until
        # ``_peers_until`` (monotonic) to note the same: see ``_peers_registering``; of
        # those, the ones proven alive (same host and pid namespace, their pid theirs still:
        # ``liveness.proven_alive``), with the operations each had in flight there
        # (``_live_peers``, ``_live_peer_ops``): a request of one of those is held past
        # ``_peers_until`` while its process lives and has not registered them (a paused
        # process is alive: its turn must not run twice); ``_peers_behind``: the file at the
        # path could not be opened since it was left: the peers try again no sooner than
        # this process (``REOPEN_S``), so the wait starts again when it opens. All kept in
        # ``self._awaited``, the process's (``PeersAwaited``)
        self._recovering = asyncio.Lock()  # one catch-up at a time
        self._decided_in_memory = 0  # admissions decided in memory so far (``admit``)
        self._reading_apart = 0  # reads apart under way (``_read_apart_while_down``)
        # set, and made anew, as one of them ends: a request waiting for a slot wakes
        self._read_apart_ended = asyncio.Event()
        # faults noted so far, and the last one's error (``_fault_since``)
        self._faults = 0
        self._last_fault: str | None = None
        self._duplicates: dict[str, list[int]] = {}  # op_key -> [held, replayed], unwritten
        self._flushing: set[asyncio.Future] = set()  # flush_counts started by note_duplicates

    # -- state ---------------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._store is not None

    @property
    def beating(self) -> bool:
        """Its heartbeat renews this process's lease (the ledger is open, or was)."""
        return self._heartbeat is not None

    def take_heartbeat(self) -> "Heartbeat | None":
        """The heartbeat, taken out of this store: ``close`` leaves it renewing the process's
        lease (a script reload: the process lives on, and a reload to a script that fails to
        load leaves no instance to renew it). Whoever takes it stops it."""
        heartbeat, self._heartbeat = self._heartbeat, None
        return heartbeat

    @property
    def usable(self) -> bool:
        """Decisions may read the ledger: it is open, no fault was noted since it last worked,
        and it owes nothing (kept writes, attempts to register, claims in doubt to settle)."""
        return (self._store is not None and self.error is None and not self._kept
                and not self._adoption_due and not self._claims_in_doubt
                and not self._store.claims_in_doubt_pending)

    @property
    def owes_writes_behind_a_lock(self) -> bool:
        """The ledger is locked by another connection (or could not be opened for it) while
        this process owes it writes: an attempt without a row in this file (until it is
        written, another process takes the operation for new), an attempt's end (its
        duplicates wait for it). The maintenance then tries again as soon as a try gave up:
        each waits for the lock in SQLite's busy handler, without using the CPU, for
        ``PROBE_S`` at most (a request's call may be queued behind it: ``_catch_up``)."""
        if self.error is None or not contended(self.error):
            return False
        return self._owes_rows()

    @property
    def owes_writes_while_down(self) -> bool:
        """The ledger failed for another reason than another connection's lock (its disk
        full, its files read-only, its PostgreSQL server restarting or cut off by the
        network) while this process owes it writes (as for ``owes_writes_behind_a_lock``).
        Such a try often fails at once, so the maintenance tries again every tenth of a
        second, not at once and not once a second: an attempt dispatched from memory
        meanwhile is registered about as soon as the ledger can be written again, before a
        duplicate sent to another process then is taken for new."""
        if self.error is None or contended(self.error):
            return False
        return self._owes_rows()

    def _owes_rows(self) -> bool:
        """Writes are kept for the ledger, or attempts in flight have no row in its file;
        with no ledger open (its file replaced by one that is no ledger, say), every attempt
        in flight is owed to the one that opens next, and so are this process's own
        recordings of the file left that may still be replayed (other processes wait for
        them: ``_record_own_recordings``)."""
        if self._kept:
            return True
        if self._store is None:
            return any(True for _ in self._attempts()) \
                or self.memory.knowledge.has_own_recordings_outside(
                    "", now=time.time(), window_of=self.replay_window_of)
        return self._attempts_elsewhere(self.generation)

    def _attempts_elsewhere(self, generation: str) -> bool:
        """This process has attempts in flight without a row in the ledger file of
        ``generation`` (dispatched without one, or registered in another file)."""
        return any(a.generation != generation for a in self._attempts())

    def down_reason(self) -> str | None:
        """Why decisions cannot read the ledger now (None: they can)."""
        if self.usable:
            return None
        if self.error:
            return self.error
        if self._kept:
            return "writes owed"
        if self._adoption_due:
            return "attempts in flight to register"
        return "claims in doubt to settle" if self._store is not None else "ledger not open"

    @property
    def generation(self) -> str:
        return self._store.generation if self._store is not None else ""

    def _unread_for_good(self, on_retired: Callable[[], None] | None) -> None:
        """A request's call was answered ``UNREAD`` (its decision is about to be made from
        memory): when this store was closed for good meanwhile (``close(final=True)``: its
        addon instance was unloaded), ``on_retired()`` first, which may raise to have the
        request decided elsewhere (by the instance a script reload loaded, with its own
        ledger). Memory decides only when it returns (no instance to take the request:
        shutdown, a reload to a copy that fails to load or refuses its options), or when the
        ledger could not answer for another reason (an outage)."""
        if self._retired and on_retired is not None:
            on_retired()

    @property
    def location(self) -> str:
        """The ledger's location as it may be shown (a URL's password masked)."""
        return display(self.path)

    @property
    def attempt_ends_notified(self) -> bool:
        """Other processes' attempt ends are notified now (PostgreSQL, listener connected):
        duplicates held on them need no polling."""
        return self._listener is not None and self._listener.live and self.usable

    @property
    def kept_writes(self) -> int:
        return len(self._kept)

    @property
    def kept_recording_bytes(self) -> int:
        """The bytes of the recordings the writes owed to the ledger carry."""
        return self._kept_bytes

    # -- opening and closing -------------------------------------------------------------------
    def open(self, path: str, *, traffic_flows: bool = False) -> bool:
        """Open the ledger at ``path`` now (start-up, a change of option); a fault is noted
        and the ledger is tried again later (``reopen_if_due``). ``traffic_flows`` (a script
        reload: the proxy serves meanwhile): a PostgreSQL ledger is opened on a thread, as a
        reopen is, and False returned at once; a server that does not answer would hold the
        event loop, and every flow, for its connect timeout. Until it is open, a request's
        call waits for that try within its own bound."""
        self.close()
        self.path = path
        if traffic_flows and is_postgres(path) and loop_running():
            self._reopen_at = 0.0
            self._reopening = asyncio.get_running_loop().create_task(self.reopen_if_due())
            return False
        try:
            connected = self._connect(path, _loop())
        except (LedgerError, OSError) as e:
            self._down(e, "open")
            return False
        self._use(connected)
        return True

    def open_to_write_owed(self, path: str) -> bool:
        """Open the ledger at ``path`` at shutdown only to write what the process owes it, as
        the ``close`` that follows does (no instance runs turnguard: a script reload left
        none, or one that refused an option). As for the writes owed at any close, a lock
        held by another connection is waited for: the open (which registers the instance, a
        write) is tried again as each try gives up at the busy timeout, until
        ``CLOSE_WRITES_S`` has passed, and ``close`` then writes within what is left of that
        bound (at least one try's wait: the lock is gone once the open got it). False: it
        could not be opened by then (the fault noted, nothing written)."""
        deadline = time.monotonic() + CLOSE_WRITES_S
        while not self.open(path):
            if self.error is None or not contended(self.error) \
                    or time.monotonic() >= deadline:
                return False
        self._writes_due_by = deadline
        return True

    def switch(self, path: str) -> None:
        """Use the ledger at ``path`` instead of the one in use (an option changed while
        running): the new one is opened first, and the one in use let go only once it is.
        One that cannot be opened for another reason than a lock held elsewhere (a file that
        is no ledger, a newer schema, a read-only file, a server that does not answer) raises
        ``LedgerError`` or ``OSError`` and leaves the one in use as it was; a lock is noted
        and tried again later, as at start-up (``open``)."""
        try:
            connected = self._connect(path, _loop())
        except (LedgerError, OSError) as e:
            if not contended(e):
                raise
            self.open(path)
            return
        self.close()
        self.path = path
        self._use(connected)

    def _reopen_due(self, soon: bool) -> bool:
        """A try to open the ledger is due: ``REOPEN_S`` after the last one, or, ``soon``,
        ``REOPEN_SOON_S`` after it."""
        now = time.monotonic()
        return now >= self._reopen_at or soon and now >= self._opened_last + REOPEN_SOON_S

    async def reopen_if_due(self, *, soon: bool = False) -> None:
        """The ticker: try to open a ledger that could not be opened (or whose file is gone).
        ``soon``: the process owes it rows (``owes_writes_while_down``), or a request would be
        decided without it: tried ``REOPEN_SOON_S`` after the last try, not ``REOPEN_S``, so
        that the fault's end (a file that is no ledger taken away) is met at once. Until its
        attempts dispatched from memory are registered, another process takes their retries
        for new turns and runs them again."""
        if self._store is not None or not self.path or self._retired \
                or not self._reopen_due(soon):
            return
        self._opened_last = time.monotonic()
        self._reopen_at = self._opened_last + REOPEN_S
        loop = asyncio.get_running_loop()
        self._reopen_under_way = under_way = loop.create_future()
        try:
            connected = await loop.run_in_executor(None, self._connect, self.path, loop)
        except (LedgerError, OSError) as e:
            self._down(e, "open")
            if contended(e):  # locked: the next tick tries again (each try waits for it)
                self._reopen_at = 0.0
            return
        finally:
            under_way.set_result(None)
            self._reopen_under_way = None
        if self._store is not None or self._retired:
            # opened meanwhile (a change of option), or this store was closed for good (a
            # script reload while the try was under way: the instance loaded opens its own)
            connected.close()
            return
        self._use(connected)

    def _connect(self, path: str, loop: asyncio.AbstractEventLoop) -> _Opened:
        """Open the ledger and start the heartbeat on its own connection (blocking; raises
        ``LedgerError`` or ``OSError``); the heartbeat (and the listener) report to ``loop``."""
        postgres = is_postgres(path)
        if postgres:  # imported only when used: psycopg costs start-up time
            from .pg_ledger import AttemptEndListener, PgLedger, PgLedgerAdmin

        def ledger(admin: bool):
            cls = ((PgLedgerAdmin if admin else PgLedger) if postgres
                   else (LedgerAdmin if admin else Ledger))
            # SQLite's checkpoints are the heartbeat thread's: no commit on the event loop
            # copies the WAL
            extra = {} if postgres else {"checkpoint_on_commit": not admin}
            return cls(path, self._instance_id, busy_timeout_ms=LEDGER_BUSY_MS,
                       identity=self._identity, **extra)

        # the admin queries too: the control commands and turnguard.status's circuits use this
        # connection (its count of operations opens one of its own: ``counts_apart``); a
        # ledger across a network never runs a call on the event loop
        runner = LedgerRunner(ledger(admin=True), fast_path=not postgres)
        store = LedgerStore(runner)
        heartbeat = listener = None
        try:
            runner.call_sync(lambda led: led.open(time.time()))
            heartbeat = Heartbeat(
                ledger(admin=False), interval_s=HEARTBEAT_S,
                on_reregistered=lambda n: loop.call_soon_threadsafe(self._reregistered, n),
                on_file_gone=lambda why: loop.call_soon_threadsafe(self._heartbeat_found_gone,
                                                                   store, why),
            )
            heartbeat.start(time.time())
            if postgres:
                listener = AttemptEndListener(
                    path, on_end=_to_loop(loop, self._attempt_ended),
                    on_live=_to_loop(loop, self._notifications_live))
                listener.start()
        except BaseException:
            if heartbeat is not None:
                heartbeat.stop()
            runner.close()
            raise
        return _Opened(store, heartbeat, listener)

    def _use(self, opened: _Opened) -> None:
        self._store, self._heartbeat, self._listener = opened.store, opened.heartbeat, opened.listener
        logger.info("turnguard: ledger %s (instance %s)", self.location, self._instance_id)
        generation = opened.store.generation
        self._stale_attempts_due = False
        left = self.memory.ledger_generation
        if self.memory.ledger_opened(generation, time.time()):
            self._moved_from = left
            # an older copy put in the old one's place may show attempts of this instance in
            # flight that it ended since: they are ended there before the file decides
            self._stale_attempts_due = True
            logger.warning("turnguard: ledger %s is another file now; what this process learned "
                           "from the old one (recordings, spent once-claims, cooling circuits) "
                           "still decides", self.location)
        # attempts of another file (this instance, or the one before a script reload, ran
        # them there) are registered in this one first; after a fault, it stays noted until a
        # try applies what is owed (recover)
        self._adoption_due = (self._attempts_elsewhere(generation) or self._stale_attempts_due
                              or bool(self._moved_from))
        if self._peers and self._peers_behind and generation != self._left:
            # the file at the path could not be opened at first (no ledger there): the peers
            # open this one at their next try, up to ``REOPEN_S`` after this process
            self._peers_behind = False
            self._peers_until = time.monotonic() + self._peers_wait_s() + REOPEN_S

    def close(self, *, write_owed: bool = True, final: bool = False) -> None:
        """Close the ledger. Writes still owed (an attempt's end kept while the ledger was
        locked or full) are tried first (``write_owed``; not into a file found deleted or
        replaced), at most ``CLOSE_WRITES_S`` in all: a process that stops (SIGTERM) or is
        reloaded must not leave a completed turn to be reaped as partial and run again; what
        still cannot be written is logged. ``final``: the addon instance is unloaded (a
        script reload, or shutdown): no ledger is opened for this store again; a call of a
        request it was still deciding (one whose catch-up spans the close) is answered
        ``UNREAD``: that request's ``on_retired`` is called (the instance a reload loaded
        takes it, with its ledger), else it is decided from memory, as in an outage."""
        if final:
            self._retired = True
        if self._store is not None and loop_running():  # (unit tests close outside a loop)
            self.write_counts()
        if write_owed and self._store is not None and (self._kept or self._sent):
            deadline = time.monotonic() + CLOSE_WRITES_S
            if self._writes_due_by is not None:  # (opened for them: what is left of that)
                deadline = max(self._writes_due_by, time.monotonic() + LEDGER_BUSY_MS / 1000)
            self._write_owed(deadline)
        self._writes_due_by = None
        if self._listener is not None:
            self._listener.stop()
            self._listener = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._store is not None:
            self._store.close()
            self._claims_in_doubt += [(attempt_id, op_key, self._store.generation)
                                      for attempt_id, op_key in self._store.claims_in_doubt_left()]
            self._store = None

    def _write_owed(self, deadline: float) -> None:
        """The writes sent and not yet known written, then the kept ones, written by
        ``deadline`` if the ledger lets them (a lock is waited for until then)."""
        store = self._store
        store.settle(deadline - time.monotonic())
        failed = [entry for future, entry in self._sent.items()
                  if not future.done() or future.cancelled() or future.exception()]
        self._sent.clear()  # (their callbacks, should the loop run them, find them gone)
        self._kept.extendleft(reversed(failed))  # sent before any kept since
        self._kept_bytes += sum(_recording_bytes(k.write) for k in failed)
        owed, written, error = len(self._kept), 0, "no time left"
        while self._kept and time.monotonic() < deadline:
            kept = self._kept[0]
            write = kept.for_ledger(store.generation)
            if write is not None:
                try:
                    store.write_sync(self._as_sent(write, store.generation),
                                     timeout=max(0.0, deadline - time.monotonic()),
                                     once=kept.once)
                except TimeoutError:
                    break
                except LedgerError as e:  # locked: the busy timeout waited; try until the end
                    error = str(e)
                    if contended(e):
                        continue
                    break
                written += 1
            self._pop_kept()
        if self._kept:
            logger.warning("turnguard: closing with %d ledger writes owed (%s); a process that "
                           "reaps this one's attempts takes them as unfinished",
                           len(self._kept), error)
        elif owed:
            logger.info("turnguard: closing: the %d ledger writes owed were written", written)

    def _attempt_ended(self, op_key: str, attempt_id: int, state: str) -> None:
        """A process sharing the ledger ended an attempt (notified, on the event loop)."""
        if state == "completed":  # (with a recording: one without is completed_unrecorded)
            self.memory.knowledge.completed_elsewhere(op_key, time.time())
        else:
            self.memory.knowledge.ended(op_key)
        if self._on_attempt_ended is not None:
            self._on_attempt_ended(op_key, attempt_id, state)

    def _notifications_live(self, live: bool) -> None:
        if self._listener is None:
            return
        if live:
            if self._notifications_lost:  # ends notified while it was not listening are lost
                self._notifications_lost = False
                self.recheck_foreign = True
                logger.warning("turnguard: attempt-end notifications from %s resumed",
                               self.location)
        else:
            self._notifications_lost = True
            logger.warning("turnguard: attempt-end notifications from %s lost; polling other "
                           "processes' attempts until they resume", self.location)

    def _file_gone(self, why: str) -> None:
        """The ledger file was found deleted or replaced (by the heartbeat, a request's call
        or a write): an outage, never an empty ledger. A task opens the file now at the path
        at once and registers this process's attempts in flight in it before anything is
        decided from it. The peers that had attempts in flight in the old file (read from it
        now) are awaited to do the same (``_peers_registering``)."""
        if self._store is None:
            return
        self._await_peers_of(self._store)
        self.close(write_owed=False)
        self._down(LedgerError(why), "file_check")
        self._reopen_at = 0.0  # open the new file at once
        if loop_running() and (self._reopening is None or self._reopening.done()):
            # not at the maintenance's next ticks: other processes hold their new turns until
            # this one's attempts in flight are registered there (``_peers_registering``)
            self._reopening = asyncio.get_running_loop().create_task(
                self._reopen_and_catch_up())

    def _heartbeat_found_gone(self, store: Store, why: str) -> None:
        """The heartbeat of ``store`` found its file deleted or replaced: the outage begins
        (``_file_gone``), unless ``store`` is no longer the one in use. A report made before
        its heartbeat stopped can come after this process left that file (the outage began
        from a request's call, or from the heartbeat's report before it): the file now at
        the path is the new one in use, and closing it would begin an outage for nothing,
        cutting short what the move to it was doing."""
        if store is self._store:
            self._file_gone(why)

    async def _reopen_and_catch_up(self) -> None:
        """Open the file now at the path and register this process's attempts in flight in
        it (``recover``); a fault is noted, and the maintenance tries again."""
        try:
            await self.reopen_if_due()
            if self._store is not None and not self.usable:
                await self.recover(None)
        except Exception:
            logger.exception("turnguard: opening the ledger file now at %s failed",
                             self.location)

    def _await_peers_of(self, store: Store) -> None:
        """Read from ``store``, the file being left, which live peers have attempts in flight
        there (and of which operations), or recordings that may still be replayed. Until each
        has noted that it registered them in the new file (its attempts in flight, and its
        own recordings: ``_record_own_recordings``), or ``PEERS_REGISTERING_S`` passed
        (counted again from when the new file opens, if it could not be opened at once: see
        ``_use``), the new file cannot say that an operation is in flight nowhere, nor that
        it never completed: a request it knows nothing of waits
        (``policy.PEERS_REGISTERING``), and so does one that memory would dispatch meanwhile
        (no file open yet to decide it: ``_peers_awaited``). The operations in flight are
        noted in flight elsewhere in memory: while no file at the path can be opened (another
        file that is no ledger put in its place), a request of one of them decided in memory
        is held, never dispatched blind. When the old file cannot say, every request waits
        that long. Every peer not proven gone is waited for: how long a peer's heartbeat has
        been silent is no proof here (only its wall clock against this one's, which step and
        differ between hosts: a live peer's heartbeat an hour old by a clock an hour ahead);
        a dead one costs that wait once."""
        now = time.time()
        try:
            rows, ops = store.attempts_in_flight_elsewhere_sync(timeout=PEERS_READ_S)
        except (LedgerError, TimeoutError) as e:
            logger.warning("turnguard: cannot read which processes had turns in the ledger "
                           "file left (%s); new turns wait up to %.0f s for them",
                           str(e) or f"not read within {PEERS_READ_S:g} s",
                           self._peers_wait_s())
            rows, ops = None, []
        if rows is None:
            peers = {UNREAD_PEERS}  # nobody notes that name: waited for the whole time
        else:
            peers = {peer.instance_id for peer in rows if liveness.verdict(
                peer, me=self._identity, now=now, lease_s=3 * HEARTBEAT_S, silent_s=0.0,
                start_ticks_of=liveness.probe_start_ticks) == "alive"}
        for instance_id, op_key, ended_at in ops:
            if ended_at is None and instance_id in peers:
                self.memory.knowledge.in_flight_elsewhere(op_key, None)
                self._awaited.in_flight.setdefault(op_key, set()).add(instance_id)
            elif instance_id in peers:
                self._awaited.recorded.add(op_key)
        # added to what earlier files left showed (not in place of it): a file left a moment
        # after another (a junk file opened through the old one's WAL, then deleted) may show
        # less, and a peer notes only the file it last used as the one it moved from
        live = {peer.instance_id: peer for peer in rows or ()
                if peer.instance_id in peers and liveness.proven_alive(
                    peer, me=self._identity, start_ticks_of=liveness.probe_start_ticks)}
        self._live_peers.update(live)
        for instance_id in live:
            self._live_peer_left.setdefault(instance_id, set()).add(store.generation)
        # (a recording too: a retry of a turn that completed there is held, not run again,
        # until its owner, paused say, records it in the new file; an attempt in flight says
        # more than a recording of the same operation, its turn before: a conversation's
        # next turn, sent with the same body, runs while the turn before is recorded)
        left: dict[str, tuple[str, float | None]] = {}
        for instance_id, op_key, ended_at in ops:
            if instance_id in live and (ended_at is None or op_key not in left):
                left[op_key] = (instance_id, ended_at)
        self._live_peer_ops.update(left)
        self._left, self._peers = store.generation, peers
        self._peers_until = time.monotonic() + self._peers_wait_s() if peers else 0.0
        self._peers_behind = False

    def _peers_wait_s(self) -> float:
        """How long peers that had attempts in flight in the ledger left are waited for to
        register them in the new one: ``PEERS_REGISTERING_S``; on PostgreSQL a
        ``HEARTBEAT_S`` more, since a peer finds its database made again (another generation)
        at its next heartbeat or its next decision, not within a second of a file check."""
        return PEERS_REGISTERING_S + (HEARTBEAT_S if is_postgres(self.path) else 0.0)

    async def _peers_registering(self, store: Store, deadline: float | None,
                                 hold_until: float | None = None, op_key: str = "",
                                 window_s: float | None = None) -> bool:
        """Peers that had attempts in flight in the ledger file this process left have not
        all registered them in ``store`` yet (within ``PEERS_REGISTERING_S``): an operation
        this file knows nothing of may be in flight in one of them. A request that could be
        held only until ``hold_until`` (monotonic), or less than ``PEERS_HOLD_MARGIN_S`` more,
        is decided without them.

        Past that wait, a request of an operation ``op_key`` that the file left showed in
        flight in a peer proven alive (``liveness.proven_alive``: a process paused, say), or
        ended there with a recording that may still be replayed, is still held while that
        peer lives and has not registered its attempts and recordings (its hold bound ends
        it, as a duplicate's of a turn in flight elsewhere): that turn is running, or ran,
        and deciding without it would run it a second time. One that ended is held only for a
        request its recording could answer: within ``window_s`` (the request's replay window;
        None: never replayed, as the same body of a Responses conversation's next turn) of
        its end. Other requests are decided without the peers."""
        peer, ended_at = self._live_peer_ops.get(op_key, (None, None))
        if ended_at is not None and (window_s is None or time.time() - ended_at > window_s):
            peer = None  # its recording is no answer to this request: the new file decides
        if peer is None and hold_until is not None \
                and time.monotonic() >= hold_until - PEERS_HOLD_MARGIN_S:
            return False
        if time.monotonic() < self._peers_until and store.generation != self._left:
            self._peers -= await store.moved_peers(self._left, deadline=deadline)
            if self._peers and time.monotonic() < self._peers_until:
                return True
        if self._peers:
            logger.warning("turnguard: %d process(es) with turns in the ledger file left did "
                           "not register them in the new one within %.0f s; deciding without "
                           "them (but for the turns in flight of those proven alive)",
                           len(self._peers), self._peers_wait_s())
        self._peers = set()
        # (asked of a request held for the peers only)
        self._awaited.in_flight, self._awaited.recorded = {}, set()
        if peer is None or store.generation == self._left:
            return False
        row = self._live_peers.get(peer)
        moved = False
        for generation in sorted(self._live_peer_left.get(peer, ())):
            if peer in await store.moved_peers(generation, deadline=deadline):
                moved = True
                break
        if moved or row is None or not liveness.proven_alive(
                row, me=self._identity, start_ticks_of=liveness.probe_start_ticks):
            self._awaited.forget(peer)  # registered (the new file decides), or gone
            return False
        return True

    async def _held_for_peers(self, ident: Identity, store: Store | None) -> policy.Hold:
        """A request of ``ident`` held for the peers to register their turns
        (``PEERS_REGISTERING``), saying whether a turn of its operation ended, recorded,
        before it came, and none runs now (``turn_ended``): a request that comes after that
        turn is no duplicate of it (a Responses conversation's next turn, sent with the same
        body, is to run), while one that comes as a turn runs is (answered from it, never run
        again as the next turn). Ended: a file left showed it recorded in a peer (proven
        alive or not), this process has its recording (its own, or one it read) within the
        replay window, or the new file (``store``, when it is not the file left) shows it
        completed. Running: a file left showed an attempt of it in flight in a peer that has
        not registered its attempts in the new file yet (another host's too), or the new file
        shows one in flight (claimed there since, or registered by its owner). A file left
        that could not be read, or a new file that cannot be read now, says it may run.
        Asked of a conversation's request alone (without an ``Idempotency-Key``): it decides
        nothing for the others (``policy.admission_replay``), which read nothing for it."""
        if not ident.conversation or ident.idempotency_key is not None:
            return policy.Hold(None, None, policy.PEERS_REGISTERING)
        op_key = ident.op_key
        peer, ended_at = self._live_peer_ops.get(op_key, (None, None))
        awaited = self._peers or {peer}  # (past the wait: held for that live peer alone)
        if UNREAD_PEERS in self._peers or self._awaited.in_flight.get(op_key, set()) & awaited \
                or (peer is not None and ended_at is None and peer in awaited):
            return policy.Hold(None, None, policy.PEERS_REGISTERING)
        ended = ended_at is not None or op_key in self._awaited.recorded \
            or self.memory.recording(ident, now=time.time(),
                                     window_s=self.replay_window_of(ident)) is not None
        if store is not None and store.generation != self._left:
            try:
                now_there = await store.read_apart(lambda led: led.snapshot(op_key))
            except Exception as e:  # (LedgerError, a timeout: it may run)
                logger.debug("turnguard: operation not read in the new ledger file (%s)", e)
                return policy.Hold(None, None, policy.PEERS_REGISTERING)
            if now_there is not None and now_there.state == "in_flight":
                return policy.Hold(None, None, policy.PEERS_REGISTERING)
            ended = ended or (now_there is not None and now_there.state == "completed")
        return policy.Hold(None, None, policy.PEERS_REGISTERING, turn_ended=ended)

    def _peers_awaited(self, hold_until: float | None) -> bool:
        """Peers that had turns in the ledger file this process left are still awaited to
        register them in the new one (``_peers_registering``'s wait, not yet over, or not yet
        begun: ``_new_file_opening``), and a request held until ``hold_until`` (monotonic)
        has ``PEERS_HOLD_MARGIN_S`` left."""
        now = time.monotonic()
        return bool(self._peers) \
            and (now < self._peers_until or self._new_file_opening()) \
            and (hold_until is None or now < hold_until - PEERS_HOLD_MARGIN_S)

    def _new_file_opening(self) -> bool:
        """The file left could not be replaced by a new one at once (``_peers_behind``: the
        peers' wait is counted again from when one opens, ``_use``), and a try to open the
        file now at the path is under way, or the last one met another connection's lock
        there (a ledger is there). A request that gave up waiting for that open (late on a
        busy machine, or behind the lock) while the first count of the wait ran out meanwhile
        (a file that is no ledger stayed longer than it) would otherwise be decided by
        memory, blind to the turns the peers are moving into that file, and run again one
        that completed."""
        if not self._peers_behind:
            return False
        opening = any(f is not None and not f.done()
                      for f in (self._reopening, self._reopen_under_way))
        return opening or self.error is not None and contended(self.error)

    def _reregistered(self, incarnation: int) -> None:
        self._emit("instance_reregistered", instance=self._instance_id,
                   incarnation=incarnation,
                   attempts_in_flight=sum(1 for _ in self._attempts()))
        logger.warning("turnguard: this process was taken for dead by another one sharing the "
                       "ledger and registered again (incarnation %d)", incarnation)
        self._on_reregistered(incarnation)

    # -- faults --------------------------------------------------------------------------------
    def _down(self, error: Exception, during: str) -> None:
        """Note that the ledger failed (said once per outage): decisions are made in memory
        until a try (the next request's, or the ticker's) finds it working again."""
        if during == "open" and self._peers:
            self._peers_behind = True
        if isinstance(error, LedgerTimeout) and self.error is not None \
                and contended(self.error):
            # it waited behind a call that waits for another connection's lock (a request's
            # claim, a probe), or was not run for it: still that lock, which keeps the ledger
            # from being written, not read (``_only_locked``)
            return
        if self.error is None:
            # WARNING, not ERROR: mitmdump exits on an error logged during start-up, and a
            # broken ledger must not stop the proxy.
            logger.warning("turnguard: ledger %s unusable (%s): %s; coalescing in memory until "
                           "it recovers", self.location, during, error)
            self._emit("ledger_unavailable", during=during, error=str(error))
        self.error = self._last_fault = str(error)
        self._faults += 1

    def _fault_since(self, faults: int) -> str | None:
        """The fault that keeps the ledger from being used now; else, when one was noted
        since ``faults`` (``self._faults`` then) and has ended, that one; else None. A request
        whose call came back unread as the outage ended (the lock went, and another
        request's probe wrote the ledger meanwhile) is decided as in that outage: what the
        others wrote is read apart first, or memory would decide it blind."""
        if self.error is not None:
            return self.error
        return self._last_fault if self._faults != faults else None

    def _up(self) -> None:
        if self.error is not None:
            logger.warning("turnguard: ledger %s usable again", self.location)
            self._emit("ledger_recovered", error_was=self.error)
            self._answering_since = time.monotonic()
        self.error = None

    async def _record_own_recordings(self, store: Store, deadline: float | None) -> None:
        """Record in ``store`` (a new file) the attempts this process completed in the files
        it left (deleted or replaced) whose recordings are still within the replay window,
        each whole, as they ended: so that another process, which waits for this one to
        note that it moved (``mark_moved``), replays such a turn from the new file rather
        than run it again. One whose operation the new file has in flight or completed
        (another attempt that runs, an end owed and written just before, a copy's or an
        older copy's own) is not recorded (``Ledger.record_offline_attempt``'s ``moving``),
        and stays known as of the file left: what it learned from that file still decides,
        and should the new file go too, it is recorded in the next.
        Newest first, in batches (``MOVE_BATCH``: one transaction each on SQLite, the event
        loop free between them), for ``MOVE_RECORDINGS_S`` at most: the rest (a backlog on a
        distant PostgreSQL server) is left, said in the log; this process still replays those
        from memory. ``recordings_moved`` counts the recordings this call moved, also when a
        batch failed or the call's deadline cut it (the next call moves the rest, and says
        so in its own)."""
        generation = store.generation
        recorded = 0
        until = time.monotonic() + MOVE_RECORDINGS_S
        mine = self.memory.knowledge.own_recordings_outside(generation, now=time.time(),
                                                            window_of=self.replay_window_of)
        mine.reverse()
        left_over = len(mine)
        try:
            for batch in _move_batches(mine):
                if time.monotonic() > until:
                    logger.warning("turnguard: %d of this process's recordings of the ledger "
                                   "file left were not recorded in the new one (%.0f s spent); "
                                   "other processes run those turns again if retried", left_over,
                                   MOVE_RECORDINGS_S)
                    break
                left_over -= len(batch)
                results = await store.write_all([known.moved for known in batch],
                                                deadline=deadline)
                for known, result in zip(batch, results):
                    if result is not None and result.applied:
                        recorded += 1
                        self.memory.knowledge.moved(known.moved.ident.op_key, known, generation)
                await asyncio.sleep(0)  # (the fast path ran it on the event loop: traffic first)
        finally:
            if recorded:
                self._emit("recordings_moved", ledger_generation=generation, recordings=recorded)

    async def recover(self, deadline: float | None) -> bool:
        """Try to bring a ledger that failed (or owes writes) back, one try at a time, within
        ``deadline``. True: it is usable again."""
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                async with self._recovering:
                    if self.usable:
                        return True
                    if self._store is None or not await self._catch_up(deadline):
                        return False
                    self._up()
                    return True
        except TimeoutError:
            return False

    async def _catch_up(self, deadline: float | None) -> bool:
        """Register the attempts in flight it does not know (dispatched while it was down, or
        its file was replaced), then apply the kept writes in order. The first write doubles as
        the probe; with none, a heartbeat is the probe. False: the ledger failed again (noted).

        Each call of a catch-up nobody waits for (no ``deadline``: the maintenance's, a held
        duplicate's poll) on an SQLite ledger gives up on a lock at once (``PROBE_S``): the
        ledger's one connection runs calls in order, and a request's call queued behind it
        (``_only_locked``) must not wait out a lock that may last (a PostgreSQL call may need
        to connect again first)."""
        store = self._store

        def bound() -> float | None:  # a call's
            return deadline if deadline is not None or is_postgres(self.path) \
                else time.monotonic() + PROBE_S

        try:
            for attempt in list(self._attempts()):
                if attempt.generation != store.generation:
                    await self._adopt(store, attempt, bound())
            # (after the adoptions: an attempt that runs on a claim in doubt found its
            # operation in flight under that claim, and is registered without a row)
            self._claims_in_doubt += [(attempt_id, op_key, store.generation) for attempt_id, op_key
                                      in await store.claims_in_doubt(deadline=bound())]
            self._settle_claims_in_doubt()
            if self._stale_attempts_due:
                moved = await store.end_stale_attempts(
                    [a.ident.op_key for a in self._attempts()], now=time.time(),
                    deadline=bound())
                self._stale_attempts_due = False
                if moved:
                    self._emit("stale_attempts_ended", ops=len(moved))
            self._adoption_due = False
            probed, dropped = bool(self._kept), 0
            while self._kept:
                kept = self._kept[0]
                write = kept.for_ledger(store.generation)
                if write is None:
                    self._pop_kept()
                    dropped += 1
                    continue
                result = await store.write(self._as_sent(write, store.generation),
                                           deadline=bound(), once=kept.once)
                self._recorded_whole(write, result, store.generation)
                self._pop_kept()
                if kept.landed is not None:
                    kept.landed(result, True)
            if dropped:
                self._emit("ledger_writes_dropped", writes=dropped,
                           reason="the ledger file they belong to was replaced")
            if self._moved_from:  # after the ends owed: a turn that ended meanwhile is there
                await self._record_own_recordings(store, deadline)
                await store.mark_moved(self._moved_from, now=time.time(), deadline=deadline)
                self._moved_from = ""
            if not probed and await store.heartbeat(time.time(),
                                                    deadline=bound()) == "reregistered":
                self._reregistered(store.incarnation)
            # a dispatch decided in memory while this catch-up waited for the ledger (a
            # request whose own call met the same lock) has no row yet: registered before the
            # ledger is taken for usable, or no other process would see it in flight (one
            # dispatched during these awaits is noted due: the next try registers it)
            for attempt in [a for a in self._attempts() if a.generation != store.generation]:
                await self._adopt(store, attempt, bound())
            self._adoption_due = self._attempts_elsewhere(store.generation)
        except LedgerError as e:
            if self._store is not store:  # closed meanwhile (a reload): no fault to note;
                return False  # what is left is owed still, to the instance loaded next
            self._down(e, "probe")
            return False
        return self._store is store

    async def _adopt(self, store: Store, attempt: AttemptInFlight, deadline: float | None) -> None:
        # the attempts of its operation whose end (or give-back) is owed to this file: ended
        # here (a retry dispatched after one of them failed must not be left without a row)
        ended = tuple(
            kept.write.attempt_id for kept in self._kept
            if isinstance(kept.write, (FinishWrite, GiveBackWrite))
            and kept.generation == store.generation
            and kept.write.op_key == attempt.ident.op_key)
        adopted = await store.adopt_attempt(
            attempt.ident, method=attempt.method, route=attempt.route, kind=attempt.kind,
            flow_id=attempt.flow_id, now=time.time(), circuit_scope=attempt.circuit_scope,
            deadline=deadline, transport=attempt.transport, ended=ended,
        )
        if attempt.attempt_id is not None and attempt.generation == store.generation:
            # its claim answered late meanwhile (``_late_claim``): that claim is its row (the
            # adoption, queued behind it, found the operation in flight)
            if adopted is not None and adopted != attempt.attempt_id:
                self.give_back(policy.Dispatch(attempt.kind, adopted), attempt.ident.op_key,
                               store.generation)
            return
        attempt.attempt_id, attempt.generation = adopted, store.generation
        self._emit("attempt_adopted", op=attempt.ident.op_id, flow=attempt.flow_id,
                   session=attempt.ident.session, transport=attempt.transport,
                   attempt=attempt.attempt_id, ledger_generation=attempt.generation)

    async def _call(self, during: str, call: Callable[[Store], Any], *,
                    deadline: float | None = None, on_late=None, background: bool = False) -> Any:
        """``call(store)`` within ``deadline``: its result, or ``UNREAD`` (noted) when the
        ledger cannot answer. A call still queued at the deadline never runs; one that
        answers after its caller stopped waiting goes to ``on_late(task, generation)``, with
        the generation of the ledger it ran on. A call (of a request: ``deadline``) that fails
        because the ledger file was deleted or replaced begins the outage at once, as the
        heartbeat would (``_file_gone``), and goes again, within its deadline, on the file now
        at the path, once this process's attempts in flight are registered there: deciding
        blind until the heartbeat noticed would dispatch a call no other process can see.

        ``background``: the maintenance's own calls (reaping, purges, garbage collection,
        the circuits' refresh), which no decision waits for. One that meets a lock is tried
        again at the next tick and is no outage: on PostgreSQL a lock holds a table, not the
        database (a ``VACUUM FULL instances`` must not send every decision to memory, where
        processes no longer see each other's turns); a decision that meets a lock notes
        the outage itself. The time it could not answer is no peer's silence (reaping by
        lease waits a whole lease from then)."""
        for _ in range(2):  # bounded: a second go only after the file was found gone
            store = self._store
            answer = await self._call_once(during, call, deadline=deadline, on_late=on_late,
                                           background=background)
            if answer is not UNREAD or deadline is None or not self._found_gone(store):
                return answer
        return UNREAD

    def _found_gone(self, store: Store | None) -> bool:
        """After a call on ``store`` could not be answered: whether its file was deleted or
        replaced (then the outage is begun, ``_file_gone``, or was by another call meanwhile),
        so that the file now at the path is opened at once."""
        if store is None or self._retired:
            return False
        if store is not self._store:
            return self._store is None or self._store.generation != store.generation
        why = store.file_replaced()
        if why is None:
            return False
        self._file_gone(why)
        return True

    def _only_locked(self, deadline: float | None) -> bool:
        """A request's call (``deadline``) goes to the ledger as it is, without a probe first,
        when all that keeps it from being usable is another connection's lock and this
        process owes it nothing (no write kept or under way, no attempt to register): a write
        lock keeps the ledger from being written, not read (SQLite in WAL mode), and an
        admission reads the operation before it takes the lock (``Ledger.admit``), so a
        duplicate of a turn another process has in flight is read there and held instead of
        being dispatched again from this process's memory. The probe (a heartbeat, a write)
        would wait for the lock and say nothing the call does not; the outage ends as before,
        when a probe (the maintenance's) writes again. SQLite only: a PostgreSQL lock that
        fails a call holds a table, which its readers wait for too."""
        return (deadline is not None and self._store is not None and self.error is not None
                and not is_postgres(self.path)
                and contended(self.error) and not self._kept and not self._sent
                and not self._adoption_due and not self._stale_attempts_due
                and not self._moved_from)

    async def _call_once(self, during: str, call: Callable[[Store], Any], *,
                         deadline: float | None = None, on_late=None,
                         background: bool = False) -> Any:
        if self._store is None and self.path and deadline is not None and not self._retired:
            # the file was found gone (or could not be opened a while ago): this request
            # opens the file now at the path rather than deciding blind until the next tick
            # (another process may have registered its attempts there meanwhile); a request
            # that comes while a try to open it is under way (another request's, or the
            # ticker's, which may have begun as the lock that failed the last one went)
            # waits for that one
            opening = {f for f in (self._reopening, self._reopen_under_way)
                       if f is not None and not f.done()}
            # (an SQLite file soon: the request would be decided blind; a PostgreSQL server
            # that does not answer would hold every request for its connect timeout)
            soon = not is_postgres(self.path)
            if not opening and self._reopen_due(soon):
                self._reopening = asyncio.get_running_loop().create_task(
                    self.reopen_if_due(soon=soon))
                opening = {self._reopening}
            if opening:
                await asyncio.wait(opening, timeout=max(0.0, deadline - time.monotonic()))
        if self._store is None or deadline is not None and deadline <= time.monotonic():
            return UNREAD
        store = self._store
        if not self.usable and not self._only_locked(deadline) \
                and not await self.recover(deadline):
            return UNREAD
        if self._store is not store:
            # closed while it caught up (a script reload unloaded this instance, or the file
            # was found gone): ``_call`` goes again on the file now at the path, if any
            return UNREAD
        started = time.monotonic()
        try:
            if deadline is None:
                return await call(self._store)
            generation = self._store.generation
            task = asyncio.ensure_future(call(self._store))
            if task.done():  # answered at once (an eager task on the ledger's fast path)
                return task.result()
            wait_s = max(0.0, deadline - time.monotonic()) + LEDGER_LATE_S
            done, _ = await asyncio.wait([task], timeout=wait_s)
            if not done:
                # the call goes on without its caller: its error (the ledger's thread gives
                # up, or the database fails later) is nobody's, never an unhandled one
                task.add_done_callback(
                    _settle if on_late is None else lambda t: on_late(t, generation))
                raise LedgerTimeout(f"no answer from the ledger within {wait_s:.2f} s ({during})")
            return task.result()
        except LedgerError as e:
            if background and contended(e):
                self._answering_since = time.monotonic()
                logger.debug("turnguard: ledger %s locked (%s): %s; tried again next tick",
                             self.location, during, e)
                return UNREAD
            self._down(e, during)
            return UNREAD
        finally:
            if time.monotonic() - started >= HEARTBEAT_S:
                # the ledger did not answer for that long (a database paused, a network
                # stall; a call waits for it): nobody may have renewed a lease meanwhile
                self._answering_since = time.monotonic()

    # -- decisions -----------------------------------------------------------------------------
    async def admit(self, ident: Identity, **kwargs) -> policy.Admission | policy.ReplayFromMemory:
        """``_admit``, the operation counted as being decided here meanwhile (a claim of it
        in doubt is settled once it is decided: ``_settle_claims_in_doubt``)."""
        deciding = self._deciding
        deciding[ident.op_key] = deciding.get(ident.op_key, 0) + 1
        try:
            return await self._admit(ident, **kwargs)
        finally:
            if deciding[ident.op_key] == 1:
                del deciding[ident.op_key]
            else:
                deciding[ident.op_key] -= 1

    async def _admit(
        self, ident: Identity, *, method: str, route: str, flow_id: str, circuit_scope: str,
        recovery: policy.RecoveryClaim | None, once_mode: bool,
        in_flight_here: Callable[[], bool], guard: policy.GuardPolicy, window_s: float | None,
        threshold: int, deadline: float, transport: str = "http", hold_until: float | None = None,
        on_retired: Callable[[], None] | None = None,
    ) -> policy.Admission | policy.ReplayFromMemory:
        """The ledger's decision for the request (a claim when it dispatches), or, without a
        ledger, the memory's (``in_flight_here()``: this process has an attempt of it in
        flight now, asked after the ledger failed). A replay of a recording this process
        made or read from the ledger is the ledger's decision too, known without reading it
        (``MemoryStore.replay``). ``on_retired``: called before the memory decides when the
        ledger went unread because this store was closed for good meanwhile
        (``_unread_for_good``)."""
        now = time.time()
        # counted before anything here waits (a read apart, the call): a dispatch from memory
        # that comes meanwhile (another request's, decided as this one read apart) is one the
        # claim below may meet
        decided_in_memory = self._decided_in_memory
        faults = self._faults
        if recovery is None:  # a recovery claim reads the session's owner in the ledger
            known = self.memory.replay(ident, now=now, window_s=window_s,
                                       generation=self.generation)
            if known is not None:
                return known
        def carried() -> policy.Admission | policy.ReplayFromMemory | None:
            if not self.memory.carrying:
                return None
            return self.memory.carried(
                ident, circuit_scope=circuit_scope, once_mode=once_mode,
                recovering=recovery is not None, now=now, window_s=window_s,
                generation=self.generation)

        async def decide(store: Store):
            # asked again on the ledger's second go (``_call``): a file found gone just now
            # was opened anew, and what the old one said decides first there too
            known = carried()
            if known is not None:
                return _Carried(known)
            if (self._peers or ident.op_key in self._live_peer_ops) and \
                    await self._peers_registering(store, deadline, hold_until, ident.op_key,
                                                  window_s):
                return _Carried(await self._held_for_peers(ident, store))
            return await store.admit(
                ident, method=method, route=route, now=now, guard=guard, flow_id=flow_id,
                circuit_scope=circuit_scope, recovery=recovery, once_mode=once_mode,
                deadline=deadline, transport=transport)

        known = carried()
        if known is not None:
            return known

        if recovery is None and self.error is not None:  # (down: most often not)
            read = await self._decided_elsewhere_while_down(
                ident, guard=guard, now=now, deadline=deadline, circuit_scope=circuit_scope,
                threshold=threshold, fault=self.error, hold_until=hold_until)
            if read is not None:
                return read

        admission = await self._call(
            "admit", decide, deadline=deadline,
            on_late=lambda task, generation: self._late_claim(task, ident, generation))
        if isinstance(admission, _Carried):
            return admission.decision
        if isinstance(admission, policy.Dispatch) and admission.attempt_id is not None \
                and self._decided_in_memory != decided_in_memory \
                and (in_flight_here() or self.memory.recording(  # (it runs, or ran, here)
                    ident, now=time.time(), window_s=window_s) is not None):
            # The claim waited for the ledger (queued behind a call that met a lock, say)
            # while this process dispatched the operation from memory: the ledger, which has
            # no row of that attempt yet, claimed it again. Not run twice here: the claim
            # becomes that attempt's row, or is given back (its end owed is recorded on
            # it), and the request is decided as memory decides it (held, or replayed).
            self._claim_not_run(admission.attempt_id, ident.op_key, self.generation,
                                "a claim made while it ran from memory")
            admission = UNREAD
        if isinstance(admission, Unread):
            self._unread_for_good(on_retired)
            fault = self._fault_since(faults)
            if recovery is None and fault is not None:
                # the ledger went down while the call waited (queued behind claims that met
                # a lock this process did not know of yet, say), and may be up again by now:
                # what the others wrote is read before memory, blind to it, decides (a few
                # ms; the read's own bound)
                read = await self._decided_elsewhere_while_down(
                    ident, guard=guard, now=now,
                    deadline=max(deadline, time.monotonic() + self._read_apart_s()),
                    circuit_scope=circuit_scope, threshold=threshold, fault=fault,
                    hold_until=hold_until)
                if read is not None:
                    return read
            decision = self.memory.admit(
                ident, circuit_scope=circuit_scope, recovering=recovery is not None,
                once_mode=once_mode, in_flight_here=in_flight_here(), now=now, window_s=window_s,
            )
            if (isinstance(decision, policy.Dispatch) or recovery is None
                    and isinstance(decision, policy.Denied)
                    and decision.reason == "ledger_unavailable") \
                    and self._peers_awaited(hold_until):
                # the new file would hold it too (``decide``): a peer may have it in flight,
                # or its recording, which this memory never saw (an open slower than the
                # request's wait for the ledger, or kept from the folder by another lock), or
                # saw end without its bytes (another process's end, notified): failed closed,
                # a turn the peer records in the new file as it moves there got a 503
                return await self._held_for_peers(ident, None)
            self._decided_in_memory += 1
            return decision
        self.memory.learn(ident, admission, me=self._instance_id, circuit_scope=circuit_scope,
                          now=now, threshold=threshold)
        return admission

    async def _read_apart_while_down(self, read: Callable[[Any], Any],
                                     deadline: float | None, fault: str | None,
                                     hold_until: float | None = None) -> Any:
        """``read(ledger)`` on a ledger that is down, on a read-only connection of its own
        (``Store.read_apart``): what keeps a ledger from being written often leaves it
        readable (another connection's lock against writes: SQLite's write lock, a
        PostgreSQL ``LOCK TABLE ... EXCLUSIVE``; a full disk; read-only files; a PostgreSQL
        server that refuses writes: a standby), and this
        connection's calls queue behind claims that wait for a lock, one after another (up
        to a request's 0.5 s step each), and behind the writes this process owes it; a claim
        that cannot be written fails, and its read with it. What such a read is used for is
        what other processes wrote. ``UNREAD`` when the ledger is not so (a file deleted or
        replaced, another database, is never read: ``read_apart`` refuses another than the
        one in use), or the read did not answer within ``_read_apart_s()`` (the
        request's call then goes as before). Not for an outage that says nothing of that
        (a ledger that did not answer in time on a busy machine, a file that cannot be
        opened), unless the connection has been in one call for ``STUCK_CALL_S`` (a lock this
        process had not met yet: the calls behind it came back unread); nor beyond
        ``READS_APART_MAX`` at a time (on SQLite, a request's admission past them waits for a
        slot: ``_read_apart_slot``). ``fault``: the outage's error (``_fault_since``; None:
        no outage, never read).

        ``hold_until`` (a request's admission: its hold deadline, ``policy.hold_deadline``):
        on a SQLite ledger, a read under way past its bound is waited for until it answers,
        or until then (None: not waited for). Such a read waits for nothing but the machine
        (a lock at most ``READ_APART_BUSY_MS``): it is late because its thread got no CPU
        (a machine whose CPU other work takes), and what it would say decides whether the
        request runs at all; dropped, memory decided the request blind and ran a retry of
        another process's turn a second time. The request would be held that long anyway
        had the read found the turn in flight elsewhere. Not on PostgreSQL: a read late
        there may be a server that does not answer (paused, cut off), which says nothing
        more later.

        With no ledger open (the open met another connection's lock, or a full disk: an
        open writes), the ledger at the path now is read so (``_read_at_path``), for such a
        fault alone: what the processes that have it open wrote (``ledger.generation``, in
        ``read``, says which file or database it was)."""
        if deadline is None or fault is None or not self._readable_apart(fault):
            return UNREAD
        if self._reading_apart >= READS_APART_MAX and not (
                await self._read_apart_slot(hold_until) and self._readable_apart(fault)):
            return UNREAD
        store = self._store
        self._reading_apart += 1
        task = asyncio.ensure_future(
            store.read_apart(read) if store is not None else self._read_at_path(read))
        task.add_done_callback(self._read_apart_done)
        bound = min(deadline, time.monotonic() + self._read_apart_s())
        await asyncio.wait([task], timeout=max(0.0, bound - time.monotonic()))
        if not task.done() and hold_until is not None and hold_until > time.monotonic() \
                and not is_postgres(self.path):
            logger.debug("turnguard: a read of ledger %s apart is late (past %.2f s): "
                         "waited for", self.location, self._read_apart_s())
            await asyncio.wait([task], timeout=max(0.0, hold_until - time.monotonic()))
        if not task.done():
            task.add_done_callback(_settle)
            return UNREAD
        try:
            return task.result()
        except LedgerError:
            return UNREAD

    async def _read_at_path(self, read: Callable[[Any], Any]) -> Any:
        """``read(ledger)`` on a read-only connection of its own to the ledger at the path
        (``Ledger.read_at``, ``PgLedger.read_at``), on a thread."""
        if is_postgres(self.path):
            from .pg_ledger import PgLedger
            return await asyncio.to_thread(PgLedger.read_at, self.path, self._instance_id,
                                           read, identity=self._identity)
        return await asyncio.to_thread(Ledger.read_at, self.path, self._instance_id, read,
                                       identity=self._identity)

    def _read_apart_s(self) -> float:
        """How long a request waits for its read apart: ``READ_APART_WHILE_DOWN_S``, on
        PostgreSQL ``READ_APART_WHILE_DOWN_PG_S`` (a read may connect first)."""
        return READ_APART_WHILE_DOWN_PG_S if is_postgres(self.path) else READ_APART_WHILE_DOWN_S

    async def _recording_apart(self, attempt_id: int, op_key: str, deadline: float | None,
                               fault: str | None, *, generation: str | None = None,
                               hold_until: float | None = None) -> Recording | None | Unread:
        """``attempt_id``'s recording of ``op_key``, read apart (``_read_apart_while_down``);
        ``UNREAD`` too when read in a file or database other than ``generation`` (None: any)."""
        read = await self._read_apart_while_down(
            lambda led: (led.generation, led.recording(attempt_id, op_key)), deadline, fault,
            hold_until)
        if isinstance(read, Unread) or generation is not None and read[0] != generation:
            return UNREAD
        return read[1]

    def _read_apart_done(self, _task: asyncio.Future) -> None:
        self._reading_apart -= 1
        ended, self._read_apart_ended = self._read_apart_ended, asyncio.Event()
        ended.set()

    def _readable_apart(self, fault: str) -> bool:
        """The ledger is one a read apart may read in ``fault`` (``_read_apart_while_down``)."""
        store = self._store
        readable = writes_refused(fault) or contended(fault)
        if store is not None:
            return readable or store.in_one_call_for() >= STUCK_CALL_S
        return readable and bool(self.path) and not self._retired

    async def _read_apart_slot(self, hold_until: float | None) -> bool:
        """Whether a read apart may start now that ``READS_APART_MAX`` are under way: on a
        SQLite ledger, a request's admission (``hold_until``: its hold deadline) waits until
        one of them ends (True), or until then (False); elsewhere False at once. A read late
        on a busy machine keeps its slot until it answers, long past its 0.15 s: the requests
        that came together past the first ``READS_APART_MAX`` were decided blind in memory,
        and each ran a retry of another process's turn a second time. Not on PostgreSQL,
        whose reads late may be a server that does not answer."""
        if hold_until is None or is_postgres(self.path):
            return False
        while self._reading_apart >= READS_APART_MAX:  # (each turn waits for one to end)
            left = hold_until - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._read_apart_ended.wait(), left)
            except asyncio.TimeoutError:
                pass
        return True

    async def _decided_elsewhere_while_down(
        self, ident: Identity, *, guard: policy.GuardPolicy, now: float, deadline: float,
        circuit_scope: str, threshold: int, fault: str, hold_until: float | None = None,
    ) -> policy.Hold | policy.Replay | None:
        """What the ledger decides for the request without a claim, read while it cannot be
        written (``_read_apart_while_down``), and learned in memory: a hold on another
        process's attempt in flight, or a replay of its recording; None otherwise. Only
        another process's attempt counts: what the ledger says of this process's own may be
        changed by the writes owed. A replay's recording is read with it (then known in
        memory, where ``recording`` finds it: read later on the ledger's own connection, it
        would wait behind the calls queued there), of the same file or database."""
        generation = self.generation
        read = await self._read_apart_while_down(
            lambda led: (led.generation, led.snapshot(ident.op_key)), deadline, fault,
            hold_until)
        if isinstance(read, Unread):
            return None
        read_generation, seen = read
        if seen is None or seen.owner_instance in (None, self._instance_id):
            return None
        decision = policy.admit(seen, fingerprint=ident.fingerprint,
                                has_idempotency_key=ident.idempotency_key is not None, now=now,
                                policy=guard)
        if isinstance(decision, policy.Replay):
            found = await self._recording_apart(decision.attempt_id, ident.op_key, deadline,
                                                fault, generation=read_generation,
                                                hold_until=hold_until)
            if isinstance(found, Unread) or found is None or generation != self.generation:
                return None
            # (no ledger open: of the file or database read, which this process opens next)
            self.memory.recording_read(ident, found, attempt_id=decision.attempt_id,
                                       generation=generation or read_generation)
        if not isinstance(decision, (policy.Hold, policy.Replay)):
            return None
        self.memory.learn(ident, decision, me=self._instance_id, circuit_scope=circuit_scope,
                          now=now, threshold=threshold)
        return decision

    def give_back(self, dispatch: policy.Dispatch, op_key: str,
                  generation: str | None = None) -> None:
        """A claim whose request will not go upstream after all (its client left while it
        was decided; its answer came too late): ended at once (``rejected``), so that a retry
        may run it. ``generation``: the ledger file it was made in (None: the one in use)."""
        if dispatch.attempt_id is not None:
            self.write(self.generation if generation is None else generation,
                       GiveBackWrite(dispatch.attempt_id, op_key, time.time()))

    def _late_claim(self, task: asyncio.Future, ident: Identity, generation: str) -> None:
        """A claim that answered after its request stopped waiting for it (the request was
        decided in memory meanwhile). When this process runs the operation now without a
        ledger row (dispatched from memory), the claim becomes that attempt's row: the ledger
        must show it in flight while it runs, or another process would run it again.
        Otherwise it is ended at once (``rejected``: it never went upstream), or it would
        stay in flight for no one."""
        if task.cancelled() or task.exception() is not None:
            return
        claim = task.result()
        if isinstance(claim, policy.Dispatch) and claim.attempt_id is not None:
            self._claim_not_run(claim.attempt_id, ident.op_key, generation,
                                "its claim answered late")

    def _settle_claims_in_doubt(self) -> None:
        """The claims in doubt that landed (``Store.claims_in_doubt``), each the row of the
        attempt this process runs of its operation, or given back (``_claim_not_run``);
        but not while a request of the operation is being decided here: the request whose
        claim it was may be about to dispatch from memory (a read apart under way, say), and
        the claim given back first would let a duplicate held elsewhere run it too. Those
        are settled by a later catch-up (the ledger is not usable meanwhile)."""
        later = []
        for attempt_id, op_key, generation in self._claims_in_doubt:
            if op_key in self._deciding:
                later.append((attempt_id, op_key, generation))
            else:
                self._claim_not_run(attempt_id, op_key, generation,
                                    "its claim's commit was in doubt")
        self._claims_in_doubt[:] = later

    def _claim_not_run(self, attempt_id: int, op_key: str, generation: str,
                       reason: str) -> None:
        """A claim (``attempt_id`` of ``op_key``) of the ledger file of ``generation`` whose
        request does not go upstream: the row of this process's attempt of the operation
        that runs without one (dispatched from memory; said with ``reason``), else ended
        (``rejected``), after the ends owed to that file: an attempt of the operation that
        ran here without a row and ended has its end recorded on the claim first."""
        running = next((a for a in self._attempts()
                        if a.attempt_id is None and a.ident.op_key == op_key), None)
        if running is not None:
            running.attempt_id, running.generation = attempt_id, generation
            self._emit("attempt_adopted", op=running.ident.op_id, flow=running.flow_id,
                       session=running.ident.session, transport=running.transport,
                       attempt=attempt_id, ledger_generation=generation, reason=reason)
            return
        self.write(generation, GiveBackWrite(attempt_id, op_key, time.time()))

    async def recording(
        self, ident: Identity, attempt_id: int | None, *, window_s: float | None,
        deadline: float, on_retired: Callable[[], None] | None = None,
    ) -> tuple[Recording | None, bool]:
        """The recording to replay: the one in memory, else ``attempt_id``'s in the ledger.
        (recording or None, readable): not readable when the ledger could not be read
        (``on_retired`` first, when that is because this store was closed for good
        meanwhile: ``_unread_for_good``). While the ledger is down, or once it went down
        while the call waited, the recording is read apart (``_read_apart_while_down``):
        never queued behind claims that wait for a lock, nor failed by a full disk; a
        completed turn whose bytes cannot be read is answered 503, never run again."""
        recording = self.memory.recording(ident, now=time.time(), window_s=window_s)
        if recording is not None or attempt_id is None:
            return recording, True
        generation, faults = self.generation, self._faults
        # (read apart, only a recording found counts: no recording may be this process's
        # own end, owed to the ledger and not written yet)
        found = await self._recording_apart(attempt_id, ident.op_key, deadline, self.error) \
            if self.error is not None else None
        if found is None or isinstance(found, Unread):
            found = await self._call("replay", lambda store: store.recording(
                attempt_id, ident.op_key, deadline=deadline), deadline=deadline)
        if isinstance(found, Unread):
            self._unread_for_good(on_retired)
            fault = self._fault_since(faults)
            if fault is not None:
                found = await self._recording_apart(
                    attempt_id, ident.op_key,
                    max(deadline, time.monotonic() + self._read_apart_s()), fault)
            if found is None or isinstance(found, Unread):
                return None, False
        if found is not None and generation == self.generation:  # (no other file meanwhile)
            self.memory.recording_read(ident, found, attempt_id=attempt_id,
                                       generation=generation)
        return found, True

    async def claim_session(
        self, session: str, *, now: float, lease_s: float, new_id: str, deadline: float,
    ) -> tuple[policy.SessionOwnership, policy.SessionClaimResult] | None:
        """Claim or renew this process's durable session (None: the ledger cannot say)."""
        claimed = await self._call("claim_session", lambda store: store.claim_session(
            session, now=now, lease_s=lease_s, new_id=new_id, deadline=deadline,
        ), deadline=deadline)
        return None if isinstance(claimed, Unread) else claimed

    async def renew_session(self, session: str, epoch: int, *, now: float,
                            lease_s: float) -> bool | None:
        """The ticker's renewal of a held session's lease (None: not renewed now; a lock
        is tried again at the next tick, within the lease's margin)."""
        kept = await self._call("renew_session", lambda store: store.renew_session(
            session, epoch, now=now, lease_s=lease_s,
            lock_wait_s=self._background_lock_wait_s()), background=True)
        return None if isinstance(kept, Unread) else kept

    async def session_owned_by(self, session: str, epoch: int) -> bool | None:
        kept = await self._call("renew_session", lambda store: store.session_owned_by(
            session, self._instance_id, epoch))
        return None if isinstance(kept, Unread) else kept

    async def circuit_remaining(self, scope: str, *, deadline: float,
                                on_retired: Callable[[], None] | None = None) -> float:
        """Seconds of cooldown left in the circuit (the memory's when the ledger cannot say;
        ``on_retired`` first, when that is because this store was closed for good meanwhile:
        ``_unread_for_good``)."""
        state = await self._call("fail_closed", lambda store: store.circuit_state(
            scope, deadline=deadline), deadline=deadline)
        if isinstance(state, Unread):
            self._unread_for_good(on_retired)
            state = self.memory.circuit_state(scope)
        return state.remaining_s(time.time())

    async def snapshot(self, op_key: str) -> policy.OperationSnapshot | None | Unread:
        """The operation now: a poll for the end of another process's attempt (counted)."""
        self.polls += 1
        return await self._call("poll", lambda store: store.snapshot(op_key))

    # -- writes --------------------------------------------------------------------------------
    def _keep(self, entry: KeptWrite) -> None:
        self._kept.append(entry)
        self._kept_bytes += _recording_bytes(entry.write)

    def _pop_kept(self) -> None:
        entry = self._kept.popleft()
        self._kept_bytes -= _recording_bytes(entry.write)
        if not self._kept:
            self._kept_bytes = 0
            self._recording_not_kept_said = False

    def _owed_end(self, end: AttemptEnd, base: dict[str, Any]) -> AttemptEnd:
        """``end`` as it may be owed to the ledger: without its recording once the recordings
        owed would pass ``MAX_OWED_RECORDING_BYTES`` (said in a ``ledger_recording_not_kept``
        event, and a warning once until nothing is owed). The end itself is always kept: the
        turn is completed in the ledger, its recording not replayable there (as a response
        over ``turnguard_replay_max_bytes``); this process may still replay it from memory."""
        size = len(end.recording.body) if end.recording is not None else 0
        if not size or self._kept_bytes + size <= MAX_OWED_RECORDING_BYTES:
            return end
        self._emit("ledger_recording_not_kept", **base, bytes=size, owed_bytes=self._kept_bytes,
                   reason="the recordings owed to the ledger are at their bound")
        if not self._recording_not_kept_said:
            self._recording_not_kept_said = True
            logger.warning(
                "turnguard: the ledger is down and the recordings owed to it reach %d MiB: "
                "the next ends are kept without their recording, not kept for the ledger "
                "(their turns stay completed there; retries through other processes are "
                "forwarded)", MAX_OWED_RECORDING_BYTES >> 20)
        return dataclasses.replace(end, recording=None)

    def write(self, generation: str, write: Write, *, landed=None, kept=None,
              elsewhere: Callable[[], Write] | None = None) -> asyncio.Future | None:
        """A write that must never be lost: sent now when the ledger is usable, else kept in
        order. ``kept()`` runs when it is kept instead of written (now, or when sending it
        failed); ``landed(result, late)`` once it is written (``late``: it had been kept).
        ``elsewhere()``: the write to make instead should the ledger be another file by then.
        Returns the write's future when it was sent now."""
        entry = KeptWrite(generation, write, landed, elsewhere)
        if not self.usable or not entry.belongs_to(self.generation):
            self._keep(entry)
            if kept is not None:
                kept()
            return None
        store, sent_to = self._store, self.generation
        future = store.send(self._as_sent(write, sent_to))
        self._sent[future] = entry

        def done(f: asyncio.Future) -> None:
            if self._sent.pop(f, None) is None:  # settled at close
                return
            error = f.exception()
            if error is not None:
                self._keep(entry)
                self._down(error, WRITE_CALLS.get(type(write), type(write).__name__))
                self._found_gone(store)  # then the new file is opened at once
                if kept is not None:
                    kept()
            else:
                self._recorded_whole(write, f.result(), sent_to)
                if landed is not None:
                    landed(f.result(), False)

        future.add_done_callback(done)
        return future

    def _recorded_whole(self, write: Write, result: FinishResult | None, generation: str) -> None:
        """An end this process recorded whole (``OfflineEndWrite``) that the ledger file of
        ``generation`` took: memory's recording of it is of that file now
        (``Knowledge.recorded_whole``), so it moves on should that file go too."""
        if isinstance(write, OfflineEndWrite) and not write.moving and result is not None \
                and result.applied and write.end.recording is not None:
            self.memory.knowledge.recorded_whole(write.ident.op_key, write.now, generation)

    def _as_sent(self, write: Write, generation: str) -> Write:
        """``write`` as it is sent to the ledger file of ``generation`` now: an attempt's end
        recorded whole names the rows there of this process's attempts of its operation that
        still run (a retry dispatched after it ended, registered since), so that it is never
        recorded on one of them."""
        if not isinstance(write, OfflineEndWrite):
            return write
        running = tuple(a.attempt_id for a in self._attempts()
                        if a.attempt_id is not None and a.generation == generation
                        and a.ident.op_key == write.ident.op_key)
        return dataclasses.replace(write, running=running) if running else write

    def first_event(self, attempt: AttemptInFlight) -> None:
        if attempt.attempt_id is not None:
            self.write(attempt.generation,
                       FirstEventWrite(attempt.attempt_id, attempt.ident.op_key))

    def finish(
        self, attempt: AttemptInFlight, ending: AttemptEnding, end: AttemptEnd, *, now: float,
        circuit_cfg: circuit.CircuitConfig, base: dict[str, Any],
    ) -> asyncio.Future | None:
        """Record an attempt's end, in the ledger (kept if need be) and in memory, and say what
        it did to its retry circuit. Returns the write's future when it was sent now."""
        # What the callbacks of a write kept while the ledger is down need, taken out of the
        # attempt and its ending: the kept write must not keep the attempt (its flow, its tee,
        # its live response) or its ending alive, only the end (and its recording, within
        # ``MAX_OWED_RECORDING_BYTES``).
        attempt_id, op_key, scope = attempt.attempt_id, attempt.ident.op_key, attempt.circuit_scope
        eventless, completed = ending.eventless, ending.outcome == "completed"
        offline = (attempt.ident, attempt.method, attempt.route, attempt.kind, attempt.flow_id,
                   scope)
        transport = attempt.transport
        self.memory.attempt_ended(
            attempt.ident, recording=ending.recording,
            spent_once_claim=attempt.kind == "recovery" and ending.spends_once_claim, now=now,
            attempt_id=attempt.attempt_id, generation=attempt.generation,
            moved=None if end.recording is None else OfflineEndWrite(
                *offline, end, now, transport=transport, moving=True),
        )
        if not self.usable:
            end = self._owed_end(end, base)

        def in_memory() -> None:  # no ledger (yet): keep the circuit in memory
            before = self.memory.circuit_state(scope)
            after, transition = circuit.record_outcome(
                before, eventless_failure=eventless, completed=completed, now=now,
                cfg=circuit_cfg,
            )
            self._note_circuit(FinishResult(True, scope, after, transition))

        def landed(result: FinishResult, late: bool) -> None:
            if not result.applied:
                if attempt_id is not None:
                    self.memory.knowledge.superseded(op_key, attempt_id)
                self._emit("outcome_fenced_out", **base, attempt=attempt_id,
                           reason="the attempt was ended meanwhile (reaped)")
            self._note_circuit(result, quiet=late)  # a late write's effect was told already

        def whole() -> Write:  # recorded whole: operation, attempt and end
            return OfflineEndWrite(*offline, end, now, circuit_cfg, eventless, transport)

        if attempt_id is None:  # dispatched without a ledger
            return self.write(ANY_LEDGER, whole(), landed=landed, kept=in_memory)
        # its row's file may be gone before this is written: then it goes into the new one
        return self.write(
            attempt.generation,
            FinishWrite(attempt_id, op_key, end, now, circuit_cfg, eventless),
            landed=landed, kept=in_memory, elsewhere=whole,
        )

    def note_duplicates(self, op_key: str, *, held: int = 0, replayed: int = 0) -> None:
        """Count a duplicate on its operation in the ledger (for inspection). The counts are
        kept here and written together by ``flush_counts`` (the ticker's, every second, or
        at once for ``MAX_UNWRITTEN_COUNTS`` operations), not one transaction per duplicate;
        skipped while the ledger is down (no decision reads them)."""
        if not self.usable:
            return
        counts = self._duplicates.setdefault(op_key, [0, 0])
        counts[0] += held
        counts[1] += replayed
        if len(self._duplicates) >= MAX_UNWRITTEN_COUNTS:  # now rather than at the next tick
            flushing = asyncio.ensure_future(self.flush_counts())
            self._flushing.add(flushing)  # (the loop keeps a weak reference only)
            flushing.add_done_callback(self._flushing.discard)

    def _counts_to_write(self) -> DuplicatesWrite | None:
        counts, self._duplicates = self._duplicates, {}
        if not counts or not self.usable:
            return None
        return DuplicatesWrite(tuple((op_key, held, replayed)
                                     for op_key, (held, replayed) in counts.items()))

    def write_counts(self) -> None:
        """Write the duplicate counts noted since the last time, in one transaction, without
        waiting for it (at close: the writes sent then are settled before the ledger closes)."""
        write = self._counts_to_write()
        if write is None:
            return

        def done(f: asyncio.Future) -> None:
            if f.exception() is not None:
                self._down(f.exception(), "note_duplicates")

        self._store.send(write).add_done_callback(done)

    async def flush_counts(self) -> None:
        """The ticker's ``write_counts``: a write nobody waits for, which gives up on another
        connection's lock after ``PROBE_S`` (the counts are dropped, as while the ledger is
        down) rather than hold the ledger's one connection, and the requests' reads queued
        behind it, for the whole busy timeout."""
        write = self._counts_to_write()
        if write is not None:
            await self._call("note_duplicates", lambda store: store.write(
                write, deadline=None, lock_wait_s=self._background_lock_wait_s()),
                background=True)

    def _background_lock_wait_s(self) -> float | None:
        """How long a write of the maintenance waits for another connection's lock: on SQLite
        ``PROBE_S`` (a request's read may queue behind it on the one connection); on
        PostgreSQL the database's bound (its lock holds a table, its readers wait too; a
        shorter statement timeout would cancel a long purge)."""
        return None if is_postgres(self.path) else PROBE_S

    def _note_circuit(self, result: FinishResult, *, quiet: bool = False) -> None:
        if result.circuit_scope is None or result.circuit is None:
            return
        self.memory.note_circuit(result.circuit_scope, result.circuit)
        if quiet:
            return
        if result.transition == "opened":
            self._emit(
                "circuit_opened", scope=result.circuit_scope, failures=result.circuit.failures,
                cooldown_ms=round((result.circuit.cooldown_s or 0) * 1000),
                open_until=result.circuit.open_until,
            )
        elif result.transition == "reset":
            self._emit("circuit_reset", scope=result.circuit_scope)

    # -- maintenance ---------------------------------------------------------------------------
    async def reap_dead_peers(self, now: float, *, lease_s: float) -> None:
        """Attempts left in flight by a dead peer become ``unknown`` (or ``partial``). Dead
        means proven gone, or silent for longer than its lease (see ``liveness``): a peer
        that is only stalled keeps its attempts, so they never run twice. Silent counts only
        while the ledger answered this process: after an outage (a database down, restarted
        or paused, a table it reads locked: nobody could renew a lease), a peer that cannot
        be proven gone is taken for gone only once the ledger has answered for a whole lease
        again, so that a peer that reconnects a little later than this process is not
        reaped for the outage.

        Both silences are measured on this process's monotonic clock, never by comparing wall
        clocks (``liveness.Silences``): a wall clock stepped forward or back here, or another
        host's clock ahead or behind, neither reaps a live peer nor keeps a dead one's
        attempts in flight. ``now`` (wall clock) is only what the reap writes as their end."""
        peers = await self._call("reap", lambda store: store.peers_with_attempts_in_flight(),
                                 background=True)
        if isinstance(peers, Unread):
            return
        mono = time.monotonic()
        self._silences.keep_only({peer.instance_id for peer in peers})
        for peer in peers:
            verdict = liveness.verdict(peer, me=self._identity, now=now, lease_s=lease_s,
                                       start_ticks_of=liveness.probe_start_ticks,
                                       silent_s=self._silences.silent_s(peer, mono))
            if verdict == "alive" or verdict == "stale" and mono - self._answering_since < lease_s:
                continue
            heartbeat_was = None if verdict == "dead" else peer.heartbeat_at
            ops = await self._call("reap", lambda store, peer=peer: store.reap_instance(
                peer.instance_id, now=now, heartbeat_was=heartbeat_was,
                lock_wait_s=self._background_lock_wait_s()), background=True)
            if isinstance(ops, Unread) or not ops:
                continue
            for op_key in ops:
                self.memory.knowledge.ended(op_key)
            self._emit("instance_reaped", instance=peer.instance_id, pid=peer.identity.pid,
                       proof="process gone" if verdict == "dead" else "lease expired",
                       operations=[k[:12] for k in ops])

    async def collect_garbage(self, now: float, *, retention_s: float, lease_s: float) -> None:
        n = await self._call("gc", lambda store: store.collect_garbage(
            now=now, retention_s=retention_s, instance_stale_s=lease_s,
            lock_wait_s=self._background_lock_wait_s()), background=True)
        if not isinstance(n, Unread) and n:
            self._emit("ledger_gc", operations_deleted=n)

    async def purge_recordings(self, now: float, *, window_s: float) -> None:
        """Drop the bytes of recordings past the replay window (see ``Ledger.purge_recordings``)."""
        await self._call("gc", lambda store: store.purge_recordings(
            now=now, window_s=window_s, lock_wait_s=self._background_lock_wait_s()),
            background=True)

    async def refresh_circuits(self, now: float) -> set[str] | None:
        """Learn the circuits cooling down now from the ledger (for the gauges, and cooldowns
        another process opened or an operator cleared); returns their scopes (None: unread)."""
        rows = await self._call("circuits", lambda store: store.cooling_circuits(now),
                                background=True)
        if isinstance(rows, Unread):
            return None
        cooling = dict(rows)
        # replaced whole: the metrics thread reads it
        self.memory.circuits = self.memory.refreshed_circuits(cooling, now)
        return set(cooling)

    def control(self, action: Callable[[Store], T]) -> T:
        """Run an operator's control action on the ledger, waiting for it here (bounded by the
        action's own timeout). Raises ``ControlError`` saying why it could not run."""
        if not self.usable:
            raise ControlError(f"the ledger is not usable now ({self.down_reason()})")
        try:
            return action(self._store)
        except TimeoutError:
            raise ControlError("the ledger is busy; the action may still apply: check with "
                               "turnguard.circuit.list or scripts/turnguard audit") from None
        except LedgerError as e:
            raise ControlError(str(e)) from None

    def status(self, now: float, *, wait_s: float) -> tuple[OperationCounts | None, list | None]:
        """Operations by state and the cooling circuits, for ``turnguard.status``, each
        waited for at most ``wait_s`` on the caller's thread (the event loop). The counts
        come from a count on a connection and a thread of their own (the last one finished,
        with its age; None: no ledger open); the circuits from a read of the small circuits
        table on the ledger's thread (None: only memory can say, e.g. while that thread is
        busy)."""
        if self._store is None:
            return None, None
        deadline = time.monotonic() + wait_s
        circuits = self._store.read_open_circuits(now) if self.usable else None
        counts = self._store.operation_counts(wait_s=wait_s)  # meanwhile
        if circuits is None:
            return counts, None
        try:
            rows = circuits.result(max(0.0, deadline - time.monotonic()))
        except (LedgerError, TimeoutError):
            return counts, None
        # a read queued earlier may be the one answered: only what still cools down now
        return counts, [(scope, state) for scope, state in rows if state.remaining_s(now)]


def _to_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn``, called from another thread, handed to ``loop`` (dropped once the loop is closed:
    the process is shutting down)."""
    def hand_over(*args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    return hand_over


def _loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # configured outside the loop (unit tests)
        return asyncio.get_event_loop_policy().get_event_loop()


def _loop_time(deadline: float | None) -> float | None:
    """A monotonic deadline as the running loop's time (what ``asyncio.timeout_at`` takes)."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + deadline - time.monotonic()


def _move_batches(recordings: list[KnownRecording]) -> Iterator[list[KnownRecording]]:
    """``recordings`` in order, cut into batches of ``MOVE_BATCH`` at most, and of
    ``MOVE_BATCH_BYTES`` of bodies at most unless one alone is more."""
    batch: list[KnownRecording] = []
    size = 0
    for known in recordings:
        body = len(known.moved.end.recording.body) if known.moved.end.recording else 0
        if batch and (len(batch) == MOVE_BATCH or size + body > MOVE_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(known)
        size += body
    if batch:
        yield batch
