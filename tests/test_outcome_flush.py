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
        await eventually(lambda: slow == concurrency, what="every slow handler running")
        # the fast ones were acknowledged while the slow ones still run
        # (before: they waited in their task's list until its slow call returned)
        await eventually(lambda: _pending_is(client, concurrency), timeout=3,
                         what="the fast ACKs sent")
        assert consumer.stats()["stream 's' group 'g'"]["effects"]["acked"] == 3
        release.set()
        await eventually(lambda: _pending_is(client, 0), what="all acknowledged")


async def _pending_is(client: Client, n: int) -> bool:
    return await _pending(client) == n
