"""Redis Cluster: a dead letter on another node answers OOM (issue 12 item 1).

Where the copy and the removal of the original live on different slots they
are two commands; the removal must never be sent after the copy failed or is
unknown (before: the XACK / LREM went out in the same pipeline as the refused
copy, and the message was gone from everywhere).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from _procs import always, eventually
from faults.server_faults import OomSwitch
from test_cluster import key_on, other_node

from trio_redis_finalize import (
    RETRY,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._transport import ClusterClient, open_client

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def cc(redis_cluster_url: str) -> AsyncIterator[ClusterClient]:
    async with open_client(redis_cluster_url) as c:
        assert isinstance(c, ClusterClient)
        yield c


@pytest.fixture
def switches(cc: ClusterClient) -> Iterator[dict[int, OomSwitch]]:
    out = {port: OomSwitch(port) for _, port in cc.nodes}
    try:
        yield out
    finally:
        for s in out.values():
            s.off()


async def test_stream_dead_letter_on_another_node_under_oom(
    cc: ClusterClient, switches: dict[int, OomSwitch]
) -> None:
    dead = key_on(cc, other_node(cc, "orders"), "dead-")
    await cc.execute("XADD", "orders", "*", "n", "1")
    sub = StreamSubscription("orders", "billing", block=0.1, max_attempts=1, dead_letter=dead)
    oom = switches[other_node(cc, "orders")[1]]  # the dead letter's node
    oom.on()
    async with open_consumer(cc, name="c1") as consumer:
        await consumer.mount(sub, always(RETRY))
        name = sub.name
        await eventually(lambda: consumer.stats()[name]["finalize_errors"] >= 3,
                         what="the refused copy sent again")
        # the original was not acknowledged: still pending, nothing lost
        assert (await cc.execute("XPENDING", "orders", "billing"))[0] == 1
        assert await cc.execute("XLEN", dead) == 0
        oom.off()
        await eventually(lambda: consumer.stats()[name]["effects"].get("dead_lettered") == 1,
                         what="dead-lettered")
    assert (await cc.execute("XPENDING", "orders", "billing"))[0] == 0
    assert await cc.execute("XLEN", dead) == 1


async def test_reliable_list_dead_letter_on_another_node_under_oom(
    cc: ClusterClient, switches: dict[int, OomSwitch]
) -> None:
    dead = key_on(cc, other_node(cc, "jobs"), "dead-")
    await cc.execute("LPUSH", "jobs", "job-1")
    sub = ReliableListSubscription("jobs", block=0.1, max_attempts=1, dead_letter=dead)
    oom = switches[other_node(cc, "jobs")[1]]
    oom.on()
    async with open_consumer(cc, name="c1") as consumer:
        await consumer.mount(sub, always(RETRY))
        name = sub.name
        processing = consumer.mounts[0].target.processing
        await eventually(lambda: consumer.stats()[name]["finalize_errors"] >= 3,
                         what="the refused copy sent again")
        assert await cc.execute("LRANGE", processing, 0, -1) == [b"job-1"]
        assert await cc.execute("LLEN", dead) == 0
        oom.off()
        await eventually(lambda: consumer.stats()[name]["effects"].get("dead_lettered") == 1,
                         what="dead-lettered")
    assert await cc.execute("LRANGE", processing, 0, -1) == []
    assert await cc.execute("LLEN", dead) == 1
