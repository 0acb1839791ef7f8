"""The response tee: passes bytes through unchanged, counts events, keeps a bounded copy."""

from hypothesis import given
from hypothesis import strategies as st

from unittest import mock

from turnguard_core import tee as tee_module
from turnguard_core.sse import SseKinds
from turnguard_core.tee import ResponseTee, recordable_headers

STREAM = b"".join(
    f"event: {t}\ndata: {{\"type\":\"{t}\"}}\n\n".encode()
    for t in ["response.created", "response.output_text.delta", "response.completed"]
)


@given(st.lists(st.integers(0, len(STREAM)), max_size=20))
def test_any_chunking_passes_bytes_through_and_counts_the_same(cuts):
    firsts = []
    tee = ResponseTee(counts_events=True, keep_max_bytes=1 << 20, on_first_event=lambda: firsts.append(1))
    out = b""
    bounds = sorted(set([0, len(STREAM), *cuts]))
    for a, b in zip(bounds, bounds[1:]):
        out += tee(STREAM[a:b])
    assert tee(b"") == b""
    assert out == STREAM and tee.body == STREAM
    assert tee.events_seen == 3 and tee.terminal == "success" and firsts == [1]


_TYPES = st.sampled_from(["response.created", "response.output_text.delta", "response.completed",
                          "response.failed", "error", ""])


@given(st.lists(_TYPES, max_size=10), st.sampled_from([0, 60, 250, 1 << 20]),
       st.sampled_from([2, 3, tee_module.READ_BATCH]), st.data())
def test_events_read_when_asked_are_the_events_read_as_they_pass(types, keep, batch, data):
    """After the first event kept chunks are read in batches or when asked: at every point
    the count, the terminal kind and the first-event callback are what a parser fed every
    chunk gives, whatever the chunking, the batch, the cap (under, over, crossed mid-stream)
    and when it is asked."""
    with mock.patch.object(tee_module, "READ_BATCH", batch):
        _read_when_asked(types, keep, data)


def _read_when_asked(types, keep, data):
    stream = "".join(  # an empty type: a data-only event whose JSON names its type
        (f"event: {t}\n" if t else "") + f"data: {{\"type\":\"{t or 'error'}\"}}\n\n"
        for t in types).encode()
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20), label="cuts")
    bounds = sorted({0, len(stream), *cuts})
    chunks = [stream[a:b] for a, b in zip(bounds, bounds[1:])]
    asks = data.draw(st.sets(st.integers(0, len(chunks))), label="asked after chunk")
    firsts: list[int] = []
    tee = ResponseTee(counts_events=True, keep_max_bytes=keep,
                      on_first_event=lambda: firsts.append(1))
    ref, ref_terminal = SseKinds(), None
    for i, chunk in enumerate(chunks):
        assert tee(chunk) == chunk
        for kind in ref.feed(chunk):  # the first terminal event decides
            ref_terminal = kind if kind != "other" and ref_terminal is None else ref_terminal
        assert len(firsts) == (1 if ref.events_seen else 0)  # at the very chunk, once
        if i in asks:  # either first: each must read what is unread
            if i % 2:
                assert (tee.terminal, tee.events_seen) == (ref_terminal, ref.events_seen)
            else:
                assert (tee.events_seen, tee.terminal) == (ref.events_seen, ref_terminal)
    tee(b"")
    assert (tee.events_seen, tee.terminal) == (ref.events_seen, ref_terminal) == (len(types), ref_terminal)
    assert tee.body == (stream if len(stream) <= keep and keep else None)


def test_body_over_the_cap_is_not_kept_but_still_passes():
    tee = ResponseTee(counts_events=True, keep_max_bytes=10)
    assert tee(STREAM) == STREAM
    tee(b"")
    assert tee.body is None and tee.over_cap and tee.events_seen == 3


def test_body_is_none_until_the_end_and_when_not_counting_no_events():
    tee = ResponseTee(counts_events=False, keep_max_bytes=1000)
    tee(STREAM)
    assert tee.body is None
    tee(b"")
    assert tee.body == STREAM and tee.events_seen == 0


def test_a_failing_callback_never_breaks_the_stream():
    def boom():
        raise RuntimeError("ledger down")

    tee = ResponseTee(counts_events=True, keep_max_bytes=1000, on_first_event=boom)
    assert tee(STREAM) == STREAM


def test_recordable_headers_drop_framing_and_cookies():
    h = [("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked"),
         ("Set-Cookie", "s=1"), ("x-codex-turn-state", "ts_1"), ("content-length", "5")]
    assert recordable_headers(h) == (("Content-Type", "text/event-stream"), ("x-codex-turn-state", "ts_1"))
