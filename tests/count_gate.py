"""A test addon for a real mitmdump (loaded after turnguard): a gate in front of the ledger's
count of operations by state (``counts``: the scan of the whole table behind
``turnguard.status``'s ``operations_by_state``), so that a test shows by order, not by time,
what the proxy does while a count runs. The count itself still runs, on the real ledger, once
the gate lets it through.

- ``POST /__count_gate/close``: counts started from now on wait (at most ``HOLD_S``) at the gate;
- ``POST /__count_gate/open``: they go on;
- ``POST /__count_gate/fail``: the next count fails (a ``LedgerError``: "database is locked");
- ``GET /__count_gate``: ``{"waiting": counts at the gate now, "started": counts started}``."""

import json
import threading

from mitmproxy import http

from turnguard_core import ledger_admin
from turnguard_core.ledger import LedgerError

HOLD_S = 30.0

_open = threading.Event()
_open.set()
_lock = threading.Lock()
_state = {"waiting": 0, "started": 0, "fail": 0}


def _gated(counts):
    def gated(self):
        with _lock:
            _state["started"] += 1
            _state["waiting"] += 1
        try:
            _open.wait(HOLD_S)
        finally:
            with _lock:
                _state["waiting"] -= 1
                fail, _state["fail"] = _state["fail"], 0
        if fail:
            raise LedgerError("database is locked")
        return counts(self)
    return gated


ledger_admin.LedgerAdmin.counts = _gated(ledger_admin.LedgerAdmin.counts)
try:
    from turnguard_core import pg_ledger
except ImportError:  # psycopg not installed: the SQLite ledger only
    pass
else:
    pg_ledger.PgLedgerAdmin.counts = _gated(pg_ledger.PgLedgerAdmin.counts)


class CountGate:
    def request(self, flow: http.HTTPFlow) -> None:
        path = flow.request.path
        if not path.startswith("/__count_gate"):
            return
        if path == "/__count_gate/close":
            _open.clear()
        elif path == "/__count_gate/open":
            _open.set()
        elif path == "/__count_gate/fail":
            with _lock:
                _state["fail"] = 1
        with _lock:
            body = json.dumps({"waiting": _state["waiting"], "started": _state["started"]})
        flow.response = http.Response.make(200, body, {"content-type": "application/json"})


addons = [CountGate()]
