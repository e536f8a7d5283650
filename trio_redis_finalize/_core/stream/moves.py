"""The durable delay set's hand-back into a stream, sans-IO: what the client writes.

The move script (``scripts.move_due_to_stream``) writes the due copies of a
stream's delay set back into the stream itself, and hands back members wider
than its budget (``_forms/_delay_set``); those the client writes, one
``XADD`` each (:func:`move_back_commands`), as the script would: the same
fields (:func:`stream_fields`) and, as every copy written into the stream,
the subscription's ``copy_maxlen`` cap (``MAXLEN ~ n``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._envelope import CorruptEnvelope, unpack_parts
from .._commands import Command
from .._types import Target, cap
from .scripts import CORRUPT_FIELD

__all__ = ["move_back_commands", "stream_fields"]


def stream_fields(member: bytes) -> list[bytes]:
    """The fields the move script writes for a stream delay-set ``member``.

    ``[field, value, ...]`` of a member that decodes to a unique id and
    pairs; one field :data:`~.scripts.CORRUPT_FIELD` holding the member otherwise.
    """
    try:
        parts = unpack_parts(member)
    except CorruptEnvelope:
        return [CORRUPT_FIELD, member]
    if len(parts) >= 3 and len(parts) % 2 == 1:
        return parts[1:]
    return [CORRUPT_FIELD, member]


def move_back_commands(t: Target, members: Sequence[bytes]) -> list[Command]:
    """One ``XADD`` per handed-back member into the stream ``t.source``, capped
    at ``t.copy_maxlen`` as the move script's own (``move_due_to_stream(cap)``)."""
    head = ("XADD", t.source, *cap(t.copy_maxlen), "*")
    return [(*head, *stream_fields(m)) for m in members]
