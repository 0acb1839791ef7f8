"""The mock upstream's routes and its dispatch log (see the package docstring for both)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from typing import Any

from .behaviours import Dispatch
from .events import INVALID_BODY_ERROR
from .scenario import DEFAULT_SCENARIO, Dispatcher, validate_behaviour
from .server import ClientGone, Connection, Request, json_error

REPRO_ATTEMPT_HEADER = "x-turnguard-repro-attempt"
MODEL_ROUTES = ("/responses", "/chat/completions")


class MockUpstream:
    """The mock's state: the scenario and its counters (``dispatcher``), every record (kept in
    memory and appended to the log file, mode 0600, flushed per line). ``route`` answers one
    request on a ``server.Server``."""

    def __init__(self, scenario: dict[str, Any] = DEFAULT_SCENARIO, log_path: str | None = None):
        self.dispatcher = Dispatcher(scenario)
        self.records: list[dict[str, Any]] = []
        self.log_file = None
        if log_path:
            fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.fchmod(fd, 0o600)
            self.log_file = os.fdopen(fd, "a", encoding="utf-8")

    def record(self, rec: dict[str, Any]) -> None:
        """Keep a record in memory and append it to the log (flushed)."""
        self.records.append(rec)
        if self.log_file is not None:
            self.log_file.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self.log_file.flush()

    def close(self) -> None:
        """Close the log file."""
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None

    async def route(self, conn: Connection, req: Request) -> bool:
        """Answer one request; return False if the connection must not be reused."""
        close = not req.keep_alive
        if req.method == "POST" and req.path.endswith(MODEL_ROUTES):
            return await self.dispatch(conn, req)
        if req.method == "GET" and req.path == "/_mock/health":
            await conn.send_whole(200, "text/plain", b"ok", close=close)
        elif req.method == "GET" and req.path == "/_mock/dispatches":
            await conn.send_json(200, [r for r in self.records if r["event"] == "dispatch"], close=close)
        elif req.method == "GET" and req.path == "/_mock/records":
            await conn.send_json(200, self.records, close=close)
        elif req.method == "POST" and req.path == "/_mock/scenario":
            try:
                self.dispatcher.replace(json.loads(req.body))
            except ValueError as e:  # includes JSONDecodeError
                await conn.send_json(400, json_error(str(e), "bad_scenario"), close=close)
                return not close
            self.record({"event": "scenario", "ts": time.time()})
            await conn.send_json(200, {"ok": True}, close=close)
        else:
            await conn.send_json(404, json_error(f"no route for {req.method} {req.path}", "not_found"),
                                 close=close)
        return not close

    async def dispatch(self, conn: Connection, req: Request) -> bool:
        """Number, log and answer a model request; return False if the connection is done.
        A body that is not a JSON object is answered 400, as the real API does, and is not a
        dispatch (logged as ``invalid_body``)."""
        try:
            parsed = json.loads(req.body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            self.record({"event": "invalid_body", "ts": time.time(), "path": req.path,
                         "bytes": len(req.body)})
            await conn.send_json(400, INVALID_BODY_ERROR, close=not req.keep_alive)
            return req.keep_alive
        override = req.header("x-mock-behaviour")
        if override is not None:
            try:
                behaviour = validate_behaviour(json.loads(override), "x-mock-behaviour")
            except ValueError as e:
                await conn.send_json(400, json_error(str(e), "bad_mock_behaviour"), close=True)
                return False
        session = req.header("session-id") or req.header("session_id")
        body_sha = hashlib.sha256(req.body).hexdigest()
        sel = self.dispatcher.next(session, body_sha)
        if override is None:
            selected_by, behaviour = sel.selected_by, sel.behaviour
        else:
            selected_by = "header"
        n = sel.n
        self.record(
            {
                "event": "dispatch",
                "n": n,
                "ts": time.time(),
                "method": req.method,
                "path": req.path,
                "query": req.query,
                "conn": conn.cid,
                "session": session,
                "turn_state": req.header("x-codex-turn-state"),
                "body_sha256": body_sha,
                "behaviour": behaviour["kind"],
                "authorization_present": req.header("authorization") is not None,
                "selected_by": selected_by,
                "op_n": sel.op_n,
                "session_n": sel.session_n,
                "spec": behaviour,
                "client_attempt": req.header(REPRO_ATTEMPT_HEADER),
            }
        )
        d = Dispatch(conn, req, n, behaviour)
        try:
            await d.run()
        except ClientGone:
            d.outcome = "client_gone"
            self.record({"event": "client_gone", "n": n, "ts": time.time()})
        except asyncio.CancelledError:
            d.outcome = "server_shutdown"
            raise
        finally:
            self.record({"event": "dispatch_end", "n": n, "ts": time.time(), "status": d.status,
                         "events_sent": d.events_sent, "outcome": d.outcome})
        return d.reusable and req.keep_alive
