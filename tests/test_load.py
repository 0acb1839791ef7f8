"""Load: 1,000 concurrent clients through a real mitmdump + turnguard for a bounded time, 30% of
their requests duplicates of another client's operation, an upstream with random faults.

Counted: every client request gets exactly one answer (none left hanging); upstream dispatches
per operation stay within the mode's bound (never two in flight at once, nothing dispatched again
after a completed dispatch, at most one for an operation that never faults); zero tracebacks;
mitmdump's resident memory flat.

The clients are raw asyncio sockets, one keep-alive connection each, so that the test process
stays light next to mitmdump and the mock. The run lasts ``TURNGUARD_LOAD_SECONDS`` (40 by
default; the issue's figure is 60). Marked ``slow``."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field

import pytest

from harness import Mitmdump, MockUpstream, assert_no_traceback, read_jsonl, rss_kb

CLIENTS = 1000
SESSIONS = 200
DUPLICATE_SHARE = 0.30
RUN_S = float(os.environ.get("TURNGUARD_LOAD_SECONDS", "40"))
REQUEST_TIMEOUT_S = 90.0  # far above every bound turnguard may hold a request
DRAIN_S = 120.0

# (weight, behaviour): faults are ~30% of operations; every stall is short
BEHAVIOURS = [
    (40, {"kind": "ok", "events": 3}),
    (15, {"kind": "ok", "events": 5, "delay_ms": 300, "gap_ms": 20}),
    (10, {"kind": "slow", "delay_ms": 1500}),
    (6, {"kind": "reset"}),
    (5, {"kind": "status", "code": 500}),
    (3, {"kind": "status", "code": 503, "retry_after": 1}),
    (3, {"kind": "status", "code": 429, "retry_after": 1}),
    (6, {"kind": "partial", "events": 2}),
    (6, {"kind": "stall_before_headers", "ms": 400}),
    (6, {"kind": "stall_after_headers", "ms": 400}),
]
NEVER_FAULTS = {"ok", "slow"}


@dataclass
class Op:
    session: str
    body: bytes
    behaviour: dict
    sha: str = ""
    started: float = 0.0

    def __post_init__(self):
        self.sha = hashlib.sha256(self.body).hexdigest()


@dataclass
class Tally:
    started: int = 0
    answers: collections.Counter = field(default_factory=collections.Counter)
    by_op: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    duplicates: int = 0
    wrong: list = field(default_factory=list)  # (op kind, class) that break the rules


class Cut(Exception):
    """The connection ended before a whole response."""


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes, bool]:
    """One HTTP/1.1 response: (status, headers, body, connection reusable)."""
    line = await reader.readline()
    if not line:
        raise Cut("closed before a response")
    status = int(line.split()[1])
    headers: dict[str, str] = {}
    for _ in range(200):  # bounded
        h = await reader.readline()
        if h in (b"\r\n", b""):
            break
        k, _, v = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    body = b""
    try:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            for _ in range(1_000_000):  # bounded
                size = int((await reader.readline()).split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                body += chunk[:-2]
        elif "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        else:
            body = await reader.read()
            return status, headers, body, False
    except (asyncio.IncompleteReadError, ValueError, ConnectionError) as e:
        raise Cut(f"body cut after {len(body)} bytes: {e!r}") from e
    return status, headers, body, headers.get("connection", "").lower() != "close"


def classify(status: int, headers: dict, body: bytes) -> str:
    if status == 200:
        return "ok" if b"response.completed" in body else "incomplete_200"
    if "x-turnguard" in headers:
        return f"turnguard_{status}"
    return f"upstream_{status}"


class Client:
    def __init__(self, n: int, port: int, tally: Tally, recent: dict, ops: dict,
                 rng: random.Random):
        self.n, self.port, self.tally, self.recent, self.ops = n, port, tally, recent, ops
        self.rng = rng
        self.session = f"load-session-{n % SESSIONS}"
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.count = 0

    def pick(self) -> Op:
        pool = self.recent[self.session]
        now = time.monotonic()
        if pool and self.rng.random() < DUPLICATE_SHARE:
            # another client's operation: preferably one still in flight (held), else a
            # recent one (answered from its recording, or retried after a failure)
            fresh = [op for op in pool if now - op.started < 3.0]
            self.tally.duplicates += 1
            return self.rng.choice(fresh or pool)
        self.count += 1
        weights, behaviours = zip(*BEHAVIOURS)
        behaviour = self.rng.choices(behaviours, weights)[0]
        body = json.dumps({"model": "gpt-load", "input": f"{self.session} c{self.n} #{self.count}",
                           "stream": True}).encode()
        op = Op(self.session, body, behaviour, started=now)
        self.ops[op.sha] = op
        pool.append(op)
        del pool[:-8]
        return op

    def request_bytes(self, op: Op) -> bytes:
        head = (
            f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Authorization: Bearer sk-load\r\nsession-id: {op.session}\r\n"
            f"x-mock-behaviour: {json.dumps(op.behaviour)}\r\n"
            f"Content-Length: {len(op.body)}\r\n\r\n"
        )
        return head.encode() + op.body

    async def once(self, op: Op) -> str:
        if self.conn is None:
            self.conn = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.conn
        try:
            writer.write(self.request_bytes(op))
            await writer.drain()
            status, headers, body, reusable = await read_response(reader)
        except (Cut, ConnectionError) as e:
            self.close()
            return "cut" if isinstance(e, Cut) and "after" in str(e) else "closed"
        if not reusable:
            self.close()
        return classify(status, headers, body)

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None

    async def run(self, deadline: float) -> None:
        await asyncio.sleep(self.rng.random() * 2.0)  # stagger the 1,000 connects
        try:
            for _ in range(100_000):  # bounded by the deadline
                if time.monotonic() >= deadline:
                    return
                op = self.pick()
                self.tally.started += 1
                try:
                    answer = await asyncio.wait_for(self.once(op), REQUEST_TIMEOUT_S)
                except (TimeoutError, OSError) as e:
                    self.close()
                    answer = "timeout" if isinstance(e, TimeoutError) else "connect_error"
                self.tally.answers[answer] += 1
                self.tally.by_op[op.sha][answer] += 1
                if op.behaviour["kind"] in NEVER_FAULTS and answer not in (
                    "ok", "turnguard_409", "turnguard_503"
                ):
                    self.tally.wrong.append((op.behaviour["kind"], answer))
        finally:
            self.close()


async def drive(port: int, pid: int, seed: int) -> tuple[Tally, dict, list[tuple[float, int]]]:
    tally, recent, ops = Tally(), collections.defaultdict(list), {}
    rng = random.Random(seed)
    started = time.monotonic()
    deadline = started + RUN_S
    clients = [Client(i, port, tally, recent, ops, random.Random(rng.random()))
               for i in range(CLIENTS)]
    rss: list[tuple[float, int]] = []

    async def sample() -> None:
        for _ in range(10_000):  # bounded by cancellation at the end
            rss.append((time.monotonic() - started, rss_kb(pid)))
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    tasks = [asyncio.create_task(c.run(deadline)) for c in clients]
    done, pending = await asyncio.wait(tasks, timeout=RUN_S + DRAIN_S)
    for t in pending:
        t.cancel()
    sampler.cancel()
    tally.answers["left_hanging"] += len(pending)
    for t in done:
        if t.exception() is not None:
            tally.answers[f"client_crash {t.exception()!r}"] += 1
    return tally, ops, rss


def upstream_check(records: list[dict], ops: dict) -> tuple[dict, list[str]]:
    """Per body hash: overlaps of dispatches, dispatches after a completed one, and dispatch
    counts of operations whose behaviour never faults."""
    problems: list[str] = []
    open_: dict[str, list[dict]] = collections.defaultdict(list)  # sha -> dispatches in flight
    ended: dict[int, dict] = {}
    completed_at: dict[str, float] = {}
    count: collections.Counter = collections.Counter()
    by_n: dict[int, dict] = {}
    for r in records:
        if r.get("event") == "dispatch":
            sha = r["body_sha256"]
            op = ops.get(sha)
            if op is None:
                continue
            count[sha] += 1
            by_n[r["n"]] = r
            # a stall closes its connection by itself after ms: by then it has ended, even if its
            # dispatch_end record comes later (the mock logs it after awaiting the close)
            still = []
            for d in open_[sha]:
                b = ops[sha].behaviour
                closes_at = d["ts"] + b.get("ms", 0) / 1000 if b["kind"].startswith("stall") \
                    else None
                if closes_at is None or r["ts"] < closes_at:
                    still.append(d)
            open_[sha] = still
            if still:
                problems.append(f"overlap: dispatch n={r['n']} while n={still[0]['n']} of the same "
                                f"operation was in flight ({op.behaviour['kind']})")
            if sha in completed_at:
                problems.append(f"dispatch n={r['n']} after the operation completed upstream")
            open_[sha].append(r)
        elif r.get("event") == "dispatch_end" and r["n"] in by_n:
            d = by_n[r["n"]]
            sha = d["body_sha256"]
            open_[sha] = [x for x in open_[sha] if x["n"] != r["n"]]
            ended[r["n"]] = r
            if r.get("outcome") == "completed":
                completed_at[sha] = r["ts"]
    for sha, n in count.items():
        if ops[sha].behaviour["kind"] in NEVER_FAULTS and n > 1:
            problems.append(f"operation that never faults was dispatched {n} times")
    summary = {
        "dispatches": sum(count.values()),
        "operations_dispatched": len(count),
        "max_per_operation": max(count.values(), default=0),
    }
    return summary, problems


@pytest.mark.slow
def test_1000_clients_with_duplicates_and_faults(tmp_path, report):
    scenario = {"default": {"kind": "ok", "events": 3}}
    with MockUpstream(tmp_path, scenario) as up, Mitmdump(tmp_path, up.url, options={
        "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
        "turnguard_events": str(tmp_path / "events.jsonl"),
        "turnguard_hold_timeout_ms": 20000,
        "turnguard_cooldown_ms": 1000,
        "turnguard_cooldown_max_ms": 2000,
        "flow_detail": 0,
    }) as proxy:
        rss_start = rss_kb(proxy.pid)
        wall = time.monotonic()
        tally, ops, rss = asyncio.run(drive(proxy.port, proxy.pid, seed=6))
        wall = time.monotonic() - wall
        alive = proxy.proc.poll() is None
        log = proxy.log_text()
        records = up.records()
    summary, problems = upstream_check(records, ops)
    kinds = collections.Counter(e["event"] for e in read_jsonl(tmp_path / "events.jsonl"))
    summary.update({k: kinds[k] for k in ("duplicate_held", "duplicate_replayed",
                                           "duplicate_rejected", "circuit_opened")})
    answered = sum(n for k, n in tally.answers.items()
                   if k not in ("timeout", "left_hanging", "connect_error")
                   and not k.startswith("client_crash"))
    # memory: the first third of the run (after warm-up) against the last third
    third = max(1, len(rss) // 3)
    early = max(kb for _, kb in rss[third // 2: third] or rss[:1])
    late = max(kb for _, kb in rss[-third:])
    report(
        f"load: {CLIENTS} clients x {RUN_S:.0f} s (wall {wall:.0f} s): {tally.started} requests "
        f"({tally.duplicates} duplicates), {answered} answered "
        f"{dict(sorted(tally.answers.items()))}; upstream {summary}; "
        f"mitmdump RSS MB start={rss_start / 1024:.0f} early={early / 1024:.0f} "
        f"late={late / 1024:.0f}; problems={len(problems)}"
    )
    assert alive, "mitmdump died under load"
    assert tally.started > CLIENTS, "the run was too short to mean anything"
    assert answered == tally.started, tally.answers  # exactly one answer each, none hanging
    assert not tally.wrong, collections.Counter(tally.wrong).most_common(10)
    assert not problems, problems[:10]
    assert_no_traceback(log)
    assert late <= early * 1.5 + 100 * 1024, rss
