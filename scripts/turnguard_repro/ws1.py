"""One Responses call over a new WebSocket, for the client models (Codex's default transport).

``create`` opens a socket to ``url`` + ``path``, sends one ``response.create`` frame and reads
the response's events into an ``http1.Exchange``, so that a WebSocket attempt is recorded and
judged like an HTTP one: ``status`` 200 once the upgrade succeeded (the upgrade's own status
when it was refused, an ``error`` event's ``status`` when the answer is one), ``events`` the
event frames, ``error`` why it ended early (the socket closed, an idle timeout). Never raises
for network trouble. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from turnguard_sse import SseEvent
from turnguard_ws import Closed, UpgradeRejected, WsClient

from .http1 import HARD_CAP_S, Exchange

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


async def create(ex: Exchange, url: str, path: str, headers: dict[str, str], frame: dict[str, Any],
                 *, idle_timeout: float | None = None) -> Exchange:
    ex.t_start = time.time()
    try:
        client = await WsClient.open(url, path, headers)
    except UpgradeRejected as e:
        ex.t_headers = ex.t_end = time.time()
        ex.status = e.status
        return ex
    except (OSError, TimeoutError) as e:
        ex.error, ex.t_end = f"connect failed: {e.__class__.__name__}", time.time()
        return ex
    ex.t_headers, ex.status = time.time(), 200
    ex.headers = {"content-type": "text/event-stream"}
    try:
        await client.send(frame)
        await _read_events(ex, client, idle_timeout)
    except asyncio.CancelledError:
        ex.error = ex.error or "cancelled"
        raise
    finally:
        ex.t_end = time.time()
        client.abort()
    return ex


async def _read_events(ex: Exchange, client: WsClient, idle_timeout: float | None) -> None:
    deadline = time.monotonic() + HARD_CAP_S
    while True:
        try:
            message = await client.recv(min(idle_timeout or HARD_CAP_S,
                                            max(0.001, deadline - time.monotonic())))
        except TimeoutError:
            ex.error = "idle timeout"
            return
        if isinstance(message, Closed):
            ex.error = f"websocket closed ({message.code})"
            return
        try:
            event = json.loads(message)
        except (ValueError, TypeError):
            continue
        if not isinstance(event, dict):
            continue
        kind = str(event.get("type"))
        ex.events.append(SseEvent(kind, event))
        if kind == "error":
            status = event.get("status")
            if isinstance(status, int) and not isinstance(status, bool):
                ex.status = status
            ex.body = json.dumps({"error": event.get("error")}).encode()
        if kind in TERMINAL:
            return
