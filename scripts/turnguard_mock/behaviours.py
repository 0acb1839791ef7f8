"""Behaviours: how the mock answers one dispatch, byte by byte and in time.

``Dispatch`` runs one behaviour against one request on one connection; each kind of
``scenario.KINDS`` is a ``_do_<kind>`` method whose docstring documents its parameters (the
``--help`` text is made from them, so it never drifts from the code). Every sleep ends early
with ``ClientGone`` when the client leaves, and no sleep is longer than MAX_SLEEP_MS.
"""

from __future__ import annotations

import asyncio
import gzip
import inspect
import json
import secrets
import textwrap
import time
import zlib
from typing import Any, Callable

from turnguard_sse import frame

from .events import Event, delta_text, failed_event, ok_events, openai_error, tool_call_events
from .scenario import KINDS
from .server import LAST_CHUNK, ClientGone, Connection, Request, chunk, response_head

MAX_SLEEP_MS = 3_600_000  # no behaviour sleeps longer than an hour
SLOW_DEFAULT_DELAY_MS = 60_000
DEFAULT_STALL_MS = 600_000
DEFAULT_HOLD_MS = 60_000
HOLD_POLL_S = 0.05  # a held dispatch looks for its release (and its client) this often


def _ms(b: dict[str, Any], key: str, default: float) -> float:
    """A millisecond parameter as seconds, clamped to MAX_SLEEP_MS."""
    return min(float(b.get(key, default) or 0), MAX_SLEEP_MS) / 1000.0


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


class Holds:
    """Named holds (a behaviour's ``hold``): a dispatch that reaches its hold point waits there
    until ``release(name)`` (``POST /_mock/release``), at most its ``hold_ms``. A release is
    kept for the server's life: a dispatch that reaches its hold after it passes at once.
    ``record`` logs the ``held`` and ``hold_end`` records."""

    def __init__(self, record: Callable[[dict[str, Any]], None]):
        self.record = record
        self.released: set[str] = set()
        self.waiting: dict[str, int] = {}

    def release(self, name: str) -> int:
        """Release ``name`` now and for later; returns the dispatches waiting at it now."""
        self.released.add(name)
        return self.waiting.get(name, 0)


class Dispatch:
    """One model request being answered by one behaviour ``b``. ``status`` is the status line
    sent (None if none), ``events_sent`` the SSE events written, ``reusable`` whether the
    connection can serve another request afterwards, ``outcome`` how it ended."""

    def __init__(self, conn: Connection, req: Request, n: int, b: dict[str, Any]):
        self.conn = conn
        self.req = req
        self.n = n
        self.b = b
        self.status: int | None = None
        self.events_sent = 0
        self.reusable = False
        self.outcome = "unfinished"
        self.holds: Holds | None = None  # set by the server that runs it (``hold``)
        self._hold_passed = False
        # ``response_id``: every response uses this id (servers need not make them unique)
        rid = b.get("response_id")
        self.rid = rid if isinstance(rid, str) and rid else f"resp_{n}_{secrets.token_hex(8)}"
        try:
            body = json.loads(req.body) if req.body else {}
        except (ValueError, RecursionError):
            body = None
        self.body = body if isinstance(body, dict) else {}
        model = self.body.get("model")
        self.model = model if isinstance(model, str) else "mock-model"
        turn_state = req.header("x-codex-turn-state")
        self.common_headers = [
            ("x-request-id", f"req_{n}"),
            ("x-codex-turn-state", turn_state if turn_state is not None else f"ts_{secrets.token_hex(8)}"),
        ]

    async def run(self) -> None:
        """Answer with the behaviour of its kind."""
        await getattr(self, "_do_" + self.b["kind"])()

    def _headers(self, *first: tuple[str, str],
                 late: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str]]:
        """``first``, then x-request-id and x-codex-turn-state, the behaviour's own ``headers``
        parameter (e.g. x-should-retry, retry-after-ms), ``late``, and ``connection: close``
        when the request did not keep the connection alive."""
        extra = list((self.b.get("headers") or {}).items())
        close = [] if self.req.keep_alive else [("connection", "close")]
        return [*first, *self.common_headers, *extra, *late, *close]

    async def _sleep(self, seconds: float) -> None:
        """Sleep, or raise ClientGone as soon as the client disconnects."""
        if seconds > 0 and await self.conn.wait_gone(seconds):
            raise ClientGone()

    async def _hold(self, at: int | None) -> None:
        """Wait at the behaviour's hold point if this is it: ``at`` is None before the status
        line, else the number of events sent so far; the point is the first one at which
        ``hold_after_events`` events were sent (absent: before the status line). Once per
        dispatch; ClientGone as soon as the client disconnects."""
        name = self.b.get("hold")
        if name is None or self.holds is None or self._hold_passed:
            return
        want = self.b.get("hold_after_events")
        if (at is not None) if want is None else (at is None or at < int(want)):
            return
        self._hold_passed = True
        holds = self.holds
        holds.record({"event": "held", "n": self.n, "ts": time.time(), "hold": name,
                      "events_sent": self.events_sent})
        holds.waiting[name] = holds.waiting.get(name, 0) + 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _ms(self.b, "hold_ms", DEFAULT_HOLD_MS)
        try:
            while name not in holds.released:  # bounded by the deadline
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                await self._sleep(min(HOLD_POLL_S, remaining))
        finally:
            holds.waiting[name] -= 1
        holds.record({"event": "hold_end", "n": self.n, "ts": time.time(), "hold": name,
                      "how": "released" if name in holds.released else "timed_out"})

    async def _send_whole(self, status: int, ctype: str, body: bytes, *more: tuple[str, str],
                          late: tuple[tuple[str, str], ...] = ()) -> None:
        """A whole response: its status line and headers (``_headers``), then ``body``."""
        self.status = status
        headers = self._headers(("content-type", ctype), *more,
                                ("content-length", str(len(body))), late=late)
        await self.conn.send(response_head(status, headers) + body)

    async def _sse_headers(self) -> None:
        self.status = 200
        await self.conn.send(response_head(200, self._headers(
            ("content-type", "text/event-stream"), ("cache-control", "no-cache"),
            ("transfer-encoding", "chunked"))))

    async def _end_stream(self) -> None:
        """The end of a complete event stream (the chunked body's last chunk)."""
        await self.conn.send(LAST_CHUNK)

    async def _send_event(self, event: Event) -> None:
        await self.conn.send(chunk(frame(*event)))
        self.events_sent += 1

    async def _stream(self, events: list[Event], gap: float) -> None:
        """Write events, one chunk each, draining after each, with ``gap`` seconds between, and
        the behaviour's ``think_ms`` after ``response.in_progress`` (before the output)."""
        think = _ms(self.b, "think_ms", 0)
        for i, event in enumerate(events):
            if i and gap:
                await self._sleep(gap)
            if think and i and events[i - 1][0] == "response.in_progress":
                await self._sleep(think)
            await self._hold(self.events_sent)
            await self._send_event(event)

    def _text(self) -> str:
        size = self.b.get("delta_bytes")
        return delta_text(self.b.get("text", "hello"), None if size is None else int(size))

    async def _break(self, how: str) -> None:
        """End the connection mid-response: ``reset`` (RST) or ``clean_close`` (FIN), after the
        kernel took every byte written so far."""
        await self.conn.flush_kernel()
        if how == "reset":
            self.conn.reset()
        else:
            await self.conn.close()

    async def _complete(self, events: list[Event]) -> None:
        """Answer with ``events``: an SSE stream (``first_event_ms`` after the headers, then
        ``gap_ms`` between events) when the request says ``"stream": true``, else the final
        response object as one JSON body, like the API. With ``content_encoding`` the whole
        body is sent at once in that coding (and ``first_event_ms`` and ``gap_ms`` are
        ignored)."""
        await self._hold(None)
        coding = self._content_coding()
        streamed = self.body.get("stream") is True  # like the API: JSON unless asked to stream
        final = json.dumps(events[-1][1]["response"]).encode()
        if streamed and coding in ("gzip", "deflate") and self.b.get("coded_stream"):
            await self._coded_stream(events, coding)
        elif coding is not None and coding != "identity":
            if streamed:
                ctype, raw = "text/event-stream", b"".join(frame(*e) for e in events)
            else:
                ctype, raw = "application/json", final
            await self._send_whole(200, ctype, content_encode(raw, coding),
                                   ("content-encoding", coding))
            self.events_sent += len(events) if streamed else 0
        elif not streamed:
            await self._send_whole(200, "application/json", final)
        else:
            await self._sse_headers()
            await self._sleep(_ms(self.b, "first_event_ms", 0))
            await self._stream(events, _ms(self.b, "gap_ms", 0))
            await self._hold(self.events_sent)  # hold_after_events: every event sent
            after = self.b.get("after_completed")
            if after == "repeat_terminal":  # a misbehaving upstream: the terminal event
                await self._sleep(0.3)      # once more, late (a WebSocket's next call may
                await self._stream(events[-1:], 0)  # be in flight by then)
            elif after == "repeat_output":  # the last output event once more, late, as the
                await self._sleep(0.3)      # API sends one: naming its item, not its response
                kind, payload = events[-2]
                await self._stream([(kind, {k: v for k, v in payload.items() if k != "response"})], 0)
            if after in ("reset", "clean_close"):
                # every event, response.completed included, then a broken transport: the
                # chunked body never ends
                await self._break(after)
                self.outcome = f"completed_then_{after}"
                return
            await self._end_stream()
        self.outcome = "completed"
        self.reusable = True

    async def _coded_stream(self, events: list[Event], coding: str) -> None:
        """``coded_stream``: an event stream in gzip or deflate sent as it is made, each
        event compressed and flushed in a chunk of its own, ``gap_ms`` apart."""
        self.status = 200
        await self.conn.send(response_head(200, self._headers(
            ("content-type", "text/event-stream"), ("content-encoding", coding),
            ("transfer-encoding", "chunked"))))
        z = zlib.compressobj(wbits=31 if coding == "gzip" else 15)
        gap = _ms(self.b, "gap_ms", 0)
        for i, event in enumerate(events):
            if i and gap:
                await self._sleep(gap)
            await self.conn.send(chunk(z.compress(frame(*event)) + z.flush(zlib.Z_SYNC_FLUSH)))
            self.events_sent += 1
        await self.conn.send(chunk(z.flush()))
        await self._end_stream()

    def _content_coding(self) -> str | None:
        return self.b.get("content_encoding")

    async def _do_ok(self, default_delay_ms: float = 0) -> None:
        """``ok``: params ``events`` (deltas, 3), ``gap_ms`` (between events, 0), ``after_completed``
        (``reset`` or ``clean_close``: the transport breaks after the last event, before the
        end of the chunked body; ``repeat_terminal``: the last event again 300 ms later, as a
        misbehaving upstream might; ``repeat_output``: the last output event, the item's done,
        again 300 ms later, without the response id the mock's events carry, as the API sends
        it), ``delay_ms``
        (before the headers, 0), ``first_event_ms`` (headers to first event, 0), ``think_ms``
        (after response.created and response.in_progress, before the output: a turn that
        started and then stalls; 0; also for ``tool_call`` and ``partial``), ``text``
        ("hello"), ``delta_bytes`` (size of each delta's text; default len(text)), ``headers``
        (extra response headers), ``content_encoding`` (identity, gzip, deflate, br, zstd: the
        whole body at once in that coding; with ``coded_stream``, gzip or deflate, an event
        stream sent as it is made, ``gap_ms`` between events), ``hold`` (a name: the answer waits
        at its hold point until ``POST /_mock/release`` names it, at most ``hold_ms``, 60000;
        a release that came first lets it pass; also for ``tool_call`` and ``partial``),
        ``hold_after_events`` (the hold point: once that many events of a stream were sent,
        before the next or the stream's end; absent: before the status line; not with
        ``content_encoding``). SSE stream when the body says ``"stream": true``, else one JSON object (the
        API's default)."""
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
        retry_after: tuple[tuple[str, str], ...] = ()
        if self.b.get("retry_after") is not None:
            ra = self.b["retry_after"]
            retry_after = (("retry-after", str(int(ra)) if float(ra).is_integer() else str(ra)),)
        await self._send_whole(code, ctype, raw, late=retry_after)
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
        await self._hold(None)
        await self._sse_headers()
        await self._sleep(_ms(self.b, "first_event_ms", 0))
        await self._stream(events, _ms(self.b, "gap_ms", 0))
        await self._hold(self.events_sent)
        if end == "failed":
            await self._send_event(failed_event(self.rid, self.model, k))
            await self._end_stream()
            self.outcome = "partial_failed"
            self.reusable = True
        elif end == "stall":
            await self.conn.flush_kernel()
            await self._sleep(_ms(self.b, "stall_ms", DEFAULT_STALL_MS))
            await self.conn.close()
            self.outcome = "partial_stalled_then_closed"
        else:
            await self._break(end)
            self.outcome = f"partial_{end}"


def behaviours_help() -> str:
    """Every behaviour kind with its parameters: the ``_do_*`` docstrings, so the help never
    drifts from the code."""
    lines = ["BEHAVIOUR = {\"kind\": KIND, ...parameters} (times in ms):"]
    for kind in sorted(KINDS):
        doc = inspect.getdoc(getattr(Dispatch, "_do_" + kind)) or ""
        text = " ".join(doc.replace("``", "").split())
        lines += textwrap.wrap(text, 92, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines)
