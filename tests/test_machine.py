"""The request machine's transitions, one by one (in the style of h11's ``test_state.py``):
each state, each event that moves it, the next state and the effects it asks to show. Pure:
no proxy, clock or disk; times are numbers."""

from __future__ import annotations

import pytest

from turnguard_core import answers, machine, policy
from turnguard_core.ledger import Recording
from turnguard_core.machine import (
    Abandon,
    Admit,
    CountHeld,
    Emit,
    Ended,
    FailClosed,
    FetchRecording,
    Forward,
    Gone,
    HoldDuplicate,
    OwnershipLost,
    PassThrough,
    Replay,
    Respond,
    Show,
    TimedOut,
    WaitCooldown,
)

NOW = 100.0
OWNER = policy.SessionOwnership("durable", "me", 3, NOW + 300)
REC = Recording(200, (("content-type", "text/event-stream"),), b"data: x\n\n")


def facts(**changes) -> machine.RequestFacts:
    base = dict(op_id="op1", op_key="opkey1", flow_id="flow1", session="s1",
                has_turn_state=True, has_previous_response_id=False, accepts_sse=False,
                budget_deadline=NOW + 120, hold_timeout_s=30.0,
                recovery_mode="server_anchored_replay_once", circuit_threshold=2, owner=OWNER)
    return machine.RequestFacts(**{**base, **changes})


def events(effects) -> list[str]:
    return [e.event for e in effects if isinstance(e, Emit)]


def record(effects, event: str) -> dict:
    return next(e.fields for e in effects if isinstance(e, Emit) and e.event == event)


# -- Admit ---------------------------------------------------------------------------------------


def test_every_request_starts_by_asking_the_store():
    assert machine.start() == Admit()


@pytest.mark.parametrize("kind", ["original", "retry"])
def test_a_dispatch_is_forwarded_and_said(kind):
    state, effects = machine.on_admission(facts(), Admit(), policy.Dispatch(kind, 7), NOW,
                                          ledger_down=None)
    assert state == Forward(policy.Dispatch(kind, 7))
    assert events(effects) == ["dispatch"]
    assert record(effects, "dispatch") == {"op": "op1", "flow": "flow1", "session": "s1", "transport": "http",
                                           "attempt": 7, "kind": kind, "ledger": True}


def test_a_dispatch_after_a_hold_is_a_forwarded_duplicate():
    state, effects = machine.on_admission(facts(), Admit(None, NOW - 2.5, NOW + 27.5),
                                          policy.Dispatch("retry", None), NOW, ledger_down="x")
    assert isinstance(state, Forward)
    assert events(effects) == ["dispatch", "duplicate_forwarded"]
    assert record(effects, "duplicate_forwarded")["held_ms"] == 2500
    assert record(effects, "dispatch")["ledger"] is False


def test_a_recovery_dispatch_names_its_epoch():
    claim = policy.RecoveryClaim("s1", 3, once=True)
    state, effects = machine.on_admission(facts(), Admit(claim), policy.Dispatch("recovery", 9),
                                          NOW, ledger_down=None)
    assert isinstance(state, Forward)
    assert events(effects) == ["dispatch", "recovery_claimed"]
    assert record(effects, "recovery_claimed")["epoch"] == 3
    assert any(isinstance(e, Show) and "recovery dispatch" in e.comment for e in effects)


@pytest.mark.parametrize("admission, attempt", [(policy.Replay(4), 4),
                                                (policy.ReplayFromMemory(), None)])
def test_a_replay_first_fetches_the_recording(admission, attempt):
    state, effects = machine.on_admission(facts(), Admit(), admission, NOW, ledger_down=None)
    assert state == FetchRecording(attempt, 0) and effects == ()


def test_a_reused_idempotency_key_is_422():
    state, effects = machine.on_admission(facts(), Admit(), policy.Conflict(), NOW,
                                          ledger_down=None)
    assert state == Respond(answers.idempotency_key_conflict())
    assert record(effects, "idempotency_key_conflict")["answer_status"] == 422


def test_a_denied_claim_fails_closed_with_its_code():
    denied = policy.Denied("upstream_operation_status_unknown", "claim_exhausted")
    state, effects = machine.on_admission(facts(), Admit(), denied, NOW, ledger_down=None)
    assert state == FailClosed("claim_exhausted", "upstream_operation_status_unknown")
    assert events(effects) == ["recovery_denied"]


# -- Admit -> Fenced ---------------------------------------------------------------------------


def test_fail_closed_mode_answers_503_during_a_cooldown():
    state, effects = machine.on_admission(facts(recovery_mode="fail_closed"), Admit(),
                                          policy.Fenced(12.2, False), NOW, ledger_down=None)
    assert isinstance(state, Respond) and state.answer.status == 503
    assert ("retry-after", "13") in state.answer.headers
    assert events(effects) == ["cooldown_rejected"]  # the mode's own answer: no fail_closed
    assert record(effects, "cooldown_rejected")["reason"] == "mode_fail_closed"


@pytest.mark.parametrize("change, reason", [
    (dict(has_previous_response_id=True), "previous_response_id"),
    (dict(has_turn_state=False), "no_turn_state_anchor"),
    (dict(owner=None), "owner_proof_missing"),
    (dict(budget_deadline=NOW), "request_budget_expired"),
])
def test_an_ineligible_request_fails_closed_during_a_cooldown(change, reason):
    state, effects = machine.on_admission(facts(**change), Admit(), policy.Fenced(5, False),
                                          NOW, ledger_down=None)
    assert isinstance(state, Respond) and state.answer.status == 503
    assert events(effects) == ["cooldown_rejected", "fail_closed"]
    assert record(effects, "fail_closed")["reason"] == reason


def test_without_a_ledger_missing_owner_proof_says_the_ledger_is_why():
    state, effects = machine.on_admission(facts(owner=None), Admit(), policy.Fenced(5, False),
                                          NOW, ledger_down="database is locked")
    assert state == FailClosed("ledger_unavailable")
    assert record(effects, "ledger_unavailable") == {
        "op": "op1", "flow": "flow1", "session": "s1", "transport": "http", "during": "recovery_decision",
        "error": "database is locked"}


def test_an_eligible_request_is_held_through_the_cooldown_within_its_budget():
    state, effects = machine.on_admission(facts(budget_deadline=NOW + 4), Admit(),
                                          policy.Fenced(10, False), NOW, ledger_down=None)
    assert state == WaitCooldown(4, 3, NOW)  # the budget is shorter than the cooldown
    assert record(effects, "wait_operation_fenced_cooldown")["wait_ms"] == 4000
    assert any(isinstance(e, Show) and e.mark == machine.MARK_COOLDOWN for e in effects)


# -- Admit -> Hold ---------------------------------------------------------------------------------


def test_a_duplicate_is_held_until_its_bound_and_counted():
    state, effects = machine.on_admission(facts(), Admit(), policy.Hold(5, "peer"), NOW,
                                          ledger_down=None)
    assert state == HoldDuplicate(5, NOW, NOW + 30)
    assert events(effects) == ["duplicate_held"]
    assert CountHeld("opkey1") in effects
    assert record(effects, "duplicate_held")["timeout_ms"] == 30000


def test_a_duplicate_admitted_again_keeps_its_hold_and_says_nothing_new():
    state, effects = machine.on_admission(facts(), Admit(None, NOW - 10, NOW + 20),
                                          policy.Hold(6, "peer"), NOW, ledger_down=None)
    assert state == HoldDuplicate(6, NOW - 10, NOW + 20) and effects == ()


def test_a_duplicate_past_its_bound_is_409_with_retry_after():
    state, effects = machine.on_admission(facts(hold_timeout_s=0), Admit(),
                                          policy.Hold(5, "peer"), NOW, ledger_down=None)
    assert isinstance(state, Respond) and state.answer.status == 409
    assert events(effects) == ["duplicate_held", "duplicate_rejected"]


@pytest.mark.parametrize("turn_ended", [False, True])
def test_a_request_held_for_the_peers_counts_as_held_before_the_turn_ended_unless_it_came_after(
        turn_ended):
    """Held for the peers to register (``PEERS_REGISTERING``), a request counts as held before
    its operation's turn ended (a duplicate: replayed from that turn) unless the file left
    showed that turn ended before it came; held on an attempt afterwards, it does again."""
    peers = policy.Hold(None, None, policy.PEERS_REGISTERING, turn_ended=turn_ended)
    state, _ = machine.on_admission(facts(), Admit(), peers, NOW, ledger_down=None)
    assert isinstance(state, HoldDuplicate) and not state.as_duplicate
    again, _ = machine.on_woke(facts(), state, Ended("unknown"), NOW + 1)
    assert again == Admit(None, NOW, NOW + 30, False, turn_ended)
    assert again.held_before_turn_ended is not turn_ended
    held, _ = machine.on_admission(facts(), again, peers, NOW + 2, ledger_down=None)
    assert held.after_turn_ended is turn_ended  # (its first hold says)
    on_attempt, _ = machine.on_admission(facts(), again, policy.Hold(5, "peer"), NOW + 2,
                                         ledger_down=None)
    after, _ = machine.on_woke(facts(), on_attempt, Ended("unknown"), NOW + 3)
    assert after.held_before_turn_ended
    assert not machine.start().held_before_turn_ended


@pytest.mark.parametrize("as_duplicate", [True, False])
def test_a_request_dispatched_after_its_hold_is_a_duplicate_forwarded_only_if_held_as_one(
        as_duplicate):
    """Dispatched after a hold, a request counts as a duplicate forwarded
    (``duplicate_forwarded``) only when it was held as one: one held for the peers alone
    (``request_held``: no duplicate, not counted as one) is dispatched without it."""
    held = Admit(None, NOW - 2, NOW + 28, as_duplicate)
    _, effects = machine.on_admission(facts(), held, policy.Dispatch("retry", 7), NOW,
                                      ledger_down=None)
    emitted = [e.event for e in effects if isinstance(e, machine.Emit)]
    assert emitted == (["dispatch", "duplicate_forwarded"] if as_duplicate else ["dispatch"])
    assert any(isinstance(e, machine.Show) and "held 2000 ms" in e.comment for e in effects)


# -- HoldDuplicate --------------------------------------------------------------------------------


HOLD = HoldDuplicate(5, NOW - 3, NOW + 27)


def test_the_original_completed_the_duplicate_is_replayed():
    state, effects = machine.on_woke(facts(), HOLD, Ended("completed", REC), NOW)
    assert state == Replay(REC, 3000, None) and effects == ()


@pytest.mark.parametrize("outcome", ["unknown", "partial", "rejected", "gone"])
def test_the_original_ended_without_a_recording_the_duplicate_is_admitted_again(outcome):
    state, effects = machine.on_woke(facts(), HOLD, Ended(outcome), NOW)
    assert state == Admit(None, NOW - 3, NOW + 27) and effects == ()


def test_a_stream_in_flight_here_is_attached_to_and_says_so():
    live = object()  # the shell's handle: opaque to the machine
    state, effects = machine.on_woke(facts(), HOLD, machine.Attachable(live), NOW)
    assert state == machine.Attach(live, 3000, 5)
    assert record(effects, "duplicate_attached")["held_ms"] == 3000
    assert any(isinstance(e, machine.Show) and e.mark == machine.MARK_ATTACHED for e in effects)


def test_a_client_gone_when_the_stream_starts_is_abandoned_not_attached():
    state, _ = machine.on_woke(facts(), HOLD, machine.Attachable(object()), NOW,
                               gone="client disconnected")
    assert isinstance(state, Abandon)


def test_the_bound_passed_409():
    state, _ = machine.on_woke(facts(), HOLD, TimedOut(), NOW)
    assert isinstance(state, Respond) and state.answer.status == 409


@pytest.mark.parametrize("woke, gone", [(Gone("killed"), None),
                                        (Ended("unknown"), "client disconnected")])
def test_a_client_gone_is_abandoned_never_dispatched(woke, gone):
    state, effects = machine.on_woke(facts(), HOLD, woke, NOW, gone=gone)
    assert isinstance(state, Abandon)
    assert record(effects, "hold_abandoned")["held_ms"] == 3000


# -- WaitCooldown ---------------------------------------------------------------------------------


WAIT = WaitCooldown(10, 3, NOW - 10)


def test_after_the_cooldown_a_recovery_claim_with_the_epoch():
    state, effects = machine.on_woke(facts(), WAIT, TimedOut(), NOW)
    assert state == Admit(policy.RecoveryClaim("s1", 3, once=True))
    assert record(effects, "wait_finished") == {"op": "op1", "flow": "flow1", "session": "s1", "transport": "http",
                                                "waited_ms": 10000, "reason": "cooldown_elapsed"}


def test_indefinite_mode_claims_without_the_once_limit():
    state, _ = machine.on_woke(facts(recovery_mode="server_indefinite_recovery"), WAIT,
                               TimedOut(), NOW)
    assert state == Admit(policy.RecoveryClaim("s1", 3, once=False))


def test_ownership_lost_fails_closed():
    state, effects = machine.on_woke(facts(), WAIT, OwnershipLost(4), NOW)
    assert state == FailClosed("ownership_lost")
    assert events(effects) == ["wait_finished", "ownership_lost"]


def test_the_budget_spent_during_the_cooldown_fails_closed():
    state, _ = machine.on_woke(facts(budget_deadline=NOW), WAIT, TimedOut(), NOW)
    assert state == FailClosed("request_budget_expired")


def test_a_client_gone_during_the_cooldown_is_abandoned_and_the_wait_said_first():
    state, effects = machine.on_woke(facts(), WAIT, TimedOut(), NOW, gone="client disconnected")
    assert isinstance(state, Abandon)
    assert events(effects) == ["wait_finished", "hold_abandoned"]
    assert record(effects, "wait_finished")["reason"] == "cooldown_elapsed"


# -- FetchRecording and FailClosed ------------------------------------------------------------


def test_a_recording_read_is_replayed():
    state, _ = machine.on_recording(facts(), FetchRecording(4, 12), REC, readable=True)
    assert state == Replay(REC, 12, 4)


def test_a_recording_that_cannot_be_read_fails_closed_never_runs_again():
    assert machine.on_recording(facts(), FetchRecording(4, 0), None, readable=False)[0] == \
        FailClosed("ledger_unavailable")
    assert machine.on_recording(facts(), FetchRecording(None, 0), None, readable=True)[0] == \
        FailClosed("ledger_unavailable")


def test_a_recording_purged_meanwhile_passes_the_request_through():
    state, effects = machine.on_recording(facts(), FetchRecording(4, 0), None, readable=True)
    assert state == PassThrough("recording missing")
    assert record(effects, "passthrough")["reason"] == "recording missing"


def test_fail_closed_is_503_with_the_cooldown_left_as_retry_after():
    state, effects = machine.fail_closed(facts(accepts_sse=True), FailClosed("ownership_lost"),
                                         remaining_s=7.5)
    assert isinstance(state, Respond) and state.answer.status == 503
    assert ("retry-after", "8") in state.answer.headers
    assert ("content-type", "text/event-stream") in state.answer.headers
    assert record(effects, "fail_closed") == {
        "op": "op1", "flow": "flow1", "session": "s1", "transport": "http", "reason": "ownership_lost",
        "code": "upstream_request_timeout", "retry_after_s": 8, "answer_status": 503}


# -- every path ends ---------------------------------------------------------------------------


def test_every_state_is_a_terminal_or_moved_by_exactly_one_transition():
    waiting = {HoldDuplicate, WaitCooldown}
    moved = {Admit: machine.on_admission, FetchRecording: machine.on_recording,
             FailClosed: machine.fail_closed, **{w: machine.on_woke for w in waiting}}
    terminal = set(machine.Terminal.__args__) - {FailClosed}
    states = set(machine.State.__args__) | set(machine.Terminal.__args__)
    assert states == set(moved) | terminal
