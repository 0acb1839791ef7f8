"""Subprocesses of a reproduction run: the mock upstream and mitmdump, on 127.0.0.1 with ports
chosen by the OS.

Each runs in its own process group (``start_new_session``) with its output in a file (never a
pipe that can fill); ``stop`` sends SIGTERM to the group, waits (bounded), then SIGKILL. Waiting
for the "listening" line is bounded too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parents[1]
REPO = SCRIPTS.parent
MOCK_UPSTREAM = SCRIPTS / "mock_upstream.py"
ADDON = REPO / "addon" / "turnguard.py"
FLOWLOG_ADDON = Path(__file__).resolve().with_name("flowlog_addon.py")

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

MOCK_LINE = re.compile(r"mock upstream listening at (http://127\.0\.0\.1:(\d+))")
MITM_LINE = re.compile(r"listening at (?:\[[^\]]*\]|[0-9.]+):(\d+)")


def mitmdump_path() -> str:
    """mitmdump next to this Python (the project's .venv), else on PATH."""
    here = Path(sys.executable).with_name("mitmdump")
    if here.exists():
        return str(here)
    found = shutil.which("mitmdump")
    if not found:
        raise RuntimeError("mitmdump not found next to this Python or on PATH (install mitmproxy)")
    return found


class Proc:
    """A subprocess with its output in ``out_path``."""

    def __init__(self, cmd: list[str], out_path: Path, *, env: dict[str, str] | None = None):
        self.cmd = cmd
        self.out_path = out_path
        with open(out_path, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
            )

    def text(self) -> str:
        try:
            return self.out_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def wait_for(self, pattern: re.Pattern[str], what: str, timeout: float = START_TIMEOUT_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:  # bounded by the deadline
            m = pattern.search(self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {self.proc.returncode}:\n{self.text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} did not start within {timeout} s:\n{self.text()}")
            await asyncio.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM to the process group, up to STOP_TIMEOUT_S, then SIGKILL."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.returncode


async def start_mock(workdir: Path, scenario: dict[str, Any]) -> tuple[Proc, str, Path]:
    """The mock upstream with ``scenario``; returns (process, url, dispatch log path)."""
    scen = workdir / "upstream-scenario.json"
    scen.write_text(json.dumps(scenario, indent=1))
    log = workdir / "upstream.jsonl"
    proc = Proc(
        [sys.executable, "-u", str(MOCK_UPSTREAM), "--host", "127.0.0.1", "--port", "0",
         "--log", str(log), "--scenario", str(scen)],
        workdir / "upstream.out",
    )
    m = await proc.wait_for(MOCK_LINE, "mock upstream")
    return proc, m.group(1), log


def option_args(options: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for k, v in options.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        args += ["--set", f"{k}={v}"]
    return args


async def start_mitmdump(
    workdir: Path, upstream_url: str, *, addon: bool, options: dict[str, Any],
    save_flows: Path | None = None, flowlog: Path | None = None,
) -> tuple[Proc, str]:
    """mitmdump in reverse-proxy mode in front of ``upstream_url``; returns (process, url)."""
    cmd = [
        mitmdump_path(), "--mode", f"reverse:{upstream_url}", "--listen-host", "127.0.0.1",
        "--listen-port", "0", "--set", f"confdir={workdir / 'confdir'}",
    ]
    if addon:
        cmd += ["-s", str(ADDON)]
    if flowlog is not None:
        cmd += ["-s", str(FLOWLOG_ADDON), "--set", f"repro_flowlog={flowlog}"]
    cmd += option_args(options)
    if save_flows is not None:
        cmd += ["-w", str(save_flows)]
    proc = Proc(cmd, workdir / "mitmdump.log")
    m = await proc.wait_for(MITM_LINE, "mitmdump")
    return proc, f"http://127.0.0.1:{m.group(1)}"


def read_jsonl(path: Path | None) -> list[dict[str, Any]]:
    if path is None or not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
