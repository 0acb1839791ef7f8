"""In-process micro-benchmarks of turnguard's per-request work, outside mitmproxy.

They price each piece the addon runs per guarded request (identity hashing, the ledger's
admit / first_event / finish transactions, telemetry JSON + logging, the SSE tee), so a profile's
shares can be checked against absolute microseconds. Each figure is the median of 5 runs.
"""

from __future__ import annotations

import email.parser
import hashlib
import io
import json
import logging
import re
import statistics
import time
import uuid
import zlib
from pathlib import Path

from turnguard_bench import upstream

PATH = "/v1/responses"


def _best(fn, n: int, runs: int = 5) -> float:
    """Median seconds per call of ``fn(i)`` over ``runs`` runs of ``n`` calls."""
    per = []
    for r in range(runs):
        t0 = time.perf_counter()
        for i in range(n):
            fn(r * n + i)
        per.append((time.perf_counter() - t0) / n)
    return statistics.median(per)


_OTHER_OBJECT = {f"k{i}": [i, "v" * (i % 17), {"x": i}] for i in range(300)}
_OTHER_TEXT = "GET /a/b?c=d HTTP/1.1\r\nHost: x\r\n" * 40


def _other_work() -> None:
    """Work of other code between two calls, as a proxy runs its own between two requests'
    hooks: JSON, a regular expression, zlib, an email header parse (about 0.5 ms here)."""
    for _ in range(3):
        json.loads(json.dumps(_OTHER_OBJECT))
        re.findall(r"(\w+)=(\w+)", _OTHER_TEXT)
        zlib.compress(_OTHER_TEXT.encode() * 20)
        email.parser.Parser().parsestr("A: b\nC: d\n\nbody")


def _timed_between_other_work(fn, n: int, runs: int = 5) -> float:
    """Median seconds per call of ``fn(i)``, timed alone, with ``_other_work`` run before
    each call: what the call costs once other code has had the caches (``_best`` times calls
    that run back to back, each finding the last one's code and data still cached)."""
    per = []
    for r in range(runs):
        spent = 0.0
        for i in range(n):
            _other_work()
            t0 = time.perf_counter()
            fn(r * n + i)
            spent += time.perf_counter() - t0
        per.append(spent / n)
    return statistics.median(per)


def _headers(session: str = "bench-micro"):
    meta = json.dumps({"session_id": session, "thread_id": "t1", "turn_id": "u1"})
    return (
        ("host", "bench"),
        ("content-type", "application/json"),
        ("accept", "text/event-stream"),
        ("authorization", "Bearer sk-bench-0123456789abcdef0123456789abcdef"),
        ("session-id", session),
        ("x-codex-turn-metadata", meta),
        ("originator", "codex_cli_rs"),
        ("user-agent", "bench/1.0"),
    )


def _body(i: int, size: int) -> bytes:
    pad = "x" * max(0, size - 80)
    return json.dumps({"model": "bench", "input": f"micro-{i}", "stream": True,
                       "instructions": pad}).encode()


def identity_us(scale: int) -> dict:
    from turnguard_core import identity

    out = {}
    for size in (200, 50_000):
        bodies = [_body(i, size) for i in range(64)]
        h = _headers()

        def one(i):
            identity.identify(identity.RequestView("POST", PATH, h, bodies[i % 64]))

        n = max(50, (2000 if size < 1000 else 100) * scale)
        out[f"identify_{size}B_body_us"] = _best(one, n) * 1e6
    return out


def large_identity_ms() -> dict:
    """Identity of large bodies: a realistic 10 MiB one (a long Codex history: messages of a
    few KB each) inline and through the worker process the addon sends bodies over 256 KiB to
    (``offload``), and the worst inline case, a 256 KiB body of tiny objects."""
    import asyncio

    from turnguard_core import identity
    from turnguard_core.offload import INLINE_MAX_BYTES, IdentityWorker

    items, size = [], 0
    while size < 10 * 2**20:
        item = {"type": "message", "role": "user", "id": f"msg_{len(items)}",
                "content": [{"type": "input_text", "text": f"{len(items)} " + "words " * 500}]}
        items.append(item)
        size += len(json.dumps(item))
    big = identity.RequestView("POST", PATH, _headers(), json.dumps({"model": "m", "input": items}).encode())
    hostile_body = '{"input":[' + ",".join('{"a":1}' for _ in range(INLINE_MAX_BYTES // 8)) + "]}"
    hostile = identity.RequestView("POST", PATH, _headers(), hostile_body.encode()[:INLINE_MAX_BYTES])
    out = {"identify_10MiB_body_inline_ms": _best(lambda i: identity.identify(big), 1, 5) * 1e3,
           "identify_hostile_256KiB_inline_ms": _best(lambda i: identity.identify(hostile), 1, 5) * 1e3}
    worker = IdentityWorker()

    async def offloaded() -> float:
        await worker.identify(big, timeout_s=60)  # starts the worker
        per = []
        for _ in range(5):
            t0 = time.perf_counter()
            await worker.identify(big, timeout_s=60)
            per.append(time.perf_counter() - t0)
        return statistics.median(per)

    try:
        out["identify_10MiB_body_worker_ms"] = asyncio.run(offloaded()) * 1e3
    finally:
        worker.close()
    return out


def sse_tee(scale: int) -> dict:
    from turnguard_core.sse import SseParser
    from turnguard_core.tee import ResponseTee

    frames = upstream.events_body(10_000)
    stream = b"".join(frames)
    big_chunks = [stream[i : i + 65536] for i in range(0, len(stream), 65536)]
    out = {}
    runs = max(1, scale // 5) + 2

    def parse(chunks):
        p = SseParser()
        for c in chunks:
            p.feed(c)
        p.close()
        assert p.events_seen == 10_000, p.events_seen

    def tee(chunks):
        t = ResponseTee(counts_events=True, keep_max_bytes=64 * 1024 * 1024, on_first_event=None)
        for c in chunks:
            t(c)
        t(b"")
        assert t.events_seen == 10_000 and t.body is not None

    for name, fn in (("sse_parser", parse), ("tee", tee)):
        for cname, chunks in (("event_chunks", frames), ("64KiB_chunks", big_chunks)):
            t = _best(lambda _i: fn(chunks), 1, runs)
            out[f"{name}_{cname}_events_per_s"] = 10_000 / t
    return out


def telemetry_us(scale: int, workdir: Path) -> dict:
    """``Telemetry.emit`` as the addon calls it: JSON + ``logging`` (a handler formatting to an
    in-memory text stream, like mitmdump's termlog printing to its stdout)."""
    from turnguard_core.telemetry import Telemetry

    logger = logging.getLogger("turnguard")
    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s"))
    old_level, old_handlers, old_prop = logger.level, logger.handlers[:], logger.propagate
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    out = {}
    try:
        fields = dict(op="c247dbc62f1c", flow=str(uuid.uuid4()), session="e8bc163c82eee187",
                      attempt=3000, kind="original", outcome="completed", events_seen=8,
                      status=200, duration_ms=25, replayable=True, detail=None,
                      fenced_out=False, not_replayable_reason=None)
        n = 2000 * scale
        t = Telemetry(None)

        def emit(i):
            t.emit("outcome", **fields)
            if i % 1000 == 0:
                sink.seek(0)
                sink.truncate()

        out["telemetry_emit_log_only_us"] = _best(emit, n) * 1e6
        f = Telemetry(str(workdir / "micro-events.jsonl"))
        out["telemetry_emit_log_and_file_us"] = _best(
            lambda i: (f.emit("outcome", **fields), i % 1000 or sink.truncate(0)), n
        ) * 1e6
        f.close()
        logger.setLevel(logging.WARNING)  # what -q / termlog_verbosity=warn gives
        out["telemetry_emit_logging_filtered_us"] = _best(lambda i: t.emit("outcome", **fields), n) * 1e6
        out["json_dumps_only_us"] = _best(
            lambda i: json.dumps({"ts": 1.0, "event": "outcome", **fields},
                                 separators=(",", ":"), default=str), n) * 1e6
    finally:
        logger.handlers, logger.propagate = old_handlers, old_prop
        logger.setLevel(old_level)
    return out


def ledger_us(scale: int, workdir: Path) -> dict:
    """The three write transactions of one guarded request, on a file ledger (WAL)."""
    from turnguard_core import circuit, identity, policy
    from turnguard_core.ledger import AttemptEnd, Ledger, Recording

    led = Ledger(str(workdir / f"micro-ledger-{uuid.uuid4().hex[:6]}.sqlite3"), "micro")
    led.open(time.time())
    n = 500 * scale
    h = _headers()
    idents = []
    for i in range(n * 6 + 10):  # 5n timed back to back, 10 for the large end, n cold
        ident = identity.identify(identity.RequestView("POST", PATH, h, _body(i, 200)))
        idents.append((ident, circuit.circuit_scope(ident.session, ident.scope, PATH)))
    guard = policy.GuardPolicy()
    cfg = circuit.CircuitConfig()
    body = b"".join(upstream.events_body(8))
    rec = Recording(200, (("content-type", "text/event-stream"), ("x-request-id", "r")), body)
    attempts: list[int] = []

    def admit(i):
        ident, scope = idents[i]
        d = led.admit(ident, method="POST", path=PATH, now=time.time(), guard=guard,
                      flow_id="f", circuit_scope=scope)
        attempts.append(d.attempt_id)

    out = {"ledger_admit_us": _best(admit, n) * 1e6}

    def admit_cold(i):
        ident, scope = idents[n * 5 + 10 + i]
        led.admit(ident, method="POST", path=PATH, now=time.time(), guard=guard,
                  flow_id="f", circuit_scope=scope)

    out["ledger_admit_between_other_work_us"] = _timed_between_other_work(
        admit_cold, n // 5) * 1e6
    out["ledger_first_event_us"] = _best(lambda i: led.first_event(attempts[i]), n) * 1e6
    out["ledger_finish_completed_1.8KiB_us"] = _best(
        lambda i: led.finish(attempts[i], AttemptEnd("completed", 200, 8, None, rec),
                             now=time.time(), circuit_cfg=cfg, eventless_failure=False), n) * 1e6
    out["ledger_claim_session_renew_us"] = _best(
        lambda i: led.claim_session("sess", now=time.time(), lease_s=300, new_id="d"), n) * 1e6
    out["ledger_recording_1.8KiB_us"] = _best(lambda i: led.recording(attempts[i]), n) * 1e6
    # the recording of the streaming phase's 10,000-event response: one transaction that a
    # claim made meanwhile waits behind
    big = b"".join(upstream.events_body(10_000))
    big_rec = Recording(200, rec.headers, big)
    fresh = [led.admit(idents[i][0], method="POST", path=PATH, now=time.time(), guard=guard,
                       flow_id="f", circuit_scope=idents[i][1]).attempt_id
             for i in range(n * 5, n * 5 + 10)]
    out["ledger_finish_completed_10000_events_ms"] = _best(
        lambda i: led.finish(fresh[i], AttemptEnd("completed", 200, 10_000, None, big_rec),
                             now=time.time(), circuit_cfg=cfg, eventless_failure=False),
        2, runs=5) * 1e3
    led.close()

    # The same claim and end as the bench's ledger_floor variant writes them: what any guard
    # must commit, against the figures above (turnguard's records, indexes and checks).
    from turnguard_bench import ledger_floor_addon as floor

    db = floor.open_db(str(workdir / f"micro-floor-{uuid.uuid4().hex[:6]}.sqlite3"))
    keys = [hashlib.sha256(_body(i, 200)).hexdigest() for i in range(n * 6 + 10)]
    out["ledger_floor_claim_us"] = _best(lambda i: floor.claim(db, keys[i], time.time()), n) * 1e6
    out["ledger_floor_claim_between_other_work_us"] = _timed_between_other_work(
        lambda i: floor.claim(db, keys[n * 5 + 10 + i], time.time()), n // 5) * 1e6
    out["ledger_floor_end_1.8KiB_us"] = _best(
        lambda i: floor.end(db, keys[i], 200, body, time.time()), n) * 1e6
    db.close()
    return out


def run(workdir: Path, cfg) -> dict:
    out: dict = {}
    out.update(identity_us(cfg.micro_scale))
    out.update(large_identity_ms())
    out.update(ledger_us(cfg.micro_scale, workdir))
    out.update(telemetry_us(cfg.micro_scale, workdir))
    out.update(sse_tee(cfg.micro_scale))
    # What one guarded short-stream request costs turnguard, from the parts above: identify,
    # admit, first_event, finish, about 2 telemetry lines (dispatch, outcome), the tee (8 events).
    out["estimated_core_us_per_request"] = (
        out["identify_200B_body_us"] + out["ledger_admit_us"] + out["ledger_first_event_us"]
        + out["ledger_finish_completed_1.8KiB_us"] + 2 * out["telemetry_emit_log_only_us"]
        + 8 * 1e6 / out["tee_event_chunks_events_per_s"]
    )
    return out
