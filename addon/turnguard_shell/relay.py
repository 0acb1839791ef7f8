"""The relay: a loopback HTTP/1.1 server inside the addon that streams a live response.

mitmproxy cannot stream a body an addon makes (MITMPROXY-NOTES: "An addon cannot stream a
synthetic body through the public API"). So a flow that attaches to an attempt in flight is
routed here instead of upstream (``route``): its destination becomes this server, with a
one-time token in the ``x-turnguard-attach`` header, and mitmproxy streams what the relay
sends to the flow's client (its ``responseheaders`` sets ``stream``; ``restore`` puts the
flow's destination back for mitmweb and saved flows). The relay answers with the
``LiveResponse``'s head, every piece so far, then each piece as it comes:

- complete: the chunked body ends normally;
- failed after the head: the connection is cut without the last chunk, so mitmproxy cuts the
  flow's client as the attempt's own client was cut (the same failure);
- failed before any head: a 502 JSON answer saying so.

The body is chunked, except to a request mitmproxy sends as HTTP/1.0 (its client spoke
HTTP/1.0, which knows no chunked coding): that body ends where the connection does, so its
client gets the bytes as they are, and a cut ends it as a close would (as HTTP/1.0 can only).

Only mitmproxy, on loopback, ever connects here; a request without a known token gets 404.
The request's body is read and dropped, whatever its framing (a Content-Length, chunked, or
none: an HTTP/2 request without a length comes as HTTP/1.1 without one); a relay connection
whose peer goes away detaches its listener at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Callable

from mitmproxy import http

from turnguard_core import answers
from turnguard_core.live import End, Head, Listener, LiveResponse
from turnguard_core.tee import recordable_headers

logger = logging.getLogger("turnguard")

TOKEN_HEADER = "x-turnguard-attach"
MAX_HEAD_BYTES = 256 * 1024  # mitmproxy sends the flow's request: its headers
MAX_REQUEST_BODY = 64 * 1024 * 1024  # the guarded request's body comes along; it is dropped
ROUTE_TTL_S = 60.0  # a route mitmproxy did not follow by then is forgotten (unless its flow
# still waits to be sent: intercepted in mitmweb or the console, its client there)
PEER_CLOSE_S = 5.0  # how long an answered HTTP/2 flow's connection waits for mitmproxy to close it
_REASONS = {200: "OK", 201: "Created", 202: "Accepted", 502: "Bad Gateway", 404: "Not Found"}


@dataclass
class Route:
    live: LiveResponse
    on_end: Callable[[End | None, int], None]  # (the end the flow saw, or None: left; bytes)
    handle: asyncio.TimerHandle | None = None
    flow: http.HTTPFlow | None = None  # the flow routed here, until it comes
    # mitmproxy closes the connection itself once the response is done (the flow's client
    # speaks HTTP/2 or 3: mitmproxy sends such a flow on an HTTP/1 connection of its own)
    peer_closes: bool = False
    # the client of the call itself (a detached call's), not a duplicate's: it gets every
    # header the upstream sent, as it would without the relay (cookies, echoed credentials)
    own: bool = False


class Relay:
    def __init__(self) -> None:
        self._server: asyncio.base_events.Server | None = None
        self._starting: asyncio.Future | None = None
        self.port: int | None = None
        self._routes: dict[str, Route] = {}
        self._connections: set[asyncio.Task] = set()

    async def ensure_started(self) -> int:
        """Listen on a free loopback port (once); returns it. A start that failed raises to
        the calls that waited for it, and the next call starts it again."""
        if self.port is not None:
            return self.port
        if self._starting is None:
            self._starting = asyncio.ensure_future(
                asyncio.start_server(self._serve, "127.0.0.1", 0, limit=MAX_HEAD_BYTES))
        starting = self._starting
        try:
            server = await asyncio.shield(starting)
            if not server.sockets:  # (Python 3.12 skips a socket it cannot make: no error)
                server.close()
                raise OSError("the relay could not listen on 127.0.0.1")
        except OSError:
            if self._starting is starting:  # the next call tries again (out of descriptors...)
                self._starting = None
            raise
        if self._server is None:
            self._server = server
            self.port = server.sockets[0].getsockname()[1]
            logger.debug("turnguard: relay for attached flows on 127.0.0.1:%d", self.port)
        return self.port

    def route(self, flow: http.HTTPFlow, live: LiveResponse,
              on_end: Callable[[End | None, int], None], *, own: bool = False) -> None:
        """Send ``flow`` here instead of upstream, to be answered from ``live`` (the relay must
        be started). ``on_end`` is called once the flow's answer ended (or its client left).
        ``own``: ``flow`` is the client of the call itself (``Route.own``)."""
        assert self.port is not None, "route() before ensure_started()"
        token = secrets.token_urlsafe(18)
        route = Route(live, on_end, flow=flow,
                      peer_closes=flow.request.http_version not in ("HTTP/1.0", "HTTP/1.1"),
                      own=own)
        self._routes[token] = route
        self._arm_expiry(token, route)
        req = flow.request
        meta = flow.metadata.setdefault("turnguard", {})
        # the Host header and the authority as they came: setting the host rewrites both
        meta["relayed_from"] = [req.scheme, req.host, req.port, req.headers.get("host"),
                                req.authority]
        req.scheme, req.host, req.port = "http", "127.0.0.1", self.port
        req.headers[TOKEN_HEADER] = token
        if req.trailers:  # an HTTP/2 request's trailers: mitmproxy's HTTP/1.1 client raises
            # on them, and the relay drops the body; kept as plain data (metadata is saved
            # with the flow: mitmweb, --save-stream-file)
            meta["relayed_trailers"] = [[k, v] for k, v in req.trailers.fields]
            req.trailers = None

    def _arm_expiry(self, token: str, route: Route) -> None:
        route.handle = asyncio.get_running_loop().call_later(
            ROUTE_TTL_S, lambda: self._expire(token))

    def _expire(self, token: str) -> None:
        """mitmproxy never followed the route (its client left first). A flow that still
        waits to be sent (a user keeps it intercepted: mitmweb's intercept comes after
        turnguard's request hook) keeps its route: forgotten, the relay would answer it
        404 once it is resumed, instead of the response it attached to."""
        route = self._routes.get(token)
        if route is None:
            return
        flow = route.flow
        if flow is not None and flow.live and flow.error is None and flow.response is None \
                and flow.client_conn.connected:
            self._arm_expiry(token, route)
            return
        del self._routes[token]
        _call_end(route, None, 0)

    def routed_to(self, live: LiveResponse) -> bool:
        """Whether a flow is on its way to the relay to attach to ``live``: routed, not
        connected yet (it is no listener of ``live`` until it connects)."""
        return any(route.live is live for route in self._routes.values())

    def abandon(self, flow: http.HTTPFlow) -> None:
        """``flow`` failed before mitmproxy followed its route (its client left within
        milliseconds, a kill): the route is dropped and ended as a client that left. Kept
        until it expired (``ROUTE_TTL_S``), the call it attached to counted a client for a
        minute more: a detached call ran that long past its window, uncounted by
        ``turnguard_detach_max``. (A route followed already is the relay connection's.)"""
        token = flow.request.headers.get(TOKEN_HEADER)
        route = self._routes.pop(token, None) if token else None
        if route is None:
            return
        if route.handle is not None:
            route.handle.cancel()
        _call_end(route, None, 0)

    @staticmethod
    def restore(flow: http.HTTPFlow) -> None:
        """Put a relayed flow's destination back (what mitmweb shows, what a saved flow says):
        its scheme, host and port, and its ``Host`` header and authority as they came (a
        virtual host's name, not the address connected to)."""
        meta = flow.metadata.get("turnguard") or {}
        origin = meta.pop("relayed_from", None)
        if origin is None:
            return
        req = flow.request
        req.scheme, req.host, req.port = origin[0], origin[1], int(origin[2])
        if len(origin) >= 5:
            host_header, authority = origin[3], origin[4]
            if host_header is not None:
                req.headers["host"] = host_header
            req.authority = authority or ""
        req.headers.pop(TOKEN_HEADER, None)
        trailers = meta.pop("relayed_trailers", None)
        if trailers is not None:
            req.trailers = http.Headers([(k, v) for k, v in trailers])

    def close(self) -> None:
        for route in self._routes.values():
            if route.handle is not None:
                route.handle.cancel()
        self._routes.clear()
        for task in list(self._connections):
            task.cancel()
        if self._server is not None:
            self._server.close()
            self._server = None
        self.port = None
        self._starting = None

    # -- the server --------------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            await self._answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                asyncio.CancelledError):
            pass
        except Exception:  # noqa: BLE001 - a relay fault cuts one flow, never the proxy
            logger.exception("turnguard: relay connection failed")
        finally:
            if task is not None:
                self._connections.discard(task)
            if not writer.transport.is_closing():  # not closed cleanly: cut
                writer.transport.abort()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")  # at most MAX_HEAD_BYTES (the limit)
        token, length, chunked = _token_and_length(head)
        http10 = head.split(b"\r\n", 1)[0].rstrip().upper().endswith(b"HTTP/1.0")
        if chunked:  # mitmproxy sends a chunked request's body chunked: read it to its end,
            await _skip_chunked(reader)  # or its bytes would read as the peer leaving
        elif 0 < length <= MAX_REQUEST_BODY:
            await reader.readexactly(length)
        route = self._routes.pop(token, None) if token else None
        if route is not None:
            route.flow = None
        if route is None:
            writer.write(_response_head(404, (("content-type", "text/plain"),), length=9)
                         + b"not found")
            await _flushed(writer)
            writer.close()
            return
        if route.handle is not None:
            route.handle.cancel()
        await self._stream(route, reader, writer, chunked_body=not http10)

    # An answer ends with the relay closing its connection, except for a flow whose client
    # speaks HTTP/2 (``Route.peer_closes``): the relay lets mitmproxy close that connection
    # first (at most PEER_CLOSE_S). mitmproxy 12 keeps the socket of a server connection open
    # for ever (CLOSE-WAIT, one descriptor each) when the server's close reaches it as it
    # closes that connection itself on another of the client connection's tasks (its HTTP/2
    # client's): its handler is cancelled before it closes the socket. Several HTTP/2 streams
    # attached at once left most of their relay connections so.

    async def _stream(self, route: Route, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter, *, chunked_body: bool = True) -> None:
        """Answer from ``route.live``: chunked (``chunked_body``), else delimited by the
        connection's close (an HTTP/1.0 request)."""
        queue: asyncio.Queue = asyncio.Queue()
        listener = Listener(
            on_head=lambda h: queue.put_nowait(("head", h)),
            on_piece=lambda p: queue.put_nowait(("piece", p)),
            on_end=lambda e, err: queue.put_nowait(("end", e, err)),
        )
        # mitmproxy sends nothing more on this connection but what is left of the request's
        # body (an HTTP/2 request without a Content-Length comes with no length at all): a
        # read that ends means it left
        peer_left = asyncio.ensure_future(_until_eof(reader))
        peer_left.add_done_callback(
            lambda t: (t.cancelled() or t.exception(), queue.put_nowait(("left",))))
        sent_head, sent, end = False, 0, None
        try:
            if not route.live.attach(listener):
                writer.write(_failed(503, "the response grew too large to attach to"))
                await _flushed(writer)
                writer.close()
                return
            while True:
                item = await queue.get()
                match item:
                    case ("head", h):
                        writer.write(_response_head(
                            h.status, _attached_headers(h, chunked_body, own=route.own)))
                        sent_head = True
                    case ("piece", piece):
                        data = piece if isinstance(piece, bytes) else piece.encode()
                        writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked_body
                                     else data)
                        sent += len(data)
                    case ("end", "complete", _):
                        end = "complete"
                        if not sent_head:
                            writer.write(_failed(502, "the attempt ended without a response"))
                        elif chunked_body:  # (else the close below ends the body)
                            writer.write(b"0\r\n\r\n")
                        await _flushed(writer)
                        await _after_peer(peer_left, route.peer_closes and chunked_body)
                        writer.close()
                        return
                    case ("end", _, error):
                        end = "failed"
                        if not sent_head:
                            writer.write(_failed(502, "the attempt attached to failed: "
                                                 f"{error or 'no response'}"))
                            await _flushed(writer)
                            await _after_peer(peer_left, route.peer_closes)
                            writer.close()
                            return
                        await _flushed(writer)  # every byte the attempt's client got, then
                        return  # the cut (the connection is aborted), as that client's
                    case ("left",):
                        return
                await writer.drain()
        finally:
            peer_left.cancel()
            route.live.detach(listener)
            _call_end(route, end, sent)


def _call_end(route: Route, end: End | None, sent: int) -> None:
    try:
        route.on_end(end, sent)
    except Exception:  # noqa: BLE001
        logger.exception("turnguard: relay end callback failed")


async def _flushed(writer: asyncio.StreamWriter) -> None:
    """Wait until every byte written went to the socket (not merely below the high mark)."""
    writer.transport.set_write_buffer_limits(high=0)
    await writer.drain()


async def _after_peer(peer_left: asyncio.Future, wait: bool) -> None:
    """When ``wait``: until the peer closed (``peer_left`` done), at most PEER_CLOSE_S."""
    if wait and not peer_left.done():
        await asyncio.wait({peer_left}, timeout=PEER_CLOSE_S)


async def _until_eof(reader: asyncio.StreamReader) -> None:
    """Read (and drop) what the peer still sends, until it closes (or sends too much)."""
    total = 0
    while total <= MAX_REQUEST_BODY:
        data = await reader.read(64 * 1024)
        if not data:
            return
        total += len(data)


async def _skip_chunked(reader: asyncio.StreamReader) -> None:
    """Read (and drop) a chunked body, trailers included, at most ``MAX_REQUEST_BODY``."""
    total = 0
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return
        total += size
        if total > MAX_REQUEST_BODY:
            raise ConnectionError("relayed request body too large")
        await reader.readexactly(size + 2)


def _token_and_length(head: bytes) -> tuple[str | None, int, bool]:
    token, length, chunked = None, 0, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == TOKEN_HEADER.encode():
            token = value.strip().decode("ascii", "replace")
        elif name == b"content-length":
            try:
                length = int(value.strip())
            except ValueError:
                length = 0
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return token, length, chunked


# the relay's own framing and connection: never passed on from the upstream's head
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding",
                         "content-length", "upgrade", "te", "trailer"})


def _attached_headers(head: Head, chunked: bool = True, *,
                      own: bool = False) -> tuple[tuple[str, str], ...]:
    """The head's headers as an attached client gets them: a duplicate's as a replay repeats
    them (no cookie nor echoed credential of another client's call); the call's own client
    (``own``) every one but the hop-by-hop ones."""
    framing = (("transfer-encoding", "chunked"),) if chunked else ()
    headers = (tuple((k, v) for k, v in head.headers if k.lower() not in _HOP_BY_HOP) if own
               else recordable_headers(head.headers))
    return (*headers, ("x-turnguard", "attached"), *framing)


def _response_head(status: int, headers, *, length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if length is not None:
        lines.append(f"content-length: {length}")
    lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


def _failed(status: int, message: str) -> bytes:
    a = answers.error_answer(status, "turnguard_attach_failed", message)
    return _response_head(status, a.headers, length=len(a.body)) + a.body
