"""Requests turnguard keeps waiting, and the one place that wakes them.

A request waits either as a duplicate of an attempt in flight (``DuplicateWait``: woken when
that attempt ends, here or in another process: notified by the ledger (PostgreSQL) or, else,
polled; or, for this process's attempt, when its response starts to stream and the request
can attach to it) or through a retry circuit's cooldown
(``CooldownWait``: woken by its timer, or early when its session's ownership is lost). Either
is woken early when its flow is killed or its client leaves. Every wake-up goes through
``resolve``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from mitmproxy import http

from turnguard_core import identity
from turnguard_core.machine import Attachable, Ended, Gone, OwnershipLost, State, TimedOut, Woke

UNLOADED = "turnguard unloaded"  # the Gone of every wait the addon's unload wakes


class HandedOver(Exception):
    """A held request's instance was unloaded by a script reload: the instance loaded since
    (``successor``, a ``TurnGuard``) decides it again from ``resume``, within what was left of
    its budget (``budget_deadline``)."""

    def __init__(self, successor, budget_deadline: float, resume: State):
        super().__init__()
        self.successor, self.budget_deadline, self.resume = successor, budget_deadline, resume


@dataclass
class DuplicateWait:
    flow: http.HTTPFlow
    key: str  # the flow's id, or its call's on a WebSocket
    op_key: str
    foreign_attempt: int | None  # set when the attempt is another process's: polled
    since: float
    wake: asyncio.Future
    generation: str = ""  # of the ledger file the foreign attempt was seen in


@dataclass
class CooldownWait:
    flow: http.HTTPFlow
    key: str
    op_key: str
    session: str
    epoch: int
    since: float
    wake: asyncio.Future


Wait = DuplicateWait | CooldownWait

RECENT_ENDS = 4096  # attempt ends notified lately, remembered for waits that begin just after
RECENT_END_S = 30.0


class Waiters:
    def __init__(self) -> None:
        self._held: dict[str, Wait] = {}  # key (flow id, or a WebSocket call's) -> its wait
        # op key -> its duplicate waits: a notified end (every process's, many a second on a
        # busy fleet) finds the few waits it concerns without going through every held flow
        self._by_op: dict[str, dict[str, DuplicateWait]] = {}
        # (op key, attempt id) -> (state, when): ends notified by the ledger, so that a wait
        # on an attempt whose end was notified before the wait began is not missed
        self._recent_ends: collections.OrderedDict[tuple[str, int], tuple[str, float]] = (
            collections.OrderedDict())

    def __iter__(self):
        return iter(list(self._held.values()))

    def __len__(self) -> int:
        return len(self._held)

    async def _wait(self, wait: Wait, timeout_s: float) -> Woke:
        self._held[wait.key] = wait
        if isinstance(wait, DuplicateWait):
            self._by_op.setdefault(wait.op_key, {})[wait.key] = wait
        try:
            return await asyncio.wait_for(wait.wake, max(0.0, timeout_s))
        except TimeoutError:
            return TimedOut()
        finally:
            self._held.pop(wait.key, None)
            if isinstance(wait, DuplicateWait):
                same_op = self._by_op.get(wait.op_key, {})
                same_op.pop(wait.key, None)
                if not same_op:
                    self._by_op.pop(wait.op_key, None)

    async def duplicate(
        self, flow: http.HTTPFlow, key: str, op_key: str, foreign_attempt: int | None,
        timeout_s: float, generation: str = "",
    ) -> Woke:
        """Wait for the operation's attempt in flight to end (``foreign_attempt``: another
        process's, seen in the ledger file of ``generation``, whose end is notified
        (``attempt_ended_elsewhere``) or polled for by the maintenance ticker; an end notified
        before this wait began ends it at once)."""
        loop = asyncio.get_running_loop()
        wait = DuplicateWait(flow, key, op_key, foreign_attempt, time.monotonic(),
                            loop.create_future(), generation)
        if foreign_attempt:
            ended = self._recent_ends.get((op_key, foreign_attempt))
            if ended is not None:
                self.resolve(wait, Ended(ended[0]))
        return await self._wait(wait, timeout_s)

    async def cooldown(
        self, flow: http.HTTPFlow, key: str, op_key: str, session: str, epoch: int,
        timeout_s: float,
    ) -> Woke:
        """Wait out the cooldown (``TimedOut`` when it is over)."""
        loop = asyncio.get_running_loop()
        return await self._wait(CooldownWait(flow, key, op_key, session, epoch,
                                             time.monotonic(), loop.create_future()), timeout_s)

    @staticmethod
    def resolve(wait: Wait, why: Woke) -> None:
        """Wake one waiting request (the one place that does)."""
        if not wait.wake.done():
            wait.wake.set_result(why)

    def attempt_streaming(self, op_key: str, live) -> None:
        """This process's attempt of ``op_key`` began to stream (``live``, a
        ``LiveResponse``): wake its duplicates, to attach to it (those that cannot take it
        wait on for its end)."""
        for wait in list(self._by_op.get(op_key, {}).values()):
            if wait.foreign_attempt is None:
                self.resolve(wait, Attachable(live))

    def attempt_ended(self, op_key: str, why: Ended) -> None:
        for wait in self:
            if isinstance(wait, DuplicateWait) and wait.op_key == op_key:
                self.resolve(wait, why)

    def attempt_ended_elsewhere(self, op_key: str, attempt_id: int, state: str, *,
                                generation: str = "") -> None:
        """The ledger (of ``generation``, when known) notified the end of an attempt (any
        process's): wake the duplicates held on it in this process as another process's
        attempt (``foreign_attempt``: that attempt, or 0 when its id was not known), and those
        held on an attempt of the operation seen in another ledger (a database made again:
        ids there name other attempts; the owner wrote its turn in this one, so they read it
        again here, where they are held again if it is still in flight); this process's own
        attempts wake their waiters themselves. Remembered a while, for a wait that begins
        just after."""
        now = time.monotonic()
        self._recent_ends[(op_key, attempt_id)] = (state, now)
        self._recent_ends.move_to_end((op_key, attempt_id))
        while self._recent_ends and (len(self._recent_ends) > RECENT_ENDS or next(
                iter(self._recent_ends.values()))[1] < now - RECENT_END_S):
            self._recent_ends.popitem(last=False)
        for wait in list(self._by_op.get(op_key, {}).values()):
            if wait.foreign_attempt in (attempt_id, 0) or (
                    wait.foreign_attempt is not None and generation
                    and wait.generation and wait.generation != generation):
                self.resolve(wait, Ended(state))

    def ownership_lost(self, session: str, epoch: int) -> None:
        for wait in self:
            if isinstance(wait, CooldownWait) and wait.session == session:
                self.resolve(wait, OwnershipLost(epoch))

    def cooldowns_cleared(self, cooling_scopes: set[str]) -> None:
        """Wake the waits through a cooldown whose circuit no longer cools (an operator
        cleared it): they go on to their recovery claim."""
        for wait in self:
            if isinstance(wait, CooldownWait) and "session:" + wait.session not in cooling_scopes:
                self.resolve(wait, Ended("circuit_cleared"))

    def gone(self, flow_id: str, reason: str) -> None:
        """Wake the waits of flow ``flow_id`` (a WebSocket may have one per call)."""
        for wait in self:
            if wait.flow.id == flow_id:
                self.resolve(wait, Gone(reason))

    def release_all(self, reason: str) -> None:
        for wait in self:
            self.resolve(wait, Gone(reason))

    def wake_gone(self, gone: Callable[[http.HTTPFlow], str | None]) -> None:
        """Wake the waits whose flow was killed or whose client left."""
        for wait in self:
            reason = gone(wait.flow)
            if reason is not None:
                self.resolve(wait, Gone(reason))

    def foreign(self) -> dict[str, set[int | None]]:
        """Operations waited on whose attempt is another process's -> the attempts seen."""
        watched: dict[str, set[int | None]] = {}
        for wait in self:
            if isinstance(wait, DuplicateWait) and wait.foreign_attempt is not None:
                watched.setdefault(wait.op_key, set()).add(wait.foreign_attempt)
        return watched

    def holding(self, op_key: str) -> bool:
        """Whether a duplicate of ``op_key`` is held waiting for its attempt in flight."""
        return bool(self._by_op.get(op_key))

    def foreign_generations(self, op_key: str) -> set[str]:
        """The ledger files in which the attempts waited on for ``op_key`` were seen."""
        return {w.generation for w in self._by_op.get(op_key, {}).values()
                if w.foreign_attempt is not None}

    def cooldown_sessions(self) -> set[tuple[str, int]]:
        return {(w.session, w.epoch) for w in self if isinstance(w, CooldownWait)}

    def describe(self, now: float) -> Iterable[str]:
        """One line per held flow, for ``turnguard.held``."""
        for key, w in list(self._held.items()):
            if isinstance(w, CooldownWait):
                what = "the retry circuit's cooldown to end"
            elif w.foreign_attempt is not None:
                what = "an attempt in another process"
            else:
                what = "an attempt in this process"
            route = identity.split_target(w.flow.request.path).route  # no key from the URL
            request = (f"a call on the WebSocket {route}" if w.flow.websocket is not None
                       else f"{w.flow.request.method} {route}")
            yield (f"{key} op={w.op_key[:12]} held={now - w.since:.1f}s waiting for {what}: "
                   f"{request}")

