"""The retry circuit and the recovery decisions, pure."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnguard_core import circuit, policy
from turnguard_core.circuit import CircuitConfig, CircuitState, record_outcome

CFG = CircuitConfig(threshold=2, cooldown_s=60, cooldown_max_s=600)


def run(outcomes, cfg=CFG, now=0.0):
    state, transitions = CircuitState(), []
    for o in outcomes:
        state, t = record_outcome(state, eventless_failure=o == "unknown",
                                  completed=o == "completed", now=now, cfg=cfg)
        transitions.append(t)
    return state, transitions


def test_threshold_opens_and_each_further_failure_doubles_up_to_the_max():
    state, transitions = run(["unknown"] * 7)
    assert transitions == [None, "opened", "opened", "opened", "opened", "opened", "opened"]
    assert [circuit.cooldown_for(n, CFG) for n in range(2, 8)] == [60, 120, 240, 480, 600, 600]
    assert state.remaining_s(0) == 600 and state.failures == 7


def test_completed_resets_and_other_outcomes_leave_it():
    state, transitions = run(["unknown", "rejected", "partial", "unknown", "completed"])
    assert transitions == [None, None, None, "opened", "reset"]
    # closed, no failures; the end of its last cooldown is kept (now), as a clear keeps it:
    # once mode reads from it that the circuit opened after an operation's last attempt
    assert state == CircuitState(0, 0.0, None) and state.remaining_s(0.0) == 0
    assert run(["unknown", "unknown", "completed", "completed"])[1][-1] is None  # reset once
    assert run(["completed"])[1] == [None]  # nothing to reset


def test_cooldown_is_absolute_time():
    state, _ = run(["unknown", "unknown"], now=100.0)
    assert state.remaining_s(130.0) == 30.0 and state.remaining_s(161.0) == 0.0


@given(st.lists(st.sampled_from(["unknown", "completed", "rejected", "partial"]), max_size=40))
def test_open_iff_the_tail_has_threshold_eventless_failures_since_the_last_completion(outcomes):
    state, _ = run(outcomes)
    tail = outcomes[len(outcomes) - outcomes[::-1].index("completed"):] if "completed" in outcomes else outcomes
    failures = tail.count("unknown")
    assert state.failures == failures
    assert (state.remaining_s(0) > 0) == (failures >= CFG.threshold)
    assert state.remaining_s(0) <= CFG.cooldown_max_s


def test_scope_is_the_session_else_credential_and_route():
    assert circuit.circuit_scope("abc", "cred", "/v1/responses") == "session:abc"
    a = circuit.circuit_scope(None, "cred", "/v1/responses?x=1")
    assert a == circuit.circuit_scope(None, "cred", "/v1/responses")
    assert a != circuit.circuit_scope(None, "cred2", "/v1/responses")
    assert a != circuit.circuit_scope(None, "cred", "/v1/chat/completions")


def snap(**kw):
    base = dict(state="unknown", fingerprint="f", current_attempt=1, owner_instance="me",
                ended_at=0.0, replay_attempt=None, events_seen=0, recovery_dispatches=0)
    return policy.OperationSnapshot(**(base | kw))


def admit(s, **kw):
    return policy.admit(s, fingerprint="f", has_idempotency_key=False, now=10.0,
                        policy=policy.GuardPolicy(), **kw)


def test_fenced_only_where_a_dispatch_would_happen():
    assert admit(snap(), circuit_remaining_s=5) == policy.Fenced(5, False)
    assert admit(snap(events_seen=2), circuit_remaining_s=5) == policy.Fenced(5, True)
    assert isinstance(admit(snap(state="in_flight"), circuit_remaining_s=5), policy.Hold)
    assert isinstance(admit(snap(state="completed", replay_attempt=1), circuit_remaining_s=5),
                      policy.Replay)


def test_recovery_claims():
    assert admit(snap(), recovery_once=True) == policy.Dispatch("recovery")
    assert admit(snap(recovery_dispatches=1), recovery_once=True) == policy.Denied(
        "upstream_operation_status_unknown", "claim_exhausted")
    assert admit(snap(recovery_dispatches=5), recovery_once=False) == policy.Dispatch("recovery")
    assert admit(snap(), recovery_once=True, owner_ok=False).reason == "ownership_lost"
    assert admit(snap(events_seen=1), recovery_once=False).reason == "output_exists"
    assert admit(snap(), recovery_once=True, circuit_remaining_s=3) == policy.Fenced(3, False)


@pytest.mark.parametrize("state", ["unknown", "partial"])
def test_once_mode_never_dispatches_an_operation_whose_recovery_had_no_known_result(state):
    exhausted = policy.Denied("upstream_operation_status_unknown", "claim_exhausted")
    assert admit(snap(state=state, recovery_dispatches=1), once_mode=True) == exhausted
    assert admit(snap(state=state, recovery_dispatches=1), once_mode=True,
                 circuit_remaining_s=9) == exhausted
    assert admit(snap(state=state, recovery_dispatches=1)) == policy.Dispatch("retry")
    assert admit(snap(state="rejected", recovery_dispatches=1), once_mode=True) == \
        policy.Dispatch("retry")


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(mode="fail_closed"), "mode_fail_closed"),
        (dict(has_previous_response_id=True), "previous_response_id"),
        (dict(has_turn_state=False), "no_turn_state_anchor"),
        (dict(output_seen=True), "output_exists"),
        (dict(owns_session=False), "owner_proof_missing"),
        (dict(), None),
    ],
)
def test_fence_hold_denial(kw, reason):
    args = dict(mode="server_anchored_replay_once", has_turn_state=True,
                has_previous_response_id=False, owns_session=True, output_seen=False) | kw
    mode = args.pop("mode")
    assert policy.fence_hold_denial(mode, **args) == reason


def test_session_claims_renew_take_over_and_fence():
    row, r = policy.claim_session(None, instance="a", now=0, lease_s=10, new_id="d")
    assert (r, row.owner_epoch, row.lease_until) == ("created", 1, 10)
    row2, r = policy.claim_session(row, instance="a", now=5, lease_s=10, new_id="x")
    assert (r, row2.owner_epoch, row2.lease_until, row2.durable_id) == ("renewed", 1, 15, "d")
    same, r = policy.claim_session(row2, instance="b", now=14, lease_s=10, new_id="x")
    assert r == "owned_by_other" and same == row2
    taken, r = policy.claim_session(row2, instance="b", now=15, lease_s=10, new_id="x")
    assert (r, taken.owner_epoch, taken.owner_instance, taken.durable_id) == ("taken_over", 2, "b", "d")


@pytest.mark.parametrize(
    "kw, cls",
    [
        (dict(cut_reason="missing_response_created_timeout"), "missing_response_created_timeout"),
        (dict(error="Client disconnected."), "client_abort"),
        (dict(error="Connection killed."), "killed"),
        (dict(status=200, error="Connection killed."), "killed"),
        (dict(error="Connection refused"), "connection_error"),
        (dict(error="server closed connection"), "upstream_closed_before_headers"),
        (dict(status=200, body_complete=True), "upstream_clean_close"),
        (dict(status=200, error="peer closed connection"), "upstream_closed_after_headers"),
    ],
)
def test_failure_class(kw, cls):
    args = dict(cut_reason=None, status=None, error=None, body_complete=False) | kw
    assert policy.failure_class(**args) == cls
    assert policy.counts_for_circuit(cls) == (cls not in ("client_abort", "killed"))


def test_the_killed_message_is_mitmproxys():
    from mitmproxy import flow

    assert policy.KILLED_MESSAGE == flow.Error.KILLED_MESSAGE
