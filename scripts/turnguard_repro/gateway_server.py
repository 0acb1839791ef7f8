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
import contextlib
import json
import os
import signal
import sys
import time

from . import clients

HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive",
       "accept-encoding", "te", "upgrade", "proxy-connection"}
RELAYED = ("content-type", "x-codex-turn-state", "x-request-id", "x-turnguard", "retry-after",
           "x-should-retry")
READ_TIMEOUT_S = 60.0
MAX_BODY = 64 * 1024 * 1024


class GatewayServer:
    def __init__(self, upstream: str, hedge_after_ms: float, max_parallel: int, log: str | None):
        self.upstream = upstream.rstrip("/")
        self.hedge_after_ms = hedge_after_ms
        self.max_parallel = max_parallel
        self.n = 0
        self.log = None
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self.log = os.fdopen(fd, "a", buffering=1, encoding="utf-8")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(1000):  # keep-alive requests on this connection, bounded
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 300)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                    return
                lines = head[:-4].decode("latin-1").split("\r\n")
                method, path, _ = (lines[0].split(" ") + ["", "", ""])[:3]
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers.setdefault(k.strip().lower(), v.strip())
                body = await self._body(reader, headers)
                keep = headers.get("connection", "").lower() != "close"
                await self.answer(writer, method, path, headers, body, keep)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            out = b""
            for _ in range(100_000):
                size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), READ_TIMEOUT_S)).split(b";")[0], 16)
                if size == 0:
                    await asyncio.wait_for(reader.readuntil(b"\r\n"), READ_TIMEOUT_S)
                    return out
                if len(out) + size > MAX_BODY:
                    raise ValueError("body too large")
                out += await asyncio.wait_for(reader.readexactly(size + 2), READ_TIMEOUT_S)
                out = out[:-2]
            raise ValueError("too many chunks")
        n = int(headers.get("content-length", "0") or 0)
        if n > MAX_BODY:
            raise ValueError("body too large")
        return await asyncio.wait_for(reader.readexactly(n), READ_TIMEOUT_S) if n else b""

    async def answer(self, writer, method, path, headers, body, keep) -> None:
        self.n += 1
        if method != "POST":
            return await self._send(writer, 404, {"content-type": "application/json"},
                                    b'{"error":{"message":"gateway: POST only","code":"not_found"}}', keep)
        model = clients.Gateway(f"gw{self.n}", self.upstream, path=path,
                                hedge_after_ms=self.hedge_after_ms, max_parallel=self.max_parallel)
        fwd = {k: v for k, v in headers.items() if k not in HOP}
        started = time.time()
        ex, outcome, reason = None, "completed", ""
        try:
            ex = await clients.hedged_exchange(model, 0, fwd, body)
        except clients.Lost as e:
            outcome, reason, ex = "lost", str(e), e.exchange
        self._log({"ts": started, "request": self.n, "path": path, "outcome": outcome, "reason": reason,
                   "attempts": len(model.attempts), "hedges": model.extra.get("hedges", 0),
                   "accounts_marked_rate_limited": model.extra.get("accounts_marked_rate_limited", 0),
                   "statuses": [a.status for a in model.attempts], "duration_s": round(time.time() - started, 3)})
        if ex is not None and ex.status is not None and (ex.completed or ex.status >= 400):
            out = {k: ex.headers[k] for k in RELAYED if k in ex.headers}
            return await self._send(writer, ex.status, out, ex.body, keep)
        err = json.dumps({"error": {"message": f"gateway: {reason}", "type": "server_error",
                                    "code": "gateway_failed"}}).encode()
        await self._send(writer, 502, {"content-type": "application/json"}, err, keep)

    async def _send(self, writer, status, headers, body, keep) -> None:
        lines = [f"HTTP/1.1 {status} Status"] + [f"{k}: {v}" for k, v in headers.items()]
        lines += [f"content-length: {len(body)}", "connection: keep-alive" if keep else "connection: close"]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)

    def _log(self, rec) -> None:
        if self.log is not None:
            self.log.write(json.dumps(rec) + "\n")


async def serve(args) -> int:
    gw = GatewayServer(args.upstream, args.hedge_after_ms, args.max_parallel, args.log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await asyncio.start_server(gw.handle, "127.0.0.1", args.port)
    print(f"gateway listening at http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
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
