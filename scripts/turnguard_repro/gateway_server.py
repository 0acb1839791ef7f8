"""The gateway executor model as a real HTTP server, so a real client (``codex exec``) can sit
behind an OmniRoute-like gateway:

    codex exec  ->  gateway_server (re-sends identical requests)  ->  mitmdump [+ turnguard]  ->  upstream

    python -m turnguard_repro.gateway_server --upstream http://127.0.0.1:PORT [--port 0]
        [--hedge-after-ms 1500] [--max-parallel 3] [--log FILE.jsonl]

For each model request it runs ``clients.hedged_exchange`` (the ``gateway`` client model's
policy) against the upstream and answers with the completed attempt, whole (with a
Content-Length; the relay is buffered, which a client with a stream idle timeout of minutes
does not notice), or relays the last error answer, or 502 when there was none. It prints
``gateway listening at http://127.0.0.1:PORT`` and logs one JSON line per request (attempts,
hedges, accounts marked rate limited, outcome). SIGTERM/SIGINT stop it. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from turnguard_mock.server import Connection, Request, Server, response_head, until_stopped

from . import clients

HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive",
       "accept-encoding", "te", "upgrade", "proxy-connection"}
RELAYED = ("content-type", "x-codex-turn-state", "x-request-id", "x-turnguard", "retry-after",
           "x-should-retry")


class GatewayServer:
    """The gateway's state: the upstream, the hedging policy, the request count and the log."""

    def __init__(self, upstream: str, hedge_after_ms: float, max_parallel: int, log: str | None):
        self.upstream = upstream.rstrip("/")
        self.hedge_after_ms = hedge_after_ms
        self.max_parallel = max_parallel
        self.n = 0
        self.log = None
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self.log = os.fdopen(fd, "a", buffering=1, encoding="utf-8")

    async def answer(self, conn: Connection, req: Request) -> bool:
        """Relay one request as the ``gateway`` client model would (``server.Server`` calls
        this); whether the connection may serve another."""
        self.n += 1
        keep = req.keep_alive
        if req.method != "POST":
            await self._send(conn, 404, {"content-type": "application/json"},
                             b'{"error":{"message":"gateway: POST only","code":"not_found"}}', keep)
            return keep
        model = clients.Gateway(f"gw{self.n}", self.upstream, path=req.target,
                                hedge_after_ms=self.hedge_after_ms, max_parallel=self.max_parallel)
        fwd: dict[str, str] = {}
        for k, v in req.headers:
            if k.lower() not in HOP:
                fwd.setdefault(k.lower(), v)
        started = time.time()
        ex, outcome, reason = None, "completed", ""
        try:
            ex = await clients.hedged_exchange(model, 0, fwd, req.body)
        except clients.Lost as e:
            outcome, reason, ex = "lost", str(e), e.exchange
        self._log({"ts": started, "request": self.n, "path": req.target, "outcome": outcome,
                   "reason": reason, "attempts": len(model.attempts),
                   "hedges": model.extra.get("hedges", 0),
                   "accounts_marked_rate_limited": model.extra.get("accounts_marked_rate_limited", 0),
                   "statuses": [a.status for a in model.attempts], "duration_s": round(time.time() - started, 3)})
        if ex is not None and ex.status is not None and (ex.completed or ex.status >= 400):
            out = {k: ex.headers[k] for k in RELAYED if k in ex.headers}
            await self._send(conn, ex.status, out, ex.body, keep)
            return keep
        err = json.dumps({"error": {"message": f"gateway: {reason}", "type": "server_error",
                                    "code": "gateway_failed"}}).encode()
        await self._send(conn, 502, {"content-type": "application/json"}, err, keep)
        return keep

    @staticmethod
    async def _send(conn: Connection, status: int, headers: dict[str, str], body: bytes,
                    keep: bool) -> None:
        await conn.send(response_head(status, [
            *headers.items(), ("content-length", str(len(body))),
            ("connection", "keep-alive" if keep else "close"),
        ]) + body)

    def _log(self, rec) -> None:
        if self.log is not None:
            self.log.write(json.dumps(rec) + "\n")


async def serve(args) -> int:
    gw = GatewayServer(args.upstream, args.hedge_after_ms, args.max_parallel, args.log)
    server = Server(gw.answer, max_requests_per_connection=1000)
    await server.start("127.0.0.1", args.port)
    try:
        await until_stopped(lambda: print(
            f"gateway listening at http://127.0.0.1:{server.port}", flush=True))
    finally:
        await server.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--hedge-after-ms", type=float, default=1500)
    p.add_argument("--max-parallel", type=int, default=3)
    p.add_argument("--log")
    a = p.parse_args(argv)
    if not a.upstream.startswith("http://127.") and not a.upstream.startswith("http://localhost"):
        p.error("--upstream must be a loopback http:// URL")
    return asyncio.run(serve(a))


if __name__ == "__main__":
    sys.exit(main())
