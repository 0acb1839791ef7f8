"""The guard on a WebSocket: Codex's Responses calls sent as ``response.create`` frames.

Each guarded socket (its upgrade matched ``turnguard_filter``) gets a ``Socket``. A client's
frame with nothing before it is decided in its own ``websocket_message`` hook as far as that
goes without waiting (``_decide_now``): sent upstream, it goes on as it came (or rebuilt);
otherwise it is dropped there (the hook never waits) and sent, or answered, once decided. The
frames that come meanwhile are dropped and queued; a task per socket takes them in order, one
response at a time (the protocol's own rule). Each call runs the same request machine, with
the same ledger, as an HTTP request:

    Forward      the frame goes upstream (as sent, or rebuilt to its full input when the
                 upstream cannot know the response it continues); the response's events are
                 relayed live, read as they pass and recorded as one attempt
    Replay       the recorded events are sent to the client; nothing goes upstream
    Attach       the events of the same call in flight on another socket of this process:
                 those so far at once, then each as it comes, to the same end
    Respond      turnguard's answer as an ``error`` event with a numeric ``status``
    PassThrough  the frame goes upstream untouched, no attempt
    Abandon      nothing is sent upstream; a client still there gets a 503 ``error`` event

Frames that are not calls go upstream untouched, in order, and are named in the telemetry;
each waits for the answer to the frame before it. One the upstream may read as a call
(binary, not JSON, unreadable here: ``NotACall.awaits_answer``) has its answer waited for as
a call's, and that answer is its own (never taken for the next call's). One of another type
(a ``ping``) may be answered or not (a ``pong``, or nothing): the frame behind it goes on at
once, and while such frames are unanswered (``Socket.unanswered`` counts them) an ``error``
before the next response's first ``response.*`` event is taken for such a frame's answer. A
prewarm is forwarded, and answered, as a call is, and timed as one: with no event of its own
within ``turnguard_response_created_timeout_ms`` its upstream is cut (``_cut_if_silent``; it
is no operation, so nothing else ends); so is a frame that may be a call, once a frame waits
behind it (with none, the socket is as it would be without turnguard). Upstream frames before
a call's first event that are no Responses event (a gateway's keepalive, binary, not JSON, a
``pong``) are passed on and answer no call (``ws.first_frame``); inside a response, a JSON
frame of another type (a ``pong``, a keepalive) is none of its events
(``ws.is_response_event``).
An upstream that echoes a call (a frame of the client's type), or whose first answer to a
frame that is no call is no Responses event, does not speak this protocol: the socket is no
longer guarded (its attempt in flight ends as rejected, its queued frames go on untouched, in
order, before any later one). So is a socket whose client sends more than
``MAX_QUEUED_FRAMES`` frames ahead of the response in flight. A frame is never lost: if
guarding it fails, it is forwarded. The socket's ``SocketRecord`` remembers the responses it
carried, so that a delta frame (``previous_response_id`` + new items) has the same identity
as its full resend on a new socket or as the HTTP POST fallback.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mitmproxy import ctx, http
from mitmproxy.proxy.layers import websocket as websocket_layer

from turnguard_core import answers, circuit, identity, machine, negotiation, proxy_internals, ws
from turnguard_core.ending import EndFacts
from turnguard_core.live import Listener
from turnguard_core.offload import WorkerStopped, read_inline

from . import flows
from .answering import MAX_GUARDED_BODY, negotiated
from .deadlines import Deadline, Deadlines
from .detached import why_not_detached
from .inflight import MISSING_RESPONSE_CREATED, STALL_GRACE_S, STALL_GRACES, STALL_LATE_S
from .waiters import HandedOver

if TYPE_CHECKING:
    from .inflight import Attempt

logger = logging.getLogger("turnguard")

MARK_WS = ":electric_plug:"
FRAME_HALTED = ("frame hook never reached turnguard (an addon before it halted it): the frame "
                "went upstream unguarded")
DROPPED_AFTER = "an addon after turnguard dropped the frame; it never went upstream"
MAX_QUEUED_FRAMES = 64  # frames a client may send ahead of the socket's response in flight


@dataclass
class Response:
    """The response the upstream is sending on a socket now."""

    request: dict | None  # the full request it answers (None: a frame that is no call)
    events: ws.ResponseEvents
    attempt_key: str | None  # its attempt, when it is a guarded dispatch
    # the client message that carries it upstream (the frame's own, or the one turnguard
    # injected, once its hook came): an addon after turnguard may drop it (``drop_unsent``)
    message: object | None = None
    # the response-created timeout of a response that is no operation (a prewarm's, or a
    # frame's that may be a call: ``WebSockets._time_no_operation``): cancelled at its end, so
    # that an ended socket's flow is not kept until it is due
    silence: Deadline | None = None


@dataclass
class Socket:
    flow: http.HTTPFlow
    record: ws.SocketRecord = field(default_factory=ws.SocketRecord)
    frames: asyncio.Queue = field(default_factory=asyncio.Queue)  # (content, is_text) | None
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # no response in flight
    current: Response | None = None
    # let go while its call ran upstream: that response is still read to its end, whose
    # events end its attempt (ended at the let-go, its duplicates would run it again)
    followed: Response | None = None
    calls: int = 0
    seen: int = 0  # how many of the flow's messages turnguard's hooks saw (``catch_up``)
    closed: bool = False
    guarded: bool = True
    task: asyncio.Task | None = None
    attached: tuple | None = None  # (LiveResponse, Listener) while a call is attached
    # A frame decided in its own websocket_message hook (``WebSockets._decide_now``): the
    # hook's message while it is (``inline``; ``inline_sent``: it goes on as it is, maybe
    # rebuilt), and the decision when it went on past the hook (``busy``, awaited before the
    # next frame); ``serving``: ``_serve`` has a queued frame in hand.
    inline: object | None = None
    inline_sent: bool = False
    busy: asyncio.Task | None = None
    serving: bool = False
    # let go while frames waited: they are injected, so every later frame is too, behind
    # them (one that went on as it came could pass an injected one still on its way)
    queue_rest: bool = False
    # a queued frame went upstream while no addon instance was loaded (a reload that
    # failed), unguarded: the next instance lets the socket go (``catch_up``)
    sent_unguarded: bool = False
    # where the upstream sent a frame that is no event outside a response (named once each)
    unsolicited: set = field(default_factory=set)
    # client frames of another type than a call's (a ``ping``) that went upstream since the
    # last response began, less the answers (``ws.answers_a_frame``: an ``error``) that came:
    # an ``error`` before the next response's first event is such a frame's answer
    # (``ws.first_frame``); the upstream answers in order, so none comes once a response began
    unanswered: int = 0
    # frames that are no call turnguard injected whose hooks have not come yet (their message
    # is not the message of a response in flight: ``message``)
    injected_not_calls: int = 0
    # the ids of the responses that ended on it lately, and of their output items: a late
    # event of one is not the next's
    ended_responses: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=16))
    ended_items: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=64))

    def __post_init__(self) -> None:
        self.idle.set()

    def begin(self, response: Response) -> None:
        self.current = response
        self.idle.clear()

    @property
    def reads_upstream(self) -> bool:
        """Whether the upstream's frames are read: guarded, or let go while a call ran
        (``followed``), until that call's response ends."""
        return self.guarded or self.followed is not None

    def unread_upstream(self) -> bool:
        """Whether the upstream sent messages that no hook read (while a script reload that
        failed left no addon instance)."""
        data = self.flow.websocket
        return data is not None and any(not m.from_client and not m.injected
                                        for m in data.messages[self.seen:])

    def finish(self) -> Response | None:
        current, self.current = self.current, None
        self.idle.set()
        if current is not None and current.silence is not None:
            current.silence.cancel()
            current.silence = None
        if current is not None and current.events.response_id is not None:
            self.ended_responses.append(current.events.response_id)
        for item in (current.events.output_items or ()) if current is not None else ():
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                self.ended_items.append(item["id"])
        return current


def inject(flow: http.HTTPFlow, content: bytes | str, *, to_client: bool,
           is_text: bool = True) -> None:
    """Send a message on the socket (what mitmproxy's ``inject.websocket`` does)."""
    data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content
    send = proxy_internals.command_body(ctx.master.addons.get("proxyserver"), "inject_websocket")
    if send is None:
        ctx.master.commands.call("inject.websocket", flow, to_client, data, is_text)
    else:
        send(flow, to_client, data, is_text)


class WebSockets:
    """The guarded sockets. They are the process's (``ProcessState.sockets``): after a script
    reload the new addon instance gets their hooks, and their tasks work for it."""

    def __init__(self, process) -> None:
        self._process = process
        self._sockets: dict[str, Socket] = process.sockets
        self._silences = Deadlines()  # the response-created timeouts of no operations
        why_not = proxy_internals.mend_websocket_layer(websocket_layer)
        if why_not is not None:
            logger.warning("turnguard: %s: a text message turnguard sends may have characters "
                           "cut in two past 4 kB", why_not)

    @property
    def _guard(self):
        return self._process.guard

    def __len__(self) -> int:
        return len(self._sockets)

    # -- hooks -----------------------------------------------------------------------------------
    def start(self, flow: http.HTTPFlow) -> None:
        sock = Socket(flow)
        self._sockets[flow.id] = sock
        sock.task = asyncio.get_running_loop().create_task(self._serve(sock))
        self._guard.explainer.show(flow, MARK_WS, "turnguard: guarding the Responses calls "
                                   "on this WebSocket")

    def message(self, flow: http.HTTPFlow) -> None:
        sock = self._sockets.get(flow.id)
        if sock is None or flow.websocket is None or not flow.websocket.messages:
            return
        message = flow.websocket.messages[-1]
        if len(flow.websocket.messages) <= sock.seen:
            return  # read already: its hook came after ``read_unread_upstream`` read it
        for unseen in flow.websocket.messages[sock.seen:-1]:
            self._say_halted(sock, unseen)
        sock.seen = len(flow.websocket.messages)
        if message.injected:
            if message.from_client and sock.injected_not_calls > 0:
                sock.injected_not_calls -= 1  # (a frame that is no call: no response's)
            elif message.from_client and sock.current is not None \
                    and sock.current.message is None:
                sock.current.message = message  # the response's frame, ours, on its way
            return
        if not message.from_client:
            if sock.reads_upstream:
                self._upstream_frame(sock, message)
            return
        self.drop_unsent(sock)  # (the frame before this one had all its hooks)
        if message.dropped:
            # an addon that runs before turnguard dropped it (a content filter): it never goes
            # upstream, so it is no call (nothing in flight, no answer to wait for) and turnguard
            # never sends it (a queued frame is sent once decided)
            return
        if not sock.guarded and not sock.queue_rest:
            return  # a socket turnguard let go: on its way as it came
        if sock.guarded and sock.frames.qsize() >= MAX_QUEUED_FRAMES:
            self._let_go(sock, f"more than {MAX_QUEUED_FRAMES} frames queued")  # queued: in order
        elif (sock.guarded and sock.busy is None and not sock.serving and sock.frames.empty()
                and sock.idle.is_set() and not sock.closed):
            return self._decide_now(sock, message)
        message.drop()
        sock.frames.put_nowait((message.content, message.is_text))

    def _decide_now(self, sock: Socket, message) -> None:
        """Decide a frame that has nothing before it in its own hook, as far as that goes
        without waiting (mitmproxy runs a new task eagerly, to its first wait): a frame that
        goes upstream then goes on as the client sent it (or rebuilt), without being dropped
        and sent again; one answered by turnguard is dropped. A decision that has to wait (a
        hold, a ledger busy elsewhere, an identity off the loop) goes on in its task, the
        frame dropped meanwhile and sent when decided, as a queued frame is; the socket's next
        frames wait for it."""
        sock.inline, sock.inline_sent = message, False
        try:
            task = asyncio.get_running_loop().create_task(
                self._one_frame(sock, message.content, message.is_text))
        finally:
            sent, sock.inline = sock.inline_sent, None
        if not sent:
            message.drop()
        if not task.done():
            sock.busy = task
            task.add_done_callback(lambda t: setattr(sock, "busy", None)
                                   if sock.busy is t else None)

    def end(self, flow: http.HTTPFlow) -> None:
        sock = self._sockets.get(flow.id)
        if sock is None:
            return
        self.read_unread_upstream(sock)  # (every frame's hooks ran: none is on its way)
        self._sockets.pop(flow.id, None)
        sock.closed = True
        sock.frames.put_nowait(None)
        if sock.attached is not None:
            live, listener = sock.attached
            live.detach(listener)
            if self._guard is not None:  # a detached call may now run without a client
                self._guard.detacher.listener_left(live)
        data = flow.websocket
        by_client = bool(data and data.closed_by_client)
        code = data.close_code if data else None
        side = "client" if by_client else "upstream"
        if sock.current is not None:
            self._response_ended(sock, error=f"websocket closed by {side} (code {code})",
                                 client_gone=by_client)
        if sock.followed is not None:
            followed, sock.followed = sock.followed, None
            self._close(sock, followed, error=f"websocket closed by {side} (code {code})",
                        client_gone=by_client)
        self._guard.waiters.gone(flow.id, "websocket closed")
        sock.idle.set()

    def read_unread_upstream(self, sock: Socket | None = None) -> None:
        """Read the upstream's frames that reached the client but not turnguard's hook, in
        order (of ``sock``, or of every guarded socket): an addon that runs before turnguard
        raised ``AddonHalt`` in its ``websocket_message`` hook for them. Unread, a call's
        events would go uncounted (its upstream cut as silent, an eventless failure counted)
        and its end unseen (the socket's next frames held behind it). Reading stops at a
        client frame not read yet (its own hook decides it); a frame whose hook comes after
        it was read here is not read twice (``message``). (The maintenance ticker calls this
        every second, and the response-created timer before it cuts a call.)"""
        for s in ([sock] if sock is not None else list(self._sockets.values())):
            data = s.flow.websocket
            if data is None or not s.reads_upstream:
                continue
            messages = data.messages
            while s.seen < len(messages) and s.reads_upstream:
                message = messages[s.seen]
                if message.from_client and not message.injected \
                        and s.seen == len(messages) - 1:
                    break  # (its own hook may still come)
                s.seen += 1
                if message.from_client:
                    self._say_halted(s, message)
                elif not message.injected:
                    self._upstream_frame(s, message)

    def drop_unsent(self, sock: Socket | None = None) -> None:
        """End the response in flight (of ``sock``, or of every socket) whose frame an addon
        that runs after turnguard dropped in its ``websocket_message`` hook (a content filter):
        mitmproxy checks ``message.dropped`` once every addon's hook ran and never sends it,
        so no upstream answers it. Kept in flight, the socket's next frames would wait behind
        it until ``turnguard_response_created_timeout_ms`` cut the upstream as silent (an
        eventless failure, the socket closed). Its attempt ends as never sent (``rejected``,
        its outcome's detail says why: no circuit, no recovery spent); the client gets
        nothing for it, as for a frame an earlier addon drops. (A later frame's hook, the
        maintenance ticker every second and the response-created timer call this.)"""
        for s in ([sock] if sock is not None else list(self._sockets.values())):
            current = s.current
            if current is None or current.message is None or not current.message.dropped:
                continue
            s.finish()
            if current.attempt_key is not None and self._guard is not None:
                headers = flows.request_headers(s.flow)
                self._guard.inflight.close(
                    current.attempt_key,
                    lambda attempt, events=current.events: replace(
                        _end_facts(attempt, events, headers, DROPPED_AFTER, False),
                        never_sent=True))

    def _say_halted(self, sock: Socket, message) -> None:
        """A client's frame whose ``websocket_message`` hook never reached turnguard (an addon
        that runs before it raised ``AddonHalt`` there; a later message exists, so its hooks
        are over): unless dropped, it went upstream unguarded, and a ``passthrough`` record
        says so. (Upstream frames are read as they are: ``read_unread_upstream``.)"""
        if message.from_client and not message.injected and not message.dropped \
                and self._guard is not None:
            self._guard._emit("passthrough", flow=sock.flow.id, transport="ws",
                              reason=FRAME_HALTED)

    def end_those_whose_end_hook_was_halted(self) -> None:
        """End the guarded sockets that closed although turnguard's ``websocket_end`` hook
        never came: an addon that runs before turnguard raised ``AddonHalt`` in that hook.
        Their call in flight would stay so for as long as the process runs (every retry, on
        any socket, held and answered ``turn_in_progress``). mitmproxy marks a WebSocket flow
        no longer ``live`` only once its ``websocket_end`` hooks have run (a kill, which
        cannot stop a socket in transit, leaves its end unset). (The maintenance ticker calls
        this every second.)"""
        for sock in list(self._sockets.values()):
            flow, data = sock.flow, sock.flow.websocket
            if flow.live or data is None or data.timestamp_end is None:
                continue
            logger.warning("turnguard: the websocket_end hook of %s never reached turnguard (an "
                           "addon before it halted it); its end is recorded now", flow.id)
            self.end(flow)

    def catch_up(self) -> None:
        """Bring the sockets up to date with what passed while no addon instance was loaded (a
        script reload that failed, until it is fixed): their hooks reached no one. The
        upstream's events each missed are read now, as they came, so a call that ended
        meanwhile is recorded as it ended (its retry is replayed); a client frame that went
        upstream unseen went unguarded: the socket is let go there, as one whose task sent a
        queued frame upstream meanwhile (``sent_unguarded``) is once its events are read. A
        socket that ended meanwhile ends now."""
        for sock in list(self._sockets.values()):
            try:
                self._catch_up(sock)
            except Exception:  # the other sockets still matter
                logger.exception("turnguard: bringing %s up to date failed", sock.flow.id)

    def _catch_up(self, sock: Socket) -> None:
        flow, data = sock.flow, sock.flow.websocket
        if data is None:
            return
        ended = data.timestamp_end is not None or not flow.live
        if ended:
            sock.closed = True  # (nothing is sent to it now)
        messages = data.messages
        while sock.seen < len(messages) and sock.guarded:
            message = messages[sock.seen]
            sock.seen += 1
            if message.injected or message.from_client and message.dropped:
                continue  # (a client frame an addon dropped never went upstream)
            if not message.from_client:
                self._upstream_frame(sock, message)
            else:
                self._let_go(sock, "a client frame went upstream unguarded while no turnguard "
                                   "script was loaded (a reload that failed)")
        sock.seen = len(messages)
        if sock.sent_unguarded and sock.guarded:
            # the socket's task sent a frame it had queued (its wait for the response before
            # it ended, or passed the budget, with no instance to decide it): the events read
            # above were the response in flight's, and what came after is no call's guarded
            self._let_go(sock, "a queued client frame went upstream unguarded while no "
                               "turnguard script was loaded (a reload that failed)")
        if ended:
            self.end(flow)

    # -- the client's frames, in order -----------------------------------------------------------
    async def _serve(self, sock: Socket) -> None:
        while not sock.closed:
            item = await sock.frames.get()
            if item is None:
                return
            sock.serving = True
            try:
                if sock.busy is not None:  # a frame decided past its hook comes first
                    await asyncio.wait({sock.busy})
                if not await self._idle(sock) and self._guard is not None:
                    self._let_go(sock, "a response did not end within "
                                       "turnguard_request_budget_ms while the client's next "
                                       "frame waited")
                if sock.closed:
                    return
                await self._one_frame(sock, *item)
            finally:
                sock.serving = False

    async def _one_frame(self, sock: Socket, content: bytes, is_text: bool) -> None:
        try:
            if self._guard is None or not sock.guarded:  # unloaded, or let go
                self._forward(sock, content, is_text)
            else:
                await self._frame(sock, content, is_text)
        except Exception as e:  # never lose a frame: forward it as it came
            logger.exception("turnguard: guarding a frame of %s failed; forwarding it",
                             sock.flow.id)
            if self._guard is not None:
                self._guard._emit("passthrough", flow=sock.flow.id, transport="ws",
                                  reason=f"internal error: {e!r}")
            if sock.current is None:
                self._forward(sock, content, is_text)

    async def _idle(self, sock: Socket) -> bool:
        """Wait until no response is in flight on the socket (one at a time: the protocol's
        rule), at most the request budget; False when that passed first."""
        if self._guard is None:
            return sock.idle.is_set()
        try:
            await asyncio.wait_for(sock.idle.wait(), self._guard.settings.request_budget_s)
        except TimeoutError:
            return sock.idle.is_set()
        return True

    def _forward(self, sock: Socket, content: bytes, is_text: bool,
                 response: Response | None = None) -> None:
        if sock.closed:
            return
        if self._guard is None and response is None:  # no instance loaded, nothing to read
            sock.sent_unguarded = True  # its answer: the next one is told (``catch_up``)
        if response is not None:
            sock.begin(response)
        if sock.inline is not None:  # decided in the frame's own hook: it goes on from there
            data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) \
                else content
            if data != sock.inline.content:
                sock.inline.content = data
            sock.inline_sent = True
            if response is not None:
                response.message = sock.inline
            return
        inject(sock.flow, content, to_client=False, is_text=is_text)

    async def _frame(self, sock: Socket, content: bytes, is_text: bool) -> None:
        frame = await _parsed(content, is_text)
        if self._guard is None or not sock.guarded:  # unloaded, or let go, while it was read
            return self._forward(sock, content, is_text)
        match frame:
            case ws.NotACall(reason=reason, awaits_answer=True):
                # the upstream may read a call in it: its answer is its own, not the next's
                self._guard._emit("passthrough", flow=sock.flow.id, transport="ws", reason=reason)
                unread = Response(None, self._events(), None)
                self._forward(sock, content, is_text, unread)
                self._time_no_operation(sock, unread,
                                        self._guard.settings.response_created_timeout_s,
                                        STALL_GRACES)
            case ws.NotACall(reason=reason):
                # another type (a ping): no response in flight for it, so the frame behind it
                # waits for no answer that may never come (``Socket.unanswered`` keeps an
                # answer that does come from being taken for the next call's)
                self._guard._emit("passthrough", flow=sock.flow.id, transport="ws", reason=reason)
                sock.unanswered += 1
                if sock.inline is None and not sock.closed:
                    sock.injected_not_calls += 1
                self._forward(sock, content, is_text)
            case ws.Prewarm(body=body):
                full = sock.record.full_request(body)
                prewarm = Response(full.body, self._events(), None)
                self._forward(sock, content, is_text, prewarm)
                self._time_no_operation(sock, prewarm,
                                        self._guard.settings.response_created_timeout_s,
                                        STALL_GRACES)
            case ws.Call():
                await self._call(sock, frame, content)

    def _time_no_operation(self, sock: Socket, response: Response, after_s: float,
                           graces: int) -> None:
        """Cut the upstream of ``response``, which is no operation (a prewarm's, or a frame's
        that may be a call), if it is still in flight without an event ``after_s`` from now
        (``_cut_if_silent``); 0: never."""
        if after_s <= 0 or sock.current is not response:
            return
        due = asyncio.get_running_loop().time() + after_s
        # (a script reload meanwhile changes nothing: the sockets and the guard it reads are
        # the process's, ``_guard`` the instance loaded now)
        response.silence = self._silences.call_later(after_s, lambda: self._cut_if_silent(
            sock, response, due, graces))

    def _cut_if_silent(self, sock: Socket, response: Response, due: float, graces: int) -> None:
        """The response to a prewarm, or to a frame that may be a call (binary, not JSON),
        still in flight without an event of its own (its upstream refused the frame with an
        ``error`` taken for the answer to a ``ping`` before it, or sent nothing): cut its
        upstream, as a silent call's is (``turnguard_response_created_timeout_ms``), so the
        client's next frame does not wait for it until ``turnguard_request_budget_ms`` (then
        sent unguarded). Ending it instead would take its answer, if it came late, for the
        next call's. A frame that is no call is cut only with a frame waiting behind it (a
        protocol may answer none of them: a binary keepalive); until then it is looked at
        again each timeout. It is no operation: no attempt ends, no circuit counts it. A
        timer that fires late first lets the loop read what came meanwhile (as a call's does);
        one that fires with no instance loaded is looked at again shortly, and one that cannot
        cut is timed again in full."""
        response.silence = None
        if sock.closed or sock.current is not response or response.events.events_seen > 0:
            return
        if self._guard is None:  # no instance loaded to read what came: looked at again
            return self._time_no_operation(sock, response, STALL_GRACE_S, 0)
        if graces > 0 and asyncio.get_running_loop().time() - due > STALL_LATE_S:
            return self._time_no_operation(sock, response, STALL_GRACE_S, graces - 1)
        self.drop_unsent(sock)  # (never sent: not silent)
        self.read_unread_upstream(sock)  # (what reached the client past an earlier addon)
        if sock.current is not response or response.events.events_seen > 0:
            return
        timeout_s, flow = self._guard.settings.response_created_timeout_s, sock.flow
        if response.request is None and sock.frames.empty() and not sock.serving:
            # a frame that is no call may await no answer (a binary keepalive): with no frame
            # behind it, the socket is as it would be without turnguard; looked at again
            return self._time_no_operation(sock, response, timeout_s, STALL_GRACES)
        why_not = proxy_internals.cut_upstream(flows.proxyserver(), flow.client_conn.id,
                                               flow.server_conn,
                                               f"turnguard: {MISSING_RESPONSE_CREATED}")
        self._guard._emit("upstream_cut", op=None, flow=flow.id, session=None, transport="ws",
                          prewarm=response.request is not None,  # (else a frame that is no call)
                          reason=MISSING_RESPONSE_CREATED, after_ms=round(timeout_s * 1000),
                          headers_seen=True, cut=why_not is None, why_not=why_not)
        if why_not is not None:
            logger.warning("turnguard: could not cut the upstream of %s (%s); timed again",
                           flow.id, why_not)
            self._time_no_operation(sock, response, timeout_s, STALL_GRACES)

    def _events(self, keep: bool = False, guard=None) -> ws.ResponseEvents:
        """A response's events reader; ``keep``: kept for a replay, as the settings of
        ``guard`` (the instance that decided the call, else the one loaded now, if any) say."""
        instance = guard if guard is not None else self._guard
        settings = instance.settings if keep and instance is not None else None
        keep_max = settings.replay_max_bytes if settings and settings.guard.replay else 0
        return ws.ResponseEvents(keep_max_bytes=keep_max)

    async def _call(self, sock: Socket, frame: ws.Call, content: bytes) -> None:
        guard, flow = self._guard, sock.flow
        cfg = guard.settings
        budget_deadline = time.monotonic() + cfg.request_budget_s
        sock.calls += 1
        key = f"{flow.id}:{sock.calls}"
        full = sock.record.full_request(frame.body)
        view = flows.ws_call_view(flow, full.encoded())
        while True:
            try:
                ident = await guard.identifier.identify_view(  # (after a reload: what is left)
                    view, max(0.0, budget_deadline - time.monotonic()), cfg.credential_headers)
                break
            except WorkerStopped:  # a script reload while the frame was identified off the
                successor = self._guard  # loop: the instance that runs now decides
                if successor is None or successor is guard or successor.refused:
                    ident = identity.Passthrough("turnguard unloaded while identifying the call")
                    break
                logger.info("turnguard: reloaded while call %s was identified; the addon "
                            "loaded now decides it", key)
                guard = successor
                cfg = guard.settings
        if isinstance(ident, identity.Passthrough):
            guard._emit("passthrough", flow=key, transport="ws", reason=ident.reason)
            return self._forward(sock, content, True, Response(full.body, self._events(), None))
        scope = circuit.circuit_scope(ident.session, ident.scope, ident.route)
        resume: machine.State | None = None
        while True:  # once more per script reload while the call is held
            req = await guard.request_facts(ident, key, budget_deadline, accepts_sse=False,
                                            turn_anchor=frame.turn_id is not None, transport="ws")
            try:
                state = await guard.decide(flow, ident, req, "POST", scope, resume)
                break
            except HandedOver as handed:
                logger.info("turnguard: reloaded while call %s was held; the addon loaded now "
                            "decides it", key)
                guard, resume, budget_deadline = \
                    handed.successor, handed.resume, handed.budget_deadline
                cfg = guard.settings
        if sock.closed or not sock.guarded:
            # the client left while it was decided (nothing to send, nowhere), or the socket
            # was let go meanwhile (the frame goes on untouched, as every frame now does): a
            # claim made for it is given back, or it would stay in flight for no one
            if isinstance(state, machine.Forward):
                guard.store.give_back(state.dispatch, ident.op_key)
            if sock.closed:  # (a call held on a detached one, say: that one may be alone now)
                asyncio.get_running_loop().call_soon(guard.detacher.enforce_cap)
            if sock.closed and not isinstance(state, machine.Abandon):
                # (an Abandon was a hold, and its end has its record already)
                guard._emit("hold_abandoned", op=ident.op_id, flow=key, transport="ws",
                            session=ident.session, reason="websocket closed while the call "
                            "was decided; nothing was sent upstream")
            else:
                self._forward(sock, content, True)
            return
        match state:
            case machine.Forward(dispatch=dispatch) if cfg.detach_s > 0 \
                    and why_not_detached(flow) is None:
                self._dispatch_detached(sock, key, full, ident, dispatch, scope, req.base)
            case machine.Forward(dispatch=dispatch):
                events = self._events(keep=True, guard=guard)
                guard.inflight.start(flow, ident, dispatch, scope, key=key, ws_events=events)
                self._dispatch(guard, sock, key, frame, full, content, events, ident,
                               attempt_key=key)
            case machine.PassThrough():
                self._dispatch(guard, sock, key, frame, full, content, self._events(), ident)
            case machine.Replay():
                if not await self._replay(sock, key, ident, full, state):
                    self._dispatch(guard, sock, key, frame, full, content, self._events(),
                                   ident)
            case machine.Attach(live=live):
                self._attach(sock, full, live)
            case machine.Respond(answer=answer):
                inject(flow, ws.error_frame(answer.status, answer.body), to_client=True)
            case machine.Abandon(reason=reason):  # the client is still there: it may retry
                released = answers.error_answer(
                    503, "turnguard_hold_released", f"turnguard let this request go ({reason});"
                    " nothing was sent upstream; retry it.", retry_after_s=1)
                inject(flow, ws.error_frame(503, released.body), to_client=True)
                asyncio.get_running_loop().call_soon(guard.detacher.enforce_cap)
            case _:
                raise AssertionError(f"unexpected terminal state {state!r}")

    def _dispatch(self, guard, sock: Socket, key: str, frame: ws.Call, full: ws.FullRequest,
                  content: bytes, events: ws.ResponseEvents, ident: identity.Identity,
                  *, attempt_key: str | None = None) -> None:
        """Send the call upstream: as the client sent it, or rebuilt to its full input when
        the upstream cannot know the response it continues (it was replayed, or answered
        on another socket). ``guard``: the instance that decided it (its records are kept
        for the next one if a reload that failed unloaded it meanwhile)."""
        outbound = sock.record.outbound(frame.body, full)
        if outbound is not None:
            content = identity.canonical_json(outbound)
            guard._emit("ws_full_input_sent", op=ident.op_id, flow=key, transport="ws",
                        session=ident.session, reason="upstream does not know "
                        "previous_response_id")
        if full.unresolved is not None:
            guard._emit("ws_unknown_previous_response", op=ident.op_id, flow=key,
                        transport="ws", session=ident.session)
        self._forward(sock, content, True, Response(full.body, events, attempt_key))

    # -- the upstream's events -------------------------------------------------------------------
    def _upstream_frame(self, sock: Socket, message) -> None:
        # a response attached to (another socket's call, or this one's detached call) is not
        # this socket's upstream's: what its upstream sends meanwhile (a late event of an
        # earlier response) answers no frame in flight, as when no response is
        followed = not sock.guarded  # (then ``sock.followed`` is set: see ``message``)
        current = sock.followed if followed else sock.current if sock.attached is None else None
        try:
            speaks, event = ws.upstream_event(message.text) if message.is_text else (False, None)
            if current is not None and current.request is None and not speaks \
                    and current.events.events_seen == 0:
                # the first answer to a frame that is no call (binary, not JSON) is none of
                # the protocol's: the upstream speaks another (no call is in flight to follow)
                return self._let_go(sock, "upstream frame is not a Responses event "
                                          f"({'binary' if not message.is_text else 'text'})",
                                    not_responses=True)
            if current is None:
                sock.unanswered = ws.unanswered_after(sock.unanswered, event)
            elif not followed and current.events.events_seen == 0:
                match ws.first_frame(speaks, event, unanswered=sock.unanswered > 0):
                    case "echo":
                        return self._let_go(sock, "upstream frame is not a Responses event "
                                                  "(text): an echo of the client's",
                                            not_responses=True)
                    case "passes":
                        sock.unanswered = ws.unanswered_after(sock.unanswered, event)
                        return self._unsolicited(sock, message, "before the response's "
                                                                "first event")
            if not speaks:
                if current is None:
                    return self._unsolicited(sock, message, "while no response is in flight")
                return self._pass_over(sock, current, message)
            if current is None:
                return
            if event is not None and not ws.is_response_event(event):
                # a ``pong``, a gateway's JSON keepalive: none of the response's events
                return self._unsolicited(sock, message, "inside a response")
            rid = ws.event_response_id(event)
            if (rid is None and not followed and current.events.events_seen == 0
                    and _item_id(event) in sock.ended_items):
                # an output event names its item, not its response: one of an item of a
                # response that ended, before the response in flight began (its first event
                # names it), is a late one of that response, not this one's
                return
            if rid is not None and (rid != current.events.response_id
                                    if current.events.response_id is not None
                                    else _stray(current.events, event, rid,
                                                sock.ended_responses)):
                return  # another response's event (a stray one of one that ended)
            if not followed and current.events.events_seen == 0 \
                    and (event is None or event["type"] != "error"):
                # the response in flight began (a stray of an ended one does not come here): it
                # comes after every answer to an earlier frame
                sock.unanswered = 0
            output_before = current.events.output_seen
            current.events.feed(message.text, event)
            if current.attempt_key is not None:  # (one too large to read reaches them too)
                self._guard.inflight.ws_event(
                    current.attempt_key, output_before == 0 < current.events.output_seen,
                    message.text)
            if current.events.ended and followed:
                sock.followed = None
                self._close(sock, current)
            elif current.events.ended:
                self._response_ended(sock)
        except Exception:  # the client's frames matter more than our bookkeeping
            logger.exception("turnguard: reading an event of %s failed", sock.flow.id)

    def _unsolicited(self, sock: Socket, message, where: str) -> None:
        """A frame that is no Responses event while no response is in flight (a gateway's
        keepalive text on an idle socket), or before the first event of the response in flight
        (a keepalive, a ``pong``, the answer to a frame that is no call: ``ws.first_frame``):
        it answers no call. It goes on untouched, named in the telemetry (once per socket and
        ``where``), and the socket stays guarded; a response in flight is still timed as
        silent until its first event (``turnguard_response_created_timeout_ms``)."""
        if where not in sock.unsolicited:
            sock.unsolicited.add(where)
            self._guard._emit(
                "passthrough", flow=sock.flow.id, transport="ws",
                reason="upstream frame passed on: not a Responses event "
                       f"({'text' if message.is_text else 'binary'}) {where}")

    def _pass_over(self, sock: Socket, current: Response, message) -> None:
        """A frame that is no Responses event (a gateway's keepalive text, a binary frame)
        inside a response that began with Responses events: the upstream speaks the protocol,
        so the socket stays guarded and the response is followed to its end (letting the
        socket go would end its attempt while the upstream goes on running it, and release
        its duplicates to run it again). The frame goes on untouched, to the duplicates
        attached to the response too (a text one: they get frames as text), and is named in
        the telemetry (once per response); the response is not recorded without it."""
        events = current.events
        if events.unreadable == 0:
            self._guard._emit(
                "passthrough", flow=sock.flow.id, transport="ws",
                reason="upstream frame passed on: not a Responses event "
                       f"({'text' if message.is_text else 'binary'}) inside a response; "
                       "the response is not recorded")
        events.pass_over()
        if current.attempt_key is not None:
            self._guard.inflight.ws_event(current.attempt_key, False,
                                          message.text if message.is_text else None)

    def _let_go(self, sock: Socket, reason: str, *, not_responses: bool = False) -> None:
        """Stop guarding the socket: the frames it queued, and all later ones, go on untouched.
        Its call in flight goes on upstream: its response is still read to its end
        (``Socket.followed``), which ends its attempt (its duplicates held meanwhile, then
        answered from it, never running it again; a let-go is no upstream failure); or, when
        the socket does not speak the Responses API (``not_responses``), its attempt ends now
        as a rejection (no circuit, not replayable)."""
        if not sock.guarded:
            sock.finish()  # (a budget past on a socket let go: the frame behind goes on)
            return
        sock.guarded = False
        sock.queue_rest = not sock.frames.empty() or sock.serving or sock.busy is not None
        self._guard._emit("passthrough", flow=sock.flow.id, transport="ws", reason=reason)
        if sock.attached is not None:  # turnguard's own response in flight: it ends here,
            live, listener = sock.attached  # before any later frame's answer can come
            sock.attached = None
            live.detach(listener)
            self._guard.detacher.listener_left(live)
            if not sock.closed:
                ended = answers.error_answer(
                    502, "upstream_stream_failed", f"turnguard let this socket go ({reason});"
                    " the response in flight ends here; retry the call.", retry_after_s=1)
                inject(sock.flow, ws.error_frame(502, ended.body), to_client=True)
        response = sock.finish()
        if response is None or response.attempt_key is None:
            return
        if not not_responses:
            sock.followed = response
            return
        headers = flows.request_headers(sock.flow)
        self._guard.inflight.close(
            response.attempt_key,
            lambda attempt: replace(_end_facts(attempt, response.events, headers, reason, False),
                                    status=502, events_seen=0, terminal=None))

    def _response_ended(self, sock: Socket, *, error: str | None = None,
                        client_gone: bool = False) -> None:
        response = sock.finish()
        if response is not None:
            self._close(sock, response, error=error, client_gone=client_gone)

    def _close(self, sock: Socket, response: Response, *, error: str | None = None,
               client_gone: bool = False) -> None:
        """The response ended (its terminal event, or its socket's close): remembered in the
        socket's record, its attempt ended by what it was."""
        if response.request is not None:
            sock.record.remember(response.request, response.events, from_upstream=True)
        if response.attempt_key is not None:
            headers = flows.request_headers(sock.flow)
            self._guard.inflight.close(
                response.attempt_key,
                lambda attempt: _end_facts(attempt, response.events, headers, error, client_gone))

    def _dispatch_detached(self, sock: Socket, key: str, full: ws.FullRequest,
                           ident: identity.Identity, dispatch, scope: str, base: dict) -> None:
        """Send the call upstream detached from the socket (``turnguard_detach_ms``): as the
        HTTP POST Codex falls back to, on turnguard's own flow, whose events the socket gets
        as frames; a socket that drops leaves it running for its retry to attach to."""
        guard = self._guard
        body = full.encoded()  # (with "stream": true: the socket's client wants events)
        up, live = guard.detacher.prepare_call(sock.flow, key, body, base)
        attempt = guard.inflight.start(up, ident, dispatch, scope)
        attempt.live = live
        guard.detacher.start(up)
        self._attach(sock, full, live)

    # -- attach ----------------------------------------------------------------------------------
    def _attach(self, sock: Socket, full: ws.FullRequest, live) -> None:
        """Send the client the events of the call in flight it duplicates (or of its own
        detached call): those so far, then each as it comes; from an HTTP attempt, its event
        stream's events as frames. The socket has this response in flight until it ends (its
        next frames wait, as for its own); a response that fails gets an ``error`` event with
        a status (an HTTP error answer's own)."""
        flow, events = sock.flow, ws.ResponseEvents()
        response = Response(full.body, events, None)
        sock.begin(response)
        frames_of = ws.SseToFrames() if live.transport == "http" else None
        refused: dict = {}  # an HTTP answer that is no event stream: its status and body

        def head(h) -> None:
            content_type = next((v for k, v in h.headers if k.lower() == "content-type"), "")
            if not (200 <= h.status < 300 and content_type.startswith("text/event-stream")):
                refused.update(status=h.status, body=[])

        def send(frames) -> None:
            for text in frames:
                events.feed(text)
                inject(flow, text, to_client=True)

        def piece(p) -> None:
            if sock.closed:
                return
            if refused:
                refused["body"].append(p)
            else:
                send(frames_of.feed(p) if frames_of is not None else [p])

        def end(how: str, error: str | None) -> None:
            sock.attached = None
            if sock.current is not response:
                return
            if frames_of is not None and not refused and not sock.closed:
                send(frames_of.close())
            sock.finish()
            if how == "complete" and frames_of is not None and not frames_of.ended:
                # an event stream whose body ended without a terminal event: its HTTP client
                # saw the end; a socket has none, and its client would wait for the rest
                how, error = "failed", "its event stream ended without a terminal event"
            if how == "complete" and not refused:
                sock.record.remember(full.body, events, from_upstream=False)
            elif not sock.closed:
                status, body = refused.get("status", 502), b"".join(refused.get("body", ()))
                if not refused or not body:
                    body = answers.error_answer(
                        502, "upstream_stream_failed", "the response to this call failed "
                        f"upstream ({error or 'no end'}); retry it.", retry_after_s=1).body
                inject(flow, ws.error_frame(ws.ws_status(status), body), to_client=True)

        listener = Listener(on_head=head, on_piece=piece, on_end=end)
        sock.attached = (live, listener)
        if not live.attach(listener):  # it grew too large meanwhile: end like a failure
            end("failed", "too large to attach to")

    # -- replay ----------------------------------------------------------------------------------
    async def _replay(self, sock: Socket, key: str, ident: identity.Identity,
                      full: ws.FullRequest, r: machine.Replay) -> bool:
        """Send the recorded events to the client; False when they cannot be (said why; the
        caller forwards the call, as a declined HTTP replay is)."""
        guard, flow = self._guard, sock.flow
        base = {"op": ident.op_id, "flow": key, "session": ident.session, "transport": "ws"}
        frames, why_not = await _recorded_frames(r.recording, flows.request_headers(flow))
        if frames is None:
            guard._emit("replay_declined", **base, held_ms=r.held_ms, reason=why_not)
            guard.explainer.show(flow, None, f"turnguard: not replayed ({why_not}); forwarded")
            return False
        events = ws.ResponseEvents()
        for text in frames:
            events.feed(text)
            inject(flow, text, to_client=True)
        sock.record.remember(full.body, events, from_upstream=False)
        guard.store.note_duplicates(ident.op_key, replayed=1)
        guard._emit("duplicate_replayed", **base, held_ms=r.held_ms, status=r.recording.status,
                    bytes=sum(len(t) for t in frames), frames=len(frames),
                    attempt=r.attempt_id, recoded=False)
        guard.explainer.show(flow, flows.MARK_REPLAYED, "turnguard: replayed the recorded "
                             f"events of operation {ident.op_id} ({len(frames)} frames) after "
                             f"{r.held_ms} ms; nothing was sent upstream")
        return True


async def _parsed(content: bytes, is_text: bool) -> ws.Call | ws.Prewarm | ws.NotACall:
    """What a client frame is (``ws.parse_client_frame``); a large one, or one of many JSON
    values (``offload.read_inline``), is read on a thread: a frame of millions of tiny JSON
    objects (a few kB deflated) takes seconds to read, and the event loop serves every other
    flow meanwhile. The frame is the message as mitmproxy inflated it (permessage-deflate):
    its size on the wire says nothing of the work."""
    if read_inline(content):
        return ws.parse_client_frame(content, is_text)
    return await asyncio.to_thread(ws.parse_client_frame, content, is_text)


def _item_id(event: dict | None) -> str | None:
    """The output item an event names (``item_id``, or its ``item``'s id), or None."""
    if event is None:
        return None
    item = event.get("item")
    named = event.get("item_id", item.get("id") if isinstance(item, dict) else None)
    return named if isinstance(named, str) else None


def _stray(events: ws.ResponseEvents, event: dict, rid: str, ended) -> bool:
    """Whether an event naming the response ``rid``, before the response in flight named its
    own, is a late one of a response that ended on the socket. Response ids need not be
    unique (an upstream may give every response one id): an event that starts a response, or
    one that comes after the response in flight sent events of its own, is that response's."""
    if rid not in ended or events.events_seen > 0:
        return False
    return event.get("type") not in ws.RESPONSE_STARTS


async def _recorded_frames(rec, request_headers) -> tuple[list[str] | None, str | None]:
    """The recording's events as frames, decoded when it was recorded with a content coding;
    or None and why it cannot be replayed on a WebSocket."""
    headers = tuple((k, v) for k, v in request_headers if k.lower() != "accept-encoding")
    how = await negotiated(rec, (*headers, ("accept-encoding", "identity")))
    if isinstance(how, negotiation.Decline):
        return None, how.reason
    content_type = next((v for k, v in how.headers if k.lower() == "content-type"), "")
    if not content_type.lower().startswith("text/event-stream"):
        return None, "not an event stream"
    frames = ws.frames_of_recording(how.body[:MAX_GUARDED_BODY])
    return (frames, None) if frames is not None else (None, "events not readable as frames")


def _end_facts(attempt: "Attempt", events: ws.ResponseEvents,
               request_headers: tuple[tuple[str, str], ...], error: str | None,
               client_gone: bool) -> EndFacts:
    """What a call's response was, in the terms of an HTTP attempt's end: an ``error`` event
    with a 4xx status before any output is a rejection (the call did not run); otherwise the
    socket's 101 stands for a 2xx, and only events that carry output count as events."""
    before_output = events.output_seen == 0
    failed_event = events.terminal_type if events.terminal == "failure" and before_output else None
    status = 200
    if failed_event == "error" and events.error_status is not None \
            and 400 <= events.error_status < 500:
        status = events.error_status
    return EndFacts(
        kind=attempt.kind, status=status, events_seen=events.output_seen,
        terminal=events.terminal, counts_events=True, body_complete=events.ended,
        kept_body=events.sse_body, over_cap=events.over_cap, response_headers=ws.SSE_HEADERS,
        request_headers=request_headers, error=error, cut_reason=attempt.cut_reason,
        client_gone=client_gone, transport="ws", failed_event=failed_event,
        not_recordable="an upstream frame inside the response is no Responses event"
        if events.unreadable else None,
    )

