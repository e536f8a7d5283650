"""Bytes that are not RESP on every transport path: the error names the
address and what came, the connection is marked lost and closed, and what
used it goes on (a new connection; the cluster's slot map, a Sentinel
client's master read again).

The command proxy (``faults.cmdproxy``) answers a chosen request with an
HTTP status line (:data:`~faults.cmdproxy.GARBLED`: after the server ran
it; ``GARBLED_INSTEAD``: without running it), or pushes bytes of the
test's own to a subscriber (:meth:`~faults.cmdproxy.CommandProxy.push`).
Real servers (``TRF_REDIS_SERVER``), a Redis Cluster, a Sentinel topology;
timeouts are bounds.
"""

from __future__ import annotations

import logging
import re

import pytest
from _procs import eventually
from faults.cmdproxy import GARBLED, GARBLED_INSTEAD, NOT_RESP, CommandProxy, serving
from redis import exceptions as rexc
from test_cluster import key_on

from trio_redis_finalize import ACK, Delivery, Outcome, open_consumer
from trio_redis_finalize import ChannelSubscription as Channel
from trio_redis_finalize._transport import Client, Message, open_client, parse_url
from trio_redis_finalize._transport._sentinel import SentinelClient
from trio_redis_finalize.testing import RedisCluster, RedisSentinel, RedisServer

pytestmark = pytest.mark.timeout(60)

HTTP = r"Protocol error, got \"H\" as reply type byte; the last read: b'.*HTTP/1\.1 400 "
"""What the error says came, after the address: the parser's words, the end of the read."""
MESSAGE = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$2\r\nm9\r\n"


def not_redis(port: int, came: str = HTTP) -> str:
    """The pattern of the error about ``127.0.0.1:<port>``: ``came``, in its parentheses."""
    return rf"^127\.0\.0\.1:{port} did not answer as a Redis server \({came}"


# -- one server: a pooled command, a pipeline ------------------------------------------


@pytest.mark.parametrize("call", ["execute", "pipeline"])
async def test_a_garbled_reply_names_the_address_and_what_came(
    redis_server: RedisServer, flavour: str, call: str,
) -> None:
    """The connection is closed and counted lost: the pool drops its idle
    ones too, and the next command gets a new connection.  Before: no
    bytes shown (only the parser's words)."""
    async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
            open_client(proxy.url) as client:
        await client.execute("SET", "k", "v")
        async with client.lease() as a, client.lease() as b:  # two idle connections after
            await a.execute("PING")
            await b.execute("PING")
        assert client.idle_connections == 2
        opened = client.connections_opened
        proxy.arm("GET", GARBLED)
        with pytest.raises(rexc.InvalidResponse, match=not_redis(proxy.port)):
            if call == "execute":
                await client.execute("GET", "k")
            else:
                await client.pipeline([("SET", "k", "w"), ("GET", "k"), ("PING",)])
        assert client.idle_connections == 0
        assert await client.execute("GET", "k") == (b"v" if call == "execute" else b"w")
        assert client.connections_opened == opened + 1


# -- Pub/Sub ------------------------------------------------------------------------------

PUSHES: dict[str, tuple[bytes, str]] = {
    "not-resp": (NOT_RESP, HTTP),
    "not-resp-after-a-message": (MESSAGE + NOT_RESP, HTTP),
    "not-a-pubsub-reply": (b":1\r\n", r"unexpected Pub/Sub reply 1\)$"),
}


@pytest.mark.parametrize("push", list(PUSHES))
async def test_a_subscriber_met_by_what_is_not_a_pubsub_reply(
    redis_server: RedisServer, flavour: str, push: str,
) -> None:
    """Read by ``get_message`` (the parser waiting for the socket), by the
    iterator of ``received`` (after a message of the same read), or a reply
    that is RESP but no Pub/Sub reply: the error names the address and what
    came, the connection is marked lost and closed (by ``get_message``: its
    socket at once).  Before: ``Protocol error ...`` or ``unexpected Pub/Sub
    reply 1``, no address, the connection neither lost nor closed."""
    data, came = PUSHES[push]
    async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
            open_client(proxy.url) as client, client.pubsub() as ps:
        await ps.subscribe("ch")
        assert await proxy.push(data) == 1
        if push == "not-resp-after-a-message":
            assert await ps.get_message(timeout=5) == Message(b"ch", b"m9")
            with pytest.raises(rexc.InvalidResponse, match=not_redis(proxy.port, came)):
                list(ps.received(10))
        else:
            with pytest.raises(rexc.InvalidResponse, match=not_redis(proxy.port, came)):
                await ps.get_message(timeout=5)
            await eventually(lambda: not any(c.pubsub for c in proxy._conns.values()), 5,
                             "the subscriber's socket closed")
        assert ps.conn.lost and ps.conn.broken
        with pytest.raises(rexc.ConnectionError, match="closed"):
            await ps.ping()


class Seen:
    """A handler: records the messages' data, acknowledges."""

    def __init__(self) -> None:
        self.data: list[bytes] = []

    async def __call__(self, d: Delivery) -> Outcome:
        self.data.append(d.data)
        return ACK


@pytest.mark.parametrize("push", ["not-resp", "not-resp-after-a-message"])
async def test_a_channel_subscription_met_by_bytes_that_are_not_resp_subscribes_again(
    redis_server: RedisServer, flavour: str, client: Client, caplog: pytest.LogCaptureFixture,
    push: str,
) -> None:
    """As after a lost connection: a new connection subscribes again (the
    gap counted) and what is published after it is handled; the warning
    names the address.  Before: the warning said ``Protocol error, got "H"
    as reply type byte`` and no more."""
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    seen = Seen()
    async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
            open_consumer(proxy.url, name="c1", shutdown_grace=1.0) as consumer:
        await consumer.mount(Channel("ch"), seen)
        name = consumer.mounts[0].name
        await client.execute("PUBLISH", "ch", b"m1")
        await eventually(lambda: seen.data == [b"m1"], 10, "m1 handled")
        assert await proxy.push(PUSHES[push][0]) == 1
        await eventually(lambda: consumer.stats()[name]["effects"].get("gaps") == 1, 15,
                         "subscribed again")
        await client.execute("PUBLISH", "ch", b"m2")
        await eventually(lambda: seen.data[-1:] == [b"m2"], 10,
                         lambda: f"m2 handled (seen {seen.data})")
        assert consumer.stats()[name]["read_errors"] == 1
    failed = [r.getMessage() for r in caplog.records if "read failed" in r.getMessage()]
    assert len(failed) == 1, failed
    assert re.search(r"read failed \(" + not_redis(proxy.port)[1:], failed[0]), failed[0]


# -- Redis Cluster ------------------------------------------------------------------------


async def test_a_cluster_node_that_garbles_is_left_and_the_slot_map_read_again(
    redis_cluster: RedisCluster, redis_cluster_url: str, flavour: str,
) -> None:
    """A seed that answers ``CLUSTER SLOTS`` with bytes that are not RESP:
    the next seed is asked (before: the ``InvalidResponse`` ended the
    refresh, and opening the client failed).  A node that garbles a reply:
    its connection is dropped and the slot map is read again before the
    next command, as after a lost connection (before: the map was kept)."""
    node, other = redis_cluster.servers[0], redis_cluster.servers[1]
    async with serving(CommandProxy(node.port, flavour=flavour)) as proxy:
        # the proxied node named by the proxy's address: its connections go through it
        proxy.rewrites["CLUSTER SLOTS"] = lambda reply: reply.replace(
            b":%d\r\n" % node.port, b":%d\r\n" % proxy.port)
        proxy.arm("CLUSTER SLOTS", GARBLED_INSTEAD)
        async with open_client(f"redis+cluster://127.0.0.1:{proxy.port},"
                               f"127.0.0.1:{other.port}") as cc:
            assert proxy.fired and cc.nodes  # the map from the second seed
        async with open_client(f"redis+cluster://127.0.0.1:{proxy.port}") as cc:
            addr = ("127.0.0.1", proxy.port)
            key = key_on(cc, addr, "garbled-")
            await cc.execute("SET", key, "v")
            refreshes = cc.refreshes
            proxy.arm("GET", GARBLED)
            with pytest.raises(rexc.InvalidResponse, match=not_redis(proxy.port)):
                await cc.execute("GET", key)
            assert cc.node(addr).idle_connections == 0
            assert await cc.execute("GET", key) == b"v"
            assert cc.refreshes == refreshes + 1


# -- Sentinel -------------------------------------------------------------------------------


def _bulk(n: int) -> bytes:
    text = b"%d" % n
    return b"$%d\r\n%s\r\n" % (len(text), text)


async def test_a_garbled_reply_to_a_sentinel_client(flavour: str) -> None:
    """A sentinel that garbles ``get-master-addr-by-name``: the error names
    it (and the next question is answered).  The master garbling a reply:
    the next connection asks the sentinels again, as after a lost
    connection (before: no new question, the client kept the address); the
    master garbling ``ROLE`` for a new connection: the client asks the
    sentinels again and connects (before: the ``InvalidResponse`` came out
    of ``connect``)."""
    with RedisSentinel(sentinels=1, quorum=1) as top:
        mport = top.master_port()
        async with serving(CommandProxy(mport, flavour=flavour)) as master, \
                serving(CommandProxy(top.sentinel_ports[0], flavour=flavour)) as sentinel:
            # the sentinel names the master's proxy: the client's connections go through it
            sentinel.rewrites["SENTINEL"] = lambda reply: reply.replace(
                _bulk(mport), _bulk(master.port))
            sc = SentinelClient(parse_url(
                f"redis+sentinel://127.0.0.1:{sentinel.port}/{top.service_name}"))
            try:
                sentinel.arm("SENTINEL", GARBLED_INSTEAD)
                with pytest.raises(rexc.ConnectionError, match=(
                        rf"^no sentinel named the master '{top.service_name}': 127\.0\.0\.1:"
                        rf"{sentinel.port}: {not_redis(sentinel.port)[1:]}")):
                    await sc.discover()
                assert await sc.discover() == ("127.0.0.1", master.port)
                await sc.execute("SET", "k", "v")
                asked = sc.discoveries
                master.arm("GET", GARBLED)
                with pytest.raises(rexc.InvalidResponse, match=not_redis(master.port)):
                    await sc.execute("GET", "k")
                assert await sc.execute("GET", "k") == b"v"
                assert sc.discoveries == asked + 1
                master.arm("ROLE", GARBLED)
                async with await sc.connect() as conn:
                    assert await conn.execute("GET", "k") == b"v"
                assert [f.kind for f in master.fired] == ["GET", "ROLE"]
                assert sc.discoveries == asked + 2
            finally:
                await sc.aclose()


@pytest.mark.parametrize("after", ["error-reply", "not-a-message", "not-resp"])
async def test_messages_read_with_a_reply_that_is_no_message_are_handled_first(
    redis_server: RedisServer, flavour: str, client: Client, after: str,
) -> None:
    """Two messages and, in the same read, an error reply, a reply of RESP
    that is no message, or bytes that are not RESP: the messages are
    handled, then the reply is taken as ``get_message`` takes it (an error
    raised: the read loop subscribes again; what is published after it is
    handled).  Before: the reply was taken first (the bytes that are not
    RESP raised while the messages were decoded), and the two messages were
    dropped unhandled."""
    seen = Seen()
    tail = {"error-reply": b"-ERR not now\r\n", "not-a-message": b":1\r\n",
            "not-resp": NOT_RESP}[after]
    async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
            open_consumer(proxy.url, name="c1", shutdown_grace=1.0) as consumer:
        await consumer.mount(Channel("ch"), seen)
        await client.execute("PUBLISH", "ch", b"m1")
        await eventually(lambda: seen.data == [b"m1"], 10, "m1 handled")
        two = MESSAGE + MESSAGE.replace(b"m9", b"m8")
        assert await proxy.push(two + tail) == 1
        await eventually(lambda: seen.data[1:3] == [b"m9", b"m8"], 10,
                         lambda: f"the two messages handled (seen {seen.data})")
        async def published() -> bool:
            await client.execute("PUBLISH", "ch", b"m2")
            return b"m2" in seen.data
        await eventually(published, 15, lambda: f"m2 handled (seen {seen.data})")
