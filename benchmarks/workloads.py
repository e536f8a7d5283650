"""Every workload of the performance contract, in one run, against its raw floor.

One private redis-server; every stream workload preloads N = 20,000 entries
(fields ``payload`` = 32 bytes and ``kind``) into a group of its own.  For
each workload the table shows the library's rate, the **raw floor** -- our
transport alone doing the same Redis work with no library in between -- and
their ratio.  Rates are the best of ``ROUNDS`` interleaved rounds (every
contender of a table runs once per round, in turn, so a noisy moment of the
machine hits them alike).  Entries (or messages) per second; the library's
time runs from ``mount()`` until the last outcome is finalized in Redis (its
``stats()`` counter reaches N, polled every millisecond).

Workloads and their floors:

* **stream ACK / DROP** (concurrency 1 and 16; DROP at 1): ``XREADGROUP COUNT
  100`` on a dedicated connection, one ``XACK`` of the batch on the pool.
* **stream RETRY**: the handler RETRYs every original and ACKs the copies;
  floor: ``XREADGROUP`` then the batch's gated ``stream_copy_ack`` scripts
  pipelined in one round trip.
* **claiming RETRY** (``Mode.CLAIMING``, ``min_idle`` 50 ms, ``block`` 1 ms):
  the handler RETRYs every entry once (it stays in the PEL) and ACKs it when
  it is claimed back; floor: ``XAUTOCLAIM`` (min idle 50 ms) and one ``XACK``
  of what it claimed, then ``XREADGROUP`` of new entries, left pending
  (``BLOCK 1`` once the cursor has gone round the PEL, else not blocking).
  Both wait out the idle time and XAUTOCLAIM's cursor passes over entries
  not yet idle, so this is a round-trip rate more than a CPU one.
* **durable retry_after round trip** (``DelayedRetry.DURABLE_ZSET``,
  ``retry_after(0)``, then ACK of the copy; ``block`` = 20 ms): floor: the
  gated ``stream_zadd_ack`` script per original (pipelined), the
  ``move_due_to_stream`` script (128 per call) before every read, one
  ``XACK`` of the copies of a batch.  Rate = originals whose copy came back
  and was acknowledged, per second.
* **reliable list ACK** and **Pub/Sub receive**: as in ``consume_lists``.
* **latency**: a producer task XADDs at a fixed offered load (5,000 msg/s, in
  bursts of the entries due every millisecond, each carrying its send time
  in a ``ts`` field) to a stream a consumer (concurrency 1, ACK) reads.  The
  consumer's pool client is wrapped so that every ``XACK`` pipeline records,
  when its reply returns, for each id: time since its ``XADD`` was sent
  (end to end) and time since its handler started (handler to finalized).
  The first second is a warm-up and not counted.  p50/p99 in ms.
* **memory**: peak RSS of a child process that only consumes (concurrency
  16, ACK) 20,000 and 200,000 preloaded entries (``consume.peak_rss``), and
  the peak RSS of this benchmark process.

The closing table checks the contract's targets on this run's figures.

    python -m benchmarks workloads [N]
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from trio_redis_finalize import (
    ACK,
    DROP,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    RETRY,
    DelayedRetry,
    Delivery,
    Mode,
    Outcome,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._scripts import MOVE_DUE_TO_STREAM, STREAM_ZADD_ACK
from trio_redis_finalize._envelope import pack_parts
from trio_redis_finalize._keys import derived
from trio_redis_finalize._transport import Client, Command, open_client, parse_url

from . import consume, consume_lists
from ._common import Result, Timer, print_table, redis_server
from .consume import COUNT, STREAM, preload, raw_ack, raw_retry

N = 20_000
BIG = 200_000
ROUNDS = 5
LIB = "trio_redis_finalize"
RAW = "raw transport"
MIN_IDLE = 0.05
CLAIM_BLOCK = 0.001
DURABLE_BLOCK = 0.02
MOVE_LIMIT = 128
RATE = 5_000
LATENCY_SECONDS = 4.0
LATENCY_WARMUP = 1.0
POLL = 0.001
_runs = 0

Run = Callable[[int], Awaitable[float]]


def _group() -> str:
    global _runs
    _runs += 1
    return f"w{_runs}"


def _name(stream: str, group: str) -> str:
    return f"stream {stream!r} group {group!r}"


async def _until(consumer: Any, name: str, effect: str, n: int) -> None:
    while consumer.stats()[name]["effects"].get(effect, 0) < n:
        await trio.sleep(POLL)


async def _pending(client: Client, group: str) -> int:
    return int((await client.execute("XPENDING", STREAM, group))[0])


# -- stream ACK / DROP / RETRY: the library --------------------------------------------

async def lib_stream(url: str, client: Client, n: int, *, outcome: Outcome = ACK,
                     concurrency: int = 1) -> float:
    """Preloaded ``n`` entries, a handler returning ``outcome`` (ACK or DROP)."""
    await preload(client, STREAM, n)
    group = _group()
    effect = "acked" if outcome == ACK else "dropped"

    async def handle(d: Delivery) -> Outcome:
        return outcome

    async with open_consumer(url, name="bench") as consumer:
        with Timer() as t:
            await consumer.mount(StreamSubscription(STREAM, group, count=COUNT), handle,
                                 concurrency=concurrency)
            await _until(consumer, _name(STREAM, group), effect, n)
    assert await _pending(client, group) == 0
    return t.seconds


async def lib_retry(url: str, client: Client, n: int) -> float:
    await preload(client, STREAM, n)
    group = _group()

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.attempt == 1 else ACK

    async with open_consumer(url, name="bench") as consumer:
        with Timer() as t:
            await consumer.mount(StreamSubscription(STREAM, group, count=COUNT), handle)
            await _until(consumer, _name(STREAM, group), "copied", n)
    assert await client.execute("XLEN", STREAM) == 2 * n
    return t.seconds


# -- claiming RETRY --------------------------------------------------------------------------

async def raw_claiming(client: Client, n: int) -> float:
    await preload(client, STREAM, n)
    group = _group()
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    idle = round(MIN_IDLE * 1000)
    acked = 0
    cursor: bytes | str = "0-0"
    async with await client.connect(name="bench-raw-reader") as conn:
        with Timer() as t:
            while acked < n:
                reply = await conn.execute("XAUTOCLAIM", STREAM, group, "raw", idle, cursor,
                                           "COUNT", COUNT)
                cursor = reply[0]
                ids = [e[0] for e in reply[1] if e is not None]
                if ids:  # second delivery: ACK
                    await client.execute("XACK", STREAM, group, *ids)
                    acked += len(ids)
                # first delivery: RETRY = leave it in the PEL; block only when
                # the cursor went round the whole PEL (as the library does)
                wait = ("BLOCK", round(CLAIM_BLOCK * 1000)) if cursor == b"0-0" else ()
                await conn.execute("XREADGROUP", "GROUP", group, "raw", "COUNT", COUNT, *wait,
                                   "STREAMS", STREAM, ">")
    assert await _pending(client, group) == 0
    return t.seconds


async def lib_claiming(url: str, client: Client, n: int) -> float:
    await preload(client, STREAM, n)
    group = _group()

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.attempt == 1 else ACK

    sub = StreamSubscription(STREAM, group, mode=Mode.CLAIMING, min_idle=MIN_IDLE,
                             block=CLAIM_BLOCK, count=COUNT)
    async with open_consumer(url, name="bench") as consumer:
        with Timer() as t:
            await consumer.mount(sub, handle)
            await _until(consumer, _name(STREAM, group), "acked", n)
    assert await _pending(client, group) == 0
    return t.seconds


# -- durable retry_after round trip -------------------------------------------------------------

DELAY_KEY = derived(STREAM, ":delayed")


async def raw_durable(client: Client, n: int) -> float:
    await preload(client, STREAM, n)
    await client.execute("DEL", DELAY_KEY)
    group = _group()
    await client.execute("XGROUP", "CREATE", STREAM, group, "0")
    acked = 0
    async with await client.connect(name="bench-raw-reader") as conn:
        with Timer() as t:
            while acked < n:
                await client.evalsha(MOVE_DUE_TO_STREAM, (DELAY_KEY, STREAM), (MOVE_LIMIT,))
                reply = await conn.execute("XREADGROUP", "GROUP", group, "raw", "COUNT", COUNT,
                                           "BLOCK", 1, "STREAMS", STREAM, ">")
                if not reply:
                    continue
                copies: list[bytes] = []
                cmds: list[Command] = []
                for eid, flat in reply[0][1]:
                    if RETRIES_FIELD in flat[::2]:
                        copies.append(eid)
                        continue
                    member = pack_parts([uuid.uuid4().bytes, *flat, RETRIES_FIELD, b"1",
                                         ORIGIN_FIELD, eid])
                    cmds.append(STREAM_ZADD_ACK.command((STREAM, DELAY_KEY), (group, eid, 0, member)))
                if copies:
                    cmds.append(("XACK", STREAM, group, *copies))
                    acked += len(copies)
                await client.pipeline(cmds)
    assert await _pending(client, group) == 0
    return t.seconds


async def lib_durable(url: str, client: Client, n: int) -> float:
    await preload(client, STREAM, n)
    await client.execute("DEL", DELAY_KEY)
    group = _group()
    again = retry_after(0)

    async def handle(d: Delivery) -> Outcome:
        return again if d.attempt == 1 else ACK

    sub = StreamSubscription(STREAM, group, delayed_retry=DelayedRetry.DURABLE_ZSET,
                             block=DURABLE_BLOCK, count=COUNT)
    async with open_consumer(url, name="bench") as consumer:
        with Timer() as t:
            await consumer.mount(sub, handle)
            await _until(consumer, _name(STREAM, group), "acked", n)
    assert await _pending(client, group) == 0
    return t.seconds


# -- latency at a fixed offered load ------------------------------------------------------------

LATENCY_STREAM = "bench:latency"


def _ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class _TimedClient(Client):
    """The consumer's pool client: times every XACK of the latency stream."""

    sent: dict[str, tuple[int, int]]  # entry id -> (XADD sent, handler started), ns
    end_to_end: list[int]
    handler_to_final: list[int]
    count_after: int

    async def pipeline(self, commands: Sequence[Command], **kw: Any) -> list[Any]:
        replies = await super().pipeline(commands, **kw)
        now = _ns()
        for c in commands:
            if c[0] == "XACK" and c[1] == LATENCY_STREAM:
                for eid in c[3:]:
                    times = self.sent.pop(str(eid), None)
                    if times is None:  # an XACK sent again after a failure
                        continue
                    xadd, started = times
                    if xadd >= self.count_after:
                        self.end_to_end.append(now - xadd)
                        self.handler_to_final.append(now - started)
        return replies


async def _produce(client: Client, rate: int, seconds: float) -> int:
    """XADD ``rate`` entries per second for ``seconds``; the entries due are sent
    together every time the loop wakes (about every millisecond)."""
    total = round(rate * seconds)
    sent = 0
    start = _ns()
    while sent < total:
        due = min(total, (_ns() - start) * rate // 1_000_000_000) - sent
        if due > 0:
            now = _ns()
            await client.pipeline(
                [("XADD", LATENCY_STREAM, "*", "ts", now, "payload", consume.PAYLOAD)] * due
            )
            sent += due
        else:
            await trio.sleep(max(0.0, (sent + 1) / rate - (_ns() - start) / 1e9))
    return sent


async def latency(url: str, publisher: Client, rate: int = RATE,
                  seconds: float = LATENCY_SECONDS) -> tuple[list[int], list[int], float]:
    """(end-to-end ns, handler-to-finalized ns, achieved offered rate)."""
    await publisher.execute("DEL", LATENCY_STREAM)
    client = _TimedClient(parse_url(url), name="trf:bench-latency", max_connections=64)
    client.sent = {}
    client.end_to_end = []
    client.handler_to_final = []
    client.count_after = _ns() + round(LATENCY_WARMUP * 1e9)
    sent_map = client.sent

    async def handle(d: Delivery) -> Outcome:
        assert d.id is not None
        sent_map[d.id] = (int(d.fields[b"ts"]), _ns())
        return ACK

    group = _group()
    name = _name(LATENCY_STREAM, group)
    try:
        async with open_consumer(client, name="bench-latency") as consumer:
            await consumer.mount(StreamSubscription(LATENCY_STREAM, group, count=COUNT), handle)
            with Timer() as t:
                total = await _produce(publisher, rate, LATENCY_WARMUP + seconds)
            await _until(consumer, name, "acked", total)
    finally:
        await client.aclose()
    await publisher.execute("DEL", LATENCY_STREAM)
    return client.end_to_end, client.handler_to_final, total / t.seconds


def _pct(values: list[int], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` in ms."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


# -- the run ----------------------------------------------------------------------------------------

async def _rounds(runs: dict[str, Run], n: int) -> list[Result]:
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(ROUNDS):
        for label, run in runs.items():
            best[label] = min(best[label], await run(n))
    return [Result(label, n, seconds) for label, seconds in best.items()]


def _ratio(results: list[Result], label: str, floor: str) -> float:
    by = {r.label: r.rate for r in results}
    return by[label] / by[floor]


async def _run(url: str, n: int) -> None:
    ratios: dict[str, float] = {}
    async with open_client(url) as client, open_client(url) as publisher:
        # warm-up: connections, script cache, code paths
        await raw_ack(client, 500)
        await lib_stream(url, client, 500)
        await lib_retry(url, client, 500)
        await lib_durable(url, client, 500)

        c1, c16, drop = f"{LIB}, ACK, concurrency 1", f"{LIB}, ACK, concurrency 16", f"{LIB}, DROP"
        ack = await _rounds({
            RAW: lambda k: raw_ack(client, k),
            c1: lambda k: lib_stream(url, client, k),
            c16: lambda k: lib_stream(url, client, k, concurrency=16),
            drop: lambda k: lib_stream(url, client, k, outcome=DROP),
        }, n)
        print_table(f"stream ACK / DROP: {n:,} entries, COUNT {COUNT} (best of {ROUNDS})", ack,
                    baseline=RAW, unit="entries/s")
        ratios["stream ACK, concurrency 1"] = _ratio(ack, c1, RAW)
        ratios["stream ACK, concurrency 16"] = _ratio(ack, c16, RAW)
        ratios["stream DROP"] = _ratio(ack, drop, RAW)

        floor = RAW + " (gated scripts)"
        retry = await _rounds({
            floor: lambda k: raw_retry(client, k),
            LIB: lambda k: lib_retry(url, client, k),
        }, n)
        print_table(f"stream RETRY (copy then XACK): {n:,} entries (best of {ROUNDS})", retry,
                    baseline=floor, unit="entries/s")
        ratios["stream RETRY"] = _ratio(retry, LIB, floor)

        claiming = await _rounds({
            RAW: lambda k: raw_claiming(client, k),
            LIB: lambda k: lib_claiming(url, client, k),
        }, n)
        print_table(f"claiming RETRY then ACK of the reclaimed entry: {n:,} entries, min_idle "
                    f"{MIN_IDLE * 1000:g} ms (best of {ROUNDS})", claiming, baseline=RAW,
                    unit="entries/s")
        ratios["claiming RETRY"] = _ratio(claiming, LIB, RAW)

        floor = RAW + " (gated scripts)"
        durable = await _rounds({
            floor: lambda k: raw_durable(client, k),
            LIB: lambda k: lib_durable(url, client, k),
        }, n)
        print_table(f"durable retry_after(0) round trip: {n:,} entries (best of {ROUNDS})",
                    durable, baseline=floor, unit="entries/s")
        ratios["durable retry_after"] = _ratio(durable, LIB, floor)
        await client.execute("DEL", STREAM, DELAY_KEY)

        await consume_lists._raw_reliable(client, 500)
        await consume_lists._lib_reliable(url, client, 500)
        rl = await _rounds({
            RAW: lambda k: consume_lists._raw_reliable(client, k),
            LIB: lambda k: consume_lists._lib_reliable(url, client, k),
        }, n)
        print_table(f"reliable list ACK: {n:,} elements (best of {ROUNDS})", rl, baseline=RAW,
                    unit="msg/s")
        ratios["reliable list ACK"] = _ratio(rl, LIB, RAW)

        await consume_lists._raw_pubsub(client, publisher, 500)
        await consume_lists._lib_pubsub(url, publisher, 500)
        ps = await _rounds({
            RAW: lambda k: consume_lists._raw_pubsub(client, publisher, k),
            LIB: lambda k: consume_lists._lib_pubsub(url, publisher, k),
        }, n)
        print_table(f"Pub/Sub receive: {n:,} messages (best of {ROUNDS})", ps, baseline=RAW,
                    unit="msg/s")
        ratios["Pub/Sub receive"] = _ratio(ps, LIB, RAW)

        e2e, h2f, offered = await latency(url, publisher)
        print(f"\nlatency at {RATE:,} msg/s offered ({offered:,.0f} achieved), "
              f"{len(e2e):,} entries after a {LATENCY_WARMUP:g} s warm-up, ms")
        print(f"  {'':24}  {'p50':>7}  {'p90':>7}  {'p99':>7}  {'max':>7}  {'mean':>7}")
        for label, values in (("XADD -> XACK returned", e2e), ("handler -> XACK returned", h2f)):
            print(f"  {label:24}  {_pct(values, 0.5):7.2f}  {_pct(values, 0.9):7.2f}  "
                  f"{_pct(values, 0.99):7.2f}  {max(values) / 1e6:7.2f}  "
                  f"{statistics.fmean(values) / 1e6:7.2f}")

        small = await consume.peak_rss(url, client, n)
        big = await consume.peak_rss(url, client, BIG)
        print("\nmemory of a consumer process (concurrency 16, ACK), KiB")
        print(f"  {'entries':>9}  {'peak RSS':>9}  {'RSS before mount':>16}  "
              f"{'highest while consuming':>23}")
        for k, (peak, before, highest, secs) in ((n, small), (BIG, big)):
            print(f"  {k:>9,}  {peak:>9,}  {before:>16,}  {highest:>23,}   "
                  f"({k / secs:,.0f} entries/s with start-up)")
        rss_ratio = big[0] / small[0]
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"  peak RSS of this benchmark process: {own:,} KiB")

    p99 = _pct(e2e, 0.99)
    print(f"\nsummary ({n:,} entries, best of {ROUNDS}): library / raw floor")
    for label, r in ratios.items():
        print(f"  {label:28}  {r:5.2f}x")
    print("\ntargets")
    checks = [
        ("stream ACK, concurrency 1 >= 0.35 x floor", ratios["stream ACK, concurrency 1"] >= 0.35,
         f"{ratios['stream ACK, concurrency 1']:.2f}x"),
        ("stream RETRY >= 0.35 x floor", ratios["stream RETRY"] >= 0.35,
         f"{ratios['stream RETRY']:.2f}x"),
        (f"peak RSS {BIG:,} within 20 % of {n:,}", rss_ratio <= 1.2, f"{rss_ratio:.3f}"),
        (f"p99 XADD -> XACK at {RATE:,} msg/s < 20 ms", p99 < 20, f"{p99:.2f} ms"),
    ]
    for label, ok, value in checks:
        print(f"  {label:44}  {value:>9}  {'met' if ok else 'MISSED'}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    args = argv or []
    n = int(args[0]) if args else N
    with redis_server() as server:
        trio.run(_run, server.url, n)


if __name__ == "__main__":
    main(sys.argv[1:])
