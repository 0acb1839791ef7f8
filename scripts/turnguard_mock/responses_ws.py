"""The Responses API over WebSocket, as the mock serves it (Codex's default transport).

``GET .../responses`` with ``Upgrade: websocket`` is accepted (101, no extension, no
subprotocol) and the socket then carries ``response.create`` text frames from the client and,
for each, the response's events back, one JSON event per text frame:

* ``"generate": false`` (Codex's prewarm): ``response.created`` and ``response.completed``
  with no output; logged as ``{"event": "prewarm"}``, never a dispatch.
* Any other ``response.create``: a *dispatch*, numbered, chosen and logged like a POST's (the
  frame is its body, the handshake's headers its headers; the record says ``"transport":
  "ws"`` and carries ``input_items`` and ``previous_response_id``), answered by its behaviour
  on this transport:

  ``ok``, ``tool_call``, ``slow``  the events as frames (same parameters as over HTTP);
      ``after_completed``: ``reset`` (RST) or ``clean_close`` (a close frame, 1000), or
      ``repeat_terminal`` (the terminal event again 300 ms later), or ``repeat_output`` (the
      item's ``output_item.done`` again 300 ms later, naming no response); ``response_id``: the id
      every response gets instead of a fresh one (ids need not be unique)
  ``stall_before_headers``, ``stall_after_headers``  nothing for ``ms``, then the TCP
      connection ends without a close frame
  ``reset``  TCP RST right after the frame
  ``clean_close``  a close frame (1011) right after the frame, no event
  ``status``  an ``error`` event with ``"status": code`` (``ws_status: false``: without it,
      which Codex ignores and then hangs)
  ``partial``  the first ``events`` events, then ``end``: ``reset``, ``clean_close`` (close
      frame 1011), ``stall`` or ``failed`` (a ``response.failed`` event)

  A ``previous_response_id`` that this socket did not produce is answered with an ``error``
  event, status 400, code ``previous_response_not_found`` (with ``store: false`` the API knows
  a response only on the socket that produced it); the dispatch is logged all the same.
* Anything else (binary, not JSON, another ``type``): an ``error`` event, status 400.

The socket closes when the client closes it, after an idle ``IDLE_TIMEOUT_S``, or when a
behaviour breaks it.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from wsproto.events import CloseConnection, TextMessage

from .behaviours import Dispatch
from .events import openai_error, response_object
from .server import READ_TIMEOUT_S, ClientGone, Connection, Request
from .websocket import WebSocket

if TYPE_CHECKING:
    from .upstream import MockUpstream

IDLE_TIMEOUT_S = 300.0
MAX_FRAMES = 10_000  # frames served on one socket


class WsDispatch(Dispatch):
    """A dispatch answered on a WebSocket: the same behaviours, with events as frames."""

    def __init__(self, ws: WebSocket, conn: Connection, req: Request, n: int,
                 b: dict[str, Any]):
        super().__init__(conn, req, n, b)
        self.ws = ws
        self.body = {**self.body, "stream": True}  # events are all this transport has
        self.completed_sent = False

    async def _sleep(self, seconds: float) -> None:
        await super()._sleep(seconds)
        self.ws.take(self.conn.parser.take_buffered())  # frames read while watching

    async def _sse_headers(self) -> None:
        self.status = 200  # the socket's 101 stands for it; nothing is sent

    async def _send_event(self, event) -> None:
        await self.ws.send(TextMessage(json.dumps(event[1], separators=(",", ":"), ensure_ascii=False)))
        self.events_sent += 1
        self.completed_sent = self.completed_sent or event[0] == "response.completed"

    async def _end_stream(self) -> None:
        pass  # the socket stays open for the next frame

    def _content_coding(self) -> str | None:
        return None  # frames carry no content coding

    async def _break(self, how: str) -> None:
        await self.conn.flush_kernel()
        if how == "reset":
            self.conn.reset()
            return
        code = 1000 if self.completed_sent else 1011
        try:
            await self.ws.send(CloseConnection(code=code, reason="mock upstream closed"))
        except ClientGone:
            pass
        await self.conn.close()

    async def _send_whole(self, status: int, ctype: str, body: bytes, *more, late=()) -> None:
        """An HTTP error answer as an ``error`` event."""
        self.status = status
        try:
            error = json.loads(body).get("error")
        except (ValueError, AttributeError):
            error = None
        event: dict[str, Any] = {"type": "error"}
        if self.b.get("ws_status") is not False:
            event["status"] = status
        event["error"] = error if isinstance(error, dict) else openai_error(status)["error"]
        await self.ws.send(TextMessage(json.dumps(event, separators=(",", ":"), ensure_ascii=False)))
        self.events_sent += 1

    async def _do_clean_close(self) -> None:
        self.outcome = "clean_close"
        await self._break("clean_close")

    async def _do_not_found(self) -> None:
        """The previous response is unknown on this socket (not a scenario kind)."""
        self.status = 400
        await self.ws.send(TextMessage(json.dumps({
            "type": "error", "status": 400,
            "error": {"type": "invalid_request_error", "code": "previous_response_not_found",
                      "message": "mock upstream: previous response not found on this socket"},
        })))
        self.outcome = "previous_response_not_found"
        self.reusable = True


async def serve_socket(mock: "MockUpstream", conn: Connection, req: Request) -> None:
    """Accept the upgrade ``req`` and serve the socket's frames until it ends."""
    ws = await WebSocket.accept(conn, req)
    mock.record({"event": "ws_open", "ts": time.time(), "conn": conn.cid, "path": req.path})
    produced: set[str] = set()  # response ids this socket completed
    idle_reads = 0
    for _ in range(MAX_FRAMES):
        try:
            message = await ws.receive()
        except TimeoutError:  # each read waits READ_TIMEOUT_S
            idle_reads += 1
            if idle_reads * READ_TIMEOUT_S >= IDLE_TIMEOUT_S:
                break
            continue
        except ClientGone:
            break
        idle_reads = 0
        if isinstance(message, CloseConnection):
            break
        if not await _answer(mock, ws, conn, req, message, produced):
            break
    mock.record({"event": "ws_close", "ts": time.time(), "conn": conn.cid})
    await conn.close()


async def _answer(mock: "MockUpstream", ws: WebSocket, conn: Connection, req: Request,
                  message, produced: set[str]) -> bool:
    """Answer one client frame; False when the socket is done."""
    body = _frame_body(message)
    if body is None:
        await ws.send(TextMessage(json.dumps({"type": "error", "status": 400,
                                              "error": openai_error(400)["error"]})))
        return True
    if body.get("generate") is False:
        rid = f"resp_pre_{secrets.token_hex(8)}"
        model = body.get("model") if isinstance(body.get("model"), str) else "mock-model"
        mock.record({"event": "prewarm", "ts": time.time(), "conn": conn.cid, "rid": rid})
        for i, (kind, status) in enumerate((("response.created", "in_progress"),
                                             ("response.completed", "completed"))):
            await ws.send(TextMessage(json.dumps({
                "type": kind, "sequence_number": i,
                "response": response_object(rid, model, status, [])})))
        produced.add(rid)
        return True
    prev = body.get("previous_response_id")
    items = body.get("input")
    frame_req = Request("POST", req.target, req.version, req.headers, message.data.encode())
    n, behaviour = mock.select(conn, frame_req, "ws", previous_response_id=prev,
                               input_items=len(items) if isinstance(items, list) else None)
    d = WsDispatch(ws, conn, frame_req, n, behaviour)
    if prev is not None and prev not in produced:
        d.b = {"kind": "not_found"}
    await mock.run(d)
    if d.outcome == "completed":
        produced.add(d.rid)
    return d.reusable


def _frame_body(message) -> dict[str, Any] | None:
    if not isinstance(message, TextMessage):
        return None
    try:
        body = json.loads(message.data)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's recursion limit
        return None
    if not isinstance(body, dict) or body.get("type") != "response.create":
        return None
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):  # the API answers such a frame 400
        return None
    return body
