"""The identity of a large request body, computed in a process of its own.

Parsing and canonicalising JSON holds the interpreter for as long as it takes: a few
milliseconds for a realistic body, but a hostile one (a megabyte of tiny objects, say) could
hold the proxy's event loop, and every other flow with it, for seconds. A thread would not help
(the JSON parser never lets go of the GIL). So bodies that ``read_inline`` refuses (above
``INLINE_MAX_BYTES``, or holding more than ``INLINE_MAX_VALUES`` JSON values) go to a worker
process: the event loop only waits for the answer, and a body that takes longer than the
caller's bound is passed through (the worker is then replaced, so it stops burning a CPU).
Starting the worker (a new interpreter: a few hundred milliseconds, seconds on a loaded machine)
has a bound of its own: a busy machine must not turn a request's guard off only because the
worker was started for it.

The worker runs the very function the proxy runs inline (``identity.identify``): the same
request gets the same identity whichever path computed it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import math
import multiprocessing
import os
import signal
from dataclasses import dataclass

from . import identity

logger = logging.getLogger("turnguard")

INLINE_MAX_BYTES = 256 * 1024
# JSON values a body read on the event loop may hold (counted as its ``{``, ``[`` and ``,``
# bytes, strings too: an upper bound). Reading costs per value, not per byte: 195 kB of
# ``{},`` (a few hundred bytes deflated on a WebSocket) held the loop ~150 ms while parsed and
# identified; 10,000 values take ~20 ms at worst.
INLINE_MAX_VALUES = 10_000


def read_inline(body: bytes) -> bool:
    """Whether ``body`` is read (parsed, identified) on the event loop: at most
    ``INLINE_MAX_BYTES`` holding at most ``INLINE_MAX_VALUES`` JSON values; else off it."""
    return len(body) <= INLINE_MAX_BYTES and (
        body.count(b"{") + body.count(b"[") + body.count(b",") <= INLINE_MAX_VALUES)


START_TIMEOUT_S = 30.0  # a worker not running by then: the machine is far past its capacity
# A wait for the worker that ended this much past its bound: the event loop itself stalled
# (the process was paused, its worker with it, a SIGSTOP of the group), so the bound did not
# run as the worker's time. It is given its bound once more (within the request's budget).
LATE_S = 0.25


class WorkerStopped(Exception):
    """The worker was stopped by ``close(unloaded=True)`` (the addon unloaded, a script reload)
    while it identified the request: nothing was decided; the addon that runs now decides."""


class _NotStarted(Exception):
    """The worker did not answer its first call within the start-up bound."""


def _die_with_parent(parent: int) -> None:
    """(Run in the worker as it starts.) The worker is killed when the proxy dies, even by
    SIGKILL (its ``done`` hook, which stops the worker, never runs then): otherwise it goes
    on waiting for work, for good. Linux only (``PR_SET_PDEATHSIG``); elsewhere a crashed
    proxy's worker stays."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


@dataclass(frozen=True)
class _Bounds:
    """One call's bounds, shared by its attempts (times on the event loop's clock)."""

    identity_s: float  # the identity itself, once the worker runs
    start_bound_s: float  # a worker starting longer than this is replaced
    start_s: float  # this call's wait for the start: the start bound, at most the budget
    start_deadline: float
    budget_s: float  # the whole call (math.inf: none)
    deadline: float


class _Replaced(Exception):
    """An attempt failed because another call replaced the worker it waited on."""


_ATTEMPTS = 3  # a call's worker replaced by others: tried again on the next, this many times


class IdentityWorker:
    """One lazily started worker process (spawned: never a fork of the running proxy)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._started: asyncio.Future | None = None  # the pool's first call (os.getpid)
        self._started_at = 0.0  # (the event loop's time) when the pool was made
        self._unloaded = False
        # one call in the worker at a time: a call's bound is its own body's time, never its
        # wait behind the bodies before it (a queue of large duplicates is no hostile body)
        self._one_at_a_time = asyncio.Lock()

    async def identify(
        self, view: identity.RequestView, *, timeout_s: float,
        start_timeout_s: float = START_TIMEOUT_S, within_s: float | None = None, **kwargs,
    ) -> identity.Identity | identity.Passthrough:
        """``identity.identify(view, **kwargs)`` in the worker, within ``timeout_s`` once the
        worker runs (starting it, when it does not run yet, within ``start_timeout_s``), and the
        whole call within ``within_s`` (the request's budget) when given; a ``Passthrough``
        naming why when any of them runs out or the worker fails. Calls go to the worker one
        at a time: the bounds but the budget count from a call's turn. Raises
        ``WorkerStopped`` when the addon was unloaded meanwhile."""
        loop = asyncio.get_running_loop()
        budget_s = math.inf if within_s is None else within_s
        deadline = loop.time() + budget_s
        try:
            await asyncio.wait_for(self._one_at_a_time.acquire(),
                                   None if within_s is None else max(0.001, within_s))
        except TimeoutError:
            return identity.Passthrough("identity of a large body did not end within the "
                                        f"request budget ({budget_s:.1f} s)")
        try:
            now = loop.time()
            start_s = max(0.001, min(start_timeout_s, deadline - now))
            bounds = _Bounds(timeout_s, start_timeout_s, start_s, now + start_s, budget_s,
                             deadline)
            attempt = 0
            while True:  # at most _ATTEMPTS times: the last one never raises _Replaced
                try:
                    return await self._identify_once(view, bounds, kwargs,
                                                     last=attempt == _ATTEMPTS - 1)
                except _Replaced:
                    attempt += 1
        finally:
            self._one_at_a_time.release()

    async def _identify_once(self, view, bounds: _Bounds, kwargs, *, last: bool):
        """One attempt on the current worker (its start awaited until its start deadline, the
        whole call bounded by the budget's); raises ``_Replaced`` when it failed only because
        another call replaced that worker meanwhile (the request is not to blame: it is tried
        again on the next worker, unless ``last``). A call that runs out of start time replaces
        the worker only when it has been starting for the start bound: one that ran out of its
        budget first, or a retry (it waited less than the bound on this worker), leaves it
        starting for the next."""
        loop = asyncio.get_running_loop()
        pool = None
        bound_s = bounds.identity_s
        try:
            if self._unloaded:
                raise WorkerStopped
            pool, started = self._get_pool()
            await self._wait_started(started, bounds.start_deadline - loop.time())
            future = loop.run_in_executor(pool, functools.partial(identity.identify, view, **kwargs))
            bound_s = min(bounds.identity_s, bounds.deadline - loop.time())
            due, late_again = loop.time() + bound_s, True
            # (asyncio.wait: a call cancelled by the pool's shutdown must not raise
            # CancelledError out of the request's hook)
            try:
                while not future.done():
                    await asyncio.wait({future}, timeout=max(0.001, due - loop.time()))
                    if future.done() or not late_again or loop.time() - due <= LATE_S:
                        break
                    late_again = False  # (paused: see LATE_S)
                    due = min(loop.time() + bounds.identity_s, bounds.deadline)
            finally:
                timed_out = not future.done()
                future.cancel()  # (a no-op once it is done)
            if timed_out:
                raise TimeoutError
            if future.cancelled():
                raise RuntimeError("identity worker stopped")
            return future.result()
        except WorkerStopped:
            raise
        except _NotStarted:
            if loop.time() - self._started_at >= bounds.start_bound_s:
                self._replace(pool)
            return identity.Passthrough(
                f"identity worker did not start within {bounds.start_s:.1f} s")
        except TimeoutError:
            if pool is not self._pool and not last and bound_s >= bounds.identity_s:
                # another call replaced the worker as this one's bound ended (in the same turn
                # of the loop, before the cancellation reached it): its bound counts its wait
                # behind that call, so it is not to blame, as when the cancellation came first
                raise _Replaced from None
            self._replace(pool)  # the worker may spin for a long time more: replace it
            if bound_s < bounds.identity_s:  # the request's budget ran out first
                return identity.Passthrough("identity of a large body did not end within the "
                                            f"request budget ({bounds.budget_s:.1f} s)")
            return identity.Passthrough(
                f"identity of a large body took longer than {bounds.identity_s:.1f} s")
        except Exception as e:  # a broken or unstartable worker must not break the request
            if self._unloaded:
                raise WorkerStopped from e
            if pool is not None and pool is not self._pool and not last:
                raise _Replaced from e  # another call replaced the worker this one waited on
            logger.warning("turnguard: identity worker failed: %r", e)
            self._replace(pool)
            return identity.Passthrough(f"identity worker failed ({type(e).__name__})")

    def _get_pool(self) -> tuple[concurrent.futures.ProcessPoolExecutor, asyncio.Future]:
        """The pool and its first call (a trivial one: it ends once the worker runs), both
        made now when there is no pool."""
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_die_with_parent, initargs=(os.getpid(),),
            )
            self._started = asyncio.get_running_loop().run_in_executor(self._pool, os.getpid)
            self._started_at = asyncio.get_running_loop().time()
            # its failure is raised to the calls that wait for it; marked seen for the case
            # none does (asyncio would log it as never retrieved)
            self._started.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._pool, self._started

    async def _wait_started(self, started: asyncio.Future, start_timeout_s: float) -> None:
        """Once the worker runs; ``_NotStarted`` past ``start_timeout_s``, the first call's
        failure when it failed."""
        if not started.done():  # (asyncio.wait: a timeout here does not cancel it for others)
            await asyncio.wait({started}, timeout=max(0.001, start_timeout_s))
        if not started.done():
            raise _NotStarted
        if started.cancelled():  # the pool was shut down meanwhile
            raise WorkerStopped if self._unloaded else RuntimeError("identity worker stopped")
        started.result()

    def _replace(self, pool: concurrent.futures.ProcessPoolExecutor | None) -> None:
        """Stop ``pool`` if it is still the current one (another call may have replaced it
        already: the new one is left alone); the next call starts another."""
        if pool is not None and pool is self._pool:
            self.close()

    def close(self, *, unloaded: bool = False) -> None:
        """Stop the worker now (a running computation is abandoned). ``unloaded``: for good,
        the addon is gone; a request it was identifying gets ``WorkerStopped``."""
        self._unloaded = self._unloaded or unloaded
        pool, self._pool = self._pool, None
        self._started = None
        if pool is None:
            return
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # shutdown does not stop a computation in progress
            if process.is_alive():
                process.kill()
