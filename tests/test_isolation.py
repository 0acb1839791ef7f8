"""Isolation (issue 11), through a real mitmdump: a recording never reaches another upstream,
principal, session, body or encoding; sessions belong to a principal; nothing secret from a URL
is kept; the ledger and events paths cannot be redirected.

The rig is one mitmdump process with three listeners sharing one ledger: a reverse proxy to
mock upstream U1, a reverse proxy to mock upstream U2, and a regular (forward) proxy through
which a client can reach either. Every dispatch of the mock answers with its own response id,
so a leaked recording shows as a response id the client's request never produced."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import secrets
import sqlite3
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import (
    ADDON,
    MITMDUMP,
    REPO,
    Mitmdump,
    MockUpstream,
    assert_no_traceback,
    default_tls,
    guarded,
    parse_sse,
    post_turn,
    read_jsonl,
    response_id,
    wait_until,
)
from hypothesis_profiles import examples
import turnguard_ws  # noqa: E402 - harness puts scripts/ on sys.path
from turnguard_ws import WsClient  # noqa: E402
from wsproto.events import Request as WsRequest

REQUEST_TIMEOUT_S = 15
EXTRA_CREDENTIAL = "x-tenant-key"  # named by turnguard_credential_headers in the rig


@dataclass
class Rig:
    ups: list[MockUpstream]
    proxy: Mitmdump
    tmp: Path

    @property
    def reverse_urls(self) -> list[str]:
        return self.proxy.urls[:2]

    @property
    def forward_proxy(self) -> str:
        return self.proxy.urls[2]

    @property
    def ledger(self) -> Path:
        return self.tmp / "ledger.sqlite3"

    def events(self, kind: str) -> list[dict]:
        return [e for e in read_jsonl(self.tmp / "events.jsonl") if e["event"] == kind]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isolation")
    ups: list[MockUpstream] = []
    try:
        ups = [MockUpstream(tmp, name="u1"), MockUpstream(tmp, name="u2")]
        proxy = Mitmdump(tmp, None, modes=[
            f"reverse:{ups[0].url}@127.0.0.1:0",
            f"reverse:{ups[1].url}@127.0.0.2:0",
            "regular@127.0.0.3:0",
        ], options={
            "turnguard_ledger": str(tmp / "ledger.sqlite3"),
            "turnguard_events": str(tmp / "events.jsonl"),
            "turnguard_credential_headers": EXTRA_CREDENTIAL,
            "turnguard_cooldown_ms": 60000,
        })
    except BaseException:
        for up in ups:
            up.stop()
        raise
    try:
        yield Rig(ups, proxy, tmp)
        assert_no_traceback(proxy.log_text())
    finally:
        proxy.stop()
        for up in ups:
            up.stop()


@dataclass(frozen=True)
class Req:
    upstream: int  # 0: U1, 1: U2
    via: str  # "reverse": U's own reverse listener; "regular": the forward proxy
    headers: tuple[tuple[str, str], ...]
    body: dict
    path: str = "/v1/responses"


def send(rig: Rig, r: Req) -> httpx.Response:
    """One request on a fresh connection, through the listener ``r.via`` names."""
    h = {"content-type": "application/json", "accept": "text/event-stream",
         "accept-encoding": "identity", **dict(r.headers)}
    if r.via == "reverse":
        with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S, verify=default_tls()) as c:
            return c.post(rig.reverse_urls[r.upstream] + r.path, json=r.body, headers=h)
    with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S, proxy=rig.forward_proxy, verify=default_tls()) as c:
        return c.post(rig.ups[r.upstream].url + r.path, json=r.body, headers=h)


def dispatches(rig: Rig, upstream: int) -> int:
    return len(rig.ups[upstream].dispatches())


def replayed(resp: httpx.Response) -> bool:
    return resp.headers.get("x-turnguard") == "replayed"


def assert_fresh(rig: Rig, r: Req, other: httpx.Response) -> httpx.Response:
    """Send ``r``: it must be dispatched to its own upstream and not answered with ``other``'s
    recording."""
    before = dispatches(rig, r.upstream)
    resp = send(rig, r)
    assert resp.status_code == 200, resp.text[:300]
    assert not replayed(resp), f"{r} got a replay"
    assert response_id(resp.content) != response_id(other.content)
    assert dispatches(rig, r.upstream) == before + 1
    return resp


def assert_replayed(rig: Rig, r: Req, original: httpx.Response) -> None:
    before = dispatches(rig, r.upstream)
    resp = send(rig, r)
    assert resp.status_code == 200 and replayed(resp), f"{r} was not replayed"
    assert resp.content == original.content
    assert dispatches(rig, r.upstream) == before


def turn(tag: str = "") -> dict:
    return {"model": "m", "input": f"isolation {tag} {secrets.token_hex(6)}", "stream": True}


# -----------------------------------------------------------------------------------------------
# 1. The upstream is part of the identity


@pytest.mark.parametrize("via", ["reverse", "regular"])
def test_the_same_request_to_another_upstream_is_never_answered_from_the_recording(rig, via):
    a = Req(0, via, (("authorization", "Bearer k"), ("session-id", "s-up")), turn("upstream"))
    first = send(rig, a)
    assert first.status_code == 200 and not replayed(first)
    assert_replayed(rig, a, first)  # the control: the same request to the same upstream
    assert_fresh(rig, replace(a, upstream=1), first)


def test_the_same_upstream_through_either_listener_is_the_same_operation(rig):
    """Identity is the upstream, not the listener: reverse and regular mode to U1 share."""
    a = Req(0, "reverse", (("authorization", "Bearer k"),), turn("listener"))
    first = send(rig, a)
    assert_replayed(rig, replace(a, via="regular"), first)


def raw_post(address: tuple[str, int], target: str, body: dict) -> bytes:
    """One HTTP/1.1 POST with the request target ``target`` as given (an absolute-form URL
    too, which httpx never sends to a server), on a fresh connection; the raw answer."""
    import socket
    import time

    data = json.dumps(body).encode()
    head = (f"POST {target} HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n"
            "authorization: Bearer k\r\ncontent-type: application/json\r\n"
            "accept: text/event-stream\r\naccept-encoding: identity\r\n"
            f"content-length: {len(data)}\r\nconnection: close\r\n\r\n")
    out = b""
    with socket.create_connection(address, timeout=REQUEST_TIMEOUT_S) as s:
        s.sendall(head.encode() + data)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    return out


def test_an_absolute_form_target_naming_another_host_is_another_upstream(rig):
    """A reverse listener forwards an absolute-form request target as it came
    (``POST http://a.example/v1/responses``), and the origin then takes the host from it and
    ignores ``Host`` (RFC 9112, 3.2.2): a virtual-hosting upstream (a gateway routing by host)
    serves another site for another authority. Such a request is never answered from the
    recording of one naming another host, nor of one in origin-form."""
    listener = ("127.0.0.1", rig.proxy.ports[0])
    body = turn("absolute-form")
    origin_form = raw_post(listener, "/v1/responses", body)
    assert origin_form.startswith(b"HTTP/1.1 200") and b"x-turnguard" not in origin_form
    answers = [origin_form]
    for host in ("site-a.example", "site-b.example"):
        before = dispatches(rig, 0)
        got = raw_post(listener, f"http://{host}/v1/responses", body)
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        assert b"x-turnguard: replayed" not in got.lower(), f"{host} got another's recording"
        assert dispatches(rig, 0) == before + 1
        assert response_id(got.partition(b"\r\n\r\n")[2]) not in {
            response_id(a.partition(b"\r\n\r\n")[2]) for a in answers}
        answers.append(got)
    again = raw_post(listener, "http://site-b.example/v1/responses", body)
    assert b"x-turnguard: replayed" in again.lower()  # the control: the same authority shares
    assert response_id(again.partition(b"\r\n\r\n")[2]) == response_id(
        answers[-1].partition(b"\r\n\r\n")[2])


# -----------------------------------------------------------------------------------------------
# 2. Every credential-bearing header, and the configured ones


@pytest.mark.parametrize("header", ["cookie", "proxy-authorization", "x-goog-api-key",
                                    "anthropic-version-is-not-one", EXTRA_CREDENTIAL,
                                    # gateways' own key headers, credentials by default: Kong's
                                    # key-auth (and Supabase), Cloudflare Access service
                                    # tokens, Azure Functions' function keys
                                    "apikey", "cf-access-client-id", "cf-access-client-secret",
                                    "x-functions-key"])
def test_requests_that_differ_only_in_a_credential_never_share_a_recording(rig, header):
    body = turn(header)
    alice = Req(0, "reverse", (("authorization", "Bearer shared"), (header, "alice")), body)
    bob = replace(alice, headers=(("authorization", "Bearer shared"), (header, "bob")))
    first = send(rig, alice)
    if header == "anthropic-version-is-not-one":  # the control: not a credential, so shared
        assert_replayed(rig, bob, first)
    else:
        assert_fresh(rig, bob, first)


def test_a_second_value_of_a_credential_header_counts(rig):
    body = turn("repeated")
    one = Req(0, "reverse", (("cookie", "a=1"),), body)
    first = send(rig, one)
    assert_fresh(rig, replace(one, headers=(("cookie", "a=1"), ("cookie", "b=2"))), first)


# -----------------------------------------------------------------------------------------------
# 3. Sessions, circuits and ownership belong to principal + session


def test_one_principal_cannot_fence_another_by_sending_its_session_id(rig):
    session = f"victim-{secrets.token_hex(4)}"
    attacker = (("authorization", "Bearer attacker"), ("session-id", session),
                ("x-mock-behaviour", json.dumps({"kind": "reset"})))
    for i in range(2):  # two eventless failures in the attacker's session: its circuit opens
        send_quietly(rig, Req(0, "reverse", attacker, turn(f"fence {i}")))
    fenced = send(rig, Req(0, "reverse", attacker[:2], turn("fenced")))
    assert fenced.status_code == 503  # the control: the attacker's own session is fenced
    victim = Req(0, "reverse", (("authorization", "Bearer victim"), ("session-id", session)),
                 turn("victim"))
    before = dispatches(rig, 0)
    resp = send(rig, victim)
    assert resp.status_code == 200 and dispatches(rig, 0) == before + 1


def test_a_circuit_opened_on_one_upstream_never_fences_the_other(rig):
    """Two eventless failures of a session's turn to U1 open that session's circuit there;
    the same key, session id and turn state sent to U2 (another upstream behind the same
    proxy) is another session, not fenced: it is dispatched to U2."""
    session = f"two-upstreams-{secrets.token_hex(4)}"
    key = (("authorization", "Bearer k"), ("session-id", session),
           ("x-codex-turn-state", "ts-two-upstreams"))
    failing = key + (("x-mock-behaviour", json.dumps({"kind": "reset"})),)
    body = turn("one upstream's circuit")
    for _ in range(2):
        send_quietly(rig, Req(0, "reverse", failing, body))
    fenced = send(rig, Req(0, "reverse", key, body))
    assert fenced.status_code == 503  # the control: U1's session cools down
    before = dispatches(rig, 1)
    resp = send(rig, Req(1, "reverse", key, body))
    assert resp.status_code == 200 and not replayed(resp)
    assert dispatches(rig, 1) == before + 1


def test_one_body_sent_to_two_upstreams_at_once_is_two_operations(rig):
    """The same request sent at the same moment to U1 and U2 (each slow upstream): neither is
    held as the other's duplicate nor answered with its bytes; each upstream runs it once."""
    slow = (("authorization", "Bearer k"), ("session-id", f"both-{secrets.token_hex(4)}"),
            ("x-mock-behaviour", json.dumps({"kind": "slow", "delay_ms": 1500})))
    body = turn("both upstreams at once")
    before = [dispatches(rig, 0), dispatches(rig, 1)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(lambda u: send(rig, Req(u, "reverse", slow, body)), (0, 1)))
    assert [a.status_code for a in answers] == [200, 200]
    assert not any(a.headers.get("x-turnguard") for a in answers)
    assert response_id(answers[0].content) != response_id(answers[1].content)
    assert [dispatches(rig, 0), dispatches(rig, 1)] == [before[0] + 1, before[1] + 1]


def test_a_key_that_modify_headers_injects_is_part_of_the_principal(tmp_path):
    """mitmproxy's ``modify_headers`` (a gateway injecting each team's key, chosen by a header
    that is no credential) runs in ``requestheaders``, before turnguard identifies a request
    in its ``request`` hook: the key injected is the principal's, so one team's identical
    request is never answered from another's recording. (Addons that change the request in
    their ``request`` hook, such as ``modify_body`` or ``map_remote``, run after turnguard.)"""
    rules = ["/~hq x-team:.a/authorization/Bearer sk-team-a",
             "/~hq x-team:.b/authorization/Bearer sk-team-b"]
    turn = {"model": "m", "input": "the same prompt", "stream": True}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, modify_headers=rules) as p:
        answers = [post_turn(p.url, {"x-team": team}, turn) for team in ("a", "b", "b")]
        assert [a[0] for a in answers] == [200, 200, 200]
        assert [a[1].get("x-turnguard") for a in answers] == [None, None, "replayed"]
        assert len(up.dispatches()) == 2
        assert all(d["authorization_present"] for d in up.dispatches())
        assert_no_traceback(p.log_text())


def test_requests_map_remote_sends_to_two_upstreams_never_share_a_recording(tmp_path):
    """mitmproxy's ``map_remote`` sends a request elsewhere in its ``request`` hook, after
    turnguard's: the upstream of a request's identity is where it will go, so the same body
    that ``map_remote`` sends to another upstream (here chosen by a header that is no part of
    the identity) is that upstream's operation, never answered from the first one's
    recording; a repeat to the same place is still replayed."""
    turn = {"model": "m", "input": "the same prompt", "stream": True}
    with MockUpstream(tmp_path, name="ua") as ua, MockUpstream(tmp_path, name="ub") as ub:
        rule = f"|~hq x-region:.b|127.0.0.1:{ua.port}|127.0.0.1:{ub.port}"
        with guarded(tmp_path, ua, map_remote=rule) as p:
            answers = [post_turn(p.url, headers, turn)
                       for headers in ({}, {"x-region": "b"}, {"x-region": "b"}, {})]
            assert [a[0] for a in answers] == [200] * 4
            assert [a[1].get("x-turnguard") for a in answers] \
                == [None, None, "replayed", "replayed"]
            assert (len(ua.dispatches()), len(ub.dispatches())) == (1, 1)
            assert response_id(answers[1][2]) == response_id(answers[2][2]) \
                != response_id(answers[0][2])
            assert_no_traceback(p.log_text())


def test_a_body_modify_body_rewrites_is_identified_as_it_goes_upstream(tmp_path):
    """mitmproxy's ``modify_body`` rewrites a request's body in its ``request`` hook, after
    turnguard's, by a rule whose filter may read what is no part of the identity (here a
    header): the body a request is identified by is the one that goes upstream, so the same
    body rewritten to ask for another model is that model's operation, never answered from
    the other's recording; a repeat of either is still replayed."""
    turn = {"model": "m-small", "input": "the same prompt", "stream": True}
    rule = "/~q & ~hq x-tier:.pro/m-small/m-big"  # (~q: the request only)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, modify_body=[rule]) as p:
        answers = [post_turn(p.url, headers, turn)
                   for headers in ({}, {"x-tier": "pro"}, {"x-tier": "pro"}, {})]
        assert [a[0] for a in answers] == [200] * 4
        models = [[d["response"].get("model") for _, d in parse_sse(a[2])
                   if isinstance(d, dict) and isinstance(d.get("response"), dict)][-1]
                  for a in answers]
        assert models == ["m-small", "m-big", "m-big", "m-small"]
        assert [a[1].get("x-turnguard") for a in answers] \
            == [None, None, "replayed", "replayed"]
        assert len(up.dispatches()) == 2
        assert_no_traceback(p.log_text())


def test_a_key_that_stickyauth_adds_is_part_of_the_principal(tmp_path):
    """mitmproxy's ``stickyauth`` gives a request without ``Authorization`` the last one seen
    for its host, in its ``request`` hook, after turnguard's: the principal is the key the
    request goes upstream with. A request sent on another key than the one its recording was
    made with is never answered from it; one sent on the same key is."""
    turn = {"model": "m", "input": "the same prompt", "stream": True}
    key = lambda k: {"authorization": f"Bearer sk-{k}"}  # noqa: E731
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, stickyauth="~q") as p:
        answers = [post_turn(p.url, h, b) for h, b in (
            (key("a"), turn),  # the key stickyauth keeps: a
            ({}, turn),  # goes upstream on key a: a's request
            (key("b"), {**turn, "input": "another prompt"}),  # the key it keeps: b
            ({}, turn),  # goes upstream on key b: b's request, not a's
        )]
        assert [a[0] for a in answers] == [200] * 4
        assert [a[1].get("x-turnguard") for a in answers] == [None, "replayed", None, None]
        assert len(up.dispatches()) == 3
        assert all(d["authorization_present"] for d in up.dispatches())
        assert_no_traceback(p.log_text())


def test_an_answer_map_local_gives_is_never_a_recording(tmp_path):
    """mitmproxy's ``map_local`` answers a request from a local file in its ``request`` hook,
    after turnguard's (here chosen by a header that is no part of the identity): that answer
    never went upstream and is no answer of the operation's, so it is never recorded nor
    replayed to a request that goes upstream."""
    turn = {"model": "m", "input": "the same prompt", "stream": False}
    canned = tmp_path / "canned.json"
    canned.write_text('{"object": "response", "id": "resp_canned", "status": "completed"}')
    rule = f"|~q & ~hq x-canned:.1|/v1/responses|{canned}"
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, map_local=[rule]) as p:
        answers = [post_turn(p.url, h, turn) for h in ({"x-canned": "1"}, {}, {})]
        assert [a[0] for a in answers] == [200] * 3
        assert [response_id(a[2]) == "resp_canned" for a in answers] == [True, False, False]
        assert [a[1].get("x-turnguard") for a in answers] == [None, None, "replayed"]
        assert len(up.dispatches()) == 1
        ends = [e for e in read_jsonl(tmp_path / "mitmdump-events.jsonl")
                if e["event"] == "outcome"]
        assert ends[0]["replayable"] is False
        assert ends[0]["not_replayable_reason"] == "answered by an addon, not by the upstream"
        assert_no_traceback(p.log_text())


def test_the_same_session_id_of_two_principals_is_two_durable_sessions(rig):
    session = f"shared-{secrets.token_hex(4)}"
    db = rig.ledger
    count = lambda: sqlite3.connect(db).execute("SELECT COUNT(*) FROM sessions").fetchone()[0]  # noqa: E731
    before = count()
    for who in ("alice", "bob"):
        assert send(rig, Req(0, "reverse", (("authorization", f"Bearer {who}"),
                                            ("session-id", session)), turn(who))).status_code == 200
    assert count() == before + 2


def send_quietly(rig: Rig, r: Req) -> int:
    try:
        return send(rig, r).status_code
    except httpx.HTTPError:
        return 0


# -----------------------------------------------------------------------------------------------
# 4. Content negotiation and Vary


def encoded_turn(rig: Rig, coding: str, accept: str, *, vary: str | None = None,
                 delay_ms: int = 0) -> tuple[Req, httpx.Response]:
    behaviour = {"kind": "ok", "content_encoding": coding, "delay_ms": delay_ms}
    if vary:
        behaviour["headers"] = {"vary": vary}
    r = Req(0, "reverse", (("accept-encoding", accept), ("x-tenant", "t1"),
                           ("x-mock-behaviour", json.dumps(behaviour))), turn(coding))
    first = send(rig, r)
    assert first.status_code == 200
    assert first.headers.get("content-encoding") == (None if coding == "identity" else coding)
    return r, first


def with_accept(r: Req, accept: str, **changes: str) -> Req:
    h = dict(r.headers)
    h["accept-encoding"] = accept
    h.update(changes)
    return replace(r, headers=tuple(h.items()))


def send_raw(rig: Rig, r: Req) -> tuple[int, dict, bytes]:
    """Send ``r`` and read the body as it came over the wire (content coding kept)."""
    h = {"content-type": "application/json", "accept": "text/event-stream", **dict(r.headers)}
    with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S, verify=default_tls()) as c:
        with c.stream("POST", rig.reverse_urls[r.upstream] + r.path, json=r.body, headers=h) as resp:
            return resp.status_code, dict(resp.headers), b"".join(resp.iter_raw())


def test_a_client_that_accepts_only_identity_gets_the_replay_decoded(rig):
    r, first = encoded_turn(rig, "gzip", "gzip")
    status, h, body = send_raw(rig, with_accept(r, "identity"))
    assert status == 200 and h.get("x-turnguard") == "replayed"
    assert "content-encoding" not in h and body == first.content  # httpx decoded the first
    # the same Accept-Encoding as the original: byte for byte as recorded
    status, h, body = send_raw(rig, r)
    assert h.get("content-encoding") == "gzip" and gzip.decompress(body) == first.content


def test_a_client_that_accepts_only_gzip_never_gets_br(rig):
    r, first = encoded_turn(rig, "br", "br")
    for accept, served in (("gzip", None), ("gzip, identity;q=0", "gzip")):
        status, h, body = send_raw(rig, with_accept(r, accept))
        assert status == 200 and h.get("x-turnguard") == "replayed"
        assert h.get("content-encoding") == served
        assert (gzip.decompress(body) if served else body) == first.content


def test_a_client_that_accepts_nothing_producible_is_forwarded(rig):
    r, first = encoded_turn(rig, "gzip", "gzip")
    before = dispatches(rig, 0)
    resp = send(rig, with_accept(r, "identity;q=0, compress"))
    assert not replayed(resp) and dispatches(rig, 0) == before + 1
    declined = wait_until(lambda: [e for e in rig.events("replay_declined")
                                   if "no content coding" in e["reason"]], 10, what="the event")
    assert declined


def test_vary_replays_only_to_the_same_values_and_vary_star_never(rig):
    r, first = encoded_turn(rig, "identity", "identity", vary="x-tenant")
    assert_replayed(rig, r, first)
    assert_fresh(rig, with_accept(r, "identity", **{"x-tenant": "t2"}), first)
    star, first = encoded_turn(rig, "identity", "identity", vary="*")
    assert_fresh(rig, star, first)


def test_a_held_duplicate_gets_the_recording_in_its_own_encoding(rig):
    behaviour = {"kind": "ok", "content_encoding": "gzip", "delay_ms": 1500}
    r = Req(0, "reverse", (("accept-encoding", "gzip"),
                           ("x-mock-behaviour", json.dumps(behaviour))), turn("held"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        before = dispatches(rig, 0)
        original = pool.submit(send_raw, rig, r)
        wait_until(lambda: dispatches(rig, 0) > before, 10, what="the original's dispatch")
        held = pool.submit(send_raw, rig, with_accept(r, "identity"))
        (s1, h1, b1), (s2, h2, b2) = original.result(), held.result()
    assert s1 == s2 == 200 and h1.get("content-encoding") == "gzip"
    assert h2.get("x-turnguard") == "replayed" and "content-encoding" not in h2
    assert b2 == gzip.decompress(b1) and dispatches(rig, 0) == before + 1


# -----------------------------------------------------------------------------------------------
# 5. Nothing secret from the URL at rest


def test_a_key_in_the_url_is_not_kept(tmp_path):
    secret_path = f"sk-PATH-{secrets.token_hex(8)}"
    secret_query = f"QUERY-{secrets.token_hex(8)}"
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path) as up:
        opts = {"turnguard_ledger": str(ledger), "turnguard_events": str(tmp_path / "ev.jsonl"),
                "turnguard_filter": "~m POST", "flow_detail": 0}
        with Mitmdump(tmp_path, up.url, options=opts) as p:
            path = f"/{secret_path}/v1/responses?key={secret_query}"
            h = {"content-type": "application/json", "accept": "text/event-stream"}
            with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S, verify=default_tls()) as c:
                first = c.post(p.url + path, json={"model": "m", "input": "k"}, headers=h)
                again = c.post(p.url + path, json={"model": "m", "input": "k"}, headers=h)
                other = c.post(p.url + "/sk-OTHER/v1/responses", json={"model": "m", "input": "k"},
                               headers=h)
            assert first.status_code == again.status_code == other.status_code == 200
            assert replayed(again) and not replayed(other)  # guarded, and the key isolates
            log = p.log_text()
        paths = {r[0] for r in sqlite3.connect(ledger).execute("SELECT path FROM operations")}
        assert paths == {"/v1/responses"}
        op = sqlite3.connect(ledger).execute("SELECT op_key FROM operations").fetchone()[0]
        cli = [subprocess.run([str(REPO / "scripts" / "ledger"), "--ledger", str(ledger), *args],
                              capture_output=True, text=True, timeout=120)
               for args in (["list"], ["show", op[:12]], ["stats"])]
        assert all(c.returncode == 0 for c in cli), [c.stderr for c in cli]
        blobs = {str(f): f.read_bytes() for f in tmp_path.glob("ledger.sqlite3*")}
        blobs["events"] = (tmp_path / "ev.jsonl").read_bytes()
        blobs["log"] = log.encode()
        blobs["scripts/ledger"] = "".join(c.stdout for c in cli).encode()
        for where, blob in blobs.items():
            for secret in (secret_path, secret_query):
                assert secret.encode() not in blob, f"{secret} is in {where}"


def test_the_default_filter_does_not_guard_a_route_after_a_key(rig):
    r = Req(0, "reverse", (("authorization", "Bearer k"),), turn("unanchored"),
            path=f"/sk-{secrets.token_hex(4)}/v1/responses")
    first = send(rig, r)
    before = dispatches(rig, 0)
    again = send(rig, r)
    assert first.status_code == again.status_code == 200
    assert not replayed(again) and dispatches(rig, 0) == before + 1


# -----------------------------------------------------------------------------------------------
# 6. Path tricks: the ledger and the events file


def start(tmp_path: Path, **options: str) -> subprocess.CompletedProcess:
    cmd = [str(MITMDUMP), "--listen-host", "127.0.0.1", "--listen-port", "0",
           "--set", f"confdir={tmp_path / 'confdir'}", "-s", str(ADDON)]
    for k, v in options.items():
        cmd += ["--set", f"{k}={v}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def shared_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)  # world-writable, not sticky
    return folder


def test_a_ledger_symlink_into_a_world_writable_folder_is_refused(tmp_path):
    target = shared_folder(tmp_path) / "ledger.sqlite3"
    link = tmp_path / "ledger.sqlite3"
    link.symlink_to(target)
    proc = start(tmp_path, turnguard_ledger=str(link))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "turnguard_ledger=" in out and "is refused" in out, out
    assert "world-writable" in out
    assert os.listdir(target.parent) == []  # no ledger, -wal or -shm created there


def test_an_events_symlink_is_refused_and_its_target_untouched(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    target = private / "victim.txt"
    target.write_text("precious\n")
    os.chmod(target, 0o644)
    link = tmp_path / "events.jsonl"
    link.symlink_to(target)
    proc = start(tmp_path, turnguard_ledger=str(tmp_path / "l.sqlite3"),
                 turnguard_events=str(link))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "turnguard_events=" in out and "is refused" in out, out
    assert "symbolic link" in out
    assert target.read_text() == "precious\n" and stat.S_IMODE(target.stat().st_mode) == 0o644


@pytest.mark.parametrize("case", ["world_writable_folder", "file_writable_by_others"])
def test_an_unsafe_events_path_is_refused(tmp_path, case):
    if case == "world_writable_folder":
        events = shared_folder(tmp_path) / "events.jsonl"
    else:
        events = tmp_path / "events.jsonl"
        events.write_text("")
        os.chmod(events, 0o666)
    proc = start(tmp_path, turnguard_ledger=str(tmp_path / "l.sqlite3"),
                 turnguard_events=str(events))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "turnguard_events=" in out and "is refused" in out, out
    assert "writable" in out
    if case == "world_writable_folder":
        assert not events.exists()


# -----------------------------------------------------------------------------------------------
# The property: any two requests that differ in upstream, principal, session or body never
# share a recording, whichever listener (reverse or regular mode) each goes through.

CREDENTIALS = ["authorization", "proxy-authorization", "cookie", "x-api-key", "api-key",
               "x-goog-api-key", "chatgpt-account-id", "openai-organization", "openai-project",
               EXTRA_CREDENTIAL]
DIMENSIONS = ["upstream", *CREDENTIALS, "session", "body", "url key"]
VALUE = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_=", min_size=1, max_size=10)


@st.composite
def request_pairs(draw, dim: str) -> tuple[Req, Req]:
    """A request ``a`` (upstream, listener, credentials, session, body drawn) and a request
    ``b`` that differs from it in ``dim`` only (and maybe in the listener it goes through)."""
    creds = draw(st.dictionaries(st.sampled_from(CREDENTIALS), VALUE, max_size=3))
    session = draw(st.none() | VALUE)
    headers = dict(creds)
    if session is not None:
        headers["session-id"] = session
    a = Req(draw(st.integers(0, 1)), draw(st.sampled_from(["reverse", "regular"])),
            tuple(headers.items()), {"model": "m", "input": draw(VALUE), "stream": True})
    b_headers = dict(headers)
    b = replace(a, via=draw(st.sampled_from(["reverse", "regular"])))
    if dim == "upstream":
        b = replace(b, upstream=1 - a.upstream)
    elif dim == "body":
        b = replace(b, body={**a.body, "input": a.body["input"] + " (changed)"})
    elif dim == "url key":
        b = replace(b, path=a.path + "?key=" + draw(VALUE))
    else:
        name = "session-id" if dim == "session" else dim
        if name in b_headers and draw(st.booleans()):
            del b_headers[name]  # present in one, absent in the other
        else:
            b_headers[name] = b_headers.get(name, "") + draw(VALUE)
        b = replace(b, headers=tuple(b_headers.items()))
    return a, b


@pytest.mark.parametrize("dim", DIMENSIONS)  # every dimension, every run: few examples each
@settings(max_examples=examples(3), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_two_requests_that_differ_never_share_a_recording(rig, dim, data):
    a, b = data.draw(request_pairs(dim))
    nonce = secrets.token_hex(6)  # not drawn: a re-run example is a new pair of operations
    a = replace(a, body={**a.body, "nonce": nonce})
    b = replace(b, body={**b.body, "nonce": nonce})
    first = send(rig, a)
    assert first.status_code == 200 and not replayed(first)
    assert_replayed(rig, a, first)  # the control
    b_first = assert_fresh(rig, b, first)
    assert_replayed(rig, b, b_first)  # b's own recording, not a's
    assert_replayed(rig, a, first)  # and a still gets its own


@pytest.mark.parametrize("listener", ["reverse after upstream", "upstream after reverse"])
def test_a_detached_dispatch_goes_where_its_own_listener_sends_it(tmp_path, listener):
    """With ``turnguard_detach_ms`` a guarded dispatch runs on turnguard's own flow through
    mitmproxy's client-replay handler, which takes its upstream proxy from the *first*
    ``--mode`` only. A request that came in on a reverse listener of a process whose first
    mode is ``upstream:`` must still go straight to its reverse target, and one that came in
    on an ``upstream:`` listener after a reverse one must go through its upstream proxy (the
    upstream its identity names, either way). The upstream proxy here is a port that accepts
    and closes, counting its connections."""
    import socket
    import threading

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    hole.settimeout(0.2)
    contacted: list[int] = []
    stop = threading.Event()

    def swallow() -> None:
        while not stop.is_set():
            try:
                conn, _ = hole.accept()
            except OSError:
                continue
            contacted.append(1)
            conn.close()

    thread = threading.Thread(target=swallow, daemon=True)
    thread.start()
    turn = {"model": "m", "input": "detached to its own upstream", "stream": True}
    try:
        with MockUpstream(tmp_path) as up:
            upstream_mode = f"upstream:http://127.0.0.1:{hole.getsockname()[1]}"
            reverse_first = listener == "upstream after reverse"
            modes = [f"reverse:{up.url}@127.0.0.1:0", f"{upstream_mode}@127.0.0.2:0"] \
                if reverse_first else \
                [f"{upstream_mode}@127.0.0.1:0", f"reverse:{up.url}@127.0.0.2:0"]
            proxy = Mitmdump(tmp_path, None, modes=modes, options={
                "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
                "turnguard_detach_ms": 60000})
            try:
                if reverse_first:  # the second listener is a proxy the client names
                    with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S,
                                      proxy=proxy.urls[1], verify=default_tls()) as c:
                        status = c.post(up.url + "/v1/responses", json=turn).status_code
                    assert (len(contacted), len(up.dispatches())) == (1, 0), \
                        f"status {status}: the call did not go through its upstream proxy"
                else:
                    status, _, body = post_turn(proxy.urls[1], {}, turn)
                    assert (status, len(contacted)) == (200, 0), \
                        f"status {status}, the other listener's upstream proxy contacted " \
                        f"{len(contacted)} times: {body[:200]!r}"
                    assert len(up.dispatches()) == 1
                assert_no_traceback(proxy.log_text())
            finally:
                proxy.stop()
    finally:
        stop.set()
        thread.join(timeout=5)
        hole.close()


LIVE_OPTIONS = Path(__file__).with_name("live_options.py")


def test_a_recording_made_before_a_header_is_named_a_credential_never_reaches_another_principal(
        tmp_path):
    """``turnguard_credential_headers`` changed in a running proxy (mitmweb's options, the
    console's ``:set``): a header named now (``x-tenant``) makes a request that carries it
    another principal than one that does not. A turn recorded before the change, for a request
    that carried ``x-tenant: alice``, must never be replayed after it to a request without the
    header (or with another value): under the names in force they are two principals."""
    turn = {"model": "m", "input": "a credential named while running", "stream": True}
    auth = {"authorization": "Bearer sk-shared-gateway-key"}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)]) as p:
        alice = post_turn(p.url, {**auth, "x-tenant": "alice"}, turn)
        assert alice[0] == 200 and alice[1].get("x-turnguard") is None
        r = httpx.post(p.url + "/__set", json=["turnguard_credential_headers=x-tenant"],
                       trust_env=False, timeout=20, verify=default_tls())
        assert r.status_code == 200, r.text
        answers = [post_turn(p.url, headers, turn)
                   for headers in (auth, {**auth, "x-tenant": "bob"}, auth)]
        assert [a[0] for a in answers] == [200, 200, 200]
        assert [a[1].get("x-turnguard") for a in answers] == [None, None, "replayed"]
        assert response_id(alice[2]) not in {response_id(a[2]) for a in answers}
        assert len(up.dispatches()) == 3
        assert_no_traceback(p.log_text())


def test_a_request_modify_body_rewrites_is_identified_as_it_is_sent(tmp_path):
    """mitmproxy's ``modify_body`` rewrites a request body in its ``request`` hook, after
    turnguard's; its rules can change while the proxy runs (mitmweb's options, ``:set``), and
    a rule's ``@file`` replacement is read again for each request. The same client body sent
    after the rule changed goes upstream as another body: it must be its own operation,
    never answered from the recording of what the old rule sent; sent again under the same
    rule, it is replayed."""
    turn = {"model": "m", "input": "SYSTEM-PROMPT: what is 2+2?", "stream": True}
    headers = {"authorization": "Bearer sk-modify-body"}
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)],
            modify_body=["/~q/SYSTEM-PROMPT/answer in English"]) as p:
        first = post_turn(p.url, headers, turn)
        r = httpx.post(p.url + "/__set",
                       json=["modify_body=/~q/SYSTEM-PROMPT/answer in French"],
                       trust_env=False, timeout=20, verify=default_tls())
        assert r.status_code == 200, r.text
        after, again = post_turn(p.url, headers, turn), post_turn(p.url, headers, turn)
        assert [a[0] for a in (first, after, again)] == [200, 200, 200]
        assert [a[1].get("x-turnguard") for a in (first, after, again)] \
            == [None, None, "replayed"]
        assert response_id(after[2]) != response_id(first[2])
        sent = [d["body_sha256"] for d in up.dispatches()]
        assert len(sent) == 2 and sent[0] != sent[1]
        assert_no_traceback(p.log_text())


def test_an_answer_map_local_gives_is_never_replayed_empty_nor_after_the_rule_is_gone(tmp_path):
    """mitmproxy's ``map_local`` answers a request from a local file in its ``request`` hook,
    after turnguard's (mitmproxy then emulates the ``responseheaders`` hook, with the whole
    body set already): no upstream ran it. A retry must get that file's bytes, never a 200
    with an empty body; and once the rule is gone (mitmweb's options, ``:set``), the same
    request goes to the upstream, never answered from what the local file said."""
    answer = tmp_path / "answer.json"
    answer.write_text(json.dumps({"id": "resp_local", "object": "response",
                                  "status": "completed", "output": []}))
    turn = {"model": "m", "input": "answered by a local file", "stream": False}
    headers = {"authorization": "Bearer sk-map-local", "accept": "application/json"}
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, extra_args=["-s", str(LIVE_OPTIONS)],
            map_local=[f"|/v1/responses|{answer}"]) as p:
        first, retry = post_turn(p.url, headers, turn), post_turn(p.url, headers, turn)
        assert [first[0], retry[0]] == [200, 200]
        assert response_id(first[2]) == response_id(retry[2]) == "resp_local", retry
        r = httpx.post(p.url + "/__set", json=["map_local"], trust_env=False, timeout=20, verify=default_tls())
        assert r.status_code == 200, r.text
        after = post_turn(p.url, headers, turn)
        assert after[0] == 200 and response_id(after[2]) not in (None, "resp_local"), after
        assert len(up.dispatches()) == 1
        assert_no_traceback(p.log_text())


def events_after(tmp_path: Path, outcomes: int) -> list[dict]:
    """The events of ``guarded``'s process once ``outcomes`` attempts ended (an attempt's
    outcome is written when its response hook ran, which may be after its client got the
    last byte)."""
    def read():
        events = read_jsonl(tmp_path / "mitmdump-events.jsonl")
        return events if sum(e["event"] == "outcome" for e in events) >= outcomes else None
    return wait_until(read, 20, what=f"{outcomes} outcomes")


def test_a_response_stream_another_addon_takes_over_is_never_recorded_incomplete(tmp_path):
    """Another addon loaded after turnguard sets ``flow.response.stream`` itself in its
    ``responseheaders`` hook (its own chunk filter): the body goes to the client through that
    filter, never through turnguard's tee. turnguard saw none of it, so it has no whole
    recording: the client's answer is the upstream's, and a retry goes upstream again rather
    than being replayed an empty body as if the upstream had sent it."""
    script = tmp_path / "own_stream.py"
    script.write_text(
        "def responseheaders(flow):\n"
        "    flow.response.stream = lambda chunk: chunk  # an addon's own chunk filter\n")
    turn = {"model": "m", "input": "a prompt streamed by another addon", "stream": False}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, extra_args=["-s", str(script)]) as p:
        answers = [post_turn(p.url, {}, turn) for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200]
        assert [response_id(a[2]) is not None for a in answers] == [True, True]
        assert answers[1][1].get("x-turnguard") != "replayed"
        assert len(up.dispatches()) == 2
        ends = [e for e in events_after(tmp_path, 2)
                if e["event"] == "outcome"]
        assert ends[0]["replayable"] is False
        assert_no_traceback(p.log_text())


def test_an_event_stream_another_addon_takes_over_is_neither_cut_nor_a_failure(tmp_path):
    """The same for an event stream: its events pass through the other addon's filter, unseen
    by turnguard. A stream that outlasts ``turnguard_response_created_timeout_ms`` is no
    silent upstream (turnguard cannot tell): it is never cut, its whole answer completes the
    attempt (no eventless failure for the retry circuit), and nothing is recorded."""
    script = tmp_path / "own_stream.py"
    script.write_text(
        "def responseheaders(flow):\n"
        "    flow.response.stream = lambda chunk: chunk  # an addon's own chunk filter\n")
    turn = {"model": "m", "input": "an event stream another addon streams", "stream": True}
    slow = {"kind": "ok", "events": 3, "gap_ms": 300}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, extra_args=["-s", str(script)],
                    turnguard_response_created_timeout_ms=200) as p:
        answers = [post_turn(p.url, {}, turn, behaviour=slow, cut_is_error=True)
                   for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200]
        assert [a[1].get("x-turnguard") for a in answers] == [None, None]
        assert len(up.dispatches()) == 2
        events = events_after(tmp_path, 2)
        assert [e for e in events if e["event"] in ("upstream_cut", "eventless_failure")] == []
        ends = [e for e in events if e["event"] == "outcome"]
        assert [(e["outcome"], e["replayable"]) for e in ends] == [("completed", False)] * 2
        assert_no_traceback(p.log_text())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "event_stream"])
def test_a_detached_call_whose_stream_another_addon_takes_over_never_answers_empty(
        tmp_path, stream):
    """With ``turnguard_detach_ms`` the call runs on turnguard's own flow, whose hooks other
    addons get too: one that sets ``flow.response.stream`` there takes the body past the tee
    that feeds the attached client. That client is then cut (it retries), never given a
    whole 200 with an empty body as if the upstream had answered nothing."""
    script = tmp_path / "own_stream.py"
    script.write_text(
        "def responseheaders(flow):\n"
        "    flow.response.stream = lambda chunk: chunk  # an addon's own chunk filter\n")
    turn = {"model": "m", "input": f"a detached call, stream {stream}", "stream": stream}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, extra_args=["-s", str(script)],
                    turnguard_detach_ms=2000) as p:
        status, _, body = post_turn(p.url, {}, turn)
        assert len(up.dispatches()) == 1
        assert (status, body) == (0, b"") or response_id(body) is not None, (status, body)
        ends = [e for e in events_after(tmp_path, 1)
                if e["event"] == "outcome"]
        assert [e["replayable"] for e in ends] == [False]
        assert_no_traceback(p.log_text())


def test_flows_read_from_a_saved_file_are_never_dispatched_nor_recorded(tmp_path):
    """``mitmdump -nr saved.mitm`` (or a file opened in mitmweb) runs the flows it reads
    through the addons' hooks: a flow saved with an error and no response reaches
    turnguard's ``request`` hook as if a client sent it. It goes nowhere (nothing is sent
    when a file is read): turnguard must not count it as a dispatch, write an attempt, claim
    a session or answer it, only leave it as it was saved."""
    saved = tmp_path / "flows.mitm"
    headers = {"session-id": "s-saved", "authorization": "Bearer sk-saved"}
    turn = {"model": "m", "input": "a turn whose upstream reset", "stream": True}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, "live", save_stream_file=str(saved)) as p:
        assert post_turn(p.url, headers, turn, behaviour={"kind": "reset"})[0] == 502
        assert len(up.dispatches()) == 1
    ledger = tmp_path / "read.sqlite3"
    events = tmp_path / "read-events.jsonl"
    done = subprocess.run(
        [str(MITMDUMP), "-n", "-r", str(saved), "-s", str(ADDON),
         "--set", f"confdir={tmp_path / 'read-confdir'}",
         "--set", f"turnguard_ledger={ledger}", "--set", f"turnguard_events={events}"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    read = [e["event"] for e in read_jsonl(events)] if events.exists() else []
    assert [e for e in read if e in ("dispatch", "outcome", "session_claimed",
                                     "eventless_failure", "replayed")] == [], read
    db = sqlite3.connect(ledger)
    try:
        assert db.execute("SELECT COUNT(*) FROM attempts").fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == 0
    finally:
        db.close()


def test_an_answer_server_replay_gives_is_never_the_upstreams(tmp_path):
    """mitmproxy's ``server_replay`` answers a request from a saved flow in its ``request``
    hook, after turnguard's: that answer went nowhere upstream. A flow saved through turnguard
    (``save_stream_file``) has no response body (turnguard streamed it), so such an answer
    comes with none: it is still the addon's answer, never an upstream that closed without
    an event (an eventless failure that opens the session's retry circuit and fails real
    turns closed), and never recorded or replayed."""
    saved = tmp_path / "saved.mitm"
    turn = {"model": "m", "input": "a turn answered from a saved flow", "stream": True}
    other = {"model": "m", "input": "a turn that is in no saved flow", "stream": True}
    with MockUpstream(tmp_path) as up:
        with guarded(tmp_path, up, "saving", ledger=tmp_path / "saving.sqlite3",
                     save_stream_file=str(saved)) as p:
            assert post_turn(p.url, {}, turn)[0] == 200
        with guarded(tmp_path, up, server_replay=[str(saved)], server_replay_reuse=True) as p:
            answers = [post_turn(p.url, {}, turn) for _ in range(3)]
            assert [a[0] for a in answers] == [200] * 3
            assert [a[1].get("x-turnguard") for a in answers] == [None] * 3
            assert len(up.dispatches()) == 1  # the saving run's only
            assert post_turn(p.url, {}, other)[0] == 200  # the session's circuit is closed
            assert len(up.dispatches()) == 2
            events = events_after(tmp_path, 4)
            assert [e for e in events if e["event"] in ("eventless_failure", "circuit_opened",
                                                        "fail_closed")] == []
            ends = [e for e in events if e["event"] == "outcome"]
            assert [(e["outcome"], e["not_replayable_reason"]) for e in ends] == [
                ("completed", "answered by an addon, not by the upstream")] * 3 + [
                ("completed", None)]
            assert_no_traceback(p.log_text())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "event_stream"])
def test_a_response_filter_an_addon_before_turnguard_sets_is_kept(tmp_path, stream):
    """An addon loaded before turnguard sets ``flow.response.stream`` to its own chunk filter
    (here one that redacts a word): turnguard must not replace it with its tee, or every
    client gets the bytes that addon exists to change. Its body passes unseen by turnguard,
    so it is never recorded or replayed (a replay would skip the filter too)."""
    script = tmp_path / "redact.py"
    script.write_text(
        "def responseheaders(flow):\n"
        "    flow.response.stream = lambda chunk: chunk.replace(b'hello', b'REDACTED')\n")
    turn = {"model": "m", "input": f"a filtered answer, stream {stream}", "stream": stream}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, addon=False,
                    extra_args=["-s", str(script), "-s", str(ADDON)]) as p:
        answers = [post_turn(p.url, {}, turn, cut_is_error=stream) for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200]
        assert [(b"hello" in a[2], b"REDACTED" in a[2]) for a in answers] == [(False, True)] * 2
        assert [a[1].get("x-turnguard") for a in answers] == [None, None]
        assert len(up.dispatches()) == 2
        ends = [e for e in events_after(tmp_path, 2)
                if e["event"] == "outcome"]
        assert [(e["outcome"], e["replayable"]) for e in ends] == [("completed", False)] * 2
        assert_no_traceback(p.log_text())

def test_a_key_a_script_after_turnguard_sets_never_shares_an_answer(tmp_path):
    """A script loaded after turnguard sets each request's ``Authorization`` by a tenant
    header that is no part of the identity (as a key-injecting gateway script would):
    turnguard identified both tenants' requests without a key, as one operation, but they go
    upstream as two principals. One tenant's answer must never be replayed to the other."""
    script = tmp_path / "inject_key.py"
    script.write_text(
        "def request(flow):\n"
        "    tenant = flow.request.headers.get('x-tenant', '')\n"
        "    flow.request.headers['authorization'] = 'Bearer sk-' + tenant\n")
    turn = {"model": "m", "input": "the same prompt from two tenants", "stream": False}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, extra_args=["-s", str(script)]) as p:
        answers = [post_turn(p.url, {"x-tenant": t}, turn) for t in ("alice", "bob")]
        assert [a[0] for a in answers] == [200, 200]
        assert [a[1].get("x-turnguard") for a in answers] == [None, None]
        assert len(up.dispatches()) == 2
        auths = [d.get("headers", {}).get("authorization") for d in up.dispatches()]
        ends = [e for e in events_after(tmp_path, 2)
                if e["event"] == "outcome"]
        assert [e["replayable"] for e in ends] == [False, False], (ends, auths)
        assert_no_traceback(p.log_text())


@pytest.mark.xfail(strict=True, reason="known defect, not fixed: turnguard streams every "
                   "guarded response through its tee, so mitmproxy's response hook (where "
                   "modify_body rewrites) has no body for a dispatch's answer; reading answers "
                   "that are no event stream whole would change what a client gets for an "
                   "upstream's broken framing (test_hostile.py), a choice left open")
def test_a_response_rule_of_modify_body_applies_to_the_first_answer_too(tmp_path):
    """mitmproxy's ``modify_body`` rewrites a response body in its ``response`` hook, which
    needs the body read whole (a streamed one has none there). The client of a dispatch gets
    the upstream's bytes unchanged, while its duplicates, replayed (their body is there), get
    them rewritten: two answers to one turn (and mitmweb and saved flows show no body)."""
    turn = {"model": "m", "input": "a turn whose answer a rule rewrites", "stream": False}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, modify_body=["|~s|hello|HOWDY"]) as p:
        answers = [post_turn(p.url, {}, turn) for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200]
        assert [(b"hello" in a[2], b"HOWDY" in a[2]) for a in answers] == [(False, True)] * 2
        assert [a[1].get("x-turnguard") for a in answers] == [None, "replayed"]
        assert len(up.dispatches()) == 1
        assert_no_traceback(p.log_text())


# -----------------------------------------------------------------------------------------------
# 7. The WebSocket transport: a socket's handshake is its calls' principal, upstream and session


def ws_frame(text: str, **extra) -> dict:
    """A ``response.create`` frame as Codex sends it (its session in the metadata too)."""
    meta = {"turn_id": "t-1", "session_id": "ws-iso",
            "x-codex-ws-stream-request-start-ms": str(secrets.randbelow(10**9))}
    return {"type": "response.create", "model": "m", "stream": True, "store": False,
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": text}]}],
            "client_metadata": meta, **extra}


def ws_url(rig: Rig, upstream: int = 0) -> str:
    return rig.reverse_urls[upstream]


async def ws_calls(url: str, headers: dict, frames: list[dict]) -> list[list[dict]]:
    """Each frame on one socket (``headers`` its handshake's), each response's events."""
    async with WsClient.connect(url, headers=headers) as c:
        got = []
        for frame in frames:
            await c.send(frame)
            got.append(await c.response())
        return got


def ws_dispatches(rig: Rig, upstream: int = 0) -> list[dict]:
    return [d for d in rig.ups[upstream].dispatches() if d.get("transport") == "ws"]


def last_id(events: list[dict]) -> str | None:
    return (events[-1].get("response") or {}).get("id")


WS_BASE = {"authorization": "Bearer ws-a", "session-id": "ws-iso"}
WS_CREDENTIAL_VARIANTS = [
    {"authorization": "Bearer ws-b"},
    {"cookie": "sid=b"},
    {"chatgpt-account-id": "acct-b"},
    {"openai-organization": "org-b"},
    {"sec-websocket-protocol": "key-b"},
    {EXTRA_CREDENTIAL: "tenant-b"},
    {"x_api_key": "k-b"},
]


@pytest.mark.parametrize("variant", WS_CREDENTIAL_VARIANTS, ids=lambda v: next(iter(v)))
def test_one_frame_on_sockets_differing_in_one_credential_runs_once_per_principal(rig, variant):
    """The same ``response.create`` on two sockets whose handshakes differ in one
    credential-bearing header (a configured one, one spelled with ``_``, a subprotocol) runs
    upstream for each; the control: a third socket with the first one's handshake shares."""
    frame = ws_frame(f"ws cred {secrets.token_hex(6)}")
    before = len(ws_dispatches(rig))
    (a,) = asyncio.run(ws_calls(ws_url(rig), WS_BASE, [frame]))
    (b,) = asyncio.run(ws_calls(ws_url(rig), {**WS_BASE, **variant}, [frame]))
    (again,) = asyncio.run(ws_calls(ws_url(rig), WS_BASE, [frame]))  # the control: shared
    assert a[-1]["type"] == b[-1]["type"] == "response.completed", (a[-1], b[-1])
    assert last_id(a) != last_id(b) and last_id(again) == last_id(a)
    assert len(ws_dispatches(rig)) == before + 2


def test_one_frame_to_two_upstreams_runs_on_each(rig):
    """The same frame with the same handshake through two reverse listeners of one process,
    to two upstreams: it runs on each; the control: again to the second shares."""
    frame = ws_frame(f"ws upstream {secrets.token_hex(6)}")
    before = [len(ws_dispatches(rig, 0)), len(ws_dispatches(rig, 1))]
    (a,) = asyncio.run(ws_calls(ws_url(rig, 0), WS_BASE, [frame]))
    (b,) = asyncio.run(ws_calls(ws_url(rig, 1), WS_BASE, [frame]))
    (again,) = asyncio.run(ws_calls(ws_url(rig, 1), WS_BASE, [frame]))  # the control: shared
    assert a[-1]["type"] == b[-1]["type"] == "response.completed"
    assert last_id(a) != last_id(b) and last_id(again) == last_id(b)
    assert [len(ws_dispatches(rig, 0)), len(ws_dispatches(rig, 1))] == \
        [before[0] + 1, before[1] + 1]


def test_a_post_fallback_of_another_principal_never_gets_a_socket_call(rig):
    """A socket's call and its HTTP POST fallback are one operation for the same principal
    (the control: replayed), never for another (run upstream, its own answer)."""
    frame = ws_frame(f"ws fallback {secrets.token_hex(6)}")
    (a,) = asyncio.run(ws_calls(ws_url(rig), WS_BASE, [frame]))
    body = {k: v for k, v in frame.items() if k != "type"}
    body["client_metadata"] = {k: v for k, v in frame["client_metadata"].items()
                               if not k.startswith("x-codex-ws")}
    mine = send(rig, Req(0, "reverse", tuple(WS_BASE.items()), body))
    assert mine.status_code == 200 and replayed(mine), "control: the same principal's fallback"
    other = Req(0, "reverse", (("authorization", "Bearer ws-b"), ("session-id", "ws-iso")), body)
    assert_fresh(rig, other, mine)


def test_a_delta_frame_naming_another_principals_response_is_never_rebuilt_from_it(rig):
    """B's socket sends a delta frame naming the response A's socket produced: B's socket
    knows no such response, so the frame goes upstream as B sent it (one input item, its
    ``previous_response_id``: the upstream refuses it), never rebuilt from A's input."""
    async def both():
        async with WsClient.connect(ws_url(rig), headers=WS_BASE) as a:
            await a.send(ws_frame(f"secret of a {secrets.token_hex(6)}"))
            first = await a.response()
            rid = last_id(first)
            async with WsClient.connect(ws_url(rig), headers={
                    **WS_BASE, "authorization": "Bearer ws-b"}) as b:
                delta = ws_frame("b continues", previous_response_id=rid)
                await b.send(delta)
                return rid, await b.response()

    rid, got = asyncio.run(both())
    last = ws_dispatches(rig)[-1]
    assert last["previous_response_id"] == rid and last["input_items"] == 1, last
    assert got[-1]["type"] == "error", got[-1]


@pytest.mark.parametrize("carrier", ["session-id", "x-codex-turn-metadata"])
def test_a_socket_of_another_principal_cannot_fence_or_take_a_session_by_its_id(tmp_path,
                                                                              carrier):
    """The attacker's two calls in the victim's session id fail eventless (the mock resets
    the first two dispatches of that session): the attacker's own circuit opens; the victim's
    socket naming the same session id (as a header or in Codex's turn metadata) still runs,
    and each principal's session is its own durable session."""
    session = f"ws-victim-{secrets.token_hex(4)}"
    scenario = {"sessions": {session: {"sequence": [{"kind": "reset"}, {"kind": "reset"}]}}}
    in_meta = {"x-codex-turn-metadata": json.dumps({"session_id": session})}
    carried = {"session-id": session} if carrier == "session-id" else in_meta
    attacker = {"authorization": "Bearer ws-attacker", "session-id": session}
    victim = {"authorization": "Bearer ws-victim", **carried}
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, turnguard_cooldown_ms=60000) as p:
        for i in range(2):
            (failed,) = asyncio.run(ws_calls(p.url, attacker, [ws_frame(f"fence {i}")]))
            assert failed[-1]["type"] in ("closed", "error"), failed[-1]
        (fenced,) = asyncio.run(ws_calls(p.url, attacker, [ws_frame("fenced")]))
        assert fenced[-1]["type"] == "error" and fenced[-1]["status"] == 503, fenced[-1]
        before = len(up.dispatches())
        (got,) = asyncio.run(ws_calls(p.url, victim, [ws_frame("victim")]))
        assert got[-1]["type"] == "response.completed", got[-1]
        assert len(up.dispatches()) == before + 1
        sessions = sqlite3.connect(tmp_path / "ledger.sqlite3").execute(
            "SELECT COUNT(*) FROM sessions").fetchone()[0]
        assert sessions == 2
        assert_no_traceback(p.log_text())


def test_a_retry_of_another_principal_never_attaches_to_a_detached_call(tmp_path):
    """With ``turnguard_detach_ms`` a call whose socket dropped runs on, for its retry to
    attach to: the same frame from another principal is its own call (run upstream), never
    attached to it nor held behind it; the control, the first principal's retry, attaches."""
    a_headers = {"authorization": "Bearer ws-a", "session-id": "ws-detach"}
    b_headers = {"authorization": "Bearer ws-b", "session-id": "ws-detach"}
    frame = ws_frame(f"detached {secrets.token_hex(6)}")
    scenario = {"sequence": [{"kind": "ok", "hold": "first"}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, \
            guarded(tmp_path, up, turnguard_detach_ms=60000) as p:
        async def run():
            async with WsClient.connect(p.url, headers=a_headers) as a:
                await a.send(frame)
                await asyncio.to_thread(up.wait_held, "first", 30)
                a.abort()
            (b,) = await ws_calls(p.url, b_headers, [frame])
            await asyncio.to_thread(up.release, "first")
            (retry,) = await ws_calls(p.url, a_headers, [frame])
            return b, retry

        b, retry = asyncio.run(run())
        assert b[-1]["type"] == "response.completed", b[-1]
        assert retry[-1]["type"] == "response.completed", retry[-1]
        assert last_id(b) != last_id(retry)
        assert len(up.dispatches()) == 2
        assert_no_traceback(p.log_text())


def test_a_socket_whose_host_names_another_site_is_another_upstream(tmp_path, monkeypatch):
    """With ``keep_host_header`` a reverse listener sends the client's ``Host`` upstream, and
    a virtual-hosting upstream serves another site for it: the same frame on a socket whose
    handshake names another host runs upstream again, never answered from the other's; the
    control: the same host shares."""
    frame = ws_frame(f"ws host {secrets.token_hex(6)}")

    def on_host(host: str):
        monkeypatch.setattr(turnguard_ws, "Request", lambda **kw: WsRequest(
            **{**kw, "host": host}))
        return asyncio.run(ws_calls(p.url, WS_BASE, [frame]))[0]

    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, keep_host_header=True) as p:
        a = on_host("site-a.example")
        b = on_host("site-b.example")
        again = on_host("site-b.example")
        assert a[-1]["type"] == b[-1]["type"] == "response.completed"
        assert last_id(a) != last_id(b) and last_id(again) == last_id(b)
        assert len(up.dispatches()) == 2
        assert_no_traceback(p.log_text())


def test_one_frame_on_sockets_whose_urls_carry_another_key_runs_once_per_principal(rig):
    """A key in the handshake's URL (a query parameter) is part of the principal, as a
    POST's is; the control: the same URL shares."""
    frame = ws_frame(f"ws url key {secrets.token_hex(6)}")

    async def on(path):
        async with WsClient.connect(ws_url(rig), path=path, headers=WS_BASE) as c:
            await c.send(frame)
            return await c.response()

    before = len(ws_dispatches(rig))
    a = asyncio.run(on("/v1/responses?api_key=ka"))
    b = asyncio.run(on("/v1/responses?api_key=kb"))
    again = asyncio.run(on("/v1/responses?api_key=kb"))
    assert last_id(a) != last_id(b) and last_id(again) == last_id(b)
    assert len(ws_dispatches(rig)) == before + 2


def test_a_call_of_another_principal_is_never_held_behind_nor_attached_to_a_socket_call(
        tmp_path):
    """A's call is held upstream (the mock holds it before its first event): the same frame
    on B's socket, and its POST fallback from C, run upstream at once, each its own answer,
    while A's is still held."""
    frame = ws_frame(f"held {secrets.token_hex(6)}")
    body = {k: v for k, v in frame.items() if k != "type"}
    body["client_metadata"] = {k: v for k, v in frame["client_metadata"].items()
                               if not k.startswith("x-codex-ws")}
    b_headers = {**WS_BASE, "authorization": "Bearer ws-b"}
    scenario = {"sequence": [{"kind": "ok", "hold": "first"}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as p:
        async def run():
            async with WsClient.connect(p.url, headers=WS_BASE) as a:
                await a.send(frame)
                await asyncio.to_thread(up.wait_held, "first", 30)
                (b,) = await ws_calls(p.url, b_headers, [frame])
                posted = await asyncio.to_thread(post_turn, p.url, {
                    **WS_BASE, "authorization": "Bearer ws-c", "accept": "text/event-stream"},
                    body)
                assert len(up.dispatches()) == 3
                await asyncio.to_thread(up.release, "first")
                return await a.response(), b, posted

        a, b, (status, _, posted) = asyncio.run(run())
        assert a[-1]["type"] == b[-1]["type"] == "response.completed"
        assert status == 200 and response_id(posted) not in (last_id(a), last_id(b))
        assert last_id(a) != last_id(b)
        assert_no_traceback(p.log_text())


def test_sockets_of_two_proxyauth_users_never_share_a_call(tmp_path):
    """mitmproxy's ``proxyauth`` takes the credential off the handshake (a reverse listener:
    ``Authorization``) and keeps the user in the flow's metadata: the same frame from two
    users runs upstream for each; the control: the first user again shares."""
    import base64
    frame = ws_frame(f"proxyauth {secrets.token_hex(6)}")

    def as_user(user: str):
        basic = base64.b64encode(f"{user}:pw".encode()).decode()
        return asyncio.run(ws_calls(p.url, {"authorization": f"Basic {basic}",
                                            "session-id": "ws-iso"}, [frame]))[0]

    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, proxyauth="any") as p:
        a, b, again = as_user("alice"), as_user("bob"), as_user("alice")
        assert a[-1]["type"] == b[-1]["type"] == "response.completed", (a[-1], b[-1])
        assert last_id(a) != last_id(b) and last_id(again) == last_id(a)
        assert len(up.dispatches()) == 2
        assert_no_traceback(p.log_text())
