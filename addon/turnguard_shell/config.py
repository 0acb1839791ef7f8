"""Options that need more than a value check: the filter expression, the events file and the
ledger path. Each raises ``ValueError`` with the one line a user sees when it is refused."""

from __future__ import annotations

import logging
import os
import re
from typing import Callable

from mitmproxy import flowfilter, http
from mitmproxy import log as mitmproxy_log

from turnguard_core.ledger import LedgerError, check_path
from turnguard_core.ledger_location import (
    CONNINFO_REFUSED,
    check_postgres_url,
    display,
    is_conninfo,
    is_postgres,
    scrub_options,
)
from turnguard_core.options import DEFAULT_FILTER, DEFAULT_FILTER_ROUTES
from turnguard_core.private_files import UnsafePath
from turnguard_core.telemetry import Telemetry


# how deep ``turnguard_filter``'s expression may nest (``!``, ``&``, ``|``, parentheses): each
# level is a Python call or two as the filter decides a flow, in the request hook's own
MAX_FILTER_DEPTH = 100


def parse_filter(expression: str) -> flowfilter.TFilter:
    """``turnguard_filter`` parsed; ``ValueError`` naming the option for one that does not
    parse, or that nests deeper than ``MAX_FILTER_DEPTH`` (it would fail on every request,
    past Python's recursion limit)."""
    # (shown without the password of a ledger URL in it, scrubbed before it is quoted: the
    # quoting escapes a quote or a backslash in it, and the scrub would no longer find it;
    # the parser's message, which quotes part of it as it likes, only when nothing was)
    shown = scrub_options(expression, [expression])
    try:
        parsed = flowfilter.parse(expression)
    except (ValueError, RecursionError) as e:
        why = e if shown == expression else "it does not parse"
        raise ValueError(f"turnguard_filter={shown!r} is not valid: {why}") from None
    if _depth(parsed) > MAX_FILTER_DEPTH:
        raise ValueError(f"turnguard_filter nests deeper than {MAX_FILTER_DEPTH} levels")
    return DefaultFilter(parsed) if expression == DEFAULT_FILTER else parsed


def _depth(parsed: object) -> int:
    """How deep a parsed filter nests (its ``itm`` and ``lst`` parts), walked without
    recursion."""
    deepest, stack = 0, [(parsed, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_FILTER_DEPTH:
            break
        inner = getattr(node, "lst", None) or [getattr(node, "itm", None)]
        stack.extend((child, depth + 1) for child in inner if child is not None)
    return deepest


class DefaultFilter:
    """The default ``turnguard_filter``, deciding every flow as mitmproxy's parsed filter
    does, without building the request's URL first (``~u`` matches ``pretty_url``: half of
    the filter's cost, on every request through the proxy).

    The URL is ``scheme://authority`` + path. When the path starts with "/" and the
    authority (from the Host header, or the host connected to) is plain (no "/", "?" or
    "#", and not empty), ``~u``'s ``://[^/?#]+`` takes the whole authority, so the route
    must start the path: the path alone decides. Anything else goes to the parsed filter."""

    def __init__(self, parsed: flowfilter.TFilter):
        self.parsed = parsed
        flags = flowfilter.maybe_ignore_case  # mitmproxy's: case-blind unless told otherwise
        self._post = re.compile(b"POST", flags)
        self._route = re.compile(DEFAULT_FILTER_ROUTES, flags)

    def __call__(self, flow) -> bool:
        if not isinstance(flow, http.HTTPFlow):
            return self.parsed(flow)
        req = flow.request
        if req.first_line_format == "authority" or req.scheme not in ("http", "https") \
                or not req.path.startswith("/") \
                or _PLAIN_AUTHORITY.fullmatch(req.host_header or req.host) is None:
            return self.parsed(flow)
        if flow.websocket is None and self._post.search(req.data.method) is None:
            return False
        return self._route.match(req.path) is not None


# an authority whose host part is not empty and that holds no "/", "?" or "#"
_PLAIN_AUTHORITY = re.compile(r"(?:[A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]*)?")


# A log handler that does not make a telemetry line worth formatting: mitmproxy's bridge to
# its deprecated ``add_log`` hook takes every level (so a DEBUG line, which no one reads
# unless termlog_verbosity is debug, would still cost a hook call on every addon).
IGNORED_LOG_HANDLERS = tuple(
    t for t in (getattr(mitmproxy_log, "LegacyLogEvents", None),) if isinstance(t, type))


class _NotTurnguardRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != "turnguard"


def keep_out_of_legacy_log_events() -> Callable[[], None]:
    """Keep turnguard's log records from mitmproxy's bridge to its deprecated ``add_log``
    hook; returns what undoes it. Each record that bridge takes wakes the event loop and
    calls ``add_log`` on every addon (about 0.1 ms: a third of what a replayed duplicate
    costs turnguard), for a hook addons no longer need (they read the log with ``logging``
    handlers since mitmproxy 9). The terminal, mitmweb's event log and every other handler
    still get every record."""
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, IGNORED_LOG_HANDLERS)]
    not_ours = _NotTurnguardRecords()
    for handler in handlers:
        handler.addFilter(not_ours)
    return lambda: [handler.removeFilter(not_ours) for handler in handlers]  # type: ignore[func-returns-value]


def telemetry(path: str | None = None) -> Telemetry:
    """Telemetry to the events file at ``path`` (None: the log only)."""
    return Telemetry(path, ignored_handlers=IGNORED_LOG_HANDLERS)


def events_path(option: str) -> str | None:
    """The events file ``turnguard_events`` names, as ``Telemetry.path`` holds it (None: the
    log only)."""
    return os.path.expanduser(option) or None


def open_events(path: str) -> Telemetry:
    """The telemetry sink: the events file at ``path`` (empty: the log only)."""
    if "\0" in path:  # (the system calls refuse it with a message that names no option)
        raise ValueError(f"turnguard_events={path!r} is refused: a path holds no NUL character")
    try:
        return telemetry(events_path(path))
    except UnsafePath as e:
        raise ValueError(f"turnguard_events={path!r} is refused: {e}") from None
    except OSError as e:
        raise ValueError(f"turnguard_events={path!r} cannot be opened: {e.strerror}") from None


def ledger_path(option: str, confdir: str) -> str:
    """The ledger's location: a PostgreSQL URL (``postgresql://...``, ``postgres://...``) as
    given, if it parses; else an SQLite path (``<confdir>/turnguard.sqlite3`` when the option is
    empty), checked: a path others could write to or redirect is refused. A libpq key/value
    connection string (``host=... password=...``) is refused: it is no URL, and opened as a
    path it would make an SQLite file named after the password. A refusal never shows a
    password."""
    if is_conninfo(option):
        raise ValueError(f"turnguard_ledger={display(option)} is refused: {CONNINFO_REFUSED}")
    if is_postgres(option):
        try:
            return check_postgres_url(option)
        except ValueError as e:
            raise ValueError(f"turnguard_ledger={display(option)} is refused: {e}") from None
    if "\0" in option:  # (the system calls refuse it with a message that names no option)
        raise ValueError(f"turnguard_ledger={display(option)} is refused: a path holds no NUL"
                         " character")
    try:
        if option:
            path = os.path.abspath(os.path.expanduser(option))
        else:
            folder = os.path.expanduser(confdir)
            os.makedirs(folder, mode=0o700, exist_ok=True)
            path = os.path.join(folder, "turnguard.sqlite3")
    except OSError as e:
        raise ValueError(f"turnguard_ledger: cannot use the folder: {e}") from None
    try:
        check_path(path)
    except LedgerError as e:
        raise ValueError(f"turnguard_ledger={display(path)} is refused: {e}") from None
    return path
