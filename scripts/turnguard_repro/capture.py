"""From a capture to a scenario: read a mitmproxy flow file of a real incident (``mitmdump -w``)
and write a scenario file that ``reproduce run`` replays.

What is extracted:

- the client request timeline: every model request (POST .../responses or .../chat/completions)
  with its offset from the first one, its path, its headers (cleaned, below) and its body;
  one ``timeline`` client per session (``session-id`` / ``session_id`` header). A request
  sent after an earlier one of its session had ended (a retry after a failure, the next turn
  after the last) names the last of them to end (``after``: its index among the session's
  requests; ``after_gap_ms``: how long after that end it was sent), so that the replay sends
  it after that end too, however the replay's timings drift (at its offset alone, a retry of
  a cut stream could reach turnguard while the replayed stream still runs, and be attached
  to it);
- the upstream's observed behaviour per dispatch, per operation (request body), in order
  (record with ``-s scripts/turnguard_repro/capture_addon.py`` to keep the events a broken
  stream sent, which mitmproxy drops otherwise):
  a whole answer with an error status (code, body, ``Retry-After``, ``x-should-retry``, the
  time to the headers); a complete SSE stream (``ok`` with the number of text deltas, their
  size, the time to the headers and the mean gap between events, or ``tool_call`` when it
  ended in a function call); a stream that broke after k events (``partial``, or
  ``stall_after_headers`` when k = 0); no answer at all (``reset`` under 100 ms, else
  ``stall_before_headers`` for as long as it was observed). Flows turnguard answered itself
  (its ``flow.metadata["turnguard"]["role"]`` is ``replay`` or ``answered``) were not
  dispatched: they are in the client timeline only.

Secrets are dropped on the way: a path other than a known route keeps its model route only
(``/responses``, ``/chat/completions``) behind a dummy prefix, one per distinct URL (a key
may travel in the path or the query); every header turnguard counts as credential-bearing
(``identity.CREDENTIAL_HEADERS``: ``Authorization``, cookies, ``OpenAI-Organization``,
``Sec-WebSocket-Protocol``, ...), those the caller names (``credential_headers``, as its
``turnguard_credential_headers``), ``Set-Cookie``, and every header whose name mentions a key,
token, secret, auth, password or credential; names are read case-insensitive and with ``_``
as ``-`` (``x_api_key``), as turnguard reads them (except ``Idempotency-Key`` and the
``x-codex-turn-*`` headers, which are not secrets and which turnguard's identity needs). Each
distinct set of credential values becomes a dummy ``Bearer sk-repro-credential-<n>`` so that
requests that shared their credentials still share one, and requests that did not still do
not. An error body the upstream sent (kept, as the behaviour to replay) loses what it quotes
of the request's credentials: each credential header's value (a cookie's alone too), what
the URL carries beside its route (a 404 quotes the URL), and anything shaped like a key.
By default the
*content* of request bodies and of output text is replaced as well (``input`` becomes a stable
placeholder derived from the whole body, so identical bodies stay identical and different ones
stay different; ``model``, ``stream``, ``previous_response_id`` and ``store`` are kept); pass
``keep_bodies=True`` to keep them verbatim.

Limits: mitmproxy keeps no per-chunk times, so gaps are averages; a body turnguard streamed
(``flow.response.stream``) is not in the flow file, so such a dispatch's event count is unknown
and is noted in the behaviour's ``note``; a reset and a clean close both read as "server closed
connection" and are replayed as ``reset``.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

from turnguard_core.identity import CREDENTIAL_HEADERS, credential_name
from turnguard_sse import SseEvent, SseReader

MODEL_PATH = re.compile(r"/(responses|chat/completions)/?(\?|$)")
KNOWN_ROUTES = {"/v1/responses", "/v1/chat/completions", "/backend-api/codex/responses",
                "/openai/v1/responses", "/openai/v1/chat/completions"}
SECRET_HEADERS = {*CREDENTIAL_HEADERS, "set-cookie"}
SECRET_WORDS = ("key", "token", "secret", "auth", "password", "credential", "cookie")
NOT_SECRET = {"idempotency-key", "x-codex-turn-state", "x-codex-turn-metadata"}
DROP = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding",
        "x-turnguard-repro-attempt", "keep-alive", "te", "upgrade"}
KEPT_BODY_FIELDS = ("model", "stream", "previous_response_id", "store")
MAX_ERROR_BODY = 4096
QUICK_FAILURE_MS = 100


def _is_secret(name: str, extra: frozenset[str] = frozenset()) -> bool:
    n = credential_name(name)
    if n in NOT_SECRET:
        return False
    return n in SECRET_HEADERS or n in extra or any(w in n for w in SECRET_WORDS)


class _Cleaner:
    def __init__(self, keep_bodies: bool, credential_headers: frozenset[str] = frozenset()):
        self.keep_bodies = keep_bodies
        self.credential_headers = credential_headers
        self.credentials: dict[str, int] = {}  # in memory only: never written
        self.urls: dict[str, int] = {}  # the same, for what a path carries beside its route
        self.dropped: Counter[str] = Counter()

    def path(self, path: str) -> str:
        """A known route as it is; else only its model route is kept, behind a dummy prefix
        that stands for the rest (a key in the path or the query: ``/sk-.../v1/responses``,
        ``?key=``), one per distinct rest, so that requests that shared a URL still share one."""
        if path in KNOWN_ROUTES:
            return path
        route = MODEL_PATH.search(path)
        tail = route.group(0).rstrip("?") if route else "/responses"
        n = self.urls.setdefault(path, len(self.urls) + 1)
        return f"/repro-url-{n}{tail}"

    def headers(self, headers) -> dict[str, str]:
        out: dict[str, str] = {}
        secrets: list[tuple[str, str]] = []
        for k, v in headers.items(multi=True):
            lk = k.lower()
            if lk in DROP:
                continue
            if _is_secret(lk, self.credential_headers):
                self.dropped[lk] += 1
                if v:
                    secrets.append((credential_name(lk), v))
                continue
            out.setdefault(lk, v)
        if secrets:
            cred = "\0".join(f"{k}\0{v}" for k, v in sorted(secrets))
            n = self.credentials.setdefault(cred, len(self.credentials) + 1)
            out["authorization"] = f"Bearer sk-repro-credential-{n}"
        return out

    def body(self, raw: bytes) -> str:
        if self.keep_bodies:
            return raw.decode("utf-8", "replace")
        digest = hashlib.sha256(raw).hexdigest()[:16]
        try:
            obj = json.loads(raw)
        except ValueError:
            return json.dumps({"input": f"redacted-non-json-{digest}"})
        if not isinstance(obj, dict):
            return json.dumps({"input": f"redacted-{digest}"})
        canon = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
        out = {k: obj[k] for k in KEPT_BODY_FIELDS if k in obj}
        out["input"] = "redacted-" + hashlib.sha256(canon).hexdigest()[:16]
        return json.dumps(out, separators=(",", ":"))


def _sse_events(data: bytes) -> list[SseEvent]:
    """Every event of a captured SSE body, the last one too when the capture cut it short."""
    reader = SseReader()
    return reader.feed(data) + reader.close()


def _ms(a: float | None, b: float | None) -> int:
    if a is None or b is None:
        return 0
    return max(0, round((b - a) * 1000))


# what an error body may quote of a key (OpenAI's 401 shows "sk-proj-abc***...wxyz")
_KEY_LIKE = re.compile(rb"(?<![A-Za-z0-9])(?:sk|rk|pk|sess)-[A-Za-z0-9_\-*.]{4,}")


# the words of the known routes: a path segment that is one of them is no key
_ROUTE_WORDS = frozenset(w for r in KNOWN_ROUTES for w in r.split("/") if w)


def _url_secrets(target: str) -> set[str]:
    """What a request target carries beside its route, as an error body may quote it (an
    Azure or a gateway 404 quotes the URL): the rest whole, each query value and each path
    segment of it (raw and percent-decoded), but the route's own words."""
    from turnguard_core.identity import split_target

    parts = split_target(target)
    rest = parts.route if parts.route.startswith("sha256:") else ""
    found = {parts.prefix, parts.suffix} if not rest else {target}
    path, _, query = (target if rest else parts.prefix + parts.suffix).partition("?")
    for param in query.split("&"):
        found.add(param.partition("=")[2])
    found.update(seg for seg in path.split("/") if seg not in _ROUTE_WORDS)
    return found | {urllib.parse.unquote_plus(f) for f in found}


def _header_secrets(value: str) -> set[str]:
    """A credential header's value as an error body may quote it: whole, the token after its
    scheme (``Bearer sk-...``), and each cookie's value (``a=1; b=2``)."""
    found = {value, value.split(" ", 1)[-1]}
    for pair in value.split(";"):
        found.update({pair.strip(), pair.partition("=")[2].strip()})
    return found


def _without_secrets(raw: bytes, request_headers,
                     credential_headers: frozenset[str] = frozenset(),
                     target: str = "") -> bytes:
    """An upstream's error body without the request's credential values (``_header_secrets``
    of each credential header, ``_url_secrets`` of its ``target``) and without anything shaped
    like a key, masked or not. The longest go first: a value is never half masked because a
    shorter one inside it went before."""
    secrets: set[str] = _url_secrets(target) if target else set()
    for name, value in request_headers.items(multi=True):
        if value and _is_secret(name, credential_headers):
            secrets |= _header_secrets(value)
    for secret in sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True):
        raw = raw.replace(secret.encode("utf-8", "surrogateescape"), b"***")
    return _KEY_LIKE.sub(b"sk-repro-redacted", raw)


def behaviour_of(flow, keep_bodies: bool,
                 credential_headers: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The mock behaviour that reproduces what the upstream did for one dispatched flow (an
    error body without the request's secrets: ``_without_secrets``)."""
    req_end = flow.request.timestamp_end or flow.request.timestamp_start
    r, err = flow.response, flow.error
    if r is None:
        t = err.timestamp if err is not None else req_end
        d = _ms(req_end, t)
        why = err.msg if err is not None else "no answer"
        if d < QUICK_FAILURE_MS:
            return {"kind": "reset", "note": f"no response: {why} after {d} ms"}
        return {"kind": "stall_before_headers", "ms": d,
                "note": f"no response headers for {d} ms, then: {why} (the stall may have been "
                        "longer if a proxy or the client ended it)"}
    delay = _ms(req_end, r.timestamp_start)
    ctype = r.headers.get("content-type", "").lower()
    if not 200 <= r.status_code < 300:
        b: dict[str, Any] = {"kind": "status", "code": r.status_code, "delay_ms": delay}
        raw = _without_secrets(r.get_content(strict=False) or b"", flow.request.headers,
                               credential_headers, flow.request.path)
        try:
            b["body"] = json.loads(raw) if raw else ""
        except ValueError:
            b["body"] = raw[:MAX_ERROR_BODY].decode("utf-8", "replace")
        ra = r.headers.get("retry-after")
        if ra is not None:
            try:
                b["retry_after"] = float(ra) if "." in ra else int(ra)
            except ValueError:
                pass
        extra = {k: r.headers[k] for k in ("x-should-retry", "retry-after-ms") if k in r.headers}
        if extra:
            b["headers"] = extra
        return b
    if "text/event-stream" not in ctype:
        return {"kind": "ok", "delay_ms": delay, "note": f"a whole {ctype or 'untyped'} body"}
    end_t = r.timestamp_end or (err.timestamp if err is not None else r.timestamp_start)
    seen = flow.metadata.get("repro_capture")  # capture_addon.py was loaded
    if isinstance(seen, dict) and seen.get("body") is not None:
        raw = seen["body"].encode("utf-8")
        if seen.get("t_last_event"):
            end_t = seen["t_last_event"]
    elif r.raw_content is not None:
        raw = r.get_content(strict=False) or b""
    elif err is not None:  # the body is not in the file: mitmproxy drops it when a stream breaks
        return {"kind": "partial", "events": 1, "end": "reset", "delay_ms": delay,
                "note": f"headers, then: {err.msg}; the events sent before are unknown (the body "
                        "is not in the capture: record with capture_addon.py); replayed as 1"}
    else:
        return {"kind": "ok", "delay_ms": delay, "note": "the body was streamed, not captured"}
    events = _sse_events(raw)
    types = [t for t, _ in events]
    gap = _ms(r.timestamp_start, end_t) // max(1, len(events) - 1) if len(events) > 1 else 0
    terminal = next((t for t in reversed(types) if t in (
        "response.completed", "response.incomplete", "response.failed", "error")), None)
    if err is None and terminal in ("response.completed", "response.incomplete"):
        final = events[types.index(terminal)][1]
        output = (final.get("response") or {}).get("output") or [] if isinstance(final, dict) else []
        calls = [i for i in output if isinstance(i, dict) and i.get("type") == "function_call"]
        if calls:
            return {"kind": "tool_call", "name": calls[0].get("name", "tool"),
                    "arguments": calls[0].get("arguments", "{}") if keep_bodies else "{}",
                    "delay_ms": delay, "gap_ms": gap}
        deltas = [d.get("delta", "") for t, d in events
                  if t == "response.output_text.delta" and isinstance(d, dict)]
        b = {"kind": "ok", "events": len(deltas), "delay_ms": delay, "gap_ms": gap}
        if deltas:
            b["delta_bytes"] = round(sum(len(x.encode()) for x in deltas) / len(deltas))
            if keep_bodies and len(set(deltas)) == 1:
                b["text"] = deltas[0]
        return b
    if terminal in ("response.failed", "error") and err is None:
        return {"kind": "partial", "events": max(0, len(events) - 1), "end": "failed",
                "delay_ms": delay, "gap_ms": gap}
    if not events:
        return {"kind": "stall_after_headers", "ms": _ms(r.timestamp_start, end_t), "delay_ms": delay,
                "note": f"headers, then no event; ended with: {err.msg if err else 'a clean end'}"}
    return {"kind": "partial", "events": len(events), "end": "reset", "delay_ms": delay, "gap_ms": gap,
            "note": f"{len(events)} events, then: {err.msg if err else 'the stream ended early'}"}


def _end_of(flow) -> float | None:
    """When the client's answer ended: its response's last byte, else the failure's time."""
    if flow.response is not None and flow.response.timestamp_end is not None:
        return flow.response.timestamp_end
    return flow.error.timestamp if flow.error is not None else None


def _dispatched(flow) -> bool:
    role = (flow.metadata.get("turnguard") or {}).get("role")
    return role not in ("replay", "answered")


def scenario_from_flows(path: str, *, keep_bodies: bool = False,
                        columns: list[str] | None = None,
                        credential_headers: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """(scenario, one-paragraph summary) from a mitmproxy flow file. ``credential_headers``:
    more header names whose values are secrets (as the proxy's
    ``turnguard_credential_headers``)."""
    from mitmproxy import http, io  # the runner needs mitmproxy anyway; import late for --help

    with open(path, "rb") as f:
        flows = [fl for fl in io.FlowReader(f).stream() if isinstance(fl, http.HTTPFlow)]
    model = [fl for fl in flows if fl.request.method == "POST" and MODEL_PATH.search(fl.request.path)]
    if not model:
        raise ValueError(f"{path}: no POST .../responses or .../chat/completions flows "
                         f"({len(flows)} HTTP flows in the file)")
    model.sort(key=lambda fl: fl.request.timestamp_start)
    t0 = model[0].request.timestamp_start
    cleaner = _Cleaner(keep_bodies, frozenset(credential_name(h.strip())
                                              for h in credential_headers if h.strip()))
    by_session: dict[str, list[dict[str, Any]]] = {}
    ends: dict[str, list[float | None]] = {}  # per session, each request's end (as sent)
    operations: dict[str, dict[str, Any]] = {}
    dispatched = answered = 0
    for fl in model:
        headers = cleaner.headers(fl.request.headers)
        body_text = cleaner.body(fl.request.raw_content or b"")
        session = headers.get("session-id") or headers.get("session_id") or "no-session"
        req = {
            "at_ms": _ms(t0, fl.request.timestamp_start),
            "path": cleaner.path(fl.request.path),
            "headers": headers,
            "body_text": body_text,
            "flow": fl.id,
        }
        reqs, session_ends = by_session.setdefault(session, []), ends.setdefault(session, [])
        earlier = [(end, i) for i, end in enumerate(session_ends)
                   if end is not None and end <= fl.request.timestamp_start]
        if earlier:
            end, i = max(earlier)
            req["after"], req["after_gap_ms"] = i, _ms(end, fl.request.timestamp_start)
        reqs.append(req)
        session_ends.append(_end_of(fl))
        if _dispatched(fl):
            dispatched += 1
            key = hashlib.sha256(body_text.encode()).hexdigest()
            operations.setdefault(key, {"sequence": [], "default": {"kind": "ok"}})
            operations[key]["sequence"].append(
                behaviour_of(fl, keep_bodies, cleaner.credential_headers))
        else:
            answered += 1
    clients = [
        {"name": f"capture-{i + 1}", "model": "timeline", "session": None if s == "no-session" else s,
         "params": {"requests": reqs}}
        for i, (s, reqs) in enumerate(by_session.items())
    ]
    last = max(fl.request.timestamp_start for fl in model)
    kinds = Counter(b["kind"] for op in operations.values() for b in op["sequence"])
    scenario = {
        "name": f"capture-{Path(path).stem}",
        "description": (
            f"Replay of {Path(path).name}: {len(model)} model requests over "
            f"{last - t0:.1f} s in {len(by_session)} session(s); {dispatched} were dispatched "
            f"upstream ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}), "
            f"{answered} answered by turnguard itself."
        ),
        "incident": "from a capture",
        "source": {"file": Path(path).name, "flows": len(flows), "model_requests": len(model),
                   "bodies": "verbatim" if keep_bodies else "content replaced by placeholders"},
        "shortened": [],
        "columns": columns or ["plain", "default", "once"],
        "deadline_s": min(900.0, max(60.0, (last - t0) + 60.0)),
        "upstream": {"default": {"kind": "ok"}, "operations": operations},
        "clients": clients,
    }
    dropped = ", ".join(f"{k} x{v}" for k, v in sorted(cleaner.dropped.items())) or "none"
    summary = (f"{scenario['description']} Secrets dropped: {dropped}; "
               f"{len(cleaner.credentials)} credential(s) replaced by dummies.")
    return scenario, summary
