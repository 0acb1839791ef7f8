"""Where the ledger lives, as ``turnguard_ledger`` names it (pure: no connection, no disk).

``turnguard_ledger`` is either a PostgreSQL URL (``postgresql://...`` or ``postgres://...``,
with the credentials in it, in the standard ``PG*`` environment variables or in a libpq service
file, ``?service=NAME``) or anything else: the path of an SQLite file. A URL may carry a
password, which must never reach a log line, a telemetry record, ``turnguard.status`` or the
events file: everything that shows the location shows ``display(location)``.
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


def display(location: str) -> str:
    """``location`` as it may be shown: a URL's password (in the authority, or as a
    ``password`` or ``sslpassword`` parameter however its name is percent-encoded) replaced
    by ``***``; an SQLite path as it is (quoted, its control characters escaped, if it has
    any: ``private_files.shown``)."""
    if not is_postgres(location):
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
        return []
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
