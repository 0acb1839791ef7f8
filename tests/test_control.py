"""Control actions at the ledger (a real SQLite file) and through the addon's commands:
clearing a circuit, releasing a session, their audit, and the once guarantee they must keep.
The same through real mitmdump processes and ``scripts/turnguard`` is in
``test_e2e_control.py``."""

from __future__ import annotations

import json

import pytest
from mitmproxy import exceptions

from turnguard_core import circuit, identity, policy
from turnguard_core.ledger import AttemptEnd, Ledger, LedgerError
from turnguard_core.ledger_admin import LedgerAdmin

GUARD = policy.GuardPolicy()
CFG = circuit.CircuitConfig(threshold=2, cooldown_s=60, cooldown_max_s=600)
T0 = 1_700_000_000.0


def ident(body: bytes = b'{"input": "x"}', session: str = "s1") -> identity.Identity:
    view = identity.RequestView(
        "POST", "/v1/responses",
        (("authorization", "Bearer k"), ("session-id", session), ("x-codex-turn-state", "ts1")),
        body,
    )
    out = identity.identify(view)
    assert isinstance(out, identity.Identity)
    return out


def scope_of(i: identity.Identity) -> str:
    return circuit.circuit_scope(i.session, i.scope, i.route)


def open_ledger(tmp_path, instance="a") -> LedgerAdmin:
    led = LedgerAdmin(str(tmp_path / "l.sqlite3"), instance)
    led.open(T0)
    return led


def admit(led, i, now, recovery=None, once=False):
    return led.admit(i, method="POST", path="/v1/responses", now=now, guard=GUARD, flow_id="f",
                     circuit_scope=scope_of(i), recovery=recovery, once_mode=once)


def fail(led, d, now):
    return led.finish(d.attempt_id, AttemptEnd("unknown", None, 0, "reset"), now=now,
                      circuit_cfg=CFG, eventless_failure=True)


def open_circuit(led, i, now=T0):
    fail(led, admit(led, i, now), now)
    assert fail(led, admit(led, i, now + 1), now + 1).transition == "opened"


@pytest.mark.parametrize("how", ["cooled down", "cleared"])
def test_in_once_mode_any_dispatch_after_the_circuit_opened_is_the_one_recovery(ledger_backend,
                                                                               how):
    """In once mode, the operation whose failures opened the circuit is dispatched at most
    once more, whoever sends it: a plain retry (another process's, one sent before the request
    held for the recovery claims it, or after the circuit was cleared) is counted as the
    recovery, so the held request's claim then finds it spent. On both stores."""
    led = ledger_backend.open("a", T0)
    i = ident()
    open_circuit(led, i)
    if how == "cleared":
        led.clear_circuits(None, now=T0 + 3, actor="test")
    at = T0 + 3.5 if how == "cleared" else T0 + 120
    first = admit(led, i, at, once=True)  # not the held request: no recovery claim
    assert first == policy.Dispatch("recovery", 3)
    fail(led, first, at + 1)
    owner, _ = led.claim_session(i.session, now=at + 2, lease_s=60, new_id="d")
    held = policy.RecoveryClaim(i.session, owner.owner_epoch, once=True)
    assert admit(led, i, at + 2, recovery=held, once=True) == policy.Denied(
        "upstream_operation_status_unknown", "claim_exhausted")
    assert admit(led, i, at + 3, once=True) == policy.Denied(
        "upstream_operation_status_unknown", "claim_exhausted")



def complete(led, d, now):
    return led.finish(d.attempt_id, AttemptEnd("completed", 200, 1, None), now=now,
                      circuit_cfg=CFG, eventless_failure=False)


@pytest.mark.parametrize("how", ["cooled down", "cleared"])
def test_in_once_mode_another_turn_completing_in_between_keeps_the_one_recovery(ledger_backend,
                                                                               how):
    """Another turn of the session completes once the cooldown is over (a completion resets
    the circuit): the first operation's next dispatch is still its one recovery. On both
    stores."""
    led = ledger_backend.open("a", T0)
    i, other = ident(), ident(b'{"input": "other turn"}')
    open_circuit(led, i)
    if how == "cleared":
        led.clear_circuits(None, now=T0 + 3, actor="test")
    at = T0 + 3.5 if how == "cleared" else T0 + 120
    done = complete(led, admit(led, other, at, once=True), at)
    assert done.transition == (None if how == "cleared" else "reset")  # cleared: closed already
    assert led.circuit_state(scope_of(i)).remaining_s(at + 1) == 0
    first = admit(led, i, at + 1, once=True)
    assert first == policy.Dispatch("recovery", 4)
    fail(led, first, at + 2)
    assert admit(led, i, at + 3, once=True) == policy.Denied(
        "upstream_operation_status_unknown", "claim_exhausted")

def test_clearing_an_open_circuit_lets_the_next_request_dispatch_and_is_audited(tmp_path):
    led = open_ledger(tmp_path)
    i = ident()
    open_circuit(led, i)
    assert isinstance(admit(led, i, T0 + 2), policy.Fenced)
    cleared = led.clear_circuits(scope_of(i)[:12], now=T0 + 3, actor="test")
    assert [r.scope for r in cleared] == [scope_of(i)] and cleared[0].state.failures == 2
    # closed: its cooldown ended at the clear (the time it did stays known, see below)
    assert led.circuit_state(scope_of(i)) == circuit.CircuitState(0, T0 + 3)
    assert admit(led, i, T0 + 4) == policy.Dispatch("retry", 3)
    (row,) = led.audit_log()
    assert (row["action"], row["target"], row["actor"]) == ("circuit_clear", scope_of(i), "test")
    assert json.loads(row["before"])["failures"] == 2 and json.loads(row["after"])["failures"] == 0


def test_clear_all_and_unknown_or_ambiguous_scopes(tmp_path):
    led = open_ledger(tmp_path)
    a, b = ident(session="s1"), ident(session="s2")
    open_circuit(led, a)
    fail(led, admit(led, b, T0), T0)  # one failure: counting, not open
    assert {r.scope for r in led.circuits(T0 + 2)} == {scope_of(a), scope_of(b)}
    with pytest.raises(LedgerError, match="no circuit"):
        led.clear_circuits("session:zzz", now=T0 + 2, actor="t")
    with pytest.raises(LedgerError, match="ambiguous"):
        led.clear_circuits("session:", now=T0 + 2, actor="t")
    assert len(led.clear_circuits(None, now=T0 + 2, actor="t")) == 2
    assert led.circuits(T0 + 2) == [] and led.clear_circuits(None, now=T0 + 3, actor="t") == []


def test_an_empty_scope_or_session_names_nothing_even_when_one_row_is_alone(tmp_path):
    led = open_ledger(tmp_path)
    i = ident()
    led.claim_session(i.session, now=T0, lease_s=300, new_id="d")
    open_circuit(led, i)  # the one circuit and the one session there are
    for blank in ("", "  "):
        with pytest.raises(LedgerError, match="empty"):
            led.clear_circuits(blank, now=T0 + 2, actor="t")
        with pytest.raises(LedgerError, match="empty"):
            led.release_session(blank, now=T0 + 2, actor="t")
    assert isinstance(admit(led, i, T0 + 3), policy.Fenced) and led.audit_log() == []


def test_in_once_mode_a_cleared_circuit_never_yields_a_second_recovery_dispatch(tmp_path):
    led = open_ledger(tmp_path)
    i = ident()
    owner, _ = led.claim_session(i.session, now=T0, lease_s=300, new_id="d")
    claim = policy.RecoveryClaim(i.session, owner.owner_epoch, once=True)
    open_circuit(led, i)
    led.clear_circuits(None, now=T0 + 2, actor="t")  # cleared while a request waited
    recovery = admit(led, i, T0 + 3, recovery=claim, once=True)
    assert recovery.kind == "recovery"
    fail(led, recovery, T0 + 4)  # the one recovery dispatch fails without events
    for n in range(3):  # cleared again and again: never a second dispatch of the operation
        led.clear_circuits(None, now=T0 + 5 + n, actor="t")
        assert admit(led, i, T0 + 5 + n, recovery=claim, once=True) == policy.Denied(
            "upstream_operation_status_unknown", "claim_exhausted")
        assert admit(led, i, T0 + 5 + n, once=True) == policy.Denied(
            "upstream_operation_status_unknown", "claim_exhausted")
    assert led.find_operation(i.op_key)["recovery_dispatches"] == 1


def test_releasing_a_session_fences_the_old_owner_and_lets_another_take_it_over(tmp_path):
    a = open_ledger(tmp_path, "a")
    b = LedgerAdmin(str(tmp_path / "l.sqlite3"), "b")
    b.open(T0)
    i = ident()
    owner, result = a.claim_session(i.session, now=T0, lease_s=300, new_id="d")
    assert result == "created" and owner.owner_epoch == 1
    assert b.claim_session(i.session, now=T0 + 1, lease_s=300, new_id="x")[1] == "owned_by_other"
    key, before, after = b.release_session(i.session[:10], now=T0 + 2, actor="op")
    assert key == i.session and before == owner
    assert (after.owner_instance, after.owner_epoch, after.lease_until) == ("", 2, T0 + 2)
    assert not a.renew_session(i.session, 1, now=T0 + 3, lease_s=300)  # the old epoch is fenced
    assert not a.session_owned_by(i.session, "a", 1)
    taken, result = b.claim_session(i.session, now=T0 + 3, lease_s=300, new_id="x")
    assert result == "taken_over" and taken.owner_epoch == 3 and taken.durable_id == "d"
    assert [r["action"] for r in b.audit_log()] == ["session_release"]
    with pytest.raises(LedgerError, match="no durable session"):
        b.release_session("zzz", now=T0 + 4, actor="op")


def test_a_control_tool_registers_no_instance(tmp_path):
    open_ledger(tmp_path).close()
    tool = LedgerAdmin(str(tmp_path / "l.sqlite3"), "cli")
    tool.open(T0 + 1, register=False)
    assert [r.instance_id for r in tool.instances()] == ["a"]


# -- the addon's commands ----------------------------------------------------------------------


async def test_the_commands_clear_a_circuit_and_release_a_session(tmp_path):
    from test_addon import make_guard

    async with make_guard(tmp_path, turnguard_metrics="127.0.0.1:0") as g:
        led = LedgerAdmin(str(tmp_path / "ledger.sqlite3"), "another process")  # the same file
        led.open(T0, register=False)
        i = ident()
        open_circuit(led, i, now=__import__("time").time())
        call = g.tctx.master.commands.call
        listed = json.loads(call("turnguard.circuit.list"))
        assert [c["scope"] for c in listed] == [scope_of(i)] and listed[0]["remaining_ms"] > 0
        with pytest.raises(exceptions.CommandError, match="no circuit"):
            call("turnguard.circuit.clear", "session:nope")
        assert json.loads(call("turnguard.circuit.clear", "all")) == {"cleared": [scope_of(i)]}
        assert json.loads(call("turnguard.circuit.list")) == []
        led.claim_session(i.session, now=T0, lease_s=300, new_id="d")
        out = json.loads(call("turnguard.session.release", i.session[:8]))
        assert out["released"] == i.session and out["epoch"] == 2
        assert [e["event"] for e in g.events() if e["event"].endswith(("cleared", "released"))] == [
            "circuit_cleared", "session_released"]
        assert [r["action"] for r in led.audit_log()] == ["session_release", "circuit_clear"]
        assert "turnguard.circuit.clear" in led.audit_log()[1]["actor"]
        scraped = {x.name: x.value for f in g.tg.metrics.registry.collect() for x in f.samples}
        assert scraped["turnguard_circuit_cleared_total"] == 1
