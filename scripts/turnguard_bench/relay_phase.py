"""The relay's cost, as its own line: guarded requests with ``turnguard_detach_ms`` (each
dispatch runs on turnguard's own flow, and its client streams from it through the loopback
relay: two flows in mitmproxy instead of one) against the same requests without it, same
upstream, same run, alternating; plus the cost of attaching duplicates live (a duplicate
streamed through the relay) against replaying them after the original's end."""

from __future__ import annotations

import uuid
from pathlib import Path

from turnguard_bench import procs
from turnguard_bench.phases import _measure_load, _summary, log, model_request, warm
from turnguard_bench.stats import median, ratio


async def relay(cfg, workdir: Path, up: procs.Proc) -> dict:
    ms = procs.start_mitmdumps(workdir, up.url, {
        "relay-direct": ("turnguard", {}),
        "relay-detached": ("turnguard", {"turnguard_detach_ms": 30000}),
    })
    runs: dict[int, dict[str, list[dict]]] = {c: {"direct": [], "detached": []}
                                              for c in cfg.relay}
    try:
        for p in ms.values():
            await warm(p, cfg.warmup)
        for rep in range(cfg.repeats):
            for c, n in cfg.relay.items():
                order = ("direct", "detached") if rep % 2 == 0 else ("detached", "direct")
                for v in order:
                    nonce = f"relay-{v}-{c}-{rep}-{uuid.uuid4().hex[:8]}"
                    load, extra = await _measure_load(
                        ms[f"relay-{v}"], up,
                        lambda i, nonce=nonce: model_request(nonce, i, session=f"s{i % 64}"),
                        n, c, cfg)
                    s = _summary(load, extra, n)
                    runs[c][v].append(s)
                    log(f"relay c={c:<2} {v:<9} rep {rep + 1}: {s['rps']:.0f} req/s, median "
                        f"{s['median_ms']:.2f} ms, cpu {s['cpu_ms_per_request']:.2f} ms/req")
    finally:
        for p in ms.values():
            p.stop()
    out: dict = {"concurrency": {}}
    for c, by_v in runs.items():
        row = {v: {k: median(r[k] for r in reps) for k in ("rps", "median_ms",
                                                              "cpu_ms_per_request")}
               for v, reps in by_v.items()}
        row["detached_vs_direct"] = {
            "rps_ratio": ratio(row["detached"]["rps"], row["direct"]["rps"]),
            "added_median_ms": row["detached"]["median_ms"] - row["direct"]["median_ms"],
            "added_cpu_ms_per_request": (row["detached"]["cpu_ms_per_request"]
                                         - row["direct"]["cpu_ms_per_request"]),
        }
        out["concurrency"][str(c)] = row
    every = [r for by_v in runs.values() for reps in by_v.values() for r in reps]
    out["checks"] = {
        "all_answered": all(r["answers"] == r["requests"] and r["errors"] == 0 for r in every),
        "all_200": all(r["statuses"] == [200] for r in every),
    }
    return out
