"""scripts/bench: turnguard side by side with plain mitmdump, on one loopback upstream.

    scripts/bench [--quick] [--json FILE] [--phases LIST] [--set K=V] [--addon-rev REV]
                  [--baseline-rev REV] [--keep]
    scripts/bench --profile DIR [--profile-seconds S] [--profile-clients N]
                  [--profile-scenarios LIST] [--addon-rev REV]

Prints a table (absolute figures and turnguard/plain ratios) and the targets of issue 5; with
``--json FILE`` also writes every measurement. The exit status is 1 when a correctness check
failed (a request without an answer, a non-200, an incomplete stream, a second dispatch of a
held operation, a replay that was not byte-identical, the exactly-once check), never because of
a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from turnguard_bench import (calls_phase, config, hooks_phase, instructions_phase, ledger_bench,
                             micro, phases, procs, profiling, relay_phase, report, ws_phase)
from turnguard_bench.envinfo import environment, loadavg

THROUGHPUT_PHASES = ("per_request", "streaming", "replay")


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 65536)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def failed_checks(res: dict) -> list[str]:
    bad = []
    for phase, data in res.items():
        if isinstance(data, dict):
            checks = data.get("checks")
            if isinstance(checks, dict):
                bad += [f"{phase}.{k}" for k, v in checks.items() if v is False]
            if phase == "ledger" and not data["exactly_once"]["passed"]:
                bad.append("ledger.exactly_once")
    return bad


async def run_all(cfg: config.Config, workdir: Path) -> dict:
    res: dict = {"mode": cfg.mode, "environment": environment(), "config": cfg.__dict__.copy(),
                 "common_options": dict(procs.COMMON_OPTIONS)}
    t0 = time.monotonic()
    up = procs.start_upstream(workdir)
    try:
        if any(p in cfg.phases for p in THROUGHPUT_PHASES):
            dispatches = "per_request" in cfg.phases or "streaming" in cfg.phases
            phases.log("starting plain, plain_stream, the floors and turnguard mitmdumps")
            ms = procs.start_mitmdumps(workdir, up.url, {
                "plain": ("plain", {}),
                "plain_stream": ("plain_stream", {}),
                "floor": ("floor", {}),
                **({"ledger_floor": ("ledger_floor", {})} if dispatches else {}),
                # replay of the 5 MiB case needs a cap above 5 MiB (the default is 8 MiB)
                "turnguard": ("turnguard", {"turnguard_replay_max_bytes": 16 * 2**20}),
                **({"turnguard_baseline": ("turnguard_baseline",
                                           {"turnguard_replay_max_bytes": 16 * 2**20})}
                   if procs.has_baseline() else {}),
                **({"answer_floor": ("answer_floor", {})} if "replay" in cfg.phases else {}),
            })
            # the answer floor only replays: the phases of dispatched requests leave it out;
            # the ledger floor only dispatches: the replay phase leaves it out
            dispatching = {k: p for k, p in ms.items() if k != "answer_floor"}
            replaying = {k: p for k, p in ms.items() if k != "ledger_floor"}
            res["commands"] = {name: p.extra["cmd"] for name, p in ms.items()}
            try:
                for p in ms.values():
                    await phases.warm(p, cfg.warmup)
                if "per_request" in cfg.phases:
                    res["per_request"] = await phases.per_request(cfg, up, dispatching)
                if "streaming" in cfg.phases:
                    res["streaming"] = await phases.streaming(cfg, up, dispatching)
                if "replay" in cfg.phases:
                    res["replay"] = await phases.replay(cfg, up, replaying)
            finally:
                for p in ms.values():
                    p.stop()
        if "holds" in cfg.phases:
            res["holds"] = await phases.holds(cfg, workdir)
        if "hooks" in cfg.phases:
            phases.log("inside mitmdump: turnguard's hooks and their parts, timed")
            res["hooks"] = await hooks_phase.hooks(cfg, workdir, up)
        if "ws" in cfg.phases:
            phases.log("Responses over WebSocket: turnguard vs plain mitmdump relaying sockets")
            res["ws"] = await ws_phase.ws(cfg, workdir)
        if "relay" in cfg.phases:
            phases.log("the relay's cost: detached dispatches vs direct ones")
            res["relay"] = await relay_phase.relay(cfg, workdir, up)
        if "ledger" in cfg.phases:
            phases.log("ledger claims and the exactly-once check")
            res["ledger"] = await asyncio.to_thread(ledger_bench.run, workdir, cfg)
        if "soak" in cfg.phases:
            res["soak"] = await phases.soak(cfg, workdir, up)
        if "micro" in cfg.phases:
            phases.log("micro-benchmarks of the core")
            res["micro"] = await asyncio.to_thread(micro.run, workdir, cfg)
        if "instructions" in cfg.phases:
            phases.log("instructions per request, counted under callgrind")
            res["instructions"] = await instructions_phase.instructions(cfg, workdir, up)
        if "calls" in cfg.phases:
            phases.log("Python calls per request, counted under Python's profiler")
            res["calls"] = await calls_phase.calls(cfg, workdir, up)
    finally:
        up.stop()
    res["duration_s"] = time.monotonic() - t0
    res["environment"]["loadavg_after"] = loadavg()
    res["targets"] = report.targets(res)
    res["failed_checks"] = failed_checks(res)
    return res


def parse(argv: list[str] | None = None):
    """The command line, checked as a whole (argparse's usage error, exit status 2, for any
    problem): (args, the run's config, the profiled scenarios). Runs nothing, so that the
    README's commands can be checked against it."""
    p = argparse.ArgumentParser(
        prog="scripts/bench",
        description="turnguard's benchmark suite: turnguard side by side with plain mitmdump "
                    "(buffered and streaming) on one loopback upstream; a table plus JSON.",
    )
    p.add_argument("--quick", action="store_true",
                   help="small counts (CI smoke test, about 1.5 minutes); default: the full mode "
                        "(about 15 minutes on 2 cores)")
    p.add_argument("--json", metavar="FILE", help="also write every measurement to FILE")
    p.add_argument("--phases", metavar="LIST",
                   help=f"comma-separated subset of {','.join(config.PHASES)} (default: all "
                        "but instructions, which counts each variant's instructions per request "
                        "under valgrind: minutes of CPU, the same counts on a busy machine; and "
                        "calls, which counts each variant's Python calls per request by "
                        "function under Python's profiler: what runs, for a change)")
    p.add_argument("--repeats", type=int, help="override the number of repeats")
    p.add_argument("--instructions-sim", action="store_true",
                   help="with the instructions phase: also simulate the caches and the branch "
                        "predictor under callgrind (misses and mispredictions a request, and "
                        "cycles estimated from them; about twice the phase's time)")
    p.add_argument("--instructions-variants", metavar="LIST",
                   help="with the instructions phase: count only these variants, a "
                        f"comma-separated subset of {','.join(config.INSTRUCTIONS_VARIANTS)} "
                        "(default: those; turnguard alone takes a quarter of the time: with "
                        "--addon-rev, what a change moves)")
    p.add_argument("--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="a mitmproxy/turnguard option for every mitmdump variant alike, e.g. "
                        "--set connection_strategy=lazy (repeatable; recorded in the JSON)")
    p.add_argument("--addon-rev", metavar="REV",
                   help="measure addon/ as committed at this git revision instead of the "
                        "working tree (the working tree is copied at start either way, so edits "
                        "during a run change nothing)")
    p.add_argument("--baseline-rev", metavar="REV",
                   help="also measure addon/ as committed at REV as the variant "
                        "turnguard_baseline, in the same rounds as turnguard (per_request, "
                        "streaming and replay phases), with the ratio turnguard / "
                        "turnguard_baseline: how a change moves turnguard, free of the "
                        "machine's drift from one run to the next")
    p.add_argument("--keep", action="store_true",
                   help="keep the work folder (logs, ledgers) and print its path")
    p.add_argument("--profile", metavar="DIR",
                   help="instead of the benchmark: profile a turnguard mitmdump with py-spy under "
                        "per-request load, streaming, replay, a hold release and calls over "
                        "WebSockets; write the "
                        "collapsed stacks to DIR and print where turnguard's time goes")
    p.add_argument("--profile-seconds", type=float, default=20.0,
                   help="seconds of load per profiled scenario (default 20)")
    p.add_argument("--profile-clients", type=int, default=32,
                   help="concurrent clients of the profiled per-request load (default 32; 1: "
                        "no batching, each request alone)")
    p.add_argument("--profile-scenarios", metavar="LIST",
                   default=",".join(profiling.SCENARIOS),
                   help="comma-separated subset of the profiled scenarios "
                        f"{','.join(profiling.SCENARIOS)} (default: all)")
    args = p.parse_args(argv)

    if args.profile_clients < 1:
        p.error(f"--profile-clients wants 1 or more, not {args.profile_clients}")
    scenarios = tuple(x.strip() for x in args.profile_scenarios.split(",") if x.strip())
    if not scenarios or set(scenarios) - set(profiling.SCENARIOS):
        p.error(f"--profile-scenarios wants some of {','.join(profiling.SCENARIOS)}, "
                f"not {args.profile_scenarios!r}")
    cfg = config.quick() if args.quick else config.full()
    if args.phases:
        wanted = tuple(x.strip() for x in args.phases.split(",") if x.strip())
        unknown = set(wanted) - set(config.PHASES)
        if unknown:
            p.error(f"unknown phases {sorted(unknown)}; known: {','.join(config.PHASES)}")
        cfg.phases = wanted
    if args.instructions_sim and "instructions" not in cfg.phases:
        p.error("--instructions-sim goes with --phases instructions")
    cfg.instructions_sim = args.instructions_sim
    if args.instructions_variants is not None:
        if "instructions" not in cfg.phases:
            p.error("--instructions-variants goes with --phases instructions")
        variants = tuple(x.strip() for x in args.instructions_variants.split(",") if x.strip())
        if not variants or set(variants) - set(config.INSTRUCTIONS_VARIANTS):
            p.error(f"--instructions-variants wants some of "
                    f"{','.join(config.INSTRUCTIONS_VARIANTS)}, not {args.instructions_variants!r}")
        cfg.instructions_variants = variants
    if args.repeats:
        cfg.repeats = args.repeats
        cfg.holds_repeats = args.repeats
    for kv in args.options:
        key, sep, _ = kv.partition("=")
        if not sep or not key:
            p.error(f"--set wants KEY=VALUE, not {kv!r}")
    # what the run writes at its end (--json) or makes at its start (--profile, with its
    # missing parents): a path it cannot use is said now, not after minutes of measuring
    if args.json and not _writable_folder(Path(args.json).resolve().parent, make=False):
        p.error(f"--json {args.json}: its folder is not one this user can write in")
    if args.profile and not _writable_folder(Path(args.profile).resolve(), make=True):
        p.error(f"--profile {args.profile}: cannot be made, or is not a folder this user can "
                "write in")
    return args, cfg, scenarios


def _writable_folder(folder: Path, *, make: bool) -> bool:
    """``folder`` is a folder this user can write in, or (``make``) it can be made: its
    nearest existing ancestor is one."""
    while make and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def main(argv: list[str] | None = None) -> int:
    args, cfg, scenarios = parse(argv)

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    for kv in args.options:
        key, _, value = kv.partition("=")
        procs.COMMON_OPTIONS[key] = value
    signal.signal(signal.SIGTERM, on_term)
    _raise_nofile()
    workdir = Path(tempfile.mkdtemp(prefix="turnguard-bench-"))
    try:
        procs.snapshot_addon(workdir, args.addon_rev)
        if args.baseline_rev:
            procs.snapshot_baseline(workdir, args.baseline_rev)
        if args.profile:
            return asyncio.run(profiling.run(
                cfg, workdir, Path(args.profile), args.profile_seconds,
                f"git {args.addon_rev}" if args.addon_rev else "working tree",
                clients=args.profile_clients, scenarios=scenarios))
        res = asyncio.run(run_all(cfg, workdir))
        if args.addon_rev:
            res["environment"]["addon_from"] = f"git {args.addon_rev}"
        if args.baseline_rev:
            res["environment"]["baseline_from"] = f"git {args.baseline_rev}"
        print(report.render(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2, default=str))
            print(f"JSON written to {args.json}")
        if res["failed_checks"]:
            print(f"FAILED checks: {', '.join(res['failed_checks'])}", file=sys.stderr)
            return 1
        return 0
    finally:
        procs.stop_all()
        if args.keep:
            print(f"work folder kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
