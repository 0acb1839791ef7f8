"""Scenarios: which behaviour answers each dispatch. Pure: no I/O, no clock.

A scenario (a JSON object; every key optional)::

    {"default": BEHAVIOUR,                       # {"kind": "ok"} when absent
     "sequence": [BEHAVIOUR, ...],               # by global dispatch number n
     "sessions": {"SESSION": SELECTOR, ...},     # by the session-id / session_id header
     "operations": {"BODY_SHA256": SELECTOR, ...},  # by sha256 hex of the request body
                                                 # (a prefix of >= 8 hex digits is enough)
     "name": "...", "description": "..."}        # ignored: for people

    SELECTOR = {"sequence": [BEHAVIOUR, ...], "default": BEHAVIOUR}   # both optional

A dispatch's behaviour is the first of: the ``x-mock-behaviour`` header; its operation's
selector (``sequence[k]`` for the operation's k-th dispatch, else its ``default``); its session's
selector (likewise, k counted per session); ``sequence[n]``; ``default``. A selector whose
sequence is used up and that has no default does not match, so the next rule decides. Every
matching selector counts the dispatch, whichever rule decided.

BEHAVIOUR is ``{"kind": K, ...params}``: the kinds are ``KINDS``, their parameters are
documented on the ``Dispatch._do_*`` methods in ``behaviours.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = {
    "ok",
    "tool_call",
    "slow",
    "stall_before_headers",
    "stall_after_headers",
    "reset",
    "clean_close",
    "status",
    "partial",
}
DEFAULT_SCENARIO: dict[str, Any] = {"default": {"kind": "ok"}}
PARTIAL_ENDS = ("reset", "clean_close", "stall", "failed")
CONTENT_ENCODINGS = ("identity", "gzip", "deflate", "br", "zstd")
MAX_DELTA_BYTES = 1024 * 1024
MAX_EVENTS = 100_000
SCENARIO_META_KEYS = {"name", "description", "comment"}
NUMBER_PARAMS = ("events", "gap_ms", "delay_ms", "ms", "code", "retry_after", "first_event_ms",
                 "delta_bytes", "stall_ms", "think_ms", "hold_ms", "hold_after_events")


def validate_behaviour(b: Any, where: str = "behaviour") -> dict[str, Any]:
    """Return ``b`` if it is a behaviour object with a known kind and sane numbers, else raise
    ValueError."""
    if not isinstance(b, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(b).__name__}")
    kind = b.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where}: unknown kind {kind!r} (known: {sorted(KINDS)})")
    for key in NUMBER_PARAMS:
        if key in b and b[key] is not None:
            v = b[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{where}: {key} must be a non-negative number")
    if "code" in b and not 100 <= int(b["code"]) <= 599:
        raise ValueError(f"{where}: code must be an HTTP status 100..599")
    if "events" in b and int(b["events"]) > MAX_EVENTS:
        raise ValueError(f"{where}: events must be <= {MAX_EVENTS}")
    if "delta_bytes" in b and int(b["delta_bytes"]) > MAX_DELTA_BYTES:
        raise ValueError(f"{where}: delta_bytes must be <= {MAX_DELTA_BYTES}")
    if "hold" in b and not (isinstance(b["hold"], str) and b["hold"]):
        raise ValueError(f"{where}: hold must be a non-empty string (the hold's name)")
    for key in ("text", "name", "call_id", "response_id"):
        if key in b and not isinstance(b[key], str):
            raise ValueError(f"{where}: {key} must be a string")
    if "arguments" in b and not isinstance(b["arguments"], (str, dict)):
        raise ValueError(f"{where}: arguments must be a string or a JSON object")
    if "content_encoding" in b and b["content_encoding"] not in CONTENT_ENCODINGS:
        raise ValueError(f"{where}: content_encoding must be one of {list(CONTENT_ENCODINGS)}")
    if "end" in b and b["end"] not in PARTIAL_ENDS:
        raise ValueError(f"{where}: end must be one of {list(PARTIAL_ENDS)}")
    if "after_completed" in b and b["after_completed"] not in (
            "reset", "clean_close", "repeat_terminal", "repeat_output"):
        raise ValueError(f"{where}: after_completed must be reset, clean_close, "
                         "repeat_terminal or repeat_output")
    if "headers" in b:
        h = b["headers"]
        if not isinstance(h, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k.strip() and "\n" not in k + v
            and "\r" not in k + v and ":" not in k
            for k, v in h.items()
        ):
            raise ValueError(f"{where}: headers must be an object of header name -> string value")
    return b


def _validate_selector(sel: Any, where: str) -> dict[str, Any]:
    """A per-session or per-operation selector: ``{"sequence": [...], "default": B}``, both
    optional; normalised to have ``sequence`` and ``default`` (None when absent)."""
    if not isinstance(sel, dict):
        raise ValueError(f"{where} must be a JSON object")
    unknown = set(sel) - {"default", "sequence"} - SCENARIO_META_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    seq = sel.get("sequence", [])
    if not isinstance(seq, list):
        raise ValueError(f"{where}.sequence must be a list")
    default = sel.get("default")
    return {
        "sequence": [validate_behaviour(b, f"{where}.sequence[{i}]") for i, b in enumerate(seq)],
        "default": None if default is None else validate_behaviour(default, f"{where}.default"),
    }


def validate_scenario(s: Any) -> dict[str, Any]:
    """Return a normalised scenario (``default``, ``sequence``, ``sessions`` and
    ``operations`` always present) or raise ValueError."""
    if not isinstance(s, dict):
        raise ValueError("scenario must be a JSON object")
    unknown = set(s) - {"default", "sequence", "sessions", "operations"} - SCENARIO_META_KEYS
    if unknown:
        raise ValueError(f"scenario: unknown keys {sorted(unknown)}")
    default = validate_behaviour(s.get("default", {"kind": "ok"}), "default")
    seq = s.get("sequence", [])
    if not isinstance(seq, list):
        raise ValueError("scenario: sequence must be a list")
    seq = [validate_behaviour(b, f"sequence[{i}]") for i, b in enumerate(seq)]
    sessions = s.get("sessions", {})
    if not isinstance(sessions, dict):
        raise ValueError("scenario: sessions must be an object of session id -> selector")
    operations = s.get("operations", {})
    if not isinstance(operations, dict):
        raise ValueError("scenario: operations must be an object of body sha256 -> selector")
    for key in operations:
        if not (8 <= len(key) <= 64 and all(c in "0123456789abcdef" for c in key)):
            raise ValueError(
                f"scenario: operations key {key!r} must be 8..64 lowercase hex digits "
                "(a prefix of the request body's sha256)"
            )
    out = {
        "default": default,
        "sequence": seq,
        "sessions": {k: _validate_selector(v, f"sessions[{k!r}]") for k, v in sessions.items()},
        "operations": {
            k: _validate_selector(v, f"operations[{k!r}]") for k, v in operations.items()
        },
    }
    for key in SCENARIO_META_KEYS & set(s):
        out[key] = s[key]
    return out


@dataclass(frozen=True)
class Selection:
    """What the scenario says about one dispatch: its number ``n`` across the server, the
    behaviour and the rule that chose it (``operation``, ``session``, ``sequence`` or
    ``default``), and its number within its operation and its session (None when no selector
    of the scenario matched it)."""

    n: int
    selected_by: str
    behaviour: dict[str, Any]
    op_n: int | None
    session_n: int | None


def _pick(selector: dict[str, Any], k: int) -> dict[str, Any] | None:
    """The behaviour a selector gives its k-th dispatch, or None when it does not decide."""
    seq = selector["sequence"]
    return seq[k] if k < len(seq) else selector["default"]


class Dispatcher:
    """A scenario and its counters: the dispatch number across the server and per matching
    operation and session. ``replace`` installs another scenario and starts counting again."""

    def __init__(self, scenario: Any = DEFAULT_SCENARIO):
        self.replace(scenario)

    def replace(self, scenario: Any) -> None:
        """Validate and install ``scenario`` (ValueError if it is not one); the counts restart
        at 0."""
        self.scenario = validate_scenario(scenario)
        self.counter = 0
        self.session_counts: dict[str, int] = {}
        self.op_counts: dict[str, int] = {}

    def _operation_key(self, body_sha: str) -> str | None:
        """The longest ``operations`` key that is a prefix of ``body_sha``, or None."""
        best = None
        for key in self.scenario["operations"]:
            if body_sha.startswith(key) and (best is None or len(key) > len(best)):
                best = key
        return best

    def next(self, session: str | None, body_sha: str) -> Selection:
        """Count one dispatch (of the request body with sha256 ``body_sha``, in ``session``)
        and pick its behaviour, in the order of the module docstring."""
        n = self.counter
        self.counter += 1
        choices: list[tuple[str, dict[str, Any] | None]] = []
        op_n = session_n = None
        op_key = self._operation_key(body_sha)
        if op_key is not None:
            op_n = self.op_counts.get(op_key, 0)
            self.op_counts[op_key] = op_n + 1
            choices.append(("operation", _pick(self.scenario["operations"][op_key], op_n)))
        if session is not None and session in self.scenario["sessions"]:
            session_n = self.session_counts.get(session, 0)
            self.session_counts[session] = session_n + 1
            choices.append(("session", _pick(self.scenario["sessions"][session], session_n)))
        seq = self.scenario["sequence"]
        choices.append(("sequence", seq[n] if n < len(seq) else None))
        by, b = next((c for c in choices if c[1] is not None), ("default", self.scenario["default"]))
        return Selection(n, by, b, op_n, session_n)
