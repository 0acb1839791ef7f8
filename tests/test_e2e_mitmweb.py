"""End to end: what a mitmproxy user does to guarded flows in mitmweb, through its own REST API
(the routes its web app calls: kill, resume, replay) on a real ``mitmweb`` process with
turnguard loaded, in front of the mock upstream. mitmweb's buttons call these routes; they do
not always go through mitmproxy's commands (its Kill sets the flow's error and refreshes the
view, without the ``update`` hook the ``flow.kill`` command fires)."""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from harness import (
    ADDON,
    MockUpstream,
    assert_no_traceback,
    default_tls,
    post_turn,
    turnguard_events,
    wait_until,
)
from turnguard_procs import Process

MITMWEB = Path(sys.executable).with_name("mitmweb")
XSRF = "0123456789abcdef0123456789abcdef"  # tornado compares the cookie with the header
START_TIMEOUT_S = 30.0


def _free_port() -> int:
    """A port the OS picked on 127.0.0.1 (mitmweb prints 0 for ``--web-port 0``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MitmWeb:
    """mitmweb in reverse mode in front of ``up``, with turnguard (its ledger and events in
    ``tmp_path``, as ``harness.guarded``), and a client of its REST API."""

    def __init__(self, tmp_path: Path, up: MockUpstream, name: str = "mitmweb", *,
                 scripts: tuple[Path, ...] = (), addon: Path = ADDON, **options: object):
        """``scripts``: more ``-s`` scripts, loaded after turnguard's; ``addon``: the script
        that loads turnguard (a copy the test reloads, say)."""
        self.tmp_path = Path(tmp_path)
        self.token = f"token-{name}"
        opts: dict[str, object] = {
            "turnguard_ledger": str(self.tmp_path / "ledger.sqlite3"),
            "turnguard_events": str(self.tmp_path / f"{name}-events.jsonl"),
            **options,
        }
        for attempt in range(3):  # the web port is picked before mitmweb binds it
            web_port = _free_port()
            cmd = [str(MITMWEB), "--mode", f"reverse:{up.url}", "--listen-host", "127.0.0.1",
                   "--listen-port", "0", "--web-host", "127.0.0.1", "--web-port", str(web_port),
                   "--no-web-open-browser", "--set", f"confdir={self.tmp_path / (name + '-confdir')}",
                   "--set", f"web_password={self.token}", "-s", str(addon)]
            for script in scripts:
                cmd += ["-s", str(script)]
            for key, value in opts.items():
                cmd += ["--set", f"{key}={value}"]
            self.process = Process(cmd, self.tmp_path / f"{name}.log")
            try:
                self.process.wait_for_line(re.compile(r"Web server listening at"),
                                           START_TIMEOUT_S, "mitmweb")
                break
            except Exception:
                self.process.stop()
                if attempt == 2:
                    raise
        m = re.search(r"listening at 127\.0\.0\.1:(\d+)", self.process.output())
        assert m, self.process.output()
        self.url = f"http://127.0.0.1:{m.group(1)}"
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{web_port}", trust_env=False,
                                timeout=20, verify=default_tls())
        self.api.cookies.set("_mitmproxy_xsrf", XSRF)
        self.api.get("/flows", params={"token": self.token}).raise_for_status()  # logs in

    def flows(self) -> list[dict[str, Any]]:
        r = self.api.get("/flows")
        r.raise_for_status()
        return r.json()

    def flow(self, flow_id: str) -> dict[str, Any] | None:
        return next((f for f in self.flows() if f["id"] == flow_id), None)

    def post(self, path: str) -> None:
        self.api.post(path, headers={"X-XSRFToken": XSRF}).raise_for_status()

    def kill(self, flow_id: str) -> None:
        self.post(f"/flows/{flow_id}/kill")  # mitmweb's Kill button

    def edit_request(self, flow_id: str, **fields: object) -> None:
        """mitmweb's flow editor (``PUT /flows/ID``): e.g. ``content`` of the request."""
        self.api.put(f"/flows/{flow_id}", json={"request": fields},
                     headers={"X-XSRFToken": XSRF}).raise_for_status()

    def resume(self, flow_id: str) -> None:
        self.post(f"/flows/{flow_id}/resume")  # mitmweb's Resume button

    def replay(self, flow_id: str) -> None:
        self.post(f"/flows/{flow_id}/replay")  # mitmweb's Replay button: replay.client

    def log_text(self) -> str:
        return self.process.output()

    def __enter__(self) -> "MitmWeb":
        return self

    def __exit__(self, *exc: object) -> None:
        self.api.close()
        self.process.stop()


def _events(tmp_path, kind=None):
    return turnguard_events(tmp_path, "mitmweb", kind)


def test_an_intercepted_original_killed_in_mitmweb_leaves_its_operation_free(tmp_path):
    """mitmweb intercepts a guarded original after turnguard dispatched it (the intercept
    addon comes after scripts), and Kill on an intercepted flow never resumes it (mitmproxy
    issue 8045): the request never goes upstream, and its attempt must not stay in flight for
    as long as the process lives. The killed flow's client gets its answer (the connection
    closed, as for any killed flow) and a retry of the turn is dispatched, not held and
    answered 409 for ever."""
    turn = {"model": "m", "input": "intercepted then killed", "stream": True}
    with ThreadPoolExecutor(2) as pool, MockUpstream(tmp_path) as up, MitmWeb(
            tmp_path, up, intercept="~hq x-intercept-me", turnguard_hold_timeout_ms=1500) as web:
        original = pool.submit(post_turn, web.url, {"x-intercept-me": "1"}, turn, timeout=60)
        held = wait_until(lambda: next((f for f in web.flows() if f["intercepted"]), None),
                          20, what="the original intercepted in mitmweb")
        web.kill(held["id"])
        status, _, _ = original.result(timeout=20)  # answered, not left hanging
        assert status == 0  # killed: its connection closed
        retry = post_turn(web.url, {}, turn, timeout=30)  # not intercepted: no header
        assert retry[0] == 200, retry
        assert len(up.dispatches()) == 1  # the retry; the killed original never went
        assert [e["kind"] for e in _events(tmp_path, "dispatch")] == ["original", "retry"]
        assert_no_traceback(web.log_text())


def test_flows_killed_in_mitmweb_do_not_open_the_retry_circuit(tmp_path):
    """A user killing guarded dispatches (one intercepted, one waiting for the upstream's
    headers) says nothing about the upstream's health: like a client that went away, a kill
    is not an eventless failure of the upstream, and two of them in a session must not open
    its retry circuit (every request of the session would get 503 for the cooldown)."""
    session = {"session-id": "sess-killed", "authorization": "Bearer sk-kill"}
    turn = {"model": "m", "stream": True}
    with ThreadPoolExecutor(2) as pool, MockUpstream(
            tmp_path, {"default": {"kind": "slow", "delay_ms": 1500}}) as up, MitmWeb(
            tmp_path, up, intercept="~hq x-intercept-me") as web:
        intercepted = pool.submit(post_turn, web.url, {**session, "x-intercept-me": "1"},
                                  {**turn, "input": "killed while intercepted"}, timeout=60)
        flow = wait_until(lambda: next((f for f in web.flows() if f["intercepted"]), None),
                          20, what="a flow intercepted in mitmweb")
        web.kill(flow["id"])
        assert intercepted.result(timeout=20)[0] == 0
        in_transit = pool.submit(post_turn, web.url, session,
                                 {**turn, "input": "killed waiting for the upstream"}, timeout=60)
        up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=20)
        flow = wait_until(lambda: next((f for f in web.flows() if f["id"] != flow["id"]), None),
                          20, what="the second flow in mitmweb")
        web.kill(flow["id"])
        assert in_transit.result(timeout=20)[0] == 0
        status, _, body = post_turn(web.url, {**session, "accept": "application/json"},
                                    {**turn, "input": "the next turn"}, timeout=30)
        assert status == 200, body[:300]
        failures = _events(tmp_path, "eventless_failure")
        # the one killed once it went upstream is a kill, not the upstream's failure; the
        # one killed while intercepted never went upstream: rejected, no failure at all
        assert [(f["failure_class"], f["counts_for_circuit"]) for f in failures] \
            == [("killed", False)], failures
        assert [o["outcome"] for o in _events(tmp_path, "outcome")][:2] == ["rejected",
                                                                            "unknown"]
        assert not _events(tmp_path, "circuit_opened")
        assert_no_traceback(web.log_text())


def test_replaying_a_guarded_flow_in_mitmweb_answers_it_from_the_recording(tmp_path):
    """mitmweb's Replay (``replay.client``) sends a flow's request again through the addons:
    a guarded flow whose turn completed is a duplicate of it, and is answered from the
    recording without anything going upstream, also when the flow replayed is turnguard's own
    upstream call of a detached dispatch (marked :satellite:), whose request is the turn's.
    That flow's mark says it is turnguard's call only while it runs: replayed, it must not
    pass unguarded (a second upstream execution of a completed turn)."""
    turn = {"model": "m", "input": "replay me", "stream": True}
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "events": 3}}) as up, MitmWeb(
            tmp_path, up, turnguard_detach_ms=5000) as web:
        status, _, body = post_turn(web.url, {}, turn, timeout=30)
        assert status == 200
        wait_until(lambda: _events(tmp_path, "outcome"), 10, what="the turn's outcome")
        flows = web.flows()
        own = [f for f in flows if f["is_replay"] == "request"]  # turnguard's detached call
        client = [f for f in flows if f["is_replay"] is None]
        assert len(own) == 1 and len(client) == 1, flows
        for flow in (client[0], own[0]):
            web.replay(flow["id"])
            wait_until(lambda: len(up.dispatches()) > 1 or any(
                e["flow"] == flow["id"] for e in _events(tmp_path, "duplicate_replayed")),
                20, what="the replay answered")
            assert len(up.dispatches()) == 1  # nothing went upstream again
            replayed = wait_until(lambda: (f := web.flow(flow["id"])) and f.get("response")
                                  and f, 10, what="the replayed flow's response")
            assert replayed["response"]["status_code"] == 200
            assert ["x-turnguard", "replayed"] in replayed["response"]["headers"], replayed
        assert_no_traceback(web.log_text())


def test_an_attached_duplicate_kept_intercepted_gets_the_response_it_attached_to(tmp_path):
    """A duplicate that attaches to a stream in flight is routed to turnguard's relay in its
    request hook; mitmweb's intercept then holds it (it comes after turnguard). However long
    the user keeps it (past the relay's ``ROUTE_TTL_S``, the original long done), once resumed
    it gets the response it attached to, never the relay's 404 for a route it forgot."""
    # the relay's route TTL (a minute) made 2 s in that mitmweb: loaded after turnguard, a
    # script sets the module's constant, read each time a route is armed
    ttl_s = 2.0
    short_ttl = tmp_path / "short_route_ttl.py"
    short_ttl.write_text("import logging, sys\n"
                         "relay = sys.modules['turnguard_shell.relay']\n"
                         f"relay.ROUTE_TTL_S = {ttl_s!r}\n"
                         "logging.warning('route TTL now %s s', relay.ROUTE_TTL_S)\n")
    turn = {"model": "m", "input": "attached, then intercepted", "stream": True}
    with ThreadPoolExecutor(2) as pool, MockUpstream(
            tmp_path, {"default": {"kind": "ok", "events": 10, "gap_ms": 500}}) as up, MitmWeb(
            tmp_path, up, scripts=(short_ttl,), intercept="~hq x-intercept-me & ~q") as web:
        assert f"route TTL now {ttl_s} s" in web.log_text()
        original = pool.submit(post_turn, web.url, {}, turn, timeout=60)
        up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=20)
        duplicate = pool.submit(post_turn, web.url, {"x-intercept-me": "1"}, turn, timeout=60)
        held = wait_until(lambda: next((f for f in web.flows() if f["intercepted"]), None),
                          20, what="the duplicate intercepted in mitmweb")
        status, _, body = original.result(timeout=30)
        assert status == 200
        assert _events(tmp_path, "duplicate_attached"), _events(tmp_path)
        time.sleep(2 * ttl_s + 1)  # the user looks at it a while (past the TTL, twice)
        web.resume(held["id"])
        d_status, d_headers, d_body = duplicate.result(timeout=30)
        assert (d_status, d_headers.get("x-turnguard")) == (200, "attached"), d_body[:300]
        assert d_body == body
        assert len(up.dispatches()) == 1
        assert_no_traceback(web.log_text())


def test_a_request_held_through_a_cooldown_and_killed_in_mitmweb_spends_nothing(tmp_path):
    """Once mode: a request held through a cooldown that a user kills with mitmweb's Kill
    (which fires no hook: turnguard's ticker sees it) is let go, its client answered, nothing
    dispatched for it; the operation's one recovery is still there for its retry."""
    scenario = {"sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
                "default": {"kind": "ok"}}
    anchored = {"authorization": "Bearer sk-held-kill", "session-id": "sess-held-kill",
                "x-codex-turn-state": "ts_1", "accept": "application/json"}
    turn = {"model": "m", "input": "held through the cooldown", "stream": True}
    with ThreadPoolExecutor(2) as pool, MockUpstream(tmp_path, scenario) as up, MitmWeb(
            tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once",
            turnguard_response_created_timeout_ms=600, turnguard_cooldown_ms=5000) as web:
        assert post_turn(web.url, anchored, turn)[0] == 502  # cut: no headers in time
        assert post_turn(web.url, anchored, turn)[0] in (0, 502)  # reset: the circuit opens
        held = pool.submit(post_turn, web.url, anchored, turn, timeout=60)
        wait_until(lambda: _events(tmp_path, "wait_operation_fenced_cooldown"), 20,
                   what="a request held through the cooldown")
        flow = next(f for f in web.flows() if not f.get("response") and not f.get("error"))
        web.kill(flow["id"])
        assert held.result(timeout=20)[0] == 0  # let go: its connection closed
        assert [e["reason"] for e in _events(tmp_path, "hold_abandoned")] == ["killed"]
        assert len(up.dispatches()) == 2 and not _events(tmp_path, "recovery_claimed")
        status, _, body = post_turn(web.url, anchored, turn, timeout=60)  # its retry
        assert status == 200, body[:300]  # held through what is left, then recovered once
        assert len(up.dispatches()) == 3
        assert len(_events(tmp_path, "recovery_claimed")) == 1
        assert_no_traceback(web.log_text())


def test_a_dispatch_kept_intercepted_is_timed_for_a_response_event_once_resumed(tmp_path):
    """turnguard cuts a dispatch that saw no response event within
    ``turnguard_response_created_timeout_ms``. A dispatch a user keeps intercepted in mitmweb
    (after turnguard's request hook) has not gone upstream: its upstream cannot be silent
    yet, so it is not cut (nor marked so) while intercepted, and once resumed it is timed from
    then on: an upstream that then says nothing is cut as any (the client gets its 502)."""
    turn = {"model": "m", "input": "looked at a while", "stream": True}
    stall = {"x-mock-behaviour": '{"kind": "stall_before_headers", "ms": 60000}'}
    with ThreadPoolExecutor(2) as pool, MockUpstream(tmp_path) as up, MitmWeb(
            tmp_path, up, intercept="~hq x-intercept-me & ~q",
            turnguard_response_created_timeout_ms=1000) as web:
        original = pool.submit(post_turn, web.url, {"x-intercept-me": "1", **stall}, turn,
                               timeout=30)
        held = wait_until(lambda: next((f for f in web.flows() if f["intercepted"]), None),
                          20, what="the dispatch intercepted in mitmweb")
        time.sleep(3)  # the user looks at it past the response-created timeout
        assert not _events(tmp_path, "upstream_cut")  # nothing went upstream to be silent
        web.resume(held["id"])
        status, _, body = original.result(timeout=25)
        assert status == 502, body[:300]  # the stalled upstream was cut once it had the request
        (cut,) = _events(tmp_path, "upstream_cut")
        assert cut["cut"] and not cut["headers_seen"]
        assert len(up.dispatches()) == 1
        assert_no_traceback(web.log_text())


def test_an_intercepted_dispatch_edited_in_mitmweb_is_not_replayed_for_its_first_body(tmp_path):
    """Intercept, edit, resume: mitmweb's intercept comes after turnguard identified the
    request and claimed its operation, so the body the user writes is not the one the
    operation is of. What the upstream answers to the edited request must never be replayed
    to a retry of the body the client sent (the upstream never saw that one): that retry is
    dispatched."""
    first = {"model": "m", "input": "the client's prompt", "stream": True}
    edited = {"model": "m", "input": "the prompt as the user edited it", "stream": True}
    with ThreadPoolExecutor(2) as pool, MockUpstream(tmp_path) as up, MitmWeb(
            tmp_path, up, intercept="~hq x-intercept-me & ~q") as web:
        original = pool.submit(post_turn, web.url, {"x-intercept-me": "1"}, first, timeout=60)
        held = wait_until(lambda: next((f for f in web.flows() if f["intercepted"]), None),
                          20, what="the dispatch intercepted in mitmweb")
        web.edit_request(held["id"], content=json.dumps(edited))
        web.resume(held["id"])
        assert original.result(timeout=30)[0] == 200
        assert len(up.dispatches()) == 1
        retry = post_turn(web.url, {}, first, timeout=30)  # the client's body again
        assert retry[0] == 200
        assert retry[1].get("x-turnguard") is None, "answered with the edited request's response"
        assert len(up.dispatches()) == 2
        again = post_turn(web.url, {}, first, timeout=30)  # and that one is replayed
        assert again[1].get("x-turnguard") == "replayed"
        assert len(up.dispatches()) == 2
        assert_no_traceback(web.log_text())


def test_a_turn_that_ends_while_a_reload_failed_is_written_as_mitmweb_stops(tmp_path):
    """The exit with no instance running, in mitmweb (its master runs its web server beside
    the proxy, and stops both): turnguard's script is reloaded to a copy that does not load
    while a turn is held upstream, the turn completes meanwhile, and mitmweb is stopped
    (SIGTERM) before the script is fixed. The unloaded instance must write the turn's end as
    mitmweb exits, as it does in mitmdump: nothing left in flight, and its outcome in the
    events file. (An attack that held.)"""
    from test_at_most_once import break_script, in_background, in_flight, reloadable

    ledger = tmp_path / "ledger.sqlite3"
    script = reloadable(tmp_path)
    body = {"model": "m", "input": "a turn that ends while a reload failed, in mitmweb",
            "stream": True}
    with MockUpstream(tmp_path, {"sequence": [{"kind": "ok", "hold": "a"}],
                                 "default": {"kind": "ok"}}) as up, \
            MitmWeb(tmp_path, up, addon=script) as web:
        original = in_background(post_turn, web.url, {"session-id": "sess-web"}, body)
        up.wait_held("a", 30)
        break_script(web, script)
        up.release("a")
        assert original.result(30)[0] == 200
        assert in_flight(ledger)
        assert web.process.stop() == 0
        log = web.log_text()
    assert not in_flight(ledger)  # written as mitmweb exited
    assert "exiting while no instance runs" in log
    assert [e["outcome"] for e in _events(tmp_path, "outcome")] == ["completed"]
    assert log.count("Traceback") == 1  # its SyntaxError
