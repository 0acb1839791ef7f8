"""turnguard's options: their declaration, validation and the settings derived from them.

Pure data and functions: the addon registers ``OPTIONS`` with mitmproxy's loader, passes the
current values to ``settings_from`` in ``configure`` and turns a ``ValueError`` into an
``OptionsError``. The names are public interface (``--set name=value``); the README's option
table is checked against this list by the tests.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence  # the one mitmproxy's option manager knows
from typing import Any, Mapping

from .circuit import CircuitConfig
from .identity import KNOWN_ROUTES
from .ledger_location import shown_value
from .policy import RECOVERY_MODES, GuardPolicy, RecoveryMode
from .records import record

# POSTs to a known route, anchored at the start of the path: ~u matches the whole URL, so the
# anchor is the end of "scheme://authority". "/KEY/v1/responses" is not guarded by default.
DEFAULT_FILTER_ROUTES = "(" + "|".join(KNOWN_ROUTES) + ")/?([?]|$)"  # after the authority
DEFAULT_FILTER = f'(~websocket | ~m POST) & ~u "^[a-z][a-z0-9+.-]*://[^/?#]+{DEFAULT_FILTER_ROUTES}"'

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token


@record
class OptionSpec:
    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: int | None = None  # for ints: the smallest valid value


OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec(
        "turnguard_ledger", str, "",
        "Path of the SQLite ledger, shared by every turnguard process that uses it (operations "
        "of different upstreams and principals never mix). Refused if it, or the real file a "
        "symlink leads to, is writable by others or in a world-writable folder without the "
        "sticky bit, or if it is another program's SQLite database (a file that is no "
        "database at all is left untouched: an outage). Empty: <confdir>/turnguard.sqlite3. "
        "Or a PostgreSQL URL "
        "(postgresql://USER@HOST/DB; credentials also from the PG* environment variables or a "
        "libpq service file; the password is never shown): a ledger shared by several hosts.",
    ),
    OptionSpec(
        "turnguard_filter", str, DEFAULT_FILTER,
        "mitmproxy filter expression for the flows turnguard guards; everything else passes "
        "untouched. The default guards POSTs and WebSockets (Codex's Responses over "
        "WebSocket) to the known model routes at the start of the path.",
    ),
    OptionSpec(
        "turnguard_credential_headers", Sequence[str], [],
        "More request headers that carry a credential, beyond the built-in list "
        "(Authorization, Proxy-Authorization, Cookie, the providers' API-key, account, "
        "organization and project headers): requests that differ in them never share an "
        "operation, a recording, a session or a circuit. Repeat --set to name several.",
    ),
    OptionSpec(
        "turnguard_hold_timeout_ms", int, 30000,
        "How long a duplicate is held waiting for the original; past it the duplicate gets "
        "409 turn_in_progress with Retry-After. 0: answer duplicates 409 at once.",
        minimum=0,
    ),
    OptionSpec(
        "turnguard_request_budget_ms", int, 120000,
        "Upper bound on the time turnguard may keep any one request waiting, whatever the "
        "reason.",
        minimum=1,
    ),
    OptionSpec(
        "turnguard_replay", bool, True,
        "Record completed responses and answer duplicates and retries from the recording. "
        "false: store no response bodies; held duplicates are forwarded one at a time.",
    ),
    OptionSpec(
        "turnguard_replay_window_ms", int, 300000,
        "A retry with an identical body (no Idempotency-Key) that arrives this long after "
        "the original completed is answered from the recording; later it is a new operation. "
        "At most turnguard_retention_ms.",
        minimum=0,
    ),
    OptionSpec(
        "turnguard_retention_ms", int, 86400000,
        "How long ended operations and their recordings stay in the ledger (and how long an "
        "Idempotency-Key is remembered). At least turnguard_replay_window_ms.",
        minimum=1,
    ),
    OptionSpec(
        "turnguard_replay_max_bytes", int, 8 * 1024 * 1024,
        "Largest response body recorded for replay; a larger one is not replayable and its "
        "duplicates are forwarded instead.",
        minimum=0,
    ),
    OptionSpec(
        "turnguard_attach", bool, True,
        "A duplicate of an event stream in flight in this process attaches to it: it gets "
        "the response so far at once, then the rest live, to the same end, and no hold bound "
        "applies once the stream has started (needs turnguard_replay). false: duplicates are "
        "held until the original ends, then replayed.",
    ),
    OptionSpec(
        "turnguard_detach_ms", int, 0,
        "Run guarded dispatches detached from their client: the upstream call is the proxy's "
        "own (mitmproxy's replay path: same upstream, TLS settings and HTTP/2; a WebSocket "
        "call goes as its HTTP POST), the client attaches to it, and when the client "
        "disconnects the call keeps running "
        "this long without any client, so that its retry attaches to it or replays it "
        "instead of running the turn again. 0: off (the client's connection is the upstream "
        "call's, as in plain mitmproxy).",
        minimum=0,
    ),
    OptionSpec(
        "turnguard_detach_max", int, 32,
        "Most upstream calls running at once without any client (turnguard_detach_ms); one "
        "more whose client leaves is cut at once.",
        minimum=0,
    ),
    OptionSpec(
        "turnguard_response_created_timeout_ms", int, 60000,
        "Cut a guarded dispatch's upstream connection when no response event (headers and "
        "first SSE event) arrived within this long, and record it as an eventless failure "
        "(missing_response_created_timeout). 0: off.",
        minimum=0,
    ),
    OptionSpec(
        "turnguard_failure_threshold", int, 2,
        "Consecutive eventless failures in a scope (the session, else credential + route) "
        "that open the retry circuit's cooldown.",
        minimum=1,
    ),
    OptionSpec(
        "turnguard_cooldown_ms", int, 60000,
        "First cooldown of an open retry circuit; each further eventless failure doubles it. "
        "At most turnguard_cooldown_max_ms.",
        minimum=1,
    ),
    OptionSpec(
        "turnguard_cooldown_max_ms", int, 600000,
        "Longest cooldown of the retry circuit. At least turnguard_cooldown_ms.",
        minimum=1,
    ),
    OptionSpec(
        "turnguard_recovery_mode", str, "fail_closed",
        "What a guarded request gets during a cooldown. fail_closed: 503 "
        "upstream_request_timeout with Retry-After, nothing dispatched. "
        "server_anchored_replay_once: an eligible hard turn-state request is held through the "
        "cooldown, then recovered with at most one recovery dispatch per operation ever. "
        "server_indefinite_recovery: the same, without the once limit (still one at a time).",
        choices=RECOVERY_MODES,
    ),
    OptionSpec(
        "turnguard_owner_lease_ms", int, 300000,
        "Lease of this process's ownership of a durable session; renewed while it serves or "
        "holds requests of the session; another process may take over once it expired.",
        minimum=1,
    ),
    OptionSpec(
        "turnguard_instance_lease_ms", int, 300000,
        "How long another turnguard process sharing the ledger may stay silent (no heartbeat) "
        "before its attempts in flight are ended as unknown, when it cannot be proven gone "
        "(it runs on another host or in another pid namespace). A process on this host and in "
        "this pid namespace is reaped only once its process is gone, however long it stalls. "
        "The silence is timed on this process's monotonic clock (wall clocks that step or "
        "differ between hosts do not shorten or lengthen it), from when it first read the "
        "peer's heartbeat: after a start or a script reload it waits a whole lease. At least "
        "15000 (the heartbeat is written every 5 s).",
        minimum=15000,
    ),
    OptionSpec(
        "turnguard_metrics", str, "",
        "Serve Prometheus metrics on this HOST:PORT ([V6]:PORT for IPv6), at /metrics, e.g. "
        "127.0.0.1:9464; empty: off. Any address is accepted: the metrics carry no secret, "
        "but a non-loopback address exposes traffic volumes, so firewall it. Each process "
        "sharing a ledger needs its own address; a port in use stops start-up.",
    ),
    OptionSpec(
        "turnguard_events", str, "",
        "Path of a JSON-lines telemetry file (created 0600, never through a symlink; refused "
        "like the ledger, and an existing file that is no turnguard events file; deleted "
        "or rotated while running: opened again at the path); "
        "empty: telemetry goes to the log only.",
    ),
)


@record
class Settings:
    """The options as the guard uses them, in seconds."""

    guard: GuardPolicy
    circuit: CircuitConfig
    hold_timeout_s: float
    request_budget_s: float
    replay_max_bytes: int
    response_created_timeout_s: float  # 0: off
    recovery_mode: RecoveryMode
    owner_lease_s: float
    instance_lease_s: float
    credential_headers: tuple[str, ...] = ()  # lower-cased, beyond identity.CREDENTIAL_HEADERS
    attach: bool = True
    detach_s: float = 0.0  # 0: off
    detach_max: int = 32
    metrics: tuple[str, int] | None = None  # (host, port) to serve /metrics on; None: off


def problems(values: Mapping[str, Any]) -> list[str]:
    """Every problem of the option values, each a message that names its option (empty: none;
    the checks between two options only once each is right alone)."""
    found = []
    for spec in OPTIONS:
        value = values[spec.name]
        try:
            # (mitmproxy lets a bool pass as an int when it is set while running: True is 1)
            check_value_type(spec, value)
        except ValueError as e:
            found.append(str(e))
            continue
        if spec.minimum is not None and value < spec.minimum:
            found.append(f"{spec.name} must be >= {spec.minimum}, not {value}")
        if spec.choices is not None and value not in spec.choices:
            # mitmproxy checks choices= for command-line flags only, not for --set
            found.append(f"{spec.name} must be one of {', '.join(spec.choices)}, not {value!r}")
    if found:
        return found
    v = values
    for name in v["turnguard_credential_headers"]:
        if not _HEADER_NAME.fullmatch(name):
            found.append(f"turnguard_credential_headers: {name!r} is not a header name")
            break
    try:
        parse_listen_address(v["turnguard_metrics"])
    except ValueError as e:
        found.append(f"turnguard_metrics: {e}")
    if v["turnguard_retention_ms"] < v["turnguard_replay_window_ms"]:
        found.append(
            "turnguard_retention_ms must be >= turnguard_replay_window_ms "
            f"({v['turnguard_retention_ms']} < {v['turnguard_replay_window_ms']})")
    if v["turnguard_cooldown_max_ms"] < v["turnguard_cooldown_ms"]:
        found.append(
            "turnguard_cooldown_max_ms must be >= turnguard_cooldown_ms "
            f"({v['turnguard_cooldown_max_ms']} < {v['turnguard_cooldown_ms']})")
    return found


def settings_from(values: Mapping[str, Any]) -> Settings:
    """Validate the option values and derive the settings. Raises ``ValueError`` with a message
    that names the option (the first of ``problems``)."""
    found = problems(values)
    if found:
        raise ValueError(found[0])
    v = values
    credential_headers = tuple(v["turnguard_credential_headers"])
    metrics = parse_listen_address(v["turnguard_metrics"])
    return Settings(
        guard=GuardPolicy(
            replay=v["turnguard_replay"],
            replay_window_s=v["turnguard_replay_window_ms"] / 1000,
            retention_s=v["turnguard_retention_ms"] / 1000,
        ),
        circuit=CircuitConfig(
            threshold=v["turnguard_failure_threshold"],
            cooldown_s=v["turnguard_cooldown_ms"] / 1000,
            cooldown_max_s=v["turnguard_cooldown_max_ms"] / 1000,
        ),
        hold_timeout_s=v["turnguard_hold_timeout_ms"] / 1000,
        request_budget_s=v["turnguard_request_budget_ms"] / 1000,
        replay_max_bytes=v["turnguard_replay_max_bytes"],
        response_created_timeout_s=v["turnguard_response_created_timeout_ms"] / 1000,
        recovery_mode=v["turnguard_recovery_mode"],
        owner_lease_s=v["turnguard_owner_lease_ms"] / 1000,
        instance_lease_s=v["turnguard_instance_lease_ms"] / 1000,
        credential_headers=tuple(dict.fromkeys(name.lower() for name in credential_headers)),
        metrics=metrics,
        attach=v["turnguard_attach"],
        detach_s=v["turnguard_detach_ms"] / 1000,
        detach_max=v["turnguard_detach_max"],
    )


def parse_listen_address(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6) -> (host, port); "" -> None (metrics off).
    Raises ``ValueError`` saying what is wrong. Port 0 lets the OS choose (tests)."""
    text = text.strip()
    if not text:
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9464)")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{text!r}: an IPv6 address goes in brackets, e.g. [::1]:9464")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: an IPv6 address goes in brackets, e.g. [::1]:9464")
    # (ASCII digits only: "٩٤٦٤" and "2²" are digits to str.isdigit, and int() reads the first)
    if not (port_text.isascii() and port_text.isdigit()) or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 0 to 65535")
    if any(c.isspace() or c in "/?#@" or not c.isprintable() for c in host):
        raise ValueError(f"{text!r}: {host!r} is not a host name or address")
    return host, int(port_text)


DEFAULTS: Mapping[str, Any] = {spec.name: spec.default for spec in OPTIONS}

PREFIX = "turnguard_"
_SPECS = {spec.name: spec for spec in OPTIONS}


def parse_set_value(spec: OptionSpec, values: list[str]) -> Any:
    """The value of ``--set NAME=VALUE`` for one of our options, parsed as mitmproxy parses it
    (``int()`` for ints; ``true``, ``false`` or nothing for bools; the string for strs).
    Raises ``ValueError`` naming the option and the value (a PostgreSQL password in it as
    ``***``: ``ledger_location.shown_value``)."""
    shown = ", ".join(shown_value(values)) if values else "(no value)"
    if spec.type not in (int, bool, str):  # a list option: one --set per value
        return list(values)
    if len(values) > 1:
        raise ValueError(f"{spec.name} was set {len(values)} times ({shown}); set it once")
    text = values[0] if values else None
    if spec.type is int:
        try:
            return int(text or "")
        except ValueError:
            raise ValueError(f"{spec.name}={shown} is not an integer") from None
    if spec.type is bool:
        if text in (None, "", "true"):
            return True
        if text == "false":
            return False
        raise ValueError(f"{spec.name}={shown} is not true or false") from None
    if text is None:
        raise ValueError(f"{spec.name} needs a value")
    return text


def check_value_type(spec: OptionSpec, value: Any) -> None:
    """Raise ``ValueError`` when ``value`` (e.g. from mitmproxy's config.yaml) is not of the
    option's type (the message shows it as ``ledger_location.shown_value`` does)."""
    shown = shown_value(value)
    if spec.type not in (int, bool, str):  # a list option
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        if not ok:
            raise ValueError(f"{spec.name}={shown!r} is not a list of strings")
        return
    ok = isinstance(value, spec.type) and not (spec.type is int and isinstance(value, bool))
    if not ok:
        raise ValueError(
            f"{spec.name}={shown!r} is not {'an integer' if spec.type is int else spec.type.__name__}"
        )


def deferred_problems(deferred: Mapping[str, Any]) -> dict[str, str]:
    """Problems with ``turnguard_*`` values that mitmproxy holds back until the script
    registers its options: unknown names (a typo) and values of the wrong type. mitmproxy
    would ignore the first for ever and, for the second, fail to load the script without a
    word. ``deferred`` maps a name to its raw ``--set`` strings (a list) or, from a config
    file, a value. Returns name -> one-line message naming the option and the value (never
    a PostgreSQL password: a misspelt ``turnguard_ledger`` is still one)."""
    found: dict[str, str] = {}
    for name, raw in deferred.items():
        if not name.startswith(PREFIX):
            continue
        spec = _SPECS.get(name)
        if spec is None:
            shown = (", ".join(map(str, shown_value(raw))) if isinstance(raw, list)
                     else repr(shown_value(raw)))
            close = difflib.get_close_matches(
                name.removeprefix(PREFIX), [n.removeprefix(PREFIX) for n in _SPECS], n=1
            )
            hint = f" (did you mean {PREFIX}{close[0]}?)" if close else ""
            found[name] = f"unknown option {name}={shown}{hint}"
            continue
        try:
            if isinstance(raw, list):
                parse_set_value(spec, [str(v) for v in raw])
            else:
                check_value_type(spec, raw)
        except ValueError as e:
            found[name] = str(e)
    return found
