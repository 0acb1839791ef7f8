"""Responses over WebSocket, Codex's default transport (the ``ws`` phase): calls per second
through turnguard against plain mitmdump relaying the same sockets, same run, same upstream.

The upstream is the mock (``turnguard_mock``: it speaks the Responses API over WebSocket, one
JSON event per text frame, its default answer ``response.created`` .. ``response.completed``).
Each of K sockets sends its calls one after the other (``response.create`` frames with inputs
unique to the run, as Codex sends a turn's calls), each waited for to its terminal event.
Variants: plain_stream, the ledger floor (``ledger_floor_addon``: a durable claim per call and
its end, nothing else) and turnguard. Figures per variant: calls/s, median latency, mitmdump's
CPU per call; the ratio by CPU is the steadier guide on a shared machine (the mock and the
client share its 2 cores). Checks: every call completed with all its events, every call
dispatched upstream once, the ledger floor claimed and ended every call.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from turnguard_bench import client, procs
from turnguard_bench.phases import _in_turn, ledger_floor_completed, log
from turnguard_bench.stats import median, percentile, ratio
from turnguard_procs import cpu_seconds
from turnguard_ws import WsClient

CALL_TIMEOUT_S = 30.0
# plain mitmdump relaying; the ledger floor (a durable claim per call and its end, committed
# on the event loop: what any guard that runs a call at most once must write); turnguard
VARIANTS = ("plain_stream", "ledger_floor", "turnguard")


def call_frame(nonce: str, i: int) -> dict:
    """A ``response.create`` frame as Codex sends one, with an input unique to (nonce, i)."""
    return {"type": "response.create", "model": "bench", "stream": True, "store": False,
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": f"{nonce}-{i}"}]}]}


async def _ws_dispatches(up: procs.Proc) -> int:
    records = await client.get_json(up.port, "/_mock/dispatches")
    return sum(r.get("transport") == "ws" for r in records)


async def calls(port: int, sockets: int, calls: int, nonce: str, deadline: float) -> dict:
    """``calls`` calls over ``sockets`` sockets, each socket one call at a time."""
    latencies: list[float] = []
    events: list[int] = []
    failed = 0
    counter = iter(range(calls))

    async def socket_worker(k: int) -> None:
        nonlocal failed
        headers = {"authorization": "Bearer sk-bench-0123456789", "session-id": f"ws-{k}"}
        async with WsClient.connect(f"http://127.0.0.1:{port}", headers=headers) as c:
            for i in counter:  # bounded by calls
                if time.monotonic() > deadline:
                    return
                t0 = time.perf_counter()
                await c.send(call_frame(nonce, i))
                got = await c.response(CALL_TIMEOUT_S)
                latencies.append(time.perf_counter() - t0)
                if got[-1].get("type") == "response.completed":
                    events.append(len(got))
                else:
                    failed += 1

    t0 = time.perf_counter()
    results = await asyncio.gather(*(socket_worker(k) for k in range(sockets)),
                                   return_exceptions=True)
    wall = time.perf_counter() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    return {"calls": calls, "completed": len(events), "failed": failed + len(errors),
            "errors": [repr(e) for e in errors][:3], "wall_s": wall,
            "events_per_call": sorted(set(events)),
            "calls_per_s": len(events) / wall if wall else 0.0,
            "median_ms": percentile([x * 1000 for x in latencies], 50),
            "p99_ms": percentile([x * 1000 for x in latencies], 99)}


async def ws(cfg, workdir: Path) -> dict:
    up = procs.start_mock_upstream(workdir, "ws-upstream")
    ms: dict[str, procs.Proc] = {}
    runs: dict[int, dict[str, list[dict]]] = {k: {v: [] for v in VARIANTS} for k in cfg.ws}
    try:
        ms = procs.start_mitmdumps(workdir, up.url, {f"ws-{v}": (v, {}) for v in VARIANTS})
        variants = {v: ms[f"ws-{v}"] for v in VARIANTS}
        for p in variants.values():  # warm-up: a few calls on one socket
            await calls(p.port, 1, 20, f"ws-warm-{uuid.uuid4().hex[:8]}",
                         time.monotonic() + cfg.load_time_limit_s)
        for rep, sockets, n, v in _in_turn(cfg.ws, variants, cfg.repeats):
            p = variants[v]
            before, cpu0 = await _ws_dispatches(up), cpu_seconds(p.pid)
            s = await calls(p.port, sockets, n, f"ws-{v}-{sockets}-{rep}-{uuid.uuid4().hex[:8]}",
                             time.monotonic() + cfg.load_time_limit_s)
            s["cpu_ms_per_call"] = (cpu_seconds(p.pid) - cpu0) * 1000 / max(1, s["completed"])
            s["upstream_dispatches"] = await _ws_dispatches(up) - before
            runs[sockets][v].append(s)
            log(f"ws sockets={sockets:<2} {v:<12} rep {rep + 1}: {s['calls_per_s']:.0f} calls/s, "
                f"median {s['median_ms']:.2f} ms, cpu {s['cpu_ms_per_call']:.2f} ms/call, "
                f"completed {s['completed']}/{n}")
        completed = ledger_floor_completed(variants["ledger_floor"])
    finally:
        for p in ms.values():
            p.stop()
        up.stop()
    out: dict = {"sockets": {}}
    for sockets, by_v in runs.items():
        row = {v: {k: median(r[k] for r in reps)
                   for k in ("calls_per_s", "median_ms", "p99_ms", "cpu_ms_per_call")}
               for v, reps in by_v.items()}
        for v, reps in by_v.items():
            row[v]["reps"] = reps
        for a, b in (("turnguard", "plain_stream"), ("turnguard", "ledger_floor"),
                     ("ledger_floor", "plain_stream")):
            row[f"{a}_vs_{b}"] = {
                "calls_per_s_ratio": ratio(row[a]["calls_per_s"], row[b]["calls_per_s"]),
                "cpu_calls_per_s_ratio": ratio(row[b]["cpu_ms_per_call"],
                                               row[a]["cpu_ms_per_call"]),
                "added_median_ms": row[a]["median_ms"] - row[b]["median_ms"],
            }
        out["sockets"][str(sockets)] = row
    every = [r for by_v in runs.values() for reps in by_v.values() for r in reps]
    out["checks"] = {
        "runs": len(every),
        "every_call_completed": all(r["completed"] == r["calls"] and r["failed"] == 0
                                    for r in every),
        "every_call_dispatched_once": all(r["upstream_dispatches"] == r["calls"] for r in every),
    }
    # the floor did write what it stands for: a claim and an end (its events) per call
    measured = sum(r["calls"] for by_v in runs.values() for r in by_v["ledger_floor"])
    out["ledger_floor_completed_claims"] = completed
    out["checks"]["ledger_floor_recorded_every_call"] = completed >= measured
    return out
