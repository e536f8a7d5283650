"""A queue in trouble, made for real, for the dashboard's tests.

``orders`` / group ``billing``: a consumer with ``max_attempts=1`` and a
dead letter dead-letters the messages its handler retries (reasons as the
library writes them) and writes its per-minute history; then a consumer
``worker-dead`` reads three entries and dies (registered, no heartbeat:
lapsed, its three entries stranded), ``worker-live`` keeps a heartbeat, 150
entries wait unread (the group lags) and a copy in the delay set is two
minutes overdue.
"""

from __future__ import annotations

import anyio

from trio_redis_finalize import (
    ACK,
    RETRY,
    Delivery,
    Mode,
    Outcome,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._core.stream import liveness as presence
from trio_redis_finalize._transport import Client

STREAM = "orders"
GROUP = "billing"
DEAD = "{orders}:dead"
LAG = 150
STRANDED = 3
BAD = 2  # dead-lettered


def totals(flat: list[bytes]) -> dict[str, int]:
    """A history hash's counts summed over its minutes, by counter."""
    out: dict[str, int] = {}
    for f, v in zip(flat[::2], flat[1::2], strict=True):
        name = f.decode().partition(":")[2]
        out[name] = out.get(name, 0) + int(v)
    return out


async def make_trouble(url: str, client: Client, stream: str = STREAM, *, lag: int = LAG) -> None:
    from trio_redis_finalize import _history

    dead = "{" + stream + "}:dead"
    for n in range(4):
        await client.execute("XADD", stream, "*", "n", str(n), "bad", "yes" if n < BAD else "no")

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.fields[b"bad"] == b"yes" else ACK

    every = _history.EVERY
    _history.EVERY = 0.05
    try:
        async with open_consumer(url, name="worker-1", shutdown_grace=1.0) as consumer:
            await consumer.mount(StreamSubscription(stream, group=GROUP, max_attempts=1, dead_letter=dead,
                                                    block=0.1), handle)
            with anyio.fail_after(20):
                while int(await client.execute("XLEN", dead) if await client.execute(
                        "EXISTS", dead) else 0) < BAD or not await client.execute(
                            "EXISTS", _history.history_key(stream, GROUP)):
                    await anyio.sleep(0.02)
                while True:  # every delivery written to the history
                    got = await client.execute("HGETALL", _history.history_key(stream, GROUP))
                    counts = totals(got)
                    if counts.get("ack") == 4 - BAD and counts.get("dead") == BAD:
                        break
                    await anyio.sleep(0.02)
    finally:
        _history.EVERY = every
    # a consumer that read three entries and died
    for n in range(STRANDED):
        await client.execute("XADD", stream, "*", "n", f"s{n}")
    await client.execute("XREADGROUP", "GROUP", GROUP, "worker-dead", "COUNT", STRANDED, "STREAMS",
                         stream, ">")
    reg = presence.registry_key(stream, GROUP)
    await client.execute("HSET", reg, "worker-dead", presence.registration_value(30.0, Mode.PLAIN),
                         "worker-live", presence.registration_value(30.0, Mode.PLAIN))
    await client.execute("SET", presence.heartbeat_key(stream, GROUP, "worker-live"), "1", "PX", 600_000)
    await client.execute("XGROUP", "CREATECONSUMER", stream, GROUP, "worker-live")
    # a backlog nobody reads
    await client.pipeline([("XADD", stream, "*", "n", f"w{n}") for n in range(lag)])
    # a delayed copy two minutes overdue (scores: server ms)
    secs, _ = await client.execute("TIME")
    await client.execute("ZADD", "{" + stream + "}:delayed", (int(secs) - 120) * 1000, b"copy")


async def make_healthy(url: str, client: Client, stream: str = "payments", group: str = "ledger",
                       n: int = 40) -> None:
    """A stream whose consumer acknowledged everything (its history written), now stopped."""
    from trio_redis_finalize import _history

    await client.pipeline([("XADD", stream, "*", "n", str(i)) for i in range(n)])

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.attempt == 1 and int(d.fields[b"n"]) % 7 == 0 else ACK

    every = _history.EVERY
    _history.EVERY = 0.05
    try:
        async with open_consumer(url, name="ledger-1", shutdown_grace=1.0) as consumer:
            await consumer.mount(StreamSubscription(stream, group=group, block=0.1), handle)
            with anyio.fail_after(20):
                while totals(await client.execute("HGETALL", _history.history_key(stream, group))
                             ).get("ack") != n:
                    await anyio.sleep(0.02)
    finally:
        _history.EVERY = every
