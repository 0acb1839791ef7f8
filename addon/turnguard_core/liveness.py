"""Is a peer process (another turnguard instance sharing the ledger) gone for good?

Reaping a live peer's attempt makes its operation run twice upstream, so a peer is declared
dead only with proof. The proof is its process identity, recorded when it registered:

- ``boot_id``: the kernel's boot id (``/proc/sys/kernel/random/boot_id``): the same value means
  the same running kernel, so pid namespaces and process start times can be compared;
- ``pid_ns``: its pid namespace (``/proc/self/ns/pid``): pids mean something only inside it;
- ``pid`` and ``start_ticks``: its pid and start time (field 22 of ``/proc/PID/stat``), so a
  reused pid is told apart from the peer.

A peer on the same kernel and in the same pid namespace is dead when its pid is gone or now
belongs to a process started at another time. Any other peer (another host, another container's
pid namespace, a system without ``/proc``) cannot be proven dead: it is dead only when it has
not renewed its lease (a heartbeat, written from a thread of its own, off the event loop) for
``lease_s``, a time far longer than any stall turnguard can bound. A stall of the peer itself
(paused, event loop blocked, ledger locked, reloading) is never proof.

How long a peer has been silent is measured by the process that judges it, on its own
monotonic clock, from when it first saw the peer's heartbeat at the value it still has
(``Silences``): never by comparing the peer's heartbeat time (the peer's wall clock) with the
judge's wall clock. Wall clocks step (NTP, a VM resumed, a laptop waking) and differ between
hosts: a judge whose clock ran an hour ahead would take a live peer for an hour silent and run
its turns again, one whose clock went back would keep a dead peer's turns in flight for an hour.

``verdict`` and ``Silences`` are pure; ``read_process_identity`` and ``probe_start_ticks`` read
``/proc``.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Literal

from .records import record

Verdict = Literal["alive", "dead", "stale"]


@record
class ProcessIdentity:
    """Who a turnguard process is, as far as other processes can check. Empty strings and
    ``None`` when the system cannot tell (no ``/proc``)."""

    host: str
    boot_id: str
    pid_ns: str
    pid: int
    start_ticks: int | None


@record
class PeerRow:
    """A registered instance, as the ledger has it."""

    instance_id: str
    identity: ProcessIdentity
    heartbeat_at: float


class Silences:
    """How long each peer has been silent, as this process saw it: the time (``now``, this
    process's ``time.monotonic()``) since it first read the peer's heartbeat at the value it
    still has. A heartbeat that changed, forwards or backwards (the peer's clock stepped), is a
    sign of life. A peer first seen now has been silent for 0 s: a process that starts (or
    reloads) waits a whole lease before it takes a peer it cannot check for gone."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, float]] = {}  # instance -> (heartbeat_at, since)

    def silent_s(self, peer: PeerRow, now: float) -> float:
        seen = self._seen.get(peer.instance_id)
        if seen is None or seen[0] != peer.heartbeat_at:
            self._seen[peer.instance_id] = (peer.heartbeat_at, now)
            return 0.0
        return max(0.0, now - seen[1])

    def keep_only(self, instance_ids: set[str]) -> None:
        """Forget the peers no longer read (reaped, or no attempt in flight any more)."""
        for gone in self._seen.keys() - instance_ids:
            del self._seen[gone]


def verdict(
    peer: PeerRow, *, me: ProcessIdentity, now: float, lease_s: float,
    start_ticks_of: Callable[[int], int | None], silent_s: float | None = None,
) -> Verdict:
    """``dead``: proven gone (same kernel and pid namespace, and its pid is gone or reused);
    ``stale``: cannot be proven either way and its lease ran out (``lease_s`` without a
    heartbeat): treat as dead; ``alive`` otherwise. ``start_ticks_of(pid)`` is the start time
    of a pid in this pid namespace, or None when no such process exists.

    ``silent_s``: how long this process has seen the peer's heartbeat unchanged
    (``Silences``); what a process that reaps must give. Without it the silence is
    ``now - peer.heartbeat_at``, the peer's wall clock against ``now``: good only for a view
    (``scripts/turnguard status``), never to reap on (see the module docstring)."""
    theirs = peer.identity
    comparable = (
        bool(me.boot_id) and theirs.boot_id == me.boot_id
        and bool(me.pid_ns) and theirs.pid_ns == me.pid_ns
        and theirs.start_ticks is not None and theirs.pid > 0
    )
    if comparable:
        return "dead" if start_ticks_of(theirs.pid) != theirs.start_ticks else "alive"
    if (now - peer.heartbeat_at if silent_s is None else silent_s) > lease_s:
        return "stale"
    return "alive"


def proven_alive(
    peer: PeerRow, *, me: ProcessIdentity, start_ticks_of: Callable[[int], int | None],
) -> bool:
    """Whether ``peer`` is proven alive: on this host and in this pid namespace, with its pid
    still the process it was (its start time unchanged). However long it has been silent (a
    process paused by SIGSTOP is alive). A peer that cannot be compared is never proven."""
    theirs = peer.identity
    return (bool(me.boot_id) and theirs.boot_id == me.boot_id
            and bool(me.pid_ns) and theirs.pid_ns == me.pid_ns
            and theirs.start_ticks is not None and theirs.pid > 0
            and start_ticks_of(theirs.pid) == theirs.start_ticks)


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_ticks(stat: str) -> int | None:
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3
    except (IndexError, ValueError):
        return None


def probe_start_ticks(pid: int) -> int | None:
    """The start time (clock ticks since boot) of process ``pid`` in this pid namespace, or
    None when there is no such process (or no ``/proc``)."""
    return _start_ticks(_read(f"/proc/{pid}/stat"))


def read_process_identity() -> ProcessIdentity:
    """This process's identity (see the module docstring). The pid namespace is left empty
    (so peers fall back to the lease) when ``/proc`` is not this pid namespace's own, since
    pids looked up there would be another namespace's."""
    pid = os.getpid()
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
        if int(os.readlink("/proc/self")) != pid:
            pid_ns = ""
    except (OSError, ValueError):
        pid_ns = ""
    return ProcessIdentity(
        host=socket.gethostname(),
        boot_id=_read("/proc/sys/kernel/random/boot_id"),
        pid_ns=pid_ns,
        pid=pid,
        start_ticks=_start_ticks(_read("/proc/self/stat")),
    )
