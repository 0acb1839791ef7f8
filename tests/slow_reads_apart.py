"""A test addon for a real mitmdump: each read of the ledger on a read-only connection of its
own (``Ledger.read_at``: a read apart, with the ledger open or not) answers ``DELAY_S`` late,
as one does on a machine whose CPU is taken (a full run of the suite beside other runs, load
18 on 2 cores): its thread gets no CPU for that long. The read itself still runs, on the real
ledger, after the delay."""

import time

from turnguard_core import ledger

DELAY_S = 0.6  # past a read apart's 0.15 s, and past a request's 0.5 s step for the ledger

_read_at = ledger.Ledger.read_at


def _late_read_at(*args, **kwargs):
    time.sleep(DELAY_S)
    return _read_at(*args, **kwargs)


ledger.Ledger.read_at = staticmethod(_late_read_at)

addons: list = []
