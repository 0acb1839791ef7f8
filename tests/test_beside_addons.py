"""turnguard beside mitmproxy's other options and addons, through a real mitmdump: options
and addons that change what reaches turnguard, or what mitmproxy does with a flow after
turnguard's hook: every promise holds, or the flow passes through untouched with its reason."""

from __future__ import annotations

from harness import (
    MockUpstream,
    assert_no_traceback,
    guarded,
    post_turn,
    read_jsonl,
    wait_until,
)


def _events(tmp_path, name="mitmdump"):
    return read_jsonl(tmp_path / f"{name}-events.jsonl")


def test_a_request_body_mitmproxy_streamed_and_stored_is_not_guarded(tmp_path):
    """With ``stream_large_bodies`` mitmproxy streams a large request body upstream as it
    comes; with ``store_streamed_bodies`` too it keeps a copy, so the ``request`` hook (which
    comes only once the body went upstream) sees a whole body. The request went upstream
    already: turnguard can neither hold it nor answer it (mitmproxy sends the upstream's
    answer whatever the hook set), so it must pass it through as "request body is streamed",
    never count it as replayed or held while the upstream runs it again."""
    turn = {"model": "m", "input": "x" * 4096, "stream": True}
    with MockUpstream(tmp_path) as up, \
            guarded(tmp_path, up, stream_large_bodies="1k", store_streamed_bodies=True) as p:
        answers = [post_turn(p.url, {}, turn, timeout=20) for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200]
        assert len(up.dispatches()) == 2  # streamed: each went upstream before any hook
        decided = ("passthrough", "dispatch", "duplicate_replayed", "request_held")
        events = wait_until(lambda: len(e := [x for x in _events(tmp_path)
                                              if x["event"] in decided]) >= 2 and e,
                            10, what="what turnguard decided for both")
        assert [(e["event"], e.get("reason")) for e in _events(tmp_path)] == [
            ("passthrough", "request body is streamed")] * 2
        assert answers[1][1].get("x-turnguard") is None
        assert_no_traceback(p.log_text())
