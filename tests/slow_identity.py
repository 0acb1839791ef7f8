"""``identity.identify`` taking a known time more, for the tests of the identity worker
(``test_offload.py``): a bound measured against a sleep, not against CPU work, holds on a
busy machine. Importable by the worker (a spawned interpreter gets the test process's
``sys.path``), which runs it as the function its pool is handed."""

from __future__ import annotations

import time

from turnguard_core import identity

DELAY_S = 0.1
_identify = identity.identify


def identify(view, **kwargs):
    time.sleep(DELAY_S)
    return _identify(view, **kwargs)
