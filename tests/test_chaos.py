"""``scripts/chaos`` end to end, through the real wrapper script: its usage, and seeded runs
(locks, pauses and script reloads over HTTP; a full disk and locks over WebSocket calls and
POSTs mixed; a file that is no database moved over the ledger, and the ledger deleted) whose
every check passes (each check is what the README's
Guarantees table promises under those faults: every request answered with the whole stream,
one answer per operation dispatched once, no operation run twice by one process, no traceback,
a sound ledger with nothing left in flight)."""

from __future__ import annotations

import json
import subprocess

import pytest

from harness import REPO

CHAOS = REPO / "scripts" / "chaos"
TIMEOUT_S = 300


def chaos(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CHAOS), *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=REPO, stdin=subprocess.DEVNULL)


def test_usage_and_bad_arguments():
    shown = chaos("--help")
    assert shown.returncode == 0 and "faults:" in shown.stdout and "mv_older" in shown.stdout \
        and "junk" in shown.stdout
    for args, says in ((["--faults", "lock,flood"], "unknown fault(s): flood"),
                       (["--ops", "0"], "--ops must be between 1 and 500"),
                       (["--transport", "grpc"], "invalid choice: 'grpc'")):
        refused = chaos(*args)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr


def test_a_run_with_locks_pauses_and_reloads_passes_every_check(tmp_path, report):
    out = tmp_path / "chaos.json"
    run = chaos("--seed", "2", "--ops", "12", "--faults", "lock,stop,reload", "--sessions",
                "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert data["violations"] == {} and data["ledger_sound"] is True
    assert data["attempts_left_in_flight"] == 0
    assert data["faults"], "no fault came during the run"
    assert "violations: none" in run.stdout and "Traceback" not in run.stdout + run.stderr
    report(f"scripts/chaos --seed 2 --ops 12 --faults lock,stop,reload --sessions: "
           f"{len(data['faults'])} faults, no check failed, "
           f"{data['dispatched_more_than_once']} operations dispatched more than once")


def test_a_run_of_websocket_calls_and_posts_with_a_full_disk_and_locks_passes_every_check(
        tmp_path, report):
    out = tmp_path / "chaos.json"
    run = chaos("--seed", "1", "--ops", "10", "--faults", "full,lock", "--transport", "mixed",
                "--json", str(out))
    if run.returncode == 2 and "tmpfs" in run.stderr:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert data["violations"] == {} and data["ledger_sound"] is True
    assert data["attempts_left_in_flight"] == 0
    assert any(fault == "full" for _, fault in data["faults"]), data["faults"]
    assert data["requests"].get("http") and data["requests"].get("ws"), data["requests"]
    report(f"scripts/chaos --seed 1 --ops 10 --faults full,lock --transport mixed: "
           f"{len(data['faults'])} faults, no check failed, "
           f"{data['requests']} requests, "
           f"{data['dispatched_more_than_once']} operations dispatched more than once")


def test_a_run_with_junk_over_the_ledger_and_deletions_passes_every_check(tmp_path, report):
    out = tmp_path / "chaos.json"
    run = chaos("--seed", "3", "--ops", "12", "--faults", "junk,rm_all", "--transport", "mixed",
                "--sessions", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert data["violations"] == {} and data["ledger_sound"] is True
    assert data["attempts_left_in_flight"] == 0
    assert any(fault == "junk" for _, fault in data["faults"]), data["faults"]
    assert "Traceback" not in run.stdout + run.stderr
    report(f"scripts/chaos --seed 3 --ops 12 --faults junk,rm_all --transport mixed --sessions: "
           f"{len(data['faults'])} faults, no check failed, "
           f"{data['dispatched_more_than_once']} operations dispatched more than once")
