"""The benchmark's ``answer_floor`` variant: the least an addon that answers a repeated request
from memory costs mitmproxy (the replay phase only).

The first request with a given body goes upstream and its whole (buffered) answer is kept in
memory; every later request with that body is answered with a copy of it in the ``request``
hook, as turnguard answers a replay, without a ledger, an identity or any check. No addon can
replay faster than this in mitmproxy: its requests per second over ``plain_stream``
dispatching the same request are the ceiling of turnguard's replay ratio.
"""

from collections import OrderedDict

from mitmproxy import http

# The most recent answers kept (the oldest go first): the replay phase replays the body it
# has just primed, after the warm-up's hundreds of others.
MAX_ANSWERS = 64


class AnswerFloor:
    def __init__(self) -> None:
        self._answers: OrderedDict[bytes, http.Response] = OrderedDict()

    def request(self, flow: http.HTTPFlow) -> None:
        answer = self._answers.get(flow.request.raw_content or b"")
        if answer is not None:
            flow.response = answer.copy()

    def response(self, flow: http.HTTPFlow) -> None:
        key = flow.request.raw_content or b""
        if flow.response is not None and flow.response.status_code == 200 and key not in self._answers:
            self._answers[key] = flow.response.copy()
            if len(self._answers) > MAX_ANSWERS:
                self._answers.popitem(last=False)


addons = [AnswerFloor()]
