"""End to end: what a running turnguard keeps in memory stays bounded under unbounded distinct
keys (sessions, circuit scopes, ...), read through ``turnguard.status`` of a real mitmdump
(``status_probe.py``: ``GET /__status``). Counts, never timings; every loop bounded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from harness import MockUpstream, assert_no_traceback, guarded, post_turn, wait_until

STATUS_PROBE = Path(__file__).with_name("status_probe.py")
TURN = {"model": "gpt-test", "input": "a turn of its own session", "stream": True}


def status(proxy) -> dict:
    """``turnguard.status`` of the running mitmdump (loaded with ``status_probe.py``)."""
    with httpx.Client(trust_env=False, timeout=20) as c:
        r = c.get(proxy.url + "/__status")
    r.raise_for_status()
    return r.json()


def probed(tmp_path, up, **options):
    return guarded(tmp_path, up, extra_args=["-s", str(STATUS_PROBE)], **options)


def test_sessions_and_circuits_of_many_distinct_sessions_are_not_kept_forever(tmp_path):
    """Thousands of distinct sessions (a gateway's clients come and go): each one served leaves
    a durable-session ownership and a retry circuit in the process's memory. Once its lease
    expired the session is no longer this process's (any process may take it over), and a
    circuit that counts no failure and does not cool down is no different from none: neither
    may stay in memory for good, or a long-running proxy grows with every session it ever saw
    (and ``turnguard_sessions_owned`` counts sessions it has not owned for hours)."""
    n_ok, n_failed = 300, 100
    with MockUpstream(tmp_path, {"default": {"kind": "ok", "events": 2}}) as up, \
            probed(tmp_path, up, turnguard_owner_lease_ms=1000) as p:
        def one(i: int) -> int:
            headers = {"authorization": "Bearer sk-bounds", "session-id": f"sess-{i}"}
            behaviour = {"kind": "reset"} if i < n_failed else None
            return post_turn(p.url, headers, {**TURN, "input": f"turn {i}"},
                             behaviour=behaviour, timeout=30)[0]

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(one, range(n_ok + n_failed)))
        assert statuses.count(200) == n_ok, statuses
        assert len(up.dispatches()) == n_ok + n_failed
        # the leases (1 s) expire; the ticker looks at circuits every 5 s: within 15 s both
        # tables hold only what still matters (no session owned, a circuit per failed one)
        last: dict = {}

        def forgotten() -> bool:
            last.update(status(p))
            return last["owned_sessions"] == 0 and last["circuits_known"] <= n_failed

        try:
            wait_until(forgotten, timeout=15, interval=0.5,
                       what="expired sessions and idle circuits to be forgotten")
        except AssertionError as e:
            raise AssertionError(f"{e}: owned_sessions={last['owned_sessions']},"
                                 f" circuits_known={last['circuits_known']}") from None
        after = last
        assert after["circuits_known"] == n_failed, after
        # a session seen again is claimed again (renewed: still this process's), as before
        headers = {"authorization": "Bearer sk-bounds", "session-id": "sess-150"}
        assert post_turn(p.url, headers, {**TURN, "input": "again"})[0] == 200
        assert status(p)["owned_sessions"] == 1
        assert_no_traceback(p.log_text())
