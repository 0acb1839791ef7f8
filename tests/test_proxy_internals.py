"""The one use of mitmproxy internals: if an upgrade moves them, this fails loudly."""

import asyncio
import inspect

from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.proxy import server

from turnguard_core.proxy_internals import client_stream_closed, cut_upstream


def test_the_internals_cut_upstream_walks_still_exist():
    assert isinstance(Proxyserver().connections, dict)
    assert "transports" in inspect.getsource(server.ConnectionHandler.__init__)
    assert "handler" in server.ConnectionIO.__annotations__


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
