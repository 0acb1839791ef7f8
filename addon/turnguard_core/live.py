"""An attempt's response as it arrives, for the duplicates that attach to it (live attach).

``LiveResponse`` is what this process has seen of one attempt's response so far: its head
(status and headers, HTTP) and every piece of its body (HTTP body chunks, or a WebSocket
call's event frames), in order, then its end: ``complete`` (the client of the attempt got
the whole response) or ``failed`` (cut mid-way, or no response at all). A duplicate that
attaches (``attach``) is given everything so far at once and then each piece as it comes, by
the callbacks of its ``Listener``: the same bytes, in the same order, as the attempt's own
client, and the same end.

Pieces are kept up to ``max_bytes``; past that no new duplicate can attach (``attachable`` is
False: it would miss the start) while those attached keep getting every piece. Pure: no
proxy, clock or event loop; listeners are plain callbacks (the shell's hand them to its
sockets and queues).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from .records import record

Transport = Literal["http", "ws"]
End = Literal["complete", "failed"]
Piece = bytes | str  # an HTTP body chunk, or a WebSocket event frame's text


@record
class Head:
    """The response's status line and headers (as the attempt's client got them)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    vary_key: str | None  # of the attempt's request (see ``negotiation.vary_key``)


@dataclass
class Listener:
    """One attached duplicate: ``on_head`` once (HTTP), ``on_piece`` for each piece in order,
    ``on_end`` once. Callbacks must not raise (a listener that does is dropped)."""

    on_head: Callable[[Head], None]
    on_piece: Callable[[Piece], None]
    on_end: Callable[[End, str | None], None]  # the end, and the failure's text if failed
    attached: bool = field(default=True)


class LiveResponse:
    def __init__(self, transport: Transport, *, max_bytes: int):
        self.transport = transport
        self.max_bytes = max_bytes
        self.head: Head | None = None
        self.end: End | None = None
        self.error: str | None = None
        self._pieces: list[Piece] | None = []
        self._size = 0
        self._listeners: list[Listener] = []
        self.listening = False  # whether a listener is attached now
        self.attached_total = 0  # listeners that ever attached
        # the attempt made progress: its first event (HTTP) or first output (WebSocket), set
        # by the shell; before that a duplicate waits (an eventless failure is retried, not
        # shared)
        self.started = False
        # whether duplicates may attach (a detached call's own client always does, whatever
        # the response; duplicates only to an event stream that succeeds)
        self.shareable = True

    # -- the attempt's side ------------------------------------------------------------------------
    def start(self, head: Head) -> None:
        """The response's head arrived (HTTP; a WebSocket call has none)."""
        if self.head is not None or self.end is not None:
            return
        self.head = head
        for listener in list(self._listeners):
            self._call(listener, listener.on_head, head)

    def feed(self, piece: Piece) -> None:
        """One more piece of the response (empty pieces are ignored)."""
        if not piece or self.end is not None:
            return
        if self._pieces is not None:
            self._size += len(piece)
            if self._size > self.max_bytes:
                self._pieces = None  # too large to give a newcomer from its start
            else:
                self._pieces.append(piece)
        if self._listeners:
            self.fed(piece)

    def kept_by_feeder(self) -> list[Piece] | None:
        """Hand the keeping of the pieces to the feeder, when it keeps the very same ones
        under the same cap anyway (the HTTP tee keeps the body for the recording): the list
        it appends each piece to, then calling ``fed(piece)`` only while ``listening``, and
        ``stop_keeping()`` when it stops. None when this response was fed already."""
        if self._pieces is None or self._pieces or self.end is not None:
            return None
        return self._pieces

    def fed(self, piece: Piece) -> None:
        """A piece the feeder kept (see ``kept_by_feeder``): give it to the listeners."""
        if self.end is None:
            for listener in list(self._listeners):
                self._call(listener, listener.on_piece, piece)

    def stop_keeping(self) -> None:
        """The pieces are no longer kept whole (over the cap): nobody new can attach."""
        self._pieces = None

    def finish(self, end: End, error: str | None = None) -> None:
        """The response ended (``failed``: with ``error``'s text)."""
        if self.end is not None:
            return
        self.end, self.error = end, error
        listeners, self._listeners = self._listeners, []
        self.listening = False
        for listener in listeners:
            listener.attached = False
            self._call(listener, listener.on_end, end, error)

    # -- the duplicates' side ----------------------------------------------------------------------
    @property
    def attachable(self) -> bool:
        """Whether a new duplicate can still get the whole response from its start."""
        return self._pieces is not None

    def whole(self) -> bytes | None:
        """The whole body of a complete HTTP response (None: not complete, or not kept)."""
        if self.end != "complete" or self._pieces is None or self.transport != "http":
            return None
        return b"".join(self._pieces)  # type: ignore[arg-type]

    @property
    def listeners(self) -> int:
        return len(self._listeners)

    def attach(self, listener: Listener) -> bool:
        """Give ``listener`` the response so far, then what comes (synchronously: nothing can
        arrive in between); False when the response is no longer attachable."""
        if self._pieces is None:
            return False
        self.attached_total += 1
        if self.head is not None and not self._call(listener, listener.on_head, self.head):
            return True
        for piece in list(self._pieces):
            if not self._call(listener, listener.on_piece, piece):
                return True
        if self.end is not None:
            listener.attached = False
            self._call(listener, listener.on_end, self.end, self.error)
            return True
        self._listeners.append(listener)
        self.listening = True
        return True

    def detach(self, listener: Listener) -> None:
        """The duplicate left (its client went away)."""
        listener.attached = False
        if listener in self._listeners:
            self._listeners.remove(listener)
            self.listening = bool(self._listeners)

    def _call(self, listener: Listener, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception:  # noqa: BLE001 - one broken listener never stops the others
            self.detach(listener)
            return False
