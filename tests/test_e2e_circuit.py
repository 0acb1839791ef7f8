"""End to end: eventless failures, the retry circuit, the cooldown fence and recovery claims,
through real mitmdump subprocesses in front of the real mock upstream."""

import contextlib
import json
import signal
import socket
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
    mock_behaviour,
    post_turn,
    sse_event_types,
    turnguard_events,
    wait_until,
)

TURN = {"model": "gpt-test", "input": [{"role": "user", "content": "fix the bug"}], "stream": True}
ANCHORED = {
    "authorization": "Bearer sk-circuit-test",
    "session-id": "sess-storm",
    "x-codex-turn-state": "ts_turn_1",
}
COOLDOWN_MS = 3000
STORM = {  # the codex-lb incident: no response.created in time, then a reset, then healthy
    "sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
    "default": {"kind": "ok", "events": 4},
}


def proxy(tmp_path, up, name="mitmdump", **options):
    return guarded(tmp_path, up, name, **{"turnguard_response_created_timeout_ms": 600,
                                          "turnguard_cooldown_ms": COOLDOWN_MS, **options})


def events(tmp_path, kind=None, name="mitmdump"):
    return turnguard_events(tmp_path, name, kind)


def wait_events(tmp_path, kind, n, name="mitmdump"):
    """The first n events of a kind, waiting for them: turnguard records an attempt's end on
    its ledger thread, so the circuit's events may follow the client's answer by a moment."""
    return wait_until(lambda: (e := events(tmp_path, kind, name))[n - 1:] and e, 10,
                      what=f"{n} {kind} event(s)")


def post(url, headers=ANCHORED, body=TURN, timeout=30):
    """One request; transport errors become status 0 (a cut stream counts as an error too)."""
    return post_turn(url, headers, body, cut_is_error=True, timeout=timeout)


def impatient_client(url, *, tries=20, gap_s=0.2, headers=ANCHORED):
    """The Codex Desktop report: ignores Retry-After and retries within 200 ms until its retry
    budget is spent. Returns every status it saw (0 = transport error) and the last body."""
    statuses, body = [], b""
    for _ in range(tries):
        status, _, body = post(url, headers)
        statuses.append(status)
        if status == 200:
            break
        time.sleep(gap_s)
    return statuses, body


def open_circuit(url):
    """Two eventless failures of the anchored turn: the circuit opens."""
    assert post(url)[0] == 502  # cut after 600 ms without response headers
    assert post(url)[0] in (0, 502)  # upstream reset


def dispatch_times(up):
    return [d["ts"] for d in up.dispatches()]


def test_missing_response_created_cuts_the_upstream_before_and_after_headers(tmp_path):
    scenario = {
        "sequence": [
            {"kind": "stall_before_headers", "ms": 60000},
            {"kind": "stall_after_headers", "ms": 60000},
        ],
        "default": {"kind": "ok"},
    }
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        started = time.monotonic()
        status, headers, _ = post(p.url, headers={"session-id": "a"})
        assert status == 502
        status, _, _ = post(p.url, headers={"session-id": "b"})
        assert status == 0  # headers came, then the stream was cut
        assert time.monotonic() - started < 30  # bounded by the timeout, not the 60 s stall
        up.wait_for_record(lambda r: r.get("event") == "client_gone" and r["n"] == 1)
        assert len([r for r in up.records() if r.get("event") == "client_gone"]) == 2
        cuts = events(tmp_path, "upstream_cut")
        assert [c["cut"] for c in cuts] == [True, True]
        assert [c["headers_seen"] for c in cuts] == [False, True]
        failures = events(tmp_path, "eventless_failure")
        assert [f["failure_class"] for f in failures] == ["missing_response_created_timeout"] * 2
        assert all(f["events_seen"] == 0 for f in failures)
        assert [o["outcome"] for o in events(tmp_path, "outcome")] == ["unknown", "unknown"]
        assert_no_traceback(p.log_text())


def test_a_content_coded_event_stream_silent_after_its_headers_is_cut(tmp_path):
    """An event stream the upstream sends gzip-coded (a compressing gateway) whose headers
    came and then nothing: its events are not counted, but it has no response event either
    (its first byte would start it). It is cut at turnguard_response_created_timeout_ms, an
    eventless failure, as an uncoded stream silent after its headers is; before, its timer
    was stopped at the headers and the stall went on for as long as the upstream's."""
    coded_stall = {"kind": "stall_after_headers", "ms": 60000,
                   "headers": {"content-encoding": "gzip"}}
    with MockUpstream(tmp_path, {"default": coded_stall}) as up, proxy(tmp_path, up) as p:
        status, _, _ = post(p.url, headers={"session-id": "coded"})
        assert status == 0  # headers came, then the stream was cut
        (cut,) = wait_events(tmp_path, "upstream_cut", 1)
        assert cut["cut"] is True and cut["headers_seen"] is True
        (failure,) = wait_events(tmp_path, "eventless_failure", 1)
        assert failure["failure_class"] == "missing_response_created_timeout"
        assert [o["outcome"] for o in events(tmp_path, "outcome")] == ["unknown"]
        up.wait_for_record(lambda r: r.get("event") == "client_gone" and r["n"] == 0)
        assert_no_traceback(p.log_text())


# For tests that must still be inside the cooldown after many requests or a restart: on a
# slow, busy machine those alone took more than COOLDOWN_MS.
LONG_COOLDOWN_MS = 12000


def test_default_mode_reproduces_the_503_storm_without_dispatching(tmp_path, report):
    with MockUpstream(tmp_path, STORM) as up, \
            proxy(tmp_path, up, turnguard_cooldown_ms=LONG_COOLDOWN_MS) as p:
        open_circuit(p.url)
        opened = wait_events(tmp_path, "circuit_opened", 1)
        assert len(opened) == 1 and opened[0]["failures"] == 2
        assert opened[0]["cooldown_ms"] == LONG_COOLDOWN_MS
        statuses, body = impatient_client(p.url, tries=8)
        assert statuses == [503] * 8  # every retry inside the cooldown: the turn is lost
        err = json.loads(body.split(b"data: ", 1)[1])["error"]
        assert err["code"] == "upstream_request_timeout"
        assert body.startswith(b"retry: ")  # the client accepts SSE: a retry hint in ms
        status, headers, plain = post(p.url, headers={**ANCHORED, "accept": "application/json"})
        assert status == 503 and 1 <= int(headers["retry-after"]) <= LONG_COOLDOWN_MS / 1000
        assert headers["x-should-retry"] == "true" and json.loads(plain)["error"]["code"]
        assert len(up.dispatches()) == 2  # nothing was sent upstream during the cooldown
        assert len(events(tmp_path, "cooldown_rejected")) == 9
    report(f"cooldown 503 storm, default fail_closed: client saw {statuses}; "
           f"upstream dispatches={len(up.dispatches())} (2 failures, 0 during cooldown)")


def test_once_mode_holds_one_request_through_the_cooldown_and_the_turn_completes(
    tmp_path, report
):
    with MockUpstream(tmp_path, STORM) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once"
    ) as p:
        open_circuit(p.url)
        opened_at = time.time()
        statuses, body = impatient_client(p.url, tries=8)
        assert statuses == [200] and sse_event_types(body)[-1] == "response.completed"
        times = dispatch_times(up)
        assert len(times) == 3
        assert times[2] >= opened_at + COOLDOWN_MS / 1000 - 0.5  # no dispatch during the wait
        waits = events(tmp_path, "wait_operation_fenced_cooldown")
        assert len(waits) == 1 and waits[0]["wait_ms"] > 0
        assert [e["reason"] for e in events(tmp_path, "wait_finished")] == ["cooldown_elapsed"]
        assert len(events(tmp_path, "recovery_claimed")) == 1
        assert not events(tmp_path, "cooldown_rejected")
        assert len(wait_events(tmp_path, "circuit_reset", 1)) == 1
    report(f"cooldown 503 storm, server_anchored_replay_once: client saw {statuses} "
           f"(held {waits[0]['wait_ms']} ms); upstream dispatches={len(times)}, "
           "0 during the cooldown")


@contextlib.contextmanager
def _held_through_the_cooldown(tmp_path, cooldown_ms: int):
    """Once mode behind a reloadable copy of the script: the circuit opened, one request
    held through its cooldown. Yields (upstream, proxy, script, the request's future, when
    the circuit opened)."""
    from test_at_most_once import reloadable

    script = reloadable(tmp_path)
    with MockUpstream(tmp_path, STORM) as up, proxy(
        tmp_path, up, addon=script, turnguard_recovery_mode="server_anchored_replay_once",
        turnguard_cooldown_ms=cooldown_ms,
    ) as p, ThreadPoolExecutor(1) as pool:
        open_circuit(p.url)
        opened_at = time.time()
        held = pool.submit(post, p.url, timeout=60)
        wait_events(tmp_path, "wait_operation_fenced_cooldown", 1)
        yield up, p, script, held, opened_at


def test_once_mode_a_request_held_through_the_cooldown_is_kept_across_a_script_reload(tmp_path):
    """mitmproxy reloads the script while a request is held through the cooldown: the
    instance loaded next holds it for what is left of the cooldown (nothing dispatched
    meanwhile) and recovers it once (before, the unload let it go: its connection was cut)."""
    from test_at_most_once import reloaded, touch_to_reload

    with _held_through_the_cooldown(tmp_path, LONG_COOLDOWN_MS) as (up, p, script, held,
                                                                   opened_at):
        reloaded(p, touch_to_reload(p, script))
        status, _, body = held.result()
        assert status == 200 and sse_event_types(body)[-1] == "response.completed"
        times = dispatch_times(up)
        assert len(times) == 3 and times[2] >= opened_at + LONG_COOLDOWN_MS / 1000 - 0.5
        assert p.log_text().count("was held; the addon loaded now decides it") == 1
        # one wait, carried over: not begun again, ended once, as long as the cooldown
        assert len(events(tmp_path, "wait_operation_fenced_cooldown")) == 1
        [finished] = events(tmp_path, "wait_finished")
        assert finished["reason"] == "cooldown_elapsed"
        assert len(events(tmp_path, "recovery_claimed")) == 1
        assert not events(tmp_path, "hold_abandoned") and not events(tmp_path, "cooldown_rejected")
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("until", ["before the cooldown ends", "past the cooldown's end"])
def test_once_mode_a_cooldown_hold_across_a_reload_while_the_ledger_is_write_locked(
        tmp_path, until):
    """Another process holds the ledger's write lock (``BEGIN IMMEDIATE``) while mitmproxy
    reloads the script with a request held through the cooldown: the new instance keeps it
    for what is left of the cooldown without the ledger. Lock gone before the cooldown ends:
    it is recovered once. Lock held past the cooldown's end: the recovery claim cannot be
    written, so it fails closed (503, nothing dispatched), and the client's retry once the
    lock goes is the one recovery; either way one wait, one end, nothing escaping a hook."""
    from test_at_most_once import reloaded, touch_to_reload, write_lock

    cooldown_ms = 6000
    with _held_through_the_cooldown(tmp_path, cooldown_ms) as (up, p, script, held, opened_at):
        with write_lock(tmp_path / "ledger.sqlite3", "BEGIN IMMEDIATE"):
            reloaded(p, touch_to_reload(p, script))
            time.sleep(1)  # the new instance holds it on, the ledger locked
            assert not held.done()
            if until == "past the cooldown's end":
                status, _, body = held.result()
        if until == "before the cooldown ends":
            status, _, body = held.result()
        times = dispatch_times(up)
        assert p.log_text().count("was held; the addon loaded now decides it") == 1
        assert len(events(tmp_path, "wait_operation_fenced_cooldown")) == 1
        [finished] = events(tmp_path, "wait_finished")
        assert finished["reason"] == "cooldown_elapsed"
        assert not events(tmp_path, "hold_abandoned") and not events(tmp_path, "cooldown_rejected")
        if until == "before the cooldown ends":
            assert status == 200 and sse_event_types(body)[-1] == "response.completed"
            assert len(times) == 3 and times[2] >= opened_at + cooldown_ms / 1000 - 0.5
            assert len(events(tmp_path, "recovery_claimed")) == 1
        else:
            assert status == 503, body
            assert len(times) == 2
            assert not events(tmp_path, "recovery_claimed")
            # the lock gone, the client's retry is the one recovery
            wait_events(tmp_path, "ledger_recovered", 1)
            status, _, body = post(p.url)
            assert status == 200 and sse_event_types(body)[-1] == "response.completed"
            assert len(dispatch_times(up)) == 3
            assert len(events(tmp_path, "recovery_claimed")) == 1
        assert_no_traceback(p.log_text())


def test_once_mode_requests_woken_by_the_cooldowns_end_as_the_script_reloads_are_recovered_once(
        tmp_path):
    """Requests held through the cooldown; the process is paused across the cooldown's end and
    the script is touched meanwhile: resumed, their waits end (the cooldown is over) in the same
    turn of the event loop as mitmproxy reloads the script. They must be decided by the
    instance loaded now: one recovery dispatch, the others held on it and answered from it
    (before, they went on in the instance unloaded, whose ledger was closed and whose holds
    nothing woke any more: they waited out their bound, then got 409)."""
    from test_at_most_once import reloadable, reloaded, touch_to_reload

    script = reloadable(tmp_path)
    with MockUpstream(tmp_path, STORM) as up, proxy(
        tmp_path, up, addon=script, turnguard_recovery_mode="server_anchored_replay_once",
        turnguard_hold_timeout_ms=8000,
    ) as p, ThreadPoolExecutor(3) as pool:
        open_circuit(p.url)
        held = [pool.submit(post, p.url, timeout=60) for _ in range(3)]
        wait_events(tmp_path, "wait_operation_fenced_cooldown", 3)
        p.proc.send_signal(signal.SIGSTOP)
        try:
            started = touch_to_reload(p, script)
            time.sleep(COOLDOWN_MS / 1000 + 0.5)  # past the cooldown's end and a reload check
        finally:
            p.proc.send_signal(signal.SIGCONT)
        reloaded(p, started)
        results = [h.result() for h in held]
        assert [r[0] for r in results] == [200] * 3
        assert len({r[2] for r in results}) == 1
        assert len(up.dispatches()) == 3  # the two failures, and the recovery once
        assert len(events(tmp_path, "recovery_claimed")) == 1
        assert not events(tmp_path, "duplicate_rejected")
        assert_no_traceback(p.log_text())


def test_once_mode_a_request_held_through_the_cooldown_at_shutdown_is_in_the_events_file(
        tmp_path):
    """mitmdump stopped (SIGTERM) while a request is held through the cooldown: it is let go
    (nothing dispatched for it), and its wait's end and the hold's are in the events file
    (before, the events file closed before the woken hold ran: neither was written)."""
    with MockUpstream(tmp_path, STORM) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once",
        turnguard_cooldown_ms=LONG_COOLDOWN_MS,
    ) as p, ThreadPoolExecutor(1) as pool:
        open_circuit(p.url)
        held = pool.submit(post, p.url, timeout=60)
        wait_events(tmp_path, "wait_operation_fenced_cooldown", 1)
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(20) == 0
        assert held.result()[0] != 200
        assert_no_traceback(p.log_text())
    assert len(up.dispatches()) == 2  # the two failures only
    assert [e["reason"] for e in events(tmp_path, "wait_finished")] == ["gone"]
    assert [e["reason"] for e in events(tmp_path, "hold_abandoned")] == ["turnguard unloaded"]


def test_once_mode_ten_concurrent_held_requests_give_one_recovery_dispatch(tmp_path, report):
    with MockUpstream(tmp_path, STORM) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once"
    ) as p:
        open_circuit(p.url)
        with ThreadPoolExecutor(max_workers=10) as pool:
            results = list(pool.map(lambda _: post(p.url), range(10)))
        assert [r[0] for r in results] == [200] * 10
        assert len({r[2] for r in results}) == 1
        assert len(up.dispatches()) == 3
        assert len(events(tmp_path, "recovery_claimed")) == 1
        assert len(events(tmp_path, "wait_operation_fenced_cooldown")) == 10
    report("10 concurrent requests held through one cooldown (once mode): "
           f"recovery dispatches={len(events(tmp_path, 'recovery_claimed'))}, "
           f"all answered {set(r[0] for r in results)}")


def _held_raw_request(url: str) -> socket.socket:
    """The anchored turn sent on a socket of its own, its answer left unread."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(TURN).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/responses HTTP/1.1\r\nhost: " + host.encode() + b"\r\n"
                 + b"".join(f"{k}: {v}\r\n".encode() for k, v in ANCHORED.items())
                 + b"content-type: application/json\r\naccept: text/event-stream\r\n"
                 + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_once_mode_never_spends_the_recovery_on_a_client_that_left_while_the_proxy_was_paused(
        tmp_path):
    """Requests held through the cooldown; the process is paused (SIGSTOP) across its end and
    the clients of the first ones leave meanwhile. Resumed, turnguard must not give the one
    recovery dispatch to a client that left (mitmproxy had not yet read its going): the
    requests still waiting are recovered, once."""
    leaving_n, staying_n = 8, 4
    with MockUpstream(tmp_path, STORM) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once"
    ) as p, ThreadPoolExecutor(max_workers=staying_n) as pool:
        open_circuit(p.url)
        leaving = []
        for i in range(leaving_n):
            leaving.append(_held_raw_request(p.url))
            wait_events(tmp_path, "wait_operation_fenced_cooldown", i + 1)
        staying = [pool.submit(post, p.url) for _ in range(staying_n)]
        wait_events(tmp_path, "wait_operation_fenced_cooldown", leaving_n + staying_n)
        p.proc.send_signal(signal.SIGSTOP)
        try:
            for s in leaving:
                s.close()
            time.sleep(COOLDOWN_MS / 1000 + 0.5)  # past the cooldown's end
        finally:
            p.proc.send_signal(signal.SIGCONT)
        assert [f.result(30)[0] for f in staying] == [200] * staying_n
        assert len(events(tmp_path, "recovery_claimed")) == 1
        assert len(up.dispatches()) == 3  # the two failures, and the recovery once
        assert_no_traceback(p.log_text())


def test_once_mode_a_recovery_whose_client_leaves_goes_on_for_the_other_holder(tmp_path):
    """Two requests held through the cooldown; the one that wins the one recovery claim has a
    client that leaves before the answer starts. The recovery dispatch runs detached from it
    (as with turnguard_detach_ms), so it goes on for the other, which gets the whole answer:
    one recovery dispatch, not cut with a client that left and spent for nothing."""
    storm = {**STORM, "default": {"kind": "ok", "events": 4, "delay_ms": 1500}}
    with MockUpstream(tmp_path, storm) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once",
        turnguard_response_created_timeout_ms=5000,
    ) as p:
        assert post(p.url)[0] == 502  # no response headers within 5 s: cut
        assert post(p.url)[0] in (0, 502)  # upstream reset: the circuit opens
        socks = {}
        for i in range(2):
            sock = _held_raw_request(p.url)
            socks[wait_events(tmp_path, "wait_operation_fenced_cooldown", i + 1)[i]["flow"]] = sock
        [claim] = wait_events(tmp_path, "recovery_claimed", 1)
        socks.pop(claim["flow"]).close()  # gone before the upstream's first byte
        [other] = socks.values()
        answer = b""
        while b"response.completed" not in answer:
            chunk = other.recv(65536)
            assert chunk, f"the other holder's answer was cut: {answer[-300:]!r}"
            answer += chunk
            assert len(answer) < 12 or answer.startswith(b"HTTP/1.1 200"), answer[:300]
        other.close()
        assert len(events(tmp_path, "recovery_claimed")) == 1
        assert len(up.dispatches()) == 3  # the two failures, and the recovery once
        assert_no_traceback(p.log_text())


def test_once_mode_never_recovers_the_same_operation_twice(tmp_path):
    scenario = {  # the recovery dispatch fails eventless too
        "sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"},
                     {"kind": "reset"}],
        "default": {"kind": "ok"},
    }
    with MockUpstream(tmp_path, scenario) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once",
        turnguard_cooldown_max_ms=COOLDOWN_MS * 2,
    ) as p:
        open_circuit(p.url)
        assert post(p.url)[0] in (0, 502)  # held, recovered once, and that failed again
        opened = wait_events(tmp_path, "circuit_opened", 2)
        assert [o["cooldown_ms"] for o in opened] == [COOLDOWN_MS, COOLDOWN_MS * 2]
        status, headers, body = post(p.url, headers={**ANCHORED, "accept": "application/json"},
                                     timeout=60)
        assert status == 503
        assert json.loads(body)["error"]["code"] == "upstream_operation_status_unknown"
        assert len(up.dispatches()) == 3
        denied = events(tmp_path, "recovery_denied")
        assert [d["reason"] for d in denied] == ["claim_exhausted"]


def test_two_processes_on_one_ledger_recover_once(tmp_path):
    with MockUpstream(tmp_path, STORM) as up, \
            proxy(tmp_path, up, "a", turnguard_recovery_mode="server_anchored_replay_once") as a, \
            proxy(tmp_path, up, "b", turnguard_recovery_mode="server_anchored_replay_once") as b:
        open_circuit(a.url)  # a serves the session first: a owns it
        with ThreadPoolExecutor(max_workers=6) as pool:
            via_a = [pool.submit(post, a.url) for _ in range(3)]
            time.sleep(0.3)
            via_b = [pool.submit(post, b.url) for _ in range(3)]
            a_results = [f.result()[0] for f in via_a]
            b_results = [f.result()[0] for f in via_b]
        assert a_results == [200] * 3
        assert b_results == [503] * 3  # b holds no owner proof for the session: fails closed
        assert [e["reason"] for e in events(tmp_path, "fail_closed", "b")] == [
            "owner_proof_missing"] * 3
        assert len(up.dispatches()) == 3
        recovered = events(tmp_path, "recovery_claimed", "a") + events(tmp_path, "recovery_claimed", "b")
        assert len(recovered) == 1


def test_once_mode_a_retry_elsewhere_while_the_owner_is_paused_is_the_one_recovery(tmp_path):
    """A owns the session and holds the turn through the cooldown, and is paused (SIGSTOP)
    across its end. A retry of the turn through B just after the end goes upstream: as the
    operation's one recovery (counted), not as a plain retry. A's held request, resumed,
    finds the recovery spent (503); so does every retry after it: one dispatch after the
    circuit opened, where there were two (B's retry, then A's recovery). By order: A is
    paused as soon as it holds the request (not at a time computed from the cooldown's end),
    B's retry goes once the cooldown is over by the ledger's clock, A resumes after B's
    answer. A round in which A did not hold the request and get paused before the cooldown's
    end (a test descheduled for the whole cooldown) shows nothing and is run again with
    another session (at most 3 rounds)."""
    once = dict(turnguard_recovery_mode="server_anchored_replay_once")
    sessions = [f"sess-storm-{r}" for r in range(3)]
    storm = {"sessions": {s: {"sequence": STORM["sequence"]} for s in sessions},
             "default": STORM["default"]}
    with MockUpstream(tmp_path, storm) as up, proxy(tmp_path, up, "a", **once) as a, \
            proxy(tmp_path, up, "b", **once) as b:
        for r, session in enumerate(sessions):
            anchored = {**ANCHORED, "session-id": session}
            assert post(a.url, anchored)[0] == 502  # a serves the session first: a owns it
            assert post(a.url, anchored)[0] in (0, 502)  # the circuit opens
            open_until = wait_events(tmp_path, "circuit_opened", r + 1, "a")[r]["open_until"]
            held_before = len(events(tmp_path, "wait_operation_fenced_cooldown", "a"))
            with ThreadPoolExecutor(max_workers=1) as pool:
                held = pool.submit(post, a.url, anchored, TURN, 60)
                wait_until(lambda: len(events(tmp_path, "wait_operation_fenced_cooldown", "a"))
                           > held_before or held.done(), 30, what="A holding the turn")
                a.proc.send_signal(signal.SIGSTOP)
                in_time = not held.done() and time.time() < open_until
                try:
                    wait_until(lambda: time.time() > open_until, COOLDOWN_MS / 1000 + 5,
                               what="the cooldown's end, as B reads it (the ledger's clock)")
                    retried = post(b.url, {**anchored, **mock_behaviour(kind="reset")})[0]
                finally:
                    a.proc.send_signal(signal.SIGCONT)
                held_status = held.result(60)[0]
            if in_time:
                break
        else:
            pytest.fail("A could not be paused before the cooldown's end in 3 rounds")
        op = events(tmp_path, "wait_operation_fenced_cooldown", "a")[held_before]["op"]
        assert held_status == 503
        assert retried in (0, 502)
        assert [post(url, anchored)[0] for url in (a.url, b.url)] == [503, 503]
        # the two failures, then the one recovery
        assert [d["session"] for d in up.dispatches()].count(session) == 3
        kinds = [e["kind"] for name in ("a", "b") for e in events(tmp_path, "dispatch", name)
                 if e["op"] == op]
        assert sorted(kinds) == ["original", "recovery", "retry"]


def test_ownership_lost_mid_wait_fails_closed(tmp_path):
    # (the session is taken over once the request is held, and the cooldown outlasts the
    # test: with COOLDOWN_MS, a test descheduled for 2 s on a busy machine took it over
    # after the cooldown had ended and the request had been recovered)
    with MockUpstream(tmp_path, STORM) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once",
        turnguard_cooldown_ms=LONG_COOLDOWN_MS,
    ) as p:
        open_circuit(p.url)
        with ThreadPoolExecutor(max_workers=1) as pool:
            held = pool.submit(post, p.url)
            wait_events(tmp_path, "wait_operation_fenced_cooldown", 1)
            db = sqlite3.connect(tmp_path / "ledger.sqlite3")
            with db:  # another process takes the session over: higher epoch
                db.execute("UPDATE sessions SET owner_instance='intruder',"
                           " owner_epoch=owner_epoch+1")
            db.close()
            status, _, _ = held.result()
        assert status == 503
        assert len(events(tmp_path, "ownership_lost")) == 1
        assert [e["reason"] for e in events(tmp_path, "fail_closed")] == ["ownership_lost"]
        assert len(up.dispatches()) == 2


@pytest.mark.parametrize(
    "headers, body, reason",
    [
        ({k: v for k, v in ANCHORED.items() if k != "session-id"}, TURN, "owner_proof_missing"),
        ({k: v for k, v in ANCHORED.items() if k != "x-codex-turn-state"}, TURN,
         "no_turn_state_anchor"),
        (ANCHORED, {**TURN, "previous_response_id": "resp_1"}, "previous_response_id"),
    ],
)
def test_ineligible_requests_are_not_held(tmp_path, headers, body, reason):
    with MockUpstream(tmp_path, STORM) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_indefinite_recovery"
    ) as p:
        assert post(p.url, headers, body)[0] == 502
        assert post(p.url, headers, body)[0] in (0, 502)
        assert post(p.url, headers, body)[0] == 503
        assert not events(tmp_path, "wait_operation_fenced_cooldown")
        assert [e["reason"] for e in events(tmp_path, "fail_closed")] == [reason]
        assert len(up.dispatches()) == 2


def test_an_operation_with_output_is_not_held(tmp_path):
    scenario = {
        "sequence": [{"kind": "partial", "events": 2},
                     {"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
        "default": {"kind": "ok"},
    }
    with MockUpstream(tmp_path, scenario) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once"
    ) as p:
        assert post(p.url)[0] == 0  # two events, then the upstream dropped: output exists
        other = {**TURN, "input": "another turn of the same session"}
        post(p.url, body=other)
        post(p.url, body=other)  # two eventless failures of the session: cooldown
        assert post(p.url)[0] == 503
        assert [e["reason"] for e in events(tmp_path, "fail_closed")] == ["output_exists"]
        assert len(up.dispatches()) == 3


def test_expired_request_budget_fails_closed(tmp_path):
    with MockUpstream(tmp_path, STORM) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once",
        turnguard_request_budget_ms=1000, turnguard_cooldown_ms=8000,
    ) as p:
        open_circuit(p.url)
        status, headers, _ = post(p.url, headers={**ANCHORED, "accept": "application/json"})
        assert status == 503 and int(headers["retry-after"]) >= 1
        finished = events(tmp_path, "wait_finished")
        assert len(finished) == 1
        assert [e["reason"] for e in events(tmp_path, "fail_closed")] == ["request_budget_expired"]
        assert len(up.dispatches()) == 2


# long enough for a mitmdump to stop and another to start on a busy machine
RESTART_COOLDOWN_MS = 30000


@pytest.mark.slow
def test_circuit_survives_a_restart_and_an_elapsed_cooldown_starts_no_new_one(tmp_path):
    with MockUpstream(tmp_path, STORM) as up:
        with proxy(tmp_path, up, turnguard_cooldown_ms=RESTART_COOLDOWN_MS) as p:
            open_circuit(p.url)
            opened_at = wait_events(tmp_path, "circuit_opened", 1)[0]["ts"]
        with proxy(tmp_path, up, name="restarted") as p:
            assert post(p.url)[0] == 503  # the cooldown is still on after the restart
        time.sleep(max(0.0, opened_at + RESTART_COOLDOWN_MS / 1000 - time.time()) + 0.2)
        with proxy(tmp_path, up, name="late") as p:
            status, _, body = post(p.url)
            assert status == 200  # the cooldown elapsed while down: the request goes through
        assert not events(tmp_path, "circuit_opened", "late")
        assert len(up.dispatches()) == 3


@pytest.mark.parametrize("switch", ["once to fail_closed", "fail_closed to once"])
def test_the_recovery_mode_switched_during_a_cooldown_gives_one_recovery_dispatch(tmp_path,
                                                                                 switch):
    """``turnguard_recovery_mode`` changed in a running proxy (mitmweb's options, the
    console's ``:set``) while the circuit cools down. Once mode switched off with a request
    held through the cooldown: that request keeps its hold and gets the one recovery dispatch
    at its end; a retry sent after the switch is answered 503 as the default mode says.
    Switched on after a retry was answered 503: a retry sent after the switch is held and
    recovered once. Either way nothing is dispatched during the cooldown, and only once
    after it."""
    once = "server_anchored_replay_once"
    first, then = (once, "fail_closed") if switch.startswith("once") else ("fail_closed", once)
    live_options = Path(__file__).with_name("live_options.py")
    with MockUpstream(tmp_path, STORM) as up, proxy(
            tmp_path, up, extra_args=["-s", str(live_options)], turnguard_recovery_mode=first,
            turnguard_cooldown_ms=8000) as p, ThreadPoolExecutor(1) as pool:
        open_circuit(p.url)
        opened_at = time.time()
        if first == once:
            held = pool.submit(post, p.url, timeout=60)
            wait_events(tmp_path, "wait_operation_fenced_cooldown", 1)
        else:
            assert post(p.url)[0] == 503
        r = httpx.post(p.url + "/__set", json=[f"turnguard_recovery_mode={then}"],
                       trust_env=False, timeout=20, verify=default_tls())
        assert r.status_code == 200, r.text
        if then == once:
            held = pool.submit(post, p.url, timeout=60)
            wait_events(tmp_path, "wait_operation_fenced_cooldown", 1)
        else:
            assert post(p.url)[0] == 503
        assert len(up.dispatches()) == 2, "the cooldown ended before the switch: nothing tested"
        status, _, body = held.result(60)
        assert status == 200 and sse_event_types(body)[-1] == "response.completed"
        times = dispatch_times(up)
        assert len(times) == 3 and times[2] >= opened_at + 8 - 0.5
        assert len(events(tmp_path, "recovery_claimed")) == 1
        assert len(events(tmp_path, "cooldown_rejected")) == 1
        assert_no_traceback(p.log_text())
