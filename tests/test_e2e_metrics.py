"""End to end: ``/metrics`` of a real mitmdump (``turnguard_metrics``) scraped during the
duplicate storm and the cooldown 503 storm, its counters checked against what the upstream
saw (the mock's dispatch log) and what the clients got; and the dashboard and alert rules in
``ops/`` checked against a real scrape."""

from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import (
    REPO,
    MockUpstream,
    assert_no_traceback,
    guarded,
    ledger_query,
    metric,
    metrics_url,
    post_turn,
    scrape,
    turnguard_events,
    wait_until,
)

BODY = {"model": "gpt-test", "input": "a stalled turn", "stream": True}
HEADERS = {"authorization": "Bearer sk-metrics-test", "session-id": "sess-metrics"}
ANCHORED = {**HEADERS, "x-codex-turn-state": "ts_turn_1"}
COOLDOWN_MS = 3000
STORM = {
    "sequence": [{"kind": "stall_before_headers", "ms": 60000}, {"kind": "reset"}],
    "default": {"kind": "ok", "events": 4},
}


def proxy(tmp_path, up, name="mitmdump", **options):
    return guarded(tmp_path, up, name, **{"turnguard_metrics": "127.0.0.1:0",
                                          "turnguard_response_created_timeout_ms": 600,
                                          "turnguard_cooldown_ms": COOLDOWN_MS, **options})


def scrape_until(url, predicate, what, timeout=10):
    """Scrape until ``predicate(samples)`` holds; return those samples (bounded)."""
    return wait_until(lambda: (s if predicate(s := scrape(url)) else None), timeout, what=what)


def post(url, headers=HEADERS, body=BODY, timeout=30):
    """The status of one request (0: a transport error)."""
    return post_turn(url, headers, body, timeout=timeout)[0]


def test_duplicate_storm_counters_match_the_upstream_log(tmp_path, report):
    # the original's headers wait for its 4 s delay and then for the test's release, given
    # once the 5 duplicates are held and have been for more than 2 s (order: they are held
    # however late they come; the delay and the 2 s are floors the sums below check)
    scenario = {"sequence": [{"kind": "slow", "delay_ms": 4000, "hold": "original"}],
                "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(
        tmp_path, up, turnguard_response_created_timeout_ms=60000
    ) as p:
        url = metrics_url(p)
        with ThreadPoolExecutor(max_workers=6) as pool:
            first = pool.submit(post, p.url)
            up.wait_for_record(lambda r: r.get("event") == "dispatch", 30)
            dups = [pool.submit(post, p.url) for _ in range(5)]
            try:
                during = scrape_until(
                    url, lambda s: metric(s, "turnguard_flows_held", wait="duplicate") == 5,
                    "5 held flows in the gauge")
                time.sleep(2.1)  # a floor: each hold lasts more than 2 s (not a race)
            finally:
                up.release("original")
            statuses = [first.result()] + [d.result() for d in dups]
        assert statuses == [200] * 6
        assert metric(during, "turnguard_attempts_in_flight") == 1
        upstream = up.dispatches()
        after = scrape_until(url, lambda s: metric(s, "turnguard_outcomes_total") == len(upstream),
                             "the outcome counted")
        assert metric(after, "turnguard_dispatches_total") == len(upstream) == 1
        assert metric(after, "turnguard_dispatches_total", kind="original") == 1
        assert metric(after, "turnguard_duplicates_total", action="held") == 5
        # the original stalled before streaming: its duplicates attached once it streamed
        assert metric(after, "turnguard_duplicates_total", action="attached") == 5
        assert metric(after, "turnguard_hold_seconds_count", result="attached") == 5
        assert metric(after, "turnguard_hold_seconds_sum") > 5 * 2.0  # each waited seconds
        assert metric(after, "turnguard_outcomes_total", outcome="completed") == 1
        assert metric(after, "turnguard_attempt_duration_seconds_sum") >= 4.0
        assert metric(after, "turnguard_time_to_first_event_seconds_count") == 1
        assert metric(after, "turnguard_flows_held") == 0
        assert metric(after, "turnguard_answers_total") == 0
        instances = {lab["turnguard_instance"] for rows in after.values() for lab, _ in rows
                     if "turnguard_instance" in lab}
        assert len(instances) == 1
        assert_no_traceback(p.log_text())
    report(f"metrics, duplicate storm: dispatches_total={metric(after, 'turnguard_dispatches_total'):g} "
           f"= upstream log {len(upstream)}; held gauge peaked at 5; duplicates held/attached "
           f"{metric(after, 'turnguard_duplicates_total', action='held'):g}/"
           f"{metric(after, 'turnguard_duplicates_total', action='attached'):g}")


def test_cooldown_storm_counters_match_the_upstream_log_in_default_and_once_mode(tmp_path, report):
    lines = []
    # fail_closed answers the storm at once: a cooldown far longer than the storm's retries
    # take on a loaded machine (3 s was not: one went upstream after it); once mode holds the
    # first retry through it
    for mode, cooldown_ms in (("fail_closed", 20000), ("server_anchored_replay_once", COOLDOWN_MS)):
        d = tmp_path / mode
        d.mkdir()
        with MockUpstream(d, STORM) as up, proxy(d, up, turnguard_recovery_mode=mode,
                                                 turnguard_cooldown_ms=cooldown_ms) as p:
            url = metrics_url(p)
            statuses = [post(p.url, ANCHORED), post(p.url, ANCHORED)]  # the circuit opens
            cooling = scrape_until(url, lambda s: metric(s, "turnguard_circuits_open") == 1,
                                   "the open circuit in the gauge")
            assert 0 < metric(cooling, "turnguard_cooldown_remaining_seconds") <= cooldown_ms / 1000
            for _ in range(6):  # a client that ignores Retry-After
                statuses.append(post(p.url, ANCHORED))
                if statuses[-1] == 200:
                    break
                time.sleep(0.2)
            upstream = up.dispatches()
            s = scrape_until(url, lambda s: metric(s, "turnguard_outcomes_total") == len(upstream),
                             "every outcome counted")
            assert metric(s, "turnguard_dispatches_total") == len(upstream)
            assert metric(s, "turnguard_upstream_cuts_total") == 1
            assert metric(s, "turnguard_eventless_failures_total",
                          failure_class="missing_response_created_timeout") == 1
            assert metric(s, "turnguard_circuit_opened_total") == 1
            assert metric(s, "turnguard_answers_total", status="503") == statuses.count(503)
            if mode == "fail_closed":
                assert len(upstream) == 2 and statuses[2:] == [503] * 6
                assert metric(s, "turnguard_fail_closed_total") == 0  # the mode's own answer
                assert metric(s, "turnguard_recovery_claimed_total") == 0
            else:
                assert len(upstream) == 3 and statuses[2:] == [200]
                assert metric(s, "turnguard_dispatches_total", kind="recovery") == 1
                assert metric(s, "turnguard_recovery_claimed_total") == 1
                assert metric(s, "turnguard_cooldown_wait_seconds_count",
                              reason="cooldown_elapsed") == 1
                assert metric(s, "turnguard_circuit_reset_total") == 1
                assert metric(s, "turnguard_circuits_open") == 0
            assert_no_traceback(p.log_text())
        lines.append(f"{mode}: upstream {len(upstream)} = dispatches_total "
                     f"{metric(s, 'turnguard_dispatches_total'):g}, 503 answers "
                     f"{metric(s, 'turnguard_answers_total', status='503'):g}")
    report("metrics, cooldown storm: " + "; ".join(lines))


# -- the dashboard and the alert rules ---------------------------------------------------------

METRIC_NAME = re.compile(r"\b(turnguard_[a-z_]+|process_[a-z_]+)\b")


def queried_names(text: str) -> set[str]:
    """The metric names a PromQL expression uses (label names such as turnguard_instance are
    not metric names: they appear after a brace or in by()/without())."""
    names = set(METRIC_NAME.findall(text))
    return {n for n in names if n != "turnguard_instance"}


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def rule_exprs(rules_text: str) -> list[str]:
    """The ``expr:`` values of the rules file (a YAML subset: one expression per rule, either
    on the line or as a ``|`` / ``>`` block)."""
    exprs, lines, i = [], rules_text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)expr:\s*(.*)$", lines[i])
        i += 1
        if not m:
            continue
        indent, value = len(m.group(1)), m.group(2).strip()
        if value in ("|", ">", "|-", ">-"):
            block = []
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                block.append(lines[i].strip())
                i += 1
            value = " ".join(block)
        exprs.append(value)
    return exprs


def test_every_metric_the_dashboard_and_rules_query_is_in_a_real_scrape(tmp_path):
    dashboard = json.loads((REPO / "ops" / "grafana-dashboard.json").read_text())
    rules = (REPO / "ops" / "prometheus-alerts.yml").read_text()
    exprs = dashboard_exprs(dashboard) + rule_exprs(rules)
    assert len(exprs) >= 10
    wanted = set().union(*(queried_names(e) for e in exprs))
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        post(p.url)  # one request, so the labelled counters have a series
        s = scrape_until(metrics_url(p), lambda s: metric(s, "turnguard_outcomes_total"),
                         "a counted request")
    missing = wanted - set(s)
    assert not missing, f"queried by ops/ but not in a real /metrics scrape: {sorted(missing)}"


# -- every series is told apart by process; a reload keeps the counts -------------------------


def test_every_series_of_a_real_scrape_carries_turnguard_instance(tmp_path):
    """The dashboard filters every query (process_resident_memory_bytes included) by
    ``turnguard_instance``: a series without the label vanishes once one process is picked."""
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        post(p.url)
        s = scrape_until(metrics_url(p), lambda s: metric(s, "turnguard_outcomes_total"),
                         "a counted request")
    unlabelled = sorted({name for name, rows in s.items() for lab, _ in rows
                         if "turnguard_instance" not in lab})
    assert metric(s, "process_resident_memory_bytes") > 0
    assert not unlabelled, f"series without turnguard_instance: {unlabelled}"


def test_a_script_reload_keeps_the_counters_of_the_process(tmp_path):
    """A reload keeps the process's turnguard_instance, so its counters must go on from
    where they were: a counter of one series never goes down within a process."""
    from test_at_most_once import reloadable, reloaded, touch_to_reload

    script = reloadable(tmp_path)
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, addon=script) as p:
        assert [post(p.url), post(p.url)] == [200, 200]  # one dispatch, one replay
        before = scrape_until(metrics_url(p),
                              lambda s: metric(s, "turnguard_outcomes_total") == 1,
                              "the outcome counted")
        reloaded(p, touch_to_reload(p, script))
        url = re.findall(r"turnguard: metrics at (http://\S+/metrics)", p.log_text())[-1]
        after = scrape(url)
        assert_no_traceback(p.log_text())
    label = lambda s: {lab["turnguard_instance"] for rows in s.values() for lab, _ in rows  # noqa: E731
                       if "turnguard_instance" in lab}
    assert label(before) == label(after)
    for name in ("turnguard_dispatches_total", "turnguard_duplicates_total",
                 "turnguard_outcomes_total", "turnguard_events_total"):
        assert metric(after, name) >= metric(before, name) > 0, name


def test_a_websocket_call_abandoned_while_decided_is_counted_as_websocket_closed(tmp_path):
    """A client drops its socket while its call waits for a locked ledger: the hold it ended
    is counted under its own reason (``websocket_closed``), not ``other``."""
    import asyncio

    from test_e2e_websocket import call, drop_a_call_while_the_ledger_is_locked, one_call, user

    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, turnguard_hold_timeout_ms=3000) as p:
        asyncio.run(one_call(p.url, call([user("warm")], seed=100)))
        drop_a_call_while_the_ledger_is_locked(p.url, tmp_path / "ledger.sqlite3")
        s = scrape_until(metrics_url(p), lambda s: metric(s, "turnguard_holds_abandoned_total"),
                         "the abandoned call counted")
        assert_no_traceback(p.log_text())
    assert metric(s, "turnguard_holds_abandoned_total", reason="other") == 0
    assert metric(s, "turnguard_holds_abandoned_total", reason="websocket_closed") == 1


def test_a_websocket_client_that_leaves_during_a_cooldown_hold_is_one_abandoned_hold(tmp_path):
    """Once mode: a call held through a cooldown whose client closes its socket ends one
    hold: one ``hold_abandoned`` record and one count, not one per layer that saw it go."""
    import asyncio

    from test_e2e_websocket import HEADERS as WS_HEADERS
    from test_e2e_websocket import call, one_call, user
    from turnguard_ws import WsClient

    scenario = {"sequence": [{"kind": "clean_close"}, {"kind": "reset"}], "default": {"kind": "ok"}}
    with MockUpstream(tmp_path, scenario) as up, proxy(
        tmp_path, up, turnguard_recovery_mode="server_anchored_replay_once"
    ) as p:
        frame = call([user("hi")])
        for _ in range(2):  # the circuit opens
            assert asyncio.run(one_call(p.url, frame))[-1]["type"] == "closed"

        async def leave():
            async with WsClient.connect(p.url, headers=WS_HEADERS) as c:
                await c.send(frame)
                await asyncio.sleep(0.5)  # held through the cooldown, then gone

        asyncio.run(leave())
        s = scrape_until(metrics_url(p), lambda s: metric(s, "turnguard_holds_abandoned_total"),
                         "the abandoned hold counted")
        time.sleep(0.5)  # a second count, if any, lands meanwhile
        s = scrape(metrics_url(p))
        abandoned = turnguard_events(tmp_path, "mitmdump", "hold_abandoned")
        assert_no_traceback(p.log_text())
    assert len(up.dispatches()) == 2  # nothing dispatched for the call that left
    assert len(abandoned) == 1, abandoned
    assert metric(s, "turnguard_holds_abandoned_total") == 1
    assert metric(s, "turnguard_cooldown_wait_seconds_count", reason="gone") == 1


# the first dispatch waits before its status line until the test releases the hold
# "original" (at most 60 s): whatever the test does meanwhile, its duplicates stay held
SLOW_ORIGINAL = {"sequence": [{"kind": "ok", "hold": "original"}], "default": {"kind": "ok"}}


def _an_original_and_held_duplicates(pool: ThreadPoolExecutor, p, up: MockUpstream, n: int):
    """A POST through ``p`` (held by ``up``, a mock with SLOW_ORIGINAL, until the test calls
    ``up.release("original")``) and ``n`` duplicates of it, sent once the mock holds it and
    returned once the gauge shows them held (order, not duplicates sent 0.5 s into a 5 s
    delay everything after had to fit in)."""
    first = pool.submit(post, p.url)
    up.wait_held("original", 30)
    dups = [pool.submit(post, p.url) for _ in range(n)]
    scrape_until(metrics_url(p),
                 lambda s: metric(s, "turnguard_flows_held", wait="duplicate") == n,
                 f"{n} held flows in the gauge")
    return first, dups


def test_holds_a_script_reload_hands_over_are_counted_once(tmp_path):
    """A script reload hands held duplicates to the instance loaded next, which answers them:
    in the events file and the metrics each is one hold, none let go, and none is still held
    once answered (the gauge is the new instance's)."""
    from test_at_most_once import reloadable, reloaded, touch_to_reload

    script = reloadable(tmp_path)
    with MockUpstream(tmp_path, SLOW_ORIGINAL) as up, proxy(
        tmp_path, up, addon=script, turnguard_response_created_timeout_ms=60000
    ) as p:
        with ThreadPoolExecutor(max_workers=4) as pool:
            first, dups = _an_original_and_held_duplicates(pool, p, up, 3)
            try:
                reloaded(p, touch_to_reload(p, script))
            finally:
                up.release("original")
            statuses = [first.result()] + [d.result() for d in dups]
        url = re.findall(r"turnguard: metrics at (http://\S+/metrics)", p.log_text())[-1]
        s = scrape_until(url, lambda s: metric(s, "turnguard_outcomes_total") == 1
                         and metric(s, "turnguard_duplicates_total", action="replayed")
                         + metric(s, "turnguard_duplicates_total", action="attached") == 3,
                         "the original's end and its 3 duplicates' answers counted")
        assert p.log_text().count("was held; the addon loaded now decides it") == 3
        assert_no_traceback(p.log_text())
    assert statuses == [200] * 4 and len(up.dispatches()) == 1
    assert len(turnguard_events(tmp_path, "mitmdump", "duplicate_held")) == 3
    assert not turnguard_events(tmp_path, "mitmdump", "hold_abandoned")
    assert metric(s, "turnguard_duplicates_total", action="held") == 3
    assert metric(s, "turnguard_holds_abandoned_total") == 0
    assert metric(s, "turnguard_flows_held") == 0


def test_holds_let_go_by_a_reload_that_failed_reach_the_events_file_and_the_metrics(tmp_path):
    """A script reload to a copy that does not load lets held duplicates go (no instance takes
    them: killed, their clients retry). Each hold's end is a decision: once the script loads
    again, it is in the events file and the metrics, not only in the log (before, the unloaded
    instance's events file and metrics were closed: the records were lost)."""
    from test_at_most_once import reloadable, reloaded

    script = reloadable(tmp_path)
    good = script.read_text()
    with MockUpstream(tmp_path, SLOW_ORIGINAL) as up, proxy(
        tmp_path, up, addon=script, turnguard_response_created_timeout_ms=60000
    ) as p:
        with ThreadPoolExecutor(max_workers=3) as pool:
            first, dups = _an_original_and_held_duplicates(pool, p, up, 2)
            try:
                time.sleep(1.1)  # mitmproxy looks at the script's mtime once a second
                script.write_text(good + "this is not python(\n")
                statuses = [d.result() for d in dups]
                started = p.log_text().count("turnguard: running")
                time.sleep(1.1)
                script.write_text(good)
                reloaded(p, started)
            finally:
                up.release("original")
            statuses.append(first.result())
        url = re.findall(r"turnguard: metrics at (http://\S+/metrics)", p.log_text())[-1]
        s = scrape_until(url, lambda s: metric(s, "turnguard_holds_abandoned_total") == 2,
                         "the 2 holds let go counted")
    assert statuses == [0, 0, 200] and len(up.dispatches()) == 1
    abandoned = turnguard_events(tmp_path, "mitmdump", "hold_abandoned")
    assert [e["reason"] for e in abandoned] == ["turnguard unloaded"] * 2
    assert metric(s, "turnguard_holds_abandoned_total", reason="unloaded") == 2


def test_what_a_reload_that_failed_left_unwritten_reaches_the_events_file_if_the_process_stops(
        tmp_path):
    """As above, but the process is stopped (SIGTERM) before the script loads again, after
    the original completed while no instance was loaded. The unloaded instance records the
    turn's end as the process exits, as the next instance to load would have (its ledger
    write); the records that instance would have written to the events file must be there
    too: the two holds let go (``hold_abandoned``) and the turn's ``outcome``. Before, the
    events file stayed closed at that exit: the holds' records, kept for an instance that
    never came, were dropped, and the turn's outcome reached only the log."""
    from test_at_most_once import reloadable

    script = reloadable(tmp_path)
    good = script.read_text()
    with MockUpstream(tmp_path, SLOW_ORIGINAL) as up, proxy(
        tmp_path, up, addon=script, turnguard_response_created_timeout_ms=60000
    ) as p:
        with ThreadPoolExecutor(max_workers=3) as pool:
            first, dups = _an_original_and_held_duplicates(pool, p, up, 2)
            try:
                time.sleep(1.1)  # mitmproxy looks at the script's mtime once a second
                script.write_text(good + "this is not python(\n")
                statuses = [d.result() for d in dups]
            finally:
                up.release("original")
            statuses.append(first.result())
        assert p.stop() == 0
        log = p.log_text()
    assert statuses == [0, 0, 200] and len(up.dispatches()) == 1
    abandoned = turnguard_events(tmp_path, "mitmdump", "hold_abandoned")
    assert [e["reason"] for e in abandoned] == ["turnguard unloaded"] * 2
    assert [e["outcome"] for e in turnguard_events(tmp_path, "mitmdump", "outcome")] \
        == ["completed"]
    assert log.count("Traceback") == 1  # its SyntaxError


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_holds_let_go_at_shutdown_reach_the_events_file(tmp_path, sig):
    """mitmdump stopped (Ctrl-C, or SIGTERM) while a duplicate is held behind a slow original:
    the hold is let go (its client retries), and its end is in the events file, where
    operators look for what happened to held requests (before, the unload closed the events
    file before the woken hold ran: its ``hold_abandoned`` reached only the log)."""
    with MockUpstream(tmp_path, SLOW_ORIGINAL) as up, proxy(
        tmp_path, up, turnguard_response_created_timeout_ms=60000
    ) as p:
        with ThreadPoolExecutor(max_workers=2) as pool:
            first, dups = _an_original_and_held_duplicates(pool, p, up, 1)
            try:
                p.proc.send_signal(sig)
                assert p.proc.wait(20) == 0
            finally:
                up.release("original")
            first.result(), dups[0].result()
        assert_no_traceback(p.log_text())
    assert len(up.dispatches()) == 1
    assert len(turnguard_events(tmp_path, "mitmdump", "duplicate_held")) == 1
    abandoned = turnguard_events(tmp_path, "mitmdump", "hold_abandoned")
    assert [e["reason"] for e in abandoned] == ["turnguard unloaded"], abandoned


def test_websocket_frames_passed_through_are_counted_by_their_reason_not_as_other(tmp_path):
    """A binary frame, a text frame that is not JSON and a JSON frame that is no call pass a
    guarded socket untouched; each passthrough is counted under a reason of its own."""
    import asyncio

    from test_e2e_websocket import HEADERS as WS_HEADERS
    from turnguard_ws import WsClient

    async def frames(url):
        async with WsClient.connect(url, headers=WS_HEADERS) as c:
            for frame in (b"\x00\x01binary", "not json {", {"type": "session.update"}):
                await c.send(frame)
                await asyncio.sleep(0.2)

    with MockUpstream(tmp_path) as up, proxy(tmp_path, up) as p:
        asyncio.run(frames(p.url))
        s = scrape_until(metrics_url(p), lambda s: metric(s, "turnguard_passthrough_total") >= 3,
                         "3 passthroughs counted")
        assert_no_traceback(p.log_text())
    reasons = {lab["reason"]: v for lab, v in s["turnguard_passthrough_total"]}
    assert "other" not in reasons, reasons
    assert len(reasons) == 3, reasons


def test_status_event_counts_go_on_like_the_metrics_across_a_new_events_file_and_a_reload(
        tmp_path):
    """``turnguard.status``'s ``events`` counts what this process did, as
    ``turnguard_events_total`` does: neither a new events file (``turnguard_events`` set while
    running, as mitmweb's options editor or ``:set`` do) nor a script reload may start it
    again from 0 while the metrics of the same process go on; nor may metrics switched off
    and on again miss what happened meanwhile."""
    from test_at_most_once import reloadable, reloaded, touch_to_reload
    from test_e2e_bounds import STATUS_PROBE, status
    from test_e2e_control import set_live, LIVE_OPTIONS

    def agree(p, url, dispatches):
        counts = status(p)["events"]
        samples = scrape(url)
        totals = {lab["event"]: v for lab, v in samples.get("turnguard_events_total", [])}
        assert counts.get("dispatch") == dispatches == len(up.dispatches()), counts
        for event in ("dispatch", "outcome", "duplicate_replayed"):
            assert counts.get(event, 0) == totals.get(event, 0), (event, counts, totals)

    script = reloadable(tmp_path)
    with MockUpstream(tmp_path) as up, proxy(
            tmp_path, up, addon=script,
            extra_args=["-s", str(STATUS_PROBE), "-s", str(LIVE_OPTIONS)]) as p:
        url = metrics_url(p)
        assert [post(p.url), post(p.url)] == [200, 200]  # one dispatch, one replay
        wait_until(lambda: metric(scrape(url), "turnguard_outcomes_total") == 1, 10,
                   what="the outcome counted")
        agree(p, url, 1)
        assert set_live(p, f"turnguard_events={tmp_path / 'rotated-events.jsonl'}")[0] == 200
        assert post(p.url) == 200  # replayed
        agree(p, url, 1)
        reloaded(p, touch_to_reload(p, script))
        url = re.findall(r"turnguard: metrics at (http://\S+/metrics)", p.log_text())[-1]
        assert post(p.url) == 200  # replayed
        agree(p, url, 1)
        # metrics switched off, then on again: the counters counted meanwhile too
        assert set_live(p, "turnguard_metrics=")[0] == 200
        assert post(p.url, body={**BODY, "input": "while the metrics are off"}) == 200
        assert set_live(p, "turnguard_metrics=127.0.0.1:0")[0] == 200
        url = re.findall(r"turnguard: metrics at (http://\S+/metrics)", p.log_text())[-1]
        wait_until(lambda: metric(scrape(url), "turnguard_outcomes_total") == 2, 10,
                   what="the outcome counted")
        agree(p, url, 2)
        assert_no_traceback(p.log_text())


def test_an_events_file_that_cannot_be_written_then_rotated_goes_on_in_the_new_file(tmp_path):
    """The events file's disk is full (here: mitmdump's file size limit, ``prlimit --fsize``,
    which fails a write past it as a full disk does, EFBIG for ENOSPC): traffic goes on and the
    log says so once, not at every event. Then logrotate renames the file away: turnguard
    goes on in a new file at the path, as the README promises, though the lines the old file
    could not take can no longer be written there (its close fails too): no traceback, and no
    hook ever fails for it."""
    events = tmp_path / "mitmdump-events.jsonl"
    filler = b'{"ts":1,"event":"filler"}\n'
    events.write_bytes(filler * (3_000_000 // len(filler)))
    events.chmod(0o600)
    limit = events.stat().st_size + 100  # the first line or so of a turn, then no more
    with MockUpstream(tmp_path) as up, guarded(
            tmp_path, up, prefix=["prlimit", f"--fsize={limit}", "--"]) as p:
        for n in range(3):
            assert post(p.url, body={**BODY, "input": f"turn {n}"}) == 200
        wait_until(lambda: "cannot write telemetry" in p.log_text(), 10,
                   what="the failed write said")
        events.rename(tmp_path / "mitmdump-events.jsonl.1")  # logrotate
        p.wait_for_log("writing to a new one", 10)
        assert post(p.url, body={**BODY, "input": "after the rotation"}) == 200
        wait_until(lambda: events.exists() and any(
            r["event"] == "outcome" for r in turnguard_events(tmp_path)), 10,
                   what="the next turn's outcome in the new events file")
        log = p.log_text()
        assert len(up.dispatches()) == 4
        assert log.count("cannot write telemetry") == 1, log
        assert_no_traceback(log)


def test_a_ledger_outage_found_by_a_turns_end_is_counted_as_finish(tmp_path):
    """The ledger is locked past its busy timeout as a turn ends: the end's write finds it
    unusable. ``turnguard_ledger_outages_total`` says which call found it, ``finish`` among
    them (README), never ``other`` for one of turnguard's own calls; the event names the same
    call."""
    import sqlite3

    slow = {"default": {"kind": "ok", "events": 6, "gap_ms": 300}}
    with MockUpstream(tmp_path, slow) as up, proxy(tmp_path, up) as p:
        url = metrics_url(p)
        db = sqlite3.connect(tmp_path / "ledger.sqlite3", isolation_level=None, timeout=10)
        try:
            with ThreadPoolExecutor(1) as pool:
                turn = pool.submit(post, p.url)
                wait_until(lambda: ledger_query(
                    tmp_path / "ledger.sqlite3",
                    "SELECT 1 FROM attempts WHERE events_seen > 0"), 20,
                    what="the turn's first event in the ledger")
                db.execute("BEGIN EXCLUSIVE")  # before the end: its write waits, then fails
                assert turn.result() == 200
            wait_until(lambda: turnguard_events(tmp_path, kind="ledger_unavailable"), 30,
                       what="the outage found")
        finally:
            db.close()  # the lock goes: the ledger recovers
        wait_until(lambda: turnguard_events(tmp_path, kind="ledger_recovered"), 30,
                   what="the ledger usable again")
        [down] = turnguard_events(tmp_path, kind="ledger_unavailable")
        s = scrape(url)
        assert down["during"] == "finish", down
        assert metric(s, "turnguard_ledger_outages_total", during="finish") == 1
        assert metric(s, "turnguard_ledger_outages_total", during="other") == 0
        assert_no_traceback(p.log_text())


def test_an_events_file_left_with_a_cut_last_line_gets_whole_lines_after_it(tmp_path):
    """An events file whose last line was cut (the disk was full when the process that wrote
    it stopped, or it was killed mid-write) is appended to by the next start: its first record
    must start a line of its own, never be glued to the cut one (which no reader can parse:
    the record would be lost)."""
    events = tmp_path / "mitmdump-events.jsonl"
    events.write_bytes(b'{"ts":1,"event":"dispatch"}\n{"ts":2,"event":"outc')
    events.chmod(0o600)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up) as p:
        assert post(p.url) == 200
        wait_until(lambda: turnguard_events(tmp_path, kind="outcome"), 10, what="the outcome")
        assert_no_traceback(p.log_text())
    lines = events.read_bytes().split(b"\n")
    assert lines[1] == b'{"ts":2,"event":"outc'  # left as it was
    records = [json.loads(line) for line in lines[2:] if line]  # every later line parses
    assert [r["event"] for r in records if r["event"] == "dispatch"] == ["dispatch"]
    assert len(up.dispatches()) == 1


def test_a_request_held_for_peers_that_turns_out_a_duplicate_is_counted_as_held(tmp_path):
    """The ledger file is deleted while A's turn is in flight and A cannot register it in the
    new file yet (paused): a duplicate sent to B is held for A to register (``request_held``:
    no duplicate yet, not counted as one). Once A has, B holds it on A's attempt: from then on
    it is a held duplicate, and its end (attached or replayed) must have the
    ``duplicate_held`` that began it, in the events and in ``turnguard_duplicates_total``
    (held = the ends of holds), and in the ledger's count of duplicates held."""
    import os

    from harness import delete_ledger
    from test_at_most_once import SESSION, behaviour, body_of, in_background

    ledger = tmp_path / "ledger.sqlite3"
    opts = dict(turnguard_hold_timeout_ms=30000)
    with MockUpstream(tmp_path) as up, guarded(tmp_path, up, "a", **opts) as a, \
            guarded(tmp_path, up, "b", turnguard_metrics="127.0.0.1:0", **opts) as b:
        turn = {**SESSION, **behaviour(kind="ok", delay_ms=5000)}
        body = body_of("held for its owner, then on its attempt")
        original = in_background(post_turn, a.url, turn, body)
        up.wait_for_record(lambda r: r.get("event") == "dispatch")
        os.kill(a.proc.pid, signal.SIGSTOP)  # A cannot register its attempt in the new file
        try:
            delete_ledger(ledger)
            duplicate = in_background(post_turn, b.url, SESSION, body)
            wait_until(lambda: turnguard_events(tmp_path, "b", "request_held"), 10,
                       what="B holding the request for A to register")
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        assert original.result(30)[0] == 200
        status, headers, _ = duplicate.result(40)
        assert status == 200 and headers.get("x-turnguard") in ("replayed", "attached")
        assert len(up.dispatches()) == 1
        ended = [e for e in turnguard_events(tmp_path, "b")
                 if e["event"] in ("duplicate_attached", "duplicate_replayed")]
        assert len(ended) == 1
        assert len(turnguard_events(tmp_path, "b", "duplicate_held")) == 1
        s = scrape(metrics_url(b))
        assert metric(s, "turnguard_duplicates_total", action="held") == 1
        assert metric(s, "turnguard_hold_seconds_count") == 1
        wait_until(lambda: ledger_query(
            ledger, "SELECT COALESCE(SUM(duplicates_held), 0) FROM operations")[0][0] == 1,
                   10, what="B's count of duplicates held in the ledger")
        assert_no_traceback(a.log_text() + b.log_text())


def test_a_large_body_whose_identity_runs_out_of_budget_is_counted_by_its_own_reason(tmp_path):
    """A body past the inline bound is identified in a worker process, within the request's
    budget: with a budget of 1 ms it cannot be, and the request is forwarded unguarded. Its
    passthrough is counted by a reason of its own, never ``other`` (what an operator alerts on
    as the unexpected)."""
    from turnguard_core.offload import INLINE_MAX_BYTES

    big = {**BODY, "input": "x" * (INLINE_MAX_BYTES + 1024)}
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up,
                                             turnguard_request_budget_ms=1) as p:
        url = metrics_url(p)
        assert post(p.url, body=big) == 200
        [passed] = wait_until(lambda: turnguard_events(tmp_path, kind="passthrough"), 10,
                              what="the passthrough")
        assert passed["reason"].startswith("identity"), passed
        s = scrape_until(url, lambda s: metric(s, "turnguard_passthrough_total") == 1,
                         "the passthrough counted")
        assert metric(s, "turnguard_passthrough_total", reason="other") == 0, \
            s["turnguard_passthrough_total"]
        assert len(up.dispatches()) == 1
        assert_no_traceback(p.log_text())
