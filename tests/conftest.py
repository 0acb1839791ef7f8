"""Puts the addon package, the tools' helpers (scripts/) and the test helpers on sys.path, as
mitmdump does for the script; marks every test with its tier; loads the Hypothesis profile."""

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "addon", ROOT / "scripts", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import hypothesis_profiles  # noqa: E402

hypothesis_profiles.load_from_environment()

# Every module's tier, one marker per test:
#   unit   pure code, the ledger on a temporary file (or the test PostgreSQL server), the
#          mock's parts: no proxy
#   addon  the TurnGuard addon in-process, under mitmproxy's taddons
#   e2e    real mitmdump processes in front of the mock upstream
#   tools  scripts/: the mock upstream as a process, the benchmark, the reproduction toolkit,
#          the shell scripts
# `scripts/test --quick` runs unit and addon; `scripts/test` runs everything, then unit, addon
# and the tests marked ``every_python`` on each other supported Python. A module missing here
# stops the run, so that no test goes untiered.
TIERS = {
    "unit": {
        "test_circuit", "test_counting", "test_deadlines", "test_degraded", "test_identity", "test_identity_memo", "test_ledger",
        "test_live", "test_liveness",
        "test_machine", "test_mock_parts", "test_negotiation", "test_offload", "test_ops",
        "test_kept_writes", "test_options", "test_outage_machine", "test_own_replays",
        "test_pg_store", "test_policy", "test_private_files",
        "test_records", "test_recovery_machine", "test_docs", "test_sse", "test_tee", "test_telemetry",
        "test_write_lock_reads",
        "test_ws",
    },
    "addon": {"test_addon", "test_control", "test_metrics", "test_proxy_internals"},
    "e2e": {
        "test_at_most_once", "test_beside_addons", "test_clock_jumps", "test_crash", "test_e2e_bounds",
        "test_e2e_circuit", "test_e2e_control", "test_e2e_guard", "test_e2e_http2",
        "test_e2e_metrics", "test_e2e_postgres",
        "test_e2e_attach", "test_e2e_tls", "test_e2e_mitmweb", "test_e2e_websocket", "test_e2e_ws_faults",
        "test_forks", "test_hostile", "test_isolation", "test_ledger_faults", "test_load",
        "test_security", "test_startup",
    },
    "tools": {
        "test_bench", "test_bench_instructions", "test_chaos", "test_mock_upstream", "test_repro_capture", "test_repro_models",
        "test_repro_real_clients", "test_repro_scenarios", "test_scripts",
    },
}
TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}
# Modules outside the fast tiers that each other supported Python runs too (quick ones).
EVERY_PYTHON_MODULES = {"test_repro_models"}
# Modules whose module-scoped fixture is costly, or not safe to make twice at once (the Codex
# CLI's install): with --dist loadgroup (scripts/test) each of them runs whole on one worker;
# every other test goes to whichever worker is free (pytest_xdist_make_scheduler below).
ONE_WORKER_MODULES = {"test_bench", "test_hostile", "test_isolation", "test_repro_real_clients",
                      "test_scripts", "test_security"}
# Modules that load the machine whole for a minute or more (a thousand clients, the benchmark's
# mitmdumps under load): marked ``solo``, which `scripts/test` runs after the rest, on two
# workers. Beside twelve other workers on a slow 2-core machine, their mitmdumps took more than
# 30 s to start, their requests more than 90 s, and the tests beside them missed bounds. The
# benchmark's callgrind and profiler phases (test_bench_instructions) count, never time, and
# run one process at a time: they run in the main run (in the solo run they took 43 s of the
# 88 s of the worker that ended it last).
SOLO_MODULES = {"test_bench", "test_load"}


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, grouped by ONE_WORKER_MODULES rather than by xdist_group marks
    (pytest-xdist 3.8 marks a group by renaming the node id, which pytest 9.2 no longer reads:
    its loadgroup spreads a group over every worker)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.partition("::")[0]
            return module if Path(module).stem in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


def _start_rank(item) -> int:
    """When a test is handed to a worker: the whole modules of ``ONE_WORKER_MODULES`` first,
    then the tests marked ``slow``, then the rest, each in collection order. The longest work
    started first leaves the workers no long test to finish alone at the end of the run."""
    if item.module.__name__.rpartition(".")[2] in ONE_WORKER_MODULES:
        return 0
    return 1 if item.get_closest_marker("slow") else 2


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_rank)  # (stable: collection order within each rank)
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        tier = TIER_OF.get(module)
        if tier is None:
            raise pytest.UsageError(f"{item.fspath}: no tier; add {module} to TIERS in "
                                    "tests/conftest.py")
        item.add_marker(getattr(pytest.mark, tier))
        if module in EVERY_PYTHON_MODULES:
            item.add_marker(pytest.mark.every_python)
        if module in SOLO_MODULES:
            item.add_marker(pytest.mark.solo)


def pytest_configure(config):
    """The end-to-end results go to one file that every xdist worker appends to."""
    if not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="turnguard-results-", suffix=".txt")
        os.close(fd)
        os.environ["TURNGUARD_RESULTS_FILE"] = path


@pytest.fixture
def report():
    """Adds a line to the end-to-end results printed at the end of the run."""
    path = os.environ["TURNGUARD_RESULTS_FILE"]

    def add(line: str) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(" ".join(line.split()) + "\n")

    return add


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    path = os.environ.get("TURNGUARD_RESULTS_FILE")
    if not path or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    os.unlink(path)
    if lines:
        terminalreporter.section("turnguard end-to-end results")
        for line in sorted(lines):
            terminalreporter.write_line(line)


# PostgreSQL: the throwaway server, a database per test, both stores as backends (pg_fixtures.py)
from pg_fixtures import ledger_backend, own_pg, pg_server_url, pg_url  # noqa: E402,F401
# --cpu-per-test FILE: each test's CPU, for finding where the suite's time goes (cpu_per_test.py)
from cpu_per_test import pytest_addoption, pytest_runtest_protocol  # noqa: E402,F401
