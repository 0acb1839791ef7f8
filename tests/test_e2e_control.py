"""End to end: ``scripts/turnguard circuit clear`` and ``session release`` against the ledger of
running mitmdump processes (any mitmdump: the tool speaks to the ledger only). A cleared
circuit lets the next request dispatch; in once mode it never yields a second recovery
dispatch of an operation, through either of two processes sharing the ledger."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness import (
    REPO,
    MockUpstream,
    Mitmdump,
    assert_no_traceback,
    default_tls,
    guarded,
    mock_behaviour,
    post_turn,
    read_jsonl,
    response_id,
    turnguard_events,
    wait_until,
)

TURNGUARD = REPO / "scripts" / "turnguard"
TURN = {"model": "gpt-test", "input": [{"role": "user", "content": "fix the bug"}], "stream": True}
ANCHORED = {
    "authorization": "Bearer sk-control-test",
    "session-id": "sess-control",
    "x-codex-turn-state": "ts_turn_1",
}
LONG_COOLDOWN_MS = 60000  # so that only the clear can end it within the test


def proxy(tmp_path, up, name="mitmdump", **options):
    return guarded(tmp_path, up, name, **{"turnguard_response_created_timeout_ms": 600,
                                          "turnguard_cooldown_ms": LONG_COOLDOWN_MS,
                                          "turnguard_cooldown_max_ms": LONG_COOLDOWN_MS * 2,
                                          **options})


def turnguard(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNGUARD_")}
    return subprocess.run(
        [str(TURNGUARD), "--ledger", str(tmp_path / "ledger.sqlite3"), *args],
        capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL,
    )


def post(url, headers=ANCHORED, timeout=90, turn=TURN):
    """(status, body) of one request that accepts JSON errors (status 0: a transport error)."""
    status, _, body = post_turn(url, {**headers, "accept": "application/json"}, turn,
                                timeout=timeout)
    return status, body


def events(tmp_path, kind, name="mitmdump"):
    return turnguard_events(tmp_path, name, kind)


def assert_refused_after_its_one_recovery(tmp_path, up, p, *, dispatches):
    """The operation's retry through ``p`` fails closed, its one recovery used: nothing more
    went upstream than ``dispatches`` in all, and one recovery was claimed."""
    status, body = post(p.url)
    assert status == 503, (status, body)
    assert json.loads(body)["error"]["code"] == "upstream_operation_status_unknown"
    assert len(up.dispatches()) == dispatches  # never a second recovery dispatch
    assert len(events(tmp_path, "recovery_claimed")) == 1
    assert_no_traceback(p.log_text())


def open_circuit(url):
    assert post(url)[0] == 502  # cut: no response headers within 600 ms
    assert post(url)[0] in (0, 502)  # upstream reset: the circuit opens


def test_clearing_an_open_circuit_lets_the_next_request_dispatch(tmp_path, report):
    scenario = {"sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        open_circuit(p.url)
        status, body = post(p.url)
        assert status == 503 and json.loads(body)["error"]["code"] == "upstream_request_timeout"
        helped = turnguard(tmp_path, "--help").stdout
        for command in ("status", "circuit", "session", "audit", "list", "show", "stats"):
            assert command in helped
        listed = turnguard(tmp_path, "circuit", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        (c,) = json.loads(listed.stdout)
        assert c["open"] and c["failures"] == 2 and c["remaining_s"] > 50
        r = turnguard(tmp_path, "circuit", "clear", c["scope"][:16], "--events",
                      str(tmp_path / "control-events.jsonl"))
        assert r.returncode == 0 and f"cleared {c['scope']}" in r.stdout, r.stderr
        assert post(p.url)[0] == 200  # dispatched at once: no cooldown left
        assert len(up.dispatches()) == 3
        (audit,) = json.loads(turnguard(tmp_path, "audit", "--json").stdout)
        assert audit["action"] == "circuit_clear" and audit["target"] == c["scope"]
        assert "scripts/turnguard" in audit["actor"] and audit["before"]["failures"] == 2
        (event,) = read_jsonl(tmp_path / "control-events.jsonl")
        assert event["event"] == "circuit_cleared" and event["by"] == "cli"
        status_out = turnguard(tmp_path, "status")
        assert "0 cooling down" in status_out.stdout and "circuit_clear" in status_out.stdout
        assert_no_traceback(p.log_text())
    report("circuit clear (scripts/turnguard, default mode): 503 before, 200 after, "
           f"upstream dispatches={len(up.dispatches())}")


def test_in_once_mode_a_cleared_circuit_never_gives_a_second_recovery_dispatch(tmp_path, report):
    scenario = {  # the recovery dispatch fails without events too
        "sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"},
                     {"kind": "reset"}],
        "default": {"kind": "ok"},
    }
    once = {"turnguard_recovery_mode": "server_anchored_replay_once"}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, "a", **once) as a, \
            proxy(tmp_path, up, "b", **once) as b:
        open_circuit(a.url)  # a owns the session
        with ThreadPoolExecutor(max_workers=1) as pool:
            held = pool.submit(post, a.url)
            wait_until(lambda: events(tmp_path, "wait_operation_fenced_cooldown", "a"), 10,
                       what="a request held through the 60 s cooldown")
            cleared_at = time.monotonic()
            r = turnguard(tmp_path, "circuit", "clear", "--all")
            assert r.returncode == 0 and "cleared session:" in r.stdout, r.stderr
            status, _ = held.result(timeout=30)
        waited = time.monotonic() - cleared_at
        assert status in (0, 502)  # released by the clear, recovered once, failed again
        assert waited < 30  # the clear, not the 60 s cooldown, ended the wait
        assert len(up.dispatches()) == 3
        assert len(events(tmp_path, "recovery_claimed", "a")) == 1
        assert [e["reason"] for e in events(tmp_path, "wait_finished", "a")] == ["woken"]
        for attempt in range(2):  # clear again and retry through both processes
            turnguard(tmp_path, "circuit", "clear", "--all")
            for p in (a, b):
                status, body = post(p.url)
                assert status == 503, (attempt, p.name, status)
                assert json.loads(body)["error"]["code"] == "upstream_operation_status_unknown"
        assert len(up.dispatches()) == 3  # never a second recovery dispatch
        recovered = (events(tmp_path, "recovery_claimed", "a")
                     + events(tmp_path, "recovery_claimed", "b"))
        assert len(recovered) == 1
        for p in (a, b):
            assert_no_traceback(p.log_text())
    report(f"once mode, circuit cleared 3 times, retried through 2 processes: upstream "
           f"dispatches={len(up.dispatches())}, recovery dispatches={len(recovered)}")


def test_in_once_mode_a_circuit_opened_again_by_another_turn_gives_no_second_recovery(
        tmp_path, report):
    """The operation's one recovery ends with an error status (a known result: the operation
    is not spent). Another turn of the session opens the circuit again; once that is cleared,
    a retry of the first operation must not be given a second recovery."""
    scenario = {
        "sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"},
                     {"kind": "status", "code": 500},  # the recovery dispatch
                     {"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
        "default": {"kind": "ok"},
    }
    other_turn = {**TURN, "input": [{"role": "user", "content": "now the tests"}]}
    once = {"turnguard_recovery_mode": "server_anchored_replay_once"}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, **once) as p:
        open_circuit(p.url)
        with ThreadPoolExecutor(max_workers=1) as pool:
            held = pool.submit(post, p.url)
            wait_until(lambda: events(tmp_path, "wait_operation_fenced_cooldown"), 10,
                       what="a request held through the 60 s cooldown")
            assert turnguard(tmp_path, "circuit", "clear", "--all").returncode == 0
            assert held.result(timeout=30)[0] == 500  # recovered once: an error status
        assert post(p.url, turn=other_turn)[0] == 502  # another turn fails twice without
        assert post(p.url, turn=other_turn)[0] in (0, 502)  # events: the circuit opens again
        (circuit,) = json.loads(turnguard(tmp_path, "circuit", "list", "--json").stdout)
        assert circuit["open"], circuit
        assert turnguard(tmp_path, "circuit", "clear", "--all").returncode == 0
        assert_refused_after_its_one_recovery(tmp_path, up, p, dispatches=5)
    report("once mode, recovery answered 500, circuit opened again by another turn and "
           f"cleared: retry 503, upstream dispatches={len(up.dispatches())}")


def test_releasing_a_session_moves_it_to_the_next_process_that_serves_it(tmp_path):
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, "a") as a, \
            proxy(tmp_path, up, "b") as b:
        assert post(a.url)[0] == 200  # a owns the session now
        status = json.loads(turnguard(tmp_path, "status", "--json").stdout)
        (session,) = status["sessions"]
        assert session["epoch"] == 1 and {i["instance"] for i in status["instances"]} >= {session["owner"]}
        assert all(i["alive"] for i in status["instances"]) and len(status["instances"]) == 2
        r = turnguard(tmp_path, "session", "release", session["session"][:10])
        assert r.returncode == 0 and "epoch 1 -> 2" in r.stdout, r.stderr
        assert post(b.url, headers={**ANCHORED, "x-codex-turn-state": "ts_2"})[0] == 200
        after = json.loads(turnguard(tmp_path, "status", "--json").stdout)["sessions"][0]
        assert after["epoch"] == 3 and after["owner"] not in (None, session["owner"])
        assert [e["result"] for e in events(tmp_path, "session_claimed", "b")] == ["taken_over"]


def test_in_once_mode_another_turn_completing_after_a_clear_gives_no_second_recovery(tmp_path):
    """The circuit opened by an operation's failures is cleared; another turn of the session
    completes (which resets the circuit). A retry of the first operation is still its one
    recovery: when it ends without a result the operation is spent, and nothing is dispatched
    for it again."""
    scenario = {
        "sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"},
                     {"kind": "ok"},  # the other turn
                     {"kind": "reset"}],  # the first operation's one recovery
        "default": {"kind": "ok"},
    }
    other_turn = {**TURN, "input": [{"role": "user", "content": "now the tests"}]}
    once = {"turnguard_recovery_mode": "server_anchored_replay_once"}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, **once) as p:
        open_circuit(p.url)
        assert turnguard(tmp_path, "circuit", "clear", "--all").returncode == 0
        assert post(p.url, turn=other_turn)[0] == 200  # resets the circuit
        assert post(p.url)[0] in (0, 502)  # the recovery, failed without events: spent
        assert_refused_after_its_one_recovery(tmp_path, up, p, dispatches=4)


def test_in_once_mode_a_sessionless_operation_has_no_recovery_to_spend(tmp_path):
    """Only an operation of a session has a recovery (only its requests can be held, and only
    they fail closed without the ledger, where a spent claim cannot be read). A sessionless
    operation's retry after its cooldown is a plain retry: were it counted as a recovery, its
    failure would refuse the operation for good here, while a process that cannot read the
    ledger dispatches it again."""
    scenario = {"sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"},
                             {"kind": "reset"}],  # the retry after the cooldown
                "default": {"kind": "ok"}}
    sessionless = {"authorization": "Bearer sk-control-test"}
    once = {"turnguard_recovery_mode": "server_anchored_replay_once",
            "turnguard_cooldown_ms": 1500, "turnguard_cooldown_max_ms": 3000}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, **once) as p:
        assert post(p.url, headers=sessionless)[0] == 502
        assert post(p.url, headers=sessionless)[0] in (0, 502)  # the circuit opens
        assert post(p.url, headers=sessionless)[0] == 503  # cooling: fail closed
        time.sleep(1.6)  # the cooldown passes
        assert post(p.url, headers=sessionless)[0] in (0, 502)  # a retry, failed again
        time.sleep(3.1)  # the doubled cooldown passes
        status, body = post(p.url, headers=sessionless)
        assert status == 200, (status, body)
        assert [e["kind"] for e in events(tmp_path, "dispatch")] == ["original"] + ["retry"] * 3
        assert not events(tmp_path, "recovery_claimed")
        assert_no_traceback(p.log_text())


def test_a_client_cannot_write_terminal_escapes_to_the_operators_terminal(tmp_path):
    """The body's ``previous_response_id`` is kept in the ledger as the client sent it; the
    tool's text output must not hand its control characters (ESC, BEL, C1 CSI, a newline
    that forges a line) to the operator's terminal."""
    hostile = "resp_\x1b]0;owned\x07\x1b[2J\x9b31m\rforged: line\nstate: completed"
    turn = {**TURN, "previous_response_id": hostile}
    with MockUpstream(tmp_path, {"default": {"kind": "ok"}}) as up, proxy(tmp_path, up) as p:
        status, _ = post(p.url, headers={"authorization": "Bearer sk-escape"}, turn=turn)
        assert status in (200, 400), status
        listed = turnguard(tmp_path, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        (op,) = json.loads(listed.stdout)
        shown = turnguard(tmp_path, "show", op["op"])
        assert shown.returncode == 0, shown.stderr
        assert "previous response" in shown.stdout
        for out in (shown.stdout, turnguard(tmp_path, "list").stdout,
                    turnguard(tmp_path, "status").stdout):
            assert not any(c in out for c in "\x1b\x07\x9b\r"), repr(out)
            assert "\nstate: completed" not in out, repr(out)
        as_json = json.loads(turnguard(tmp_path, "show", op["op"], "--json").stdout)
        assert as_json["previous_response_id"] == hostile  # JSON keeps the value exactly
        assert_no_traceback(p.log_text())


LIVE_OPTIONS = Path(__file__).with_name("live_options.py")


def set_live(p, *specs: str) -> tuple[int, str]:
    """Set options of the running mitmdump ``p`` (loaded with ``live_options.py``)."""
    r = httpx.post(p.url + "/__set", json=list(specs), trust_env=False, timeout=20, verify=default_tls())
    return r.status_code, r.text


def test_changing_the_ledger_while_a_turn_streams_never_wedges_its_duplicates(tmp_path):
    """The ledger option changed in a running process (mitmweb, ``:set``) while one of its
    turns streams: the turn's end must reach the ledger the other processes share, so a
    duplicate there is replayed, not answered 409 for as long as this process lives. A bad
    value is refused with a clear error and the old one kept."""
    shared, other = tmp_path / "ledger.sqlite3", tmp_path / "other.sqlite3"
    turn = {**TURN, "input": "switch ledgers"}
    headers = {"authorization": "Bearer sk-switch"}
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "events": 6, "gap_ms": 700}}) as up, \
            Mitmdump(tmp_path, up.url, name="a", extra_args=["-s", str(LIVE_OPTIONS)], options={
                "turnguard_ledger": str(shared),
                "turnguard_events": str(tmp_path / "a-events.jsonl")}) as a, \
            guarded(tmp_path, up, "b", turnguard_hold_timeout_ms=3000) as b:
        with ThreadPoolExecutor(1) as pool:
            original = pool.submit(post, a.url, headers, 60, turn)
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=20)
            status, text = set_live(a, "turnguard_hold_timeout_ms=-5")
            assert status == 400 and "turnguard_hold_timeout_ms" in text, text
            status, text = set_live(a, f"turnguard_ledger={tmp_path}")  # a folder: refused
            assert status == 400 and "turnguard_ledger" in text, text
            changed = set_live(a, f"turnguard_ledger={other}")
            assert original.result()[0] == 200
        if changed[0] != 200:  # refused while the turn ran: the refusal says why
            assert "turnguard_ledger" in changed[1] and "in flight" in changed[1], changed
            assert set_live(a, f"turnguard_ledger={other}")[0] == 200  # once it has ended
        status, body = post(b.url, headers, 30, turn)  # b shares the first ledger
        assert status == 200, (status, body[:300])
        assert len(up.dispatches()) == 1
        assert "Traceback" not in a.log_text() + b.log_text()


def test_options_changed_while_a_duplicate_is_held_bind_only_the_requests_after_the_change(
        tmp_path):
    """``turnguard_hold_timeout_ms`` and ``turnguard_filter`` changed in a running proxy
    (mitmweb's options, the console's ``:set``) while a duplicate is held: the held one keeps
    the bounds it came with and gets the original's answer (neither a 409 from the new bound
    nor a wait for ever because it is outside the new filter); a duplicate that comes after
    the first change is held by the new bound (0: a 409 at once), and one after the second is
    not guarded (forwarded untouched)."""
    headers = {"authorization": "Bearer sk-held-change", "session-id": "sess-held-change"}
    turn = {**TURN, "input": "options changed while a duplicate is held"}
    slow = {**headers, **mock_behaviour(kind="ok", delay_ms=10000)}
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)],
            turnguard_hold_timeout_ms=60000) as p:
        with ThreadPoolExecutor(2) as pool:
            original = pool.submit(post_turn, p.url, slow, turn)
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=20)
            held = pool.submit(post_turn, p.url, headers, turn)
            wait_until(lambda: events(tmp_path, "duplicate_held"), 20, what="the duplicate held")
            assert set_live(p, "turnguard_hold_timeout_ms=0") == (200, "ok")
            after = post(p.url, headers, 30, turn)
            assert after[0] == 409 and b"turn_in_progress" in after[1], after
            assert set_live(p, 'turnguard_filter=~u "/nothing-guarded$"') == (200, "ok")
            unguarded = post_turn(p.url, headers, turn)
            assert unguarded[0] == 200 and "x-turnguard" not in unguarded[1]
            assert not original.done(), "the original ended before the changes: nothing tested"
            first, second = original.result(60), held.result(60)
        assert first[0] == second[0] == 200
        assert second[1].get("x-turnguard") in ("attached", "replayed"), second[1]
        assert response_id(second[2]) == response_id(first[2])
        assert len(up.dispatches()) == 2  # the original and the unguarded one
        assert_no_traceback(p.log_text())


def test_a_value_refused_while_running_is_said_in_the_log(tmp_path):
    """A turnguard value refused in a running proxy (mitmweb's options, the console's ``:set``,
    ``options.load`` of a config file) keeps the value in force; the one who set it sees
    mitmproxy's error, and the proxy's log says it too (in mitmdump, or a config file loaded
    by a command, it is the only place that does), without a password the value held."""
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)]) as p:
        status, text = set_live(p, "turnguard_hold_timeout_ms=-5")
        assert status == 400 and "turnguard_hold_timeout_ms" in text, text
        line = p.wait_for_log("turnguard_hold_timeout_ms must be >= 0, not -5", timeout=10)
        assert "kept" in line.split("not -5", 1)[1].splitlines()[0], line
        status, text = set_live(p, "turnguard_ledger=host=127.0.0.1 password=hunter2")
        assert status == 400 and "turnguard_ledger" in text and "hunter2" not in text, text
        p.wait_for_log("turnguard: turnguard_ledger=", timeout=10)
        assert "hunter2" not in p.log_text()
        assert post_turn(p.url, {"authorization": "Bearer k"}, TURN)[0] == 200  # still guarded
        assert len(events(tmp_path, "dispatch")) == 1
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("value, needle", [
    ("turnguard_filter=" + "!" * 1200 + "(~m POST)", "nests deeper than 100"),
    ("turnguard_ledger=postgresql://bob:hunter2@[::1/db", "turnguard_ledger"),
    ('turnguard_filter=~u "postgresql://bob:hunter2@127.0.0.1/db" & ~u [', "turnguard_filter"),
    ("turnguard_filter=~u \"postgresql://bob:hunter2'x@127.0.0.1/db\" ((", "turnguard_filter"),
    ('turnguard_filter=~u "postgresql://bob:hunter2@h/db" & ' + "!" * 150 + "~q",
     "nests deeper than 100"),
], ids=["a filter nested too deep", "a URL whose host does not parse",
        "a password in a filter that does not parse", "a password with a quote in a filter",
        "a password in a filter nested too deep"])
def test_a_hostile_value_set_while_running_is_refused_in_one_line_without_its_password(
        tmp_path, value, needle):
    """Values found by attacking the options of a running proxy: a filter nested so deep
    that it failed on every request (a RecursionError out of the request hook, every turn
    unguarded), a ledger URL whose bracketed host does not parse (the refusal's own scrub
    raised: a traceback, the value kept in the options and every later refusal lost), a
    password inside a filter that does not parse (shown in the refusal). Each is refused: the
    value in force is kept, one log line names the option, no password, and turns are still
    guarded."""
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)]) as p:
        status, text = set_live(p, value)
        assert status == 400 and needle in text and "hunter2" not in text, text
        assert "turnguard: " in p.wait_for_log(needle, timeout=10)
        headers = {"authorization": "Bearer k"}
        assert post_turn(p.url, headers, TURN)[0] == 200
        again = post_turn(p.url, headers, TURN)
        assert again[0] == 200 and again[1].get("x-turnguard") == "replayed"
        assert status == 400 and set_live(p, "turnguard_hold_timeout_ms=-5")[0] == 400
        assert "hunter2" not in p.log_text()
        assert len(events(tmp_path, "dispatch")) == 1
        assert_no_traceback(p.log_text())


def test_a_ledger_that_cannot_be_opened_is_refused_while_running_and_the_one_in_use_kept(
        tmp_path):
    """``turnguard_ledger`` changed in a running proxy to a file that is no ledger (a wrong
    path: a file of another kind) is refused, as a folder is: the ledger in use is kept (no
    outage, no decisions in memory only), its recording still answers a retry, and a
    turn after the refusal is recorded in it. Set back to a good file, the change is made."""
    ledger, junk, other = (tmp_path / "ledger.sqlite3", tmp_path / "notes.txt",
                           tmp_path / "other.sqlite3")
    junk.write_bytes(b"these are my notes, not a database\n" * 50)
    junk.chmod(0o600)
    headers = {"authorization": "Bearer sk-ledger-switch"}
    turn = {**TURN, "input": "switch to a file that is no ledger"}
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)]) as p:
        assert post_turn(p.url, headers, turn)[0] == 200
        status, text = set_live(p, f"turnguard_ledger={junk}")
        assert status == 400 and "turnguard_ledger" in text, text
        again = post_turn(p.url, headers, turn)
        assert again[0] == 200 and again[1].get("x-turnguard") == "replayed"
        assert post_turn(p.url, headers, {**turn, "input": "after the refusal"})[0] == 200
        assert set_live(p, f"turnguard_ledger={other}") == (200, "ok")
        assert not events(tmp_path, "ledger_unavailable")
        assert_no_traceback(p.log_text())
    assert junk.read_bytes() == b"these are my notes, not a database\n" * 50
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT COUNT(*) FROM attempts").fetchone() == (2,)
    assert len(up.dispatches()) == 2


def test_a_ledger_change_refused_while_a_turn_runs_leaves_the_ledger_in_use_alone(tmp_path):
    """A ledger change refused because a turn is in flight (its end belongs to the ledger in
    use) must leave that ledger as it was: mitmproxy rolls the option back and configures
    turnguard again with the old value, which is no reason to close and open the ledger in
    use. Opened again while another process holds its write lock (a backup, a peer's long
    transaction), it would fail: an outage, decisions in memory only, for a change that was
    refused."""
    from test_at_most_once import write_lock

    ledger, other = tmp_path / "ledger.sqlite3", tmp_path / "other.sqlite3"
    headers = {"authorization": "Bearer sk-refused-switch"}
    turn = {**TURN, "input": "a turn in flight while the ledger change is refused"}
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)]) as p:
        with ThreadPoolExecutor(1) as pool:
            original = pool.submit(post_turn, p.url,
                                   {**headers, **mock_behaviour(kind="ok", delay_ms=4000)}, turn)
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=20)
            with write_lock(ledger):
                status, text = set_live(p, f"turnguard_ledger={other}")
            assert status == 400 and "in flight" in text, text
            assert not original.done(), "the turn ended before the change: nothing was tested"
            assert original.result(60)[0] == 200
        assert not events(tmp_path, "ledger_unavailable")
        assert p.log_text().count("turnguard: ledger ") == 1  # opened once, at start-up
        assert post_turn(p.url, headers, turn)[1].get("x-turnguard") == "replayed"
        assert len(up.dispatches()) == 1
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("refused_by", ["a turn in flight", "a ledger URL refused",
                                        "a ledger that cannot be opened"])
@pytest.mark.parametrize("named", ["a new file", "an existing events file"])
def test_an_update_refused_with_a_new_events_file_leaves_that_file_as_it_was(
        tmp_path, refused_by, named):
    """One update (a config file loaded, mitmweb's options, ``set`` of several options)
    names another events file together with a value turnguard refuses: the update is
    refused whole, so the file it names is never made, opened or written (one that existed
    before keeps its bytes), and every later record goes to the events file in force."""
    in_force, named_file = tmp_path / "mitmdump-events.jsonl", tmp_path / "named-events.jsonl"
    junk = tmp_path / "notes.txt"
    junk.write_bytes(b"these are my notes, not a database\n")
    junk.chmod(0o600)
    before = b'{"ts":1.0,"event":"dispatch"}\n'
    if named == "an existing events file":
        named_file.write_bytes(before)
        named_file.chmod(0o600)
    ledger = {"a turn in flight": str(tmp_path / "other.sqlite3"),
              "a ledger URL refused": "host=127.0.0.1 password=hunter2",
              "a ledger that cannot be opened": str(junk)}[refused_by]
    headers = {"authorization": "Bearer sk-refused-events"}
    turn = {**TURN, "input": "an events file named in a refused update"}
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)]) as p:
        in_flight = refused_by == "a turn in flight"  # (else it ends before the update)
        with ThreadPoolExecutor(1) as pool:
            original = pool.submit(post_turn, p.url, {**headers, **mock_behaviour(
                kind="ok", delay_ms=3000 if in_flight else 0)}, turn)
            if in_flight:
                up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=20)
            else:
                assert original.result(60)[0] == 200
            status, text = set_live(p, f"turnguard_events={named_file}",
                                    f"turnguard_ledger={ledger}")
            assert status == 400 and "turnguard_ledger" in text, text
            if in_flight:
                assert not original.done(), "the turn ended before the update: nothing tested"
            assert original.result(60)[0] == 200
        assert post_turn(p.url, headers, {**turn, "input": "after the refusal"})[0] == 200
        wait_until(lambda: len(events(tmp_path, "dispatch")) == 2, 10,
                   what="both dispatches in the events file in force")
        assert_no_traceback(p.log_text())
    if named == "a new file":
        assert not named_file.exists()
    else:
        assert named_file.read_bytes() == before
    assert len(events(tmp_path, "outcome")) == 2  # the turn in flight's end, and the next's
    assert in_force.exists() and junk.read_bytes() == b"these are my notes, not a database\n"


@pytest.mark.parametrize("refused_by", ["turnguard", "an addon after turnguard"])
def test_an_update_refused_while_the_events_file_in_force_is_a_symlink_keeps_it_in_use(
        tmp_path, refused_by):
    """The events file in force was replaced by a symbolic link (it cannot be opened again:
    the private-file rules refuse it), then an update naming another events file is refused,
    by turnguard (a ledger URL) or by an addon that mitmproxy configures after turnguard
    (mitmdump's own dumper: a bad ``dumper_filter``): mitmproxy rolls it back and configures
    the old path again. The handle in use is kept (the path did not change: nothing to
    reopen), the file named is never made, and the records after the refusal go on into the
    file in force. Before, turnguard put the named file in use at once (or, refused itself,
    reopened the old path): the roll-back's reopening failed for the symlink, and the refused
    file kept every later record. An update accepted by all is still followed: its file is in
    use from then on."""
    in_force, named_file = tmp_path / "mitmdump-events.jsonl", tmp_path / "named-events.jsonl"
    moved = tmp_path / "moved-events.jsonl"
    headers = {"authorization": f"Bearer sk-refused-events-symlink-{len(refused_by)}"}
    turn = {**TURN, "input": f"the events file in force became a symlink ({refused_by})"}
    refused, says = (("turnguard_ledger=host=127.0.0.1 password=hunter2", "turnguard_ledger")
                     if refused_by == "turnguard" else
                     ("dumper_filter=~q(", "Invalid filter expression"))
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)]) as p:
        assert post_turn(p.url, headers, turn)[0] == 200
        wait_until(lambda: len(events(tmp_path, "outcome")) == 1, 10, what="the first outcome")
        in_force.rename(moved)
        in_force.symlink_to(moved)
        p.wait_for_log("not reopened", timeout=10)  # the rotation check refused the symlink
        status, text = set_live(p, f"turnguard_events={named_file}", refused)
        assert status == 400 and says in text, text
        assert post_turn(p.url, headers, {**turn, "input": "after the refusal"})[0] == 200
        wait_until(lambda: len([r for r in read_jsonl(moved) if r["event"] == "outcome"]) == 2,
                   10, what="the second outcome in the file in force")
        assert not named_file.exists()
        assert set_live(p, f"turnguard_events={named_file}")[0] == 200  # accepted by all
        assert post_turn(p.url, headers, {**turn, "input": "after the change"})[0] == 200
        wait_until(lambda: [r["event"] for r in read_jsonl(named_file)].count("outcome") == 1,
                   10, what="the third outcome in the file named")
        assert [r["event"] for r in read_jsonl(moved)].count("outcome") == 2
        assert "hunter2" not in p.log_text()
        assert_no_traceback(p.log_text())


def test_an_events_file_named_right_before_a_reload_that_failed_gets_what_the_exit_writes(
        tmp_path):
    """An update names another events file, accepted by all, and turnguard's script is
    reloaded in the same turn of the event loop (before the file is put in use), to a script
    that fails to load. The process then exits while no instance is loaded: the unloaded
    instance writes what the next instance would have (the end of the turn that completed
    meanwhile) to the events file in force, the one the update named. Before, the unload
    discarded the file named (removed: made for the update, still empty), and the exit wrote
    the turn's end to the file the update had replaced."""
    from test_at_most_once import reloadable

    in_force, named_file = tmp_path / "mitmdump-events.jsonl", tmp_path / "named-events.jsonl"
    script = reloadable(tmp_path)
    good = script.read_text()
    headers = {"authorization": "Bearer sk-events-then-reload"}
    slow_original = {"sequence": [{"kind": "ok", "hold": "original"}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, slow_original) as up, guarded(
            tmp_path, up, addon=script, turnguard_response_created_timeout_ms=60000,
            extra_args=["-s", str(LIVE_OPTIONS)]) as p:
        with ThreadPoolExecutor(1) as pool:
            original = pool.submit(post_turn, p.url, headers, {**TURN, "input": "a slow turn"})
            try:
                up.wait_held("original", 30)
                mtime = script.stat()
                script.write_text(good + "this is not python(\n")  # (as it was: only this
                os.utime(script, ns=(mtime.st_atime_ns, mtime.st_mtime_ns))  # reload fails)
                r = httpx.post(p.url + "/__set_then_reload", json=[f"turnguard_events={named_file}"],
                               trust_env=False, timeout=20, verify=default_tls())
                assert r.status_code == 200, r.text
                p.wait_for_log("SyntaxError", timeout=10)
            finally:
                up.release("original")
            assert original.result(60)[0] == 200
        assert p.stop() == 0
    assert [r["event"] for r in read_jsonl(named_file)].count("outcome") == 1
    assert "outcome" not in [r["event"] for r in read_jsonl(in_force)]


COMMAND_PROBE = Path(__file__).with_name("command_probe.py")


def command(p, *args: str) -> tuple[int, str]:
    """Run a mitmproxy command in the running mitmdump ``p`` (loaded with ``command_probe.py``),
    as the console's ``:`` does: (200, what it returned) or (400, its error)."""
    r = httpx.post(p.url + "/__command", json=list(args), trust_env=False, timeout=20, verify=default_tls())
    return r.status_code, r.text


def test_a_cooldown_carried_over_from_a_deleted_ledger_file_is_shown_and_cleared_by_the_commands(
        tmp_path):
    """The ledger file is deleted while a circuit cools: the process goes on in a new file and
    still fences the scope from what it learned (a request gets the cooldown's 503). The
    operator's view and controls must see that cooldown: ``turnguard.status`` and
    ``turnguard.circuit.list`` list it, ``turnguard.circuit.clear`` with its scope (or a
    prefix) ends it, says so in the events file, and the next request dispatches."""
    from test_e2e_bounds import STATUS_PROBE, status

    ledger = tmp_path / "ledger.sqlite3"
    storm = {"sequence": [{"kind": "reset"}, {"kind": "reset"}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, storm) as up, proxy(
            tmp_path, up, extra_args=["-s", str(STATUS_PROBE), "-s", str(COMMAND_PROBE)]) as p:
        assert [post(p.url)[0], post(p.url)[0]] == [502, 502]  # the circuit opens
        [opened] = events(tmp_path, "circuit_opened")
        scope = opened["scope"]
        for suffix in ("", "-wal", "-shm"):
            Path(f"{ledger}{suffix}").unlink(missing_ok=True)
        wait_until(lambda: ledger.exists() and events(tmp_path, "ledger_recovered"), 15,
                   what="a new ledger file in use")
        assert post(p.url, turn={**TURN, "input": "another turn"})[0] == 503  # still fenced
        assert [c["scope"] for c in status(p)["cooldowns"]] == [scope]
        code, text = command(p, "turnguard.circuit.list")
        assert code == 200 and [c["scope"] for c in json.loads(text)] == [scope], text
        code, text = command(p, "turnguard.circuit.clear", scope[:16])
        assert code == 200 and json.loads(text) == {"cleared": [scope]}, text
        assert post(p.url, turn={**TURN, "input": "after the clear"})[0] == 200
        assert len(up.dispatches()) == 3
        [cleared] = events(tmp_path, "circuit_cleared")
        assert (cleared["scope"], cleared["failures"], cleared["by"]) == (scope, 2, "command")
        assert status(p)["cooldowns"] == []
        assert_no_traceback(p.log_text())


def test_a_bad_value_set_while_running_is_refused_and_the_value_in_force_kept(tmp_path):
    """An option changed in the running proxy (mitmweb's options, the console's ``:set``) to a
    value turnguard refuses: whoever set it gets the error naming the option, the log gets a
    warning line naming it, and the value in force stays (here: a hold bound of 0, so a
    duplicate of a turn in flight is answered 409 at once). A value that is not of the
    option's type (``abc`` for a number) is refused by mitmproxy itself, naming the option."""
    turn = {**TURN, "input": "a bad value set while running"}
    slow = {**ANCHORED, **mock_behaviour(kind="ok", delay_ms=4000)}
    with MockUpstream(tmp_path) as up, proxy(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)],
            turnguard_hold_timeout_ms=0, turnguard_response_created_timeout_ms=30000) as p:
        refused = {
            "turnguard_hold_timeout_ms=-5": "turnguard_hold_timeout_ms must be >= 0, not -5",
            "turnguard_recovery_mode=maybe": "turnguard_recovery_mode must be one of",
            "turnguard_cooldown_ms=999999999": "turnguard_cooldown_max_ms must be >= "
                                               "turnguard_cooldown_ms",
        }
        for spec, message in refused.items():
            status, text = set_live(p, spec)
            assert status == 400 and message in text, (spec, text)
            wait_until(lambda: f"{message}" in p.log_text() and "refused, the value in force "
                       "is kept" in p.log_text(), 10, what=f"the warning line for {spec}")
        status, text = set_live(p, "turnguard_hold_timeout_ms=abc")
        assert status == 400 and "turnguard_hold_timeout_ms" in text, text
        # a bool where a number goes (mitmweb's options editor sends JSON, a config file
        # loaded while running holds YAML): mitmproxy lets it pass as an int, True as 1
        typed = tmp_path / "typed.yaml"
        typed.write_text("turnguard_hold_timeout_ms: true\n")
        r = httpx.post(p.url + "/__load", content=str(typed), trust_env=False, timeout=20,
                       verify=default_tls())
        assert r.status_code == 400 and "turnguard_hold_timeout_ms" in r.text, r.text
        wait_until(lambda: "turnguard_hold_timeout_ms=True is not an integer" in p.log_text(),
                   10, what="the warning line for a bool")
        with ThreadPoolExecutor(1) as pool:
            original = pool.submit(post, p.url, slow, 30, turn)
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=20)
            status, body = post(p.url, ANCHORED, 30, turn)
            assert status == 409 and b"turn_in_progress" in body, (status, body[:200])
            assert original.result()[0] == 200
        assert_no_traceback(p.log_text())


def test_the_commands_say_turnguard_is_not_loaded_while_a_reload_failed(tmp_path):
    """mitmproxy reloads the script to a copy that does not load: no turnguard instance runs,
    but mitmproxy keeps the commands the unloaded one registered. They must say that
    turnguard is not loaded (a ``CommandError``), not answer from the unloaded instance: its
    ledger closed ("ledger_ok": false, "the ledger is not usable now"), which sends the
    operator to a ledger that is fine. Once the script loads again they answer from the new
    instance."""
    from test_at_most_once import break_script, reloadable

    script = reloadable(tmp_path)
    good = script.read_text()
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, addon=script,
                                             extra_args=["-s", str(COMMAND_PROBE)]) as p:
        assert post(p.url)[0] == 200
        break_script(p, script)
        failed_at = len(p.log_text())
        for args in (["turnguard.status"], ["turnguard.held"], ["turnguard.circuit.list"],
                     ["turnguard.circuit.clear", "all"], ["turnguard.session.release", "s"]):
            code, text = command(p, *args)
            assert code == 400 and "not loaded" in json.loads(text)["error"], (args, code, text)
        started = p.log_text().count("turnguard: running")
        time.sleep(1.1)
        script.write_text(good)
        wait_until(lambda: p.log_text().count("turnguard: running") > started, 15,
                   what="the script reloaded")
        code, text = command(p, "turnguard.status")
        assert code == 200 and json.loads(text)["ledger_ok"] is True, text
        code, text = command(p, "turnguard.circuit.list")
        assert code == 200 and json.loads(text) == [], text
        assert_no_traceback(p.log_text()[failed_at:])

