"""A write owed to the ledger (an attempt's end kept while another connection held the write
lock) is applied once, however often it is sent: a catch-up that stops waiting for its write
(a request's deadline passes, a script reload stops the ticker: ``test_at_most_once.py``)
leaves that write to run, and land, on the ledger's thread, and the catch-up after it must
not apply it a second time. On a real ledger file, through ``FailoverStore``, with a real lock
held by another connection and a gate in front of the ledger's ``finish`` (order, not
time)."""

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
from test_own_replays import SCOPE, Traced, ident


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
