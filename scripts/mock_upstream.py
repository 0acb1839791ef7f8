#!/usr/bin/env python3
"""A mock OpenAI-Responses-style upstream for turnguard's end-to-end tests.

Standard library only. A real HTTP/1.1 server on asyncio streams, so that every reset, clean
close and stall happens exactly when a scenario says so.

    python scripts/mock_upstream.py --host 127.0.0.1 --port 0 \
        [--scenario FILE.json] [--log FILE.jsonl]

On start it prints one line, ``mock upstream listening at http://127.0.0.1:PORT``, and flushes.
SIGTERM and SIGINT make it exit with status 0.

Routes
------
``POST .../responses`` and ``POST .../chat/completions`` (query ignored)
    A model *dispatch*: numbered n = 0, 1, 2, ... across the server, logged, and answered by a
    behaviour: the ``x-mock-behaviour`` request header (a BEHAVIOUR JSON) if present, else
    ``scenario["sequence"][n]`` if it exists, else ``scenario["default"]``. As the API: SSE
    when the body says ``"stream": true``, else one JSON object; a body that is not a JSON
    object gets 400 and is no dispatch (logged as ``invalid_body``). ``--help`` lists every
    behaviour.
``GET /_mock/health``
    200 ``ok``.
``GET /_mock/dispatches``
    JSON list of the dispatch records so far (``GET /_mock/records``: every record).
``POST /_mock/scenario``
    Body: a scenario. Replaces the scenario and resets the dispatch counter to 0.
Anything else
    404 with a JSON error.

Scenario (a JSON object; every key optional)::

    {"default": BEHAVIOUR,                       # {"kind": "ok"} when absent
     "sequence": [BEHAVIOUR, ...],               # by global dispatch number n
     "sessions": {"SESSION": SELECTOR, ...},     # by the session-id / session_id header
     "operations": {"BODY_SHA256": SELECTOR, ...},  # by sha256 hex of the request body
                                                 # (a prefix of >= 8 hex digits is enough)
     "name": "...", "description": "..."}        # ignored: for people

    SELECTOR = {"sequence": [BEHAVIOUR, ...], "default": BEHAVIOUR}   # both optional

A dispatch's behaviour is the first of: the ``x-mock-behaviour`` header; its operation's
selector (``sequence[k]`` for the operation's k-th dispatch, else its ``default``); its session's
selector (likewise, k counted per session); ``sequence[n]``; ``default``. A selector whose
sequence is used up and that has no default does not match, so the next rule decides. Every
matching selector counts the dispatch, whichever rule decided.

BEHAVIOUR is ``{"kind": K, ...params}``; see ``KINDS`` and the ``_do_*`` methods of
``Dispatch`` for the kinds and their parameters (``ok``, ``tool_call``, ``slow``,
``stall_before_headers``, ``stall_after_headers``, ``reset``, ``clean_close``, ``status``,
``partial``).

Log (``--log``, JSON lines, mode 0600, flushed per line, also kept in memory)
    ``{"event": "dispatch", "n", "ts", "method", "path", "query", "conn", "session",
    "turn_state", "body_sha256", "behaviour", "authorization_present", "selected_by",
    "op_n", "session_n", "spec", "client_attempt"}`` when a dispatch starts (``behaviour`` is
    the kind, ``spec`` the whole behaviour, ``selected_by`` one of header / operation /
    session / sequence / default, ``op_n`` and ``session_n`` the dispatch's number within its
    operation and session, ``client_attempt`` the ``x-turnguard-repro-attempt`` header the
    reproduction toolkit's clients send, or null);
    ``{"event": "client_gone", "n", "ts"}`` when its client disconnects before the behaviour
    finished; ``{"event": "dispatch_end", "n", "ts", "status", "events_sent", "outcome"}`` when
    it ends (``status`` is null when no status line was sent); ``{"event": "scenario", "ts"}``
    when ``POST /_mock/scenario`` replaced the scenario. The Authorization value is never logged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import hashlib
import itertools
import json
import os
import secrets
import signal
import socket
import struct
import sys
import time
import zlib
from typing import Any

# Bounds: every read, wait and loop in this server is bounded by one of these.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 200
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_CHUNKS = 1_000_000
MAX_REQUESTS_PER_CONNECTION = 10_000
IDLE_TIMEOUT_S = 300.0  # keep-alive connection waiting for its next request
READ_TIMEOUT_S = 60.0  # reading one request's head and body
MAX_SLEEP_MS = 3_600_000  # no behaviour sleeps longer than an hour
WATCH_BUFFER_LIMIT = 1024 * 1024  # stop reading pipelined bytes while watching for EOF
DRAIN_TIMEOUT_S = 5.0  # waiting for the kernel to take our bytes before an RST

KINDS = {
    "ok",
    "tool_call",
    "slow",
    "stall_before_headers",
    "stall_after_headers",
    "reset",
    "clean_close",
    "status",
    "partial",
}
DEFAULT_SCENARIO: dict[str, Any] = {"default": {"kind": "ok"}}
SLOW_DEFAULT_DELAY_MS = 60_000
DEFAULT_STALL_MS = 600_000
PARTIAL_ENDS = ("reset", "clean_close", "stall", "failed")
CONTENT_ENCODINGS = ("identity", "gzip", "deflate", "br", "zstd")
MAX_DELTA_BYTES = 1024 * 1024
SCENARIO_META_KEYS = {"name", "description", "comment"}
REPRO_ATTEMPT_HEADER = "x-turnguard-repro-attempt"
INVALID_BODY_ERROR = {"error": {
    "message": "We could not parse the JSON body of your request. (HINT: This likely means you "
               "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
               "but what was sent was not valid JSON.)",
    "type": "invalid_request_error", "param": None, "code": None,
}}

REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


class BadRequest(Exception):
    """The client sent something this server will not parse; answered 400, then closed."""


class ClientGone(Exception):
    """The client disconnected while a behaviour was still running."""


# --------------------------------------------------------------------------------------------
# Scenario validation


def validate_behaviour(b: Any, where: str = "behaviour") -> dict[str, Any]:
    """Return ``b`` if it is a behaviour object with a known kind and sane numbers, else raise
    ValueError."""
    if not isinstance(b, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(b).__name__}")
    kind = b.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where}: unknown kind {kind!r} (known: {sorted(KINDS)})")
    for key in (
        "events", "gap_ms", "delay_ms", "ms", "code", "retry_after", "first_event_ms",
        "delta_bytes", "stall_ms", "think_ms",
    ):
        if key in b and b[key] is not None:
            v = b[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{where}: {key} must be a non-negative number")
    if "code" in b and not 100 <= int(b["code"]) <= 599:
        raise ValueError(f"{where}: code must be an HTTP status 100..599")
    if "events" in b and int(b["events"]) > 100_000:
        raise ValueError(f"{where}: events must be <= 100000")
    if "delta_bytes" in b and int(b["delta_bytes"]) > MAX_DELTA_BYTES:
        raise ValueError(f"{where}: delta_bytes must be <= {MAX_DELTA_BYTES}")
    for key in ("text", "name", "call_id"):
        if key in b and not isinstance(b[key], str):
            raise ValueError(f"{where}: {key} must be a string")
    if "arguments" in b and not isinstance(b["arguments"], (str, dict)):
        raise ValueError(f"{where}: arguments must be a string or a JSON object")
    if "content_encoding" in b and b["content_encoding"] not in CONTENT_ENCODINGS:
        raise ValueError(f"{where}: content_encoding must be one of {list(CONTENT_ENCODINGS)}")
    if "end" in b and b["end"] not in PARTIAL_ENDS:
        raise ValueError(f"{where}: end must be one of {list(PARTIAL_ENDS)}")
    if "after_completed" in b and b["after_completed"] not in ("reset", "clean_close"):
        raise ValueError(f"{where}: after_completed must be reset or clean_close")
    if "headers" in b:
        h = b["headers"]
        if not isinstance(h, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k.strip() and "\n" not in k + v
            and "\r" not in k + v and ":" not in k
            for k, v in h.items()
        ):
            raise ValueError(f"{where}: headers must be an object of header name -> string value")
    return b


def _validate_selector(sel: Any, where: str) -> dict[str, Any]:
    """A per-session or per-operation selector: ``{"sequence": [...], "default": B}``, both
    optional; normalised to have ``sequence`` and ``default`` (None when absent)."""
    if not isinstance(sel, dict):
        raise ValueError(f"{where} must be a JSON object")
    unknown = set(sel) - {"default", "sequence"} - SCENARIO_META_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    seq = sel.get("sequence", [])
    if not isinstance(seq, list):
        raise ValueError(f"{where}.sequence must be a list")
    default = sel.get("default")
    return {
        "sequence": [validate_behaviour(b, f"{where}.sequence[{i}]") for i, b in enumerate(seq)],
        "default": None if default is None else validate_behaviour(default, f"{where}.default"),
    }


def validate_scenario(s: Any) -> dict[str, Any]:
    """Return a normalised scenario (``default``, ``sequence``, ``sessions`` and
    ``operations`` always present) or raise ValueError."""
    if not isinstance(s, dict):
        raise ValueError("scenario must be a JSON object")
    unknown = set(s) - {"default", "sequence", "sessions", "operations"} - SCENARIO_META_KEYS
    if unknown:
        raise ValueError(f"scenario: unknown keys {sorted(unknown)}")
    default = validate_behaviour(s.get("default", {"kind": "ok"}), "default")
    seq = s.get("sequence", [])
    if not isinstance(seq, list):
        raise ValueError("scenario: sequence must be a list")
    seq = [validate_behaviour(b, f"sequence[{i}]") for i, b in enumerate(seq)]
    sessions = s.get("sessions", {})
    if not isinstance(sessions, dict):
        raise ValueError("scenario: sessions must be an object of session id -> selector")
    operations = s.get("operations", {})
    if not isinstance(operations, dict):
        raise ValueError("scenario: operations must be an object of body sha256 -> selector")
    for key in operations:
        if not (8 <= len(key) <= 64 and all(c in "0123456789abcdef" for c in key)):
            raise ValueError(
                f"scenario: operations key {key!r} must be 8..64 lowercase hex digits "
                "(a prefix of the request body's sha256)"
            )
    out = {
        "default": default,
        "sequence": seq,
        "sessions": {k: _validate_selector(v, f"sessions[{k!r}]") for k, v in sessions.items()},
        "operations": {
            k: _validate_selector(v, f"operations[{k!r}]") for k, v in operations.items()
        },
    }
    for key in SCENARIO_META_KEYS & set(s):
        out[key] = s[key]
    return out


def _ms(b: dict[str, Any], key: str, default: float) -> float:
    """A millisecond parameter as seconds, clamped to MAX_SLEEP_MS."""
    return min(float(b.get(key, default) or 0), MAX_SLEEP_MS) / 1000.0


# --------------------------------------------------------------------------------------------
# Responses API payloads


def sse_frame(event_type: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: ``event: <type>\\ndata: <json>\\n\\n``."""
    return f"event: {event_type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def response_object(rid: str, model: str, status: str, output: list[Any]) -> dict[str, Any]:
    """A Responses API ``response`` object (no timestamps, so payloads differ only by id)."""
    return {"id": rid, "object": "response", "status": status, "model": model, "output": output}


def ok_events(rid: str, model: str, deltas: int, text: str) -> list[tuple[str, dict[str, Any]]]:
    """The events of a successful streamed turn, in order: created, in_progress,
    output_item.added, ``deltas`` x output_text.delta (each carrying ``text``),
    output_item.done, completed. Every payload has ``type``, ``sequence_number`` and a
    ``response`` object with the response id."""
    item_id = "msg_" + rid.removeprefix("resp_")
    full = text * deltas
    done_item = {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": full, "annotations": []}],
    }
    raw: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": response_object(rid, model, "in_progress", [])}),
        ("response.in_progress", {"response": response_object(rid, model, "in_progress", [])}),
        (
            "response.output_item.added",
            {
                "response": {"id": rid},
                "output_index": 0,
                "item": {**done_item, "status": "in_progress", "content": []},
            },
        ),
    ]
    for _ in range(deltas):
        raw.append(
            (
                "response.output_text.delta",
                {
                    "response": {"id": rid},
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "delta": text,
                },
            )
        )
    raw.append(("response.output_item.done", {"response": {"id": rid}, "output_index": 0, "item": done_item}))
    raw.append(("response.completed", {"response": response_object(rid, model, "completed", [done_item])}))
    return [(t, {"type": t, "sequence_number": i, **d}) for i, (t, d) in enumerate(raw)]


def delta_text(text: str, delta_bytes: int | None) -> str:
    """The text of one output_text.delta: ``text``, or ``text`` repeated and cut to
    ``delta_bytes`` ASCII characters when that size is given (``text`` must then be ASCII to
    hit the size exactly)."""
    if delta_bytes is None:
        return text
    if delta_bytes <= 0:
        return ""
    base = text or "x"
    return (base * (delta_bytes // len(base) + 1))[:delta_bytes]


def tool_call_events(
    rid: str, model: str, name: str, arguments: str, call_id: str
) -> list[tuple[str, dict[str, Any]]]:
    """The events of a turn's step that ends in one function call, shaped like the Responses
    API's: created, in_progress, output_item.added (a ``function_call`` item),
    function_call_arguments.delta, function_call_arguments.done, output_item.done, completed
    (its ``output`` is the function call). The client runs the tool and sends the next request
    of the same turn, carrying the ``x-codex-turn-state`` this response returned."""
    item_id = "fc_" + rid.removeprefix("resp_")
    item = {
        "id": item_id,
        "type": "function_call",
        "status": "completed",
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }
    raw: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": response_object(rid, model, "in_progress", [])}),
        ("response.in_progress", {"response": response_object(rid, model, "in_progress", [])}),
        (
            "response.output_item.added",
            {
                "response": {"id": rid},
                "output_index": 0,
                "item": {**item, "status": "in_progress", "arguments": ""},
            },
        ),
        (
            "response.function_call_arguments.delta",
            {"response": {"id": rid}, "item_id": item_id, "output_index": 0, "delta": arguments},
        ),
        (
            "response.function_call_arguments.done",
            {"response": {"id": rid}, "item_id": item_id, "output_index": 0, "arguments": arguments},
        ),
        ("response.output_item.done", {"response": {"id": rid}, "output_index": 0, "item": item}),
        ("response.completed", {"response": response_object(rid, model, "completed", [item])}),
    ]
    return [(t, {"type": t, "sequence_number": i, **d}) for i, (t, d) in enumerate(raw)]


def failed_event(rid: str, model: str, seq: int) -> tuple[str, dict[str, Any]]:
    """A ``response.failed`` event (the upstream gave up after some output)."""
    resp = response_object(rid, model, "failed", [])
    resp["error"] = {"code": "server_error", "message": "mock upstream: the response failed"}
    return ("response.failed", {"type": "response.failed", "sequence_number": seq, "response": resp})


def openai_error(code: int) -> dict[str, Any]:
    """The default error body of a ``status`` behaviour, shaped like OpenAI's."""
    if code == 429:
        etype, ecode = "requests", "rate_limit_exceeded"
    elif code >= 500:
        etype, ecode = "server_error", "server_error"
    else:
        etype, ecode = "invalid_request_error", "invalid_request"
    return {"error": {"message": f"mock upstream error {code}", "type": etype, "code": ecode}}


# --------------------------------------------------------------------------------------------
# Connection I/O


class Request:
    """A parsed HTTP/1.x request."""

    def __init__(self, method: str, target: str, version: str, headers: list[tuple[str, str]], body: bytes):
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.body = body
        self.path, _, query = target.partition("?")
        self.query = query or None

    def header(self, name: str) -> str | None:
        """First value of a header, case-insensitive, or None."""
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def keep_alive(self) -> bool:
        """Whether the connection stays open after this request's response."""
        conn = (self.header("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn


class Conn:
    """One client connection: a byte buffer over the stream reader (so watching for EOF while a
    behaviour sleeps never loses pipelined bytes) plus write helpers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cid: int):
        self.reader = reader
        self.writer = writer
        self.cid = cid
        self.buf = bytearray()
        self.eof = False

    async def _fill(self) -> bool:
        """Read more bytes into the buffer; False at EOF (or a reset)."""
        if self.eof:
            return False
        try:
            data = await self.reader.read(65536)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def read_until(self, sep: bytes, limit: int) -> bytes | None:
        """Bytes up to and including ``sep``; None at EOF before any byte; BadRequest past
        ``limit``."""
        start = 0
        while True:  # bounded: each pass grows the buffer or returns/raises
            i = self.buf.find(sep, start)
            if i >= 0:
                out = bytes(self.buf[: i + len(sep)])
                del self.buf[: i + len(sep)]
                return out
            if len(self.buf) > limit:
                raise BadRequest("header section too large")
            start = max(0, len(self.buf) - len(sep) + 1)
            if not await self._fill():
                if self.buf:
                    raise BadRequest("incomplete request")
                return None

    async def read_exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes, or BadRequest at EOF."""
        while len(self.buf) < n:  # bounded: each pass grows the buffer or raises
            if not await self._fill():
                raise BadRequest("incomplete body")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def wait_gone(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return True as soon as the client disconnects (EOF on the
        reader), False if the time passed with the client still connected."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, seconds)
        while not self.eof:  # bounded by the deadline and by WATCH_BUFFER_LIMIT
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            if len(self.buf) > WATCH_BUFFER_LIMIT:
                await asyncio.sleep(remaining)
                return False
            try:
                await asyncio.wait_for(self._fill(), remaining)
            except TimeoutError:
                return False
        return True

    async def send(self, data: bytes) -> None:
        """Write and drain; ClientGone if the client is no longer there."""
        if self.eof and self.writer.transport.is_closing():
            raise ClientGone()
        try:
            self.writer.write(data)
            await asyncio.wait_for(self.writer.drain(), READ_TIMEOUT_S)
        except (ConnectionError, OSError, TimeoutError) as e:
            raise ClientGone() from e
        if self.writer.transport.is_closing():
            raise ClientGone()

    async def flush_kernel(self) -> None:
        """Wait (bounded) until the transport's own buffer is empty, so that an RST right after
        does not discard bytes we meant the client to get."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_TIMEOUT_S
        transport = self.writer.transport
        while transport.get_write_buffer_size() > 0 and loop.time() < deadline:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)  # give the peer a moment to read the last bytes

    def reset(self) -> None:
        """Close with a TCP RST (SO_LINGER on, timeout 0)."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    async def close(self) -> None:
        """Close cleanly (FIN), bounded."""
        with contextlib.suppress(Exception):
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), 2.0)

    async def read_request(self, idle_timeout: float) -> Request | None:
        """Read one request; None if the client closed (or idled past ``idle_timeout``)
        before sending a byte of it. TimeoutError if the request itself is too slow."""
        try:
            started = await asyncio.wait_for(self._wait_first_byte(), idle_timeout)
        except TimeoutError:
            return None
        if not started:
            return None
        return await asyncio.wait_for(self._read_head_and_body(), READ_TIMEOUT_S)

    async def _wait_first_byte(self) -> bool:
        """Wait for the first byte of a request, skipping stray CRLFs between requests; False
        at EOF."""
        for _ in range(16):
            while self.buf[:2] == b"\r\n":
                del self.buf[:2]
            if self.buf:
                return True
            if not await self._fill():
                return False
        raise BadRequest("only empty lines")

    async def _read_head_and_body(self) -> Request:
        """The request line, headers and body (Content-Length or chunked)."""
        head = await self.read_until(b"\r\n\r\n", MAX_HEAD_BYTES)
        if head is None:
            raise BadRequest("incomplete request")
        lines = head[:-4].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequest(f"bad request line {lines[0]!r}")
        method, target, version = parts
        if len(lines) - 1 > MAX_HEADERS:
            raise BadRequest("too many headers")
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise BadRequest(f"bad header line {line!r}")
            headers.append((name, value.strip()))
        req = Request(method, target, version, headers, b"")
        if (req.header("expect") or "").lower() == "100-continue":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        te = (req.header("transfer-encoding") or "").lower()
        if te:
            if te.split(",")[-1].strip() != "chunked":
                raise BadRequest(f"unsupported transfer-encoding {te!r}")
            req.body = await self._read_chunked()
        else:
            cl = req.header("content-length")
            if cl is not None:
                if not cl.isdigit():
                    raise BadRequest("bad content-length")
                if int(cl) > MAX_BODY_BYTES:
                    raise BadRequest("body too large")
                req.body = await self.read_exact(int(cl))
        return req

    async def _read_chunked(self) -> bytes:
        """A chunked request body (chunk extensions and trailers ignored)."""
        body = bytearray()
        for _ in range(MAX_CHUNKS):
            line = await self.read_until(b"\r\n", 4096)
            if line is None:
                raise BadRequest("incomplete chunked body")
            size_text = line[:-2].split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise BadRequest(f"bad chunk size {size_text!r}") from None
            if size == 0:
                for _ in range(MAX_HEADERS + 1):  # trailers until the empty line
                    t = await self.read_until(b"\r\n", MAX_HEAD_BYTES)
                    if t is None or t == b"\r\n":
                        return bytes(body)
                raise BadRequest("too many trailers")
            if len(body) + size > MAX_BODY_BYTES:
                raise BadRequest("body too large")
            body += await self.read_exact(size)
            if await self.read_exact(2) != b"\r\n":
                raise BadRequest("chunk not followed by CRLF")
        raise BadRequest("too many chunks")


def content_encode(data: bytes, coding: str) -> bytes:
    """``data`` in a content coding. gzip and deflate are the standard library's; br and zstd
    need the brotli and zstd modules mitmproxy brings (imported only when asked for)."""
    if coding == "gzip":
        return gzip.compress(data, mtime=0)
    if coding == "deflate":
        return zlib.compress(data)
    if coding == "br":
        import brotli

        return brotli.compress(data)
    if coding == "zstd":
        try:
            from compression import zstd  # type: ignore[import-not-found]
        except ImportError:  # Python < 3.14
            from backports import zstd  # type: ignore[no-redef]
        return zstd.compress(data)
    return data


def head_bytes(status: int, headers: list[tuple[str, str]]) -> bytes:
    """A status line and header section."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked response body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


# --------------------------------------------------------------------------------------------
# The server


class MockUpstream:
    """Server state: scenario, dispatch counter, records and the log file."""

    def __init__(self, scenario: dict[str, Any], log_path: str | None):
        self.scenario = validate_scenario(scenario)
        self.counter = 0
        self.session_counts: dict[str, int] = {}
        self.op_counts: dict[str, int] = {}
        self.records: list[dict[str, Any]] = []
        self.conn_ids = itertools.count()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.log_file = None
        if log_path:
            fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.fchmod(fd, 0o600)
            self.log_file = os.fdopen(fd, "a", encoding="utf-8")

    def record(self, rec: dict[str, Any]) -> None:
        """Keep a record in memory and append it to the log (flushed)."""
        self.records.append(rec)
        if self.log_file is not None:
            self.log_file.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self.log_file.flush()

    def close(self) -> None:
        """Close the log file."""
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection: requests in a bounded keep-alive loop."""
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        conn = Conn(reader, writer, next(self.conn_ids))
        try:
            for _ in range(MAX_REQUESTS_PER_CONNECTION):
                try:
                    req = await conn.read_request(IDLE_TIMEOUT_S)
                except (BadRequest, TimeoutError) as e:
                    status, msg = (400, str(e)) if isinstance(e, BadRequest) else (408, "request read timed out")
                    error = {"error": {"message": msg, "type": "invalid_request_error", "code": "bad_request"}}
                    with contextlib.suppress(ClientGone):
                        await self.send_json(conn, status, error, close=True)
                    break
                if req is None:
                    break
                if not await self.route(conn, req) or not req.keep_alive:
                    break
        except ClientGone:
            pass
        finally:
            if task is not None:
                self.tasks.discard(task)
            if not writer.transport.is_closing():
                await conn.close()

    async def route(self, conn: Conn, req: Request) -> bool:
        """Answer one request; return False if the connection must not be reused."""
        close = not req.keep_alive
        if req.method == "POST" and (req.path.endswith("/responses") or req.path.endswith("/chat/completions")):
            return await self.dispatch(conn, req)
        if req.method == "GET" and req.path == "/_mock/health":
            await self.send_plain(conn, 200, b"ok", close=close)
        elif req.method == "GET" and req.path == "/_mock/dispatches":
            await self.send_json(conn, 200, [r for r in self.records if r["event"] == "dispatch"], close=close)
        elif req.method == "GET" and req.path == "/_mock/records":
            await self.send_json(conn, 200, self.records, close=close)
        elif req.method == "POST" and req.path == "/_mock/scenario":
            try:
                self.scenario = validate_scenario(json.loads(req.body))
            except ValueError as e:  # includes JSONDecodeError
                await self.send_json(conn, 400, {"error": {"message": str(e), "type": "invalid_request_error", "code": "bad_scenario"}}, close=close)
                return not close
            self.counter = 0
            self.session_counts.clear()
            self.op_counts.clear()
            self.record({"event": "scenario", "ts": time.time()})
            await self.send_json(conn, 200, {"ok": True}, close=close)
        else:
            await self.send_json(conn, 404, {"error": {"message": f"no route for {req.method} {req.path}", "type": "invalid_request_error", "code": "not_found"}}, close=close)
        return not close

    async def send_json(self, conn: Conn, status: int, obj: Any, *, close: bool, extra: tuple[tuple[str, str], ...] = ()) -> None:
        """A whole JSON response with content-length."""
        body = json.dumps(obj).encode()
        await self.send_whole(conn, status, "application/json", body, close=close, extra=extra)

    async def send_plain(self, conn: Conn, status: int, body: bytes, *, close: bool) -> None:
        """A whole text/plain response."""
        await self.send_whole(conn, status, "text/plain", body, close=close)

    async def send_whole(self, conn: Conn, status: int, ctype: str, body: bytes, *, close: bool, extra: tuple[tuple[str, str], ...] = ()) -> None:
        """A whole response with content-length."""
        headers = [("content-type", ctype), ("content-length", str(len(body))), *extra]
        if close:
            headers.append(("connection", "close"))
        await conn.send(head_bytes(status, headers) + body)

    def _operation_key(self, body_sha: str) -> str | None:
        """The longest ``operations`` key that is a prefix of ``body_sha``, or None."""
        best = None
        for key in self.scenario["operations"]:
            if body_sha.startswith(key) and (best is None or len(key) > len(best)):
                best = key
        return best

    def select(
        self, n: int, session: str | None, body_sha: str
    ) -> tuple[tuple[str, dict[str, Any]], int | None, int | None]:
        """Count the dispatch in its operation and session, and pick its behaviour:
        ((selected_by, behaviour), number within the session, number within the operation).
        See the module docstring for the order."""
        choices: list[tuple[str, dict[str, Any] | None]] = []
        op_n = session_n = None
        op_key = self._operation_key(body_sha)
        if op_key is not None:
            op_n = self.op_counts.get(op_key, 0)
            self.op_counts[op_key] = op_n + 1
            choices.append(("operation", _pick(self.scenario["operations"][op_key], op_n)))
        if session is not None and session in self.scenario["sessions"]:
            session_n = self.session_counts.get(session, 0)
            self.session_counts[session] = session_n + 1
            choices.append(("session", _pick(self.scenario["sessions"][session], session_n)))
        for by, b in choices:
            if b is not None:
                return (by, b), session_n, op_n
        seq = self.scenario["sequence"]
        if n < len(seq):
            return ("sequence", seq[n]), session_n, op_n
        return ("default", self.scenario["default"]), session_n, op_n

    async def dispatch(self, conn: Conn, req: Request) -> bool:
        """Number, log and answer a model request; return False if the connection is done.
        A body that is not a JSON object is answered 400, as the real API does, and is not a
        dispatch (logged as ``invalid_body``)."""
        try:
            parsed = json.loads(req.body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            self.record({"event": "invalid_body", "ts": time.time(), "path": req.path,
                         "bytes": len(req.body)})
            await self.send_json(conn, 400, INVALID_BODY_ERROR, close=not req.keep_alive)
            return req.keep_alive
        override = req.header("x-mock-behaviour")
        if override is not None:
            try:
                behaviour = validate_behaviour(json.loads(override), "x-mock-behaviour")
            except ValueError as e:
                await self.send_json(conn, 400, {"error": {"message": str(e), "type": "invalid_request_error", "code": "bad_mock_behaviour"}}, close=True)
                return False
        n = self.counter
        self.counter += 1
        session = req.header("session-id") or req.header("session_id")
        body_sha = hashlib.sha256(req.body).hexdigest()
        selected, session_n, op_n = self.select(n, session, body_sha)
        if override is None:
            selected_by, behaviour = selected
        else:
            selected_by = "header"
        self.record(
            {
                "event": "dispatch",
                "n": n,
                "ts": time.time(),
                "method": req.method,
                "path": req.path,
                "query": req.query,
                "conn": conn.cid,
                "session": session,
                "turn_state": req.header("x-codex-turn-state"),
                "body_sha256": body_sha,
                "behaviour": behaviour["kind"],
                "authorization_present": req.header("authorization") is not None,
                "selected_by": selected_by,
                "op_n": op_n,
                "session_n": session_n,
                "spec": behaviour,
                "client_attempt": req.header(REPRO_ATTEMPT_HEADER),
            }
        )
        d = Dispatch(self, conn, req, n, behaviour)
        try:
            await getattr(d, "_do_" + behaviour["kind"])()
        except ClientGone:
            d.outcome = "client_gone"
            self.record({"event": "client_gone", "n": n, "ts": time.time()})
        except asyncio.CancelledError:
            d.outcome = "server_shutdown"
            raise
        finally:
            self.record({"event": "dispatch_end", "n": n, "ts": time.time(), "status": d.status, "events_sent": d.events_sent, "outcome": d.outcome})
        return d.reusable and req.keep_alive


def _pick(selector: dict[str, Any], k: int) -> dict[str, Any] | None:
    """The behaviour a selector gives its k-th dispatch, or None when it does not decide."""
    seq = selector["sequence"]
    return seq[k] if k < len(seq) else selector["default"]


class Dispatch:
    """One model request being answered by one behaviour. ``status`` is the status line sent
    (None if none), ``events_sent`` the SSE events written, ``reusable`` whether the connection
    can serve another request afterwards."""

    def __init__(self, server: MockUpstream, conn: Conn, req: Request, n: int, b: dict[str, Any]):
        self.server = server
        self.conn = conn
        self.req = req
        self.n = n
        self.b = b
        self.status: int | None = None
        self.events_sent = 0
        self.reusable = False
        self.outcome = "unfinished"
        self.rid = f"resp_{n}_{secrets.token_hex(8)}"
        try:
            body = json.loads(req.body) if req.body else {}
        except ValueError:
            body = None
        self.body = body if isinstance(body, dict) else {}
        model = self.body.get("model")
        self.model = model if isinstance(model, str) else "mock-model"
        turn_state = req.header("x-codex-turn-state")
        self.common_headers = [
            ("x-request-id", f"req_{n}"),
            ("x-codex-turn-state", turn_state if turn_state is not None else f"ts_{secrets.token_hex(8)}"),
        ]

    def _close_header(self) -> list[tuple[str, str]]:
        return [] if self.req.keep_alive else [("connection", "close")]

    async def _sleep(self, seconds: float) -> None:
        """Sleep, or raise ClientGone as soon as the client disconnects."""
        if seconds > 0 and await self.conn.wait_gone(seconds):
            raise ClientGone()

    def _extra_headers(self) -> list[tuple[str, str]]:
        """The behaviour's own ``headers`` parameter (e.g. x-should-retry, retry-after-ms)."""
        return list((self.b.get("headers") or {}).items())

    async def _sse_headers(self) -> None:
        self.status = 200
        headers = [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
            ("transfer-encoding", "chunked"),
            *self.common_headers,
            *self._extra_headers(),
            *self._close_header(),
        ]
        await self.conn.send(head_bytes(200, headers))

    async def _stream(self, events: list[tuple[str, dict[str, Any]]], gap: float) -> None:
        """Write events, one chunk each, draining after each, with ``gap`` seconds between, and
        the behaviour's ``think_ms`` after ``response.in_progress`` (before the output)."""
        think = _ms(self.b, "think_ms", 0)
        for i, (etype, data) in enumerate(events):
            if i and gap:
                await self._sleep(gap)
            if think and i and events[i - 1][0] == "response.in_progress":
                await self._sleep(think)
            await self.conn.send(chunk(sse_frame(etype, data)))
            self.events_sent += 1

    def _text(self) -> str:
        size = self.b.get("delta_bytes")
        return delta_text(self.b.get("text", "hello"), None if size is None else int(size))

    async def _complete(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Answer with ``events``: an SSE stream (``first_event_ms`` after the headers, then
        ``gap_ms`` between events) when the request says ``"stream": true``, else the final
        response object as one JSON body, like the API. With ``content_encoding`` the whole body is sent at
        once in that coding (and ``first_event_ms`` and ``gap_ms`` are ignored)."""
        coding = self.b.get("content_encoding")
        streamed = self.body.get("stream") is True  # like the API: JSON unless asked to stream
        if coding is not None and coding != "identity":
            if streamed:
                ctype, raw = "text/event-stream", b"".join(sse_frame(t, d) for t, d in events)
            else:
                ctype, raw = "application/json", json.dumps(events[-1][1]["response"]).encode()
            body = content_encode(raw, coding)
            self.status = 200
            headers = [("content-type", ctype), ("content-encoding", coding), ("content-length", str(len(body))), *self.common_headers, *self._extra_headers(), *self._close_header()]
            await self.conn.send(head_bytes(200, headers) + body)
            self.events_sent += len(events) if streamed else 0
        elif not streamed:
            self.status = 200
            final = events[-1][1]["response"]
            body = json.dumps(final).encode()
            headers = [("content-type", "application/json"), ("content-length", str(len(body))), *self.common_headers, *self._extra_headers(), *self._close_header()]
            await self.conn.send(head_bytes(200, headers) + body)
        else:
            await self._sse_headers()
            await self._sleep(_ms(self.b, "first_event_ms", 0))
            await self._stream(events, _ms(self.b, "gap_ms", 0))
            after = self.b.get("after_completed")
            if after in ("reset", "clean_close"):
                # every event, response.completed included, then a broken transport: the
                # chunked body never ends
                await self.conn.flush_kernel()
                if after == "reset":
                    self.conn.reset()
                else:
                    await self.conn.close()
                self.outcome = f"completed_then_{after}"
                return
            await self.conn.send(b"0\r\n\r\n")
        self.outcome = "completed"
        self.reusable = True

    async def _do_ok(self, default_delay_ms: float = 0) -> None:
        """``ok``: params ``events`` (deltas, 3), ``gap_ms`` (between events, 0), ``after_completed``
        (``reset`` or ``clean_close``: the transport breaks after the last event, before the
        end of the chunked body), ``delay_ms``
        (before the headers, 0), ``first_event_ms`` (headers to first event, 0), ``think_ms``
        (after response.created and response.in_progress, before the output: a turn that
        started and then stalls; 0; also for ``tool_call`` and ``partial``), ``text``
        ("hello"), ``delta_bytes`` (size of each delta's text; default len(text)), ``headers``
        (extra response headers), ``content_encoding`` (identity, gzip, deflate, br, zstd: the
        whole body at once in that coding). SSE stream when the body says ``"stream": true``,
        else one JSON object (the API's default)."""
        deltas = int(self.b.get("events", 3))
        await self._sleep(_ms(self.b, "delay_ms", default_delay_ms))
        await self._complete(ok_events(self.rid, self.model, deltas, self._text()))

    async def _do_tool_call(self) -> None:
        """``tool_call``: params ``name`` ("repro_lookup"), ``arguments`` (JSON text or object,
        "{}"), ``call_id`` (minted), and ``delay_ms``, ``first_event_ms``, ``gap_ms``,
        ``headers`` as for ``ok``. A completed response whose output is one function call, so
        the client runs the tool and sends the turn's next request with the
        ``x-codex-turn-state`` this response carries."""
        args = self.b.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, separators=(",", ":"))
        call_id = self.b.get("call_id") or f"call_{self.n}_{secrets.token_hex(6)}"
        await self._sleep(_ms(self.b, "delay_ms", 0))
        events = tool_call_events(self.rid, self.model, self.b.get("name", "repro_lookup"), args, call_id)
        await self._complete(events)

    async def _do_slow(self) -> None:
        """``slow``: ``ok`` with a default ``delay_ms`` of 60 s."""
        await self._do_ok(default_delay_ms=SLOW_DEFAULT_DELAY_MS)

    async def _do_stall_before_headers(self) -> None:
        """``stall_before_headers``: param ``ms`` (600000). Send nothing for ``ms``, then close."""
        await self._sleep(_ms(self.b, "ms", DEFAULT_STALL_MS))
        await self.conn.close()
        self.outcome = "stalled_then_closed"

    async def _do_stall_after_headers(self) -> None:
        """``stall_after_headers``: param ``ms`` (600000). SSE headers, nothing for ``ms``,
        then close (the chunked body never ends)."""
        await self._sse_headers()
        await self._sleep(_ms(self.b, "ms", DEFAULT_STALL_MS))
        await self.conn.close()
        self.outcome = "stalled_then_closed"

    async def _do_reset(self) -> None:
        """``reset``: TCP RST right after reading the request, no response bytes."""
        self.conn.reset()
        self.outcome = "reset"

    async def _do_clean_close(self) -> None:
        """``clean_close``: FIN with no response bytes."""
        await self.conn.close()
        self.outcome = "clean_close"

    async def _do_status(self) -> None:
        """``status``: params ``code`` (500), ``body`` (JSON object or string; default an
        OpenAI-shaped error), ``retry_after`` (seconds, Retry-After header), ``delay_ms``,
        ``headers`` (extra response headers, e.g. ``{"x-should-retry": "false"}``)."""
        code = int(self.b.get("code", 500))
        await self._sleep(_ms(self.b, "delay_ms", 0))
        body = self.b.get("body", openai_error(code))
        if isinstance(body, str):
            ctype, raw = "text/plain", body.encode()
        else:
            ctype, raw = "application/json", json.dumps(body).encode()
        headers = [("content-type", ctype), ("content-length", str(len(raw))), *self.common_headers, *self._extra_headers()]
        if self.b.get("retry_after") is not None:
            ra = self.b["retry_after"]
            headers.append(("retry-after", str(int(ra)) if float(ra).is_integer() else str(ra)))
        headers += self._close_header()
        self.status = code
        await self.conn.send(head_bytes(code, headers) + raw)
        self.outcome = "status"
        self.reusable = True

    async def _do_partial(self) -> None:
        """``partial``: param ``events`` (k, 2), also ``gap_ms``, ``delay_ms``,
        ``first_event_ms``, ``text``, ``delta_bytes``, ``headers``. SSE headers and the first k
        events of an ok stream, then ``end``: ``reset`` (default: RST), ``clean_close`` (FIN
        without the chunked body's end), ``stall`` (nothing for ``stall_ms``, 600000, then
        close) or ``failed`` (a ``response.failed`` event and a complete body)."""
        k = int(self.b.get("events", 2))
        end = self.b.get("end", "reset")
        await self._sleep(_ms(self.b, "delay_ms", 0))
        events = ok_events(self.rid, self.model, max(3, k), self._text())[:k]
        await self._sse_headers()
        await self._sleep(_ms(self.b, "first_event_ms", 0))
        await self._stream(events, _ms(self.b, "gap_ms", 0))
        if end == "failed":
            await self.conn.send(chunk(sse_frame(*failed_event(self.rid, self.model, k))))
            self.events_sent += 1
            await self.conn.send(b"0\r\n\r\n")
            self.outcome = "partial_failed"
            self.reusable = True
            return
        await self.conn.flush_kernel()
        if end == "stall":
            await self._sleep(_ms(self.b, "stall_ms", DEFAULT_STALL_MS))
            await self.conn.close()
            self.outcome = "partial_stalled_then_closed"
        elif end == "clean_close":
            await self.conn.close()
            self.outcome = "partial_clean_close"
        else:
            self.conn.reset()
            self.outcome = "partial_reset"


# --------------------------------------------------------------------------------------------
# Entry point


async def serve(args: argparse.Namespace, scenario: dict[str, Any]) -> int:
    """Run until SIGTERM/SIGINT; return the exit status."""
    state = MockUpstream(scenario, args.log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await asyncio.start_server(state.handle, args.host, args.port, reuse_address=True)
    port = server.sockets[0].getsockname()[1]
    print(f"mock upstream listening at http://{args.host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            # a second signal during shutdown (a process group and a trap both sending one)
            # must not reach the closing loop's wakeup fd
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        server.close()
        tasks = list(state.tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        state.close()
    return 0


HELP_INTRO = """\
A mock OpenAI Responses API upstream you can make stall, reset, fail or answer slowly, per
request or by script: put turnguard (scripts/proxy) in front of it to see holds, replays,
409s, cooldown 503s and recoveries without a network. Standard library only.

Model routes: POST .../responses and POST .../chat/completions (any prefix, query ignored).
  The request body must be a JSON object (else 400 invalid_request_error, like the API; not
  counted as a dispatch). The answer is SSE when the body says "stream": true, else one JSON
  response object. Every model request is a numbered *dispatch* n = 0, 1, 2, ... and is
  answered by a BEHAVIOUR, the first of:
    1. the x-mock-behaviour request header, a BEHAVIOUR as JSON, e.g.
         -H 'x-mock-behaviour: {"kind": "slow", "delay_ms": 5000}'
    2. the scenario's "operations" selector of the request body's sha256 (a prefix of >= 8
       hex digits), then its "sessions" selector of the session-id / session_id header
    3. the scenario's "sequence"[n], else its "default" ({"kind": "ok"} when absent)

Control endpoints:
  GET  /_mock/health       200 ok
  GET  /_mock/dispatches   JSON list of the dispatch records so far (/_mock/records: all)
  POST /_mock/scenario     body: a SCENARIO; replaces it and restarts the count at n = 0

SCENARIO (JSON, every key optional; --scenario FILE or POST /_mock/scenario):
  {"default": BEHAVIOUR, "sequence": [BEHAVIOUR, ...],
   "sessions": {"SESSION-ID": {"sequence": [...], "default": BEHAVIOUR}},
   "operations": {"BODY-SHA256-PREFIX": {"sequence": [...], "default": BEHAVIOUR}}}

Log (--log FILE, JSON lines, 0600): a "dispatch" record when a dispatch starts (n, ts, path,
session, body_sha256, behaviour, ...), "client_gone" when its client left early, "dispatch_end"
(status, events_sent, outcome), "invalid_body", "scenario". No Authorization value is logged.
"""


def behaviours_help() -> str:
    """Every behaviour kind with its parameters: the ``_do_*`` docstrings, so the help never
    drifts from the code."""
    import inspect
    import textwrap

    lines = ["BEHAVIOUR = {\"kind\": KIND, ...parameters} (times in ms):"]
    for kind in sorted(KINDS):
        doc = inspect.getdoc(getattr(Dispatch, "_do_" + kind)) or ""
        text = " ".join(doc.replace("``", "").split())
        lines += textwrap.wrap(text, 92, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines)


EXAMPLES = """\
Examples:
  scripts/mock --port 9000 --log /tmp/mock.jsonl
  curl -s 127.0.0.1:9000/v1/responses -d '{"model": "m", "input": "hi"}'
  curl -sN 127.0.0.1:9000/v1/responses -d '{"model": "m", "input": "hi", "stream": true}' \\
       -H 'x-mock-behaviour: {"kind": "partial", "events": 3, "end": "reset"}'
  curl -s 127.0.0.1:9000/_mock/scenario -d '{"sequence": [{"kind": "stall_before_headers",
       "ms": 8000}, {"kind": "reset"}], "default": {"kind": "ok"}}'
"""


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the scenario and serve."""
    p = argparse.ArgumentParser(
        prog=os.environ.get("TURNGUARD_MOCK_PROG") or "mock_upstream.py",
        description=HELP_INTRO, epilog=behaviours_help() + "\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; keep it on loopback)")
    p.add_argument("--port", type=int, default=0,
                   help="port (default 0: one the OS picks; the listening line names it)")
    p.add_argument("--scenario", metavar="FILE", help="scenario JSON file (see SCENARIO above)")
    p.add_argument("--log", metavar="FILE", help="JSON-lines log file (appended, mode 0600)")
    args = p.parse_args(argv)
    scenario: Any = DEFAULT_SCENARIO
    if args.scenario:
        try:
            with open(args.scenario, encoding="utf-8") as f:
                scenario = validate_scenario(json.load(f))
        except (OSError, ValueError) as e:
            print(f"mock upstream: bad scenario {args.scenario}: {e}", file=sys.stderr, flush=True)
            return 2
    return asyncio.run(serve(args, scenario))


if __name__ == "__main__":
    sys.exit(main())
