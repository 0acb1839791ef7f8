"""Stateful property test of the circuit and recovery claims: the real request machine
(``turnguard_core.machine``) with the real ledger as its store (each store in turn: SQLite and
PostgreSQL), driven with an injected clock against a simple model.

Requests arrive for a few operations of one durable session (hard turn-state anchored, so in
once mode they are held through a cooldown); attempts end completed or eventless; time moves.
Checked after every step: at most one recovery dispatch per operation, never a dispatch while
the model's circuit is open, at most one attempt in flight per operation; and at the end every
request has been answered."""

import json
from typing import assert_never

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from hypothesis_profiles import examples
from turnguard_core import circuit, identity, machine, policy
from turnguard_core.ledger import AttemptEnd, Recording

GUARD = policy.GuardPolicy(replay=True, replay_window_s=300, retention_s=3600)
CFG = circuit.CircuitConfig(threshold=2, cooldown_s=10, cooldown_max_s=40)
SESSION_HEADERS = (("authorization", "Bearer k"), ("session-id", "s"),
                   ("x-codex-turn-state", "ts"))


def ident(n: int) -> identity.Identity:
    body = json.dumps({"input": f"turn {n}"}).encode()
    out = identity.identify(identity.RequestView("POST", "/v1/responses", SESSION_HEADERS, body))
    assert isinstance(out, identity.Identity)
    return out


class ModelCircuit:
    """The circuit as the issue states it, written independently of ``circuit.py``."""

    def __init__(self):
        self.failures, self.open_until = 0, 0.0

    def end(self, outcome: str, now: float) -> None:
        if outcome == "completed":
            self.failures, self.open_until = 0, 0.0
        elif outcome == "unknown":
            self.failures += 1
            if self.failures >= CFG.threshold:
                cooldown = min(CFG.cooldown_s * 2 ** (self.failures - CFG.threshold),
                               CFG.cooldown_max_s)
                self.open_until = now + cooldown

    def is_open(self, now: float) -> bool:
        return now < self.open_until


class RecoveryMachine(RuleBasedStateMachine):
    backend = None  # set by test_recovery_machine before each run

    def __init__(self):
        super().__init__()
        self.backend.fresh()
        self.now = 1000.0
        self.ledger = self.backend.open("me", self.now)
        self.owner, _ = self.ledger.claim_session(
            ident(0).session, now=self.now, lease_s=1e9, new_id="durable"
        )
        self.scope = circuit.circuit_scope(ident(0).session, ident(0).scope, "/v1/responses")
        self.model = ModelCircuit()
        self.in_flight: dict[int, int] = {}  # attempt -> op n
        self.pending: list[dict] = []  # requests not answered yet
        self.answered = 0
        self.recoveries: dict[int, int] = {}
        self.dispatches_while_open = 0

    def teardown(self):
        try:
            self._every_request_is_answered()
        finally:
            self.ledger.close()

    # -- the driver: the real request machine, with the ledger as its store ----------------------
    def _facts(self, n: int) -> machine.RequestFacts:
        i = ident(n)
        return machine.RequestFacts(
            i.op_id, i.op_key, f"flow-{n}", i.session, True, False, False, self.now + 1e6,
            1e6, "server_anchored_replay_once", CFG.threshold, self.owner)

    def _advance(self, req: dict, state, transition) -> None:
        """Run the machine from ``state`` as far as it goes without waiting."""
        i = ident(req["n"])
        facts = self._facts(req["n"])
        state, _ = transition
        while True:
            match state:
                case machine.Admit():
                    a = self.ledger.admit(i, method="POST", path="/v1/responses", now=self.now,
                                          guard=GUARD, flow_id=None, circuit_scope=self.scope,
                                          recovery=state.recovery, once_mode=True)
                    state, _ = machine.on_admission(facts, state, a, self.now, ledger_down=None)
                case machine.Forward(dispatch=d):
                    if self.model.is_open(self.now):
                        self.dispatches_while_open += 1
                    if d.kind == "recovery":
                        self.recoveries[req["n"]] = self.recoveries.get(req["n"], 0) + 1
                    self.in_flight[d.attempt_id] = req["n"]
                    self.answered += 1  # forwarded: the upstream answers it
                    return
                case machine.FetchRecording(attempt_id=attempt):
                    rec = self.ledger.recording(attempt)
                    state, _ = machine.on_recording(facts, state, rec, readable=True)
                case machine.FailClosed():
                    state, _ = machine.fail_closed(facts, state, 0.0)
                case machine.HoldDuplicate() | machine.WaitCooldown():
                    self.pending.append({**req, "state": state})
                    return
                case machine.Replay() | machine.Respond() | machine.PassThrough() | machine.Abandon():
                    self.answered += 1
                    return
                case _:
                    assert_never(state)

    def _arrive(self, n: int) -> None:
        self._advance({"n": n}, machine.start(), (machine.start(), ()))

    def _wake(self, who, woke) -> None:
        woken = [r for r in self.pending if who(r)]
        self.pending = [r for r in self.pending if not who(r)]
        for r in woken:
            transition = machine.on_woke(self._facts(r["n"]), r["state"], woke(r), self.now)
            self._advance(r, r["state"], transition)

    # -- rules -------------------------------------------------------------------------------------
    @rule(n=st.integers(0, 2))
    def request_arrives(self, n):
        self._arrive(n)

    @rule(data=st.data(), outcome=st.sampled_from(["completed", "unknown", "unknown"]))
    def attempt_ends(self, data, outcome):
        if not self.in_flight:
            return
        attempt = data.draw(st.sampled_from(sorted(self.in_flight)))
        n = self.in_flight.pop(attempt)
        rec = Recording(200, (), b"ok") if outcome == "completed" else None
        events = 3 if outcome == "completed" else 0
        self.ledger.finish(attempt, AttemptEnd(outcome, 200 if rec else None, events, None, rec),
                           now=self.now, circuit_cfg=CFG, eventless_failure=outcome == "unknown")
        self.model.end(outcome, self.now)
        self._wake(lambda r: isinstance(r["state"], machine.HoldDuplicate) and r["n"] == n,
                   lambda r: machine.Ended(outcome, rec))

    @rule(dt=st.sampled_from([0.5, 5.0, 11.0, 45.0]))
    def time_passes(self, dt):
        self.now += dt
        self._wake(lambda r: isinstance(r["state"], machine.WaitCooldown)
                   and r["state"].since + r["state"].wait_s <= self.now,
                   lambda r: machine.TimedOut())

    # -- properties --------------------------------------------------------------------------------
    @invariant()
    def at_most_one_recovery_dispatch_per_operation(self):
        assert all(v <= 1 for v in self.recoveries.values()), self.recoveries
        [row] = self.backend.rows("SELECT MAX(recovery_dispatches) FROM operations")
        assert (row[0] or 0) <= 1

    @invariant()
    def never_a_dispatch_while_fenced(self):
        assert self.dispatches_while_open == 0

    @invariant()
    def single_flight(self):
        assert len(set(self.in_flight.values())) == len(self.in_flight)

    @invariant()
    def held_requests_wait_for_something_that_will_end(self):
        for r in self.pending:
            if isinstance(r["state"], machine.HoldDuplicate):
                assert r["n"] in self.in_flight.values()
            else:
                assert r["state"].since + r["state"].wait_s <= self.now + CFG.cooldown_max_s

    def _every_request_is_answered(self):
        """At the end: end every attempt, let every cooldown pass; nothing stays pending."""
        for _ in range(50):  # bounded: each round ends every attempt and passes the cooldown
            if not self.pending:
                break
            for attempt in sorted(self.in_flight):
                n = self.in_flight.pop(attempt)
                self.ledger.finish(attempt, AttemptEnd("completed", 200, 1, None,
                                                       Recording(200, (), b"ok")),
                                   now=self.now, circuit_cfg=CFG)
                self.model.end("completed", self.now)
                self._wake(lambda r, n=n: isinstance(r["state"], machine.HoldDuplicate)
                           and r["n"] == n,
                           lambda r: machine.Ended("completed", Recording(200, (), b"ok")))
            self.time_passes(CFG.cooldown_max_s + 1)
        assert not self.pending


def test_recovery_machine(ledger_backend):
    """The request machine with each store as its ledger."""
    RecoveryMachine.backend = ledger_backend
    run_state_machine_as_test(
        RecoveryMachine, settings=settings(max_examples=examples(60), stateful_step_count=40,
                                           deadline=None))
