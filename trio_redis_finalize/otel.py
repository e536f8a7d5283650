"""OpenTelemetry spans around handler calls (extra ``[otel]``).

``instrument_handler(handler)`` wraps a handler so each call runs in a span
with the subscription, entry id, origin id, attempt and outcome; without
``opentelemetry-api`` installed it returns the handler unchanged.
"""

from ._otel import instrument_handler as instrument_handler

__all__ = ["instrument_handler"]
