"""turnguard's imperative shell: the parts of the addon that hold state, wait and speak
mitmproxy, around the pure core (``turnguard_core``).

- ``process``: what outlives a script reload (the instance, its attempts in flight, writes owed);
- ``flows``: everything that reads or changes an HTTP flow (request view, answers, marks);
- ``inflight``: this process's attempts in flight (by flow and by operation), their tee,
  timer and end;
- ``waiters``: requests held (a duplicate, or through a cooldown), and the one place that wakes
  them;
- ``sessions``: this process's durable-session ownership, claims and lease renewal;
- ``maintenance``: the ticker (reap, garbage collection, polling other processes' attempts,
  renewing held sessions, bringing a failed ledger back), run from ``TurnGuard``'s
  ``running`` and ``done`` hooks;
- ``commands``: ``turnguard.status``, ``turnguard.held`` and the control commands, registered
  by ``TurnGuard`` at load.
"""
