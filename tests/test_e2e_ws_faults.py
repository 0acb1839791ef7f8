"""End to end: Responses over WebSocket while the shared SQLite ledger fails (locked, full,
deleted) at each step of a call, through two real mitmdump processes on one ledger."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import (MockUpstream, another_host_prefix, assert_no_traceback, delete_ledger,
                     guarded, ledger_query,
                     older_copy, parse_sse, replace_with_junk, replace_with_older_copy,
                     sse_post, turnguard_events, wait_for_a_first_event, wait_until)
from test_ledger_faults import immutable, tiny_tmpfs
from turnguard_faults import disk_full
from test_e2e_websocket import HEADERS, call, post_fallback, user
from turnguard_ws import WsClient, types  # noqa: E402 - harness puts scripts/ on sys.path
from turnguard_core.ledger import Ledger

STREAM = {"default": {"kind": "ok", "events": 12, "gap_ms": 150}}


def after_warm_ups(n: int, scenario: dict) -> dict:
    """``scenario`` with its first ``n`` dispatches (a test's warm-up calls, which only open
    the ledger or add attempts) answered at once: only the calls after them stream slowly."""
    return {**scenario, "sequence": [{"kind": "ok"}] * n}


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


def _fail_twice(tmp_path, proxy, text, ends=("closed",)):
    """Two calls of ``text`` (seeds 2 and 3) that fail without an event through ``proxy``
    (named "a"; the mock's ``EVENTLESS_TWICE``): their circuit opens."""
    for seed in (2, 3):
        got = ws_call(proxy.url, call([user(text)], seed=seed))
        assert got[-1]["type"] in ends, got
    wait_until(lambda: len(turnguard_events(tmp_path, "a", "eventless_failure")) == 2,
               10, what="two eventless failures")


def _held_through_the_cooldown(tmp_path, proxy, frame):
    """``frame`` sent through ``proxy`` (named "a") in the background, once it is held
    through its circuit's cooldown: the future of its events."""
    held = background(ws_call, proxy.url, frame)
    wait_until(lambda: turnguard_events(tmp_path, "a", "wait_operation_fenced_cooldown"),
               10, what="the call held through the cooldown")
    return held


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


@contextlib.contextmanager
def fault(kind, folder):
    """The ledger in ``folder`` locked (another connection's ``BEGIN IMMEDIATE``), its file
    system full, its files read-only (``chattr +i``; the -shm stays writable: it is mmapped),
    or a file that is no database at its path (taken away at the end: a new ledger is made
    there), until the block ends; or its file deleted."""
    ledger = folder / "ledger.sqlite3"
    if kind == "locked":
        with write_lock(ledger):
            yield
    elif kind == "full":
        with disk_full(ledger):
            yield
    elif kind == "read-only":
        with immutable(ledger, folder / "ledger.sqlite3-wal", folder):
            yield
    elif kind == "junk":
        replace_with_junk(ledger)
        yield
        delete_ledger(ledger)
    elif kind == "replaced":  # an older copy (taken at the start) moved into its place
        replace_with_older_copy(folder)
        yield
    else:
        delete_ledger(ledger)
        yield


def ledger_folder(tmp_path, kind, size="2m"):
    """The folder of the ledger for a fault of ``kind``: a tmpfs of ``size`` to fill for
    "full" (room for ``disk_full``'s scratch writes, one a round where a test fills it
    several times: 8m)."""
    folder = tmp_path / "ledger-fs"
    if kind == "full":
        return tiny_tmpfs(folder, size)
    folder.mkdir(mode=0o700)
    return contextlib.nullcontext(folder)


def original_of(transport):
    return ws_call if transport == "ws" else lambda url, frame: http_call(url, frame)


@pytest.mark.parametrize("kind", ["locked", "full", "deleted", "replaced"])
@pytest.mark.parametrize("transport", ["ws", "http"])
def test_a_call_that_ends_in_a_ledger_fault_answers_its_retries_held_in_the_other_process(
        tmp_path, kind, transport):
    """A call streams through process a (over a socket, or as its POST fallback); its retries
    come through process b, on a new socket and as the POST fallback, and are held there (the
    call is in flight in the ledger). Then the ledger fails (locked, full, deleted) and the call
    completes in it: its end is kept. When the fault is over, a writes the end and b answers
    both retries from the recording: one upstream execution, nothing in flight."""
    with ledger_folder(tmp_path, kind) as folder, \
            MockUpstream(tmp_path, after_warm_ups(1, STREAM)) as up:
        ledger = folder / "ledger.sqlite3"
        opts = dict(turnguard_ledger=str(ledger), turnguard_hold_timeout_ms=20000)
        with guarded(tmp_path, up, "a", **opts) as a, guarded(tmp_path, up, "b", **opts) as b:
            ws_call(a.url, call([user("warm")], turn="warm", seed=9))
            older_copy(folder)
            frame = call([user(f"ends in a fault {kind}")], seed=1)
            original = background(original_of(transport), a.url, frame)
            op = wait_until(lambda: turnguard_events(tmp_path, "a", "dispatch")[1:], 10,
                            what="a dispatching the call")[0]["op"]
            wait_until(lambda: op_states(ledger, op) == [("in_flight",)], 10,
                       what="the call in flight")
            retry_ws = background(ws_call, b.url, call([user(f"ends in a fault {kind}")], seed=2))
            retry_http = background(http_call, b.url, frame)
            wait_until(lambda: len(turnguard_events(tmp_path, "b", "duplicate_held")) == 2, 10,
                       what="both retries held in b")
            with fault(kind, folder):
                got = original.result(30)
                time.sleep(1)
            kinds = types(got) if transport == "ws" else got[2]
            assert kinds[-1] == "response.completed", got
            again = retry_ws.result(40)
            assert types(again) == kinds, again
            status, how, http_kinds = retry_http.result(40)
            assert status == 200 and http_kinds == kinds, (status, how, http_kinds)
            assert len(up.dispatches()) == 2  # the warm-up, the call
            wait_until(lambda: ledger.exists() and not in_flight(ledger), 20,
                       what="nothing in flight")
            assert_no_traceback(a.log_text() + b.log_text())


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
    scenario = after_warm_ups(2, {"default": {"kind": "ok", "events": 20, "gap_ms": 200}})
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


@pytest.mark.parametrize("who", ["client", "upstream"])
def test_a_socket_closed_mid_call_behind_a_lock_leaves_nothing_in_flight(tmp_path, who):
    """The ledger is locked while a call streams through process a, and its socket is closed
    mid-stream (the client drops it, or the upstream breaks the stream). Once the lock goes
    nothing stays in flight, and the retry through process b is dispatched and answered."""
    ledger = tmp_path / "ledger.sqlite3"
    scenario = STREAM if who == "client" else {
        "default": {"kind": "ok", "events": 12, "gap_ms": 150},
        "sequence": [{"kind": "partial", "events": 4, "gap_ms": 150, "end": "reset"}]}
    opts = dict(turnguard_hold_timeout_ms=20000)
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        frame = call([user("closed behind a lock")], seed=1)

        async def cut():
            async with WsClient.connect(a.url, headers=HEADERS) as c:
                await c.send(frame)
                first = json.loads(await c.recv(20))
                with write_lock(ledger):
                    if who == "client":
                        await asyncio.sleep(0.5)
                        c.abort()
                        await asyncio.sleep(1.5)
                        return [first]
                    got = await c.response(20)
                    await asyncio.sleep(1)
                    return [first, *got]

        cut_short = asyncio.run(cut())
        assert "response.completed" not in types(cut_short)
        wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight after the lock")
        again = ws_call(b.url, call([user("closed behind a lock")], seed=2))
        assert types(again)[-1] == "response.completed", again
        assert len(up.dispatches()) == 2  # the call cut short, and its retry
        wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight")
        assert_no_traceback(a.log_text() + b.log_text())


def masked_text_frame(payload: bytes) -> bytes:
    """A client's whole text frame (FIN, opcode 1, masked) carrying ``payload`` as it is,
    invalid UTF-8 included (wsproto would refuse to build one)."""
    key = os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                            bytes([0x80 | 126]) + n.to_bytes(2, "big") if n < 65536 else
                            bytes([0x80 | 127]) + n.to_bytes(8, "big"))
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


HOSTILE = {
    "binary": b"\x00\xff binary",
    "1 MB": json.dumps({"type": "response.create", "model": "gpt-test", "stream": True,
                        "input": "y" * (1 << 20)}),
    "unknown previous_response_id": None,  # built in the test: a delta on a response never seen
    "invalid UTF-8": masked_text_frame(b'{"type": "response.create", "input": "\xff\xfe"}'),
}


@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_a_hostile_frame_behind_a_call_that_ends_behind_a_lock(tmp_path, hostile):
    """A call streams through process a; the ledger is locked after its first event, and the
    client sends a hostile frame right behind it on the same socket. The call is answered in
    full, with its own events; the hostile frame gets the upstream's own answer (or, invalid
    UTF-8, the socket is closed with a reason); once the lock goes nothing stays in flight, a
    retry of the call through process b is replayed (one upstream execution) and no hook
    raised."""
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path, STREAM) as up, guarded(tmp_path, up, "a") as a, \
            guarded(tmp_path, up, "b") as b:
        frame = call([user(f"hostile behind {hostile}")], seed=1)
        delta = call([user("and then")], seed=3, previous_response_id="resp_never_seen_here")

        async def go():
            async with WsClient.connect(a.url, headers=HEADERS) as c:
                await c.send(frame)
                first = json.loads(await c.recv(20))
                with write_lock(ledger):
                    raw = HOSTILE[hostile]
                    if isinstance(raw, bytes) and hostile == "invalid UTF-8":
                        c._writer.write(raw)
                        await c._writer.drain()
                    else:
                        await c.send(delta if raw is None else raw)
                    got = [first, *await c.response(30)]
                    behind = [] if got[-1]["type"] == "closed" else await c.response(30)
                    await asyncio.sleep(0.5)
                return got, behind

        got, behind = asyncio.run(go())
        if hostile == "invalid UTF-8":  # a protocol error: mitmproxy closes the socket
            assert got[-1] == {"type": "closed", "code": 1007}, got
            wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight after the lock")
            again = ws_call(b.url, call([user(f"hostile behind {hostile}")], seed=2))
            assert types(again)[-1] == "response.completed", again
            assert len(up.dispatches()) == 2  # the call cut with its socket, and its retry
            assert_no_traceback(a.log_text() + b.log_text())
            return
        assert types(got)[0] == "response.created" and types(got)[-1] == "response.completed"
        ids = {e["response"]["id"] for e in got if "response" in e}
        assert len(ids) == 1, ids
        assert behind and all(e.get("response", {}).get("id") not in ids for e in behind), behind
        wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight after the lock")
        again = ws_call(b.url, call([user(f"hostile behind {hostile}")], seed=2))
        assert again == got
        # the call once, and the hostile frame (a binary one is answered 400, no dispatch)
        assert len(up.dispatches()) == (1 if hostile == "binary" else 2)
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


@pytest.mark.parametrize("kind", ["locked", "deleted"])
def test_a_late_event_in_a_ledger_fault_is_not_lent_to_the_next_call(tmp_path, kind):
    """The ledger fails (locked, or its file deleted) before two calls on one socket through
    process a; the upstream sends the first response's terminal event once more, late, while
    the second call is in flight. Once the fault is over, the retry of the second call through
    process b is replayed the second call's own events (never the stray one) and nothing stays
    in flight."""
    scenario = {"sequence": [{"kind": "ok"}, {"kind": "ok", "after_completed": "repeat_terminal"},
                             {"kind": "ok", "delay_ms": 1000}], "default": {"kind": "ok"}}
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a") as a, \
            guarded(tmp_path, up, "b") as b:
        async def two_calls():
            async with WsClient.connect(a.url, headers=HEADERS) as c:
                await c.send(call([user("A")], seed=1))
                first = await c.response()
                await c.send(call([user("B")], seed=2))
                stray = await c.response()
                return first, stray, await c.response()

        ws_call(b.url, call([user("warm b")], turn="warm", seed=9))  # b has the ledger open
        if kind == "locked":
            with write_lock(ledger):
                first, stray, second = asyncio.run(two_calls())
        else:
            for suffix in ("", "-wal", "-shm"):
                os.unlink(f"{ledger}{suffix}")
            first, stray, second = asyncio.run(two_calls())
        ids = [{e["response"]["id"] for e in r if "response" in e} for r in (first, second)]
        assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1]
        assert stray == first[-1:]
        wait_until(lambda: ledger.exists() and not in_flight(ledger) and len(ledger_query(
                       ledger, "SELECT 1 FROM attempts WHERE outcome='completed'")) >= 2, 20,
                   what="both calls' ends written")
        retried = ws_call(b.url, call([user("B")], seed=3))
        assert retried == [e for e in second if e["response"]["id"] in ids[1]
                           or "response" not in e]
        assert len(up.dispatches()) == 3  # the warm-up, A, B
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_a_retry_held_elsewhere_when_an_older_copy_replaces_the_ledger_is_answered(
        tmp_path, transport):
    """A call streams through process a (over a socket, or as its POST fallback) and its retry
    is held in process b (on a new socket) on the call's attempt, when an older copy of the
    ledger is moved into its place. a registers the call in the copy (in flight, or ended whole),
    where the attempt ids are the copy's own: the id b waits on may be another operation's
    there. b's retry is still answered with the call's recording once it ends (one upstream
    execution), and does not wait out its hold bound."""
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=20000)
    text = f"an older copy over the ledger ({transport})"
    with MockUpstream(tmp_path, after_warm_ups(3, STREAM)) as up, \
            guarded(tmp_path, up, "a", **opts) as a, guarded(tmp_path, up, "b", **opts) as b:
        ws_call(a.url, call([user("warm 1")], turn="w1", seed=7))
        wait_until(lambda: not in_flight(ledger), 10, what="the warm-up ended")
        older_copy(tmp_path)
        for i in (2, 3):  # attempts the copy does not have
            ws_call(a.url, call([user(f"warm {i}")], turn=f"w{i}", seed=7 + i))
        frame = call([user(text)], seed=1)
        original = background(original_of(transport), a.url, frame)
        op = wait_until(lambda: turnguard_events(tmp_path, "a", "dispatch")[3:], 10,
                        what="a dispatching the call")[0]["op"]
        wait_until(lambda: op_states(ledger, op) == [("in_flight",)], 10, what="the call in flight")
        retry = background(ws_call, b.url, call([user(text)], seed=2))
        wait_until(lambda: turnguard_events(tmp_path, "b", "duplicate_held"), 10,
                   what="the retry held in b")
        replace_with_older_copy(tmp_path)
        got = original.result(30)
        kinds = types(got) if transport == "ws" else got[2]
        assert kinds[-1] == "response.completed", got
        again = retry.result(40)
        assert types(again) == kinds, again
        assert len(up.dispatches()) == 4  # three warm-ups, the call
        wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight")
        assert_no_traceback(a.log_text() + b.log_text())


def _call_in_flight(tmp_path, up, a, ledger, text: str):
    """A call of ``text`` sent through process ``a`` (in the background), once it is in
    flight in the ledger and the upstream (``up``) has it: its frame, its future and its
    operation."""
    upstream_had = len(up.dispatches())
    frame = call([user(text)], seed=1)
    original = background(ws_call, a.url, frame)
    op = wait_until(lambda: turnguard_events(tmp_path, "a", "dispatch"), 10,
                    what="a dispatching the call")[0]["op"]
    wait_until(lambda: op_states(ledger, op) == [("in_flight",)], 10, what="the call")
    wait_until(lambda: len(up.dispatches()) > upstream_had, 10, what="the upstream's call")
    return frame, original, op


def _retry(b, text: str, frame: dict, retry_via: str):
    """The retry of that call through process ``b``, in the background: on a new socket
    (another seed), or as the POST fallback of its frame."""
    return (background(ws_call, b.url, call([user(text)], seed=2)) if retry_via == "ws"
            else background(http_call, b.url, frame))


def test_retries_that_find_the_ledger_deleted_together_all_wait_for_its_new_file(tmp_path):
    """The ledger file is deleted while a call streams through process a; a registers the call
    in the new file. Then eight retries of it reach process b at once (sockets and POST
    fallbacks), b still on the deleted file: the first to find it gone opens the new one, and
    the others wait for that opening (within their budget) instead of deciding blind while it
    is under way. All are held on a's call and answered from it: one upstream execution."""
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=20000)
    scenario = after_warm_ups(1, {"default": {"kind": "ok", "events": 20, "gap_ms": 250}})
    text = "eight retries on a deleted ledger"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        ws_call(b.url, call([user("warm b")], turn="warm", seed=9))  # b has the file open
        frame, original, op = _call_in_flight(tmp_path, up, a, ledger, text)
        for suffix in ("", "-wal", "-shm"):
            os.unlink(f"{ledger}{suffix}")
        wait_until(lambda: op_states(ledger, op) == [("in_flight",)], 10,
                   what="a registering the call in the new file")
        pool = ThreadPoolExecutor(max_workers=8)
        try:
            retries = [pool.submit(ws_call, b.url, call([user(text)], seed=10 + i)) if i % 2
                       else pool.submit(http_call, b.url, frame) for i in range(8)]
            got = original.result(30)
            answers = [r.result(40) for r in retries]
        finally:
            pool.shutdown(wait=False)
        assert types(got)[-1] == "response.completed"
        assert [types(x) if i % 2 else x[2] for i, x in enumerate(answers)] == [types(got)] * 8
        assert len(up.dispatches()) == 2  # b's warm-up, and the call once
        assert not [e for e in turnguard_events(tmp_path, "b", "dispatch") if e["op"] == op]
        wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight")
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("kind", ["deleted", "replaced"])
def test_retries_sent_elsewhere_as_the_ledger_goes_wait_for_the_call_to_be_registered(
        tmp_path, kind):
    """A call streams through process a when the ledger file is deleted (or an older copy is
    moved into its place), and its retries reach process b at once (a new socket and a POST
    fallback), before a has registered the call in the new file. b read from the file it
    left that a had an attempt in flight: it waits for a to note that its attempts are
    registered in the new file, then holds the retries on the call. One upstream execution."""
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=20000)
    scenario = after_warm_ups(1, {"default": {"kind": "ok", "events": 16, "gap_ms": 250}})
    text = f"retries as the ledger is {kind}"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        ws_call(b.url, call([user("warm b")], turn="warm", seed=9))  # b has the file open
        older_copy(tmp_path)
        frame, original, op = _call_in_flight(tmp_path, up, a, ledger, text)
        with fault(kind, tmp_path):
            retries = [background(ws_call, b.url, call([user(text)], seed=2)),
                       background(http_call, b.url, frame)]
            got = original.result(30)
            answers = [r.result(40) for r in retries]
        assert types(got)[-1] == "response.completed"
        assert types(answers[0]) == types(got) and answers[1][2] == types(got)
        assert len(up.dispatches()) == 2  # b's warm-up, and the call once
        assert not [e for e in turnguard_events(tmp_path, "b", "dispatch") if e["op"] == op]
        # held for a to register (request_held), or, had a registered first, on its call
        held = turnguard_events(tmp_path, "b", "request_held")
        assert {e["reason"] for e in held} <= {"ledger_peers_registering"}
        assert held or turnguard_events(tmp_path, "b", "duplicate_held")
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("kind", ["locked", "full"])
def test_a_call_claimed_in_a_ledger_fault_is_registered_after_it_and_holds_its_retry(
        tmp_path, kind):
    """The ledger is locked, or its disk full, when a call's frame reaches process a: the call
    is decided in memory and dispatched. Once the fault is over, a registers it in the ledger
    while it still streams, so its retry through process b (a new socket) is held on it and
    answered from it: one upstream execution, nothing in flight after."""
    scenario = after_warm_ups(1, {"default": {"kind": "ok", "events": 24, "gap_ms": 250}})
    text = f"claimed in a fault {kind}"
    with ledger_folder(tmp_path, kind) as folder, MockUpstream(tmp_path, scenario) as up:
        ledger = folder / "ledger.sqlite3"
        opts = dict(turnguard_ledger=str(ledger), turnguard_hold_timeout_ms=20000)
        with guarded(tmp_path, up, "a", **opts) as a, guarded(tmp_path, up, "b", **opts) as b:
            ws_call(a.url, call([user("warm")], turn="warm", seed=9))
            wait_until(lambda: not in_flight(ledger), 10, what="the warm-up ended")
            with fault(kind, folder):
                original = background(ws_call, a.url, call([user(text)], seed=1))
                dispatched = wait_until(lambda: turnguard_events(tmp_path, "a", "dispatch")[1:],
                                        10, what="a dispatching the call")
                assert dispatched[0]["ledger"] is False  # decided without the ledger
            op = dispatched[0]["op"]
            wait_until(lambda: op_states(ledger, op) == [("in_flight",)], 10,
                       what="the call registered once the fault is over")
            retry = background(ws_call, b.url, call([user(text)], seed=2))
            got = original.result(30)
            assert types(got)[-1] == "response.completed"
            assert retry.result(40) == got
            assert len(up.dispatches()) == 2  # the warm-up, the call
            wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight")
            assert_no_traceback(a.log_text() + b.log_text())


@contextlib.contextmanager
def two_warm_processes(tmp_path, kind, scenario):
    """Processes a and b on one ledger, in a folder made for a fault of ``kind`` (a tmpfs of
    8m for a full disk: room for the scratch writes of ``disk_full``), a's warm-up call
    ended: yields (folder, ledger, upstream, a, b)."""
    with ledger_folder(tmp_path, kind, "8m") as folder, \
            MockUpstream(tmp_path, scenario) as up:
        ledger = folder / "ledger.sqlite3"
        opts = dict(turnguard_ledger=str(ledger), turnguard_hold_timeout_ms=20000)
        with guarded(tmp_path, up, "a", **opts) as a, guarded(tmp_path, up, "b", **opts) as b:
            ws_call(a.url, call([user("warm")], turn="warm", seed=9))
            wait_until(lambda: not in_flight(ledger), 10, what="the warm-up ended")
            yield folder, ledger, up, a, b


@pytest.mark.parametrize("kind", ["locked", "full", "read-only", "junk"])
def test_a_call_claimed_in_a_ledger_fault_is_registered_before_a_retry_sent_elsewhere_just_after(
        tmp_path, kind):
    """As the test above, with the retries sent 0.4 s after the fault's end, not once the
    call's row is there: the ledger is locked, its disk full, its files read-only or a file
    that is no database at its path when a call's frame reaches process a, which decides it
    in memory and dispatches it; until a writes its row, process b takes a retry for new. So
    a tries again at once (behind a lock) or every 0.1 s (otherwise; with no ledger open, a
    try to open the file at the path) while it owes the row, not at its next tick, and b
    tries to open the file before it decides a retry blind: the retries through b (a new
    socket and the POST fallback) are held on the call and answered from it, in each of
    three rounds (the fault's end at several points of a's tick). One upstream execution a
    call."""
    scenario = after_warm_ups(1, {"default": {"kind": "ok", "events": 20, "gap_ms": 200}})
    with two_warm_processes(tmp_path, kind, scenario) as (folder, ledger, up, a, b):
        for n, fault_s in enumerate((1.3, 2.1, 2.7), start=1):
            text = f"claimed while the ledger is {kind} for {fault_s} s"
            frame = call([user(text)], seed=1)
            with fault(kind, folder):
                original = background(ws_call, a.url, frame)
                dispatched = wait_until(
                    lambda: turnguard_events(tmp_path, "a", "dispatch")[n:], 10,
                    what="a dispatching the call")
                assert dispatched[0]["ledger"] is False  # decided without the ledger
                time.sleep(fault_s)
            time.sleep(0.4)  # (a tries every 0.1 s, or at once behind a lock)
            retries = [background(ws_call, b.url, call([user(text)], seed=2)),
                       background(http_call, b.url, frame)]
            got = original.result(30)
            assert types(got)[-1] == "response.completed", got
            again, (status, _, kinds) = retries[0].result(40), retries[1].result(40)
            assert again == got, again
            assert status == 200 and kinds == types(got), (status, kinds)
            assert len(up.dispatches()) == 1 + n, "b ran the call a second time"
        wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight")
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("transport", ["ws", "http"])
@pytest.mark.parametrize("kind", ["full", "read-only", "junk"])
def test_a_call_run_whole_in_a_ledger_fault_is_replayed_to_a_retry_sent_elsewhere_just_after(
        tmp_path, kind, transport):
    """A call's frame (or its POST fallback) reaches process a while the ledger's disk is
    full, its files read-only or a file that is no database is at its path: a dispatches it
    from memory, and it completes before the fault ends. a owes the ledger the call whole
    (its operation, its attempt, its end): until it writes it, process b takes a retry for
    new. So a tries every 0.1 s while it owes it: the retries sent through b (a new socket
    and the POST fallback) 0.4 s after the fault's end are replayed the call's events, in
    each of three rounds (the fault's end at several points of a's tick), never dispatched
    again."""
    scenario = after_warm_ups(1, {"default": {"kind": "ok", "events": 4, "gap_ms": 50}})
    with two_warm_processes(tmp_path, kind, scenario) as (folder, ledger, up, a, b):
        for n, fault_s in enumerate((1.3, 2.1, 2.7), start=1):
            text = f"run whole while the ledger is {kind} for {fault_s} s"
            frame = call([user(text)], seed=1)
            with fault(kind, folder):
                got = original_of(transport)(a.url, frame)
                dispatched = turnguard_events(tmp_path, "a", "dispatch")[n:]
                assert dispatched and dispatched[0]["ledger"] is False, dispatched
                time.sleep(fault_s)
            time.sleep(0.4)  # (a tries every 0.1 s)
            kinds = types(got) if transport == "ws" else got[2]
            assert kinds[-1] == "response.completed", got
            again = ws_call(b.url, call([user(text)], seed=2))
            status, how, http_kinds = http_call(b.url, frame)
            assert len(up.dispatches()) == 1 + n, "b ran the call a second time"
            assert types(again) == kinds, again
            assert (status, how, http_kinds) == (200, "replayed", kinds)
        assert not in_flight(ledger)
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("retry_via", ["ws", "http"])
def test_a_retry_sent_elsewhere_while_another_connection_holds_the_write_lock_is_held(
        tmp_path, retry_via):
    """A call streams through process a when another connection takes the ledger's write lock
    (``BEGIN IMMEDIATE``); its retry then reaches process b, which never saw the call (a new
    socket, or the POST fallback). The ledger can still be read: b finds the call in flight in
    a and holds the retry, never dispatches it a second time; it gets the call's events once
    the call ended. One upstream execution."""
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=30000)
    scenario = {"default": {"kind": "ok", "events": 16, "gap_ms": 250}}
    text = f"a retry behind a write lock via {retry_via}"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        frame, original, op = _call_in_flight(tmp_path, up, a, ledger, text)
        with write_lock(ledger):
            retry = _retry(b, text, frame, retry_via)
            wait_until(lambda: turnguard_events(tmp_path, "b", "duplicate_held")
                       or turnguard_events(tmp_path, "b", "dispatch"), 10,
                       what="b deciding the retry")
            assert len(up.dispatches()) == 1, "b ran the call a second time behind the lock"
            assert turnguard_events(tmp_path, "b", "ledger_unavailable")  # the lock was met
            got = original.result(30)
        assert types(got)[-1] == "response.completed"
        again = retry.result(40)
        assert (types(again) if retry_via == "ws" else again[2]) == types(got), again
        assert len(up.dispatches()) == 1
        assert_no_traceback(a.log_text() + b.log_text())


def test_a_completed_call_retried_elsewhere_while_another_connection_holds_the_write_lock_is_replayed(
        tmp_path):
    """A call completed through process a; while another connection holds the ledger's write
    lock its retries reach process b (a new socket, and the POST fallback): b reads the
    recording from the ledger and replays it to both. One upstream execution."""
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a") as a, \
            guarded(tmp_path, up, "b") as b:
        frame = call([user("a completed call behind a write lock")], seed=1)
        got = ws_call(a.url, frame)
        assert types(got)[-1] == "response.completed"
        wait_until(lambda: ledger_query(ledger, "SELECT state FROM operations")
                   == [("completed",)], 10, what="the call's end written")
        with write_lock(ledger):
            again = ws_call(b.url, call([user("a completed call behind a write lock")], seed=2))
            status, how, kinds = http_call(b.url, frame)
            assert turnguard_events(tmp_path, "b", "ledger_unavailable")  # the lock was met
        assert len(up.dispatches()) == 1, "b ran the completed call again behind the lock"
        assert again == got
        assert status == 200 and how == "replayed" and kinds == types(got), (status, how, kinds)
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("retry_via", ["ws", "http"])
def test_a_retry_sent_elsewhere_while_the_ledger_is_replaced_by_junk_waits_for_the_call(
        tmp_path, retry_via):
    """A call streams through process a when a file that is no database is moved over the
    ledger. Process b, which never saw the call, finds the file replaced and decides in memory;
    but it read from the file it left that a, alive, had the call in flight: its retry (a new
    socket, or the POST fallback) is held, never dispatched blind. Once the junk is gone it is
    answered with the call's events. One upstream execution."""
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=30000)
    scenario = {"default": {"kind": "ok", "events": 16, "gap_ms": 250}}
    text = f"a retry while the ledger is junk via {retry_via}"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        frame, original, op = _call_in_flight(tmp_path, up, a, ledger, text)
        replace_with_junk(ledger)
        wait_until(lambda: turnguard_events(tmp_path, "b", "ledger_unavailable"), 10,
                   what="b finding the ledger replaced")
        retry = _retry(b, text, frame, retry_via)
        got = original.result(30)
        assert types(got)[-1] == "response.completed"
        delete_ledger(ledger)  # the junk goes: a new ledger is made at the path
        again = retry.result(60)
        assert len(up.dispatches()) == 1, "the retry sent to b ran the call a second time"
        assert (types(again) if retry_via == "ws" else again[2]) == types(got), again
        assert_no_traceback(a.log_text() + b.log_text())


ONCE_COOLDOWN_MS = 4000
EVENTLESS_TWICE = {"sequence": [{"kind": "clean_close"}, {"kind": "clean_close"}],
                   "default": {"kind": "ok"}}

@pytest.mark.parametrize("kind", ["deleted", "replaced"])
def test_once_mode_a_call_held_as_the_ledger_goes_is_recovered_by_its_live_owner(
        tmp_path, kind):
    """Once mode over a socket: a call's frame is held through its cooldown by process a, the
    owner of its session, when the ledger file is deleted (or an older copy, made before the
    session was first claimed, is moved into its place). The new file does not know the
    session, and no process took it over: a is still its owner, and the file is an outage,
    never an empty ledger. So the held call is not failed closed as ``ownership_lost``
    (another process took the session); a registers its session in the new file at its epoch,
    and recovers the call once when the cooldown ends."""
    with MockUpstream(tmp_path, EVENTLESS_TWICE) as up:
        opts = dict(turnguard_hold_timeout_ms=20000, turnguard_cooldown_ms=ONCE_COOLDOWN_MS,
                    turnguard_recovery_mode="server_anchored_replay_once")
        with guarded(tmp_path, up, "a", **opts) as a:
            older_copy(tmp_path)  # the file a opened: no row of the session claimed below
            text = f"once mode as the ledger is {kind}"
            _fail_twice(tmp_path, a, text)
            held = _held_through_the_cooldown(tmp_path, a, call([user(text)], seed=1))
            with fault(kind, tmp_path):
                got = held.result(40)
            assert types(got)[-1] == "response.completed", (
                got, turnguard_events(tmp_path, "a", "fail_closed"))
            assert len(up.dispatches()) == 3  # two failures, the recovery
            assert len(turnguard_events(tmp_path, "a", "recovery_claimed")) == 1
            assert not turnguard_events(tmp_path, "a", "ownership_lost")
            assert_no_traceback(a.log_text())


@pytest.mark.parametrize("kind", ["locked", "full", "deleted", "replaced"])
def test_once_mode_a_call_held_through_the_cooldown_in_a_ledger_fault_is_answered_once(
        tmp_path, kind):
    """Once mode over a socket: two eventless failures of a call open its circuit; its next
    frame is held through the cooldown, and the ledger fails (locked, full, deleted, replaced
    by an older copy) while it is held and stays so as the cooldown ends, at its recovery
    claim. The held call gets one answer (the recovered events, or, the claim unwritable, an
    ``error`` event with a numeric status, never a hang); then, the fault over, its retry on a
    new socket and its POST fallback are answered: the operation is recovered exactly once
    upstream, nothing is left in flight and no hook raised."""
    with ledger_folder(tmp_path, kind) as folder, MockUpstream(tmp_path, EVENTLESS_TWICE) as up:
        ledger = folder / "ledger.sqlite3"
        opts = dict(turnguard_ledger=str(ledger), turnguard_hold_timeout_ms=20000,
                    turnguard_cooldown_ms=ONCE_COOLDOWN_MS,
                    turnguard_recovery_mode="server_anchored_replay_once")
        with guarded(tmp_path, up, "a", **opts) as a:
            text = f"once mode in a ledger fault {kind}"
            frame = call([user(text)], seed=1)
            _fail_twice(tmp_path, a, text)
            wait_until(lambda: not in_flight(ledger), 10, what="both ends written")
            older_copy(folder)
            held = _held_through_the_cooldown(tmp_path, a, frame)
            with fault(kind, folder):
                got = held.result(40)
                time.sleep(0.5)
            assert got and got[-1]["type"] in ("response.completed", "error"), got
            if got[-1]["type"] == "error":
                assert isinstance(got[-1].get("status"), int), got
            wait_until(lambda: ledger.exists() and not in_flight(ledger), 20,
                       what="nothing in flight once the fault is over")
            again = ws_call(a.url, call([user(text)], seed=4))
            status, how, kinds = http_call(a.url, frame)
            recoveries = [d for d in turnguard_events(tmp_path, "a", "dispatch")
                          if d["kind"] == "recovery"]
            # two failures and one recovery: the held call's, or (it failed closed) its retry's
            assert len(up.dispatches()) == 3, up.dispatches()
            assert len(recoveries) == 1, recoveries
            assert types(again)[-1] == "response.completed", again
            assert status == 200 and how == "replayed" and kinds == types(again), (
                status, how, kinds)
            assert_no_traceback(a.log_text())


@pytest.mark.parametrize("kind", ["none", "locked", "deleted"])
def test_once_mode_a_call_held_through_the_cooldown_and_a_script_reload_in_a_ledger_fault(
        tmp_path, kind):
    """Once mode over a socket: a call's frame is held through its cooldown; the ledger fails
    (write-locked by another connection, or its file deleted) and mitmproxy reloads the
    script while it is held, the fault lasting past the cooldown's end. The instance loaded
    next keeps the hold and answers it once (recovered, or failed closed with a numeric
    status when the claim cannot be written); the retries after the fault (a new socket,
    the POST fallback) get the one recovery: two failures and one recovery upstream, no
    traceback."""
    from test_at_most_once import reloadable, reloaded, touch_to_reload

    script = reloadable(tmp_path)
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path, EVENTLESS_TWICE) as up, guarded(
            tmp_path, up, "a", addon=script, turnguard_hold_timeout_ms=20000,
            turnguard_cooldown_ms=ONCE_COOLDOWN_MS,
            turnguard_recovery_mode="server_anchored_replay_once") as a:
        text = f"once mode, a reload in a ledger fault {kind}"
        frame = call([user(text)], seed=1)
        _fail_twice(tmp_path, a, text)
        wait_until(lambda: not in_flight(ledger), 10, what="both ends written")
        held = _held_through_the_cooldown(tmp_path, a, frame)
        with contextlib.nullcontext() if kind == "none" else fault(kind, tmp_path):
            reloaded(a, touch_to_reload(a, script))
            got = held.result(40)
            time.sleep(0.5)
        assert got and got[-1]["type"] in ("response.completed", "error"), got
        if got[-1]["type"] == "error":
            assert kind != "none" and isinstance(got[-1].get("status"), int), got
        assert a.log_text().count("was held; the addon loaded now decides it") == 1
        wait_until(lambda: ledger.exists() and not in_flight(ledger), 20,
                   what="nothing in flight once the fault is over")
        again = ws_call(a.url, call([user(text)], seed=4))
        status, how, kinds = http_call(a.url, frame)
        assert len(up.dispatches()) == 3, up.dispatches()  # two failures, one recovery
        assert types(again)[-1] == "response.completed", again
        assert status == 200 and kinds == types(again), (status, how, kinds)
        assert not turnguard_events(tmp_path, "a", "hold_abandoned")
        assert_no_traceback(a.log_text())


def test_once_mode_never_spends_the_recovery_on_a_socket_that_left_while_the_proxy_was_paused(
        tmp_path):
    """Once mode over sockets: four sockets send the call while its circuit cools, and all
    are held; the process is paused (SIGSTOP) across the cooldown's end, and three of the
    clients drop their sockets meanwhile. Resumed, turnguard must not give the one recovery
    to a socket that left: the one still open gets the recovered events; one recovery
    dispatch in all."""
    with MockUpstream(tmp_path, EVENTLESS_TWICE) as up, guarded(
            tmp_path, up, "a", turnguard_hold_timeout_ms=20000,
            turnguard_cooldown_ms=ONCE_COOLDOWN_MS,
            turnguard_recovery_mode="server_anchored_replay_once") as a:
        text = "once mode, sockets that left while paused"
        _fail_twice(tmp_path, a, text)

        async def go():
            leaving = []
            for i in range(3):
                c = await WsClient.connect(a.url, headers=HEADERS).__aenter__()
                await c.send(call([user(text)], seed=10 + i))
                leaving.append(c)
                await asyncio.to_thread(wait_until, lambda n=i + 1: len(turnguard_events(
                    tmp_path, "a", "wait_operation_fenced_cooldown")) == n, 10)
            async with WsClient.connect(a.url, headers=HEADERS) as staying:
                await staying.send(call([user(text)], seed=20))
                await asyncio.to_thread(wait_until, lambda: len(turnguard_events(
                    tmp_path, "a", "wait_operation_fenced_cooldown")) == 4, 10)
                a.proc.send_signal(signal.SIGSTOP)
                try:
                    for c in leaving:
                        c.abort()
                    await asyncio.sleep(ONCE_COOLDOWN_MS / 1000 + 0.5)
                finally:
                    a.proc.send_signal(signal.SIGCONT)
                return await staying.response(30)

        got = asyncio.run(go())
        assert types(got)[-1] == "response.completed", got
        assert len(up.dispatches()) == 3  # two failures, one recovery
        assert len(turnguard_events(tmp_path, "a", "recovery_claimed")) == 1
        assert_no_traceback(a.log_text())


@pytest.mark.parametrize("kind", ["deleted", "replaced"])
def test_once_mode_a_ledger_that_goes_while_the_owner_is_paused_across_the_cooldowns_end(
        tmp_path, kind):
    """Once mode over a socket: a call is held through its cooldown by process a; a is paused
    (SIGSTOP), the ledger file is deleted (or an older copy made before the session was
    claimed is moved into its place) and the cooldown ends while a is paused. Resumed, a
    finds the new file at its recovery claim, which has no row of the session: no process
    took it over, so the call is recovered once, not failed closed as ``ownership_lost``."""
    with MockUpstream(tmp_path, EVENTLESS_TWICE) as up, guarded(
            tmp_path, up, "a", turnguard_hold_timeout_ms=20000,
            turnguard_cooldown_ms=ONCE_COOLDOWN_MS,
            turnguard_recovery_mode="server_anchored_replay_once") as a:
        older_copy(tmp_path)
        text = f"once mode, the ledger {kind} while paused"
        _fail_twice(tmp_path, a, text)
        held = _held_through_the_cooldown(tmp_path, a, call([user(text)], seed=1))
        a.proc.send_signal(signal.SIGSTOP)
        try:
            with fault(kind, tmp_path):
                time.sleep(ONCE_COOLDOWN_MS / 1000 + 0.5)
        finally:
            a.proc.send_signal(signal.SIGCONT)
        got = held.result(40)
        assert types(got)[-1] == "response.completed", (
            got, turnguard_events(tmp_path, "a", "fail_closed"))
        assert len(up.dispatches()) == 3  # two failures, the recovery
        assert len(turnguard_events(tmp_path, "a", "recovery_claimed")) == 1
        assert_no_traceback(a.log_text())


@pytest.mark.parametrize("kind,retry_via", [("locked", "ws"), ("deleted", "http")])
def test_a_call_claimed_in_a_ledger_fault_and_handed_over_by_a_reload_holds_its_retry(
        tmp_path, kind, retry_via):
    """A call's frame reaches process a while the ledger is write-locked (decided in memory)
    or just after its file was deleted, and mitmproxy reloads the script while the call
    streams, the fault still on. Once the fault is over the new instance has the call in
    flight in the ledger, so its retry through process b (a new socket, or the POST
    fallback) is held on it and answered from it: one upstream execution, nothing in flight
    after, no traceback."""
    from test_at_most_once import reloadable, reloaded, touch_to_reload

    script = reloadable(tmp_path)
    scenario = {"default": {"kind": "ok", "events": 30, "gap_ms": 250}}
    ledger = tmp_path / "ledger.sqlite3"
    text = f"claimed in a fault {kind}, then a reload"
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, "a", addon=script, **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        ws_call(a.url, call([user("warm")], turn="warm", seed=9))
        wait_until(lambda: not in_flight(ledger), 10, what="the warm-up ended")
        frame = call([user(text)], seed=1)
        with fault(kind, tmp_path):
            original = background(ws_call, a.url, frame)
            op = wait_until(lambda: turnguard_events(tmp_path, "a", "dispatch")[1:], 10,
                            what="a dispatching the call")[0]["op"]
            reloaded(a, touch_to_reload(a, script))
        wait_until(lambda: op_states(ledger, op) == [("in_flight",)], 10,
                   what="the call in flight in the ledger once the fault is over")
        retry = _retry(b, text, frame, retry_via)
        got = original.result(30)
        assert types(got)[-1] == "response.completed", got
        again = retry.result(40)
        assert (types(again) if retry_via == "ws" else again[2]) == types(got), again
        assert len(up.dispatches()) == 2  # the warm-up, the call
        wait_until(lambda: not in_flight(ledger), 20, what="nothing in flight")
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("kind,retry_via", [("locked", "http"), ("full", "ws"),
                                            ("deleted", "ws"), ("replaced", "http")])
def test_a_retry_sent_elsewhere_after_the_call_ended_in_a_ledger_fault_is_answered_once(
        tmp_path, kind, retry_via):
    """A call streams through process a and ends while the ledger fails (locked, full,
    deleted, replaced by an older copy): its end is owed. Its retry then reaches process b,
    which never saw it (a new socket, or the POST fallback), while the fault is still on,
    and the fault ends a moment later. The retry is answered with the call's events, never
    dispatched a second time; nothing in flight after, no traceback."""
    with ledger_folder(tmp_path, kind) as folder, MockUpstream(tmp_path, STREAM) as up:
        ledger = folder / "ledger.sqlite3"
        opts = dict(turnguard_ledger=str(ledger), turnguard_hold_timeout_ms=30000)
        with guarded(tmp_path, up, "a", **opts) as a, guarded(tmp_path, up, "b", **opts) as b:
            ws_call(b.url, call([user("warm")], turn="warm", seed=9))  # b has the file open
            wait_until(lambda: not in_flight(ledger), 10, what="the warm-up ended")
            older_copy(folder)
            text = f"ended in a fault {kind}, retried elsewhere"
            frame, original, op = _call_in_flight(tmp_path, up, a, ledger, text)
            with fault(kind, folder):
                got = original.result(30)
                retry = _retry(b, text, frame, retry_via)
                wait_until(lambda: turnguard_events(tmp_path, "b", "duplicate_held")
                           or turnguard_events(tmp_path, "b", "request_held")
                           or turnguard_events(tmp_path, "b", "dispatch")[1:]
                           or retry.done(), 15, what="b deciding the retry")
                time.sleep(1)
            assert types(got)[-1] == "response.completed", got
            again = retry.result(40)
            assert (types(again) if retry_via == "ws" else again[2]) == types(got), again
            assert len(up.dispatches()) == 2, up.dispatches()  # the warm-up, the call
            wait_until(lambda: ledger.exists() and not in_flight(ledger), 20,
                       what="nothing in flight")
            assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("kind", ["locked", "deleted"])
def test_once_mode_a_detached_recovery_whose_socket_drops_in_a_ledger_fault_is_run_once(
        tmp_path, kind):
    """Once mode with detached calls: a call held through its cooldown is recovered as
    turnguard's own POST; its client drops the socket after the first event, and the ledger
    fails (locked, deleted) meanwhile. The recovery runs on; the call's retry on a new
    socket through the same process attaches to it, and one through process b (the POST
    fallback), sent once the fault is over, is held on it: each gets the whole answer, the
    operation is recovered once upstream, nothing in flight after."""
    scenario = {"sequence": [{"kind": "clean_close"}, {"kind": "clean_close"}],
                "default": {"kind": "ok", "think_ms": 3000, "events": 3}}
    opts = dict(turnguard_detach_ms=30000, turnguard_response_created_timeout_ms=20000,
                turnguard_hold_timeout_ms=20000, turnguard_cooldown_ms=ONCE_COOLDOWN_MS,
                turnguard_recovery_mode="server_anchored_replay_once")
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        text = f"a detached recovery in a fault {kind}"
        frame = call([user(text)], seed=1)
        # detached, a failure reaches the socket as an error event
        _fail_twice(tmp_path, a, text, ends=("closed", "error"))

        async def drop():
            async with WsClient.connect(a.url, headers=HEADERS) as c:
                await c.send(frame)
                first = json.loads(await c.recv(20))
                with fault(kind, tmp_path):
                    c.abort()
                    await asyncio.sleep(1)
                return first

        first = asyncio.run(drop())
        assert first["type"] == "response.created", first
        [claim] = turnguard_events(tmp_path, "a", "recovery_claimed")
        wait_until(lambda: op_states(ledger, claim["op"]) == [("in_flight",)], 10,
                   what="the recovery in flight in the ledger once the fault is over")
        elsewhere = background(http_call, b.url, frame)
        here = ws_call(a.url, call([user(text)], seed=4))
        assert types(here)[-1] == "response.completed" and here[0] == first, here
        status, _, kinds = elsewhere.result(30)
        assert status == 200 and kinds == types(here), (status, kinds)
        assert len(up.dispatches()) == 3  # two failures, the recovery
        wait_until(lambda: ledger.exists() and not in_flight(ledger), 20, what="nothing in flight")
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("kind", ["locked", "full", "junk"])
def test_once_mode_retries_elsewhere_at_the_cooldowns_end_in_a_ledger_fault_recover_once(
        tmp_path, kind):
    """Once mode across two processes: process a holds a call through its cooldown; the
    ledger fails (write-locked, its disk full, or replaced by a file that is no database)
    and stays so past the cooldown's end, while the call's retries reach process b (a new
    socket, and the POST fallback) and a (a new socket). Without a writable ledger no one
    may spend the one recovery blind: every answer is one (events, or an error event /
    status with a number), and once the fault is over a retry through b is recovered, or
    replayed: two failures and at most one recovery upstream."""
    with ledger_folder(tmp_path, "full" if kind == "full" else "locked") as folder, \
            MockUpstream(tmp_path, EVENTLESS_TWICE) as up:
        ledger = folder / "ledger.sqlite3"
        opts = dict(turnguard_ledger=str(ledger), turnguard_hold_timeout_ms=20000,
                    turnguard_cooldown_ms=ONCE_COOLDOWN_MS,
                    turnguard_recovery_mode="server_anchored_replay_once")
        with guarded(tmp_path, up, "a", **opts) as a, guarded(tmp_path, up, "b", **opts) as b:
            text = f"once mode, retries elsewhere in a fault {kind}"
            frame = call([user(text)], seed=1)
            _fail_twice(tmp_path, a, text)
            wait_until(lambda: not in_flight(ledger), 10, what="both ends written")
            held = background(ws_call, a.url, frame)
            opened = wait_until(lambda: turnguard_events(
                tmp_path, "a", "wait_operation_fenced_cooldown"), 10, what="the call held")
            if kind == "junk":
                ctx = contextlib.nullcontext()
                replace_with_junk(ledger)
            else:
                ctx = fault(kind, folder)
            with ctx:
                time.sleep(max(0.0, opened[0]["ts"] + ONCE_COOLDOWN_MS / 1000 + 0.3
                               - time.time()))
                answers = [ws_call(b.url, call([user(text)], seed=5)),
                           http_call(b.url, frame),
                           ws_call(a.url, call([user(text)], seed=6))]
                got = held.result(40)
            if kind == "junk":
                delete_ledger(ledger)
            for x in [got, answers[0], answers[2]]:
                assert x and (x[-1]["type"] == "response.completed" or isinstance(
                    x[-1].get("status"), int)), x
            assert answers[1][0] in (200, 503), answers[1]
            assert len(up.dispatches()) <= 3, up.dispatches()  # 2 failures, 1 recovery
            wait_until(lambda: turnguard_events(tmp_path, "b", "ledger_recovered")
                       or not turnguard_events(tmp_path, "b", "ledger_unavailable"), 20,
                       what="b's ledger back")
            wait_until(lambda: turnguard_events(tmp_path, "a", "ledger_recovered")
                       or not turnguard_events(tmp_path, "a", "ledger_unavailable"), 20,
                       what="a's ledger back")
            last = ws_call(b.url, call([user(text)], seed=7))
            assert types(last)[-1] == "response.completed", last
            assert len(up.dispatches()) == 3, up.dispatches()
            assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("retry_via", ["ws", "http"])
def test_a_retry_sent_elsewhere_while_the_owner_is_paused_as_the_ledger_goes_is_not_run_again(
        tmp_path, retry_via):
    """A call streams through process a; a is paused (SIGSTOP) and the ledger file is deleted
    while it is paused, so a cannot register the call in the new file; the call's retry then
    reaches process b (a new socket, or the POST fallback), and a stays paused past the 5 s
    b waits for the processes that had turns in flight in the old file. a is alive (a pause
    is no death: README, a live process's turn never runs twice): b holds the retry until a
    registers the call, never dispatches it a second time; resumed, a completes the call and
    b answers the retry from it. One upstream execution."""
    scenario = {"default": {"kind": "ok", "events": 40, "gap_ms": 200}}
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=40000)
    text = f"the owner paused as the ledger goes, via {retry_via}"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        ws_call(b.url, call([user("warm b")], turn="warm", seed=9))  # b has the file open
        frame, original, op = _call_in_flight(tmp_path, up, a, ledger, text)
        a.proc.send_signal(signal.SIGSTOP)
        try:
            delete_ledger(ledger)
            retry = _retry(b, text, frame, retry_via)
            time.sleep(8)  # past b's 5 s wait for the peers to register
            assert len(up.dispatches()) == 2, "b ran the paused owner's call a second time"
        finally:
            a.proc.send_signal(signal.SIGCONT)
        got = original.result(40)
        assert types(got)[-1] == "response.completed", got
        again = retry.result(40)
        assert (types(again) if retry_via == "ws" else again[2]) == types(got), again
        assert len(up.dispatches()) == 2  # b's warm-up, and the call once
        assert_no_traceback(a.log_text() + b.log_text())


def test_a_retry_held_for_a_paused_owner_past_its_hold_bound_is_told_to_retry_not_run_again(
        tmp_path):
    """As above, with a hold bound (2 s) shorter than the owner's pause: the POST fallback
    sent to b while the owner a is paused and the ledger file is gone gets 409
    ``turn_in_progress`` at its bound (the call is running in a live process), never a
    second dispatch; after the pause the call completes and the retry is replayed."""
    scenario = {"default": {"kind": "ok", "events": 40, "gap_ms": 200}}
    ledger = tmp_path / "ledger.sqlite3"
    text = "the owner paused past a retry's hold bound"
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, "a", turnguard_hold_timeout_ms=40000) as a, \
            guarded(tmp_path, up, "b", turnguard_hold_timeout_ms=2000) as b:
        ws_call(b.url, call([user("warm b")], turn="warm", seed=9))  # b has the file open
        frame, original, op = _call_in_flight(tmp_path, up, a, ledger, text)
        a.proc.send_signal(signal.SIGSTOP)
        try:
            delete_ledger(ledger)
            status, how, _ = http_call(b.url, frame)
            assert (status, how) == (409, "turn_in_progress"), (status, how)
            assert len(up.dispatches()) == 2, "b ran the paused owner's call a second time"
        finally:
            a.proc.send_signal(signal.SIGCONT)
        got = original.result(40)
        assert types(got)[-1] == "response.completed", got
        wait_until(lambda: op_states(ledger, op) == [("completed",)], 20, what="the call's end")
        status, how, kinds = http_call(b.url, frame)
        assert (status, how, kinds) == (200, "replayed", types(got)), (status, how, kinds)
        assert len(up.dispatches()) == 2  # b's warm-up, and the call once
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("kind", ["locked", "full", "replaced"])
def test_retries_through_the_same_process_of_a_call_claimed_in_a_ledger_fault_are_answered_once(
        tmp_path, kind):
    """A call's frame reaches process a while the ledger fails (locked, full, or replaced by
    an older copy as the frame comes); while the fault is still on, its retries reach the
    same process (a new socket, and the POST fallback): they attach to the call or are held
    on it, and get its events; once the fault is over nothing stays in flight. One upstream
    execution, no traceback."""
    scenario = {"default": {"kind": "ok", "events": 16, "gap_ms": 200}}
    with ledger_folder(tmp_path, kind) as folder, MockUpstream(tmp_path, scenario) as up:
        ledger = folder / "ledger.sqlite3"
        opts = dict(turnguard_ledger=str(ledger), turnguard_hold_timeout_ms=20000)
        with guarded(tmp_path, up, "a", **opts) as a:
            ws_call(a.url, call([user("warm")], turn="warm", seed=9))
            wait_until(lambda: not in_flight(ledger), 10, what="the warm-up ended")
            older_copy(folder)
            text = f"same-process retries in a fault {kind}"
            frame = call([user(text)], seed=1)
            with fault(kind, folder):
                original = background(ws_call, a.url, frame)
                wait_until(lambda: turnguard_events(tmp_path, "a", "dispatch")[1:], 10,
                           what="a dispatching the call")
                retries = [background(ws_call, a.url, call([user(text)], seed=2)),
                           background(http_call, a.url, frame)]
                got = original.result(30)
                again, (status, _, kinds) = retries[0].result(30), retries[1].result(30)
                time.sleep(0.5)
            assert types(got)[-1] == "response.completed", got
            assert again == got, again
            assert status == 200 and kinds == types(got), (status, kinds)
            assert len(up.dispatches()) == 2  # the warm-up, the call
            wait_until(lambda: ledger.exists() and not in_flight(ledger), 20,
                       what="nothing in flight")
            assert_no_traceback(a.log_text())


def test_a_retry_held_for_a_paused_owner_across_a_script_reload_is_not_run_again(tmp_path):
    """As above, and mitmproxy reloads the script of process b while it holds the retry (the
    owner a paused, the ledger file gone, a's call not yet registered in the new file). The
    instance loaded next must not take the retry for a new turn: it goes on holding it until
    a registers the call, then answers it from it. One upstream execution."""
    from test_at_most_once import reloadable, reloaded, touch_to_reload

    script = reloadable(tmp_path)
    scenario = {"default": {"kind": "ok", "events": 40, "gap_ms": 200}}
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=40000)
    text = "the owner paused, the holder reloaded"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", addon=script, **opts) as b:
        ws_call(b.url, call([user("warm b")], turn="warm", seed=9))  # b has the file open
        frame, original, op = _call_in_flight(tmp_path, up, a, ledger, text)
        a.proc.send_signal(signal.SIGSTOP)
        try:
            delete_ledger(ledger)
            retry = _retry(b, text, frame, "http")
            wait_until(lambda: turnguard_events(tmp_path, "b", "request_held"), 10,
                       what="b holding the retry for a")
            reloaded(b, touch_to_reload(b, script))
            time.sleep(2)
            assert len(up.dispatches()) == 2, "b ran the paused owner's call a second time"
        finally:
            a.proc.send_signal(signal.SIGCONT)
        got = original.result(40)
        assert types(got)[-1] == "response.completed", got
        status, _, kinds = retry.result(40)
        assert status == 200 and kinds == types(got), (status, kinds)
        assert len(up.dispatches()) == 2  # b's warm-up, and the call once
        assert_no_traceback(a.log_text() + b.log_text())


def a_call_with_steps(step: str) -> dict:
    """A scenario whose call (after a's warm-up) sends 10 events 300 ms apart, its first
    byte 1.5 s after its claim for the step "claimed"."""
    return after_warm_ups(1, {"default": {"kind": "ok", "events": 10, "gap_ms": 300,
                                          "delay_ms": 1500 if step == "claimed" else 0}})


def call_run_to(step: str, up, a, ledger, frame: str):
    """The call ``frame`` sent through a and let run to ``step``: just after its claim, after
    its first event (in the ledger), just before its end, or after it. Its future."""
    original = background(ws_call, a.url, frame)
    wait_until(lambda: len(up.dispatches()) == 2, 10, what="the call dispatched")
    if step in ("first event", "before its end"):
        wait_for_a_first_event(ledger, "the call's first event")
        if step == "before its end":
            time.sleep(2.6)  # (its last event about 3 s after its first)
    elif step == "after its end":
        original.result(30)
    return original


def retrying(text: str, frame: str):
    """What sends retries of the call ``frame`` through proxies: for each, one on a new
    socket (another seed: the frame Codex would send again) and one as the POST fallback."""
    seeds = iter(range(2, 40))

    def through(*proxies) -> list:
        return [r for proxy in proxies for r in (
            background(ws_call, proxy.url, call([user(text)], seed=next(seeds))),
            background(http_call, proxy.url, frame))]
    return through


def each_got_the_call(retries: list, original) -> None:
    """The call completed, and each retry (``retrying``'s, in its order) got its events: on
    a socket, the same kinds; as the POST fallback, replayed or attached."""
    got = original.result(30)
    assert types(got)[-1] == "response.completed", got
    for n, retry in enumerate(retries):
        again = retry.result(45)
        if n % 2 == 0:
            assert types(again) == types(got), (n, again)
        else:
            status, how, kinds = again
            assert status == 200 and how in ("replayed", "attached") \
                and kinds == types(got), (n, again)


@pytest.mark.parametrize("kind", ["locked", "full", "read-only"])
@pytest.mark.parametrize("step", ["claimed", "first event", "before its end", "after its end"])
def test_a_ledger_that_cannot_be_written_at_a_step_of_a_call_answers_every_retry_from_one_execution(
        tmp_path, kind, step):
    """The ledger is locked, its disk full or its files read-only for 2.5 s from a step of a
    call through process a: just after its claim, after its first event, just before its
    end, or after it. Retries of the call (a new socket, and the POST fallback) through a and
    b during the fault (both read the ledger: the call is in flight there, or ended) and 0.4 s
    after it get the call's events; one upstream execution; nothing in flight once the
    writes the fault kept are written."""
    scenario = a_call_with_steps(step)
    with two_warm_processes(tmp_path, kind, scenario) as (folder, ledger, up, a, b):
        text = f"the ledger {kind} at a step of a call: {step}"
        frame = call([user(text)], seed=1)
        original = call_run_to(step, up, a, ledger, frame)
        retries_through = retrying(text, frame)
        with fault(kind, folder):
            retries = retries_through(a, b)
            time.sleep(2.5)
        time.sleep(0.4)
        retries += retries_through(a, b)
        each_got_the_call(retries, original)
        assert len(up.dispatches()) == 2, "the call ran twice upstream"  # (and the warm-up)
        assert [e["ledger"] for e in turnguard_events(tmp_path, "a", "dispatch")] == [True, True]
        wait_until(lambda: not ledger_query(
            ledger, "SELECT 1 FROM attempts WHERE outcome='in_flight'"), 15,
            what="the call's end written")
        assert_no_traceback(a.log_text() + b.log_text())


@pytest.mark.parametrize("step, junk_s, then", [
    ("claimed", 1.5, "deleted"),
    ("first event", 1.5, "deleted"),
    ("before its end", 1.5, "deleted"),
    ("after its end", 1.5, "deleted"),
    ("first event", 6.0, "deleted"),
    ("before its end", 1.5, "replaced"),
])
def test_junk_over_the_ledger_at_a_step_of_a_call_answers_every_retry_from_one_execution(
        tmp_path, step, junk_s, then):
    """A file that is no database is moved over the ledger (its -wal and -shm left beside it)
    at a step of a call through process a: just after its claim, after its first event, just
    before its end, or after it. It stays ``junk_s`` (past REOPEN_S: 6 s), then is deleted,
    or an older copy of the ledger (taken before the call) is moved in its place. Retries of
    the call (a new socket, and the POST fallback) through a during the junk, through b
    during it while the call is in flight (b read from the old file that a had it in flight),
    and through a and b 0.4 s after the junk went get the call's events; one upstream
    execution; nothing in flight once its end is written. (A call that ended before the junk
    came is retried through b only after it: during it b, which never read its end, decides
    in memory.)"""
    scenario = a_call_with_steps(step)
    with two_warm_processes(tmp_path, "junk", scenario) as (folder, ledger, up, a, b):
        older_copy(folder)
        text = f"junk {step} of a call for {junk_s} s, then {then}"
        frame = call([user(text)], seed=1)
        original = call_run_to(step, up, a, ledger, frame)
        in_flight_at_junk = not original.done()
        replace_with_junk(ledger)
        retries_through = retrying(text, frame)
        retries = retries_through(a)
        if in_flight_at_junk:
            wait_until(lambda: turnguard_events(tmp_path, "b", "ledger_unavailable"), 10,
                       what="b finding the ledger replaced")
            retries += retries_through(b)
        time.sleep(junk_s)
        if then == "deleted":
            delete_ledger(ledger)
        else:
            replace_with_older_copy(folder)
        time.sleep(0.4)
        retries += retries_through(a, b)
        each_got_the_call(retries, original)
        assert len(up.dispatches()) == 2, "the call ran twice upstream"  # (and the warm-up)
        assert turnguard_events(tmp_path, "a", "ledger_unavailable")  # the junk was met
        # (the call claimed in the ledger before the junk came)
        assert [e["ledger"] for e in turnguard_events(tmp_path, "a", "dispatch")] == [True, True]
        wait_until(lambda: ledger.exists() and not ledger_query(
            ledger, "SELECT 1 FROM attempts WHERE outcome='in_flight'"), 15,
            what="the call's end written")
        assert_no_traceback(a.log_text() + b.log_text())



def _completed_through_a(tmp_path, up, a, b, frame, *, older_copy_first: bool = False):
    """Both processes warmed up (b has the ledger file open), then ``frame``'s call completed
    through a and its end in the ledger (``older_copy_first``: an older copy of the ledger
    made before that call). The call's events, and the upstream's dispatches before it."""
    ws_call(a.url, call([user("warm a")], turn="warm", seed=9))
    ws_call(b.url, call([user("warm b")], turn="warm", seed=8))
    if older_copy_first:
        older_copy(tmp_path)
    upstream_had = len(up.dispatches())
    got = ws_call(a.url, frame)
    assert types(got)[-1] == "response.completed", got
    op = turnguard_events(tmp_path, "a", "dispatch")[-1]["op"]
    wait_until(lambda: op_states(tmp_path / "ledger.sqlite3", op) == [("completed",)], 20,
               what="the call's end")
    return got, upstream_had


@pytest.mark.parametrize("retry_via", ["ws", "http"])
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_call_that_completed_before_the_ledger_went_under_a_paused_owner_is_not_run_again(
        tmp_path, how, retry_via):
    """A call completes through process a (its recording in the ledger, within its replay
    window); a is paused (SIGSTOP) and the ledger file is deleted, or an older copy made
    before the call is moved into its place, so a cannot record the call in the new file. A
    retry of the call then reaches process b (a new socket, or the POST fallback), and a
    stays paused past the 5 s b waits for the processes that had turns in the old file. a is
    alive: b holds the retry until a records its recordings in the new file, never
    dispatches the call a second time; resumed, a does, and b replays it."""
    scenario = after_warm_ups(2, {"default": {"kind": "ok", "events": 5, "gap_ms": 100}})
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=40000)
    text = f"completed, then the ledger {how} under its paused owner, via {retry_via}"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        frame = call([user(text)], seed=1)
        got, upstream_had = _completed_through_a(tmp_path, up, a, b, frame, older_copy_first=True)
        a.proc.send_signal(signal.SIGSTOP)
        try:
            if how == "deleted":
                delete_ledger(ledger)
            else:
                replace_with_older_copy(tmp_path)
            retry = _retry(b, text, frame, retry_via)
            time.sleep(8)  # past b's 5 s wait for the peers to register
            assert len(up.dispatches()) == upstream_had + 1, \
                "b ran the paused owner's completed call a second time"
        finally:
            a.proc.send_signal(signal.SIGCONT)
        again = retry.result(40)
        assert (types(again) if retry_via == "ws" else again[2]) == types(got), again
        assert len(up.dispatches()) == upstream_had + 1
        assert_no_traceback(a.log_text() + b.log_text())


def _response_id(events: list[dict]) -> str | None:
    return next((e["response"].get("id") for e in events if isinstance(e.get("response"), dict)),
                None)


def test_a_conversations_next_turn_sent_elsewhere_while_its_owner_is_paused_runs_as_its_own(
        tmp_path):
    """A turn of a Responses ``conversation`` completes through process a (its recording in
    the ledger); so does one of another conversation, whose next turn (the same body: the
    conversation upstream changed with the turn before) then streams through a. a is paused
    (SIGSTOP) and the ledger file is deleted. The first conversation's next turn reaches
    process b, and so does a retry of the second's turn in flight. b holds both for its 5 s
    wait for the processes that had turns in the old file; then it runs the next turn
    upstream as its own (never answered from the turn before, nor held for a to its hold
    bound), while the retry stays held until a resumes and is answered from the turn it
    retries (not from the turn before it, and not run again): one upstream execution of
    each turn."""
    scenario = after_warm_ups(2, {"default": {"kind": "ok", "events": 8, "gap_ms": 150}})
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=40000)
    turn_text, call_text = "yes", "the other conversation's turn, the next in flight as a pauses"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        turn = call([user(turn_text)], seed=1, conversation="conv_1")
        got, upstream_had = _completed_through_a(tmp_path, up, a, b, turn)
        before = ws_call(a.url, call([user(call_text)], seed=5, conversation="conv_2"))
        assert types(before)[-1] == "response.completed", before
        op = turnguard_events(tmp_path, "a", "dispatch")[-1]["op"]
        wait_until(lambda: op_states(ledger, op) == [("completed",)], 20, what="its end")
        original = background(ws_call, a.url, call([user(call_text)], seed=3,
                                                   conversation="conv_2"))
        wait_until(lambda: op_states(ledger, op) == [("in_flight",)], 20, what="its next turn")
        wait_for_a_first_event(ledger, "the other conversation's next turn")
        a.proc.send_signal(signal.SIGSTOP)
        try:
            delete_ledger(ledger)
            retry = background(ws_call, b.url, call([user(call_text)], seed=4,
                                                    conversation="conv_2"))
            next_turn = ws_call(b.url, call([user(turn_text)], seed=2, conversation="conv_1"))
            assert types(next_turn) == types(got), next_turn
            assert _response_id(next_turn) != _response_id(got), "the turn before's answer"
            # held for the peers alone: no duplicate, and not counted as one when it goes on
            assert not turnguard_events(tmp_path, "b", "duplicate_forwarded")
            assert len(up.dispatches()) == upstream_had + 4  # and the other conversation's two
        finally:
            a.proc.send_signal(signal.SIGCONT)
        first = original.result(40)
        assert types(first)[-1] == "response.completed", first
        again = retry.result(40)
        assert (types(again), _response_id(again)) == (types(first), _response_id(first)), again
        assert _response_id(first) != _response_id(before)
        assert len(up.dispatches()) == upstream_had + 4, "the turn in flight ran twice"
        assert_no_traceback(a.log_text() + b.log_text())


def test_a_retry_of_a_conversations_turn_in_flight_in_another_host_is_not_run_again_as_its_next(
        tmp_path):
    """A turn of a Responses ``conversation`` completes through process a (its recording in
    the ledger); its next turn (the same body) then streams through process c, in a pid
    namespace of its own (another host: never proven alive). a is paused (SIGSTOP) and the
    ledger file deleted: the file left shows the operation recorded in a live peer, a, and in
    flight in c. A retry of the turn in flight reaches process b, which holds it for its 5 s
    wait for the processes that had turns in the old file (a stays paused); the turn ends in
    c meanwhile. The retry came while that turn ran: it is its duplicate, answered from it,
    never run a second time as the conversation's next turn."""
    prefix = another_host_prefix()
    scenario = after_warm_ups(3, {"default": {"kind": "ok", "events": 8, "gap_ms": 150}})
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=40000)
    text = "yes, and the next turn goes through another host"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b, \
            guarded(tmp_path, up, "c", prefix=prefix, **opts) as c:
        ws_call(c.url, call([user("warm c")], turn="warm", seed=7))
        turn = call([user(text)], seed=1, conversation="conv_1")
        before, upstream_had = _completed_through_a(tmp_path, up, a, b, turn)
        original = background(ws_call, c.url, call([user(text)], seed=2, conversation="conv_1"))
        wait_for_a_first_event(ledger, "the next turn's first event in c")
        a.proc.send_signal(signal.SIGSTOP)
        try:
            delete_ledger(ledger)
            retry = background(ws_call, b.url, call([user(text)], seed=3,
                                                    conversation="conv_1"))
            first = original.result(40)
            assert types(first)[-1] == "response.completed", first
            wait_until(lambda: turnguard_events(tmp_path, "b", "request_held"), 10,
                       what="the retry held for the peers")
            time.sleep(6)  # past b's 5 s wait for the peers to register
        finally:
            a.proc.send_signal(signal.SIGCONT)
        again = retry.result(40)
        assert (types(again), _response_id(again)) == (types(first), _response_id(first)), again
        assert _response_id(first) != _response_id(before)
        assert len(up.dispatches()) == upstream_had + 2, "the turn in flight in c ran twice"
        assert_no_traceback(a.log_text() + b.log_text() + c.log_text())


@pytest.mark.parametrize("ran_in", ["b", "another host"])
def test_a_conversations_next_turn_held_for_the_peers_where_its_turn_before_ran_runs_as_its_own(
        tmp_path, ran_in):
    """A turn of a Responses ``conversation`` completes through process b (its recording
    b's own), or through process c, in a pid namespace of its own (another host: never
    proven alive); process a, which completed a call of its own, is paused (SIGSTOP) and the
    ledger file deleted, so b waits 5 s for a to register its turns in the new file. The
    conversation's next turn (the same body) reaches b meanwhile: held for the peers, it
    came after the turn before ended (b recorded it, or the file left showed c's
    recording), so it then runs upstream as its own, never answered from the turn before."""
    prefix = another_host_prefix() if ran_in == "another host" else None
    scenario = after_warm_ups(3, {"default": {"kind": "ok", "events": 5, "gap_ms": 100}})
    ledger = tmp_path / "ledger.sqlite3"
    text = f"yes, the turn before ran in {ran_in}"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a") as a, \
            guarded(tmp_path, up, "b") as b, guarded(tmp_path, up, "c", prefix=prefix) as c:
        ws_call(a.url, call([user("warm a")], turn="warm", seed=9))
        ws_call(b.url, call([user("warm b")], turn="warm", seed=8))
        ws_call(c.url, call([user("warm c")], turn="warm", seed=7))
        upstream_had = len(up.dispatches())
        owner = b if ran_in == "b" else c
        before = ws_call(owner.url, call([user(text)], seed=1, conversation="conv_1"))
        assert types(before)[-1] == "response.completed", before
        op = turnguard_events(tmp_path, owner.name, "dispatch")[-1]["op"]
        wait_until(lambda: op_states(ledger, op) == [("completed",)], 20, what="its end")
        a.proc.send_signal(signal.SIGSTOP)
        try:
            delete_ledger(ledger)
            next_turn = ws_call(b.url, call([user(text)], seed=2, conversation="conv_1"))
        finally:
            a.proc.send_signal(signal.SIGCONT)
        assert turnguard_events(tmp_path, "b", "request_held"), "not held for the peers"
        assert types(next_turn) == types(before), next_turn
        assert _response_id(next_turn) != _response_id(before), "the turn before's answer"
        assert len(up.dispatches()) == upstream_had + 2
        assert_no_traceback(a.log_text() + b.log_text() + c.log_text())


def test_a_retry_of_a_conversations_next_turn_claimed_in_the_new_file_is_not_run_again(tmp_path):
    """A turn of a Responses ``conversation`` completes through process a (its recording in
    the ledger); a is paused (SIGSTOP), and so is b for the first 3 s after the ledger file is
    deleted, so b starts its 5 s wait for the processes that had turns in the old file about
    3 s after process c starts its own. The conversation's next turn (the same body), sent to
    c, runs once c's wait is over (claimed in the new file); a retry of it reaches b while it
    streams, and is held there for b's wait, which outlasts the turn (then for a, the paused
    owner of the turn before's recording, until it resumes). The retry came while the turn
    ran: it is answered from it, never run a second time as the conversation's next turn."""
    scenario = after_warm_ups(3, {"default": {"kind": "ok", "events": 8, "gap_ms": 150}})
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=40000)
    text = "yes, claimed in the new file while b still waits"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b, guarded(tmp_path, up, "c", **opts) as c:
        ws_call(c.url, call([user("warm c")], turn="warm", seed=7))
        turn = call([user(text)], seed=1, conversation="conv_1")
        before, upstream_had = _completed_through_a(tmp_path, up, a, b, turn)
        a.proc.send_signal(signal.SIGSTOP)
        b.proc.send_signal(signal.SIGSTOP)
        try:
            delete_ledger(ledger)
            dispatched = len(turnguard_events(tmp_path, "c", "dispatch"))
            original = background(ws_call, c.url, call([user(text)], seed=2,
                                                        conversation="conv_1"))
            time.sleep(3)
            b.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: len(turnguard_events(tmp_path, "c", "dispatch")) > dispatched, 20,
                       what="the next turn dispatched by c")
            retry = background(ws_call, b.url, call([user(text)], seed=3,
                                                    conversation="conv_1"))
            first = original.result(40)
            assert types(first)[-1] == "response.completed", first
            time.sleep(6)  # past b's 5 s wait for the peers to register
            assert len(up.dispatches()) == upstream_had + 2, "the next turn ran twice"
        finally:
            b.proc.send_signal(signal.SIGCONT)
            a.proc.send_signal(signal.SIGCONT)
        again = retry.result(40)
        assert turnguard_events(tmp_path, "b", "request_held"), "the retry not held for the peers"
        assert (types(again), _response_id(again)) == (types(first), _response_id(first)), again
        assert _response_id(first) != _response_id(before)
        assert len(up.dispatches()) == upstream_had + 2, "the next turn ran twice"
        assert_no_traceback(a.log_text() + b.log_text() + c.log_text())


def test_a_call_a_paused_owner_completed_past_its_replay_window_is_not_held_for_it(tmp_path):
    """A call completes through process a; a is paused (SIGSTOP) and the ledger file
    deleted. Its same body sent to b once the replay window (2 s) has passed since it
    completed is a new operation (its recording answers it nowhere): b, which holds a retry
    of a call the paused a completed until a records it in the new file, does not hold this
    one past its 5 s wait for the peers, nor answer it at its hold bound: it dispatches it,
    as it would have with the file in place."""
    scenario = after_warm_ups(2, {"default": {"kind": "ok", "events": 5, "gap_ms": 100}})
    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=15000, turnguard_replay_window_ms=2000)
    text = "completed, then the ledger deleted under its paused owner, then past the window"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        got, upstream_had = _completed_through_a(tmp_path, up, a, b, call([user(text)], seed=1))
        a.proc.send_signal(signal.SIGSTOP)
        try:
            delete_ledger(ledger)
            time.sleep(2.5)  # the replay window passes
            again = ws_call(b.url, call([user(text)], seed=2))
            assert types(again) == types(got), again
            assert len(up.dispatches()) == upstream_had + 2
        finally:
            a.proc.send_signal(signal.SIGCONT)
        assert_no_traceback(a.log_text() + b.log_text())


def _ledger_of_many_ended_attempts(ledger, attempts: int) -> None:
    """A ledger file at ``ledger`` holding ``attempts`` attempts of a process long gone, all
    ended without a recording (what a ledger that served a while mostly holds)."""
    now = time.time()
    made = Ledger(str(ledger), "filler")  # the schema, as the addon makes it
    made.open(now, register=False)
    made.close()
    db = sqlite3.connect(ledger)
    db.execute("INSERT INTO operations (op_key, scope, method, path, fingerprint, state,"
               " created_at, updated_at) VALUES ('filler', 's', 'POST', '/v1/responses', 'f',"
               " 'completed', ?, ?)", (now, now))
    db.executemany("INSERT INTO attempts (op_key, kind, instance_id, started_at, ended_at,"
                   " outcome) VALUES ('filler', 'original', 'gone', ?, ?, 'completed')",
                   ((now, now) for _ in range(attempts)))
    db.commit()
    db.close()


def test_a_completed_call_of_a_paused_owner_is_not_run_again_when_a_large_ledger_goes(tmp_path):
    """As above (the ledger deleted under process a, paused, after a call completed through
    it), with a ledger of 1,200,000 attempts that ended long ago without a recording. b reads
    which processes had turns in flight or recordings in the file left within 0.2 s of its
    event loop: read through the partial indexes of the attempts in flight and of the
    recordings, never a scan of every attempt, so the read is done in time, b knows a had
    the call, and holds its retry until a records it in the new file: never run twice."""
    ledger = tmp_path / "ledger.sqlite3"
    _ledger_of_many_ended_attempts(ledger, 1_200_000)
    scenario = after_warm_ups(2, {"default": {"kind": "ok", "events": 5, "gap_ms": 100}})
    opts = dict(turnguard_hold_timeout_ms=40000)
    text = "completed, then a large ledger deleted under its paused owner"
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        got, upstream_had = _completed_through_a(tmp_path, up, a, b, call([user(text)], seed=1))
        a.proc.send_signal(signal.SIGSTOP)
        try:
            delete_ledger(ledger)
            retry = background(ws_call, b.url, call([user(text)], seed=2))
            time.sleep(8)  # past b's 5 s wait for the peers to register
            assert len(up.dispatches()) == upstream_had + 1, \
                "b ran the paused owner's completed call a second time"
        finally:
            a.proc.send_signal(signal.SIGCONT)
        assert types(retry.result(40)) == types(got)
        assert len(up.dispatches()) == upstream_had + 1
        assert_no_traceback(a.log_text() + b.log_text())
