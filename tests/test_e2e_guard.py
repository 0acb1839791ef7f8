"""End to end: real mitmdump + turnguard subprocesses in front of the real mock upstream.

Every assertion counts what the upstream saw (its dispatch log) and what each client got."""

import asyncio
import gzip
import json
import os
import sqlite3
import stat
import subprocess
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import (
    MITMDUMP,
    ADDON,
    MockUpstream,
    assert_no_traceback,
    asse_post,
    guarded,
    response_id,
    sse_event_types,
    sse_post,
    turnguard_events,
    wait_until,
)

SECRET = "sk-test-SECRET-do-not-store-0123456789"
HEADERS = {"authorization": f"Bearer {SECRET}", "session-id": "sess-1"}
BODY = {"model": "gpt-test", "input": "write a haiku", "stream": True}


def post_all(url, up, n, *, body=BODY, headers=HEADERS, stagger_s=0.0):
    """Send n identical requests, each on its own connection; the first alone until the
    upstream ``up`` has its dispatch, so that it is the original (a pause of a fixed length
    was no order: on a loaded machine the first client's thread may start later than that).
    Returns [(status, headers, body)] in sending order."""
    dispatched = len(up.dispatches())
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(sse_post, url, body=body, headers=headers, timeout=90)]
        wait_until(lambda: len(up.dispatches()) > dispatched or futures[0].done(), 30,
                   what="the first request dispatched")
        for _ in range(n - 1):
            futures.append(pool.submit(sse_post, url, body=body, headers=headers, timeout=90))
            time.sleep(stagger_s)
        return [f.result() for f in futures]


def test_stalled_original_and_five_duplicates_give_one_dispatch_and_six_identical_answers(
    tmp_path, report
):
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 4000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        results = post_all(proxy.url, up, 6, stagger_s=0.1)
        statuses = [s for s, _, _ in results]
        bodies = {b for _, _, b in results}
        assert statuses == [200] * 6
        assert len(bodies) == 1, "all six clients must get byte-identical SSE bodies"
        assert sse_event_types(results[0][2])[-1] == "response.completed"
        assert len(up.dispatches()) == 1
        # held while the original stalled, then attached to its stream once it started
        assert [h.get("x-turnguard") for _, h, _ in results[1:]] == ["attached"] * 5
        assert results[0][1].get("x-turnguard") is None  # the original passes untouched
        assert len(turnguard_events(tmp_path, kind="duplicate_held")) == 5
        assert len(turnguard_events(tmp_path, kind="duplicate_attached")) == 5
        assert not turnguard_events(tmp_path, kind="duplicate_rejected")
        assert_no_traceback(proxy.log_text())
    report(
        "duplicate storm (original stalled 4 s, 5 duplicates on their own connections): "
        f"upstream dispatches={len(up.dispatches())}, statuses={statuses}, "
        f"distinct bodies={len(bodies)}, 409s={statuses.count(409)}"
    )


def test_duplicates_past_the_hold_bound_get_409_with_retry_after_then_replay(tmp_path, report):
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 3500}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(
        tmp_path, up, turnguard_hold_timeout_ms=800
    ) as proxy:
        results = post_all(proxy.url, up, 3)
        assert results[0][0] == 200
        for status, headers, body in results[1:]:
            assert status == 409
            assert int(headers["retry-after"]) >= 1
            assert headers["x-should-retry"] == "true"
            err = json.loads(body)["error"]
            assert err["code"] == err["type"] == "turn_in_progress"
        # the client's retry after the original completed is answered from the recording
        status, headers, body = sse_post(proxy.url, body=BODY, headers=HEADERS)
        assert status == 200 and headers["x-turnguard"] == "replayed"
        assert body == results[0][2]
        assert len(up.dispatches()) == 1
        assert len(turnguard_events(tmp_path, kind="duplicate_rejected")) == 2
    report(
        "hold bound 0.8 s < original 3.5 s: duplicates got "
        f"{[s for s, _, _ in results[1:]]} with Retry-After; later retry replayed; "
        f"upstream dispatches={len(up.dispatches())}"
    )


def test_two_mitmdump_processes_on_one_ledger_dispatch_once(tmp_path, report):
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 3000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up, name="a") as a, guarded(
        tmp_path, up, name="b"
    ) as b:
        with ThreadPoolExecutor(max_workers=4) as pool:
            first = pool.submit(sse_post, a.url, body=BODY, headers=HEADERS)
            up.wait_for_record(lambda r: r.get("event") == "dispatch")  # it is the original
            dups = [pool.submit(sse_post, b.url, body=BODY, headers=HEADERS) for _ in range(3)]
            results = [first.result()] + [d.result() for d in dups]
        assert [r[0] for r in results] == [200] * 4
        assert len({r[2] for r in results}) == 1
        assert len(up.dispatches()) == 1
        held = turnguard_events(tmp_path, "b", "duplicate_held")
        assert len(held) == 3 and all(h["owner"] != held[0]["flow"] for h in held)
    report(
        "two mitmdump processes, one ledger: original via A, 3 duplicates via B -> "
        f"upstream dispatches={len(up.dispatches())}, statuses={[r[0] for r in results]}"
    )


@pytest.mark.slow
def test_200_concurrent_clients_over_20_operations_dispatch_20_times(tmp_path, report):
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "delay_ms": 300, "events": 5}}) as up, \
            guarded(tmp_path, up) as proxy:

        async def run():
            tasks = [
                asse_post(proxy.url, body={**BODY, "input": f"question {i % 20}"},
                          headers=HEADERS, timeout=90)
                for i in range(200)
            ]
            return await asyncio.gather(*tasks)

        results = asyncio.run(run())
        assert [r[0] for r in results].count(200) == 200
        by_op: dict[str, set] = {}
        for i, (_, _, body) in enumerate(results):
            by_op.setdefault(i % 20, set()).add(body)
        assert all(len(b) == 1 for b in by_op.values())
        assert len(up.dispatches()) == 20
        assert_no_traceback(proxy.log_text())
    report(f"200 concurrent clients over 20 operations: upstream dispatches={len(up.dispatches())}")


def test_rejected_original_lets_the_held_duplicate_go_upstream(tmp_path):
    scenario = {
        "sequence": [{"kind": "status", "code": 429, "retry_after": 1, "delay_ms": 1500}],
        "default": {"kind": "ok"},
    }
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        results = post_all(proxy.url, up, 2)
        assert results[0][0] == 429
        assert results[1][0] == 200 and "x-turnguard" not in results[1][1]
        assert len(up.dispatches()) == 2
        assert [e["outcome"] for e in turnguard_events(tmp_path, kind="outcome")] == ["rejected", "completed"]
        assert len(turnguard_events(tmp_path, kind="duplicate_forwarded")) == 1


def test_eventless_original_failure_forwards_the_duplicate_as_a_retry(tmp_path):
    scenario = {"sequence": [{"kind": "stall_after_headers", "ms": 1200}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        with ThreadPoolExecutor(max_workers=2) as pool:
            original = pool.submit(sse_post, proxy.url, body=BODY, headers=HEADERS)
            up.wait_for_record(lambda r: r.get("event") == "dispatch")  # it is the original
            status, _, body = sse_post(proxy.url, body=BODY, headers=HEADERS)
            with pytest.raises(Exception):  # the upstream closed the original's stream early
                original.result()
        assert status == 200 and sse_event_types(body)[-1] == "response.completed"
        assert len(up.dispatches()) == 2
        outcomes = [e["outcome"] for e in turnguard_events(tmp_path, kind="outcome")]
        assert outcomes == ["unknown", "completed"]


def test_replay_window_and_idempotency_keys(tmp_path):
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, turnguard_replay_window_ms=1000) as proxy:
        first = sse_post(proxy.url, body=BODY, headers=HEADERS)
        again = sse_post(proxy.url, body=BODY, headers=HEADERS)
        assert again[2] == first[2] and again[1]["x-turnguard"] == "replayed"
        time.sleep(1.3)
        later = sse_post(proxy.url, body=BODY, headers=HEADERS)
        assert "x-turnguard" not in later[1] and response_id(later[2]) != response_id(first[2])
        assert len(up.dispatches()) == 2

        idem = {**HEADERS, "idempotency-key": "key-1"}
        k1 = sse_post(proxy.url, body=BODY, headers=idem)
        time.sleep(1.3)  # past the window, within retention: still a replay
        k2 = sse_post(proxy.url, body=BODY, headers=idem)
        assert k2[1]["x-turnguard"] == "replayed" and k2[2] == k1[2]
        status, headers, body = sse_post(proxy.url, body={**BODY, "input": "other"}, headers=idem)
        assert status == 422 and json.loads(body)["error"]["code"] == "idempotency_key_conflict"
        other_cred = {**idem, "authorization": "Bearer another-key"}
        assert sse_post(proxy.url, body={**BODY, "input": "other"}, headers=other_cred)[0] == 200
        assert len(up.dispatches()) == 4
        assert len(turnguard_events(tmp_path, kind="idempotency_key_conflict")) == 1


def test_an_idempotency_key_reused_with_another_body_while_its_first_runs_here_is_422(tmp_path):
    """The same key with another body, while the key's first request is in flight in this very
    process (attach on and off, streamed or not): 422, never held on it, attached to it or
    answered with its response."""
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 2500}], "default": {"kind": "ok"}}
    idem = {**HEADERS, "idempotency-key": "transfer-1"}
    for attach, stream in [("true", True), ("false", True), ("false", False)]:
        run = tmp_path / f"{attach}-{stream}"
        run.mkdir()
        with MockUpstream(run, scenario) as up, guarded(run, up, turnguard_attach=attach) as proxy, \
                ThreadPoolExecutor(max_workers=1) as pool:
            body = {**BODY, "stream": stream}
            first = pool.submit(sse_post, proxy.url, body={**body, "input": "$10 to alice"},
                                headers=idem)
            wait_until(lambda: len(up.dispatches()) == 1, 10, what="the first request upstream")
            status, _, answer = sse_post(
                proxy.url, body={**body, "input": "$9999 to mallory"}, headers=idem)
            assert status == 422 and json.loads(answer)["error"]["code"] == "idempotency_key_conflict"
            assert first.result(30)[0] == 200
            assert len(up.dispatches()) == 1
            assert not turnguard_events(run, kind="duplicate_held")
            assert_no_traceback(proxy.log_text())


def test_no_replay_across_credentials_or_sessions(tmp_path):
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as proxy:
        a = sse_post(proxy.url, body=BODY, headers=HEADERS)
        b = sse_post(proxy.url, body=BODY, headers={**HEADERS, "authorization": "Bearer k2"})
        c = sse_post(proxy.url, body=BODY, headers={**HEADERS, "session-id": "sess-2"})
        assert len({a[2], b[2], c[2]}) == 3
        assert len(up.dispatches()) == 3


def test_what_turnguard_does_not_understand_passes_untouched(tmp_path):
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as proxy:
        status, headers, body = sse_post(proxy.url, body=b"not json{", headers=HEADERS)
        # the upstream's own answer to a body that is not JSON (the mock's, like the API's)
        assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
        assert "x-turnguard" not in headers
        sse_post(proxy.url, body=b"not json{", headers=HEADERS)
        # not guarded, so not coalesced: both reached the upstream
        assert [r["event"] for r in up.records()].count("invalid_body") == 2
        reasons = [e["reason"] for e in turnguard_events(tmp_path, kind="passthrough")]
        assert reasons and all("JSON" in r for r in reasons)
        # unguarded routes are not touched at all
        status, _, _ = sse_post(proxy.url, path="/v1/other", body=BODY, headers=HEADERS)
        assert status == 404
        assert_no_traceback(proxy.log_text())


def test_a_held_duplicate_whose_client_leaves_is_never_dispatched(tmp_path):
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 3000}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(tmp_path, up) as proxy:
        with ThreadPoolExecutor(max_workers=2) as pool:
            original = pool.submit(sse_post, proxy.url, body=BODY, headers=HEADERS)
            up.wait_for_record(lambda r: r.get("event") == "dispatch")  # it is the original
            with pytest.raises(Exception):
                sse_post(proxy.url, body=BODY, headers=HEADERS, timeout=0.8)
            wait_until(lambda: turnguard_events(tmp_path, kind="hold_abandoned"), 5, what="hold_abandoned")
            assert original.result()[0] == 200
        assert len(up.dispatches()) == 1


def test_no_secret_in_ledger_events_or_log_and_files_are_private(tmp_path):
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as proxy:
        post_all(proxy.url, up, 3)
        log = proxy.log_text()
    ledger = tmp_path / "ledger.sqlite3"
    ev = tmp_path / "mitmdump-events.jsonl"
    for path in (ledger, ev):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    blobs = [ledger.read_bytes(), ev.read_bytes(), log.encode()]
    wal = tmp_path / "ledger.sqlite3-wal"
    if wal.exists():
        blobs.append(wal.read_bytes())
    for blob in blobs:
        assert SECRET.encode() not in blob
    assert sqlite3.connect(ledger).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.mark.parametrize(
    "option, message",
    [
        ("turnguard_hold_timeout_ms=-5", "turnguard_hold_timeout_ms must be >= 0"),
        ("turnguard_filter=~q ((", "turnguard_filter"),
        ("turnguard_retention_ms=10", "turnguard_retention_ms must be >="),
    ],
)
def test_invalid_options_stop_mitmdump_with_a_clear_message(tmp_path, option, message):
    proc = subprocess.run(
        [str(MITMDUMP), "--listen-host", "127.0.0.1", "--listen-port", "0",
         "--set", f"confdir={tmp_path}", "-s", str(ADDON), "--set", option],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_compressed_body_is_guarded_and_a_decompression_bomb_passes_untouched(tmp_path):
    """A gzip-encoded request is identified by its decoded body (its duplicate is replayed),
    also with two codings; one that decodes to more than turnguard guards (a bomb, in one
    coding or two) is forwarded untouched, decoded only in the identity worker, never in
    mitmdump: its peak memory does not grow by the 64 MiB the bound would let a decoder make;
    three codings are not decoded at all."""
    body = json.dumps({**BODY, "input": "compressed"}).encode()
    coded = {**HEADERS, "content-encoding": "gzip", "content-type": "application/json"}
    bomb = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    bomb_body = b"".join(bomb.compress(zeros) for _ in range(512)) + bomb.flush()  # 512 MiB
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as proxy:
        first = sse_post(proxy.url, body=gzip.compress(body), headers=coded)
        again = sse_post(proxy.url, body=gzip.compress(body, mtime=1), headers=coded)
        assert first[0] == again[0] == 200 and again[1].get("x-turnguard") == "replayed"
        twice = {**coded, "content-encoding": "gzip, gzip"}
        two = json.dumps({**BODY, "input": "coded twice"}).encode()
        first2 = sse_post(proxy.url, body=gzip.compress(gzip.compress(two)), headers=twice)
        again2 = sse_post(proxy.url, body=gzip.compress(gzip.compress(two), mtime=1), headers=twice)
        assert first2[0] == again2[0] == 200 and again2[1].get("x-turnguard") == "replayed"
        assert len(up.dispatches()) == 2
        peak_before = _peak_rss_kb(proxy.pid)
        for encoding, data in [("gzip", bomb_body), ("gzip, gzip", gzip.compress(bomb_body)),
                               ("gzip, gzip, gzip", gzip.compress(gzip.compress(bomb_body)))]:
            status, headers, _ = sse_post(proxy.url, body=data,
                                          headers={**coded, "content-encoding": encoding})
            assert status == 400 and "x-turnguard" not in headers  # the mock's answer to its bytes
        reasons = [e["reason"] for e in turnguard_events(tmp_path, kind="passthrough")]
        assert reasons == ["body could not be decoded"] * 3
        assert _peak_rss_kb(proxy.pid) - peak_before < 32 * 1024  # never decoded here
        assert_no_traceback(proxy.log_text())


def test_a_turn_of_a_conversation_sent_again_after_it_completed_goes_upstream(tmp_path):
    """A Responses request that names a ``conversation`` is answered from the conversation's
    state upstream, which its own turn changed once it completed: the same body sent again
    afterwards is the conversation's next turn (a user who says "yes" twice), never answered
    from the first one's recording. A duplicate of it sent while it runs is still held and
    answered from it, and a repeat with its ``Idempotency-Key`` is still replayed."""
    turn = {"model": "m", "conversation": "conv_1", "input": "yes", "stream": True}
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as p:
        answers = [sse_post(p.url, body=turn, headers=HEADERS) for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200]
        assert [a[1].get("x-turnguard") for a in answers] == [None, None]
        assert response_id(answers[0][2]) != response_id(answers[1][2])
        assert len(up.dispatches()) == 2
        keyed = {**HEADERS, "idempotency-key": "turn-7"}
        again = [sse_post(p.url, body={**turn, "input": "no"}, headers=keyed) for _ in range(2)]
        assert [a[1].get("x-turnguard") for a in again] == [None, "replayed"]
        assert len(up.dispatches()) == 3

        async def while_it_runs():
            slow = {**HEADERS, "x-mock-behaviour": json.dumps({"kind": "slow", "delay_ms": 4000})}
            first = asyncio.create_task(asse_post(p.url, body={**turn, "input": "hold"},
                                                  headers=slow))
            for _ in range(500):  # until it runs upstream
                if len(up.dispatches()) == 4:
                    break
                await asyncio.sleep(0.02)
            duplicate = await asse_post(p.url, body={**turn, "input": "hold"}, headers=HEADERS)
            return await first, duplicate

        first, duplicate = asyncio.run(while_it_runs())
        assert duplicate[1].get("x-turnguard") in ("replayed", "attached")
        assert response_id(duplicate[2]) == response_id(first[2])
        assert len(up.dispatches()) == 4
        assert_no_traceback(p.log_text())


RETENTION_PROBE = Path(__file__).with_name("retention_probe.py")


def retention_looks(proxy, n: int) -> list[str]:
    """What ``retention_probe.py`` said of each flow in ``proxy`` ("let go", or "kept by
    turnguard"), once it said it ``n`` times."""
    wait_until(lambda: proxy.log_text().count("retention_probe:") == n, 10,
               what="the probe's look at each flow")
    return [line.split("retention_probe: ", 1)[1].split(" ", 1)[1]
            for line in proxy.log_text().splitlines() if "retention_probe: " in line]


def test_turnguard_keeps_no_flow_whose_attempt_ended(tmp_path):
    """Once an attempt's end is recorded (its response hook ran), turnguard refers to its
    flow no more (``retention_probe.py`` walks turnguard's objects from the addon at the
    flow's ``response`` hook, after turnguard's). A reference kept (a timer's callback that
    outlives the attempt) keeps the flow, with its request, response and tee, alive past the
    garbage collector's young generations: only its full passes then free each request's
    objects, and the whole process slows. A completed stream, a rejection, a connection
    the upstream resets (the error hook), and a replay (no attempt) each."""
    scenario = {"sequence": [{"kind": "ok"}, {"kind": "status", "code": 429},
                             {"kind": "reset"}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, guarded(
            tmp_path, up, extra_args=["-s", str(RETENTION_PROBE)]) as proxy:
        answers = [sse_post(proxy.url, body={**BODY, "input": f"turn {n}"}, headers=HEADERS)
                   for n in range(3)]
        answers.append(sse_post(proxy.url, body={**BODY, "input": "turn 0"}, headers=HEADERS))
        assert [a[0] for a in answers] == [200, 429, 502, 200]
        assert answers[3][1]["x-turnguard"] == "replayed"
        assert retention_looks(proxy, 4) == ["let go"] * 4
        outcomes = [e["outcome"] for e in turnguard_events(tmp_path, kind="outcome")]
        assert outcomes == ["completed", "rejected", "unknown"]
        assert_no_traceback(proxy.log_text())
