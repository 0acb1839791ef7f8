"""``turnguard.status``'s reads of the ledger never hold the event loop nor the ledger's calls:
the count of operations by state (``counting.OperationCounter``) runs on a connection and a
thread of its own, at most one at a time, and its last result is kept with its age; the
cooling circuits are read on the ledger's thread at most once at a time, waited for within a
bound. Counts and order, never timings (a fake clock; gates the test opens)."""

from __future__ import annotations

import concurrent.futures
import sqlite3
import threading
import time

import pytest

from turnguard_core.counting import OperationCounter, OperationCounts, count_due
from turnguard_core.ledger import LedgerError
from turnguard_core.ledger_admin import LedgerAdmin
from turnguard_core.ledger_runner import LedgerRunner
from turnguard_core.store import LedgerStore

WAIT_S = 10.0  # bound of every wait for a thread here


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_count_is_due_when_none_runs_and_the_last_one_is_old():
    assert count_due(running=False, finished_at=None, now=5.0, max_age_s=1.0)
    assert not count_due(running=True, finished_at=None, now=5.0, max_age_s=1.0)
    assert not count_due(running=False, finished_at=4.5, now=5.0, max_age_s=1.0)
    assert count_due(running=False, finished_at=4.0, now=5.0, max_age_s=1.0)
    assert not count_due(running=True, finished_at=1.0, now=5.0, max_age_s=1.0)


def test_a_slow_count_is_shown_on_a_later_read_and_never_twice_at_once():
    clock, release, calls = Clock(), threading.Event(), []

    def count() -> dict[str, int]:
        calls.append(1)
        assert release.wait(WAIT_S)
        return {"completed": 7}

    counter = OperationCounter(count, clock=clock)
    assert counter.read(wait_s=0) == OperationCounts(None, None, True, None)
    clock.now += 5  # however long it runs, no second count starts meanwhile
    assert counter.read(wait_s=0) == OperationCounts(None, None, True, None)
    assert len(calls) == 1
    release.set()
    for _ in range(2000):  # at most 10 s
        seen = counter.read(wait_s=0)
        if not seen.counting:
            break
        time.sleep(0.005)
    assert seen == OperationCounts({"completed": 7}, 0, False, None)
    clock.now += 0.5  # fresh enough: not counted again, its age said
    assert counter.read(wait_s=0) == OperationCounts({"completed": 7}, 500, False, None)
    assert len(calls) == 1
    clock.now += 0.5  # a second old: counted again, waited for (a fast count is fresh)
    assert counter.read(wait_s=WAIT_S) == OperationCounts({"completed": 7}, 0, False, None)
    assert len(calls) == 2


def test_a_failed_count_says_why_beside_the_last_counts():
    clock, results = Clock(), [{"completed": 3}, LedgerError("database is locked"), {"x": 1}]

    def count() -> dict[str, int]:
        r = results.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    counter = OperationCounter(count, clock=clock)
    assert counter.read(wait_s=WAIT_S) == OperationCounts({"completed": 3}, 0, False, None)
    clock.now += 2
    assert counter.read(wait_s=WAIT_S) == OperationCounts(
        {"completed": 3}, 2000, False, "database is locked")
    clock.now += 2
    assert counter.read(wait_s=WAIT_S) == OperationCounts({"x": 1}, 0, False, None)


@pytest.fixture
def store(tmp_path):
    led = LedgerAdmin(str(tmp_path / "l.sqlite3"), "a")
    led.open(1000.0)
    runner = LedgerRunner(led)
    yield LedgerStore(runner), runner
    runner.close()


def test_the_count_runs_on_a_connection_of_its_own_while_the_ledgers_thread_is_busy(
        store, tmp_path):
    """The ledger's thread held by a call (a claim waiting for a lock): the count still runs,
    read-only, and the circuits' read waits in its queue, once however often asked."""
    led_store, runner = store
    db = sqlite3.connect(tmp_path / "l.sqlite3", isolation_level=None)
    db.execute("INSERT INTO operations (op_key, scope, method, path, fingerprint, state,"
               " created_at, updated_at) VALUES ('k', 's', 'POST', '/', 'f', 'completed', 1, 1)")
    db.close()
    held, release = threading.Event(), threading.Event()

    def busy(_led):
        held.set()
        return release.wait(WAIT_S)

    blocking = runner.submit(busy)
    assert held.wait(WAIT_S)
    counts = led_store.operation_counts(wait_s=WAIT_S)
    assert counts.by_state == {"completed": 1} and counts.error is None
    first = led_store.read_open_circuits(2000.0)
    assert led_store.read_open_circuits(2000.0) is first  # one at a time
    with pytest.raises(concurrent.futures.TimeoutError):
        first.result(0)
    release.set()
    assert blocking.result(WAIT_S) is True
    assert first.result(WAIT_S) == []
    assert led_store.read_open_circuits(2000.0) is not first
