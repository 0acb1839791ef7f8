"""Ledger faults: a locked database, a read-only file or folder, a full disk, a corrupt or
non-SQLite file, a schema from a future version.

What turnguard promises for each: it keeps proxying (duplicates still coalesced in memory), a
decision that needs the ledger fails closed with a clear error and a ``ledger_unavailable``
event, and it recovers by itself when the fault goes away.

Faults are made for real under a real mitmdump: another connection holds the write lock,
``chattr +i`` makes the files and folder read-only (also for root), a tiny tmpfs is filled up, a
junk or future-schema file sits at the ledger path. Root is needed for chattr and mount; without
it those tests skip."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from turnguard_faults import fill, mount_tmpfs, unfill, unmount, wal_at_its_end
from harness import (
    MockUpstream,
    Regression,
    assert_no_traceback,
    check,
    default_tls,
    guarded,
    ledger_integrity,
    post_turn,
    turnguard_events,
    wait_until,
)

HEADERS = {"authorization": "Bearer sk-ledger-faults", "session-id": "sess-plain"}
# another session: a completed plain request must not reset the anchored turn's circuit
ANCHORED = {**HEADERS, "session-id": "sess-anchored", "x-codex-turn-state": "ts_faults"}
TURN = {"model": "gpt-test", "input": "the anchored turn", "stream": True}
ONCE = "server_anchored_replay_once"


# -----------------------------------------------------------------------------------------------
# Making faults (root only: chattr and mount). Every fault is undone in a finally block, or
# pytest could not delete its temporary folders afterwards.


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def immutable(*paths: Path):
    """``chattr +i``: the files (or folder entries) cannot be written, even by root."""
    done: list[Path] = []
    try:
        for p in paths:
            if p.exists():
                r = _run("chattr", "+i", str(p))
                if r.returncode != 0:
                    pytest.skip(f"chattr +i not possible here: {r.stderr.strip()}")
                done.append(p)
        yield
    finally:
        for p in done:
            _run("chattr", "-i", str(p))


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str = "2m"):
    try:
        mount_tmpfs(path, size)
    except OSError as e:
        pytest.skip(str(e))
    try:
        yield path
    finally:
        unmount(path)


# -----------------------------------------------------------------------------------------------
# Proxy and client helpers


def proxy(tmp_path: Path, up: MockUpstream, ledger: Path, name: str = "mitmdump", **options):
    return guarded(tmp_path, up, name, ledger=ledger, **options)


def events(tmp_path: Path, kind: str | None = None, name: str = "mitmdump") -> list[dict]:
    return turnguard_events(tmp_path, name, kind)


def post(url, headers=HEADERS, body=None, behaviour: dict | None = None, timeout: float = 60):
    """One request (status 0 on a transport error or a cut stream)."""
    return post_turn(url, headers, body, behaviour=behaviour, cut_is_error=True, timeout=timeout)


def body_of(tag: str) -> dict:
    return {"model": "gpt-test", "input": f"ledger faults: {tag}", "stream": True}


def dispatches_of(up: MockUpstream, body: dict) -> int:
    import hashlib

    digest = hashlib.sha256(json.dumps(body).encode()).hexdigest()
    return sum(1 for d in up.dispatches() if d["body_sha256"] == digest)


def assert_duplicates_coalesced(url: str, up: MockUpstream, tag: str) -> None:
    """Three identical requests while the first is slow upstream: one dispatch, three equal
    answers (the duplicates held and answered from the original, in memory)."""
    body = body_of(tag)
    slow = {"kind": "slow", "delay_ms": 1000}
    with ThreadPoolExecutor(max_workers=3) as pool:
        first = pool.submit(post, url, HEADERS, body, slow)
        wait_until(lambda: dispatches_of(up, body) == 1, 10, what="the original dispatched")
        rest = [pool.submit(post, url, HEADERS, body, slow) for _ in range(2)]
        results = [first.result(), *(f.result() for f in rest)]
    assert [r[0] for r in results] == [200, 200, 200]
    assert len({r[2] for r in results}) == 1
    assert dispatches_of(up, body) == 1


def wait_ledger_used_again(tmp_path: Path, url: str, timeout: float = 20) -> None:
    """Recovery: a fresh request is admitted through the ledger again (bounded wait)."""
    seen = {"n": 0}

    def used() -> bool:
        seen["n"] += 1
        post(url, HEADERS, body_of(f"recovered? {seen['n']}"))
        return any(e["ledger"] for e in events(tmp_path, "dispatch")
                   if e["ts"] > started)

    started = time.time()
    wait_until(used, timeout, interval=1.0, what="the ledger used again")


# -----------------------------------------------------------------------------------------------
# Faults during a run, under a real mitmdump


def test_a_copy_made_anew_on_a_full_disk_leaves_no_part_and_is_made_once_there_is_room(
        tmp_path):
    """The ledger's -wal is deleted under its connection on a full disk: the copy put in the
    file's place (``Ledger.make_anew``) cannot be made; the part made is removed (it would only
    take the room other writes need), and the copy is made once there is room."""
    from test_ledger import admit, ident, open_ledger
    from turnguard_core.ledger import LedgerError

    folder = tmp_path / "ledger-fs"
    with tiny_tmpfs(folder, "4m"):
        path = folder / "l.sqlite3"
        led = open_ledger(path, "a")
        for n in range(50):
            admit(led, ident({"n": n, "pad": "x" * 2000}))
        os.unlink(f"{path}-wal")
        fill(folder)
        before = sorted(p.name for p in folder.iterdir())
        with pytest.raises(LedgerError):
            led.make_anew()
        assert sorted(p.name for p in folder.iterdir()) == before
        unfill(folder)
        assert led.make_anew()
        assert sorted(p.name for p in folder.iterdir()) == ["l.sqlite3"]
        led.close()
        again = open_ledger(path, "b")
        assert again.counts() == {"in_flight": 50}
        again.close()


def test_disk_full_keeps_proxying_fails_closed_and_recovers(tmp_path, report):
    folder = tmp_path / "ledger-fs"
    with tiny_tmpfs(folder, "8m"):  # (room for the scratch writes of wal_at_its_end)
        ledger = folder / "ledger.sqlite3"
        # indefinite mode: once mode fails a session's requests closed while the ledger is
        # down (see test_at_most_once.py)
        with MockUpstream(tmp_path) as up, proxy(
            tmp_path, up, ledger, turnguard_recovery_mode="server_indefinite_recovery",
            turnguard_cooldown_ms=2000,
        ) as p:
            # one eventless failure of the anchored turn while the ledger works: the session is
            # claimed (owner proof in hand), the circuit has one failure
            assert post(p.url, ANCHORED, TURN, {"kind": "reset"})[0] in (0, 502)
            with wal_at_its_end(ledger):  # (every write must grow the WAL: fails, full)
                fill(folder)
                try:
                    assert post(p.url, HEADERS, body_of("plain"))[0] == 200  # keeps proxying
                    unavailable = events(tmp_path, "ledger_unavailable")
                    assert unavailable and "full" in unavailable[0]["error"]
                    assert_duplicates_coalesced(p.url, up, "duplicates while full")
                    # the second eventless failure opens the cooldown (kept in memory) ...
                    assert post(p.url, ANCHORED, TURN, {"kind": "reset"})[0] in (0, 502)
                    assert events(tmp_path, "circuit_opened")
                    # ... the next request is held through it, and its recovery claim needs the
                    # ledger: it fails closed, nothing dispatched
                    status, _, body = post(p.url, {**ANCHORED, "accept": "application/json"}, TURN,
                                           {"kind": "ok"})
                    assert status == 503
                    assert json.loads(body)["error"]["code"] == "upstream_request_timeout"
                    assert "ledger" in json.loads(body)["error"]["message"]
                    assert [e["reason"] for e in events(tmp_path, "fail_closed")] == [
                        "ledger_unavailable"]
                    assert dispatches_of(up, TURN) == 2
                finally:
                    unfill(folder)
            wait_ledger_used_again(tmp_path, p.url)
        assert ledger_integrity(ledger) == "ok"
        assert_no_traceback(p.log_text())
    report("ledger on a full disk: kept proxying, duplicates coalesced in memory (1 dispatch), "
           "recovery claim failed closed (503 ledger_unavailable), ledger used again once freed")


def test_read_only_ledger_files_and_folder_keep_proxying_and_recover(tmp_path):
    folder = tmp_path / "ledger-dir"
    folder.mkdir(mode=0o700)
    ledger = folder / "ledger.sqlite3"
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, ledger) as p:
        assert post(p.url, HEADERS, body_of("before"))[0] == 200
        wal = Path(str(ledger) + "-wal")
        # the -shm file stays writable: it is mmapped, and a write fault there is a SIGBUS
        with immutable(ledger, wal, folder):
            assert post(p.url, HEADERS, body_of("read-only"))[0] == 200
            assert events(tmp_path, "ledger_unavailable")
            assert_duplicates_coalesced(p.url, up, "duplicates while read-only")
        wait_ledger_used_again(tmp_path, p.url)
    assert ledger_integrity(ledger) == "ok"
    assert_no_traceback(p.log_text())


def test_locked_ledger_keeps_proxying_and_recovers(tmp_path, report):
    ledger = tmp_path / "ledger.sqlite3"
    with MockUpstream(tmp_path) as up, proxy(tmp_path, up, ledger) as p:
        assert post(p.url, HEADERS, body_of("before"))[0] == 200
        blocker = sqlite3.connect(ledger, isolation_level=None, timeout=1)
        blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        pool = ThreadPoolExecutor(max_workers=1)
        unrelated_s = None
        try:
            guarded = pool.submit(post, p.url, {**HEADERS, "session-id": "locked"},
                                  body_of("while locked"), None, 120)
            time.sleep(0.5)
            started = time.monotonic()
            try:  # traffic turnguard does not even guard
                with httpx.Client(trust_env=False, timeout=10, verify=default_tls()) as c:
                    assert c.get(p.url + "/_mock/health").status_code == 200
                unrelated_s = time.monotonic() - started
            except httpx.TimeoutException:
                pass
            # the lock is held past the busy timeout: the ledger is reported unavailable, and
            # the guarded request is answered all the same, while the lock is still held
            wait_until(lambda: events(tmp_path, "ledger_unavailable"), 30,
                       what="ledger_unavailable")
            assert guarded.result(timeout=90)[0] == 200
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
            pool.shutdown(wait=True)
        unavailable = events(tmp_path, "ledger_unavailable")
        assert all("locked" in e["error"] for e in unavailable)
        wait_ledger_used_again(tmp_path, p.url)
        assert ledger_integrity(ledger) == "ok"
        assert_no_traceback(p.log_text())
    took = "> 10" if unrelated_s is None else f"{unrelated_s:.1f}"
    report(f"ledger write-locked by another process: an unguarded GET took {took} s")
    # a generous bound: unrelated traffic normally passes in milliseconds
    check(unrelated_s is not None and unrelated_s < 3,
              f"a GET that turnguard does not guard waited {took} s while the ledger was "
              "locked: the whole proxy was frozen")


# -----------------------------------------------------------------------------------------------
# Faults present when the ledger is opened, under a real mitmdump


def _junk(ledger: Path) -> None:
    ledger.write_bytes(b"this is not an SQLite database\n" * 512)
    os.chmod(ledger, 0o600)


def _future(ledger: Path) -> None:
    db = sqlite3.connect(ledger)
    db.execute("CREATE TABLE from_the_future (x)")
    db.execute("PRAGMA user_version=99")
    db.commit()
    db.close()
    os.chmod(ledger, 0o600)


@contextlib.contextmanager
def startup_fault(kind: str, tmp_path: Path):
    """The ledger path with a fault; ``fix()`` (yielded) removes it, as an operator would."""
    folder = tmp_path / "ledger-dir"
    if kind == "disk_full":
        with tiny_tmpfs(folder, "1m"):
            fill(folder)
            try:
                yield folder / "ledger.sqlite3", lambda: unfill(folder)
            finally:
                unfill(folder)
        return
    folder.mkdir(mode=0o700)
    ledger = folder / "ledger.sqlite3"
    if kind == "junk":
        _junk(ledger)
        yield ledger, ledger.unlink
    elif kind == "future_schema":
        _future(ledger)
        yield ledger, ledger.unlink
    elif kind == "read_only_folder":
        stack = contextlib.ExitStack()
        with stack:
            stack.enter_context(immutable(folder))
            yield ledger, stack.close
    else:  # pragma: no cover
        raise ValueError(kind)


@pytest.mark.parametrize(
    "kind", ["junk", "future_schema", "read_only_folder", "disk_full"]
)
def test_ledger_fault_at_startup_proxy_keeps_running_and_recovers(tmp_path, kind):
    with startup_fault(kind, tmp_path) as (ledger, fix), MockUpstream(tmp_path) as up:
        try:
            p = proxy(tmp_path, up, ledger)
        except RuntimeError as e:  # exited before it listened
            raise Regression(f"mitmdump did not start with a faulty ledger ({kind}): {e}") from e
        try:
            time.sleep(1.5)  # mitmproxy's errorcheck acts right after startup
            check(p.proc.poll() is None,
                      f"mitmdump exited ({p.proc.returncode}) because the ledger was unusable "
                      f"({kind}):\n{p.log_text()[-1500:]}")
            assert post(p.url, HEADERS, body_of("plain"))[0] == 200
            assert [e["during"] for e in events(tmp_path, "ledger_unavailable")][:1] == ["open"]
            assert_duplicates_coalesced(p.url, up, "duplicates, no ledger")
            if kind == "future_schema":  # a newer turnguard's file is left as it was
                db = sqlite3.connect(ledger)
                assert db.execute("PRAGMA user_version").fetchone()[0] == 99
                assert [r[0] for r in db.execute("SELECT name FROM sqlite_master")] == [
                    "from_the_future"]
                db.close()
            fix()
            wait_ledger_used_again(tmp_path, p.url, timeout=20)  # it retries every ~5 s
            assert ledger_integrity(ledger) == "ok"
            assert_no_traceback(p.log_text())
        finally:
            p.stop()


def test_recovery_decision_without_a_ledger_fails_closed_as_ledger_unavailable(tmp_path):
    """Indefinite mode (once mode fails such requests closed at once, see below): the turn
    runs in memory until a cooldown, and the recovery needs the ledger's owner proof."""
    ledger = tmp_path / "ledger.sqlite3"
    _junk(ledger)
    with MockUpstream(tmp_path) as up:
        try:
            p = proxy(tmp_path, up, ledger, turnguard_recovery_mode="server_indefinite_recovery",
                      turnguard_cooldown_ms=3000)
        except RuntimeError as e:
            raise Regression(f"mitmdump did not start with a junk ledger: {e}") from e
        try:
            time.sleep(1.5)
            check(p.proc.poll() is None, "mitmdump exited because the ledger was unusable")
            # two eventless failures of the anchored turn: a cooldown, kept in memory
            for _ in range(2):
                assert post(p.url, ANCHORED, TURN, {"kind": "reset"})[0] in (0, 502)
            assert events(tmp_path, "circuit_opened")
            before = len(events(tmp_path, "ledger_unavailable"))
            # the next one would be held and recovered with a ledger claim: no ledger, so it
            # fails closed, and says why
            status, _, body = post(p.url, {**ANCHORED, "accept": "application/json"}, TURN,
                                   {"kind": "ok"})
            assert status == 503
            assert dispatches_of(up, TURN) == 2
            message = json.loads(body)["error"]["message"]
            reasons = [e["reason"] for e in events(tmp_path, "fail_closed")]
            assert_no_traceback(p.log_text())
        finally:
            p.stop()
    check(reasons == ["ledger_unavailable"] and "ledger" in message
              and len(events(tmp_path, "ledger_unavailable")) > before,
              f"fail_closed reasons {reasons}, message {message!r}: nothing says the ledger is "
              "the cause")


def test_each_ledger_outage_is_logged(tmp_path):
    folder = tmp_path / "ledger-fs"
    with tiny_tmpfs(folder, "8m"):  # (room for the scratch writes of wal_at_its_end)
        ledger = folder / "ledger.sqlite3"
        with MockUpstream(tmp_path) as up, proxy(tmp_path, up, ledger) as p:
            for outage in range(2):
                with wal_at_its_end(ledger):  # (every write must grow the WAL: fails, full)
                    fill(folder)
                    try:
                        assert post(p.url, HEADERS, body_of(f"outage {outage}"))[0] == 200
                    finally:
                        unfill(folder)
                wait_ledger_used_again(tmp_path, p.url)
            log = p.log_text()
            assert_no_traceback(log)
    lines = [line for line in log.splitlines() if str(ledger) in line
             and ("unusable" in line.lower() or "unavailable" in line.lower())]
    check(len(lines) >= 2, f"two outages of the ledger, {len(lines)} log line(s) about them")


@pytest.mark.parametrize("what", ["folder", "file"])
def test_ledger_open_raises_ledger_error_when_read_only(tmp_path, what):
    from turnguard_core.ledger import Ledger, LedgerError

    folder = tmp_path / "ro"
    folder.mkdir(mode=0o700)
    path = folder / "l.sqlite3"
    if what == "file":
        path.touch(mode=0o600)
    with immutable(folder if what == "folder" else path):
        led = Ledger(str(path), "a")
        try:
            led.open(time.time())
        except LedgerError:
            return
        except OSError as e:
            raise Regression(f"Ledger.open raised {e!r}, not LedgerError") from e
        finally:
            led.close()
        raise AssertionError(f"opening a ledger in a read-only {what} succeeded")
