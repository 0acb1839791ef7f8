"""Callbacks due after a delay, on one asyncio timer for all of them.

``Deadlines.call_later`` does what the event loop's does, for timers of one delay that are
mostly cancelled long before they are due: a request's response-created timeout (cancelled at
its first event) and the record of its first event (cancelled when the request ends first).
asyncio keeps each of its timers in a heap of ``TimerHandle`` objects ordered by a Python
``__lt__``, a few dozen Python calls a timer between scheduling it, cancelling it and
dropping it; here a heap of tuples, ordered in C, under one asyncio timer armed for the
earliest deadline still on. Cancelled entries are dropped lazily: from the top whenever the
timer fires, and all at once when they are more than half of the heap.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from typing import Callable

logger = logging.getLogger("turnguard")

# what asyncio counts as due: a timer runs when its time is within the clock's resolution
_RESOLUTION = time.get_clock_info("monotonic").resolution
_REBUILD_AFTER = 100  # cancelled entries, at least, before the heap is rebuilt without them


class Deadline:
    """One scheduled callback: ``cancel()`` it (a no-op once it ran or was cancelled)."""

    __slots__ = ("_owner", "callback", "cancelled", "ran")

    def __init__(self, owner: Deadlines, callback: Callable[[], object]):
        self._owner = owner
        self.callback = callback
        self.cancelled = False
        self.ran = False

    def cancel(self) -> None:
        if not self.cancelled and not self.ran:
            self.cancelled = True
            self.callback = None  # (nothing it refers to is kept alive until it is dropped)
            self._owner._note_cancelled()


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()  # (equal times run in the order they were scheduled)
        self._cancelled = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def __len__(self) -> int:
        """Callbacks scheduled and neither run nor cancelled."""
        return len(self._heap) - self._cancelled

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> Deadline:
        """Run ``callback`` ``delay_s`` from now on the running loop's clock (as
        ``loop.call_later``); an exception it raises is logged, the others still run."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay_s
        deadline = Deadline(self, callback)
        heapq.heappush(self._heap, (when, next(self._order), deadline))
        if when < self._timer_at:
            self._arm(loop, when)
        return deadline

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_at(when, self._run_due)

    def _run_due(self) -> None:
        self._timer, self._timer_at = None, math.inf
        loop = asyncio.get_running_loop()
        end = loop.time() + _RESOLUTION
        # (self._heap each time: a callback that cancels another may rebuild it)
        while self._heap and (self._heap[0][0] <= end or self._heap[0][2].cancelled):
            _, _, deadline = heapq.heappop(self._heap)
            if deadline.cancelled:
                self._cancelled -= 1
                continue
            deadline.ran = True
            callback, deadline.callback = deadline.callback, None
            try:
                callback()
            except Exception:  # noqa: BLE001 - as the event loop would: said, the rest run
                logger.exception("turnguard: a scheduled callback failed")
        if self._heap:
            self._arm(loop, self._heap[0][0])

    def _note_cancelled(self) -> None:
        self._cancelled += 1
        if self._cancelled > _REBUILD_AFTER and 2 * self._cancelled > len(self._heap):
            self._heap = [entry for entry in self._heap if not entry[2].cancelled]
            heapq.heapify(self._heap)
            self._cancelled = 0
