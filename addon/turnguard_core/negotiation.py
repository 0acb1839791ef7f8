"""Content negotiation for a replay: which form of a recorded response a duplicate may get.

Pure: recorded headers and the duplicate's request headers in, a decision out. The codec that
decodes and encodes content codings is passed in (``codec.BoundedCodec`` in the addon).

Rules (RFC 9110, 12.5.3 Accept-Encoding and 12.5.5 Vary):

- ``Accept-Encoding`` absent: any content coding is acceptable. Present (even empty): a coding
  is acceptable when listed with q > 0, or when not listed and ``*`` is listed with q > 0;
  ``identity`` (no coding) is acceptable unless ``identity;q=0``, or ``*;q=0`` without an
  ``identity`` entry. Names are case-insensitive; ``x-gzip`` is ``gzip``. A q-value that does
  not parse counts as 0 (never send what the client may not take).
- A recording whose content coding the duplicate accepts is sent as recorded, byte for byte
  (``AsRecorded``).
- Otherwise it is decoded (``Recode``) and sent without a coding if the client accepts that,
  else re-encoded in the acceptable coding of ``PRODUCIBLE`` with the highest q (ties in that
  order). The headers that describe the encoded bytes (ETag, digests) are dropped,
  ``Content-Encoding`` is set or removed, and ``Vary`` gets ``Accept-Encoding``.
- Nothing acceptable can be produced, or the recorded coding is not one turnguard can decode:
  ``Decline`` (the duplicate is forwarded, not replayed).
- ``Vary``: a response with ``Vary: *`` is never recorded for replay (``vary_names`` is None).
  Otherwise the recording carries ``vary_key`` of the original request: a hash of its values
  of the headers ``Vary`` names, Accept-Encoding excepted (negotiated above). A duplicate
  whose ``vary_key`` differs is declined.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Protocol

from .records import record

__all__ = [
    "PRODUCIBLE",
    "AsRecorded",
    "Codec",
    "Decline",
    "Recode",
    "Serve",
    "accepted_codings",
    "plan",
    "recode",
    "vary_key",
    "vary_names",
]

Headers = Iterable[tuple[str, str]]

# Codings turnguard can produce, in order of preference when the client weighs them equally.
PRODUCIBLE = ("gzip", "br", "zstd", "deflate")
_DECODABLE = frozenset(PRODUCIBLE)
_ALIASES = {"x-gzip": "gzip"}
# Headers that describe the encoded bytes, not the content: wrong after a re-encoding.
_ENCODING_BOUND = frozenset({"etag", "content-md5", "digest", "content-digest", "repr-digest"})


class Codec(Protocol):
    def decode(self, data: bytes, coding: str) -> bytes:
        """Undo one content coding; raise ValueError when the data is not valid or too big."""

    def encode(self, data: bytes, coding: str) -> bytes:
        """Apply one content coding."""


@record
class AsRecorded:
    """Send the recording as it is."""


@record
class Recode:
    """Undo ``recorded`` (codings in the order they were applied), then apply ``target``
    (``"identity"``: none)."""

    recorded: tuple[str, ...]
    target: str


@record
class Decline:
    """Do not replay; forward the duplicate. ``reason`` is for telemetry."""

    reason: str


@record
class Serve:
    """The headers and body to send (``recode``'s result: ``recoded``; or the recording as it
    is)."""

    headers: tuple[tuple[str, str], ...]
    body: bytes
    recoded: bool = True


def _values(headers: Headers, name: str) -> list[str]:
    return [v for k, v in headers if k.lower() == name]


def _list_items(values: Iterable[str]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def vary_names(response_headers: Headers) -> frozenset[str] | None:
    """The request headers a response varies on, lower-cased, Accept-Encoding excepted; None
    for ``Vary: *`` (it varies on anything: never replayed)."""
    names = {item.lower() for item in _list_items(_values(response_headers, "vary"))}
    if "*" in names:
        return None
    return frozenset(names - {"accept-encoding"})


def vary_key(names: frozenset[str], request_headers: Headers) -> str:
    """Hash of a request's values of the headers ``names`` (every value, in order); "" when
    ``names`` is empty."""
    if not names:
        return ""
    pairs = list(request_headers)
    h = hashlib.sha256(b"turnguard-vary\0")
    for name in sorted(names):
        values = [v for k, v in pairs if k.lower() == name]
        for part in (name, str(len(values)), *values):
            b = part.encode("utf-8", "surrogatepass")
            h.update(b"%d:" % len(b) + b + b"\0")
    return h.hexdigest()


def accepted_codings(request_headers: Headers) -> dict[str, float] | None:
    """Accept-Encoding as {coding: q}; None when the header is absent (anything goes)."""
    values = _values(request_headers, "accept-encoding")
    if not values:
        return None
    out: dict[str, float] = {}
    for item in _list_items(values):
        coding, *params = (p.strip() for p in item.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
                if not 0.0 <= q <= 1.0:  # also NaN
                    q = 0.0
        coding = _ALIASES.get(coding.lower(), coding.lower())
        out[coding] = q
    return out


def _q(coding: str, accepted: dict[str, float] | None) -> float:
    """The client's weight for ``coding`` (0: not acceptable)."""
    if accepted is None:
        return 1.0
    if coding in accepted:
        return accepted[coding]
    if coding == "identity":
        return 0.0 if accepted.get("*", 1.0) == 0.0 else 1.0
    return accepted.get("*", 0.0)


def _recorded_codings(recorded_headers: Headers) -> tuple[str, ...]:
    codings = (c.lower() for c in _list_items(_values(recorded_headers, "content-encoding")))
    return tuple(_ALIASES.get(c, c) for c in codings if c != "identity")


def plan(
    recorded_headers: Headers,
    recorded_vary_key: str | None,
    request_headers: Headers,
) -> AsRecorded | Recode | Decline:
    """What a duplicate with ``request_headers`` may get of a recording (see the module
    docstring). ``recorded_vary_key`` None: not known (then only a response without Vary
    names is replayed)."""
    recorded_headers = tuple(recorded_headers)
    request_headers = tuple(request_headers)
    names = vary_names(recorded_headers)
    if names is None:
        return Decline("the response varies on anything (Vary: *)")
    if names and vary_key(names, request_headers) != recorded_vary_key:
        return Decline(f"the request differs in a header the response varies on "
                       f"({', '.join(sorted(names))})")
    accepted = accepted_codings(request_headers)
    recorded = _recorded_codings(recorded_headers)
    if all(_q(c, accepted) > 0 for c in recorded) and (recorded or _q("identity", accepted) > 0):
        return AsRecorded()
    undecodable = [c for c in recorded if c not in _DECODABLE]
    if undecodable:
        return Decline(f"the client does not accept the recorded content-encoding "
                       f"{', '.join(recorded)}, and turnguard cannot decode {undecodable[0]}")
    if _q("identity", accepted) > 0:
        return Recode(recorded, "identity")
    weighted = [(c, _q(c, accepted)) for c in PRODUCIBLE if _q(c, accepted) > 0]
    if not weighted:
        return Decline("the client accepts no content coding turnguard can produce "
                       f"(identity, {', '.join(PRODUCIBLE)})")
    best = max(q for _, q in weighted)
    return Recode(recorded, next(c for c, q in weighted if q == best))


def recode(
    recorded_headers: Headers, body: bytes, how: Recode, codec: Codec
) -> Serve | Decline:
    """The recording in the coding ``how`` asks for, with headers to match; ``Decline`` when
    the codec fails (corrupt data, or past its size bound)."""
    try:
        for coding in reversed(how.recorded):
            body = codec.decode(body, coding)
        if how.target != "identity":
            body = codec.encode(body, how.target)
    except (ValueError, OSError, MemoryError) as e:
        return Decline(f"cannot recode the recording from {', '.join(how.recorded) or 'identity'}"
                       f" to {how.target}: {e}")
    headers = [
        (k, v) for k, v in recorded_headers
        if k.lower() not in _ENCODING_BOUND and k.lower() != "content-encoding"
    ]
    if how.target != "identity":
        headers.append(("content-encoding", how.target))
    vary = {item.lower() for item in _list_items(_values(headers, "vary"))}
    if "accept-encoding" not in vary:
        headers.append(("vary", "accept-encoding"))
    return Serve(tuple(headers), body)
