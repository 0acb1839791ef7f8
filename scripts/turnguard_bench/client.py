"""An asyncio HTTP/1.1 load client on raw sockets (``asyncio.Protocol``), cheap per request.

It keeps connections alive, parses responses incrementally (content-length, chunked, or
close-delimited), counts SSE events (blank-line-terminated blocks) without keeping bodies, and
time-stamps each request with ``time.monotonic()``: sent, first response byte, last byte.
Every load is bounded by a request count and a deadline; every await by a timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Callable

from turnguard_bench import HOST

CONNECT_TIMEOUT_S = 10.0
MAX_HEAD = 64 * 1024


@dataclass
class Result:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body_bytes: int = 0
    events: int = 0
    t_send: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    sha256: str | None = None
    error: str | None = None
    tag: object = None
    body: bytes | None = None  # only with keep_body

    @property
    def latency(self) -> float:
        return self.t_done - self.t_send

    @property
    def ttfb(self) -> float:
        return self.t_first - self.t_send


class ConnClosed(Exception):
    pass


class Conn(asyncio.Protocol):
    """One client connection; ``await conn.request(raw)`` sends a request and reads its response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future | None = None
        self._res: Result | None = None
        self._buf = bytearray()
        self._state = "idle"
        self._remaining = 0
        self._last = 0  # last body byte seen (for counting "\n\n" across reads)
        self._hash = None
        self._keep: bytearray | None = None
        self._close_delimited = False
        self.reusable = True

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            if self._state == "body" and self._close_delimited:
                self._finish()
            else:
                self._waiter.set_exception(ConnClosed(f"connection closed in state {self._state}"))

    def data_received(self, data: bytes) -> None:
        if self._res is None:
            return  # unsolicited bytes: ignore
        if not self._res.t_first:
            self._res.t_first = time.monotonic()
        self._buf += data
        try:
            self._parse()
        except Exception as e:  # a malformed response: fail this request, drop the connection
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(e)
            self.transport.close()

    # -- requests ----------------------------------------------------------------------------
    async def request(
        self, raw: bytes, timeout: float, *, hash_body: bool = False, keep_body: bool = False
    ) -> Result:
        if self.closed or self._waiter is not None:
            raise ConnClosed("connection not usable")
        res = Result()
        self._res = res
        self._state = "head"
        self._last = 0
        self._hash = hashlib.sha256() if hash_body else None
        self._keep = bytearray() if keep_body else None
        self._waiter = asyncio.get_running_loop().create_future()
        res.t_send = time.monotonic()
        self.transport.write(raw)
        try:
            await asyncio.wait_for(self._waiter, timeout)
        finally:
            self._waiter = None
            self._res = None
        return res

    def _body(self, data) -> None:
        if not data:
            return
        res = self._res
        res.body_bytes += len(data)
        n = data.count(b"\n\n")
        if self._last == 0x0A and data[0] == 0x0A:
            n += 1
        res.events += n
        self._last = data[-1]
        if self._hash is not None:
            self._hash.update(data)
        if self._keep is not None:
            self._keep += data

    def _finish(self) -> None:
        res = self._res
        res.t_done = time.monotonic()
        if self._hash is not None:
            res.sha256 = self._hash.hexdigest()
        if self._keep is not None:
            res.body = bytes(self._keep)
        self._state = "idle"
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(res)

    def _take_body(self, buf: bytearray) -> bool:
        """Consume the body bytes in ``buf``, up to what remains of the body (or chunk); True
        once that is all there."""
        take = min(len(buf), self._remaining)
        if take:
            self._body(bytes(buf[:take]))
            del buf[:take]
            self._remaining -= take
        return self._remaining == 0

    def _parse(self) -> None:
        buf = self._buf
        for _ in range(1_000_000):  # bounded: each pass consumes bytes or returns
            if self._state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise ValueError("response head too large")
                    return
                lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
                del buf[: end + 4]
                status = int(lines[0].split(" ", 2)[1])
                if status == 100:
                    continue
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers.setdefault(k.strip().lower(), v.strip())
                self._res.status = status
                self._res.headers = headers
                self.reusable = "close" not in headers.get("connection", "").lower()
                self._close_delimited = False
                if status in (204, 304):
                    self._finish()
                    return
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    self._state = "chunk_size"
                elif "content-length" in headers:
                    self._remaining = int(headers["content-length"])
                    self._state = "body"
                    if self._remaining == 0:
                        self._finish()
                        return
                else:
                    self._state = "body"
                    self._close_delimited = True
                    self.reusable = False
                    self._remaining = 1 << 62
            elif self._state == "body":
                if self._take_body(buf):
                    self._finish()
                return
            elif self._state == "chunk_size":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                del buf[: end + 2]
                if size == 0:
                    self._state = "trailers"
                else:
                    self._remaining = size
                    self._state = "chunk_data"
            elif self._state == "chunk_data":
                if not self._take_body(buf):
                    return
                self._state = "chunk_crlf"
            elif self._state == "chunk_crlf":
                if len(buf) < 2:
                    return
                del buf[:2]
                self._state = "chunk_size"
            elif self._state == "trailers":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish()
                    return
            else:
                return
        raise ValueError("response parser made no progress")

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()


async def connect(port: int) -> Conn:
    loop = asyncio.get_running_loop()
    _, conn = await asyncio.wait_for(
        loop.create_connection(Conn, HOST, port), CONNECT_TIMEOUT_S
    )
    return conn


def build_request(
    path: str, body: bytes, headers: dict[str, str] | None = None, host: str = "bench"
) -> bytes:
    """A POST request's bytes (content-length framing)."""
    lines = [f"POST {path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class Load:
    results: list[Result]
    wall_s: float
    errors: int
    stopped_by_deadline: bool


async def run_load(
    port: int,
    make_request: Callable[[int], bytes],
    n: int,
    concurrency: int,
    *,
    time_limit_s: float,
    request_timeout_s: float = 60.0,
    hash_body: bool = False,
) -> Load:
    """Send ``n`` requests (``make_request(i)``) over ``concurrency`` keep-alive connections,
    each connection one request at a time; stop early at ``time_limit_s``."""
    results: list[Result] = []
    counter = iter(range(n))
    deadline = time.monotonic() + time_limit_s
    errors = 0
    stopped = False

    async def worker() -> None:
        nonlocal errors, stopped
        conn: Conn | None = None
        try:
            for i in counter:  # bounded by n
                if time.monotonic() > deadline:
                    stopped = True
                    return
                raw = make_request(i)
                for attempt in range(2):  # one reconnect on a stale keep-alive connection
                    try:
                        if conn is None or conn.closed or not conn.reusable:
                            if conn is not None:
                                conn.close()
                            conn = await connect(port)
                        res = await conn.request(raw, request_timeout_s, hash_body=hash_body)
                        res.tag = i
                        results.append(res)
                        break
                    except (ConnClosed, OSError, TimeoutError) as e:
                        if conn is not None:
                            conn.close()
                        conn = None
                        if attempt == 1 or isinstance(e, TimeoutError):
                            errors += 1
                            results.append(Result(error=f"{type(e).__name__}: {e}", tag=i))
                            break
        finally:
            if conn is not None:
                conn.close()

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, n)))))
    return Load(results, time.monotonic() - t0, errors, stopped)


async def open_and_send(
    port: int, raws: list[tuple[object, bytes]], *, batch: int = 100, timeout_s: float = 60.0
) -> list[asyncio.Task]:
    """One new connection per request, opened ``batch`` at a time (the listen backlog is
    finite); each request is sent as soon as its connection is up. Returns one task per request
    whose result is a ``Result`` (with ``tag``) or an error ``Result``."""

    async def one(tag: object, raw: bytes, conn: Conn) -> Result:
        try:
            res = await conn.request(raw, timeout_s)
        except (ConnClosed, OSError, TimeoutError) as e:
            res = Result(error=f"{type(e).__name__}: {e}")
        finally:
            conn.close()
        res.tag = tag
        return res

    async def connect_or_error(tag):
        try:
            return await connect(port)
        except (OSError, TimeoutError) as e:
            return Result(error=f"connect: {type(e).__name__}: {e}", tag=tag)

    tasks: list[asyncio.Task] = []
    for start in range(0, len(raws), batch):
        part = raws[start : start + batch]
        conns = await asyncio.gather(*(connect_or_error(tag) for tag, _ in part))
        for (tag, raw), conn in zip(part, conns):
            if isinstance(conn, Result):
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(conn)
                tasks.append(fut)
            else:
                tasks.append(asyncio.create_task(one(tag, raw, conn)))
        await asyncio.sleep(0)
    return tasks


async def get_json(port: int, path: str, method: str = "GET", timeout: float = 10.0) -> object:
    """A small control request to the bench upstream (its own connection); its JSON answer."""
    conn = await connect(port)
    try:
        raw = f"{method} {path} HTTP/1.1\r\nhost: bench\r\ncontent-length: 0\r\n\r\n".encode()
        res = await conn.request(raw, timeout, keep_body=True)
        return json.loads(res.body or b"null")
    finally:
        conn.close()
