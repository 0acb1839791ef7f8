"""End to end through TLS: turnguard in front of an ``https://`` upstream (the mock behind a TLS
front with a throwaway certificate, ``tls_front.py``), reached the ways real clients reach it:
regular mode (``CONNECT``, then TLS intercepted with mitmproxy's CA, which the client trusts),
reverse mode to ``https://``, several listeners. The Guarantees hold as over plain HTTP: one
upstream execution for duplicates, identical bytes, detached calls reach the same upstream the
same way (TLS, SNI), no traceback.

Assertions count what the upstream saw (dispatches, TLS connections and their SNI) and compare
what each client got; never timings."""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from harness import (
    PYTHON,
    REPO,
    MockUpstream,
    Mitmdump,
    _ServerProcess,
    assert_no_traceback,
    mock_behaviour,
    sse_event_types,
    turnguard_events,
    wait_until,
)
from turnguard_procs import Process, read_jsonl

import mitmdump_forks
import tls_front

HEADERS = {"authorization": "Bearer sk-test-tls", "session-id": "sess-tls"}
BODY = {"model": "gpt-test", "input": "over TLS", "stream": True}
# The silent-turn tests: turnguard_response_created_timeout_ms, and how long a silent turn stays
# silent. The timeout leaves a loaded machine seconds to carry a turn's first event (through
# mitmdump, the TLS front and the mock: 1.5 s was too short there, the turn that streams was
# cut, or the silent one before it reached the mock); the silence outlasts it by far.
CUT_MS = 5000
SILENT_MS = 30000


class TlsFront(_ServerProcess):
    """``tls_front.py`` in front of ``up``: ``url`` is ``https://127.0.0.1:PORT``; ``cert``
    is the certificate it shows (for ``ssl_verify_upstream_trusted_ca``)."""

    def __init__(self, tmp_path: Path, up: MockUpstream, name: str = "front",
                 h2: bool = False, max_streams: int | None = None):
        self.cert, key = tls_front.make_cert(tmp_path, name)
        self.log_path = tmp_path / f"{name}.jsonl"
        self.process = Process(
            [PYTHON, "-u", str(REPO / "tests" / "tls_front.py"), "--target", str(up.port),
             "--cert", str(self.cert), "--key", str(key), "--log", str(self.log_path),
             *(["--h2"] if h2 else []),
             *(["--max-streams", str(max_streams)] if max_streams is not None else [])],
            tmp_path / f"{name}.out", popen=mitmdump_forks.popen)
        m = self.process.wait_for_line(re.compile(tls_front.LINE), 20, "tls front")
        self.url, self.port = m.group(1), int(m.group(2))

    def connections(self) -> list[dict]:
        return [r for r in read_jsonl(self.log_path) if r["event"] == "connection"]


def tls_proxy(tmp_path: Path, front: TlsFront, modes: list[str], name: str = "mitmdump",
              **options) -> Mitmdump:
    opts = {"turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
            "turnguard_events": str(tmp_path / f"{name}-events.jsonl"),
            "ssl_verify_upstream_trusted_ca": str(front.cert), **options}
    return Mitmdump(tmp_path, None, modes=modes, options=opts, name=name)


def ca_of(proxy: Mitmdump) -> str:
    return str(proxy.confdir / "mitmproxy-ca-cert.pem")


async def stream_post(proxy_url: str | None, target: str, ca: str, *, headers=HEADERS,
                      body=BODY, behaviour: dict | None = None, delay_s: float = 0.0,
                      timeout: float = 30, http2: bool = False) -> dict:
    """POST ``target`` (an ``https://`` URL) through the proxy at ``proxy_url`` (regular
    mode; None: ``target`` is the proxy itself), trusting only ``ca``; read it as it comes."""
    await asyncio.sleep(delay_s)
    h = {"content-type": "application/json", "accept": "text/event-stream", **headers,
         **(mock_behaviour(**behaviour) if behaviour else {})}
    out: dict = {"error": None, "body": b""}
    tls = ssl.create_default_context(cafile=ca)
    async with httpx.AsyncClient(proxy=proxy_url, verify=tls, trust_env=False,
                                 timeout=timeout, http2=http2) as c:
        try:
            async with c.stream("POST", target, headers=h, json=body) as r:
                out["status"], out["headers"] = r.status_code, dict(r.headers)
                async for chunk in r.aiter_raw():
                    out["body"] += chunk
        except httpx.HTTPError as e:
            out["error"] = repr(e)
    return out


TURN_HEADERS = {"content-type": "application/json", "accept": "text/event-stream", **HEADERS}


def h2_client(proxy: Mitmdump, via: str | None = None) -> httpx.AsyncClient:
    """An HTTP/2 client of ``proxy`` trusting its CA (through it as a proxy: ``via``)."""
    return httpx.AsyncClient(trust_env=False, timeout=30, http2=True, proxy=via,
                             verify=ssl.create_default_context(cafile=ca_of(proxy)))


async def h2_turn(c: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    """POST the turn ``body`` on the client ``c`` with ``headers`` beside the usual ones, read
    as it comes: ``{"status", "body", "error"}`` (``error``: the client's error, or None)."""
    out: dict = {"error": None, "body": b""}
    try:
        async with c.stream("POST", url, json=body, headers={**TURN_HEADERS, **headers}) as r:
            out["status"] = r.status_code
            async for chunk in r.aiter_raw():
                out["body"] += chunk
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    return out


def dispatches(up: MockUpstream) -> int:
    return len(up.dispatches())


async def dropped_then_retried(connect, text: str, tmp_path: Path, up: MockUpstream
                               ) -> tuple[dict, list]:
    """A WebSocket call whose socket is dropped after its first event, then the same call
    on a new socket: the first event, and the retry's whole answer. The mock holds the call
    after that event (its behaviour's hold ``think``, ``hold_after_events`` 1) until the
    retry attached (order, not a retry that had to come within the call's thinking)."""
    from test_e2e_websocket import call, user

    attached = len(turnguard_events(tmp_path, kind="duplicate_attached"))
    async with connect() as a:
        await a.send(call([user(text)], seed=1))
        first = json.loads(await a.recv())
        a.abort()
    async with connect() as b:
        await b.send(call([user(text)], seed=2))
        try:
            await asyncio.to_thread(wait_until, lambda: len(turnguard_events(
                tmp_path, kind="duplicate_attached")) > attached, 30, what="the retry attached")
        finally:
            await asyncio.to_thread(up.release, "think")
        return first, await b.response()


# a turn its client gives up on (1 s without a byte): its first events at once, then 3 s of
# thinking (the client leaves then), then the rest of the stream at once
LEAVES = {"kind": "ok", "events": 4, "think_ms": 3000}


def left_then_retried(proxy_url: str | None, target: str, proxy: Mitmdump) -> dict:
    """A client that gives up on a turn mid-stream (its call detached), then its retry,
    answered 200 with the whole stream: the retry's answer."""
    gone = asyncio.run(stream_post(proxy_url, target, ca_of(proxy), timeout=1.0,
                                   behaviour=LEAVES))
    assert gone["error"] is not None, gone
    retry = asyncio.run(stream_post(proxy_url, target, ca_of(proxy)))
    assert retry["status"] == 200 and retry["error"] is None, (retry, proxy.log_text())
    assert sse_event_types(retry["body"])[-1] == "response.completed"
    return retry


def assert_ran_over_tls(up: MockUpstream, front: "TlsFront", proxy: Mitmdump, *,
                        times: int = 1) -> None:
    """``times`` upstream executions, every upstream connection TLS with the target's SNI,
    no traceback."""
    assert dispatches(up) == times
    assert {c["sni"] for c in front.connections()} == {"localhost"}, front.connections()
    assert_no_traceback(proxy.log_text())


def assert_detached_call_completed(tmp_path: Path) -> None:
    detached = wait_until(lambda: turnguard_events(tmp_path, kind="upstream_detached"),
                          what="upstream_detached")
    assert detached[0]["outcome"] == "completed"


SLOW = {"kind": "ok", "events": 8, "gap_ms": 250}
HELD = {"kind": "ok", "events": 8, "hold": "original", "hold_after_events": 2}


async def while_held(tmp_path: Path, up: MockUpstream, duplicate,
                     event: str = "duplicate_attached"):
    """Await ``duplicate`` (a coroutine: a client's duplicate of an original sent with
    ``HELD``) once the mock holds the original's stream, and release it once the proxy's
    events have an ``event`` (a duplicate attached; ``duplicate_held``: held): the duplicate
    finds the stream running however late it comes (order, not a duplicate placed within a
    2 s stream). Returns its result."""
    await asyncio.to_thread(up.wait_held, "original", 30)
    task = asyncio.ensure_future(duplicate)
    try:
        await asyncio.to_thread(wait_until, lambda: turnguard_events(
            tmp_path, kind=event) or task.done(), 30, what=f"a {event} event")
    finally:
        await asyncio.to_thread(up.release, "original")
    return await task


def test_regular_mode_connect_duplicates_attach_and_replay_over_tls(tmp_path):
    """A client of a regular-mode proxy (``CONNECT``, TLS intercepted) sends a streamed turn;
    a duplicate while it streams attaches (the relay), one after it is replayed: one upstream
    execution, identical bytes, every upstream connection TLS with the target's SNI."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, ["regular"]) as proxy:
        target = f"https://localhost:{front.port}/v1/responses"

        async def run():
            first = asyncio.create_task(stream_post(proxy.url, target, ca_of(proxy),
                                                    behaviour=HELD))
            dup = await while_held(tmp_path, up, stream_post(proxy.url, target, ca_of(proxy)))
            return await first, dup
        first, dup = asyncio.run(run())
        later = asyncio.run(stream_post(proxy.url, target, ca_of(proxy)))
        assert first["error"] is None and first["status"] == 200, first
        assert sse_event_types(first["body"])[-1] == "response.completed"
        assert dup["error"] is None and dup["status"] == 200, dup
        assert dup["headers"].get("x-turnguard") == "attached", dup["headers"]
        assert dup["body"] == first["body"]
        assert later["headers"].get("x-turnguard") == "replayed"
        assert later["body"] == first["body"]
        assert_ran_over_tls(up, front, proxy)


def test_regular_mode_a_detached_call_whose_client_left_goes_to_the_https_upstream(tmp_path):
    """With ``turnguard_detach_ms``, a regular-mode client (CONNECT, TLS intercepted) that
    gives up mid-stream leaves its call running on turnguard's own flow: it reaches the
    https upstream over TLS with the target's SNI, and the client's retry gets its answer
    without a second execution."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, ["regular"], turnguard_detach_ms=20000) as proxy:
        target = f"https://localhost:{front.port}/v1/responses"
        retry = left_then_retried(proxy.url, target, proxy)
        assert retry["headers"].get("x-turnguard") in ("attached", "replayed"), retry["headers"]
        assert_ran_over_tls(up, front, proxy)


def test_reverse_mode_to_https_detached_call_reaches_the_upstream_as_the_direct_one(tmp_path):
    """Reverse mode to ``https://localhost:PORT``: a direct call and a detached one both
    reach the upstream over TLS with SNI ``localhost``; a duplicate is answered once."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"],
                      turnguard_detach_ms=20000) as proxy:
        left_then_retried(None, proxy.url + "/v1/responses", proxy)
        assert_ran_over_tls(up, front, proxy)


def test_wss_a_detached_call_outlives_its_dropped_socket_and_reaches_the_https_upstream(tmp_path):
    """Codex over ``wss://`` to a reverse proxy in front of an https upstream: two sockets
    sending the same call make one dispatch; a socket dropped mid-call leaves its call
    running (detached, as turnguard's own POST over TLS, SNI the upstream's name) and the
    retry on a new socket attaches to it: one upstream execution per call."""
    from test_e2e_websocket import HEADERS as WS_HEADERS
    from turnguard_ws import WsClient, types

    thinking = {"default": {"kind": "ok", "hold": "think", "hold_after_events": 1, "events": 3}}
    with MockUpstream(tmp_path, thinking) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"],
                      turnguard_detach_ms=30000,
                      turnguard_response_created_timeout_ms=20000) as proxy:
        tls = ssl.create_default_context(cafile=ca_of(proxy))
        wss = f"https://127.0.0.1:{proxy.port}"

        def connect():
            return WsClient.connect(wss, headers=WS_HEADERS, ssl=tls,
                                    server_hostname="localhost")

        first, retried = asyncio.run(dropped_then_retried(connect, "think over TLS", tmp_path,
                                                          up))
        assert first["type"] == "response.created"
        assert types(retried)[-1] == "response.completed", retried
        assert retried[0] == first
        assert_detached_call_completed(tmp_path)
        assert_ran_over_tls(up, front, proxy)


@pytest.mark.parametrize("mode", ["reverse", "regular"])
def test_an_http2_upstream_over_alpn_gets_one_execution_per_turn(tmp_path, mode):
    """The https upstream speaks only HTTP/2 (ALPN ``h2``), and so does the client (mitmproxy
    offers the upstream ``h2`` only when its client negotiated it). A
    duplicate while the turn streams attaches, a client that leaves leaves its call
    detached, its retry gets it: one execution each, identical bytes, every request to the
    upstream over HTTP/2 with its SNI."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=True) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"
                                        if mode == "reverse" else "regular"],
                      turnguard_detach_ms=20000) as proxy:
        if mode == "reverse":
            via, url = None, f"https://127.0.0.1:{proxy.port}/v1/responses"
        else:
            via, url = proxy.url, f"https://localhost:{front.port}/v1/responses"

        async def run():
            first = asyncio.create_task(stream_post(via, url, ca_of(proxy), behaviour=HELD,
                                                    http2=True))
            dup = await while_held(tmp_path, up, stream_post(via, url, ca_of(proxy),
                                                             http2=True))
            return await first, dup
        first, dup = asyncio.run(run())
        assert first["status"] == 200 and first["error"] is None, (first, proxy.log_text())
        assert dup["status"] == 200 and dup["error"] is None, (dup, proxy.log_text())
        assert dup["headers"].get("x-turnguard") == "attached", dup["headers"]
        assert dup["body"] == first["body"]
        assert len(up.dispatches()) == 1
        body2 = {**BODY, "input": "left"}
        gone = asyncio.run(stream_post(via, url, ca_of(proxy), body=body2, timeout=1.0,
                                       behaviour=LEAVES, http2=True))
        assert gone["error"] is not None, gone
        retry = asyncio.run(stream_post(via, url, ca_of(proxy), body=body2,
                                        http2=True))
        assert retry["status"] == 200 and retry["error"] is None, (retry, proxy.log_text())
        assert sse_event_types(retry["body"])[-1] == "response.completed"
        assert len(up.dispatches()) == 2
        conns = front.connections()
        assert {(c["sni"], c["alpn"]) for c in conns} == {("localhost", "h2")}, conns
        assert len([r for r in read_jsonl(front.log_path) if r["event"] == "h2_request"]) == 2
        assert_no_traceback(proxy.log_text())


def curl(args: list[str], out: Path, body: dict = BODY, headers=HEADERS,
         behaviour: dict | None = None) -> subprocess.Popen:
    """curl POSTing ``body`` with ``args`` (its proxy, CA, URL); ``-i`` output to ``out``."""
    h = {**headers, "content-type": "application/json", "accept": "text/event-stream",
         **(mock_behaviour(**behaviour) if behaviour else {})}
    cmd = ["curl", "-sS", "-i", "-N", "--max-time", "30", "--noproxy", "", "-o", str(out),
           "--data-binary", json.dumps(body)]
    for k, v in h.items():
        cmd += ["-H", f"{k}: {v}"]
    return subprocess.Popen([*cmd, *args], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={"PATH": os.environ["PATH"]})


def split_answer(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_socks5_mode_duplicates_attach_and_reach_the_https_upstream_once(tmp_path):
    """A client of a ``socks5`` listener (curl ``--socks5-hostname``, TLS intercepted with
    mitmproxy's CA): a duplicate while the turn streams attaches (the relay), a later one is
    replayed: one upstream execution, identical bytes, SNI the target's name."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, ["socks5"]) as proxy:
        args = ["--socks5-hostname", f"127.0.0.1:{proxy.port}", "--cacert", ca_of(proxy),
                f"https://localhost:{front.port}/v1/responses"]
        outs = [tmp_path / f"curl-{i}.out" for i in range(3)]
        first = curl(args, outs[0], behaviour=SLOW)
        wait_until(lambda: up.dispatches(), 20, what="the first dispatch")
        wait_until(lambda: outs[0].exists() and b"response.created" in outs[0].read_bytes(),
                   20, what="the first event")
        dup = curl(args, outs[1])
        assert dup.wait(60) == 0 and first.wait(60) == 0, (dup.stderr.read(), proxy.log_text())
        assert curl(args, outs[2]).wait(60) == 0
        (s0, h0, b0), (s1, h1, b1), (s2, h2, b2) = (split_answer(o.read_bytes()) for o in outs)
        assert (s0, s1, s2) == (200, 200, 200)
        assert h1.get("x-turnguard") == "attached", h1
        assert h2.get("x-turnguard") == "replayed", h2
        assert b1 == b0 and b2 == b0
        assert sse_event_types(b0)[-1] == "response.completed"
        assert_ran_over_tls(up, front, proxy)


def test_upstream_mode_behind_a_proxy_duplicates_are_held_and_replayed_over_tls(tmp_path):
    """``upstream:`` mode in front of a corporate proxy (a plain mitmdump in regular mode) to
    an https upstream: a duplicate while the turn streams is held (the relay cannot stand in
    for the upstream proxy), then answered with the same bytes; the upstream ran it once,
    and every upstream connection went through the corporate proxy (its CONNECT)."""
    seen = tmp_path / "seen.py"
    seen.write_text("import logging\n"
                    "def http_connect(flow):\n"
                    "    logging.warning('corp CONNECT %s', flow.request.authority)\n")
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            Mitmdump(tmp_path, None, modes=["regular"], addon=seen, name="corp",
                     options={"ssl_verify_upstream_trusted_ca": str(front.cert)}) as corp, \
            tls_proxy(tmp_path, front, [f"upstream:{corp.url}"],
                      ssl_verify_upstream_trusted_ca=str(corp.confdir / "mitmproxy-ca-cert.pem"),
                      turnguard_detach_ms=20000) as proxy:
        target = f"https://localhost:{front.port}/v1/responses"

        async def run():
            first = asyncio.create_task(stream_post(proxy.url, target, ca_of(proxy),
                                                    behaviour=HELD))
            dup = await while_held(tmp_path, up, stream_post(proxy.url, target, ca_of(proxy)),
                                   event="duplicate_held")
            return await first, dup
        first, dup = asyncio.run(run())
        assert first["status"] == 200 and first["error"] is None, first
        assert dup["status"] == 200 and dup["error"] is None, dup
        assert dup["headers"].get("x-turnguard") == "replayed", dup["headers"]
        assert dup["body"] == first["body"]
        assert len(up.dispatches()) == 1
        assert corp.log_text().count("corp CONNECT localhost:") >= 1
        assert len(front.connections()) == corp.log_text().count("corp CONNECT localhost:")
        assert_no_traceback(proxy.log_text())


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_regular_mode_a_kept_alive_connection_after_an_attach_reaches_the_upstream(tmp_path,
                                                                                   http2):
    """One client connection through a CONNECT tunnel (kept alive) first gets a duplicate
    answered through the relay, then sends a new turn and a retry of the first: the new
    turn goes to the https upstream (over TLS, SNI the target's), the retry is replayed."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=http2) as front, \
            tls_proxy(tmp_path, front, ["regular"]) as proxy:
        target = f"https://localhost:{front.port}/v1/responses"
        h = {"content-type": "application/json", "accept": "text/event-stream", **HEADERS}

        async def run():
            first = asyncio.create_task(stream_post(proxy.url, target, ca_of(proxy),
                                                    behaviour=HELD, http2=http2))
            async with httpx.AsyncClient(proxy=proxy.url, trust_env=False, timeout=30,
                                         http2=http2,
                                         verify=ssl.create_default_context(
                                             cafile=ca_of(proxy))) as c:
                dup = await while_held(tmp_path, up, c.post(target, headers=h, json=BODY))
                new = await c.post(target, headers=h, json={**BODY, "input": "next turn"})
                again = await c.post(target, headers=h, json=BODY)
            return await first, dup, new, again
        first, dup, new, again = asyncio.run(run())
        assert dup.headers.get("x-turnguard") == "attached", dup.headers
        assert dup.content == first["body"]
        assert new.status_code == 200 and new.headers.get("x-turnguard") is None, new.headers
        assert sse_event_types(new.content)[-1] == "response.completed"
        assert again.headers.get("x-turnguard") == "replayed" and again.content == first["body"]
        assert len(up.dispatches()) == 2
        assert {c["sni"] for c in front.connections()} == {"localhost"}
        assert_no_traceback(proxy.log_text())


def test_regular_mode_a_detached_call_keeps_the_tunnels_sni_when_the_host_names_another(
        tmp_path):
    """A client tunnels to ``localhost:PORT`` (CONNECT, SNI ``localhost``) and names a
    virtual host in ``Host`` (a gateway that routes by it, behind a certificate of its own
    name). The detached call must reach the upstream as the direct call would: over the
    same TLS, SNI ``localhost``. It sent the ``Host`` header's name as SNI instead, which
    the upstream's certificate does not cover: the call failed where the direct one works."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, ["regular"], turnguard_detach_ms=20000) as proxy:
        target = f"https://localhost:{front.port}/v1/responses"
        vhost = {**HEADERS, "host": "gateway.test"}
        got = asyncio.run(stream_post(proxy.url, target, ca_of(proxy), headers=vhost))
        assert got["error"] is None and got["status"] == 200, (got, proxy.log_text())
        assert sse_event_types(got["body"])[-1] == "response.completed"
        assert_ran_over_tls(up, front, proxy)



def _post_through_tunnel(proxy: Mitmdump, port: int, sni: str, body: bytes) -> bytes:
    """POST ``body`` through a ``CONNECT`` tunnel to 127.0.0.1:``port``, TLS with the server
    name ``sni``, ``Host: gateway.test``: all that came back until the proxy closed."""
    import socket

    with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as raw:
        raw.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n"
                    .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += raw.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        with ssl.create_default_context(cafile=ca_of(proxy)).wrap_socket(
                raw, server_hostname=sni) as tls:
            tls.sendall(b"POST /v1/responses HTTP/1.1\r\nhost: gateway.test\r\n"
                        b"authorization: Bearer sk-test-tls\r\ncontent-type: application/json"
                        b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
    return answer


def test_regular_mode_two_server_names_to_one_address_are_two_upstreams(tmp_path):
    """A front that routes by the TLS server name sends two names to two sites, though they
    come to one address with one Host header: the same request through tunnels with two
    server names (mitmproxy gives each upstream connection the client's) is run once for
    each, never answered from the other name's recording."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, ["regular"], ssl_insecure=True) as proxy:
        body = json.dumps({"model": "m", "input": "two server names"}).encode()
        answers = [_post_through_tunnel(proxy, front.port, sni, body)
                   for sni in ("a.test", "b.test", "b.test")]
        heads = [a.partition(b"\r\n\r\n")[0].lower() for a in answers]
        assert all(h.startswith(b"http/1.1 200") for h in heads), heads
        assert [b"x-turnguard: replayed" in h for h in heads] == [False, False, True], heads
        assert dispatches(up) == 2
        assert {c["sni"] for c in front.connections()} == {"a.test", "b.test"}
        assert_no_traceback(proxy.log_text())


def test_wss_through_a_connect_tunnel_one_dispatch_per_call_and_a_detached_retry(tmp_path):
    """Codex over ``wss://`` through a regular-mode proxy (CONNECT, TLS intercepted): two
    sockets sending the same call make one dispatch; a socket dropped mid-call leaves its
    call detached (turnguard's own POST through the tunnel's upstream, over TLS, SNI the
    target's) and the retry on a new socket attaches to it."""
    from test_e2e_websocket import HEADERS as WS_HEADERS, call, user
    from turnguard_ws import WsClient, types

    # the same call stops after response.in_progress until its second socket's is held, the
    # dropped one after response.created until its retry attached (order, not a second
    # socket 0.5 s and a retry 0.3 s into 2 s of thinking)
    thinking = {"sequence": [
        {"kind": "ok", "hold": "same", "hold_after_events": 2, "events": 3},
        {"kind": "ok", "hold": "think", "hold_after_events": 1, "events": 3}],
        "default": {"kind": "ok", "events": 3}}
    with MockUpstream(tmp_path, thinking) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, ["regular"], turnguard_detach_ms=30000,
                      turnguard_response_created_timeout_ms=20000) as proxy:
        tls = ssl.create_default_context(cafile=ca_of(proxy))
        wss = f"https://localhost:{front.port}"

        def connect():
            return WsClient.connect(wss, headers=WS_HEADERS, ssl=tls, proxy=proxy.url)

        async def two_then_drop_then_retry():
            async def one(seed: int):
                async with connect() as c:
                    await c.send(call([user("same call")], seed=seed))
                    return await c.response()
            first = asyncio.ensure_future(one(1))
            await asyncio.to_thread(up.wait_held, "same", 30)
            second = asyncio.ensure_future(one(2))
            try:
                await asyncio.to_thread(wait_until, lambda: turnguard_events(
                    tmp_path, kind="duplicate_held") or second.done(), 30,
                    what="the second socket's call held")
            finally:
                await asyncio.to_thread(up.release, "same")
            both = [await first, await second]
            return both, *await dropped_then_retried(connect, "think over the tunnel",
                                                     tmp_path, up)

        (one_a, one_b), first, retried = asyncio.run(two_then_drop_then_retry())
        assert one_a == one_b and types(one_a)[-1] == "response.completed", (one_a, one_b)
        assert types(retried)[-1] == "response.completed", retried
        assert retried[0] == first
        assert_detached_call_completed(tmp_path)
        assert_ran_over_tls(up, front, proxy, times=2)


def test_two_listeners_a_detached_call_of_the_second_goes_its_own_way_over_tls(tmp_path):
    """``--mode upstream:CORP@A --mode regular@B``: a client of B (CONNECT to the https
    upstream) that leaves leaves a detached call that goes straight to the upstream as B's
    flows do (never through A's corporate proxy), over TLS with the target's SNI; its retry
    gets it. The same turn through A goes through the proxy: another upstream, no replay."""
    seen = tmp_path / "seen.py"
    seen.write_text("import logging\n"
                    "def http_connect(flow):\n"
                    "    logging.warning('corp CONNECT %s', flow.request.authority)\n")
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            Mitmdump(tmp_path, None, modes=["regular"], addon=seen, name="corp",
                     options={"ssl_verify_upstream_trusted_ca": str(front.cert)}) as corp:
        # the upstream's certificate, and the CA of the corporate proxy (which intercepts)
        trusted = tmp_path / "trusted.pem"
        trusted.write_bytes(front.cert.read_bytes()
                            + (corp.confdir / "mitmproxy-ca-cert.pem").read_bytes())
        with tls_proxy(tmp_path, front, [f"upstream:{corp.url}@127.0.0.1:0",
                                         "regular@127.0.0.2:0"],
                       ssl_verify_upstream_trusted_ca=str(trusted),
                       turnguard_detach_ms=20000) as proxy:
            two_listeners_over_tls(tmp_path, up, front, corp, proxy)


def two_listeners_over_tls(tmp_path, up, front, corp, proxy) -> None:
    target = f"https://localhost:{front.port}/v1/responses"
    retry = left_then_retried(proxy.urls[1], target, proxy)
    assert retry["headers"].get("x-turnguard") in ("attached", "replayed")
    assert len(up.dispatches()) == 1
    assert "corp CONNECT" not in corp.log_text()
    assert {c["sni"] for c in front.connections()} == {"localhost"}
    through = asyncio.run(stream_post(proxy.urls[0], target, ca_of(proxy)))
    assert through["status"] == 200 and through["headers"].get("x-turnguard") is None
    assert len(up.dispatches()) == 2
    assert corp.log_text().count("corp CONNECT localhost:") == 1
    assert_no_traceback(proxy.log_text())


@pytest.mark.parametrize("mode, silence", [("reverse", "before_headers"),
                                           ("reverse", "after_headers"),
                                           ("regular", "before_headers")])
def test_http2_upstream_a_silent_turn_cut_spares_the_turns_sharing_its_connection(tmp_path,
                                                                                  mode, silence):
    """An HTTP/2 client multiplexes two turns on one connection to an HTTP/2 upstream, which
    mitmproxy carries on one upstream connection: one turn streams, the other is silent.
    Cutting the silent one at ``turnguard_response_created_timeout_ms`` resets its stream
    alone (RST_STREAM upstream: the upstream sees its client leave) and answers it 502 (its
    stream reset once its headers went); the one that streams completes on the same
    connection, once. In regular mode the streams are in the client's ``CONNECT`` tunnel."""
    silent_behaviour = {"kind": f"stall_{silence}", "ms": SILENT_MS}
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=True) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"
                                        if mode == "reverse" else "regular"],
                      turnguard_response_created_timeout_ms=CUT_MS) as proxy:
        if mode == "reverse":
            url, via = f"https://127.0.0.1:{proxy.port}/v1/responses", None
        else:
            url, via = f"https://localhost:{front.port}/v1/responses", proxy.url

        async def run():
            async with h2_client(proxy, via) as c:
                def one(body, behaviour):
                    return h2_turn(c, url, body, mock_behaviour(**behaviour))
                streams = asyncio.create_task(one({**BODY, "input": "streams"},
                                                  {"kind": "ok", "events": 24, "gap_ms": 300}))
                # the second turn once the first one's upstream connection is up (sent while
                # mitmproxy still made it, on a loaded machine, it took a connection of its own)
                for _ in range(200):  # bounded: 10 s
                    if front.connections():
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                silent = await one({**BODY, "input": "silent"}, silent_behaviour)
                return await streams, silent
        streams, silent = asyncio.run(run())
        if silence == "before_headers":
            assert silent.get("status") == 502, silent
        else:
            assert silent.get("status") == 200 and silent["error"] is not None, silent
            assert "response.created" not in sse_event_types(silent["body"])
        assert streams["error"] is None, (streams, proxy.log_text())
        assert sse_event_types(streams["body"])[-1] == "response.completed", streams
        assert len(front.connections()) == 1  # the connection both streams share, never cut
        resets = [r for r in read_jsonl(front.log_path) if r["event"] == "h2_reset"]
        assert len(resets) == 1, resets
        silent_n = next(d["n"] for d in up.dispatches() if d["spec"].get("ms"))
        up.wait_for_record(lambda r: r.get("event") == "client_gone" and r["n"] == silent_n)
        assert len(up.dispatches()) == 2
        cut, = turnguard_events(tmp_path, kind="upstream_cut")
        assert cut["cut"] is True and cut["why_not"] is None, cut
        assert_no_traceback(proxy.log_text())


def test_reverse_mode_keeping_the_host_header_a_detached_call_keeps_the_modes_sni(tmp_path):
    """Reverse mode to ``https://localhost:PORT`` with ``keep_host_header``: the client's
    ``Host`` names the proxy (127.0.0.1:P). Its flow's upstream connection sends SNI
    ``localhost``; its detached call must too, not the proxy's address from ``Host``."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"],
                      keep_host_header=True, turnguard_detach_ms=20000) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"
        left_then_retried(None, url, proxy)
        assert_ran_over_tls(up, front, proxy)


def test_socks5_mode_a_detached_call_whose_client_left_reaches_the_https_upstream(tmp_path):
    """A ``socks5`` client that gives up mid-turn leaves its call detached (its listener's
    mode: straight to the upstream, over TLS with the target's SNI); its retry gets it."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up) as front, \
            tls_proxy(tmp_path, front, ["socks5"], turnguard_detach_ms=20000) as proxy:
        args = ["--socks5-hostname", f"127.0.0.1:{proxy.port}", "--cacert", ca_of(proxy),
                f"https://localhost:{front.port}/v1/responses"]
        gone = curl(["--max-time", "1", *args], tmp_path / "gone.out", behaviour=LEAVES)
        assert gone.wait(60) != 0  # curl gave up (its time limit)
        out = tmp_path / "retry.out"
        assert curl(args, out).wait(60) == 0
        status, headers, body = split_answer(out.read_bytes())
        assert status == 200 and headers.get("x-turnguard") in ("attached", "replayed")
        assert sse_event_types(body)[-1] == "response.completed"
        assert_ran_over_tls(up, front, proxy)


@pytest.mark.parametrize("mode", ["reverse", "regular"])
@pytest.mark.parametrize("h2", [False, True], ids=["http1_upstream", "h2_upstream"])
@pytest.mark.parametrize("behaviour", [{"kind": "reset"},
                                       {"kind": "partial", "events": 0, "end": "reset"}],
                         ids=["before_headers", "after_headers"])
def test_an_upstream_that_resets_a_turn_feeds_the_circuit_over_http2_as_over_http1(
        tmp_path, h2, behaviour, mode):
    """The upstream drops a turn before any event (before or after its headers): over
    HTTP/1.1 its connection breaks, over HTTP/2 it resets the turn's stream (RST_STREAM; the
    TLS front does so when the mock drops its request). mitmproxy words both HTTP/2 resets
    alike, "stream reset by client (...)", whichever side sent it; an upstream's reset is an
    upstream failure all the same: the eventless failure counts for the retry circuit, the
    client being still there, and is named as over HTTP/1.1."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=h2) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"
                                        if mode == "reverse" else "regular"],
                      turnguard_response_created_timeout_ms=20000) as proxy:
        if mode == "reverse":
            via, url = None, f"https://127.0.0.1:{proxy.port}/v1/responses"
        else:  # (the turn's stream in the client's CONNECT tunnel)
            via, url = proxy.url, f"https://localhost:{front.port}/v1/responses"
        out = asyncio.run(stream_post(via, url, ca_of(proxy), behaviour=behaviour,
                                      http2=True))
        assert out["error"] is not None or out.get("status") == 502, out
        failure, = wait_until(lambda: turnguard_events(tmp_path, kind="eventless_failure"),
                              20, what="the eventless failure")
        assert {(c["alpn"]) for c in front.connections()} == {"h2" if h2 else "http/1.1"}
        assert failure["counts_for_circuit"] is True, (failure["failure_class"], failure)
        assert failure["failure_class"] == ("upstream_closed_before_headers"
                                            if behaviour["kind"] == "reset"
                                            else "upstream_closed_after_headers"), failure
        assert len(up.dispatches()) == 1
        assert_no_traceback(proxy.log_text())


def test_an_http2_client_that_resets_its_turns_stream_is_no_upstream_failure(tmp_path):
    """The other side of the test above: an HTTP/2 client, its connection kept open, resets
    the stream of its turn while an HTTP/2 upstream thinks (mitmproxy's error is worded as for
    an upstream's reset): the client gave up, which says nothing of the upstream's health
    (``client_abort``, not counted for the circuit), and the upstream sees the stream reset."""
    from test_e2e_http2 import RawH2

    slow = {"kind": "stall_before_headers", "ms": 8000}
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=True) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"],
                      turnguard_response_created_timeout_ms=20000) as proxy:
        client = RawH2(proxy.port)
        try:
            client.post(1, "/v1/responses", json.dumps(BODY).encode(),
                        {**HEADERS, "content-type": "application/json",
                         "accept": "text/event-stream", **mock_behaviour(**slow)})
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=10)
            client.reset(1)
            failure, = wait_until(lambda: turnguard_events(tmp_path, kind="eventless_failure"),
                                  20, what="the eventless failure")
        finally:
            client.close()
        assert failure["failure_class"] == "client_abort", failure
        assert failure["counts_for_circuit"] is False, failure
        wait_until(lambda: [r for r in read_jsonl(front.log_path) if r["event"] == "h2_reset"],
                   10, what="the upstream stream reset")
        assert len(up.dispatches()) == 1
        assert_no_traceback(proxy.log_text())


def test_http2_a_turn_mitmproxy_queues_behind_the_upstreams_stream_limit_is_not_cut(tmp_path):
    """The HTTP/2 upstream allows one stream at a time (MAX_CONCURRENT_STREAMS 1): mitmproxy
    queues a second turn of the client's connection until the first one's stream ends. A
    queued turn has not reached the upstream, whose silence it cannot be: it is not cut at
    ``turnguard_response_created_timeout_ms`` (its timer starts again), and both turns
    complete, each dispatched once, without a cut (a cut there answered its client 502 and
    later still sent it upstream, when mitmproxy emptied its queue)."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=True, max_streams=1) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"],
                      turnguard_response_created_timeout_ms=CUT_MS) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"

        async def run():
            async with h2_client(proxy) as c:
                def one(body, behaviour):
                    return h2_turn(c, url, body, mock_behaviour(**behaviour))
                first = asyncio.create_task(one({**BODY, "input": "first"},
                                                {"kind": "ok", "events": 24, "gap_ms": 300}))
                await asyncio.to_thread(wait_until, lambda: up.dispatches(), 20)
                queued = await one({**BODY, "input": "queued"}, {"kind": "ok"})
                return await first, queued
        first, queued = asyncio.run(run())
        for out in (first, queued):
            assert out.get("status") == 200 and out["error"] is None, (out, proxy.log_text())
            assert sse_event_types(out["body"])[-1] == "response.completed", out
        assert not turnguard_events(tmp_path, kind="upstream_cut")
        assert len(up.dispatches()) == 2
        assert len(front.connections()) == 1
        assert_no_traceback(proxy.log_text())


@pytest.mark.parametrize("silence", ["before_headers", "after_headers"])
def test_http2_a_silent_turn_cut_with_a_duplicate_on_its_connection_is_retried_once(
        tmp_path, silence):
    """An HTTP/2 client sends a turn, then the same turn again on the same connection (the
    duplicate held, or attached once the original's headers came) to an HTTP/2 upstream that
    stays silent on the first: the original's stream is cut alone at
    ``turnguard_response_created_timeout_ms``, and the duplicate, an eventless failure being
    never shared, is run once more and completes: two dispatches, one connection, no
    traceback."""
    scenario = {"sequence": [{"kind": f"stall_{silence}", "ms": SILENT_MS}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, TlsFront(tmp_path, up, h2=True) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"],
                      turnguard_response_created_timeout_ms=CUT_MS) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"

        async def run():
            async with h2_client(proxy) as c:
                def one():
                    return h2_turn(c, url, BODY, {})
                original = asyncio.create_task(one())
                await asyncio.to_thread(wait_until, lambda: up.dispatches(), 20)
                dup = await one()
                return await original, dup
        original, dup = asyncio.run(run())
        assert original.get("status") == 502 or original["error"] is not None \
            or "response.completed" not in sse_event_types(original["body"]), original
        assert dup.get("status") == 200 and dup["error"] is None, (dup, proxy.log_text())
        assert sse_event_types(dup["body"])[-1] == "response.completed", dup
        assert len(up.dispatches()) == 2
        assert len(front.connections()) == 1
        cut, = turnguard_events(tmp_path, kind="upstream_cut")
        assert cut["cut"] is True, cut
        assert_no_traceback(proxy.log_text())


def test_http2_a_silent_turn_cut_after_a_script_reload_spares_the_turn_sharing_its_connection(
        tmp_path):
    """mitmproxy reloads turnguard's script while two turns share an HTTP/2 upstream
    connection, one silent: the new addon instance does the cut, of the silent turn's stream
    alone (reset upstream, 502 to its client), and the other turn completes on the same
    connection; its end is recorded by the new instance too."""
    from test_at_most_once import reloadable, reloaded, touch_to_reload

    script = reloadable(tmp_path)
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=True) as front, \
            Mitmdump(tmp_path, None, modes=[f"reverse:https://localhost:{front.port}"],
                     addon=script, options={
                         "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
                         "turnguard_events": str(tmp_path / "mitmdump-events.jsonl"),
                         "ssl_verify_upstream_trusted_ca": str(front.cert),
                         "turnguard_response_created_timeout_ms": 7000}) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"

        async def run():
            async with h2_client(proxy) as c:
                def one(body, behaviour):
                    return h2_turn(c, url, body, mock_behaviour(**behaviour))
                silent = asyncio.create_task(one({**BODY, "input": "silent"},
                                                 {"kind": "stall_before_headers", "ms": 20000}))
                await asyncio.to_thread(wait_until, lambda: up.dispatches(), 20)
                streams = asyncio.create_task(one({**BODY, "input": "streams"},
                                                  {"kind": "ok", "events": 40, "gap_ms": 300}))
                await asyncio.to_thread(wait_until, lambda: len(up.dispatches()) == 2, 20)
                await asyncio.to_thread(lambda: reloaded(proxy, touch_to_reload(proxy, script)))
                if turnguard_events(tmp_path, kind="upstream_cut"):  # (a very slow host)
                    pytest.skip("the cut came before the reload: not the case under test")
                return await silent, await streams
        silent, streams = asyncio.run(run())
        assert silent.get("status") == 502, silent
        assert streams["error"] is None, (streams, proxy.log_text())
        assert sse_event_types(streams["body"])[-1] == "response.completed", streams
        assert len(front.connections()) == 1
        assert len(up.dispatches()) == 2
        cut, = turnguard_events(tmp_path, kind="upstream_cut")
        assert cut["cut"] is True and cut["why_not"] is None, cut
        outcomes = wait_until(lambda: len(turnguard_events(tmp_path, kind="outcome")) == 2
                              and turnguard_events(tmp_path, kind="outcome"), 10,
                              what="both ends recorded")
        assert sorted(o["outcome"] for o in outcomes) == ["completed", "unknown"], outcomes
        assert_no_traceback(proxy.log_text())


SLOW_REQUEST_HOOK = '''
import asyncio


async def request(flow):
    if "x-slow-hook" in flow.request.headers:
        await asyncio.sleep(float(flow.request.headers["x-slow-hook"]))
'''


@pytest.mark.parametrize("h2", [True, False], ids=["h2_upstream", "http1_upstream"])
@pytest.mark.parametrize("then", ["answers", "silent"])
def test_a_turn_held_in_a_later_addons_request_hook_is_timed_from_when_it_goes_upstream(
        tmp_path, h2, then):
    """An addon loaded after turnguard keeps a turn in its own ``request`` hook for twice
    ``turnguard_response_created_timeout_ms``, on an HTTP/2 client connection whose upstream
    connection an earlier turn opened. The turn has not gone upstream meanwhile: no silence
    of the upstream, no cut (a cut of its HTTP/2 stream then acted only once the hook ended,
    after the request went upstream: the client got 502 and the turn's end was recorded as
    a cut while the upstream ran it, so the client's retry would run it twice). Its timeout
    runs from when it goes upstream: an upstream that answers completes it; one that stays
    silent has it cut then, once, before it answers anything."""
    slow = tmp_path / "slow_request_hook.py"
    slow.write_text(SLOW_REQUEST_HOOK)
    behaviour = {"kind": "ok"} if then == "answers" else {"kind": "stall_before_headers",
                                                          "ms": SILENT_MS}
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=h2) as front, \
            Mitmdump(tmp_path, None, modes=[f"reverse:https://localhost:{front.port}"],
                     extra_args=["-s", str(slow)], options={
                         "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
                         "turnguard_events": str(tmp_path / "mitmdump-events.jsonl"),
                         "ssl_verify_upstream_trusted_ca": str(front.cert),
                         "turnguard_response_created_timeout_ms": CUT_MS}) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"

        async def run():
            async with h2_client(proxy) as c:
                def one(body, extra):
                    return h2_turn(c, url, body, extra)
                first = await one({**BODY, "input": "opens the connection"}, {})
                held = await one({**BODY, "input": "held by a hook"},
                                 {"x-slow-hook": str(2 * CUT_MS / 1000), **mock_behaviour(**behaviour)})
                return first, held
        first, held = asyncio.run(run())
        assert first.get("status") == 200 and first["error"] is None, first
        outcomes = wait_until(lambda: len(turnguard_events(tmp_path, kind="outcome")) == 2
                              and turnguard_events(tmp_path, kind="outcome"), 10,
                              what="both ends recorded")
        assert len(up.dispatches()) == 2
        cuts = turnguard_events(tmp_path, kind="upstream_cut")
        if then == "answers":
            assert held.get("status") == 200 and held["error"] is None, (held, cuts)
            assert sse_event_types(held["body"])[-1] == "response.completed", held
            assert [o["outcome"] for o in outcomes] == ["completed", "completed"], outcomes
            assert not cuts, cuts
        else:
            assert held.get("status") == 502, held
            cut, = cuts
            assert cut["cut"] is True and cut["why_not"] is None, cut
            silent_n = next(d["n"] for d in up.dispatches() if d["spec"].get("ms"))
            up.wait_for_record(lambda r: r.get("event") == "client_gone" and r["n"] == silent_n)
        assert len(front.connections()) == 1
        assert_no_traceback(proxy.log_text())


def test_http2_detached_a_silent_turn_cut_spares_the_turn_sharing_its_client_connection(
        tmp_path):
    """With ``turnguard_detach_ms`` each turn's upstream call runs on a connection of
    turnguard's own (mitmproxy's replay handler): two turns of one HTTP/2 client connection to
    an HTTP/2 upstream, one silent, one streaming. The silent one's call is cut at
    ``turnguard_response_created_timeout_ms`` (its client told so: a 502), the other one
    completes, each dispatched once."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=True) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"],
                      turnguard_detach_ms=20000,
                      turnguard_response_created_timeout_ms=CUT_MS) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"

        async def run():
            async with h2_client(proxy) as c:
                def one(body, behaviour):
                    return h2_turn(c, url, body, mock_behaviour(**behaviour))
                streams = asyncio.create_task(one({**BODY, "input": "streams"},
                                                  {"kind": "ok", "events": 24, "gap_ms": 300}))
                await asyncio.to_thread(wait_until, lambda: up.dispatches(), 20)
                silent = await one({**BODY, "input": "silent"},
                                   {"kind": "stall_before_headers", "ms": SILENT_MS})
                return await streams, silent
        streams, silent = asyncio.run(run())
        assert silent.get("status") == 502 or silent["error"] is not None, silent
        assert "response.created" not in sse_event_types(silent["body"]), silent
        assert streams["error"] is None, (streams, proxy.log_text())
        assert sse_event_types(streams["body"])[-1] == "response.completed", streams
        silent_n = next(d["n"] for d in up.dispatches() if d["spec"].get("ms"))
        up.wait_for_record(lambda r: r.get("event") == "client_gone" and r["n"] == silent_n)
        assert len(up.dispatches()) == 2
        cut, = turnguard_events(tmp_path, kind="upstream_cut")
        assert cut["cut"] is True and cut["why_not"] is None, cut
        assert_no_traceback(proxy.log_text())


def test_a_detached_call_held_in_a_later_addons_request_hook_is_timed_once_it_goes_upstream(
        tmp_path):
    """With ``turnguard_detach_ms`` the turn's call is a flow of turnguard's own, run by
    mitmproxy's replay handler, whose ``request`` hook an addon loaded after turnguard keeps
    for twice ``turnguard_response_created_timeout_ms``: its timeout runs from when it goes
    upstream, where it stays silent: it is cut then (the upstream sees its client leave, the
    client gets a 502), never left running without a bound."""
    slow = tmp_path / "slow_request_hook.py"
    slow.write_text(SLOW_REQUEST_HOOK)
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=True) as front, \
            Mitmdump(tmp_path, None, modes=[f"reverse:https://localhost:{front.port}"],
                     extra_args=["-s", str(slow)], options={
                         "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
                         "turnguard_events": str(tmp_path / "mitmdump-events.jsonl"),
                         "ssl_verify_upstream_trusted_ca": str(front.cert),
                         "turnguard_detach_ms": 20000,
                         "turnguard_response_created_timeout_ms": CUT_MS}) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"
        held = asyncio.run(stream_post(None, url, ca_of(proxy), http2=True, headers={
            **HEADERS, "x-slow-hook": str(2 * CUT_MS / 1000)}, behaviour={"kind": "stall_before_headers",
                                                      "ms": SILENT_MS}))
        assert held.get("status") == 502 or held["error"] is not None, held
        assert "response.created" not in sse_event_types(held["body"]), held
        silent_n, = [d["n"] for d in up.dispatches()]
        up.wait_for_record(lambda r: r.get("event") == "client_gone" and r["n"] == silent_n)
        cut, = turnguard_events(tmp_path, kind="upstream_cut")
        assert cut["cut"] is True and cut["why_not"] is None, cut
        assert_no_traceback(proxy.log_text())


def test_http2_a_turn_queued_behind_a_silent_one_is_timed_from_when_it_goes_upstream(tmp_path):
    """The HTTP/2 upstream allows one stream at a time; a silent turn holds it and a second
    turn of the same client connection waits in mitmproxy's queue behind it. The silent one
    is cut at ``turnguard_response_created_timeout_ms``, which lets the queued one go
    upstream only then, a moment before its own timer is due: it is given the whole timeout
    from when it went upstream, and completes (its first event takes 0.6 s)."""
    with MockUpstream(tmp_path) as up, TlsFront(tmp_path, up, h2=True, max_streams=1) as front, \
            tls_proxy(tmp_path, front, [f"reverse:https://localhost:{front.port}"],
                      turnguard_response_created_timeout_ms=CUT_MS) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"

        async def run():
            async with h2_client(proxy) as c:
                def one(body, behaviour):
                    return h2_turn(c, url, body, mock_behaviour(**behaviour))
                silent = asyncio.create_task(one({**BODY, "input": "silent"},
                                                 {"kind": "stall_before_headers", "ms": SILENT_MS}))
                await asyncio.to_thread(wait_until, lambda: up.dispatches(), 20)
                queued = await one({**BODY, "input": "queued"},
                                   {"kind": "ok", "first_event_ms": 600})
                return await silent, queued
        silent, queued = asyncio.run(run())
        assert silent.get("status") == 502, silent
        assert queued.get("status") == 200 and queued["error"] is None, (queued,
                                                                          proxy.log_text())
        assert sse_event_types(queued["body"])[-1] == "response.completed", queued
        cut, = turnguard_events(tmp_path, kind="upstream_cut")
        assert len(up.dispatches()) == 2
        assert len(front.connections()) == 1
        assert_no_traceback(proxy.log_text())
