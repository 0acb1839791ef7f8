"""Subprocesses of a benchmark run (the bench upstream and the mitmdump variants) and /proc
readings of their CPU time and resident memory.

Every process is a ``turnguard_procs.Process`` (output in a file, never a pipe that could
fill), registered here and stopped by ``stop_all`` (one SIGTERM, bounded wait, then SIGKILL of
that pid only).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from turnguard_bench import ADDON, HOST, REPO, SCRIPTS_DIR
from turnguard_procs import MITMDUMP_LINE, Process

PYTHON = sys.executable
MITMDUMP = Path(sys.executable).with_name("mitmdump")
# The bench starts its mitmdumps together, each importing mitmproxy (about 1 s of CPU alone):
# on a loaded 2-core machine one took more than 30 s to listen.
START_TIMEOUT_S = 120.0
FLOOR_ADDON = Path(__file__).with_name("floor_addon.py")
ANSWER_FLOOR_ADDON = Path(__file__).with_name("answer_floor_addon.py")
LEDGER_FLOOR_ADDON = Path(__file__).with_name("ledger_floor_addon.py")
HOOK_TIMER_ADDON = Path(__file__).with_name("hook_timer_addon.py")

_UPSTREAM_LINE = re.compile(r"bench upstream listening at http://127\.0\.0\.1:(\d+)")
_MOCK_LINE = re.compile(r"mock upstream listening at http://127\.0\.0\.1:(\d+)")


class Stoppable(Protocol):
    def stop(self) -> object: ...


_started: list[Stoppable] = []

# The addon the mitmdumps load. ``snapshot_addon`` points it at a private copy of addon/, so
# that an edit of the working tree during a run (mitmproxy reloads a changed script, which drops
# the flows it holds) cannot change what is measured half way.
_addon_dir: Path = REPO / "addon"
_baseline_dir: Path | None = None  # --baseline-rev: the turnguard_baseline variant's addon

# ``--set KEY=VALUE`` options of scripts/bench: given to every mitmdump variant alike.
COMMON_OPTIONS: dict[str, str] = {}


def snapshot_addon(workdir: Path, rev: str | None = None) -> Path:
    """Copy addon/ (without caches) into ``workdir`` and use the copy from now on; also put it
    first on sys.path so in-process measurements import the same code. With ``rev``, the copy
    is addon/ as committed at that git revision (to measure a version against another).
    Returns the copy."""
    global _addon_dir
    _addon_dir = _copy_addon(workdir / "addon-snapshot", rev)
    sys.path.insert(0, str(_addon_dir))
    return _addon_dir


def snapshot_baseline(workdir: Path, rev: str) -> Path:
    """addon/ as committed at ``rev``, for the ``turnguard_baseline`` variant: measured in the
    same run as ``turnguard``, so that two versions are compared side by side (machine noise
    from one run to the next is larger than what most changes move)."""
    global _baseline_dir
    _baseline_dir = _copy_addon(workdir / "addon-baseline", rev)
    return _baseline_dir


def _copy_addon(dest: Path, rev: str | None) -> Path:
    if rev is None:
        shutil.copytree(ADDON.parent, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return dest
    tmp = dest.with_name(dest.name + "-rev")
    tmp.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "addon"],
                             capture_output=True, timeout=60)
    if archive.returncode != 0:
        raise SystemExit(f"scripts/bench: git archive {rev} addon failed: "
                         f"{archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True, timeout=60)
    (tmp / "addon").rename(dest)
    return dest


def has_baseline() -> bool:
    return _baseline_dir is not None


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
    "floor": "mitmdump -s floor_addon.py (a no-op addon that only streams SSE responses: "
             "what any streaming addon costs)",
    "ledger_floor": "mitmdump -s ledger_floor_addon.py (the floor plus a durable claim before "
                    "each request goes upstream and its end and body after: what any guard "
                    "that executes a request at most once across processes must write)",
    "turnguard": "mitmdump -s addon/turnguard.py (guarded responses streamed through its tee)",
    "turnguard_baseline": "with --baseline-rev REV only: turnguard as committed at REV, "
                          "measured in the same rounds as turnguard",
    "answer_floor": "mitmdump -s answer_floor_addon.py (replay phase only: answers a repeated "
                    "request from memory, what any replaying addon costs)",
}


@dataclass
class Proc:
    """A started server of the run: its process, name, output file and listening port."""

    name: str
    process: Process
    listening_line: re.Pattern[str]
    port: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def alive(self) -> bool:
        return self.process.alive()

    def stop(self) -> int:
        """One SIGTERM, a bounded wait, then SIGKILL (see ``turnguard_procs``)."""
        forget(self)
        return self.process.stop()

    def log_text(self) -> str:
        return self.process.output()


def register(p: Stoppable) -> None:
    """Have ``stop_all`` stop ``p`` unless it was stopped before."""
    _started.append(p)


def forget(p: Stoppable) -> None:
    """``p`` was stopped: ``stop_all`` leaves it alone."""
    if p in _started:
        _started.remove(p)


def stop_all() -> None:
    """Stop every process this run started (each by its own pid)."""
    for p in list(_started):
        try:
            p.stop()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
    _started.clear()


def _start(name: str, cmd: list[str], log_path: Path, pattern: re.Pattern[str],
           extra: dict | None = None) -> Proc:
    """Start ``cmd`` (scripts/ and the measured addon on its PYTHONPATH), registered; its
    port is read from its listening line by ``wait_listening``."""
    pp = [str(SCRIPTS_DIR), str(_addon_dir)]
    if os.environ.get("PYTHONPATH"):
        pp.append(os.environ["PYTHONPATH"])
    p = Proc(name, Process(cmd, log_path, env={"PYTHONPATH": os.pathsep.join(pp)}), pattern,
             extra=extra or {})
    register(p)
    return p


def wait_listening(p: Proc, timeout: float = START_TIMEOUT_S) -> None:
    """Block until ``p`` printed its listening line (bounded; stopped and RuntimeError with
    its output if it exits first or does not print it in time); set its port."""
    p.port = int(p.process.wait_for_line(p.listening_line, timeout, p.name).group(1))


def start_upstream(workdir: Path, name: str = "upstream") -> Proc:
    """The bench upstream (``turnguard_bench.upstream``), listening."""
    p = _start(name, [PYTHON, "-u", "-m", "turnguard_bench.upstream", "--port", "0"],
               workdir / f"{name}.log", _UPSTREAM_LINE)
    wait_listening(p)
    return p


def start_mock_upstream(workdir: Path, name: str = "mock-upstream") -> Proc:
    """The mock upstream (``turnguard_mock``: Responses over HTTP and WebSocket), listening."""
    p = _start(name, [PYTHON, "-u", "-m", "turnguard_mock", "--port", "0"],
               workdir / f"{name}.log", _MOCK_LINE)
    wait_listening(p)
    return p


def start_mitmdumps(
    workdir: Path, upstream_url: str, specs: dict[str, tuple[str, dict[str, object]]],
    *, hook_timer: bool = False, prefix: list[str] | None = None,
    start_timeout: float = START_TIMEOUT_S,
) -> dict[str, Proc]:
    """Start several mitmdump processes at once. ``specs``: name -> (variant, extra options).
    ``hook_timer``: each also loads ``hook_timer_addon.py`` after its addon. ``prefix``: the
    command each runs under (e.g. valgrind), given ``start_timeout`` to listen."""
    procs: dict[str, Proc] = {}
    try:
        for name, (variant, options) in specs.items():
            confdir = workdir / f"{name}-confdir"
            confdir.mkdir(mode=0o700, exist_ok=True)
            cmd = [
                *(prefix or ()), str(MITMDUMP), "--mode", f"reverse:{upstream_url}",
                "--listen-host", HOST, "--listen-port", "0", "--set", f"confdir={confdir}",
            ]  # fmt: skip
            opts: dict[str, object] = dict(COMMON_OPTIONS)
            if variant == "plain_stream":
                opts["stream_large_bodies"] = "1"
            elif variant == "floor":
                cmd += ["-s", str(FLOOR_ADDON)]
            elif variant == "answer_floor":
                cmd += ["-s", str(ANSWER_FLOOR_ADDON)]
            elif variant == "ledger_floor":
                cmd += ["-s", str(LEDGER_FLOOR_ADDON)]
            elif variant in ("turnguard", "turnguard_baseline"):
                addon_dir = _addon_dir if variant == "turnguard" else _baseline_dir
                if addon_dir is None:
                    raise ValueError("turnguard_baseline needs snapshot_baseline first")
                cmd += ["-s", str(addon_dir / ADDON.name)]
                opts["turnguard_ledger"] = str(workdir / f"{name}-ledger.sqlite3")
            elif variant != "plain":
                raise ValueError(f"unknown variant {variant}")
            if hook_timer:
                cmd += ["-s", str(HOOK_TIMER_ADDON)]
            opts.update(options)
            for k, v in opts.items():
                if isinstance(v, bool):
                    v = "true" if v else "false"
                cmd += ["--set", f"{k}={v}"]
            procs[name] = _start(name, cmd, workdir / f"{name}.log", MITMDUMP_LINE,
                                 {"variant": variant, "options": opts, "cmd": cmd,
                                  "confdir": str(confdir)})
        for p in procs.values():
            wait_listening(p, start_timeout)
    except BaseException:
        for p in procs.values():
            p.stop()
        raise
    return procs


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
