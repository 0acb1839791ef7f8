"""``scripts/chaos``: a bounded, seeded chaos run against turnguard's promises.

Two guarded mitmdumps (A and B) share one SQLite ledger in front of the mock upstream. Each of
--ops turns is an original, held upstream for 0.2 to 4 s, and 1 to 3 identical duplicates
sent 0.05 to 3 s after it, each through A or B at random, on connections of their own: HTTP
POSTs, WebSocket calls (a ``response.create`` frame on a socket of its own, as Codex sends
it), or either at random (--transport; a frame and its POST are one operation). While they
run, a fault from --faults comes every 0.8 to 2.5 s. Then the run checks what the
Guarantees table promises under those faults, and prints one line per operation that broke a
check, and a summary; --json FILE writes it all. Everything runs on 127.0.0.1; the run is
bounded (every wait has a timeout, the faults stop with the traffic).

Checks (exit status 1 when one fails):
  answered    every request got a 200 (a socket: its upgrade) whose events end with
              response.completed
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
from typing import Any, Callable

from turnguard_faults import (delete_ledger, disk_full, mount_tmpfs, replace_with_junk,
                              unmount)
from turnguard_procs import MITMDUMP_LINE, MOCK_LINE, Process, read_jsonl
from turnguard_repro import http1
from turnguard_repro.procs import ADDON, MOCK_UPSTREAM, mitmdump_path, option_args
from turnguard_ws import UpgradeRejected, WsClient

FAULTS = ("stop", "lock", "full", "rm_file", "rm_wal", "rm_shm", "rm_all", "mv_older", "junk",
          "reload")
FAULTS_HELP = {
    "stop": "SIGSTOP one process for 0.5-3 s, then SIGCONT",
    "lock": "another connection holds the ledger's write lock for 0.3-2 s",
    "full": "the ledger's disk full for 0.3-2 s, every write meeting it (the ledger then "
            "lives on a tmpfs of its own: root only)",
    "rm_file": "delete the ledger file alone (its -wal and -shm left)",
    "rm_wal": "delete the ledger's -wal",
    "rm_shm": "delete the ledger's -shm",
    "rm_all": "delete the ledger and its -wal and -shm",
    "mv_older": "every other time: make a copy of the ledger; move it back over the ledger "
                "(its -wal and -shm left)",
    "junk": "move a file that is no database over the ledger (its -wal and -shm left) for "
            "0.3-2 s, then delete it and them",
    "reload": "touch turnguard's script: mitmproxy reloads it in both processes",
}
TRANSPORTS = ("http", "ws", "mixed")
LEDGER_TMPFS_SIZE = "64m"  # the ledger, its 16 MiB WAL and disk_full's scratch write in it
START_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 90.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # (SIGHUP: its terminal closed)


class Stopped(Exception):
    """The run was stopped by ``signum`` (SIGTERM, SIGINT, SIGHUP): its clean-up ran."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The first stop signal received, and what receiving one does besides (the run under way:
# cancel it). The handler only notes it: a signal never interrupts a clean-up (a process group
# stopped, the tmpfs unmounted, the work folder removed), however many come.
_stop_noted: list[int] = []
_on_stop: list[Callable[[], None]] = []


def _note_stop(signum: int, _frame: object) -> None:
    if not _stop_noted:
        _stop_noted.append(signum)
        for act in _on_stop:
            act()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/chaos", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n", 2)[2],
        epilog="faults:\n" + "\n".join(f"  {k:9} {v}" for k, v in FAULTS_HELP.items())
        + "\n\nexample:\n  scripts/chaos --seed 3 --ops 40 --faults lock,stop")
    p.add_argument("--seed", type=int, default=1, help="the run's random seed (default 1)")
    p.add_argument("--ops", type=int, default=30, help="operations (turns), 1-500 (default 30)")
    p.add_argument("--faults", default=None,
                   help="comma-separated faults to draw from, or 'none' (default: all; "
                        "without root, all but full)")
    p.add_argument("--transport", choices=TRANSPORTS, default="http",
                   help="how requests are sent: HTTP POSTs, WebSocket calls, or either at "
                        "random for each request (default http)")
    p.add_argument("--sessions", action="store_true",
                   help="send every request with a session-id (5 sessions) and one of 3 keys")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work folder and print it")
    args = p.parse_args(argv)
    if not 1 <= args.ops <= 500:
        p.error("--ops must be between 1 and 500")
    args.all_faults = args.faults is None
    args.faults = list(FAULTS) if args.faults is None else \
        [] if args.faults == "none" else args.faults.split(",")
    unknown = sorted(set(args.faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown fault(s): {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    return args


class Run:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        # (a folder of its own: a tmpfs with ``full``, whose fill leaves the rest alone)
        self.ledger = work / "ledger" / "ledger.sqlite3"
        self.script = work / "addon" / "turnguard.py"  # a copy: ``reload`` touches it
        self.procs: dict[str, Process] = {}
        self.urls: dict[str, str] = {}
        self.faults: list[tuple[float, str]] = []
        self.answers: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
        self.t0 = time.monotonic()

    def body(self, op: int) -> bytes:
        return json.dumps({"model": "m", "input": f"chaos {self.args.seed} op {op}",
                           "stream": True}).encode()

    def frame(self, op: int) -> str:
        """The operation's call on a socket: its POST's body as a ``response.create`` frame."""
        return json.dumps({"type": "response.create", **json.loads(self.body(op))})

    def bodies_sha256(self, op: int) -> tuple[str, str]:
        """What the upstream logs of the operation's dispatches: its POST's body, its frame."""
        return (hashlib.sha256(self.body(op)).hexdigest(),
                hashlib.sha256(self.frame(op).encode()).hexdigest())

    async def start(self) -> None:
        shutil.copytree(ADDON.parent, self.script.parent,
                        ignore=shutil.ignore_patterns("__pycache__"))
        # an operation's first dispatch is slow (its turn held upstream: its duplicates come
        # meanwhile), any later one answered at once, by POST or on a socket alike
        scenario = {"default": {"kind": "ok"}, "operations": {
            sha: {"sequence": [{"kind": "slow", "delay_ms": self.rng.randint(200, 4000)}],
                  "default": {"kind": "ok"}}
            for op in range(self.args.ops) for sha in self.bodies_sha256(op)}}
        (self.work / "scenario.json").write_text(json.dumps(scenario))
        mock = Process([sys.executable, "-u", str(MOCK_UPSTREAM), "--host", "127.0.0.1",
                        "--port", "0", "--scenario", str(self.work / "scenario.json"),
                        "--log", str(self.work / "upstream.jsonl")],
                       self.work / "upstream.out", new_session=True)
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
        if self.ledger.parent.is_mount():
            if self.args.keep:  # (the tmpfs goes with the run)
                shutil.copytree(self.ledger.parent, self.work / "ledger-kept")
            unmount(self.ledger.parent)

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
        elif fault == "full":
            held = self.rng.uniform(0.3, 2)
            full = disk_full(ledger)
            await asyncio.to_thread(full.__enter__)
            try:
                await asyncio.sleep(held)
            finally:
                await asyncio.to_thread(full.__exit__, None, None, None)
        elif fault in ("rm_file", "rm_wal", "rm_shm", "rm_all"):
            suffixes = {"rm_file": [""], "rm_wal": ["-wal"], "rm_shm": ["-shm"],
                        "rm_all": ["", "-wal", "-shm"]}[fault]
            for suffix in suffixes:
                Path(f"{ledger}{suffix}").unlink(missing_ok=True)
        elif fault == "mv_older":
            older = ledger.parent / "older.sqlite3"  # (one file system: moved, not copied)
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
        elif fault == "junk":
            held = self.rng.uniform(0.3, 2)
            replace_with_junk(ledger)
            await asyncio.sleep(held)
            delete_ledger(ledger)
        elif fault == "reload":
            os.utime(self.script)
        return False if fault == "mv_older" else copy_made

    # -- the traffic -----------------------------------------------------------------------------
    async def request(self, op: int, index: int, via: str, delay: float, transport: str) -> None:
        await asyncio.sleep(delay)
        headers = {}
        if self.args.sessions:
            headers.update({"authorization": f"Bearer sk-chaos-{op % 3}",
                            "session-id": f"chaos-{op % 5}"})
        started = time.time()
        if transport == "ws":
            answer = await self.call(op, via, headers)
        else:
            ex = http1.Exchange()
            await http1.post(ex, self.urls[via], "/v1/responses",
                             {"content-type": "application/json",
                              "accept": "text/event-stream", **headers}, self.body(op),
                             headers_timeout=REQUEST_TIMEOUT_S, idle_timeout=REQUEST_TIMEOUT_S)
            final = ex.final_response() or {}
            answer = {"status": ex.status, "error": ex.error, "completed": ex.completed,
                      "response_id": final.get("id")}
        self.answers[op].append({"request": index, "via": via, "transport": transport, **answer,
                                 "seconds": round(time.time() - started, 2)})

    async def call(self, op: int, via: str, headers: dict[str, str]) -> dict[str, Any]:
        """The operation's call on a socket of its own: 200 once upgraded, completed when its
        events end with ``response.completed``."""
        try:
            async with WsClient.connect(self.urls[via], headers=headers) as client:
                await client.send(self.frame(op))
                events = await client.response(REQUEST_TIMEOUT_S)
        except UpgradeRejected as e:
            return {"status": e.status, "error": str(e), "completed": False, "response_id": None}
        except (OSError, TimeoutError, ValueError) as e:
            return {"status": 0, "error": repr(e), "completed": False, "response_id": None}
        last = events[-1] if events else {}
        completed = last.get("type") == "response.completed"
        return {"status": 200, "error": None if completed else f"ended with {last}",
                "completed": completed,
                "response_id": (last.get("response") or {}).get("id") if completed else None}

    def transport(self) -> str:
        return self.rng.choice(("http", "ws")) if self.args.transport == "mixed" \
            else self.args.transport

    async def traffic(self) -> None:
        sends = []
        for op in range(self.args.ops):
            start = op * self.rng.uniform(0.1, 0.5)
            sends.append(self.request(op, 0, self.rng.choice("AB"), start, self.transport()))
            for index in range(1, self.rng.randint(2, 4)):
                sends.append(self.request(op, index, self.rng.choice("AB"),
                                          start + self.rng.uniform(0.05, 3), self.transport()))
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
            runs = sum(upstream[sha] for sha in self.bodies_sha256(op))
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
        sent = collections.Counter(a["transport"] for answers in self.answers.values()
                                   for a in answers)
        return {"seed": self.args.seed, "ops": self.args.ops, "faults": self.faults,
                "requests": dict(sent),
                "violations": dict(violations), "dispatched_more_than_once": reported,
                "ledger_sound": sound, "attempts_left_in_flight": left,
                "operations": [o for o in ops if o["broken"] or o.get("upstream_dispatches", 1) > 1]}


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The run, its processes stopped (and the ledger's tmpfs unmounted) however it ends. A
    stop signal meanwhile (``_note_stop``) cancels it, and it raises ``Stopped`` once its
    processes are gone."""
    loop, main = asyncio.get_running_loop(), asyncio.current_task()
    assert main is not None
    _on_stop.append(lambda: loop.call_soon_threadsafe(main.cancel))
    if _stop_noted:  # (before the loop ran)
        main.cancel()
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
    except asyncio.CancelledError:
        if _stop_noted:
            raise Stopped(_stop_noted[0]) from None
        raise
    finally:
        _on_stop.clear()
        chaos_run.stop()


def main(argv: list[str] | None = None) -> int:
    """The run; its exit status. Stopped by SIGTERM, SIGINT or SIGHUP, it stops the processes
    it started (each in a process group of its own, which a signal to this one does not reach),
    unmounts the ledger's tmpfs and removes its work folder, and exits 128 + the signal."""
    args = parse_args(argv)
    for signum in STOP_SIGNALS:
        signal.signal(signum, _note_stop)
    try:
        report = _run_in_work_folder(args)
    except Stopped:
        report = None
    finally:  # the clean-up is over: one more signal must not end the exit (Python sets the
        for signum in STOP_SIGNALS:  # handlers back to the default as it exits)
            signal.signal(signum, signal.SIG_IGN)
    if _stop_noted:  # (also one that came as the run ended, or during its clean-up)
        print(f"scripts/chaos: stopped by {signal.Signals(_stop_noted[0]).name}; the "
              "processes it started are stopped", file=sys.stderr)
        return 128 + _stop_noted[0]
    if report is None:
        return 2
    for o in report["operations"]:
        print(json.dumps(o))
    print(f"faults: {' '.join(f'{t}s:{f}' for t, f in report['faults']) or 'none'}")
    print(f"operations: {report['ops']}; requests: "
          f"{', '.join(f'{n} {t}' for t, n in sorted(report['requests'].items()))}; "
          f"dispatched upstream more than once (reported): "
          f"{report['dispatched_more_than_once']}; ledger sound: {report['ledger_sound']}, "
          f"attempts left in flight: {report['attempts_left_in_flight']}")
    print(f"violations: {report['violations'] or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if report["violations"] else 0


def _run_in_work_folder(args: argparse.Namespace) -> dict[str, Any] | None:
    """The run's report, in a work folder of its own that is removed after (unless --keep),
    its ledger's tmpfs (with ``full``) unmounted first however the run ends; None when
    ``full`` was asked for and no tmpfs can be mounted."""
    work, keep = Path(tempfile.mkdtemp(prefix="turnguard-chaos-")), args.keep
    try:
        os.chmod(work, 0o700)
        try:
            if "full" in args.faults:
                mount_tmpfs(work / "ledger", LEDGER_TMPFS_SIZE)
            else:
                (work / "ledger").mkdir(mode=0o700)
        except OSError as e:
            if not args.all_faults:
                keep = False  # (nothing ran)
                print(f"scripts/chaos: the fault full needs the ledger on a tmpfs of its own: "
                      f"{e}", file=sys.stderr)
                return None
            print(f"the fault full is left out (it needs the ledger on a tmpfs of its own: {e})")
            args.faults.remove("full")
            (work / "ledger").mkdir(mode=0o700, exist_ok=True)
        if _stop_noted:  # stopped while the folder was made: nothing to run
            return None
        return asyncio.run(run(args, work))
    finally:
        if (work / "ledger").is_mount():  # (stopped before the run could unmount it)
            unmount(work / "ledger")
        if keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
