"""The reproduction toolkit's client models: their retry schedules, counted against a local
server (the mock upstream) that always answers 503 (with or without Retry-After), and the
gateway executor's re-sends. Bounds, not exact times: the attempts a model makes, the server's
dispatch count, and the waits between attempts within generous tolerances."""

from __future__ import annotations

import asyncio
import sys

import pytest

from harness import REPO, MockUpstream

sys.path.insert(0, str(REPO / "scripts"))

from turnguard_repro import clients  # noqa: E402


def run(model: clients.ClientModel) -> clients.ClientResult:
    return asyncio.run(model.run())


def gaps(result: clients.ClientResult) -> list[float]:
    a = result.attempts
    return [a[i + 1].start - a[i].end for i in range(len(a) - 1)]


def always(tmp_path, **status):
    return MockUpstream(tmp_path, {"default": {"kind": "status", "code": 503, **status}})


def test_codex_cli_honours_retry_after_in_its_inner_loop(tmp_path):
    with always(tmp_path, retry_after=1) as up:
        r = run(clients.CodexCli("codex", up.url, session="s", request_max_retries=2, stream_max_retries=1, seed=1))
        assert r.outcome == "lost" and "stream retries" in r.reason
        assert len(r.attempts) == 6 == len(up.dispatches())  # (2 + 1) x (1 + 1)
        g = gaps(r)
        inner = [g[0], g[1], g[3], g[4]]
        assert all(0.9 <= x <= 1.4 for x in inner), g  # Retry-After: 1
        assert 0.1 <= g[2] <= 0.5, g  # outer backoff 0.2 s
        assert [a.waited_before_s for a in r.attempts][:3] == [0.0, 1.0, 1.0]
        assert r.errors_by_kind() == {"503": 6}


def test_codex_cli_backoff_without_retry_after(tmp_path):
    with always(tmp_path) as up:
        r = run(clients.CodexCli("codex", up.url, request_max_retries=4, stream_max_retries=0, seed=2))
        assert len(r.attempts) == 5 == len(up.dispatches())
        waits = [a.waited_before_s for a in r.attempts[1:]]
        for got, want in zip(waits, [0.2, 0.4, 0.8, 1.6]):
            assert want * 0.89 <= got <= want * 1.11, waits


def test_codex_cli_retries_409_in_the_outer_loop_and_stops_at_400(tmp_path):
    with MockUpstream(tmp_path, {"sequence": [{"kind": "status", "code": 409, "retry_after": 1}],
                                 "default": {"kind": "status", "code": 400}}) as up:
        r = run(clients.CodexCli("codex", up.url, seed=3))
        assert r.outcome == "lost" and r.reason.startswith("fatal answer 400")
        assert [a.status for a in r.attempts] == [409, 400]
        assert 0.9 <= r.attempts[1].waited_before_s <= 1.01  # the 409's Retry-After


def test_impatient_client_ignores_retry_after(tmp_path):
    with always(tmp_path, retry_after=30) as up:
        r = run(clients.Impatient("desktop", up.url, max_attempts=6))
        assert r.outcome == "lost" and "retry budget spent: 6 attempts" in r.reason
        assert len(r.attempts) == 6 == len(up.dispatches())
        assert [a.waited_before_s for a in r.attempts] == [0.0] + [0.2] * 5  # not Retry-After's 30 s
        assert all(g >= 0.15 for g in gaps(r)), gaps(r)


def test_openai_python_honours_retry_after_up_to_120_s(tmp_path):
    with always(tmp_path, retry_after=1) as up:
        r = run(clients.OpenAIPython("sdk", up.url, seed=4))
        assert r.outcome == "lost" and "APIStatusError 503" in r.reason
        assert len(r.attempts) == 3 == len(up.dispatches())  # max_retries = 2
        assert all(0.9 <= g <= 1.4 for g in gaps(r)), gaps(r)
        assert [d.get("client_attempt") for d in up.dispatches()] == ["sdk#1", "sdk#2", "sdk#3"]


def test_openai_python_backoff_and_retry_count_header(tmp_path):
    with always(tmp_path) as up:
        r = run(clients.OpenAIPython("sdk", up.url, seed=5, max_retries=3))
        waits = [a.waited_before_s for a in r.attempts[1:]]
        for got, base in zip(waits, [0.5, 1.0, 2.0]):
            assert base * 0.75 - 0.001 <= got <= base, waits
        assert len(up.dispatches()) == 4


@pytest.mark.parametrize("status, attempts", [
    ({"retry_after": 200}, 1),  # Retry-After over 120 s: no retry
    ({"headers": {"x-should-retry": "false"}}, 1),
    ({"code": 400, "headers": {"x-should-retry": "true"}}, 3),  # the header wins over the status
])
def test_openai_python_should_retry_rules(tmp_path, status, attempts):
    with always(tmp_path, **status) as up:
        r = run(clients.OpenAIPython("sdk", up.url, seed=6))
        assert len(r.attempts) == attempts == len(up.dispatches())


def test_gateway_resends_identical_requests_while_the_original_is_open(tmp_path):
    scenario = {"sequence": [{"kind": "ok", "think_ms": 3000}], "default": {"kind": "ok", "think_ms": 1000}}
    with MockUpstream(tmp_path, scenario) as up:
        r = run(clients.Gateway("gw", up.url, session="s", hedge_after_ms=500, max_parallel=3))
        assert r.outcome == "completed"
        ds = up.dispatches()
        assert len(ds) == 3 and len({d["body_sha256"] for d in ds}) == 1
        assert len({d["conn"] for d in ds}) == 3  # each on its own connection
        # each resend waits for the hedge interval, and goes while the original is still open
        # (it is cancelled once a resend has won)
        starts = [a.start - r.attempts[0].start for a in r.attempts]
        assert all(s >= 0.45 * i for i, s in enumerate(starts)), starts
        assert all(a.start < r.attempts[0].end for a in r.attempts[1:])
        assert r.extra["hedges"] == 2
        assert sorted(a.error or "ok" for a in r.attempts) == ["cancelled", "cancelled", "ok"]


def test_gateway_409_marks_the_account_and_loses_the_turn(tmp_path):
    scenario = {"sequence": [{"kind": "ok", "think_ms": 3000}], "default": {"kind": "status", "code": 409}}
    with MockUpstream(tmp_path, scenario) as up:
        r = run(clients.Gateway("gw", up.url, hedge_after_ms=300))
        assert r.outcome == "lost" and "account marked rate limited" in r.reason
        assert r.extra["accounts_marked_rate_limited"] == 1
        assert len(up.dispatches()) == 2


def test_a_turn_follows_tool_calls_with_the_turn_state(tmp_path):
    with MockUpstream(tmp_path, {"sequence": [{"kind": "tool_call"}, {"kind": "tool_call"}]}) as up:
        r = run(clients.CodexCli("codex", up.url, session="s"))
        assert (r.outcome, r.steps) == ("completed", 3)
        ds = up.dispatches()
        assert ds[0]["turn_state"] is None and ds[1]["turn_state"] == ds[2]["turn_state"] is not None
        assert ds[0]["body_sha256"] != ds[1]["body_sha256"]  # the input grew
        assert [a.turn_state for a in r.attempts] == [False, True, True]


def test_unknown_model_parameters_are_refused():
    with pytest.raises(ValueError, match="unknown parameters"):
        clients.Impatient("x", "http://127.0.0.1:9", retry_gap=1)
    with pytest.raises(ValueError, match="unknown model"):
        clients.make_client({"model": "nope"}, "http://127.0.0.1:9")
