"""Large bodies are identified in a worker process (``offload``): the same identity as inline,
and a body too costly to identify in time is passed through instead of holding the loop."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

import slow_identity
from turnguard_core import identity
from turnguard_core.offload import INLINE_MAX_BYTES, IdentityWorker

_REAL_IDENTIFY = identity.identify

UPSTREAM = identity.Upstream("https", "api.example", 443)


def view(body: bytes) -> identity.RequestView:
    headers = (("authorization", "Bearer k"), ("session-id", "s"))
    return identity.RequestView("POST", "/v1/responses", headers, body, UPSTREAM)


@pytest.fixture
def worker():
    w = IdentityWorker()
    yield w
    w.close()


async def test_the_worker_computes_the_same_identity_as_inline(worker):
    items = [{"type": "message", "role": "user", "content": "x" * 1000, "n": i} for i in range(400)]
    body = json.dumps({"model": "m", "input": items}).encode()
    assert len(body) > INLINE_MAX_BYTES
    reordered = json.dumps({"input": items, "model": "m"}, indent=1).encode()
    offloaded = await worker.identify(view(body), timeout_s=30)
    assert offloaded == identity.identify(view(body))
    assert (await worker.identify(view(reordered), timeout_s=30)).op_key == offloaded.op_key
    hostile = await worker.identify(view(b'{"a": 1, "a": 2}' + b" " * INLINE_MAX_BYTES), timeout_s=30)
    assert hostile == identity.Passthrough("duplicate keys in JSON body")


async def test_a_body_too_costly_to_identify_in_time_is_passed_through(worker):
    body = ('{"input":[' + ",".join('{"a":1,"b":[2]}' for _ in range(1_500_000)) + "]}").encode()
    out = await worker.identify(view(body), timeout_s=0.2)
    assert isinstance(out, identity.Passthrough) and "took longer than 0.2 s" in out.reason
    # the worker was replaced: the next large body is identified again
    small_enough = json.dumps({"input": "y" * (INLINE_MAX_BYTES + 1)}).encode()
    assert isinstance(await worker.identify(view(small_enough), timeout_s=30), identity.Identity)


async def test_a_body_whose_bound_ends_with_the_one_it_waited_behind_is_identified_on_the_next_worker(
        worker):
    """A large body queued in the worker behind one too costly to identify: its bound counts
    its wait there, so on a busy machine it can end in the same turn of the event loop as the
    costly one's (a full run found it: both passed through). The costly one, handled first,
    replaces the worker; the queued one finds it replaced and is identified on the next
    worker, as one whose call the replacement cancelled is, not passed through."""
    costly = ('{"input":[' + ",".join('{"a":1,"b":[2]}' for _ in range(1_500_000)) + "]}").encode()
    queued = json.dumps({"model": "m", "input": "q" * (INLINE_MAX_BYTES + 1)}).encode()
    assert isinstance(await worker.identify(view(queued), timeout_s=30), identity.Identity)
    first = asyncio.ensure_future(worker.identify(view(costly), timeout_s=0.3))
    await asyncio.sleep(0)  # (its call in the worker, its bound running)
    second = asyncio.ensure_future(worker.identify(view(queued), timeout_s=0.3))
    await asyncio.sleep(0)
    time.sleep(0.8)  # the event loop held past both bounds: both end in its next turn
    costly_out, queued_out = await first, await second
    assert isinstance(costly_out, identity.Passthrough) and "took longer" in costly_out.reason
    assert queued_out == identity.identify(view(queued)), queued_out


@pytest.fixture
def slow_identify(monkeypatch):
    """The worker's function takes ``slow_identity.DELAY_S`` more (a sleep): a bound set
    against it holds however busy the machine is."""
    monkeypatch.setattr(identity, "identify", slow_identity.identify)
    return slow_identity.DELAY_S


def _body(tag: int) -> bytes:
    return json.dumps({"model": "m", "tag": tag, "input": "w" * (INLINE_MAX_BYTES + 1)}).encode()


async def test_bodies_queued_behind_each_other_each_get_their_whole_bound(worker, slow_identify):
    """Large bodies that come together (a gateway's retries of one long turn) wait in turn for
    the worker: the bound is each one's own identity, not its wait behind the others, which
    passed the last ones through unguarded (their duplicate then ran again upstream)."""
    bodies = [_body(tag) for tag in range(8)]  # 0.8 s in the worker in all, each 0.1 s
    assert isinstance(await worker.identify(view(bodies[0]), timeout_s=30), identity.Identity)
    outs = await asyncio.gather(*(worker.identify(view(b), timeout_s=5 * slow_identify,
                                                  within_s=60) for b in bodies))
    assert outs == [_REAL_IDENTIFY(view(b)) for b in bodies]


async def test_a_wait_that_ends_late_because_the_process_was_paused_gets_its_bound_again(
        worker, slow_identify):
    """The process paused with its worker (a SIGSTOP of the group): the wait's bound ran out
    while neither ran, so the body had no time to be identified. The wait that ends late is
    given its bound once more, as the response-created timer is; the body is identified, not
    passed through."""
    import os
    import signal

    body = _body(0)
    assert isinstance(await worker.identify(view(body), timeout_s=30), identity.Identity)
    pid = next(iter(worker._pool._processes))
    call = asyncio.ensure_future(worker.identify(view(body), timeout_s=10 * slow_identify,
                                                 within_s=60))
    await asyncio.sleep(0)  # (its call in the worker, its bound running)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(15 * slow_identify)  # the event loop stopped too, past the bound
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await call == _REAL_IDENTIFY(view(body))


async def test_the_event_loop_runs_while_the_worker_parses(worker):
    body = ('{"input":[' + ",".join('{"a":1}' for _ in range(200_000)) + "]}").encode()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.ensure_future(ticker())
    try:
        await worker.identify(view(body), timeout_s=60)
    finally:
        task.cancel()
    assert ticks > 5  # the loop kept turning while a body of 200,000 objects was parsed


async def test_a_worker_slow_to_start_does_not_count_against_the_identity_bound(
        worker, tmp_path, monkeypatch):
    """Starting the worker is a new interpreter: seconds on a loaded machine. The first large
    body waits for it within the start-up bound, and only its identity has ``timeout_s``
    (before, the start counted too: the first large body after a start or a reload was passed
    through unguarded on a busy machine)."""
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(1.5)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the spawned interpreter starts slowly
    body = json.dumps({"model": "m", "input": "z" * (INLINE_MAX_BYTES + 1)}).encode()
    out = await worker.identify(view(body), timeout_s=1.0, start_timeout_s=60)
    assert out == identity.identify(view(body))


async def test_a_worker_that_does_not_start_in_time_passes_the_request_through(
        worker, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    body = json.dumps({"model": "m", "input": "z" * (INLINE_MAX_BYTES + 1)}).encode()
    out = await worker.identify(view(body), timeout_s=30, start_timeout_s=0.5)
    assert out == identity.Passthrough("identity worker did not start within 0.5 s")
    monkeypatch.delenv("PYTHONPATH")  # the next call starts another worker, which runs
    assert await worker.identify(view(body), timeout_s=30) == identity.identify(view(body))


async def test_the_start_and_the_identity_together_stay_within_the_request_budget(
        tmp_path, monkeypatch):
    """The request's budget bounds its whole wait in turnguard. The worker's start and the
    identity each had a bound within it, but their sum did not: a large body waited for a
    slow start, then up to the budget again for its identity (1 + 4 s against 4)."""
    from turnguard_shell.answering import Identifier

    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(1.0)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the spawned interpreter starts slowly
    identifier = Identifier()
    try:
        body = ('{"input":[' + ",".join('{"a":1,"b":[2]}' for _ in range(3_000_000)) + "]}")
        loop = asyncio.get_running_loop()
        started = loop.time()
        out = await identifier.identify_view(view(body.encode()), 4.0, ())
        waited = loop.time() - started
        assert isinstance(out, identity.Passthrough)
        assert out.reason in (  # (the first when the machine is too busy to start it by then)
            "identity worker did not start within 4.0 s",
            "identity of a large body did not end within the request budget (4.0 s)")
        assert waited < 4.0 + 1.0, f"waited {waited:.1f} s on a budget of 4.0 s"
    finally:
        identifier.close()


def test_a_body_is_read_inline_only_when_small_and_of_few_values():
    """Reading costs per JSON value: a body under ``INLINE_MAX_BYTES`` of more than
    ``INLINE_MAX_VALUES`` values (a few hundred bytes deflated on a WebSocket) is read off the
    event loop too; a realistic body of that size is read inline."""
    from turnguard_core.offload import INLINE_MAX_VALUES, read_inline
    few = json.dumps({"input": [{"role": "user", "content": "x" * 200_000}]}).encode()
    many = json.dumps({"input": [{}] * (INLINE_MAX_VALUES // 2 + 1)}).encode()
    assert read_inline(few) and len(many) < INLINE_MAX_BYTES and not read_inline(many)
    assert not read_inline(b" " * (INLINE_MAX_BYTES + 1))
