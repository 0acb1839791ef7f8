"""The README against the code: what an operator copies from it (the CI entry point, the
metrics table with its labels and their values) names what the code runs and serves. (The
options table: ``test_options.py``; the telemetry events: ``test_telemetry.py``; the
dashboard and alert rules: ``test_ops.py`` and ``test_e2e_metrics.py``.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from turnguard_core import metrics
from turnguard_core.policy import RECOVERY_MODES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_ci_runs_exactly_the_readmes_test_command():
    """The README's quickstart gives one command that runs the tests; ``.ci/run`` runs that
    command and nothing else (from the repository's root)."""
    quickstart = _section("Quickstart")
    commands = re.findall(r"^    (scripts/test\b.*?)\s*(?:#.*)?$", quickstart, re.M)
    assert len(commands) == 1, commands
    lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    runs = [line for line in lines if line and not line.startswith("#")
            and not line.startswith(("set ", "cd "))]
    assert runs == [f"exec {commands[0]}"], runs


def _readme_metrics() -> dict[str, tuple[str, set[str], str]]:
    """name -> (type, label names, the row's text) from the README's metrics table."""
    rows = re.findall(r"^\| (`turnguard_.*?) \|\s*(\w*)\s*\|\s*(.*?)\s*\|\s*(.*?)\s*\|$",
                      _section("Metrics and dashboards"), re.M)
    table: dict[str, tuple[str, set[str], str]] = {}
    for names, kind, labels, what in rows:
        label_names = set(re.findall(r"`(\w+)`", labels))
        for name, own_label in re.findall(r"`(turnguard_\w+)`(?: \(`(\w+)`\))?", names):
            table[name] = (kind, label_names | ({own_label} if own_label else set()), what)
    return table


def _served_metrics() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names) of what ``/metrics`` serves (without the instance label)."""
    m = metrics.Metrics("i", state=lambda: metrics.GaugeState(recovery_mode="fail_closed"))
    served: dict[str, tuple[str, set[str]]] = {}
    for family in m.registry.collect():
        if family.name.startswith("turnguard_"):
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = {k for s in family.samples for k in s.labels}
            served[name] = (family.type, labels)
    for family in m._families:  # label names of the families with no series yet
        name = family.name + ("_total" if isinstance(family, metrics._Counters) else "")
        served[name] = (served[name][0], served[name][1] | set(family.labels))
    return {name: (kind, labels - {metrics.INSTANCE_LABEL, "le"})
            for name, (kind, labels) in served.items()}


def test_the_readmes_metrics_table_names_every_metric_with_its_type_and_labels():
    readme, served = _readme_metrics(), _served_metrics()
    assert set(readme) == set(served)
    for name, (kind, labels) in served.items():
        assert readme[name][:2] == (kind, labels), name


# metric -> label -> the values the code gives it (a fixed set each; anything else: "other")
LABEL_VALUES = {
    "turnguard_dispatches_total": {"kind": metrics.DISPATCH_KINDS},
    "turnguard_outcomes_total": {"outcome": metrics.OUTCOMES},
    "turnguard_attempt_duration_seconds": {"outcome": metrics.OUTCOMES},
    "turnguard_events_total": {"event": ()},  # the event names: test_telemetry.py
    "turnguard_duplicates_total": {"action": tuple(metrics.DUPLICATE_ACTIONS.values())},
    "turnguard_answers_total": {"status": ("409", "422", "503"), "code": metrics.ANSWER_CODES},
    "turnguard_recovery_denied_total": {"reason": metrics.RECOVERY_DENIED_REASONS},
    "turnguard_fail_closed_total": {"reason": metrics.FAIL_CLOSED_REASONS},
    "turnguard_passthrough_total": {"reason": metrics.PASSTHROUGH_LABELS},
    "turnguard_ledger_outages_total": {"during": metrics.LEDGER_CALLS},
    "turnguard_eventless_failures_total": {"failure_class": metrics.FAILURE_CLASSES},
    "turnguard_holds_abandoned_total": {"reason": tuple(metrics.ABANDON_REASONS.values())},
    "turnguard_sessions_claimed_total": {"result": metrics.SESSION_CLAIM_RESULTS},
    "turnguard_hold_seconds": {
        "result": tuple(a for a in metrics.DUPLICATE_ACTIONS.values() if a != "held")
        + ("abandoned",)},
    "turnguard_cooldown_wait_seconds": {"reason": metrics.WAIT_END_REASONS},
    "turnguard_flows_held": {"wait": ("duplicate", "cooldown")},
    "turnguard_info": {"recovery_mode": RECOVERY_MODES},
}


def test_every_labelled_metric_is_in_the_value_list():
    """So that ``LABEL_VALUES`` below cannot miss a labelled metric the code adds."""
    labelled = {name for name, (_, labels) in _served_metrics().items() if labels}
    assert labelled == set(LABEL_VALUES)
    for name, labels in LABEL_VALUES.items():
        assert set(labels) == _served_metrics()[name][1], name


@pytest.mark.parametrize("name", sorted(LABEL_VALUES))
def test_the_readmes_metrics_table_names_every_value_of_each_label(name):
    """An operator writes alerts and dashboards from the README: every value a label can
    take is named in its metric's row (what the row names beside them is prose)."""
    (row,) = [line for line in _section("Metrics and dashboards").splitlines()
              if line.startswith("| ") and f"`{name}`" in line.split(" | ")[0]]
    words = set(re.findall(r"[\w.]+", row))
    for label, values in LABEL_VALUES[name].items():
        missing = [v for v in values if v not in words and v != metrics.OTHER]
        assert not missing, f"{name}{{{label}}}: the README does not name {missing}"


@pytest.mark.parametrize("name", sorted(LABEL_VALUES))
def test_a_metrics_help_that_lists_a_labels_values_lists_them_all(name):
    """``/metrics``' own HELP line, where it lists the values of a label, lists every one
    (a reader of a scrape takes the list for the whole set)."""
    m = metrics.Metrics("i", state=lambda: metrics.GaugeState())
    (family,) = [f for f in m.registry.collect()
                 if f.name + ("_total" if f.type == "counter" else "") == name]
    words = set(re.findall(r"[\w.]+", family.documentation))
    for label, values in LABEL_VALUES[name].items():
        named = [v for v in values if v in words]
        if len(named) >= 2:
            assert named == list(values), f"{name}{{{label}}}: HELP lacks {set(values) - set(named)}"


def test_every_test_the_readme_names_exists():
    """The README's Guarantees (and its other sections) prove each promise by naming tests:
    ``module.py::name`` (or ``::prefix_*``) must be a test of that module, and a test named
    alone a test of some module; a module named must exist."""
    tests = {p.name: set(re.findall(r"^(?:async )?def (test_\w+)", p.read_text(), re.M))
             for p in (ROOT / "tests").glob("test_*.py")}
    every = set().union(*tests.values())
    missing = []
    for module in set(re.findall(r"\b(test_\w+\.py)\b", README)):
        if module not in tests:
            missing.append(module)
    for module, name, star in re.findall(r"\b(test_\w+\.py)::(test_\w+)(\*?)", README):
        found = tests.get(module, set())
        if not (any(t.startswith(name) for t in found) if star else name in found):
            missing.append(f"{module}::{name}{star}")
    for name, star in re.findall(r"(?<![:\w])(test_\w+?)(\*?)(?:\[[^\]]*\])?`", README):
        if not (any(t.startswith(name) for t in every) if star else name in every):
            missing.append(name + star)
    assert not missing, f"the README names tests that do not exist: {sorted(set(missing))}"


def _readme_commands(tool: str, *, inline: bool = True) -> list[list[str]]:
    """The ``scripts/TOOL ...`` commands the README shows: lines of its code blocks (without
    their comment) and, with ``inline``, commands in backticks; as argument lists."""
    found = re.findall(rf"^ {{4,}}(?:\w+=\S+ )?(scripts/{tool}\b.*?)\s*(?:#.*)?$", README, re.M)
    if inline:
        found += re.findall(rf"`(scripts/{tool}\b[^`]*)`", README)
    return sorted({tuple(shlex.split(" ".join(c.split())))[1:] for c in found})


@pytest.mark.parametrize("argv", _readme_commands("bench"), ids=" ".join)
def test_every_benchmark_command_the_readme_shows_is_one_scripts_bench_accepts(argv):
    """A command copied from the README runs: it parses as ``scripts/bench`` parses it, the
    checks it makes before starting anything included (DIR, REV: the README's placeholders)."""
    from turnguard_bench.__main__ import parse

    parse([{"DIR": "/tmp/profiles", "REV": "HEAD"}.get(a, a) for a in argv])


@pytest.mark.parametrize("argv", [a for a in _readme_commands("turnguard", inline=False)
                                  if not any(c in " ".join(a) for c in "|[")], ids=" ".join)
def test_every_status_command_the_readme_shows_is_one_scripts_turnguard_accepts(argv):
    from turnguard_core.ledger_cli import _parser

    _parser("scripts/turnguard").parse_args(argv)


def test_the_layout_names_every_module_of_the_addon():
    """The README's Layout is the map of ``addon/``: every module of the core is named there
    (by file name), and every part of the shell (by its name, as the Layout lists them)."""
    layout = _section("Layout")
    core = {p.name for p in (ROOT / "addon/turnguard_core").glob("*.py")} - {"__init__.py"}
    shell = {p.stem for p in (ROOT / "addon/turnguard_shell").glob("*.py")} - {"__init__"}
    assert not sorted(n for n in core if n not in layout.split())
    words = set(re.findall(r"\w+", layout))
    assert not sorted(shell - words)


def test_the_readme_names_every_x_turnguard_value_of_turnguards_own_answers():
    """``x-turnguard`` is how a client or a log tells turnguard's answers from the upstream's:
    every value it takes (the code of each answer turnguard makes, ``replayed``, ``attached``)
    is named where the README defines it, and the code of each answer is its header's."""
    from turnguard_core import answers

    made = [answers.turn_in_progress(1, 5), answers.idempotency_key_conflict(),
            answers.cooldown_rejected(3, 2, accepts_sse=False),
            answers.cooldown_rejected(3, 2, accepts_sse=True),
            answers.failed_closed("upstream_operation_status_unknown", "claim_exhausted", 1,
                                  accepts_sse=False)]
    values = {dict(a.headers)["x-turnguard"] for a in made}
    assert values <= set(metrics.ANSWER_CODES)
    (paragraph,) = [p for p in README.split("\n\n") if "its `x-turnguard` header" in p]
    named = set(re.findall(r"`(\w+)`", paragraph))
    assert {*metrics.ANSWER_CODES, "replayed", "attached"} <= named
    shell = "".join(p.read_text() for p in (ROOT / "addon").rglob("*.py"))
    for value in ("replayed", "attached"):
        assert f'"{value}"' in shell


def test_every_environment_variable_the_tools_read_is_in_the_readme():
    """``TURNGUARD_*`` variables are public interface as options are: each one the addon or
    a tool reads is named in the README (but the program names the wrappers in scripts/ set
    for the help they print)."""
    set_by_wrappers = {"TURNGUARD_PROG", "TURNGUARD_MOCK_PROG"}
    sources = [p for p in (*(ROOT / "scripts").rglob("*"), *(ROOT / "addon").rglob("*.py"))
               if p.is_file() and "__pycache__" not in p.parts]
    read = set()
    for p in sources:
        read |= set(re.findall(r"\bTURNGUARD_[A-Z_]+[A-Z]", p.read_text(errors="replace")))
    missing = sorted(read - set_by_wrappers - set(re.findall(r"\bTURNGUARD_[A-Z_]+[A-Z]", README)))
    assert not missing, missing
