"""This process's attempts in flight: dispatched upstream, until their end is recorded.

An attempt is registered when a request is forwarded upstream (``start``); its response goes
through a tee that counts events and keeps a bounded copy (``tee_response``); a timer cuts the
upstream when no response event arrives in time (``turnguard_response_created_timeout_ms``);
and its end (``end``, from the response or error hook) is classified (``ending``), recorded
(``FailoverStore.finish``) and wakes the attempt's held duplicates. The registry itself (by
flow and by operation) lives in ``ProcessState``, so a script reload hands it over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from mitmproxy import http
from mitmproxy.flow import Error

from turnguard_core import identity, negotiation, options, policy
from turnguard_core.ending import EndFacts, classify_end, end_telemetry
from turnguard_core.failover import FailoverStore
from turnguard_core.ledger import AttemptEnd
from turnguard_core.live import Head, LiveResponse
from turnguard_core.machine import Ended
from turnguard_core.proxy_internals import (
    H2_RESET_MESSAGE,
    cut_handler_upstream,
    cut_http2_stream,
    cut_upstream,
    release_killed_intercepted,
    stream_not_sent,
    stream_reset_by_upstream,
)
from turnguard_core.tee import ResponseTee, coded_stream_events
from turnguard_core.ws import ResponseEvents

from . import flows
from .deadlines import Deadline, Deadlines
from .process import ProcessState
from .waiters import Waiters

logger = logging.getLogger("turnguard")

FIRST_EVENT_DELAY_S = 0.1  # a stream's first event is recorded this late, unless it ended
MARK_CUT = ":scissors:"
MISSING_RESPONSE_CREATED = "missing_response_created_timeout"
# The response-created timer fired this much past its due time: the event loop itself stalled
# (the process was paused, or blocked), and what the upstream sent meanwhile may sit unread in
# the socket. The timer is given STALL_GRACE_S more to read it before it cuts anything, at
# most STALL_GRACES times (a loop that keeps stalling does not keep the upstream forever).
STALL_LATE_S = 0.25
STALL_GRACE_S = 0.5
STALL_GRACES = 3
# A dispatch is looked at this long after it is registered, and again as often while it has
# not gone upstream (in a later addon's request hook, or queued behind an HTTP/2 upstream's
# stream limit): its full timeout runs from the first look that finds it sent.
UNSENT_LOOK_S = 0.25


@dataclass
class Attempt:
    """A guarded flow this process dispatched upstream, until its outcome is recorded."""

    flow_id: str
    ident: identity.Identity
    attempt_id: int | None  # None when the ledger was unavailable
    generation: str  # of the ledger file that holds attempt_id
    kind: str
    started: float
    circuit_scope: str
    method: str
    route: str  # as the ledger stores it
    transport: str = "http"
    status: int | None = None
    tee: ResponseTee | None = None
    ws_events: ResponseEvents | None = None  # a WebSocket call's response, read as it passes
    cut_reason: str | None = None  # set when turnguard cut the upstream itself
    first_event_at: float | None = None  # monotonic time of the first response event
    timer: Deadline | None = None  # response_created timeout
    live: LiveResponse | None = None  # its response as it arrives, for duplicates to attach
    first_event_timer: Deadline | None = None  # records the first event, if still on
    look: Deadline | None = None  # the next look whether it went upstream (``_look_unsent``)
    flow: http.HTTPFlow | None = field(default=None, repr=False)  # its flow (HTTP), or socket's
    sent_as: tuple | None = field(default=None, repr=False)  # its request when dispatched
    edited: bool = False  # a user edited its request after it was identified
    credentials_changed: bool = False  # it went upstream as another principal's
    answered_here: bool = False  # an addon answered it: nothing went upstream
    unsent: bool = False  # a look found it not sent upstream yet (``_not_sent_yet``)

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    @property
    def events_seen(self) -> int:
        if self.ws_events is not None:
            return self.ws_events.events_seen
        return self.tee.events_seen if self.tee is not None else 0

    @property
    def base(self) -> dict:
        return {"op": self.ident.op_id, "flow": self.flow_id, "session": self.ident.session,
                "transport": self.transport}


class InFlight:
    def __init__(
        self, process: ProcessState, store: FailoverStore, waiters: Waiters,
        explainer: flows.Explainer, emit: Callable[..., None],
        settings: Callable[[], options.Settings],
    ):
        self._process = process
        self._store = store
        self._waiters = waiters
        self._explainer = explainer
        self._emit = emit
        self._settings = settings
        # the three timers of a dispatch, each of one delay (deadlines.py: one asyncio timer
        # for each kind, not one a request)
        self._cuts = Deadlines()  # response_created timeouts
        self._looks = Deadlines()  # whether a dispatch went upstream yet (UNSENT_LOOK_S)
        self._first_events = Deadlines()  # a first event's record (FIRST_EVENT_DELAY_S)

    def _current(self) -> "InFlight":
        """The registry of the addon instance that gets the hooks now (another one after a
        script reload): callbacks of a flow in flight go there."""
        guard = self._process.guard
        return guard.inflight if guard is not None else self

    def __len__(self) -> int:
        return len(self._process.attempts)

    def __iter__(self):
        return iter(list(self._process.attempts.values()))

    def of_operation(self, op_key: str) -> Attempt | None:
        flow_id = self._process.by_op.get(op_key)
        return None if flow_id is None else self._process.attempts.get(flow_id)

    def attempt(self, key: str) -> Attempt | None:
        """The attempt in flight of the flow (or WebSocket call) ``key``."""
        return self._process.attempts.get(key)

    def is_local(self, op_key: str) -> bool:
        return op_key in self._process.by_op

    def start(
        self, flow: http.HTTPFlow, ident: identity.Identity, dispatch: policy.Dispatch,
        circuit_scope: str, *, key: str | None = None, ws_events: ResponseEvents | None = None,
    ) -> Attempt:
        """Register the dispatch as this process's attempt of its operation: the flow's
        request (HTTP), or (``ws_events`` given) the call ``key`` on the WebSocket ``flow``."""
        key = key or flow.id
        generation = self._store.generation if dispatch.attempt_id is not None else ""
        attempt = Attempt(key, ident, dispatch.attempt_id, generation, dispatch.kind,
                          time.monotonic(), circuit_scope, "POST" if ws_events else
                          flow.request.method, ident.route,
                          transport="ws" if ws_events else "http", ws_events=ws_events,
                          flow=flow)
        settings = self._settings()
        if ws_events is not None and settings.attach and settings.guard.replay:
            attempt.live = LiveResponse("ws", max_bytes=settings.replay_max_bytes)
        self._process.attempts[key] = attempt
        self._process.by_op[ident.op_key] = key
        if ws_events is None:
            attempt.sent_as = _request_as_is(flow)
            flow.metadata["turnguard"] = {"role": "dispatch", "op": ident.op_id,
                                          "attempt": dispatch.attempt_id, "kind": dispatch.kind}
        timeout_s = self._settings().response_created_timeout_s
        if timeout_s > 0:
            self._arm_cut(attempt, key, flow, timeout_s, STALL_GRACES)
            if ws_events is None:  # one that goes upstream late is timed from then on
                self._look_later(attempt, key, flow)
        return attempt

    def _arm_cut(self, attempt: Attempt, key: str, flow: http.HTTPFlow, after_s: float,
                 graces: int) -> None:
        due = asyncio.get_running_loop().time() + after_s
        attempt.timer = self._cuts.call_later(
            after_s, lambda: self._current()._cut_if_silent(key, flow, due, graces))

    def _time_again(self, attempt: Attempt, key: str, flow: http.HTTPFlow) -> None:
        """Time the attempt's silence again from now, for the whole timeout."""
        self._arm_cut(attempt, key, flow, self._settings().response_created_timeout_s,
                      STALL_GRACES)

    def _cut_if_silent(self, key: str, flow: http.HTTPFlow, due: float | None = None,
                       graces: int = 0) -> None:
        """No response event in time: cut the upstream; its end records ``unknown``. A timer
        that fires late (this process stalled: its own pause is no silence of the upstream)
        first lets the loop read what arrived meanwhile."""
        attempt = self._process.attempts.get(key)
        if attempt is None or attempt.events_seen > 0:
            return
        attempt.timer = None
        if _tee_bypassed(flow, attempt):
            # another addon streams the body through its own filter: its events pass unseen,
            # so no silence can be told (never cut a stream turnguard cannot read)
            self._emit("passthrough", **attempt.base, reason=STREAM_TAKEN_OVER)
            return
        if attempt.transport == "http" and (getattr(attempt, "unsent", False)
                                             or self._not_sent_yet(key, flow)):
            # not sent upstream yet (see ``_not_sent_yet``), so no silence of the upstream:
            # its looks (``_look_unsent``) time it in full from the first that finds it sent
            if not getattr(attempt, "unsent", False):
                attempt.unsent = True
                self._look_later(attempt, key, flow)
            self._time_again(attempt, key, flow)
            return
        if attempt.transport == "http" and flow.intercepted:
            # held by a user (mitmweb's intercept comes after turnguard's request hook): not
            # sent upstream yet, so no silence of the upstream; timed again from now on
            self._time_again(attempt, key, flow)
            return
        if attempt.transport == "http" and attempt.tee is None and flow.response is not None \
                and not attempt.answered_here:
            # its response headers came, but turnguard's responseheaders hook has not (an
            # addon before it still in its own, or one that halted it: mitmproxy then reads
            # the body whole, unseen): its events cannot be counted, so no silence can be
            # told; timed again from now on, and read whole at its end
            self._time_again(attempt, key, flow)
            return
        if due is not None and graces > 0 \
                and asyncio.get_running_loop().time() - due > STALL_LATE_S:
            self._arm_cut(attempt, key, flow, STALL_GRACE_S, graces - 1)
            return
        sock = self._process.sockets.get(flow.id) if attempt.transport == "ws" else None
        if sock is not None and self._process.guard is not None:
            self._process.guard.websockets.drop_unsent(sock)  # (never sent: not silent)
            if key not in self._process.attempts:
                return
        if sock is not None and sock.unread_upstream():
            if self._process.guard is None:
                return  # no instance loaded to read its events: the next one does (not silent)
            # events that reached the client, not turnguard's hook (an addon before it halted
            # it): read now, so that they count
            self._process.guard.websockets.read_unread_upstream(sock)
            if attempt.events_seen > 0 or key not in self._process.attempts:
                return
        attempt.cut_reason = MISSING_RESPONSE_CREATED
        reason = f"turnguard: {MISSING_RESPONSE_CREATED}"
        stream_cut = False
        if key in self._process.detached:  # turnguard's own call: cut on its replay handler
            why_not = cut_detached(self._process.detached, key, reason)
        elif flow.server_conn.alpn == b"h2":  # shared with other streams: this one alone
            why_not = cut_http2_stream(flows.proxyserver(), flow, reason)
            stream_cut = why_not is None
            if not stream_cut:
                logger.warning("turnguard: could not reset the HTTP/2 stream of %s (%s): its "
                               "whole upstream connection is cut", flow.id, why_not)
                why_not = cut_upstream(flows.proxyserver(), flow.client_conn.id,
                                       flow.server_conn, reason)
        else:
            why_not = cut_upstream(flows.proxyserver(), flow.client_conn.id, flow.server_conn,
                                   reason)
        after_ms = round(self._settings().response_created_timeout_s * 1000)
        self._emit("upstream_cut", **attempt.base, reason=MISSING_RESPONSE_CREATED,
                   after_ms=after_ms, headers_seen=attempt.status is not None,
                   cut=why_not is None, why_not=why_not)
        if why_not is not None:
            # nothing was cut: its end is what the upstream does, and it is timed again (a
            # cut that cannot be made now may be made later; at worst tried each timeout)
            attempt.cut_reason = None
            self._time_again(attempt, key, flow)
            logger.warning("turnguard: could not cut the upstream of %s (%s); timed again",
                           flow.id, why_not)
        else:
            what = "reset its HTTP/2 stream" if stream_cut else "cut the upstream connection"
            self._explainer.show(flow, MARK_CUT, f"turnguard: no response event within {after_ms}"
                                 f" ms ({MISSING_RESPONSE_CREATED}); {what}")

    def _not_sent_yet(self, key: str, flow: http.HTTPFlow) -> bool:
        """Whether the dispatch ``key`` (its flow, or its detached call's) has not gone
        upstream yet (``stream_not_sent``): still in its ``request`` hook (an addon after
        turnguard keeps it in its own, or a user's intercept), or queued by mitmproxy behind
        its HTTP/2 upstream's stream limit (``MAX_CONCURRENT_STREAMS`` streams open). Either
        way a cut now would act only once it is sent: its client answered 502 and its end
        recorded as a cut, while the upstream runs it."""
        if key in self._process.detached:  # (the process's: read with no instance loaded too)
            handler = self._process.detached[key].handler
            if handler is None:
                return False
            proxyserver = None
        else:
            handler, proxyserver = None, flows.proxyserver()
        return bool(stream_not_sent(proxyserver, flow, handler))

    def _look_later(self, attempt: Attempt, key: str, flow: http.HTTPFlow) -> None:
        # cancelled when the attempt ends: the look keeps its flow, and a flow kept this
        # long outlives the garbage collector's young generations, so every request's
        # objects would be left for its full collections to find (much slower ones)
        attempt.look = self._looks.call_later(
            UNSENT_LOOK_S, lambda: self._current()._look_unsent(key, flow))

    def _look_unsent(self, key: str, flow: http.HTTPFlow) -> None:
        """Look whether the dispatch ``key`` went upstream yet (``_not_sent_yet``): while it
        has not, again every ``UNSENT_LOOK_S``; at the first look that finds it sent (after
        one that did not), its response-created timeout starts again in full."""
        attempt = self._process.attempts.get(key)
        if attempt is None or attempt.events_seen > 0 or attempt.cut_reason is not None:
            return
        if self._not_sent_yet(key, flow):
            attempt.unsent = True
            self._look_later(attempt, key, flow)
            return
        if getattr(attempt, "unsent", False):
            attempt.unsent = False
            if attempt.timer is not None:  # (still timed)
                attempt.stop_timer()
                self._time_again(attempt, key, flow)

    def release_killed(self) -> None:
        """Attempts whose flow was killed while intercepted (mitmweb's intercept runs after
        turnguard's request hook, so a flow it intercepts is already this process's attempt):
        mitmproxy never lets such a flow go on (``release_killed_intercepted``), so it would
        never go upstream, never reach the error hook, and keep its operation in flight for
        as long as the process lives (every retry held, then answered 409). Let it go on to
        its kill: its error hook ends the attempt, and its client's connection is closed."""
        for attempt in list(self._process.attempts.values()):
            flow = attempt.flow
            if attempt.transport != "http" or flow is None or flow.error is None \
                    or flow.error.msg != Error.KILLED_MESSAGE:
                continue
            if release_killed_intercepted(flow):
                logger.info("turnguard: %s was killed while intercepted; it goes on to its "
                            "kill (nothing was sent upstream)", flow.id)

    def tee_response(self, flow: http.HTTPFlow, *, read_later: bool = False) -> None:
        """The response headers of an attempt arrived: stream its body through a tee.
        ``read_later``: the upstream's response, whole, whose hooks went by while no addon
        instance was loaded (``end_those_ended_unseen``): its body is read by the caller."""
        attempt = self._process.attempts.get(flow.id)
        if attempt is None or flow.response is None:
            return
        resp = flow.response
        attempt.status = resp.status_code
        if (resp.raw_content is not None or flow.is_replay == "response") and not read_later:
            # Its body is here with its headers: an addon that runs after turnguard made it in
            # its ``request`` hook (``map_local``, ``server_replay``, a script; mitmproxy then
            # calls this hook itself) and nothing went upstream. It answers this request only:
            # no tee, so it is never recorded, attached to or replayed (its end reads it whole,
            # keeping nothing). ``server_replay`` marks its answers (``is_replay``): one from a
            # flow saved without its body (streamed, as turnguard streams every response it
            # guards) has none, and is still no upstream's response (no eventless failure).
            attempt.stop_timer()
            attempt.answered_here = True
            return
        encoding = flows.header(resp.headers, b"content-encoding", "identity").strip().lower()
        is_sse = flows.header(resp.headers, b"content-type", "").lower().startswith(
            "text/event-stream")
        ok = 200 <= resp.status_code < 300
        counts_events = is_sse and encoding in ("", "identity") and ok
        if is_sse and encoding not in ("", "identity"):
            self._emit("passthrough", op=attempt.ident.op_id, flow=flow.id,
                       session=attempt.ident.session, transport="http",
                       reason=f"response content-encoding {encoding}: events not counted")
        if not (is_sse and ok):
            attempt.stop_timer()  # an answer that is not an event stream is its own event
        # (a content-coded event stream's events are not counted: its first byte stops the
        # timer, and one silent after its headers is cut as an uncoded one is)
        settings = self._settings()
        attempt.edited = _edited_since(flow, attempt.sent_as)
        attempt.credentials_changed = _credentials_changed(flow, attempt)
        keep = settings.replay_max_bytes if settings.guard.replay and ok \
            and not attempt.edited and not attempt.credentials_changed else 0
        shareable = settings.attach and settings.guard.replay and is_sse and ok \
            and not attempt.edited and not attempt.credentials_changed
        if attempt.live is not None:  # a detached call: its client is attached already
            head = _head(flow)
            attempt.live.shareable = shareable and head is not None
            attempt.live.start(head or Head(resp.status_code, flows.response_headers(flow), None))
        elif shareable:
            head = _head(flow)
            if head is not None:
                attempt.live = LiveResponse("http", max_bytes=settings.replay_max_bytes)
                attempt.live.start(head)
        attempt.tee = ResponseTee(
            counts_events=counts_events, keep_max_bytes=keep,
            on_first_event=lambda: self._current()._first_event(attempt),
            live=attempt.live,
            # a content-coded event stream: its events are not counted, its first byte
            # starts it (duplicates with its representation attach from then on)
            on_first_chunk=(lambda: self._current()._coded_started(attempt))
            if is_sse and ok and not counts_events else None,
        )
        if not callable(resp.stream):
            resp.stream = attempt.tee
        # else an addon that runs before turnguard streams the body through its own filter
        # (``_tee_bypassed``): kept, as what its client must get, and the tee sees none of it

    def _first_event(self, attempt: Attempt) -> None:
        """The attempt has output now. The ledger learns it a moment later, and not at all
        when the attempt ends first (its finish records the events): one transaction less
        for short responses; a crash within that moment records ``unknown``, not ``partial``."""
        attempt.stop_timer()
        attempt.first_event_at = time.monotonic()
        self._streaming(attempt)
        if attempt.attempt_id is not None and attempt.first_event_timer is None:
            attempt.first_event_timer = self._first_events.call_later(
                FIRST_EVENT_DELAY_S, lambda: self._current()._record_first_event(attempt))

    def _coded_started(self, attempt: Attempt) -> None:
        """The first byte of an event stream the upstream sends content-coded: it has
        started (its events are not counted), so it is no longer silent."""
        attempt.stop_timer()
        self._streaming(attempt)

    def _streaming(self, attempt: Attempt) -> None:
        """The attempt's response streams: duplicates may attach to it from now on."""
        live = attempt.live
        if live is not None and not live.started:
            live.started = True
            if live.shareable:
                self._waiters.attempt_streaming(attempt.ident.op_key, live)

    def _record_first_event(self, attempt: Attempt) -> None:
        if attempt.flow_id in self._process.attempts:
            self._store.first_event(attempt)

    def ws_event(self, key: str, first_output: bool, text: str | None) -> None:
        """A WebSocket call's response sent an event (``text``; ``first_output``: its first
        event that carries output, which the ledger learns as for an HTTP stream's first
        event), or a frame that is none (``text`` None: a binary one, not relayed)."""
        attempt = self._process.attempts.get(key)
        if attempt is None:
            return
        attempt.stop_timer()
        if attempt.live is not None and text is not None:
            attempt.live.feed(text)
        if first_output:
            self._first_event(attempt)

    def end_those_ended_unseen(self) -> None:
        """End the HTTP attempts whose flow ended while no addon instance was loaded (a script
        reload that failed, until it is fixed): their response or error hook reached no one,
        and their operation would stay in flight for as long as the process runs (every retry
        held, then answered 409). Their response went through its tee all the same, or is read
        whole now when its responseheaders hook went by too."""
        for attempt in list(self._process.attempts.values()):
            flow = attempt.flow
            if attempt.transport != "http" or flow is None:
                continue
            if flow.error is not None and not flow.live:  # (not a note on a live flow)
                self.end(flow, body_complete=False)
            elif flow.response is not None and flow.response.timestamp_end is not None:
                self.end(flow, body_complete=True)  # (its body read whole if never teed)

    def end_those_whose_end_hook_was_halted(self) -> None:
        """End the HTTP attempts whose flow is over although turnguard's ``response`` or
        ``error`` hook never came: an addon that runs before turnguard raised ``AddonHalt``
        in that hook (mitmproxy's way for an addon to say no later addon handles the event).
        Their operation would stay in flight for as long as the process runs (every retry
        held, then answered 409; an attached duplicate streaming for ever). mitmproxy marks
        an HTTP flow no longer ``live`` only once its ``response`` or ``error`` hooks have all
        run, so an attempt whose flow is no longer live missed its own. A flow a user killed
        is not live from the kill on, before its ``error`` hook (``release_killed``): it is
        left to that hook. (The maintenance ticker calls this every second.)"""
        for attempt in list(self._process.attempts.values()):
            flow = attempt.flow
            if attempt.transport != "http" or flow is None or flow.live \
                    or flow.error is not None and flow.error.msg == Error.KILLED_MESSAGE:
                continue
            if flow.error is None and (flow.response is None
                                       or flow.response.timestamp_end is None):
                continue  # (not over: no end to record yet)
            logger.warning("turnguard: the %s hook of %s never reached turnguard (an addon "
                           "before it halted it); its end is recorded now",
                           "error" if flow.error is not None else "response", flow.id)
            self.end(flow, body_complete=flow.error is None)  # (read whole if never teed)

    def end(self, flow: http.HTTPFlow, *, body_complete: bool) -> asyncio.Future | None:
        """The attempt's response ended (or failed): record it and wake its duplicates.
        Returns the ledger write's future when it was sent now. A whole response whose
        ``responseheaders`` hook never reached turnguard (an addon before it raised
        ``AddonHalt`` there, or the hooks went by while no instance was loaded) was read
        whole by mitmproxy, never streamed: it is read through its tee now, as it would have
        been (it is the upstream's answer: recorded, replayed, never run again)."""
        attempt = self._process.attempts.get(flow.id)
        if body_complete and attempt is not None and attempt.tee is None \
                and not attempt.answered_here and flow.response is not None:
            self.tee_response(flow, read_later=True)
            if attempt.tee is not None:
                attempt.tee(flow.response.raw_content or b"")
        max_bytes = self._settings().replay_max_bytes
        return self.close(flow.id, lambda a: self._end_facts(flow, a, body_complete, max_bytes))

    def close(self, key: str, facts_of: Callable[[Attempt], EndFacts]) -> asyncio.Future | None:
        """End the attempt ``key`` with the facts ``facts_of`` it gives: record it and wake
        its duplicates. Returns the ledger write's future when it was sent now."""
        attempt = self._process.attempts.pop(key, None)
        if attempt is None:
            return None
        attempt.stop_timer()
        if attempt.first_event_timer is not None:  # its finish records the events: no wake-up
            attempt.first_event_timer.cancel()
        if attempt.look is not None:
            attempt.look.cancel()
        why, recorded, facts = Ended("unknown"), None, None
        try:
            facts = facts_of(attempt)
            why, recorded = self._record_end(attempt, facts)
        except Exception:
            logger.exception("turnguard: recording the outcome of %s failed", key)
        finally:
            if attempt.live is not None:  # attached duplicates end as its client did, or
                # cleanly once the stream's terminal success came (it completed upstream)
                complete = why.outcome == "completed" or (
                    facts is not None and facts.body_complete and facts.error is None)
                if facts is not None and facts.not_recordable == STREAM_TAKEN_OVER:
                    # its bytes went by unseen: a detached call's attached client, given
                    # none of them, is cut (it retries), never told the empty answer is whole
                    attempt.live.finish("failed", STREAM_TAKEN_OVER)
                else:
                    attempt.live.finish("complete" if complete else "failed",
                                        None if facts is None else facts.error)
            if key in self._process.detached and self._process.guard is not None:
                self._process.guard.detacher.ended(key, why.outcome)
            op_key = attempt.ident.op_key
            if self._process.by_op.get(op_key) == key:
                del self._process.by_op[op_key]
            # Held duplicates wake now: a recording is replayed from memory; anything else is
            # admitted again, and the ledger runs that after this attempt's finish.
            self._waiters.attempt_ended(op_key, why)
        return recorded

    def _record_end(
        self, attempt: Attempt, facts: EndFacts
    ) -> tuple[Ended, asyncio.Future | None]:
        settings = self._settings()
        if not settings.guard.replay and facts.kept_body is not None \
                and facts.not_recordable is None:
            # turnguard_replay switched off while it streamed (its tee kept the body as the
            # setting was then): no body is kept from now on, this one's included
            facts = dataclasses.replace(facts, not_recordable="replay off")
        # the names the attempt was identified under, and those in force now (the option may
        # have changed while it ran): a header either counts as a credential is not kept
        ending = classify_end(facts, (*attempt.ident.credential_names,
                                      *settings.credential_headers))
        duration_ms = round((time.monotonic() - attempt.started) * 1000)
        first_event_ms = (None if attempt.first_event_at is None
                          else round((attempt.first_event_at - attempt.started) * 1000, 1))
        for record in end_telemetry(ending, facts, attempt.base, attempt_id=attempt.attempt_id,
                                    duration_ms=duration_ms, first_event_ms=first_event_ms):
            self._emit(record.event, **record.fields)
        end = AttemptEnd(ending.outcome, facts.status, facts.events_seen, ending.record_detail,
                         ending.recording)
        recorded = self._store.finish(attempt, ending, end, now=time.time(),
                                      circuit_cfg=self._settings().circuit, base=attempt.base)
        return Ended(ending.outcome, ending.recording,
                     facts.error if ending.failure == "proxy_body_size_limit" else None), recorded

    @staticmethod
    def _end_facts(flow: http.HTTPFlow, attempt: Attempt, body_complete: bool,
                   max_bytes: int) -> EndFacts:
        """What the attempt's flow says of its end. A 2xx event stream the upstream sent
        content-coded passed uncounted: its kept body (whole, or as far as it came when its
        transport broke) is decoded now (at most ``max_bytes``, ``turnguard_replay_max_bytes``)
        and its events read, so that it completed exactly when a terminal success event came,
        as an uncoded one; one that cannot be read is not recorded."""
        tee = attempt.tee
        bypassed = _tee_bypassed(flow, attempt)
        if bypassed:  # nothing of the body passed through the tee: read as never teed
            tee = None
        if tee is not None and body_complete and not tee.ended:
            # the response hook comes once the whole body passed; mitmproxy never calls the
            # stream with its closing b"" for an empty body (Content-Length: 0)
            tee(b"")
        if tee is None and body_complete and flow.response is not None and not bypassed:
            # No streaming happened (e.g. another addon answered): read the whole body.
            tee = ResponseTee(counts_events=False, keep_max_bytes=0)
            tee(flow.response.raw_content or b"")
            tee(b"")
        resp = flow.response
        kept_body = tee.body if tee else None
        events_seen = tee.events_seen if tee else 0
        terminal = tee.terminal if tee else None
        counts_events = tee.counts_events if tee else False
        not_read = None
        coding = flows.header(resp.headers, b"content-encoding", "") if resp is not None else ""
        so_far = kept_body if kept_body is not None or tee is None else tee.kept_so_far()
        if (so_far is not None and not counts_events and coding.strip().lower()
                not in ("", "identity") and 200 <= resp.status_code < 300
                and resp.headers.get("content-type", "").lower().startswith("text/event-stream")):
            read = coded_stream_events(so_far, coding, max_bytes, whole=kept_body is not None)
            if read is None:
                not_read = f"content-coded event stream ({coding}) that cannot be read"
            else:
                (events_seen, terminal), counts_events = read, True
                if terminal == "success":  # whole, or cut after its terminal success event:
                    kept_body = so_far     # it completed upstream (as an uncoded stream)
        edited = attempt.edited or _edited_since(flow, attempt.sent_as)
        return EndFacts(
            kind=attempt.kind,
            status=resp.status_code if resp is not None else None,
            events_seen=events_seen,
            terminal=terminal,
            counts_events=counts_events,
            body_complete=body_complete and (tee is None or tee.ended),
            kept_body=kept_body,
            over_cap=bool(tee and tee.over_cap),
            response_headers=flows.response_headers(flow),
            request_headers=flows.request_headers(flow),
            error=_error_of(flow),
            cut_reason=attempt.cut_reason,
            client_gone=_client_gone(flow),
            never_sent=_killed_before_sent(flow),
            not_recordable="request edited after it was identified" if edited
            else CREDENTIALS_CHANGED if attempt.credentials_changed
            else "answered by an addon, not by the upstream" if attempt.answered_here
            else STREAM_TAKEN_OVER if bypassed
            else not_read,
        )


STREAM_TAKEN_OVER = "response body streamed by another addon, unseen by turnguard"


def cut_detached(calls: dict, up_id: str, reason: str) -> str | None:
    """Cut the upstream of the detached call ``up_id`` of ``calls`` (the process's
    ``detached``): on its replay handler, which is the process's, so that an instance need
    not be loaded (a script reload to a copy that fails to load leaves none, while the
    call's timeout still runs). Why not, if it cannot be cut."""
    d = calls.get(up_id)
    if d is None or d.handler is None:
        return "not a running detached call"
    return cut_handler_upstream(d.handler, d.up.server_conn, reason)


def _tee_bypassed(flow: http.HTTPFlow, attempt: Attempt) -> bool:
    """Whether another addon set ``flow.response.stream`` itself (one that runs after
    turnguard's ``responseheaders`` hook replaced the tee; one before it set its own filter,
    which ``tee_response`` keeps), so that the body goes to the client through its filter,
    never through the attempt's tee: turnguard then saw none of it (no events counted, no
    copy kept). Its end is read as a body turnguard cannot read (a whole 2xx body
    completes it), never recorded, attached to or replayed: an empty or partial copy is no
    answer of the upstream's."""
    resp = flow.response
    return attempt.tee is not None and resp is not None and resp.stream is not attempt.tee


def _request_as_is(flow: http.HTTPFlow) -> tuple:
    """What a request is now, to tell later whether it changed: its body and headers by
    identity (mitmproxy replaces the object on every change), the rest by value."""
    data = flow.request.data  # (its fields as stored: no property decodes them)
    return (data.content, data.headers.fields, data.method, data.scheme, data.host, data.port,
            data.path)


CREDENTIALS_CHANGED = "credentials changed after it was identified (an addon after turnguard)"


def _credentials_changed(flow: http.HTTPFlow, attempt: Attempt) -> bool:
    """Whether the request went upstream as another principal than it was identified as: an
    addon whose ``request`` hook runs after turnguard's, one turnguard cannot foresee (a
    script that sets ``Authorization`` by a header that is no part of the identity, say),
    changed its credentials. (Those mitmproxy's own addons add after turnguard,
    ``stickyauth`` and ``stickycookie``, were foreseen: ``flows._as_sent``.) Its response
    then answers that request only: never recorded for the operation nor attached to, or
    one principal's answer would go to another's requests."""
    if attempt.transport != "http" or flow.request is None:
        return False
    if attempt.sent_as is not None and flow.request.headers.fields is attempt.sent_as[1]:
        return False  # its headers untouched since it was identified (the usual case: cheap)
    try:
        view = flows._view(flow, flow.request.method, flows.request_headers(flow), None)
        if isinstance(view, identity.Passthrough):
            return True
        sent = identity.principal_of(view, attempt.ident.credential_names)
    except Exception:  # noqa: BLE001 - unsure: it answers its own request only
        logger.exception("turnguard: reading the principal %s went upstream as failed", flow.id)
        return True
    return sent != attempt.ident.principal


def _edited_since(flow: http.HTTPFlow, sent_as: tuple | None) -> bool:
    """Whether a user edited the request after turnguard identified it: mitmweb's intercept
    comes after turnguard's request hook, and its editor (or the console's) saves a backup
    of the flow first (``Flow.modified``). A change by an addon that runs after turnguard
    (``map_remote``, ``modify_body``: the request was identified as they send it,
    ``flows._as_sent``) leaves no backup and is no edit. Its response then answers that
    edited request only: it is neither recorded for the operation nor attached to."""
    if sent_as is None or flow.request is None:
        return False
    if sent_as == _request_as_is(flow):  # (a tuple compares its items by identity first)
        return False
    return flow.modified()


def _killed_before_sent(flow: http.HTTPFlow) -> bool:
    """Whether the flow was killed before its request went upstream: in its ``request`` hook
    (by an addon after turnguard, or while a user kept it intercepted). mitmproxy acts on a
    kill only at the flow's next hook, and the one after its request is sent is
    ``responseheaders``: a flow killed once it was sent reaches its ``error`` hook with the
    response's headers (and an upstream failure meanwhile replaces the kill's message)."""
    return flow.error is not None and flow.error.msg == Error.KILLED_MESSAGE \
        and flow.response is None


H2_UPSTREAM_RESET_MESSAGE = "stream reset by upstream"


def _error_of(flow: http.HTTPFlow) -> str | None:
    """The flow's error as its end records it. mitmproxy words an HTTP/2 stream's reset
    "stream reset by client (...)" whichever side sent it; one the upstream sent (an upstream
    that refused or dropped the turn: an upstream failure, fed to the circuit as a broken
    HTTP/1.1 connection is) is named "stream reset by upstream (...)". A detached call's
    client is turnguard's stand-in, which resets nothing: a reset there is the upstream's."""
    if flow.error is None:
        return None
    msg = flow.error.msg
    if not msg.startswith(H2_RESET_MESSAGE):
        return msg
    meta = flow.metadata.get("turnguard") or {}
    by_upstream = ("detached_cut" not in meta if "detached" in meta
                   else stream_reset_by_upstream(flows.proxyserver(), flow))
    if by_upstream:
        return H2_UPSTREAM_RESET_MESSAGE + msg[len(H2_RESET_MESSAGE):]
    return msg


def _client_gone(flow: http.HTTPFlow) -> bool:
    """Whether the attempt ended for want of a client. A detached call's flow never has a
    connected client (mitmproxy's replay handler runs it): it went without one only when
    turnguard cut it for that (``detached``)."""
    meta = flow.metadata.get("turnguard") or {}
    if "detached" in meta:
        return "detached_cut" in meta
    return not flow.client_conn.connected


def _head(flow: http.HTTPFlow) -> Head | None:
    """The response's head as a duplicate would take it; None when no duplicate could
    (``Vary: *``)."""
    resp = flow.response
    headers = flows.response_headers(flow)
    names = negotiation.vary_names(headers)
    if names is None:
        return None
    return Head(resp.status_code, headers, negotiation.vary_key(names, flows.request_headers(flow)))
