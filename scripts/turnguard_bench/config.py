"""Counts of the quick (CI smoke) and full benchmark modes."""

from __future__ import annotations

from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 * 1024

PHASES = ("per_request", "streaming", "holds", "replay", "hooks", "ws", "relay", "ledger",
          "soak", "micro", "instructions", "calls")
# instructions runs each variant under valgrind (minutes of CPU), calls under Python's
# profiler (a tool for a change, not a figure of the report): only when asked for
DEFAULT_PHASES = tuple(p for p in PHASES if p not in ("instructions", "calls"))
INSTRUCTIONS_VARIANTS = ("plain_stream", "floor", "ledger_floor", "turnguard")


@dataclass
class Config:
    mode: str
    repeats: int  # repeats of the per-request, streaming and replay measurements
    warmup: int  # requests per mitmdump before measuring
    per_request: dict[int, int]  # concurrent clients -> requests per repeat
    stream: dict[int, int]  # events per response -> responses per repeat
    replay: dict[int, int]  # body bytes (0: the 8-event SSE stream) -> replays per repeat
    replay_concurrency: int
    holds_ops: int
    holds_dups_per_op: int
    hold_s: float
    holds_repeats: int
    ledger_claims_1: int  # admissions in the one-process run
    ledger_claims_4: int  # admissions per process in the four-process run
    exactly_once_n: int  # identical identities admitted by each of four processes
    ledger_scale_points: list[int]  # operations in the ledger at each point of the scale curve
    soak_checkpoints: list[int]  # guarded requests done at each RSS reading
    soak_concurrency: int
    soak_baseline: bool  # also soak plain mitmdump
    micro_scale: int
    relay: dict[int, int] = field(default_factory=lambda: {1: 60, 8: 150})  # clients -> requests
    hooks: dict[str, int] = field(default_factory=lambda: {"replay": 3200, "dispatch": 3200})
    ws: dict[int, int] = field(default_factory=lambda: {1: 600, 8: 2000})  # sockets -> calls
    wake_trials: int = 100  # held duplicates woken on PostgreSQL (p50/p99 of the wake-up)
    instructions: int = 200  # requests counted under callgrind, per variant
    instructions_variants: tuple[str, ...] = INSTRUCTIONS_VARIANTS
    instructions_sim: bool = False  # also simulate caches and branch prediction (about 2x slower)
    calls: int = 1000  # requests counted under Python's profiler, per variant
    calls_variants: tuple[str, ...] = ("plain_stream", "ledger_floor", "turnguard")
    request_timeout_s: float = 60.0
    load_time_limit_s: float = 120.0
    phases: tuple[str, ...] = field(default=DEFAULT_PHASES)


def quick() -> Config:
    """A smoke test (CI runs it, checking counts, never timings): every phase and variant
    once, at the smallest counts that still exercise each (128 clients get 128 requests), so
    that it stays near a minute of CPU on 2 cores."""
    return Config(
        mode="quick",
        repeats=1,
        warmup=5,
        per_request={1: 10, 8: 24, 32: 64, 128: 128},
        stream={1000: 1, 10000: 1},
        replay={0: 12, 1 * KiB: 6, 100 * KiB: 4, 5 * MiB: 1},
        replay_concurrency=4,
        holds_ops=3,
        holds_dups_per_op=20,
        hold_s=1.0,
        holds_repeats=1,
        ledger_claims_1=500,
        ledger_claims_4=100,
        exactly_once_n=100,
        ledger_scale_points=[500, 2000],
        wake_trials=10,
        hooks={"replay": 100, "dispatch": 100},
        relay={1: 15, 8: 40},
        ws={1: 20, 8: 48},
        instructions=20,
        instructions_variants=("plain_stream", "turnguard"),
        calls=40,
        calls_variants=("ledger_floor", "turnguard"),
        soak_checkpoints=[100, 400],
        soak_concurrency=16,
        soak_baseline=False,
        micro_scale=1,
        load_time_limit_s=30.0,
    )


def full() -> Config:
    return Config(
        mode="full",
        relay={1: 500, 8: 2000, 32: 3000},
        repeats=3,
        warmup=200,
        per_request={1: 500, 8: 2000, 32: 3000, 128: 4000},
        stream={1000: 20, 10000: 6},
        replay={0: 1000, 1 * KiB: 400, 100 * KiB: 200, 5 * MiB: 20},
        replay_concurrency=4,
        holds_ops=100,  # 10,000 held duplicates
        holds_dups_per_op=100,
        hold_s=10.0,
        holds_repeats=1,
        ledger_claims_1=20000,
        ledger_claims_4=10000,
        exactly_once_n=3000,
        ledger_scale_points=[10_000, 100_000, 1_000_000],
        soak_checkpoints=[10000, 25000, 50000, 75000, 100000],
        soak_concurrency=16,
        soak_baseline=True,
        micro_scale=10,
    )
