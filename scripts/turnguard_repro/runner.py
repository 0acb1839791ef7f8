"""Run a scenario's columns and measure them.

One column = a fresh mock upstream, a fresh mitmdump (with or without turnguard, a fresh ledger
and events file) on loopback ports the OS picks, and the scenario's clients. Columns run side by
side (each has its own processes and ports) unless ``serial``. Counts come from the mock's
dispatch log and turnguard's events file; the clients' own records say what each client saw.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnguard_procs import read_jsonl

from . import clients as clientmod
from . import procs
from .scenarios import COLUMNS, PRODUCTION

DEFAULT_RESPONSE_CREATED_TIMEOUT_MS = 60000  # turnguard's default, when nothing sets it

SETTLE_TIMEOUT_S = 3.0  # after the clients: wait for the mock to log every dispatch's end

HOLD_FIELDS = {  # turnguard events that say how long a request was held
    "duplicate_replayed": "held_ms",
    "duplicate_attached": "held_ms",
    "duplicate_rejected": "held_ms",
    "duplicate_forwarded": "held_ms",
    "hold_abandoned": "held_ms",
    "wait_finished": "waited_ms",
}


@dataclass
class ColumnResult:
    column: str
    title: str
    clients: list[clientmod.ClientResult]
    dispatches: list[dict[str, Any]]  # mock "dispatch" records, each with "end" merged in
    tg_events: list[dict[str, Any]]
    flowlog: list[dict[str, Any]]
    t0: float
    t_end: float
    options: dict[str, Any]
    workdir: str
    flows_file: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def turnguard_options(scenario: dict[str, Any], column: str, workdir: Path,
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every --set for a turnguard column: ledger/events in the column's folder, the
    scenario's options (a built-in's include its shortened timings), the column's own, then
    ``extra`` (command line)."""
    opts: dict[str, Any] = {
        "turnguard_ledger": str(workdir / "ledger.sqlite3"),
        "turnguard_events": str(workdir / "turnguard-events.jsonl"),
        **scenario.get("turnguard_options", {}),
        **COLUMNS[column]["options"],
        **(extra or {}),
    }
    return opts


def private_folder(path: Path) -> None:
    """Make ``path`` and each missing folder above it 0700, whatever the umask: a column's
    folder holds its ledger, events, logs and the scenario's requests, and turnguard refuses
    a ledger or events file in a folder others may write to (the umask 000 made it 0777, and
    every turnguard column then lost its turn). A folder that exists is left as it is."""
    missing = []
    while not path.exists() and path != path.parent:  # bounded by the path's depth
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another column: left as it is
            continue
        folder.chmod(0o700)  # (mkdir's mode goes through the umask)


async def run_column(
    scenario: dict[str, Any], column: str, workdir: Path, *, save_flows: Path | None = None,
    extra_options: dict[str, Any] | None = None,
) -> ColumnResult:
    private_folder(workdir)
    spec = COLUMNS[column]
    opts = turnguard_options(scenario, column, workdir, extra_options) if spec["addon"] else {}
    flowlog = workdir / "flows.jsonl"
    mock = mitm = None
    try:
        mock, up_url, mock_log = await procs.start_mock(workdir, scenario["upstream"])
        mitm, url = await procs.start_mitmdump(workdir, up_url, addon=spec["addon"], options=opts,
                                               save_flows=save_flows, flowlog=flowlog)
        t0 = time.time()
        models = [clientmod.make_client(c, url, seed=i) for i, c in enumerate(scenario["clients"])]
        async with asyncio.timeout(scenario["deadline_s"] + 5):
            results = list(await asyncio.gather(*(m.run() for m in models)))
        t_end = max([r.end for r in results] + [t0])
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:  # bounded: every dispatch logged its end
            recs = read_jsonl(mock_log)
            started = {r["n"] for r in recs if r.get("event") == "dispatch"}
            ended = {r["n"] for r in recs if r.get("event") == "dispatch_end"}
            if started <= ended:
                break
            await asyncio.sleep(0.05)
    finally:
        # Stop both in a thread (a blocking wait here would stall the other columns' clients).
        # Handed to the executor here, before any await: a task for it (asyncio.to_thread) could
        # be cancelled before its first step by asyncio.run's teardown, which cancels every task
        # still running once the main task ends (a second ^C, or the first column done), and
        # then nothing stopped them. The executor's future is no task: the teardown leaves it
        # alone and waits for the executor, so both are stopped however often this column is
        # cancelled; shielded so that a cancelled await does not cancel the stop.
        def stop_both() -> None:
            for proc in (mitm, mock):
                if proc is not None:
                    proc.stop()

        await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, stop_both))
    recs = read_jsonl(mock_log)
    ends = {r["n"]: r for r in recs if r.get("event") == "dispatch_end"}
    dispatches = []
    for r in recs:
        if r.get("event") == "dispatch":
            dispatches.append({**r, "end": ends.get(r["n"])})
    res = ColumnResult(
        column, spec["title"], results, dispatches,
        read_jsonl(workdir / "turnguard-events.jsonl") if spec["addon"] else [],
        read_jsonl(flowlog), t0, t_end, opts, str(workdir),
        str(save_flows) if save_flows else None,
    )
    res.metrics = summarize(res)
    return res


async def run_scenario(
    scenario: dict[str, Any], workdir: Path, *, columns: list[str] | None = None,
    save_flows: Path | None = None, extra_options: dict[str, Any] | None = None,
    serial: bool = False,
) -> list[ColumnResult]:
    cols = columns or scenario["columns"]

    def flows_for(col: str) -> Path | None:
        if save_flows is None:
            return None
        if len(cols) == 1:
            return save_flows
        return save_flows.with_name(f"{save_flows.stem}.{col}{save_flows.suffix or '.flows'}")

    jobs = [
        (col, lambda col=col: run_column(scenario, col, workdir / col, save_flows=flows_for(col),
                                         extra_options=extra_options))
        for col in cols
    ]
    if serial:
        return [await job() for _, job in jobs]
    return list(await asyncio.gather(*(job() for _, job in jobs)))


def timings_in_force(scenario: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, int]:
    """The values of the options ``PRODUCTION`` names that a turnguard column runs with (the
    scenario's, then the command line's; turnguard's default otherwise)."""
    opts = {**scenario.get("turnguard_options", {}), **(extra or {})}
    return {k: int(opts.get(k, v)) for k, v in PRODUCTION.items()}


def _stall_ms(b: dict[str, Any]) -> tuple[float, str] | None:
    """How long a behaviour keeps a dispatch without a response event, and how."""
    kind = b.get("kind")
    if kind == "stall_before_headers":
        return float(b.get("ms", 600000)), "no response headers"
    if kind == "stall_after_headers":
        return float(b.get("ms", 600000)), "headers, then no event"
    before = float(b.get("delay_ms", 60000 if kind == "slow" else 0) or 0)
    before += float(b.get("first_event_ms", 0) or 0)
    if kind in ("ok", "slow", "tool_call", "partial") and before > 0:
        return before, "no response event"
    return None


def stall_warnings(scenario: dict[str, Any], extra: dict[str, Any] | None = None) -> list[str]:
    """One line per upstream behaviour that keeps a dispatch without a response event for
    longer than the ``turnguard_response_created_timeout_ms`` in force: turnguard cuts such a
    dispatch (``missing_response_created_timeout``), which a capture did not show."""
    timeout = timings_in_force(scenario, extra)["turnguard_response_created_timeout_ms"]
    if timeout <= 0 or "source" not in scenario:  # only a capture's stalls: the built-ins
        return []  # shorten the timeout on purpose
    up = scenario.get("upstream") or {}
    found: list[tuple[str, dict[str, Any]]] = []
    for i, b in enumerate(up.get("sequence") or []):
        found.append((f"dispatch {i}", b))
    if isinstance(up.get("default"), dict):
        found.append(("every other dispatch", up["default"]))
    for group in ("sessions", "operations"):
        for key, sel in (up.get(group) or {}).items():
            for i, b in enumerate(sel.get("sequence") or []):
                found.append((f"{group[:-1]} {key[:12]} dispatch {i}", b))
            if isinstance(sel.get("default"), dict):
                found.append((f"{group[:-1]} {key[:12]} default", sel["default"]))
    out = []
    for where, b in found:
        stall = _stall_ms(b)
        if stall is not None and stall[0] > timeout:
            out.append(f"{where}: {stall[1]} for {stall[0] / 1000:g} s, longer than "
                       f"turnguard_response_created_timeout_ms={timeout}: turnguard columns cut it "
                       "(missing_response_created_timeout); set "
                       f"--set turnguard_response_created_timeout_ms={int(stall[0]) + 1000} to "
                       "replay it whole")
    return out


# ------------------------------------------------------------------------------------------------
# Metrics: pure functions of the records


# turnguard's circuit_opened event carries the cooldown's length, not its end; the event is
# written a few ms after the ledger computed open_until (7 ms seen), so a window derived from
# the event's ts ends a little late. A dispatch this close to the end is the cooldown's end,
# not a breach (the recovery dispatch lands there by design).
COOLDOWN_END_SLACK_S = 0.1


def cooldown_windows(tg_events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """[start, end) of every cooldown, from turnguard's circuit_opened events (end minus
    COOLDOWN_END_SLACK_S)."""
    return [
        (e["ts"], e["ts"] + e.get("cooldown_ms", 0) / 1000 - COOLDOWN_END_SLACK_S)
        for e in tg_events if e.get("event") == "circuit_opened"
    ]


def turn_outcomes(
    clients: list[clientmod.ClientResult],
) -> tuple[dict[str, str], dict[str, str], int]:
    """Each client's outcome, the reason, and the number of recorded requests that failed and
    that no client retried. A timeline client (a capture's replay) lost its turn only when one
    of its recorded turns (same path and body, whoever sent it) was retried and still never
    completed by any client: a failure nobody retried in the capture is the capture's, not a
    lost turn."""
    outcomes = {c.name: c.outcome for c in clients}
    reasons = {c.name: c.reason for c in clients}
    turns: dict[str, dict[str, int]] = {}
    for c in clients:
        for key, t in (c.extra.get("turns") or {}).items():
            agg = turns.setdefault(key, {"requests": 0, "completed": 0})
            agg["requests"] += t["requests"]
            agg["completed"] += bool(t["completed"])
    unretried = 0
    for c in clients:
        mine = c.extra.get("turns")
        if mine is None:
            continue
        lost = [k for k in mine if not turns[k]["completed"] and turns[k]["requests"] > 1]
        unretried += sum(1 for k in mine if not turns[k]["completed"] and turns[k]["requests"] == 1)
        if lost:
            outcomes[c.name] = "lost"
            reasons[c.name] = (f"{len(lost)} of {len(mine)} recorded turns were retried and "
                               "never completed")
        else:
            outcomes[c.name] = "completed"
    return outcomes, reasons, unretried


def summarize(res: ColumnResult) -> dict[str, Any]:
    """The table's numbers for one column."""
    errors: Counter[str] = Counter()
    for c in res.clients:
        errors.update(c.errors_by_kind())
    by_op: dict[tuple, list[dict[str, Any]]] = {}
    for d in res.dispatches:  # an operation: same session, path and body (one credential here)
        by_op.setdefault((d.get("session"), d.get("path"), d["body_sha256"]), []).append(d)

    def end_ts(d: dict[str, Any]) -> float:
        return d["end"]["ts"] if d.get("end") else res.t_end

    max_in_flight = 0
    reexecuted = 0
    for ds in by_op.values():
        points = sorted([(d["ts"], 1) for d in ds] + [(end_ts(d), -1) for d in ds],
                        key=lambda p: (p[0], p[1]))
        cur = 0
        for _, step in points:
            cur += step
            max_in_flight = max(max_in_flight, cur)
        done_at = [end_ts(d) for d in ds if d.get("end") and d["end"].get("outcome") == "completed"]
        if done_at:
            first_done = min(done_at)
            reexecuted += sum(1 for d in ds if d["ts"] > first_done)
    windows = cooldown_windows(res.tg_events)

    def inside(ts: float) -> bool:
        return any(a <= ts < b for a, b in windows)

    # turnguard's own admissions (its "dispatch" events) inside a cooldown: what the fence
    # promises never happens. The mock's count can be higher when a request admitted just
    # before the circuit opened reached the upstream just after: reported separately.
    during = sum(1 for e in res.tg_events if e.get("event") == "dispatch" and inside(e["ts"]))
    reached = sum(1 for d in res.dispatches if inside(d["ts"]))
    holds = [e[f] for e in res.tg_events for k, f in HOLD_FIELDS.items()
             if e.get("event") == k and isinstance(e.get(f), (int, float))]
    ev = Counter(e.get("event") for e in res.tg_events)
    outcomes, reasons, unretried = turn_outcomes(res.clients)
    lost = [name for name, o in outcomes.items() if o != "completed"]
    incident = []
    if lost:
        incident.append("turn lost")
    if max_in_flight > 1:
        incident.append(f"{max_in_flight} dispatches of one operation in flight at once")
    if reexecuted:
        incident.append(f"{reexecuted} re-execution(s) after completion")
    if during:
        incident.append(f"{during} dispatch(es) during the cooldown")
    return {
        "outcomes": outcomes,
        "reasons": reasons,
        "failed_not_retried": unretried,
        "attempts": sum(len(c.attempts) for c in res.clients),
        "errors": dict(sorted(errors.items())),
        "upstream_dispatches": len(res.dispatches),
        "operations": len(by_op),
        "max_in_flight_per_operation": max_in_flight,
        "reexecuted_after_completion": reexecuted,
        "cooldowns_opened": len(windows),
        "cooldown_ms": [round((b - a + COOLDOWN_END_SLACK_S) * 1000) for a, b in windows],
        "dispatches_during_cooldown": during if windows else None,
        "upstream_dispatches_in_cooldown_window": reached if windows else None,
        "max_hold_ms": max(holds) if holds else None,
        "turnguard": {
            "replayed": ev["duplicate_replayed"],
            "attached": ev["duplicate_attached"],
            "held_duplicates": ev["duplicate_held"],
            "rejected_409": ev["duplicate_rejected"],
            "cooldown_503": ev["cooldown_rejected"],
            "cooldown_503_reasons": dict(Counter(
                e.get("reason") for e in res.tg_events if e.get("event") == "cooldown_rejected")),
            "fail_closed_reasons": dict(Counter(
                e.get("reason") for e in res.tg_events if e.get("event") == "fail_closed")),
            "fail_closed": ev["fail_closed"],
            "held_through_cooldown": ev["wait_operation_fenced_cooldown"],
            "recovery_dispatches": ev["recovery_claimed"],
            "upstream_cuts": ev["upstream_cut"],
        } if res.tg_events or COLUMNS[res.column]["addon"] else None,
        "gateway_accounts_marked_rate_limited": sum(
            c.extra.get("accounts_marked_rate_limited", 0) for c in res.clients),
        "wall_s": round(res.t_end - res.t0, 2),
        "incident": incident,
    }


# ------------------------------------------------------------------------------------------------
# Report


def _errors_text(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}×{v}" for k, v in errors.items()) if errors else "none"


def _tg_text(m: dict[str, Any]) -> str:
    t = m.get("turnguard")
    if t is None:
        return "-"
    parts = []
    if t["replayed"]:
        parts.append(f"replayed {t['replayed']}")
    if t.get("attached"):
        parts.append(f"attached {t['attached']}")
    if t["rejected_409"]:
        parts.append(f"409 {t['rejected_409']}")
    if t["fail_closed"] or t["cooldown_503"]:
        reasons = {**t["cooldown_503_reasons"], **t["fail_closed_reasons"]}
        reasons.pop("mode_fail_closed", None)
        paired = sum(v for k, v in t["cooldown_503_reasons"].items() if k != "mode_fail_closed")
        n = t["cooldown_503"] + t["fail_closed"] - paired  # a non-mode 503 logs both events
        why = f" ({', '.join(sorted(reasons))})" if reasons else ""
        parts.append(f"503 {n}{why}")
    if t["held_through_cooldown"]:
        parts.append(f"held {t['held_through_cooldown']} thru cooldown")
    if t["recovery_dispatches"]:
        parts.append(f"recovered {t['recovery_dispatches']}")
    if t["upstream_cuts"]:
        parts.append(f"cut {t['upstream_cuts']}")
    return ", ".join(parts) or "passed through"


def table_rows(scenario: dict[str, Any], results: list[ColumnResult]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = []
    for spec in scenario["clients"]:
        name = spec["name"]
        cells = []
        for r in results:
            out = r.metrics["outcomes"].get(name, "?")
            cells.append("turn completed" if out == "completed" else "TURN LOST")
        rows.append((f"{name} ({spec['model']})", cells))
    rows.append(("client attempts", [str(r.metrics["attempts"]) for r in results]))
    if any(r.metrics.get("failed_not_retried") for r in results):
        rows.append(("failed, no client retried", [str(r.metrics.get("failed_not_retried", 0))
                                                   for r in results]))
    rows.append(("client-visible errors", [_errors_text(r.metrics["errors"]) for r in results]))
    if any(r.metrics["gateway_accounts_marked_rate_limited"] for r in results):
        rows.append(("accounts marked rate-limited",
                     [str(r.metrics["gateway_accounts_marked_rate_limited"]) for r in results]))
    rows.append(("upstream dispatches", [str(r.metrics["upstream_dispatches"]) for r in results]))
    rows.append(("same op in flight at once", [str(r.metrics["max_in_flight_per_operation"]) for r in results]))
    rows.append(("re-run after completion", [str(r.metrics["reexecuted_after_completion"]) for r in results]))
    rows.append(("dispatches during cooldown", [
        "- (no cooldown)" if r.metrics["dispatches_during_cooldown"] is None
        else f"{r.metrics['dispatches_during_cooldown']} (cooldown {r.metrics['cooldown_ms'][0] / 1000:g} s)"
        + (f"; {r.metrics['upstream_dispatches_in_cooldown_window'] - r.metrics['dispatches_during_cooldown']}"
           " admitted just before it opened"
           if r.metrics["upstream_dispatches_in_cooldown_window"] > r.metrics["dispatches_during_cooldown"] else "")
        for r in results]))
    rows.append(("max hold", [
        "-" if r.metrics["max_hold_ms"] is None else f"{r.metrics['max_hold_ms'] / 1000:.1f} s"
        for r in results]))
    rows.append(("turnguard answers", [_tg_text(r.metrics) for r in results]))
    rows.append(("wall time", [f"{r.metrics['wall_s']:.1f} s" for r in results]))
    rows.append(("INCIDENT", ["YES: " + "; ".join(r.metrics["incident"]) if r.metrics["incident"] else "no"
                              for r in results]))
    return rows


def _wrap(text: str, width: int) -> list[str]:
    words, lines, cur = text.split(" "), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    return lines + [cur] if cur else lines or [""]


def render_table(scenario: dict[str, Any], results: list[ColumnResult],
                 extra: dict[str, Any] | None = None) -> str:
    rows = table_rows(scenario, results)
    width = 24
    label_w = max(len(label) for label, _ in rows) + 2
    out = [f"scenario {scenario['name']}"
           + (f" ({scenario['incident']})" if scenario.get("incident") else "")]
    out += ["  " + line for line in _wrap(scenario.get("description", ""), 96)]
    if any(COLUMNS[r.column]["addon"] for r in results):
        force = timings_in_force(scenario, extra)
        shown = [f"{k}={v}" + ("" if v == PRODUCTION[k] else f" (production {PRODUCTION[k]})")
                 for k, v in force.items()]
        out.append("  turnguard timings in force: " + ", ".join(shown))
        for w in stall_warnings(scenario, extra):
            out.append(f"  WARNING: {w}")
    for note in scenario.get("shortened", []):
        out.append(f"  shortened: {note}")
    out.append("")
    header = " " * label_w + "".join(r.title.ljust(width) for r in results)
    out.append(header.rstrip())
    out.append("-" * (label_w + width * len(results)))
    for label, cells in rows:
        wrapped = [_wrap(c, width - 2) for c in cells]
        height = max(len(w) for w in wrapped)
        for i in range(height):
            line = (label if i == 0 else "").ljust(label_w)
            line += "".join((w[i] if i < len(w) else "").ljust(width) for w in wrapped)
            out.append(line.rstrip())
    out.append("")
    for r in results:
        for c in r.clients:
            if r.metrics["outcomes"].get(c.name) != "completed":
                out.append(f"  {r.title}: {c.name} lost the turn: {r.metrics['reasons'][c.name]}")
    return "\n".join(out)


def to_json(scenario: dict[str, Any], results: list[ColumnResult],
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "scenario": scenario["name"],
        "description": scenario.get("description", ""),
        "incident": scenario.get("incident"),
        "timings": {k: {"value": v, "production": PRODUCTION[k]}
                    for k, v in timings_in_force(scenario, extra).items()},
        "warnings": stall_warnings(scenario, extra),
        "shortened_notes": scenario.get("shortened", []),
        "columns": {
            r.column: {
                "title": r.title,
                "about": COLUMNS[r.column]["about"],
                "metrics": r.metrics,
                "options": r.options,
                "workdir": r.workdir,
                "flows_file": r.flows_file,
                "clients": [c.to_json() for c in r.clients],
                "dispatches": r.dispatches,
            }
            for r in results
        },
    }
