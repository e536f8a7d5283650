"""OpenTelemetry by the messaging conventions, checked with the SDK's in-memory
exporter: process spans (system, operation, destination or template, group,
client id, error.type), the settle span with the effect, and the producer's
trace context restored as the parent on streams (traceparent field) and
lists and channels (the publisher's envelope), across retries too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from trio_redis_finalize import (
    ACK,
    RETRY,
    Delivery,
    ListSubscription,
    Outcome,
    PatternSubscription,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    open_publisher,
)
from trio_redis_finalize._transport import Client
from trio_redis_finalize.otel import instrument_handler, trace_context

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """The global tracer provider (the publisher's spans use it) with an in-memory exporter."""
    trace.set_tracer_provider(_PROVIDER)  # once per process; later calls only warn
    assert trace.get_tracer_provider() is _PROVIDER
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def named(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


async def until(predicate: Any) -> None:
    with trio.fail_after(10):
        while not predicate():
            await trio.sleep(0.01)


async def test_process_and_settle_spans_by_the_conventions(
    redis_url: str, client: Client, exporter: InMemorySpanExporter
) -> None:
    async def handle(d: Delivery) -> Outcome:
        if d.fields[b"n"] == b"boom" and d.attempt == 1:
            raise KeyError("boom")
        return RETRY if d.fields[b"n"] == b"retry" and d.attempt == 1 else ACK

    for n in ("ok", "retry", "boom"):
        await client.execute("XADD", "orders", "*", "n", n)
    async with open_consumer(redis_url, name="worker-1") as consumer:
        await consumer.mount(StreamSubscription("orders", "billing", block=0.05), instrument_handler(handle))
        await until(lambda: len(named(exporter, "settle ")) == 5)
    process = named(exporter, "process ")
    assert len(process) == 5
    for s in process:
        a = s.attributes or {}
        assert s.kind is SpanKind.CONSUMER and s.name == "process orders"
        assert a["messaging.system"] == "redis"
        assert a["messaging.operation.name"] == "process"
        assert a["messaging.operation.type"] == "process"
        assert a["messaging.destination.name"] == "orders"
        assert a["messaging.consumer.group.name"] == "billing"
        assert a["messaging.client.id"] == "worker-1"
    errors = [s for s in process if "error.type" in (s.attributes or {})]
    assert [(s.attributes or {})["error.type"] for s in errors] == ["KeyError"]
    settle = named(exporter, "settle ")
    by_parent = {s.parent.span_id: s for s in settle if s.parent is not None}
    assert set(by_parent) == {s.context.span_id for s in process}  # one settle per process span
    effects = sorted((s.attributes or {})["trf.effect"] for s in settle)
    # the raise stays pending (Backoff) and is redelivered; RETRY writes a copy
    assert effects.count("acked") == 3 and "copied" in effects, effects
    for s in settle:
        a = s.attributes or {}
        assert s.kind is SpanKind.CLIENT and s.name == "settle orders"
        assert a["messaging.operation.type"] == "settle"
        assert a["messaging.operation.name"] == a["trf.effect"]
        assert a["messaging.consumer.group.name"] == "billing"
        parent = next(p for p in process if p.context.span_id == s.parent.span_id)
        assert s.context.trace_id == parent.context.trace_id


async def test_a_failed_finalization_settles_as_failed_with_an_error_status(
    redis_url: str, client: Client, exporter: InMemorySpanExporter
) -> None:
    """The settle span carries the effect Redis answered, not the plan's: a
    dead letter refused (its key holds a string: WRONGTYPE) is ``failed``."""
    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.fields[b"n"] == b"poison" else ACK

    sub = StreamSubscription("orders", "billing", block=0.05, max_attempts=1,
                             dead_letter="orders:dead")
    async with open_consumer(redis_url, name="worker-1") as consumer:
        await consumer.mount(sub, instrument_handler(handle))
        await client.execute("SET", "orders:dead", "not a stream")  # after mount()'s type check
        for n in ("ok", "poison"):
            await client.execute("XADD", "orders", "*", "n", n)
        await until(lambda: len(named(exporter, "settle ")) == 2)
    by_effect = {(s.attributes or {})["trf.effect"]: s for s in named(exporter, "settle ")}
    assert set(by_effect) == {"acked", "failed"}
    assert by_effect["failed"].status.status_code is trace.StatusCode.ERROR
    assert by_effect["acked"].status.status_code is not trace.StatusCode.ERROR


async def test_trace_context_from_producer_to_consumer_every_form(
    redis_url: str, exporter: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("test")

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.attempt == 1 and d.source == "jobs" else ACK

    wrapped = instrument_handler(handle)
    async with open_consumer(redis_url, name="c") as consumer, open_publisher(redis_url) as pub:
        await consumer.mount(StreamSubscription("orders", "g", block=0.05), wrapped)
        await consumer.mount(ReliableListSubscription("jobs", block=0.05), wrapped)
        await consumer.mount(ListSubscription("tasks", block=0.05), wrapped)
        await consumer.mount(PatternSubscription("news.*"), wrapped)
        with tracer.start_as_current_span("checkout") as root:
            await pub.add("orders", {b"n": b"1"})
            await pub.push("jobs", b"job")
            await pub.push("tasks", b"task")
            await pub.publish("news.sport", b"goal")
        await until(lambda: len(named(exporter, "process ")) == 5)  # jobs twice (a retry)
    trace_id = root.get_span_context().trace_id
    sends = {s.attributes["messaging.destination.name"]: s for s in named(exporter, "send ")}
    assert set(sends) == {"orders", "jobs", "tasks", "news.sport"}
    for s in sends.values():
        assert s.kind is SpanKind.PRODUCER and s.context.trace_id == trace_id
        assert s.parent is not None and s.parent.span_id == root.get_span_context().span_id
    process = named(exporter, "process ")
    for s in process:
        dest = s.attributes["messaging.destination.name"]
        assert s.context.trace_id == trace_id, s.name
        assert s.parent is not None and s.parent.span_id == sends[dest].context.span_id, s.name
    jobs = [s for s in process if s.attributes["messaging.destination.name"] == "jobs"]
    assert sorted(s.attributes["trf.attempt"] for s in jobs) == [1, 2]  # the copy keeps the context
    (pattern,) = [s for s in process if s.attributes["messaging.destination.name"] == "news.sport"]
    assert pattern.name == "process news.*"
    assert pattern.attributes["messaging.destination.template"] == "news.*"


async def test_a_foreign_traceparent_field_is_the_parent(
    redis_url: str, client: Client, exporter: InMemorySpanExporter
) -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await client.execute("XADD", "orders", "*", "n", "1", "traceparent", tp)

    seen: list[tuple[dict[bytes, bytes], dict[str, str]]] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append((dict(d.fields), trace_context(d)))  # the field is the library's to read
        return ACK

    async with open_consumer(redis_url, name="c") as consumer:
        await consumer.mount(StreamSubscription("orders", "g", block=0.05), instrument_handler(handle))
        await until(lambda: len(named(exporter, "settle ")) == 1)
    assert seen == [({b"n": b"1"}, {"traceparent": tp})]
    (span,) = named(exporter, "process ")
    assert span.parent is not None and span.parent.is_remote
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(span.parent.span_id, "016x") == "b7ad6b7169203331"


async def test_publishing_inside_a_span_the_handler_sees_only_its_fields(
    redis_url: str, client: Client, exporter: InMemorySpanExporter
) -> None:
    """``pub.add`` inside a span writes ``traceparent``: the handler sees the
    entry's own fields only (``fields``, ``field_list``), at every attempt;
    the RETRY copy keeps the entry's field list byte for byte, the trace
    context included, so the copy's process span has the producer's parent too."""
    tracer = trace.get_tracer("test")
    seen: list[tuple[int, dict[bytes, bytes], tuple[tuple[bytes, bytes], ...]]] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append((d.attempt, dict(d.fields), d.field_list))
        return RETRY if d.attempt == 1 else ACK

    async with open_consumer(redis_url, name="c") as consumer, open_publisher(redis_url) as pub:
        await consumer.mount(StreamSubscription("orders", "g", block=0.05), instrument_handler(handle))
        with tracer.start_as_current_span("checkout"):
            eid = await pub.add("orders", {b"n": b"1", b"m": b"2"})
        await until(lambda: len(named(exporter, "settle ")) == 2)
    assert seen == [(a, {b"n": b"1", b"m": b"2"}, ((b"n", b"1"), (b"m", b"2"))) for a in (1, 2)]
    (orig, copy) = await client.execute("XRANGE", "orders", "-", "+")
    assert orig[0].decode() == eid
    written = orig[1]
    assert written[:4] == [b"n", b"1", b"m", b"2"] and written[4] == b"traceparent"
    assert copy[1][:len(written)] == written  # the copy: the entry's own list, byte for byte
    (send,) = named(exporter, "send ")
    process = named(exporter, "process ")
    assert len(process) == 2
    assert all(s.parent is not None and s.parent.span_id == send.context.span_id for s in process)
