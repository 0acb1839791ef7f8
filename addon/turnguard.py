"""turnguard: hold duplicate AI model turns instead of executing them twice.

Load it with ``mitmdump -s addon/turnguard.py --mode reverse:https://api.openai.com``. This file
is the mitmproxy-facing shell: ``TurnGuard`` turns hooks into calls on the pure core
(``turnguard_core``) and the core's decisions into flow actions; the parts of the shell that
hold state live in ``turnguard_shell``. What happens to a request, and so to a duplicate, is
the loop of ``TurnGuard._guard`` over the states of ``turnguard_core.machine``.
"""

import asyncio
import logging
import os
import sys
import time
from typing import Callable, assert_never

# mitmproxy puts this folder on sys.path only while it loads the script: import the core now.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from mitmproxy import ctx, exceptions, flowfilter, http  # noqa: E402
from mitmproxy.websocket import WebSocketData  # noqa: E402

from turnguard_core import circuit, identity, ledger_location, machine, options, policy  # noqa: E402
from turnguard_core.failover import FailoverStore  # noqa: E402
from turnguard_core.ledger import LedgerError  # noqa: E402
from turnguard_core.offload import WorkerStopped  # noqa: E402
from turnguard_core.telemetry import Telemetry  # noqa: E402
from turnguard_shell import config, flows  # noqa: E402
from turnguard_shell.answering import Identifier, Replayer  # noqa: E402
from turnguard_shell.attaching import Attacher  # noqa: E402
from turnguard_shell.commands import Commands  # noqa: E402
from turnguard_shell.detached import Detacher  # noqa: E402
from turnguard_shell.inflight import InFlight  # noqa: E402
from turnguard_shell.maintenance import Maintenance  # noqa: E402
from turnguard_shell.metrics_endpoint import MetricsEndpoint  # noqa: E402
from turnguard_shell.process import ProcessState  # noqa: E402
from turnguard_shell.sessions import Sessions  # noqa: E402
from turnguard_shell.waiters import UNLOADED, HandedOver, Waiters  # noqa: E402
from turnguard_shell.websocket import WebSockets  # noqa: E402

logger = logging.getLogger("turnguard")

LEDGER_WAIT_S = 0.5  # longest a request waits for the ledger before deciding without it
SHUTDOWN_LET_GO_S = 2.0  # longest shutdown waits for the requests it let go to record their end
ERROR_RECORD_WAIT_S = 1.0  # longest a failed attempt's answer waits for its ledger record
PEERS_RECHECK_S = 1.0  # a request held for peers to register in a new ledger is admitted again this often
# set on a flow whose request hook reached turnguard (any instance's), or that was said to
# pass unguarded for want of it: a flow that reaches its response without it went by
# unguarded (``TurnGuard._say_request_unguarded``). An attribute of the flow, not a set of
# flows: a weak set cost several microseconds a request.
REQUEST_SEEN = "_turnguard_request_seen"
REQUEST_HALTED = ("request hook never reached turnguard (an addon before it halted it, or "
                  "answered it before that hook): the request went by unguarded")
WEBSOCKET_OFF = ("websocket option is off: mitmproxy relays the socket as raw TCP, its calls "
                 "unguarded")


def _shutting_down() -> bool:
    """mitmproxy is exiting (not reloading the script): its master's ``should_exit`` is set
    before the ``done`` hooks run. True when that cannot be told (no master)."""
    should_exit = getattr(getattr(ctx, "master", None), "should_exit", None)
    return should_exit is None or should_exit.is_set()


# the states whose step the addon instance does (a wait, a ledger call): after a reload, the
# instance loaded then does them
_ASKS = (machine.Admit, machine.HoldDuplicate, machine.WaitCooldown, machine.FetchRecording,
         machine.FailClosed)


def _ledger_deadline(budget_deadline: float) -> float:
    """How long a request may wait for the ledger now: never past its budget."""
    return min(budget_deadline, time.monotonic() + LEDGER_WAIT_S)


class TurnGuard:
    def __init__(self) -> None:
        self.settings = options.settings_from(options.DEFAULTS)
        self.filter: flowfilter.TFilter | None = None
        self.telemetry = config.telemetry()
        # another events file an update named while running, accepted by turnguard: in use on
        # the loop's next turn if the update is still in force then (``_settle_events``)
        self._events_pending: Telemetry | None = None
        self._undo_log_filter: Callable[[], object] = lambda: None
        self._running = False  # set by the running hook: start-up is over
        self._unloaded = False  # set by done: the process's next instance writes telemetry
        self._holding = 0  # requests held now, until their wake-up is decided and applied
        self._none_holding: asyncio.Event | None = None  # set by done at shutdown
        self.refused: list[str] = []  # bad options found at start-up: turnguard stays off
        self.identifier = Identifier()
        self._build(ProcessState.new())

    def _build(self, process: ProcessState) -> None:
        """The parts, around ``process`` (kept on mitmproxy's master across script reloads)."""
        self._process = process
        self.telemetry.counts = process.event_counts  # the process's: a reload goes on counting
        self.waiters = Waiters()
        self.clients = flows.ClientWatch()
        self.explainer = flows.Explainer()
        self.store = FailoverStore(
            instance_id=process.instance_id, identity=process.identity, emit=self._emit,
            memory=process.memory, kept=process.kept_writes,
            claims_in_doubt=process.claims_in_doubt, attempts=lambda: self.inflight,
            on_reregistered=lambda incarnation: self.sessions.forget_all(),
            on_attempt_ended=lambda op_key, attempt_id, state: self.waiters.attempt_ended_elsewhere(
                op_key, attempt_id, state, generation=self.store.generation),
            peers_awaited=process.peers_awaited,
        )
        self.store.replay_window_of = self._replay_window_s
        self.inflight = InFlight(process, self.store, self.waiters, self.explainer, self._emit,
                                 lambda: self.settings)
        self.sessions = Sessions(self.store, self._emit)
        self.maintenance = Maintenance(self)
        self.metrics_endpoint = MetricsEndpoint(self)
        self.replayer = Replayer(self.store, self.explainer, self._emit)
        self.websockets = WebSockets(process)
        self.detacher = Detacher(process.detached, self._emit, self.explainer,
                                 lambda: self.settings, self._awaited)
        self.attacher = Attacher(process, self.inflight, self.detacher, lambda: self.settings,
                                 self.clients.gone)
        # no sub-addons (``addons``): mitmproxy walks an addon's sub-addons on every event of
        # every flow; the maintenance's hooks are called from this instance's, and the
        # commands are registered at load
        self.commands = Commands(self)

    @property
    def instance_id(self) -> str:
        return self._process.instance_id

    @property
    def metrics(self):
        """The Prometheus metrics served (``turnguard_metrics``), or None."""
        return self.metrics_endpoint.metrics

    def _awaited(self, flow_id: str) -> bool:
        """A duplicate is held waiting for the attempt of ``flow_id`` (a detached call's), by
        the instance that gets the hooks now: a detached call's window armed before a script
        reload ends in the unloaded instance's ``Detacher``, while the retries held on the
        call since are the new instance's (counted as its clients, it is not cut); or one
        decided to attach to it is on its way to the relay (no listener until it gets
        there)."""
        now = self._process.guard
        if now is not None and now is not self:
            return now._awaited(flow_id)
        attempt = self.inflight.attempt(flow_id)
        if attempt is None:
            return False
        relay = self._process.relay
        return self.waiters.holding(attempt.ident.op_key) or (
            relay is not None and attempt.live is not None and relay.routed_to(attempt.live))

    def _emit(self, event: str, **fields) -> None:
        if self._unloaded:
            # a record of this instance's work made after it was unloaded (holds it let go
            # end on the loop's next turn): a reload's new instance writes it, as the file
            # and the metrics are its now
            now = self._process.guard
            if now is not None and now is not self:
                now._emit(event, **fields)
                return
            if now is None and not _shutting_down():
                # no instance loaded (a reload to a script that fails to load): the events
                # file and the metrics are closed; the next instance that loads writes it
                self._process.unwritten.append((event, {"ts": round(time.time(), 6), **fields}))
                return
        self.telemetry.emit(event, **fields)

    # -- options ---------------------------------------------------------------------------------
    def load(self, loader) -> None:
        # A script reload makes a new TurnGuard in the same process: it takes over the
        # process's instance id and its attempts in flight (their hooks now come here).
        self._build(ProcessState.of(loader.master))
        self._process.guard = self
        if self._process.exit_watch is not None:  # an instance is loaded: its done does that
            self._process.exit_watch.cancel()
            self._process.exit_watch = None
        loader.master.commands.collect_commands(self.commands)
        self._undo_log_filter = config.keep_out_of_legacy_log_events()
        for spec in options.OPTIONS:
            loader.add_option(spec.name, spec.type, spec.default, spec.help,
                              choices=list(spec.choices) if spec.choices else None)
        # --set values of not-yet-registered options wait in `deferred`; mitmproxy applies ours
        # right after this hook. A typo there would be ignored for ever, and a value of the
        # wrong type would make mitmproxy drop the script without a word: check them first.
        # On a script reload such values come from a config file loaded while running (they
        # were said then, or the ticker has not seen them yet): said and dropped, the guard
        # goes on, as for a value refused later.
        deferred = getattr(loader.master.options, "deferred", {})
        if self._process.ran:
            self.drop_deferred_problems(deferred)
            return
        problems = options.deferred_problems({k: getattr(v, "val", v) for k, v in deferred.items()})
        for name, message in problems.items():
            deferred.pop(name, None)
            self._refuse(message)

    @staticmethod
    def drop_deferred_problems(deferred: dict) -> None:
        """A config file loaded into the running proxy (the console's ``options.load``)
        whose ``turnguard_*`` name is unknown (a typo) or whose value has the wrong type:
        mitmproxy keeps it aside in ``deferred`` without a word (it never applies it, and
        would hand it to the next script reload). Each is said in one error line naming it
        and dropped; the value in force is kept. (The ticker calls this every second.)"""
        if not any(name.startswith(options.PREFIX) for name in deferred):
            return
        problems = options.deferred_problems({k: getattr(v, "val", v) for k, v in deferred.items()})
        for name, message in problems.items():
            deferred.pop(name, None)
            logger.error("turnguard: %s; ignored, the value in force is kept", message)

    def configure(self, updated: set[str]) -> None:
        o = ctx.options
        if self.refused:  # turnguard is off: a bad option at start-up
            if not self._running:
                self._refuse_other_bad_values(o)
            return
        try:
            self.settings = options.settings_from({s.name: getattr(o, s.name) for s in options.OPTIONS})
            if "turnguard_filter" in updated:
                self.filter = config.parse_filter(o.turnguard_filter)
            ledger_changed = "turnguard_ledger" in updated or "confdir" in updated
            if ledger_changed:  # (the checks that touch nothing: before any file is opened)
                location = config.ledger_path(o.turnguard_ledger, o.confdir)
                self._check_ledger_change(location)
            # (while running) another events file, in use once the whole update is accepted
            events = self._events_named(o.turnguard_events) \
                if "turnguard_events" in updated else None
            accepted = False
            try:
                # (the metrics before the ledger: a port in use stops start-up)
                if "turnguard_metrics" in updated:
                    self.metrics_endpoint.configure(self.settings.metrics, o.turnguard_metrics)
                if ledger_changed:
                    # a refused path leaves the ledger in use; a fault at open is noted and the
                    # ledger tried again later
                    if self._running and self.store.path and location != self.store.path:
                        self._switch_ledger(location)
                    elif not (self._running and self.store.is_open
                              and location == self.store.path):
                        self.store.open(location, traffic_flows=self._process.ran)
                    # (else the ledger in use, set again: mitmproxy's roll-back of a refused
                    # change configures the old value again; closing and opening it would cost
                    # the event loop the owed writes' wait, and fail behind another's lock)
                accepted = True
            finally:
                if events is not None and accepted:
                    self._use_events_once_in_force(events)
                elif events is not None:  # refused: mitmproxy rolls it back, the file in force
                    events.discard()  # stays in use; the one named is left as it was
        except ValueError as e:  # (a PostgreSQL password in any option's value: ***)
            self._refuse(ledger_location.scrub_options(
                str(e), [getattr(o, s.name) for s in options.OPTIONS]))
            if not self._running:  # (start-up stops: every other bad option is said too)
                self._refuse_other_bad_values(o)
            return
        if self._running:
            self.attacher.start_relay_early()

    def _events_named(self, option: str) -> Telemetry | None:
        """The events file ``turnguard_events`` names, opened: None when it is the one in use
        (set again: mitmproxy's roll-back of a refused update configures it again, and it may
        no longer open, a symlink now) or already pending. A pending file the update no
        longer names is discarded (the roll-back of an update an addon after turnguard
        refused). At start-up, where nothing is rolled back, it is put in use at once (the
        ledger's opening records go there) and None returned."""
        path = config.events_path(option)
        pending = self._events_pending
        if pending is not None and pending.path != path:
            self._events_pending = None
            pending.discard()
        if path == self.telemetry.path or self._events_pending is not None:
            return None
        events = config.open_events(option)
        if self._running:
            return events
        self._use_events(events)
        return None

    def _use_events_once_in_force(self, telemetry: Telemetry) -> None:
        """An update that turnguard accepted while running named ``telemetry``'s events file:
        an addon that mitmproxy configures after turnguard (mitmdump's own dumper, another
        script) may still refuse it, and mitmproxy then rolls the update back, configuring the
        path in force again. So the file is put in use on the loop's next turn, once the update
        is over, and only if its path is still the option's value then (``_settle_events``)."""
        self._events_pending = telemetry
        try:
            asyncio.get_running_loop().call_soon(self._settle_events)
        except RuntimeError:  # (no loop: nothing configures after this; unit tests)
            self._settle_events()

    def _settle_events(self, *, unloading: bool = False) -> None:
        """Put the pending events file in use if the update that named it is in force, else
        discard it (``Telemetry.discard``: a file this opening made is removed if empty). An
        instance unloaded discards it, but for its own unload (``unloading``, from ``_close``,
        which closes the file in use right after): the update is in force, so its file is the
        one the exit writes to after a reload that failed (``_watch_exit``: what the next
        instance would have written, and that one opens the option's file)."""
        pending, self._events_pending = self._events_pending, None
        if pending is None:
            return
        try:
            if (unloading or not self._unloaded) \
                    and config.events_path(ctx.options.turnguard_events) == pending.path:
                self._use_events(pending)
            else:
                pending.discard()
        except Exception as e:  # (a callback of the loop's: said in one line)
            logger.error("turnguard: putting the events file named in use failed: %r", e)
            if self.telemetry is not pending:  # (not in use: its descriptor is not kept)
                pending.close()

    def _use_events(self, telemetry: Telemetry) -> None:
        """Records go to ``telemetry``'s events file from now on (the one in use closed), with
        the metrics and the counts they went to."""
        telemetry.sink = self.telemetry.sink
        telemetry.counts = self.telemetry.counts  # a new file: the counts go on
        self.telemetry.close()
        self.telemetry = telemetry

    def _switch_ledger(self, location: str) -> None:
        """Another ledger while running: one that cannot be opened (but for a lock) is
        refused, the one in use kept. (At start-up such a ledger is an outage, tried again
        every few seconds: the proxy starts; here a wrong path would swap a working ledger
        for decisions in memory only.)"""
        try:
            self.store.switch(location)
        except (LedgerError, OSError) as e:
            raise ValueError(f"turnguard_ledger={ledger_location.display(location)} is refused: "
                             f"it cannot be opened ({e}); the ledger in use"
                             f" ({self.store.location}) is kept") from None

    def _check_ledger_change(self, location: str) -> None:
        """Another ledger while this process runs turns or holds duplicates registered in the
        one in use is refused: their ends belong to that ledger (other processes sharing it
        hold their duplicates on them, and would answer 409 for as long as this process
        lives), and a held duplicate would be decided again from a ledger that never saw
        its original. Set it again once they have ended."""
        if not self._running or not self.store.path or location == self.store.path:
            return
        turns, held = len(self.inflight), len(self.waiters)
        if turns or held:
            raise ValueError(
                f"turnguard_ledger={ledger_location.display(location)} is refused for now: "
                f"{turns} turn(s) in flight and {held} duplicate(s) held on the ledger in use"
                f" ({self.store.location}) must end there first; set it again once they have"
                " ended (turnguard.status shows them)")

    def _refuse_other_bad_values(self, o) -> None:
        """At start-up, once a bad option has turned turnguard off (an unknown name, a value
        of the wrong type: said as the script loaded), the values mitmproxy then applies are
        still checked, so that one start names every bad option, not one per try. Only the
        checks that touch nothing (the numbers and choices, the filter, a ledger location
        given): no file is opened, no folder made."""
        values = [getattr(o, s.name) for s in options.OPTIONS]
        found = options.problems({s.name: getattr(o, s.name) for s in options.OPTIONS})
        checks = [lambda: config.parse_filter(o.turnguard_filter)]
        if o.turnguard_ledger:  # (the default one is a folder to make: it is checked at open)
            checks.append(lambda: config.ledger_path(o.turnguard_ledger, o.confdir))
        for check in checks:
            try:
                check()
            except ValueError as e:
                found.append(str(e))
        for message in found:
            message = ledger_location.scrub_options(message, values)
            if message not in self.refused:  # (configure runs more than once at start-up)
                self._refuse(message)

    def _refuse(self, message: str) -> None:
        """A bad option. While mitmproxy starts: one error line naming it, turnguard stays off
        and mitmproxy exits (an error logged during start-up stops it). Later (an option changed
        in mitmweb or the console, a config file loaded): ``OptionsError``, so mitmproxy keeps
        the previous value, and a warning line: whoever set it sees mitmproxy's error, but
        nothing else says it in the log (mitmdump has no other place to show it)."""
        if self._running:
            logger.warning("turnguard: %s; refused, the value in force is kept", message)
            raise exceptions.OptionsError(message)
        self.refused.append(message)
        logger.error("turnguard: %s; turnguard is not running", message)

    # -- lifecycle -------------------------------------------------------------------------------
    def running(self) -> None:
        self._running = True
        if not self.refused:
            self._process.ran = True
            self.attacher.start_relay_early()
            while self._process.unwritten:  # made while a reload left no instance loaded
                event, fields = self._process.unwritten.popleft()
                self._emit(event, **fields)  # (with the time it was made)
            self.inflight.end_those_ended_unseen()
            self.websockets.catch_up()  # the same, for the guarded WebSockets
            self.stop_kept_heartbeat()
            logger.info("turnguard: running (instance %s, recovery mode %s, ledger %s)",
                        self.instance_id, self.settings.recovery_mode, self.store.location)
        self.maintenance.running()

    def done(self) -> "asyncio.Future | None":
        """Unloaded (shutdown, or mitmproxy reloading the script): held flows wake at once
        rather than wait out their bound on an addon that no longer gets events. On a reload
        a held request (HTTP, or a WebSocket's call) is decided again by the instance loaded
        next (``HandedOver``); at shutdown, or with no instance to take it, it is let go
        (killed: its client retries). At shutdown the events file and the metrics close once
        the requests let go have recorded their end (a wait of at most ``SHUTDOWN_LET_GO_S``:
        the task returned, which mitmproxy awaits). Attempts in flight, writes owed to the
        ledger and what is known of it stay with the process: at shutdown the owed writes
        are tried as the ledger closes; on a reload the instance loaded next writes them (the
        event loop is not held for them)."""
        self._unloaded = True
        self.maintenance.done()
        self.waiters.release_all(UNLOADED)
        if self._holding and _shutting_down():
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # (no loop: nothing can run them)
                pass
            else:
                # the holds woken above end on the loop's next turns: their ends are recorded
                # (events file, metrics) before these close. mitmproxy awaits what its done
                # hook returns at shutdown (a task: it also runs if it is not awaited)
                self._none_holding = asyncio.Event()
                return asyncio.ensure_future(self._close_once_let_go(self._none_holding))
        self._close()

    async def _close_once_let_go(self, none_holding: asyncio.Event) -> None:
        """At shutdown: wait (bounded) for the held requests, which the unload let go, to
        record their end, then close."""
        try:
            await asyncio.wait_for(none_holding.wait(), SHUTDOWN_LET_GO_S)
        except TimeoutError:
            pass
        except Exception:
            logger.exception("turnguard: waiting for held requests to be let go failed")
        finally:
            self._close()

    def _close(self) -> None:
        self.metrics_endpoint.close()
        shutting_down = _shutting_down()
        if self.refused:
            if shutting_down:
                self._open_for_ends_owed()  # (written as its store closes, below)
        elif self.store.path:
            self._process.ledger = self.store.path
        # a script reload: the process lives on, its lease with it (its heartbeat is kept)
        kept = None if shutting_down else self.store.take_heartbeat()
        if kept is not None or shutting_down:
            self._process.keep_heartbeat(kept)
        self.store.close(write_owed=shutting_down, final=True)
        self.identifier.close()
        self._settle_events(unloading=True)  # (then closed below, as the file in use)
        self.telemetry.close()
        self._undo_log_filter()
        if self._process.guard is self:
            self._process.guard = None
        if not shutting_down:
            self._watch_exit()

    def _watch_exit(self) -> None:
        """A script reload unloaded this instance: should the process exit before another
        instance loads (the reload's script fails to load until then), this one records as it
        exits what the next instance would have: the turns' ends in the ledger
        (``_open_for_ends_owed``), the telemetry records made meanwhile and those ends' in
        its events file (``_reopen_events_for_unwritten``)."""
        should_exit = getattr(getattr(ctx, "master", None), "should_exit", None)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (no loop: unit tests)
            return
        if should_exit is None:
            return

        async def watch() -> None:
            try:
                await should_exit.wait()
            finally:  # (also when the loop's end cancels it, woken but not yet run)
                if should_exit.is_set():  # (not: an instance loaded, and cancelled it)
                    try:  # (its own step: the ledger's below goes on whatever it does)
                        self._reopen_events_for_unwritten()
                    except Exception:
                        logger.exception("turnguard: opening the events file at exit failed")
                    try:
                        self._process.keep_heartbeat(None)
                        self._open_for_ends_owed()
                        self.store.close(write_owed=True, final=True)
                    except Exception:
                        logger.exception("turnguard: writing the turns' ends at exit failed")
                    finally:
                        self.telemetry.close()

        self._process.exit_watch = loop.create_task(watch(), name="turnguard-exit-watch")

    def _reopen_events_for_unwritten(self) -> None:
        """At exit with no instance loaded since this one was unloaded: its events file is
        opened again for what the next instance would have written there, the records made
        meanwhile (``ProcessState.unwritten``: the holds the reload let go, say), written
        first, with the time each was made, then those the exit makes (the ends of the turns
        that ended meanwhile, ``_open_for_ends_owed``). The caller closes it. A file that
        can no longer be opened is said in the log, and the records go to the log only.
        (Nothing to write, nothing opened: an events file removed meanwhile is not made.)"""
        process = self._process
        if not (process.unwritten or process.attempts or process.sockets):
            return
        try:
            telemetry = config.open_events(self.telemetry.path or "")
        except ValueError as e:
            logger.warning("turnguard: %s; the records made while no instance was loaded go "
                           "to the log only", e)
            telemetry = config.telemetry()
        telemetry.counts = self.telemetry.counts  # (the process's)
        self.telemetry = telemetry
        while self._process.unwritten:
            event, fields = self._process.unwritten.popleft()
            telemetry.emit(event, **fields)  # (with the time it was made)

    def _open_for_ends_owed(self) -> None:
        """The process exits while no instance runs turnguard: none loaded since a script
        reload (its script failed to load: the instance it unloaded does this, ``_watch_exit``)
        or the one loaded refused an option (it does this as it closes). The ledger the last
        instance that ran used is opened, and the HTTP turns that ended meanwhile with their
        hooks reaching no instance are ended, so that their ends and the writes owed (ends
        kept, the refused instance's among them) are written as the store closes, as any
        instance's writes owed are at shutdown (``FailoverStore.close``; a lock held by
        another connection is waited for, the opening included, up to ``CLOSE_WRITES_S``:
        ``FailoverStore.open_to_write_owed``). Left unwritten, a peer reaps the process once
        it is gone and runs a completed turn again. The guarded WebSockets are brought up to
        date the same way (``WebSockets.catch_up``: a call that ended unseen is recorded as it
        ended), with this instance as the one they report to meanwhile."""
        path = self._process.ledger
        if self.store.is_open or not path \
                or not (self._process.attempts or self._process.kept_writes):
            return
        logger.info("turnguard: exiting while no instance runs; writing the ends of its turns "
                    "to ledger %s", ledger_location.display(path))
        if not self.store.open_to_write_owed(path):  # (a lock waited for, as at any close)
            logger.warning("turnguard: exiting without writing the ends of its turns to ledger "
                           "%s (%s); a process that reaps this one's attempts takes them as "
                           "unfinished", ledger_location.display(path), self.store.error)
            return
        self.inflight.end_those_ended_unseen()
        loaded, self._process.guard = self._process.guard, self
        try:
            self.websockets.catch_up()
        finally:
            self._process.guard = loaded

    def stop_kept_heartbeat(self) -> None:
        """Stop the heartbeat a script reload kept from the instance it unloaded, once this
        instance's ledger renews the lease itself (at ``running``, or at the tick that opens
        a ledger that could not be opened at once)."""
        if self.store.beating:
            self._process.keep_heartbeat(None)

    # -- the guard -------------------------------------------------------------------------------
    def _filter_matches(self, flow: http.HTTPFlow) -> bool:
        """``turnguard_filter`` on ``flow``. One that fails on it (it should not: one that
        nests too deep is refused) lets the flow go by unguarded, said in a ``passthrough``
        record, never an exception out of a hook."""
        try:
            return bool(self.filter(flow))
        except Exception as e:
            self._emit("passthrough", flow=flow.id, reason=f"turnguard_filter failed: {e!r}")
            return False

    async def request(self, flow: http.HTTPFlow) -> None:
        setattr(flow, REQUEST_SEEN, True)
        if self.refused or self.filter is None or flow.response is not None or not flow.live \
                or not self._filter_matches(flow):
            return  # (not live: a flow read from a file, ``mitmdump -nr`` or opened in
            # mitmweb, whose hooks run with nothing sent: no dispatch, attempt or answer)
        if flow.id in self._process.detached:
            return  # turnguard's own upstream call of a detached dispatch, running now (its
            # metadata says "detached" for good, and so does its client flow's: a replay of
            # either in mitmweb, the same flow sent again, is guarded as any request)
        self.maintenance.ensure_running()
        try:
            await self._guard(flow)
        except Exception as e:  # never break traffic: the flow goes on as a plain proxy's would
            logger.exception("turnguard: request hook failed; forwarding %s unguarded", flow.id)
            self._emit("passthrough", flow=flow.id, reason=f"internal error: {e!r}",
                       transport="http")

    async def _guard(self, flow: http.HTTPFlow, budget_deadline: float | None = None,
                     resume: machine.State | None = None) -> None:
        """What happens to a guarded request: identify it, run the machine, do what it ends in.
        When it began in an instance unloaded since: ``budget_deadline``, the end of its
        budget; ``resume``, the machine's state to go on from."""
        cfg = self.settings
        if budget_deadline is None:
            budget_deadline = time.monotonic() + cfg.request_budget_s
        try:
            ident = await self.identifier.identify(
                flow, max(0.0, budget_deadline - time.monotonic()), cfg.credential_headers)
        except WorkerStopped:  # a script reload while its body was identified off the loop
            successor = self._process.guard
            if successor is not None and successor is not self and not successor.refused:
                logger.info("turnguard: reloaded while %s was identified; the addon loaded "
                            "now decides it", flow.id)
                return await successor._guard(flow, budget_deadline)  # what is left of it
            ident = identity.Passthrough("turnguard unloaded while identifying the request")
        if isinstance(ident, identity.Passthrough):
            self._emit("passthrough", flow=flow.id, reason=ident.reason, transport="http")
            return
        req = await self.request_facts(ident, flow.id, budget_deadline,
                                       accepts_sse=flows.accepts_sse(flow))
        scope = circuit.circuit_scope(ident.session, ident.scope, ident.route)
        try:
            state = await self.decide(flow, ident, req, flow.request.method, scope, resume)
        except HandedOver as handed:
            logger.info("turnguard: reloaded while %s was held; the addon loaded now decides "
                        "it", flow.id)
            return await handed.successor._guard(flow, handed.budget_deadline, handed.resume)
        match state:
            case machine.Forward():
                flows.give_body_a_length(flow)
                if not await self.attacher.dispatch_detached(flow, ident, req, state.dispatch,
                                                             scope):
                    self.inflight.start(flow, ident, state.dispatch, scope)
            case machine.Replay():
                await self.replayer.replay(flow, ident, state)
            case machine.Attach():
                await self.attacher.attach(flow, ident, state)
            case machine.Respond():
                flows.answer(flow, state.answer)
            case machine.Abandon():
                if flow.killable:  # never dispatch it
                    flow.kill()
                # (once its wait is gone: a detached call it kept past the cap is cut now)
                asyncio.get_running_loop().call_soon(self.detacher.enforce_cap)
            case machine.PassThrough():
                pass  # forwarded untouched
            case _:
                assert_never(state)

    async def request_facts(self, ident: identity.Identity, key: str, budget_deadline: float,
                            *, accepts_sse: bool, turn_anchor: bool | None = None,
                            transport: str = "http") -> machine.RequestFacts:
        """What the machine knows of a request (``key``: its flow, or its call on a socket).
        ``turn_anchor``: whether it is anchored to a turn (None: it carries
        ``x-codex-turn-state``)."""
        cfg = self.settings
        owner = await self.sessions.ownership(ident.session, lease_s=cfg.owner_lease_s,
                                              deadline=_ledger_deadline(budget_deadline))
        anchored = ident.turn_state is not None if turn_anchor is None else turn_anchor
        return machine.RequestFacts(
            ident.op_id, ident.op_key, key, ident.session, anchored,
            ident.previous_response_id is not None, accepts_sse, budget_deadline,
            cfg.hold_timeout_s, cfg.recovery_mode, cfg.circuit.threshold, owner, transport)

    async def decide(self, flow: http.HTTPFlow, ident: identity.Identity,
                     req: machine.RequestFacts, method: str, scope: str,
                     resume: machine.State | None = None) -> machine.Terminal:
        """The request loop: do what each state asks, feed the result to the machine, show
        its effects, until a state the transport acts on (exactly one of: dispatch, replay,
        answer, abandon, pass through). ``resume``: the state to begin from (a request handed
        over by a script reload), else the machine's start."""
        state: machine.State = machine.start() if resume is None else resume

        def retired() -> None:
            # a ledger call of ``state`` that the unload closed (its catch-up spanned the
            # reload): the instance loaded now asks its ledger, not this one's memory
            self._hand_over_if_reloaded(req, state)

        while True:
            deadline, now = _ledger_deadline(req.budget_deadline), time.monotonic
            if self._unloaded and isinstance(state, _ASKS):  # (a reload while it was decided)
                self._hand_over_if_reloaded(req, state)
            match state:
                case machine.Admit():
                    admission = await self._admit(method, ident, req, scope, state, deadline,
                                                  retired)
                    state, effects = machine.on_admission(req, state, admission, now(),
                                                          ledger_down=self.store.down_reason())
                case machine.HoldDuplicate() | machine.WaitCooldown():
                    self._holding += 1
                    try:
                        woke = await self._wait(flow, ident, req.flow_id, state)
                        if isinstance(state, machine.HoldDuplicate):
                            woke = await self._answer_waited_for(ident, req, state, woke)
                        if isinstance(woke, machine.Gone) and woke.reason == UNLOADED:
                            self._hand_over_if_reloaded(req, state)
                        gone = (await self.clients.settled_gone(flow)
                                if isinstance(state, machine.WaitCooldown)
                                else self.clients.gone(flow))
                        state, effects = machine.on_woke(req, state, woke, now(), gone=gone)
                        self._apply(flow, effects)  # (a shutdown waits for what it records)
                        continue
                    finally:
                        self._holding -= 1
                        if not self._holding and self._none_holding is not None:
                            self._none_holding.set()
                case machine.FetchRecording():
                    recording, readable = await self.store.recording(
                        ident, state.attempt_id, window_s=self._replay_window_s(ident),
                        deadline=deadline, on_retired=retired)
                    state, effects = machine.on_recording(req, state, recording, readable=readable)
                case machine.FailClosed():
                    remaining = await self.store.circuit_remaining(scope, deadline=deadline,
                                                                   on_retired=retired)
                    state, effects = machine.fail_closed(req, state, remaining)
                case (machine.Forward() | machine.Replay() | machine.Attach() | machine.Respond()
                      | machine.Abandon() | machine.PassThrough()):
                    return state
                case _:
                    assert_never(state)
            self._apply(flow, effects)

    def _hand_over_if_reloaded(self, req: machine.RequestFacts, state: machine.State) -> None:
        """Raise ``HandedOver`` when this instance was unloaded while it decided a request
        (over HTTP, or a call on a WebSocket) and a script reload has loaded the instance
        that takes it: its unload woke it from a hold, or a wait ended (or the ledger
        answered) in the turn of the event loop that reloaded the script, or its ledger call
        (an admission, a recording's read, a circuit's cooldown) went unread because the
        unload closed this instance's ledger while the call waited for it (for a catch-up of
        the writes owed): the new instance asks its own ledger rather than this one's memory
        deciding it as in an outage (a duplicate of a turn another process has in flight was
        dispatched again). This instance's ledger is closed and nothing wakes its holds any
        more: the new one goes on from ``state``, within what was left of the budget. A
        held duplicate keeps its hold (admitted again, as when the attempt it waited for
        ends without a recording), so a reload never lengthens a wait; a request held
        through a cooldown goes on waiting for what was left of it (one wait, one
        ``wait_finished``). With no instance to take it (shutdown, a reload to a copy that
        fails to load), or one that refused its options, it stays here (decided from memory
        when its ledger call went unread)."""
        if not self._unloaded:
            return
        successor = self._process.guard
        if successor is None or successor is self or successor.refused:
            return
        resume = state
        if isinstance(state, machine.WaitCooldown):  # the same wait, for what is left of it
            left_s = max(0.0, state.since + state.wait_s - time.monotonic())
            resume = machine.WaitCooldown(left_s, state.epoch, state.since)
        elif isinstance(state, machine.HoldDuplicate):
            resume = machine.Admit(state.recovery, state.held_since, state.deadline,
                                   state.as_duplicate, state.after_turn_ended)
        raise HandedOver(successor, req.budget_deadline, resume)

    async def _wait(self, flow: http.HTTPFlow, ident: identity.Identity, key: str,
                    state: machine.HoldDuplicate | machine.WaitCooldown) -> machine.Woke:
        if isinstance(state, machine.WaitCooldown):
            return await self.waiters.cooldown(flow, key, ident.op_key, ident.session,
                                               state.epoch, state.wait_s)
        # an attempt of another process is notified (PostgreSQL) or polled for; this
        # process's wakes its waiters, and its response, once it streams, can be attached to
        local = self.inflight.of_operation(ident.op_key)
        if local is not None:
            self.detacher.wanted(local.flow_id)
        if local is not None and local.live is not None and local.live.started \
                and await self.attacher.ready_to_attach(flow, local.live):
            return machine.Attachable(local.live)
        foreign = None if local is not None else (state.attempt_id or 0)
        # held for the peers to register in a new ledger (``request_held``), no attempt seen:
        # admitted again at least every ``PEERS_RECHECK_S``, since nothing may notify this
        # request when that wait ends (on PostgreSQL no poll runs for it, and an end notified
        # while it still waited for the peers was spent on an admission that held it again);
        # also a duplicate's hold that is now such a wait (the attempt it was held on was in
        # a ledger since made again)
        recheck = local is None and (not state.as_duplicate or state.attempt_id is None)
        while True:  # bounded by the hold's deadline
            left = state.deadline - time.monotonic()
            woke = await self.waiters.duplicate(flow, key, ident.op_key, foreign,
                                                min(left, PEERS_RECHECK_S) if recheck else left,
                                                self.store.generation)
            if recheck and isinstance(woke, machine.TimedOut) \
                    and time.monotonic() < state.deadline:
                return machine.Ended("unknown")  # admitted again
            if not isinstance(woke, machine.Attachable) \
                    or await self.attacher.ready_to_attach(flow, woke.live):
                return woke
            if woke.live.end is not None or not self.inflight.is_local(ident.op_key):
                return machine.Ended("unknown")  # it ended meanwhile: admitted again

    async def _answer_waited_for(self, ident: identity.Identity, req: machine.RequestFacts,
                                 state: machine.HoldDuplicate, woke: machine.Woke
                                 ) -> machine.Woke:
        """A duplicate held on another process's attempt that ended ``completed`` gets that
        attempt's recording (read by its id), as one held on an attempt of this process does:
        the answer it waited for, whatever the clocks say. Admitted again instead, it would be
        judged by the replay window, the attempt's end time (the other process's wall clock)
        against this process's wall clock: a clock stepped forward here, or running ahead of
        the other host's, would take the end of a moment ago for one past the window and
        dispatch the operation again. Anything else (not completed, no recording, the ledger
        unreadable, replay off) is admitted again, as before."""
        if not (isinstance(woke, machine.Ended) and woke.recording is None
                and woke.outcome == "completed" and state.attempt_id
                and self._replay_window_s(ident) is not None):
            return woke
        recording, _ = await self.store.recording(
            ident, state.attempt_id, window_s=self._replay_window_s(ident),
            deadline=_ledger_deadline(req.budget_deadline))
        return woke if recording is None else machine.Ended(woke.outcome, recording)

    def _apply(self, flow: http.HTTPFlow, effects: tuple[machine.Effect, ...]) -> None:
        for effect in effects:
            match effect:
                case machine.Emit(event=event, fields=fields):
                    self._emit(event, **fields)
                case machine.Show(mark=mark, comment=comment):
                    self.explainer.show(flow, mark, comment)
                case machine.CountHeld(op_key=op_key):
                    self.store.note_duplicates(op_key, held=1)

    def _replay_window_s(self, ident: identity.Identity) -> float | None:
        """How long after its end a recording of this request may be replayed (None: never)."""
        return policy.replay_window_s(self.settings.guard,
                                      idempotency_key=ident.idempotency_key is not None)

    async def _admit(self, method: str, ident: identity.Identity, req: machine.RequestFacts,
                     scope: str, state: machine.Admit, deadline: float,
                     retired: Callable[[], None] | None = None):
        local = self.inflight.of_operation(ident.op_key)
        if local is not None:  # this process's attempt is in flight: hold, no ledger needed
            if local.ident.fingerprint != ident.fingerprint:  # its Idempotency-Key, another body
                return policy.Conflict()
            return policy.Hold(local.attempt_id, self.instance_id)
        cfg = self.settings
        hold_until = state.hold_deadline if state.held_since is not None else \
            policy.hold_deadline(time.monotonic(), hold_timeout_s=req.hold_timeout_s,
                                 budget_deadline=req.budget_deadline)
        guard, window_s = policy.admission_replay(
            cfg.guard, idempotency_key=ident.idempotency_key is not None,
            conversation=bool(ident.conversation), held=state.held_before_turn_ended)
        return await self.store.admit(
            ident, method=method, route=ident.route, flow_id=req.flow_id,
            circuit_scope=scope, recovery=state.recovery,
            once_mode=policy.recovery_is_once(cfg.recovery_mode),
            in_flight_here=lambda: self.inflight.is_local(ident.op_key), guard=guard,
            window_s=window_s, threshold=cfg.circuit.threshold,
            deadline=deadline, transport=req.transport, hold_until=hold_until,
            on_retired=retired)

    # -- the original's response -----------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        try:
            self._say_request_unguarded(flow)
            if not self.attacher.responseheaders(flow):
                self.inflight.tee_response(flow)
        except Exception:
            logger.exception("turnguard: responseheaders hook failed for %s", flow.id)

    def response(self, flow: http.HTTPFlow) -> None:
        try:
            self._say_request_unguarded(flow)
        except Exception:
            logger.exception("turnguard: response hook failed for %s", flow.id)
        self.inflight.end(flow, body_complete=True)
        if flow.response.status_code == 101 and flow.websocket is None:
            try:
                self._say_websocket_unguarded(flow)
            except Exception:
                logger.exception("turnguard: response hook failed for %s", flow.id)

    def _say_request_unguarded(self, flow: http.HTTPFlow) -> None:
        """A request whose ``request`` hook never reached turnguard: an addon that runs
        before it raised ``AddonHalt`` there (mitmproxy's way to say no later addon handles
        the event), or answered it earlier. It went by unguarded (nothing held, claimed or
        recorded); a flow ``turnguard_filter`` matches is named in one ``passthrough`` record
        (at its first hook that can tell: ``responseheaders``, ``response``, or ``error``
        once a response came), so that it is said, not silent. A WebSocket upgrade is not a
        call (its socket is guarded from ``websocket_start``)."""
        if getattr(flow, REQUEST_SEEN, False) or self.refused or self.filter is None \
                or not flow.live or flow.websocket is not None or flow.response is None \
                or flow.response.status_code == 101:
            return
        setattr(flow, REQUEST_SEEN, True)  # (said once)
        if self.filter(flow):
            self._emit("passthrough", flow=flow.id, transport="http", reason=REQUEST_HALTED)

    def _say_websocket_unguarded(self, flow: http.HTTPFlow) -> None:
        """A WebSocket upgrade that succeeded while mitmproxy's ``websocket`` option is off:
        mitmproxy relays the socket as raw TCP, so turnguard sees none of its calls (the Codex
        CLI's transport). It passes untouched, as through a plain mitmproxy; a socket that
        ``turnguard_filter`` would guard is named in a ``passthrough`` record, so that its
        calls going unguarded is said, not silent."""
        if self.refused or self.filter is None or not flow.live or ctx.options.websocket:
            return
        if flow.response.headers.get("upgrade", "").lower() != "websocket":
            return
        probe = flow.copy()  # (as mitmproxy would have made it: a WebSocket flow)
        probe.websocket = WebSocketData()
        if self._filter_matches(probe):
            self._emit("passthrough", flow=flow.id, transport="ws", reason=WEBSOCKET_OFF)

    async def error(self, flow: http.HTTPFlow) -> None:
        """A failed attempt is recorded before the client hears of the failure (a bounded
        wait): a retry it sends at once, through any process sharing the ledger, then sees
        the failure and the circuit it fed."""
        try:
            self._say_request_unguarded(flow)
            self.attacher.error(flow)
        except Exception:
            logger.exception("turnguard: error hook failed for %s", flow.id)
        recorded = self.inflight.end(flow, body_complete=False)
        if recorded is not None:
            await asyncio.wait([recorded], timeout=ERROR_RECORD_WAIT_S)

    # -- Responses over WebSocket (turnguard_shell.websocket) --------------------------------------
    def websocket_start(self, flow: http.HTTPFlow) -> None:
        if self.refused or self.filter is None or not flow.live or not self._filter_matches(flow):
            return  # (not live: a socket read from a file, its messages replayed to the hooks)
        try:
            self.maintenance.ensure_running()
            self.websockets.start(flow)
        except Exception as e:
            logger.exception("turnguard: websocket_start failed; %s is not guarded", flow.id)
            self._emit("passthrough", flow=flow.id, transport="ws", reason=f"internal error: {e!r}")

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        try:
            self.websockets.message(flow)
        except Exception:
            logger.exception("turnguard: websocket_message failed for %s", flow.id)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        try:
            self.websockets.end(flow)
        except Exception:
            logger.exception("turnguard: websocket_end failed for %s", flow.id)

    @property
    def update(self):
        """mitmproxy's ``update`` hook, only while a flow is held (None: no hook). mitmproxy
        looks a hook up on every event, and fires ``update`` after each of a flow's hooks:
        four calls per request for nothing when no flow waits."""
        return self._update if len(self.waiters) else None

    def _update(self, flows_) -> None:
        """A flow was changed elsewhere (e.g. killed with the flow.kill command): wake it if held."""
        for f in flows_:
            if flows.killed(f):  # (not an error another addon only notes on a live flow)
                self.waiters.gone(f.id, "killed")


addons = [TurnGuard()]
