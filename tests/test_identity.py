"""Tests for turnguard_core.identity: stability, separation, secrecy, totality."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import zlib

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from turnguard_core.identity import (
    CREDENTIAL_HEADERS,
    KNOWN_ROUTES,
    Identity,
    Passthrough,
    RequestView,
    Target,
    Upstream,
    canonical_json,
    identify,
    split_target,
)

BODY = b'{"model":"gpt-5","input":[{"role":"user","content":"hi"}],"stream":true}'
AUTH = "Bearer sk-test-SECRET-0123456789"


UPSTREAM = Upstream("https", "api.openai.com", 443)


def req(body=BODY, headers=(("Authorization", AUTH),), method="POST", path="/v1/responses",
        upstream=UPSTREAM, proxy_auth=None):
    return RequestView(method, path, tuple(headers), body, upstream, proxy_auth)


def ident(*args, credential_headers=(), **kw) -> Identity:
    r = identify(req(*args, **kw), credential_headers=credential_headers)
    assert isinstance(r, Identity), r
    return r


def sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def tuple_hash(domain: str, *parts: str) -> str:
    """The documented encoding, written out independently of the module."""
    data = b"turnguard-" + domain.encode() + b"\0"
    for part in parts:
        b = part.encode()
        data += str(len(b)).encode() + b":" + b + b"\0"
    return hashlib.sha256(data).hexdigest()


def session_of(key: str, **kw) -> str:
    """The session hash of ``key`` for a request like ``ident(**kw)`` otherwise."""
    kw = {"headers": (), **kw}
    return ident(**{**kw, "headers": [*kw["headers"], ("session-id", key)]}).session


# --- strategies --------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=6)
header_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
                      min_size=1, max_size=20)


def dump(value, rnd: random.Random) -> str:
    """Serialize with shuffled keys, random whitespace and random string escaping."""
    def ws() -> str:
        return rnd.choice(["", "", " ", "  ", "\n", "\t", "\r\n "])

    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        inner = ",".join(f"{ws()}{dump(k, rnd)}{ws()}:{ws()}{dump(v, rnd)}{ws()}" for k, v in items)
        return "{" + inner + ws() + "}"
    if isinstance(value, list):
        return "[" + ws() + ",".join(f"{ws()}{dump(v, rnd)}{ws()}" for v in value) + "]"
    return json.dumps(value, ensure_ascii=rnd.random() < 0.5)


# --- stability ---------------------------------------------------------------------------------


@given(json_objects, st.randoms(use_true_random=False), st.randoms(use_true_random=False))
def test_identity_is_stable_under_key_order_and_whitespace(obj, rnd1, rnd2):
    a = ident(body=dump(obj, rnd1).encode())
    b = ident(body=dump(obj, rnd2).encode())
    assert a == b
    assert a.fingerprint == hashlib.sha256(canonical_json(obj)).hexdigest()


def test_identity_is_stable_example():
    a = ident(body=b'{"a":1,"b":[1,{"x":"\\u00e9","y":null}]}')
    b = ident(body=b'{ "b" : [ 1 , { "y" : null , "x" : "\xc3\xa9" } ] ,\n "a" : 1 }')
    assert a == b
    assert a != ident(body=b'{"a":1,"b":[{"x":"\\u00e9","y":null},1]}')  # list order matters


def test_canonical_json():
    assert canonical_json({"b": 1, "a": [1.5, None, "é", True]}) == '{"a":[1.5,null,"é",true],"b":1}'.encode()
    assert canonical_json({"x": float("nan")}) == b'{"x":NaN}'
    assert canonical_json("\ud800") == b'"\xed\xa0\x80"'  # lone surrogate: total, not an error


def test_principal_upstream_scope_session_and_op_key_formulas():
    i = ident(
        headers=[("Authorization", "Bearer x"), ("ChatGPT-Account-Id", "acct"),
                 ("session-id", "s1"), ("x-other", "not a credential")],
        path="/base/v1/responses/?k=v",
        upstream=Upstream("HTTPS", "API.example", 8443, host_header="api.example:8443",
                          via="http://127.0.0.1:3128"),
    )
    principal = tuple_hash(
        "principal", "headers", "2", "authorization", "1", "Bearer x", "chatgpt-account-id",
        "1", "acct", "url", "/base", "/?k=v", "proxy-auth", "",
    )
    upstream = tuple_hash("upstream", "https", "api.example", "8443", "",
                          "http://127.0.0.1:3128")
    scope = tuple_hash("scope", principal, upstream)
    assert (i.principal, i.upstream, i.scope) == (principal, upstream, scope)
    assert i.session == tuple_hash("session", scope, "s1")[:32]
    assert i.route == "/v1/responses"
    assert i.op_key == tuple_hash("op", scope, i.session, "POST", "/v1/responses",
                                  "body:" + i.fingerprint)
    assert ident(headers=[("Authorization", "")]).scope == ident(headers=[]).scope
    assert len(i.op_key) == 64 and len(i.fingerprint) == 64
    assert i.op_id == i.op_key[:12]
    plain = ident(headers=[])
    assert plain.session is None and plain.turn_state is None and plain.idempotency_key is None


# --- separation --------------------------------------------------------------------------------


@given(header_text, header_text)
def test_different_authorization_differs(a1, a2):
    assume(a1 != a2)
    x, y = ident(headers=[("Authorization", a1)]), ident(headers=[("Authorization", a2)])
    assert x.scope != y.scope and x.op_key != y.op_key
    assert x.fingerprint == y.fingerprint


@pytest.mark.parametrize("name", CREDENTIAL_HEADERS)
def test_every_credential_header_separates_principals(name):
    a = ident(headers=[("Authorization", AUTH), (name.upper(), "alice")])
    b = ident(headers=[("Authorization", AUTH), (name, "bob")])
    c = ident(headers=[("Authorization", AUTH)])
    assert len({a.principal, b.principal, c.principal}) == 3
    assert a.op_key != b.op_key and "alice" not in repr(a)


def test_the_built_in_credential_headers():
    for name in ("authorization", "proxy-authorization", "cookie", "api-key", "x-api-key",
                 "x-goog-api-key", "openai-organization", "openai-project", "chatgpt-account-id"):
        assert name in CREDENTIAL_HEADERS


def test_configured_credential_headers_separate_principals_and_nothing_else_does():
    a = [("x-tenant-key", "alice"), ("x-trace", "1")]
    b = [("x-tenant-key", "bob"), ("x-trace", "2")]
    assert ident(headers=a).op_key == ident(headers=b).op_key  # not credentials by default
    named = ("X-Tenant-Key",)
    x, y = ident(headers=a, credential_headers=named), ident(headers=b, credential_headers=named)
    assert x.principal != y.principal and x.op_key != y.op_key
    # the names are part of every principal: a request without the header identified before
    # it was named (when a request carrying it was the same principal) is another one after
    assert ident(headers=[], credential_headers=named).principal != ident(headers=[]).principal
    assert ident(headers=[], credential_headers=named).op_key != ident(headers=a).op_key
    # in any case, any order, repeated, or one of the built-in names: the same names
    assert ident(headers=a, credential_headers=("x_tenant_key", "X-TENANT-KEY", "cookie")) == x
    assert ident(headers=a, credential_headers=("authorization",)) == ident(headers=a)


def test_every_value_of_a_repeated_credential_header_counts_in_order():
    one = ident(headers=[("Cookie", "a=1")])
    two = ident(headers=[("Cookie", "a=1"), ("cookie", "b=2")])
    swapped = ident(headers=[("cookie", "b=2"), ("Cookie", "a=1")])
    assert len({one.principal, two.principal, swapped.principal}) == 3


def test_a_credential_header_spelled_with_underscores_is_that_credential():
    """Servers that map headers to CGI-style names read ``x_api_key`` as ``x-api-key``."""
    assert ident(headers=[("x_api_key", "K9")]).principal != ident(headers=[]).principal
    assert ident(headers=[("X_Api_Key", "K9")]).principal == ident(headers=[("x-api-key", "K9")]).principal
    tenant = ("x_tenant_key",)
    assert (ident(headers=[("x-tenant-key", "a")], credential_headers=tenant).principal
            != ident(headers=[("x-tenant-key", "b")], credential_headers=tenant).principal)


def test_a_key_sent_as_a_websocket_subprotocol_is_a_credential():
    a = ident(headers=[("Sec-WebSocket-Protocol", "realtime, openai-insecure-api-key.sk-AAAA")])
    b = ident(headers=[("Sec-WebSocket-Protocol", "realtime, openai-insecure-api-key.sk-BBBB")])
    assert a.principal != b.principal and "sk-AAAA" not in repr(a)


def test_proxy_authentication_is_part_of_the_principal():
    a, b = ident(proxy_auth='["alice", "pw"]'), ident(proxy_auth='["bob", "pw"]')
    none, empty = ident(proxy_auth=None), ident(proxy_auth="")
    assert len({a.principal, b.principal, none.principal, empty.principal}) == 4


@given(header_text, header_text)
def test_different_account_differs(c1, c2):
    assume(c1 != c2)
    h = ("Authorization", AUTH)
    x = ident(headers=[h, ("chatgpt-account-id", c1)])
    y = ident(headers=[h, ("chatgpt-account-id", c2)])
    assert x.scope != y.scope and x.op_key != y.op_key


def test_credential_fields_do_not_bleed_into_each_other():
    # ("ab", "") and ("a", "b") must not collide.
    x = ident(headers=[("Authorization", "ab")])
    y = ident(headers=[("Authorization", "a"), ("chatgpt-account-id", "b")])
    assert x.scope != y.scope
    z = ident(headers=[("Authorization", "a"), ("Authorization", "b")])
    assert len({x.scope, y.scope, z.scope}) == 3


# --- the upstream ------------------------------------------------------------------------------


@pytest.mark.parametrize("other", [
    Upstream("http", "api.openai.com", 443),
    Upstream("https", "api.openai.org", 443),
    Upstream("https", "api.openai.com", 8443),
    Upstream("https", "api.openai.com", 443, host_header="other.example"),
    Upstream("https", "api.openai.com", 443, host_header="api.openai.com:444"),
    Upstream("https", "api.openai.com", 443, via="http://127.0.0.1:3128"),
    # a TLS server name that names another host (a front that routes by it)
    Upstream("https", "api.openai.com", 443, sni="b.example"),
    Upstream("https", "api.openai.com", 443, host_header="a.example", sni="b.example"),
    None,
])
def test_another_upstream_is_another_scope_session_and_operation(other):
    h = [("Authorization", AUTH), ("session-id", "s1")]
    a, b = ident(headers=h), ident(headers=h, upstream=other)
    assert a.principal == b.principal
    assert a.upstream != b.upstream and a.scope != b.scope
    assert a.session != b.session and a.op_key != b.op_key


@pytest.mark.parametrize("same", [
    Upstream("HTTPS", "API.OpenAI.com", 443),
    Upstream("https", "api.openai.com", 443, host_header="api.openai.com"),
    Upstream("https", "api.openai.com", 443, host_header="API.openai.com:443"),
    # the server name of the host connected to, or of the Host header's: no other site
    Upstream("https", "api.openai.com", 443, sni="API.openai.com"),
])
def test_the_same_upstream_spelled_differently_is_the_same(same):
    assert ident(upstream=same) == ident()


def test_a_server_name_counts_only_over_tls_and_when_it_names_another_host():
    named = Upstream("https", "10.0.0.1", 443, host_header="gateway.example", sni="gateway.example")
    assert named.parts() == Upstream("https", "10.0.0.1", 443, host_header="gateway.example").parts()
    assert Upstream("http", "h", 80, sni="x").parts() == Upstream("http", "h", 80).parts()
    other = Upstream("https", "10.0.0.1", 443, host_header="gateway.example", sni="a.example")
    assert other.parts()[-2:] == ("sni", "a.example")


def test_ipv6_upstreams():
    a = Upstream("http", "::1", 8080, host_header="[::1]:8080")
    assert ident(upstream=a) == ident(upstream=Upstream("http", "::1", 8080))
    assert ident(upstream=a) != ident(upstream=Upstream("http", "::1", 8081))


# --- the target: route and URL rest -------------------------------------------------------------


@pytest.mark.parametrize(("target", "route", "prefix", "suffix"), [
    ("/v1/responses", "/v1/responses", "", ""),
    ("/v1/responses/", "/v1/responses", "", "/"),
    ("/v1/responses?stream=1", "/v1/responses", "", "?stream=1"),
    ("/sk-SECRET/v1/responses", "/v1/responses", "/sk-SECRET", ""),
    ("/openai/v1/responses?api-version=1", "/openai/v1/responses", "", "?api-version=1"),
    ("/gw/openai/v1/chat/completions/", "/openai/v1/chat/completions", "/gw", "/"),
    ("/backend-api/codex/responses", "/backend-api/codex/responses", "", ""),
    ("/xv1/responses", None, "/xv1/responses", ""),
    ("/v1/responses/resp_1?key=k", None, "/v1/responses/resp_1", "?key=k"),
    ("/", None, "/", ""),
    ("", None, "", ""),
])
def test_split_target(target, route, prefix, suffix):
    t = split_target(target)
    if route is None:
        route = "sha256:" + sha(prefix)[:32]
    assert t == Target(route, prefix, suffix)


def test_known_routes_are_paths():
    assert all(r.startswith("/") and not r.endswith("/") for r in KNOWN_ROUTES)


@pytest.mark.parametrize(("a", "b"), [
    ("/sk-alice/v1/responses", "/sk-bob/v1/responses"),
    ("/v1/responses?key=alice", "/v1/responses?key=bob"),
    ("/v1/responses?key=alice", "/v1/responses"),
    ("/v1/responses/", "/v1/responses"),
])
def test_a_key_in_the_url_isolates_like_a_credential_and_is_not_kept(a, b):
    h = [("Authorization", AUTH), ("session-id", "s1")]
    x, y = ident(path=a, headers=h), ident(path=b, headers=h)
    assert x.principal != y.principal and x.session != y.session and x.op_key != y.op_key
    assert x.route == y.route == "/v1/responses"
    assert "alice" not in repr(x)


# --- sessions belong to a principal and an upstream ---------------------------------------------


@given(header_text, header_text)
def test_the_same_session_id_of_two_principals_is_two_sessions(cred1, cred2):
    assume(cred1 != cred2)
    for name in ("authorization", "cookie", "x-goog-api-key"):
        x = ident(headers=[(name, cred1), ("session-id", "shared")])
        y = ident(headers=[(name, cred2), ("session-id", "shared")])
        assert x.session != y.session


@given(json_objects, json_objects)
def test_different_body_differs(o1, o2):
    assume(canonical_json(o1) != canonical_json(o2))
    x, y = ident(body=json.dumps(o1).encode()), ident(body=json.dumps(o2).encode())
    assert x.fingerprint != y.fingerprint and x.op_key != y.op_key
    assert x.scope == y.scope


@given(header_text, header_text)
def test_different_session_differs(s1, s2):
    assume(s1 != s2)
    x = ident(headers=[("Authorization", AUTH), ("session-id", s1)])
    y = ident(headers=[("Authorization", AUTH), ("session-id", s2)])
    assert x.session != y.session and x.op_key != y.op_key
    assert x.scope == y.scope and x.fingerprint == y.fingerprint


@given(st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=30))
def test_different_path_differs(p1, p2):
    assume(p1 != p2)
    assert ident(path=p1).op_key != ident(path=p2).op_key


def test_the_method_is_case_sensitive_as_in_http():
    """`post` is not `POST` to an origin (it may answer 405): never one operation."""
    assert ident(method="post").op_key != ident(method="POST").op_key
    assert ident(method="PUT").op_key != ident(method="POST").op_key


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_no_json(literal):
    """Python reads them, JSON has no such value: as floats, `Infinity` would be one body with
    `1e400`, which an origin may take where it refuses `Infinity`."""
    r = identify(req(body=b'{"model":"m","temperature":' + literal + b"}"))
    assert isinstance(r, Passthrough) and r.reason == "body is not JSON", r
    assert ident(body=b'{"model":"m","temperature":1e400}').op_key


@given(header_text, json_objects, json_objects)
def test_idempotency_key_shares_op_key_across_bodies(key, o1, o2):
    assume(canonical_json(o1) != canonical_json(o2))
    h = [("Authorization", AUTH), ("Idempotency-Key", key)]
    x = ident(body=json.dumps(o1).encode(), headers=h)
    y = ident(body=json.dumps(o2).encode(), headers=h)
    assert x.op_key == y.op_key  # same operation ...
    assert x.fingerprint != y.fingerprint  # ... with another body: the caller answers 422
    assert x.idempotency_key == sha(key)[:32]


def test_idempotency_key_separates_operations_and_empty_key_is_absent():
    h = ("Authorization", AUTH)
    a = ident(headers=[h, ("idempotency-key", "k1")])
    b = ident(headers=[h, ("idempotency-key", "k2")])
    assert a.op_key != b.op_key and a.fingerprint == b.fingerprint
    assert ident(headers=[h, ("Idempotency-Key", "")]) == ident(headers=[h])


# --- secrecy -----------------------------------------------------------------------------------


@given(st.text(min_size=1, max_size=40), st.booleans())
def test_raw_authorization_never_appears(token, json_body):
    secret = "sk-" + token
    auth = "Bearer " + secret
    body = BODY if json_body else b"not json " + auth.encode()
    r = identify(req(body=body, headers=[("Authorization", auth), ("chatgpt-account-id", "acct")]))
    text = repr(r)
    assert auth not in text and secret not in text
    if isinstance(r, Identity):
        for field in (r.principal, r.upstream, r.scope, r.session, r.route, r.turn_state,
                      r.previous_response_id, r.idempotency_key, r.fingerprint, r.op_key,
                      r.op_id):
            assert field is None or secret not in field


# --- session precedence ------------------------------------------------------------------------

SOURCES = [
    ("session-id", "A"),
    ("session_id", "B"),
    ("x-codex-turn-metadata", json.dumps({"session_id": "C", "turn_id": "t1"})),
    ("conversation_id", "D"),
    ("conversation-id", "E"),
]
SOURCE_KEY = {"session-id": "A", "session_id": "B", "x-codex-turn-metadata": "C",
              "conversation_id": "D", "conversation-id": "E"}


@pytest.mark.parametrize("first", range(len(SOURCES) + 1))
def test_session_precedence(first):
    present = SOURCES[first:]
    expected = session_of(SOURCE_KEY[present[0][0]]) if present else None
    assert ident(headers=list(reversed(present))).session == expected


@given(st.sets(st.sampled_from([n for n, _ in SOURCES])), st.randoms(use_true_random=False))
def test_session_precedence_any_order_and_case(names, rnd):
    headers = [(n, v) for n, v in SOURCES if n in names]
    rnd.shuffle(headers)
    headers = [("".join(c.upper() if rnd.random() < 0.5 else c for c in n), v) for n, v in headers]
    winner = next((SOURCE_KEY[n] for n, _ in SOURCES if n in names), None)
    assert ident(headers=headers).session == (session_of(winner) if winner else None)


@pytest.mark.parametrize(
    "meta", ['["session_id", "C"]', "not json", '{"session_id": 5}', '{"session_id": ""}', "{"]
)
def test_turn_metadata_that_is_not_a_usable_object_is_ignored(meta):
    i = ident(headers=[("x-codex-turn-metadata", meta), ("conversation_id", "D")])
    assert i.session == session_of("D")


def test_first_occurrence_wins_and_empty_counts_as_absent():
    assert ident(headers=[("Session-Id", "A"), ("session-id", "Z")]).session == session_of("A")
    assert ident(headers=[("session-id", ""), ("session_id", "B")]).session == session_of("B")
    # an empty first occurrence does not hide a later non-empty one of the same name
    assert ident(headers=[("session-id", ""), ("Session-Id", "A")]).session == session_of("A")
    # but every value of a credential header counts
    x = ident(headers=[("Authorization", "a1"), ("authorization", "a2")])
    assert x.scope != ident(headers=[("Authorization", "a1")]).scope


# --- anchors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("turn_state", "prev", "expected_prev", "hard"),
    [
        ("ts-token", None, None, True),
        ("ts-token", "resp_1", "resp_1", False),
        (None, "resp_1", "resp_1", False),
        (None, None, None, False),
        ("ts-token", "", None, True),
        ("ts-token", 42, None, True),
        ("", None, None, False),  # empty header counts as absent
    ],
)
def test_anchors(turn_state, prev, expected_prev, hard):
    body = {"model": "m", "input": "hi"}
    if prev is not None:
        body["previous_response_id"] = prev
    headers = [("x-codex-turn-state", turn_state)] if turn_state is not None else []
    i = ident(body=json.dumps(body).encode(), headers=headers)
    assert i.previous_response_id == expected_prev
    assert i.has_hard_anchor is hard
    assert i.turn_state == (sha(turn_state)[:16] if turn_state else None)


def test_turn_state_is_part_of_identity_but_not_of_op_key():
    a = ident(headers=[("x-codex-turn-state", "t1")])
    b = ident(headers=[("x-codex-turn-state", "t2")])
    assert a.turn_state != b.turn_state and a.op_key == b.op_key


# --- passthrough -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (None, "body could not be decoded"),
        (b"", "no body"),
        (b"not json", "body is not JSON"),
        (b'{"a":1', "body is not JSON"),
        (b'{"a":1} trailing', "body is not JSON"),
        (b"\xef\xbb\xbf{}", "body is not JSON"),  # BOM
        (b'{"n": ' + b"9" * 5000 + b"}", "body is not JSON"),  # past int digit limit
        (b"[1, 2]", "body is not a JSON object"),
        (b'"text"', "body is not a JSON object"),
        (b"null", "body is not a JSON object"),
        (b'{"a": "\xff"}', "body is not UTF-8"),
        (b'{"a": "\xed\xa0\x80"}', "body is not UTF-8"),  # encoded surrogate
        (b'{"a": 1, "a": 2}', "duplicate keys in JSON body"),
        (b'{"x": [{"k": 1, "k": 1}]}', "duplicate keys in JSON body"),
        (b'{"a":' + b"[" * 256 + b"]" * 256 + b"}", "JSON nesting too deep"),
        (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON nesting too deep"),
        (b"[" * 100_000, "JSON nesting too deep"),
    ],
)
def test_passthrough_reasons(body, reason):
    assert identify(req(body=body)) == Passthrough(reason)


def test_nesting_at_the_limit_is_accepted():
    # The top-level object is depth 1, so 255 nested lists make 256.
    assert isinstance(identify(req(body=b'{"a":' + b"[" * 255 + b"]" * 255 + b"}")), Identity)


def test_body_too_large():
    assert identify(req(body=b'{"a": "12"}'), max_body_bytes=10) == Passthrough(
        "body too large (11 bytes > limit 10)"
    )
    assert isinstance(identify(req(body=b'{"a":"12"}'), max_body_bytes=10), Identity)
    huge = b'{"a":"' + b"x" * (64 * 1024 * 1024) + b'"}'
    r = identify(req(body=huge))
    assert isinstance(r, Passthrough) and r.reason.startswith("body too large")


def test_nul_in_credentials_is_unambiguous():
    a = ident(headers=[("Authorization", "a\0b")])
    b = ident(headers=[("Authorization", "a"), ("Authorization", "b")])
    c = ident(headers=[("chatgpt-account-id", "\0")])
    assert len({a.principal, b.principal, c.principal}) == 3


# --- totality ----------------------------------------------------------------------------------

any_text = st.text(st.characters(codec=None), max_size=20)  # surrogates and NULs included
header_names = st.sampled_from(
    ["authorization", "Authorization", "chatgpt-account-id", "session-id", "session_id",
     "x-codex-turn-metadata", "conversation_id", "conversation-id", "x-codex-turn-state",
     "Idempotency-Key"]
) | any_text
bodies = (
    st.none()
    | st.binary(max_size=200)
    | json_objects.map(lambda o: json.dumps(o).encode())
    | st.builds(lambda o, cut: json.dumps(o).encode()[:cut], json_objects, st.integers(0, 50))
    | json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass"))
)


@settings(max_examples=examples(300))
@given(any_text, any_text, st.lists(st.tuples(header_names, any_text | json_values.map(json.dumps)),
                                    max_size=8), bodies)
def test_identify_never_raises(method, path, headers, body):
    r = identify(RequestView(method, path, tuple(headers), body, UPSTREAM),
                 credential_headers=("x-a", "Authorization"))
    assert isinstance(r, (Identity, Passthrough))
    if isinstance(r, Identity):
        assert len(r.op_key) == 64 and len(r.scope) == 64
    else:
        assert r.reason and not r.reason.startswith("identity failed"), r.reason


def test_identify_never_raises_on_malformed_views():
    bad = [
        RequestView(None, "/", (), BODY),  # type: ignore[arg-type]
        RequestView("POST", "/", (("a",),), BODY),  # type: ignore[arg-type]
        RequestView("POST", "/", None, BODY),  # type: ignore[arg-type]
        RequestView("POST", "/", (), "{}"),  # type: ignore[arg-type]
        RequestView("POST", "/", (), BODY, Upstream("http", None, 1)),  # type: ignore[arg-type]
        RequestView("POST", "/", (), BODY, Upstream("http", "h", "x")),  # type: ignore[arg-type]
        RequestView("POST", None, (), BODY),  # type: ignore[arg-type]
    ]
    for view in bad:
        r = identify(view)
        assert isinstance(r, (Identity, Passthrough))


def _tuple_hash_reference(domain: str, *parts: str) -> str:
    """The encoding the ledgers' keys were made with: changing it would orphan them."""
    h = hashlib.sha256(b"turnguard-" + domain.encode("utf-8", "surrogatepass") + b"\0")
    for part in parts:
        b = part.encode("utf-8", "surrogatepass")
        h.update(b"%d:" % len(b))
        h.update(b)
        h.update(b"\0")
    return h.hexdigest()


@given(st.text(max_size=20), st.lists(st.text(), max_size=6))
def test_tuple_hashes_keep_their_encoding(domain, parts):
    from turnguard_core.identity import _tuple_hash

    assert _tuple_hash(domain, *parts) == _tuple_hash_reference(domain, *parts)
    assert _tuple_hash("op", "a\ud800", "") == _tuple_hash_reference("op", "a\ud800", "")


# -- a body still content-coded (the shell leaves one that decodes large to the worker) ---------
def _coded(body: bytes, codings: tuple[str, ...]) -> bytes:
    for coding in codings:
        body = gzip.compress(body, mtime=0) if coding == "gzip" else zlib.compress(body)
    return body


@pytest.mark.parametrize("codings", [("gzip",), ("deflate",), ("gzip", "deflate")])
def test_a_coded_body_has_the_identity_of_its_decoded_body(codings):
    view = RequestView("POST", "/v1/responses", (("Authorization", AUTH),), _coded(BODY, codings),
                       UPSTREAM, body_codings=codings)
    assert identify(view) == identify(req())


def test_a_coded_body_that_cannot_be_decoded_within_the_bound_is_passed_through():
    three = ("gzip", "gzip", "gzip")  # more codings than are decoded, however small
    for body, codings, bound in [(_coded(BODY, three), three, 1 << 20),
                                 (_coded(bytes(1 << 20), ("gzip",)), ("gzip",), 1 << 19),
                                 (b"not gzip", ("gzip",), 1 << 20)]:
        view = RequestView("POST", "/v1/responses", (), body, UPSTREAM, body_codings=codings)
        assert identify(view, max_body_bytes=bound) == Passthrough("body could not be decoded")
