"""A minimal, fast HTTP/1.1 upstream for the benchmarks (loopback only, standard library).

    python -m turnguard_bench.upstream [--port 0]

prints ``bench upstream listening at http://127.0.0.1:PORT`` and serves until SIGTERM/SIGINT.
Unlike ``scripts/mock_upstream.py`` (which is built to misbehave on cue) it does as little as
possible per request: an ``asyncio.Protocol``, responses precomputed and cached, one
``transport.write`` per response, no logging. So the proxy, not the upstream, is what a
benchmark measures.

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
import signal
import sys
import time

from turnguard_bench import HOST

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024
HOLD_MAX_S = 180.0  # a held request is answered after this long even without a release
DEFAULT_EVENTS = 8
MAX_EVENTS = 100_000
MAX_BYTES = 64 * 1024 * 1024
DELTA_MAX = 4096


def sse_frame(event_type: str, data: dict) -> bytes:
    """One server-sent event: ``event: <type>\\ndata: <json>\\n\\n``."""
    return f"event: {event_type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def ok_events(rid: str, model: str, deltas: int, text: str) -> list[tuple[str, dict]]:
    """A successful streamed turn, shaped as scripts/mock_upstream.py's (and the Responses
    API's): created, in_progress, output_item.added, ``deltas`` x output_text.delta,
    output_item.done, completed."""
    item_id = "msg_" + rid.removeprefix("resp_")
    done_item = {
        "id": item_id, "type": "message", "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": text * deltas, "annotations": []}],
    }

    def resp(status: str, output: list) -> dict:
        return {"id": rid, "object": "response", "status": status, "model": model,
                "output": output}

    raw: list[tuple[str, dict]] = [
        ("response.created", {"response": resp("in_progress", [])}),
        ("response.in_progress", {"response": resp("in_progress", [])}),
        ("response.output_item.added", {"response": {"id": rid}, "output_index": 0,
                                        "item": {**done_item, "status": "in_progress",
                                                 "content": []}}),
    ]
    raw += [
        ("response.output_text.delta", {"response": {"id": rid}, "item_id": item_id,
                                        "output_index": 0, "content_index": 0, "delta": text})
    ] * deltas
    raw.append(("response.output_item.done", {"response": {"id": rid}, "output_index": 0,
                                              "item": done_item}))
    raw.append(("response.completed", {"response": resp("completed", [done_item])}))
    return [(t, {"type": t, "sequence_number": i, **d}) for i, (t, d) in enumerate(raw)]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"x-request-id: req_bench\r\ntransfer-encoding: chunked\r\n\r\n"
)


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
            r = _HEAD + b"".join(_chunk(f) for f in frames) + b"0\r\n\r\n"
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
    def __init__(self, state: State) -> None:
        self.state = state
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        for _ in range(1000):  # bounded: pipelined requests in one read
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self.transport.close()
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            method, target = lines[0].split(" ", 2)[:2]
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
            if headers.get("transfer-encoding") or length > MAX_BODY:
                self._send_simple(400, b"bench upstream: chunked or huge request bodies unsupported")
                self.transport.close()
                return
            if len(self.buf) < end + 4 + length:
                return
            del self.buf[: end + 4 + length]
            self._route(method, target, headers)

    def _send_simple(self, status: int, body: bytes, ctype: bytes = b"text/plain") -> None:
        self.transport.write(
            b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, ctype, len(body), body)
        )

    def _route(self, method: str, target: str, headers: dict[str, str]) -> None:
        st = self.state
        path = target.split("?", 1)[0]
        if path == "/_bench/stats":
            self._send_simple(200, json.dumps(st.stats()).encode(), b"application/json")
            return
        if path == "/_bench/release" and method == "POST":
            n = st.release()
            self._send_simple(200, json.dumps({"released": n}).encode(), b"application/json")
            return
        if path == "/_bench/reset" and method == "POST":
            st.reset()
            self._send_simple(200, b"{}", b"application/json")
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
    state = State()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await loop.create_server(lambda: Server(state), HOST, port, backlog=4096)
    print(f"bench upstream listening at http://{HOST}:{server.sockets[0].getsockname()[1]}",
          flush=True)

    async def hold_bound() -> None:
        """Release everything once the oldest held request waited HOLD_MAX_S (no hang)."""
        while True:  # ends with the process
            await asyncio.sleep(1)
            if state.held and time.monotonic() - state.held_since > HOLD_MAX_S:
                state.release()

    tasks = [asyncio.create_task(hold_bound())]
    try:
        await stop.wait()
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
