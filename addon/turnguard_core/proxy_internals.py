"""The one place turnguard relies on mitmproxy internals: cutting a flow's upstream connection,
telling whether an HTTP/2 client still wants a stream that turnguard holds, and injecting a
WebSocket message without the command's per-call argument check.

Cutting.

``flow.kill()`` cannot stop a flow that is already waiting for upstream headers or streaming
(mitmproxy issue 4711): the proxy checks the kill only between hooks. What works at once is
cancelling the asyncio task that serves the flow's server connection. mitmproxy then treats the
upstream as closed: before response headers the client gets a 502, mid-stream its body is cut;
either way the ``error`` hook fires. The path to that task, in mitmproxy 12.3:

    proxyserver addon .connections[client connection id]   -> ConnectionHandler
        .transports[server connection]                       -> ConnectionIO
            .handler                                         -> asyncio.Task

Nothing here imports mitmproxy but ``cut_http2_stream``; the caller passes the proxyserver
addon. If an upgrade moves any of these, ``cut_upstream`` returns a reason instead of raising,
and ``tests/test_proxy_internals.py`` fails loudly.

HTTP/2 upstream streams. An HTTP/2 upstream connection carries every stream of the client's
connection, so cancelling its task cuts other turns too. ``cut_http2_stream`` ends the one
flow's stream instead, by the path mitmproxy's own HTTP layer takes when a client resets a
stream: an ``HttpLayer`` routes a ``CommandCompleted`` to the stream that issued its command
(``HttpLayer.command_sources``). A ``RequestWakeup`` of turnguard's is entered there with a
stand-in for the flow's stream as its source (and, in each ``HttpLayer`` above it, the
``CONNECT`` stream whose tunnel holds it), and its ``Wakeup`` fed to the connection handler
(``ConnectionHandler.server_event``, as ``inject_event`` does). The stand-in then sends the
server connection a ``RequestProtocolError`` (``CANCEL``: its HTTP/2 layer resets the stream)
and gives the stream a ``ResponseProtocolError``, on which it fires the ``error`` hook and
answers its client (a 502 before headers, a reset after). The stand-in stays the source of
the stream's later blocking commands and passes their completions on.

Not sent upstream yet (``stream_not_sent``): a stream whose ``request`` hook has not ended is
paused on it (``Layer._paused``, whose ``command`` is the ``HttpRequestHook``); a stream the
HTTP/2 upstream has no room for yet (as many open as its ``MAX_CONCURRENT_STREAMS``) waits in
its ``Http2Client``'s ``stream_queue`` (by the client's stream id), below
``HttpLayer.connections[server connection]`` (``ServerTLSLayer``, then ``HttpClient``).

Detached dispatches (``turnguard_detach_ms``) run on mitmproxy's own client-replay machinery,
``mitmproxy.addons.clientplayback.ReplayHandler(flow, options)``: a connection handler whose
client is a stand-in, so the upstream call outlives the real client's connection;
``cut_handler_upstream`` cuts it as above. Its upstream connection is made for the server it
puts in its layer's context (``handler.layer.context.server``), with the ``Host`` header's host
as its TLS server name; ``set_replay_server_name`` gives it the name the flow's own connection
has instead.

Injecting WebSocket messages. mitmproxy's ``inject.websocket`` command checks its arguments
against the method's signature on every call (``inspect.signature``: about 0.1 ms a message
under load, most of what injecting costs). turnguard calls the command's own method body
(``command_body``: the function its ``@command`` decorator wraps, reached through
``functools.wraps``' ``__wrapped__``) with arguments turnguard types itself, and the command
when that is not there.

A client that left while the event loop was held (a paused process, a long hook): its
connection's ``StreamReader`` has the end (or the reset) as soon as asyncio read it, some loop
steps before mitmproxy's connection task marks ``client_conn`` closed; ``client_transport_ended``
reads it there:

    proxyserver addon .connections[client connection id] -> ConnectionHandler
        .transports[client connection]                      -> ConnectionIO
            .reader                                         -> asyncio.StreamReader

Two mends of mitmproxy's WebSocket layer (``mend_websocket_layer``, given the module
``mitmproxy.proxy.layers.websocket``), for the messages turnguard sends itself or changes:

- ``Fragmentizer`` cuts a message it sends into ~4 kB frames (a changed or injected one) or
  into the original's frame lengths, and decodes each text frame alone, with
  ``errors="replace"``: a character cut in two becomes two U+FFFD. Text is now cut on a
  character's first byte (at most 3 bytes earlier); binary messages and cuts that fall on a
  character's start are as before.
- ``WebsocketLayer.relay_messages`` adds an injected message to the sender's message buffer
  (``frame_buf``): when the client has sent part of its next message, the injected one is sent
  with that part before it, and the client's message loses it. An injected message is now
  relayed with the buffer set aside and put back after.

A flow killed while intercepted (mitmweb's Kill, the ``flow.kill`` command): ``Flow.kill()``
clears ``intercepted`` but never sets the event the proxy awaits after the flow's hooks
(``Flow.wait_for_resume``; mitmproxy issue 8045), so the flow waits for ever: its client hangs,
and ``flow.resume`` no longer reaches it (it is not intercepted any more).
``release_killed_intercepted`` sets that event, ``Flow._resume_event``: the proxy then goes on as
for any flow killed in a hook (the ``error`` hook fires, the client's connection is closed).

HTTP/2 streams. While a request hook holds a flow, mitmproxy queues that stream's RST_STREAM
until the hook returns, and the client connection stays open, so neither ``flow.error`` nor
``client_conn.connected`` says that the client gave up. The HTTP/2 connection layer, though,
forgets a reset stream at once. A stream reset in the same read as its request's end is
forgotten before the request hook runs and never reported at all (h2 has it closed at its
``StreamEnded``, so ``Http2Connection`` drops it there and ignores the ``StreamReset``): no
``error`` hook ever fires for that flow; only its absence from ``Http2Server.streams`` tells.
``find_http_layer`` finds the connection's ``HttpLayer`` below the connection handler's root
layer (``NextLayer.layer``, a layer's ``child_layer``, or the layer behind a bound
``_handle_event``); from there:

    HttpLayer.streams[stream id]             -> HttpStream (its .flow is our flow)
    HttpLayer.connections[client connection] -> Http2Server, whose .streams holds the open ids
"""

from __future__ import annotations


def cut_upstream(proxyserver, client_conn_id: str, server_conn, reason: str) -> str | None:
    """Cancel the server connection's handler task. Returns None when cut, else why not."""
    if proxyserver is None:
        return "no proxyserver addon"
    connections = getattr(proxyserver, "connections", None)
    if not isinstance(connections, dict):
        return "proxyserver has no connections map (mitmproxy internals changed?)"
    handler = connections.get(client_conn_id)
    if handler is None:
        return "client connection is gone"
    return cut_handler_upstream(handler, server_conn, reason)


def cut_http2_stream(proxyserver, flow, reason: str) -> str | None:
    """End ``flow``'s stream on an HTTP/2 upstream connection alone (its other streams are
    other flows, another turn's among them): the stream is reset upstream (RST_STREAM
    ``CANCEL``) and the flow ends as when the upstream fails it (its ``error`` hook fires; its
    client gets a 502 before response headers, a broken stream after). Returns None when
    done, else why not (the caller may then cut the whole connection)."""
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers import http as http_layers
    from mitmproxy.utils import asyncio_utils

    handler = getattr(proxyserver, "connections", {}).get(flow.client_conn.id)
    if handler is None or not hasattr(handler, "server_event"):
        return "client connection is gone"
    path = _flow_path(proxyserver, flow, handler)
    if path is None:
        return "no HTTP stream of this flow (mitmproxy internals changed?)"
    if not all(isinstance(getattr(layer, "command_sources", None), dict) for layer, _ in path):
        return "an HTTP layer without command sources (mitmproxy internals changed?)"
    http_layer, stream = path[-1]
    if flow.server_conn not in getattr(http_layer, "connections", {}):
        return "no open server connection for this flow"
    stream_id = stream.stream_id
    wakeup = commands.RequestWakeup(0)

    class _Cut:  # in the HTTP layer's place of the command's source, for the stream
        def handle_event(self, event):
            if getattr(event, "command", None) is wakeup:
                if http_layer.streams.get(stream_id) is not stream:
                    return  # it ended meanwhile
                yield http_layers.SendHttp(http_layers.RequestProtocolError(
                    stream_id, reason, http_layers.ErrorCode.CANCEL), flow.server_conn)
                event = http_layers.ResponseProtocolError(
                    stream_id, reason, http_layers.ErrorCode.GENERIC_SERVER_ERROR)
            # the stream's own blocking commands (its error hook) now name this as their
            # source: their completions go on to the stream
            yield from stream.handle_event(event)

    for layer, leads_on in path[:-1]:  # a CONNECT's stream, with the tunnel's layers below it
        layer.command_sources[wakeup] = leads_on
    http_layer.command_sources[wakeup] = _Cut()
    asyncio_utils.create_task(handler.server_event(events.Wakeup(wakeup)),
                              name="turnguard: cut an HTTP/2 stream", keep_ref=True)
    return None


def stream_not_sent(proxyserver, flow, handler=None) -> bool | None:
    """Whether nothing of ``flow``'s request has gone upstream yet, read on one walk to its
    stream: its stream still waits for its ``request`` hook to end (an addon after turnguard
    keeps it in its own, or a user's intercept does; the layer is paused on
    ``HttpRequestHook``, what comes meanwhile waits in its queue, and the request is sent
    first), or its request waits in its HTTP/2 upstream connection's queue (the upstream
    allows so many concurrent streams, ``MAX_CONCURRENT_STREAMS``, and as many are open, so
    mitmproxy's ``Http2Client`` keeps the stream's events in ``stream_queue``, by the client's
    stream id, and sends none of them until one ends). ``handler``: the connection handler
    that runs the flow when it is no connection of the proxy's (a detached call's
    ``ReplayHandler``). None when that cannot be told (the flow's stream is not found:
    mitmproxy internals changed)."""
    path = _flow_path(proxyserver, flow, handler)
    if path is None:
        return None
    http_layer, stream = path[-1]
    paused = getattr(stream, "_paused", False)
    if type(getattr(paused, "command", None)).__name__ == "HttpRequestHook":
        return True
    # HttpLayer.connections[server connection] -> its stack's top (ServerTLSLayer, then
    # HttpClient, through their child_layer) -> Http2Client
    todo, seen = [getattr(http_layer, "connections", {}).get(flow.server_conn)], set()
    while todo and len(seen) < 16:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        queue = getattr(node, "stream_queue", None)
        if isinstance(queue, dict):
            return stream.stream_id in queue
        todo.extend(_children(node))
    return None if paused is False else False


def _flow_path(proxyserver, flow, handler=None):
    """``_stream_path`` from the root layer of ``flow``'s connection handler (``handler``, or
    the proxy's handler of its client connection)."""
    if handler is None:
        handler = getattr(proxyserver, "connections", {}).get(flow.client_conn.id)
    return _stream_path(getattr(handler, "layer", None), flow, set())


def _stream_path(node, flow, seen: set):
    """From the layer ``node`` down to ``flow``'s stream, the ``(HttpLayer, HttpStream)`` pairs
    that an event routed by its command's source passes, the flow's own last (one before it is
    a ``CONNECT``'s stream, with the tunnel's layers below it); None when not found."""
    if node is None or id(node) in seen or len(seen) > 64:
        return None
    seen.add(id(node))
    streams = getattr(node, "streams", None)
    if type(node).__name__ == "HttpLayer" and isinstance(streams, dict):
        for stream in streams.values():
            if getattr(stream, "flow", None) is flow:
                return [(node, stream)]
        for stream in list(streams.values()):
            below = _stream_path(stream, flow, seen)
            if below is not None:
                return [(node, stream), *below]
        return None
    for child in _children(node):
        found = _stream_path(child, flow, seen)
        if found is not None:
            return found
    return None


def set_replay_server_name(handler, sni: str) -> str | None:
    """Make the ``ReplayHandler`` ``handler`` send ``sni`` as its upstream connection's TLS
    server name (mitmproxy's ``HttpLayer.get_connection`` takes its context's server's name
    for a connection to that server's address). None when set, else why not."""
    server = getattr(getattr(getattr(handler, "layer", None), "context", None), "server", None)
    if server is None or not hasattr(server, "sni"):
        return "replay handler has no layer context server (mitmproxy internals changed?)"
    server.sni = sni
    return None


def cut_handler_upstream(handler, server_conn, reason: str) -> str | None:
    """``cut_upstream`` on a connection handler itself (one turnguard made to run a detached
    dispatch: mitmproxy's ``ReplayHandler``, not in the proxyserver's map)."""
    transports = getattr(handler, "transports", None)
    if transports is None:
        return "connection handler has no transports (mitmproxy internals changed?)"
    io = transports.get(server_conn)
    if io is None:
        return "no open server connection for this flow"
    task = getattr(io, "handler", None)
    if task is None or not hasattr(task, "cancel"):
        return "server connection has no handler task (mitmproxy internals changed?)"
    if task.done():
        return "server connection already closed"
    task.cancel(reason)
    return None


def release_killed_intercepted(flow) -> bool:
    """Let a flow that was killed while intercepted go on to its kill (see the module's
    docstring: mitmproxy leaves it waiting for a resume that never comes). True when it was
    waiting so; the caller checks that the flow was killed."""
    event = getattr(flow, "_resume_event", None)
    if getattr(flow, "intercepted", True) or event is None or not hasattr(event, "is_set") \
            or event.is_set():
        return False
    event.set()
    return True


def command_body(addon, method_name: str):
    """``addon``'s command method ``method_name`` without its ``@command`` argument check,
    bound to ``addon``; None when there is no such wrapped method (the caller then goes
    through the command)."""
    body = getattr(getattr(type(addon), method_name, None), "__wrapped__", None)
    return None if body is None else body.__get__(addon)


def _on_character_start(content: bytes, cut: int) -> int:
    """``cut`` moved back onto the first byte of a UTF-8 character (at most 3 bytes)."""
    floor = max(0, cut - 3)
    while floor < cut < len(content) and content[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def _text_safe_call(self, content: bytes):
    """``Fragmentizer.__call__``, with text cut only where a character starts."""
    if len(content) == sum(self.fragment_lengths):
        cuts, at = [], 0
        for length in self.fragment_lengths[:-1]:
            at += length
            cuts.append(at)
    else:
        cuts = list(range(self.FRAGMENT_SIZE, len(content), self.FRAGMENT_SIZE))
    start = 0
    for cut in cuts:
        if self.is_text:
            cut = _on_character_start(content, cut)
        if start < cut < len(content):
            yield self.msg(content[start:cut], False)
            start = cut
    yield self.msg(content[start:], True)


def _relay_injected_apart(relay_messages, injected_event):
    def relay(self, event):
        if not isinstance(event, injected_event):
            return relay_messages(self, event)
        return _apart(self, event)

    def _apart(self, event):
        sender = self.client_ws if event.message.from_client else self.server_ws
        partial, sender.frame_buf = sender.frame_buf, [b""]
        try:
            yield from relay_messages(self, event)
        finally:  # (anything that came meanwhile continues the sender's own message)
            later, sender.frame_buf = sender.frame_buf, partial
            partial[-1] += later[0]
            partial.extend(later[1:])

    relay._turnguard_mended = True
    return relay


def mend_websocket_layer(module) -> str | None:
    """Install the two mends (see the module's docstring) in ``module``
    (``mitmproxy.proxy.layers.websocket``), once. Returns None, or why not (an upgrade moved
    what they replace)."""
    fragmentizer = getattr(module, "Fragmentizer", None)
    layer = getattr(module, "WebsocketLayer", None)
    injected = getattr(module, "WebSocketMessageInjected", None)
    relay = getattr(layer, "relay_messages", None)
    if fragmentizer is None or relay is None or injected is None \
            or not hasattr(fragmentizer, "FRAGMENT_SIZE") or not hasattr(fragmentizer, "msg"):
        return "mitmproxy's WebSocket layer is not the one these mends were written for"
    if getattr(relay, "_turnguard_mended", False):
        return None
    fragmentizer.__call__ = _text_safe_call
    layer.relay_messages = _relay_injected_apart(relay, injected)
    return None


def client_stream_closed(http_layer, flow, client_conn) -> bool | None:
    """Whether the client has reset or closed ``flow``'s HTTP/2 stream. None when that cannot
    be told (not HTTP/2, unknown layer, internals changed): the caller then relies on
    ``flow.error`` and ``client_conn.connected``."""
    streams = getattr(http_layer, "streams", None)
    connections = getattr(http_layer, "connections", None)
    if not isinstance(streams, dict) or not isinstance(connections, dict):
        return None
    client_layer = connections.get(client_conn)
    open_ids = getattr(client_layer, "streams", None)
    if not isinstance(open_ids, dict) or not hasattr(client_layer, "h2_conn"):
        return None  # not an HTTP/2 client connection
    for stream_id, stream in streams.items():
        if getattr(stream, "flow", None) is flow:
            return stream_id not in open_ids
    return None


# mitmproxy's error for a flow whose HTTP/2 stream was reset, whichever side reset it (its
# HTTP/2 layers share the wording): "stream reset by client (CANCEL)"
H2_RESET_MESSAGE = "stream reset by client"


def stream_reset_by_upstream(proxyserver, flow) -> bool | None:
    """In ``flow``'s ``error`` hook, whether the HTTP/2 stream reset it failed of (its error
    ``H2_RESET_MESSAGE``, which mitmproxy words alike for either side) came from the
    upstream. mitmproxy fires the hook before it answers the client: a stream the upstream
    reset is still open on the client's side then (an HTTP/1 client has no stream to
    reset), one the client reset is closed in its HTTP/2 connection's state (the hook may run
    before mitmproxy's layer forgets the stream: ``client_stream_closed`` cannot tell it
    yet). None when that cannot be told (the flow's stream is not found: mitmproxy internals
    changed, or no connection of the proxy's)."""
    path = _flow_path(proxyserver, flow)
    if path is None:
        return None
    http_layer = path[-1][0]
    client_layer = getattr(http_layer, "connections", {}).get(flow.client_conn)
    if client_layer is None:
        return None
    if not hasattr(client_layer, "h2_conn"):
        return type(client_layer).__name__ == "Http1Server" or None
    is_closed = getattr(client_layer, "is_closed", None)
    if not callable(is_closed):
        return None
    return not is_closed(path[-1][1].stream_id)


_LINKS = ("layer", "child_layer")
_BOUND = ("_handle_event", "handle_event", "_handle")


def client_transport_ended(proxyserver, client_conn) -> bool | None:
    """Whether asyncio already read the end (or a reset) of the client connection; None when
    that cannot be told (mitmproxy internals changed)."""
    handler = getattr(proxyserver, "connections", {}).get(client_conn.id)
    transports = getattr(handler, "transports", None)
    io = transports.get(client_conn) if isinstance(transports, dict) else None
    reader = getattr(io, "reader", None)
    if reader is None or not hasattr(reader, "at_eof"):
        return None
    return reader.at_eof() or reader.exception() is not None


def find_http_layer(proxyserver, client_conn_id: str):
    """The ``HttpLayer`` serving a client connection, or None."""
    handler = getattr(proxyserver, "connections", {}).get(client_conn_id)
    todo, seen = [getattr(handler, "layer", None)], set()
    while todo and len(seen) < 32:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "HttpLayer":
            return node
        todo.extend(_children(node))
    return None


def _children(node) -> list:
    """The layers right below ``node``: ``NextLayer.layer``, a layer's ``child_layer``, the
    layer behind a bound handler (some None)."""
    return [*(getattr(node, name, None) for name in _LINKS),
            *(getattr(getattr(node, name, None), "__self__", None) for name in _BOUND)]
