"""A test addon for a real mitmdump: ``POST /__set`` with a JSON list of ``name=value`` specs
sets mitmproxy options while it runs (what mitmweb's options editor or the console's ``:set``
do): 200 ``ok``, or 400 with the ``OptionsError`` mitmproxy raised (the old values kept)."""

import json

from mitmproxy import ctx, exceptions, http


class LiveOptions:
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.path != "/__set" or flow.request.method != "POST":
            return
        try:
            ctx.options.set(*json.loads(flow.request.get_text()))
        except exceptions.OptionsError as e:
            flow.response = http.Response.make(400, json.dumps({"error": str(e)}))
        else:
            flow.response = http.Response.make(200, b"ok")


addons = [LiveOptions()]
