"""Content negotiation for replays (pure) and the bounded codec it uses."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from turnguard_core import negotiation as n
from turnguard_core.codec import BoundedCodec

SSE = (("content-type", "text/event-stream"),)
BODY = b"event: response.completed\ndata: {}\n\n" * 20


def ae(value: str | None) -> tuple[tuple[str, str], ...]:
    return () if value is None else (("Accept-Encoding", value),)


def enc(coding: str | None) -> tuple[tuple[str, str], ...]:
    return SSE if coding is None else (*SSE, ("Content-Encoding", coding))


@pytest.mark.parametrize(("recorded", "accept", "expected"), [
    # as recorded whenever the client accepts the recorded coding
    (None, None, n.AsRecorded()),
    ("gzip", None, n.AsRecorded()),
    ("br", "gzip, deflate, br", n.AsRecorded()),
    ("gzip", "GZIP;q=0.1", n.AsRecorded()),
    ("x-gzip", "gzip", n.AsRecorded()),
    ("gzip", "x-gzip", n.AsRecorded()),
    ("zstd", "*", n.AsRecorded()),
    (None, "", n.AsRecorded()),
    (None, "gzip", n.AsRecorded()),  # identity is acceptable unless excluded
    ("identity", "gzip", n.AsRecorded()),
    ("gzip, br", "br, gzip", n.AsRecorded()),
    # the cases: identity only, gzip only
    ("gzip", "identity", n.Recode(("gzip",), "identity")),
    ("br", "gzip", n.Recode(("br",), "identity")),
    ("br", "gzip, identity;q=0", n.Recode(("br",), "gzip")),
    ("gzip", "", n.Recode(("gzip",), "identity")),  # empty: no coding wanted
    ("gzip", "gzip;q=0", n.Recode(("gzip",), "identity")),
    ("gzip", "*;q=0, identity", n.Recode(("gzip",), "identity")),
    ("gzip", "gzip;q=abc", n.Recode(("gzip",), "identity")),  # unparseable q: 0
    ("gzip", "gzip;q=2", n.Recode(("gzip",), "identity")),  # out of range: 0
    ("gzip, br", "gzip", n.Recode(("gzip", "br"), "identity")),
    (None, "identity;q=0, br;q=0.5, zstd;q=0.9", n.Recode((), "zstd")),
    (None, "*;q=0, deflate", n.Recode((), "deflate")),
    ("br", "*;q=0, gzip;q=0.5, br;q=0", n.Recode(("br",), "gzip")),
    (None, "*", n.AsRecorded()),
    (None, "identity;q=0, *;q=0.3", n.Recode((), "gzip")),  # ties: gzip first
])
def test_plan(recorded, accept, expected):
    assert n.plan(enc(recorded), "", ae(accept)) == expected


@pytest.mark.parametrize(("recorded", "accept", "why"), [
    (None, "identity;q=0", "accepts no content coding"),
    (None, "*;q=0", "accepts no content coding"),
    ("gzip", "compress, identity;q=0", "accepts no content coding"),
    ("compress", "gzip", "cannot decode compress"),
    ("gzip, exi", "identity", "cannot decode exi"),
])
def test_plan_declines_when_nothing_acceptable_can_be_made(recorded, accept, why):
    got = n.plan(enc(recorded), "", ae(accept))
    assert isinstance(got, n.Decline) and why in got.reason


def test_vary_star_is_never_replayed():
    got = n.plan((*SSE, ("Vary", "Origin, *")), "", ())
    assert isinstance(got, n.Decline) and "Vary: *" in got.reason
    assert n.vary_names((("vary", "*"),)) is None


def test_vary_replays_only_to_the_same_values_of_the_named_headers():
    recorded = (*SSE, ("Vary", "X-Tenant, Accept-Encoding"), ("vary", "x-region"))
    names = n.vary_names(recorded)
    assert names == frozenset({"x-tenant", "x-region"})
    original = (("x-tenant", "a"), ("X-Region", "eu"), ("accept-encoding", "gzip"))
    key = n.vary_key(names, original)
    same = (("X-Tenant", "a"), ("x-region", "eu"), ("accept-encoding", "br"), ("x-other", "1"))
    assert n.plan(recorded, key, same) == n.AsRecorded()
    for other in [(("x-tenant", "b"), ("x-region", "eu")),
                  (("x-region", "eu"),),
                  (("x-tenant", "a"), ("x-tenant", "a"), ("x-region", "eu"))]:
        got = n.plan(recorded, key, other)
        assert isinstance(got, n.Decline) and "x-region, x-tenant" in got.reason
    assert isinstance(n.plan(recorded, None, same), n.Decline)  # key unknown: never
    assert n.vary_key(frozenset(), original) == ""
    assert n.plan((*SSE, ("vary", "accept-encoding")), None, ()) == n.AsRecorded()


def test_recode_decodes_and_encodes_and_fixes_the_headers():
    codec = BoundedCodec(1 << 20)
    recorded = (*SSE, ("content-encoding", "gzip"), ("ETag", '"x"'), ("vary", "x-tenant"),
                ("x-request-id", "r1"))
    out = n.recode(recorded, gzip.compress(BODY), n.Recode(("gzip",), "identity"), codec)
    assert out == n.Serve((*SSE, ("vary", "x-tenant"), ("x-request-id", "r1"),
                           ("vary", "accept-encoding")), BODY)
    out = n.recode(recorded, gzip.compress(BODY), n.Recode(("gzip",), "br"), codec)
    assert isinstance(out, n.Serve) and ("content-encoding", "br") in out.headers
    assert codec.decode(out.body, "br") == BODY
    out = n.recode((*SSE, ("Vary", "Accept-Encoding")), BODY, n.Recode((), "deflate"), codec)
    assert zlib.decompress(out.body) == BODY
    assert [h for h in out.headers if h[0].lower() == "vary"] == [("Vary", "Accept-Encoding")]


def test_recode_declines_a_bomb_and_garbage():
    bomb = gzip.compress(b"\0" * (2 << 20))
    got = n.recode(enc("gzip"), bomb, n.Recode(("gzip",), "identity"), BoundedCodec(1 << 20))
    assert isinstance(got, n.Decline) and "more than 1048576 bytes" in got.reason
    got = n.recode(enc("gzip"), b"not gzip", n.Recode(("gzip",), "identity"), BoundedCodec(99))
    assert isinstance(got, n.Decline) and "invalid data" in got.reason


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_codec_round_trips_and_refuses_truncation(coding):
    codec = BoundedCodec(len(BODY))
    data = codec.encode(BODY, coding)
    assert codec.decode(data, coding) == BODY
    with pytest.raises(ValueError):
        codec.decode(data[: len(data) // 2], coding)
    with pytest.raises(ValueError, match="more than"):
        BoundedCodec(len(BODY) - 1).decode(data, coding)


CODINGS = st.sampled_from(["gzip", "br", "zstd", "deflate", "identity", "compress", "*"])
ACCEPT = st.lists(
    st.tuples(CODINGS, st.sampled_from(["", ";q=0", ";q=0.5", ";q=1", ";q=0.001"])),
    max_size=5,
).map(lambda items: ", ".join(c + q for c, q in items))


@settings(max_examples=examples(300))
@given(recorded=st.sampled_from([None, "gzip", "br", "zstd", "deflate"]),
       accept=st.none() | ACCEPT)
def test_whatever_is_served_is_acceptable_and_decodes_to_the_recording(recorded, accept):
    """The property: a replay is sent only in a coding the client accepts, and it carries
    the recorded content."""
    codec = BoundedCodec(1 << 20)
    body = BODY if recorded is None else codec.encode(BODY, recorded)
    how = n.plan(enc(recorded), "", ae(accept))
    accepted = n.accepted_codings(ae(accept))
    if isinstance(how, n.Decline):
        return
    if isinstance(how, n.AsRecorded):
        headers, out = enc(recorded), body
    else:
        served = n.recode(enc(recorded), body, how, codec)
        assert isinstance(served, n.Serve)
        headers, out = served.headers, served.body
    codings = [v for k, v in headers if k.lower() == "content-encoding"]
    coding = codings[0] if codings else "identity"
    if accepted is not None:
        weight = accepted.get(coding)
        if weight is None:
            weight = accepted.get("*", 0.0 if coding != "identity" else 1.0)
            if coding == "identity" and accepted.get("*") == 0.0:
                weight = 0.0
        assert weight > 0, (coding, accept)
    assert (out if coding == "identity" else codec.decode(out, coding)) == BODY
