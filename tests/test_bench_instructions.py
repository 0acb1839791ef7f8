"""``scripts/bench --phases instructions`` and ``--phases calls`` end to end (their parsing
and pure parts are tested in test_bench.py).

A module of its own, apart from test_bench.py: that one runs alone on the machine, after the
rest (``solo``: its quick run times what it measures), while these count instructions and
calls, which a busy machine does not change: they run in the main run, among the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_bench import BENCH_TIMEOUT_S, REPO, SCRIPTS, _num

from turnguard_bench import instructions_phase  # (test_bench put scripts/ on sys.path)


@pytest.mark.slow
def test_instructions_phase_counts_each_variant_under_callgrind(tmp_path):
    """``scripts/bench --quick --phases instructions --instructions-sim --instructions-variants
    turnguard``: turnguard runs under callgrind with its cache and branch simulation, every
    request answered, a count of instructions a request (the window with N requests counted
    more than the one with N/2), split by library, the simulated misses and the cycles
    estimated from them reported. The counts themselves are not checked: a smoke test, like
    the rest of quick mode. One variant: each costs half a minute of valgrind alone, and the
    ratios between variants are one line of arithmetic over the same counts (the variants
    chosen on the command line: test_bench.py)."""
    why_not = instructions_phase.missing_tools()
    if why_not is not None:
        pytest.skip(why_not)
    out_json = tmp_path / "instructions.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO / "addon")])}
    run = subprocess.run(
        [sys.executable, "-m", "turnguard_bench", "--quick", "--phases", "instructions",
         "--instructions-sim", "--instructions-variants", "turnguard", "--json", str(out_json)],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=BENCH_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads(out_json.read_text())["instructions"]
    assert set(data["variants"]) == {"turnguard"}
    counted = data["variants"]["turnguard"]
    assert counted["window_with_n"] > counted["window_with_half"] > 0
    assert _num(counted["per_request"]) and counted["per_request"] > 0
    assert data["checks"] == {"all_200": True}
    assert "instructions a request" in run.stdout
    sim = counted["simulated_per_request"]
    assert sim["Ir"] == counted["per_request"]
    assert {"I1mr", "D1mr", "Bc", "Bcm", "Bi", "Bim"} <= set(sim)
    assert sim["Bc"] > sim["Bcm"] > 0  # some conditional branches, not all, mispredicted
    assert counted["estimated_cycles_per_request"] > counted["per_request"]
    assert "cycles estimated" in run.stdout
    # the count split by library adds up to the count; turnguard's ledger runs SQLite
    assert sum(counted["by_library"].values()) == pytest.approx(counted["per_request"])
    assert counted["by_library"]["libpython3." + str(sys.version_info.minor)] > 0
    assert counted["by_library"].get("libsqlite3", 0) > 0
    assert "library (a request)" in run.stdout


@pytest.mark.slow
def test_calls_phase_counts_each_variants_python_calls_by_function(tmp_path):
    """``scripts/bench --quick --phases calls``: the ledger floor and turnguard each run under
    Python's profiler, every request answered; each has a count of calls a request (the
    window with N requests counted more than the one with N/2), split by group, and only
    turnguard's has calls of turnguard's functions, which it lists. The counts themselves are
    not checked: a smoke test, like the rest of quick mode."""
    out_json = tmp_path / "calls.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO / "addon")])}
    run = subprocess.run(
        [sys.executable, "-m", "turnguard_bench", "--quick", "--phases", "calls",
         "--json", str(out_json)],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=BENCH_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads(out_json.read_text())["calls"]
    assert set(data["variants"]) == {"ledger_floor", "turnguard"}
    for counted in data["variants"].values():
        assert counted["per_request"] > counted["python_per_request"] > 0
        assert counted["by_group"]["mitmproxy"]["python"] > 0
        assert sum(g["python"] + g["c"] for g in counted["by_group"].values()) \
            == pytest.approx(counted["per_request"])
    ours = data["variants"]["turnguard"]
    assert ours["by_group"]["turnguard"]["python"] > 0 and ours["by_group"]["turnguard"]["c"] > 0
    assert "turnguard" not in data["variants"]["ledger_floor"]["by_group"]
    assert ours["turnguard_functions"] and all(
        f["function"].startswith("turnguard") for f in ours["turnguard_functions"])
    assert data["turnguard_added_per_request"]["ledger_floor"]["turnguard"] > 0
    assert data["checks"] == {"all_200": True}
    assert "calls a request" in run.stdout and "turnguard's function" in run.stdout
