"""Where the ledger and the events file may live, and how they are opened (real files)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from turnguard_core.ledger import Ledger, LedgerError
from turnguard_core.private_files import (
    UnsafePath,
    check_private_path,
    ensure_private_file,
    open_private,
)
from turnguard_core.telemetry import Telemetry


@pytest.fixture
def shared(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)  # world-writable, not sticky
    return folder


def test_a_plain_private_path_is_accepted_and_is_its_own_real_path(tmp_path):
    assert check_private_path(str(tmp_path / "x")) == str(tmp_path / "x")


def test_a_symlink_is_judged_by_the_folder_it_points_into(tmp_path, shared):
    link = tmp_path / "ledger.sqlite3"
    link.symlink_to(shared / "ledger.sqlite3")
    with pytest.raises(UnsafePath, match="world-writable"):
        check_private_path(str(link))
    with pytest.raises(LedgerError, match="world-writable"):
        Ledger(str(link), "x").open(time.time())
    assert os.listdir(shared) == []


def test_a_symlink_to_a_safe_place_is_followed_for_the_ledger(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "ledger.sqlite3"
    link.symlink_to(real / "ledger.sqlite3")
    assert check_private_path(str(link)) == str(real / "ledger.sqlite3")
    led = Ledger(str(link), "x")
    led.open(time.time())
    led.close()
    assert (real / "ledger.sqlite3").is_file() and link.is_symlink()
    assert stat.S_IMODE((real / "ledger.sqlite3").stat().st_mode) == 0o600


def test_a_symlink_placed_in_a_world_writable_folder_is_refused(tmp_path, shared):
    safe = tmp_path / "safe"
    safe.mkdir()
    link = shared / "ledger.sqlite3"  # anyone could replace this link
    link.symlink_to(safe / "ledger.sqlite3")
    with pytest.raises(UnsafePath, match=f"folder {shared} is world-writable"):
        check_private_path(str(link))


def test_a_sticky_world_writable_folder_is_accepted(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    check_private_path(str(sticky / "events.jsonl"))


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_a_file_writable_by_others_is_refused_through_a_link_too(tmp_path, mode):
    real = tmp_path / "real.jsonl"
    real.write_text("")
    os.chmod(real, mode)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    for path in (real, link):
        with pytest.raises(UnsafePath, match="writable by others"):
            check_private_path(str(path))


def test_open_private_never_follows_a_symlink_and_leaves_its_target_alone(tmp_path):
    target = tmp_path / "victim"
    target.write_text("precious")
    os.chmod(target, 0o644)
    link = tmp_path / "events.jsonl"
    link.symlink_to(target)
    with pytest.raises(UnsafePath, match="symbolic link"):
        open_private(str(link), os.O_WRONLY | os.O_APPEND)
    with pytest.raises(UnsafePath, match="symbolic link"):
        Telemetry(str(link))
    assert target.read_text() == "precious" and stat.S_IMODE(target.stat().st_mode) == 0o644


def test_open_private_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "events.jsonl"
    os.mkfifo(fifo, 0o600)
    started = time.monotonic()
    with pytest.raises(OSError):  # ENXIO (no reader) or "not a regular file"
        Telemetry(str(fifo))
    assert time.monotonic() - started < 5


def test_open_private_creates_0600_and_tightens_an_existing_file(tmp_path):
    old = os.umask(0)
    try:
        fd = open_private(str(tmp_path / "new"), os.O_WRONLY)
        os.close(fd)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o600
    existing = tmp_path / "existing"
    existing.write_text("")
    os.chmod(existing, 0o644)
    t = Telemetry(str(existing))
    t.emit("x", a=1)
    t.close()
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600
    assert '"event":"x"' in existing.read_text()


def test_telemetry_refuses_a_world_writable_folder(shared):
    with pytest.raises(UnsafePath, match="world-writable"):
        Telemetry(str(shared / "events.jsonl"))
    assert os.listdir(shared) == []


def test_ensure_private_file_creates_0600_tightens_and_refuses_what_is_not_a_plain_file(tmp_path):
    new = tmp_path / "new"
    ensure_private_file(str(new))
    assert stat.S_IMODE(new.stat().st_mode) == 0o600
    loose = tmp_path / "loose"
    loose.write_bytes(b"x")
    loose.chmod(0o644)
    ensure_private_file(str(loose))
    assert stat.S_IMODE(loose.stat().st_mode) == 0o600 and loose.read_bytes() == b"x"
    link = tmp_path / "link"
    link.symlink_to(loose)
    with pytest.raises(UnsafePath, match="symbolic link"):
        ensure_private_file(str(link))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafePath, match="not a regular file"):
        ensure_private_file(str(tmp_path / "fifo"))
