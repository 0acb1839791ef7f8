"""What a process remembers of the ledger's durable facts, to decide while it cannot read it
(``MemoryStore``), and to answer a replay of one of its own attempts without reading it.

While the ledger is locked, full or gone, turnguard decides in memory
(``policy.admit_without_ledger``). Deciding from nothing would dispatch again what the ledger
knows must not be: an operation another process has in flight, a completed one it can replay,
a once-mode operation whose one recovery was spent. ``Knowledge`` keeps those facts as the
process learns them (from admissions and from its own attempts' ends), bounded in entries and
bytes, oldest dropped first. No clock, disk or proxy: times are passed in.

A ledger file deleted or replaced under the process is an outage, never an empty ledger: what
it learned from the old file (its recordings, spent once-claims and cooling circuits) still
decides (``MemoryStore.carried``) where the new file, which knows none of it, would dispatch.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Iterator

from .circuit import CircuitState
from .identity import Identity
from .ledger import Recording
from .policy import (
    Admission,
    Denied,
    Fenced,
    Hold,
    MemoryFacts,
    Replay,
    ReplayFromMemory,
    admit_without_ledger,
)
from .records import record

if TYPE_CHECKING:  # (only named here: a KnownRecording keeps such a write, made by the store)
    from .store import OfflineEndWrite

MAX_OPERATIONS = 10_000
MAX_COUNTING_CIRCUITS = 10_000  # circuits that count failures but do not cool down, at most
MAX_RECORDING_BYTES = 64 * 1024 * 1024


@record
class KnownRecording:
    recording: Recording
    ended_at: float  # wall clock, as the ledger's ended_at
    fingerprint: str  # of the body that produced it (an Idempotency-Key reuse must not get it)
    attempt_id: int | None = None  # its attempt's row in the ledger (None: it has none)
    generation: str = ""  # of the ledger file that holds that row
    # this process's own attempt made it: that attempt recorded whole, as it is written into
    # another ledger file when the one that held it is deleted or replaced (None: the
    # recording was read from the ledger)
    moved: OfflineEndWrite | None = None


class Knowledge:
    def __init__(
        self, *, max_operations: int = MAX_OPERATIONS, max_bytes: int = MAX_RECORDING_BYTES
    ):
        self._max_operations = max_operations
        self._max_bytes = max_bytes
        self._elsewhere: OrderedDict[str, int | None] = OrderedDict()  # op -> attempt id
        self._exhausted: OrderedDict[str, None] = OrderedDict()
        # op -> when another process's attempt of it completed (wall clock), as notified: its
        # recording is in the ledger, not here
        self._completed_elsewhere: OrderedDict[str, float] = OrderedDict()
        self._recordings: OrderedDict[str, KnownRecording] = OrderedDict()
        self._bytes = 0

    # -- learning ------------------------------------------------------------------------------
    def in_flight_elsewhere(self, op_key: str, attempt_id: int | None) -> None:
        """The ledger said another process has an attempt of ``op_key`` in flight."""
        self._completed_elsewhere.pop(op_key, None)
        self._put(self._elsewhere, op_key, attempt_id)

    def ended(self, op_key: str) -> None:
        """The operation's attempt in flight (here or elsewhere) is known to have ended."""
        self._elsewhere.pop(op_key, None)
        self._completed_elsewhere.pop(op_key, None)

    def completed_elsewhere(self, op_key: str, ended_at: float) -> None:
        """Another process's attempt of ``op_key`` completed at ``ended_at`` (the ledger
        notified it): replayed from the ledger, never dispatched again from memory while the
        recording cannot be read."""
        self.ended(op_key)
        if op_key not in self._recordings:
            self._put(self._completed_elsewhere, op_key, ended_at)

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

    def exhausted_keys(self) -> list[str]:
        return list(self._exhausted)

    def own_recordings_outside(
        self, generation: str, *, now: float, window_of: Callable[[Identity], float | None],
    ) -> list[KnownRecording]:
        """This process's own recordings within their replay window (``window_of`` their
        operation's identity; None: not replayed) whose attempt's row is in a ledger file
        other than the one of ``generation`` (the file in use; "": none is): what it records
        in a new file, so that another process replays them there rather than run them
        again. Any file left, not only the last: a recording the new file had already (a
        copy made from the file left) stays of that file, and would never move on should
        the new file go too."""
        return list(self._own_outside(generation, now, window_of))

    def _own_outside(self, generation: str, now: float,
                     window_of: Callable[[Identity], float | None]) -> Iterator[KnownRecording]:
        return (known for known in self._recordings.values()
                if known.moved is not None and known.generation != generation
                and (window_s := window_of(known.moved.ident)) is not None
                and now - known.ended_at <= window_s)

    def has_own_recordings_outside(
        self, generation: str, *, now: float, window_of: Callable[[Identity], float | None],
    ) -> bool:
        """Whether ``own_recordings_outside`` would give any."""
        return any(True for _ in self._own_outside(generation, now, window_of))

    def moved(self, op_key: str, known: KnownRecording, generation: str) -> None:
        """``known`` was recorded in the ledger file of ``generation`` (its row there is not
        known: replays of it come from memory)."""
        if self._recordings.get(op_key) is known:
            self._recordings[op_key] = dataclasses.replace(known, attempt_id=None,
                                                           generation=generation)

    def recorded_whole(self, op_key: str, ended_at: float, generation: str) -> None:
        """This process's own end of ``op_key`` at ``ended_at`` was recorded whole (an end
        owed to a file since gone, or of an attempt dispatched without a ledger) in the
        ledger file of ``generation``: its recording, if still the one kept, is of that file
        now, and moves on from it should it go too (its row is not known: replays of it come
        from memory)."""
        known = self._recordings.get(op_key)
        if known is not None and known.moved is not None and known.ended_at == ended_at:
            self.moved(op_key, known, generation)

    def recorded_in_another_file(
        self, op_key: str, *, fingerprint: str, now: float, window_s: float, generation: str
    ) -> bool:
        """A recording of ``op_key`` for this very body, within ``window_s``, whose attempt's
        row is in a ledger file other than ``generation``'s (one since deleted or replaced)."""
        known = self._replayable(op_key, fingerprint, now, window_s)
        return known is not None and known.generation not in ("", generation)

    def superseded(self, op_key: str, attempt_id: int) -> None:
        """The ledger did not take ``attempt_id``'s end (it had been ended meanwhile, by a
        reaper): its recording is not what the ledger would replay, forget it."""
        known = self._recordings.get(op_key)
        if known is not None and known.attempt_id == attempt_id:
            del self._recordings[op_key]
            self._bytes -= len(known.recording.body)

    def _put(self, table: OrderedDict, key: str, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self._max_operations:
            table.popitem(last=False)

    # -- reading -------------------------------------------------------------------------------
    def _replayable(
        self, op_key: str, fingerprint: str, now: float, window_s: float
    ) -> KnownRecording | None:
        known = self._recordings.get(op_key)
        if known is None or known.fingerprint != fingerprint or now - known.ended_at > window_s:
            return None
        return known

    def recording(
        self, op_key: str, *, fingerprint: str, now: float, window_s: float
    ) -> Recording | None:
        """A recording of ``op_key`` for this very body that ended within ``window_s``."""
        known = self._replayable(op_key, fingerprint, now, window_s)
        return None if known is None else known.recording

    def replay_attempt(
        self, op_key: str, *, fingerprint: str, now: float, window_s: float, generation: str
    ) -> int | None:
        """The row, in the ledger file of ``generation``, of a recording of ``op_key`` for
        this very body that ended within ``window_s`` (None: none known, or its attempt has
        no row in that file: an id of another file may name another operation's attempt)."""
        known = self._replayable(op_key, fingerprint, now, window_s)
        return None if known is None or known.generation != generation else known.attempt_id

    def facts(
        self, op_key: str, *, in_flight_here: bool, fingerprint: str, now: float,
        window_s: float | None,
    ) -> MemoryFacts:
        """What is known of ``op_key`` (``window_s`` None: replay is off)."""
        replayable = window_s is not None and self.recording(
            op_key, fingerprint=fingerprint, now=now, window_s=window_s
        ) is not None
        completed_at = self._completed_elsewhere.get(op_key)
        return MemoryFacts(
            in_flight_here=in_flight_here,
            in_flight_elsewhere=op_key in self._elsewhere,
            exhausted=op_key in self._exhausted,
            replayable=replayable,
            completed_elsewhere=not replayable and window_s is not None
            and completed_at is not None and now - completed_at <= window_s,
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
        # learned from a ledger file since deleted or replaced (``file_replaced``)
        self.carried_exhausted: OrderedDict[str, None] = OrderedDict()
        self.carried_circuits: dict[str, CircuitState] = {}
        self.ledger_generation = ""  # of the ledger file this process uses, or used last
        self.carrying = False  # decides with facts learned from an earlier file (``carried``)

    def ledger_opened(self, generation: str, now: float) -> bool:
        """The ledger file of ``generation`` is open now. True when it is not the one this
        process used before (deleted or replaced since, whichever addon instance saw it):
        what that one said durably is kept (``file_replaced``) and decides from now on."""
        before, self.ledger_generation = self.ledger_generation, generation
        if not before or before == generation:
            return False
        self.file_replaced(now)
        self.carrying = True
        return True

    def file_replaced(self, now: float) -> None:
        """The ledger is another file now: keep what the old one said durably, for
        ``carried`` (recordings keep their file's generation and need nothing here)."""
        for op_key in self.knowledge.exhausted_keys():
            self.carried_exhausted[op_key] = None
            self.carried_exhausted.move_to_end(op_key)
        while len(self.carried_exhausted) > MAX_OPERATIONS:
            self.carried_exhausted.popitem(last=False)
        self.carried_circuits.update(
            {scope: state for scope, state in self.circuits.items() if state.remaining_s(now)})

    def carried(
        self, ident: Identity, *, circuit_scope: str, once_mode: bool, recovering: bool,
        now: float, window_s: float | None, generation: str,
    ) -> Admission | ReplayFromMemory | None:
        """The decision that what was learned from an earlier ledger file makes for the
        request, before the ledger (file ``generation``) is asked; None: it makes none.
        A recording of it is replayed (not for a recovery claim), a spent once-claim refused,
        a cooling circuit fences it."""
        if not recovering and window_s is not None and self.knowledge.recorded_in_another_file(
                ident.op_key, fingerprint=ident.fingerprint, now=now, window_s=window_s,
                generation=generation):
            return ReplayFromMemory()
        if once_mode and ident.op_key in self.carried_exhausted:
            return Denied("upstream_operation_status_unknown", "claim_exhausted")
        state = self.carried_circuits.get(circuit_scope)
        if state is not None:
            remaining = state.remaining_s(now)
            if remaining:
                return Fenced(remaining, output_seen=False)
            del self.carried_circuits[circuit_scope]
        return None

    def cooling_carried(self, now: float, scope: str | None = None) -> dict[str, CircuitState]:
        """The carried circuits that cool down now (they fence requests, though the ledger
        in use never knew them): all, or those of ``scope``: the one named, else those it
        is the start of (an operator's prefix, as the ledger's control commands take)."""
        cooling = {s: st for s, st in self.carried_circuits.items() if st.remaining_s(now)}
        if scope is None:
            return cooling
        if scope in cooling:
            return {scope: cooling[scope]}
        return {s: st for s, st in cooling.items() if scope.strip() and s.startswith(scope)}

    def clear_carried_circuits(self, scopes: set[str] | None) -> set[str]:
        """An operator cleared ``scopes`` (whole scopes; None: every circuit): their carried
        cooldowns end too. Returns the scopes cleared."""
        cleared = {s for s in self.carried_circuits if scopes is None or s in scopes}
        for s in cleared:
            del self.carried_circuits[s]
        return cleared

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

    def replay(
        self, ident: Identity, *, now: float, window_s: float | None, generation: str,
    ) -> Replay | None:
        """The ledger's own decision for a request this process can answer from a recording
        of one of its attempts, or one it read from the ledger (``recording_read``), made
        without reading the ledger; None when it cannot tell.

        Once an attempt completed with a recording, the ledger replays that attempt to every
        request of its operation with the same body until the window (``window_s``, None:
        replay is off) passes: no process dispatches it meanwhile, and no later write
        changes it. So the answer is known here from the attempt's end (remembered with the
        ``ended_at`` the ledger was given, or has), unless the ledger did not take that end
        (``Knowledge.superseded``) or is another file now (``generation``: the ledger's in
        use). A process whose window is longer than another's may replay a recording the
        other has since run again: an answer of the same request either way, never a
        dispatch."""
        if window_s is None:
            return None
        attempt_id = self.knowledge.replay_attempt(
            ident.op_key, fingerprint=ident.fingerprint, now=now, window_s=window_s,
            generation=generation)
        return None if attempt_id is None else Replay(attempt_id)

    def recording(self, ident: Identity, *, now: float, window_s: float | None) -> Recording | None:
        if window_s is None:
            return None
        return self.knowledge.recording(ident.op_key, fingerprint=ident.fingerprint, now=now,
                                        window_s=window_s)

    def circuit_state(self, scope: str) -> CircuitState:
        return self.circuits.get(scope, CircuitState())

    def note_circuit(self, scope: str, state: CircuitState) -> None:
        """The circuit of ``scope`` is ``state`` now (the last noted comes last). One without
        failures (a completed turn's, a cleared one's: no cooldown either) is not kept: it is
        what ``circuit_state`` says of a scope never seen, also during an outage, when no
        refresh (``refreshed_circuits``) comes to forget it."""
        self.circuits.pop(scope, None)
        if state.failures:
            self.circuits[scope] = state

    def refreshed_circuits(
        self, cooling: dict[str, CircuitState], now: float,
        max_counting: int = MAX_COUNTING_CIRCUITS,
    ) -> dict[str, CircuitState]:
        """The circuits to remember once the ledger said which cool down now (``cooling``):
        those, the cooldowns carried over from a replaced file, and of the rest only those
        that count failures (what a decision in memory needs during an outage), the
        ``max_counting`` noted last. A circuit this process saw cooling that the ledger says
        is not was cleared elsewhere; one without failures and without a cooldown is the
        circuit of a scope never seen (``circuit_state``), so it is not kept: without this,
        every session a long-running process ever served would stay in memory for good."""
        counting = [(scope, state) for scope, state in self.circuits.items()
                    if scope not in cooling and not state.remaining_s(now) and state.failures]
        circuits = dict(counting[max(0, len(counting) - max_counting):])
        circuits.update(cooling)
        circuits.update({scope: state for scope, state in self.carried_circuits.items()
                         if state.remaining_s(now) and scope not in cooling})
        return circuits

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

    def recording_read(self, ident: Identity, recording: Recording, *, attempt_id: int,
                       generation: str) -> None:
        """A recording read from the ledger (of ``generation``) to replay it, another
        process's as much as this one's: kept as this process's own are, with the end the
        ledger has for it (``Recording.ended_at``), so that it still answers the operation's
        duplicates while that file cannot be read, or once it was deleted or replaced
        (what the process learned from it still decides). A recording read without its
        end is not kept: its window could not be told."""
        if recording.ended_at is None:
            return
        self.knowledge.completed(ident.op_key, KnownRecording(
            recording, recording.ended_at, ident.fingerprint, attempt_id, generation))

    def attempt_ended(
        self, ident: Identity, *, recording: Recording | None, spent_once_claim: bool,
        now: float, attempt_id: int | None = None, generation: str = "",
        moved: OfflineEndWrite | None = None,
    ) -> None:
        """One of this process's attempts ended (``spent_once_claim``: a recovery that ended
        without a known result; ``attempt_id``: its row in the ledger file of ``generation``,
        if it has one; ``moved``: the attempt recorded whole, kept with its recording)."""
        if recording is not None:
            self.knowledge.completed(ident.op_key, KnownRecording(
                recording, now, ident.fingerprint, attempt_id, generation, moved))
            return
        self.knowledge.ended(ident.op_key)
        if spent_once_claim:
            self.knowledge.exhausted(ident.op_key)
