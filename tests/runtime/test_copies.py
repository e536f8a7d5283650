"""Stream copies against a real redis-server: what a copy keeps and who handles it.

* Copies keep the original field list byte for byte, order and repeated
  names included (RETRY, durable and runtime ``retry_after``, dead letter);
  the handler sees the list as ``Delivery.field_list``.
* Entries of any width are copied: a RETRY or dead letter of 5,000 fields
  (past Lua's ~8,000 values of one ``unpack``), a wide member of the durable
  delay set (never holding up the members behind it; members wider than the
  script's budget are handed back to the client, leased, written, removed).
* Copies a group writes to the stream are addressed to that group
  (:data:`GROUP_FIELD`): every other group acknowledges them without calling
  its handler and counts them (``foreign_copy``); copies without the header
  (older versions) are handled by every group.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import trio
from _procs import Monitor, eventually
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_redis_finalize import (
    ACK,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    RETRY,
    DelayedRetry,
    Delivery,
    Outcome,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._types import DEAD_FIELDS
from trio_redis_finalize._core.stream.moves import stream_fields
from trio_redis_finalize._core.stream.scripts import MOVE_DUE_TO_STREAM
from trio_redis_finalize._envelope import GROUP_FIELD, pack_parts, unpack_parts
from trio_redis_finalize._forms import _delay_set
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize.pytest_plugin import RunConsumer

S, G, DEAD = "s", "g", "s-dead"
DZ = DelayedRetry.DURABLE_ZSET
DELAY_KEY = "{s}:delayed"

# repeated names, binary and empty names and values, a name that looks like a header's prefix
NARROW = [b"item", b"apple", b"item", b"pear", b"\x00bin", b"\xff\x00", b"", b"empty name",
          b"trf-", b"x", b"item", b""]
# 5,000 fields (10,000 values: past one Lua unpack), one name repeated
WIDE = [x for i in range(5000) for x in (b"f%d" % i if i % 100 else b"dup", b"v%d" % i)]
HEADERS = {RETRIES_FIELD, ORIGIN_FIELD, GROUP_FIELD}


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Client]:
    async with open_client(redis_url) as client:
        yield client


def pairs(flat: Sequence[bytes]) -> tuple[tuple[bytes, bytes], ...]:
    return tuple(zip(flat[::2], flat[1::2], strict=True))


async def entries(redis: Client, stream: str = S) -> list[tuple[bytes, list[bytes]]]:
    return [(eid, list(f)) for eid, f in await redis.execute("XRANGE", stream, "-", "+")]


async def group_info(redis: Client, stream: str, group: str) -> dict[str, Any]:
    for row in await redis.execute("XINFO", "GROUPS", stream):
        info = {row[i].decode(): row[i + 1] for i in range(0, len(row), 2)}
        if info["name"] == group.encode():
            return info
    raise AssertionError(f"no group {group!r} on {stream!r}")


# -- item 4 and 6: the copy is the original, byte for byte, at any width --------------------

WAYS = {
    "retry": ({}, RETRY),
    "durable": ({"delayed_retry": DZ}, retry_after(0)),
    "runtime": ({"delayed_retry": DelayedRetry.RUNTIME}, retry_after(0.01)),
    "dead": ({"max_attempts": 1, "dead_letter": DEAD}, RETRY),
}


@pytest.mark.parametrize("width", ["narrow", "wide"])
@pytest.mark.parametrize("way", list(WAYS))
async def test_copies_keep_the_field_list(redis: Client, run_consumer: RunConsumer, way: str,
                                          width: str) -> None:
    original = NARROW if width == "narrow" else WIDE
    eid = await redis.execute("XADD", S, "*", *original)
    extra, first = WAYS[way]
    calls: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        calls.append(d)
        return first if d.attempt == 1 else ACK

    async def done() -> bool:
        if way == "dead":
            return bool(await redis.execute("XLEN", DEAD) == 1)
        return len(calls) == 2

    await run_consumer(StreamSubscription(S, G, block=0.05, **extra), handle, done, timeout=10)
    if way == "dead":
        [(_, copy)] = await entries(redis, DEAD)
        assert copy[: len(original)] == original
        names = [n for n, _ in pairs(copy[len(original):])]
        assert set(names) == {RETRIES_FIELD, ORIGIN_FIELD, *DEAD_FIELDS}  # no group address
        assert len(calls) == 1
    else:
        (_, orig), (_, copy) = await entries(redis)
        assert orig == original
        assert copy == [*original, RETRIES_FIELD, b"1", ORIGIN_FIELD, eid, GROUP_FIELD, G.encode()]
        assert [d.attempt for d in calls] == [1, 2]
    # the handler sees the list as it is (no library header), and the mapping: last value wins
    for d in calls:
        assert d.field_list == pairs(original)
        assert dict(d.fields) == dict(pairs(original))
        assert not HEADERS & set(d.fields)
    if width == "narrow":
        assert calls[0].fields[b"item"] == b""


async def test_field_list_of_a_copy_with_repeated_header_names(redis: Client,
                                                               run_consumer: RunConsumer) -> None:
    # a foreign copy carrying header names twice: none of them reaches the handler
    await redis.execute("XADD", S, "*", "a", "1", RETRIES_FIELD, "1", "b", "2", RETRIES_FIELD, "2",
                        ORIGIN_FIELD, "0-1", "a", "3")
    calls: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        calls.append(d)
        return ACK

    await run_consumer(StreamSubscription(S, G, block=0.05), handle, lambda: calls)
    [d] = calls
    assert d.field_list == ((b"a", b"1"), (b"b", b"2"), (b"a", b"3"))
    assert dict(d.fields) == {b"a": b"3", b"b": b"2"}
    assert (d.attempt, d.origin_id) == (3, "0-1")


# -- item 6: a wide member never holds up the delay set --------------------------------------

def member(fields: Sequence[bytes]) -> bytes:
    return pack_parts([uuid.uuid4().bytes, *fields])


async def test_wide_member_does_not_hold_up_the_others(redis: Client,
                                                       run_consumer: RunConsumer) -> None:
    wide = [*WIDE, ORIGIN_FIELD, b"0-1", RETRIES_FIELD, b"1"]
    narrow = [[b"n", b"%d" % i, ORIGIN_FIELD, b"0-%d" % (i + 2), RETRIES_FIELD, b"1"]
              for i in range(3)]
    await redis.execute("ZADD", DELAY_KEY, 0, member(wide),
                        *[x for i, f in enumerate(narrow) for x in (i + 1, member(f))])
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append(d)
        return ACK

    await run_consumer(StreamSubscription(S, G, block=0.05, delayed_retry=DZ), handle,
                       lambda: len(seen) == 4, timeout=10)
    assert [d.origin_id for d in seen] == ["0-1", "0-2", "0-3", "0-4"]
    assert [f for _, f in await entries(redis)] == [wide, *narrow]
    assert await redis.execute("EXISTS", DELAY_KEY) == 0


async def test_move_script_hands_back_members_past_its_width(redis: Client) -> None:
    now_s, _ = await redis.execute("TIME")
    members = [member([b"a", b"1"]), member([b"w", b"1", b"w", b"2"]), member([b"b", b"2"])]
    await redis.execute("ZADD", DELAY_KEY, *[x for i, m in enumerate(members) for x in (i, m)])
    # budget 2 values: the second member (4 values) is handed back, leased 60 s
    moved, now_ms, first, *back = await redis.evalsha(
        MOVE_DUE_TO_STREAM, (DELAY_KEY, S), (128, 2, 60_000))
    assert moved == 2 and back == [members[1]]
    assert int(now_ms) // 1000 >= int(now_s)
    assert int(float(first)) == int(now_ms) + 60_000
    assert [f for _, f in await entries(redis)] == [[b"a", b"1"], [b"b", b"2"]]
    assert float(await redis.execute("ZSCORE", DELAY_KEY, members[1])) == int(now_ms) + 60_000
    # leased: a racing mover does not get it again
    moved, _, first, *back = await redis.evalsha(MOVE_DUE_TO_STREAM, (DELAY_KEY, S), (128, 2, 60_000))
    assert (moved, back) == (0, [])
    # without a budget the script moves any width itself
    await redis.execute("ZADD", DELAY_KEY, 0, members[1])
    moved, _, first, *back = await redis.evalsha(MOVE_DUE_TO_STREAM, (DELAY_KEY, S), (128,))
    assert (moved, first, back) == (1, None, [])
    assert (await entries(redis))[-1][1] == [b"w", b"1", b"w", b"2"]


async def test_client_moves_handed_back_members_xadd_first(
    redis: Client, run_consumer: RunConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_delay_set, "MOVE_WIDTH", 7)
    fields = [[b"n", b"%d" % i, ORIGIN_FIELD, b"0-%d" % (i + 1), RETRIES_FIELD, b"1"]
              + [b"pad", b"x"] * (i % 2) for i in range(6)]  # odd ones: 8 values, past the budget
    ms = [member(f) for f in fields]
    await redis.execute("ZADD", DELAY_KEY, *[x for i, m in enumerate(ms) for x in (i, m)])
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append(d)
        return ACK

    mon = Monitor()
    async with trio.open_nursery() as nursery:
        await nursery.start(mon.run, redis)
        stats = await run_consumer(StreamSubscription(S, G, block=0.05, delayed_retry=DZ), handle,
                                   lambda: len(seen) == 6, timeout=10)
        nursery.cancel_scope.cancel()
    assert sorted(d.origin_id for d in seen) == [f"0-{i + 1}" for i in range(6)]
    assert sorted(f for _, f in await entries(redis)) == sorted(fields)
    assert await redis.execute("EXISTS", DELAY_KEY) == 0
    assert stats["effects"]["moved_from_delay_set"] == 6
    # the wide ones: XADD by the client (not in a script), then its ZREM
    for i in (1, 3, 5):
        value = f'"n" "{i}"'
        xadd = mon.index("*", "XADD", value)
        assert mon.lines[xadd][0] != "lua"
        zrem = [j for j, (a, c, _) in enumerate(mon.lines) if c == "ZREM" and a != "lua"]
        assert any(j > xadd for j in zrem)


async def test_handed_back_member_on_a_broken_stream_stays(redis: Client) -> None:
    # the client's XADD fails too: the member stays in the set (leased), nothing is lost
    await redis.execute("SET", S, "not a stream")
    wide = member([b"w", b"1", b"w", b"2"])
    await redis.execute("ZADD", DELAY_KEY, 0, wide)
    moved, _, _, *back = await redis.evalsha(MOVE_DUE_TO_STREAM, (DELAY_KEY, S), (128, 2, 60_000))
    assert (moved, back) == (0, [wide])
    assert await redis.execute("ZRANGE", DELAY_KEY, 0, -1) == [wide]
    assert unpack_parts(wide)[1:] == [b"w", b"1", b"w", b"2"]


# -- item 10: copies are addressed to the group that wrote them --------------------------------

@pytest.mark.parametrize("way", ["retry", "durable", "runtime"])
async def test_other_groups_acknowledge_a_groups_copies(redis_url: str, redis: Client,
                                                        way: str) -> None:
    extra, first = WAYS[way]
    eid = await redis.execute("XADD", S, "*", "n", "1")
    one = StreamSubscription(S, "g1", block=0.05, **extra)
    two = StreamSubscription(S, "g2", block=0.05, **extra)
    calls: dict[str, list[Delivery]] = {"g1": [], "g2": []}

    def handler(group: str) -> Callable[[Delivery], Any]:
        async def handle(d: Delivery) -> Outcome:
            calls[group].append(d)
            return first if group == "g1" and d.attempt == 1 else ACK
        return handle

    async with open_consumer(redis_url) as consumer:
        await consumer.mount(one, handler("g1"))
        await consumer.mount(two, handler("g2"))
        await eventually(lambda: len(calls["g1"]) == 2, what="g1 handles its copy")
        copy_id = calls["g1"][1].id
        assert copy_id is not None

        async def g2_done() -> bool:
            info = await group_info(redis, S, "g2")
            # the XACK ran (pending 0) before its reply is counted: wait for both
            return bool(info["last-delivered-id"] == copy_id.encode() and info["pending"] == 0
                        and consumer.stats()[two.name]["effects"].get("foreign_copy") == 1)

        await eventually(g2_done, what="g2 read and acknowledged the copy")
        stats = consumer.stats()
    assert [d.id for d in calls["g2"]] == [eid.decode()]
    assert stats[two.name]["effects"].get("foreign_copy") == 1
    assert "foreign_copy" not in stats[one.name]["effects"]
    assert stats[two.name]["received"] == 1
    assert (await group_info(redis, S, "g1"))["pending"] == 0


async def test_copies_without_group_are_handled_by_every_group(redis_url: str,
                                                               redis: Client) -> None:
    # an older version's copy (no group header) and a foreign producer's
    await redis.execute("XADD", S, "*", "n", "1", RETRIES_FIELD, "1", ORIGIN_FIELD, "0-1")
    last = await redis.execute("XADD", S, "*", "n", "2", RETRIES_FIELD, "1", ORIGIN_FIELD, "0-2",
                               GROUP_FIELD, "g1")
    calls: dict[str, list[Delivery]] = {"g1": [], "g2": []}

    def handler(group: str) -> Callable[[Delivery], Any]:
        async def handle(d: Delivery) -> Outcome:
            calls[group].append(d)
            return ACK
        return handle

    async with open_consumer(redis_url) as consumer:
        for g in ("g1", "g2"):
            await consumer.mount(StreamSubscription(S, g, block=0.05), handler(g))
        await eventually(lambda: len(calls["g1"]) == 2 and calls["g2"], what="deliveries")

        async def acked() -> bool:
            info = await group_info(redis, S, "g2")
            return bool(info["last-delivered-id"] == last and info["pending"] == 0)

        await eventually(acked, what="g2 done")
    assert [d.origin_id for d in calls["g1"]] == ["0-1", "0-2"]
    assert [d.origin_id for d in calls["g2"]] == ["0-1"]
    assert [d.attempt for d in calls["g1"]] == [2, 2]
    assert GROUP_FIELD not in calls["g1"][1].fields


async def test_foreign_copy_with_a_corrupt_header_is_not_dead_lettered(
    redis: Client, run_consumer: RunConsumer
) -> None:
    # not ours: acknowledged as a foreign copy, whatever its other headers say
    await redis.execute("XADD", S, "*", "n", "1", RETRIES_FIELD, "bad", GROUP_FIELD, "other")
    await redis.execute("XADD", S, "*", "n", "2")
    calls: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        calls.append(d)
        return ACK

    stats = await run_consumer(
        StreamSubscription(S, G, block=0.05, max_attempts=3, dead_letter=DEAD), handle,
        lambda: calls)
    assert [d.fields for d in calls] == [{b"n": b"2"}]
    assert stats["effects"].get("foreign_copy") == 1
    assert await redis.execute("EXISTS", DEAD) == 0
    assert (await group_info(redis, S, G))["pending"] == 0


# -- item 6: the scripts' XADD at the widths around Lua's unpack limit -------------------------

@pytest.mark.parametrize("n", [2, 6998, 7000, 7002, 7200, 7398, 8000, 16002])
async def test_scripts_write_entries_of_any_width(redis: Client, n: int) -> None:
    from trio_redis_finalize._core.stream.scripts import STREAM_COPY_ACK

    fields = [b"%d" % i for i in range(n)]
    await redis.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    await redis.execute("XADD", S, "*", "f", "v")
    [[_, [(eid, _)]]] = await redis.execute("XREADGROUP", "GROUP", G, "c", "STREAMS", S, ">")
    new = await redis.evalsha(STREAM_COPY_ACK, (S, S), (G, eid, *fields))
    assert isinstance(new, bytes)
    assert (await entries(redis))[-1] == (new, fields)
    assert (await group_info(redis, S, G))["pending"] == 0
    await redis.execute("ZADD", DELAY_KEY, 0, member(fields))
    moved, _, first, *back = await redis.evalsha(MOVE_DUE_TO_STREAM, (DELAY_KEY, S), (128,))
    assert (moved, first, back) == (1, None, [])
    assert (await entries(redis))[-1][1] == fields
    assert await redis.execute("XLEN", S) == 3


async def test_client_writes_what_the_script_writes(redis: Client) -> None:
    # the client's decoding of a handed-back member (stream_fields) is the script's
    from trio_redis_finalize._envelope import MAGIC_DELAY

    uid = b"u" * 16
    cases = [
        pack_parts([uid, b"f", b"v", b"f", b"w"]),
        pack_parts([uid, b"", b""]),
        pack_parts([uid, b"f"]),  # a field without value
        pack_parts([uid]),
        pack_parts([]),
        pack_parts([uid, b"f", b"v"]) + b"trailing",
        MAGIC_DELAY + b"\xff\xff\xff\xff" + b"\x00" * 8,
        b"not a member",
        b"",
    ]
    for i, m in enumerate(cases):
        await redis.execute("ZADD", DELAY_KEY, i, m)
    moved, _, first, *back = await redis.evalsha(MOVE_DUE_TO_STREAM, (DELAY_KEY, S), (128,))
    assert (moved, first, back) == (len(cases), None, [])
    assert [f for _, f in await entries(redis)] == [stream_fields(m) for m in cases]


async def test_racing_movers_write_each_handed_back_member_once(
    redis_url: str, redis: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every member past the budget: two consumers of one group move them all
    # by hand, and the lease keeps them from writing one twice
    monkeypatch.setattr(_delay_set, "MOVE_WIDTH", 4)
    n = 1000
    origins = [f"0-{i + 1}" for i in range(n)]
    await redis.execute("ZADD", DELAY_KEY, *[
        x for o in origins
        for x in (0, member([b"n", b"1", ORIGIN_FIELD, o.encode(), RETRIES_FIELD, b"1"]))])
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> Outcome:
        seen.append(d)
        return ACK

    sub = StreamSubscription(S, G, delayed_retry=DZ, block=0.05)
    async with open_consumer(redis_url, name="a") as one, open_consumer(redis_url, name="b") as two:
        await one.mount(sub, handle)
        await two.mount(sub, handle)
        await eventually(lambda: len(seen) >= n, what=f"{n} deliveries")
        await trio.sleep(0.3)  # a second write of anything would show up by now
        moved = [c.stats()[sub.name]["effects"].get("moved_from_delay_set", 0) for c in (one, two)]
    assert sorted(d.origin_id for d in seen) == sorted(origins)
    assert await redis.execute("XLEN", S) == n
    assert await redis.execute("EXISTS", DELAY_KEY) == 0
    assert sum(moved) == n


# -- the round trip read -> plan -> script -> read, on any field list ---------------------------

class _MountStub:
    def __init__(self, sub: StreamSubscription) -> None:
        self.name = sub.name
        self.target = sub.target("c")


_NAMES = st.one_of(st.sampled_from([b"item", b"", b"trf-", RETRIES_FIELD, GROUP_FIELD]),
                   st.binary(max_size=6))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(_NAMES, st.binary(max_size=10)), min_size=1, max_size=8),
       st.sampled_from(["retry", "durable", "runtime", "dead"]))
def test_round_trip_keeps_any_field_list(redis_url: str, written: list[tuple[bytes, bytes]],
                                         way: str) -> None:
    from trio_redis_finalize._core._plan import plan
    from trio_redis_finalize._core.stream.decode import stream_deliveries

    flat = [x for kv in written for x in kv]
    own = [(n, v) for n, v in written if n not in HEADERS]
    key = f"rt-{uuid.uuid4().hex}"
    extra, outcome = WAYS[way]
    sub = StreamSubscription(key, G, **{**extra, "dead_letter": f"{{{key}}}:dead"}
                             if way == "dead" else extra)
    mount = _MountStub(sub)

    async def read(client: Client) -> tuple[Delivery, Any]:
        [[_, [(eid, got)]]] = await client.execute(
            "XREADGROUP", "GROUP", G, "c", "COUNT", 1, "STREAMS", key, ">")
        ready, direct = stream_deliveries(mount.target, [(eid, got)])
        return (ready[0], None) if ready else direct[0]

    async def body() -> None:
        async with open_client(redis_url) as client:
            await client.execute("XGROUP", "CREATE", key, G, "0", "MKSTREAM")
            await client.execute("XADD", key, "*", *flat)
            d, direct = await read(client)
            if direct is not None:  # a corrupt or foreign header drawn: not handled
                assert d.field_list == tuple(own)
                return
            assert d.field_list == tuple(own)
            p = plan(mount.target, d, outcome)  # type: ignore[arg-type]
            await client.pipeline(p.commands)
            if p.later:
                await client.pipeline(p.later)
            if way == "durable":
                await client.evalsha(MOVE_DUE_TO_STREAM, (mount.target.delay_key, key), (128,))
            if way == "dead":
                [(_, copy)] = await client.execute("XRANGE", f"{{{key}}}:dead", "-", "+")
                assert list(copy[: 2 * len(own)]) == [x for kv in own for x in kv]
                return
            (_, copy) = (await client.execute("XRANGE", key, "-", "+"))[-1]
            assert list(copy) == [*(x for kv in own for x in kv), RETRIES_FIELD, b"%d" % d.attempt,
                                  ORIGIN_FIELD, d.origin_id.encode(), GROUP_FIELD, G.encode()]
            again, direct = await read(client)
            assert direct is None
            assert again.field_list == tuple(own)
            assert (again.origin_id, again.attempt) == (d.origin_id, d.attempt + 1)

    trio.run(body)
