"""What a benchmark result was measured on: git revision, addon digest, versions, load."""

from __future__ import annotations

import os
import platform
import subprocess
import time

from turnguard_bench import REPO, procs


def _git() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "addon"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + (" (addon/ modified)" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def environment() -> dict:
    try:
        import mitmproxy.version as mv
        mitm = mv.VERSION
    except Exception:  # noqa: BLE001
        mitm = "?"
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git": _git(),
        "addon_from": "working tree",
        "addon_sha256": procs.addon_digest(),
        "python": platform.python_version(),
        "mitmproxy": mitm,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "loadavg_before": loadavg(),
    }
