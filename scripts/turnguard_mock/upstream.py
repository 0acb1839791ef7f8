"""The mock upstream's routes and its dispatch log (see the package docstring for both)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import zlib
from typing import Any

from .behaviours import Dispatch, Holds
from .responses_ws import serve_socket
from .events import INVALID_BODY_ERROR
from .scenario import DEFAULT_SCENARIO, Dispatcher, validate_behaviour
from .server import MAX_BODY_BYTES, ClientGone, Connection, Request, json_error

REPRO_ATTEMPT_HEADER = "x-turnguard-repro-attempt"
MODEL_ROUTES = ("/responses", "/chat/completions")


class MockUpstream:
    """The mock's state: the scenario and its counters (``dispatcher``), every record (kept in
    memory and appended to the log file, mode 0600, flushed per line). ``route`` answers one
    request on a ``server.Server``."""

    def __init__(self, scenario: dict[str, Any] = DEFAULT_SCENARIO, log_path: str | None = None):
        self.dispatcher = Dispatcher(scenario)
        self.records: list[dict[str, Any]] = []
        self.holds = Holds(self.record)
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
        if (req.method == "GET" and req.path.endswith(MODEL_ROUTES)
                and (req.header("upgrade") or "").lower() == "websocket"):
            await serve_socket(self, conn, req)
            return False
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
        elif req.method == "POST" and req.path == "/_mock/release":
            try:
                name = json.loads(req.body)["hold"]
                if not (isinstance(name, str) and name):
                    raise ValueError
            except (ValueError, TypeError, KeyError):
                await conn.send_json(400, json_error('body must be {"hold": NAME}', "bad_release"),
                                     close=close)
                return not close
            waiting = self.holds.release(name)
            self.record({"event": "release", "ts": time.time(), "hold": name, "waiting": waiting})
            await conn.send_json(200, {"ok": True, "waiting": waiting}, close=close)
        else:
            await conn.send_json(404, json_error(f"no route for {req.method} {req.path}", "not_found"),
                                 close=close)
        return not close

    async def dispatch(self, conn: Connection, req: Request) -> bool:
        """Number, log and answer a model request; return False if the connection is done.
        A body that is not a JSON object is answered 400, as the real API does, and is not a
        dispatch (logged as ``invalid_body``). A gzip or deflate request body is decoded first
        (at most MAX_BODY_BYTES; more is an invalid body)."""
        try:
            req.body = _decoded(req)  # the dispatch and its log see the decoded body
            parsed = json.loads(req.body)
        except (ValueError, RecursionError):
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
        n, selected = self.select(conn, req, "http", override=behaviour if override else None)
        d = Dispatch(conn, req, n, selected)
        await self.run(d)
        return d.reusable and req.keep_alive

    def select(self, conn: Connection, req: Request, transport: str, *,
               override: dict[str, Any] | None = None, **extra: Any) -> tuple[int, dict[str, Any]]:
        """Number a dispatch, choose its behaviour (``override``: the x-mock-behaviour header's)
        and log it; returns the number and the behaviour."""
        session = req.header("session-id") or req.header("session_id")
        body_sha = hashlib.sha256(req.body).hexdigest()
        sel = self.dispatcher.next(session, body_sha)
        if override is None:
            selected_by, behaviour = sel.selected_by, sel.behaviour
        else:
            selected_by, behaviour = "header", override
        self.record(
            {
                "event": "dispatch",
                "n": sel.n,
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
                "subprotocol_present": req.header("sec-websocket-protocol") is not None,
                "selected_by": selected_by,
                "op_n": sel.op_n,
                "session_n": sel.session_n,
                "spec": behaviour,
                "client_attempt": req.header(REPRO_ATTEMPT_HEADER),
                "transport": transport,
                **extra,
            }
        )
        return sel.n, behaviour

    async def run(self, d: Dispatch) -> None:
        """Answer a logged dispatch with its behaviour; log how it ended."""
        d.holds = self.holds
        try:
            await d.run()
        except ClientGone:
            d.outcome = "client_gone"
            self.record({"event": "client_gone", "n": d.n, "ts": time.time()})
        except asyncio.CancelledError:
            d.outcome = "server_shutdown"
            raise
        finally:
            self.record({"event": "dispatch_end", "n": d.n, "ts": time.time(), "status": d.status,
                         "events_sent": d.events_sent, "outcome": d.outcome})


def _decoded(req: Request) -> bytes:
    """The request body without its gzip/deflate content codings, last applied first
    (ValueError: another coding, invalid data, or more than MAX_BODY_BYTES decoded)."""
    codings = [c.strip().lower() for c in (req.header("content-encoding") or "").split(",")]
    body = req.body
    for coding in reversed([c for c in codings if c not in ("", "identity")]):
        if coding not in ("gzip", "x-gzip", "deflate"):
            raise ValueError(f"content-encoding {coding} not supported")
        d = zlib.decompressobj(16 + zlib.MAX_WBITS if coding != "deflate" else zlib.MAX_WBITS)
        try:
            body = d.decompress(body, MAX_BODY_BYTES + 1)
        except zlib.error as e:
            raise ValueError(str(e)) from None
        if len(body) > MAX_BODY_BYTES or not d.eof:
            raise ValueError("body too large once decoded, or incomplete")
    return body
