"""Liveness by proof (``liveness``): when a peer process counts as gone."""

from __future__ import annotations

import os
import subprocess
import sys

from turnguard_core import liveness
from turnguard_core.liveness import PeerRow, ProcessIdentity, verdict

ME = ProcessIdentity("host", "boot-1", "pid:[1]", 100, 5000)


def peer(**changes) -> PeerRow:
    fields = {"host": "host", "boot_id": "boot-1", "pid_ns": "pid:[1]", "pid": 200,
              "start_ticks": 7000, **changes}
    return PeerRow("peer", ProcessIdentity(**fields), heartbeat_at=1000.0)


def judge(row: PeerRow, *, now: float = 1001.0, running: dict[int, int] | None = None) -> str:
    running = {200: 7000} if running is None else running
    return verdict(row, me=ME, now=now, lease_s=300, start_ticks_of=running.get)


def test_a_peer_in_this_kernel_and_pid_namespace_is_judged_by_its_pid_only():
    assert judge(peer()) == "alive"
    assert judge(peer(), now=1e9) == "alive"  # silent for ages but running: a stall, not death
    assert judge(peer(), running={}) == "dead"  # its pid is gone
    assert judge(peer(), running={200: 9999}) == "dead"  # its pid now belongs to another process


def test_only_a_peer_whose_pid_is_still_its_own_here_is_proven_alive():
    def proven(row, running=None):
        running = {200: 7000} if running is None else running
        return liveness.proven_alive(row, me=ME, start_ticks_of=running.get)
    assert proven(peer())  # however long silent: no clock is read
    assert not proven(peer(), running={}) and not proven(peer(), running={200: 9999})
    for other in (peer(boot_id="boot-2"), peer(pid_ns="pid:[2]"), peer(start_ticks=None),
                  peer(boot_id=""), PeerRow("gone", ProcessIdentity("", "", "", -1, None), 1000.0)):
        assert not proven(other)  # within its lease or not, it cannot be proven


def test_a_peer_that_cannot_be_checked_is_judged_by_its_lease():
    for other in (peer(boot_id="boot-2"), peer(pid_ns="pid:[2]"), peer(start_ticks=None),
                  peer(boot_id=""), PeerRow("gone", ProcessIdentity("", "", "", -1, None), 1000.0)):
        assert judge(other, running={}) == "alive"  # within its lease, even if no such pid here
        assert judge(other, now=1000.0 + 301, running={}) == "stale"


def test_without_proc_this_process_is_never_comparable():
    me_unknown = ProcessIdentity("host", "", "", 100, None)
    assert verdict(peer(), me=me_unknown, now=1001.0, lease_s=300,
                   start_ticks_of=lambda pid: None) == "alive"


def test_this_process_identity_and_the_probe_agree():
    me = liveness.read_process_identity()
    assert me.pid == os.getpid() and me.boot_id and me.pid_ns.startswith("pid:[")
    assert liveness.probe_start_ticks(me.pid) == me.start_ticks
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ticks = liveness.probe_start_ticks(child.pid)
        assert ticks is not None and ticks >= me.start_ticks
    finally:
        child.kill()
        child.wait(10)
    assert liveness.probe_start_ticks(child.pid) is None  # reaped: gone


def test_silence_is_measured_on_the_judges_monotonic_clock_not_by_comparing_wall_clocks():
    from turnguard_core.liveness import Silences

    silences = Silences()
    other = peer(boot_id="boot-2")  # judged by its lease; its heartbeat_at: 1000 (its clock)
    # however far the judge's wall clock is from the peer's, a peer first seen is not silent
    assert silences.silent_s(other, 50.0) == 0.0
    assert verdict(other, me=ME, now=1e9, lease_s=300, start_ticks_of={}.get,
                   silent_s=silences.silent_s(other, 50.0)) == "alive"
    assert silences.silent_s(other, 349.0) == 299.0
    assert verdict(other, me=ME, now=-1e9, lease_s=300, start_ticks_of={}.get,
                   silent_s=silences.silent_s(other, 351.0)) == "stale"
    # a heartbeat that changed, even backwards (the peer's clock stepped back), is a sign of life
    back = PeerRow("peer", other.identity, heartbeat_at=10.0)
    assert silences.silent_s(back, 400.0) == 0.0
    assert silences.silent_s(back, 450.0) == 50.0
    silences.keep_only(set())
    assert silences.silent_s(back, 460.0) == 0.0  # forgotten: seen anew
