"""The one use of mitmproxy internals: if an upgrade moves them, this fails loudly."""

import asyncio
import inspect

from hypothesis import given
from hypothesis import strategies as st

from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.proxy import server

from turnguard_core.proxy_internals import (
    client_stream_closed,
    client_transport_ended,
    cut_upstream,
    release_killed_intercepted,
)


def test_the_internals_cut_upstream_walks_still_exist():
    assert isinstance(Proxyserver().connections, dict)
    assert "transports" in inspect.getsource(server.ConnectionHandler.__init__)
    assert "handler" in server.ConnectionIO.__annotations__


def test_the_internals_the_client_transport_check_walks_still_exist():
    assert "reader" in server.ConnectionIO.__annotations__
    assert "reader.read(" in inspect.getsource(server.ConnectionHandler.handle_connection)


async def test_client_transport_ended_reads_the_connections_stream_reader():
    class Conn:
        id = "client-1"

    def proxyserver_with(reader):
        class IO:
            pass

        io = IO()
        io.reader = reader
        handler = type("Handler", (), {"transports": {conn: io}})()
        return type("Proxyserver", (), {"connections": {conn.id: handler}})()

    conn = Conn()
    open_reader = asyncio.StreamReader()
    assert client_transport_ended(proxyserver_with(open_reader), conn) is False
    ended = asyncio.StreamReader()
    ended.feed_eof()
    assert client_transport_ended(proxyserver_with(ended), conn) is True
    reset = asyncio.StreamReader()
    reset.set_exception(ConnectionResetError())
    assert client_transport_ended(proxyserver_with(reset), conn) is True
    assert client_transport_ended(type("P", (), {"connections": {}})(), conn) is None


async def test_a_flow_killed_while_intercepted_is_released_to_its_kill():
    """mitmproxy issue 8045: ``kill()`` of an intercepted flow leaves ``wait_for_resume``
    waiting for ever; ``release_killed_intercepted`` ends that wait (if mitmproxy fixes it,
    the wait ends by itself and the release finds nothing to do)."""
    from mitmproxy.test import tflow

    f = tflow.tflow()
    f.intercept()
    waiting = asyncio.ensure_future(f.wait_for_resume())
    await asyncio.sleep(0)
    f.kill()
    await asyncio.sleep(0)
    released = release_killed_intercepted(f)
    await asyncio.wait_for(waiting, 5)
    assert released or f._resume_event is None or f._resume_event.is_set()
    assert not release_killed_intercepted(f)  # once only
    g = tflow.tflow()  # never intercepted, or intercepted now: left alone
    assert not release_killed_intercepted(g)
    g.intercept()
    assert not release_killed_intercepted(g)


def test_the_internals_the_http2_stream_check_walks_still_exist():
    from mitmproxy.proxy.layers.http import HttpLayer
    from mitmproxy.proxy.layers.http._http2 import Http2Connection

    init = inspect.getsource(HttpLayer.__init__)
    assert "self.streams" in init and "self.connections" in init
    init = inspect.getsource(Http2Connection.__init__)
    assert "self.h2_conn" in init and "self.streams" in init


def test_the_internals_the_http2_stream_cut_walks_still_exist():
    """``cut_http2_stream``: a completion goes to its command's source in the HTTP layer; the
    HTTP/2 layer resets a stream on a ``RequestProtocolError``; a stream takes a
    ``ResponseProtocolError`` as its upstream's failure; the handler takes an event from
    outside (the end-to-end proof: ``test_e2e_tls.py::test_http2_upstream_a_silent_turn_cut_*``)."""
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers import http as http_layers
    from mitmproxy.proxy.layers.http._http2 import Http2Connection

    assert "self.command_sources.pop(event.command)" in inspect.getsource(
        http_layers.HttpLayer._handle_event)
    assert "reset_stream" in inspect.getsource(Http2Connection._handle_event)
    assert "handle_protocol_error" in inspect.getsource(http_layers.HttpStream._handle_event)
    assert issubclass(events.Wakeup, events.CommandCompleted)
    assert commands.RequestWakeup(0).delay == 0
    assert http_layers.ErrorCode.CANCEL and http_layers.SendHttp
    assert inspect.iscoroutinefunction(server.ConnectionHandler.server_event)


def test_the_internals_the_unsent_and_reset_checks_walks_still_exist():
    """``stream_not_sent`` (a layer paused on its ``HttpRequestHook``, or its stream in
    ``Http2Client.stream_queue``) and ``stream_reset_by_upstream``
    (mitmproxy's one wording for either side's reset, the HTTP/2 state's ``is_closed``): the
    end-to-end proofs are in ``test_e2e_tls.py``; this fails loudly if an upgrade moves them."""
    from mitmproxy.proxy import layer
    from mitmproxy.proxy.layers.http import HttpRequestHook, _http2
    from turnguard_core.proxy_internals import H2_RESET_MESSAGE

    assert "self._paused" in inspect.getsource(layer.Layer.handle_event)
    assert "self.stream_queue" in inspect.getsource(_http2.Http2Client._handle_event)
    assert callable(_http2.Http2Connection.is_closed)
    assert HttpRequestHook.__name__ == "HttpRequestHook"
    assert H2_RESET_MESSAGE in inspect.getsource(_http2)


def test_client_stream_closed_reads_the_http2_layer():
    class Stream:
        def __init__(self, flow):
            self.flow = flow

    class H2:  # stands for Http2Server: its open streams, and an h2 connection
        h2_conn = object()
        streams = {1: "open"}

    flow, other = object(), object()

    class Layer:  # stands for HttpLayer
        streams = {1: Stream(other), 3: Stream(flow)}
        connections = {"client": H2()}

    assert client_stream_closed(Layer(), flow, "client") is True
    assert client_stream_closed(Layer(), other, "client") is False
    assert client_stream_closed(Layer(), object(), "client") is None
    assert client_stream_closed(object(), flow, "client") is None


async def test_cut_cancels_the_server_connection_task_and_reports_why_not_otherwise():
    task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
    io = server.ConnectionIO(handler=task)

    class Handler:
        transports = {"server-conn": io}

    class PS:
        connections = {"client-1": Handler()}

    assert cut_upstream(PS(), "client-1", "server-conn", "why") is None
    await asyncio.sleep(0)
    assert task.cancelled()
    assert cut_upstream(PS(), "client-1", "server-conn", "why") == "server connection already closed"
    assert cut_upstream(PS(), "gone", "server-conn", "why") == "client connection is gone"
    assert cut_upstream(PS(), "client-1", "other", "why") == "no open server connection for this flow"
    assert cut_upstream(None, "c", "s", "why") == "no proxyserver addon"
    assert "internals changed" in cut_upstream(object(), "c", "s", "why")


def test_the_replay_handler_detached_dispatches_run_on_still_exists():
    """turnguard_detach_ms runs a guarded call on mitmproxy's client-replay handler, made as
    ``ReplayHandler(flow, options)``, started by ``replay()``, and cut through ``transports``
    (a ConnectionHandler's): if an upgrade moves any of it, this fails."""
    import inspect

    from mitmproxy.addons.clientplayback import ReplayHandler
    from mitmproxy.proxy.server import ConnectionHandler

    assert list(inspect.signature(ReplayHandler.__init__).parameters)[1:] == ["flow", "options"]
    assert inspect.iscoroutinefunction(ReplayHandler.replay)
    assert issubclass(ReplayHandler, ConnectionHandler)
    assert "transports" in inspect.getsource(ConnectionHandler.__init__)


def test_a_replay_handlers_server_name_is_its_layer_contexts_servers():
    """A detached call sends the server name of the flow's own connection: set on the server
    ``ReplayHandler`` puts in its layer's context, the one its connection is made for."""
    from mitmproxy.addons.clientplayback import ReplayHandler
    from mitmproxy.options import Options
    from mitmproxy.test import tflow

    from turnguard_core.proxy_internals import set_replay_server_name

    flow = tflow.tflow()
    flow.request.scheme, flow.request.host, flow.request.port = "https", "localhost", 8443
    flow.request.headers["host"] = "virtual.example"
    handler = ReplayHandler(flow, Options())
    assert handler.layer.context.server.sni == "virtual.example"  # the Host header's
    assert handler.layer.context.server.address == ("localhost", 8443)
    assert set_replay_server_name(handler, "localhost") is None
    assert handler.layer.context.server.sni == "localhost"
    assert "internals changed" in set_replay_server_name(object(), "x")


def test_a_response_made_without_its_type_checks_is_what_response_make_makes():
    """flows.make_response relies on a response's state being its ``data`` (a ``ResponseData``
    whose attributes are its fields) and on Response.make being that state's constructor plus
    ``content``: if an upgrade changes either, this fails."""
    from mitmproxy import http

    from turnguard_shell import flows

    headers = [(), (("content-type", "text/event-stream"),), (("content-encoding", "gzip"),),
               (("content-encoding", "bogus"), ("x", "y")), (("transfer-encoding", "chunked"),),
               (("content-length", "5"), ("a", "b"), ("content-length", "7"))]
    for status in (200, 409, 422, 599):
        for pairs in headers:
            for body in (b"", b"12345"):
                made = http.Response.make(status, body, flows._headers(pairs))
                ours = flows.make_response(status, body, flows._headers(pairs))
                assert vars(ours).keys() == vars(made).keys() == {"data"}
                assert list(vars(ours.data)) == list(vars(made.data))
                state, expected = ours.get_state(), made.get_state()
                for s in (state, expected):
                    assert s.pop("timestamp_start") <= s.pop("timestamp_end")
                assert state == expected


def test_turnguard_records_skip_only_the_deprecated_add_log_bridge():
    """turnguard's log records stay out of mitmproxy's bridge to its deprecated ``add_log``
    hook (a loop wake-up and a hook call on every addon per record), and only out of it:
    other handlers (the terminal, mitmweb's event log) and other loggers' records pass; the
    undo (the addon's ``done``) puts it back as it was."""
    import logging

    from mitmproxy import log as mitmproxy_log
    from mitmproxy.test import taddons

    from turnguard_shell import config

    def record(name: str) -> logging.LogRecord:
        return logging.LogRecord(name, logging.INFO, __file__, 1, "a line", None, None)

    with taddons.context():
        handlers = logging.getLogger().handlers
        legacy = [h for h in handlers if isinstance(h, mitmproxy_log.LegacyLogEvents)]
        others = [h for h in handlers if not isinstance(h, mitmproxy_log.LegacyLogEvents)]
        assert legacy, "mitmproxy no longer installs its add_log bridge"
        undo = config.keep_out_of_legacy_log_events()
        try:
            assert not any(h.filter(record("turnguard")) for h in legacy)
            assert all(h.filter(record("mitmproxy.proxy.server")) for h in legacy)
            assert all(h.filter(record("turnguard")) for h in others)
        finally:
            undo()
        assert all(h.filter(record("turnguard")) for h in legacy)


def test_the_inject_websocket_command_body_is_reached_without_its_argument_check(caplog):
    from turnguard_core.proxy_internals import command_body

    proxyserver = Proxyserver()
    send = command_body(proxyserver, "inject_websocket")
    assert send is not None and send.__self__ is proxyserver
    assert Proxyserver.inject_websocket.command_name == "inject.websocket"
    assert send.__func__ is Proxyserver.inject_websocket.__wrapped__  # the command's own body
    # the same body: a flow that is not a WebSocket is refused with the command's warning
    from mitmproxy.test import tflow

    with caplog.at_level("WARNING"):
        send(tflow.tflow(), True, b"{}", True)
    assert "Cannot inject WebSocket messages into non-WebSocket flows" in caplog.text
    assert command_body(object(), "inject_websocket") is None  # then the shell uses the command


# -- the WebSocket layer's mends ---------------------------------------------------------------
@given(st.text(alphabet=st.sampled_from("a€é😀\u0800")), st.booleans(), st.sampled_from([3, 4000]))
def test_text_is_cut_into_frames_only_where_a_character_starts(text, as_received, fragment_size):
    """A message cut as it was received (its frames' lengths) or, changed, into frames of
    ``FRAGMENT_SIZE``: each text frame decodes alone, and binary is cut as before."""
    from mitmproxy.proxy.layers import websocket as layer

    from turnguard_core import proxy_internals

    assert proxy_internals.mend_websocket_layer(layer) is None
    content = text.encode()
    original = [content[:len(content) // 2], content[len(content) // 2:]] if as_received else []
    cut = layer.Fragmentizer(original, True)
    cut.FRAGMENT_SIZE = fragment_size
    frames = list(cut(content))
    assert "".join(f.data for f in frames) == text  # no U+FFFD: each frame decodes alone
    assert [f.message_finished for f in frames] == [False] * (len(frames) - 1) + [True]
    binary = layer.Fragmentizer([], False)
    binary.FRAGMENT_SIZE = fragment_size
    assert b"".join(f.data for f in binary(content)) == content
