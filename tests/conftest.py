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
