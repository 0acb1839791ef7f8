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


def _conninfo_pairs(text: str) -> list[tuple[str, int, int]] | None:
    """``(keyword, start, end)`` of each value of ``text`` read as libpq reads a key/value
    connection string (``keyword = value``, a value in single quotes or up to the next space,
    ``\\`` escaping the next character); None when ``text`` is not one."""
    pairs: list[tuple[str, int, int]] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return pairs or None
        start = i
        while i < n and (text[i].isalnum() or text[i] == "_"):
            i += 1
        keyword = text[start:i]
        while i < n and text[i].isspace():
            i += 1
        if not keyword or i == n or text[i] != "=":
            return None
        i += 1
        while i < n and text[i].isspace():
            i += 1
        value_start = i
        quoted = i < n and text[i] == "'"
        if quoted:
            i += 1
        while i < n:
            if text[i] == "\\":
                i += 2
                continue
            if (text[i] == "'") if quoted else text[i].isspace():
                break
            i += 1
        if quoted:
            if i >= n:
                return None  # an unterminated quote: libpq refuses it too
            i += 1
        pairs.append((keyword.lower(), value_start, min(i, n)))


def is_conninfo(location: str) -> bool:
    """Whether ``location`` is a libpq key/value connection string (``host=... dbname=...``):
    ``keyword=value`` pairs, one of them a libpq keyword. A path never is one unless a name
    in it is such a pair (``./host=db`` is a path)."""
    pairs = _conninfo_pairs(location)
    return pairs is not None and any(k in _CONNINFO_KEYWORDS for k, _, _ in pairs)


CONNINFO_REFUSED = (
    "a libpq key/value connection string is not taken; give the database as a URL, "
    "postgresql://USER@HOST:PORT/DB (the password from PGPASSWORD, ~/.pgpass or a service "
    "file; a path that looks like one: ./NAME)")


def _conninfo_secrets(location: str) -> list[tuple[int, int]]:
    """The spans of the secret values of a key/value connection string."""
    pairs = _conninfo_pairs(location) or []
    return [(start, end) for k, start, end in pairs if k in _SECRET_PARAMS and end > start]


def shown_value(value: object) -> object:
    """An option's value as a message may show it: a string that names a PostgreSQL ledger
    (a URL or a key/value connection string) as ``display`` shows it, a list of strings
    likewise; anything else as it is."""
    if isinstance(value, str) and (is_postgres(value) or is_conninfo(value)):
        return display(value)
    if isinstance(value, (list, tuple)):
        return type(value)(shown_value(v) for v in value)
    return value


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
    key, eq, _ = param.partition("=")
    if eq and urllib.parse.unquote_plus(key).strip().lower() in _SECRET_PARAMS:
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
    query = urllib.parse.urlsplit(f"{scheme}://{after}").query
    for param in query.split("&"):  # as libpq reads it: a "+" is a "+", never a space
        key, _, value = param.partition("=")
        if urllib.parse.unquote(key).strip().lower() in _SECRET_PARAMS and value:
            found.append(value)
    if userinfo is not None and ":" in userinfo and userinfo.split(":", 1)[1]:
        found.append(userinfo.split(":", 1)[1])
    return found


def scrub(text: str, location: str) -> str:
    """``text`` (an error message) without the secrets of ``location``, raw or URL-decoded."""
    for password in _secrets_of(location):
        for secret in {password, urllib.parse.unquote(password)}:
            if secret:
                text = text.replace(secret, "***")
    return text


def scrub_options(text: str, values) -> str:
    """``text`` (a refused option's message) without the secrets of any of ``values`` (the
    options' values) that names a PostgreSQL database, a URL or a key/value string: a
    ledger URL put in another option by mistake (``turnguard_events``, ``turnguard_metrics``)
    is quoted in that option's refusal, its password included."""
    for value in values:
        if isinstance(value, str) and (is_postgres(value) or is_conninfo(value)):
            text = scrub(text, value)
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


def _split_authority(rest: str) -> tuple[str, str, str]:
    """(authority, separator, the rest) of a URL after its ``scheme://``."""
    for i, ch in enumerate(rest):
        if ch in "/?#":
            return rest[:i], ch, rest[i + 1:]
    return rest, "", ""


def check_postgres_url(location: str) -> str:
    """The URL, stripped, if libpq can parse it; raises ``ValueError`` (the message shows no
    password) otherwise."""
    url = location.strip()
    scheme, _, rest = url.partition("://")
    try:  # the hosts and the rest, checked without the credentials (never quoted)
        parsed = urllib.parse.urlsplit(f"{scheme}://{_credentials(rest)[1]}")
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as e:
        raise ValueError(f"not a valid PostgreSQL URL: {e}") from None
    if parsed.fragment:
        raise ValueError("not a valid PostgreSQL URL: it has a #fragment")
    return url
