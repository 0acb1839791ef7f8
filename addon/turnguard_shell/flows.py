"""Everything turnguard reads from or does to an HTTP flow (mitmproxy's ``http.HTTPFlow``).

The pure core never sees a flow: this module turns a flow into a ``RequestView`` for identity,
tells whether its client still wants an answer, answers it (turnguard's own answers and
replays), and explains it in mitmweb (a mark and a comment).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import weakref

from mitmproxy import ctx, hooks, http
from mitmproxy.flow import Error
from mitmproxy.net.http import status_codes

from turnguard_core import answers, identity
from turnguard_core.codec import TooBig, content_codings, decode_content
from turnguard_core.offload import INLINE_MAX_BYTES
from turnguard_core.proxy_internals import (
    client_stream_closed,
    client_transport_ended,
    find_http_layer,
)

MARK_REPLAYED = ":recycle:"


def accepts_sse(flow: http.HTTPFlow) -> bool:
    return "text/event-stream" in header(flow.request.headers, b"accept", "")


def header(headers: http.Headers, name: bytes, default: str) -> str:
    """``headers.get(name, default)`` (repeats folded with ", "), for a lower-case ``name``,
    read in one comprehension over the fields: ``Headers.get`` makes a dozen Python calls
    and one more for each header."""
    values = [v for k, v in headers.fields if k.lower() == name]
    if not values:
        return default
    return ", ".join([v.decode("utf-8", "surrogateescape") for v in values])


def request_headers(flow: http.HTTPFlow) -> tuple[tuple[str, str], ...]:
    """The request's headers as (name, value) pairs, in order, repeats kept."""
    return headers_of(flow.request)


def response_headers(flow: http.HTTPFlow) -> tuple[tuple[str, str], ...]:
    """The response's headers as ``request_headers`` gives the request's."""
    return headers_of(flow.response) if flow.response is not None else ()


# Each message's headers as str pairs, the last time they were read, kept on the message
# (not copied with it, never serialized): a guarded request's are read three times or more
# (identity, the live response's head, the recording's Vary key), about 0.5 us a header each
# time. (A weak-keyed dictionary of messages cost more than the reads it saved: weak
# references to two messages a request.)
_HEADERS_READ = "_turnguard_headers_read"


def headers_of(message: http.Message) -> tuple[tuple[str, str], ...]:
    """``tuple(message.headers.items(multi=True))``, remembered while they are unchanged:
    mitmproxy's ``Headers`` replaces its ``fields`` tuple on every change (and a new
    ``Headers`` has its own), so the very same tuple means the very same headers."""
    fields = message.headers.fields
    seen = getattr(message, _HEADERS_READ, None)
    if seen is not None and seen[0] is fields:
        return seen[1]
    # what items(multi=True) yields, read in one comprehension: its generator calls a
    # function for each name and each value
    pairs = tuple([(k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
                   for k, v in fields])
    setattr(message, _HEADERS_READ, (fields, pairs))
    return pairs


def give_body_a_length(flow: http.HTTPFlow) -> None:
    """An HTTP/2 or HTTP/3 request may come with no Content-Length (a client streaming its
    body), and mitmproxy sends such a request to an HTTP/1.1 upstream with neither a
    Content-Length nor a Transfer-Encoding: a request without a body to that upstream. A
    dispatched request's body is whole here, so it goes with its length (valid on any
    version)."""
    req = flow.request
    if ((req.is_http2 or req.is_http3) and req.raw_content
            and "content-length" not in req.headers and "transfer-encoding" not in req.headers):
        req.headers["content-length"] = str(len(req.raw_content))


def request_view(flow: http.HTTPFlow, max_body: int) -> identity.RequestView | identity.Passthrough:
    """What identity needs of the request (as it will be sent: ``_as_sent``), or why it
    cannot be guarded. A body with content
    codings is decoded here when that stays within ``INLINE_MAX_BYTES``; past that it goes on
    encoded (``body_codings``), to be decoded with its identity off the event loop (a body of a
    few kilobytes can decode to the whole bound, and each coding to as much again).

    A streamed request body (``stream_large_bodies``, or an addon's ``request.stream``) went
    upstream before the ``request`` hook: the request can be neither held nor answered
    (mitmproxy sends the upstream's answer whatever the hook set), so it is not guarded, also
    when ``store_streamed_bodies`` kept a copy of the body (``raw_content`` is then set)."""
    if flow.request.raw_content is None or flow.request.stream:
        return identity.Passthrough("request body is streamed")
    sent = _as_sent(flow)  # (the body, URL and upstream it will go with)
    req = sent or flow.request
    if len(req.raw_content) > max_body:
        return identity.Passthrough(f"body too large ({len(req.raw_content)} bytes > limit {max_body})")
    body: bytes | None = req.raw_content
    codings = content_codings(header(req.headers, b"content-encoding", ""))
    if codings:
        try:
            body, codings = decode_content(body, codings, INLINE_MAX_BYTES), ()
        except TooBig:
            pass  # decoded with its identity, in the worker
        except ValueError:
            body, codings = None, ()
    headers = request_headers(flow) if sent is None else headers_of(sent)
    # the method as sent: mitmproxy's ``method`` upper-cases it, and `post` is not `POST`
    method = req.data.method.decode("ascii", "surrogateescape")
    return _view(flow, method, headers, body, codings, target=sent)


# mitmproxy's addons that add credentials to a request in their ``request`` hook (after
# turnguard's) when their filter is set: ``stickyauth`` (the last Authorization seen for the
# host, to a request without one) and ``stickycookie`` (its cookie jar's cookies).
_STICKY = ("stickyauth", "stickycookie")


def _as_sent(flow: http.HTTPFlow) -> http.Request | None:
    """The request as mitmproxy's ``map_remote``, ``modify_body``, ``stickyauth`` and
    ``stickycookie`` will send it, when they change it (None: they do not). They change a
    request in their ``request`` hook, which runs after the scripts' (turnguard's), by rules
    whose filters may read what is no part of the identity (a header, say), or from what
    other requests left (the sticky ones): the upstream, the path, the body and the
    credentials a request's identity names are those it will go with, so that two requests
    ``map_remote`` sends to two upstreams, whose bodies ``modify_body`` makes two (another
    model asked for) or that go on two keys never share an operation or a recording. They are
    applied as they apply themselves, in mitmproxy's order, to a copy of the flow."""
    try:
        addons = ctx.master.addons
        remote = getattr(addons.get("mapremote"), "replacements", None)
        body = getattr(addons.get("modifybody"), "replacements", None)
        sticky = [a for a in map(addons.get, _STICKY) if getattr(a, "flt", None) is not None]
    except AttributeError:  # no master (unit tests)
        return None
    if not remote and not body and not sticky:
        return None
    probe = flow.copy()
    for spec in remote or ():
        if spec.matches(probe):
            url = probe.request.pretty_url
            new_url = re.sub(spec.subject, spec.replacement, url)
            if url != new_url:
                probe.request.url = new_url
    for spec in body or ():
        if spec.matches(probe):
            try:
                replacement = spec.read_replacement()
                probe.request.content = re.sub(spec.subject, lambda _: replacement,
                                               probe.request.content, flags=re.DOTALL)
            except (OSError, ValueError):  # as modify_body itself, it changes nothing then
                continue  # (a body that cannot be decoded: identified as it is, undecodable)
    for addon in sticky:  # (they change nothing but the flow they are given, and stickyauth
        addon.request(probe)  # learns a key as it will from the request itself)
    sent, req = probe.request, flow.request
    if (sent.scheme, sent.host, sent.port, sent.path, sent.host_header, sent.raw_content,
            sent.headers.fields) == (req.scheme, req.host, req.port, req.path,
                                     req.host_header, req.raw_content, req.headers.fields):
        return None
    return sent


def ws_call_view(flow: http.HTTPFlow, body: bytes) -> identity.RequestView | identity.Passthrough:
    """What identity needs of a call sent on the WebSocket ``flow``: the call's full request
    (``body``) as a POST to the socket's path, with the handshake's headers (its credentials,
    its session) but no ``Idempotency-Key``: a socket's calls are many operations."""
    headers = tuple((k, v) for k, v in request_headers(flow) if k.lower() != "idempotency-key")
    return _view(flow, "POST", headers, body)


def _view(flow: http.HTTPFlow, method: str, headers: tuple[tuple[str, str], ...],
          body: bytes | None, body_codings: tuple[str, ...] = (),
          target: http.Request | None = None) -> identity.RequestView | identity.Passthrough:
    """``target``: the request as it will go upstream, when an addon that runs after
    turnguard sends it elsewhere (its URL and upstream are then the identity's)."""
    req = target or flow.request
    if not req.host:
        return identity.Passthrough("upstream unknown (no host)")
    proxy_auth = flow.metadata.get("proxyauth")  # mitmproxy's proxyauth took the header
    if proxy_auth is not None:
        if not (isinstance(proxy_auth, (tuple, list))
                and all(isinstance(part, str) for part in proxy_auth)):
            return identity.Passthrough("principal undetermined (proxyauth metadata)")
        proxy_auth = json.dumps(list(proxy_auth))
    return identity.RequestView(
        method=method,
        path=req.path,
        headers=headers,
        body=body,
        body_codings=body_codings,
        upstream=identity.Upstream(
            scheme=req.scheme, host=req.host, port=req.port, host_header=req.host_header,
            via=_via(flow), authority=req.authority or None, sni=server_name(flow, req),
        ),
        proxy_auth=proxy_auth,
    )


def server_name(flow: http.HTTPFlow, req: http.Request | None = None) -> str:
    """The TLS server name (SNI) mitmproxy gives the upstream connection of ``flow``'s request
    (``req``: the request as it will be sent, when an addon sends it elsewhere) (mitmproxy's
    ``HttpLayer.get_connection``): when the request goes where the flow's connection goes (a
    ``CONNECT`` tunnel's target, a reverse or transparent mode's upstream), that connection's
    name (the client's SNI, a reverse mode's host), else the client's SNI, else the host
    connected to; a request sent elsewhere, the host connected to. ``ReplayHandler`` names the
    ``Host`` header's host instead: a request naming a virtual host (``Host`` other than the
    tunnel's target) went out with another SNI, which the upstream's certificate need not
    cover (the call failed where the flow's own would work), or which selects another site."""
    req, server = req or flow.request, flow.server_conn
    if server.address is not None and tuple(server.address) == (req.host, req.port):
        return server.sni or flow.client_conn.sni or req.host
    return req.host


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
        [(k.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
         for k, v in pairs]
    )


def make_response(status: int, body: bytes, headers: http.Headers) -> http.Response:
    """What ``http.Response.make(status, body, headers)`` makes (``body`` encoded as the
    headers' content coding says, the ``content-length`` header set)."""
    resp = _response(status, headers, None)
    resp.content = body
    return resp


def _response(status: int, headers: http.Headers, raw_content: bytes | None) -> http.Response:
    """A response whose body is ``raw_content`` as it goes on the wire, made without checking
    its fields' types again (mitmproxy's ``MessageData.__post_init__``, about 20 us a
    response; turnguard's are right by construction): its state (``ResponseData``) given
    directly."""
    data = object.__new__(http.ResponseData)
    now = time.time()
    data.__dict__.update(
        http_version=b"HTTP/1.1", headers=headers, content=raw_content, trailers=None,
        timestamp_start=now, timestamp_end=now, status_code=status,
        reason=status_codes.RESPONSES.get(status, "").encode())
    resp = object.__new__(http.Response)
    resp.data = data
    return resp


def answer(flow: http.HTTPFlow, a: answers.Answer) -> None:
    """Answer the flow with turnguard's own answer (nothing goes upstream)."""
    flow.response = make_response(a.status, a.body, _headers(a.headers))
    flow.metadata["turnguard"] = {"role": "answered", "status": a.status}


def replay(flow: http.HTTPFlow, op_id: str, status: int, headers, body: bytes, *,
           how: str = "replayed") -> None:
    """Answer the flow from a recording (or, ``how`` "attached", from the whole response of
    the attempt it attached to): the bytes as given (never re-encoded by mitmproxy)."""
    resp = _response(status, _headers(headers), body)
    if status >= 200 and status not in (204, 304):  # (those have no body to measure)
        resp.headers["content-length"] = str(len(body))
    resp.headers["x-turnguard"] = how
    flow.response = resp
    flow.metadata["turnguard"] = {"role": "replay" if how == "replayed" else how, "op": op_id}


def proxyserver():
    try:
        return ctx.master.addons.get("proxyserver")
    except AttributeError:  # no master (unit tests)
        return None


# Loop steps a request woken from a cooldown lets run before it is judged (``settled_gone``):
# one for the loop to read the sockets, one for mitmproxy's connection task to pass what it
# read to its layers (an HTTP/2 stream reset), one spare.
SETTLE_STEPS = 3


def killed(flow: http.HTTPFlow) -> bool:
    """Whether the flow was killed: its error is mitmproxy's kill (``flow.kill()``, i.e.
    ``Error.KILLED_MESSAGE``: the only error mitmproxy acts on after a hook), or it is over
    with an error. An error another addon only sets on a live flow (a note, with no kill)
    is no kill: mitmproxy lets that flow go on, and so does turnguard."""
    return flow.error is not None and (flow.error.msg == Error.KILLED_MESSAGE or not flow.live)


class ClientWatch:
    """Tells whether the client of a held flow still wants an answer."""

    def __init__(self) -> None:
        # client connection id -> its HttpLayer (found once), to tell a reset HTTP/2 stream
        self._http_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    async def settled_gone(self, flow: http.HTTPFlow) -> str | None:
        """``gone``, once the event loop has read what the clients sent meanwhile. After a
        pause (SIGSTOP, a stall) the loop's first steps run the timers that ended the waits
        before it reads any socket, and an HTTP/2 client's reset is known only once
        mitmproxy's connection task has handled it: judged at once, a client that left
        while the process stood still could win the one recovery dispatch."""
        for _ in range(SETTLE_STEPS):
            if (reason := self.gone(flow)) is not None:
                return reason
            await asyncio.sleep(0)
        return self.gone(flow)

    def gone(self, flow: http.HTTPFlow) -> str | None:
        """Why the client no longer wants an answer (None: it still does); ``killed`` says
        what a kill is (not an error another addon only notes on a live flow)."""
        if killed(flow):
            return "killed"
        if not flow.client_conn.connected:
            return "client disconnected"
        if client_transport_ended(proxyserver(), flow.client_conn):
            return "client disconnected"  # read by asyncio; mitmproxy not told yet
        if flow.websocket is not None and flow.websocket.timestamp_end is not None:
            return "websocket closed"
        if flow.request.http_version == "HTTP/2.0":
            layer = self._http_layers.get(flow.client_conn.id)
            if layer is None:
                layer = find_http_layer(proxyserver(), flow.client_conn.id)
                if layer is not None:
                    self._http_layers[flow.client_conn.id] = layer
            if layer is not None and client_stream_closed(layer, flow, flow.client_conn):
                return "stream reset by client"
        return None


class Explainer:
    """Explains flows in mitmweb or the console: a mark and a comment, then a refresh."""

    def __init__(self) -> None:
        self._has_view: bool | None = None  # is there a UI whose flow list needs refreshing?

    def show(self, flow: http.HTTPFlow, mark: str | None, comment: str) -> None:
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
