"""The measurements of issue 5, each side by side with plain mitmdump in the same run.

Variants (see ``procs.VARIANTS``): ``plain`` (mitmdump, no addon: bodies buffered),
``plain_stream`` (no addon, ``stream_large_bodies=1``: bodies streamed), ``floor`` (a no-op
addon that only streams SSE responses: what any streaming addon costs), ``ledger_floor`` (the
floor plus a durable claim and end per request in SQLite: what any guard that executes a
request at most once across processes must write; per-request and streaming phases),
``answer_floor`` (answers a repeated request from memory; replay phase) and ``turnguard``
(``-s addon/turnguard.py``; it streams guarded responses through its tee). All of them front the
same bench upstream on 127.0.0.1 with the same options otherwise; repeats run the variants in a
rotating order so that a burst of load from elsewhere on the machine does not always hit the
same one.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Callable

from turnguard_bench import client, ledger_floor_addon, procs
from turnguard_bench.stats import median, percentile, ratio, spread
from turnguard_procs import cpu_seconds, cpu_times, kernel_events, rss_bytes

V_ALL = ("plain", "plain_stream", "floor", "turnguard")
# what turnguard is compared with (ledger_floor: in the phases of dispatched requests only;
# answer_floor: in the replay phase only; turnguard_baseline: with --baseline-rev only)
BASES = ("plain", "plain_stream", "floor", "ledger_floor", "answer_floor", "turnguard_baseline")
SHORT_EVENTS = 8  # the upstream's default stream: created .. completed with 3 deltas
GUARDED_PATH = "/v1/responses"
SOAK_WINDOW_MS = 2000


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_request(
    nonce: str, i: int, *, session: str = "bench-1", extra: dict[str, str] | None = None,
) -> bytes:
    """A guarded Responses request with a body unique to (nonce, i)."""
    body = b'{"model":"bench","input":"%s-%d","stream":true}' % (nonce.encode(), i)
    headers = {
        "content-type": "application/json",
        "accept": "text/event-stream",
        "authorization": "Bearer sk-bench-0123456789",
        "session-id": session,
    }
    if extra:
        headers.update(extra)
    return client.build_request(GUARDED_PATH, body, headers)


def _rotate(seq, k: int):
    k %= len(seq)
    return list(seq[k:]) + list(seq[:k])


async def upstream_stats(up: procs.Proc) -> dict:
    return await client.get_json(up.port, "/_bench/stats")


async def _measure_load(
    p: procs.Proc, up: procs.Proc, make: Callable[[int], bytes], n: int, c: int, cfg,
    *, hash_body: bool = False,
) -> tuple[client.Load, dict]:
    """Run a load against one mitmdump; return it with CPU (all of it, and the system's
    part) and upstream-dispatch deltas."""
    before = (await upstream_stats(up))["dispatches"]
    user0, system0 = cpu_times(p.pid)
    events0 = kernel_events(p.pid)
    load = await client.run_load(
        p.port, make, n, c, time_limit_s=cfg.load_time_limit_s,
        request_timeout_s=cfg.request_timeout_s, hash_body=hash_body,
    )
    user1, system1 = cpu_times(p.pid)
    events1 = kernel_events(p.pid)
    after = (await upstream_stats(up))["dispatches"]
    return load, {"cpu_s": user1 + system1 - user0 - system0, "cpu_system_s": system1 - system0,
                  "upstream_dispatches": after - before,
                  "kernel_events": {k: events1[k] - events0[k] for k in events0}}


# what the kernel did for a request, beside its CPU time (``kernel_events``): in each row of
# the per-request phase
KERNEL_EVENTS = ("minor_faults_per_request", "voluntary_switches_per_request",
                 "involuntary_switches_per_request")


def _summary(load: client.Load, extra: dict, n: int) -> dict:
    ok = [r for r in load.results if r.error is None]
    lat = [r.latency * 1000 for r in ok]
    return {
        "requests": n,
        "answers": len(load.results),
        "ok": len(ok),
        "errors": load.errors,
        "stopped_by_deadline": load.stopped_by_deadline,
        "statuses": sorted({r.status for r in ok}),
        "wall_s": load.wall_s,
        "rps": len(ok) / load.wall_s if load.wall_s else 0.0,
        "median_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "cpu_s": extra["cpu_s"],
        "cpu_ms_per_request": extra["cpu_s"] * 1000 / len(ok) if ok else float("nan"),
        "cpu_system_ms_per_request": (extra["cpu_system_s"] * 1000 / len(ok) if ok
                                      else float("nan")),
        "upstream_dispatches": extra["upstream_dispatches"],
        **{f"{k}_per_request": v / len(ok) if ok else float("nan")
           for k, v in extra.get("kernel_events", {}).items()},
    }


def _empty_runs(settings: dict[int, int], variants: dict) -> dict[int, dict[str, list[dict]]]:
    """Where a phase keeps its repeats: setting -> variant -> [summary of each repeat]."""
    return {k: {v: [] for v in variants} for k in settings}


def _in_turn(settings: dict[int, int], variants: dict, repeats: int, *,
             rotate_by_setting: bool = False):
    """(repeat, setting, requests, variant) in the order a phase measures them: each repeat
    goes over every setting, and for each over the variants in an order rotated by the repeat
    (and by the setting), so that no variant always runs first (or right after another)."""
    for rep in range(repeats):
        for key, n in settings.items():
            yield from ((rep, key, n, v)
                        for v in _rotate(list(variants), rep + (key if rotate_by_setting else 0)))


def _keep(by_v: dict[str, list[dict]], variant: str, summary: dict, line: str) -> None:
    """Keep one repeat's ``summary`` under its variant and log ``line`` about it."""
    by_v[variant].append(summary)
    log(line)


def _row(by_v: dict[str, list[dict]], medians: tuple[str, ...], spreads: tuple[str, ...],
         vs: Callable[[dict, dict], dict]) -> dict:
    """One row of a phase's table from its repeats per variant: for each variant the median
    over the repeats of each key in ``medians``, ``<key>_spread`` of each key in ``spreads``
    and the repeats themselves; then ``turnguard_vs_<base>`` = ``vs(turnguard, base)`` for
    each plain variant measured."""
    row: dict = {}
    for v, reps in by_v.items():
        row[v] = {k: median(r[k] for r in reps) for k in medians}
        row[v].update({f"{k}_spread": spread(r[k] for r in reps) for k in spreads})
        row[v]["reps"] = reps
    tg = row.get("turnguard")
    for base in BASES:
        if tg and base in row:
            row[f"turnguard_vs_{base}"] = vs(tg, row[base])
    return row


def _request_ratios(tg: dict, b: dict) -> dict:
    """turnguard's requests/s, median and p99 latency over a plain variant's."""
    return {
        "rps_ratio": ratio(tg["rps"], b["rps"]),
        "median_ratio": ratio(tg["median_ms"], b["median_ms"]),
        "p99_ratio": ratio(tg["p99_ms"], b["p99_ms"]),
    }


def _answered_checks(all_runs: list[dict]) -> dict:
    """The checks of a phase of requests: how many runs, every request answered, all 200."""
    return {
        "runs": len(all_runs),
        "all_answered": all(r["answers"] == r["requests"] and r["errors"] == 0 for r in all_runs),
        "all_200": all(r["statuses"] == [200] for r in all_runs),
    }


def _all_runs(runs: dict[object, dict[str, list[dict]]]) -> list[dict]:
    """Every repeat of every variant of a phase."""
    return [r for by_v in runs.values() for reps in by_v.values() for r in reps]


async def warm(p: procs.Proc, n: int) -> None:
    nonce = "warm-" + uuid.uuid4().hex[:8]
    await client.run_load(p.port, lambda i: model_request(nonce, i), n, 8, time_limit_s=60)


# -- 1. per-request overhead -----------------------------------------------------------------
async def per_request(cfg, up: procs.Proc, ms: dict[str, procs.Proc]) -> dict:
    runs = _empty_runs(cfg.per_request, ms)
    for rep, c, n, v in _in_turn(cfg.per_request, ms, cfg.repeats, rotate_by_setting=True):
        nonce = f"pr-{v}-{c}-{rep}-{uuid.uuid4().hex[:8]}"
        load, extra = await _measure_load(
            ms[v], up, lambda i, nonce=nonce: model_request(nonce, i, session=f"s{i % 64}"),
            n, c, cfg,
        )
        s = _summary(load, extra, n)
        s["events_ok"] = all(r.events == SHORT_EVENTS for r in load.results if r.error is None)
        _keep(runs[c], v, s, f"per-request c={c:<2} {v:<12} rep {rep + 1}: "
              f"{s['rps']:.0f} req/s, median {s['median_ms']:.2f} ms, "
              f"p99 {s['p99_ms']:.2f} ms, cpu {s['cpu_ms_per_request']:.2f} ms/req")

    def vs(tg: dict, b: dict) -> dict:
        return {
            **_request_ratios(tg, b),
            "added_median_ms": tg["median_ms"] - b["median_ms"],
            "added_cpu_ms_per_request": tg["cpu_ms_per_request"] - b["cpu_ms_per_request"],
            "added_cpu_system_ms_per_request": (tg["cpu_system_ms_per_request"]
                                                - b["cpu_system_ms_per_request"]),
            # mitmdump is one event loop on one core: on an otherwise idle core its
            # throughput is about 1 / CPU per request, so this ratio is a less noisy estimate
            # of the throughput ratio on a shared machine.
            "cpu_rps_ratio": ratio(b["cpu_ms_per_request"], tg["cpu_ms_per_request"]),
        }

    out: dict = {"concurrency": {
        str(c): _row(by_v, ("rps", "median_ms", "p99_ms", "cpu_ms_per_request",
                            "cpu_system_ms_per_request", *KERNEL_EVENTS), ("rps", "median_ms"),
                     vs)
        for c, by_v in runs.items()
    }}
    all_runs = _all_runs(runs)
    out["checks"] = {
        **_answered_checks(all_runs),
        "all_streams_complete": all(r["events_ok"] for r in all_runs),
        "every_request_dispatched_once": all(r["upstream_dispatches"] == r["requests"] for r in all_runs),
    }
    if "ledger_floor" in ms:  # it did write what it stands for: a claim and an end per request
        measured = sum(r["requests"] for by_v in runs.values() for r in by_v["ledger_floor"])
        out["ledger_floor_completed_claims"] = completed = ledger_floor_completed(ms["ledger_floor"])
        out["checks"]["ledger_floor_recorded_every_request"] = completed >= measured
    return out


def ledger_floor_completed(p: procs.Proc) -> int:
    """Claims the ``ledger_floor`` variant has ended (with their bodies) in its file."""
    path = Path(p.extra["confdir"]) / ledger_floor_addon.FILE_NAME
    db = sqlite3.connect(path.as_uri() + "?mode=ro", uri=True, timeout=10)
    try:
        return db.execute("SELECT count(*) FROM claims WHERE state='completed'"
                          " AND length(body) > 0").fetchone()[0]
    finally:
        db.close()


# -- 2. streaming ----------------------------------------------------------------------------
async def streaming(cfg, up: procs.Proc, ms: dict[str, procs.Proc]) -> dict:
    runs = _empty_runs(cfg.stream, ms)
    for rep, events, n, v in _in_turn(cfg.stream, ms, cfg.repeats):
        nonce = f"st-{v}-{events}-{rep}-{uuid.uuid4().hex[:8]}"
        make = lambda i, nonce=nonce, events=events: model_request(  # noqa: E731
            nonce, i, extra={"x-bench-events": str(events)})
        load, extra = await _measure_load(ms[v], up, make, n, 1, cfg)
        ok = [r for r in load.results if r.error is None]
        s = {
            "responses": n,
            "ok": len(ok),
            "errors": load.errors,
            "statuses": sorted({r.status for r in ok}),
            "events_complete": all(r.events == events for r in ok),
            "events_per_s": median(events / r.latency for r in ok),
            "ttfb_ms": median(r.ttfb * 1000 for r in ok),
            "total_ms": median(r.latency * 1000 for r in ok),
            "mib_per_s": median(r.body_bytes / r.latency / 2**20 for r in ok),
            "cpu_ms_per_response": extra["cpu_s"] * 1000 / max(1, len(ok)),
            "upstream_dispatches": extra["upstream_dispatches"],
        }
        _keep(runs[events], v, s, f"streaming {events:>5} events {v:<12} rep {rep + 1}: "
              f"{s['events_per_s']:.0f} events/s, ttfb {s['ttfb_ms']:.2f} ms, "
              f"total {s['total_ms']:.1f} ms")

    def vs(tg: dict, b: dict) -> dict:
        return {
            "events_per_s_ratio": ratio(tg["events_per_s"], b["events_per_s"]),
            "ttfb_ratio": ratio(tg["ttfb_ms"], b["ttfb_ms"]),
            "cpu_events_per_s_ratio": ratio(b["cpu_ms_per_response"], tg["cpu_ms_per_response"]),
        }

    out: dict = {"events": {
        str(events): _row(by_v, ("events_per_s", "ttfb_ms", "total_ms", "mib_per_s",
                                 "cpu_ms_per_response"), ("events_per_s",), vs)
        for events, by_v in runs.items()
    }}
    all_runs = _all_runs(runs)
    out["checks"] = {
        "runs": len(all_runs),
        "all_answered": all(r["ok"] == r["responses"] and r["errors"] == 0 for r in all_runs),
        "all_200": all(r["statuses"] == [200] for r in all_runs),
        "all_events_delivered": all(r["events_complete"] for r in all_runs),
    }
    return out


# -- 4. replay -------------------------------------------------------------------------------
async def replay(cfg, up: procs.Proc, ms: dict[str, procs.Proc]) -> dict:
    runs = _empty_runs(cfg.replay, ms)
    for rep, size, n, v in _in_turn(cfg.replay, ms, cfg.repeats):
        nonce = f"rp-{size}-{rep}-{uuid.uuid4().hex[:8]}"
        # size 0: the per-request phase's 8-event stream (replay vs plain dispatch of it)
        raw = model_request(nonce, 0, extra={"x-bench-bytes": str(size)} if size else None)
        prime = None
        if v in ("turnguard", "turnguard_baseline", "answer_floor"):  # the original: recorded
            pl = await client.run_load(ms[v].port, lambda i: raw, 1, 1, time_limit_s=60,
                                       hash_body=True)
            prime = pl.results[0]
            await asyncio.sleep(0.2)  # let the response hook record it
        load, extra = await _measure_load(ms[v], up, lambda i: raw, n, cfg.replay_concurrency,
                                          cfg, hash_body=True)
        s = _summary(load, extra, n)
        ok = [r for r in load.results if r.error is None]
        s["body_bytes"] = median(r.body_bytes for r in ok)
        s["mib_per_s"] = s["rps"] * (s["body_bytes"] or 0) / 2**20
        s["replayed"] = sum(r.headers.get("x-turnguard") == "replayed" for r in ok)
        s["distinct_bodies"] = len({r.sha256 for r in ok})
        s["same_as_original"] = prime is not None and all(r.sha256 == prime.sha256 for r in ok)
        _keep(runs[size], v, s, f"replay {size:>8} B {v:<12} rep {rep + 1}: "
              f"{s['rps']:.0f} req/s, {s['mib_per_s']:.1f} MiB/s, median {s['median_ms']:.2f} ms, "
              f"p99 {s['p99_ms']:.2f} ms, replayed {s['replayed']}/{n}")
    out: dict = {"sizes": {
        str(size): _row(by_v, ("rps", "mib_per_s", "median_ms", "p99_ms"), ("rps",),
                        _request_ratios)
        for size, by_v in runs.items()
    }}
    tg_runs = [r for by_v in runs.values() for v in ("turnguard", "turnguard_baseline")
               for r in by_v.get(v, [])]
    all_runs = _all_runs(runs)
    out["checks"] = {
        **_answered_checks(all_runs),
        "turnguard_all_replayed": all(r["replayed"] == r["requests"] for r in tg_runs),
        "turnguard_replays_byte_identical": all(r["same_as_original"] and r["distinct_bodies"] == 1 for r in tg_runs),
        "turnguard_nothing_dispatched_on_replay": all(r["upstream_dispatches"] == 0 for r in tg_runs),
        "answer_floor_nothing_dispatched": all(
            r["upstream_dispatches"] == 0 for by_v in runs.values()
            for r in by_v.get("answer_floor", [])),
    }
    return out


# -- 3. holds --------------------------------------------------------------------------------
def _count_in_file(path: Path, needle: bytes) -> int:
    try:
        return path.read_bytes().count(needle)
    except FileNotFoundError:
        return 0


async def _wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:  # bounded by the deadline
        v = await pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


def _open_files_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def holds_once(cfg, workdir: Path, rep: int) -> dict:
    """One run of the hold measurement, with a fresh upstream and fresh mitmdumps. Both
    connect upstream lazily (a held duplicate then takes one file descriptor, not two); plain
    mitmdump, whose requests all wait upstream, gets as many as its descriptors allow."""
    up = procs.start_upstream(workdir, name=f"holds-upstream-{rep}")
    out: dict = {}
    ms: dict[str, procs.Proc] = {}
    try:
        events_path = workdir / f"holds-{rep}-events.jsonl"
        ms = procs.start_mitmdumps(workdir, up.url, {
            f"holds-turnguard-{rep}": ("turnguard", {
                "turnguard_events": str(events_path),
                "turnguard_hold_timeout_ms": 600000,  # held through the setup of 10,000
                "turnguard_request_budget_ms": 900000,
                # the originals get no byte for the setup and the hold (over a minute in full
                # mode): past this bound turnguard would cut them and send a duplicate instead
                "turnguard_response_created_timeout_ms": 900000,
                "connection_strategy": "lazy",
            }),
            f"holds-plain-{rep}": ("plain", {"connection_strategy": "lazy"}),
        })
        for name, p in ms.items():
            variant = p.extra["variant"]
            await warm(p, 20)
            await asyncio.sleep(0.5)
            await client.get_json(up.port, "/_bench/reset", "POST")
            rss0 = rss_bytes(p.pid)
            nonce = f"hold-{rep}-{uuid.uuid4().hex[:8]}"
            n_ops, per_op = cfg.holds_ops, cfg.holds_dups_per_op
            originals = [
                (("orig", k), model_request(nonce, k, session=f"hold-{k}", extra={
                    "x-bench-hold": "1", "x-bench-id": f"o{k}", "x-bench-op": str(k)}))
                for k in range(n_ops)
            ]
            dups = [
                (("dup", k, j), model_request(nonce, k, session=f"hold-{k}", extra={
                    "x-bench-hold": "1", "x-bench-id": f"d{k}-{j}", "x-bench-op": str(k)}))
                for j in range(per_op) for k in range(n_ops)
            ]
            setup_limit_s = max(60.0, len(dups) / 40)  # 10,000 connections take a while to open
            timeout = cfg.hold_s + setup_limit_s + 120
            if variant == "plain":  # every request waiting upstream takes 2 descriptors there
                dups = dups[:max(0, _open_files_limit() // 2 - 500 - n_ops)]
            t_setup = time.monotonic()
            tasks = await client.open_and_send(p.port, originals, timeout_s=timeout)

            async def upstream_holds(n):
                return (await upstream_stats(up))["held"] >= n

            await _wait_for(lambda: upstream_holds(n_ops), 30, "the originals to reach the upstream")
            tasks += await client.open_and_send(p.port, dups, timeout_s=timeout)
            n_dups = len(dups)
            if variant == "turnguard":
                async def all_held():
                    return _count_in_file(events_path, b'"event":"duplicate_held"') >= n_dups
                await _wait_for(all_held, setup_limit_s, f"{n_dups} duplicates to be held",
                                interval=0.5)
            else:
                await _wait_for(lambda: upstream_holds(n_ops + n_dups), setup_limit_s,
                                f"{n_ops + n_dups} requests to reach the upstream")
            setup_s = time.monotonic() - t_setup
            cpu0 = cpu_seconds(p.pid)
            t0 = time.monotonic()
            rss_samples = []
            while time.monotonic() - t0 < cfg.hold_s:  # bounded by hold_s
                await asyncio.sleep(min(0.5, max(0.0, cfg.hold_s - (time.monotonic() - t0))))
                rss_samples.append(rss_bytes(p.pid))
            cpu1 = cpu_seconds(p.pid)
            hold_wall = time.monotonic() - t0
            st_before = await upstream_stats(up)
            await client.get_json(up.port, "/_bench/release", "POST")
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                t.cancel()
            results = [t.result() for t in done if not t.cancelled()]
            st = await upstream_stats(up)
            lat = []
            errors = [r for r in results if r.error is not None]
            for r in results:
                if r.error is None and r.tag[0] == "dup":
                    k, j = r.tag[1], r.tag[2]
                    ref = st["last_byte_by_id"].get(f"d{k}-{j}") or st["last_byte_by_op"][str(k)]
                    lat.append((r.t_done - ref) * 1000)
            ok = [r for r in results if r.error is None]
            rss_hold = max(rss_samples) if rss_samples else rss_bytes(p.pid)
            res = {
                "variant": variant,
                "operations": n_ops,
                "duplicates": n_dups,
                "answers": len(results),
                "errors": len(errors) + len(pending),
                "error_samples": [r.error for r in errors[:3]],
                "statuses": sorted({r.status for r in ok}),
                "upstream_dispatches": st["dispatches"],
                "upstream_held_during_hold": st_before["held"],
                # answered from the original's response: replayed, or attached to it live
                "replayed": sum(r.headers.get("x-turnguard") in ("replayed", "attached")
                                for r in ok),
                "setup_s": setup_s,
                "hold_s": hold_wall,
                "cpu_s_during_hold": cpu1 - cpu0,
                "cpu_s_per_10s_hold": (cpu1 - cpu0) * 10 / hold_wall,
                "rss_before_mib": rss0 / 2**20,
                "rss_during_hold_mib": rss_hold / 2**20,
                "rss_per_held_flow_kib": (rss_hold - rss0) / n_dups / 1024,
                "answer_after_completion_p50_ms": percentile(lat, 50),
                "answer_after_completion_p99_ms": percentile(lat, 99),
                "answer_after_completion_max_ms": max(lat) if lat else float("nan"),
                # the burst: answers per second from the release to the last answer, a floor
                # that mitmproxy's per-response cost sets for any proxy answering n at once
                "burst_answers_per_s": n_dups / (max(lat) / 1000) if lat and max(lat) > 0 else float("nan"),
            }
            out[variant] = res
            log(f"holds {variant:<10} rep {rep + 1}: {n_dups} held in {setup_s:.1f} s; "
                f"cpu {res['cpu_s_per_10s_hold']:.3f} s/10 s, "
                f"{res['rss_per_held_flow_kib']:.1f} KiB/flow; answers after completion "
                f"p50 {res['answer_after_completion_p50_ms']:.1f} ms, "
                f"p99 {res['answer_after_completion_p99_ms']:.1f} ms, "
                f"max {res['answer_after_completion_max_ms']:.1f} ms; "
                f"upstream dispatches {st['dispatches']}")
            p.stop()
    finally:
        for p in ms.values():
            p.stop()
        up.stop()
    return out


async def holds(cfg, workdir: Path) -> dict:
    reps = [await holds_once(cfg, workdir, rep) for rep in range(cfg.holds_repeats)]
    keys = ("cpu_s_per_10s_hold", "rss_per_held_flow_kib", "answer_after_completion_p50_ms",
            "answer_after_completion_p99_ms", "answer_after_completion_max_ms",
            "rss_before_mib", "rss_during_hold_mib", "setup_s", "burst_answers_per_s")
    out: dict = {"variants": {}}
    for v in ("plain", "turnguard"):
        vr = [r[v] for r in reps if v in r]
        if vr:
            out["variants"][v] = {k: median(r[k] for r in vr) for k in keys}
            out["variants"][v]["reps"] = vr
    tg = [r["turnguard"] for r in reps if "turnguard" in r]
    pl = [r["plain"] for r in reps if "plain" in r]
    out["checks"] = {
        "runs": len(tg) + len(pl),
        "all_answered": all(r["answers"] == r["operations"] + r["duplicates"] and r["errors"] == 0
                            for r in tg + pl),
        "all_200": all(r["statuses"] == [200] for r in tg + pl),
        "turnguard_one_dispatch_per_operation": all(r["upstream_dispatches"] == r["operations"] for r in tg),
        "turnguard_all_duplicates_replayed": all(r["replayed"] == r["duplicates"] for r in tg),
    }
    if tg and pl:
        a, b = out["variants"]["turnguard"], out["variants"]["plain"]
        out["turnguard_vs_plain"] = {
            "p50_ratio": ratio(a["answer_after_completion_p50_ms"], b["answer_after_completion_p50_ms"]),
            "p99_ratio": ratio(a["answer_after_completion_p99_ms"], b["answer_after_completion_p99_ms"]),
            "cpu_ratio": ratio(a["cpu_s_per_10s_hold"], b["cpu_s_per_10s_hold"]),
            "rss_per_flow_ratio": ratio(a["rss_per_held_flow_kib"], b["rss_per_held_flow_kib"]),
        }
    return out


# -- 6. soak ---------------------------------------------------------------------------------
async def soak(cfg, workdir: Path, up: procs.Proc) -> dict:
    # a short replay window, so that recordings are purged during the soak as they would be
    # over hours with the default one: the ledger keeps what a request leaves after its window
    specs = {"soak-turnguard": ("turnguard", {"turnguard_replay_window_ms": SOAK_WINDOW_MS})}
    if cfg.soak_baseline:
        specs["soak-plain"] = ("plain", {})
    ms = procs.start_mitmdumps(workdir, up.url, specs)
    out: dict = {"variants": {}}
    try:
        for name, p in ms.items():
            variant = p.extra["variant"]
            ledger = Path(p.extra["options"].get("turnguard_ledger", "/nonexistent"))
            nonce = f"soak-{uuid.uuid4().hex[:8]}"
            points = []
            done = 0
            errors = 0
            statuses: set[int] = set()
            t0 = time.monotonic()
            for target in cfg.soak_checkpoints:
                n = target - done
                start = done
                load = await client.run_load(
                    p.port, lambda i, start=start: model_request(nonce, start + i, session=f"s{(start + i) % 64}"),
                    n, cfg.soak_concurrency, time_limit_s=max(cfg.load_time_limit_s, n / 20),
                    request_timeout_s=cfg.request_timeout_s,
                )
                done += len(load.results)
                errors += load.errors
                statuses |= {r.status for r in load.results if r.error is None}
                await asyncio.sleep(0.5)
                pt = {
                    "requests": done,
                    "rss_mib": rss_bytes(p.pid) / 2**20,
                    "cpu_s": cpu_seconds(p.pid),
                    "elapsed_s": time.monotonic() - t0,
                    "rps": len(load.results) / load.wall_s if load.wall_s else 0.0,
                }
                if variant == "turnguard":
                    pt["ledger_bytes"] = procs.ledger_size(ledger)
                points.append(pt)
                log(f"soak {variant:<10} {done:>7} requests: rss {pt['rss_mib']:.1f} MiB"
                    + (f", ledger {pt['ledger_bytes']['total'] / 2**20:.1f} MiB" if "ledger_bytes" in pt else "")
                    + f", {pt['rps']:.0f} req/s")
            after_window = None
            if variant == "turnguard":  # past the window and its purge: what stays
                await asyncio.sleep(SOAK_WINDOW_MS / 1000 * 1.5 + 2.5)
                after_window = procs.ledger_size(ledger)
            first, last = points[0], points[-1]
            res = {
                "points": points,
                "requests": done,
                "requested": cfg.soak_checkpoints[-1],
                "errors": errors,
                "statuses": sorted(statuses),
                "rss_first_mib": first["rss_mib"],
                "rss_last_mib": last["rss_mib"],
                "first_at": first["requests"],
                "last_at": last["requests"],
                "rss_growth_pct": (last["rss_mib"] - first["rss_mib"]) / first["rss_mib"] * 100,
            }
            if variant == "turnguard":
                res["ledger_bytes_first"] = first["ledger_bytes"]["total"]
                res["ledger_bytes_last"] = last["ledger_bytes"]["total"]
                res["ledger_bytes_per_request"] = last["ledger_bytes"]["total"] / max(1, done)
                res["ledger_bytes_after_window"] = after_window["total"]
                res["ledger_bytes_per_request_after_window"] = after_window["total"] / max(1, done)
                res["replay_window_ms"] = SOAK_WINDOW_MS
                res["retention_ms"] = 86400000
            out["variants"][variant] = res
            p.stop()
    finally:
        for p in ms.values():
            p.stop()
    vs = out["variants"]
    out["checks"] = {
        "all_answered": all(r["requests"] == r["requested"] and r["errors"] == 0 for r in vs.values()),
        "all_200": all(r["statuses"] == [200] for r in vs.values()),
    }
    return out


def dump(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=str))
