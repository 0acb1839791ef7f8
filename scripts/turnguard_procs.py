"""Subprocesses for the tests and tools: start one with its output in a file, wait for a line
it prints, stop it; read its CPU time and memory, and the JSON lines it writes. Standard
library only.

    proc = Process([sys.executable, "-u", "scripts/mock_upstream.py", "--port", "0"], out_path)
    url = proc.wait_for_line(MOCK_LINE, 20, "mock upstream").group(1)
    ...
    proc.stop()   # one SIGTERM, up to STOP_TIMEOUT_S, then SIGKILL

The rules every caller gets: output goes to a file, never to a pipe that could fill; the file is
appended to, and ``output`` returns only this process's part, so that a restart under the same
name keeps one file; every wait is bounded; ``stop`` sends one SIGTERM (to the process group with
``new_session``), waits, then SIGKILL, and never a second SIGTERM; only the process (or group)
this object started is ever signalled.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 10.0
POLL_S = 0.02

# What the servers print once they listen. mitmproxy 12.3.1 prints e.g. "[01:29:22.706]
# reverse proxy to http://127.0.0.1:9 listening at 127.0.0.1:47487."
MOCK_LINE = re.compile(r"mock upstream listening at (http://127\.0\.0\.1:(\d+))")
MITMDUMP_LINE = re.compile(r"listening at (?:\[[^\]]*\]|[0-9.]+):(\d+)")


class Process:
    """One subprocess, its stdout and stderr appended to ``out_path``, stdin from /dev/null.

    ``env`` is added to this process's environment (``PYTHONUNBUFFERED=1`` always is);
    ``new_session`` starts it in a process group of its own, which ``stop`` and ``kill`` then
    signal as a whole (for a process that starts children). ``popen`` starts it: a callable
    with ``subprocess.Popen``'s signature and result (the tests fork their mitmdumps)."""

    def __init__(
        self,
        cmd: Sequence[str],
        out_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO,
        new_session: bool = False,
        popen: Callable[..., Any] = subprocess.Popen,
    ):
        self.cmd = list(cmd)
        self.out_path = Path(out_path)
        self.new_session = new_session
        self.offset = self.out_path.stat().st_size if self.out_path.exists() else 0
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.out_path, "ab") as out:
            self.popen = popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=cwd, env=full_env, start_new_session=new_session,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        """What this process printed so far (its part of ``out_path``)."""
        return read_text_from(self.out_path, self.offset)

    def _check_line(self, pattern: re.Pattern[str], deadline: float, timeout: float,
                    what: str) -> re.Match[str] | None:
        """One look at the output: the match, None to look again, or RuntimeError (with the
        output) when the process exited first or the deadline passed (it is stopped then)."""
        text = self.output()
        m = pattern.search(text)
        if m:
            return m
        if not self.alive():
            raise RuntimeError(f"{what} exited with status {self.popen.returncode} before "
                               f"printing what was awaited:\n{text}")
        if time.monotonic() > deadline:
            self.stop()
            raise RuntimeError(f"{what} did not print what was awaited within {timeout} s:\n{text}")
        return None

    def wait_for_line(self, pattern: re.Pattern[str], timeout: float, what: str) -> re.Match[str]:
        """Block until ``pattern`` matches this process's output (bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        while (m := self._check_line(pattern, deadline, timeout, what)) is None:  # bounded
            time.sleep(POLL_S)
        return m

    async def await_line(self, pattern: re.Pattern[str], timeout: float, what: str) -> re.Match[str]:
        """``wait_for_line`` for a caller on an event loop."""
        deadline = time.monotonic() + timeout
        while (m := self._check_line(pattern, deadline, timeout, what)) is None:  # bounded
            await asyncio.sleep(POLL_S)
        return m

    def _signal(self, sig: int) -> None:
        try:
            if self.new_session:
                os.killpg(self.popen.pid, sig)
            else:
                self.popen.send_signal(sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = STOP_TIMEOUT_S, sig: int = signal.SIGTERM) -> int:
        """One SIGTERM (or ``sig``: py-spy writes its profile on SIGINT), up to ``timeout``
        seconds for the exit, then SIGKILL; the exit status (negative: the signal that ended
        it). A process that already exited is only reaped."""
        if self.popen.poll() is None:
            self._signal(sig)
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL at once (a crash); the exit status."""
        if self.popen.poll() is None:
            self._signal(signal.SIGKILL)
            self.popen.wait(STOP_TIMEOUT_S)
        return self.popen.returncode


def cpu_seconds(pid: int) -> float:
    """CPU time of a process (user + system, all its threads) so far, in seconds (Linux)."""
    return sum(cpu_times(pid))


def cpu_times(pid: int) -> tuple[float, float]:
    """CPU time of a process so far (all its threads), in seconds: (user, system) (Linux).
    System time is the kernel's work for it: system calls (a ledger's writes), page faults."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def kernel_events(pid: int) -> dict[str, int]:
    """Counts of a process so far (all its threads; Linux): its page faults (``minor_faults``:
    a page mapped without reading the disk, e.g. memory touched for the first time) and its
    context switches (``voluntary_switches``: it waited, e.g. for the event loop's next
    event; ``involuntary_switches``: the scheduler took the CPU from it)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    out = {"minor_faults": int(fields[7]), "major_faults": int(fields[9]),
           "voluntary_switches": 0, "involuntary_switches": 0}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status", "rb") as f:
                status = f.read()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith(b"voluntary_ctxt_switches:"):
                out["voluntary_switches"] += int(line.split()[1])
            elif line.startswith(b"nonvoluntary_ctxt_switches:"):
                out["involuntary_switches"] += int(line.split()[1])
    return out


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, in bytes (Linux)."""
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def read_text_from(path: Path, offset: int = 0) -> str:
    """The text of ``path`` from byte ``offset`` on ("" if there is no such file)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def read_jsonl(path: Path | None) -> list[dict[str, Any]]:
    """The records of a JSON-lines file a process writes (the mock's dispatch log, turnguard's
    events); a line that does not parse (the last one, while it is being written) is skipped."""
    if path is None:
        return []
    out = []
    for line in read_text_from(Path(path)).splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
