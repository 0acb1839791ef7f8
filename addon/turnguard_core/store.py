"""What the addon needs of a ledger, typed, whatever database holds it.

``Store`` is the protocol the shell (through ``failover.FailoverStore``) uses: async calls
bounded by a ``deadline`` (``time.monotonic()``), and the writes that decide the future as
data (``Write``), so that they can be kept while the ledger is down and applied later, in
order. Every call may raise ``LedgerError``; deciding without the ledger is ``MemoryStore``'s
job. ``LedgerStore`` implements it on a ledger module run by a ``LedgerRunner`` (never blocking
the event loop for long): the embedded SQLite ledger (``ledger.Ledger``, the default) or the
PostgreSQL one (``pg_ledger.PgLedger``, several hosts), whose methods have the same contracts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Protocol, TypeVar

from . import circuit, liveness, policy
from .counting import OperationCounter, OperationCounts
from .identity import Identity
from .ledger import AttemptEnd, FinishResult, HeartbeatResult, Ledger, LedgerError, Recording
from .ledger_admin import CircuitRow
from .ledger_runner import LedgerRunner
from .records import record


@record
class FinishWrite:
    """An attempt's end (its operation's outcome, its recording, its circuit's effect)."""

    attempt_id: int
    op_key: str  # the attempt's operation: the write applies to no other's attempt
    end: AttemptEnd
    now: float
    circuit_cfg: circuit.CircuitConfig | None = None
    eventless_failure: bool = False


@record
class OfflineEndWrite:
    """The end of an attempt dispatched while the ledger could not be written (it has no row
    there): recorded whole once the ledger is back (``Ledger.record_offline_attempt``)."""

    ident: Identity
    method: str
    route: str
    kind: str
    flow_id: str | None
    circuit_scope: str | None
    end: AttemptEnd
    now: float
    circuit_cfg: circuit.CircuitConfig | None = None
    eventless_failure: bool = False
    transport: str = "http"
    # the ids of this process's attempts of the operation in flight as it is sent: rows of
    # attempts that still run, never this end's (see ``FailoverStore._as_sent``)
    running: tuple[int, ...] = ()
    # an own completed attempt recorded in a new file as the process moves there
    # (``FailoverStore._record_own_recordings``): not where that file has its operation in
    # flight or completed
    moving: bool = False


@record
class FirstEventWrite:
    """An attempt saw its first response event (its operation has output now)."""

    attempt_id: int
    op_key: str


@record
class DuplicatesWrite:
    """Duplicates of operations held or replayed (for inspection; no decision reads them):
    ``(op_key, held, replayed)`` of each, written in one transaction."""

    counts: tuple[tuple[str, int, int], ...]


@record
class GiveBackWrite:
    """A claim made for a request that stopped waiting for it: ended, never dispatched."""

    attempt_id: int
    op_key: str
    now: float


Write = FinishWrite | OfflineEndWrite | FirstEventWrite | GiveBackWrite | DuplicatesWrite


class Store(Protocol):
    generation: str  # this ledger's identity: kept writes name it

    def file_replaced(self) -> str | None:
        """Why the ledger is no longer the one opened (its file deleted or replaced, the
        database another one), or None. No query: cheap enough for the event loop."""
        ...

    async def admit(
        self, ident: Identity, *, method: str, route: str, now: float,
        guard: policy.GuardPolicy, flow_id: str | None, circuit_scope: str | None,
        recovery: policy.RecoveryClaim | None, once_mode: bool, deadline: float | None,
        transport: str = "http",
    ) -> policy.Admission: ...

    async def recording(self, attempt_id: int, op_key: str, *,
                        deadline: float | None) -> Recording | None: ...

    async def claim_session(
        self, session: str, *, now: float, lease_s: float, new_id: str, deadline: float | None,
    ) -> tuple[policy.SessionOwnership, policy.SessionClaimResult]: ...

    async def renew_session(self, session: str, epoch: int, *, now: float, lease_s: float,
                            lock_wait_s: float | None = None) -> bool: ...

    async def session_owned_by(self, session: str, instance_id: str, epoch: int) -> bool: ...

    async def circuit_state(self, scope: str, *, deadline: float | None) -> circuit.CircuitState: ...

    async def snapshot(self, op_key: str) -> policy.OperationSnapshot | None: ...

    async def read_apart(self, read: Callable[[Any], T]) -> T:
        """``read(ledger)`` on a read-only connection of its own, on a thread, never queued
        behind this store's calls (``Ledger.read_apart``, ``PgLedger.read_apart``)."""

    def in_one_call_for(self) -> float:
        """How long this store's connection has been in the call it runs now (0.0: none);
        no query (``LedgerRunner.in_one_call_for``)."""
        ...

    async def heartbeat(self, now: float, *, deadline: float | None) -> HeartbeatResult:
        """The probe of a ledger that failed: this process's lease renewed, once a claim
        could be written too (``Ledger.heartbeat``'s ``as_probe``)."""

    async def adopt_attempt(
        self, ident: Identity, *, method: str, route: str, kind: str, flow_id: str | None,
        now: float, circuit_scope: str | None, deadline: float | None, transport: str = "http",
        ended: tuple[int, ...] = (),
    ) -> int | None: ...

    @property
    def claims_in_doubt_pending(self) -> bool:
        """A claim's commit was in doubt when the connection broke, and ``claims_in_doubt``
        has not told of it yet (no query)."""

    async def claims_in_doubt(self, *, deadline: float | None) -> list[tuple[int, str]]:
        """``PgLedger.claims_in_doubt``: the claims in doubt that landed and are in flight."""

    def claims_in_doubt_left(self) -> list[tuple[int, str]]:
        """The claims in doubt ``claims_in_doubt`` has not told (once this store is closed:
        whoever settles them does not know whether they landed)."""

    async def peers_with_attempts_in_flight(self) -> list[liveness.PeerRow]: ...

    def attempts_in_flight_elsewhere_sync(
        self, *, timeout: float,
    ) -> tuple[list[liveness.PeerRow], list[tuple[str, str, float | None]]]:
        """The other instances with attempts in flight or recordings that may still be
        replayed (``peers_with_attempts_in_flight``) and the ``(instance_id, op_key,
        ended_at)`` of each such attempt (``ended_at`` None: in flight), read together, blocking at most ``timeout`` (the
        file being left, read as it goes; ``attempts_left_behind``: a ledger database made
        again since it was opened is an error)."""

    async def mark_moved(self, from_generation: str, *, now: float,
                         deadline: float | None) -> None: ...

    async def moved_peers(self, from_generation: str, *, deadline: float | None) -> set[str]: ...

    async def end_stale_attempts(
        self, keep_ops: list[str], *, now: float, deadline: float | None,
    ) -> list[str]: ...

    # the maintenance's writes, which no request waits for: ``lock_wait_s`` bounds how long
    # one waits for another connection's lock (None: the ledger's busy timeout)
    async def reap_instance(
        self, instance_id: str, *, now: float, heartbeat_was: float | None = None,
        lock_wait_s: float | None = None,
    ) -> list[str]: ...

    async def collect_garbage(
        self, *, now: float, retention_s: float, instance_stale_s: float,
        lock_wait_s: float | None = None,
    ) -> int: ...

    async def purge_recordings(self, *, now: float, window_s: float,
                               lock_wait_s: float | None = None) -> int: ...

    def send(self, write: Write) -> asyncio.Future:
        """Apply ``write`` soon without waiting for it (a store may group several writes in
        one transaction); the future holds its result or error."""
        ...

    async def write(self, write: Write, *, deadline: float | None,
                    lock_wait_s: float | None = None,
                    once: "AppliedOnce | None" = None) -> FinishResult | None:
        """Apply ``write`` and await its result. ``once``: the write owed it stands for, which
        is applied at most once to a ledger file, however many times it is sent (a later
        send gets the first one's result: ``AppliedOnce``)."""
        ...

    async def write_all(self, writes: list[Write], *, deadline: float | None
                        ) -> list[FinishResult | None]:
        """Apply ``writes`` in order and await their results: one call of the ledger's, in
        one transaction where the ledger groups writes (SQLite's ``batch``: all of them, or
        none and ``LedgerError``); on PostgreSQL each is its own (those before one that
        failed stay applied)."""
        ...

    def write_sync(self, write: Write, *, timeout: float,
                   once: "AppliedOnce | None" = None) -> FinishResult | None:
        """``write``, waited for on the caller's thread (at close: the event loop is done);
        ``once`` as for ``write``."""

    def settle(self, timeout: float) -> None:
        """At close: the writes sent so far are run (at most ``timeout`` s) and their futures
        settled, without the event loop."""

    def operation_counts(self, *, wait_s: float) -> OperationCounts:
        """The ledger's operations by state, counted on a connection and a thread of their
        own (``counting.OperationCounter``): waits ``wait_s`` at most, never for a call of the
        addon's nor holding one up."""
        ...

    def read_open_circuits(self, now: float) -> concurrent.futures.Future:
        """The circuits cooling down (a list of (scope, state)), read on the ledger's thread:
        its future, which the caller waits for as long as it may. At most one such read is
        queued at a time: while the last one has not run, that one's future (older rows)."""
        ...

    async def cooling_circuits(self, now: float) -> list[tuple[str, circuit.CircuitState]]: ...

    # operators' control actions (audited in the ledger), waited for on the caller's thread
    def list_circuits(self, now: float, *, timeout: float) -> list[CircuitRow]: ...

    def clear_circuits(self, scope: str | None, *, now: float, actor: str,
                       timeout: float) -> list[CircuitRow]: ...

    def release_session(self, session: str, *, now: float, actor: str, timeout: float
                        ) -> tuple[str, policy.SessionOwnership, policy.SessionOwnership]: ...

    @property
    def incarnation(self) -> int: ...

    def close(self) -> None: ...


T = TypeVar("T")


class AppliedOnce:
    """A write owed to the ledger (``failover.KeptWrite``), applied at most once to each
    ledger file, whoever sends it and however often. A catch-up that stops waiting for its
    write (a script reload stops the ticker that sent it; a request's deadline passes) leaves
    that write to run, and land, on the ledger's thread; the write stays owed, and the next
    catch-up (this instance's, or the one a reload loads: the writes owed are the process's)
    sends it again. Applied a second time, an attempt's end would be fenced out (said as if
    the attempt had been reaped, and its recording forgotten), and one recorded whole (an
    attempt dispatched without the ledger) would be a second attempt of its operation, its
    failure fed to the retry circuit twice. So each send runs through ``apply``: under one
    lock (a second send waits there while the first runs, as for the database's lock: at most
    the ledger's busy timeout on its thread, not at all on the event loop, where it is
    "locked" and the runner hands it to its thread), and a send that finds the write applied
    to this file already gets that result without writing anything. Its job must run alone
    (``LedgerRunner.call(alone=True)``): the result is noted once its transaction is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._applied: dict[str, Any] = {}  # the ledger file's generation -> the result

    def apply(self, ledger: Ledger, write: Callable[[], T]) -> T:
        """``write()`` on ``ledger`` (the job's), or the result it had there already."""
        if loop_running():
            acquired = self._lock.acquire(blocking=False)
        else:
            acquired = self._lock.acquire(timeout=ledger.busy_timeout_ms / 1000)
        if not acquired:
            raise LedgerError("database is locked: a write of it is under way")
        try:
            generation = ledger.generation
            if generation in self._applied:
                return self._applied[generation]
            result = write()
            self._applied[generation] = result
            return result
        finally:
            self._lock.release()


def loop_running() -> bool:
    """Whether the caller runs on an event loop (the proxy's; not the ledger's thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _apply(write: Write, ledger: Ledger) -> FinishResult | None:
    match write:
        case FinishWrite():
            return ledger.finish(write.attempt_id, write.end, now=write.now,
                                 circuit_cfg=write.circuit_cfg,
                                 eventless_failure=write.eventless_failure, op_key=write.op_key)
        case OfflineEndWrite():
            return ledger.record_offline_attempt(
                write.ident, method=write.method, path=write.route, kind=write.kind,
                flow_id=write.flow_id, circuit_scope=write.circuit_scope, end=write.end,
                now=write.now, circuit_cfg=write.circuit_cfg,
                eventless_failure=write.eventless_failure, transport=write.transport,
                running=write.running, moving=write.moving)
        case FirstEventWrite():
            ledger.first_event(write.attempt_id, write.op_key)
            return None
        case GiveBackWrite():
            return ledger.finish(write.attempt_id, AttemptEnd(
                "rejected", None, 0, "abandoned: the request stopped waiting for the ledger"),
                now=write.now, op_key=write.op_key)
        case DuplicatesWrite():
            ledger.note_duplicates(write.counts)
            return None


def _apply_all(writes: list[Write], ledger: Ledger) -> list[FinishResult | None]:
    if isinstance(ledger, Ledger):
        with ledger.batch():
            return [_apply(write, ledger) for write in writes]
    return [_apply(write, ledger) for write in writes]


HEAVY_WRITE_BYTES = 256 * 1024  # a recording this large is written off the event loop


def _heavy(write: Write) -> bool:
    """Whether ``write`` keeps a recording large enough to be written on the ledger's thread."""
    end = getattr(write, "end", None)
    return end is not None and end.recording is not None and \
        len(end.recording.body) >= HEAVY_WRITE_BYTES


class LedgerStore:
    """``Store`` on a ledger (``ledger.Ledger`` or ``pg_ledger.PgLedger``: same methods, same
    contracts) run by ``runner``."""

    def __init__(self, runner: LedgerRunner):
        self._runner = runner
        self._counter = OperationCounter(lambda: runner.ledger.counts_apart())
        self._circuits_read: concurrent.futures.Future | None = None  # open_circuits' last

    @property
    def generation(self) -> str:
        return self._runner.ledger.generation

    def file_replaced(self) -> str | None:
        return self._runner.ledger.file_replaced()

    @property
    def incarnation(self) -> int:
        return self._runner.ledger.incarnation

    async def admit(self, ident, *, method, route, now, guard, flow_id, circuit_scope, recovery,
                    once_mode, deadline, transport="http"):
        return await self._runner.call(lambda led: led.admit(
            ident, method=method, path=route, now=now, guard=guard, flow_id=flow_id,
            circuit_scope=circuit_scope, recovery=recovery, once_mode=once_mode,
            transport=transport,
        ), deadline=deadline)

    async def recording(self, attempt_id, op_key, *, deadline):
        return await self._runner.call(lambda led: led.recording(attempt_id, op_key),
                                       deadline=deadline)

    async def claim_session(self, session, *, now, lease_s, new_id, deadline):
        return await self._runner.call(
            lambda led: led.claim_session(session, now=now, lease_s=lease_s, new_id=new_id),
            deadline=deadline,
        )

    async def renew_session(self, session, epoch, *, now, lease_s, lock_wait_s=None):
        return await self._runner.call(
            lambda led: led.renew_session(session, epoch, now=now, lease_s=lease_s),
            lock_wait_s=lock_wait_s)

    async def session_owned_by(self, session, instance_id, epoch):
        return await self._runner.call(
            lambda led: led.session_owned_by(session, instance_id, epoch))

    async def circuit_state(self, scope, *, deadline):
        return await self._runner.call(lambda led: led.circuit_state(scope), deadline=deadline)

    async def snapshot(self, op_key):
        return await self._runner.call(lambda led: led.snapshot(op_key))

    async def read_apart(self, read):
        return await asyncio.to_thread(self._runner.ledger.read_apart, read)

    def in_one_call_for(self):
        return self._runner.in_one_call_for()

    async def heartbeat(self, now, *, deadline):
        return await self._runner.call(lambda led: led.heartbeat(now, as_probe=True),
                                       deadline=deadline)

    async def adopt_attempt(self, ident, *, method, route, kind, flow_id, now, circuit_scope,
                            deadline, transport="http", ended=()):
        return await self._runner.call(lambda led: led.adopt_attempt(
            ident, method=method, path=route, kind=kind, flow_id=flow_id, now=now,
            circuit_scope=circuit_scope, transport=transport, ended=ended,
        ), deadline=deadline)

    @property
    def claims_in_doubt_pending(self):
        return self._runner.ledger.claims_in_doubt_pending

    async def claims_in_doubt(self, *, deadline):
        return await self._runner.call(lambda led: led.claims_in_doubt(), deadline=deadline)

    def claims_in_doubt_left(self):
        return self._runner.ledger.claims_in_doubt_left()

    async def peers_with_attempts_in_flight(self):
        return await self._runner.call(lambda led: led.peers_with_attempts_in_flight())

    def attempts_in_flight_elsewhere_sync(self, *, timeout):
        return self._runner.call_sync(lambda led: led.attempts_left_behind(), timeout=timeout)

    async def mark_moved(self, from_generation, *, now, deadline):
        return await self._runner.call(lambda led: led.mark_moved(from_generation, now),
                                       deadline=deadline)

    async def moved_peers(self, from_generation, *, deadline):
        return await self._runner.call(lambda led: led.moved_peers(from_generation),
                                       deadline=deadline)

    async def end_stale_attempts(self, keep_ops, *, now, deadline):
        return await self._runner.call(
            lambda led: led.end_stale_attempts(list(keep_ops), now=now), deadline=deadline)

    async def reap_instance(self, instance_id, *, now, heartbeat_was=None, lock_wait_s=None):
        return await self._runner.call(
            lambda led: led.reap_instance(instance_id, now=now, heartbeat_was=heartbeat_was),
            lock_wait_s=lock_wait_s)

    async def collect_garbage(self, *, now, retention_s, instance_stale_s, lock_wait_s=None):
        return await self._runner.call(lambda led: led.collect_garbage(
            now=now, retention_s=retention_s, instance_stale_s=instance_stale_s),
            lock_wait_s=lock_wait_s)

    async def purge_recordings(self, *, now, window_s, lock_wait_s=None):
        return await self._runner.call(
            lambda led: led.purge_recordings(now=now, window_s=window_s),
            lock_wait_s=lock_wait_s)

    def send(self, write):
        return self._runner.defer(lambda led: _apply(write, led), heavy=_heavy(write))

    async def write(self, write, *, deadline, lock_wait_s=None, once=None):
        if once is None:
            return await self._runner.call(lambda led: _apply(write, led), deadline=deadline,
                                           lock_wait_s=lock_wait_s)
        return await self._runner.call(
            lambda led: once.apply(led, lambda: _apply(write, led)), deadline=deadline,
            lock_wait_s=lock_wait_s, alone=True)

    async def write_all(self, writes, *, deadline):
        # alone: its own batch, which would not nest in the deferred writes' (they go first)
        return await self._runner.call(lambda led: _apply_all(writes, led), deadline=deadline,
                                       alone=True)

    def write_sync(self, write, *, timeout, once=None):
        if once is None:
            return self._runner.call_sync(lambda led: _apply(write, led), timeout=timeout)
        return self._runner.call_sync(lambda led: once.apply(led, lambda: _apply(write, led)),
                                      timeout=timeout)

    def settle(self, timeout):
        self._runner.settle(timeout)

    def operation_counts(self, *, wait_s):
        return self._counter.read(wait_s=wait_s)

    def read_open_circuits(self, now):
        if self._circuits_read is None or self._circuits_read.done():
            self._circuits_read = self._runner.submit(lambda led: led.open_circuits(now))
        return self._circuits_read

    async def cooling_circuits(self, now):
        return await self._runner.call(lambda led: led.open_circuits(now))

    def list_circuits(self, now, *, timeout):
        return self._runner.call_sync(lambda led: led.circuits(now), timeout=timeout)

    def clear_circuits(self, scope, *, now, actor, timeout):
        return self._runner.call_sync(
            lambda led: led.clear_circuits(scope, now=now, actor=actor), timeout=timeout)

    def release_session(self, session, *, now, actor, timeout):
        return self._runner.call_sync(
            lambda led: led.release_session(session, now=now, actor=actor), timeout=timeout)

    def close(self) -> None:
        self._runner.close()


SqliteStore = LedgerStore  # the name it had while SQLite was the only ledger
