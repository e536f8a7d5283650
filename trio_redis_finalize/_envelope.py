"""Headers carried by copies.

Stream copies keep the entry's field list byte for byte (order and
repeated names included) and append header fields: :data:`RETRIES_FIELD`
(the retry counter, decimal), :data:`ORIGIN_FIELD` (id of the first entry of
the chain) and, on copies written back to the stream (RETRY, delayed copies;
not dead letters), :data:`GROUP_FIELD` (the group that wrote the copy: other
groups of the stream acknowledge it unhandled).  A copy without
:data:`GROUP_FIELD` (older versions) is handled by every group.

The trace-context fields :data:`TRACEPARENT_FIELD` and :data:`TRACESTATE_FIELD`
(written by the publisher inside a span, or by any producer) are part of
the entry's own field list: copies keep them in place, byte for byte; the
handler sees neither (the OpenTelemetry instrumentation makes the context
the parent of its span).

List elements and Pub/Sub payloads have no fields, so their copies are
wrapped in an envelope, version 1::

    MAGIC (5 bytes: ff 74 72 66 01) | retries (4 bytes, big-endian)
    | origin length (2 bytes, big-endian) | origin (utf-8) | body

``0xff`` never starts UTF-8 text, so a plain text element from a foreign
producer is never mistaken for an envelope.  A payload that starts with the
magic but does not decode is *corrupt*.

Members of the durable delay set are a list of length-prefixed parts
(``MAGIC_DELAY | count (4) | [length (4) | bytes]*``), decoded by the Lua
move script: ``[unique id, payload...]``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

__all__ = [
    "GROUP_FIELD",
    "MAGIC",
    "MAGIC_DELAY",
    "ORIGIN_FIELD",
    "RETRIES_FIELD",
    "TRACEPARENT_FIELD",
    "TRACESTATE_FIELD",
    "TRACE_FIELDS",
    "CorruptEnvelope",
    "pack_parts",
    "unpack_parts",
    "unwrap",
    "wrap",
]

RETRIES_FIELD: Final[bytes] = b"trf-retries"
"""Stream header field: how many times the message was retried (copies only)."""
ORIGIN_FIELD: Final[bytes] = b"trf-origin"
"""Stream header field: id of the first entry of the chain (copies only)."""
GROUP_FIELD: Final[bytes] = b"trf-group"
"""Stream header field: the consumer group that wrote the copy to the stream."""
TRACEPARENT_FIELD: Final[bytes] = b"traceparent"
"""Stream field carrying the W3C trace context of the producer's span
(written by the publisher; read by the OpenTelemetry instrumentation)."""
TRACESTATE_FIELD: Final[bytes] = b"tracestate"
"""Stream field carrying the W3C ``tracestate`` beside :data:`TRACEPARENT_FIELD`."""
TRACE_FIELDS: Final = frozenset((TRACEPARENT_FIELD, TRACESTATE_FIELD))
"""The trace-context fields: copies keep them where the entry has them (byte
for byte), the handler does not see them (``Delivery.fields`` /
``field_list``)."""

MAGIC: Final = b"\xfftrf\x01"
MAGIC_DELAY: Final = b"\xfftrd\x01"
_HEAD = struct.Struct(">IH")
_HEAD_AT = len(MAGIC)
_ORIGIN_AT = _HEAD_AT + _HEAD.size
_unpack_head = _HEAD.unpack_from
_U32 = struct.Struct(">I")


class CorruptEnvelope(ValueError):
    """A payload starts with the envelope magic but cannot be decoded."""


def wrap(body: bytes, retries: int, origin: str) -> bytes:
    """Envelope ``body`` with its retry counter and origin id.

    The counter saturates at 2**32 - 1 (a crafted envelope cannot make its
    copy fail to encode).

    Raises:
        ValueError: ``origin`` is longer than 65535 bytes in UTF-8.
    """
    o = origin.encode()
    if len(o) > 0xFFFF:
        raise ValueError(f"origin too long for an envelope ({len(o)} bytes)")
    return MAGIC + _HEAD.pack(min(max(retries, 0), 0xFFFFFFFF), len(o)) + o + body


def unwrap(payload: bytes) -> tuple[bytes, int, str | None]:
    """``(body, retries, origin)``; a foreign payload is ``(payload, 0, None)``.

    Raises:
        CorruptEnvelope: the magic is there, the rest does not decode.
    """
    if not payload.startswith(MAGIC):
        return payload, 0, None
    size = len(payload)
    if size < _ORIGIN_AT:
        raise CorruptEnvelope(f"envelope header truncated ({size} bytes)")
    retries, olen = _unpack_head(payload, _HEAD_AT)
    end = _ORIGIN_AT + olen
    if size < end:
        raise CorruptEnvelope(f"envelope origin truncated ({size} bytes, needs {olen})")
    try:
        origin = payload[_ORIGIN_AT:end].decode()
    except UnicodeDecodeError:
        raise CorruptEnvelope("envelope origin is not utf-8") from None
    return payload[end:], retries, origin


def pack_parts(parts: Sequence[bytes]) -> bytes:
    """A delay-set member: ``MAGIC_DELAY`` and length-prefixed parts."""
    out = [MAGIC_DELAY, _U32.pack(len(parts))]
    for p in parts:
        out.append(_U32.pack(len(p)))
        out.append(p)
    return b"".join(out)


def unpack_parts(member: bytes) -> list[bytes]:
    """Inverse of :func:`pack_parts`.

    Raises:
        CorruptEnvelope: not a delay-set member.
    """
    if not member.startswith(MAGIC_DELAY):
        raise CorruptEnvelope("not a delay-set member")
    pos = len(MAGIC_DELAY)
    try:
        (n,) = _U32.unpack_from(member, pos)
        pos += 4
        parts = []
        for _ in range(n):
            (ln,) = _U32.unpack_from(member, pos)
            pos += 4
            if pos + ln > len(member):
                raise CorruptEnvelope("delay-set member truncated")
            parts.append(member[pos : pos + ln])
            pos += ln
    except struct.error:
        raise CorruptEnvelope("delay-set member truncated") from None
    if pos != len(member):
        raise CorruptEnvelope(f"delay-set member has {len(member) - pos} trailing bytes")
    return parts
