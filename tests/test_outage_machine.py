"""Stateful property test of ledger outages and process pauses: several turnguard processes on
one real SQLite ledger file, driven with an injected clock against a simple model.

Driven: three model processes, each with its own ``Ledger`` connection (its own instance id and
a fake ``ProcessIdentity``: one boot id and pid namespace for all, its own pid and start time),
its own ``Knowledge``, queue of kept ledger writes, circuits and owned sessions in memory. A
small driver does with them what ``TurnGuard`` does (``_admit``, ``_guard``, ``_write``,
``_catch_up``, ``_record_end``, ``_reap_dead`` and the ticker): a request tries the ledger first
and is decided in memory (``policy.admit_without_ledger``) while its process's ledger is down;
an attempt's first event and end are written, or kept in order and applied before that process
reads the ledger again; held duplicates wake on their attempt's end, on a poll of the ledger or
at their bound (409); a hard turn-state request of an owned session is held through a cooldown
and released through a recovery claim. Three operations: two of one durable session, anchored
by a turn-state, and one with neither. Each recovery mode is a test of its own.

Rules: requests (or bursts of retries) arrive at running processes, often as eventless failures
(the incident); attempts see a first event and end (completed, unknown, partial, rejected); a
process's ledger goes down and comes back; processes pause and resume (paused: no decision, no
end, no write, no heartbeat, but alive), crash (its attempts stay in flight in the ledger, its
kept writes and held requests are lost) and restart (a new instance, sometimes on the crashed
one's pid); processes reap (``peers_with_attempts_in_flight`` + ``liveness.verdict`` +
``reap_instance``; the ticker also does it every 5 s) and collect garbage; time passes.

Checked after every step:
1. once mode: at most one recovery dispatch per operation (model and ledger), and an operation
   whose recovery dispatch ended with no known result (unknown, partial, crashed) is never
   dispatched again, from the ledger or from memory;
2. single flight: at most one attempt in flight per operation in the ledger; a dispatch decided
   from the ledger never overlaps another attempt the ledger registered, nor happens while the
   circuit is open; a dispatch decided in memory never overlaps an attempt its process knew to
   be in flight. Not asserted against: two processes that are both blind dispatching, and an
   attempt dispatched blind overlapping a later dispatch (this model does not register blind
   attempts when the ledger comes back; the shell does, and records their ends whole: see
   test_addon.py's tests of a locked ledger);
3. no live process (running, paused, or without its ledger) has an attempt reaped, nor reports
   an end after a reap;
4. an operation the ledger has completed with a recording is replayed, never dispatched, within
   the replay window (and every replay finds its recording); the ledger agrees with the model on
   every operation and circuit; no running process keeps a request past its bound.

At the end (no wedge): crashed processes restart, paused ones resume, every ledger comes back,
attempts end, reapers run and time passes; then no operation is in flight, no write is kept, and
every request was answered (dispatched, replayed, refused with 409 or 503), or lost with a
crashed process (its client sees the connection close).
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import tempfile
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test,
)

from turnguard_core import circuit, identity, liveness, policy
from turnguard_core.knowledge import Knowledge, KnownRecording
from turnguard_core.ledger import AttemptEnd, FinishResult, Ledger, Recording

FAIL_CLOSED, ONCE, INDEFINITE = policy.RECOVERY_MODES
GUARD = policy.GuardPolicy(replay=True, replay_window_s=120.0, retention_s=1e7)  # no op purged
CIRCUIT = circuit.CircuitConfig(threshold=2, cooldown_s=10.0, cooldown_max_s=40.0)
HOLD_TIMEOUT_S = 30.0
REQUEST_BUDGET_S = 120.0
OWNER_LEASE_S = 60.0
INSTANCE_LEASE_S = 120.0
TICK_S = 5.0  # the longest the clock moves between two ticks of every running process
REAP_S = 5.0  # a running process looks for dead peers this often (1 s while it holds for one)
RECORDING = Recording(200, (("content-type", "text/event-stream"),), b"data: completed\n\n")
PROCESSES = 3

BOOT_ID, PID_NS = "boot-1", "pid:[4026531836]"  # one kernel, one pid namespace: pids are proof


@dataclass(frozen=True)
class Operation:
    name: str
    ident: identity.Identity
    circuit_scope: str


def _operation(name: str, *, session: bool, turn_state: bool) -> Operation:
    headers = [("authorization", "Bearer k")]
    if session:
        headers.append(("session-id", "s"))
    if turn_state:
        headers.append(("x-codex-turn-state", "ts"))
    body = json.dumps({"input": name}).encode()
    ident = identity.identify(
        identity.RequestView("POST", "/v1/responses", tuple(headers), body)
    )
    assert isinstance(ident, identity.Identity)
    return Operation(name, ident, circuit.circuit_scope(ident.session, ident.scope, ident.route))


OPERATIONS = (
    _operation("anchored turn 0", session=True, turn_state=True),
    _operation("anchored turn 1", session=True, turn_state=True),
    _operation("sessionless turn", session=False, turn_state=False),
)


class ModelCircuit:
    """The ledger's circuit of one scope as the issue states it, fed with the ends the ledger
    applied, in the order it applied them (written independently of ``circuit.py``)."""

    def __init__(self):
        self.failures, self.open_until = 0, 0.0

    def end(self, outcome: str, now: float) -> None:
        if outcome == "completed":  # closed now; the end of its last cooldown is kept
            self.failures, self.open_until = 0, min(self.open_until, now)
        elif outcome == "unknown":
            self.failures += 1
            if self.failures >= CIRCUIT.threshold:
                # a longer cooldown already open stands: an end applied late (kept through an
                # outage, its ``now`` earlier than the failure that opened the cooldown)
                # never shortens it
                self.open_until = max(self.open_until, now + min(
                    CIRCUIT.cooldown_s * 2 ** (self.failures - CIRCUIT.threshold),
                    CIRCUIT.cooldown_max_s,
                ))

    def is_open(self, now: float) -> bool:
        return now < self.open_until


@dataclass(eq=False)
class Attempt:
    """One upstream dispatch. ``status``: running (the exchange goes on), ended (its process
    saw it end), orphaned (its process crashed mid-exchange; the ledger still has it in
    flight), reaped (a reaper ended it), gone (a crashed process's attempt the ledger never
    knew)."""

    op: int
    process: "Process"
    attempt_id: int | None  # None: dispatched while its process's ledger was down
    kind: str
    events: int = 0
    status: str = "running"

    def __repr__(self) -> str:
        return (f"Attempt(op {self.op}, {self.kind}, ledger id {self.attempt_id}, of "
                f"{self.process!r}, {self.status})")

    @property
    def in_flight_upstream(self) -> bool:
        return self.status in ("running", "orphaned")


@dataclass(eq=False)
class Process:
    slot: int
    instance_id: str
    identity: liveness.ProcessIdentity
    ledger: Ledger
    knowledge: Knowledge = field(default_factory=Knowledge)
    kept: list = field(default_factory=list)  # ledger writes owed, in order (the addon's _pending)
    attempts: dict = field(default_factory=dict)  # op -> its Attempt in flight here (_local)
    circuits: dict = field(default_factory=dict)  # scope -> CircuitState, for memory decisions
    sessions: dict = field(default_factory=dict)  # session -> SessionOwnership it holds
    # The model's own record of what the ledger told this process: op -> the attempt it said
    # another process has in flight, until the process sees evidence that it ended.
    learned_in_flight: dict = field(default_factory=dict)
    ledger_up: bool = True
    paused: bool = False
    crashed: bool = False
    last_reap: float = 0.0

    @property
    def running(self) -> bool:
        return not (self.paused or self.crashed)

    def __repr__(self) -> str:
        state = "crashed" if self.crashed else "paused" if self.paused else "running"
        return f"{self.instance_id} ({state}, ledger {'up' if self.ledger_up else 'down'})"


@dataclass(eq=False)
class Request:
    rid: int
    op: int
    process: Process
    budget_deadline: float
    owner: policy.SessionOwnership | None
    recovery: policy.RecoveryClaim | None = None
    held_since: float | None = None
    hold_deadline: float = 0.0
    waiting: str | None = None  # "duplicate" or "cooldown" while parked
    watched_attempt: int | None = None  # another process's attempt it waits for (0: unknown)
    cooldown_until: float = 0.0


@dataclass
class OperationRow:
    """An operation as the model expects the ledger to have it."""

    state: str
    current_attempt: int | None = None
    ended_at: float | None = None
    replay_attempt: int | None = None
    events_seen: int = 0
    recovery_dispatches: int = 0


class OutageMachine(RuleBasedStateMachine):
    MODE = FAIL_CLOSED  # the default; the subclasses below run the recovery modes

    def __init__(self):
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "ledger.sqlite3")
        self.now = 1_000_000.0
        self.ids = itertools.count(1)
        self.processes: list[Process] = []
        self.dead_instances: set[str] = set()
        for slot in range(PROCESSES):
            self.processes.append(self._start(slot, pid=1000 + slot))
        self.checker = sqlite3.connect(self.path)
        self.attempts: list[Attempt] = []
        self.attempt_rows: dict[int, Attempt] = {}  # ledger attempt id -> Attempt
        self.row_in_flight: dict[int, bool] = {}  # ledger attempt id -> in flight in the model
        self.row_events: dict[int, int] = {}
        self.operations: dict[int, OperationRow] = {}
        self.circuits = {op.circuit_scope: ModelCircuit() for op in OPERATIONS}
        self.parked: list[Request] = []
        self.answers: dict[int, str] = {}
        self.requests_seen = 0
        self.recoveries: dict[int, int] = {}
        self.spent: set[int] = set()  # ops whose recovery dispatch ended with no known result
        self.violations: list[str] = []  # found while deciding, reported by the invariants

    def teardown(self):
        try:
            self._no_wedge()
        finally:
            self.checker.close()
            for p in self.processes:
                p.ledger.close()
            self.dir.cleanup()

    # -- processes -------------------------------------------------------------------------------
    def _start(self, slot: int, *, pid: int) -> Process:
        n = next(self.ids)
        ident = liveness.ProcessIdentity("host", BOOT_ID, PID_NS, pid, 50_000 + n)
        instance_id = f"p{slot}.{n}"
        ledger = Ledger(self.path, instance_id, identity=ident)
        ledger.open(self.now)
        return Process(slot, instance_id, ident, ledger)

    def _start_ticks_of(self, pid: int) -> int | None:
        """What /proc says of a pid: a paused process is still there, a crashed one is not."""
        for p in self.processes:
            if not p.crashed and p.identity.pid == pid:
                return p.identity.start_ticks
        return None

    def _running(self) -> list[Process]:
        return [p for p in self.processes if p.running]

    # -- the ledger, through a process: used only while its ledger is up ------------------------
    def _ledger_ready(self, p: Process) -> bool:
        """The addon's ``_ledger``: a ledger that is up is brought up to date (``_catch_up``)
        before anything reads it."""
        if not p.ledger_up:
            return False
        self._catch_up(p)
        return True

    def _write(self, p: Process, call: str, *args, on_kept=None, landed=None, **kwargs) -> None:
        """The addon's ``_write``: written now when the ledger is usable (up and owing nothing),
        else kept in order."""
        if p.ledger_up and not p.kept:
            self._apply(p, call, args, kwargs, landed)
        else:
            p.kept.append((call, args, kwargs, landed))
            if on_kept is not None:
                on_kept()

    def _catch_up(self, p: Process) -> None:
        while p.kept:
            call, args, kwargs, landed = p.kept.pop(0)
            self._apply(p, call, args, kwargs, landed)

    def _apply(self, p: Process, call: str, args: tuple, kwargs: dict, landed) -> None:
        if call == "first_event":
            (attempt_id,) = args
            p.ledger.first_event(attempt_id)
            self.row_events[attempt_id] = 1
            self.operations[self.attempt_rows[attempt_id].op].events_seen = 1
            return
        assert call == "finish"
        attempt_id, end = args
        result = p.ledger.finish(attempt_id, end, **kwargs)
        expected_applied = self.row_in_flight[attempt_id]
        if result.applied != expected_applied:
            self.violations.append(
                f"finish of attempt {attempt_id} applied={result.applied}, expected "
                f"{expected_applied}")
        if expected_applied:
            op = self.attempt_rows[attempt_id].op
            self.row_in_flight[attempt_id] = False
            self.row_events[attempt_id] = max(self.row_events[attempt_id], end.events_seen)
            row = self.operations[op]
            row.state, row.ended_at = end.outcome, kwargs["now"]
            row.events_seen = max(row.events_seen, end.events_seen)
            row.replay_attempt = attempt_id if end.recording is not None else None
            self.circuits[OPERATIONS[op].circuit_scope].end(end.outcome, kwargs["now"])
        if landed is not None:
            landed(result)

    # -- a request's fate: the addon's _guard, one admission at a time ----------------------------
    def _ownership(self, p: Process, op: Operation) -> policy.SessionOwnership | None:
        session = op.ident.session
        if session is None:
            return None
        cached = p.sessions.get(session)
        if cached is not None and cached.lease_until - self.now > OWNER_LEASE_S / 2:
            return cached
        if not self._ledger_ready(p):
            return None
        row, result = p.ledger.claim_session(
            session, now=self.now, lease_s=OWNER_LEASE_S, new_id=f"durable-{next(self.ids)}"
        )
        if result == "owned_by_other":
            p.sessions.pop(session, None)
            return None
        p.sessions[session] = row
        return row

    def _admit(self, p: Process, req: Request):
        """The addon's ``_admit``: (admission, where it was decided)."""
        op = OPERATIONS[req.op]
        own = p.attempts.get(req.op)
        if own is not None:
            return policy.Hold(own.attempt_id, p.instance_id), "here"
        once_mode = self.MODE == ONCE
        if self._ledger_ready(p):
            admission = p.ledger.admit(
                op.ident, method="POST", path=op.ident.route, now=self.now, guard=GUARD,
                flow_id=f"flow-{req.rid}", circuit_scope=op.circuit_scope,
                recovery=req.recovery, once_mode=once_mode,
            )
            self._check_ledger_decision(p, req, admission)
            if isinstance(admission, policy.Fenced):
                p.circuits[op.circuit_scope] = circuit.CircuitState(
                    CIRCUIT.threshold, self.now + admission.remaining_s)
            elif isinstance(admission, policy.Hold) and admission.owner_instance != p.instance_id:
                p.knowledge.in_flight_elsewhere(op.ident.op_key, admission.attempt_id)
            return admission, "ledger"
        facts = p.knowledge.facts(
            op.ident.op_key, in_flight_here=False, fingerprint=op.ident.fingerprint,
            now=self.now, window_s=GUARD.replay_window_s,
        )
        admission = policy.admit_without_ledger(
            facts,
            circuit_remaining_s=p.circuits.get(
                op.circuit_scope, circuit.CircuitState()).remaining_s(self.now),
            recovering=req.recovery is not None, once_mode=once_mode,
            has_session=op.ident.session is not None,
        )
        return admission, "memory"

    def _check_ledger_decision(self, p: Process, req: Request, admission) -> None:
        """What the model says the ledger must have decided, and what the process learns."""
        row = self.operations.get(req.op)
        if row is not None and row.state == "in_flight":
            owner = self.attempt_rows[row.current_attempt].process.instance_id
            if admission != policy.Hold(row.current_attempt, owner):
                self.violations.append(f"op {req.op} in flight, ledger answered {admission}")
        if (
            row is not None and row.state == "completed" and row.replay_attempt is not None
            and self.now - row.ended_at <= GUARD.replay_window_s
            and admission != policy.Replay(row.replay_attempt)
        ):
            self.violations.append(
                f"op {req.op} completed with a recording {self.now - row.ended_at:.1f} s ago, "
                f"within the replay window, yet the ledger answered {admission}")
        if isinstance(admission, policy.Hold):
            p.learned_in_flight[req.op] = admission.attempt_id
        else:  # the ledger says nothing of the operation is in flight now
            p.learned_in_flight.pop(req.op, None)

    def _run(self, req: Request) -> None:
        """One admission of a request, and what the addon does with it: answer it, dispatch
        it, or park it (a held duplicate, or held through a cooldown) until a wake."""
        p, op = req.process, OPERATIONS[req.op]
        admission, where = self._admit(p, req)
        if isinstance(admission, policy.Dispatch):
            self._dispatch(p, req, admission, where)
        elif isinstance(admission, (policy.Replay, policy.ReplayFromMemory)):
            recording = p.knowledge.recording(
                op.ident.op_key, fingerprint=op.ident.fingerprint, now=self.now,
                window_s=GUARD.replay_window_s)
            if recording is None and isinstance(admission, policy.Replay):
                recording = p.ledger.recording(admission.attempt_id)
            if recording is None:
                self.violations.append(f"{admission} of op {req.op} found no recording")
            self._answer(req, "replayed")
        elif isinstance(admission, policy.Denied):
            if admission.reason == "claim_exhausted":
                p.knowledge.exhausted(op.ident.op_key)
            self._answer(req, f"503 {admission.reason}")
        elif isinstance(admission, policy.Fenced):
            denial = policy.fence_hold_denial(
                self.MODE, has_turn_state=op.ident.turn_state is not None,
                has_previous_response_id=False, owns_session=req.owner is not None,
                output_seen=admission.output_seen,
            )
            remaining_budget = req.budget_deadline - self.now
            if denial is None and remaining_budget <= 0:
                denial = "request_budget_expired"
            if denial == "owner_proof_missing" and op.ident.session and where == "memory":
                denial = "ledger_unavailable"
            if denial is not None:
                self._answer(req, f"503 {denial}")
                return
            req.waiting, req.recovery = "cooldown", None
            req.cooldown_until = self.now + min(admission.remaining_s, remaining_budget)
            self.parked.append(req)
        elif isinstance(admission, policy.Hold):
            if req.held_since is None:
                req.held_since = self.now
                req.hold_deadline = policy.hold_deadline(
                    self.now, hold_timeout_s=HOLD_TIMEOUT_S, budget_deadline=req.budget_deadline)
            if self.now >= req.hold_deadline:
                self._answer(req, "409 turn_in_progress")
                return
            req.waiting = "duplicate"
            req.watched_attempt = None if req.op in p.attempts else (admission.attempt_id or 0)
            self.parked.append(req)
        else:
            raise AssertionError(f"unexpected admission {admission}")

    def _dispatch(self, p: Process, req: Request, d: policy.Dispatch, where: str) -> None:
        if self.MODE == ONCE and req.op in self.spent:
            self.violations.append(
                f"op {req.op} dispatched again ({d.kind}, from {where}) after its one recovery "
                "dispatch ended with no known result")
        overlapping = [a for a in self.attempts if a.op == req.op and a.in_flight_upstream]
        if where == "ledger":
            registered = [a for a in overlapping if a.attempt_id is not None]
            if registered:
                self.violations.append(
                    f"ledger dispatch of op {req.op} by {p.instance_id} overlaps {registered}")
            if self.circuits[OPERATIONS[req.op].circuit_scope].is_open(self.now):
                self.violations.append(f"ledger dispatch of op {req.op} while its circuit is open")
        else:
            knew_of = [a for a in overlapping if a.process is p or (
                req.op in p.learned_in_flight and a.attempt_id == p.learned_in_flight[req.op])]
            if knew_of:
                self.violations.append(
                    f"memory dispatch of op {req.op} by {p.instance_id} overlaps {knew_of}, "
                    "which it knew to be in flight")
        attempt = Attempt(req.op, p, d.attempt_id, d.kind)
        self.attempts.append(attempt)
        p.attempts[req.op] = attempt
        if d.attempt_id is not None:
            self.attempt_rows[d.attempt_id] = attempt
            self.row_in_flight[d.attempt_id] = True
            self.row_events[d.attempt_id] = 0
            row = self.operations.setdefault(req.op, OperationRow("new"))
            row.state, row.current_attempt, row.ended_at = "in_flight", d.attempt_id, None
            row.recovery_dispatches += d.kind == "recovery"
        if d.kind == "recovery":
            self.recoveries[req.op] = self.recoveries.get(req.op, 0) + 1
        self._answer(req, f"dispatched {d.kind}")

    def _answer(self, req: Request, how: str) -> None:
        assert req.rid not in self.answers, (req.rid, self.answers[req.rid], how)
        self.answers[req.rid] = how

    def _wake_duplicates(self, p: Process, op: int, recording: Recording | None) -> None:
        """The addon's ``_wake``: every duplicate of ``op`` held in ``p`` wakes; with a
        recording it is replayed, else admitted again."""
        woken = [r for r in self.parked
                 if r.process is p and r.op == op and r.waiting == "duplicate"]
        self.parked = [r for r in self.parked if r not in woken]
        for req in woken:
            req.waiting = None
            if recording is not None:
                self._answer(req, "replayed")
            else:
                self._run(req)

    # -- an attempt's end: the addon's _record_end ----------------------------------------------
    def _end(self, attempt: Attempt, outcome: str) -> None:
        p, op = attempt.process, OPERATIONS[attempt.op]
        if outcome == "unknown" and attempt.events:
            outcome = "partial"  # events were seen: classify_outcome never says unknown
        if outcome == "rejected" and attempt.events:
            outcome = "partial"  # an error status after events
        events = max(attempt.events, 1) if outcome in ("completed", "partial") else 0
        recording = RECORDING if outcome == "completed" else None
        status = {"unknown": None, "rejected": 503}.get(outcome, 200)
        del p.attempts[attempt.op]
        attempt.status = "ended"
        if attempt.kind == "recovery" and outcome in ("unknown", "partial"):
            self.spent.add(attempt.op)
        now = self.now
        if recording is not None:
            p.knowledge.completed(
                op.ident.op_key, KnownRecording(recording, now, op.ident.fingerprint))
        else:
            p.knowledge.ended(op.ident.op_key)
            if attempt.kind == "recovery" and outcome in ("unknown", "partial"):
                p.knowledge.exhausted(op.ident.op_key)
        eventless = outcome == "unknown"

        def in_memory() -> None:  # no ledger: keep the circuit in memory
            before = p.circuits.get(op.circuit_scope, circuit.CircuitState())
            p.circuits[op.circuit_scope], _ = circuit.record_outcome(
                before, eventless_failure=eventless, completed=outcome == "completed",
                now=now, cfg=CIRCUIT)

        def landed(result: FinishResult) -> None:
            if result.circuit_scope is not None and result.circuit is not None:
                p.circuits[result.circuit_scope] = result.circuit

        if attempt.attempt_id is not None:
            self._write(
                p, "finish", attempt.attempt_id,
                AttemptEnd(outcome, status, events, None, recording),
                now=now, circuit_cfg=CIRCUIT, eventless_failure=eventless,
                on_kept=in_memory, landed=landed,
            )
        else:
            in_memory()
        self._wake_duplicates(p, attempt.op, recording)

    # -- the ticker: what each running process does by itself ------------------------------------
    def _tick(self, p: Process) -> None:
        if p.ledger_up:
            self._catch_up(p)
            if p.ledger.heartbeat(self.now) == "reregistered":
                p.sessions.clear()  # taken for dead: what it owned may have been taken over
            self._check_cooldown_sessions(p)
            holds_for_a_peer = any(r.process is p and r.watched_attempt is not None
                                   for r in self.parked)
            if self.now - p.last_reap >= (1.0 if holds_for_a_peer else REAP_S):
                self._reap(p)
            self._poll_foreign(p)
        for req in [r for r in self.parked if r.process is p]:
            if req not in self.parked:
                continue  # answered by an earlier wake in this tick
            if req.waiting == "cooldown" and self.now >= req.cooldown_until:
                self.parked.remove(req)
                req.waiting = None
                if self.now >= req.budget_deadline:
                    self._answer(req, "503 request_budget_expired")
                    continue
                req.recovery = policy.RecoveryClaim(
                    OPERATIONS[req.op].ident.session, req.owner.owner_epoch,
                    once=self.MODE == ONCE)
                req.held_since = None
                self._run(req)
            elif req.waiting == "duplicate" and self.now >= req.hold_deadline:
                self.parked.remove(req)
                self._answer(req, "409 turn_in_progress")

    def _check_cooldown_sessions(self, p: Process) -> None:
        held = {(OPERATIONS[r.op].ident.session, r.owner.owner_epoch)
                for r in self.parked if r.process is p and r.waiting == "cooldown"}
        for session, epoch in held:
            owned = p.sessions.get(session)
            fresh = owned is not None and owned.lease_until - self.now >= OWNER_LEASE_S * 2 / 3
            kept = fresh and p.ledger.session_owned_by(session, p.instance_id, epoch)
            if not kept:  # renewed (or registered again in a file that does not know it)
                kept = p.ledger.renew_session(session, epoch, now=self.now, lease_s=OWNER_LEASE_S)
                if kept and owned is not None:
                    p.sessions[session] = replace(owned, lease_until=self.now + OWNER_LEASE_S)
            if not kept:
                p.sessions.pop(session, None)
                lost = [r for r in self.parked if r.process is p and r.waiting == "cooldown"
                        and OPERATIONS[r.op].ident.session == session]
                for req in lost:
                    self.parked.remove(req)
                    self._answer(req, "503 ownership_lost")

    def _poll_foreign(self, p: Process) -> None:
        """The addon's ``_poll_foreign``: duplicates held on another process's attempt wake
        once the ledger shows that attempt is no longer the one in flight."""
        foreign = {r.op for r in self.parked if r.process is p and r.waiting == "duplicate"
                   and r.watched_attempt is not None}
        for op in foreign:
            snap = p.ledger.snapshot(OPERATIONS[op].ident.op_key)
            watched = {r.watched_attempt for r in self.parked
                       if r.process is p and r.op == op and r.waiting == "duplicate"}
            if snap is None or snap.state != "in_flight" or snap.current_attempt not in watched:
                self._wake_duplicates(p, op, None)

    def _tick_all(self) -> None:
        for p in self._running():
            self._tick(p)

    def _pass_time(self, dt: float) -> None:
        while dt > 0:
            step = min(dt, TICK_S)
            self.now += step
            dt -= step
            self._tick_all()

    def _reap(self, p: Process) -> None:
        """The addon's ``_reap_dead``, from ``p``'s view of its peers."""
        self._catch_up(p)
        p.last_reap = self.now
        for peer in p.ledger.peers_with_attempts_in_flight():
            verdict = liveness.verdict(
                peer, me=p.identity, now=self.now, lease_s=INSTANCE_LEASE_S,
                start_ticks_of=self._start_ticks_of,
            )
            if verdict == "alive":
                continue
            moved = p.ledger.reap_instance(
                peer.instance_id, now=self.now,
                heartbeat_was=None if verdict == "dead" else peer.heartbeat_at,
            )
            self._reaped(peer.instance_id, moved)
            for op_key in moved:
                p.knowledge.ended(op_key)
                p.learned_in_flight.pop(self._op_of(op_key), None)

    def _reaped(self, instance_id: str, moved: list[str]) -> None:
        """Move the model as ``reap_instance`` must have moved the ledger."""
        expected = set()
        for attempt_id, in_flight in self.row_in_flight.items():
            attempt = self.attempt_rows[attempt_id]
            if not in_flight or attempt.process.instance_id != instance_id:
                continue
            if not attempt.process.crashed:
                self.violations.append(
                    f"attempt {attempt_id} of live process {instance_id} "
                    f"({'paused' if attempt.process.paused else 'running'}) was reaped")
            self.row_in_flight[attempt_id] = False
            if attempt.status in ("running", "orphaned"):
                attempt.status = "reaped"
            row = self.operations[attempt.op]
            if row.current_attempt == attempt_id:
                row.state = "partial" if self.row_events[attempt_id] else "unknown"
                row.ended_at = self.now
                expected.add(OPERATIONS[attempt.op].ident.op_key)
        if set(moved) != expected:
            self.violations.append(f"reap of {instance_id} moved {moved}, expected {expected}")

    @staticmethod
    def _op_of(op_key: str) -> int:
        return next(i for i, op in enumerate(OPERATIONS) if op.ident.op_key == op_key)

    # -- rules ------------------------------------------------------------------------------------
    @initialize(failures=st.integers(0, 3), retries=st.integers(0, 3))
    def the_incident_has_begun(self, failures, retries):
        """In many runs the incident has begun before the faults do: the first process served
        eventless failures of the first operation, so its circuit cools down (from two on),
        and the client's retries arrive there (in the recovery modes, held through the
        cooldown)."""
        first = self.processes[0]
        for _ in range(failures):
            self._arrive(first, 0)
            if 0 not in first.attempts:
                break  # fenced: the cooldown is open
            self._end(first.attempts[0], "unknown")
        for _ in range(retries):
            self._arrive(first, 0)

    def _arrive(self, p: Process, op: int) -> None:
        self.requests_seen += 1
        req = Request(self.requests_seen, op, p, self.now + REQUEST_BUDGET_S, None)
        req.owner = self._ownership(p, OPERATIONS[op])
        self._run(req)
        self._tick_all()

    def _alive(self) -> list[Process]:
        return [p for p in self.processes if not p.crashed]

    def _attempts_running(self) -> list[Attempt]:
        return [a for p in self._running() for a in p.attempts.values()]

    def _reapers(self) -> list[Process]:
        return [p for p in self._running() if p.ledger_up]

    @precondition(lambda self: self._running())
    @rule(data=st.data(), op=st.integers(0, len(OPERATIONS) - 1), copies=st.integers(1, 3))
    def requests_arrive(self, data, op, copies):
        """One request, or a client's burst of retries of it, at one process."""
        p = data.draw(st.sampled_from(self._running()), label="process")
        for _ in range(copies):
            self._arrive(p, op)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), op=st.integers(0, len(OPERATIONS) - 1),
          outcome=st.sampled_from(["unknown", "unknown", "rejected"]))
    def a_turn_fails_without_events(self, data, op, outcome):
        """The incident's shape, as one step so that cooldowns are common: a request arrives
        and the attempt of its operation (the one it started, or the one it waits for) ends
        with no event: ``unknown`` (a timeout, a reset) or ``rejected`` (an error status)."""
        self._arrive(data.draw(st.sampled_from(self._running()), label="process"), op)
        attempt = next((a for a in self._attempts_running() if a.op == op), None)
        if attempt is not None and not attempt.events:
            self._end(attempt, outcome)
            self._tick_all()

    @precondition(lambda self: any(not a.events for a in self._attempts_running()))
    @rule(data=st.data())
    def first_event_arrives(self, data):
        candidates = [a for a in self._attempts_running() if not a.events]
        attempt = data.draw(st.sampled_from(candidates), label="attempt")
        attempt.events = 1
        if attempt.attempt_id is not None:
            self._write(attempt.process, "first_event", attempt.attempt_id)
        self._tick_all()

    @precondition(lambda self: self._attempts_running())
    @rule(data=st.data(),
          outcome=st.sampled_from(["completed", "unknown", "partial", "rejected"]))
    def attempt_ends(self, data, outcome):
        self._end(data.draw(st.sampled_from(self._attempts_running()), label="attempt"), outcome)
        self._tick_all()

    @precondition(lambda self: any(p.ledger_up for p in self._alive()))
    @rule(data=st.data())
    def ledger_goes_down(self, data):
        up = [p for p in self._alive() if p.ledger_up]
        data.draw(st.sampled_from(up), label="process").ledger_up = False

    @precondition(lambda self: any(not p.ledger_up for p in self._alive()))
    @rule(data=st.data())
    def ledger_comes_back(self, data):
        down = [p for p in self._alive() if not p.ledger_up]
        data.draw(st.sampled_from(down), label="process").ledger_up = True
        self._tick_all()  # a running process catches up before it reads the ledger again

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def process_pauses(self, data):
        data.draw(st.sampled_from(self._running()), label="process").paused = True

    @precondition(lambda self: any(p.paused for p in self._alive()))
    @rule(data=st.data())
    def process_resumes(self, data):
        paused = [p for p in self._alive() if p.paused]
        data.draw(st.sampled_from(paused), label="process").paused = False
        self._tick_all()

    @precondition(lambda self: self._alive())
    @rule(data=st.data())
    def process_crashes(self, data):
        p = data.draw(st.sampled_from(self._alive()), label="process")
        p.crashed = True
        self.dead_instances.add(p.instance_id)
        p.kept.clear()  # kept writes die with the process: that is the crash
        for attempt in p.attempts.values():
            attempt.status = "gone" if attempt.attempt_id is None else "orphaned"
            if attempt.kind == "recovery":
                self.spent.add(attempt.op)  # it may have run upstream: its result is unknown
        p.attempts.clear()
        for req in [r for r in self.parked if r.process is p]:
            self.parked.remove(req)
            self._answer(req, "lost with its process")
        p.ledger.close()

    @precondition(lambda self: any(p.crashed for p in self.processes))
    @rule(data=st.data(), reuse_pid=st.booleans())
    def process_restarts(self, data, reuse_pid):
        crashed = [p for p in self.processes if p.crashed]
        self._restart(data.draw(st.sampled_from(crashed), label="process"), reuse_pid=reuse_pid)

    def _restart(self, old: Process, *, reuse_pid: bool) -> None:
        pid = old.identity.pid if reuse_pid else 2000 + next(self.ids)
        self.processes[old.slot] = self._start(old.slot, pid=pid)
        self._tick_all()

    @precondition(lambda self: self._reapers())
    @rule(data=st.data())
    def process_reaps(self, data):
        self._reap(data.draw(st.sampled_from(self._reapers()), label="process"))
        self._tick_all()

    @precondition(lambda self: self._reapers())
    @rule(data=st.data())
    def process_collects_garbage(self, data):
        p = data.draw(st.sampled_from(self._reapers()), label="process")
        self._catch_up(p)
        p.ledger.collect_garbage(now=self.now, retention_s=GUARD.retention_s,
                                 instance_stale_s=INSTANCE_LEASE_S)

    @rule(dt=st.sampled_from([0.5, 5.0, 11.0, 45.0, 130.0]))
    def time_passes(self, dt):
        self._pass_time(dt)

    @precondition(lambda self: any(r.waiting == "cooldown" for r in self.parked))
    @rule()
    def a_cooldown_ends(self):
        """Time passes to just after the first cooldown a held request waits out."""
        until = min(r.cooldown_until for r in self.parked if r.waiting == "cooldown")
        self._pass_time(until - self.now + 0.1)

    # -- properties -------------------------------------------------------------------------------
    @invariant()
    def nothing_went_wrong_while_deciding(self):
        assert not self.violations, self.violations

    @invariant()
    def at_most_one_recovery_dispatch_per_operation_in_once_mode(self):
        if self.MODE != ONCE:
            return
        assert all(n <= 1 for n in self.recoveries.values()), self.recoveries
        (most,) = self.checker.execute("SELECT MAX(recovery_dispatches) FROM operations").fetchone()
        assert (most or 0) <= 1

    @invariant()
    def at_most_one_attempt_in_flight_per_operation_in_the_ledger(self):
        rows = self.checker.execute(
            "SELECT op_key, COUNT(*) FROM attempts WHERE outcome='in_flight' GROUP BY op_key"
            " HAVING COUNT(*) > 1").fetchall()
        assert not rows, rows

    @invariant()
    def no_live_process_was_reaped(self):
        reaped = {i for (i,) in self.checker.execute(
            "SELECT instance_id FROM attempts WHERE detail='owner process gone'")}
        assert reaped <= self.dead_instances, reaped - self.dead_instances
        late = self.checker.execute(
            "SELECT attempt_id, instance_id, late_outcome FROM attempts"
            " WHERE late_outcome IS NOT NULL").fetchall()
        assert not late, f"ends that arrived after their attempt was reaped: {late}"

    @invariant()
    def the_ledger_agrees_with_the_model(self):
        for n, op in enumerate(OPERATIONS):
            got = self.checker.execute(
                "SELECT state, current_attempt, ended_at, replay_attempt, events_seen > 0,"
                " recovery_dispatches FROM operations WHERE op_key=?", (op.ident.op_key,)
            ).fetchone()
            row = self.operations.get(n)
            want = None if row is None else (
                row.state, row.current_attempt, row.ended_at, row.replay_attempt,
                int(row.events_seen > 0), row.recovery_dispatches)
            assert got == want, (op.name, got, want)
        for scope, model in self.circuits.items():
            row = self.checker.execute(
                "SELECT failures, COALESCE(open_until, 0) FROM circuits WHERE scope=?", (scope,)
            ).fetchone()
            assert (row or (0, 0.0)) == (model.failures, model.open_until), (scope, row)

    @invariant()
    def every_held_request_waits_within_its_bounds(self):
        for req in self.parked:
            assert not req.process.crashed and req.rid not in self.answers
            if req.waiting == "duplicate":
                assert req.hold_deadline <= req.held_since + HOLD_TIMEOUT_S
                bound = req.hold_deadline
            else:
                assert req.waiting == "cooldown"
                assert req.cooldown_until <= self.now + CIRCUIT.cooldown_max_s
                bound = req.cooldown_until
            if req.process.running:  # a paused one answers when it resumes
                assert self.now < bound, (req.rid, req.waiting, bound, self.now)

    def _no_wedge(self) -> None:
        """Every fault ends: crashed processes restart, paused ones resume, every ledger comes
        back; attempts end, reapers run, time passes. Then nothing may be left over."""
        for p in list(self.processes):
            if p.crashed:
                self._restart(p, reuse_pid=False)
        for p in self.processes:
            p.paused, p.ledger_up = False, True
        for _ in range(10):  # bounded: each round ends every attempt and outlasts every wait
            self._tick_all()
            for p in self.processes:
                for attempt in list(p.attempts.values()):
                    self._end(attempt, "completed")
            for p in self.processes:
                self._reap(p)
            self._pass_time(HOLD_TIMEOUT_S + CIRCUIT.cooldown_max_s + TICK_S)
            if not (self.parked or any(p.attempts for p in self.processes)):
                break
        assert not self.violations, self.violations
        assert not self.parked, [(r.rid, r.op, r.waiting) for r in self.parked]
        assert not any(p.kept for p in self.processes)
        assert not any(p.attempts for p in self.processes)
        in_flight = self.checker.execute(
            "SELECT op_key, state FROM operations WHERE state IN ('in_flight', 'new')"
        ).fetchall()
        assert not in_flight, [(OPERATIONS[self._op_of(k)].name, s) for k, s in in_flight]
        assert sorted(self.answers) == list(range(1, self.requests_seen + 1))


class OnceModeMachine(OutageMachine):
    MODE = ONCE


class IndefiniteModeMachine(OutageMachine):
    MODE = INDEFINITE


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.slow
@pytest.mark.parametrize("machine", [OutageMachine, OnceModeMachine, IndefiniteModeMachine],
                         ids=[FAIL_CLOSED, ONCE, INDEFINITE])
def test_outages_pauses_and_crashes(machine):
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


class _Draws:
    """Stands in for Hypothesis's ``data`` in a replayed sequence: each draw picks the first
    element of the sampled list that ``pick`` accepts."""

    def __init__(self, pick):
        self.pick = pick

    def draw(self, strategy, label=None):
        strategy = getattr(strategy, "wrapped_strategy", strategy)
        elements = strategy.elements if hasattr(strategy, "elements") else [strategy.value]
        return next(x for x in elements if self.pick(x))


def test_once_mode_a_circuit_that_opens_again_gives_no_second_recovery():
    """A sequence the machine once found (shrunk): the operation's one recovery ends with an
    error status; another turn of its session opens the circuit again; the operation's held
    retry is refused (claim_exhausted), and so must be a fresh retry arriving after."""
    m = OnceModeMachine()
    try:
        def process(slot):
            return _Draws(lambda p: p.slot == slot)
        attempt_of_op_0 = _Draws(lambda a: a.op == 0)
        m.the_incident_has_begun(failures=0, retries=1)
        m.attempt_ends(attempt_of_op_0, "unknown")
        m.a_turn_fails_without_events(process(0), 0, "unknown")
        m.requests_arrive(process(0), 0, 1)
        m.a_cooldown_ends()
        assert m.recoveries == {0: 1}
        m.attempt_ends(attempt_of_op_0, "rejected")
        m.a_turn_fails_without_events(process(0), 1, "unknown")
        m.a_turn_fails_without_events(process(0), 0, "unknown")
        m.a_cooldown_ends()
        m.requests_arrive(process(0), 0, 1)
        assert m.recoveries == {0: 1}
        assert list(m.answers.values())[-2:] == ["503 claim_exhausted"] * 2
        m.nothing_went_wrong_while_deciding()
    finally:
        m.teardown()
