"""End to end: Responses over WebSocket while the shared SQLite ledger fails (locked, full,
deleted) at each step of a call, through two real mitmdump processes on one ledger."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import (MockUpstream, assert_no_traceback, guarded, ledger_query, parse_sse,
                     sse_post, turnguard_events, wait_until)
from test_e2e_websocket import HEADERS, call, post_fallback, user
from turnguard_ws import WsClient, types  # noqa: E402 - harness puts scripts/ on sys.path

STREAM = {"default": {"kind": "ok", "events": 12, "gap_ms": 150}}


@contextlib.contextmanager
def write_lock(ledger):
    db = sqlite3.connect(ledger, timeout=10, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        db.execute("ROLLBACK")
        db.close()


def in_flight(ledger):
    return ledger_query(ledger, "SELECT op_key FROM operations WHERE state='in_flight'")


def op_states(ledger, op):
    """The states of operation ``op`` (its id) in the ledger file at ``ledger`` now ([] while
    the file or its schema is not there)."""
    try:
        return ledger_query(ledger, "SELECT state FROM operations WHERE substr(op_key, 1, 12) = ?",
                            (op,))
    except sqlite3.Error:
        return []


def background(fn, *args):
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def ws_call(url, frame, timeout=60):
    async def go():
        async with WsClient.connect(url, headers=HEADERS) as c:
            await c.send(frame)
            return await c.response(timeout)
    return asyncio.run(go())


def http_call(url, frame):
    status, headers, body = sse_post(url, body=post_fallback(frame),
                                     headers={**HEADERS, "accept": "text/event-stream"})
    return status, headers.get("x-turnguard"), [d.get("type") for _, d in parse_sse(body)]


@pytest.mark.parametrize("retry_via", ["ws", "http"])
def test_a_call_that_finds_the_ledger_deleted_is_claimed_in_the_new_file(tmp_path, retry_via):
    """The ledger file is deleted just before a call's frame reaches process a (both processes
    had it open). The call finds it gone: a opens the file now at the path and claims the call
    there before deciding (README: "registers its attempts in flight there before deciding from
    it"), rather than dispatching it blind and registering it seconds later, after the heartbeat
    noticed, or never while it runs. So a retry reaching process b while the call streams (on a
    new socket, or as the POST fallback) is held on it and answered with its recording: one
    upstream execution of the call."""
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=20000)
    scenario = {"default": {"kind": "ok", "events": 20, "gap_ms": 200}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        ws_call(a.url, call([user("warm a")], seed=10))
        ws_call(b.url, call([user("warm b")], seed=11))
        for suffix in ("", "-wal", "-shm"):
            os.unlink(f"{ledger}{suffix}")
        frame = call([user("claimed in a new file")], seed=1)
        original = background(ws_call, a.url, frame)
        up.wait_for_record(lambda r: r.get("event") == "dispatch" and r["n"] == 2, 10)
        dispatched = wait_until(lambda: turnguard_events(tmp_path, "a", "dispatch")[1:], 10,
                                what="a's dispatch of the call")
        assert dispatched[0]["ledger"] is True, dispatched  # decided from the new file
        op = dispatched[0]["op"]
        assert wait_until(lambda: op_states(ledger, op), 10,
                          what="the call in the new file") == [("in_flight",)]
        retry = (background(ws_call, b.url, call([user("claimed in a new file")], seed=2))
                 if retry_via == "ws" else background(http_call, b.url, frame))
        got = original.result(30)
        assert types(got)[-1] == "response.completed"
        again = retry.result(40)
        assert (types(again) if retry_via == "ws" else again[2]) == types(got), again
        assert len(up.dispatches()) == 3  # the two warm-ups and the call: once
        wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight")
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("kind", ["locked", "deleted"])
def test_a_detached_call_whose_socket_drops_in_a_ledger_fault_is_run_once(tmp_path, kind):
    """Detached calls (``turnguard_detach_ms``): a call streams through process a, the ledger
    fails (locked, or its file deleted), and the client drops its socket mid-think. The call
    runs on as turnguard's own POST; a retry on a new socket through a attaches to it, and one
    through process b (on a socket, and as the POST fallback), sent once the fault is over
    while the call still runs, is held and answered from it: one upstream execution, nothing
    in flight after."""
    thinking = {"default": {"kind": "ok", "think_ms": 4000, "events": 3}}
    opts = dict(turnguard_detach_ms=30000, turnguard_response_created_timeout_ms=20000,
                turnguard_hold_timeout_ms=20000)
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path, thinking) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        frame = call([user(f"detached in a fault {kind}")], seed=1)

        async def drop():
            async with WsClient.connect(a.url, headers=HEADERS) as c:
                await c.send(frame)
                first = json.loads(await c.recv(20))
                c.abort()
                await asyncio.sleep(0.5)
                return first

        text = f"detached in a fault {kind}"
        if kind == "locked":
            with write_lock(ledger):
                first = asyncio.run(drop())
        else:
            for suffix in ("", "-wal", "-shm"):
                os.unlink(f"{ledger}{suffix}")
            first = asyncio.run(drop())
        op = turnguard_events(tmp_path, "a", "dispatch")[0]["op"]
        wait_until(lambda: op_states(ledger, op) == [("in_flight",)], 10,
                   what="the call in flight in the ledger once the fault is over")
        elsewhere_ws = background(ws_call, b.url, call([user(text)], seed=3))
        elsewhere_http = background(http_call, b.url, frame)
        here = ws_call(a.url, call([user(text)], seed=2))
        assert types(here)[-1] == "response.completed" and here[0] == first, here
        assert elsewhere_ws.result(30) == here
        status, _, kinds = elsewhere_http.result(30)
        assert status == 200 and kinds == types(here)
        assert len(up.dispatches()) == 1
        assert len(turnguard_events(tmp_path, "b", "duplicate_held")) == 2
        wait_until(lambda: ledger.exists() and not in_flight(ledger), 20, what="nothing in flight")
        assert_no_traceback(a.log_text() + b.log_text())
