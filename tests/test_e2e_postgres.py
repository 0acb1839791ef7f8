"""End to end on a PostgreSQL ledger: real mitmdump processes sharing one real PostgreSQL
database (the processes stand for hosts: nothing but the database is shared), in front of the
real mock upstream. The multi-process guarantees of the SQLite ledger, again, plus what only a
shared server brings: waking held duplicates by LISTEN/NOTIFY (no polling), reaping across
hosts by lease, and a database restart while requests are held and a cooldown is open."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest

import harness
import pg_server
from harness import (
    Mitmdump,
    MockUpstream,
    assert_no_traceback,
    sse_event_types,
    sse_post,
    turnguard_events,
    wait_until,
)
from turnguard_ws import WsClient, types  # noqa: E402 - harness puts scripts/ on sys.path

SECRET = "sk-pg-test-0123456789"
HEADERS = {"authorization": f"Bearer {SECRET}", "session-id": "sess-pg"}
BODY = {"model": "gpt-test", "input": "one ledger, many hosts", "stream": True}
ANCHORED = {**HEADERS, "x-codex-turn-state": "ts_pg_turn"}
ONCE = "server_anchored_replay_once"
# the snapshot query: what a process polls with (and what admission reads under its lock)
SNAPSHOT_SQL = "SELECT o.state, o.fingerprint, o.current_attempt%"
# an admission's read of the operation and its circuit (the first statement of a claim)
ADMISSION_SQL = "SELECT c.failures, c.open_until, c.cooldown_s, o.op_key IS NOT NULL%"
# the reaper's read of the peers with attempts in flight (each process's, every few seconds)
REAPER_SQL = "SELECT a.instance_id, COALESCE(i.host, '')%"


def guarded(tmp_path, up, name: str, ledger: str, **options) -> Mitmdump:
    """mitmdump + turnguard on the PostgreSQL ledger ``ledger`` (a URL)."""
    return harness.guarded(tmp_path, up, name, ledger=ledger, **options)


events = turnguard_events


def rows(url: str, sql: str, args=()) -> list[tuple]:
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as db:
        cur = db.execute(sql, args)
        return cur.fetchall() if cur.description is not None else []


# how many of the server's sessions running a query LIKE the argument wait for a lock
LOCK_WAITERS_SQL = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE %s")


def post(url: str, headers=HEADERS, body=BODY, timeout: float = 60):
    """One request; a transport error (reset, cut stream) is status 0."""
    try:
        status, h, b = sse_post(url, body=body, headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return 0, {}, b""
    if status == 200 and sse_event_types(b)[-1:] != ["response.completed"]:
        return 0, h, b
    return status, h, b


def instance_of(url: str, pid: int) -> str:
    return wait_until(lambda: rows(url, "SELECT instance_id FROM instances WHERE pid=%s", (pid,)),
                      10, what=f"pid {pid} registered")[0][0]


def snapshot_reads(url: str) -> int:
    """How many times the ledger's operation snapshot was read in this database (every
    process): pg_stat_statements, counted by the server."""
    return int(rows(url, "SELECT COALESCE(SUM(s.calls), 0) FROM pg_stat_statements s JOIN"
                         " pg_database d ON d.oid = s.dbid WHERE d.datname = current_database()"
                         " AND s.query LIKE %s", (SNAPSHOT_SQL,))[0][0])


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_on_one_postgres_ledger_dispatch_once_and_replay_byte_identical(
        tmp_path, pg_url, processes, report):
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 3000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up:
        proxies = [guarded(tmp_path, up, f"p{k}", pg_url) for k in range(processes)]
        try:
            with ThreadPoolExecutor(max_workers=1 + 2 * (processes - 1)) as pool:
                first = pool.submit(post, proxies[0].url)
                wait_until(lambda: up.dispatches(), 10, what="the original's dispatch")
                dups = [pool.submit(post, p.url) for p in proxies[1:] for _ in range(2)]
                results = [first.result()] + [d.result() for d in dups]
            owner = instance_of(pg_url, proxies[0].pid)
            held = [e for p in range(1, processes) for e in events(tmp_path, f"p{p}", "duplicate_held")]
            log = "".join(p.log_text() for p in proxies)
        finally:
            for p in proxies:
                p.stop()
    assert [r[0] for r in results] == [200] * len(results)
    assert len({r[2] for r in results}) == 1  # byte-identical
    assert all(r[1].get("x-turnguard") == "replayed" for r in results[1:])
    assert len(up.dispatches()) == 1
    assert len(held) == 2 * (processes - 1) and all(e["owner"] == owner for e in held)
    assert_no_traceback(log)
    report(f"{processes} mitmdump processes, one PostgreSQL ledger: original via the first, "
           f"{len(dups)} duplicates via the others -> upstream dispatches={len(up.dispatches())}, "
           f"statuses={[r[0] for r in results]}, distinct bodies=1")


def in_flight(url: str) -> int:
    """How many operations the ledger at ``url`` has in flight."""
    return rows(url, "SELECT COUNT(*) FROM operations WHERE state = 'in_flight'")[0][0]


def _made_again(tmp_path, up, pg_url: str, by: str) -> None:
    """The ledger's tables dropped under the running processes, and made again ``by``
    another turnguard started for it (else by the processes themselves, as they find
    them gone)."""
    rows(pg_url, "DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    if by == "another turnguard":
        with guarded(tmp_path, up, "c", pg_url):
            pass


def _warm_up(a, b, headers=HEADERS) -> None:
    """One turn through each of two processes (``headers`` its request's), answered: their
    ledger connections are made before a test's fault."""
    for p, warm in ((a, "warm a"), (b, "warm b")):
        assert post(p.url, headers, {**BODY, "input": warm})[0] == 200


def _claim_answers_late(pg_url: str, what: str, start=None, *, missed_ok: bool = False):
    """Make the next claim answer after its request stopped waiting for it, and return what
    ``start()`` (the request that makes it, if not already on its way) returned; with
    ``missed_ok``, that and whether the claim was seen waiting (on a loaded machine the
    watch may miss its wait: the claim then fails within its bound, not late). Each of the
    claim's two statements waits within its own bound (what is left of the request's 0.5 s
    wait for the ledger when the claim starts over on the ledger's thread: about 0.47 s), and
    together longer than the request waits for its claim (0.5 s, and 0.25 s of grace for a
    call that started in time): 0.38 s on the circuits once the claim is seen waiting for
    them (``what``), then 0.42 s on the tables."""
    circuits = psycopg.connect(pg_url, autocommit=True)
    tables = psycopg.connect(pg_url, autocommit=True)
    watch = psycopg.connect(pg_url, autocommit=True)
    try:
        circuits.execute("BEGIN")
        circuits.execute("LOCK TABLE circuits IN ACCESS EXCLUSIVE MODE")
        tables.execute("BEGIN")
        tables.execute("LOCK TABLE operations, attempts IN SHARE MODE")
        started = start() if start is not None else None
        # the claim's read waits at most about 0.47 s: watched on a connection of its own
        # (a new connection a poll took longer than that on a loaded machine)
        try:
            wait_until(lambda: watch.execute(LOCK_WAITERS_SQL, (ADMISSION_SQL,)).fetchone()[0],
                       10, interval=0.005, what=what)
        except AssertionError:
            if not missed_ok:
                raise
            return started, False
        time.sleep(0.38)
        circuits.execute("COMMIT")
        time.sleep(0.42)
        tables.execute("COMMIT")
    finally:
        circuits.close()
        tables.close()
        watch.close()
    return (started, True) if missed_ok else started


def test_a_claim_that_answers_late_becomes_the_row_of_the_attempt_decided_in_memory(
        tmp_path, pg_url):
    """A's claim waits on table locks past its request's wait for the ledger: A decides in
    memory and dispatches. The claim then lands: it becomes that running attempt's row
    (given back, it left the turn running with nothing in flight in the ledger), so a
    duplicate through B is held and replayed, never run again."""
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url) as a, \
            guarded(tmp_path, up, "b", pg_url) as b, ThreadPoolExecutor(2) as pool:
        _warm_up(a, b)
        slow = {**HEADERS, **harness.mock_behaviour(kind="slow", delay_ms=5000)}
        # the set-up is timed against the claim's bounds: on a loaded machine a statement may
        # pass its own bound first (the claim fails, not late), or the watch miss its wait;
        # then it goes again, a new turn
        for attempt in range(3):  # bounded
            body = {**BODY, "input": f"its claim answers late ({attempt})"}
            original, seen = _claim_answers_late(
                pg_url, "the claim's read waiting for the circuits", missed_ok=True,
                start=lambda: pool.submit(post, a.url, slow, body))
            if not seen:
                assert original.result(30)[0] == 200
                continue
            late = wait_until(lambda: [e for e in events(tmp_path, "a", "attempt_adopted")
                                       if e.get("reason") == "its claim answered late"]
                              or original.done(), 10,
                              what="the late claim taken as the attempt's row")
            if late is not True:
                break
        else:
            pytest.fail("no claim answered late in 3 tries")
        status, headers, _ = post(b.url, body=body)
        assert original.result(30)[0] == status == 200
        assert headers.get("x-turnguard") in ("replayed", "attached")
        # the two warm-ups, the turns whose claim failed instead, and this turn once
        assert len(up.dispatches()) == 2 + attempt + 1
        assert_no_traceback(a.log_text() + b.log_text())


def test_a_duplicate_held_on_another_process_is_woken_by_a_notification_not_by_polling(
        tmp_path, pg_url, report):
    try:  # the server counts the queries (tests/pg_server.py preloads it)
        rows(pg_url, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        snapshot_reads(pg_url)
    except psycopg.Error as e:
        pytest.skip(f"pg_stat_statements is not loaded on this server, polls cannot be counted: {e}")
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 4000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", pg_url) as a, \
            guarded(tmp_path, up, "b", pg_url) as b, ThreadPoolExecutor(max_workers=2) as pool:
        original = pool.submit(post, a.url)
        dispatched = wait_until(lambda: up.dispatches(), 10, what="the original's dispatch")[0]
        duplicate = pool.submit(post, b.url)
        wait_until(lambda: events(tmp_path, "b", "duplicate_held"), 10, what="B holds it")
        time.sleep(0.3)  # B's admission is over: from here on, any snapshot read is a poll
        before = snapshot_reads(pg_url)
        time.sleep(max(0.0, dispatched["ts"] + 3.5 - time.time()))  # until just before the end
        during = snapshot_reads(pg_url) - before
        status, headers, body = duplicate.result(30)
        assert original.result(30)[2] == body
        log = a.log_text() + b.log_text()
    assert during == 0, f"{during} snapshot reads (polls) while the duplicate was held"
    assert status == 200 and headers.get("x-turnguard") == "replayed"
    assert len(up.dispatches()) == 1
    assert "notifications" not in log or "lost" not in log
    assert_no_traceback(log)
    report("duplicate held on another process (PostgreSQL ledger): woken by NOTIFY, "
           f"snapshot reads while held={during} (polling would read every 200 ms)")


def test_two_processes_in_once_mode_on_postgres_recover_once(tmp_path, pg_url):
    storm = {"sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
             "default": {"kind": "ok", "events": 4}}
    opts = {"turnguard_recovery_mode": ONCE, "turnguard_response_created_timeout_ms": 600,
            "turnguard_cooldown_ms": 3000}
    with MockUpstream(tmp_path, storm) as up, guarded(tmp_path, up, "a", pg_url, **opts) as a, \
            guarded(tmp_path, up, "b", pg_url, **opts) as b:
        assert post(a.url, ANCHORED)[0] == 502  # cut: no response event in time
        assert post(a.url, ANCHORED)[0] in (0, 502)  # reset: the circuit opens; A owns the session
        with ThreadPoolExecutor(max_workers=6) as pool:
            via_a = [pool.submit(post, a.url, ANCHORED) for _ in range(3)]
            time.sleep(0.3)
            via_b = [pool.submit(post, b.url, ANCHORED) for _ in range(3)]
            a_results = [f.result()[0] for f in via_a]
            b_results = [f.result()[0] for f in via_b]
        log = a.log_text() + b.log_text()
    assert a_results == [200] * 3
    assert b_results == [503] * 3  # B holds no owner proof for A's session: fails closed
    assert [e["reason"] for e in events(tmp_path, "b", "fail_closed")] == ["owner_proof_missing"] * 3
    assert len(up.dispatches()) == 3
    assert len(events(tmp_path, "a", "recovery_claimed") + events(tmp_path, "b", "recovery_claimed")) == 1
    assert rows(pg_url, "SELECT MAX(recovery_dispatches) FROM operations") == [(1,)]
    assert_no_traceback(log)


def _kill_owner_mid_stream(tmp_path, pg_url, *, prefix=None, **options):
    """A dispatches a stalled original and holds nothing; B holds 3 duplicates of it; A is
    killed (-9). Returns (B's answers, the dead instance, seconds from the kill to the reap)."""
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 30000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "b", pg_url, **options) as b:
        a = guarded(tmp_path, up, "a", pg_url, prefix=prefix, **options)
        pool = ThreadPoolExecutor(max_workers=4)
        try:
            first = pool.submit(post, a.url)
            wait_until(lambda: up.dispatches(), 10, what="A's dispatch")
            dups = [pool.submit(post, b.url) for _ in range(3)]
            wait_until(lambda: len(events(tmp_path, "b", "duplicate_held")) == 3, 10,
                       what="3 duplicates held by B")
            owner = events(tmp_path, "b", "duplicate_held")[0]["owner"]
            killed_at = time.time()
            a.kill9()
            assert first.result(timeout=30)[0] == 0
            results = [f.result(timeout=90) for f in dups]
        finally:
            a.stop()
            pool.shutdown(wait=False)
        log = b.log_text()
        dispatches = len(up.dispatches())
    reaped = events(tmp_path, "b", "instance_reaped")
    assert [r["instance"] for r in reaped] == [owner], reaped
    assert [r[0] for r in results] == [200] * 3
    assert len({r[2] for r in results}) == 1
    assert dispatches == 2  # A's (lost in the crash) + B's single retry
    assert [r for r in rows(pg_url, "SELECT kind, outcome FROM attempts ORDER BY attempt_id")] == [
        ("original", "unknown"), ("retry", "completed")]
    assert_no_traceback(log)
    return reaped[0], reaped[0]["ts"] - killed_at


def test_owner_killed_mid_stream_on_the_same_kernel_is_reaped_by_proof(tmp_path, pg_url, report):
    reaped, reap_s = _kill_owner_mid_stream(tmp_path, pg_url)
    assert reaped["proof"] == "process gone"
    assert reap_s < 20
    report(f"PostgreSQL ledger, owner killed -9 mid-stream (same kernel): survivor reaped it by "
           f"proof after {reap_s:.1f} s and served the 3 held duplicates; upstream dispatches=2")


@pytest.mark.slow
def test_owner_killed_on_another_host_is_reaped_by_its_lease(tmp_path, pg_url, report):
    """Another pid namespace stands for another host: its pid means nothing here, so the
    survivor may only go by the lease (turnguard_instance_lease_ms, short here)."""
    prefix = harness.another_host_prefix()
    reaped, reap_s = _kill_owner_mid_stream(tmp_path, pg_url, prefix=prefix,
                                            turnguard_instance_lease_ms=15000,  # the shortest
                                            turnguard_hold_timeout_ms=90000)
    assert reaped["proof"] == "lease expired"
    assert 15.0 - 5.0 <= reap_s < 45  # not before its lease ran out (heartbeat 5 s old at most)
    report(f"PostgreSQL ledger, owner on 'another host' (pid namespace) killed -9: reaped by its "
           f"lease (15 s) after {reap_s:.1f} s; upstream dispatches=2")


def test_postgres_restarted_while_requests_are_held_and_a_cooldown_is_open(tmp_path, own_pg, report):
    url = own_pg.url
    opts = {"turnguard_response_created_timeout_ms": 600, "turnguard_cooldown_ms": 120000,
            "turnguard_cooldown_max_ms": 120000}
    cooling = {"authorization": f"Bearer {SECRET}", "session-id": "sess-cooling"}
    slow = {"x-mock-behaviour": json.dumps({"kind": "ok", "events": 6, "gap_ms": 800})}
    body = {**BODY, "input": "held through a restart"}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", url, **opts) as a, \
            guarded(tmp_path, up, "b", url, **opts) as b:
        for behaviour in ({"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}):
            assert post(a.url, {**cooling, "x-mock-behaviour": json.dumps(behaviour)})[0] in (0, 502)
        wait_until(lambda: events(tmp_path, "a", "circuit_opened"), 10, what="the circuit open")
        assert post(b.url, cooling)[0] == 503  # the other process sees the cooldown
        with ThreadPoolExecutor(max_workers=4) as pool:
            original = pool.submit(post, b.url, {**HEADERS, **slow}, body)
            wait_until(lambda: len(up.dispatches()) == 3, 10, what="the original's dispatch")
            dups = [pool.submit(post, a.url, HEADERS, body) for _ in range(3)]
            wait_until(lambda: len(events(tmp_path, "a", "duplicate_held")) == 3, 10,
                       what="3 duplicates held on A")
            own_pg.restart(down_s=1.5)  # a crash-like stop: every connection breaks
            results = [original.result(60)] + [d.result(60) for d in dups]
        after = [post(p.url, cooling)[0] for p in (a, b)]
        log = a.log_text() + b.log_text()
    circuits = rows(url, "SELECT failures, open_until FROM circuits WHERE open_until > %s",
                    (time.time(),))
    assert [r[0] for r in results] == [200] * 4
    assert len({r[2] for r in results}) == 1
    assert len(up.dispatches()) == 3  # 2 failures that opened the circuit + the original, once
    assert after == [503, 503]  # the cooldown outlived the restart
    assert len(circuits) == 1 and circuits[0][0] == 2
    assert rows(url, "SELECT COUNT(*) FROM attempts WHERE outcome = 'in_flight'") == [(0,)]
    assert_no_traceback(log)
    report("PostgreSQL restarted (immediate stop, 1.5 s down) with 3 duplicates held and a "
           f"cooldown open: answers={[r[0] for r in results]}, upstream dispatches of the held "
           f"operation=1, cooldown afterwards={after}")


def test_a_ledger_down_at_start_up_keeps_proxying_and_is_used_once_it_is_up(tmp_path, own_pg):
    own_pg.stop()
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", own_pg.url) as a:
        assert post(a.url)[0] == 200  # proxied, decided in memory
        unavailable = events(tmp_path, "a", "ledger_unavailable")
        assert unavailable and unavailable[0]["during"] == "open"
        own_pg.restart()  # (it is stopped: this starts it)
        wait_until(lambda: re.search(r"turnguard: ledger \S+ \(instance", a.log_text()), 15,
                   what="the ledger opened")
        body = {**BODY, "input": "after the outage"}
        assert post(a.url, HEADERS, body)[0] == 200
        again = post(a.url, HEADERS, body)
        assert again[0] == 200 and again[1].get("x-turnguard") == "replayed"
        log = a.log_text()
    assert rows(own_pg.url, "SELECT COUNT(*) FROM operations") >= [(2,)]
    assert_no_traceback(log)


def _pause_server(server, paused: bool) -> None:
    """SIGSTOP (or SIGCONT) the server's postmaster and every backend: a server that hangs
    without closing a connection (a frozen VM, a stalled disk)."""
    import os
    import signal

    with open(os.path.join(server.data, "postmaster.pid"), encoding="utf-8") as f:
        postmaster = int(f.readline())
    children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True,
                              text=True, timeout=10).stdout.split()
    for pid in [postmaster, *map(int, children)]:
        try:
            os.kill(pid, signal.SIGCONT if not paused else signal.SIGSTOP)
        except ProcessLookupError:  # a backend that ended meanwhile (its zombie reaped by
            pass  # the postmaster, resumed first): nothing left to stop or resume


def test_a_paused_server_leaves_no_unhandled_error_once_it_answers_again(tmp_path, own_pg):
    """The server hangs (SIGSTOP) while turns start on two processes: every request is
    answered within its budget, decided in memory; the ledger calls they stopped waiting for
    fail on the ledger's thread later, and none of them is an unhandled error in mitmdump's
    log once the server answers again."""
    url = own_pg.url
    opts = {"turnguard_request_budget_ms": 6000}
    slow = {**HEADERS, **harness.mock_behaviour(kind="ok", events=5, gap_ms=800)}
    body = {**BODY, "input": "the server hangs at the claim"}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", url, **opts) as a, \
            guarded(tmp_path, up, "b", url, **opts) as b, ThreadPoolExecutor(3) as pool:
        _warm_up(a, b)
        _pause_server(own_pg, True)
        try:
            original = pool.submit(post, a.url, slow, body)
            time.sleep(0.5)
            dups = [pool.submit(post, b.url, HEADERS, body) for _ in range(2)]
            time.sleep(10)
        finally:
            _pause_server(own_pg, False)
        results = [original.result(60)] + [d.result(60) for d in dups]
        wait_until(lambda: "usable again" in a.log_text() and "usable again" in b.log_text(),
                   20, what="both processes back on the ledger")
        time.sleep(1)
        log = a.log_text() + b.log_text()
    assert [r[0] for r in results] == [200] * 3
    assert rows(url, "SELECT COUNT(*) FROM attempts WHERE outcome = 'in_flight'") == [(0,)]
    assert_no_traceback(log)


def test_a_connection_the_server_ended_is_made_again_before_a_duplicate_is_decided(
        tmp_path, pg_url):
    """The server ends turnguard's connections (pg_terminate_backend: an operator, a pooler or
    `idle_session_timeout`) while A runs a turn; then a duplicate comes to B. The server is
    up: B's claim finds its connection gone before it did anything, makes it again and reads
    A's attempt in flight, so the duplicate is held and replayed, never run again."""
    scenario = {"sequence": [{"kind": "ok", "events": 6, "gap_ms": 800}],
                "default": {"kind": "ok"}}
    sessionless = {"authorization": f"Bearer {SECRET}"}  # the claim is the first ledger call
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", pg_url) as a, \
            guarded(tmp_path, up, "b", pg_url) as b, ThreadPoolExecutor(4) as pool:
        original = pool.submit(post, a.url, sessionless)
        wait_until(lambda: up.dispatches(), 10, what="the original's dispatch")
        dups = []
        for _ in range(3):
            ended = rows(pg_url, "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))"
                                 " FROM pg_stat_activity WHERE datname = current_database()"
                                 " AND pid <> pg_backend_pid()")[0][0]
            assert ended >= 1
            dups.append(pool.submit(post, b.url, sessionless))
            time.sleep(0.5)
        results = [original.result(30)] + [d.result(30) for d in dups]
        log = a.log_text() + b.log_text()
    assert [r[0] for r in results] == [200] * 4
    assert [r[1].get("x-turnguard") for r in results[1:]] == ["replayed"] * 3
    assert len(up.dispatches()) == 1
    assert_no_traceback(log)


def test_a_duplicate_replayed_from_another_process_is_not_failed_closed_by_an_ended_connection(
        tmp_path, pg_url):
    """B holds a duplicate of A's turn; the server ends every connection (the server stays up)
    just before the turn ends. B reads the recording to replay on a connection made again,
    never answering 503 ledger_unavailable for a turn that completed."""
    scenario = {"sequence": [{"kind": "ok", "events": 4, "gap_ms": 800}],
                "default": {"kind": "ok"}}
    sessionless = {"authorization": f"Bearer {SECRET}"}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", pg_url) as a, \
            guarded(tmp_path, up, "b", pg_url) as b, ThreadPoolExecutor(4) as pool:
        original = pool.submit(post, a.url, sessionless)
        dispatched = wait_until(lambda: up.dispatches(), 10, what="the original's dispatch")[0]
        dups = [pool.submit(post, b.url, sessionless) for _ in range(2)]
        wait_until(lambda: len(events(tmp_path, "b", "duplicate_held")) == 2, 10,
                   what="2 duplicates held by B")
        time.sleep(max(0.0, dispatched["ts"] + 2.5 - time.time()))  # before the end (3.2 s)
        rows(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                     " WHERE datname = current_database() AND pid <> pg_backend_pid()")
        results = [original.result(30)] + [d.result(30) for d in dups]
        log = a.log_text() + b.log_text()
    assert [r[0] for r in results] == [200] * 3
    assert [r[1].get("x-turnguard") for r in results[1:]] == ["replayed"] * 2
    assert len({r[2] for r in results}) == 1
    assert len(up.dispatches()) == 1
    assert "ledger_unavailable" not in log
    assert_no_traceback(log)


@pytest.mark.slow
def test_a_database_made_read_only_for_a_while_is_used_again_once_it_is_writable(
        tmp_path, pg_url):
    """The database is made read-only (``default_transaction_read_only``: maintenance, a
    standby) and turnguard's connections are made again meanwhile: every write fails, an
    outage. Once it is writable again, turnguard recovers by itself: a duplicate on the other
    process is held and replayed again, not run twice."""
    name = pg_url.rsplit("/", 1)[1]
    admin = pg_url.rsplit("/", 1)[0] + "/postgres"
    sessionless = {"authorization": f"Bearer {SECRET}"}
    slow = {**sessionless, **harness.mock_behaviour(kind="ok", events=4, gap_ms=700)}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url) as a, \
            guarded(tmp_path, up, "b", pg_url) as b, ThreadPoolExecutor(2) as pool:
        _warm_up(a, b, sessionless)
        rows(admin, f"ALTER DATABASE {name} SET default_transaction_read_only = on")
        rows(admin, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
             (name,))
        time.sleep(1)
        assert post(a.url, sessionless, {**BODY, "input": "read-only"})[0] == 200
        # the outage begins with whichever call meets it first: a request's write, refused
        # (ReadOnlySqlTransaction), or the ticker's call on a connection just terminated
        wait_until(lambda: events(tmp_path, "a", "ledger_unavailable"), 10,
                   what="a meeting the outage")
        rows(admin, f"ALTER DATABASE {name} RESET default_transaction_read_only")
        time.sleep(12)  # two heartbeats and reopen intervals
        body = {**BODY, "input": "writable again"}
        original = pool.submit(post, a.url, slow, body)
        wait_until(lambda: len(up.dispatches()) == 4, 10, what="the original's dispatch")
        time.sleep(0.3)
        status, headers, _ = post(b.url, sessionless, body)
        assert original.result(30)[0] == status == 200
        log = a.log_text() + b.log_text()
    assert headers.get("x-turnguard") == "replayed"
    assert len(up.dispatches()) == 4  # the warm-ups, the one in the outage, the turn once
    assert_no_traceback(log)


@pytest.mark.parametrize("turn", ["in flight", "completed"])
def test_a_retry_sent_elsewhere_while_the_database_is_read_only_is_held_or_replayed(
        tmp_path, pg_url, turn):
    """A's turn is in the ledger (in flight, or completed) when the database is made
    read-only (a standby after a failover, maintenance). B meets it (a new turn of its own
    cannot be claimed), and then decided every request in memory, which knows nothing of A's
    turn. The database can still be read: B reads the operation before it decides from
    memory, and holds a retry of A's turn on A's attempt or replays its recording: one
    upstream execution."""
    name = pg_url.rsplit("/", 1)[1]
    admin = pg_url.rsplit("/", 1)[0] + "/postgres"
    sessionless = {"authorization": f"Bearer {SECRET}"}
    body = {**BODY, "input": f"a retry while the database is read-only ({turn})"}
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url, **opts) as a, \
            guarded(tmp_path, up, "b", pg_url, **opts) as b, ThreadPoolExecutor(2) as pool:
        original = pool.submit(post, a.url, {**sessionless, **harness.mock_behaviour(
            kind="ok", delay_ms=5000 if turn == "in flight" else 0)}, body)
        wait_until(lambda: up.dispatches(), 10, what="the turn's dispatch")
        state = "in_flight" if turn == "in flight" else "completed"
        wait_until(lambda: rows(pg_url, "SELECT state FROM operations") == [(state,)], 10,
                   what=f"the turn {turn} in the ledger")
        rows(admin, f"ALTER DATABASE {name} SET default_transaction_read_only = on")
        try:
            rows(admin, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = %s", (name,))
            assert post(b.url, sessionless, {**BODY, "input": "B meets the fault"})[0] == 200
            wait_until(lambda: events(tmp_path, "b", "ledger_unavailable"), 10,
                       what="B meeting the fault")
            retry = pool.submit(post, b.url, sessionless, body)
            wait_until(lambda: events(tmp_path, "b", "duplicate_held") or retry.done()
                       or len(up.dispatches()) > 2, 10, what="B deciding the retry")
            assert len(up.dispatches()) == 2, "B ran A's turn a second time, read-only"
        finally:
            rows(admin, f"ALTER DATABASE {name} RESET default_transaction_read_only")
        status, _, first = original.result(30)
        again, headers, replayed = retry.result(40)
        log = a.log_text() + b.log_text()
    assert status == again == 200 and headers.get("x-turnguard") == "replayed", headers
    assert replayed == first
    assert len(up.dispatches()) == 2  # the turn once, and B's own turn in the fault
    assert_no_traceback(log)


def test_a_nul_in_a_previous_response_id_is_stored_and_keeps_the_ledger_in_use(tmp_path, pg_url):
    """A call whose ``previous_response_id`` holds a NUL (which PostgreSQL refuses in text), on
    a WebSocket and over HTTP: its claim is written (the NUL stored as U+FFFD), never taken for
    an outage of the ledger that would leave every call after it decided in memory."""
    from test_e2e_websocket import HEADERS as WS_HEADERS, call, user

    prev = "resp_\u0000x"
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url) as a:
        async def on_socket():
            async with WsClient.connect(a.url, headers=WS_HEADERS) as c:
                await c.send(json.dumps(call([user("nul")], seed=1, previous_response_id=prev)))
                hostile = await c.response()
                await c.send(json.dumps(call([user("plain")], seed=2)))
                return hostile, await c.response()

        hostile, plain = asyncio.run(on_socket())
        http = post(a.url, body={**BODY, "input": "nul over http", "previous_response_id": prev})
        wait_until(lambda: rows(pg_url, "SELECT COUNT(*) FROM attempts WHERE outcome <> 'in_flight'")
                   == [(3,)], 10, what="the three calls' ends in the ledger")
        log = a.log_text()
    assert hostile and types(plain)[-1] == "response.completed" and http[0] == 200
    assert events(tmp_path, "a", "ledger_unavailable") == []
    assert [d["ledger"] for d in events(tmp_path, "a", "dispatch")] == [True] * 3
    assert sorted(r[0] for r in rows(pg_url, "SELECT previous_response_id FROM operations"
                                             " WHERE previous_response_id IS NOT NULL")) == [
        "resp_\ufffdx"] * 2
    assert_no_traceback(log)


def test_a_table_locked_under_a_replays_read_does_not_stop_the_ledger_deciding_other_turns(
        tmp_path, pg_url):
    """Another session holds ``spool`` in ACCESS EXCLUSIVE mode (``VACUUM FULL spool``, an
    operator's ``LOCK TABLE``) and keeps its transaction open. B's read of a recording waits
    for it no longer than its request's bound (it fails closed), and B's ledger goes on
    deciding: a duplicate through B of a turn A runs meanwhile is held (claims do not read the
    spool) and replayed once the lock goes, never run a second time."""
    sessionless = {"authorization": f"Bearer {SECRET}"}
    slow = {**sessionless, **harness.mock_behaviour(kind="ok", events=5, gap_ms=600)}
    recorded = {**BODY, "input": "recorded before the lock"}
    turn = {**BODY, "input": "runs while the spool is locked"}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url) as a, \
            guarded(tmp_path, up, "b", pg_url) as b, ThreadPoolExecutor(2) as pool:
        _warm_up(a, b, sessionless)
        assert post(a.url, sessionless, recorded)[0] == 200
        # its end (the recording) is written just after its client has the answer
        wait_until(lambda: in_flight(pg_url) == 0, 10, what="the recorded turn's end written")
        locker = psycopg.connect(pg_url, autocommit=True)
        try:
            locker.execute("BEGIN")
            locker.execute("LOCK TABLE spool IN ACCESS EXCLUSIVE MODE")
            # its bytes cannot be read now: failed closed, never run again
            assert post(b.url, sessionless, recorded, timeout=30)[0] == 503
            original = pool.submit(post, a.url, slow, turn)
            wait_until(lambda: len(up.dispatches()) == 4, 10, what="the turn's dispatch")
            duplicate = pool.submit(post, b.url, sessionless, turn)
            assert original.result(30)[0] == 200  # its end waits for the lock (kept)
            wait_until(lambda: duplicate.done() or events(tmp_path, "b", "duplicate_held"), 10,
                       what="the duplicate decided")
            locker.execute("COMMIT")
        finally:
            locker.close()
        status, headers, _ = duplicate.result(60)
        log = a.log_text() + b.log_text()
    assert len(up.dispatches()) == 4  # the warm-ups, the recorded turn, the turn once
    assert status == 200 and headers.get("x-turnguard") == "replayed"
    assert_no_traceback(log)



@pytest.mark.parametrize("fault", ["future_schema", "read_only"])
def test_a_postgres_ledger_unusable_at_start_up_keeps_proxying_and_is_used_once_mended(
        tmp_path, pg_url, fault):
    """The database holds a newer turnguard's ledger (schema version 99: left untouched), or
    is read-only (``default_transaction_read_only``): mitmdump starts, proxies and coalesces
    in memory; once an operator mends it, turnguard opens and uses it by itself."""
    name = pg_url.rsplit("/", 1)[1]
    admin = pg_url.rsplit("/", 1)[0] + "/postgres"
    if fault == "future_schema":
        rows(pg_url, "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        rows(pg_url, "INSERT INTO meta VALUES ('schema_version', '99'), ('generation', 'new')")
    else:
        rows(admin, f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    body = {**BODY, "input": "before the ledger is usable"}
    slow = {**HEADERS, **harness.mock_behaviour(kind="ok", events=4, gap_ms=500)}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url) as a, \
            ThreadPoolExecutor(2) as pool:
        original = pool.submit(post, a.url, slow, body)
        wait_until(lambda: up.dispatches(), 10, what="the original's dispatch")
        duplicate = post(a.url, HEADERS, body)
        assert original.result(30)[0] == duplicate[0] == 200
        assert len(up.dispatches()) == 1  # coalesced in memory
        assert [e["during"] for e in events(tmp_path, "a", "ledger_unavailable")][:1] == ["open"]
        if fault == "future_schema":  # a newer turnguard's ledger is left as it was
            assert rows(pg_url, "SELECT key, value FROM meta ORDER BY key") == [
                ("generation", "new"), ("schema_version", "99")]
            assert rows(pg_url, "SELECT to_regclass('operations')") == [(None,)]
            rows(pg_url, "DROP TABLE meta")
        else:
            rows(admin, f"ALTER DATABASE {name} RESET default_transaction_read_only")
        wait_until(lambda: re.search(r"turnguard: ledger \S+ \(instance", a.log_text()), 20,
                   what="the ledger opened")
        mended = {**BODY, "input": "once mended"}
        assert post(a.url, HEADERS, mended)[0] == 200
        again = post(a.url, HEADERS, mended)
        log = a.log_text()
    assert again[0] == 200 and again[1].get("x-turnguard") == "replayed"
    assert rows(pg_url, "SELECT COUNT(*) FROM operations WHERE state = 'completed'") >= [(1,)]
    assert_no_traceback(log)


def test_a_turn_dispatched_while_the_tables_are_locked_is_registered_as_soon_as_they_are_not(
        tmp_path, pg_url):
    """Another session keeps ``operations`` and ``attempts`` locked (ACCESS EXCLUSIVE) while A
    gets a turn: A decides it in memory and dispatches it, and owes the ledger its row. Its
    tries to write it wait for the lock (a lock timeout each); one that gave up is followed by
    the next at once, as on SQLite, so the row lands as the lock goes: a duplicate sent to B
    shortly after is held and replayed, never run a second time."""
    sessionless = {"authorization": f"Bearer {SECRET}"}
    slow = {**sessionless, **harness.mock_behaviour(kind="ok", events=6, gap_ms=600)}
    turn = {**BODY, "input": "dispatched while the tables are locked"}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url) as a, \
            guarded(tmp_path, up, "b", pg_url) as b, ThreadPoolExecutor(2) as pool:
        _warm_up(a, b, sessionless)
        locker = psycopg.connect(pg_url, autocommit=True)
        watch = psycopg.connect(pg_url, autocommit=True)

        def registering() -> int:  # A's try to write the turn's row, waiting for the lock
            return watch.execute(LOCK_WAITERS_SQL, (SNAPSHOT_SQL,)).fetchone()[0]

        try:
            locker.execute("BEGIN")
            locker.execute("LOCK TABLE operations, attempts IN ACCESS EXCLUSIVE MODE")
            original = pool.submit(post, a.url, slow, turn)
            wait_until(lambda: len(up.dispatches()) == 3, 10, what="the turn's dispatch")
            wait_until(registering, 10, interval=0.005, what="A's try to register it")
            # released between two tries, if A leaves a pause between them (50 polls in a row
            # without one), else after 5 s while a try waits (it takes the lock as it goes)
            quiet, until = 0, time.monotonic() + 5
            while quiet < 50 and time.monotonic() < until:
                quiet = 0 if registering() else quiet + 1
                time.sleep(0.002)
            locker.execute("COMMIT")
        finally:
            locker.close()
            watch.close()
        time.sleep(0.3)  # well past "about 0.1 s of the release"
        status, headers, _ = post(b.url, sessionless, turn)
        assert original.result(30)[0] == status == 200
        log = a.log_text() + b.log_text()
    assert len(up.dispatches()) == 3, "the turn ran twice"  # the warm-ups, the turn once
    assert headers.get("x-turnguard") in ("replayed", "attached")
    assert_no_traceback(log)


def test_a_hold_whose_listener_is_ended_and_cannot_connect_again_is_woken_by_polling(
        tmp_path, pg_url):
    """B holds a duplicate of A's turn; the server ends the LISTEN connections and refuses new
    ones to the database (``ALLOW_CONNECTIONS false``) until after the turn ended: its
    notification is lost. B polls over its ledger connection (still open) meanwhile, so the
    duplicate is replayed well within its hold bound, never 409, never run again; once the
    database takes connections again B listens again by itself."""
    name = pg_url.rsplit("/", 1)[1]
    admin = pg_url.rsplit("/", 1)[0] + "/postgres"
    sessionless = {"authorization": f"Bearer {SECRET}"}
    slow = {**sessionless, **harness.mock_behaviour(kind="ok", events=5, gap_ms=600)}
    turn = {**BODY, "input": "its end is not notified"}
    opts = {"turnguard_hold_timeout_ms": 15000}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url, **opts) as a, \
            guarded(tmp_path, up, "b", pg_url, **opts) as b, ThreadPoolExecutor(2) as pool:
        original = pool.submit(post, a.url, slow, turn)
        wait_until(lambda: up.dispatches(), 10, what="the turn's dispatch")
        duplicate = pool.submit(post, b.url, sessionless, turn)
        wait_until(lambda: events(tmp_path, "b", "duplicate_held"), 10, what="B holds it")
        try:
            rows(admin, f"ALTER DATABASE {name} WITH ALLOW_CONNECTIONS false")
            assert rows(admin, "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))"
                               " FROM pg_stat_activity WHERE datname = %s"
                               " AND application_name = 'turnguard-listen'", (name,)) == [(2,)]
            assert original.result(30)[0] == 200
            status, headers, body = duplicate.result(30)
        finally:
            rows(admin, f"ALTER DATABASE {name} WITH ALLOW_CONNECTIONS true")
        wait_until(lambda: "notifications from" in b.log_text()
                   and "resumed" in b.log_text(), 20, what="B listening again")
        log = a.log_text() + b.log_text()
    assert status == 200 and headers.get("x-turnguard") == "replayed"
    assert body == original.result()[2]
    assert len(up.dispatches()) == 1
    assert_no_traceback(log)


def test_a_recovery_claim_given_back_unused_leaves_the_operation_its_one_recovery(tmp_path, pg_url):
    """Once mode. A request held through its cooldown makes the recovery claim, which waits on
    table locks past the request's wait for the ledger: the request fails closed
    (``ledger_unavailable``: whether the recovery was spent cannot be read) and nothing is
    dispatched. The claim then lands and is given back (``rejected``: it never went upstream).
    The operation's one recovery was not used: the client's next retry recovers it, once.

    The locks are timed against the claim's bounds; on a loaded machine the claim may start
    late enough to answer within the request's wait, and the held request recovers (once:
    checked). That try did not get its setting: it goes again, a new session in a new
    process before a new upstream (the upstream's failures are used once)."""
    storm = {"sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
             "default": {"kind": "ok", "events": 4}}
    opts = {"turnguard_recovery_mode": ONCE, "turnguard_response_created_timeout_ms": 600,
            "turnguard_cooldown_ms": 4000}
    for attempt in range(3):  # bounded
        where = tmp_path / f"try{attempt}"
        where.mkdir()
        anchored = {**ANCHORED, "session-id": f"sess-pg-{attempt}",
                    "x-codex-turn-state": f"ts_pg_turn_{attempt}"}
        with MockUpstream(where, storm) as up, guarded(where, up, "a", pg_url, **opts) as a, \
                ThreadPoolExecutor(1) as pool:
            assert post(a.url, anchored)[0] == 502  # cut: no response event in time
            assert post(a.url, anchored)[0] in (0, 502)  # reset: the circuit opens; A owns it
            held = pool.submit(post, a.url, anchored)
            wait_until(lambda: events(where, "a", "wait_operation_fenced_cooldown"), 10,
                       what="the request held through the cooldown")
            open_until = rows(pg_url, "SELECT MAX(open_until) FROM circuits")[0][0]
            time.sleep(max(0.0, open_until - 0.2 - time.time()))  # just before the claim
            _claim_answers_late(pg_url, "the recovery claim waiting for the circuits")
            if held.result(30)[0] == 200:  # the claim answered in time: recovered, once
                assert len(up.dispatches()) == 3
                assert_no_traceback(a.log_text())
                continue
            assert [e["reason"] for e in events(where, "a", "fail_closed")] == ["ledger_unavailable"]
            wait_until(lambda: rows(pg_url, "SELECT COUNT(*) FROM attempts WHERE kind = 'recovery'"
                                            " AND outcome = 'rejected'") == [(1,)], 10,
                       what="the late recovery claim given back")
            assert len(up.dispatches()) == 2  # nothing went upstream for it
            retry = post(a.url, anchored)
            log = a.log_text()
        assert retry[0] == 200, (retry[0], events(where, "a", "fail_closed")[-1:])
        assert len(up.dispatches()) == 3  # the two failures, and the one recovery
        assert_no_traceback(log)
        return
    pytest.fail("the recovery claim answered within the request's wait in 3 tries")


@pytest.mark.slow
@pytest.mark.parametrize("stall", ["down", "paused"])
def test_a_server_down_past_a_peers_lease_is_no_proof_that_the_peer_is_gone(
        tmp_path, own_pg, stall, report):
    """A (another host: reaped only by its lease) runs a turn; B holds duplicates of it. The
    server is down (an immediate stop, a crash), or hangs (SIGSTOP: a frozen VM, a stalled
    disk), for longer than the lease: nobody can renew a lease meanwhile, so the silence is
    the ledger's, not A's. A comes back a few seconds after B
    (its own role refused connections a little longer: a slower reconnection): B must not
    reap A's turn and run it again, since A was not silent for a lease while B could see
    the ledger answer."""
    prefix = harness.another_host_prefix()
    url = own_pg.url
    rows(url, "CREATE ROLE peer_a LOGIN SUPERUSER")
    a_url = url.replace(f"{pg_server.DB_USER}@", "peer_a@")
    opts = {"turnguard_instance_lease_ms": 15000, "turnguard_hold_timeout_ms": 90000}
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 30000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, "b", url, **opts) as b, \
            guarded(tmp_path, up, "a", a_url, prefix=prefix, **opts) as a, \
            ThreadPoolExecutor(3) as pool:
        first = pool.submit(post, a.url)
        wait_until(lambda: up.dispatches(), 10, what="A's dispatch")
        dups = [pool.submit(post, b.url) for _ in range(2)]
        wait_until(lambda: len(events(tmp_path, "b", "duplicate_held")) == 2, 10,
                   what="2 duplicates held by B")
        rows(url, "ALTER ROLE peer_a NOLOGIN")  # A's connections made again fail for now
        if stall == "down":
            own_pg.restart(down_s=17)  # past the lease (15 s)
            wait_until(lambda: "usable again" in b.log_text(), 30, what="B back on the ledger")
        else:
            _pause_server(own_pg, True)
            try:  # past the lease (15 s) by more than a heartbeat: a heartbeat that A sent
                # during the pause lands with the time A sent it
                time.sleep(24)
            finally:
                _pause_server(own_pg, False)
            rows(url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                      " WHERE usename = 'peer_a'")
        time.sleep(3)  # B's maintenance reaps every second or so while it holds duplicates
        rows(url, "ALTER ROLE peer_a LOGIN")
        results = [first.result(60)] + [d.result(60) for d in dups]
        reaped = events(tmp_path, "b", "instance_reaped")
        log = a.log_text() + b.log_text()
    assert reaped == []
    assert [r[0] for r in results] == [200] * 3
    assert len({r[2] for r in results}) == 1
    assert len(up.dispatches()) == 1
    assert_no_traceback(log)
    report(f"PostgreSQL server {stall} past a 15 s lease, the peer on 'another host' back "
           f"3 s after the others: it kept its turn (reaped: {len(reaped)}); upstream "
           f"dispatches={len(up.dispatches())}")


def test_a_lock_on_the_instances_table_alone_leaves_claims_deciding(tmp_path, pg_url):
    """Another session keeps ``instances`` locked (``VACUUM FULL instances``): heartbeats and
    the reaper's reads wait for it and give up, but no claim reads that table. A duplicate
    through B of a turn A runs meanwhile is still held on the ledger and replayed, never run
    again: a maintenance read that found a lock is no outage of the ledger's decisions."""
    sessionless = {"authorization": f"Bearer {SECRET}"}
    slow = {**sessionless, **harness.mock_behaviour(kind="ok", events=5, gap_ms=600)}
    turn = {**BODY, "input": "runs while instances is locked"}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url) as a, \
            guarded(tmp_path, up, "b", pg_url) as b, ThreadPoolExecutor(2) as pool:
        _warm_up(a, b, sessionless)
        locker = psycopg.connect(pg_url, autocommit=True)
        watch = psycopg.connect(pg_url, autocommit=True)
        reapers: set[int] = set()

        def waiting_reapers() -> set[int]:
            return {r[0] for r in watch.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE %s", (REAPER_SQL,))}

        def both_reapers_met_it() -> bool:
            reapers.update(waiting_reapers())
            return len(reapers) >= 2

        try:
            locker.execute("BEGIN")
            locker.execute("LOCK TABLE instances IN ACCESS EXCLUSIVE MODE")
            # both processes' reapers (every 5 s) meet the lock and give up
            wait_until(both_reapers_met_it, 15, interval=0.01,
                       what="both reapers waiting for the lock")
            wait_until(lambda: not waiting_reapers(), 10, what="both reapers gave up")
            original = pool.submit(post, a.url, slow, turn)
            wait_until(lambda: len(up.dispatches()) == 3, 10, what="the turn's dispatch")
            status, headers, _ = post(b.url, sessionless, turn)
            assert original.result(30)[0] == status == 200
        finally:
            locker.execute("ROLLBACK")
            locker.close()
            watch.close()
        log = a.log_text() + b.log_text()
    assert len(up.dispatches()) == 3, "the turn ran twice"  # the warm-ups, the turn once
    assert headers.get("x-turnguard") in ("replayed", "attached")
    assert_no_traceback(log)


def test_a_duplicate_sent_elsewhere_while_another_session_locks_the_tables_against_writes_is_held(
        tmp_path, pg_url):
    """A's turn is in flight when another session locks ``operations`` and ``attempts``
    against writes, not reads (``LOCK TABLE ... IN EXCLUSIVE MODE``) and keeps its
    transaction open; a duplicate reaches B, which never saw the turn. B's admission still
    reads the operation: B never dispatches the turn a second time, it holds the duplicate on
    A's attempt and answers it once the turn ended. (A lock against reads too, ACCESS
    EXCLUSIVE, is the README's "cannot be read for it" limit: decided in memory.)"""
    mode = "EXCLUSIVE"
    slow = {**HEADERS, **harness.mock_behaviour(kind="ok", delay_ms=5000)}
    turn = {**BODY, "input": f"a duplicate while the tables are locked ({mode})"}
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url, **opts) as a, \
            guarded(tmp_path, up, "b", pg_url, **opts) as b, ThreadPoolExecutor(2) as pool:
        # B has served a turn (its connection made, its session claimed): on a loaded machine
        # a process's first calls, still under way, kept the duplicate's read past its step
        assert post(b.url, HEADERS, {**BODY, "input": "B knows the ledger"})[0] == 200
        original = pool.submit(post, a.url, slow, turn)
        wait_until(lambda: len(up.dispatches()) == 2, 10, what="the turn's dispatch")
        wait_until(lambda: in_flight(pg_url) == 1, 10, what="the turn in flight in the ledger")
        locker = psycopg.connect(pg_url, autocommit=True)
        try:
            locker.execute("BEGIN")
            locker.execute(f"LOCK TABLE operations, attempts IN {mode} MODE")
            duplicate = pool.submit(post, b.url, HEADERS, turn)
            wait_until(lambda: duplicate.done() or events(tmp_path, "b", "duplicate_held")
                       or len(up.dispatches()) > 2, 10, what="B deciding the duplicate")
            assert len(up.dispatches()) == 2, "B ran the turn a second time behind the lock"
            status, _, first = original.result(30)
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        again, headers, body = duplicate.result(60)
        log = a.log_text() + b.log_text()
    assert status == 200
    assert len(up.dispatches()) == 2  # B's own turn first, then A's, once
    assert again == 200 and headers.get("x-turnguard") in ("replayed", "attached"), headers
    assert_no_traceback(log)


@pytest.mark.parametrize("turn", ["in flight", "completed"])
def test_a_retry_queued_behind_claims_that_meet_a_table_lock_it_did_not_know_of_is_held_or_replayed(
        tmp_path, pg_url, turn):
    """A's turn is in the ledger (in flight, or completed) when another session locks
    ``operations`` and ``attempts`` against writes (``EXCLUSIVE``); three new turns reach B,
    which does not know of the lock, each of whose claims waits for it on B's one connection,
    and a retry of A's turn right behind them. Its call, queued behind the claims, came back
    unread, and B decided it in memory, blind to A's turn: it ran a second time (the full
    suite on a loaded machine found it, a call of B's own meeting the lock). B now reads the
    ledger apart (the lock lets reads through): the retry is held on A's attempt or replayed,
    one upstream execution."""
    sessionless = {"authorization": f"Bearer {SECRET}"}
    body = {**BODY, "input": f"a retry queued behind claims that meet a table lock ({turn})"}
    opts = dict(turnguard_hold_timeout_ms=30000)
    from test_ledger_faults import dispatches_of

    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url, **opts) as a, \
            guarded(tmp_path, up, "b", pg_url, **opts) as b, ThreadPoolExecutor(5) as pool:
        # both processes have used the ledger (B's connection is made, its session known)
        assert post(b.url, sessionless, {**BODY, "input": "B knows the ledger"})[0] == 200
        original = pool.submit(post, a.url, {**sessionless, **harness.mock_behaviour(
            kind="ok", delay_ms=5000 if turn == "in flight" else 0)}, body)
        state = "in_flight" if turn == "in flight" else "completed"
        wait_until(lambda: sorted(rows(pg_url, "SELECT state FROM operations"))
                   == sorted([("completed",), (state,)]), 10, what=f"the turn {turn} in the ledger")
        locker = psycopg.connect(pg_url, autocommit=True)
        try:
            locker.execute("BEGIN")
            locker.execute("LOCK TABLE operations, attempts IN EXCLUSIVE MODE")
            waiting = [pool.submit(post, b.url, sessionless, {**BODY, "input": f"new turn {n}"})
                       for n in range(3)]
            time.sleep(0.05)  # (their claims queued on B's connection, none failed yet)
            retry = pool.submit(post, b.url, sessionless, body)
            wait_until(lambda: events(tmp_path, "b", "duplicate_held") or retry.done()
                       or dispatches_of(up, body) > 1, 10, what="B deciding the retry")
            assert dispatches_of(up, body) == 1, "B ran A's turn a second time behind the lock"
            # (its probe takes the lock a claim takes: a heartbeat alone, which writes
            # instances, took the ledger for usable while the lock held)
            assert not events(tmp_path, "b", "ledger_recovered"), "B recovered behind the lock"
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        assert all(f.result(30)[0] == 200 for f in waiting)
        status, _, first = original.result(30)
        again, headers, replayed = retry.result(40)
        log = a.log_text() + b.log_text()
    assert status == again == 200 and headers.get("x-turnguard") == "replayed", headers
    assert replayed == first
    assert len(up.dispatches()) == 5  # B's first turn, A's turn once, B's three new turns
    assert_no_traceback(log)


@pytest.mark.parametrize("turn", ["in flight", "completed"])
def test_a_process_started_while_another_session_locks_the_tables_holds_or_replays_a_retry(
        tmp_path, pg_url, turn):
    """A's turn is in the ledger (in flight, or completed) when another session locks
    ``operations`` and ``attempts`` against writes (``EXCLUSIVE``); B starts then. Unlike
    SQLite's write lock, which keeps a new process from opening the ledger
    (test_at_most_once.py::test_a_process_started_while_the_ledger_cannot_be_written_reads_what_the_others_wrote),
    this one lets B open it (its open writes ``meta`` and ``instances`` alone), and B's
    admission reads the operation before it would claim: a retry of A's turn sent to B is
    held on A's attempt, or replayed, by the ledger itself, never run a second time; the
    lock gone, a held retry is answered with A's result."""
    sessionless = {"authorization": f"Bearer {SECRET}"}
    body = {**BODY, "input": f"sent to a process started behind a table lock ({turn})"}
    opts = dict(turnguard_hold_timeout_ms=30000)
    from test_ledger_faults import dispatches_of

    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url, **opts) as a, \
            ThreadPoolExecutor(2) as pool:
        original = pool.submit(post, a.url, {**sessionless, **harness.mock_behaviour(
            kind="ok", delay_ms=4000 if turn == "in flight" else 0)}, body)
        state = "in_flight" if turn == "in flight" else "completed"
        wait_until(lambda: rows(pg_url, "SELECT state FROM operations") == [(state,)], 10,
                   what=f"the turn {turn} in the ledger")
        locker = psycopg.connect(pg_url, autocommit=True)
        try:
            locker.execute("BEGIN")
            locker.execute("LOCK TABLE operations, attempts IN EXCLUSIVE MODE")
            with guarded(tmp_path, up, "b", pg_url, **opts) as b:
                retry = pool.submit(post, b.url, sessionless, body)
                wait_until(lambda: events(tmp_path, "b", "duplicate_held") or retry.done()
                           or dispatches_of(up, body) > 1, 10, what="B deciding the retry")
                assert dispatches_of(up, body) == 1, "B ran A's turn a second time"
                locker.execute("ROLLBACK")
                status, _, first = original.result(30)
                again, headers, replayed = retry.result(40)
                log = a.log_text() + b.log_text()
        finally:
            locker.close()
    assert status == again == 200 and headers.get("x-turnguard") == "replayed", headers
    assert replayed == first
    assert dispatches_of(up, body) == 1
    assert_no_traceback(log)


@pytest.mark.parametrize("remade_by", ["another turnguard", "the processes"])
def test_a_duplicate_sent_elsewhere_as_the_database_is_made_again_waits_for_the_owner(
        tmp_path, pg_url, remade_by):
    """A's turn is in flight when the ledger's tables are dropped and made again (another
    turnguard opening the emptied database, or the processes themselves once they find it
    empty): another ledger (generation). A duplicate sent to B then, which never saw the
    turn, is never dispatched a second time: it waits for A to register its attempt in the
    new ledger (admitted again meanwhile, never left waiting for a notification that came
    while it waited) and is replayed once the turn ended."""
    slow = {**HEADERS, **harness.mock_behaviour(kind="ok", delay_ms=6000)}
    turn = {**BODY, "input": f"a duplicate as the database is made again by {remade_by}"}
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url, **opts) as a, \
            guarded(tmp_path, up, "b", pg_url, **opts) as b, ThreadPoolExecutor(2) as pool:
        _warm_up(a, b)
        original = pool.submit(post, a.url, slow, turn)
        wait_until(lambda: len(up.dispatches()) == 3, 10, what="the turn's dispatch")
        wait_until(lambda: in_flight(pg_url) == 1, 10, what="the turn in flight in the ledger")
        _made_again(tmp_path, up, pg_url, remade_by)
        duplicate = pool.submit(post, b.url, HEADERS, turn)
        status, _, first = original.result(30)
        again, headers, body = duplicate.result(60)
        log = a.log_text() + b.log_text()
    assert status == 200
    assert len(up.dispatches()) == 3, "B ran the turn a second time"
    assert again == 200 and headers.get("x-turnguard") == "replayed", (again, headers)
    assert_no_traceback(log)


@pytest.mark.parametrize("remade_by", ["another turnguard", "the processes"])
def test_a_turn_that_ended_before_the_database_was_made_again_is_replayed_elsewhere(
        tmp_path, pg_url, remade_by):
    """A's turn ended (its recording in the ledger); then the ledger's tables are dropped and
    made again (another ledger: its generation). A retry sent to B then, which never saw the
    turn, is replayed with its bytes, never run again: A records its own recordings still
    within the replay window in the new ledger as it moves there, and B waits for A to
    have moved before it decides a request the new ledger knows nothing of."""
    turn = {**BODY, "input": f"ended before the database was made again by {remade_by}"}
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url, **opts) as a, \
            guarded(tmp_path, up, "b", pg_url, **opts) as b:
        _warm_up(a, b)
        status, _, first = post(a.url, HEADERS, turn)
        wait_until(lambda: in_flight(pg_url) == 0, 10, what="the turn's end in the ledger")
        _made_again(tmp_path, up, pg_url, remade_by)
        again, headers, body = post(b.url, HEADERS, turn)
        log = a.log_text() + b.log_text()
    assert status == 200
    assert len(up.dispatches()) == 3, "B ran the turn a second time"  # the warm-ups, the turn
    assert again == 200 and headers.get("x-turnguard") == "replayed", (again, headers)
    assert body == first
    assert events(tmp_path, "a", "recordings_moved")
    assert_no_traceback(log)


def test_a_retry_decided_before_the_database_made_again_opens_is_held_for_the_turns_owner(
        tmp_path, pg_url):
    """A's turn ended (B told of its end); then the ledger's tables are dropped and made
    again, and B's open of the new ledger waits (here for the migration lock another session
    holds: on a busy machine, for the server) past a retry's wait for the ledger. The retry,
    decided in memory, which knows the turn completed elsewhere but not its bytes, was failed
    closed (503 ``ledger_unavailable``), though A records its recording in the new ledger as
    it moves there: it is held for A, as one the new ledger knows nothing of is, and replayed
    with its bytes, never run again."""
    from turnguard_core.pg_ledger import MIGRATION_LOCK

    turn = {**BODY, "input": "a retry decided before the database made again opens"}
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", pg_url, **opts) as a, \
            guarded(tmp_path, up, "b", pg_url, **opts) as b, ThreadPoolExecutor(1) as pool:
        _warm_up(a, b)
        status, _, first = post(a.url, HEADERS, turn)
        wait_until(lambda: in_flight(pg_url) == 0, 10, what="the turn's end in the ledger")
        locker = psycopg.connect(pg_url, autocommit=True)
        try:
            locker.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
            rows(pg_url, "DROP SCHEMA public CASCADE; CREATE SCHEMA public")
            retry = pool.submit(post, b.url, HEADERS, turn)
            wait_until(lambda: events(tmp_path, "b", "request_held") or retry.done(), 15,
                       what="B deciding the retry")
        finally:
            locker.close()  # (the lock with it)
        again, headers, body = retry.result(60)
        log = a.log_text() + b.log_text()
    assert status == 200
    assert len(up.dispatches()) == 3, "B ran the turn a second time"  # the warm-ups, the turn
    assert again == 200 and headers.get("x-turnguard") == "replayed", \
        (again, headers, events(tmp_path, "b"))
    assert body == first
    assert not events(tmp_path, "b", "fail_closed")
    assert_no_traceback(log)


@pytest.mark.parametrize("lock", ["none", "instances locked as it stops"])
def test_a_turn_that_ends_while_a_reload_failed_is_written_to_postgres_as_the_process_stops(
        tmp_path, pg_url, lock):
    """The PostgreSQL twin of ``test_at_most_once.py``'s exit with no instance running: A's
    script is reloaded to a copy that does not load while A's turn is held upstream, the turn
    completes meanwhile, and A is stopped (SIGTERM) before the script is fixed (with another
    session holding ``instances`` locked for 0.8 s as it stops, or not). The unloaded
    instance opens the ledger as A exits and writes the turn's end there: nothing is left in
    flight, B replays the retry (one dispatch), and the log never shows the password."""
    from test_at_most_once import break_script, reloadable

    turn = {**BODY, "input": f"a turn that ends while a reload failed, on postgres ({lock})"}
    script = reloadable(tmp_path)
    with MockUpstream(tmp_path) as up:
        with guarded(tmp_path, up, "a", pg_url, addon=script) as a:
            with ThreadPoolExecutor(1) as pool:
                original = pool.submit(post, a.url,
                                       {**HEADERS, **harness.mock_behaviour(kind="ok", hold="a")},
                                       turn)
                up.wait_held("a", 30)
                break_script(a, script)
                up.release("a")
                first = original.result(30)
            assert first[0] == 200
            assert in_flight(pg_url) == 1
            if lock == "none":
                assert a.stop() == 0
            else:
                locker = psycopg.connect(pg_url, autocommit=True)
                try:
                    locker.execute("BEGIN")
                    locker.execute("LOCK TABLE instances IN ACCESS EXCLUSIVE MODE")
                    a.proc.send_signal(signal.SIGTERM)
                    a.wait_for_log("exiting while no instance runs", 10)
                    time.sleep(0.8)
                finally:
                    locker.execute("ROLLBACK")
                    locker.close()
                assert a.proc.wait(30) == 0
            log = a.log_text()
        assert in_flight(pg_url) == 0
        with guarded(tmp_path, up, "b", pg_url) as b:
            retry = post(b.url, HEADERS, turn)
            assert retry[0] == 200 and retry[1].get("x-turnguard") == "replayed"
            assert retry[2] == first[2]
        assert len(up.dispatches()) == 1
    password = re.search(r"://[^:/@]*:([^@]*)@", pg_url)
    assert password is None or password.group(1) not in log
    assert log.count("Traceback") == 1  # its SyntaxError



def test_a_turn_dispatched_while_the_server_restarts_is_registered_as_soon_as_it_is_back(
        tmp_path, own_pg):
    """The server is down (an immediate stop, as a crash) when A's turn comes: A decides it in
    memory and dispatches it, and owes the ledger its row. A tries again every 0.1 s while the
    server cannot be reached (not once a second, at the maintenance's tick), so the row lands
    as the server is back: a duplicate sent to B shortly after is held on it and replayed,
    never run a second time. Nothing is left in flight once the turn ended."""
    url = own_pg.url
    turn = {**BODY, "input": "dispatched while the server restarts"}
    slow = {**HEADERS, **harness.mock_behaviour(kind="ok", hold="h")}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", url) as a, \
            guarded(tmp_path, up, "b", url) as b, ThreadPoolExecutor(2) as pool:
        _warm_up(a, b)
        own_pg.stop(mode="immediate")
        try:
            original = pool.submit(post, a.url, slow, turn)
            up.wait_held("h", 10)  # dispatched from memory
            time.sleep(1.0)  # a few of A's tries meet the server down
        finally:
            own_pg.start()
        time.sleep(0.4)  # well past "about 0.1 s" of the server answering again
        duplicate = pool.submit(post, b.url, HEADERS, turn)
        wait_until(lambda: duplicate.done() or events(tmp_path, "b", "duplicate_held")
                   or len(up.dispatches()) > 3, 10, what="B deciding the duplicate")
        up.release("h")
        first, again = original.result(30), duplicate.result(30)
        wait_until(lambda: in_flight(url) == 0, 10, what="the turn's end written")
        log = a.log_text() + b.log_text()
    assert [e["ledger"] for e in events(tmp_path, "a", "dispatch")] == [True, False]
    assert len(up.dispatches()) == 3, "the turn ran twice"  # the warm-ups, the turn once
    assert first[0] == again[0] == 200
    assert again[1].get("x-turnguard") == "replayed" and again[2] == first[2]
    assert_no_traceback(log)


@pytest.mark.parametrize("fault", ["restart", "pause"])
@pytest.mark.parametrize("step", ["claimed", "first event", "before its end", "after its end"])
def test_a_server_down_at_a_step_of_a_turn_runs_it_once(tmp_path, own_pg, fault, step):
    """The server goes down for 2.5 s (an immediate stop, or paused by SIGSTOP) at a step of
    A's turn: just after its claim, after its first event is in the ledger, with everything
    but its terminal event sent, or after its end. A turn still running ends 1 s into the
    outage, so what it had left to write (its first event, its end, its recording) is owed.
    A's own retry during the outage, and retries through A and B 0.4 s after it, each get the
    turn's bytes; the turn runs once upstream, and nothing is left in flight. (B is asked
    only once the server is back: while it cannot read the ledger it knows nothing of A's
    turn, the limit the README states.)"""
    url = own_pg.url
    turn = {**BODY, "input": f"the server down ({fault}) at a step of a turn: {step}"}
    hold = {"claimed": {"hold": "h"}, "first event": {"hold": "h", "hold_after_events": 1},
            "before its end": {"hold": "h", "hold_after_events": 7}}.get(step)
    behaviour = {**HEADERS, **harness.mock_behaviour(kind="ok", **(hold or {}))}
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", url, **opts) as a, \
            guarded(tmp_path, up, "b", url, **opts) as b, ThreadPoolExecutor(4) as pool:
        _warm_up(a, b)
        original = pool.submit(post, a.url, behaviour, turn)
        if hold is not None:
            up.wait_held("h", 10)
        if step == "first event":
            wait_until(lambda: rows(url, "SELECT 1 FROM attempts WHERE events_seen > 0"
                                         " AND outcome = 'in_flight'"), 10,
                       what="the turn's first event in the ledger")
        elif step == "after its end":
            assert original.result(30)[0] == 200
        if fault == "restart":
            own_pg.stop(mode="immediate")
        else:
            _pause_server(own_pg, True)
        try:
            during = pool.submit(post, a.url, HEADERS, turn)
            time.sleep(1.0)
            if hold is not None:
                up.release("h")
            time.sleep(1.5)
        finally:
            if fault == "restart":
                own_pg.start()
            else:
                _pause_server(own_pg, False)
        time.sleep(0.4)
        after = [pool.submit(post, proxy.url, HEADERS, turn) for proxy in (a, b)]
        first = original.result(30)
        results = [during.result(45), *(r.result(45) for r in after)]
        wait_until(lambda: in_flight(url) == 0, 20, what="nothing in flight")
        log = a.log_text() + b.log_text()
    if fault == "restart":  # (a paused server's statements wait, within their bound)
        assert events(tmp_path, "a", "ledger_unavailable"), "A never met the outage"
    assert first[0] == 200
    assert [(r[0], r[1].get("x-turnguard") in ("replayed", "attached"), r[2] == first[2])
            for r in results] == [(200, True, True)] * 3
    assert len(up.dispatches()) == 3, "the turn ran twice"  # the warm-ups, the turn once
    assert_no_traceback(log)


@pytest.mark.parametrize("fault", ["restart", "pause", "drop"])
def test_a_turn_that_ends_while_the_ledger_is_down_runs_once_and_is_left_in_flight_nowhere(
        tmp_path, request, fault):
    """B holds a duplicate of A's turn when the ledger goes down just before the turn's end
    (the server stopped as a crash would, or paused by SIGSTOP: a frozen VM; or the database
    dropped, and made again a second later): A's end cannot be written when its client gets
    the answer, and is owed. Another duplicate comes to B once the fault is over. The turn
    runs once and each duplicate gets the original's bytes, well within its hold bound: the
    held one also where the database was made again (A writes the turn there whole; its
    notification names an attempt of that ledger, which wakes the duplicate held on A's
    attempt in the old one). Once the fault is over nothing is left in flight."""
    server = request.getfixturevalue("own_pg") if fault != "drop" else None
    url = server.url if server is not None else request.getfixturevalue("pg_url")
    name, admin = url.rsplit("/", 1)[1], url.rsplit("/", 1)[0] + "/postgres"
    turn = {**BODY, "input": f"a turn that ends while the ledger is down ({fault})"}
    last_event = {**HEADERS, **harness.mock_behaviour(kind="ok", hold="h", hold_after_events=7)}
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", url, **opts) as a, \
            guarded(tmp_path, up, "b", url, **opts) as b, ThreadPoolExecutor(3) as pool:
        _warm_up(a, b)
        original = pool.submit(post, a.url, last_event, turn)
        up.wait_held("h", 10)  # everything sent but response.completed
        held = pool.submit(post, b.url, HEADERS, turn)
        wait_until(lambda: events(tmp_path, "b", "duplicate_held"), 10, what="B holds it")
        if fault == "restart":
            server.stop(mode="immediate")
        elif fault == "pause":
            _pause_server(server, True)
        else:
            rows(admin, f"DROP DATABASE {name} WITH (FORCE)")
        try:
            up.release("h")
            wait_until(original.done, 10, what="the original answered")
            time.sleep(1.0)
        finally:
            if fault == "restart":
                server.start()
            elif fault == "pause":
                _pause_server(server, False)
            else:
                rows(admin, f"CREATE DATABASE {name}")
        later = post(b.url, HEADERS, turn)
        first, results = original.result(30), [held.result(30), later]

        def in_flight_once_made() -> int | None:
            try:
                return rows(url, "SELECT COUNT(*) FROM operations"
                                 " WHERE state = 'in_flight'")[0][0]
            except psycopg.errors.UndefinedTable:  # not made again yet
                return None

        wait_until(lambda: in_flight_once_made() == 0, 20, what="nothing in flight")
        log = a.log_text() + b.log_text()
    assert len(up.dispatches()) == 3, "the turn ran twice"  # the warm-ups, the turn once
    assert first[0] == 200
    assert [(r[0], r[1].get("x-turnguard"), r[2] == first[2]) for r in results] == [
        (200, "replayed", True)] * 2
    assert_no_traceback(log)


def test_a_claim_whose_commit_answer_was_lost_while_its_turn_runs_is_never_given_back(
        tmp_path, pg_url):
    """A's claim is committed, but the connection breaks before the server's answer: A
    cannot know the claim landed, decides in memory and dispatches. B sees the turn in flight
    under A and holds a duplicate. When A's connection is made again, the claim in doubt is
    the row of the turn that runs here: given back (``rejected``), it woke B, which ran the
    turn a second time."""
    from pg_cut import PgCut

    with MockUpstream(tmp_path) as up, PgCut(pg_url) as cut, \
            guarded(tmp_path, up, "a", cut.url) as a, guarded(tmp_path, up, "b", pg_url) as b, \
            ThreadPoolExecutor(2) as pool:
        _warm_up(a, b)
        slow = {**HEADERS, **harness.mock_behaviour(kind="slow", delay_ms=4000)}
        body = {**BODY, "input": "its claim's commit answer is lost"}
        cut.arm()
        original = pool.submit(post, a.url, slow, body)
        assert cut.wait_cut(15), "no claim was cut at its commit"
        wait_until(lambda: len(up.dispatches()) == 3, 15, what="the turn dispatched by A")
        duplicate = pool.submit(post, b.url, slow, body)
        wait_until(lambda: events(tmp_path, "b", "duplicate_held"), 15, what="B holds it")
        cut.let_in()  # A connects again while its turn runs, B's duplicate held on its claim
        status, headers, answer = duplicate.result(60)
        assert original.result(60)[0] == status == 200
        assert headers.get("x-turnguard") in ("replayed", "attached")
        assert len(up.dispatches()) == 3  # the two warm-ups, and this turn once
        assert in_flight(pg_url) == 0
        assert [e["reason"] for e in events(tmp_path, "a", "attempt_adopted")
                if e.get("reason")] == ["its claim's commit was in doubt"]
        assert_no_traceback(a.log_text() + b.log_text())


def test_a_duplicate_woken_by_a_completed_end_while_its_process_cannot_reach_the_ledger_is_not_run_again(
        tmp_path, pg_url):
    """A holds a duplicate of B's turn. A is cut off its ledger (its connections closed, new
    ones refused) but for the connection that listens for notifications. B's turn completes:
    the notification wakes A's duplicate, which cannot read the recording nor the operation.
    A knows from the notification that the turn completed: the duplicate is failed closed
    (503, as a completed turn whose bytes cannot be read), never run again."""
    from pg_cut import PgCut

    with MockUpstream(tmp_path) as up, PgCut(pg_url) as cut, \
            guarded(tmp_path, up, "a", cut.url) as a, guarded(tmp_path, up, "b", pg_url) as b, \
            ThreadPoolExecutor(2) as pool:
        _warm_up(a, b)
        slow = {**HEADERS, **harness.mock_behaviour(kind="slow", delay_ms=3000)}
        body = {**BODY, "input": "its end is told, its recording cannot be read"}
        original = pool.submit(post, b.url, slow, body)
        wait_until(lambda: len(up.dispatches()) == 3, 15, what="the turn dispatched by B")
        duplicate = pool.submit(post, a.url, slow, body)
        wait_until(lambda: events(tmp_path, "a", "duplicate_held"), 15, what="A holds it")
        cut.isolate()
        try:
            assert original.result(60)[0] == 200
            status, headers, _ = duplicate.result(60)
        finally:
            cut.let_in()
        assert len(up.dispatches()) == 3  # the two warm-ups, and this turn once
        assert status == 503 or (status == 200 and headers.get("x-turnguard") == "replayed")
        assert_no_traceback(a.log_text() + b.log_text())


def test_a_script_reload_while_the_server_hangs_does_not_hold_the_proxy(tmp_path, own_pg):
    """The server hangs (SIGSTOP) and A's script is reloaded: the instance loaded opens the
    ledger on a thread, never on the event loop, where the connect would hold every flow
    for its timeout. It runs before that try gives up (its log line comes first), a turn sent
    meanwhile is answered, decided in memory, and once the server answers again the ledger
    is used, nothing left in flight."""
    from test_at_most_once import reloadable, touch_to_reload

    url = own_pg.url
    script = reloadable(tmp_path)
    body = {**BODY, "input": "sent while the reloaded script's ledger opens"}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, "a", url, addon=script, turnguard_request_budget_ms=6000) as a:
        _warm_up(a, a)
        _pause_server(own_pg, True)
        try:
            started = touch_to_reload(a, script)
            wait_until(lambda: a.log_text().count("turnguard: running") > started, 15,
                       what="the script reloaded")
            answer = post(a.url, HEADERS, body)
            log = wait_until(lambda: (t := a.log_text()).count("unusable (open)") and t, 15,
                             what="the reloaded instance's try to open the ledger given up")
        finally:
            _pause_server(own_pg, False)
        wait_until(lambda: "usable again" in a.log_text(), 30, what="the ledger used again")
        assert answer[0] == 200
        reloaded_at = log.rindex("turnguard: running")
        assert reloaded_at < log.index("unusable (open)"), log[-3000:]
        assert in_flight(url) == 0
        assert_no_traceback(a.log_text())


def test_a_claim_in_doubt_whose_request_never_ran_is_given_back_after_a_script_reload(
        tmp_path, pg_url):
    """Once mode: A's claim is committed but its answer lost, and memory fails the request
    closed (503: nothing runs upstream). A's script is reloaded before A can connect again.
    The claim in doubt is the process's, not the unloaded instance's: the instance loaded
    gives it back once it can, so a retry through B runs the turn (before, it stayed in
    flight for A's live instance: every retry held, then 409, for as long as A lived)."""
    from pg_cut import PgCut
    from test_at_most_once import reloadable, reloaded, touch_to_reload

    script = reloadable(tmp_path)
    with MockUpstream(tmp_path) as up, PgCut(pg_url) as cut, \
            guarded(tmp_path, up, "a", cut.url, addon=script, turnguard_recovery_mode=ONCE) as a, \
            guarded(tmp_path, up, "b", pg_url, turnguard_recovery_mode=ONCE) as b:
        _warm_up(a, b)
        body = {**BODY, "input": "its claim in doubt, failed closed, then a reload"}
        cut.arm()
        assert post(a.url, HEADERS, body)[0] == 503
        assert cut.wait_cut(15)
        assert len(up.dispatches()) == 2  # (failed closed: nothing ran)
        reloaded(a, touch_to_reload(a, script))
        cut.let_in()
        wait_until(lambda: in_flight(pg_url) == 0, 20, what="the claim given back")
        status, headers, _ = post(b.url, HEADERS, body)
        assert status == 200 and headers.get("x-turnguard") is None
        assert len(up.dispatches()) == 3
        assert_no_traceback(a.log_text() + b.log_text())


def _local_tcp_ports(pid: int) -> set[int]:
    """The local ports of the TCP sockets process ``pid`` has open (from /proc)."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _ledger_connections(url: str, pid_of_client_port) -> int:
    """turnguard's connections to the database at ``url`` whose client is the process whose
    client ports ``pid_of_client_port`` says."""
    ports = rows(url, "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
                      " AND application_name LIKE 'turnguard%%' AND pid <> pg_backend_pid()")
    return sum(1 for (port,) in ports if pid_of_client_port(port))


def test_a_second_reload_while_the_first_reloads_open_is_under_way_leaks_no_connection(
        tmp_path, own_pg):
    """The server hangs and A's script is reloaded twice: the first instance loaded is
    unloaded while its ledger opens on a thread. That open, once the server answers, is
    closed, never used by a store closed for good (its ledger, heartbeat and listener
    connections were left open for the life of the process)."""
    from test_at_most_once import reloadable, reloaded, touch_to_reload

    url = own_pg.url
    script = reloadable(tmp_path)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", url, addon=script) as a:
        _warm_up(a, a)

        def of_a(port: int) -> bool:
            return port in _local_tcp_ports(a.pid)

        before = _ledger_connections(url, of_a)
        opened = a.log_text().count("turnguard: ledger postgresql")
        _pause_server(own_pg, True)
        try:
            reloaded(a, touch_to_reload(a, script))
            reloaded(a, touch_to_reload(a, script))
        finally:
            _pause_server(own_pg, False)
        wait_until(lambda: a.log_text().count("turnguard: ledger postgresql") > opened, 30,
                   what="the ledger opened by the instance loaded last")
        assert post(a.url, HEADERS, {**BODY, "input": "after two reloads"})[0] == 200
        wait_until(lambda: _ledger_connections(url, of_a) <= before, 15, interval=0.5,
                   what=f"no more than the {before} ledger connections of one instance")
        assert_no_traceback(a.log_text())


def test_a_duplicate_of_a_turn_completed_without_a_recording_is_dispatched_not_failed_closed(
        tmp_path, pg_url):
    """B's turn completes too large to record (``turnguard_replay_max_bytes``): its
    duplicates are dispatched, as the ledger decides. A learns the end from its notification
    while A cannot read the ledger: a retry through A is dispatched from memory, never failed
    closed as a completed turn whose bytes cannot be read (there are none)."""
    from pg_cut import PgCut

    with MockUpstream(tmp_path) as up, PgCut(pg_url) as cut, \
            guarded(tmp_path, up, "a", cut.url) as a, \
            guarded(tmp_path, up, "b", pg_url, turnguard_replay_max_bytes=10) as b:
        _warm_up(a, b)
        body = {**BODY, "input": "completed, too large to record"}
        assert post(b.url, HEADERS, body)[0] == 200
        time.sleep(0.5)  # (its notification reaches A: without it A decides blind anyway)
        cut.isolate()
        try:
            status, headers, _ = post(a.url, HEADERS, body)
        finally:
            cut.let_in()
        assert status == 200 and headers.get("x-turnguard") is None
        assert len(up.dispatches()) == 4
        assert_no_traceback(a.log_text() + b.log_text())
