"""Telemetry: one JSON line per decision, to an optional file (mode 0600) and to the log
(routine per-request events at DEBUG, the others at INFO), and each record to an optional
``sink`` (the Prometheus metrics, ``metrics.Metrics.observe``).

The file is opened by the rules of ``private_files`` (the ledger's): never through a symlink,
never in a folder others may write to without the sticky bit, never a file others may write
to; ``Telemetry(path)`` raises ``OSError`` (``UnsafePath`` for a refusal) otherwise.

Every line has ``ts`` (Unix seconds, float) and ``event``; callers add ``op``, ``flow``,
``session`` and the event's own fields. Values must be plain JSON data and never a secret.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from typing import Callable

from .private_files import check_private_path, open_private, shown

logger = logging.getLogger("turnguard")

# One of these per guarded request: logged at DEBUG (mitmdump --set termlog_verbosity=debug),
# so that a busy proxy's log shows the decisions that change a request's fate (mitmdump
# already prints a line per flow; two more per request would triple a busy log). The events
# file and the metrics get every event.
ROUTINE = frozenset({"dispatch", "outcome"})

# What json.dumps(record, separators=(",", ":"), default=str) uses, made once (json.dumps
# makes an encoder on every call given options).
_LINE_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


def handlers_take(log: logging.Logger, level: int, ignore: tuple[type, ...] = ()) -> bool:
    """Whether a record of ``level`` logged to ``log`` reaches a handler whose level lets it
    through (handlers of the ``ignore`` types do not count). When none does, the record
    need not be made at all: formatting it is most of its cost."""
    if not log.isEnabledFor(level):
        return False
    current: logging.Logger | None = log
    while current is not None:
        for handler in current.handlers:
            if level >= handler.level and not isinstance(handler, ignore):
                return True
        if not current.propagate:
            return False
        current = current.parent
    return False


class Telemetry:
    def __init__(self, path: str | None = None, clock: Callable[[], float] = time.time, *,
                 ignored_handlers: tuple[type, ...] = ()):
        """``ignored_handlers``: log handler types that do not make a record worth writing
        (the shell names mitmproxy's bridge to its deprecated ``add_log`` hook, which takes
        records of every level and turns each one into a hook call on every addon)."""
        self._clock = clock
        self._ignored_handlers = ignored_handlers
        self._file = None
        self._refused: str | None = None  # why the moved events file was not reopened
        self._write_failing = False  # a write failed (said once) and none succeeded since
        self._made = False  # the file did not exist: this opening made it (see ``discard``)
        self.path = path or None
        # records by event name; the owner may hand in another (the shell keeps one per
        # process, so that a new events file or a script reload does not count from 0)
        self.counts: Counter[str] = Counter()
        # called with (event, fields) for every record, before it is written; must not raise
        self.sink: Callable[[str, dict], None] | None = None
        if self.path:
            check_private_path(self.path)
            self._file, self._made = _open_events(self.path)

    def emit(self, event: str, **fields: object) -> None:
        self.counts[event] += 1
        if self.sink is not None:
            self.sink(event, fields)
        level = logging.DEBUG if event in ROUTINE else logging.INFO
        to_log = handlers_take(logger, level, self._ignored_handlers)
        if self._file is None and not to_log:
            return
        record = {"ts": round(self._clock(), 6), "event": event, **fields}
        line = _LINE_ENCODER.encode(record)
        if self._file is not None:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError) as e:  # a full disk must not break traffic
                if not self._write_failing:  # said once, not at every line while it lasts
                    self._write_failing = True
                    logger.warning("turnguard: cannot write telemetry to %s: %s; said once "
                                   "until a line is written again", shown(self.path), e)
            else:
                if self._write_failing:
                    self._write_failing = False
                    logger.warning("turnguard: telemetry written to %s again", shown(self.path))
        if to_log:
            # what logger.log(level, "turnguard %s", line) makes and handles, without its
            # walk of the stack for the caller (this method, always): a fifth of the line's cost
            logger.handle(logger.makeRecord(logger.name, level, __file__, _EMIT_LINE,
                                            "turnguard %s", (line,), None, "emit"))

    def reopen_if_moved(self) -> None:
        """The events file was deleted, renamed or replaced (log rotation, by hand): go on in
        a new private file at the path, so that no later record goes to a file nobody reads.
        An unsafe path now (a symlink, another owner's file) is refused: the old file is kept
        and a warning says why."""
        if self._file is None:
            return
        try:
            at_path = os.stat(self.path, follow_symlinks=False)
            mine = os.fstat(self._file.fileno())
            if (at_path.st_dev, at_path.st_ino) == (mine.st_dev, mine.st_ino):
                return
        except FileNotFoundError:
            pass
        try:
            check_private_path(self.path)
            file, _ = _open_events(self.path)
        except (OSError, ValueError) as e:
            if str(e) != self._refused:  # said once, not at every check while it lasts
                self._refused = str(e)
                logger.warning("turnguard: events file %s moved; not reopened (%s)",
                               shown(self.path), e)
            return
        self._refused = None
        self._close_file()
        self._file = file
        self._write_failing = False
        logger.info("turnguard: events file %s was moved or deleted; writing to a new one",
                    shown(self.path))

    def discard(self) -> None:
        """Close a file never put in use (the option update that named it was refused), and
        remove it if this opening made it and nothing was written to it since: a refused
        update leaves no file behind. A file that was there before is someone's data, never
        removed."""
        if self._file is None:
            return
        if self._made:
            try:
                mine = os.fstat(self._file.fileno())
                at_path = os.stat(self.path, follow_symlinks=False)
                if (at_path.st_dev, at_path.st_ino) == (mine.st_dev, mine.st_ino) \
                        and mine.st_size == 0:
                    os.unlink(self.path)
            except OSError:  # (gone or replaced meanwhile: not the file made here)
                pass
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._close_file()
            self._file = None

    def _close_file(self) -> None:
        """Close the file in use; lines it could not take (a full disk) are lost, said in the
        log, never raised: a rotation or a shutdown must not fail for them."""
        try:
            self._file.close()
        except (OSError, ValueError) as e:
            logger.warning("turnguard: events file %s closed with lines it could not take "
                           "lost: %s", shown(self.path), e)


_EMIT_LINE = Telemetry.emit.__code__.co_firstlineno

# How every line of an events file starts: an existing file that does not is someone
# else's, never appended to (nor made private).
EVENTS_FILE_START = b'{"ts":'


def _open_events(path: str):
    """The events file at ``path``, opened to append, and whether this opening made it. One
    whose last line was cut (a full disk, a process killed mid-write) gets a line end first:
    the next record starts a line of its own, never glued to the cut one, where no reader
    could parse it."""
    flags = os.O_RDWR | os.O_APPEND
    try:  # (O_EXCL: made here, not by another process between a look and the opening)
        fd, made = open_private(path, flags | os.O_EXCL), True
    except FileExistsError:  # (a symbolic link too: refused as one below)
        fd, made = open_private(path, flags, starts_with=EVENTS_FILE_START,
                                kind="turnguard events file"), False
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")
    except OSError:  # (a full disk: the first record says so when it cannot be written)
        pass
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8"), made
