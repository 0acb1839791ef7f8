"""A TCP relay in front of a PostgreSQL server on loopback, for tests of a connection that
breaks at the worst moment: once armed, the first transaction that claims an attempt
(``INSERT INTO attempts``) has its ``COMMIT`` passed to the server, and the connection is cut
before the server's answer comes back. The claim is then committed while the process that
made it cannot know whether it was: a claim in doubt.

    with PgCut(pg_url) as cut:
        url = cut.url          # the same database, through the relay
        cut.arm()
        ...                    # a request whose claim goes through ``url``
        cut.wait_cut(10)
        ...                    # what happens while the process cannot connect again
        cut.let_in()

``isolate`` cuts a process off its ledger but for its notifications: every connection through
the relay but the one that sent ``LISTEN`` is closed, new ones refused until ``let_in``.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from urllib.parse import urlsplit, urlunsplit

CLAIM = b"INSERT INTO attempts"
# a COMMIT as a simple query, or prepared (psycopg prepares a statement it ran often: its Parse
# names it, and each later run is a Bind of that name, without the text)
COMMIT_QUERY = re.compile(rb"Q....COMMIT\x00", re.S)
COMMIT_PARSE = re.compile(rb"P....([^\x00]*)\x00COMMIT\x00", re.S)
SETTLE_S = 0.3  # the server's time to commit what it was sent, before the cut


class PgCut:
    def __init__(self, pg_url: str):
        parts = urlsplit(pg_url)
        self._target = (parts.hostname, parts.port or 5432)
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        netloc = parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{port}"
        self.url = urlunsplit(parts._replace(
            netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))
        self._armed = threading.Event()
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._stopped = False
        self._refusing = False  # after the cut (``arm``)
        self._refusing_all = False  # (``isolate``)
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._listening: set[tuple[socket.socket, socket.socket]] = set()

    def __enter__(self) -> "PgCut":
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped = True
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                _close(s)

    def arm(self) -> None:
        """Cut the connection of the next claim's transaction at its ``COMMIT`` (once); new
        connections are refused from then on, until ``let_in``."""
        self._cut.clear()
        self._refusing = True
        self._armed.set()

    def isolate(self) -> None:
        """Close every connection through the relay but those that listen for notifications
        (they sent ``LISTEN``), and refuse new ones until ``let_in``: the process can no
        longer read or write the ledger, yet it is still told of the ends of attempts."""
        with self._lock:
            self._refusing_all = True
            for client, server in list(self._pairs):
                if (client, server) not in self._listening:
                    _close(client)
                    _close(server)

    def let_in(self) -> None:
        """New connections pass again."""
        self._refusing = self._refusing_all = False

    def wait_cut(self, timeout: float) -> bool:
        return self._cut.wait(timeout)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._refusing_all or self._refusing and self._cut.is_set():
                _close(client)
                continue
            try:
                server = socket.create_connection(self._target, timeout=10)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
                self._pairs.append((client, server))
            cutting = threading.Event()
            threading.Thread(target=self._upward, args=(client, server, cutting),
                             daemon=True).start()
            threading.Thread(target=_downward, args=(server, client, cutting),
                             daemon=True).start()

    def _upward(self, client: socket.socket, server: socket.socket,
                cutting: threading.Event) -> None:
        claiming = False
        prepared: set[bytes] = set()  # the names of COMMIT's prepared statements
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                break
            if not data:
                break
            if b"LISTEN " in data:
                with self._lock:
                    self._listening.add((client, server))
            if self._armed.is_set() and CLAIM in data:
                claiming = True
            prepared.update(m.group(1) for m in COMMIT_PARSE.finditer(data))
            commit = claiming and self._armed.is_set() and (
                COMMIT_QUERY.search(data) is not None or COMMIT_PARSE.search(data) is not None
                or any(re.search(rb"B....[^\x00]*\x00" + re.escape(name) + rb"\x00", data, re.S)
                       for name in prepared if name))
            if commit:
                self._armed.clear()
                cutting.set()  # the server's answer to it never reaches the client
            try:
                server.sendall(data)
            except OSError:
                break
            if commit:
                time.sleep(SETTLE_S)
                _close(client)
                _close(server)
                self._cut.set()
                return
        _close(client)
        _close(server)


def _downward(server: socket.socket, client: socket.socket, cutting: threading.Event) -> None:
    source, sink = server, client
    while True:
        try:
            data = source.recv(65536)
            if not data:
                break
            if not cutting.is_set():
                sink.sendall(data)
        except OSError:
            break
    _close(source)
    _close(sink)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
