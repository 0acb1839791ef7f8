"""Runs one ``Ledger`` on a thread of its own, so SQLite never blocks the proxy's event loop.

Every call goes to the same single thread, in submission order: a call submitted after another
sees its effects (the addon relies on that: an attempt's ``finish`` is submitted before any
later request for the operation can be admitted). A locked database then makes only the calls
that need the ledger wait (up to its busy timeout), never unrelated traffic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from .ledger import Ledger


class LedgerThread:
    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="turnguard-ledger"
        )

    def submit(self, method: str, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Queue ``ledger.<method>(*args, **kwargs)``; the future holds its result or error."""
        return self._pool.submit(getattr(self.ledger, method), *args, **kwargs)

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run a ledger method on the ledger's thread and await its result."""
        return await asyncio.wrap_future(self.submit(method, *args, **kwargs))

    def call_sync(self, method: str, /, *args: Any, timeout: float | None = None, **kwargs: Any):
        """Run a ledger method on the ledger's thread and wait for it here (start-up, status).
        Raises ``TimeoutError`` when it takes longer than ``timeout`` seconds."""
        return self.submit(method, *args, **kwargs).result(timeout)

    def close(self) -> None:
        """Close the connection after every queued call; do not wait for it."""
        self._pool.submit(self.ledger.close)
        self._pool.shutdown(wait=False)
