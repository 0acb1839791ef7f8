"""Inspect a turnguard ledger from the command line (read only).

    python -m turnguard_core.ledger_cli [--ledger PATH] list [--limit N] [--json]
    python -m turnguard_core.ledger_cli [--ledger PATH] show OP_PREFIX [--json]
    python -m turnguard_core.ledger_cli [--ledger PATH] stats [--json]

``scripts/ledger`` runs it with the set-up done. The ledger is opened with
``Ledger.open_readonly``: nothing is written, so it is safe next to running proxies. The ledger
holds no secret (credentials, sessions and turn-state tokens are hashes); recorded response
headers are never printed. Exit status: 0 ok, 1 error (missing ledger, no such operation,
ambiguous prefix, failed integrity check), 2 usage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any, TextIO

from .ledger import Ledger, LedgerError

DEFAULT_LEDGER = "~/.mitmproxy/turnguard.sqlite3"
OP_ID_CHARS = 12


class CliError(Exception):
    """An error reported as one line on stderr, exit status 1."""


def iso(ts: float | None) -> str | None:
    """A Unix time as ISO-8601 UTC with milliseconds, e.g. ``2025-01-02T03:04:05.678Z``."""
    if ts is None:
        return None
    t = datetime.datetime.fromtimestamp(ts, datetime.UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def default_ledger_path() -> str:
    return os.environ.get("TURNGUARD_LEDGER") or DEFAULT_LEDGER


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/ledger",
        description="Inspect a turnguard ledger (read only).",
        epilog="The ledger defaults to $TURNGUARD_LEDGER, else " + DEFAULT_LEDGER
        + " (the proxy's default with confdir ~/.mitmproxy).",
    )
    p.add_argument(
        "--ledger", metavar="PATH", default=None,
        help=f"ledger file (default: $TURNGUARD_LEDGER or {DEFAULT_LEDGER})",
    )
    # --ledger is accepted after the command too (`list --ledger PATH`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--ledger", metavar="PATH", default=argparse.SUPPRESS, help="ledger file")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    ls = sub.add_parser("list", parents=[common],
                        help="recent operations, most recently updated first")
    ls.add_argument("--limit", type=_positive_int, default=50, metavar="N",
                    help="at most N operations (default 50)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    show = sub.add_parser("show", parents=[common], help="one operation and its attempts")
    show.add_argument("op_prefix", metavar="OP_PREFIX", help="the start of an operation id")
    show.add_argument("--json", action="store_true", help="print JSON")
    st = sub.add_parser("stats", parents=[common],
                        help="operations by state and an integrity check")
    st.add_argument("--json", action="store_true", help="print JSON")
    return p


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {n}")
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
    "attempt_id", "op_key", "kind", "instance_id", "flow_id", "started_at", "ended_at", "status",
    "events_seen", "outcome", "detail", "body_bytes", "replayable",
}
_OPERATION_COLUMNS = {
    "op_key", "state", "method", "path", "scope", "session", "idempotency_key", "fingerprint",
    "turn_state", "previous_response_id", "attempts", "current_attempt", "replay_attempt",
    "created_at", "updated_at", "ended_at",
}


def attempt_view(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "attempt": row["attempt_id"],
        "kind": row["kind"],
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


def operation_view(op: dict[str, Any]) -> dict[str, Any]:
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
        "created": iso(op["created_at"]),
        "updated": iso(op["updated_at"]),
        "ended": iso(op["ended_at"]),
        **_extra(op, _OPERATION_COLUMNS),
        "attempt_rows": [attempt_view(a) for a in op["attempt_rows"]],
    }


# -- commands --------------------------------------------------------------------------------


def cmd_list(ledger: Ledger, args: argparse.Namespace, out: TextIO) -> int:
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


def cmd_show(ledger: Ledger, args: argparse.Namespace, out: TextIO) -> int:
    prefix = args.op_prefix.strip().lower()
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
    view = operation_view(op)
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
        ("current attempt", view["current_attempt"]),
        ("replay attempt", view["replay_attempt"]),
        ("created", view["created"]),
        ("updated", view["updated"]),
        ("ended", view["ended"]),
    ]
    fields += [(k.replace("_", " "), v) for k, v in _extra(op, _OPERATION_COLUMNS).items()]
    for name, value in fields:
        out.write(f"{name + ':':<21} {_text(value)}\n")
    for a in view["attempt_rows"]:
        out.write(f'\nattempt {a["attempt"]} ({a["kind"]})\n')
        for name, value in a.items():
            if name in ("attempt", "kind"):
                continue
            if name == "replayable":
                value = "yes" if value else "no"
            out.write(f"  {name.replace('_', ' ') + ':':<14} {_text(value)}\n")
    if not view["attempt_rows"]:
        out.write("\nno attempts recorded\n")
    return 0


def cmd_stats(ledger: Ledger, args: argparse.Namespace, out: TextIO) -> int:
    counts = ledger.counts()
    integrity = ledger.integrity_check()
    ok = integrity == "ok"
    if args.json:
        json.dump(
            {"ledger": ledger.path, "operations": sum(counts.values()),
             "by_state": dict(sorted(counts.items())), "integrity": integrity,
             "integrity_ok": ok},
            out, indent=2,
        )
        out.write("\n")
    else:
        out.write(f"ledger:     {ledger.path}\n")
        out.write(f"operations: {sum(counts.values())}\n")
        for state, n in sorted(counts.items()):
            out.write(f"  {state + ':':<11} {n}\n")
        out.write(f"integrity:  {'ok' if ok else 'FAILED: ' + integrity}\n")
    return 0 if ok else 1


COMMANDS = {"list": cmd_list, "show": cmd_show, "stats": cmd_stats}


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _table(header: list[str], rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


# -- entry point -----------------------------------------------------------------------------


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return e.code if isinstance(e.code, int) else 2
    path = os.path.abspath(os.path.expanduser(args.ledger or default_ledger_path()))
    ledger = Ledger(path, f"cli-{os.getpid()}")
    try:
        if not os.path.exists(path):
            raise CliError(
                f"no ledger at {path}: start the proxy first (scripts/proxy), or point at"
                " another file with --ledger PATH or TURNGUARD_LEDGER"
            )
        try:
            ledger.open_readonly()
        except LedgerError as e:
            raise CliError(f"cannot open the ledger: {e}") from e
        return COMMANDS[args.command](ledger, args, out)
    except CliError as e:
        err.write(f"ledger: error: {e}\n")
        return 1
    except LedgerError as e:
        err.write(f"ledger: error: reading {path} failed: {e}\n")
        return 1
    finally:
        ledger.close()


if __name__ == "__main__":
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `scripts/ledger list | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    sys.exit(status)
