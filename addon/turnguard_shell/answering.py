"""Two steps of a request that take a while and so stay off the event loop's hot path: its
identity (``Identifier``: a large body goes to a worker process) and a replay in the encoding
the client accepts (``Replayer``: decoding and re-encoding run on a thread)."""

from __future__ import annotations

import asyncio
from typing import Callable

from mitmproxy import http

from turnguard_core import identity, machine, negotiation
from turnguard_core.identity_memo import IdentityMemo
from turnguard_core.ledger import Recording
from turnguard_core.codec import BoundedCodec
from turnguard_core.failover import FailoverStore
from turnguard_core.offload import START_TIMEOUT_S, IdentityWorker, read_inline

from . import flows

MAX_GUARDED_BODY = 64 * 1024 * 1024
IDENTITY_TIMEOUT_S = 5.0  # a large body not identified by then (once the worker runs): passed through
MAX_RECODED_BODY = 64 * 1024 * 1024  # a replay decoded for a client larger than this: forwarded


class Identifier:
    def __init__(self) -> None:
        self._worker = IdentityWorker()  # started the first time a large body arrives
        self._memo = IdentityMemo()  # a retry of a request seen last: identified at once

    @property
    def remembered(self) -> int:
        """Identities remembered for retries (``identity_memo``), for ``turnguard.status``."""
        return len(self._memo)

    async def identify(
        self, flow: http.HTTPFlow, timeout_s: float, credential_headers: tuple[str, ...]
    ) -> identity.Identity | identity.Passthrough:
        """The request's identity: computed here for a small body (remembered for its retries:
        ``identity_memo``), in the worker process for a large one or one that decodes large
        (``offload``), so that no body holds the event loop for long."""
        return await self.identify_view(flows.request_view(flow, MAX_GUARDED_BODY), timeout_s,
                                        credential_headers)

    async def identify_view(
        self, view: identity.RequestView | identity.Passthrough, timeout_s: float,
        credential_headers: tuple[str, ...],
    ) -> identity.Identity | identity.Passthrough:
        if isinstance(view, identity.Passthrough):
            return view
        kwargs = dict(max_body_bytes=MAX_GUARDED_BODY, credential_headers=credential_headers)
        if view.body is None or read_inline(view.body) and not view.body_codings:
            return self._memo.identify(view, **kwargs)
        return await self._worker.identify(view, timeout_s=IDENTITY_TIMEOUT_S,
                                           start_timeout_s=START_TIMEOUT_S, within_s=timeout_s,
                                           **kwargs)

    def close(self) -> None:
        """Unloaded: the worker stops; a request it was identifying raises ``WorkerStopped``
        (the addon loaded next identifies it again)."""
        self._worker.close(unloaded=True)


async def negotiated(rec: Recording, request_headers: tuple[tuple[str, str], ...]
                     ) -> negotiation.Serve | negotiation.Decline:
    """The recording in a form a request with ``request_headers`` accepts (``negotiation``):
    as recorded when it can, else decoded or re-encoded (on a thread: megabytes take a
    while), or declined with the reason."""
    how = negotiation.plan(rec.headers, rec.vary_key, request_headers)
    if isinstance(how, negotiation.Recode):
        return await asyncio.to_thread(negotiation.recode, rec.headers, rec.body, how,
                                       BoundedCodec(MAX_RECODED_BODY))
    if isinstance(how, negotiation.Decline):
        return how
    return negotiation.Serve(rec.headers, rec.body, recoded=False)


class Replayer:
    def __init__(self, store: FailoverStore, explainer: flows.Explainer,
                 emit: Callable[..., None]):
        self._store = store
        self._explainer = explainer
        self._emit = emit

    async def replay(self, flow: http.HTTPFlow, ident: identity.Identity, r: machine.Replay) -> None:
        """Answer from the recording, in a form the request accepts (see ``negotiation``): as
        recorded, byte for byte, when it can; decoded or re-encoded for a client that does not
        accept the recorded content coding. Declined (``Vary``, or no acceptable coding): the
        flow is forwarded untouched, with a ``replay_declined`` event."""
        rec, base = r.recording, {"op": ident.op_id, "flow": flow.id, "session": ident.session,
                                  "transport": "http"}
        how = await negotiated(rec, flows.request_headers(flow))
        if isinstance(how, negotiation.Decline):
            self._emit("replay_declined", **base, held_ms=r.held_ms, reason=how.reason)
            self._explainer.show(flow, None, f"turnguard: not replayed ({how.reason}); forwarded")
            return
        headers, body = how.headers, how.body
        flows.replay(flow, ident.op_id, rec.status, headers, body)
        self._store.note_duplicates(ident.op_key, replayed=1)
        self._emit("duplicate_replayed", **base, held_ms=r.held_ms, status=rec.status,
                   bytes=len(body), attempt=r.attempt_id, recoded=how.recoded)
        self._explainer.show(flow, flows.MARK_REPLAYED, "turnguard: replayed the recorded "
                             f"response of operation {ident.op_id} ({len(body)} bytes) after "
                             f"{r.held_ms} ms; nothing was sent upstream")
