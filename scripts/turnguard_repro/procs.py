"""Subprocesses of a reproduction run: the mock upstream and mitmdump, on 127.0.0.1 with ports
chosen by the OS.

Each is a ``turnguard_procs.Process`` in a process group of its own, with its output in a file
(never a pipe that can fill); ``stop`` sends one SIGTERM to the group, waits (bounded), then
SIGKILL. Waiting for the "listening" line is bounded too.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from turnguard_procs import MITMDUMP_LINE, MOCK_LINE, Process

SCRIPTS = Path(__file__).resolve().parents[1]
REPO = SCRIPTS.parent
MOCK_UPSTREAM = SCRIPTS / "mock_upstream.py"
ADDON = REPO / "addon" / "turnguard.py"
FLOWLOG_ADDON = Path(__file__).resolve().with_name("flowlog_addon.py")

START_TIMEOUT_S = 30.0


def mitmdump_path() -> str:
    """mitmdump next to this Python (the project's .venv), else on PATH."""
    here = Path(sys.executable).with_name("mitmdump")
    if here.exists():
        return str(here)
    found = shutil.which("mitmdump")
    if not found:
        raise RuntimeError("mitmdump not found next to this Python or on PATH (install mitmproxy)")
    return found


async def start_mock(workdir: Path, scenario: dict[str, Any]) -> tuple[Process, str, Path]:
    """The mock upstream with ``scenario``; returns (process, url, dispatch log path)."""
    scen = workdir / "upstream-scenario.json"
    scen.write_text(json.dumps(scenario, indent=1))
    log = workdir / "upstream.jsonl"
    proc = Process(
        [sys.executable, "-u", str(MOCK_UPSTREAM), "--host", "127.0.0.1", "--port", "0",
         "--log", str(log), "--scenario", str(scen)],
        workdir / "upstream.out", new_session=True,
    )
    m = await _started(proc, MOCK_LINE, "mock upstream")
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
) -> tuple[Process, str]:
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
    proc = Process(cmd, workdir / "mitmdump.log", new_session=True)
    m = await _started(proc, MITMDUMP_LINE, "mitmdump")
    return proc, f"http://127.0.0.1:{m.group(1)}"


async def _started(proc: Process, pattern, what: str):
    """Its listening line; a process that never says it (it failed, or the run was stopped
    meanwhile: ^C, SIGTERM) is stopped here, since its caller never gets it to stop."""
    try:
        return await proc.await_line(pattern, START_TIMEOUT_S, what)
    except BaseException:
        proc.stop()
        raise
