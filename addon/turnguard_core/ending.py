"""How an upstream attempt ended, decided from facts (pure: no proxy, clock or disk).

The shell collects what it saw of the attempt (``EndFacts``: status, events counted by the tee,
whether the body came whole, the kept copy, why the connection ended) and ``classify_end``
says what that means: the outcome, the recording to keep (when it may be replayed), the
eventless failure that feeds the retry circuit, and the telemetry to emit. The shell then
writes it to the store and wakes the attempt's held duplicates.
"""

from __future__ import annotations

from typing import Any, Literal

from . import negotiation, policy
from .ledger import Recording
from .machine import Emit
from .records import record
from .tee import recordable_headers


@record
class EndFacts:
    """What the shell saw of one attempt's end."""

    kind: str  # original, retry, recovery
    status: int | None  # None: no response headers arrived
    events_seen: int
    terminal: Literal["success", "failure"] | None
    counts_events: bool  # an SSE stream the tee could read
    body_complete: bool  # the whole body arrived (as far as the transport says)
    kept_body: bytes | None  # the copy kept for replay (None: not kept)
    over_cap: bool  # not kept: larger than turnguard_replay_max_bytes
    response_headers: tuple[tuple[str, str], ...]
    request_headers: tuple[tuple[str, str], ...]
    error: str | None  # why the connection ended early (mitmproxy's message)
    cut_reason: str | None  # turnguard cut the upstream itself (e.g. no event in time)
    client_gone: bool
    transport: str = "http"  # or "ws": a call on a WebSocket
    failed_event: str | None = None  # "error" / "response.failed" that ended it (WebSocket)
    not_recordable: str | None = None  # why its response must not answer its operation's
    # duplicates whatever it is (the request sent is not the one identified)
    never_sent: bool = False  # killed before its request went upstream: it did not run


@record
class AttemptEnding:
    outcome: policy.Outcome
    recording: Recording | None  # the response to replay to its duplicates, if any
    failure: str | None  # the eventless failure's class, when the outcome is unknown
    eventless: bool  # it counts towards the retry circuit
    detail: str | None
    not_replayable_reason: str | None  # a completed response that is not kept, and why

    @property
    def spends_once_claim(self) -> bool:
        """A recovery that ends like this has used its operation's one recovery for good."""
        return self.outcome in policy.SPENT_OUTCOMES

    @property
    def record_detail(self) -> str | None:
        """What the ledger keeps as the attempt's detail."""
        return self.failure or self.detail


def classify_end(facts: EndFacts, credential_headers: tuple[str, ...] = ()) -> AttemptEnding:
    """What the attempt's end means. ``credential_headers``: the credential-bearing header
    names configured beyond the built-in ones, never kept in a recording. An attempt killed
    before its request went upstream (``never_sent``) did not run: ``rejected``, as a claim
    given back is (no eventless failure; in once mode it spends no recovery)."""
    if facts.never_sent:
        return AttemptEnding(outcome="rejected", recording=None, failure=None, eventless=False,
                             detail=f"{facts.error} (before it went upstream)",
                             not_replayable_reason=None)
    outcome = policy.classify_outcome(
        status=facts.status, events_seen=facts.events_seen, terminal=facts.terminal,
        body_complete=facts.body_complete, counts_events=facts.counts_events,
    )
    recording, not_recorded = None, facts.not_recordable
    if outcome == "completed" and facts.kept_body is not None and not_recorded is None:
        headers = recordable_headers(facts.response_headers, credential_headers)
        vary = negotiation.vary_names(headers)
        if vary is None:
            not_recorded = "Vary: *"
        else:
            recording = Recording(facts.status, headers, facts.kept_body,
                                  negotiation.vary_key(vary, facts.request_headers))
    failure = None
    if outcome == "unknown":
        failure = policy.failure_class(
            cut_reason=facts.cut_reason, status=facts.status, error=facts.error,
            body_complete=facts.body_complete, client_gone=facts.client_gone,
            transport=facts.transport, failed_event=facts.failed_event,
        )
    why_not = None
    if recording is None and outcome == "completed":
        why_not = not_recorded or (
            "over turnguard_replay_max_bytes" if facts.over_cap else "replay off")
    return AttemptEnding(
        outcome=outcome, recording=recording, failure=failure,
        eventless=failure is not None and policy.counts_for_circuit(failure),
        detail=facts.error, not_replayable_reason=why_not,
    )


def end_telemetry(
    ending: AttemptEnding, facts: EndFacts, base: dict[str, Any], *, attempt_id: int | None,
    duration_ms: int, first_event_ms: float | None = None,
) -> tuple[Emit, ...]:
    """The ``outcome`` record, and an ``eventless_failure`` one when it is one."""
    records = [Emit("outcome", {
        **base, "attempt": attempt_id, "kind": facts.kind, "outcome": ending.outcome,
        "events_seen": facts.events_seen, "status": facts.status, "duration_ms": duration_ms,
        "first_event_ms": first_event_ms, "replayable": ending.recording is not None, "detail": ending.detail,
        "not_replayable_reason": ending.not_replayable_reason,
    })]
    if ending.failure is not None:
        records.append(Emit("eventless_failure", {
            **base, "failure_class": ending.failure, "events_seen": facts.events_seen,
            "status": facts.status, "counts_for_circuit": ending.eventless,
            "detail": ending.detail,
        }))
    return tuple(records)
