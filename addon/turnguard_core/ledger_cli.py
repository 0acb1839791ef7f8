"""turnguard's status and control tool, working on the ledger (so with any mitmdump):

    python -m turnguard_core.ledger_cli [--ledger PATH] status [--json]
    python -m turnguard_core.ledger_cli [--ledger PATH] list [--limit N] [--json]
    python -m turnguard_core.ledger_cli [--ledger PATH] show OP_PREFIX [--json]
    python -m turnguard_core.ledger_cli [--ledger PATH] stats [--json]
    python -m turnguard_core.ledger_cli [--ledger PATH] circuit list [--json]
    python -m turnguard_core.ledger_cli [--ledger PATH] circuit clear SCOPE|--all [--events FILE]
    python -m turnguard_core.ledger_cli [--ledger PATH] session release SESSION [--events FILE]
    python -m turnguard_core.ledger_cli [--ledger PATH] audit [--limit N] [--json]

``scripts/turnguard`` runs it with the set-up done (``scripts/ledger`` too: the same program,
kept for the inspection commands). Inspection opens the ledger with ``Ledger.open_readonly``:
nothing is written, so it is safe next to running proxies, and no file is made beside the ledger
(but a -shm, 0600, for a -wal found without one: SQLite needs it to read the -wal's rows). The control commands (``circuit
clear``, ``session release``) write through the ledger module's fenced transactions, the same
the addon uses, record who did what in the ledger's audit table and, with ``--events`` (or
$TURNGUARD_EVENTS), append a telemetry line. The ledger holds no secret (credentials,
sessions and turn-state tokens are hashes); recorded response headers are never printed. Exit
status: 0 ok, 1 error (missing ledger, no such operation, circuit or session, ambiguous prefix,
failed integrity check, a row turnguard did not write), 2 usage error.
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import io
import json
import os
import re
import sys
import time
from typing import Any, TextIO

from . import liveness
from .ledger import LedgerError
from .ledger_admin import LedgerAdmin
from .ledger_location import (
    CONNINFO_REFUSED,
    check_postgres_url,
    display,
    is_conninfo,
    is_postgres,
    scrub_options,
)
from .options import DEFAULTS
from .private_files import UnsafePath, shown
from .telemetry import Telemetry

DEFAULT_LEDGER = "~/.mitmproxy/turnguard.sqlite3"
OP_ID_CHARS = 12


class CliError(Exception):
    """An error reported as one line on stderr, exit status 1."""


def iso(ts: float | None) -> str | None:
    """A Unix time as ISO-8601 UTC with milliseconds, e.g. ``2025-01-02T03:04:05.678Z``."""
    if ts is None:
        return None
    try:
        t = datetime.datetime.fromtimestamp(ts, datetime.UTC)
    except (TypeError, ValueError, OverflowError, OSError):  # a junk value in the ledger
        return f"(not a time: {ts!r})"
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def default_ledger_path() -> str:
    return os.environ.get("TURNGUARD_LEDGER") or DEFAULT_LEDGER


# the addon's default turnguard_instance_lease_ms: a process that cannot be checked on this host
# is taken for dead after this long without a heartbeat
INSTANCE_LEASE_S = DEFAULTS["turnguard_instance_lease_ms"] / 1000


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="turnguard's status and control, on its ledger: works with any mitmdump "
        "(or none) that uses the ledger. Inspection is read only and makes no file beside the "
        "ledger (but a -shm, 0600, for a -wal found without one: SQLite reads the -wal through "
        "it); circuit clear and session "
        "release write through the ledger's fenced transactions and are audited.",
        epilog="The ledger defaults to $TURNGUARD_LEDGER, else " + DEFAULT_LEDGER
        + " (the proxy's default with confdir ~/.mitmproxy). Exit status: 0 ok; 1 error (no"
        " ledger, a ledger that cannot be opened or read, no such operation, circuit or"
        " session, an ambiguous prefix, a failed integrity check, a row turnguard did not"
        " write); 2 usage error.",
    )
    p.add_argument(
        "--ledger", metavar="PATH", default=None,
        help=f"ledger file, or a PostgreSQL URL postgresql://... (default: $TURNGUARD_LEDGER "
        f"or {DEFAULT_LEDGER})",
    )
    # --ledger is accepted after the command too (`list --ledger PATH`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--ledger", metavar="PATH", default=argparse.SUPPRESS, help="ledger file or PostgreSQL URL")
    # not required= here: argparse would then report a missing COMMAND before an option it
    # does not know (`--bogus` alone); main() asks for the command once the rest parsed
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _inspection_commands(sub, common)
    _control_commands(sub, common)
    return p


def _inspection_commands(sub, common: argparse.ArgumentParser) -> None:
    """Read-only: list, show, stats, status, audit."""
    ls = sub.add_parser("list", parents=[common],
                        help="recent operations, most recently updated first")
    ls.add_argument("--limit", type=_positive_int, default=50, metavar="N",
                    help="at most N operations (default 50)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    show = sub.add_parser("show", parents=[common], help="one operation and its attempts")
    show.add_argument("op_prefix", metavar="OP_PREFIX", help="the start of an operation id")
    show.add_argument("--json", action="store_true", help="print JSON")
    st = sub.add_parser("stats", parents=[common],
                        help="operations by state, duplicates, open circuits and an integrity "
                             "check")
    st.add_argument("--json", action="store_true", help="print JSON")
    status = sub.add_parser(
        "status", parents=[common],
        help="operations by state, duplicates held and replayed, open circuits with their "
             "remaining cooldown, sessions and owners, instances and heartbeats")
    status.add_argument("--json", action="store_true", help="print JSON")
    audit = sub.add_parser("audit", parents=[common], help="the latest control actions")
    audit.add_argument("--limit", type=_positive_int, default=20, metavar="N",
                       help="at most N actions (default 20)")
    audit.add_argument("--json", action="store_true", help="print JSON")


def _control_commands(sub, common: argparse.ArgumentParser) -> None:
    """Audited writes: circuit list|clear, session release."""
    events = argparse.ArgumentParser(add_help=False)
    events.add_argument(
        "--events", metavar="FILE", default=os.environ.get("TURNGUARD_EVENTS") or None,
        help="append the action as a telemetry line to this JSON-lines file (0600; default: "
             "$TURNGUARD_EVENTS; use the proxy's turnguard_events file)")
    circuit = sub.add_parser("circuit", help="retry circuits: list, clear")
    csub = circuit.add_subparsers(dest="circuit_command", metavar="ACTION", required=True)
    clist = csub.add_parser("list", parents=[common],
                            help="circuits that count failures or cool down")
    clist.add_argument("--json", action="store_true", help="print JSON")
    clear = csub.add_parser(
        "clear", parents=[common, events],
        help="close a circuit by hand: the next request dispatches (audited). In once mode an "
             "operation still gets at most one recovery dispatch ever.")
    clear.add_argument("scope", nargs="?", metavar="SCOPE",
                       help="the circuit's scope, or a unique start of it (see circuit list)")
    clear.add_argument("--all", action="store_true",
                       help="every circuit that counts failures or cools down")
    session = sub.add_parser("session", help="durable sessions: release")
    ssub = session.add_subparsers(dest="session_command", metavar="ACTION", required=True)
    release = ssub.add_parser(
        "release", parents=[common, events],
        help="release a durable session: no process owns it, its epoch goes up (writes fenced "
             "with the old one fail), the next process to serve it takes it over (audited)")
    release.add_argument("session", metavar="SESSION",
                         help="the session id (a hash, see status) or a unique start of it")


MAX_COUNT = 2**31 - 1  # a --limit past SQLite's integers would only fail deep down


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {n}")
    if n > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT}, not {n}")
    return n


# -- views: what each command shows, as plain dicts (also the --json output) -------------------


def operation_summary(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "op": row["op_key"][:OP_ID_CHARS],
        "op_key": row["op_key"],
        "state": row["state"],
        "attempts": row["attempts"],
        "method": row["method"],
        "path": row["path"],
        "session": row["session"],
        "created": iso(row["created_at"]),
        "updated": iso(row["updated_at"]),
        "replayable": bool(row["replayable"]),
    }


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def circuit_view(scope: str, state, now: float) -> dict[str, Any]:
    remaining = state.remaining_s(now)
    return {
        "scope": scope,
        "open": remaining > 0,
        "failures": state.failures,
        "remaining_s": round(remaining, 3),
        "cooldown_s": state.cooldown_s,
        "open_until": iso(state.open_until),
    }


# Columns never shown: the recorded response headers (they could carry anything an upstream
# sent) and the spool's bytes.
HIDDEN = {"headers", "data"}


def _extra(row: dict[str, Any], shown: set[str]) -> dict[str, Any]:
    """Columns a newer schema added that the views below do not name: shown as they are
    (times as ISO-8601), so that inspection keeps up with the ledger."""
    out = {}
    for k, v in row.items():
        if k in shown or k in HIDDEN or k == "attempt_rows":
            continue
        is_time = k.endswith(("_at", "_until")) and isinstance(v, (int, float))
        out[k] = iso(v) if is_time else v
    return out


_ATTEMPT_COLUMNS = {
    "attempt_id", "op_key", "kind", "transport", "instance_id", "flow_id", "started_at",
    "ended_at", "status",
    "events_seen", "outcome", "detail", "body_bytes", "replayable",
}
_OPERATION_COLUMNS = {
    "op_key", "state", "method", "path", "scope", "session", "idempotency_key", "fingerprint",
    "turn_state", "previous_response_id", "attempts", "current_attempt", "replay_attempt",
    "created_at", "updated_at", "ended_at", "duplicates_held", "duplicates_replayed",
    "recovery_dispatches", "circuit_scope",
}


def attempt_view(row: dict[str, Any], number: int) -> dict[str, Any]:
    """An attempt; ``number`` counts the operation's attempts from 1 (``attempt`` is the
    ledger's id, global across operations)."""
    return {
        "number": number,
        "attempt": row["attempt_id"],
        "kind": row["kind"],
        "transport": row.get("transport", "http"),
        "instance": row["instance_id"],
        "flow": row["flow_id"],
        "started": iso(row["started_at"]),
        "ended": iso(row["ended_at"]),
        "status": row["status"],
        "events_seen": row["events_seen"],
        "outcome": row["outcome"],
        "detail": row["detail"],
        "body_bytes": row["body_bytes"],
        "replayable": bool(row["replayable"]),
        **_extra(row, _ATTEMPT_COLUMNS),
    }


def operation_view(op: dict[str, Any], circuit: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "op": op["op_key"][:OP_ID_CHARS],
        "op_key": op["op_key"],
        "state": op["state"],
        "method": op["method"],
        "path": op["path"],
        "scope": op["scope"][:OP_ID_CHARS],
        "session": op["session"],
        "idempotency_key": op["idempotency_key"],
        "fingerprint": op["fingerprint"][:OP_ID_CHARS],
        "turn_state": op["turn_state"],
        "previous_response_id": op["previous_response_id"],
        "attempts": op["attempts"],
        "current_attempt": op["current_attempt"],
        "replay_attempt": op["replay_attempt"],
        "recovery_dispatches": op["recovery_dispatches"],
        "duplicates_held": op["duplicates_held"],
        "duplicates_replayed": op["duplicates_replayed"],
        "circuit": circuit,
        "created": iso(op["created_at"]),
        "updated": iso(op["updated_at"]),
        "ended": iso(op["ended_at"]),
        **_extra(op, _OPERATION_COLUMNS),
        "attempt_rows": [attempt_view(a, i) for i, a in enumerate(op["attempt_rows"], 1)],
    }


# -- commands --------------------------------------------------------------------------------


def cmd_list(ledger: LedgerAdmin, args: argparse.Namespace, out: TextIO) -> int:
    ops = [operation_summary(r) for r in ledger.list_operations(args.limit)]
    if args.json:
        json.dump(ops, out, indent=2)
        out.write("\n")
        return 0
    if not ops:
        out.write(f"no operations in {ledger.path}\n")
        return 0
    rows = [
        [o["op"], o["state"], str(o["attempts"]), f'{o["method"]} {o["path"]}', o["updated"],
         "yes" if o["replayable"] else "no"]
        for o in ops
    ]
    _table(["OP", "STATE", "ATTEMPTS", "REQUEST", "UPDATED (UTC)", "REPLAYABLE"], rows, out)
    return 0


def cmd_show(ledger: LedgerAdmin, args: argparse.Namespace, out: TextIO) -> int:
    op = _find_operation(ledger, args.op_prefix.strip().lower())
    now = time.time()
    circuit = None
    if op["circuit_scope"]:
        circuit = circuit_view(op["circuit_scope"], ledger.circuit_state(op["circuit_scope"]), now)
    view = operation_view(op, circuit)
    if args.json:
        json.dump(view, out, indent=2)
        out.write("\n")
        return 0
    fields = [
        ("operation", view["op_key"]),
        ("state", view["state"]),
        ("request", f'{view["method"]} {view["path"]}'),
        ("scope", view["scope"]),
        ("session", view["session"]),
        ("idempotency key", view["idempotency_key"]),
        ("body fingerprint", view["fingerprint"]),
        ("turn state", view["turn_state"]),
        ("previous response", view["previous_response_id"]),
        ("attempts", view["attempts"]),
        ("current attempt", _number_of(view, view["current_attempt"])),
        ("replay attempt", _number_of(view, view["replay_attempt"])),
        ("recovery dispatches", view["recovery_dispatches"]),
        ("duplicates held", view["duplicates_held"]),
        ("duplicates replayed", view["duplicates_replayed"]),
        ("circuit", _circuit_text(circuit)),
        ("created", view["created"]),
        ("updated", view["updated"]),
        ("ended", view["ended"]),
    ]
    fields += [(k.replace("_", " "), v) for k, v in _extra(op, _OPERATION_COLUMNS).items()]
    for name, value in fields:
        out.write(f"{name + ':':<21} {_text(value)}\n")
    _write_attempts(view["attempt_rows"], out)
    return 0


def _find_operation(ledger: LedgerAdmin, prefix: str) -> dict[str, Any]:
    if not prefix:
        raise CliError("OP_PREFIX is empty; give the start of an operation id (see `list`)")
    op = ledger.find_operation(prefix)
    if op is None:
        raise CliError(f"no operation whose id starts with {prefix!r} in {ledger.path}")
    if "ambiguous" in op:
        found = ", ".join(k[:OP_ID_CHARS] + "..." for k in op["ambiguous"])
        raise CliError(
            f"operation id prefix {prefix!r} is ambiguous (matches {found} and maybe more);"
            " give more characters"
        )
    return op


def _write_attempts(rows: list[dict[str, Any]], out: TextIO) -> None:
    for a in rows:
        out.write(f'\nattempt {a["number"]} ({a["kind"]})\n')
        a = {"ledger id": a["attempt"], **a}
        for name, value in a.items():
            if name in ("attempt", "kind", "number"):
                continue
            if name == "replayable":
                value = "yes" if value else "no"
            out.write(f"  {name.replace('_', ' ') + ':':<14} {_text(value)}\n")
    if not rows:
        out.write("\nno attempts recorded\n")


def _number_of(view: dict[str, Any], attempt_id: int | None) -> str | None:
    """An attempt id as the operation's own numbering ("2 (ledger id 7)")."""
    if attempt_id is None:
        return None
    for a in view["attempt_rows"]:
        if a["attempt"] == attempt_id:
            return f'{a["number"]} (ledger id {attempt_id})'
    return f"ledger id {attempt_id}"


def _circuit_text(c: dict[str, Any] | None) -> str | None:
    if c is None:
        return None
    if c["open"]:
        return (f'OPEN: cooldown {duration(c["remaining_s"])} left, {c["failures"]} consecutive '
                f'eventless failures (scope {c["scope"]})')
    return f'closed, {c["failures"]} consecutive eventless failures (scope {c["scope"]})'


def cmd_stats(ledger: LedgerAdmin, args: argparse.Namespace, out: TextIO) -> int:
    now = time.time()
    counts = ledger.counts()
    dups = ledger.duplicate_totals()
    open_circuits = ledger.open_circuits(now)
    integrity = ledger.integrity_check()
    ok = integrity == "ok"
    if args.json:
        json.dump(
            {"ledger": ledger.path, "operations": sum(counts.values()),
             "by_state": dict(sorted(counts.items())), "duplicates": dups,
             "open_circuits": [circuit_view(s, st, now) for s, st in open_circuits],
             "integrity": integrity, "integrity_ok": ok},
            out, indent=2,
        )
        out.write("\n")
    else:
        out.write(f"ledger:     {ledger.path}\n")
        out.write(f"operations: {sum(counts.values())}\n")
        for state, n in sorted(counts.items()):
            out.write(f"  {state + ':':<11} {n}\n")
        out.write(f"duplicates: held {dups['held']}, replayed {dups['replayed']}\n")
        longest = max((st.remaining_s(now) for _, st in open_circuits), default=0.0)
        out.write(f"cooldowns:  {len(open_circuits)} open"
                  + (f" (longest {duration(longest)} left)\n" if open_circuits else "\n"))
        out.write(f"integrity:  {'ok' if ok else 'FAILED: ' + integrity}\n")
    return 0 if ok else 1


def status_view(ledger: LedgerAdmin, now: float) -> dict[str, Any]:
    counts = ledger.counts()
    instances = ledger.instances()
    return {
        "ledger": ledger.path,
        "operations": sum(counts.values()),
        "operations_by_state": dict(sorted(counts.items())),
        "duplicates": ledger.duplicate_totals(),
        "circuits": [circuit_view(r.scope, r.state, now) for r in ledger.circuits(now)],
        "sessions": [
            {"session": r.session, "durable_id": r.ownership.durable_id,
             "owner": r.ownership.owner_instance or None, "epoch": r.ownership.owner_epoch,
             "lease_left_s": round(max(0.0, r.ownership.lease_until - now), 1),
             "updated": iso(r.updated_at)}
            for r in ledger.sessions()
        ],
        "instances": [
            {"instance": r.instance_id, "pid": r.identity.pid, "host": r.identity.host,
             "heartbeat": iso(r.heartbeat_at),
             "heartbeat_age_s": round(now - r.heartbeat_at, 1),
             "alive": liveness.verdict(
                 r, me=liveness.read_process_identity(), now=now, lease_s=INSTANCE_LEASE_S,
                 start_ticks_of=liveness.probe_start_ticks) == "alive"}
            for r in instances
        ],
        "recent_control_actions": [_audit_view(a) for a in ledger.audit_log(5)],
    }


def cmd_status(ledger: LedgerAdmin, args: argparse.Namespace, out: TextIO) -> int:
    now = time.time()
    v = status_view(ledger, now)
    if args.json:
        json.dump(v, out, indent=2)
        out.write("\n")
        return 0
    by_state = ", ".join(f"{k} {n}" for k, n in v["operations_by_state"].items())
    out.write(f"ledger:      {v['ledger']}\n")
    out.write(f"operations:  {v['operations']}" + (f" ({by_state})" if by_state else "") + "\n")
    out.write(f"duplicates:  held {v['duplicates']['held']}, "
              f"replayed {v['duplicates']['replayed']}\n")
    cooling = [c for c in v["circuits"] if c["open"]]
    out.write(f"circuits:    {len(cooling)} cooling down, "
              f"{len(v['circuits']) - len(cooling)} counting failures\n")
    if v["circuits"]:
        _table(["  SCOPE", "STATE", "FAILURES", "COOLDOWN LEFT"], [
            ["  " + c["scope"], "open" if c["open"] else "closed", str(c["failures"]),
             duration(c["remaining_s"]) if c["open"] else "-"]
            for c in v["circuits"]
        ], out)
    out.write(f"sessions:    {len(v['sessions'])}\n")
    if v["sessions"]:
        _table(["  SESSION", "OWNER", "EPOCH", "LEASE LEFT"], [
            ["  " + s["session"], s["owner"] or "(released)", str(s["epoch"]),
             duration(s["lease_left_s"])]
            for s in v["sessions"]
        ], out)
    out.write(f"instances:   {len(v['instances'])}\n")
    if v["instances"]:
        _table(["  INSTANCE", "PID", "HOST", "HEARTBEAT", "STATE"], [
            ["  " + i["instance"], str(i["pid"]), i["host"], f"{i['heartbeat_age_s']:.1f} s ago",
             "alive" if i["alive"] else "dead (its attempts get reaped)"]
            for i in v["instances"]
        ], out)
    if v["recent_control_actions"]:
        out.write("recent control actions:\n")
        for a in v["recent_control_actions"]:
            out.write(f"  {a['at']}  {_text(a['action'])} {_text(a['target'])}"
                      f"  by {_text(a['actor'])}\n")
    return 0


def _audit_view(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "at": iso(row["at"]), "action": row["action"], "target": row["target"],
        "actor": row["actor"],
        "before": json.loads(row["before"]) if row["before"] else None,
        "after": json.loads(row["after"]) if row["after"] else None,
    }


def cmd_audit(ledger: LedgerAdmin, args: argparse.Namespace, out: TextIO) -> int:
    rows = [_audit_view(r) for r in ledger.audit_log(args.limit)]
    if args.json:
        json.dump(rows, out, indent=2)
        out.write("\n")
    elif not rows:
        out.write("no control actions recorded\n")
    else:
        for a in rows:
            out.write(f"{a['at']}  {_text(a['action'])} {_text(a['target'])}  by {_text(a['actor'])}\n"
                      f"    before {json.dumps(a['before'])}\n    after  {json.dumps(a['after'])}\n")
    return 0


def cmd_circuit(ledger: LedgerAdmin, args: argparse.Namespace, out: TextIO) -> int:
    now = time.time()
    if args.circuit_command == "list":
        rows = [circuit_view(r.scope, r.state, now) for r in ledger.circuits(now)]
        if args.json:
            json.dump(rows, out, indent=2)
            out.write("\n")
        elif not rows:
            out.write("no circuit counts failures or cools down\n")
        else:
            _table(["SCOPE", "STATE", "FAILURES", "COOLDOWN LEFT", "OPEN UNTIL (UTC)"], [
                [c["scope"], "open" if c["open"] else "closed", str(c["failures"]),
                 duration(c["remaining_s"]) if c["open"] else "-", c["open_until"] or "-"]
                for c in rows
            ], out)
        return 0
    if bool(args.all) == bool(args.scope):
        raise UsageError("circuit clear needs a SCOPE or --all (not both)")
    telemetry = _events(args)
    cleared = ledger.clear_circuits(None if args.all else args.scope, now=now, actor=_actor())
    for row in cleared:
        telemetry.emit("circuit_cleared", scope=row.scope, failures=row.state.failures,
                       remaining_ms=round(row.state.remaining_s(now) * 1000), by="cli")
        out.write(f"cleared {_text(row.scope)} ({row.state.failures} failures, "
                  f"{duration(row.state.remaining_s(now))} of cooldown left)\n")
    if not cleared:
        out.write("no circuit counts failures or cools down: nothing to clear\n")
    telemetry.close()
    return 0


def cmd_session(ledger: LedgerAdmin, args: argparse.Namespace, out: TextIO) -> int:
    telemetry = _events(args)
    key, before, after = ledger.release_session(args.session, now=time.time(), actor=_actor())
    telemetry.emit("session_released", session=key, owner_was=before.owner_instance,
                   epoch_was=before.owner_epoch, epoch=after.owner_epoch, by="cli")
    telemetry.close()
    out.write(f"released session {_text(key)} (owner was {_text(before.owner_instance or 'none')}, epoch "
              f"{before.owner_epoch} -> {after.owner_epoch}); the next process to serve it "
              "takes it over\n")
    return 0


def _events(args: argparse.Namespace) -> Telemetry:
    try:
        return Telemetry(os.path.abspath(os.path.expanduser(args.events)) if args.events else None)
    except UnsafePath as e:  # (a ledger URL given as --events by mistake: its password ***)
        raise CliError(scrub_options(f"--events {args.events} is refused: {e}",
                                     [args.events])) from None
    except OSError as e:
        raise CliError(scrub_options(f"--events {args.events} cannot be opened: {e.strerror}",
                                     [args.events])) from None


def _actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return f"{PROG_NAME} (user {user}, pid {os.getpid()})"


class UsageError(Exception):
    """A usage error found after parsing: exit status 2."""


COMMANDS = {
    "list": cmd_list, "show": cmd_show, "stats": cmd_stats, "status": cmd_status,
    "circuit": cmd_circuit, "session": cmd_session, "audit": cmd_audit,
}
WRITES = {"circuit": lambda a: a.circuit_command == "clear", "session": lambda a: True}
PROG_NAME = os.environ.get("TURNGUARD_PROG") or "scripts/turnguard"


# what a terminal acts on rather than prints: C0 and C1 controls (ESC, BEL, CR, a C1 CSI),
# DEL, format characters (bidi overrides), line and paragraph separators and lone surrogates
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e"
                          "\u2060-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff]")


def _escape(text: str, keep_newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on written as an escape (``\\x1b``):
    values in the ledger can come from a client (a body's ``previous_response_id``), and must
    not move the operator's cursor, retitle the terminal or forge a line of output."""
    def one(m: re.Match[str]) -> str:
        c = m.group(0)
        if keep_newlines and c == "\n":
            return c
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    return _UNPRINTABLE.sub(one, text)


class _Printable:
    """The output stream with no character a terminal would act on, newlines apart (the
    tool's own line ends; a value's newlines are escaped by ``_text`` and ``_table``)."""

    def __init__(self, out: TextIO):
        self._out = out

    def write(self, text: str) -> int:
        return self._out.write(_escape(text, keep_newlines=True))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def _text(value: Any) -> str:
    return "-" if value is None else _escape(str(value))


def _table(header: list[str], rows: list[list[str]], out: TextIO) -> None:
    rows = [[_escape(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


# -- entry point -----------------------------------------------------------------------------


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    parser = _parser(PROG_NAME)
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.error("the following arguments are required: COMMAND")
        if getattr(args, "ledger", None) is not None and not args.ledger.strip():
            # `--ledger "$UNSET"`: never the default ledger in its place (a `circuit clear
            # --all` would act on another ledger than the one meant)
            parser.error("--ledger is empty; give a ledger file or a PostgreSQL URL, or leave "
                         "--ledger out for the default")
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return e.code if isinstance(e.code, int) else 2
    for value in vars(args).values():  # bytes that are not UTF-8 (a terminal's slip)
        if isinstance(value, str) and not _utf8(value):
            parser.print_usage(err)
            err.write(f"{os.path.basename(PROG_NAME)}: error: an argument is not UTF-8 text\n")
            return 2
    location = args.ledger or default_ledger_path()
    if is_postgres(location):  # a PostgreSQL ledger: shown without its password
        from .pg_ledger import PgLedgerAdmin
        ledger: LedgerAdmin = PgLedgerAdmin(location.strip(), f"cli-{os.getpid()}")
        path = ledger.path
    else:
        path = os.path.abspath(os.path.expanduser(location))
        ledger = LedgerAdmin(path, f"cli-{os.getpid()}")
    writes = WRITES.get(args.command, lambda a: False)(args)
    name = os.path.basename(PROG_NAME)
    try:
        if is_conninfo(location):  # refused as the addon refuses it: never a path
            raise CliError(f"{display(location)} is refused: {CONNINFO_REFUSED}")
        if is_postgres(location):  # refused as the addon refuses it (never read as a bad row)
            try:
                check_postgres_url(location)
            except ValueError as e:
                raise CliError(f"{display(location)} is refused: {e}") from None
        elif not os.path.exists(path):
            raise CliError(
                f"no ledger at {shown(path)}: start the proxy first (scripts/proxy), or point at"
                " another file with --ledger PATH or TURNGUARD_LEDGER"
            )
        try:
            if writes:  # migrates an older ledger, as the addon would; registers no instance
                ledger.open(time.time(), register=False)
            else:
                ledger.open_readonly()
        except LedgerError as e:
            raise CliError(f"cannot open the ledger: {e}") from e
        if writes:
            try:
                return COMMANDS[args.command](ledger, args, _Printable(out))
            except LedgerError as e:
                raise CliError(str(e)) from e
        return _inspect(ledger, args, out)
    except UsageError as e:
        parser.print_usage(err)
        err.write(f"{name}: error: {e}\n")
        return 2
    except CliError as e:
        err.write(f"{name}: error: {e}\n")
        return 1
    except LedgerError as e:
        err.write(f"{name}: error: reading {shown(path)} failed: {e}\n")
        return 1
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError) as e:
        # a row this tool cannot read (a value of the wrong type, a junk JSON text): written
        # by hand or by something else than turnguard; say so instead of a traceback
        err.write(f"{name}: error: {shown(path)} holds a row turnguard did not write "
                  f"(edited by hand or by another program: {type(e).__name__}: "
                  f"{_escape(str(e))})\n")
        return 1
    finally:
        ledger.close()


# reads of a ledger no process had open that a writer overlapped, before the last is kept
INSPECTION_READS = 3


def _inspect(ledger: LedgerAdmin, args: argparse.Namespace, out: TextIO) -> int:
    """Runs an inspection command; what it printed is kept only if the read was stable (no
    writer opened the ledger meanwhile: ``Ledger.read_was_stable``), else it reads again."""
    for read in range(1, INSPECTION_READS + 1):
        last = read == INSPECTION_READS
        buffer = io.StringIO()
        try:
            status = COMMANDS[args.command](ledger, args, _Printable(buffer))
        except LedgerError:
            if last or ledger.read_was_stable():
                raise
        else:
            if last or ledger.read_was_stable():
                break
        ledger.close()
        ledger.open_readonly()
    out.write(buffer.getvalue())
    return status


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # surrogates: how Python keeps undecodable bytes of argv
        return False
    return True


if __name__ == "__main__":
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `scripts/ledger list | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    sys.exit(status)
