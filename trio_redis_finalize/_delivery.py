"""What a handler receives."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["Delivery"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Delivery:
    """One delivery of one message to a handler.

    Attributes:
        source: the key (stream, list) or the channel the message came from;
            for a pattern subscription, the concrete channel.
        id: the stream entry id; ``None`` for other forms.
        fields: the stream entry's field map without the library's header
            fields (:data:`RETRIES_FIELD`, :data:`ORIGIN_FIELD`); empty for
            other forms.
        data: the list element or message payload without envelope; ``None``
            for streams.
        attempt: 1 on the first delivery, one more on every retry (and on
            every crash-redelivery counted by the server).
        origin_id: the same for every copy of one message: an idempotency key.
    """

    source: str
    id: str | None
    fields: Mapping[bytes, bytes]
    data: bytes | None
    attempt: int
    origin_id: str
    # -- private: what finalization needs --------------------------------
    raw: bytes | None = dataclasses.field(default=None, repr=False)
    """The exact list element as read (for LREM), envelope included."""
    retries: int = dataclasses.field(default=0, repr=False)
    """The retry counter carried by the message's header (0 for originals)."""
    mount: str = dataclasses.field(default="", repr=False)
    """Name of the subscription that delivered it (logs, stats)."""
    corrupt: str | None = dataclasses.field(default=None, repr=False)
    """Why the envelope could not be decoded, when it could not."""
