"""The user-facing scripts, as real processes: ``scripts/proxy`` and ``scripts/ledger``.

``scripts/proxy`` with no upstream runs the offline mock upstream and mitmdump in front of it;
these tests send real requests through it, stop it with signals and check that no process is
left behind. ``scripts/ledger`` is run against the ledger that run wrote and against one written
directly with ``Ledger``. Every wait is bounded; everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import contextlib
import os
import random
import re
import shutil
import signal
import stat
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import pg_server
from harness import REPO, read_jsonl, sse_event_types, sse_post, wait_until
from turnguard_core import identity, policy
from turnguard_core.ledger import AttemptEnd, Ledger, Recording

PROXY = REPO / "scripts" / "proxy"
LEDGER = REPO / "scripts" / "ledger"
START_TIMEOUT_S = 40.0  # includes the set-up check of scripts/_python.sh
STOP_TIMEOUT_S = 25.0  # the script gives each child up to 10 s before SIGKILL
CLI_TIMEOUT_S = 60.0

_MOCK_PID = re.compile(r"OFFLINE MOCK upstream (http://127\.0\.0\.1:\d+) \(pid (\d+)\)")
_LISTENING = re.compile(r"listening at 127\.0\.0\.1:(\d+)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNGUARD_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _free_port() -> int:
    """A free loopback port below Linux's ephemeral range (32768-60999), so that no connection
    or port-0 listener of a parallel test (or the proxy's own mock) takes it before it is used."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free loopback port in 20000-32000 after 200 tries")


def _processes_mentioning(needle: str) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) process whose command line has
    ``needle``."""
    out = subprocess.run(
        ["ps", "-A", "-ww", "-o", "pid=,stat=,args="], capture_output=True, text=True, timeout=10,
        check=True,
    ).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and needle in parts[2] and not parts[1].startswith("Z"):
            found[int(parts[0])] = parts[2]
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    r = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, timeout=10)
    stat = r.stdout.strip()
    return bool(stat) and not stat.startswith("Z")


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class ProxyRun:
    """What a ``scripts/proxy`` run in front of the mock did (see ``_run_proxy``)."""

    tmp: Path
    ledger: Path
    out: str
    rc: int | None
    first: tuple[int, dict[str, str], bytes]
    second: tuple[int, dict[str, str], bytes]
    mock_pid: int
    mitmdump_pids: list[int]
    dispatches: list[dict]
    leftovers: dict[int, str]
    stop_s: float


def _start_proxy(tmp: Path, name: str, ledger: str | None = None, path_first: Path | None = None
                 ) -> tuple[subprocess.Popen[bytes], Path, int]:
    """scripts/proxy started in a session of its own; ``path_first``: a folder searched for its
    commands before $PATH."""
    port = _free_port()
    out_path = tmp / f"{name}.out"
    cmd = [
        str(PROXY), "--port", str(port), "--",
        "--set", f"confdir={tmp / 'confdir'}",
        "--set", f"turnguard_ledger={ledger or tmp / 'l.sqlite3'}",
    ]  # fmt: skip
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=tmp,
            env=_env(TURNGUARD_STATE_DIR=str(tmp / "state"),
                     **({"PATH": f"{path_first}:{os.environ['PATH']}"} if path_first else {})),
            start_new_session=True,
        )
    return proc, out_path, port


def _wait_listening(proc: subprocess.Popen[bytes], out_path: Path, port: int) -> str:
    def ready() -> str | None:
        text = out_path.read_text(errors="replace")
        m = _LISTENING.search(text)
        if m and int(m.group(1)) == port:
            return text
        if proc.poll() is not None:
            raise AssertionError(f"scripts/proxy exited with {proc.returncode}:\n{text}")
        return None

    return wait_until(ready, START_TIMEOUT_S, 0.05, "scripts/proxy to listen")


def _wait_banner(proc: subprocess.Popen[bytes], out_path: Path, port: int) -> None:
    """scripts/proxy listening, and its banner (what to try) printed."""
    _wait_listening(proc, out_path, port)
    wait_until(lambda: "try:" in out_path.read_text(errors="replace"), START_TIMEOUT_S, 0.05,
               "the banner")


def _stop(proc: subprocess.Popen[bytes], sig: int, *, group: bool) -> float:
    """Send ``sig`` (to the group or to the script only); wait for the script; return seconds."""
    t0 = time.monotonic()
    if group:
        _kill_group(proc, sig)
    else:
        proc.send_signal(sig)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stuck = _session_processes(proc.pid)  # (what each was doing, before they are killed)
        for pgid in {pgid for pgid, _ in stuck.values()} | {proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)  # the script's group and its children's own
        proc.wait(10)
        listing = "\n".join(f"  {pid} {line}" for pid, (_, line) in sorted(stuck.items()))
        raise AssertionError(f"scripts/proxy did not exit within {STOP_TIMEOUT_S} s of {sig!r};"
                             f" its processes then (pid stat wchan args):\n{listing}") from None
    return time.monotonic() - t0


def _session_processes(sid: int) -> dict[int, tuple[int, str]]:
    """pid -> (process group, "stat wchan args") of each live process of session ``sid`` (the
    script started with ``start_new_session``: its children in their own groups included)."""
    out = subprocess.run(
        ["ps", "-A", "-ww", "-o", "pid=,pgid=,sid=,stat=,wchan:24=,args="], capture_output=True,
        text=True, timeout=10, check=False,
    ).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[2] == str(sid) and not parts[3].startswith("Z"):
            found[int(parts[0])] = (int(parts[1]), parts[3])
    return found


def _run_proxy(tmp: Path, *, stop_group: bool) -> ProxyRun:
    """Start scripts/proxy with no upstream, POST the same request twice, stop it with SIGTERM
    (to its whole process group, or to the script alone) and look for leftover processes."""
    proc, out_path, port = _start_proxy(tmp, "proxy")
    try:
        text = _wait_listening(proc, out_path, port)
        m = _MOCK_PID.search(text)
        assert m, f"no mock upstream line in:\n{text}"
        mock_pid = int(m.group(2))
        mitmdump_pids = [
            pid for pid, args in _processes_mentioning(str(tmp)).items() if "mitmdump" in args
        ]
        url = f"http://127.0.0.1:{port}"
        first = sse_post(url, timeout=30)
        second = sse_post(url, timeout=30)
        dispatches = [
            r for r in read_jsonl(tmp / "state" / "mock-upstream.jsonl") if r.get("event") == "dispatch"
        ]
        stop_s = _stop(proc, signal.SIGTERM, group=stop_group)
        # The script reaps its children before it exits: nothing should be left at once. Poll
        # briefly anyway so that a slow machine reports what stayed, not a race.
        leftovers: dict[int, str] = {}

        def nothing_left() -> bool:
            nonlocal leftovers
            leftovers = _processes_mentioning(str(tmp))
            if _alive(mock_pid):
                leftovers.setdefault(mock_pid, "mock upstream")
            return not leftovers

        try:
            wait_until(nothing_left, 5, 0.1, "no leftover processes")
        except AssertionError:
            pass
        return ProxyRun(
            tmp=tmp, ledger=tmp / "l.sqlite3", out=out_path.read_text(errors="replace"),
            rc=proc.returncode, first=first, second=second, mock_pid=mock_pid,
            mitmdump_pids=mitmdump_pids, dispatches=dispatches, leftovers=leftovers, stop_s=stop_s,
        )
    finally:
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)
            proc.wait(10)
        for pid in _processes_mentioning(str(tmp)):  # only processes of this test's tmp dir
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def proxy_run(tmp_path_factory) -> ProxyRun:
    return _run_proxy(tmp_path_factory.mktemp("proxy"), stop_group=True)


def _ledger_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LEDGER), *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        env=env or _env(), stdin=subprocess.DEVNULL,
    )


# -- scripts/proxy ---------------------------------------------------------------------------


def test_proxy_help_prints_usage():
    r = subprocess.run([str(PROXY), "--help"], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Usage: scripts/proxy [--web] [--port N] [UPSTREAM_URL]")
    for needle in ("8080", "turnguard.sqlite3", "--set turnguard_", "https://api.openai.com", "mock"):
        assert needle in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unknown option '--bogus'"),
        (["--port", "abc"], "port must be a number"),
        (["--port", "70000"], "port must be a number"),
        (["--port"], "--port needs a value"),
        (["ftp://example.invalid"], "UPSTREAM_URL must start with http:// or https://"),
        (["http://127.0.0.1:1", "http://127.0.0.1:2"], "more than one upstream URL"),
        # mitmproxy's reverse mode takes a server, not a base path: said here, before set-up
        (["https://example.invalid/openai"], "UPSTREAM_URL names a server"),
        (["https://example.invalid?key=1"], "UPSTREAM_URL names a server"),
    ],
)
def test_proxy_rejects_bad_arguments(args, message):
    r = subprocess.run([str(PROXY), *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=_env())
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Usage: scripts/proxy" in r.stderr
    assert r.stdout == ""  # nothing started


def test_proxy_rejects_non_numeric_port_from_env():
    r = subprocess.run([str(PROXY)], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=_env(TURNGUARD_PORT="80a"))
    assert r.returncode == 2 and "from TURNGUARD_PORT" in r.stderr


def test_proxy_fronts_the_mock_replays_and_leaves_nothing_behind(proxy_run: ProxyRun, report):
    run = proxy_run
    assert "fronts the OFFLINE MOCK upstream" in run.out and "mock-upstream.jsonl" in run.out
    assert "curl -N http://127.0.0.1:" in run.out and f"ledger {run.ledger}" in run.out
    status, headers, body = run.first
    assert status == 200, body
    assert sse_event_types(body)[-1] == "response.completed"
    assert "x-turnguard" not in headers
    status2, headers2, body2 = run.second
    assert status2 == 200 and headers2.get("x-turnguard") == "replayed"
    assert body2 == body
    assert [d["n"] for d in run.dispatches] == [0], "the replay must not reach the upstream"
    events_file = run.ledger.parent / "state" / "turnguard-events.jsonl"  # the default
    assert f"events file {events_file}" in run.out
    assert stat.S_IMODE(events_file.stat().st_mode) == 0o600
    kinds = [e["event"] for e in read_jsonl(events_file)]
    assert kinds.count("dispatch") == 1 and kinds.count("duplicate_replayed") == 1
    assert run.mitmdump_pids, f"no mitmdump process found for {run.tmp}"
    assert run.leftovers == {}, f"processes left behind: {run.leftovers}"
    assert not any(_alive(p) for p in [run.mock_pid, *run.mitmdump_pids])
    assert "Traceback" not in run.out, run.out
    report(f"scripts/proxy: mock + mitmdump, replay ok, SIGTERM to the group stopped both in {run.stop_s:.1f} s")


def test_proxy_sigterm_to_the_script_alone_stops_its_children(tmp_path, report):
    """The trap, not the group signal, stops mitmdump and the mock."""
    run = _run_proxy(tmp_path, stop_group=False)
    assert run.first[0] == 200 and run.second[1].get("x-turnguard") == "replayed"
    assert run.rc == 128 + signal.SIGTERM
    assert run.leftovers == {}, f"processes left behind: {run.leftovers}"
    assert not any(_alive(p) for p in [run.mock_pid, *run.mitmdump_pids])
    report(f"scripts/proxy: SIGTERM to the script alone stopped mock + mitmdump in {run.stop_s:.1f} s")


def _proxy_to_exit(tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run scripts/proxy (mock upstream) until it exits by itself; (status, output)."""
    with open(tmp_path / "out", "wb") as out:
        proc = subprocess.Popen(
            [str(PROXY), *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            cwd=tmp_path, env=_env(TURNGUARD_STATE_DIR=str(tmp_path / "state")),
            start_new_session=True,
        )
    try:
        rc = proc.wait(START_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)
            proc.wait(10)
    return rc, (tmp_path / "out").read_text(errors="replace")


def test_proxy_never_prints_the_password_of_a_postgres_ledger(tmp_path):
    """The banner names the ledger and the status command for it: a PostgreSQL URL's password
    is shown as ***, like everywhere turnguard shows the ledger (nothing listens on port 1:
    the ledger is down, the proxy runs and prints its banner all the same)."""
    url = "postgresql://tg:s3cret-pw@127.0.0.1:1/ledger?sslmode=disable&sslpassword=k3y-pw"
    proc, out_path, port = _start_proxy(tmp_path, "proxy", ledger=url)
    try:
        _wait_listening(proc, out_path, port)
        out = wait_until(lambda: "(status: " in (t := out_path.read_text(errors="replace"))
                         and t, START_TIMEOUT_S, 0.05, "the banner")
    finally:
        _stop(proc, signal.SIGTERM, group=True)
    assert "s3cret" not in out and "k3y" not in out, out
    assert "turnguard: ledger postgresql://tg:***@127.0.0.1:1/ledger?sslmode=disable" \
           "&sslpassword=***" in out, out


def test_proxy_on_a_port_in_use_says_to_use_port_and_stops_the_mock(tmp_path):
    with socket.socket() as busy:  # mitmdump cannot listen on a port already taken
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, out = _proxy_to_exit(tmp_path, "--port", str(port), "--", "--set", f"confdir={tmp_path / 'c'}")
    assert rc != 0
    assert out.rstrip().splitlines()[-1] == (
        f"scripts/proxy: port {port} on 127.0.0.1 is in use; choose another with --port N "
        "(or TURNGUARD_PORT=N)"
    ), out
    assert "--mode reverse:" not in out  # mitmproxy's advice does not apply to this script
    assert "try:" not in out and "curl" not in out  # no banner for a proxy that never ran
    assert "Traceback" not in out
    assert _processes_mentioning(str(tmp_path)) == {}


@pytest.mark.parametrize(
    "setting, needle",
    [
        ("turnguard_hold_timeout_ms=abc", "turnguard_hold_timeout_ms=abc is not an integer"),
        ("turnguard_replay=maybe", "turnguard_replay=maybe is not true or false"),
        ("turnguard_holdtimeout_ms=5", "unknown option turnguard_holdtimeout_ms=5"),
    ],
)
def test_proxy_with_a_bad_option_stops_with_one_line_and_no_banner(tmp_path, setting, needle):
    rc, out = _proxy_to_exit(
        tmp_path, "--port", str(_free_port()), "--", "--set", f"confdir={tmp_path / 'c'}",
        "--set", setting,
    )
    assert rc != 0, out
    lines = [line for line in out.splitlines() if needle in line]
    assert len(lines) == 1, out
    assert "try:" not in out and "Traceback" not in out, out
    assert _processes_mentioning(str(tmp_path)) == {}


# The race these rounds hunt (a second SIGTERM to mitmdump racing its shutdown printed a
# traceback) was Python 3.13's, through its signal wake-up fd; an older Python, run beside the
# main run (scripts/test), gets a few rounds: each is an exec'd mitmdump and mock, 1.2 CPU s.
GROUP_SIGTERM_ROUNDS = 20 if sys.version_info >= (3, 13) else 5


@pytest.mark.every_python
@pytest.mark.slow
def test_proxy_stops_on_a_group_sigterm_without_a_traceback_20_times(tmp_path, report):
    """SIGTERM to the script's process group, as ^C or a supervisor sends it: the script alone
    gets it and gives each child exactly one; no traceback, nothing left behind (20 times on
    Python 3.13 and newer, ``GROUP_SIGTERM_ROUNDS``)."""
    def one_round(i: int) -> None:  # (independent processes: a few rounds at a time)
        run_dir = tmp_path / f"run{i:02d}"  # (no name a prefix of another)
        run_dir.mkdir()
        proc, out_path, port = _start_proxy(run_dir, "proxy")
        try:
            _wait_banner(proc, out_path, port)
            _stop(proc, signal.SIGTERM, group=True)
        finally:
            if proc.poll() is None:
                _kill_group(proc, signal.SIGKILL)
                proc.wait(10)
        out = out_path.read_text(errors="replace")
        assert proc.returncode == 128 + signal.SIGTERM, out
        assert "Traceback" not in out and "Exception ignored" not in out, out
        wait_until(lambda: _processes_mentioning(str(run_dir)) == {}, 5, 0.1, "no leftovers")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one_round, range(GROUP_SIGTERM_ROUNDS)))  # (raises the first failure)
    report(f"scripts/proxy on Python {sys.version.split()[0]}: stopped by a group SIGTERM "
           f"{GROUP_SIGTERM_ROUNDS} times, "
           "no traceback, nothing left behind")


def test_proxy_stop_bound_is_time_not_a_count_of_sleeps(tmp_path):
    """scripts/proxy gives each child STOP_TIMEOUT_S (10 s) after its SIGTERM, then SIGKILL.
    That bound is time: on a loaded machine each ``sleep 0.1`` of its wait takes longer (a
    fork and an exec), and a bound counted as 100 of them stretches with it (here each takes
    0.5 s: 50 s, past the 25 s the tests give the script). mitmdump is paused (SIGSTOP), so
    that it does not stop on its SIGTERM; the script must still be gone within the bound."""
    slow_bin = tmp_path / "slow-bin"
    slow_bin.mkdir()
    (slow_bin / "sleep").write_text("#!/bin/sh\nexec /bin/sleep 0.5  # a slow fork and exec\n")
    (slow_bin / "sleep").chmod(0o755)
    proc, out_path, port = _start_proxy(tmp_path, "proxy", path_first=slow_bin)
    try:
        _wait_banner(proc, out_path, port)
        [mitm] = [pid for pid, (_, line) in _session_processes(proc.pid).items()
                  if "mitmdump" in line and "scripts/proxy" not in line]
        os.kill(mitm, signal.SIGSTOP)
        _stop(proc, signal.SIGTERM, group=True)  # (fails past STOP_TIMEOUT_S, 25 s)
    finally:
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)
            proc.wait(10)
    out = out_path.read_text(errors="replace")
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert f"pid {mitm} did not stop within 10s; killing it" in out, out
    wait_until(lambda: _processes_mentioning(str(tmp_path)) == {}, 5, 0.1, "no leftovers")


def test_proxy_mock_start_bound_is_time_not_a_count_of_sleeps(tmp_path):
    """scripts/proxy gives the offline mock MOCK_START_TIMEOUT_S (20 s) to print its listening
    line, then says so and exits with status 1. That bound is time: counted as 200 sleeps of
    0.1 s it stretches with each fork and exec of ``sleep`` on a loaded machine (here each
    takes 0.5 s: 100 s). The mock here never starts: its log (in the state folder) is a FIFO
    nobody reads, so it blocks opening it, before its listening line."""
    slow_bin = tmp_path / "slow-bin"
    slow_bin.mkdir()
    (slow_bin / "sleep").write_text("#!/bin/sh\nexec /bin/sleep 0.5  # a slow fork and exec\n")
    (slow_bin / "sleep").chmod(0o755)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.mkfifo(state / "mock-upstream.jsonl", 0o600)
    proc, out_path, _ = _start_proxy(tmp_path, "proxy", path_first=slow_bin)
    try:
        rc = proc.wait(START_TIMEOUT_S + 20)  # its set-up check, then the 20 s bound
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        for pgid in {pgid for pgid, _ in _session_processes(proc.pid).values()} | {proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)  # the script's group and its children's own
        proc.wait(10)
    out = out_path.read_text(errors="replace")
    assert rc == 1, out
    assert "the mock upstream did not start within 20s" in out, out
    wait_until(lambda: _processes_mentioning(str(tmp_path)) == {}, 5, 0.1, "no leftovers")


# -- scripts/ledger on the proxy's ledger ----------------------------------------------------


def test_ledger_list_show_stats_on_the_proxy_ledger(proxy_run: ProxyRun):
    led = str(proxy_run.ledger)
    r = _ledger_cli("--ledger", led, "list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["OP", "STATE", "ATTEMPTS", "REQUEST", "UPDATED", "(UTC)", "REPLAYABLE"]
    assert len(lines) == 2
    op, state, attempts, method, path, updated, replayable = lines[1].split()
    assert (state, attempts, method, path, replayable) == ("completed", "1", "POST", "/v1/responses", "yes")
    assert re.fullmatch(r"[0-9a-f]{12}", op)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", updated)

    r = _ledger_cli("--ledger", led, "list", "--json")
    assert r.returncode == 0, r.stderr
    ops = json.loads(r.stdout)
    assert [o["op"] for o in ops] == [op] and ops[0]["replayable"] is True

    r = _ledger_cli("--ledger", led, "show", op[:8])
    assert r.returncode == 0, r.stderr
    assert ops[0]["op_key"] in r.stdout
    assert re.search(r"outcome:\s+completed", r.stdout)
    assert re.search(r"status:\s+200", r.stdout)
    assert "attempt 1 (original)" in r.stdout

    r = _ledger_cli("show", op, "--json", "--ledger", led)  # --ledger after the command too
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert [(a["kind"], a["outcome"], a["status"]) for a in shown["attempt_rows"]] == [
        ("original", "completed", 200)
    ]
    assert shown["attempt_rows"][0]["body_bytes"] == len(proxy_run.first[2])
    assert "headers" not in shown["attempt_rows"][0]

    r = _ledger_cli("stats", env=_env(TURNGUARD_LEDGER=led))  # the default comes from the env
    assert r.returncode == 0, r.stderr
    assert re.search(r"completed:\s+1", r.stdout) and re.search(r"integrity:\s+ok", r.stdout)

    r = _ledger_cli("--ledger", led, "show", "zzz")
    assert r.returncode == 1 and "no operation whose id starts with 'zzz'" in r.stderr


# -- scripts/ledger on a ledger written directly ----------------------------------------------


def _ident(body: dict) -> identity.Identity:
    view = identity.RequestView(
        "POST", "/v1/responses", (("authorization", "Bearer k1"), ("session-id", "s1")),
        json.dumps(body).encode(),
    )
    out = identity.identify(view)
    assert isinstance(out, identity.Identity)
    return out


@dataclass
class DirectLedger:
    path: Path
    completed: str  # op key of the completed, replayable operation
    twins: tuple[str, str]  # op keys of two unknown operations with the same first hex digit


@pytest.fixture
def direct_ledger(tmp_path) -> DirectLedger:
    """A ledger written with ``Ledger`` itself: one completed operation whose recording has a
    secret-looking header, and unknown ones until two share a first hex digit (at most 17)."""
    path = tmp_path / "direct.sqlite3"
    t0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
    led = Ledger(str(path), "writer")
    led.open(t0)
    try:
        guard = policy.GuardPolicy()
        done = _ident({"model": "m", "input": "done"})
        d = led.admit(done, method="POST", path="/v1/responses", now=t0, guard=guard, flow_id="f")
        assert isinstance(d, policy.Dispatch)
        headers = (("content-type", "text/event-stream"), ("x-api-key", "SECRET-VALUE"))
        rec = Recording(200, headers, b"data: x\n\n")
        led.finish(d.attempt_id, AttemptEnd("completed", 200, 3, None, rec), now=t0 + 2.5)
        by_digit: dict[str, str] = {}
        for n in range(17):
            ident = _ident({"model": "m", "input": f"lost {n}"})
            d = led.admit(ident, method="POST", path="/v1/responses", now=t0 + 10 + n, guard=guard, flow_id=f"f{n}")
            assert isinstance(d, policy.Dispatch)
            led.finish(d.attempt_id, AttemptEnd("unknown", None, 0, "upstream reset"), now=t0 + 10.5 + n)
            digit = ident.op_key[0]
            if digit in by_digit and not done.op_key.startswith(digit):
                twins = (by_digit[digit], ident.op_key)
                break
            by_digit[digit] = ident.op_key
        else:
            raise AssertionError("17 operations without two sharing a first hex digit")
    finally:
        led.close()
    return DirectLedger(path, done.op_key, twins)


def test_ledger_show_never_prints_recorded_headers(direct_ledger: DirectLedger):
    led = str(direct_ledger.path)
    for extra in ([], ["--json"]):
        r = _ledger_cli("--ledger", led, "show", direct_ledger.completed[:10], *extra)
        assert r.returncode == 0, r.stderr
        assert "SECRET-VALUE" not in r.stdout and "x-api-key" not in r.stdout
        assert "2023-11-14T22:13:22.500Z" in r.stdout  # ended, ISO-8601 UTC
    shown = json.loads(r.stdout)
    assert shown["state"] == "completed" and shown["attempt_rows"][0]["replayable"] is True
    assert shown["attempt_rows"][0]["body_bytes"] == len(b"data: x\n\n")
    r = _ledger_cli("--ledger", led, "show", direct_ledger.twins[0][:10])
    assert r.returncode == 0, r.stderr
    assert re.search(r"outcome:\s+unknown", r.stdout) and "upstream reset" in r.stdout


def test_ledger_errors(direct_ledger: DirectLedger, tmp_path):
    led = str(direct_ledger.path)
    a, b = direct_ledger.twins
    r = _ledger_cli("--ledger", led, "show", a[0])
    assert r.returncode == 1 and "ambiguous" in r.stderr
    assert a[:12] in r.stderr or b[:12] in r.stderr
    r = _ledger_cli("--ledger", led, "show", "zzz")
    assert r.returncode == 1 and "no operation whose id starts with 'zzz'" in r.stderr
    missing = tmp_path / "missing.sqlite3"
    r = _ledger_cli("--ledger", str(missing), "list")
    assert r.returncode == 1 and f"no ledger at {missing}" in r.stderr
    assert not missing.exists()  # inspection never creates a ledger
    not_a_ledger = tmp_path / "other.sqlite3"
    sqlite3.connect(not_a_ledger).close()
    r = _ledger_cli("--ledger", str(not_a_ledger), "stats")
    assert r.returncode == 1 and "schema version 0" in r.stderr
    for args in (["--ledger", led], ["--ledger", led, "frobnicate"], ["--ledger", led, "list", "--limit", "x"]):
        r = _ledger_cli(*args)
        assert r.returncode == 2 and "usage:" in r.stderr, args


@pytest.mark.parametrize("args", [["--bogus"], ["--ledger", "x.sqlite3", "--bogus"],
                                  ["--bogus", "status"], ["status", "--bogus"]])
def test_ledger_cli_names_an_unknown_option_wherever_it_stands(args):
    """An option scripts/turnguard does not know is named in its usage error, also when no
    command follows it (not taken for a missing command)."""
    r = _ledger_cli(*args)
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr, r.stderr
    assert r.stderr.startswith("usage: scripts/ledger "), r.stderr


@pytest.mark.parametrize("args", [("--ledger", "", "circuit", "clear", "--all"),
                                  ("circuit", "clear", "--all", "--ledger", " ")])
def test_ledger_cli_refuses_an_empty_ledger_instead_of_using_the_default(tmp_path, args):
    """``--ledger "$UNSET"`` is a usage error: never the default ledger in the one meant's
    place (here a clear of every circuit), nor anything made there."""
    r = _ledger_cli(*args, env=_env(HOME=str(tmp_path), TURNGUARD_LEDGER=""))
    assert r.returncode == 2 and "--ledger is empty" in r.stderr, r.stderr
    assert not any(tmp_path.rglob("*.sqlite3*"))


def test_ledger_cli_without_a_command_says_it_needs_one():
    r = _ledger_cli("--ledger", "x.sqlite3")
    assert r.returncode == 2 and "the following arguments are required: COMMAND" in r.stderr


def test_ledger_cli_reads_without_writing(direct_ledger: DirectLedger):
    led = str(direct_ledger.path)
    r = _ledger_cli("--ledger", led, "stats", "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["by_state"]["completed"] == 1 and stats["by_state"]["unknown"] >= 2
    assert stats["integrity_ok"] is True
    r = _ledger_cli("--ledger", led, "list", "--limit", "2")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3
    db = sqlite3.connect(f"file:{led}?mode=ro", uri=True)
    try:
        assert db.execute("SELECT instance_id FROM instances").fetchall() == [("writer",)]
    finally:
        db.close()


def test_inspection_of_a_closed_ledger_makes_no_file_beside_it(direct_ledger: DirectLedger):
    """No process has the ledger open (no -wal): every inspection command reads it without
    SQLite's -wal and -shm appearing next to it (they would take the ledger's mode, here 0644),
    and leaves the file as it was. (A ledger's connections leave its -wal and -shm, emptied,
    when they close: here the file alone, as one copied elsewhere is.)"""
    led = direct_ledger.path
    for suffix in ("-wal", "-shm"):
        os.unlink(f"{led}{suffix}")
    os.chmod(led, 0o644)
    before = led.stat()
    for args in (["status"], ["status", "--json"], ["list"], ["stats"], ["audit"],
                 ["circuit", "list"], ["show", direct_ledger.completed[:10]]):
        r = _ledger_cli("--ledger", str(led), *args)
        assert r.returncode == 0, (args, r.stderr)
        assert sorted(p.name for p in led.parent.iterdir()) == [led.name], args
    after = led.stat()
    assert (after.st_mode, after.st_size, after.st_mtime_ns) == \
        (before.st_mode, before.st_size, before.st_mtime_ns)
    with contextlib.closing(sqlite3.connect(f"file:{led}?immutable=1", uri=True)) as db:
        [(ops,)] = db.execute("SELECT count(*) FROM operations").fetchall()
    assert re.search(rf"operations:\s+{ops} ", _ledger_cli("--ledger", str(led), "status").stdout)


def test_inspection_next_to_a_running_writer_sees_its_latest_rows(direct_ledger: DirectLedger):
    """With a connection open (its -wal holds rows not yet in the file), inspection reads
    through the -wal and -shm and sees them."""
    led = direct_ledger.path
    with contextlib.closing(sqlite3.connect(led, isolation_level=None)) as other:
        other.execute("PRAGMA wal_autocheckpoint=0")
        other.execute("UPDATE operations SET state='unknown' WHERE state='completed'")
        assert Path(f"{led}-wal").stat().st_size > 0
        r = _ledger_cli("--ledger", str(led), "stats", "--json")
        assert r.returncode == 0, r.stderr
        assert "completed" not in json.loads(r.stdout)["by_state"]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_scripts_reproduce_stopped_by_sigterm_stops_every_process_it_started(tmp_path, sigint):
    """SIGTERM to scripts/reproduce mid-run stops it as ^C does: every column's mitmdump and
    mock upstream goes with it (they kept running before, orphaned). Also as a shell's
    background job, which ignores SIGINT: SIGTERM was turned into a SIGINT, and then it did
    nothing (the run went on to its end and exited 0)."""
    work = tmp_path / "work"
    log = (tmp_path / "reproduce.out").open("wb")
    proc = subprocess.Popen(
        [str(REPO / "scripts" / "reproduce"), "duplicate-storm", "--keep", str(work)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
        env=_env(), start_new_session=True,
        preexec_fn=_ignore_sigint if sigint == "ignored" else None)
    try:
        # (its log, not ps: one ps of every process once took seconds on a loaded machine,
        # and the run had ended before the SIGTERM)
        wait_until(lambda: any("listening at" in log.read_text(errors="replace")
                               for log in work.glob("*/mitmdump.log")), 120, 0.1,
                   "a column's mitmdump listening")
        assert proc.poll() is None, "the run ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        left: dict[int, str] = {}

        def none_left() -> bool:
            left.clear()
            left.update(_processes_mentioning(str(work)))
            return not left

        try:
            wait_until(none_left, 10, 0.1, "every process it started stopped")
        except AssertionError:
            raise AssertionError(f"left running: {left}") from None
    finally:
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)
            proc.wait(10)
        for pid in _processes_mentioning(str(work)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
    assert "Traceback" not in (tmp_path / "reproduce.out").read_text(errors="replace")


def test_reproduce_interrupted_twice_mid_start_stops_every_process_it_started(tmp_path):
    """^C, then ^C again at once (or SIGTERM twice), the first as soon as one column's mock
    upstream listens and its mitmdump is starting (the other column still starting): every
    process a column started is stopped by the time asyncio.run returns. A column's stop was a
    task the second interrupt's teardown cancelled before it ever ran, which left that
    column's mock upstream running, orphaned."""
    import asyncio
    import threading

    from turnguard_repro import runner, scenarios

    assert threading.current_thread() is threading.main_thread()
    scen = scenarios.validate(scenarios.builtin("duplicate-storm"))
    work = tmp_path / "work"
    cols = ["plain", "once"]
    interrupts: list[str] = []

    def second_interrupt() -> None:
        interrupts.append("second")
        signal.raise_signal(signal.SIGINT)  # the Runner's handler raises KeyboardInterrupt here

    def watch() -> None:
        if any((work / c / "mitmdump.log").exists() for c in cols):  # its mock listens
            interrupts.append("first")
            signal.raise_signal(signal.SIGINT)  # the Runner's handler cancels the main task
            loop.call_soon(second_interrupt)  # after the columns have taken the cancellation
            return
        loop.call_later(0.005, watch)

    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in scripts/reproduce
    try:
        with asyncio.Runner() as run:  # what asyncio.run does
            loop = run.get_loop()
            loop.call_soon(watch)
            with pytest.raises(KeyboardInterrupt):
                run.run(runner.run_scenario(scen, work, columns=cols))
        assert interrupts == ["first", "second"]
        assert any((work / c / "mitmdump.log").exists() for c in cols)
        assert _processes_mentioning(str(work)) == {}
    finally:
        signal.signal(signal.SIGINT, old)
        for pid in _processes_mentioning(str(work)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_scripts_reproduce_refuses_a_bad_turnguard_option_before_it_starts_anything():
    for option, message in [("turnguard_hold_timeout_ms=abc", "is not an integer"),
                            ("turnguard_hold_timeot_ms=5", "did you mean turnguard_hold_timeout_ms")]:
        proc = subprocess.run([str(REPO / "scripts" / "reproduce"), "--set", option,
                               "duplicate-storm"], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, cwd=REPO, env=_env())
        assert proc.returncode == 1 and message in proc.stderr, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr


def test_ledger_cli_refuses_a_huge_limit_and_an_argument_that_is_not_utf8(direct_ledger):
    led = str(direct_ledger.path)
    for args in (["list", "--limit", "9" * 20], ["audit", "--limit", "9" * 20]):
        r = _ledger_cli("--ledger", led, *args)
        assert r.returncode == 2 and "must be at most" in r.stderr and "Traceback" not in r.stderr
    for command in (["show"], ["circuit", "clear"], ["session", "release"]):
        r = subprocess.run([str(LEDGER), "--ledger", led, *command, b"\xff\xfe".decode(
            "utf-8", "surrogateescape")], capture_output=True, timeout=CLI_TIMEOUT_S,
            env=_env(), stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and b"not UTF-8" in r.stderr and b"Traceback" not in r.stderr


def test_ledger_cli_on_junk_rows_says_so_in_one_line_and_exits_1(direct_ledger: DirectLedger):
    """Rows turnguard did not write (a value of the wrong type, a time out of range, JSON that
    is not): every command answers or says so in one line, exit status 1, never a traceback;
    --help documents the exit statuses."""
    led = str(direct_ledger.path)
    db = sqlite3.connect(led)
    with db:
        db.execute("INSERT INTO operations (op_key, scope, method, path, fingerprint, state,"
                   " created_at, updated_at, ended_at, attempts) VALUES ('ffff0001', 's',"
                   " 'POST', '/v1/responses', 'fp', 'weird', 'x', 1e308, X'00ff', 'many')")
        db.execute("INSERT INTO circuits VALUES ('junk', 'many', 'soon', 'x', 'y')")
        db.execute("INSERT INTO sessions VALUES ('junk', 'd', 'o', 'epoch', 'lease', 0, 0)")
        db.execute("INSERT INTO instances (instance_id, pid, host, started_at, heartbeat_at)"
                   " VALUES ('junk', 'pid', 'h', 'x', 'y')")
        db.execute("INSERT INTO control_audit (at, action, target, actor, before, after)"
                   " VALUES ('x', 'a', 't', 'b', '{bad', '[1')")
    db.close()
    for args in (["status"], ["status", "--json"], ["list"], ["list", "--json"],
                 ["show", "ffff0001"], ["show", "ffff0001", "--json"], ["stats"],
                 ["circuit", "list"], ["audit"], ["audit", "--json"],
                 ["circuit", "clear", "--all"], ["session", "release", "junk"]):
        r = _ledger_cli("--ledger", led, *args)
        assert "Traceback" not in r.stderr, (args, r.stderr)
        assert r.returncode in (0, 1), (args, r.returncode, r.stderr)
        if r.returncode == 1:
            assert len(r.stderr.strip().splitlines()) == 1 and "error:" in r.stderr, (args, r.stderr)
    helped = _ledger_cli("--help").stdout
    assert "Exit status" in helped and "2 usage error" in helped


# Two tests that say which processes run them (the pytest worker and its controller) and wait.
_WAITING_TESTS = '''
import os, pathlib, sys, time, pytest

@pytest.mark.unit
@pytest.mark.parametrize("i", range(2))
def test_waits(i):
    pids = pathlib.Path(__file__).with_name("pids")
    part = pids / f".{os.getpid()}"  # renamed whole: the test never reads it half written
    part.write_text(f"{os.getppid()} {sys.version_info[1]}")
    part.rename(pids / str(os.getpid()))
    time.sleep(120)
'''


def test_scripts_started_at_once_on_a_fresh_clone_make_its_environment_once(tmp_path):
    """Two scripts started at once where ``.venv`` is not made yet (a fresh clone; the suite's
    own run beside a test that runs scripts/test): each waits for the set-up under way
    (``.venv.lock``, flock; here the test's own hold of it, so that both are seen waiting),
    and says so; then one makes the environment and the other finds it made. Both run with
    it. Before, each saw no environment and made it, the second under the first. (The real
    ``scripts/_python.sh`` in a folder of the test's own, with an empty requirements file:
    the set-up costs seconds.)"""
    import fcntl

    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "_python.sh", root / "scripts" / "_python.sh")
    (root / "requirements.txt").write_text("# none: the set-up alone is tested\n")
    probe = root / "scripts" / "probe"
    probe.write_text('#!/usr/bin/env bash\nsource "$(dirname "$0")/_python.sh"\ntg_setup\n'
                     'tg_install requirements.txt\n'
                     'exec "$TG_PY" -c "import sys; print(\'ran in\', sys.prefix)"\n')
    probe.chmod(0o755)
    env = {k: v for k, v in _env().items() if not k.startswith("TG_")}  # (scripts/test's)
    waiting = f"turnguard: waiting for another script's set-up of {root / '.venv'} to end"
    outs = [tmp_path / f"out{i}" for i in range(2)]
    procs = []
    with open(root / ".venv.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for out in outs:
            with open(out, "wb") as log:
                procs.append(subprocess.Popen([str(probe)], stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=subprocess.STDOUT, cwd=root,
                                              env=env))
        try:
            wait_until(lambda: all(waiting in out.read_text() for out in outs), 60, 0.05,
                       "both scripts waiting for the set-up")
            assert not (root / ".venv").exists()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    texts = []
    for proc, out in zip(procs, outs):
        proc.wait(120)
        texts.append(out.read_text())
    assert [proc.returncode for proc in procs] == [0, 0], texts
    assert all(f"ran in {root / '.venv'}" in text for text in texts), texts
    assert sum(text.count("turnguard: creating") for text in texts) == 1, texts
    assert sum(text.count("turnguard: installing") for text in texts) == 1, texts


@pytest.mark.parametrize("workers", ["0", "twelve", "12 -x", "-3", "1.5"])
def test_scripts_test_refuses_a_worker_count_that_is_not_a_whole_number_from_one(workers):
    """TURNGUARD_TEST_WORKERS (the whole suite's worker processes; unset or empty: 12) must be
    a whole number, 1 or more: anything else is one line and exit status 2, before any
    set-up."""
    proc = subprocess.run([str(REPO / "scripts" / "test")], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, cwd=REPO, timeout=30,
                          env=_env(TURNGUARD_TEST_WORKERS=workers))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr == (
        f"scripts/test: TURNGUARD_TEST_WORKERS={workers}: want a whole number of worker "
        "processes, 1 or more\n")


@pytest.mark.parametrize("when", ["while it starts", "once the tests run"])
def test_scripts_test_interrupted_stops_the_postgresql_server_it_starts(tmp_path, when):
    """The whole-suite run starts its PostgreSQL server in the background, beside the virtual
    environment's set-up. SIGTERM to scripts/test, while that server is still starting (its
    ``initdb`` held here until the signal is sent) or once the main run's tests run: the
    script waits for the start, then stops the server; no ``postgres`` of it is left and its
    folder is gone. Once started, its URL reaches the tests (``TURNGUARD_TEST_PG``)."""
    real_bin = Path(pg_server.find_bin_dir() or pytest.skip("no PostgreSQL binaries here"))
    # (a folder the server's own user can reach and write its mark in: pg_server.py runs it
    # as postgres under root)
    slow_bin = Path(tempfile.mkdtemp(prefix="turnguard-slow-initdb-"))
    try:
        slow_bin.chmod(0o777)
        started, go = slow_bin / "started", slow_bin / "go"
        (slow_bin / "initdb").write_text(  # (held until the test says go, 60 s at most)
            "#!/bin/sh\n"
            f"echo \"$@\" >{started}.part && mv {started}.part {started}\n"
            f"i=0; while [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n"
            f"exec {real_bin / 'initdb'} \"$@\"\n")
        (slow_bin / "initdb").chmod(0o755)
        for name in ("pg_ctl", "postgres"):  # (found beside initdb: pg_server.find_bin_dir)
            (slow_bin / name).symlink_to(real_bin / name)
        (tmp_path / "test_waiting.py").write_text(_WAITING_TESTS + _PG_URL_TEST)
        pids = tmp_path / "pids"
        pids.mkdir()
        env = _env(PYTEST_ADDOPTS=f"{tmp_path / 'test_waiting.py'} -p no:randomly "
                                  "-p no:cacheprovider",
                   PATH=f"{slow_bin}{os.pathsep}{os.environ['PATH']}",
                   TURNGUARD_TEST_WORKERS="3")  # (the URL's test beside the two waiting)
        out = tmp_path / "out"
        with open(out, "wb") as log:
            proc = subprocess.Popen([str(REPO / "scripts" / "test")], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                    start_new_session=True)
        folder = None
        try:
            wait_until(started.exists, 120, 0.05, "the PostgreSQL server's initdb")
            folder = Path(started.read_text().split()[1]).parent  # (initdb -D FOLDER/data)
            if when == "once the tests run":
                go.touch()
                wait_until(lambda: (tmp_path / "pg_url").exists(), 300, 0.1,
                           "the main run's tests")
                assert (tmp_path / "pg_url").read_text().endswith(f"@127.0.0.1:{_pg_port(folder)}"
                                                                   "/postgres")
                proc.send_signal(signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
                go.touch()
            assert proc.wait(60) == 128 + signal.SIGTERM, out.read_text(errors="replace")
            if when == "while it starts":
                assert "PostgreSQL for the tests at" not in out.read_text(errors="replace")
            wait_until(lambda: not folder.exists(), 15, 0.1, "the server's folder removed")
            assert _processes_mentioning(str(folder)) == {}, out.read_text(errors="replace")
            if when == "while it starts":
                assert not (tmp_path / "pg_url").exists()  # (no test ran)
        finally:
            if proc.poll() is None:
                _kill_group(proc, signal.SIGKILL)
                proc.wait(10)
            for pid_file in pids.iterdir():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.name), signal.SIGKILL)
            if folder is not None and folder.exists():  # (a failure: no server left behind)
                pg_server.PgServer(str(folder)).destroy()
    finally:
        shutil.rmtree(slow_bin, ignore_errors=True)


_PG_URL_TEST = '''

@pytest.mark.unit
def test_pg_url():
    pathlib.Path(__file__).with_name("pg_url").write_text(os.environ["TURNGUARD_TEST_PG"])
'''


def _pg_port(folder: Path) -> int:
    """The port in the server's configuration (pg_server.py writes ``port = N``)."""
    conf = (folder / "data" / "postgresql.auto.conf").read_text()
    return int(re.findall(r"^port = (\d+)", conf, re.M)[-1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_scripts_test_interrupted_stops_every_pytest_it_started(tmp_path, sig):
    """SIGTERM or SIGINT to scripts/test alone (not its group), during the whole-suite run:
    the main run's pytest and its workers stop with the other Pythons' run. The main run was
    a foreground command the script did not stop: SIGTERM left it running, orphaned, and SIGINT
    did nothing until it ended. (The whole suite is two waiting tests here, PYTEST_ADDOPTS,
    on two workers: the twelve of a real run stop as the two do, and the two tests here cost
    the machine 6 CPU s rather than 12.)"""
    (tmp_path / "test_waiting.py").write_text(_WAITING_TESTS)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = _env(PYTEST_ADDOPTS=f"{tmp_path / 'test_waiting.py'} -p no:randomly -p no:cacheprovider",
               TURNGUARD_TEST_PG="postgresql://turnguard@127.0.0.1:9/none",  # none started
               TURNGUARD_TEST_WORKERS="2")  # (one a waiting test: both wait at once)
    out = tmp_path / "out"
    with open(out, "wb") as log:
        # (SIGINT as a terminal's ^C finds it, whatever this run inherited: a shell's
        # background job ignores SIGINT, and a shell cannot trap what it started ignoring)
        proc = subprocess.Popen([str(REPO / "scripts" / "test")], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True, preexec_fn=_default_sigint)
    started: set[int] = set()

    def written() -> list[Path]:
        return [f for f in pids.iterdir() if not f.name.startswith(".")]

    def running() -> set[int]:
        for f in written():
            started.update({int(f.name), int(f.read_text().split()[0])})
        return {p for p in started if _alive(p)}

    def main_run_waits() -> bool:  # (beside it, the other Pythons' run may have begun too)
        return sum(f.read_text().split()[1] == str(sys.version_info[1])
                   for f in written()) >= 2

    try:
        # (interpreters importing pytest, the main run's workers and itself, beside the other
        # Pythons' run: seconds alone, more than 80 s beside the whole suite)
        wait_until(main_run_waits, 300, 0.1, "the main run's tests")
        proc.send_signal(sig)
        assert proc.wait(30) in (128 + sig, -sig), out.read_text(errors="replace")
        try:
            wait_until(lambda: not running(), 15, 0.1, "every pytest it started stopped")
        except AssertionError:
            left = {pid: _command_line(pid) for pid in running()}
            raise AssertionError(f"left running: {left}\n{out.read_text(errors='replace')}") from None
    finally:
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)
            proc.wait(10)
        for pid in running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
