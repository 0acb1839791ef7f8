"""The benchmark suite's CI smoke test: ``scripts/bench --quick`` runs end to end and reports
every measurement, with sane counts. No timing is asserted (CI machines are shared and noisy):
only that each figure exists and that the correctness checks of the run passed (every request
answered, one upstream dispatch per held operation, replays byte-identical, exactly once
across four processes)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from turnguard_bench import (  # noqa: E402
    calls_phase, instructions_phase, profiling, upstream)

BENCH_TIMEOUT_S = 600  # about 70 CPU s alone; a loaded CI machine took more than 400 s at twice the counts
# turnguard_baseline: turnguard as committed at HEAD (--baseline-rev), beside the working tree's
VARIANTS = ("plain", "plain_stream", "floor", "ledger_floor", "turnguard_baseline", "turnguard")


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out_json = tmp / "bench.json"
    out_text = tmp / "bench.out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO / "addon")])}
    with open(out_text, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "turnguard_bench", "--quick", "--json", str(out_json),
             "--baseline-rev", "HEAD"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: on a timeout it all goes
        )
        try:
            rc = proc.wait(BENCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            pytest.fail(f"scripts/bench --quick did not end within {BENCH_TIMEOUT_S} s:\n"
                        + out_text.read_text(errors="replace")[-6000:])
    text = out_text.read_text(errors="replace")
    assert rc == 0, f"scripts/bench --quick exited {rc}:\n{text[-6000:]}"
    return json.loads(out_json.read_text()), text


@pytest.mark.slow
def test_quick_mode_prints_the_table_and_the_note(quick_run, report):
    data, text = quick_run
    for heading in ("1. per-request overhead", "2. streaming", "3. holds", "4. replay",
                    "5. ledger", "6. soak", "targets (issues 5 and 14)"):
        assert heading in text
    assert "the ratios to plain mitmdump measured in the same run are what counts" in text
    assert data["mode"] == "quick" and data["failed_checks"] == []
    report(f"scripts/bench --quick: {len(data['targets'])} targets reported in "
           f"{data['duration_s']:.0f} s, all correctness checks passed")


@pytest.mark.slow
def test_per_request_measures_every_variant_and_answers_every_request(quick_run):
    pr = quick_run[0]["per_request"]
    assert set(pr["concurrency"]) == {"1", "8", "32", "128"}
    for c, row in pr["concurrency"].items():
        for v in VARIANTS:
            r = row[v]
            assert all(_num(r[k]) and r[k] > 0 for k in ("rps", "median_ms", "p99_ms",
                                                         "cpu_ms_per_request"))
            assert r["p99_ms"] >= r["median_ms"]
            # (each a median over the repeats, of a sum of clock ticks: equal ones may differ
            # in their last bits)
            assert 0 <= r["cpu_system_ms_per_request"] <= r["cpu_ms_per_request"] * (1 + 1e-9)
            for rep in r["reps"]:
                assert rep["answers"] == rep["ok"] == rep["requests"] > 0
                assert rep["statuses"] == [200] and rep["events_ok"]
                assert rep["upstream_dispatches"] == rep["requests"]  # distinct bodies: no replay
        for base in ("plain", "plain_stream", "floor", "ledger_floor", "turnguard_baseline"):
            ratios = row[f"turnguard_vs_{base}"]
            assert all(_num(ratios[k]) for k in ("rps_ratio", "median_ratio", "p99_ratio",
                                                  "added_median_ms"))
    assert all(pr["checks"].values())
    # the ledger floor wrote a claim and an end for every request (warm-up ones too)
    measured = sum(rep["requests"] for row in pr["concurrency"].values()
                   for rep in row["ledger_floor"]["reps"])
    assert pr["ledger_floor_completed_claims"] >= measured > 0


@pytest.mark.slow
def test_streaming_delivers_every_event(quick_run):
    st = quick_run[0]["streaming"]
    assert set(st["events"]) == {"1000", "10000"}
    for row in st["events"].values():
        for v in VARIANTS:
            assert _num(row[v]["events_per_s"]) and row[v]["events_per_s"] > 0
            assert _num(row[v]["ttfb_ms"])
            assert all(rep["events_complete"] and rep["ok"] == rep["responses"]
                       for rep in row[v]["reps"])
        assert _num(row["turnguard_vs_plain_stream"]["events_per_s_ratio"])
    assert all(st["checks"].values())


@pytest.mark.slow
def test_holds_coalesce_every_duplicate_into_one_dispatch(quick_run):
    ho = quick_run[0]["holds"]
    for rep in ho["variants"]["turnguard"]["reps"]:
        assert rep["answers"] == rep["operations"] + rep["duplicates"]
        assert rep["errors"] == 0 and rep["statuses"] == [200]
        assert rep["upstream_dispatches"] == rep["operations"]
        assert rep["replayed"] == rep["duplicates"]
        assert rep["upstream_held_during_hold"] == rep["operations"]
    for rep in ho["variants"]["plain"]["reps"]:
        assert rep["upstream_dispatches"] == rep["operations"] + rep["duplicates"]
    for v in ("plain", "turnguard"):
        r = ho["variants"][v]
        for k in ("answer_after_completion_p50_ms", "answer_after_completion_p99_ms",
                  "cpu_s_per_10s_hold", "rss_per_held_flow_kib"):
            assert _num(r[k]), (v, k, r[k])
        assert r["cpu_s_per_10s_hold"] >= 0
    assert all(ho["checks"].values())


@pytest.mark.slow
def test_replays_are_byte_identical_and_never_dispatched(quick_run):
    rp = quick_run[0]["replay"]
    assert set(rp["sizes"]) == {"0", str(1024), str(100 * 1024), str(5 * 1024 * 1024)}
    short = sum(map(len, upstream.events_body(8)))  # size 0: the 8-event stream
    for size, row in rp["sizes"].items():
        for rep in row["turnguard"]["reps"] + row["turnguard_baseline"]["reps"]:
            assert rep["replayed"] == rep["requests"] == rep["ok"]
            assert rep["distinct_bodies"] == 1 and rep["same_as_original"]
            assert rep["upstream_dispatches"] == 0
            assert rep["body_bytes"] == (int(size) or short)
        for v in ("plain", "plain_stream", "floor", "answer_floor", "turnguard"):
            assert _num(row[v]["rps"]) and row[v]["rps"] > 0
        assert "ledger_floor" not in row  # it only dispatches
    assert all(rp["checks"].values())


REPLAY_PARTS = ("request hook", "identity", "request facts (session owner)",
                "decision (admission, ledger)", "replay answer")
DISPATCH_PARTS = ("request hook", "identity", "request facts (session owner)",
                  "decision (admission, ledger)", "dispatch start (attempt, heartbeat)",
                  "responseheaders hook", "response hook")


@pytest.mark.slow
def test_hooks_phase_times_each_part_once_per_request_inside_mitmdump(quick_run):
    data, text = quick_run
    hk = data["hooks"]
    assert all(hk["checks"].values()) and "4a. inside mitmdump" in text
    n, replay = hk["replay"]["requests"], hk["replay"]["turnguard"]
    for part in REPLAY_PARTS:
        assert replay[part]["calls"] == n, part
        assert _num(replay[part]["median_us"]) and replay[part]["median_us"] > 0, part
    # every replay is explained by one log line: its record made and handled
    assert replay["log record handling (handlers)"]["calls"] >= n
    assert replay["telemetry line (JSON, log record)"]["calls"] >= n
    assert "dispatch start (attempt, heartbeat)" not in replay  # nothing goes upstream
    # a replay is the request identified just before, byte for byte: its identity is
    # remembered (identity_memo), its body never parsed again; each new operation's is
    parsing = "identity: parsing and hashing (not remembered)"
    assert parsing not in replay
    assert hk["dispatch"]["turnguard"][parsing]["calls"] == hk["dispatch"]["requests"]
    # the parts nest: a replay's identity, decision and answer are within its hook
    inner = sum(replay[p]["total_us"] for p in REPLAY_PARTS[1:])
    assert inner <= replay["request hook"]["total_us"]
    assert hk["replay"]["answer_floor"]["request hook"]["calls"] == n
    m, dispatch = hk["dispatch"]["requests"], hk["dispatch"]["turnguard"]
    for part in DISPATCH_PARTS:
        assert dispatch[part]["calls"] == m and _num(dispatch[part]["us_per_request"]), part
    assert "replay answer" not in dispatch
    # the ledger floor's hooks beside them: its claim in the request hook, its end in the
    # response hook, once a request each
    # outside the hooks: every response's chunks through the tee, and the deferred writes'
    # group commits (some commit with the next claim instead, in its decision)
    assert dispatch["response stream (the tee, per chunk)"]["calls"] >= m
    assert dispatch["group commit of deferred writes (after the hooks)"]["calls"] > 0
    floor = hk["dispatch"]["ledger_floor"]
    for part in ("request hook", "responseheaders hook", "response hook"):
        assert floor[part]["calls"] == m and _num(floor[part]["us_per_request"]), part
    # dispatch and outcome: at DEBUG, so no log record is made for them
    assert dispatch["telemetry line (JSON, log record)"]["calls"] >= 2 * m
    assert dispatch.get("log record handling (handlers)", {"calls": 0})["calls"] < m
    # the garbage collector's passes, timed in each process (their objects are the requests')
    for timed in (dispatch, replay, hk["replay"]["answer_floor"], hk["dispatch"]["plain_stream"]):
        passes = timed["garbage collection (every pass)"]
        assert passes["calls"] > 0 and _num(passes["us_per_request"])


@pytest.mark.slow
def test_ws_phase_completes_every_call_over_websocket_and_dispatches_each_once(quick_run):
    data, text = quick_run
    wsr = data["ws"]
    assert all(wsr["checks"].values()) and wsr["checks"]["runs"] > 0
    assert "4c. Responses over WebSocket" in text
    measured = 0
    for sockets, row in wsr["sockets"].items():
        for v in ("plain_stream", "ledger_floor", "turnguard"):
            for rep in row[v]["reps"]:
                assert rep["completed"] == rep["calls"] == rep["upstream_dispatches"]
                assert rep["failed"] == 0 and rep["events_per_call"] == [8]
            assert _num(row[v]["calls_per_s"]) and row[v]["calls_per_s"] > 0
        measured += sum(rep["calls"] for rep in row["ledger_floor"]["reps"])
        for pair in ("turnguard_vs_plain_stream", "turnguard_vs_ledger_floor",
                     "ledger_floor_vs_plain_stream"):
            ratios = row[pair]
            assert _num(ratios["calls_per_s_ratio"]) and _num(ratios["cpu_calls_per_s_ratio"])
    # the floor claimed and ended every call it relayed (the warm-up's too)
    assert wsr["ledger_floor_completed_claims"] >= measured > 0
    assert "ledger_floor/plain_stream" in text


@pytest.mark.slow
def test_ledger_claims_and_exactly_once(quick_run):
    le = quick_run[0]["ledger"]
    for k in ("claims_1_process", "claims_4_processes"):
        assert le[k]["claims"] == le[k]["attempted"] > 0 and le[k]["errors"] == 0
        assert _num(le[k]["claims_per_s"]) and le[k]["claims_per_s"] > 0
    eo = le["exactly_once"]
    assert eo["passed"]
    assert eo["dispatches"] == eo["identities"] == eo["operations_in_ledger"]
    assert eo["max_dispatches_per_identity"] == eo["max_attempts_per_operation"] == 1
    assert eo["kinds"].get("Dispatch") == eo["identities"]
    assert eo["kinds"].get("Hold", 0) == eo["admissions"] - eo["identities"]
    sc = le["scale"]
    assert [p["operations"] for p in sc["points"]] == quick_run[0]["config"]["ledger_scale_points"]
    for p in sc["points"]:
        assert all(_num(p[k]) and p[k] > 0 for k in ("live_bytes", "file_bytes", "admit_new_us",
                                                        "admit_replay_us"))
    # every write commits some pages: a claim its operation and attempt rows and their
    # indexes; the floor's claim at least its row
    wp = le["wal_pages"]
    assert all(_num(v) and v >= 1 for v in (*wp["turnguard"].values(), *wp["ledger_floor"].values()))
    assert wp["turnguard"]["claim"] > wp["ledger_floor"]["claim"]
    assert "pages written to the WAL a transaction" in quick_run[1]
    if "by_btree" in wp:  # (this SQLite has dbstat) a claim writes both rows, an end its recording
        assert {"operations", "attempts"} <= set(wp["by_btree"]["claim"])
        assert "spool" in wp["by_btree"]["finish"]
        assert "turnguard's claim by table or index: " in quick_run[1]


@pytest.mark.slow
def test_soak_reports_memory_and_ledger_size(quick_run):
    so = quick_run[0]["soak"]["variants"]["turnguard"]
    assert so["requests"] == so["requested"] and so["errors"] == 0
    assert [p["requests"] for p in so["points"]] == quick_run[0]["config"]["soak_checkpoints"]
    assert all(p["rss_mib"] > 0 and p["ledger_bytes"]["total"] > 0 for p in so["points"])
    # the database file never shrinks (no VACUUM); the WAL does (a purge's TRUNCATE
    # checkpoint), so their total may be smaller at the last point than at the first
    first, last = so["points"][0]["ledger_bytes"], so["points"][-1]["ledger_bytes"]
    assert last["db"] >= first["db"]
    assert _num(so["ledger_bytes_per_request_after_window"])
    assert _num(so["rss_growth_pct"])


@pytest.mark.slow
def test_every_target_is_reported_and_micro_figures_exist(quick_run):
    data = quick_run[0]
    names = " | ".join(t["target"] for t in data["targets"])
    for word in ("throughput >= 0.90x plain_stream at 128 clients", "0.95x the floor",
                 "median added latency", "p99 latency", "streaming 1,000", "streaming 10,000",
                 "replay of the 8-event SSE", "duplicates answered", "CPU during a hold",
                 "per held flow", "claims/s", "exactly once", "admission flat",
                 "per operation after the replay window", "flat memory"):
        assert word in names
    assert all(isinstance(t["met"], bool) for t in data["targets"])
    assert all(_num(v) and v > 0 for v in data["micro"].values())


def test_instructions_are_split_by_the_library_that_ran_them():
    """A callgrind dump's self costs summed by object file: names compressed to ``(n)`` are
    looked up where they were first named (an ``ob=`` or a ``cob=``), and the cost line after
    ``calls=`` (the callee's inclusive cost) is not counted again."""
    dump = "\n".join([
        "events: Ir",
        "ob=(1) /usr/lib/x86_64-linux-gnu/libc.so.6",
        "fl=(1) ???",
        "fn=(1) memcpy",
        "0 40",
        "ob=(2) /opt/lib/libpython3.13.so.1.0",
        "fn=(2) eval",
        "0 100",
        "+2 5",
        "cob=(3) /usr/lib/x86_64-linux-gnu/libsqlite3.so.0.8.6",
        "cfn=(3) sqlite3_step",
        "calls=1 0",
        "0 700",
        "cob=(1)",
        "cfn=(1)",
        "calls=2 0",
        "* 80",
        "ob=(3)",
        "fn=(3)",
        "0 660",
        "cob=(1)",
        "cfn=(1)",
        "calls=1 0",
        "0 40",
        "totals: 805",
    ])
    libs = instructions_phase.self_by_library(dump)
    assert libs == {"libc": 40, "libpython3.13": 105, "libsqlite3": 660}
    assert sum(libs.values()) == instructions_phase.parse_totals(dump)["Ir"]


def test_calls_are_counted_per_request_by_group_and_c_calls_by_their_caller():
    """The calls phase's arithmetic: a request is the window with N requests less the one with
    N/2, over N/2; a Python function counts in its file's group, a C function (``~``) in its
    caller's, and turnguard's functions are listed with the C calls each made."""
    tg = ("/x/addon-snapshot/turnguard_core/ledger.py", 10, "admit")
    mitm = ("/v/site-packages/mitmproxy/addonmanager.py", 5, "trigger")
    builtin = ("~", 0, "<built-in method builtins.len>")

    def stats(tg_calls, mitm_calls, len_by_tg, len_by_mitm):
        return {tg: (tg_calls, tg_calls, 0.0, 0.0, {mitm: (tg_calls, tg_calls, 0.0, 0.0)}),
                mitm: (mitm_calls, mitm_calls, 0.0, 0.0, {}),
                builtin: (0, len_by_tg + len_by_mitm, 0.0, 0.0,
                          {tg: (0, len_by_tg, 0.0, 0.0), mitm: (0, len_by_mitm, 0.0, 0.0)})}

    counted = calls_phase.per_request(stats(25, 103, 70, 9), stats(15, 53, 40, 7), 10)
    assert counted["by_group"] == {"turnguard": {"python": 1.0, "c": 3.0},
                                   "mitmproxy": {"python": 5.0, "c": 0.2}}
    assert counted["per_request"] == pytest.approx(9.2)
    assert counted["python_per_request"] == 6.0
    assert counted["turnguard_functions"] == [
        {"function": "turnguard_core/ledger.py:10 admit", "calls": 1.0, "c_calls": 3.0}]
    assert calls_phase.group_of("/usr/lib/python3.13/asyncio/events.py") == "asyncio"
    assert calls_phase.group_of("/usr/lib/python3.13/json/encoder.py") == "standard library"
    assert calls_phase.group_of("/x/addon-snapshot/turnguard.py") == "turnguard"


# -- pure parts of the suite -----------------------------------------------------------------
@pytest.mark.parametrize("size", [512, 600, 1024, 4200, 4300, 102400, 5 * 1024 * 1024])
def test_the_bench_upstream_sizes_bodies_exactly(size):
    frames = upstream.sized_body(size)
    assert sum(map(len, frames)) == size
    assert frames[-1].startswith(b"event: response.completed\n")


def test_the_bench_upstream_streams_the_asked_number_of_events():
    assert len(upstream.events_body(1000)) == 1000
    assert b"".join(upstream.events_body(8)).count(b"\n\n") == 8


def test_profile_categories():
    ledger = "/x/turnguard_core/ledger.py"
    addon = "/x/addon-snapshot/turnguard.py"
    mitm = "/v/site-packages/mitmproxy/proxy/server.py"
    stack = (f"run ({mitm});TurnGuard._record_end ({addon});_wrap.<locals>.wrapper ({ledger});"
             f"Ledger.finish ({ledger});_Transaction.__exit__ ({ledger})")
    assert profiling.categorize(stack) == "ledger.finish"
    tee_then_ledger = (f"run ({mitm});ResponseTee.__call__ (/x/turnguard_core/tee.py);"
                       f"TurnGuard._first_event ({addon});wrapper ({ledger});"
                       f"Ledger.first_event ({ledger})")
    assert profiling.categorize(tee_then_ledger) == "ledger.first_event"
    assert profiling.categorize(f"run ({mitm});x ({mitm})").startswith("not turnguard")
    assert profiling.categorize(f"run ({mitm});TurnGuard._show ({addon});trigger ({mitm})") \
        == "addon._show (mitmweb UpdateHook trigger)"
    # the shell (turnguard_shell/, mitmproxy's side of the addon) is turnguard's code too
    shell = "/x/addon-snapshot/turnguard_shell/websocket.py"
    assert profiling.categorize(f"run ({mitm});Sockets._call ({shell});x ({mitm})") \
        == "addon._call"
    assert profiling.categorize(f"run ({mitm});Sockets._call ({shell});wrapper ({ledger});"
                                f"Ledger.admit ({ledger})") == "ledger.admit"


def test_profile_scenarios_are_checked_before_anything_starts(tmp_path):
    out = subprocess.run([str(REPO / "scripts" / "bench"), "--profile", str(tmp_path / "p"),
                          "--profile-scenarios", "requests,websocket"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "--profile-scenarios wants some of requests,streaming,replay,holds,ws, " \
           "not 'requests,websocket'" in out.stderr
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("option", ["--json", "--profile"])
def test_an_output_path_the_bench_could_not_write_is_refused_before_it_runs(tmp_path, option,
                                                                            capsys):
    """--json FILE was written after the whole run (15 minutes in full mode): in a folder
    that is not there, the run ended in a traceback and its JSON was lost. --profile DIR under
    a file failed the same way. Both are usage errors before anything starts now."""
    from turnguard_bench.__main__ import parse

    (tmp_path / "a-file").write_text("")
    target = {"--json": tmp_path / "no-folder" / "bench.json",
              "--profile": tmp_path / "a-file" / "profiles"}[option]
    with pytest.raises(SystemExit) as exit_:
        parse(["--quick", "--phases", "micro", option, str(target)])
    assert exit_.value.code == 2
    assert option in capsys.readouterr().err
    parse(["--quick", "--phases", "micro", option, str(tmp_path / "fine")])  # a good one


def test_the_instructions_variants_are_chosen_on_the_command_line(capsys):
    """``--instructions-variants turnguard`` counts turnguard alone (a change measured with
    ``--addon-rev`` in a quarter of the time); a name that is no variant, or the option
    without the instructions phase, is a usage error before anything runs."""
    from turnguard_bench.__main__ import parse

    _, cfg, _ = parse(["--phases", "instructions", "--instructions-variants", "turnguard"])
    assert cfg.instructions_variants == ("turnguard",) and cfg.instructions == 200
    _, cfg, _ = parse(["--phases", "instructions"])
    assert cfg.instructions_variants == ("plain_stream", "floor", "ledger_floor", "turnguard")
    for argv, said in ((["--phases", "instructions", "--instructions-variants", "turnguard,x"],
                        "--instructions-variants wants some of plain_stream,floor,ledger_floor,"
                        "turnguard, not 'turnguard,x'"),
                       (["--phases", "micro", "--instructions-variants", "turnguard"],
                        "--instructions-variants goes with --phases instructions")):
        with pytest.raises(SystemExit) as exit_:
            parse(argv)
        assert exit_.value.code == 2 and said in capsys.readouterr().err
