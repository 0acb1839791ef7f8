"""Where the ledger lives, as ``turnguard_ledger`` names it (pure: no connection, no disk).

``turnguard_ledger`` is either a PostgreSQL URL (``postgresql://...`` or ``postgres://...``,
with the credentials in it, in the standard ``PG*`` environment variables or in a libpq service
file, ``?service=NAME``) or anything else: the path of an SQLite file. A URL may carry a
password, which must never reach a log line, a telemetry record, ``turnguard.status`` or the
events file: everything that shows the location shows ``display(location)``.

A libpq key/value connection string (``host=db user=u password=...``) is no URL, and no path
either: ``is_conninfo`` tells it, so that it is refused (never opened as an SQLite file named
after the password) and shown with its password as ``***``.
"""

from __future__ import annotations

import re
import urllib.parse

from . import private_files

POSTGRES_SCHEMES = ("postgresql://", "postgres://")

# libpq's parameters that carry a secret (names percent-decoded, as libpq reads them)
_SECRET_PARAMS = frozenset({"password", "sslpassword"})


def is_postgres(location: str) -> bool:
    """Whether ``location`` names a PostgreSQL database (else it is an SQLite path)."""
    return location.strip().lower().startswith(POSTGRES_SCHEMES)


# libpq's connection keywords (PostgreSQL 17's, and a few older ones): a string made of
# ``keyword=value`` pairs naming one of these is a connection string, not a file name
_CONNINFO_KEYWORDS = frozenset({
    "host", "hostaddr", "port", "dbname", "user", "password", "passfile", "require_auth",
    "channel_binding", "connect_timeout", "client_encoding", "options", "application_name",
    "fallback_application_name", "keepalives", "keepalives_idle", "keepalives_interval",
    "keepalives_count", "tcp_user_timeout", "replication", "gssencmode", "sslmode",
    "sslnegotiation", "requiressl", "sslcompression", "sslcert", "sslkey", "sslkeylogfile",
    "sslpassword", "sslcertmode", "sslrootcert", "sslcrl", "sslcrldir", "sslsni",
    "requirepeer", "ssl_min_protocol_version", "ssl_max_protocol_version", "krbsrvname",
    "gsslib", "gssdelegation", "service", "target_session_attrs", "load_balance_hosts",
})


# what libpq's parser takes for a space (C's isspace): not Python's wider str.isspace (a
# no-break space in a password is the password's)
_SPACES = frozenset(" \t\n\r\f\v")


def _conninfo_pairs(text: str) -> list[tuple[str, int, int]] | None:
    """``(keyword, start, end)`` of each value of ``text`` read as libpq reads a key/value
    connection string (``keyword = value``, a value in single quotes or up to the next space,
    ``\\`` escaping the next character); None when ``text`` is not one."""
    pairs: list[tuple[str, int, int]] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in _SPACES:
            i += 1
        if i == n:
            return pairs or None
        start = i
        while i < n and (text[i].isalnum() or text[i] == "_"):
            i += 1
        keyword = text[start:i]
        while i < n and text[i] in _SPACES:
            i += 1
        if not keyword or i == n or text[i] != "=":
            return None
        i += 1
        while i < n and text[i] in _SPACES:
            i += 1
        value_start = i
        quoted = i < n and text[i] == "'"
        if quoted:
            i += 1
        while i < n:
            if text[i] == "\\":
                i += 2
                continue
            if (text[i] == "'") if quoted else text[i] in _SPACES:
                break
            i += 1
        if quoted:
            if i >= n:
                return None  # an unterminated quote: libpq refuses it too
            i += 1
        pairs.append((keyword.lower(), value_start, min(i, n)))


# a libpq keyword and its "=" at the start or after a space: what marks a key/value string
# that libpq would not parse (a password in double quotes, a word without "=") as one all
# the same, so that it is refused rather than taken for a file named after its password
_CONNINFO_KEY = re.compile(
    r"(?:^|[ \t\n\r\f\v])("
    + "|".join(sorted(_CONNINFO_KEYWORDS, key=len, reverse=True))
    + r")[ \t\n\r\f\v]*=[ \t\n\r\f\v]*",
    re.IGNORECASE)


def is_conninfo(location: str) -> bool:
    """Whether ``location`` is a libpq key/value connection string (``host=... dbname=...``):
    ``keyword=value`` pairs, one of them a libpq keyword; or, where it does not parse as
    pairs, a libpq keyword and its ``=`` at its start or after a space. A path never is one
    unless a name in it is such a pair (``./host=db`` is a path)."""
    pairs = _conninfo_pairs(location)
    if pairs is None:
        return _CONNINFO_KEY.search(location) is not None
    return any(k in _CONNINFO_KEYWORDS for k, _, _ in pairs)


CONNINFO_REFUSED = (
    "a libpq key/value connection string is not taken; give the database as a URL, "
    "postgresql://USER@HOST:PORT/DB (the password from PGPASSWORD, ~/.pgpass or a service "
    "file; a path that looks like one: ./NAME)")


def _conninfo_secrets(location: str) -> list[tuple[int, int]]:
    """The spans of the secret values of a key/value connection string; of one that does not
    parse, all from the first secret's value to the end (where its value ends is unknown)."""
    pairs = _conninfo_pairs(location)
    if pairs is not None:
        return [(start, end) for k, start, end in pairs if k in _SECRET_PARAMS and end > start]
    for key in _CONNINFO_KEY.finditer(location):
        if key.group(1).lower() in _SECRET_PARAMS and key.end() < len(location):
            return [(key.end(), len(location))]
    return []


def shown_value(value: object) -> object:
    """An option's value as a message may show it: a string that names a PostgreSQL ledger
    (a URL or a key/value connection string) as ``display`` shows it, a list of strings
    likewise; a number, a bool or None as it is; anything else (a mapping from a config file,
    whose values may hold a password under any key) by its kind only, as ``<mapping>``."""
    if isinstance(value, str) and (is_postgres(value) or is_conninfo(value)):
        return display(value)
    if isinstance(value, (list, tuple)):
        return type(value)(shown_value(v) for v in value)
    if value is None or isinstance(value, (str, int, float)):
        return value
    return f"<{'mapping' if isinstance(value, dict) else type(value).__name__}>"


def display(location: str) -> str:
    """``location`` as it may be shown: a URL's password (in the authority, or as a
    ``password`` or ``sslpassword`` parameter however its name is percent-encoded) replaced
    by ``***``; a key/value connection string with its ``password`` and ``sslpassword`` values
    as ``***``; an SQLite path as it is (quoted, its control characters escaped, if it has
    any: ``private_files.shown``)."""
    if not is_postgres(location):
        if is_conninfo(location):
            for start, end in reversed(_conninfo_secrets(location)):
                location = f"{location[:start]}***{location[end:]}"
        return private_files.shown(location)
    scheme, _, rest = location.strip().partition("://")
    try:
        check_postgres_url(location)
    except ValueError:  # libpq's reading of it may not be what was meant: keep more back
        userinfo, after = _any_credentials(rest)
    else:
        userinfo, after = _credentials(rest)
    shown = "" if userinfo is None else (
        f"{userinfo.split(':', 1)[0]}:***@" if ":" in userinfo else f"{userinfo}@")
    hostport, sep, tail = _split_authority(after)
    authority = f"{shown}{hostport}"
    if sep == "?" or "?" in tail:
        path, qmark, query = ("", "", tail) if sep == "?" else tail.partition("?")
        query, hash_, fragment = query.partition("#")
        params = [_masked(param) for param in query.split("&")]
        tail = f"{path}{qmark}{'&'.join(params)}{hash_}{fragment}"
    return f"{scheme}://{authority}{sep}{tail}"


def _masked(param: str) -> str:
    """A query parameter as shown: a secret's value as ``***``, and a word without ``=``
    (libpq refuses it; a raw ``&`` in a password leaves one) as ``***``."""
    key, eq, _ = param.partition("=")
    if not eq:
        return "***" if param else param
    if urllib.parse.unquote_plus(key).strip().lower() in _SECRET_PARAMS:
        return f"{key}=***"
    return param


def _secrets_of(location: str) -> list[str]:
    """Every secret a PostgreSQL URL carries (its password, in its authority or as a
    parameter, and an ``sslpassword``)."""
    if not is_postgres(location):
        return [location[start:end] for start, end in _conninfo_secrets(location)]
    found = []
    scheme, _, rest = location.strip().partition("://")
    userinfo, after = _credentials(rest)
    # (as urlsplit would read it, which raises for some hosts: "[::1" is no IPv6 address)
    query = after.partition("#")[0].partition("?")[2]
    for param in query.split("&"):  # as libpq reads it: a "+" is a "+", never a space
        key, eq, value = param.partition("=")
        if urllib.parse.unquote(key).strip().lower() in _SECRET_PARAMS and value:
            found.append(value)
        elif param and not eq:  # a word without "=": maybe the rest of a password
            found.append(param)
    for credentials in (userinfo, _any_credentials(rest)[0]):
        if credentials is not None and ":" in credentials and credentials.split(":", 1)[1]:
            found.append(credentials.split(":", 1)[1])
    return found


def scrub(text: str, location: str) -> str:
    """``text`` (an error message) without the secrets of ``location``, raw or URL-decoded:
    every character any of them covers (they may overlap: libpq's reading of a password and
    a longer one) is in a ``***``."""
    secrets = {s for found in _secrets_of(location)
               for s in (found, urllib.parse.unquote(found)) if s}
    spans = sorted((m.start(), m.start() + len(secret)) for secret in secrets
                   for m in re.finditer(f"(?={re.escape(secret)})", text))
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    parts, shown_to = [], 0
    for start, end in merged:
        parts += [text[shown_to:start], "***"]
        shown_to = end
    return "".join(parts) + text[shown_to:]


# a PostgreSQL URL inside a longer text (a filter's expression, say), up to a blank or a
# double quote (a password may hold a single one)
_EMBEDDED_URL = re.compile(r'postgres(?:ql)?://[^\s"]+', re.IGNORECASE)


def scrub_options(text: str, values) -> str:
    """``text`` (a refused option's message) without the secrets of any of ``values`` (the
    options' values, a list's items too) that names a PostgreSQL database, a URL or a
    key/value string, or holds such a URL (a filter ``~u "postgresql://..."``): a ledger URL
    put in another option by mistake (``turnguard_events``, ``turnguard_metrics``,
    ``turnguard_filter``) is quoted in that option's refusal, its password included."""
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if not isinstance(item, str):
                continue
            if is_postgres(item) or is_conninfo(item):
                text = scrub(text, item)
            for url in _EMBEDDED_URL.findall(item):
                text = scrub(text, url)
    return text


def _credentials(rest: str) -> tuple[str | None, str]:
    """(user[:password] or None, what follows it) of a URL after its ``scheme://``, read as
    libpq reads it: the credentials end at the first ``@`` met before any ``/``, so a raw
    ``?`` or ``#`` in a password is the password's, not a query's or a fragment's."""
    for i, ch in enumerate(rest):
        if ch == "@":
            return rest[:i], rest[i + 1:]
        if ch == "/":
            break
    return None, rest


def _any_credentials(rest: str) -> tuple[str | None, str]:
    """(user[:password] or None, what follows it) of a URL after its ``scheme://``, read as
    a password with a raw ``@``, ``/``, ``?`` or ``#`` in it would make it: the credentials
    end at the last ``@``. More than libpq reads as the credentials, for a URL it does not
    read as meant."""
    credentials, at, after = rest.rpartition("@")
    return (credentials, after) if at else (None, rest)


def _split_authority(rest: str) -> tuple[str, str, str]:
    """(authority, separator, the rest) of a URL after its ``scheme://``."""
    for i, ch in enumerate(rest):
        if ch in "/?#":
            return rest[:i], ch, rest[i + 1:]
    return rest, "", ""


def check_postgres_url(location: str) -> str:
    """The URL, stripped, if libpq can parse it as it was meant; raises ``ValueError`` (the
    message shows no password) otherwise, also for an ``@`` after the credentials or a query
    word without ``=`` (a password's raw ``@``, ``/`` or ``&``)."""
    url = location.strip()
    scheme, _, rest = url.partition("://")
    after = _credentials(rest)[1]
    if "@" in after.partition("?")[0].partition("#")[0]:
        # a host never has one: a password's raw "@" or "/" (libpq would read part of the
        # password as the host, the port or the database, and its errors would quote it)
        raise ValueError("not a valid PostgreSQL URL: an '@' after its credentials (in a user"
                         " name or password, write '@' as %40, '/' as %2F)")
    try:  # the hosts and the rest, checked without the credentials (never quoted)
        parsed = urllib.parse.urlsplit(f"{scheme}://{after}")
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as e:  # (its port's text is not quoted: it may be a password's start)
        raise ValueError(f"not a valid PostgreSQL URL: {str(e).partition(' as ')[0]}") from None
    if parsed.fragment:
        raise ValueError("not a valid PostgreSQL URL: it has a #fragment")
    if any(param and "=" not in param for param in parsed.query.split("&")):
        raise ValueError("not a valid PostgreSQL URL: a query parameter without '=' (in a"
                         " value, write '&' as %26)")
    return url
