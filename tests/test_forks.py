"""The tests' forked mitmdumps (tests/mitmdump_forks.py) run as exec'd ones do.

Every end-to-end test relies on this: a mitmdump forked from the server that imported mitmproxy
must see the same arguments, environment, directory, umask, streams, ``__main__`` and signal
dispositions as one started with exec, end with the same statuses, and be signalled the same
way. Each test starts one of each and compares. (The identity worker a forked mitmdump spawns,
with the mitmdump script as its ``__main__``, and its end with that mitmdump:
``test_crash.py::test_kill9_does_not_leave_the_identity_worker_running``.)
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cpu_per_test
import mitmdump_forks
from harness import (ADDON, REPO, Mitmdump, MockUpstream, assert_no_traceback, running, sse_post,
                     wait_until)

# An addon that writes what the process it runs in looks like, once loaded.
_PROBE = '''
import json, os, resource, signal, sys
import __main__

def _status(field):
    with open("/proc/self/status") as f:
        return next(line.split()[1] for line in f if line.startswith(field + ":"))

def _disposition(sig):
    handler = signal.getsignal(sig)
    return handler if isinstance(handler, int) else "python"

def load(loader):
    facts = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": os.environ.get("TURNGUARD_PROBE"),
        "main": getattr(__main__, "__file__", None),
        "path0": sys.path[0],
        "stdin": os.path.realpath(f"/proc/self/fd/0"),
        "stdout_is_stderr": os.path.samestat(os.fstat(1), os.fstat(2)),
        "signals": {s.name: _disposition(s)
                    for s in (signal.SIGINT, signal.SIGPIPE, signal.SIGTERM, signal.SIGCHLD)},
        "sid_is_own": os.getsid(0) == os.getpid(),
        "turnguard_loaded": "turnguard_core" in sys.modules,
        "umask": _status("Umask"),
        "ignored": _status("SigIgn"),
        "blocked": _status("SigBlk"),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
    }
    with open(os.environ["TURNGUARD_PROBE_OUT"], "w") as f:
        json.dump(facts, f)
'''


def _both(tmp_path: Path, monkeypatch, **kwargs):
    """A forked and an exec'd mitmdump with the same arguments; yields each with its name."""
    for how in ("fork", "exec"):
        monkeypatch.setenv("TURNGUARD_TEST_EXEC_MITMDUMP", "1" if how == "exec" else "0")
        yield how, Mitmdump(tmp_path, "http://127.0.0.1:9", name=how, **kwargs)


def _probe_both(tmp_path: Path, monkeypatch, forked: bool = True) -> dict:
    """What the probe saw in a mitmdump started as a fork (or, when ``forked`` is false, one the
    fork module ran with exec on its own) and in an exec'd one."""
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    facts = {}
    for how, proxy in _both(tmp_path, monkeypatch, addon=probe,
                            env={"TURNGUARD_PROBE": "x",
                                 "TURNGUARD_PROBE_OUT": str(tmp_path / "facts")}):
        with proxy:
            assert isinstance(proxy.proc, mitmdump_forks.ForkedPopen) == (how == "fork" and forked)
            facts[how] = json.loads((tmp_path / "facts").read_text())
            (tmp_path / "facts").unlink()
            assert proxy.stop() == 0, proxy.log_text()
        assert_no_traceback(proxy.log_text())
    for how in facts:  # what differs by design: the confdir and the name in the arguments
        facts[how]["argv"] = [a.replace(f"{how}-confdir", "-confdir") for a in facts[how]["argv"]]
    return facts


def test_a_forked_mitmdump_sees_what_an_execd_one_sees(tmp_path, monkeypatch):
    facts = _probe_both(tmp_path, monkeypatch)
    assert facts["fork"] == facts["exec"]
    assert facts["fork"]["env"] == "x" and facts["fork"]["stdin"] == "/dev/null"
    assert facts["fork"]["main"] == str(mitmdump_forks.MITMDUMP)
    assert not facts["fork"]["turnguard_loaded"], \
        "a mitmdump that does not load turnguard's script must not have its modules"


# An addon, loaded after turnguard's script, that writes which of turnguard's modules the
# process runs, and from which file.
_MODULES_PROBE = '''
import json, os, sys

def running():
    modules = {name: module.__file__ for name, module in list(sys.modules.items())
               if name.partition(".")[0] in ("turnguard_core", "turnguard_shell")}
    out = os.environ["TURNGUARD_PROBE_OUT"]
    with open(out + ".part", "w") as f:
        json.dump(modules, f)
    os.rename(out + ".part", out)
'''


def _reaped_cpu_s() -> float:
    """CPU seconds of the processes reaped so far by this test process (an exec'd mitmdump,
    with what it reaped: its identity worker), and of its fork server's tree (a forked one,
    once reaped, with the fork that made it)."""
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    server = mitmdump_forks._server
    forked = 0.0 if server is None else cpu_per_test.tree_cpu_s(server.process.pid)
    return own.ru_utime + own.ru_stime + forked


@pytest.mark.parametrize("tree", ["addon/", "a copy of addon/"])
def test_a_forked_mitmdump_runs_the_turnguard_its_script_imports(tmp_path, monkeypatch, report,
                                                                  tree):
    """The server imported turnguard's modules from addon/: a forked mitmdump loading
    addon/turnguard.py runs those very files, every one an exec'd one runs; one loading the
    script of another copy of the folder runs that copy's modules, as an exec'd one does, not
    the server's. Reports what each took, started and stopped."""
    script = ADDON
    if tree != "addon/":
        shutil.copytree(ADDON.parent, tmp_path / "addon",
                        ignore=shutil.ignore_patterns("__pycache__"))
        script = tmp_path / "addon" / "turnguard.py"
    probe = tmp_path / "probe.py"
    probe.write_text(_MODULES_PROBE)
    out = tmp_path / "modules"
    seen, cpu_s = {}, {}
    # (the fork server started first: what it reaps is counted from the first reading on)
    Mitmdump(tmp_path, "http://127.0.0.1:9", name="first", addon=False).stop()
    for how in ("fork", "exec"):
        monkeypatch.setenv("TURNGUARD_TEST_EXEC_MITMDUMP", "1" if how == "exec" else "0")
        before = _reaped_cpu_s()
        with Mitmdump(tmp_path, "http://127.0.0.1:9", name=how, addon=script,
                      extra_args=["-s", str(probe)],
                      env={"TURNGUARD_PROBE_OUT": str(out)}) as proxy:
            assert isinstance(proxy.proc, mitmdump_forks.ForkedPopen) == (how == "fork")
            wait_until(out.exists, 30, what="the probe's list")
            seen[how] = json.loads(out.read_text())
            out.unlink()
            assert proxy.stop() == 0, proxy.log_text()
        cpu_s[how] = _reaped_cpu_s() - before
        assert_no_traceback(proxy.log_text())
    assert "turnguard_core.machine" in seen["exec"]
    assert all(Path(f).parent.parent == script.parent for f in seen["exec"].values()), seen
    assert seen["exec"].items() <= seen["fork"].items()
    if tree != "addon/":  # the server's dropped first: the copy's imported as asked
        assert seen["fork"] == seen["exec"]
    report(f"a mitmdump with turnguard ({tree}) and a probe addon, started and stopped: "
           f"{cpu_s['fork']:.2f} CPU seconds forked, {cpu_s['exec']:.2f} exec'd")


_AT_EXIT_ADDON = '''
import atexit, os, threading, time

OUT = os.environ["TURNGUARD_PROBE_OUT"]
atexit.register(lambda: open(OUT + ".atexit", "w").close())


def done():
    def late():
        time.sleep(0.5)
        open(OUT + ".thread", "w").close()
    threading.Thread(target=late).start()  # not a daemon: the interpreter waits for it
'''


def test_a_forked_mitmdump_ends_as_an_execd_one_waiting_for_threads_and_exit_handlers(
        tmp_path, monkeypatch):
    """A forked child skips only the teardown of its objects: it waits for its non-daemon
    threads and runs its exit handlers before it ends, with the same status."""
    addon = tmp_path / "at_exit.py"
    addon.write_text(_AT_EXIT_ADDON)
    seen = {}
    for how, proxy in _both(tmp_path, monkeypatch, addon=addon,
                            env={"TURNGUARD_PROBE_OUT": str(tmp_path / "out")}):
        with proxy:
            status = proxy.stop()
        files = sorted(p.name for p in tmp_path.glob("out.*"))
        for p in tmp_path.glob("out.*"):
            p.unlink()
        seen[how] = (status, files)
    assert seen["fork"] == seen["exec"] == (0, ["out.atexit", "out.thread"])


def test_a_forked_mock_upstream_answers_logs_and_stops_as_an_execd_one(tmp_path, monkeypatch):
    """The mock upstream is forked too: it answers, logs (its log file 0600) and ends on
    SIGTERM with status 0 as the exec'd one does."""
    seen = {}
    for how in ("fork", "exec"):
        monkeypatch.setenv("TURNGUARD_TEST_EXEC_MITMDUMP", "1" if how == "exec" else "0")
        with MockUpstream(tmp_path, {"default": {"kind": "ok", "events": 3}}, name=how) as up:
            assert isinstance(up.process.popen, mitmdump_forks.ForkedPopen) == (how == "fork")
            status, _, body = sse_post(up.url, body={"model": "m", "input": how, "stream": True},
                                       timeout=10)
            dispatches = up.dispatches()
            seen[how] = (status, body.count(b"event: "), len(dispatches),
                         dispatches[0]["path"], up.log_path.stat().st_mode & 0o777,
                         up.stop())
    status, events, dispatched, path, mode, stopped = seen["fork"]
    assert seen["fork"] == seen["exec"]
    assert (status, dispatched, path, mode, stopped) == (200, 1, "/v1/responses", 0o600, 0)
    assert events > 0


def test_a_forked_mitmdump_inherits_what_the_test_process_has_when_it_starts(tmp_path,
                                                                             monkeypatch):
    """An exec'd mitmdump inherits the test process's umask, resource limits, ignored and
    blocked signals as they are when it starts (test_security.py starts one under umask 0), not
    as they were when the server started."""
    with Mitmdump(tmp_path, "http://127.0.0.1:9", name="first", addon=False):
        pass  # the server runs, started with the test process's usual state
    old_umask = os.umask(0o007)
    try:  # a umask a fork can take
        facts = _probe_both(tmp_path, monkeypatch)
    finally:
        os.umask(old_umask)
    assert facts["exec"]["umask"] == "0007"
    assert facts["fork"] == facts["exec"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.ExitStack() as undo:  # what a fork could not always take: exec'd
        for what, change in [(lambda h: signal.signal(signal.SIGHUP, h),
                              signal.signal(signal.SIGHUP, signal.SIG_IGN)),
                             (lambda m: signal.pthread_sigmask(signal.SIG_SETMASK, m),
                              signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1}))]:
            undo.callback(what, change)
        undo.callback(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
        facts = _probe_both(tmp_path, monkeypatch, forked=False)
    assert facts["exec"]["nofile"][0] == min(soft, 512) and facts["exec"]["blocked"] != "0" * 16
    assert facts["fork"] == facts["exec"]


def test_a_forked_mitmdump_ends_and_is_signalled_as_an_execd_one(tmp_path, monkeypatch):
    statuses = {}
    for how, proxy in _both(tmp_path, monkeypatch, addon=False):
        with proxy:
            proxy.proc.send_signal(signal.SIGSTOP)
            time.sleep(0.3)
            assert proxy.proc.poll() is None  # stopped is not ended
            proxy.proc.send_signal(signal.SIGCONT)
            sigterm = proxy.stop()
        killed = Mitmdump(tmp_path, "http://127.0.0.1:9", name=f"{how}-k", addon=False)
        statuses[how] = (sigterm, killed.kill9(), killed.proc.poll(), killed.proc.wait(1))
    killed = -signal.SIGKILL
    assert statuses["fork"] == statuses["exec"] == (0, killed, killed, killed)


def test_a_forked_mitmdump_that_fails_to_start_reports_as_an_execd_one(tmp_path, monkeypatch):
    outcomes = {}
    for how in ("fork", "exec"):
        monkeypatch.setenv("TURNGUARD_TEST_EXEC_MITMDUMP", "1" if how == "exec" else "0")
        out = tmp_path / f"{how}.out"
        with open(out, "ab") as f:
            p = mitmdump_forks.popen(
                [str(mitmdump_forks.MITMDUMP), "--listen-host", "127.0.0.1", "--listen-port", "0",
                 "--mode", "no-such-mode"],
                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
        assert isinstance(p, mitmdump_forks.ForkedPopen) == (how == "fork")
        rc = p.wait(60)
        outcomes[how] = (rc, "no-such-mode" in out.read_text())
    assert outcomes["fork"] == outcomes["exec"] and outcomes["fork"][0] != 0 and outcomes["fork"][1]


def test_the_server_keeps_the_environment_the_test_process_began_with(tmp_path, monkeypatch):
    """A server started while a test had changed the environment forks for the tests after it
    (before, it took that test's environment, and every later mitmdump of the process was
    exec'd: in CI, a test setting PYTHONPATH made the fork tests of its worker fail)."""
    monkeypatch.setenv("TURNGUARD_TEST_EXEC_MITMDUMP", "0")
    monkeypatch.setattr(mitmdump_forks, "_server", None)  # this test's own, started below
    kinds = []
    try:
        for during_test in (True, False):
            with monkeypatch.context() as m:
                if during_test:
                    m.setenv("PYTHONPATH", str(tmp_path))
                with Mitmdump(tmp_path, "http://127.0.0.1:9", addon=False) as proxy:
                    kinds.append(type(proxy.proc).__name__)
    finally:
        if mitmdump_forks._server is not None:
            mitmdump_forks._server.close()
    assert kinds == ["Popen", "ForkedPopen"]


def test_what_an_import_or_the_interpreter_would_read_is_execd(tmp_path, monkeypatch):
    """mitmproxy reads SSLKEYLOGFILE when imported, Python PYTHON* as it starts: a fork of a
    server that started without them would not see them."""
    monkeypatch.setenv("TURNGUARD_TEST_EXEC_MITMDUMP", "0")
    for extra in ({"SSLKEYLOGFILE": str(tmp_path / "keys")}, {"PYTHONHASHSEED": "1"}):
        with Mitmdump(tmp_path, "http://127.0.0.1:9", addon=False, env=extra) as proxy:
            assert isinstance(proxy.proc, subprocess.Popen)
    with Mitmdump(tmp_path, "http://127.0.0.1:9", addon=False, env={"TURNGUARD_X": "1"}) as proxy:
        assert isinstance(proxy.proc, mitmdump_forks.ForkedPopen)


# A test process that starts a forked mitmdump, says what runs, and waits to be killed.
_KILLED_TEST = '''
import json, os, sys, time
sys.path[:0] = [os.path.join(sys.argv[1], "tests"), os.path.join(sys.argv[1], "scripts")]
import mitmdump_forks
from harness import Mitmdump
from pathlib import Path
proxy = Mitmdump(Path(sys.argv[2]), "http://127.0.0.1:9", addon=False)
server = mitmdump_forks._server
print(json.dumps({"forked": isinstance(proxy.proc, mitmdump_forks.ForkedPopen),
                  "server": server.process.pid, "mitmdump": proxy.proc.pid, "dir": server.dir}),
      flush=True)
time.sleep(60)
'''


def test_a_test_process_killed_takes_the_server_and_its_mitmdumps_with_it(tmp_path, monkeypatch):
    """kill -9 of a test process (a worker that crashed or timed out): the server sees it gone,
    kills its mitmdumps, ends, and leaves no socket or directory behind."""
    monkeypatch.setenv("TURNGUARD_TEST_EXEC_MITMDUMP", "0")
    test = subprocess.Popen([sys.executable, "-c", _KILLED_TEST, str(REPO), str(tmp_path)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        started = json.loads(test.stdout.readline())
    finally:
        test.kill()
        test.wait(10)
        test.stdout.close()
    assert started["forked"]
    deadline = time.monotonic() + 15
    while any(running(started[p]) for p in ("server", "mitmdump")):  # bounded by the deadline
        assert time.monotonic() < deadline, f"still running: {started}"
        time.sleep(0.05)
    assert not os.path.exists(started["dir"]), os.listdir(started["dir"])


def test_a_server_killed_takes_its_mitmdumps_with_it(tmp_path, monkeypatch):
    """kill -9 of the server (the OOM killer's pick): its mitmdumps go with it, so that what
    ForkedPopen then answers (killed) is true and Process.stop leaves nothing running."""
    monkeypatch.setenv("TURNGUARD_TEST_EXEC_MITMDUMP", "0")
    with Mitmdump(tmp_path, "http://127.0.0.1:9", addon=False) as proxy:
        assert isinstance(proxy.proc, mitmdump_forks.ForkedPopen)
        server = mitmdump_forks._server
        pid = proxy.proc.pid
        try:
            server.process.kill()
            server.process.wait(10)
            assert proxy.proc.wait(10) == -signal.SIGKILL
            deadline = time.monotonic() + 10
            while running(pid):  # bounded by the deadline
                assert time.monotonic() < deadline, "the mitmdump outlived its server"
                time.sleep(0.05)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            server.close()
            mitmdump_forks._server = None  # the next mitmdump starts a new one


def test_signalling_a_forked_mitmdump_that_just_ended_is_harmless_as_with_popen(tmp_path,
                                                                                monkeypatch):
    """While one thread waits for a mitmdump (and holds its lock), another signals it just
    after it ended and was reaped: Popen.send_signal ignores the ProcessLookupError, and so must
    ForkedPopen."""
    monkeypatch.setenv("TURNGUARD_TEST_EXEC_MITMDUMP", "0")
    with Mitmdump(tmp_path, "http://127.0.0.1:9", addon=False) as proxy:
        proc = proxy.proc
        assert isinstance(proc, mitmdump_forks.ForkedPopen)
        with proc._lock:  # as a wait() in another thread does
            os.kill(proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{proc.pid}"):  # reaped by the server; bounded
                assert time.monotonic() < deadline
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            proc.terminate()
        assert proc.wait(10) == -signal.SIGKILL
