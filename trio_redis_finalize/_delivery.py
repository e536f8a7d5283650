"""What a handler receives."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ._envelope import TRACE_FIELDS
from ._value import builder, immutable, setters

__all__ = ["MAX_ERROR", "Delivery", "DeliveryBuilder", "record_error", "trace_fields"]


# Built per message: ``builder(init=True)`` below replaces the generated frozen
# ``__init__`` (about 2.3 µs) with one that fills the slots in on the builder
# twin (about 0.7 µs; 1.5 µs with the slot setters).
@immutable
@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Delivery:
    """One delivery of one message to a handler.

    Attributes:
        source: the key (stream, list) or the channel the message came from;
            for a pattern subscription, the concrete channel.
        id: the stream entry id; ``None`` for other forms.
        fields: the stream entry's field map without the library's header
            fields (:data:`RETRIES_FIELD`, :data:`ORIGIN_FIELD`,
            :data:`GROUP_FIELD`) and without the trace context
            (``traceparent``, ``tracestate``: the publisher writes them
            inside a span; :func:`trio_redis_finalize.otel.trace_context`
            reads them); empty for other forms.  A name the entry repeats
            maps to its last value; :attr:`field_list` has them all.
        field_list: (the property below) the entry's fields as written, in
            order, repeated names included, without the header fields and
            the trace context.
        data: the list element or message payload without envelope; ``None``
            for streams.
        attempt: 1 on the first delivery, one more on every retry (and on
            every crash-redelivery counted by the server).
        origin_id: the same for every copy of one message: an idempotency key.

    The readers build some deliveries as private subclasses that compute a
    field when it is first read (a stream entry's ``fields``, a foreign
    element's ``origin_id``), named ``Delivery`` too and equal in every other
    respect; copies and pickles of them are plain ``Delivery`` objects.  Test
    with ``isinstance(d, Delivery)``, not ``type(d) is Delivery``.
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
    error: str | None = dataclasses.field(default=None, repr=False, init=False)
    """``Type: message`` of the handler's exception (bounded), set when it raised;
    ``None`` otherwise.  Not an argument: a copy (``dataclasses.replace``) starts
    without one."""
    flat: Sequence[bytes] | None = dataclasses.field(default=None, repr=False)
    """The entry's fields as read, flat (name, value, ...), without the header
    fields but with the trace context (what copies carry, byte for byte);
    ``None``: the same as ``fields`` (built without a field list)."""

    @property
    def field_list(self) -> tuple[tuple[bytes, bytes], ...]:
        """The stream entry's ``(name, value)`` pairs as written, in order.

        Repeated names are all there (``fields`` keeps the last value of
        each); the library's header fields and the trace context
        (``traceparent``, ``tracestate``) are not.  Copies (RETRY, delayed,
        dead letter) keep the entry's field list byte for byte, the trace
        context in its place.  Empty for other forms.
        """
        flat = self.flat
        if flat is None:
            return tuple(self.fields.items())
        it = iter(flat)
        return tuple(pair for pair in zip(it, it, strict=False) if pair[0] not in TRACE_FIELDS)


_set_origin_id, _set_error = setters(Delivery, "origin_id", "error")

DeliveryBuilder = builder(Delivery, init=True)
"""The builder twin of :class:`Delivery` (``_value.builder``): ``Delivery.__init__``
fills a new delivery in on it; readers build theirs on it inline."""


def trace_fields(d: Delivery) -> dict[bytes, bytes]:
    """The trace-context fields of a stream delivery (``traceparent``,
    ``tracestate``; a repeated one: its last value), which ``fields`` and
    ``field_list`` leave out; ``{}`` without them."""
    flat = d.flat
    if flat is None:
        return {k: v for k, v in d.fields.items() if k in TRACE_FIELDS}
    it = iter(flat)
    return {k: v for k, v in zip(it, it, strict=False) if k in TRACE_FIELDS}


MAX_ERROR = 500
"""Characters of a handler exception's ``Type: message`` kept (in dead-letter entries)."""


def record_error(d: Delivery, exc: BaseException | None) -> None:
    """Remember the handler's exception on ``d`` (its dead-letter entry records it)."""
    if exc is None:
        return
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    text = " ".join(str(exc).split())
    full = f"{name}: {text}" if text else name
    _set_error(d, full if len(full) <= MAX_ERROR else full[: MAX_ERROR - 3] + "...")
