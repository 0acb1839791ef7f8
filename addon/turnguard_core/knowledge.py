"""What a process remembers of the ledger's durable facts, to decide while it cannot read it
(``MemoryStore``).

While the ledger is locked, full or gone, turnguard decides in memory
(``policy.admit_without_ledger``). Deciding from nothing would dispatch again what the ledger
knows must not be: an operation another process has in flight, a completed one it can replay,
a once-mode operation whose one recovery was spent. ``Knowledge`` keeps those facts as the
process learns them (from admissions and from its own attempts' ends), bounded in entries and
bytes, oldest dropped first. No clock, disk or proxy: times are passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .circuit import CircuitState
from .identity import Identity
from .ledger import Recording
from .policy import (
    Admission,
    Denied,
    Fenced,
    Hold,
    MemoryFacts,
    ReplayFromMemory,
    admit_without_ledger,
)

MAX_OPERATIONS = 10_000
MAX_RECORDING_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class KnownRecording:
    recording: Recording
    ended_at: float  # wall clock, as the ledger's ended_at
    fingerprint: str  # of the body that produced it (an Idempotency-Key reuse must not get it)


class Knowledge:
    def __init__(
        self, *, max_operations: int = MAX_OPERATIONS, max_bytes: int = MAX_RECORDING_BYTES
    ):
        self._max_operations = max_operations
        self._max_bytes = max_bytes
        self._elsewhere: OrderedDict[str, int | None] = OrderedDict()  # op -> attempt id
        self._exhausted: OrderedDict[str, None] = OrderedDict()
        self._recordings: OrderedDict[str, KnownRecording] = OrderedDict()
        self._bytes = 0

    # -- learning ------------------------------------------------------------------------------
    def in_flight_elsewhere(self, op_key: str, attempt_id: int | None) -> None:
        """The ledger said another process has an attempt of ``op_key`` in flight."""
        self._put(self._elsewhere, op_key, attempt_id)

    def ended(self, op_key: str) -> None:
        """The operation's attempt in flight (here or elsewhere) is known to have ended."""
        self._elsewhere.pop(op_key, None)

    def exhausted(self, op_key: str) -> None:
        """Its once-only recovery claim is spent (it never becomes available again)."""
        self._put(self._exhausted, op_key, None)

    def completed(self, op_key: str, known: KnownRecording) -> None:
        """A completed, replayable recording of the operation."""
        self.ended(op_key)
        old = self._recordings.pop(op_key, None)
        if old is not None:
            self._bytes -= len(old.recording.body)
        size = len(known.recording.body)
        if size > self._max_bytes:
            return
        self._recordings[op_key] = known
        self._bytes += size
        while self._bytes > self._max_bytes or len(self._recordings) > self._max_operations:
            _, dropped = self._recordings.popitem(last=False)
            self._bytes -= len(dropped.recording.body)

    def _put(self, table: OrderedDict, key: str, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self._max_operations:
            table.popitem(last=False)

    # -- reading -------------------------------------------------------------------------------
    def recording(
        self, op_key: str, *, fingerprint: str, now: float, window_s: float
    ) -> Recording | None:
        """A recording of ``op_key`` for this very body that ended within ``window_s``."""
        known = self._recordings.get(op_key)
        if known is None or known.fingerprint != fingerprint or now - known.ended_at > window_s:
            return None
        return known.recording

    def facts(
        self, op_key: str, *, in_flight_here: bool, fingerprint: str, now: float,
        window_s: float | None,
    ) -> MemoryFacts:
        """What is known of ``op_key`` (``window_s`` None: replay is off)."""
        replayable = window_s is not None and self.recording(
            op_key, fingerprint=fingerprint, now=now, window_s=window_s
        ) is not None
        return MemoryFacts(
            in_flight_here=in_flight_here,
            in_flight_elsewhere=op_key in self._elsewhere,
            exhausted=op_key in self._exhausted,
            replayable=replayable,
        )

    @property
    def recording_bytes(self) -> int:
        return self._bytes


class MemoryStore:
    """Decisions while the ledger cannot be read, from what this process learned of it: its
    ``Knowledge`` and the last known state of each retry circuit (pure: times are passed in)."""

    def __init__(self) -> None:
        self.knowledge = Knowledge()
        self.circuits: dict[str, CircuitState] = {}

    def admit(
        self, ident: Identity, *, circuit_scope: str, recovering: bool, once_mode: bool,
        in_flight_here: bool, now: float, window_s: float | None,
    ) -> Admission | ReplayFromMemory:
        facts = self.knowledge.facts(ident.op_key, in_flight_here=in_flight_here,
                                     fingerprint=ident.fingerprint, now=now, window_s=window_s)
        return admit_without_ledger(
            facts, circuit_remaining_s=self.circuit_state(circuit_scope).remaining_s(now),
            recovering=recovering, once_mode=once_mode, has_session=ident.session is not None,
        )

    def recording(self, ident: Identity, *, now: float, window_s: float | None) -> Recording | None:
        if window_s is None:
            return None
        return self.knowledge.recording(ident.op_key, fingerprint=ident.fingerprint, now=now,
                                        window_s=window_s)

    def circuit_state(self, scope: str) -> CircuitState:
        return self.circuits.get(scope, CircuitState())

    def learn(
        self, ident: Identity, admission: Admission, *, me: str, circuit_scope: str,
        now: float, threshold: int,
    ) -> None:
        """What a ledger admission says durably: a cooling circuit, another process's attempt
        in flight, a spent once-claim."""
        match admission:
            case Hold(attempt_id=attempt_id, owner_instance=owner) if owner != me:
                self.knowledge.in_flight_elsewhere(ident.op_key, attempt_id)
                return
            case Hold():
                return
            case Fenced(remaining_s=remaining):
                self.circuits[circuit_scope] = CircuitState(threshold, now + remaining)
            case Denied(reason="claim_exhausted"):
                self.knowledge.exhausted(ident.op_key)
        self.knowledge.ended(ident.op_key)  # whatever was in flight elsewhere is over

    def attempt_ended(
        self, ident: Identity, *, recording: Recording | None, spent_once_claim: bool,
        now: float,
    ) -> None:
        """One of this process's attempts ended (``spent_once_claim``: a recovery that ended
        without a known result)."""
        if recording is not None:
            self.knowledge.completed(ident.op_key, KnownRecording(recording, now, ident.fingerprint))
            return
        self.knowledge.ended(ident.op_key)
        if spent_once_claim:
            self.knowledge.exhausted(ident.op_key)
