"""Puts the addon package and the test helpers on sys.path, as mitmdump does for the script."""

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "addon", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# The fast tier: modules that run in-process (pure core, the addon under mitmproxy's taddons,
# the ledger on a temporary file). Every other module starts real subprocesses (mitmdump, the
# mock upstream, the scripts) and is marked ``e2e``. `scripts/test --quick` runs the fast tier,
# and `scripts/test` runs it on every other supported Python too, with the tests marked
# ``every_python``.
FAST_MODULES = frozenset({
    "test_addon", "test_circuit", "test_control", "test_degraded", "test_identity",
    "test_ledger", "test_liveness", "test_metrics", "test_negotiation", "test_offload",
    "test_ops", "test_options", "test_outage_machine", "test_pg_store", "test_policy", "test_private_files", "test_proxy_internals",
    "test_recovery_machine", "test_repro_models", "test_sse", "test_tee",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] not in FAST_MODULES:
            item.add_marker(pytest.mark.e2e)


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
