"""The benchmark's ``ledger_floor`` variant: the ``floor`` plus the durable writes any guard that
executes a request at most once across processes must make, and nothing else.

Before a request goes upstream, a claim on its body's hash is committed to a SQLite file (WAL,
``synchronous=NORMAL``, as turnguard's ledger); when its response ends, its outcome and its
body (kept as it streams, for replays) are committed. Both run on the event loop, as
turnguard's ledger calls do when the file is not contended. On a WebSocket the same for each
``response.create`` frame a client sends (the frame goes on while its claim is committed in
the hook; a repeated one too: the floor never holds or answers), its response being the
server's event frames up to the terminal one, each read as JSON, as a guard must to know
the response's end. No identity beyond a hash, no
policy, no holds, no telemetry: what turnguard does above this variant is its own logic; what
this variant costs over ``floor`` is what a durable claim and end cost any guard.
"""

import hashlib
import json
import os
import sqlite3
import time

from mitmproxy import ctx, http

FILE_NAME = "ledger-floor.sqlite3"  # in mitmproxy's confdir (the bench reads it back)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS claims (op_key TEXT PRIMARY KEY, state TEXT NOT NULL,"
    " started_at REAL NOT NULL, ended_at REAL, status INTEGER, body BLOB)"
)


class Tee:
    """Passes each chunk on and keeps it."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def __call__(self, chunk: bytes) -> bytes:
        if chunk:
            self.chunks.append(chunk)
        return chunk


def open_db(path: str) -> sqlite3.Connection:
    """The floor's file, as turnguard's ledger opens its own (WAL, ``synchronous=NORMAL``)."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute(SCHEMA)
    return db


def claim(db: sqlite3.Connection, op_key: str, now: float) -> bool:
    """Claim ``op_key``, committed; False when it was claimed before."""
    db.execute("BEGIN IMMEDIATE")
    claimed = db.execute(
        "INSERT INTO claims (op_key, state, started_at) VALUES (?, 'in_flight', ?)"
        " ON CONFLICT(op_key) DO NOTHING", (op_key, now)).rowcount
    db.execute("COMMIT")
    return claimed == 1


def end(db: sqlite3.Connection, op_key: str, status: int, body: bytes, now: float) -> None:
    """The claim's end, with the body kept for replays, committed."""
    db.execute(
        "UPDATE claims SET state='completed', ended_at=?, status=?, body=? WHERE op_key=?",
        (now, status, body, op_key))


TERMINAL_TYPES = frozenset({"response.completed", "response.failed", "response.incomplete",
                            "error"})


def _event_type(text: str) -> str | None:
    try:
        event = json.loads(text)
    except ValueError:
        return None
    kind = event.get("type") if isinstance(event, dict) else None
    return kind if isinstance(kind, str) else None


class LedgerFloor:
    def __init__(self) -> None:
        self.db: sqlite3.Connection | None = None

    def running(self) -> None:
        path = os.path.join(os.path.expanduser(ctx.options.confdir), FILE_NAME)
        self.db = open_db(path)

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.method != "POST" or self.db is None:
            return
        op_key = hashlib.sha256(flow.request.raw_content or b"").hexdigest()
        if claim(self.db, op_key, time.time()):
            flow.metadata["ledger_floor"] = op_key

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
            flow.response.stream = Tee() if "ledger_floor" in flow.metadata else True

    def response(self, flow: http.HTTPFlow) -> None:
        op_key = flow.metadata.get("ledger_floor")
        if op_key is None or self.db is None:
            return
        tee = flow.response.stream
        body = b"".join(tee.chunks) if isinstance(tee, Tee) else flow.response.raw_content
        end(self.db, op_key, flow.response.status_code, body, time.time())

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        message = flow.websocket.messages[-1]
        if self.db is None or not message.is_text:
            return
        if message.from_client:
            if _event_type(message.text) == "response.create":
                op_key = hashlib.sha256(message.content).hexdigest()
                if claim(self.db, op_key, time.time()):
                    flow.metadata["ledger_floor_ws"] = (op_key, [])
            return
        pending = flow.metadata.get("ledger_floor_ws")
        if pending is None:
            return
        kind = _event_type(message.text)
        pending[1].append(message.content)
        if kind in TERMINAL_TYPES:
            del flow.metadata["ledger_floor_ws"]
            end(self.db, pending[0], 200 if kind == "response.completed" else 502,
                b"\n".join(pending[1]), time.time())


addons = [LedgerFloor()]
