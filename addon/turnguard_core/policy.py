"""The guard's decisions, as pure functions over small value types.

Nothing here reads a clock, a disk or a proxy: the caller passes ``now`` and the ledger's snapshot
of an operation, and gets back what to do with the request. The ledger applies an admission
inside its write transaction, which is what makes a claim atomic across processes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from .records import record

Outcome = Literal["in_flight", "completed", "rejected", "partial", "unknown"]

RecoveryMode = Literal["fail_closed", "server_anchored_replay_once", "server_indefinite_recovery"]
RECOVERY_MODES: tuple[RecoveryMode, ...] = (
    "fail_closed", "server_anchored_replay_once", "server_indefinite_recovery",
)

# The once rule, in one place. In once mode an operation gets at most one recovery dispatch,
# ever; and one whose recovery dispatch ended without a known result (these outcomes, a crash
# included) is never dispatched again, by any path.
SPENT_OUTCOMES: tuple[Outcome, ...] = ("unknown", "partial")


def recovery_is_once(mode: RecoveryMode) -> bool:
    """Whether ``mode`` allows one recovery dispatch per operation, ever."""
    return mode == "server_anchored_replay_once"


def once_claim_spent(recovery_dispatches: int, state: Outcome) -> bool:
    """Whether an operation's one recovery was used up without a known result."""
    return recovery_dispatches >= 1 and state in SPENT_OUTCOMES


@record
class GuardPolicy:
    """The options that shape admission, in seconds."""

    replay: bool = True
    replay_window_s: float = 300.0
    retention_s: float = 86400.0


def replay_window_s(guard: GuardPolicy, *, idempotency_key: bool) -> float | None:
    """How long after its end a recording of a request may be replayed (None: never): the
    retention for a request with an ``Idempotency-Key``, else the replay window."""
    if not guard.replay:
        return None
    return guard.retention_s if idempotency_key else guard.replay_window_s


def admission_replay(guard: GuardPolicy, *, idempotency_key: bool, conversation: bool,
                     held: bool) -> tuple[GuardPolicy, float | None]:
    """The guard and replay window a request is admitted with. A completed turn of a
    conversation is no answer to the same body sent after it: that is the conversation's
    next turn (identity's ``conversation``), so replay is off for it, unless it has an
    ``Idempotency-Key`` or was held on the turn's attempt while it ran (``held``: it came
    before, a duplicate)."""
    if conversation and not idempotency_key and not held:
        return dataclasses.replace(guard, replay=False), None
    return guard, replay_window_s(guard, idempotency_key=idempotency_key)


@record
class OperationSnapshot:
    """What the ledger knows of an operation when a request for it arrives."""

    state: Outcome
    fingerprint: str
    current_attempt: int | None
    owner_instance: str | None
    ended_at: float | None
    replay_attempt: int | None  # attempt whose recording can be replayed, if any
    events_seen: int = 0  # response events seen by any attempt: output exists when > 0
    recovery_dispatches: int = 0


@record
class Dispatch:
    """Send the request upstream as a new attempt. ``kind`` says why the attempt exists."""

    kind: Literal["original", "retry", "recovery"]
    attempt_id: int | None = None  # filled in by the ledger when it records the claim


@record
class Replay:
    """Answer from the recording of ``attempt_id``; nothing goes upstream."""

    attempt_id: int


@record
class Hold:
    """Another attempt of the operation is in flight: wait for it to end. ``reason`` (None:
    an attempt in flight) says why else the request waits and is admitted again after:
    ``PEERS_REGISTERING``. ``turn_ended`` (with ``PEERS_REGISTERING``): a turn of the
    operation ended, recorded, before this request was decided, and none is known to run
    (the failover store's ``_held_for_peers`` says from what): the request came after that
    turn, not while it ran."""

    attempt_id: int | None
    owner_instance: str | None
    reason: str | None = None
    turn_ended: bool = False


# The ledger file was deleted or replaced, and processes that had attempts in flight or
# recordings in the old one have not registered them in the new one yet: what the new file
# says of an operation is not known to be all there is until they have.
PEERS_REGISTERING = "ledger_peers_registering"


@record
class Conflict:
    """The request reuses an ``Idempotency-Key`` with a different body: 422, never a replay."""


@record
class Fenced:
    """The request's circuit is cooling down: no dispatch now. ``remaining_s`` of cooldown
    are left; ``output_seen`` says whether the operation already produced response events."""

    remaining_s: float
    output_seen: bool


@record
class Denied:
    """A recovery claim was refused: fail closed with ``code`` (an OpenAI error code)."""

    code: str
    reason: str


@record
class RecoveryClaim:
    """A request released from a cooldown wait asks for a recovery dispatch. ``epoch`` is the
    owner epoch of its durable session that this process holds (the fencing token)."""

    session: str
    epoch: int
    once: bool


Admission = Dispatch | Replay | Hold | Conflict | Fenced | Denied


def admit(
    snapshot: OperationSnapshot | None,
    *,
    fingerprint: str,
    has_idempotency_key: bool,
    now: float,
    policy: GuardPolicy,
    circuit_remaining_s: float = 0.0,
    recovery_once: bool | None = None,
    owner_ok: bool = True,
    once_mode: bool = False,
    circuit_open_until: float | None = None,
    has_session: bool = True,
) -> Admission:
    """Decide what happens to a request for an operation, given the operation's current state.

    - unknown operation: dispatch it (``original``);
    - same ``Idempotency-Key``, other body: ``Conflict``;
    - an attempt in flight: ``Hold`` (single flight);
    - completed with a recording, within the replay window (or, with an ``Idempotency-Key``,
      within retention): ``Replay``;
    - otherwise dispatch again: a ``retry`` after a rejected/partial/unknown attempt, a new
      ``original`` after a completed one whose window passed (people do ask twice).

    A dispatch is then fenced: while the circuit cools down (``circuit_remaining_s`` > 0) the
    answer is ``Fenced``; a request released from a cooldown wait (``recovery_once`` given)
    asks for a recovery (``_recovery``). In once mode (``once_mode``) a spent operation
    (``once_claim_spent``) is never dispatched again, by any path: ``Denied``; and any other
    request of an operation without output whose circuit opened after its last attempt ended
    (``circuit_open_until``: its failures opened it) is that operation's one recovery too,
    counted, whoever sends it: a retry through another process, or after the cooldown was
    cleared, before the request held for the recovery claims it; and ``Denied`` when the
    operation had its one recovery already (one that ended with a known error status, say).
    Only an operation of a session (``has_session``) has a recovery at all (only its requests
    can be held through a cooldown, and only they fail closed without the ledger): a retry of
    a sessionless one after its cooldown is a retry, as in the default mode.
    """
    decision = _admit_unfenced(
        snapshot, fingerprint=fingerprint, has_idempotency_key=has_idempotency_key, now=now,
        policy=policy,
    )
    if not isinstance(decision, Dispatch):
        return decision
    if once_mode and snapshot is not None and once_claim_spent(
        snapshot.recovery_dispatches, snapshot.state
    ):
        return Denied("upstream_operation_status_unknown", "claim_exhausted")
    if circuit_remaining_s > 0:
        return Fenced(circuit_remaining_s, snapshot is not None and snapshot.events_seen > 0)
    if recovery_once is None:
        if (once_mode and has_session and decision.kind == "retry"
                and _opened_by(snapshot, circuit_open_until)):
            return _recovery(snapshot, once=True, owner_ok=True)
        return decision
    return _recovery(snapshot, once=recovery_once, owner_ok=owner_ok)


def _opened_by(snapshot: OperationSnapshot | None, circuit_open_until: float | None) -> bool:
    """The operation, without output, ended before its circuit last opened (it has an
    unknown result from the time its circuit was cooling down for it)."""
    return (snapshot is not None and circuit_open_until is not None
            and snapshot.events_seen == 0 and snapshot.ended_at is not None
            and circuit_open_until > snapshot.ended_at)


def _recovery(snapshot: OperationSnapshot | None, *, once: bool, owner_ok: bool) -> Admission:
    """A request released from a cooldown wait gets a ``recovery`` dispatch only if its session
    is still owned by this process, the operation has no output, and, in once mode, had no
    recovery dispatch yet; otherwise ``Denied``."""
    if not owner_ok:
        return Denied("upstream_request_timeout", "ownership_lost")
    if snapshot is not None and snapshot.events_seen > 0:
        return Denied("upstream_request_timeout", "output_exists")
    if once and snapshot is not None and snapshot.recovery_dispatches >= 1:
        return Denied("upstream_operation_status_unknown", "claim_exhausted")
    return Dispatch("recovery")


def _admit_unfenced(
    snapshot: OperationSnapshot | None,
    *,
    fingerprint: str,
    has_idempotency_key: bool,
    now: float,
    policy: GuardPolicy,
) -> Dispatch | Replay | Hold | Conflict:
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


@record
class ReplayFromMemory:
    """Answer from a recording this process keeps in memory (the ledger cannot be read)."""


@record
class MemoryFacts:
    """What this process knows of an operation without reading the ledger: only durable facts
    it learned from the ledger or its own attempts. ``exhausted`` never reverts (a spent
    once-claim); the others describe now."""

    in_flight_here: bool = False  # this process has an attempt of it in flight
    in_flight_elsewhere: bool = False  # the ledger last said another process has one
    exhausted: bool = False  # its once-only recovery was spent on an unknown/partial end
    replayable: bool = False  # a completed recording within its window is in memory
    # another process's attempt completed within the replay window (the ledger notified it):
    # its recording is in the ledger only
    completed_elsewhere: bool = False


def admit_without_ledger(
    facts: MemoryFacts,
    *,
    circuit_remaining_s: float,
    recovering: bool,
    once_mode: bool,
    has_session: bool,
) -> Admission | ReplayFromMemory:
    """Decide without the ledger (it is locked, full, gone): coalesce in this process, never
    against what the ledger said durably.

    - an attempt in flight here or elsewhere: ``Hold`` (never a second dispatch of it);
    - a recording in memory: ``ReplayFromMemory``;
    - another process's completed recording, within its window, that cannot be read now:
      ``Denied`` (503, as a completed turn whose bytes cannot be read: never run again);
    - once mode: an operation of a session (only those can ever have a recovery dispatch)
      has a recovery state that cannot be read now, so it fails closed: ``Denied`` (and an
      exhausted one says so);
    - a known cooling circuit: ``Fenced``; a recovery claim: ``Denied`` (needs the ledger);
    - otherwise ``Dispatch`` (an attempt with no ledger row)."""
    if facts.in_flight_here or facts.in_flight_elsewhere:
        return Hold(None, None)
    if facts.replayable:
        return ReplayFromMemory()
    if facts.completed_elsewhere:
        return Denied("upstream_request_timeout", "ledger_unavailable")
    if once_mode and facts.exhausted:
        return Denied("upstream_operation_status_unknown", "claim_exhausted")
    if once_mode and has_session:
        return Denied("upstream_request_timeout", "ledger_unavailable")
    if circuit_remaining_s > 0:
        return Fenced(circuit_remaining_s, output_seen=False)
    if recovering:
        return Denied("upstream_request_timeout", "ledger_unavailable")
    return Dispatch("original")


def fence_hold_denial(
    mode: RecoveryMode,
    *,
    has_turn_state: bool,
    has_previous_response_id: bool,
    owns_session: bool,
    output_seen: bool,
) -> str | None:
    """Why a fenced request may not be held through the cooldown (None: it may).

    Only the recovery modes hold, and only a hard turn-state request (``x-codex-turn-state``,
    no ``previous_response_id``) whose operation has no output and whose durable session this
    process owns; everything else fails closed."""
    if mode == "fail_closed":
        return "mode_fail_closed"
    if has_previous_response_id:
        return "previous_response_id"
    if not has_turn_state:
        return "no_turn_state_anchor"
    if output_seen:
        return "output_exists"
    if not owns_session:
        return "owner_proof_missing"
    return None


@record
class SessionOwnership:
    """A durable session's row: who owns it, with which epoch (fencing token), until when."""

    durable_id: str
    owner_instance: str
    owner_epoch: int
    lease_until: float


SessionClaimResult = Literal["created", "renewed", "taken_over", "owned_by_other"]


def claim_session(
    row: SessionOwnership | None, *, instance: str, now: float, lease_s: float, new_id: str
) -> tuple[SessionOwnership, SessionClaimResult]:
    """Claim or renew a durable session for ``instance``: a new session is created at epoch 1;
    the owner renews its lease; another process takes over only after the lease expired, and
    then the epoch goes up by one, so every write fenced with the old epoch fails."""
    if row is None:
        return SessionOwnership(new_id, instance, 1, now + lease_s), "created"
    if row.owner_instance == instance:
        return SessionOwnership(row.durable_id, instance, row.owner_epoch, now + lease_s), "renewed"
    if row.lease_until <= now:
        return (
            SessionOwnership(row.durable_id, instance, row.owner_epoch + 1, now + lease_s),
            "taken_over",
        )
    return row, "owned_by_other"


def release_session(row: SessionOwnership, *, now: float) -> SessionOwnership:
    """A session released by an operator: owned by no process (``owner_instance`` empty), its
    lease over, its epoch one higher. Every write fenced with the old epoch then fails, and
    ``claim_session`` lets the next process take it over (epoch one higher again), including
    the old owner: fencing tokens only ever grow."""
    return SessionOwnership(row.durable_id, "", row.owner_epoch + 1, min(row.lease_until, now))


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


def hold_deadline(held_at: float, *, hold_timeout_s: float, budget_deadline: float) -> float:
    """The moment a held duplicate stops waiting: the hold timeout counted from when the hold
    began, or the end of the request's budget, whichever comes first."""
    return min(held_at + hold_timeout_s, budget_deadline)


def retry_after_seconds(remaining_s: float) -> int:
    """A ``Retry-After`` value: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(remaining_s)) if math.isfinite(remaining_s) else 1


def failure_class(
    *, cut_reason: str | None, status: int | None, error: str | None, body_complete: bool,
    client_gone: bool = False, transport: str = "http", failed_event: str | None = None,
) -> str:
    """Name the kind of an eventless failure, for telemetry and for the circuit.
    ``client_gone``: the client's connection is closed (mitmproxy's HTTP/2 messages do not say
    whose side closed, so the caller checks the connection). On a WebSocket (``transport``
    "ws") a response ends with an event or with the socket: ``failed_event`` is the ``error``
    or ``response.failed`` event that ended it before any output, if one did. ``killed``: a
    user killed the flow (mitmweb's Kill, the ``flow.kill`` command: mitmproxy's message
    ``KILLED_MESSAGE``); turnguard never kills a flow it dispatched (it cuts the upstream).
    ``proxy_out_of_resources``: the proxy's own host could not make the connection (out of
    descriptors, memory, buffers or local ports: ``PROXY_SHORTAGES``), so nothing of it
    reached the upstream. ``proxy_body_size_limit``: mitmproxy refused a body past its
    ``body_size_limit`` option (its message ``BODY_SIZE_LIMIT``): the upstream answered, the
    proxy would not carry it."""
    if cut_reason:
        return cut_reason
    if error == KILLED_MESSAGE:
        return "killed"
    msg = (error or "").lower()
    if BODY_SIZE_LIMIT in msg:
        return "proxy_body_size_limit"
    if client_gone or any(w in msg for w in ("client disconnected", "reset by client")):
        return "client_abort"
    if any(w in msg for w in PROXY_SHORTAGES):
        return "proxy_out_of_resources"
    if transport == "ws":
        if failed_event == "error":
            return "upstream_error_event"
        if failed_event is not None:
            return "upstream_response_failed"
        return "upstream_ws_closed"
    if status is None:
        if any(w in msg for w in ("refused", "connect call failed", "cannot connect",
                                  "resolve", "unreachable", "no route")):
            return "connection_error"
        return "upstream_closed_before_headers"
    if body_complete:
        return "upstream_clean_close"
    return "upstream_closed_after_headers"


# mitmproxy's ``flow.Error.KILLED_MESSAGE``: the error of a flow a user killed
KILLED_MESSAGE = "Connection killed."
# what mitmproxy's error says of a request or response body past its ``body_size_limit``
# ("Response body exceeds mitmproxy's body_size_limit.")
BODY_SIZE_LIMIT = "exceeds mitmproxy's body_size_limit"
# the OS's messages (strerror) for a resource of the proxy's own host running out: EMFILE,
# ENFILE ("... in system"), ENOBUFS, ENOMEM, EADDRNOTAVAIL (no local port left to connect from)
PROXY_SHORTAGES = ("too many open files", "no buffer space available", "cannot allocate memory",
                   "cannot assign requested address")


def counts_for_circuit(failure: str) -> bool:
    """A client that went away, a flow a user killed, the proxy's own host out of
    descriptors (or memory, buffers, local ports), or a body the proxy refused for its
    ``body_size_limit`` says nothing about the upstream's health."""
    return failure not in ("client_abort", "killed", "proxy_out_of_resources",
                           "proxy_body_size_limit")


def purge_interval_s(replay_window_s: float) -> float:
    """How often to purge recordings past the replay window: half the window, between 1 s
    and a minute (so a recording outlives its window by at most that)."""
    return min(60.0, max(1.0, replay_window_s / 2))


def gc_interval_s(retention_s: float) -> float:
    """How often to collect garbage: half the retention, between 5 s and 10 minutes."""
    return min(600.0, max(5.0, retention_s / 2))
