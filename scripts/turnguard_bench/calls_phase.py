"""Python calls per request, counted by function: each mitmdump variant runs under Python's
deterministic profiler (``calls_profiler``), which counts every call of a Python function and
of a C function called from Python (``len``, a ``sqlite3`` cursor's ``execute``, ...) in every
thread while it is on. Unlike the instructions phase, it says which function runs: that phase
sees the interpreter as one library, here each of turnguard's functions and mitmproxy's has
its own count. The calls of Python functions a request are the same from run to run within
one or two; the calls of C functions move by a few hundred (a few per cent of all): how often
the event loop polls, and what the heartbeat's thread does, follow the timing, not the
requests. So what a change moves is read in the Python calls (``python_per_request``, and
turnguard's own).

Per variant (one at a time, one client sending one request after the other): a warm-up, then
two windows of the same length, each counted from new counters: one with N requests, one
with N/2. What the process runs on its own (timers, turnguard's heartbeat) takes the same in
both, so the difference of the two counts over N/2 is what a request costs.

Each call is put in a group by the file of the function that was called, a C function by the
file of the function that called it: ``turnguard`` (addon/), ``mitmproxy``, ``asyncio``,
``standard library``, ``other libraries`` (site-packages), ``bench addon`` (a floor). So what
turnguard adds to the ledger floor is seen by who makes the calls, and its own functions are
listed by how many calls a request each makes (its C calls included).

A count is not a time: a call of ``len`` and a call of ``COMMIT`` count one each (the ledger's
statements are few calls and much of the time; see the hooks phase and the profiles for
time). The profiler's own cost slows the process several fold, which changes no count.
"""

from __future__ import annotations

import asyncio
import os
import pstats
import time
import uuid
from collections import defaultdict
from pathlib import Path

from turnguard_bench import procs
from turnguard_bench.calls_profiler import START_SIGNAL, STOP_SIGNAL
from turnguard_bench.instructions_phase import sequential
from turnguard_bench.phases import log

START_TIMEOUT_S = 60.0
DUMP_TIMEOUT_S = 60.0
SETTLE_S = 1.0  # after the last request of a window: its tail is in the window
SIGNALLED_S = 0.1  # from a signal to the first request: the profiler is on by then
TOP_FUNCTIONS = 15
GROUPS = ("turnguard", "mitmproxy", "asyncio", "standard library", "other libraries",
          "bench addon")
Key = tuple[str, int, str]  # pstats: (file, line, function)


async def calls(cfg, workdir: Path, up: procs.Proc) -> dict:
    out: dict = {"requests": cfg.calls, "variants": {}}
    statuses: set[int] = set()
    for variant in cfg.calls_variants:
        counted = await _count(workdir, up, variant, cfg.calls, statuses)
        out["variants"][variant] = counted
        log(f"calls {variant:<13}: {counted['per_request']:,.0f} a request "
            f"({counted['python_per_request']:,.0f} of Python functions; windows of "
            f"{counted['window_s']:.1f} s)")
    per = {v: d["per_request"] for v, d in out["variants"].items()}
    if "turnguard" in per:
        tg = out["variants"]["turnguard"]["by_group"]
        out["turnguard_added_per_request"] = {
            v: {"all": per["turnguard"] - per[v],
                **{g: _both(tg.get(g)) - _both(d["by_group"].get(g)) for g in GROUPS}}
            for v, d in out["variants"].items() if v != "turnguard"}
    out["checks"] = {"all_200": statuses == {200}}
    return out


def _both(counts: dict | None) -> float:
    return 0.0 if counts is None else counts["python"] + counts["c"]


async def _count(workdir: Path, up: procs.Proc, variant: str, n: int,
                 statuses: set[int]) -> dict:
    dump = workdir / f"calls-{variant}.pstats"
    prefix = [procs.PYTHON, "-m", "turnguard_bench.calls_profiler", str(dump)]
    name = f"calls-{variant}"
    p = procs.start_mitmdumps(workdir, up.url, {name: (variant, {})}, prefix=prefix,
                              start_timeout=START_TIMEOUT_S)[name]
    try:
        nonce = f"calls-{variant}-{uuid.uuid4().hex[:8]}"
        await sequential(p, nonce, 0, max(3, n // 10), statuses)
        await asyncio.sleep(SETTLE_S)
        whole, window_s = await _window(p, dump, nonce, 1000, n, None, statuses)
        halved, _ = await _window(p, dump, nonce, 1000 + n, n // 2, window_s, statuses)
    finally:
        p.stop()
    counted = per_request(whole, halved, n - n // 2)
    counted["window_s"] = window_s
    return counted


async def _window(p: procs.Proc, dump: Path, nonce: str, first: int, n: int,
                  length: float | None, statuses: set[int]) -> tuple[dict, float]:
    """Count ``n`` requests in a window of ``length`` seconds (None: as long as they take,
    and ``SETTLE_S``); the statistics, and the window's length."""
    dump.unlink(missing_ok=True)
    t0 = time.monotonic()
    os.kill(p.pid, START_SIGNAL)
    await asyncio.sleep(SIGNALLED_S)
    await sequential(p, nonce, first, n, statuses)
    window_s = length if length is not None else time.monotonic() - t0 + SETTLE_S
    await asyncio.sleep(max(0.0, t0 + window_s - time.monotonic()))
    os.kill(p.pid, STOP_SIGNAL)
    deadline = time.monotonic() + DUMP_TIMEOUT_S
    while not dump.exists():  # bounded by the deadline
        if time.monotonic() > deadline:
            raise RuntimeError(f"{p.name}: no counts written to {dump}")
        await asyncio.sleep(0.05)
    return pstats.Stats(str(dump)).stats, window_s  # type: ignore[attr-defined]


def group_of(file: str) -> str:
    """The group of a function by its file (not for a C function: ``~``)."""
    if "/turnguard_core/" in file or "/turnguard_shell/" in file \
            or file.endswith("/turnguard.py"):
        return "turnguard"
    if "/mitmproxy/" in file:
        return "mitmproxy"
    if "/turnguard_bench/" in file:
        return "bench addon"
    if "/asyncio/" in file:
        return "asyncio"
    if "/site-packages/" in file:
        return "other libraries"
    return "standard library"


def _calls(stats: dict) -> tuple[dict[Key, int], dict[Key, int]]:
    """Calls of each Python function, and the C calls each Python function made."""
    python: dict[Key, int] = {}
    c_by_caller: dict[Key, int] = defaultdict(int)
    for key, (_, calls, _, _, callers) in stats.items():
        if key[0] == "~":  # a C function: counted where it was called from
            for caller, caller_counts in callers.items():
                c_by_caller[caller] += caller_counts[1]
        else:
            python[key] = calls
    return python, c_by_caller


def per_request(whole: dict, halved: dict, k: int) -> dict:
    """What a request costs: the counts of the window with N requests less those of the
    window with N/2, over ``k`` (N - N/2). Totals, by group, and turnguard's functions."""
    (py_w, c_w), (py_h, c_h) = _calls(whole), _calls(halved)
    python = {key: (py_w.get(key, 0) - py_h.get(key, 0)) / k for key in py_w.keys() | py_h.keys()}
    c = {key: (c_w.get(key, 0) - c_h.get(key, 0)) / k for key in c_w.keys() | c_h.keys()}
    by_group: dict[str, dict[str, float]] = {}
    for counts, kind in ((python, "python"), (c, "c")):
        for key, n in counts.items():
            group = by_group.setdefault(group_of(key[0]), {"python": 0.0, "c": 0.0})
            group[kind] += n
    ours = [key for key in python.keys() | c.keys() if group_of(key[0]) == "turnguard"]
    ours.sort(key=lambda key: -(python.get(key, 0.0) + c.get(key, 0.0)))
    return {
        "per_request": sum(python.values()) + sum(c.values()),
        "python_per_request": sum(python.values()),
        "by_group": by_group,
        "turnguard_functions": [
            {"function": _named(key), "calls": python.get(key, 0.0),
             "c_calls": c.get(key, 0.0)}
            for key in ours[:TOP_FUNCTIONS]],
    }


def _named(key: Key) -> str:
    """``turnguard_core/ledger.py:524 admit``: the file from the addon's folder on."""
    file, line, function = key
    parts = file.replace(os.sep, "/").split("/")
    tail = "/".join(parts[-2:]) if parts[-2].startswith("turnguard_") else parts[-1]
    return f"{tail}:{line} {function}"
