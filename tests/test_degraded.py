"""Deciding without the ledger: what a process remembers (``knowledge``) and how it decides
from it (``policy.admit_without_ledger``)."""

from __future__ import annotations

import pytest

from turnguard_core import policy
from turnguard_core.circuit import CircuitState
from turnguard_core.identity import Identity
from turnguard_core.knowledge import Knowledge, KnownRecording, MemoryStore
from turnguard_core.ledger import Recording
from turnguard_core.policy import MemoryFacts, admit_without_ledger


def rec(size: int = 10) -> KnownRecording:
    return KnownRecording(Recording(200, (), b"x" * size), ended_at=1000.0, fingerprint="f")


def decide(facts: MemoryFacts, **kw):
    args = dict(circuit_remaining_s=0.0, recovering=False, once_mode=False, has_session=True)
    return admit_without_ledger(facts, **{**args, **kw})


def test_an_attempt_in_flight_anywhere_is_held_never_dispatched_again():
    assert decide(MemoryFacts(in_flight_here=True)) == policy.Hold(None, None)
    assert decide(MemoryFacts(in_flight_elsewhere=True), once_mode=True) == policy.Hold(None, None)


def test_a_recording_in_memory_is_replayed():
    assert decide(MemoryFacts(replayable=True), once_mode=True) == policy.ReplayFromMemory()


@pytest.mark.parametrize("has_session", [True, False])
def test_once_mode_fails_closed_what_it_cannot_read_and_refuses_a_spent_claim(has_session):
    spent = decide(MemoryFacts(exhausted=True), once_mode=True, has_session=has_session)
    assert spent == policy.Denied("upstream_operation_status_unknown", "claim_exhausted")
    unknown = decide(MemoryFacts(), once_mode=True, has_session=has_session)
    if has_session:  # only a session's operation can ever have a recovery dispatch
        assert unknown == policy.Denied("upstream_request_timeout", "ledger_unavailable")
    else:
        assert unknown == policy.Dispatch("original")


def test_other_modes_keep_a_known_cooldown_and_never_recover_blind():
    assert decide(MemoryFacts(), circuit_remaining_s=3.0) == policy.Fenced(3.0, False)
    assert decide(MemoryFacts(), recovering=True) == policy.Denied(
        "upstream_request_timeout", "ledger_unavailable")
    assert decide(MemoryFacts()) == policy.Dispatch("original")


def test_knowledge_learns_and_forgets_as_the_ledger_would():
    k = Knowledge()
    k.in_flight_elsewhere("op", 7)
    assert k.facts("op", in_flight_here=False, fingerprint="f", now=1000.0,
                   window_s=300).in_flight_elsewhere
    k.completed("op", rec())
    facts = k.facts("op", in_flight_here=False, fingerprint="f", now=1100.0, window_s=300)
    assert facts.replayable and not facts.in_flight_elsewhere
    # another body under the same key (an Idempotency-Key reuse), a passed window, replay off
    assert not k.facts("op", in_flight_here=False, fingerprint="g", now=1100.0, window_s=300).replayable
    assert not k.facts("op", in_flight_here=False, fingerprint="f", now=1400.0, window_s=300).replayable
    assert not k.facts("op", in_flight_here=False, fingerprint="f", now=1100.0, window_s=None).replayable
    k.exhausted("spent")
    assert k.facts("spent", in_flight_here=False, fingerprint="f", now=0, window_s=1).exhausted


def test_a_turn_completed_elsewhere_within_its_window_is_never_dispatched_again_blind():
    """The ledger notified that another process's attempt completed; its recording is in the
    ledger only. While the ledger cannot be read, a duplicate is failed closed (503), as a
    completed turn whose bytes cannot be read is, until the window passes or a new attempt of
    the operation is known."""
    assert decide(MemoryFacts(completed_elsewhere=True)) == policy.Denied(
        "upstream_request_timeout", "ledger_unavailable")
    k = Knowledge()

    def facts(now=1100.0, window_s=300):
        return k.facts("op", in_flight_here=False, fingerprint="f", now=now, window_s=window_s)

    k.in_flight_elsewhere("op", 7)
    k.completed_elsewhere("op", 1000.0)
    assert facts().completed_elsewhere and not facts().in_flight_elsewhere
    assert not facts(now=1400.0).completed_elsewhere  # past its window: a new turn
    assert not facts(window_s=None).completed_elsewhere  # replay off: the ledger dispatches too
    k.in_flight_elsewhere("op", 8)  # run again elsewhere (past the window there)
    assert not facts().completed_elsewhere and facts().in_flight_elsewhere
    k.completed_elsewhere("op", 1000.0)
    k.completed("op", rec())  # its recording read: replayed from memory
    assert facts().replayable and not facts().completed_elsewhere
    k.completed_elsewhere("op", 1050.0)  # (its own end, notified too)
    assert facts().replayable and not facts().completed_elsewhere


def test_remembered_circuits_are_bounded_and_idle_ones_forgotten():
    """Of the circuits a process noted, a refresh from the ledger keeps the cooling ones (the
    ledger's and those carried from a replaced file) and of the rest only those that count
    failures, the last noted first, at most ``max_counting``: one per session ever served
    would grow without bound."""
    m = MemoryStore()
    m.note_circuit("session:reset", CircuitState(1, None, None))
    m.note_circuit("session:reset", CircuitState(0, 900.0, None))  # completed: not kept
    assert "session:reset" not in m.circuits
    for i in range(50):  # idle: what every completed turn of a session left before
        m.circuits[f"session:idle{i}"] = CircuitState()
    for i in range(30):  # one failure each; the first noted again last
        m.note_circuit(f"session:failed{i}", CircuitState(1, None, None))
    m.note_circuit("session:failed0", CircuitState(1, None, None))
    m.note_circuit("session:cooled", CircuitState(3, 900.0, 60.0))  # its cooldown is over
    m.note_circuit("session:cleared", CircuitState(2, 2000.0, 60.0))  # cleared elsewhere
    m.carried_circuits["session:carried"] = CircuitState(2, 2000.0, 60.0)
    cooling = {"session:cooling": CircuitState(2, 2000.0, 60.0)}
    kept = m.refreshed_circuits(cooling, now=1000.0, max_counting=10)
    # the last 10 noted that count failures: failed22..29, failed0 (noted again), cooled
    assert set(kept) == {f"session:failed{i}" for i in range(22, 30)} | {
        "session:failed0", "session:cooled", "session:cooling", "session:carried"}
    m.circuits = kept
    assert m.circuit_state("session:idle3") == CircuitState()


def test_knowledge_is_bounded_in_entries_and_bytes():
    k = Knowledge(max_operations=3, max_bytes=25)
    for i in range(5):
        k.exhausted(f"op{i}")
        k.completed(f"r{i}", rec(10))
    assert k.recording_bytes <= 25
    kept = [i for i in range(5) if k.recording(f"r{i}", fingerprint="f", now=1000, window_s=9)]
    assert kept == [3, 4]  # the oldest dropped first
    assert [i for i in range(5) if k.facts(f"op{i}", in_flight_here=False, fingerprint="f",
                                            now=0, window_s=None).exhausted] == [2, 3, 4]
    k.completed("huge", rec(100))  # larger than the whole budget: not kept
    assert k.recording("huge", fingerprint="f", now=1000, window_s=9) is None


def own(attempt_id: int | None = 7, generation: str = "gen-1") -> KnownRecording:
    return KnownRecording(Recording(200, (), b"x"), ended_at=1000.0, fingerprint="f",
                          attempt_id=attempt_id, generation=generation)


def test_its_own_recordings_of_the_files_left_are_what_it_moves_to_the_new_one():
    """The recordings a process moves into a new ledger file: its own (not those it read
    from the ledger), of any file but the one in use, within their window; once moved, of
    the new file (replayed from memory: their row there is not known). One of a file left
    before the last (the new file had it: a copy made from the file left) moves on too."""
    from turnguard_core.ledger import AttemptEnd
    from turnguard_core.store import OfflineEndWrite

    ident = Identity("p", "u", "s", None, "/v1/responses", None, None, None, "f", "op")
    mine = OfflineEndWrite(ident, "POST", "/v1/responses", "original", "flow", None,
                           AttemptEnd("completed", 200, 3, None, Recording(200, (), b"x")),
                           1000.0, moving=True)
    k = Knowledge()
    k.completed("op", KnownRecording(Recording(200, (), b"x"), 1000.0, "f", 7, "gen-1", mine))
    k.completed("read", own(attempt_id=8))  # another process's, read from the ledger
    k.completed("other file", KnownRecording(Recording(200, (), b"x"), 1000.0, "f", 9,
                                             "gen-0", mine))
    window = {"f": 300.0}

    def outside(generation, now=1100.0, window_of=lambda i: window[i.fingerprint]):
        return sorted((known.attempt_id for known in k.own_recordings_outside(
            generation, now=now, window_of=window_of)), key=str)

    assert outside("gen-2") == [7, 9]  # the new file: the last file's and the one before's
    assert outside("gen-1") == [9] and outside("gen-0") == [7]
    assert outside("") == [7, 9]  # no file in use
    assert outside("gen-2", now=1301.0) == []  # past their window
    assert outside("gen-2", window_of=lambda i: None) == []  # replay off
    assert k.has_own_recordings_outside("gen-2", now=1100.0, window_of=lambda i: 300.0)
    (known,) = [r for r in k.own_recordings_outside("gen-2", now=1100.0,
                                                    window_of=lambda i: 300.0)
                if r.attempt_id == 7]
    k.moved("op", known, "gen-2")
    assert outside("gen-2") == [9] and outside("gen-3") == [9, None]
    assert k.recording("op", fingerprint="f", now=1100.0, window_s=300) == Recording(200, (), b"x")
    assert k.replay_attempt("op", fingerprint="f", now=1100.0, window_s=300,
                            generation="gen-2") is None  # replayed from memory


def test_a_replay_of_its_own_recording_is_the_ledgers_decision_known_in_memory():
    k = Knowledge()
    k.completed("op", own())
    ask = dict(fingerprint="f", now=1100.0, window_s=300, generation="gen-1")
    assert k.replay_attempt("op", **ask) == 7
    # what the ledger would not replay, or names another file's row: the ledger decides
    assert k.replay_attempt("other", **ask) is None
    assert k.replay_attempt("op", **{**ask, "fingerprint": "g"}) is None
    assert k.replay_attempt("op", **{**ask, "now": 1301.0}) is None
    assert k.replay_attempt("op", **{**ask, "generation": "gen-2"}) is None
    k.completed("no-row", own(attempt_id=None))
    assert k.replay_attempt("no-row", **ask) is None


def test_a_recording_read_from_the_ledger_is_known_as_its_own_are_by_the_ledgers_end():
    """A recording this process read from the ledger to replay it (another process's turn):
    kept with the end the ledger has for it, so its replay is known without the ledger, also
    once that file is gone, within the same window the ledger would give it; one read
    without its end is not kept (its window could not be told)."""
    ident = Identity("p", "u", "s", None, "/v1/responses", None, None, None, "f", "op")
    m = MemoryStore()
    m.recording_read(ident, Recording(200, (), b"body"), attempt_id=3, generation="gen-1")
    assert m.knowledge.recording_bytes == 0
    m.recording_read(ident, Recording(200, (), b"body", None, 1000.0), attempt_id=3,
                     generation="gen-1")
    ask = dict(now=1100.0, window_s=300, generation="gen-1")
    assert m.replay(ident, **ask) == policy.Replay(3)
    assert m.recording(ident, now=1100.0, window_s=300) == Recording(200, (), b"body")
    assert m.replay(ident, **{**ask, "now": 1301.0}) is None  # past the window from its end
    assert m.replay(ident, **{**ask, "generation": "gen-2"}) is None  # another file: asked
    m.file_replaced(1100.0)
    assert m.carried(ident, circuit_scope="s", once_mode=False, recovering=False, now=1100.0,
                     window_s=300, generation="gen-2") == policy.ReplayFromMemory()


def test_a_recording_whose_end_the_ledger_refused_is_forgotten():
    k = Knowledge()
    k.completed("op", own(attempt_id=7))
    k.superseded("op", 6)  # an older attempt's end: not this recording
    assert k.replay_attempt("op", fingerprint="f", now=1100.0, window_s=300,
                            generation="gen-1") == 7
    k.superseded("op", 7)
    assert k.replay_attempt("op", fingerprint="f", now=1100.0, window_s=300,
                            generation="gen-1") is None
    assert k.recording_bytes == 0


def test_what_was_learned_from_a_replaced_ledger_file_still_decides():
    """After the ledger file was replaced (``file_replaced``), the old file's recordings,
    spent once-claims and cooling circuits decide before the new file is asked."""
    def ident(op: str) -> Identity:
        return Identity("p", "u", "s", None, "/v1/responses", None, None, None, "f", op)

    m = MemoryStore()
    m.knowledge.completed("done", own(attempt_id=7))  # its row is in gen-1
    m.knowledge.exhausted("spent")
    m.circuits["cooling"] = CircuitState(2, 1200.0)
    m.circuits["cooled"] = CircuitState(2, 1050.0)
    ask = dict(circuit_scope="other", once_mode=True, recovering=False, now=1100.0,
               window_s=300, generation="gen-2")
    assert m.carried(ident("spent"), **ask) is None  # nothing carried before a replacement
    m.file_replaced(1100.0)
    assert m.carried(ident("done"), **ask) == policy.ReplayFromMemory()
    assert m.carried(ident("done"), **{**ask, "generation": "gen-1"}) is None  # its own file
    assert m.carried(ident("done"), **{**ask, "recovering": True}) is None
    assert m.carried(ident("spent"), **ask) == policy.Denied(
        "upstream_operation_status_unknown", "claim_exhausted")
    assert m.carried(ident("spent"), **{**ask, "once_mode": False}) is None
    assert m.carried(ident("new"), **{**ask, "circuit_scope": "cooling"}) == policy.Fenced(
        100.0, output_seen=False)
    assert m.carried(ident("new"), **{**ask, "circuit_scope": "cooled"}) is None
    assert m.carried(ident("new"), **{**ask, "circuit_scope": "cooling", "now": 1201.0}) is None
    m.carried_circuits["cooling"] = CircuitState(2, 1200.0)
    assert m.cooling_carried(1100.0, "cool") == {"cooling": CircuitState(2, 1200.0)}  # a prefix
    assert m.cooling_carried(1201.0) == {}  # its cooldown over
    assert m.clear_carried_circuits({"cooling"}) == {"cooling"}
    assert m.carried(ident("new"), **{**ask, "circuit_scope": "cooling"}) is None
