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

from collections.abc import Awaitable, Callable

from trio_redis_finalize import (
    ACK,
    RETRY,
    Delivery,
    Mode,
    Outcome,
    StreamSubscription,
)
from trio_redis_finalize._core.stream import liveness as presence
from trio_redis_finalize._transport import Client
from trio_redis_finalize.pytest_plugin import consume_until

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


async def _consume_with_history(url: str, name: str, sub: StreamSubscription,
                                handle: Callable[[Delivery], Awaitable[Outcome]],
                                written: Callable[[], Awaitable[bool]]) -> None:
    """``sub`` consumed by consumer ``name``, its history written every 50 ms,
    until ``written()`` (within 20 s)."""
    from trio_redis_finalize import _history

    every = _history.EVERY
    _history.EVERY = 0.05
    try:
        await consume_until(url, sub, handle, written, timeout=20, name=name, shutdown_grace=1.0)
    finally:
        _history.EVERY = every


async def make_trouble(url: str, client: Client, stream: str = STREAM, *, lag: int = LAG) -> None:
    from trio_redis_finalize import _history

    dead = "{" + stream + "}:dead"
    for n in range(4):
        await client.execute("XADD", stream, "*", "n", str(n), "bad", "yes" if n < BAD else "no")

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.fields[b"bad"] == b"yes" else ACK

    async def written() -> bool:  # the dead letters, and every delivery in the history
        counts = totals(await client.execute("HGETALL", _history.history_key(stream, GROUP)))
        return (int(await client.execute("XLEN", dead)) >= BAD
                and counts.get("ack") == 4 - BAD and counts.get("dead") == BAD)

    sub = StreamSubscription(stream, group=GROUP, max_attempts=1, dead_letter=dead, block=0.1)
    await _consume_with_history(url, "worker-1", sub, handle, written)
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

    async def written() -> bool:
        return totals(await client.execute("HGETALL", _history.history_key(stream, group))
                      ).get("ack") == n

    await _consume_with_history(url, "ledger-1", StreamSubscription(stream, group=group, block=0.1),
                                handle, written)
