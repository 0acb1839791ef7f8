"""Identities of the requests seen last, remembered by the whole request: a duplicate (a
client's or a gateway's retry, byte for byte the same request) is identified by a lookup
instead of parsing and hashing its body again (most of what a retry storm costs the proxy
per request, and the larger the body the more).

``identity.identify`` is a pure function of its arguments, so a remembered identity is the
one it would compute again. The key is the request's view itself (method, target, every header
with its value, the decoded body, the upstream, the proxy's credentials), compared whole on a
hit, never a digest of it; it stays in this process's memory only, as the flow it came from
does. Bounded by count and by bytes: each request's body, target and headers (mitmproxy sets
no bound on a request's head, so a megabyte header must count as a megabyte body does); the
least recently used go first. Only
identities are remembered: a request that is passed through unguarded is examined again each
time.
"""

from __future__ import annotations

from collections import OrderedDict

from .identity import Identity, Passthrough, RequestView, identify

MAX_ENTRIES = 1024
MAX_BODY_BYTES = 8 * 1024 * 1024  # of all the remembered requests together (``_size``)


class IdentityMemo:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_body_bytes: int = MAX_BODY_BYTES):
        if max_entries < 1 or max_body_bytes < 0:
            raise ValueError("IdentityMemo wants max_entries >= 1 and max_body_bytes >= 0")
        self.max_entries = max_entries
        self.max_body_bytes = max_body_bytes
        self.body_bytes = 0
        self._known: OrderedDict[tuple, Identity] = OrderedDict()

    def __len__(self) -> int:
        return len(self._known)

    def identify(self, view: RequestView, *, max_body_bytes: int,
                 credential_headers: tuple[str, ...] = ()) -> Identity | Passthrough:
        """What ``identity.identify(view, ...)`` returns, remembered."""
        key = (view, max_body_bytes, credential_headers)
        known = self._known.get(key)
        if known is not None:
            self._known.move_to_end(key)
            return known
        ident = identify(view, max_body_bytes=max_body_bytes,
                         credential_headers=credential_headers)
        size = _size(view)
        if isinstance(ident, Identity) and size <= self.max_body_bytes:
            self._known[key] = ident
            self.body_bytes += size
            while len(self._known) > self.max_entries or self.body_bytes > self.max_body_bytes:
                (oldest, _, _), _ = self._known.popitem(last=False)
                self.body_bytes -= _size(oldest)
        return ident


def _size(view: RequestView) -> int:
    """What a remembered request holds: its body, its target and its headers."""
    return ((len(view.body) if view.body is not None else 0) + len(view.path)
            + sum([len(name) + len(value) for name, value in view.headers])
            + len(view.proxy_auth or ""))
