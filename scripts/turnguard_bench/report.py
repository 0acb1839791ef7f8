"""The benchmark table (stdout) and the targets of issue 5, met or missed."""

from __future__ import annotations

import math

NOTE = ("Absolute figures vary by machine (and by what else runs on it); the ratios to plain "
        "mitmdump measured in the same run are what counts.")


def _f(x, fmt: str = ".2f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:{fmt}}{suffix}"


def _x(x) -> str:
    return _f(x, ".2f", "x")


def table(rows: list[list[str]], header: list[str]) -> str:
    cols = [header] + rows
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _setting_rows(label: str, row: dict, variant_cells, ratio_cells) -> list[list[str]]:
    """The table rows of one setting of a phase (a concurrency, a stream length, a body
    size): one per variant measured, ``[label, variant, *variant_cells(figures)]``, then one
    per ratio of turnguard to a plain variant, ``[label, "turnguard/<base>",
    *ratio_cells(ratios)]``."""
    rows = [[label, v, *variant_cells(row[v])]
            for v in ("plain", "plain_stream", "floor", "ledger_floor", "answer_floor",
                      "turnguard_baseline", "turnguard")
            if v in row]
    rows += [[label, f"turnguard/{base}", *ratio_cells(row[f"turnguard_vs_{base}"])]
             for base in ("plain", "plain_stream", "floor", "ledger_floor", "answer_floor",
                          "turnguard_baseline")
             if f"turnguard_vs_{base}" in row]
    return rows


def _ratio(row: dict, a: str, b: str, key: str):
    """``row[a][key] / row[b][key]``, or None when either is missing."""
    try:
        return row[a][key] / row[b][key]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _ledger_floor(row: dict, key: str, ratio_key: str) -> str:
    """The ledger floor's part of a target's detail: what a durable claim and end per request
    leave of plain_stream, and turnguard's share of that."""
    if "ledger_floor" not in row:
        return ""
    return (f"; the ledger floor vs plain_stream: {_x(_ratio(row, 'ledger_floor', 'plain_stream', key))}"
            f", turnguard / ledger_floor: "
            f"{_x(row.get('turnguard_vs_ledger_floor', {}).get(ratio_key))}")


def _libraries_shown(variants: dict) -> list[str]:
    """The libraries that executed at least 1 % of some variant's instructions a request,
    most first (by the largest variant's count)."""
    shown: dict[str, float] = {}
    for d in variants.values():
        libs, total = d.get("by_library", {}), d.get("per_request", 0.0)
        for lib, count in libs.items():
            if total > 0 and count >= 0.01 * total:
                shown[lib] = max(shown.get(lib, 0.0), count)
    return sorted(shown, key=lambda lib: -shown[lib])


def _section(title: str) -> str:
    return f"\n== {title} " + "=" * max(0, 90 - len(title))


def targets(res: dict) -> list[dict]:
    """Each target of issues 5 and 14 with the measured value and whether it is met."""
    out: list[dict] = []

    def add(name, value, met, detail=""):
        out.append({"target": name, "value": value, "met": met, "detail": detail})

    pr = res.get("per_request")
    if pr:
        rows = pr["concurrency"]
        for c, row in rows.items():
            vs_s = row.get("turnguard_vs_plain_stream", {})
            vs_f = row.get("turnguard_vs_floor", {})
            if "rps_ratio" in vs_s:
                add(f"throughput >= 0.90x plain_stream at {c} clients", _x(vs_s["rps_ratio"]),
                    vs_s["rps_ratio"] >= 0.90,
                    f"vs buffered plain: {_x(row.get('turnguard_vs_plain', {}).get('rps_ratio'))}"
                    f"; from CPU per request: {_x(vs_s.get('cpu_rps_ratio'))}")
            if "rps_ratio" in vs_f:
                add(f"throughput >= 0.95x the floor at {c} clients", _x(vs_f["rps_ratio"]),
                    vs_f["rps_ratio"] >= 0.95,
                    f"from CPU per request: {_x(vs_f.get('cpu_rps_ratio'))}; the floor vs "
                    f"plain_stream: {_x(_ratio(row, 'floor', 'plain_stream', 'rps'))}"
                    f"{_ledger_floor(row, 'rps', 'rps_ratio')}")
        a = rows.get("1", {}).get("turnguard_vs_plain_stream", {})
        if a:
            others = ", ".join(
                f"{c} clients {_f(rows[c].get('turnguard_vs_plain_stream', {}).get('added_median_ms'), '+.2f')} ms"
                for c in rows if c != "1")
            add("median added latency <= 0.5 ms vs plain_stream (1 client: unloaded)",
                _f(a["added_median_ms"], "+.2f", " ms"), a["added_median_ms"] <= 0.5,
                f"vs the floor: {_f(rows['1'].get('turnguard_vs_floor', {}).get('added_median_ms'), '+.2f', ' ms')}"
                f"; loaded (queueing included): {others}")
            others = ", ".join(
                f"{c} clients {_x(rows[c].get('turnguard_vs_plain_stream', {}).get('p99_ratio'))}"
                for c in rows if c != "1")
            add("p99 latency <= 1.25x plain_stream (1 client)", _x(a["p99_ratio"]),
                a["p99_ratio"] <= 1.25, f"loaded: {others}")
    st = res.get("streaming")
    if st:
        for ev, row in st["events"].items():
            r = row.get("turnguard_vs_plain_stream", {}).get("events_per_s_ratio")
            if r is not None:
                add(f"streaming {int(ev):,} events: events/s >= 0.90x plain_stream",
                    _x(r), r >= 0.90,
                    f"vs the floor: {_x(row.get('turnguard_vs_floor', {}).get('events_per_s_ratio'))}"
                    f"; from CPU per response: "
                    f"{_x(row.get('turnguard_vs_plain_stream', {}).get('cpu_events_per_s_ratio'))}"
                    f"{_ledger_floor(row, 'events_per_s', 'events_per_s_ratio')}")
    rp = res.get("replay")
    if rp and "0" in rp["sizes"]:
        row = rp["sizes"]["0"]
        r = row.get("turnguard_vs_plain_stream", {}).get("rps_ratio")
        if r is not None:
            add("replay of the 8-event SSE >= 1.5x plain_stream dispatching it", _x(r), r >= 1.5,
                f"vs buffered plain: {_x(row.get('turnguard_vs_plain', {}).get('rps_ratio'))}"
                f"; median latency {_x(row.get('turnguard_vs_plain_stream', {}).get('median_ratio'))}"
                f"; the ceiling (answer_floor / plain_stream): "
                f"{_x(_ratio(row, 'answer_floor', 'plain_stream', 'rps'))}, turnguard / "
                f"answer_floor: {_x(row.get('turnguard_vs_answer_floor', {}).get('rps_ratio'))}")
    ho = res.get("holds")
    if ho and "turnguard" in ho["variants"]:
        t = ho["variants"]["turnguard"]
        n = t["reps"][0]["duplicates"]
        add(f"duplicates answered within 20 ms p99 of the original's completion ({n} held)",
            _f(t["answer_after_completion_p99_ms"], ".1f", " ms"),
            t["answer_after_completion_p99_ms"] <= 20.0,
            f"plain mitmdump delivering {n} responses released at once: p99 "
            f"{_f(ho['variants'].get('plain', {}).get('answer_after_completion_p99_ms'), '.1f', ' ms')}")
        add(f"CPU during a hold of {n} flows < 0.2 s per 10 s",
            _f(t["cpu_s_per_10s_hold"], ".3f", " s"), t["cpu_s_per_10s_hold"] < 0.2,
            f"plain mitmdump with {n} requests waiting upstream: "
            f"{_f(ho['variants'].get('plain', {}).get('cpu_s_per_10s_hold'), '.3f', ' s')}")
        add("< 64 KiB resident memory per held flow", _f(t["rss_per_held_flow_kib"], ".1f", " KiB"),
            t["rss_per_held_flow_kib"] < 64,
            f"plain, per request waiting upstream: "
            f"{_f(ho['variants'].get('plain', {}).get('rss_per_held_flow_kib'), '.1f', ' KiB')}")
    le = res.get("ledger")
    if le and "scale" in le:
        sc = le["scale"]
        first, last = sc["points"][0], sc["points"][-1]
        growth = max(sc["admit_new_growth"], sc["admit_replay_growth"])
        add(f"admission flat from {first['operations']:,} to {last['operations']:,} operations "
            "(<= 1.5x)", _x(growth), growth <= 1.5,
            f"claim {first['admit_new_us']:.0f} -> {last['admit_new_us']:.0f} us, replay "
            f"{first['admit_replay_us']:.0f} -> {last['admit_replay_us']:.0f} us")
        add("ledger <= 1 KB per operation after the replay window",
            _f(last["live_bytes_per_operation"], ".0f", " B"),
            last["live_bytes_per_operation"] <= 1024,
            f"at {last['operations']:,} operations; the file: "
            f"{last['file_bytes_per_operation']:.0f} B per operation (free pages the next "
            "requests reuse)")
    if le:
        c1 = le["claims_1_process"]["claims_per_s"]
        add("ledger >= 5,000 claims/s in one process", _f(c1, ",.0f", "/s"), c1 >= 5000,
            f"4 processes: {_f(le['claims_4_processes']['claims_per_s'], ',.0f', '/s')} in all")
        eo = le["exactly_once"]
        add("exactly once across 4 processes",
            f"{eo['dispatches']}/{eo['identities']}", eo["passed"],
            f"{eo['admissions']} admissions, max {eo['max_dispatches_per_identity']} dispatch "
            f"per identity")
        pg = le.get("postgres") or {}
        if "claims_1_process" in pg:
            add("PostgreSQL ledger: exactly once across 4 processes",
                f"{pg['exactly_once']['dispatches']}/{pg['exactly_once']['identities']}",
                pg["exactly_once"]["passed"],
                f"claims/s {_f(pg['claims_1_process']['claims_per_s'], ',.0f')} (1 process), "
                f"{_f(pg['claims_4_processes']['claims_per_s'], ',.0f')} (4 processes)")
            w = pg["wake"]
            add("PostgreSQL: a duplicate held on another process answered <= 50 ms after the "
                "original's end (p99)", _f(w["p99_ms"], ".1f", " ms"),
                w["p99_ms"] is not None and w["p99_ms"] <= 50 and w["replayed_byte_identical"],
                f"p50 {_f(w['p50_ms'], '.1f', ' ms')} over {w['trials']} trials; polls while "
                f"held: {w['polls_while_held']}")
    so = res.get("soak")
    if so and "turnguard" in so["variants"]:
        t = so["variants"]["turnguard"]
        p = so["variants"].get("plain")
        limit = 10.0
        add(f"flat memory in the soak (RSS {t['first_at']:,} -> {t['last_at']:,} requests, "
            f"growth <= {limit:.0f}%)",
            _f(t["rss_growth_pct"], "+.1f", "%"), t["rss_growth_pct"] <= limit,
            f"{_f(t['rss_first_mib'], '.1f')} -> {_f(t['rss_last_mib'], '.1f')} MiB"
            + (f"; plain {_f(p['rss_growth_pct'], '+.1f', '%')}" if p else ""))
    return out


SIM_SHOWN = ("I1mr", "D1mr", "D1mw", "DLmr", "DLmw", "Bcm", "Bim")


def render(res: dict) -> str:
    o: list[str] = []
    env = res.get("environment", {})
    o.append(f"turnguard benchmark, {res.get('mode')} mode, {env.get('started')}; "
             f"git {env.get('git')}; addon from {env.get('addon_from')} (sha256 "
             f"{env.get('addon_sha256')}); Python {env.get('python')}, mitmproxy {env.get('mitmproxy')}; "
             f"{env.get('cpus')} CPUs, load average before {env.get('loadavg_before')} after "
             f"{env.get('loadavg_after')}; {res.get('duration_s', 0):.0f} s")
    from turnguard_bench.procs import VARIANTS

    o.append("variants: " + "; ".join(f"{k} = {v}" for k, v in VARIANTS.items())
             + "; all: mitmdump --mode reverse:<bench upstream> --listen-host 127.0.0.1, "
             "default options otherwise, output to a file")
    if env.get("baseline_from"):
        o.append(f"turnguard_baseline: addon from {env['baseline_from']}")
    if res.get("common_options"):
        o.append(f"options given to every mitmdump: {res['common_options']}")
    o.append(NOTE)

    pr = res.get("per_request")
    if pr:
        o.append(_section("1. per-request overhead: guarded POSTs, distinct bodies, 8-event SSE "
                          "answers (medians over repeats)"))
        rows = [cells for c, row in pr["concurrency"].items() for cells in _setting_rows(
            f"{c} clients", row,
            lambda r: [_f(r["rps"], ".0f"), _f(r["median_ms"]), _f(r["p99_ms"]),
                       f"{_f(r['cpu_ms_per_request'])} ({_f(r['cpu_system_ms_per_request'])})",
                       _f(r["rps_spread"] * 100, ".0f", "%")],
            lambda r: [_x(r["rps_ratio"]),
                       f"{_x(r['median_ratio'])} ({_f(r['added_median_ms'], '+.2f')})",
                       _x(r["p99_ratio"]),
                       f"{_f(r['added_cpu_ms_per_request'], '+.2f')} "
                       f"({_f(r['added_cpu_system_ms_per_request'], '+.2f')})",
                       f"CPU: {_x(r.get('cpu_rps_ratio'))}"])]
        o.append(table(rows, ["clients", "variant", "req/s", "median ms", "p99 ms",
                              "CPU ms/req (system)", "req/s spread"]))
        o.append("(ratio rows: req/s, latency ratios with the added median in ms, the added CPU "
                 "per request with the kernel's part of it in brackets, and 'CPU:' the "
                 "throughput ratio implied by CPU per request)")
        o.append(f"checks: {pr['checks']}")

    st = res.get("streaming")
    if st:
        o.append(_section("2. streaming: one client, SSE responses of N events, ledger tee on"))
        rows = [cells for ev, row in st["events"].items() for cells in _setting_rows(
            f"{int(ev):,} events", row,
            lambda r: [_f(r["events_per_s"], ",.0f"), _f(r["mib_per_s"], ".1f"), _f(r["ttfb_ms"]),
                       _f(r["total_ms"], ".1f"), _f(r["cpu_ms_per_response"], ".1f"),
                       _f(r["events_per_s_spread"] * 100, ".0f", "%")],
            lambda r: [_x(r["events_per_s_ratio"]), "", _x(r["ttfb_ratio"]), "",
                       f"CPU: {_x(r.get('cpu_events_per_s_ratio'))}", ""])]
        o.append(table(rows, ["stream", "variant", "events/s", "MiB/s", "TTFB ms", "total ms",
                              "CPU ms/resp", "spread"]))
        o.append(f"checks: {st['checks']}")

    ho = res.get("holds")
    if ho:
        any_rep = (ho["variants"].get("turnguard")
                   or next(iter(ho["variants"].values())))["reps"][0]
        o.append(_section(
            f"3. holds: {any_rep['duplicates']} concurrent duplicates of {any_rep['operations']} "
            f"operations, originals held {any_rep['hold_s']:.0f} s by the upstream"))
        rows = []
        for v, r in ho["variants"].items():
            rows.append([v, _f(r["answer_after_completion_p50_ms"], ".1f"),
                         _f(r["answer_after_completion_p99_ms"], ".1f"),
                         _f(r["answer_after_completion_max_ms"], ".1f"),
                         _f(r["cpu_s_per_10s_hold"], ".3f"), _f(r["rss_before_mib"], ".1f"),
                         _f(r["rss_during_hold_mib"], ".1f"), _f(r["rss_per_held_flow_kib"], ".1f"),
                         _f(r["setup_s"], ".1f"), _f(r.get("burst_answers_per_s"), ",.0f")])
        if "turnguard_vs_plain" in ho:
            r = ho["turnguard_vs_plain"]
            rows.append(["turnguard/plain", _x(r["p50_ratio"]), _x(r["p99_ratio"]), "",
                         _x(r["cpu_ratio"]), "", "", _x(r["rss_per_flow_ratio"]), "", ""])
        o.append(table(rows, ["variant", "p50 ms", "p99 ms", "max ms", "CPU s/10 s",
                              "RSS before MiB", "RSS held MiB", "KiB/flow", "setup s",
                              "answers/s"]))
        plain = ho["variants"].get("plain")
        o.append("(answer times are from the upstream's last byte of the response to the "
                 "client's last byte; plain mitmdump has no holds: there every duplicate waits "
                 "upstream and is answered by its own response, released at the same moment"
                 + (f"; plain had {plain['reps'][0]['duplicates']:,} duplicates, as many as its "
                    "file descriptors allow" if plain and plain["reps"][0]["duplicates"]
                    != any_rep["duplicates"] else "") + ")")
        o.append(f"checks: {ho['checks']}")

    rp = res.get("replay")
    if rp:
        o.append(_section("4. replay: identical requests answered from the recording "
                          "(plain variants: forwarded upstream)"))
        rows = [cells for size, row in rp["sizes"].items() for cells in _setting_rows(
            _size(int(size)), row,
            lambda r: [_f(r["rps"], ".0f"), _f(r["mib_per_s"], ".1f"), _f(r["median_ms"]),
                       _f(r["p99_ms"]), _f(r["rps_spread"] * 100, ".0f", "%")],
            lambda r: [_x(r["rps_ratio"]), "", _x(r["median_ratio"]), _x(r["p99_ratio"]), ""])]
        o.append(table(rows, ["body", "variant", "req/s", "MiB/s", "median ms", "p99 ms", "spread"]))
        o.append(f"checks: {rp['checks']}")

    hk = res.get("hooks")
    if hk:
        o.append(_section("4a. inside mitmdump: the hooks and their parts, timed in the process "
                          "(parts nest: the request hook holds the others)"))
        rows = []
        for load in ("replay", "dispatch"):
            for v in ("answer_floor", "ledger_floor", "plain_stream", "turnguard"):
                for part, t in hk[load].get(v, {}).items():
                    rows.append([load, v, part, _f(t["calls_per_request"], ".2f"),
                                 _f(t["median_us"], ".1f"), _f(t["p90_us"], ".1f"),
                                 _f(t["us_per_request"], ".1f")])
        o.append(table(rows, ["load", "addon", "part", "calls/req", "median us", "p90 us",
                              "us/req"]))
        o.append(f"checks: {hk['checks']}")

    rl = res.get("relay")
    if rl:
        o.append(_section("4b. the relay's cost: turnguard_detach_ms (the call on turnguard's own "
                          "flow, the client through the relay) vs direct dispatches"))
        rows = []
        for c, row in rl["concurrency"].items():
            for v in ("direct", "detached"):
                r = row[v]
                rows.append([c, v, _f(r["rps"], ".0f"), _f(r["median_ms"]),
                             _f(r["cpu_ms_per_request"])])
            d = row["detached_vs_direct"]
            rows.append([c, "detached/direct", _x(d["rps_ratio"]),
                         _f(d["added_median_ms"], "+.2f"), _f(d["added_cpu_ms_per_request"], "+.2f")])
        o.append(table(rows, ["clients", "variant", "req/s", "median ms", "CPU ms/req"]))
        o.append(f"checks: {rl['checks']}")

    wsr = res.get("ws")
    if wsr:
        o.append(_section("4c. Responses over WebSocket (Codex's default transport): calls on K "
                          "sockets, each socket one call at a time, the mock upstream"))
        rows = []
        for k, row in wsr["sockets"].items():  # each variant, then each "<a>_vs_<b>" ratio
            for v, r in row.items():
                if "_vs_" not in v:
                    rows.append([k, v, _f(r["calls_per_s"], ".0f"), _f(r["median_ms"]),
                                 _f(r["p99_ms"]), _f(r["cpu_ms_per_call"])])
            for pair, d in row.items():
                if "_vs_" in pair:
                    rows.append([k, pair.replace("_vs_", "/"), _x(d["calls_per_s_ratio"]),
                                 _f(d["added_median_ms"], "+.2f"), "",
                                 f"{_x(d['cpu_calls_per_s_ratio'])} by CPU"])
        o.append(table(rows, ["sockets", "variant", "calls/s", "median ms", "p99 ms",
                              "CPU ms/call"]))
        o.append(f"checks: {wsr['checks']}")

    le = res.get("ledger")
    if le:
        o.append(_section("5. ledger: Ledger.admit() of distinct identities (one BEGIN IMMEDIATE "
                          "claim each)"))
        a, b, eo = le["claims_1_process"], le["claims_4_processes"], le["exactly_once"]
        rows = [
            ["1 process", f"{a['claims']:,}", _f(a["seconds"], ".2f"), _f(a["claims_per_s"], ",.0f")],
            ["4 processes", f"{b['claims']:,}", _f(b["seconds"], ".2f"), _f(b["claims_per_s"], ",.0f")],
        ]
        o.append(table(rows, ["processes", "claims", "seconds", "claims/s"]))
        o.append(f"exactly once: {eo['identities']} identical identities admitted by each of "
                 f"{eo['processes']} processes at once -> {eo['dispatches']} dispatches, "
                 f"max {eo['max_dispatches_per_identity']} per identity, "
                 f"{eo['operations_in_ledger']} operations with at most "
                 f"{eo['max_attempts_per_operation']} attempt each, errors {eo['errors']}: "
                 f"{'PASSED' if eo['passed'] else 'FAILED'}")
        sc = le.get("scale")
        if sc:
            o.append(f"scale curve (an 8-event SSE recording per operation, purged {sc['window_s']:g} s "
                     "after its end, as past the replay window):")
            rows = [[f"{pt['operations']:,}", _f(pt["live_bytes_per_operation"], ".0f"),
                     _f(pt["file_bytes_per_operation"], ".0f"), _f(pt["admit_new_us"], ".1f"),
                     _f(pt["admit_replay_us"], ".1f"), _f(pt["fill_s"], ".0f")]
                    for pt in sc["points"]]
            o.append(table(rows, ["operations", "live B/op", "file B/op", "admit new us",
                                  "admit replay us", "fill s"]))
        wp = le.get("wal_pages")
        if wp:
            t, f = wp["turnguard"], wp["ledger_floor"]
            o.append(f"pages written to the WAL a transaction ({wp['operations']} operations): "
                     f"turnguard claim {t['claim']:.1f}, first event {t['first_event']:.1f}, "
                     f"finish with the recording {t['finish']:.1f} "
                     f"({sum(t.values()):.1f} in all); the ledger floor claim {f['claim']:.1f}, "
                     f"end with the body {f['end']:.1f} ({sum(f.values()):.1f})")
            for part, pages in (wp.get("by_btree") or {}).items():
                o.append(f"  turnguard's {part.replace('_', ' ')} by table or index: "
                         + ", ".join(f"{name} {k:g}" for name, k in pages.items()))
        pg = le.get("postgres") or {}
        if "skipped" in pg:
            o.append(f"PostgreSQL ledger: skipped ({pg['skipped']})")
        elif pg:
            a, b, eo, w = (pg["claims_1_process"], pg["claims_4_processes"], pg["exactly_once"],
                           pg["wake"])
            o.append("PostgreSQL ledger (PgLedger.admit(): an advisory-locked claim each, over a "
                     "loopback connection to a server on the same cores):")
            o.append(table([
                ["1 process", f"{a['claims']:,}", _f(a["seconds"], ".2f"), _f(a["claims_per_s"], ",.0f")],
                ["4 processes", f"{b['claims']:,}", _f(b["seconds"], ".2f"), _f(b["claims_per_s"], ",.0f")],
            ], ["processes", "claims", "seconds", "claims/s"]))
            o.append(f"exactly once: {eo['dispatches']} dispatches for {eo['identities']} "
                     f"identities x {eo['processes']} processes: "
                     f"{'PASSED' if eo['passed'] else 'FAILED'}")
            o.append(f"held duplicate on another mitmdump, answered after the original's end "
                     f"(LISTEN/NOTIFY), {w['trials']} trials: p50 {_f(w['p50_ms'], '.1f')} ms, "
                     f"p99 {_f(w['p99_ms'], '.1f')} ms, max {_f(w['max_ms'], '.1f')} ms; "
                     f"snapshot reads (polls) while held: {w['polls_while_held']}; replayed "
                     f"byte-identical: {w['replayed_byte_identical']}")

    so = res.get("soak")
    if so:
        o.append(_section("6. soak: distinct guarded requests, resident memory and ledger size"))
        rows = []
        for v, r in so["variants"].items():
            for pt in r["points"]:
                rows.append([v, f"{pt['requests']:,}", _f(pt["rss_mib"], ".1f"),
                             _f(pt["ledger_bytes"]["total"] / 2**20, ".1f") if "ledger_bytes" in pt else "-",
                             _f(pt["rps"], ".0f")])
        o.append(table(rows, ["variant", "requests", "RSS MiB", "ledger MiB", "req/s"]))
        t = so["variants"].get("turnguard")
        if t:
            o.append(f"turnguard RSS {t['first_at']:,} -> {t['last_at']:,} requests: "
                     f"{_f(t['rss_growth_pct'], '+.1f', '%')}; ledger (db+wal+shm) "
                     f"{t['ledger_bytes_last'] / 2**20:.1f} MiB = "
                     f"{t['ledger_bytes_per_request']:.0f} B/request, "
                     f"{t['ledger_bytes_per_request_after_window']:.0f} B/request once the last "
                     f"recordings passed the replay window ({t['replay_window_ms'] / 1000:g} s "
                     f"here; retention {t['retention_ms'] / 3600000:.0f} h: no operation expires "
                     "within a soak, the steady-state size is about request rate x retention x "
                     "B/request)")
        o.append(f"checks: {so['checks']}")

    mi = res.get("micro")
    if mi:
        o.append(_section("micro: turnguard's core in-process, per call (no mitmproxy)"))
        rows = [[k, _f(v, ",.1f")] for k, v in mi.items()]
        o.append(table(rows, ["measure", "value"]))

    ins = res.get("instructions")
    if ins:
        o.append(_section("instructions per request, counted (callgrind; one client, in turn)"))
        if "skipped" in ins:
            o.append(f"skipped: {ins['skipped']}")
        else:
            vs, added = ins.get("turnguard_vs", {}), ins.get("turnguard_added_per_request", {})
            rows = [[v, f"{d['per_request']:,.0f}", _x(vs.get(v)),
                     f"{added[v]:+,.0f}" if v in added else ""]
                    for v, d in ins["variants"].items()]
            o.append(table(rows, ["variant", "instructions a request", "variant / turnguard",
                                  "turnguard's added"]))
            o.append(f"({ins['requests']} requests a variant; user-space instructions only: "
                     "system calls and cache misses are not in these counts)")
            libs = _libraries_shown(ins["variants"])
            if libs:
                by_lib = [[lib, *(f"{d.get('by_library', {}).get(lib, 0.0):,.0f}"
                                  for d in ins["variants"].values())] for lib in libs]
                by_lib.append(["other", *(
                    f"{sum(v for k, v in d.get('by_library', {}).items() if k not in libs):,.0f}"
                    for d in ins["variants"].values())])
                o.append(table(by_lib, ["library (a request)", *ins["variants"]]))
                o.append("(self instructions of each library's functions: libpython runs every "
                         "Python function, mitmproxy's and the addon's; libsqlite3 a ledger's SQL)")
            if ins.get("simulated"):
                by_est = ins.get("turnguard_vs_by_estimated_cycles", {})
                sim = [[v, *(f"{d['simulated_per_request'].get(e, 0):,.0f}" for e in SIM_SHOWN),
                        f"{d['estimated_cycles_per_request']:,.0f}", _x(by_est.get(v))]
                       for v, d in ins["variants"].items()]
                o.append(table(sim, ["variant (a request)", *SIM_SHOWN, "cycles estimated",
                                     "variant / turnguard"]))
                o.append("(simulated by callgrind: I1mr/D1mr/D1mw first-level misses, "
                         "DLmr/DLmw last-level data misses, Bcm/Bim mispredicted conditional/"
                         "indirect branches; cycles = Ir + 10 Bm + 10 L1m + 100 LLm)")
            o.append(f"checks: {ins['checks']}")

    ca = res.get("calls")
    if ca:
        o.append(_section("Python calls per request, counted (Python's profiler; one client, "
                          "in turn)"))
        variants = ca["variants"]
        groups = sorted({g for d in variants.values() for g in d["by_group"]},
                        key=lambda g: -max(sum(d["by_group"].get(g, {}).values())
                                           for d in variants.values()))

        def in_group(d: dict, g: str) -> str:
            counts = d["by_group"].get(g)
            return "" if counts is None else f"{counts['python']:,.0f} + {counts['c']:,.0f}"

        rows = [[v, f"{d['per_request']:,.0f}", *(in_group(d, g) for g in groups)]
                for v, d in variants.items()]
        o.append(table(rows, ["variant", "calls a request", *groups]))
        o.append("(by group: calls of its Python functions + calls of C functions they made)")
        added = ca.get("turnguard_added_per_request", {})
        if added:
            o.append(table([[v, f"{a['all']:+,.0f}", *(f"{a[g]:+,.0f}" for g in groups)]
                            for v, a in added.items()],
                           ["turnguard adds to", "calls a request", *groups]))
        ours = variants.get("turnguard", {}).get("turnguard_functions", [])
        if ours:
            o.append(table([[f["function"], f"{f['calls']:,.1f}", f"{f['c_calls']:,.1f}"]
                            for f in ours],
                           ["turnguard's function", "calls a request", "its C calls"]))
        o.append(f"({ca['requests']} requests a variant; a count is not a time: see the hooks "
                 "phase and --profile for where the time goes)")
        o.append(f"checks: {ca['checks']}")

    tg = res.get("targets")
    if tg:
        o.append(_section("targets (issues 5 and 14)"))
        rows = [[t["target"], t["value"], "met" if t["met"] else "MISSED", t["detail"]] for t in tg]
        o.append(table(rows, ["target", "measured", "", "context"]))
        if res.get("mode") == "quick":
            o.append("(quick mode: small counts, indicative only; the full mode's figures count)")
    o.append("")
    o.append(NOTE)
    return "\n".join(o)


def _size(n: int) -> str:
    if n == 0:
        return "8-event SSE"
    if n >= 2**20:
        return f"{n / 2**20:g} MiB"
    if n >= 1024:
        return f"{n / 1024:g} KiB"
    return f"{n} B"
