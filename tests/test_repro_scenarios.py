"""``scripts/reproduce`` end to end, through the real wrapper script: the two built-in incidents
show the incident without turnguard (duplicate storm) or in the default mode (cooldown storm)
and not with turnguard's answer to it; the JSON, the table, the SVG timeline and the saved
flows (with turnguard's marks) are what they say."""

from __future__ import annotations

import json
import re
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness import REPO

REPRODUCE = REPO / "scripts" / "reproduce"
TIMEOUT_S = 120


def reproduce(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNGUARD_")}
    proc = subprocess.run([str(REPRODUCE), *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_list_show_and_usage_errors():
    out = reproduce("--list").stdout
    for name in ("duplicate-storm", "cooldown-503-storm", "replay-after-completion", "partial-output",
                 "upstream-429"):
        assert name in out
    shown = json.loads(reproduce("show", "duplicate-storm").stdout)
    assert shown["name"] == "duplicate-storm" and shown["clients"][0]["model"] == "gateway"
    bad = reproduce("no-such-scenario", check=False)
    assert bad.returncode == 2 and "unknown scenario" in bad.stderr
    bad = reproduce("duplicate-storm", "--set", "cooldown=1", check=False)
    assert bad.returncode != 0 and "turnguard_NAME=VALUE" in bad.stderr
    # the built-ins carry their shortened timings: a shown scenario runs as the built-in does
    assert shown["turnguard_options"]["turnguard_response_created_timeout_ms"] == 1000
    helped = reproduce("--help").stdout
    assert "from-capture" in helped and "reproduce show NAME" in helped and "TURN LOST" in helped
    show_help = reproduce("show", "--help")
    assert show_help.stdout.startswith("usage: reproduce show") and "duplicate-storm" in show_help.stdout
    assert reproduce("show", "nope", check=False).returncode == 2


def test_duplicate_storm(tmp_path, report):
    """The scenario as ``scripts/reproduce duplicate-storm`` runs it: its results (written
    with ``--save-json`` beside the table it prints), its timeline and saved flows, and the
    table the README shows."""
    svg, flows, results = tmp_path / "dup.svg", tmp_path / "dup.flows", tmp_path / "dup.json"
    proc = reproduce("duplicate-storm", "--save-json", str(results), "--timeline", str(svg),
                     "-w", str(flows))
    assert f"results as JSON: {results}" in proc.stdout
    assert_the_readme_shows(_table(proc.stdout), "duplicate-storm")
    data = json.loads(results.read_text())
    cols = data["columns"]
    assert list(cols) == ["plain", "guard409", "default", "once"]
    plain, g409, default, once = (cols[c]["metrics"] for c in cols)
    # without turnguard: the gateway's identical re-sends all run upstream, at the same time
    assert plain["upstream_dispatches"] == 3 and plain["max_in_flight_per_operation"] == 3
    assert plain["incident"]
    # a guard that answers 409 at once: the gateway marks the account and loses the turn
    assert g409["outcomes"] == {"gateway": "lost"} and g409["errors"].get("409", 0) >= 1
    assert g409["gateway_accounts_marked_rate_limited"] >= 1
    for m in (default, once):  # turnguard: one execution, duplicates held, then attached
        assert m["outcomes"] == {"gateway": "completed"}, m
        assert m["upstream_dispatches"] == 1 and m["errors"] == {} and not m["incident"]
        # held, then attached to the original's stream (at once when it already streamed)
        assert m["turnguard"]["held_duplicates"] == 2
        assert m["turnguard"]["attached"] + m["turnguard"]["replayed"] == 2
    # the timeline is well-formed SVG with a panel per column
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = svg.read_text()
    # held until the original's stream started, then attached to it (or, once it ended,
    # replayed)
    assert text.count('class="panel"') == 4 and ("held → attached" in text
                                                  or "held → replayed" in text)
    # the saved flows of the default column carry turnguard's marks and comments
    from mitmproxy import io

    with open(tmp_path / "dup.default.flows", "rb") as f:
        saved = list(io.FlowReader(f).stream())
    marks = {fl.marked for fl in saved}
    assert (":link:" in marks and any("attached to the attempt" in fl.comment for fl in saved)) \
        or (":recycle:" in marks and any("replayed the recorded" in fl.comment for fl in saved))
    report(f"reproduce duplicate-storm: dispatches plain={plain['upstream_dispatches']} "
           f"409-guard={g409['upstream_dispatches']} (turn lost) default={default['upstream_dispatches']} "
           f"once={once['upstream_dispatches']}")


def test_cooldown_503_storm(tmp_path, report):
    svg = tmp_path / "storm.svg"
    # a cooldown longer than the scenario's 3 s: the desktop's ten tries, 200 ms apart, all
    # fall inside it on a loaded machine too (in 3 s, the last of them met a closed circuit)
    cooldown = ("--set", "turnguard_cooldown_ms=8000")
    results = tmp_path / "storm.json"
    proc = reproduce("cooldown-503-storm", "--columns", "default,once", "--timeline", str(svg),
                     "--save-json", str(results), *cooldown)
    table = proc.stdout
    assert "turnguard default: desktop lost the turn: retry budget spent" in table
    # the header shows the values in force, an override included
    assert "turnguard_cooldown_ms=8000 (production 60000)" in table
    assert "turnguard_response_created_timeout_ms=1000 (production 60000)" in table
    # the stall turnguard cut is drawn as a cut, not as a dispatch the client closed
    text = svg.read_text()
    # one per turnguard column (the bar's tooltip: its label is drawn only where it fits)
    assert text.count("outcome cut by turnguard (no response event in time)") >= 2
    data = json.loads(results.read_text())  # (the same run's)
    default, once = data["columns"]["default"]["metrics"], data["columns"]["once"]["metrics"]
    assert default["outcomes"] == {"desktop": "lost"}
    assert default["errors"].get("503", 0) >= 7  # every retry inside the cooldown
    assert default["dispatches_during_cooldown"] == 0 and default["cooldowns_opened"] == 1
    assert once["outcomes"] == {"desktop": "completed"} and not once["incident"]
    assert once["dispatches_during_cooldown"] == 0
    assert once["turnguard"]["recovery_dispatches"] == 1 and "503" not in once["errors"]
    assert once["max_hold_ms"] > 4000  # held through (most of) the 8 s cooldown
    report(f"reproduce cooldown-503-storm: default lost after {default['errors']}; once completed "
           f"(held {once['max_hold_ms']} ms, {once['turnguard']['recovery_dispatches']} recovery dispatch)")


@pytest.mark.parametrize("name, check", [
    ("replay-after-completion",
     lambda c: c["plain"]["reexecuted_after_completion"] == 1 and c["default"]["upstream_dispatches"] == 1
     and c["default"]["turnguard"]["replayed"] == 1),
    ("upstream-429",
     lambda c: all(m["cooldowns_opened"] == 0 and set(m["outcomes"].values()) == {"completed"}
                   for m in c.values())),
    ("codex-websocket-cooldown",  # the Codex ladder on the socket: 503 events, none upstream
     lambda c: c["default"]["outcomes"] == {"codex": "completed"}
     and c["default"]["dispatches_during_cooldown"] == 0 and c["default"]["cooldowns_opened"] == 1
     and c["default"]["errors"].get("503", 0) >= 1 and c["default"]["upstream_dispatches"] == 3),
])
def test_crossing_scenarios(name, check):
    data = json.loads(reproduce(name, "--json", "--columns", "plain,default").stdout)
    metrics = {k: v["metrics"] for k, v in data["columns"].items()}
    assert check(metrics), json.dumps(metrics, indent=1)


@pytest.mark.parametrize("option", ["--timeline", "--save-json"])
@pytest.mark.parametrize("kind", ["missing folder", "fifo", "symlink"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, kind,
                                                                         option):
    """--timeline was written with Path.write_text after the whole run: a missing folder
    lost the run's results to a traceback, a FIFO blocked for ever, a symlink was written
    through. Now one line before anything runs, and nothing is changed; --save-json alike."""
    svg = tmp_path / "t.svg"
    target = tmp_path / "victim.txt"
    if kind == "missing folder":
        svg = tmp_path / "nowhere" / "t.svg"
    elif kind == "fifo":
        os.mkfifo(svg, 0o644)
    else:
        target.write_text("keep me\n")
        svg.symlink_to(target)
    proc = reproduce("duplicate-storm", "--columns", "plain", option, str(svg), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr
    assert option in proc.stderr and proc.stdout == ""
    if kind == "symlink":
        assert target.read_text() == "keep me\n"


def test_under_umask_000_the_work_folders_are_private_and_turnguard_runs(tmp_path):
    """The work folders ``reproduce`` makes (``--keep DIR`` and each column's, which hold its
    ledger, events, logs and the scenario's requests) are 0700 whatever the umask. With
    umask 000 they were 0777: turnguard refused its events file there (a world-writable
    folder) and every turnguard column reported a lost turn that turnguard never saw."""
    keep = tmp_path / "kept" / "run"
    old = os.umask(0)  # the tool inherits it
    try:
        data = json.loads(reproduce("duplicate-storm", "--columns", "default", "--json",
                                    "--keep", str(keep)).stdout)
    finally:
        os.umask(old)
    made = [tmp_path / "kept", keep, keep / "default"]
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in made}
    assert set(modes.values()) == {"0o700"}, modes
    log = (keep / "default" / "mitmdump.log").read_text()
    assert "refused" not in log, log
    m = data["columns"]["default"]["metrics"]
    assert m["outcomes"] == {"gateway": "completed"} and m["upstream_dispatches"] == 1, m


def _table(text: str) -> dict[str, list[str]]:
    """row label -> its cells, from a printed scenario table: the column header is the first
    line that starts with 10 spaces, the rows follow it up to the first blank line (a line of
    dashes skipped), and a line with no label continues the cells of the row before it."""
    lines = text.splitlines()
    head_at = next(i for i, line in enumerate(lines) if line.startswith(" " * 10))
    starts = [m.start() for m in re.finditer(r"(?<=\s\s)\S", lines[head_at])]

    def cells(line: str) -> list[str]:
        return [line[at:end].strip() for at, end in zip(starts, [*starts[1:], None])]

    rows: dict[str, list[str]] = {}
    last = ""
    for line in lines[head_at + 1:]:
        if not line.strip():
            break
        if set(line.strip()) == {"-"}:
            continue
        label = line[:starts[0]].strip()
        if label:
            rows[last := label] = cells(line)
        else:
            rows[last] = [f"{a} {b}".strip() for a, b in zip(rows[last], cells(line))]
    return rows


# rows whose cells are timings, or the answers' mix (held, then attached or replayed: whether
# the original's stream had started), which a run may change
TIMED_ROWS = {"max hold", "wall time", "turnguard answers"}


def assert_the_readme_shows(printed: dict[str, list[str]], name: str) -> None:
    """The README shows what ``scripts/reproduce NAME`` prints (``printed``: its ``_table``):
    the same rows, and in each row that is not a timing the same cells."""
    readme = (REPO / "README.md").read_text()
    sample = readme.split(f"\n    scenario {name} (", 1)[1].split("\n\n", 1)[0]
    documented = _table("\n".join(line[4:] for line in sample.splitlines()))
    assert list(documented) == list(printed)
    for label, cells in printed.items():
        if label not in TIMED_ROWS:
            assert documented[label] == cells, label


def test_the_readmes_sample_table_is_what_the_scenario_prints():
    """The cooldown storm's table as the README shows it: the scenario's own columns and
    options (its test above runs others; the duplicate storm's table is checked there)."""
    assert_the_readme_shows(_table(reproduce("cooldown-503-storm").stdout), "cooldown-503-storm")


@pytest.mark.parametrize("where", ["under /proc", "a file"])
def test_a_keep_folder_that_cannot_be_made_is_refused_before_the_run(tmp_path, where):
    """--keep DIR that cannot be made (under /proc), or that names a file, ended in a
    traceback; now one line before anything runs (the file left as it was)."""
    keep = tmp_path / "a-file" if where == "a file" else Path("/proc/no-such-folder")
    if where == "a file":
        keep.write_text("mine")
    proc = reproduce("duplicate-storm", "--columns", "plain", "--keep", str(keep), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr
    assert "--keep" in proc.stderr and proc.stdout == ""
    assert where != "a file" or keep.read_text() == "mine"
