"""Shutdown at the grace deadline, in the middle of a chunk of deliveries."""

from __future__ import annotations

import pytest
import trio
from _procs import eventually

from trio_redis_finalize import (
    ACK,
    Consumer,
    Delivery,
    Outcome,
    ReliableListSubscription,
    open_consumer,
)
from trio_redis_finalize._keys import derived
from trio_redis_finalize._transport import Client


async def test_grace_deadline_mid_chunk_gives_back_what_no_handler_started(
    redis_url: str, client: Client
) -> None:
    # Fast handlers grow the reliable-list prefetch, so the element that hangs
    # arrives inside a chunk with others behind it.  At the grace deadline the
    # hanging one stays in the processing list (it was being handled); the
    # ones behind it in the chunk go back onto the queue, uncounted.
    n = 300
    await client.pipeline([("LPUSH", "jobs", f"m{i}") for i in range(n)])
    handled: list[bytes] = []

    async def handle(d: Delivery) -> Outcome:
        assert d.data is not None
        if d.data == b"m150":
            await trio.sleep_forever()
        handled.append(d.data)
        return ACK

    processing = derived("jobs", ":processing:c1")
    async with open_consumer(redis_url, name="c1", shutdown_grace=0.3) as consumer:
        await consumer.mount(ReliableListSubscription("jobs", block=0.05), handle)
        await eventually(lambda: len(handled) >= 150, what="150 handled")
        await trio.sleep(0.2)
    assert len(handled) == 150
    assert await client.execute("LRANGE", processing, 0, -1) == [b"m150"]
    queue = await client.execute("LRANGE", "jobs", 0, -1)
    assert len(queue) == n - 151
    assert sorted(queue + handled + [b"m150"]) == sorted(f"m{i}".encode() for i in range(n))


async def test_a_failing_shutdown_raises_instead_of_hanging(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_aclose(self: Consumer) -> None:
        raise RuntimeError("shutdown failed")

    monkeypatch.setattr(Consumer, "aclose", broken_aclose)
    with trio.fail_after(5), pytest.raises(BaseExceptionGroup) as info:
        async with open_consumer(redis_url, name="c1"):
            pass
    assert info.value.subgroup(RuntimeError) is not None
