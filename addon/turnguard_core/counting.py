"""The ledger's operations counted by state for ``turnguard.status``, never on the event loop
nor on the connection that decides requests.

``SELECT state, COUNT(*) FROM operations GROUP BY state`` scans the whole table: about 280 ms
for the million operations a busy gateway keeps by default. Run where the addon's ledger calls
run (one connection, calls in submission order), it froze the event loop that long and queued
every claim of a new turn behind it. ``OperationCounter`` runs the count (``count``: a function
that opens a connection of its own, counts, and closes it: each store module speaks its SQL)
on a daemon thread of its own, at most one count at a time, and keeps the last one finished:

- ``read(wait_s)`` never waits longer than ``wait_s``: it starts a count when none runs and the
  last one finished more than ``max_age_s`` ago (or none ever did), waits at most ``wait_s``
  for the count it started (a small ledger's counts are fresh on the first call), and returns
  what it knows (``OperationCounts``): the last successful count and its age, whether a count
  runs now, and why the last one failed;
- a count's error never replaces its mapping: ``by_state`` is always state -> count, or None
  while no count has finished.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .records import record

MAX_AGE_S = 1.0  # counts older than this are counted again when asked for


@record
class OperationCounts:
    """What ``turnguard.status`` says of the ledger's operations."""

    by_state: dict[str, int] | None  # the last successful count; None: none finished yet
    age_ms: int | None  # since that count finished
    counting: bool  # a count runs now
    error: str | None  # why the last count failed (None: it did not)


def count_due(*, running: bool, finished_at: float | None, now: float, max_age_s: float) -> bool:
    """Whether to start a count: none runs, and none finished within ``max_age_s``."""
    return not running and (finished_at is None or now - finished_at >= max_age_s)


class OperationCounter:
    def __init__(self, count: Callable[[], dict[str, int]], *, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        self._count = count
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()  # the fields below: the caller's thread and the count's
        self._running: threading.Event | None = None  # set once the running count finished
        self._finished_at: float | None = None  # the last count's end, successful or not
        self._by_state: dict[str, int] | None = None
        self._counted_at: float | None = None  # the last successful count's end
        self._error: str | None = None

    def read(self, *, wait_s: float) -> OperationCounts:
        """What is known now, after a wait of at most ``wait_s`` (see the module)."""
        with self._lock:
            started = count_due(running=self._running is not None,
                                finished_at=self._finished_at, now=self._clock(),
                                max_age_s=self._max_age_s)
            if started:
                done = self._running = threading.Event()
                threading.Thread(target=self._run, args=(done,), daemon=True,
                                 name="turnguard-count").start()
        if started:
            done.wait(max(0.0, wait_s))
        with self._lock:
            now = self._clock()
            return OperationCounts(
                None if self._by_state is None else dict(self._by_state),
                None if self._counted_at is None else round((now - self._counted_at) * 1000),
                self._running is not None, self._error)

    def _run(self, done: threading.Event) -> None:
        try:
            by_state, error = dict(self._count()), None
        except Exception as e:  # noqa: BLE001 - said in the status, as the count's error
            by_state, error = None, str(e) or type(e).__name__
        with self._lock:
            self._finished_at = self._clock()
            self._error = error
            if by_state is not None:
                self._by_state, self._counted_at = by_state, self._finished_at
            self._running = None
        done.set()
