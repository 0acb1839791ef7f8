"""Detached dispatches (``turnguard_detach_ms``): a guarded HTTP request's upstream call runs on
a connection turnguard owns, so that it outlives its client.

mitmproxy closes a flow's server connection with its client's connection. For a detached
dispatch the request is copied into a flow of turnguard's own (its metadata says
``detached``), which mitmproxy's own client-replay handler runs (``ReplayHandler``: the same
upstream, TLS settings, HTTP/2 and addons as any flow, and the TLS server name the client's
flow would send, ``flows.server_name``; mitmweb shows it as a replay). That
flow is the attempt; the client's flow attaches to its live response through the relay, as a
duplicate does, from its first byte. When every client has left before the end, the call goes
on without one for ``turnguard_detach_ms``, so that a retry attaches to it (or, once it
completed, replays it) instead of running the turn again; a retry held waiting for it
(nothing streamed yet) counts as a client. Past that with nobody attached or waiting, or
when more than ``turnguard_detach_max`` calls would run without a client, it is cut. A
once-mode recovery dispatch runs detached whatever ``turnguard_detach_ms`` says (at least
``RECOVERY_WINDOW_S`` without a client): it is the one dispatch for every request held on it.
``upstream_detached`` says, when such a call ends, how long it ran without a client, whether
it was used (a retry came for it meanwhile: it attached, or waited for its end to replay it)
and how it ended.

The mitmproxy internals used (``ReplayHandler``, the server name its context's server gets,
cutting its server connection) are named here and in ``turnguard_core.proxy_internals``, and
checked by ``tests/test_proxy_internals``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from mitmproxy import ctx, http
from mitmproxy.addons.clientplayback import ReplayHandler

from turnguard_core.live import LiveResponse
from turnguard_core.proxy_internals import cut_handler_upstream, set_replay_server_name

from . import flows
from .inflight import STALL_GRACE_S, STALL_GRACES, STALL_LATE_S

logger = logging.getLogger("turnguard")

MARK_DETACHED = ":satellite:"
AWAITED_RECHECK_S = 0.5  # a call without a client that a held retry waits for: checked again
RECOVERY_WINDOW_S = 10.0  # a once-mode recovery goes on this long at least without a client
CUT_AGAIN_S = 0.05  # a cut before the call's server connection opened: tried again so often,
CUT_TRIES = 40  # this many times (2 s)
# a WebSocket handshake's headers that the same call sent as an HTTP POST does not carry
_HANDSHAKE_ONLY = ("upgrade", "connection", "sec-websocket-key", "sec-websocket-version",
                   "sec-websocket-extensions", "sec-websocket-protocol", "openai-beta",
                   "content-length", "transfer-encoding", "accept", "accept-encoding",
                   "content-type")


class _ListenerOptions:
    """``options`` as the listener ``flow`` came in on sees them: its own mode first.
    mitmproxy's ``ReplayHandler`` takes the upstream proxy (and upstream mode) from
    ``options.mode[0]``, the first listener's, so with several ``--mode`` a call of a reverse
    or regular listener would go through the first one's upstream proxy, and a call of an
    ``upstream:`` listener after the first straight to the origin: not the upstream its
    identity names. Every other option is read from ``options``."""

    def __init__(self, options, flow: http.HTTPFlow):
        self._options = options
        mode = getattr(flow.client_conn, "proxy_mode", None)
        spec = getattr(mode, "full_spec", None)
        self.mode = [spec] if isinstance(spec, str) else options.mode

    def __getattr__(self, name: str):
        return getattr(self._options, name)


@dataclass
class Detached:
    """One detached upstream call: ``up`` is turnguard's flow that runs it."""

    up: http.HTTPFlow
    client_flow_id: str
    base: dict
    live: LiveResponse
    handler: ReplayHandler | None = None
    task: asyncio.Task | None = None
    orphan_since: float | None = None  # monotonic; set while no client is attached
    orphan_total_s: float = 0.0
    attached_at_orphan: int = 0
    used: bool = False
    ever_orphaned: bool = False
    window_s: float = 0.0  # how long it goes on without a client
    cut_reason: str | None = None
    timer: asyncio.TimerHandle | None = None


def why_not_detached(flow: http.HTTPFlow) -> str | None:
    """Why ``flow`` (a request, or a WebSocket whose call is dispatched) cannot be dispatched
    detached (None: it can)."""
    if flow.websocket is None and flow.request.raw_content is None:
        return "its body is streamed"
    if flow.server_conn.via is not None:
        return "sent through an upstream proxy (the relay cannot stand in for it)"
    if flow.websocket is not None and flow.request.headers.get("sec-websocket-protocol"):
        return "its socket's subprotocol may be its credential, which a POST cannot carry"
    return None


class Detacher:
    def __init__(self, calls: dict, emit: Callable[..., None], explainer, settings,
                 awaited: Callable[[str], bool] = lambda up_id: False):
        """``awaited(up_id)``: a duplicate (a retry) is held waiting for that call now."""
        self._calls: dict[str, Detached] = calls  # up flow id -> Detached (the process's)
        self._emit = emit
        self._explainer = explainer
        self._settings = settings
        self._awaited = awaited

    def __len__(self) -> int:
        return len(self._calls)

    def without_client(self) -> int:
        """Detached calls running without any client now (one a retry attached to since its
        client left has one again: it ends its time without one first)."""
        for d in self._calls.values():
            self._refresh(d)
        return sum(1 for d in self._calls.values() if d.orphan_since is not None)

    def _refresh(self, d: Detached) -> None:
        """A call without a client that a retry attached to since has a client again: its
        time without one ends and its window is dropped (the retry's leaving, which
        ``listener_left`` hears, starts another). Not so for a retry held waiting for it:
        one that never attaches is not heard leaving, so that call keeps its window (which
        counts such a retry as its client when it ends)."""
        if d.orphan_since is not None and d.live.end is None and d.live.listeners > 0:
            if d.timer is not None:
                d.timer.cancel()
                d.timer = None
            self._back(d)

    def prepare(self, flow: http.HTTPFlow, base: dict, *, recovery: bool = False
                ) -> tuple[http.HTTPFlow, LiveResponse]:
        """The flow that will run ``flow``'s upstream call, and the live response its client
        (and any duplicate) attaches to. ``start`` then runs it (once it is registered as the
        operation's attempt). ``recovery``: a once-mode recovery, which goes on without a
        client at least ``RECOVERY_WINDOW_S`` (its one dispatch is for every holder)."""
        return self._register(flow.copy(), flow.id, base, recovery)

    def prepare_call(self, ws_flow: http.HTTPFlow, key: str, body: bytes,
                     base: dict) -> tuple[http.HTTPFlow, LiveResponse]:
        """``prepare`` for a call on the WebSocket ``ws_flow`` (``key``): the call goes upstream
        as the HTTP POST Codex falls back to (the same path and headers, without the
        handshake's; ``body`` is the call without its WebSocket-only fields), asking for an
        uncompressed event stream, whose events the socket then gets as frames."""
        up = ws_flow.copy()
        up.websocket = None
        req = up.request
        req.method = "POST"
        for name in _HANDSHAKE_ONLY:
            if name in req.headers:
                del req.headers[name]
        req.headers["content-type"] = "application/json"
        req.headers["accept"] = "text/event-stream"
        req.headers["accept-encoding"] = "identity"
        req.content = body
        return self._register(up, key, base, False)

    def _register(self, up: http.HTTPFlow, client: str, base: dict,
                  recovery: bool) -> tuple[http.HTTPFlow, LiveResponse]:
        up.response = None
        up.error = None
        up.is_replay = "request"
        up.metadata = {}
        live = LiveResponse("http", max_bytes=self._settings().replay_max_bytes)
        self._calls[up.id] = Detached(up, client, {**base, "flow": client}, live,
                                      window_s=RECOVERY_WINDOW_S if recovery else 0.0)
        return up, live

    def start(self, up: http.HTTPFlow) -> None:
        """Run the call on mitmproxy's replay handler (its hooks come to the addon as any
        flow's; the request hook passes it over)."""
        d = self._calls[up.id]
        up.metadata.setdefault("turnguard", {})["detached"] = d.client_flow_id
        self._explainer.show(up, MARK_DETACHED, "turnguard: the upstream call of flow "
                             f"{d.client_flow_id}, detached from its client (it goes on "
                             "without one for turnguard_detach_ms)")
        d.handler = ReplayHandler(up, _ListenerOptions(ctx.options, up))
        if up.request.scheme == "https":
            why_not = set_replay_server_name(d.handler, flows.server_name(up))
            if why_not is not None:
                logger.warning("turnguard: the detached call of %s goes with mitmproxy's "
                               "server name (%s)", d.client_flow_id, why_not)
        d.task = asyncio.get_running_loop().create_task(d.handler.replay())
        d.task.add_done_callback(lambda t: _log_failure(t, up.id))

    def listener_left(self, live: LiveResponse) -> None:
        """A client or duplicate attached to ``live`` left (or got its answer): a detached
        call without any client starts its window (again, when a retry attached since the
        last one started and has left too: each window counts from the last client gone), or
        is cut at once past the cap (``enforce_cap``)."""
        d = next((d for d in self._calls.values() if d.live is live), None)
        if d is None or live.end is not None or live.listeners > 0:
            return
        if d.orphan_since is not None:
            if live.attached_total == d.attached_at_orphan:
                return  # nobody came since this window started
            if d.timer is not None:
                d.timer.cancel()
                d.timer = None
            self._back(d)
        settings = self._settings()
        d.orphan_since, d.ever_orphaned = time.monotonic(), True
        d.attached_at_orphan = live.attached_total
        self._arm_window(d, max(d.window_s, settings.detach_s))
        self.enforce_cap()  # (this call first, the last to lose its client)

    def enforce_cap(self) -> None:
        """Cut the calls running without a client or a retry waiting for them past
        ``turnguard_detach_max`` of them, the last to lose its client first. A call a retry
        still waits for counts as one with a client, never toward the cap (its window, which
        counts that retry when it ends, decides). Called when a client leaves a call
        (``listener_left``) and when a held retry is let go (one kept a call from its cut)."""
        self.without_client()  # (brought up to date: a call a retry attached to has a client)
        alone = sorted((d for d in self._calls.values()
                        if d.orphan_since is not None and d.cut_reason is None
                        and d.live.end is None and d.live.listeners == 0
                        and not self._awaited(d.up.id)),
                       key=lambda d: d.orphan_since, reverse=True)
        for d in alone[:max(0, len(alone) - self._settings().detach_max)]:
            if d.timer is not None:
                d.timer.cancel()
                d.timer = None
            self._cut(d, "turnguard_detach_max")

    def wanted(self, up_id: str) -> None:
        """A duplicate (a retry) of the call came: if it runs without a client, it is used."""
        d = self._calls.get(up_id)
        if d is not None and d.orphan_since is not None:
            d.used = True

    def _arm_window(self, d: Detached, after_s: float, graces: int = STALL_GRACES) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + after_s
        d.timer = loop.call_later(after_s, lambda: self._window_over(d, due, graces))

    def _window_over(self, d: Detached, due: float | None = None, graces: int = 0) -> None:
        d.timer = None
        if d.live.end is not None:
            return
        if due is not None and graces > 0 \
                and asyncio.get_running_loop().time() - due > STALL_LATE_S:
            # this process stalled past the window's end (paused, blocked): a retry that came
            # meanwhile may be unread yet; let the loop read it before the call is cut
            self._arm_window(d, STALL_GRACE_S, graces - 1)
            return
        if d.live.listeners > 0:  # a retry attached meanwhile: it has a client again
            self._back(d)
            return
        if self._awaited(d.up.id):  # a retry waits for it (to attach once it streams): a
            d.used = True          # client too; the window starts again when it is gone
            self._arm_window(d, max(d.window_s, self._settings().detach_s, AWAITED_RECHECK_S))
            return
        self._cut(d, "no client within turnguard_detach_ms")

    def _back(self, d: Detached) -> None:
        if d.orphan_since is not None:
            d.orphan_total_s += time.monotonic() - d.orphan_since
            d.orphan_since = None
        d.used = d.used or d.live.attached_total > d.attached_at_orphan

    def _cut(self, d: Detached, reason: str) -> None:
        d.cut_reason = reason
        d.up.metadata.setdefault("turnguard", {})["detached_cut"] = reason
        logger.info("turnguard: cut the detached upstream call of %s (%s)", d.client_flow_id,
                    reason)
        self._cut_upstream(d, reason, CUT_TRIES)

    def _cut_upstream(self, d: Detached, reason: str, tries: int) -> None:
        """Cut the call's upstream connection. One not open yet (its client left within
        milliseconds of the decision) has its task cancelled, and the cut is tried again
        every ``CUT_AGAIN_S`` while the call runs (at most ``tries`` times more): a
        connection mitmproxy was opening meanwhile carries the call on otherwise."""
        why_not = cut_handler_upstream(d.handler, d.up.server_conn, f"turnguard: {reason}") \
            if d.handler is not None else "not started"
        if why_not is None:
            return
        if d.task is not None and not d.task.done():
            d.task.cancel(f"turnguard: {reason}")  # before it has a server connection
        if tries > 0:
            asyncio.get_running_loop().call_later(
                CUT_AGAIN_S, lambda: self._calls.get(d.up.id) is d and d.live.end is None
                and self._cut_upstream(d, reason, tries - 1))

    def ended(self, up_id: str, outcome: str) -> None:
        """The call's attempt ended (``outcome``): forget it; say what it was worth."""
        d = self._calls.pop(up_id, None)
        if d is None:
            return
        if d.timer is not None:
            d.timer.cancel()
        if d.ever_orphaned:
            self._back(d)
            self._emit("upstream_detached", **d.base, attempt_flow=up_id,
                       ran_without_client_ms=round(d.orphan_total_s * 1000), used=d.used,
                       outcome=outcome, cut=d.cut_reason)


def _log_failure(task: asyncio.Task, up_id: str) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("turnguard: the detached call %s failed: %r", up_id, task.exception())
