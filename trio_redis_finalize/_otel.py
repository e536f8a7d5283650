"""OpenTelemetry spans around handler calls (optional: ``pip install 'trio_redis_finalize[otel]'``).

Opt in per handler, no consumer setting involved::

    from trio_redis_finalize._otel import instrument_handler

    await consumer.mount(StreamSubscription("orders", group="billing"),
                         instrument_handler(handle))

Each call of the wrapped handler runs in a span (kind ``CONSUMER``) named
``process <source>`` with the attributes

* ``trf.subscription``: the subscription's name (as in ``consumer.stats()``);
* ``trf.id``: the stream entry id (absent for other forms);
* ``trf.origin_id``: the message's idempotency key (the same for every copy);
* ``trf.attempt``: 1 on the first delivery;
* ``trf.outcome``: what the handler returned (``ack``, ``retry``, ``drop``,
  ``retry_after``), ``error`` when it raised (the exception is recorded and
  the span's status is ``ERROR``), ``invalid`` when it returned something
  that is not an outcome;
* the messaging conventions ``messaging.system`` (``redis``),
  ``messaging.operation.type`` (``process``), ``messaging.destination.name``
  (the key or channel) and ``messaging.message.id``.

The span is current while the handler runs, so spans the handler starts
are its children.  Finalization runs later, batched for many deliveries in
one pipeline; its results are counted per subscription in
``consumer.stats()`` (and :mod:`trio_redis_finalize.prometheus`) rather than
traced per delivery.

Only ``opentelemetry-api`` is needed; spans go wherever the application's
tracer provider sends them (none without an SDK configured).  When
``opentelemetry-api`` is not installed, :func:`instrument_handler` returns
the handler unchanged, so the same code runs with and without it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ._delivery import Delivery
from ._outcome import Outcome

if TYPE_CHECKING:
    from ._mount import Handler

__all__ = ["instrument_handler"]


def instrument_handler(handler: Handler, *, tracer: Any = None) -> Handler:
    """Wrap ``handler`` so that each call runs in an OpenTelemetry span.

    Args:
        handler: ``async def handler(delivery) -> Outcome``.
        tracer: an ``opentelemetry.trace.Tracer``; default the global
            tracer provider's tracer named ``trio_redis_finalize``.

    Returns:
        The wrapped handler; ``handler`` itself when ``opentelemetry-api`` is
        not installed.
    """
    try:
        from opentelemetry import trace
    except ImportError:
        return handler
    from . import __version__

    if tracer is None:
        tracer = trace.get_tracer("trio_redis_finalize", __version__)
    kind = trace.SpanKind.CONSUMER
    error = trace.Status(trace.StatusCode.ERROR)

    @functools.wraps(handler)
    async def traced(delivery: Delivery) -> Outcome:
        attributes: dict[str, str | int] = {
            "messaging.system": "redis",
            "messaging.operation.type": "process",
            "messaging.destination.name": delivery.source,
            "messaging.message.id": delivery.id or delivery.origin_id,
            "trf.subscription": delivery.mount,
            "trf.origin_id": delivery.origin_id,
            "trf.attempt": delivery.attempt,
        }
        if delivery.id is not None:
            attributes["trf.id"] = delivery.id
        with tracer.start_as_current_span(
            f"process {delivery.source}", kind=kind, attributes=attributes,
            record_exception=False, set_status_on_exception=False,
        ) as span:
            try:
                result = await handler(delivery)
            except BaseException as e:
                if isinstance(e, Exception):
                    span.set_attribute("trf.outcome", "error")
                    span.record_exception(e)
                    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}"))
                else:  # cancelled (shutdown): not a handler error
                    span.set_attribute("trf.outcome", "cancelled")
                raise
            if isinstance(result, Outcome):
                span.set_attribute("trf.outcome", result.kind.value)
                if result.delay:
                    span.set_attribute("trf.delay", result.delay)
            else:
                span.set_attribute("trf.outcome", "invalid")
                span.set_status(error)
            return result

    return traced
