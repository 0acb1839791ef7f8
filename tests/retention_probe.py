"""A test addon for a real mitmdump, loaded after turnguard: at each flow's ``response``,
``error`` and ``websocket_end`` hook (turnguard's has run: its attempt, or its socket, has
ended) it looks whether the flow can still be reached
from the turnguard addon's own objects, and says so in one log line
(``retention_probe: <flow id> kept by turnguard`` or ``... let go``).

A flow turnguard keeps after its attempt ended outlives the garbage collector's young
generations with all its objects (request, response, headers, tee), so that only the
collector's full passes, the slowest, ever free them: every request then costs the whole
process more, and a held flow's memory is kept for nothing.

The walk follows turnguard's objects and Python's containers, functions' closures and bound
methods' owners, never a module's globals, an event loop or mitmproxy's objects (from those
everything is reachable): what it finds, turnguard itself refers to."""

import collections
import gc
import logging
import types

from mitmproxy import ctx, http

logger = logging.getLogger("retention_probe")

_CONTAINERS = (dict, list, tuple, set, frozenset, collections.deque, types.CellType)
_STEPS = 200_000  # a bound on the walk


def _ours(obj) -> bool:
    # (mitmproxy loads the script as ``__mitmproxy_script__.turnguard``)
    return "turnguard" in type(obj).__module__


def _next(obj):
    if isinstance(obj, types.FunctionType):
        return [*(obj.__closure__ or ()), *(obj.__defaults__ or ())]
    if isinstance(obj, types.MethodType):
        return [obj.__self__] if _ours(obj.__self__) else []
    if isinstance(obj, _CONTAINERS) or _ours(obj):
        if isinstance(obj, dict) and "__builtins__" in obj:
            return []  # a module's globals
        return gc.get_referents(obj)
    return []


def reaches(root, target) -> bool:
    seen, todo, steps = {id(root)}, [root], 0
    while todo and steps < _STEPS:
        steps += 1
        for ref in _next(todo.pop()):
            if ref is target:
                return True
            if id(ref) not in seen and (isinstance(ref, (_CONTAINERS, types.FunctionType,
                                                          types.MethodType)) or _ours(ref)):
                seen.add(id(ref))
                todo.append(ref)
    return False


class RetentionProbe:
    def response(self, flow: http.HTTPFlow) -> None:
        guard = ctx.master.addons.get("turnguard")
        kept = guard is not None and reaches(guard, flow)
        logger.info("retention_probe: %s %s", flow.id, "kept by turnguard" if kept else "let go")

    def error(self, flow: http.HTTPFlow) -> None:
        self.response(flow)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self.response(flow)


addons = [RetentionProbe()]
