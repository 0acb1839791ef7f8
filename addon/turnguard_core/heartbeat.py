"""The instance's heartbeat, renewed from a thread of its own.

Peers that cannot prove this process dead (see ``liveness``) go by its lease, so the lease must
not lapse because the event loop is busy (a large body, a long hook) or the main ledger
connection waits behind a lock. ``Heartbeat`` runs on a daemon thread with its own connection:
every ``interval_s`` it renews the lease, every second it checks that the ledger file is still
the one it opened, and every ``CHECKPOINT_S`` it copies the WAL into the database (a passive
checkpoint: the connection that decides requests leaves that to this thread, so its commits
stay short and the event loop never waits for a checkpoint's writes and fsyncs). Once no other
connection has committed for ``IDLE_TRUNCATE_S`` it empties the WAL file (while writes go on,
the file keeps its size, so that commits reuse its blocks; see ``ledger.WAL_SIZE_LIMIT``). It
reports to the caller's callbacks (called on the thread: they must only hand over to the event
loop, e.g. with ``loop.call_soon_threadsafe``):

- ``on_reregistered(incarnation)``: the instance's row was gone (a peer reaped it): it is
  registered again, and its attempts in flight must be assumed ended by the peer;
- ``on_file_gone(reason)``: the ledger file was deleted or replaced; or its -wal or -shm
  was deleted, and the file was made anew from it (``Ledger.make_anew``).

A failed renewal (locked, full) is left to the lease's margin and tried again next time.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .ledger import Ledger, LedgerError, WalState
from .private_files import shown

logger = logging.getLogger("turnguard")

FILE_CHECK_S = 1.0
CHECKPOINT_S = 0.25
IDLE_TRUNCATE_S = 2.0


class IdleWal:
    """When to empty the WAL file: once it holds frames and no other connection has committed
    for ``idle_s`` (pure: the checkpoints' ``WalState`` and the times are given)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._version: int | None = None
        self._since = 0.0

    def after_checkpoint(self, wal: WalState, now: float) -> bool:
        """Whether to empty it now; asked after each checkpoint. True again at the next
        checkpoint when emptying it failed (the WAL still holds frames)."""
        if wal.version != self._version or wal.frames == 0:
            self._version, self._since = wal.version, now
            return False
        return now - self._since >= self.idle_s


class Heartbeat:
    def __init__(
        self, ledger: Ledger, *, interval_s: float,
        on_reregistered: Callable[[int], None], on_file_gone: Callable[[str], None],
        idle_truncate_s: float = IDLE_TRUNCATE_S,
    ):
        self._ledger = ledger
        self._interval_s = interval_s
        self._idle_wal = IdleWal(idle_truncate_s)
        self._on_reregistered = on_reregistered
        self._on_file_gone = on_file_gone
        self._stop = threading.Event()
        self._anew_failed = False
        self._thread = threading.Thread(target=self._run, name="turnguard-heartbeat", daemon=True)

    def start(self, now: float) -> None:
        """Open the connection (raises ``LedgerError``) and start renewing."""
        self._ledger.open(now)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing; the connection closes on the thread (does not wait)."""
        self._stop.set()

    def _run(self) -> None:
        next_beat = time.monotonic() + self._interval_s
        next_check = time.monotonic() + FILE_CHECK_S
        try:
            while not self._stop.wait(CHECKPOINT_S):
                try:
                    wal = self._ledger.checkpoint()
                    if self._idle_wal.after_checkpoint(wal, time.monotonic()):
                        self._ledger.truncate_wal()
                except LedgerError as e:  # the next one copies what this one could not
                    logger.debug("turnguard: checkpoint not made (%s)", e)
                if time.monotonic() < next_check:
                    continue
                next_check = time.monotonic() + FILE_CHECK_S
                why = self._ledger.file_replaced() or self._made_anew()
                if why is not None:
                    self._on_file_gone(why)
                    return
                if time.monotonic() < next_beat:
                    continue
                next_beat = time.monotonic() + self._interval_s
                try:
                    if self._ledger.heartbeat(time.time()) == "reregistered":
                        self._on_reregistered(self._ledger.incarnation)
                except LedgerError as e:
                    logger.debug("turnguard: heartbeat not written (%s); next try in %.0f s",
                                 e, self._interval_s)
        except Exception:  # a thread's exception would only reach stderr
            logger.exception("turnguard: heartbeat thread failed")
        finally:
            self._ledger.close()

    def _made_anew(self) -> str | None:
        """When the file's -wal or -shm was deleted under it: why the file is another now
        (``Ledger.make_anew``: this process, or another, put a copy in its place), else None.
        A copy that could not be made now (a full disk) is tried again at the next check."""
        gone = self._ledger.sidecar_gone()
        if gone is None:
            return None
        try:
            made = self._ledger.make_anew()
        except LedgerError as e:
            if self._anew_failed:  # said once, not at every check while it lasts
                return None
            self._anew_failed = True
            logger.warning("turnguard: the %s of ledger %s was deleted; the file could not "
                           "be made anew yet (%s)", gone, shown(self._ledger.path), e)
            return None
        if made:  # (said here too: the outage's one warning may have named an earlier fault)
            logger.warning("turnguard: the %s of ledger %s was deleted; this process made the "
                           "file anew from its copy", gone, shown(self._ledger.path))
        return (f"the {gone} of ledger file {shown(self._ledger.path)} was deleted; "
                + ("the file was made anew from it" if made else "another process made the "
                   "file anew"))
