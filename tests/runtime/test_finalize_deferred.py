"""Error replies for commands the server did not run (READONLY, LOADING,
TRYAGAIN, CLUSTERDOWN) defer a finalization; they never discard it."""

from __future__ import annotations

import trio
from _procs import eventually

from trio_redis_finalize import ACK, RETRY, Delivery, Outcome, StreamSubscription, open_consumer, retry_after
from trio_redis_finalize._transport import open_client
from trio_redis_finalize.pytest_plugin import sync_command
from trio_redis_finalize.testing import RedisServer, free_port


async def test_readonly_reply_defers_the_retry_until_the_server_takes_writes(
    fresh_redis_server: RedisServer,
) -> None:
    server = fresh_redis_server
    url = server.url
    release = trio.Event()
    seen: list[int] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append(d.attempt)
        if d.attempt == 1:
            await release.wait()
            return RETRY
        return ACK

    async with open_client(url) as client:
        await client.execute("XADD", "orders", "*", "n", "1")
        async with open_consumer(url, name="c1", shutdown_grace=1) as consumer:
            await consumer.mount(StreamSubscription("orders", group="g", block=0.05), handle)
            await eventually(lambda: seen == [1], what="first delivery")
            # a replica of a master that does not exist keeps its data and
            # answers every write with READONLY
            sync_command(server, "REPLICAOF", "127.0.0.1", free_port())
            release.set()
            name = "stream 'orders' group 'g'"
            await eventually(lambda: consumer.stats()[name]["finalize_errors"] >= 2,
                             what="finalization deferred twice")
            assert await client.execute("XLEN", "orders") == 1
            sync_command(server, "REPLICAOF", "NO", "ONE")
            await eventually(lambda: seen == [1, 2], timeout=10, what="the copy delivered")
            await eventually(
                lambda: consumer.stats()[name]["effects"].get("acked", 0) == 1, what="copy acked"
            )
        assert await client.execute("XLEN", "orders") == 2
        assert (await client.execute("XPENDING", "orders", "g"))[0] == 0


async def test_readonly_reply_defers_a_held_runtime_copy(fresh_redis_server: RedisServer) -> None:
    server = fresh_redis_server
    url = server.url
    seen: list[int] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append(d.attempt)
        return retry_after(0.3) if d.attempt == 1 else ACK

    async with open_client(url) as client:
        await client.execute("XADD", "orders", "*", "n", "1")
        async with open_consumer(url, name="c1", shutdown_grace=1) as consumer:
            await consumer.mount(StreamSubscription("orders", group="g", block=0.05), handle)
            name = "stream 'orders' group 'g'"
            await eventually(lambda: consumer.stats()[name]["held"] == 1, what="copy held")
            sync_command(server, "REPLICAOF", "127.0.0.1", free_port())
            await trio.sleep(1.0)  # the copy fell due and was refused meanwhile
            assert await client.execute("XLEN", "orders") == 1
            sync_command(server, "REPLICAOF", "NO", "ONE")
            await eventually(lambda: seen == [1, 2], timeout=10, what="the copy delivered")
        assert await client.execute("XLEN", "orders") == 2
