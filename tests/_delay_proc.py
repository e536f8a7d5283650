"""A consumer process for the SIGKILL tests of ``test_delayed_retry``.

Usage: ``python tests/_delay_proc.py URL WAY NAME DELAY``

Mounts, as consumer NAME, the subscription :func:`subscription` gives for
WAY (``runtime``, ``durable``, ``claiming``: stream ``s`` group ``g``;
``reliable``: reliable list ``q``).  The handler records ``<attempt> <origin
id>`` with RPUSH on the list ``calls`` and returns ``retry_after(DELAY)`` on
the first attempt, ``ACK`` after.  Runs until it is killed.
"""

from __future__ import annotations

import sys

import trio

from trio_redis_finalize import (
    ACK,
    DelayedRetry,
    Delivery,
    Mode,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._transport import open_client

CLAIMING_MIN_IDLE = 0.5


def subscription(way: str) -> StreamSubscription | ReliableListSubscription:
    if way == "runtime":
        return StreamSubscription("s", "g", block=0.1)
    if way == "durable":
        return StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.1)
    if way == "claiming":
        return StreamSubscription("s", "g", mode=Mode.CLAIMING, min_idle=CLAIMING_MIN_IDLE, block=0.1)
    if way == "reliable":
        return ReliableListSubscription("q", block=0.1)
    raise ValueError(f"way: unknown {way!r}")


async def main(url: str, way: str, name: str, delay: float) -> None:
    async with open_client(url) as client, open_consumer(url, name=name) as consumer:

        async def handler(d: Delivery) -> Outcome:
            await client.execute("RPUSH", "calls", f"{d.attempt} {d.origin_id}")
            return retry_after(delay) if d.attempt == 1 else ACK

        await consumer.mount(subscription(way), handler)
        await trio.sleep_forever()


if __name__ == "__main__":
    url, way, name, delay = sys.argv[1:5]
    trio.run(main, url, way, name, float(delay))
