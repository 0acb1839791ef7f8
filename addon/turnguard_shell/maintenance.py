"""The ticker: one task for the whole addon, started and stopped by ``TurnGuard``'s
``running`` and ``done`` hooks.

It wakes held flows that were killed or whose client left, lets attempts killed while
intercepted go on to their kill (``InFlight.release_killed``), ends the attempts whose
``response`` or ``error`` hook an earlier addon halted
(``InFlight.end_those_whose_end_hook_was_halted``, and the sockets' whose
``websocket_end`` was; the upstream frames whose ``websocket_message`` was are read),
brings a ledger that failed back
(or opens it again), reaps dead peers' attempts, polls the attempts of other processes that
duplicates here wait on (only while their ends cannot be notified: on PostgreSQL they are, see
``FailoverStore.attempt_ends_notified``; then it re-checks them once when notifications
resume), renews the leases of sessions with requests held through a cooldown, purges
recordings past the replay window and collects garbage. It sleeps longer when nothing is
held, so an idle proxy does next to no work. (The heartbeat has a thread of its own: see
``turnguard_core.heartbeat``.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from mitmproxy import ctx

from turnguard_core import policy
from turnguard_core.failover import Unread
from turnguard_core.machine import Ended

if TYPE_CHECKING:
    from turnguard import TurnGuard

logger = logging.getLogger("turnguard")

FOREIGN_POLL_S = 0.2  # re-check an operation another process owns (issue: 100-250 ms)
TICK_S = 1.0
OWED_WRITES_RETRY_S = 0.01  # writes owed behind a lock: try again at once (each try waits)
# writes owed to a ledger that fails otherwise (a full disk, read-only files, a server that
# cannot be reached): a try fails at once, so a short pause between tries
OWED_WRITES_REDIAL_S = 0.1
REAP_S = 5.0  # look for dead peers' attempts this often (every second when waiting on one)
FOREIGN_REAP_S = 1.0


class Maintenance:
    def __init__(self, guard: "TurnGuard"):
        self._guard = guard
        self._task: asyncio.Task | None = None
        # when each last ran, on the monotonic clock (-inf: never): a wall clock stepped back
        # must not put them off for the step (nor one stepped forward run them on every tick)
        self._last_gc = float("-inf")
        self._last_purge = float("-inf")
        self._last_reap = 0.0

    def running(self) -> None:
        if not self._guard.refused:
            self.ensure_running()

    def done(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._tick_forever(), name="turnguard-maintenance")

    async def _tick_forever(self) -> None:
        g = self._guard
        while True:
            foreign = g.waiters.foreign()
            poll = bool(foreign) and not g.store.attempt_ends_notified
            if g.store.owes_writes_behind_a_lock:
                await asyncio.sleep(OWED_WRITES_RETRY_S)
            elif g.store.owes_writes_while_down:
                await asyncio.sleep(OWED_WRITES_REDIAL_S)
            else:
                await asyncio.sleep(FOREIGN_POLL_S if poll else TICK_S)
            try:
                g.waiters.wake_gone(g.clients.gone)
                g.inflight.release_killed()
                g.inflight.end_those_whose_end_hook_was_halted()
                g.websockets.read_unread_upstream()
                g.websockets.drop_unsent()
                g.websockets.end_those_whose_end_hook_was_halted()
                g.telemetry.reopen_if_moved()
                g.drop_deferred_problems(getattr(ctx.options, "deferred", {}))
                await self._maintain_ledger(time.time())
                g.stop_kept_heartbeat()  # (once the ledger opened at last has its own)
                foreign = g.waiters.foreign()
                recheck, g.store.recheck_foreign = g.store.recheck_foreign, False
                if foreign and (recheck or not g.store.attempt_ends_notified):
                    await self._poll_foreign(foreign)
                await g.sessions.keep_held(g.waiters, now=time.time(),
                                           lease_s=g.settings.owner_lease_s)
                g.sessions.expire(time.time())
            except Exception:
                logger.exception("turnguard: maintenance tick failed")

    async def _maintain_ledger(self, now: float) -> None:
        store, settings = self._guard.store, self._guard.settings
        if not store.is_open:
            # recover by itself once the fault is gone (soon while it owes rows)
            await store.reopen_if_due(soon=store.owes_writes_while_down)
            if not store.is_open:
                return
        if not store.usable and not await store.recover(None):
            return
        await store.flush_counts()
        if time.monotonic() - self._last_reap >= REAP_S:
            await self._reap(now)
            await self._refresh_circuits(now)
        window_s = settings.guard.replay_window_s
        mono = time.monotonic()
        if settings.guard.replay and mono - self._last_purge >= policy.purge_interval_s(window_s):
            self._last_purge = mono
            await store.purge_recordings(now, window_s=window_s)
        if mono - self._last_gc >= policy.gc_interval_s(settings.guard.retention_s):
            self._last_gc = mono
            await store.collect_garbage(now, retention_s=settings.guard.retention_s,
                                        lease_s=settings.instance_lease_s)

    async def _refresh_circuits(self, now: float) -> None:
        """Learn which circuits cool down (for the gauges), and wake the requests held through
        a cooldown that an operator cleared from another process (the control CLI), so they
        go on to their recovery claim now."""
        cooling = await self._guard.store.refresh_circuits(now)
        if cooling is not None:
            self._guard.waiters.cooldowns_cleared(cooling)

    async def _reap(self, now: float) -> None:
        self._last_reap = time.monotonic()
        await self._guard.store.reap_dead_peers(now, lease_s=self._guard.settings.instance_lease_s)

    async def _poll_foreign(self, watched: dict[str, set[int | None]]) -> None:
        """Operations another process owns: wake their waiters once the attempt changed."""
        if time.monotonic() - self._last_reap >= FOREIGN_REAP_S:
            await self._reap(time.time())
        for op_key, attempts in watched.items():
            snap = await self._guard.store.snapshot(op_key)
            if isinstance(snap, Unread):
                return
            seen_in = self._guard.waiters.foreign_generations(op_key)
            if snap is None and "" not in seen_in and self._guard.store.generation not in seen_in:
                # not in this ledger file, and seen in one since deleted or replaced: its
                # process registers it here once it notices (then it is seen again), or it
                # has ended; the duplicates wait (to their bound), never dispatch it again now
                continue
            if snap is None or snap.state != "in_flight" or snap.current_attempt not in attempts:
                self._guard.waiters.attempt_ended(op_key, Ended(snap.state if snap else "gone"))
