"""The SQLite ledger: real files, real SQLite, several connections as several processes."""

import json
import multiprocessing
import os
import sqlite3
import stat
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from hypothesis_profiles import examples
from turnguard_core import identity, policy
from turnguard_core.heartbeat import Heartbeat, IdleWal
from turnguard_core.ledger import (
    _MIGRATIONS,
    SCHEMA_VERSION,
    AttemptEnd,
    Ledger,
    LedgerError,
    Recording,
    WalState,
    _split_sql,
)
from turnguard_core.ledger_admin import LedgerAdmin

GUARD = policy.GuardPolicy(replay=True, replay_window_s=300, retention_s=3600)


def ident(
    body: dict, *, auth="Bearer k1", idem: str | None = None, turn_state: str | None = None
) -> identity.Identity:
    headers = [("authorization", auth), ("session-id", "s1")]
    if idem:
        headers.append(("idempotency-key", idem))
    if turn_state:
        headers.append(("x-codex-turn-state", turn_state))
    view = identity.RequestView("POST", "/v1/responses", tuple(headers), json.dumps(body).encode())
    out = identity.identify(view)
    assert isinstance(out, identity.Identity)
    return out


def open_ledger(path, name="a", now=1000.0) -> LedgerAdmin:
    led = LedgerAdmin(str(path), name)
    led.open(now)
    return led


def admit(led, i, now=1000.0, guard=GUARD):
    return led.admit(i, method="POST", path="/v1/responses", now=now, guard=guard, flow_id="f")


def test_file_is_private_and_schema_versioned(tmp_path):
    path = tmp_path / "l.sqlite3"
    led = open_ledger(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    admit(led, ident({"a": 1}))
    for suffix in ("-wal", "-shm"):
        p = str(path) + suffix
        if os.path.exists(p):
            assert stat.S_IMODE(os.stat(p).st_mode) & 0o077 == 0
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert led.integrity_check() == "ok"


def test_a_version_1_ledger_migrates_and_keeps_its_recordings(tmp_path):
    path = tmp_path / "v1.sqlite3"
    db = sqlite3.connect(path)
    for statement in _split_sql(_MIGRATIONS[1]):
        db.execute(statement)
    db.execute("PRAGMA user_version=1")
    db.execute("INSERT INTO operations (op_key, scope, method, path, fingerprint, state,"
               " replay_attempt, created_at, updated_at, ended_at)"
               " VALUES ('op', 's', 'POST', '/v1/responses', 'f', 'completed', 1, 1, 1, 1)")
    db.execute("INSERT INTO attempts (op_key, kind, instance_id, started_at, outcome, headers,"
               " body_bytes, replayable) VALUES ('op', 'original', 'old', 1, 'completed',"
               " '[[\"content-type\", \"text/event-stream\"]]', 3, 1)")
    db.execute("INSERT INTO spool VALUES (1, 0, x'616263')")
    db.commit()
    db.close()
    os.chmod(path, 0o600)
    led = open_ledger(path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert led.recording(1) == Recording(None,  # status was never set
                                         (("content-type", "text/event-stream"),), b"abc", None)
    assert len(led.generation.split("@")[0]) == 32  # made by the migration
    # the old instance's attempt is not in flight: nothing to reap
    assert led.peers_with_attempts_in_flight() == []
    assert led.integrity_check() == "ok"


def test_the_vary_key_is_kept_with_the_recording(ledger_backend):
    led = ledger_backend.open("a")
    d = admit(led, ident({"a": 1}))
    rec = Recording(200, (("vary", "x-tenant"),), b"body", "k" * 64)
    led.finish(d.attempt_id, AttemptEnd("completed", 200, 1, None, rec), now=1001.0)
    assert led.recording(d.attempt_id) == rec


def test_a_later_completion_without_a_recording_never_replays_an_older_one(ledger_backend):
    led = ledger_backend.open("a")
    i = ident({"a": 1})
    first = admit(led, i)
    rec = Recording(200, (), b"old answer")
    led.finish(first.attempt_id, AttemptEnd("completed", 200, 1, None, rec), now=1001.0)
    again = admit(led, i, now=1001.0 + GUARD.replay_window_s + 1)  # the window passed
    assert isinstance(again, policy.Dispatch)
    led.finish(again.attempt_id, AttemptEnd("completed", 200, 1, None, None), now=1400.0)
    assert isinstance(admit(led, i, now=1401.0), policy.Dispatch)  # not the old answer


def test_world_writable_ledger_is_refused(tmp_path):
    path = tmp_path / "l.sqlite3"
    path.write_bytes(b"")
    os.chmod(path, 0o666)
    with pytest.raises(LedgerError, match="writable by others"):
        open_ledger(path)


def test_future_schema_and_garbage_file_raise_ledger_error(tmp_path):
    future = tmp_path / "future.sqlite3"
    db = sqlite3.connect(future)
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(LedgerError, match="newer"):
        open_ledger(future)
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"this is not a database" * 100)
    os.chmod(junk, 0o600)
    with pytest.raises(LedgerError):
        open_ledger(junk)


def test_a_file_that_is_no_database_is_not_opened_through_the_wal_left_beside_it(tmp_path):
    """A file that is no database moved over a ledger whose WAL still holds its first page
    (its -wal and -shm left beside it, a connection still open on the old file): read
    through that WAL, SQLite takes the junk for the old ledger. It is refused as junk, left
    untouched, and a read-only open (the operator's tools) refuses it too; once it is gone,
    a new ledger is made at the path."""
    path = tmp_path / "l.sqlite3"
    a = LedgerAdmin(str(path), "a", checkpoint_on_commit=False)  # (pages stay in the WAL)
    a.open(1000.0)
    admit(a, ident({"n": 1}))
    assert Path(f"{path}-wal").stat().st_size > 0
    junk = tmp_path / "junk"
    junk.write_bytes(b"no database here\n" * 256)
    junk.chmod(0o600)
    os.replace(junk, path)
    with pytest.raises(LedgerError, match="is not a SQLite database; left untouched"):
        open_ledger(path, "b")
    with pytest.raises(LedgerError, match="is not a SQLite database"):  # nor read (a tool)
        LedgerAdmin(str(path), "tool").open_readonly()
    assert path.read_bytes() == b"no database here\n" * 256
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink()
    b = open_ledger(path, "b")
    assert b.generation != a.generation


def test_claim_hold_finish_replay_cycle(ledger_backend):
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    i = ident({"input": "hi"})
    d = admit(a, i)
    assert isinstance(d, policy.Dispatch) and d.kind == "original" and d.attempt_id
    assert admit(b, i) == policy.Hold(d.attempt_id, "a")
    rec = Recording(200, (("content-type", "text/event-stream"),), b"event: x\ndata: 1\n\n" * 50000)
    assert a.finish(d.attempt_id, AttemptEnd("completed", 200, 3, None, rec), now=1001.0).applied
    r = admit(b, i, now=1002.0)
    assert r == policy.Replay(d.attempt_id)
    assert b.recording(r.attempt_id) == rec
    # the second finish of the same attempt is fenced out
    assert not a.finish(d.attempt_id, AttemptEnd("unknown", None, 0), now=1003.0).applied


def test_an_end_recorded_whole_ends_this_instances_claim_in_flight_not_another_ones(
        ledger_backend):
    """An attempt dispatched without a row (its request stopped waiting for its claim) ended
    before its claim answered: its end, recorded whole, finds the operation in flight under
    that claim. It is recorded on the claim (refused, the claim was given back as rejected:
    the completed turn's recording lost, and a retry through another process ran it again).
    In flight under another instance's attempt, or under one this instance still runs, it is
    still refused."""
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    i = ident({"input": "its claim answers late"})
    late = admit(a, i)
    rec = Recording(200, (("content-type", "text/event-stream"),), b"data: done\n\n")

    def whole(led, op, now, running=()):
        return led.record_offline_attempt(
            op, method="POST", path="/v1/responses", kind="original", flow_id="f",
            circuit_scope=None, end=AttemptEnd("completed", 200, 3, None, rec), now=now,
            running=running)

    assert whole(a, i, 1001.0).applied
    assert admit(b, i, now=1002.0) == policy.Replay(late.attempt_id)
    assert b.recording(late.attempt_id) == rec
    # the claim's give-back, written after it, comes too late
    assert not a.finish(late.attempt_id, AttemptEnd("rejected", None, 0), now=1003.0).applied
    assert admit(b, i, now=1004.0) == policy.Replay(late.attempt_id)

    theirs = ident({"input": "another instance runs it"})
    running = admit(b, theirs)
    assert not whole(a, theirs, 1005.0).applied
    assert admit(a, theirs, now=1006.0) == policy.Hold(running.attempt_id, "b")

    # in flight under an attempt this instance still runs (a retry dispatched after the
    # attempt ended, registered since: ``running``), it is refused too
    retried = ident({"input": "a retry of it runs here"})
    retry = admit(a, retried)
    assert not whole(a, retried, 1007.0, running=(retry.attempt_id,)).applied
    assert admit(b, retried, now=1008.0) == policy.Hold(retry.attempt_id, "a")


def test_a_completed_attempt_moved_into_a_new_ledger_is_recorded_where_nothing_else_decides(
        ledger_backend):
    """A process records its own completed attempts of a ledger file since deleted or
    replaced in the new one (``moving``): whole, where the operation is unknown, or ended
    otherwise (an attempt an older copy showed in flight, ended since as stale); never over
    an operation in flight (another attempt runs it) or completed (an end recorded whole
    just before, the copy's own)."""
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    rec = Recording(200, (("content-type", "text/event-stream"),), b"data: done\n\n")

    def moved(op, now):
        return a.record_offline_attempt(
            op, method="POST", path="/v1/responses", kind="original", flow_id="f",
            circuit_scope=None, end=AttemptEnd("completed", 200, 3, None, rec), now=now,
            moving=True)

    unknown = ident({"input": "the new file never saw it"})
    assert moved(unknown, 1001.0).applied
    assert isinstance(admit(b, unknown, now=1002.0), policy.Replay)

    stale = ident({"input": "the older copy shows it in flight"})
    claim = admit(a, stale)
    a.finish(claim.attempt_id, AttemptEnd("unknown", None, 1), now=1003.0)
    assert moved(stale, 1004.0).applied
    assert isinstance(admit(b, stale, now=1005.0), policy.Replay)

    runs = ident({"input": "another attempt runs it"})
    running = admit(b, runs)
    assert not moved(runs, 1006.0).applied
    assert admit(a, runs, now=1007.0) == policy.Hold(running.attempt_id, "b")

    done = ident({"input": "its end was recorded whole just before"})
    first = admit(a, done)
    a.finish(first.attempt_id, AttemptEnd("completed", 200, 3, None, rec), now=1008.0)
    assert not moved(done, 1009.0).applied
    assert admit(b, done, now=1010.0) == policy.Replay(first.attempt_id)


def test_adopting_a_retry_ends_the_attempt_of_this_instance_whose_end_is_owed(ledger_backend):
    """``adopt_attempt`` for a retry this instance dispatched without a row, while its
    operation is still in flight under this instance's earlier attempt whose end is owed
    (``ended``): that attempt is ended (``unknown``) and the retry claimed, so that the owed
    end, written after, is fenced out and the retry stays in flight. An attempt of this
    instance not named, or another instance's, still makes it None."""
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")

    def adopt(led, op, ended=()):
        return led.adopt_attempt(op, method="POST", path="/v1/responses", kind="retry",
                                 flow_id="f2", now=1002.0, ended=ended)

    i = ident({"input": "failed, its end owed, retried"})
    first = admit(a, i)
    assert adopt(a, i) is None
    assert adopt(b, i, ended=(first.attempt_id,)) is None
    retry = adopt(a, i, ended=(first.attempt_id,))
    assert retry is not None and retry != first.attempt_id
    assert not a.finish(first.attempt_id, AttemptEnd("failed", 502, 0), now=1003.0).applied
    assert admit(b, i, now=1004.0) == policy.Hold(retry, "a")
    op = a.find_operation(i.op_key)
    assert [(r["outcome"], r["late_outcome"]) for r in op["attempt_rows"]] == [
        ("unknown", "failed"), ("in_flight", None)]


def test_stale_attempts_of_an_instance_are_ended_and_the_ones_it_runs_kept(ledger_backend):
    """``end_stale_attempts``: this instance's attempts in flight for operations it no longer
    runs end (``partial`` after an event, ``unknown`` before); the ones it runs, and another
    instance's, stay in flight."""
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    ran, seen, runs, other = (ident({"input": n}) for n in ("ran", "seen", "runs", "other"))
    for i in (ran, seen, runs):
        admit(a, i)
    a.first_event(a.snapshot(seen.op_key).current_attempt)
    admit(b, other)
    assert sorted(a.end_stale_attempts([runs.op_key], now=1001.0)) == sorted(
        [ran.op_key, seen.op_key])
    assert [a.snapshot(i.op_key).state for i in (ran, seen, runs, other)] == [
        "unknown", "partial", "in_flight", "in_flight"]
    assert a.end_stale_attempts([], now=1002.0) == [runs.op_key]
    assert b.snapshot(other.op_key).state == "in_flight"


def test_failed_attempt_is_retried_once_at_a_time(ledger_backend):
    a = ledger_backend.open("a")
    i = ident({"input": "x"})
    d = admit(a, i)
    a.finish(d.attempt_id, AttemptEnd("rejected", 429, 0), now=1001.0)
    r1 = admit(a, i, now=1002.0)
    assert isinstance(r1, policy.Dispatch) and r1.kind == "retry"
    assert isinstance(admit(a, i, now=1002.0), policy.Hold)
    op = a.find_operation(i.op_key[:10])
    assert [x["outcome"] for x in op["attempt_rows"]] == ["rejected", "in_flight"]


def test_idempotency_key_conflict(ledger_backend):
    a = ledger_backend.open("a")
    d = admit(a, ident({"n": 1}, idem="k"))
    assert isinstance(d, policy.Dispatch)
    assert admit(a, ident({"n": 2}, idem="k")) == policy.Conflict()
    assert isinstance(admit(a, ident({"n": 2}, idem="k", auth="Bearer other")), policy.Dispatch)


def test_reap_dead_instance(ledger_backend):
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    i1, i2 = ident({"n": 1}), ident({"n": 2})
    d1, d2 = admit(a, i1), admit(a, i2)
    a.first_event(d2.attempt_id)
    rows = b.peers_with_attempts_in_flight()
    assert [r.instance_id for r in rows] == ["a"]
    assert rows[0].identity == a.identity and rows[0].heartbeat_at == 1000.0
    moved = b.reap_instance("a", now=1005.0)
    assert sorted(moved) == sorted([i1.op_key, i2.op_key])
    assert b.snapshot(i1.op_key).state == "unknown"
    assert b.snapshot(i2.op_key).state == "partial"
    assert isinstance(admit(b, i1, now=1006.0), policy.Dispatch)
    # the reaped process's late outcome is kept for the record, and changes nothing else
    assert not a.finish(d1.attempt_id, AttemptEnd("completed", 200, 1), now=1007.0).applied
    op = b.find_operation(i1.op_key)
    assert [(r["outcome"], r["late_outcome"]) for r in op["attempt_rows"]] == [
        ("unknown", "completed"), ("in_flight", None)]


def test_ops_in_flight_elsewhere_names_each_other_instances_attempt_in_flight(ledger_backend):
    """What a process reads from a ledger file it leaves (deleted or replaced): the operations
    other instances have in flight there, never its own nor ended ones."""
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    i1, i2, i3 = ident({"n": 1}), ident({"n": 2}), ident({"n": 3})
    admit(a, i1)
    d2 = admit(a, i2)
    admit(b, i3)
    a.finish(d2.attempt_id, AttemptEnd("completed", 200, 1), now=1001.0)
    assert b.ops_in_flight_elsewhere() == [("a", i1.op_key)]
    assert a.ops_in_flight_elsewhere() == [("b", i3.op_key)]


def test_an_attempt_id_of_another_operation_is_neither_ended_nor_replayed(ledger_backend):
    """Attempt ids come again in an older copy of a ledger put back in place: a write or a
    read by attempt id that names its operation never touches another operation's attempt."""
    a = ledger_backend.open("a")
    mine, theirs = ident({"n": 1}), ident({"n": 2}, auth="Bearer another")
    d = admit(a, theirs)
    rec = Recording(200, (("content-type", "text/event-stream"),), b"mine")
    a.first_event(d.attempt_id, mine.op_key)
    assert a.snapshot(theirs.op_key).events_seen == 0
    ended = a.finish(d.attempt_id, AttemptEnd("completed", 200, 1, None, rec), now=1001.0,
                     op_key=mine.op_key)
    assert not ended.applied
    assert a.snapshot(theirs.op_key).state == "in_flight"
    op = a.find_operation(theirs.op_key)
    assert [(r["outcome"], r["late_outcome"]) for r in op["attempt_rows"]] == [("in_flight", None)]
    theirs_rec = Recording(200, (("content-type", "text/event-stream"),), b"theirs")
    assert a.finish(d.attempt_id, AttemptEnd("completed", 200, 1, None, theirs_rec),
                    now=1002.0, op_key=theirs.op_key).applied
    assert a.recording(d.attempt_id, mine.op_key) is None
    assert a.recording(d.attempt_id, theirs.op_key).body == b"theirs"


def test_a_reaped_instance_reregisters_at_its_next_heartbeat_under_a_new_incarnation(ledger_backend):
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    admit(a, ident({"n": 1}))
    assert a.heartbeat(1001.0) == "renewed" and a.incarnation == 1
    b.reap_instance("a", now=1002.0)
    assert a.heartbeat(1003.0) == "reregistered" and a.incarnation == 2
    assert a.heartbeat(1004.0) == "renewed"
    # a reload of the same process (same instance id) keeps its incarnation
    again = ledger_backend.open("a", 1005.0)
    assert again.incarnation == 2


def test_a_reap_judged_by_the_lease_does_not_happen_once_the_instance_came_back(ledger_backend):
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    i = ident({"n": 1})
    admit(a, i)
    [peer] = b.peers_with_attempts_in_flight()  # judged silent at heartbeat 1000
    a.heartbeat(1300.0)  # ...but it resumes before the reap runs
    assert b.reap_instance("a", now=1301.0, heartbeat_was=peer.heartbeat_at) == []
    assert b.snapshot(i.op_key).state == "in_flight"
    [peer] = b.peers_with_attempts_in_flight()
    assert b.reap_instance("a", now=1600.0, heartbeat_was=peer.heartbeat_at) == [i.op_key]


def test_a_reap_judged_by_an_unchanged_heartbeat_does_not_happen_once_it_changed(ledger_backend):
    """``heartbeat_was``: the reap compares the heartbeat with the value seen, never with a
    clock; any other value (later, or earlier: the peer's clock stepped back) stops it."""
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    i = ident({"n": 1})
    admit(a, i)
    [peer] = b.peers_with_attempts_in_flight()
    a.heartbeat(peer.heartbeat_at - 3600.0)  # renewed, its clock an hour back
    assert b.reap_instance("a", now=0.0, heartbeat_was=peer.heartbeat_at) == []
    assert b.snapshot(i.op_key).state == "in_flight"
    [peer] = b.peers_with_attempts_in_flight()
    assert b.reap_instance("a", now=0.0, heartbeat_was=peer.heartbeat_at) == [i.op_key]


def test_closing_a_ledger_never_deletes_a_wal_or_shm_by_its_name(tmp_path):
    """SQLite's close of the last connection to a file copies its WAL into it, then deletes
    the -wal and -shm by their names. It checks that the file did not move before the copy,
    not after: a file deleted and made again at the path during that copy (another process's
    new ledger, or this one's after a script reload) lost its -wal, the rows committed to it,
    while its connections went on writing to the unlinked one (a freshly made ledger failed to
    open with SQLITE_IOERR_SHORT_READ, one full test run in a few). A ledger's connection now
    copies the WAL itself through its own descriptors and leaves both files, emptied."""
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    admit(a, ident({"n": 1}))
    b = open_ledger(path, "b")
    b.close()
    a.close()  # the last connection
    assert Path(f"{path}-wal").stat().st_size == 0 and Path(f"{path}-shm").exists()
    c = open_ledger(path, "c")
    assert c.counts() == {"in_flight": 1}  # every row in the file
    # a ledger closed as its file is deleted and another made at the path keeps the new one's
    for suffix in ("", "-wal", "-shm"):
        os.unlink(f"{path}{suffix}")
    d = open_ledger(path, "d")
    admit(d, ident({"n": 2}))
    c.close()
    e = open_ledger(path, "e")
    assert e.counts() == {"in_flight": 1} and e.snapshot(ident({"n": 2}).op_key).state \
        == "in_flight"
    e.close()
    d.close()


@pytest.mark.parametrize("deleted", [("-wal",), ("-shm",), ("-wal", "-shm")])
def test_a_ledger_whose_wal_or_shm_was_deleted_under_a_connection_is_made_anew(
        tmp_path, deleted):
    """A connection has the file open when its -wal or -shm is deleted: no other connection
    opens the file meanwhile (SQLite would give it new ones: two WALs, or two indexes of one
    WAL); the connection sees it gone and puts a copy of the file, every row committed in its
    WAL included, in its place with none beside it, which the others then open."""
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    a._conn().execute("PRAGMA wal_autocheckpoint=0")  # (the rows below stay in the WAL)
    for n in range(3):
        admit(a, ident({"n": n}))
    assert a.sidecar_gone() is None
    for suffix in deleted:
        os.unlink(f"{path}{suffix}")
    assert a.sidecar_gone() == " and ".join(deleted)
    assert a.file_replaced() is None  # the file itself is still in place
    with pytest.raises(LedgerError, match="was deleted while a connection has the file open"):
        open_ledger(path, "b")
    assert a.make_anew()
    assert "replaced by another file" in a.file_replaced()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.sqlite3"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    b = open_ledger(path, "b")
    assert b.counts() == {"in_flight": 3}
    assert b.integrity_check() == "ok"
    assert not a.make_anew()  # the file at the path is another's now
    a.close()
    b.close()
    c = open_ledger(path, "c")  # with no connection on it, a file alone opens as before
    c.close()
    for suffix in deleted:
        os.unlink(f"{path}{suffix}")
    open_ledger(path, "d").close()


def test_a_ledger_is_made_in_a_folder_that_takes_no_lock(tmp_path, monkeypatch):
    """A file system without locks on a folder (some network ones refuse ``flock`` there)
    still gets its ledger file made, and made anew, without that lock."""
    import errno

    from turnguard_core import ledger_files

    def refused(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(ledger_files.fcntl, "flock", refused)
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    admit(a, ident({"n": 1}))
    os.unlink(f"{path}-wal")
    assert a.make_anew()
    a.close()
    b = open_ledger(path, "b")
    assert b.counts() == {"in_flight": 1}
    b.close()


def test_an_older_copy_moved_in_beside_the_wal_of_the_file_this_process_left_opens_alone(
        tmp_path):
    """An older copy moved over the ledger, the old file's -wal and -shm left, its WAL holding
    pages; the process that had the old file open (no connection has it now) opens the copy
    without them, where SQLite would read the old WAL's pages as the copy's."""
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    a._conn().execute("PRAGMA wal_autocheckpoint=0")
    for n in range(30):
        admit(a, ident({"n": n, "pad": "x" * 500}))
    older = tmp_path / "older.sqlite3"
    target = sqlite3.connect(older)
    a._conn().backup(target)
    target.close()
    os.chmod(older, 0o600)
    for n in range(30, 60):  # in the file, then in the WAL
        admit(a, ident({"n": n, "pad": "x" * 500}))
    a._conn().execute("PRAGMA wal_checkpoint(PASSIVE)")
    for n in range(60, 90):
        admit(a, ident({"n": n, "pad": "x" * 500}))
    assert Path(f"{path}-wal").stat().st_size > 0
    os.replace(older, path)
    assert "replaced" in a.file_replaced()
    a.close()
    with pytest.raises(LedgerError, match="are another file's"):  # nor read (a tool)
        LedgerAdmin(str(path), "tool").open_readonly()
    b = open_ledger(path, "b")
    assert b.counts() == {"in_flight": 30}
    assert b.integrity_check() == "ok"
    b.close()


def test_a_ledger_dropped_without_its_close_no_longer_counts_as_having_its_file_open(tmp_path):
    """This process's note of which file each connection has open forgets a ledger collected
    without ``close`` (its connection closed with it): kept, a new file later given that
    file's inode was taken for open, and refused as one whose -wal and -shm were deleted
    under a connection (a full run's unit tests, which leave ledgers unclosed)."""
    import gc

    from turnguard_core import ledger_files

    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    assert ledger_files.open_anywhere(str(path))
    del a
    gc.collect()
    assert not ledger_files.open_anywhere(str(path))
    b = open_ledger(path, "b")
    assert ledger_files.open_anywhere(str(path))
    b.close()
    assert not ledger_files.open_anywhere(str(path))



def test_a_file_made_at_the_path_as_a_deleted_ones_connection_closes_is_not_taken_for_open(
        tmp_path):
    """The ledger file is deleted under a connection, and a new one is made at the path just
    as that connection closes on another thread (a script reload: the new store opens the
    path while the old one's heartbeat closes its own). Closed, the deleted file's inode is
    free, and the new file gets it: the new file is not taken for one this process has open
    (nor refused as one whose -wal and -shm were deleted under a connection). Another
    process making files meanwhile (a parallel test run) may take the freed inode first: then
    it goes again, with another ledger."""
    for attempt in range(5):  # bounded
        if _a_file_made_as_a_deleted_ones_connection_closes(tmp_path / f"try{attempt}"):
            return
    pytest.skip("this file system did not give a new file the freed inode in 5 tries")


def _a_file_made_as_a_deleted_ones_connection_closes(folder: Path) -> bool:
    """One try of the test above; False when no file made got the freed inode."""
    import threading

    from turnguard_core import ledger_files

    folder.mkdir()
    path = folder / "l.sqlite3"
    a = open_ledger(path, "a")
    deleted = os.stat(path).st_ino
    for suffix in ("", "-wal", "-shm"):
        os.unlink(f"{path}{suffix}")
    connection, closed = a._db, threading.Event()

    class PausedAfterItsClose:  # (the thread that closes it is not scheduled again at once)
        def __getattr__(self, name):
            return getattr(connection, name)

        def close(self):
            connection.close()
            closed.set()
            time.sleep(0.5)

    a._db = PausedAfterItsClose()
    closing = threading.Thread(target=a.close)
    closing.start()
    try:
        assert closed.wait(10)
        for n in range(64):  # (the files made next there, until one has the deleted one's inode)
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            if os.stat(path).st_ino == deleted:
                break
            os.rename(path, folder / f"other-{n}")
        else:
            return False
        assert not ledger_files.open_anywhere(str(path))
        os.unlink(path)
        b = open_ledger(path, "b")
        b.close()
        return True
    finally:
        closing.join()


def test_a_file_put_in_place_while_a_copy_is_made_anew_is_kept(tmp_path):
    """An operator restores a backup (its -wal and -shm deleted first, then the backup moved
    in): a heartbeat that saw the -wal gone in between and made a copy of the file meanwhile
    does not put its copy over the backup."""
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    admit(a, ident({"n": 1}))
    backup = tmp_path / "backup.sqlite3"
    target = sqlite3.connect(backup)
    a._conn().backup(target)
    target.close()
    os.chmod(backup, 0o600)
    restored = os.stat(backup).st_ino
    os.unlink(f"{path}-wal")
    connection = a._conn()

    class BackupRestoredMeanwhile:
        def __getattr__(self, name):
            return getattr(connection, name)

        def backup(self, target):
            connection.backup(target)
            os.replace(backup, path)

    a._db = BackupRestoredMeanwhile()
    assert not a.make_anew()
    a._db = connection
    assert os.stat(path).st_ino == restored
    assert not Path(f"{path}.copy").exists()
    a.close()


def test_a_deleted_or_replaced_ledger_file_is_an_error_not_an_empty_ledger(tmp_path):
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    i = ident({"n": 1})
    admit(a, i)
    generation = a.generation
    assert a.file_replaced() is None
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.unlink(f"{path}{suffix}")
    assert "was deleted" in a.file_replaced()
    with pytest.raises(LedgerError, match="was deleted"):
        admit(a, i)
    b = open_ledger(path, "b")  # a new process makes a new file there
    assert b.generation != generation
    assert "replaced by another file" in a.file_replaced()
    with pytest.raises(LedgerError, match="replaced"):
        a.heartbeat(1001.0)


def test_a_read_only_look_at_a_closed_ledger_makes_no_file_and_knows_when_a_writer_came(tmp_path):
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    admit(a, ident({"n": 1}))
    a.close()
    assert Path(f"{path}-wal").stat().st_size == 0  # its close copied the WAL into the file
    for suffix in ("-wal", "-shm"):  # the file alone (copied, or its -wal and -shm removed)
        os.unlink(f"{path}{suffix}")
    ro = LedgerAdmin(str(path), "cli")
    ro.open_readonly()
    assert ro.counts() == {"in_flight": 1} and ro.read_was_stable()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.sqlite3"]
    b = open_ledger(path, "b")  # a writer opens it meanwhile: the look is to be taken again
    admit(b, ident({"n": 2}))
    assert not ro.read_was_stable()
    ro.close()
    ro.open_readonly()  # through its -wal now
    assert ro.counts() == {"in_flight": 2} and ro.read_was_stable()
    ro.close()
    b.close()


def test_a_read_only_look_at_a_ledger_with_a_wal_and_no_shm_makes_the_shm_private(tmp_path):
    """A -wal copied in without its -shm: SQLite cannot read its rows without one, so the
    look makes it, 0600 (SQLite would give it the ledger's mode); one of another user or a
    symbolic link is refused."""
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    a._conn().execute("PRAGMA wal_autocheckpoint=0")
    admit(a, ident({"n": 1}))
    copy = tmp_path / "c.sqlite3"
    for suffix in ("", "-wal"):
        Path(f"{copy}{suffix}").write_bytes(Path(f"{path}{suffix}").read_bytes())
    a.close()
    os.chmod(copy, 0o644)
    ro = LedgerAdmin(str(copy), "cli")
    ro.open_readonly()
    assert ro.counts() == {"in_flight": 1}
    ro.close()
    assert stat.S_IMODE(os.stat(f"{copy}-shm").st_mode) == 0o600
    os.unlink(f"{copy}-shm")
    os.symlink(tmp_path / "elsewhere", f"{copy}-shm")
    with pytest.raises(LedgerError, match="is a symbolic link"):
        ro.open_readonly()
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file of another user (needs root)")
def test_a_wal_or_shm_another_user_makes_as_sqlite_opens_the_ledger_is_never_used(
        tmp_path, monkeypatch):
    """In a sticky world-writable folder another user may make the ledger's -wal or -shm
    between turnguard's checks and SQLite's open, which takes a file it finds there (and, as
    root, gives it to the ledger's owner; the other user's descriptor stays open): SQLite never
    opens one, the ledger is refused. One found (a process killed left it) that is another
    user's or a symbolic link is refused too; its own are made 0600."""
    path = tmp_path / "l.sqlite3"
    open_ledger(path).close()
    for suffix in ("-wal", "-shm"):  # (left beside it, emptied) gone, as before a first start
        os.unlink(f"{path}{suffix}")
    real_connect = sqlite3.connect
    made = []

    def racing(database, *args, **kwargs):  # the other user, just before SQLite opens
        for suffix in ("-wal", "-shm"):
            try:
                fd = os.open(f"{path}{suffix}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
            except FileExistsError:
                continue
            os.fchown(fd, 4242, 4242)
            os.close(fd)
            made.append(suffix)
        return real_connect(database, *args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", racing)
    with pytest.raises(LedgerError, match=r"belongs to another user \(uid 4242\)"):
        open_ledger(path, "b")
    monkeypatch.undo()
    assert made == ["-wal", "-shm"]
    for suffix in made:  # untouched: SQLite never opened them
        st = os.stat(f"{path}{suffix}")
        assert (st.st_uid, st.st_size) == (4242, 0), suffix
    for suffix in ("-wal", "-shm"):
        os.unlink(f"{path}{suffix}")
        os.symlink(tmp_path / "elsewhere", f"{path}{suffix}")
        with pytest.raises(LedgerError, match="is a symbolic link"):
            open_ledger(path, "c")
        os.unlink(f"{path}{suffix}")
        with open(f"{path}{suffix}", "wb"):
            pass
    assert not (tmp_path / "elsewhere").exists()
    led = open_ledger(path, "d")
    admit(led, ident({"n": 1}))
    for suffix in ("-wal", "-shm"):
        st = os.stat(f"{path}{suffix}")
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o600), suffix
    led.close()


def test_an_older_copy_of_the_ledger_put_back_in_its_place_is_another_generation(tmp_path):
    """A restored backup carries the same made-with id, not the rows since (its attempt ids
    come again): it must not be taken for the file a process wrote to."""
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    admit(a, ident({"n": 1}))
    backup = tmp_path / "backup.sqlite3"
    with sqlite3.connect(path) as src, sqlite3.connect(backup) as dst:
        src.backup(dst)
    admit(a, ident({"n": 2}))
    for suffix in ("-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.unlink(f"{path}{suffix}")
    os.replace(backup, path)
    assert "replaced by another file" in a.file_replaced()
    b = open_ledger(path, "b")
    made = sqlite3.connect(path).execute("SELECT value FROM meta WHERE key='generation'")
    assert a.generation.split("@")[0] == made.fetchone()[0]  # the same made-with id ...
    assert b.generation != a.generation  # ... yet another generation


def test_a_spent_once_claim_outlives_retention_as_a_tombstone(ledger_backend):
    a = ledger_backend.open("a")
    i = ident({"n": 1}, turn_state="ts")
    owner, _ = a.claim_session(i.session, now=1000.0, lease_s=1e9, new_id="d")
    d = a.admit(i, method="POST", path="/v1/responses", now=1000.0, guard=GUARD, flow_id=None,
                recovery=policy.RecoveryClaim(i.session, owner.owner_epoch, once=True),
                once_mode=True)
    assert d.kind == "recovery"
    a.finish(d.attempt_id, AttemptEnd("unknown", None, 0), now=1001.0)
    a.collect_garbage(now=1e7, retention_s=3600, instance_stale_s=30)
    assert a.snapshot(i.op_key) is not None  # the row stays; its attempts are gone
    assert a.find_operation(i.op_key)["attempt_rows"] == []
    again = a.admit(i, method="POST", path="/v1/responses", now=1e7, guard=GUARD, flow_id=None,
                    once_mode=True)
    assert again == policy.Denied("upstream_operation_status_unknown", "claim_exhausted")


def test_garbage_collection_purges_ended_operations_and_spool(ledger_backend):
    a = ledger_backend.open("a")
    i = ident({"n": 1})
    d = admit(a, i)
    a.finish(d.attempt_id, AttemptEnd("completed", 200, 1, None, Recording(200, (), b"x")), now=1001.0)
    assert a.collect_garbage(now=1001.0 + 100, retention_s=3600, instance_stale_s=30) == 0
    assert a.collect_garbage(now=1001.0 + 3601, retention_s=3600, instance_stale_s=30) == 1
    for table in ("spool", "operations", "attempts"):
        assert ledger_backend.rows(f"SELECT COUNT(*) FROM {table}") == [(0,)]


def test_attempt_ids_never_come_again_after_garbage_collection(tmp_path):
    """After every row was collected an attempt id is still never handed out twice (the
    attempts table's AUTOINCREMENT): a late end of an attempt collected must never land on
    another."""
    a = open_ledger(tmp_path / "l.sqlite3")
    first = admit(a, ident({"n": 1}))
    a.finish(first.attempt_id, AttemptEnd("completed", 200, 1, None, Recording(200, (), b"x")),
             now=1001.0)
    assert a.collect_garbage(now=1001.0 + 3601, retention_s=3600, instance_stale_s=30) == 1
    second = admit(a, ident({"n": 2}), now=1001.0 + 3602)
    assert isinstance(second, policy.Dispatch) and second.attempt_id == first.attempt_id + 1
    assert a.snapshot(ident({"n": 2}).op_key).current_attempt == second.attempt_id
    late = a.finish(first.attempt_id, AttemptEnd("completed", 200, 1, None, None),
                    now=1001.0 + 3603)
    assert not late.applied and a.snapshot(ident({"n": 2}).op_key).state == "in_flight"


def test_locked_database_raises_ledger_error(tmp_path):
    path = tmp_path / "l.sqlite3"
    a = Ledger(str(path), "a", busy_timeout_ms=50)
    a.open(1000.0)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(LedgerError, match="locked"):
            admit(a, ident({"n": 1}))
    finally:
        blocker.execute("ROLLBACK")
    assert isinstance(admit(a, ident({"n": 1})), policy.Dispatch)


def test_a_read_apart_answers_behind_another_connections_write_lock_and_only_of_its_file(
        tmp_path):
    """``read_apart`` reads on a read-only connection of its own, in one read transaction:
    it answers while another connection holds the write lock (which this connection's claims
    wait for), and refuses once the file at the path is another one (what it read would be
    that file's)."""
    path = tmp_path / "l.sqlite3"
    a = open_ledger(str(path), "a")
    b = open_ledger(str(path), "b")
    claim = admit(b, ident({"n": 1}))
    assert isinstance(claim, policy.Dispatch)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        seen = a.read_apart(lambda led: led.snapshot(ident({"n": 1}).op_key))
        assert (seen.state, seen.current_attempt, seen.owner_instance) == (
            "in_flight", claim.attempt_id, "b")
        assert a.read_apart(lambda led: led.snapshot(ident({"n": 2}).op_key)) is None
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    os.replace(path, tmp_path / "moved.sqlite3")
    open_ledger(str(path), "c").close()  # another file at the path
    with pytest.raises(LedgerError, match="not the one in use"):
        a.read_apart(lambda led: led.snapshot(ident({"n": 1}).op_key))


def _race(path: str, name: str, bodies: list[dict], out):
    if path.startswith("postgresql://"):
        from turnguard_core.pg_ledger import PgLedger as Ledger
    else:
        from turnguard_core.ledger import Ledger
    led = Ledger(path, name, busy_timeout_ms=20000)
    led.open(1000.0)
    wins = 0
    for body in bodies:
        if isinstance(admit(led, ident(body)), policy.Dispatch):
            wins += 1
    out.put(wins)


def test_claims_are_exactly_once_across_processes(ledger_backend):
    path = ledger_backend.location
    ledger_backend.open("a").close()
    bodies = [{"n": n} for n in range(200)]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(path, f"p{k}", bodies, out)) for k in range(4)]
    for p in procs:
        p.start()
    wins = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sum(wins) == 200
    assert ledger_backend.rows("SELECT COUNT(*) FROM attempts") == [(200,)]


class LedgerMachine(RuleBasedStateMachine):
    """Two processes (connections) on one ledger against a dict model of the operations; run
    against each store (``ledger_backend``: SQLite and PostgreSQL)."""

    backend = None  # set by test_ledger_machine before each run

    def __init__(self):
        super().__init__()
        self.backend.fresh()
        self.procs = {n: self.backend.open(n) for n in ("a", "b")}
        self.now = 1000.0
        self.model: dict[str, dict] = {}  # op_key -> {"state", "attempt", "owner", "ended", "rec"}
        self.open_attempts: dict[int, tuple[str, str]] = {}  # attempt -> (op_key, owner)

    def teardown(self):
        for led in self.procs.values():
            led.close()

    @rule(proc=st.sampled_from("ab"), n=st.integers(0, 3))
    def admit_request(self, proc, n):
        i = ident({"n": n})
        got = admit(self.procs[proc], i, now=self.now)
        m = self.model.get(i.op_key)
        snapshot = None
        if m is not None:
            snapshot = policy.OperationSnapshot(
                m["state"], i.fingerprint, m["attempt"], m["owner"], m["ended"], m["rec"]
            )
        want = policy.admit(snapshot, fingerprint=i.fingerprint, has_idempotency_key=False,
                            now=self.now, policy=GUARD)
        if isinstance(want, policy.Dispatch):
            assert isinstance(got, policy.Dispatch) and got.kind == want.kind
            self.model[i.op_key] = {"state": "in_flight", "attempt": got.attempt_id,
                                    "owner": proc, "ended": None,
                                    "rec": m["rec"] if m else None}
            self.open_attempts[got.attempt_id] = (i.op_key, proc)
        else:
            assert got == want

    @rule(data=st.data(), outcome=st.sampled_from(["completed", "rejected", "partial", "unknown"]))
    def finish_attempt(self, data, outcome):
        if not self.open_attempts:
            return
        attempt = data.draw(st.sampled_from(sorted(self.open_attempts)))
        op_key, owner = self.open_attempts.pop(attempt)
        rec = Recording(200, (), b"body%d" % attempt) if outcome == "completed" else None
        assert self.procs[owner].finish(attempt, AttemptEnd(outcome, 200, 1, None, rec), now=self.now).applied
        m = self.model[op_key]
        m.update(state=outcome, ended=self.now, rec=attempt if rec else m["rec"])

    @rule(proc=st.sampled_from("ab"))
    def reap(self, proc):
        other = "b" if proc == "a" else "a"
        self.procs[proc].reap_instance(other, now=self.now)
        for attempt, (op_key, owner) in list(self.open_attempts.items()):
            if owner == other:
                del self.open_attempts[attempt]
                self.model[op_key].update(state="unknown", ended=self.now)

    @rule(dt=st.sampled_from([1.0, 200.0, 400.0]))
    def advance(self, dt):
        self.now += dt

    @invariant()
    def at_most_one_attempt_in_flight_per_operation(self):
        rows = self.backend.rows(
            "SELECT op_key, COUNT(*) FROM attempts WHERE outcome='in_flight' GROUP BY op_key")
        assert all(n == 1 for _, n in rows)
        assert sum(n for _, n in rows) == len(self.open_attempts)


def test_ledger_machine(ledger_backend):
    """The claims' state machine, on each store."""
    LedgerMachine.backend = ledger_backend
    run_state_machine_as_test(
        LedgerMachine, settings=settings(max_examples=examples(40), stateful_step_count=30, deadline=None))


def test_garbage_collection_keeps_live_circuits_and_sessions(tmp_path):
    from turnguard_core import circuit

    a = open_ledger(tmp_path / "l.sqlite3")
    cfg = circuit.CircuitConfig(threshold=1, cooldown_s=10_000, cooldown_max_s=10_000)
    i = ident({"n": 1})
    d = admit(a, i)
    assert a.finish(d.attempt_id, AttemptEnd("unknown", None, 0), now=1001.0, circuit_cfg=cfg,
                    eventless_failure=True).transition is None  # no circuit scope given
    a.claim_session("s", now=1000.0, lease_s=50_000, new_id="d")
    a.claim_session("t", now=1000.0, lease_s=10, new_id="e")
    db = sqlite3.connect(tmp_path / "l.sqlite3")
    db.execute("INSERT INTO circuits VALUES ('open', 2, 20000.0, 60, 1000.0)")
    db.execute("INSERT INTO circuits VALUES ('closed', 1, NULL, NULL, 1000.0)")
    db.commit()
    a.collect_garbage(now=1000.0 + 3601, retention_s=3600, instance_stale_s=30)
    assert [r[0] for r in db.execute("SELECT scope FROM circuits")] == ["open"]
    assert [r[0] for r in db.execute("SELECT session FROM sessions")] == ["s"]


def test_circuit_is_fed_in_the_finish_transaction_and_fences_admission(ledger_backend):
    from turnguard_core import circuit

    a = ledger_backend.open("a")
    b = ledger_backend.open("b")  # another process sees the same circuit
    cfg = circuit.CircuitConfig(threshold=2, cooldown_s=60, cooldown_max_s=600)
    i = ident({"n": 1})

    def fail(now):
        d = a.admit(i, method="POST", path="/v1/responses", now=now, guard=GUARD, flow_id=None,
                    circuit_scope="session:x")
        assert isinstance(d, policy.Dispatch)
        return a.finish(d.attempt_id, AttemptEnd("unknown", None, 0), now=now, circuit_cfg=cfg,
                        eventless_failure=True)

    assert fail(1000.0).transition is None
    opened = fail(1001.0)
    assert opened.transition == "opened" and opened.circuit.open_until == 1061.0
    fenced = b.admit(i, method="POST", path="/v1/responses", now=1010.0, guard=GUARD,
                     flow_id=None, circuit_scope="session:x")
    assert fenced == policy.Fenced(51.0, False)
    assert b.open_circuits(1010.0)[0][0] == "session:x"
    d = b.admit(i, method="POST", path="/v1/responses", now=1062.0, guard=GUARD, flow_id=None,
                circuit_scope="session:x")
    reset = b.finish(d.attempt_id, AttemptEnd("completed", 200, 3), now=1063.0, circuit_cfg=cfg)
    assert reset.transition == "reset" and b.circuit_state("session:x").remaining_s(1063.0) == 0


def test_a_session_the_ledger_does_not_know_is_registered_again_by_its_owner(
        ledger_backend):
    """A ledger that has no row of a session (a file made again under the running process)
    does not know it: its owner's renewal, or its recovery claim, registers it at the owner's
    epoch, and the recovery claim fenced by that epoch is the owner's. An instance that
    claimed it there first owns it: the renewal and the claim are refused, as those of a
    session taken over are."""
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    assert a.renew_session("s", 3, now=1000.0, lease_s=10)
    assert a.session_owned_by("s", "a", 3) and not a.session_owned_by("s", "a", 1)
    assert b.claim_session("s", now=1005.0, lease_s=10, new_id="d")[1] == "owned_by_other"
    i = ident({"n": 10})
    d = a.admit(i, method="POST", path="/v1/responses", now=1006.0, guard=GUARD, flow_id=None,
                recovery=policy.RecoveryClaim("s", 3, once=True))
    assert isinstance(d, policy.Dispatch), d
    b.claim_session("t", now=1000.0, lease_s=10, new_id="d2")
    assert not a.renew_session("t", 1, now=1001.0, lease_s=10)
    assert b.session_owned_by("t", "b", 1)
    # the file went between the owner's last renewal and its recovery claim: the claim
    # registers the session at its epoch, its lease ended (another may take it over after)
    d = a.admit(ident({"n": 11}), method="POST", path="/v1/responses", now=1010.0, guard=GUARD,
                flow_id=None, recovery=policy.RecoveryClaim("u", 2, once=True))
    assert isinstance(d, policy.Dispatch), d
    assert a.session_owned_by("u", "a", 2)
    assert b.claim_session("u", now=1011.0, lease_s=10, new_id="d3")[0].owner_epoch == 3
    assert a.admit(ident({"n": 12}), method="POST", path="/v1/responses", now=1012.0,
                   guard=GUARD, flow_id=None, recovery=policy.RecoveryClaim("t", 1, once=True)
                   ) == policy.Denied("upstream_request_timeout", "ownership_lost")


def test_session_ownership_is_fenced_by_epoch(ledger_backend):
    a = ledger_backend.open("a")
    b = ledger_backend.open("b")
    row, result = a.claim_session("s", now=1000.0, lease_s=10, new_id="d1")
    assert result == "created" and row.owner_epoch == 1
    assert b.claim_session("s", now=1005.0, lease_s=10, new_id="d2")[1] == "owned_by_other"
    assert a.renew_session("s", 1, now=1008.0, lease_s=10)  # lease now ends at 1018
    assert b.claim_session("s", now=1017.0, lease_s=10, new_id="d2")[1] == "owned_by_other"
    taken, result = b.claim_session("s", now=1019.0, lease_s=10, new_id="d2")
    assert result == "taken_over" and taken.owner_epoch == 2 and taken.durable_id == "d1"
    assert not a.renew_session("s", 1, now=1020.0, lease_s=10)
    assert not a.session_owned_by("s", "a", 1) and b.session_owned_by("s", "b", 2)
    i = ident({"n": 9})
    claim = policy.RecoveryClaim("s", 1, once=True)
    assert a.admit(i, method="POST", path="/v1/responses", now=1020.0, guard=GUARD, flow_id=None,
                   recovery=claim) == policy.Denied("upstream_request_timeout", "ownership_lost")


async def test_ledger_runner_runs_at_once_and_moves_to_its_thread_when_contended(tmp_path):
    import asyncio
    import threading

    from turnguard_core.ledger_runner import LedgerRunner

    path = tmp_path / "l.sqlite3"
    runner = LedgerRunner(Ledger(str(path), "a", busy_timeout_ms=5000), fast_busy_ms=20)
    runner.call_sync(lambda led: led.open(1000.0))
    threads = []
    orig = runner.ledger.admit

    def spy(*a, **kw):
        threads.append(threading.current_thread().name)
        return orig(*a, **kw)

    runner.ledger.admit = spy
    assert isinstance(await runner.call(lambda led: led.admit(
        ident({"n": 1}), method="POST", path="/v1/responses", now=1000.0, guard=GUARD,
        flow_id=None)), policy.Dispatch)
    assert threads == [threading.current_thread().name]  # uncontended: no hand-off

    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, blocker.execute, "ROLLBACK")  # the lock goes away while it waits
    got = await runner.call(lambda led: led.admit(
        ident({"n": 2}), method="POST", path="/v1/responses", now=1000.0, guard=GUARD,
        flow_id=None))
    assert isinstance(got, policy.Dispatch)
    assert threads[-1].startswith("turnguard-ledger")  # retried on the thread, not lost
    assert not runner._fast_possible()  # and calls stay there for a while
    runner.close()
    blocker.close()


def test_a_second_connection_in_the_same_process_keeps_the_first_ones_locks(tmp_path):
    """Closing any descriptor of a file drops every POSIX lock the process holds on it. Opening
    a second connection (the heartbeat's, or a reloaded script's) must not open and close the
    file: SQLite's locks of the first would vanish, another process's connection would take
    itself for the last one and delete the WAL on close, and every later write of the first
    would go to a deleted file that no one else reads."""
    import subprocess
    import sys

    def count_elsewhere() -> int:
        out = subprocess.run(
            [sys.executable, "-c",
             "import sqlite3, sys; db = sqlite3.connect(sys.argv[1]);"
             " print(db.execute('SELECT COUNT(*) FROM attempts').fetchone()[0]); db.close()",
             str(path)],
            capture_output=True, text=True, timeout=30,
        )
        return int(out.stdout)

    path = tmp_path / "l.sqlite3"
    a = open_ledger(path, "a")
    open_ledger(path, "b")
    admit(a, ident({"n": 1}))
    assert count_elsewhere() == 1
    admit(a, ident({"n": 2}))
    assert count_elsewhere() == 2


def test_recordings_past_the_replay_window_are_purged_unless_an_idempotency_key_keeps_them(
        ledger_backend):
    a = ledger_backend.open("a")
    plain, keyed = ident({"n": "plain"}), ident({"n": "keyed"}, idem="k-1")
    for i in (plain, keyed):
        d = admit(a, i)
        a.finish(d.attempt_id, AttemptEnd("completed", 200, 1, None,
                                          Recording(200, (("a", "b"),), b"body" * 100)), now=1001.0)
    assert a.purge_recordings(now=1001.0 + 299, window_s=300) == 0  # within the window
    assert isinstance(admit(a, plain, now=1001.0 + 299), policy.Replay)
    assert a.purge_recordings(now=1001.0 + 301, window_s=300) == 1
    # the Idempotency-Key's recording is kept, replayed for the retention
    assert ledger_backend.rows("SELECT COUNT(*) FROM spool") == [(1,)]
    assert isinstance(admit(a, keyed, now=1001.0 + 301), policy.Replay)
    assert isinstance(admit(a, plain, now=1001.0 + 301), policy.Dispatch)  # as without a purge
    assert ledger_backend.rows(
        "SELECT COUNT(*) FROM attempts WHERE headers IS NOT NULL") == [(1,)]


def test_purging_recordings_reads_only_the_recordings_past_the_window(tmp_path):
    """The purge runs every few seconds with the write lock held: its work must not grow
    with the ledger (it once read every operation: 0.2 s with 60,000 of them). Counted in
    SQLite virtual-machine steps, the same purge in a ledger of 10 and of 20,010 operations."""

    def steps_to_purge(extra_operations: int) -> int:
        path = tmp_path / f"l{extra_operations}.sqlite3"
        a = open_ledger(path)
        for n in range(10):
            d = admit(a, ident({"n": n}))
            a.finish(d.attempt_id, AttemptEnd("completed", 200, 1, None,
                                              Recording(200, (), b"body")), now=1001.0)
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO operations (op_key, scope, method, path, fingerprint, state,"
            " created_at, updated_at) VALUES (?, 's', 'POST', '/v1/responses', 'f',"
            " 'completed', 1000, 1000)", ((f"other-{i}",) for i in range(extra_operations)))
        db.execute("COMMIT")
        db.close()
        steps = 0

        def count() -> int:
            nonlocal steps
            steps += 1
            return 0

        a._conn().set_progress_handler(count, 100)
        assert a.purge_recordings(now=1001.0 + 301, window_s=300) == 10
        a._conn().set_progress_handler(None, 100)
        return steps

    small, large = steps_to_purge(0), steps_to_purge(20_000)
    assert large < 2 * small + 5, (small, large)


def test_a_replay_or_a_hold_is_decided_without_the_write_lock(tmp_path):
    """Only a claim needs BEGIN IMMEDIATE: while another connection holds the write lock a
    replay and a hold are still decided; a dispatch waits for the lock (and here fails)."""
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path)
    done, flying = ident({"n": "done"}), ident({"n": "flying"})
    d = admit(a, done)
    a.finish(d.attempt_id, AttemptEnd("completed", 200, 1, None, Recording(200, (), b"x")), now=1001.0)
    admit(a, flying)
    b = Ledger(str(path), "b", busy_timeout_ms=50)
    b.open(1000.0)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        assert isinstance(admit(b, done, now=1002.0), policy.Replay)
        assert isinstance(admit(b, flying, now=1002.0), policy.Hold)
        with pytest.raises(LedgerError):
            admit(b, ident({"n": "new"}), now=1002.0)
    finally:
        blocker.execute("ROLLBACK")


def test_a_batch_commits_its_writes_together_or_not_at_all(tmp_path):
    path = tmp_path / "l.sqlite3"
    a = open_ledger(path)
    ids = [admit(a, ident({"n": k})).attempt_id for k in range(3)]
    end = AttemptEnd("rejected", 500, 0)
    with a.batch():
        a.finish(ids[0], end, now=1001.0)
        a.first_event(ids[1])
    db = sqlite3.connect(path)
    outcomes = dict(db.execute("SELECT attempt_id, outcome FROM attempts").fetchall())
    assert outcomes[ids[0]] == "rejected"
    with pytest.raises(RuntimeError):
        with a.batch():
            a.finish(ids[1], end, now=1001.0)
            raise RuntimeError("a write of the batch failed")
    outcomes = dict(db.execute("SELECT attempt_id, outcome FROM attempts").fetchall())
    assert outcomes[ids[1]] == "in_flight"  # rolled back with the batch
    a.finish(ids[1], end, now=1001.0)  # and the ledger is usable after it


def _runner_counting_commits(tmp_path):
    """A ledger runner on a fresh ledger, and the list of the COMMITs its connection runs."""
    from turnguard_core.ledger_runner import LedgerRunner

    runner = LedgerRunner(Ledger(str(tmp_path / "l.sqlite3"), "a", busy_timeout_ms=5000))
    runner.call_sync(lambda led: led.open(1000.0))
    commits: list[str] = []
    runner.ledger._conn().set_trace_callback(
        lambda sql: commits.append(sql) if sql.startswith("COMMIT") else None)
    return runner, commits


async def test_deferred_writes_commit_in_one_transaction_before_any_later_call(tmp_path):
    runner, commits = _runner_counting_commits(tmp_path)
    i = ident({"n": 1})
    d = await runner.call(lambda led: admit(led, i))
    commits.clear()
    end = AttemptEnd("completed", 200, 1, None, Recording(200, (), b"x"))
    finished = runner.defer(lambda led: led.finish(d.attempt_id, end, now=1001.0))
    counted = runner.defer(lambda led: led.note_duplicates([(i.op_key, 1, 0)]))
    assert not finished.done()  # deferred: nothing written yet
    # a later call sees them: the admission replays the finished attempt
    assert isinstance(await runner.call(lambda led: admit(led, i, now=1002.0)), policy.Replay)
    assert (await finished).applied and await counted is None
    assert len(commits) == 1  # the two writes in one transaction; the replay wrote nothing
    runner.close()


async def test_deferred_writes_and_a_later_claim_commit_together(tmp_path):
    """A call made while writes are deferred runs in their transaction (one commit); a call
    that fails there is run again on its own, after them, and they still land."""
    runner, commits = _runner_counting_commits(tmp_path)
    i, j = ident({"n": 1}), ident({"n": 2})
    d = await runner.call(lambda led: admit(led, i))
    commits.clear()
    end = AttemptEnd("completed", 200, 1, None, Recording(200, (), b"x"))
    finished = runner.defer(lambda led: led.finish(d.attempt_id, end, now=1001.0))
    claim = await runner.call(lambda led: admit(led, j, now=1001.0))
    assert isinstance(claim, policy.Dispatch) and (await finished).applied
    assert len(commits) == 1

    ran = []

    def failing(led):
        ran.append(led.snapshot(i.op_key).state)
        if len(ran) == 1:
            raise RuntimeError("fails inside the shared transaction")
        return "ran alone"

    finished2 = runner.defer(lambda led: led.finish(claim.attempt_id, end, now=1002.0))
    assert await runner.call(failing) == "ran alone"
    assert (await finished2).applied
    assert runner.ledger.snapshot(j.op_key).state == "completed"
    runner.close()


async def test_a_heavy_deferred_write_runs_on_the_ledgers_thread_and_keeps_the_order(tmp_path):
    import threading

    from turnguard_core.ledger_runner import LedgerRunner

    runner = LedgerRunner(Ledger(str(tmp_path / "l.sqlite3"), "a", busy_timeout_ms=5000))
    runner.call_sync(lambda led: led.open(1000.0))
    i = ident({"n": 1})
    d = await runner.call(lambda led: admit(led, i))
    big = AttemptEnd("completed", 200, 1, None, Recording(200, (), b"x" * (1 << 20)))
    ran_on = []

    def finish(led):
        ran_on.append(threading.current_thread().name)
        return led.finish(d.attempt_id, big, now=1001.0)

    finished = runner.defer(finish, heavy=True)
    replay = await runner.call(lambda led: admit(led, i, now=1002.0))  # queued behind it
    assert (await finished).applied and isinstance(replay, policy.Replay)
    assert ran_on[0].startswith("turnguard-ledger")
    assert len((await runner.call(lambda led: led.recording(d.attempt_id))).body) == 1 << 20
    runner.close()


def test_an_attempt_end_whose_detail_holds_a_nul_is_recorded(ledger_backend):
    """An error text may carry any character; the end must land (a write that cannot land is
    kept and retried for ever), on either store."""
    led = ledger_backend.open("a")
    d = admit(led, ident({"nul": 1}))
    assert led.finish(d.attempt_id, AttemptEnd("unknown", None, 0, "reset\x00by peer"),
                      now=1001.0).applied
    assert led.snapshot(ident({"nul": 1}).op_key).state == "unknown"


def test_idle_wal_is_emptied_only_once_no_other_connection_committed_for_its_idle_time():
    idle = IdleWal(idle_s=2.0)
    assert not idle.after_checkpoint(WalState(frames=10, version=1), now=0.0)  # first sight
    assert not idle.after_checkpoint(WalState(frames=10, version=1), now=1.9)
    assert idle.after_checkpoint(WalState(frames=10, version=1), now=2.0)
    assert idle.after_checkpoint(WalState(frames=10, version=1), now=2.25)  # it failed: again
    assert not idle.after_checkpoint(WalState(frames=0, version=1), now=2.5)  # emptied
    assert not idle.after_checkpoint(WalState(frames=0, version=1), now=9.0)  # nothing to empty
    # a commit elsewhere (the version moves) starts the idle time again
    assert not idle.after_checkpoint(WalState(frames=4, version=2), now=9.25)
    assert not idle.after_checkpoint(WalState(frames=9, version=3), now=11.0)
    assert not idle.after_checkpoint(WalState(frames=9, version=3), now=12.9)
    assert idle.after_checkpoint(WalState(frames=9, version=3), now=13.0)


def _wal_bytes(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_the_heartbeat_empties_the_wal_of_an_idle_ledger_and_keeps_every_write(tmp_path):
    path = tmp_path / "l.sqlite3"
    main = Ledger(str(path), "a", checkpoint_on_commit=False)
    main.open(1000.0)
    beat = Heartbeat(Ledger(str(path), "a"), interval_s=60.0, on_reregistered=lambda n: None,
                     on_file_gone=lambda why: None, idle_truncate_s=0.3)
    beat.start(1000.0)
    try:
        idents = [ident({"n": n}) for n in range(50)]
        for i in idents:
            d = admit(main, i)
            main.finish(d.attempt_id, AttemptEnd("completed", 200, 3, None,
                                                 Recording(200, (), b"x" * 3000)), now=1001.0)
        assert _wal_bytes(path) > 0
        deadline = time.monotonic() + 30
        while _wal_bytes(path) and time.monotonic() < deadline:  # bounded
            time.sleep(0.05)
        assert _wal_bytes(path) == 0
        for i in idents:  # every write is in the database file now
            assert isinstance(admit(main, i, now=1002.0), policy.Replay)
        assert main.recording(admit(main, idents[0], now=1002.0).attempt_id).body == b"x" * 3000
    finally:
        beat.stop()
        main.close()


def test_emptying_the_wal_gives_up_while_a_reader_needs_it(tmp_path):
    path = tmp_path / "l.sqlite3"
    led = open_ledger(path)
    admit(led, ident({"n": 1}))
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM operations").fetchone()  # a snapshot in the WAL
    try:
        led.truncate_wal()  # waits at most TRUNCATE_BUSY_MS, then leaves the WAL as it is
        assert _wal_bytes(path) > 0
        assert led.checkpoint().frames > 0
    finally:
        reader.execute("COMMIT")
    led.truncate_wal()
    assert _wal_bytes(path) == 0 and led.checkpoint().frames == 0
    assert led.busy_timeout_ms == 5000
    assert led._conn().execute("PRAGMA busy_timeout").fetchone()[0] == 5000  # restored


def test_a_process_notes_in_the_new_file_that_its_attempts_in_flight_moved_there(ledger_backend):
    """``mark_moved``/``moved_peers``: what a process that left a deleted or replaced ledger
    file waits for from each peer that had attempts in flight there (both stores)."""
    a = ledger_backend.open("a", 1000.0)
    b = ledger_backend.open("b", 1000.0)
    assert b.moved_peers("gen-left") == set()
    a.mark_moved("gen-left", 1001.0)
    a.mark_moved("gen-left", 1002.0)  # noted again: still one note
    b.mark_moved("gen-another", 1001.0)
    assert b.moved_peers("gen-left") == {"a"}
    assert a.moved_peers("gen-another") == {"b"}
