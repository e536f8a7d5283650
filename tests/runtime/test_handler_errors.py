"""Whatever a handler raises is a handler error (issue 12 item 9, DESIGN §4
"Handler errors"): an ``asyncio.CancelledError`` of a task the handler awaited,
any other ``BaseException`` subclass -- logged, ``on_error``, and the
subscription goes on (concurrency 1), no held id left behind.  The
consumer's own cancellation (shutdown) still ends the handler."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import anyio
import pytest
import trio
from _procs import Hang, eventually

from trio_redis_finalize import ACK, DROP, Delivery, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._transport import Client, open_client

pytestmark = pytest.mark.timeout(60)

NAME = "stream 's' group 'g'"


async def _pending(client: Client) -> int:
    return int((await client.execute("XPENDING", "s", "g"))[0])


async def add_entries(client: Client, n: int) -> None:
    """Entries n=0 .. n-1 in stream ``s``."""
    for i in range(n):
        await client.execute("XADD", "s", "*", "n", str(i))


async def all_handled(consumer: Any, seen: list[bytes], n: int) -> None:
    """Once ``n`` entries were handled, their outcomes settled (none in hand)."""
    await eventually(lambda: len(seen) == n, what="every entry handled")
    mount = consumer.mounts[0]
    await eventually(lambda: not mount.in_hand, what="no held id left")


def test_asyncio_cancelled_error_of_another_task_is_a_handler_error(redis_url: str) -> None:
    async def main() -> None:
        async with open_client(redis_url) as client:
            await add_entries(client, 3)
            seen: list[bytes] = []

            async def handler(d: Delivery) -> Outcome:
                seen.append(d.fields[b"n"])
                if d.fields[b"n"] == b"0":
                    task = asyncio.ensure_future(asyncio.sleep(10))
                    await asyncio.sleep(0)
                    task.cancel()
                    await task  # raises asyncio.CancelledError: not ours
                if d.fields[b"n"] == b"hang":
                    await anyio.sleep(math.inf)
                return ACK

            with anyio.fail_after(20):
                async with open_consumer(redis_url, name="c1", shutdown_grace=0.2) as consumer:
                    await consumer.mount(StreamSubscription("s", "g", block=0.1), handler,
                                         concurrency=1, on_error=DROP)
                    await all_handled(consumer, seen, 3)
                    stats = consumer.stats()[NAME]
                    assert stats["handler_errors"] == 1, stats
                    assert stats["effects"] == {"dropped": 1, "acked": 2}, stats
                    # the consumer's own cancellation still ends a handler
                    await client.execute("XADD", "s", "*", "n", "hang")
                    await eventually(lambda: len(seen) == 4, what="the hanging handler called")
                assert consumer.stats()[NAME]["handler_errors"] == 1
            assert await _pending(client) == 1  # the hanging one stays pending

    anyio.run(main, backend="asyncio")


class Weird(BaseException):
    """Not an Exception: e.g. what a library raises to unwind."""


async def test_base_exception_from_handler_is_a_handler_error(redis_url: str, client: Client) -> None:
    await add_entries(client, 3)
    seen: list[bytes] = []

    async def handler(d: Delivery) -> Outcome:
        seen.append(d.fields[b"n"])
        if d.fields[b"n"] == b"1":
            raise Weird("unwinding")
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("s", "g", block=0.1), handler, on_error=DROP)
        await all_handled(consumer, seen, 3)
        assert consumer.stats()[NAME]["handler_errors"] == 1
    assert await _pending(client) == 0


async def test_own_cancellation_still_ends_the_handler(redis_url: str, client: Client) -> None:
    await client.execute("XADD", "s", "*", "n", "0")
    handler = Hang()
    with trio.fail_after(10):
        async with open_consumer(redis_url, name="c1", shutdown_grace=0.2) as consumer:
            await consumer.mount(StreamSubscription("s", "g", block=0.1), handler)
            await handler.started.wait()
    assert consumer.stats()[NAME]["handler_errors"] == 0
    assert await _pending(client) == 1


async def test_system_exit_from_handler_ends_the_consumer(redis_url: str, client: Client) -> None:
    """SystemExit (like KeyboardInterrupt, GeneratorExit) is not a handler error:
    it ends the consumer; the entry stays pending."""
    await client.execute("XADD", "s", "*", "n", "0")

    async def handler(d: Delivery) -> Outcome:
        raise SystemExit(3)

    with trio.fail_after(10):
        with pytest.raises(BaseException) as info:
            async with open_consumer(redis_url, name="c1", shutdown_grace=0.2) as consumer:
                await consumer.mount(StreamSubscription("s", "g", block=0.1), handler)
                await trio.sleep_forever()
    exc: BaseException = info.value
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    assert isinstance(exc, SystemExit), repr(info.value)
    assert await _pending(client) == 1
