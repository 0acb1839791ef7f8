"""A replay of one of this process's own recordings is decided without reading the ledger: once
its attempt completed with a recording, the ledger replays that attempt to every request of the
operation with the same body until the window passes, so the process knows the answer already.

On a real SQLite ledger file, through ``FailoverStore``: the statements its connection runs are
traced, so "without reading the ledger" is counted, not assumed; and each case where the ledger
could decide otherwise (another body, the window passed, the end refused because the attempt
was reaped meanwhile, another ledger file) goes to the ledger as before."""

from __future__ import annotations

import asyncio
import collections
import json
import sqlite3
import time

from harness import delete_ledger
from turnguard_core import circuit, identity, liveness, policy
from turnguard_core.ending import AttemptEnding
from turnguard_core.failover import FailoverStore
from turnguard_core.knowledge import MemoryStore
from turnguard_core.ledger import AttemptEnd, Ledger, Recording

from store_attempt import StoreAttempt

GUARD = policy.GuardPolicy(replay=True, replay_window_s=300, retention_s=3600)
SCOPE = "route:own-replays"


def ident(text: str, idempotency_key: str | None = None) -> identity.Identity:
    headers = [("authorization", "Bearer sk-own-replays")]
    if idempotency_key:
        headers.append(("idempotency-key", idempotency_key))
    view = identity.RequestView("POST", "/v1/responses", tuple(headers),
                                json.dumps({"input": text}).encode())
    out = identity.identify(view)
    assert isinstance(out, identity.Identity)
    return out


class Traced:
    """A ``FailoverStore`` on a real ledger file whose connection's statements are counted."""

    def __init__(self, path: str):
        self.events: list[tuple[str, dict]] = []
        self.store = FailoverStore(
            instance_id="me", identity=liveness.read_process_identity(),
            emit=lambda event, **fields: self.events.append((event, fields)),
            memory=MemoryStore(), kept=collections.deque(), attempts=lambda: [],
            on_reregistered=lambda n: None)
        assert self.store.open(path)
        self.statements: list[str] = []
        self.store._store._runner.ledger._db.set_trace_callback(self.statements.append)

    async def admit(self, i: identity.Identity, guard: policy.GuardPolicy = GUARD):
        """As the addon asks: the window is the guard's for this request (None: replay off)."""
        window_s = None if not guard.replay else (
            guard.retention_s if i.idempotency_key else guard.replay_window_s)
        return await self.store.admit(
            i, method="POST", route="/v1/responses", flow_id="f", circuit_scope=SCOPE,
            recovery=None, once_mode=False, in_flight_here=lambda: False, guard=guard,
            window_s=window_s, threshold=2, deadline=time.monotonic() + 5)

    async def complete(self, i: identity.Identity, attempt_id: int, body: bytes) -> bool:
        """End the attempt as completed with a recording; whether the ledger took the end."""
        recording = Recording(200, (("content-type", "text/event-stream"),), body)
        ending = AttemptEnding("completed", recording, None, False, None, None)
        landed = self.store.finish(
            StoreAttempt(i, attempt_id, self.store.generation, circuit_scope=SCOPE), ending,
            AttemptEnd("completed", 200, 3, None, recording), now=time.time(),
            circuit_cfg=circuit.CircuitConfig(), base={})
        assert landed is not None
        await landed
        return not any(event == "outcome_fenced_out" for event, _ in self.events)

    def file_deleted(self, path) -> str:
        """Delete the ledger file under the store, which moves to the new one at its path as
        it does once the file is found gone; the generation it left."""
        left = self.store.generation
        delete_ledger(path)
        self.store._file_gone("ledger file deleted")  # as the heartbeat finds it
        assert self.store.open(str(path)), f"the new file did not open: {self.store.error!r}"
        assert self.store.generation != left
        return left

    def end_owed(self, i: identity.Identity, attempt_id: int, generation: str,
                 body: bytes) -> None:
        """End as completed, with a recording, an attempt of the file of ``generation``, since
        left: the end is kept, owed to the ledger."""
        recording = Recording(200, (("content-type", "text/event-stream"),), body)
        ending = AttemptEnding("completed", recording, None, False, None, None)
        assert self.store.finish(
            StoreAttempt(i, attempt_id, generation, circuit_scope=SCOPE), ending,
            AttemptEnd("completed", 200, 3, None, recording), now=time.time(),
            circuit_cfg=circuit.CircuitConfig(), base={}) is None  # kept: another file


def body_of(i: identity.Identity) -> bytes:
    """The recorded body of ``i``'s turn in the backlog tests: its own, to tell them apart."""
    return b"data: " + i.op_key.encode() + b"\n\n"


async def completed_turns(traced: Traced, n: int) -> list[identity.Identity]:
    """``n`` turns the store dispatched and completed (``body_of`` each), replayable within
    the guard's window (as the shell says: ``replay_window_of``)."""
    traced.store.replay_window_of = lambda i: GUARD.replay_window_s
    turns = [ident(f"backlog turn {n}") for n in range(n)]
    for turn in turns:
        claim = await traced.admit(turn)
        assert await traced.complete(turn, claim.attempt_id, body_of(turn))
    return turns


def replayed_by_a_peer(path, i: identity.Identity, body: bytes) -> None:
    """A process that never saw ``i``'s turn replays it from the ledger file at ``path``."""
    peer = Ledger(str(path), "peer")
    peer.open(time.time())
    try:
        replay = peer.admit(i, method="POST", path="/v1/responses", now=time.time(),
                            guard=GUARD, flow_id="g")
        assert isinstance(replay, policy.Replay), replay
        assert peer.recording(replay.attempt_id, i.op_key).body == body
    finally:
        peer.close()


async def test_a_replay_of_its_own_recording_reads_nothing_and_is_the_ledgers_decision(tmp_path):
    traced = Traced(str(tmp_path / "ledger.sqlite3"))
    try:
        turn = ident("the turn")
        claim = await traced.admit(turn)
        assert isinstance(claim, policy.Dispatch)
        assert await traced.complete(turn, claim.attempt_id, b"data: done\n\n")

        traced.statements.clear()
        replay = await traced.admit(turn)
        assert replay == policy.Replay(claim.attempt_id)
        assert traced.statements == []  # decided without a statement on the ledger
        recording, readable = await traced.store.recording(turn, replay.attempt_id, window_s=300,
                                                           deadline=time.monotonic() + 5)
        assert readable and recording.body == b"data: done\n\n" and traced.statements == []

        # the ledger, asked itself by another process, decides the same
        peer = Ledger(str(tmp_path / "ledger.sqlite3"), "peer")
        peer.open(time.time())
        try:
            assert peer.admit(turn, method="POST", path="/v1/responses", now=time.time(),
                              guard=GUARD, flow_id="g") == replay
        finally:
            peer.close()

        # a decision the memory cannot know goes to the ledger
        other = await traced.admit(ident("another turn"))
        assert isinstance(other, policy.Dispatch) and traced.statements
        traced.statements.clear()
        replay_off = policy.GuardPolicy(replay=False, replay_window_s=300, retention_s=3600)
        assert isinstance(await traced.admit(turn, replay_off), policy.Dispatch)
        assert traced.statements  # replay off: dispatched again, by the ledger's claim
    finally:
        traced.store.close()


async def test_a_key_reused_with_another_body_or_a_passed_window_is_decided_by_the_ledger(
        tmp_path):
    traced = Traced(str(tmp_path / "ledger.sqlite3"))
    try:
        keyed = ident("first body", idempotency_key="key-1")
        claim = await traced.admit(keyed)
        assert await traced.complete(keyed, claim.attempt_id, b"data: one\n\n")
        traced.statements.clear()
        assert await traced.admit(ident("second body", idempotency_key="key-1")) \
            == policy.Conflict()
        assert traced.statements

        plain = ident("short window")
        claim = await traced.admit(plain)
        assert await traced.complete(plain, claim.attempt_id, b"data: two\n\n")
        await asyncio.sleep(0.05)
        traced.statements.clear()
        again = await traced.admit(plain, policy.GuardPolicy(
            replay=True, replay_window_s=0.01, retention_s=3600))
        assert isinstance(again, policy.Dispatch) and traced.statements
    finally:
        traced.store.close()


async def test_a_recording_whose_attempt_was_reaped_meanwhile_is_not_replayed(tmp_path):
    """A reaper ended the attempt (this process looked dead) before its end was written: the
    ledger refuses the end and dispatches the operation again as a retry; the memory must not
    answer with the recording the ledger never took."""
    path = str(tmp_path / "ledger.sqlite3")
    traced = Traced(path)
    try:
        turn = ident("reaped turn")
        claim = await traced.admit(turn)
        reaper = Ledger(path, "reaper")
        reaper.open(time.time())
        try:
            assert reaper.reap_instance("me", now=time.time()) \
                == [turn.op_key]
        finally:
            reaper.close()
        assert not await traced.complete(turn, claim.attempt_id, b"data: late\n\n")
        traced.statements.clear()
        decision = await traced.admit(turn)
        assert decision == policy.Dispatch("retry", decision.attempt_id)
        assert traced.statements
    finally:
        traced.store.close()


# -- a ledger file replaced under the store --------------------------------------------------------


async def test_an_end_owed_to_a_deleted_ledger_file_is_recorded_whole_in_the_new_one(tmp_path):
    """An attempt's end that is written after its ledger file was deleted names a row that
    file had: it goes into the new file whole (operation, attempt, end), so other processes
    replay the turn instead of running it again; nothing is dropped."""
    path = tmp_path / "ledger.sqlite3"
    traced = Traced(str(path))
    store = traced.store
    try:
        turn = ident("ended after the delete")
        claim = await traced.admit(turn)
        old = traced.file_deleted(path)
        assert store.memory.carrying
        traced.end_owed(turn, claim.attempt_id, old, b"data: end\n\n")
        assert await store.recover(time.monotonic() + 5)
        assert not [e for e, _ in traced.events if e == "ledger_writes_dropped"]
        replayed_by_a_peer(path, turn, b"data: end\n\n")
    finally:
        store.close()


async def test_a_store_made_after_a_reload_registers_attempts_of_another_file_first(tmp_path):
    """A script reload makes a new store around the process's memory and attempts. When the
    file at the path is not the one the process used (deleted just before), the new store
    learns it (what the old file said still decides) and registers the attempts in flight
    there before any decision reads it."""
    path = tmp_path / "ledger.sqlite3"
    traced = Traced(str(path))
    turn = ident("in flight across a reload")
    claim = await traced.admit(turn)
    attempt = StoreAttempt(turn, claim.attempt_id, traced.store.generation, circuit_scope=SCOPE)
    traced.store.close()
    delete_ledger(path)
    reloaded = FailoverStore(
        instance_id="me", identity=liveness.read_process_identity(), emit=lambda e, **f: None,
        memory=traced.store.memory, kept=collections.deque(), attempts=lambda: [attempt],
        on_reregistered=lambda n: None)
    try:
        assert reloaded.open(str(path))
        assert reloaded.memory.carrying and not reloaded.usable
        assert reloaded.down_reason() == "attempts in flight to register"
        assert await reloaded.recover(time.monotonic() + 5)
        assert attempt.generation == reloaded.generation and reloaded.usable
        peer = Ledger(str(path), "peer")
        peer.open(time.time())
        try:
            assert peer.snapshot(turn.op_key).state == "in_flight"
        finally:
            peer.close()
    finally:
        reloaded.close()


async def test_a_backlog_of_own_recordings_moves_to_a_new_file_in_batches_the_loop_free_between(
        tmp_path, monkeypatch):
    """1,000 turns this process completed, then their ledger file deleted: as it moves to the
    new file it records every one of them there (a peer replays the oldest and the newest),
    a hundred a transaction, and the event loop runs other tasks between the batches (one
    transaction each held the loop for the whole backlog: up to 2 s, 10,000 recordings).
    The move's bound is the test's own (30 s): on a loaded machine 2 s moved 700."""
    from turnguard_core import failover

    monkeypatch.setattr(failover, "MOVE_RECORDINGS_S", 30.0)
    path = tmp_path / "ledger.sqlite3"
    traced = Traced(str(path))
    store = traced.store
    try:
        turns = await completed_turns(traced, 1000)
        traced.file_deleted(path)
        statements: list[str] = []
        store._store._runner.ledger._db.set_trace_callback(statements.append)
        ticks = 0

        async def other_task() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other_task())
        await asyncio.sleep(0)
        at_start = ticks
        assert await store.recover(time.monotonic() + 30), (store.error, traced.events[-3:])
        ticked = ticks - at_start
        ticker.cancel()
        moved = [f for e, f in traced.events if e == "recordings_moved"]
        assert [f["recordings"] for f in moved] == [1000]
        transactions = sum(s.startswith("BEGIN") for s in statements)
        assert transactions <= 1000 // 100 + 5, transactions  # (the probe, the move's mark)
        assert ticked >= 1000 // 100 - 1, ticked
        for turn in (turns[0], turns[-1]):
            replayed_by_a_peer(path, turn, body_of(turn))
    finally:
        store.close()


async def test_a_lock_taken_on_the_new_file_between_two_batches_of_the_move_loses_nothing(
        tmp_path, monkeypatch):
    """Another connection takes the new file's write lock just before the move's third batch
    (the ledger locked at that very step) and holds it until that batch has waited for it a
    tenth of a second on the ledger's thread, the event loop running meanwhile (it polls the
    wait and ends the lock): the move goes on once it is gone, and every recording is moved,
    each once (a peer replays the oldest and the newest). The move's bound is the test's
    own (10 s): on a loaded machine the lock and the batches once went past 2 s. So is the
    busy timeout (5 s): the lock was once held a fixed 0.5 s, the busy timeout itself, and
    on a loaded machine its end, due on the event loop, came after the batch had given up."""
    from turnguard_core import failover

    monkeypatch.setattr(failover, "MOVE_RECORDINGS_S", 10.0)
    monkeypatch.setattr(failover, "LEDGER_BUSY_MS", 5000)
    path = tmp_path / "ledger.sqlite3"
    traced = Traced(str(path))
    store = traced.store
    locker = None
    try:
        turns = await completed_turns(traced, 500)
        traced.file_deleted(path)
        locker = sqlite3.connect(path, timeout=10, isolation_level=None)
        moving, batches = store._store.write_all, 0
        waited_for: list[bool] = []  # whether the batch was seen waiting when the lock ended
        ending: list[asyncio.Task] = []

        async def end_the_lock_once_waited_for() -> None:
            runner = store._store._runner
            for _ in range(500):  # every 10 ms, 5 s at most
                if runner.in_one_call_for() >= 0.1:
                    break
                await asyncio.sleep(0.01)
            waited_for.append(runner.in_one_call_for() > 0)
            locker.execute("COMMIT")

        async def write_all(writes, *, deadline):
            nonlocal batches
            batches += 1
            if batches == 3:
                locker.execute("BEGIN IMMEDIATE")
                ending.append(asyncio.create_task(end_the_lock_once_waited_for()))
            return await moving(writes, deadline=deadline)

        store._store.write_all = write_all
        assert await store.recover(time.monotonic() + 30), (store.error, traced.events[-3:])
        assert waited_for == [True]
        assert batches == 5
        assert sum(f["recordings"] for e, f in traced.events if e == "recordings_moved") == 500
        assert locker.execute("SELECT COUNT(*), COUNT(DISTINCT op_key) FROM attempts"
                              ).fetchone() == (500, 500)
        for turn in (turns[0], turns[-1]):
            replayed_by_a_peer(path, turn, body_of(turn))
    finally:
        if locker is not None:
            locker.close()
        store.close()


async def test_a_move_cut_by_its_calls_deadline_reports_every_recording_moved(
        tmp_path, monkeypatch):
    """A recovery whose deadline cuts the move in its second batch, then the next that moves
    the rest: the ``recordings_moved`` of the two calls add up to every recording moved, each
    once (the first call's batch was never reported: 400 of 500). The move's own bound is the
    test's (30 s), so that only the deadline cuts it."""
    from turnguard_core import failover

    monkeypatch.setattr(failover, "MOVE_RECORDINGS_S", 30.0)
    path = tmp_path / "ledger.sqlite3"
    traced = Traced(str(path))
    store = traced.store
    try:
        await completed_turns(traced, 500)
        traced.file_deleted(path)
        moving, batches = store._store.write_all, 0

        async def write_all(writes, *, deadline):
            nonlocal batches
            batches += 1
            if batches == 2:
                await asyncio.sleep(60)  # (cut by the recovery's deadline)
            return await moving(writes, deadline=deadline)

        store._store.write_all = write_all
        assert not await store.recover(time.monotonic() + 5)
        assert batches == 2
        assert await store.recover(time.monotonic() + 30), (store.error, traced.events[-3:])
        moved = [f["recordings"] for e, f in traced.events if e == "recordings_moved"]
        assert moved == [100, 400]
        with sqlite3.connect(path) as reader:
            assert reader.execute("SELECT COUNT(*), COUNT(DISTINCT op_key) FROM attempts"
                                  ).fetchone() == (500, 500)
    finally:
        store.close()


def test_the_recordings_moved_are_cut_into_batches_by_count_and_by_bytes():
    """``MOVE_BATCH`` recordings a batch at most, and ``MOVE_BATCH_BYTES`` of bodies at most
    unless one alone is more (then alone); in their order, none left out."""
    from turnguard_core import failover
    from turnguard_core.knowledge import KnownRecording
    from turnguard_core.store import OfflineEndWrite

    def known(n: int, size: int) -> KnownRecording:
        recording = Recording(200, (), b"x" * size)
        moved = OfflineEndWrite(ident(f"turn {n}"), "POST", "/v1/responses", "original", "f",
                                None, AttemptEnd("completed", 200, 3, None, recording), 1000.0,
                                moving=True)
        return KnownRecording(recording, 1000.0, "f", n, "gen-1", moved)

    def sizes(batches):
        return [[len(k.recording.body) for k in batch] for batch in batches]

    small = [known(n, 10) for n in range(250)]
    batches = list(failover._move_batches(small))
    assert [len(b) for b in batches] == [100, 100, 50]
    assert [k for b in batches for k in b] == small
    mib = failover.MOVE_BATCH_BYTES
    big = [known(0, mib // 2), known(1, mib // 2), known(2, 1), known(3, 2 * mib), known(4, 1)]
    assert sizes(failover._move_batches(big)) == [[mib // 2, mib // 2], [1], [2 * mib], [1]]
    assert list(failover._move_batches([])) == []


async def test_an_end_recorded_whole_in_a_new_file_moves_again_when_that_file_goes(tmp_path):
    """An attempt's end written after its ledger file was deleted is recorded whole in the new
    file (above); when that file goes too, the process moves the recording on into the third
    one like any other of its own, so a peer there replays the turn rather than run it again
    (before, memory still named the first file for it, and it was moved nowhere)."""
    path = tmp_path / "ledger.sqlite3"
    traced = Traced(str(path))
    store = traced.store
    store.replay_window_of = lambda i: GUARD.replay_window_s  # (the shell's: the guard's)
    try:
        turn = ident("ended after the delete, then its new file deleted")
        claim = await traced.admit(turn)
        first = traced.file_deleted(path)
        traced.end_owed(turn, claim.attempt_id, first, b"data: end\n\n")
        assert await store.recover(time.monotonic() + 5)
        traced.file_deleted(path)
        assert await store.recover(time.monotonic() + 5)
        assert [f["recordings"] for e, f in traced.events if e == "recordings_moved"] == [1]
        replayed_by_a_peer(path, turn, b"data: end\n\n")
    finally:
        store.close()


async def test_a_report_of_the_file_left_from_its_heartbeat_does_not_close_the_new_one(tmp_path):
    """A ledger file's heartbeat can report it gone after the process left it for the new
    file at the path (a report made before that heartbeat stopped, which comes through the
    event loop): the new file stays in use, and the move to it goes on. (Before, the report
    closed the new file and began another outage: in the backlog test above, under load, the
    move's catch-up then failed.)"""
    path = tmp_path / "ledger.sqlite3"
    traced = Traced(str(path))
    store = traced.store
    try:
        report_of_the_old_file = store._heartbeat._on_file_gone
        traced.file_deleted(path)
        new = store._store
        report_of_the_old_file(f"ledger file {path} was replaced by another file")
        await asyncio.sleep(0.05)  # (the report comes through the event loop)
        assert store._store is new
        assert await store.recover(time.monotonic() + 5) and store.usable
        assert [e for e, _ in traced.events].count("ledger_unavailable") == 1
    finally:
        store.close()
