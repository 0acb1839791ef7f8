"""The Prometheus endpoint of ``turnguard_metrics`` (see ``turnguard_core.metrics``).

Counters and histograms are derived from the telemetry records (the ``Telemetry`` sink); the
gauges are read from the addon's state when Prometheus scrapes, on the metrics server's thread:
only plain reads and copies, retried if the event loop changed a table meanwhile.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .waiters import CooldownWait, DuplicateWait

if TYPE_CHECKING:
    from turnguard import TurnGuard
    from turnguard_core.metrics import GaugeState, Metrics

logger = logging.getLogger("turnguard")


class MetricsEndpoint:
    def __init__(self, guard: "TurnGuard"):
        self._guard = guard
        self._metrics: Metrics | None = None
        self._serving: tuple[str, int] | None = None  # the address asked for

    @property
    def metrics(self) -> "Metrics | None":
        """The metrics being served (their ``address`` is the one bound), or None: off."""
        return self._metrics

    def configure(self, address: tuple[str, int] | None, shown: str) -> None:
        """Serve on ``address`` (None: stop). The new address is bound before the old one is
        let go, so a refused address keeps the old one. Raises ``ValueError`` (the line a
        user sees) when it cannot be bound."""
        g = self._guard
        if address == self._serving:
            return
        if address is None:
            self.close()
            return
        if self._metrics is None:
            kept = g._process.metrics  # a script reload: the process's counters go on
            if kept is not None:
                kept.watch(self._gauges)
                self._metrics = kept
            else:
                # imported when wanted: the client library costs ~50 ms at every start-up
                from turnguard_core.metrics import Metrics

                self._metrics = g._process.metrics = Metrics(g.instance_id, self._gauges)
        try:
            host, port = self._metrics.serve(*address)  # the same registry: the counters go on
        except OSError as e:
            raise ValueError(f"turnguard_metrics={shown!r}: cannot serve metrics there: "
                             f"{e.strerror or e}") from None
        self._serving = address
        g.telemetry.sink = self._metrics.observe
        logger.info("turnguard: metrics at http://%s:%d/metrics",
                    f"[{host}]" if ":" in host else host, port)

    def close(self) -> None:
        """Stop serving (frees the address: a reloaded script binds it again). The counters
        stay with the process (``ProcessState.metrics``), and go on counting this
        instance's records: served again, they agree with the events file."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._serving = None

    def _gauges(self) -> "GaugeState":
        from turnguard_core.metrics import GaugeState

        g = self._guard
        for _ in range(5):  # the event loop may change a table while this thread copies it
            try:
                held = list(g.waiters)
                open_until = tuple(s.open_until for s in list(g.store.memory.circuits.values())
                                   if s.open_until is not None)
                break
            except RuntimeError:
                continue
        else:
            held, open_until = [], ()
        return GaugeState(
            held_duplicates=sum(isinstance(w, DuplicateWait) for w in held),
            held_through_cooldown=sum(isinstance(w, CooldownWait) for w in held),
            attempts_in_flight=len(g.inflight),
            circuits_open_until=open_until,
            owned_sessions=len(g.sessions),
            ledger_up=g.store.is_open and g.store.error is None,
            recovery_mode=g.settings.recovery_mode,
        )
