"""Stream subscriptions against a real redis-server: every cell of the table,
headers and attempts, MONITOR-checked command order and connections,
max_attempts / dead letter, bad input, and the asyncio backend."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
import trio
from _procs import Monitor, Recorder, effects, eventually, stats
from _stream import NAME, G, S, pending, xadd

from trio_redis_finalize import (
    ACK,
    DROP,
    GROUP_FIELD,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    RETRY,
    Delivery,
    Mode,
    Outcome,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._transport import Client, open_client

DEAD_KEYS = (b"trf-dead-reason", b"trf-dead-source", b"trf-dead-id", b"trf-dead-group",
             b"trf-dead-attempt")


# -- helpers ------------------------------------------------------------------


async def xrange(client: Client, stream: str = S) -> list[tuple[str, dict[bytes, bytes]]]:
    rows = await client.execute("XRANGE", stream, "-", "+")
    return [(r[0].decode(), dict(zip(r[1][::2], r[1][1::2], strict=True))) for r in rows]


# -- the table, cell by cell ------------------------------------------------------

async def test_ack_and_drop_acknowledge_without_copies(redis_url: str, client: Client) -> None:
    a = await xadd(client, n="a")
    b = await xadd(client, n="b")
    h = Recorder(lambda d: ACK if d.fields[b"n"] == b"a" else DROP)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)

        async def done() -> bool:
            e = effects(consumer)
            return e.get("acked") == 1 and e.get("dropped") == 1
        await eventually(done, what="ack + drop finalized")
        assert stats(consumer)["outcomes"] == {"ack": 1, "drop": 1}
    assert [d.id for d in h.seen] == [a, b]
    assert await pending(client) == 0
    assert await client.execute("XLEN", S) == 2  # nothing added
    assert [eid for eid, _ in await xrange(client)] == [a, b]


async def test_an_ack_of_an_entry_another_consumer_finalized_is_counted_gate_closed(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """While its handler runs, another consumer of the group claims the entry
    and acknowledges it (a reclaim after ``min_idle``, say): this consumer's
    ``XACK`` answers 0 -- counted ``gate_closed``, not ``acked`` (counts are
    what Redis answered), and logged."""
    a = await xadd(client, n="a")
    b = await xadd(client, n="b")
    claimed = trio.Event()

    async def h(d: Delivery) -> Outcome:
        if d.id == a:
            await claimed.wait()
        return ACK

    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h, concurrency=2)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="b acknowledged")
        [[eid, _]] = await client.execute("XCLAIM", S, G, "other", 0, a)
        assert eid.decode() == a
        assert await client.execute("XACK", S, G, a) == 1
        claimed.set()
        await eventually(lambda: effects(consumer).get("gate_closed") == 1, what="a settled")
        assert effects(consumer).get("acked") == 1  # b's, not a's
        assert stats(consumer)["outcomes"] == {"ack": 2}
    assert await pending(client) == 0
    assert [eid for eid, _ in await xrange(client)] == [a, b]
    assert any("were no longer pending" in r.getMessage() for r in caplog.records)


async def test_retry_appends_one_copy_with_headers_and_acks(redis_url: str, client: Client) -> None:
    orig = await xadd(client, payload="p1", kind="k")
    h = Recorder(lambda d: RETRY if d.attempt == 1 else ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)
        await eventually(lambda: len(h.seen) == 2 and effects(consumer).get("acked") == 1,
                         what="copy handled")
        await trio.sleep(0.2)  # nothing more may come
        assert effects(consumer) == {"copied": 1, "acked": 1}
    assert len(h.seen) == 2
    first, second = h.seen
    assert (first.id, first.attempt, first.origin_id) == (orig, 1, orig)
    assert second.id != orig
    assert (second.attempt, second.origin_id) == (2, orig)
    assert dict(second.fields) == {b"payload": b"p1", b"kind": b"k"}  # no header fields
    assert second.source == S and second.data is None

    rows = await xrange(client)
    assert [eid for eid, _ in rows] == [orig, second.id]  # exactly one copy
    assert rows[1][1] == {b"payload": b"p1", b"kind": b"k",
                          RETRIES_FIELD: b"1", ORIGIN_FIELD: orig.encode(), GROUP_FIELD: G.encode()}
    assert await pending(client) == 0


async def test_copy_of_a_copy_counts_on_and_keeps_the_origin(redis_url: str, client: Client) -> None:
    orig = await xadd(client, payload="x")
    h = Recorder(lambda d: RETRY if d.attempt < 3 else ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="third attempt acked")
    assert [(d.attempt, d.origin_id) for d in h.seen] == [(1, orig), (2, orig), (3, orig)]
    rows = await xrange(client)
    assert len(rows) == 3
    assert rows[2][1][RETRIES_FIELD] == b"2" and rows[2][1][ORIGIN_FIELD] == orig.encode()
    assert await pending(client) == 0


async def test_claiming_retry_stays_in_the_pel_and_returns_after_min_idle(
    redis_url: str, client: Client
) -> None:
    orig = await xadd(client, payload="c")
    min_idle = 0.3
    h = Recorder(lambda d: RETRY if d.attempt == 1 else ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, mode=Mode.CLAIMING, min_idle=min_idle, block=0.05), h)
        await eventually(lambda: effects(consumer).get("left_pending") == 1, what="left pending")
        # while it waits: still pending, nothing added
        assert await pending(client) == 1
        assert await client.execute("XLEN", S) == 1
        await eventually(lambda: effects(consumer).get("acked") == 1, what="claimed back and acked")
    assert [(d.id, d.attempt, d.origin_id) for d in h.seen] == [(orig, 1, orig), (orig, 2, orig)]
    assert h.at[1] - h.at[0] >= min_idle * 0.8
    assert await client.execute("XLEN", S) == 1
    assert await pending(client) == 0


async def test_foreign_entries_arrive_at_attempt_one(redis_url: str, client: Client) -> None:
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)
        # a plain XADD from another client, after the group exists
        ids = [await xadd(client, a="1"), await xadd(client, b="2", c="3")]
        await eventually(lambda: len(h.seen) == 2, what="foreign entries")
    assert [(d.id, d.attempt, d.origin_id, dict(d.fields)) for d in h.seen] == [
        (ids[0], 1, ids[0], {b"a": b"1"}),
        (ids[1], 1, ids[1], {b"b": b"2", b"c": b"3"}),
    ]
    assert await pending(client) == 0


async def test_start_id_zero_consumes_entries_written_before_the_group(
    redis_url: str, client: Client
) -> None:
    before = [await xadd(client, n=str(i)) for i in range(3)]
    assert await client.execute("EXISTS", S) == 1
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)  # start_id="0" by default
        after = await xadd(client, n="3")
        await eventually(lambda: len(h.seen) == 4, what="all four entries")
    assert [d.id for d in h.seen] == [*before, after]
    assert await pending(client) == 0


async def test_mount_on_a_missing_stream_creates_it(redis_url: str, client: Client) -> None:
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)
        # mount() returned: the group exists (MKSTREAM)
        groups = await client.execute("XINFO", "GROUPS", S)
        assert [dict(zip(g[::2], g[1::2], strict=True))[b"name"] for g in groups] == [G.encode()]
        eid = await xadd(client, n="1")
        await eventually(lambda: len(h.seen) == 1, what="delivery")
    assert h.seen[0].id == eid


# -- MONITOR: which connection sends what, in which order ------------------------

async def _names_by_addr(client: Client) -> dict[str, str]:
    text = (await client.execute("CLIENT", "LIST")).decode()
    out = {}
    for line in text.splitlines():
        kv = dict(p.split("=", 1) for p in line.split(" ") if "=" in p)
        out[kv["addr"]] = kv["name"]
    return out


async def test_finalization_goes_through_the_pool_not_the_reader(redis_url: str, client: Client) -> None:
    ids = [await xadd(client, n=str(i)) for i in range(3)]
    mon = Monitor()
    h = Recorder(lambda d: RETRY if d.fields[b"n"] == b"1" and d.attempt == 1 else ACK)
    async with trio.open_nursery() as nursery:
        await nursery.start(mon.run, client)
        async with open_consumer(redis_url, name="mon1") as consumer:
            await consumer.mount(StreamSubscription(S, G, block=0.1), h)
            await eventually(lambda: effects(consumer).get("acked") == 3, what="all acked")
            names = await _names_by_addr(client)
        await trio.sleep(0.1)  # let the last MONITOR lines arrive
        nursery.cancel_scope.cancel()
    readers = mon.where("XREADGROUP")
    finalizers = mon.where("XACK") | mon.where("EVALSHA")
    finalizers.discard("lua")
    assert readers and finalizers
    assert not readers & finalizers, (readers, finalizers)
    assert {names.get(a) for a in readers} == {"trf:mon1:reader"}
    assert all(names.get(a) == "trf:mon1" for a in finalizers)
    # every id was acknowledged from a pool connection (XACK or inside the script)
    acked = " ".join(rest for a, c, rest in mon.lines if c == "XACK")
    assert all(f'"{i}"' in acked for i in ids)


async def test_monitor_retry_runs_xadd_before_xack_in_one_script(redis_url: str, client: Client) -> None:
    orig = await xadd(client, payload="m")
    mon = Monitor()
    h = Recorder(lambda d: RETRY if d.attempt == 1 else ACK)
    async with trio.open_nursery() as nursery:
        await nursery.start(mon.run, client)
        async with open_consumer(redis_url, name="mon2") as consumer:
            await consumer.mount(StreamSubscription(S, G, block=0.1), h)
            await eventually(lambda: effects(consumer).get("acked") == 1, what="copy acked")
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    copy_id = h.seen[1].id
    evalsha = next(i for i, (a, c, rest) in enumerate(mon.lines) if c == "EVALSHA" and orig in rest)
    xadd_i = mon.index("lua", "XADD", f'"{S}" "*" "payload" "m" "{RETRIES_FIELD.decode()}" "1"')
    xack_i = mon.index("lua", "XACK", f'"{S}" "{G}" "{orig}"')
    assert evalsha < xadd_i < xack_i
    # the original is acknowledged only there: no plain XACK of it from anywhere
    plain_acks = [rest for a, c, rest in mon.lines if c == "XACK" and a != "lua" and orig in rest]
    assert plain_acks == []
    # and the copy's ACK is a plain XACK
    assert any(c == "XACK" and a != "lua" and f'"{copy_id}"' in rest for a, c, rest in mon.lines)


# -- max_attempts and the dead letter --------------------------------------------

@pytest.mark.parametrize("mode", [Mode.PLAIN, Mode.CLAIMING])
async def test_max_attempts_dead_letters_after_exactly_three_calls(
    redis_url: str, client: Client, mode: Mode
) -> None:
    orig = await xadd(client, payload="poison", kind="k")
    h = Recorder(lambda d: RETRY)
    sub = StreamSubscription(S, G, mode=mode, min_idle=0.2, block=0.05, max_attempts=3,
                             dead_letter="dead")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, h)
        await eventually(lambda: effects(consumer).get("dead_lettered") == 1, what="dead letter")
        await trio.sleep(0.5)  # > min_idle: no fourth call comes
        assert stats(consumer)["outcomes"] == {"retry": 3}
    assert [d.attempt for d in h.seen] == [1, 2, 3]
    assert {d.origin_id for d in h.seen} == {orig}
    assert await pending(client) == 0
    dead = await xrange(client, "dead")
    assert len(dead) == 1
    fields = dead[0][1]
    assert fields[b"payload"] == b"poison" and fields[b"kind"] == b"k"
    assert fields[b"trf-dead-source"] == S.encode()
    assert fields[b"trf-dead-group"] == G.encode()
    assert fields[b"trf-dead-id"] == (h.seen[-1].id or "").encode()
    assert fields[b"trf-dead-attempt"] == b"3"
    assert b"max_attempts=3" in fields[b"trf-dead-reason"]
    assert fields[ORIGIN_FIELD] == orig.encode()
    if mode is Mode.CLAIMING:
        assert await client.execute("XLEN", S) == 1  # nothing was added
        assert {d.id for d in h.seen} == {orig}
    else:
        assert await client.execute("XLEN", S) == 3  # original + two copies


async def test_max_attempts_without_dead_letter_acknowledges_with_a_warning(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")  # whatever earlier tests set
    await xadd(client, payload="x")
    h = Recorder(lambda d: RETRY)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05, max_attempts=2, dead_letter=None), h)
        await eventually(lambda: effects(consumer).get("exhausted") == 1, what="exhausted")
    assert [d.attempt for d in h.seen] == [1, 2]
    assert await pending(client) == 0
    assert await client.execute("XLEN", S) == 2
    assert any("max_attempts=2" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


async def test_poison_entry_reclaimed_past_the_limit_is_dead_lettered_unhandled(
    redis_url: str, client: Client
) -> None:
    eid = await xadd(client, payload="poison")
    await client.execute("XGROUP", "CREATE", S, G, "0")
    # a consumer that read it and died, after crashing on it several times
    await client.execute("XREADGROUP", "GROUP", G, "dead-consumer", "COUNT", 1, "STREAMS", S, ">")
    await client.execute("XCLAIM", S, G, "dead-consumer", 0, eid, "IDLE", 100_000, "RETRYCOUNT", 5)
    h = Recorder(lambda d: ACK)
    sub = StreamSubscription(S, G, mode=Mode.RECLAIM, min_idle=0.2, block=0.05, max_attempts=3,
                             dead_letter="dead")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, h)
        await eventually(lambda: effects(consumer).get("dead_lettered") == 1, what="dead letter")
    assert h.seen == []
    assert await pending(client) == 0
    dead = await xrange(client, "dead")
    assert len(dead) == 1
    assert dead[0][1][b"trf-dead-id"] == eid.encode()
    assert b"past max_attempts=3" in dead[0][1][b"trf-dead-reason"]
    assert int(dead[0][1][b"trf-dead-attempt"]) > 3


# -- bad input ------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"stream": ""}, "stream"),
        ({"group": ""}, "group"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"min_idle": -1.0}, "min_idle"),
        ({"block": 0}, "block"),
        ({"block": -0.5}, "block"),
        ({"max_attempts": None, "dead_letter": "dead"}, "dead_letter"),
        ({"count": 0}, "count"),
    ],
)
def test_bad_config_names_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"stream": S, "group": G, **kwargs}
    with pytest.raises(ValueError, match=param):
        StreamSubscription(args.pop("stream"), args.pop("group"), **args)


async def test_mount_on_a_list_key_names_key_and_type(redis_url: str, client: Client) -> None:
    await client.execute("RPUSH", "a-list", "x")
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        with pytest.raises(Exception, match=r"a-list") as info:
            await consumer.mount(StreamSubscription("a-list", G, block=0.1), h)
        assert "list" in str(info.value).replace("a-list", "")
        # the consumer lives on: another mount works
        await consumer.mount(StreamSubscription(S, G, block=0.1), h)
        eid = await xadd(client, n="1")
        await eventually(lambda: len(h.seen) == 1, what="delivery after a failed mount")
    assert h.seen[0].id == eid
    assert await client.execute("LRANGE", "a-list", 0, -1) == [b"x"]


async def test_handler_returning_none_is_retried_and_the_consumer_lives(
    redis_url: str, client: Client
) -> None:
    orig = await xadd(client, n="1")
    calls: list[Delivery] = []

    async def handler(d: Delivery) -> Outcome:
        calls.append(d)
        if d.attempt == 1 and d.fields[b"n"] == b"1":
            return None  # type: ignore[return-value]
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        # the default on_error (Backoff): the same entry comes back as attempt 2
        await consumer.mount(StreamSubscription(S, G, block=0.1), handler)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="retried entry acked")
        later = await xadd(client, n="2")
        await eventually(lambda: effects(consumer).get("acked") == 2, what="consumer lives")
        assert stats(consumer)["handler_errors"] == 1
        assert effects(consumer)["backed_off"] == 1 and "copied" not in effects(consumer)
    assert [(d.attempt, d.id, d.origin_id) for d in calls] == [
        (1, orig, orig), (2, orig, orig), (1, later, later)]
    assert await pending(client) == 0
    assert await client.execute("XLEN", S) == 2  # no copy


# -- anyio's asyncio backend ---------------------------------------------------------

def test_plain_round_trip_under_asyncio(redis_url: str) -> None:
    async def main() -> list[tuple[int, str]]:
        seen: list[Delivery] = []

        async def handler(d: Delivery) -> Outcome:
            seen.append(d)
            return RETRY if d.attempt == 1 else ACK

        async with open_client(redis_url) as c:
            eid = (await c.execute("XADD", S, "*", "k", "v")).decode()
            async with open_consumer(redis_url, name="aio") as consumer:
                await consumer.mount(StreamSubscription(S, G, block=0.05), handler)
                with anyio.fail_after(5):
                    while consumer.stats()[NAME]["effects"].get("acked") != 1:
                        await anyio.sleep(0.02)
            assert (await c.execute("XPENDING", S, G))[0] == 0
            assert all(d.origin_id == eid for d in seen)
        return [(d.attempt, d.fields[b"k"].decode()) for d in seen]

    assert anyio.run(main, backend="asyncio") == [(1, "v"), (2, "v")]


async def test_corrupt_retry_header_is_dead_lettered_with_its_reason(redis_url: str, client: Client) -> None:
    bad = str((await client.execute("XADD", S, "*", "n", "1", RETRIES_FIELD, "not-a-number")).decode())
    good = await xadd(client, n="2")
    h = Recorder(lambda d: ACK)
    sub = StreamSubscription(S, G, block=0.05, max_attempts=5, dead_letter="dead")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub, h)
        await eventually(lambda: effects(consumer) == {"acked": 1, "dead_lettered": 1},
                         what="good acked, bad dead-lettered")
    assert [d.id for d in h.seen] == [good]
    dead = await xrange(client, "dead")
    assert len(dead) == 1
    assert dead[0][1][b"trf-dead-id"] == bad.encode()
    assert b"corrupt" in dead[0][1][b"trf-dead-reason"]
    assert await pending(client) == 0
