"""turnguard's mitmproxy commands (console ``:``, mitmweb), registered by ``TurnGuard`` at load:
``turnguard.status`` and ``turnguard.held`` to look, ``turnguard.circuit.list``,
``turnguard.circuit.clear`` and ``turnguard.session.release`` to steer (audited in the
ledger, like ``scripts/turnguard``'s)."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from mitmproxy import command, exceptions

from turnguard_core.failover import ControlError
from turnguard_core.store import Store

from .waiters import CooldownWait, DuplicateWait

T = TypeVar("T")

if TYPE_CHECKING:
    from turnguard import TurnGuard

STATUS_TIMEOUT_S = 1.0  # the control commands' wait for the ledger
# turnguard.status's longest wait (the event loop's): for a count it started (a small ledger's
# counts are fresh on the first call) and the cooling circuits; a large ledger is counted on
# a thread of its own, and shown on a later call
STATUS_WAIT_S = 0.02


NOT_LOADED = ("turnguard: not loaded (mitmproxy's last reload of its script failed, or the "
              "script was unloaded); it answers again once the script loads")


class Commands:
    def __init__(self, guard: "TurnGuard"):
        self._guard = guard

    def _loaded(self) -> "TurnGuard":
        """The addon instance that gets the hooks now. mitmproxy keeps a removed addon's
        commands registered (a script reload that fails to load leaves these, bound to the
        instance it unloaded, whose ledger, events file and holds are closed): with no
        instance loaded a command raises ``CommandError`` saying so, never answers from the
        unloaded one (a ledger "not open" that is fine, cooldowns it no longer guards)."""
        guard = self._guard
        if guard._unloaded:
            guard = guard._process.guard
            if guard is None or guard._unloaded:
                raise exceptions.CommandError(NOT_LOADED)
        return guard

    @command.command("turnguard.status")
    def status(self) -> str:
        """turnguard's state as JSON: mode, ledger, operations by state (the last count, with
        its age: a large ledger is counted on a thread of its own, never holding up traffic),
        flows in flight and held, circuits cooling down, counts of its telemetry events.
        Waits at most ``STATUS_WAIT_S`` for the ledger."""
        g = self._loaded()
        now = time.time()
        counts, cooldowns = g.store.status(now, wait_s=STATUS_WAIT_S)
        if cooldowns is None:  # only memory can say
            cooldowns = [(scope, state) for scope, state in g.store.memory.circuits.items()
                         if state.remaining_s(now)]
        else:
            cooldowns = _with_carried(cooldowns, g, now)
        held = list(g.waiters)
        return json.dumps(
            {
                "instance": g.instance_id,
                "recovery_mode": g.settings.recovery_mode,
                "ledger": g.store.location,
                "ledger_ok": g.store.is_open and g.store.error is None,
                "ledger_error": g.store.error,
                "operations_by_state": None if counts is None else counts.by_state,
                "operations_counted_ms_ago": None if counts is None else counts.age_ms,
                "operations_counting": counts is not None and counts.counting,
                "operations_count_error": None if counts is None else counts.error,
                "in_flight": len(g.inflight),
                "held_duplicates": sum(isinstance(w, DuplicateWait) for w in held),
                "held_through_cooldown": sum(isinstance(w, CooldownWait) for w in held),
                "attached": sum(a.live.listeners for a in g.inflight if a.live is not None),
                "detached_calls": len(g.detacher),
                "detached_without_client": g.detacher.without_client(),
                "cooldowns": [
                    {"scope": scope, "failures": st.failures,
                     "remaining_ms": round(st.remaining_s(now) * 1000),
                     "cooldown_ms": round((st.cooldown_s or 0) * 1000)}
                    for scope, st in cooldowns
                ],
                "owned_sessions": len(g.sessions),
                "circuits_known": len(g.store.memory.circuits),
                "identities_remembered": g.identifier.remembered,
                "ledger_writes_pending": g.store.kept_writes,
                "ledger_writes_pending_bytes": g.store.kept_recording_bytes,
                "events": dict(g.telemetry.counts),
            },
            indent=2,
        )

    @command.command("turnguard.held")
    def held(self) -> str:
        """One line per held flow: flow id, operation, seconds held, and what it waits for."""
        lines = list(self._loaded().waiters.describe(time.monotonic()))
        return "\n".join(lines) if lines else "no held flows"

    @command.command("turnguard.circuit.list")
    def circuit_list(self) -> str:
        """Retry circuits that count failures or cool down, as JSON (from the ledger; this
        process's last known ones when it is down)."""
        g, now = self._loaded(), time.time()
        try:
            rows = _with_carried([(r.scope, r.state) for r in self._control(
                g, lambda store: store.list_circuits(now, timeout=STATUS_TIMEOUT_S))], g, now)
        except exceptions.CommandError:
            rows = [(k, v) for k, v in g.store.memory.circuits.items()
                    if v.failures or v.remaining_s(now)]
        return json.dumps([
            {"scope": scope, "failures": st.failures,
             "remaining_ms": round(st.remaining_s(now) * 1000),
             "cooldown_ms": round((st.cooldown_s or 0) * 1000)}
            for scope, st in rows
        ], indent=2)

    @command.command("turnguard.circuit.clear")
    def circuit_clear(self, scope: str) -> str:
        """Close a retry circuit by hand: its scope (or a unique prefix; ``all``: every circuit
        with failures). Audited in the ledger; requests held through its cooldown go on to
        their recovery claim, and the next request dispatches. In once mode an operation still
        gets at most one recovery dispatch ever."""
        g, now = self._loaded(), time.time()
        actor = self._actor(g, "turnguard.circuit.clear")
        wanted = None if scope == "all" else scope
        # a cooldown carried over from a ledger file deleted or replaced since fences its
        # scope though the ledger in use never knew the circuit: it is cleared too, by name
        # or prefix, and said like the ledger's
        carried = g.store.memory.cooling_carried(now, wanted)
        if wanted is not None and len(carried) > 1:
            raise exceptions.CommandError(
                f"turnguard: circuit scope {scope!r} is ambiguous; give more of it")
        try:
            cleared = self._control(g, lambda store: store.clear_circuits(
                wanted, now=now, actor=actor, timeout=STATUS_TIMEOUT_S))
        except exceptions.CommandError as e:
            if not (carried and g.store.usable and "no circuit whose scope" in str(e)):
                raise
            cleared = []  # only this process's memory knows it
        ended = [(row.scope, row.state) for row in cleared]
        ended += [(s, st) for s, st in carried.items() if s not in {r.scope for r in cleared}]
        scopes = {s for s, _ in ended}
        g.store.memory.clear_carried_circuits(None if wanted is None else scopes)
        g.store.memory.circuits = {k: v for k, v in g.store.memory.circuits.items()
                                   if k not in scopes}
        g.waiters.cooldowns_cleared({k for k, v in g.store.memory.circuits.items()
                                     if v.remaining_s(now)})
        for s, st in ended:
            g.telemetry.emit("circuit_cleared", scope=s, failures=st.failures,
                             remaining_ms=round(st.remaining_s(now) * 1000), by="command")
        return json.dumps({"cleared": sorted(scopes)}, indent=2)

    @command.command("turnguard.session.release")
    def session_release(self, session: str) -> str:
        """Release a durable session (its id or a unique prefix): no process owns it, its
        epoch goes up (writes fenced with the old one fail), the next process to serve it
        takes it over. Audited in the ledger."""
        g = self._loaded()
        actor = self._actor(g, "turnguard.session.release")
        key, before, after = self._control(g, lambda store: store.release_session(
            session, now=time.time(), actor=actor, timeout=STATUS_TIMEOUT_S))
        g.sessions.forget(key)
        g.telemetry.emit("session_released", session=key, owner_was=before.owner_instance,
                         epoch_was=before.owner_epoch, epoch=after.owner_epoch, by="command")
        return json.dumps({"released": key, "owner_was": before.owner_instance,
                           "epoch": after.owner_epoch}, indent=2)

    @staticmethod
    def _actor(g: "TurnGuard", command_name: str) -> str:
        return f"{command_name} (instance {g.instance_id}, pid {os.getpid()})"

    @staticmethod
    def _control(g: "TurnGuard", action: Callable[[Store], T]) -> T:
        """A control command's ledger call, waited for here (bounded)."""
        try:
            return g.store.control(action)
        except ControlError as e:
            raise exceptions.CommandError(f"turnguard: {e}") from None


def _with_carried(rows: list, guard: "TurnGuard", now: float) -> list:
    """The ledger's circuits ``rows`` (scope, state) and the cooldowns this process carried
    over from a ledger file deleted or replaced since, which fence requests here though the
    ledger in use has no row of them."""
    known = {scope for scope, _ in rows}
    return [*rows, *((s, st) for s, st in guard.store.memory.cooling_carried(now).items()
                     if s not in known)]
