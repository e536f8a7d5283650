"""OpenTelemetry spans by the messaging conventions (optional: ``pip install 'trio_redis_finalize[otel]'``).

Opt in per handler, no consumer setting involved::

    from trio_redis_finalize.otel import instrument_handler

    await consumer.mount(StreamSubscription("orders", group="billing"),
                         instrument_handler(handle))

Each call of the wrapped handler runs in a span (kind ``CONSUMER``) named
``process <destination>`` (for a pattern subscription the pattern, the
destination template) with the attributes of the OpenTelemetry messaging
semantic conventions:

* ``messaging.system``: ``redis``;
* ``messaging.operation.name`` and ``messaging.operation.type``: ``process``;
* ``messaging.destination.name``: the key or channel the message came from;
* ``messaging.destination.template``: the pattern (pattern subscriptions);
* ``messaging.consumer.group.name``: the consumer group (streams);
* ``messaging.client.id``: the consumer's name;
* ``messaging.message.id``: the stream entry id, else the origin id;
* ``error.type``: the exception's class when the handler raised (the
  exception is recorded, the status is ``ERROR``), ``invalid_outcome`` when it
  returned something that is not an outcome;

and the library's own ``trf.subscription``, ``trf.id``, ``trf.origin_id``,
``trf.attempt``, ``trf.outcome`` (``ack``, ``retry``, ``drop``,
``retry_after``, ``error``, ``invalid``, ``cancelled``) and ``trf.delay``.

**Trace context from producer to consumer.** The span's parent is the
producer's span when the message carries its context: the ``traceparent``
(and ``tracestate``) field of a stream entry, or the origin id written by
:func:`~trio_redis_finalize.open_publisher` in the list envelope (which every
retry copy keeps).  A message without one starts a new trace (or is a
child of the span current where the consumer runs).

**Settlement.** When Redis confirmed the finalization of the delivery, a
span ``settle <destination>`` (kind ``CLIENT``, child of the process span)
records it: ``messaging.operation.type`` ``settle``,
``messaging.operation.name`` the effect (``acked``, ``copied``, ``delayed``,
``dead_lettered``, ...; ``gate_closed`` when it was finalized already,
``failed`` -- with an error status -- when Redis refused it and it stays
pending), also as ``trf.effect``.  Finalization runs batched
for many deliveries in one pipeline, so the settle span marks the moment
the effect was confirmed rather than the time the command took.

The process span is current while the handler runs, so spans the handler
starts are its children.  Only ``opentelemetry-api`` is needed; spans go
wherever the application's tracer provider sends them (nowhere without an
SDK configured).  When ``opentelemetry-api`` is not installed,
:func:`instrument_handler` returns the handler unchanged, so the same code
runs with and without it.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._core._types import FAILED
from ._delivery import Delivery, trace_fields
from ._forms import FORMS
from ._outcome import Outcome
from ._publisher import trace_context

if TYPE_CHECKING:
    from ._forms._port import Context, Handler

__all__ = ["instrument_handler"]

_MAX_WATCHED = 10_000
"""Process spans remembered until their settlement (the oldest are forgotten beyond)."""


def _error_type(e: BaseException) -> str:
    cls = type(e)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


class _Mounted:
    """What the span attributes need to know of one mounted subscription."""

    __slots__ = ("attributes", "template")

    def __init__(self, mount: Context) -> None:
        t = mount.target
        self.attributes: dict[str, str] = {
            "messaging.system": "redis",
            "messaging.client.id": mount.consumer.name,
        }
        if t.group:
            self.attributes["messaging.consumer.group.name"] = t.group
        self.template: str | None = t.source if FORMS[t.form].templated else None
        if self.template is not None:
            self.attributes["messaging.destination.template"] = self.template


def instrument_handler(handler: Handler, *, tracer: Any = None) -> Handler:
    """Wrap ``handler`` so that each call runs in an OpenTelemetry span.

    Args:
        handler: ``async def handler(delivery) -> Outcome``.
        tracer: an ``opentelemetry.trace.Tracer``; default the global
            tracer provider's tracer named ``trio_redis_finalize``.

    Returns:
        The wrapped handler (mount it as the handler itself); ``handler``
        itself when ``opentelemetry-api`` is not installed.
    """
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return handler
    from ._version import __version__

    if tracer is None:
        tracer = trace.get_tracer("trio_redis_finalize", __version__)
    consumer_kind = trace.SpanKind.CONSUMER
    client_kind = trace.SpanKind.CLIENT
    error = trace.Status(trace.StatusCode.ERROR)
    mounted: dict[str, _Mounted] = {}
    watched: OrderedDict[int, tuple[Delivery, Any, str]] = OrderedDict()

    def settled(items: list[tuple[Delivery, str]]) -> None:
        for d, effect in items:
            got = watched.pop(id(d), None)
            if got is None or got[0] is not d:
                continue
            _, ctx, destination = got
            parent = trace.set_span_in_context(trace.NonRecordingSpan(ctx))
            attrs = {
                **(mounted[d.mount].attributes if d.mount in mounted else {"messaging.system": "redis"}),
                "messaging.operation.type": "settle",
                "messaging.operation.name": effect,
                "messaging.destination.name": d.source,
                "messaging.message.id": d.id or d.origin_id,
                "trf.effect": effect,
            }
            span = tracer.start_span(f"settle {destination}", context=parent, kind=client_kind,
                                     attributes=attrs)
            if effect == FAILED:  # the finalization failed: the delivery stays pending
                span.set_status(error)
            span.end()

    def bind(mount: Context) -> Callable[[list[tuple[Delivery, str]]], None]:
        """Called by the runtime when the wrapped handler is mounted."""
        mounted[mount.name] = _Mounted(mount)
        return settled

    @functools.wraps(handler)
    async def traced(delivery: Delivery) -> Outcome:
        m = mounted.get(delivery.mount)
        destination = (m.template if m is not None else None) or delivery.source
        attributes: dict[str, str | int] = {
            **(m.attributes if m is not None else {"messaging.system": "redis"}),
            "messaging.operation.name": "process",
            "messaging.operation.type": "process",
            "messaging.destination.name": delivery.source,
            "messaging.message.id": delivery.id or delivery.origin_id,
            "trf.subscription": delivery.mount,
            "trf.origin_id": delivery.origin_id,
            "trf.attempt": delivery.attempt,
        }
        if delivery.id is not None:
            attributes["trf.id"] = delivery.id
        carrier = trace_context(delivery.origin_id, trace_fields(delivery))
        context = propagate.extract(carrier) if carrier else None
        with tracer.start_as_current_span(
            f"process {destination}", context=context, kind=consumer_kind, attributes=attributes,
            record_exception=False, set_status_on_exception=False,
        ) as span:
            try:
                result = await handler(delivery)
            except BaseException as e:
                if isinstance(e, Exception):
                    span.set_attribute("trf.outcome", "error")
                    span.set_attribute("error.type", _error_type(e))
                    span.record_exception(e)
                    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}"))
                    _watch(delivery, span, destination)
                else:  # cancelled (shutdown): not a handler error
                    span.set_attribute("trf.outcome", "cancelled")
                raise
            if isinstance(result, Outcome):
                span.set_attribute("trf.outcome", result.kind.value)
                if result.delay:
                    span.set_attribute("trf.delay", result.delay)
            else:
                span.set_attribute("trf.outcome", "invalid")
                span.set_attribute("error.type", "invalid_outcome")
                span.set_status(error)
            _watch(delivery, span, destination)
            return result

    def _watch(delivery: Delivery, span: Any, destination: str) -> None:
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return
        watched[id(delivery)] = (delivery, ctx, destination)
        while len(watched) > _MAX_WATCHED:
            watched.popitem(last=False)

    traced.trf_bind = bind  # type: ignore[attr-defined]
    return traced
