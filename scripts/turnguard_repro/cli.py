"""``scripts/reproduce``: recreate a turnguard incident on one machine, with and without turnguard.

    scripts/reproduce --list
    scripts/reproduce duplicate-storm [--json] [--save-json FILE] [-w FILE.flows] [--timeline FILE.svg]
    scripts/reproduce cooldown-503-storm --columns default,once
    scripts/reproduce show NAME > my-scenario.json       # a built-in scenario as a file
    scripts/reproduce run my-scenario.json
    scripts/reproduce from-capture FLOWS_FILE -o scenario.json [--keep-bodies]
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from . import capture, runner, scenarios, timeline

EPILOG = """\
Commands:
  reproduce NAME [options]              run a built-in scenario (--list names them)
  reproduce run FILE.json [options]     run a scenario file (yours, or one from a capture)
  reproduce show NAME                   print a built-in scenario, to start your own
  reproduce from-capture FLOWS -o FILE  turn a mitmdump -w capture into a scenario file
                                        (reproduce from-capture --help for its options)

Columns: plain (mitmdump without turnguard), guard409 (turnguard answering duplicates 409 at
once), default (turnguard defaults, fail_closed), once (server_anchored_replay_once),
indefinite (server_indefinite_recovery). Each column gets a fresh mock upstream, mitmdump,
ledger and events file on loopback ports; columns run side by side.

The built-in scenarios shorten turnguard's timings so that they run in seconds:
turnguard_cooldown_ms=3000 (production 60000) and turnguard_response_created_timeout_ms=1000
(production 60000), in their own turnguard_options (reproduce show prints them). A scenario
file from a capture runs with turnguard's defaults, so the captured timings play out as they
were; --set overrides either, and the table's header shows the values in force. A captured
stall longer than the response_created timeout in force gets a WARNING (turnguard would cut
it). Counts come from the mock's dispatch log and turnguard's events file. TURN LOST: a turn
(same path and body, whoever sent it) that was retried and never completed; a failed request
no client retried is counted apart.

-w FILE.flows saves each column's flows (FILE.<column>.flows with several columns); open one
with `mitmweb -r FILE.default.flows`: held, replayed and rejected flows carry turnguard's marks
and comments.
"""


def _parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.startswith("turnguard_"):
            raise SystemExit(f"reproduce: --set wants turnguard_NAME=VALUE, not {item!r}")
        out[k] = v
    from turnguard_core.options import deferred_problems  # the addon's own check

    problems = deferred_problems({k: [v] for k, v in out.items()})
    if problems:  # each turnguard column's mitmdump would refuse to start
        raise SystemExit("reproduce: " + "; ".join(problems.values()))
    return out


def _list() -> str:
    lines = ["Built-in scenarios:"]
    for name, s in scenarios.BUILTIN.items():
        lines.append(f"  {name:<26} {s.get('incident', '')}")
        for line in runner._wrap(s["description"], 70):
            lines.append(f"  {'':<26} {line}")
    lines.append("")
    lines.append("Run one: scripts/reproduce NAME   (see --help for the options)")
    return "\n".join(lines)


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"reproduce: cannot read scenario {path}: {e}") from None
    try:
        return scenarios.validate(data, path)
    except ValueError as e:
        raise SystemExit(f"reproduce: bad scenario: {e}") from None


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--save-json", metavar="FILE",
                   help="also write the results as JSON to FILE (the table is printed as usual)")
    p.add_argument("-w", "--save-flows", metavar="FILE", help="save each column's flows (mitmdump -w)")
    p.add_argument("--timeline", metavar="FILE.svg", help="write an SVG timeline of every column")
    p.add_argument("--columns", help="comma-separated columns to run (default: the scenario's)")
    p.add_argument("--set", action="append", default=[], metavar="turnguard_NAME=VALUE",
                   help="extra turnguard option for every turnguard column (repeatable)")
    p.add_argument("--serial", action="store_true", help="run the columns one after the other")
    p.add_argument("--keep", metavar="DIR", help="keep every log, ledger and events file in DIR")


def _open_output(option: str, path: str) -> int | None:
    """The file ``option`` names, opened to be written once the run ends (its descriptor),
    or None once a line said why it cannot be: never through a symlink, never a device or
    FIFO (see from-capture's -o)."""
    from turnguard_core.private_files import UnsafePath, open_private, shown

    try:
        return open_private(path, os.O_WRONLY, kind="file")
    except UnsafePath as e:
        print(f"reproduce: {option} refused: {e}", file=sys.stderr)
    except OSError as e:
        print(f"reproduce: {option}: cannot write {shown(path)}: {e.strerror}", file=sys.stderr)
    return None


def _write_output(fd: int, text: str) -> None:
    """Write ``text`` over what the file ``fd`` held, and close it."""
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.truncate(0)
        out.write(text)


def _stop_on_sigterm() -> list[bool]:
    """SIGTERM stops a run as ^C does: without this, Python would end at once and leave every
    mitmdump and mock it started running. Before and after the event loop runs, it raises
    ``KeyboardInterrupt``; while it runs, ``_stoppable`` cancels the run instead, as
    ``asyncio.run`` does on ^C (every column then stops what it started, and the work folder
    goes). Never through SIGINT: a shell's background job ignores SIGINT, and then SIGTERM
    did nothing at all. Returns a flag set once SIGTERM came."""
    came: list[bool] = []

    def on_sigterm(signum, frame) -> None:
        came.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    return came


async def _stoppable(run, stopped: list[bool]):
    """Await ``run`` with SIGTERM cancelling it (see ``_stop_on_sigterm``)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    before = signal.getsignal(signal.SIGTERM)

    def on_sigterm() -> None:
        stopped.append(True)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await run
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, before)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["from-capture"]:
        p = argparse.ArgumentParser(prog="reproduce from-capture",
                                    description="Turn a mitmproxy flow file into a scenario file.")
        p.add_argument("flows")
        p.add_argument("-o", "--output", required=True, help="scenario file to write")
        p.add_argument("--keep-bodies", action="store_true",
                       help="keep request bodies and output text verbatim (default: replace "
                            "their content with stable placeholders; duplicates stay duplicates)")
        p.add_argument("--columns", default="plain,default,once")
        p.add_argument("--credential-header", action="append", default=[], metavar="NAME",
                       help="another header whose values are secrets (dropped, as the "
                            "built-in credential headers are); repeatable. Name those the "
                            "proxy's turnguard_credential_headers added")
        a = p.parse_args(argv[1:])
        from mitmproxy.exceptions import FlowReadException
        try:
            scen, summary = capture.scenario_from_flows(
                a.flows, keep_bodies=a.keep_bodies, columns=a.columns.split(","),
                credential_headers=tuple(a.credential_header))
        except (OSError, ValueError) as e:
            print(f"reproduce from-capture: {e}", file=sys.stderr)
            return 2
        except (FlowReadException, MemoryError) as e:
            print(f"reproduce from-capture: {a.flows} is not a mitmproxy flow file "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        from turnguard_core.private_files import UnsafePath, open_private, shown

        try:  # private: it may describe what the capture held. Never through a symlink, never
            # a device or FIFO (-o /dev/null as root would make it 0600): open_private's rules
            fd = open_private(a.output, os.O_WRONLY, kind="file")
            os.ftruncate(fd, 0)  # a regular file that was there: replaced, and made 0600
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(json.dumps(scen, indent=2) + "\n")
        except UnsafePath as e:
            print(f"reproduce from-capture: refused: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"reproduce from-capture: cannot write {shown(a.output)}: {e.strerror}",
                  file=sys.stderr)
            return 2
        print(summary)
        print(f"wrote {a.output}; replay it with: scripts/reproduce run {a.output}")
        return 0
    if argv[:1] == ["show"]:
        p = argparse.ArgumentParser(
            prog="reproduce show", description="Print a built-in scenario as a scenario file "
            "(JSON), to start your own: scripts/reproduce show NAME > mine.json, edit it, then "
            "scripts/reproduce run mine.json.", epilog=_list(),
            formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("name", metavar="NAME", choices=list(scenarios.BUILTIN),
                       help="a built-in scenario (listed below)")
        a = p.parse_args(argv[1:])
        print(json.dumps(scenarios.builtin(a.name), indent=2))
        return 0

    p = argparse.ArgumentParser(
        prog="reproduce", description=__doc__.splitlines()[0],
        usage="reproduce [--list] NAME|run FILE [options]\n"
              "       reproduce show NAME\n"
              "       reproduce from-capture FLOWS_FILE -o SCENARIO.json [--keep-bodies]",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--list", action="store_true", help="list the built-in scenarios")
    p.add_argument("what", nargs="*", help="a built-in scenario name, or: run SCENARIO.json")
    _run_args(p)
    a = p.parse_args(argv)
    if a.list or not a.what:
        print(_list())
        return 0 if a.list else 2
    if a.what[0] == "run":
        if len(a.what) != 2:
            p.error("run needs one scenario file")
        scen = _load(a.what[1])
    elif len(a.what) == 1 and a.what[0] in scenarios.BUILTIN:
        scen = scenarios.validate(scenarios.builtin(a.what[0]))
    else:
        print(f"reproduce: unknown scenario {' '.join(a.what)!r}\n", file=sys.stderr)
        print(_list(), file=sys.stderr)
        return 2
    columns = a.columns.split(",") if a.columns else None
    if columns:
        bad = [c for c in columns if c not in scenarios.COLUMNS]
        if bad:
            p.error(f"unknown columns {bad} (known: {', '.join(scenarios.COLUMNS)})")
    extra = _parse_sets(a.set)
    # the output files are opened before the run: a path it cannot write stops it, not its end
    outputs: dict[str, int] = {}
    for option, path in (("--timeline", a.timeline), ("--save-json", a.save_json)):
        if path:
            opened = _open_output(option, path)
            if opened is None:
                for fd in outputs.values():
                    os.close(fd)
                return 2
            outputs[option] = opened
    tmp = None
    if a.keep:
        workdir = Path(a.keep)
        try:
            runner.private_folder(workdir)  # 0700 if made here, whatever the umask
            if not workdir.is_dir():  # (a file there: the run would fail at its first write)
                raise NotADirectoryError(errno.ENOTDIR, "it is not a folder")
        except OSError as e:
            print(f"reproduce: --keep {a.keep}: cannot make it: {e.strerror or e}",
                  file=sys.stderr)
            for fd in outputs.values():
                os.close(fd)
            return 2
    else:
        tmp = tempfile.mkdtemp(prefix="turnguard-repro-")
        workdir = Path(tmp)
    try:
        for w in runner.stall_warnings(scen, extra):
            print(f"reproduce: WARNING: {w}", file=sys.stderr)
        stopped = _stop_on_sigterm()
        try:
            results = asyncio.run(_stoppable(runner.run_scenario(
                scen, workdir, columns=columns,
                save_flows=Path(a.save_flows).resolve() if a.save_flows else None,
                extra_options=extra, serial=a.serial,
            ), stopped))
        except (KeyboardInterrupt, asyncio.CancelledError):  # every process it started was
            # stopped on the way out (CancelledError: by SIGTERM, see _stoppable)
            print("reproduce: stopped", file=sys.stderr)
            return 128 + (signal.SIGTERM if stopped else signal.SIGINT)
        if "--timeline" in outputs:
            drawn = timeline.render_svg(scen, results)
            _write_output(outputs.pop("--timeline"), drawn)
        as_json = json.dumps(runner.to_json(scen, results, extra), indent=2)
        if "--save-json" in outputs:
            _write_output(outputs.pop("--save-json"), as_json + "\n")
        if a.json:
            print(as_json)
        else:
            print(runner.render_table(scen, results, extra))
            for r in results:
                if r.flows_file:
                    print(f"  flows of {r.title}: {r.flows_file}  (mitmweb -r {r.flows_file})")
            if a.timeline:
                print(f"  timeline: {a.timeline}")
            if a.save_json:
                print(f"  results as JSON: {a.save_json}")
            if a.keep:
                print(f"  logs, ledgers and events files: {workdir}")
    finally:
        for fd in outputs.values():  # the run stopped before they were written
            os.close(fd)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0
