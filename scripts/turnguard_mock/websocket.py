"""A server-side WebSocket on a ``server.Connection`` after an upgrade request: the handshake
answer, then whole messages in and out, framed by wsproto (installed with mitmproxy).

    ws = await WebSocket.accept(conn, request)
    await ws.echo(max_messages=16)

It is where the mock's WebSocket transport (Codex's ``response.create`` frames) goes.
"""

from __future__ import annotations

import collections

from wsproto.connection import Connection as WsConnection
from wsproto.connection import ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Message, Ping, TextMessage
from wsproto.utilities import generate_accept_token

from .server import MAX_READS, READ_TIMEOUT_S, BadRequest, Connection, Request, response_head

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class WebSocket:
    """One accepted WebSocket. ``receive`` returns a whole message (``TextMessage`` or
    ``BytesMessage``) or the peer's ``CloseConnection`` (code 1006 when the TCP connection
    ended without one); pings are answered on the way."""

    def __init__(self, conn: Connection, ws: WsConnection):
        self.conn = conn
        self._ws = ws
        self._pending: collections.deque[Event] = collections.deque()

    @classmethod
    async def accept(cls, conn: Connection, req: Request) -> WebSocket:
        """Answer the upgrade request ``req`` with 101 and take over the connection (the bytes
        the client sent after the request are its first frames). BadRequest without a
        ``Sec-WebSocket-Key``."""
        key = req.header("sec-websocket-key")
        if not key:
            raise BadRequest("an upgrade to websocket without a sec-websocket-key")
        await conn.send(response_head(101, [
            ("upgrade", "websocket"), ("connection", "Upgrade"),
            ("sec-websocket-accept", generate_accept_token(key.encode()).decode()),
        ]))
        return cls(conn, WsConnection(ConnectionType.SERVER,
                                      trailing_data=conn.parser.take_buffered()))

    async def send(self, event: Event) -> None:
        """Send one event (a message, a close, a pong)."""
        await self.conn.send(self._ws.send(event))

    async def _next_event(self) -> Event:
        for _ in range(MAX_READS):  # bounded: each pass reads bytes or returns
            if not self._pending:
                self._pending.extend(self._ws.events())
            if self._pending:
                return self._pending.popleft()
            data = await self.conn.receive_bytes(READ_TIMEOUT_S)
            self._ws.receive_data(data or None)
        raise BadRequest("too many reads")

    async def receive(self) -> Message | CloseConnection:
        """The next whole message, or the close."""
        parts: list[bytes | str] = []
        size = 0
        for _ in range(MAX_READS):  # bounded: each pass takes one event
            event = await self._next_event()
            if isinstance(event, Ping):
                await self.send(event.response())
            elif isinstance(event, CloseConnection):
                return event
            elif isinstance(event, Message):
                parts.append(event.data)
                size += len(event.data)
                if size > MAX_MESSAGE_BYTES:
                    raise BadRequest("websocket message too large")
                if event.message_finished:
                    if isinstance(event, TextMessage):
                        return TextMessage(data="".join(parts))  # type: ignore[arg-type]
                    return BytesMessage(data=b"".join(parts))  # type: ignore[arg-type]
        raise BadRequest("too many frames")

    async def echo(self, max_messages: int) -> None:
        """Send each message back as it came, up to ``max_messages``; answer a close with a
        close and return."""
        for _ in range(max_messages):
            event = await self.receive()
            if isinstance(event, CloseConnection):
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    await self.send(event.response())
                return
            await self.send(event)
