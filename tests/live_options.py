"""A test addon for a real mitmdump: ``POST /__set`` with a JSON list of ``name=value`` specs
sets mitmproxy options while it runs (what mitmweb's options editor or the console's ``:set``
do): 200 ``ok``, or 400 with the ``OptionsError`` mitmproxy raised (the old values kept).
``POST /__load`` with a file's path runs mitmproxy's ``options.load`` command on it (what the
console's ``:options.load ~/.mitmproxy/config.yaml`` does): 200 ``ok``, or 400 with the
``CommandError`` it raised. ``POST /__set_then_reload`` sets the options as ``/__set`` does,
then reloads turnguard's script in the same turn of the event loop (mitmproxy's own
``Script.loadscript``, what its watcher calls when the file changed): a reload that lands
right after an update, which touching the script cannot time (mitmproxy looks at its mtime
once a second)."""

import json

from mitmproxy import ctx, exceptions, http


def _turnguard_script():
    """mitmproxy's ``Script`` addon that loaded turnguard (its namespace has ``TurnGuard``)."""
    for addon in ctx.master.addons.chain:
        for script in getattr(addon, "addons", None) or []:
            if hasattr(script, "loadscript") and hasattr(script.ns, "TurnGuard"):
                return script
    raise RuntimeError("live_options: turnguard's script is not loaded")


class LiveOptions:
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.method != "POST" \
                or flow.request.path not in ("/__set", "/__load", "/__set_then_reload"):
            return
        try:
            if flow.request.path == "/__load":
                ctx.master.commands.call_strings("options.load", [flow.request.get_text()])
            elif flow.request.path == "/__set":
                ctx.options.set(*json.loads(flow.request.get_text()))
            else:
                script = _turnguard_script()
                ctx.options.set(*json.loads(flow.request.get_text()))
                script.loadscript()
        except (exceptions.OptionsError, exceptions.CommandError) as e:
            flow.response = http.Response.make(400, json.dumps({"error": str(e)}))
        else:
            flow.response = http.Response.make(200, b"ok")


addons = [LiveOptions()]
