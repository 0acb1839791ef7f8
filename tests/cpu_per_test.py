"""What each test costs in CPU, for finding where the suite's time goes: a pytest plugin
(``conftest.py`` imports its hooks), off unless asked for.

    scripts/test -n 12 --dist loadgroup -m "not solo" --cpu-per-test FILE

appends a line per test to FILE: CPU seconds of the test's whole process tree (its pytest
worker, the fork server, the mitmdumps, mock upstreams and tools it started, and what each of
them reaped), CPU seconds of the worker alone, wall seconds, the test's id, its worker
(``gw0``..., ``main`` without xdist) and when it began (Unix seconds), tab-separated.
The tree is read from ``/proc`` before and after each test (setup and teardown included). A
process that left the tree before it ended (one that daemonized itself) is not counted; one
still running when the test ends is counted up to then. Workers append to the one file, a line
at a time.

    sort -rn FILE | head -40                  # the costliest tests
    sort -t$'\\t' -k6 -n FILE | tail -40         # the last to begin: what the run ends with
    awk -F'\\t' '{split($4, a, "::"); cpu[a[1]] += $1} END {for (m in cpu) print cpu[m], m}' \\
        FILE | sort -rn                       # by module
"""

from __future__ import annotations

import os
import time

import pytest

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-per-test", metavar="FILE", default=None,
                     help="append each test's CPU seconds (its process tree, its worker alone), "
                          "wall seconds, id, worker and start time to FILE, tab-separated")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and of every process below it, each with what it reaped."""
    ticks, stack = 0, [root]
    while stack:  # (a tree: no process is its own ancestor)
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
                children = f.read().split()
        except (OSError, ValueError):
            continue  # ended meanwhile: its parent's reaped time has it once reaped
        ticks += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
        stack.extend(int(c) for c in children)
    return ticks / _TICKS_PER_S


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = item.config.getoption("--cpu-per-test")
    if not path:
        yield
        return
    pid = os.getpid()
    began = time.time()
    tree, own, wall = tree_cpu_s(pid), sum(os.times()[:2]), time.monotonic()
    yield
    tree, own, wall = tree_cpu_s(pid) - tree, sum(os.times()[:2]) - own, time.monotonic() - wall
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{tree:.2f}\t{own:.2f}\t{wall:.1f}\t{item.nodeid}\t"
                f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{began:.1f}\n")
