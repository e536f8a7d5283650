"""Reliable-list ACK and Pub/Sub receive throughput: the library against its raw floor.

On one private redis-server, in the same run, N = 20,000 messages each:

* **reliable list, ACK**: N elements LPUSHed beforehand; the library
  (``ReliableListSubscription`` mounted with a handler returning ``ACK``)
  against the floor: our transport alone doing what the library must do per
  element - ``BLMOVE`` (+ pipelined ``LMOVE``, 64 per round trip like the
  reader's largest prefetch) on a dedicated connection, then the ``LREM
  processing -1 element`` of each element (from the tail, the oldest end, as
  the library removes), pipelined on a pool connection.  Timed until the processing
  list is empty.
* **Pub/Sub receive**: N messages PUBLISHed (pipelined, batches of 100) by a
  separate connection; the library (``ChannelSubscription``, handler returning
  ``ACK``) against the floor: a bare ``PubSub.get_message`` loop of our
  transport.  Timed from the first PUBLISH to the N-th message handled.

Each figure is the best of 3 runs.  Rates are messages/s; the ratio column is
relative to the raw floor.

    python -m benchmarks.consume_lists [N]
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

import trio

from trio_redis_finalize import (
    ACK,
    ChannelSubscription,
    Delivery,
    Outcome,
    ReliableListSubscription,
    open_consumer,
)
from trio_redis_finalize._transport import Client, open_client

from ._common import Result, Timer, print_table, redis_server

N = 20_000
QUEUE = "bench:rl"
PROCESSING = "bench:rl:processing"
CHANNEL = "bench:ps"
PREFETCH = 64
REPEAT = 3
RAW = "raw transport"
LIB = "trio_redis_finalize"


async def _fill(client: Client, n: int) -> None:
    await client.execute("DEL", QUEUE, PROCESSING)
    for start in range(0, n, 1000):
        await client.execute(
            "LPUSH", QUEUE, *[f"job-{i:06d}".encode() for i in range(start, min(start + 1000, n))]
        )


async def _raw_reliable(client: Client, n: int) -> float:
    await _fill(client, n)
    done = 0
    async with await client.connect(name="bench-raw-reader") as conn:
        with Timer() as t:
            while done < n:
                cmds: list[tuple[str | bytes, ...]] = [
                    ("BLMOVE", QUEUE, PROCESSING, "RIGHT", "LEFT", "1")
                ]
                cmds += [("LMOVE", QUEUE, PROCESSING, "RIGHT", "LEFT")] * (PREFETCH - 1)
                got = [r for r in await conn.pipeline(cmds) if r is not None]
                await client.pipeline([("LREM", PROCESSING, -1, e) for e in got])
                done += len(got)
    assert await client.execute("LLEN", PROCESSING) == 0
    return t.seconds


async def _lib_reliable(url: str, client: Client, n: int) -> float:
    await _fill(client, n)
    count = 0
    all_in = trio.Event()

    async def handle(d: Delivery) -> Outcome:
        nonlocal count
        count += 1
        if count == n:
            all_in.set()
        return ACK

    name = f"reliable list {QUEUE!r}"
    async with open_consumer(url, name="bench") as consumer:
        with Timer() as t:
            await consumer.mount(
                ReliableListSubscription(QUEUE, processing=PROCESSING, block=1.0), handle
            )
            await all_in.wait()
            while consumer.stats()[name]["effects"].get("acked", 0) < n:
                await trio.sleep(0.001)
    assert await client.execute("LLEN", PROCESSING) == 0
    assert count == n
    return t.seconds


async def _publish(client: Client, n: int) -> None:
    for start in range(0, n, 100):
        await client.pipeline(
            [("PUBLISH", CHANNEL, f"msg-{i:06d}") for i in range(start, min(start + 100, n))]
        )


async def _raw_pubsub(client: Client, publisher: Client, n: int) -> float:
    got = 0
    async with client.pubsub(name="bench-raw-sub") as ps:
        await ps.subscribe(CHANNEL)
        async with trio.open_nursery() as nursery:
            with Timer() as t:
                nursery.start_soon(_publish, publisher, n)
                while got < n:
                    msg = await ps.get_message(timeout=5.0)
                    if msg is None:
                        raise RuntimeError(f"raw Pub/Sub: only {got} of {n} messages arrived")
                    got += 1
    return t.seconds


async def _lib_pubsub(url: str, publisher: Client, n: int) -> float:
    count = 0
    all_in = trio.Event()

    async def handle(d: Delivery) -> Outcome:
        nonlocal count
        count += 1
        if count == n:
            all_in.set()
        return ACK

    async with open_consumer(url, name="bench-ps") as consumer:
        await consumer.mount(ChannelSubscription(CHANNEL), handle)
        async with trio.open_nursery() as nursery:
            with Timer() as t:
                nursery.start_soon(_publish, publisher, n)
                with trio.fail_after(60):
                    await all_in.wait()
    return t.seconds


async def _best(run: Callable[[int], Awaitable[float]], n: int) -> float:
    """Best of ``REPEAT`` timed runs (each is short; the machine may be noisy)."""
    return min([await run(n) for _ in range(REPEAT)])


async def _run(url: str, n: int) -> None:
    async with open_client(url) as client, open_client(url) as publisher:
        # warm-up (script loading, connections, code paths)
        await _raw_reliable(client, 500)
        await _lib_reliable(url, client, 500)
        rl = [
            Result(RAW, n, await _best(lambda k: _raw_reliable(client, k), n)),
            Result(LIB, n, await _best(lambda k: _lib_reliable(url, client, k), n)),
        ]
        print_table(f"reliable list, ACK: {n:,} elements (best of {REPEAT})", rl,
                    baseline=RAW, unit="msg/s")
        await _raw_pubsub(client, publisher, 500)
        await _lib_pubsub(url, publisher, 500)
        ps = [
            Result(RAW, n, await _best(lambda k: _raw_pubsub(client, publisher, k), n)),
            Result(LIB, n, await _best(lambda k: _lib_pubsub(url, publisher, k), n)),
        ]
        print_table(f"Pub/Sub receive: {n:,} messages (best of {REPEAT})", ps,
                    baseline=RAW, unit="msg/s")


def main(n: int = N) -> None:
    with redis_server() as server:
        trio.run(_run, server.url, n)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else N)
