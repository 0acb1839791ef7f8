"""Ledger faults made for real, shared by the tests and ``scripts/chaos``: a file system of its
own for a ledger (a tmpfs: root only) and that file system full; a file that is no database
moved over a ledger; a ledger deleted.

    mount_tmpfs(folder, "64m")        # OSError when it cannot be mounted (not root, say)
    with disk_full(ledger):           # until the block ends, every ledger write fails: full
        ...
    unmount(folder)

Every wait is bounded; every fault is undone when its block ends."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import time
from pathlib import Path

FILL_PAGES_MAX = 100_000  # bounds a fill: 400 MiB, more than any tmpfs made here
UNMOUNT_TRIES = 20


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


def mount_tmpfs(path: Path, size: str) -> None:
    """Make ``path`` (a new folder, 0700) a tmpfs of ``size`` (mount's ``size=``: "2m").
    Raises OSError, with mount's message, when it cannot be mounted."""
    path.mkdir(mode=0o700)
    r = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    if r.returncode != 0:
        raise OSError(f"cannot mount a tmpfs at {path}: {r.stderr.strip() or r.returncode}")


def unmount(path: Path) -> None:
    """Unmount ``path``, lazily if a process still holds a file of it after a few tries."""
    for _ in range(UNMOUNT_TRIES):  # bounded: a process may hold a file open for a moment
        if _run("umount", str(path)).returncode == 0:
            return
        time.sleep(0.25)
    _run("umount", "-l", str(path))


def _write_until_full(path: Path, chunk: bytes, times: int) -> None:
    """Write ``chunk`` to a new file at ``path`` up to ``times`` times, unbuffered, until the
    file system refuses. (A buffered file would raise on its close the bytes it kept when
    its last flush met the full disk: on Python 3.11 and 3.12, not 3.13.)"""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(times):
            try:
                if os.write(fd, chunk) < len(chunk):
                    return
            except OSError:
                return
    finally:
        os.close(fd)


def fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` up to the last byte."""
    filler = folder / "filler"
    _write_until_full(filler, b"\0" * 4096, FILL_PAGES_MAX)
    _write_until_full(folder / "filler-tail", b"\0", 4096)  # the tail of a page, if any
    return filler


def unfill(folder: Path) -> None:
    for name in ("filler", "filler-tail"):
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()


@contextlib.contextmanager
def wal_at_its_end(ledger: Path):
    """Until the block ends, every write to the ledger must grow its WAL file, so that a full
    disk fails it. (The processes checkpoint the WAL often, and SQLite then writes it again
    from its start, into space the file already has: a full disk would not be noticed.) A
    scratch write larger than the WAL file takes it past the space it had (a reader holding a
    snapshot first keeps it from starting again under that write), and a second reader, whose
    snapshot holds the scratch write, keeps the WAL from starting again before its end. The
    block may be entered and left on different threads."""
    wal = Path(f"{ledger}-wal")
    readers = []
    try:
        for scratch in (True, False):
            reader = sqlite3.connect(ledger, timeout=10, isolation_level=None,
                                     check_same_thread=False)
            readers.append(reader)
            reader.execute("BEGIN")
            reader.execute("SELECT COUNT(*) FROM operations").fetchone()
            if scratch:
                size = max(512 * 1024, wal.stat().st_size + 64 * 1024)
                with contextlib.closing(sqlite3.connect(ledger, timeout=10,
                                                        isolation_level=None)) as w:
                    w.execute("CREATE TABLE IF NOT EXISTS test_scratch (b BLOB)")
                    w.execute("DELETE FROM test_scratch")
                    w.execute("INSERT INTO test_scratch VALUES (zeroblob(?))", (size,))
        yield
    finally:
        for reader in readers:
            reader.execute("ROLLBACK")
            reader.close()


@contextlib.contextmanager
def disk_full(ledger: Path):
    """The ledger's file system full until the block ends, and every write to the ledger
    meeting it (``wal_at_its_end``)."""
    with wal_at_its_end(ledger):
        try:
            fill(ledger.parent)
            yield
        finally:
            unfill(ledger.parent)


def replace_with_junk(ledger: Path) -> None:
    """Move a file that is no database over a SQLite ledger under running processes (its
    ``-wal`` and ``-shm`` left beside it), as one atomic rename: an operator's mistake, a
    restore gone wrong."""
    junk = ledger.with_name(ledger.name + ".junk")
    junk.write_bytes(b"no database here\n" * 256)
    junk.chmod(0o600)
    os.replace(junk, ledger)


def delete_ledger(ledger: Path) -> None:
    """Delete a SQLite ledger file and its ``-wal`` and ``-shm`` under running processes (as
    an operator's ``rm`` would): whichever of them exist."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)
