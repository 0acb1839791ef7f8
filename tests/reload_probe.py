"""A test addon for a real mitmdump: reloads turnguard's script at the one moment an
end-to-end test cannot reach by itself, a request's ledger call waiting for a catch-up of the
ledger under way (the writes owed being written: ``FailoverStore.recover``, one at a time).
A request waits there at most 0.5 s, and mitmproxy looks at a script's mtime once a second,
so touching the script cannot land in that wait; this probe makes the reload itself there.

The reload is mitmproxy's own: ``Script.loadscript`` of turnguard's script, what mitmproxy's
watcher calls when the file changed (the old instance's ``done``, then the new one's
``load``, ``configure`` and ``running``), run on the event loop's next turn, once the
request's call is waiting. It is armed by the file ``reload-when-waiting`` in the folder
``$TURNGUARD_TEST_RELOAD_PROBE`` (used once: the file is removed); the file's text, if any,
is a path removed right after the reload (a ``write_gate.py`` gate's ``closed``: the writes
owed then land at once, for the instance loaded now). Said in one log line
(``reload_probe: ...``). Load it after turnguard's script (``-s``): it patches the store
class turnguard imported."""

import asyncio
import logging
import os
from pathlib import Path

from mitmproxy import ctx

from turnguard_core import failover

logger = logging.getLogger("reload_probe")
FOLDER = Path(os.environ["TURNGUARD_TEST_RELOAD_PROBE"])
ARMED = FOLDER / "reload-when-waiting"

_recover = failover.FailoverStore.recover


def _turnguard_script():
    """mitmproxy's ``Script`` addon that loaded turnguard (its namespace has ``TurnGuard``)."""
    for addon in ctx.master.addons.chain:
        for script in getattr(addon, "addons", None) or []:
            if hasattr(script, "loadscript") and hasattr(script.ns, "TurnGuard"):
                return script
    raise RuntimeError("reload_probe: turnguard's script is not loaded")


def _reload(then_remove: str) -> None:
    _turnguard_script().loadscript()
    logger.info("reload_probe: script reloaded")
    if then_remove:
        Path(then_remove).unlink(missing_ok=True)
        logger.info("reload_probe: removed %s", then_remove)


async def recover(self, deadline):
    if deadline is not None and self._recovering.locked() and ARMED.exists():
        then_remove = ARMED.read_text().strip()
        ARMED.unlink()
        logger.info("reload_probe: a request's ledger call waits for the catch-up under way; "
                    "reloading turnguard's script")
        asyncio.get_running_loop().call_soon(_reload, then_remove)
    return await _recover(self, deadline)


failover.FailoverStore.recover = recover

addons: list = []
