"""Every command has a deadline; mount() honours cancellation (issue 12 item 7).

A proxy that blackholes the connection (``ChaosProxy.stall``: the kernel keeps
the connection up, no byte moves) plays a silent server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
import trio
from _procs import always
from faults.chaosproxy import ChaosProxy, serving
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    ListSubscription,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._transport import open_client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def proxy(redis_server: RedisServer, redis_url: str) -> AsyncIterator[ChaosProxy]:
    async with serving(ChaosProxy(upstream_port=redis_server.port)) as p:
        try:
            yield p
        finally:
            p.heal()


SUBS = {
    "stream": (StreamSubscription("s", "g"), "TYPE on key 's'"),
    "reliable-list": (ReliableListSubscription("q"), "TYPE on key 'q'"),
    "list": (ListSubscription("l"), "TYPE on key 'l'"),
}


@pytest.mark.parametrize("form", list(SUBS))
async def test_mount_on_a_silent_server_fails_naming_command_and_key(
    proxy: ChaosProxy, form: str
) -> None:
    sub, named = SUBS[form]
    async with open_consumer(proxy.url, name="c1", shutdown_grace=0.1) as consumer:
        proxy.stall()
        with trio.fail_after(16):  # mount's own bound is 15 s
            with pytest.raises(rexc.TimeoutError) as info:
                await consumer.mount(sub, always(ACK))
        assert named in str(info.value), str(info.value)
        proxy.heal()


async def test_mount_honours_its_callers_cancellation(proxy: ChaosProxy) -> None:
    async with open_consumer(proxy.url, name="c1", shutdown_grace=0.1) as consumer:
        proxy.stall()
        with trio.fail_after(4):  # well before any command's own deadline
            with trio.move_on_after(0.3) as scope:
                await consumer.mount(StreamSubscription("s", "g"), always(ACK))
        assert scope.cancelled_caught
        assert consumer.mounts == []
        proxy.heal()
        # the consumer still works: the same subscription mounts now
        await consumer.mount(StreamSubscription("s", "g", block=0.1), always(ACK))
        assert len(consumer.mounts) == 1


async def test_pooled_commands_have_a_default_deadline(proxy: ChaosProxy) -> None:
    async with open_client(proxy.url) as client:
        proxy.stall()
        with trio.fail_after(8):
            with pytest.raises(rexc.TimeoutError) as info:
                await client.execute("XPENDING", "s", "g")
        assert "XPENDING on key 's'" in str(info.value)
        with trio.fail_after(8):
            # the timed-out connection was closed: this one is new, and its
            # handshake (the capability detection in it) is what meets the
            # silence -- a ConnectionError naming the handshake, in its deadline
            with pytest.raises((rexc.TimeoutError, rexc.ConnectionError)) as again:
                await client.pipeline([("SET", "hb", "1"), ("HSET", "reg", "c", "p")])
        assert "timed out" in str(again.value) or "no reply" in str(again.value)
        proxy.heal()


async def test_a_shutdown_on_a_silent_server_ends_and_reports_its_held_copies(
    proxy: ChaosProxy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The server goes silent with a runtime copy held: leaving the block still
    ends (each phase bounded; here about 4 s with the graces cut to 1 s), and
    the copy the flush could not write is logged and counted ``held_lost``
    (before: gone without a word when the flush's round trip was cut)."""
    from trio_redis_finalize import _shutdown, retry_after
    monkeypatch.setattr(_shutdown, "FINALIZE_GRACE", 1.0)
    monkeypatch.setattr(_shutdown, "FLUSH_GRACE", 1.0)
    async with open_client(proxy.url) as client:
        await client.execute("XADD", "s", "*", "n", "1")

    sub = StreamSubscription("s", "g", block=0.1)
    with trio.fail_after(30):  # a hang fails here, not at the test's timeout
        async with open_consumer(proxy.url, name="c1", shutdown_grace=0.2) as consumer:
            await consumer.mount(sub, always(retry_after(60)))
            while consumer.stats()[sub.name]["held"] != 1:
                await trio.sleep(0.02)
            proxy.stall()
    stats = consumer.stats()[sub.name]
    assert stats["effects"].get("held_lost") == 1 and stats["held"] == 0, stats
    assert any(r.getMessage().startswith(f"{sub.name}: could not publish 1 held")
               for r in caplog.records)


def test_mount_honours_cancellation_on_asyncio(redis_server: RedisServer, redis_url: str) -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tg:
            p = ChaosProxy(upstream_port=redis_server.port)
            await tg.start(p.serve)
            async with open_consumer(p.url, name="c1", shutdown_grace=0.1) as consumer:
                p.stall()
                with anyio.fail_after(4):
                    with anyio.move_on_after(0.3) as scope:
                        await consumer.mount(StreamSubscription("s", "g"), always(ACK))
                assert scope.cancelled_caught
                assert consumer.mounts == []
                p.heal()
            tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")
