"""The mock upstream's command line: ``python -m turnguard_mock`` (with scripts/ on the path),
``scripts/mock_upstream.py`` or ``scripts/mock``; ``--help`` explains everything."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from .behaviours import behaviours_help
from .scenario import DEFAULT_SCENARIO, validate_scenario
from .server import Server, until_stopped
from .upstream import MockUpstream

HELP_INTRO = """\
A mock OpenAI Responses API upstream you can make stall, reset, fail or answer slowly, per
request or by script: put turnguard (scripts/proxy) in front of it to see holds, replays,
409s, cooldown 503s and recoveries without a network. Needs nothing beyond what mitmproxy
installs.

Model routes: POST .../responses and POST .../chat/completions (any prefix, query ignored).
  The request body must be a JSON object (else 400 invalid_request_error, like the API; not
  counted as a dispatch). The answer is SSE when the body says "stream": true, else one JSON
  response object. Every model request is a numbered *dispatch* n = 0, 1, 2, ... and is
  answered by a BEHAVIOUR, the first of:
    1. the x-mock-behaviour request header, a BEHAVIOUR as JSON, e.g.
         -H 'x-mock-behaviour: {"kind": "slow", "delay_ms": 5000}'
    2. the scenario's "operations" selector of the request body's sha256 (a prefix of >= 8
       hex digits), then its "sessions" selector of the session-id / session_id header
    3. the scenario's "sequence"[n], else its "default" ({"kind": "ok"} when absent)

WebSocket (Codex's default transport): GET .../responses with Upgrade: websocket. Each
  {"type": "response.create", ...} text frame is a dispatch like a POST (numbered, chosen and
  logged the same way, "transport": "ws"), answered with one JSON event per text frame by the
  same behaviours: reset = TCP RST, clean_close = close frame 1011, stalls = silence then the
  TCP connection ends, status = an "error" event with "status": code ("ws_status": false
  leaves the status out). "generate": false (Codex's prewarm) gets response.created +
  response.completed and is no dispatch. A previous_response_id this socket did not produce
  gets an error event 400 previous_response_not_found.

Control endpoints:
  GET  /_mock/health       200 ok
  GET  /_mock/dispatches   JSON list of the dispatch records so far (/_mock/records: all)
  POST /_mock/scenario     body: a SCENARIO; replaces it and restarts the count at n = 0
  POST /_mock/release      body: {"hold": NAME}; what waits at the hold NAME (a behaviour's
                           "hold") goes on, and what reaches it later passes at once

SCENARIO (JSON, every key optional; --scenario FILE or POST /_mock/scenario):
  {"default": BEHAVIOUR, "sequence": [BEHAVIOUR, ...],
   "sessions": {"SESSION-ID": {"sequence": [...], "default": BEHAVIOUR}},
   "operations": {"BODY-SHA256-PREFIX": {"sequence": [...], "default": BEHAVIOUR}}}

Log (--log FILE, JSON lines, 0600): a "dispatch" record when a dispatch starts (n, ts, path,
session, body_sha256, behaviour, ...), "client_gone" when its client left early, "dispatch_end"
(status, events_sent, outcome), "held" and "hold_end" (a dispatch at its hold, and how it went
on: released or timed_out), "release", "invalid_body", "scenario". No Authorization value is
logged.
"""

EXAMPLES = """\
Examples:
  scripts/mock --port 9000 --log /tmp/mock.jsonl
  curl -s 127.0.0.1:9000/v1/responses -d '{"model": "m", "input": "hi"}'
  curl -sN 127.0.0.1:9000/v1/responses -d '{"model": "m", "input": "hi", "stream": true}' \\
       -H 'x-mock-behaviour: {"kind": "partial", "events": 3, "end": "reset"}'
  curl -s 127.0.0.1:9000/_mock/scenario -d '{"sequence": [{"kind": "stall_before_headers",
       "ms": 8000}, {"kind": "reset"}], "default": {"kind": "ok"}}'
"""


async def serve(args: argparse.Namespace, scenario: dict[str, Any]) -> int:
    """Listen, print the listening line, serve until SIGTERM/SIGINT; return the exit status.
    A log file that cannot be opened or an address that cannot be listened on (in use, a
    host that does not resolve) is one line on stderr and exit status 1, no traceback."""
    try:
        mock = MockUpstream(scenario, args.log)
    except OSError as e:
        print(f"mock upstream: cannot open the log {args.log}: {e.strerror or e}",
              file=sys.stderr, flush=True)
        return 1
    server = Server(mock.route)
    try:
        await server.start(args.host, args.port)
    except OSError as e:  # (socket.gaierror is one)
        print(f"mock upstream: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr, flush=True)
        mock.close()
        return 1
    try:
        await until_stopped(lambda: print(
            f"mock upstream listening at http://{args.host}:{server.port}", flush=True))
    finally:
        await server.close()
        mock.close()
    return 0


def _port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: one the OS picks)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0 to 65535, not {port}")
    return port


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the scenario and serve."""
    p = argparse.ArgumentParser(
        prog=os.environ.get("TURNGUARD_MOCK_PROG") or "mock_upstream.py",
        description=HELP_INTRO, epilog=behaviours_help() + "\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; keep it on loopback)")
    p.add_argument("--port", type=_port, default=0,
                   help="port (default 0: one the OS picks; the listening line names it)")
    p.add_argument("--scenario", metavar="FILE", help="scenario JSON file (see SCENARIO above)")
    p.add_argument("--log", metavar="FILE", help="JSON-lines log file (appended, mode 0600)")
    args = p.parse_args(argv)
    scenario: Any = DEFAULT_SCENARIO
    if args.scenario:
        try:
            with open(args.scenario, encoding="utf-8") as f:
                scenario = validate_scenario(json.load(f))
        except (OSError, ValueError) as e:
            print(f"mock upstream: bad scenario {args.scenario}: {e}", file=sys.stderr, flush=True)
            return 2
    return asyncio.run(serve(args, scenario))


if __name__ == "__main__":
    sys.exit(main())
