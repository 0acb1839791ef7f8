"""A mock OpenAI-Responses-style upstream for turnguard's tests and for people (``scripts/mock``).

A real HTTP/1.1 server on asyncio streams, so that every reset, clean close and stall happens
exactly when a scenario says so. Requests are parsed with h11 and WebSocket frames with wsproto
(both installed with mitmproxy); responses are written byte by byte.

    python scripts/mock_upstream.py --host 127.0.0.1 --port 0 \\
        [--scenario FILE.json] [--log FILE.jsonl]

On start it prints one line, ``mock upstream listening at http://127.0.0.1:PORT``, and flushes.
SIGTERM and SIGINT make it exit with status 0.

Modules
-------
``scenario``    which behaviour answers each dispatch (validation, selection, counters); pure
``events``      the Responses API's SSE events and error bodies; pure
``server``      the HTTP/1.1 server: h11 parsing, raw writes, RST / FIN / stalls; also the
                request parser of the benchmark's upstream and the server of the hostile
                upstream in the tests
``websocket``   a WebSocket session (wsproto) on a ``server.Connection`` after an upgrade
``behaviours``  how one dispatch is answered, one ``_do_<kind>`` method per behaviour
``responses_ws`` the Responses API over WebSocket: the same behaviours, events as frames
``upstream``    the routes and the dispatch log
``__main__``    the command line

Routes
------
``POST .../responses`` and ``POST .../chat/completions`` (query ignored)
    A model *dispatch*: numbered n = 0, 1, 2, ... across the server, logged, and answered by a
    behaviour chosen as ``scenario`` says. As the API: SSE when the body says
    ``"stream": true``, else one JSON object; a body that is not a JSON object gets 400 and is
    no dispatch (logged as ``invalid_body``). ``--help`` lists every behaviour.
``GET .../responses`` with ``Upgrade: websocket``
    The Responses API over WebSocket (Codex's default transport): each ``response.create``
    frame is a dispatch, answered with one JSON event per frame (see ``responses_ws``).
``GET /_mock/health``
    200 ``ok``.
``GET /_mock/dispatches``
    JSON list of the dispatch records so far (``GET /_mock/records``: every record).
``POST /_mock/scenario``
    Body: a scenario. Replaces the scenario and resets the dispatch counter to 0.
``POST /_mock/release``
    Body: ``{"hold": NAME}``. Releases the hold NAME (a behaviour's ``hold``): the dispatches
    waiting at it go on, and any that reaches it later passes at once. Answers
    ``{"ok": true, "waiting": K}``, K the dispatches that were waiting at it.
Anything else
    404 with a JSON error.

Log (``--log``, JSON lines, mode 0600, flushed per line, also kept in memory)
    ``{"event": "dispatch", "n", "ts", "method", "path", "query", "conn", "session",
    "turn_state", "body_sha256", "behaviour", "authorization_present", "selected_by",
    "op_n", "session_n", "spec", "client_attempt"}`` when a dispatch starts (``behaviour`` is
    the kind, ``spec`` the whole behaviour, ``selected_by`` one of header / operation /
    session / sequence / default, ``op_n`` and ``session_n`` the dispatch's number within its
    operation and session, ``client_attempt`` the ``x-turnguard-repro-attempt`` header the
    reproduction toolkit's clients send, or null);
    ``{"event": "client_gone", "n", "ts"}`` when its client disconnects before the behaviour
    finished; ``{"event": "dispatch_end", "n", "ts", "status", "events_sent", "outcome"}`` when
    it ends (``status`` is null when no status line was sent); ``{"event": "scenario", "ts"}``
    when ``POST /_mock/scenario`` replaced the scenario; ``{"event": "held", "n", "ts", "hold",
    "events_sent"}`` when a dispatch reaches its hold point and ``{"event": "hold_end", "n",
    "ts", "hold", "how"}`` when it goes on (``how``: released or timed_out);
    ``{"event": "release", "ts", "hold", "waiting"}`` for ``POST /_mock/release``;
    ``{"event": "invalid_body", "ts",
    "path", "bytes"}`` for a model request whose body is not a JSON object. The Authorization
    value is never logged.
"""
