"""Ledger benchmarks: atomic claims per second from 1 and 4 processes, and the exactly-once
check (N identical identities admitted concurrently by 4 processes: exactly one Dispatch each),
on the SQLite ledger and on the PostgreSQL one; the scale curve of the SQLite ledger (size per
operation and admission time after 10k, 100k, 1M operations); and, on PostgreSQL, how soon a
duplicate held on another mitmdump process is answered after the original's end (woken by
LISTEN/NOTIFY).

Uses ``turnguard_core.ledger.Ledger`` (or ``pg_ledger.PgLedger``) directly, as the addon does:
``admit()`` with a circuit scope (so the circuit row is read inside the claim's transaction).
Identities are made with ``identity.identify`` from realistic requests before the clock starts;
only ``admit`` is timed. Workers are separate processes (multiprocessing, spawn) that start
together on a barrier. The PostgreSQL server is ``$TURNGUARD_BENCH_PG`` (a database is made on
it) or a throwaway one (``tests/pg_server.py``) on loopback; without one, that part says why it
was skipped.
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


def _ledger_class(location: str):
    if location.startswith("postgresql://"):
        from turnguard_core.pg_ledger import PgLedger

        return PgLedger
    from turnguard_core.ledger import Ledger

    return Ledger


def _worker(ledger_path: str, nonce: str, start: int, n: int, barrier, queue) -> None:
    from turnguard_core import policy
    from turnguard_core.ledger import LedgerError

    Ledger = _ledger_class(ledger_path)

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
    led = _ledger_class(str(ledger_path))(str(ledger_path), "bench-setup")
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


def claims_per_second(workdir: Path, processes: int, per_process: int, tag: str,
                      location: str | None = None) -> dict:
    """``processes`` workers each admit ``per_process`` distinct identities on one ledger
    (``location``: a PostgreSQL URL; default: an SQLite file in ``workdir``)."""
    path = location or workdir / f"ledger-claims-{tag}.sqlite3"
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


def _read(location, sql: str) -> list[tuple]:
    if str(location).startswith("postgresql://"):
        import psycopg

        with psycopg.connect(str(location), autocommit=True) as db:
            return db.execute(sql).fetchall()
    with sqlite3.connect(f"file:{location}?mode=ro", uri=True) as db:
        return db.execute(sql).fetchall()


def exactly_once(workdir: Path, n: int, processes: int = 4, location: str | None = None) -> dict:
    """Every worker admits the same ``n`` identities, in the same order, at the same time."""
    path = location or workdir / "ledger-exactly-once.sqlite3"
    nonce = uuid.uuid4().hex[:8]
    res = _run(path, [(nonce, 0, n)] * processes)
    per_op = Counter(op for r in res for op in r["dispatched"])
    attempts = dict(_read(path, "SELECT op_key, COUNT(*) FROM attempts GROUP BY op_key"))
    ops = _read(path, "SELECT COUNT(*) FROM operations")[0][0]
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
            "scale": scale, "wal_pages": wal_pages(workdir), "postgres": run_postgres(workdir, cfg)}


WAL_FRAME_HEADER = 24  # bytes before each page in a WAL file (SQLite's file format)
WAL_HEADER = 32  # bytes before the first frame


def wal_pages(workdir: Path, n: int = 200) -> dict:
    """Pages each transaction writes to the WAL: turnguard's ledger (``Ledger.admit`` of a
    new operation, its ``first_event``, its ``finish`` with an 8-event SSE recording, each
    its own transaction) against the ledger floor's claim and end
    (``ledger_floor_addon``), ``n`` operations each. What a commit costs grows with its
    pages (each is written to the WAL with a checksum): this says how many more a
    turnguard request writes than what any at-most-once guard must. Counted from the WAL's
    growth with checkpoints off (the file only grows), means over ``n``. ``by_btree``: the
    same pages of turnguard's transactions split by the table or index each belongs to (the
    page number in each frame's header, named by SQLite's ``dbstat``; page 1, the file's
    header, is ``sqlite_schema``), over the last half of the operations (the tables no longer
    empty); absent when this SQLite lacks ``dbstat``."""
    from turnguard_bench import ledger_floor_addon, upstream
    from turnguard_core import policy
    from turnguard_core.ledger import AttemptEnd, Ledger, Recording

    body = b"".join(upstream.events_body(8))
    end = AttemptEnd("completed", 200, 8, None, Recording(
        200, (("content-type", "text/event-stream"),), body))
    guard = policy.GuardPolicy(replay=True, replay_window_s=60.0, retention_s=86400.0)
    idents = make_identities(f"wal-{uuid.uuid4().hex[:8]}", 0, n)
    grown = {"claim": 0, "first_event": 0, "finish": 0}
    floor_grown = {"claim": 0, "end": 0}

    spans: list[tuple[str, int, int]] = []  # (part, WAL offset before, after)

    def grew(wal: Path, totals: dict, part: str, write) -> object:
        before = wal.stat().st_size if wal.exists() else 0
        result = write()
        after = wal.stat().st_size
        totals[part] += after - before
        if totals is grown:
            spans.append((part, before, after))
        return result

    path = workdir / "ledger-wal-pages.sqlite3"
    led = Ledger(str(path), "bench-wal", checkpoint_on_commit=False)
    led.open(time.time())
    db = led._conn()
    page = db.execute("PRAGMA page_size").fetchone()[0] + WAL_FRAME_HEADER
    db.execute("PRAGMA wal_autocheckpoint=0")
    wal = Path(f"{path}-wal")
    for ident, scope in idents:  # bounded by n
        claim = grew(wal, grown, "claim", lambda: led.admit(
            ident, method="POST", path=PATH, now=time.time(), guard=guard, flow_id="bench",
            circuit_scope=scope))
        grew(wal, grown, "first_event", lambda: led.first_event(claim.attempt_id, ident.op_key))
        grew(wal, grown, "finish", lambda: led.finish(claim.attempt_id, end, now=time.time(),
                                                      op_key=ident.op_key))
    by_btree = _pages_by_btree(db, wal, page, spans[len(spans) // 2:])
    led.close()
    floor_path = workdir / "ledger-floor-wal-pages.sqlite3"
    floor = ledger_floor_addon.open_db(str(floor_path))
    floor.execute("PRAGMA wal_autocheckpoint=0")
    wal = Path(f"{floor_path}-wal")
    for ident, _ in idents:  # bounded by n
        grew(wal, floor_grown, "claim",
             lambda: ledger_floor_addon.claim(floor, ident.op_key, time.time()))
        grew(wal, floor_grown, "end",
             lambda: ledger_floor_addon.end(floor, ident.op_key, 200, body, time.time()))
    floor.close()
    return {"operations": n,
            "turnguard": {k: v / n / page for k, v in grown.items()},
            "ledger_floor": {k: v / n / page for k, v in floor_grown.items()},
            **({"by_btree": by_btree} if by_btree is not None else {})}


def _pages_by_btree(db, wal: Path, frame_size: int,
                    spans: list[tuple[str, int, int]]) -> dict | None:
    """For each part (claim, first_event, finish), the pages a transaction wrote by the
    b-tree they belong to, means over the operations ``spans`` cover."""
    import sqlite3
    import struct
    from collections import Counter

    try:
        names = {pageno: name for name, pageno in db.execute("SELECT name, pageno FROM dbstat")}
    except sqlite3.Error:  # (SQLite built without SQLITE_ENABLE_DBSTAT_VTAB)
        return None
    data = wal.read_bytes()
    counts: dict[str, Counter] = {}
    for part, before, after in spans:
        c = counts.setdefault(part, Counter())
        for at in range(max(before, WAL_HEADER), after, frame_size):
            pageno = struct.unpack(">I", data[at:at + 4])[0]
            c[names.get(pageno, "sqlite_schema" if pageno == 1 else "other")] += 1
    ops = max(1, sum(1 for part, _, _ in spans if part == "claim"))
    return {part: {name: round(k / ops, 2) for name, k in c.most_common()}
            for part, c in counts.items()}


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


# -- PostgreSQL ------------------------------------------------------------------------------------
def _database(server_url: str) -> str:
    """A new database on the server (its URL)."""
    import psycopg

    name = "tg_bench_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server_url, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    url = server_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(url, autocommit=True) as db:
        try:  # to count the snapshot reads (polls); the server may not preload it
            db.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        except psycopg.Error:
            pass
    return url


def run_postgres(workdir: Path, cfg) -> dict:
    """Claims/s, exactly once and the wake-up of held duplicates, on a PostgreSQL ledger."""
    import os
    import sys

    from turnguard_bench import REPO

    server = None
    url = os.environ.get("TURNGUARD_BENCH_PG")
    if not url:
        sys.path.insert(0, str(REPO / "tests"))
        from pg_server import PgServer, PgUnavailable

        try:
            server = PgServer().start()
        except (PgUnavailable, OSError) as e:
            return {"skipped": f"no PostgreSQL server: {e}"}
        url = server.url
    try:
        res = {
            "claims_1_process": claims_per_second(workdir, 1, cfg.ledger_claims_1, "pg1",
                                                  _database(url)),
            "claims_4_processes": claims_per_second(workdir, 4, cfg.ledger_claims_4, "pg4",
                                                    _database(url)),
            "exactly_once": exactly_once(workdir, cfg.exactly_once_n, location=_database(url)),
        }
        res["wake"] = wake_latency(workdir, _database(url), cfg.wake_trials)
        return res
    finally:
        if server is not None:
            server.destroy()


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, float]:
    """One POST on a fresh connection: (status, body, monotonic time of its last byte)."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", PATH, body=body, headers={"content-type": "application/json",
                                                       "authorization": "Bearer sk-bench",
                                                       **headers})
        r = conn.getresponse()
        data = r.read()
        return r.status, data, time.monotonic()
    finally:
        conn.close()


def _get_json(url: str, path: str, method: str = "GET") -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url + path, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _snapshot_reads(location: str) -> int | None:
    """Snapshot reads (what a poll runs) in the database so far; None: cannot be counted."""
    try:
        return _snapshot_count(location)
    except Exception:  # noqa: BLE001 - pg_stat_statements not loaded
        return None


def _snapshot_count(location: str) -> int:
    return int(_read(location, "SELECT COALESCE(SUM(s.calls), 0) FROM pg_stat_statements s JOIN"
                               " pg_database d ON d.oid = s.dbid WHERE d.datname ="
                               " current_database() AND s.query LIKE"
                               " 'SELECT o.state, o.fingerprint, o.current_attempt%'")[0][0])


def wake_latency(workdir: Path, location: str, trials: int) -> dict:
    """Two mitmdumps (A, B) on one PostgreSQL ledger, in front of the bench upstream. Each
    trial: an original via A that the upstream holds; a duplicate via B, held by B on A's
    attempt; then the upstream releases the original. Measured: from the original's last byte
    at its client to the duplicate's last byte at its own (both on this machine's monotonic
    clock), and the snapshot reads (polls) of every process while the duplicates were held."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from turnguard_bench import procs, stats

    up = procs.start_upstream(workdir, "wake-upstream")
    events = {n: workdir / f"wake-{n}-events.jsonl" for n in ("a", "b")}
    mitm = procs.start_mitmdumps(workdir, up.url, {
        n: ("turnguard", {"turnguard_ledger": location, "turnguard_events": str(events[n])})
        for n in ("a", "b")})
    gaps, polls, answers = [], 0, []
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            for t in range(trials):  # bounded by trials
                body = json.dumps({"model": "bench", "input": f"wake {uuid.uuid4().hex} {t}",
                                   "stream": True}).encode()
                held_before = events["b"].read_text().count("duplicate_held") if events["b"].exists() else 0
                original = pool.submit(_post, mitm["a"].url, body, {"x-bench-hold": "1"})
                _until(lambda: _get_json(up.url, "/_bench/stats")["held"] == 1, "original held")
                duplicate = pool.submit(_post, mitm["b"].url, body, {})
                _until(lambda: events["b"].read_text().count("duplicate_held") > held_before,
                       "duplicate held")
                reads = _snapshot_reads(location)
                time.sleep(0.05)
                after = _snapshot_reads(location)
                polls = None if polls is None or reads is None else polls + after - reads
                _get_json(up.url, "/_bench/release", "POST")
                (s1, b1, t1), (s2, b2, t2) = original.result(60), duplicate.result(60)
                answers.append((s1, s2, b1 == b2))
                gaps.append((t2 - t1) * 1000)
    finally:
        for p in mitm.values():
            p.stop()
        up.stop()
    ok = all(a == (200, 200, True) for a in answers)
    return {"trials": trials, "p50_ms": stats.percentile(gaps, 50) if gaps else None,
            "p99_ms": stats.percentile(gaps, 99) if gaps else None,
            "max_ms": max(gaps, default=None), "polls_while_held": polls,
            "replayed_byte_identical": ok}


def _until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # bounded by the deadline
        if time.monotonic() > deadline:
            raise RuntimeError(f"wake-up benchmark: timed out waiting for {what}")
        time.sleep(0.005)
