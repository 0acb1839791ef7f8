"""The guard's decisions, as pure functions over small value types.

Nothing here reads a clock, a disk or a proxy: the caller passes ``now`` and the ledger's snapshot
of an operation, and gets back what to do with the request. The ledger applies an admission
inside its write transaction, which is what makes a claim atomic across processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Outcome = Literal["in_flight", "completed", "rejected", "partial", "unknown"]
ENDED_OUTCOMES: frozenset[str] = frozenset({"completed", "rejected", "partial", "unknown"})


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    """The options that shape admission, in seconds."""

    replay: bool = True
    replay_window_s: float = 300.0
    retention_s: float = 86400.0


@dataclass(frozen=True, slots=True)
class OperationSnapshot:
    """What the ledger knows of an operation when a request for it arrives."""

    state: Outcome
    fingerprint: str
    current_attempt: int | None
    owner_instance: str | None
    ended_at: float | None
    replay_attempt: int | None  # attempt whose recording can be replayed, if any


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send the request upstream as a new attempt. ``kind`` says why the attempt exists."""

    kind: Literal["original", "retry"]
    attempt_id: int | None = None  # filled in by the ledger when it records the claim


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer from the recording of ``attempt_id``; nothing goes upstream."""

    attempt_id: int


@dataclass(frozen=True, slots=True)
class Hold:
    """Another attempt of the operation is in flight: wait for it to end."""

    attempt_id: int | None
    owner_instance: str | None


@dataclass(frozen=True, slots=True)
class Conflict:
    """The request reuses an ``Idempotency-Key`` with a different body: 422, never a replay."""


Admission = Dispatch | Replay | Hold | Conflict


def admit(
    snapshot: OperationSnapshot | None,
    *,
    fingerprint: str,
    has_idempotency_key: bool,
    now: float,
    policy: GuardPolicy,
) -> Admission:
    """Decide what happens to a request for an operation, given the operation's current state.

    - unknown operation: dispatch it (``original``);
    - same ``Idempotency-Key``, other body: ``Conflict``;
    - an attempt in flight: ``Hold`` (single flight);
    - completed with a recording, within the replay window (or, with an ``Idempotency-Key``,
      within retention): ``Replay``;
    - otherwise dispatch again: a ``retry`` after a rejected/partial/unknown attempt, a new
      ``original`` after a completed one whose window passed (people do ask twice).
    """
    if snapshot is None:
        return Dispatch("original")
    if has_idempotency_key and snapshot.fingerprint != fingerprint:
        return Conflict()
    if snapshot.state == "in_flight":
        return Hold(snapshot.current_attempt, snapshot.owner_instance)
    if snapshot.state == "completed":
        if policy.replay and snapshot.replay_attempt is not None and snapshot.ended_at is not None:
            limit = policy.retention_s if has_idempotency_key else policy.replay_window_s
            if now - snapshot.ended_at <= limit:
                return Replay(snapshot.replay_attempt)
        return Dispatch("original")
    return Dispatch("retry")


def admit_in_memory(in_flight_locally: bool) -> Admission:
    """Admission when the ledger cannot be used: coalesce what this process has in flight,
    forward everything else (no replay, no cross-process guarantee)."""
    return Hold(None, None) if in_flight_locally else Dispatch("original")


def classify_outcome(
    *,
    status: int | None,
    events_seen: int,
    terminal: Literal["success", "failure"] | None,
    body_complete: bool,
    counts_events: bool,
) -> Outcome:
    """Classify how one upstream attempt ended.

    ``status`` is None when no response headers arrived. ``counts_events`` is False when the
    body is not an SSE stream we can read (not SSE, or content-encoded), in which case a whole
    2xx body is a completion.

    - ``rejected``: an error status before any event (the operation did not run);
    - ``completed``: a terminal success event, or a whole 2xx body that is not an event stream;
    - ``partial``: events were seen, then the stream failed or ended without a terminal success;
    - ``unknown``: no events and no status, or a 2xx event stream that ended with zero events.
    """
    if status is None:
        return "partial" if events_seen else "unknown"
    if not 200 <= status < 300:
        return "partial" if events_seen else "rejected"
    if terminal == "success":
        return "completed"
    if not counts_events:
        return "completed" if body_complete else "unknown"
    return "partial" if events_seen else "unknown"


def hold_deadline(arrived_at: float, *, hold_timeout_s: float, request_budget_s: float) -> float:
    """The moment a held request stops waiting: the hold timeout or the request budget,
    whichever comes first, both counted from the request's arrival."""
    return arrived_at + min(hold_timeout_s, request_budget_s)


def retry_after_seconds(remaining_s: float) -> int:
    """A ``Retry-After`` value: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(remaining_s)) if math.isfinite(remaining_s) else 1
