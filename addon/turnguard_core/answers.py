"""The answers turnguard writes itself: OpenAI-shaped JSON errors with retry hints.

Pure: each function returns status, headers and body; the addon turns them into a response.
"""

from __future__ import annotations

import json

from .records import record


@record
class Answer:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def error_answer(
    status: int,
    code: str,
    message: str,
    *,
    retry_after_s: int | None = None,
    should_retry: bool | None = None,
) -> Answer:
    """``{"error": {"message", "type", "code"}}`` with ``type`` == ``code`` as the issue asks,
    plus ``Retry-After`` (whole seconds) and ``x-should-retry`` when given."""
    body = json.dumps(
        {"error": {"message": message, "type": code, "code": code, "param": None}},
        separators=(",", ":"),
    ).encode()
    headers = [("content-type", "application/json"), ("x-turnguard", code)]
    if retry_after_s is not None:
        headers.append(("retry-after", str(retry_after_s)))
    if should_retry is not None:
        headers.append(("x-should-retry", "true" if should_retry else "false"))
    return Answer(status, tuple(headers), body)


def turn_in_progress(retry_after_s: int, held_ms: int) -> Answer:
    return error_answer(
        409,
        "turn_in_progress",
        f"An identical request is still being answered upstream; it was held {held_ms} ms "
        f"without ending. Retry after {retry_after_s} s.",
        retry_after_s=retry_after_s,
        should_retry=True,
    )


def response_refused(reason: str) -> Answer:
    """502 ``proxy_refused_response`` for a duplicate held while its original ran: the upstream
    answered the original, but the proxy refused that answer (``reason``, mitmproxy's message:
    a body past its ``body_size_limit``). The same request would be refused the same way, so
    it was not run upstream again."""
    return error_answer(
        502,
        "proxy_refused_response",
        f"An identical request was answered upstream, but the proxy refused the answer "
        f"({reason}); it was not run again. Raise the limit to receive it.",
        should_retry=False,
    )


def idempotency_key_conflict() -> Answer:
    return error_answer(
        422,
        "idempotency_key_conflict",
        "This Idempotency-Key was already used with a different request body.",
        should_retry=False,
    )


def upstream_unavailable(
    code: str, message: str, *, retry_after_s: int, accepts_sse: bool
) -> Answer:
    """503 fail-closed answer (``upstream_request_timeout`` during a cooldown,
    ``upstream_operation_status_unknown`` when a recovery claim is exhausted). Nothing was
    dispatched. A client that accepts ``text/event-stream`` gets the error as an SSE body that
    starts with a ``retry:`` hint in milliseconds; the headers carry ``Retry-After`` for all."""
    json_answer = error_answer(503, code, message, retry_after_s=retry_after_s, should_retry=True)
    if not accepts_sse:
        return json_answer
    body = (
        f"retry: {retry_after_s * 1000}\n\nevent: error\ndata: ".encode()
        + json_answer.body
        + b"\n\n"
    )
    headers = tuple(
        ("content-type", "text/event-stream") if k == "content-type" else (k, v)
        for k, v in json_answer.headers
    )
    return Answer(503, headers, body)


def cooldown_rejected(retry_after_s: int, threshold: int, *, accepts_sse: bool) -> Answer:
    """503 ``upstream_request_timeout`` for a request fenced by a cooling retry circuit."""
    return upstream_unavailable(
        "upstream_request_timeout",
        f"The upstream failed {threshold} or more times in a row without sending a response "
        f"event; retries are paused for {retry_after_s} s.",
        retry_after_s=retry_after_s, accepts_sse=accepts_sse,
    )


def failed_closed(code: str, reason: str, retry_after_s: int, *, accepts_sse: bool) -> Answer:
    """503 for a request turnguard may not recover (``reason``); nothing was dispatched."""
    if code == "upstream_operation_status_unknown":
        message = ("This request already had its one recovery attempt after eventless upstream "
                   "failures; its outcome is unknown. Start a new turn.")
    else:
        message = (f"The upstream is unavailable for this request ({reason}); "
                   f"retry after {retry_after_s} s.")
    return upstream_unavailable(code, message, retry_after_s=retry_after_s,
                                accepts_sse=accepts_sse)
