"""Instructions per request, counted rather than timed: each mitmdump variant runs under
valgrind's callgrind, which counts every instruction the process executes in user space (all
its threads). A count does not move with the machine's load, so the ratios of this phase are
the same from run to run, where CPU-time ratios move by 10-60 % on a busy 2-core machine.

Per variant (one at a time, one client sending one request after the other): a warm-up, then
two windows of the same length, counted from zeroed counters to a dump: one with N requests,
one with N/2, each followed by nothing until the window ends. What the process runs on its own
(timers, turnguard's heartbeat and checkpoints) takes the same in both, so the difference of
the two counts over N/2 is what a request costs, with nothing estimated.

Each count is also split by the library that executed it (``by_library``: the self cost of
its functions, e.g. ``libpython3.13`` for the interpreter running every Python function,
mitmproxy's and turnguard's alike, ``libsqlite3`` for a ledger's SQL, ``libc``): so the
instructions a variant adds are seen by what runs them.

What a count leaves out: the kernel's work (system calls, the copies they make), and how fast
the instructions run (cache misses, the other processes on the machine). So the ratios here
are not the throughput ratios: where the two differ, the difference is in what a count leaves
out. ``--instructions-sim`` (``cfg.instructions_sim``) has callgrind simulate the caches (first
level and last level, shaped as the host's) and the branch predictor as well: misses and
mispredictions a request, and the cycles valgrind's documentation estimates from them
(``Ir + 10 Bm + 10 L1m + 100 LLm``). A simulation, not the hardware: it shows whether the
instructions turnguard adds run into more misses than plain mitmdump's, not what they cost.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from turnguard_bench import client, procs
from turnguard_bench.phases import log, model_request
from turnguard_bench.stats import ratio

START_TIMEOUT_S = 300.0  # a mitmdump under callgrind starts some 30 times slower
CONTROL_TIMEOUT_S = 120.0
# a request under callgrind's simulation: the first (imports, a cold ledger) took more than 60 s
# on a loaded machine
REQUEST_TIMEOUT_S = 300.0
SETTLE_S = 2.0  # after the last request of a window: its tail (a checkpoint) is in the window
_TOTALS = re.compile(r"^totals:[ \t]*([\d \t]+)$", re.M)  # the last line of a whole dump
_EVENTS = re.compile(r"^events:[ \t]*(.+)$", re.M)  # the names of its columns
SIM_FLAGS = ("--cache-sim=yes", "--branch-sim=yes")


def missing_tools() -> str | None:
    """Why the phase cannot run here, or None."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian: apt-get install valgrind)"
    return None


async def instructions(cfg, workdir: Path, up: procs.Proc) -> dict:
    why_not = missing_tools()
    if why_not is not None:
        log(f"instructions: skipped, {why_not}")
        return {"skipped": why_not}
    out: dict = {"requests": cfg.instructions, "simulated": cfg.instructions_sim, "variants": {}}
    statuses: set[int] = set()
    for variant in cfg.instructions_variants:
        counted = await _count(workdir, up, variant, cfg.instructions, statuses,
                               simulate=cfg.instructions_sim)
        out["variants"][variant] = counted
        log(f"instructions {variant:<13}: {counted['per_request']:,.0f} a request "
            f"(windows of {counted['window_s']:.1f} s)")
    per = {v: d["per_request"] for v, d in out["variants"].items()}
    if "turnguard" in per:
        out["turnguard_vs"] = {v: ratio(per[v], per["turnguard"]) for v in per
                               if v != "turnguard"}
        out["turnguard_added_per_request"] = {v: per["turnguard"] - per[v] for v in per
                                              if v != "turnguard"}
        if cfg.instructions_sim:
            est = {v: d["estimated_cycles_per_request"] for v, d in out["variants"].items()}
            out["turnguard_vs_by_estimated_cycles"] = {
                v: ratio(est[v], est["turnguard"]) for v in est if v != "turnguard"}
    out["checks"] = {"all_200": statuses == {200}}
    return out


async def _count(workdir: Path, up: procs.Proc, variant: str, n: int,
                 statuses: set[int], *, simulate: bool = False) -> dict:
    dumps = workdir / f"callgrind-{variant}"
    dumps.mkdir()
    # instrumented only from the warm-up on: mitmproxy's start-up runs at valgrind's plain
    # speed, several times faster than counted
    prefix = ["valgrind", "--tool=callgrind", *(SIM_FLAGS if simulate else ()),
              "--dump-instr=no", "--instr-atstart=no", f"--callgrind-out-file={dumps}/out"]
    name = f"instr-{variant}"
    p = procs.start_mitmdumps(workdir, up.url, {name: (variant, {})}, prefix=prefix,
                              start_timeout=START_TIMEOUT_S)[name]
    try:
        nonce = f"instr-{variant}-{uuid.uuid4().hex[:8]}"
        _control(p, "--instr=on")
        await sequential(p, nonce, 0, max(3, n // 10), statuses)
        await asyncio.sleep(SETTLE_S)
        half = n // 2
        _control(p, "--zero")
        t0 = time.monotonic()
        await sequential(p, nonce, 1000, n, statuses)
        window_s = time.monotonic() - t0 + SETTLE_S
        await asyncio.sleep(max(0.0, t0 + window_s - time.monotonic()))
        whole = _dump(p, dumps)
        _control(p, "--zero")
        t0 = time.monotonic()
        await sequential(p, nonce, 1000 + n, half, statuses)
        await asyncio.sleep(max(0.0, t0 + window_s - time.monotonic()))
        halved = _dump(p, dumps)
    finally:
        p.stop()
    (whole, whole_libs), (halved, halved_libs) = whole, halved
    per_event = {e: (whole[e] - halved.get(e, 0)) / (n - half) for e in whole}
    counted = {"per_request": per_event["Ir"], "window_s": window_s,
               "window_with_n": whole["Ir"], "window_with_half": halved["Ir"],
               "by_library": {lib: (whole_libs[lib] - halved_libs.get(lib, 0)) / (n - half)
                              for lib in whole_libs}}
    if simulate:
        counted["simulated_per_request"] = per_event
        counted["estimated_cycles_per_request"] = estimated_cycles(per_event)
    return counted


def estimated_cycles(events: dict[str, float]) -> float:
    """valgrind's estimate of the cycles of simulated ``events`` (callgrind's names): each
    instruction one cycle, a first-level miss or a mispredicted branch 10, a last-level miss
    100. Events that were not simulated count nothing."""
    g = lambda name: events.get(name, 0.0)  # noqa: E731
    return (g("Ir") + 10 * (g("I1mr") + g("D1mr") + g("D1mw") + g("Bcm") + g("Bim"))
            + 100 * (g("ILmr") + g("DLmr") + g("DLmw")))


def parse_totals(dump: str) -> dict[str, int] | None:
    """A whole callgrind dump's totals by event name (``{"Ir": ...}``, and the simulated
    events when there are some), or None before it is written out to its last line."""
    totals, events = _TOTALS.search(dump), _EVENTS.search(dump)
    if totals is None or events is None:
        return None
    names, counts = events.group(1).split(), totals.group(1).split()
    if len(names) != len(counts):
        return None
    return dict(zip(names, map(int, counts)))


async def sequential(p: procs.Proc, nonce: str, first: int, n: int, statuses: set[int]) -> None:
    """Requests ``first`` .. ``first + n - 1`` of the per-request phase's model, one after the
    other on one connection to ``p``; their statuses added to ``statuses``."""
    conn = await client.connect(p.port)
    try:
        for i in range(first, first + n):
            res = await conn.request(model_request(nonce, i), timeout=REQUEST_TIMEOUT_S)
            statuses.add(res.status)
    finally:
        conn.close()


def _control(p: procs.Proc, action: str) -> None:
    subprocess.run(["callgrind_control", action, str(p.pid)], capture_output=True,
                   timeout=CONTROL_TIMEOUT_S, check=True)


def self_by_library(dump: str) -> dict[str, int]:
    """A callgrind dump's instructions (its first event) by the library that executed them:
    the self cost of every function, summed by its object file (``ob=``), named without its
    folder and from ``.so`` on (``libsqlite3.so.0.8.6`` -> ``libsqlite3``). The cost line after
    a ``calls=`` line is the callee's inclusive cost, counted where the callee's own lines
    are: skipped here. Names the format compresses (``ob=(3)``, named at their first ``ob=`` or
    ``cob=``) are looked up."""
    names: dict[str, str] = {}
    totals: dict[str, int] = {}
    current, after_call = "?", False
    for line in dump.splitlines():
        if not line:
            continue
        head = line[0]
        if head.isdigit() or head in "+-*":
            if after_call:
                after_call = False
                continue
            parts = line.split()
            if len(parts) > 1:
                totals[current] = totals.get(current, 0) + int(parts[1])
        elif line.startswith("ob="):
            current = _compressed(names, line[3:])
        elif line.startswith("cob="):  # may name an object first (used by a later ``ob=``)
            _compressed(names, line[4:])
        elif line.startswith("calls="):
            after_call = True
    return totals


def _compressed(names: dict[str, str], ref: str) -> str:
    """``(3) /usr/lib/libc.so.6`` (remembered as 3) or ``(3)``: the library's short name."""
    ref = ref.strip()
    if ref.startswith("(") and ")" in ref:
        key, _, path = ref[1:].partition(")")
        if path.strip():
            names[key] = _library(path.strip())
        return names.get(key, "?")
    return _library(ref)


def _library(path: str) -> str:
    return path.rsplit("/", 1)[-1].split(".so", 1)[0] or "?"


def _dump(p: procs.Proc, dumps: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Dump the counts since the last zeroing: their totals by event, and the instructions
    by library (``self_by_library``)."""
    before = set(dumps.iterdir())
    _control(p, "--dump")
    deadline = time.monotonic() + CONTROL_TIMEOUT_S
    while time.monotonic() < deadline:
        for f in set(dumps.iterdir()) - before:
            text = f.read_text(errors="replace")
            totals = parse_totals(text)
            if totals is not None:
                return totals, self_by_library(text)
        time.sleep(0.1)
    raise RuntimeError(f"callgrind wrote no dump for {p.name} in {CONTROL_TIMEOUT_S:.0f} s")
