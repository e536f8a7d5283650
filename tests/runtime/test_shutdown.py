"""Shutdown at the grace deadline, in the middle of a chunk of deliveries."""

from __future__ import annotations

import logging

import pytest
import trio
from _procs import eventually

from trio_redis_finalize import (
    ACK,
    Consumer,
    Delivery,
    ListSubscription,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._envelope import unwrap
from trio_redis_finalize._keys import derived
from trio_redis_finalize._transport import Client


async def test_grace_deadline_mid_chunk_gives_back_what_no_handler_started(
    redis_url: str, client: Client
) -> None:
    # Fast handlers grow the reliable-list prefetch, so the element that hangs
    # arrives inside a chunk with others behind it.  At the grace deadline the
    # hanging one stays in the processing list (it was being handled) until
    # the stop hands it back onto the queue, counted; the ones behind it in
    # the chunk go back onto the queue, uncounted.
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
    assert await client.execute("LRANGE", processing, 0, -1) == []
    queue = await client.execute("LRANGE", "jobs", 0, -1)
    assert len(queue) == n - 150
    assert unwrap(queue[-1])[:2] == (b"m150", 1)  # read next, its cut attempt counted
    queue[-1] = b"m150"
    assert sorted(queue + handled) == sorted(f"m{i}".encode() for i in range(n))


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


async def test_shutdown_says_how_many_handlers_it_waits_for_and_which_entries_stay_pending(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: nothing was logged.  Now: "waiting for N handlers" when the
    shutdown begins, and at the grace deadline, per subscription, the
    deliveries whose handler was cancelled: pending (stream, reliable list),
    or gone (simple list); a handler that finishes in time is not named."""
    eid = (await client.execute("XADD", "orders", "*", "n", "slow")).decode()
    await client.execute("LPUSH", "jobs", "slow-job")
    await client.execute("LPUSH", "plain", "slow-task")
    started: list[str] = []
    finish = trio.Event()

    async def hang(d: Delivery) -> Outcome:
        started.append(d.source)
        await trio.sleep_forever()
        raise AssertionError("not reached")

    async def in_time(d: Delivery) -> Outcome:
        started.append(d.source)
        await finish.wait()
        await trio.sleep(0.05)
        return ACK

    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    stream = StreamSubscription("orders", "g", block=0.05)
    rlist = ReliableListSubscription("jobs", block=0.05)
    lst = ListSubscription("plain", block=0.05)
    fine = StreamSubscription("fine", "g", block=0.05)
    await client.execute("XADD", "fine", "*", "n", "1")
    with trio.fail_after(20):
        async with open_consumer(redis_url, name="c1", shutdown_grace=0.5) as consumer:
            for sub, h in ((stream, hang), (rlist, hang), (lst, hang), (fine, in_time)):
                await consumer.mount(sub, h)
            await eventually(lambda: len(started) == 4, what="four handlers running")
            finish.set()  # the fine one ends within the grace
    (waiting,) = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert "consumer c1 shutting down: waiting for 4 handlers to finish (shutdown_grace=0.5 s)" in waiting
    assert f"{stream.name}: 1" in waiting and f"{fine.name}: 1" in waiting
    cut = {r.subscription: r for r in caplog.records if "shutdown_grace" in r.getMessage()
           and "cancelled" in r.getMessage()}
    assert set(cut) == {stream.name, rlist.name, lst.name}, cut
    assert all(r.levelno == logging.WARNING for r in cut.values())
    text = cut[stream.name].getMessage()
    assert (f"cancelled: entries {eid}: left pending in the PEL of group 'g' (consumer 'c1'), "
            "handed back at the stop") in text, text
    assert cut[stream.name].cancelled == [eid]
    text = cut[rlist.name].getMessage()
    assert ("(origin ids): left in the processing list '{jobs}:processing:c1', handed back "
            "onto the queue at the stop") in text, text
    assert "(origin ids): gone (a list is at-most-once)" in cut[lst.name].getMessage()
    # what the lines say is so
    assert [row[0].decode() for row in await client.execute("XPENDING", "orders", "g", "-", "+", 10)] == [eid]
    assert await client.execute("LLEN", derived("jobs", ":processing:c1")) == 0  # handed back
    assert await client.execute("LLEN", "jobs") == 1
    assert await client.execute("XPENDING", "fine", "g", "-", "+", 10) == []
