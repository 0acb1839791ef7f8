"""``ops/``: the Grafana dashboard loads (checked against the Grafana dashboard schema fields it
uses: the dashboard model, panels, grid positions, targets, templating), and the alert rules
file has the shape Prometheus loads. That every metric they query exists in a real
``/metrics`` scrape is checked end to end in ``test_e2e_metrics.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_e2e_metrics import dashboard_exprs, queried_names, rule_exprs

OPS = Path(__file__).resolve().parents[1] / "ops"
DASHBOARD = json.loads((OPS / "grafana-dashboard.json").read_text())
RULES = (OPS / "prometheus-alerts.yml").read_text()

# Grafana's dashboard schema (schemaVersion 39, grafana/packages/grafana-schema
# dashboard_kind.cue): the fields this dashboard uses, with their types and allowed values.
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "text", "heatmap"}
VARIABLE_TYPES = {"query", "datasource", "custom", "constant", "interval", "textbox", "adhoc"}
GRID_COLUMNS = 24
UID = re.compile(r"[a-zA-Z0-9_-]{1,40}")


def test_the_dashboard_model_has_the_schema_fields_and_types():
    d = DASHBOARD
    assert isinstance(d["title"], str) and d["title"]
    assert UID.fullmatch(d["uid"])
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert isinstance(d["version"], int)
    assert isinstance(d["editable"], bool)
    assert d["graphTooltip"] in (0, 1, 2)
    assert all(isinstance(t, str) for t in d["tags"])
    assert d["timezone"] in ("browser", "utc", "")
    assert re.fullmatch(r"\d+[smhd]", d["refresh"])
    assert set(d["time"]) == {"from", "to"} and all(isinstance(v, str) for v in d["time"].values())
    assert isinstance(d["annotations"]["list"], list)
    assert isinstance(d["panels"], list) and d["panels"]


def test_templating_variables_are_well_formed():
    names = set()
    for v in DASHBOARD["templating"]["list"]:
        assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", v["name"]) and v["name"] not in names
        names.add(v["name"])
        assert v["type"] in VARIABLE_TYPES
        assert v.get("hide", 0) in (0, 1, 2)
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert v["refresh"] in (0, 1, 2)
            assert isinstance(v["query"]["query"], str) and v["definition"] == v["query"]["query"]
    assert names == {"datasource", "instance"}
    # every variable a query uses is defined
    used = set(re.findall(r"\$(?:\{)?([a-zA-Z_]\w*)", json.dumps(DASHBOARD["panels"])))
    assert used - {"__rate_interval"} <= names


def test_panels_have_unique_ids_fit_the_grid_and_do_not_overlap():
    ids, cells = set(), set()
    for p in DASHBOARD["panels"]:
        assert isinstance(p["id"], int) and p["id"] not in ids
        ids.add(p["id"])
        assert p["type"] in PANEL_TYPES
        assert isinstance(p["title"], str) and p["title"]
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"} and all(isinstance(v, int) and v >= 0 for v in g.values())
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= GRID_COLUMNS
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another at {x},{y}"
                cells.add((x, y))
        if p["type"] == "row":
            assert p["panels"] == [] and p["collapsed"] is False and g["w"] == GRID_COLUMNS
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert isinstance(p["description"], str) and p["description"]
        defaults = p["fieldConfig"]["defaults"]
        assert isinstance(defaults["unit"], str) and isinstance(p["fieldConfig"]["overrides"], list)
        steps = defaults.get("thresholds", {"steps": [{"value": None}]})["steps"]
        assert steps[0]["value"] is None  # Grafana's base step
        assert isinstance(p["options"], dict)
        ref_ids = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(set(ref_ids)) == len(ref_ids)
        for t in p["targets"]:
            assert isinstance(t["expr"], str) and t["expr"].count("(") == t["expr"].count(")")
            assert t["expr"].count("{") == t["expr"].count("}")
            assert isinstance(t.get("legendFormat", ""), str)


def test_the_dashboard_shows_what_the_issue_asks_for():
    titles = " ".join(p["title"] for p in DASHBOARD["panels"]).lower()
    for needed in ("dedup ratio", "held", "circuit", "cooldown", "recovery", "fail-closed",
                   "ledger"):
        assert needed in titles, needed
    exprs = " ".join(dashboard_exprs(DASHBOARD))
    assert 'turnguard_instance=~"$instance"' in exprs  # one or all processes


def test_alert_rules_have_the_shape_prometheus_loads():
    assert RULES.lstrip().startswith("#") and "\ngroups:\n" in RULES
    alerts = re.findall(r"^\s+- alert: (\w+)$", RULES, re.M)
    assert len(alerts) == len(set(alerts)) >= 5
    assert len(rule_exprs(RULES)) == len(alerts)
    for expr in rule_exprs(RULES):
        assert expr.count("(") == expr.count(")") and queried_names(expr)
    assert "\t" not in RULES
    assert len(re.findall(r"^\s+severity: (critical|warning|info)$", RULES, re.M)) == len(alerts)


@pytest.mark.parametrize("expr", ['sum(rate(turnguard_x_total{turnguard_instance=~"$instance"}[5m]))'])
def test_queried_names_ignore_the_instance_label(expr):
    assert queried_names(expr) == {"turnguard_x_total"}
