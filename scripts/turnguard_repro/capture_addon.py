"""Load this next to ``mitmdump -w`` when you capture an incident, so that the flow file keeps
what mitmproxy otherwise drops: how many SSE events a response sent before it broke, and when.

    mitmdump -w incident.flows -s scripts/turnguard_repro/capture_addon.py [-s addon/turnguard.py ...]

mitmproxy keeps no body for a response whose upstream broke mid-stream, nor for one an addon
streams (turnguard streams the responses it guards). This addon streams every
``text/event-stream`` response itself (bytes pass through unchanged and at once), counts its
events, and stores plain data in ``flow.metadata["repro_capture"]``: ``events`` (count),
``types`` (the first 200 event types), ``t_first_event`` / ``t_last_event`` (Unix seconds),
``bytes``, ``ended`` (the body ended normally) and ``body`` (the first 1 MiB as text).
``reproduce from-capture`` reads it. Load it after turnguard: it wraps turnguard's stream
callable instead of replacing it.
"""

import time

MAX_KEEP = 1024 * 1024
MAX_TYPES = 200


class _Tee:
    def __init__(self, flow, inner):
        self.flow = flow
        self.inner = inner
        self.buf = b""
        self.meta = {"events": 0, "types": [], "t_first_event": None, "t_last_event": None,
                     "bytes": 0, "ended": False, "body": ""}
        self.kept = bytearray()
        flow.metadata["repro_capture"] = self.meta

    def _observe(self, chunk: bytes) -> None:
        m = self.meta
        if not chunk:
            m["ended"] = True
            return
        m["bytes"] += len(chunk)
        if len(self.kept) < MAX_KEEP:
            self.kept += chunk[: MAX_KEEP - len(self.kept)]
            m["body"] = self.kept.decode("utf-8", "replace")
        self.buf = (self.buf + chunk).replace(b"\r\n", b"\n")
        *blocks, self.buf = self.buf.split(b"\n\n")
        for block in blocks:
            etype = None
            for line in block.split(b"\n"):
                if line.startswith(b"event:"):
                    etype = line[6:].strip().decode("utf-8", "replace")
                elif line.startswith(b"data:") and etype is None:
                    etype = ""
            if etype is None:
                continue
            now = time.time()
            m["events"] += 1
            m["t_first_event"] = m["t_first_event"] or now
            m["t_last_event"] = now
            if len(m["types"]) < MAX_TYPES:
                m["types"].append(etype)

    def __call__(self, chunk: bytes):
        try:
            self._observe(chunk)
        except Exception:  # never break the traffic being captured
            pass
        if callable(self.inner):
            return self.inner(chunk)
        return chunk


class ReproCapture:
    def responseheaders(self, flow) -> None:
        resp = flow.response
        if resp is None or not resp.headers.get("content-type", "").lower().startswith("text/event-stream"):
            return
        resp.stream = _Tee(flow, resp.stream)


addons = [ReproCapture()]
