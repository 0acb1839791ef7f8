"""A test addon for a real mitmdump: a gate in front of the ledger writes that record an
attempt's end (``finish``, ``record_offline_attempt``, on either ledger), so that a test shows
by order, not by time, what happens while such a write is under way on the ledger's thread.
The write itself still runs, on the real ledger, once the gate lets it through. The gate is
files in the folder ``$TURNGUARD_TEST_WRITE_GATE`` (``closed``, ``state``), so it
works while the proxy's event loop waits and while no turnguard instance is loaded (a script
reload that failed): it is a script of its own.

- while the file ``closed`` is there, writes wait at the gate (at most ``HOLD_S``) on the
  ledger's thread; one the event loop runs itself (the runner's fast path) fails as if the
  database were locked, so that the runner hands it to its thread, as it does for a lock;
- while it is closed, a read on a connection of its own (``Ledger.read_apart``) fails too,
  as one that cannot open the file does: a request's call then waits for the write under way
  on the ledger's connection, the moment the tests that use the gate are about;
- ``state`` (JSON): ``{"waiting": writes at the gate now, "returned": writes that ran and
  returned (applied or fenced out)}``."""

import json
import os
import threading
import time
from pathlib import Path

from turnguard_core import ledger
from turnguard_core.ledger import LedgerError
from turnguard_core.store import loop_running

HOLD_S = 30.0
FOLDER = Path(os.environ["TURNGUARD_TEST_WRITE_GATE"])

_lock = threading.Lock()
_state = {"waiting": 0, "returned": 0}


def _closed() -> bool:
    return (FOLDER / "closed").exists()


def _note(key: str, by: int) -> None:
    with _lock:
        _state[key] += by
        tmp = FOLDER / "state.tmp"
        tmp.write_text(json.dumps(_state))
        tmp.replace(FOLDER / "state")


def _gated(write):
    def gated(self, *args, **kwargs):
        if _closed():
            if loop_running():
                raise LedgerError("database is locked (the write gate is closed)")
            _note("waiting", 1)
            try:
                until = time.monotonic() + HOLD_S
                while _closed() and time.monotonic() < until:
                    time.sleep(0.01)
            finally:
                _note("waiting", -1)
        result = write(self, *args, **kwargs)
        _note("returned", 1)
        return result
    return gated


def _read_apart(read_apart):
    def gated(self, *args, **kwargs):
        if _closed():
            raise LedgerError("the read apart fails while the write gate is closed")
        return read_apart(self, *args, **kwargs)
    return gated


ledger.Ledger.read_apart = _read_apart(ledger.Ledger.read_apart)
ledger.Ledger.finish = _gated(ledger.Ledger.finish)
ledger.Ledger.record_offline_attempt = _gated(ledger.Ledger.record_offline_attempt)
try:
    from turnguard_core import pg_ledger
except ImportError:  # psycopg not installed: the SQLite ledger only
    pass
else:
    pg_ledger.PgLedger.finish = _gated(pg_ledger.PgLedger.finish)
    pg_ledger.PgLedger.record_offline_attempt = _gated(pg_ledger.PgLedger.record_offline_attempt)

addons: list = []
