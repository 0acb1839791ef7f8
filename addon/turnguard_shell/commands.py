"""``turnguard.status`` and ``turnguard.held``: mitmproxy commands, a sub-addon of
``TurnGuard`` (mitmproxy console ``:``, mitmweb)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from mitmproxy import command

from .waiters import CooldownWait, DuplicateWait

if TYPE_CHECKING:
    from turnguard import TurnGuard

STATUS_TIMEOUT_S = 1.0


class Commands:
    name = "turnguard-commands"

    def __init__(self, guard: "TurnGuard"):
        self._guard = guard

    @command.command("turnguard.status")
    def status(self) -> str:
        """turnguard's state as JSON: mode, ledger, operations by state, flows in flight and
        held, circuits cooling down, counts of its telemetry events."""
        g = self._guard
        now = time.time()
        counts, cooldowns = g.store.status(now, timeout=STATUS_TIMEOUT_S)
        if cooldowns is None:  # only memory can say
            cooldowns = [(scope, state) for scope, state in g.store.memory.circuits.items()
                         if state.remaining_s(now)]
        held = list(g.waiters)
        return json.dumps(
            {
                "instance": g.instance_id,
                "recovery_mode": g.settings.recovery_mode,
                "ledger": g.store.path,
                "ledger_ok": g.store.is_open and g.store.error is None,
                "ledger_error": g.store.error,
                "operations_by_state": counts,
                "in_flight": len(g.inflight),
                "held_duplicates": sum(isinstance(w, DuplicateWait) for w in held),
                "held_through_cooldown": sum(isinstance(w, CooldownWait) for w in held),
                "cooldowns": [
                    {"scope": scope, "failures": st.failures,
                     "remaining_ms": round(st.remaining_s(now) * 1000),
                     "cooldown_ms": round((st.cooldown_s or 0) * 1000)}
                    for scope, st in cooldowns
                ],
                "owned_sessions": len(g.sessions),
                "ledger_writes_pending": g.store.kept_writes,
                "events": dict(g.telemetry.counts),
            },
            indent=2,
        )

    @command.command("turnguard.held")
    def held(self) -> str:
        """One line per held flow: flow id, operation, seconds held, and what it waits for."""
        lines = list(self._guard.waiters.describe(time.monotonic()))
        return "\n".join(lines) if lines else "no held flows"
