"""Ledger benchmarks: atomic claims per second from 1 and 4 processes, the exactly-once
check (N identical identities admitted concurrently by 4 processes: exactly one Dispatch each)
and the scale curve (size per operation and admission time after 10k, 100k, 1M operations).

Uses ``turnguard_core.ledger.Ledger`` directly, as the addon does: ``admit()`` with a circuit
scope (so the circuit row is read inside the claim's transaction). Identities are made with
``identity.identify`` from realistic requests before the clock starts; only ``admit`` is timed.
Workers are separate processes (multiprocessing, spawn) that start together on a barrier.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import time
import uuid
from collections import Counter
from pathlib import Path

PATH = "/v1/responses"
JOIN_TIMEOUT_S = 120.0


def make_identities(nonce: str, start: int, n: int):
    from turnguard_core import circuit, identity

    headers = (
        ("content-type", "application/json"),
        ("authorization", "Bearer sk-bench"),
        ("session-id", "bench-ledger"),
    )
    out = []
    for i in range(start, start + n):
        body = b'{"model":"bench","input":"ledger-%s-%d","stream":true}' % (nonce.encode(), i)
        ident = identity.identify(identity.RequestView("POST", PATH, headers, body))
        out.append((ident, circuit.circuit_scope(ident.session, ident.scope, PATH)))
    return out


def _worker(ledger_path: str, nonce: str, start: int, n: int, barrier, queue) -> None:
    from turnguard_core import policy
    from turnguard_core.ledger import Ledger, LedgerError

    try:
        idents = make_identities(nonce, start, n)
        led = Ledger(ledger_path, uuid.uuid4().hex[:16])
        led.open(time.time())
        guard = policy.GuardPolicy()
        barrier.wait(60)
        kinds: Counter[str] = Counter()
        dispatched: list[str] = []
        errors = 0
        t0 = time.monotonic()
        for ident, scope in idents:  # bounded by n
            try:
                a = led.admit(ident, method="POST", path=PATH, now=time.time(), guard=guard,
                              flow_id=None, circuit_scope=scope)
            except LedgerError:
                errors += 1
                continue
            kinds[type(a).__name__] += 1
            if isinstance(a, policy.Dispatch):
                dispatched.append(ident.op_key)
        t1 = time.monotonic()
        led.close()
        queue.put({"t0": t0, "t1": t1, "n": n, "kinds": dict(kinds), "errors": errors,
                   "dispatched": dispatched})
    except Exception as e:  # noqa: BLE001 - reported to the parent
        queue.put({"error": f"{type(e).__name__}: {e}"})


def _create(ledger_path: Path) -> None:
    """Create the ledger file (schema) before the workers start: several processes opening a
    brand-new ledger at the same moment race in the schema migration (see the report)."""
    from turnguard_core.ledger import Ledger

    led = Ledger(str(ledger_path), "bench-setup")
    led.open(time.time())
    led.close()


def _run(ledger_path: Path, jobs: list[tuple[str, int, int]]) -> list[dict]:
    _create(ledger_path)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(jobs))
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(str(ledger_path), nonce, start, n, barrier, queue))
        for nonce, start, n in jobs
    ]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            results.append(queue.get(timeout=JOIN_TIMEOUT_S))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
    errs = [r["error"] for r in results if "error" in r]
    if errs:
        raise RuntimeError("ledger worker failed: " + "; ".join(errs))
    return results


def claims_per_second(workdir: Path, processes: int, per_process: int, tag: str) -> dict:
    """``processes`` workers each admit ``per_process`` distinct identities on one ledger."""
    path = workdir / f"ledger-claims-{tag}.sqlite3"
    nonce = uuid.uuid4().hex[:8]
    jobs = [(nonce, k * per_process, per_process) for k in range(processes)]
    res = _run(path, jobs)
    t0 = min(r["t0"] for r in res)
    t1 = max(r["t1"] for r in res)
    total = sum(r["kinds"].get("Dispatch", 0) for r in res)
    return {
        "processes": processes,
        "claims": total,
        "attempted": processes * per_process,
        "errors": sum(r["errors"] for r in res),
        "seconds": t1 - t0,
        "claims_per_s": total / (t1 - t0) if t1 > t0 else 0.0,
        "per_process_claims_per_s": [r["kinds"].get("Dispatch", 0) / (r["t1"] - r["t0"]) for r in res],
    }


def exactly_once(workdir: Path, n: int, processes: int = 4) -> dict:
    """Every worker admits the same ``n`` identities, in the same order, at the same time."""
    path = workdir / "ledger-exactly-once.sqlite3"
    nonce = uuid.uuid4().hex[:8]
    res = _run(path, [(nonce, 0, n)] * processes)
    per_op = Counter(op for r in res for op in r["dispatched"])
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        attempts = dict(db.execute("SELECT op_key, COUNT(*) FROM attempts GROUP BY op_key").fetchall())
        ops = db.execute("SELECT COUNT(*) FROM operations").fetchone()[0]
    kinds: Counter[str] = Counter()
    for r in res:
        kinds.update(r["kinds"])
    ok = (
        len(per_op) == n and all(v == 1 for v in per_op.values())
        and ops == n and len(attempts) == n and all(v == 1 for v in attempts.values())
        and sum(r["errors"] for r in res) == 0
    )
    return {
        "processes": processes,
        "identities": n,
        "admissions": processes * n,
        "dispatches": sum(per_op.values()),
        "operations_in_ledger": ops,
        "max_attempts_per_operation": max(attempts.values(), default=0),
        "max_dispatches_per_identity": max(per_op.values(), default=0),
        "identities_dispatched": len(per_op),
        "kinds": dict(kinds),
        "errors": sum(r["errors"] for r in res),
        "passed": ok,
    }


def run(workdir: Path, cfg) -> dict:
    one = claims_per_second(workdir, 1, cfg.ledger_claims_1, "1")
    four = claims_per_second(workdir, 4, cfg.ledger_claims_4, "4")
    once = exactly_once(workdir, cfg.exactly_once_n)
    scale = scale_curve(workdir, cfg.ledger_scale_points)
    return {"claims_1_process": one, "claims_4_processes": four, "exactly_once": once,
            "scale": scale}


def scale_curve(workdir: Path, points: list[int], *, window_s: float = 2.0,
                samples: int = 300) -> dict:
    """The ledger as it grows: after 10k, 100k, 1M operations (``points``), each one
    completed with an 8-event SSE recording, its size per operation and how long an admission
    takes. Operations end 1 ms apart (1,000 requests/s of simulated time) and, as the addon's
    ticker does, recordings past the replay window (``window_s``) are purged as the ledger
    fills; at each point the last ones are purged too, so the size is what a request leaves
    behind after the window. Admissions must stay flat (indexed lookups only): the median of
    ``samples`` admissions of new operations (a claim) and of completed ones (a replay, read
    without the write lock) at each point."""
    import dataclasses
    import hashlib
    import statistics

    from turnguard_bench import upstream
    from turnguard_core import policy
    from turnguard_core.ledger import AttemptEnd, Ledger, Recording

    path = workdir / "ledger-scale.sqlite3"
    led = Ledger(str(path), "bench-scale", checkpoint_on_commit=False)
    t = 1_000_000.0
    led.open(t)
    template, scope = make_identities("scale", 0, 1)[0]
    body = b"".join(upstream.events_body(8))
    rec = Recording(200, (("content-type", "text/event-stream"), ("cache-control", "no-cache"),
                          ("x-request-id", "req_bench")), body)
    end = AttemptEnd("completed", 200, 8, None, rec)
    guard = policy.GuardPolicy(replay=True, replay_window_s=window_s, retention_s=86400)
    made = 0

    def fresh(k: int):
        h = hashlib.sha256(b"scale-%d" % k).hexdigest()
        return dataclasses.replace(template, op_key=h, fingerprint=h[::-1])

    def fill(upto: int) -> None:
        nonlocal made, t
        while made < upto:  # bounded by upto
            with led.batch():
                for _ in range(min(1000, upto - made)):
                    t += 0.001
                    led.record_offline_attempt(fresh(made), method="POST", path=PATH,
                                               kind="original", flow_id=None,
                                               circuit_scope=scope, end=end, now=t)
                    made += 1
            led.purge_recordings(now=t, window_s=window_s)
            led.checkpoint()

    def median_us(fn) -> float:
        times = []
        for k in range(samples):
            t0 = time.perf_counter()
            fn(k)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    out = []
    for n in points:
        t0 = time.monotonic()
        fill(n)
        fill_s = time.monotonic() - t0
        t += window_s + 1
        purged = led.purge_recordings(now=t, window_s=window_s)
        led.checkpoint()
        db = led._conn()
        pages, free, page_size = (db.execute(f"PRAGMA {p}").fetchone()[0]
                                  for p in ("page_count", "freelist_count", "page_size"))
        sizes = {"file_bytes": os.path.getsize(path), "live_bytes": (pages - free) * page_size}
        fresh_ids = [fresh(10**9 + n + k) for k in range(samples)]
        claims: list[int] = []

        def claim(k):
            claims.append(led.admit(fresh_ids[k], method="POST", path=PATH, now=t, guard=guard,
                                    flow_id=None, circuit_scope=scope).attempt_id)

        admit_new = median_us(claim)
        with led.batch():
            for a in claims:
                led.finish(a, end, now=t)
        admit_replay = median_us(lambda k: led.admit(
            fresh_ids[k], method="POST", path=PATH, now=t + 0.5, guard=guard, flow_id=None,
            circuit_scope=scope))
        point = {"operations": n, "fill_s": fill_s, "purged_at_point": purged, **sizes,
                 "live_bytes_per_operation": sizes["live_bytes"] / n,
                 "file_bytes_per_operation": sizes["file_bytes"] / n,
                 "admit_new_us": admit_new, "admit_replay_us": admit_replay}
        out.append(point)
        print(f"[bench] ledger scale {n:>9,} operations: {point['live_bytes_per_operation']:.0f} "
              f"B/operation live ({point['file_bytes_per_operation']:.0f} in the file), admit "
              f"{admit_new:.0f} us new / {admit_replay:.0f} us replay (filled in {fill_s:.0f} s)",
              flush=True)
    led.close()
    first, last = out[0], out[-1]
    return {"window_s": window_s, "points": out,
            "admit_new_growth": last["admit_new_us"] / first["admit_new_us"],
            "admit_replay_growth": last["admit_replay_us"] / first["admit_replay_us"]}
