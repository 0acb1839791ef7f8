"""A guarded request's whole fate, as a pure state machine (in the style of h11's ``_state``).

No proxy, clock, disk or network: the shell runs the loop, does what a state asks (ask the
store, wait, read a recording) and feeds the result back to one transition function, which
returns the next state and the effects to show (telemetry records, a mark and a comment for
mitmweb). Every request starts in ``Admit`` and ends in exactly one terminal state:

    Forward      dispatch it upstream as a new attempt (the store claimed it)
    PassThrough  forward it untouched, outside single flight (nothing to guard it with)
    Replay       answer from a recording (the shell may still decline it: Vary, encodings)
    Attach       answer live from the attempt in flight in this process: its response so
                 far at once, then the rest as it comes (``live``), to the same end
    Respond      answer it with turnguard's own answer (409, 422, 503)
    FailClosed   answer 503 (the shell reads the circuit's remaining cooldown, then
                 ``fail_closed`` gives the answer)
    Abandon      its client is gone: kill it, never dispatch it

and in between it waits in ``HoldDuplicate`` (another attempt of its operation is in flight),
``WaitCooldown`` (held through a retry circuit's cooldown, recovery modes) or
``FetchRecording``. Who moves a state:

    Admit           --on_admission(store's decision)-->  any state
    HoldDuplicate   --on_woke(Ended | Attachable | TimedOut | Gone)-->
                        Admit | Replay | Attach | Respond | Abandon
    WaitCooldown    --on_woke(TimedOut | Gone | OwnershipLost)-->  Admit | FailClosed | Abandon
    FetchRecording  --on_recording(recording or not)-->  Replay | PassThrough | FailClosed
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from . import answers, policy
from .ledger import Recording
from .records import record

MARK_HELD = ":hourglass:"
MARK_COOLDOWN = ":snowflake:"
MARK_REJECTED = ":no_entry:"
MARK_ATTACHED = ":link:"


# -- what a request is -------------------------------------------------------------------------
@record
class RequestFacts:
    """What the machine knows of one guarded request. Times are the shell's monotonic clock."""

    op_id: str
    op_key: str
    flow_id: str
    session: str | None
    has_turn_state: bool
    has_previous_response_id: bool
    accepts_sse: bool
    budget_deadline: float
    hold_timeout_s: float
    recovery_mode: policy.RecoveryMode
    circuit_threshold: int
    owner: policy.SessionOwnership | None  # this process's ownership of its session, if any
    transport: str = "http"  # or "ws": a call on a WebSocket

    @property
    def base(self) -> dict[str, Any]:
        """The fields every telemetry record of the request starts with."""
        return {"op": self.op_id, "flow": self.flow_id, "session": self.session,
                "transport": self.transport}


# -- effects -----------------------------------------------------------------------------------
@record
class Emit:
    """One telemetry record."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)


@record
class Show:
    """What mitmweb shows of the flow: a mark (None: keep it) and a comment."""

    mark: str | None
    comment: str


@record
class CountHeld:
    """A duplicate of ``op_key`` began to be held: counted on the operation in the ledger
    (for inspection)."""

    op_key: str


Effect = Emit | Show | CountHeld


# -- states ------------------------------------------------------------------------------------
@record
class Admit:
    """Ask the store what to do (a recovery claim when ``recovery`` is given). ``held_since``
    and ``hold_deadline`` carry a duplicate hold across re-admissions; ``held_as_duplicate``:
    that hold was counted as a duplicate's (``duplicate_held``), not only a request's held for
    peers (``request_held``); ``after_turn_ended``: that hold began for the peers, after a
    turn of its operation ended (``policy.Hold.turn_ended``)."""

    recovery: policy.RecoveryClaim | None = None
    held_since: float | None = None
    hold_deadline: float = 0.0
    held_as_duplicate: bool = True
    after_turn_ended: bool = False

    @property
    def held_before_turn_ended(self) -> bool:
        """Held while a turn of its operation ran, or may have run (a duplicate: that turn's
        recording answers it; ``policy.admission_replay``'s ``held``). Not a request held
        only for the peers to register their turns, after a turn of it ended: a
        Responses conversation's next turn, sent with the same body, is no duplicate of the
        turn before, and its peers wait must not make it one (replayed the turn before's
        answer once the paused owner registers it, or held to its bound until then)."""
        return self.held_since is not None \
            and (self.held_as_duplicate or not self.after_turn_ended)


@record
class HoldDuplicate:
    """Wait for the operation's attempt in flight (``attempt_id``, if known) to end, until
    ``deadline``."""

    attempt_id: int | None
    held_since: float
    deadline: float
    recovery: policy.RecoveryClaim | None = None
    as_duplicate: bool = True  # counted as a duplicate's hold (else a request_held)
    after_turn_ended: bool = False  # see ``Admit``


@record
class WaitCooldown:
    """Held through the circuit's cooldown for ``wait_s`` (nothing is dispatched meanwhile),
    with the session owned at ``epoch``."""

    wait_s: float
    epoch: int
    since: float


@record
class FetchRecording:
    """Read the recording to replay: ``attempt_id``'s in the store (None: only the one this
    process keeps in memory)."""

    attempt_id: int | None
    held_ms: int


@record
class Forward:
    """Terminal: dispatch upstream as the attempt the store claimed."""

    dispatch: policy.Dispatch


@record
class PassThrough:
    """Terminal: forward untouched (no attempt), saying why."""

    reason: str


@record
class Replay:
    """Terminal: answer from ``recording``."""

    recording: Recording
    held_ms: int
    attempt_id: int | None


@record
class Attach:
    """Terminal: answer live from the attempt in flight in this process (``attempt_id``):
    ``live`` is the shell's handle on its response (opaque here)."""

    live: Any
    held_ms: int
    attempt_id: int | None


@record
class Respond:
    """Terminal: turnguard's own answer."""

    answer: answers.Answer


@record
class FailClosed:
    """Terminal: 503 with ``code``, nothing dispatched (see ``fail_closed``)."""

    reason: str
    code: str = "upstream_request_timeout"


@record
class Abandon:
    """Terminal: the client is gone (or the flow was killed); never dispatch it."""

    reason: str


Terminal = Forward | PassThrough | Replay | Attach | Respond | FailClosed | Abandon
State = Admit | HoldDuplicate | WaitCooldown | FetchRecording | Terminal
Transition = tuple["State", tuple[Effect, ...]]


# -- why a wait ended --------------------------------------------------------------------------
@record
class Ended:
    """The attempt waited for ended (``recording``: completed and replayable; ``refused``:
    the upstream answered but the proxy refused that answer, mitmproxy's message; the same
    request would be refused again)."""

    outcome: str
    recording: Recording | None = None
    refused: str | None = None


@record
class Attachable:
    """The attempt waited for is this process's and its response is streaming: the request
    can attach to it (``live``: the shell's handle on that response, opaque here)."""

    live: Any


@record
class TimedOut:
    """The wait's bound passed first."""


@record
class Gone:
    """The flow was killed or its client went away."""

    reason: str


@record
class OwnershipLost:
    """Another process took the session (a higher epoch)."""

    epoch: int | None


Woke = Ended | Attachable | TimedOut | Gone | OwnershipLost


# -- transitions -------------------------------------------------------------------------------
def start() -> Admit:
    return Admit()


def on_admission(
    req: RequestFacts, state: Admit, admission: policy.Admission | policy.ReplayFromMemory,
    now: float, *, ledger_down: str | None,
) -> Transition:
    """The store decided (``admission``) for the request in ``state``. ``ledger_down``: why
    the ledger cannot be used now (None: it can)."""
    base = req.base
    held_ms = 0 if state.held_since is None else round((now - state.held_since) * 1000)
    match admission:
        case policy.Dispatch(kind=kind, attempt_id=attempt_id):
            effects: list[Effect] = [Emit("dispatch", {**base, "attempt": attempt_id,
                                                       "kind": kind,
                                                       "ledger": attempt_id is not None})]
            if kind == "recovery":
                epoch = state.recovery.epoch if state.recovery else None
                effects += [
                    Emit("recovery_claimed", {**base, "attempt": attempt_id, "epoch": epoch}),
                    Show(None, "turnguard: held through the cooldown, then sent upstream once "
                               f"as the recovery dispatch of {req.op_id}"),
                ]
            elif state.held_since is not None and state.held_as_duplicate:
                effects += [
                    Emit("duplicate_forwarded", {**base, "held_ms": held_ms}),
                    Show(None, f"turnguard: held {held_ms} ms, then forwarded (the earlier "
                               f"attempt of {req.op_id} did not complete)"),
                ]
            elif state.held_since is not None:  # held for the peers alone: no duplicate
                effects.append(Show(None, f"turnguard: held {held_ms} ms for the processes "
                                          "that had turns in the ledger file left to register "
                                          "them, then sent upstream"))
            return Forward(admission), tuple(effects)
        case policy.Replay(attempt_id=attempt_id):
            return FetchRecording(attempt_id, held_ms), ()
        case policy.ReplayFromMemory():
            return FetchRecording(None, held_ms), ()
        case policy.Conflict():
            return Respond(answers.idempotency_key_conflict()), (
                Emit("idempotency_key_conflict", {**base, "answer_status": 422,
                                                  "code": "idempotency_key_conflict"}),
                Show(MARK_REJECTED, "turnguard: Idempotency-Key reused with a different body"),
            )
        case policy.Denied(code=code, reason=reason):
            return FailClosed(reason, code), (
                Emit("recovery_denied", {**base, "reason": reason, "code": code}),
            )
        case policy.Fenced():
            return _fenced(req, admission, now, ledger_down)
        case policy.Hold():
            return _hold(req, state, admission, now)
    raise AssertionError(f"unknown admission {admission!r}")  # pragma: no cover


def _fenced(
    req: RequestFacts, fenced: policy.Fenced, now: float, ledger_down: str | None
) -> Transition:
    """The circuit cools down: fail closed (503), or hold through the cooldown."""
    base = req.base
    denial = policy.fence_hold_denial(
        req.recovery_mode,
        has_turn_state=req.has_turn_state,
        has_previous_response_id=req.has_previous_response_id,
        owns_session=req.owner is not None,
        output_seen=fenced.output_seen,
    )
    remaining_budget = req.budget_deadline - now
    if denial is None and remaining_budget <= 0:
        denial = "request_budget_expired"
    if denial == "owner_proof_missing" and req.session and ledger_down is not None:
        # no owner proof because there is no ledger to hold it: say so
        return FailClosed("ledger_unavailable"), (
            Emit("ledger_unavailable", {**base, "during": "recovery_decision",
                                        "error": ledger_down}),
        )
    if denial is not None:
        retry_after = policy.retry_after_seconds(fenced.remaining_s)
        effects: list[Effect] = [Emit("cooldown_rejected", {
            **base, "retry_after_s": retry_after,
            "cooldown_remaining_ms": round(fenced.remaining_s * 1000), "reason": denial,
            "answer_status": 503, "code": "upstream_request_timeout",
        })]
        if denial != "mode_fail_closed":
            effects.append(Emit("fail_closed", {**base, "reason": denial}))
        effects.append(Show(MARK_REJECTED, "turnguard: cooldown, answered 503 without "
                                           f"dispatching ({denial})"))
        answer = answers.cooldown_rejected(retry_after, req.circuit_threshold,
                                           accepts_sse=req.accepts_sse)
        return Respond(answer), tuple(effects)
    assert req.owner is not None  # fence_hold_denial says owner_proof_missing otherwise
    wait_s = min(fenced.remaining_s, remaining_budget)
    wait_ms = round(wait_s * 1000)
    return WaitCooldown(wait_s, req.owner.owner_epoch, now), (
        Emit("wait_operation_fenced_cooldown", {
            **base, "wait_ms": wait_ms, "cooldown_remaining_ms": round(fenced.remaining_s * 1000),
            "epoch": req.owner.owner_epoch,
        }),
        Show(MARK_COOLDOWN, f"turnguard: held through the retry circuit's cooldown ({wait_ms} "
                            "ms); nothing is sent upstream while it waits"),
    )


def _hold(req: RequestFacts, state: Admit, hold: policy.Hold, now: float) -> Transition:
    """Another attempt of the operation is in flight: hold (bounded), or 409 past the bound.
    A request held for peers (``request_held``) that is now held on an attempt becomes a
    duplicate's hold then: its ``duplicate_held`` is said (and counted) once, so that every
    end of a duplicate's hold has the record that began it."""
    effects: tuple[Effect, ...] = ()
    held_since, deadline = state.held_since, state.hold_deadline
    as_duplicate, after_turn_ended = state.held_as_duplicate, state.after_turn_ended
    if held_since is None or (not as_duplicate and hold.reason is None):
        if held_since is None:
            held_since = now
            after_turn_ended = hold.turn_ended
            deadline = policy.hold_deadline(now, hold_timeout_s=req.hold_timeout_s,
                                            budget_deadline=req.budget_deadline)
        timeout_ms = max(0, round((deadline - now) * 1000))
        as_duplicate = hold.reason is None
        if hold.reason is None:
            effects = (
                Emit("duplicate_held", {**req.base, "attempt": hold.attempt_id,
                                        "owner": hold.owner_instance, "timeout_ms": timeout_ms}),
                CountHeld(req.op_key),
                Show(MARK_HELD, f"turnguard: held as a duplicate of operation {req.op_id}, "
                                "waiting for its attempt in flight"),
            )
        else:  # no duplicate (yet): not counted as one
            effects = (
                Emit("request_held", {**req.base, "reason": hold.reason,
                                      "timeout_ms": timeout_ms}),
                Show(MARK_HELD, f"turnguard: held ({hold.reason}): the ledger file was "
                                "replaced, and processes that had turns in flight or recorded "
                                "in the old one have not registered them in the new one yet"),
            )
    if now >= deadline:
        return _reject_in_progress(req, held_since, now, effects)
    return HoldDuplicate(hold.attempt_id, held_since, deadline, state.recovery,
                         as_duplicate, after_turn_ended), effects


def _reject_refused(req: RequestFacts, refused: str, held_since: float, now: float) -> Transition:
    """The original ran upstream and the proxy refused its answer: run again, the duplicate
    would be refused the same way (one more upstream execution for nothing)."""
    held_ms = round((now - held_since) * 1000)
    return Respond(answers.response_refused(refused)), (
        Emit("duplicate_rejected", {**req.base, "held_ms": held_ms, "answer_status": 502,
                                    "code": "proxy_refused_response"}),
        Show(MARK_REJECTED, f"turnguard: held {held_ms} ms; the proxy refused the original's "
                            f"answer ({refused}): answered 502, not run again"),
    )


def _reject_in_progress(
    req: RequestFacts, held_since: float, now: float, effects: tuple[Effect, ...] = ()
) -> Transition:
    held_ms = round((now - held_since) * 1000)
    retry_after = policy.retry_after_seconds(1)
    return Respond(answers.turn_in_progress(retry_after, held_ms)), (
        *effects,
        Emit("duplicate_rejected", {**req.base, "held_ms": held_ms, "retry_after_s": retry_after,
                                    "answer_status": 409, "code": "turn_in_progress"}),
        Show(MARK_REJECTED, f"turnguard: held {held_ms} ms; the original was still in flight, "
                            "answered 409 turn_in_progress"),
    )


def on_woke(
    req: RequestFacts, state: HoldDuplicate | WaitCooldown, woke: Woke, now: float,
    *, gone: str | None = None,
) -> Transition:
    """A wait ended: ``woke`` says why; ``gone`` says why the client no longer wants an answer,
    if the shell found so when it woke (a client that left gets nothing dispatched)."""
    if isinstance(state, WaitCooldown):
        return _cooldown_ended(req, state, woke, now, gone)
    if isinstance(woke, Gone):
        gone = woke.reason
    match woke:
        case TimedOut():
            return _reject_in_progress(req, state.held_since, now)
        case _ if gone is not None:
            return _abandon(req, gone, state.held_since, now)
        case Ended(recording=recording) if recording is not None:
            return Replay(recording, round((now - state.held_since) * 1000), None), ()
        case Ended(refused=refused) if refused is not None:
            return _reject_refused(req, refused, state.held_since, now)
        case Attachable(live=live):
            held_ms = round((now - state.held_since) * 1000)
            return Attach(live, held_ms, state.attempt_id), (
                Emit("duplicate_attached", {**req.base, "attempt": state.attempt_id,
                                            "held_ms": held_ms}),
                Show(MARK_ATTACHED, f"turnguard: attached to the attempt of {req.op_id} in "
                                    f"flight after {held_ms} ms: its response so far, then the "
                                    "rest live; nothing was sent upstream"),
            )
        case _:  # ended without a recording: admit again (claim, replay or hold anew)
            return Admit(state.recovery, state.held_since, state.deadline,
                         state.as_duplicate, state.after_turn_ended), ()


def _cooldown_ended(
    req: RequestFacts, state: WaitCooldown, woke: Woke, now: float, gone: str | None
) -> Transition:
    reason = {TimedOut: "cooldown_elapsed", Gone: "gone", OwnershipLost: "ownership_lost"}.get(
        type(woke), "woken")
    finished = Emit("wait_finished", {**req.base, "waited_ms": round((now - state.since) * 1000),
                                      "reason": reason})
    if isinstance(woke, Gone):
        gone = woke.reason
    if gone is not None:
        abandon, effects = _abandon(req, gone, state.since, now)
        return abandon, (finished, *effects)
    match woke:
        case OwnershipLost(epoch=epoch):
            return FailClosed("ownership_lost"), (
                finished, Emit("ownership_lost", {**req.base, "epoch": epoch}))
    if now >= req.budget_deadline:
        return FailClosed("request_budget_expired"), (finished,)
    recovery = policy.RecoveryClaim(req.session, state.epoch,
                                    once=policy.recovery_is_once(req.recovery_mode))
    return Admit(recovery), (finished,)  # a new phase: a duplicate hold, if any


def _abandon(req: RequestFacts, reason: str, held_since: float, now: float) -> Transition:
    return Abandon(reason), (
        Emit("hold_abandoned", {**req.base, "reason": reason,
                                "held_ms": round((now - held_since) * 1000)}),
    )


def on_recording(
    req: RequestFacts, state: FetchRecording, recording: Recording | None, *, readable: bool
) -> Transition:
    """The recording to replay was read (``readable`` False: the store could not be read)."""
    if recording is not None:
        return Replay(recording, state.held_ms, state.attempt_id), ()
    if not readable or state.attempt_id is None:
        # it completed, but its bytes cannot be read now: never run it again
        return FailClosed("ledger_unavailable"), ()
    return PassThrough("recording missing"), (
        Emit("passthrough", {**req.base, "reason": "recording missing"}),
    )


def fail_closed(req: RequestFacts, state: FailClosed, remaining_s: float) -> Transition:
    """The 503 of ``FailClosed``, with ``remaining_s`` of cooldown left in its circuit."""
    retry_after = policy.retry_after_seconds(remaining_s)
    answer = answers.failed_closed(state.code, state.reason, retry_after,
                                   accepts_sse=req.accepts_sse)
    return Respond(answer), (
        Emit("fail_closed", {**req.base, "reason": state.reason, "code": state.code,
                             "retry_after_s": retry_after, "answer_status": 503}),
        Show(MARK_REJECTED, f"turnguard: failed closed with 503 {state.code} ({state.reason})"),
    )
