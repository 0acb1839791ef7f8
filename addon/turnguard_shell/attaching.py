"""Live attach and detached dispatches on HTTP: which flow may take which live response, and
how a flow is answered from one (the relay) or runs detached (``detached``).

The machine decides *that* a duplicate attaches (``machine.Attach``); this module says whether
it *can* take the live response as it is, and does it. A WebSocket's calls attach in
``websocket`` (frames are injected, no relay).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from mitmproxy import http

from turnguard_core import identity, machine, negotiation, options, policy
from turnguard_core.live import LiveResponse
from turnguard_core.tee import recordable_headers

from . import flows
from .detached import Detacher, why_not_detached
from .inflight import InFlight
from .process import ProcessState
from .relay import Relay

logger = logging.getLogger("turnguard")


class Attacher:
    def __init__(self, process: ProcessState, inflight: InFlight, detacher: Detacher,
                 settings: Callable[[], options.Settings],
                 gone: Callable[[http.HTTPFlow], str | None] = lambda flow: None):
        """``gone(flow)``: why ``flow``'s client no longer wants an answer (None: it does;
        ``flows.ClientWatch.gone``)."""
        self._process = process
        self._inflight = inflight
        self._detacher = detacher
        self._settings = settings
        self._gone = gone
        self._relay_start: asyncio.Future | None = None

    def start_relay_early(self) -> None:
        """Start the relay now when the options may detach a dispatch (``turnguard_detach_ms``
        above 0, or a once-only recovery mode), rather than at the first such dispatch. Its
        start awaited there would come between the decision to dispatch and the attempt's
        registration in flight: a late ledger claim answering then would find no attempt and
        give the operation back while the turn runs. A relay that cannot start is logged; a
        dispatch then goes as it is, as before."""
        settings = self._settings()
        if settings.detach_s <= 0 and not policy.recovery_is_once(settings.recovery_mode):
            return
        if self._relay_start is not None and not self._relay_start.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (the addon loaded outside mitmproxy's)
            return
        self._relay_start = loop.create_task(self._relay())
        self._relay_start.add_done_callback(_log_relay_failure)

    def can_attach(self, flow: http.HTTPFlow, live: LiveResponse) -> bool:
        """Whether ``flow`` (a request, or a WebSocket whose call it is) can take ``live`` as
        it is: attach on (with replay), the whole response still kept and shareable, the same
        representation (``Vary`` and content coding, as for a replay), and, over HTTP, a
        destination the relay can stand in for (not through an upstream proxy). A call on a
        WebSocket takes a call's events, or an uncompressed event stream's as frames."""
        settings = self._settings()
        if not (settings.attach and settings.guard.replay) or not live.attachable \
                or not live.shareable:
            return False
        if flow.websocket is not None:
            return live.transport == "ws" or (live.head is not None and _plain_sse(live.head))
        if live.transport != "http" or live.head is None or flow.server_conn.via is not None:
            return False
        head = live.head
        return isinstance(negotiation.plan(head.headers, head.vary_key,
                                           flows.request_headers(flow)), negotiation.AsRecorded)

    async def ready_to_attach(self, flow: http.HTTPFlow, live: LiveResponse) -> bool:
        """``can_attach``, and what attaching needs is there: over HTTP, a response still
        streaming is relayed, so the relay must listen (started here if it is not). A relay
        that cannot start (out of descriptors...) is logged, and the duplicate waits on for
        the attempt's end, to be answered with its recording, rather than attaching."""
        if not self.can_attach(flow, live):
            return False
        if flow.websocket is not None or live.whole() is not None:
            return True
        try:
            await self._relay()
        except OSError as e:
            logger.warning("turnguard: relay unavailable (%s); %s waits for the end of the "
                           "attempt in flight instead of attaching to it", e, flow.id)
            return False
        return True

    async def attach(self, flow: http.HTTPFlow, ident: identity.Identity,
                     state: machine.Attach) -> None:
        """Answer ``flow`` live from the attempt it attached to, through the relay (started
        by ``ready_to_attach``); or, when that response is complete already (a burst of
        duplicates woken as it streamed), with its bytes at once, as a replay is (no relay
        connection)."""
        live = state.live
        body = live.whole()
        if body is not None:
            flows.replay(flow, ident.op_id, live.head.status,
                         recordable_headers(live.head.headers), body, how="attached")
            return
        relay = await self._relay()
        flow.metadata["turnguard"] = {"role": "attached", "op": ident.op_id,
                                      "attempt": state.attempt_id}
        relay.route(flow, live, lambda end, sent: self._ended(flow, live, end, sent))

    async def dispatch_detached(self, flow: http.HTTPFlow, ident: identity.Identity,
                                req: machine.RequestFacts, dispatch: policy.Dispatch,
                                scope: str) -> bool:
        """Dispatch ``flow`` as a detached call when ``turnguard_detach_ms`` asks for it, and
        always a once-only recovery (its client attaches to it through the relay; the other
        requests held on it keep it going if that client leaves, instead of its one dispatch
        being cut and spent); False when the flow is to be dispatched as it is (off, not
        detachable, or no relay)."""
        settings = self._settings()
        once = dispatch.kind == "recovery" and policy.recovery_is_once(settings.recovery_mode)
        if (settings.detach_s <= 0 and not once) or why_not_detached(flow) is not None:
            return False
        try:
            relay = await self._relay()
        except OSError as e:
            logger.warning("turnguard: relay unavailable (%s); %s dispatched as is", e, flow.id)
            return False
        up, live = self._detacher.prepare(flow, req.base, recovery=once)
        attempt = self._inflight.start(up, ident, dispatch, scope)
        attempt.live = live
        self._detacher.start(up)
        flow.metadata["turnguard"] = {"role": "attached", "op": ident.op_id,
                                      "attempt": dispatch.attempt_id, "detached": up.id}
        relay.route(flow, live, lambda end, sent: self._ended(flow, live, end, sent), own=True)
        self._let_go_if_gone(flow)
        return True

    def _let_go_if_gone(self, flow: http.HTTPFlow) -> None:
        """A detached call's client flow, just routed to the relay, whose client is gone
        already is killed: its ``error`` hook then drops the route as a client that left
        (``error``), so that the call starts its window now, or is cut past the cap.
        mitmproxy never tells of an HTTP/2 stream the client reset in the same read as the
        request's end (its connection layer forgets a stream h2 reports closed at its
        ``StreamEnded``, and ignores the ``StreamReset`` that follows): followed, the route
        was a listener of the call until the client's whole connection closed (and a route
        mitmproxy had not followed yet was kept until it expired, ``ROUTE_TTL_S``). (A
        duplicate so reset is let go from its hold at once: ``ClientWatch.gone``.)"""
        reason = self._gone(flow)
        if reason is not None and flow.killable:
            logger.info("turnguard: %s left before it was sent to the relay (%s)", flow.id,
                        reason)
            flow.kill()

    @staticmethod
    def responseheaders(flow: http.HTTPFlow) -> bool:
        """An attached flow's response (the relay's) starts: stream it live to the client and
        put the flow's destination back. False: not an attached flow.

        The relay's ``Connection: close`` is about the relay's own connection (one response
        each), not the client's: passed on, it would close a kept-alive client connection
        after every attached (or detached) answer, and lose a request the client pipelined
        behind it. It is dropped (an attached head never has the original's: it is
        hop-by-hop, not recorded); the relay still closes its connection after the response,
        and a body delimited by that close (an HTTP/1.0 client's) still closes the client's."""
        if (flow.metadata.get("turnguard") or {}).get("role") != "attached":
            return False
        flow.response.headers.pop("connection", None)
        flow.response.stream = True
        Relay.restore(flow)
        return True

    def error(self, flow: http.HTTPFlow) -> None:
        """An attached flow failed before its response (the relay's) started (its client
        left, a kill): its route is dropped, which ends it as a client that left (a detached
        call's window starts now, not when an unused route expires); and its destination is
        put back all the same, and the relay's token dropped, for what mitmweb shows, a saved
        flow says and a replay of it sends (the upstream, not the relay)."""
        if (flow.metadata.get("turnguard") or {}).get("role") == "attached":
            if self._process.relay is not None:
                self._process.relay.abandon(flow)
            Relay.restore(flow)

    def _ended(self, flow: http.HTTPFlow, live: LiveResponse, end: str | None,
               sent: int) -> None:
        logger.debug("turnguard: attached flow %s ended (%s, %d bytes)", flow.id,
                     end or "client left", sent)
        self._detacher.listener_left(live)

    async def _relay(self) -> Relay:
        relay = self._process.relay
        if relay is None:
            relay = self._process.relay = Relay()
        await relay.ensure_started()
        return relay


def _log_relay_failure(started: asyncio.Future) -> None:
    if not started.cancelled() and started.exception() is not None:
        logger.warning("turnguard: relay unavailable (%s); detached dispatches go as they are "
                       "until it starts", started.exception())


def _plain_sse(head) -> bool:
    """Whether a response is an uncompressed event stream (its events can become frames)."""
    headers = {k.lower(): v for k, v in head.headers}
    return headers.get("content-type", "").startswith("text/event-stream") and \
        headers.get("content-encoding", "identity").strip().lower() in ("", "identity")
