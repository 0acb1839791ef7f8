"""The Responses API's server-sent events and error bodies, as the mock sends them. Pure.

Every list of events is ``[(type, payload), ...]`` with ``payload["type"] == type`` and
``sequence_number`` 0, 1, 2, ...; ``turnguard_sse.frame`` turns one into bytes. Payloads carry
no timestamps, so two answers differ only by their ids.
"""

from __future__ import annotations

from typing import Any

Event = tuple[str, dict[str, Any]]

INVALID_BODY_ERROR = {"error": {
    "message": "We could not parse the JSON body of your request. (HINT: This likely means you "
               "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
               "but what was sent was not valid JSON.)",
    "type": "invalid_request_error", "param": None, "code": None,
}}


def response_object(rid: str, model: str, status: str, output: list[Any]) -> dict[str, Any]:
    """A Responses API ``response`` object (no timestamps, so payloads differ only by id)."""
    return {"id": rid, "object": "response", "status": status, "model": model, "output": output}


def _step(rid: str, model: str, item: dict[str, Any], added: dict[str, Any],
          middle: list[Event]) -> list[Event]:
    """The events of one completed step whose output is ``item``: created, in_progress,
    output_item.added (``added``: the item as it starts), ``middle``, output_item.done,
    completed; each payload given its ``type`` and ``sequence_number``."""
    raw: list[Event] = [
        ("response.created", {"response": response_object(rid, model, "in_progress", [])}),
        ("response.in_progress", {"response": response_object(rid, model, "in_progress", [])}),
        ("response.output_item.added", {"response": {"id": rid}, "output_index": 0, "item": added}),
        *middle,
        ("response.output_item.done", {"response": {"id": rid}, "output_index": 0, "item": item}),
        ("response.completed", {"response": response_object(rid, model, "completed", [item])}),
    ]
    return [(t, {"type": t, "sequence_number": i, **d}) for i, (t, d) in enumerate(raw)]


def ok_events(rid: str, model: str, deltas: int, text: str) -> list[Event]:
    """The events of a successful streamed turn, in order: created, in_progress,
    output_item.added, ``deltas`` x output_text.delta (each carrying ``text``),
    output_item.done, completed. Every payload has ``type``, ``sequence_number`` and a
    ``response`` object with the response id."""
    item_id = "msg_" + rid.removeprefix("resp_")
    done_item = {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text * deltas, "annotations": []}],
    }
    delta = ("response.output_text.delta", {"response": {"id": rid}, "item_id": item_id,
                                            "output_index": 0, "content_index": 0, "delta": text})
    return _step(rid, model, done_item, {**done_item, "status": "in_progress", "content": []},
                 [delta] * deltas)


def delta_text(text: str, delta_bytes: int | None) -> str:
    """The text of one output_text.delta: ``text``, or ``text`` repeated and cut to
    ``delta_bytes`` ASCII characters when that size is given (``text`` must then be ASCII to
    hit the size exactly)."""
    if delta_bytes is None:
        return text
    if delta_bytes <= 0:
        return ""
    base = text or "x"
    return (base * (delta_bytes // len(base) + 1))[:delta_bytes]


def tool_call_events(rid: str, model: str, name: str, arguments: str, call_id: str) -> list[Event]:
    """The events of a turn's step that ends in one function call, shaped like the Responses
    API's: created, in_progress, output_item.added (a ``function_call`` item),
    function_call_arguments.delta, function_call_arguments.done, output_item.done, completed
    (its ``output`` is the function call). The client runs the tool and sends the next request
    of the same turn, carrying the ``x-codex-turn-state`` this response returned."""
    item_id = "fc_" + rid.removeprefix("resp_")
    item = {
        "id": item_id,
        "type": "function_call",
        "status": "completed",
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }
    ref = {"response": {"id": rid}, "item_id": item_id, "output_index": 0}
    return _step(rid, model, item, {**item, "status": "in_progress", "arguments": ""}, [
        ("response.function_call_arguments.delta", {**ref, "delta": arguments}),
        ("response.function_call_arguments.done", {**ref, "arguments": arguments}),
    ])


def failed_event(rid: str, model: str, seq: int) -> Event:
    """A ``response.failed`` event (the upstream gave up after some output)."""
    resp = response_object(rid, model, "failed", [])
    resp["error"] = {"code": "server_error", "message": "mock upstream: the response failed"}
    return ("response.failed", {"type": "response.failed", "sequence_number": seq, "response": resp})


def openai_error(code: int) -> dict[str, Any]:
    """The default error body of a ``status`` behaviour, shaped like OpenAI's."""
    if code == 429:
        etype, ecode = "requests", "rate_limit_exceeded"
    elif code >= 500:
        etype, ecode = "server_error", "server_error"
    else:
        etype, ecode = "invalid_request_error", "invalid_request"
    return {"error": {"message": f"mock upstream error {code}", "type": etype, "code": ecode}}
