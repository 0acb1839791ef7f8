"""Subprocesses of a benchmark run (the bench upstream and the mitmdump variants) and /proc
readings of their CPU time and resident memory.

Every process started here is registered and stopped by ``stop_all`` (SIGTERM, bounded wait,
then SIGKILL of that pid only). Output goes to files, never to a pipe that could fill.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from turnguard_bench import ADDON, HOST, REPO, SCRIPTS_DIR

PYTHON = sys.executable
MITMDUMP = Path(sys.executable).with_name("mitmdump")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

_UPSTREAM_LINE = re.compile(r"bench upstream listening at http://127\.0\.0\.1:(\d+)")
_MITM_LINE = re.compile(r"listening at (?:\[[^\]]*\]|[0-9.]+):(\d+)")

_started: list[subprocess.Popen] = []

# The addon the mitmdumps load. ``snapshot_addon`` points it at a private copy of addon/, so
# that an edit of the working tree during a run (mitmproxy reloads a changed script, which drops
# the flows it holds) cannot change what is measured half way.
_addon_dir: Path = REPO / "addon"

# ``--set KEY=VALUE`` options of scripts/bench: given to every mitmdump variant alike.
COMMON_OPTIONS: dict[str, str] = {}


def snapshot_addon(workdir: Path, rev: str | None = None) -> Path:
    """Copy addon/ (without caches) into ``workdir`` and use the copy from now on; also put it
    first on sys.path so in-process measurements import the same code. With ``rev``, the copy
    is addon/ as committed at that git revision (to measure a version against another).
    Returns the copy."""
    global _addon_dir
    dest = workdir / "addon-snapshot"
    if rev is None:
        shutil.copytree(ADDON.parent, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        tmp = workdir / "addon-rev"
        tmp.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "addon"],
                                 capture_output=True, timeout=60)
        if archive.returncode != 0:
            raise SystemExit(f"scripts/bench: git archive {rev} addon failed: "
                             f"{archive.stderr.decode(errors='replace').strip()}")
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True, timeout=60)
        (tmp / "addon").rename(dest)
    _addon_dir = dest
    sys.path.insert(0, str(dest))
    return dest


def addon_digest() -> str:
    """sha256 (first 12 hex) over the addon files that are measured."""
    h = hashlib.sha256()
    for p in sorted(_addon_dir.rglob("*.py")):
        h.update(str(p.relative_to(_addon_dir)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]

# What each variant adds to the common mitmdump command line.
VARIANTS = {
    "plain": "mitmdump, no addon (bodies buffered: mitmproxy's default)",
    "plain_stream": "mitmdump, no addon, --set stream_large_bodies=1 (bodies streamed)",
    "turnguard": "mitmdump -s addon/turnguard.py (guarded responses streamed through its tee)",
}


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log_path: Path
    port: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        return _terminate(self.proc)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def _terminate(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    if proc in _started:
        _started.remove(proc)
    return proc.returncode


def stop_all() -> None:
    """Stop every process this run started (each by its own pid)."""
    for proc in list(_started):
        try:
            _terminate(proc)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass


def _spawn(cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    full_env = {**os.environ, **(env or {})}
    pp = [str(SCRIPTS_DIR), str(_addon_dir)]
    if full_env.get("PYTHONPATH"):
        pp.append(full_env["PYTHONPATH"])
    full_env["PYTHONPATH"] = os.pathsep.join(pp)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            env=full_env,
        )
    _started.append(proc)
    return proc


def _wait_port(p: Proc, pattern: re.Pattern[str], timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:  # bounded by the deadline
        m = pattern.search(p.log_text())
        if m:
            p.port = int(m.group(1))
            return
        if not p.alive():
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.log_text()[-4000:]}")
        if time.monotonic() > deadline:
            p.stop()
            raise RuntimeError(f"{p.name} did not start within {timeout} s:\n{p.log_text()[-4000:]}")
        time.sleep(0.02)


def start_upstream(workdir: Path, name: str = "upstream") -> Proc:
    log = workdir / f"{name}.log"
    proc = _spawn([PYTHON, "-u", "-m", "turnguard_bench.upstream", "--port", "0"], log)
    p = Proc(name, proc, log)
    _wait_port(p, _UPSTREAM_LINE)
    return p


def start_mitmdumps(
    workdir: Path, upstream_url: str, specs: dict[str, tuple[str, dict[str, object]]]
) -> dict[str, Proc]:
    """Start several mitmdump processes at once. ``specs``: name -> (variant, extra options)."""
    procs: dict[str, Proc] = {}
    try:
        for name, (variant, options) in specs.items():
            confdir = workdir / f"{name}-confdir"
            confdir.mkdir(mode=0o700, exist_ok=True)
            cmd = [
                str(MITMDUMP), "--mode", f"reverse:{upstream_url}",
                "--listen-host", HOST, "--listen-port", "0", "--set", f"confdir={confdir}",
            ]  # fmt: skip
            opts: dict[str, object] = dict(COMMON_OPTIONS)
            if variant == "plain_stream":
                opts["stream_large_bodies"] = "1"
            elif variant == "turnguard":
                cmd += ["-s", str(_addon_dir / ADDON.name)]
                opts["turnguard_ledger"] = str(workdir / f"{name}-ledger.sqlite3")
            elif variant != "plain":
                raise ValueError(f"unknown variant {variant}")
            opts.update(options)
            for k, v in opts.items():
                if isinstance(v, bool):
                    v = "true" if v else "false"
                cmd += ["--set", f"{k}={v}"]
            log = workdir / f"{name}.log"
            procs[name] = Proc(name, _spawn(cmd, log), log, extra={"variant": variant, "options": opts, "cmd": cmd})
        for p in procs.values():
            _wait_port(p, _MITM_LINE)
    except BaseException:
        for p in procs.values():
            p.stop()
        raise
    return procs


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, in bytes."""
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


def file_size(*paths: Path) -> int:
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_size
        except FileNotFoundError:
            pass
    return total


def ledger_size(ledger: Path) -> dict[str, int]:
    """Bytes of a SQLite ledger: the main file, its WAL and shared-memory file."""
    wal = Path(str(ledger) + "-wal")
    shm = Path(str(ledger) + "-shm")
    return {"db": file_size(ledger), "wal": file_size(wal), "shm": file_size(shm),
            "total": file_size(ledger, wal, shm)}
