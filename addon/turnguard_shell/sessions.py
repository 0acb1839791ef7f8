"""This process's ownership of durable sessions (the fencing behind recovery claims).

A request of a session claims the session, or renews this process's lease on it, in the
ledger; requests held through a cooldown keep renewing it. The lease is written only once less
than ``RENEW_LEFT`` of it is left (one threshold for both), so a busy session costs one write
per half lease. When another process took the session (a higher epoch), it is forgotten and
requests held through its cooldown are woken to fail closed.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Callable

from turnguard_core import policy
from turnguard_core.failover import FailoverStore

from .waiters import Waiters

RENEW_LEFT = 0.5  # renew a lease once less than this share of it is left


class Sessions:
    def __init__(self, store: FailoverStore, emit: Callable[..., None]):
        self._store = store
        self._emit = emit
        self._owned: dict[str, policy.SessionOwnership] = {}

    def __len__(self) -> int:
        return len(self._owned)

    def forget(self, session: str) -> None:
        """An operator released it: the next request claims it afresh (a higher epoch)."""
        self._owned.pop(session, None)

    def forget_all(self) -> None:
        """Another process may have taken any of them (this one was taken for dead)."""
        self._owned.clear()

    def expire(self, now: float) -> None:
        """Forget the sessions whose lease has ended: this process no longer owns them (any
        process may take them over), and a request of one claims it again (renewed when it is
        still this process's). Without this, every session ever served would stay here."""
        self._owned = {session: owned for session, owned in self._owned.items()
                       if owned.lease_until > now}

    def _fresh(self, owned: policy.SessionOwnership | None, now: float, lease_s: float) -> bool:
        return owned is not None and owned.lease_until - now > lease_s * RENEW_LEFT

    async def ownership(
        self, session: str | None, *, lease_s: float, deadline: float
    ) -> policy.SessionOwnership | None:
        """Claim or renew this process's ownership of ``session`` (None: not owned, or the
        ledger cannot say)."""
        if session is None:
            return None
        now = time.time()
        cached = self._owned.get(session)
        if self._fresh(cached, now, lease_s):
            return cached
        claimed = await self._store.claim_session(session, now=now, lease_s=lease_s,
                                                  new_id=uuid.uuid4().hex, deadline=deadline)
        if claimed is None:
            return None
        row, result = claimed
        if result == "owned_by_other":
            self._owned.pop(session, None)
            return None
        if result != "renewed":
            self._emit("session_claimed", session=session, result=result,
                       epoch=row.owner_epoch, durable_id=row.durable_id)
        self._owned[session] = row
        return row

    async def keep_held(self, waiters: Waiters, *, now: float, lease_s: float) -> None:
        """Renew the leases of sessions with requests held through a cooldown; wake those
        requests when another process took the session."""
        for session, epoch in waiters.cooldown_sessions():
            owned = self._owned.get(session)
            kept = (await self._store.session_owned_by(session, epoch)
                    if self._fresh(owned, now, lease_s) else False)
            if kept is False:
                # renewed, or, in a ledger file that does not know the session (deleted or
                # replaced under this process), registered again at its epoch: lost only
                # when another process owns it there
                kept = await self._store.renew_session(session, epoch, now=now, lease_s=lease_s)
                if kept and owned is not None:
                    self._owned[session] = dataclasses.replace(owned, lease_until=now + lease_s)
            if kept is False:
                self._owned.pop(session, None)
                waiters.ownership_lost(session, epoch)
