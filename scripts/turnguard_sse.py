"""Server-sent events for the tests and tools: one writer and one reader.

This module is an oracle: the mock upstream writes its streams with ``frame``, the tests and the
reproduction toolkit read what reaches a client with ``SseReader`` / ``parse_sse``. It shares no
code with ``addon/turnguard_core/sse.py`` (the parser turnguard itself uses), so that a bug
there cannot hide behind the same bug here. Standard library only.

What the reader understands (what the Responses API and the mock send): events separated by a
blank line, ``\\n`` or ``\\r\\n`` line ends, ``event:`` and ``data:`` fields (several ``data:``
lines joined by ``\\n``), comments and other fields ignored. An event's type is its ``event:``
field, else the ``type`` of its JSON data; its data is the parsed JSON where the data is JSON,
else the text.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple


class SseEvent(NamedTuple):
    """One event: its type ("" when it has none) and its data (parsed JSON, else the text)."""

    type: str
    data: Any


def frame(event_type: str, data: Any, *, eol: bytes = b"\n", ensure_ascii: bool = True) -> bytes:
    """One event as bytes: ``event: <type>``, ``data: <compact JSON>``, a blank line, each line
    ended by ``eol``. ``ensure_ascii=False`` keeps non-ASCII text as UTF-8 (a multi-byte
    character that a split can cut) instead of ``\\u`` escapes."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=ensure_ascii)
    return b"event: " + event_type.encode() + eol + b"data: " + text.encode() + eol + eol


def _event_of(block: bytes) -> SseEvent | None:
    """The event of one block (its lines, blank line excluded), or None for a block with
    neither an ``event:`` nor a ``data:`` field."""
    etype, data_lines = "", []
    for line in block.decode("utf-8", "replace").split("\n"):
        if line.startswith("event:"):
            etype = line[6:].strip()
        elif line.startswith("data:"):
            data_lines.append(line[5:].removeprefix(" "))
    if not data_lines and not etype:
        return None
    text = "\n".join(data_lines)
    try:
        data: Any = json.loads(text)
    except ValueError:
        data = text
    if not etype and isinstance(data, dict):
        etype = str(data.get("type", ""))
    return SseEvent(etype, data)


class SseReader:
    """An incremental reader: ``feed`` bytes as they arrive, split anywhere, and get the events
    each completes; ``close`` at the end of the stream returns the last event if the stream
    ended without its blank line (``parse_sse`` leaves such an event out)."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[SseEvent]:
        """The events that ``data`` completes, in order."""
        *blocks, self._rest = (self._rest + data).replace(b"\r\n", b"\n").split(b"\n\n")
        return [ev for ev in map(_event_of, blocks) if ev is not None]

    def close(self) -> list[SseEvent]:
        """The event left incomplete at the end of the stream, if any (at most one)."""
        rest, self._rest = self._rest, b""
        ev = _event_of(rest)
        return [] if ev is None else [ev]


def parse_sse(body: bytes) -> list[SseEvent]:
    """The complete events of a whole SSE body (an incomplete last event is left out)."""
    return SseReader().feed(body)


def event_types(body: bytes) -> list[str]:
    """The types of a whole SSE body's complete events, in order."""
    return [ev.type for ev in parse_sse(body)]
