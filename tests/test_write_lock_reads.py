"""Another connection's write lock keeps the SQLite ledger from being written, not read: a
request's read goes to the ledger behind it (``FailoverStore._only_locked``), so a turn another
process completed is replayed, never run again from this process's memory, whatever else waits
for the lock on the ledger's one connection. On a real ledger file, through ``FailoverStore``,
with a real lock held by another connection."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time

import pytest

from turnguard_core import failover, policy
from turnguard_core.ledger_runner import contended
from turnguard_core.ledger import AttemptEnd, Ledger, Recording

from test_own_replays import GUARD, SCOPE, Traced, ident


@contextlib.contextmanager
def completed_elsewhere_then_locked(tmp_path, text, *, locked=True):
    """A store on a ledger where another process (``peer``) completed the turn ``text``, then
    another connection holds the write lock (``locked``): (store, turn, the attempt to
    replay)."""
    path = str(tmp_path / "ledger.sqlite3")
    traced = Traced(path)
    peer = Ledger(path, "peer")
    peer.open(time.time())
    blocker = sqlite3.connect(path, isolation_level=None, timeout=1)
    try:
        turn = ident(text)
        claim = peer.admit(turn, method="POST", path="/v1/responses", now=time.time(),
                           guard=GUARD, flow_id="g")
        recording = Recording(200, (("content-type", "text/event-stream"),), b"data: done\n\n")
        peer.finish(claim.attempt_id, AttemptEnd("completed", 200, 3, None, recording),
                    now=time.time(), op_key=turn.op_key)
        if locked:
            blocker.execute("BEGIN IMMEDIATE")
        yield traced, turn, claim.attempt_id
    finally:
        blocker.close()
        peer.close()
        traced.store.close()


def claim_session(traced):
    """A request's session claim (a write): it waits for the lock until its 0.5 s bound."""
    return traced.store.claim_session("sess", now=time.time(), lease_s=15, new_id="x",
                                      deadline=time.monotonic() + 0.5)


def admit(traced, turn):
    """A request's admission, within the bound a request gives the ledger (0.5 s)."""
    return traced.store.admit(
        turn, method="POST", route="/v1/responses", flow_id="f", circuit_scope=SCOPE,
        recovery=None, once_mode=False, in_flight_here=lambda: False, guard=GUARD,
        window_s=GUARD.replay_window_s, threshold=2, deadline=time.monotonic() + 0.5)


async def test_a_call_queued_past_its_bound_behind_the_lock_does_not_send_reads_to_memory(
        tmp_path):
    """Two requests meet the lock together: the first's session claim waits 0.5 s for it, the
    second's is still queued behind it at its own bound and gives up unrun ("gave up
    waiting"), which says nothing new of the ledger. The next request for a turn another
    process completed still reads the ledger and replays it, where it was decided in memory
    (a dispatch: the turn run again)."""
    with completed_elsewhere_then_locked(tmp_path, "a turn completed elsewhere") \
            as (traced, turn, attempt_id):
        assert await asyncio.gather(claim_session(traced), claim_session(traced)) == [None, None]
        assert await admit(traced, turn) == policy.Replay(attempt_id)


async def test_the_maintenances_write_behind_the_lock_does_not_hold_up_a_requests_read(tmp_path):
    """The ticker's purge of old recordings (a write nobody waits for) is the first to meet the
    lock: it gives up after a moment (tried again at the next purge), where it held the
    ledger's one connection for the whole busy timeout (5 s), so that a request's read queued
    behind it passed its bound and the turn another process completed was decided in memory
    (run again)."""
    with completed_elsewhere_then_locked(tmp_path, "a turn completed before the purge") \
            as (traced, turn, attempt_id):
        purge = asyncio.ensure_future(traced.store.purge_recordings(time.time(), window_s=300))
        await asyncio.sleep(0.02)
        assert await admit(traced, turn) == policy.Replay(attempt_id)
        await purge


async def test_the_renewal_of_a_held_sessions_lease_behind_the_lock_does_not_hold_up_a_requests_read(
        tmp_path):
    """The ticker renews the lease of a session with a request held through a cooldown (once
    mode), a write, and is the first to meet the lock: it gives up after a moment (the
    lease's margin covers the next try), so a request's read queued behind it still replays
    the turn another process completed."""
    with completed_elsewhere_then_locked(tmp_path, "a turn completed before the renewal") \
            as (traced, turn, attempt_id):
        renewal = asyncio.ensure_future(
            traced.store.renew_session("sess", 1, now=time.time(), lease_s=15))
        await asyncio.sleep(0.02)
        assert await admit(traced, turn) == policy.Replay(attempt_id)
        assert await renewal is None  # not renewed, and not taken for an outage
        assert traced.store.usable


async def test_duplicate_counts_written_at_their_bound_behind_the_lock_do_not_hold_up_a_requests_read(
        tmp_path):
    """Duplicates of ``MAX_UNWRITTEN_COUNTS`` operations within one tick have their counts
    written at once rather than at the ticker's next turn; that write too gives up on the lock
    after a moment (the counts are dropped, as the ticker's are), so a request's read queued
    behind it still replays the turn another process completed."""
    with completed_elsewhere_then_locked(tmp_path, "a turn completed before the counts") \
            as (traced, turn, attempt_id):
        for n in range(failover.MAX_UNWRITTEN_COUNTS):
            traced.store.note_duplicates(f"op{n}", held=1)
        await asyncio.sleep(0.02)
        assert await admit(traced, turn) == policy.Replay(attempt_id)
        assert traced.store.usable


async def test_duplicate_counts_at_their_bound_are_written_without_waiting_for_the_ticker(
        tmp_path):
    """Without a lock, the counts written at the bound reach the ledger (on the operation a
    duplicate was counted on), before any tick."""
    with completed_elsewhere_then_locked(tmp_path, "a turn with duplicates", locked=False) \
            as (traced, turn, _):
        traced.store.note_duplicates(turn.op_key, held=1, replayed=1)
        for n in range(failover.MAX_UNWRITTEN_COUNTS - 1):
            traced.store.note_duplicates(f"op{n}", held=1)
        await asyncio.sleep(0.3)
        with contextlib.closing(sqlite3.connect(tmp_path / "ledger.sqlite3")) as db:
            assert db.execute("SELECT duplicates_held, duplicates_replayed FROM operations "
                              "WHERE op_key=?", (turn.op_key,)).fetchall() == [(1, 1)]


@pytest.mark.parametrize("reading", ["its admission", "its recording"])
async def test_a_request_whose_call_came_back_unread_as_the_outage_ended_still_reads_apart(
        tmp_path, monkeypatch, reading):
    """A request's call (the admission of a retry of a turn another process completed, or
    the read of that turn's recording) is queued behind a session claim that waits for the
    lock, and comes back unread once the lock failed the claim. Then, before the request
    is decided, the outage ends: the lock goes and another request's probe writes the ledger
    (a full run on a busy machine found it on PostgreSQL, whose probe then wrote
    ``instances`` alone, which a lock of ``operations`` and ``attempts`` lets through). The
    request is still decided as in that outage: the ledger is read apart and the turn
    replayed, where memory, blind to it, dispatched it again (the turn run twice), or
    answered its replay 503. The claim waits 2 s on the lock (the busy timeout is the
    test's), the request's call queued once the claim is seen waiting: with the 0.5 s
    default, an event loop starved that long on a busy machine let the claim fail before the
    call was made, and the request read apart without a call to come back unread."""
    # (read as the store opens its connection)
    monkeypatch.setattr(failover, "LEDGER_BUSY_MS", 2000)
    with completed_elsewhere_then_locked(tmp_path, f"reading {reading} as the outage ends",
                                         locked=False) as (traced, turn, attempt_id):
        store = traced.store
        blocker = sqlite3.connect(tmp_path / "ledger.sqlite3", isolation_level=None, timeout=1)
        call = store._call
        ended = []

        async def unread_as_the_outage_ends(during, *args, **kwargs):
            answer = await call(during, *args, **kwargs)
            if during in ("admit", "replay") and answer is failover.UNREAD and not ended:
                assert contended(store.error), store.error  # (the claim met the lock first)
                blocker.execute("ROLLBACK")
                ended.append(await store.recover(time.monotonic() + 2))
            return answer

        monkeypatch.setattr(store, "_call", unread_as_the_outage_ends)
        # the request's call waits for its answer past its bound (``LEDGER_LATE_S``) for the
        # claim ahead of it to meet the lock (2 s): on a busy machine that may come later
        # than 0.25 s past the bound, and the call must be answered unread, not given up on
        monkeypatch.setattr(failover, "LEDGER_LATE_S", 5.0)
        try:
            blocker.execute("BEGIN IMMEDIATE")
            session = asyncio.ensure_future(store.claim_session(  # (waits 2 s)
                "sess", now=time.time(), lease_s=15, new_id="x", deadline=time.monotonic() + 2))
            runner = store._store._runner
            for _ in range(500):  # every 10 ms, 5 s at most: until it waits on the thread
                if runner.in_one_call_for() > 0:
                    break
                await asyncio.sleep(0.01)
            # queued behind it, past its own bound (0.4 s) when the thread comes to it
            deadline = time.monotonic() + 0.4
            if reading == "its admission":
                answer = await store.admit(
                    turn, method="POST", route="/v1/responses", flow_id="f",
                    circuit_scope=SCOPE, recovery=None, once_mode=False,
                    in_flight_here=lambda: False, guard=GUARD,
                    window_s=GUARD.replay_window_s, threshold=2, deadline=deadline,
                    hold_until=time.monotonic() + 30)  # (as a request's: its hold bound)
            else:
                answer = await store.recording(turn, attempt_id,
                                               window_s=GUARD.replay_window_s,
                                               deadline=deadline)
            assert await session is None
        finally:
            blocker.close()
    assert ended == [True], "the request's call was answered: no outage ended as it waited"
    assert store.error is None
    if reading == "its admission":
        assert answer == policy.Replay(attempt_id), f"decided blind: {answer}"
    else:
        recording, readable = answer
        assert readable and recording is not None and recording.body == b"data: done\n\n"


async def test_no_more_than_reads_apart_max_reads_apart_run_at_once(tmp_path, monkeypatch):
    """Ten requests for turns another process completed come together while the lock keeps
    the ledger from being written, once the store met it: each reads the ledger apart, on a
    connection of its own, but no more than ``READS_APART_MAX`` such reads run at once (a
    flood of requests in an outage must not open a connection each); every request is
    answered, the first ones read apart replay their turns."""
    path = str(tmp_path / "ledger.sqlite3")
    traced = Traced(path)
    peer = Ledger(path, "peer")
    peer.open(time.time())
    blocker = sqlite3.connect(path, isolation_level=None, timeout=1)
    running, most = 0, 0
    real = Ledger.read_apart

    def counted(self, read):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            time.sleep(0.05)  # (long enough for the reads that come together to overlap)
            return real(self, read)
        finally:
            running -= 1

    try:
        turns = {}
        for n in range(10):
            turn = ident(f"a turn completed elsewhere, {n}")
            claim = peer.admit(turn, method="POST", path="/v1/responses", now=time.time(),
                               guard=GUARD, flow_id="g")
            recording = Recording(200, (("content-type", "text/event-stream"),), b"data: x\n\n")
            peer.finish(claim.attempt_id, AttemptEnd("completed", 200, 3, None, recording),
                        now=time.time(), op_key=turn.op_key)
            turns[turn] = claim.attempt_id
        blocker.execute("BEGIN IMMEDIATE")
        assert await claim_session(traced) is None  # the store meets the lock
        monkeypatch.setattr(Ledger, "read_apart", counted)
        answers = await asyncio.gather(*(admit(traced, turn) for turn in turns))
    finally:
        blocker.close()
        peer.close()
        traced.store.close()
    assert most <= failover.READS_APART_MAX, f"{most} reads apart at once"
    assert most == failover.READS_APART_MAX, most  # (they did run together, up to the cap)
    assert all(isinstance(a, (policy.Replay, policy.Dispatch, policy.Hold)) for a in answers)
    replayed = [a for a, attempt in zip(answers, turns.values()) if a == policy.Replay(attempt)]
    assert len(replayed) >= failover.READS_APART_MAX, answers



async def test_a_turn_run_from_memory_while_its_duplicate_read_apart_is_not_claimed_again(
        tmp_path, monkeypatch):
    """The store met the lock, so a request reads the ledger apart before its claim, and again
    once the claim came back unread. A turn's claim waits until its bound, then, after that
    second read apart, memory decides it and it runs here (no row of it in the ledger). Its
    duplicate, through the same process, came during that read (the turn not yet in flight)
    and was still reading apart itself when the turn went upstream (reads that take 3 s with
    a bound of 2 s: a busy machine's); the lock then goes, and the ledger, which has no row of
    the turn, gives the duplicate a claim. That claim is not a second run in the process that
    runs the turn: the duplicate is held on it. (Before, the dispatches from memory that the
    claim may meet were counted from after the duplicate's read apart: a full run on a busy
    machine ran such a turn twice, 11 ms apart, in
    test_at_most_once.py::test_a_claim_answered_after_its_turn_went_upstream_from_memory_does_not_run_it_again.)"""
    path = str(tmp_path / "ledger.sqlite3")
    traced = Traced(path)
    blocker = sqlite3.connect(path, isolation_level=None, timeout=1)
    real = Ledger.read_apart
    turn = ident("a turn run from memory while its duplicate read apart")
    running: set[str] = set()

    def slow(self, read):
        time.sleep(3.0)
        return real(self, read)

    def admit_within(bound_s: float):
        return traced.store.admit(
            turn, method="POST", route="/v1/responses", flow_id="f", circuit_scope=SCOPE,
            recovery=None, once_mode=False, in_flight_here=lambda: turn.op_key in running,
            guard=GUARD, window_s=GUARD.replay_window_s, threshold=2,
            deadline=time.monotonic() + bound_s)

    try:
        blocker.execute("BEGIN IMMEDIATE")
        assert await claim_session(traced) is None  # the store meets the lock
        monkeypatch.setattr(Ledger, "read_apart", slow)
        monkeypatch.setattr(failover, "READ_APART_WHILE_DOWN_S", 2.0)
        original = asyncio.ensure_future(admit_within(0.5))
        await asyncio.sleep(0.75)  # (the turn's second read apart: 0.5 s to 2.5 s)
        duplicate = asyncio.ensure_future(admit_within(8.0))
        assert not original.done()  # (the turn is not in flight yet as its duplicate comes)
        first = await original
        assert isinstance(first, policy.Dispatch) and first.attempt_id is None, first
        running.add(turn.op_key)  # (it runs here, dispatched from memory)
        assert not duplicate.done()  # (still reading apart: until 2.75 s)
        blocker.execute("ROLLBACK")
        second = await duplicate
        claims = query_attempts(path)
    finally:
        blocker.close()
        traced.store.close()
    assert isinstance(second, policy.Hold), f"the turn ran twice here: {second}"
    assert claims, "the ledger never answered the duplicate's claim"


def query_attempts(path: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT attempt_id, outcome FROM attempts").fetchall()
