"""The Responses API over WebSocket, as Codex speaks it: pure (no mitmproxy, clock, disk or network).

A client sends each model call as one text frame, ``{"type": "response.create", ...}``: the
Responses request body plus ``type``. The upstream answers with the response's events, one JSON
object per text frame (``response.created`` ... ``response.completed``), on the same socket.
Follow-ups on that socket are *delta frames*: ``previous_response_id`` names the socket's last
response and ``input`` holds only the new items. A new socket (a retry after a fault, the
next process) and the HTTP POST fallback send the *full* input instead.

Contract
--------
* ``parse_client_frame(content, is_text)`` says what a client frame is: a ``Call`` (a
  ``response.create`` that asks for generation), a ``Prewarm`` (``generate: false``: it warms
  the socket and is never an operation) or ``NotACall`` with the reason (binary, not UTF-8, not
  a JSON object, duplicate keys, too deep or too large, more than ``MAX_FRAME_CONTAINERS``
  objects and arrays or ``MAX_FRAME_VALUES`` values, another ``type``). Never raises.
  ``NotACall.awaits_answer``: whether the upstream may still read the frame as a call (binary,
  not JSON, unreadable here: another parser may read a ``response.create`` in it), so that its
  answer is waited for as a call's; a JSON object of another ``type`` (a ``ping``, a ``pong``)
  is no call to any Responses upstream, which may answer it or not.
* ``SocketRecord`` is one client socket's memory: the responses it carried (their full input
  and their output items, the last ``MAX_REMEMBERED`` of them) and which of them the upstream
  socket knows (it produced them; a replayed one it never saw). ``full_request(body)`` rebuilds
  a delta frame into the full request (earlier input + earlier output + new items, without
  ``previous_response_id``) when the record knows the response it names; ``outbound`` is what
  to send upstream for a call: the frame as the client sent it when the upstream knows its
  ``previous_response_id`` (or it has none), else the rebuilt full request.
* ``ResponseEvents`` reads one response's events as they pass (``feed(text)``): counts them,
  tells output from bookkeeping, finds the terminal event, the response id and output items,
  and keeps a bounded copy as an SSE body (the form a recording has whatever its transport, so
  an HTTP client can be answered from a WebSocket attempt and the other way round).
* ``speaks_responses(text)`` tells an upstream frame that can be a Responses event (a JSON
  object with a str ``type`` other than the client's ``response.create``) from one that shows
  the socket speaks something else (an echo, another protocol): the shell then stops guarding
  that socket. ``upstream_event(text)`` says the same with the event it read, which
  ``feed(text, event)`` then takes without reading the frame again.
* ``first_frame(speaks, event, unanswered=...)`` says what an upstream frame that comes
  before a call's first event is: ``begins`` (the call's answer: a ``response.*`` event, or
  ``error``), ``passes`` (no answer of the call's: binary, not JSON, a JSON frame of another
  type such as a gateway's ``keepalive`` or a ``pong``; and an ``error`` when a client frame
  that is no call went upstream before the call with no answer yet: that frame's answer) or
  ``echo`` (a client frame's own type: the upstream speaks no Responses).
  ``unanswered_after(n, event)`` counts the client's frames that are no call still
  unanswered (an ``error`` answers one: ``answers_a_frame``); ``is_response_event`` tells a
  response's own events from other JSON frames inside it.
* ``frames_of_recording(body)`` turns a recorded SSE body back into event frames;
  ``error_frame`` is turnguard's own answer on this transport: an ``error`` event that always
  carries a numeric ``status`` (Codex ignores one without and hangs).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from .identity import (WS_FRAME_TYPE, Passthrough, canonical_json, parse_json_object,
                       socket_call_body)
from .records import record
from .sse import SseParser, terminal_kind

__all__ = [
    "Call",
    "MAX_FRAME_BYTES",
    "NotACall",
    "Prewarm",
    "ResponseEvents",
    "SocketRecord",
    "error_frame",
    "event_response_id",
    "answers_a_frame",
    "first_frame",
    "is_response_event",
    "unanswered_after",
    "frames_of_recording",
    "parse_client_frame",
    "speaks_responses",
    "upstream_event",
    "ws_status",
]

MAX_FRAME_BYTES = 64 * 1024 * 1024
# JSON objects and arrays a client frame may hold (counted as ``{`` and ``[`` bytes, strings
# too: an upper bound): each costs ~100 bytes once read, so a frame of 64 MiB of ``{},``
# (a few kB deflated) would take about 3 GB and half a minute. A Codex turn holds far fewer.
MAX_FRAME_CONTAINERS = 1_000_000
# JSON values a client frame may hold (counted as ``,`` bytes, strings too: an upper bound).
# One long array of numbers is read in one go, the interpreter held throughout (mitmproxy's
# event loop too, though it is read on a thread): 20 M of them (38 MB, 40 kB deflated) held it
# for ~3 s, and their canonical form took ~2.5 s more on the event loop. 4 M: a fraction of a
# second each; a Codex turn holds far fewer.
MAX_FRAME_VALUES = 4_000_000
MAX_REMEMBERED = 8  # responses a socket record keeps for delta frames
# Events that say a response exists but carry none of its output.
_BOOKKEEPING = frozenset({"response.created", "response.in_progress", "response.queued"})
RESPONSE_STARTS = _BOOKKEEPING  # the events a response begins with
SSE_HEADERS = (("content-type", "text/event-stream"),)


@record
class Call:
    """A ``response.create`` frame that asks for generation: a model call."""

    body: dict[str, Any]
    turn_id: str | None  # client_metadata.turn_id, when a non-empty str

    @property
    def previous_response_id(self) -> str | None:
        prev = self.body.get("previous_response_id")
        return prev if isinstance(prev, str) and prev else None


@record
class Prewarm:
    """A ``response.create`` with ``generate: false``: warms the socket, generates nothing."""

    body: dict[str, Any]


@record
class NotACall:
    reason: str
    awaits_answer: bool = True  # (see the module's contract)


def parse_client_frame(content: bytes, is_text: bool, *,
                       max_bytes: int = MAX_FRAME_BYTES) -> Call | Prewarm | NotACall:
    """What a client frame is (see the module's contract). Never raises."""
    if not is_text:
        return NotACall("binary frame")
    if len(content) > MAX_FRAME_CONTAINERS and \
            content.count(b"{") + content.count(b"[") > MAX_FRAME_CONTAINERS:
        return NotACall(f"frame holds more than {MAX_FRAME_CONTAINERS} JSON objects and arrays")
    if len(content) > MAX_FRAME_VALUES and content.count(b",") > MAX_FRAME_VALUES:
        return NotACall(f"frame holds more than {MAX_FRAME_VALUES} JSON values")
    parsed = parse_json_object(content, max_bytes)
    if isinstance(parsed, Passthrough):
        return NotACall(parsed.reason.replace("body", "frame"))
    kind = parsed.get("type")
    if kind != WS_FRAME_TYPE:
        return NotACall(f"frame type {str(kind)[:40]!r} is not {WS_FRAME_TYPE}",
                        awaits_answer=False)
    if parsed.get("generate") is False:
        return Prewarm(parsed)
    meta = parsed.get("client_metadata")
    turn_id = meta.get("turn_id") if isinstance(meta, dict) else None
    return Call(parsed, turn_id if isinstance(turn_id, str) and turn_id else None)


@record
class FullRequest:
    """A call as its operation: ``body`` is the full request (``rebuilt``: made from a delta
    frame and the socket's record). ``unresolved`` names a ``previous_response_id`` the record
    does not know (the body then keeps it, and stands for itself)."""

    body: dict[str, Any]
    rebuilt: bool
    unresolved: str | None = None

    def encoded(self) -> bytes:
        """The call as the HTTP POST it stands for (``identity.socket_call_body``: without
        its WebSocket-only fields, with ``"stream": true``), canonical JSON: what it is
        identified as, and what goes upstream when it is sent as a POST (detached)."""
        return canonical_json(socket_call_body(self.body))


def as_items(value: Any) -> list[Any] | None:
    """A request's ``input`` as a list of items: a string is one user message, as the API
    reads it (``{"role": "user", "content": ...}``); None for anything else."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return None


@dataclass(slots=True)
class _Remembered:
    input: list[Any]  # the full input of the request
    output: list[Any]  # its response's output items, in order


@dataclass
class SocketRecord:
    """One client socket's memory of the responses it carried (see the module's contract)."""

    _responses: OrderedDict[str, _Remembered] = field(default_factory=OrderedDict)
    _upstream_knows: set[str] = field(default_factory=set)

    def full_request(self, body: dict[str, Any]) -> FullRequest:
        prev = body.get("previous_response_id")
        if not (isinstance(prev, str) and prev):
            return FullRequest(body, rebuilt=False)
        known = self._responses.get(prev)
        delta = as_items(body.get("input", []))
        if known is None or delta is None:
            return FullRequest(body, rebuilt=False, unresolved=prev)
        full = {k: v for k, v in body.items() if k != "previous_response_id"}
        full["input"] = [*known.input, *known.output, *delta]
        return FullRequest(full, rebuilt=True)

    def upstream_knows(self, response_id: str | None) -> bool:
        return response_id is not None and response_id in self._upstream_knows

    def outbound(self, frame: dict[str, Any], full: FullRequest) -> dict[str, Any] | None:
        """What to send upstream for ``frame``: None to send it as the client did, else the
        full request to send instead (the upstream cannot know the response it names)."""
        prev = frame.get("previous_response_id")
        if not full.rebuilt or self.upstream_knows(prev if isinstance(prev, str) else None):
            return None
        return full.body

    def remember(self, request: dict[str, Any], events: "ResponseEvents", *,
                 from_upstream: bool) -> None:
        """``events`` answered ``request`` (a full request) on this socket: by the upstream
        (``from_upstream``), or by turnguard from a recording."""
        rid, items = events.response_id, as_items(request.get("input", []))
        if (rid is None or events.terminal != "success" or items is None
                or events.output_items is None):
            return
        self._responses[rid] = _Remembered(list(items), list(events.output_items))
        self._responses.move_to_end(rid)
        while len(self._responses) > MAX_REMEMBERED:
            old, _ = self._responses.popitem(last=False)
            self._upstream_knows.discard(old)
        if from_upstream:
            self._upstream_knows.add(rid)
        else:
            self._upstream_knows.discard(rid)


class ResponseEvents:
    """One response's events, read as they pass (see the module's contract). Never raises:
    a frame that is not a JSON event is passed over (``unreadable`` counts it), and the
    response is no longer kept (``over_cap``: one event past what is read is too large)."""

    def __init__(self, keep_max_bytes: int = 0, max_event_bytes: int = 8 * 1024 * 1024):
        self.events_seen = 0  # every event
        self.output_seen = 0  # events that carry output (not created / in_progress / error)
        self.unreadable = 0
        self.terminal: Literal["success", "failure"] | None = None
        self.terminal_type: str | None = None
        self.error_status: int | None = None  # the status of an ``error`` event, if any
        self.response_id: str | None = None
        self.output_items: list[Any] | None = []  # None: more than the socket record keeps
        self.over_cap = False
        self._keep_max = keep_max_bytes
        self._max_event = max_event_bytes
        self._kept: list[bytes] | None = [] if keep_max_bytes > 0 else None
        self._kept_bytes = 0
        self._items_bytes = 0

    @property
    def ended(self) -> bool:
        return self.terminal is not None

    @property
    def sse_body(self) -> bytes | None:
        """The events as an SSE body, when all were kept and the response succeeded."""
        if self._kept is None or self.terminal != "success":
            return None
        return b"".join(self._kept)

    def feed(self, text: str, event: dict[str, Any] | None = None) -> str | None:
        """Take one server frame's text; returns its event type (None: not an event).
        ``event``: the frame already read by ``upstream_event`` (it is not read again)."""
        if event is None or len(text) > self._max_event:
            event = _parse_event(text, self._max_event)
        if event is None:
            self.pass_over()
            return None
        kind = event["type"]
        self.events_seen += 1
        if kind not in _BOOKKEEPING and kind != "error":
            self.output_seen += 1
        self._learn(kind, event, len(text))
        self._keep(kind, text)
        return kind

    def pass_over(self) -> None:
        """A frame of the response that is no event (binary, not JSON, not a Responses
        event) went by: counted (``unreadable``), and the response is no longer kept (a
        recording without it would not be this response)."""
        self.unreadable += 1
        if self._kept is not None:
            self._kept, self.over_cap = None, True

    def _learn(self, kind: str, event: dict[str, Any], size: int) -> None:
        response = event.get("response")
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            self.response_id = response["id"]
        if kind == "response.output_item.done" and "item" in event:
            self._items_bytes += size
            if self.output_items is None or self._items_bytes > MAX_FRAME_BYTES:
                self.output_items = None
            else:
                self.output_items.append(event["item"])
        if kind == "error":
            status = event.get("status")
            if isinstance(status, int) and not isinstance(status, bool):
                self.error_status = status
        terminal = terminal_kind(kind)
        if terminal is not None and self.terminal is None:
            self.terminal, self.terminal_type = terminal, kind

    def _keep(self, kind: str, text: str) -> None:
        if self._kept is None:
            return
        # the event's name as an SSE "event:" field only when it is one printable line (a
        # type with a line break would write fields of its own; the data carries the type)
        name = b"event: " + kind.encode() + b"\n" if kind.isprintable() else b""
        chunk = name + b"data: " + _one_line(text) + b"\n\n"
        self._kept_bytes += len(chunk)
        if self._kept_bytes > self._keep_max:
            self._kept, self.over_cap = None, True
        else:
            self._kept.append(chunk)


def _one_line(text: str) -> bytes:
    """The event's JSON on one line (an SSE ``data:`` field ends at a line break)."""
    if "\n" not in text and "\r" not in text:
        return text.encode("utf-8", "surrogatepass")
    return json.dumps(json.loads(text), separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8", "surrogatepass")


def _parse_event(text: str, max_bytes: int) -> dict[str, Any] | None:
    if len(text) > max_bytes or not text.lstrip().startswith("{"):
        return None
    try:
        event = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        return None
    return event


def speaks_responses(text: str, max_bytes: int = 8 * 1024 * 1024) -> bool:
    """Whether an upstream text frame can be a Responses event (see the module's contract).
    A frame too large to read is given the benefit of the doubt."""
    return upstream_event(text, max_bytes)[0]


def upstream_event(text: str, max_bytes: int = 8 * 1024 * 1024
                   ) -> tuple[bool, dict[str, Any] | None]:
    """``speaks_responses(text)``, and the event read from the frame (None: too large to
    read here, or not an event), for ``ResponseEvents.feed``: each frame is read once."""
    if len(text) > max_bytes:
        return True, None
    event = _parse_event(text, max_bytes)
    return event is not None and event["type"] != WS_FRAME_TYPE, event


# The types of the frames a client sends: one of them from the upstream is an echo.
CLIENT_TYPES = frozenset({WS_FRAME_TYPE, "response.cancel"})
def answers_a_frame(event: dict[str, Any] | None) -> bool:
    """Whether an upstream frame is taken for the answer to a client frame that is no call
    (a ``ping``): an ``error`` (for a type the upstream does not know) is. A ``pong`` is not:
    an upstream may send one unasked (a heartbeat), or before an ``error`` for the same
    ``ping``; counted as an answer, it would leave that ``error`` to be taken for the call's,
    ending the attempt of a call that runs (its duplicates would run it again). A keepalive
    answers nothing."""
    return event is not None and event["type"] == "error"


def unanswered_after(unanswered: int, event: dict[str, Any] | None) -> int:
    """How many client frames that are no call stay unanswered once an upstream frame
    (``event``, as ``upstream_event`` read it) that begins no response came."""
    return unanswered - 1 if unanswered and answers_a_frame(event) else unanswered


def is_response_event(event: dict[str, Any]) -> bool:
    """Whether an upstream event belongs to a response (a ``response.*`` event, or its
    ``error``); another type inside one (a ``pong``, a gateway's ``keepalive``) is none of
    its events: passed on, never relayed, counted or recorded as the response's."""
    kind = event["type"]
    return kind == "error" or kind.startswith("response.")


def first_frame(speaks: bool, event: dict[str, Any] | None, *,
                unanswered: bool) -> Literal["begins", "passes", "echo"]:
    """What an upstream frame before a call's first event is (see the module's contract):
    ``speaks`` and ``event`` as ``upstream_event`` read it; ``unanswered``: client frames
    that are no call went upstream before the call and not all of them were answered (the
    upstream answers in order: such an answer comes before the call's, and an ``error`` then
    is taken for it, never for the call's: taken for the call's, it would end an attempt
    that runs, and its duplicates would run it again). A frame too large to read begins the
    call's answer (the benefit of the doubt, as ``speaks_responses`` gives it)."""
    if event is None:
        return "begins" if speaks else "passes"
    kind = event["type"]
    if kind in CLIENT_TYPES:
        return "echo"
    if kind == "error":
        return "passes" if unanswered else "begins"
    return "begins" if is_response_event(event) else "passes"


def event_response_id(event: dict[str, Any] | None) -> str | None:
    """The id of the response an event names (``response.created``, ``completed``... carry
    their response object), or None."""
    response = event.get("response") if event is not None else None
    rid = response.get("id") if isinstance(response, dict) else None
    return rid if isinstance(rid, str) else None


def frames_of_recording(body: bytes) -> list[str] | None:
    """The event frames of a recorded SSE body (each event's data, a JSON object with a
    ``type``), up to its first terminal event, or None when it is not such a stream (then it
    cannot be replayed over a WebSocket). What an upstream sent after the terminal event in
    an HTTP response (an ``error`` after ``response.completed``, the terminal event again)
    was inside that response; on a socket it would come after the response's end, where the
    client reads it as its next call's: it is left out."""
    parser = SseParser()
    events = parser.feed(body) + parser.close()
    frames = []
    for ev in events:
        if ev.data.strip() == "[DONE]":
            continue
        event = None if ev.truncated else _parse_event(ev.data, len(ev.data) + 1)
        if event is None:
            return None
        frames.append(ev.data)
        if terminal_kind(event["type"]) is not None:
            break
    return frames or None


class SseToFrames:
    """An SSE body, chunk by chunk, as event frames (``frames_of_recording`` for a stream that
    is still arriving): ``feed(chunk)`` returns the frames of the events it completed, in
    order, up to the first terminal event (``ended``: it came; what follows would, on a
    socket, be read as the next call's); events that are no JSON event (``[DONE]``, a
    comment, garbage) are left out."""

    def __init__(self) -> None:
        self._parser = SseParser()
        self.ended = False

    def feed(self, chunk: bytes) -> list[str]:
        return self._frames(self._parser.feed(chunk))

    def close(self) -> list[str]:
        return self._frames(self._parser.close())

    def _frames(self, events) -> list[str]:
        frames = []
        for ev in events:
            event = None if ev.truncated or self.ended else _parse_event(ev.data,
                                                                         len(ev.data) + 1)
            if event is not None:
                frames.append(ev.data)
                self.ended = terminal_kind(event["type"]) is not None
        return frames


def ws_status(status: int) -> int:
    """The status of turnguard's HTTP answer as an ``error`` event's ``status``. 409
    (``turn_in_progress``: retry later) becomes 503: Codex retries a 5xx on a new socket and
    may give up the turn on another 4xx."""
    return 503 if status == 409 else status


def error_frame(status: int, answer_body: bytes) -> str:
    """turnguard's answer (an OpenAI-shaped JSON error body) as an ``error`` event frame with a
    numeric ``status``."""
    try:
        error = json.loads(answer_body).get("error")
    except (ValueError, AttributeError):
        error = None
    if not isinstance(error, dict):
        error = {"type": "turnguard_error", "code": "turnguard_error",
                 "message": answer_body.decode("utf-8", "replace")[:500]}
    return json.dumps({"type": "error", "status": ws_status(status), "error": error},
                      separators=(",", ":"))
