"""Observability: the Prometheus collector (scraped for real, over HTTP from
another thread), OpenTelemetry spans around handler calls, and structured
log records (subscription, entry id, attempt, outcome as ``extra=`` fields)."""

from __future__ import annotations

import logging
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
import trio
from _procs import always, eventually
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    Backoff,
    DelayedRetry,
    Delivery,
    ListSubscription,
    Outcome,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._transport import Client
from trio_redis_finalize.otel import instrument_handler
from trio_redis_finalize.prometheus import register
from trio_redis_finalize.testing import free_port

S, G = "orders", "billing"
SUB = StreamSubscription(S, G, block=0.05)
NAME = SUB.name
SL = {"form": "stream", "key": S, "group": G}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse the text exposition: (sample name, sorted labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples(generate_latest(registry).decode())


def lbl(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


async def xadd(client: Client, n: str) -> str:
    return str((await client.execute("XADD", S, "*", "n", n)).decode())


def by_n(d: Delivery) -> bytes:
    return d.fields[b"n"]


# -- Prometheus ------------------------------------------------------------------------


async def test_prometheus_families_match_stats(redis_url: str, client: Client) -> None:
    """Every family reads consumer.stats() at scrape time: received, outcomes,
    effects, errors, in-flight, held runtime copies, delay-set lag."""
    for n in ("ack", "retry", "drop", "later", "boom"):
        await xadd(client, n)
    release = trio.Event()
    decide: dict[bytes, Outcome] = {b"ack": ACK, b"drop": DROP, b"later": retry_after(30)}

    async def handle(d: Delivery) -> Outcome:
        if by_n(d) == b"retry":
            return RETRY if d.attempt == 1 else ACK
        if by_n(d) == b"boom":
            if d.attempt == 1:
                raise RuntimeError("boom")
            await release.wait()  # stays in flight until released
            return ACK
        return decide[by_n(d)]

    registry = CollectorRegistry()
    async with open_consumer(redis_url, name="c1") as consumer:
        register(consumer, registry)
        assert not [k for k in scrape(registry) if k[0] == "trf_deliveries_read_total"]  # nothing mounted yet
        await consumer.mount(SUB, handle)
        # the raise backs off (the default on_error): the same entry, in flight again
        await eventually(lambda: consumer.stats()[NAME]["in_flight"] == 1, what="boom again in flight")
        got = scrape(registry)
        st = consumer.stats()[NAME]
        assert got[("trf_deliveries_read_total", lbl(**SL))] == st["received"] == 7
        for outcome, n in {"ack": 2, "retry": 1, "drop": 1, "retry_after": 1, "backoff": 1}.items():
            assert got[("trf_handler_outcomes_total", lbl(**SL, outcome=outcome))] == n
            assert st["outcomes"][outcome] == n
        for effect, n in st["effects"].items():
            assert got[("trf_effects_total", lbl(**SL, effect=effect))] == n
        assert st["effects"]["copied"] == 1 and st["effects"]["held"] == 1, st["effects"]
        assert st["effects"]["backed_off"] == 1, st["effects"]
        assert got[("trf_errors_total", lbl(**SL, kind="handler"))] == 1
        assert got[("trf_errors_total", lbl(**SL, kind="read"))] == 0
        assert got[("trf_in_flight", lbl(**SL))] == 1
        assert got[("trf_held_copies", lbl(**SL))] == 1  # retry_after(30), runtime
        assert ("trf_delay_lag_seconds", lbl(**SL)) not in got  # no delay set
        release.set()
        await eventually(lambda: consumer.stats()[NAME]["in_flight"] == 0)
        assert scrape(registry)[("trf_in_flight", lbl(**SL))] == 0
    # after the consumer closed: final counters, the held copy written at shutdown
    final = scrape(registry)
    assert final[("trf_held_copies", lbl(**SL))] == 0
    assert final[("trf_handler_outcomes_total", lbl(**SL, outcome="ack"))] == 3


async def test_prometheus_delay_lag_of_the_durable_set(redis_url: str, client: Client) -> None:
    sub = StreamSubscription(S, G, block=0.05, delayed_retry=DelayedRetry.DURABLE_ZSET)
    await xadd(client, "x")

    async def handle(d: Delivery) -> Outcome:
        return retry_after(30) if d.attempt == 1 else ACK

    registry = CollectorRegistry()
    async with open_consumer(redis_url, name="c1") as consumer:
        register(consumer, registry)
        await consumer.mount(sub, handle)
        await eventually(lambda: consumer.stats()[sub.name]["delay_lag"] is not None, what="lag known")
        got = scrape(registry)
        assert got[("trf_delay_lag_seconds", lbl(**SL))] == 0.0  # waiting, not due
        assert got[("trf_effects_total", lbl(**SL, effect="delayed"))] == 1
        assert got[("trf_held_copies", lbl(**SL))] == 0  # in Redis, not in memory
    assert await client.execute("ZCARD", "{orders}:delayed") == 1


async def test_prometheus_scraped_over_http_from_another_thread(redis_url: str, client: Client) -> None:
    """The real set-up: start_http_server's thread reads stats() while the
    consumer keeps counting in the event loop's thread."""
    registry = CollectorRegistry()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        async with open_consumer(redis_url, name="c1") as consumer:
            register(consumer, registry)

            await consumer.mount(SUB, always(ACK))
            await client.pipeline([("XADD", S, "*", "n", str(i)) for i in range(300)])

            def get() -> str:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return str(r.read().decode())

            seen: list[float] = []
            with trio.fail_after(10):
                while not seen or seen[-1] < 300:
                    got = samples(await trio.to_thread.run_sync(get))
                    seen.append(got[("trf_deliveries_read_total", lbl(**SL))])
                    await trio.sleep(0.01)
            assert seen == sorted(seen)  # a counter never goes backwards
            await eventually(lambda: consumer.stats()[NAME]["effects"].get("acked") == 300)
            got = samples(await trio.to_thread.run_sync(get))
            assert got[("trf_effects_total", lbl(**SL, effect="acked"))] == 300
    finally:
        server.shutdown()
        thread.join(5)


async def test_prometheus_several_consumers_share_one_collector(redis_url: str) -> None:
    registry = CollectorRegistry()

    lst = ListSubscription("jobs", block=0.05)
    async with open_consumer(redis_url, name="a") as a, open_consumer(redis_url, name="b") as b:
        await a.mount(lst, always(ACK))
        await b.mount(lst, always(ACK))
        collector = register(a, registry, labels={"worker": "a"})
        assert register(b, registry, labels={"worker": "b"}) is collector
        with pytest.raises(ValueError, match="labels"):
            register(b, registry)  # other label names than the registered ones
        with pytest.raises(ValueError, match="already registered"):
            register(a, registry, labels={"worker": "x"})
        with pytest.raises(ValueError, match="labels"):
            register(a, CollectorRegistry(), labels={"key": "x"})
        got = scrape(registry)
        assert got[("trf_deliveries_read_total", lbl(form="list", key="jobs", group="", worker="a"))] == 0
        assert got[("trf_deliveries_read_total", lbl(form="list", key="jobs", group="", worker="b"))] == 0
        collector.remove(b)
        assert collector.consumers() == [a]
        gone = ("trf_deliveries_read_total", lbl(form="list", key="jobs", group="", worker="b"))
        assert gone not in scrape(registry)


def test_prometheus_families_add_up_equal_labels() -> None:
    """Two consumers with the same form, key, group and labels: counters and
    gauges add up, the delay lag is the largest, histogram buckets add up."""
    from trio_redis_finalize._metrics import MountSample, families
    from trio_redis_finalize._stats import DURATION_BOUNDS

    def st(received: int, lag: float | None) -> list[MountSample]:
        buckets = [0] * (len(DURATION_BOUNDS) + 1)
        buckets[0] = received
        return [MountSample("stream", "s", "g", {
            "received": received, "outcomes": {"ack": received}, "effects": {},
            "in_flight": 1, "held": 2, "delay_lag": lag}, buckets, 0.5)]

    fams = {f.name: f for f in families([(st(3, 0.5), ()), (st(4, None), ()), (st(1, 2.0), ())])}
    k = ("stream", "s", "g")
    assert fams["trf_deliveries_read"].samples == [(k, 8.0)]
    assert dict(fams["trf_handler_outcomes"].samples) == {
        (*k, "ack"): 8.0, (*k, "retry"): 0.0, (*k, "drop"): 0.0, (*k, "retry_after"): 0.0,
        (*k, "reject"): 0.0, (*k, "backoff"): 0.0}
    assert fams["trf_in_flight"].samples == [(k, 3.0)]
    assert fams["trf_held_copies"].samples == [(k, 6.0)]
    assert fams["trf_delay_lag_seconds"].samples == [(k, 2.0)]
    ((labels, (cum, total)),) = fams["trf_handler_duration_seconds"].samples
    assert labels == k and cum == [8] * (len(DURATION_BOUNDS) + 1) and total == 1.5
    assert {f.name for f in families([], prefix="app_q")} >= {"app_q_effects", "app_q_group_lag"}


async def test_prometheus_every_series_from_zero_with_help_and_histogram(
    redis_url: str, client: Client
) -> None:
    """Before any message: every outcome, effect and error series is there at 0;
    HELP says reads are not handler calls; the histogram counts handler calls."""
    registry = CollectorRegistry()

    async def handle(d: Delivery) -> Outcome:
        await trio.sleep(0.02)
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        register(consumer, registry, prefix="shop")
        await consumer.mount(SUB, handle)
        text = generate_latest(registry).decode()
        got = samples(text)
        for outcome in ("ack", "retry", "drop", "retry_after", "backoff"):
            assert got[("shop_handler_outcomes_total", lbl(**SL, outcome=outcome))] == 0
        for effect in ("acked", "dropped", "copied", "delayed", "held", "left_pending",
                       "dead_lettered", "exhausted", "refused", "lost_before_handling",
                       "backed_off", "gate_closed", "failed", "foreign_copy", "trimmed"):
            assert got[("shop_effects_total", lbl(**SL, effect=effect))] == 0, effect
        assert got[("shop_handler_duration_seconds_count", lbl(**SL))] == 0
        assert "# HELP shop_deliveries_read_total Deliveries read from Redis" in text
        assert "not handler calls" in text
        assert not [k for k in got if "subscription" in dict(k[1])]
        for i in range(3):
            await xadd(client, str(i))
        await eventually(lambda: consumer.stats()[NAME]["effects"].get("acked") == 3)
        got = scrape(registry)
        assert got[("shop_handler_duration_seconds_count", lbl(**SL))] == 3
        assert got[("shop_handler_duration_seconds_bucket", lbl(**SL, le="0.01"))] == 0  # slept 0.02
        assert got[("shop_handler_duration_seconds_bucket", lbl(**SL, le="+Inf"))] == 3
        assert got[("shop_handler_duration_seconds_sum", lbl(**SL))] >= 0.06
    with pytest.raises(ValueError, match="prefix"):
        register(consumer, CollectorRegistry(), prefix="no-dashes")


def test_every_effect_and_outcome_the_package_counts_is_exported_from_zero() -> None:
    """The package's source names each effect it counts (``effects["x"]``,
    ``Effect.X``, the ``GATE_CLOSED`` / ``FAILED`` answers) and each outcome:
    all of them are in the families' from-0 lists, so the README's "every
    series from 0" holds for series added later too."""
    import re
    from pathlib import Path

    import trio_redis_finalize
    from trio_redis_finalize._core._types import FAILED, GATE_CLOSED, Effect
    from trio_redis_finalize._metrics import EFFECTS, OUTCOMES

    root = Path(trio_redis_finalize.__file__).parent
    source = "\n".join(p.read_text() for p in root.rglob("*.py"))
    counted = set(re.findall(r"effects\[\"(\w+)\"\]", source))
    counted |= {e.value for e in Effect} | {GATE_CLOSED, FAILED}
    assert counted <= set(EFFECTS), counted - set(EFFECTS)
    assert {"backed_off", "gate_closed", "failed", "foreign_copy", "trimmed"} <= counted
    assert set(re.findall(r"outcomes\[\"(\w+)\"\]", source)) <= set(OUTCOMES)
    assert "backoff" in OUTCOMES


async def test_serve_exposes_the_process_metrics(redis_url: str) -> None:
    """``serve`` without a registry: the process metrics beside the consumer's."""
    from trio_redis_finalize.prometheus import serve

    port = free_port()
    async with open_consumer(redis_url, name="c1") as consumer, trio.open_nursery() as n:
        await consumer.mount(SUB, _ack_one)
        await n.start(lambda task_status: serve(consumer, port, host="127.0.0.1",
                                                task_status=task_status))
        body = await trio.to_thread.run_sync(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read())
        n.cancel_scope.cancel()
    got = samples(body.decode())
    assert got[("process_resident_memory_bytes", ())] > 0
    assert ("process_cpu_seconds_total", ()) in got and ("process_open_fds", ()) in got
    assert any(name == "python_info" for name, _ in got)
    assert got[("trf_effects_total", lbl(**SL, effect="backed_off"))] == 0


async def test_serve_on_a_port_in_use_names_it(redis_url: str) -> None:
    """Before: ``[Errno 98] Address already in use``, no address named."""
    import errno
    import socket

    from trio_redis_finalize.prometheus import serve

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        async with open_consumer(redis_url, name="c1") as consumer:
            with trio.fail_after(10), pytest.raises(
                    OSError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}: address already "
                                   "in use") as info:
                await serve(consumer, port, host="127.0.0.1")
    assert info.value.errno == errno.EADDRINUSE


async def _ack() -> Outcome:
    return ACK


async def _ack_one(d: Delivery) -> Outcome:  # mount() refuses a lambda: an async def
    return ACK


async def test_histogram_counts_every_call_of_runs_of_fast_calls(redis_url: str, client: Client) -> None:
    """The handler loop keeps a run's fast calls (first bucket) and its time in
    locals and adds them when the run ends: every call is counted once, in its
    bucket, whether the run ended at a batch's end or at a slow call."""
    registry = CollectorRegistry()
    slow = {b"50", b"150"}

    async def handle(d: Delivery) -> Outcome:
        if by_n(d) in slow:
            await trio.sleep(0.02)  # ends the run it is in (a slow call)
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        register(consumer, registry, prefix="shop")
        await client.pipeline([("XADD", S, "*", "n", str(i)) for i in range(300)])
        start = trio.current_time()
        await consumer.mount(StreamSubscription(S, G, block=0.05, count=100), handle)
        await eventually(lambda: consumer.stats()[NAME]["effects"].get("acked") == 300)
        took = trio.current_time() - start
        got = scrape(registry)
    count = got[("shop_handler_duration_seconds_count", lbl(**SL))]
    assert count == 300
    assert got[("shop_handler_duration_seconds_bucket", lbl(**SL, le="+Inf"))] == 300
    # the two slow calls are above 10 ms; the fast ones below (but for a rare
    # pause of this shared machine, a garbage collection, in one of them)
    assert 290 <= got[("shop_handler_duration_seconds_bucket", lbl(**SL, le="0.01"))] <= 298
    assert 0.04 <= got[("shop_handler_duration_seconds_sum", lbl(**SL))] <= took


async def test_prometheus_group_lag_pending_and_oldest_idle(redis_url: str, client: Client) -> None:
    """The KEDA-style gauges come from Redis: lag (undelivered), pending (PEL), oldest idle."""
    from trio_redis_finalize.prometheus import refresh_backlog

    registry = CollectorRegistry()
    release = trio.Event()

    async def handle(d: Delivery) -> Outcome:
        await release.wait()
        return ACK

    for i in range(5):
        await xadd(client, str(i))
    sub = StreamSubscription(S, G, block=0.05, count=2)
    async with open_consumer(redis_url, name="c1") as consumer:
        register(consumer, registry)
        await consumer.mount(sub, handle)
        await eventually(lambda: consumer.stats()[sub.name]["in_flight"] == 1)
        await trio.sleep(0.2)
        await refresh_backlog(consumer)
        got = scrape(registry)
        pending = (await client.execute("XPENDING", S, G))[0]
        assert 2 <= pending < 5  # batches of count=2 read ahead, the first one held up
        assert got[("trf_pending", lbl(**SL))] == pending
        version = await client.execute("INFO", "server")
        if b"redis_version:6." not in version:  # 6.2 has no lag field
            assert got[("trf_group_lag", lbl(**SL))] == 5 - pending
        assert got[("trf_oldest_pending_idle_seconds", lbl(**SL))] >= 0.1
        release.set()
        await eventually(lambda: consumer.stats()[sub.name]["effects"].get("acked") == 5)
        await refresh_backlog(consumer)
        got = scrape(registry)
        assert got[("trf_pending", lbl(**SL))] == 0
        assert got[("trf_group_lag", lbl(**SL))] == 0
        assert got[("trf_oldest_pending_idle_seconds", lbl(**SL))] == 0


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter, which must succeed."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def test_prometheus_module_without_the_extra_names_it() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "try:\n"
        "    import trio_redis_finalize.prometheus\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('imported without prometheus-client')\n"
    )
    out = run_python(code)
    assert "pip install '.[prometheus]' in a checkout" in out.stdout


# -- OpenTelemetry ---------------------------------------------------------------------


async def test_otel_span_per_handler_call(redis_url: str, client: Client) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    ids = {n: await xadd(client, n) for n in ("ack", "retry", "boom", "bad", "later")}

    async def handle(d: Delivery) -> Any:
        n = by_n(d)
        if d.attempt > 1:
            return ACK
        with tracer.start_as_current_span("child"):  # the handler's own span nests
            pass
        if n == b"boom":
            raise ValueError("boom")
        return {b"ack": ACK, b"retry": RETRY, b"bad": "not an outcome", b"later": retry_after(0.05)}[n]

    wrapped = instrument_handler(handle, tracer=tracer)
    assert wrapped.__name__ == "handle"
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(SUB, wrapped)
        await eventually(lambda: consumer.stats()[NAME]["outcomes"].get("ack") == 5, what="all acked")
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith("process ")]
    assert len(spans) == 9  # 5 first attempts, 4 second ones (the ack needs none)
    first = {s.attributes["messaging.message.id"]: s for s in spans if s.attributes["trf.attempt"] == 1}
    outcome = {n: first[ids[n]].attributes["trf.outcome"] for n in ids}
    assert outcome == {"ack": "ack", "retry": "retry", "boom": "error", "bad": "invalid",
                       "later": "retry_after"}
    for s in spans:
        assert s.kind is SpanKind.CONSUMER and s.name == f"process {S}"
        assert s.attributes["trf.subscription"] == NAME
        assert s.attributes["messaging.system"] == "redis"
        assert s.attributes["messaging.destination.name"] == S
        assert s.attributes["trf.id"] == s.attributes["messaging.message.id"]
    assert first[ids["later"]].attributes["trf.delay"] == 0.05
    boom = first[ids["boom"]]
    assert boom.status.status_code is StatusCode.ERROR and "ValueError: boom" in str(boom.status.description)
    assert [e.name for e in boom.events] == ["exception"]
    assert first[ids["bad"]].status.status_code is StatusCode.ERROR
    assert first[ids["ack"]].status.status_code is StatusCode.UNSET
    retried = [s for s in spans if s.attributes["trf.attempt"] == 2]
    assert {s.attributes["trf.origin_id"] for s in retried} == {
        ids[n] for n in ("retry", "boom", "bad", "later")}
    children = [s for s in exporter.get_finished_spans() if s.name == "child"]
    assert len(children) == 5
    parents = {s.context.span_id for s in spans}
    assert all(c.parent is not None and c.parent.span_id in parents for c in children)


def test_otel_without_the_api_returns_the_handler_itself() -> None:
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from trio_redis_finalize._otel import instrument_handler\n"
        "async def handle(d): ...\n"
        "assert instrument_handler(handle) is handle\n"
        "print('unchanged')\n"
    )
    out = run_python(code)
    assert out.stdout.strip() == "unchanged"


# -- structured logs -------------------------------------------------------------------


@pytest.mark.parametrize("on_error", [RETRY, Backoff(base=0.01, cap=0.02, window=0)],
                         ids=["retry", "backoff"])
async def test_log_records_carry_subscription_id_attempt_outcome(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture, on_error: Outcome | Backoff
) -> None:
    boom = await xadd(client, "boom")
    fine = await xadd(client, "fine")

    async def handle(d: Delivery) -> Outcome:
        if by_n(d) == b"boom":
            raise RuntimeError("boom")
        return ACK

    caplog.set_level(logging.DEBUG, logger="trio_redis_finalize")
    sub = StreamSubscription(S, G, block=0.05, max_attempts=2, dead_letter=None)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, handle, on_error=on_error)
        await eventually(lambda: consumer.stats()[sub.name]["effects"].get("exhausted") == 1)
    recs = [r for r in caplog.records if getattr(r, "subscription", None) == sub.name]
    raised = [r for r in recs if "handler raised" in r.getMessage()]
    kind = "retry" if on_error is RETRY else "backoff"
    assert [(r.attempt, r.outcome, r.origin_id) for r in raised] == [(1, kind, boom), (2, kind, boom)]
    assert raised[0].entry_id == boom
    if on_error is RETRY:  # attempt 2 is the copy
        assert raised[1].entry_id not in (boom, fine, None)
    else:  # the same entry, delivered again
        assert raised[1].entry_id == boom
    exhausted = [r for r in recs if getattr(r, "effect", None) == "exhausted"]
    assert len(exhausted) == 1 and exhausted[0].levelno == logging.WARNING
    assert (exhausted[0].attempt, exhausted[0].outcome) == (2, kind)
    acked = [r for r in recs if r.levelno == logging.DEBUG and getattr(r, "entry_id", None) == fine]
    assert [(r.effect, r.outcome, r.attempt) for r in acked] == [("acked", "ack", 1)]
