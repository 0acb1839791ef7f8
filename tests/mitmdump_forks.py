"""mitmdump processes (and mock upstreams) forked from one that already imported mitmproxy,
for the tests.

Each mitmdump a test starts spends about 1 s of CPU importing mitmproxy before it runs anything
of turnguard's; the suite starts hundreds. This module keeps, per test process, one server that
has imported mitmproxy (``mitmproxy.tools.main`` and ``mitmproxy.tools.dump``, which imports its
addons) and the modules of turnguard's packages that ``addon/turnguard.py`` imports, with the
PostgreSQL ledger's (``_preload_turnguard``). Asked for a mitmdump, it forks: the child takes
the test's standard streams, working directory, environment and arguments, and runs the
``mitmdump`` script of the virtual environment as ``__main__``, as ``exec`` would have;
turnguard's addon is loaded by that mitmdump as always (``-s``), its script run anew, its
packages' modules found imported. A child that does not load ``addon/turnguard.py`` itself
(``-s``) has turnguard's modules dropped first, so that it imports what it asks for as an
exec'd one would (a copy of the script, a test's own addon, no turnguard at all). Their
imports cost a mitmdump with turnguard about 0.1 s of CPU, half its start (psycopg's, for a
PostgreSQL ledger, 0.16 s more); none of them reads the environment or the process as it is
imported (a forked child's would be the server's). The server reaps the child and tells the
test its exit status, so that ``ForkedPopen`` answers ``poll``, ``wait``, ``send_signal`` and
``kill`` as ``subprocess.Popen`` does. A start then costs about 0.1 s of CPU instead of 1.2. A child
ends as the interpreter would end it (its non-daemon threads waited for, its exit handlers
run, its status the same) but without tearing down its objects, which in a fork copies every
page it inherited (``_run_as_main``): a mitmdump with turnguard, started and stopped, 1.5 s
of CPU exec'd, 0.8 forked with the teardown, 0.44 without (then 0.19 once the harness gave
each confdir its CA, ``harness.seed_ca``, and turnguard's import got cheaper). The mock upstream
(``python -u scripts/mock_upstream.py``) is forked the same way (0.22 -> 0.02 s a start).

``popen(cmd, **popen_kwargs)`` is what ``turnguard_procs.Process`` calls. It forks only what
exec and a fork run alike: the venv's ``mitmdump`` itself (no prefix such as ``unshare``) or
the mock upstream run by this interpreter,
with an environment that differs from the server's only in ``TURNGUARD_*`` and ``PYTEST_*``
variables (mitmproxy reads some variables when imported, e.g. ``SSLKEYLOGFILE``, and Python
reads ``PYTHON*`` ones when it starts), and while the test process's resource limits, ignored
signals and the calling thread's blocked ones (which an exec'd process inherits as they are when
it starts, a fork as they were when the server started) are the server's; the umask goes with
the request. Anything else, ``TURNGUARD_TEST_EXEC_MITMDUMP=1``, or a server that cannot start, gets
``subprocess.Popen``.

Two differences stay. The forks of one server share its string hash seed (an exec'd mitmdump
draws its own), so two mitmdumps of one test hash and order sets of strings alike; a test of
something that must not depend on that order runs its mitmdumps with
``TURNGUARD_TEST_EXEC_MITMDUMP=1``. And the libraries turnguard's modules import
(``multiprocessing``, ``sqlite3``, ``psycopg``) stay imported in every child, which nothing but
``sys.modules`` tells (``multiprocessing``'s alias of the server's ``__main__``,
``__mp_main__``, is dropped: what it names in an exec'd mitmdump is made only as it runs).

Run as a script, this module is the server: ``python -u mitmdump_forks.py SOCKET``.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MITMDUMP = Path(sys.executable).with_name("mitmdump")
_ADDON = Path(__file__).resolve().parents[1] / "addon" / "turnguard.py"
_PACKAGES = ("turnguard_core", "turnguard_shell")
# The mock upstream (``python -u scripts/mock_upstream.py ...``) is forked too: its start costs
# about 0.2 s of CPU exec'd, and the suite starts hundreds.
_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
MOCK_UPSTREAM = _SCRIPTS / "mock_upstream.py"
START_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 30.0
# The server's environment: this test process's as it was before any test changed it (a server
# started by a test that had set, say, PYTHONPATH would exec every later mitmdump of the process)
_ENVIRONMENT = dict(os.environ)
_PASSED_THROUGH = ("TURNGUARD_", "PYTEST_")  # read by turnguard as it loads, or by nothing
_IGNORED = {"PYTHONUNBUFFERED"}  # the server runs with -u


# ---- the server -------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1

def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
    if len(head) != 4 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request is a 4-byte length with three descriptors")
    size = int.from_bytes(head, "big")
    data = b""
    while len(data) < size:  # bounded by size and the socket's timeout
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("the request ended early")
        data += chunk
    return json.loads(data), fds


def _become_mitmdump(request: dict, fds: list[int], owned: list, mask: set, server: int) -> None:
    """In the forked child: be killed with the server (killed itself, it could not kill its
    children, and the tests would take them for ended), take back SIGTERM (blocked across the
    fork, so that a SIGTERM sent at once ends the child as it would an exec'd one), drop the
    server's descriptors, take the request's streams, directory, environment and arguments, and
    run the mitmdump script as ``__main__``. Its ``SystemExit`` (or exception) ends this process
    as it would end an exec'd mitmdump."""
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0 or os.getppid() != server:
        os._exit(1)  # the server is already gone
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for thing in owned:
        thing.close()
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(request["argv"][0])
    if not _loads_turnguard(sys.argv):
        for name in [n for n in sys.modules if n.partition(".")[0] in _PACKAGES]:
            del sys.modules[name]
    _run_as_main(request["argv"][0])


def _preload_turnguard() -> None:
    """Import the modules of turnguard's packages that ``addon/turnguard.py`` imports (read
    from its ``from ... import`` statements, so that the list follows the script), and the
    PostgreSQL ledger's, which the addon imports only for a ``postgresql://`` ledger."""
    import ast
    import importlib
    import importlib.util

    names = {"turnguard_core.pg_ledger"}
    for node in ast.walk(ast.parse(_ADDON.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        if node.module in _PACKAGES:  # from turnguard_core import circuit, ...
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif node.module.partition(".")[0] in _PACKAGES:  # from turnguard_core.ledger import ...
            names.add(node.module)
    sys.path.insert(0, str(_ADDON.parent))
    try:
        for name in sorted(names):
            if importlib.util.find_spec(name) is not None:  # (not a package's attribute)
                importlib.import_module(name)
    finally:
        del sys.path[0]
    sys.modules.pop("__mp_main__", None)  # multiprocessing's alias of this server's __main__


def _loads_turnguard(argv: list[str]) -> bool:
    """Whether the mitmdump ``argv`` loads ``addon/turnguard.py`` itself (``-s``)."""
    return any(flag in ("-s", "--scripts") and Path(script).resolve() == _ADDON
               for flag, script in zip(argv, argv[1:]))


def _run_as_main(path: str) -> None:
    """Run the script ``path`` as ``__main__`` and end this process as the interpreter would
    end it, but without tearing its heap down: non-daemon threads are waited for, exit
    handlers run (``logging`` flushes its handlers there), the standard streams are flushed,
    and the status is the one an exec'd process would have (an uncaught exception printed, 1;
    an uncaught ``KeyboardInterrupt``, killed by SIGINT). Only the objects' destruction is
    skipped: in a fork, dropping the references to every object the server had imported
    (mitmproxy's modules) writes to each of their pages, which copies them: it took about
    0.5 s of CPU per mitmdump, more than the mock upstream's whole start exec'd."""
    import atexit
    import runpy
    import threading
    import traceback

    code: int | None = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = None
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  (what finalization does first)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    os._exit(code & 0xFF)


def serve(path: str) -> None:
    """Listen on the Unix socket ``path``; fork a mitmdump per request; report each exit."""
    import selectors

    sys.path[0] = str(MITMDUMP.parent)  # as for the mitmdump script, not this file's folder
    import mitmproxy.tools.dump  # noqa: F401  (the import every child saves)
    import mitmproxy.tools.main  # noqa: F401

    sys.path.insert(0, str(_SCRIPTS))  # (as the mock's entry point does, for its own imports)
    import turnguard_mock.__main__  # noqa: F401
    del sys.path[0]
    _preload_turnguard()

    parent, server = os.getppid(), os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, its requester)

    def stop(_sig: int, _frame: object) -> None:
        for pid, _conn in children.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while True:  # until SIGTERM or the end of the test process that started us
        if os.getppid() != parent:  # killed (its atexit never ran): what it would have removed
            for name in ("socket", "server.out"):
                try:
                    os.unlink(os.path.join(os.path.dirname(path), name))
                except FileNotFoundError:
                    pass
            try:
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass
            stop(signal.SIGTERM, None)
        for key, _events in sel.select(1.0):
            if key.data is not None:  # a child exited
                pid, conn = children.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _tell(conn, returncode=os.waitstatus_to_exitcode(status))
                conn.close()
                continue
            conn, _ = listener.accept()
            conn.settimeout(REPLY_TIMEOUT_S)
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError) as e:
                print(f"bad request: {e!r}", flush=True)
                conn.close()
                continue
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            pid = os.fork()
            if pid == 0:
                owned = [sel, listener, conn, *(c for _, c in children.values())]
                for pidfd in children:
                    os.close(pidfd)
                _become_mitmdump(request, fds, owned, mask, server)
                os._exit(1)  # not reached: _run_as_main ends the process
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for fd in set(fds):
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = (pid, conn)
            sel.register(pidfd, selectors.EVENT_READ, pid)
            _tell(conn, pid=pid)


def _tell(conn: socket.socket, **message: int) -> None:
    """One JSON line to a requester, which may have gone (its test ended)."""
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


# ---- the client -------------------------------------------------------------------------------

def _status(field: str) -> str:
    with open("/proc/self/status") as f:
        return next(line.split()[1] for line in f if line.startswith(field + ":"))


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, for a moment, for
    every thread)."""
    return int(_status("Umask"), 8)


def _inherited() -> tuple:
    """What a process started now from this thread inherits, besides its umask, environment and
    directory: resource limits, ignored signals, blocked signals."""
    import resource

    limits = tuple(resource.getrlimit(getattr(resource, name))
                   for name in sorted(dir(resource)) if name.startswith("RLIMIT_"))
    return (limits, _status("SigIgn"), frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, ())))


class ForkedPopen:
    """The ``subprocess.Popen`` calls ``turnguard_procs.Process`` and the tests make, for a
    mitmdump forked by the server."""

    def __init__(self, server: _Server, args: list[str], fds: list[int], cwd: str,
                 env: dict[str, str], new_session: bool):
        self.args = args
        self.returncode: int | None = None
        self._buffer = b""
        self._lock = threading.Lock()  # one reader of the server's answers at a time
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.settimeout(REPLY_TIMEOUT_S)
        try:
            self._conn.connect(server.path)
            request = {"argv": args, "env": env, "cwd": cwd, "umask": _umask(),
                       "new_session": new_session}
            payload = json.dumps(request).encode()
            socket.send_fds(self._conn, [len(payload).to_bytes(4, "big")], fds)
            self._conn.sendall(payload)
            self.pid: int = self._read_message(REPLY_TIMEOUT_S)["pid"]
        except BaseException:
            self._conn.close()
            raise

    def _read_message(self, timeout: float | None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:  # bounded by the deadline
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], remaining)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            chunk = self._conn.recv(4096)
            if not chunk:  # the server is gone, and it kills its children when it goes
                return {"returncode": -signal.SIGKILL}
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            try:
                self._take_returncode(timeout)
            finally:
                self._lock.release()
        return self.returncode  # type: ignore[return-value]

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                self._take_returncode(0)
            except subprocess.TimeoutExpired:
                pass
            finally:
                self._lock.release()
        return self.returncode

    def _take_returncode(self, timeout: float | None) -> None:  # with self._lock
        if self.returncode is None:
            self.returncode = self._read_message(timeout)["returncode"]
            self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # as Popen: it ended and was reaped, not yet told
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """This test process's server, started on first use and stopped at exit."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="tg-forks-")
        self.path = os.path.join(self.dir, "socket")
        self.env = dict(_ENVIRONMENT)
        self.inherited = _inherited()
        self.log = open(os.path.join(self.dir, "server.out"), "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-u", __file__, self.path], stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.dir, env=self.env)
        atexit.register(self.close)
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"ready" not in Path(self.dir, "server.out").read_bytes():  # bounded by the deadline
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the mitmdump fork server did not start: "
                                   + Path(self.dir, "server.out").read_text(errors="replace"))
            time.sleep(0.02)

    def forks_alike(self, env: dict[str, str]) -> bool:
        """True if an exec'd mitmdump would see what a fork of the server sees."""
        if _inherited() != self.inherited:
            return False
        keys = (set(env) | set(self.env)) - _IGNORED
        return all(env.get(k) == self.env.get(k) for k in keys if not k.startswith(_PASSED_THROUGH))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
        for name in ("socket", "server.out"):
            try:
                os.unlink(os.path.join(self.dir, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


_server: _Server | None = None
_server_failed = False
_lock = threading.Lock()


def _the_server() -> _Server | None:
    global _server, _server_failed
    with _lock:
        if _server is None and not _server_failed:
            try:
                _server = _Server()
            except (OSError, RuntimeError) as e:
                _server_failed = True
                print(f"mitmdump_forks: every mitmdump is exec'd: {e}", file=sys.stderr)
        return _server


def popen(cmd: list[str], *, stdin=None, stdout=None, stderr=None, cwd=None, env=None,
          start_new_session: bool = False):
    """``subprocess.Popen(cmd, ...)``, or the same mitmdump forked (see the module's doc). Forks
    only for the streams ``turnguard_procs.Process`` gives: stdin from /dev/null, stdout to a
    file, stderr to stdout."""
    kwargs = dict(stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env,
                  start_new_session=start_new_session)
    full_env = dict(os.environ if env is None else env)
    argv = _script_argv(list(cmd))
    if (os.environ.get("TURNGUARD_TEST_EXEC_MITMDUMP") == "1" or argv is None
            or not hasattr(os, "pidfd_open") or stdin != subprocess.DEVNULL
            or not hasattr(stdout, "fileno") or stderr != subprocess.STDOUT):
        return subprocess.Popen(cmd, **kwargs)
    server = _the_server()
    if server is None or not server.forks_alike(full_env):
        return subprocess.Popen(cmd, **kwargs)
    with open(os.devnull, "rb") as devnull:
        fds = [devnull.fileno(), stdout.fileno(), stdout.fileno()]
        forked = ForkedPopen(server, argv, fds, str(cwd or os.getcwd()), full_env,
                             start_new_session)
    forked.args = list(cmd)  # as Popen's
    return forked


def _script_argv(cmd: list[str]) -> list[str] | None:
    """The ``sys.argv`` a forked child takes for ``cmd``: the venv's mitmdump, or the mock
    upstream run by this interpreter unbuffered (the server runs with ``-u``); None for
    anything else (exec'd)."""
    if cmd[:1] == [str(MITMDUMP)]:
        return cmd
    if cmd[:3] == [sys.executable, "-u", str(MOCK_UPSTREAM)]:
        return cmd[2:]
    return None


if __name__ == "__main__":
    serve(sys.argv[1])
