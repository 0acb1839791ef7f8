"""Tests for turnguard_core.sse: chunking invariance, WHATWG line rules, bounded memory."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from turnguard_core.sse import (
    TERMINAL_FAILURE,
    TERMINAL_SUCCESS,
    SseEvent,
    SseKinds,
    SseParser,
    event_kind,
    terminal_kind,
)

BOM = b"\xef\xbb\xbf"


def parse(chunks, **kw) -> tuple[SseParser, list[SseEvent]]:
    p = SseParser(**kw)
    out: list[SseEvent] = []
    for c in chunks:
        out += p.feed(c)
    out += p.close()
    return p, out


def split_at(raw: bytes, cuts) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(raw)})
    return [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)])]


def bytewise(raw: bytes) -> list[bytes]:
    return [raw[i : i + 1] for i in range(len(raw))]


# --- generated streams ------------------------------------------------------------------------

# Field values: any Unicode (multi-byte included) except line breaks and surrogates.
values = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12
)
comments = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=8
).map(lambda s: ":" + s)


@st.composite
def streams(draw):
    """(raw bytes, expected events): blocks of event/data/id fields, comments, random endings."""
    eol_mode = draw(st.sampled_from(["\n", "\r\n", "\r", "mixed"]))
    lines: list[str] = []  # without endings; "" is a blank line
    expected: list[SseEvent] = []
    last_id = None

    def field(name: str, value: str) -> str:
        if value == "" and draw(st.booleans()):
            return name  # no colon: field with an empty value
        # one space after the colon is stripped, so a value starting with a space needs it
        sep = ": " if value.startswith(" ") or draw(st.booleans()) else ":"
        return f"{name}{sep}{value}"

    def maybe_comments():
        lines.extend(draw(st.lists(comments, max_size=2)))

    maybe_comments()
    for _ in range(draw(st.integers(0, 6))):
        event = draw(st.none() | values)
        data = draw(st.lists(values, max_size=4))
        ident = draw(st.none() | values.filter(lambda s: "\0" not in s))
        block = [field("data", d) for d in data]
        for name, value in (("event", event), ("id", ident)):
            if value is not None:
                block.insert(draw(st.integers(0, len(block))), field(name, value))
        for _ in range(draw(st.integers(0, 2))):
            block.insert(draw(st.integers(0, len(block))), draw(comments))
        lines.extend(block)
        lines.extend([""] * draw(st.integers(1, 2)))  # extra blank lines dispatch nothing
        if ident is not None:
            last_id = ident
        if data:  # a block without a data line is no event, whatever its name
            expected.append(SseEvent(event, "\n".join(data), last_id))
        maybe_comments()
    # An unterminated last block is never dispatched.
    trailing = draw(st.lists(values.map(lambda v: field("data", v)), max_size=2))
    lines.extend(trailing)

    out: list[str] = []
    prev = None
    for i, line in enumerate(lines):
        if i == len(lines) - 1 and trailing and draw(st.booleans()):
            out.append(line)  # stream ends without a final line ending
            break
        if eol_mode != "mixed":
            eol = eol_mode
        elif line == "" and prev == "\r":
            eol = draw(st.sampled_from(["\r\n", "\r"]))  # "\r" + "\n" would be one CRLF
        else:
            eol = draw(st.sampled_from(["\n", "\r\n", "\r"]))
        out.append(line + eol)
        prev = eol
    raw = "".join(out).encode("utf-8")
    if draw(st.booleans()):
        raw = BOM + raw
    return raw, expected


@settings(max_examples=examples(300))
@given(streams(), st.data())
def test_any_chunking_gives_the_generated_events(stream, data):
    raw, expected = stream
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=30), label="cuts")

    whole_parser, whole = parse([raw])
    assert whole == expected
    assert parse(split_at(raw, cuts))[1] == expected
    assert parse(bytewise(raw))[1] == expected

    assert whole_parser.events_seen == len(expected)
    assert whole_parser.last_type == (expected[-1].type if expected else None)
    assert not whole_parser.overflowed


# Data that names (or seems to name) a terminal type, spelt plainly or with JSON escapes.
_typed_data = st.sampled_from([
    '{"type":"response.completed"}', '{"type": "response.failed", "x": 1}',
    '{"type":"response\\u002ecompleted"}', '{"type":"\\u0065rror"}', '{"type":"error"',
    '{"type":"response.output_text.delta","delta":"response.completed"}', '"error"',
    '{"type":["error"]}', '{"type":"response.incomplete"}', '[{"type":"error"}]',
    # Chat Completions: [DONE] ends the stream, an object with an error member fails it
    '[DONE]', ' [DONE] ', '[DONE]x', '{"error": {"message": "x"}}', '{"\\u0065rror": 1}',
    '{"object": "chat.completion.chunk", "choices": [{"delta": {"content": "error"}}]}',
    '{"type": 5, "error": null}',
])


@st.composite
def typed_streams(draw):
    """SSE bytes whose events carry their type in data or in an event: field, any length."""
    blocks = []
    for _ in range(draw(st.integers(0, 6))):
        lines = []
        if draw(st.booleans()):
            lines.append("event:" + draw(st.sampled_from(["", "error", "response.completed", "x"])))
        for part in draw(st.lists(_typed_data | values, min_size=0, max_size=3)):
            lines.append("data: " + part)
        blocks.append("\n".join(lines) + "\n\n")
    return "".join(blocks).encode("utf-8")


@settings(max_examples=examples(300))
@given(st.one_of(streams().map(lambda s: s[0]), typed_streams()), st.data(),
       st.sampled_from([8 * 1024 * 1024, 24]))
def test_kinds_are_the_terminal_kinds_of_the_events(raw, data, limit):
    """SseKinds (the tee's parser) gives, in any chunking, exactly the terminal kind of each
    event SseParser gives, also with escaped JSON types and events over the size limit."""
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=30), label="cuts")
    events = parse([raw], max_event_bytes=limit)[1]
    want = [event_kind(e) or "other" for e in events]
    # as an upstream writes: a chunk per event or per few events (the fast path's chunks)
    ends = [i + 2 for i in range(len(raw)) if raw[i:i + 2] == b"\n\n"]
    by_events = split_at(raw, data.draw(st.lists(st.sampled_from(ends), max_size=len(ends)),
                                        label="event ends") if ends else [])
    for chunks in ([raw], split_at(raw, cuts), bytewise(raw), split_at(raw, ends), by_events,
                   [b"", *split_at(raw, ends)]):
        p = SseKinds(max_event_bytes=limit)
        per_chunk = [p.feed(c) for c in chunks]
        p.close()
        assert [k for kinds in per_chunk for k in kinds] == want
        assert p.events_seen == len(events)
        # take(): per chunk, the count and the first terminal kind among its events
        t = SseKinds(max_event_bytes=limit)
        for chunk, kinds in zip(chunks, per_chunk):
            before = t.events_seen
            terminal = [k for k in kinds if k != "other"]
            assert t.take(chunk) == (terminal[0] if terminal else None)  # the first decides
            assert t.events_seen - before == len(kinds)


# --- line endings, BOM, UTF-8 -------------------------------------------------------------------


def test_crlf_split_across_chunks_is_one_line_ending():
    # If the CR ending chunk 1 were a lone CR, the LF opening chunk 2 would be a blank line and
    # dispatch "a" on its own.
    p = SseParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"\ndata: b\r") == []
    assert p.feed(b"\n") == []
    assert p.feed(b"\r") == [SseEvent(None, "a\nb", None)]
    assert p.feed(b"\n") == []  # completes the CRLF of the blank line, not another blank line


@pytest.mark.parametrize(
    "raw",
    [b"data: a\n\n", b"data: a\r\n\r\n", b"data: a\r\r", b"data: a\r\n\r", b"data: a\r\n\n"],
)
def test_line_ending_styles(raw):
    for chunks in ([raw], bytewise(raw)):
        assert parse(chunks)[1] == [SseEvent(None, "a", None)]


def test_multibyte_utf8_split_at_every_byte():
    text = "héllo 😀 中文 ✓"
    raw = f"event: delta\ndata: {text}\ndata: {text}\n\n".encode()
    expected = [SseEvent("delta", f"{text}\n{text}", None)]
    assert parse([raw])[1] == expected
    assert parse(bytewise(raw))[1] == expected
    for i in range(len(raw)):
        assert parse([raw[:i], raw[i:]])[1] == expected


def test_invalid_utf8_is_replaced_the_same_in_any_chunking():
    raw = b"data: a\xff\xe2\x82b\xf0\x9f\x98\n\n"
    expected = [SseEvent(None, b"a\xff\xe2\x82b\xf0\x9f\x98".decode("utf-8", "replace"), None)]
    assert parse([raw])[1] == expected
    assert parse(bytewise(raw))[1] == expected


def test_bom_is_dropped_once_at_stream_start():
    raw = BOM + b"data: x\n\n"
    assert parse([raw])[1] == [SseEvent(None, "x", None)]
    assert parse(bytewise(raw))[1] == [SseEvent(None, "x", None)]
    # A second BOM is part of the first line: the field name is then "\ufeffdata", unknown.
    assert parse([BOM + BOM + b"data: x\n\n"])[1] == []
    # A BOM later in the stream is not stripped either.
    assert parse([b"data: a\n\n" + BOM + b"data: b\n\n"])[1] == [SseEvent(None, "a", None)]
    # Bytes that only look like the start of a BOM are kept.
    assert parse([b"\xef", b"data: x\n\n"])[1] == []
    assert parse([b"data: x\n", b"\n"])[1] == [SseEvent(None, "x", None)]


# --- fields ------------------------------------------------------------------------------------


def test_field_rules():
    raw = (
        b": a comment\n"
        b"data:no space\n"
        b"data:  two spaces\n"
        b"data\n"  # no colon: empty value
        b"retry: 1000\n"
        b"unknown: x\n"
        b"event:custom\n"
        b"\n"
    )
    assert parse([raw])[1] == [SseEvent("custom", "no space\n two spaces\n", None)]


def test_id_persists_and_nul_id_is_ignored():
    raw = b"id: 1\ndata: a\n\ndata: b\n\nid: x\0y\ndata: c\n\nid\ndata: d\n\n"
    assert [e.id for e in parse([raw])[1]] == ["1", "1", "1", ""]


def test_a_block_without_a_data_line_is_no_event_whatever_its_name():
    """The standard dispatches nothing for a block whose data buffer is empty: a name alone
    (`event: response.completed` with no `data:`) is no terminal event, so such a stream is
    never taken for a completed one (and replayed); an empty `data:` line is data."""
    raw = (b"event: ping\n\n\n\nid: 5\n\n: just a comment\n\n"
           b"event: response.completed\n\nevent: response.completed\n: ping\n\n"
           b"event: response.completed\nid: 6\n\n")
    p, out = parse([raw])
    assert out == [] and p.events_seen == 0
    kinds = SseKinds()
    assert [kinds.take(raw[i:i + 1]) for i in range(len(raw))] == [None] * len(raw)
    # and through the tee's fast paths (a chunk of one event, a chunk of whole events)
    for chunk in (b"event: response.completed\n: ping\n\n", b"event: response.completed\nid: 7\n\n",
                  b"event: response.completed\n\nevent: response.failed\nid: 8\n\n"):
        assert kinds.take(chunk) is None and kinds.feed(chunk) == []
    assert kinds.events_seen == 0
    assert kinds.take(b"event: response.completed\ndata:\n\n") == "success"
    p, out = parse([b"event: response.completed\ndata:\n\n"])
    assert out == [SseEvent("response.completed", "", None)] and p.events_seen == 1


def test_close_never_dispatches_an_unterminated_event():
    for raw in (b"data: x", b"data: x\n", b"event: response.completed\r"):
        p, out = parse([raw])
        assert out == [] and p.events_seen == 0
    p = SseParser()
    p.close()
    with pytest.raises(ValueError):
        p.feed(b"data: x\n\n")


# --- type and terminal kinds -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "data", "expected"),
    [
        ("response.completed", '{"type": "other"}', "response.completed"),
        (None, '{"type": "response.failed"}', "response.failed"),
        ("", ' \n{"type":"error"}', "error"),  # empty event field: fall back to the data
        (None, '{"type": 5}', None),
        (None, '["type"]', None),
        (None, "[DONE]", None),
        (None, "not json", None),
        (None, "", None),
        (None, '{"type": "x"', None),
    ],
)
def test_event_type(event, data, expected):
    assert SseEvent(event, data, None).type == expected


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [
        ("response.completed", "success"),
        ("response.incomplete", "success"),
        ("response.failed", "failure"),
        ("error", "failure"),
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_text.delta", None),
        ("response.output_item.done", None),
        ("", None),
        (None, None),
        ("Response.Completed", None),
    ],
)
def test_terminal_kind(event_type, kind):
    assert terminal_kind(event_type) == kind


def test_terminal_sets():
    assert TERMINAL_SUCCESS == {"response.completed", "response.incomplete"}
    assert TERMINAL_FAILURE == {"response.failed", "error"}


def responses_stream(with_event_lines: bool) -> tuple[bytes, list[str]]:
    resp = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    payloads = [
        {"type": "response.created", "sequence_number": 0, "response": resp},
        {"type": "response.in_progress", "sequence_number": 1, "response": resp},
        {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
         "item": item},
        {"type": "response.output_text.delta", "sequence_number": 3, "item_id": "msg_1",
         "output_index": 0, "content_index": 0, "delta": "Hel"},
        {"type": "response.output_text.delta", "sequence_number": 4, "item_id": "msg_1",
         "output_index": 0, "content_index": 0, "delta": "lo — ünïcödé 👋"},
        {"type": "response.output_item.done", "sequence_number": 5, "output_index": 0,
         "item": item},
        {"type": "response.completed", "sequence_number": 6,
         "response": {**resp, "status": "completed", "usage": {"total_tokens": 12}}},
    ]
    out = b""
    for p in payloads:
        if with_event_lines:
            out += f"event: {p['type']}\n".encode()
        out += f"data: {json.dumps(p, ensure_ascii=False)}\n\n".encode()
    return out, [p["type"] for p in payloads]


@pytest.mark.parametrize("with_event_lines", [True, False])
def test_realistic_responses_stream(with_event_lines):
    raw, types = responses_stream(with_event_lines)
    for chunks in ([raw], split_at(raw, range(0, len(raw), 7)), bytewise(raw)):
        p, out = parse(chunks)
        assert [e.type for e in out] == types
        assert json.loads(out[4].data)["delta"] == "lo — ünïcödé 👋"
        assert p.events_seen == 7
        assert p.last_type == "response.completed"
        assert terminal_kind(p.last_type) == "success"
        assert [terminal_kind(e.type) for e in out[:-1]] == [None] * 6


# --- bounded memory ----------------------------------------------------------------------------

MiB = 1024 * 1024


def feed_bounded(p: SseParser, chunks) -> tuple[list[SseEvent], int]:
    """Feed chunks; assert the parser's own buffer stays bounded; return events, traced peak."""
    out: list[SseEvent] = []
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for c in chunks:
            out += p.feed(c)
            assert p.buffered_bytes <= 2 * p.max_event_bytes
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return out, peak


def test_huge_single_line_event_is_counted_but_not_held():
    p = SseParser(max_event_bytes=MiB)
    block = b"x" * (64 * 1024)

    def chunks():
        yield b'event: response.completed\ndata: {"type":"response.completed","x":"'
        for _ in range(20 * 16):  # 20 MiB in one data line
            yield block
        yield b'"}\n\ndata: {"type":"after"}\n\n'

    out, peak = feed_bounded(p, chunks())
    assert peak < 4 * MiB, peak
    assert p.overflowed
    assert [e.type for e in out] == ["response.completed", "after"]
    assert out[0] == SseEvent("response.completed", "", None, truncated=True)
    assert not out[1].truncated
    assert p.events_seen == 2
    assert p.buffered_bytes == 0


def test_huge_multi_line_event_is_counted_but_not_held():
    p = SseParser(max_event_bytes=MiB)
    lines = b"data: " + b"y" * 1017 + b"\n"  # 1 KiB per line
    block = lines * 64

    def chunks():
        yield b"event: response.output_text.delta\n"
        for _ in range(20 * 16):  # 20 MiB of data lines
            yield block
        yield b"\nevent: response.completed\ndata: {}\n\n"

    out, peak = feed_bounded(p, chunks())
    assert peak < 4 * MiB, peak
    assert p.overflowed
    assert [(e.type, e.truncated, e.data) for e in out] == [
        ("response.output_text.delta", True, ""),
        ("response.completed", False, "{}"),
    ]
    assert p.events_seen == 2


def test_overlong_comment_and_unterminated_line_stay_bounded():
    p = SseParser(max_event_bytes=1000)
    out = p.feed(b":" + b"c" * 5000)
    out += p.feed(b"c" * 5000 + b"\ndata: ok\n\n")
    assert out == [SseEvent(None, "ok", None)]
    assert p.overflowed
    assert p.feed(b"data: " + b"z" * 900) == []  # no line ending yet: held
    assert p.buffered_bytes == 906
    assert p.feed(b"z" * 200) == []  # now overlong: only a short name prefix is kept
    assert p.buffered_bytes <= 64
    assert p.close() == []


def test_data_exactly_at_the_limit_is_kept():
    # "data: " + 9 bytes -> 9 + 1 (the joining newline) = 10 bytes of event data.
    p, out = parse([b"data: 123456789\n\n"], max_event_bytes=15)
    assert out == [SseEvent(None, "123456789", None)] and not p.overflowed
    p, out = parse([b"data: 123456789\ndata: 12345\n\n"], max_event_bytes=15)
    assert out == [SseEvent(None, "", None, truncated=True)] and p.overflowed
