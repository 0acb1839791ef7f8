"""Crashes and restarts: kill -9 of a real mitmdump + turnguard process, then a restart (or a
surviving second process) on the same ledger.

Each test counts what the upstream saw (the mock's dispatch log), what the ledger holds
(attempts, operations, circuits, sessions, ``PRAGMA integrity_check``) and what the clients got.
Every wait is bounded; every process is stopped in a ``with`` block or a ``finally``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from harness import (
    PYTHON,
    REPO,
    Mitmdump,
    MockUpstream,
    Regression,
    assert_no_traceback,
    default_tls,
    guarded,
    ledger_integrity,
    ledger_query,
    post_turn,
    running,
    sse_event_types,
    turnguard_events,
    upstream_of,
    wait_until,
)

SECRET = "sk-crash-test-0123456789"
HEADERS = {"authorization": f"Bearer {SECRET}", "session-id": "sess-crash"}
BODY = {"model": "gpt-test", "input": "survive a crash", "stream": True}
ANCHORED = {**HEADERS, "x-codex-turn-state": "ts_crash_turn"}
ONCE = "server_anchored_replay_once"


events = turnguard_events


def query(tmp_path: Path, sql: str, args=()) -> list[tuple]:
    """A read on the test's ledger (``tmp_path/ledger.sqlite3``) from another connection."""
    return ledger_query(tmp_path / "ledger.sqlite3", sql, args)


def integrity(tmp_path: Path) -> str:
    return ledger_integrity(tmp_path / "ledger.sqlite3")


def attempts(tmp_path: Path) -> list[tuple]:
    return query(
        tmp_path,
        "SELECT attempt_id, kind, instance_id, outcome, events_seen, detail FROM attempts"
        " ORDER BY attempt_id",
    )


def settled(tmp_path: Path, timeout: float = 10) -> list[tuple]:
    """The attempts once none is in flight: an outcome is recorded just after the client got
    its last byte, so a check right after an answer must wait for it (bounded)."""
    return wait_until(
        lambda: (r := attempts(tmp_path)) and all(a[3] != "in_flight" for a in r) and r,
        timeout, what="every attempt's outcome recorded",
    )


def instance_id_for_pid(tmp_path: Path, pid: int) -> str:
    rows = query(tmp_path, "SELECT instance_id FROM instances WHERE pid=?", (pid,))
    assert len(rows) == 1, rows
    return rows[0][0]


def post(url: str, headers=HEADERS, body=BODY, timeout: float = 60):
    """One request; a transport error (reset, cut stream, crash of the proxy) is status 0."""
    return post_turn(url, headers, body, cut_is_error=True, timeout=timeout)


class StreamingClient:
    """A client that reads an SSE response as it streams, in a thread. ``got(n)`` waits until
    n events arrived; ``join`` returns (status, bytes, error)."""

    def __init__(self, url: str, headers=HEADERS, body=BODY, timeout: float = 60):
        self.data = bytearray()
        self.status: int | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, args=(url, headers, body, timeout), daemon=True
        )
        self._thread.start()

    def _run(self, url, headers, body, timeout):
        h = {"content-type": "application/json", "accept": "text/event-stream", **headers}
        try:
            with httpx.Client(trust_env=False, timeout=timeout, verify=default_tls()) as c:
                with c.stream("POST", url + "/v1/responses", content=json.dumps(body).encode(),
                              headers=h) as r:
                    self.status = r.status_code
                    for chunk in r.iter_raw():
                        with self._lock:
                            self.data += chunk
        except BaseException as e:  # the proxy was killed: that is the point
            self.error = e

    def events(self) -> int:
        with self._lock:
            return bytes(self.data).count(b"\n\n")

    def got(self, n: int, timeout: float = 20) -> None:
        wait_until(lambda: self.events() >= n, timeout, what=f"{n} streamed events")

    def join(self, timeout: float = 30):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "streaming client did not end"
        return self.status, bytes(self.data), self.error


def dispatches(up: MockUpstream) -> list[dict]:
    return up.dispatches()


def original_and_held_duplicates(tmp_path: Path, up: MockUpstream, pool: ThreadPoolExecutor,
                                 original_url: str, duplicate_url: str, holder: str):
    """The original request through ``original_url``, once it is dispatched three duplicates
    through ``duplicate_url``, once the process ``holder`` holds them (bounded waits): their
    futures, (original, [duplicates])."""
    first = pool.submit(post, original_url)
    wait_until(lambda: dispatches(up), 10, what="the original dispatched")
    dups = [pool.submit(post, duplicate_url) for _ in range(3)]
    wait_until(lambda: len(events(tmp_path, holder, "duplicate_held")) == 3, 10,
               what=f"3 duplicates held by {holder}")
    return first, dups


# -----------------------------------------------------------------------------------------------
# kill -9 of the only process, then a restart on the same ledger


def test_kill9_while_a_response_streams_then_restart_marks_it_partial(tmp_path, report):
    scenario = {"sequence": [{"kind": "ok", "events": 60, "gap_ms": 100}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up:
        a = guarded(tmp_path, up, "a")
        try:
            dead_instance = instance_id_for_pid(tmp_path, a.pid)
            client = StreamingClient(a.url)
            client.got(4)
            # the first event is in the ledger before the crash
            wait_until(lambda: query(tmp_path, "SELECT 1 FROM attempts WHERE events_seen>0"),
                       10, what="first_event recorded")
            a.kill9()
        finally:
            a.stop()
        status, streamed, error = client.join()
        assert status == 200 and error is not None, "the client's stream must be cut, not ended"
        assert integrity(tmp_path) == "ok"
        assert [r[3] for r in attempts(tmp_path)] == ["in_flight"]  # as the crash left it

        with guarded(tmp_path, up, "b") as b:
            # the restart reaps the dead instance's attempt: it had events, so partial
            rows = wait_until(lambda: (r := attempts(tmp_path)) and r[0][3] != "in_flight" and r,
                              10, what="the dead attempt reaped")
            assert rows[0][1:] == ("original", dead_instance, "partial", 1, "owner process gone")
            assert query(tmp_path, "SELECT state FROM operations") == [("partial",)]
            assert not query(tmp_path, "SELECT 1 FROM instances WHERE instance_id=?",
                             (dead_instance,))
            reaped = events(tmp_path, "b", "instance_reaped")
            assert [r["instance"] for r in reaped] == [dead_instance]
            # a partial outcome is not an eventless failure: no cooldown
            assert not query(tmp_path, "SELECT 1 FROM circuits WHERE open_until IS NOT NULL")
            # the client's retry goes upstream once more (output existed: no replay possible),
            # and its duplicate afterwards is answered from the new recording
            status, _, body = post(b.url)
            assert status == 200
            again = post(b.url)
            assert again[0] == 200 and again[1].get("x-turnguard") == "replayed"
            assert again[2] == body
            assert len(dispatches(up)) == 2
            assert [r[1] for r in attempts(tmp_path)] == ["original", "retry"]
            assert integrity(tmp_path) == "ok"
            assert_no_traceback(b.log_text())
    report(f"kill -9 mid-stream ({client.events()} events streamed): restart reaped the attempt "
           f"as partial; retry dispatched once, then replayed; upstream dispatches=2")


def test_kill9_while_duplicates_are_held_then_restart_handles_the_retries(tmp_path, report):
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 8000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up:
        a = guarded(tmp_path, up, "a")
        pool = ThreadPoolExecutor(max_workers=4)
        try:
            dead_instance = instance_id_for_pid(tmp_path, a.pid)
            first, dups = original_and_held_duplicates(tmp_path, up, pool, a.url, a.url, "a")
            a.kill9()
            crashed = [f.result(timeout=30)[0] for f in [first, *dups]]
        finally:
            a.stop()
            pool.shutdown(wait=False)
        assert crashed == [0, 0, 0, 0]  # every client saw the crash; none got an answer
        assert integrity(tmp_path) == "ok"
        assert len(dispatches(up)) == 1

        with guarded(tmp_path, up, "b") as b:
            rows = wait_until(lambda: (r := attempts(tmp_path)) and r[0][3] != "in_flight" and r,
                              10, what="the dead attempt reaped")
            assert rows[0][1:4] == ("original", dead_instance, "unknown")
            assert query(tmp_path, "SELECT state FROM operations") == [("unknown",)]
            # one eventless failure is below the threshold: no cooldown
            assert not query(tmp_path, "SELECT 1 FROM circuits WHERE open_until IS NOT NULL")
            # the four clients retry together: one retry dispatch, three answered from it
            with ThreadPoolExecutor(max_workers=4) as retry_pool:
                retried = list(retry_pool.map(lambda _: post(b.url), range(4)))
            assert [r[0] for r in retried] == [200] * 4
            assert len({r[2] for r in retried}) == 1
            assert len(dispatches(up)) == 2
            assert [r[1] for r in attempts(tmp_path)] == ["original", "retry"]
            assert integrity(tmp_path) == "ok"
            assert_no_traceback(b.log_text())
    report("kill -9 with 3 duplicates held: restart reaped the original as unknown; the 4 "
           f"clients' retries -> statuses {[r[0] for r in retried]}, upstream dispatches=2")


def _open_circuit(url: str) -> None:
    """Two eventless failures of the anchored turn (the mock resets twice): cooldown opens."""
    assert post(url, ANCHORED)[0] in (0, 502)
    assert post(url, ANCHORED)[0] in (0, 502)


def _kill9_while_holding_through_the_cooldown(tmp_path: Path, a: Mitmdump) -> None:
    """kill -9 of the process ``a`` (named "a") while it holds a request of the anchored turn
    through its circuit's cooldown; that client gets no answer."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        held = pool.submit(post, a.url, ANCHORED)
        wait_until(lambda: events(tmp_path, "a", "wait_operation_fenced_cooldown"), 10,
                   what="A holds a request through the cooldown")
        a.kill9()
        assert held.result(timeout=30)[0] == 0
    finally:
        pool.shutdown(wait=False)


def test_kill9_while_a_request_is_held_through_a_cooldown_then_restart_recovers_once(
    tmp_path, report
):
    cooldown_ms, lease_ms = 9000, 3000
    scenario = {"sequence": [{"kind": "reset"}, {"kind": "reset"}], "default": {"kind": "ok"}}
    opts = dict(turnguard_recovery_mode=ONCE, turnguard_cooldown_ms=cooldown_ms,
                turnguard_owner_lease_ms=lease_ms)
    with MockUpstream(tmp_path, scenario) as up:
        a = guarded(tmp_path, up, "a", **opts)
        try:
            _open_circuit(a.url)
            circuit_before = query(tmp_path, "SELECT scope, failures, open_until FROM circuits")
            assert len(circuit_before) == 1 and circuit_before[0][1] == 2
            _kill9_while_holding_through_the_cooldown(tmp_path, a)
        finally:
            a.stop()
        assert integrity(tmp_path) == "ok"
        session_a = query(tmp_path, "SELECT owner_instance, owner_epoch, lease_until FROM sessions")
        assert len(session_a) == 1 and session_a[0][1] == 1

        with guarded(tmp_path, up, "b", **opts) as b:
            # the cooldown survived the crash, unchanged
            assert query(tmp_path, "SELECT scope, failures, open_until FROM circuits") == \
                circuit_before
            within_lease = time.time() < session_a[0][2] - 0.3
            if within_lease:  # the dead owner's lease still runs: no owner proof, fail closed
                status, _, _ = post(b.url, {**ANCHORED, "accept": "application/json"})
                if status == 503:
                    assert [e["reason"] for e in events(tmp_path, "b", "fail_closed")] == [
                        "owner_proof_missing"]
                else:  # (a busy machine decided it only after the lease: then taken over)
                    claimed = events(tmp_path, "b", "session_claimed")
                    assert [c["result"] for c in claimed] == ["taken_over"], (status, claimed)
                    assert claimed[0]["ts"] >= session_a[0][2], "taken over within the lease"
            wait_until(lambda: time.time() > session_a[0][2] + 0.1, lease_ms / 1000 + 2,
                       what="the dead owner's lease to expire")
            # after the lease: take the session over (epoch 2), hold through the rest of the
            # cooldown, recover once for all three clients
            with ThreadPoolExecutor(max_workers=3) as retry_pool:
                retried = list(retry_pool.map(lambda _: post(b.url, ANCHORED), range(3)))
            assert [r[0] for r in retried] == [200] * 3
            assert len({r[2] for r in retried}) == 1
            claimed = events(tmp_path, "b", "session_claimed")
            assert [(c["result"], c["epoch"]) for c in claimed] == [("taken_over", 2)]
            assert query(tmp_path, "SELECT owner_epoch FROM sessions") == [(2,)]
            assert len(events(tmp_path, "b", "recovery_claimed")) == 1
            assert query(tmp_path, "SELECT recovery_dispatches FROM operations") == [(1,)]
            assert [r[1] for r in attempts(tmp_path)].count("recovery") == 1
            assert len(dispatches(up)) == 3  # two failures + one recovery; none while waiting
            assert dispatches(up)[2]["ts"] >= circuit_before[0][2] - 0.5
            assert integrity(tmp_path) == "ok"
            assert_no_traceback(b.log_text())
    report(f"kill -9 while held through a cooldown (once mode): restart kept the cooldown; "
           f"{'fail closed within the dead owner lease, then ' if within_lease else ''}"
           f"took the session over (epoch 2) after the lease; 3 retries -> "
           f"{[r[0] for r in retried]}, recovery dispatches=1, upstream dispatches=3")


def _crash_during_recovery(tmp_path: Path, up: MockUpstream, opts: dict) -> None:
    """Open the circuit, hold one request through the cooldown, and kill -9 the process while
    its recovery dispatch is stalled upstream (dispatch n=2)."""
    a = guarded(tmp_path, up, "a", **opts)
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        _open_circuit(a.url)
        held = pool.submit(post, a.url, ANCHORED)
        up.wait_for_record(lambda r: r.get("event") == "dispatch" and r["n"] == 2, 20)
        wait_until(lambda: events(tmp_path, "a", "recovery_claimed"), 10, what="recovery claim")
        a.kill9()
        assert held.result(timeout=30)[0] == 0
    finally:
        a.stop()
        pool.shutdown(wait=False)


RECOVERY_STALLS = {
    "sequence": [{"kind": "reset"}, {"kind": "reset"},
                 {"kind": "stall_before_headers", "ms": 60000}],
    "default": {"kind": "ok"},
}


def test_kill9_during_the_recovery_dispatch_leaves_one_recovery_counted(tmp_path):
    opts = dict(turnguard_recovery_mode=ONCE, turnguard_cooldown_ms=1500,
                turnguard_owner_lease_ms=2000)
    with MockUpstream(tmp_path, RECOVERY_STALLS) as up:
        _crash_during_recovery(tmp_path, up, opts)
        assert integrity(tmp_path) == "ok"
        with guarded(tmp_path, up, "b", **opts):
            rows = wait_until(lambda: (r := attempts(tmp_path)) and r[-1][3] != "in_flight" and r,
                              10, what="the dead recovery attempt reaped")
            assert [(r[1], r[3]) for r in rows] == [
                ("original", "unknown"), ("retry", "unknown"), ("recovery", "unknown")]
            assert query(tmp_path, "SELECT state, recovery_dispatches FROM operations") == [
                ("unknown", 1)]
            assert integrity(tmp_path) == "ok"


def test_kill9_during_the_recovery_dispatch_then_the_retry_is_not_dispatched_again(tmp_path):
    """Without a crash, a recovery dispatch that ends eventless re-opens the cooldown (3rd
    failure) and the client's next retry is held and denied (claim exhausted: 503
    upstream_operation_status_unknown), nothing dispatched. A crash of the process during
    that dispatch must not turn the same retry into a fresh upstream dispatch."""
    opts = dict(turnguard_recovery_mode=ONCE, turnguard_cooldown_ms=1500,
                turnguard_owner_lease_ms=2000)
    with MockUpstream(tmp_path, RECOVERY_STALLS) as up:
        _crash_during_recovery(tmp_path, up, opts)
        with guarded(tmp_path, up, "b", **opts) as b:
            wait_until(lambda: attempts(tmp_path)[-1][3] != "in_flight", 10, what="reaped")
            lease_until = query(tmp_path, "SELECT lease_until FROM sessions")[0][0]
            wait_until(lambda: time.time() > lease_until + 0.1, 5, what="lease expiry")
            status, _, body = post(b.url, {**ANCHORED, "accept": "application/json"}, timeout=30)
            if len(dispatches(up)) != 3:
                raise Regression(f"the operation was dispatched again (answer {status}) after its "
                               "once-only recovery attempt was reaped as unknown")
            assert status == 503
            assert json.loads(body)["error"]["code"] == "upstream_operation_status_unknown"


def test_kill9_under_concurrent_writes_leaves_a_consistent_ledger(tmp_path):
    scenario = {"default": {"kind": "ok", "events": 20, "gap_ms": 30}}
    with MockUpstream(tmp_path, scenario) as up:
        a = guarded(tmp_path, up, "a")
        pool = ThreadPoolExecutor(max_workers=40)
        try:
            futures = [pool.submit(post, a.url, {**HEADERS, "session-id": f"w{i % 5}"},
                                   {**BODY, "input": f"write {i}"}) for i in range(40)]
            wait_until(lambda: len(dispatches(up)) >= 20, 20, what="writes in flight")
            a.kill9()
            for f in futures:
                f.result(timeout=60)
        finally:
            a.stop()
            pool.shutdown(wait=False)
        assert integrity(tmp_path) == "ok"
        with guarded(tmp_path, up, "b") as b:
            wait_until(lambda: not query(tmp_path, "SELECT 1 FROM attempts WHERE outcome="
                                                   "'in_flight'"), 10, what="everything reaped")
            assert integrity(tmp_path) == "ok"
            assert query(tmp_path, "PRAGMA foreign_key_check") == []
            # every operation's state is the outcome of its current attempt
            assert query(tmp_path, "SELECT COUNT(*) FROM operations o JOIN attempts a"
                                   " ON a.attempt_id=o.current_attempt WHERE o.state<>a.outcome"
                         ) == [(0,)]
            assert query(tmp_path, "SELECT COUNT(*) FROM operations WHERE state='in_flight'") \
                == [(0,)]
            assert_no_traceback(b.log_text())


# -----------------------------------------------------------------------------------------------
# Two processes on one ledger, one killed


def test_two_processes_one_killed_mid_stall_the_survivor_reaps_and_takes_over(tmp_path, report):
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 30000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "b") as b:
        a = guarded(tmp_path, up, "a")
        pool = ThreadPoolExecutor(max_workers=4)
        try:
            dead_instance = instance_id_for_pid(tmp_path, a.pid)
            first, dups = original_and_held_duplicates(tmp_path, up, pool, a.url, b.url, "b")
            assert all(e["owner"] == dead_instance for e in events(tmp_path, "b", "duplicate_held"))
            killed_at = time.time()
            a.kill9()
            assert first.result(timeout=30)[0] == 0
            results = [f.result(timeout=60) for f in dups]
        finally:
            a.stop()
            pool.shutdown(wait=False)
        reaped = events(tmp_path, "b", "instance_reaped")
        assert [r["instance"] for r in reaped] == [dead_instance]
        reap_s = reaped[0]["ts"] - killed_at
        assert reap_s < 20, f"the survivor took {reap_s:.1f} s to notice a dead process"
        assert [r[0] for r in results] == [200] * 3
        assert len({r[2] for r in results}) == 1
        assert len(dispatches(up)) == 2  # A's (lost in the crash) + B's single retry
        rows = settled(tmp_path)
        assert [(r[1], r[3]) for r in rows] == [("original", "unknown"), ("retry", "completed")]
        assert integrity(tmp_path) == "ok"
        assert_no_traceback(b.log_text())
    report(f"two processes, A killed with the original in flight: B reaped it after "
           f"{reap_s:.1f} s; B's 3 held duplicates -> {[r[0] for r in results]}; "
           "upstream dispatches=2")


# A stand-in for a turnguard process killed in the middle of a claim: the real Ledger class,
# in its own process, with its own instance row (pid) so the survivor can tell it died.
_CLAIMER = r"""
import json, os, sys, time
sys.path.insert(0, os.path.join(sys.argv[1], "addon"))
from turnguard_core import identity, policy
from turnguard_core.ledger import Ledger

path, mode, headers, body = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5].encode()
scheme, host, port = json.loads(sys.argv[6])  # the upstream mitmdump sends the request to
view = identity.RequestView("POST", "/v1/responses", tuple(headers.items()), body,
                            identity.Upstream(scheme, host, port))
ident = identity.identify(view)
led = Ledger(path, "claimer-" + str(os.getpid()))
led.open(time.time())
if mode == "committed":
    d = led.admit(ident, method="POST", path="/v1/responses", now=time.time(),
                  guard=policy.GuardPolicy(), flow_id="claimer")
    assert isinstance(d, policy.Dispatch), d
    print("claimed", d.attempt_id, flush=True)
else:  # inside the claim's write transaction, not committed
    db = led._db
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT INTO operations (op_key, scope, method, path, fingerprint, state,"
               " created_at, updated_at) VALUES (?,?,?,?,?, 'in_flight', 0, 0)",
               (ident.op_key, ident.scope, "POST", "/v1/responses", ident.fingerprint))
    db.execute("INSERT INTO attempts (op_key, kind, instance_id, started_at)"
               " VALUES (?, 'original', ?, 0)", (ident.op_key, led.instance_id))
    print("claimed", "uncommitted", flush=True)
time.sleep(120)
"""


def _start_claimer(tmp_path: Path, mode: str, upstream_url: str) -> subprocess.Popen:
    out = tmp_path / f"claimer-{mode}.out"
    h = {"content-type": "application/json", "accept": "text/event-stream", **HEADERS}
    up = upstream_of(upstream_url)
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [PYTHON, "-c", _CLAIMER, str(REPO), str(tmp_path / "ledger.sqlite3"), mode,
             json.dumps(h), json.dumps(BODY), json.dumps([up.scheme, up.host, up.port])],
            stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: b"claimed" in out.read_bytes() or proc.poll() is not None, 20,
                   what="the claimer's claim")
        assert proc.poll() is None, out.read_text()
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def test_process_killed_after_committing_a_claim_the_survivor_takes_over(tmp_path, report):
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "b") as b:
        claimer = _start_claimer(tmp_path, "committed", up.url)
        pool = ThreadPoolExecutor(max_workers=2)
        try:
            waiting = [pool.submit(post, b.url) for _ in range(2)]
            wait_until(lambda: len(events(tmp_path, "b", "duplicate_held")) == 2, 10,
                       what="B holds the requests behind the claimer's attempt")
            assert not dispatches(up)
            killed_at = time.time()
            _kill(claimer)
            results = [f.result(timeout=60) for f in waiting]
        finally:
            _kill(claimer)
            pool.shutdown(wait=False)
        assert [r[0] for r in results] == [200, 200] and results[0][2] == results[1][2]
        assert len(dispatches(up)) == 1
        reaped = events(tmp_path, "b", "instance_reaped")
        assert len(reaped) == 1 and reaped[0]["pid"] == claimer.pid
        assert [(r[1], r[3]) for r in settled(tmp_path)] == [
            ("original", "unknown"), ("retry", "completed")]
        assert integrity(tmp_path) == "ok"
        assert_no_traceback(b.log_text())
    report(f"process killed right after committing a claim: survivor reaped it after "
           f"{reaped[0]['ts'] - killed_at:.1f} s and dispatched once")


def test_process_killed_inside_the_claim_transaction_leaves_no_trace(tmp_path):
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "b") as b:
        claimer = _start_claimer(tmp_path, "uncommitted", up.url)
        _kill(claimer)  # SIGKILL while it holds the write lock with an uncommitted claim
        status, _, _ = post(b.url)
        assert status == 200
        assert len(dispatches(up)) == 1
        assert [(r[1], r[3]) for r in settled(tmp_path)] == [("original", "completed")]
        assert integrity(tmp_path) == "ok"
        assert not events(tmp_path, "b", "ledger_unavailable")
        assert_no_traceback(b.log_text())


def test_survivor_takes_a_session_over_only_after_the_dead_owners_lease(tmp_path, report):
    cooldown_ms, lease_ms = 8000, 3000
    scenario = {"sequence": [{"kind": "reset"}, {"kind": "reset"}], "default": {"kind": "ok"}}
    opts = dict(turnguard_recovery_mode=ONCE, turnguard_cooldown_ms=cooldown_ms,
                turnguard_owner_lease_ms=lease_ms)
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "b", **opts) as b:
        a = guarded(tmp_path, up, "a", **opts)
        try:
            _open_circuit(a.url)  # A owns the session
            _kill9_while_holding_through_the_cooldown(tmp_path, a)
        finally:
            a.stop()
        lease_until = query(tmp_path, "SELECT lease_until FROM sessions")[0][0]
        early = None
        if time.time() < lease_until - 0.3:
            early = post(b.url, {**ANCHORED, "accept": "application/json"})
            assert early[0] == 503
            assert [e["reason"] for e in events(tmp_path, "b", "fail_closed")] == [
                "owner_proof_missing"]
        wait_until(lambda: time.time() > lease_until + 0.1, lease_ms / 1000 + 2,
                   what="lease expiry")
        status, _, body = post(b.url, ANCHORED)
        assert status == 200 and sse_event_types(body)[-1] == "response.completed"
        assert [(c["result"], c["epoch"]) for c in events(tmp_path, "b", "session_claimed")] == [
            ("taken_over", 2)]
        assert len(events(tmp_path, "b", "recovery_claimed")) == 1
        assert query(tmp_path, "SELECT recovery_dispatches FROM operations") == [(1,)]
        assert len(dispatches(up)) == 3
        assert integrity(tmp_path) == "ok"
        assert_no_traceback(b.log_text())
    report("two processes, session owner A killed while holding through a cooldown: B "
           f"{'failed closed within the lease, then ' if early else ''}took the session over "
           "(epoch 2) after it and recovered once")


def _identity_workers(pid: int) -> list[int]:
    """The identity worker processes ``pid`` started (spawned: ``spawn_main`` in their
    command line), alive or not yet reaped."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            for child in (int(c) for c in f.read().split()):
                with contextlib.suppress(OSError), open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"spawn_main" in c.read():
                        found.append(child)
    return found


def test_kill9_does_not_leave_the_identity_worker_running(tmp_path):
    """A large body starts the identity worker (a process of its own). mitmdump killed
    (kill -9: its `done` hook never runs) takes the worker with it, idle or busy with a body
    (before, the worker waited for work for good, an orphan of every crash)."""
    large = {**BODY, "input": "l" * 300_000}
    hostile = ('{"model":"m","stream":true,"input":['
               + ",".join('{"a":1,"b":[2]}' for _ in range(1_000_000)) + "]}").encode()
    left = []
    with MockUpstream(tmp_path) as up:
        for busy in (False, True):
            a = guarded(tmp_path, up, "a")
            try:
                assert post(a.url, body=large)[0] == 200
                workers = _identity_workers(a.pid)
                assert len(workers) == 1
                if busy:  # the worker parses a body for far longer than the test waits
                    connects = a.log_text().count("client connect")
                    threading.Thread(target=post, args=(a.url, HEADERS, hostile, 30),
                                     daemon=True).start()
                    wait_until(lambda: a.log_text().count("client connect") > connects, 10,
                               what="the hostile request")
                    time.sleep(1.0)  # its upload; then the worker parses it for seconds
                a.kill9()
            finally:
                a.stop()
            try:
                wait_until(lambda: not any(map(running, workers)), 10, what="the worker gone")
            except Exception:
                left += [w for w in workers if running(w)]
                for w in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w, signal.SIGKILL)  # (not left to the machine)
    assert not left
