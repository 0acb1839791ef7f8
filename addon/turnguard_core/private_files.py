"""Private files: where turnguard may keep its ledger and its events file, and how it opens them.

One set of rules for both (no clock or proxy here; only the file system):

- ``check_private_path``: the folder of the path as given *and* the folder of its real path
  (symlinks resolved) must exist and must not be world-writable unless sticky (like /tmp), and
  an existing file (the real one) must not be writable by group or others. Otherwise another
  user could swap the file, or read what turnguard writes next to it (SQLite's -wal and -shm
  are created next to the real file).
- ``open_private``: opens without following a symlink at the path (``O_NOFOLLOW``), creates
  the file 0600, and refuses anything but a regular file owned by this user, and (with
  ``starts_with``) a non-empty file that does not start as turnguard's files do: a wrong path
  (``/etc/passwd`` as root) is never written to nor made private. The file is then made 0600
  whatever the umask.

Refusals raise ``UnsafePath`` (an ``OSError``, so callers that handle a file they cannot open
handle it too), with a message that says why: one line, a path in it as ``shown`` makes it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

__all__ = ["UnsafePath", "check_private_file", "check_private_path", "create_private_file",
           "ensure_private_file", "open_private", "shown"]


class UnsafePath(OSError):
    """The path is one another user could write to or redirect."""


def shown(path: str) -> str:
    """``path`` as a message may show it: as it is when every character of it prints; else
    quoted with its control characters escaped, so that a newline or a terminal's escape
    sequence in a name neither splits the message's line nor reaches the terminal."""
    return path if path.isprintable() else repr(path)


def check_private_path(path: str) -> str:
    """Refuse ``path`` if another user could write to it or swap it (see the module
    docstring); return its real path (symlinks resolved)."""
    given = os.path.abspath(path)
    real = os.path.realpath(given)
    for folder in dict.fromkeys((os.path.dirname(given), os.path.dirname(real))):
        if not os.path.isdir(folder):
            raise UnsafePath(f"folder {shown(folder)} does not exist")
        mode = os.stat(folder).st_mode
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise UnsafePath(f"folder {shown(folder)} is world-writable (and not sticky)")
    if os.path.exists(real) and os.stat(real).st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        named = shown(real) if real == given else f"{shown(given)} (-> {shown(real)})"
        raise UnsafePath(f"file {named} is writable by others")
    return real


def open_private(path: str, flags: int, *, starts_with: bytes | None = None,
                 kind: str = "turnguard file") -> int:
    """Open (creating if needed) ``path`` as a file readable and writable by its owner only
    (0600); never through a symlink, never a FIFO, device or another user's file. With
    ``starts_with`` (``flags`` must allow reading), an existing non-empty file must start with
    those bytes: else it is refused, unchanged, as not a ``kind``."""
    try:
        fd = os.open(
            path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600
        )
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{shown(path)} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{shown(path)} is not a regular file")
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"{shown(path)} belongs to another user (uid {st.st_uid})")
        if starts_with is not None and st.st_size > 0 \
                and os.pread(fd, len(starts_with), 0) != starts_with:
            raise UnsafePath(f"{shown(path)} is not a {kind} (it does not start with "
                             f"{starts_with.decode(errors='replace')}); left untouched")
        os.fchmod(fd, 0o600)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_private_file(path: str, *, create: bool = True) -> None:
    """Make sure ``path`` is a private regular file (created 0600 if missing, unless not
    ``create``: then a missing file is left missing), without keeping a descriptor open. For a
    file that SQLite may already hold open in this process (a second connection, a script
    reload): closing any descriptor of a file drops every POSIX lock this process holds on it,
    including SQLite's, so an existing file is checked by its path, never opened."""
    st = check_private_file(path)
    if st is None:
        if create:
            os.close(open_private(path, os.O_RDWR))
        return
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.chmod(path, 0o600, follow_symlinks=False)


def check_private_file(path: str, *, owner: int | None = None) -> os.stat_result | None:
    """Refuse ``path`` unless it is missing (None) or a regular file (not a symbolic link)
    of ``owner`` (default: this user); return its ``lstat``. Looks by the path: opens
    nothing, changes nothing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{shown(path)} is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{shown(path)} is not a regular file")
    if st.st_uid != (os.geteuid() if owner is None else owner):
        raise UnsafePath(f"{shown(path)} belongs to another user (uid {st.st_uid})")
    return st


def create_private_file(path: str, *, owner: int | None = None) -> bool:
    """Make ``path`` a new empty file, 0600, unless it exists (then checked as
    ``check_private_file`` checks it); whether it made it. SQLite gives an empty file it
    opens beside a database the database's mode: make it 0600 again once SQLite opened it. ``O_EXCL|O_NOFOLLOW``: a file or a symbolic link
    another user puts there first is refused, never opened; one that exists is never opened
    either (closing a descriptor of a file SQLite holds in this process drops its locks).
    ``owner`` (running as root): the new file is given to that user, as SQLite does with the
    files it makes beside a database."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_NONBLOCK, 0o600)
    except FileExistsError:
        check_private_file(path, owner=owner)
        return False
    try:
        os.fchmod(fd, 0o600)
        if owner is not None and owner != os.geteuid() and os.geteuid() == 0:
            os.fchown(fd, owner, -1)
    finally:
        os.close(fd)
    return True
