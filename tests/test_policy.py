"""The guard's pure decisions: admission, outcome classification, bounds."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnguard_core import answers, policy
from turnguard_core.policy import Conflict, Dispatch, GuardPolicy, Hold, OperationSnapshot, Replay

P = GuardPolicy(replay=True, replay_window_s=300, retention_s=86400)


def snap(state, *, fp="fp", ended_at=100.0, replay_attempt=7, current=7, owner="me"):
    return OperationSnapshot(state, fp, current, owner, ended_at, replay_attempt)


def admit(s, *, fp="fp", idem=False, now=200.0, p=P):
    return policy.admit(s, fingerprint=fp, has_idempotency_key=idem, now=now, policy=p)


def test_new_operation_is_dispatched_as_original():
    assert admit(None) == Dispatch("original")


def test_in_flight_operation_holds_with_its_attempt_and_owner():
    assert admit(snap("in_flight", current=3, owner="other")) == Hold(3, "other")


def test_completed_within_window_replays_and_past_window_is_a_new_original():
    assert admit(snap("completed"), now=100.0 + 300) == Replay(7)
    assert admit(snap("completed"), now=100.0 + 300.5) == Dispatch("original")


def test_idempotency_key_replays_within_retention_not_only_the_window():
    assert admit(snap("completed"), idem=True, now=100.0 + 3600) == Replay(7)
    assert admit(snap("completed"), idem=True, now=100.0 + 86401) == Dispatch("original")


def test_idempotency_key_with_another_body_is_a_conflict_in_any_state():
    for state in ("in_flight", "completed", "rejected", "unknown", "partial"):
        assert admit(snap(state, fp="a"), fp="b", idem=True) == Conflict()


def test_replay_off_or_unrecorded_completion_dispatches_again():
    assert admit(snap("completed"), p=GuardPolicy(replay=False)) == Dispatch("original")
    assert admit(snap("completed", replay_attempt=None)) == Dispatch("original")


@pytest.mark.parametrize("state", ["rejected", "partial", "unknown"])
def test_failed_attempts_are_retried(state):
    assert admit(snap(state)) == Dispatch("retry")


@given(
    state=st.sampled_from(["in_flight", "completed", "rejected", "partial", "unknown"]),
    idem=st.booleans(),
    same_body=st.booleans(),
    age=st.floats(0, 200000),
)
def test_replay_only_for_completed_recordings_of_the_same_body(state, idem, same_body, age):
    s = snap(state, fp="a")
    decision = admit(s, fp="a" if same_body or not idem else "b", idem=idem, now=100.0 + age)
    if isinstance(decision, Replay):
        assert state == "completed" and (same_body or not idem)
        assert age <= (P.retention_s if idem else P.replay_window_s)
    if state == "in_flight" and not (idem and not same_body):
        assert isinstance(decision, Hold)


@pytest.mark.parametrize(
    "kw, outcome",
    [
        (dict(status=None, events_seen=0), "unknown"),
        (dict(status=None, events_seen=3), "partial"),
        (dict(status=429, events_seen=0), "rejected"),
        (dict(status=500, events_seen=0), "rejected"),
        (dict(status=200, events_seen=5, terminal="success"), "completed"),
        (dict(status=200, events_seen=5, terminal="failure"), "partial"),
        (dict(status=200, events_seen=5), "partial"),
        (dict(status=200, events_seen=0), "unknown"),
        (dict(status=200, events_seen=0, counts_events=False), "completed"),
        (dict(status=200, events_seen=0, counts_events=False, body_complete=False), "unknown"),
    ],
)
def test_classify_outcome(kw, outcome):
    args = dict(terminal=None, body_complete=True, counts_events=True) | kw
    assert policy.classify_outcome(**args) == outcome


def test_hold_deadline_is_the_earlier_bound():
    assert policy.hold_deadline(10.0, hold_timeout_s=30, budget_deadline=130.0) == 40.0
    assert policy.hold_deadline(10.0, hold_timeout_s=30, budget_deadline=15.0) == 15.0


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_retry_after_is_a_whole_second_at_least_one(x):
    r = policy.retry_after_seconds(x)
    assert isinstance(r, int) and r >= 1


def test_turn_in_progress_answer_shape():
    import json

    a = answers.turn_in_progress(3, 1500)
    assert a.status == 409
    h = dict(a.headers)
    assert h["retry-after"] == "3" and h["x-should-retry"] == "true"
    err = json.loads(a.body)["error"]
    assert err["type"] == err["code"] == "turn_in_progress" and err["message"]


def _once_retry(recovery_dispatches, *, circuit_open_until=150.0):
    s = OperationSnapshot("rejected", "fp", 7, "me", 100.0, None,
                          recovery_dispatches=recovery_dispatches)
    return policy.admit(s, fingerprint="fp", has_idempotency_key=False, now=200.0, policy=P,
                        once_mode=True, circuit_open_until=circuit_open_until)


def test_in_once_mode_a_retry_after_the_circuit_opened_is_the_one_recovery_and_never_a_second():
    """A retry of an operation without output whose circuit opened after its last end is its
    one recovery; once that recovery was used (it ended with an error status, so the operation
    is not spent), the next circuit to open must not give it a second one."""
    assert _once_retry(0) == Dispatch("recovery")
    assert _once_retry(1) == policy.Denied("upstream_operation_status_unknown", "claim_exhausted")
    assert _once_retry(1, circuit_open_until=90.0) == Dispatch("retry")


def test_a_conversation_turn_sent_again_unheld_and_without_a_key_is_admitted_without_replay():
    guard = policy.GuardPolicy(replay=True, replay_window_s=300.0, retention_s=86400.0)
    plain = policy.admission_replay(guard, idempotency_key=False, conversation=False, held=False)
    assert plain == (guard, 300.0)
    assert policy.admission_replay(guard, idempotency_key=True, conversation=False,
                                   held=False) == (guard, 86400.0)
    next_turn = policy.admission_replay(guard, idempotency_key=False, conversation=True,
                                        held=False)
    assert next_turn[0].replay is False and next_turn[1] is None
    for key, held in ((True, False), (False, True)):  # a key, or held on it while it ran
        assert policy.admission_replay(guard, idempotency_key=key, conversation=True,
                                       held=held)[0] == guard
    off = policy.GuardPolicy(replay=False)
    assert policy.admission_replay(off, idempotency_key=True, conversation=False,
                                   held=False) == (off, None)
