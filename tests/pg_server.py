"""A throwaway PostgreSQL server for the tests (and ``scripts/bench``): standard library only.

``PgServer`` runs the machine's own PostgreSQL binaries (``initdb``, ``pg_ctl``, ``postgres``:
Debian's ``postgresql`` package, found on ``PATH`` or under ``/usr/lib/postgresql/N/bin``) on a
data folder in a temporary folder, listening on 127.0.0.1 (a port the OS picked) and on a Unix
socket in that folder, with ``trust`` authentication for loopback only. Being a test server, it
runs with ``fsync=off`` (never ``synchronous_commit=off``: a crashed server must keep every
commit it acknowledged) and loads ``pg_stat_statements`` (when installed) so that tests can count
the queries a process sent. PostgreSQL refuses to run as root: as root, it runs as the
``postgres`` user (or a system user ``turnguard-pg`` made for it) through ``runuser``.

    python tests/pg_server.py start [--install]   # prints "URL<TAB>FOLDER"; --install: apt-get
                                                  # the postgresql package when it is missing
    python tests/pg_server.py stop FOLDER

``scripts/test`` starts one for the whole run and exports its URL as ``TURNGUARD_TEST_PG``;
``tests/conftest.py`` gives each test a database of its own on it (``pg_url``), and a server of
its own to a test that restarts it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time

START_TIMEOUT_S = 60
DB_USER = "turnguard"  # the server's superuser (trust auth on loopback only)
RUN_AS_CANDIDATES = ("postgres", "turnguard-pg")


class PgUnavailable(RuntimeError):
    """No PostgreSQL server can be started here (the message says why)."""


def find_bin_dir() -> str | None:
    """The folder of ``initdb``/``pg_ctl``/``postgres``: on PATH, else the newest Debian one."""
    for name in ("initdb",):
        found = shutil.which(name)
        if found:
            real = os.path.dirname(os.path.realpath(found))
            if os.path.exists(os.path.join(real, "pg_ctl")) and os.path.exists(os.path.join(real, "postgres")):
                return real
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return os.path.dirname(candidates[-1]) if candidates else None


def install_server() -> None:
    """Install Debian's ``postgresql`` package (root with apt-get only); raises ``PgUnavailable``."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise PgUnavailable("no PostgreSQL server binaries (initdb) and no way to install them: "
                            "install the postgresql package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print("turnguard: installing PostgreSQL (apt-get install postgresql) for the tests", file=sys.stderr)
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "postgresql"]):
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=900)
        if done.returncode != 0:
            raise PgUnavailable(f"{' '.join(cmd)} failed: {done.stderr.decode(errors='replace')[-500:]}")


def _run_as_user() -> str | None:
    """The user to run the server as (None: this one). PostgreSQL refuses root."""
    if os.geteuid() != 0:
        return None
    for name in RUN_AS_CANDIDATES:
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    RUN_AS_CANDIDATES[-1]], check=True, timeout=30, capture_output=True)
    return RUN_AS_CANDIDATES[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """One throwaway server (see the module docstring). ``url`` connects as its superuser to the
    ``postgres`` database; ``url_for(db)`` to another."""

    def __init__(self, folder: str | None = None, *, bin_dir: str | None = None):
        self.bin_dir = bin_dir or find_bin_dir()
        if self.bin_dir is None:
            raise PgUnavailable("no PostgreSQL server binaries (initdb, pg_ctl) found")
        self.user = _run_as_user()
        # as another user, in a folder it can reach (TMPDIR may be under root's home)
        shared = "/tmp" if self.user is not None and os.path.isdir("/tmp") else None
        self.folder = folder or tempfile.mkdtemp(prefix="turnguard-pg-", dir=shared)
        self.data = os.path.join(self.folder, "data")
        self.log = os.path.join(self.folder, "server.log")
        self.port = 0

    # -- commands -------------------------------------------------------------------------------
    def _cmd(self, *args: str, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
        cmd = [os.path.join(self.bin_dir, args[0]), *args[1:]]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              cwd=self.folder)

    def _check(self, done: subprocess.CompletedProcess, what: str) -> None:
        if done.returncode != 0:
            tail = ""
            if os.path.exists(self.log):
                with open(self.log, encoding="utf-8", errors="replace") as f:
                    tail = f.read()[-1500:]
            raise PgUnavailable(f"{what} failed ({done.returncode}): "
                                f"{(done.stderr or done.stdout).decode(errors='replace')[-1500:]}{tail}")

    def start(self) -> "PgServer":
        """Make the cluster (first time) and start the server; raises ``PgUnavailable``."""
        if self.user is not None:
            uid = pwd.getpwnam(self.user).pw_uid
            os.chown(self.folder, uid, -1)
            os.chmod(self.folder, 0o700)
        if not os.path.exists(self.data):
            self._check(self._cmd("initdb", "-D", self.data, "-U", DB_USER, "--auth=trust",
                                  "-E", "UTF8", "--no-sync", "--locale=C"), "initdb")
        for attempt in range(3):  # the port picked may be taken by the time the server binds it
            self.port = self.port if attempt == 0 and self.port else _free_port()
            self._write_conf()
            done = self._cmd("pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t",
                             str(START_TIMEOUT_S), "start", timeout=START_TIMEOUT_S + 10)
            if done.returncode == 0:
                return self
            self.port = 0
        self._check(done, "pg_ctl start")
        return self

    def _write_conf(self) -> None:
        lines = [
            "listen_addresses = '127.0.0.1'",
            f"port = {self.port}",
            f"unix_socket_directories = '{self.folder}'",
            "max_connections = 300",
            # fsync off: only an OS crash could lose data, and this server dies with the test.
            # synchronous_commit stays on: a server crash (a test's immediate stop) must not
            # lose a commit turnguard was told about, as it must not on a real ledger
            "fsync = off", "full_page_writes = off",
            "shared_buffers = 64MB",
        ]
        lib = os.path.join(os.path.dirname(self.bin_dir), "lib", "pg_stat_statements.so")
        if os.path.exists(lib):
            lines += ["shared_preload_libraries = 'pg_stat_statements'",
                      "pg_stat_statements.track = all"]
        with open(os.path.join(self.data, "postgresql.auto.conf"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    def stop(self, *, mode: str = "fast") -> None:
        """Stop the server (``mode``: fast, immediate), keeping the cluster."""
        self._cmd("pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "30", "stop", timeout=60)

    def restart(self, *, down_s: float = 0.0) -> None:
        """Stop the server (``immediate``: as a crash would) and start it again after ``down_s``
        on the same port."""
        self.stop(mode="immediate")
        time.sleep(down_s)
        done = self._cmd("pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t",
                         str(START_TIMEOUT_S), "start", timeout=START_TIMEOUT_S + 10)
        self._check(done, "pg_ctl start (restart)")

    def destroy(self) -> None:
        """Stop the server and delete its folder."""
        try:
            self.stop(mode="immediate")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    # -- addresses ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql://{DB_USER}@127.0.0.1:{self.port}/{database}"

    def __enter__(self) -> "PgServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _main(argv: list[str]) -> int:
    if argv[:1] == ["start"]:
        try:
            if find_bin_dir() is None and "--install" in argv:
                install_server()
            server = PgServer().start()
        except (PgUnavailable, OSError, subprocess.SubprocessError) as e:
            print(f"turnguard: cannot start a PostgreSQL server for the tests: {e}", file=sys.stderr)
            return 1
        print(f"{server.url}\t{server.folder}")
        return 0
    if argv[:1] == ["stop"] and len(argv) == 2:
        folder = argv[1]
        if not os.path.isdir(os.path.join(folder, "data")):
            return 0
        PgServer(folder).destroy()
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
