"""Scenarios: what the upstream does, which clients run, which columns to compare.

A scenario file is JSON::

    {"name": "...", "description": "...", "incident": "where it was reported",
     "shortened": ["what is shorter than in production", ...],
     "upstream": MOCK_SCENARIO,        # scripts/mock_upstream.py's format (per dispatch,
                                       # per session, per operation)
     "clients": [CLIENT, ...],         # see clients.make_client
     "columns": ["plain", "default", "once"],   # optional; see COLUMNS
     "turnguard_options": {"turnguard_cooldown_ms": 3000, ...},  # optional, for every
                                       # turnguard column; absent options take turnguard's
                                       # defaults (a capture's timings are replayed as they
                                       # were; the built-ins shorten theirs, see SHORTENED)
     "deadline_s": 60}                 # optional: hard bound of one column's run

``reproduce show NAME`` prints a built-in one as a starting point for your own.
"""

from __future__ import annotations

import copy
from typing import Any

from . import clients

# Production defaults of the turnguard options a scenario may shorten, for the report.
PRODUCTION = {"turnguard_cooldown_ms": 60000, "turnguard_response_created_timeout_ms": 60000}
# What the built-in scenarios use so that they run in seconds: part of each built-in's own
# turnguard_options (so `reproduce show NAME` prints them). A scenario file (one from a capture,
# or your own) gets turnguard's defaults unless it, or --set, says otherwise.
SHORTENED = {"turnguard_cooldown_ms": 3000, "turnguard_response_created_timeout_ms": 1000}

COLUMNS: dict[str, dict[str, Any]] = {
    "plain": {"title": "plain mitmdump", "addon": False, "options": {},
              "about": "mitmdump without turnguard: what the clients and the upstream do alone"},
    "guard409": {"title": "409 guard", "addon": True, "options": {"turnguard_hold_timeout_ms": 0},
                 "about": "turnguard with turnguard_hold_timeout_ms=0: duplicates get 409 "
                          "turn_in_progress at once, like the guard in the OmniRoute report"},
    "default": {"title": "turnguard default", "addon": True, "options": {},
                "about": "turnguard defaults (recovery mode fail_closed)"},
    "once": {"title": "turnguard once", "addon": True,
             "options": {"turnguard_recovery_mode": "server_anchored_replay_once"},
             "about": "turnguard_recovery_mode=server_anchored_replay_once"},
    "indefinite": {"title": "turnguard indefinite", "addon": True,
                   "options": {"turnguard_recovery_mode": "server_indefinite_recovery"},
                   "about": "turnguard_recovery_mode=server_indefinite_recovery"},
}
DEFAULT_COLUMNS = ["plain", "default", "once"]

TURN = {"model": "gpt-test", "input": [{"role": "user", "content": "fix the failing test"}], "stream": True}
HEALTHY = {"kind": "ok", "events": 4}
# A request without a response event: a stall that turnguard's response_created timeout cuts,
# then a reset. Two of them open the retry circuit.
STALL_THEN_RESET = [{"kind": "stall_before_headers", "ms": 8000}, {"kind": "reset"}]
STALL_SHORTENED = "the upstream stalls 8 s before its headers, then closes"


def impatient(name: str, session: str) -> dict[str, Any]:
    """The client of the Codex Desktop report: it ignores Retry-After and retries every 200 ms,
    10 attempts in all."""
    return {"name": name, "model": "impatient", "session": session, "body": TURN,
            "params": {"retry_gap_ms": 200, "max_attempts": 10}}


BUILTIN: dict[str, dict[str, Any]] = {
    "duplicate-storm": {
        "description": (
            "The original turn starts (response.created) and then stalls upstream; a gateway "
            "executor that saw no output for 1.5 s re-sends the identical request on new "
            "connections while the original stays open (the OmniRoute pattern)."
        ),
        "incident": "duplicate turns, OmniRoute issue 18716",
        "shortened": ["the original stalls 6 s after response.created (incident: 10-244 s)",
                      "the upstream answers a duplicate's dispatch after 2.5 s"],
        "columns": ["plain", "guard409", "default", "once"],
        "upstream": {
            "sequence": [{"kind": "ok", "think_ms": 6000, "events": 4, "gap_ms": 20}],
            "default": {"kind": "ok", "think_ms": 2500, "events": 4, "gap_ms": 20},
        },
        "clients": [
            {"name": "gateway", "model": "gateway", "session": "sess-dup", "body": TURN,
             "params": {"hedge_after_ms": 1500, "max_parallel": 3}},
        ],
    },
    "cooldown-503-storm": {
        "description": (
            "A turn's first request ends in a tool call; the next request of the turn carries "
            "x-codex-turn-state (a hard turn-state request) and fails twice without a response "
            "event (a stall cut by turnguard's response_created timeout, then a reset); the "
            "retry circuit opens; the client ignores Retry-After and retries every 200 ms."
        ),
        "incident": "cooldown 503 storm, codex-lb issue 1737 (Codex Desktop)",
        "shortened": [STALL_SHORTENED + " (incident: until the client or a proxy gives up)"],
        "columns": ["plain", "default", "once", "indefinite"],
        "upstream": {"sequence": [{"kind": "tool_call"}, *STALL_THEN_RESET], "default": HEALTHY},
        "clients": [impatient("desktop", "sess-storm")],
    },
    "cooldown-codex-cli": {
        "description": (
            "The cooldown storm's upstream, with the Codex CLI's retry policy instead: it "
            "honours Retry-After on a 503, so it waits out the cooldown even in the default "
            "mode."
        ),
        "incident": "codex-lb issue 1737, the CLI side",
        "shortened": [STALL_SHORTENED],
        "columns": ["plain", "default", "once"],
        "upstream": {"sequence": [{"kind": "tool_call"}, *STALL_THEN_RESET], "default": HEALTHY},
        "clients": [{"name": "codex", "model": "codex_cli", "session": "sess-cli", "body": TURN}],
    },
    "codex-websocket-cooldown": {
        "description": (
            "Codex's default transport: each model call is a response.create frame on a "
            "WebSocket. The upstream closes the socket right after the frame, twice, without "
            "an event; the retry circuit opens. Codex reconnects (0.2 s doubling, 5 times) and "
            "then falls back to HTTP POST, the same operation: turnguard fails every attempt "
            "closed with a 503 (an error event with a status on the socket) until the cooldown "
            "is over, or, in the recovery modes, holds the frame through it."
        ),
        "incident": "codex-lb issue 1737 on the WebSocket transport",
        "shortened": [],
        "columns": ["plain", "default", "once"],
        "upstream": {
            "sequence": [{"kind": "clean_close"}, {"kind": "clean_close"}],
            "default": {"kind": "ok", "events": 4},
        },
        "clients": [{"name": "codex", "model": "codex_ws", "session": "sess-ws", "body": TURN}],
    },
    "replay-after-completion": {
        "description": (
            "A turn completes upstream; 1.5 s later the same request is sent again (a gateway "
            "re-sending a turn it already relayed after its own client dropped). Without a "
            "recording the upstream runs the turn a second time."
        ),
        "incident": "duplicate turns x replay window",
        "shortened": [],
        "columns": ["plain", "default", "once"],
        "upstream": {"default": {"kind": "ok", "events": 4, "delay_ms": 300}},
        "clients": [
            {"name": "first", "model": "codex_cli", "session": "sess-replay", "body": TURN},
            {"name": "resend", "model": "codex_cli", "session": "sess-replay", "body": TURN,
             "start_ms": 1500},
        ],
    },
    "partial-output": {
        "description": (
            "The turn's anchored request streams 3 events and drops; its retries then fail "
            "twice without events, opening the cooldown. The operation already produced output, "
            "so no recovery mode may hold and re-run it: turnguard fails closed."
        ),
        "incident": "cooldown storm x partial output",
        "shortened": [STALL_SHORTENED],
        "columns": ["plain", "default", "once"],
        "upstream": {
            "sequence": [{"kind": "tool_call"}, {"kind": "partial", "events": 3},
                         *STALL_THEN_RESET],
            "default": HEALTHY,
        },
        "clients": [impatient("desktop", "sess-partial")],
    },
    "upstream-429": {
        "description": (
            "The upstream answers 429 with Retry-After: 2 (twice for the SDK's session, five "
            "times for the impatient client's). A 429 is a rejection, not an eventless failure: "
            "turnguard passes it through and opens no cooldown."
        ),
        "incident": "rate limits x retry circuit",
        "shortened": [],
        "columns": ["plain", "default", "once"],
        "upstream": {
            "sessions": {
                "sess-sdk": {"sequence": [{"kind": "status", "code": 429, "retry_after": 2}] * 2},
                "sess-desktop": {"sequence": [{"kind": "status", "code": 429, "retry_after": 2}] * 5},
            },
            "default": HEALTHY,
        },
        "clients": [
            {"name": "sdk", "model": "openai_python", "session": "sess-sdk", "body": TURN},
            impatient("desktop", "sess-desktop"),
        ],
    },
}


def builtin(name: str) -> dict[str, Any]:
    """A built-in scenario as a scenario file would hold it (with its shortened timings)."""
    if name not in BUILTIN:
        raise KeyError(name)
    s = {"name": name, **copy.deepcopy(BUILTIN[name])}
    s["turnguard_options"] = {**SHORTENED, **s.get("turnguard_options", {})}
    return s


def validate(s: Any, where: str = "scenario") -> dict[str, Any]:
    """Check a scenario's shape (the mock validates ``upstream`` itself when it starts);
    returns it with defaults filled in. Raises ValueError."""
    if not isinstance(s, dict):
        raise ValueError(f"{where} must be a JSON object")
    known = {"name", "description", "incident", "shortened", "upstream", "clients", "columns",
             "turnguard_options", "deadline_s", "source"}
    unknown = set(s) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    s = copy.deepcopy(s)
    s.setdefault("name", "scenario")
    s.setdefault("description", "")
    s.setdefault("shortened", [])
    s.setdefault("upstream", {"default": {"kind": "ok"}})
    if not isinstance(s["upstream"], dict):
        raise ValueError(f"{where}: upstream must be a mock scenario object")
    cl = s.get("clients")
    if not isinstance(cl, list) or not cl:
        raise ValueError(f"{where}: clients must be a non-empty list")
    names = set()
    for i, c in enumerate(cl):
        if not isinstance(c, dict) or c.get("model") not in clients.MODELS:
            raise ValueError(f"{where}: clients[{i}] needs a model, one of {sorted(clients.MODELS)}")
        c.setdefault("name", f"{c['model']}-{i + 1}")
        if c["name"] in names:
            raise ValueError(f"{where}: two clients named {c['name']!r}")
        names.add(c["name"])
    cols = s.setdefault("columns", list(DEFAULT_COLUMNS))
    bad = [c for c in cols if c not in COLUMNS]
    if bad or not cols:
        raise ValueError(f"{where}: unknown columns {bad} (known: {sorted(COLUMNS)})")
    opts = s.setdefault("turnguard_options", {})
    if not isinstance(opts, dict) or not all(k.startswith("turnguard_") for k in opts):
        raise ValueError(f"{where}: turnguard_options must map turnguard_* options to values")
    s["deadline_s"] = float(s.get("deadline_s", 60))
    if not 1 <= s["deadline_s"] <= 900:
        raise ValueError(f"{where}: deadline_s must be between 1 and 900")
    return s
