"""Where the ledger lives, as ``turnguard_ledger`` names it (pure: no connection, no disk).

``turnguard_ledger`` is either a PostgreSQL URL (``postgresql://...`` or ``postgres://...``,
with the credentials in it, in the standard ``PG*`` environment variables or in a libpq service
file, ``?service=NAME``) or anything else: the path of an SQLite file. A URL may carry a
password, which must never reach a log line, a telemetry record, ``turnguard.status`` or the
events file: everything that shows the location shows ``display(location)``.
"""

from __future__ import annotations

import re
import urllib.parse

POSTGRES_SCHEMES = ("postgresql://", "postgres://")

_PASSWORD_PARAM = re.compile(r"(?i)([?&]password=)[^&#]*")


def is_postgres(location: str) -> bool:
    """Whether ``location`` names a PostgreSQL database (else it is an SQLite path)."""
    return location.strip().lower().startswith(POSTGRES_SCHEMES)


def display(location: str) -> str:
    """``location`` as it may be shown: a URL's password (in the authority or as a
    ``password=`` parameter) replaced by ``***``; an SQLite path as it is."""
    if not is_postgres(location):
        return location
    text = _PASSWORD_PARAM.sub(r"\1***", location.strip())
    scheme, _, rest = text.partition("://")
    authority, sep, tail = _split_authority(rest)
    userinfo, at, hostport = authority.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        authority = f"{user}:***@{hostport}"
    return f"{scheme}://{authority}{sep}{tail}"


def password_of(location: str) -> str | None:
    """The password a PostgreSQL URL carries (in its authority or as ``password=``), if any."""
    if not is_postgres(location):
        return None
    query = urllib.parse.urlsplit(location.strip()).query if "?" in location else ""
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if key.lower() == "password" and value:
            return value
    rest = location.strip().partition("://")[2]
    userinfo, at, _ = _split_authority(rest)[0].rpartition("@")
    if at and ":" in userinfo:
        return userinfo.split(":", 1)[1] or None
    return None


def scrub(text: str, location: str) -> str:
    """``text`` (an error message) without the password of ``location``, raw or URL-decoded."""
    password = password_of(location)
    if not password:
        return text
    for secret in {password, urllib.parse.unquote(password)}:
        if secret:
            text = text.replace(secret, "***")
    return text


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
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as e:
        raise ValueError(f"not a valid PostgreSQL URL: {e}") from None
    if parsed.fragment:
        raise ValueError("not a valid PostgreSQL URL: it has a #fragment")
    return url
