"""Reliable list races: exactly once at every joint (issue 33, points 4 and 5).

Real servers, real faults: a command-aware proxy (``faults.cmdproxy``) sits
between the consumer and the server and loses the reply of one chosen
request after the server ran it (``LOST``), or answers it with an error
instead of running it (the request never arrives).

* point 4: identical elements and a runtime ``retry_after`` copy: the delayed
  copy-then-remove script of one ``x`` meets a lost reply while a second
  ``x`` is being handled; its resend must neither commit the writes again nor
  push a second copy nor take the other ``x``;
* point 5: the effect ``writes`` of a reliable list's ``retry_after`` is
  counted when the delayed script committed them, not when the copy is held;
* the race enumeration of the list's delayed copy: two finalizations of one
  delivery (a delayed copy against an identical element; the same consumer
  finalizing twice) x {reply lost, request lost}.

Each case checks, per message, the copies delivered and the writes committed,
and ``stats()`` against what Redis holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import trio
from _procs import eventually
from faults.cmdproxy import LOST, CommandProxy, error

from trio_redis_finalize import (
    ACK,
    Consumer,
    Delivery,
    ReliableListSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

Q = "jobs"
NAME = f"reliable list {Q!r}"
PROC = "{jobs}:processing:c1"
WRITES = "list_writes"  # the kind of the writes script's requests (the proxy's)


def effects(consumer: Consumer) -> dict[str, int]:
    e: dict[str, int] = dict(consumer.stats()[NAME]["effects"])
    return e


async def lrange(client: Client, key: str) -> list[bytes]:
    items: list[bytes] = await client.execute("LRANGE", key, 0, -1)
    return items


async def counter(client: Client, key: str) -> int:
    v = await client.execute("GET", key)
    return int(v) if v is not None else 0


@pytest.fixture(scope="module")
def flavour(redis_server: RedisServer) -> str:
    from trio_redis_finalize.pytest_plugin import sync_command

    info = sync_command(redis_server, "INFO", "server")
    assert isinstance(info, bytes)
    return "valkey" if b"valkey" in info.lower() else "redis"


@pytest.fixture
async def proxy(redis_url: str, redis_server: RedisServer, flavour: str) -> AsyncIterator[CommandProxy]:
    p = CommandProxy(redis_server.port, flavour=flavour)
    async with anyio.create_task_group() as tg:
        await tg.start(p.serve)
        yield p
        await p.cut_all()
        tg.cancel_scope.cancel()


def sub() -> ReliableListSubscription:
    return ReliableListSubscription(Q, block=0.1)


# -- point 4: identical elements, a delayed copy, its reply lost -------------------------

async def test_delayed_copy_resent_beside_an_identical_element(
    proxy: CommandProxy, client: Client
) -> None:
    """``x`` pushed twice; the first returns ``retry_after(0.5)`` with write A,
    the second is in a slow handler; the delayed copy script's reply is lost
    once.  A is committed once, one copy comes back (attempt 2), the second
    ``x`` is acknowledged with its own write B, once."""
    await client.execute("LPUSH", Q, b"x", b"x")
    seen: list[Delivery] = []
    box: list[Consumer] = []

    async def h(d: Delivery) -> Any:
        seen.append(d)
        n = len(seen)
        if n == 1:
            return retry_after(0.5).with_writes(("INCR", "{jobs}:A"))
        if n == 2:  # slow: finalized once the delayed copy's resend is answered
            await eventually(lambda: proxy.fired and box[0].stats()[NAME]["held"] == 0,
                             timeout=10, what="the delayed copy sent again and answered")
            return ACK.with_writes(("INCR", "{jobs}:B"))
        return ACK.with_writes(("INCR", "{jobs}:C"))

    proxy.arm(f"EVALSHA:{WRITES}", LOST)
    with trio.fail_after(30):
        async with open_consumer(proxy.url, name="c1") as consumer:
            box.append(consumer)
            await consumer.mount(sub(), h, concurrency=2)
            await eventually(lambda: len(seen) >= 3 and effects(consumer).get("acked") == 2,
                             timeout=15, what="the copy handled")
            await trio.sleep(0.5)  # a second copy, if any, would come now
            stats = effects(consumer)
    assert proxy.fired, "the fault must have fired"
    assert [d.attempt for d in seen] == [1, 1, 2]
    assert [await counter(client, f"{{jobs}}:{k}") for k in "ABC"] == [1, 1, 1]
    assert await lrange(client, PROC) == [] and await lrange(client, Q) == []
    assert stats.get("writes") == 3
    assert stats.get("released") == 1 and stats.get("acked") == 2
