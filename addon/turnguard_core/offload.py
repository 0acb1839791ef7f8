"""The identity of a large request body, computed in a process of its own.

Parsing and canonicalising JSON holds the interpreter for as long as it takes: a few
milliseconds for a realistic body, but a hostile one (a megabyte of tiny objects, say) could
hold the proxy's event loop, and every other flow with it, for seconds. A thread would not help
(the JSON parser never lets go of the GIL). So bodies above ``INLINE_MAX_BYTES`` go to a worker
process: the event loop only waits for the answer, and a body that takes longer than the
caller's bound is passed through (the worker is then replaced, so it stops burning a CPU).

The worker runs the very function the proxy runs inline (``identity.identify``): the same
request gets the same identity whichever path computed it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import multiprocessing

from . import identity

logger = logging.getLogger("turnguard")

INLINE_MAX_BYTES = 256 * 1024  # a hostile body this size parses in ~25 ms at worst


class WorkerStopped(Exception):
    """The worker was stopped by ``close(unloaded=True)`` (the addon unloaded, a script reload)
    while it identified the request: nothing was decided; the addon that runs now decides."""


class IdentityWorker:
    """One lazily started worker process (spawned: never a fork of the running proxy)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._unloaded = False

    async def identify(
        self, view: identity.RequestView, *, timeout_s: float, **kwargs
    ) -> identity.Identity | identity.Passthrough:
        """``identity.identify(view, **kwargs)`` in the worker, within ``timeout_s``; a
        ``Passthrough`` naming why when it takes longer or the worker fails. Raises
        ``WorkerStopped`` when the addon was unloaded meanwhile."""
        loop = asyncio.get_running_loop()
        try:
            if self._unloaded:
                raise WorkerStopped
            pool = self._get_pool()
            future = loop.run_in_executor(pool, functools.partial(identity.identify, view, **kwargs))
            return await asyncio.wait_for(future, max(0.001, timeout_s))
        except WorkerStopped:
            raise
        except TimeoutError:
            self.close()  # the worker may spin for a long time more: replace it
            return identity.Passthrough(f"identity of a large body took longer than {timeout_s:.1f} s")
        except Exception as e:  # a broken or unstartable worker must not break the request
            if self._unloaded:
                raise WorkerStopped from e
            logger.warning("turnguard: identity worker failed: %r", e)
            self.close()
            return identity.Passthrough(f"identity worker failed ({type(e).__name__})")

    def _get_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn")
            )
        return self._pool

    def close(self, *, unloaded: bool = False) -> None:
        """Stop the worker now (a running computation is abandoned). ``unloaded``: for good,
        the addon is gone; a request it was identifying gets ``WorkerStopped``."""
        self._unloaded = self._unloaded or unloaded
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # shutdown does not stop a computation in progress
            if process.is_alive():
                process.kill()
