"""Capture to scenario, round trip: the test records a flow file itself (``mitmdump -w`` in front
of the mock upstream), turns it into a scenario with ``reproduce from-capture`` (the real
wrapper), checks what was extracted and that no secret survived, then replays it with
``reproduce run`` and compares the upstream dispatches with the capture's."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness import REPO, Mitmdump, MockUpstream, sse_post, wait_until

REPRODUCE = REPO / "scripts" / "reproduce"
CAPTURE_ADDON = REPO / "scripts" / "turnguard_repro" / "capture_addon.py"
SECRET = "sk-live-CAPTURE-SECRET-0123456789"
ACCOUNT = "acct-SECRET-4242"
COOKIE = "session=COOKIE-SECRET-77"
# every kind of credential header: listed, spelled with "_", a subprotocol, one the proxy's
# turnguard_credential_headers would add (named to from-capture with --credential-header)
HEADERS = {"authorization": f"Bearer {SECRET}", "chatgpt-account-id": ACCOUNT, "cookie": COOKIE,
           "session-id": "sess-cap", "x-api-key": "another-SECRET-key",
           "x_goog_user_project": "project-SECRET-9", "OpenAI_Organization": "org-SECRET-5",
           "sec-websocket-protocol": "realtime, openai-insecure-api-key.sk-SECRET-WS",
           "x-tenant": "tenant-SECRET-3"}


def body(text: str) -> dict:
    return {"model": "gpt-test", "input": [{"role": "user", "content": f"private prompt {text}"}], "stream": True}


def post(url: str, text: str, headers=HEADERS) -> int:
    try:
        return sse_post(url, body=body(text), headers=headers, timeout=30)[0]
    except httpx.HTTPError:
        return 0


def reproduce(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNGUARD_")}
    proc = subprocess.run([str(REPRODUCE), *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_capture_to_scenario_round_trip(tmp_path, report):
    flows = tmp_path / "incident.flows"
    upstream = {"sequence": [
        # A, the original: it thinks, then waits for the test's release, given once A's
        # duplicate went upstream (the overlap, by order, not a duplicate 0.3 s into 1.5 s)
        {"kind": "ok", "think_ms": 1500, "events": 3, "hold": "A", "hold_after_events": 2},
        {"kind": "ok", "think_ms": 800, "events": 3},  # A again, while A runs: a duplicate
        {"kind": "partial", "events": 3},  # B
        {"kind": "status", "code": 429, "retry_after": 1, "headers": {"x-should-retry": "true"}},  # B again
        {"kind": "stall_before_headers", "ms": 1200},  # C
        {"kind": "tool_call", "name": "lookup"},  # D
    ]}
    with MockUpstream(tmp_path, upstream) as up, \
            Mitmdump(tmp_path, up.url, addon=False, extra_args=["-w", str(flows), "-s", str(CAPTURE_ADDON)]) as proxy:
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(post, proxy.url, "A")
            try:
                up.wait_for_record(lambda r: r.get("event") == "dispatch", 30)
                second = pool.submit(post, proxy.url, "A")
                wait_until(lambda: len(up.dispatches()) == 2 or second.done(), 30,
                           what="A's duplicate upstream")
            finally:
                up.release("A")
            statuses = [first.result(), second.result()]
        statuses += [post(proxy.url, "B"), post(proxy.url, "B"), post(proxy.url, "C"), post(proxy.url, "D")]
        captured = len(up.dispatches())
    assert statuses[:2] == [200, 200] and statuses[3] == 429 and captured == 6

    scenario_path = tmp_path / "scenario.json"
    scenario_path.write_text("{}")
    scenario_path.chmod(0o644)  # a file that was there is made private too
    out = reproduce("from-capture", str(flows), "-o", str(scenario_path),
                    "--credential-header", "X-Tenant").stdout
    assert "6 model requests" in out and "authorization x6" in out
    text = scenario_path.read_text()
    assert scenario_path.stat().st_mode & 0o777 == 0o600
    assert "SECRET" not in text and "private prompt" not in text
    scen = json.loads(text)
    (client,) = scen["clients"]
    reqs = client["params"]["requests"]
    assert client["model"] == "timeline" and client["session"] == "sess-cap" and len(reqs) == 6
    assert {r["headers"]["authorization"] for r in reqs} == {"Bearer sk-repro-credential-1"}
    assert all("cookie" not in r["headers"] and "chatgpt-account-id" not in r["headers"] for r in reqs)
    assert reqs[0]["body_text"] == reqs[1]["body_text"] != reqs[2]["body_text"]
    # in the order sent, the second while the first ran (the run below recreates the overlap)
    assert 0 <= reqs[1]["at_ms"] - reqs[0]["at_ms"]
    ops = scen["upstream"]["operations"]
    assert sorted(len(o["sequence"]) for o in ops.values()) == [1, 1, 2, 2]
    kinds = sorted(b["kind"] for o in ops.values() for b in o["sequence"])
    assert kinds == ["ok", "ok", "partial", "stall_before_headers", "status", "tool_call"]
    seqs = {o["sequence"][0]["kind"]: o["sequence"] for o in ops.values()}
    assert [b.get("events") for b in seqs["ok"]] == [3, 3]
    assert seqs["partial"][0]["events"] == 3 and seqs["partial"][1]["code"] == 429
    assert seqs["partial"][1]["retry_after"] == 1 and seqs["partial"][1]["headers"] == {"x-should-retry": "true"}
    assert seqs["stall_before_headers"][0]["ms"] >= 1000  # the 1,200 ms stall, as captured
    assert seqs["tool_call"][0]["name"] == "lookup"
    # each was sent after the one before it ended (B after A and A's duplicate, B's retry
    # after B's cut, ...), but A's duplicate while A ran
    afters = [r.get("after") for r in reqs]
    assert afters[:2] == [None, None] and afters[2] in (0, 1) and afters[3:] == [2, 3, 4]
    assert all(r["after_gap_ms"] >= 0 for r in reqs[2:])
    # the replay's timings drift from the capture's: B's stream starts 0.7 s later than it
    # did; its retry still comes after its cut (at its recorded offset alone it would come
    # while B streams, and be attached to B's attempt: one dispatch fewer), C after that
    seqs["partial"][0]["delay_ms"] = seqs["partial"][0].get("delay_ms", 0) + 700
    scenario_path.write_text(json.dumps(scen))

    data = json.loads(reproduce("run", str(scenario_path), "--json", "--columns", "plain,default").stdout)
    plain, default = data["columns"]["plain"]["metrics"], data["columns"]["default"]["metrics"]
    assert plain["upstream_dispatches"] == captured  # the replay recreates the capture
    assert plain["max_in_flight_per_operation"] == 2  # A ran twice at once, as captured
    # turnguard held A's duplicate (the dispatches and the telemetry counts say what else
    # happened, should this fail)
    assert default["upstream_dispatches"] == captured - 1, (
        data["columns"]["default"]["dispatches"], default["turnguard"])
    # A's duplicate got A's response: attached to it live, or replayed after its end
    assert default["turnguard"]["replayed"] + default["turnguard"]["attached"] == 1
    dispatched = data["columns"]["plain"]["dispatches"]
    assert [d["behaviour"] for d in dispatched] == ["ok", "ok", "partial", "status", "stall_before_headers", "tool_call"]
    # the capture's own timings: C's 1.2 s stall plays out whole (nothing shortened)
    assert data["timings"]["turnguard_response_created_timeout_ms"]["value"] == 60000
    assert data["warnings"] == [] and default["turnguard"]["upstream_cuts"] == 0
    # B was retried and never completed: lost; C failed once and nobody retried it: apart
    assert plain["outcomes"] == {client["name"]: "lost"} and plain["failed_not_retried"] == 1
    table = reproduce("run", str(scenario_path), "--columns", "default",
                      "--set", "turnguard_response_created_timeout_ms=1000").stdout
    assert "turnguard_response_created_timeout_ms=1000 (production 60000)" in table
    assert "WARNING: " in table and "longer than turnguard_response_created_timeout_ms=1000" in table
    assert "failed, no client retried" in table
    report(f"capture round trip: captured {captured} dispatches; replay plain={plain['upstream_dispatches']}, "
           f"turnguard default={default['upstream_dispatches']} (duplicate replayed)")


def test_a_key_in_the_url_is_not_kept_and_requests_that_shared_a_url_still_do():
    from turnguard_repro import capture

    clean = capture._Cleaner(keep_bodies=False)
    assert clean.path("/v1/responses") == "/v1/responses"
    by_query = clean.path("/v1/responses?key=sk-SECRET-1")
    in_path = clean.path("/sk-SECRET-2/v1/responses")
    assert clean.path("/v1/responses?key=sk-SECRET-1") == by_query != in_path
    assert "SECRET" not in by_query + in_path
    assert by_query.endswith("/responses") and in_path.endswith("/responses")
    assert clean.path("/openai/deployments/x/chat/completions?api-version=1").endswith(
        "/chat/completions")


def test_every_credential_header_is_dropped_and_distinct_credentials_stay_distinct():
    from mitmproxy.http import Headers

    from turnguard_core.identity import CREDENTIAL_HEADERS
    from turnguard_repro import capture

    clean = capture._Cleaner(keep_bodies=False, credential_headers=frozenset({"x-tenant"}))
    for name in (*CREDENTIAL_HEADERS, "x-tenant"):
        for spelling in (name, name.replace("-", "_"), name.upper()):
            out = clean.headers(Headers([(spelling.encode(), b"SECRET-value")]))
            assert "SECRET" not in json.dumps(out), spelling
    one = clean.headers(Headers(authorization="Bearer a", x_api_key="k1"))
    again = clean.headers(Headers(authorization="Bearer a", x_api_key="k1"))
    other = clean.headers(Headers(authorization="Bearer a", x_api_key="k2"))
    assert one == again != other  # what turnguard takes for one principal, and only that


def test_an_error_body_keeps_no_credential_of_the_request():
    """An upstream's 401 quotes the key it refused (OpenAI shows it partly masked), another
    error echoes a header: the scenario's behaviour keeps neither."""
    from mitmproxy.test import tflow

    from turnguard_repro import capture

    for body in (b'{"error": {"message": "Incorrect API key provided: sk-proj-abc***wxyz."}}',
                 b'{"error": {"message": "unknown org org-SECRET-77, key sk-live-SECRET-1"}}',
                 b"plain text: tenant tenant-SECRET-3 refused"):
        flow = tflow.tflow(resp=True)
        flow.request.headers["authorization"] = "Bearer sk-live-SECRET-1"
        flow.request.headers["OpenAI_Organization"] = "org-SECRET-77"
        flow.request.headers["x-tenant"] = "tenant-SECRET-3"
        flow.response.status_code = 401
        flow.response.set_content(body)
        b = capture.behaviour_of(flow, False, frozenset({"x-tenant"}))
        text = json.dumps(b)
        assert b["code"] == 401 and "SECRET" not in text and "abc***" not in text, text


@pytest.mark.parametrize("path, echoed", [
    ("/v1/responses?api-key=AZ-SECRET-1234", "Invalid URL (POST /v1/responses?api-key=AZ-SECRET-1234)"),
    ("/v1/responses?access_token=TOK-SECRET-77&x=1", "token TOK-SECRET-77 expired"),
    ("/kSECRET4242/v1/responses", "Invalid URL (POST /kSECRET4242/v1/responses)"),
    ("/v1/responses", "cookie sid=COOKIE-SECRET-9 refused, other OTHER-SECRET-3 too"),
], ids=["query key", "query token alone", "key in the path", "one cookie of two"])
def test_an_error_body_that_quotes_a_url_key_or_one_cookie_keeps_neither(tmp_path, path, echoed):
    """An upstream's 404 quotes the URL it did not know (a key in its query or path with it),
    a 401 the one cookie it refused: the request's credentials too, which the scenario file
    ``reproduce from-capture`` writes must not keep (the URL and the Cookie header themselves
    are replaced)."""
    from mitmproxy import io
    from mitmproxy.test import tflow, tutils

    request = tutils.treq(method=b"POST", path=path.encode(),
                          content=json.dumps(body("A")).encode())
    request.headers["cookie"] = "sid=COOKIE-SECRET-9; other=OTHER-SECRET-3"
    response = tutils.tresp(status_code=404 if "URL" in echoed else 401,
                            content=json.dumps({"error": {"message": echoed}}).encode())
    flows = tmp_path / "c.flows"
    with open(flows, "wb") as f:
        io.FlowWriter(f).add(tflow.tflow(req=request, resp=response))
    out = tmp_path / "s.json"
    reproduce("from-capture", str(flows), "-o", str(out))
    scenario = out.read_text()
    assert "SECRET" not in scenario, scenario
    [operation] = json.loads(scenario)["upstream"]["operations"].values()
    assert operation["sequence"][0]["code"] in (401, 404), scenario  # the error is kept


def test_a_file_that_is_no_flow_file_gets_one_clear_line(tmp_path):
    for name, data in [("truncated.flows", b"99999999999:abc"), ("junk.flows", b"not a capture")]:
        bad = tmp_path / name
        bad.write_bytes(data)
        proc = subprocess.run([str(REPRODUCE), "from-capture", str(bad), "-o",
                               str(tmp_path / "s.json")], capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL, cwd=REPO)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "not a mitmproxy flow file" in proc.stderr and "Traceback" not in proc.stderr


def _one_flow_file(path) -> None:
    from mitmproxy import io
    from mitmproxy.test import tflow, tutils

    request = tutils.treq(method=b"POST", path=b"/v1/responses",
                          content=json.dumps(body("A")).encode())
    with open(path, "wb") as f:
        io.FlowWriter(f).add(tflow.tflow(req=request, resp=tutils.tresp()))


@pytest.mark.parametrize("kind", ["device", "fifo", "symlink"])
def test_an_output_that_is_no_regular_file_is_refused_and_left_untouched(tmp_path, kind):
    """-o naming a device (/dev/null as root: made 0600, nobody else could use it), a FIFO
    (blocked for ever) or a symlink (written through, its target made 0600): refused, one
    line, nothing changed."""
    flows = tmp_path / "c.flows"
    _one_flow_file(flows)
    out = tmp_path / "out"
    target = tmp_path / "victim.txt"
    if kind == "device":
        os.mknod(out, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a copy of /dev/null
        os.chmod(out, 0o666)
    elif kind == "fifo":
        os.mkfifo(out, 0o644)
    else:
        target.write_text("keep me\n")
        target.chmod(0o644)
        out.symlink_to(target)
    before = os.lstat(out)
    proc = subprocess.run([str(REPRODUCE), "from-capture", str(flows), "-o", str(out)],
                          capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL, cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr
    assert os.lstat(out).st_mode == before.st_mode
    if kind == "symlink":
        assert target.read_text() == "keep me\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
