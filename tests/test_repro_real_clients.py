"""Real clients end to end through mitmdump (+ turnguard) against the mock upstream, one
scenario per incident each:

- openai-python (pinned in requirements-test.txt), Responses API streaming: two SDK clients
  racing the same turn (duplicate storm), and the SDK with max_retries=6 against an open
  cooldown (cooldown storm);
- the Codex CLI (``@openai/codex``, pinned below), installed by this module into
  ``.turnguard/node/`` with ``npm install --prefix`` (never globally), running ``codex exec``
  offline with a custom model provider: behind an OmniRoute-like gateway that re-sends
  identical requests (duplicate storm), and a turn whose anchored request fails twice without
  events (cooldown storm). Skipped, with the reason, only when npm is missing.

The Codex config keys used (``model_provider``, ``model_providers.<id>.name|base_url|wire_api|
env_key|request_max_retries|stream_max_retries``) and the flags (``exec --skip-git-repo-check
--ephemeral --ignore-user-config -C -c``) are the ones ``codex exec --help`` documents and the
installed binary accepts (checked with 0.171.0).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness import REPO, LoopbackServer, Mitmdump, MockUpstream, read_jsonl, wait_until

sys.path.insert(0, str(REPO / "scripts"))

from turnguard_procs import Process  # noqa: E402
from turnguard_repro.runner import cooldown_windows  # noqa: E402

CODEX_VERSION = "0.171.0"
NODE_PREFIX = REPO / ".turnguard" / "node"
CODEX_BIN = NODE_PREFIX / "node_modules" / ".bin" / "codex"
KEY_ENV = "TURNGUARD_REPRO_DUMMY_KEY"
CODEX_TIMEOUT_S = 90
SHORT = {"turnguard_cooldown_ms": 3000, "turnguard_response_created_timeout_ms": 1000}
TURN_STATE = {"session-id": "sess-real", "x-codex-turn-state": "ts_real_turn"}
STORM = {"sequence": [{"kind": "stall_before_headers", "ms": 8000}, {"kind": "reset"}],
         "default": {"kind": "ok", "events": 4}}


def proxy(tmp_path, up, name, **options):
    opts = {"turnguard_ledger": str(tmp_path / f"{name}.sqlite3"),
            "turnguard_events": str(tmp_path / f"{name}-events.jsonl"), **SHORT, **options}
    return Mitmdump(tmp_path, up.url, options=opts, name=name)


def events(tmp_path, name, kind):
    return [e for e in read_jsonl(tmp_path / f"{name}-events.jsonl") if e["event"] == kind]


def during_cooldown(tmp_path, name, up) -> int:
    """Dispatches turnguard admitted while a cooldown was open (its ``dispatch`` events): the
    fence's promise. The window comes from the circuit_opened event, whose ts lags the ledger's
    open_until by a few ms: ``cooldown_windows`` trims that slack from its end."""
    windows = cooldown_windows(read_jsonl(tmp_path / f"{name}-events.jsonl"))
    assert windows, "the circuit never opened"
    return sum(1 for e in events(tmp_path, name, "dispatch") if any(a <= e["ts"] < b for a, b in windows))


def diagnose(tmp_path, name, up) -> str:
    """The mock's records and turnguard's events, for an assertion message."""
    lines = [json.dumps(r) for r in up.records()]
    lines += [json.dumps(e) for e in read_jsonl(tmp_path / f"{name}-events.jsonl")]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# openai-python


def sdk(url: str, max_retries: int = 2):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-repro-dummy", max_retries=max_retries,
                         http_client=openai.DefaultHttpxClient(trust_env=False), timeout=60)


def sdk_turn(client, headers) -> tuple[str, str]:
    """One streamed Responses turn; (response id, output text) from response.completed."""
    stream = client.responses.create(model="gpt-test", input="fix the failing test", stream=True,
                                     extra_headers=headers)
    last = None
    for ev in stream:
        last = ev
    assert last is not None and last.type == "response.completed", last
    return last.response.id, last.response.output_text


@pytest.mark.parametrize("guard", [False, True])
def test_openai_python_two_clients_racing_one_turn(tmp_path, guard, report):
    # the first turn stops after response.in_progress until the second attached (or, without
    # turnguard, went upstream): order, not a second client that had to come within 2 s
    scenario = {"sequence": [{"kind": "ok", "hold": "first", "hold_after_events": 2, "events": 3}],
                "default": {"kind": "ok", "think_ms": 500}}
    with MockUpstream(tmp_path, scenario) as up, (
        proxy(tmp_path, up, "tg") if guard else Mitmdump(tmp_path, up.url, addon=False)
    ) as p:
        results: list = [None, None]
        # made first: importing the SDK takes seconds of CPU on a busy machine, which the
        # wait for the first turn below need not include
        clients = [sdk(p.url), sdk(p.url)]

        def race(i: int) -> None:
            results[i] = sdk_turn(clients[i], {"session-id": "sess-race"})

        threads = [threading.Thread(target=race, args=(i,)) for i in range(2)]
        threads[0].start()
        try:
            up.wait_held("first", 60)
            threads[1].start()
            wait_until(lambda: len(up.dispatches()) > 1 or not threads[1].is_alive() or (
                guard and events(tmp_path, "tg", "duplicate_attached")), 30,
                what="the second client attached or upstream")
        finally:
            up.release("first")
        for t in threads:
            t.join(60)
        assert all(r is not None for r in results)
        if guard:
            assert len(up.dispatches()) == 1
            assert results[0] == results[1]  # the same response id and text: one execution
            # the second arrives while the first streams: it attaches to it
            assert len(events(tmp_path, "tg", "duplicate_attached")) == 1
        else:
            assert len(up.dispatches()) == 2 and results[0][0] != results[1][0]
    report(f"openai-python, two clients racing one turn, {'turnguard' if guard else 'plain mitmdump'}: "
           f"upstream dispatches={len(up.dispatches())}")


@pytest.mark.parametrize("detach", [False, True])
def test_openai_python_that_times_out_retries_into_the_detached_call(tmp_path, detach, report):
    """openai-python with a 2 s timeout against an upstream that takes 5 s to answer: each
    timeout drops the connection and the SDK retries the same request. Detached
    (``turnguard_detach_ms``), the upstream call goes on without its client and a retry
    attaches to it (or replays it): one execution, the turn completes. Not detached, every
    retry is cut with its client and runs the turn again."""
    import openai

    scenario = {"default": {"kind": "ok", "delay_ms": 5000, "events": 3}}
    # the upstream's 5 s of silence is no eventless failure here (SHORT cuts it after 1 s)
    options = {"turnguard_response_created_timeout_ms": 20000,
               **({"turnguard_detach_ms": 30000} if detach else {})}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, "tg", **options) as p:
        client = openai.OpenAI(base_url=f"{p.url}/v1", api_key="sk-repro-dummy", max_retries=4,
                               http_client=openai.DefaultHttpxClient(trust_env=False), timeout=2)
        t0 = time.monotonic()
        try:
            result = sdk_turn(client, {"session-id": "sess-timeout"})
        except openai.APIError:  # timed out every time, or the circuit opened
            result = None
        took = time.monotonic() - t0
        dispatches = len(up.dispatches())
        if detach:
            assert result is not None, "the turn must complete through the detached call"
            assert dispatches == 1
            # written as the detached call's own flow ends, which may come just after the
            # retry that attached to it got its last byte
            detached = wait_until(lambda: events(tmp_path, "tg", "upstream_detached"), 10,
                                  what="the detached call's record")
            assert len(detached) == 1 and detached[0]["used"] is True
            assert detached[0]["ran_without_client_ms"] > 0
        else:
            assert dispatches > 1  # each retry ran the turn again
    report(f"openai-python timeout=2 s vs an upstream that takes 5 s, "
           f"{'detached' if detach else 'not detached'}: "
           f"{'completed' if result else 'gave up'} after {took:.1f} s, upstream dispatches="
           f"{dispatches}")


@pytest.mark.parametrize("mode", ["fail_closed", "server_anchored_replay_once"])
def test_openai_python_against_the_cooldown(tmp_path, mode, report):
    with MockUpstream(tmp_path, STORM) as up, proxy(tmp_path, up, "tg", turnguard_recovery_mode=mode) as p:
        started = time.monotonic()
        try:
            rid, text = sdk_turn(sdk(p.url, max_retries=6), TURN_STATE)
        except Exception as e:
            raise AssertionError(diagnose(tmp_path, "tg", up)) from e
        took = time.monotonic() - started
        assert text == "hello" * 4
        assert len(up.dispatches()) == 3, diagnose(tmp_path, "tg", up)  # stall (cut), reset, one more
        assert during_cooldown(tmp_path, "tg", up) == 0, diagnose(tmp_path, "tg", up)
        rejected = events(tmp_path, "tg", "cooldown_rejected")
        if mode == "fail_closed":
            assert rejected  # the SDK saw 503 + Retry-After and waited it out (<= 120 s)
        else:
            assert not rejected  # held through the cooldown: the SDK saw no 503
            assert len(events(tmp_path, "tg", "recovery_claimed")) == 1
    report(f"openai-python max_retries=6 vs cooldown, {mode}: completed in {took:.1f} s, "
           f"503s seen={len(rejected)}, upstream dispatches={len(up.dispatches())}")


# ------------------------------------------------------------------------------------------------
# Codex CLI


@pytest.fixture(scope="module")
def codex() -> Path:
    """The pinned Codex CLI in .turnguard/node (installed once; npm's cache makes it quick)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: cannot install @openai/codex for the Codex CLI tests")
    pkg = NODE_PREFIX / "node_modules" / "@openai" / "codex" / "package.json"
    installed = json.loads(pkg.read_text()).get("version") if pkg.exists() else None
    if installed != CODEX_VERSION or not CODEX_BIN.exists():
        NODE_PREFIX.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [npm, "install", "--prefix", str(NODE_PREFIX), "--no-audit", "--no-fund", "--no-save",
             f"@openai/codex@{CODEX_VERSION}"],
            capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, f"npm install @openai/codex@{CODEX_VERSION} failed:\n{proc.stdout}\n{proc.stderr}"
    version = subprocess.run([str(CODEX_BIN), "--version"], capture_output=True, text=True, timeout=60)
    assert CODEX_VERSION in version.stdout, version.stdout + version.stderr
    return CODEX_BIN


def codex_exec(codex: Path, tmp_path: Path, base_url: str, prompt: str = "say hello",
               *config: str) -> subprocess.CompletedProcess[str]:
    home, work = tmp_path / "codex-home", tmp_path / "codex-work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and not k.startswith(("OPENAI_", "CODEX_"))}
    env.update({"CODEX_HOME": str(home), KEY_ENV: "sk-repro-dummy-not-a-secret", "NO_COLOR": "1"})
    cmd = [
        str(codex), "exec", "--skip-git-repo-check", "--ephemeral", "--ignore-user-config",
        "-C", str(work), "-m", "gpt-test",
        "-c", "model_provider=repro",
        "-c", 'model_providers.repro.name="turnguard repro"',
        "-c", f'model_providers.repro.base_url="{base_url}/v1"',
        "-c", 'model_providers.repro.wire_api="responses"',
        "-c", f'model_providers.repro.env_key="{KEY_ENV}"',
        *[a for c in config for a in ("-c", c)],
        prompt,
    ]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=CODEX_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, cwd=work, env=env)
    except subprocess.TimeoutExpired as e:  # subprocess.run killed it; report what it printed
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(cmd, -9, out, f"codex exec timed out after {CODEX_TIMEOUT_S} s\n{err}")


GATEWAY_LINE = re.compile(r"gateway listening at (http://127\.0\.0\.1:\d+)")


class Gateway:
    """scripts/turnguard_repro/gateway_server.py in front of ``upstream``."""

    def __init__(self, tmp_path: Path, upstream: str, hedge_after_ms: int = 1000):
        self.log = tmp_path / "gateway.jsonl"
        self.process = Process(
            [sys.executable, "-m", "turnguard_repro.gateway_server", "--upstream", upstream,
             "--hedge-after-ms", str(hedge_after_ms), "--max-parallel", "3", "--log", str(self.log)],
            tmp_path / "gateway.out", env={"PYTHONPATH": str(REPO / "scripts")})
        self.url = self.process.wait_for_line(GATEWAY_LINE, 20, "the gateway").group(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.stop()


@pytest.mark.parametrize("guard", [False, True])
def test_codex_cli_behind_a_resending_gateway(codex, tmp_path, guard, report):
    scenario = {"sequence": [{"kind": "ok", "think_ms": 3500, "events": 3}],
                "default": {"kind": "ok", "think_ms": 2000, "events": 3}}
    with MockUpstream(tmp_path, scenario) as up, (
        proxy(tmp_path, up, "tg") if guard else Mitmdump(tmp_path, up.url, addon=False)
    ) as p, Gateway(tmp_path, p.url) as gw:
        done = codex_exec(codex, tmp_path, gw.url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "hellohellohello" in done.stdout
        (relay,) = read_jsonl(gw.log)
        assert relay["outcome"] == "completed" and relay["hedges"] == 2  # 3 identical requests
        ds = up.dispatches()
        assert len({d["session"] for d in ds}) == 1 and len({d["body_sha256"] for d in ds}) == 1
        if guard:
            assert len(ds) == 1  # the gateway's two re-sends were held and replayed
            assert len(events(tmp_path, "tg", "duplicate_held")) == 2
        else:
            assert len(ds) == 3  # the upstream ran Codex's turn three times
    report(f"codex exec {CODEX_VERSION} behind a re-sending gateway, "
           f"{'turnguard' if guard else 'plain mitmdump'}: upstream dispatches={len(ds)}")


@pytest.mark.parametrize("mode", ["fail_closed", "server_anchored_replay_once"])
def test_codex_cli_turn_state_request_through_the_cooldown(codex, tmp_path, mode, report):
    scenario = {"sequence": [{"kind": "tool_call"}, {"kind": "stall_before_headers", "ms": 8000},
                             {"kind": "reset"}], "default": {"kind": "ok", "events": 3}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, "tg", turnguard_recovery_mode=mode) as p:
        started = time.monotonic()
        done = codex_exec(codex, tmp_path, p.url, "look it up")
        took = time.monotonic() - started
        assert done.returncode == 0, done.stdout + done.stderr + diagnose(tmp_path, "tg", up)
        assert "hellohellohello" in done.stdout
        ds = up.dispatches()
        assert ds[0]["turn_state"] is None and all(d["turn_state"] == ds[1]["turn_state"] for d in ds[1:])
        assert ds[1]["turn_state"] is not None  # Codex echoed the turn-state after the tool call
        assert len(ds) == 4 and during_cooldown(tmp_path, "tg", up) == 0, diagnose(tmp_path, "tg", up)
        rejected = events(tmp_path, "tg", "cooldown_rejected")
        if mode == "fail_closed":
            assert rejected  # Codex CLI got 503 + Retry-After and waited it out
        else:
            assert not rejected and len(events(tmp_path, "tg", "recovery_claimed")) == 1
    report(f"codex exec {CODEX_VERSION}, turn-state request vs cooldown, {mode}: completed in "
           f"{took:.1f} s, 503s seen={len(rejected)}, upstream dispatches={len(ds)}")


# ------------------------------------------------------------------------------------------------
# Codex CLI on its default transport: the built-in provider, Responses over WebSocket


def codex_ws_exec(codex: Path, tmp_path: Path, base_url: str,
                  prompt: str = "say hello") -> subprocess.CompletedProcess[str]:
    """``codex exec`` pointed at turnguard the way users do it (``openai_base_url`` with the
    built-in ``openai`` provider): it speaks the Responses API over a WebSocket."""
    home, work = tmp_path / "codex-home", tmp_path / "codex-work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and not k.startswith(("OPENAI_", "CODEX_"))}
    env.update({"CODEX_HOME": str(home), "OPENAI_API_KEY": "sk-repro-dummy-not-a-secret",
                "NO_COLOR": "1"})
    cmd = [str(codex), "exec", "--skip-git-repo-check", "--ephemeral", "--ignore-user-config",
           "-C", str(work), "-c", f'openai_base_url="{base_url}/v1"', prompt]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=CODEX_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, cwd=work, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(cmd, -9, out, f"codex exec timed out after {CODEX_TIMEOUT_S} s\n{err}")


def test_codex_cli_over_websocket_a_turn_with_a_tool_call(codex, tmp_path, report):
    scenario = {"sequence": [{"kind": "tool_call", "name": "repro_lookup"}],
                "default": {"kind": "ok", "events": 3}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, "tg") as p:
        done = codex_ws_exec(codex, tmp_path, p.url, "look it up")
        assert done.returncode == 0, done.stdout + done.stderr + diagnose(tmp_path, "tg", up)
        assert "hellohellohello" in done.stdout
        ds = up.dispatches()
        assert [d["transport"] for d in ds] == ["ws", "ws"], diagnose(tmp_path, "tg", up)
        assert ds[1]["previous_response_id"] is not None  # the follow-up: a delta on its socket
        dispatched = events(tmp_path, "tg", "dispatch")
        assert [(d["transport"], d["kind"]) for d in dispatched] == [("ws", "original")] * 2
        assert [o["outcome"] for o in events(tmp_path, "tg", "outcome")] == ["completed"] * 2
    report(f"codex exec {CODEX_VERSION} over WebSocket, a turn with a tool call: upstream "
           f"dispatches={len(ds)} (one per model call)")


@pytest.mark.parametrize("mode", ["fail_closed", "server_anchored_replay_once"])
def test_codex_cli_over_websocket_through_the_cooldown(codex, tmp_path, mode, report):
    """The socket closes right after the frame twice (no event): the circuit opens. Default:
    Codex gets 503 error events, goes down its reconnect ladder (and maybe to its POST
    fallback, the same operation) and completes once the cooldown is over. Once mode: its next
    frame is held through the cooldown and recovered with one dispatch."""
    scenario = {"sequence": [{"kind": "clean_close"}, {"kind": "clean_close"}],
                "default": {"kind": "ok", "events": 3}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, "tg", turnguard_recovery_mode=mode) as p:
        started = time.monotonic()
        done = codex_ws_exec(codex, tmp_path, p.url)
        took = time.monotonic() - started
        assert done.returncode == 0, done.stdout + done.stderr + diagnose(tmp_path, "tg", up)
        assert "hellohellohello" in done.stdout
        ds = up.dispatches()
        assert len(ds) == 3 and during_cooldown(tmp_path, "tg", up) == 0, diagnose(tmp_path, "tg", up)
        rejected = events(tmp_path, "tg", "cooldown_rejected")
        if mode == "fail_closed":
            assert rejected and all(r["transport"] in ("ws", "http") for r in rejected)
        else:
            assert not rejected and len(events(tmp_path, "tg", "recovery_claimed")) == 1
    report(f"codex exec {CODEX_VERSION} over WebSocket vs cooldown, {mode}: completed in "
           f"{took:.1f} s, 503s seen={len(rejected)}, upstream dispatches={len(ds)} "
           f"({', '.join(d['transport'] for d in ds)})")


def test_codex_cli_post_fallback_is_the_same_operation_as_its_websocket_frames(codex, tmp_path, report):
    """A cooldown longer than Codex's reconnect ladder: it falls back to HTTP POST while the
    circuit still cools. turnguard knows the POST as the frames' operation (the same op in
    every 503), sends nothing upstream in the cooldown, and the turn completes after it."""
    scenario = {"sequence": [{"kind": "clean_close"}, {"kind": "clean_close"}],
                "default": {"kind": "ok", "events": 3}}
    with MockUpstream(tmp_path, scenario) as up, \
            proxy(tmp_path, up, "tg", turnguard_cooldown_ms=9000) as p:
        started = time.monotonic()
        done = codex_ws_exec(codex, tmp_path, p.url)
        took = time.monotonic() - started
        assert done.returncode == 0, done.stdout + done.stderr + diagnose(tmp_path, "tg", up)
        assert "hellohellohello" in done.stdout
        assert "Falling back from WebSockets to HTTPS transport" in done.stderr
        ds = up.dispatches()
        assert [d["transport"] for d in ds] == ["ws", "ws", "http"], diagnose(tmp_path, "tg", up)
        assert during_cooldown(tmp_path, "tg", up) == 0, diagnose(tmp_path, "tg", up)
        rejected = events(tmp_path, "tg", "cooldown_rejected")
        assert {r["transport"] for r in rejected} == {"ws", "http"}
        ops = {e["op"] for e in [*rejected, *events(tmp_path, "tg", "dispatch")]}
        assert len(ops) == 1, diagnose(tmp_path, "tg", up)  # one operation on both transports
    report(f"codex exec {CODEX_VERSION}: WebSocket frames and their HTTP POST fallback as one "
           f"operation through a 9 s cooldown: completed in {took:.1f} s, 503s seen="
           f"{len(rejected)} ({sum(r['transport'] == 'http' for r in rejected)} over HTTP)")


@pytest.mark.parametrize("detach", [False, True])
def test_codex_cli_over_websocket_whose_socket_drops_is_answered_by_the_detached_call(
        codex, tmp_path, detach, report):
    """Codex over a WebSocket with a 2.5 s stream idle timeout, against an upstream that thinks
    6 s after response.created: Codex drops its socket and retries on a new one (full input).
    Detached, the call goes on upstream without the dropped socket and each retry attaches
    to it: one upstream execution, and the turn completes. Not detached, each drop cuts the
    call and its retry runs the turn again (shown with one retry: Codex's five, each cut
    too, took 45 s for nothing more)."""
    scenario = {"default": {"kind": "ok", "think_ms": 6000, "events": 3}}
    options = {"turnguard_response_created_timeout_ms": 30000,
               **({"turnguard_detach_ms": 60000} if detach else {})}
    retries = () if detach else ("model_providers.repro.stream_max_retries=1",)
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, "tg", **options) as p:
        started = time.monotonic()
        done = codex_exec(codex, tmp_path, p.url, "say hello",
                          "model_providers.repro.supports_websockets=true",
                          "model_providers.repro.stream_idle_timeout_ms=2500", *retries)
        took = time.monotonic() - started
        ds = up.dispatches()
        attached = events(tmp_path, "tg", "duplicate_attached")
        if not detach:
            assert len(ds) > 1, diagnose(tmp_path, "tg", up)
        else:
            assert done.returncode == 0, done.stdout + done.stderr + diagnose(tmp_path, "tg", up)
            assert "hellohellohello" in done.stdout
            assert len(ds) == 1, diagnose(tmp_path, "tg", up)
            assert attached and all(a["transport"] == "ws" for a in attached)
            detached = wait_until(lambda: events(tmp_path, "tg", "upstream_detached"), 10,
                                  what="the detached call's record")
            assert detached[0]["used"] is True
            assert detached[0]["outcome"] == "completed"
    report(f"codex exec {CODEX_VERSION} over WebSocket, idle timeout 2.5 s vs a 6 s think, "
           f"{'detached' if detach else 'not detached'}: "
           f"{'completed' if done.returncode == 0 else f'rc {done.returncode}'} in {took:.1f} s, "
           f"{len(attached)} retries attached, upstream dispatches={len(ds)}")


def test_codex_cli_over_websocket_a_follow_up_and_its_resend_on_a_new_socket_are_one_operation(
        codex, tmp_path, report):
    """A turn with a tool call: the follow-up goes on the socket as a delta frame, and the
    socket closes right after it (no event); Codex resends it on a new socket with its full
    input, the tool call as it keeps it in its history (with its own bookkeeping members).
    turnguard identifies the delta by its full request, rebuilt from what the socket carried:
    the two are one operation (the same op in both dispatches), as the retry ladder and the
    POST fallback of any call are."""
    scenario = {"sequence": [{"kind": "tool_call", "name": "repro_lookup"},
                             {"kind": "clean_close"}],
                "default": {"kind": "ok", "events": 3}}
    with MockUpstream(tmp_path, scenario) as up, proxy(tmp_path, up, "tg") as p:
        done = codex_ws_exec(codex, tmp_path, p.url, "look it up")
        assert done.returncode == 0, done.stdout + done.stderr + diagnose(tmp_path, "tg", up)
        assert "hellohellohello" in done.stdout
        ds = up.dispatches()
        assert [(d["transport"], d["previous_response_id"] is not None) for d in ds] == [
            ("ws", True), ("ws", True), ("ws", False)], diagnose(tmp_path, "tg", up)
        ops = [d["op"] for d in events(tmp_path, "tg", "dispatch")]
        assert len(ops) == 3 and ops[1] == ops[2], diagnose(tmp_path, "tg", up)
    report(f"codex exec {CODEX_VERSION} over WebSocket: a follow-up delta and its full resend on "
           f"a new socket ({ds[1]['input_items']} and {ds[2]['input_items']} input items) are one "
           "operation")


class UpgradeRefusingFront(LoopbackServer):
    """A front for the mock upstream that answers every WebSocket upgrade with ``status`` and
    relays every other connection to the mock as it is (byte for byte, both ways)."""

    def __init__(self, target_port: int, status: int):
        self.target_port, self.status, self.refused = target_port, status, 0
        super().__init__()

    async def handle(self, reader, writer) -> None:
        import asyncio
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            if b"\nupgrade: websocket" in head.lower():
                self.refused += 1
                body = b'{"error":{"message":"upgrade refused","type":"invalid_request_error"}}'
                writer.write(f"HTTP/1.1 {self.status} Refused\r\ncontent-type: application/json"
                             f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
                             .encode() + body)
                await writer.drain()
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            up_writer.write(head)

            async def pipe(src, dst) -> None:
                for _ in range(1_000_000):  # bounded: each pass reads
                    data = await src.read(65536)
                    if not data:
                        break
                    dst.write(data)
                    await dst.drain()
                dst.close()

            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer),
                                 return_exceptions=True)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


@pytest.mark.parametrize("status", [426, 500])
def test_codex_cli_whose_upgrade_is_refused_falls_back_to_a_guarded_post(
        codex, tmp_path, status, report):
    """The upstream refuses every WebSocket upgrade: with 426 Codex goes straight to its HTTP
    POST, with 500 after its reconnect ladder (measured: 1 + 6 upgrades). The refused
    upgrades pass turnguard untouched (a GET whose upgrade did not succeed is no guarded
    flow) and the POST is guarded as any: dispatched once, recorded, the turn completes."""
    with MockUpstream(tmp_path) as up, UpgradeRefusingFront(up.port, status) as front, \
            proxy(tmp_path, front, "tg") as p:
        done = codex_ws_exec(codex, tmp_path, p.url)
        assert done.returncode == 0, done.stdout + done.stderr + diagnose(tmp_path, "tg", up)
        assert "hellohellohello" in done.stdout
        assert front.refused >= 1
        assert [d["transport"] for d in up.dispatches()] == ["http"], diagnose(tmp_path, "tg", up)
        dispatched = events(tmp_path, "tg", "dispatch")
        assert [(d["transport"], d["kind"]) for d in dispatched] == [("http", "original")]
        assert [o["outcome"] for o in events(tmp_path, "tg", "outcome")] == ["completed"]
    report(f"codex exec {CODEX_VERSION}, every WebSocket upgrade refused with {status} "
           f"({front.refused} refused): its POST guarded, upstream dispatches=1")
