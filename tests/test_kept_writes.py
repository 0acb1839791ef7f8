"""A write owed to the ledger (an attempt's end kept while another connection held the write
lock) is applied once, however often it is sent: a catch-up that stops waiting for its write
(a request's deadline passes, a script reload stops the ticker: ``test_at_most_once.py``)
leaves that write to run, and land, on the ledger's thread, and the catch-up after it must
not apply it a second time. On a real ledger file, through ``FailoverStore``, with a real lock
held by another connection and a gate in front of the ledger's ``finish`` (order, not
time). So is a request's catch-up that a script reload interrupts: the request still gets a
decision (from memory; the instance loaded next decides it again), never an exception."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time

import pytest

from turnguard_core import circuit, ledger, policy
from turnguard_core.ending import AttemptEnding
from turnguard_core.ledger import AttemptEnd, LedgerError, Recording

from store_attempt import StoreAttempt
from test_own_replays import GUARD, SCOPE, Traced, ident


class FinishGate:
    """A gate in front of ``Ledger.finish``: while it is closed, a finish on the ledger's
    thread waits there (``entered`` is set then); one the event loop runs itself (the
    runner's fast path) fails as if the database were locked, so that the runner hands it to
    its thread, as it does for a lock. ``returned``: the finishes that ran (applied or
    fenced out)."""

    def __init__(self, monkeypatch) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.entered = threading.Event()
        self.returned = 0
        finish = ledger.Ledger.finish

        def gated(led, *args, **kwargs):
            if not self.opened.is_set():
                with contextlib.suppress(RuntimeError):
                    asyncio.get_running_loop()
                    raise LedgerError("database is locked (the finish gate is closed)")
                self.entered.set()
                assert self.opened.wait(30)
            result = finish(led, *args, **kwargs)
            self.returned += 1
            return result

        monkeypatch.setattr(ledger.Ledger, "finish", gated)


def read(path: str, sql: str) -> list[tuple]:
    db = sqlite3.connect(path, timeout=10)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


async def test_an_owed_end_whose_write_outlives_its_catch_up_is_applied_once(tmp_path,
                                                                             monkeypatch):
    """The end of a completed turn is kept (the ledger locked); the lock goes, and a catch-up
    sends it: the write is under way on the ledger's thread when the catch-up stops waiting
    (cancelled, as a passed deadline or a reload's stop of the ticker cancels it). It lands.
    The next catch-up gets its result without writing it again: no second ``finish`` (fenced
    out, it was said as if the attempt had been reaped, kept as its ``late_outcome``, and the
    recording this process would replay from memory forgotten)."""
    path = str(tmp_path / "ledger.sqlite3")
    gate = FinishGate(monkeypatch)
    traced = Traced(path)
    blocker = sqlite3.connect(path, isolation_level=None, timeout=1)
    try:
        turn = ident("an end owed, its write outliving its catch-up")
        claim = await traced.admit(turn)
        assert isinstance(claim, policy.Dispatch)
        recording = Recording(200, (("content-type", "text/event-stream"),), b"data: done\n\n")
        blocker.execute("BEGIN IMMEDIATE")
        sent = traced.store.finish(
            StoreAttempt(turn, claim.attempt_id, traced.store.generation, circuit_scope=SCOPE),
            AttemptEnding("completed", recording, None, False, None, None),
            AttemptEnd("completed", 200, 3, None, recording), now=time.time(),
            circuit_cfg=circuit.CircuitConfig(), base={})
        with pytest.raises(LedgerError):
            await sent
        assert traced.store.kept_writes == 1  # kept: the lock
        blocker.execute("ROLLBACK")

        gate.opened.clear()
        catch_up = asyncio.ensure_future(traced.store.recover(time.monotonic() + 30))
        assert await asyncio.to_thread(gate.entered.wait, 10)  # its write under way
        catch_up.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await catch_up
        gate.opened.set()
        for _ in range(1000):  # bounded: the write lands on the ledger's thread
            if read(path, "SELECT state FROM operations") == [("completed",)]:
                break
            await asyncio.sleep(0.01)
        assert read(path, "SELECT state FROM operations") == [("completed",)]
        assert traced.store.kept_writes == 1  # still owed: its catch-up did not see it land

        assert await traced.store.recover(time.monotonic() + 5)
        assert traced.store.kept_writes == 0
        assert gate.returned == 1  # applied once
        assert [event for event, _ in traced.events if event == "outcome_fenced_out"] == []
        assert read(path, "SELECT outcome, late_outcome FROM attempts") == [("completed", None)]
        assert traced.store.memory.recording(turn, now=time.time(), window_s=300) == recording
    finally:
        blocker.close()
        traced.store.close()


async def owe_ends(traced: Traced, path: str, texts: list[str]) -> None:
    """Turns of ``texts`` claimed, then completed while another connection holds the write
    lock: their ends are owed (kept), and the lock is gone again."""
    recording = Recording(200, (("content-type", "text/event-stream"),), b"data: done\n\n")
    claims = [(turn, await traced.admit(turn)) for turn in map(ident, texts)]
    blocker = sqlite3.connect(path, isolation_level=None, timeout=1)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        for turn, claim in claims:
            sent = traced.store.finish(
                StoreAttempt(turn, claim.attempt_id, traced.store.generation,
                             circuit_scope=SCOPE),
                AttemptEnding("completed", recording, None, False, None, None),
                AttemptEnd("completed", 200, 3, None, recording), now=time.time(),
                circuit_cfg=circuit.CircuitConfig(), base={})
            if sent is not None:  # (the second is kept at once: the ledger is down)
                with pytest.raises(LedgerError):
                    await sent
        blocker.execute("ROLLBACK")
    finally:
        blocker.close()
    assert traced.store.kept_writes == len(texts)


@pytest.mark.parametrize("owed", [1, 2])
async def test_a_requests_catch_up_that_a_reload_interrupts_still_decides_the_request(
        tmp_path, monkeypatch, owed):
    """A request's admission finds ends owed to the ledger and writes them first (its
    catch-up); the write of the first is under way (at the gate) when the addon instance is
    unloaded (a script reload closes its store). The admission must still come back with a
    decision: its ``on_retired`` is called first (the addon hands the request to the instance
    a reload loaded, with its ledger: ``test_at_most_once.py``), and when that returns (no
    instance to take it), a decision made from memory. It raised (the store it caught up
    for was gone: AttributeError; with another end owed, the closed ledger's executor
    refused its write: RuntimeError), and the request hook forwarded the request unguarded,
    a duplicate run upstream again. The store is not opened again for the unloaded
    instance, and the ends still owed stay the process's."""
    path = str(tmp_path / "ledger.sqlite3")
    gate = FinishGate(monkeypatch)
    traced = Traced(path)
    try:
        await owe_ends(traced, path, [f"owed {n}" for n in range(owed)])
        gate.opened.clear()
        retired: list[str] = []
        admission = asyncio.ensure_future(traced.store.admit(
            ident("a request whose catch-up spans a reload"), method="POST",
            route="/v1/responses", flow_id="f2", circuit_scope=SCOPE, recovery=None,
            once_mode=False, in_flight_here=lambda: False, guard=GUARD,
            window_s=GUARD.replay_window_s, threshold=2, deadline=time.monotonic() + 30,
            on_retired=lambda: retired.append("the request's ledger call went unread")))
        assert await asyncio.to_thread(gate.entered.wait, 10)  # its catch-up's write
        traced.store.close(write_owed=False, final=True)  # the unload (a script reload)
        gate.opened.set()
        decision = await admission
        assert retired == ["the request's ledger call went unread"]  # asked once, first
        assert isinstance(decision, policy.Dispatch) and decision.attempt_id is None  # memory
        assert not traced.store.is_open  # nothing opened it again
        assert traced.store.kept_writes == owed - 1  # the first landed; the rest still owed
        assert read(path, "SELECT state FROM operations ORDER BY created_at") == \
            [("completed",)] + [("in_flight",)] * (owed - 1)
    finally:
        traced.store.close()


class TakenElsewhere(Exception):
    """What the addon's ``on_retired`` raises (``HandedOver``): the request goes elsewhere."""


@pytest.mark.parametrize("call", ["admit", "recording", "circuit_remaining"])
async def test_a_request_call_a_reload_interrupts_is_offered_to_the_next_instance_first(
        tmp_path, monkeypatch, call):
    """The same interruption (a catch-up's write under way as the store closes for good), for
    each ledger call of a request's loop: its ``on_retired`` is called before memory decides,
    and what it raises (the addon's hand-over to the instance a reload loaded) reaches the
    caller: no decision, no 503 ``ledger_unavailable`` for a recording unread, no cooldown of
    memory's, made for a request the next instance decides from its ledger."""
    path = str(tmp_path / "ledger.sqlite3")
    gate = FinishGate(monkeypatch)
    traced = Traced(path)
    try:
        await owe_ends(traced, path, ["owed"])
        gate.opened.clear()
        turn, deadline = ident(f"a request's {call} that a reload interrupts"), \
            time.monotonic() + 30
        retired: list[str] = []

        def on_retired() -> None:
            retired.append(call)
            raise TakenElsewhere(call)

        asked = {
            "admit": lambda: traced.store.admit(
                turn, method="POST", route="/v1/responses", flow_id="f2",
                circuit_scope=SCOPE, recovery=None, once_mode=False,
                in_flight_here=lambda: False, guard=GUARD, window_s=GUARD.replay_window_s,
                threshold=2, deadline=deadline, on_retired=on_retired),
            "recording": lambda: traced.store.recording(
                turn, 1, window_s=GUARD.replay_window_s, deadline=deadline,
                on_retired=on_retired),
            "circuit_remaining": lambda: traced.store.circuit_remaining(
                SCOPE, deadline=deadline, on_retired=on_retired),
        }[call]
        pending = asyncio.ensure_future(asked())
        assert await asyncio.to_thread(gate.entered.wait, 10)  # its catch-up's write
        traced.store.close(write_owed=False, final=True)  # the unload (a script reload)
        gate.opened.set()
        with pytest.raises(TakenElsewhere):
            await pending
        assert retired == [call]
        assert not traced.store.is_open
    finally:
        traced.store.close()


async def test_a_store_closed_at_an_unload_is_not_opened_again_by_a_call_that_fails_after(
        tmp_path, monkeypatch):
    """A request's ledger call (a session's claim) is under way on the ledger's thread when
    the addon instance is unloaded (its store closed for good), and fails after that (the
    lock it waited for stayed). That failure must not be taken for a ledger file gone: the
    call's second go opened the ledger again, a connection and a heartbeat thread for an
    instance no longer loaded. It is unread (decided from memory) and the store stays
    closed."""
    path = str(tmp_path / "ledger.sqlite3")
    entered, fail = threading.Event(), threading.Event()
    claim = ledger.Ledger.claim_session

    def gated(led, *args, **kwargs):
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            raise LedgerError("database is locked (the claim gate)")  # to the thread
        entered.set()
        assert fail.wait(30)
        raise LedgerError("database is locked")

    monkeypatch.setattr(ledger.Ledger, "claim_session", gated)
    traced = Traced(path)
    try:
        call = asyncio.ensure_future(traced.store.claim_session(
            "sess", now=time.time(), lease_s=15, new_id="x", deadline=time.monotonic() + 30))
        assert await asyncio.to_thread(entered.wait, 10)
        traced.store.close(write_owed=False, final=True)  # the unload (a script reload)
        monkeypatch.setattr(ledger.Ledger, "claim_session", claim)
        fail.set()
        assert await call is None  # unread
        assert not traced.store.is_open
    finally:
        traced.store.close()


async def test_a_request_that_comes_while_the_ledger_is_being_opened_again_waits_for_that(
        tmp_path, monkeypatch):
    """The ledger could not be opened (another connection held its write lock: so a script
    reload's new instance finds it), and the ticker's next try to open it is under way as
    the lock goes, when a request comes. The request must wait for that try (within its
    deadline) and get the ledger's decision: it was decided from memory at once, although
    the ledger opened a moment later (in once mode a retry got 503 ``ledger_unavailable``; a
    duplicate of a turn another process has in flight would have been dispatched again)."""
    from turnguard_core.failover import FailoverStore

    path = str(tmp_path / "ledger.sqlite3")
    traced = Traced(path)
    store = traced.store
    entered, proceed = threading.Event(), threading.Event()
    connect = FailoverStore._connect

    def gated(self, *args, **kwargs):
        entered.set()
        assert proceed.wait(30)
        return connect(self, *args, **kwargs)

    try:
        store.close()
        blocker = sqlite3.connect(path, isolation_level=None, timeout=1)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            assert not store.open(path)  # locked: noted, tried again by the ticker
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        monkeypatch.setattr(FailoverStore, "_connect", gated)
        reopening = asyncio.ensure_future(store.reopen_if_due())  # the ticker's try
        assert await asyncio.to_thread(entered.wait, 10)
        admission = asyncio.ensure_future(traced.admit(ident("a request as the ledger opens")))
        await asyncio.sleep(0.2)  # (it has come, and waits for that try)
        proceed.set()
        await reopening
        decision = await admission
        assert isinstance(decision, policy.Dispatch) and decision.attempt_id is not None
        assert store.is_open
    finally:
        proceed.set()
        store.close()
