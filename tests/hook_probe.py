"""A test addon for a real mitmdump: each flow's ``responseheaders``, ``response`` and
``error`` hooks are said in one log line (``hook_probe: <hook> <flow id>``), so that an
end-to-end test can wait for a flow to reach one of them, also while no turnguard instance is
loaded (a script reload that failed)."""

import logging

from mitmproxy import http

logger = logging.getLogger("hook_probe")


class HookProbe:
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        logger.info("hook_probe: responseheaders %s", flow.id)

    def response(self, flow: http.HTTPFlow) -> None:
        logger.info("hook_probe: response %s", flow.id)

    def error(self, flow: http.HTTPFlow) -> None:
        logger.info("hook_probe: error %s", flow.id)


addons = [HookProbe()]
