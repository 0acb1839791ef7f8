"""``scripts/bench --profile DIR``: where a turnguard mitmdump spends its time under load.

py-spy (``requirements-bench.txt``) samples the mitmdump process while the bench client drives
one scenario at a time (``--profile-scenarios`` picks some): ``requests`` (32 clients unless
``--profile-clients`` says otherwise, short guarded SSE answers), ``streaming``
(10,000-event responses, one client), ``replay`` (100 KiB replays, 4 clients), ``holds``
(1,000 duplicates of 10 held operations, then the release) and ``ws`` (Responses calls over 8
WebSockets, each one call at a time, in front of the mock upstream, as the ``ws`` phase
drives them). ``requests``, ``streaming`` and ``ws`` are also profiled on plain_stream, and
turnguard's added time per unit is split by function. Each profile is written to
``DIR/<scenario>.txt`` in py-spy's raw (collapsed stack) format, which flamegraph.pl and
speedscope read, and summarised by category: the ledger transactions (admit, first_event,
finish, ...), identity hashing, telemetry (JSON + logging), the tee and SSE parser, the hold
wake-ups, the mitmweb update hook, the rest of the addon, and everything that is not turnguard
(mitmproxy itself, asyncio, the interpreter).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

from turnguard_bench import client, phases, procs, ws_phase
from turnguard_bench.envinfo import environment
from turnguard_bench.report import table
from turnguard_procs import Process, cpu_seconds

PYSPY = shutil.which("py-spy", path=str(procs.MITMDUMP.parent)) or shutil.which("py-spy")
RATE = 200
_FRAME = re.compile(r"^(?P<name>.*) \((?P<path>[^()]*)\)$")

# Threads blocked in these frames use no CPU, yet py-spy samples them as active (a timed
# ``Event.wait`` on the heartbeat thread, an idle ``ThreadPoolExecutor`` worker): such stacks
# are left out of every total, or they would pass for a third of turnguard's time.
IDLE_LEAVES = {("wait", "threading.py"), ("_worker", "thread.py"), ("get", "queue.py")}

HTTP_SCENARIOS = ("requests", "streaming", "replay", "holds")  # against the bench upstream
SCENARIOS = (*HTTP_SCENARIOS, "ws")
WS_SOCKETS = 8

HOLD_FUNCS = {"_wait", "_wake", "_tick_forever", "_wake_gone_flows", "_poll_foreign",
              "_check_cooldown_sessions"}
ADDON_FILES = {"turnguard.py"}


def _frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for f in stack.split(";"):
        m = _FRAME.match(f)
        if m:
            name = m.group("name").rsplit(".", 1)[-1]  # drop the class: Ledger.admit -> admit
            out.append((name, m.group("path")))
        else:
            out.append((f, ""))
    return out


def idle(stack: str) -> bool:
    """Whether the stack is a thread blocked waiting (no CPU), see ``IDLE_LEAVES``."""
    frames = _frames(stack)
    return bool(frames) and (frames[-1][0], Path(frames[-1][1]).name) in IDLE_LEAVES


def _module(path: str) -> str | None:
    """turnguard's module name for a frame's file, or None if the frame is not turnguard's."""
    p = Path(path)
    if p.parent.name == "turnguard_core":
        return p.stem
    if p.name in ADDON_FILES or p.parent.name == "turnguard_shell":  # the shell: the addon's
        return "addon"
    return None


def categorize(stack: str) -> str:
    tg = [(name, _module(path)) for name, path in _frames(stack)]
    tg = [(n, m) for n, m in tg if m is not None]
    if not tg:
        return "not turnguard (mitmproxy, asyncio, interpreter)"
    mods = {m for _, m in tg}
    if "ledger" in mods:
        names = [n for n, m in tg if m == "ledger" and n not in ("wrapper", "_wrap")]
        return f"ledger.{names[0]}" if names else "ledger"
    if "telemetry" in mods:
        return "telemetry (JSON + logging)"
    if "identity" in mods:
        return "identity (JSON parse + hashes)"
    if "sse" in mods or "tee" in mods:
        return "tee + SSE parsing"
    addon = [n for n, m in tg if m == "addon"]
    inner = addon[-1] if addon else tg[-1][0]
    if inner == "_show":
        return "addon._show (mitmweb UpdateHook trigger)"
    if inner in HOLD_FUNCS:
        return "holds (wait, wake, tick)"
    if any(m not in ("addon",) for m in mods):
        return "core: " + ",".join(sorted(m for m in mods if m != "addon"))
    return f"addon.{inner}"


def analyze(raw_path: Path) -> dict:
    """Samples per category and per leaf function inside turnguard, from a raw py-spy file."""
    cats: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for line in raw_path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        if idle(stack):
            continue
        total += n
        cat = categorize(stack)
        cats[cat] += n
        if not cat.startswith("not turnguard"):
            frames = _frames(stack)
            leaf = frames[-1]
            leaves[f"{leaf[0]} ({Path(leaf[1]).name})"] += n
    return {"samples": total, "categories": dict(cats.most_common()),
            "turnguard_leaves": dict(leaves.most_common(25))}


def inclusive(raw_path: Path) -> Counter[str]:
    """Samples per function (name and file name), counting each function once per stack."""
    out: Counter[str] = Counter()
    for line in raw_path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or idle(stack):
            continue
        seen = {f"{n} ({Path(p).name})" for n, p in _frames(stack)}
        for k in seen:
            out[k] += int(count)
    return out


def diff_table(tg: dict, base: dict, top: int = 25, unit: str = "request") -> str:
    """Inclusive CPU ms per ``unit`` of each function, turnguard minus plain_stream: where the
    added time goes, including mitmproxy's own work on turnguard's behalf (hook dispatch,
    streaming, logging of telemetry lines)."""
    a, b = inclusive(Path(tg["raw"])), inclusive(Path(base["raw"]))
    na, nb = tg["units"]["count"] or 1, base["units"]["count"] or 1
    ms_a = {k: v / RATE * 1000 / na for k, v in a.items()}
    ms_b = {k: v / RATE * 1000 / nb for k, v in b.items()}
    # Leave out the frames every sample has (the event loop's, mitmdump's main).
    root_a, root_b = max(ms_a.values(), default=0), max(ms_b.values(), default=0)
    keys = [k for k in set(ms_a) | set(ms_b)
            if not (ms_a.get(k, 0) >= 0.97 * root_a and ms_b.get(k, 0) >= 0.97 * root_b)]
    keys.sort(key=lambda k: -(ms_a.get(k, 0) - ms_b.get(k, 0)))
    d = 4 if unit == "event" else 3  # an event costs microseconds
    rows = [[k, f"{ms_a.get(k, 0):.{d}f}", f"{ms_b.get(k, 0):.{d}f}",
             f"{ms_a.get(k, 0) - ms_b.get(k, 0):+.{d}f}"] for k in keys[:top]]
    return table(rows, ["function (inclusive)", f"turnguard ms/{unit}",
                        f"plain_stream ms/{unit}", "added"])


class Spy:
    """py-spy recording one process; ``stop()`` ends it early (SIGINT makes it write)."""

    def __init__(self, pid: int, out: Path, max_s: float):
        if PYSPY is None:
            raise RuntimeError("py-spy not found: scripts/bench installs it "
                               "(requirements-bench.txt)")
        self.out = out
        self.process = Process(
            [PYSPY, "record", "-p", str(pid), "-f", "raw", "-o", str(out), "-r", str(RATE),
             "-d", str(int(max_s) + 1), "--nolineno", "--full-filenames"],
            out.with_suffix(".pyspy.log"),
        )
        procs.register(self)

    def stop(self) -> None:
        """One SIGINT (py-spy writes its profile then), up to 30 s, then SIGKILL."""
        procs.forget(self)
        self.process.stop(30, signal.SIGINT)


async def _profiled(p: procs.Proc, outdir: Path, name: str, max_s: float, work) -> dict:
    raw = outdir / f"{name}.txt"
    spy = Spy(p.pid, raw, max_s + 15)
    await asyncio.sleep(1.0)  # py-spy attaches
    cpu0, t0 = cpu_seconds(p.pid), time.monotonic()
    try:
        units = await work()
    finally:
        cpu1, t1 = cpu_seconds(p.pid), time.monotonic()
        spy.stop()
    res = analyze(raw) if raw.exists() else {"samples": 0, "categories": {}, "turnguard_leaves": {}}
    res.update({"scenario": name, "units": units, "cpu_s": cpu1 - cpu0, "wall_s": t1 - t0,
                "raw": str(raw)})
    return res


def render(res: dict, unit_name: str) -> str:
    total = res["samples"] or 1
    units = res["units"]["count"] or 1
    # The profile covers 1 s more than the load (py-spy attaching), all of it busy time only;
    # the CPU per unit uses /proc over the load itself.
    cpu_ms = res["cpu_s"] * 1000 / units
    rows = []
    for cat, n in res["categories"].items():
        rows.append([cat, f"{n}", f"{n / total * 100:.1f}%", f"{n / total * cpu_ms:.3f}"])
    tg = sum(n for c, n in res["categories"].items() if not c.startswith("not turnguard"))
    rows.append(["= turnguard in all", f"{tg}", f"{tg / total * 100:.1f}%",
                 f"{tg / total * cpu_ms:.3f}"])
    out = [f"\n== profile '{res['scenario']}': {units:,} {unit_name} in {res['wall_s']:.1f} s, "
           f"{res['cpu_s']:.2f} CPU s = {cpu_ms:.3f} CPU ms per {unit_name.rstrip('s')} "
           f"(under py-spy); {res['samples']} busy samples at {RATE} Hz",
           table(rows, ["category", "samples", "share", f"CPU ms/{unit_name.rstrip('s')}"])]
    leaves = [[k, str(v), f"{v / total * 100:.1f}%"] for k, v in res["turnguard_leaves"].items()]
    if leaves:
        out.append("innermost Python frames of the turnguard samples (self time):")
        out.append(table(leaves[:15], ["function (file)", "samples", "share"]))
    return "\n".join(out)


async def _profile_into(results: dict, p: procs.Proc, outdir: Path, name: str,
                        seconds: float, work, unit: str) -> None:
    phases.log(f"profiling '{name}' ...")
    r = await _profiled(p, outdir, name, seconds + 70, work)
    r["unit"] = unit
    results[name] = r
    print(render(r, unit), flush=True)


async def _profile_ws(results: dict, workdir: Path, outdir: Path, seconds: float) -> None:
    """The ``ws`` scenario: turnguard and plain_stream each relaying calls on ``WS_SOCKETS``
    sockets to the mock upstream (it speaks Responses over WebSocket)."""
    up = procs.start_mock_upstream(workdir, "profile-ws-upstream")
    ms = procs.start_mitmdumps(workdir, up.url, {"profile-ws-turnguard": ("turnguard", {}),
                                                 "profile-ws-plain_stream": ("plain_stream", {})})

    async def calls(target: procs.Proc) -> dict:
        s = await ws_phase.calls(target.port, WS_SOCKETS, 10**6, "profw-" + uuid.uuid4().hex[:8],
                                 time.monotonic() + seconds)
        return {"count": s["completed"]}

    try:
        for variant in ("plain_stream", "turnguard"):
            p = ms[f"profile-ws-{variant}"]
            await ws_phase.calls(p.port, 1, 20, "profw-warm-" + uuid.uuid4().hex[:8],
                                 time.monotonic() + 30)
            name = "ws" if variant == "turnguard" else "ws-plain_stream"
            await _profile_into(results, p, outdir, name, seconds, lambda p=p: calls(p), "calls")
            p.stop()
    finally:
        for p in ms.values():
            p.stop()
        up.stop()


async def _profile_http(results: dict, workdir: Path, outdir: Path, seconds: float, *,
                        clients: int, scenarios: tuple[str, ...]) -> None:
    """The HTTP scenarios named in ``scenarios``, against the bench upstream."""
    up = procs.start_upstream(workdir)
    ms = procs.start_mitmdumps(workdir, up.url, {
        "profile-turnguard": ("turnguard", {"turnguard_replay_max_bytes": 16 * 2**20,
                                            "turnguard_hold_timeout_ms": 120000}),
        "profile-plain_stream": ("plain_stream", {}),
    })
    p, base = ms["profile-turnguard"], ms["profile-plain_stream"]
    try:
        await phases.warm(p, 300)

        async def requests(target=p):
            nonce = "prof-" + uuid.uuid4().hex[:8]
            load = await client.run_load(
                target.port, lambda i: phases.model_request(nonce, i, session=f"s{i % 64}"),
                10**7, clients, time_limit_s=seconds)
            return {"count": sum(r.error is None for r in load.results)}

        async def streaming(target=p):
            nonce = "profs-" + uuid.uuid4().hex[:8]
            load = await client.run_load(
                target.port, lambda i: phases.model_request(nonce, i, extra={"x-bench-events": "10000"}),
                10**6, 1, time_limit_s=seconds)
            return {"count": sum(r.events for r in load.results if r.error is None)}

        async def replay():
            nonce = "profr-" + uuid.uuid4().hex[:8]
            raw = phases.model_request(nonce, 0, extra={"x-bench-bytes": str(100 * 1024)})
            await client.run_load(p.port, lambda i: raw, 1, 1, time_limit_s=30)
            await asyncio.sleep(0.3)
            load = await client.run_load(p.port, lambda i: raw, 10**7, 4, time_limit_s=seconds)
            return {"count": sum(r.headers.get("x-turnguard") == "replayed"
                                 for r in load.results if r.error is None)}

        async def holds():
            nonce = "profh-" + uuid.uuid4().hex[:8]
            n_ops, per_op = 10, 100
            await client.get_json(up.port, "/_bench/reset", "POST")
            mk = lambda k, tag: phases.model_request(  # noqa: E731
                nonce, k, session=f"h{k}", extra={"x-bench-hold": "1", "x-bench-id": tag,
                                                  "x-bench-op": str(k)})
            tasks = await client.open_and_send(p.port, [(("o", k), mk(k, f"o{k}")) for k in range(n_ops)])
            await asyncio.sleep(0.5)
            tasks += await client.open_and_send(
                p.port, [(("d", k, j), mk(k, f"d{k}-{j}")) for j in range(per_op) for k in range(n_ops)])
            await asyncio.sleep(3.0)  # held: what does a hold cost?
            await client.get_json(up.port, "/_bench/release", "POST")
            done, pending = await asyncio.wait(tasks, timeout=60)
            for t in pending:
                t.cancel()
            return {"count": sum(1 for t in done if t.result().error is None)}

        plan = [(name, work, unit) for name, work, unit in (
            ("requests", requests, "requests"), ("streaming", streaming, "events"),
            ("replay", replay, "replays"), ("holds", holds, "answers")) if name in scenarios]
        compared = [(name, work, unit) for name, work, unit in plan
                    if name in ("requests", "streaming")]
        if compared:
            await phases.warm(base, 300)
            for name, work, unit in compared:
                await _profile_into(results, base, outdir, f"{name}-plain_stream", seconds,
                                    lambda work=work: work(base), unit)
        base.stop()
        for name, work, unit in plan:
            await _profile_into(results, p, outdir, name, seconds, work, unit)
    finally:
        for proc in (p, base, up):
            proc.stop()


async def _main(workdir: Path, outdir: Path, seconds: float, addon_from: str, *,
                clients: int, scenarios: tuple[str, ...] = SCENARIOS) -> dict:
    outdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": {**environment(), "addon_from": addon_from,
                                     "requests_clients": clients, "scenarios": list(scenarios)}}
    env = results["environment"]
    print(f"profiling turnguard: git {env['git']}, addon from {addon_from}, sha256 {env['addon_sha256']}, "
          f"load average {env['loadavg_before']}; scenarios {','.join(scenarios)}; "
          f"'requests' with {clients} client{'s' * (clients != 1)}", flush=True)
    try:
        if set(scenarios) & set(HTTP_SCENARIOS):
            await _profile_http(results, workdir, outdir, seconds, clients=clients,
                                scenarios=scenarios)
        if "ws" in scenarios:
            await _profile_ws(results, workdir, outdir, seconds)
        for name, unit in (("requests", "request"), ("streaming", "event"), ("ws", "call")):
            if f"{name}-plain_stream" in results and name in results:
                print(f"\n== where turnguard's added CPU per {unit} goes in '{name}', by function "
                      "(inclusive; under py-spy; a function's time includes what it calls)")
                print(diff_table(results[name], results[f"{name}-plain_stream"], unit=unit))
    finally:
        procs.stop_all()
    (outdir / "summary.json").write_text(json.dumps(results, indent=2))
    print(f"\nraw profiles and summary.json in {outdir} (collapsed stacks: flamegraph.pl or "
          "speedscope read them)")
    return results


async def run(cfg, workdir: Path, outdir: Path, seconds: float, addon_from: str, *,
              clients: int = 32, scenarios: tuple[str, ...] = SCENARIOS) -> int:
    res = await _main(workdir, outdir, seconds, addon_from, clients=clients,
                      scenarios=scenarios)
    return 0 if res else 1
