"""Puts the addon package and the test helpers on sys.path, as mitmdump does for the script."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "addon", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import pytest

_REPORT: list[str] = []


@pytest.fixture
def report():
    """Adds a line to the end-to-end results printed at the end of the run."""
    return _REPORT.append


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("turnguard end-to-end results")
        for line in _REPORT:
            terminalreporter.write_line(line)
