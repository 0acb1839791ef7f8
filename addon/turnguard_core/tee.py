"""The tee between an upstream response and its client: counts events, keeps a bounded copy.

``ResponseTee`` is the callable the addon installs as ``flow.response.stream``: each chunk goes
to the client unchanged and immediately, while the tee feeds it to the SSE parser and keeps a
copy for the ledger's spool (up to ``keep_max_bytes``; past that the response is not replayable
and the copy is dropped so memory stays bounded). No proxy, clock or disk in here.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Literal

from .codec import content_codings, decode_content
from .identity import CREDENTIAL_HEADERS, credential_name
from .live import LiveResponse
from .sse import SseKinds, after

logger = logging.getLogger("turnguard")

# Not replayed: hop-by-hop and framing headers (the replay has its own framing), cookies, and
# the credential-bearing headers an upstream may echo (OpenAI-Organization, OpenAI-Project):
# no credential is kept at rest.
_NOT_RECORDED = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "transfer-encoding", "content-length",
        "upgrade", "te", "trailer", "set-cookie", "alt-svc", *CREDENTIAL_HEADERS,
    }
)


def recordable_headers(headers: Iterable[tuple[str, str]],
                       credential_headers: Iterable[str] = ()) -> tuple[tuple[str, str], ...]:
    """The response headers a replay repeats, in order (names read as the identity reads a
    credential header's: ``_`` as ``-``). ``credential_headers``: more credential-bearing
    names (``turnguard_credential_headers``), dropped too."""
    more = {credential_name(name) for name in credential_headers}
    return tuple([(k, v) for k, v in headers
                  if (n := credential_name(k)) not in _NOT_RECORDED and n not in more])


def coded_stream_events(
    body: bytes, content_encoding: str, max_bytes: int, *, whole: bool = True,
) -> tuple[int, Literal["success", "failure"] | None] | None:
    """The events of an event stream the upstream sent content-coded (the tee passes its
    bytes uncounted): ``(events, kind of the first terminal event or None)`` of ``body``
    decoded, or None when it cannot be read (an unknown or invalid coding, more codings than
    ``codec`` undoes, more than ``max_bytes`` decoded). ``whole`` False: ``body`` is what came
    of a stream whose transport broke (the coding's end may be missing). Such a stream
    completed only when its decoded events end with a terminal success, as an uncoded one;
    one that cannot be read is never taken for completed bytes to replay."""
    try:
        data = decode_content(body, content_codings(content_encoding), max_bytes,
                              prefix=not whole)
    except ValueError:
        return None
    parser = SseKinds(max_event_bytes=max(1, max_bytes))
    kind = parser.take(data) if data else None
    parser.close()
    return parser.events_seen, None if kind is None else after(None, kind)


# After the first event, kept chunks are read this many at a time: one loop over them costs
# less than a call between mitmproxy's own work for each, and the end of a stream (when the
# client waits for its last bytes) has at most this many left to read.
READ_BATCH = 64


class ResponseTee:
    """``tee(chunk) -> chunk``; ``tee(b"")`` marks the end of the body (mitmproxy's contract).

    Events are counted as they pass until the first one; after it, while the body is kept
    anyway, chunks are kept and read ``READ_BATCH`` at a time, or when ``events_seen`` or
    ``terminal`` is asked, at the end, or when the body grows past the cap and stops being
    kept: the same counts, since the parser gives the same events in any chunking, for less
    work per chunk while the stream flows.

    Never raises: a fault in counting or copying is logged and the chunk still passes."""

    def __init__(
        self,
        *,
        counts_events: bool,
        keep_max_bytes: int,
        on_first_event: Callable[[], None] | None = None,
        live: LiveResponse | None = None,
        on_first_chunk: Callable[[], None] | None = None,
    ):
        """``live``: the response duplicates attach to (live attach), fed each non-empty
        chunk as it passes; when it keeps what the tee keeps (same cap), one list serves both
        and it is called only while someone listens. ``on_first_chunk``: called once, at the
        body's first byte (a stream whose events are not counted: it has started)."""
        self._on_first_chunk = on_first_chunk
        self.counts_events = counts_events
        self._live = live
        self._parser = SseKinds() if counts_events else None
        self._keep_max = keep_max_bytes
        self._chunks: list[bytes] | None = [] if keep_max_bytes > 0 else None
        self._live_shares = False
        if live is not None and self._chunks is not None and live.max_bytes == keep_max_bytes:
            shared = live.kept_by_feeder()
            if shared is not None:
                self._chunks, self._live_shares = shared, True  # type: ignore[assignment]
        self._unread = -1  # index of the first kept chunk not read yet (-1: every chunk is read)
        self._on_first_event = on_first_event
        self.body_bytes = 0
        self._terminal: Literal["success", "failure"] | None = None
        self.ended = False
        self.over_cap = False

    @property
    def events_seen(self) -> int:
        if self._parser is None:
            return 0
        self._read_kept()
        return self._parser.events_seen

    @property
    def terminal(self) -> Literal["success", "failure"] | None:
        """The kind of the first terminal event (None: none yet): what follows it changes
        nothing; a Chat Completions ``[DONE]`` is a success (``sse.after``)."""
        self._read_kept()
        return self._terminal

    @property
    def body(self) -> bytes | None:
        """The whole body as the client got it, or None when it was not (entirely) kept. An
        event stream that delivered its terminal success event is whole even when the
        transport broke afterwards (before the end of the chunked body, say): its events are
        complete, and its operation completed upstream."""
        if self._chunks is None or not (self.ended or self.terminal == "success"):
            return None
        return b"".join(self._chunks)

    def kept_so_far(self) -> bytes | None:
        """The body kept so far, whether it ended or not (None: not kept)."""
        if self._chunks is None:
            return None
        return b"".join(self._chunks)

    def __call__(self, chunk: bytes) -> bytes:
        # one call per chunk of the stream: kept flat on purpose (each Python call costs)
        if not chunk:
            self._end()
            return chunk
        try:
            if self._on_first_chunk is not None:
                started, self._on_first_chunk = self._on_first_chunk, None
                started()
            self.body_bytes += len(chunk)
            chunks = self._chunks
            if chunks is not None and self.body_bytes > self._keep_max:
                self._drop_kept()  # every byte so far was kept: read what was not, then drop
                chunks = None
                self.over_cap = True
            if chunks is not None:
                chunks.append(chunk)
                if self._unread < 0:
                    if self._parser is not None:
                        self._read(chunk)
                        if self._parser.events_seen:  # from now on read in batches
                            self._unread = len(chunks)
                elif len(chunks) - self._unread >= READ_BATCH:
                    self._read_kept()
            elif self._parser is not None:
                self._read(chunk)
        except Exception:  # the client's bytes matter more than our bookkeeping
            logger.exception("turnguard: response tee failed; passing the body through")
            self._drop_kept()
        live = self._live
        if live is not None and (live.listening or not self._live_shares):
            try:
                live.fed(chunk) if self._live_shares else live.feed(chunk)
            except Exception:
                logger.exception("turnguard: live copy of a response failed")
                self._live = None
        return chunk

    def _read(self, data: bytes) -> None:
        """Count the events ``data`` completes (the next bytes of the body)."""
        parser = self._parser
        before = parser.events_seen
        kind = parser.take(data)
        if kind is not None:
            self._terminal = after(self._terminal, kind)
        if not before and parser.events_seen and self._on_first_event is not None:
            self._on_first_event()

    def _read_kept(self) -> None:
        """Read the kept chunks not read yet (one by one: a chunk of one event is the parser's
        fastest case)."""
        if self._unread < 0 or self._chunks is None:
            return
        unread, self._unread = self._chunks[self._unread:], len(self._chunks)
        take = self._parser.take
        for chunk in unread:
            kind = take(chunk)
            if kind is not None:
                self._terminal = after(self._terminal, kind)

    def _drop_kept(self) -> None:
        """Keep no more of the body (it is not replayable), reading what was not read yet."""
        try:
            self._read_kept()
        except Exception:
            logger.exception("turnguard: response tee could not count the kept events")
        self._chunks = None
        self._unread = -1
        if self._live_shares:
            self._live.stop_keeping()  # type: ignore[union-attr]

    def _end(self) -> None:
        try:
            self.ended = True
            if self._parser is not None:
                self._read_kept()
                self._parser.close()  # a stream's end never completes an event
        except Exception:
            logger.exception("turnguard: response tee failed at the end of the body")
