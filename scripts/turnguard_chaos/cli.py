"""``scripts/chaos``: a bounded, seeded chaos run against turnguard's promises.

Two guarded mitmdumps (A and B) share one SQLite ledger in front of the mock upstream. Each of
--ops turns is an original, held upstream for 0.2 to 4 s, and 1 to 3 identical duplicates
sent 0.05 to 3 s after it, each through A or B at random, on connections of their own. While
they run, a fault from --faults comes every 0.8 to 2.5 s. Then the run checks what the
Guarantees table promises under those faults, and prints one line per operation that broke a
check, and a summary; --json FILE writes it all. Everything runs on 127.0.0.1; the run is
bounded (every wait has a timeout, the faults stop with the traffic).

Checks (exit status 1 when one fails):
  answered    every request got a 200 whose event stream ends with response.completed
  one answer  the requests of an operation dispatched once all got the same response
  once here   no process dispatched an operation twice (each process coalesces what it knows)
  no trace    no Python traceback in either process's log; both still running
  ledger      PRAGMA integrity_check is ok, and no attempt is left in flight
Reported, not failed: operations dispatched upstream more than once whose requests were all
answered. While a fault keeps the ledger from being read or written (a lock, a file deleted or
replaced), each process coalesces only what it knows (README, "Processes and restarts"); with
--keep, the folder's A-events.jsonl and B-events.jsonl tell which process decided what.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from turnguard_procs import MITMDUMP_LINE, MOCK_LINE, Process, read_jsonl
from turnguard_repro import http1
from turnguard_repro.procs import ADDON, MOCK_UPSTREAM, mitmdump_path, option_args

FAULTS = ("stop", "lock", "rm_file", "rm_wal", "rm_shm", "rm_all", "mv_older", "reload")
FAULTS_HELP = {
    "stop": "SIGSTOP one process for 0.5-3 s, then SIGCONT",
    "lock": "another connection holds the ledger's write lock for 0.3-2 s",
    "rm_file": "delete the ledger file alone (its -wal and -shm left)",
    "rm_wal": "delete the ledger's -wal",
    "rm_shm": "delete the ledger's -shm",
    "rm_all": "delete the ledger and its -wal and -shm",
    "mv_older": "every other time: make a copy of the ledger; move it back over the ledger "
                "(its -wal and -shm left)",
    "reload": "touch turnguard's script: mitmproxy reloads it in both processes",
}
START_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 90.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/chaos", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n", 2)[2],
        epilog="faults:\n" + "\n".join(f"  {k:9} {v}" for k, v in FAULTS_HELP.items())
        + "\n\nexample:\n  scripts/chaos --seed 3 --ops 40 --faults lock,stop")
    p.add_argument("--seed", type=int, default=1, help="the run's random seed (default 1)")
    p.add_argument("--ops", type=int, default=30, help="operations (turns), 1-500 (default 30)")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help="comma-separated faults to draw from, or 'none' (default: all)")
    p.add_argument("--sessions", action="store_true",
                   help="send every request with a session-id (5 sessions) and one of 3 keys")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work folder and print it")
    args = p.parse_args(argv)
    if not 1 <= args.ops <= 500:
        p.error("--ops must be between 1 and 500")
    args.faults = [] if args.faults == "none" else args.faults.split(",")
    unknown = sorted(set(args.faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown fault(s): {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    return args


class Run:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.ledger = work / "ledger.sqlite3"
        self.script = work / "addon" / "turnguard.py"  # a copy: ``reload`` touches it
        self.procs: dict[str, Process] = {}
        self.urls: dict[str, str] = {}
        self.faults: list[tuple[float, str]] = []
        self.answers: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
        self.t0 = time.monotonic()

    def body(self, op: int) -> bytes:
        return json.dumps({"model": "m", "input": f"chaos {self.args.seed} op {op}",
                           "stream": True}).encode()

    async def start(self) -> None:
        shutil.copytree(ADDON.parent, self.script.parent,
                        ignore=shutil.ignore_patterns("__pycache__"))
        mock = Process([sys.executable, "-u", str(MOCK_UPSTREAM), "--host", "127.0.0.1", "--port", "0", "--log",
                        str(self.work / "upstream.jsonl")], self.work / "upstream.out",
                       new_session=True)
        self.procs["upstream"] = mock
        upstream = (await mock.await_line(MOCK_LINE, START_TIMEOUT_S, "mock upstream")).group(1)
        for name in ("A", "B"):
            options = {"turnguard_ledger": str(self.ledger),
                       "turnguard_events": str(self.work / f"{name}-events.jsonl"),
                       "turnguard_hold_timeout_ms": 20000}
            cmd = [mitmdump_path(), "--mode", f"reverse:{upstream}", "--listen-host",
                   "127.0.0.1", "--listen-port", "0", "--set",
                   f"confdir={self.work / (name + '-confdir')}", "-s", str(self.script),
                   *option_args(options)]
            proc = Process(cmd, self.work / f"{name}.log", new_session=True)
            self.procs[name] = proc
            port = (await proc.await_line(MITMDUMP_LINE, START_TIMEOUT_S, f"mitmdump {name}")).group(1)
            self.urls[name] = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for proc in self.procs.values():
            try:
                os.kill(proc.pid, signal.SIGCONT)  # (one left paused would not stop)
            except OSError:
                pass
            proc.stop()

    # -- the faults ------------------------------------------------------------------------------
    async def chaos(self, until: asyncio.Event) -> None:
        copy_made = False
        while not until.is_set():
            try:
                await asyncio.wait_for(until.wait(), self.rng.uniform(0.8, 2.5))
                return
            except TimeoutError:
                pass
            if not self.args.faults:
                continue
            fault = self.rng.choice(self.args.faults)
            self.faults.append((round(time.monotonic() - self.t0, 2), fault))
            try:
                copy_made = await self.fault(fault, copy_made)
            except (OSError, sqlite3.Error) as e:  # (a file already gone, say): noted
                self.faults[-1] = (self.faults[-1][0], f"{fault} ({e})")

    async def fault(self, fault: str, copy_made: bool) -> bool:
        ledger = self.ledger
        if fault == "stop":
            name, pause = self.rng.choice("AB"), self.rng.uniform(0.5, 3)
            os.kill(self.procs[name].pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(pause)
            finally:
                os.kill(self.procs[name].pid, signal.SIGCONT)
        elif fault == "lock":
            held = self.rng.uniform(0.3, 2)
            db = sqlite3.connect(ledger, timeout=5, isolation_level=None, check_same_thread=False)
            try:
                await asyncio.to_thread(db.execute, "BEGIN EXCLUSIVE")
                await asyncio.sleep(held)
                db.execute("ROLLBACK")
            finally:
                db.close()
        elif fault in ("rm_file", "rm_wal", "rm_shm", "rm_all"):
            suffixes = {"rm_file": [""], "rm_wal": ["-wal"], "rm_shm": ["-shm"],
                        "rm_all": ["", "-wal", "-shm"]}[fault]
            for suffix in suffixes:
                Path(f"{ledger}{suffix}").unlink(missing_ok=True)
        elif fault == "mv_older":
            older = self.work / "older.sqlite3"
            if not copy_made:
                src = sqlite3.connect(ledger, check_same_thread=False)
                dst = sqlite3.connect(older, check_same_thread=False)
                try:
                    await asyncio.to_thread(src.backup, dst)
                finally:
                    src.close()
                    dst.close()
                os.chmod(older, 0o600)
                return True
            os.replace(older, ledger)
        elif fault == "reload":
            os.utime(self.script)
        return False if fault == "mv_older" else copy_made

    # -- the traffic -----------------------------------------------------------------------------
    async def request(self, op: int, index: int, via: str, delay: float, stall_ms: int) -> None:
        await asyncio.sleep(delay)
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if index == 0:
            headers["x-mock-behaviour"] = json.dumps({"kind": "slow", "delay_ms": stall_ms})
        if self.args.sessions:
            headers.update({"authorization": f"Bearer sk-chaos-{op % 3}",
                            "session-id": f"chaos-{op % 5}"})
        ex = http1.Exchange()
        await http1.post(ex, self.urls[via], "/v1/responses", headers, self.body(op),
                         headers_timeout=REQUEST_TIMEOUT_S, idle_timeout=REQUEST_TIMEOUT_S)
        final = ex.final_response() or {}
        self.answers[op].append({
            "request": index, "via": via, "status": ex.status, "error": ex.error,
            "completed": ex.completed, "response_id": final.get("id"),
            "seconds": round((ex.t_end or time.time()) - ex.t_start, 2)})

    async def traffic(self) -> None:
        sends = []
        for op in range(self.args.ops):
            start = op * self.rng.uniform(0.1, 0.5)
            sends.append(self.request(op, 0, self.rng.choice("AB"), start,
                                      self.rng.randint(200, 4000)))
            for index in range(1, self.rng.randint(2, 4)):
                sends.append(self.request(op, index, self.rng.choice("AB"),
                                          start + self.rng.uniform(0.05, 3), 0))
        await asyncio.gather(*sends)

    # -- the checks ------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        upstream = collections.Counter(
            r.get("body_sha256") for r in read_jsonl(self.work / "upstream.jsonl")
            if r.get("event") == "dispatch")
        dispatched: dict[str, list[tuple[str, bool]]] = collections.defaultdict(list)
        for name in ("A", "B"):
            for r in read_jsonl(self.work / f"{name}-events.jsonl"):
                if r.get("event") == "dispatch":
                    dispatched[r["op"]].append((name, bool(r.get("ledger"))))
        ops, violations, reported = [], collections.Counter(), 0
        for op in range(self.args.ops):
            answers = sorted(self.answers[op], key=lambda a: a["request"])
            runs = upstream[hashlib.sha256(self.body(op)).hexdigest()]
            broken = []
            if not all(a["status"] == 200 and a["completed"] for a in answers):
                broken.append("answered")
            if runs == 1 and len({a["response_id"] for a in answers}) > 1:
                broken.append("one answer")
            ops.append({"op": op, "upstream_dispatches": runs, "answers": answers,
                        "broken": broken})
            violations.update(broken)
            reported += runs > 1 and not broken
        for op_id, by in dispatched.items():
            for name in ("A", "B"):
                if sum(1 for n, _ in by if n == name) > 1:
                    violations["once here"] += 1
                    ops.append({"op_id": op_id, "dispatches": by, "broken": ["once here"]})
        for name in ("A", "B"):
            proc = self.procs[name]
            if "Traceback" in proc.output() or proc.popen.poll() is not None:
                violations["no trace"] += 1
        try:
            db = sqlite3.connect(f"file:{self.ledger}?mode=ro", uri=True, timeout=10)
            try:
                sound = db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
                left = db.execute(
                    "SELECT count(*) FROM attempts WHERE outcome='in_flight'").fetchone()[0]
            finally:
                db.close()
        except sqlite3.Error as e:
            sound, left = False, str(e)
        if not sound or left:
            violations["ledger"] += 1
        return {"seed": self.args.seed, "ops": self.args.ops, "faults": self.faults,
                "violations": dict(violations), "dispatched_more_than_once": reported,
                "ledger_sound": sound, "attempts_left_in_flight": left,
                "operations": [o for o in ops if o["broken"] or o.get("upstream_dispatches", 1) > 1]}


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    chaos_run = Run(args, work)
    try:
        await chaos_run.start()
        done = asyncio.Event()
        faults = asyncio.create_task(chaos_run.chaos(done))
        try:
            await chaos_run.traffic()
        finally:
            done.set()
            await faults
        await asyncio.sleep(3)  # what was owed is written, the last ends land
        return chaos_run.report()
    finally:
        chaos_run.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="turnguard-chaos-"))
    os.chmod(work, 0o700)
    try:
        report = asyncio.run(run(args, work))
    finally:
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for o in report["operations"]:
        print(json.dumps(o))
    print(f"faults: {' '.join(f'{t}s:{f}' for t, f in report['faults']) or 'none'}")
    print(f"operations: {report['ops']}; dispatched upstream more than once (reported): "
          f"{report['dispatched_more_than_once']}; ledger sound: {report['ledger_sound']}, "
          f"attempts left in flight: {report['attempts_left_in_flight']}")
    print(f"violations: {report['violations'] or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if report["violations"] else 0
