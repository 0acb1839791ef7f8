"""turnguard beside mitmproxy's other options and addons, through a real mitmdump: options
and addons that change what reaches turnguard, or what mitmproxy does with a flow after
turnguard's hook: every promise holds, or the flow passes through untouched with its reason."""

from __future__ import annotations

import pytest

from harness import (
    ADDON,
    MockUpstream,
    assert_no_traceback,
    guarded,
    post_turn,
    read_jsonl,
    wait_until,
)


def _events(tmp_path, name="mitmdump"):
    return read_jsonl(tmp_path / f"{name}-events.jsonl")


def test_a_request_body_mitmproxy_streamed_and_stored_is_not_guarded(tmp_path):
    """With ``stream_large_bodies`` mitmproxy streams a large request body upstream as it
    comes; with ``store_streamed_bodies`` too it keeps a copy, so the ``request`` hook (which
    comes only once the body went upstream) sees a whole body. The request went upstream
    already: turnguard can neither hold it nor answer it (mitmproxy sends the upstream's
    answer whatever the hook set), so it must pass it through as "request body is streamed",
    never count it as replayed or held while the upstream runs it again."""
    turn = {"model": "m", "input": "x" * 4096, "stream": True}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, stream_large_bodies="1k", store_streamed_bodies=True) as p:
        answers = [post_turn(p.url, {}, turn, timeout=20) for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200]
        assert len(up.dispatches()) == 2  # streamed: each went upstream before any hook
        decided = ("passthrough", "dispatch", "duplicate_replayed", "request_held")
        events = wait_until(lambda: len(e := [x for x in _events(tmp_path)
                                              if x["event"] in decided]) >= 2 and e,
                            10, what="what turnguard decided for both")
        assert [(e["event"], e.get("reason")) for e in _events(tmp_path)] == [
            ("passthrough", "request body is streamed")] * 2
        assert answers[1][1].get("x-turnguard") is None
        assert_no_traceback(p.log_text())


DROPPER = (
    "def websocket_message(flow):\n"
    "    message = flow.websocket.messages[-1]\n"
    "    if message.from_client and b'forbidden' in message.content:\n"
    "        message.drop()  # a content filter: this frame never goes upstream\n"
)


async def _dropped_alone(url: str) -> list:
    """A frame the dropper drops, alone on its socket, then a call: that call's response."""
    from test_e2e_websocket import HEADERS
    from turnguard_ws import WsClient

    async with WsClient.connect(url, headers=HEADERS) as c:
        await c.send(_ws_call("a forbidden prompt"))
        await c.send(_ws_call("an allowed prompt"))
        return [await c.response(timeout=20)]


async def _dropped_queued(url: str) -> list:
    """A call, a frame the dropper drops queued behind it, then another call: both calls'
    responses."""
    from test_e2e_websocket import HEADERS
    from turnguard_ws import WsClient

    async with WsClient.connect(url, headers=HEADERS) as c:
        await c.send(_ws_call("a slow allowed prompt", seed=1))
        await c.send(_ws_call("a forbidden prompt queued", seed=2))
        await c.send(_ws_call("another allowed prompt", seed=3))
        return [await c.response(timeout=20), await c.response(timeout=20)]


def _ws_call(text: str, seed: int = 0) -> dict:
    from test_e2e_websocket import call, user
    return call([user(text)], seed=seed)


def test_a_websocket_frame_an_earlier_addon_drops_is_neither_a_call_nor_sent(tmp_path):
    """An addon loaded before turnguard drops a client's frame in its ``websocket_message``
    hook (a content filter): that frame never goes upstream, so it is no call of turnguard's.
    Alone on its socket, nothing is in flight for it (the socket's next call is answered at
    once, never held behind it nor cut as a silent upstream); queued behind a response in
    flight, turnguard never sends it upstream when its turn comes."""
    import asyncio

    from test_e2e_websocket import ws_dispatches
    from turnguard_ws import types

    script = tmp_path / "dropper.py"
    script.write_text(DROPPER)

    scenario = {"default": {"kind": "ok", "delay_ms": 500}}
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, addon=script, extra_args=["-s", str(ADDON)],
                    turnguard_response_created_timeout_ms=3000) as p:  # the dropper first
        for case in (_dropped_alone, _dropped_queued):
            got = asyncio.run(case(p.url))
            assert [types(r)[-1] for r in got] == ["response.completed"] * len(got), case
        assert len(ws_dispatches(up)) == 3  # the allowed calls only
        assert [e for e in _events(tmp_path) if e["event"] in ("upstream_cut",
                                                               "eventless_failure")] == []
        assert_no_traceback(p.log_text())


HALTER = (
    "from mitmproxy import exceptions\n"
    "def {hook}(flow):\n"
    "    raise exceptions.AddonHalt()  # no addon after this one handles the event\n"
)


@pytest.mark.parametrize("hook", ["response", "error"])
def test_a_turn_whose_end_hook_an_earlier_addon_halts_is_not_left_in_flight(tmp_path, hook):
    """An addon loaded before turnguard raises ``AddonHalt`` in its ``response`` (or
    ``error``) hook, mitmproxy's way for an addon to say no later addon handles the event:
    turnguard's hook never comes, though the flow ended. The attempt must still end
    (recorded, its duplicates answered), never stay in flight for as long as the process
    lives: every retry held and answered 409, or attached to a stream that never ends."""
    script = tmp_path / "halter.py"
    script.write_text(HALTER.format(hook=hook))
    turn = {"model": "m", "input": f"a turn whose {hook} hook is halted", "stream": True}
    scenario = {"sequence": [{"kind": "reset"}] if hook == "error" else [],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, addon=script, extra_args=["-s", str(ADDON)],
                    turnguard_hold_timeout_ms=8000) as p:  # the halter first
        first = post_turn(p.url, {}, turn, cut_is_error=True, timeout=30)
        assert first[0] == (200 if hook == "response" else 502)
        retry = post_turn(p.url, {}, turn, cut_is_error=True, timeout=30)
        assert retry[0] == 200
        (outcome, *_) = wait_until(lambda: [e for e in _events(tmp_path)
                                            if e["event"] == "outcome"], 10, what="an outcome")
        if hook == "response":  # answered by the first attempt: attached, or replayed
            assert retry[1].get("x-turnguard") in ("attached", "replayed")
            assert (outcome["outcome"], outcome["replayable"]) == ("completed", True)
        else:  # the failed attempt ended: the retry went upstream
            assert outcome["outcome"] == "unknown"
        later = post_turn(p.url, {}, turn, cut_is_error=True, timeout=30)
        assert later[0] == 200 and later[1].get("x-turnguard") == "replayed"
        assert retry[2] == later[2]
        assert len(up.dispatches()) == (1 if hook == "response" else 2)
        assert_no_traceback(p.log_text())


def test_a_turn_whose_responseheaders_hook_an_earlier_addon_halts_runs_once(tmp_path):
    """An addon loaded before turnguard raises ``AddonHalt`` in its ``responseheaders`` hook:
    turnguard never streams the response through its tee, and mitmproxy reads the body whole
    before the ``response`` hook. It is still the upstream's whole answer: its duplicates,
    held meanwhile or sent after, are answered from it, never run upstream again; and a
    stream that outlasts ``turnguard_response_created_timeout_ms`` while turnguard cannot
    read its events is not cut as silent."""
    import concurrent.futures

    script = tmp_path / "halter.py"
    script.write_text(HALTER.format(hook="responseheaders"))
    turn = {"model": "m", "input": "a turn whose responseheaders hook is halted", "stream": True}
    slow = {"kind": "ok", "events": 4, "gap_ms": 400}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, addon=script, extra_args=["-s", str(ADDON)],
                    turnguard_response_created_timeout_ms=800) as p, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:  # the halter first
        first = pool.submit(post_turn, p.url, {}, turn, behaviour=slow, cut_is_error=True,
                            timeout=30)
        wait_until(lambda: up.dispatches(), 10, what="the first dispatch")
        held = post_turn(p.url, {}, turn, cut_is_error=True, timeout=30)
        first = first.result()
        later = post_turn(p.url, {}, turn, cut_is_error=True, timeout=30)
        assert [first[0], held[0], later[0]] == [200, 200, 200]
        assert first[2] == held[2] == later[2]
        assert len(up.dispatches()) == 1
        assert [e for e in _events(tmp_path) if e["event"] == "upstream_cut"] == []
        assert_no_traceback(p.log_text())


def test_a_websocket_mitmproxy_does_not_open_with_websocket_off_passes_and_says_why(tmp_path):
    """With mitmproxy's ``websocket`` option off, a WebSocket upgrade on a guarded route (the
    Codex CLI's transport) becomes a raw TCP stream: turnguard sees none of its calls. The
    socket works as through a plain mitmproxy, its calls unguarded, and turnguard says so
    (``passthrough`` naming the option) rather than nothing at all."""
    import asyncio

    from test_e2e_websocket import HEADERS, ws_dispatches
    from turnguard_ws import WsClient, types

    async def one(url):
        async with WsClient.connect(url, headers=HEADERS) as c:
            await c.send(_ws_call("a call on a socket mitmproxy does not read"))
            return await c.response(timeout=20)

    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, websocket=False) as p:
        got = asyncio.run(one(p.url))
        assert types(got)[-1] == "response.completed"
        assert len(ws_dispatches(up)) == 1
        (said,) = wait_until(lambda: [e for e in _events(tmp_path)
                                      if e["event"] == "passthrough"], 10,
                             what="a passthrough event")
        assert said["transport"] == "ws" and "websocket" in said["reason"]
        assert [e["event"] for e in _events(tmp_path)] == ["passthrough"]
        assert_no_traceback(p.log_text())


def test_a_request_block_list_kills_never_goes_upstream_even_detached(tmp_path):
    """mitmproxy's ``block_list`` with status 444 kills a matching request in its ``request``
    hook, which runs before the scripts' (turnguard's): the request must never go upstream,
    nor be claimed as an attempt. (mitmproxy's kill marks the flow no longer live, and
    turnguard leaves a flow that is not live alone: not dispatched on a detached flow of its
    own, which the kill would not reach.) The next request, not blocked, is guarded as
    usual."""
    blocked = {"model": "m", "input": "a blocked prompt", "stream": True}
    allowed = {"model": "m", "input": "an allowed prompt", "stream": True}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, block_list=[":~hq x-block:444"],
                    turnguard_detach_ms=5000) as p:
        assert post_turn(p.url, {"x-block": "1"}, blocked, timeout=20)[0] == 0  # closed
        assert post_turn(p.url, {}, allowed, cut_is_error=True, timeout=20)[0] == 200
        wait_until(lambda: any(e["event"] == "outcome" for e in _events(tmp_path)), 10,
                   what="the allowed turn's outcome")
        assert len(up.dispatches()) == 1
        assert [e["event"] for e in _events(tmp_path)] == ["dispatch", "outcome"]
        assert_no_traceback(p.log_text())


def test_a_call_whose_websocket_end_hook_an_earlier_addon_halts_is_not_left_in_flight(tmp_path):
    """An addon loaded before turnguard raises ``AddonHalt`` in its ``websocket_end`` hook:
    turnguard never hears that a socket closed. A call in flight on it when its client left
    must still end (an abandoned call, its retry on a new socket dispatched), never stay in
    flight for as long as the process lives, every retry answered ``turn_in_progress``."""
    import asyncio

    from test_e2e_websocket import HEADERS, ws_dispatches
    from turnguard_ws import WsClient, types

    script = tmp_path / "halter.py"
    script.write_text(HALTER.format(hook="websocket_end"))
    frame = _ws_call("a call whose socket's end is halted")

    async def leave_mid_call(url):
        async with WsClient.connect(url, headers=HEADERS) as c:
            await c.send(frame)
            assert json_type(await c.recv(timeout=20)) == "response.created"
            c.abort()  # the client leaves mid-call

    async def retry(url):
        async with WsClient.connect(url, headers=HEADERS) as c:
            await c.send(frame)
            return await c.response(timeout=30)

    # the call left mid-call streams slowly; its retry (dispatched again) at once
    slow = {"sequence": [{"kind": "ok", "events": 6, "gap_ms": 500}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, slow) as up, \
            guarded(tmp_path, up, addon=script, extra_args=["-s", str(ADDON)],
                    turnguard_hold_timeout_ms=8000) as p:  # the halter first
        asyncio.run(leave_mid_call(p.url))
        wait_until(lambda: [e for e in _events(tmp_path) if e["event"] == "outcome"], 10,
                   what="the abandoned call's outcome")
        got = asyncio.run(retry(p.url))
        assert types(got)[-1] == "response.completed"
        assert len(ws_dispatches(up)) == 2
        assert_no_traceback(p.log_text())


def json_type(message) -> str | None:
    import json
    try:
        return json.loads(message).get("type")
    except (TypeError, ValueError, AttributeError):
        return None


KILL_SWITCH = (
    "import os\n"
    "def request(flow):\n"
    "    if os.path.exists({flag!r}) and flow.killable:\n"
    "        flow.kill()  # a kill switch: nothing goes upstream while it is on\n"
)


def test_a_once_recovery_an_addon_kills_before_it_goes_upstream_is_not_spent(tmp_path):
    """In once mode a request held through a cooldown is recovered by exactly one dispatch.
    An addon loaded after turnguard (a kill switch) kills that dispatch in its ``request``
    hook, before anything went upstream: the operation's one recovery was not used (no
    execution whose result is unknown), so a retry after the switch is off is recovered,
    not refused ``upstream_operation_status_unknown`` for good."""
    import test_e2e_circuit as circ

    flag = tmp_path / "kill-switch-on"
    script = tmp_path / "kill_switch.py"
    script.write_text(KILL_SWITCH.format(flag=str(flag)))
    with MockUpstream(tmp_path, circ.STORM) as up, circ.proxy(
            tmp_path, up, extra_args=["-s", str(script)],
            turnguard_recovery_mode="server_anchored_replay_once") as p:
        circ.open_circuit(p.url)
        flag.touch()
        assert circ.post(p.url)[0] == 0  # held through the cooldown, then killed
        flag.unlink()
        status, _, body = circ.post(p.url, timeout=60)
        assert status == 200, body
        assert len(up.dispatches()) == 3  # the two failures, then one recovery that ran
        assert_no_traceback(p.log_text())


HALT_UPSTREAM_FRAMES = (
    "from mitmproxy import exceptions\n"
    "def websocket_message(flow):\n"
    "    if not flow.websocket.messages[-1].from_client:\n"
    "        raise exceptions.AddonHalt()  # the upstream's frames: no later addon's business\n"
)


def test_a_call_whose_events_an_earlier_addon_halts_is_not_cut_as_silent(tmp_path):
    """An addon loaded before turnguard raises ``AddonHalt`` in ``websocket_message`` for
    the upstream's frames: turnguard never reads a call's events, though they reach the
    client. A call that outlasts ``turnguard_response_created_timeout_ms`` is not silent:
    it is never cut (its client gets the whole response), no eventless failure is counted
    against the upstream, and the call is recorded as it ended (its retry on a new socket
    is replayed)."""
    import asyncio

    from test_e2e_websocket import HEADERS, ws_dispatches
    from turnguard_ws import WsClient, types

    script = tmp_path / "halter.py"
    script.write_text(HALT_UPSTREAM_FRAMES)

    async def one(url):
        async with WsClient.connect(url, headers=HEADERS) as c:
            await c.send(_ws_call("a call whose events turnguard never reads"))
            return await c.response(timeout=20)

    slow = {"default": {"kind": "ok", "events": 6, "gap_ms": 300}}  # streaming at once
    with MockUpstream(tmp_path, slow) as up, \
            guarded(tmp_path, up, addon=script, extra_args=["-s", str(ADDON)],
                    turnguard_response_created_timeout_ms=600) as p:  # the halter first
        got = asyncio.run(one(p.url))
        assert types(got)[-1] == "response.completed"
        (outcome,) = wait_until(lambda: [e for e in _events(tmp_path)
                                         if e["event"] == "outcome"], 10, what="its outcome")
        assert (outcome["outcome"], outcome["replayable"]) == ("completed", True)
        again = asyncio.run(one(p.url))
        assert types(again) == types(got)
        assert len(ws_dispatches(up)) == 1
        assert [e for e in _events(tmp_path) if e["event"] in ("upstream_cut",
                                                               "eventless_failure")] == []
        assert_no_traceback(p.log_text())


def test_an_answer_map_local_gives_a_detached_call_reaches_its_client(tmp_path):
    """With ``turnguard_detach_ms`` a dispatch runs on turnguard's own flow, whose hooks
    ``map_local`` gets too: it answers that flow from a local file (nothing goes upstream).
    The client attached to the call gets that answer, as it would without detaching, never
    a 502 "the attempt ended without a response" in its place; and the answer is no
    recording (a later request goes upstream)."""
    turn = {"model": "m", "input": "a prompt map_local answers", "stream": False}
    canned = tmp_path / "canned.json"
    canned.write_text('{"object": "response", "id": "resp_canned", "status": "completed"}')
    rule = f"|~q & ~hq x-canned:.1|/v1/responses|{canned}"
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, map_local=[rule], turnguard_detach_ms=3000) as p:
        canned_answer = post_turn(p.url, {"x-canned": "1"}, turn, timeout=20)
        assert canned_answer[0] == 200, canned_answer[2][:300]
        assert b"resp_canned" in canned_answer[2]
        upstream_answer = post_turn(p.url, {}, turn, timeout=20)
        assert upstream_answer[0] == 200 and b"resp_canned" not in upstream_answer[2]
        assert len(up.dispatches()) == 1
        assert_no_traceback(p.log_text())


def test_an_upstream_mitmproxy_ignores_passes_untouched_and_turnguard_stays_silent(tmp_path):
    """``ignore_hosts`` matching the upstream: mitmproxy relays its connections as raw
    bytes, HTTP and WebSocket alike, and parses nothing, so turnguard sees no flow. Every
    request is answered by the upstream, the same body twice goes upstream twice (no
    replay, no hold), and turnguard writes nothing about them."""
    import asyncio

    from test_e2e_websocket import HEADERS, ws_dispatches
    from turnguard_ws import WsClient, types

    turn = {"model": "m", "input": "a prompt to an ignored host", "stream": True}

    async def one(url):
        async with WsClient.connect(url, headers=HEADERS) as c:
            await c.send(_ws_call("a call to an ignored host"))
            return await c.response(timeout=20)

    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, ignore_hosts=[r"^127\.0\.0\.1:"]) as p:
        answers = [post_turn(p.url, {}, turn, cut_is_error=True, timeout=20) for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200]
        assert [a[1].get("x-turnguard") for a in answers] == [None, None]
        assert types(asyncio.run(one(p.url)))[-1] == "response.completed"
        assert len(up.dispatches()) == 3 and len(ws_dispatches(up)) == 1
        assert _events(tmp_path) == []
        assert_no_traceback(p.log_text())


ANNOTATOR = (
    "from mitmproxy import flow as mflow\n"
    "def request(f):\n"
    "    if f.request.headers.get('x-annotate'):\n"
    "        f.error = mflow.Error('flagged by policy')  # a note: the flow goes on\n"
)


def test_a_flow_error_an_addon_only_notes_is_no_kill(tmp_path):
    """An addon loaded before turnguard sets ``flow.error`` on a request without killing it
    (an annotation). mitmproxy kills a flow only when its error is ``Error.KILLED_MESSAGE``
    (``flow.kill()``): the request goes on. A duplicate of a turn in flight so annotated is
    held and answered with the original's result, never let go and killed as if its user
    had killed it (a lost request)."""
    import concurrent.futures

    script = tmp_path / "annotator.py"
    script.write_text(ANNOTATOR)
    turn = {"model": "m", "input": "a turn an addon annotates", "stream": True}
    slow = {"kind": "ok", "events": 4, "gap_ms": 300}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, addon=script, extra_args=["-s", str(ADDON)]) as p, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:  # the annotator first
        first = pool.submit(post_turn, p.url, {"x-annotate": "1"}, turn, behaviour=slow,
                            cut_is_error=True, timeout=30)
        wait_until(lambda: up.dispatches(), 10, what="the first dispatch")
        held = post_turn(p.url, {"x-annotate": "1"}, turn, cut_is_error=True, timeout=30)
        first = first.result()
        assert [first[0], held[0]] == [200, 200]
        assert first[2] == held[2]
        assert held[1].get("x-turnguard") in ("attached", "replayed")
        assert len(up.dispatches()) == 1
        assert_no_traceback(p.log_text())


def test_a_response_body_size_limit_refuses_is_no_upstream_failure(tmp_path):
    """``body_size_limit`` under a response's Content-Length: mitmproxy refuses the body after
    the ``responseheaders`` hook (its ``error`` hook fires; the client gets mitmproxy's 502).
    The upstream answered, whole and on time: the proxy refused it. That is never an eventless
    failure of the upstream's (enough of them would open a cooldown, 503s for the session):
    it is named ``proxy_body_size_limit`` and does not count for the circuit. A duplicate
    held meanwhile is answered 502 ``proxy_refused_response`` (never a hang), not run upstream
    again to be refused the same way."""
    import concurrent.futures

    import test_e2e_circuit as circ

    turn = {"model": "m", "input": "big", "stream": False}  # (the request is under the limit)
    with MockUpstream(tmp_path) as up, \
            circ.proxy(tmp_path, up, body_size_limit="100",
                       turnguard_response_created_timeout_ms=5000) as p, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        for n in range(3):  # two eventless failures would open the circuit
            answer = post_turn(p.url, circ.ANCHORED, {**turn, "input": f"turn {n}"}, timeout=20)
            assert answer[0] in (0, 502), answer
        assert len(up.dispatches()) == 3  # none refused by a cooldown
        failures = wait_until(lambda: (e := circ.events(tmp_path, "eventless_failure"))[2:]
                              and e, 10, what="three failures")
        assert [(f["failure_class"], f["counts_for_circuit"]) for f in failures] == [
            ("proxy_body_size_limit", False)] * 3
        assert circ.events(tmp_path, "circuit_opened") == []
        slow = {"kind": "ok", "delay_ms": 1500}
        first = pool.submit(post_turn, p.url, circ.ANCHORED, turn, behaviour=slow, timeout=20)
        wait_until(lambda: len(up.dispatches()) == 4, 10, what="the original's dispatch")
        held = post_turn(p.url, circ.ANCHORED, turn, timeout=20)
        assert first.result()[0] in (0, 502)
        assert (held[0], held[1].get("x-turnguard")) == (502, "proxy_refused_response"), held
        assert len(up.dispatches()) == 4
        assert_no_traceback(p.log_text())


def test_a_websocket_frame_a_later_addon_drops_is_not_left_in_flight(tmp_path):
    """An addon loaded after turnguard drops a client's frame in its ``websocket_message``
    hook (a content filter): mitmproxy checks ``message.dropped`` once every addon's hook ran,
    and never sends it. turnguard decided it before the drop (a call on its way upstream, or
    a queued one it sends itself, which the filter sees too), but it never went upstream: it
    is not kept in flight, the socket's next call is answered (never held behind it nor cut
    as a silent upstream), and no eventless failure is counted."""
    import asyncio

    from test_e2e_websocket import ws_dispatches
    from turnguard_ws import types

    script = tmp_path / "dropper.py"
    script.write_text(DROPPER)

    scenario = {"default": {"kind": "ok", "delay_ms": 500}}
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, extra_args=["-s", str(script)],
                    turnguard_response_created_timeout_ms=3000) as p:  # the dropper after
        for case in (_dropped_alone, _dropped_queued):
            got = asyncio.run(case(p.url))
            assert [types(r)[-1] for r in got] == ["response.completed"] * len(got), case
        assert len(ws_dispatches(up)) == 3  # the allowed calls only
        outcomes = wait_until(lambda: (e := [x for x in _events(tmp_path)
                                             if x["event"] == "outcome"])[4:] and e,
                              10, what="five outcomes")
        assert sorted(o["outcome"] for o in outcomes) == ["completed"] * 3 + ["rejected"] * 2
        assert all("dropped" in o["detail"] for o in outcomes if o["outcome"] == "rejected")
        assert [e for e in _events(tmp_path) if e["event"] in ("upstream_cut",
                                                               "eventless_failure")] == []
        assert_no_traceback(p.log_text())


REQUEST_HALTER = (
    "from mitmproxy import exceptions\n"
    "def request(flow):\n"
    "    if flow.request.headers.get('x-halt'):\n"
    "        raise exceptions.AddonHalt()  # no addon after this one handles the request\n"
)


def test_a_request_whose_hook_an_earlier_addon_halts_is_said_to_pass_unguarded(tmp_path):
    """An addon loaded before turnguard raises ``AddonHalt`` in its ``request`` hook:
    turnguard's hook never comes, and the request goes upstream unguarded (the same body
    twice runs twice: nothing held, nothing replayed). turnguard learns of it at the flow's
    response: each such flow gets one ``passthrough`` record saying why, counted in
    ``turnguard_passthrough_total{reason="hook_halted"}``; a request whose hook
    reached turnguard gets none."""
    from harness import metric, metrics_url, scrape

    script = tmp_path / "halter.py"
    script.write_text(REQUEST_HALTER)
    turn = {"model": "m", "input": "a turn whose request hook is halted", "stream": True}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, addon=script, extra_args=["-s", str(ADDON)],
                    turnguard_metrics="127.0.0.1:0") as p:  # the halter first
        answers = [post_turn(p.url, {"x-halt": "1"}, turn, cut_is_error=True, timeout=20)
                   for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200]
        assert len(up.dispatches()) == 2  # unguarded: each ran
        guarded_answer = post_turn(p.url, {}, {**turn, "input": "guarded"}, timeout=20)
        assert guarded_answer[0] == 200
        said = wait_until(lambda: (e := [x for x in _events(tmp_path)
                                         if x["event"] == "passthrough"])[1:] and e,
                          10, what="two passthrough records")
        assert [e.get("reason", "").split(" (")[0] for e in said] == [
            "request hook never reached turnguard"] * 2
        assert len({e["flow"] for e in said}) == 2
        samples = scrape(metrics_url(p))
        assert metric(samples, "turnguard_passthrough_total", reason="hook_halted") == 2
        assert_no_traceback(p.log_text())


FRAME_HALTER = (
    "from mitmproxy import exceptions\n"
    "def websocket_message(flow):\n"
    "    message = flow.websocket.messages[-1]\n"
    "    if message.from_client and b'unguarded' in message.content:\n"
    "        raise exceptions.AddonHalt()  # no addon after this one handles the frame\n"
)


def test_a_websocket_frame_whose_hook_an_earlier_addon_halts_is_said_to_pass(tmp_path):
    """An addon loaded before turnguard raises ``AddonHalt`` in ``websocket_message`` for a
    client's frame: turnguard's hook never comes for it, and it goes upstream unguarded.
    turnguard learns of it once a later message exists (its hooks are over): one
    ``passthrough`` record says why; the socket's next call is guarded as before."""
    import asyncio

    from test_e2e_websocket import HEADERS, ws_dispatches
    from turnguard_ws import WsClient, types

    script = tmp_path / "halter.py"
    script.write_text(FRAME_HALTER)

    async def calls(url):
        async with WsClient.connect(url, headers=HEADERS) as c:
            await c.send(_ws_call("an unguarded prompt"))
            first = await c.response(timeout=20)
            await c.send(_ws_call("a guarded prompt"))
            return [first, await c.response(timeout=20)]

    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, addon=script, extra_args=["-s", str(ADDON)]) as p:
        got = asyncio.run(calls(p.url))
        assert [types(r)[-1] for r in got] == ["response.completed"] * 2
        assert len(ws_dispatches(up)) == 2
        said = wait_until(lambda: [e for e in _events(tmp_path) if e["event"] == "passthrough"],
                          10, what="a passthrough record")
        assert [e["reason"].split(" (")[0] for e in said] == [
            "frame hook never reached turnguard"]
        (outcome,) = wait_until(lambda: [e for e in _events(tmp_path)
                                         if e["event"] == "outcome"], 10, what="an outcome")
        assert outcome["outcome"] == "completed"  # the guarded call's only
        assert_no_traceback(p.log_text())
