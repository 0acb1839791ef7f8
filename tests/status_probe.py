"""A test addon for a real mitmdump: ``GET /__status`` answers with what the
``turnguard.status`` command returns (JSON), so an end-to-end test can read the counts of the
running process's in-memory state (the console's ``:turnguard.status``, from outside)."""

from mitmproxy import ctx, http


class StatusProbe:
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.path != "/__status" or flow.request.method != "GET":
            return
        text = ctx.master.commands.call("turnguard.status")
        flow.response = http.Response.make(200, text, {"content-type": "application/json"})


addons = [StatusProbe()]
