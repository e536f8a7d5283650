"""Redis Cluster against a local 3-master cluster (the ``redis_cluster`` fixture):
slot routing, MOVED / ASK / TRYAGAIN, pipelines in order across nodes, every
stream and reliable-list cell of the table, dead letters on the same and on
another slot, durable retry_after, streams on three nodes in one consumer, and
a slot migrated while it is being consumed."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
from _procs import Recorder, eventually

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRIES_FIELD,
    RETRY,
    ChannelSubscription,
    Consumer,
    DelayedRetry,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._envelope import unwrap
from trio_redis_finalize._transport import (
    Client,
    ClusterClient,
    RoutedConnection,
    Script,
    command_keys,
    open_client,
    open_connection,
    slot_of,
)
from trio_redis_finalize.testing import RedisCluster

pytestmark = pytest.mark.timeout(60)

Address = tuple[str, int]


# -- helpers ------------------------------------------------------------------------


@pytest.fixture
async def cc(redis_cluster_url: str) -> AsyncIterator[ClusterClient]:
    async with open_client(redis_cluster_url) as c:
        assert isinstance(c, ClusterClient)
        yield c


def key_on(client: ClusterClient, node: Address, prefix: str, *, avoid: int | None = None) -> str:
    """A key ``<prefix><n>`` whose slot ``node`` serves (and not slot ``avoid``)."""
    for n in range(100_000):
        key = f"{prefix}{n}"
        slot = slot_of(("GET", key))
        assert slot is not None
        if client.owner(slot) == node and slot != avoid:
            return key
    raise AssertionError(f"no key for {node}")


def node_of(client: ClusterClient, key: str) -> Address:
    slot = slot_of(("GET", key))
    assert slot is not None
    owner = client.owner(slot)
    assert owner is not None
    return owner


def other_node(client: ClusterClient, key: str) -> Address:
    return next(n for n in client.nodes if n != node_of(client, key))


def effects(consumer: Consumer, name: str) -> dict[str, int]:
    e: dict[str, int] = consumer.stats()[name]["effects"]
    return e


_LINE = re.compile(r'^([\d.]+) \[\d+ ([^\]]+)\] "([^"]+)"(.*)$', re.S)


class NodeMonitor:
    """MONITOR on one node: (time, client address or 'lua', COMMAND, rest)."""

    def __init__(self, client: ClusterClient, node: Address) -> None:
        self.params = client.params.for_node(*node)
        self.lines: list[tuple[float, str, str, str]] = []

    async def run(self, *, task_status: trio.TaskStatus[None]) -> None:
        conn = await open_connection(self.params, name="test-monitor")
        async with conn:
            assert await conn.execute("MONITOR") in (b"OK", "OK")
            task_status.started()
            while True:
                line = await conn._read_reply()
                m = _LINE.match(line.decode("utf-8", "replace"))
                if m:
                    self.lines.append((float(m[1]), m[2], m[3].upper(), m[4]))

    def find(self, command: str, contains: str = "", *, lua: bool | None = None) -> list[float]:
        return [t for t, a, c, rest in self.lines
                if c == command and contains in rest and (lua is None or (a == "lua") == lua)]


async def xadd_many(client: Client, stream: str, n: int, **extra: str) -> list[str]:
    cmds = [("XADD", stream, "*", "n", str(i), *[x for kv in extra.items() for x in kv])
            for i in range(n)]
    return [r.decode() for r in await client.pipeline(cmds)]


async def pending(client: Client, stream: str, group: str) -> int:
    return int((await client.execute("XPENDING", stream, group))[0])


# -- routing ------------------------------------------------------------------------


def test_command_keys() -> None:
    assert command_keys(("SET", "a", 1)) == ["a"]
    assert command_keys(("EVALSHA", b"sha", 2, "k1", "k2", "arg")) == ["k1", "k2"]
    assert command_keys(("XREADGROUP", "GROUP", "g", "c", "COUNT", 1, "BLOCK", 5, "STREAMS", "s1", "s2",
                         ">", ">")) == ["s1", "s2"]
    assert command_keys(("XGROUP", "CREATE", "s", "g", "0", "MKSTREAM")) == ["s"]
    assert command_keys(("XINFO", "GROUPS", "s")) == ["s"]
    assert command_keys(("BLMOVE", "q", "p", "RIGHT", "LEFT", 1)) == ["q", "p"]
    assert command_keys(("BRPOP", "a", "b", 1)) == ["a", "b"]
    assert command_keys(("MSET", "a", 1, "b", 2)) == ["a", "b"]
    assert command_keys(("DEL", "a", "b")) == ["a", "b"]
    for keyless in (("PING",), ("SCRIPT", "LOAD", "x"), ("PUBLISH", "ch", "m"), ("TIME",),
                    ("CLUSTER", "SLOTS"), ("XINFO", "HELP")):
        assert command_keys(keyless) == []
    assert slot_of(("GET", "{user1}:a")) == slot_of(("GET", "{user1}:b"))  # hash tags


async def test_url_gives_a_cluster_client_with_the_slot_map(
    redis_cluster: RedisCluster, cc: ClusterClient
) -> None:
    assert len(cc.nodes) == 3
    assert {p for _, p in cc.nodes} == set(redis_cluster.ports)
    assert all(cc.owner(s) is not None for s in range(16384))
    for node in cc.nodes:
        key = key_on(cc, node, "k")
        assert cc.owner(redis_cluster.slot_of(key)) == node
        assert redis_cluster.owner(redis_cluster.slot_of(key)) == node[1]
        assert await cc.execute("SET", key, f"on {node[1]}") == b"OK"
        # it really is on that node: the owner answers without a redirection
        assert redis_cluster.command(node[1], "GET", key) == f"on {node[1]}".encode()
    assert cc.moved == cc.asked == 0
    assert await cc.execute("PING") == b"PONG"


async def test_a_single_seed_is_enough(redis_cluster: RedisCluster) -> None:
    async with open_client(f"redis+cluster://127.0.0.1:{redis_cluster.ports[1]}") as c:
        assert isinstance(c, ClusterClient)
        assert len(c.nodes) == 3


async def test_a_seed_that_is_not_a_cluster_node_is_named(redis_url: str) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(Exception, match=rf"127.0.0.1:{port} is not a Redis Cluster node"):
        async with open_client(f"redis+cluster://127.0.0.1:{port}"):
            pass


async def test_moved_is_followed_and_the_map_read_again(
    redis_cluster: RedisCluster, cc: ClusterClient
) -> None:
    node = cc.nodes[0]
    key = key_on(cc, node, "moved")
    slot = redis_cluster.slot_of(key)
    wrong = other_node(cc, key)
    # the wrong node really answers MOVED
    with pytest.raises(RuntimeError, match=rf"MOVED {slot} 127.0.0.1:{node[1]}"):
        redis_cluster.command(wrong[1], "SET", key, "x")

    def corrupt() -> None:
        cc._owner[slot] = wrong
        cc._stale = False

    corrupt()
    refreshes = cc.refreshes
    assert await cc.execute("SET", key, "v1") == b"OK"
    assert cc.moved == 1
    assert cc.owner(slot) == node  # learnt from the MOVED reply at once
    assert redis_cluster.command(node[1], "GET", key) == b"v1"
    assert await cc.execute("GET", key) == b"v1"
    assert cc.refreshes == refreshes + 1  # and the whole map read again before the next command

    tag = f"{{{key}}}"  # keys of the same slot
    corrupt()  # a pipeline: only the redirected commands are sent again
    other_key = key_on(cc, wrong, "fine")
    replies = await cc.pipeline([("INCR", f"{tag}:n"), ("INCR", other_key), ("INCR", f"{tag}:n")])
    assert replies == [1, 1, 2]
    assert redis_cluster.command(node[1], "GET", f"{tag}:n") == b"2"
    assert cc.moved == 2  # the third went to the owner: the map was read again after the first

    corrupt()  # a transaction
    assert await cc.transaction([("INCR", f"{tag}:t"), ("INCR", f"{tag}:t")]) == [1, 2]

    corrupt()  # a script (loaded on the node that owns the key)
    script = Script("return redis.call('INCR', KEYS[1])", name="incr")
    assert await cc.evalsha(script, [f"{tag}:s"], []) == 1

    corrupt()  # a dedicated connection moves itself to the owner
    conn = await cc.connect(name="test-routed", key=key)
    async with conn:
        assert isinstance(conn, RoutedConnection)
        assert conn.address == wrong
        assert await conn.execute("RPUSH", f"{tag}:l", "a") == 1
        assert conn.address == node
        assert await conn.execute("BLMOVE", f"{tag}:l", f"{tag}:l", "RIGHT", "LEFT", 0.1) == b"a"
    assert cc.moved == 5


async def test_ask_is_followed_during_a_migration(
    redis_cluster: RedisCluster, cc: ClusterClient
) -> None:
    key = "{ask}:a"
    slot = redis_cluster.slot_of(key)
    source = node_of(cc, key)
    target = other_node(cc, key)
    await cc.execute("SET", key, "before")
    await cc.execute("RPUSH", "{ask}:list", "x", "y")
    redis_cluster.begin_migration(slot, source[1], target[1])
    try:
        assert await cc.execute("GET", key) == b"before"  # still on the source
        assert cc.asked == 0
        assert redis_cluster.migrate_keys(slot, source[1], target[1]) == 2
        assert await cc.execute("GET", key) == b"before"  # ASK -> ASKING + GET on the target
        assert cc.asked == 1
        assert await cc.execute("SET", "{ask}:new", "n") == b"OK"  # created on the target
        assert cc.asked == 2
        assert redis_cluster.command(target[1], "CLUSTER", "COUNTKEYSINSLOT", slot) == 3
        assert redis_cluster.command(source[1], "CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        # a dedicated connection on the source follows ASK on a second connection
        conn = await cc.connect(name="test-ask", key=key)
        async with conn:
            assert isinstance(conn, RoutedConnection) and conn.address == source
            assert await conn.execute("BLMOVE", "{ask}:list", "{ask}:list", "RIGHT", "LEFT", 0.1) == b"y"
            assert conn.address == source
        assert cc.asked == 3
        assert cc.owner(slot) == source
    finally:
        redis_cluster.end_migration(slot, target[1])
        redis_cluster.wait_agreement()
    assert await cc.execute("GET", key) == b"before"
    assert cc.moved == 1 and cc.owner(slot) == target


async def test_pipeline_runs_in_order_across_nodes(
    redis_cluster: RedisCluster, cc: ClusterClient
) -> None:
    a, b, c = cc.nodes
    ka, kb, kc = key_on(cc, a, "pa"), key_on(cc, b, "pb"), key_on(cc, c, "pc")
    mons = {n: NodeMonitor(cc, n) for n in cc.nodes}
    async with trio.open_nursery() as nursery:
        for m in mons.values():
            await nursery.start(m.run)
        replies = await cc.pipeline([
            ("RPUSH", ka, "1"), ("RPUSH", kb, "2"), ("RPUSH", ka, "3"), ("RPUSH", kc, "4"),
            ("LRANGE", ka, 0, -1), ("LRANGE", kb, 0, -1), ("LRANGE", kc, 0, -1),
        ])
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert replies == [1, 1, 2, 1, [b"1", b"3"], [b"2"], [b"4"]]
    times = [
        mons[a].find("RPUSH", f'"{ka}" "1"')[0], mons[b].find("RPUSH", f'"{kb}" "2"')[0],
        mons[a].find("RPUSH", f'"{ka}" "3"')[0], mons[c].find("RPUSH", f'"{kc}" "4"')[0],
    ]
    assert times == sorted(times)

    # NOSCRIPT on every node: each node loads the script, every command runs once
    redis_cluster.flushall()
    script = Script("return redis.call('INCR', KEYS[1])", name="incr-each")
    replies = await cc.pipeline([script.command([k], []) for k in (ka, kb, kc, ka)])
    assert replies == [1, 1, 1, 2]


async def test_scan_with_a_hash_tagged_pattern_goes_to_the_tag_node(cc: ClusterClient) -> None:
    first = cc.owner(0)
    tag = next(t for t in (f"scan{i}" for i in range(1000)) if node_of(cc, t) != first)
    await cc.pipeline([("SET", f"{{{tag}}}:a", 1), ("SET", f"{{{tag}}}:b", 1)])
    assert slot_of(("SCAN", 0, "MATCH", f"{{{tag}}}:*")) == slot_of(("GET", tag))
    assert slot_of(("SCAN", 0, "MATCH", "scan*")) is None
    assert slot_of(("SCAN", 0, "MATCH", "{sc*}:x")) is None
    cursor, found = b"0", set()
    while True:
        cursor, batch = await cc.execute("SCAN", cursor, "MATCH", f"{{{tag}}}:*", "COUNT", 1000)
        found |= set(batch)
        if cursor == b"0":
            break
    assert found == {f"{{{tag}}}:a".encode(), f"{{{tag}}}:b".encode()}


async def test_transaction_needs_one_slot(cc: ClusterClient) -> None:
    assert await cc.transaction([("SET", "{t}a", 1), ("INCR", "{t}b")]) == [b"OK", 1]
    with pytest.raises(Exception, match="one hash slot"):
        await cc.transaction([("SET", "{t}a", 1), ("SET", "{u}b", 1)])


async def test_a_timeout_is_raised_not_retried(cc: ClusterClient) -> None:
    key = "timeout-key"
    mon = NodeMonitor(cc, node_of(cc, key))
    async with trio.open_nursery() as nursery:
        await nursery.start(mon.run)
        with pytest.raises(Exception, match="outcome unknown"):
            await cc.execute("BLPOP", key, 1, timeout=0.1)
        await trio.sleep(1.2)
        nursery.cancel_scope.cancel()
    assert len(mon.find("BLPOP", f'"{key}"')) == 1


# -- the consumer: every stream cell ---------------------------------------------------


S, G = "orders", "billing"
SNAME = f"stream {S!r} group {G!r}"


def _stream_case(case: str, cc: ClusterClient) -> tuple[StreamSubscription, Callable[[Delivery], Outcome]]:
    if case in ("ack", "drop"):
        outcome = ACK if case == "ack" else DROP
        return StreamSubscription(S, G, block=0.1), lambda d: outcome
    if case == "retry":
        return StreamSubscription(S, G, block=0.1), lambda d: RETRY if d.attempt == 1 else ACK
    if case == "durable":
        return (StreamSubscription(S, G, block=0.1, delayed_retry=DelayedRetry.DURABLE_ZSET),
                lambda d: retry_after(0.2) if d.attempt == 1 else ACK)
    dead = "{orders}:dead" if case == "dead-same-slot" else key_on(cc, other_node(cc, S), "dead-")
    return StreamSubscription(S, G, block=0.1, max_attempts=2, dead_letter=dead), lambda d: RETRY


@pytest.mark.parametrize("case", ["ack", "drop", "retry", "durable", "dead-same-slot", "dead-other-slot"])
async def test_stream_cells(redis_cluster: RedisCluster, cc: ClusterClient, case: str) -> None:
    sub, decide = _stream_case(case, cc)
    ids = await xadd_many(cc, S, 5)
    h = Recorder(decide)
    want = {"ack": "acked", "drop": "dropped", "retry": "acked", "durable": "acked",
            "dead-same-slot": "dead_lettered", "dead-other-slot": "dead_lettered"}[case]
    dead = sub.dead_letter if case.startswith("dead") else None  # (the others: the default)
    mons = {n: NodeMonitor(cc, n) for n in cc.nodes}
    async with trio.open_nursery() as nursery:
        for m in mons.values():
            await nursery.start(m.run)
        async with open_consumer(cc, name="c1") as consumer:
            await consumer.mount(sub, h)
            await eventually(lambda: effects(consumer, SNAME).get(want) == 5, what=want)
            e = effects(consumer, SNAME)
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert await pending(cc, S, G) == 0
    entries = await cc.execute("XRANGE", S, "-", "+")
    origins = {d.origin_id for d in h.seen}
    assert origins == set(ids)
    if case in ("ack", "drop"):
        assert len(entries) == 5 and [d.attempt for d in h.seen] == [1] * 5
    if case == "retry":
        assert e.get("copied") == 5
        copies = [dict(zip(f[::2], f[1::2], strict=True)) for _, f in entries[5:]]
        assert len(copies) == 5 and all(c[RETRIES_FIELD] == b"1" for c in copies)
        assert sorted(d.attempt for d in h.seen) == [1] * 5 + [2] * 5
    if case == "durable":
        assert e.get("delayed") == 5 and e.get("moved_from_delay_set") == 5
        assert await cc.execute("ZCARD", "{orders}:delayed") == 0
        assert sorted(d.attempt for d in h.seen) == [1] * 5 + [2] * 5
    if dead is not None:
        assert len(h.seen) == 10  # attempts 1 and 2, then dead
        rows = await cc.execute("XRANGE", dead, "-", "+")
        assert len(rows) == 5
        got = {dict(zip(f[::2], f[1::2], strict=True))[b"trf-dead-id"].decode() for _, f in rows}
        assert got == {d.id for d in h.seen if d.attempt == 2}
        src, dst = mons[node_of(cc, S)], mons[node_of(cc, dead)]
        if case == "dead-same-slot":
            # gated scripts on the stream's node (a batch's in one batched
            # call): XADD then XACK inside them
            assert len(src.find("EVALSHA", f'"{S}" "{dead}"')) >= 1
            assert len(src.find("XADD", f'"{dead}"', lua=True)) == 5
            assert len(src.find("XACK", f'"{S}"', lua=True)) >= 1
        else:
            # another node: two commands from a pool connection, the copy first (a
            # plain XADD in the one-key stream_xadd script: trf-dead-time, the
            # server's clock)
            assert dst is not src
            xadds = dst.find("XADD", f'"{dead}"', lua=True)
            dead_ids = {d.id for d in h.seen if d.attempt == 2}
            xacks = [t for t, a, c, rest in src.lines if c == "XACK" and a != "lua"
                     and any(i in rest for i in dead_ids)]
            assert len(xadds) == 5 and xacks
            assert max(xadds) <= max(xacks) and min(xadds) <= min(xacks)


# -- every reliable-list cell -------------------------------------------------------------


Q = "jobs"
QNAME = f"reliable list {Q!r}"


@pytest.mark.parametrize("case", ["ack", "drop", "retry", "durable", "dead-same-slot", "dead-other-slot"])
async def test_reliable_list_cells(redis_cluster: RedisCluster, cc: ClusterClient, case: str) -> None:
    dead: str | None = None
    kwargs: dict[str, Any] = {}
    decide: Callable[[Delivery], Outcome]
    if case in ("ack", "drop"):
        outcome = ACK if case == "ack" else DROP
        decide = lambda d: outcome  # noqa: E731
    elif case == "retry":
        decide = lambda d: RETRY if d.attempt == 1 else ACK  # noqa: E731
    elif case == "durable":
        kwargs["delayed_retry"] = DelayedRetry.DURABLE_ZSET
        decide = lambda d: retry_after(0.2) if d.attempt == 1 else ACK  # noqa: E731
    else:
        dead = "{jobs}:dead" if case == "dead-same-slot" else key_on(cc, other_node(cc, Q), "dead-")
        kwargs.update(max_attempts=2, dead_letter=dead)
        decide = lambda d: RETRY  # noqa: E731
    want = {"ack": "acked", "drop": "dropped", "retry": "acked", "durable": "acked",
            "dead-same-slot": "dead_lettered", "dead-other-slot": "dead_lettered"}[case]
    await cc.execute("LPUSH", Q, *[f"job-{i}" for i in range(5)])
    h = Recorder(decide)
    sub = ReliableListSubscription(Q, block=0.1, **kwargs)
    async with open_consumer(cc, name="c1") as consumer:
        await consumer.mount(sub, h)
        await eventually(lambda: effects(consumer, QNAME).get(want) == 5, what=want)
        e = effects(consumer, QNAME)
        processing = consumer.mounts[0].target.processing
    assert processing == "{jobs}:processing:c1"
    assert await cc.execute("LRANGE", processing, 0, -1) == []
    assert await cc.execute("LRANGE", Q, 0, -1) == []
    assert {d.data for d in h.seen} == {f"job-{i}".encode() for i in range(5)}
    if case in ("retry", "durable"):
        assert sorted(d.attempt for d in h.seen) == [1] * 5 + [2] * 5
        assert e.get("copied" if case == "retry" else "delayed") == 5
    if case == "durable":
        assert await cc.execute("ZCARD", "{jobs}:delayed") == 0
    if dead is not None:
        rows = await cc.execute("LRANGE", dead, 0, -1)
        assert sorted(unwrap(r)[0] for r in rows) == sorted(f"job-{i}".encode() for i in range(5))


async def test_cluster_refuses_derived_keys_on_another_slot(cc: ClusterClient) -> None:
    async with open_consumer(cc, name="c1") as consumer:
        with pytest.raises(ValueError, match="processing"):
            await consumer.mount(ReliableListSubscription(Q, processing="elsewhere"), Recorder(lambda d: ACK))
        with pytest.raises(ValueError, match="delay_key"):
            await consumer.mount(
                StreamSubscription(S, G, delayed_retry=DelayedRetry.DURABLE_ZSET, delay_key="elsewhere"),
                Recorder(lambda d: ACK),
            )


async def test_pubsub_messages_from_any_node(redis_cluster: RedisCluster, cc: ClusterClient) -> None:
    h = Recorder(lambda d: ACK)
    async with open_consumer(cc, name="c1") as consumer:
        await consumer.mount(ChannelSubscription("news"), h)
        for port in redis_cluster.ports:  # classic Pub/Sub reaches every node
            redis_cluster.command(port, "PUBLISH", "news", f"from {port}")
        await eventually(lambda: len(h.seen) == 3, what="three messages")
    assert sorted(d.data for d in h.seen) == sorted(f"from {p}".encode() for p in redis_cluster.ports)


# -- keys on different nodes, one consumer --------------------------------------------------


async def test_streams_on_three_nodes_one_consumer(
    redis_cluster: RedisCluster, redis_cluster_url: str, cc: ClusterClient
) -> None:
    streams = [key_on(cc, n, f"s{i}-") for i, n in enumerate(cc.nodes)]
    assert len({node_of(cc, s) for s in streams}) == 3
    produced = {s: set(await xadd_many(cc, s, 100)) for s in streams}
    seen: dict[str, set[str]] = {s: set() for s in streams}

    async def handle(d: Delivery) -> Outcome:
        seen[d.source].add(d.origin_id)
        return RETRY if d.attempt == 1 and int(d.fields[b"n"]) % 10 == 0 else ACK

    async with open_consumer(redis_cluster_url, name="multi") as consumer:  # the URL, this time
        for s in streams:
            await consumer.mount(StreamSubscription(s, G, block=0.1), handle, concurrency=4)
        names = [f"stream {s!r} group {G!r}" for s in streams]
        await eventually(lambda: all(effects(consumer, n).get("acked") == 100 for n in names),
                         what="all acked")
        # each reader's connection is on the node of its stream
        for port in redis_cluster.ports:
            clients = redis_cluster.command(port, "CLIENT", "LIST").decode()
            assert clients.count("name=trf:multi:reader") == 1
    assert seen == produced
    for s in streams:
        assert await pending(cc, s, G) == 0
        assert await cc.execute("XLEN", s) == 110  # ten copies each


async def test_writes_commit_in_the_sources_slot_and_elsewhere_are_a_handler_error(
    redis_cluster_url: str, cc: ClusterClient,
) -> None:
    """Exactly-once effects in Redis Cluster: a write on a key of the stream's
    hash slot is committed with the ACK (one script on that node); one on a key
    of another slot cannot be, so the outcome is a handler error (a ValueError
    naming the key, logged; ``on_error`` -- DROP here -- applies)."""
    s = "{wr}orders"
    here, there = "{wr}totals", "totals-elsewhere"
    assert slot_of(here) == slot_of(s) != slot_of(there)
    await xadd_many(cc, s, 4)

    async def handle(d: Delivery) -> Outcome:
        key = here if int(d.fields[b"n"]) % 2 == 0 else there
        return ACK.with_writes(("HINCRBY", key, "n", 1))

    name = f"stream {s!r} group {G!r}"
    async with open_consumer(redis_cluster_url, name="w") as consumer:
        await consumer.mount(StreamSubscription(s, G, block=0.1), handle, on_error=DROP)
        await eventually(lambda: effects(consumer, name).get("acked") == 2
                         and effects(consumer, name).get("dropped") == 2, what="finalized")
        assert consumer.stats()[name]["handler_errors"] == 2
        assert effects(consumer, name).get("writes") == 2
    assert await cc.execute("HGET", here, "n") == b"2"
    assert await cc.execute("EXISTS", there) == 0
    assert await pending(cc, s, G) == 0


# -- a slot migrated during consumption ------------------------------------------------------


async def test_slot_migrated_during_consumption_loses_nothing(
    redis_cluster: RedisCluster, cc: ClusterClient
) -> None:
    """The stream and the reliable list of one slot move to another node while
    a consumer reads and finalizes them and a producer writes: MOVED and ASK
    are followed, every entry and element is handled and finalized."""
    stream, queue = "{mig}:stream", "{mig}:queue"
    slot = redis_cluster.slot_of(stream)
    source = node_of(cc, stream)
    target = other_node(cc, stream)
    total = 300
    handled_s: set[str] = set()
    handled_q: set[bytes] = set()

    async def on_stream(d: Delivery) -> Outcome:
        if d.attempt == 1 and int(d.fields[b"n"]) % 7 == 0:
            return RETRY
        handled_s.add(d.fields[b"n"].decode())
        return ACK

    async def on_queue(d: Delivery) -> Outcome:
        assert d.data is not None
        if d.attempt == 1 and int(d.data) % 7 == 0:
            return RETRY
        handled_q.add(d.data)
        return ACK

    async def produce(client: ClusterClient) -> None:
        for i in range(total):
            await client.execute("XADD", stream, "*", "n", str(i))
            await client.execute("LPUSH", queue, str(i))
            await trio.sleep(0.004)

    def migrate() -> None:
        redis_cluster.begin_migration(slot, source[1], target[1])
        trio.from_thread.run(trio.sleep, 0.3)  # some reads and writes while MIGRATING
        while redis_cluster.migrate_keys(slot, source[1], target[1]):
            trio.from_thread.run(trio.sleep, 0.1)  # the keys on the target, slot not yet moved: ASK
        trio.from_thread.run(trio.sleep, 0.3)
        redis_cluster.end_migration(slot, target[1])
        redis_cluster.wait_agreement()

    async with open_client(redis_cluster.url) as consumer_client, open_client(redis_cluster.url) as pc:
        assert isinstance(consumer_client, ClusterClient) and isinstance(pc, ClusterClient)
        async with open_consumer(consumer_client, name="mover") as consumer:
            await consumer.mount(StreamSubscription(stream, G, block=0.1), on_stream, concurrency=2)
            await consumer.mount(ReliableListSubscription(queue, block=0.1), on_queue, concurrency=2)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce, pc)
                await eventually(lambda: len(handled_s) >= 60, what="consumption under way")
                await trio.to_thread.run_sync(migrate)
            await eventually(lambda: len(handled_s) == total and len(handled_q) == total,
                             timeout=20, what="everything handled")
            s_stats = consumer.stats()[f"stream {stream!r} group {G!r}"]
            q_stats = consumer.stats()[f"reliable list {queue!r}"]
        moved, asked = consumer_client.moved + pc.moved, consumer_client.asked + pc.asked
        followed = (consumer_client.moved, consumer_client.asked)
    assert followed[0] > 0 and followed[1] > 0, followed  # the consumer itself was redirected
    assert moved > followed[0] and asked > followed[1]  # and so was the producer
    assert redis_cluster.owner(slot) == target[1]
    assert redis_cluster.command(source[1], "CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    assert handled_s == {str(i) for i in range(total)}
    assert handled_q == {str(i).encode() for i in range(total)}
    # finalized: nothing pending, every copy consumed, queue and processing list empty
    assert int(redis_cluster.command(target[1], "XPENDING", stream, G)[0]) == 0
    retried = len(range(0, total, 7))
    assert redis_cluster.command(target[1], "XLEN", stream) == total + retried
    assert redis_cluster.command(target[1], "LLEN", queue) == 0
    assert redis_cluster.command(target[1], "LLEN", "{mig}:queue:processing:mover") == 0
    assert s_stats["effects"].get("copied") == retried and q_stats["effects"].get("copied") == retried
    assert s_stats["finalize_errors"] == 0 and q_stats["finalize_errors"] == 0
