"""What outlives a script reload.

mitmproxy reloads a changed script by dropping the addon instance and making a new one, while
flows in transit go on and their remaining hooks reach the new instance. So what belongs to the
process, not to an addon instance, is kept on mitmproxy's master (which stays): the instance
this process is in the ledger (and its heartbeat, between two instances), its attempts in
flight, the ledger writes it still owes, what it learned of the ledger (and the peers it waits
for there), and its metrics' counters and telemetry event counts (a reload keeps
``turnguard_instance``, so a counter of that series must not start again from 0).
"""

from __future__ import annotations

import collections
import uuid
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from turnguard_core import liveness
from turnguard_core.failover import PeersAwaited
from turnguard_core.knowledge import MemoryStore

UNWRITTEN_MAX = 10_000  # records kept while no instance is loaded (the oldest go first)


@dataclass
class ProcessState:
    instance_id: str
    identity: liveness.ProcessIdentity
    attempts: dict = field(default_factory=dict)  # flow id -> inflight.Attempt
    by_op: dict = field(default_factory=dict)  # op key -> flow id of an attempt in flight
    sockets: dict = field(default_factory=dict)  # flow id -> websocket.Socket (guarded)
    kept_writes: collections.deque = field(default_factory=collections.deque)
    # claims in doubt not settled yet (FailoverStore: they outlive a script reload too)
    claims_in_doubt: list = field(default_factory=list)
    memory: MemoryStore = field(default_factory=MemoryStore)
    # the peers awaited in a ledger file opened after one was left (a reload goes on waiting)
    peers_awaited: PeersAwaited = field(default_factory=PeersAwaited)
    guard: Any = None  # the addon instance that gets the hooks now
    ran: bool = False  # an instance ran (start-up is over: a later load is a script reload)
    relay: Any = None  # relay.Relay: attached flows' streams (made on first use, or as the
    # addon runs when a dispatch may be detached: Attacher.start_relay_early)
    detached: dict = field(default_factory=dict)  # flow id -> detached.Detached (its calls)
    metrics: Any = None  # metrics.Metrics: the counters go on across reloads (same instance)
    # telemetry records by event (``turnguard.status``'s ``events``): they go on across
    # reloads and new events files, as the metrics' counters do
    event_counts: collections.Counter = field(default_factory=collections.Counter)
    # telemetry records made while no instance was loaded (a reload to a script that failed
    # to load): (event, fields with their ts), written by the next instance that loads
    unwritten: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=UNWRITTEN_MAX))
    # the heartbeat of the instance a script reload unloaded: it renews the process's lease
    # until the next instance's ledger has a heartbeat of its own (a reload to a script that
    # fails to load leaves none for as long as it is not fixed, while the process's attempts
    # go on upstream: their lease must not lapse, or a peer reaps them and runs them again)
    heartbeat: Any = None
    # the ledger (its location) the last instance that was not refused used: an instance a
    # script reload loads and refuses (a bad option: turnguard not running) opens it at
    # shutdown to write what the process owes it (``TurnGuard._open_for_ends_owed``)
    ledger: str = ""
    # the unloaded instance's wait for the process's exit (``TurnGuard._watch_exit``): with no
    # instance loaded since (a reload to a script that failed to load), it writes at exit
    # what the next instance would have; cancelled when an instance loads
    exit_watch: Any = None

    def keep_heartbeat(self, heartbeat: Any) -> None:
        """Keep ``heartbeat`` (None: none) as the process's, stopping the one kept before."""
        if self.heartbeat is not None and self.heartbeat is not heartbeat:
            self.heartbeat.stop()
        self.heartbeat = heartbeat

    @classmethod
    def new(cls) -> "ProcessState":
        return cls(uuid.uuid4().hex[:16], liveness.read_process_identity())

    @classmethod
    def of(cls, master) -> "ProcessState":
        """The process's state, kept on ``master`` (made on first use). One an older
        turnguard made (a script reload that upgrades turnguard in a running proxy) is given
        the fields it lacks, each its default, so that the new code finds every one."""
        state = getattr(master, "_turnguard_process", None)
        if state is None:
            state = cls.new()
            try:
                master._turnguard_process = state
            except AttributeError:  # no master (unit tests without one)
                pass
        for f in fields(cls):
            if not hasattr(state, f.name) and (f.default is not MISSING
                                               or f.default_factory is not MISSING):
                setattr(state, f.name,
                        f.default if f.default_factory is MISSING else f.default_factory())
        return state
