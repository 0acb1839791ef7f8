"""Security: no secret at rest or in the logs, private files, refused unsafe ledger paths, no
cross-scope replay (property tests at the ledger and through a real mitmdump), nothing kept when
replay is off, and retention that purges what it promises."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import stat
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from harness import (
    ADDON,
    MITMDUMP,
    Mitmdump,
    MockUpstream,
    assert_no_traceback,
    check,
    default_tls,
    guarded,
    ledger_query,
    post_turn,
    read_jsonl,
    response_id,
    wait_until,
)
from hypothesis_profiles import examples
from turnguard_core import identity, policy
from turnguard_core.ledger import AttemptEnd, Ledger, Recording

GUARD = policy.GuardPolicy(replay=True, replay_window_s=300, retention_s=3600)


def ledger_files(path: Path) -> list[Path]:
    return [p for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists()]


query = ledger_query


def post(url, headers, body, path="/v1/responses", timeout=60):
    """One request; a transport error is status 0."""
    return post_turn(url, headers, body, path=path, timeout=timeout)


# -----------------------------------------------------------------------------------------------
# Secrets never at rest, never logged


def test_no_secret_reaches_the_ledger_the_events_or_the_log(tmp_path, report):
    tokens = {name: f"{name}-SECRET-{secrets.token_hex(8)}" for name in (
        "bearer", "account", "idem", "cookie", "apikey", "xapikey", "session", "org",
        "echoed_org", "echoed_project")}
    headers = {
        "authorization": f"Bearer {tokens['bearer']}",
        "chatgpt-account-id": tokens["account"],
        "idempotency-key": tokens["idem"],
        "cookie": f"sid={tokens['cookie']}",
        "api-key": tokens["apikey"],
        "x-api-key": tokens["xapikey"],
        "session-id": tokens["session"],
        "openai-organization": tokens["org"],
    }
    body = {"model": "gpt-test", "input": "keep my secrets", "stream": True}
    # the recorded answer carries what api.openai.com sends back: the organization and the
    # project of the key (credential-bearing headers, never kept at rest)
    echoed = {"openai-organization": tokens["echoed_org"],
              "openai_project": tokens["echoed_project"]}
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 1200, "headers": echoed},
                             {"kind": "reset"}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as p:
        with ThreadPoolExecutor(max_workers=3) as pool:  # original + held duplicates
            first = pool.submit(post, p.url, headers, body)
            wait_until(lambda: up.dispatches(), 10, what="the original")
            dups = [pool.submit(post, p.url, headers, body) for _ in range(2)]
            assert [f.result()[0] for f in [first, *dups]] == [200, 200, 200]
        post(p.url, {**headers, "idempotency-key": tokens["idem"] + "-2"},
             {**body, "input": "fails"})  # an eventless failure (the mock resets)
        assert post(p.url, headers, {**body, "input": "other body"})[0] == 422  # key reused
        post(p.url, headers, b"not json")  # passthrough
        post(p.url, {**headers, "idempotency-key": ""}, body, path="/v1/other")
        log = p.log_text()
    ledger = tmp_path / "ledger.sqlite3"
    blobs = {str(f): f.read_bytes() for f in ledger_files(ledger)}
    blobs["events"] = (tmp_path / "mitmdump-events.jsonl").read_bytes()
    blobs["log"] = log.encode()
    for where, blob in blobs.items():
        for name, token in tokens.items():
            assert token.encode() not in blob, f"the {name} secret is in {where}"
    assert query(ledger, "PRAGMA integrity_check") == [("ok",)]
    report(f"secrets: {len(tokens)} token values grepped in {len(blobs)} files: none found")


def test_a_credential_in_the_query_string_is_not_kept_in_the_ledger(tmp_path):
    token = f"qs-SECRET-{secrets.token_hex(8)}"
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as p:
        status, _, _ = post(p.url, {"session-id": "q"}, {"model": "m", "input": "q"},
                            path=f"/v1/responses?api-key={token}")
        assert status == 200
        assert len(up.dispatches()) == 1
    events = (tmp_path / "mitmdump-events.jsonl").read_bytes()
    assert token.encode() not in events
    found = [str(f) for f in ledger_files(tmp_path / "ledger.sqlite3")
             if token.encode() in f.read_bytes()]
    check(not found, f"the query-string credential is stored in {found}")


def test_a_configured_credential_header_echoed_by_the_upstream_is_not_kept(tmp_path):
    """A header named by ``turnguard_credential_headers`` is credential-bearing like the
    built-in ones: when the upstream echoes it in its answer (a gateway that sends the tenant
    key back), the recording keeps it no more than it keeps an echoed OpenAI-Organization, in
    any spelling."""
    token = f"tenant-SECRET-{secrets.token_hex(8)}"
    echoed = {"x-tenant-key": token, "X_Tenant_Key": token + "-2"}
    scenario = {"default": {"kind": "ok", "headers": echoed}}
    headers = {"x-tenant-key": token, "session-id": "tenant"}
    body = {"model": "m", "input": "echo my tenant key", "stream": True}
    with MockUpstream(tmp_path, scenario) as up, guarded(
            tmp_path, up, turnguard_credential_headers="x-tenant-key") as p:
        assert post(p.url, headers, body)[0] == 200
        status, replay_headers, _ = post(p.url, headers, body)
        assert status == 200 and replay_headers.get("x-turnguard") == "replayed"
        assert len(up.dispatches()) == 1
    found = [str(f) for f in ledger_files(tmp_path / "ledger.sqlite3")
             if token.encode() in f.read_bytes()]
    check(not found, f"the echoed configured credential is stored in {found}")


def test_a_credential_header_unnamed_while_its_turn_streams_is_not_kept(tmp_path):
    """``turnguard_credential_headers`` changed in a running proxy (mitmweb's options, the
    console's ``:set``) while a turn that was identified under it streams: the header the turn
    was identified as carrying a credential in stays one for that turn, so the upstream's echo
    of it is not kept in its recording, whatever the option says when the turn ends (as
    ``turnguard_replay`` switched off mid-stream, the stricter of the two holds)."""
    import httpx

    token = f"tenant-SECRET-{secrets.token_hex(8)}"
    # a stream of about 9 s: the change lands while it streams, on a busy machine too
    scenario = {"default": {"kind": "ok", "events": 30, "gap_ms": 300,
                            "headers": {"x-tenant-key": token}}}
    headers = {"x-tenant-key": token, "session-id": "tenant"}
    body = {"model": "m", "input": "unname my tenant key mid-stream", "stream": True}
    live_options = Path(__file__).with_name("live_options.py")
    with MockUpstream(tmp_path, scenario) as up, guarded(
            tmp_path, up, extra_args=["-s", str(live_options)],
            turnguard_credential_headers="x-tenant-key") as p:
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(post, p.url, headers, body)
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=20)
            r = httpx.post(p.url + "/__set", json=["turnguard_credential_headers"],
                           trust_env=False, timeout=20, verify=default_tls())
            assert r.status_code == 200, r.text
            assert not first.done(), "the turn ended before the change: nothing was tested"
            assert first.result()[0] == 200
        assert len(up.dispatches()) == 1
        assert_no_traceback(p.log_text())
    assert [e["outcome"] for e in read_jsonl(tmp_path / "mitmdump-events.jsonl")
            if e["event"] == "outcome"] == ["completed"]
    found = [str(f) for f in ledger_files(tmp_path / "ledger.sqlite3")
             if token.encode() in f.read_bytes()]
    check(not found, f"the echoed credential is stored in {found}")


# -----------------------------------------------------------------------------------------------
# Private files, unsafe paths refused


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def test_ledger_and_events_files_are_0600_whatever_the_umask(tmp_path):
    with MockUpstream(tmp_path) as up:
        with umask(0):  # the child inherits it: the files must be private on their own
            p = guarded(tmp_path, up)
        # the default location, <confdir>/turnguard.sqlite3, with the usual umask (with umask 0
        # mitmproxy itself creates its confdir world-writable, and turnguard rightly refuses it)
        with umask(0o022):
            default = Mitmdump(tmp_path, up.url, name="default-ledger")
        try:
            assert post(p.url, {"session-id": "s"}, {"model": "m", "input": "private"})[0] == 200
            assert post(default.url, {"session-id": "s"}, {"model": "m", "input": "x"})[0] == 200
            files = ledger_files(tmp_path / "ledger.sqlite3") + [
                tmp_path / "mitmdump-events.jsonl"]
            files += ledger_files(tmp_path / "default-ledger-confdir" / "turnguard.sqlite3")
            assert len(files) >= 5, files
            modes = {str(f): oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files}
            assert set(modes.values()) == {"0o600"}, modes
        finally:
            p.stop()
            default.stop()


def test_a_wal_and_shm_left_readable_by_others_are_made_private(tmp_path):
    """A process killed leaves the ledger's -wal and -shm; copied or restored under the usual
    umask they are 0644, and SQLite keeps the mode of those it finds. The rows they hold
    (recordings) are the ledger's: a process that opens the ledger makes them 0600."""
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path) as up:
        with guarded(tmp_path, up):
            pass  # made the ledger
        with umask(0o022), contextlib.closing(sqlite3.connect(ledger)) as other:
            other.execute("PRAGMA journal_mode=WAL")
            other.execute("CREATE TABLE IF NOT EXISTS test_scratch (x)")
            other.execute("INSERT INTO test_scratch VALUES (1)")
            other.commit()  # its -wal and -shm stay while it is open
            for f in ledger_files(ledger):
                os.chmod(f, 0o644)
            assert len(ledger_files(ledger)) == 3
            with guarded(tmp_path, up) as p:
                assert post(p.url, {"session-id": "s"}, {"model": "m", "input": "w"})[0] == 200
                modes = {f.name: oct(stat.S_IMODE(os.stat(f).st_mode))
                         for f in ledger_files(ledger)}
    assert modes == dict.fromkeys(["ledger.sqlite3", "ledger.sqlite3-wal",
                                   "ledger.sqlite3-shm"], "0o600"), modes


def _start_refused(tmp_path: Path, ledger: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MITMDUMP), "--listen-host", "127.0.0.1", "--listen-port", "0",
         "--set", f"confdir={tmp_path / 'confdir'}", "-s", str(ADDON),
         "--set", f"turnguard_ledger={ledger}"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("case", ["world_writable_folder", "world_writable_file",
                                  "group_writable_file"])
def test_an_unsafe_ledger_path_is_refused(tmp_path, case):
    folder = tmp_path / "shared"
    folder.mkdir()
    ledger = folder / "ledger.sqlite3"
    if case == "world_writable_folder":
        os.chmod(folder, 0o777)
    else:
        Ledger(str(ledger), "x").open(time.time())  # a real ledger, then loosened
        os.chmod(ledger, 0o666 if case == "world_writable_file" else 0o660)
    proc = _start_refused(tmp_path, ledger)
    assert proc.returncode != 0
    assert "refused" in proc.stdout + proc.stderr
    assert "writable" in proc.stdout + proc.stderr
    if case == "world_writable_folder":
        assert not ledger.exists()  # nothing was created there


def test_a_sticky_shared_folder_like_tmp_is_accepted(tmp_path):
    folder = tmp_path / "sticky"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    with MockUpstream(tmp_path) as up, guarded(
        tmp_path, up, turnguard_ledger=str(folder / "ledger.sqlite3")
    ) as p:
        assert post(p.url, {"session-id": "s"}, {"model": "m", "input": "sticky"})[0] == 200
    assert stat.S_IMODE(os.stat(folder / "ledger.sqlite3").st_mode) == 0o600


# -----------------------------------------------------------------------------------------------
# No cross-scope replay: property tests at the ledger (many examples, fast)

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=16)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)  # (JSON has neither)
    | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)
BODY = st.dictionaries(st.sampled_from(["model", "input", "stream", "tools", "x"]), JSON,
                       min_size=1, max_size=4)


@st.composite
def request(draw) -> dict:
    session_carrier = draw(st.sampled_from(["session-id", "session_id", "metadata", "none"]))
    return {
        "auth": draw(st.none() | TOKEN),
        "account": draw(st.none() | TOKEN),
        "session": None if session_carrier == "none" else draw(TOKEN),
        "carrier": session_carrier,
        "body": draw(BODY),
        "idem": draw(st.none() | TOKEN),
    }


def headers_of(r: dict) -> list[tuple[str, str]]:
    h = [("content-type", "application/json")]
    if r["auth"] is not None:
        h.append(("Authorization", f"Bearer {r['auth']}"))
    if r["account"] is not None:
        h.append(("ChatGPT-Account-Id", r["account"]))
    if r["session"] is not None:
        if r["carrier"] == "metadata":
            h.append(("x-codex-turn-metadata", json.dumps({"session_id": r["session"]})))
        else:
            h.append((r["carrier"], r["session"]))
    if r["idem"] is not None:
        h.append(("Idempotency-Key", r["idem"]))
    return h


def ident_of(r: dict, *, reorder: bool = False) -> identity.Identity:
    body = json.dumps(r["body"], sort_keys=reorder, indent=2 if reorder else None).encode()
    h = headers_of(r)
    if reorder:  # the same request, spelled differently: header order and case, JSON layout
        h = [(k.upper(), v) for k, v in reversed(h)]
    i = identity.identify(identity.RequestView("POST", "/v1/responses", tuple(h), body))
    assert isinstance(i, identity.Identity)
    return i


def same_scope(a: dict, b: dict) -> bool:
    return (a["auth"], a["account"], a["session"]) == (b["auth"], b["account"], b["session"])


def canonical(body: dict) -> bytes:
    """The body as the API reads it: a member of an ``input`` item whose value is null is
    absent to it, and those a client adds to the items it keeps are its own bookkeeping
    (identity.fingerprint_body). ``{"input": [{}]}`` and ``{"input": [{"": null}]}`` are one
    request: a replay across them is no leak."""
    items = body.get("input")
    if isinstance(items, list):
        body = {**body, "input": [
            {k: v for k, v in i.items() if v is not None
             and k not in identity.CLIENT_ITEM_METADATA} if isinstance(i, dict) else i
            for i in items]}
    return identity.canonical_json(body)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=request(), b=request())
@example(  # one request to the API (a null member is absent): replayed, no leak
    a={"auth": None, "account": None, "session": "0", "carrier": "session-id",
       "body": {"input": [{}, 1.5, "z"]}, "idem": None},
    b={"auth": None, "account": None, "session": "0", "carrier": "session-id",
       "body": {"input": [{"": None}, 1.5, "z"]}, "idem": None})
def test_a_recording_never_reaches_another_credential_session_or_body(a, b):
    with tempfile.TemporaryDirectory() as d:
        led = Ledger(os.path.join(d, "l.sqlite3"), "p")
        led.open(1000.0)
        try:
            ia, ib = ident_of(a), ident_of(b)
            d1 = led.admit(ia, method="POST", path="/v1/responses", now=1000.0, guard=GUARD,
                           flow_id="a")
            assert isinstance(d1, policy.Dispatch)
            rec = Recording(200, (("content-type", "text/event-stream"),), b"A's answer")
            led.finish(d1.attempt_id, AttemptEnd("completed", 200, 3, None, rec), now=1001.0)
            got = led.admit(ib, method="POST", path="/v1/responses", now=1002.0, guard=GUARD,
                            flow_id="b")
            if isinstance(got, policy.Replay):
                # only the same credential, session and request (same key or same body)
                assert same_scope(a, b)
                if b["idem"] is not None:
                    assert a["idem"] == b["idem"] and canonical(a["body"]) == canonical(b["body"])
                else:
                    assert a["idem"] is None and canonical(a["body"]) == canonical(b["body"])
            if isinstance(got, policy.Conflict):  # 422: same key, same scope, another body
                assert same_scope(a, b) and a["idem"] == b["idem"] is not None
            if not same_scope(a, b):
                assert ia.op_key != ib.op_key and isinstance(got, policy.Dispatch)
                assert got.kind == "original"
        finally:
            led.close()


@settings(max_examples=examples(100), deadline=None)
@given(a=request())
def test_the_same_request_spelled_differently_is_replayed(a):
    """The positive control: identity is stable under header case/order and JSON layout."""
    assert ident_of(a).op_key == ident_of(a, reorder=True).op_key


@settings(max_examples=examples(100), deadline=None)
@given(a=request(), auth2=TOKEN, key=TOKEN)
def test_an_idempotency_key_collision_across_credentials_is_two_operations(a, auth2, key):
    assume(auth2 != a["auth"])
    a = {**a, "idem": key}
    b = {**a, "auth": auth2, "body": {**a["body"], "x": "another body"}}
    with tempfile.TemporaryDirectory() as d:
        led = Ledger(os.path.join(d, "l.sqlite3"), "p")
        led.open(1000.0)
        try:
            kinds = []
            for r in (a, b):
                got = led.admit(ident_of(r), method="POST", path="/v1/responses", now=1000.0,
                                guard=GUARD, flow_id="f")
                kinds.append(type(got).__name__)
            assert kinds == ["Dispatch", "Dispatch"]  # no 422, no hold, no replay
        finally:
            led.close()


# The same property through a real mitmdump: a handful of generated pairs, each answered by the
# mock (every dispatch gets its own response id, so a leaked recording is visible).


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security-live")
    up = MockUpstream(tmp)
    try:
        p = guarded(tmp, up)
    except BaseException:
        up.stop()
        raise
    try:
        yield p, up
    finally:
        p.stop()
        up.stop()


VARIANTS = ["authorization", "chatgpt-account-id", "session-id", "session_via_metadata", "body"]


@settings(max_examples=examples(12), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(variant=st.sampled_from(VARIANTS), seed=TOKEN, text=st.text(max_size=20))
def test_live_a_recording_never_reaches_another_scope(live, variant, seed, text):
    p, up = live
    tag = secrets.token_hex(4)
    base_headers = {"authorization": f"Bearer k-{seed}", "chatgpt-account-id": f"acct-{seed}",
                    "session-id": f"s-{seed}-{tag}"}
    body = {"model": "m", "input": f"{text} {tag}", "stream": True}
    first = post(p.url, base_headers, body)
    assert first[0] == 200
    again = post(p.url, base_headers, body)  # the control: the same request is replayed
    assert again[1].get("x-turnguard") == "replayed" and again[2] == first[2]
    other_headers, other_body = dict(base_headers), dict(body)
    if variant == "session_via_metadata":
        del other_headers["session-id"]
        other_headers["x-codex-turn-metadata"] = json.dumps({"session_id": f"m-{seed}-{tag}"})
    elif variant == "body":
        other_body["input"] += " (changed)"
    else:
        other_headers[variant] += "-other"
    n = len(up.dispatches())
    status, h, b = post(p.url, other_headers, other_body)
    assert status == 200 and "x-turnguard" not in h
    assert response_id(b) != response_id(first[2])
    assert len(up.dispatches()) == n + 1


def test_live_idempotency_key_collision_across_credentials_is_two_operations(live):
    p, up = live
    n = len(up.dispatches())
    key = f"key-{secrets.token_hex(4)}"
    a = post(p.url, {"authorization": "Bearer alice", "idempotency-key": key},
             {"model": "m", "input": "alice's turn"})
    b = post(p.url, {"authorization": "Bearer bob", "idempotency-key": key},
             {"model": "m", "input": "bob's turn"})
    c = post(p.url, {"authorization": "Bearer bob", "idempotency-key": key},
             {"model": "m", "input": "bob's turn"})
    assert a[0] == b[0] == 200 and "x-turnguard" not in b[1]
    assert response_id(a[2]) != response_id(b[2])
    assert c[1].get("x-turnguard") == "replayed" and c[2] == b[2]  # bob's own retry
    assert len(up.dispatches()) == n + 2


@pytest.mark.parametrize("header", ["api-key", "x-api-key"])
def test_live_no_replay_across_api_key_headers(live, header):
    """Azure OpenAI sends its key as ``api-key`` (and its ``/openai/v1/responses`` route is
    guarded by the default filter); several gateways use ``x-api-key``."""
    p, up = live
    body = {"model": "m", "input": f"same question {secrets.token_hex(4)}", "stream": True}
    alice = post(p.url, {header: "alice-key"}, body, path="/openai/v1/responses")
    bob = post(p.url, {header: "bob-key"}, body, path="/openai/v1/responses")
    assert alice[0] == 200 and bob[0] == 200
    check(bob[1].get("x-turnguard") != "replayed" and response_id(bob[2]) != response_id(
        alice[2]), f"bob ({header}: bob-key) got alice's recorded response")


@pytest.mark.parametrize("header", identity.CREDENTIAL_HEADERS)
def test_live_every_credential_header_keeps_its_principal_apart_and_its_value_unkept(live,
                                                                                    header):
    """Each built-in credential header, alone on a request: the same body under another value
    of it is another operation (never replayed across), under the same value it is replayed;
    the values reach neither the ledger (its -wal included), nor the events, nor the log."""
    p, up = live
    tokens = [f"{header}-SECRET-{secrets.token_hex(8)}" for _ in range(2)]
    body = {"model": "m", "input": f"one question, two keys {secrets.token_hex(4)}",
            "stream": True}
    n = len(up.dispatches())
    alice = post(p.url, {header: tokens[0]}, body)
    bob = post(p.url, {header: tokens[1]}, body)
    alice_again = post(p.url, {header: tokens[0]}, body)
    assert alice[0] == bob[0] == alice_again[0] == 200
    assert bob[1].get("x-turnguard") is None and response_id(bob[2]) != response_id(alice[2]), \
        f"{header}: another value got the first one's recorded response"
    assert alice_again[1].get("x-turnguard") == "replayed" and alice_again[2] == alice[2]
    assert len(up.dispatches()) == n + 2
    blobs = {str(f): f.read_bytes() for f in ledger_files(p.tmp_path / "ledger.sqlite3")}
    blobs["events"] = (p.tmp_path / "mitmdump-events.jsonl").read_bytes()
    blobs["log"] = p.log_text().encode()
    for where, blob in blobs.items():
        for token in tokens:
            assert token.encode() not in blob, f"the {header} value is in {where}"


# -----------------------------------------------------------------------------------------------
# replay=false keeps no bodies; retention purges


def test_replay_switched_off_while_a_turn_streams_keeps_its_body_out_of_the_ledger(tmp_path):
    """``turnguard_replay`` set to false in a running proxy (mitmweb's options, the console's
    ``:set``) while a turn streams: the turn's end is written after the switch, and what is
    written then keeps no body, whatever the setting was when the turn began; its retry is
    forwarded, not replayed."""
    import httpx

    marker = f"BODY-MARKER-{secrets.token_hex(6)}"
    live_options = Path(__file__).with_name("live_options.py")
    ledger = tmp_path / "ledger.sqlite3"
    # the switched turn streams slowly; the later one (forwarded, not replayed) at once
    scenario = {"sequence": [{"kind": "ok", "events": 12, "gap_ms": 300, "text": marker}],
                "default": {"kind": "ok", "text": marker}}
    with MockUpstream(tmp_path, scenario) as up, \
            Mitmdump(tmp_path, up.url, extra_args=["-s", str(live_options)], options={
                "turnguard_ledger": str(ledger),
                "turnguard_events": str(tmp_path / "events.jsonl")}) as p:
        h = {"authorization": "Bearer k"}
        body = {"model": "m", "input": "switch replay off mid-stream", "stream": True}
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(post, p.url, h, body)
            up.wait_for_record(lambda r: r.get("event") == "dispatch", timeout=20)
            # the response is streaming (its headers, and a first event, passed the tee)
            wait_until(lambda: query(ledger, "SELECT MAX(events_seen) FROM attempts") == [(1,)],
                       20, what="the turn's first event")
            r = httpx.post(p.url + "/__set", json=["turnguard_replay=false"], trust_env=False,
                           timeout=20, verify=default_tls())
            assert r.status_code == 200, r.text
            assert not first.done(), "the turn ended before the switch: nothing was tested"
            assert first.result()[0] == 200
        assert not [e for e in read_jsonl(tmp_path / "events.jsonl")
                    if e["event"] == "outcome" and e["outcome"] != "completed"]
        assert query(ledger, "SELECT COUNT(*) FROM spool") == [(0,)]
        assert query(ledger, "SELECT COUNT(*) FROM attempts WHERE replayable<>0 OR headers IS NOT"
                             " NULL OR body_bytes IS NOT NULL") == [(0,)]
        assert not any(marker.encode() in f.read_bytes() for f in ledger_files(ledger))
        later = post(p.url, h, body)
        assert later[0] == 200 and "x-turnguard" not in later[1]  # forwarded
        assert len(up.dispatches()) == 2
        assert_no_traceback(p.log_text())


def test_replay_off_stores_no_response_bodies(tmp_path):
    marker = f"BODY-MARKER-{secrets.token_hex(6)}"
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 1000, "text": marker}],
                "default": {"kind": "ok", "text": marker}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, turnguard_replay=False) as p:
        h = {"authorization": "Bearer k", "session-id": "s"}
        body = {"model": "m", "input": "no recordings please", "stream": True}
        with ThreadPoolExecutor(max_workers=3) as pool:
            first = pool.submit(post, p.url, h, body)
            wait_until(lambda: up.dispatches(), 10, what="the original")
            dups = [pool.submit(post, p.url, h, body) for _ in range(2)]
            results = [first.result(), *(f.result() for f in dups)]
        assert [r[0] for r in results] == [200, 200, 200]
        assert all("x-turnguard" not in r[1] for r in results)  # forwarded, never replayed
        later = post(p.url, h, body)
        assert later[0] == 200 and "x-turnguard" not in later[1]
        assert len(up.dispatches()) == 4
        # forwarded one at a time: no two dispatches of the operation overlap upstream
        recs = up.records()
        in_flight = 0
        for r in recs:
            if r.get("event") == "dispatch":
                in_flight += 1
                assert in_flight == 1
            elif r.get("event") == "dispatch_end":
                in_flight -= 1
        ledger = tmp_path / "ledger.sqlite3"
        assert query(ledger, "SELECT COUNT(*) FROM spool") == [(0,)]
        assert query(ledger, "SELECT COUNT(*) FROM attempts WHERE replayable<>0 OR headers IS NOT"
                             " NULL OR body_bytes IS NOT NULL") == [(0,)]
        assert query(ledger, "SELECT COUNT(*) FROM operations WHERE replay_attempt IS NOT NULL") \
            == [(0,)]
        for f in ledger_files(ledger):
            assert marker.encode() not in f.read_bytes()
        assert_no_traceback(p.log_text())


def _marker_run(tmp_path: Path, up: MockUpstream, name: str, marker: str, **options) -> None:
    with guarded(tmp_path, up, name, **options) as p:
        for i in range(3):
            assert post(p.url, {"session-id": "r", "idempotency-key": f"k{i}"},
                        {"model": "m", "input": f"retained {i}"})[0] == 200
    ledger = tmp_path / "ledger.sqlite3"
    assert query(ledger, "SELECT COUNT(*) FROM operations") == [(3,)]
    assert any(marker.encode() in f.read_bytes() for f in ledger_files(ledger))


def test_retention_purges_operations_and_their_bytes_at_restart(tmp_path):
    marker = f"RETAINED-{secrets.token_hex(6)}"
    opts = dict(turnguard_retention_ms=1500, turnguard_replay_window_ms=1000)
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "text": marker}}) as up:
        _marker_run(tmp_path, up, "first", marker, **opts)
        time.sleep(1.8)
        with guarded(tmp_path, up, "restarted", **opts) as p:  # collects garbage at open
            ledger = tmp_path / "ledger.sqlite3"
            wait_until(lambda: query(ledger, "SELECT COUNT(*) FROM operations") == [(0,)], 10,
                       what="the purge at open")
            assert query(ledger, "SELECT COUNT(*) FROM spool") == [(0,)]
            assert query(ledger, "SELECT COUNT(*) FROM attempts") == [(0,)]
            # the event (and the WAL checkpoint before it) follows the purge's commit: wait
            gc = wait_until(lambda: [e for e in read_jsonl(tmp_path / "restarted-events.jsonl")
                                     if e["event"] == "ledger_gc"], 10, what="ledger_gc")
            assert gc[0]["operations_deleted"] == 3
            still = [str(f) for f in ledger_files(ledger) if marker.encode() in f.read_bytes()]
            assert not still, f"the purged response bodies are still readable in {still}"
            # an Idempotency-Key past retention is a new operation, not a replay
            n = len(up.dispatches())
            status, h, _ = post(p.url, {"session-id": "r", "idempotency-key": "k0"},
                                {"model": "m", "input": "retained 0"})
            assert status == 200 and "x-turnguard" not in h and len(up.dispatches()) == n + 1


def test_retention_purges_while_running(tmp_path):
    opts = dict(turnguard_retention_ms=1500, turnguard_replay_window_ms=1000)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, **opts) as p:
        for i in range(3):
            status, _, _ = post(p.url, {"session-id": "r"}, {"model": "m", "input": f"brief {i}"})
            assert status == 200
        ledger = tmp_path / "ledger.sqlite3"
        ended = time.time()
        # bound: the retention plus two heartbeats (~5 s each), generously
        purged = False
        for _ in range(40):  # bounded: 40 x 0.25 s = 10 s past the retention
            if query(ledger, "SELECT COUNT(*) FROM operations") == [(0,)]:
                purged = True
                break
            time.sleep(0.25 if time.time() - ended > 1.5 else 1.5)
        assert_no_traceback(p.log_text())
    check(purged, f"operations ended {time.time() - ended:.0f} s ago, with a retention of "
                      "1.5 s, are still in the ledger")


def test_a_recording_past_the_replay_window_leaves_no_bytes_on_disk_while_running(tmp_path):
    """Past the replay window (the retention much longer) a recording's bytes are purged
    from the ledger: from its files too, the -wal included, while the proxy runs (the purge
    deletes the rows; secure_delete and the idle WAL truncation take the bytes)."""
    marker = f"WINDOWED-{secrets.token_hex(6)}"
    opts = dict(turnguard_replay_window_ms=1000)
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "text": marker}}) as up, \
            guarded(tmp_path, up, **opts) as p:
        assert post(p.url, {"session-id": "w"}, {"model": "m", "input": "windowed"})[0] == 200
        ledger = tmp_path / "ledger.sqlite3"
        wait_until(lambda: any(marker.encode() in f.read_bytes() for f in ledger_files(ledger)),
                   10, what="the recording on disk")
        wait_until(lambda: query(ledger, "SELECT COUNT(*) FROM spool") == [(0,)], 15,
                   what="the purge past the replay window")
        assert query(ledger, "SELECT COUNT(*) FROM operations") == [(1,)]  # retention: kept
        gone = False
        for _ in range(60):  # bounded: 60 x 0.25 s after the purge
            if not any(marker.encode() in f.read_bytes() for f in ledger_files(ledger)):
                gone = True
                break
            time.sleep(0.25)
        still = [f.name for f in ledger_files(ledger) if marker.encode() in f.read_bytes()]
        assert_no_traceback(p.log_text())
    check(gone, f"a purged recording's bytes are still in {still}")


def test_no_secret_of_a_websocket_call_reaches_the_ledger_the_events_or_a_debug_log(tmp_path):
    """The WebSocket guard's own paths (handshake headers, a key as the subprotocol, a key in
    the socket's URL, a configured credential header; a call, its duplicate on another
    socket, a call that fails) keep no credential at rest, in the events or in the log, at
    DEBUG too. (mitmdump's own flow lines print each URL: flow_detail=0, as the README says.)"""
    import asyncio

    from turnguard_ws import WsClient, types

    tokens = {name: f"{name}-SECRET-{secrets.token_hex(6)}"
              for name in ("bearer", "proto", "query", "tenant", "cookie")}
    headers = {"authorization": f"Bearer {tokens['bearer']}", "session-id": "ws-secrets",
               "sec-websocket-protocol": f"realtime, openai-insecure-api-key.{tokens['proto']}",
               "x-tenant-key": tokens["tenant"], "cookie": f"sid={tokens['cookie']}"}
    path = f"/v1/responses?api-key={tokens['query']}"
    frame = {"type": "response.create", "model": "gpt-test", "stream": True,
             "input": [{"type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": "keep it"}]}]}
    # the first call's answer stops after response.in_progress until its duplicate is held
    # (order, not a duplicate that had to come within 800 ms of thinking)
    scenario = {"sequence": [{"kind": "ok", "hold": "first", "hold_after_events": 2, "headers": {
        "x-tenant-key": tokens["tenant"], "set-cookie": f"sid={tokens['cookie']}"}},
        {"kind": "reset"}], "default": {"kind": "ok"}}

    async def calls(url: str) -> list[list[str]]:
        async def one(f):
            async with WsClient.connect(url, path=path, headers=headers) as c:
                await c.send(f)
                return types(await c.response())

        first = asyncio.ensure_future(one(frame))
        try:
            await asyncio.to_thread(up.wait_held, "first", 30)
            dup = asyncio.ensure_future(one(frame))  # held, then attached, on another socket
            await asyncio.to_thread(wait_until, lambda: dup.done() or "duplicate_held" in {
                e["event"] for e in read_jsonl(tmp_path / "mitmdump-events.jsonl")}, 30,
                what="the duplicate held")
        finally:
            await asyncio.to_thread(up.release, "first")
        out = [await first, await dup]
        with contextlib.suppress(Exception):  # the upstream resets this one
            out.append(await one({**frame, "input": [{"type": "message", "role": "user",
                                                     "content": "fails"}]}))
        return out

    with MockUpstream(tmp_path, scenario) as up, guarded(
            tmp_path, up, turnguard_credential_headers="x-tenant-key",
            termlog_verbosity="debug", flow_detail=0) as p:
        answers = asyncio.run(calls(p.url))
        assert [a[-1] for a in answers[:2]] == ["response.completed"] * 2, answers
        assert len([d for d in up.dispatches() if d.get("transport") == "ws"]) >= 2
        log = p.log_text()
        assert_no_traceback(log)
    seen = {e["event"] for e in read_jsonl(tmp_path / "mitmdump-events.jsonl")}
    assert {"duplicate_held", "eventless_failure"} <= seen, seen  # the paths were taken
    blobs = {str(f): f.read_bytes() for f in ledger_files(tmp_path / "ledger.sqlite3")}
    blobs["events"] = (tmp_path / "mitmdump-events.jsonl").read_bytes()
    blobs["log"] = log.encode()
    found = [(name, where) for where, blob in blobs.items() for name, token in tokens.items()
             if token.encode() in blob]
    assert not found, found
