"""Where a request's time goes inside mitmdump (the ``hooks`` phase): turnguard's hooks and
their parts (identity, decision, answer, telemetry line, log handlers) and the garbage
collector's passes, each timed in the running process by ``hook_timer_addon.py``, for two
loads: replays of the 8-event SSE (4 clients, as the replay phase) and new operations (8
clients, each claimed and dispatched), with the answer floor's hooks beside the replays, and
beside the new operations the ledger floor's hooks (its durable claim and end: what any
guard that runs a request at most once must do in them) and plain_stream (its collector's
passes only: what any process's requests leave to it). Medians per call and the mean per
request; the parts nest (see ``hook_timer_addon``). The wrappers add about a microsecond to
each timed call."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from turnguard_bench import client, hook_timer_addon, procs
from turnguard_bench.phases import _measure_load, log, model_request, warm

REPLAY_CLIENTS = 4
DISPATCH_CLIENTS = 8


async def _times(p: procs.Proc) -> dict:
    """What the mitmdump's hook timer timed since it was last asked (and it starts over)."""
    return (await client.get_json(p.port, hook_timer_addon.TIMES_PATH))["parts"]


def _per_request(parts: dict, requests: int) -> dict:
    """Each part's calls and mean time per request besides its per-call median and p90."""
    return {part: {**t, "calls_per_request": t["calls"] / requests,
                   "us_per_request": t["total_us"] / requests}
            for part, t in parts.items() if t["calls"]}


async def hooks(cfg, workdir: Path, up: procs.Proc) -> dict:
    ms = procs.start_mitmdumps(workdir, up.url, {
        "hooks-turnguard": ("turnguard", {}),
        "hooks-answer_floor": ("answer_floor", {}),
        "hooks-ledger_floor": ("ledger_floor", {}),
        "hooks-plain_stream": ("plain_stream", {}),  # (the collector's passes only)
    }, hook_timer=True)
    out: dict = {"replay": {}, "dispatch": {}}
    checks: dict = {}
    try:
        for p in ms.values():
            await warm(p, cfg.warmup)
        n = cfg.hooks["replay"]
        for v in ("turnguard", "answer_floor"):
            p = ms[f"hooks-{v}"]
            raw = model_request(f"hk-{v}-{uuid.uuid4().hex[:8]}", 0)
            await client.run_load(p.port, lambda i: raw, 1, 1, time_limit_s=60)  # the original
            await asyncio.sleep(0.2)  # its response hook records it
            await _times(p)
            load, extra = await _measure_load(p, up, lambda i: raw, n, REPLAY_CLIENTS, cfg)
            out["replay"][v] = _per_request(await _times(p), n)
            ok = [r for r in load.results if r.error is None and r.status == 200]
            checks[f"{v}_replays_answered"] = len(ok) == n
            checks[f"{v}_nothing_dispatched_on_replay"] = extra["upstream_dispatches"] == 0
            if v == "turnguard":
                checks["turnguard_all_replayed"] = all(
                    r.headers.get("x-turnguard") == "replayed" for r in ok)
            log(f"hooks: {n} replays through {v} timed")
        out["replay"]["requests"] = n
        n = cfg.hooks["dispatch"]
        for v in ("turnguard", "ledger_floor", "plain_stream"):
            p = ms[f"hooks-{v}"]
            await _times(p)
            nonce = f"hk-new-{v}-{uuid.uuid4().hex[:8]}"
            load, extra = await _measure_load(
                p, up, lambda i: model_request(nonce, i, session=f"s{i % 64}"), n,
                DISPATCH_CLIENTS, cfg)
            out["dispatch"][v] = _per_request(await _times(p), n)
            prefix = "" if v == "turnguard" else f"{v}_"
            checks[f"{prefix}dispatches_answered"] = sum(
                r.error is None and r.status == 200 for r in load.results) == n
            checks[f"{prefix}every_operation_dispatched_once"] = \
                extra["upstream_dispatches"] == n
            log(f"hooks: {n} new operations through {v} timed")
        out["dispatch"]["requests"] = n
    finally:
        for p in ms.values():
            p.stop()
    out["checks"] = checks
    return out
