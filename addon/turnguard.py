"""turnguard: hold duplicate AI model turns instead of executing them twice.

Load it with ``mitmdump -s addon/turnguard.py --mode reverse:https://api.openai.com``. This file is
the imperative shell: the only code that speaks mitmproxy. It translates hooks into calls on the
pure core (``turnguard_core``: identity, policy, SSE, tee) and the ledger, and the core's decisions
into flow actions. "What happens to a duplicate" is ``TurnGuard._guard``.
"""


import asyncio
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

# mitmproxy puts this folder on sys.path only while it loads the script: import the core now.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from mitmproxy import command, ctx, exceptions, flowfilter, hooks, http  # noqa: E402

from turnguard_core import answers, identity, policy  # noqa: E402
from turnguard_core.ledger import (  # noqa: E402
    AttemptEnd,
    Ledger,
    LedgerError,
    Recording,
    instance_is_dead,
)
from turnguard_core.tee import ResponseTee, recordable_headers  # noqa: E402
from turnguard_core.telemetry import Telemetry  # noqa: E402

logger = logging.getLogger("turnguard")

DEFAULT_FILTER = (
    '~m POST & ~u "/(v1/responses|backend-api/codex/responses|v1/chat/completions)/?([?]|$)"'
)
MAX_GUARDED_BODY = 64 * 1024 * 1024
FOREIGN_POLL_S = 0.2  # re-check an operation another process owns (issue: 100-250 ms)
TICK_S = 1.0  # notice killed or disconnected held flows; heartbeat
HEARTBEAT_S = 5.0
INSTANCE_STALE_S = 30.0
GC_EVERY_S = 600.0

MARK_HELD = ":hourglass:"
MARK_REPLAYED = ":recycle:"
MARK_REJECTED = ":no_entry:"


@dataclass
class _Attempt:
    """A guarded flow this process dispatched upstream, until its outcome is recorded."""

    flow_id: str
    ident: identity.Identity
    attempt_id: int | None  # None when the ledger was unavailable
    kind: str
    started: float
    status: int | None = None
    tee: ResponseTee | None = None


@dataclass
class _Held:
    """A duplicate waiting for the operation's attempt in flight to end."""

    flow: http.HTTPFlow
    op_key: str
    since: float
    wake: asyncio.Future
    foreign_attempt: int | None = None  # set when another process owns the attempt


@dataclass(frozen=True)
class _Ended:
    """Why a held flow woke up: the attempt ended (maybe with a recording to replay)."""

    outcome: str
    recording: Recording | None = None


@dataclass(frozen=True)
class _Gone:
    """Why a held flow woke up: it was killed or its client went away."""

    reason: str


@dataclass
class _Stats:
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1


def _headers(pairs) -> http.Headers:
    return http.Headers(
        [(k.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape")) for k, v in pairs]
    )


class TurnGuard:
    def __init__(self) -> None:
        self.instance_id = uuid.uuid4().hex[:16]
        self.ledger: Ledger | None = None
        self.ledger_path = ""
        self.ledger_error: str | None = None
        self.telemetry = Telemetry()
        self.filter: flowfilter.TFilter | None = None
        self.guard_policy = policy.GuardPolicy()
        self._attempts: dict[str, _Attempt] = {}  # flow id -> attempt in flight
        self._local: dict[str, str] = {}  # op key -> flow id of this process's attempt in flight
        self._held: dict[str, _Held] = {}  # flow id -> held duplicate
        self._ticker: asyncio.Task | None = None
        self._last_heartbeat = 0.0
        self._last_gc = 0.0
        self._last_reap = 0.0

    # -- options ---------------------------------------------------------------------------------
    def load(self, loader) -> None:
        loader.add_option(
            "turnguard_ledger", str, "",
            "Path of the SQLite ledger shared by every turnguard process that guards the same "
            "upstream. Empty: <confdir>/turnguard.sqlite3.",
        )
        loader.add_option(
            "turnguard_filter", str, DEFAULT_FILTER,
            "mitmproxy filter expression for the flows turnguard guards; everything else passes "
            "untouched.",
        )
        loader.add_option(
            "turnguard_hold_timeout_ms", int, 30000,
            "How long a duplicate is held waiting for the original; past it the duplicate gets "
            "409 turn_in_progress with Retry-After. 0: answer duplicates 409 at once.",
        )
        loader.add_option(
            "turnguard_request_budget_ms", int, 120000,
            "Upper bound on the time turnguard may keep any one request waiting, whatever the "
            "reason.",
        )
        loader.add_option(
            "turnguard_replay", bool, True,
            "Record completed responses and answer duplicates and retries from the recording. "
            "false: store no response bodies; held duplicates are forwarded one at a time.",
        )
        loader.add_option(
            "turnguard_replay_window_ms", int, 300000,
            "A retry with an identical body (no Idempotency-Key) that arrives this long after "
            "the original completed is answered from the recording; later it is a new operation.",
        )
        loader.add_option(
            "turnguard_retention_ms", int, 86400000,
            "How long ended operations and their recordings stay in the ledger (and how long an "
            "Idempotency-Key is remembered).",
        )
        loader.add_option(
            "turnguard_replay_max_bytes", int, 8 * 1024 * 1024,
            "Largest response body recorded for replay; a larger one is not replayable and its "
            "duplicates are forwarded instead.",
        )
        loader.add_option(
            "turnguard_events", str, "",
            "Path of a JSON-lines telemetry file (created 0600); empty: telemetry goes to the "
            "log only.",
        )

    def configure(self, updated: set[str]) -> None:
        o = ctx.options
        for name in (
            "turnguard_hold_timeout_ms", "turnguard_replay_window_ms", "turnguard_replay_max_bytes",
        ):
            if getattr(o, name) < 0:
                raise exceptions.OptionsError(f"{name} must be >= 0, not {getattr(o, name)}")
        for name in ("turnguard_request_budget_ms", "turnguard_retention_ms"):
            if getattr(o, name) <= 0:
                raise exceptions.OptionsError(f"{name} must be > 0, not {getattr(o, name)}")
        if o.turnguard_retention_ms < o.turnguard_replay_window_ms:
            raise exceptions.OptionsError(
                "turnguard_retention_ms must be >= turnguard_replay_window_ms "
                f"({o.turnguard_retention_ms} < {o.turnguard_replay_window_ms})"
            )
        if "turnguard_filter" in updated:
            try:
                self.filter = flowfilter.parse(o.turnguard_filter)
            except ValueError as e:
                raise exceptions.OptionsError(f"turnguard_filter: {e}") from e
        self.guard_policy = policy.GuardPolicy(
            replay=o.turnguard_replay,
            replay_window_s=o.turnguard_replay_window_ms / 1000,
            retention_s=o.turnguard_retention_ms / 1000,
        )
        if "turnguard_events" in updated:
            try:
                telemetry = Telemetry(os.path.expanduser(o.turnguard_events) or None)
            except OSError as e:
                raise exceptions.OptionsError(
                    f"turnguard_events: cannot open {o.turnguard_events!r}: {e.strerror}"
                ) from e
            self.telemetry.close()
            self.telemetry = telemetry
        if "turnguard_ledger" in updated or "confdir" in updated:
            self._open_ledger(self._ledger_path())

    def _ledger_path(self) -> str:
        if ctx.options.turnguard_ledger:
            return os.path.abspath(os.path.expanduser(ctx.options.turnguard_ledger))
        confdir = os.path.expanduser(ctx.options.confdir)
        os.makedirs(confdir, mode=0o700, exist_ok=True)
        return os.path.join(confdir, "turnguard.sqlite3")

    def _open_ledger(self, path: str) -> None:
        if self.ledger is not None:
            self.ledger.close()
        self.ledger, self.ledger_path = None, path
        folder = os.path.dirname(path)
        if not os.path.isdir(folder):
            raise exceptions.OptionsError(f"turnguard_ledger: folder {folder} does not exist")
        ledger = Ledger(path, self.instance_id)
        try:
            ledger.open(time.time())
        except LedgerError as e:
            if "world-writable" in str(e) or "writable by others" in str(e):
                raise exceptions.OptionsError(f"turnguard_ledger: refused: {e}") from e
            self._ledger_down(e, "open")
            return
        self.ledger, self.ledger_error = ledger, None
        logger.info("turnguard: ledger %s (instance %s)", path, self.instance_id)
        self._maintain(time.time(), force=True)

    def _ledger_down(self, error: Exception, during: str) -> None:
        """Note that the ledger failed; turnguard goes on coalescing in memory."""
        if self.ledger_error is None:
            logger.error("turnguard: ledger %s unusable (%s): %s", self.ledger_path, during, error)
        self.ledger_error = str(error)
        self.telemetry.emit("ledger_unavailable", during=during, error=str(error))

    # -- lifecycle -------------------------------------------------------------------------------
    def running(self) -> None:
        self._ensure_ticker()

    def done(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self.ledger is not None:
            self.ledger.close()
        self.telemetry.close()

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def _tick_forever(self) -> None:
        """One task for the whole process: wakes held flows that were killed or whose client
        left, re-checks operations owned by other processes, heartbeats and collects garbage.
        It sleeps longer when nothing is held, so an idle proxy does no work."""
        while True:
            foreign = any(h.foreign_attempt is not None for h in self._held.values())
            await asyncio.sleep(FOREIGN_POLL_S if foreign else TICK_S)
            try:
                self._wake_gone_flows()
                if foreign:
                    self._poll_foreign()
                self._maintain(time.time())
            except Exception:
                logger.exception("turnguard: maintenance tick failed")

    def _maintain(self, now: float, force: bool = False) -> None:
        if self.ledger is None:
            if self.ledger_path and (force or now - self._last_heartbeat >= HEARTBEAT_S):
                self._last_heartbeat = now
                self._open_ledger(self.ledger_path)  # recover by itself when the fault is gone
            return
        try:
            if force or now - self._last_heartbeat >= HEARTBEAT_S:
                self._last_heartbeat = now
                self.ledger.heartbeat(now)
            if force or now - self._last_reap >= HEARTBEAT_S:
                self._last_reap = now
                self._reap_dead(now)
            if force or now - self._last_gc >= GC_EVERY_S:
                self._last_gc = now
                n = self.ledger.collect_garbage(
                    now=now, retention_s=self.guard_policy.retention_s,
                    instance_stale_s=INSTANCE_STALE_S,
                )
                if n:
                    self.telemetry.emit("ledger_gc", operations_deleted=n)
        except LedgerError as e:
            self._ledger_down(e, "maintenance")

    def _reap_dead(self, now: float) -> None:
        """Attempts left in flight by a dead process become ``unknown`` (or ``partial``)."""
        for row in self.ledger.instances_with_attempts_in_flight():
            if instance_is_dead(row, host=self.ledger.host, now=now, stale_s=INSTANCE_STALE_S):
                ops = self.ledger.reap_instance(row.instance_id, now=now)
                self.telemetry.emit(
                    "instance_reaped", instance=row.instance_id, pid=row.pid,
                    operations=[k[:12] for k in ops],
                )

    # -- the guard -------------------------------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        if self.filter is None or flow.response is not None or not self.filter(flow):
            return
        self._ensure_ticker()
        try:
            await self._guard(flow)
        except Exception as e:  # never break traffic: the flow goes on as a plain proxy's would
            logger.exception("turnguard: request hook failed; forwarding %s unguarded", flow.id)
            self.telemetry.emit("passthrough", flow=flow.id, reason=f"internal error: {e!r}")

    async def _guard(self, flow: http.HTTPFlow) -> None:
        """What happens to a guarded request, and so to a duplicate.

        Admit it against the ledger: dispatch (the first, or a retry after a failed attempt),
        replay (a completed recording), conflict (422), or hold while another attempt of the
        same operation is in flight. A held request waits, event-driven, for that attempt to
        end, then is admitted again; past the hold bound it gets 409 turn_in_progress."""
        ident = self._identify(flow)
        if isinstance(ident, identity.Passthrough):
            self.telemetry.emit("passthrough", flow=flow.id, reason=ident.reason)
            return
        o = ctx.options
        arrived = time.monotonic()
        deadline = policy.hold_deadline(
            arrived,
            hold_timeout_s=o.turnguard_hold_timeout_ms / 1000,
            request_budget_s=o.turnguard_request_budget_ms / 1000,
        )
        base = {"op": ident.op_id, "flow": flow.id, "session": ident.session}
        held_since: float | None = None
        while True:
            admission = self._admit(flow, ident)
            held_ms = 0 if held_since is None else round((time.monotonic() - held_since) * 1000)
            if isinstance(admission, policy.Dispatch):
                self._dispatch(flow, ident, admission)
                self.telemetry.emit(
                    "dispatch", **base, attempt=admission.attempt_id, kind=admission.kind,
                    ledger=admission.attempt_id is not None,
                )
                if held_since is not None:
                    self.telemetry.emit("duplicate_forwarded", **base, held_ms=held_ms)
                    self._show(flow, None, f"turnguard: held {held_ms} ms, then forwarded "
                               f"(the earlier attempt of {ident.op_id} did not complete)")
                return
            if isinstance(admission, policy.Replay):
                recording = self._recording(admission.attempt_id)
                if recording is None:
                    self.telemetry.emit("passthrough", **base, reason="recording missing")
                    return
                self._replay(flow, ident, recording, held_ms, admission.attempt_id)
                return
            if isinstance(admission, policy.Conflict):
                self.telemetry.emit("idempotency_key_conflict", **base)
                self._answer(flow, answers.idempotency_key_conflict(), MARK_REJECTED,
                             "turnguard: Idempotency-Key reused with a different body")
                return
            # Hold: another attempt of this operation is in flight.
            now = time.monotonic()
            if held_since is None:
                held_since = now
                self.telemetry.emit(
                    "duplicate_held", **base, attempt=admission.attempt_id,
                    owner=admission.owner_instance,
                    timeout_ms=max(0, round((deadline - now) * 1000)),
                )
                self._show(flow, MARK_HELD, f"turnguard: held as a duplicate of operation "
                           f"{ident.op_id}, waiting for its attempt in flight")
            if now >= deadline:
                self._reject_in_progress(flow, base, held_since)
                return
            woke = await self._wait(flow, ident.op_key, admission, deadline - now)
            if woke is None:
                self._reject_in_progress(flow, base, held_since)
                return
            if isinstance(woke, _Gone):
                self.telemetry.emit("hold_abandoned", **base, reason=woke.reason,
                                    held_ms=round((time.monotonic() - held_since) * 1000))
                if flow.killable:
                    flow.kill()  # never dispatch a request whose client is gone
                return
            if woke.recording is not None:
                held_ms = round((time.monotonic() - held_since) * 1000)
                self._replay(flow, ident, woke.recording, held_ms, None)
                return
            # The attempt ended without a recording: admit again (claim, replay or hold anew).

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
        view = identity.RequestView(
            method=req.method,
            path=req.path,
            headers=tuple(req.headers.items(multi=True)),
            body=body,
        )
        return identity.identify(view, max_body_bytes=MAX_GUARDED_BODY)

    def _admit(self, flow: http.HTTPFlow, ident: identity.Identity) -> policy.Admission:
        local_flow = self._local.get(ident.op_key)
        if local_flow is not None:
            attempt = self._attempts.get(local_flow)
            return policy.Hold(attempt.attempt_id if attempt else None, self.instance_id)
        if self.ledger is not None:
            try:
                return self.ledger.admit(
                    ident, method=flow.request.method, path=flow.request.path,
                    now=time.time(), guard=self.guard_policy, flow_id=flow.id,
                )
            except LedgerError as e:
                self._ledger_down(e, "admit")
        return policy.admit_in_memory(False)

    def _recording(self, attempt_id: int) -> Recording | None:
        try:
            return self.ledger.recording(attempt_id) if self.ledger else None
        except LedgerError as e:
            self._ledger_down(e, "replay")
            return None

    def _dispatch(self, flow: http.HTTPFlow, ident: identity.Identity, d: policy.Dispatch) -> None:
        self._attempts[flow.id] = _Attempt(flow.id, ident, d.attempt_id, d.kind, time.monotonic())
        self._local[ident.op_key] = flow.id
        flow.metadata["turnguard"] = {
            "role": "dispatch", "op": ident.op_id, "attempt": d.attempt_id, "kind": d.kind,
        }

    async def _wait(
        self, flow: http.HTTPFlow, op_key: str, hold: policy.Hold, timeout_s: float
    ) -> _Ended | _Gone | None:
        """Wait for the attempt in flight to end. None: the bound passed first."""
        wake = asyncio.get_running_loop().create_future()
        foreign = None if op_key in self._local else (hold.attempt_id or 0)
        self._held[flow.id] = _Held(flow, op_key, time.monotonic(), wake, foreign)
        try:
            return await asyncio.wait_for(wake, timeout_s)
        except TimeoutError:
            return None
        finally:
            self._held.pop(flow.id, None)

    def _wake(self, op_key: str, why: _Ended) -> None:
        for held in list(self._held.values()):
            if held.op_key == op_key and not held.wake.done():
                held.wake.set_result(why)

    def _wake_gone_flows(self) -> None:
        for held in list(self._held.values()):
            f = held.flow
            if f.error is not None or not f.client_conn.connected:
                if not held.wake.done():
                    held.wake.set_result(
                        _Gone("killed" if f.error is not None else "client disconnected")
                    )

    def _poll_foreign(self) -> None:
        """Operations another process owns: wake their waiters once the attempt changed."""
        if self.ledger is None:
            return
        try:
            now = time.time()
            if now - self._last_reap >= 1.0:
                self._last_reap = now
                self._reap_dead(now)
            for op_key in {h.op_key for h in self._held.values() if h.foreign_attempt is not None}:
                snap = self.ledger.snapshot(op_key)
                watched = {h.foreign_attempt for h in self._held.values() if h.op_key == op_key}
                if snap is None or snap.state != "in_flight" or snap.current_attempt not in watched:
                    self._wake(op_key, _Ended(snap.state if snap else "gone"))
        except LedgerError as e:
            self._ledger_down(e, "poll")

    def _reject_in_progress(self, flow: http.HTTPFlow, base: dict, held_since: float) -> None:
        held_ms = round((time.monotonic() - held_since) * 1000)
        retry_after = policy.retry_after_seconds(1)
        self.telemetry.emit("duplicate_rejected", **base, held_ms=held_ms,
                            retry_after_s=retry_after)
        self._answer(flow, answers.turn_in_progress(retry_after, held_ms), MARK_REJECTED,
                     f"turnguard: held {held_ms} ms; the original was still in flight, "
                     "answered 409 turn_in_progress")

    # -- answers ---------------------------------------------------------------------------------
    def _replay(
        self, flow: http.HTTPFlow, ident: identity.Identity, rec: Recording, held_ms: int,
        attempt_id: int | None,
    ) -> None:
        resp = http.Response.make(rec.status, b"", _headers(rec.headers))
        resp.raw_content = rec.body  # as recorded: no re-encoding
        resp.headers["content-length"] = str(len(rec.body))
        resp.headers["x-turnguard"] = "replayed"
        flow.response = resp
        flow.metadata["turnguard"] = {"role": "replay", "op": ident.op_id}
        self.telemetry.emit(
            "duplicate_replayed", op=ident.op_id, flow=flow.id, session=ident.session,
            held_ms=held_ms, status=rec.status, bytes=len(rec.body), attempt=attempt_id,
        )
        self._show(flow, MARK_REPLAYED, f"turnguard: replayed the recorded response of "
                   f"operation {ident.op_id} ({len(rec.body)} bytes) after {held_ms} ms; "
                   "nothing was sent upstream")

    def _answer(self, flow: http.HTTPFlow, a: answers.Answer, mark: str, comment: str) -> None:
        flow.response = http.Response.make(a.status, a.body, _headers(a.headers))
        flow.metadata["turnguard"] = {"role": "answered", "status": a.status}
        self._show(flow, mark, comment)

    def _show(self, flow: http.HTTPFlow, mark: str | None, comment: str) -> None:
        """Explain the flow in mitmweb (mark + comment) and make the UI refresh it."""
        if mark is not None:
            flow.marked = mark
        flow.comment = comment
        try:
            ctx.master.addons.trigger(hooks.UpdateHook([flow]))
        except Exception:  # no master (tests) or no view: nothing to refresh
            pass

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
            counts_events = is_sse and encoding in ("", "identity")
            if is_sse and not counts_events:
                self.telemetry.emit(
                    "passthrough", op=attempt.ident.op_id, flow=flow.id,
                    reason=f"response content-encoding {encoding}: events not counted",
                )
            keep = ctx.options.turnguard_replay_max_bytes if self.guard_policy.replay else 0
            attempt.tee = ResponseTee(
                counts_events=counts_events,
                keep_max_bytes=keep if 200 <= resp.status_code < 300 else 0,
                on_first_event=lambda: self._first_event(attempt),
            )
            resp.stream = attempt.tee
        except Exception:
            logger.exception("turnguard: responseheaders hook failed for %s", flow.id)

    def _first_event(self, attempt: _Attempt) -> None:
        if self.ledger is not None and attempt.attempt_id is not None:
            try:
                self.ledger.first_event(attempt.attempt_id)
            except LedgerError as e:
                self._ledger_down(e, "first_event")

    def response(self, flow: http.HTTPFlow) -> None:
        self._end_attempt(flow, body_complete=True)

    def error(self, flow: http.HTTPFlow) -> None:
        self._end_attempt(flow, body_complete=False)

    def _end_attempt(self, flow: http.HTTPFlow, *, body_complete: bool) -> None:
        attempt = self._attempts.pop(flow.id, None)
        if attempt is None:
            return
        try:
            self._record_end(flow, attempt, body_complete)
        except Exception:
            logger.exception("turnguard: recording the outcome of %s failed", flow.id)
        finally:
            if self._local.get(attempt.ident.op_key) == flow.id:
                del self._local[attempt.ident.op_key]

    def _record_end(self, flow: http.HTTPFlow, attempt: _Attempt, body_complete: bool) -> None:
        tee = attempt.tee
        if tee is None and body_complete and flow.response is not None:
            # No streaming happened (e.g. another addon answered): read the whole body.
            tee = ResponseTee(counts_events=False, keep_max_bytes=0)
            tee(flow.response.raw_content or b"")
            tee(b"")
        events = tee.events_seen if tee else 0
        outcome = policy.classify_outcome(
            status=attempt.status if flow.response is None else flow.response.status_code,
            events_seen=events,
            terminal=tee.terminal if tee else None,
            body_complete=body_complete and (tee is None or tee.ended),
            counts_events=tee.counts_events if tee else False,
        )
        recording = None
        if outcome == "completed" and tee is not None and tee.body is not None:
            recording = Recording(
                flow.response.status_code,
                recordable_headers(flow.response.headers.items(multi=True)),
                tee.body,
            )
        status = flow.response.status_code if flow.response is not None else None
        detail = flow.error.msg if flow.error else None
        fenced_out = False
        if self.ledger is not None and attempt.attempt_id is not None:
            try:
                fenced_out = not self.ledger.finish(
                    attempt.attempt_id,
                    AttemptEnd(outcome, status, events, detail, recording),
                    now=time.time(),
                )
            except LedgerError as e:
                self._ledger_down(e, "finish")
        self.telemetry.emit(
            "outcome", op=attempt.ident.op_id, flow=flow.id, session=attempt.ident.session,
            attempt=attempt.attempt_id, outcome=outcome, events_seen=events, status=status,
            duration_ms=round((time.monotonic() - attempt.started) * 1000),
            replayable=recording is not None, detail=detail, fenced_out=fenced_out,
            not_replayable_reason=(
                None if recording is not None or outcome != "completed"
                else ("over turnguard_replay_max_bytes" if tee and tee.over_cap else "replay off")
            ),
        )
        if self._local.get(attempt.ident.op_key) == flow.id:
            del self._local[attempt.ident.op_key]
        self._wake(attempt.ident.op_key, _Ended(outcome, recording))

    def update(self, flows) -> None:
        """A flow was changed elsewhere (e.g. killed with the flow.kill command): wake it if held."""
        for f in flows:
            held = self._held.get(f.id)
            if held is not None and f.error is not None and not held.wake.done():
                held.wake.set_result(_Gone("killed"))

    # -- commands --------------------------------------------------------------------------------
    @command.command("turnguard.status")
    def status(self) -> str:
        """turnguard's state: counts of its decisions, held flows, ledger."""
        ledger_counts: dict[str, Any] = {}
        if self.ledger is not None:
            try:
                ledger_counts = self.ledger.counts()
            except LedgerError as e:
                ledger_counts = {"error": str(e)}
        return json.dumps(
            {
                "instance": self.instance_id,
                "ledger": self.ledger_path,
                "ledger_ok": self.ledger is not None,
                "ledger_error": self.ledger_error,
                "operations_by_state": ledger_counts,
                "in_flight": len(self._attempts),
                "held": len(self._held),
                "events": dict(self.telemetry.counts),
            },
            indent=2,
        )

    @command.command("turnguard.held")
    def held(self) -> str:
        """One line per held flow: flow id, operation, seconds held, and what it waits for."""
        now = time.monotonic()
        lines = []
        for flow_id, h in self._held.items():
            where = "another process" if h.foreign_attempt is not None else "this process"
            lines.append(
                f"{flow_id} op={h.op_key[:12]} held={now - h.since:.1f}s "
                f"waiting for an attempt in {where} {h.flow.request.method} "
                f"{h.flow.request.path}"
            )
        return "\n".join(lines) if lines else "no held flows"


addons = [TurnGuard()]
