"""Wall clocks that jump (an NTP step, a VM resumed, a laptop waking) or differ between the
processes that share a ledger.

Each test runs real mitmdump processes in front of the bundled mock upstream; one of them runs
with its wall clock offset (``time.time`` and ``time.time_ns``, read by turnguard for every
time it writes to the ledger) by an amount the test changes mid-run (``skewed``): a step of
the host's clock, seen by that process before the others act on it, or another host's clock.
``time.monotonic`` is left alone: it never jumps. The upstream's dispatch log counts what ran.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from harness import (
    Mitmdump,
    MockUpstream,
    another_host_prefix,
    assert_no_traceback,
    delete_ledger,
    ledger_query,
    mock_behaviour,
    post_turn,
    response_id,
    turnguard_events,
    wait_until,
)
from test_at_most_once import in_background, post

SESSION = {"authorization": "Bearer sk-clock-jumps", "session-id": "sess-clock"}
HOUR_S = 3600.0

_SKEW_SCRIPT = '''\
"""Offsets this process's wall clock (time.time, time.time_ns) by the seconds written in
{path!r}, re-read every 50 ms of the monotonic clock (which is left alone)."""
import time

_path = {path!r}
_time, _time_ns, _mono = time.time, time.time_ns, time.monotonic
_state = [0.0, -1.0]


def _offset():
    now = _mono()
    if now - _state[1] >= 0.05:
        _state[1] = now
        try:
            with open(_path) as f:
                _state[0] = float(f.read().strip() or 0)
        except (OSError, ValueError):
            pass
    return _state[0]


def _skewed_time():
    return _time() + _offset()


def _skewed_time_ns():
    return _time_ns() + int(_offset() * 1e9)


time.time, time.time_ns = _skewed_time, _skewed_time_ns
'''


class Skew:
    """The offset file of one process's wall clock: ``jump(s)`` sets it (seconds, + or -)."""

    def __init__(self, tmp_path: Path, name: str):
        self.file = tmp_path / f"{name}-clock-offset"
        self.file.write_text("0")
        self.script = tmp_path / f"{name}-skewed_clock.py"
        self.script.write_text(_SKEW_SCRIPT.format(path=str(self.file)))

    def jump(self, seconds: float) -> None:
        """Set the offset; it is in effect when this returns (the process re-reads it every
        50 ms: a request sent at once could still see the old clock)."""
        self.file.write_text(repr(float(seconds)))
        time.sleep(0.2)


def skewed(tmp_path: Path, up: MockUpstream, name: str, skew: Skew | None, *,
           prefix: list[str] | None = None, **options: object) -> Mitmdump:
    """``guarded``, with the wall clock of ``skew`` (loaded before turnguard's script)."""
    opts: dict[str, object] = {
        "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
        "turnguard_events": str(tmp_path / f"{name}-events.jsonl"),
        **options,
    }
    extra = [] if skew is None else ["-s", str(skew.script)]
    # the skew script first, so that turnguard reads the skewed clock from its start
    return Mitmdump(tmp_path, up.url, options=opts, name=name, prefix=prefix,
                    extra_args=extra)


def body_of(text: str) -> dict:
    return {"model": "gpt-test", "input": text, "stream": True}


events = turnguard_events


# -- leases: a live peer is never reaped, a dead one always is ----------------------------------


def heartbeats_renewed(tmp_path: Path, proxy: Mitmdump, times: int, ledger: str | None = None
                       ) -> None:
    """Wait until ``proxy`` has renewed its heartbeat in the ledger (``tmp_path``'s SQLite
    file, or the PostgreSQL URL ``ledger``) ``times`` times more (5 s apart): its peers'
    reapers ran meanwhile (every second while they hold a duplicate of one of its
    attempts)."""
    instance = re.search(r"turnguard: running \(instance (\w+)", proxy.log_text()).group(1)

    def beat() -> float | None:
        if ledger is None:
            found = ledger_query(tmp_path / "ledger.sqlite3",
                                 "SELECT heartbeat_at FROM instances WHERE instance_id=?",
                                 (instance,))
        else:
            import psycopg

            with psycopg.connect(ledger, autocommit=True, connect_timeout=10) as db:
                found = db.execute("SELECT heartbeat_at FROM instances WHERE instance_id=%s",
                                   (instance,)).fetchall()
        return found[0][0] if found else None

    seen = [beat()]
    wait_until(lambda: (b := beat()) != seen[-1] and seen.append(b) is None
               and len(seen) > times, 10.0 * (times + 1), what=f"{times} heartbeats of {instance}")


def held_on_b(tmp_path: Path, up: MockUpstream, a: Mitmdump, b: Mitmdump, text: str, *,
              turn_ms: int):
    """A turn of ``turn_ms`` sent to A (dispatched), and its duplicate sent to B, held there:
    both requests' futures."""
    original = in_background(post, a.url,
                             {**SESSION, **mock_behaviour(kind="ok", delay_ms=turn_ms)},
                             body_of(text))
    up.wait_for_record(lambda r: r.get("event") == "dispatch")
    duplicate = in_background(post, b.url, SESSION, body_of(text))
    wait_until(lambda: events(tmp_path, "b", "duplicate_held"), 10,
               what="the duplicate held on B")
    return original, duplicate


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_a_clock_stepped_forward_does_not_reap_a_live_peer_and_run_its_turn_twice(
        tmp_path, request, store, report):
    """A (another pid namespace: judged by its lease, as a process on another host is) runs a
    25 s turn; B holds its duplicate. B's wall clock steps an hour forward (the host's clock
    stepped, B's reap tick before A's next heartbeat; or, on PostgreSQL, B on a host whose
    clock runs ahead) for two of A's heartbeats, then back. A is alive and renews its
    heartbeat all along: B must not take an hour of wall clock for an hour of silence, reap
    A's attempt and dispatch the duplicate again."""
    prefix = another_host_prefix()
    skew = Skew(tmp_path, "b")
    opts: dict[str, object] = dict(turnguard_hold_timeout_ms=60000)
    url = None
    if store == "postgres":
        url = request.getfixturevalue("pg_url")
        opts["turnguard_ledger"] = url
    with MockUpstream(tmp_path) as up, \
            skewed(tmp_path, up, "a", None, prefix=prefix, **opts) as a, \
            skewed(tmp_path, up, "b", skew, **opts) as b:
        original, duplicate = held_on_b(
            tmp_path, up, a, b, "a turn across a clock step", turn_ms=25000)
        skew.jump(HOUR_S)
        heartbeats_renewed(tmp_path, a, 2, url)
        skew.jump(0)
        first, second = original.result(60), duplicate.result(60)
        reaped = events(tmp_path, "b", "instance_reaped")
        dispatches = len(up.dispatches())
        log = a.log_text() + b.log_text()
    assert dispatches == 1
    assert not reaped, reaped
    assert first[0] == second[0] == 200 and first[2] == second[2]
    assert_no_traceback(log)
    report(f"{store}: B's wall clock 1 h ahead for 10 s while A (judged by its lease) ran a "
           f"turn: A not reaped, duplicate replayed; upstream dispatches={dispatches}")


def test_a_clock_ahead_as_the_ledger_is_deleted_still_waits_for_a_live_peer_to_register(
        tmp_path, report):
    """A (another pid namespace: judged by its heartbeat, as a process on another host is)
    has a turn in flight when the ledger file is deleted, and B's wall clock runs an hour
    ahead. B finds the file gone and reads in the old one which peers had turns in flight
    there, to wait for them to register those in the new file. A's last heartbeat is an hour
    old only by B's clock: B must still wait for A, and hold a duplicate sent to it on A's
    attempt, not decide it in a new file that knows nothing of it yet and run it again."""
    prefix = another_host_prefix()
    skew = Skew(tmp_path, "b")
    opts: dict[str, object] = dict(turnguard_hold_timeout_ms=30000)
    text = "a turn in flight as the ledger goes, B's clock ahead"
    with MockUpstream(tmp_path) as up, \
            skewed(tmp_path, up, "a", None, prefix=prefix, **opts) as a, \
            skewed(tmp_path, up, "b", skew, **opts) as b:
        original = in_background(post, a.url,
                                 {**SESSION, **mock_behaviour(kind="ok", delay_ms=6000)},
                                 body_of(text))
        up.wait_for_record(lambda r: r.get("event") == "dispatch")
        skew.jump(HOUR_S)
        delete_ledger(tmp_path / "ledger.sqlite3")
        duplicate = in_background(post, b.url, SESSION, body_of(text))
        first, second = original.result(30), duplicate.result(40)
        dispatches = len(up.dispatches())
        log = a.log_text() + b.log_text()
    assert dispatches == 1
    assert first[0] == second[0] == 200
    assert second[1].get("x-turnguard") in ("replayed", "attached"), second[1]
    assert response_id(second[2]) == response_id(first[2])
    assert_no_traceback(log)
    report("ledger deleted while A (judged by its heartbeat) ran a turn and B's wall clock ran "
           f"1 h ahead: B waited for A to register it, the duplicate was "
           f"{second[1].get('x-turnguard')}; upstream dispatches={dispatches}")


@pytest.mark.slow
def test_a_clock_stepped_back_does_not_keep_a_dead_peers_turn_in_flight(tmp_path, report):
    """A (another pid namespace) is killed -9 mid-turn; B holds its duplicate; B's wall
    clock steps an hour back. A's last heartbeat now looks an hour in B's future: B must
    still take A for gone once A has been silent for its lease (15 s here), not an hour and
    a lease later, and answer the duplicate (a dispatch of its own)."""
    prefix = another_host_prefix()
    skew = Skew(tmp_path, "b")
    opts = dict(turnguard_hold_timeout_ms=50000, turnguard_instance_lease_ms=15000)
    with MockUpstream(tmp_path) as up, \
            skewed(tmp_path, up, "a", None, prefix=prefix, **opts) as a, \
            skewed(tmp_path, up, "b", skew, **opts) as b:
        original, duplicate = held_on_b(
            tmp_path, up, a, b, "a dead peer's turn across a clock step", turn_ms=60000)
        skew.jump(-HOUR_S)
        a.kill9()
        killed = time.monotonic()
        second = duplicate.result(100)
        answered_s = time.monotonic() - killed
        assert original.result(30)[0] in (0, 502)
        reaped = events(tmp_path, "b", "instance_reaped")
        dispatches = len(up.dispatches())
        log = b.log_text()
    assert second[0] == 200
    assert [r["proof"] for r in reaped] == ["lease expired"]
    assert dispatches == 2
    assert_no_traceback(log)
    report("B's wall clock stepped 1 h back, A (judged by its lease, 15 s) killed -9: reaped, "
           f"duplicate answered {answered_s:.0f} s after the kill; upstream dispatches={dispatches}")


# -- the replay window: a duplicate held on a turn gets its answer ---------------------------


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_a_duplicate_held_across_a_clock_step_gets_the_answer_it_waited_for(
        tmp_path, request, store, report):
    """A runs a 10 s turn; B holds its duplicate; B's wall clock steps an hour forward (past
    the 5 min replay window) and stays there (on PostgreSQL: B's host an hour ahead). The
    turn B waited on ends completed a moment later in real time: its duplicate must get that
    answer (woken by a poll on SQLite, a notification on PostgreSQL), not be dispatched again
    because A's end time, on A's clock, looks an hour old on B's."""
    skew = Skew(tmp_path, "b")
    opts: dict[str, object] = dict(turnguard_hold_timeout_ms=60000)
    if store == "postgres":
        opts["turnguard_ledger"] = request.getfixturevalue("pg_url")
    with MockUpstream(tmp_path) as up, skewed(tmp_path, up, "a", None, **opts) as a, \
            skewed(tmp_path, up, "b", skew, **opts) as b:
        original, duplicate = held_on_b(
            tmp_path, up, a, b, "a duplicate held across a clock step", turn_ms=10000)
        skew.jump(HOUR_S)
        first, second = original.result(60), duplicate.result(60)
        dispatches = len(up.dispatches())
        log = a.log_text() + b.log_text()
    assert dispatches == 1
    assert first[0] == second[0] == 200 and first[2] == second[2]
    assert second[1].get("x-turnguard") == "replayed"
    assert_no_traceback(log)
    report(f"{store}: B's wall clock stepped 1 h forward (past the replay window) while its "
           f"duplicate was held on A's turn: it got A's answer; upstream dispatches={dispatches}")


# -- the purge of recordings and the retention ------------------------------------------------


def test_a_clock_stepped_back_does_not_keep_recordings_past_the_window_and_retention(tmp_path,
                                                                                     report):
    """The process's wall clock steps an hour back after it started (its first purge and
    garbage collection ran). Its turns' bytes must still be purged past the replay window
    (1 s) and their operations collected past the retention (1.5 s), every interval of the
    maintenance kept on its own: not an hour and a window later."""
    skew = Skew(tmp_path, "p")
    opts = dict(turnguard_retention_ms=1500, turnguard_replay_window_ms=1000)
    with MockUpstream(tmp_path) as up, skewed(tmp_path, up, "p", skew, **opts) as p:
        ledger = tmp_path / "ledger.sqlite3"
        empty = "SELECT (SELECT COUNT(*) FROM spool) + (SELECT COUNT(*) FROM operations)"
        assert post(p.url, {"session-id": "r"}, {"model": "m", "input": "before"})[0] == 200
        wait_until(lambda: ledger_query(ledger, empty) == [(0,)], 15,
                   what="a first purge and garbage collection, before the step")
        skew.jump(-HOUR_S)
        for i in range(3):
            assert post(p.url, {"session-id": "r"}, {"model": "m", "input": f"brief {i}"})[0] \
                == 200
        # the three went through the ledger (their operations were written there); not a
        # count of its rows: with a turn that took over 1.5 s, the garbage collection (every
        # 5 s) may already have taken the first, as it should
        assert [e["ledger"] for e in events(tmp_path, "p", "dispatch")[-3:]] == [True] * 3
        purged = False
        for _ in range(60):  # bounded: 60 x 0.25 s, many times the window and the retention
            if ledger_query(ledger, empty) == [(0,)]:
                purged = True
                break
            time.sleep(0.25)
        left = ledger_query(ledger, "SELECT (SELECT COUNT(*) FROM spool),"
                                    " (SELECT COUNT(*) FROM operations)")
        log = p.log_text()
    assert purged, f"spool rows, operations still in the ledger: {left}"
    assert_no_traceback(log)
    report("wall clock stepped 1 h back: recordings purged past the 1 s window and operations "
           "collected past the 1.5 s retention, as without the step")


# -- cooldowns: once mode's one recovery is counted, not timed --------------------------------


def test_once_mode_a_clock_stepped_forward_still_gives_one_recovery_dispatch(tmp_path, report):
    """Once mode. Two eventless failures through A open the circuit (15 s); A holds the
    turn's next request through the cooldown. B's wall clock steps an hour forward: for B the
    cooldown and A's session lease are over, and a retry of the turn through B goes upstream
    (B takes the session over). That dispatch must be the operation's one recovery (counted
    in the ledger, fenced by the epoch): A's held request gets an answer, never a second
    recovery dispatch. (Its answer is the 503 ``ownership_lost``: session leases are
    wall-clock times, see README, Durable sessions.)"""
    anchored = {"authorization": "Bearer sk-clock-once", "session-id": "sess-clock-once",
                "x-codex-turn-state": "ts_clock_1"}
    turn = {"model": "gpt-test", "input": "a turn recovered across a clock step",
            "stream": True}
    storm = {"sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
             "default": {"kind": "ok", "events": 4}}
    opts = {"turnguard_recovery_mode": "server_anchored_replay_once",
            "turnguard_response_created_timeout_ms": 600, "turnguard_cooldown_ms": 15000}
    skew = Skew(tmp_path, "b")
    with MockUpstream(tmp_path, storm) as up, skewed(tmp_path, up, "a", None, **opts) as a, \
            skewed(tmp_path, up, "b", skew, **opts) as b:
        assert post_turn(a.url, anchored, turn, cut_is_error=True, timeout=30)[0] == 502
        assert post_turn(a.url, anchored, turn, cut_is_error=True, timeout=30)[0] in (0, 502)
        wait_until(lambda: events(tmp_path, "a", "circuit_opened"), 10, what="the circuit open")
        held = in_background(lambda: post_turn(a.url, anchored, turn, timeout=60))
        wait_until(lambda: events(tmp_path, "a", "wait_operation_fenced_cooldown"), 10,
                   what="A holding the turn through the cooldown")
        skew.jump(HOUR_S)
        retried = post_turn(b.url, anchored, turn, timeout=30)
        answer = held.result(60)
        dispatches = len(up.dispatches())
        kinds = sorted(e["kind"] for e in events(tmp_path, "a", "dispatch")
                       + events(tmp_path, "b", "dispatch"))
        log = a.log_text() + b.log_text()
    assert dispatches == 3  # the two failures, then the one recovery
    assert kinds == ["original", "recovery", "retry"]
    assert retried[0] == 200
    assert answer[0] == 200 and answer[2] == retried[2] or answer[0] == 503
    assert_no_traceback(log)
    report("once mode, B's wall clock stepped 1 h forward during A's 15 s cooldown: B's retry "
           f"was the one recovery, A's held request answered {answer[0]}; "
           f"upstream dispatches={dispatches}")
