"""The PostgreSQL ledger's own parts, in-process on a real server: the location and its masked
password, migrations when several processes start at once, a database made again, a claim in
doubt when the connection broke, the attempt-end notifications through ``FailoverStore`` (and
the fallback when they are lost), and the control tool on a PostgreSQL URL. (The contract both
stores keep is tested on both in test_ledger.py and test_recovery_machine.py.)"""

from __future__ import annotations

import asyncio
import collections
import io
import json
import threading
import time

import psycopg
import pytest

from turnguard_core import circuit, identity, ledger_cli, liveness, pg_ledger, policy
from turnguard_core.ending import AttemptEnding
from turnguard_core.failover import FailoverStore
from turnguard_core.knowledge import MemoryStore
from turnguard_core.ledger import AttemptEnd, LedgerError, Recording
from turnguard_core.ledger_location import display, is_postgres
from turnguard_core.ledger_runner import contended
from turnguard_core.pg_ledger import SCHEMA_VERSION as PG_SCHEMA_VERSION
from turnguard_core.pg_ledger import (NOTIFY_CHANNEL, READERS_KEPT, AttemptEndListener,
                                      PgLedger, PgLedgerAdmin)
from turnguard_shell import config

from harness import wait_until
from store_attempt import StoreAttempt

GUARD = policy.GuardPolicy(replay=True, replay_window_s=300, retention_s=3600)


def ident(n: int) -> identity.Identity:
    view = identity.RequestView("POST", "/v1/responses", (("authorization", "Bearer k"),),
                                json.dumps({"n": n}).encode())
    out = identity.identify(view)
    assert isinstance(out, identity.Identity)
    return out


def with_password(url: str, password: str = "s3cret-pw") -> str:
    scheme, _, rest = url.partition("://")
    user, _, host = rest.partition("@")
    return f"{scheme}://{user}:{password}@{host}"


def sql(url: str, query: str, args=()) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as db:
        cur = db.execute(query, args)
        return cur.fetchall() if cur.description else []


# -- the location --------------------------------------------------------------------------------
@pytest.mark.parametrize("location, shown", [
    ("postgresql://tg:pw@db.example:5432/ledger", "postgresql://tg:***@db.example:5432/ledger"),
    ("postgres://tg:p%40ss@h/l?sslmode=require", "postgres://tg:***@h/l?sslmode=require"),
    ("postgresql://h/l?user=tg&password=pw&sslmode=require",
     "postgresql://h/l?user=tg&password=***&sslmode=require"),
    ("postgresql:///l?service=turnguard", "postgresql:///l?service=turnguard"),
    ("postgresql://tg@h/l", "postgresql://tg@h/l"),
    # libpq decodes a parameter's name: these are the password too; sslpassword is a secret
    ("postgresql://tg@h/l?%70assword=pw", "postgresql://tg@h/l?%70assword=***"),
    ("postgresql://h?PassWord=pw&sslpassword=key&a=b",
     "postgresql://h?PassWord=***&sslpassword=***&a=b"),
    ("/var/lib/turnguard/ledger.sqlite3", "/var/lib/turnguard/ledger.sqlite3"),
    # libpq's key/value form (refused as a ledger, but shown in the refusal)
    ("host=db user=tg password=pw dbname=l", "host=db user=tg password=*** dbname=l"),
    ("host = db  password = 'p w\\' x' sslpassword=key", "host = db  password = *** sslpassword=***"),
    ("/var/lib/x=y/ledger.sqlite3", "/var/lib/x=y/ledger.sqlite3"),
    # libpq ends the credentials at the first "@" before any "/": a raw "?" or "#" in the
    # password is the password's
    ("postgresql://tg:12?34@h/l", "postgresql://tg:***@h/l"),
    ("postgresql://tg:ab#cd@h:5432/l?sslmode=disable", "postgresql://tg:***@h:5432/l?sslmode=disable"),
    # a raw "/", "@" or "&" in a password: libpq reads part of it as the host, the port, the
    # database or a query word (such a URL is refused); the password is still all kept back
    ("postgresql://tg:ab/cd@h:5432/l", "postgresql://tg:***@h:5432/l"),
    ("postgresql://tg:ab@cd@h/l", "postgresql://tg:***@h/l"),
    ("postgresql://tg:ab?cd/ef@h/l", "postgresql://tg:***@h/l"),
    ("postgresql://tg@h/l?password=ab&cd", "postgresql://tg@h/l?password=***&***"),
    # a key/value string libpq would not parse: from the password on, nothing is shown
    ('host=db password="p w" dbname=l', "host=db password=***"),
    ("host=db password=pw dbname", "host=db password=***"),
])
def test_the_location_is_shown_without_its_password(location, shown):
    assert display(location) == shown
    assert is_postgres(location) == location.startswith("postgres")


@pytest.mark.parametrize("url", ["postgresql://tg:ab?cd@127.0.0.1/l",
                                 "postgresql://tg:ab#cd@127.0.0.1:x/l"])
def test_a_url_with_a_raw_question_mark_or_hash_in_its_password_never_shows_it(url):
    """Accepted as libpq reads it, or refused for its port: never a message quoting it."""
    from turnguard_core.ledger_location import check_postgres_url, scrub

    try:
        assert check_postgres_url(url) == url
    except ValueError as e:
        assert "ab" not in str(e) and "cd" not in str(e), e
    password = url.split("tg:", 1)[1].split("@", 1)[0]
    assert "ab" not in display(url) and scrub(f"pw was {password}", url) == "pw was ***"


@pytest.mark.parametrize("url", ["postgresql://tg:ab@cd@h/l", "postgresql://tg:ab?cd/ef@h/l"])
def test_every_part_of_a_password_libpq_would_misread_is_scrubbed(url):
    """What libpq reads as the password and what the URL meant as one overlap (``ab`` and
    ``ab@cd``): every character either covers is hidden, not only the first one found."""
    from turnguard_core.ledger_location import scrub

    scrubbed = scrub(f"invalid value {url!r}", url)
    assert scrubbed.startswith("invalid value 'postgresql://tg:***"), scrubbed
    assert "ab" not in scrubbed and "cd" not in scrubbed, scrubbed


def test_turnguard_ledger_takes_a_postgres_url_and_refuses_a_bad_one_without_its_password(tmp_path):
    url = "postgresql://tg:hunter2@127.0.0.1:5432/ledger"
    assert config.ledger_path(url, str(tmp_path)) == url
    with pytest.raises(ValueError) as refused:
        config.ledger_path("postgresql://tg:hunter2@127.0.0.1:port/ledger", str(tmp_path))
    assert "hunter2" not in str(refused.value) and "***" in str(refused.value)


def test_a_failure_never_shortens_an_open_cooldown():
    """Another replica (another clock, a shorter turnguard_cooldown_ms) records a failure: the
    cooldown it would open ends earlier than the one in force, which stands."""
    cfg = circuit.CircuitConfig(threshold=1, cooldown_s=10, cooldown_max_s=10)
    longer = circuit.CircuitState(3, 2000.0, 600)
    after, transition = circuit.record_outcome(longer, eventless_failure=True, completed=False,
                                               now=1000.0, cfg=cfg)
    assert after.open_until == 2000.0 and after.failures == 4 and transition == "opened"


# -- schema, generation, connection faults ---------------------------------------------------------
def test_processes_that_start_together_migrate_the_schema_once(pg_url):
    ledgers = [PgLedger(pg_url, f"p{k}") for k in range(6)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(ledgers))

    def open_one(led):
        start.wait()
        try:
            led.open(time.time())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_one, args=(led,)) for led in ledgers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len({led.generation for led in ledgers}) == 1 and ledgers[0].generation
    assert sql(pg_url, "SELECT value FROM meta WHERE key='schema_version'") == [
        (str(PG_SCHEMA_VERSION),)]
    assert sql(pg_url, "SELECT COUNT(*) FROM instances") == [(6,)]
    for led in ledgers:
        led.close()


def test_a_database_made_again_is_an_error_not_an_empty_ledger(pg_url):
    led = PgLedger(pg_url, "a")
    led.open(1000.0)
    assert led.file_replaced() is None
    sql(pg_url, "DROP TABLE meta, spool, attempts, operations, circuits, sessions, instances,"
                " control_audit")
    PgLedger(pg_url, "b").open(1001.0)  # another process makes a new ledger there
    with pytest.raises(LedgerError, match="replaced"):
        led.heartbeat(1002.0)
    assert "replaced" in led.file_replaced()
    led.close()


def _turnguard_connections(pg_url: str) -> int:
    return sql(pg_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name='turnguard'"
                       " AND datname=current_database()")[0][0]


def test_reads_apart_keep_their_connections_and_never_read_a_database_made_again(
        pg_url, monkeypatch):
    """Reads apart, one after another, use one read-only connection kept for them (each used
    to connect: a server process each time, in an outage, many at once); several at once
    keep ``READERS_KEPT`` at most. A kept one the server ended gives way to a new one. Once the
    ledger's tables were dropped and made again, a kept one refuses to read (the new tables
    know nothing of the turns in flight), and ``close`` closes them all."""
    a = PgLedger(pg_url, "a")
    a.open(1000.0)
    turn = ident(1)
    claim = a.admit(turn, method="POST", path="/v1/responses", now=1000.0, guard=GUARD,
                    flow_id="f")
    for _ in range(5):
        assert a.read_apart(lambda led: led.snapshot(turn.op_key)).current_attempt \
            == claim.attempt_id
    assert _turnguard_connections(pg_url) == 2  # (A's own, and one kept for reads apart)

    together = threading.Barrier(READERS_KEPT + 2)

    def read_together():
        return a.read_apart(lambda led: (together.wait(10), led.snapshot(turn.op_key))[1])

    readers = [threading.Thread(target=read_together) for _ in range(READERS_KEPT + 2)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(20)
    assert not any(reader.is_alive() for reader in readers)
    # (the server ends a backend after its client closed the connection, not at once: on a
    # busy machine the two not kept were still listed when asked at once)
    wait_until(lambda: _turnguard_connections(pg_url) == 1 + READERS_KEPT, 10,
               what=f"{READERS_KEPT} kept for reads apart, the others closed")

    sql(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE"
                " application_name='turnguard' AND datname=current_database() AND pid<>%s",
        (a._db.info.backend_pid,))
    wait_until(lambda: _turnguard_connections(pg_url) == 1, 10, what="the kept ones ended")
    with monkeypatch.context() as m:
        # (whether the end is seen before the read is a race: here it is not, so the read's
        # first query fails, and a new connection reads)
        m.setattr(pg_ledger, "_ended_while_idle", lambda db: False)
        assert a.read_apart(lambda led: led.snapshot(turn.op_key)).current_attempt \
            == claim.attempt_id
    assert a.read_apart(lambda led: led.snapshot(turn.op_key)).current_attempt \
        == claim.attempt_id
    assert _turnguard_connections(pg_url) == 2

    sql(pg_url, "DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    b = PgLedger(pg_url, "b")
    b.open(1001.0)  # another ledger there: B's claim has A's attempt id
    assert b.admit(turn, method="POST", path="/v1/responses", now=1001.0, guard=GUARD,
                   flow_id="g").attempt_id == claim.attempt_id
    with pytest.raises(LedgerError, match="replaced"):
        a.read_apart(lambda led: led.snapshot(turn.op_key))
    b.close()
    a.close()
    wait_until(lambda: _turnguard_connections(pg_url) == 0, 10, what="every connection closed")


def _a_turn_claimed_then_the_tables_dropped(pg_url: str):
    """A (``PgLedger`` "a") claims a turn; then the ledger's tables are dropped while A's
    connection stays open. Returns A, the turn and its claim."""
    a = PgLedger(pg_url, "a")
    a.open(1000.0)
    turn = ident(1)
    claim = a.admit(turn, method="POST", path="/v1/responses", now=1000.0, guard=GUARD,
                    flow_id="f")
    sql(pg_url, "DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    return a, turn, claim


def _writes_by_attempt_id(a: PgLedger, turn, claim) -> dict:
    """A's writes of its claimed attempt, by step."""
    return {
        "first event": lambda: a.first_event(claim.attempt_id, turn.op_key),
        "finish": lambda: a.finish(claim.attempt_id, AttemptEnd("completed", 200, 3, None, None),
                                   now=1002.0, op_key=turn.op_key),
    }


@pytest.mark.parametrize("step", ["first event", "finish", "what it left behind"])
def test_nothing_is_written_to_nor_read_from_a_database_made_again_before_it_is_noticed(
        pg_url, step):
    """A's connection stayed open while the ledger's tables were dropped and made again, and
    B claimed the same turn there (attempt ids start again: B's has A's id). Before A has
    noticed (its next heartbeat), A's writes by attempt id fail (``replaced``) instead of
    landing on B's attempt, and what A reads of the ledger it leaves (which peers had turns in
    flight there) is an error, not the new tables' rows, which know nothing of A's turn."""
    a, turn, claim = _a_turn_claimed_then_the_tables_dropped(pg_url)
    b = PgLedger(pg_url, "b")
    b.open(1001.0)
    theirs = b.admit(turn, method="POST", path="/v1/responses", now=1001.0, guard=GUARD,
                     flow_id="g")
    assert theirs.attempt_id == claim.attempt_id  # (the same id, another attempt)
    step_of = {**_writes_by_attempt_id(a, turn, claim),
               "what it left behind": lambda: a.attempts_left_behind()}
    with pytest.raises(LedgerError, match="replaced"):
        step_of[step]()
    assert "replaced" in a.file_replaced()
    assert sql(pg_url, "SELECT instance_id, outcome, events_seen FROM attempts") \
        == [("b", "in_flight", 0)]
    a.close()
    b.close()


@pytest.mark.parametrize("connection", ["kept", "ended by the server"])
@pytest.mark.parametrize("step", ["first event", "finish", "heartbeat"])
def test_nothing_is_written_to_a_database_whose_tables_were_dropped_and_not_made_again(
        pg_url, step, connection):
    """The ledger's tables were dropped while A's connection stayed open (or the server also
    ended that connection), and nobody has made them again yet: A's next write by attempt id
    is refused as a ledger replaced, not read as a passing error to retry, and from then on
    A says so (``file_replaced``) and makes no table of its own there."""
    a, turn, claim = _a_turn_claimed_then_the_tables_dropped(pg_url)
    if connection == "ended by the server":
        _end_ledger_connections(pg_url)
    step_of = {**_writes_by_attempt_id(a, turn, claim), "heartbeat": lambda: a.heartbeat(1002.0)}
    with pytest.raises(LedgerError, match="replaced"):
        step_of[step]()
    assert "replaced" in a.file_replaced()
    with pytest.raises(LedgerError, match="replaced"):
        a.admit(ident(2), method="POST", path="/v1/responses", now=1003.0, guard=GUARD,
                flow_id="g")
    assert sql(pg_url, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == [(0,)]
    a.close()


def test_a_newer_schema_is_refused(pg_url):
    PgLedger(pg_url, "a").open(1000.0)
    sql(pg_url, "UPDATE meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(LedgerError, match="newer"):
        PgLedger(pg_url, "b").open(1001.0)


def _end_ledger_connections(pg_url: str) -> None:
    """The server ends turnguard's connections to this test's database (other tests, on other
    workers, share the server), and they are gone before this returns."""
    sql(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE"
                " application_name='turnguard' AND datname=current_database()"
                " AND pid<>pg_backend_pid()")
    deadline = time.monotonic() + 10
    while sql(pg_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name='turnguard'"
                      " AND datname=current_database()") != [(0,)]:
        assert time.monotonic() < deadline, "the connection was not ended"
        time.sleep(0.02)


def test_a_claim_in_doubt_when_the_connection_broke_is_told_once_never_given_back_alone(pg_url):
    """A claim whose commit's answer was lost stays in flight when the connection is made
    again (its request may run, decided in memory: given back, a duplicate held elsewhere
    would run it again); ``claims_in_doubt`` tells it, once, for the caller to settle."""
    led = PgLedger(pg_url, "a")
    led.open(1000.0)
    i, j = ident(1), ident(2)
    claim = led.admit(i, method="POST", path="/v1/responses", now=1000.0, guard=GUARD, flow_id="f")
    led._doubtful_claims.append((claim.attempt_id, i.op_key))  # as if the COMMIT's answer was lost
    led._doubtful_claims.append((claim.attempt_id + 1, j.op_key))  # one that never landed
    assert led.claims_in_doubt_pending
    _end_ledger_connections(pg_url)
    assert led.snapshot(i.op_key).state == "in_flight"  # made again: nothing given back
    assert led.claims_in_doubt() == [(claim.attempt_id, i.op_key)]
    assert not led.claims_in_doubt_pending and led.claims_in_doubt() == []
    assert sql(pg_url, "SELECT outcome FROM attempts") == [("in_flight",)]
    led.close()


def test_claims_in_doubt_that_cannot_be_read_are_told_once_they_can_be(pg_url):
    """The connection broke at a claim's commit, and when it is made again another session
    keeps ``operations`` locked against reads: the claims in doubt cannot be told then (the
    call fails). They are still pending, and told by the next call that can read."""
    led = PgLedger(pg_url, "a", busy_timeout_ms=300)
    led.open(1000.0)
    i = ident(1)
    claim = led.admit(i, method="POST", path="/v1/responses", now=1000.0, guard=GUARD, flow_id="f")
    led._doubtful_claims.append((claim.attempt_id, i.op_key))  # as if the COMMIT's answer was lost
    _end_ledger_connections(pg_url)
    locker = psycopg.connect(pg_url, autocommit=True)
    try:
        locker.execute("BEGIN")
        locker.execute("LOCK TABLE operations IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(LedgerError):
            led.claims_in_doubt()
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert led.claims_in_doubt_pending
    assert led.claims_in_doubt() == [(claim.attempt_id, i.op_key)]
    led.close()


@pytest.mark.parametrize("locked", ["operations", "attempts"])
def test_the_probe_of_a_ledger_that_failed_fails_while_a_claim_could_not_be_written(
        pg_url, locked):
    """Another session locks a table a claim writes against writes (``EXCLUSIVE``: reads
    pass). The heartbeat, which writes ``instances`` alone, still renews the lease; but the
    probe that ends an outage (the same heartbeat, ``as_probe``) fails as a lock (after
    ``PROBE_LOCK_WAIT_MS``), where it took the ledger for usable again while no claim could
    be written (a full run found a retry decided blind as it did). The lock gone, it
    passes."""
    led = PgLedger(pg_url, "a", busy_timeout_ms=300)
    led.open(1000.0)
    locker = psycopg.connect(pg_url, autocommit=True)
    try:
        locker.execute("BEGIN")
        locker.execute(f"LOCK TABLE {locked} IN EXCLUSIVE MODE")
        assert led.heartbeat(1001.0) == "renewed"
        with pytest.raises(LedgerError) as refused:
            led.heartbeat(1002.0, as_probe=True)
        assert contended(refused.value), refused.value
        with pytest.raises(LedgerError):
            led.admit(ident(1), method="POST", path="/v1/responses", now=1002.0,
                      guard=GUARD, flow_id="f")  # (what the probe stands for)
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert led.heartbeat(1003.0, as_probe=True) == "renewed"
    assert sql(pg_url, "SELECT heartbeat_at FROM instances") == [(1003.0,)]
    led.close()


async def test_an_outage_begun_by_a_table_lock_ends_only_once_a_claim_could_be_written(pg_url):
    """Through ``FailoverStore``: another session locks ``operations`` and ``attempts``
    against writes, and a request's claim meets the lock (an outage). The probe that would
    end it (``recover``) fails while the lock holds, however often it is tried, and no
    ``ledger_recovered`` is said; once the lock goes, the next probe ends the outage."""
    emitted: list[str] = []
    store = FailoverStore(
        instance_id="me", identity=liveness.read_process_identity(),
        emit=lambda event, **fields: emitted.append(event), memory=MemoryStore(),
        kept=collections.deque(), attempts=lambda: [], on_reregistered=lambda n: None)
    assert store.open(pg_url)
    locker = psycopg.connect(pg_url, autocommit=True)
    try:
        locker.execute("BEGIN")
        locker.execute("LOCK TABLE operations, attempts IN EXCLUSIVE MODE")
        decided = await store.admit(
            ident(21), method="POST", route="/v1/responses", flow_id="f",
            circuit_scope="route:x", recovery=None, once_mode=False,
            in_flight_here=lambda: False, guard=GUARD, window_s=300, threshold=2,
            deadline=time.monotonic() + 0.3)
        assert decided == policy.Dispatch("original")  # (decided in memory)
        # the claim's lock error; on a machine short of CPU its answer may come after the
        # request's wait for it, and the outage is noted as that (a full run once did): it
        # began at the lock either way, and what follows is the same
        assert store.error is not None and (
            contended(store.error) or "no answer from the ledger" in store.error), store.error
        for _ in range(3):
            assert not await store.recover(time.monotonic() + 2)
        assert "ledger_recovered" not in emitted and not store.usable
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    try:
        assert await store.recover(time.monotonic() + 2)
        assert emitted.count("ledger_recovered") == 1 and store.usable
    finally:
        store.close()


def test_a_connection_past_descriptor_1024_is_kept_while_the_server_keeps_it(pg_url):
    """A busy mitmproxy has more than 1,024 descriptors open: the check for a connection the
    server ended must work past select()'s limit, or every call makes its connection again."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open only {hard} descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = []
    try:
        while len(filler) < 1030:
            filler.append(open("/dev/null", "rb"))
        led = PgLedger(pg_url, "a")
        led.open(1000.0)
        first = led._conn()
        assert first.fileno() > 1024
        assert led.snapshot(ident(1).op_key) is None
        assert led._conn() is first  # kept: nothing came from the server
        led.close()
    finally:
        for f in filler:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_restart_of_the_server_is_an_outage_and_the_ledger_comes_back(own_pg):
    led = PgLedger(own_pg.url, "a", busy_timeout_ms=2000)
    led.open(1000.0)
    i = ident(1)
    claim = led.admit(i, method="POST", path="/v1/responses", now=1000.0, guard=GUARD, flow_id="f")
    own_pg.stop(mode="immediate")  # down: an outage
    with pytest.raises(LedgerError):
        led.finish(claim.attempt_id, AttemptEnd("completed", 200, 1, None,
                                                Recording(200, (), b"ok")), now=1001.0)
    own_pg.restart()  # (it is stopped: this starts it)
    assert led.finish(claim.attempt_id, AttemptEnd("completed", 200, 1, None,
                                                   Recording(200, (), b"ok")), now=1001.0).applied
    assert led.recording(claim.attempt_id).body == b"ok"
    # restarted while the connection was idle, and up again by the next claim: the
    # connection the server ended is made again at once, no outage
    own_pg.restart()
    other = ident(2)
    assert isinstance(led.admit(other, method="POST", path="/v1/responses", now=1002.0,
                                guard=GUARD, flow_id="g"), policy.Dispatch)
    led.close()


# -- notifications through FailoverStore -----------------------------------------------------------
def _failover(ended: list) -> FailoverStore:
    return FailoverStore(
        instance_id="me", identity=liveness.read_process_identity(), emit=lambda *a, **k: None,
        memory=MemoryStore(), kept=collections.deque(), attempts=lambda: [],
        on_reregistered=lambda n: None,
        on_attempt_ended=lambda *end: ended.append(end))


async def _until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_other_processes_attempt_ends_are_notified_and_the_fallback_is_polling(pg_url):
    ended: list = []
    store = _failover(ended)
    assert store.open(pg_url)
    try:
        assert store.attempt_ends_notified and not store.recheck_foreign
        peer = PgLedger(pg_url, "peer")
        peer.open(time.time())
        i = ident(7)
        claim = peer.admit(i, method="POST", path="/v1/responses", now=time.time(), guard=GUARD,
                           flow_id="f")
        peer.finish(claim.attempt_id, AttemptEnd("unknown", None, 0), now=time.time())
        await _until(lambda: ended)
        assert ended == [(i.op_key, claim.attempt_id, "unknown")]
        # a completed end is told apart by whether it has a recording to replay: without one
        # (too large to keep, say) its duplicates are dispatched, never failed closed
        recorded, unrecorded = ident(8), ident(9)
        for turn, recording in ((recorded, Recording(200, (), b"ok")), (unrecorded, None)):
            claim = peer.admit(turn, method="POST", path="/v1/responses", now=time.time(),
                               guard=GUARD, flow_id="f")
            peer.finish(claim.attempt_id, AttemptEnd("completed", 200, 1, recording=recording),
                        now=time.time())
        await _until(lambda: len(ended) == 3)
        assert [(op, state) for op, _, state in ended[1:]] == [
            (recorded.op_key, "completed"), (unrecorded.op_key, "completed_unrecorded")]
        now = time.time()
        facts = [store.memory.knowledge.facts(turn.op_key, in_flight_here=False,
                                              fingerprint=turn.fingerprint, now=now,
                                              window_s=300) for turn in (recorded, unrecorded)]
        assert [f.completed_elsewhere for f in facts] == [True, False]
        # the listener's connection is lost: polling until it is back, then one re-check
        sql(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name='turnguard-listen' AND datname=current_database()")
        await _until(lambda: not store.attempt_ends_notified)
        await _until(lambda: store.attempt_ends_notified)
        assert store.recheck_foreign
        assert store.polls == 0
        peer.close()
    finally:
        store.close()


def test_the_listener_is_not_ended_by_an_idle_session_timeout(pg_url):
    """A server (or database) with ``idle_session_timeout`` ended the listener's connection,
    which idles by design, once per timeout: each time a warning that notifications were lost,
    polling, and another that they resumed. The listener turns the timeout off for its own
    session."""
    database = sql(pg_url, "SELECT current_database()")[0][0]
    sql(pg_url, f"ALTER DATABASE {database} SET idle_session_timeout = '300ms'")
    lives: list[bool] = []
    ends: list = []
    listener = AttemptEndListener(pg_url, on_end=lambda *end: ends.append(end),
                                  on_live=lives.append, retry_s=0.1, poll_s=0.05)
    listener.start()
    try:
        time.sleep(1.5)  # five timeouts
        sql(pg_url, f"SELECT pg_notify('{NOTIFY_CHANNEL}', 'op 7 completed')")
        deadline = time.monotonic() + 10
        while not ends and time.monotonic() < deadline:  # bounded
            time.sleep(0.02)
        assert ends == [("op", 7, "completed")]
        assert lives == [True], "the listener's connection was ended while it idled"
    finally:
        listener.stop()


async def test_a_held_duplicate_is_woken_by_the_notification_even_if_it_came_first():
    """The end is notified between the admission that said Hold and the start of the wait."""
    from turnguard_shell.waiters import Waiters

    class Flow:
        id = "f1"

    waiters = Waiters()
    waiters.attempt_ended_elsewhere("op", 5, "completed")
    woke = await waiters.duplicate(Flow(), "f1", "op", 5, timeout_s=5)
    assert woke.outcome == "completed"
    # an end of an older attempt does not wake a wait on a newer one
    waiters.attempt_ended_elsewhere("op2", 4, "unknown")
    assert type(await waiters.duplicate(Flow(), "f1", "op2", 5, timeout_s=0.05)).__name__ == "TimedOut"


async def test_a_wait_on_an_attempt_of_a_ledger_made_again_is_woken_by_an_end_in_the_new_one():
    """A duplicate held on attempt 3 seen in the ledger of generation g1 (a database since
    dropped and made again): the owner's turn, written in the new ledger (g2), ends there as
    attempt 1. That end wakes it (to be admitted again in g2); an end in g1 of another attempt
    does not."""
    from turnguard_shell.waiters import Waiters

    class Flow:
        id = "f1"

    waiters = Waiters()
    wait = asyncio.ensure_future(waiters.duplicate(Flow(), "f1", "op", 3, 5, "g1"))
    await asyncio.sleep(0)
    waiters.attempt_ended_elsewhere("op", 1, "completed", generation="g1")
    await asyncio.sleep(0.05)
    assert not wait.done()
    waiters.attempt_ended_elsewhere("op", 1, "completed", generation="g2")
    assert (await asyncio.wait_for(wait, 5)).outcome == "completed"


# -- the control tool --------------------------------------------------------------------------------
def test_scripts_turnguard_works_on_a_postgres_ledger_and_never_prints_the_password(pg_url):
    led = PgLedgerAdmin(pg_url, "a")
    led.open(time.time())
    cfg = circuit.CircuitConfig(threshold=1, cooldown_s=600, cooldown_max_s=600)
    i = ident(3)
    claim = led.admit(i, method="POST", path="/v1/responses", now=time.time(), guard=GUARD,
                      flow_id="f", circuit_scope="session:abc")
    led.finish(claim.attempt_id, AttemptEnd("unknown", None, 0), now=time.time(),
               circuit_cfg=cfg, eventless_failure=True)
    url = with_password(pg_url)  # trust auth on the test server: the password is not checked
    for args in (["status"], ["list"], ["stats"], ["show", i.op_key[:12]], ["circuit", "list"],
                 ["status", "--json"]):
        out, err = io.StringIO(), io.StringIO()
        assert ledger_cli.main(["--ledger", url, *args], out, err) == 0, err.getvalue()
        assert "s3cret-pw" not in out.getvalue() + err.getvalue()
    out = io.StringIO()
    assert ledger_cli.main(["--ledger", url, "status"], out, io.StringIO()) == 0
    assert "***" in out.getvalue() and "session:abc" in out.getvalue()
    assert ledger_cli.main(["--ledger", url, "circuit", "clear", "--all"], io.StringIO(),
                           io.StringIO()) == 0
    cleared = led.circuit_state("session:abc")
    assert cleared.failures == 0 and cleared.remaining_s(time.time()) == 0
    assert [a["action"] for a in led.audit_log()] == ["circuit_clear"]
    led.close()


def test_a_ledger_url_given_as_events_by_mistake_is_refused_without_its_password(tmp_path):
    """``scripts/turnguard ... --events URL`` (the ledger's URL in the wrong place) is refused
    as a path would be, quoting it: with its password as ***."""
    from turnguard_core.ledger import Ledger

    path = str(tmp_path / "l.sqlite3")
    Ledger(path, "x").open(time.time())
    err = io.StringIO()
    url = "postgresql://tg:s3cret-pw@127.0.0.1:1/ledger"
    assert ledger_cli.main(["--ledger", path, "circuit", "clear", "--all", "--events", url],
                           io.StringIO(), err) == 1
    assert "s3cret" not in err.getvalue() and "tg:***@" in err.getvalue(), err.getvalue()


@pytest.mark.parametrize("url", ["postgresql://tg:s3cret-pw@[127.0.0.1:1/ledger",
                                 "postgresql://tg:s3cret-pw@127.0.0.1:1/ledger#part"])
def test_scripts_turnguard_refuses_a_url_libpq_cannot_read_as_such(url):
    """A malformed URL is said to be one (as the addon says it), never taken for a row of the
    ledger that turnguard did not write; the password is not shown."""
    err = io.StringIO()
    assert ledger_cli.main(["--ledger", url, "status"], io.StringIO(), err) == 1
    said = err.getvalue()
    assert "not a valid PostgreSQL URL" in said and "did not write" not in said, said
    assert "s3cret" not in said and "tg:***@" in said, said


async def test_no_error_or_status_line_shows_the_password():
    """libpq echoes what it cannot parse; the ledger's errors and the status line never show
    the password."""
    from turnguard_core.ledger_location import scrub

    url = "postgresql://tg:p%40ss-w0rd@127.0.0.1:1/ledger?sslmode=disable"
    assert scrub("bad value p@ss-w0rd and p%40ss-w0rd", url) == "bad value *** and ***"
    led = PgLedger(url, "a")
    with pytest.raises(LedgerError) as refused:  # nothing listens on port 1
        led.open(1000.0)
    assert "p@ss-w0rd" not in str(refused.value) and "p%40ss" not in str(refused.value)
    assert led.path == "postgresql://tg:***@127.0.0.1:1/ledger?sslmode=disable"
    store = _failover([])
    assert not store.open(url)  # an outage, said without the password
    assert store.location == led.path and "p%40ss" not in (store.error or "")
    store.close()


@pytest.mark.parametrize("url", [
    "postgresql://tg@127.0.0.1:1/ledger?password=pa+ss%wo-rd",
    "postgresql://tg@127.0.0.1:1/ledger?sslmode=disable&sslpassword=pa+ss%wo-rd",
])
async def test_a_password_parameter_with_a_plus_that_libpq_echoes_is_never_shown(url):
    """libpq reads a "+" in a parameter as a "+" (never a space) and echoes a value whose
    percent-encoding it cannot read: the error says neither the password nor any part of it."""
    led = PgLedger(url, "a")
    with pytest.raises(LedgerError) as refused:
        led.open(1000.0)
    assert "ss%wo" not in str(refused.value) and "***" in str(refused.value), refused.value
    store = _failover([])
    assert not store.open(url)  # an outage, said without the password
    assert "ss%wo" not in (store.error or "")
    store.close()


async def test_a_database_made_again_under_a_running_process_gets_its_attempts_in_flight(
        pg_url, monkeypatch):
    """The heartbeat finds another generation: an outage, never an empty ledger. The process
    opens the new database and registers its attempt in flight there before deciding from it,
    so another process holds that operation's duplicates instead of dispatching them."""
    from turnguard_core import failover

    monkeypatch.setattr(failover, "HEARTBEAT_S", 0.2)

    attempts: list[StoreAttempt] = []
    store = FailoverStore(
        instance_id="me", identity=liveness.read_process_identity(), emit=lambda *a, **k: None,
        memory=MemoryStore(), kept=collections.deque(), attempts=lambda: attempts,
        on_reregistered=lambda n: None)
    assert store.open(pg_url)
    try:
        i = ident(11)
        claim = await store.admit(
            i, method="POST", route="/v1/responses", flow_id="f", circuit_scope="route:x",
            recovery=None, once_mode=False, in_flight_here=lambda: False, guard=GUARD,
            window_s=300, threshold=2, deadline=time.monotonic() + 5)
        attempts.append(StoreAttempt(i, claim.attempt_id, store.generation))
        old = store.generation
        sql(pg_url, "DROP TABLE meta, spool, attempts, operations, circuits, sessions,"
                    " instances, control_audit")
        peer = PgLedger(pg_url, "peer")
        peer.open(time.time())
        # the heartbeat saw another generation: the new database is opened at once (no
        # maintenance tick here) and the attempt registered there
        await _until(lambda: store.generation == peer.generation)
        assert store.is_open and store.generation != old
        assert await store.recover(time.monotonic() + 5)
        assert attempts[0].generation == peer.generation
        held = peer.admit(i, method="POST", path="/v1/responses", now=time.time(), guard=GUARD,
                          flow_id="g")
        assert held == policy.Hold(attempts[0].attempt_id, "me")
        peer.close()
    finally:
        store.close()


def _store_with_a_gated_claim(pg_url, attempts: list[StoreAttempt]):
    """A FailoverStore on ``pg_url`` whose claims wait on the ledger's thread until the gate
    is set (started in time, they answer after their request gave up): (store, its ledger
    runner, the gate, the events it emitted)."""
    events: list[tuple[str, dict]] = []
    store = FailoverStore(
        instance_id="me", identity=liveness.read_process_identity(),
        emit=lambda event, **fields: events.append((event, fields)),
        memory=MemoryStore(), kept=collections.deque(), attempts=lambda: attempts,
        on_reregistered=lambda n: None)
    assert store.open(pg_url)
    runner = store._store._runner
    gate = threading.Event()
    admit = runner.ledger.admit

    def slow_admit(*args, **kwargs):
        gate.wait(10)
        return admit(*args, **kwargs)

    runner.ledger.admit = slow_admit
    return store, runner, gate, events


async def test_a_late_claim_stays_the_row_of_its_attempt_when_the_catch_up_adopts_it_meanwhile(
        pg_url):
    """The claim waits on the ledger's thread past its request's wait: the request is decided
    in memory and dispatched, and the catch-up queues the adoption of that attempt behind the
    claim. The claim lands first (the adoption then finds the operation in flight: None); it is
    the attempt's row, not overwritten by the adoption's None, so the attempt's end ends it
    (written whole without an attempt id, it was refused and the claim stayed in flight)."""
    attempts: list[StoreAttempt] = []
    store, runner, gate, events = _store_with_a_gated_claim(pg_url, attempts)
    try:
        i = ident(13)
        decided = await store.admit(
            i, method="POST", route="/v1/responses", flow_id="f", circuit_scope="route:x",
            recovery=None, once_mode=False, in_flight_here=lambda: False, guard=GUARD,
            window_s=300, threshold=2, deadline=time.monotonic() + 0.1)
        assert decided == policy.Dispatch("original")  # decided in memory
        attempt = StoreAttempt(i, None, "")
        attempts.append(attempt)  # dispatched without a row
        recovering = asyncio.ensure_future(store.recover(time.monotonic() + 10))
        await _until(lambda: runner._handed - runner._finished == 2)  # adoption queued
        gate.set()
        assert await recovering
        await _until(lambda: any(f.get("reason") == "its claim answered late"
                                 for _, f in events))
        claimed = sql(pg_url, "SELECT state, current_attempt FROM operations WHERE op_key=%s",
                      (i.op_key,))
        assert claimed[0][0] == "in_flight"
        assert (attempt.attempt_id, attempt.generation) == (claimed[0][1], store.generation)

        ending = AttemptEnding("completed", None, None, False, None, None)
        await store.finish(attempt, ending, AttemptEnd("completed", 200, 3, None), now=time.time(),
                           circuit_cfg=circuit.CircuitConfig(), base={})
        assert not [e for e, _ in events if e == "outcome_fenced_out"]
        assert sql(pg_url, "SELECT state FROM operations WHERE op_key=%s",
                   (i.op_key,)) == [("completed",)]
    finally:
        store.close()


async def test_an_attempt_that_ended_before_its_late_claim_answered_is_that_claims_end(pg_url):
    """The attempt decided in memory ends (completed, recorded) while its claim still waits
    on the ledger's thread; its end, recorded whole, is written after the claim. It is the
    claim's end: the turn is completed in the ledger and replayed to another process, never
    given back as rejected (then run again there)."""
    store, runner, gate, events = _store_with_a_gated_claim(pg_url, [])
    try:
        i = ident(14)
        decided = await store.admit(
            i, method="POST", route="/v1/responses", flow_id="f", circuit_scope="route:x",
            recovery=None, once_mode=False, in_flight_here=lambda: False, guard=GUARD,
            window_s=300, threshold=2, deadline=time.monotonic() + 0.1)
        assert decided == policy.Dispatch("original")  # decided in memory, and it ends
        rec = Recording(200, (("content-type", "text/event-stream"),), b"data: done\n\n")
        store.finish(StoreAttempt(i, None, ""), AttemptEnding("completed", rec, None, False,
                                                              None, None),
                     AttemptEnd("completed", 200, 3, None, rec), now=time.time(),
                     circuit_cfg=circuit.CircuitConfig(), base={})
        gate.set()
        await _until(lambda: runner._handed == runner._finished)  # the claim answered
        assert await store.recover(time.monotonic() + 5)
        await _until(lambda: runner._handed == runner._finished and not store.kept_writes)
        assert not [e for e, _ in events if e == "outcome_fenced_out"]
        peer = PgLedger(pg_url, "peer")
        peer.open(time.time())
        try:
            replay = peer.admit(i, method="POST", path="/v1/responses", now=time.time(),
                                guard=GUARD, flow_id="g")
            assert isinstance(replay, policy.Replay)
            assert peer.recording(replay.attempt_id) == rec
        finally:
            peer.close()
    finally:
        store.close()
