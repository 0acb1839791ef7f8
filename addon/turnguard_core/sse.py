"""Incremental Server-Sent Events parser (WHATWG HTML, "event stream interpretation").

Contract
--------
Pure: no mitmproxy, clock, disk or network. ``SseParser.feed(chunk)`` takes the stream's bytes in
any chunking and returns the events that chunk completed; every chunking of the same byte stream
gives the same events (also when a split falls inside a CRLF pair or a multi-byte UTF-8 character).

* Lines end with CRLF, LF or a lone CR. Each complete line is decoded as UTF-8 with
  ``errors="replace"``. One UTF-8 BOM at the very start of the stream is dropped.
* ``:comment`` lines are ignored. ``name:value`` loses one space after the colon; a line without
  a colon is a field name with an empty value. Fields: ``event``, ``data`` (lines joined with
  "\\n"), ``id`` (ignored if it contains NUL; as in the spec it persists across events, so
  ``SseEvent.id`` is the last event id seen so far), ``retry`` and unknown names are ignored.
* A blank line dispatches the pending event if it has data lines OR an ``event:`` field (the
  latter is a deliberate deviation: an ``event:``-only block counts as an event), then resets it.
* ``close()`` ends the stream: a final unterminated line is processed, but an event not ended by a
  blank line is never dispatched (spec), so ``close()`` returns ``[]``.
* Memory is bounded: a line or an event's data longer than ``max_event_bytes`` is dropped; the
  event still dispatches (``truncated=True``, ``data=""``, its ``event:`` field kept) and is
  counted, and ``overflowed`` becomes True. The parser never holds more than about
  ``2 * max_event_bytes`` (one partial line plus one event's data); see ``buffered_bytes``.
"""

from __future__ import annotations

import json
from typing import Literal

from .records import record

__all__ = [
    "TERMINAL_FAILURE",
    "TERMINAL_SUCCESS",
    "SseEvent",
    "SseKinds",
    "SseParser",
    "event_kind",
    "terminal_kind",
]

TERMINAL_SUCCESS = frozenset({"response.completed", "response.incomplete"})
TERMINAL_FAILURE = frozenset({"response.failed", "error"})

# What the data of an event whose JSON "type" is terminal must contain, as bytes: the name
# itself, or a ``\\u`` escape (the only JSON escape that can spell a letter, ``.`` or ``_``;
# a JSON string cannot span a line, so the escape is never split between data lines).
_TERMINAL_HINTS = tuple(t.encode() for t in TERMINAL_SUCCESS | TERMINAL_FAILURE) + (b"\\u",
                                                                                    b"[DONE]")
# A Chat Completions stream has no typed events: ``data:`` lines of chunk objects, an error
# as an object with an ``error`` member, and ``data: [DONE]`` at its end. ``DONE`` is that end:
# a success unless a terminal event came before it (see ``after``).
DONE = "done"
# The kind of each terminal type, by its bytes (an ``event:`` value that is not valid UTF-8
# decodes to replacement characters, so it never equals a name: comparing bytes is the same).
_KIND_OF_NAME = {
    **{t.encode(): "success" for t in TERMINAL_SUCCESS},
    **{t.encode(): "failure" for t in TERMINAL_FAILURE},
}

_BOM = b"\xef\xbb\xbf"
_LF, _CR, _COLON = 0x0A, 0x0D, 0x3A
# Bytes of an overlong line that are kept: enough to recognise any field name we act on.
_NAME_PREFIX = 16


def _json_object(data: str) -> dict | None:
    """``data`` parsed as a JSON object, else None (not parsed unless it starts like one)."""
    if not data.lstrip(" \t\r\n").startswith("{"):
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _json_type(data: str) -> str | None:
    """The str ``"type"`` member of ``data`` parsed as a JSON object, else None."""
    obj = _json_object(data)
    t = obj.get("type") if obj is not None else None
    return t if isinstance(t, str) else None


@record
class SseEvent:
    """One dispatched event.

    ``truncated`` is True when part of the event exceeded the parser's ``max_event_bytes``; its
    data was then dropped (``data == ""``).
    """

    event: str | None  # value of the `event:` field, None if absent
    data: str  # data lines joined with "\n"
    id: str | None  # last event id seen on the stream (spec), None if never set
    truncated: bool = False

    @property
    def type(self) -> str | None:
        """``event`` if non-empty, else the str ``"type"`` member of ``data`` as a JSON object."""
        if self.event:
            return self.event
        return _json_type(self.data)


def event_kind(event: SseEvent) -> Literal["success", "failure", "done"] | None:
    """What ``event`` ends, if anything: its ``event:`` name's ``terminal_kind``; else, for a
    data-only event, ``DONE`` for ``[DONE]`` (the end of a Chat Completions stream), the
    ``terminal_kind`` of its JSON ``"type"``, or "failure" for a JSON object without a
    ``"type"`` whose ``"error"`` member is not null (a Chat Completions error)."""
    if event.event:
        return terminal_kind(event.event)
    return _text_kind(event.data)


def after(terminal: Literal["success", "failure"] | None,
          kind: Literal["success", "failure", "done"]) -> Literal["success", "failure"]:
    """The terminal kind of a stream so far (``terminal``) once an event of ``kind`` came:
    the first terminal event decides, as for a WebSocket call (a response ends once; what a
    gateway sends after it, an ``error`` or a ``[DONE]``, changes nothing), and ``[DONE]``
    that came first is a success."""
    if terminal is not None:
        return terminal
    return "success" if kind == DONE else kind  # type: ignore[return-value]


def _text_kind(data: str) -> Literal["success", "failure", "done"] | None:
    if data.strip() == "[DONE]":
        return DONE  # type: ignore[return-value]
    obj = _json_object(data)
    if obj is None:
        return None
    t = obj.get("type")
    if isinstance(t, str):
        return terminal_kind(t)
    return "failure" if obj.get("error") is not None else None


def terminal_kind(event_type: str | None) -> Literal["success", "failure"] | None:
    """"success" / "failure" for a terminal Responses API event type, None otherwise."""
    if event_type in TERMINAL_SUCCESS:
        return "success"
    if event_type in TERMINAL_FAILURE:
        return "failure"
    return None


class SseParser:
    """feed() bytes in any chunking; returns the events completed by that chunk."""

    __slots__ = (
        "max_event_bytes",
        "events_seen",
        "overflowed",
        "last_type",
        "_line",
        "_line_overlong",
        "_skip_lf",
        "_at_start",
        "_closed",
        "_event",
        "_data",
        "_data_bytes",
        "_truncated",
        "_last_id",
    )

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024):
        if max_event_bytes < 1:
            raise ValueError("max_event_bytes must be positive")
        self.max_event_bytes = max_event_bytes
        self.events_seen = 0  # events dispatched so far
        self.overflowed = False  # True once a line or an event exceeded max_event_bytes
        self.last_type: str | None = None  # type of the most recent event
        self._line = bytearray()  # the incomplete last line (only a prefix if overlong)
        self._line_overlong = False
        self._skip_lf = False  # the previous chunk ended with CR: a leading LF belongs to it
        self._at_start = True  # BOM not yet ruled out
        self._closed = False
        self._event: str | None = None
        self._data: list[str] = []
        self._data_bytes = 0
        self._truncated = False
        self._last_id: str | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for the incomplete line and the pending event's data."""
        return len(self._line) + self._data_bytes

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Consume ``chunk``; return the events it completed (possibly none)."""
        if self._closed:
            raise ValueError("SseParser.feed() after close()")
        if self._at_start and chunk:
            chunk = self._strip_bom(chunk)
        if not chunk:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == _LF:
                chunk = chunk[1:]
                if not chunk:
                    return []

        lines = chunk.splitlines()  # bytes.splitlines breaks on \r\n, \r and \n only
        last = chunk[-1]
        if last == _CR:
            self._skip_lf = True
            tail = b""
        elif last == _LF:
            tail = b""
        else:
            tail = lines.pop()

        events: list[SseEvent] = []
        if lines:
            first = lines[0]
            if self._line or self._line_overlong:
                # Complete the line carried over from earlier chunks.
                self._append(first)
                overlong = self._line_overlong
                first = bytes(self._line)
                self._line.clear()
                self._line_overlong = False
                ev = self._process_line(first, overlong)
            else:
                ev = self._process_line_checked(first)
            if ev is not None:
                events.append(ev)
            for line in lines[1:]:
                ev = self._process_line_checked(line)
                if ev is not None:
                    events.append(ev)
        if tail:
            self._append(tail)
        return events

    def close(self) -> list[SseEvent]:
        """End of stream: process a final unterminated line; never dispatch (returns [])."""
        if not self._closed:
            self._closed = True
            if self._line or self._line_overlong:
                self._process_line(bytes(self._line), self._line_overlong)
            self._line.clear()
            self._line_overlong = False
            self._reset_event()
        return []

    # -- internals -------------------------------------------------------------------------

    def _strip_bom(self, chunk: bytes) -> bytes:
        """Drop a leading BOM, which may arrive split over several chunks."""
        head = bytes(self._line) + chunk  # _line holds at most 2 bytes of a possible BOM here
        if len(head) < len(_BOM) and _BOM.startswith(head):
            self._line[:] = head
            return b""
        self._line.clear()
        self._at_start = False
        return head[len(_BOM):] if head.startswith(_BOM) else head

    def _append(self, piece: bytes) -> None:
        """Add ``piece`` to the incomplete line, keeping only a name prefix once overlong."""
        if self._line_overlong:
            return
        if len(self._line) + len(piece) > self.max_event_bytes:
            self._line_overlong = True
            if len(self._line) < _NAME_PREFIX:
                self._line += piece[: _NAME_PREFIX - len(self._line)]
            del self._line[_NAME_PREFIX:]
        else:
            self._line += piece

    def _process_line_checked(self, line: bytes) -> SseEvent | None:
        if len(line) > self.max_event_bytes:
            return self._process_line(line[:_NAME_PREFIX], True)
        return self._process_line(line, False)

    def _process_line(self, line: bytes, overlong: bool) -> SseEvent | None:
        """Apply one complete line (without its ending); return an event if it dispatched one.

        ``overlong`` means ``line`` is only the prefix of a line longer than max_event_bytes.
        """
        if not line:
            return self._dispatch()
        if overlong:
            self.overflowed = True
        if line[0] == _COLON:
            return None
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            if overlong or self._truncated:
                self._drop_data()
                return None
            self._data_bytes += len(value) + 1
            if self._data_bytes > self.max_event_bytes:
                self._drop_data()
            else:
                self._data.append(self._data_line(value))
        elif name == b"event":
            if overlong:
                self._drop_data()
            else:
                self._event = value.decode("utf-8", "replace")
        elif name == b"id":
            if not overlong and b"\0" not in value:
                self._last_id = value.decode("utf-8", "replace")
        # retry and unknown fields are ignored
        return None

    @staticmethod
    def _data_line(value: bytes):
        """A data line's value as the pending event keeps it."""
        return value.decode("utf-8", "replace")

    def _drop_data(self) -> None:
        self._data.clear()
        self._data_bytes = 0
        self._truncated = True
        self.overflowed = True

    def _dispatch(self) -> SseEvent | None:
        if not self._data and not self._truncated:
            # no data line: no event (the standard's "data buffer is empty"), whatever its
            # name says; a name alone (`event: response.completed`) is no terminal event
            self._reset_event()
            return None
        ev = SseEvent(self._event, "\n".join(self._data), self._last_id, self._truncated)
        self._reset_event()
        self.events_seen += 1
        self.last_type = ev.type
        return ev

    def _reset_event(self) -> None:
        self._event = None
        self._data = []
        self._data_bytes = 0
        self._truncated = False


class SseKinds(SseParser):
    """The parser for a reader that needs only to count events and see the terminal ones
    (the response tee): ``feed(chunk)`` returns, for each event the chunk completed, its
    ``event_kind(event)`` or ``"other"`` when that is None: exactly the events
    ``SseParser`` would give, for every byte stream and every chunking, without making an
    ``SseEvent``, decoding data that cannot name a terminal type, or parsing its JSON.
    ``last_type`` is not kept (None)."""

    __slots__ = ("_clean",)

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024):
        super().__init__(max_event_bytes)
        # nothing pending (no partial line or event, no BOM to look for): what the fast
        # paths need; false at the start, so that the line parser sees (and strips) a BOM
        self._clean = False

    @staticmethod
    def _data_line(value: bytes):
        return value  # decoded only when the event's type is asked of its data

    def _dispatch(self):
        if not self._data and not self._truncated:
            self._reset_event()
            return None
        kind = None
        if self._event:
            kind = terminal_kind(self._event)
        else:
            kind = _data_kind(self._data)
        self._reset_event()
        self.events_seen += 1
        return kind or "other"

    def take(self, chunk: bytes) -> Literal["success", "failure", "done"] | None:
        """``feed`` for a reader that needs only the count (``events_seen``) and the
        first terminal kind among the events ``chunk`` completed (None: none was terminal;
        the first decides: see ``after``). One
        call for a chunk of one event led by its ``event:`` field (nearly every chunk of a
        Responses stream): its kind is its name's, whatever its data says."""
        if self._clean and chunk[-2:] == b"\n\n" and len(chunk) <= self.max_event_bytes:
            lines = chunk.splitlines()  # the line parser's split: CR, LF and CRLF
            if (len(lines) == 3 and lines[0][:7] == b"event: " and len(lines[0]) > 7
                    and (lines[1][:5] == b"data:" or lines[1] == b"data")):
                self.events_seen += 1
                return _KIND_OF_NAME.get(lines[0][7:])  # type: ignore[return-value]
        kind = None
        for k in self.feed(chunk):
            if k != "other" and kind is None:
                kind = k
        return kind  # type: ignore[return-value]

    def feed(self, chunk: bytes) -> list[Literal["success", "failure", "other"]]:  # type: ignore[override]
        """Consume ``chunk``; the terminal kind (or ``"other"``) of each event it completed.

        A chunk of whole events (what an upstream writes: one or more events, each ended by a
        blank line, nothing pending from earlier chunks) is read with few bytes operations;
        anything else goes through the line parser. Both give the same kinds: the fast paths
        take only chunks on which they provably agree (the tests check it in any chunking)."""
        if (self._clean and chunk[-2:] == b"\n\n" and len(chunk) <= self.max_event_bytes
                and chunk[0] != _LF and b"\r" not in chunk and b"\n\n\n" not in chunk):
            return self._blocks(chunk)  # no line can be over the limit: the chunk is not
        kinds = super().feed(chunk)
        self._clean = not (self._line or self._line_overlong or self._skip_lf or self._closed
                           or self._data or self._event is not None or self._truncated
                           or self._at_start)
        return kinds  # type: ignore[return-value]

    def close(self) -> list:
        self._clean = False
        return super().close()

    def _blocks(self, chunk: bytes) -> list[Literal["success", "failure", "other"]]:
        """The kinds of the events of a chunk of whole LF-ended events (no CR, no blank line
        but those ending events) with nothing pending before it (it leaves nothing pending
        either). Each block between blank lines is one event's lines; as in the line parser,
        the last ``event`` field and the ``data`` fields count (a field name is what precedes
        the first colon, one space after it is dropped), and a block without a ``data`` field
        dispatches nothing."""
        kinds: list[Literal["success", "failure", "other"]] = []
        for block in chunk[:-2].split(b"\n\n"):
            event: bytes | None = None
            data: list[bytes] | None = None
            for line in block.split(b"\n"):
                if line[:5] == b"data:" or line == b"data":
                    value = line[5:]
                    if value[:1] == b" ":
                        value = value[1:]
                    if data is None:
                        data = [value]
                    else:
                        data.append(value)
                elif line[:6] == b"event:" or line == b"event":
                    event = line[7:] if line[6:7] == b" " else line[6:]
            if data is None:
                continue
            self.events_seen += 1
            kind = _KIND_OF_NAME.get(event) if event else _data_kind(data or ())
            kinds.append(kind or "other")  # type: ignore[arg-type]
        return kinds


def _data_kind(data) -> Literal["success", "failure", "done"] | None:
    """``event_kind`` of a data-only event, from its data lines (bytes); they are decoded
    and the JSON parsed only when their bytes could name a terminal kind at all."""
    if not any(hint in line for line in data for hint in _TERMINAL_HINTS):
        return None
    return _text_kind("\n".join(line.decode("utf-8", "replace") for line in data))
