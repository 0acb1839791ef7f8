"""A small WebSocket client for the tests and the reproduction toolkit, speaking the Responses
API over WebSocket as Codex does (``response.create`` frames out, one JSON event per frame
back), on wsproto (installed with mitmproxy) and asyncio streams. Every wait is bounded.

    async with WsClient.connect(proxy.url, headers={"session-id": "s1"}) as c:
        await c.send({"type": "response.create", "model": "m", "input": [...]})
        events = await c.response()          # the events up to the terminal one
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from wsproto import WSConnection
from wsproto.connection import ConnectionType
from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Message, Ping,
                            RejectConnection, Request, TextMessage)

TIMEOUT_S = 15.0
TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")
CODEX_HEADERS = {"openai-beta": "responses_websockets=2026-02-06", "originator": "codex_exec"}


class UpgradeRejected(ConnectionError):
    """The server answered the upgrade with an HTTP status instead of 101."""

    def __init__(self, status: int):
        super().__init__(f"upgrade rejected with {status}")
        self.status = status


@dataclass(frozen=True)
class Closed:
    """The socket ended: the close code (1006: without a close frame)."""

    code: int


class WsClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 ws: WSConnection):
        self._reader, self._writer, self._ws = reader, writer, ws
        self._parts: list[str | bytes] = []
        self._ready: list[str | bytes | Closed] = []
        self.closed: Closed | None = None

    @classmethod
    def connect(cls, url: str, *, path: str = "/v1/responses",
                headers: dict[str, str] | None = None, ssl=None,
                server_hostname: str | None = None,
                proxy: str | None = None) -> "_Connecting":
        """``ssl``: an ``ssl.SSLContext`` to speak TLS (wss) with, ``server_hostname`` the
        name to send as SNI and check the certificate against (default: the URL's host).
        ``proxy``: an HTTP proxy's ``http://HOST:PORT``, through which the socket is tunnelled
        (``CONNECT`` to the URL's host and port, then TLS if ``ssl``)."""
        return _Connecting(url, path, {**CODEX_HEADERS, **(headers or {})}, ssl,
                           server_hostname, proxy)

    @classmethod
    async def open(cls, url: str, path: str, headers: dict[str, str], ssl=None,
                   server_hostname: str | None = None,
                   proxy: str | None = None) -> "WsClient":
        parts = urlsplit(url)
        name = server_hostname or parts.hostname
        if proxy is None:
            tls = {} if ssl is None else {"ssl": ssl, "server_hostname": name}
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port, **tls), TIMEOUT_S)
        else:
            p = urlsplit(proxy)
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(p.hostname, p.port), TIMEOUT_S)
            writer.write(f"CONNECT {parts.hostname}:{parts.port} HTTP/1.1\r\n"
                         f"Host: {parts.hostname}:{parts.port}\r\n\r\n".encode())
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
            if answer.split(b" ", 2)[1:2] != [b"200"]:
                writer.close()
                raise UpgradeRejected(int(answer.split(b" ", 2)[1]))
            if ssl is not None:
                await asyncio.wait_for(writer.start_tls(ssl, server_hostname=name), TIMEOUT_S)
        path = parts.path.rstrip("/") + path
        ws = WSConnection(ConnectionType.CLIENT)
        extra = [(k.encode(), v.encode()) for k, v in headers.items()]
        writer.write(ws.send(Request(host=parts.netloc, target=path, extra_headers=extra)))
        client = cls(reader, writer, ws)
        while True:
            event = await client._next_event()
            if isinstance(event, AcceptConnection):
                return client
            if isinstance(event, RejectConnection):
                writer.close()
                raise UpgradeRejected(event.status_code)

    async def _next_event(self, read_timeout: float | None = TIMEOUT_S):
        """The next wsproto event; each read waits up to ``read_timeout`` seconds (None: as
        long as the caller's own bound lets it), then raises ``TimeoutError``."""
        for _ in range(100_000):  # bounded: each pass reads or returns
            for event in self._ws.events():
                return event
            data = await asyncio.wait_for(self._reader.read(65536), read_timeout)
            self._ws.receive_data(data or None)
        raise RuntimeError("too many reads")

    async def send(self, message: dict[str, Any] | str | bytes) -> None:
        if isinstance(message, dict):
            message = json.dumps(message)
        event = TextMessage(message) if isinstance(message, str) else BytesMessage(message)
        self._writer.write(self._ws.send(event))
        await self._writer.drain()

    async def send_in_two(self, message: dict[str, Any] | str, first_bytes: int):
        """Send the first ``first_bytes`` of ``message``'s frame now; returns a coroutine
        function that sends the rest (a client whose message reaches the proxy in parts)."""
        text = json.dumps(message) if isinstance(message, dict) else message
        raw = self._ws.send(TextMessage(text))
        self._writer.write(raw[:first_bytes])
        await self._writer.drain()

        async def rest() -> None:
            self._writer.write(raw[first_bytes:])
            await self._writer.drain()

        return rest

    async def recv(self, timeout: float = TIMEOUT_S) -> str | bytes | Closed:
        """The next whole message, or ``Closed`` when the peer closed the socket (1006: the
        connection ended without a close frame). No message within ``timeout`` seconds:
        ``TimeoutError``, the socket left open (a silence is never reported as a close)."""
        return await asyncio.wait_for(self._recv(), timeout)

    async def _recv(self) -> str | bytes | Closed:
        if self.closed is not None:
            return self.closed
        while True:
            try:
                # no bound of its own: recv's is the caller's (TimeoutError is an OSError, and
                # a read bound here was once reported as the peer's 1006)
                event = await self._next_event(read_timeout=None)
            except (ConnectionError, OSError):
                event = CloseConnection(1006)
            if isinstance(event, Ping):
                self._writer.write(self._ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                self.closed = Closed(event.code)
                return self.closed
            elif isinstance(event, Message):
                self._parts.append(event.data)
                if event.message_finished:
                    parts, self._parts = self._parts, []
                    return "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)

    async def response(self, timeout: float = TIMEOUT_S) -> list[dict[str, Any]]:
        """The events of one response, up to its terminal event (or the socket's end, then the
        last item is a ``{"type": "closed", "code": ...}`` pseudo-event); ``TimeoutError`` when
        it has not ended within ``timeout`` seconds."""
        events: list[dict[str, Any]] = []
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            message = await self.recv(max(0.01, left))
            if isinstance(message, Closed):
                return [*events, {"type": "closed", "code": message.code}]
            event = json.loads(message)
            events.append(event)
            if event.get("type") in TERMINAL:
                return events

    def abort(self) -> None:
        """Drop the connection with a TCP reset (as a killed client does)."""
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._writer.close()

    async def aclose(self) -> None:
        try:
            self._writer.close()
            await asyncio.wait_for(self._writer.wait_closed(), 2)
        except (OSError, TimeoutError, ConnectionError):
            pass


class _Connecting:
    def __init__(self, url: str, path: str, headers: dict[str, str], ssl=None,
                 server_hostname: str | None = None, proxy: str | None = None):
        self._args = (url, path, headers, ssl, server_hostname, proxy)
        self._client: WsClient | None = None

    def __await__(self):
        return WsClient.open(*self._args).__await__()

    async def __aenter__(self) -> WsClient:
        self._client = await WsClient.open(*self._args)
        return self._client

    async def __aexit__(self, *exc) -> None:
        if self._client is not None:
            await self._client.aclose()


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e.get("type") for e in events]
