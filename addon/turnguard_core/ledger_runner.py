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

A call submitted after another sees its effects (the addon relies on it: an attempt's
``finish`` is queued before any later request for the operation can be admitted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Callable, TypeVar

from .ledger import Ledger, LedgerError

T = TypeVar("T")


class LedgerTimeout(LedgerError):
    """The call's deadline passed before the ledger could run it; it did nothing."""


def _contended(error: LedgerError) -> bool:
    text = str(error).lower()
    return "locked" in text or "busy" in text


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
        self._busy_ms: int | None = None  # the busy timeout the connection has now
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="turnguard-ledger"
        )

    # -- the two paths ----------------------------------------------------------------------------
    def _fast_possible(self) -> bool:
        return (
            self._fast_path
            and self._handed == self._finished  # the thread is not using the connection
            and time.monotonic() >= self._slow_until
            and self.ledger.is_open
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
            if not _contended(e):
                raise
            self._slow_until = time.monotonic() + self._slow_s
            raise _Contended from e

    def _queue(self, job: Job[T], deadline: float | None = None) -> concurrent.futures.Future:
        self._handed += 1
        return self._pool.submit(self._run_on_thread, job, deadline)

    def _run_on_thread(self, job: Job[T], deadline: float | None) -> T:
        try:
            busy_ms = None
            if deadline is not None:
                left_ms = (deadline - time.monotonic()) * 1000
                if left_ms <= 0:
                    raise LedgerTimeout("gave up waiting for the ledger")
                busy_ms = min(left_ms, self.ledger.busy_timeout_ms)
            return self._run(job, busy_ms)
        finally:
            self._finished += 1

    # -- the interface ----------------------------------------------------------------------------
    def submit(self, job: Job[T]) -> concurrent.futures.Future:
        """Run ``job`` now or queued, without waiting; the future holds its result or error."""
        if self._fast_possible():
            done: concurrent.futures.Future = concurrent.futures.Future()
            try:
                done.set_result(self._run_fast(job))
                return done
            except _Contended:
                pass
            except Exception as e:  # noqa: BLE001 - the future carries it
                done.set_exception(e)
                return done
        return self._queue(job)

    async def call(self, job: Job[T], *, deadline: float | None = None) -> T:
        """Run ``job`` (now, or on the ledger's thread) and await its result; on the thread,
        bounded by ``deadline`` (see the module docstring)."""
        if self._fast_possible():
            try:
                return self._run_fast(job)
            except _Contended:
                pass
        return await asyncio.wrap_future(self._queue(job, deadline))

    def call_sync(self, job: Job[T], *, timeout: float | None = None) -> T:
        """Run ``job`` on the ledger's thread and wait for it here (start-up, status). Raises
        ``TimeoutError`` when it takes longer than ``timeout`` seconds."""
        return self._queue(job).result(timeout)

    def close(self) -> None:
        """Close the connection after every queued call; do not wait for it."""
        self._pool.submit(self.ledger.close)
        self._pool.shutdown(wait=False)


class _Contended(Exception):
    """The fast path met a locked database; the call goes to the thread."""
