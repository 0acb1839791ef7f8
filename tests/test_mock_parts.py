"""The mock upstream's pure parts and the tests' SSE oracle, in-process: the request parser
(h11) fed bytes split anywhere, scenario selection, the Responses API events, and the SSE
writer and reader against each other. The mock as a process is in test_mock_upstream.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnguard_mock.events import ok_events, tool_call_events
from turnguard_mock.scenario import Dispatcher
from turnguard_mock.server import BadRequest, RequestParser
from turnguard_sse import SseReader, frame, parse_sse

# -- the request parser --------------------------------------------------------------------

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
VALUE = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20)


@st.composite
def raw_requests(draw) -> tuple[bytes, tuple[str, str, list[tuple[str, str]], bytes]]:
    """One HTTP/1.1 request as bytes (content-length or chunked body), and what it says."""
    method = draw(st.sampled_from(["POST", "PUT", "GET"]))
    target = "/" + draw(TOKEN) + draw(st.sampled_from(["", "?a=1"]))
    headers = [("host", "127.0.0.1"), *draw(st.lists(st.tuples(
        TOKEN.map(lambda t: "x-" + t), VALUE), max_size=4))]
    body = draw(st.binary(max_size=300)) if method != "GET" else b""
    if method != "GET" and draw(st.booleans()):
        cuts = sorted(set(draw(st.lists(st.integers(0, len(body)), max_size=4))))
        bounds = [0, *cuts, len(body)]
        framed = b"".join(f"{b - a:x}\r\n".encode() + body[a:b] + b"\r\n"
                          for a, b in zip(bounds, bounds[1:]) if b > a) + b"0\r\n\r\n"
        framing = [("transfer-encoding", "chunked")]
    else:
        framed, framing = body, [("content-length", str(len(body)))]
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers + framing) + "\r\n"
    return head.encode() + framed, (method, target, headers + framing, body)


def parse_all(parts: list[bytes]) -> list[tuple[str, str, list[tuple[str, str]], bytes]]:
    """Feed ``parts`` one by one, then EOF; every request parsed, as what it says."""
    parser, out = RequestParser(), []
    for part in [*(p for p in parts if p), b""]:  # b"" is the end of the stream
        parser.feed(part)
        for _ in range(10):
            req = parser.next_request()
            if req is None:
                break
            out.append((req.method, req.target, req.headers, req.body))
    assert parser.at_eof and parser.next_request() is None
    return out


@given(requests=st.lists(raw_requests(), min_size=1, max_size=3), data=st.data())
def test_pipelined_requests_split_anywhere_parse_as_they_were_sent(requests, data):
    stream = b"".join(raw for raw, _ in requests)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(stream)), max_size=8))))
    bounds = [0, *cuts, len(stream)]
    parts = [stream[a:b] for a, b in zip(bounds, bounds[1:])]
    assert parse_all(parts) == [said for _, said in requests]


def test_stray_line_ends_between_requests_are_skipped_up_to_a_bound():
    one = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    assert [r[1] for r in parse_all([one + b"\r\n" * 16 + one])] == ["/", "/"]
    parser = RequestParser()
    parser.feed(b"\r\n" * 17 + one)
    with pytest.raises(BadRequest, match="only empty lines"):
        parser.next_request()


@pytest.mark.parametrize("raw, why", [
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nshort", "complete message"),
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2000\r\n\r\n", "too large"),
    (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n7d0\r\n" + b"x" * 2000,
     "too large"),
    (b"POST / HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(200))
     + b"\r\n", "too many headers"),
    (b"POST / HTTP/1.1\r\ncontent-length: 0\r\n\r\n", "Host"),
    (b"NOT HTTP AT ALL\r\n\r\n", None),
])
def test_what_is_not_a_request_within_the_bounds_is_a_bad_request(raw, why):
    parser = RequestParser(max_body_bytes=1000)
    parser.feed(raw)
    parser.feed(b"")
    with pytest.raises(BadRequest, match=why):
        parser.next_request()


def test_a_client_that_closes_between_requests_is_no_request():
    parser = RequestParser()
    parser.feed(b"")
    assert parser.next_request() is None and parser.at_eof


def test_expect_100_continue_is_told_once_before_the_body():
    parser = RequestParser()
    parser.feed(b"POST / HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
    assert parser.next_request() is None
    assert parser.take_continue() is True and parser.take_continue() is False
    parser.feed(b"{}")
    assert parser.next_request().body == b"{}"


def test_the_bytes_after_an_upgrade_request_are_left_for_the_new_protocol():
    parser = RequestParser()
    parser.feed(b"GET /ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                b"\r\n\x81\x05hello")
    req = parser.next_request()
    assert req.header("Upgrade") == "websocket" and not req.body
    assert parser.take_buffered() == b"\x81\x05hello"


# -- scenario selection --------------------------------------------------------------------


def test_selection_order_and_counters():
    status = lambda code: {"kind": "status", "code": code}  # noqa: E731
    d = Dispatcher({
        "default": status(418),
        "sequence": [status(500)],
        "sessions": {"s1": {"sequence": [status(429)], "default": {"kind": "ok"}},
                     "s2": {"sequence": [status(502)]}},
        "operations": {"abcdef01": {"sequence": [status(503)]}},
    })
    picks = [d.next("s1", "abcdef01" + "0" * 56), d.next("s1", "abcdef01" + "0" * 56),
             d.next("s2", "ff" * 32), d.next("s2", "ff" * 32), d.next(None, "ff" * 32)]
    assert [(p.n, p.selected_by, p.behaviour.get("code")) for p in picks] == [
        (0, "operation", 503), (1, "session", None), (2, "session", 502),
        (3, "default", 418), (4, "default", 418)]
    assert [(p.op_n, p.session_n) for p in picks] == [
        (0, 0), (1, 1), (None, 0), (None, 1), (None, None)]
    d.replace({"sequence": [status(500)]})
    assert (d.next(None, "00" * 32).n, d.counter) == (0, 1)


@pytest.mark.parametrize("bad", [
    {"default": {"kind": "nope"}},
    {"operations": {"XYZ": {}}},
    {"sessions": {"s": {"bogus": 1}}},
    {"default": {"kind": "ok", "events": -1}},
    [],
])
def test_a_bad_scenario_is_refused(bad):
    with pytest.raises(ValueError):
        Dispatcher(bad)


# -- the Responses API events ----------------------------------------------------------------


def test_ok_and_tool_call_events_are_numbered_typed_and_end_completed():
    ok = ok_events("resp_1_x", "m", 3, "hi")
    call = tool_call_events("resp_2_y", "m", "lookup", '{"q":1}', "call_1")
    for events in (ok, call):
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        assert all(d["type"] == t for t, d in events)
        assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
        assert events[-1][1]["response"]["status"] == "completed"
    assert [d["delta"] for t, d in ok if t == "response.output_text.delta"] == ["hi"] * 3
    assert ok[-1][1]["response"]["output"][0]["content"][0]["text"] == "hihihi"
    assert call[-1][1]["response"]["output"][0]["type"] == "function_call"


# -- the SSE writer and reader ---------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
EVENTS = st.lists(st.tuples(st.from_regex(r"[a-z][a-z._]{0,20}", fullmatch=True), JSON),
                  min_size=1, max_size=6)


@given(events=EVENTS, eol=st.sampled_from([b"\n", b"\r\n"]), ascii_only=st.booleans(),
       data=st.data())
def test_the_reader_gets_back_what_the_writer_wrote_however_it_is_split(events, eol, ascii_only,
                                                                       data):
    body = b"".join(frame(t, d, eol=eol, ensure_ascii=ascii_only) for t, d in events)
    assert parse_sse(body) == events
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(body)), max_size=10))))
    bounds = [0, *cuts, len(body)]
    reader = SseReader()
    got = [ev for a, b in zip(bounds, bounds[1:]) for ev in reader.feed(body[a:b])]
    assert got == events and reader.close() == []


def test_an_event_cut_short_is_left_out_by_parse_and_given_by_close():
    body = frame("a", {"type": "a"}) + b'event: b\ndata: {"type": "b"}\n'
    assert parse_sse(body) == [("a", {"type": "a"})]
    reader = SseReader()
    assert reader.feed(body) == [("a", {"type": "a"})]
    assert reader.close() == [("b", {"type": "b"})]


def test_the_type_comes_from_the_data_when_there_is_no_event_field_and_text_stays_text():
    body = b'data: {"type": "t"}\n\n: a comment\n\ndata: line 1\ndata: line 2\n\n'
    assert parse_sse(body) == [("t", {"type": "t"}), ("", "line 1\nline 2")]


def test_the_sse_oracle_shares_no_code_with_the_addon():
    source = (Path(__file__).resolve().parents[1] / "scripts" / "turnguard_sse.py").read_text()
    imported = {n.names[0].name if isinstance(n, ast.Import) else n.module
                for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert not any(name and name.startswith(("turnguard_core", "turnguard_shell", "mitmproxy"))
                   for name in imported), imported
    assert json.loads(frame("x", {"é": 1}, ensure_ascii=False).split(b"data: ")[1]) == {"é": 1}
