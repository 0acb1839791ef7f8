"""The benchmark's ``floor`` variant: the least any addon that streams SSE must do.

A no-op mitmproxy addon that only streams event-stream responses (``flow.response.stream =
True`` in ``responseheaders``), as turnguard must for a live stream. Whatever a streaming addon
costs mitmproxy (loading a script, a hook call per flow, streaming instead of buffering) shows
in this variant; how far turnguard is above it is turnguard's own cost.
"""

from mitmproxy import http


class Floor:
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
            flow.response.stream = True


addons = [Floor()]
