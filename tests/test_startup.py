"""Start-up and shutdown as a user meets them: bad options stop mitmdump with one line, a
refused ledger path with one line, the scripts find (or clearly fail to find) a Python, and
mitmdump stops on one signal without a traceback, on every supported Python.

Each test runs real processes: ``mitmdump -s addon/turnguard.py`` from this interpreter's
virtual environment (forked, as every test's mitmdump: ``mitmdump_forks.py``), and the scripts'
Python discovery (``scripts/_python.sh``) in bash.
"""

from __future__ import annotations

import os
import shutil
import stat
import socket
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import mitmdump_forks
from harness import ADDON, MITMDUMP, REPO, Mitmdump, assert_no_traceback
from turnguard_core import options

RUN_TIMEOUT_S = 40.0
BASH = shutil.which("bash") or "/bin/bash"
STOP_ROUNDS = 20
STOP_ROUNDS_AT_ONCE = 4  # rounds are independent processes: a few at a time


def _mitmdump_once(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    """mitmdump with turnguard and the given ``--set`` values, to its exit (it must exit),
    forked as every test's mitmdump is (``mitmdump_forks``; it runs as an exec'd one would).
    Its output, stdout and stderr together as a terminal shows them, is the result's stdout."""
    cmd = [
        str(MITMDUMP), "--mode", "reverse:http://127.0.0.1:9", "--listen-host", "127.0.0.1",
        "--listen-port", "0", "--set", f"confdir={tmp_path / 'confdir'}", "-s", str(ADDON),
    ]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    out = tmp_path / f"mitmdump-once-{len(list(tmp_path.glob('mitmdump-once-*')))}.out"
    with open(out, "wb") as f:
        proc = mitmdump_forks.popen(cmd, stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        returncode = proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise
    return subprocess.CompletedProcess(cmd, returncode, out.read_text(errors="replace"), "")


def _turnguard_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "turnguard:" in line]


def _assert_refused(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """mitmdump exited non-zero with exactly one turnguard line, naming ``needles``, and no
    traceback; returns that line."""
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "Traceback" not in out, out
    lines = _turnguard_lines(out)
    assert len(lines) == 1, out
    for needle in needles:
        assert needle in lines[0], out
    assert "turnguard: running" not in out
    return lines[0]


WRONG_TYPE = {int: "abc", bool: "maybe"}


@pytest.mark.parametrize(
    "spec", [s for s in options.OPTIONS if s.type in WRONG_TYPE], ids=lambda s: s.name
)
def test_an_option_value_of_the_wrong_type_stops_mitmdump_with_one_line(tmp_path, spec):
    value = WRONG_TYPE[spec.type]
    r = _mitmdump_once(tmp_path, f"{spec.name}={value}")
    _assert_refused(r, spec.name, value)
    assert not (tmp_path / "confdir" / "turnguard.sqlite3").exists()


def test_an_unknown_turnguard_option_stops_mitmdump_and_suggests_the_right_name(tmp_path):
    r = _mitmdump_once(tmp_path, "turnguard_holdtimeout_ms=5")
    line = _assert_refused(r, "turnguard_holdtimeout_ms=5")
    assert "did you mean turnguard_hold_timeout_ms?" in line


@pytest.mark.parametrize(
    "setting, needle",
    [
        ("turnguard_recovery_mode=maybe", "turnguard_recovery_mode"),
        ("turnguard_hold_timeout_ms=-1", "turnguard_hold_timeout_ms must be >= 0, not -1"),
        ("turnguard_filter=~nosuchfilter", "turnguard_filter='~nosuchfilter'"),
    ],
)
def test_an_invalid_option_value_stops_mitmdump_with_one_line(tmp_path, setting, needle):
    _assert_refused(_mitmdump_once(tmp_path, setting), needle)


@pytest.mark.parametrize("case", ["missing folder", "world-writable folder", "group-writable file",
                                  "a folder", "a FIFO"])
def test_a_refused_ledger_path_stops_mitmdump_with_one_line_and_no_traceback(tmp_path, case):
    folder = tmp_path / "ledger-folder"
    if case != "missing folder":
        folder.mkdir()
    path = folder / "l.sqlite3"
    if case == "world-writable folder":
        folder.chmod(0o777)
    elif case == "group-writable file":
        path.write_bytes(b"")
        path.chmod(0o660)
    elif case == "a folder":  # never openable: refused, not an outage turnguard waits out
        path.mkdir(mode=0o700)
    elif case == "a FIFO":
        os.mkfifo(path, 0o600)
    line = _assert_refused(_mitmdump_once(tmp_path, f"turnguard_ledger={path}"), str(path), "refused")
    assert {"missing folder": "does not exist", "world-writable folder": "world-writable",
            "group-writable file": "writable by others", "a folder": "not a regular file",
            "a FIFO": "not a regular file"}[case] in line


@pytest.mark.parametrize("user_version, tables", [(0, True), (3, True), (-1, True), (-1, False)])
def test_a_ledger_path_naming_another_programs_database_is_refused_and_left_untouched(
        tmp_path, user_version, tables):
    """turnguard would add its tables to it (or make it 0600 and WAL before its migration
    failed): many programs set a schema version of their own. A negative one is never
    turnguard's, even without tables (its migration from it failed with a traceback)."""
    path = tmp_path / "notes.db"
    db = sqlite3.connect(path)
    if tables:
        db.execute("CREATE TABLE notes (body TEXT)")
        db.execute("INSERT INTO notes VALUES ('keep me')")
    db.execute(f"PRAGMA user_version={user_version}")
    db.commit()
    db.close()
    path.chmod(0o644)
    before = path.read_bytes()
    line = _assert_refused(_mitmdump_once(tmp_path, f"turnguard_ledger={path}"), str(path),
                           "refused")
    assert "not a turnguard ledger" in line
    assert path.read_bytes() == before and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not (tmp_path / "notes.db-wal").exists() and not (tmp_path / "notes.db-shm").exists()


def test_a_ledger_path_naming_a_file_that_is_no_database_leaves_it_untouched(tmp_path):
    """A wrong path (--set turnguard_ledger=/etc/hosts as root) is never made private (0600)
    nor given SQLite's -wal and -shm beside it. It is an outage, as a ledger replaced by junk
    is: turnguard runs and decides in memory, and says why."""
    path = tmp_path / "hosts"
    path.write_text("127.0.0.1 localhost\n")
    path.chmod(0o644)
    before = path.read_bytes()
    with Mitmdump(tmp_path, "http://127.0.0.1:9", options={"turnguard_ledger": str(path)}) \
            as proxy:
        text = proxy.wait_for_log("not a SQLite database; left untouched")
        proxy.wait_for_log("turnguard: running")
    assert_no_traceback(text)
    assert path.read_bytes() == before and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not (tmp_path / "hosts-wal").exists() and not (tmp_path / "hosts-shm").exists()


def test_a_ledger_path_naming_a_database_of_a_newer_schema_leaves_it_untouched(tmp_path):
    """Another program's database with a high schema version of its own, or a newer
    turnguard's ledger: an outage (as a future schema always was), never made 0600 nor
    switched to WAL before the version is read."""
    path = tmp_path / "notes.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (body TEXT)")
    db.execute("PRAGMA user_version=42")
    db.commit()
    db.close()
    path.chmod(0o644)
    before = path.read_bytes()
    with Mitmdump(tmp_path, "http://127.0.0.1:9", options={"turnguard_ledger": str(path)}) \
            as proxy:
        text = proxy.wait_for_log("is newer than this turnguard")
        proxy.wait_for_log("turnguard: running")
    assert_no_traceback(text)
    assert path.read_bytes() == before and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not (tmp_path / "notes.db-wal").exists() and not (tmp_path / "notes.db-shm").exists()


def test_an_events_path_naming_a_file_that_is_no_events_file_is_refused_and_left_untouched(
        tmp_path):
    path = tmp_path / "passwd"
    path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    path.chmod(0o644)
    before = path.read_bytes()
    line = _assert_refused(_mitmdump_once(tmp_path, f"turnguard_events={path}"), str(path))
    assert "not a turnguard events file" in line
    assert path.read_bytes() == before
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_good_start_says_turnguard_is_running(tmp_path):
    with Mitmdump(tmp_path, "http://127.0.0.1:9") as proxy:
        text = proxy.wait_for_log("turnguard: running")
    assert "recovery mode fail_closed" in text
    assert_no_traceback(text)


@pytest.mark.every_python
@pytest.mark.slow
def test_mitmdump_stops_on_one_sigterm_without_a_traceback_20_times(tmp_path, report):
    """Python 3.13 prints 'Exception ignored ... signal wakeup fd' when a second signal races
    mitmdump's shutdown; one signal, then waiting, must never print anything of the kind."""
    def one_round(i: int) -> None:
        proxy = Mitmdump(tmp_path, "http://127.0.0.1:9", name=f"stop-{i}")
        proxy.wait_for_log("turnguard: running")
        rc = proxy.stop()
        text = proxy.log_text()
        assert rc == 0, text
        assert "Traceback" not in text and "Exception ignored" not in text, text

    with ThreadPoolExecutor(STOP_ROUNDS_AT_ONCE) as pool:
        list(pool.map(one_round, range(STOP_ROUNDS)))  # (raises the first round's failure)
    report(f"bare mitmdump + turnguard on Python {sys.version.split()[0]}: stopped by one SIGTERM "
           f"{STOP_ROUNDS} times, no traceback")


# -- scripts/_python.sh ------------------------------------------------------------------------


def _bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, "-c", f'source "{REPO}/scripts/_python.sh"; {script}'], capture_output=True,
        text=True, timeout=RUN_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL,
    )


def _fake_python(folder: Path, name: str, version: str | None, fails: str | None = None) -> Path:
    """An executable that answers the version probe like a Python of ``version`` would (or
    fails with ``fails``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    body = f"echo '{fails}' >&2; exit 1" if fails else f"echo {version}"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _isolated_env(tmp_path: Path, path_dirs: list[Path], **extra: str) -> dict[str, str]:
    """An environment whose PATH holds only ``path_dirs`` and the basic tools, and whose
    pyenv/uv folders are empty."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for tool in ("sort", "head", "cat", "ls", "realpath", "dirname", "cut", "sha256sum", "rm"):
        src = shutil.which(tool)
        if src and not (tools / tool).exists():
            (tools / tool).symlink_to(src)
    return {
        "PATH": ":".join(str(p) for p in [*path_dirs, tools]), "HOME": str(home),
        "PYENV_ROOT": str(home / "pyenv"), **extra,
    }


def test_turnguard_python_is_honoured_even_when_the_venv_exists():
    venv = Path(sys.prefix)
    env = {**os.environ, "TG_VENV": str(venv), "TURNGUARD_PYTHON": "/nonexistent/python3"}
    r = subprocess.run(
        [str(REPO / "scripts" / "reproduce"), "--list"], capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL,
    )
    assert r.returncode != 0, r.stdout
    assert "TURNGUARD_PYTHON=/nonexistent/python3: no such file or command" in r.stderr


def test_turnguard_python_too_old_or_broken_says_which(tmp_path):
    old = _fake_python(tmp_path / "bin", "python3.11", "3.11.4")
    broken = _fake_python(tmp_path / "bin", "pythonx", None, fails="cannot execute")
    env = _isolated_env(tmp_path, [tmp_path / "bin"])
    r = _bash("tg_find_python", {**env, "TURNGUARD_PYTHON": str(old)})
    assert r.returncode != 0
    assert f"TURNGUARD_PYTHON={old} is Python 3.11.4; turnguard needs Python >= 3.12" in r.stderr
    r = _bash("tg_find_python", {**env, "TURNGUARD_PYTHON": str(broken)})
    assert r.returncode != 0 and f"TURNGUARD_PYTHON={broken} does not run (cannot execute)" in r.stderr


def test_no_python_found_lists_what_was_looked_at(tmp_path):
    if any(Path(p).exists() for d in ("/usr/bin", "/usr/local/bin") for p in
           [f"{d}/python3.{m}" for m in range(12, 20)]):
        pytest.skip("this machine has a system Python >= 3.12 in /usr/bin or /usr/local/bin")
    _fake_python(tmp_path / "bin", "python3", "3.11.4")
    _fake_python(tmp_path / "bin", "python3.13", None, fails="pyenv: python3.13: command not found")
    r = _bash("tg_find_python", _isolated_env(tmp_path, [tmp_path / "bin"]))
    assert r.returncode != 0
    assert "turnguard needs Python >= 3.12 and found none. Looked at:" in r.stderr
    assert f"{tmp_path}/bin/python3 is Python 3.11.4" in r.stderr
    assert f"{tmp_path}/bin/python3.13 does not run (pyenv: python3.13: command not found)" in r.stderr
    assert "TURNGUARD_PYTHON=" in r.stderr


def test_the_newest_supported_python_is_chosen_and_the_others_listed(tmp_path):
    _fake_python(tmp_path / "bin", "python3.12", "3.12.7")
    _fake_python(tmp_path / "bin", "python3.13", "3.13.1")
    _fake_python(tmp_path / "bin", "python3", "3.11.4")
    env = _isolated_env(tmp_path, [tmp_path / "bin"])
    r = _bash("tg_find_python", env)
    assert r.returncode == 0 and r.stdout.strip() == f"{tmp_path}/bin/python3.13", r.stderr
    r = _bash(f'TG_PY="{tmp_path}/bin/python3.13" tg_other_pythons', env)
    assert r.stdout.split() == [f"{tmp_path}/bin/python3.12"], r.stderr


def test_proxy_help_creates_nothing(tmp_path):
    venv = tmp_path / "venv"
    r = subprocess.run(
        [str(REPO / "scripts" / "proxy"), "--help"], capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S, env={**os.environ, "TG_VENV": str(venv)}, stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0 and r.stdout.startswith("Usage: scripts/proxy")
    assert not venv.exists()


def test_test_help_creates_nothing(tmp_path):
    venv = tmp_path / "venv"
    r = subprocess.run(
        [str(REPO / "scripts" / "test"), "--help"], capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S, env={**os.environ, "TG_VENV": str(venv)}, stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0 and "--quick" in r.stdout
    assert not venv.exists()


def test_a_metrics_address_that_cannot_be_bound_stops_mitmdump_with_one_line(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        r = _mitmdump_once(tmp_path, f"turnguard_metrics=127.0.0.1:{port}")
    line = _assert_refused(r, f"turnguard_metrics='127.0.0.1:{port}'", "cannot serve metrics there")
    assert "in use" in line
    _assert_refused(_mitmdump_once(tmp_path, "turnguard_metrics=9464"), "turnguard_metrics",
                    "HOST:PORT")


@pytest.mark.parametrize("option", ["turnguard_ledger", "turnguard_events"])
def test_a_refused_path_with_a_newline_or_a_terminal_escape_is_one_line_and_writes_no_escape(
        tmp_path, option):
    """A name is whatever bytes a user or a script put in it: the refusal must stay the one
    line a user reads, and must not send an escape sequence to the terminal."""
    folder = tmp_path / "ev\x1b[2J"
    folder.mkdir()
    path = folder / "fi\nfo"
    os.mkfifo(path, 0o600)  # refused by both: not a regular file
    r = _mitmdump_once(tmp_path, f"{option}={path}")
    line = _assert_refused(r, option, "not a regular file")
    assert "\x1b" not in r.stdout + r.stderr, line
    assert stat.S_ISFIFO(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("option", ["turnguard_ledger", "turnguard_events", "turnguard_metrics"])
def test_a_value_with_a_nul_from_the_config_file_is_refused_in_one_line_naming_it(
        tmp_path, option):
    """A YAML string may hold a NUL (``"\\0"``), which no command line can: the system calls
    and the socket refuse it with messages that name no option (or a traceback, for the
    metrics' host). It is refused in one line naming the option."""
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    value = "127.0.0.1\\0:9464" if option == "turnguard_metrics" else f"{tmp_path}/x\\0y"
    (confdir / "config.yaml").write_text(f'{option}: "{value}"\n')
    r = _mitmdump_once(tmp_path)
    _assert_refused(r, option)


def test_a_config_file_with_a_misspelt_option_and_a_bad_value_names_both_at_start_up(tmp_path):
    """A config file holding a misspelt turnguard name and a bad value for a real one: the
    start stops (exit status non-zero) naming both, one line each, not one per try (the
    misspelling turned turnguard off as the script loaded, and the bad value that mitmproxy
    applied next was never checked)."""
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    (confdir / "config.yaml").write_text(
        "turnguard_hold_timout_ms: 5\nturnguard_hold_timeout_ms: -3\n")
    r = _mitmdump_once(tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out, out
    lines = _turnguard_lines(out)
    assert len(lines) == 2, out
    assert any("unknown option turnguard_hold_timout_ms=5" in line
               and "did you mean turnguard_hold_timeout_ms?" in line for line in lines), out
    assert any("turnguard_hold_timeout_ms must be >= 0, not -3" in line for line in lines), out
    assert "turnguard: running" not in out


@pytest.mark.parametrize("config, sets, named", [
    ("turnguard_hold_timeout_ms: -3\nturnguard_detach_max: -1\n", (),
     ["turnguard_hold_timeout_ms must be >= 0", "turnguard_detach_max must be >= 0"]),
    ("turnguard_hold_timout_ms: 5\nturnguard_hold_timeout_ms: -3\nturnguard_detach_max: -1\n",
     (), ["unknown option turnguard_hold_timout_ms", "turnguard_hold_timeout_ms must be >= 0",
          "turnguard_detach_max must be >= 0"]),
    ("turnguard_detach_max: -1\n", ("turnguard_filter=~q(",),
     ["turnguard_detach_max must be >= 0", "turnguard_filter"]),
    ("turnguard_ledgr: 5\n", ("turnguard_ledger=postgresql://u:p@ss@127.0.0.1/db",),
     ["unknown option turnguard_ledgr", "turnguard_ledger="]),
], ids=["two bad values", "a typo and two bad values", "a bad value and a bad filter",
        "a typo and a refused ledger"])
def test_every_bad_option_is_named_at_start_up(tmp_path, config, sets, named):
    """Start-up names every bad option, one line each (not one per try): the values
    turnguard refuses, a filter that does not parse, a ledger location refused, beside a
    typo; it stops (exit status non-zero) without a traceback or a password."""
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    (confdir / "config.yaml").write_text(config)
    r = _mitmdump_once(tmp_path, *sets)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out, out
    lines = _turnguard_lines(out)
    assert len(lines) == len(named), out
    for needle in named:
        assert any(needle in line for line in lines), (needle, out)
    assert "p@ss" not in out and "turnguard: running" not in out


def test_a_misspelt_option_whose_value_is_a_mapping_never_shows_it(tmp_path):
    """A config file's misspelt ``turnguard_ledger`` whose value is a mapping (a URL and a
    password under keys of their own): named, its value shown by its kind only."""
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    (confdir / "config.yaml").write_text(
        'turnguard_ledgr: {url: "postgresql://tg:hunter2@127.0.0.1/db", password: hunter2}\n')
    r = _mitmdump_once(tmp_path)
    out = _assert_refused(r, "unknown option turnguard_ledgr", "<mapping>")
    assert "hunter2" not in r.stdout + r.stderr, out


PG_SECRET = "pg-SECRET-hunter2"


@pytest.mark.parametrize("sets", [
    # a misspelt name: reported as unknown, with its value
    [f"turnguard_ledgr=postgresql://tg:{PG_SECRET}@127.0.0.1:1/ledger"],
    # set twice: both values are named
    [f"turnguard_ledger=postgresql://tg:{PG_SECRET}@127.0.0.1:1/ledger",
     f"turnguard_ledger=postgresql://tg:{PG_SECRET}-2@127.0.0.1:1/ledger"],
    [f"turnguard_ledgr=host=127.0.0.1 port=1 dbname=ledger password={PG_SECRET}"],
    # the ledger's URL put in another option by mistake: refused, quoting it
    [f"turnguard_events=postgresql://tg:{PG_SECRET}@127.0.0.1:1/ledger"],
    [f"turnguard_metrics=postgresql://tg:{PG_SECRET}@127.0.0.1:1/ledger"],
], ids=["misspelt", "set twice", "misspelt key-value", "in turnguard_events",
        "in turnguard_metrics"])
def test_a_refused_ledger_option_never_shows_its_password(tmp_path, sets):
    """An option refused before turnguard reads it (a typo, a value set twice), or one that
    got the ledger's URL by mistake, is named with its value, as any refused option is; a
    PostgreSQL password in it is still shown as ***."""
    r = _mitmdump_once(tmp_path, *sets)
    line = _assert_refused(r, sets[0].split("=", 1)[0], "***")
    assert PG_SECRET not in r.stdout + r.stderr, line


@pytest.mark.parametrize("password", [
    PG_SECRET,
    f'"{PG_SECRET} x"',  # in double quotes, as a shell would have it: libpq has no such quote
    f"{PG_SECRET} dbname",  # a word without "=" after it
    f"{PG_SECRET}\u00a0x=y",  # a no-break space: no space to libpq, the password's
], ids=["plain", "double quotes", "a word without =", "a no-break space"])
def test_a_libpq_key_value_connection_string_is_refused_without_its_password(tmp_path, password):
    """``host=... password=...`` (libpq's other form) is no URL: taken for an SQLite path it
    made a file named after the password in the working folder and logged that name with
    every start. It is refused, one line, the password as ***, and no file is made; the
    control tool refuses it the same way. So is one that libpq would not parse (a password
    in double quotes, a word without a value): it is still no file's name."""
    conninfo = f"host=127.0.0.1 port=1 dbname=ledger user=tg password={password}"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cmd = [str(MITMDUMP), "--mode", "reverse:http://127.0.0.1:9", "--listen-host",
           "127.0.0.1", "--listen-port", "0", "--set", f"confdir={tmp_path / 'confdir'}",
           "-s", str(ADDON), "--set", f"turnguard_ledger={conninfo}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                           stdin=subprocess.DEVNULL, cwd=cwd,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as e:  # it ran (on an SQLite file): what did it say?
        r = subprocess.CompletedProcess(cmd, None, _text(e.stdout), _text(e.stderr))
    made = [p.name for p in cwd.iterdir()]
    assert PG_SECRET not in r.stdout + r.stderr and not made, (made, r.stdout + r.stderr)
    _assert_refused(r, "turnguard_ledger=host=127.0.0.1", "password=***", "postgresql://")
    tool = subprocess.run([str(REPO / "scripts" / "turnguard"), "--ledger", conninfo, "status"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          stdin=subprocess.DEVNULL, cwd=cwd)
    assert tool.returncode == 1 and PG_SECRET not in tool.stdout + tool.stderr, tool.stderr
    assert "password=***" in tool.stderr and "postgresql://" in tool.stderr, tool.stderr
    assert not list(cwd.iterdir())


@pytest.mark.parametrize("url, parts", [
    ("postgresql://tg:Xq7/{s}@127.0.0.1:1/ledger", ["Xq7", PG_SECRET]),  # a raw "/"
    ("postgresql://tg:Xq7@{s}@127.0.0.1:1/ledger", ["Xq7", PG_SECRET]),  # a raw "@"
    ("postgresql://tg@127.0.0.1:1/ledger?password=Xq7&{s}", ["Xq7", PG_SECRET]),  # a raw "&"
    ("postgresql://tg:Xq7?{s}/x@127.0.0.1:1/ledger", ["Xq7", PG_SECRET]),  # "?", then "/"
], ids=["slash", "at", "ampersand", "question mark and slash"])
def test_a_url_whose_password_has_a_raw_delimiter_is_refused_without_any_of_it(
        tmp_path, url, parts):
    """A password with an unencoded ``/``, ``@`` or ``&`` is read by libpq as part of the
    host, the port, the database or a query word, which its errors (and urllib's) quote:
    such a URL was shown and reported with the rest of the password in clear. It is refused,
    one line, and no part of the password is in what the proxy or the control tool says."""
    url = url.format(s=PG_SECRET)
    r = _mitmdump_once(tmp_path, f"turnguard_ledger={url}")
    line = _assert_refused(r, "turnguard_ledger=postgresql://", "not a valid PostgreSQL URL")
    for part in parts:
        assert part not in r.stdout + r.stderr, line
    tool = subprocess.run([str(REPO / "scripts" / "turnguard"), "--ledger", url, "status"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert tool.returncode == 1 and "not a valid PostgreSQL URL" in tool.stderr, tool.stderr
    for part in parts:
        assert part not in tool.stdout + tool.stderr, tool.stderr


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""
