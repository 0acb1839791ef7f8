"""The identity memo: a remembered identity is always the one ``identify`` computes, for any
sequence of requests (retries, near-duplicates that differ in one credential, one header, one
body byte, the upstream), and the memo stays within its bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from turnguard_core import identity_memo
from turnguard_core.identity import Identity, Passthrough, RequestView, Upstream, identify
from turnguard_core.identity_memo import IdentityMemo

MAX = 64 * 1024 * 1024
UP = Upstream("https", "api.openai.com", 443)


def view(body: bytes | None = b'{"model":"m","input":"hi"}', *, auth: str = "Bearer sk-a",
         session: str = "s1", upstream: Upstream | None = UP, proxy_auth: str | None = None,
         path: str = "/v1/responses", extra: tuple[tuple[str, str], ...] = ()) -> RequestView:
    headers = (("Authorization", auth), ("session-id", session), *extra)
    return RequestView("POST", path, headers, body, upstream, proxy_auth)


# requests close to each other: the memo must tell every one of them apart
bodies = st.sampled_from([b'{"model":"m","input":"hi"}', b'{"model":"m","input":"hj"}',
                          b'{"input":"hi","model":"m"}', b'{"model":"m","input":"hi" }',
                          b"not json", None, b'{"model":"m","input":"' + b"x" * 3000 + b'"}'])
variants = st.builds(
    view, body=bodies,
    auth=st.sampled_from(["Bearer sk-a", "Bearer sk-b", "bearer sk-a", ""]),
    session=st.sampled_from(["s1", "s2"]),
    upstream=st.sampled_from([UP, Upstream("https", "api.openai.com", 8443), None]),
    proxy_auth=st.sampled_from([None, "Basic dTpw", "Basic dTpx"]),
    path=st.sampled_from(["/v1/responses", "/v1/responses?x=1", "/v1/chat/completions"]),
    extra=st.sampled_from([(), (("x-api-key", "k1"),), (("x-api-key", "k2"),),
                           (("idempotency-key", "i1"),), (("x-codex-turn-state", "t"),)]),
)


def copy(v: RequestView) -> RequestView:
    """The same request as a retry brings it: equal, but no object shared."""
    return RequestView(str(v.method), str(v.path), tuple((str(k), str(x)) for k, x in v.headers),
                       None if v.body is None else bytes(bytearray(v.body)), v.upstream,
                       v.proxy_auth)


@settings(max_examples=examples(300))
@given(st.lists(st.tuples(variants, st.sampled_from([(), ("x-api-key",), ("session-id",)])),
                min_size=1, max_size=40),
       st.integers(1, 8), st.sampled_from([0, 100, 5000, 1 << 20]))
def test_a_remembered_identity_is_the_one_identify_computes(requests, max_entries, max_bytes):
    memo = IdentityMemo(max_entries=max_entries, max_body_bytes=max_bytes)
    for v, names in requests + requests[::-1]:  # then each again, as a retry would
        got = memo.identify(copy(v), max_body_bytes=MAX, credential_headers=names)
        assert got == identify(v, max_body_bytes=MAX, credential_headers=names)
        assert len(memo) <= max_entries and memo.body_bytes <= max_bytes


def test_a_retry_is_answered_from_memory_and_a_changed_request_is_not(monkeypatch):
    computed = []

    def counting_identify(v, **kw):
        computed.append(v)
        return identify(v, **kw)

    monkeypatch.setattr(identity_memo, "identify", counting_identify)
    memo = IdentityMemo()
    first = memo.identify(view(), max_body_bytes=MAX)
    assert isinstance(first, Identity)
    assert memo.identify(copy(view()), max_body_bytes=MAX) is first and len(computed) == 1
    # one credential, one body byte, another upstream, another proxy login: computed again
    for other in (view(auth="Bearer sk-b"), view(body=b'{"model":"m","input":"hj"}'),
                  view(upstream=Upstream("https", "api.openai.com", 8443)),
                  view(proxy_auth="Basic dTpw")):
        got = memo.identify(other, max_body_bytes=MAX)
        assert got == identify(other, max_body_bytes=MAX) and got.principal is not None
    assert len(computed) == 5
    # the same request under another credential-header configuration is another question
    memo.identify(view(), max_body_bytes=MAX, credential_headers=("session-id",))
    assert len(computed) == 6


def test_a_passthrough_is_examined_again_each_time():
    memo = IdentityMemo()
    bad = view(body=b"not json")
    assert isinstance(memo.identify(bad, max_body_bytes=MAX), Passthrough)
    assert len(memo) == 0


def test_bounds_the_least_recently_used_go_first():
    memo = IdentityMemo(max_entries=2, max_body_bytes=1000)
    a, b, c = (view(session=s) for s in ("a", "b", "c"))
    for v in (a, b, a, c):  # a used again after b: b goes when c comes
        memo.identify(v, max_body_bytes=MAX)
    assert len(memo) == 2
    keys = [k[0] for k in memo._known]
    assert keys == [a, c]
    big = view(body=b'{"input":"' + b"y" * 990 + b'"}')  # 1002 bytes: over the byte bound
    memo.identify(big, max_body_bytes=MAX)
    assert len(memo) == 2 and memo.body_bytes <= 1000
    half = view(body=b'{"input":"' + b"z" * 500 + b'"}')
    memo.identify(half, max_body_bytes=MAX)
    memo.identify(view(body=b'{"input":"' + b"w" * 500 + b'"}'), max_body_bytes=MAX)
    assert memo.body_bytes <= 1000 and half not in [k[0] for k in memo._known]


@pytest.mark.parametrize("args", [(0, 10), (1, -1)])
def test_bad_bounds_are_refused(args):
    with pytest.raises(ValueError):
        IdentityMemo(*args)
