"""An SVG timeline of a scenario run: one panel per column, on one time scale.

Rows per panel: each client's attempts (light while waiting for the response headers, solid
while the body streams; green completed, red an error status, orange a transport error or a
cut stream, grey cancelled by the client itself), turnguard's holds (a duplicate held for its
original, a request held through the cooldown), the upstream's dispatches (from the mock's
log; purple with ✂ when turnguard cut it for want of a response event), and the retry
circuit's cooldown window shaded across the panel. Hover any bar for its
details. Plain SVG text; no plotting library.
"""

from __future__ import annotations

from html import escape
from typing import Any

from .runner import COOLDOWN_END_SLACK_S, ColumnResult, cooldown_windows

WIDTH = 1100
LEFT = 170
RIGHT = 20
LANE_H = 16
ROW_GAP = 8
PANEL_GAP = 26

GREEN, RED, ORANGE, GREY, BLUE, CYAN = "#2e7d32", "#c62828", "#ef6c00", "#9e9e9e", "#1565c0", "#00838f"
PURPLE = "#6a1b9a"
CUT_MATCH_S = 1.0  # a cut dispatch's end, as the upstream logged it, follows turnguard's cut

HOLD_ENDS = {
    "duplicate_replayed": "replayed",
    "duplicate_attached": "attached",
    "duplicate_rejected": "409",
    "duplicate_forwarded": "forwarded",
    "hold_abandoned": "abandoned",
}


def _lanes(bars: list[dict[str, Any]]) -> int:
    """Assign ``lane`` to each bar (greedy, no overlaps in a lane); return the lane count."""
    ends: list[float] = []
    for b in sorted(bars, key=lambda b: b["start"]):
        for i, e in enumerate(ends):
            if e <= b["start"]:
                b["lane"], ends[i] = i, b["end"]
                break
        else:
            b["lane"] = len(ends)
            ends.append(b["end"])
    return max(1, len(ends))


def _attempt_bars(res: ColumnResult, name: str) -> list[dict[str, Any]]:
    bars = []
    for c in res.clients:
        if c.name != name:
            continue
        for a in c.attempts:
            end = a.end or res.t_end
            if a.completed:
                color, label = GREEN, (a.turnguard or str(a.status))
            elif a.error == "cancelled":
                color, label = GREY, "closed by client"
            elif a.status is not None and a.status >= 400:
                color, label = RED, str(a.status)
            else:
                color, label = ORANGE, (f"{a.status} cut" if a.status else "no answer")
            if a.function_call:
                label = "tool call"
            tip = (f"{a.client}#{a.n} step {a.step}: status {a.status}, error {a.error}, "
                   f"{a.events} events, x-turnguard {a.turnguard}, waited {a.waited_before_s} s before"
                   + (f"; {a.note}" if a.note else ""))
            bars.append({"start": a.start, "end": end, "mid": a.t_headers, "color": color,
                         "label": label, "tip": tip, "faint": a.t_headers is None})
    return bars


def _hold_bars(res: ColumnResult) -> list[dict[str, Any]]:
    attempt_of = {r["flow"]: r.get("attempt") for r in res.flowlog}
    starts: dict[tuple[str, str], float] = {}
    bars = []
    for e in res.tg_events:
        ev, flow = e.get("event"), e.get("flow")
        if ev == "duplicate_held":
            starts[("dup", flow)] = e["ts"]
        elif ev in HOLD_ENDS and ("dup", flow) in starts:
            bars.append({"start": starts.pop(("dup", flow)), "end": e["ts"], "color": BLUE,
                         "label": f"held → {HOLD_ENDS[ev]}",
                         "tip": f"{attempt_of.get(flow) or flow}: held as a duplicate, then {HOLD_ENDS[ev]}"})
        elif ev == "wait_operation_fenced_cooldown":
            starts[("cool", flow)] = e["ts"]
        elif ev == "wait_finished" and ("cool", flow) in starts:
            bars.append({"start": starts.pop(("cool", flow)), "end": e["ts"], "color": CYAN,
                         "label": "held thru cooldown",
                         "tip": f"{attempt_of.get(flow) or flow}: held through the cooldown ({e.get('reason')})"})
    for (kind, flow), t in starts.items():
        bars.append({"start": t, "end": res.t_end, "color": BLUE if kind == "dup" else CYAN,
                     "label": "held", "tip": f"{attempt_of.get(flow) or flow}: held (no end logged)"})
    return bars


def cut_dispatches(res: ColumnResult) -> set[int]:
    """The numbers (``n``) of the upstream dispatches turnguard cut (its ``upstream_cut``
    events): matched by the client attempt of the cut flow (mitmproxy's flow log), else by
    time (the upstream saw its client go within a moment of the cut)."""
    attempt_of = {r["flow"]: r.get("attempt") for r in res.flowlog if r.get("flow")}
    cuts = [e for e in res.tg_events if e.get("event") == "upstream_cut" and e.get("cut")]
    found: set[int] = set()
    for e in cuts:
        attempt = attempt_of.get(e.get("flow"))
        match = [d for d in res.dispatches if attempt and d.get("client_attempt") == attempt]
        if not match:
            match = [d for d in res.dispatches
                     if (d.get("end") or {}).get("outcome") == "client_gone"
                     and 0 <= d["end"]["ts"] - e["ts"] <= CUT_MATCH_S and d["n"] not in found]
            match = match[:1]
        found.update(d["n"] for d in match)
    return found


def _dispatch_bars(res: ColumnResult) -> list[dict[str, Any]]:
    bars = []
    cut = cut_dispatches(res)
    for d in res.dispatches:
        end = d.get("end") or {}
        outcome = end.get("outcome", "unfinished")
        color = {"completed": GREEN, "status": RED, "client_gone": GREY}.get(outcome, ORANGE)
        label = d.get("behaviour", "?")
        if outcome == "status":
            label = f"{end.get('status')}"
        if d["n"] in cut:
            color, label, outcome = PURPLE, "✂ cut by turnguard", "cut by turnguard (no response event in time)"
        tip = (f"dispatch {d['n']} ({d.get('client_attempt') or 'unknown attempt'}): behaviour "
               f"{d.get('behaviour')}, outcome {outcome}, status {end.get('status')}, "
               f"{end.get('events_sent')} events, turn-state {'yes' if d.get('turn_state') else 'no'}")
        bars.append({"start": d["ts"], "end": end.get("ts", res.t_end), "color": color,
                     "label": label, "tip": tip})
    return bars


def render_svg(scenario: dict[str, Any], results: list[ColumnResult]) -> str:
    span = max([r.t_end - r.t0 for r in results] + [1.0]) * 1.03
    scale = (WIDTH - LEFT - RIGHT) / span

    def x(t: float, t0: float) -> float:
        return LEFT + max(0.0, t - t0) * scale

    body: list[str] = []
    y = 40
    for r in results:
        rows: list[tuple[str, list[dict[str, Any]]]] = []
        for c in scenario["clients"]:
            rows.append((f"{c['name']} ({c['model']})", _attempt_bars(r, c["name"])))
        if r.tg_events or r.column != "plain":
            rows.append(("turnguard holds", _hold_bars(r)))
        rows.append(("upstream dispatches", _dispatch_bars(r)))
        heights = [_lanes(bars) * LANE_H for _, bars in rows]
        panel_h = 34 + sum(h + ROW_GAP for h in heights) + 18
        verdict = "; ".join(r.metrics.get("incident", [])) or "no incident"
        body.append(f'<g class="panel"><rect x="4" y="{y}" width="{WIDTH - 8}" height="{panel_h}" '
                    f'fill="#fafafa" stroke="#ddd"/>')
        body.append(f'<text x="10" y="{y + 15}" font-weight="bold">{escape(r.title)}</text>'
                    f'<text x="{LEFT}" y="{y + 15}" fill="{RED if r.metrics.get("incident") else GREEN}">'
                    f'{escape(verdict)}</text>')
        top = y + 34
        for a, b in cooldown_windows(r.tg_events):
            b += COOLDOWN_END_SLACK_S  # draw the whole cooldown
            x0, x1 = x(a, r.t0), x(b, r.t0)
            body.append(f'<rect x="{x0:.1f}" y="{top - 12}" width="{max(1.0, x1 - x0):.1f}" '
                        f'height="{panel_h - 40}" fill="#b3e5fc" opacity="0.45">'
                        f'<title>retry circuit cooldown {b - a:.1f} s</title></rect>'
                        f'<text x="{x0 + 3:.1f}" y="{top - 2}" font-size="10" fill="#01579b">'
                        f'cooldown {b - a:.1f} s</text>')
        for (label, bars), h in zip(rows, heights):
            body.append(f'<text x="10" y="{top + 12}" font-size="11">{escape(label)}</text>')
            body.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{top + h + ROW_GAP / 2}" '
                        f'y2="{top + h + ROW_GAP / 2}" stroke="#eee"/>')
            for b in bars:
                bx0, bx1 = x(b["start"], r.t0), x(b["end"], r.t0)
                by = top + b["lane"] * LANE_H + 2
                w = max(2.0, bx1 - bx0)
                tip = escape(b["tip"])
                mid = b.get("mid")
                if mid is not None and b["start"] <= mid <= b["end"]:
                    mx = x(mid, r.t0)
                    body.append(f'<rect x="{bx0:.1f}" y="{by}" width="{max(1.0, mx - bx0):.1f}" '
                                f'height="{LANE_H - 4}" fill="{b["color"]}" opacity="0.35"><title>{tip}'
                                f' (waiting for headers)</title></rect>')
                    body.append(f'<rect x="{mx:.1f}" y="{by}" width="{max(2.0, bx1 - mx):.1f}" '
                                f'height="{LANE_H - 4}" fill="{b["color"]}"><title>{tip}</title></rect>')
                else:
                    body.append(f'<rect x="{bx0:.1f}" y="{by}" width="{w:.1f}" height="{LANE_H - 4}" '
                                f'fill="{b["color"]}" opacity="{0.35 if b.get("faint") else 0.85}">'
                                f'<title>{tip}</title></rect>')
                text_w = 5.5 * len(b["label"]) + 4
                later = [x(o["start"], r.t0) for o in bars if o["lane"] == b["lane"] and o["start"] > b["start"]]
                room = (min(later) if later else WIDTH - RIGHT) - bx1
                if w > text_w:
                    body.append(f'<text x="{bx0 + 3:.1f}" y="{by + 10}" font-size="9" fill="#fff">'
                                f'{escape(b["label"])}</text>')
                elif room > text_w:
                    body.append(f'<text x="{bx1 + 2:.1f}" y="{by + 10}" font-size="9" fill="#333">'
                                f'{escape(b["label"])}</text>')
            top += h + ROW_GAP
        step = 1 if span <= 12 else 2 if span <= 30 else 5
        for i in range(int(span // step) + 1):
            tx = LEFT + i * step * scale
            body.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{top}" y2="{top + 4}" stroke="#666"/>'
                        f'<text x="{tx:.1f}" y="{top + 14}" font-size="9" text-anchor="middle">{i * step}s</text>')
        body.append("</g>")
        y += panel_h + PANEL_GAP
    title = f"turnguard reproduce: {scenario['name']}"
    legend = ("light: waiting for headers · solid: streaming · green completed · red error status · "
              "orange transport error / cut · grey closed by the client · purple ✂ cut by turnguard · "
              "blue held duplicate · "
              "teal held through the cooldown · shaded: cooldown")
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y + 10}" '
            f'font-family="sans-serif" font-size="12">'
            f'<rect width="100%" height="100%" fill="#fff"/>'
            f'<text x="10" y="18" font-weight="bold" font-size="14">{escape(title)}</text>'
            f'<text x="10" y="32" font-size="10" fill="#555">{escape(legend)}</text>')
    return head + "".join(body) + "</svg>\n"
