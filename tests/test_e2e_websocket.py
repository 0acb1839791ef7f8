"""End to end: the guard on Codex's default transport, Responses over WebSocket, through a real
mitmdump + turnguard in front of the real mock upstream speaking the same transport."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import (ADDON, REPO, LoopbackServer, Mitmdump, MockUpstream, assert_no_traceback,
                     guarded, ledger_query, parse_sse, sse_post, turnguard_events, wait_until)
from turnguard_shell.websocket import MAX_QUEUED_FRAMES
import turnguard_ws  # noqa: E402 - harness puts scripts/ on sys.path
from turnguard_ws import Closed, WsClient, types  # noqa: E402
from test_at_most_once import (break_script, reloadable, reloaded, slow_workers,
                               touch_to_reload)

SESSION = "01a22e73-8c1f-7fc3-8961-844f4a263337"
HEADERS = {"authorization": "Bearer sk-ws-test", "session-id": SESSION}
COOLDOWN_MS = 2500
LONG_COOLDOWN_MS = 60000  # for a test that must still be inside the cooldown at its end


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def call(items: list, *, turn: str = "turn-1", seed: int = 0, **extra) -> dict:
    """A ``response.create`` frame as Codex sends it: keys in a random order, a new start-ms."""
    meta = {"turn_id": turn, "session_id": SESSION, "x-codex-window-id": f"{SESSION}:0",
            "x-codex-ws-stream-request-start-ms": str(1796075676393 + seed),
            "ws_request_header_x_openai_internal_codex_responses_lite": "true"}
    frame = {"type": "response.create", "model": "gpt-test", "stream": True, "input": items,
             "tool_choice": "auto", "parallel_tool_calls": False, "store": False,
             "prompt_cache_key": SESSION, "client_metadata": meta, **extra}
    rnd = random.Random(seed)
    keys = list(frame)
    rnd.shuffle(keys)
    return {k: frame[k] for k in keys}


def post_fallback(frame: dict) -> dict:
    """The HTTP POST Codex falls back to: the frame without its WebSocket-only fields."""
    body = {k: v for k, v in frame.items() if k != "type"}
    body["client_metadata"] = {k: v for k, v in frame["client_metadata"].items()
                               if k != "x-codex-ws-stream-request-start-ms"
                               and not k.startswith("ws_request_header_")}
    return body


PREWARM = {"type": "response.create", "model": "gpt-test", "input": [], "generate": False,
           "client_metadata": {"turn_id": "", "session_id": SESSION}}


def ws_dispatches(up: MockUpstream) -> list[dict]:
    return [r for r in up.dispatches() if r.get("transport") == "ws"]


def events(tmp_path, kind=None):
    return turnguard_events(tmp_path, "mitmdump", kind)


def proxy(tmp_path, up, **options):
    return guarded(tmp_path, up, **{"turnguard_cooldown_ms": COOLDOWN_MS, **options})


async def one_call(url: str, frame: dict, *, prewarm: bool = False) -> list[dict]:
    async with WsClient.connect(url, headers=HEADERS) as c:
        if prewarm:
            await c.send(PREWARM)
            assert types(await c.response()) == ["response.created", "response.completed"]
        await c.send(frame)
        return await c.response()


def test_a_call_goes_upstream_once_and_its_events_are_relayed(tmp_path):
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        got = asyncio.run(one_call(p.url, call([user("hi")]), prewarm=True))
        assert types(got)[0] == "response.created" and types(got)[-1] == "response.completed"
        assert len(ws_dispatches(up)) == 1  # the prewarm is no dispatch
        dispatch = events(tmp_path, "dispatch")
        assert [(d["transport"], d["kind"]) for d in dispatch] == [("ws", "original")]
        outcome = wait_until(lambda: events(tmp_path, "outcome"), what="outcome")
        assert outcome[0]["outcome"] == "completed" and outcome[0]["replayable"] is True
        assert outcome[0]["transport"] == "ws"
        ledger = tmp_path / "ledger.sqlite3"  # the end is committed just after its telemetry
        wait_until(lambda: ledger_query(ledger, "SELECT transport, outcome FROM attempts") == [
            ("ws", "completed")], what="the attempt's end in the ledger")
        shown = subprocess.run([str(REPO / "scripts" / "ledger"), "--ledger", str(ledger),
                                "show", outcome[0]["op"]], capture_output=True, text=True,
                               timeout=60)
        assert shown.returncode == 0 and "transport:" in shown.stdout, shown.stderr
        assert [line.split()[-1] for line in shown.stdout.splitlines()
                if line.strip().startswith("transport:")] == ["ws"]
        assert_no_traceback(p.log_text())


def test_two_sockets_sending_the_same_call_make_one_dispatch(tmp_path):
    """Same session, turn and input; another key order and start-ms: the second is held until
    the first one's response starts, then attached to it: it gets the same events."""
    # the first call's answer waits (before its first event) until the second is held: order,
    # not a second sent within a 1.5 s delay
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "hold": "first"}}) as up, \
            proxy(tmp_path, up) as p:
        async def both():
            first = asyncio.create_task(one_call(p.url, call([user("hi")], seed=1)))
            await asyncio.to_thread(up.wait_held, "first", 30)
            second = asyncio.create_task(one_call(p.url, call([user("hi")], seed=2)))
            try:
                await asyncio.to_thread(wait_until, lambda: events(tmp_path, "duplicate_held")
                                        or second.done(), 30, what="the second call held")
            finally:
                await asyncio.to_thread(up.release, "first")
            return await first, await second

        first, second = asyncio.run(both())
        assert len(ws_dispatches(up)) == 1
        assert first == second and types(first)[-1] == "response.completed"
        assert [e["transport"] for e in events(tmp_path, "duplicate_held")] == ["ws"]
        assert [e["transport"] for e in events(tmp_path, "duplicate_attached")] == ["ws"]


def test_a_duplicate_call_attaches_and_gets_the_events_live(tmp_path, report):
    """The first call streams (the mock holds it after four events, its first delta among
    them, until the duplicate has attached: order, not a duplicate sent 1 s into a 3 s
    stream); the same call on another socket gets the events so far at once and the rest as
    they come (its first event comes before the first call's last)."""
    slow = {"default": {"kind": "ok", "events": 10, "hold": "first", "hold_after_events": 4}}
    with MockUpstream(tmp_path, slow) as up, proxy(tmp_path, up) as p:
        async def timed(c):
            got, first = [], None
            while not got or got[-1].get("type") not in ("response.completed", "response.failed"):
                got.append(json.loads(await c.recv()))
                first = first or loop.time()
            return got, first, loop.time()

        async def both():
            async with WsClient.connect(p.url, headers=HEADERS) as a, \
                    WsClient.connect(p.url, headers=HEADERS) as b:
                await a.send(call([user("long")], seed=1))
                original = asyncio.create_task(timed(a))
                await asyncio.to_thread(up.wait_held, "first", 30)
                sent = loop.time()
                await b.send(call([user("long")], seed=2))
                dup = asyncio.create_task(timed(b))
                try:
                    await asyncio.to_thread(wait_until, lambda: events(
                        tmp_path, "duplicate_attached") or dup.done(), 30,
                        what="the duplicate attached")
                finally:
                    await asyncio.to_thread(up.release, "first")
                return await original, await dup, sent

        loop = asyncio.new_event_loop()
        (first, _, first_end), (second, second_first, _), sent = loop.run_until_complete(both())
        loop.close()
        assert len(ws_dispatches(up)) == 1
        assert first == second and types(first)[-1] == "response.completed"
        assert second_first < first_end, "the duplicate's first event must come live"
        assert [e["transport"] for e in events(tmp_path, "duplicate_attached")] == ["ws"]
        assert_no_traceback(p.log_text())
    report(f"WebSocket attach: a duplicate call sent while the stream was held after four events "
           f"got its first event after "
           f"{round((second_first - sent) * 1000)} ms, all {len(second)} events identical; "
           f"upstream dispatches={len(ws_dispatches(up))}")


def test_a_completed_call_is_replayed_on_a_new_socket_and_to_its_post_fallback(tmp_path):
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        frame = call([user("hi")], seed=1)
        first = asyncio.run(one_call(p.url, frame))
        again = asyncio.run(one_call(p.url, call([user("hi")], seed=9)))
        assert again == first and len(ws_dispatches(up)) == 1
        status, headers, body = sse_post(p.url, body=post_fallback(frame),
                                         headers={**HEADERS, "accept": "text/event-stream"})
        assert status == 200 and headers.get("x-turnguard") == "replayed"
        assert [data for _, data in parse_sse(body)] == first
        assert len(up.dispatches()) == 1
        replayed = events(tmp_path, "duplicate_replayed")
        assert [r["transport"] for r in replayed] == ["ws", "http"]


def test_a_call_without_stream_is_never_replayed_as_events_to_a_post_that_asked_for_json(
        tmp_path):
    """A call on a socket is answered with events whatever its ``stream`` says (events are all
    that transport has): it is the POST that asks for an event stream. The same body POSTed
    without ``"stream": true`` asks for one JSON response object: another answer, so another
    operation, never the socket's events replayed."""
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        frame = call([user("hi")], seed=1)
        del frame["stream"]
        first = asyncio.run(one_call(p.url, frame))
        assert types(first)[-1] == "response.completed"
        status, headers, body = sse_post(p.url, body=post_fallback(frame),
                                         headers={**HEADERS, "accept": "application/json"})
        assert status == 200 and headers.get("x-turnguard") != "replayed"
        assert headers.get("content-type", "").startswith("application/json")
        assert json.loads(body)["status"] == "completed"
        assert len(up.dispatches()) == 2
        # the POST that does ask for events is the socket's call: replayed, not run again
        status, headers, body = sse_post(p.url, body={**post_fallback(frame), "stream": True},
                                         headers={**HEADERS, "accept": "text/event-stream"})
        assert status == 200 and headers.get("x-turnguard") == "replayed"
        assert [data for _, data in parse_sse(body)] == first
        assert len(up.dispatches()) == 2


def test_a_call_answered_over_http_is_replayed_on_a_socket(tmp_path):
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        frame = call([user("hi")], seed=3)
        status, _, body = sse_post(p.url, body=post_fallback(frame),
                                   headers={**HEADERS, "accept": "text/event-stream"})
        assert status == 200
        got = asyncio.run(one_call(p.url, frame))
        assert got == [data for _, data in parse_sse(body)]
        assert len(up.dispatches()) == 1
        assert ledger_query(tmp_path / "ledger.sqlite3", "SELECT transport FROM attempts") == [
            ("http",)]


@pytest.mark.parametrize("how", ["replayed", "attached"])
def test_what_an_http_stream_sent_after_its_end_is_not_the_next_calls_on_a_socket(
        tmp_path, how):
    """An upstream that sends the terminal event once more, late, inside an HTTP response
    (the first terminal event decides: it completed). A socket answered from that attempt
    (replayed from its recording, or attached to it live) gets its events up to its end and
    no further: the late one, sent on the socket after the response's end, would be read by
    the client as the answer to its next call."""
    # attached: the mock holds the POST after two events until the socket's call attached
    # (order, not a socket that had to come within a stream of 150 ms gaps)
    hold = {"hold": "post", "hold_after_events": 2} if how == "attached" else {}
    scenario = {"sequence": [{"kind": "ok", "after_completed": "repeat_terminal", **hold}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        frame = call([user("hi")], seed=3)

        def post() -> list[dict]:
            status, _, body = sse_post(p.url, body=post_fallback(frame),
                                       headers={**HEADERS, "accept": "text/event-stream"})
            assert status == 200
            return [data for _, data in parse_sse(body)]

        async def on_a_socket():
            posted = None
            if how == "attached":
                posted = asyncio.create_task(asyncio.to_thread(post))
                await asyncio.to_thread(up.wait_held, "post", 30)  # its first events came
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(frame)
                if how == "attached":
                    try:
                        await asyncio.to_thread(wait_until, lambda: events(
                            tmp_path, "duplicate_attached") or len(up.dispatches()) > 1, 30,
                            what="the socket's call attached")
                    finally:
                        await asyncio.to_thread(up.release, "post")
                first = await c.response()
                await c.send(call([user("next")], seed=4))
                return first, await c.response(), posted and await posted

        posted = post() if how == "replayed" else None
        first, second, attached_post = asyncio.run(on_a_socket())
        posted = posted or attached_post
        assert [e["type"] for e in posted][-2:] == ["response.completed"] * 2  # (the HTTP body)
        assert first == posted[:-1]
        ids = {e["response"]["id"] for e in second if "response" in e}
        assert types(second)[0] == "response.created" and ids.isdisjoint(
            {e["response"]["id"] for e in first})  # the next call's own response
        assert len(up.dispatches()) == 2
        assert len(events(tmp_path, f"duplicate_{how}")) == 1
        assert_no_traceback(p.log_text())


def test_a_delta_after_a_replayed_response_goes_upstream_with_its_full_input(tmp_path):
    """The upstream never saw the replayed response: a ``previous_response_id`` naming it is
    never forwarded as is (the mock, like the API, would not know it)."""
    scenario = {"sequence": [{"kind": "tool_call", "name": "exec"}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        first_items = [user("run it")]
        first = asyncio.run(one_call(p.url, call(first_items, seed=1)))
        tool_call = next(e["item"] for e in first if e["type"] == "response.output_item.done")
        rid = first[-1]["response"]["id"]

        async def replay_then_follow_up():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(call(first_items, seed=2))  # a new socket: full resend
                replayed = await c.response()
                output = {"type": "function_call_output", "call_id": tool_call["call_id"],
                          "output": "done"}
                await c.send(call([output], seed=3, previous_response_id=rid))
                return replayed, await c.response()

        replayed, follow_up = asyncio.run(replay_then_follow_up())
        assert replayed == first
        assert types(follow_up)[-1] == "response.completed"
        sent = ws_dispatches(up)
        assert len(sent) == 2
        assert sent[1]["previous_response_id"] is None and sent[1]["input_items"] == 3
        assert len(events(tmp_path, "ws_full_input_sent")) == 1


@pytest.mark.parametrize("strings", ["first", "delta", "both"])
def test_a_delta_whose_input_is_a_string_after_a_replayed_response_goes_with_its_full_input(
        tmp_path, strings):
    """The API takes a string for ``input`` (one user message): a call or a delta made so is
    remembered and rebuilt as one made of items, so a delta naming a response turnguard
    replayed never goes upstream as is (where it is unknown: 400
    ``previous_response_not_found``)."""
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        first_input = "say hi" if strings in ("first", "both") else [user("say hi")]
        first = asyncio.run(one_call(p.url, call(first_input, seed=1)))
        rid = first[-1]["response"]["id"]

        async def replay_then_follow_up():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(call(first_input, seed=2))  # a new socket: replayed
                replayed = await c.response()
                delta = "go on" if strings in ("delta", "both") else [user("go on")]
                await c.send(call(delta, seed=3, previous_response_id=rid))
                return replayed, await c.response()

        replayed, follow_up = asyncio.run(replay_then_follow_up())
        assert replayed == first and types(follow_up)[-1] == "response.completed"
        sent = ws_dispatches(up)
        assert len(sent) == 2 and sent[1]["previous_response_id"] is None
        assert sent[1]["input_items"] == 3  # the first call's message, its answer, the delta
        assert events(tmp_path, "ws_unknown_previous_response") == []


def test_a_delta_on_the_socket_that_produced_its_response_is_sent_as_a_delta(tmp_path):
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        async def turn():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(call([user("one")], seed=1))
                first = await c.response()
                await c.send(call([user("two")], seed=2,
                                  previous_response_id=first[-1]["response"]["id"]))
                return await c.response()

        assert types(asyncio.run(turn()))[-1] == "response.completed"
        sent = ws_dispatches(up)
        assert [s["input_items"] for s in sent] == [1, 1]
        assert sent[1]["previous_response_id"] is not None
        assert events(tmp_path, "ws_full_input_sent") == []


def as_codex_resends(item: dict, turn: str) -> dict:
    """An output item as the Codex CLI (0.171.0, measured through turnguard) puts it back in
    the full input of a resend: the upstream's item with Codex's own bookkeeping added."""
    return {**item, "internal_chat_message_metadata_passthrough": {"turn_id": turn}}


def test_a_follow_up_delta_and_its_full_resend_on_a_new_socket_are_one_operation(tmp_path):
    """A tool call's follow-up goes on the socket as a delta (``previous_response_id`` + the
    tool's output); its resend on a new socket carries the full input, the tool call among it
    as Codex keeps it in its history (with its ``internal_chat_message_metadata_passthrough``).
    The two are one operation: the resend is replayed the follow-up's events, not run again."""
    scenario = {"sequence": [{"kind": "tool_call", "name": "exec"}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        first_items = [user("run it")]

        async def turn():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(call(first_items, seed=1))
                first = await c.response()
                tool_call = next(e["item"] for e in first
                                 if e["type"] == "response.output_item.done")
                output = {"type": "function_call_output", "call_id": tool_call["call_id"],
                          "output": "done"}
                await c.send(call([output], seed=2,
                                  previous_response_id=first[-1]["response"]["id"]))
                return tool_call, output, await c.response()

        tool_call, output, follow_up = asyncio.run(turn())
        assert types(follow_up)[-1] == "response.completed"
        assert len(ws_dispatches(up)) == 2
        resend = call([*first_items, as_codex_resends(tool_call, "turn-1"), output], seed=3)
        assert asyncio.run(one_call(p.url, resend)) == follow_up  # replayed
        assert len(ws_dispatches(up)) == 2
        assert len(events(tmp_path, "duplicate_replayed")) == 1
        assert_no_traceback(p.log_text())


def test_eventless_failures_open_the_circuit_and_the_socket_gets_a_503_event(tmp_path):
    scenario = {"sequence": [{"kind": "clean_close"}, {"kind": "reset"}],
                "default": {"kind": "ok"}}
    # (a cooldown the test never waits out: the fenced call must come while it lasts, and with
    # COOLDOWN_MS a client descheduled for 2.5 s on a busy machine came after it and was sent)
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, turnguard_cooldown_ms=LONG_COOLDOWN_MS) as p:
        frame = call([user("hi")])
        for _ in range(2):
            got = asyncio.run(one_call(p.url, frame))
            assert got[-1]["type"] == "closed"
        wait_until(lambda: len(events(tmp_path, "eventless_failure")) == 2, what="2 failures")
        fenced = asyncio.run(one_call(p.url, frame))
        assert types(fenced) == ["error"]
        assert fenced[0]["status"] == 503
        assert fenced[0]["error"]["code"] == "upstream_request_timeout"
        assert len(ws_dispatches(up)) == 2
        classes = [e["failure_class"] for e in events(tmp_path, "eventless_failure")]
        assert classes == ["upstream_ws_closed", "upstream_ws_closed"]


def test_once_mode_holds_a_call_through_the_cooldown_then_recovers_it_once(tmp_path):
    scenario = {"sequence": [{"kind": "clean_close"}, {"kind": "clean_close"}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once") as p:
        frame = call([user("hi")])
        for _ in range(2):
            assert asyncio.run(one_call(p.url, frame))[-1]["type"] == "closed"
        wait_until(lambda: len(events(tmp_path, "eventless_failure")) == 2, what="2 failures")
        recovered = asyncio.run(one_call(p.url, frame))
        assert types(recovered)[-1] == "response.completed"
        sent = ws_dispatches(up)
        assert len(sent) == 3
        assert sent[2]["ts"] - sent[1]["ts"] >= COOLDOWN_MS / 1000 * 0.9  # none in the cooldown
        assert [d["kind"] for d in events(tmp_path, "dispatch")] == ["original", "retry",
                                                                    "recovery"]
        assert len(events(tmp_path, "wait_operation_fenced_cooldown")) == 1


def test_an_error_event_without_output_counts_as_eventless_and_a_4xx_as_rejected(tmp_path):
    scenario = {"sequence": [{"kind": "status", "code": 503}, {"kind": "status", "code": 429}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        first = asyncio.run(one_call(p.url, call([user("a")])))
        second = asyncio.run(one_call(p.url, call([user("b")])))
        assert [first[0]["status"], second[0]["status"]] == [503, 429]  # relayed as they came
        outcomes = wait_until(lambda: (o := events(tmp_path, "outcome"))[1:] and o, what="2")
        assert [o["outcome"] for o in outcomes] == ["unknown", "rejected"]
        failures = events(tmp_path, "eventless_failure")
        assert [f["failure_class"] for f in failures] == ["upstream_error_event"]
        assert len(up.dispatches()) == 2


def test_a_silent_upstream_is_cut_after_the_response_created_timeout(tmp_path):
    scenario = {"sequence": [{"kind": "stall_before_headers", "ms": 30000}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, turnguard_response_created_timeout_ms=800) as p:
        got = asyncio.run(one_call(p.url, call([user("hi")])))
        assert got[-1]["type"] == "closed"
        failure = wait_until(lambda: events(tmp_path, "eventless_failure"), what="failure")
        assert failure[0]["failure_class"] == "missing_response_created_timeout"
        assert events(tmp_path, "upstream_cut")[0]["cut"] is True
        assert len(up.dispatches()) == 1


def test_a_proxy_paused_past_the_response_created_timeout_keeps_the_call_that_came(tmp_path):
    """The proxy is paused (SIGSTOP) right after it sent a call; the upstream answers it whole
    within the response-created timeout. Resumed, the overdue timer must not cut what came
    meanwhile (cut, the call ran upstream and is lost; its retry runs it again)."""
    scenario = {"sequence": [{"kind": "ok", "delay_ms": 700, "events": 3}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, turnguard_response_created_timeout_ms=1200) as p:
        with ThreadPoolExecutor(max_workers=1) as pool:
            got = pool.submit(lambda: asyncio.run(one_call(p.url, call([user("hi")]))))
            up.wait_for_record(lambda r: r.get("event") == "dispatch", 20)
            os.kill(p.pid, signal.SIGSTOP)
            try:
                end = up.wait_for_record(lambda r: r.get("event") == "dispatch_end", 10)
                assert end["outcome"] == "completed"
                time.sleep(3)  # past the 1.2 s timeout
            finally:
                os.kill(p.pid, signal.SIGCONT)
            assert types(got.result(30))[-1] == "response.completed"
        assert not events(tmp_path, "upstream_cut")
        assert types(asyncio.run(one_call(p.url, call([user("hi")], seed=1))))[-1] == \
            "response.completed"
        assert len(ws_dispatches(up)) == 1  # the retry was replayed, not run again
        assert_no_traceback(p.log_text())


def test_a_client_that_leaves_while_held_ends_the_hold(tmp_path):
    # the first call's answer waits (before its first event) until the duplicate's hold ended:
    # order, not a duplicate sent within a 2.5 s delay
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "hold": "first"}}) as up, \
            proxy(tmp_path, up) as p:
        async def leave_while_held():
            first = asyncio.create_task(one_call(p.url, call([user("hi")], seed=1)))
            try:
                await asyncio.to_thread(up.wait_held, "first", 30)
                c = await WsClient.connect(p.url, headers=HEADERS)
                await c.send(call([user("hi")], seed=2))
                await asyncio.to_thread(wait_until, lambda: events(tmp_path, "duplicate_held"),
                                        what="the hold")
                c.abort()
                await asyncio.to_thread(wait_until, lambda: events(tmp_path, "hold_abandoned"),
                                        what="the hold ended by the client's leaving")
            finally:
                await asyncio.to_thread(up.release, "first")
            return await first

        assert types(asyncio.run(leave_while_held()))[-1] == "response.completed"
        abandoned = wait_until(lambda: events(tmp_path, "hold_abandoned"), what="abandoned")
        assert abandoned[0]["reason"] in ("websocket closed", "client disconnected")
        assert len(up.dispatches()) == 1
        assert all(f["failure_class"] != "client_abort"
                   for f in events(tmp_path, "eventless_failure"))


def test_hostile_frames_pass_through_untouched(tmp_path):
    hostile = [b"\x00\xff binary", "not json", "[1, 2]", '{"type": "response.cancel"}',
               '{"type": "response.create", "type": "x"}', "{" * 5000, "[" * 100_000,
               json.dumps({"type": "response.create", "input": "x" * (2 << 20)})]
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        async def send_all():
            answers = []
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                for frame in hostile:
                    await c.send(frame)
                    answers.append(await c.response())
                await c.send(call([user("still guarded")]))
                answers.append(await c.response())
            return answers

        answers = asyncio.run(send_all())
        assert [a[0]["status"] for a in answers[:7]] == [400] * 7  # the mock's own answers
        assert types(answers[7])[-1] == "response.completed"  # a call, however large
        assert types(answers[8])[-1] == "response.completed"
        reasons = [e["reason"] for e in events(tmp_path, "passthrough")]
        assert reasons[:7] == ["binary frame", "frame is not JSON", "frame is not a JSON object",
                               "frame type 'response.cancel' is not response.create",
                               "duplicate keys in JSON frame", "frame is not JSON",
                               "JSON nesting too deep"]
        assert len(ws_dispatches(up)) == 2
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("first", [b"\x00\xff binary", "not json", '{"type": "response.cancel"}',
                                   '{"type": "response.create", "model": "a", "model": "b", '
                                   '"input": [], "stream": true}'])
def test_a_call_right_behind_a_frame_that_is_no_call_gets_its_own_answer(tmp_path, first):
    """A frame turnguard does not follow, with a call sent right behind it on the socket: the
    upstream's answer to that frame is not taken for the call's (the call completes and is
    recorded with its own events: its retry on a new socket is replayed them, not run again)."""
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        async def pipelined():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(first)
                await c.send(call([user("run me once")], seed=1))
                return await c.response(), await c.response()

        _, answered = asyncio.run(pipelined())
        assert types(answered)[-1] == "response.completed"
        dispatched = len(ws_dispatches(up))
        retried = asyncio.run(one_call(p.url, call([user("run me once")], seed=5)))
        assert retried == answered  # the call's own events, replayed
        assert len(ws_dispatches(up)) == dispatched
        assert [o["outcome"] for o in events(tmp_path, "outcome")] == ["completed"]
        assert len(events(tmp_path, "duplicate_replayed")) == 1
        assert_no_traceback(p.log_text())


def masked_frame(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    """A client's WebSocket frame (masked) built by hand: any opcode, FIN or not, any payload
    (a fragment of a text message may end inside a character)."""
    key, n = os.urandom(4), len(payload)
    head = bytes([(0x80 if fin else 0) | opcode]) + (
        bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
        if n < 65536 else bytes([0x80 | 127]) + n.to_bytes(8, "big"))
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def test_a_call_sent_in_fragments_with_a_ping_between_them_is_guarded_whole(tmp_path):
    """A call sent as a text frame and two continuation frames, a ping between them, the
    message cut inside a character: the upstream gets it whole (the same bytes), the ping is
    answered, and the call is guarded as one: its retry on a new socket, sent whole, is
    replayed."""
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        frame = call([user("déjà vu")], seed=1)
        data = json.dumps(frame, ensure_ascii=False).encode()
        cut = data.index("é".encode()) + 1  # inside the two bytes of é

        async def fragmented():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                c._writer.write(masked_frame(1, data[:cut], fin=False)
                                + masked_frame(9, b"are you there")
                                + masked_frame(0, data[cut:cut + 40], fin=False)
                                + masked_frame(0, data[cut + 40:]))
                await c._writer.drain()
                return await c.response()

        got = asyncio.run(fragmented())
        assert types(got)[-1] == "response.completed"
        sent = ws_dispatches(up)
        assert [s["body_sha256"] for s in sent] == [hashlib.sha256(data).hexdigest()]
        assert asyncio.run(one_call(p.url, call([user("déjà vu")], seed=2))) == got
        assert len(ws_dispatches(up)) == 1
        assert len(events(tmp_path, "duplicate_replayed")) == 1
        assert "pong" in p.log_text().lower()
        assert_no_traceback(p.log_text())


def test_a_client_that_queues_too_many_frames_is_let_go_with_its_frames_in_order(tmp_path):
    """More frames queued behind a response in flight than turnguard keeps: the socket is let
    go, and every frame goes upstream untouched in the order sent, none ahead of the queue."""
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 1500}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        frames = [call([user(f"frame {i}")], seed=i) for i in range(MAX_QUEUED_FRAMES + 6)]

        async def flood():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                for frame in frames:
                    await c.send(frame)
                return [await c.response() for _ in frames]

        answers = asyncio.run(flood())
        assert all(types(a)[-1] == "response.completed" for a in answers)
        index = {hashlib.sha256(json.dumps(f).encode()).hexdigest(): i for i, f in enumerate(frames)}
        assert [index[d["body_sha256"]] for d in ws_dispatches(up)] == list(range(len(frames)))
        assert any("frames queued" in e["reason"] for e in events(tmp_path, "passthrough"))
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("why", ["frames queued", "budget", "frames queued, then a reload"])
def test_a_socket_let_go_while_its_call_runs_upstream_never_runs_it_twice(tmp_path, why):
    """A socket is let go while its call runs upstream (its client queued more frames than
    turnguard keeps behind it, or one frame waited past the request budget): its frames go on
    untouched from then, but the call goes on too. Its response is still read to its end
    (also by the instance a script reload loads meanwhile): the same call held on another
    socket is answered from it, never run again, and the let-go is no eventless failure for
    the circuit."""
    options = {"turnguard_request_budget_ms": 2000} if why == "budget" else {}
    script = reloadable(tmp_path)
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "hold": "run"}}) as up, \
            proxy(tmp_path, up, addon=script, **options) as p:
        async def both():
            async with WsClient.connect(p.url, headers=HEADERS) as a:
                await a.send(call([user("run me once")], seed=1))
                await asyncio.to_thread(up.wait_held, "run", 30)
                for _ in range(MAX_QUEUED_FRAMES + 6 if why != "budget" else 1):
                    await a.send({"type": "keepalive"})
                await asyncio.to_thread(
                    wait_until, lambda: [e for e in events(tmp_path, "passthrough")
                                         if "frames queued" in e["reason"]
                                         or "within turnguard_request_budget_ms" in e["reason"]],
                    30, what="the socket let go")
                if why.endswith("reload"):  # the followed call's end is the new instance's
                    await asyncio.to_thread(lambda: reloaded(p, touch_to_reload(p, script)))
                async with WsClient.connect(p.url, headers=HEADERS) as b:
                    await b.send(call([user("run me once")], seed=2))
                    try:
                        await asyncio.to_thread(  # (or run again: a failure, told below)
                            wait_until, lambda: events(tmp_path, "duplicate_held")
                            or len(ws_dispatches(up)) > 1, 30, what="the same call held")
                    finally:
                        await asyncio.to_thread(up.release, "run")
                    return await a.response(), await b.response()

        first, second = asyncio.run(both())
        assert types(first)[-1] == "response.completed" and first == second
        assert len(ws_dispatches(up)) == 1
        assert [o["outcome"] for o in events(tmp_path, "outcome")] == ["completed"]
        assert events(tmp_path, "eventless_failure") == [] and events(tmp_path, "duplicate_forwarded") == []
        assert_no_traceback(p.log_text())


def test_a_continuation_after_partial_output_is_a_new_operation(tmp_path):
    """Output that reached the client before a failure is Codex's: its next call carries it in
    the input. That is another operation: dispatched, never answered from the old one."""
    scenario = {"sequence": [{"kind": "partial", "events": 4, "end": "clean_close"}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        first = asyncio.run(one_call(p.url, call([user("hi")], seed=1)))
        assert first[-1] == {"type": "closed", "code": 1011}
        said = {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "hel"}]}
        then = asyncio.run(one_call(p.url, call([user("hi"), said], seed=2)))
        assert types(then)[-1] == "response.completed"
        assert len(ws_dispatches(up)) == 2
        outcomes = [o["outcome"] for o in events(tmp_path, "outcome")]
        assert outcomes == ["partial", "completed"]
        dispatched = events(tmp_path, "dispatch")
        assert [d["kind"] for d in dispatched] == ["original", "original"]
        assert dispatched[0]["op"] != dispatched[1]["op"]
        assert events(tmp_path, "duplicate_held") == []


def test_a_held_call_holds_up_nothing_else(tmp_path):
    """While a duplicate waits on one socket, another socket's call, and the next frame of a
    socket that sends two calls back to back, are answered."""
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "delay_ms": 300}}) as up, \
            proxy(tmp_path, up) as p:
        # the first dispatch waits (before its first event) until the test releases it: the
        # duplicate is held all along, however slowly the rest comes
        up.set_scenario({"sequence": [{"kind": "ok", "hold": "slow"}],
                         "default": {"kind": "ok", "delay_ms": 100}})

        async def meanwhile():
            slow = asyncio.create_task(one_call(p.url, call([user("slow")], seed=1)))
            try:
                await asyncio.to_thread(up.wait_held, "slow", 30)
                held = asyncio.create_task(one_call(p.url, call([user("slow")], seed=2)))
                await asyncio.to_thread(wait_until, lambda: events(tmp_path, "duplicate_held")
                                        or held.done(), 30, what="the duplicate held")
                async with WsClient.connect(p.url, headers=HEADERS) as c:
                    await c.send(call([user("a")]))
                    await c.send(call([user("b")]))  # queued behind the first response
                    a, b = await c.response(), await c.response()
                assert not held.done() and not slow.done()
            finally:
                await asyncio.to_thread(up.release, "slow")
            return a, b, await slow, await held

        a, b, slow, held = asyncio.run(meanwhile())
        assert types(a)[-1] == types(b)[-1] == "response.completed"
        assert a[-1]["response"]["id"] != b[-1]["response"]["id"]
        assert slow == held
        assert len(ws_dispatches(up)) == 3


def test_a_retry_held_past_its_hold_bound_in_another_process_gets_its_error_on_an_open_socket(
        tmp_path, monkeypatch):
    """A call waits upstream (before its first event) through process a; its retry on a new
    socket through process b (same ledger) is held there past ``turnguard_hold_timeout_ms``:
    the socket gets the ``error`` event (status 503, ``turn_in_progress``: what b's telemetry
    records as its 409) and stays open, the next call on it answered; the retry never goes
    upstream. Before, the test client cut each read after its own bound (15 s) and reported
    that silence as the peer's close, 1006: a retry held 15 s looked closed by the proxy. The
    bound is made 1 s here, below the hold bound, so that the old client fails quickly."""
    scenario = {"sequence": [{"kind": "ok", "hold": "first"}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, "a", turnguard_hold_timeout_ms=3000) as a, \
            guarded(tmp_path, up, "b", turnguard_hold_timeout_ms=3000) as b:
        async def held_past_the_bound():
            original = asyncio.create_task(one_call(a.url, call([user("held")], seed=1)))
            try:
                await asyncio.to_thread(up.wait_held, "first", 30)
                async with WsClient.connect(b.url, headers=HEADERS) as c:
                    monkeypatch.setattr(turnguard_ws, "TIMEOUT_S", 1.0)
                    await c.send(call([user("held")], seed=2))
                    retry = await c.response(30)
                    await c.send(call([user("next")], turn="turn-2", seed=3))
                    following = await c.response(30)
            finally:
                await asyncio.to_thread(up.release, "first")
            return retry, following, await original

        retry, following, original = asyncio.run(held_past_the_bound())
        assert [(e["type"], e.get("status"), (e.get("error") or {}).get("code"))
                for e in retry] == [("error", 503, "turn_in_progress")], retry
        assert types(following)[-1] == "response.completed", following
        assert types(original)[-1] == "response.completed", original
        assert len(ws_dispatches(up)) == 2  # the call and the next one: never the retry
        assert [(e["answer_status"], e["code"]) for e in turnguard_events(
            tmp_path, "b", "duplicate_rejected")] == [(409, "turn_in_progress")]
        assert_no_traceback(a.log_text() + b.log_text())


def test_a_call_while_the_ledger_is_locked_is_answered_and_recorded_after(tmp_path):
    """No ledger within the request's budget: the call is decided without it and dispatched
    (it is no duplicate of anything known), and its attempt is in the ledger once it is back,
    with its transport."""
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, turnguard_request_budget_ms=3000) as p:
        asyncio.run(one_call(p.url, call([user("warm")], seed=1)))  # the ledger exists
        db = sqlite3.connect(ledger, timeout=10, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")
        try:
            got = asyncio.run(one_call(p.url, call([user("locked")], seed=2)))
        finally:
            db.execute("ROLLBACK")
            db.close()
        assert types(got)[-1] == "response.completed"
        assert [d["ledger"] for d in events(tmp_path, "dispatch")] == [True, False]
        # the attempt is registered as the lock goes, and its end written after that
        rows = wait_until(lambda: (r := ledger_query(
            ledger, "SELECT transport, outcome FROM attempts ORDER BY attempt_id"))[1:]
            and r[-1][1] != "in_flight" and r,
            timeout=20, what="the attempt recorded, and ended, after the lock")
        assert rows == [("ws", "completed"), ("ws", "completed")]
        assert len(up.dispatches()) == 2


def drop_a_call_while_the_ledger_is_locked(url: str, ledger) -> None:
    """A socket sends a call while another connection holds the ledger's write lock, and
    drops before the call is decided; the lock goes 0.2 s later."""
    db = sqlite3.connect(ledger, timeout=10, isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")

    async def drop():
        c = await WsClient.connect(url, headers=HEADERS)
        await c.send(call([user("dropped while decided")], seed=1))
        await asyncio.sleep(0.1)
        c.abort()
        await asyncio.sleep(0.2)
        db.execute("ROLLBACK")

    try:
        asyncio.run(drop())
    finally:
        db.close()


def test_a_client_that_drops_while_its_call_is_decided_leaves_nothing_in_flight(tmp_path):
    """The ledger is locked when a call arrives, and the client drops its socket before the
    call is decided: the claim made for it is given back (nothing went upstream), so its
    retry on a new socket is dispatched, not held and refused as a turn in progress."""
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, turnguard_hold_timeout_ms=3000) as p:
        asyncio.run(one_call(p.url, call([user("warm")], seed=100)))
        drop_a_call_while_the_ledger_is_locked(p.url, ledger)
        wait_until(lambda: events(tmp_path, "hold_abandoned"), 10, what="the call abandoned")
        retried = asyncio.run(one_call(p.url, call([user("dropped while decided")], seed=2)))
        assert types(retried)[-1] == "response.completed"
        assert len(ws_dispatches(up)) == 2  # the warm-up, and the retry: never the dropped one
        assert wait_until(lambda: not ledger_query(
            ledger, "SELECT 1 FROM operations WHERE state='in_flight'"), 10, what="nothing in flight")
        assert_no_traceback(p.log_text())


def test_a_socket_let_go_while_a_call_is_decided_passes_it_and_every_frame_behind_it(tmp_path):
    """A call's decision waits on a locked ledger while its client sends more frames behind
    it than turnguard queues: the socket is let go, and the call, once decided, goes on
    untouched like every frame behind it (its claim given back): each frame is answered in
    turn, none waits for a request budget, nothing stays in flight."""
    ledger = tmp_path / "ledger.sqlite3"
    behind = MAX_QUEUED_FRAMES + 2
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, turnguard_request_budget_ms=30000) as p:
        asyncio.run(one_call(p.url, call([user("warm")], seed=100)))
        db = sqlite3.connect(ledger, timeout=10, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")

        async def flood():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(call([user("decided late")], seed=1))
                for _ in range(behind):
                    await c.send(PREWARM)
                await asyncio.sleep(1.0)
                db.execute("ROLLBACK")
                return [await c.response(10) for _ in range(behind + 1)]

        try:
            answers = asyncio.run(flood())
        finally:
            db.close()
        assert types(answers[0])[-1] == "response.completed"
        assert all(types(a) == ["response.created", "response.completed"] for a in answers[1:])
        assert wait_until(lambda: not ledger_query(
            ledger, "SELECT 1 FROM operations WHERE state='in_flight'"), 10, what="nothing in flight")
        assert_no_traceback(p.log_text())


def test_a_socket_let_go_while_its_attached_response_streams_gets_one_response_at_a_time(
        tmp_path):
    """A detached call streams to its socket longer than the request budget while the client
    waits with its next call behind it: the socket is let go, the attached response ends there
    with an error event (a numeric status), and only then does the next call's response come;
    never the two interleaved."""
    slow = {"sequence": [{"kind": "ok", "events": 12, "gap_ms": 400}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, slow) as up, proxy(
            tmp_path, up, turnguard_request_budget_ms=2000, turnguard_detach_ms=30000) as p:
        async def pipelined():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(call([user("X")], seed=1))
                await asyncio.sleep(0.1)
                await c.send(call([user("Y")], seed=2))
                first, second = await c.response(20), await c.response(20)
                try:  # nothing of the first comes after the second
                    late = await c.recv(1.5)
                except TimeoutError:
                    late = None
                return first, second, late

        first, second, late = asyncio.run(pipelined())
        assert first[-1]["type"] == "error" and first[-1]["status"] == 502
        assert types(second)[-1] == "response.completed"
        ids = {e["response"]["id"] for e in second if "response" in e}
        assert len(ids) == 1 and not ids & {e["response"]["id"] for e in first if "response" in e}
        assert late is None
        assert any("turnguard_request_budget_ms" in e["reason"]
                   for e in events(tmp_path, "passthrough"))
        assert_no_traceback(p.log_text())


def late_event_after(after_completed: str) -> dict:
    """A scenario whose first call's upstream sends an event of it again, late (the mock's
    ``after_completed``), while the second call waits 1 s for its first event."""
    return {"sequence": [{"kind": "ok", "after_completed": after_completed},
                         {"kind": "ok", "delay_ms": 1000}], "default": {"kind": "ok"}}


async def a_then_b(url: str, reads: int) -> list[list[dict]]:
    """Call A, then call B on the same socket: A's events, then the ``reads`` responses read
    after B was sent (a late event of A's comes first, relayed as the upstream sent it)."""
    async with WsClient.connect(url, headers=HEADERS) as c:
        await c.send(call([user("A")], seed=1))
        out = [await c.response()]
        await c.send(call([user("B")], seed=2))
        for _ in range(reads):
            out.append(await c.response())
        return out


def test_a_late_event_of_a_response_that_ended_is_not_the_next_calls(tmp_path):
    """A misbehaving upstream sends a response's terminal event once more, late, while the
    socket's next call is in flight: it is not taken for that call's end (its retry on a new
    socket is replayed its own events, with its output)."""
    with MockUpstream(tmp_path, late_event_after("repeat_terminal")) as up, \
            proxy(tmp_path, up) as p:
        first, stray, second = asyncio.run(a_then_b(p.url, 2))
        ids = [{e["response"]["id"] for e in r if "response" in e} for r in (first, second)]
        assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1]
        assert stray == first[-1:]
        retried = asyncio.run(one_call(p.url, call([user("B")], seed=3)))
        assert retried == [e for e in second if e["response"]["id"] in ids[1]
                           or "response" not in e]
        assert len(events(tmp_path, "duplicate_replayed")) == 1
        assert_no_traceback(p.log_text())


def test_a_late_output_event_naming_no_response_is_not_the_next_calls(tmp_path):
    """The API's output events name their item, not their response: an upstream that sends a
    response's last ``output_item.done`` once more, late, while the socket's next call waits
    for its first event, must not have it taken for that call's (recorded as its output, its
    retry replayed the other call's message before its own)."""
    with MockUpstream(tmp_path, late_event_after("repeat_output")) as up, \
            proxy(tmp_path, up) as p:
        first, second = asyncio.run(a_then_b(p.url, 1))
        late = second[0]
        assert late["type"] == "response.output_item.done" and "response" not in late
        assert late["item"] == next(e["item"] for e in first
                                    if e["type"] == "response.output_item.done")
        retried = asyncio.run(one_call(p.url, call([user("B")], seed=3)))
        assert retried == second[1:] and len(ws_dispatches(up)) == 2
        assert len(events(tmp_path, "duplicate_replayed")) == 1
        assert_no_traceback(p.log_text())


def test_an_upstream_that_reuses_one_response_id_has_each_call_guarded(tmp_path):
    """Response ids need not be unique (Codex takes any): an upstream that answers every call
    with the same id still has each call's events read as that call's. Not: the second call's
    events were taken for late events of the first (its id had ended), so its attempt never
    ended, the next frame waited the whole request budget, the socket was let go and the
    completed call was counted an eventless failure."""
    scenario = {"default": {"kind": "ok", "response_id": "resp_fixed0000"}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, turnguard_request_budget_ms=3000) as p:
        async def turns():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                for i in range(3):
                    await c.send(call([user(f"turn {i}")], turn=f"t{i}", seed=i))
                    assert types(await c.response())[-1] == "response.completed"

        asyncio.run(turns())
        # no frame waited out the budget: the socket was not let go (a passthrough) and each
        # call's attempt ended as completed
        outcomes = wait_until(lambda: o if len(o := events(tmp_path, "outcome")) == 3 else None,
                              what="three outcomes")
        assert [o["outcome"] for o in outcomes] == ["completed"] * 3
        assert not [e for e in events(tmp_path, "passthrough")]
        again = asyncio.run(one_call(p.url, call([user("turn 1")], turn="t1", seed=9)))
        assert types(again)[-1] == "response.completed" and len(ws_dispatches(up)) == 3
        assert_no_traceback(p.log_text())


def test_a_call_decided_after_its_hook_keeps_its_place_before_the_next_frame(tmp_path):
    """The ledger is write-locked when a call arrives: its decision has to wait, so it goes on
    past the frame's websocket_message hook (the frame dropped meanwhile, sent once decided).
    A prewarm sent right behind it on the same socket needs no ledger, yet it goes upstream
    only after the call (and after the call's response: one at a time), never before."""
    ledger = tmp_path / "ledger.sqlite3"
    first = call([user("first")], seed=3)

    async def call_then_prewarm(url: str, db: sqlite3.Connection):
        async with WsClient.connect(url, headers=HEADERS) as c:
            await c.send(first)
            await c.send(PREWARM)
            await asyncio.sleep(1.0)  # both frames are in; the call still waits for the ledger
            db.execute("ROLLBACK")
            return await c.response(), await c.response()

    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, turnguard_request_budget_ms=5000) as p:
        asyncio.run(one_call(p.url, call([user("warm")], seed=1)))  # the ledger exists
        db = sqlite3.connect(ledger, timeout=10, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")
        try:
            answered = asyncio.run(call_then_prewarm(p.url, db))
        finally:
            if db.in_transaction:
                db.execute("ROLLBACK")
            db.close()
        assert [types(r) for r in answered][1] == ["response.created", "response.completed"]
        assert types(answered[0])[-1] == "response.completed"
        first_sha = hashlib.sha256(json.dumps(first).encode()).hexdigest()
        order = [r.get("body_sha256", r.get("event")) for r in up.records()
                 if r.get("event") == "prewarm" or r.get("transport") == "ws"]
        assert order[-2:] == [first_sha, "prewarm"]


def test_a_script_reload_mid_call_hands_the_socket_and_its_attempt_over(tmp_path):
    """mitmproxy reloads a changed script while a call is in flight on a socket: the new addon
    instance gets the socket's remaining events, records the attempt's end (a retry on a new
    socket is replayed) and guards the socket's next call."""
    script = tmp_path / "reloadable.py"
    script.write_text(
        "# a copy of turnguard's script that the test can touch to make mitmproxy reload it\n"
        f"__file__ = {str(ADDON)!r}\n"
        f"exec(compile(open(__file__).read(), __file__, 'exec'))\n"
    )
    scenario = {"sequence": [{"kind": "ok", "delay_ms": 3000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, addon=script) as p:
        async def reload_mid_call():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(call([user("reloaded")], seed=1))
                await asyncio.to_thread(up.wait_for_record, lambda r: r.get("event") == "dispatch")
                await asyncio.sleep(1.1)  # mitmproxy looks at the script's mtime once a second
                os.utime(script)
                await asyncio.to_thread(wait_until, lambda: p.log_text().count(
                    "turnguard: running") >= 2, 15, what="the script reloaded")
                first = await c.response()
                await c.send(call([user("after the reload")], seed=2))
                return first, await c.response()

        first, after = asyncio.run(reload_mid_call())
        assert types(first)[-1] == types(after)[-1] == "response.completed"
        ledger = tmp_path / "ledger.sqlite3"
        wait_until(lambda: ledger_query(ledger, "SELECT transport, outcome FROM attempts") == [
            ("ws", "completed"), ("ws", "completed")], 10, what="both ends recorded")
        again = asyncio.run(one_call(p.url, call([user("reloaded")], seed=3)))
        assert again == first and len(ws_dispatches(up)) == 2
        assert_no_traceback(p.log_text())


def test_a_call_held_through_a_script_reload_is_answered_by_the_new_instance(tmp_path):
    """A duplicate call held on one socket when mitmproxy reloads the script (its original in
    flight on another) is decided again by the instance loaded next and gets the original's
    events: one upstream dispatch (before, the unload let it go: a 503 error event)."""
    script = reloadable(tmp_path)
    scenario = {"sequence": [{"kind": "ok", "delay_ms": 5000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, addon=script) as p:
        async def held_through_a_reload():
            original = asyncio.create_task(one_call(p.url, call([user("held")], seed=1)))
            await asyncio.to_thread(up.wait_for_record, lambda r: r.get("event") == "dispatch")
            held = asyncio.create_task(one_call(p.url, call([user("held")], seed=2)))
            await asyncio.to_thread(wait_until, lambda: events(tmp_path, "duplicate_held"), 10,
                                    what="the duplicate call held")
            await asyncio.to_thread(reloaded, p, touch_to_reload(p, script))
            return await original, await held

        original, held = asyncio.run(held_through_a_reload())
        assert types(original)[-1] == "response.completed" and held == original
        assert len(ws_dispatches(up)) == 1
        assert p.log_text().count("was held; the addon loaded now decides it") == 1
        assert len(events(tmp_path, "duplicate_held")) == 1
        assert not events(tmp_path, "hold_abandoned")
        assert_no_traceback(p.log_text())


def test_a_call_whose_admission_a_reload_interrupts_is_decided_by_the_new_instance(tmp_path):
    """The WebSocket twin of ``test_at_most_once.py``'s: A owes the ledger an end (its own
    turn completed behind another connection's write lock), its catch-up's write held at
    ``write_gate.py``'s gate, when a duplicate of a call B has in flight (held upstream)
    comes on a socket to A; its admission waits for that catch-up and the script reloads
    meanwhile (``reload_probe.py``). The instance loaded now decides the call from its
    ledger: held, then given B's events; one upstream dispatch (from the unloaded
    instance's memory it was dispatched again)."""
    from test_at_most_once import (gate_state, in_background, reloading_beside_a_peer,
                                   write_lock)

    ledger = tmp_path / "ledger.sqlite3"
    scenario = {"default": {"kind": "ok", "hold": "b"}}
    with MockUpstream(tmp_path, scenario) as up, reloading_beside_a_peer(
            tmp_path, up, turnguard_hold_timeout_ms=30000) as (a, b, gate, probe):
        # A's own turn, in the calls' session (A owns it then), completes behind a lock
        own = in_background(sse_post, a.url, "/v1/responses",
                            {"model": "gpt-test", "input": "A's own turn", "stream": True},
                            {**HEADERS, "x-mock-behaviour": json.dumps(
                                {"kind": "ok", "events": 8, "gap_ms": 100})})
        wait_until(lambda: ledger_query(ledger, "SELECT 1 FROM attempts WHERE events_seen>0"),
                   10, what="A's own turn streaming")
        with write_lock(ledger):
            assert own.result(30)[0] == 200
            wait_until(lambda: turnguard_events(tmp_path, "a", "ledger_unavailable"), 10,
                       what="its end kept")
            (gate / "closed").touch()
            # (under the lock: a try of the write that began before the gate closed gives up
            # behind it at its busy timeout, and the next waits at the gate; released first, it
            # would land as the lock went, never at the gate)
            wait_until(lambda: gate_state(gate)["waiting"] == 1, 10,
                       what="A's catch-up writing the end owed, at the gate")

        async def held_across_the_reload():
            original = asyncio.create_task(one_call(b.url, call([user("held")], seed=1)))
            await asyncio.to_thread(up.wait_held, "b", 30)
            (probe / "reload-when-waiting").write_text(str(gate / "closed"))
            started = a.log_text().count("turnguard: running")
            duplicate = asyncio.create_task(one_call(a.url, call([user("held")], seed=2)))
            await asyncio.to_thread(reloaded, a, started)
            await asyncio.to_thread(
                wait_until, lambda: turnguard_events(tmp_path, "a", "duplicate_held")
                or len(ws_dispatches(up)) > 1 or duplicate.done(), 15,
                what="the duplicate call held, or dispatched")
            await asyncio.to_thread(up.release, "b")
            return await original, await duplicate

        original, duplicate = asyncio.run(held_across_the_reload())
        assert "waits for the catch-up under way" in a.log_text()
        assert len(ws_dispatches(up)) == 1
        assert types(original)[-1] == "response.completed" and duplicate == original
        assert a.log_text().count("the addon loaded now decides it") == 1
        assert gate_state(gate)["returned"] == 1  # A's end owed, written once
        assert_no_traceback(a.log_text() + b.log_text())


async def sent_then_unloaded(c: WsClient, up: MockUpstream, proxy: Mitmdump, script,
                             text: str) -> str:
    """Send a call (seed 1) on ``c``, wait for its dispatch upstream, then ``break_script``
    (off the loop): the call goes on with no turnguard instance loaded. The good text."""
    await c.send(call([user(text)], seed=1))
    await asyncio.to_thread(up.wait_for_record, lambda r: r.get("event") == "dispatch")
    return await asyncio.to_thread(break_script, proxy, script)


def restore_script(proxy: Mitmdump, script, good: str) -> int:
    """Put the good text back and wait for it to load; where the log was then (what came
    after it has no traceback of the failed load)."""
    log = proxy.log_text()
    time.sleep(1.1)
    script.write_text(good)
    reloaded(proxy, log.count("turnguard: running"))
    return len(log)


def test_a_call_that_ends_with_its_socket_while_a_reload_failed_is_replayed_on_a_new_one(
        tmp_path):
    """A call in flight completes, and its socket closes, while a reload to a script that does
    not load leaves no instance: the next instance that loads reads the events it missed and
    records the call completed, so its retry on a new socket is replayed (before, the call
    stayed in flight in the process: the retry was held, then answered with a 409 event)."""
    script = reloadable(tmp_path)
    scenario = {"sequence": [{"kind": "ok", "delay_ms": 6000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, addon=script, turnguard_hold_timeout_ms=3000) as p:
        async def ends_while_unloaded():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                good = await sent_then_unloaded(c, up, p, script, "ends unseen")
                return await c.response(), good

        first, good = asyncio.run(ends_while_unloaded())
        assert types(first)[-1] == "response.completed"
        restored = restore_script(p, script, good)
        again = asyncio.run(one_call(p.url, call([user("ends unseen")], seed=2)))
        assert again == first, types(again)
        assert len(ws_dispatches(up)) == 1
        assert [e["outcome"] for e in events(tmp_path, "outcome")] == ["completed"]
        assert [e["transport"] for e in events(tmp_path, "duplicate_replayed")] == ["ws"]
        wait_until(lambda: not ledger_query(tmp_path / "ledger.sqlite3", "SELECT op_key FROM "
                                            "operations WHERE state='in_flight'"), 10,
                   what="nothing in flight")
        assert_no_traceback(p.log_text()[restored:])


def test_a_call_that_ends_while_a_reload_failed_is_written_if_the_process_stops_first(tmp_path):
    """A call in flight through A completes, and its socket closes, while a reload to a script
    that does not load leaves no instance; A stops (SIGTERM) before the script is fixed. The
    call's end must be written as A exits (the unloaded instance reads the events it missed,
    as the next instance to load would have): B replays the call on a socket of its own; one
    upstream dispatch (unread, the call stayed in flight, and B, reaping A once it was gone,
    ran it a second time)."""
    ledger = tmp_path / "ledger.sqlite3"
    script = reloadable(tmp_path)
    scenario = {"default": {"kind": "ok", "hold": "a"}}
    opts = {"turnguard_hold_timeout_ms": 2000}
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, "a", addon=script, **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        async def ends_while_unloaded():
            async with WsClient.connect(a.url, headers=HEADERS) as c:
                await c.send(call([user("ends unseen, then A stops")], seed=1))
                await asyncio.to_thread(up.wait_held, "a", 30)
                await asyncio.to_thread(break_script, a, script)
                await asyncio.to_thread(up.release, "a")
                return await c.response()

        first = asyncio.run(ends_while_unloaded())
        assert types(first)[-1] == "response.completed"
        assert a.stop() == 0
        assert not ledger_query(ledger, "SELECT op_key FROM operations WHERE state='in_flight'")
        again = asyncio.run(one_call(b.url, call([user("ends unseen, then A stops")], seed=2)))
        assert again == first, types(again)
        assert len(ws_dispatches(up)) == 1
        assert a.log_text().count("Traceback") == 1  # its SyntaxError


def test_a_call_that_ends_while_a_reload_failed_is_replayed_on_its_open_socket(tmp_path):
    """The same, the socket still open when the next instance loads: the call it missed the
    end of is recorded completed, and the socket's next frame (the same call again) is
    replayed, not held behind a response turnguard still thought in flight."""
    script = reloadable(tmp_path)
    scenario = {"sequence": [{"kind": "ok", "delay_ms": 6000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, addon=script, turnguard_hold_timeout_ms=3000,
                  turnguard_request_budget_ms=8000) as p:
        async def ends_while_unloaded():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                good = await sent_then_unloaded(c, up, p, script, "ends unseen")
                first = await c.response()
                restored = await asyncio.to_thread(restore_script, p, script, good)
                await c.send(call([user("ends unseen")], seed=2))
                return first, await c.response(), restored

        first, again, restored = asyncio.run(ends_while_unloaded())
        assert types(first)[-1] == "response.completed"
        assert again == first, types(again)
        assert len(ws_dispatches(up)) == 1
        assert [e["outcome"] for e in events(tmp_path, "outcome")] == ["completed"]
        assert [e["transport"] for e in events(tmp_path, "duplicate_replayed")] == ["ws"]
        assert_no_traceback(p.log_text()[restored:])


def test_a_socket_whose_client_frame_went_by_while_a_reload_failed_is_let_go(tmp_path):
    """While no instance is loaded the client sends its next call on the socket: it goes
    upstream unguarded. The next instance that loads records the call that ended before it
    (its retry elsewhere is replayed) and lets the socket go, saying why."""
    script = reloadable(tmp_path)
    scenario = {"sequence": [{"kind": "ok", "delay_ms": 6000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, addon=script) as p:
        async def a_call_unseen():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                good = await sent_then_unloaded(c, up, p, script, "ends unseen")
                first = await c.response()
                await c.send(call([user("sent unseen")], seed=2))
                assert types(await c.response())[-1] == "response.completed"
                restored = await asyncio.to_thread(restore_script, p, script, good)
                return first, restored

        first, restored = asyncio.run(a_call_unseen())
        wait_until(lambda: events(tmp_path, "passthrough"), 10, what="the socket let go")
        assert ["reload that failed" in e["reason"] for e in events(tmp_path, "passthrough")] \
            == [True]
        again = asyncio.run(one_call(p.url, call([user("ends unseen")], seed=3)))
        assert again == first and len(ws_dispatches(up)) == 2
        assert [e["outcome"] for e in events(tmp_path, "outcome")] == ["completed"]
        assert_no_traceback(p.log_text()[restored:])


def test_a_queued_frame_sent_past_the_budget_while_a_reload_failed_lets_the_socket_go(
        tmp_path):
    """The client's next call waits behind a slow one on the socket; a reload to a script
    that does not load leaves no instance, and the wait for the slow call's end passes the
    request budget meanwhile: the socket's task sends the waiting call upstream itself,
    unguarded. The next instance that loads records the slow call (its retry is replayed)
    and lets the socket go, saying why (before, nothing told: the call went upstream with no
    attempt and no passthrough event)."""
    script = reloadable(tmp_path)
    scenario = {"sequence": [{"kind": "ok", "delay_ms": 7000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, addon=script, turnguard_request_budget_ms=4000) as p:
        async def queued_while_unloaded():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                breaking = asyncio.create_task(asyncio.to_thread(break_script, p, script))
                await c.send(call([user("slow")], seed=1))
                await asyncio.to_thread(up.wait_for_record, lambda r: r.get("event") == "dispatch")
                await c.send(call([user("queued")], seed=2))
                good = await breaking
                assert not events(tmp_path, "passthrough")  # (broken before the budget passed)
                first, second = await c.response(), await c.response()
                restored = await asyncio.to_thread(restore_script, p, script, good)
                return first, second, restored

        first, second, restored = asyncio.run(queued_while_unloaded())
        assert types(first)[-1] == types(second)[-1] == "response.completed"
        assert len(ws_dispatches(up)) == 2
        wait_until(lambda: events(tmp_path, "passthrough"), 10, what="the socket let go")
        assert ["upstream unguarded" in e["reason"] and "no turnguard script was loaded"
                in e["reason"] for e in events(tmp_path, "passthrough")] == [True]
        again = asyncio.run(one_call(p.url, call([user("slow")], seed=3)))
        assert again == first and len(ws_dispatches(up)) == 2
        assert [e["outcome"] for e in events(tmp_path, "outcome")] == ["completed"]
        assert [e["transport"] for e in events(tmp_path, "duplicate_replayed")] == ["ws"]
        assert_no_traceback(p.log_text()[restored:])


def test_a_call_whose_events_come_while_a_reload_failed_is_not_cut_as_silent(tmp_path):
    """The response's first events come while no instance is loaded (no hook reads them):
    the response-created timeout must not take that for a silent upstream and cut the
    socket; the client gets the whole response and the call is recorded completed."""
    script = reloadable(tmp_path)
    scenario = {"sequence": [{"kind": "ok", "delay_ms": 3000, "events": 12, "gap_ms": 300}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, addon=script, turnguard_response_created_timeout_ms=4500) as p:
        async def created_while_unloaded():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                good = await sent_then_unloaded(c, up, p, script, "created unseen")
                first = await c.response()
                restored = await asyncio.to_thread(restore_script, p, script, good)
                return first, restored

        first, restored = asyncio.run(created_while_unloaded())
        assert types(first)[-1] == "response.completed", types(first)
        assert not events(tmp_path, "upstream_cut")
        again = asyncio.run(one_call(p.url, call([user("created unseen")], seed=2)))
        assert again == first and len(ws_dispatches(up)) == 1
        assert [e["outcome"] for e in events(tmp_path, "outcome")] == ["completed"]
        assert_no_traceback(p.log_text()[restored:])


def test_calls_of_another_credential_or_session_never_share_a_recording(tmp_path):
    """A socket's handshake carries the call's principal and session: the same call sent with
    another key, another credential header or another session is another operation."""
    others = [{"authorization": "Bearer sk-someone-else"},
              {"x-api-key": "k2"},
              {"session-id": "another-session"}]
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        frame = call([user("mine")], seed=1)
        first = asyncio.run(one_call(p.url, frame))

        async def as_other(headers):
            async with WsClient.connect(p.url, headers={**HEADERS, **headers}) as c:
                await c.send(frame)
                return await c.response()

        for headers in others:
            got = asyncio.run(as_other(headers))
            assert types(got)[-1] == "response.completed"
            assert got[-1]["response"]["id"] != first[-1]["response"]["id"]
        assert len(ws_dispatches(up)) == 1 + len(others)
        assert events(tmp_path, "duplicate_replayed") == []


def test_a_frame_behind_a_response_that_never_ends_waits_no_longer_than_the_budget(tmp_path):
    """The client sends its next frame while the socket's response has stalled after some
    output: past the request budget turnguard lets the socket go (the frame goes upstream
    untouched, the stalled attempt is recorded) instead of holding the frame for ever."""
    scenario = {"sequence": [{"kind": "partial", "events": 3, "end": "stall", "stall_ms": 6000}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, turnguard_request_budget_ms=1500) as p:
        async def pipelined():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(call([user("stalls")], seed=1))
                await c.send(call([user("next")], seed=2))
                await asyncio.to_thread(wait_until, lambda: any(
                    "did not end within" in e["reason"]
                    for e in events(tmp_path, "passthrough")), 10, what="the socket let go")
                c.abort()

        asyncio.run(pipelined())
        outcome = wait_until(lambda: events(tmp_path, "outcome"), what="the stalled attempt")
        assert [(o["transport"], o["outcome"]) for o in outcome] == [("ws", "partial")]
        assert len(ws_dispatches(up)) == 1
        assert_no_traceback(p.log_text())


def test_a_detached_call_outlives_its_dropped_socket_and_the_retry_attaches(tmp_path, report):
    """Codex's idle timeout: the socket drops while the upstream still thinks. Detached
    (``turnguard_detach_ms``), the call runs on as turnguard's own HTTP POST; the retry on a
    new socket (the same call: full input, another start-ms and key order) attaches to it
    and gets the whole response: one upstream execution."""
    # the call stops after response.created until its retry attached (order, not a retry
    # that had to come within 3 s of thinking)
    thinking = {"default": {"kind": "ok", "hold": "think", "hold_after_events": 1,
                            "events": 3}}
    with MockUpstream(tmp_path, thinking) as up, proxy(
            tmp_path, up, turnguard_detach_ms=30000,
            turnguard_response_created_timeout_ms=20000) as p:
        async def drop_then_retry():
            async with WsClient.connect(p.url, headers=HEADERS) as a:
                await a.send(call([user("think hard")], seed=1))
                first = json.loads(await a.recv())  # response.created, then silence
                a.abort()  # the idle timeout: a TCP drop, no close frame
            async with WsClient.connect(p.url, headers=HEADERS) as b:
                await b.send(call([user("think hard")], seed=2))
                try:
                    await asyncio.to_thread(wait_until, lambda: events(
                        tmp_path, "duplicate_attached") or len(up.dispatches()) > 1, 30,
                        what="the retry attached")
                finally:
                    await asyncio.to_thread(up.release, "think")
                return first, await b.response()

        first, retried = asyncio.run(drop_then_retry())
        assert first["type"] == "response.created"
        assert types(retried)[0] == "response.created" and types(retried)[-1] == "response.completed"
        assert retried[0] == first  # the same response: the one upstream execution
        assert len(up.dispatches()) == 1
        assert [e["transport"] for e in events(tmp_path, "duplicate_attached")] == ["ws"]
        detached = wait_until(lambda: events(tmp_path, "upstream_detached"),
                              what="upstream_detached")
        assert detached[0]["used"] is True and detached[0]["outcome"] == "completed"
        assert_no_traceback(p.log_text())
    report(f"WebSocket call detached: socket dropped while the upstream held it, retry on a new "
           f"socket attached; upstream dispatches={len(up.dispatches())} "
           f"(ran {detached[0]['ran_without_client_ms']} ms without a client)")


def test_a_detached_call_without_stream_gets_its_events(tmp_path):
    """A call detached from its socket goes upstream as the HTTP POST it stands for, one that
    asks for an event stream whatever the frame said of ``stream`` (a POST without it would be
    answered with one JSON object, no events for the socket)."""
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, turnguard_detach_ms=30000) as p:
        frame = call([user("no stream key")], seed=1)
        del frame["stream"]
        got = asyncio.run(one_call(p.url, frame))
        assert types(got)[0] == "response.created" and types(got)[-1] == "response.completed"
        assert [d["transport"] for d in up.dispatches()] == ["http"]
        assert_no_traceback(p.log_text())


def test_a_socket_whose_key_is_its_subprotocol_is_not_detached_without_it(tmp_path):
    """A browser's client sends its key as ``Sec-WebSocket-Protocol``, the one header a POST
    cannot carry: with ``turnguard_detach_ms`` such a socket's call goes upstream on the
    socket, with its credential. Not: it went as a detached HTTP POST without any credential
    (a real upstream answers 401), recorded under the socket's principal."""
    headers = {"session-id": SESSION,
               "sec-websocket-protocol": "openai-insecure-api-key.sk-ws-proto-test"}
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, turnguard_detach_ms=30000) as p:
        async def one():
            async with WsClient.connect(p.url, headers=headers) as c:
                await c.send(call([user("proto")], seed=1))
                return await c.response()

        assert types(asyncio.run(one()))[-1] == "response.completed"
        assert [(d["transport"], d["subprotocol_present"]) for d in up.dispatches()] == [
            ("ws", True)]
        assert_no_traceback(p.log_text())


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (its identity worker, and what multiprocessing adds)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    return found


def _worker_started(pid: int) -> bool:
    """Whether ``pid``'s identity worker runs its own program (it was exec'd). A child
    stopped between its fork and its exec would hold mitmproxy's event loop, which waits in
    the spawn for the exec, and with it the script's reload."""
    for child in _children(pid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return True
    return False


@contextlib.contextmanager
def _paused_children(pid: int):
    """Every process ``pid`` starts is kept stopped (SIGSTOP, every 10 ms, a new one too)
    until the block ends, then continued."""
    stopped: set[int] = set()
    done = threading.Event()

    def keep_stopping() -> None:
        while not done.is_set():
            for child in set(_children(pid)) - stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGSTOP)
                    stopped.add(child)
            done.wait(0.01)

    thread = threading.Thread(target=keep_stopping, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(5)
        for child in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGCONT)


def test_a_script_reload_while_a_large_call_is_identified_leaves_it_guarded(tmp_path, report):
    """A call frame past 256 KiB is identified in a worker process. mitmproxy reloads the
    script meanwhile (the worker is paused until then, so the reload comes first), which stops
    the old instance's worker: the instance loaded now identifies and decides the call, so it
    is guarded (before, it went upstream unguarded, and its retry through another process ran
    it again)."""
    script = reloadable(tmp_path)
    items = [{"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "t"}] * 20_000}]
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "delay_ms": 4000}}) as up, \
            guarded(tmp_path, up, "a", addon=script, **opts) as a, \
            guarded(tmp_path, up, "b", **opts) as b:
        with ThreadPoolExecutor(max_workers=1) as pool:
            original = pool.submit(asyncio.run, one_call(a.url, call(items, seed=1)))
            wait_until(lambda: _worker_started(a.pid), 20, what="the identity worker")
            with _paused_children(a.pid):  # the worker cannot answer before the reload
                reloaded(a, touch_to_reload(a, script))
            a.wait_for_log("was identified; the addon loaded now decides it", 20)
            wait_until(lambda: ws_dispatches(up), 20, what="the call dispatched")
            retry = asyncio.run(one_call(b.url, call(items, seed=2)))
            first = original.result(60)
        assert types(first)[-1] == types(retry)[-1] == "response.completed"
        assert first[-1]["response"]["id"] == retry[-1]["response"]["id"]
        assert len(up.dispatches()) == 1
        assert not turnguard_events(tmp_path, "a", "passthrough")
        assert_no_traceback(a.log_text() + b.log_text())
    report("script reloaded while a 20,000-item call was identified in the worker: the new "
           "instance decided it; its retry through another process got the same response; "
           "upstream dispatches=1")


def test_a_large_call_identified_as_a_reload_fails_passes_through_without_a_fault(tmp_path):
    """A call frame past 256 KiB is identified in a worker process; a reload to a script that
    does not load stops the worker and leaves no instance to decide it: the call passes
    through (said so), its response is read by the next instance that loads, and nothing
    fails on the instance that is missing (before, reading its settings raised, logged as a
    failure to guard the frame)."""
    script = reloadable(tmp_path)
    items = [{"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "t"}] * 20_000}]
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "delay_ms": 500}}) as up, \
            guarded(tmp_path, up, "a", addon=script) as a:
        with ThreadPoolExecutor(max_workers=1) as pool:
            original = pool.submit(asyncio.run, one_call(a.url, call(items, seed=1)))
            wait_until(lambda: _worker_started(a.pid), 20, what="the identity worker")
            with _paused_children(a.pid):  # the worker cannot answer before the reload
                good = break_script(a, script)
            first = original.result(60)
        restore_script(a, script, good)
        assert types(first)[-1] == "response.completed"
        assert len(ws_dispatches(up)) == 1
        passthrough = wait_until(lambda: turnguard_events(tmp_path, "a", "passthrough"), 10,
                                 what="the passthrough recorded")
        assert [e["reason"] for e in passthrough] == [
            "turnguard unloaded while identifying the call"]
        assert "guarding a frame" not in a.log_text()


def test_a_reload_while_a_large_call_is_identified_leaves_it_only_the_rest_of_its_budget(
        tmp_path, monkeypatch):
    """As over HTTP: the instance loaded now identifies the call within what is left of its
    budget (before, a whole budget again: the next worker, which starts in 5 s, was waited for
    past the 8 s budget). The call passes through, sent upstream once, and is answered."""
    first = slow_workers(tmp_path, monkeypatch, 5)
    script = reloadable(tmp_path)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", addon=script,
                                               turnguard_request_budget_ms=8000) as a:
        with ThreadPoolExecutor(max_workers=1) as pool:
            original = pool.submit(asyncio.run, one_call(a.url, call([user("b" * 300_000)])))
            wait_until(first.exists, 20, what="the first identity worker")
            time.sleep(3)  # it never starts: the reload comes ~4-5 s into the budget
            reloaded(a, touch_to_reload(a, script))
            a.wait_for_log("was identified; the addon loaded now decides it", 20)
            answered = original.result(60)
        assert types(answered)[-1] == "response.completed"
        passed = [e["reason"] for e in turnguard_events(tmp_path, "a", "passthrough")]
        assert len(passed) == 1 and ("did not start within" in passed[0]
                                     or "request budget" in passed[0]), passed
        assert len(ws_dispatches(up)) == 1
        assert_no_traceback(a.log_text())


# -- what turnguard sends itself on a socket: whole, in order, every character intact ------------
def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_frames_turnguard_sends_itself_keep_every_character(tmp_path):
    """Frames turnguard sends after their hook (a call past 256 KiB, identified off the event
    loop; a call queued behind another) and events it replays are cut into frames of about
    4 kB by mitmproxy: a character is never cut in two (before, each half became U+FFFD)."""
    text = "naïve café — " + "€" * 1500  # over 4 kB of UTF-8 in each event that carries it
    big = call([user("€" * 100_000)], seed=1)  # over 256 KiB: identified in the worker
    slow = {"kind": "ok", "text": text, "events": 2, "delay_ms": 800}
    scenario = {"sequence": [{"kind": "ok", "text": text, "events": 2}, slow],
                "default": {"kind": "ok", "text": text, "events": 2}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        async def run():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                sent = [json.dumps(big, ensure_ascii=False)]
                await c.send(sent[0])
                first = await c.response()
                slow_call = call([user("slow")], turn="turn-2", seed=2)
                queued = call([user("queued € " * 600)], turn="turn-3", seed=3)
                sent += [json.dumps(slow_call, ensure_ascii=False),
                         json.dumps(queued, ensure_ascii=False)]
                await c.send(sent[1])
                await c.send(sent[2])  # queued behind the slow one: sent once it ended
                await c.response()
                await c.response()
            async with WsClient.connect(p.url, headers=HEADERS) as c:  # a retry: replayed
                await c.send(json.dumps(call([user("€" * 100_000)], seed=4), ensure_ascii=False))
                again = await c.response()
            return sent, first, again

        sent, first, again = asyncio.run(run())
        assert [d["body_sha256"] for d in ws_dispatches(up)] == [_sha(f) for f in sent]
        assert again == first and not any("\ufffd" in json.dumps(e) for e in again)
        assert any(text in json.dumps(e, ensure_ascii=False) for e in again)
        assert_no_traceback(p.log_text())


def test_a_frame_queued_while_the_client_sends_its_next_one_in_parts_goes_alone(tmp_path):
    """A call queued behind a slow one is sent when that one ends; if the client has sent
    only part of its next (large) frame by then, the queued call still goes upstream alone,
    and the next one whole (before, mitmproxy sent the queued call after the part, and the
    next one lost it: two errors where plain mitmdump completes three calls)."""
    # A's answer waits upstream until the test releases it, once B and C's first part are
    # sent; C's rest goes once B went upstream (order, not a 1.5 s delay B had to come
    # within and a 2.5 s pause A had to end within)
    scenario = {"sequence": [{"kind": "ok", "hold": "A"}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up) as p:
        frames = [json.dumps(call([user(f"{name} " + "x" * pad)], turn=f"turn-{name}", seed=i))
                  for i, (name, pad) in enumerate([("A", 0), ("B", 0), ("C", 200_000)])]

        async def run():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(frames[0])  # held upstream
                try:
                    await asyncio.to_thread(up.wait_held, "A", 30)
                    await c.send(frames[1])  # queued behind A
                    rest = await c.send_in_two(frames[2], 1000)
                finally:
                    await asyncio.to_thread(up.release, "A")
                await asyncio.to_thread(wait_until, lambda: len(ws_dispatches(up)) >= 2, 30,
                                        what="B upstream")  # A ended; B went upstream
                await rest()
                return [await c.response(timeout=15) for _ in frames]

        answers = asyncio.run(run())
        assert [types(a)[-1] for a in answers] == ["response.completed"] * 3
        assert [d["body_sha256"] for d in ws_dispatches(up)] == [_sha(f) for f in frames]
        assert not events(tmp_path, "passthrough")
        assert_no_traceback(p.log_text())


def test_an_older_copy_put_over_the_ledger_after_a_call_ended_leaves_nothing_in_flight(tmp_path):
    """A copy of the ledger is taken while A's call streams; the call completes (its end in
    the ledger), then the copy is put in the ledger's place. The copy shows the call in
    flight, owned by A, which is alive and ended it. Once A and B have seen the new file,
    nothing may stay in flight there: B's retry of the call must get an answer, not a
    turn_in_progress error on every retry."""
    ledger = tmp_path / "ledger.sqlite3"
    backup = tmp_path / "backup.sqlite3"
    opts = {"turnguard_hold_timeout_ms": 2000}
    scenario = {"sequence": [{"kind": "ok"}],  # the warm-up at once, then calls that stream
                "default": {"kind": "ok", "events": 12, "gap_ms": 150}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, name="a", **opts) as a, proxy(tmp_path, up, name="b", **opts) as b:
        asyncio.run(one_call(a.url, call([user("warm")], seed=50)))

        async def copy_mid_call():
            first = asyncio.create_task(one_call(a.url, call([user("x")], seed=1)))
            await asyncio.to_thread(wait_until, lambda: len(ledger_query(
                ledger, "SELECT 1 FROM attempts WHERE events_seen>0")) == 2, 10,
                what="the call streaming")
            with contextlib.closing(sqlite3.connect(ledger)) as src, \
                    contextlib.closing(sqlite3.connect(backup)) as dst:
                src.backup(dst)
            return await first

        assert types(asyncio.run(copy_mid_call()))[-1] == "response.completed"
        wait_until(lambda: not ledger_query(
            ledger, "SELECT 1 FROM operations WHERE state='in_flight'"), 10, what="its end")
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{ledger}{suffix}")
        os.replace(backup, ledger)
        for name in ("a", "b"):
            wait_until(lambda: turnguard_events(tmp_path, name, "ledger_recovered"), 15,
                       what=f"{name} on the new file")
        retried = asyncio.run(one_call(b.url, call([user("x")], seed=4)))
        assert types(retried)[-1] == "response.completed", retried[-1]
        assert wait_until(lambda: not ledger_query(
            ledger, "SELECT 1 FROM operations WHERE state='in_flight'"), 10, what="nothing in flight")
        assert_no_traceback(a.log_text() + b.log_text())


class DeflateUpstream(LoopbackServer):
    """A small Responses-over-WebSocket upstream of its own (the mock caps an event at 1 MiB
    and negotiates no extension): it accepts permessage-deflate when the socket offers it and
    answers each call, after ``delay_s``, with ``response.created``, a small delta, one delta
    of ``big_bytes`` (a few kB on the wire, deflated), ``output_item.done`` and
    ``response.completed``. ``dispatches`` counts the calls. ``hold``: the first call's
    answer waits (in place of ``delay_s``) until ``release()``, at most 60 s; ``held`` is
    set once it waits (the test's view that the call is upstream and unanswered)."""

    def __init__(self, *, big_bytes: int, delay_s: float = 0.8, hold: bool = False):
        self.big_bytes, self.delay_s, self.dispatches = big_bytes, delay_s, 0
        self.hold, self.held = hold, threading.Event()
        self._released = asyncio.Event()
        super().__init__()

    def release(self) -> None:
        """Let the held first call answer (from the test's thread)."""
        self._loop.call_soon_threadsafe(self._released.set)

    async def handle(self, reader, writer) -> None:
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage
        from wsproto.extensions import PerMessageDeflate
        from wsproto.utilities import LocalProtocolError
        conn, parts = WSConnection(ConnectionType.SERVER), []

        async def send(*events) -> None:
            for event in events:
                writer.write(conn.send(event))
                await writer.drain()

        try:
            for _ in range(100_000):  # bounded: each pass reads
                data = await asyncio.wait_for(reader.read(65536), 120)
                conn.receive_data(data or None)
                for event in conn.events():
                    if isinstance(event, Request):
                        await send(AcceptConnection(extensions=[PerMessageDeflate()]))
                    elif isinstance(event, CloseConnection):
                        return await send(event.response())
                    elif isinstance(event, TextMessage):
                        parts.append(event.data)
                        if event.message_finished:
                            text = "".join(parts)  # (a large one is answered unread)
                            await self._answer(send, json.loads(text) if len(text) < 1 << 20
                                               else {})
                            parts = []
                if not data:
                    return
        except (OSError, TimeoutError, ValueError, LocalProtocolError):  # the client left
            return
        finally:
            writer.close()

    async def _answer(self, send, frame: dict) -> None:
        from wsproto.events import TextMessage
        self.dispatches += 1
        rid = f"resp_{self.dispatches}"
        if self.hold and self.dispatches == 1:
            self.held.set()
            await asyncio.wait_for(self._released.wait(), 60)
        else:
            await asyncio.sleep(self.delay_s)
        item = {"type": "message", "id": f"msg_{rid}", "role": "assistant",
                "content": [{"type": "output_text", "text": "hi"}]}
        frames = [{"type": "response.created", "response": {"id": rid}},
                  {"type": "response.output_text.delta", "delta": "h"},
                  {"type": "response.output_text.delta", "delta": "a" * self.big_bytes},
                  {"type": "response.output_item.done", "item": item},
                  {"type": "response.completed", "response": {"id": rid}}]
        for i, f in enumerate(frames):
            await send(TextMessage(json.dumps(f)))
            await asyncio.sleep(0.3 if i < 2 else 0)  # the duplicate attaches meanwhile


class ScriptedUpstream(LoopbackServer):
    """A Responses-over-WebSocket upstream of its own, for frames the mock never sends: the
    n-th call (any client message) is answered by ``scripts[n]``, a list of frames (a dict:
    a JSON event, ``RID`` in it the response's id; a str: a raw text frame; bytes: a binary
    frame) and pauses (a float: seconds). ``calls`` counts the calls."""

    def __init__(self, scripts: list[list]):
        self.scripts, self.calls = scripts, 0
        super().__init__()

    async def handle(self, reader, writer) -> None:
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Message,
                                    Request, TextMessage)
        from wsproto.utilities import LocalProtocolError
        conn = WSConnection(ConnectionType.SERVER)

        async def send(event) -> None:
            writer.write(conn.send(event))
            await writer.drain()

        try:
            for _ in range(100_000):  # bounded: each pass reads
                data = await asyncio.wait_for(reader.read(65536), 120)
                conn.receive_data(data or None)
                for event in conn.events():
                    if isinstance(event, Request):
                        await send(AcceptConnection())
                    elif isinstance(event, CloseConnection):
                        return await send(event.response())
                    elif isinstance(event, Message) and event.message_finished:
                        n, self.calls = self.calls, self.calls + 1
                        for step in self.scripts[min(n, len(self.scripts) - 1)]:
                            if isinstance(step, float):
                                await asyncio.sleep(step)
                            elif isinstance(step, bytes):
                                await send(BytesMessage(step))
                            else:
                                text = step if isinstance(step, str) else json.dumps(step)
                                await send(TextMessage(text.replace("RID", f"resp_{n}")))
                if not data:
                    return
        except (OSError, TimeoutError, ValueError, LocalProtocolError):  # the client left
            return
        finally:
            writer.close()


def scripted_response(*middle) -> list:
    """A response's frames, with ``middle`` (frames and pauses) after its ``created``."""
    item = {"type": "message", "id": "msg_RID", "role": "assistant",
            "content": [{"type": "output_text", "text": "hi"}]}
    return [{"type": "response.created", "response": {"id": "RID"}}, *middle,
            {"type": "response.output_text.delta", "delta": "hi"},
            {"type": "response.output_item.done", "item": item},
            {"type": "response.completed", "response": {"id": "RID", "output": [item]}}]


async def _rest_of_response(client: WsClient, got: list) -> list:
    """``got`` with the messages ``client`` gets next, up to a ``response.completed``."""
    for _ in range(10):  # bounded: up to the terminal event
        got.append(await asyncio.wait_for(client.recv(), 60))
        if "response.completed" in got[-1]:
            break
    return got


async def _a_call_and_its_duplicate_after_its_first_frame(url: str) -> tuple[list, list]:
    """A call on one socket, and the same call on another once the first socket's client got
    its first frame: the messages each got, up to the ``response.completed``."""
    async with WsClient.connect(url, headers=HEADERS) as a:
        await a.send(call([user("hi")], seed=1))
        first = [await asyncio.wait_for(a.recv(), 60)]
        duplicate = asyncio.create_task(messages_of_one_call(url, call([user("hi")], seed=2)))
        await _rest_of_response(a, first)
        return first, await duplicate


async def messages_of_one_call(url: str, frame: dict, delay: float = 0.0) -> list:
    """The messages a socket gets for one call, as they come (text or bytes), up to its
    terminal event."""
    await asyncio.sleep(delay)
    async with WsClient.connect(url, headers=HEADERS) as c:
        await c.send(frame)
        got = []
        for _ in range(50):
            message = await c.recv()
            got.append(message)
            if not isinstance(message, str) or not message.startswith("{"):
                continue
            if json.loads(message).get("type") in ("response.completed", "error"):
                return got
        return got


@pytest.mark.parametrize("stray", ["keepalive", b"\x00binary"], ids=["text", "binary"])
def test_a_frame_that_is_no_event_inside_a_response_does_not_run_its_duplicate_again(
        tmp_path, stray):
    """An upstream (a gateway) that puts a frame of its own (a keepalive text, a binary
    frame) inside a response that began as the Responses API's: the response goes on
    upstream, so it is followed to its end, and a duplicate sent meanwhile on another socket
    attaches to it (one upstream execution), gets every event, and the stray text frame too;
    the frame is named in the telemetry and the response, not recordable without it, is not
    replayed."""
    scripts = [scripted_response(stray, 1.5)]
    with ScriptedUpstream(scripts) as up, proxy(tmp_path, up) as p:
        async def both():
            return await asyncio.gather(
                messages_of_one_call(p.url, call([user("hi")], seed=1)),
                messages_of_one_call(p.url, call([user("hi")], seed=2), delay=0.5))

        first, second = asyncio.run(both())
        assert up.calls == 1
        assert first[1] == stray
        assert second == (first if isinstance(stray, str) else [first[0], *first[2:]])
        assert json.loads(second[-1])["type"] == "response.completed"
        assert [e["transport"] for e in events(tmp_path, "duplicate_attached")] == ["ws"]
        assert any("inside a response" in e["reason"] for e in events(tmp_path, "passthrough"))
        outcome = events(tmp_path, "outcome")
        assert [(o["outcome"], o["replayable"]) for o in outcome] == [("completed", False)]
        assert_no_traceback(p.log_text())


def test_a_frame_that_is_no_event_between_responses_leaves_the_socket_guarded(tmp_path):
    """A gateway's keepalive text on a socket with no response in flight answers no frame of
    the client's: it is passed on, named in the telemetry, and the socket stays guarded (its
    next call is recorded, and that call's retry on a new socket is replayed, not run again)."""
    scripts = [[*scripted_response(), 0.2, "keepalive"], scripted_response()]
    with ScriptedUpstream(scripts) as up, proxy(tmp_path, up) as p:
        async def two_calls():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send(call([user("one")], seed=1))
                first = await c.response()
                assert await c.recv() == "keepalive"
                await c.send(call([user("two")], seed=2))
                return first, await c.response()

        first, second = asyncio.run(two_calls())
        assert types(first)[-1] == types(second)[-1] == "response.completed"
        assert asyncio.run(one_call(p.url, call([user("two")], seed=3))) == second
        assert up.calls == 2
        assert len(events(tmp_path, "duplicate_replayed")) == 1
        assert any("while no response is in flight" in e["reason"]
                   for e in events(tmp_path, "passthrough"))
        assert_no_traceback(p.log_text())


def test_a_late_event_of_its_own_upstream_is_not_the_response_a_socket_is_attached_to(
        tmp_path):
    """Socket B's call is attached to the same call streaming on socket A, and B's client has
    sent its next call behind it. B's own upstream then sends a late ``error`` event (of B's
    previous response, naming none): it is not the attached response's (B's upstream never
    sent that one), so it neither ends it nor lets the next call go upstream while the
    attached events still come: B gets them all before the next call's."""
    late_error = {"type": "error", "status": 500,
                  "error": {"type": "server_error", "message": "late"}}
    scripts = [[*scripted_response(), 1.0, late_error],  # B's first call
               [{"type": "response.created", "response": {"id": "RID"}},  # A's call
                {"type": "response.output_text.delta", "delta": "a"}, 2.0,
                *scripted_response()[1:]],
               scripted_response()]  # B's next call
    with ScriptedUpstream(scripts) as up, proxy(tmp_path, up) as p:
        async def b_socket():
            async with WsClient.connect(p.url, headers=HEADERS) as b:
                await b.send(call([user("first")], seed=1))
                await b.response()
                a = asyncio.create_task(one_call(p.url, call([user("same")], seed=2)))
                await asyncio.to_thread(wait_until, lambda: up.calls == 2, 10,
                                        what="A's call upstream")
                await asyncio.sleep(0.3)  # its first output came
                await b.send(call([user("same")], seed=3))  # attached to A's
                await b.send(call([user("next")], seed=4))  # queued behind it
                got = []
                for _ in range(40):
                    event = json.loads(await b.recv())
                    got.append((event["type"], event.get("response", {}).get("id")))
                    if {("response.completed", "resp_1"),
                            ("response.completed", "resp_2")} <= set(got):
                        break
                return got, await a

        got, on_a = asyncio.run(b_socket())
        assert types(on_a)[-1] == "response.completed"
        assert ("error", None) in got  # the late event, relayed as it came
        ends = got.index(("response.completed", "resp_1"))
        assert ends < got.index(("response.created", "resp_2")), got  # one at a time
        assert up.calls == 3
        assert_no_traceback(p.log_text())


class EndlessSseUpstream(ScriptedUpstream):
    """An upstream that accepts a WebSocket upgrade (and reads its frames without answering)
    and answers a POST with an event stream of ``events`` (0.3 s apart) whose chunked body
    then ends cleanly, without a terminal event. ``calls`` counts the POSTs, ``sent`` the
    events sent; the stream stops after its first event until ``go_on`` is set (bounded: 30 s),
    so that a duplicate reaches it while it is live however slow the machine."""

    def __init__(self, events: list[dict]):
        self.events = events
        self.sent = 0
        self.go_on = threading.Event()
        super().__init__([])

    async def handle(self, reader, writer) -> None:
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import AcceptConnection, Request
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            if b"upgrade: websocket" in head.lower():
                conn = WSConnection(ConnectionType.SERVER)
                conn.receive_data(head)
                if any(isinstance(e, Request) for e in conn.events()):
                    writer.write(conn.send(AcceptConnection()))
                for _ in range(100_000):  # bounded: each pass reads
                    if not await asyncio.wait_for(reader.read(65536), 120):
                        return
                return
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            self.calls += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            for i, event in enumerate(self.events):
                data = f"data: {json.dumps(event)}\n\n".encode()
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await writer.drain()
                self.sent += 1
                if i == 0:
                    await asyncio.to_thread(self.go_on.wait, 30)
                await asyncio.sleep(0.3)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


def test_a_socket_attached_to_an_http_stream_that_ends_without_a_terminal_event_is_told(
        tmp_path):
    """An HTTP attempt whose event stream ends cleanly without a terminal event (its client
    sees the body end: the response is over, unfinished). A duplicate on a socket attached to
    it gets its events, then an ``error`` event with a status: a socket has no body end to
    tell its client the response is over, which would otherwise wait for the rest forever."""
    created = {"type": "response.created", "response": {"id": "resp_http"}}
    delta = {"type": "response.output_text.delta", "delta": "hi"}
    with EndlessSseUpstream([created, delta, delta, delta]) as up, proxy(tmp_path, up) as p:
        frame = call([user("hi")], seed=3)

        async def both():
            posted = asyncio.create_task(asyncio.to_thread(
                sse_post, p.url, body=post_fallback(frame),
                headers={**HEADERS, "accept": "text/event-stream"}))
            try:
                await asyncio.to_thread(wait_until, lambda: up.sent, 10, what="its first event")
                async with WsClient.connect(p.url, headers=HEADERS) as c:
                    await c.send(frame)
                    await asyncio.to_thread(wait_until,
                                            lambda: events(tmp_path, "duplicate_attached"), 20,
                                            what="the socket attached")
                    up.go_on.set()  # (not a fixed pause: on a loaded machine the stream ended)
                    return await c.response(timeout=10), await posted
            finally:
                up.go_on.set()  # (a failure above does not leave the stream waiting)

        got, (status, _, body) = asyncio.run(both())
        assert status == 200 and len(parse_sse(body)) == 4
        assert types(got) == ["response.created"] + ["response.output_text.delta"] * 3 + ["error"]
        assert isinstance(got[-1]["status"], int) and got[-1]["status"] >= 500
        assert up.calls == 1 and len(events(tmp_path, "duplicate_attached")) == 1
        assert_no_traceback(p.log_text())


class DeflateClient(WsClient):
    """``WsClient`` offering permessage-deflate (as Codex does)."""

    @classmethod
    async def open(cls, url: str, path: str, headers: dict[str, str]) -> "WsClient":
        from urllib.parse import urlsplit

        from wsproto import ConnectionType, WSConnection
        from wsproto.events import AcceptConnection, Request
        from wsproto.extensions import PerMessageDeflate
        parts = urlsplit(url)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, parts.port), 15)
        conn = WSConnection(ConnectionType.CLIENT)
        writer.write(conn.send(Request(
            host=parts.netloc, target=path, extensions=[PerMessageDeflate()],
            extra_headers=[(k.encode(), v.encode()) for k, v in headers.items()])))
        client = cls(reader, writer, conn)
        event = await client._next_event()
        assert isinstance(event, AcceptConnection) and event.extensions, event
        return client


def test_an_event_too_large_to_read_reaches_every_duplicate_or_none_is_answered_without_it(
        tmp_path):
    """An upstream event past what turnguard reads (8 MiB; a few kB deflated): the original's
    client gets it; a duplicate attached live gets it too, and no replay leaves it out (the
    response cannot be recorded without it: a later retry is forwarded)."""
    big = 9 * 1024 * 1024
    with DeflateUpstream(big_bytes=big, hold=True) as up, Mitmdump(tmp_path, up.url, options={
            "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
            "turnguard_events": str(tmp_path / "mitmdump-events.jsonl")}) as p:
        async def on(client, seed):
            async with client.connect(p.url, headers=HEADERS) as c:
                await c.send(call([user("big")], seed=seed))
                return await c.response(30)

        async def run():
            # the upstream holds the first call unanswered until the second is held: it is
            # held, then attached at the first delta (order, not a second call that had to
            # come within 0.4 s of the first and before its answer's end)
            first = asyncio.create_task(on(DeflateClient, 1))
            await asyncio.to_thread(wait_until, up.held.is_set, 30, what="the first call upstream")
            second = asyncio.create_task(on(WsClient, 2))
            try:
                await asyncio.to_thread(wait_until, lambda: events(
                    tmp_path, "duplicate_held") or second.done(), 30,
                    what="the second call held")
            finally:
                up.release()
            first, second = await first, await second
            return first, second, await on(DeflateClient, 3)

        first, attached, later = asyncio.run(run())
        assert types(first) == ["response.created", "response.output_text.delta",
                                "response.output_text.delta", "response.output_item.done",
                                "response.completed"]
        assert len(first[2]["delta"]) == big
        def digest(got):  # (a failure does not print 9 MiB)
            return [hashlib.sha256(json.dumps(e).encode()).hexdigest()[:12] for e in got]

        assert digest(attached) == digest(first)
        assert [e["transport"] for e in events(tmp_path, "duplicate_attached")] == ["ws"]
        assert types(later) == types(first) and len(later[2]["delta"]) == big
        assert events(tmp_path, "duplicate_replayed") == [] and up.dispatches == 2
        assert_no_traceback(p.log_text())


def test_a_frame_of_millions_of_tiny_objects_does_not_hold_the_proxy(tmp_path):
    """A client frame of 400,000 small JSON objects (20 MB; a few kB deflated) takes a second
    or more to read: it is read off the event loop, so a call sent on another socket meanwhile
    is decided and sent upstream before it is read, and both are answered."""
    hostile = call([user("hostile"), *([{k: 0 for k in "abcdefgh"}] * 400_000)], turn="turn-h")
    hostile = json.dumps(hostile, separators=(",", ":"))[:-1] + ',"type":"response.create"}'
    with DeflateUpstream(big_bytes=0, delay_s=0) as up, Mitmdump(tmp_path, up.url, options={
            "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
            "turnguard_events": str(tmp_path / "mitmdump-events.jsonl")}) as p:
        async def run():
            async with DeflateClient.connect(p.url, headers=HEADERS) as big, \
                    WsClient.connect(p.url, headers=HEADERS) as other:
                await big.send(hostile)  # duplicate keys: no call, it goes on once read
                await asyncio.to_thread(p.wait_for_log, "-> WebSocket text message ->", 60)
                await other.send(call([user("meanwhile")], turn="turn-m"))
                return await other.response(60), await big.response(60)

        meanwhile, answered = asyncio.run(run())
        assert types(meanwhile)[-1] == "response.completed"
        assert types(answered)[-1] == "response.completed"
        assert [(e["event"], e.get("reason")) for e in events(tmp_path)
                if e["event"] in ("dispatch", "passthrough")] == [
            ("dispatch", None), ("passthrough", "duplicate keys in JSON frame")]
        assert_no_traceback(p.log_text())


def test_a_frame_of_millions_of_numbers_passes_without_being_read(tmp_path):
    """A call frame of 5 M numbers in one array (over ``MAX_FRAME_VALUES``, 4 M): 10 MB,
    about 10 kB deflated, and only one JSON array. Read, the parser holds the interpreter (and
    mitmproxy's event loop with it, though it runs on a thread) for about 0.3 s of CPU in one
    go (seconds at the 64 MiB a frame may have), and its canonical form as long again on the
    event loop, whatever the request budget: it passes untouched, unread, and a call on
    another socket is answered as usual."""
    hostile = json.dumps(call([user("hostile")], turn="turn-h"), separators=(",", ":"))
    hostile = hostile[:-1] + ',"tools":[' + "0," * 5_000_000 + '0]}'
    with DeflateUpstream(big_bytes=0, delay_s=0) as up, Mitmdump(tmp_path, up.url, options={
            "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
            "turnguard_events": str(tmp_path / "mitmdump-events.jsonl"),
            "turnguard_request_budget_ms": 2000}) as p:
        async def run():
            async with DeflateClient.connect(p.url, headers=HEADERS) as big, \
                    WsClient.connect(p.url, headers=HEADERS) as other:
                await big.send(hostile)
                await other.send(call([user("meanwhile")], turn="turn-m"))
                return await other.response(60), await big.response(120)

        meanwhile, answered = asyncio.run(run())
        assert types(meanwhile)[-1] == types(answered)[-1] == "response.completed"
        assert up.dispatches == 2
        assert [e["reason"] for e in events(tmp_path, "passthrough")] == [
            "frame holds more than 4000000 JSON values"]
        assert_no_traceback(p.log_text())


def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_frame_that_inflates_to_millions_of_objects_passes_without_being_read(tmp_path):
    """A call frame of 5 M empty JSON objects: 15 MB (a frame may have 64 MiB), about 15 kB
    deflated. Read, it would take about 700 MB of mitmdump's memory (3 GB at 64 MiB) and
    seconds: it passes untouched, unread, and the socket goes on."""
    hostile = call([user("hostile"), *([{}] * 5_000_000)], turn="turn-h")
    with DeflateUpstream(big_bytes=0, delay_s=0) as up, Mitmdump(tmp_path, up.url, options={
            "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
            "turnguard_events": str(tmp_path / "mitmdump-events.jsonl")}) as p:
        async def run():
            async with DeflateClient.connect(p.url, headers=HEADERS) as c:
                await c.send(json.dumps(hostile, separators=(",", ":")))
                first = await c.response(120)
                await c.send(call([user("after")], turn="turn-a"))
                return first, await c.response(60)

        peak_before = _peak_rss_kb(p.pid)
        answered, after = asyncio.run(run())
        assert types(answered)[-1] == types(after)[-1] == "response.completed"
        assert up.dispatches == 2
        assert _peak_rss_kb(p.pid) - peak_before < 256 * 1024  # its 15 MB, a few times
        assert [e["reason"] for e in events(tmp_path, "passthrough")] == [
            "frame holds more than 1000000 JSON objects and arrays"]
        assert_no_traceback(p.log_text())



def test_a_small_deflated_frame_of_many_values_is_identified_off_the_event_loop(
        tmp_path, monkeypatch):
    """A call frame of 60,000 empty JSON objects: 180 kB inflated (under the 256 KiB read on
    the event loop by size), a few hundred bytes deflated. Read and identified on the loop it
    held it ~150 ms (24 of them held another client's handshake for seconds): it goes to the
    identity worker (which a ``sitecustomize`` marks as started: it starts only for a body it
    is handed), and the call is still guarded: answered once, its retry replayed."""
    started = tmp_path / "worker-started"
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if 'spawn_main' in ' '.join(getattr(sys, 'orig_argv', [])):\n"
        f"    open({str(started)!r}, 'a').close()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    dense = [user("dense"), *([{}] * 60_000)]
    with DeflateUpstream(big_bytes=0, delay_s=0) as up, proxy(tmp_path, up) as p:
        async def twice():
            answers = []
            for seed in (1, 2):  # the call, then its retry on a new socket
                async with DeflateClient.connect(p.url, headers=HEADERS) as c:
                    frame = json.dumps(call(dense, seed=seed), separators=(",", ":"))
                    assert len(frame) < 256 * 1024
                    await c.send(frame)
                    answers.append(await c.response(120))
            return answers

        first, retried = asyncio.run(twice())
        assert types(first)[-1] == "response.completed" and retried == first
        assert up.dispatches == 1 and len(events(tmp_path, "duplicate_replayed")) == 1
        assert started.exists(), "the identity worker was never started: read on the loop"
        assert_no_traceback(p.log_text())

def test_turnguard_keeps_no_socket_once_it_ended(tmp_path):
    """Two sockets send the same call, one after the other (the second's is replayed), and
    close: once each socket's ``websocket_end`` hook ran, turnguard refers to neither flow
    (``retention_probe.py``, as for HTTP in test_e2e_guard.py)."""
    from test_e2e_guard import RETENTION_PROBE, retention_looks

    with MockUpstream(tmp_path) as up, proxy(
            tmp_path, up, extra_args=["-s", str(RETENTION_PROBE)]) as p:
        first = asyncio.run(one_call(p.url, call([user("kept?")])))
        again = asyncio.run(one_call(p.url, call([user("kept?")])))
        assert types(first)[-1] == types(again)[-1] == "response.completed"
        assert len(ws_dispatches(up)) == 1
        # (each flow is looked at twice: at its upgrade's response, at its socket's end)
        assert retention_looks(p, 4) == ["let go"] * 4
        assert_no_traceback(p.log_text())



PONG, REFUSED = {"type": "pong"}, {"type": "error", "status": 400}


@pytest.mark.parametrize("answer, late", [([PONG], False), ([PONG], True), ([REFUSED], True),
                                          ([], False)],
                         ids=["pong", "late-pong", "late-error", "silent"])
def test_a_call_behind_a_frame_that_is_no_call_waits_for_no_answer_to_it(tmp_path, answer,
                                                                          late):
    """A client's ``ping`` (a JSON frame that is no call) goes upstream untouched, and the
    upstream answers it with a ``pong``, an ``error`` or nothing (``late``: only once the
    call came, before the call's events): the call the client sends next waits for no answer
    to it (the budget is ten minutes: the call is answered within the test's bound only if it
    waits for nothing), and the ``pong`` or ``error`` is passed on, never taken for the
    call's; the socket stays guarded (the call's retry on a new socket is replayed)."""
    scripts = [[], [*answer, *scripted_response()]] if late else [answer, scripted_response()]
    with ScriptedUpstream(scripts) as up, \
            proxy(tmp_path, up, turnguard_request_budget_ms=600_000) as p:
        async def ping_then_call():
            async with WsClient.connect(p.url, headers=HEADERS) as c:
                await c.send({"type": "ping"})
                await c.send(call([user("one")], seed=1))
                got = []
                for _ in range(10):  # bounded: the answer, then the call's events
                    got.append(json.loads(await asyncio.wait_for(c.recv(), 60)))
                    if got[-1]["type"] == "response.completed":
                        return got
                return got

        got = asyncio.run(ping_then_call())
        assert got[:len(answer)] == answer
        answered = got[len(answer):]
        assert types(answered)[-1] == "response.completed" and up.calls == 2
        assert asyncio.run(one_call(p.url, call([user("one")], seed=2))) == answered
        assert up.calls == 2 and len(events(tmp_path, "duplicate_replayed")) == 1
        assert [o["outcome"] for o in events(tmp_path, "outcome")] == ["completed"]
        assert not any("turnguard_request_budget_ms" in e["reason"]
                       for e in events(tmp_path, "passthrough"))
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("keepalive", ["keepalive", {"type": "keepalive"}, b"\x00"],
                         ids=["text", "json", "binary"])
def test_a_keepalive_before_a_calls_first_event_does_not_run_its_duplicate_again(
        tmp_path, keepalive):
    """An upstream (a gateway) that sends a keepalive of its own (text, a JSON frame of
    another type, binary) before the call's first event: it answers no call, so it is passed
    on and the call stays guarded. The same call sent on another socket once the keepalive
    reached the first one's client is held, then attached: one upstream execution, both
    clients get the response, and it is recorded."""
    scripts = [[keepalive, 2.0, *scripted_response()]]
    with ScriptedUpstream(scripts) as up, proxy(tmp_path, up) as p:
        first, second = asyncio.run(_a_call_and_its_duplicate_after_its_first_frame(p.url))
        expected = keepalive if not isinstance(keepalive, dict) else json.dumps(keepalive)
        assert first[0] == expected and json.loads(first[-1])["type"] == "response.completed"
        assert up.calls == 1
        assert second == first[1:]
        outcome = events(tmp_path, "outcome")
        assert [(o["outcome"], o["replayable"]) for o in outcome] == [("completed", True)]
        assert any("before the response's first event" in e["reason"]
                   for e in events(tmp_path, "passthrough"))
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("scripts, pings, wait", [
    # the first ping answered at once, the second only once the call came
    ([[REFUSED], [], [REFUSED, 1.0, *scripted_response()]], 2, True),
    # a keepalive, or a pong sent unasked (a heartbeat), while the socket is idle answers no
    # ping: the ping's answer comes later
    ([["keepalive"], [REFUSED, 1.0, *scripted_response()]], 1, True),
    ([[{"type": "keepalive"}], [REFUSED, 1.0, *scripted_response()]], 1, True),
    ([[PONG], [REFUSED, 1.0, *scripted_response()]], 1, True),
    # a ping answered with a pong, then an error, once the call came
    ([[], [PONG, REFUSED, 1.0, *scripted_response()]], 1, False),
], ids=["two pings", "a keepalive while idle (text)", "a keepalive while idle (json)",
        "a pong while idle", "a pong then an error"])
def test_a_pings_late_answer_is_never_taken_for_the_calls_behind_it(tmp_path, scripts, pings,
                                                                     wait):
    """A client sends pings (frames that are no call) and a call (once something came back,
    ``wait``). The upstream answers in order, each ping with an ``error`` (or not at once): an
    ``error`` before the call's first event answers a ping still unanswered (they are
    counted; a keepalive or a ``pong`` answers none: an upstream may send a ``pong`` unasked,
    or before the ``error`` that answers the same ping), never the call, which runs on. Taken
    for the call's, it ended the call's attempt as rejected while the call ran upstream, and
    its duplicate on another socket ran it a second time."""
    with ScriptedUpstream(scripts) as up, \
            proxy(tmp_path, up, turnguard_request_budget_ms=600_000) as p:
        async def pings_then_call():
            async with WsClient.connect(p.url, headers=HEADERS) as a:
                for _ in range(pings):
                    await a.send({"type": "ping"})
                got = [await asyncio.wait_for(a.recv(), 60)] if wait else []
                await a.send(call([user("hi")], seed=1))
                for _ in range(100):  # bounded: until the call went upstream
                    if up.calls == pings + 1:
                        break
                    await asyncio.sleep(0.02)
                duplicate = asyncio.create_task(messages_of_one_call(
                    p.url, call([user("hi")], seed=2), delay=0.3))
                for _ in range(10):  # bounded: up to the terminal event
                    got.append(await asyncio.wait_for(a.recv(), 60))
                    if "response.completed" in got[-1]:
                        break
                return got, await duplicate

        got, duplicate = asyncio.run(pings_then_call())
        assert json.loads(got[-1])["type"] == "response.completed"
        assert up.calls == pings + 1  # the pings, and the call once
        assert duplicate[-1] == got[-1]
        assert [o["outcome"] for o in events(tmp_path, "outcome")] == ["completed"]
        assert_no_traceback(p.log_text())


def test_a_stray_end_of_the_last_response_does_not_make_a_pings_answer_the_next_calls(
        tmp_path):
    """A call completes; the client sends a ping and a second call; the upstream repeats the
    first response's ``response.completed`` (a stray, passed over), then answers the ping with
    an ``error``, then the second call. The stray is no beginning of the second response: the
    ping is still unanswered when its ``error`` comes, so the second call runs on (before, the
    stray counted as the response's beginning, the ``error`` ended the second call's attempt
    while it ran, and its duplicate ran it again)."""
    item = {"type": "message", "id": "msg_resp_0", "role": "assistant",
            "content": [{"type": "output_text", "text": "hi"}]}
    stray = {"type": "response.completed", "response": {"id": "resp_0", "output": [item]}}
    scripts = [scripted_response(), [], [stray, REFUSED, 1.0, *scripted_response()]]
    with ScriptedUpstream(scripts) as up, proxy(tmp_path, up) as p:
        async def two_calls():
            async with WsClient.connect(p.url, headers=HEADERS) as a:
                await a.send(call([user("one")], seed=1))
                for _ in range(10):  # bounded: up to the first call's terminal event
                    if "response.completed" in await asyncio.wait_for(a.recv(), 60):
                        break
                await a.send({"type": "ping"})
                await a.send(call([user("two")], turn="turn-2", seed=2))
                for _ in range(100):  # bounded: until the second call went upstream
                    if up.calls == 3:
                        break
                    await asyncio.sleep(0.02)
                duplicate = asyncio.create_task(messages_of_one_call(
                    p.url, call([user("two")], turn="turn-2", seed=3), delay=0.3))
                got = []
                for _ in range(10):  # bounded: the stray, the error, then the second call
                    got.append(json.loads(await asyncio.wait_for(a.recv(), 60)))
                    if got[-1]["type"] == "response.completed" \
                            and got[-1]["response"]["id"] == "resp_2":
                        break
                return got, await duplicate

        got, duplicate = asyncio.run(two_calls())
        assert got[-1]["response"]["id"] == "resp_2"
        assert up.calls == 3  # the first call, the ping, the second call once
        assert json.loads(duplicate[-1])["response"]["id"] == "resp_2"
        assert [o["outcome"] for o in events(tmp_path, "outcome")] == ["completed"] * 2
        assert_no_traceback(p.log_text())


def test_a_calls_error_after_its_ping_was_answered_ends_the_call_and_its_retry_goes_on(
        tmp_path):
    """A ping goes upstream and is answered (an ``error``); the client's call is then refused
    (``error`` 429). No ping is unanswered, so the ``error`` is the call's: the call ends at
    once (the circuit learns the 429), and its retry on the same socket goes upstream and is
    answered (had the ``error`` been taken for the ping's, the call would have stayed in
    flight until cut as silent, its retry queued behind it)."""
    limited = {"type": "error", "status": 429, "error": {"code": "rate_limit_exceeded"}}
    scripts = [[REFUSED], [limited], scripted_response()]
    with ScriptedUpstream(scripts) as up, proxy(
            tmp_path, up, turnguard_request_budget_ms=600_000,
            turnguard_response_created_timeout_ms=600_000) as p:
        async def ping_call_retry():
            async with WsClient.connect(p.url, headers=HEADERS) as a:
                await a.send({"type": "ping"})
                got = [json.loads(await asyncio.wait_for(a.recv(), 60))]
                await a.send(call([user("limited")], seed=1))
                got.append(json.loads(await asyncio.wait_for(a.recv(), 60)))
                await a.send(call([user("limited")], seed=2))
                for _ in range(10):  # bounded: up to the retry's terminal event
                    got.append(json.loads(await asyncio.wait_for(a.recv(), 60)))
                    if got[-1]["type"] == "response.completed":
                        break
                return got

        got = asyncio.run(ping_call_retry())
        assert [e.get("status") for e in got[:2]] == [400, 429]
        assert got[-1]["type"] == "response.completed" and up.calls == 3
        assert [o["outcome"] for o in events(tmp_path, "outcome")][-1] == "completed"
        assert any(o.get("status") == 429 for o in events(tmp_path, "outcome"))
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("stray", [PONG, {"type": "keepalive"}], ids=["pong", "json keepalive"])
def test_a_json_frame_of_another_type_inside_a_response_is_none_of_its_events(tmp_path, stray):
    """A ``pong`` or a gateway's JSON keepalive inside a response (after its first event) is
    passed on to the socket's own client only: a duplicate attached to the response, and one
    replayed later, get the response's events without it (before, it was relayed, recorded and
    counted as output)."""
    with ScriptedUpstream([scripted_response(1.0, stray)]) as up, proxy(tmp_path, up) as p:
        async def three():
            first, attached = await _a_call_and_its_duplicate_after_its_first_frame(p.url)
            return first, attached, await messages_of_one_call(p.url, call([user("hi")], seed=3))

        first, attached, replayed = asyncio.run(three())
        assert json.dumps(stray) in first
        without = [m for m in first if m != json.dumps(stray)]
        assert attached == without and replayed == without
        assert up.calls == 1 and len(events(tmp_path, "duplicate_replayed")) == 1
        assert_no_traceback(p.log_text())


def test_a_detached_call_kept_for_a_retry_on_a_socket_is_cut_past_the_cap_once_that_socket_drops(
        tmp_path):
    """The cap (1) is full with an HTTP call whose client left. A call's socket drops while
    its retry, on another socket, is held waiting for it (it is kept: it has a client); then
    the retry's socket drops too: the call now runs without anyone past the cap, and is cut
    (before, a retry leaving by its socket's drop was never heard: two calls ran without a
    client until their windows ended)."""
    from test_e2e_attach import BODY as HTTP_BODY, _raw_post

    slow = {"default": {"kind": "ok", "events": 3, "gap_ms": 100, "first_event_ms": 6000}}
    with MockUpstream(tmp_path, slow) as up, proxy(
            tmp_path, up, turnguard_detach_ms=20000, turnguard_detach_max=1,
            turnguard_response_created_timeout_ms=30000) as p:
        lone = _raw_post(p.port, HEADERS, {**HTTP_BODY, "input": "a turn alone"})
        wait_until(lambda: len(up.dispatches()) == 1, 10, what="the lone turn upstream")
        lone.close()
        time.sleep(0.5)  # (the proxy sees its client gone: it runs without one)

        async def drops():
            a = await WsClient.connect(p.url, headers=HEADERS)
            await a.send(call([user("kept for its retry")], seed=1))
            await asyncio.to_thread(wait_until, lambda: len(up.dispatches()) == 2, 10,
                                    what="the call upstream")
            b = await WsClient.connect(p.url, headers=HEADERS)
            await b.send(call([user("kept for its retry")], seed=2))
            await asyncio.to_thread(wait_until, lambda: events(tmp_path, "duplicate_held"), 10,
                                    what="its retry held")
            a.abort()
            await asyncio.sleep(0.5)
            b.abort()

        asyncio.run(drops())
        cut = wait_until(lambda: [e for e in events(tmp_path, "upstream_detached")
                                  if e.get("cut") == "turnguard_detach_max"], 10,
                         what="a call cut past the cap once its retry's socket dropped")
        assert len(cut) == 1 and len(up.dispatches()) == 2
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("frame, reload", [(PREWARM, False), ("not JSON", False),
                                           (b"\x00binary", False), (PREWARM, True)],
                         ids=["prewarm", "not JSON", "binary", "prewarm, a script reload"])
def test_a_frame_that_is_no_operation_refused_behind_an_unanswered_ping_is_cut_at_the_response_created_timeout(
        tmp_path, frame, reload):
    """A client sends a ``ping`` the upstream never answers, then a prewarm, or a frame
    turnguard cannot read but the upstream may read as a call (text that is not JSON,
    binary), which the upstream refuses with an ``error``. The ``error`` comes while the ping
    is unanswered, so it is taken for the ping's (an ``error`` names no frame), and the frame
    stays in flight with no event. It is timed as a call is: at
    ``turnguard_response_created_timeout_ms`` its upstream is cut (``upstream_cut``,
    ``prewarm`` true for a prewarm) and the socket closes, the call the client sent behind it
    never having gone upstream; its retry on a new socket runs once. Before, such a frame had
    no timer: the call behind it waited ``turnguard_request_budget_ms`` (here ten minutes),
    then went upstream unguarded, the socket let go; nothing closed the socket meanwhile (the
    test client's read gave up after 15 s, and reported that as a close, 1006). A script
    reload while the frame's timer runs hands it to the instance loaded: cut once, by it."""
    refused = {"type": "error", "status": 400, "error": {"code": "refused"}}
    scripts = [[], [refused], scripted_response()]
    timeout_ms = 6000 if reload else 3000  # (past the reload's 1-3 s)
    script = reloadable(tmp_path)
    with ScriptedUpstream(scripts) as up, proxy(
            tmp_path, up, addon=script, turnguard_response_created_timeout_ms=timeout_ms,
            turnguard_request_budget_ms=600_000) as p:
        async def ping_frame_call():
            async with WsClient.connect(p.url, headers=HEADERS) as a:
                await a.send({"type": "ping"})
                await a.send(frame)
                got = [await a.recv(30)]
                if reload:
                    await asyncio.to_thread(lambda: reloaded(p, touch_to_reload(p, script)))
                await a.send(call([user("behind a frame that is no operation")], seed=1))
                for _ in range(10):  # bounded: up to the socket's end or a terminal event
                    try:
                        got.append(await a.recv(30))
                    except TimeoutError:
                        return [*got, "no answer within 30 s"]
                    if not isinstance(got[-1], str) or "response.completed" in got[-1]:
                        break
                return got

        got = asyncio.run(ping_frame_call())
        assert json.loads(got[0]) == refused
        assert len(got) == 2 and isinstance(got[1], Closed), got  # cut: nothing else came
        assert up.calls == 2  # the ping, the frame; the call behind them never went up
        cut = events(tmp_path, "upstream_cut")
        assert [(c["reason"], c["prewarm"], c["cut"], c["after_ms"]) for c in cut] == \
            [("missing_response_created_timeout", frame is PREWARM, True, timeout_ms)]
        assert not events(tmp_path, "outcome")  # no operation
        retry = asyncio.run(one_call(p.url, call([user("behind a frame that is no operation")],
                                                 seed=2)))
        assert types(retry)[-1] == "response.completed" and up.calls == 3
        assert not any("turnguard_request_budget_ms" in e["reason"]
                       for e in events(tmp_path, "passthrough"))
        assert_no_traceback(p.log_text())


def test_a_binary_frame_the_upstream_never_answers_with_nothing_behind_it_leaves_the_socket_open(
        tmp_path):
    """A client's binary frame (a keepalive, say) that its upstream never answers, with no
    frame behind it: the socket stays open past ``turnguard_response_created_timeout_ms``, as
    it does without turnguard; the frame is timed only for a frame that waits behind it
    (``test_a_frame_that_is_no_operation_refused_behind_an_unanswered_ping_is_cut_at_the_response_created_timeout``).
    Before, its upstream was cut as silent at the timeout, and the socket closed, every time
    such a frame went unanswered."""
    with ScriptedUpstream([[]]) as up, proxy(
            tmp_path, up, turnguard_response_created_timeout_ms=1000) as p:
        async def keepalive_then_listen():
            async with WsClient.connect(p.url, headers=HEADERS) as a:
                await a.send(b"\x00keepalive")
                try:
                    return await a.recv(5)  # five timeouts and more: a cut would have come
                except TimeoutError:
                    return "nothing came, the socket open"

        assert asyncio.run(keepalive_then_listen()) == "nothing came, the socket open"
        assert up.calls == 1
        assert not events(tmp_path, "upstream_cut")
        assert_no_traceback(p.log_text())
