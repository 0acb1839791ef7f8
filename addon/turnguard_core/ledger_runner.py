"""Runs one ``Ledger`` so that SQLite never freezes the proxy's event loop.

Two paths, one connection, calls strictly in submission order:

- fast: while nothing is queued on the thread and the database has not been contended
  lately, a call runs right away on the caller's thread with a short busy timeout
  (``fast_busy_ms``). That is the common case and costs no thread hand-off;
- slow: a call that meets a locked database there (it was rolled back, so it can run again),
  and every call for ``slow_s`` after that, runs on a thread of its own with the ledger's
  busy timeout. Unrelated traffic then waits at most ``fast_busy_ms`` once.

A call may carry a ``deadline`` (``time.monotonic()``): on the thread it waits for a lock at
most until then, and a call whose deadline passed while it was queued is not run at all
(``LedgerTimeout``). So a request never waits for the ledger past its own bound, however many
calls queue up behind a lock; and a call that was not run claimed nothing.

Writes that nobody waits for at once (an attempt's end, its first event, a duplicate
counted) may be deferred (``defer``): they are gathered and committed together in one
transaction (a group commit) once the callbacks the event loop's current step scheduled have
run (so a response's end goes to its client first), or before any other call, whichever comes
first. One transaction instead of one per write, and none on the path of the hook that made
it. (Without the fast path, each deferred write is its own transaction on the thread.)

A call made while deferred writes wait (on the fast path) runs in their transaction, after
them: one commit for all (say an admission right after a response's end). If that transaction
does not commit, nothing of it applied, and they run as above: the writes, then the call.

A call submitted after another sees its effects (the addon relies on it: an attempt's
``finish`` is queued before any later request for the operation can be admitted); a deferred
write counts as submitted when ``defer`` is called.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from typing import Callable, TypeVar

from .ledger import Ledger, LedgerError

T = TypeVar("T")


class LedgerTimeout(LedgerError):
    """The call's deadline passed before the ledger could run it; it did nothing."""


def contended(error: LedgerError | str) -> bool:
    """Whether the ledger failed for a lock held by another connection (it may work later):
    SQLite's "database is locked" (or busy), PostgreSQL's lock timeout, and its statement
    timeout (a call's ``statement_timeout`` and ``lock_timeout`` are the same bound, so a
    statement that waits for a lock that long is usually cancelled by the first). Each such
    error came after a wait of the call's whole bound: trying again at once spins nothing."""
    text = str(error).lower()
    return ("locked" in text or "busy" in text or "lock timeout" in text
            or "statement timeout" in text)


def writes_refused(error: LedgerError | str) -> bool:
    """Whether the ledger refused to write but can still be read: a full disk, read-only
    files (SQLite: a read-only database, or a write the file system refused, as for a file
    made immutable), a read-only transaction (a PostgreSQL standby,
    ``default_transaction_read_only``) or a full disk on the server."""
    text = str(error).lower()
    return ("disk is full" in text or "readonly database" in text or "ioerr_write" in text
            or "read-only transaction" in text or "readonlysqltransaction" in text
            or "diskfull" in text or "no space left on device" in text)


Job = Callable[[Ledger], T]
"""A ledger call: a function of the ledger, e.g. ``lambda ledger: ledger.admit(...)``."""


class LedgerRunner:
    def __init__(self, ledger: Ledger, *, fast_busy_ms: int = 20, slow_s: float = 5.0,
                 fast_path: bool = True):
        """``fast_path=False``: every call runs on the thread (a ledger across a network, such
        as PostgreSQL: a round trip must never run on the event loop)."""
        self.ledger = ledger
        self._fast_path = fast_path
        self._fast_busy_ms = fast_busy_ms
        self._slow_s = slow_s
        self._slow_until = 0.0
        # calls handed to the thread, and calls it finished: each counter has one writer
        # (the caller's thread, the ledger's thread), so no lock is needed
        self._handed = 0
        self._finished = 0
        # when the thread began the call it runs now (monotonic), None between calls: written
        # by the ledger's thread alone, read on the event loop (``in_one_call_for``)
        self._call_began: float | None = None
        self._busy_ms: int | None = None  # the busy timeout the connection has now
        # deferred writes, with the futures their callers hold, until the next flush
        self._deferred: list[tuple[Job, asyncio.Future]] = []
        self._deferred_heavy = False  # one of them is heavy: the batch runs on the thread
        # batches handed to the thread whose futures the event loop has not settled yet
        self._landing: dict[concurrent.futures.Future, tuple[list, bool]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="turnguard-ledger"
        )
        self._closed = False

    # -- the two paths ----------------------------------------------------------------------------
    def _fast_possible(self) -> bool:
        return (
            self._fast_path
            and self._handed == self._finished  # the thread is not using the connection
            and time.monotonic() >= self._slow_until
            and self.ledger.is_open
            and not self._closed  # (its close may still be queued on the thread)
        )

    def _run(self, job: Job[T], busy_ms: float | None) -> T:
        busy = None if busy_ms is None else max(1, int(busy_ms))
        if busy != self._busy_ms and self.ledger.is_open:
            self.ledger.set_busy_timeout(busy)
            self._busy_ms = busy
        return job(self.ledger)

    def _run_fast(self, job: Job[T]) -> T:
        """Run now; raises ``_Contended`` when the database was locked (nothing was done)."""
        try:
            return self._run(job, self._fast_busy_ms)
        except LedgerError as e:
            if not contended(e):
                raise
            self._slow_until = time.monotonic() + self._slow_s
            raise _Contended from e

    def _queue(self, job: Job[T], deadline: float | None = None,
               lock_wait_s: float | None = None) -> concurrent.futures.Future:
        if self._closed:  # (not the executor's RuntimeError: a caller handles a LedgerError)
            raise LedgerError("the ledger was closed")
        self._handed += 1
        return self._pool.submit(self._run_on_thread, job, deadline, lock_wait_s)

    def in_one_call_for(self) -> float:
        """How long the ledger's thread has been in the call it runs now, in seconds; 0.0
        when it runs none. Calls take milliseconds: one in for longer waits for a lock (or
        for a server that does not answer), and every call queued behind it waits too."""
        began = self._call_began
        return 0.0 if began is None else max(0.0, time.monotonic() - began)

    def _run_on_thread(self, job: Job[T], deadline: float | None,
                       lock_wait_s: float | None = None) -> T:
        self._call_began = time.monotonic()
        try:
            busy_ms = None
            if deadline is not None:
                left_ms = (deadline - time.monotonic()) * 1000
                if left_ms <= 0:
                    raise LedgerTimeout("gave up waiting for the ledger")
                busy_ms = min(left_ms, self.ledger.busy_timeout_ms)
            if lock_wait_s is not None:
                bound_ms = self.ledger.busy_timeout_ms if busy_ms is None else busy_ms
                busy_ms = min(bound_ms, lock_wait_s * 1000)
            return self._run(job, busy_ms)
        finally:
            self._call_began = None
            self._finished += 1

    # -- group commits ----------------------------------------------------------------------------
    def defer(self, job: Job[T], *, heavy: bool = False) -> asyncio.Future:
        """Run ``job`` with the other deferred writes, in one transaction, soon after the
        event loop's current step (or before any later call); the future (of the running
        loop) holds its result or error. A transaction that fails fails all its writes.
        ``heavy``: a write that takes long (megabytes of a recording): its transaction runs
        on the ledger's thread, where SQLite's work does not hold the event loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._deferred_heavy = self._deferred_heavy or heavy
        if not self._deferred:
            # two hops: callbacks the current step schedules (a hook's task resuming to send
            # the response's end to its client) run before the commit, not after it
            loop.call_soon(loop.call_soon, self.flush)
        self._deferred.append((job, future))
        return future

    def flush(self) -> None:
        """Commit the deferred writes now (fast path) or queue them, in order, as one job."""
        if not self._deferred:
            return
        batch, self._deferred = self._deferred, []
        heavy, self._deferred_heavy = self._deferred_heavy, False
        if not self._fast_path:
            # a ledger across a network: each write its own transaction, on the thread (its
            # failures and retries are its own; nothing runs on the event loop to save)
            for job, future in batch:
                self._land(self._queue(job), [(job, future)], single=True)
            return
        jobs = [job for job, _ in batch]

        def run_batch(ledger: Ledger) -> list:
            with ledger.batch():
                return [job(ledger) for job in jobs]

        if not heavy and self._fast_possible():
            try:
                _settle(batch, self._run_fast(run_batch), None)
                return
            except _Contended:
                pass
            except Exception as e:  # noqa: BLE001 - each write's future carries it
                _settle(batch, None, e)
                return
        self._land(self._queue(run_batch), batch, single=False)

    def _land(self, done: concurrent.futures.Future, batch: list[tuple[Job, asyncio.Future]], *,
              single: bool) -> None:
        """Settle ``batch``'s futures, on their loop, once ``done`` (its job on the thread:
        the batch's, or ``single``: the one write's) has run."""
        loop = batch[0][1].get_loop()
        self._landing[done] = (batch, single)

        def landed(f: concurrent.futures.Future) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: so are the waiters
                loop.call_soon_threadsafe(self._settle_landed, f)

        done.add_done_callback(landed)

    def _settle_landed(self, done: concurrent.futures.Future) -> None:
        entry = self._landing.pop(done, None)
        if entry is None:
            return
        batch, single = entry
        error = done.exception()
        results = None if error else ([done.result()] if single else done.result())
        _settle(batch, results, error)

    def settle(self, timeout: float) -> None:
        """At close, when the event loop will not run what the thread hands over: flush the
        deferred writes, wait at most ``timeout`` s for the thread to run what is queued, and
        settle here the futures of the writes it ran (a write still running stays unsettled)."""
        self.flush()
        concurrent.futures.wait(list(self._landing), timeout=max(0.0, timeout))
        for done in [d for d in self._landing if d.done()]:
            self._settle_landed(done)

    # -- the interface ----------------------------------------------------------------------------
    async def call(self, job: Job[T], *, deadline: float | None = None,
                   lock_wait_s: float | None = None, alone: bool = False) -> T:
        """Run ``job`` (now, or on the ledger's thread) and await its result; on the thread,
        bounded by ``deadline`` (see the module docstring). ``lock_wait_s``: how long it may
        wait for a lock at most, however long it was queued (a call nobody waits for, which
        must not hold the one connection for the whole busy timeout). ``alone``: never in the
        deferred writes' transaction (they are committed first): a job that notes its own
        effect as done (``store.AppliedOnce``) must not find it rolled back with them."""
        if not alone and self._deferred and self._fast_path and not self._deferred_heavy \
                and self._fast_possible():
            done, result = self._run_with_deferred(job)
            if done:
                return result
        self.flush()
        if self._fast_possible():
            try:
                return self._run_fast(job)
            except _Contended:
                pass
        return await asyncio.wrap_future(self._queue(job, deadline, lock_wait_s))

    def _run_with_deferred(self, job: Job[T]) -> tuple[bool, T | None]:
        """The deferred writes, then ``job``, in one transaction on the fast path (a commit
        less than flushing them first). (True, its result); or (False, None) when that
        transaction did not commit (nothing of it applied): the deferred writes are put
        back, and the caller flushes them and runs ``job`` on its own, as without this."""
        batch, self._deferred = self._deferred, []
        jobs = [j for j, _ in batch]

        def run_all(ledger: Ledger) -> tuple[list, T]:
            with ledger.batch():
                return [j(ledger) for j in jobs], job(ledger)

        try:
            results, result = self._run_fast(run_all)
        except Exception:  # noqa: BLE001 - rolled back: each runs again on its own below
            self._deferred = batch + self._deferred
            return False, None
        _settle(batch, results, None)
        return True, result

    def call_sync(self, job: Job[T], *, timeout: float | None = None) -> T:
        """Run ``job`` on the ledger's thread and wait for it here (start-up, control). Raises
        ``TimeoutError`` when it takes longer than ``timeout`` seconds."""
        return self.submit(job).result(timeout)

    def submit(self, job: Job[T]) -> concurrent.futures.Future:
        """Queue ``job`` on the ledger's thread (after the deferred writes); its future."""
        self.flush()
        return self._queue(job)

    def close(self) -> None:
        """Close the connection after every queued call (deferred writes first); do not wait
        for it. A call made after this raises ``LedgerError`` (the ledger was closed)."""
        self.flush()
        self._closed = True
        self._pool.submit(self.ledger.close)
        self._pool.shutdown(wait=False)


def _settle(batch: list[tuple[Job, asyncio.Future]], results: list | None,
            error: BaseException | None) -> None:
    """Give each deferred write of a batch its result, or the batch's error."""
    for i, (_, future) in enumerate(batch):
        if future.done():  # cancelled by its caller
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(results[i])


class _Contended(Exception):
    """The fast path met a locked database; the call goes to the thread."""
