"""Prometheus metrics: counters and histograms derived from turnguard's telemetry records,
gauges read from the addon's state at scrape time, and the HTTP endpoint that serves them.

Contract:
- ``Metrics.observe(event, fields)`` is a telemetry sink (``Telemetry.sink``): every record
  turnguard emits goes through it, so the metrics and the events file never disagree on what
  happened. It never raises and costs a few microseconds per record.
- Every series carries the label ``turnguard_instance`` (the process's instance id, the one in
  the ledger's ``instances`` table): several mitmdump processes sharing one ledger each serve
  their own endpoint and are told apart. (Prometheus gives the label ``instance`` to the scrape
  target itself and would rename ours to ``exported_instance``.)
- Label values come from fixed sets only (free-text reasons are mapped onto ``PASSTHROUGH_REASONS``
  and friends; anything unexpected is ``other``), and never carry a credential, a session or an
  operation id: the cardinality stays bounded whatever the clients send.
- Each ``Metrics`` has its own ``CollectorRegistry`` (a test creates many addons in one
  process); ``serve`` binds synchronously (a bind error is an ``OSError`` at once) and
  ``close`` stops the server and frees the port before it returns (a script reload binds the
  same address again right after).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from bisect import bisect_left

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .records import record

logger = logging.getLogger("turnguard")

NAMESPACE = "turnguard"
INSTANCE_LABEL = "turnguard_instance"
OTHER = "other"
SERVER_POLL_S = 0.05  # how fast close() stops the server thread
SCRAPE_READ_TIMEOUT_S = 10.0  # a scraper that sends nothing does not keep a thread for ever
# connections served at once (a thread and a descriptor each, for up to the read timeout);
# one more is closed at once: idle connections must not take the descriptors the proxied
# traffic needs
MAX_SCRAPE_CONNECTIONS = 16

# -- fixed label sets --------------------------------------------------------------------------

DISPATCH_KINDS = ("original", "retry", "recovery")
OUTCOMES = ("completed", "rejected", "partial", "unknown")
DUPLICATE_ACTIONS = {
    "duplicate_held": "held",
    "duplicate_replayed": "replayed",
    "duplicate_attached": "attached",
    "duplicate_forwarded": "forwarded",
    "duplicate_rejected": "rejected",
    "replay_declined": "declined",
}
ANSWER_CODES = (
    "turn_in_progress", "idempotency_key_conflict", "upstream_request_timeout",
    "upstream_operation_status_unknown", "proxy_refused_response",
)
FAIL_CLOSED_REASONS = (
    "owner_proof_missing", "ownership_lost", "output_exists", "request_budget_expired",
    "claim_exhausted", "previous_response_id", "no_turn_state_anchor", "ledger_unavailable",
)
RECOVERY_DENIED_REASONS = ("ownership_lost", "output_exists", "claim_exhausted",
                           "ledger_unavailable")
FAILURE_CLASSES = (
    "missing_response_created_timeout", "client_abort", "killed", "connection_error",
    "upstream_closed_before_headers", "upstream_clean_close", "upstream_closed_after_headers",
    "upstream_error_event", "upstream_response_failed", "upstream_ws_closed",
    "proxy_out_of_resources", "proxy_body_size_limit",
)
ABANDON_REASONS = {
    "killed": "killed", "client disconnected": "client_disconnected",
    "stream reset by client": "stream_reset", "turnguard unloaded": "unloaded",
    "websocket closed": "websocket_closed",
}
WAIT_END_REASONS = ("cooldown_elapsed", "gone", "ownership_lost", "woken")
SESSION_CLAIM_RESULTS = ("created", "taken_over")
# (failover.WRITE_CALLS names its writes; "probe": the catch-up and heartbeat of a ledger
# found unusable before; "file_check": the file was found deleted or replaced, or made anew)
LEDGER_CALLS = (
    "open", "admit", "heartbeat", "reap", "gc", "replay", "poll", "claim_session",
    "renew_session", "fail_closed", "finish", "first_event", "recovery_decision",
    "note_duplicates", "give_back", "control", "probe", "circuits", "file_check",
)
# A passthrough's free-text reason (identity.py, the addon) -> a label value, by prefix.
PASSTHROUGH_REASONS: tuple[tuple[str, str], ...] = (
    ("request body is streamed", "body_streamed"),
    ("body too large", "body_too_large"),
    ("upstream unknown", "upstream_unknown"),
    ("principal undetermined", "principal_undetermined"),
    ("body could not be decoded", "body_undecodable"),
    ("no body", "no_body"),
    ("body is not UTF-8", "body_not_utf8"),
    ("duplicate keys", "duplicate_keys"),
    ("JSON nesting too deep", "json_too_deep"),
    ("body is not a JSON object", "body_not_object"),
    ("body is not JSON", "body_not_json"),
    ("identity failed", "identity_failed"),
    # a large body identified in the worker process (offload.py)
    ("identity worker failed", "identity_failed"),
    ("identity worker did not start", "identity_timeout"),
    ("identity of a large body", "identity_timeout"),
    ("turnguard unloaded while identifying", "unloaded"),  # a script reload meanwhile
    ("internal error", "internal_error"),
    ("turnguard_filter failed", "filter_failed"),  # (turnguard.py: it should never)
    ("recording missing", "recording_missing"),
    ("response content-encoding", "response_encoded"),
    # a WebSocket frame (ws.parse_client_frame says "frame" where a body's reason says "body")
    ("frame too large", "body_too_large"),
    ("frame holds more than ", "body_too_large"),  # too many objects and arrays to read
    ("frame could not be decoded", "body_undecodable"),
    ("frame is not UTF-8", "body_not_utf8"),
    ("frame is not a JSON object", "body_not_object"),
    ("frame is not JSON", "body_not_json"),
    ("binary frame", "binary_frame"),
    ("frame type ", "not_a_call"),
    # a WebSocket let go (websocket.WebSockets._let_go)
    ("more than ", "frames_queued"),
    ("a response did not end within", "response_timeout"),
    ("upstream frame is not a Responses event", "not_responses"),
    # an upstream frame that is no Responses event, passed on with the socket still guarded
    ("upstream frame passed on", "frame_passed_on"),
    # a WebSocket mitmproxy relays as raw TCP (its websocket option off): turnguard.py
    ("websocket option is off", "websocket_off"),
    # a request (or a client's WebSocket frame) whose hook an earlier addon halted: turnguard.py
    ("request hook never reached turnguard", "hook_halted"),
    ("frame hook never reached turnguard", "hook_halted"),
)
PASSTHROUGH_LABELS = tuple(dict.fromkeys(label for _, label in PASSTHROUGH_REASONS)) + (OTHER,)

# -- buckets (seconds) -------------------------------------------------------------------------

HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
COOLDOWN_WAIT_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
FIRST_EVENT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ATTEMPT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

HELD_FLOWS_TRACKED = 100_000  # flows between duplicate_held and their end, for hold time


def passthrough_label(reason: object) -> str:
    """The label value of a passthrough's free-text reason (``other`` when unknown)."""
    text = str(reason or "")
    for prefix, label in PASSTHROUGH_REASONS:
        if text.startswith(prefix):
            return label
    return OTHER


def abandon_label(reason: object) -> str:
    """The label value of a hold's end reason: by prefix, as a reason may say more
    ("websocket closed while the call was decided; ..."); ``other`` when unknown."""
    text = str(reason or "")
    for prefix, label in ABANDON_REASONS.items():
        if text.startswith(prefix):
            return label
    return OTHER


def _one_of(value: object, allowed: Iterable[str]) -> str:
    return value if isinstance(value, str) and value in allowed else OTHER


def _seconds(ms: object) -> float | None:
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or ms < 0:
        return None
    return ms / 1000


@record
class GaugeState:
    """What the addon holds right now, read at scrape time (``state`` callable of ``Metrics``).
    ``circuits_open_until`` are the ends (Unix time) of the cooldowns this process knows of."""

    held_duplicates: int = 0
    held_through_cooldown: int = 0
    attempts_in_flight: int = 0
    circuits_open_until: tuple[float, ...] = ()
    owned_sessions: int = 0
    ledger_up: bool = True
    recovery_mode: str = ""


@dataclass
class _Names:
    """The metric names, for the README and the tests (``Metrics.names``)."""

    counters: list[str] = field(default_factory=list)
    histograms: list[str] = field(default_factory=list)
    gauges: list[str] = field(default_factory=list)


GAUGES = {
    "turnguard_flows_held": "Flows held now, by what they wait for (wait: duplicate, cooldown).",
    "turnguard_attempts_in_flight": "Upstream dispatches of guarded requests in flight now.",
    "turnguard_circuits_open": "Retry circuits cooling down now (as this process last saw "
                               "the ledger: refreshed every 5 s and on every transition).",
    "turnguard_cooldown_remaining_seconds": "Longest remaining cooldown of an open retry "
                                            "circuit (0: none open).",
    "turnguard_sessions_owned": "Durable sessions this process owns.",
    "turnguard_ledger_up": "1 while the ledger is usable, 0 while turnguard decides in memory.",
    "turnguard_info": "Always 1; labels: recovery_mode.",
}


class _StateCollector(Collector):
    def __init__(self, instance: str, state: Callable[[], GaugeState], clock: Callable[[], float]):
        self._instance = instance
        self._state = state
        self._clock = clock

    def collect(self):
        try:
            s = self._state()
        except Exception:  # a scrape must not fail because of a racing update
            logger.debug("turnguard: metrics state unavailable", exc_info=True)
            s = GaugeState()
        now = self._clock()
        labels = [INSTANCE_LABEL]
        held = GaugeMetricFamily("turnguard_flows_held", GAUGES["turnguard_flows_held"],
                                 labels=[*labels, "wait"])
        held.add_metric([self._instance, "duplicate"], s.held_duplicates)
        held.add_metric([self._instance, "cooldown"], s.held_through_cooldown)
        yield held
        remaining = [until - now for until in s.circuits_open_until if until > now]
        for name, value in (
            ("turnguard_attempts_in_flight", s.attempts_in_flight),
            ("turnguard_circuits_open", len(remaining)),
            ("turnguard_cooldown_remaining_seconds", max(remaining, default=0.0)),
            ("turnguard_sessions_owned", s.owned_sessions),
            ("turnguard_ledger_up", 1 if s.ledger_up else 0),
        ):
            g = GaugeMetricFamily(name, GAUGES[name], labels=labels)
            g.add_metric([self._instance], value)
            yield g
        info = GaugeMetricFamily("turnguard_info", GAUGES["turnguard_info"],
                                 labels=[*labels, "recovery_mode"])
        info.add_metric([self._instance, s.recovery_mode], 1)
        yield info

    def describe(self):
        return []  # collected at scrape time only


class _Labelled(Collector):
    """Another collector's series with ``turnguard_instance`` added (the process metrics of
    the client library have no labels: a dashboard filtered by instance would lose them)."""

    def __init__(self, inner: Collector, instance: str):
        self._inner = inner
        self._instance = instance

    def collect(self):
        for family in self._inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, INSTANCE_LABEL: self._instance}, s.value,
                               s.timestamp, s.exemplar)
            yield out

    def describe(self):
        return []  # collected at scrape time only


class _Counters:
    """A counter family: its values by label values (the instance's first). Callers hold
    the lock of their ``Metrics``."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]):
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...]) -> None:
        self.values[key] = self.values.get(key, 0.0) + 1.0

    def family(self) -> CounterMetricFamily:
        out = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, value in list(self.values.items()):
            out.add_metric(key, value)
        return out


class _Histograms:
    """A histogram family: per label values, the count of each bucket (an observation
    counts in the first whose upper bound it does not exceed; the last is +Inf) and the
    sum. Callers hold the lock of their ``Metrics``."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]):
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = (*(float(b) for b in buckets), float("inf"))
        self._les = tuple(floatToGoString(b) for b in self.bounds)
        self.values: dict[tuple[str, ...], list[float]] = {}  # bucket counts, then the sum

    def observe(self, key: tuple[str, ...], amount: float) -> None:
        row = self.values.get(key)
        if row is None:
            row = self.values[key] = [0.0] * (len(self.bounds) + 1)
        row[bisect_left(self.bounds, amount)] += 1.0
        row[-1] += amount

    def bind(self, key: tuple[str, ...]) -> None:
        """The series exists (at 0) before its first observation."""
        self.values.setdefault(key, [0.0] * (len(self.bounds) + 1))

    def family(self) -> HistogramMetricFamily:
        out = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, row in list(self.values.items()):
            cumulative, total = [], 0.0
            for le, count in zip(self._les, row):
                total += count
                cumulative.append((le, total))
            out.add_metric(key, cumulative, row[-1])
        return out


class _Families(Collector):
    """The counters and histograms of a ``Metrics``, read under its lock at scrape time."""

    def __init__(self, families: list, lock: threading.Lock):
        self._families = families
        self._lock = lock

    def collect(self):
        with self._lock:
            made = [f.family() for f in self._families]
        yield from made

    def describe(self):
        return []  # collected at scrape time only


class Metrics:
    """The metrics of one addon instance. ``observe`` is the telemetry sink; ``serve`` starts
    the endpoint; ``close`` stops it."""

    def __init__(
        self, instance: str, state: Callable[[], GaugeState] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.instance = instance
        self._key = (instance,)
        self._lock = threading.Lock()  # records may come from threads other than the loop's
        self._families: list[_Counters | _Histograms] = []
        self.registry = CollectorRegistry()
        self.names = _Names()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None  # bound (the port the OS chose)
        self.wanted: tuple[str, int] | None = None  # as configured (the addon's bookkeeping)
        self._held: dict[str, None] = {}  # flow ids held as duplicates (insertion ordered)
        self._declare_counters(self._counter)
        self._declare_health_counters(self._counter)
        self._declare_histograms(self._histogram)
        self.registry.register(_Families(self._families, self._lock))
        self.names.gauges.extend(GAUGES)
        self._gauge_state: _StateCollector | None = None
        if state is not None:
            self._gauge_state = _StateCollector(instance, state, clock)
            self.registry.register(self._gauge_state)
        try:  # process_resident_memory_bytes, ... (Linux /proc), with turnguard_instance too
            self.registry.register(_Labelled(ProcessCollector(registry=None), instance))
        except Exception:  # pragma: no cover - a platform without /proc
            pass
        self._bind_children(instance)

    def watch(self, state: Callable[[], GaugeState]) -> None:
        """Read the gauges from ``state`` from now on (a reloaded addon keeps the process's
        metrics, and with them its counters, but the state is the new instance's)."""
        if self._gauge_state is None:
            self._gauge_state = _StateCollector(self.instance, state, time.time)
            self.registry.register(self._gauge_state)
        else:
            self._gauge_state._state = state

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> _Counters:
        self.names.counters.append(f"{NAMESPACE}_{name}_total")
        family = _Counters(f"{NAMESPACE}_{name}", doc, (INSTANCE_LABEL, *labels))
        self._families.append(family)
        return family

    def _histogram(self, name: str, doc: str, buckets, labels: tuple[str, ...] = ()) -> _Histograms:
        self.names.histograms.append(f"{NAMESPACE}_{name}")
        family = _Histograms(f"{NAMESPACE}_{name}", doc, (INSTANCE_LABEL, *labels), buckets)
        self._families.append(family)
        return family

    def _declare_counters(self, counter) -> None:
        self.events = counter("events", "Telemetry records emitted, by event name.", ("event",))
        self.dispatches = counter(
            "dispatches", "Guarded requests sent upstream, by kind (original, retry, recovery).",
            ("kind",))
        self.outcomes = counter(
            "outcomes", "Ends of upstream dispatches, by outcome (completed, rejected, partial, "
            "unknown).", ("outcome",))
        self.duplicates = counter(
            "duplicates", "Duplicates by what turnguard did: held (a hold began), replayed "
            "(answered from a recording, held or not), attached (answered live from a stream in "
            "flight), forwarded (held, then sent upstream as "
            "the retry), rejected (409 past the hold bound), declined (a recording its "
            "Accept-Encoding or Vary rules out; forwarded).", ("action",))
        self.answers = counter(
            "answers", "Answers turnguard made itself instead of the upstream, by status "
            "(409, 422, 503) and error code.", ("status", "code"))
        self.circuit_opened = counter("circuit_opened", "Retry circuits that opened a cooldown.")
        self.circuit_reset = counter("circuit_reset",
                                     "Retry circuits reset by a completed response.")
        self.circuit_cleared = counter(
            "circuit_cleared", "Retry circuits cleared by an operator in this process "
            "(turnguard.circuit.clear; scripts/turnguard circuit clear is another process, "
            "counted nowhere here).")
        self.recovery_claimed = counter("recovery_claimed",
                                        "Recovery dispatches claimed after a cooldown.")
        self.recovery_denied = counter("recovery_denied", "Recovery claims refused, by reason.",
                                       ("reason",))
        self.fail_closed = counter(
            "fail_closed", "Requests failed closed (503, nothing dispatched) for a reason other "
            "than the fail_closed mode itself, by reason.", ("reason",))
        self.passthrough = counter(
            "passthrough", "Guarded requests forwarded unguarded, by reason.", ("reason",))

    def _declare_health_counters(self, counter) -> None:
        self.ledger_outages = counter(
            "ledger_outages", "Times the ledger became or was found unusable, by the call that "
            "found it (turnguard then decides in memory, or fails closed).", ("during",))
        self.upstream_cuts = counter(
            "upstream_cuts", "Upstream connections turnguard cut (no response event in time).")
        self.eventless_failures = counter(
            "eventless_failures", "Dispatches that ended without a response event, by class.",
            ("failure_class",))
        self.holds_abandoned = counter(
            "holds_abandoned", "Held requests whose client went away or that were killed.",
            ("reason",))
        self.ownership_lost = counter(
            "ownership_lost", "Requests held through a cooldown whose session another process "
            "took over.")
        self.sessions_claimed = counter(
            "sessions_claimed", "Durable sessions this process created or took over.",
            ("result",))
        self.sessions_released = counter(
            "sessions_released", "Durable sessions released by an operator in this process.")
        self.instances_reaped = counter(
            "instances_reaped", "Dead processes whose attempts in flight this process ended.")

    def _declare_histograms(self, histogram) -> None:
        self.hold_seconds = histogram(
            "hold_seconds", "How long a duplicate was held, by how the hold ended (replayed, attached, "
            "rejected, forwarded, declined, abandoned).", HOLD_BUCKETS, ("result",))
        self.cooldown_wait_seconds = histogram(
            "cooldown_wait_seconds", "How long a request was held through a cooldown, by how "
            "the wait ended.", COOLDOWN_WAIT_BUCKETS, ("reason",))
        self.first_event_seconds = histogram(
            "time_to_first_event_seconds", "From dispatch to the first response event (SSE "
            "streams that produced one).", FIRST_EVENT_BUCKETS)
        self.attempt_seconds = histogram(
            "attempt_duration_seconds", "From dispatch to the end of the response, by outcome.",
            ATTEMPT_BUCKETS, ("outcome",))

    def _bind_children(self, i: str) -> None:
        """The series without a label of their own exist (at 0) from the start."""
        self._plain = {
            "circuit_opened": self.circuit_opened,
            "circuit_reset": self.circuit_reset,
            "circuit_cleared": self.circuit_cleared,
            "recovery_claimed": self.recovery_claimed,
            "upstream_cut": self.upstream_cuts,
            "ownership_lost": self.ownership_lost,
            "session_released": self.sessions_released,
            "instance_reaped": self.instances_reaped,
        }
        for family in self._plain.values():
            family.values[self._key] = 0.0
        self.first_event_seconds.bind(self._key)

    # -- the telemetry sink ----------------------------------------------------------------------
    def observe(self, event: str, fields: Mapping[str, Any]) -> None:
        """Count one telemetry record. Never raises."""
        try:
            with self._lock:
                self._observe(event, fields)
        except Exception:  # metrics must never break traffic
            logger.debug("turnguard: metrics could not count %s", event, exc_info=True)

    def _observe(self, event: str, f: Mapping[str, Any]) -> None:
        i = self.instance
        self.events.inc((i, event))
        plain = self._plain.get(event)
        if plain is not None:
            plain.inc(self._key)
            return
        if event == "dispatch":
            self.dispatches.inc((i, _one_of(f.get("kind"), DISPATCH_KINDS)))
        elif event == "outcome":
            outcome = _one_of(f.get("outcome"), OUTCOMES)
            self.outcomes.inc((i, outcome))
            duration = _seconds(f.get("duration_ms"))
            if duration is not None:
                self.attempt_seconds.observe((i, outcome), duration)
            first = _seconds(f.get("first_event_ms"))
            if first is not None:
                self.first_event_seconds.observe(self._key, first)
        elif event in DUPLICATE_ACTIONS:
            action = DUPLICATE_ACTIONS[event]
            self.duplicates.inc((i, action))
            self._hold_ended(f, action)
        elif event == "fail_closed":
            self.fail_closed.inc((i, _one_of(f.get("reason"), FAIL_CLOSED_REASONS)))
        elif event == "passthrough":
            self.passthrough.inc((i, passthrough_label(f.get("reason"))))
        elif event == "recovery_denied":
            self.recovery_denied.inc((i, _one_of(f.get("reason"), RECOVERY_DENIED_REASONS)))
        elif event == "ledger_unavailable":
            self.ledger_outages.inc((i, _one_of(f.get("during"), LEDGER_CALLS)))
        elif event == "eventless_failure":
            self.eventless_failures.inc((i, _one_of(f.get("failure_class"), FAILURE_CLASSES)))
        elif event == "hold_abandoned":
            self.holds_abandoned.inc((i, abandon_label(f.get("reason"))))
            self._hold_ended(f, "abandoned")
        elif event == "wait_finished":
            waited = _seconds(f.get("waited_ms"))
            if waited is not None:
                reason = _one_of(f.get("reason"), WAIT_END_REASONS)
                self.cooldown_wait_seconds.observe((i, reason), waited)
        elif event == "session_claimed":
            self.sessions_claimed.inc((i, _one_of(f.get("result"), SESSION_CLAIM_RESULTS)))
        status = f.get("answer_status")
        if status is not None:
            self.answers.inc((i, _one_of(str(status), ("409", "422", "503")),
                              _one_of(f.get("code"), ANSWER_CODES)))

    def _hold_ended(self, f: Mapping[str, Any], result: str) -> None:
        flow = f.get("flow")
        if not isinstance(flow, str):
            return
        if result == "held":
            self._held[flow] = None
            if len(self._held) > HELD_FLOWS_TRACKED:  # an end never came: forget the oldest
                del self._held[next(iter(self._held))]
            return
        if flow in self._held:
            del self._held[flow]
            held = _seconds(f.get("held_ms"))
            if held is not None:
                self.hold_seconds.observe((self.instance, result), held)

    # -- the endpoint ----------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Serve ``/metrics`` on ``host:port`` (port 0: one the OS picks) from a thread of its
        own, instead of the address served so far (if any); return the address bound. Raises
        ``OSError`` when it cannot bind: the address served so far is then kept."""
        family = _family(host, port)

        class Server(ThreadingWSGIServer):
            address_family = family
            # socketserver's listen backlog of 5 made connections past the first few wait
            # for SYN retransmits (1 s, 3 s, ...) while a flood was closed at once
            request_queue_size = 128
            _serving = 0  # connections being served now (their threads)
            _count_lock = threading.Lock()
            _refused_said = False

            def process_request(self, request, client_address) -> None:
                """Serve the connection on a thread of its own, unless ``MAX_SCRAPE_CONNECTIONS``
                are served already: then it is closed at once (said once in the log until
                the count is back under the bound)."""
                with self._count_lock:
                    full = self._serving >= MAX_SCRAPE_CONNECTIONS
                    if not full:
                        self._serving += 1
                if full:
                    self.shutdown_request(request)
                    if not self._refused_said:
                        self._refused_said = True
                        logger.warning("turnguard: %d metrics connections are open; closing "
                                       "more (from %s) at once", MAX_SCRAPE_CONNECTIONS,
                                       client_address[0])
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    self._served()
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    self._served()

            def _served(self) -> None:
                with self._count_lock:
                    self._serving -= 1
                    if self._serving < MAX_SCRAPE_CONNECTIONS // 2:
                        self._refused_said = False

            def handle_error(self, request, client_address) -> None:
                """A scraper that went silent, slow or away (the read timeout, a reset) is no
                error worth a traceback in mitmdump's output (socketserver prints one)."""
                error = sys.exc_info()[1]
                if not isinstance(error, OSError):  # TimeoutError, ConnectionError included
                    logger.warning("turnguard: a metrics request from %s failed: %r",
                                   client_address[0], error)

        server = make_server(host, port, make_wsgi_app(self.registry), Server,
                             handler_class=_QuietHandler)
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": SERVER_POLL_S},
            name="turnguard-metrics", daemon=True,
        )
        self.close()
        thread.start()
        self._server, self._thread = server, thread
        self.address = (host, server.server_address[1])
        return self.address

    def close(self) -> None:
        """Stop serving and free the address (waits at most a moment)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=2)


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (mitmdump's output is the operator's); bounded reads: the whole
    request (its line and headers) within ``SCRAPE_READ_TIMEOUT_S`` of the connection, not
    only each read (a client sending a byte at a time would keep its slot for ever), else
    the connection is cut."""

    timeout = SCRAPE_READ_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        self._deadline = threading.Timer(SCRAPE_READ_TIMEOUT_S, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once
        except OSError:
            pass

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers
        self._deadline.cancel()  # the request is in: its answer is not bounded here
        return ok

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


def _family(host: str, port: int) -> socket.AddressFamily:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    return infos[0][0]
