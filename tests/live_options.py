"""A test addon for a real mitmdump: ``POST /__set`` with a JSON list of ``name=value`` specs
sets mitmproxy options while it runs (what mitmweb's options editor or the console's ``:set``
do): 200 ``ok``, or 400 with the ``OptionsError`` mitmproxy raised (the old values kept).
``POST /__load`` with a file's path runs mitmproxy's ``options.load`` command on it (what the
console's ``:options.load ~/.mitmproxy/config.yaml`` does): 200 ``ok``, or 400 with the
``CommandError`` it raised."""

import json

from mitmproxy import ctx, exceptions, http


class LiveOptions:
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.method != "POST" or flow.request.path not in ("/__set", "/__load"):
            return
        try:
            if flow.request.path == "/__set":
                ctx.options.set(*json.loads(flow.request.get_text()))
            else:
                ctx.master.commands.call_strings("options.load", [flow.request.get_text()])
        except (exceptions.OptionsError, exceptions.CommandError) as e:
            flow.response = http.Response.make(400, json.dumps({"error": str(e)}))
        else:
            flow.response = http.Response.make(200, b"ok")


addons = [LiveOptions()]
