"""``Deadlines``: callbacks due after a delay on one asyncio timer, as ``loop.call_later``
runs them (order, once each, a cancel is final), on a real event loop."""

from __future__ import annotations

import asyncio
import logging

from turnguard_shell.deadlines import Deadlines


async def _until_ran(deadlines: Deadlines, bound_s: float = 5.0) -> None:
    """Wait (bounded) until nothing scheduled is left to run."""
    for _ in range(int(bound_s / 0.01)):
        if not len(deadlines):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(deadlines)} callbacks still scheduled after {bound_s} s")


async def test_callbacks_run_once_each_in_deadline_order_and_cancelled_ones_never():
    deadlines, ran = Deadlines(), []
    # (delays far apart: a busy machine's pause between two lines reorders none of them)
    later = deadlines.call_later(0.5, lambda: ran.append("later"))
    deadlines.call_later(0.03, lambda: ran.append("sooner, scheduled after"))
    cancelled = deadlines.call_later(0.01, lambda: ran.append("cancelled"))
    deadlines.call_later(0.03, lambda: ran.append("same time, second"))
    cancelled.cancel()
    cancelled.cancel()  # (twice: still one cancel)
    await _until_ran(deadlines)
    assert ran == ["sooner, scheduled after", "same time, second", "later"]
    later.cancel()  # (after it ran: nothing)
    assert len(deadlines) == 0 and later.ran and not later.cancelled


async def test_a_callback_that_raises_is_logged_and_the_others_still_run(caplog):
    deadlines, ran = Deadlines(), []
    deadlines.call_later(0.01, lambda: 1 / 0)
    deadlines.call_later(0.01, lambda: ran.append("next"))
    with caplog.at_level(logging.ERROR, logger="turnguard"):
        await _until_ran(deadlines)
    assert ran == ["next"]
    assert "a scheduled callback failed" in caplog.text and "ZeroDivisionError" in caplog.text


async def test_callbacks_that_schedule_and_cancel_others_while_they_run():
    """A callback may schedule another (run at its own time) and cancel one not run yet,
    also when the cancel rebuilds the heap without its cancelled entries."""
    deadlines, ran = Deadlines(), []
    # (due long after ``first``: however late the loop runs it, no victim is due before it)
    victims = [deadlines.call_later(30, lambda: ran.append("victim")) for _ in range(300)]
    for v in victims[:200]:
        v.cancel()

    def first():
        ran.append("first")
        for v in victims[200:]:
            v.cancel()
        deadlines.call_later(0.01, lambda: ran.append("scheduled by first"))

    deadlines.call_later(0.01, first)
    await _until_ran(deadlines)
    assert ran == ["first", "scheduled by first"]


async def test_cancelled_entries_do_not_pile_up():
    """A thousand timers cancelled long before they are due (the usual case: a request's
    60 s timeout, cancelled at its first event) are not kept until then."""
    deadlines = Deadlines()
    keep = deadlines.call_later(60, lambda: None)
    for _ in range(1000):
        deadlines.call_later(60, lambda: None).cancel()
    assert len(deadlines) == 1
    assert len(deadlines._heap) <= 2 * 100 + 2  # rebuilt once more than half were cancelled
    keep.cancel()
