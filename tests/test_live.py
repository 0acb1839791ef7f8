"""The live response a duplicate attaches to (``turnguard_core.live``), without a proxy."""

from hypothesis import given
from hypothesis import strategies as st

from turnguard_core.live import Head, Listener, LiveResponse

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


@given(st.lists(st.binary(min_size=1, max_size=20), max_size=30), st.data())
def test_a_listener_gets_every_piece_in_order_wherever_it_attaches(pieces, data):
    live = LiveResponse("http", max_bytes=10_000)
    live.start(HEAD)
    at = data.draw(st.integers(0, len(pieces)))
    early, late = Got(), Got()
    assert live.attach(early.listener)
    for piece in pieces[:at]:
        live.feed(piece)
    assert live.attach(late.listener)
    for piece in pieces[at:]:
        live.feed(piece)
    live.finish("complete")
    for got in (early, late):
        assert got.head == HEAD and got.pieces == pieces and got.end == ("complete", None)
    assert live.whole() == b"".join(pieces)


def test_past_max_bytes_no_one_new_attaches_but_those_attached_get_everything():
    live = LiveResponse("http", max_bytes=10)
    live.start(HEAD)
    attached = Got()
    live.attach(attached.listener)
    live.feed(b"12345678")
    live.feed(b"90abc")  # 13 bytes: too many to give a newcomer
    assert not live.attachable and not live.attach(Got().listener)
    live.feed(b"d")
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
