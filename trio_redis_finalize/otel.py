"""OpenTelemetry spans by the messaging conventions (extra ``[otel]``).

``instrument_handler(handler)`` wraps a handler so each call runs in a
``process`` span (``messaging.system=redis``, operation, destination,
consumer group, client id, ``error.type``), a child of the producer's span
when the message carries its trace context, followed by a ``settle`` span
with the effect once Redis confirmed the finalization; without
``opentelemetry-api`` installed it returns the handler unchanged.  See
:mod:`trio_redis_finalize._otel` for every attribute.
"""

from ._otel import instrument_handler as instrument_handler

__all__ = ["instrument_handler"]
