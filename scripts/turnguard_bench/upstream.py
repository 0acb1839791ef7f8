"""A minimal, fast HTTP/1.1 upstream for the benchmarks (loopback only).

    python -m turnguard_bench.upstream [--port 0]

prints ``bench upstream listening at http://127.0.0.1:PORT`` and serves until SIGTERM/SIGINT.
Unlike ``scripts/mock_upstream.py`` (which is built to misbehave on cue) it does as little as
possible per request: an ``asyncio.Protocol``, responses precomputed and cached, one
``transport.write`` per response, no logging. So the proxy, not the upstream, is what a
benchmark measures. What it shares with the mock (``turnguard_mock``): the request parser
(h11), the response framing and the Responses API events.

Model requests (any ``POST`` but the control routes) are answered 200 with a chunked SSE stream
of Responses-API-shaped events (one HTTP chunk per event), chosen by request headers:

``x-bench-events: N``   N events in all (default 8: created, in_progress, output_item.added,
                        3 x output_text.delta, output_item.done, completed; N >= 6)
``x-bench-bytes: B``    instead: a compact stream (created, deltas of <= 4 KiB, completed) whose
                        body is exactly B bytes (B >= 512)
``x-bench-hold: 1``     send nothing until ``POST /_bench/release`` (or HOLD_MAX_S passed); the
                        time right after the last byte was written is recorded under the
                        request's ``x-bench-id`` and ``x-bench-op``

Control: ``GET /_bench/stats`` (JSON: dispatches, held now, released, last-byte times),
``POST /_bench/release`` (release every held request), ``POST /_bench/reset`` (zero the stats).
Times are ``time.monotonic()``: CLOCK_MONOTONIC, comparable across processes on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time

from turnguard_bench import HOST
from turnguard_mock.events import ok_events
from turnguard_mock.server import (
    LAST_CHUNK,
    BadRequest,
    RequestParser,
    chunk,
    json_error,
    response_head,
    until_stopped,
)
from turnguard_sse import frame as sse_frame

MAX_BODY = 16 * 1024 * 1024
MAX_PIPELINED = 1000  # requests answered from one read
HOLD_MAX_S = 600.0  # a held request is answered after this long even without a release
DEFAULT_EVENTS = 8
MAX_EVENTS = 100_000
MAX_BYTES = 64 * 1024 * 1024
DELTA_MAX = 4096

_HEAD = response_head(200, [("content-type", "text/event-stream"), ("cache-control", "no-cache"),
                            ("x-request-id", "req_bench"), ("transfer-encoding", "chunked")])


def events_body(n_events: int) -> list[bytes]:
    """The SSE frames of an ok stream of ``n_events`` events."""
    deltas = max(1, n_events - 5)
    events = ok_events("resp_bench", "bench", deltas, "hello")
    return [sse_frame(t, d) for t, d in events]


def sized_body(n_bytes: int) -> list[bytes]:
    """Compact SSE frames whose concatenation is exactly ``n_bytes`` long."""
    head = sse_frame(
        "response.created",
        {"type": "response.created", "response": {"id": "resp_bench", "status": "in_progress"}},
    )
    tail = sse_frame(
        "response.completed",
        {"type": "response.completed", "response": {"id": "resp_bench", "status": "completed"}},
    )

    def delta(text_len: int) -> bytes:
        return sse_frame(
            "response.output_text.delta",
            {"type": "response.output_text.delta", "delta": "x" * text_len},
        )

    overhead = len(delta(0))
    frames = [head]
    left = n_bytes - len(head) - len(tail)
    if left < overhead + 1:
        raise ValueError(f"x-bench-bytes {n_bytes} is too small")
    while left > 0:  # bounded: each pass consumes at least overhead + 1 bytes
        if left <= overhead + DELTA_MAX:
            frames.append(delta(left - overhead))
            left = 0
        elif left - (overhead + DELTA_MAX) < overhead + 1:
            frames.append(delta(left - 2 * overhead - 1))  # leave room for a last 1-char delta
            left = overhead + 1
        else:
            frames.append(delta(DELTA_MAX))
            left -= overhead + DELTA_MAX
    frames.append(tail)
    assert sum(map(len, frames)) == n_bytes
    return frames


class State:
    def __init__(self) -> None:
        self.cache: dict[tuple[str, int], bytes] = {}
        self.reset()

    def reset(self) -> None:
        self.dispatches = 0
        self.held: list[tuple[asyncio.Transport, bytes, str | None, str | None]] = []
        self.released = 0
        self.last_byte_by_id: dict[str, float] = {}
        self.last_byte_by_op: dict[str, float] = {}
        self.release_at: float | None = None
        self.held_since = 0.0

    def response(self, kind: str, n: int) -> bytes:
        key = (kind, n)
        r = self.cache.get(key)
        if r is None:
            frames = events_body(n) if kind == "events" else sized_body(n)
            r = _HEAD + b"".join(chunk(f) for f in frames) + LAST_CHUNK
            if len(self.cache) > 64:
                self.cache.clear()
            self.cache[key] = r
        return r

    def release(self) -> int:
        held, self.held = self.held, []
        self.release_at = time.monotonic()
        for transport, data, rid, op in held:
            if transport.is_closing():
                continue
            transport.write(data)
            t = time.monotonic()
            if rid is not None:
                self.last_byte_by_id[rid] = t
            if op is not None:
                self.last_byte_by_op[op] = max(t, self.last_byte_by_op.get(op, 0.0))
            self.released += 1
        return len(held)

    def stats(self) -> dict:
        return {
            "dispatches": self.dispatches,
            "held": len(self.held),
            "released": self.released,
            "release_at": self.release_at,
            "last_byte_by_id": self.last_byte_by_id,
            "last_byte_by_op": self.last_byte_by_op,
        }


class Server(asyncio.Protocol):
    """One connection: requests parsed by the mock's ``RequestParser`` (h11) as bytes arrive,
    each answered with one ``transport.write`` of a cached response."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.parser = RequestParser(max_body_bytes=MAX_BODY)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        for _ in range(MAX_PIPELINED):  # bounded: pipelined requests in one read
            try:
                req = self.parser.next_request()
            except BadRequest as e:
                self._send_simple(400, json.dumps(json_error(str(e), "bad_request")).encode(),
                                  "application/json")
                self.transport.close()
                return
            if req is None:
                return
            headers = {k.lower(): v for k, v in req.headers}
            self._route(req.method, req.path, headers)

    def _send_simple(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
        self.transport.write(response_head(status, [("content-type", ctype),
                                                    ("content-length", str(len(body)))]) + body)

    def _route(self, method: str, path: str, headers: dict[str, str]) -> None:
        st = self.state
        if path == "/_bench/stats":
            self._send_simple(200, json.dumps(st.stats()).encode(), "application/json")
            return
        if path == "/_bench/release" and method == "POST":
            n = st.release()
            self._send_simple(200, json.dumps({"released": n}).encode(), "application/json")
            return
        if path == "/_bench/reset" and method == "POST":
            st.reset()
            self._send_simple(200, b"{}", "application/json")
            return
        if method != "POST":
            self._send_simple(404, b"not found")
            return
        st.dispatches += 1
        try:
            if "x-bench-bytes" in headers:
                data = st.response("bytes", min(int(headers["x-bench-bytes"]), MAX_BYTES))
            else:
                n = int(headers.get("x-bench-events", DEFAULT_EVENTS))
                data = st.response("events", min(max(n, 6), MAX_EVENTS))
        except ValueError as e:
            self._send_simple(400, str(e).encode())
            return
        if headers.get("x-bench-hold") == "1":
            if not st.held:
                st.held_since = time.monotonic()
            st.held.append((self.transport, data, headers.get("x-bench-id"), headers.get("x-bench-op")))
            return
        self.transport.write(data)

    def connection_lost(self, exc) -> None:
        self.transport = None


async def serve(port: int) -> None:
    """Listen on HOST:``port``, print the listening line, serve until SIGTERM/SIGINT."""
    state = State()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Server(state), HOST, port, backlog=4096)
    port = server.sockets[0].getsockname()[1]

    async def hold_bound() -> None:
        """Release everything once the oldest held request waited HOLD_MAX_S (no hang)."""
        while True:  # ends with the process
            await asyncio.sleep(1)
            if state.held and time.monotonic() - state.held_since > HOLD_MAX_S:
                state.release()

    tasks = [asyncio.create_task(hold_bound())]
    try:
        await until_stopped(lambda: print(f"bench upstream listening at http://{HOST}:{port}",
                                          flush=True))
    finally:
        for t in tasks:
            t.cancel()
        server.close()


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="turnguard bench upstream (loopback only)")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    raise_nofile()
    asyncio.run(serve(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
