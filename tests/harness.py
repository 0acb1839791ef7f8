"""Helpers for turnguard's end-to-end tests: real subprocesses on loopback.

``MockUpstream`` runs ``scripts/mock_upstream.py``; ``Mitmdump`` runs mitmdump in reverse-proxy
mode (with or without ``addon/turnguard.py``; forked from a process that imported mitmproxy
once, which runs it as exec would: ``mitmdump_forks.py``), ``guarded`` with turnguard's ledger
and events in ``tmp_path``; ``sse_post`` / ``asse_post`` / ``post_turn`` send one request on a
fresh connection each. Every process is a ``turnguard_procs.Process`` (output in a file in
``tmp_path``, never a pipe that can fill; one SIGTERM, then SIGKILL), every wait is bounded, and
every port is chosen by the OS (port 0). SSE bodies are read with ``turnguard_sse``, which
shares no code with the addon's parser.

    with MockUpstream(tmp_path) as up, Mitmdump(tmp_path, up.url) as proxy:
        status, headers, body = sse_post(proxy.url, body={"model": "m", "input": "hi"})
        assert [r["n"] for r in up.dispatches()] == [0]
        assert_no_traceback(proxy.log_text())
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import ssl
import subprocess
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self

import httpx
import pytest

import mitmdump_forks

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "scripts") not in sys.path:  # the tools' helpers, which the tests share
    sys.path.insert(0, str(REPO / "scripts"))

from turnguard_procs import (  # noqa: E402
    MITMDUMP_LINE,
    MOCK_LINE,
    Process,
    read_jsonl,
    rss_bytes,
)
from turnguard_sse import event_types as sse_event_types  # noqa: E402
from turnguard_sse import parse_sse  # noqa: E402
# (the tests import these two from here too)
from turnguard_faults import delete_ledger, replace_with_junk  # noqa: E402, F401

PYTHON = sys.executable
MITMDUMP = Path(sys.executable).with_name("mitmdump")
MOCK_UPSTREAM = REPO / "scripts" / "mock_upstream.py"
ADDON = REPO / "addon" / "turnguard.py"

MOCK_START_TIMEOUT_S = 20.0
MITMDUMP_START_TIMEOUT_S = 30.0

DEFAULT_BODY: dict[str, Any] = {"model": "gpt-test", "input": "hello", "stream": True}

_MITM_ADDRESS = re.compile(r"listening at (\[[^\]]*\]|[0-9.]+):(\d+)")


@functools.cache
def default_tls() -> ssl.SSLContext:
    """What an ``httpx`` client verifies a server with by default (the CA bundle it trusts),
    made once per test process: httpx loads the bundle into a new context for every client
    (about 40 ms of CPU here), and the tests make a client for each request (a new connection
    each). A test that trusts another CA gives its own ``verify``."""
    return httpx.create_ssl_context(trust_env=False)


def seed_ca(confdir: Path) -> None:
    """Give a new ``confdir`` this test process's CA, in the files mitmproxy makes there.

    mitmproxy makes a CA in each new confdir: a 2048-bit RSA key (0.05 to 0.5 s of CPU), then
    loads it twice as it starts, checking the key each time (0.07 s each here). That was most
    of a forked mitmdump's start, and the suite starts about two a test. This CA's key is an
    ECDSA P-256 one, made once per test process, with the extensions mitmproxy gives its own
    (``certs.create_ca``); mitmproxy signs its certificates with it as with its own. A confdir
    that already has a CA (a restart under the same name) is left as it is."""
    if (confdir / "mitmproxy-ca.pem").exists():
        return
    confdir.mkdir(parents=True, exist_ok=True)
    for name, data in _made_ca("mitmproxy").items():
        fd = os.open(confdir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


@functools.cache
def _made_ca(basename: str) -> dict[str, bytes]:
    """A CA's files as mitmproxy's ``CertStore.create_store`` names them, made once."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import pkcs12
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    from mitmproxy import certs

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, basename),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, basename)])
    now = datetime.datetime.now()
    cert = (
        x509.CertificateBuilder().serial_number(x509.random_serial_number())
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .not_valid_before(now + certs.CERT_VALIDITY_OFFSET)
        .not_valid_after(now + certs.CERT_VALIDITY_OFFSET + certs.CA_EXPIRY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(private_key=key, algorithm=hashes.SHA256())
    )
    no_encryption = serialization.NoEncryption()
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL, no_encryption)
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    return {
        f"{basename}-ca.pem": key_pem + cert_pem,
        f"{basename}-ca.p12": pkcs12.serialize_key_and_certificates(
            basename.encode(), key, cert, None, no_encryption),
        f"{basename}-ca-cert.pem": cert_pem,
        f"{basename}-ca-cert.cer": cert_pem,
        f"{basename}-ca-cert.p12": pkcs12.serialize_key_and_certificates(
            basename.encode(), None, cert, None, no_encryption),
        f"{basename}-dhparam.pem": certs.DEFAULT_DHPARAM,
    }


def _unique(tmp_path: Path, name: str, suffix: str) -> Path:
    """``tmp_path/name+suffix``, or ``name-2+suffix`` ... if taken (several servers per test)."""
    p = tmp_path / f"{name}{suffix}"
    for i in range(2, 1000):
        if not p.exists():
            return p
        p = tmp_path / f"{name}-{i}{suffix}"
    raise RuntimeError(f"too many {name} files in {tmp_path}")


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or raise AssertionError
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:  # bounded by the deadline
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class _ServerProcess:
    """A server subprocess (``self.process``) that a ``with`` block stops."""

    process: Process

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> int:
        """SIGTERM, wait up to 10 s, then SIGKILL; return the exit status."""
        return self.process.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MockUpstream(_ServerProcess):
    """``scripts/mock_upstream.py`` as a subprocess on 127.0.0.1, port chosen by the OS.

    ``scenario`` is written to a file and passed with ``--scenario``. Output goes to
    ``tmp_path/<name>.out``, the dispatch log to ``.log_path`` (``<name>.jsonl``)."""

    def __init__(self, tmp_path: Path, scenario: dict[str, Any] | None = None, *, name: str = "mock_upstream"):
        self.tmp_path = Path(tmp_path)
        self.out_path = _unique(self.tmp_path, name, ".out")
        stem = self.out_path.name.removesuffix(".out")
        self.log_path = self.tmp_path / f"{stem}.jsonl"
        cmd = [PYTHON, "-u", str(MOCK_UPSTREAM), "--host", "127.0.0.1", "--port", "0", "--log", str(self.log_path)]
        if scenario is not None:
            scenario_path = self.tmp_path / f"{stem}-scenario.json"
            scenario_path.write_text(json.dumps(scenario))
            cmd += ["--scenario", str(scenario_path)]
        self.process = Process(cmd, self.out_path, popen=mitmdump_forks.popen)
        m = self.process.wait_for_line(MOCK_LINE, MOCK_START_TIMEOUT_S, "mock upstream")
        self.url: str = m.group(1)
        self.port: int = int(m.group(2))

    def records(self) -> list[dict[str, Any]]:
        """Every record of the log file, in order."""
        return read_jsonl(self.log_path)

    def dispatches(self) -> list[dict[str, Any]]:
        """The dispatch records (``event == "dispatch"``) of the log file."""
        return [r for r in self.records() if r.get("event") == "dispatch"]

    def wait_for_record(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        """The first log record matching ``predicate``, waiting up to ``timeout`` seconds."""
        return wait_until(lambda: next((r for r in self.records() if predicate(r)), None), timeout, what="a mock upstream log record")

    def set_scenario(self, scenario: dict[str, Any]) -> None:
        """Replace the running server's scenario; the dispatch counter restarts at 0."""
        with httpx.Client(trust_env=False, timeout=10, verify=default_tls()) as c:
            r = c.post(f"{self.url}/_mock/scenario", json=scenario)
        if r.status_code != 200:
            raise RuntimeError(f"set_scenario failed: {r.status_code} {r.text}")

    def wait_held(self, hold: str, timeout: float = 10.0) -> dict[str, Any]:
        """The ``held`` record of a dispatch waiting at the hold ``hold`` (a behaviour's
        ``hold``), waiting up to ``timeout`` seconds for it."""
        return self.wait_for_record(lambda r: r.get("event") == "held" and r.get("hold") == hold,
                                    timeout)

    def release(self, hold: str) -> int:
        """Release the hold ``hold``: what waits at it goes on, what reaches it later passes.
        Returns how many dispatches were waiting at it."""
        with httpx.Client(trust_env=False, timeout=10, verify=default_tls()) as c:
            r = c.post(f"{self.url}/_mock/release", json={"hold": hold})
        if r.status_code != 200:
            raise RuntimeError(f"release failed: {r.status_code} {r.text}")
        return r.json()["waiting"]

    def output_text(self) -> str:
        """The subprocess's stdout and stderr so far."""
        return self.process.output()


def _option_args(options: Mapping[str, object]) -> list[str]:
    """``--set k=v`` arguments; bools as true/false, lists/tuples as one ``--set`` per item."""
    args: list[str] = []
    for key, value in options.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, bool):
                v = "true" if v else "false"
            args += ["--set", f"{key}={v}"]
    return args


class Mitmdump(_ServerProcess):
    """mitmdump in reverse-proxy mode in front of ``upstream_url``, on 127.0.0.1, port chosen by
    the OS, loading ``addon/turnguard.py`` unless ``addon=False``.

    ``modes`` replaces that single reverse listener by several, given as mitmproxy mode specs
    (``reverse:http://127.0.0.1:A@127.0.0.1:0``, ``regular@127.0.0.2:0``): mitmproxy refuses two
    listeners on one address, so give each its own loopback address (127.0.0.N) with port 0.
    ``ports`` and ``urls`` then list their ports and URLs, in the order of ``modes``.

    Its own confdir (``tmp_path/<name>-confdir``, given the test process's CA: ``seed_ca``)
    keeps the test's CA away from ``~/.mitmproxy``;
    output is appended to ``tmp_path/<name>.log`` (so a restart under the same name, e.g. after
    ``kill9``, keeps one file; ``log_text`` returns this instance's part). ``env`` adds
    environment variables; ``addon`` may name another script to load; ``prefix`` goes before
    the command (e.g. ``unshare`` to run it in a pid namespace of its own)."""

    def __init__(
        self,
        tmp_path: Path,
        upstream_url: str | None,
        *,
        modes: list[str] | None = None,
        addon: bool | Path = True,
        options: Mapping[str, object] | None = None,
        extra_args: list[str] | None = None,
        name: str = "mitmdump",
        env: Mapping[str, str] | None = None,
        prefix: list[str] | None = None,
    ):
        self.tmp_path = Path(tmp_path)
        self.name = name
        self.log_path = self.tmp_path / f"{name}.log"
        self.confdir = self.tmp_path / f"{name}-confdir"
        seed_ca(self.confdir)
        modes = modes or [f"reverse:{upstream_url}"]
        cmd = [*(prefix or []), str(MITMDUMP)]
        for mode in modes:
            cmd += ["--mode", mode]
        cmd += [
            "--listen-host", "127.0.0.1",
            "--listen-port", "0",
            "--set", f"confdir={self.confdir}",
        ]  # fmt: skip
        if addon:
            cmd += ["-s", str(ADDON if addon is True else addon)]
        cmd += _option_args(options or {})
        cmd += list(extra_args or [])
        self.cmd = cmd
        # with a prefix (unshare --fork), mitmdump is the prefix's child: a process group of
        # their own lets stop() and kill9() reach it too, or it would outlive the test
        self.process = Process(cmd, self.log_path, env=env, new_session=bool(prefix), popen=mitmdump_forks.popen)
        self.log_offset = self.process.offset
        every_listener = re.compile(r"(?:.*?" + MITMDUMP_LINE.pattern + r"){%d}" % len(modes), re.S)
        self.process.wait_for_line(every_listener, MITMDUMP_START_TIMEOUT_S, f"mitmdump ({name})")
        found = _MITM_ADDRESS.findall(self.log_text())[: len(modes)]
        if len(modes) == 1:  # what it always was, whatever address mitmproxy prints
            found = [("127.0.0.1", found[0][1])]
        else:  # in the order of ``modes``, told apart by their listen addresses
            by_host = dict(found)
            found = [(h, by_host[h]) for h in (m.rpartition("@")[2].rpartition(":")[0] for m in modes)]
        self.urls: list[str] = [f"http://{host}:{port}" for host, port in found]
        self.ports: list[int] = [int(port) for _, port in found]
        self.port: int = self.ports[0]
        self.url: str = self.urls[0]

    @property
    def proc(self):
        """The ``subprocess.Popen`` (for ``poll()`` and ``returncode``)."""
        return self.process.popen

    def log_text(self) -> str:
        """Everything this mitmdump process printed so far."""
        return self.process.output()

    def wait_for_log(self, needle: str, timeout: float = 10.0) -> str:
        """Wait until ``needle`` appears in the log; return the log text."""
        return wait_until(lambda: t if needle in (t := self.log_text()) else None, timeout, what=f"{needle!r} in {self.log_path}")

    def kill9(self) -> int:
        """SIGKILL at once (a crash); return the exit status."""
        return self.process.kill()


class LoopbackServer:
    """A TCP server of a test's own on 127.0.0.1 (a port of its own), served by an asyncio loop
    on a thread of its own: ``handle(reader, writer)`` answers each connection (a subclass's).
    ``url`` once started; a context manager that stops it."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self.handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        async def stop() -> None:  # connections still open are ended here, on the loop
            self._server.close()
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in handlers:
                task.cancel()
            if handlers:
                await asyncio.wait(handlers, timeout=5)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def upstream_of(url: str):
    """The ``identity.Upstream`` turnguard sees for requests it sends to ``url``
    (``http://127.0.0.1:PORT``), to compute op ids in tests."""
    from turnguard_core.identity import Upstream  # tests/conftest.py puts addon/ on sys.path

    scheme, _, rest = url.partition("://")
    host, _, port = rest.rstrip("/").rpartition(":")
    return Upstream(scheme, host, int(port))


def running(pid: int) -> bool:
    """Whether ``pid`` runs (gone, or a zombie not yet reaped: it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def rss_kb(pid: int) -> int:
    """Resident memory of a process (e.g. a mitmdump), in KiB."""
    return rss_bytes(pid) // 1024


def assert_no_traceback(text: str) -> None:
    """Fail if a mitmdump log shows a Python traceback."""
    assert "Traceback" not in text, f"traceback in mitmdump log:\n{text}"


# --------------------------------------------------------------------------------------------
# turnguard in front of the mock: its files, its ledger


def guarded(
    tmp_path: Path,
    up: MockUpstream,
    name: str = "mitmdump",
    *,
    ledger: Path | str | None = None,
    addon: bool | Path = True,
    prefix: list[str] | None = None,
    extra_args: list[str] | None = None,
    **options: object,
) -> Mitmdump:
    """mitmdump + turnguard in front of ``up``: its ledger ``tmp_path/ledger.sqlite3`` (or a
    path or PostgreSQL URL ``ledger``; processes of one test share it), its events
    ``tmp_path/<name>-events.jsonl`` (``turnguard_events``), and ``options`` (which may
    override both); ``extra_args`` go on its command line (another ``-s`` script)."""
    opts: dict[str, object] = {
        "turnguard_ledger": str(ledger or tmp_path / "ledger.sqlite3"),
        "turnguard_events": str(tmp_path / f"{name}-events.jsonl"),
        **options,
    }
    return Mitmdump(tmp_path, up.url, options=opts, name=name, addon=addon, prefix=prefix,
                    extra_args=extra_args)


def turnguard_events(tmp_path: Path, name: str = "mitmdump", kind: str | None = None) -> list[dict[str, Any]]:
    """The telemetry records of the ``guarded`` process ``name`` so far (of one ``kind``)."""
    recs = read_jsonl(tmp_path / f"{name}-events.jsonl")
    return [r for r in recs if kind is None or r["event"] == kind]


def wait_for_a_first_event(ledger: Path, what: str = "the turn's first event") -> None:
    """Until the SQLite ``ledger`` shows an attempt in flight that has seen a response event
    (a turn's first event, which turnguard records 0.1 s after it came)."""
    wait_until(lambda: ledger_query(
        ledger, "SELECT 1 FROM attempts WHERE events_seen>0 AND outcome='in_flight'"),
        10, what=what)


def ledger_query(ledger: Path, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """A read on a ledger through a connection of the test's own (another process's view)."""
    db = sqlite3.connect(ledger, timeout=10)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def ledger_integrity(ledger: Path) -> str:
    """SQLite's ``PRAGMA integrity_check`` of a ledger: ``ok`` when it is sound."""
    return ledger_query(ledger, "PRAGMA integrity_check")[0][0]


class Regression(AssertionError):
    """A check that once found a bug in the addon (fixed since) failed again."""


def check(ok: bool, message: str) -> None:
    """Raise ``Regression(message)`` unless ``ok``."""
    if not ok:
        raise Regression(message)


# --------------------------------------------------------------------------------------------
# Clients


def _request(url: str, path: str, body: dict[str, Any] | bytes | None,
             headers: Mapping[str, str] | None) -> tuple[str, bytes, dict[str, str]]:
    """The URL, the body bytes (dicts serialised the same way every time, so equal dicts give
    byte-identical duplicates) and the headers with JSON/SSE defaults of one POST."""
    if body is None:
        body = DEFAULT_BODY
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"content-type": "application/json", "accept": "text/event-stream"}
    h.update({k.lower(): v for k, v in (headers or {}).items()})
    return url.rstrip("/") + path, raw, h


def _answer(r: httpx.Response) -> tuple[int, dict[str, str], bytes]:
    return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content


def sse_post(
    url: str,
    path: str = "/v1/responses",
    body: dict[str, Any] | bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 60,
) -> tuple[int, dict[str, str], bytes]:
    """POST on a fresh connection (a new httpx.Client per call) and read the whole body.

    Returns (status, lowercase headers, body bytes). Transport errors (reset, early close,
    timeout) propagate as httpx exceptions."""
    target, raw, h = _request(url, path, body, headers)
    with httpx.Client(trust_env=False, timeout=timeout, verify=default_tls()) as c:
        return _answer(c.post(target, content=raw, headers=h))


async def asse_post(
    url: str,
    path: str = "/v1/responses",
    body: dict[str, Any] | bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 60,
) -> tuple[int, dict[str, str], bytes]:
    """Async ``sse_post`` (a new httpx.AsyncClient per call) for concurrency tests."""
    target, raw, h = _request(url, path, body, headers)
    async with httpx.AsyncClient(trust_env=False, timeout=timeout, verify=default_tls()) as c:
        return _answer(await c.post(target, content=raw, headers=h))


def post_turn(
    url: str,
    headers: Mapping[str, str] | None = None,
    body: dict[str, Any] | bytes | None = None,
    *,
    path: str = "/v1/responses",
    behaviour: dict[str, Any] | None = None,
    cut_is_error: bool = False,
    timeout: float = 60,
) -> tuple[int, dict[str, str], bytes]:
    """``sse_post`` for a test that counts failures: a transport error (a reset, a crash of
    the proxy) is ``(0, {}, b"")``; with ``cut_is_error``, so is a 200 SSE answer whose last
    event is not ``response.completed`` (a stream cut short; its headers and bytes are kept).
    ``behaviour`` picks the mock upstream's answer (``mock_behaviour``)."""
    h = {**(headers or {}), **(mock_behaviour(**behaviour) if behaviour is not None else {})}
    try:
        status, rh, b = sse_post(url, path=path, body=body, headers=h, timeout=timeout)
    except httpx.HTTPError:
        return 0, {}, b""
    if cut_is_error and status == 200 and sse_event_types(b)[-1:] != ["response.completed"]:
        return 0, rh, b
    return status, rh, b


def mock_behaviour(**b: Any) -> dict[str, str]:
    """The header that makes the mock upstream answer one request with behaviour ``b`` (not
    part of the request's identity: duplicates may carry another one)."""
    return {"x-mock-behaviour": json.dumps(b)}


def response_id(body: bytes) -> str | None:
    """The response id of an SSE or JSON Responses body (first one found), or None."""
    for _, data in parse_sse(body):
        if isinstance(data, dict) and isinstance(data.get("response"), dict):
            return data["response"].get("id")
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return obj.get("id") if isinstance(obj, dict) else None


# --------------------------------------------------------------------------------------------
# Metrics


def scrape(url: str, timeout: float = 10) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET ``url`` (a turnguard ``/metrics`` endpoint) and parse the exposition: sample name ->
    [(labels, value), ...] (an empty list for a declared series with no sample yet, e.g. a
    labelled counter no label value was seen for). Raises on a status other than 200 or a body
    that does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(trust_env=False, timeout=timeout, verify=default_tls()) as c:
        r = c.get(url)
    r.raise_for_status()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count", "")}
    for family in text_string_to_metric_families(r.text):
        for suffix in suffixes.get(family.type, ("",)):  # declared, maybe no sample yet
            out.setdefault(family.name + suffix, [])
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def metric(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


_METRICS_LINE = re.compile(r"turnguard: metrics at (http://\S+/metrics)")


def metrics_url(proxy: "Mitmdump", timeout: float = 10.0) -> str:
    """The metrics URL a mitmdump started with ``turnguard_metrics`` printed."""
    m = _METRICS_LINE.search(proxy.wait_for_log("turnguard: metrics at", timeout))
    assert m, proxy.log_text()
    return m.group(1)


def another_host_prefix() -> list[str]:
    """A command prefix that runs a process in a pid namespace of its own: another host, as
    far as liveness can tell (it cannot be proven gone by its pid, only by its lease). Skips
    the test where that cannot be made (``unshare --pid`` needs root)."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=30) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare --pid needs root)")
    return [unshare, "--pid", "--fork", "--mount-proc", "--kill-child"]


def older_copy(folder: Path) -> None:
    """A copy (0600) of the ledger ``folder/ledger.sqlite3`` as it is now, made beside it as
    ``older.sqlite3``, for ``replace_with_older_copy`` to put back later."""
    src = sqlite3.connect(folder / "ledger.sqlite3")
    dst = sqlite3.connect(folder / "older.sqlite3")
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    os.chmod(folder / "older.sqlite3", 0o600)


def replace_with_older_copy(folder: Path) -> None:
    """Move the copy ``older_copy`` made into the ledger's place, the old file's ``-wal`` and
    ``-shm`` deleted first (SQLite would pair them with the copy: the README's warning)."""
    ledger = folder / "ledger.sqlite3"
    for suffix in ("-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)
    os.replace(folder / "older.sqlite3", ledger)
