"""OpenTelemetry spans by the messaging conventions (extra ``[otel]``).

``instrument_handler(handler)`` wraps a handler so each call runs in a
``process`` span (``messaging.system=redis``, operation, destination,
consumer group, client id, ``error.type``), a child of the producer's span
when the message carries its trace context, followed by a ``settle`` span
with the effect once Redis confirmed the finalization; without
``opentelemetry-api`` installed it returns the handler unchanged.  See
:mod:`trio_redis_finalize._otel` for every attribute.

``trace_context(delivery)`` is the W3C trace context a delivery carries
(``traceparent``, ``tracestate``), which ``Delivery.fields`` and
``field_list`` leave out; it needs no ``opentelemetry-api``.
"""

from __future__ import annotations

from ._delivery import Delivery, trace_fields
from ._otel import instrument_handler as instrument_handler
from ._publisher import trace_context as _carried

__all__ = ["instrument_handler", "trace_context"]


def trace_context(delivery: Delivery) -> dict[str, str]:
    """The W3C trace context ``delivery`` carries: ``{"traceparent": ...}``
    (and ``"tracestate"``), or ``{}``.

    From a stream entry's ``traceparent`` / ``tracestate`` fields (written
    by :meth:`~trio_redis_finalize.Publisher.add` inside a span, or by any
    producer), else from the origin id the publisher writes into the list
    envelope.  The handler does not see these fields in
    :attr:`~trio_redis_finalize.Delivery.fields` or
    :attr:`~trio_redis_finalize.Delivery.field_list`; copies keep them.
    """
    return _carried(delivery.origin_id, trace_fields(delivery))
