"""Network faults between the consumer and redis-server (``faults.chaosproxy``).

The consumer connects through a loopback proxy that can stall (a silent
partition: bytes held, no error), swallow replies, cut connections with RST
and refuse new ones; the test's own client talks to the server directly.

* a stall during an idle blocking read: the reader notices after its
  deadline (``block`` + margin), reconnects, and after the heal consumes
  again, including the entry whose read reply the partition swallowed;
* a swallowed read reply: the entry waits in the consumer's PEL and is
  handled once after the reconnect;
* RST cuts in the middle of batches of finalizations: nothing lost, every
  RETRY made exactly one copy, no entry handled twice;
* a stall longer than the finalization deadline: the outcome is unknown (the
  request may still reach Redis after the heal) and the gated resend
  settles it: exactly one copy;
* refused connections for a while: the consumer resumes by itself.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import pytest
import trio
from _procs import eventually

from faults.chaosproxy import ChaosProxy, serving
from faults.checks import stream_state
from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    Consumer,
    Delivery,
    Outcome,
    StreamSubscription,
    _finalizer,
    open_consumer,
)
from trio_redis_finalize._deadlines import READ_MARGIN as _READ_MARGIN
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize.testing import RedisServer

S, G = "orders", "billing"
NAME = f"stream {S!r} group {G!r}"


def proxied(server: RedisServer) -> AbstractAsyncContextManager[ChaosProxy]:
    return serving(ChaosProxy(upstream_port=server.port))


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[Client]:
    async with open_client(redis_url) as c:
        await c.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
        yield c


def stats(consumer: Consumer) -> dict[str, object]:
    return consumer.stats()[NAME]


async def xadd(client: Client, n: int) -> str:
    return str((await client.execute("XADD", S, "*", "n", n)).decode())


async def settled(client: Client) -> bool:
    state = await stream_state(client, S, G)
    return not state.present()


class Recorder:
    """A handler that counts calls per entry id and returns ``policy(delivery)``."""

    def __init__(self, policy: Callable[[Delivery], Outcome] = lambda d: ACK) -> None:
        self.policy = policy
        self.calls: Counter[str] = Counter()
        self.origins: Counter[str] = Counter()

    async def __call__(self, d: Delivery) -> Outcome:
        assert d.id is not None
        self.calls[d.id] += 1
        self.origins[d.origin_id] += 1
        return self.policy(d)


async def test_silent_partition_during_idle_read_does_not_hang_the_reader(
    redis_server: RedisServer, admin: Client
) -> None:
    block = 0.2
    handled = Recorder()
    async with proxied(redis_server) as proxy, open_consumer(
        proxy.url + "?timeout=0.5", name="w1", shutdown_grace=1.0
    ) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=block), handled)
        first = await xadd(admin, 1)
        await eventually(lambda: handled.calls[first] == 1, 30, "handling before the partition")

        proxy.stall()  # silent: no RST, no FIN, bytes held
        await trio.sleep(0.05)
        during = await xadd(admin, 2)  # served to the blocked read; the reply is held
        # its client deadline fires (a little above block); the bound is a
        # loaded machine's, far below the pytest timeout a hang would meet
        await eventually(lambda: stats(consumer)["read_errors"] != 0, block + _READ_MARGIN + 20,
                         "the reader noticing the partition")
        pending = await admin.execute("XPENDING", S, G, "-", "+", 10)
        assert [(r[0].decode(), r[1].decode()) for r in pending] == [(during, "w1")]
        await trio.sleep(1.0)  # still partitioned: reconnect attempts fail
        assert handled.calls[during] == 0
        proxy.heal()

        after = await xadd(admin, 3)
        await eventually(lambda: handled.calls[during] == 1 and handled.calls[after] == 1, 30,
                         "consuming again after the heal")
        await eventually(lambda: settled(admin), 30, "nothing pending")
    assert set(handled.calls.values()) == {1}


async def test_a_swallowed_read_reply_waits_in_the_pel_and_is_handled_once(
    redis_server: RedisServer, admin: Client
) -> None:
    handled = Recorder()
    async with proxied(redis_server) as proxy, open_consumer(
        proxy.url, name="w1", shutdown_grace=1.0
    ) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.2), handled)
        await trio.sleep(0.05)  # the reader is blocked in XREADGROUP
        proxy.drop_down = True
        eid = await xadd(admin, 1)
        await eventually(lambda: proxy.stats["dropped_down"] > 0, 30, "the reply being swallowed")
        proxy.drop_down = False
        rows = await admin.execute("XPENDING", S, G, "-", "+", 10)
        assert [(r[0].decode(), r[1].decode(), int(r[3])) for r in rows] == [(eid, "w1", 1)]
        assert handled.calls[eid] == 0
        await eventually(lambda: handled.calls[eid] == 1, 0.2 + _READ_MARGIN + 20,
                         "recovery from the PEL after the read deadline")
        await eventually(lambda: settled(admin), 30, "nothing pending")
        assert stats(consumer)["read_errors"] != 0
    assert handled.calls == {eid: 1}


def _mixed(d: Delivery) -> Outcome:
    """ACK, RETRY (originals: their copies are ACKed), DROP by entry number."""
    kind = int(d.fields[b"n"]) % 3
    if kind == 1:
        return RETRY if d.origin_id == d.id else ACK
    return DROP if kind == 2 else ACK


async def test_rst_cuts_mid_batch_of_finalizations_lose_nothing(
    redis_server: RedisServer, admin: Client
) -> None:
    n = 300
    handled = Recorder(_mixed)
    ids = [await xadd(admin, i) for i in range(n)]
    rng = random.Random(7)
    # The run lasts until the third cut whatever the machine's speed (it once
    # ended after two on a quick one): the original 50 of each hundred, once
    # handled, holds its outcome until the k-th cut was made, so each cut
    # comes with deliveries and finalizations in flight around it.
    cut_made = [trio.Event() for _ in range(3)]

    async def handle(d: Delivery) -> Outcome:
        outcome = await handled(d)
        i = int(d.fields[b"n"])
        if d.origin_id == d.id and i % 100 == 50:
            await cut_made[i // 100].wait()
        return outcome

    async with proxied(redis_server) as proxy:
        proxy.latency = 0.002  # batches of finalizations stay in flight a while
        async with open_consumer(proxy.url, name="w1", shutdown_grace=2.0) as consumer:
            await consumer.mount(StreamSubscription(S, G, block=0.1, count=20), handle,
                                 concurrency=4)
            cuts = 0
            while (sum(handled.calls.values()) < n or cuts < 3) and cuts < 12:
                await trio.sleep(rng.uniform(0.02, 0.08))
                if await proxy.cut(rst=True):
                    cuts += 1
                    if cuts <= 3:
                        cut_made[cuts - 1].set()
            await eventually(lambda: settled(admin), 30, "every entry finalized")
            errors = stats(consumer)
    state = await stream_state(admin, S, G)
    assert cuts >= 3
    assert errors["finalize_errors"] or errors["read_errors"]
    assert not state.present()
    copies = state.copies()
    for i, eid in enumerate(ids):
        assert handled.calls[eid] == 1, f"entry {eid} handled {handled.calls[eid]} times"
        assert copies[eid] == (1 if i % 3 == 1 else 0), f"entry {eid}: {copies[eid]} copies"
    assert all(c == 1 for c in handled.calls.values())  # the copies too


async def test_stall_longer_than_the_finalize_deadline_is_settled_once(
    redis_server: RedisServer, admin: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_finalizer, "FINALIZE_TIMEOUT", 0.3)
    original = await xadd(admin, 1)
    async with proxied(redis_server) as proxy:

        async def heal_later() -> None:
            await trio.sleep(1.5)
            proxy.heal()

        async def handle(d: Delivery) -> Outcome:
            if d.id != original:
                return ACK
            proxy.stall()  # the finalization is sent into the partition
            nursery.start_soon(heal_later)
            return RETRY

        async with trio.open_nursery() as nursery, open_consumer(
            proxy.url + "?timeout=0.3", name="w1", shutdown_grace=1.0
        ) as consumer:
            recorder = Recorder()

            async def handler(d: Delivery) -> Outcome:
                await recorder(d)
                return await handle(d)

            await consumer.mount(StreamSubscription(S, G, block=0.2), handler)
            await eventually(lambda: stats(consumer)["finalize_errors"] != 0, 30,
                             "the finalization timing out")
            await eventually(lambda: recorder.origins[original] >= 2, 30, "the copy being handled")
            await eventually(lambda: settled(admin), 30, "nothing pending")
    state = await stream_state(admin, S, G)
    assert state.copies()[original] == 1, f"{state.copies()[original]} copies of the message"
    assert recorder.calls[original] == 1
    assert recorder.origins[original] == 2  # the original once, its one copy once
    assert not state.pending


async def test_refused_connections_then_the_consumer_resumes_by_itself(
    redis_server: RedisServer, admin: Client
) -> None:
    handled = Recorder()
    async with proxied(redis_server) as proxy, open_consumer(
        proxy.url + "?timeout=0.5", name="w1", shutdown_grace=1.0
    ) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.2), handled)
        proxy.refuse = True
        await proxy.cut(rst=True)
        ids = [await xadd(admin, i) for i in range(5)]
        await trio.sleep(1.0)
        assert proxy.stats["refused"] >= 1
        assert stats(consumer)["read_errors"] != 0
        proxy.refuse = False
        await eventually(lambda: all(handled.calls[i] == 1 for i in ids), 30, "consuming again")
        await eventually(lambda: settled(admin), 30, "nothing pending")
    assert set(handled.calls.values()) == {1}
