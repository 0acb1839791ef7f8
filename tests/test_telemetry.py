"""Telemetry's log lines: the record each decision makes, and when none is made at all."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from turnguard_core import telemetry
from turnguard_core.telemetry import Telemetry


class Keep(logging.Handler):
    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept():
    log = logging.getLogger("turnguard")
    handler, level, propagate = Keep(), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
        log.disabled = False


def test_a_decision_is_one_record_as_logger_log_would_make_it(kept):
    Telemetry(clock=lambda: 12.5).emit("duplicate_replayed", op="ab12", flow="f1", status=200)
    [record] = kept.records
    assert record.name == "turnguard" and record.levelno == logging.INFO
    assert record.getMessage() == ('turnguard {"ts":12.5,"event":"duplicate_replayed",'
                                   '"op":"ab12","flow":"f1","status":200}')
    # where logger.log would have placed it: the caller, Telemetry.emit in telemetry.py
    code = Telemetry.emit.__code__
    assert record.pathname == telemetry.__file__ and record.filename == "telemetry.py"
    assert record.module == "telemetry" and record.funcName == "emit"
    assert code.co_firstlineno <= record.lineno <= max(line for _, _, line in code.co_lines()
                                                        if line is not None)
    assert record.exc_info is None and record.stack_info is None
    assert json.loads(record.args[0])["event"] == "duplicate_replayed"


def test_routine_events_are_debug_and_the_others_info(kept):
    t = Telemetry()
    t.emit("dispatch", op="a")
    t.emit("outcome", op="a")
    t.emit("duplicate_held", op="a")
    assert [(r.levelno, json.loads(r.args[0])["event"]) for r in kept.records] == [
        (logging.DEBUG, "dispatch"), (logging.DEBUG, "outcome"), (logging.INFO, "duplicate_held")]


def test_no_record_is_made_when_no_handler_takes_it_nor_for_a_disabled_logger(kept):
    kept.setLevel(logging.INFO)
    t = Telemetry()
    t.emit("dispatch", op="a")  # DEBUG: no handler takes it
    assert kept.records == [] and t.counts["dispatch"] == 1
    logging.getLogger("turnguard").disabled = True
    t.emit("duplicate_held", op="a")
    assert kept.records == [] and t.counts["duplicate_held"] == 1


def test_the_loggers_filters_still_apply(kept):
    log = logging.getLogger("turnguard")
    dropped = lambda record: "duplicate_held" not in record.getMessage()  # noqa: E731
    log.addFilter(dropped)
    try:
        t = Telemetry()
        t.emit("duplicate_held", op="a")
        t.emit("duplicate_replayed", op="a")
    finally:
        log.removeFilter(dropped)
    assert [json.loads(r.args[0])["event"] for r in kept.records] == ["duplicate_replayed"]


def test_an_events_file_deleted_or_rotated_is_reopened_at_its_path(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    t = Telemetry(str(path))
    t.emit("first")
    t.reopen_if_moved()  # still the same file: nothing happens
    path.rename(tmp_path / "events.jsonl.1")  # rotated
    t.reopen_if_moved()
    t.emit("second")
    path.unlink()  # deleted
    t.reopen_if_moved()
    t.emit("third")
    assert [json.loads(x)["event"] for x in (tmp_path / "events.jsonl.1").read_text().splitlines()] \
        == ["first"]
    assert [json.loads(x)["event"] for x in path.read_text().splitlines()] == ["third"]
    assert path.stat().st_mode & 0o777 == 0o600
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")  # unsafe now: refused, the old file kept
    with caplog.at_level(logging.WARNING, logger="turnguard"):
        t.reopen_if_moved()
        t.reopen_if_moved()  # still unsafe: said once
    assert caplog.text.count("not reopened") == 1 and not (tmp_path / "elsewhere").exists()
    t.close()


def test_every_event_the_addon_emits_is_named_in_the_readmes_telemetry_section():
    """The README's telemetry section is the operator's list of event names (what to grep the
    events file for, what ``turnguard_events_total{event=...}`` can say): an event the addon
    emits that it does not name is one nobody knows to watch for."""
    import re

    root = Path(__file__).resolve().parent.parent
    emitted: set[str] = set()
    for source in (root / "addon").rglob("*.py"):
        emitted |= set(re.findall(r'(?:emit|Emit)\(\s*"([a-z_]+)"', source.read_text()))
    readme = (root / "README.md").read_text()
    section = readme.split("## Telemetry, commands, inspection", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert len(emitted) > 30, sorted(emitted)  # the scan found the calls
    missing = sorted(emitted - named)
    assert not missing, f"emitted, not named in the README: {missing}"


def _emit_calls():
    """Every telemetry call of the addon's code (``emit("x", a=...)``, ``_emit``,
    ``Emit("x", {"a": ...})``), as (file name, line, event, the field names it gives; None in
    them for a ``**spread`` or a dict that is not written out)."""
    import ast

    for source in (Path(__file__).resolve().parent.parent / "addon").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            first = node.args[0]
            if name not in ("emit", "_emit", "Emit") or not isinstance(first, ast.Constant) \
                    or not isinstance(first.value, str):
                continue
            keys = {kw.arg for kw in node.keywords}
            for arg in node.args[1:]:
                keys |= ({k.value if isinstance(k, ast.Constant) else None for k in arg.keys}
                         if isinstance(arg, ast.Dict) else {None})
            yield source.name, node.lineno, first.value, keys


def _emitted_fields() -> dict[str, set[str]]:
    """event -> the fields the addon's calls give it by name (what a ``**spread`` adds is the
    common fields)."""
    fields: dict[str, set[str]] = {}
    for _, _, event, keys in _emit_calls():
        fields.setdefault(event, set()).update(k for k in keys if k)
    return fields


def test_every_field_an_event_carries_is_named_with_it_in_the_readme():
    """The README's telemetry section names, after each event, the fields of its own it
    carries (beyond ``ts``, ``event``, and the request's ``op``, ``flow``, ``session``,
    ``transport`` or the ``scope`` / ``instance`` of a circuit's, a process's record): a
    field a parser of the events file meets without a word about it is undocumented
    interface."""
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Telemetry, commands, inspection", 1)[1].split("\nIn mitmweb", 1)[0]
    documented: dict[str, set[str]] = {}
    for m in re.finditer(r"`([a-z_]+)`\s*\(", section):
        depth, i = 1, m.end()
        while depth and i < len(section):
            depth += {"(": 1, ")": -1}.get(section[i], 0)
            i += 1
        documented.setdefault(m.group(1), set()).update(
            re.findall(r"`([a-z_]+)`", section[m.end():i]))
    answers = set(re.findall(r"`([a-z_]+)`", section.split("The events that are turnguard's own", 1)[1]
                             .split(") carry", 1)[0]))
    common = {"op", "flow", "session", "transport", "scope", "instance"}
    missing = {}
    for event, fields in sorted(_emitted_fields().items()):
        own = fields - common - documented.get(event, set())
        if event in answers:
            own -= {"answer_status", "code"}
        if own:
            missing[event] = sorted(own)
    assert not missing, f"fields the README does not name with their event: {missing}"


def test_every_record_about_a_request_carries_its_op_flow_session_and_transport():
    """The README: a record about a request has ``op``, ``flow``, ``session`` and
    ``transport`` (a consumer groups a request's records by them). Every emit call that names
    the operation (``op``) names the other three too, or spreads a request's ``base`` (which
    has all four). (A ``passthrough`` of a request turnguard could not identify has no
    operation: ``flow`` and ``transport`` only, as the README says.)"""
    short = []
    for file, line, event, keys in _emit_calls():
        if None in keys:  # a spread: a base of the request's (checked where it is made)
            continue
        if "op" in keys and not {"flow", "session", "transport"} <= keys:
            short.append(f"{file}:{line} {event} {sorted(keys)}")
        if "flow" in keys and "op" not in keys and event != "passthrough":
            short.append(f"{file}:{line} {event} {sorted(keys)}")
    assert not short, short
