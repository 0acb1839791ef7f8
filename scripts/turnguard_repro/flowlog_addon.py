"""A mitmproxy addon the scenario runner loads next to turnguard (and alone in the plain
column): one JSON line per finished flow, so that the timeline can tell which client attempt a
flow was (the ``x-turnguard-repro-attempt`` request header) and what mitmproxy did with it. It
only observes; turnguard's events file and the mock's dispatch log stay the sources of truth
for counts.

    mitmdump -s flowlog_addon.py --set repro_flowlog=FILE.jsonl
"""

import json
import os
import time

from mitmproxy import ctx


class ReproFlowLog:
    def __init__(self) -> None:
        self._file = None

    def load(self, loader) -> None:
        loader.add_option("repro_flowlog", str, "", "JSON-lines file: one record per finished flow.")

    def configure(self, updated) -> None:
        if "repro_flowlog" in updated and ctx.options.repro_flowlog:
            fd = os.open(ctx.options.repro_flowlog, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._file = os.fdopen(fd, "a", buffering=1, encoding="utf-8")

    def _write(self, flow, end: str) -> None:
        if self._file is None:
            return
        resp = flow.response
        rec = {
            "ts": time.time(),
            "end": end,
            "flow": flow.id,
            "attempt": flow.request.headers.get("x-turnguard-repro-attempt"),
            "path": flow.request.path,
            "ts_request": flow.request.timestamp_start,
            "status": resp.status_code if resp is not None else None,
            "x_turnguard": resp.headers.get("x-turnguard") if resp is not None else None,
            "turnguard_role": (flow.metadata.get("turnguard") or {}).get("role"),
            "marked": flow.marked or None,
            "comment": flow.comment or None,
            "error": flow.error.msg if flow.error else None,
        }
        self._file.write(json.dumps(rec) + "\n")

    def response(self, flow) -> None:
        self._write(flow, "response")

    def error(self, flow) -> None:
        self._write(flow, "error")

    def done(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


addons = [ReproFlowLog()]
