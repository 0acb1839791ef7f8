#!/usr/bin/env python3
"""The mock upstream's entry point by path (what tests/harness.py, scripts/proxy, scripts/mock
and the reproduction toolkit start):

    python scripts/mock_upstream.py --host 127.0.0.1 --port 0 \\
        [--scenario FILE.json] [--log FILE.jsonl]

It prints ``mock upstream listening at http://127.0.0.1:PORT`` once it listens; SIGTERM and
SIGINT make it exit with status 0. The code and its documentation are the ``turnguard_mock``
package next to this file; ``--help`` explains every behaviour.
"""

from __future__ import annotations

import sys
from pathlib import Path

_SCRIPTS = str(Path(__file__).resolve().parent)
if _SCRIPTS not in sys.path:
    sys.path.insert(0, _SCRIPTS)

from turnguard_mock.__main__ import main  # noqa: E402
from turnguard_mock.scenario import KINDS  # noqa: E402, F401 - the behaviour kinds, for readers

if __name__ == "__main__":
    sys.exit(main())
