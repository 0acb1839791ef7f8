"""The live response a duplicate attaches to (``turnguard_core.live``), without a proxy."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnguard_core.live import Head, Listener, LiveResponse
from turnguard_core.tee import ResponseTee

HEAD = Head(200, (("content-type", "text/event-stream"),), None)


class Got:
    """A listener that writes down what it is given."""

    def __init__(self):
        self.head, self.pieces, self.end = None, [], None
        self.listener = Listener(on_head=self._head, on_piece=self.pieces.append,
                                 on_end=self._end)

    def _head(self, head):
        assert self.head is None, "the head comes once"
        self.head = head

    def _end(self, end, error):
        assert self.end is None, "the end comes once"
        self.end = (end, error)


def feeder(live: LiveResponse, through_tee: bool):
    """How pieces reach ``live``: its own ``feed``, or an HTTP tee keeping the same pieces
    under the same cap (one list for both; the tee calls it only while someone listens)."""
    if not through_tee:
        return live.feed
    return ResponseTee(counts_events=False, keep_max_bytes=live.max_bytes, live=live)


@pytest.mark.parametrize("through_tee", [False, True])
@given(pieces=st.lists(st.binary(min_size=1, max_size=20), max_size=30), data=st.data())
def test_a_listener_gets_every_piece_in_order_wherever_it_attaches(through_tee, pieces, data):
    live = LiveResponse("http", max_bytes=10_000)
    live.start(HEAD)
    feed = feeder(live, through_tee)
    at = data.draw(st.integers(0, len(pieces)))
    early, late = Got(), Got()
    if data.draw(st.booleans(), label="one attached from the start"):
        assert live.attach(early.listener)
    else:
        early.pieces, early.head, early.end = pieces, HEAD, ("complete", None)  # nobody
    for piece in pieces[:at]:
        feed(piece)
    assert live.attach(late.listener)
    for piece in pieces[at:]:
        feed(piece)
    live.finish("complete")
    for got in (early, late):
        assert got.head == HEAD and got.pieces == pieces and got.end == ("complete", None)
    assert live.whole() == b"".join(pieces)


@pytest.mark.parametrize("through_tee", [False, True])
def test_past_max_bytes_no_one_new_attaches_but_those_attached_get_everything(through_tee):
    live = LiveResponse("http", max_bytes=10)
    live.start(HEAD)
    feed = feeder(live, through_tee)
    attached = Got()
    live.attach(attached.listener)
    feed(b"12345678")
    feed(b"90abc")  # 13 bytes: too many to give a newcomer
    assert not live.attachable and not live.attach(Got().listener)
    feed(b"d")
    live.finish("failed", "reset")
    assert attached.pieces == [b"12345678", b"90abc", b"d"]
    assert attached.end == ("failed", "reset")
    assert live.whole() is None


def test_attaching_after_the_end_gets_it_all_and_the_end_at_once():
    live = LiveResponse("ws", max_bytes=100)
    live.feed('{"type":"response.created"}')
    live.finish("complete")
    got = Got()
    assert live.attach(got.listener)
    assert got.head is None and got.pieces == ['{"type":"response.created"}']
    assert got.end == ("complete", None) and live.listeners == 0


def test_a_listener_that_raises_is_dropped_and_the_others_go_on():
    live = LiveResponse("http", max_bytes=100)
    live.start(HEAD)

    def broken(piece):
        raise RuntimeError("its client is gone")

    bad = Listener(on_head=lambda h: None, on_piece=broken, on_end=lambda e, r: None)
    good = Got()
    live.attach(bad)
    live.attach(good.listener)
    live.feed(b"a")
    live.feed(b"b")
    live.finish("complete")
    assert good.pieces == [b"a", b"b"] and good.end == ("complete", None)
    assert not bad.attached


def test_a_detached_listener_gets_nothing_more():
    live = LiveResponse("http", max_bytes=100)
    got = Got()
    live.attach(got.listener)
    live.start(HEAD)  # a head that comes after the attach
    live.feed(b"a")
    live.detach(got.listener)
    live.feed(b"b")
    live.finish("complete")
    assert got.head == HEAD and got.pieces == [b"a"] and got.end is None
    assert live.listeners == 0 and live.attached_total == 1
