"""``scripts/chaos`` end to end, through the real wrapper script: its usage, and seeded runs
(locks, pauses and script reloads over HTTP; a full disk and locks over WebSocket calls and
POSTs mixed; a file that is no database moved over the ledger, and the ledger deleted) whose
every check passes (each check is what the README's
Guarantees table promises under those faults: every request answered with the whole stream,
one answer per operation dispatched once, no operation run twice by one process, no traceback,
a sound ledger with nothing left in flight)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from harness import REPO, wait_until

CHAOS = REPO / "scripts" / "chaos"
TIMEOUT_S = 300
STOPPED_WITHIN_S = 45  # its processes stopped one after the other, each up to 10 s


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


def _proc_stat(pid: str) -> tuple[int, int, str] | None:
    """(parent pid, process group, state) of a live process, from /proc; None once gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # (the command's name may hold spaces)
    return int(fields[1]), int(fields[2]), fields[0]


def _group_leaders_started_by(parent: int) -> set[int]:
    """The children of ``parent`` that lead a process group of their own (what the chaos run
    starts: the mock upstream and the two mitmdumps, each in a session of its own)."""
    leaders = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _proc_stat(pid)
        if stat is not None and stat[0] == parent and stat[1] == int(pid):
            leaders.add(int(pid))
    return leaders


def _alive_in_groups(groups: set[int]) -> list[int]:
    """The processes (not yet dead: zombies are) in any of the process groups ``groups``."""
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc"))
            if (stat := _proc_stat(pid)) is not None and stat[1] in groups
            and stat[2] not in ("Z", "X")]


def _mounts_under(folder: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(f"{folder}/")]


@pytest.mark.parametrize("stop_signal, barrage", [
    (signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGHUP, False),
    (signal.SIGTERM, True)], ids=["SIGTERM", "SIGINT", "SIGHUP", "SIGTERM every 5 ms"])
def test_a_run_stopped_by_a_signal_leaves_no_process_and_no_mount(tmp_path, stop_signal,
                                                                  barrage):
    """``scripts/chaos`` stopped by SIGTERM (or SIGINT, or SIGHUP: its terminal closed) while
    its turns run: the processes it started (the mock upstream and the two mitmdumps, each in
    a process group of its own that the signal does not reach) are stopped, the ledger's tmpfs
    (with root: every fault, full included) is unmounted, the work folder removed, and it
    exits 128 + the signal; also when more signals come during its clean-up (``barrage``:
    one every 5 ms until it exits). (A SIGTERM ended it at once: all of them, and the mount,
    were left behind; a SIGHUP still does so; a second SIGTERM during the clean-up left the
    work folder half removed.)"""
    out = tmp_path / "chaos.out"
    with open(out, "wb") as f:
        run = subprocess.Popen([str(CHAOS), "--seed", "1", "--ops", "30"], stdout=f,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                               env={**os.environ, "TMPDIR": str(tmp_path)})
    groups: set[int] = set()
    try:
        def both_proxies_listen() -> bool:
            groups.update(_group_leaders_started_by(run.pid))
            assert run.poll() is None, out.read_text()
            logs = list(tmp_path.glob("turnguard-chaos-*/[AB].log"))
            return len(groups) == 3 and len(logs) == 2 and all(
                "listening at" in log.read_text(errors="replace") for log in logs)

        wait_until(both_proxies_listen, 60, interval=0.1, what="the chaos run's processes")
        mounted = _mounts_under(tmp_path)
        assert mounted or "the fault full is left out" in out.read_text(), out.read_text()
        run.send_signal(stop_signal)
        for _ in range(4000 if barrage else 0):  # bounded: 20 s at most
            if run.poll() is not None:
                break
            run.send_signal(stop_signal)
            time.sleep(0.005)
        status = run.wait(STOPPED_WITHIN_S)
        wait_until(lambda: not _alive_in_groups(groups), 10, interval=0.1,
                   what=f"the processes of groups {sorted(groups)} gone")
        assert not _mounts_under(tmp_path), (mounted, out.read_text())
        assert status == 128 + stop_signal, out.read_text()
        assert not list(tmp_path.glob("turnguard-chaos-*")), "the work folder is left"
        text = out.read_text()
        assert f"stopped by {stop_signal.name}" in text and "Traceback" not in text, text
    finally:  # (what the run left, if it did: only what it started)
        if run.poll() is None:
            run.kill()
            run.wait(10)
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for mount in _mounts_under(tmp_path):
            subprocess.run(["umount", "-l", mount], check=False, timeout=30)
