"""Request identity: a pure function of one request (no mitmproxy, clock, disk or network).

Contract
--------
``identify(RequestView)`` returns an ``Identity`` for a request whose body is a UTF-8 JSON object
(no duplicate keys, nesting at most 256 deep, at most ``max_body_bytes``), else a
``Passthrough`` naming the reason; it never raises (it runs inside a proxy hook).

* Header lookup is case-insensitive; the first non-empty occurrence of a name wins; empty values
  count as absent.
* ``scope`` = sha256 hex of ``"turnguard-scope\\0"`` + the values of ``CREDENTIAL_HEADERS``
  (Authorization, chatgpt-account-id, api-key, x-api-key, openai-organization, openai-project)
  joined by NUL (missing headers are ""). Raw secrets appear in no field. A NUL in a value
  would make that
  encoding ambiguous (and is invalid HTTP), so such a request is a ``Passthrough``.
* Session key: ``session-id``, else ``session_id``, else the str ``session_id`` member of the JSON
  object in ``x-codex-turn-metadata``, else ``conversation_id``, else ``conversation-id``.
  ``session`` is its sha256 hex, first 16 chars.
* ``turn_state``: sha256 hex (16) of ``x-codex-turn-state``; ``idempotency_key``: sha256 hex (32)
  of ``Idempotency-Key``; ``previous_response_id``: the body's top-level non-empty str member.
* ``fingerprint`` = sha256 hex of ``canonical_json(body)``: stable under key order and whitespace.
* ``op_key`` = sha256 hex over the length-prefixed tuple (scope, session or "", METHOD, path,
  "idem:"+idempotency_key or "body:"+fingerprint). The same Idempotency-Key with another body
  has the same op_key and a different fingerprint (the caller answers 422).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_JSON_DEPTH",
    "Identity",
    "Passthrough",
    "RequestView",
    "canonical_json",
    "identify",
]

MAX_JSON_DEPTH = 256  # the top-level object is depth 1

# Who is asking: OpenAI's and ChatGPT's (Authorization, chatgpt-account-id), Azure OpenAI's and
# gateways' API keys, and the OpenAI organization and project a key acts for.
CREDENTIAL_HEADERS = (
    "authorization", "chatgpt-account-id", "api-key", "x-api-key", "openai-organization",
    "openai-project",
)


@dataclass(frozen=True, slots=True)
class RequestView:
    """What identify() needs of a request."""

    method: str
    path: str  # path including query string, as sent
    headers: tuple[tuple[str, str], ...]  # (name, value), names any case; repeats possible
    body: bytes | None  # decoded body (content-encoding removed); None when undecodable


@dataclass(frozen=True, slots=True)
class Identity:
    """A request's identity. Every field is a hash or a value taken from the body; no secrets."""

    scope: str
    session: str | None
    turn_state: str | None
    previous_response_id: str | None
    idempotency_key: str | None
    fingerprint: str
    op_key: str

    @property
    def op_id(self) -> str:
        """Short operation id for telemetry."""
        return self.op_key[:12]

    @property
    def has_hard_anchor(self) -> bool:
        """Hard turn-state request: carries x-codex-turn-state and no previous_response_id."""
        return self.turn_state is not None and self.previous_response_id is None


@dataclass(frozen=True, slots=True)
class Passthrough:
    """The request cannot be identified; forward it unguarded and log ``reason``."""

    reason: str


class _Reject(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _DuplicateKey(Exception):
    pass


def canonical_json(value: Any) -> bytes:
    """Canonical bytes of a parsed JSON value: sorted keys, no whitespace, UTF-8.

    Lone surrogates (legal as JSON escapes) are encoded with ``surrogatepass`` so this is total.
    """
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True
    ).encode("utf-8", "surrogatepass")


def identify(
    request: RequestView, *, max_body_bytes: int = 64 * 1024 * 1024
) -> Identity | Passthrough:
    """The request's Identity, or a Passthrough with a reason. Never raises."""
    try:
        return _identify(request, max_body_bytes)
    except _Reject as r:
        return Passthrough(r.reason)
    except RecursionError:
        return Passthrough("JSON nesting too deep")
    except Exception as e:  # noqa: BLE001 - a proxy hook must never see an exception
        return Passthrough(f"identity failed ({type(e).__name__})")


def _identify(request: RequestView, max_body_bytes: int) -> Identity:
    body = _parse_body(request.body, max_body_bytes)
    headers = _first_values(request.headers)

    credentials = [headers.get(name, "") for name in CREDENTIAL_HEADERS]
    if any("\0" in value for value in credentials):
        raise _Reject("credential header contains NUL")
    scope = _sha(b"turnguard-scope\0" + b"\0".join(_utf8(value) for value in credentials))

    session_key = _session_key(headers)
    session = _sha(_utf8(session_key))[:16] if session_key else None
    turn_state_raw = headers.get("x-codex-turn-state")
    turn_state = _sha(_utf8(turn_state_raw))[:16] if turn_state_raw else None
    idem_raw = headers.get("idempotency-key")
    idempotency_key = _sha(_utf8(idem_raw))[:32] if idem_raw else None

    prev = body.get("previous_response_id")
    previous_response_id = prev if isinstance(prev, str) and prev else None

    fingerprint = _sha(canonical_json(body))
    op_key = _tuple_hash(
        scope,
        session or "",
        request.method.upper(),
        request.path,
        f"idem:{idempotency_key}" if idempotency_key else f"body:{fingerprint}",
    )
    return Identity(
        scope=scope,
        session=session,
        turn_state=turn_state,
        previous_response_id=previous_response_id,
        idempotency_key=idempotency_key,
        fingerprint=fingerprint,
        op_key=op_key,
    )


def _parse_body(body: bytes | None, max_body_bytes: int) -> dict[str, Any]:
    """The body as a JSON object, or raise _Reject with the reason."""
    if body is None:
        raise _Reject("body could not be decoded")
    if not body:
        raise _Reject("no body")
    if len(body) > max_body_bytes:
        raise _Reject(f"body too large ({len(body)} bytes > limit {max_body_bytes})")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        raise _Reject("body is not UTF-8") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey:
        raise _Reject("duplicate keys in JSON body") from None
    except RecursionError:
        raise _Reject("JSON nesting too deep") from None
    except ValueError:  # JSONDecodeError, and int literals past sys.get_int_max_str_digits()
        raise _Reject("body is not JSON") from None
    if not isinstance(value, dict):
        raise _Reject("body is not a JSON object")
    if _deeper_than(value, MAX_JSON_DEPTH):
        raise _Reject("JSON nesting too deep")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateKey
    return obj


def _deeper_than(value: Any, limit: int) -> bool:
    """True if containers nest more than ``limit`` deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        for child in v.values() if isinstance(v, dict) else v:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def _first_values(headers: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Lower-cased name -> first non-empty value."""
    out: dict[str, str] = {}
    for name, value in headers:
        if value:
            out.setdefault(name.lower(), value)
    return out


def _session_key(headers: dict[str, str]) -> str | None:
    for name in ("session-id", "session_id"):
        if value := headers.get(name):
            return value
    if meta := headers.get("x-codex-turn-metadata"):
        try:
            obj = json.loads(meta)
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict):
            sid = obj.get("session_id")
            if isinstance(sid, str) and sid:
                return sid
    for name in ("conversation_id", "conversation-id"):
        if value := headers.get(name):
            return value
    return None


def _utf8(s: str) -> bytes:
    # surrogatepass: header values from mitmproxy may carry surrogate escapes; stays injective.
    return s.encode("utf-8", "surrogatepass")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tuple_hash(*parts: str) -> str:
    """sha256 hex over an unambiguous encoding: each part as b"<len>:" + utf8 + b"\\0"."""
    h = hashlib.sha256(b"turnguard-op\0")
    for part in parts:
        b = _utf8(part)
        h.update(b"%d:" % len(b))
        h.update(b)
        h.update(b"\0")
    return h.hexdigest()
