"""Content codings (gzip, deflate, br, zstd) of request bodies and replays; decoding is bounded.

A body is at most some bytes on the wire, but decoded it could be a decompression bomb:
``BoundedCodec.decode`` stops at ``max_bytes`` of output and raises ``TooBig`` instead, and
``decode_content`` undoes at most ``MAX_CONTENT_CODINGS`` codings of one body. Encoding uses mitmproxy's own codec functions
(``mitmproxy.net.encoding.custom_encode``, fast settings), not its ``encode``: that one keeps a
module-wide cache, which a call from another thread (the addon recodes off the event loop) would
race with. The same brotli and zstd modules mitmproxy uses are used here; no proxy, clock or
disk.
"""

from __future__ import annotations

import sys
import zlib

import brotli
from mitmproxy.net import encoding as mitmproxy_encoding

if sys.version_info >= (3, 14):
    from compression import zstd  # type: ignore[import-not-found]
else:  # pragma: no cover - the backport mitmproxy depends on below 3.14
    from backports import zstd  # type: ignore[no-redef]

__all__ = ["MAX_CONTENT_CODINGS", "BoundedCodec", "TooBig", "content_codings", "decode_content"]

MAX_CONTENT_CODINGS = 2
"""A body with more content codings than this is not decoded: no client stacks them, and each
layer could decode to the whole bound."""


class TooBig(ValueError):
    """The data decodes to more than the bound."""


def content_codings(header: str | None) -> tuple[str, ...]:
    """The codings a ``Content-Encoding`` value lists, in the order they were applied: lower
    case, ``x-gzip`` as ``gzip``, without ``identity`` and empty entries."""
    if not header:
        return ()
    codings = (c.strip().lower() for c in header.split(","))
    return tuple("gzip" if c == "x-gzip" else c for c in codings if c not in ("", "identity"))


def decode_content(data: bytes, codings: tuple[str, ...], max_bytes: int, *,
                   prefix: bool = False) -> bytes:
    """``data`` with ``codings`` (as ``content_codings`` gives them) undone, last applied first,
    each at most ``max_bytes`` decoded; ``ValueError`` (``TooBig`` past the bound) when it
    cannot be, or when there are more than ``MAX_CONTENT_CODINGS``. ``prefix``: ``data`` may
    be the start of a coded body whose end never came (a transport cut): what it decodes to
    so far, instead of an error for the missing end."""
    if len(codings) > MAX_CONTENT_CODINGS:
        raise ValueError(f"{len(codings)} content codings (at most {MAX_CONTENT_CODINGS} are decoded)")
    codec = BoundedCodec(max_bytes, prefix=prefix)
    for coding in reversed(codings):
        data = codec.decode(data, coding)
    return data


class BoundedCodec:
    """``decode`` and ``encode`` for ``negotiation.recode``. ``decode`` raises ValueError for
    data that is not a complete, valid stream of the coding, or decodes to more than
    ``max_bytes``."""

    def __init__(self, max_bytes: int, *, prefix: bool = False):
        self.max_bytes = max_bytes
        self.prefix = prefix  # data may lack the end of its stream (see ``decode_content``)

    def decode(self, data: bytes, coding: str) -> bytes:
        if not data:
            return b""
        if coding == "gzip":
            return self._zlib(data, 16 + zlib.MAX_WBITS)
        if coding == "deflate":  # zlib-wrapped as the RFC says, or raw as some servers send
            try:
                return self._zlib(data, zlib.MAX_WBITS)
            except TooBig:
                raise
            except ValueError:
                return self._zlib(data, -zlib.MAX_WBITS)
        if coding == "br":
            return self._brotli(data)
        if coding == "zstd":
            return self._zstd(data)
        raise ValueError(f"unsupported content coding {coding!r}")

    def encode(self, data: bytes, coding: str) -> bytes:
        if coding not in ("gzip", "deflate", "br", "zstd"):
            raise ValueError(f"unsupported content coding {coding!r}")
        return mitmproxy_encoding.custom_encode[coding](data)

    def _too_big(self) -> ValueError:
        return TooBig(f"decodes to more than {self.max_bytes} bytes")

    def _zlib(self, data: bytes, wbits: int) -> bytes:
        d = zlib.decompressobj(wbits)
        return self._bounded(lambda: d.decompress(data, self.max_bytes + 1), zlib.error,
                             lambda: d.eof and not d.unused_data)

    def _brotli(self, data: bytes) -> bytes:
        d = brotli.Decompressor()
        return self._bounded(
            lambda: d.process(data, output_buffer_limit=self.max_bytes + 1), brotli.error,
            d.is_finished)

    def _zstd(self, data: bytes) -> bytes:
        d = zstd.ZstdDecompressor()
        return self._bounded(lambda: d.decompress(data, max_length=self.max_bytes + 1),
                             zstd.ZstdError, lambda: d.eof and not d.unused_data)

    def _bounded(self, decompress, error: type[Exception], whole) -> bytes:
        """``decompress()`` (made to stop one byte past the bound), checked: a decoder error,
        an output over the bound, or a stream that did not end exactly at the end of the data
        (``whole()`` False) raise ``ValueError``."""
        try:
            out = decompress()
        except error as e:
            raise ValueError(f"invalid data: {e}") from None
        if len(out) > self.max_bytes:
            raise self._too_big()
        if not self.prefix and not whole():
            raise ValueError("incomplete, or followed by other data")
        return out
