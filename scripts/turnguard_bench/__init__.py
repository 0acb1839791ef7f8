"""turnguard's benchmark suite (``scripts/bench``): turnguard side by side with plain mitmdump.

Modules:
    upstream   a minimal asyncio HTTP/1.1 SSE upstream with precomputed responses (fast, so it
               is never the bottleneck), controlled by request headers; runs as its own process
    client     an asyncio keep-alive HTTP/1.1 load client (raw sockets, bounded in count and time)
    procs      starting and stopping the upstream and the mitmdump variants; /proc CPU and RSS
    phases     the measurements of issue 5 (per-request, streaming, holds, replay, ledger, soak)
    hooks_phase   turnguard's hooks and their parts timed inside mitmdump (hook_timer_addon)
    ledger_bench  ledger claims/s from 1 and 4 processes and the exactly-once check
    micro      in-process micro-benchmarks of turnguard's core (identity, SSE, tee, telemetry)
    report     the table and the JSON
    profiling  py-spy profiles of a turnguard mitmdump under load, summarised by category

Everything listens and connects on 127.0.0.1 only; every loop is bounded in count and time.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ADDON_DIR = REPO / "addon"
SCRIPTS_DIR = REPO / "scripts"
ADDON = ADDON_DIR / "turnguard.py"

for _p in (ADDON_DIR, SCRIPTS_DIR):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

HOST = "127.0.0.1"
