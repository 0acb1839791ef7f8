"""Prometheus metrics in-process: the telemetry sink, the endpoint's life (serve, reload, refuse)
and the gauges, through the addon in a ``taddons`` context and a real loopback HTTP scrape.
The end-to-end checks against a real mitmdump and the upstream's log are in
``test_e2e_metrics.py``."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import httpx
import pytest
from mitmproxy import exceptions

from harness import metric, scrape
from test_addon import WAIT_S, hold_duplicate, make_guard, sse_body, stream_response, until
from turnguard_core import metrics as m
from turnguard_core.ledger_admin import LedgerAdmin
from turnguard_core.options import parse_listen_address


def url_of(guard) -> str:
    host, port = guard.tg.metrics.address
    return f"http://{host}:{port}/metrics"


# -- the listen address ------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("", None), ("  ", None), ("127.0.0.1:9464", ("127.0.0.1", 9464)), ("[::1]:0", ("::1", 0)),
    ("localhost:1", ("localhost", 1)), ("0.0.0.0:9464", ("0.0.0.0", 9464)),
])
def test_listen_addresses_parse(text, want):
    assert parse_listen_address(text) == want


@pytest.mark.parametrize("text", ["9464", ":9464", "::1:9464", "[::1:9", "h:65536", "h:x", "a b:1",
                                  "h:\u0669\u0664\u0666\u0664", "h:2\u00b2",
                                  "h/x:1"])
def test_bad_listen_addresses_say_why(text):
    with pytest.raises(ValueError):
        parse_listen_address(text)


# -- the sink ----------------------------------------------------------------------------------


def samples(metrics: m.Metrics) -> dict:
    out: dict = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def test_every_record_counts_and_labels_come_from_fixed_sets():
    metrics = m.Metrics("inst1")
    emit = metrics.observe
    emit("dispatch", {"kind": "original"})
    emit("dispatch", {"kind": "made-up"})
    emit("passthrough", {"reason": "body too large (99 bytes > limit 1)"})
    emit("passthrough", {"reason": "sk-secret-looking free text"})
    emit("fail_closed", {"reason": "owner_proof_missing", "code": "x", "answer_status": 503})
    emit("cooldown_rejected", {"reason": "mode_fail_closed", "answer_status": 503,
                               "code": "upstream_request_timeout"})
    emit("duplicate_held", {"flow": "f1"})
    emit("duplicate_replayed", {"flow": "f1", "held_ms": 1500})
    emit("duplicate_replayed", {"flow": "f2", "held_ms": 0})  # a retry answered, never held
    emit("outcome", {"outcome": "completed", "duration_ms": 2000, "first_event_ms": 120.5})
    emit("circuit_opened", {"scope": "session:abc"})
    emit("ledger_unavailable", {"during": "admit", "error": "disk I/O error"})
    s = samples(metrics)
    assert metric(s, "turnguard_dispatches_total", kind="original") == 1
    assert metric(s, "turnguard_dispatches_total", kind="other") == 1
    assert metric(s, "turnguard_passthrough_total", reason="body_too_large") == 1
    assert metric(s, "turnguard_passthrough_total", reason="other") == 1
    assert metric(s, "turnguard_fail_closed_total", reason="owner_proof_missing") == 1
    assert metric(s, "turnguard_answers_total", status="503") == 2
    assert metric(s, "turnguard_answers_total", code="other") == 1
    assert metric(s, "turnguard_duplicates_total", action="replayed") == 2
    assert metric(s, "turnguard_hold_seconds_count", result="replayed") == 1  # only the held one
    assert metric(s, "turnguard_hold_seconds_sum") == 1.5
    assert metric(s, "turnguard_attempt_duration_seconds_sum", outcome="completed") == 2.0
    assert metric(s, "turnguard_time_to_first_event_seconds_sum") == pytest.approx(0.1205)
    assert metric(s, "turnguard_circuit_opened_total") == 1
    assert metric(s, "turnguard_ledger_outages_total", during="admit") == 1
    assert metric(s, "turnguard_events_total") == 12
    # every series names its process; no label value is free text from a request
    for name, rows in s.items():
        if name.startswith("turnguard_"):
            for labels, _ in rows:
                assert labels["turnguard_instance"] == "inst1"
                assert "secret" not in "".join(labels.values())


def test_the_sink_never_raises():
    metrics = m.Metrics("i")
    metrics.observe("outcome", {"duration_ms": "not a number", "outcome": object()})
    metrics.observe("duplicate_rejected", {"flow": None, "held_ms": -5})
    assert metric(samples(metrics), "turnguard_outcomes_total", outcome="other") == 1


def test_a_scraper_that_resets_or_goes_silent_prints_no_traceback(capfd, monkeypatch):
    monkeypatch.setattr(m, "SCRAPE_READ_TIMEOUT_S", 0.2)
    monkeypatch.setattr(m._QuietHandler, "timeout", 0.2)
    metrics = m.Metrics("i")
    host, port = metrics.serve("127.0.0.1", 0)
    try:
        silent = socket.create_connection((host, port))
        reset = socket.create_connection((host, port))
        reset.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n")
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()
        time.sleep(0.6)  # past the read timeout of the silent one
        silent.close()
        assert scrape(f"http://{host}:{port}/metrics")  # still serving
    finally:
        metrics.close()
    assert "Traceback" not in capfd.readouterr().err


def test_each_metrics_object_has_its_own_registry():
    a, b = m.Metrics("a"), m.Metrics("b")
    a.observe("dispatch", {"kind": "original"})
    assert metric(samples(a), "turnguard_dispatches_total") == 1
    assert metric(samples(b), "turnguard_dispatches_total") == 0


def test_the_passthrough_reasons_of_the_code_map_to_their_own_labels():
    reasons = ["request body is streamed", "body too large (5 bytes > limit 1)",
               "upstream unknown (no host)", "principal undetermined (proxyauth metadata)",
               "body could not be decoded", "no body", "body is not UTF-8",
               "duplicate keys in JSON body", "JSON nesting too deep", "body is not JSON",
               "body is not a JSON object", "identity failed (KeyError)",
               "internal error: ValueError()", "recording missing",
               "response content-encoding gzip: events not counted"]
    labels = [m.passthrough_label(r) for r in reasons]
    assert m.OTHER not in labels and len(set(labels)) == len(labels)
    # a socket let go, and an upstream frame passed on with the socket still guarded
    assert m.passthrough_label("upstream frame is not a Responses event (binary)") \
        == "not_responses"
    assert m.passthrough_label("upstream frame passed on: not a Responses event (text) "
                               "inside a response; the response is not recorded") \
        == "frame_passed_on"


def test_every_passthrough_reason_written_in_the_code_has_its_label():
    """Every ``Passthrough("...")`` the addon makes (its text's start, before any value put
    in it) is counted by a label of its own, never ``other``."""
    import re
    from pathlib import Path

    root = Path(m.__file__).resolve().parent.parent
    starts = {match for source in root.rglob("*.py")
              for match in re.findall(r'Passthrough\(\s*f?"([^"{]*)', source.read_text())}
    assert len(starts) > 8, starts
    assert sorted(r for r in starts if m.passthrough_label(r) == m.OTHER) == []


# -- the endpoint through the addon ------------------------------------------------------------


async def test_a_hold_and_a_replay_show_in_a_scrape_and_the_gauges_follow(tmp_path):
    async with make_guard(tmp_path, turnguard_metrics="127.0.0.1:0") as g:
        url = url_of(g)
        before = await asyncio.to_thread(scrape, url)
        assert metric(before, "turnguard_ledger_up") == 1
        assert metric(before, "turnguard_info", recovery_mode="fail_closed") == 1
        f1, f2, task = await hold_duplicate(g)
        held = await asyncio.to_thread(scrape, url)
        assert metric(held, "turnguard_flows_held", wait="duplicate") == 1
        assert metric(held, "turnguard_attempts_in_flight") == 1
        assert metric(held, "turnguard_dispatches_total", kind="original") == 1
        assert metric(held, "turnguard_duplicates_total", action="held") == 1
        stream_response(g, f1, sse_body())
        await asyncio.wait_for(task, WAIT_S)
        after = await asyncio.to_thread(scrape, url)
        assert metric(after, "turnguard_flows_held") == 0
        assert metric(after, "turnguard_attempts_in_flight") == 0
        assert metric(after, "turnguard_duplicates_total", action="replayed") == 1
        assert metric(after, "turnguard_outcomes_total", outcome="completed") == 1
        assert metric(after, "turnguard_hold_seconds_count", result="replayed") == 1
        assert metric(after, "turnguard_time_to_first_event_seconds_count") == 1
        assert metric(after, "process_resident_memory_bytes") > 0
        # the ledger counts the duplicate on its operation too (for scripts/turnguard)
        ledger = LedgerAdmin(str(g.tmp_path / "ledger.sqlite3"), "inspector")
        ledger.open_readonly()
        try:
            await until(lambda: ledger.duplicate_totals() == {"held": 1, "replayed": 1},
                        "the duplicate counts in the ledger")
        finally:
            ledger.close()


async def test_done_frees_the_address_so_a_reloaded_script_binds_it_again(tmp_path):
    async with make_guard(tmp_path, turnguard_metrics="127.0.0.1:0") as g:
        host, port = g.tg.metrics.address
        g.tg.done()
        with socket.create_server((host, port)):  # free at once
            pass
    (tmp_path / "again").mkdir()
    async with make_guard(tmp_path / "again", turnguard_metrics=f"127.0.0.1:{port}") as g2:
        assert g2.tg.metrics.address == ("127.0.0.1", port)
        assert metric(await asyncio.to_thread(scrape, url_of(g2)), "turnguard_ledger_up") == 1


async def test_an_address_in_use_is_refused_at_start_up(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        async with make_guard(tmp_path, turnguard_metrics=f"127.0.0.1:{port}") as g:
            pass
    assert g.tg.refused and "turnguard_metrics" in g.tg.refused[0]
    assert "cannot serve metrics there" in g.tg.refused[0]


async def test_a_bad_address_while_running_keeps_the_endpoint_in_use(tmp_path):
    async with make_guard(tmp_path, turnguard_metrics="127.0.0.1:0") as g:
        url = url_of(g)
        with socket.create_server(("127.0.0.1", 0)) as busy:
            with pytest.raises(exceptions.OptionsError, match="turnguard_metrics"):
                g.tctx.configure(g.tg, turnguard_metrics=f"127.0.0.1:{busy.getsockname()[1]}")
        with pytest.raises(exceptions.OptionsError, match="turnguard_metrics"):
            g.tctx.configure(g.tg, turnguard_metrics="nonsense")
        assert metric(await asyncio.to_thread(scrape, url), "turnguard_ledger_up") == 1
        g.tctx.configure(g.tg, turnguard_metrics="")  # off: no longer served, still counted
        assert g.tg.metrics is None and g.tg.telemetry.sink is not None
        with pytest.raises(httpx.ConnectError):
            await asyncio.to_thread(scrape, url)


async def test_metrics_off_by_default_and_nothing_listens(tmp_path):
    async with make_guard(tmp_path) as g:
        assert g.tg.metrics is None and g.tg.telemetry.sink is None


def test_histogram_buckets_are_cumulative_and_end_with_the_count():
    metrics = m.Metrics("i")
    for ms in (50, 100, 2000, 700_000):  # 0.05 s, on a bound, inside, past the last bound
        metrics.observe("outcome", {"outcome": "completed", "duration_ms": ms})
    rows = {lab["le"]: v for lab, v in samples(metrics)["turnguard_attempt_duration_seconds_bucket"]
            if lab["outcome"] == "completed"}
    assert rows["0.1"] == 2 and rows["2.5"] == 3 and rows["600.0"] == 3 and rows["+Inf"] == 4
    assert list(rows.values()) == sorted(rows.values())
    s = samples(metrics)
    assert metric(s, "turnguard_attempt_duration_seconds_count", outcome="completed") == 4
    assert metric(s, "turnguard_attempt_duration_seconds_sum") == pytest.approx(702.15)


def test_every_reason_a_websocket_frame_is_no_call_has_its_label():
    from turnguard_core import ws

    frames = [(b"\x00", False), (b"\xff", True), (b"[]", True), (b"nope", True),
              (b'{"type":"session.update"}', True),
              (b"[" * (ws.MAX_FRAME_CONTAINERS + 1), True)]
    for content, is_text in frames:
        reason = ws.parse_client_frame(content, is_text).reason
        assert m.passthrough_label(reason) != m.OTHER, reason


def test_every_ledger_call_an_outage_is_said_during_has_its_own_label():
    """``ledger_unavailable``'s ``during`` is one of ``LEDGER_CALLS`` for every call turnguard
    makes (a literal of ``failover``'s, or a write's ``WRITE_CALLS`` name): never ``other``."""
    import re
    from pathlib import Path

    from turnguard_core import failover, metrics

    source = Path(failover.__file__).read_text()
    said = set(re.findall(r'_down\([^,]+, "([a-z_ ]+)"\)', source))
    said |= set(re.findall(r'self\._call\(\s*"([a-z_ ]+)"', source))
    said |= set(failover.WRITE_CALLS.values())
    assert {"open", "admit", "finish", "first_event"} <= said
    assert sorted(said - set(metrics.LEDGER_CALLS)) == []
