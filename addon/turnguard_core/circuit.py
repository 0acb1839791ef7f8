"""The retry circuit: consecutive eventless failures in a scope open a cooldown.

Pure: state in, state out, with ``now`` passed in. The ledger persists the state (so a restart
keeps an open cooldown) and applies ``record_outcome`` inside the transaction that records an
attempt's end, so that every process sharing the ledger sees one circuit per scope.

Rules:
- an eventless failure (an ``unknown`` outcome the upstream caused: timeout, reset, clean close,
  connection error) adds one failure; at ``threshold`` failures the circuit opens for
  ``cooldown_s``, and each further failure re-opens it for twice as long, up to ``cooldown_max_s``;
- a completed response resets it: no failures, and a cooldown still running ends now. The end
  of the last cooldown is kept (as a clear keeps it): that the circuit opened after an
  operation's last attempt ended is what makes the operation's next dispatch its one recovery
  in once mode (``policy.admit``), whatever turn of the scope completed meanwhile;
- a failure never moves an open cooldown's end earlier: processes sharing a ledger (other hosts,
  other clocks, another ``turnguard_cooldown_ms``) can lengthen a cooldown, never shorten it;
- other outcomes (rejected, partial, a client that went away) leave it as it is;
- the cooldown is an absolute time, so one that elapsed while no process was running is over:
  nothing starts a new one until a new failure arrives.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from .records import record

Transition = Literal["opened", "reset"] | None


@record
class CircuitConfig:
    threshold: int = 2
    cooldown_s: float = 60.0
    cooldown_max_s: float = 600.0


@record
class CircuitState:
    failures: int = 0
    open_until: float | None = None
    cooldown_s: float | None = None  # length of the cooldown that open_until ends

    def remaining_s(self, now: float) -> float:
        """Seconds of cooldown left (0 when closed)."""
        if self.open_until is None:
            return 0.0
        return max(0.0, self.open_until - now)


def cooldown_for(failures: int, cfg: CircuitConfig) -> float:
    """The cooldown opened by the ``failures``-th consecutive failure (``failures >= threshold``)."""
    doublings = max(0, failures - cfg.threshold)
    # 2**doublings grows fast: cap the exponent before it overflows a float.
    return min(cfg.cooldown_max_s, cfg.cooldown_s * (2 ** min(doublings, 64)))


def record_outcome(
    state: CircuitState, *, eventless_failure: bool, completed: bool, now: float,
    cfg: CircuitConfig,
) -> tuple[CircuitState, Transition]:
    """The circuit after one attempt's end, and whether it opened or reset."""
    if completed:
        if state.failures or state.remaining_s(now) > 0:
            ended = None if state.open_until is None else min(state.open_until, now)
            return CircuitState(0, ended, None), "reset"
        return state, None
    if not eventless_failure:
        return state, None
    failures = state.failures + 1
    if failures < cfg.threshold:
        return CircuitState(failures, state.open_until, state.cooldown_s), None
    cooldown = cooldown_for(failures, cfg)
    open_until = now + cooldown
    if state.open_until is not None and state.open_until > open_until:
        open_until = state.open_until  # another process's longer cooldown stands
    return CircuitState(failures, open_until, cooldown), "opened"


def circuit_scope(session: str | None, scope: str, route: str) -> str:
    """The circuit's scope: the durable session when the request has one (its hash already
    covers the principal and the upstream, see ``identity``), else the principal + upstream
    ``scope`` and the route (a query string, if given, is ignored)."""
    if session is not None:
        return "session:" + session
    route = route.split("?", 1)[0]
    digest = hashlib.sha256(f"{scope}\0{route}".encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return "route:" + digest
