"""A finished outcome does not wait behind a slow handler (issue 12 item 13):
it reaches Redis within about the flush interval of its handler returning,
whatever the handler task does next."""

from __future__ import annotations

import pytest
import trio
from _procs import eventually

from trio_redis_finalize import ACK, Delivery, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(60)


async def _pending(client: Client) -> int:
    return int((await client.execute("XPENDING", "s", "g"))[0])


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_ack_is_sent_while_the_next_handler_call_is_slow(
    redis_url: str, client: Client, concurrency: int
) -> None:
    # one batch: fast entries, then slow ones (one per handler task)
    for n in range(3):
        await client.execute("XADD", "s", "*", "n", f"fast{n}")
    for n in range(concurrency):
        await client.execute("XADD", "s", "*", "n", f"slow{n}")
    release = trio.Event()
    slow = 0

    async def handler(d: Delivery) -> Outcome:
        nonlocal slow
        if d.fields[b"n"].startswith(b"slow"):
            slow += 1
            await release.wait()
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.1), handler,
                             concurrency=concurrency)
        await eventually(lambda: slow == concurrency, timeout=30, what="every slow handler running")
        # the fast ones were acknowledged while the slow ones still run
        # (before: they waited in their task's list until its slow call returned)
        # (bounds, not expectations: the slow handlers block until released,
        # so the fast ACKs can only have been sent beside them)
        await eventually(lambda: _pending_is(client, concurrency), timeout=30,
                         what="the fast ACKs sent")
        # Redis applied the XACK; the finalizer counts it once it has read the
        # reply (reading stats() right after XPENDING raced that: KeyError)
        await eventually(lambda: consumer.stats()["stream 's' group 'g'"]["effects"]["acked"] == 3,
                         timeout=30, what="the fast ACKs counted")
        assert slow == concurrency and not release.is_set()
        release.set()
        await eventually(lambda: _pending_is(client, 0), timeout=30, what="all acknowledged")


async def _pending_is(client: Client, n: int) -> bool:
    return await _pending(client) == n


async def test_every_outcome_and_effect_reads_0_until_counted(redis_url: str, client: Client) -> None:
    """``stats()`` from 0, as Prometheus: a test (or a dashboard) that reads
    ``effects["acked"]`` before the first reply is settled reads 0, not a
    KeyError; and the counts still compare equal to a dict of what was counted."""
    from trio_redis_finalize._metrics import EFFECTS, OUTCOMES

    done = trio.Event()

    async def handler(d: Delivery) -> Outcome:
        done.set()
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.1), handler)
        before = consumer.stats()["stream 's' group 'g'"]
        assert all(before["effects"][e] == 0 for e in EFFECTS), before
        assert all(before["outcomes"][o] == 0 for o in OUTCOMES), before
        assert before["effects"] == {} and before["outcomes"] == {}
        await client.execute("XADD", "s", "*", "n", "1")
        with trio.fail_after(30):  # a bound
            await done.wait()
        await eventually(lambda: consumer.stats()["stream 's' group 'g'"]["effects"]["acked"] == 1,
                         timeout=30, what="the ACK counted")
        after = consumer.stats()["stream 's' group 'g'"]
        assert after["effects"] == {"acked": 1} and after["outcomes"] == {"ack": 1}
        assert after["effects"]["dropped"] == 0
