"""The benchmark's hook timer (the ``hooks`` phase): times, inside a running mitmdump, the
hooks of the addon it measures and named parts of them: the CPU time of the thread that runs
them (``time.thread_time()``: the event loop's; time the process is not running, preempted
by the load's clients on a small machine, does not count).

Loaded after the measured addon (``-s addon/turnguard.py -s hook_timer_addon.py``). At
``running`` it replaces each timed callable (``PARTS``: attribute paths from the addon, e.g.
``replayer.replay``, or module functions; the ``turnguard`` logger's ``handle``) with a wrapper
on its owner (the instance, or the module), so that every call of it from then on is timed;
mitmproxy looks a hook up on its addon at every call, so the hooks are timed too. A part that
suspends (awaits something that is not ready) also counts what the thread ran for other flows
meanwhile: the parts of a replay and of a claim on an uncontended ledger never suspend.

The garbage collector's passes are timed too (``gc.callbacks``), in any process that loads it:
``GC_PART``, every pass, and ``GC_FULL_PART``, the full ones (the oldest generation). A pass
runs within whatever allocated when it was due, so its time is also in that part.

``GET /_bench/hook_times`` (answered by this addon, never timed) returns what was timed since
the last such request, as JSON, and starts over: ``{"addon": name, "parts": {part: {"calls":
n, "median_us": .., "p90_us": .., "total_us": ..}}}``. Parts nest (the request hook includes
its identity, its decision and its answer; the answer includes its telemetry line): each is
timed as a whole.
"""

from __future__ import annotations

import functools
import gc
import inspect
import json
import logging
import sys
import time

from mitmproxy import ctx, http

TIMES_PATH = "/_bench/hook_times"

# the measured addon (by mitmproxy's name for it) -> part -> the callable: an attribute path
# from the addon, or "module:function" for a function its modules call through their module;
# several, separated by "|": the first that exists (an older addon, --addon-rev, has another)
PARTS: dict[str, dict[str, str]] = {
    "turnguard": {
        "request hook": "request",
        "identity": "identifier.identify",
        "identity: the request's view (headers, body)": "turnguard_shell.flows:request_view",
        "identity: parsing and hashing (not remembered)":
            "turnguard_core.identity_memo:identify|turnguard_core.identity:identify",
        "request facts (session owner)": "request_facts",
        "decision (admission, ledger)": "decide",
        "replay answer": "replayer.replay",
        "replay answer: the response made": "turnguard_shell.flows:replay",
        "dispatch start (attempt, heartbeat)": "inflight.start",
        "telemetry line (JSON, log record)": "telemetry.emit",
        "responseheaders hook": "responseheaders",
        "response hook": "response",
        # outside the hooks: the response's chunks through the tee (mitmproxy calls it per
        # chunk), and the group commits of the writes deferred by the hooks (an attempt's
        # first event and end), run by the event loop after them (those a later ledger call
        # commits with it are in that call's part)
        "response stream (the tee, per chunk)": "turnguard_core.tee:ResponseTee.__call__",
        "group commit of deferred writes (after the hooks)":
            "turnguard_core.ledger_runner:LedgerRunner.flush",
    },
    "answerfloor": {"request hook": "request", "response hook": "response"},
    "ledgerfloor": {"request hook": "request", "responseheaders hook": "responseheaders",
                    "response hook": "response"},
}
LOG_PART = "log record handling (handlers)"  # the "turnguard" logger's handle(), with turnguard
GC_PART = "garbage collection (every pass)"
GC_FULL_PART = "garbage collection: full passes"
OLDEST = len(gc.get_count()) - 1  # the collector's oldest generation


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _ours(args: tuple) -> bool:
    """Whether a call is about one of this addon's own requests (never timed)."""
    return bool(args) and isinstance(args[0], http.HTTPFlow) \
        and args[0].request.path.startswith("/_bench/")


class HookTimer:
    def __init__(self) -> None:
        self.addon: str | None = None
        self.samples: dict[str, list[float]] = {}

    def running(self) -> None:
        self._time_collections()
        for name, parts in PARTS.items():
            target = ctx.master.addons.get(name)
            if target is None:
                continue
            self.addon = name
            for part, paths in parts.items():
                for path in paths.split("|"):
                    module, colon, path = path.rpartition(":")
                    *owners, attr = path.split(".")
                    try:
                        owner = functools.reduce(getattr, owners,
                                                 sys.modules[module] if colon else target)
                        getattr(owner, attr)
                    except (KeyError, AttributeError):
                        continue
                    self._wrap(owner, attr, part)
                    break
            if name == "turnguard":
                self._wrap(logging.getLogger("turnguard"), "handle", LOG_PART)
            return
        logging.getLogger(__name__).info("hook timer: no addon of %s loaded; timing the garbage "
                                         "collector's passes only", list(PARTS))

    def _time_collections(self) -> None:
        every, full = (self.samples.setdefault(part, []) for part in (GC_PART, GC_FULL_PART))
        clock, began = time.thread_time, [0.0]

        def timed(phase: str, info: dict) -> None:
            if phase == "start":
                began[0] = clock()
                return
            spent = clock() - began[0]
            every.append(spent)
            if info["generation"] == OLDEST:
                full.append(spent)

        gc.callbacks.append(timed)

    def _wrap(self, owner: object, attr: str, part: str) -> None:
        func = getattr(owner, attr)
        samples = self.samples.setdefault(part, [])
        clock = time.thread_time
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def timed_async(*args, **kwargs):
                t0 = clock()
                try:
                    return await func(*args, **kwargs)
                finally:
                    if not _ours(args):
                        samples.append(clock() - t0)
            setattr(owner, attr, timed_async)
        else:
            @functools.wraps(func)
            def timed(*args, **kwargs):
                t0 = clock()
                try:
                    return func(*args, **kwargs)
                finally:
                    if not _ours(args):
                        samples.append(clock() - t0)
            setattr(owner, attr, timed)

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.path != TIMES_PATH:
            return
        parts = {}
        for part, samples in self.samples.items():
            s = sorted(samples)
            parts[part] = {"calls": len(s), "median_us": _percentile(s, 0.5) * 1e6 if s else None,
                           "p90_us": _percentile(s, 0.9) * 1e6 if s else None,
                           "total_us": sum(s) * 1e6}
            samples.clear()
        flow.response = http.Response.make(
            200, json.dumps({"addon": self.addon, "parts": parts}).encode(),
            {"content-type": "application/json"})


addons = [HookTimer()]
