"""A small HTTP/1.1 client on asyncio streams, for the client models.

Responses are parsed by h11 and SSE bodies read with ``turnguard_sse`` (the tests' and tools'
reader), so the reproduction toolkit needs nothing but mitmproxy (which installs h11). Every request
goes on a NEW connection (what the incidents are about: a retry or a gateway's re-send on a
fresh connection while the original may still be open), sends ``connection: close``, and
fills an ``Exchange`` as it goes, so a caller that cancels the task still has the partial
record (status, headers, events seen so far, the time of each step).

Every wait is bounded: the connect timeout, the optional headers timeout (time to the status
line), the optional idle timeout (longest silence while reading the body) and a hard total cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11

from turnguard_sse import SseEvent, SseReader

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_READS = 1_000_000  # reads per response: bounds every loop below
HARD_CAP_S = 900.0  # no exchange lasts longer than this, whatever the caller asked


@dataclass
class Exchange:
    """One request and what came back, filled in progressively (times are ``time.time()``)."""

    t_start: float = 0.0
    t_headers: float | None = None
    t_end: float | None = None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names, first value
    body: bytes = b""
    error: str | None = None
    events: list[SseEvent] = field(default_factory=list)
    _sse: SseReader = field(default_factory=SseReader)
    _on_event: Any = None

    # -- what the body says ------------------------------------------------------------------
    @property
    def is_sse(self) -> bool:
        return self.headers.get("content-type", "").lower().startswith("text/event-stream")

    @property
    def terminal(self) -> str | None:
        """``completed`` / ``incomplete`` / ``failed`` / ``error`` from the SSE stream's
        terminal event, or from a whole JSON response object's ``status``."""
        for ev in reversed(self.events):
            if ev.type in ("response.completed", "response.incomplete", "response.failed", "error"):
                return ev.type.removeprefix("response.")
        if not self.is_sse and self.status is not None and 200 <= self.status < 300 and self.body:
            try:
                obj = json.loads(self.body)
            except ValueError:
                return None
            if isinstance(obj, dict) and obj.get("status") in ("completed", "incomplete", "failed"):
                return obj["status"]
        return None

    @property
    def completed(self) -> bool:
        """A 2xx answer that ended with a terminal success and no transport error."""
        return (
            self.error is None
            and self.status is not None
            and 200 <= self.status < 300
            and self.terminal in ("completed", "incomplete")
        )

    def final_response(self) -> dict[str, Any] | None:
        """The final ``response`` object (from ``response.completed`` or a whole JSON body)."""
        for ev in reversed(self.events):
            if ev.type in ("response.completed", "response.incomplete") and isinstance(ev.data, dict):
                resp = ev.data.get("response")
                return resp if isinstance(resp, dict) else None
        if not self.is_sse and self.body:
            try:
                obj = json.loads(self.body)
            except ValueError:
                return None
            return obj if isinstance(obj, dict) else None
        return None

    def function_calls(self) -> list[dict[str, Any]]:
        """The function-call items of the final response's output."""
        resp = self.final_response() or {}
        out = resp.get("output") or []
        return [i for i in out if isinstance(i, dict) and i.get("type") == "function_call"]

    def retry_after_s(self) -> float | None:
        """``retry-after-ms`` / ``retry-after`` (seconds; an HTTP date is not parsed) or None."""
        for name, div in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
            v = self.headers.get(name)
            if v is None:
                continue
            try:
                return float(v) / div
            except ValueError:
                continue
        return None

    def json_error_code(self) -> str | None:
        """``error.code`` of a JSON (or SSE ``error`` event) error body."""
        for ev in self.events:
            if ev.type == "error" and isinstance(ev.data, dict):
                err = ev.data.get("error", ev.data)
                return err.get("code") if isinstance(err, dict) else None
        try:
            obj = json.loads(self.body)
        except ValueError:
            return None
        err = obj.get("error") if isinstance(obj, dict) else None
        return err.get("code") if isinstance(err, dict) else None

    # -- SSE ---------------------------------------------------------------------------------
    def _feed_sse(self, data: bytes) -> None:
        for ev in self._sse.feed(data):
            self.events.append(ev)
            if self._on_event is not None:
                self._on_event(self, ev)


class _Closed(Exception):
    pass


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader,
                      timeout: Callable[[], float]) -> Any:
    """The next h11 event of the response, reading as needed (``timeout()`` seconds at most per
    read; b"" at EOF tells h11 the connection closed)."""
    for _ in range(MAX_READS):
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await asyncio.wait_for(reader.read(65536), timeout()))
    raise _Closed("too many reads")


async def post(
    ex: Exchange,
    url: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
    *,
    connect_timeout: float = 5.0,
    headers_timeout: float | None = None,
    idle_timeout: float | None = None,
    on_headers: Callable[[Exchange], Awaitable[None]] | None = None,
    on_body: Callable[[bytes], Awaitable[None]] | None = None,
    on_event: Callable[[Exchange, SseEvent], None] | None = None,
    method: str = "POST",
) -> Exchange:
    """Send one request on a new connection and read the whole answer into ``ex``.

    Never raises for network trouble: ``ex.error`` says what happened (``connect failed``,
    ``reset before headers``, ``closed before headers``, ``timeout before headers``,
    ``cut after headers``, ``idle timeout``). Cancellation sets ``ex.error = "cancelled"``,
    closes the socket and propagates."""
    ex.t_start = time.time()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    prefix = parts.path.rstrip("/")
    writer: asyncio.StreamWriter | None = None
    loop = asyncio.get_running_loop()
    hard_deadline = loop.time() + HARD_CAP_S

    def left(t: float | None) -> float:
        rest = hard_deadline - loop.time()
        return max(0.001, min(rest, t) if t is not None else rest)

    try:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), connect_timeout)
        except (OSError, TimeoutError) as e:
            ex.error = f"connect failed: {e.__class__.__name__}"
            return ex
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        skip = {"host", "content-length", "connection", "transfer-encoding"}
        head = [("host", f"{host}:{port}"), *((k, v) for k, v in headers.items() if k.lower() not in skip),
                ("content-length", str(len(body))), ("connection", "close")]
        writer.write(conn.send(h11.Request(method=method, target=prefix + path, headers=head))
                     + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        try:
            await asyncio.wait_for(writer.drain(), left(connect_timeout))
            response = await _next_event(conn, reader, lambda: left(headers_timeout))
            for _ in range(MAX_READS):  # informational answers (100 Continue) before the real one
                if not isinstance(response, h11.InformationalResponse):
                    break
                response = await _next_event(conn, reader, lambda: left(headers_timeout))
        except TimeoutError:
            ex.error = "timeout before headers"
            return ex
        except (ConnectionResetError, BrokenPipeError):
            ex.error = "reset before headers"
            return ex
        except (_Closed, OSError, h11.RemoteProtocolError):
            ex.error = "closed before headers"
            return ex
        if not isinstance(response, h11.Response):
            ex.error = "closed before headers"
            return ex
        ex.t_headers = time.time()
        ex.status = response.status_code
        for k, v in response.headers:
            ex.headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        if on_headers is not None:
            await on_headers(ex)
        ex._on_event = on_event
        await _read_body(ex, conn, reader, lambda: left(idle_timeout), on_body)
        return ex
    except asyncio.CancelledError:
        ex.error = ex.error or "cancelled"
        raise
    finally:
        ex.t_end = time.time()
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.transport.abort()


async def _read_body(
    ex: Exchange,
    conn: h11.Connection,
    reader: asyncio.StreamReader,
    timeout: Callable[[], float],
    on_body: Callable[[bytes], Awaitable[None]] | None,
) -> None:
    """The body, as h11 frames it (content-length, chunked, or until the connection closes),
    fed to ``ex`` piece by piece; ``ex.error`` when it does not end as framed."""
    try:
        for _ in range(MAX_READS):
            event = await _next_event(conn, reader, timeout)
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return
            if isinstance(event, h11.Data):
                data = bytes(event.data)
                if len(ex.body) + len(data) > MAX_BODY_BYTES:
                    raise _Closed("body too large")
                ex.body += data
                if ex.is_sse:
                    ex._feed_sse(data)
                if on_body is not None:
                    await on_body(data)
        raise _Closed("too many reads")
    except TimeoutError:
        ex.error = "idle timeout"
    except (ConnectionResetError, BrokenPipeError):
        ex.error = "cut after headers (reset)"
    except (_Closed, OSError, h11.RemoteProtocolError):
        ex.error = "cut after headers"
