"""The tee between an upstream response and its client: counts events, keeps a bounded copy.

``ResponseTee`` is the callable the addon installs as ``flow.response.stream``: each chunk goes
to the client unchanged and immediately, while the tee feeds it to the SSE parser and keeps a
copy for the ledger's spool (up to ``keep_max_bytes``; past that the response is not replayable
and the copy is dropped so memory stays bounded). No proxy, clock or disk in here.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Literal

from .sse import SseKinds

logger = logging.getLogger("turnguard")

# Not replayed: hop-by-hop and framing headers (the replay has its own framing), cookies.
_NOT_RECORDED = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "transfer-encoding", "content-length",
        "upgrade", "te", "trailer", "set-cookie", "alt-svc",
    }
)


def recordable_headers(headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The response headers a replay repeats, in order."""
    return tuple((k, v) for k, v in headers if k.lower() not in _NOT_RECORDED)


class ResponseTee:
    """``tee(chunk) -> chunk``; ``tee(b"")`` marks the end of the body (mitmproxy's contract).

    Never raises: a fault in counting or copying is logged and the chunk still passes."""

    def __init__(
        self,
        *,
        counts_events: bool,
        keep_max_bytes: int,
        on_first_event: Callable[[], None] | None = None,
        on_chunk: Callable[[bytes], None] | None = None,
    ):
        """``on_chunk``: given each non-empty chunk as it passes (live attach)."""
        self.counts_events = counts_events
        self._on_chunk = on_chunk
        self._parser = SseKinds() if counts_events else None
        self._keep_max = keep_max_bytes
        self._chunks: list[bytes] | None = [] if keep_max_bytes > 0 else None
        self._on_first_event = on_first_event
        self.body_bytes = 0
        self.terminal: Literal["success", "failure"] | None = None
        self.ended = False
        self.over_cap = False

    @property
    def events_seen(self) -> int:
        return self._parser.events_seen if self._parser else 0

    @property
    def body(self) -> bytes | None:
        """The whole body as the client got it, or None when it was not (entirely) kept. An
        event stream that delivered its terminal success event is whole even when the
        transport broke afterwards (before the end of the chunked body, say): its events are
        complete, and its operation completed upstream."""
        if self._chunks is None or not (self.ended or self.terminal == "success"):
            return None
        return b"".join(self._chunks)

    def __call__(self, chunk: bytes) -> bytes:
        # one call per chunk of the stream: kept flat on purpose (each Python call costs)
        if not chunk:
            self._end()
            return chunk
        try:
            self.body_bytes += len(chunk)
            if self._chunks is not None:
                if self.body_bytes > self._keep_max:  # every byte so far was kept: its size
                    self._chunks = None
                    self.over_cap = True
                else:
                    self._chunks.append(chunk)
            parser = self._parser
            if parser is not None:
                before = parser.events_seen
                kind = parser.take(chunk)
                if kind is not None:
                    self.terminal = kind
                if not before and parser.events_seen and self._on_first_event is not None:
                    self._on_first_event()
        except Exception:  # the client's bytes matter more than our bookkeeping
            logger.exception("turnguard: response tee failed; passing the body through")
            self._chunks = None
        if self._on_chunk is not None:
            try:
                self._on_chunk(chunk)
            except Exception:
                logger.exception("turnguard: live copy of a response failed")
                self._on_chunk = None
        return chunk

    def _end(self) -> None:
        try:
            self.ended = True
            if self._parser is not None:
                self._parser.close()  # a stream's end never completes an event
        except Exception:
            logger.exception("turnguard: response tee failed at the end of the body")
