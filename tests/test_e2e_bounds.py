"""End to end: what a running turnguard keeps in memory stays bounded under unbounded distinct
keys (sessions, circuit scopes, ...), read through ``turnguard.status`` of a real mitmdump
(``status_probe.py``: ``GET /__status``); and ``turnguard.status`` itself holds up no traffic
on a large ledger (its count held at ``count_gate.py``'s gate: order, not time). Counts, never
timings; every loop bounded."""

from __future__ import annotations

import os
import resource
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness import (
    MockUpstream,
    assert_no_traceback,
    default_tls,
    guarded,
    ledger_query,
    post_turn,
    turnguard_events,
    wait_until,
)

STATUS_PROBE = Path(__file__).with_name("status_probe.py")
TURN = {"model": "gpt-test", "input": "a turn of its own session", "stream": True}


def status(proxy) -> dict:
    """``turnguard.status`` of the running mitmdump (loaded with ``status_probe.py``)."""
    with httpx.Client(trust_env=False, timeout=20, verify=default_tls()) as c:
        r = c.get(proxy.url + "/__status")
    r.raise_for_status()
    return r.json()


def probed(tmp_path, up, **options):
    return guarded(tmp_path, up, extra_args=["-s", str(STATUS_PROBE)], **options)


@pytest.mark.slow
def test_sessions_and_circuits_of_many_distinct_sessions_are_not_kept_forever(tmp_path):
    """Thousands of distinct sessions (a gateway's clients come and go): each one served leaves
    a durable-session ownership and a retry circuit in the process's memory. Once its lease
    expired the session is no longer this process's (any process may take it over), and a
    circuit that counts no failure and does not cool down is no different from none: neither
    may stay in memory for good, or a long-running proxy grows with every session it ever saw
    (and ``turnguard_sessions_owned`` counts sessions it has not owned for hours)."""
    n_ok, n_failed = 300, 100
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "events": 2}}) as up, \
            probed(tmp_path, up, turnguard_owner_lease_ms=1000) as p:
        def one(i: int) -> int:
            headers = {"authorization": "Bearer sk-bounds", "session-id": f"sess-{i}"}
            behaviour = {"kind": "reset"} if i < n_failed else None
            return post_turn(p.url, headers, {**TURN, "input": f"turn {i}"},
                             behaviour=behaviour, timeout=30)[0]

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(one, range(n_ok + n_failed)))
        assert statuses.count(200) == n_ok, statuses
        assert len(up.dispatches()) == n_ok + n_failed
        # the leases (1 s) expire; the ticker looks at circuits every 5 s: within 15 s both
        # tables hold only what still matters (no session owned, a circuit per failed one)
        last: dict = {}

        def forgotten() -> bool:
            last.update(status(p))
            return last["owned_sessions"] == 0 and last["circuits_known"] <= n_failed

        try:
            wait_until(forgotten, timeout=15, interval=0.5,
                       what="expired sessions and idle circuits to be forgotten")
        except AssertionError as e:
            raise AssertionError(f"{e}: owned_sessions={last['owned_sessions']},"
                                 f" circuits_known={last['circuits_known']}") from None
        after = last
        assert after["circuits_known"] == n_failed, after
        # a session seen again is claimed again (renewed: still this process's), as before
        headers = {"authorization": "Bearer sk-bounds", "session-id": "sess-150"}
        assert post_turn(p.url, headers, {**TURN, "input": "again"})[0] == 200
        assert status(p)["owned_sessions"] == 1
        assert_no_traceback(p.log_text())


def test_the_recordings_owed_to_a_locked_ledger_are_bounded_and_every_end_is_written(tmp_path):
    """The ledger stays locked (another connection holds its write lock) under steady traffic
    of distinct turns with large answers: each attempt's end is kept for the ledger, and with
    it its recording. Those bytes must stay bounded (a lock of an hour would otherwise keep
    every answer of the hour in memory); past the bound a recording is not kept for the
    ledger (as a response over ``turnguard_replay_max_bytes`` is not), said in a log line and
    a telemetry event, while the end itself is never dropped: once the lock goes, every
    turn is in the ledger, completed, nothing left in flight."""
    n, delta = 60, 128 * 1024  # 60 answers of about 1.5 MiB: 90 MiB owed, the bound is 64
    ledger = tmp_path / "ledger.sqlite3"
    behaviour = {"kind": "ok", "events": 4, "delta_bytes": delta}
    with MockUpstream(tmp_path, {"default": behaviour}) as up, probed(tmp_path, up) as p:
        assert post_turn(p.url, {"authorization": "Bearer sk-owed"},
                         {**TURN, "input": "before the lock"})[0] == 200
        lock = sqlite3.connect(ledger, timeout=10, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            def one(i: int) -> int:
                status, _, body = post_turn(p.url, {"authorization": "Bearer sk-owed"},
                                            {**TURN, "input": f"owed {i}"}, timeout=60)
                return status if len(body) > 4 * delta else -status

            with ThreadPoolExecutor(4) as pool:
                statuses = list(pool.map(one, range(n)))
            assert statuses == [200] * n, statuses
            owed = status(p)
            assert owed["ledger_writes_pending"] >= n, owed
            assert owed["ledger_writes_pending_bytes"] <= 64 * 1024 * 1024, owed
            assert turnguard_events(tmp_path, kind="ledger_recording_not_kept"), owed
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        wait_until(lambda: status(p)["ledger_writes_pending"] == 0, timeout=30, interval=0.2,
                   what="the owed writes written")
        rows = ledger_query(ledger, "SELECT state, count(*) FROM operations GROUP BY state")
        assert rows == [("completed", n + 1)], rows
        assert len(up.dispatches()) == n + 1
        assert "not kept for the ledger" in p.log_text()
        assert_no_traceback(p.log_text())


def _descriptor_limit_leaving_one_free(pid: int) -> int:
    """The descriptor limit under which ``pid`` has exactly one descriptor number free (the
    next client's connection: then the proxy cannot open its upstream connection), read once
    its descriptors held still for 0.5 s (on a loaded machine one closed after the count, and
    the upstream connection had a number free: the turns were answered 200)."""
    def still() -> set[str] | None:
        before = set(os.listdir(f"/proc/{pid}/fd"))
        time.sleep(0.5)
        return before if set(os.listdir(f"/proc/{pid}/fd")) == before else None

    used = {int(fd) for fd in wait_until(still, 15, what="the proxy's descriptors still")}
    free = [fd for fd in range(max(used) + 3) if fd not in used]
    return free[1]


def test_the_proxys_own_shortage_of_descriptors_does_not_open_the_retry_circuit(tmp_path):
    """mitmdump runs out of file descriptors for a moment (a burst of clients past its
    ``ulimit -n``): the client connections it accepted cannot be sent upstream ("Too many open
    files", mitmproxy answers 502), nothing reached the upstream. That says nothing of the
    upstream's health: it must not count as an eventless failure of the upstream, or a short
    burst opens the session's retry circuit (then doubles its cooldown with each further
    request, up to ``turnguard_cooldown_max_ms``) and the session gets 503 for minutes after
    the descriptors are back."""
    headers = {"authorization": "Bearer sk-fd", "session-id": "sess-descriptors"}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, connection_strategy="lazy") as p:
        assert post_turn(p.url, headers, {**TURN, "input": "before"})[0] == 200
        p.wait_for_log("server disconnect")  # its connections closed: their descriptors free
        wait_until(lambda: "client disconnect" in p.log_text(), what="the client gone")
        soft, hard = resource.prlimit(p.proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(p.proc.pid, resource.RLIMIT_NOFILE,
                         (_descriptor_limit_leaving_one_free(p.proc.pid), hard))
        try:
            during = [post_turn(p.url, headers, {**TURN, "input": f"short {i}"}, timeout=30)[0]
                      for i in range(3)]
        finally:
            resource.prlimit(p.proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert during == [502, 502, 502], during
        # (an end is recorded on the ledger's thread: its record may follow the client's 502
        # by a moment on a busy machine)
        failures = wait_until(
            lambda: (f := turnguard_events(tmp_path, kind="eventless_failure"))[2:] and f, 10,
            what="the three failures recorded")
        assert all("Too many open files" in (f["detail"] or "") for f in failures), failures
        assert [f["counts_for_circuit"] for f in failures] == [False] * len(failures), \
            (during, turnguard_events(tmp_path, kind="circuit_opened"))
        assert len(failures) == 3, failures
        assert len(up.dispatches()) == 1
        after = post_turn(p.url, headers, {**TURN, "input": "after"})
        assert after[0] == 200, after
        assert not turnguard_events(tmp_path, kind="circuit_opened")
        # (asyncio's accept loop logs its own EMFILE tracebacks meanwhile: none of turnguard's)
        assert not [line for line in p.log_text().splitlines()
                    if line.strip().startswith("File ") and "/addon/" in line]


def test_identities_remembered_for_retries_are_bounded_in_bytes_headers_included(tmp_path):
    """The identities of the last requests are remembered, keyed by the whole request (its
    target, every header, its body), at most 8 MiB of them: a client whose requests carry
    large headers (a cookie jar, a trace header of a megabyte: mitmproxy sets no bound on a
    request's head) must not make it keep a megabyte per request, up to 1,024 of them."""
    mib = 1024 * 1024
    with MockUpstream(tmp_path) as up, probed(tmp_path, up) as p:
        answered = [post_turn(p.url, {"authorization": "Bearer sk-memo",
                                      "x-trace": f"{i}-" + "t" * mib},
                              {**TURN, "input": f"large head {i}"}, timeout=30)[0]
                    for i in range(20)]
        assert 0 not in answered, answered  # each answered (the mock refuses such a head)
        remembered = status(p)["identities_remembered"]
        assert 1 <= remembered <= 8, remembered  # 8 MiB hold at most 8 such requests
        # (the mock's resets opened that principal's retry circuit: another one is served)
        assert post_turn(p.url, {"authorization": "Bearer sk-memo-2"}, TURN)[0] == 200
        assert_no_traceback(p.log_text())


def test_idle_connections_to_the_metrics_endpoint_take_a_bounded_number_of_descriptors(tmp_path):
    """Each connection to ``/metrics`` was served by a thread of its own, waiting up to 10 s
    for a request that may never come: a client (a misconfigured scraper, anything that can
    reach the address) keeping hundreds of idle connections open took as many descriptors and
    threads of mitmdump, whose proxied traffic needs the same descriptors (past its
    ``ulimit -n`` it can accept no client and open no upstream connection). Past a small
    bound a connection is closed at once; the proxy and a scrape still work."""
    import socket

    from harness import metrics_url, scrape

    n = 200
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up,
                                               turnguard_metrics="127.0.0.1:0") as p:
        url = metrics_url(p)
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        pid = p.proc.pid
        before = len(os.listdir(f"/proc/{pid}/fd"))
        idle = []
        try:
            for _ in range(n):
                idle.append(socket.create_connection((host, int(port)), timeout=5))
            # the server takes them in until it is full and says so (bounded wait; not a count
            # of descriptors: others of mitmdump's, such as a start-up probe's, may close
            # meanwhile), then holds what it holds
            wait_until(lambda: "metrics connections are open; closing more" in p.log_text(),
                       timeout=20, what="the metrics server full and closing more at once")
            time.sleep(1.0)  # (a count, not a timing: it only lets the accept loop drain)
            held = len(os.listdir(f"/proc/{pid}/fd")) - before
            threads = len(os.listdir(f"/proc/{pid}/task"))
            assert held <= 40, (held, threads)
            assert post_turn(p.url, {"authorization": "Bearer sk-metrics"}, TURN)[0] == 200
        finally:
            for s in idle:
                s.close()
        def served():
            try:
                return scrape(url)
            except httpx.HTTPError:  # (closed at once: the server frees a slot as it sees
                return None          # the client's close, a moment after it)

        wait_until(lambda: served() is not None, timeout=15, interval=0.5,
                   what="a scrape served once the idle connections are gone")
        assert_no_traceback(p.log_text())


def test_a_scraper_that_sends_its_request_a_byte_at_a_time_is_cut_at_the_read_bound(tmp_path):
    """Each metrics connection waits up to 10 s for its request (README): a client that keeps
    sending it a byte at a time, each within the socket's timeout, must not hold its slot past
    that, or 16 such (the most served at once) keep every scrape out for as long as they
    like. Each is cut; then a scrape is served."""
    import select
    import socket

    from harness import metrics_url, scrape
    from turnguard_core.metrics import MAX_SCRAPE_CONNECTIONS, SCRAPE_READ_TIMEOUT_S

    with MockUpstream(tmp_path) as up, guarded(tmp_path, up,
                                               turnguard_metrics="127.0.0.1:0") as p:
        url = metrics_url(p)
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        slow = [socket.create_connection((host, int(port)), timeout=5)
                for _ in range(MAX_SCRAPE_CONNECTIONS)]
        cut: set[int] = set()
        try:
            for s in slow:
                s.sendall(b"GET /metrics HTTP/1.1\r\n")
            # a byte a second, for 2.5 times the bound (a count of bytes, not a timing)
            for _ in range(int(SCRAPE_READ_TIMEOUT_S * 2.5)):
                time.sleep(1.0)
                for i, s in enumerate(slow):
                    if i in cut:
                        continue
                    try:
                        s.sendall(b"x")
                        readable, _, _ = select.select([s], [], [], 0)
                        if readable and s.recv(1024) == b"":
                            cut.add(i)
                    except OSError:  # reset by the server
                        cut.add(i)
                if len(cut) == len(slow):
                    break
        finally:
            for s in slow:
                s.close()
        assert len(cut) == len(slow), f"{len(slow) - len(cut)} dribbling connections kept"
        assert scrape(url)
        assert_no_traceback(p.log_text())


# ------------------------------------------------------------------------------------------------
# turnguard.status on a large ledger

COUNT_GATE = Path(__file__).with_name("count_gate.py")
FILLED = 300_000  # operations in the ledger before the proxy starts (a busy gateway keeps ~1M)


def gate(proxy, action: str = "") -> dict:
    """``count_gate.py`` of the running mitmdump: close, open, fail, or read the gate."""
    with httpx.Client(trust_env=False, timeout=20, verify=default_tls()) as c:
        r = c.post(proxy.url + "/__count_gate" + (f"/{action}" if action else ""))
    r.raise_for_status()
    return r.json()


def _status_counts_apart(tmp_path, up, p, attempt_outcomes, filled: int) -> None:
    """``turnguard.status`` on a ledger of ``filled`` operations, its count held at the gate:
    by order, a turn sent after the status started the count is claimed in the ledger,
    dispatched once and answered before the count finished; the counts come on a later call;
    a failed count says why beside the last counts, never in their place."""
    gate(p, "close")
    first = status(p)
    # a mapping of state -> count, or null: never an error in its place
    assert first.get("operations_by_state") is None, first
    assert first["operations_counting"] is True and first["operations_count_error"] is None, first
    assert first["operations_counted_ms_ago"] is None, first
    wait_until(lambda: gate(p)["waiting"] == 1, 10, what="the count to run (at the gate)")

    headers = {"authorization": "Bearer sk-status", "session-id": "counted"}
    assert post_turn(p.url, headers, {**TURN, "input": "while the ledger is counted"},
                     timeout=30)[0] == 200
    assert len(up.dispatches()) == 1
    # its claim and its end went to the ledger, not behind the count nor around it
    wait_until(lambda: attempt_outcomes() == ["completed"], 10, what="the turn's end written")
    during = status(p)
    assert during["operations_counting"] is True and during["operations_by_state"] is None, during
    assert gate(p) == {"waiting": 1, "started": 1}  # the count still runs; one at a time
    assert not turnguard_events(tmp_path, kind="ledger_unavailable")

    gate(p, "open")
    counted = wait_until(lambda: (s := status(p))["operations_by_state"] is not None and s,
                         15, interval=0.1, what="the counts on a later status")
    assert counted["operations_by_state"] == {"completed": filled + 1}, counted
    assert isinstance(counted["operations_counted_ms_ago"], int), counted
    assert counted["operations_count_error"] is None, counted

    gate(p, "fail")  # the next count (a second later) fails
    failed = wait_until(lambda: (s := status(p))["operations_count_error"] and s,
                        15, interval=0.1, what="a failed count said")
    assert "locked" in failed["operations_count_error"], failed
    assert failed["operations_by_state"] == {"completed": filled + 1}, failed
    assert gate(p)["started"] == 2, "a count per second at most, none while one runs"
    assert_no_traceback(p.log_text())


def test_status_counts_a_large_sqlite_ledger_apart_from_the_traffic(tmp_path):
    """``turnguard.status`` counted the operations by state on the ledger's one connection,
    waiting up to a second on the event loop (280 ms for a million operations): every status
    froze the proxy, every claim of a new turn queued behind the count, and a busy ledger put
    ``{"error": ...}`` in the mapping of state -> count."""
    from turnguard_core.ledger import Ledger

    ledger = tmp_path / "ledger.sqlite3"
    made = Ledger(str(ledger), "filler")
    made.open(time.time(), register=False)
    made.close()
    db = sqlite3.connect(ledger, isolation_level=None)
    db.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
        " INSERT INTO operations (op_key, scope, method, path, fingerprint, state, created_at,"
        " updated_at) SELECT 'filled-' || i, 's', 'POST', '/v1/responses', 'f', 'completed',"
        " ?, ? FROM n", (FILLED, time.time(), time.time()))
    db.close()

    def outcomes() -> list[str]:
        return [r[0] for r in ledger_query(ledger, "SELECT outcome FROM attempts")]

    with MockUpstream(tmp_path, {"default": {"kind": "ok", "events": 2}}) as up, \
            guarded(tmp_path, up, extra_args=["-s", str(STATUS_PROBE), "-s", str(COUNT_GATE)]) as p:
        _status_counts_apart(tmp_path, up, p, outcomes, FILLED)


def test_status_counts_a_large_postgres_ledger_apart_from_the_traffic(tmp_path, pg_url):
    """The same on PostgreSQL: the count ran on the ledger's one connection (its thread), so
    every claim queued behind it; it runs on a short-lived connection of its own now."""
    import psycopg

    from turnguard_core.pg_ledger import PgLedger

    made = PgLedger(pg_url, "filler")
    made.open(time.time(), register=False)
    made.close()
    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute(
            "INSERT INTO operations (op_key, scope, method, path, fingerprint, state, created_at,"
            " updated_at) SELECT 'filled-' || i, 's', 'POST', '/v1/responses', 'f', 'completed',"
            " %s, %s FROM generate_series(1, %s) AS i", (time.time(), time.time(), FILLED))

    def outcomes() -> list[str]:
        with psycopg.connect(pg_url, autocommit=True) as db:
            return [r[0] for r in db.execute("SELECT outcome FROM attempts")]

    with MockUpstream(tmp_path, {"default": {"kind": "ok", "events": 2}}) as up, \
            guarded(tmp_path, up, ledger=pg_url,
                    extra_args=["-s", str(STATUS_PROBE), "-s", str(COUNT_GATE)]) as p:
        _status_counts_apart(tmp_path, up, p, outcomes, FILLED)
