"""Request identity: a pure function of one request (no mitmproxy, clock, disk or network).

Contract
--------
``identify(RequestView)`` returns an ``Identity`` for a request whose body is a UTF-8 JSON object
(no duplicate keys, nesting at most 256 deep, at most ``max_body_bytes``), else a
``Passthrough`` naming the reason; it never raises (it runs inside a proxy hook).

Every field of an ``Identity`` is a hash, a known route or a value taken from the body: no raw
credential, session id or URL appears in it. All hashes are sha256 hex over a length-prefixed
tuple, so no two different tuples share an encoding.

* **Target.** The request target (path and query) is split by ``split_target``: ``route`` is
  the known route (``KNOWN_ROUTES``) the path ends with (one trailing "/" allowed), else
  ``"sha256:"`` + a hash of the whole path; everything else of the target (the path before the
  route, a trailing "/", the query string; for an unknown route the whole path and query) is
  the *URL rest*, which may carry a key (``/sk-.../v1/responses``, ``?key=``) and so counts
  as a credential.
* **Principal** = hash of every credential the request carries: the values of the
  credential-bearing headers present (``CREDENTIAL_HEADERS`` plus the caller's
  ``credential_headers``; names case-insensitive, ``_`` read as ``-``, since servers that map
  headers to CGI-style names read ``x_api_key`` as ``x-api-key``; every non-empty value of a
  repeated header, in order: an empty one is no credential), the URL rest, and the proxy's
  own authentication (``proxy_auth``: mitmproxy's proxyauth consumes ``Proxy-Authorization``
  before turnguard sees it); and, when the caller names any beyond ``CREDENTIAL_HEADERS``,
  those names (``named_beyond_builtin``): a principal computed under other names is another
  principal, so what was identified before ``turnguard_credential_headers`` changed (a request
  whose credential in a header named since was not counted) is never shared after it.
* **Upstream** = hash of where the proxy sends the request: scheme, host and port it connects
  to, the Host header it sends when that names another host or port (virtual hosting), the
  authority of an absolute-form request target when that names another (a reverse proxy
  forwards it as it came; the origin takes the host from it), and the upstream proxy it goes
  through (mitmproxy's upstream mode). ``None`` (callers outside a
  proxy: tests, tools) is a value of its own.
* ``scope`` = hash(principal, upstream): whatever is shared, is shared only within it.
* Session key: ``session-id``, else ``session_id``, else the str ``session_id`` member of the
  JSON object in ``x-codex-turn-metadata``, else ``conversation_id``, else
  ``conversation-id`` (header lookup case-insensitive; first non-empty occurrence wins).
  ``session`` = hash(scope, session key)[:32]: a client-chosen session id never names
  another principal's or another upstream's session.
* ``turn_state``: sha256 hex (16) of ``x-codex-turn-state``; ``idempotency_key``: sha256 hex
  (32) of ``Idempotency-Key``; ``previous_response_id``: the body's top-level non-empty str.
* ``fingerprint`` = sha256 hex of ``canonical_json(fingerprint_body(body))``: stable under key
  order and whitespace, and blind to the fields only a transport adds (``operation_body``)
  and to what a client adds to the input items it sends back (``fingerprint_body``), so a
  Responses call sent as a WebSocket ``response.create`` frame (a delta frame rebuilt from
  the socket's record), its retries and its HTTP POST fallback have one fingerprint. A frame is identified as the POST it stands for
  (``socket_call_body``: with ``"stream": true``, since a socket answers with events whatever
  the frame says), never as a POST that asks for one JSON object.
* ``op_key`` = hash(scope, session or "", METHOD, route, "idem:"+idempotency_key or
  "body:"+fingerprint). The same Idempotency-Key with another body has the same op_key and a
  different fingerprint (the caller answers 422).
* ``conversation``: the body names a Responses ``conversation`` (a non-empty value). The
  upstream answers such a request from the conversation's items, to which its own turn is
  added once it completes: the same body sent again afterwards is the conversation's next
  turn, not this one (the caller replays a completed one only with an Idempotency-Key).
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from .codec import decode_content
from .records import record

__all__ = [
    "CREDENTIAL_HEADERS",
    "KNOWN_ROUTES",
    "MAX_JSON_DEPTH",
    "Identity",
    "Passthrough",
    "RequestView",
    "Target",
    "Upstream",
    "canonical_json",
    "credential_name",
    "fingerprint_body",
    "identify",
    "operation_body",
    "parse_json_object",
    "socket_call_body",
    "split_target",
]

MAX_JSON_DEPTH = 256  # the top-level object is depth 1

# Headers that say who is asking, by provider: the standard ones (Authorization,
# Proxy-Authorization, Cookie); API keys of Azure OpenAI (api-key), Anthropic and many gateways
# (x-api-key), Google (x-goog-api-key), Azure API Management (ocp-apim-subscription-key),
# Cloudflare AI Gateway (cf-aig-authorization), Portkey (x-portkey-api-key,
# x-portkey-virtual-key), Helicone (helicone-auth), LiteLLM (x-litellm-api-key), Kong's
# key-auth and Supabase (apikey), Cloudflare Access service tokens (cf-access-client-id,
# cf-access-client-secret), Azure Functions (x-functions-key); the account,
# organization or project a key acts for (chatgpt-account-id, openai-organization,
# openai-project, x-goog-user-project); AWS session tokens (x-amz-security-token).
# More with the turnguard_credential_headers option.
CREDENTIAL_HEADERS = (
    "authorization", "proxy-authorization", "cookie",
    "api-key", "x-api-key", "x-goog-api-key", "ocp-apim-subscription-key",
    "cf-aig-authorization", "x-portkey-api-key", "x-portkey-virtual-key", "helicone-auth",
    "x-litellm-api-key", "apikey", "cf-access-client-id", "cf-access-client-secret",
    "x-functions-key",
    "chatgpt-account-id", "openai-organization", "openai-project", "x-goog-user-project",
    "x-amz-security-token",
    "sec-websocket-protocol",  # browsers' clients send their key as a subprotocol
)

# The model routes turnguard knows by name (the default filter guards POSTs to exactly these,
# at the start of the path): OpenAI's Responses and Chat Completions, Codex's ChatGPT backend,
# and Azure OpenAI's v1 API.
KNOWN_ROUTES = (
    "/v1/responses", "/v1/chat/completions", "/backend-api/codex/responses",
    "/openai/v1/responses", "/openai/v1/chat/completions",
)
# What Codex adds to a Responses request only when it sends it as a WebSocket frame: the frame
# type, the moment of this send (new on every retry) and copies of transport headers.
WS_FRAME_TYPE = "response.create"
WS_ONLY_METADATA = frozenset({"x-codex-ws-stream-request-start-ms"})
WS_ONLY_METADATA_PREFIX = "ws_request_header_"
# What the Codex CLI adds to an input item it sends back from its history (its own
# bookkeeping, never the model's): an output item of the upstream comes back with it.
CLIENT_ITEM_METADATA = frozenset({"internal_chat_message_metadata_passthrough"})
_ROUTES_LONGEST_FIRST = tuple(sorted(KNOWN_ROUTES, key=len, reverse=True))
_DEFAULT_PORTS = {"http": 80, "https": 443}


@record
class Upstream:
    """Where the proxy sends a request: the address it connects to (scheme, host, port), the
    Host header it sends (``host_header``), the authority of an absolute-form request target
    it sends as it came (``authority``: a reverse proxy forwards ``POST http://a.example/...``
    so, and the origin then takes the host from it, not from Host), the upstream proxy in
    between (``via``, e.g. ``"http://127.0.0.1:3128"``), if any, and the TLS server name it
    sends (``sni``: a front that routes by it sends two names to two sites)."""

    scheme: str
    host: str
    port: int
    host_header: str | None = None
    via: str | None = None
    authority: str | None = None
    sni: str | None = None

    def parts(self) -> tuple[str, ...]:
        """The canonical parts that identify it. The Host header and the target's authority
        count only when they name another host or port than the one connected to (an
        authority that does not adds no part: the same parts as without one); the server
        name only over TLS, and when it names another host than both."""
        scheme, host = self.scheme.lower(), _bare_host(self.host)
        vhost = ""
        named_host = host
        if self.host_header:
            named = _parse_authority(self.host_header, _DEFAULT_PORTS.get(scheme))
            named_host = _bare_host(named[0])
            if named != (host, self.port):
                vhost = self.host_header.lower()
        parts = (scheme, host, str(int(self.port)), vhost, (self.via or "").lower())
        if self.authority:
            named = _parse_authority(self.authority, _DEFAULT_PORTS.get(scheme))
            if named != (host, self.port):
                parts += ("authority", self.authority.lower())
        if self.sni and scheme == "https":
            sni = self.sni.lower()
            if sni not in (host, named_host):
                parts += ("sni", sni)
        return parts


@record
class RequestView:
    """What identify() needs of a request."""

    method: str
    path: str  # request target: path including query string, as sent
    headers: tuple[tuple[str, str], ...]  # (name, value), names any case; repeats possible
    body: bytes | None  # decoded body (content-encoding removed); None when undecodable
    upstream: Upstream | None = None  # None: not known (outside a proxy)
    proxy_auth: str | None = None  # credentials the proxy itself authenticated and removed
    # content codings still on ``body`` (``codec.content_codings``): identify decodes it, at
    # most ``max_body_bytes`` a coding (the shell leaves a body that decodes large to the worker)
    body_codings: tuple[str, ...] = ()


@record
class Target:
    """A request target split into the route it names and the rest (see ``split_target``)."""

    route: str  # a KNOWN_ROUTES entry, or "sha256:" + 32 hex digits of the path
    prefix: str  # the path before the route (the whole path for an unknown route)
    suffix: str  # a trailing "/" and the query string with its "?"


@record
class Identity:
    """A request's identity. Every field is a hash, a known route, or a value taken from the
    body; no secrets."""

    principal: str
    upstream: str
    scope: str
    session: str | None
    route: str
    turn_state: str | None
    previous_response_id: str | None
    idempotency_key: str | None
    fingerprint: str
    op_key: str
    # the body names a ``conversation``: the upstream answers it from state its own turn
    # changes, so a completed one answers only the duplicates that came while it ran
    conversation: bool = False
    # the header names it was identified under beyond CREDENTIAL_HEADERS (names, no value):
    # its attempt's recording keeps none of them, whatever turnguard_credential_headers says
    # when it ends
    credential_names: tuple[str, ...] = ()

    @property
    def op_id(self) -> str:
        """Short operation id for telemetry."""
        return self.op_key[:12]

    @property
    def has_hard_anchor(self) -> bool:
        """Hard turn-state request: carries x-codex-turn-state and no previous_response_id."""
        return self.turn_state is not None and self.previous_response_id is None


@record
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
    return _CANONICAL_ENCODER.encode(value).encode("utf-8", "surrogatepass")


# json.dumps and json.loads with options other than the defaults build an encoder or decoder on
# every call: made once here (they keep no state between calls).
_CANONICAL_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)


def operation_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request body as its operation: ``body`` without the fields a transport adds (a
    top-level ``"type": "response.create"``, and in ``client_metadata`` the WebSocket-only
    keys ``WS_ONLY_METADATA`` and ``ws_request_header_*``). A body without them is returned
    as is; ``body`` is never changed."""
    out = body
    if body.get("type") == WS_FRAME_TYPE:
        out = {k: v for k, v in body.items() if k != "type"}
    meta = body.get("client_metadata")
    if isinstance(meta, dict) and any(_ws_only_metadata(k) for k in meta):
        out = {**out, "client_metadata": {k: v for k, v in meta.items()
                                          if not _ws_only_metadata(k)}}
    return out


def fingerprint_body(body: dict[str, Any]) -> dict[str, Any]:
    """What a request's fingerprint is the hash of: ``operation_body(body)`` with each object
    of its ``input`` list as the model reads it, without the members a client adds to the
    items it keeps and sends back (``CLIENT_ITEM_METADATA``) and without members whose value
    is null (to the API, absent). The Codex CLI puts each output item of a response into its
    history so (measured, 0.171.0: ``internal_chat_message_metadata_passthrough`` on every
    item, ``"content": null`` on a reasoning item): the full input of its resend then holds
    the items the upstream sent as the socket's record holds them, and a delta frame rebuilt
    from that record has the resend's fingerprint. ``body`` is never changed."""
    out = operation_body(body)
    items = out.get("input")
    if isinstance(items, list) and any(isinstance(i, dict) and _item_bookkeeping(i)
                                       for i in items):
        out = {**out, "input": [
            {k: v for k, v in i.items() if v is not None and k not in CLIENT_ITEM_METADATA}
            if isinstance(i, dict) else i for i in items]}
    return out


def _item_bookkeeping(item: dict[str, Any]) -> bool:
    return any(v is None or k in CLIENT_ITEM_METADATA for k, v in item.items())


def socket_call_body(body: dict[str, Any]) -> dict[str, Any]:
    """A call sent as a WebSocket ``response.create`` frame as the HTTP POST it stands for:
    ``operation_body(body)`` with ``"stream": true``. Its answer is a stream of events whatever
    the frame says of ``stream`` (events are all that transport carries), which over HTTP is
    what a POST asking ``"stream": true`` gets; a POST without it asks for one JSON response
    object, another answer, so another operation. ``body`` is never changed."""
    out = operation_body(body)
    if out.get("stream") is not True:
        out = {**out, "stream": True}
    return out


def _ws_only_metadata(key: str) -> bool:
    return key in WS_ONLY_METADATA or key.startswith(WS_ONLY_METADATA_PREFIX)


def split_target(target: str) -> Target:
    """Split a request target (path + query) into its route and the rest. The route is the
    longest of ``KNOWN_ROUTES`` the path ends with (after dropping one trailing "/"), so that
    ``/KEY/v1/responses`` has the route ``/v1/responses`` and the prefix ``/KEY``; a path that
    ends with none has a hashed route and is all prefix. Never raises for a str."""
    query_at = target.find("?")
    path, query = (target, "") if query_at < 0 else (target[:query_at], target[query_at:])
    trimmed = path[:-1] if path.endswith("/") and len(path) > 1 else path
    for route in _ROUTES_LONGEST_FIRST:
        if trimmed.endswith(route):
            return Target(route, trimmed[: -len(route)], path[len(trimmed):] + query)
    return Target("sha256:" + _sha(_utf8(path))[:32], path, query)


def identify(
    request: RequestView,
    *,
    max_body_bytes: int = 64 * 1024 * 1024,
    credential_headers: tuple[str, ...] = (),
) -> Identity | Passthrough:
    """The request's Identity, or a Passthrough with a reason. Never raises.

    ``credential_headers`` names more credential-bearing headers (any case) than
    ``CREDENTIAL_HEADERS``."""
    try:
        return _identify(request, max_body_bytes, credential_headers)
    except _Reject as r:
        return Passthrough(r.reason)
    except RecursionError:
        return Passthrough("JSON nesting too deep")
    except Exception as e:  # noqa: BLE001 - a proxy hook must never see an exception
        return Passthrough(f"identity failed ({type(e).__name__})")


def _identify(
    request: RequestView, max_body_bytes: int, credential_headers: tuple[str, ...]
) -> Identity:
    body = _parse_body(_decoded(request, max_body_bytes), max_body_bytes)
    headers = _first_values(request.headers)
    target = split_target(request.path)

    principal = _principal(request, target, credential_headers)
    named = named_beyond_builtin(tuple(credential_headers))
    upstream = _upstream_hash(request.upstream)
    scope = _scope_hash(principal, upstream)

    session_key = _session_key(headers)
    session = _tuple_hash("session", scope, session_key)[:32] if session_key else None
    turn_state_raw = headers.get("x-codex-turn-state")
    turn_state = _sha(_utf8(turn_state_raw))[:16] if turn_state_raw else None
    idem_raw = headers.get("idempotency-key")
    idempotency_key = _sha(_utf8(idem_raw))[:32] if idem_raw else None

    prev = body.get("previous_response_id")
    previous_response_id = prev if isinstance(prev, str) and prev else None

    fingerprint = _sha(canonical_json(fingerprint_body(body)))
    op_key = _tuple_hash(
        "op",
        scope,
        session or "",
        request.method,  # case-sensitive, as HTTP's: `post` is not `POST` to an origin
        target.route,
        f"idem:{idempotency_key}" if idempotency_key else f"body:{fingerprint}",
    )
    return Identity(
        principal=principal,
        upstream=upstream,
        scope=scope,
        session=session,
        route=target.route,
        turn_state=turn_state,
        previous_response_id=previous_response_id,
        idempotency_key=idempotency_key,
        fingerprint=fingerprint,
        op_key=op_key,
        conversation=body.get("conversation") not in (None, "", {}),
        credential_names=named,
    )


def principal_of(request: RequestView, credential_names: tuple[str, ...]) -> str:
    """The principal ``identify`` gives ``request`` when its credential names beyond the
    built-in ones are ``credential_names`` (an Identity's ``credential_names``): to tell
    whether a request still carries the credentials it was identified with."""
    return _principal(request, split_target(request.path), credential_names)


def _principal(request: RequestView, target: Target, extra_names: tuple[str, ...]) -> str:
    """Hash of every credential the request carries (see the module docstring)."""
    names = _credential_names(tuple(extra_names))
    values: dict[str, list[str]] = {}
    for name, value in request.headers:
        key = credential_name(name)
        if key in names and value:
            values.setdefault(key, []).append(value)
    parts = ["headers", str(len(values))]
    for name in sorted(values):
        parts += [name, str(len(values[name])), *values[name]]
    named = named_beyond_builtin(tuple(extra_names))
    if named:  # (none named: the hash stays what it always was)
        parts += ["named", str(len(named)), *named]
    parts += ["url", target.prefix, target.suffix]
    parts += ["proxy-auth", "" if request.proxy_auth is None else "=" + request.proxy_auth]
    return _tuple_hash("principal", *parts)


# The upstream and the scope are the same for most of a proxy's requests: their hashes are
# remembered (keyed by the upstream, and by hashes: no credential is kept).
@functools.lru_cache(maxsize=256)
def _upstream_hash(upstream: Upstream | None) -> str:
    if upstream is None:
        return _tuple_hash("upstream-unknown")
    return _tuple_hash("upstream", *upstream.parts())


@functools.lru_cache(maxsize=1024)
def _scope_hash(principal: str, upstream: str) -> str:
    return _tuple_hash("scope", principal, upstream)


@functools.lru_cache(maxsize=64)
def _credential_names(extra_names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(CREDENTIAL_HEADERS) | {credential_name(name) for name in extra_names}


@functools.lru_cache(maxsize=64)
def named_beyond_builtin(extra_names: tuple[str, ...]) -> tuple[str, ...]:
    """The credential-bearing header names configured beyond ``CREDENTIAL_HEADERS``, as
    credential names, sorted, each once: a principal counts a header only under these names,
    so they are part of it."""
    return tuple(sorted({credential_name(name) for name in extra_names} - set(CREDENTIAL_HEADERS)))


def credential_name(name: str) -> str:
    """A header's name as a credential header is named: lower case, ``_`` read as ``-``
    (servers that map headers to CGI-style names read ``x_api_key`` as ``x-api-key``)."""
    return name.lower().replace("_", "-")


def parse_json_object(body: bytes | None, max_bytes: int) -> dict[str, Any] | Passthrough:
    """``body`` as a JSON object under the same rules as a request body (UTF-8, no duplicate
    keys, at most ``MAX_JSON_DEPTH`` deep, at most ``max_bytes``), or a Passthrough naming
    what is wrong. Never raises."""
    try:
        return _parse_body(body, max_bytes)
    except _Reject as r:
        return Passthrough(r.reason)
    except RecursionError:
        return Passthrough("JSON nesting too deep")


def _decoded(request: RequestView, max_body_bytes: int) -> bytes | None:
    if not request.body_codings or request.body is None:
        return request.body
    try:
        return decode_content(request.body, request.body_codings, max_body_bytes)
    except ValueError:
        return None


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
        value = _BODY_DECODER.decode(text)
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


def _not_json(constant: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are no JSON (RFC 8259), though Python reads
    them: as floats they would be one body with ``1e400`` (a number an origin may take where
    it refuses ``Infinity``)."""
    raise ValueError(f"{constant} is not JSON")


# what json.loads would make, refusing what is no JSON
_BODY_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_not_json)


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


def _tuple_hash(domain: str, *parts: str) -> str:
    """sha256 hex over an unambiguous encoding: "turnguard-<domain>", then each part as
    b"<len>:" + utf8 + b"\\0"."""
    text = "".join(["turnguard-", domain, "\0", *[f"{len(p)}:{p}\0" for p in parts]])
    if text.isascii():  # the common case: a character is a byte, so each length is the same
        return hashlib.sha256(text.encode("ascii")).hexdigest()
    out = [b"turnguard-" + _utf8(domain) + b"\0"]
    for part in parts:  # the same bytes as updating a hash part by part, in one update
        b = _utf8(part)
        out.append(b"%d:%b\0" % (len(b), b))
    return hashlib.sha256(b"".join(out)).hexdigest()


def _bare_host(host: str) -> str:
    return host.lower().removeprefix("[").removesuffix("]")


def _parse_authority(authority: str, default_port: int | None) -> tuple[str, int | None]:
    """(host, port) of a Host header value; the port is ``default_port`` when absent and
    None when it is not a number (then it matches no connection)."""
    value = authority.strip()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
    else:
        host, colon, port_text = value.rpartition(":")
        if not colon or ":" in host:  # no port, or a bare IPv6 address
            host, port_text = value, None
    if port_text is None:
        return host.lower(), default_port
    return host.lower(), int(port_text) if port_text.isdigit() and len(port_text) <= 5 else None
