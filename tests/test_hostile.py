"""Hostile and odd input through a real mitmdump + turnguard: generated requests, generated
upstream responses (SSE split anywhere, malformed lines, huge events, gzip/zstd, chunked,
content-length and close-delimited bodies), WebSocket upgrades, HEAD and GET.

Everything must pass or get a clear error, no exception may escape a hook (the mitmdump log has
no traceback), every request gets an answer, and mitmdump's memory stays bounded.

The upstream here is ``ScriptedUpstream``, the mock package's HTTP/1.1 server in a thread of
the test process: a request names its script (status, headers, body parts, framing) in an
``x-script`` header, so that the bytes and their split are exactly what the test chose."""

from __future__ import annotations

import asyncio
import base64
import collections
import gzip
import itertools
import json
import os
import socket
import struct
import threading
import zlib
from pathlib import Path

import brotli
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harness import (
    Mitmdump,
    assert_no_traceback,
    default_tls,
    read_jsonl,
    rss_kb,
    upstream_of,
    wait_until,
)
from hypothesis_profiles import examples
from turnguard_mock.server import LAST_CHUNK, Connection, Request, ServerThread, response_head
from turnguard_mock.server import chunk as one_chunk
from turnguard_mock.websocket import WebSocket
from turnguard_sse import frame as sse_frame

try:  # the same zstd mitmproxy uses
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # Python < 3.14
    from backports import zstd  # type: ignore[no-redef]

from turnguard_core import identity
from turnguard_core.sse import SseParser, after, event_kind

_ids = itertools.count()


# -----------------------------------------------------------------------------------------------
# The scripted upstream


class ScriptedUpstream:
    """The mock package's HTTP/1.1 server on 127.0.0.1 (port chosen by the OS) in a background
    thread of the test process, answering each request with a script.

    ``add(script) -> id``; a request with ``x-script: id`` is answered by that script:
    ``{"status", "headers": [(k, v)], "parts": [bytes], "framing": "length"|"chunked"|"close",
    "gap_s"}``. Without ``x-script``: a small completed SSE stream for POST, ``ok`` otherwise.
    ``Upgrade: websocket`` gets a handshake and an echo of each message. Every response closes
    its connection. ``hits[id]`` counts the requests each script answered."""

    def __init__(self) -> None:
        self.scripts: dict[str, dict] = {}
        self.hits: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self._lock = threading.Lock()
        self._server = ServerThread(self._respond, name="scripted-upstream")
        self.url = self._server.url

    def add(self, script: dict) -> str:
        sid = f"s{next(_ids)}"
        with self._lock:
            self.scripts[sid] = script
        return sid

    def stop(self) -> None:
        self._server.stop()

    async def _respond(self, conn: Connection, req: Request) -> bool:
        with self._lock:
            self.requests += 1
        if (req.header("upgrade") or "").lower() == "websocket":
            ws = await WebSocket.accept(conn, req)
            await ws.echo(max_messages=16)
            return False
        sid = req.header("x-script")
        with self._lock:
            script = self.scripts.get(sid) if sid else None
            if script is not None:
                self.hits[sid] += 1
        await self._write(conn, req.method, script or _default_script(req.method))
        return False

    @staticmethod
    async def _write(conn: Connection, method: str, s: dict) -> None:
        """The script's bytes, as it frames them: ``length`` (``length_short`` announces 10
        bytes it never sends), ``chunked`` (``chunked_cut``: no last chunk), ``close`` (the
        end of the body is the end of the connection); ``gap_s`` between the parts."""
        parts = [p for p in s.get("parts", []) if p]
        framing = s.get("framing", "length")
        headers = list(s.get("headers", []))
        if framing in ("length", "length_short"):
            extra = 10 if framing == "length_short" else 0
            headers.append(("content-length", str(sum(len(p) for p in parts) + extra)))
        elif framing in ("chunked", "chunked_cut"):
            headers.append(("transfer-encoding", "chunked"))
        headers.append(("connection", "close"))
        await conn.send(response_head(s.get("status", 200), headers))
        if method == "HEAD":
            return
        gap = s.get("gap_s", 0)
        for part in parts:
            await conn.send(one_chunk(part) if framing.startswith("chunked") else part)
            if gap:
                await asyncio.sleep(gap)
        if framing == "chunked":
            await conn.send(LAST_CHUNK)


def _default_script(method: str) -> dict:
    if method == "POST":
        return {"headers": [("content-type", "text/event-stream")], "framing": "chunked",
                "parts": [sse(t, {"type": t, "response": {"id": "resp_default"}})
                          for t in ("response.created", "response.completed")]}
    return {"headers": [("content-type", "text/plain")], "parts": [b"ok"]}


def _ws_frame(opcode: int, payload: bytes) -> bytes:
    """One masked WebSocket frame from the client, written by hand (an oracle independent of
    wsproto, which both the upstream and mitmproxy use)."""
    head = bytes([0x80 | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    key = os.urandom(4)
    return head + key + bytes(c ^ key[i % 4] for i, c in enumerate(payload))


def sse(event_type: str, data: dict, eol: bytes = b"\n") -> bytes:
    """One event, non-ASCII text kept as UTF-8 (so that a split can cut a character)."""
    return sse_frame(event_type, data, eol=eol, ensure_ascii=False)


# -----------------------------------------------------------------------------------------------
# The rig: one upstream and one mitmdump for the module


class Rig:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.events_path = tmp / "events.jsonl"
        self.up = ScriptedUpstream()
        try:
            self.proxy = Mitmdump(tmp, self.up.url, options={
                "turnguard_ledger": str(tmp / "ledger.sqlite3"),
                "turnguard_events": str(self.events_path),
            })
        except BaseException:
            self.up.stop()
            raise
        self.client = httpx.Client(trust_env=False, timeout=60, verify=default_tls())
        self.rss: dict[str, int] = {}

    def events(self, kind: str) -> list[dict]:
        return [e for e in read_jsonl(self.events_path) if e["event"] == kind]

    def close(self) -> None:
        try:
            self.client.close()
            self.proxy.stop()
        finally:
            self.up.stop()


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    r = Rig(tmp_path_factory.mktemp("hostile"))
    try:
        # warm up (imports, first ledger writes) before the first memory reading
        for i in range(20):
            r.client.post(r.proxy.url + "/v1/responses", content=json.dumps({"warm": i}).encode(),
                          headers={"content-type": "application/json"})
        r.rss["start"] = rss_kb(r.proxy.pid)
        yield r
    finally:
        r.close()


def raw_post(rig: Rig, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    """POST and read the body as it came over the wire (content-encoding kept). A body cut
    short is returned as far as it came, with ``x-test-cut: 1`` added to the headers."""
    with rig.client.stream("POST", rig.proxy.url + path, content=body, headers=headers) as r:
        data, h = b"", dict(r.headers)
        try:
            for chunk in r.iter_raw():
                data += chunk
        except httpx.HTTPError:
            h["x-test-cut"] = "1"
        return r.status_code, h, data


# -----------------------------------------------------------------------------------------------
# Hostile requests

HEADER_VALUE = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=60,
)
SPECIAL_HEADERS = st.dictionaries(
    st.sampled_from([
        "authorization", "chatgpt-account-id", "session-id", "session_id", "conversation_id",
        "x-codex-turn-metadata", "x-codex-turn-state", "idempotency-key", "accept",
        "content-type", "x-stainless-retry-count", "openai-organization",
    ]),
    HEADER_VALUE | st.sampled_from(['{"session_id": "s"}', '{"session_id": 5}', "[", "{}"]),
    max_size=6,
)
EXTRA_HEADERS = st.dictionaries(
    st.from_regex(r"x-h-[a-z0-9-]{1,20}", fullmatch=True), HEADER_VALUE, max_size=4
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
NASTY_BODIES = st.sampled_from([
    b"", b"{", b"null", b"[]", b'"just a string"', b"\xef\xbb\xbf{\"bom\": 1}",
    b'{"a": 1, "a": 2}', b'{"bad utf8": "\xff\xfe"}', b'{"nan": NaN, "inf": -Infinity}',
    b'{"lone": "\\ud800"}', b'{"big": 1' + b"0" * 5000 + b"}", b'{"e": 1e999999}',
    b'{"x":' * 300 + b"1" + b"}" * 300, b'{"x":' * 5000 + b"1" + b"}" * 5000,
    b"[" * 100_000 + b"]" * 100_000, b'{"input": "\x00 nul"}', b"\x1f\x8b\x08\x00junk",
])
BODIES = (
    JSON_VALUES.map(lambda v: json.dumps(v).encode())
    | st.dictionaries(st.sampled_from(["model", "input", "stream", "previous_response_id"]),
                      JSON_VALUES, min_size=1).map(lambda d: json.dumps(d).encode())
    | st.binary(max_size=300)
    | NASTY_BODIES
    | st.integers(100_000, 2_000_000).map(lambda n: json.dumps({"input": "y" * n}).encode())
)
GUARDED_PATHS = ["/v1/responses", "/v1/chat/completions", "/backend-api/codex/responses",
                 "/v1/responses?stream=true", "/v1/responses/"]
PATHS = st.sampled_from(GUARDED_PATHS + ["/v1/other", "/v1/responses/resp_1", "/"])
METHODS = st.sampled_from(["POST"] * 6 + ["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])


@settings(max_examples=examples(70), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.large_base_example])
@given(method=METHODS, path=PATHS, special=SPECIAL_HEADERS, extra=EXTRA_HEADERS, body=BODIES,
       encoding=st.sampled_from([None, None, None, "gzip", "br", "zstd", "x-unknown"]))
def test_generated_requests_all_get_an_answer(rig, method, path, special, extra, body, encoding):
    headers = {k: v.encode("latin-1") for k, v in {**special, **extra}.items()}
    if encoding:
        headers["content-encoding"] = encoding.encode()  # a claim the body may not honour
    r = rig.client.request(method, rig.proxy.url + path, content=body, headers=headers)
    # a healthy upstream answers everything 200: turnguard may add only its clear errors
    if r.status_code >= 400:
        assert r.headers.get("content-type", "").startswith("application/json"), r.text[:300]
        assert r.json()["error"]["code"] in {"idempotency_key_conflict"}, r.text[:300]


RAW_REQUESTS = [
    # chunked request body on a guarded route
    b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\n\r\n",
    # Expect: 100-continue
    b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 8\r\n"
    b"\r\n{\"b\": 2}",
    # both Content-Length and Transfer-Encoding
    b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n{}",
    b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    b"POST /v1/responses HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    b"GARBAGE\r\n\r\n",
    b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{\"short\": 1}",
]


@pytest.mark.parametrize("raw", RAW_REQUESTS, ids=range(len(RAW_REQUESTS)))
def test_malformed_raw_requests_get_an_answer_or_a_close(rig, raw):
    with socket.create_connection(("127.0.0.1", rig.proxy.port), timeout=10) as s:
        s.sendall(raw)
        if raw.endswith(b'{"short": 1}'):  # shorter than announced: the client gives up
            s.shutdown(socket.SHUT_WR)
        data = b""
        for _ in range(1000):  # bounded; each recv waits at most 10 s
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            data += chunk
    assert data == b"" or data.startswith(b"HTTP/1."), data[:200]
    if b"Transfer-Encoding: chunked\r\n\r\n5\r\n" in raw:
        assert data.startswith(b"HTTP/1.1 200"), data[:200]


def test_very_large_request_body_is_guarded_and_replayed(rig):
    body = json.dumps({"model": "m", "input": "z" * (20 * 1024 * 1024), "n": next(_ids)}).encode()
    h = {"content-type": "application/json", "accept": "text/event-stream"}
    op = identity.identify(identity.RequestView("POST", "/v1/responses", tuple(h.items()), body,
                                                upstream_of(rig.up.url)))
    first = raw_post(rig, "/v1/responses", body, h)
    wait_until(lambda: any(e.get("op") == op.op_id for e in rig.events("outcome")), 10,
               what="the outcome of the first")
    second = raw_post(rig, "/v1/responses", body, h)
    assert first[0] == second[0] == 200
    assert second[1].get("x-turnguard") == "replayed" and second[2] == first[2]
    rig.rss["after_large_request"] = rss_kb(rig.proxy.pid)


# -----------------------------------------------------------------------------------------------
# Hostile upstream responses

EVENT_TYPES = ["response.created", "response.in_progress", "response.output_text.delta",
               "response.output_item.done", "response.completed", "response.incomplete",
               "response.failed", "error", "weird.thing", ""]


@st.composite
def sse_lines(draw) -> bytes:
    """One block of an SSE stream: a well-formed event or something odd."""
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    kind = draw(st.sampled_from(["event", "event", "event", "data_only", "comment", "no_colon",
                                 "garbage", "bad_utf8", "multi_data", "id_retry", "blank"]))
    t = draw(st.sampled_from(EVENT_TYPES))
    if kind == "event":
        return sse(t, {"type": t, "text": draw(st.text(max_size=20))}, eol)
    if kind == "data_only":
        return b"data: " + json.dumps({"type": t}).encode() + eol + eol
    if kind == "comment":
        return b": keep-alive " + draw(st.binary(max_size=10)).replace(b"\n", b"").replace(
            b"\r", b"") + eol
    if kind == "no_colon":
        return b"event" + eol + b"data" + eol + eol
    if kind == "garbage":
        return draw(st.binary(max_size=40))
    if kind == "bad_utf8":
        return b"event: " + t.encode() + eol + b"data: \xff\xfe\xc3" + eol + eol
    if kind == "multi_data":
        return b"event: " + t.encode() + eol + b"data: {\"a\":" + eol + b"data: 1}" + eol + eol
    if kind == "id_retry":
        return b"id: 7\x00" + eol + b"retry: abc" + eol + b"id: 8" + eol
    return eol


@st.composite
def upstream_responses(draw) -> dict:
    status = draw(st.sampled_from([200] * 8 + [201, 400, 429, 500, 503]))
    body = draw(st.sampled_from([b"", b"\xef\xbb\xbf"])) + b"".join(
        draw(st.lists(sse_lines(), max_size=10)))
    ending = draw(st.sampled_from(["response.completed", "response.incomplete",
                                   "response.failed", "error", None, None]))
    if ending:
        body += sse(ending, {"type": ending})
    if status >= 400:
        body = json.dumps({"error": {"message": "no", "type": "x", "code": "x"}}).encode()
    ctype = draw(st.sampled_from(["text/event-stream"] * 5 + [
        "text/event-stream; charset=utf-8", "TEXT/EVENT-STREAM", "application/json",
        "text/plain"]))
    encoding = draw(st.sampled_from(["identity", "identity", "gzip", "zstd", "bogus-gzip"]))
    encoded = body
    headers = [("content-type", ctype), ("x-codex-turn-state", "ts_hostile")]
    if encoding == "gzip":
        encoded = gzip.compress(body)
    elif encoding == "zstd":
        encoded = zstd.compress(body)
    if encoding != "identity":
        headers.append(("content-encoding", "gzip" if encoding == "bogus-gzip" else encoding))
    framing = draw(st.sampled_from(["length", "chunked", "close"] * 3
                                   + ["length_short", "chunked_cut"]))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(encoded)), max_size=12))))
    bounds = [0, *cuts, len(encoded)]
    parts = [encoded[a:b] for a, b in zip(bounds, bounds[1:])]
    return {"status": status, "headers": headers, "parts": parts, "framing": framing,
            "_body": body, "_encoded": encoded, "_encoding": encoding, "_ctype": ctype}


def truncated(script: dict) -> bool:
    return script["framing"] in ("length_short", "chunked_cut")


def unreadable(script: dict) -> bool:
    """A 2xx event stream whose content coding cannot be undone (not gzip at all): it
    completes when it came whole, and is never recorded."""
    return (script["_encoding"] == "bogus-gzip" and script["_body"] != b""
            and script["_ctype"].lower().startswith("text/event-stream"))


def expected_completion(script: dict) -> tuple[bool, int | None]:
    """(completed?, events counted) by the rules: a 2xx SSE stream completes on a terminal
    success event (one sent content-coded is read decoded at its end, as far as it came); any other 2xx
    body, or an event stream whose coding cannot be undone, completes when it came whole;
    an error status is rejected. Events are counted with turnguard's own parser over the whole
    body at once, so a difference means the split changed the result."""
    if not 200 <= script["status"] < 300:
        return False, None
    if not script["_ctype"].lower().startswith("text/event-stream") or unreadable(script):
        return not truncated(script), None
    parser = SseParser()
    evs = parser.feed(script["_body"]) + parser.close()
    terminal = None
    for ev in evs:
        kind = event_kind(ev)
        terminal = terminal if kind is None else after(terminal, kind)
    return terminal == "success", len(evs)


def _send_scripted(rig: Rig, script: dict, tag: str) -> tuple[tuple[int, dict, bytes], list[dict]]:
    sid = rig.up.add(script)
    body = json.dumps({"model": "m", "input": f"hostile {tag} {sid}", "stream": True}).encode()
    # the client accepts every coding the upstream may send, so that its retry is replayed byte
    # for byte (a client that does not is tested in test_isolation.py)
    h = {"content-type": "application/json", "accept": "text/event-stream", "x-script": sid,
         "authorization": "Bearer sk-hostile", "session-id": f"hostile-{sid}",
         "accept-encoding": "gzip, deflate, br, zstd"}
    op = identity.identify(identity.RequestView("POST", "/v1/responses", tuple(h.items()), body,
                                                upstream_of(rig.up.url)))

    def of_op() -> list[dict]:
        return [e for e in read_jsonl(rig.events_path) if e.get("op") == op.op_id]

    first = raw_post(rig, "/v1/responses", body, h)
    # the outcome is recorded when mitmproxy's response/error hook ran, which may be a moment
    # after the client read the last byte
    new = wait_until(lambda: (n := of_op()) and any(e["event"] == "outcome" for e in n) and n,
                     10, what="the outcome event")
    second = raw_post(rig, "/v1/responses", body, h)
    return (first, second, sid), new


def _check_scripted(rig: Rig, script: dict, tag: str) -> None:
    (first, second, sid), evs = _send_scripted(rig, script, tag)
    status, headers, raw = first
    assert status == script["status"]
    assert raw == script["_encoded"], "the client must get the upstream's bytes unchanged"
    assert "x-turnguard" not in headers
    assert ("x-test-cut" in headers) == truncated(script)
    completed, counted = expected_completion(script)
    outcomes = [e for e in evs if e["event"] == "outcome"]
    assert len(outcomes) == 1
    if completed:
        assert outcomes[0]["outcome"] == "completed"
    elif not 200 <= status < 300:
        assert outcomes[0]["outcome"] == "rejected"
    else:  # a 2xx event stream that ended without a terminal success event
        assert outcomes[0]["outcome"] in ("partial", "unknown")
    if counted is not None:
        assert outcomes[0]["events_seen"] == counted
    # the retry: answered from the recording exactly when the original completed: whole, or
    # an event stream whose terminal success event arrived (completed upstream, even if the
    # transport broke afterwards)
    status2, headers2, raw2 = second
    assert status2 == status and raw2 == raw
    if completed and (counted is not None or not truncated(script)) and not unreadable(script):
        assert headers2.get("x-turnguard") == "replayed" and rig.up.hits[sid] == 1
        assert headers2.get("content-encoding") == headers.get("content-encoding")
    else:
        assert "x-turnguard" not in headers2 and rig.up.hits[sid] == 2


@settings(max_examples=examples(80), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(script=upstream_responses())
# an empty 200 body (Content-Length: 0) completed upstream: mitmproxy never closes the stream
# for it, and its end was taken for an eventless failure ("unknown", fed to the circuit)
@example(script={"status": 200, "headers": [("content-type", "application/json"),
                                            ("x-codex-turn-state", "ts_hostile")],
                 "parts": [b""], "framing": "length", "_body": b"", "_encoded": b"",
                 "_encoding": "identity", "_ctype": "application/json"})
def test_generated_upstream_responses_pass_unchanged_and_replay_only_when_complete(rig, script):
    _check_scripted(rig, script, "generated")


def _ok_stream(eol: bytes = b"\n", text: str = "héllo ✓ ") -> bytes:
    types = ["response.created", "response.in_progress", "response.output_text.delta",
             "response.output_text.delta", "response.output_item.done", "response.completed"]
    return b"".join(sse(t, {"type": t, "delta": text * 3, "response": {"id": "resp_x"}}, eol)
                    for t in types)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_sse_split_at_every_byte(rig, eol, framing):
    body = _ok_stream(eol)
    script = {"status": 200, "headers": [("content-type", "text/event-stream")],
              "parts": [body[i:i + 1] for i in range(len(body))], "framing": framing,
              "gap_s": 0.0005, "_body": body, "_encoded": body, "_encoding": "identity",
              "_ctype": "text/event-stream"}
    assert expected_completion(script) == (True, 6)
    _check_scripted(rig, script, f"bytewise {framing}")


def test_a_stream_whose_terminal_name_comes_without_data_is_not_replayed(rig):
    """`event: response.completed` with no `data:` line is no event (the SSE standard; a
    client's parser dispatches nothing for it): the stream did not complete, and its retry
    goes upstream again, as through plain mitmdump, rather than getting the broken stream."""
    body = sse("response.created", {"type": "response.created"}) + b"event: response.completed\n\n"
    script = {"status": 200, "headers": [("content-type", "text/event-stream")],
              "parts": [body], "framing": "chunked", "_body": body, "_encoded": body,
              "_encoding": "identity", "_ctype": "text/event-stream"}
    (first, second, sid), evs = _send_scripted(rig, script, "terminal name without data")
    assert first[2] == body and second[2] == body and "x-turnguard" not in second[1]
    assert [e["outcome"] for e in evs if e["event"] == "outcome"] == ["partial"]
    assert rig.up.hits[sid] == 2


def test_huge_event_passes_and_is_not_kept_for_replay(rig):
    huge = b"data: " + b"x" * (12 * 1024 * 1024) + b"\n\n"
    body = sse("response.created", {"type": "response.created"}) + huge + sse(
        "response.completed", {"type": "response.completed"})
    parts = [body[i:i + 256 * 1024] for i in range(0, len(body), 256 * 1024)]
    script = {"status": 200, "headers": [("content-type", "text/event-stream")], "parts": parts,
              "framing": "chunked", "_body": body, "_encoded": body, "_encoding": "identity",
              "_ctype": "text/event-stream"}
    (first, second, sid), evs = _send_scripted(rig, script, "huge")
    assert first[0] == 200 and first[2] == body
    outcome = [e for e in evs if e["event"] == "outcome"][0]
    assert outcome["outcome"] == "completed" and outcome["events_seen"] == 3
    assert outcome["replayable"] is False  # over turnguard_replay_max_bytes: not kept
    assert second[0] == 200 and second[2] == body and "x-turnguard" not in second[1]
    assert rig.up.hits[sid] == 2
    rig.rss["after_huge_event"] = rss_kb(rig.proxy.pid)


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_encoded_sse_passes_unchanged_and_replays(rig, encoding):
    body = _ok_stream()
    encoded = gzip.compress(body) if encoding == "gzip" else zstd.compress(body)
    script = {"status": 200, "framing": "chunked",
              "headers": [("content-type", "text/event-stream"), ("content-encoding", encoding)],
              "parts": [encoded[i:i + 7] for i in range(0, len(encoded), 7)],
              "_body": body, "_encoded": encoded, "_encoding": encoding,
              "_ctype": "text/event-stream"}
    _check_scripted(rig, script, encoding)


@pytest.mark.parametrize("ending", ["response.failed", "error", None],
                         ids=["response_failed", "error_event", "no_terminal_event"])
@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_content_coded_event_stream_that_did_not_complete_is_not_replayed(rig, encoding, ending):
    """A whole 2xx event stream the upstream sent gzip- or zstd-coded that ended with
    ``response.failed``, an ``error`` event or no terminal event at all did not complete: its
    retry runs again (a second dispatch), never gets the failure back from a recording."""
    types = ["response.created", "response.in_progress"] + ([ending] if ending else [])
    body = b"".join(sse(t, {"type": t, "response": {"id": "resp_coded"}}) for t in types)
    encoded = gzip.compress(body) if encoding == "gzip" else zstd.compress(body)
    script = {"status": 200, "framing": "chunked",
              "headers": [("content-type", "text/event-stream"), ("content-encoding", encoding)],
              "parts": [encoded], "_body": body, "_encoded": encoded, "_encoding": encoding,
              "_ctype": "text/event-stream"}
    (first, second, sid), evs = _send_scripted(rig, script, f"coded {encoding} {ending}")
    assert first[0] == 200 and first[2] == encoded
    outcome = [e for e in evs if e["event"] == "outcome"][0]
    assert outcome["outcome"] == "partial" and outcome["replayable"] is False
    assert outcome["events_seen"] == len(types)
    assert second[0] == 200 and second[2] == encoded and "x-turnguard" not in second[1]
    assert rig.up.hits[sid] == 2


@pytest.mark.parametrize("encoding", ["gzip", "br"])
def test_a_content_coded_stream_cut_after_response_completed_is_replayed_not_run_again(
        rig, encoding):
    """A gzip- or br-coded event stream that delivered ``response.completed`` and then lost
    its transport (no last chunk) completed upstream, as an uncoded one does: its retry gets
    the bytes that came, from the recording, and the turn is not run a second time."""
    body = _ok_stream()
    if encoding == "gzip":
        z = zlib.compressobj(wbits=31)
        encoded = z.compress(body) + z.flush(zlib.Z_SYNC_FLUSH)  # the trailer never comes
    else:
        c = brotli.Compressor()
        encoded = c.process(body) + c.flush()  # flushed, not finished
    script = {"status": 200, "framing": "chunked_cut",
              "headers": [("content-type", "text/event-stream"), ("content-encoding", encoding)],
              "parts": [encoded[i:i + 64] for i in range(0, len(encoded), 64)],
              "_body": body, "_encoded": encoded, "_encoding": encoding,
              "_ctype": "text/event-stream"}
    (first, second, sid), evs = _send_scripted(rig, script, f"coded cut {encoding}")
    assert first[0] == 200 and first[2] == encoded and first[1].get("x-test-cut") == "1"
    outcome = [e for e in evs if e["event"] == "outcome"][0]
    assert outcome["outcome"] == "completed" and outcome["replayable"] is True
    assert second[0] == 200 and second[2] == encoded
    assert second[1].get("x-turnguard") == "replayed" and rig.up.hits[sid] == 1


def _chat_chunks(error: bool = False) -> bytes:
    """A streamed Chat Completions answer as the API sends it: ``data:`` lines of
    ``chat.completion.chunk`` objects (no ``type``, no ``event:`` field) ended by
    ``data: [DONE]``; ``error``: an error object mid-stream instead of the last chunks."""
    def chunk(delta: dict, finish: str | None = None) -> bytes:
        obj = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1,
               "model": "gpt-test", "choices": [{"index": 0, "delta": delta,
                                                 "finish_reason": finish}]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"
    head = chunk({"role": "assistant", "content": ""}) + chunk({"content": "hello"})
    if error:
        return head + b'data: {"error": {"message": "The server had an error", ' \
            b'"type": "server_error", "code": null}}\n\n' + b"data: [DONE]\n\n"
    return head + chunk({}, "stop") + b"data: [DONE]\n\n"


@pytest.mark.parametrize("error", [False, True], ids=["done", "error_then_done"])
def test_a_chat_completions_stream_ended_by_done_completes_and_is_replayed(rig, error):
    """/v1/chat/completions is guarded, and its stream has no Responses API event: it ends
    with ``data: [DONE]``. A stream that ended so completed (its retry is answered from the
    recording: one upstream execution); one that carried an error object did not (its retry
    runs again)."""
    body = _chat_chunks(error)
    script = {"status": 200, "framing": "chunked",
              "headers": [("content-type", "text/event-stream")],
              "parts": [body[i:i + 40] for i in range(0, len(body), 40)]}
    sid = rig.up.add(script)
    request = json.dumps({"model": "gpt-test", "stream": True, "messages": [
        {"role": "user", "content": f"chat {sid}"}]}).encode()
    h = {"content-type": "application/json", "x-script": sid,
         "authorization": "Bearer sk-hostile-chat"}
    op = identity.identify(identity.RequestView("POST", "/v1/chat/completions",
                                                tuple(h.items()), request,
                                                upstream_of(rig.up.url)))
    first = raw_post(rig, "/v1/chat/completions", request, h)
    assert first[0] == 200 and first[2] == body
    outcome = wait_until(lambda: [e for e in rig.events("outcome") if e.get("op") == op.op_id],
                         10, what="the outcome event")[0]
    second = raw_post(rig, "/v1/chat/completions", request, h)
    assert second[0] == 200 and second[2] == body
    if error:
        assert outcome["outcome"] == "partial" and outcome["replayable"] is False
        assert "x-turnguard" not in second[1] and rig.up.hits[sid] == 2
    else:
        assert outcome["outcome"] == "completed" and outcome["replayable"] is True
        assert second[1].get("x-turnguard") == "replayed" and rig.up.hits[sid] == 1


def test_a_stream_with_an_error_event_after_response_completed_is_replayed_not_run_again(rig):
    """The upstream sent ``response.completed`` and then an ``error`` event (a gateway
    reporting its own trouble after the turn ended): the turn completed upstream, as it does
    when the transport breaks after its terminal event, and as a WebSocket call's first
    terminal event decides. Its retry is answered from the recording: one execution."""
    types = ["response.created", "response.output_text.delta", "response.completed", "error"]
    body = b"".join(sse(t, {"type": t, "response": {"id": "resp_then_error"}}) for t in types)
    script = {"status": 200, "framing": "chunked",
              "headers": [("content-type", "text/event-stream")], "parts": [body],
              "_body": body, "_encoded": body, "_encoding": "identity",
              "_ctype": "text/event-stream"}
    (first, second, sid), evs = _send_scripted(rig, script, "completed then error")
    assert first[0] == 200 and first[2] == body
    outcome = [e for e in evs if e["event"] == "outcome"][0]
    assert outcome["outcome"] == "completed" and outcome["replayable"] is True
    assert second[0] == 200 and second[2] == body
    assert second[1].get("x-turnguard") == "replayed" and rig.up.hits[sid] == 1


# -----------------------------------------------------------------------------------------------
# Traffic turnguard does not guard: WebSocket upgrades, GET, HEAD


def _ws_open(rig, path: str) -> tuple[socket.socket, object]:
    key = base64.b64encode(os.urandom(16)).decode()
    s = socket.create_connection(("127.0.0.1", rig.proxy.port), timeout=15)
    s.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
        "authorization: Bearer sk-ws\r\nsession-id: s-hostile\r\n\r\n".encode()
    )
    f = s.makefile("rb")
    status = f.readline()
    assert status.startswith(b"HTTP/1.1 101"), status
    for _ in range(50):  # bounded: headers until the blank line
        if f.readline() in (b"\r\n", b""):
            break
    return s, f


def _ws_read(f) -> tuple[int, bytes]:
    b0, b1 = f.read(2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack("!H", f.read(2))[0]
    elif n == 127:
        n = struct.unpack("!Q", f.read(8))[0]
    return b0 & 0x0F, f.read(n)


def test_websocket_upgrade_passes(rig):
    s, f = _ws_open(rig, "/v1/realtime?model=m")
    with s:
        for payload in (b"hello turnguard", os.urandom(70_000)):
            opcode = 1 if payload.isascii() else 2
            s.sendall(_ws_frame(opcode, payload))
            assert _ws_read(f) == (opcode, payload)
        s.sendall(_ws_frame(8, struct.pack("!H", 1000)))


def test_hostile_frames_on_a_guarded_websocket_pass_untouched(rig):
    """On a guarded route (/v1/responses) an upstream that is no Responses server (this one
    echoes) gets every frame untouched and in order, calls included: turnguard lets the socket
    go when the first answer is no Responses event. Invalid UTF-8 in a text frame ends the
    socket (mitmproxy's WebSocket layer closes it, 1007), without a traceback."""
    call = json.dumps({"type": "response.create", "model": "m", "input": [{"role": "user",
                       "content": "x"}], "client_metadata": {"turn_id": "t"}}).encode()
    frames = [(1, b"not json"), (2, os.urandom(3000)), (1, b'{"type":"response.cancel"}'),
              (1, call), (1, b"{" * 3000), (1, call), (2, b"\x00")]
    s, f = _ws_open(rig, "/v1/responses")
    with s:
        for opcode, payload in frames:
            s.sendall(_ws_frame(opcode, payload))
        assert [_ws_read(f) for _ in frames] == frames
        s.sendall(_ws_frame(1, b"\xff\xfe not utf-8"))
        opcode, payload = _ws_read(f)
        assert opcode == 8 and struct.unpack("!H", payload[:2])[0] == 1007
    reasons = [json.loads(line).get("reason", "") for line in
               rig.events_path.read_text().splitlines() if '"passthrough"' in line]
    assert any(r.startswith("upstream frame is not a Responses event") for r in reasons)


def _exchange(rig: Rig, head: bytes, body: bytes) -> bytes:
    """One raw HTTP/1.1 request (``head`` without its Content-Length) on a connection of its
    own, and all the proxy sent back until it closed it."""
    port = int(rig.proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def test_a_method_in_another_case_is_its_own_operation(rig):
    """HTTP's methods are case-sensitive: an origin may answer `post` with 405. A `post` of a
    body whose `POST` completed is sent upstream, not answered from the `POST`'s recording
    (it is guarded as its own operation: its own repeat is replayed)."""
    sid = rig.up.add(_default_script("POST"))
    body = json.dumps({"model": "m", "input": f"method case {sid}"}).encode()
    answers = [_exchange(rig, method + b" /v1/responses HTTP/1.1\r\nhost: h\r\n"
                         b"content-type: application/json\r\nx-script: " + sid.encode()
                         + b"\r\n", body)
               for method in (b"POST", b"post", b"post")]
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers
    replayed = [b"x-turnguard: replayed" in a.partition(b"\r\n\r\n")[0] for a in answers]
    assert replayed == [False, False, True] and rig.up.hits[sid] == 2


def test_a_replayed_204_gets_no_content_length(rig):
    """A 204 has no body and must not carry a Content-Length (RFC 9110 8.6): its replay is
    the recorded answer, without one added."""
    sid = rig.up.add({"status": 204, "headers": [("x-a", "1")], "parts": [], "framing": "close"})
    body = json.dumps({"model": "m", "input": f"no content {sid}"}).encode()
    heads = [_exchange(rig, b"POST /v1/responses HTTP/1.1\r\nhost: h\r\ncontent-type: "
                       b"application/json\r\nx-script: " + sid.encode() + b"\r\n", body
                       ).partition(b"\r\n\r\n")[0].lower() for _ in range(2)]
    assert all(h.startswith(b"http/1.1 204") and b"x-a: 1" in h for h in heads), heads
    assert b"x-turnguard: replayed" in heads[1] and rig.up.hits[sid] == 1, heads
    assert b"content-length" not in heads[0] and b"content-length" not in heads[1], heads


def test_a_body_with_infinity_is_no_json_and_passes_untouched(rig):
    """`Infinity` is no JSON (Python reads it): as a float it made the body one operation with
    `1e400`, and it was answered from that body's recording where an origin refuses it."""
    sid = rig.up.add(_default_script("POST"))
    h = {"content-type": "application/json", "x-script": sid}
    number = f'{{"model":"m","input":"infinity {sid}","temperature":%s}}'

    def passthroughs() -> int:
        return sum(e.get("reason") == "body is not JSON" for e in rig.events("passthrough"))

    before = passthroughs()
    for literal in ("1e400", "1e400", "Infinity"):
        r = rig.client.post(rig.proxy.url + "/v1/responses", content=number % literal, headers=h)
        assert r.status_code == 200
    assert "x-turnguard" not in r.headers and rig.up.hits[sid] == 2  # 1e400 replayed once
    wait_until(lambda: passthroughs() == before + 1, 10, what="the passthrough record")


def test_get_and_head_pass_untouched(rig):
    body = os.urandom(3000)
    sid = rig.up.add({"headers": [("content-type", "application/octet-stream"),
                                  ("x-upstream", "yes")], "parts": [body]})
    r = rig.client.get(rig.proxy.url + "/v1/models", headers={"x-script": sid})
    assert r.status_code == 200 and r.content == body and r.headers["x-upstream"] == "yes"
    assert "x-turnguard" not in r.headers
    h = rig.client.head(rig.proxy.url + "/v1/models", headers={"x-script": sid})
    assert h.status_code == 200 and h.content == b""
    assert h.headers["content-length"] == str(len(body))
    # a GET on a guarded path is not a model turn either
    r = rig.client.get(rig.proxy.url + "/v1/responses/resp_123", headers={"x-script": sid})
    assert r.content == body and rig.up.hits[sid] == 3


# -----------------------------------------------------------------------------------------------
# Last: the log and the memory after all of the above


def test_no_traceback_and_memory_bounded(rig, report):
    rig.rss["end"] = rss_kb(rig.proxy.pid)
    assert rig.proxy.proc.poll() is None
    assert_no_traceback(rig.proxy.log_text())
    growth_mb = (rig.rss["end"] - rig.rss["start"]) / 1024
    report("hostile input: mitmdump RSS (MB) "
           + ", ".join(f"{k}={v / 1024:.0f}" for k, v in rig.rss.items())
           + f"; upstream requests={rig.up.requests}")
    assert growth_mb < 400, rig.rss
