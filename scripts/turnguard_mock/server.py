"""An HTTP/1.1 server for upstreams that must misbehave exactly on cue.

Requests are parsed by h11 (the sans-I/O HTTP/1.1 library mitmproxy installs); responses are
written as raw bytes, so that a behaviour decides every byte and its timing: a status line and
headers (``response_head``), chunk framing (``chunk``, ``LAST_CHUNK``), a TCP RST
(``Connection.reset``), a FIN in the middle of a body (``Connection.close``), a stall that
notices the client leaving (``Connection.wait_gone``).

Pieces, from the bottom up:

``RequestParser``   sans-I/O: bytes in, whole requests out (bounded); also used by the
                    benchmark's upstream on an ``asyncio.Protocol``
``Connection``      one client connection on asyncio streams: read requests, write bytes,
                    RST / FIN / stall
``Server``          listens on loopback and serves each connection's requests, in a bounded
                    keep-alive loop, with a ``respond(connection, request)`` coroutine
``ServerThread``    a ``Server`` on an event loop of its own in a thread (for a test process)
``until_stopped``   waits for SIGTERM or SIGINT (the servers that run as their own process)

Every read, wait and loop here is bounded by one of the constants below.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import h11

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 200
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_READS = 1_000_000  # reads of one request, events of one parse: bounds every loop below
MAX_EMPTY_LINES = 16  # stray CRLFs tolerated before a request
MAX_REQUESTS_PER_CONNECTION = 10_000
IDLE_TIMEOUT_S = 300.0  # keep-alive connection waiting for its next request
READ_TIMEOUT_S = 60.0  # reading one request's head and body; writing one piece of a response
WATCH_BUFFER_LIMIT = 1024 * 1024  # stop reading pipelined bytes while watching for EOF
DRAIN_TIMEOUT_S = 5.0  # waiting for the kernel to take our bytes before an RST
SHUTDOWN_TIMEOUT_S = 5.0  # connections still being served when the server closes

REASONS = {
    100: "Continue",
    101: "Switching Protocols",
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

LAST_CHUNK = b"0\r\n\r\n"


class BadRequest(Exception):
    """The client sent something that is not an HTTP/1.1 request within the bounds."""


class ClientGone(Exception):
    """The client disconnected while its response was still being written or prepared."""


class Request:
    """A whole HTTP/1.x request. ``headers`` keep their order and the case they were sent in;
    ``path`` and ``query`` split the target (``query`` is None without a ``?``)."""

    def __init__(self, method: str, target: str, version: str, headers: list[tuple[str, str]],
                 body: bytes):
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


class RequestParser:
    """Sans-I/O request reading: ``feed`` bytes (``feed(b"")`` at EOF), then ``next_request``
    returns the next whole request, or None while more bytes are needed (or, with ``at_eof``,
    when the client closed between requests). A request that is not HTTP/1.x, or is past the
    bounds, raises ``BadRequest``. Bytes after a request (pipelined, or a WebSocket's frames
    after an upgrade) stay buffered for the next call (``take_buffered``)."""

    def __init__(self, *, max_head_bytes: int = MAX_HEAD_BYTES,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = max_body_bytes
        self.at_eof = False
        self._eof_given = False
        self._buffer = bytearray()  # bytes not yet given to h11
        self._h11: h11.Connection | None = None  # one per request: we write responses raw
        self._head: h11.Request | None = None
        self._body = bytearray()
        self._continue_due = False

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed."""
        return len(self._buffer)

    def feed(self, data: bytes) -> None:
        """More bytes from the client; ``b""`` means it closed its side."""
        if data:
            self._buffer += data
        else:
            self.at_eof = True

    def take_buffered(self) -> bytes:
        """The bytes received after the last whole request (and forget them)."""
        out = bytes(self._buffer)
        self._buffer.clear()
        return out

    def started(self) -> bool:
        """Whether a request has begun: a byte of it arrived (stray CRLFs before a request are
        dropped, up to MAX_EMPTY_LINES; BadRequest past that)."""
        if self._h11 is not None:
            return True
        for _ in range(MAX_EMPTY_LINES):
            if self._buffer[:2] != b"\r\n":
                return bool(self._buffer)
            del self._buffer[:2]
        if self._buffer[:2] == b"\r\n":
            raise BadRequest("only empty lines")
        return bool(self._buffer)

    def take_continue(self) -> bool:
        """True once after the head of a request that waits for ``100 Continue``."""
        due, self._continue_due = self._continue_due, False
        return due

    def next_request(self) -> Request | None:
        """The next whole request, or None (more bytes needed, or the client closed between
        requests: see ``at_eof``)."""
        if self._h11 is None:
            if not self.started():
                return None
            self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head_bytes)
        if self._buffer:
            self._h11.receive_data(bytes(self._buffer))
            self._buffer.clear()
        if self.at_eof and not self._eof_given:
            self._eof_given = True
            self._h11.receive_data(b"")
        for _ in range(MAX_READS):  # bounded: each event consumes bytes given to h11
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as e:
                raise BadRequest(str(e) or "bad request") from None
            if event is h11.NEED_DATA:
                if self._eof_given:
                    raise BadRequest("incomplete request")
                return None
            if isinstance(event, h11.Request):
                self._take_head(event)
            elif isinstance(event, h11.Data):
                if len(self._body) + len(event.data) > self.max_body_bytes:
                    raise BadRequest("body too large")
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return self._finish_request()
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                raise BadRequest("incomplete request")
        raise BadRequest("too many parts")

    def _take_head(self, event: h11.Request) -> None:
        raw = event.headers.raw_items()
        if len(raw) > MAX_HEADERS:
            raise BadRequest("too many headers")
        for name, value in event.headers:  # h11 checked that a content-length is a number
            if name == b"content-length" and int(value) > self.max_body_bytes:
                raise BadRequest("body too large")
        self._head = event
        self._continue_due = self._h11.they_are_waiting_for_100_continue

    def _finish_request(self) -> Request:
        head, body = self._head, bytes(self._body)
        assert head is not None and self._h11 is not None
        trailing, _ = self._h11.trailing_data
        self._buffer[:0] = trailing
        self._h11, self._head, self._body = None, None, bytearray()
        self._eof_given = False
        return Request(
            head.method.decode("latin-1"),
            head.target.decode("latin-1"),
            "HTTP/" + head.http_version.decode("latin-1"),
            [(k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers.raw_items()],
            body,
        )


def response_head(status: int, headers: list[tuple[str, str]]) -> bytes:
    """A status line and header section, as given (no header added)."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def json_error(message: str, code: str, etype: str = "invalid_request_error") -> dict[str, Any]:
    """An error body shaped like the OpenAI API's."""
    return {"error": {"message": message, "type": etype, "code": code}}


class Connection:
    """One client connection: requests read through a ``RequestParser`` (so that watching for
    EOF while a behaviour sleeps never loses pipelined bytes), responses written as bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cid: int):
        self.reader = reader
        self.writer = writer
        self.cid = cid
        self.parser = RequestParser()
        self.eof = False

    async def _fill(self) -> bool:
        """Read more bytes into the parser; False at EOF (or a reset)."""
        if self.eof:
            return False
        try:
            data = await self.reader.read(65536)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
        self.parser.feed(data)
        return not self.eof

    async def read_request(self, idle_timeout: float) -> Request | None:
        """Read one request; None if the client closed (or idled past ``idle_timeout``) before
        sending a byte of it. BadRequest for what is not a request, TimeoutError if the request
        takes longer than READ_TIMEOUT_S to arrive once begun."""
        try:
            started = await asyncio.wait_for(self._wait_first_byte(), idle_timeout)
        except TimeoutError:
            return None
        if not started:
            return None
        return await asyncio.wait_for(self._read_rest(), READ_TIMEOUT_S)

    async def _wait_first_byte(self) -> bool:
        for _ in range(MAX_EMPTY_LINES + 1):
            if self.parser.started():
                return True
            if not await self._fill():
                return False
        raise BadRequest("only empty lines")

    async def _read_rest(self) -> Request:
        for _ in range(MAX_READS):  # bounded: each pass parses, or reads more bytes
            req = self.parser.next_request()
            if req is not None:
                return req
            if self.parser.take_continue():
                self.writer.write(response_head(100, []))
            if self.eof:
                raise BadRequest("incomplete request")
            await self._fill()
        raise BadRequest("too many reads")

    async def receive_bytes(self, timeout: float) -> bytes:
        """The bytes that arrive next, read past the HTTP parser (after an upgrade); b"" at EOF.
        TimeoutError after ``timeout`` seconds without a byte."""
        if self.eof:
            return b""
        try:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
        except (ConnectionError, OSError):
            data = b""
        self.eof = not data
        return data

    async def wait_gone(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as the client disconnects (EOF on the reader),
        False if the time passed with the client still connected."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, seconds)
        while not self.eof:  # bounded by the deadline and by WATCH_BUFFER_LIMIT
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            if self.parser.buffered > WATCH_BUFFER_LIMIT:
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

    async def send_whole(self, status: int, ctype: str, body: bytes, *, close: bool,
                         extra: tuple[tuple[str, str], ...] = ()) -> None:
        """A whole response with a content-length (and ``connection: close`` with ``close``)."""
        headers = [("content-type", ctype), ("content-length", str(len(body))), *extra]
        if close:
            headers.append(("connection", "close"))
        await self.send(response_head(status, headers) + body)

    async def send_json(self, status: int, obj: Any, *, close: bool,
                        extra: tuple[tuple[str, str], ...] = ()) -> None:
        """A whole JSON response."""
        await self.send_whole(status, "application/json", json.dumps(obj).encode(), close=close,
                              extra=extra)

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


Respond = Callable[[Connection, Request], Awaitable[bool]]


class Server:
    """Serves HTTP/1.1 on one address: each connection's requests, one after the other, are
    answered by ``respond(connection, request)``, which returns whether the connection may
    serve another request. A request that cannot be read gets 400 (408 when it is too slow)
    and its connection is closed; so is a connection idle for ``idle_timeout`` seconds."""

    def __init__(self, respond: Respond, *, idle_timeout: float = IDLE_TIMEOUT_S,
                 max_requests_per_connection: int = MAX_REQUESTS_PER_CONNECTION):
        self.respond = respond
        self.idle_timeout = idle_timeout
        self.max_requests = max_requests_per_connection
        self.tasks: set[asyncio.Task[Any]] = set()
        self.port = 0
        self._cids = 0
        self._listener: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, **kwargs: Any) -> None:
        """Listen on ``host``:``port`` (0: a port the OS picks, then in ``self.port``)."""
        self._listener = await asyncio.start_server(self._serve, host, port, reuse_address=True,
                                                    **kwargs)
        self.port = self._listener.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and end the connections still served (bounded)."""
        if self._listener is not None:
            self._listener.close()
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_TIMEOUT_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        conn = Connection(reader, writer, self._cids)
        self._cids += 1
        try:
            for _ in range(self.max_requests):
                try:
                    req = await conn.read_request(self.idle_timeout)
                except (BadRequest, TimeoutError) as e:
                    status, msg = ((400, str(e)) if isinstance(e, BadRequest)
                                   else (408, "request read timed out"))
                    with contextlib.suppress(ClientGone):
                        await conn.send_json(status, json_error(msg, "bad_request"), close=True)
                    break
                if req is None:
                    break
                if not await self.respond(conn, req) or not req.keep_alive:
                    break
        except ClientGone:
            pass
        finally:
            if task is not None:
                self.tasks.discard(task)
            if not writer.transport.is_closing():
                await conn.close()


class ServerThread:
    """A ``Server`` on 127.0.0.1 (port chosen by the OS) with an event loop of its own in a
    daemon thread: an upstream a test process controls byte by byte. ``respond`` runs on that
    loop; ``stop`` ends it (bounded)."""

    def __init__(self, respond: Respond, *, name: str = "server-thread",
                 start_timeout: float = 10.0):
        self.server = Server(respond)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout) or self._error is not None:
            raise RuntimeError(f"{name} did not start: {self._error!r}")
        self.port = self.server.port
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start("127.0.0.1", 0))
        except BaseException as e:  # noqa: BLE001 - reported by __init__
            self._error = e
            self.loop.close()
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the server and its connections, then the loop and the thread (bounded)."""
        if self.loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.loop.close()


async def until_stopped(ready: Callable[[], None] | None = None) -> None:
    """Return when SIGTERM or SIGINT arrives. Both are ignored from then on: a second signal
    during shutdown (a process group and a trap both sending one) must not reach the closing
    loop's wakeup fd. ``ready`` (the listening line) runs once the handlers are in place: a
    signal sent as soon as the line is seen then stops the server cleanly (exit status 0),
    never by the default action."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    sigs = (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready()
    try:
        await stop.wait()
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
