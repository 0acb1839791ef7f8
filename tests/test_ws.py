"""The Responses-over-WebSocket core (``turnguard_core.ws``) and identity across transports:
a ``response.create`` frame, its retries and its HTTP POST fallback are one operation."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnguard_core import ws
from turnguard_core.identity import RequestView, Upstream, identify, operation_body
from turnguard_core.sse import SseParser, terminal_kind

SESSION = "01a22e73-8c1f-7fc3-8961-844f4a263337"
HEADERS = (("authorization", "Bearer sk-test"), ("session-id", SESSION))
UPSTREAM = Upstream("http", "127.0.0.1", 9)


def post_body(input_items, **extra) -> dict:
    """A Codex turn request as the HTTP POST fallback sends it."""
    return {
        "model": "gpt-test", "stream": True, "input": input_items, "tool_choice": "auto",
        "parallel_tool_calls": False, "store": False, "prompt_cache_key": SESSION,
        "client_metadata": {"turn_id": "turn-1", "session_id": SESSION,
                            "x-codex-turn-metadata": json.dumps({"turn_id": "turn-1"})},
        **extra,
    }


def frame_of(body: dict, start_ms: int = 1796075676393) -> dict:
    """The same request as a WebSocket frame: ``type`` and the WebSocket-only metadata."""
    meta = {**body["client_metadata"], "x-codex-ws-stream-request-start-ms": str(start_ms),
            "ws_request_header_x_openai_internal_codex_responses_lite": "true"}
    return {"type": "response.create", **body, "client_metadata": meta}


def shuffled(value, rnd: random.Random):
    """``value`` with every object's keys in a random order (Codex's serialisation)."""
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {k: shuffled(value[k], rnd) for k in keys}
    if isinstance(value, list):
        return [shuffled(v, rnd) for v in value]
    return value


def op_key(body: dict, method: str = "POST") -> str:
    return identify(RequestView(method, "/v1/responses", HEADERS,
                                json.dumps(body).encode(), UPSTREAM)).op_key


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


ITEM = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                               max_size=3),
    max_leaves=12,
)


# -- one identity across transports ------------------------------------------------------------
@given(items=st.lists(ITEM, max_size=4), seed=st.integers(0, 2**32 - 1),
       start_ms=st.integers(0, 2**41))
def test_a_frame_its_retries_and_its_post_fallback_are_one_operation(items, seed, start_ms):
    body = post_body(items)
    rnd = random.Random(seed)
    frame = shuffled(frame_of(body, start_ms), rnd)
    retry = shuffled(frame_of(body, start_ms + 250), rnd)
    assert json.dumps(frame) != json.dumps(post_body(items))  # never byte-identical
    assert op_key(frame) == op_key(retry) == op_key(shuffled(body, rnd))


@given(items=st.lists(ITEM, min_size=1, max_size=4), extra=ITEM)
def test_another_input_is_another_operation(items, extra):
    assert op_key(post_body(items)) != op_key(post_body([*items, extra]))


def test_only_transport_fields_are_left_out():
    body = post_body([user("hi")])
    assert operation_body(frame_of(body)) == body
    assert operation_body(body) is body  # nothing to leave out: untouched
    other = {**body, "type": "something.else"}
    assert operation_body(other) == other  # another type is content
    meta = {**body["client_metadata"], "x-codex-window-id": "w:0"}
    assert op_key({**body, "client_metadata": meta}) != op_key(body)


# -- frames ------------------------------------------------------------------------------------
def test_what_a_client_frame_is():
    call = ws.parse_client_frame(json.dumps(frame_of(post_body([user("hi")]))).encode(), True)
    assert isinstance(call, ws.Call) and call.turn_id == "turn-1"
    prewarm = frame_of(post_body([], generate=False))
    prewarm["client_metadata"]["turn_id"] = ""
    assert isinstance(ws.parse_client_frame(json.dumps(prewarm).encode(), True), ws.Prewarm)
    untouched = {  # (awaits: the upstream may read a call in it, so its answer is awaited)
        b"\x00\x01": (False, "binary frame", True),
        b"\xff\xfe": (True, "frame is not UTF-8", True),
        b"not json": (True, "frame is not JSON", True),
        b"[1]": (True, "frame is not a JSON object", True),
        b'{"type":"a","type":"b"}': (True, "duplicate keys in JSON frame", True),
        b'{"type":"response.cancel"}': (True, "frame type 'response.cancel' is not "
                                              "response.create", False),
        b'{"type":"ping"}': (True, "frame type 'ping' is not response.create", False),
        b'{"input":[]}': (True, "frame type 'None' is not response.create", False),
    }
    for content, (is_text, reason, awaits) in untouched.items():
        assert ws.parse_client_frame(content, is_text) == ws.NotACall(reason, awaits)
    deep = b'{"type":"response.create","x":' + b"[" * 300 + b"]" * 300 + b"}"
    assert ws.parse_client_frame(deep, True) == ws.NotACall("JSON nesting too deep")
    assert isinstance(ws.parse_client_frame(b"{}", True, max_bytes=1), ws.NotACall)


@given(st.binary(max_size=64), st.booleans())
def test_parse_client_frame_never_raises(content, is_text):
    assert isinstance(ws.parse_client_frame(content, is_text), (ws.Call, ws.Prewarm, ws.NotACall))


# -- responses and the socket's record ---------------------------------------------------------
def response_frames(rid: str, items: list[dict]) -> list[str]:
    frames = [{"type": "response.created", "response": {"id": rid, "status": "in_progress"}}]
    for i, item in enumerate(items):
        frames += [{"type": "response.output_item.added", "output_index": i, "item": item},
                   {"type": "response.output_item.done", "output_index": i, "item": item}]
    frames.append({"type": "response.completed",
                   "response": {"id": rid, "status": "completed", "output": items}})
    return [json.dumps(f) for f in frames]


def read(frames: list[str], keep: int = 1 << 20) -> ws.ResponseEvents:
    events = ws.ResponseEvents(keep_max_bytes=keep)
    for f in frames:
        events.feed(f)
    return events


def test_response_events_count_output_and_keep_an_sse_body():
    call = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": "exec",
            "input": "text('hi')"}
    events = read(response_frames("resp_1", [call]))
    assert (events.events_seen, events.output_seen) == (4, 3)
    assert events.terminal == "success" and events.response_id == "resp_1"
    assert events.output_items == [call]
    parsed = SseParser().feed(events.sse_body)
    assert [e.type for e in parsed] == ["response.created", "response.output_item.added",
                                        "response.output_item.done", "response.completed"]
    assert ws.frames_of_recording(events.sse_body) == response_frames("resp_1", [call])


def test_an_error_event_before_output_is_a_failure_without_output():
    events = read([json.dumps({"type": "response.created", "response": {"id": "r"}}),
                   json.dumps({"type": "error", "status": 503, "error": {"code": "x"}})])
    assert (events.output_seen, events.terminal, events.terminal_type) == (0, "failure", "error")
    assert events.error_status == 503 and events.sse_body is None
    assert read(["not json", "{}", '{"type": 1}']).unreadable == 3


_FRAMES = response_frames("resp_9", [{"type": "message", "role": "assistant", "content": []}])
upstream_frames = st.lists(st.one_of(
    st.sampled_from(_FRAMES + ['{"type":"response.create"}', '{"type": 1}', "[]",
                               ' {"type":"x"}']),
    st.text(max_size=12),
    st.builds(lambda t, v: json.dumps({"type": t, "v": v}), st.text(max_size=8), st.integers()),
), max_size=12)


def _state(events: ws.ResponseEvents) -> tuple:
    return (events.events_seen, events.output_seen, events.unreadable, events.terminal,
            events.terminal_type, events.error_status, events.response_id, events.output_items,
            events.over_cap, events.sse_body)


@given(upstream_frames, st.sampled_from([0, 64, 1 << 20]), st.sampled_from([8, 1 << 20]))
def test_a_frame_read_once_by_upstream_event_feeds_as_a_frame_read_twice(frames, keep, max_event):
    once = ws.ResponseEvents(keep_max_bytes=keep, max_event_bytes=max_event)
    twice = ws.ResponseEvents(keep_max_bytes=keep, max_event_bytes=max_event)
    for text in frames:
        speaks, event = ws.upstream_event(text)
        assert speaks == ws.speaks_responses(text)
        assert once.feed(text, event) == twice.feed(text)
    assert _state(once) == _state(twice)


_ANY_TYPE = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=())),  # lone surrogates too
    st.sampled_from(['x\ndata: {"type":"response.failed"}\n\nevent: y', "a\rb", "\ud800"]),
).filter(lambda t: terminal_kind(t) is None)  # (a replay ends at the first terminal event)


@given(st.lists(_ANY_TYPE, min_size=1, max_size=6))
def test_the_recording_replays_exactly_the_frames_kept_whatever_their_type(types_):
    """An event's type is any JSON string: a line break in it must not write SSE fields of
    its own (a fake ``response.failed`` in the replay), a lone surrogate must not break the
    recording."""
    frames = [json.dumps({"type": t, "n": i}) for i, t in enumerate(types_)]
    frames.append(json.dumps({"type": "response.completed", "response": {"id": "r"}}))
    events = read(frames)
    assert events.events_seen == len(frames)
    assert ws.frames_of_recording(events.sse_body) == frames


def test_a_frame_too_large_to_read_speaks_responses_but_is_read_by_feed_alone():
    big = json.dumps({"type": "response.output_text.delta", "delta": "x" * 100})
    assert ws.upstream_event(big, max_bytes=10) == (True, None)
    assert ws.upstream_event('{"type":"response.create"}') == (False, {"type": "response.create"})


def test_events_over_the_cap_are_not_kept():
    events = read(response_frames("r", [user("x" * 100)]), keep=100)
    assert events.over_cap and events.sse_body is None
    assert events.terminal == "success"


def test_a_delta_frame_is_rebuilt_to_the_full_request_of_a_new_socket():
    """The measured sequence: prewarm, a turn with a tool call, its follow-up as a delta on the
    same socket; on a new socket (or over HTTP) the same follow-up is a full resend."""
    record = ws.SocketRecord()
    prewarm = {"type": "response.create", "input": [], "generate": False}
    record.remember(prewarm, read(response_frames("resp_pre", [])), from_upstream=True)
    first_items = [user("run the tool")]
    first = record.full_request(post_body(first_items, previous_response_id="resp_pre"))
    assert first.rebuilt and first.body == post_body(first_items)
    call = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": "exec",
            "input": "x"}
    record.remember(first.body, read(response_frames("resp_1", [call])), from_upstream=True)
    output = {"type": "custom_tool_call_output", "call_id": "call_1", "output": "hello"}
    delta = frame_of(post_body([output], previous_response_id="resp_1"))
    full = record.full_request(delta)
    resend = frame_of(post_body([*first_items, call, output]))
    assert full.rebuilt and op_key(full.body) == op_key(resend) == op_key(
        post_body([*first_items, call, output]))
    assert record.outbound(delta, full) is None  # the upstream knows resp_1: send the delta


def test_a_delta_frame_has_the_identity_of_codexs_resend_of_the_items_it_keeps():
    """The Codex CLI (0.171.0, measured) keeps a response's output items in its history and
    resends them with its own bookkeeping (``internal_chat_message_metadata_passthrough``)
    and a reasoning item's ``"content": null``: the delta frame rebuilt from the socket's
    record (the items as the upstream sent them) is still the resend's operation."""
    record = ws.SocketRecord()
    first_items = [user("run the tool")]
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gA"}
    message = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "let me look", "annotations": []}]}
    call = {"type": "function_call", "id": "fc_1", "status": "completed", "name": "exec",
            "arguments": "{}", "call_id": "call_1"}
    record.remember(post_body(first_items),
                    read(response_frames("resp_1", [reasoning, message, call])),
                    from_upstream=True)
    output = {"type": "function_call_output", "call_id": "call_1", "output": "hello"}
    full = record.full_request(frame_of(post_body([output], previous_response_id="resp_1")))
    kept = {"internal_chat_message_metadata_passthrough": {"turn_id": "turn-1"}}
    resent = [{**reasoning, "content": None, **kept}, {**message, **kept}, {**call, **kept}]
    resend = post_body([*first_items, *resent, output])
    assert op_key(full.body) == op_key(frame_of(resend)) == op_key(resend)
    # what the model reads still tells calls apart
    assert op_key(resend) != op_key(post_body([*first_items, *resent[:2], output]))


def test_a_response_the_upstream_never_saw_is_continued_with_the_full_input():
    record = ws.SocketRecord()
    items = [user("hi")]
    record.remember(post_body(items), read(response_frames("resp_r", [user("a")])),
                    from_upstream=False)  # turnguard replayed it
    delta = frame_of(post_body([user("more")], previous_response_id="resp_r"))
    full = record.full_request(delta)
    assert record.outbound(delta, full) == full.body
    assert "previous_response_id" not in full.body
    assert full.body["input"] == [*items, user("a"), user("more")]


def test_an_unknown_previous_response_stands_for_itself():
    record = ws.SocketRecord()
    delta = frame_of(post_body([user("more")], previous_response_id="resp_elsewhere"))
    full = record.full_request(delta)
    assert (full.rebuilt, full.unresolved) == (False, "resp_elsewhere")
    assert record.outbound(delta, full) is None and full.body is delta


def test_a_failed_response_is_not_remembered_and_the_record_is_bounded():
    record = ws.SocketRecord()
    failed = read([json.dumps({"type": "response.created", "response": {"id": "rf"}}),
                   json.dumps({"type": "response.failed", "response": {"id": "rf"}})])
    record.remember(post_body([]), failed, from_upstream=True)
    assert record.full_request(post_body([], previous_response_id="rf")).unresolved == "rf"
    for i in range(ws.MAX_REMEMBERED + 2):
        record.remember(post_body([]), read(response_frames(f"r{i}", [])), from_upstream=True)
    assert record.full_request(post_body([], previous_response_id="r0")).unresolved == "r0"
    assert not record.upstream_knows("r0") and record.upstream_knows(f"r{ws.MAX_REMEMBERED + 1}")


def test_turnguard_answers_are_error_events_with_a_numeric_status():
    body = json.dumps({"error": {"code": "turn_in_progress", "message": "m"}}).encode()
    event = json.loads(ws.error_frame(409, body))
    assert event == {"type": "error", "status": 503,
                     "error": {"code": "turn_in_progress", "message": "m"}}
    assert json.loads(ws.error_frame(422, b"not json"))["status"] == 422
    assert json.loads(ws.error_frame(503, b"[]"))["error"]["code"] == "turnguard_error"


def test_a_recording_that_is_not_an_event_stream_has_no_frames():
    assert ws.frames_of_recording(b'{"id": "resp_1"}') is None
    assert ws.frames_of_recording(b"data: not json\n\n") is None
    assert ws.frames_of_recording(b'data: {"type":"x"}\n\ndata: [DONE]\n\n') == ['{"type":"x"}']


def test_a_live_event_stream_becomes_frames_up_to_its_first_terminal_event():
    to_frames = ws.SseToFrames()
    delta, done = '{"type":"response.output_text.delta"}', '{"type":"response.completed"}'
    assert to_frames.feed(f"data: {delta}\n\ndata: [DONE]\n\nda".encode()) == [delta]
    assert not to_frames.ended
    assert to_frames.feed(f"ta: {done}\n\ndata: {done}\n\n".encode()) == [done]
    assert to_frames.ended and to_frames.feed(f"data: {delta}\n\n".encode()) == []


def test_a_recording_replays_on_a_socket_up_to_its_first_terminal_event():
    """What an HTTP response carried after its terminal event would, on a socket, come after
    the response's end: the client would read it as its next call's."""
    done = '{"type":"response.completed","response":{"id":"r"}}'
    late = '{"type":"error","status":500}'
    body = f"data: {done}\n\ndata: {late}\n\ndata: {done}\n\n".encode()
    assert ws.frames_of_recording(body) == [done]


@pytest.mark.parametrize("text, unanswered, kind", [
    ('{"type":"response.created","response":{"id":"r"}}', True, "begins"),
    ('{"type":"response.output_text.delta","delta":"x"}', False, "begins"),
    ('{"type":"error","status":400}', False, "begins"),
    ('{"type":"error","status":400}', True, "passes"),
    ('{"type":"keepalive"}', False, "passes"),
    ('{"type":"pong"}', False, "passes"),
    ("keepalive", False, "passes"),
    ('{"no":"type"}', False, "passes"),
    ('{"type":"response.create","input":[]}', False, "echo"),
    ('{"type":"response.cancel"}', False, "echo"),
])
def test_first_frame_tells_a_calls_answer_from_what_answers_no_call(text, unanswered, kind):
    speaks, event = ws.upstream_event(text)
    assert ws.first_frame(speaks, event, unanswered=unanswered) == kind


def test_a_first_frame_too_large_to_read_begins_the_answer_and_a_binary_one_passes():
    assert ws.first_frame(*ws.upstream_event("x" * 20, max_bytes=10), unanswered=True) == "begins"
    assert ws.first_frame(False, None, unanswered=False) == "passes"


@pytest.mark.parametrize("text, answers, of_a_response", [
    ('{"type":"pong"}', False, False),  # (one may come unasked: a heartbeat)
    ('{"type":"error","status":400}', True, True),
    ('{"type":"keepalive"}', False, False),
    ('{"type":"response.created","response":{"id":"r"}}', False, True),
    ('{"type":"response.output_text.delta","delta":"x"}', False, True),
])
def test_what_answers_a_frame_that_is_no_call_and_what_belongs_to_a_response(
        text, answers, of_a_response):
    """An ``error`` is taken for the answer to a client's ``ping`` (a ``pong``, which may come
    unasked, or a keepalive answer nothing); inside a response only ``response.*`` events and
    its ``error`` are its own."""
    event = ws.upstream_event(text)[1]
    assert ws.answers_a_frame(event) is answers
    assert ws.is_response_event(event) is of_a_response
    assert not ws.answers_a_frame(None)


def test_an_error_answers_one_frame_that_is_no_call_and_nothing_else_does():
    error, pong = (ws.upstream_event(t)[1] for t in ('{"type":"error"}', '{"type":"pong"}'))
    assert ws.unanswered_after(2, error) == 1 and ws.unanswered_after(0, error) == 0
    assert ws.unanswered_after(2, pong) == 2 and ws.unanswered_after(2, None) == 2
