"""A test addon for a real mitmdump: ``POST /__command`` with a JSON list ``[name, *args]``
runs that mitmproxy command (what the console's ``:`` or mitmweb's command bar do): 200 with
what it returned, or 400 with the ``CommandError`` it raised."""

import json

from mitmproxy import ctx, exceptions, http


class CommandProbe:
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.path != "/__command" or flow.request.method != "POST":
            return
        name, *args = json.loads(flow.request.get_text())
        try:
            text = ctx.master.commands.call(name, *args)
        except exceptions.CommandError as e:
            flow.response = http.Response.make(400, json.dumps({"error": str(e)}))
        else:
            flow.response = http.Response.make(200, str(text))


addons = [CommandProbe()]
