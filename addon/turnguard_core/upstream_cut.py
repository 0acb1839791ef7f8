"""Cutting a flow's upstream connection: the one place turnguard relies on mitmproxy internals.

``flow.kill()`` cannot stop a flow that is already waiting for upstream headers or streaming
(mitmproxy issue 4711): the proxy checks the kill only between hooks. What works at once is
cancelling the asyncio task that serves the flow's server connection. mitmproxy then treats the
upstream as closed: before response headers the client gets a 502, mid-stream its body is cut;
either way the ``error`` hook fires. The path to that task, in mitmproxy 12.3:

    proxyserver addon .connections[client connection id]   -> ConnectionHandler
        .transports[server connection]                       -> ConnectionIO
            .handler                                         -> asyncio.Task

Nothing here imports mitmproxy; the caller passes the proxyserver addon. If an upgrade moves any
of these, ``cut_upstream`` returns a reason instead of raising, and
``tests/test_upstream_cut.py`` fails loudly.
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
