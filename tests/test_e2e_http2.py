"""HTTP/2 clients through a real ``mitmdump -s addon/turnguard.py`` in reverse mode.

mitmdump accepts TLS from the client with the CA of its own confdir (the harness gives each
mitmdump one in ``tmp_path``) and negotiates HTTP/2 by ALPN; the upstream is the bundled mock
over plain HTTP/1.1. The client is ``curl --http2 -k`` (one process per request, so each
request has its own connection), and every curl is bounded by ``--max-time`` and a process
timeout. Assertions count what the mock upstream saw and what each client got.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import socket
import ssl
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import (
    Mitmdump,
    MockUpstream,
    assert_no_traceback,
    metric,
    metrics_url,
    mock_behaviour,
    read_jsonl,
    scrape,
    sse_event_types,
    sse_post,
    wait_until,
)

SECRET = "sk-test-h2-SECRET-0123456789"
HEADERS = {
    "authorization": f"Bearer {SECRET}",
    "session-id": "sess-h2",
    "content-type": "application/json",
    "accept": "text/event-stream",
}
BODY = {"model": "gpt-test", "input": "write a haiku over HTTP/2", "stream": True}
CURL_MAX_S = 30
PROC_WAIT_S = CURL_MAX_S + 10


def _curl_with_http2() -> str | None:
    curl = shutil.which("curl")
    if curl is None:
        return None
    try:
        out = subprocess.run(
            [curl, "--version"], capture_output=True, text=True, timeout=10,
            stdin=subprocess.DEVNULL,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    features = next((ln for ln in out.splitlines() if ln.startswith("Features:")), "")
    return curl if "HTTP2" in features.split() else None


CURL = _curl_with_http2()
HAS_H2 = importlib.util.find_spec("h2") is not None

pytestmark = pytest.mark.skipif(
    CURL is None and not HAS_H2,
    reason="no HTTP/2 client: curl is missing or built without HTTP2 (see `curl --version`), "
    "and the h2 package is not installed for httpx",
)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    http_version: str  # "2" for HTTP/2


def _parse_header_dump(text: str) -> tuple[int, dict[str, str]]:
    """Status and lower-cased headers of the last response block of a ``curl -D`` dump."""
    blocks = [b for b in text.replace("\r\n", "\n").split("\n\n") if b.strip()]
    lines = blocks[-1].split("\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


class CurlH2:
    """One ``curl --http2`` process per request, its outputs in files under ``workdir``."""

    def __init__(self, workdir: Path, name: str, url: str, body: bytes, headers: dict[str, str]):
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        (self.dir / "request").write_bytes(body)
        cmd = [
            CURL, "-sS", "--http2", "-k", "--noproxy", "*", "--max-time", str(CURL_MAX_S),
            "-X", "POST", "--data-binary", f"@{self.dir / 'request'}",
            "-D", str(self.dir / "headers"), "-o", str(self.dir / "body"),
            "-w", "%{http_version}",
        ]
        for k, v in headers.items():
            cmd += ["-H", f"{k}: {v}"]
        cmd.append(url)
        with open(self.dir / "stdout", "wb") as out, open(self.dir / "stderr", "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)

    def result(self) -> Reply:
        try:
            rc = self.proc.wait(PROC_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"curl {self.dir.name} did not finish within {PROC_WAIT_S} s")
        stderr = (self.dir / "stderr").read_text(errors="replace")
        assert rc == 0, f"curl {self.dir.name} exited {rc}: {stderr}"
        status, headers = _parse_header_dump((self.dir / "headers").read_text(errors="replace"))
        return Reply(status, headers, (self.dir / "body").read_bytes(),
                     (self.dir / "stdout").read_text().strip())


class HttpxH2:
    """Fallback when curl has no HTTP/2: httpx with h2, run in a thread."""

    def __init__(self, workdir: Path, name: str, url: str, body: bytes, headers: dict[str, str]):
        import concurrent.futures

        import httpx

        def send() -> Reply:
            with httpx.Client(http2=True, verify=False, trust_env=False, timeout=CURL_MAX_S) as c:
                r = c.post(url, content=body, headers=headers)
                version = {"HTTP/2": "2"}.get(r.http_version, r.http_version)
                return Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()},
                             r.content, version)

        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._future = self._pool.submit(send)

    def result(self) -> Reply:
        try:
            reply = self._future.result(PROC_WAIT_S)
        finally:
            self._pool.shutdown(wait=False)
        if reply.http_version != "2":
            pytest.skip(
                "curl lacks HTTP2 and httpx negotiated "
                f"{reply.http_version} through mitmproxy (it offers http/1.1 first and "
                "mitmproxy follows the client's ALPN order): no HTTP/2 client available"
            )
        return reply


def h2_post(workdir: Path, name: str, proxy: Mitmdump, *, body: bytes | None = None,
            headers: dict[str, str] | None = None, path: str = "/v1/responses"):
    client = CurlH2 if CURL is not None else HttpxH2
    raw = body if body is not None else json.dumps(BODY).encode()
    return client(workdir, name, f"https://127.0.0.1:{proxy.port}{path}", raw, headers or HEADERS)


def guarded(tmp_path: Path, upstream: MockUpstream, **options) -> Mitmdump:
    opts = {
        "turnguard_ledger": str(tmp_path / "ledger.sqlite3"),
        "turnguard_events": str(tmp_path / "events.jsonl"),
        **options,
    }
    return Mitmdump(tmp_path, upstream.url, options=opts)


def events(tmp_path: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(tmp_path / "events.jsonl") if r.get("event") == kind]


def test_http2_original_and_three_http2_duplicates_dispatch_once(tmp_path, report):
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 3000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        original = h2_post(tmp_path, "original", proxy)
        # the original is upstream (stalled 3 s) before any duplicate is sent
        up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=15)
        dups = [h2_post(tmp_path, f"dup{i}", proxy) for i in range(3)]
        wait_until(lambda: len(events(tmp_path, "duplicate_held")) == 3, 15,
                   what="three HTTP/2 duplicates held")
        replies = [original.result()] + [d.result() for d in dups]

        assert [r.http_version for r in replies] == ["2"] * 4, "every client spoke HTTP/2"
        assert [r.status for r in replies] == [200] * 4
        assert len({r.body for r in replies}) == 1, "four byte-identical bodies"
        assert sse_event_types(replies[0].body)[-1] == "response.completed"
        assert len(up.dispatches()) == 1
        assert "x-turnguard" not in replies[0].headers
        # held while the original stalled, then attached to its stream
        assert [r.headers.get("x-turnguard") for r in replies[1:]] == ["attached"] * 3
        assert all(r.headers["content-type"].startswith("text/event-stream") for r in replies)
        assert len(events(tmp_path, "duplicate_attached")) == 3
        assert not events(tmp_path, "duplicate_rejected")
        assert not events(tmp_path, "passthrough")
        assert [e["outcome"] for e in events(tmp_path, "outcome")] == ["completed"]
        assert_no_traceback(proxy.log_text())
    report(
        "HTTP/2 (curl --http2, TLS to mitmdump): original stalled 3 s + 3 duplicates -> "
        f"upstream dispatches={len(up.dispatches())}, statuses={[r.status for r in replies]}, "
        f"versions={[r.http_version for r in replies]}, distinct bodies="
        f"{len({r.body for r in replies})}"
    )


def test_http2_request_with_a_non_json_body_passes_through(tmp_path):
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as proxy:
        reply = h2_post(tmp_path, "nonjson", proxy, body=b"this is not json {").result()
        assert reply.http_version == "2"
        assert reply.status == 400  # the upstream's answer to a body that is not JSON
        assert json.loads(reply.body)["error"]["type"] == "invalid_request_error"
        assert "x-turnguard" not in reply.headers
        (p,) = events(tmp_path, "passthrough")
        assert "JSON" in p["reason"]
        assert not events(tmp_path, "dispatch")  # forwarded unguarded, not as a guarded dispatch
        assert [r["event"] for r in up.records()].count("invalid_body") == 1
        assert_no_traceback(proxy.log_text())


@pytest.mark.skipif(CURL is None, reason="needs curl with HTTP2 for multiplexed streams")
def test_original_and_duplicate_multiplexed_on_one_http2_connection(tmp_path):
    """An async request hook holds only its own HTTP/2 stream: the duplicate waits on the
    same connection as its original, whose stream keeps flowing."""
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 1500}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"
        req = tmp_path / "request"
        req.write_bytes(json.dumps(BODY).encode())
        common = ["--http2", "-k", "--noproxy", "*", "--max-time", str(CURL_MAX_S),
                  "-X", "POST", "--data-binary", f"@{req}"]
        for k, v in HEADERS.items():
            common += ["-H", f"{k}: {v}"]
        cmd = [CURL, "-sS", "--parallel", "--parallel-max", "2",
               *common, "-D", str(tmp_path / "h0"), "-o", str(tmp_path / "b0"), url, "--next",
               *common, "-D", str(tmp_path / "h1"), "-o", str(tmp_path / "b1"), url]
        proc = subprocess.run(cmd, capture_output=True, timeout=PROC_WAIT_S,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        replies = []
        for i in (0, 1):
            status, headers = _parse_header_dump((tmp_path / f"h{i}").read_text())
            replies.append((status, headers, (tmp_path / f"b{i}").read_bytes()))
        log = proxy.log_text()
        assert log.count("client connect") == 1, "both streams on one HTTP/2 connection"
        assert [s for s, _, _ in replies] == [200, 200]
        assert replies[0][2] == replies[1][2]
        assert sorted(h.get("x-turnguard", "") for _, h, _ in replies) in (
            ["", "attached"], ["", "replayed"])  # live, or after the original's end
        assert len(up.dispatches()) == 1
        assert len(events(tmp_path, "duplicate_held")) == 1
        assert_no_traceback(log)


# ------------------------------------------------------------------------------------------------
# HTTP/2 clients that give up


@pytest.mark.skipif(CURL is None, reason="needs curl with HTTP2")
def test_http2_clients_that_give_up_do_not_open_the_retry_circuit(tmp_path):
    scenario = {
        "sequence": [{"kind": "slow", "delay_ms": 4000}, {"kind": "slow", "delay_ms": 4000}],
        "default": {"kind": "ok"},
    }
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        url = f"https://127.0.0.1:{proxy.port}/v1/responses"
        for i in range(2):  # two turns whose client gives up after 1 s (upstream needs 4 s)
            body = json.dumps({**BODY, "input": f"turn {i}"})
            cmd = [CURL, "-sS", "--http2", "-k", "--noproxy", "*", "--max-time", "1",
                   "-o", "/dev/null", "--data-binary", body, url]
            for k, v in HEADERS.items():
                cmd += ["-H", f"{k}: {v}"]
            rc = subprocess.run(cmd, capture_output=True, timeout=PROC_WAIT_S,
                                stdin=subprocess.DEVNULL).returncode
            assert rc == 28  # curl: operation timed out
        wait_until(lambda: len(events(tmp_path, "outcome")) == 2, 10, what="two outcomes")
        assert len(up.dispatches()) == 2
        reply = h2_post(tmp_path, "turn3", proxy,
                        body=json.dumps({**BODY, "input": "turn 3"}).encode()).result()
        assert reply.status == 200, f"healthy upstream, yet {reply.status}: {reply.body[:200]!r}"
        assert not events(tmp_path, "circuit_opened")
        assert all(e["failure_class"] == "client_abort"
                   for e in events(tmp_path, "eventless_failure"))


class RawH2:
    """A minimal HTTP/2 client (the ``h2`` package over TLS) that can reset one stream while
    keeping the connection open, which curl cannot do. Every socket read is bounded."""

    def __init__(self, port: int):
        import h2.config
        import h2.connection

        tls = ssl.create_default_context()
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
        tls.set_alpn_protocols(["h2"])
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock = tls.wrap_socket(raw, server_hostname="localhost")
        assert self.sock.selected_alpn_protocol() == "h2"
        self.port = port
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self._flush()
        self.ended: dict[int, str] = {}  # stream id -> "ended" | "reset"
        self.status: dict[int, int] = {}
        self.bodies: dict[int, bytes] = {}

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def post(self, stream_id: int, path: str, body: bytes, headers: dict[str, str],
             trailers: dict[str, str] | None = None, *, reset: bool = False) -> None:
        """Send a request on ``stream_id``; ``reset``: and reset the stream in the same write
        (one TLS record, which mitmproxy reads at once)."""
        import h2.errors

        hdrs = [(":method", "POST"), (":path", path), (":scheme", "https"),
                (":authority", f"127.0.0.1:{self.port}"), ("content-length", str(len(body)))]
        hdrs += list(headers.items())
        self.conn.send_headers(stream_id, hdrs)
        self.conn.send_data(stream_id, body, end_stream=not trailers)
        if trailers:
            self.conn.send_headers(stream_id, list(trailers.items()), end_stream=True)
        if reset:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        self._flush()

    def reset(self, stream_id: int) -> None:
        import h2.errors

        self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        self._flush()

    def pump(self, until, timeout: float) -> None:
        """Read and answer frames until ``until()`` is true or ``timeout`` passes."""
        import h2.events

        deadline = time.monotonic() + timeout
        self.sock.settimeout(0.2)
        while not until() and time.monotonic() < deadline:
            try:
                data = self.sock.recv(65536)
            except (socket.timeout, TimeoutError):
                continue
            if not data:
                break
            for ev in self.conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    self.status[ev.stream_id] = int(dict(ev.headers)[b":status"])
                elif isinstance(ev, h2.events.DataReceived):
                    self.bodies[ev.stream_id] = self.bodies.get(ev.stream_id, b"") + ev.data
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    self.ended[ev.stream_id] = "ended"
                elif isinstance(ev, h2.events.StreamReset):
                    self.ended[ev.stream_id] = "reset"
            self._flush()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.skipif(not HAS_H2, reason="needs the h2 package for a raw HTTP/2 client")
def test_a_held_http2_duplicate_whose_stream_is_reset_is_never_forwarded(tmp_path):
    scenario = {"sequence": [{"kind": "stall_after_headers", "ms": 2000}],
                "default": {"kind": "ok"}}
    body = json.dumps(BODY).encode()
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        client = RawH2(proxy.port)
        try:
            client.post(1, "/v1/responses", body, HEADERS)
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=10)
            client.post(3, "/v1/responses", body, HEADERS)  # same connection, same turn
            (held,) = wait_until(lambda: events(tmp_path, "duplicate_held"), 10,
                                 what="the duplicate held")
            client.reset(3)  # the client gives up on the duplicate; the connection stays open
            client.pump(lambda: 1 in client.ended, timeout=15)  # the original ends (cut)
            wait_until(
                lambda: [e for e in read_jsonl(tmp_path / "events.jsonl")
                         if e.get("flow") == held["flow"]
                         and e["event"] in ("hold_abandoned", "duplicate_forwarded",
                                            "duplicate_replayed", "duplicate_rejected")],
                10, what="the held duplicate's fate",
            )
        finally:
            client.close()
        assert len(up.dispatches()) == 1
        dup = [e for e in read_jsonl(tmp_path / "events.jsonl") if e.get("flow") == held["flow"]]
        assert not [e for e in dup if e["event"] in ("dispatch", "duplicate_forwarded")], dup
        assert [e for e in dup if e["event"] == "hold_abandoned"]


def test_a_detached_http2_call_answers_its_http2_client_and_its_duplicate(tmp_path):
    """turnguard_detach_ms with HTTP/2 clients: the call runs on turnguard's own flow (the
    upstream speaks HTTP/1.1), the client's stream and a duplicate's are answered from it
    through the relay, byte for byte; one upstream execution."""
    scenario = {"sequence": [{"kind": "ok", "events": 6, "gap_ms": 300}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(
            tmp_path, up, turnguard_detach_ms=30000) as proxy:
        original = h2_post(tmp_path, "original", proxy)
        up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=15)
        dup = h2_post(tmp_path, "dup", proxy)
        replies = [original.result(), dup.result()]
        assert [r.http_version for r in replies] == ["2", "2"]
        assert [r.status for r in replies] == [200, 200]
        assert replies[0].body == replies[1].body
        assert sse_event_types(replies[0].body)[-1] == "response.completed"
        assert len(up.dispatches()) == 1
        assert replies[1].headers.get("x-turnguard") == "attached"


@pytest.mark.skipif(CURL is None, reason="needs curl with HTTP2 (an upload of unknown length)")
def test_an_http2_duplicate_without_a_content_length_attaches_and_gets_the_whole_stream(
        tmp_path):
    """An HTTP/2 request body may come with no Content-Length (``curl -T -``, any client
    streaming its body): mitmproxy sends it on to the relay as HTTP/1.1 with no length. Those
    bytes are the request's, not the peer leaving: the duplicate gets the same complete
    stream as the original, from one upstream execution."""
    scenario = {"sequence": [{"kind": "ok", "events": 8, "gap_ms": 250}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        original = h2_post(tmp_path, "original", proxy)
        up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=15)
        cmd = [CURL, "-sS", "--http2", "-k", "--noproxy", "*", "--max-time", str(CURL_MAX_S),
               "-X", "POST", "-T", "-", "-D", str(tmp_path / "dup-headers")]
        for k, v in HEADERS.items():
            cmd += ["-H", f"{k}: {v}"]
        cmd.append(f"https://127.0.0.1:{proxy.port}/v1/responses")
        dup = subprocess.run(cmd, input=json.dumps(BODY).encode(), capture_output=True,
                             timeout=PROC_WAIT_S)
        first = original.result()
        assert dup.returncode == 0, dup.stderr.decode(errors="replace")
        status, headers = _parse_header_dump((tmp_path / "dup-headers").read_text())
        assert status == 200 and headers.get("x-turnguard") == "attached"
        assert dup.stdout == first.body
        assert sse_event_types(first.body)[-1] == "response.completed"
        assert len(up.dispatches()) == 1
        assert_no_traceback(proxy.log_text())


@pytest.mark.skipif(CURL is None, reason="needs curl with HTTP2 (an upload of unknown length)")
def test_an_http2_call_without_a_content_length_reaches_an_http1_upstream_with_its_body(
        tmp_path):
    """An HTTP/2 request body may come with no Content-Length (``curl -T -``, any client
    streaming its body). The upstream here speaks HTTP/1.1, and mitmproxy sends it such a
    request with neither a Content-Length nor a Transfer-Encoding: to the upstream that is a
    request without a body. A guarded call must reach the upstream whole, once, and its
    duplicate (with a length) get the same answer."""
    import hashlib

    scenario = {"sequence": [{"kind": "ok", "events": 6, "gap_ms": 250}],
                "default": {"kind": "ok"}}
    raw = json.dumps(BODY).encode()
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        cmd = [CURL, "-sS", "--http2", "-k", "--noproxy", "*", "--max-time", str(CURL_MAX_S),
               "-X", "POST", "-T", "-", "-D", str(tmp_path / "original-headers"),
               "-w", "%{http_version}", "-o", str(tmp_path / "original-body")]
        for k, v in HEADERS.items():
            cmd += ["-H", f"{k}: {v}"]
        cmd.append(f"https://127.0.0.1:{proxy.port}/v1/responses")
        original = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        out, err = original.communicate(raw, timeout=PROC_WAIT_S)
        assert original.returncode == 0, err.decode(errors="replace")
        assert out.decode().strip() == "2", "the client spoke HTTP/2"
        status, _ = _parse_header_dump((tmp_path / "original-headers").read_text())
        body = (tmp_path / "original-body").read_bytes()
        assert status == 200, body[:300]
        assert sse_event_types(body)[-1] == "response.completed"
        assert not [r for r in up.records() if r.get("event") == "invalid_body"]
        (dispatch,) = up.dispatches()
        assert dispatch["body_sha256"] == hashlib.sha256(raw).hexdigest()
        dup = h2_post(tmp_path, "dup", proxy).result()
        assert dup.status == 200 and dup.body == body
        assert dup.headers.get("x-turnguard") == "replayed"
        assert len(up.dispatches()) == 1
        assert_no_traceback(proxy.log_text())


@pytest.mark.skipif(not HAS_H2, reason="needs the h2 package for a raw HTTP/2 client")
def test_an_http2_duplicate_with_request_trailers_attaches_without_a_traceback(tmp_path):
    """A duplicate whose HTTP/2 request ends with trailers (HEADERS after its DATA) is
    attached: turnguard routes it to its relay, which speaks HTTP/1.1 and drops the request's
    body. The trailers have nowhere to go there (mitmproxy's HTTP/1 client raises on them):
    the duplicate gets the original's stream and mitmdump prints no traceback."""
    scenario = {"sequence": [{"kind": "ok", "events": 8, "gap_ms": 250}],
                "default": {"kind": "ok"}}
    body = json.dumps(BODY).encode()
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        original, dup = RawH2(proxy.port), RawH2(proxy.port)
        try:
            original.post(1, "/v1/responses", body, HEADERS)
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=10)
            dup.post(1, "/v1/responses", body, {**HEADERS, "te": "trailers"},
                     trailers={"x-client-checksum": "abc"})
            original.pump(lambda: 1 in original.ended, timeout=20)
            dup.pump(lambda: 1 in dup.ended, timeout=20)
        finally:
            original.close()
            dup.close()
        assert original.ended == dup.ended == {1: "ended"}
        assert original.status == dup.status == {1: 200}
        assert dup.bodies[1] == original.bodies[1]
        assert sse_event_types(dup.bodies[1])[-1] == "response.completed"
        assert len(up.dispatches()) == 1
        assert len(events(tmp_path, "duplicate_attached")) == 1
        assert_no_traceback(proxy.log_text())


# ------------------------------------------------------------------------------------------------
# The cooldown storm over one HTTP/2 connection


@pytest.mark.skipif(not HAS_H2, reason="needs the h2 package")
def test_http2_streams_reset_while_the_proxy_is_paused_never_win_the_one_recovery(tmp_path):
    """Once mode: six streams of one HTTP/2 connection hold the anchored turn through its
    cooldown; the process is paused (SIGSTOP) across the cooldown's end and the client resets
    every stream meanwhile. Resumed, turnguard must let them all go (their resets are read
    only once mitmproxy's connection task has run): no recovery dispatch for clients that
    left, so the turn's next retry still gets its one recovery."""
    cooldown_ms = 3000
    storm = {"sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
             "default": {"kind": "ok", "events": 4}}
    anchored = {**HEADERS, "x-codex-turn-state": "ts_h2_storm"}
    body = json.dumps(BODY).encode()
    with MockUpstream(tmp_path, storm) as up, guarded(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once",
        turnguard_response_created_timeout_ms=600, turnguard_cooldown_ms=cooldown_ms,
    ) as proxy:
        for _ in range(2):  # two eventless failures of the turn: its circuit opens
            h2_post(tmp_path, f"failure-{_}", proxy, headers=anchored).proc.wait(PROC_WAIT_S)
        wait_until(lambda: events(tmp_path, "circuit_opened"), 10, what="the circuit opened")
        client = RawH2(proxy.port)
        streams = [1, 3, 5, 7, 9, 11]
        try:
            for sid in streams:
                client.post(sid, "/v1/responses", body, anchored)
            wait_until(lambda: len(events(tmp_path, "wait_operation_fenced_cooldown")) == 6,
                       10, what="six streams held through the cooldown")
            proxy.proc.send_signal(signal.SIGSTOP)
            try:
                for sid in streams:
                    client.reset(sid)
                time.sleep(cooldown_ms / 1000 + 1)  # past the cooldown's end
            finally:
                proxy.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: len(events(tmp_path, "hold_abandoned")) == 6
                       or events(tmp_path, "recovery_claimed"), 15,
                       what="every reset stream let go, or one recovering")
        finally:
            client.close()
        assert not events(tmp_path, "recovery_claimed")
        assert len(up.dispatches()) == 2  # the two failures; nothing for the streams that left
        retry = h2_post(tmp_path, "retry", proxy, headers=anchored).result()
        assert retry.status == 200 and sse_event_types(retry.body)[-1] == "response.completed"
        assert len(events(tmp_path, "recovery_claimed")) == 1
        assert len(up.dispatches()) == 3
        assert_no_traceback(proxy.log_text())


def _close_wait_sockets(pid: int) -> int:
    """How many of process ``pid``'s TCP sockets are in CLOSE-WAIT (the peer closed, the
    process never did): /proc/net/tcp's state 08, matched by inode to its descriptors."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "08" and fields[9] in inodes:
                count += 1
    return count


@pytest.mark.skipif(not HAS_H2 or not Path("/proc/net/tcp").exists(),
                    reason="needs the h2 package and Linux's /proc")
def test_http2_duplicates_attached_at_once_leave_no_connection_open(tmp_path):
    """Several HTTP/2 streams of one connection attached to a stream in flight: each is
    answered through a relay connection of its own, and none of those is left open once
    answered. (mitmproxy 12 kept the socket of most of them in CLOSE-WAIT for as long as it
    ran, a descriptor each, when the relay closed them first.)"""
    slow = {"kind": "ok", "events": 10, "gap_ms": 200}
    body = json.dumps(BODY).encode()
    streams = [1, 3, 5, 7, 9]
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as proxy:
        with ThreadPoolExecutor(max_workers=1) as pool:
            original = pool.submit(sse_post, proxy.url, body=BODY,
                                   headers={**HEADERS, **mock_behaviour(**slow)})
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=10)
            client = RawH2(proxy.port)
            try:
                for stream_id in streams:
                    client.post(stream_id, "/v1/responses", body, HEADERS)
                client.pump(lambda: all(s in client.ended for s in streams), timeout=30)
                status, _, first = original.result(timeout=30)
                assert status == 200
                assert {client.status.get(s) for s in streams} == {200}
                assert all(client.bodies[s] == first for s in streams)
                assert len(events(tmp_path, "duplicate_attached")) == len(streams)
            finally:
                client.close()
        assert len(up.dispatches()) == 1
        try:
            wait_until(lambda: _close_wait_sockets(proxy.pid) == 0, 10,
                       what="no socket of mitmdump left in CLOSE-WAIT")
        except AssertionError:
            raise AssertionError(f"{_close_wait_sockets(proxy.pid)} sockets of mitmdump left "
                                 "in CLOSE-WAIT") from None
        assert_no_traceback(proxy.log_text())


@pytest.mark.skipif(not HAS_H2, reason="needs the h2 package for a raw HTTP/2 client")
def test_held_http2_streams_of_a_connection_the_client_goes_away_from_are_let_go_once(tmp_path):
    """Three duplicates held on one HTTP/2 connection, then the client sends GOAWAY (mitmproxy
    closes the connection on any GOAWAY): each hold ends once (``hold_abandoned``), none is
    dispatched, the held gauge is back to 0, and the original is answered."""
    import struct

    slow = {"kind": "slow", "delay_ms": 2500}
    body = json.dumps(BODY).encode()
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up,
                                               turnguard_metrics="127.0.0.1:0") as proxy:
        url = metrics_url(proxy)
        with ThreadPoolExecutor(max_workers=1) as pool:
            original = pool.submit(sse_post, proxy.url, body=BODY,
                                   headers={**HEADERS, **mock_behaviour(**slow)})
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=10)
            client = RawH2(proxy.port)
            try:
                for stream_id in (1, 3, 5):
                    client.post(stream_id, "/v1/responses", body, HEADERS)
                wait_until(lambda: len(events(tmp_path, "duplicate_held")) == 3, 10,
                           what="three duplicates held")
                assert metric(scrape(url), "turnguard_flows_held", wait="duplicate") == 3
                # GOAWAY (last stream 0, NO_ERROR), written by hand: h2 would refuse to read on
                client.sock.sendall(struct.pack(">I", 8)[1:] + bytes([7, 0]) +
                                    struct.pack(">III", 0, 0, 0))
                wait_until(lambda: len(events(tmp_path, "hold_abandoned")) == 3, 15,
                           what="the three holds let go")
            finally:
                client.close()
            assert original.result(timeout=30)[0] == 200
        wait_until(lambda: metric(scrape(url), "turnguard_flows_held") == 0, 10,
                   what="no flow held")
        held = {e["flow"] for e in events(tmp_path, "duplicate_held")}
        abandoned = [e["flow"] for e in events(tmp_path, "hold_abandoned")]
        assert sorted(abandoned) == sorted(held)
        assert len(up.dispatches()) == 1
        assert not [e for e in read_jsonl(tmp_path / "events.jsonl")
                    if e.get("flow") in held and e["event"] in (
                        "dispatch", "duplicate_forwarded", "duplicate_replayed")]
        assert_no_traceback(proxy.log_text())


@pytest.mark.skipif(not HAS_H2, reason="needs the h2 package for a raw HTTP/2 client")
def test_an_attached_http2_stream_the_client_resets_takes_nothing_from_its_neighbours(tmp_path):
    """The original and two duplicates multiplexed on one HTTP/2 connection, the duplicates
    attached to the original's stream in flight; the client resets one duplicate's stream
    while the turn streams. The original and the other duplicate get the whole stream,
    identical bytes, on the same connection; one upstream execution; no traceback."""
    slow = {"kind": "ok", "events": 12, "gap_ms": 250}
    body = json.dumps(BODY).encode()
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as proxy:
        client = RawH2(proxy.port)
        try:
            client.post(1, "/v1/responses", body, {**HEADERS, **mock_behaviour(**slow)})
            client.pump(lambda: client.bodies.get(1), timeout=15)  # its first event came
            client.post(3, "/v1/responses", body, HEADERS)
            client.post(5, "/v1/responses", body, HEADERS)
            client.pump(lambda: client.bodies.get(3) and client.bodies.get(5), timeout=15)
            client.reset(3)
            client.pump(lambda: 1 in client.ended and 5 in client.ended, timeout=30)
        finally:
            client.close()
        assert client.ended.get(1) == "ended" and client.ended.get(5) == "ended", client.ended
        assert client.status.get(1) == 200 and client.status.get(5) == 200
        assert sse_event_types(client.bodies[1])[-1] == "response.completed"
        assert client.bodies[5] == client.bodies[1]
        assert len(events(tmp_path, "duplicate_attached")) == 2
        assert len(up.dispatches()) == 1
        assert_no_traceback(proxy.log_text())
