"""What is at the ledger's path: the SQLite file and the -wal and -shm beside it.

SQLite pairs a database file with whatever -wal and -shm it finds beside it, and a connection
goes on with the ones it opened once they are unlinked. So a file, a -wal or a -shm deleted
or moved under running processes (``rm`` of one of them, a copy moved in with the old ones
left) gives a connection opened then the rows of another file, or another index of the WAL
others write: a corrupted ledger. This module tells, for the ledger module's opens and its
copies made anew, which of the files there are the file's own (``stale_sidecars``,
``sidecars_deleted_under_a_connection``), which connections have a file open
(``open_anywhere``: this process's, noted as they open and close, and other processes', by
their locks), and makes a missing file alone (``make_file_alone``), all under one lock on the
folder (``FolderLock``) that every process of ours takes. File-system calls only; no SQL.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Iterable

from .private_files import check_private_file, open_private, shown



class FolderBusy(OSError):
    """Another program holds the folder's lock past the wait given."""


def make_file_alone(real: str) -> None:
    """Make the ledger file at ``real``, where there is none, with no -wal or -shm beside it.
    Any found there are a deleted file's (``rm`` of the ledger alone, or of a file moved over
    it): SQLite would pair the new file with them. While a connection still has the deleted
    file open (a paused process, a backup, an operator's shell) every open of the new file
    then fails (a disk I/O error: its pages looked for in the old file's WAL), and each
    process decides in memory for as long as that connection stays; once none has, SQLite
    copies the old WAL's pages into the new file. Removing their names takes nothing from
    the connections that have them open. Under the folder's lock (``FolderLock``): two
    processes that find the file gone at once make one file, and neither removes the -wal
    or -shm of the file the other made."""
    for suffix in ("-wal", "-shm"):
        if check_private_file(real + suffix) is not None:
            os.unlink(real + suffix)
    os.close(open_private(real, os.O_RDWR))


def stale_sidecars(real: str) -> bool:
    """Whether the -wal and -shm beside the existing file at ``real`` are another file's: no
    connection has this file open (``open_anywhere``), and either another process has that
    -shm open (SQLite holds a lock on a file as long as it has it open, and takes it before
    its -shm's: so the -shm's connections are of another file; this process's own lock may
    be a connection of this very file it does not track, a test's), or this process left the
    file they were beside (``_SIDECARS_LEFT``). That is a file put in place by a move with
    the old one's -wal and -shm left (an older copy restored so): SQLite would read the old
    file's WAL as this one's and corrupt it. A -wal of no other file (a process killed)
    holds this one's rows."""
    sidecars = [found for found in (file_id(real + "-wal"), file_id(real + "-shm"))
                if found is not None]
    if not sidecars or open_anywhere(real):
        return False  # (this file open: what is beside it is its own)
    with _SIDECARS_LEFT_LOCK:
        left = any(found in _SIDECARS_LEFT for found in sidecars)
    return left or bool(_locked(*sidecars, by_another_process=True))


def remove_stale_sidecars(real: str) -> None:
    """Remove the -wal and -shm beside the file at ``real`` when they are another file's
    (``stale_sidecars``). Under the folder's lock (``FolderLock``), so that no process of
    ours opens the file between the look and the removal."""
    if stale_sidecars(real):
        for suffix in ("-wal", "-shm"):
            if check_private_file(real + suffix) is not None:
                os.unlink(real + suffix)


# The -wal and -shm (device, inode) of the ledger files this process's connections found
# deleted or replaced (``Ledger.file_replaced``) since it last opened one: at most
# ``MAX_SIDECARS_LEFT``, the newest. Forgotten at the next open: once deleted, their inodes
# may be given to another file's.
_SIDECARS_LEFT: dict[tuple[int, int], None] = {}
_SIDECARS_LEFT_LOCK = threading.Lock()  # (the heartbeat's thread notes them too)
MAX_SIDECARS_LEFT = 64


def note_sidecars_left(ids: Iterable[tuple[int, int] | None]) -> None:
    with _SIDECARS_LEFT_LOCK:
        for found in ids:
            if found is not None:
                _SIDECARS_LEFT.pop(found, None)
                _SIDECARS_LEFT[found] = None
        while len(_SIDECARS_LEFT) > MAX_SIDECARS_LEFT:
            del _SIDECARS_LEFT[next(iter(_SIDECARS_LEFT))]


def forget_sidecars_left() -> None:
    with _SIDECARS_LEFT_LOCK:
        _SIDECARS_LEFT.clear()


def file_id(path: str) -> tuple[int, int] | None:
    """The (device, inode) of the file at ``path``, None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def sidecars_deleted_under_a_connection(real: str) -> str | None:
    """Which of the -wal and -shm of the existing file at ``real`` is missing while a
    connection (of any process) has the file open, or None. Every connection in WAL mode
    holds a lock on the file as long as it is open, and SQLite keeps both beside the file
    meanwhile; so one missing then was deleted under that connection, which goes on with it
    unlinked."""
    missing = [suffix for suffix in ("-wal", "-shm") if not os.path.lexists(real + suffix)]
    if not missing or not os.path.lexists(real):
        return None
    return " and ".join(missing) if open_anywhere(real) else None


def open_anywhere(real: str) -> bool:
    """Whether a connection of this process (``_OPEN_HERE``) or of another one has the
    existing file at ``real`` open: every connection in WAL mode holds a lock on it as long
    as it is open. A lock ``/proc/locks`` lists was held; one it leaves out (it is read in
    parts while others change) is asked of the kernel (``F_GETLK``: another process's, at
    once and whole) through a descriptor of the file, opened only when no connection of this
    process is known to have the file open: closing it drops every lock this process holds
    on the file."""
    found = file_id(real)
    if found is None:
        return False
    with _OPEN_HERE_LOCK:
        if found in _OPEN_HERE.values():
            return True
    if _locked(found):
        return True
    try:
        fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        asked = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        return struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, asked))[0] != fcntl.F_UNLCK
    except OSError:
        return False
    finally:
        os.close(fd)


_FLOCK = "hhxxxxqqixxxx"  # struct flock (Linux): l_type, l_whence, l_start, l_len, l_pid

# The file (device, inode) each connection of this process has open, by its ledger object:
# held weakly, so that a ledger dropped without its ``close`` (its connection closed as it is
# collected) leaves no entry behind, which a new file given that inode would take for open.
_OPEN_HERE: weakref.WeakKeyDictionary[object, tuple[int, int]] = weakref.WeakKeyDictionary()
_OPEN_HERE_LOCK = threading.Lock()


def note_open_here(ledger: object, found: tuple[int, int] | None) -> None:
    """``ledger``'s connection has the file ``found`` open (None: no file, ``:memory:``)."""
    if found is not None:
        with _OPEN_HERE_LOCK:
            _OPEN_HERE[ledger] = found


def close_here(ledger: object, close: Callable[[], None]) -> None:
    """Run ``close`` (which closes ``ledger``'s connection) and forget the file it had open,
    as one step for ``open_anywhere``: once closed, a file deleted meanwhile is gone, and its
    inode may be a new file's at once (ext4 gives the next file made the inode just freed); a
    note kept a moment longer took that new file for open here, and refused it as one whose
    -wal and -shm were deleted under a connection (a script reload that reopens the path as
    the old connection closes on its thread)."""
    with _OPEN_HERE_LOCK:
        try:
            close()
        finally:
            _OPEN_HERE.pop(ledger, None)


def _locked(*files: tuple[int, int] | None,
            by_another_process: bool = False) -> set[tuple[int, int]]:
    """Which of ``files`` (device, inode) a process (``by_another_process``: not this one)
    holds a lock on, as Linux's ``/proc/locks`` lists them (none where it cannot be read). A
    lock listed is one that was held; one left out may be held still (the list is read in
    parts while others change)."""
    wanted = {f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}": (dev, ino)
              for dev, ino in filter(None, files)}
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            held = locks.read()
    except OSError:
        return set()
    found = set()
    for line in held.splitlines():  # "1: POSIX  ADVISORY  READ 14759 fe:00:2146459 128 128"
        fields = line.split()  # (a lock waited for: "1: -> POSIX ...", one field more)
        at = 6 if len(fields) > 1 and fields[1] == "->" else 5
        if len(fields) > at and fields[at] in wanted and not (
                by_another_process and fields[at - 1] == str(os.getpid())):
            found.add(wanted[fields[at]])
    return found


class FolderLock:
    """The lock of ``Ledger._connect`` and ``Ledger.make_anew`` on the folder of the file at
    ``real`` (none for ``:memory:``): held while a process of ours looks at, makes or
    removes the files there, up to SQLite's first locks on them."""

    def __init__(self, real: str, wait_s: float):
        self.real, self.wait_s, self._folder = real, wait_s, None

    def __enter__(self) -> None:
        if self.real == ":memory:":
            return
        self._folder = os.open(os.path.dirname(self.real),
                               os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _lock_folder(self._folder, self.real, self.wait_s)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        if self._folder is not None:
            os.close(self._folder)  # (drops the lock)
            self._folder = None


def _lock_folder(folder: int, real: str, wait_s: float) -> None:
    """Take the lock of ``make_file_alone`` and ``Ledger.make_anew`` on the open ``folder``,
    waiting for it at most ``wait_s`` (without a bound, a program holding it would hold up
    the event loop: the file is made there; a copy, on the heartbeat's thread). A file system
    that has no such lock (some network ones) goes without it, as turnguard did before it."""
    give_up = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= give_up:
                raise FolderBusy(f"the folder of {shown(real)} is locked by another program; "
                                 "the ledger file is opened at the next try") from None
            time.sleep(0.001)
        except OSError:  # (EBADF, ENOLCK, EOPNOTSUPP: no lock on a folder there)
            return
