"""turnguard: hold duplicate AI model turns instead of executing them twice.

Load it with ``mitmdump -s addon/turnguard.py --mode reverse:https://api.openai.com``. This file is
the imperative shell: the only code that speaks mitmproxy. It translates hooks into calls on the
pure core (``turnguard_core``: identity, policy, SSE, tee) and the ledger, and the core's decisions
into flow actions. "What happens to a duplicate" is ``TurnGuard._guard``.
"""


import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

# mitmproxy puts this folder on sys.path only while it loads the script: import the core now.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from mitmproxy import command, ctx, exceptions, flowfilter, hooks, http  # noqa: E402

from turnguard_core import answers, circuit, identity, negotiation, options, policy  # noqa: E402
from turnguard_core.codec import BoundedCodec  # noqa: E402
from turnguard_core.ledger import (  # noqa: E402
    AttemptEnd,
    FinishResult,
    Ledger,
    LedgerError,
    Recording,
    check_path,
    instance_is_dead,
)
from turnguard_core.ledger_runner import LedgerRunner  # noqa: E402
from turnguard_core.private_files import UnsafePath  # noqa: E402
from turnguard_core.proxy_internals import (  # noqa: E402
    client_stream_closed,
    cut_upstream,
    find_http_layer,
)
from turnguard_core.tee import ResponseTee, recordable_headers  # noqa: E402
from turnguard_core.telemetry import Telemetry  # noqa: E402

logger = logging.getLogger("turnguard")

MAX_GUARDED_BODY = 64 * 1024 * 1024
MAX_RECODED_BODY = 64 * 1024 * 1024  # a replay decoded for a client larger than this: forwarded
FOREIGN_POLL_S = 0.2  # re-check an operation another process owns (issue: 100-250 ms)
TICK_S = 1.0  # notice killed or disconnected held flows; heartbeat
HEARTBEAT_S = 5.0
INSTANCE_STALE_S = 30.0
LEDGER_BUSY_MS = 2000  # SQLite busy timeout: claims by other processes take milliseconds
LEDGER_RETRY_S = 5.0  # after a ledger fault, decide in memory this long, then probe again
STATUS_TIMEOUT_S = 1.0
ERROR_RECORD_WAIT_S = 1.0  # longest a failed attempt's answer waits for its ledger record
FIRST_EVENT_DELAY_S = 0.1  # a stream's first event is recorded this late, unless it ended

_UNAVAILABLE = object()  # what _ledger() returns when the ledger cannot be used

MARK_HELD = ":hourglass:"
MARK_COOLDOWN = ":snowflake:"
MARK_REPLAYED = ":recycle:"
MARK_REJECTED = ":no_entry:"
MARK_CUT = ":scissors:"
MISSING_RESPONSE_CREATED = "missing_response_created_timeout"


@dataclass
class _Attempt:
    """A guarded flow this process dispatched upstream, until its outcome is recorded."""

    flow_id: str
    ident: identity.Identity
    attempt_id: int | None  # None when the ledger was unavailable
    kind: str
    started: float
    circuit_scope: str
    status: int | None = None
    tee: ResponseTee | None = None
    cut_reason: str | None = None  # set when turnguard cut the upstream itself
    first_event_at: float | None = None  # monotonic time of the first response event
    timer: asyncio.TimerHandle | None = None  # response_created timeout

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


@dataclass
class _Held:
    """A request turnguard keeps waiting: a duplicate of an attempt in flight, or a request
    held through a cooldown (``cooldown``), which waits on a timer and its session's lease."""

    flow: http.HTTPFlow
    op_key: str
    since: float
    wake: asyncio.Future
    foreign_attempt: int | None = None  # set when another process owns the attempt
    cooldown: bool = False
    session: str | None = None
    epoch: int | None = None


@dataclass(frozen=True)
class _Ended:
    """Why a held flow woke up: the attempt ended (maybe with a recording to replay)."""

    outcome: str
    recording: Recording | None = None


@dataclass(frozen=True)
class _Gone:
    """Why a held flow woke up: it was killed or its client went away."""

    reason: str


@dataclass(frozen=True)
class _OwnershipLost:
    """Why a cooldown-held flow woke up: another process took its session (higher epoch)."""

    epoch: int | None


def _accepts_sse(flow: http.HTTPFlow) -> bool:
    return "text/event-stream" in flow.request.headers.get("accept", "")


def _via(flow: http.HTTPFlow) -> str | None:
    """The upstream proxy a flow goes through (mitmproxy's upstream mode), as a URL."""
    via = flow.server_conn.via
    if via is None:
        return None
    try:
        scheme, (host, port) = via
        return f"{scheme}://{host}:{port}"
    except (TypeError, ValueError):  # not a ServerSpec: still a value of its own
        return repr(via)


def _headers(pairs) -> http.Headers:
    return http.Headers(
        [(k.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape")) for k, v in pairs]
    )


class TurnGuard:
    def __init__(self) -> None:
        self.instance_id = uuid.uuid4().hex[:16]
        self.db: LedgerRunner | None = None  # the ledger; never blocks the loop for long
        self._ledger_retry_at = 0.0  # while in the future, the ledger is down: decide in memory
        self.ledger_path = ""
        self.ledger_error: str | None = None
        self.telemetry = Telemetry()
        self.filter: flowfilter.TFilter | None = None
        self.settings = options.settings_from(options.DEFAULTS)
        self._attempts: dict[str, _Attempt] = {}  # flow id -> attempt in flight
        self._local: dict[str, str] = {}  # op key -> flow id of this process's attempt in flight
        self._held: dict[str, _Held] = {}  # flow id -> held request
        self._sessions: dict[str, policy.SessionOwnership] = {}  # sessions this process owns
        self._circuits: dict[str, circuit.CircuitState] = {}  # last known, for when the ledger is down
        self._ticker: asyncio.Task | None = None
        # client connection id -> its HttpLayer (found once), to tell a reset HTTP/2 stream
        self._http_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._last_heartbeat = 0.0
        self._has_view: bool | None = None  # is there a UI whose flow list needs refreshing?
        self._last_gc = 0.0
        self._last_reap = 0.0
        self._running = False  # set by the running hook: start-up is over
        self.refused: list[str] = []  # bad options found at start-up: turnguard stays off
        self.metrics = None  # metrics.Metrics: the Prometheus endpoint, when turnguard_metrics
        # scope -> end of its cooldown, as last seen (ledger every heartbeat, and transitions
        # here); replaced, never changed in place: the metrics thread reads it
        self._circuit_view: dict[str, float] = {}

    # -- options ---------------------------------------------------------------------------------
    def load(self, loader) -> None:
        for spec in options.OPTIONS:
            loader.add_option(
                spec.name, spec.type, spec.default, spec.help,
                choices=list(spec.choices) if spec.choices else None,
            )
        # --set values of not-yet-registered options wait in `deferred`; mitmproxy applies ours
        # right after this hook. A typo there would be ignored for ever, and a value of the
        # wrong type would make mitmproxy drop the script without a word: check them first.
        deferred = getattr(loader.master.options, "deferred", {})
        problems = options.deferred_problems({k: getattr(v, "val", v) for k, v in deferred.items()})
        for name, message in problems.items():
            deferred.pop(name, None)
            self._refuse(message)

    def configure(self, updated: set[str]) -> None:
        if self.refused:
            return
        try:
            self.settings = options.settings_from(
                {spec.name: getattr(ctx.options, spec.name) for spec in options.OPTIONS}
            )
        except ValueError as e:
            return self._refuse(str(e))
        o = ctx.options
        if "turnguard_filter" in updated:
            try:
                self.filter = flowfilter.parse(o.turnguard_filter)
            except ValueError as e:
                return self._refuse(f"turnguard_filter={o.turnguard_filter!r} is not valid: {e}")
        if "turnguard_events" in updated:
            try:
                telemetry = Telemetry(os.path.expanduser(o.turnguard_events) or None)
            except UnsafePath as e:
                return self._refuse(f"turnguard_events={o.turnguard_events!r} is refused: {e}")
            except OSError as e:
                return self._refuse(
                    f"turnguard_events={o.turnguard_events!r} cannot be opened: {e.strerror}"
                )
            telemetry.sink = self.telemetry.sink
            self.telemetry.close()
            self.telemetry = telemetry
        if "turnguard_metrics" in updated and not self._configure_metrics():
            return
        if "turnguard_ledger" in updated or "confdir" in updated:
            try:
                path = self._ledger_path()
            except OSError as e:
                return self._refuse(f"turnguard_ledger: cannot use the folder: {e}")
            self._open_ledger(path)

    def _configure_metrics(self) -> bool:
        """Serve the metrics on the address of ``turnguard_metrics`` (or stop serving). The new
        address is bound before the old one is let go: a refused address keeps the old one.
        False: refused (see ``_refuse``)."""
        address = self.settings.metrics
        if self.metrics is not None and self.metrics.wanted == address:
            return True
        if address is None:
            if self.metrics is not None:
                self.metrics.close()
                self.metrics.wanted = None
            self.telemetry.sink = None
            return True
        if self.metrics is None:
            # imported when wanted: the client library costs ~50 ms at every start-up
            from turnguard_core.metrics import Metrics

            self.metrics = Metrics(self.instance_id, self._gauge_state)
        metrics = self.metrics
        try:
            host, port = metrics.serve(*address)  # the same registry: the counters go on
        except OSError as e:
            shown = ctx.options.turnguard_metrics
            self._refuse(f"turnguard_metrics={shown!r}: cannot serve metrics there: "
                         f"{e.strerror or e}")
            return False
        metrics.wanted = address
        self.telemetry.sink = metrics.observe
        shown_host = f"[{host}]" if ":" in host else host
        logger.info("turnguard: metrics at http://%s:%d/metrics", shown_host, port)
        return True

    def _gauge_state(self):
        """The gauges (``metrics.GaugeState``), read by the metrics thread at scrape time
        (plain reads and copies)."""
        from turnguard_core.metrics import GaugeState

        held = list(self._held.values())
        return GaugeState(
            held_duplicates=sum(not h.cooldown for h in held),
            held_through_cooldown=sum(h.cooldown for h in held),
            attempts_in_flight=len(self._attempts),
            circuits_open_until=tuple(self._circuit_view.values()),
            owned_sessions=len(self._sessions),
            ledger_up=self.db is not None and self.ledger_error is None,
            recovery_mode=self.settings.recovery_mode,
        )

    def _refuse(self, message: str) -> None:
        """A bad option. While mitmproxy starts: one error line naming it, turnguard stays off
        and mitmproxy exits (an error logged during start-up stops it). Later (an option changed
        in mitmweb or the console): ``OptionsError``, so mitmproxy keeps the previous value."""
        if self._running:
            raise exceptions.OptionsError(message)
        self.refused.append(message)
        logger.error("turnguard: %s; turnguard is not running", message)

    def _ledger_path(self) -> str:
        if ctx.options.turnguard_ledger:
            return os.path.abspath(os.path.expanduser(ctx.options.turnguard_ledger))
        confdir = os.path.expanduser(ctx.options.confdir)
        os.makedirs(confdir, mode=0o700, exist_ok=True)
        return os.path.join(confdir, "turnguard.sqlite3")

    def _open_ledger(self, path: str) -> None:
        """Open the ledger (start-up, or a change of option). A path others could write to is
        refused (the ledger in use stays); any other fault leaves turnguard running without
        it, and the ticker tries again every few seconds."""
        try:
            check_path(path)
        except LedgerError as e:
            return self._refuse(f"turnguard_ledger={path} is refused: {e}")
        if self.db is not None:
            self.db.close()
        self.db, self.ledger_path = None, path
        self._try_open(path)

    def _try_open(self, path: str) -> bool:
        db = LedgerRunner(Ledger(path, self.instance_id, busy_timeout_ms=LEDGER_BUSY_MS))
        try:
            now = time.time()
            db.call_sync("open", now)
            db.call_sync("heartbeat", now)
        except (LedgerError, OSError) as e:
            db.close()
            self._ledger_down(e, "open")
            return False
        self.db = db
        self._ledger_up()
        logger.info("turnguard: ledger %s (instance %s)", path, self.instance_id)
        return True

    def _ledger_usable(self) -> bool:
        return self.db is not None and time.monotonic() >= self._ledger_retry_at

    async def _ledger(self, during: str, call: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run a ledger call (see ``ledger_runner``). ``_UNAVAILABLE`` when the ledger is down (then
        the caller decides in memory or fails closed), after noting the fault."""
        if not self._ledger_usable():
            return _UNAVAILABLE
        try:
            return await self.db.call(call, *args, **kwargs)
        except LedgerError as e:
            self._ledger_down(e, during)
            return _UNAVAILABLE

    def _ledger_down(self, error: Exception, during: str) -> None:
        """Note that the ledger failed: for a few seconds decisions are made in memory (no
        call waits on a broken ledger), then the ticker probes it again."""
        self._ledger_retry_at = time.monotonic() + LEDGER_RETRY_S
        if self.ledger_error is None:
            # WARNING, not ERROR: mitmdump exits on an error logged during start-up, and a
            # broken ledger must not stop the proxy.
            logger.warning("turnguard: ledger %s unusable (%s): %s; coalescing in memory until "
                           "it recovers", self.ledger_path, during, error)
        self.ledger_error = str(error)
        self.telemetry.emit("ledger_unavailable", during=during, error=str(error))

    def _ledger_up(self) -> None:
        if self.ledger_error is not None:
            logger.warning("turnguard: ledger %s usable again", self.ledger_path)
            self.telemetry.emit("ledger_recovered", error_was=self.ledger_error)
        self.ledger_error = None
        self._ledger_retry_at = 0.0

    # -- lifecycle -------------------------------------------------------------------------------
    def running(self) -> None:
        self._running = True
        if self.refused:
            return
        logger.info("turnguard: running (instance %s, recovery mode %s, ledger %s)",
                    self.instance_id, self.settings.recovery_mode, self.ledger_path)
        self._ensure_ticker()

    def done(self) -> None:
        """Unloaded (shutdown, or mitmproxy reloading the script): held flows are let go at
        once (killed, so their clients retry against the new instance) instead of waiting
        out their bound on an addon that no longer gets events."""
        for held in list(self._held.values()):
            if not held.wake.done():
                held.wake.set_result(_Gone("turnguard unloaded"))
        if self._ticker is not None:
            self._ticker.cancel()
        if self.db is not None:
            self.db.close()
            self.db = None
        if self.metrics is not None:
            self.metrics.close()  # frees the address: a reloaded script binds it again
            self.metrics = None
        self.telemetry.close()

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def _tick_forever(self) -> None:
        """One task for the whole process: wakes held flows that were killed or whose client
        left, re-checks operations owned by other processes, renews the leases of sessions
        with requests held through a cooldown, heartbeats and collects garbage. It sleeps
        longer when nothing is held, so an idle proxy does next to no work."""
        while True:
            foreign = any(h.foreign_attempt is not None for h in self._held.values())
            await asyncio.sleep(FOREIGN_POLL_S if foreign else TICK_S)
            try:
                self._wake_gone_flows()
                if foreign:
                    await self._poll_foreign()
                if any(h.cooldown for h in self._held.values()):
                    await self._check_cooldown_sessions(time.time())
                await self._maintain(time.time())
            except Exception:
                logger.exception("turnguard: maintenance tick failed")

    async def _maintain(self, now: float) -> None:
        if now - self._last_heartbeat < HEARTBEAT_S:
            return
        self._last_heartbeat = now
        if self.db is None:
            if self.ledger_path:  # recover by itself once the fault is gone
                await asyncio.get_running_loop().run_in_executor(
                    None, self._try_open, self.ledger_path
                )
            return
        try:  # the heartbeat doubles as the probe of a ledger that failed
            await self.db.call("heartbeat", now)
        except LedgerError as e:
            self._ledger_down(e, "heartbeat")
            return
        self._ledger_up()
        await self._refresh_circuits(now)
        await self._reap_dead(now)
        if now - self._last_gc >= policy.gc_interval_s(self.settings.guard.retention_s):
            self._last_gc = now
            n = await self._ledger(
                "gc", "collect_garbage", now=now, retention_s=self.settings.guard.retention_s,
                instance_stale_s=INSTANCE_STALE_S,
            )
            if n and n is not _UNAVAILABLE:
                self.telemetry.emit("ledger_gc", operations_deleted=n)

    async def _refresh_circuits(self, now: float) -> None:
        """Learn which circuits cool down now (for the metrics), and wake the requests held
        through a cooldown whose circuit an operator cleared (from another process: the
        control CLI), so they go on to their recovery claim now."""
        rows = await self._ledger("heartbeat", "open_circuits", now)
        if rows is _UNAVAILABLE:
            return
        self._circuit_view = {scope: st.open_until for scope, st in rows}
        self._wake_cleared(set(self._circuit_view))

    def _wake_cleared(self, still_open: set[str]) -> None:
        for held in list(self._held.values()):
            if (held.cooldown and held.session is not None and not held.wake.done()
                    and "session:" + held.session not in still_open):
                held.wake.set_result(_Ended("circuit_cleared"))

    async def _reap_dead(self, now: float) -> None:
        """Attempts left in flight by a dead process become ``unknown`` (or ``partial``)."""
        self._last_reap = now
        rows = await self._ledger("reap", "instances_with_attempts_in_flight")
        if rows is _UNAVAILABLE:
            return
        for row in rows:
            if instance_is_dead(row, host=self.db.ledger.host, now=now, stale_s=INSTANCE_STALE_S):
                ops = await self._ledger("reap", "reap_instance", row.instance_id, now=now)
                if ops is not _UNAVAILABLE:
                    self.telemetry.emit(
                        "instance_reaped", instance=row.instance_id, pid=row.pid,
                        operations=[k[:12] for k in ops],
                    )

    # -- the guard -------------------------------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        if self.refused or self.filter is None or flow.response is not None or not self.filter(flow):
            return
        self._ensure_ticker()
        try:
            await self._guard(flow)
        except Exception as e:  # never break traffic: the flow goes on as a plain proxy's would
            logger.exception("turnguard: request hook failed; forwarding %s unguarded", flow.id)
            self.telemetry.emit("passthrough", flow=flow.id, reason=f"internal error: {e!r}")

    async def _guard(self, flow: http.HTTPFlow) -> None:
        """What happens to a guarded request, and so to a duplicate.

        Admit it against the ledger: dispatch (the first, a retry after a failed attempt, or a
        recovery after a cooldown), replay (a completed recording), conflict (422), hold while
        another attempt of the same operation is in flight, or fenced by a cooling circuit.
        A held duplicate waits, event-driven, for that attempt to end and is admitted again;
        past the hold bound it gets 409 turn_in_progress. A fenced request fails closed (503)
        unless the recovery mode lets it wait out the cooldown; then it asks for a recovery
        claim. Every path ends in exactly one answer or one dispatch."""
        ident = self._identify(flow)
        if isinstance(ident, identity.Passthrough):
            self.telemetry.emit("passthrough", flow=flow.id, reason=ident.reason)
            return
        cfg = self.settings
        arrived = time.monotonic()
        budget_deadline = arrived + cfg.request_budget_s
        scope = circuit.circuit_scope(ident.session, ident.scope, ident.route)
        owner = await self._ownership(ident.session)
        base = {"op": ident.op_id, "flow": flow.id, "session": ident.session}
        held_since: float | None = None
        hold_deadline = 0.0
        recovery: policy.RecoveryClaim | None = None
        while True:
            admission = await self._admit(flow, ident, scope, recovery)
            now = time.monotonic()
            held_ms = 0 if held_since is None else round((now - held_since) * 1000)
            if isinstance(admission, policy.Dispatch):
                self._dispatch(flow, ident, admission, scope)
                self.telemetry.emit(
                    "dispatch", **base, attempt=admission.attempt_id, kind=admission.kind,
                    ledger=admission.attempt_id is not None,
                )
                if admission.kind == "recovery":
                    self.telemetry.emit("recovery_claimed", **base, attempt=admission.attempt_id,
                                        epoch=recovery.epoch if recovery else None)
                    self._show(flow, None, "turnguard: held through the cooldown, then sent "
                               f"upstream once as the recovery dispatch of {ident.op_id}")
                elif held_since is not None:
                    self.telemetry.emit("duplicate_forwarded", **base, held_ms=held_ms)
                    self._show(flow, None, f"turnguard: held {held_ms} ms, then forwarded "
                               f"(the earlier attempt of {ident.op_id} did not complete)")
                return
            if isinstance(admission, policy.Replay):
                recording = await self._ledger("replay", "recording", admission.attempt_id)
                if recording is _UNAVAILABLE:
                    recording = None
                if recording is None:
                    self.telemetry.emit("passthrough", **base, reason="recording missing")
                    return
                await self._replay(flow, ident, recording, held_ms, admission.attempt_id)
                return  # replayed, or declined and forwarded
            if isinstance(admission, policy.Conflict):
                self.telemetry.emit("idempotency_key_conflict", **base, answer_status=422,
                                    code="idempotency_key_conflict")
                self._answer(flow, answers.idempotency_key_conflict(), MARK_REJECTED,
                             "turnguard: Idempotency-Key reused with a different body")
                return
            if isinstance(admission, policy.Denied):
                self.telemetry.emit("recovery_denied", **base, reason=admission.reason,
                                    code=admission.code)
                await self._fail_closed(flow, base, scope, admission.reason, code=admission.code)
                return
            if isinstance(admission, policy.Fenced):
                denial = policy.fence_hold_denial(
                    cfg.recovery_mode,
                    has_turn_state=ident.turn_state is not None,
                    has_previous_response_id=ident.previous_response_id is not None,
                    owns_session=owner is not None,
                    output_seen=admission.output_seen,
                )
                remaining_budget = budget_deadline - now
                if denial is None and remaining_budget <= 0:
                    denial = "request_budget_expired"
                if denial == "owner_proof_missing" and ident.session and not self._ledger_usable():
                    # no owner proof because there is no ledger to hold it: say so
                    self.telemetry.emit("ledger_unavailable", **base, during="recovery_decision",
                                        error=self.ledger_error)
                    await self._fail_closed(flow, base, scope, "ledger_unavailable")
                    return
                if denial is not None:
                    self._cooldown_reject(flow, base, admission.remaining_s, denial)
                    return
                woke = await self._wait_out_cooldown(
                    flow, ident, base, owner, min(admission.remaining_s, remaining_budget),
                    admission.remaining_s,
                )
                gone = woke if isinstance(woke, _Gone) else self._client_gone(flow)
                if gone is not None:
                    self._abandon(flow, base, gone if isinstance(gone, _Gone) else _Gone(gone),
                                  held_since or now)
                    return
                if isinstance(woke, _OwnershipLost):
                    self.telemetry.emit("ownership_lost", **base, epoch=woke.epoch)
                    await self._fail_closed(flow, base, scope, "ownership_lost")
                    return
                if time.monotonic() >= budget_deadline:
                    await self._fail_closed(flow, base, scope, "request_budget_expired")
                    return
                recovery = policy.RecoveryClaim(
                    ident.session, owner.owner_epoch,
                    once=cfg.recovery_mode == "server_anchored_replay_once",
                )
                held_since = None  # what follows is a new phase: a duplicate hold, if any
                continue
            # Hold: another attempt of this operation is in flight.
            if held_since is None:
                held_since = now
                hold_deadline = policy.hold_deadline(
                    now, hold_timeout_s=cfg.hold_timeout_s, budget_deadline=budget_deadline
                )
                self.telemetry.emit(
                    "duplicate_held", **base, attempt=admission.attempt_id,
                    owner=admission.owner_instance,
                    timeout_ms=max(0, round((hold_deadline - now) * 1000)),
                )
                self._note_duplicate(ident.op_key, held=1)
                self._show(flow, MARK_HELD, f"turnguard: held as a duplicate of operation "
                           f"{ident.op_id}, waiting for its attempt in flight")
            if now >= hold_deadline:
                self._reject_in_progress(flow, base, held_since)
                return
            woke = await self._wait(flow, ident.op_key, admission, hold_deadline - now)
            if woke is None:
                self._reject_in_progress(flow, base, held_since)
                return
            gone = woke if isinstance(woke, _Gone) else self._client_gone(flow)
            if gone is not None:
                self._abandon(flow, base, gone if isinstance(gone, _Gone) else _Gone(gone),
                              held_since)
                return
            if isinstance(woke, _Ended) and woke.recording is not None:
                held_ms = round((time.monotonic() - held_since) * 1000)
                await self._replay(flow, ident, woke.recording, held_ms, None)
                return  # replayed, or declined and forwarded
            # The attempt ended without a recording: admit again (claim, replay or hold anew).

    async def _wait_out_cooldown(
        self, flow: http.HTTPFlow, ident: identity.Identity, base: dict,
        owner: policy.SessionOwnership, wait_s: float, cooldown_s: float,
    ) -> "_Ended | _Gone | _OwnershipLost | None":
        """Hold an eligible request through the cooldown: nothing is dispatched meanwhile; the
        session's lease is renewed by the ticker; ownership loss or a kill wakes it early."""
        wait_ms = round(wait_s * 1000)
        self.telemetry.emit(
            "wait_operation_fenced_cooldown", **base, wait_ms=wait_ms,
            cooldown_remaining_ms=round(cooldown_s * 1000), epoch=owner.owner_epoch,
        )
        self._show(flow, MARK_COOLDOWN, f"turnguard: held through the retry circuit's cooldown "
                   f"({wait_ms} ms); nothing is sent upstream while it waits")
        started = time.monotonic()
        woke = await self._wait(
            flow, ident.op_key, None, wait_s,
            cooldown=True, session=ident.session, epoch=owner.owner_epoch,
        )
        reason = {
            type(None): "cooldown_elapsed", _Gone: "gone", _OwnershipLost: "ownership_lost",
        }.get(type(woke), "woken")
        self.telemetry.emit(
            "wait_finished", **base, waited_ms=round((time.monotonic() - started) * 1000),
            reason=reason,
        )
        return woke

    def _identify(self, flow: http.HTTPFlow) -> identity.Identity | identity.Passthrough:
        req = flow.request
        if req.raw_content is None:
            return identity.Passthrough("request body is streamed")
        if len(req.raw_content) > MAX_GUARDED_BODY:
            return identity.Passthrough(
                f"body too large ({len(req.raw_content)} bytes > limit {MAX_GUARDED_BODY})"
            )
        try:
            body = req.content
        except ValueError:
            body = None
        if not req.host:
            return identity.Passthrough("upstream unknown (no host)")
        proxy_auth = flow.metadata.get("proxyauth")  # mitmproxy's proxyauth took the header
        if proxy_auth is not None:
            if not (isinstance(proxy_auth, (tuple, list))
                    and all(isinstance(part, str) for part in proxy_auth)):
                return identity.Passthrough("principal undetermined (proxyauth metadata)")
            proxy_auth = json.dumps(list(proxy_auth))
        view = identity.RequestView(
            method=req.method,
            path=req.path,
            headers=tuple(req.headers.items(multi=True)),
            body=body,
            upstream=identity.Upstream(
                scheme=req.scheme, host=req.host, port=req.port, host_header=req.host_header,
                via=_via(flow),
            ),
            proxy_auth=proxy_auth,
        )
        return identity.identify(
            view, max_body_bytes=MAX_GUARDED_BODY,
            credential_headers=self.settings.credential_headers,
        )

    async def _admit(
        self, flow: http.HTTPFlow, ident: identity.Identity, scope: str,
        recovery: policy.RecoveryClaim | None,
    ) -> policy.Admission:
        local_flow = self._local.get(ident.op_key)
        if local_flow is not None:
            attempt = self._attempts.get(local_flow)
            return policy.Hold(attempt.attempt_id if attempt else None, self.instance_id)
        admission = await self._ledger(
            "admit", "admit", ident, method=flow.request.method,
            path=ident.route,  # a known route or a hash: the rest of a URL may carry a key
            now=time.time(), guard=self.settings.guard, flow_id=flow.id,
            circuit_scope=scope, recovery=recovery,
            once_mode=self.settings.recovery_mode == "server_anchored_replay_once",
        )
        if admission is _UNAVAILABLE:
            # Coalesce in memory, keep a known cooldown, never recover blind.
            if ident.op_key in self._local:  # another request claimed it meanwhile
                return policy.Hold(None, self.instance_id)
            remaining = self._circuits.get(scope, circuit.CircuitState()).remaining_s(time.time())
            if remaining > 0:
                return policy.Fenced(remaining, output_seen=False)
            if recovery is not None:
                return policy.Denied("upstream_request_timeout", "ledger_unavailable")
            return policy.Dispatch("original")
        if isinstance(admission, policy.Fenced):
            self._circuits[scope] = circuit.CircuitState(
                self.settings.circuit.threshold, time.time() + admission.remaining_s
            )
            if scope not in self._circuit_view:
                self._circuit_view = {**self._circuit_view,
                                      scope: time.time() + admission.remaining_s}
        return admission

    async def _ownership(self, session: str | None) -> policy.SessionOwnership | None:
        """Claim or renew this process's ownership of a durable session (None: not owned).
        The ledger is written only when the lease is past half its length."""
        if session is None:
            return None
        now = time.time()
        lease_s = self.settings.owner_lease_s
        cached = self._sessions.get(session)
        if cached is not None and cached.lease_until - now > lease_s / 2:
            return cached
        claimed = await self._ledger(
            "claim_session", "claim_session", session, now=now, lease_s=lease_s,
            new_id=uuid.uuid4().hex,
        )
        if claimed is _UNAVAILABLE:
            return None
        row, result = claimed
        if result == "owned_by_other":
            self._sessions.pop(session, None)
            return None
        if result != "renewed":
            self.telemetry.emit("session_claimed", session=session, result=result,
                                epoch=row.owner_epoch, durable_id=row.durable_id)
        self._sessions[session] = row
        return row

    def _dispatch(
        self, flow: http.HTTPFlow, ident: identity.Identity, d: policy.Dispatch, scope: str
    ) -> None:
        attempt = _Attempt(flow.id, ident, d.attempt_id, d.kind, time.monotonic(), scope)
        self._attempts[flow.id] = attempt
        self._local[ident.op_key] = flow.id
        flow.metadata["turnguard"] = {
            "role": "dispatch", "op": ident.op_id, "attempt": d.attempt_id, "kind": d.kind,
        }
        timeout_s = self.settings.response_created_timeout_s
        if timeout_s > 0:
            attempt.timer = asyncio.get_running_loop().call_later(
                timeout_s, self._response_created_timeout, flow
            )

    def _response_created_timeout(self, flow: http.HTTPFlow) -> None:
        """No response event in time: cut the upstream; the error hook records ``unknown``."""
        attempt = self._attempts.get(flow.id)
        if attempt is None or (attempt.tee is not None and attempt.tee.events_seen > 0):
            return
        attempt.timer = None
        attempt.cut_reason = MISSING_RESPONSE_CREATED
        why_not = cut_upstream(
            self._proxyserver(), flow.client_conn.id, flow.server_conn,
            f"turnguard: {MISSING_RESPONSE_CREATED}",
        )
        self.telemetry.emit(
            "upstream_cut", op=attempt.ident.op_id, flow=flow.id,
            session=attempt.ident.session, reason=MISSING_RESPONSE_CREATED,
            after_ms=round(self.settings.response_created_timeout_s * 1000),
            headers_seen=attempt.status is not None, cut=why_not is None, why_not=why_not,
        )
        if why_not is not None:
            logger.warning("turnguard: could not cut the upstream of %s: %s", flow.id, why_not)
        else:
            self._show(flow, MARK_CUT, "turnguard: no response event within "
                       f"{round(self.settings.response_created_timeout_s * 1000)} ms "
                       f"({MISSING_RESPONSE_CREATED}); cut the upstream connection")

    async def _wait(
        self, flow: http.HTTPFlow, op_key: str, hold: policy.Hold | None, timeout_s: float,
        *, cooldown: bool = False, session: str | None = None, epoch: int | None = None,
    ) -> "_Ended | _Gone | _OwnershipLost | None":
        """Wait for the attempt in flight to end (or, ``cooldown``, for the timeout alone).
        None: the bound passed first."""
        wake = asyncio.get_running_loop().create_future()
        foreign = None
        if hold is not None and op_key not in self._local:
            foreign = hold.attempt_id or 0
        self._held[flow.id] = _Held(
            flow, op_key, time.monotonic(), wake, foreign, cooldown, session, epoch
        )
        try:
            return await asyncio.wait_for(wake, timeout_s)
        except TimeoutError:
            return None
        finally:
            self._held.pop(flow.id, None)

    def _wake(self, op_key: str, why: _Ended) -> None:
        for held in list(self._held.values()):
            if held.op_key == op_key and not held.cooldown and not held.wake.done():
                held.wake.set_result(why)

    @staticmethod
    def _proxyserver():
        try:
            return ctx.master.addons.get("proxyserver")
        except AttributeError:  # no master (unit tests)
            return None

    def _client_gone(self, flow: http.HTTPFlow) -> str | None:
        """Why the client of a held flow no longer wants an answer, if it does not."""
        if flow.error is not None:
            return "killed"
        if not flow.client_conn.connected:
            return "client disconnected"
        if flow.request.http_version == "HTTP/2.0":
            layer = self._http_layers.get(flow.client_conn.id)
            if layer is None:
                layer = find_http_layer(self._proxyserver(), flow.client_conn.id)
                if layer is not None:
                    self._http_layers[flow.client_conn.id] = layer
            if layer is not None and client_stream_closed(layer, flow, flow.client_conn):
                return "stream reset by client"
        return None

    def _wake_gone_flows(self) -> None:
        for held in list(self._held.values()):
            reason = self._client_gone(held.flow)
            if reason is not None and not held.wake.done():
                held.wake.set_result(_Gone(reason))

    async def _check_cooldown_sessions(self, now: float) -> None:
        """Renew the leases of sessions with requests held through a cooldown, and wake those
        requests if another process took the session."""
        lease_s = self.settings.owner_lease_s
        for session, epoch in {(h.session, h.epoch) for h in self._held.values() if h.cooldown}:
            owned = self._sessions.get(session)
            if owned is None or owned.lease_until - now < lease_s * 2 / 3:
                kept = await self._ledger("renew_session", "renew_session", session, epoch,
                                          now=now, lease_s=lease_s)
                if kept is True and owned is not None:
                    self._sessions[session] = dataclasses.replace(
                        owned, lease_until=now + lease_s
                    )
            else:
                kept = await self._ledger("renew_session", "session_owned_by", session,
                                          self.instance_id, epoch)
            if kept is False:
                self._sessions.pop(session, None)
                for held in list(self._held.values()):
                    if held.cooldown and held.session == session and not held.wake.done():
                        held.wake.set_result(_OwnershipLost(epoch))

    async def _poll_foreign(self) -> None:
        """Operations another process owns: wake their waiters once the attempt changed."""
        now = time.time()
        if now - self._last_reap >= 1.0:
            await self._reap_dead(now)
        for op_key in {h.op_key for h in self._held.values() if h.foreign_attempt is not None}:
            snap = await self._ledger("poll", "snapshot", op_key)
            if snap is _UNAVAILABLE:
                return
            watched = {h.foreign_attempt for h in self._held.values() if h.op_key == op_key}
            if snap is None or snap.state != "in_flight" or snap.current_attempt not in watched:
                self._wake(op_key, _Ended(snap.state if snap else "gone"))

    def _abandon(self, flow: http.HTTPFlow, base: dict, gone: _Gone, held_since: float) -> None:
        self.telemetry.emit("hold_abandoned", **base, reason=gone.reason,
                            held_ms=round((time.monotonic() - held_since) * 1000))
        if flow.killable:
            flow.kill()  # never dispatch a request whose client is gone

    def _reject_in_progress(self, flow: http.HTTPFlow, base: dict, held_since: float) -> None:
        held_ms = round((time.monotonic() - held_since) * 1000)
        retry_after = policy.retry_after_seconds(1)
        self.telemetry.emit("duplicate_rejected", **base, held_ms=held_ms,
                            retry_after_s=retry_after, answer_status=409, code="turn_in_progress")
        self._answer(flow, answers.turn_in_progress(retry_after, held_ms), MARK_REJECTED,
                     f"turnguard: held {held_ms} ms; the original was still in flight, "
                     "answered 409 turn_in_progress")

    def _cooldown_reject(
        self, flow: http.HTTPFlow, base: dict, remaining_s: float, reason: str
    ) -> None:
        """503 during a cooldown, nothing dispatched (the default mode's answer)."""
        retry_after = policy.retry_after_seconds(remaining_s)
        self.telemetry.emit("cooldown_rejected", **base, retry_after_s=retry_after,
                            cooldown_remaining_ms=round(remaining_s * 1000), reason=reason,
                            answer_status=503, code="upstream_request_timeout")
        if reason != "mode_fail_closed":
            self.telemetry.emit("fail_closed", **base, reason=reason)
        answer = answers.cooldown_rejected(
            retry_after, self.settings.circuit.threshold, accepts_sse=_accepts_sse(flow)
        )
        self._answer(flow, answer, MARK_REJECTED,
                     f"turnguard: cooldown, answered 503 without dispatching ({reason})")

    async def _fail_closed(
        self, flow: http.HTTPFlow, base: dict, scope: str, reason: str,
        code: str = "upstream_request_timeout",
    ) -> None:
        """503 for a request that may not be recovered (owner proof lost, budget spent, claim
        exhausted, output exists, ledger unusable). Nothing is dispatched."""
        now = time.time()
        state = await self._ledger("fail_closed", "circuit_state", scope)
        if state is _UNAVAILABLE:
            state = self._circuits.get(scope, circuit.CircuitState())
        remaining = state.remaining_s(now)
        retry_after = policy.retry_after_seconds(remaining)
        self.telemetry.emit("fail_closed", **base, reason=reason, code=code,
                            retry_after_s=retry_after, answer_status=503)
        answer = answers.failed_closed(code, reason, retry_after, accepts_sse=_accepts_sse(flow))
        self._answer(flow, answer, MARK_REJECTED,
                     f"turnguard: failed closed with 503 {code} ({reason})")

    # -- answers ---------------------------------------------------------------------------------
    async def _replay(
        self, flow: http.HTTPFlow, ident: identity.Identity, rec: Recording, held_ms: int,
        attempt_id: int | None,
    ) -> bool:
        """Answer the flow from the recording, in a form its request accepts (see
        ``negotiation``): as recorded, byte for byte, when it can; decoded or re-encoded for a
        client that does not accept the recorded content coding. False: the recording may not
        be replayed to this request (``Vary``, or no acceptable coding); the flow is then
        forwarded, with a ``replay_declined`` event."""
        request_headers = tuple(flow.request.headers.items(multi=True))
        how = negotiation.plan(rec.headers, rec.vary_key, request_headers)
        headers, body = rec.headers, rec.body
        if isinstance(how, negotiation.Recode):
            # decoding and encoding megabytes takes a while: not on the event loop
            how = await asyncio.to_thread(
                negotiation.recode, rec.headers, rec.body, how, BoundedCodec(MAX_RECODED_BODY)
            )
            if isinstance(how, negotiation.Serve):
                headers, body = how.headers, how.body
        if isinstance(how, negotiation.Decline):
            self.telemetry.emit("replay_declined", op=ident.op_id, flow=flow.id,
                                session=ident.session, held_ms=held_ms, reason=how.reason)
            self._show(flow, None, f"turnguard: not replayed ({how.reason}); forwarded")
            return False
        resp = http.Response.make(rec.status, b"", _headers(headers))
        resp.raw_content = body  # as recorded, or as negotiated: never re-encoded by mitmproxy
        resp.headers["content-length"] = str(len(body))
        resp.headers["x-turnguard"] = "replayed"
        flow.response = resp
        flow.metadata["turnguard"] = {"role": "replay", "op": ident.op_id}
        self.telemetry.emit(
            "duplicate_replayed", op=ident.op_id, flow=flow.id, session=ident.session,
            held_ms=held_ms, status=rec.status, bytes=len(body), attempt=attempt_id,
            recoded=isinstance(how, negotiation.Serve),
        )
        self._note_duplicate(ident.op_key, replayed=1)
        self._show(flow, MARK_REPLAYED, f"turnguard: replayed the recorded response of "
                   f"operation {ident.op_id} ({len(body)} bytes) after {held_ms} ms; "
                   "nothing was sent upstream")
        return True

    def _answer(self, flow: http.HTTPFlow, a: answers.Answer, mark: str, comment: str) -> None:
        flow.response = http.Response.make(a.status, a.body, _headers(a.headers))
        flow.metadata["turnguard"] = {"role": "answered", "status": a.status}
        self._show(flow, mark, comment)

    def _show(self, flow: http.HTTPFlow, mark: str | None, comment: str) -> None:
        """Explain the flow in mitmweb (mark + comment) and make the UI refresh it."""
        if mark is not None:
            flow.marked = mark
        flow.comment = comment
        if self._has_view is None:
            try:
                self._has_view = ctx.master.addons.get("view") is not None
            except AttributeError:  # no master (unit tests)
                self._has_view = False
        if self._has_view:  # mitmweb or the console: refresh the flow there
            ctx.master.addons.trigger(hooks.UpdateHook([flow]))

    # -- the original's response -----------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        attempt = self._attempts.get(flow.id)
        if attempt is None or flow.response is None:
            return
        try:
            resp = flow.response
            attempt.status = resp.status_code
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            is_sse = resp.headers.get("content-type", "").lower().startswith("text/event-stream")
            counts_events = is_sse and encoding in ("", "identity") and 200 <= resp.status_code < 300
            if is_sse and encoding not in ("", "identity"):
                self.telemetry.emit(
                    "passthrough", op=attempt.ident.op_id, flow=flow.id,
                    reason=f"response content-encoding {encoding}: events not counted",
                )
            if not counts_events:
                attempt.stop_timer()  # an answer that is not an event stream is its own event
            keep = self.settings.replay_max_bytes if self.settings.guard.replay else 0
            attempt.tee = ResponseTee(
                counts_events=counts_events,
                keep_max_bytes=keep if 200 <= resp.status_code < 300 else 0,
                on_first_event=lambda: self._first_event(attempt),
            )
            resp.stream = attempt.tee
        except Exception:
            logger.exception("turnguard: responseheaders hook failed for %s", flow.id)

    def _first_event(self, attempt: _Attempt) -> None:
        """The attempt has output now. The ledger learns it a moment later, and not at all
        when the attempt ends first (its finish records the events): one transaction less
        for short responses; a crash within that moment records ``unknown``, not ``partial``."""
        attempt.stop_timer()
        attempt.first_event_at = time.monotonic()
        if attempt.attempt_id is not None:
            asyncio.get_running_loop().call_later(
                FIRST_EVENT_DELAY_S, self._record_first_event, attempt
            )

    def _record_first_event(self, attempt: _Attempt) -> None:
        if attempt.flow_id in self._attempts and self._ledger_usable():
            self._submit("first_event", attempt.attempt_id)

    def _note_duplicate(self, op_key: str, *, held: int = 0, replayed: int = 0) -> None:
        """Count a duplicate on its operation in the ledger (for ``scripts/turnguard``), without
        waiting; skipped while the ledger is down."""
        if self._ledger_usable():
            self._submit("note_duplicates", op_key, held=held, replayed=replayed)

    def _submit(self, call: str, /, *args: Any, then=None, **kwargs: Any) -> asyncio.Future:
        """Queue a ledger write without waiting for it (from a sync hook or the stream tee).
        ``then(result)`` runs on the event loop afterwards; a fault is noted there. Returns
        the future of the write, for a caller that wants to wait after all."""
        future = asyncio.wrap_future(self.db.submit(call, *args, **kwargs))

        def done(f: asyncio.Future) -> None:
            error = f.exception()
            if error is not None:
                self._ledger_down(error, call)
            if then is not None:
                then(None if error is not None else f.result())

        future.add_done_callback(done)
        return future

    def response(self, flow: http.HTTPFlow) -> None:
        self._end_attempt(flow, body_complete=True)

    async def error(self, flow: http.HTTPFlow) -> None:
        """A failed attempt is recorded before the client hears of the failure (a bounded
        wait): a retry it sends at once, through any process sharing the ledger, then sees
        the failure and the circuit it fed."""
        recorded = self._end_attempt(flow, body_complete=False)
        if recorded is not None:
            await asyncio.wait([recorded], timeout=ERROR_RECORD_WAIT_S)

    def _end_attempt(self, flow: http.HTTPFlow, *, body_complete: bool) -> asyncio.Future | None:
        attempt = self._attempts.pop(flow.id, None)
        if attempt is None:
            return None
        attempt.stop_timer()
        why, recorded = _Ended("unknown"), None
        try:
            why, recorded = self._record_end(flow, attempt, body_complete)
        except Exception:
            logger.exception("turnguard: recording the outcome of %s failed", flow.id)
        finally:
            if self._local.get(attempt.ident.op_key) == flow.id:
                del self._local[attempt.ident.op_key]
            # Held duplicates wake now: a recording is replayed from memory; anything else is
            # admitted again, and the ledger runs that after this attempt's finish.
            self._wake(attempt.ident.op_key, why)
        return recorded

    def _record_end(
        self, flow: http.HTTPFlow, attempt: _Attempt, body_complete: bool
    ) -> tuple[_Ended, asyncio.Future | None]:
        """Classify the attempt's end, say so, and queue its record (and its circuit's)."""
        tee = attempt.tee
        if tee is None and body_complete and flow.response is not None:
            # No streaming happened (e.g. another addon answered): read the whole body.
            tee = ResponseTee(counts_events=False, keep_max_bytes=0)
            tee(flow.response.raw_content or b"")
            tee(b"")
        events = tee.events_seen if tee else 0
        status = flow.response.status_code if flow.response is not None else None
        complete = body_complete and (tee is None or tee.ended)
        outcome = policy.classify_outcome(
            status=status,
            events_seen=events,
            terminal=tee.terminal if tee else None,
            body_complete=complete,
            counts_events=tee.counts_events if tee else False,
        )
        recording, not_recorded = None, None
        if outcome == "completed" and tee is not None and tee.body is not None:
            response_headers = recordable_headers(flow.response.headers.items(multi=True))
            vary = negotiation.vary_names(response_headers)
            if vary is None:
                not_recorded = "Vary: *"
            else:
                recording = Recording(
                    status, response_headers, tee.body,
                    negotiation.vary_key(vary, flow.request.headers.items(multi=True)),
                )
        detail = flow.error.msg if flow.error else None
        failure = None
        if outcome == "unknown":
            failure = policy.failure_class(
                cut_reason=attempt.cut_reason, status=status, error=detail,
                body_complete=complete, client_gone=not flow.client_conn.connected,
            )
        eventless = failure is not None and policy.counts_for_circuit(failure)
        base = {"op": attempt.ident.op_id, "flow": flow.id, "session": attempt.ident.session}
        self.telemetry.emit(
            "outcome", **base, attempt=attempt.attempt_id, kind=attempt.kind, outcome=outcome,
            events_seen=events, status=status,
            duration_ms=round((time.monotonic() - attempt.started) * 1000),
            first_event_ms=(None if attempt.first_event_at is None
                            else round((attempt.first_event_at - attempt.started) * 1000, 1)),
            replayable=recording is not None, detail=detail,
            not_replayable_reason=(
                None if recording is not None or outcome != "completed"
                else not_recorded
                or ("over turnguard_replay_max_bytes" if tee and tee.over_cap else "replay off")
            ),
        )
        if failure is not None:
            self.telemetry.emit(
                "eventless_failure", **base, failure_class=failure, events_seen=events,
                status=status, counts_for_circuit=eventless, detail=detail,
            )
        now = time.time()

        def in_memory(result: FinishResult | None = None) -> None:
            if result is None:  # no ledger: keep the circuit in memory
                before = self._circuits.get(attempt.circuit_scope, circuit.CircuitState())
                after, transition = circuit.record_outcome(
                    before, eventless_failure=eventless, completed=outcome == "completed",
                    now=now, cfg=self.settings.circuit,
                )
                result = FinishResult(True, attempt.circuit_scope, after, transition)
            elif not result.applied:
                self.telemetry.emit("outcome_fenced_out", **base, attempt=attempt.attempt_id,
                                    reason="the attempt was ended meanwhile (reaped)")
            self._note_circuit(result)

        recorded = None
        if attempt.attempt_id is not None and self._ledger_usable():
            recorded = self._submit(
                "finish", attempt.attempt_id,
                AttemptEnd(outcome, status, events, failure or detail, recording),
                now=now, circuit_cfg=self.settings.circuit, eventless_failure=eventless,
                then=in_memory,
            )
        else:
            in_memory()
        return _Ended(outcome, recording), recorded

    def _note_circuit(self, result: FinishResult) -> None:
        if result.circuit_scope is None or result.circuit is None:
            return
        self._circuits[result.circuit_scope] = result.circuit
        if result.transition is not None:
            view = dict(self._circuit_view)
            view.pop(result.circuit_scope, None)
            if result.transition == "opened" and result.circuit.open_until is not None:
                view[result.circuit_scope] = result.circuit.open_until
            self._circuit_view = view
        if result.transition == "opened":
            self.telemetry.emit(
                "circuit_opened", scope=result.circuit_scope, failures=result.circuit.failures,
                cooldown_ms=round((result.circuit.cooldown_s or 0) * 1000),
                open_until=result.circuit.open_until,
            )
        elif result.transition == "reset":
            self.telemetry.emit("circuit_reset", scope=result.circuit_scope)

    def update(self, flows) -> None:
        """A flow was changed elsewhere (e.g. killed with the flow.kill command): wake it if held."""
        for f in flows:
            held = self._held.get(f.id)
            if held is not None and f.error is not None and not held.wake.done():
                held.wake.set_result(_Gone("killed"))

    # -- commands --------------------------------------------------------------------------------
    @command.command("turnguard.status")
    def status(self) -> str:
        """turnguard's state as JSON: mode, ledger, operations by state, flows in flight and
        held, circuits cooling down, counts of its telemetry events."""
        now = time.time()
        ledger_counts: dict[str, Any] = {}
        cooldowns = [
            (scope, state) for scope, state in self._circuits.items() if state.remaining_s(now)
        ]
        if self._ledger_usable():
            try:
                ledger_counts = self.db.call_sync("counts", timeout=STATUS_TIMEOUT_S)
                cooldowns = self.db.call_sync("open_circuits", now, timeout=STATUS_TIMEOUT_S)
            except (LedgerError, TimeoutError) as e:
                ledger_counts = {"error": str(e) or "ledger busy"}
        return json.dumps(
            {
                "instance": self.instance_id,
                "recovery_mode": self.settings.recovery_mode,
                "ledger": self.ledger_path,
                "ledger_ok": self.db is not None and self.ledger_error is None,
                "ledger_error": self.ledger_error,
                "operations_by_state": ledger_counts,
                "in_flight": len(self._attempts),
                "held_duplicates": sum(not h.cooldown for h in self._held.values()),
                "held_through_cooldown": sum(h.cooldown for h in self._held.values()),
                "cooldowns": [
                    {"scope": scope, "failures": st.failures,
                     "remaining_ms": round(st.remaining_s(now) * 1000),
                     "cooldown_ms": round((st.cooldown_s or 0) * 1000)}
                    for scope, st in cooldowns
                ],
                "owned_sessions": len(self._sessions),
                "events": dict(self.telemetry.counts),
            },
            indent=2,
        )

    @command.command("turnguard.circuit.list")
    def circuit_list(self) -> str:
        """Retry circuits that count failures or cool down, as JSON (from the ledger; this
        process's last known ones when it is down)."""
        now = time.time()
        try:
            rows = [(r.scope, r.state) for r in self._control("circuits", now)]
        except exceptions.CommandError:
            rows = [(k, v) for k, v in self._circuits.items() if v.failures or v.remaining_s(now)]
        return json.dumps([
            {"scope": scope, "failures": st.failures,
             "remaining_ms": round(st.remaining_s(now) * 1000),
             "cooldown_ms": round((st.cooldown_s or 0) * 1000)}
            for scope, st in rows
        ], indent=2)

    @command.command("turnguard.circuit.clear")
    def circuit_clear(self, scope: str) -> str:
        """Close a retry circuit by hand: its scope (or a unique prefix; ``all``: every circuit
        with failures). Audited in the ledger; requests held through its cooldown go on to
        their recovery claim, and the next request dispatches. In once mode an operation still
        gets at most one recovery dispatch ever."""
        now = time.time()
        cleared = self._control("clear_circuits", None if scope == "all" else scope, now=now,
                                actor=self._actor("turnguard.circuit.clear"))
        self._circuits = {k: v for k, v in self._circuits.items()
                          if k not in {r.scope for r in cleared}}
        self._circuit_view = {k: v for k, v in self._circuit_view.items()
                              if k not in {r.scope for r in cleared}}
        self._wake_cleared(set(self._circuit_view))
        for row in cleared:
            self.telemetry.emit(
                "circuit_cleared", scope=row.scope, failures=row.state.failures,
                remaining_ms=round(row.state.remaining_s(now) * 1000), by="command",
            )
        return json.dumps({"cleared": [r.scope for r in cleared]}, indent=2)

    @command.command("turnguard.session.release")
    def session_release(self, session: str) -> str:
        """Release a durable session (its id or a unique prefix): no process owns it, its
        epoch goes up (writes fenced with the old one fail), the next process to serve it
        takes it over. Audited in the ledger."""
        key, before, after = self._control("release_session", session, now=time.time(),
                                           actor=self._actor("turnguard.session.release"))
        self._sessions.pop(key, None)
        self.telemetry.emit(
            "session_released", session=key, owner_was=before.owner_instance,
            epoch_was=before.owner_epoch, epoch=after.owner_epoch, by="command",
        )
        return json.dumps({"released": key, "owner_was": before.owner_instance,
                           "epoch": after.owner_epoch}, indent=2)

    def _actor(self, command_name: str) -> str:
        return f"{command_name} (instance {self.instance_id}, pid {os.getpid()})"

    def _control(self, call: str, /, *args: Any, **kwargs: Any) -> Any:
        """A control command's ledger call, waited for here (bounded)."""
        if not self._ledger_usable():
            raise exceptions.CommandError(
                f"turnguard: the ledger is not usable now ({self.ledger_error or 'not open'})")
        try:
            return self.db.call_sync(call, *args, timeout=STATUS_TIMEOUT_S, **kwargs)
        except TimeoutError:
            raise exceptions.CommandError(  # it stays queued: it may still be applied
                "turnguard: the ledger is busy; the action may still apply: check with "
                "turnguard.circuit.list or scripts/turnguard audit") from None
        except LedgerError as e:
            raise exceptions.CommandError(f"turnguard: {e}") from None

    @command.command("turnguard.held")
    def held(self) -> str:
        """One line per held flow: flow id, operation, seconds held, and what it waits for."""
        now = time.monotonic()
        lines = []
        for flow_id, h in self._held.items():
            if h.cooldown:
                what = "the retry circuit's cooldown to end"
            elif h.foreign_attempt is not None:
                what = "an attempt in another process"
            else:
                what = "an attempt in this process"
            route = identity.split_target(h.flow.request.path).route  # no key from the URL
            lines.append(
                f"{flow_id} op={h.op_key[:12]} held={now - h.since:.1f}s waiting for {what}: "
                f"{h.flow.request.method} {route}"
            )
        return "\n".join(lines) if lines else "no held flows"


addons = [TurnGuard()]
