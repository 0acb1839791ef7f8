"""Run mitmdump under Python's deterministic profiler, switched on and off by signals.

    python -m turnguard_bench.calls_profiler OUT MITMDUMP [mitmdump's arguments ...]

``START_SIGNAL`` begins counting with new counters; ``STOP_SIGNAL`` stops it and writes what
was counted to OUT (``pstats``' format), whole, by a rename. Real-time signals: mitmproxy
takes SIGUSR1 and SIGUSR2 for itself (its debug dumps). The calls phase
(``calls_phase``) drives it; the profiler counts every call of a Python function and of a C
function called from Python (each thread's, since Python 3.12) while it is on.
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys

START_SIGNAL = signal.SIGRTMIN + 1
STOP_SIGNAL = signal.SIGRTMIN + 2


def main() -> None:
    out, sys.argv = sys.argv[1], sys.argv[2:]
    profiler: cProfile.Profile | None = None

    def start(*_: object) -> None:
        nonlocal profiler
        profiler = cProfile.Profile()
        profiler.enable()

    def stop(*_: object) -> None:
        if profiler is None:
            return
        profiler.disable()
        profiler.dump_stats(out + ".part")
        os.replace(out + ".part", out)

    signal.signal(START_SIGNAL, start)
    signal.signal(STOP_SIGNAL, stop)
    from mitmproxy.tools.main import mitmdump

    mitmdump()


if __name__ == "__main__":
    main()
