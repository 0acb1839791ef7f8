"""Client models: faithful retry policies of the clients in turnguard's incidents.

Each model runs one *turn*: it sends the turn's first request; when the answer ends in a
function call (the mock's ``tool_call``), it "runs the tool" and sends the turn's next request
with the function call and its output appended to ``input`` and the ``x-codex-turn-state``
header the previous answer carried, as Codex does; the turn is *completed* when an answer
completes without a function call, and *lost* when the model's retry policy gives up (or the
client's deadline passes). Every HTTP attempt is recorded (start and end time, time of the
response headers, status, error, SSE events, the ``x-turnguard`` answer header, the wait that
preceded it) and so is the final outcome.

Every request goes on a new connection (``http1.post``) and carries
``x-turnguard-repro-attempt: <client>#<n>`` so that the mock's dispatch log, mitmproxy's flows
and the timeline can say which attempt was which. turnguard does not look at that header (it is
not part of a request's identity) and the real clients do not send it.

The numbers and where they come from:

- ``codex_cli``: measured here with the real Codex CLI 0.171.0 (``codex exec`` with a custom
  ``model_providers`` entry) against ``scripts/mock_upstream.py``. Two nested loops. The inner
  (``request_max_retries`` = 4, so 5 tries) retries a transport error before the headers and
  any 5xx, waiting ``Retry-After`` when the answer has one (503 with ``Retry-After: 3`` -> 3.0 s)
  and otherwise 0.2, 0.4, 0.8, 1.6 s (x 0.9..1.1 jitter); it ignores ``x-should-retry``. The
  outer (``stream_max_retries`` = 5) starts the inner loop again after it gave up, after a 409
  or a 429 (waiting their ``Retry-After``), and after a stream that broke after the headers,
  with the same 0.2 s doubling backoff; 30 dispatches at most for one request. Any other 4xx
  ends the turn at once. No timeout before the headers (it waited 60 s); 300 s of silence after
  them (``stream_idle_timeout_ms``) breaks the stream.
- ``codex_ws``: the Codex CLI 0.171.0 on its default transport (the built-in ``openai``
  provider), measured against a mock speaking WebSocket and SSE: each request is a
  ``response.create`` frame on a WebSocket; a failure before ``response.completed`` (the socket
  closed or reset, an ``error`` event with a 5xx status, ``response.failed``) is retried on a
  NEW socket after 0.2, 0.4, 0.8, 1.6, 3.2 s (x 0.9..1.1), 5 times; then it falls back to HTTP
  POST for good (``codex_cli``'s policy, no ``openai-beta``, the frame without its
  WebSocket-only fields). An ``error`` event with status 429 ends the turn at once; one without
  a status makes it hang (the model gives the turn up instead). Each attempt here is on a new
  socket (Codex keeps a socket that succeeded, and then sends deltas; a new socket always gets
  the full input, as here).
- ``impatient`` (the Codex Desktop report in codex-lb issue 1737): ignores ``Retry-After`` and
  ``x-should-retry`` and sends the same request again ``retry_gap_ms`` = 200 ms after any
  failure until it has made ``max_attempts`` = 10 attempts for that request.
- ``openai_python``: the retry loop of openai-python 3.57.0 (``openai/_base_client.py``,
  ``_constants.py``): ``max_retries`` = 2 (3 tries); retries a timeout or connection error,
  and a status error when ``_should_retry`` says so: ``x-should-retry: true|false`` decides
  first, else 408, 409, 429 and >= 500 retry; a ``Retry-After`` over 120 s means no retry.
  Delay: ``retry-after-ms`` / ``retry-after`` when 0 < value <= 120 s, else
  min(0.5 x 2^retries_taken, 8) s x (1 - 0.25 x random). Timeout 600 s (connect 5 s). Sends
  ``x-stainless-retry-count`` and ``x-stainless-read-timeout``, no idempotency key. A stream
  that breaks after the headers is not retried (the SDK already returned the response).
- ``gateway`` (the OmniRoute pattern, issue 18716): an executor that re-sends the identical
  request on a new connection when no attempt produced output (an SSE event past
  ``response.created`` / ``response.in_progress``, or a whole answer) within
  ``hedge_after_ms`` = 1500 ms of the last send, while the earlier attempts stay open, up to
  ``max_parallel`` = 3 attempts; the first attempt with output is relayed and, once it
  completes, the others are closed. A
  409 or 429 on any attempt makes it mark the account rate limited and, with
  ``conflict_aborts`` (default, as reported), abandon the turn's attempts on that account: the
  client loses the turn mid-stream. A 5xx or transport error with nothing else in flight is
  re-sent at once while attempts remain.
- ``timeline``: no policy of its own; sends recorded requests at their recorded offsets
  (``reproduce from-capture``), each on a new connection, and waits for each answer; a
  request recorded as sent after an earlier one had ended (``after``: a retry after a
  failure, the next turn after the last) is sent no sooner than ``after_gap_ms`` after that
  one's end in the replay.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from turnguard_sse import SseEvent

from . import http1, ws1

ATTEMPT_HEADER = "x-turnguard-repro-attempt"
DUMMY_AUTHORIZATION = "Bearer sk-repro-dummy-not-a-secret"
DEFAULT_BODY: dict[str, Any] = {
    "model": "gpt-test",
    "input": [{"role": "user", "content": "fix the failing test"}],
    "stream": True,
}
MAX_STEPS = 8  # requests in one turn (tool calls) before the model gives up
DEFAULT_DEADLINE_S = 60.0


def body_bytes(body: dict[str, Any]) -> bytes:
    """The one serialisation every model uses, so a retry is byte-identical."""
    return json.dumps(body, separators=(",", ":"), sort_keys=False).encode()


@dataclass
class Attempt:
    """One HTTP attempt of a client (times are Unix seconds)."""

    client: str
    n: int  # 1-based, across the client's whole turn
    step: int  # which request of the turn (0: the first; 1: after the first tool call; ...)
    start: float
    end: float | None = None
    t_headers: float | None = None
    status: int | None = None
    error: str | None = None
    events: int = 0
    completed: bool = False
    function_call: bool = False
    turnguard: str | None = None  # the x-turnguard answer header: replayed, turn_in_progress, ...
    error_code: str | None = None  # error.code of an error body
    retry_after_s: float | None = None
    waited_before_s: float = 0.0  # the policy's wait before this attempt
    turn_state: bool = False  # sent x-codex-turn-state
    note: str = ""
    transport: str = "http"  # or "ws": a response.create frame on a WebSocket

    @property
    def visible_error(self) -> str | None:
        """What the client saw as an error: the status (>= 400), ``stream cut`` for a 2xx
        answer that broke, ``no answer`` for a transport error before the headers, None for a
        good answer (or one the client itself cancelled)."""
        if self.completed:
            return None
        if self.error == "cancelled":
            return None
        if self.status is not None and self.status >= 400:
            return str(self.status)
        if self.status is not None:
            return "stream cut" if self.error else ("no terminal event" if not self.function_call else None)
        return "no answer" if self.error else None


@dataclass
class ClientResult:
    name: str
    model: str
    outcome: str  # "completed" | "lost"
    reason: str
    start: float
    end: float
    attempts: list[Attempt] = field(default_factory=list)
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def errors_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.attempts:
            k = a.visible_error
            if k is not None:
                out[k] = out.get(k, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["errors"] = self.errors_by_kind()
        return d


class Lost(Exception):
    """The policy gave up on the turn; ``exchange`` is the last answer, when there was one."""

    def __init__(self, reason: str, exchange: http1.Exchange | None = None):
        super().__init__(reason)
        self.exchange = exchange


class ClientModel:
    """Shared turn logic; subclasses implement ``request_step`` (one request of the turn,
    with the policy's retries) and may override ``headers_for``."""

    model = "base"

    def __init__(
        self,
        name: str,
        url: str,
        *,
        session: str | None = None,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        path: str = "/v1/responses",
        start_ms: float = 0,
        deadline_s: float = DEFAULT_DEADLINE_S,
        seed: int | None = None,
        **params: Any,
    ):
        self.name = name
        self.url = url.rstrip("/")
        self.path = path
        self.session = session
        self.body = copy.deepcopy(body if body is not None else DEFAULT_BODY)
        self.base_headers = {
            "content-type": "application/json",
            "accept": "text/event-stream",
            "authorization": DUMMY_AUTHORIZATION,
        }
        if session:
            self.base_headers["session-id"] = session
        self.base_headers.update({k.lower(): v for k, v in (headers or {}).items()})
        self.start_s = float(start_ms) / 1000
        self.deadline_s = float(deadline_s)
        self.rng = random.Random(seed)
        self.attempts: list[Attempt] = []
        self.extra: dict[str, Any] = {}
        self._next_wait = 0.0
        accepted = set(inspect.signature(self.configure).parameters)
        unknown = set(params) - accepted
        if unknown:
            raise ValueError(f"{self.model}: unknown parameters {sorted(unknown)} (known: {sorted(accepted)})")
        self.configure(**params)

    def configure(self, **params: Any) -> None:
        if params:
            raise ValueError(f"{self.model}: unknown parameters {sorted(params)}")

    # -- running ---------------------------------------------------------------------------------
    async def run(self) -> ClientResult:
        await asyncio.sleep(self.start_s)
        start = time.time()
        outcome, reason, steps = "lost", "", 0
        try:
            async with asyncio.timeout(self.deadline_s):
                steps, reason = await self.turn()
                outcome = "completed"
        except Lost as e:
            reason = str(e)
        except TimeoutError:
            reason = f"client deadline ({self.deadline_s:g} s) passed"
        return ClientResult(
            self.name, self.model, outcome, reason, start, time.time(), self.attempts,
            steps, self.extra,
        )

    async def turn(self) -> tuple[int, str]:
        body = copy.deepcopy(self.body)
        if isinstance(body.get("input"), str):
            body["input"] = [{"role": "user", "content": body["input"]}]
        turn_state: str | None = None
        for step in range(MAX_STEPS):
            headers = dict(self.base_headers)
            if turn_state:
                headers["x-codex-turn-state"] = turn_state
            ex = await self.request_step(step, headers, body_bytes(body))
            calls = ex.function_calls()
            if not calls:
                return step + 1, "completed"
            turn_state = ex.headers.get("x-codex-turn-state") or turn_state
            items = list(body.get("input") or [])
            for c in calls:
                items.append({k: c[k] for k in ("type", "name", "arguments", "call_id") if k in c})
                items.append({"type": "function_call_output", "call_id": c.get("call_id"), "output": "ok"})
            body = {**body, "input": items}
        raise Lost(f"more than {MAX_STEPS} requests in one turn")

    async def request_step(self, step: int, headers: dict[str, str], body: bytes) -> http1.Exchange:
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------------
    async def wait(self, seconds: float) -> None:
        """The policy's wait before its next attempt (recorded on that attempt)."""
        seconds = max(0.0, seconds)
        self._next_wait = seconds
        await asyncio.sleep(seconds)

    def _attempt(self, step: int, headers: dict[str, str], transport: str = "http") -> tuple[Attempt, dict[str, str]]:
        """A new attempt, recorded, and its headers (with the attempt header)."""
        n = len(self.attempts) + 1
        h = dict(headers)
        h[ATTEMPT_HEADER] = f"{self.name}#{n}"
        att = Attempt(self.name, n, step, time.time(), waited_before_s=round(self._next_wait, 3),
                      turn_state="x-codex-turn-state" in h, transport=transport)
        self._next_wait = 0.0
        self.attempts.append(att)
        return att, h

    async def send(
        self,
        step: int,
        headers: dict[str, str],
        body: bytes,
        *,
        headers_timeout: float | None = None,
        idle_timeout: float | None = None,
        on_headers=None,
        on_event=None,
        path: str | None = None,
    ) -> tuple[Attempt, http1.Exchange]:
        att, h = self._attempt(step, headers)
        ex = http1.Exchange()
        try:
            await http1.post(ex, self.url, path or self.path, h, body, headers_timeout=headers_timeout,
                             idle_timeout=idle_timeout, on_headers=on_headers, on_event=on_event)
        finally:
            _fill(att, ex)
        return att, ex


def _fill(att: Attempt, ex: http1.Exchange) -> None:
    att.end = ex.t_end or time.time()
    att.t_headers = ex.t_headers
    att.status = ex.status
    att.error = ex.error
    att.events = len(ex.events)
    att.completed = ex.completed
    att.function_call = bool(ex.completed and ex.function_calls())
    att.turnguard = ex.headers.get("x-turnguard")
    att.retry_after_s = ex.retry_after_s()
    if ex.status is not None and ex.status >= 400:
        att.error_code = ex.json_error_code()


def _describe(ex: http1.Exchange) -> str:
    if ex.status is None:
        return ex.error or "no answer"
    if ex.status >= 400:
        code = ex.json_error_code()
        return f"{ex.status}" + (f" {code}" if code else "")
    if ex.error:
        return f"{ex.status} then {ex.error} after {len(ex.events)} events"
    return f"{ex.status} without a terminal event"


# ------------------------------------------------------------------------------------------------
# Codex CLI


class CodexCli(ClientModel):
    """Codex CLI 0.171.0's retry loops (measured; see the module docstring)."""

    model = "codex_cli"
    REQUEST_MAX_RETRIES = 4  # model_providers.<id>.request_max_retries default
    STREAM_MAX_RETRIES = 5  # model_providers.<id>.stream_max_retries default
    BACKOFF_BASE_S = 0.2  # 0.2, 0.4, 0.8, 1.6, 3.2 s ...
    JITTER = (0.9, 1.1)
    STREAM_IDLE_TIMEOUT_S = 300.0  # stream_idle_timeout_ms default; none before the headers

    def configure(self, request_max_retries: int | None = None, stream_max_retries: int | None = None,
                  stream_idle_timeout_ms: float | None = None) -> None:
        if request_max_retries is not None:
            self.REQUEST_MAX_RETRIES = int(request_max_retries)
        if stream_max_retries is not None:
            self.STREAM_MAX_RETRIES = int(stream_max_retries)
        if stream_idle_timeout_ms is not None:
            self.STREAM_IDLE_TIMEOUT_S = float(stream_idle_timeout_ms) / 1000

    def backoff(self, k: int) -> float:
        """The k-th backoff (k >= 1): 0.2 x 2^(k-1) s, jittered."""
        return self.BACKOFF_BASE_S * 2 ** (k - 1) * self.rng.uniform(*self.JITTER)

    async def request_step(self, step, headers, body):
        last = None
        for s in range(self.STREAM_MAX_RETRIES + 1):
            ex = await self._inner(step, headers, body)
            last = ex
            if ex.completed:
                return ex
            if ex.status is not None and 400 <= ex.status < 500 and ex.status not in (409, 429):
                raise Lost(f"fatal answer {_describe(ex)}")
            if s == self.STREAM_MAX_RETRIES:
                break
            ra = ex.retry_after_s() if ex.status in (409, 429) else None
            await self.wait(ra if ra is not None else self.backoff(s + 1))
        raise Lost(f"gave up after {self.STREAM_MAX_RETRIES} stream retries (last: {_describe(last)})")

    async def _inner(self, step, headers, body) -> http1.Exchange:
        for r in range(self.REQUEST_MAX_RETRIES + 1):
            _, ex = await self.send(step, headers, body, idle_timeout=self.STREAM_IDLE_TIMEOUT_S)
            retryable = ex.status is None or ex.status >= 500
            if not retryable or r == self.REQUEST_MAX_RETRIES:
                return ex
            ra = ex.retry_after_s() if ex.status is not None else None
            await self.wait(ra if ra is not None else self.backoff(r + 1))
        raise AssertionError("unreachable")


class CodexWebSocket(CodexCli):
    """Codex CLI 0.171.0 on its default transport (measured; see the module docstring)."""

    model = "codex_ws"
    WS_RECONNECTS = 5
    WS_ONLY_HEADERS = {"openai-beta": "responses_websockets=2026-02-06"}

    def configure(self, request_max_retries: int | None = None, stream_max_retries: int | None = None,
                  stream_idle_timeout_ms: float | None = None) -> None:
        super().configure(request_max_retries, stream_max_retries, stream_idle_timeout_ms)
        self.fell_back = False
        meta = {"turn_id": f"{self.name}-turn", "session_id": self.session or self.name}
        self.body.setdefault("client_metadata", meta)

    async def request_step(self, step, headers, body):
        if not self.fell_back:
            last = None
            for k in range(self.WS_RECONNECTS + 1):
                if k:
                    await self.wait(self.backoff(k))
                ex = last = await self._send_frame(step, headers, body)
                if ex.completed:
                    return ex
                if ex.status == 429:
                    raise Lost("fatal 429 (exceeded retry limit)", ex)
                if any(e.type == "error" for e in ex.events) and ex.status == 200:
                    raise Lost("an error event without a status: Codex hangs", ex)
                if ex.status == 426:
                    break  # upgrade required: straight to the fallback
            self.fell_back = True
            self.extra["fell_back_to_http_after"] = _describe(last) if last else "no attempt"
            await self.wait(0.05)
        return await super().request_step(step, headers, body)

    async def _send_frame(self, step, headers, body: bytes) -> http1.Exchange:
        frame = json.loads(body)
        meta = dict(frame.get("client_metadata") or {})
        meta["x-codex-ws-stream-request-start-ms"] = str(int(time.time() * 1000))
        meta["ws_request_header_x_openai_internal_codex_responses_lite"] = "true"
        frame = {"type": "response.create", **frame, "client_metadata": meta}
        skip = {"content-type", "accept", "content-length"}
        att, h = self._attempt(step, {**{k: v for k, v in headers.items() if k not in skip},
                                      **self.WS_ONLY_HEADERS}, transport="ws")
        ex = http1.Exchange()
        try:
            await ws1.create(ex, self.url, self.path, h, frame,
                             idle_timeout=self.STREAM_IDLE_TIMEOUT_S)
        finally:
            _fill(att, ex)
        return ex


# ------------------------------------------------------------------------------------------------
# The impatient client (Codex Desktop report)


class Impatient(ClientModel):
    """Ignores Retry-After and x-should-retry; retries 200 ms after any failure until
    ``max_attempts`` attempts of the request were made."""

    model = "impatient"
    RETRY_GAP_S = 0.2
    MAX_ATTEMPTS = 10
    IDLE_TIMEOUT_S = 300.0

    def configure(self, retry_gap_ms: float | None = None, max_attempts: int | None = None,
                  headers_timeout_ms: float | None = None) -> None:
        if retry_gap_ms is not None:
            self.RETRY_GAP_S = float(retry_gap_ms) / 1000
        if max_attempts is not None:
            self.MAX_ATTEMPTS = int(max_attempts)
        self.headers_timeout = None if headers_timeout_ms is None else float(headers_timeout_ms) / 1000

    async def request_step(self, step, headers, body):
        last = None
        for i in range(self.MAX_ATTEMPTS):
            if i:
                await self.wait(self.RETRY_GAP_S)
            _, ex = await self.send(step, headers, body, headers_timeout=self.headers_timeout,
                                    idle_timeout=self.IDLE_TIMEOUT_S)
            last = ex
            if ex.completed:
                return ex
            if ex.status is not None and 400 <= ex.status < 500 and ex.status not in (408, 409, 429):
                raise Lost(f"fatal answer {_describe(ex)}")
        raise Lost(f"retry budget spent: {self.MAX_ATTEMPTS} attempts (last: {_describe(last)})")


# ------------------------------------------------------------------------------------------------
# openai-python


class OpenAIPython(ClientModel):
    """openai-python 3.57.0's retry loop (``_base_client.py``)."""

    model = "openai_python"
    MAX_RETRIES = 2  # DEFAULT_MAX_RETRIES
    INITIAL_RETRY_DELAY = 0.5
    MAX_RETRY_DELAY = 8.0
    MAX_RETRY_AFTER_DELAY = 120.0  # 2 * 60
    TIMEOUT_S = 600.0  # DEFAULT_TIMEOUT (connect 5 s)
    VERSION = "3.57.0"

    def configure(self, max_retries: int | None = None, timeout_ms: float | None = None) -> None:
        if max_retries is not None:
            self.MAX_RETRIES = int(max_retries)
        if timeout_ms is not None:
            self.TIMEOUT_S = float(timeout_ms) / 1000
        self.base_headers.setdefault("user-agent", f"OpenAI/Python {self.VERSION}")
        self.base_headers.setdefault("x-stainless-lang", "python")
        self.base_headers.setdefault("x-stainless-package-version", self.VERSION)

    def should_retry(self, ex: http1.Exchange) -> bool:
        """``_should_retry``: Retry-After too long, then x-should-retry, then the status."""
        ra = ex.retry_after_s()
        if ra is not None and ra > self.MAX_RETRY_AFTER_DELAY:
            return False
        flag = ex.headers.get("x-should-retry")
        if flag == "true":
            return True
        if flag == "false":
            return False
        return ex.status in (408, 409, 429) or (ex.status or 0) >= 500

    def retry_delay(self, retries_taken: int, ex: http1.Exchange | None) -> float:
        """``_calculate_retry_timeout``."""
        ra = ex.retry_after_s() if ex is not None else None
        if ra is not None and 0 < ra <= self.MAX_RETRY_AFTER_DELAY:
            return ra
        sleep = min(self.INITIAL_RETRY_DELAY * 2.0 ** retries_taken, self.MAX_RETRY_DELAY)
        return sleep * (1 - 0.25 * self.rng.random())

    async def request_step(self, step, headers, body):
        ex = None
        for retries_taken in range(self.MAX_RETRIES + 1):
            if retries_taken:
                await self.wait(self.retry_delay(retries_taken - 1, ex if ex and ex.status else None))
            h = dict(headers)
            h["x-stainless-retry-count"] = str(retries_taken)
            h["x-stainless-read-timeout"] = str(self.TIMEOUT_S)
            _, ex = await self.send(step, h, body, headers_timeout=self.TIMEOUT_S, idle_timeout=self.TIMEOUT_S)
            if ex.status is None:  # timeout or connection error: retried
                continue
            if ex.status >= 400:
                if retries_taken < self.MAX_RETRIES and self.should_retry(ex):
                    continue
                raise Lost(f"APIStatusError {_describe(ex)} after {retries_taken} retries")
            if ex.completed:
                return ex
            raise Lost(f"stream broke after the headers ({_describe(ex)}); the SDK does not retry that")
        raise Lost(f"APIConnectionError/APITimeoutError after {self.MAX_RETRIES} retries ({_describe(ex)})")


# ------------------------------------------------------------------------------------------------
# The gateway executor (OmniRoute pattern)


class Gateway(ClientModel):
    """Re-sends the identical request on a new connection while the original is still open."""

    model = "gateway"
    HEDGE_AFTER_S = 1.5
    MAX_PARALLEL = 3
    CONFLICT_ABORTS = True

    def configure(self, hedge_after_ms: float | None = None, max_parallel: int | None = None,
                  conflict_aborts: bool | None = None) -> None:
        if hedge_after_ms is not None:
            self.HEDGE_AFTER_S = float(hedge_after_ms) / 1000
        if max_parallel is not None:
            self.MAX_PARALLEL = int(max_parallel)
        if conflict_aborts is not None:
            self.CONFLICT_ABORTS = bool(conflict_aborts)
        self.extra.setdefault("accounts_marked_rate_limited", 0)
        self.extra.setdefault("hedges", 0)

    async def request_step(self, step, headers, body):
        return await hedged_exchange(self, step, headers, body)


async def hedged_exchange(model: Gateway, step: int, headers: dict[str, str], body: bytes) -> http1.Exchange:
    """The executor's loop for one request (also used by ``gateway_server``). Returns the
    completed exchange or raises Lost (with the last exchange, for a gateway to relay)."""
    tasks: dict[asyncio.Task, int] = {}
    state: dict[str, Any] = {"winner": None}
    launched = 0

    def launch() -> None:
        nonlocal launched
        launched += 1
        idx = launched

        def output_seen(ex: http1.Exchange, ev: SseEvent) -> None:
            if ev.type not in ("response.created", "response.in_progress") and state["winner"] is None:
                state["winner"] = idx

        tasks[asyncio.create_task(model.send(step, headers, body, on_event=output_seen))] = idx

    async def close_all() -> None:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    launch()
    try:
        for _ in range(10_000):  # bounded: every pass ends an attempt, launches one or waits
            for t in [t for t in tasks if t.done()]:
                idx = tasks.pop(t)
                if t.cancelled():
                    continue
                att, ex = t.result()
                if ex.completed:
                    return ex
                if ex.status in (409, 429):
                    model.extra["accounts_marked_rate_limited"] += 1
                    att.note = "account marked rate limited"
                    if model.CONFLICT_ABORTS:
                        raise Lost(f"{ex.status} on attempt {att.n}: account marked rate limited, "
                                   "its in-flight attempts abandoned", ex)
                elif ex.status is not None and 400 <= ex.status < 500:
                    raise Lost(f"fatal answer {_describe(ex)}", ex)
                if state["winner"] == idx:
                    raise Lost(f"the relayed attempt broke mid-stream ({_describe(ex)})", ex)
                if not tasks:
                    if launched >= model.MAX_PARALLEL:
                        raise Lost(f"all {launched} attempts failed (last: {_describe(ex)})", ex)
                    launch()
            hedge = state["winner"] is None and launched < model.MAX_PARALLEL
            done, _ = await asyncio.wait(list(tasks), timeout=model.HEDGE_AFTER_S if hedge else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done and hedge and state["winner"] is None:
                model.extra["hedges"] += 1
                launch()
        raise Lost("executor loop bound reached")
    finally:
        await close_all()


# ------------------------------------------------------------------------------------------------
# Timeline replay (from a capture)


class Timeline(ClientModel):
    """Sends recorded requests at their recorded offsets (and no sooner than ``after_gap_ms``
    after the end of the request one followed, ``after``), each on a new connection;
    the turn is completed when every recorded operation got one completed answer."""

    model = "timeline"

    def configure(self, requests: list[dict[str, Any]] | None = None, timeout_ms: float = 120_000) -> None:
        self.requests = list(requests or [])
        self.timeout_s = float(timeout_ms) / 1000

    @staticmethod
    def op_of(req: dict[str, Any]) -> str:
        h = {k.lower(): v for k, v in (req.get("headers") or {}).items()}
        key = "\0".join([h.get("authorization", ""), h.get("session-id") or h.get("session_id", ""),
                         req.get("path", ""), req.get("body_text", "")])
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    @staticmethod
    def turn_of(req: dict[str, Any]) -> str:
        """The turn a recorded request belongs to, whoever sent it: path and body (a gateway
        that re-sends a turn with another account or session still re-sends that turn)."""
        key = "\0".join([req.get("path", ""), req.get("body_text", "")])
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    async def turn(self) -> tuple[int, str]:
        """Send every recorded request; record per turn how many were sent and whether one
        completed (``extra["turns"]``). Whether a turn was lost is decided across the column's
        clients (``runner.turn_outcomes``): here the run always ends."""
        t0 = time.monotonic()
        turns: dict[str, dict[str, Any]] = {}
        ended = [asyncio.Event() for _ in self.requests]

        async def one(i: int, req: dict[str, Any]) -> None:
            try:
                await asyncio.sleep(max(0.0, float(req.get("at_ms", 0)) / 1000 - (time.monotonic() - t0)))
                after = req.get("after")
                if isinstance(after, int) and 0 <= after < i:  # after that one's end, as recorded
                    await ended[after].wait()
                    await asyncio.sleep(max(0.0, float(req.get("after_gap_ms", 0)) / 1000))
                headers = {k.lower(): v for k, v in (req.get("headers") or {}).items()}
                att, ex = await self.send(0, headers, req.get("body_text", "").encode(),
                                          headers_timeout=self.timeout_s, idle_timeout=self.timeout_s,
                                          path=req.get("path", self.path))
                att.note = f"recorded flow {req.get('flow', '?')}"
                t = turns[self.turn_of(req)]
                t["completed"] = t["completed"] or ex.completed
            finally:
                ended[i].set()

        for req in self.requests:
            t = turns.setdefault(self.turn_of(req), {"requests": 0, "completed": False})
            t["requests"] += 1
        await asyncio.gather(*(one(i, r) for i, r in enumerate(self.requests)))
        self.extra["turns"] = turns
        failed = sum(1 for t in turns.values() if not t["completed"])
        return len(self.requests), (f"{failed} of {len(turns)} recorded turns did not complete"
                                    if failed else "completed")


MODELS: dict[str, type[ClientModel]] = {
    m.model: m for m in (CodexCli, CodexWebSocket, Impatient, OpenAIPython, Gateway, Timeline)
}


def make_client(spec: dict[str, Any], url: str, *, seed: int | None = None) -> ClientModel:
    """A client model from a scenario's client spec: ``{"name", "model", "session",
    "start_ms", "deadline_s", "body", "headers", "path", "params": {...}}``."""
    model = spec.get("model")
    if model not in MODELS:
        raise ValueError(f"client {spec.get('name')!r}: unknown model {model!r} (known: {sorted(MODELS)})")
    cls = MODELS[model]
    c = cls(
        spec.get("name") or model, url, session=spec.get("session"), body=spec.get("body"),
        headers=spec.get("headers"), path=spec.get("path", "/v1/responses"),
        start_ms=spec.get("start_ms", 0), deadline_s=spec.get("deadline_s", DEFAULT_DEADLINE_S),
        seed=seed, **(spec.get("params") or {}),
    )
    if model == "timeline":
        c.base_headers = {}
    return c
