"""``retry_after(delay)`` in its three ways, against a real redis-server.

* runtime copies (plain streams, simple lists, channels, patterns with a
  ``retry_channel``, reliable lists): held in memory by the consumer's one
  scheduler, written when the timer fires, all written at graceful shutdown,
  bounded by ``max_held_copies``;
* the durable sorted set (``DelayedRetry.DURABLE_ZSET``): due times from the
  server's clock, moved back by every read, one atomic script per batch (no
  loss, no duplicate when a write fails mid-batch or a connection is cut),
  survives a SIGKILL of the consumer, shared safely by several consumers;
* claiming (``Mode.CLAIMING``): the PEL is the delay; it lasts ``min_idle``
  (shorter delays wait longer, longer ones are cut, logged once);
* ``max_attempts`` counts every delayed round, then the dead letter.

Timing asserts are lower bounds (a copy never comes back early) or upper
bounds of the delay plus one ``block`` plus generous slack.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import _delay_proc
import pytest
import trio
from _paths import TESTS
from _procs import eventually
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    ChannelSubscription,
    DelayedRetry,
    Delivery,
    ListSubscription,
    Mode,
    Outcome,
    PatternSubscription,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._types import content_origin
from trio_redis_finalize._core.stream.scripts import MOVE_DUE_TO_STREAM
from trio_redis_finalize._envelope import pack_parts
from trio_redis_finalize._transport import Client, Connection, open_client

PROC = TESTS / "_delay_proc.py"

# -- helpers --------------------------------------------------------------------


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Client]:
    async with open_client(redis_url) as client:
        yield client


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """caplog with the library's logger at WARNING whatever earlier tests set."""
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    return caplog


@dataclass
class Call:
    delivery: Delivery
    at: float  # trio clock when the handler was called


class Recorder:
    """A handler that records its calls and returns ``decide(delivery)``."""

    def __init__(self, decide: Callable[[Delivery], Outcome]) -> None:
        self.decide = decide
        self.calls: list[Call] = []

    async def __call__(self, d: Delivery) -> Outcome:
        self.calls.append(Call(d, trio.current_time()))
        return self.decide(d)

    def attempts(self, n: int) -> list[Call]:
        return [c for c in self.calls if c.delivery.attempt == n]


def once_then_ack(delay: float) -> Callable[[Delivery], Outcome]:
    return lambda d: retry_after(delay) if d.attempt == 1 else ACK


async def add_entries(redis: Client, n: int) -> list[str]:
    """Entries n=0 .. n-1 in stream ``s``: their ids."""
    return [(await redis.execute("XADD", "s", "*", "n", str(i))).decode() for i in range(n)]


async def equals(awaitable: Awaitable[Any], value: Any) -> bool:
    return bool(await awaitable == value)


async def pending(redis: Client | Connection, stream: str, group: str) -> int:
    return int((await redis.execute("XPENDING", stream, group))[0])


async def server_ms(redis: Client) -> int:
    sec, usec = await redis.execute("TIME")
    return int(sec) * 1000 + int(usec) // 1000


def header(fields: list[bytes], name: bytes) -> bytes | None:
    d = dict(zip(fields[::2], fields[1::2], strict=True))
    return d.get(name)


async def stream_entries(redis: Client, stream: str) -> list[tuple[str, list[bytes]]]:
    return [(eid.decode(), list(f)) for eid, f in await redis.execute("XRANGE", stream, "-", "+")]


def due_member(origin: str, value: bytes = b"v") -> bytes:
    """A delay-set member in the planner's format: [unique id, field, value, ...]."""
    return pack_parts([uuid.uuid4().bytes, b"k", value, RETRIES_FIELD, b"1", ORIGIN_FIELD, origin.encode()])


def warnings_with(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# -- runtime: streams -----------------------------------------------------------------


async def test_runtime_stream_copy(redis_url: str, redis: Client) -> None:
    delay = 1.0
    first = (await redis.execute("XADD", "s", "*", "k", "v")).decode()
    rec = Recorder(once_then_ack(delay))
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: rec.calls, what="first call")
        # the original is acknowledged at once, before the copy exists
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 1, what="held copy")
        assert await pending(redis, "s", "g") == 0
        assert await redis.execute("XLEN", "s") == 1
        await eventually(lambda: rec.attempts(2), timeout=delay + 5, what="the copy")
        one, two = rec.calls[0], rec.calls[1]
        assert two.at - one.at >= delay
        assert two.delivery.attempt == 2
        assert two.delivery.origin_id == first == one.delivery.origin_id
        assert two.delivery.id != first
        assert dict(two.delivery.fields) == {b"k": b"v"}
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 0)
    entries = await stream_entries(redis, "s")
    assert len(entries) == 2
    assert header(entries[1][1], RETRIES_FIELD) == b"1"
    assert header(entries[1][1], ORIGIN_FIELD) == first.encode()
    assert await pending(redis, "s", "g") == 0
    assert len(rec.calls) == 2


async def test_shutdown_writes_every_held_copy(redis_url: str, redis: Client) -> None:
    ids = await add_entries(redis, 100)
    rec = Recorder(once_then_ack(60.0))
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 100, what="100 held")
        assert await pending(redis, "s", "g") == 0
        assert await redis.execute("XLEN", "s") == 100
        started = trio.current_time()
    # right after the block: every copy is in Redis, none waited for its delay
    assert trio.current_time() - started < 30
    entries = await stream_entries(redis, "s")
    copies = [f for _, f in entries if header(f, RETRIES_FIELD) == b"1"]
    assert len(entries) == 200
    assert Counter(header(f, ORIGIN_FIELD) for f in copies) == Counter(i.encode() for i in ids)
    assert len(rec.calls) == 100


async def test_max_held_copies_sends_at_once_when_full(
    redis_url: str, redis: Client, logs: pytest.LogCaptureFixture
) -> None:
    await add_entries(redis, 10)
    rec = Recorder(once_then_ack(60.0))
    async with open_consumer(redis_url, max_held_copies=4) as consumer:
        sub = StreamSubscription("s", "g", block=0.1)
        await consumer.mount(sub, rec)
        # 4 wait 60 s; the 6 others went out at once and came back as attempt 2
        await eventually(lambda: len(rec.attempts(2)) == 6, what="6 copies sent at once")
        # the reader may see a copy before the scheduler has settled its reply
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 4, what="4 held")
        assert len(consumer.scheduler) == 4
        await trio.sleep(0.3)
        assert len(rec.attempts(2)) == 6
    assert warnings_with(logs, "max_held_copies=4")
    # the 4 held copies were written at shutdown: 10 originals, 10 copies
    assert await redis.execute("XLEN", "s") == 20


async def test_runtime_copy_survives_cut_connections(redis_url: str, redis: Client) -> None:
    # the pool connections are cut again and again around the moment the
    # copy is due: the scheduler sends it again (duplicate, never loss)
    first = (await redis.execute("XADD", "s", "*", "k", "v")).decode()
    rec = Recorder(once_then_ack(0.5))
    async with await redis.connect(name="killer") as killer, open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 1, what="held copy")
        with trio.move_on_after(0.8):
            while True:
                await killer.execute("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                await trio.sleep(0.01)
        await eventually(lambda: rec.attempts(2), timeout=10, what="the copy")
        # the killer's own request may have been cut by move_on_after (a
        # cut connection is closed, never reused): check on a fresh one
        async with await redis.connect(name="checker") as checker:
            await eventually(lambda: equals(pending(checker, "s", "g"), 0), timeout=10)
            raw = await checker.execute("XRANGE", "s", "-", "+")
    copies = [f for _, f in raw if header(list(f), ORIGIN_FIELD) == first.encode()]
    assert 1 <= len(copies) <= 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10", None])
async def test_max_held_copies_is_validated(redis_url: str, bad: Any) -> None:
    with pytest.raises(ValueError, match="max_held_copies"):
        async with open_consumer(redis_url, max_held_copies=bad):
            pass


async def test_max_held_copies_zero_never_holds(redis_url: str, redis: Client) -> None:
    await redis.execute("XADD", "s", "*", "k", "v")
    rec = Recorder(once_then_ack(60.0))
    async with open_consumer(redis_url, max_held_copies=0) as consumer:
        sub = StreamSubscription("s", "g", block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: rec.attempts(2), what="copy sent at once")
        assert len(consumer.scheduler) == 0  # never in the heap
        # (counted held while being sent: the reader may see it before its reply is settled)
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 0, what="nothing held")


# -- durable sorted set ---------------------------------------------------------------


async def test_durable_copy_waits_in_the_set_then_comes_back(redis_url: str, redis: Client) -> None:
    delay = 1.0
    before = await server_ms(redis)
    first = (await redis.execute("XADD", "s", "*", "k", "v")).decode()
    rec = Recorder(once_then_ack(delay))
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.2)
        await consumer.mount(sub, rec)
        await eventually(lambda: redis.execute("ZCARD", "{s}:delayed"), what="copy in the set")
        after = await server_ms(redis)
        assert await pending(redis, "s", "g") == 0  # original acknowledged
        _member, score = await redis.execute("ZRANGE", "{s}:delayed", 0, -1, "WITHSCORES")
        # due time = server TIME (when the script ran) + delay
        assert before + 1000 * delay <= float(score) <= after + 1000 * delay
        # bounds a loaded machine keeps: never before the delay, and back
        # (the reads move due copies) long before a few blocks more
        await eventually(lambda: rec.attempts(2), timeout=delay + 30, what="the copy")
        one, two = rec.calls
        assert two.at - one.at >= delay - 0.05  # server clock vs trio clock
        assert two.at - one.at <= delay + 30
        assert two.delivery.attempt == 2
        assert two.delivery.origin_id == first
        assert dict(two.delivery.fields) == {b"k": b"v"}
        assert await redis.execute("ZCARD", "{s}:delayed") == 0
        stats = consumer.stats()[sub.name]
        assert stats["effects"]["delayed"] == 1
        assert stats["effects"]["moved_from_delay_set"] == 1
    assert await redis.execute("XLEN", "s") == 2


async def test_durable_counter_grows_every_round(redis_url: str, redis: Client) -> None:
    first = (await redis.execute("XADD", "s", "*", "k", "v")).decode()
    rec = Recorder(lambda d: retry_after(0.05) if d.attempt < 4 else ACK)
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: rec.attempts(4), what="fourth attempt")
    assert [c.delivery.attempt for c in rec.calls] == [1, 2, 3, 4]
    assert {c.delivery.origin_id for c in rec.calls} == {first}
    assert await redis.execute("EXISTS", "{s}:delayed") == 0


# WAY: (delay the killed process asks for, name of the restarted consumer)
CRASH_WAYS = {
    "runtime": (1.5, "victim"),
    "durable": (2.0, "other"),
    "claiming": (0.05, "other"),
    "reliable": (3.0, "victim"),  # its due time outlives the process: the restart waits it out
}


@pytest.mark.parametrize("way", list(CRASH_WAYS))
async def test_sigkill_during_the_delay(redis_url: str, redis: Client, way: str) -> None:
    """What a crash costs (docs/crash_costs.rst), one row per way.

    A consumer process gets the message, returns ``retry_after`` and is
    SIGKILLed during the delay; then another consumer starts.  runtime: the
    copy is lost (the original was acknowledged); durable: the copy comes back
    from the set; claiming: the entry comes back from the PEL (same id);
    reliable list (runtime): the original comes back from the processing list.
    """
    delay, restart_name = CRASH_WAYS[way]
    if way == "reliable":
        await redis.execute("LPUSH", "q", b"job")
        first = content_origin(b"job")
    else:
        first = (await redis.execute("XADD", "s", "*", "k", "v")).decode()
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(PROC), redis_url, way, "victim", str(delay)],
        stdout=subprocess.DEVNULL,
    )
    try:
        await eventually(lambda: redis.execute("LLEN", "calls"), timeout=20, what="the first call")
        if way == "runtime":
            await eventually(lambda: equals(pending(redis, "s", "g"), 0), what="original acknowledged")
        elif way == "durable":
            await eventually(lambda: redis.execute("ZCARD", "{s}:delayed"), what="copy in the set")
        proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert await redis.execute("LRANGE", "calls", 0, -1) == [f"1 {first}".encode()]
    # where the message is while nobody runs
    if way == "runtime":
        assert await redis.execute("XLEN", "s") == 1
        assert await pending(redis, "s", "g") == 0
    elif way == "durable":
        assert await redis.execute("ZCARD", "{s}:delayed") == 1
        assert await pending(redis, "s", "g") == 0
    elif way == "claiming":
        assert await pending(redis, "s", "g") == 1
    else:
        assert await redis.execute("LRANGE", "{q}:processing:victim", 0, -1) == [b"job"]
    rec = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name=restart_name) as consumer:
        await consumer.mount(_delay_proc.subscription(way), rec)
        if way == "runtime":
            await trio.sleep(delay + 1.0)  # the copy would be back by now
        else:
            await eventually(lambda: rec.calls, timeout=delay + 5, what="the message after restart")
            await trio.sleep(0.2)
    if way == "runtime":
        assert rec.calls == []  # lost: the documented cost of the runtime way
        assert await redis.execute("XLEN", "s") == 1
        return
    [call] = rec.calls
    assert call.delivery.origin_id == first
    if way == "durable":
        assert call.delivery.attempt == 2
        assert await redis.execute("ZCARD", "{s}:delayed") == 0
    elif way == "claiming":
        assert call.delivery.id == first
        assert call.delivery.attempt == 2
    else:
        assert call.delivery.data == b"job"
        assert await redis.execute("LLEN", "{q}:processing:victim") == 0
    if way != "reliable":
        assert await pending(redis, "s", "g") == 0


async def test_durable_members_unique_for_identical_messages(redis_url: str, redis: Client) -> None:
    # two entries with the same fields and headers (same chain, same retry
    # counter): their copies must not collapse into one set member
    for _ in range(2):
        await redis.execute("XADD", "s", "*", "k", "same", RETRIES_FIELD, "1", ORIGIN_FIELD, "0-1")
    rec = Recorder(lambda d: retry_after(0.3) if d.attempt == 2 else ACK)
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: len(rec.attempts(2)) == 2, what="both entries")
        # both wait in the set at once (the delay is 0.3 s, the block 0.1 s)
        await eventually(lambda: equals(redis.execute("ZCARD", "{s}:delayed"), 2), what="2 members")
        await eventually(lambda: len(rec.attempts(3)) == 2, timeout=30, what="both copies")
        await trio.sleep(0.2)
    assert [c.delivery.origin_id for c in rec.calls] == ["0-1"] * 4
    assert len(rec.calls) == 4


async def test_durable_reliable_list_copy(redis_url: str, redis: Client) -> None:
    delay = 0.5
    await redis.execute("LPUSH", "q", b"job")
    rec = Recorder(once_then_ack(delay))
    async with open_consumer(redis_url, name="c1") as consumer:
        sub = ReliableListSubscription("q", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: redis.execute("ZCARD", "{q}:delayed"), what="copy in the set")
        # the original left the processing list in the same script
        assert await redis.execute("LLEN", "{q}:processing:c1") == 0
        assert await redis.execute("LLEN", "q") == 0
        await eventually(lambda: rec.attempts(2), timeout=delay + 5, what="the copy")
        one, two = rec.calls
        assert two.at - one.at >= delay - 0.05
        assert two.delivery.data == b"job"
        assert two.delivery.origin_id == one.delivery.origin_id
        await eventually(lambda: equals(redis.execute("LLEN", "{q}:processing:c1"), 0))
    assert await redis.execute("EXISTS", "{q}:delayed") == 0
    assert len(rec.calls) == 2


async def test_two_consumers_move_each_copy_exactly_once(redis_url: str, redis: Client) -> None:
    n = 1000
    origins = [f"0-{i + 1}" for i in range(n)]
    rec = Recorder(lambda d: ACK)
    sub = StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.05)
    async with open_consumer(redis_url, name="a") as one, open_consumer(redis_url, name="b") as two:
        await one.mount(sub, rec)
        await two.mount(sub, rec)
        args: list[Any] = []
        for o in origins:
            args += [0, due_member(o)]  # score 0: long due
        assert await redis.execute("ZADD", "{s}:delayed", *args) == n
        await eventually(lambda: len(rec.calls) >= n, timeout=20, what=f"{n} deliveries")
        await eventually(lambda: equals(pending(redis, "s", "g"), 0), what="all acknowledged")
        await trio.sleep(0.3)  # a second move of anything would show up by now
        moved = [c.stats()[sub.name]["effects"].get("moved_from_delay_set", 0) for c in (one, two)]
    assert await redis.execute("XLEN", "s") == n
    assert await redis.execute("EXISTS", "{s}:delayed") == 0
    assert sum(moved) == n
    seen = Counter(c.delivery.origin_id for c in rec.calls)
    assert seen == Counter(origins)
    assert {c.delivery.attempt for c in rec.calls} == {2}


async def test_due_copy_is_moved_while_the_stream_is_idle(redis_url: str, redis: Client) -> None:
    # a copy made while the reader blocks on an idle stream comes back
    # within the delay and one block
    first = (await redis.execute("XADD", "s", "*", "k", "v")).decode()
    rec = Recorder(once_then_ack(0.3))
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.5)
        await consumer.mount(sub, rec)
        await eventually(lambda: rec.attempts(2), timeout=0.3 + 0.5 + 3.0, what="the copy")
    assert rec.calls[1].delivery.origin_id == first


async def test_block_is_shortened_to_the_next_due_time(redis_url: str, redis: Client) -> None:
    # a copy due in 1.5 s, a reader that would block 60 s: the copy is back
    # long before one block
    now = await server_ms(redis)
    await redis.execute("XGROUP", "CREATE", "s", "g", "0", "MKSTREAM")
    await redis.execute("ZADD", "{s}:delayed", now + 1500, due_member("0-7"))
    rec = Recorder(lambda d: ACK)
    async with open_consumer(redis_url) as consumer:
        start = trio.current_time()
        sub = StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=60.0)
        await consumer.mount(sub, rec)
        # a bound: long before one block of 60 s
        await eventually(lambda: rec.calls, timeout=40, what="the due copy")
        assert rec.calls[0].at - start >= 1.5 - 0.1
        assert rec.calls[0].delivery.origin_id == "0-7"


# -- faults during a move -------------------------------------------------------------


async def test_write_failing_mid_batch_loses_and_duplicates_nothing(redis: Client) -> None:
    # The stream's last id is one below the largest possible: the first XADD
    # of the batch succeeds, the second fails ("exhausted the last possible
    # ID") in the middle of the script, which Redis does not roll back.
    top = "18446744073709551615-18446744073709551614"
    await redis.execute("XADD", "s", top, "seed", "1")
    origins = [f"0-{i + 1}" for i in range(5)]
    await redis.execute("ZADD", "{s}:delayed", *[x for o in origins for x in (0, due_member(o))])
    with pytest.raises(rexc.ResponseError, match="exhausted"):
        await redis.evalsha(MOVE_DUE_TO_STREAM, ("{s}:delayed", "s"), (128,))
    in_stream = [header(f, ORIGIN_FIELD) for _, f in await stream_entries(redis, "s")][1:]
    left = await redis.execute("ZRANGE", "{s}:delayed", 0, -1)
    in_set = [header(f, ORIGIN_FIELD) for f in (_fields_of(m) for m in left)]
    assert len(in_stream) == 1  # the member written before the failure
    assert len(in_set) == 4  # every member after it still waits in the set
    assert Counter(in_stream + in_set) == Counter(o.encode() for o in origins)


def _fields_of(member: bytes) -> list[bytes]:
    from trio_redis_finalize._envelope import unpack_parts

    return unpack_parts(member)[1:]


async def test_refused_move_keeps_the_consumer_reading(
    redis_url: str, redis: Client, logs: pytest.LogCaptureFixture
) -> None:
    # the same failure under a running consumer: logged (naming both keys),
    # counted, nothing lost, and the consumer keeps reading its stream
    top = "18446744073709551615-18446744073709551614"
    await redis.execute("XADD", "s", top, "seed", "1")
    origins = [f"0-{i + 1}" for i in range(3)]
    await redis.execute("ZADD", "{s}:delayed", *[x for o in origins for x in (0, due_member(o))])
    rec = Recorder(lambda d: ACK)
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: len(rec.calls) == 2, what="seed and the one copy written")
        await trio.sleep(0.5)  # still alive, still reading
        assert consumer.stats()[sub.name]["read_errors"] >= 1
    assert rec.calls[0].delivery.id == top
    refused = [r for r in logs.records if r.levelno == logging.ERROR and "{s}:delayed" in r.getMessage()]
    assert refused and "exhausted" in refused[0].getMessage()
    in_stream = [header(f, ORIGIN_FIELD) for _, f in await stream_entries(redis, "s")][1:]
    left = await redis.execute("ZRANGE", "{s}:delayed", 0, -1)
    in_set = [header(_fields_of(m), ORIGIN_FIELD) for m in left]
    assert Counter(in_stream + in_set) == Counter(o.encode() for o in origins)


async def test_wrong_type_destination_keeps_every_member(redis: Client) -> None:
    await redis.execute("SET", "s", "not a stream")
    await redis.execute("ZADD", "{s}:delayed", 0, due_member("0-1"), 0, due_member("0-2"))
    with pytest.raises(rexc.ResponseError, match="WRONGTYPE"):
        await redis.evalsha(MOVE_DUE_TO_STREAM, ("{s}:delayed", "s"), (128,))
    assert await redis.execute("ZCARD", "{s}:delayed") == 2


async def test_connections_cut_while_moving_lose_and_duplicate_nothing(
    redis_url: str, redis: Client
) -> None:
    n = 2000
    origins = [f"0-{i + 1}" for i in range(n)]
    rec = Recorder(lambda d: ACK)
    sub = StreamSubscription("s", "g", delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.05)
    # the checks run on the killer's own connection (the one CLIENT KILL skips)
    async with await redis.connect(name="killer") as killer:
        async with open_consumer(redis_url) as consumer:
            await consumer.mount(sub, rec)
            args: list[Any] = []
            for o in origins:
                args += [0, due_member(o)]
            await killer.execute("ZADD", "{s}:delayed", *args)
            # cut every other connection (reader and pool) again and again
            # while the consumer moves the copies 128 at a time
            for _ in range(40):
                await killer.execute("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                await trio.sleep(0.005)
            await eventually(lambda: len({c.delivery.origin_id for c in rec.calls}) == n, timeout=30,
                           what="every copy handled")
            await eventually(lambda: equals(pending(killer, "s", "g"), 0), timeout=10,
                           what="all acknowledged")
            stats = consumer.stats()[sub.name]
        assert stats["read_errors"] >= 1  # the cuts did hit the consumer
        assert await killer.execute("EXISTS", "{s}:delayed") == 0
        raw = await killer.execute("XRANGE", "s", "-", "+")
    in_stream = Counter(header(list(f), ORIGIN_FIELD) for _, f in raw)
    assert in_stream == Counter(o.encode() for o in origins)  # each exactly once


# -- claiming -------------------------------------------------------------------------


async def test_claiming_short_delay_lasts_min_idle(redis_url: str, redis: Client) -> None:
    first = (await redis.execute("XADD", "s", "*", "k", "v")).decode()
    rec = Recorder(once_then_ack(0.05))
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", mode=Mode.CLAIMING, min_idle=0.5, block=0.05)
        await consumer.mount(sub, rec)
        await eventually(lambda: rec.calls, what="first call")
        await trio.sleep(0.1)
        assert await pending(redis, "s", "g") == 1  # waits in the PEL
        await eventually(lambda: rec.attempts(2), timeout=30, what="claimed back")
        one, two = rec.calls
        assert two.at - one.at >= 0.5 - 0.05
        assert two.delivery.id == first == one.delivery.id
        assert two.delivery.attempt == 2
        await eventually(lambda: equals(pending(redis, "s", "g"), 0))
    assert await redis.execute("XLEN", "s") == 1
    assert await redis.execute("EXISTS", "{s}:delayed") == 0


async def test_claiming_longer_delay_is_cut_and_logged_once(
    redis_url: str, redis: Client, logs: pytest.LogCaptureFixture
) -> None:
    await add_entries(redis, 3)
    rec = Recorder(once_then_ack(30.0))
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", mode=Mode.CLAIMING, min_idle=0.3, block=0.05)
        await consumer.mount(sub, rec)
        await eventually(lambda: len(rec.attempts(2)) == 3, timeout=30, what="all three claimed back")
    cut = warnings_with(logs, "cut to min_idle")
    assert len(cut) == 1
    assert sub.name in cut[0].getMessage()
    assert "retry_after(30.0)" in cut[0].getMessage()


async def test_claiming_delay_not_longer_than_min_idle_is_not_logged(
    redis_url: str, redis: Client, logs: pytest.LogCaptureFixture
) -> None:
    await redis.execute("XADD", "s", "*", "k", "v")
    rec = Recorder(once_then_ack(0.2))
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", mode=Mode.CLAIMING, min_idle=0.2, block=0.05)
        await consumer.mount(sub, rec)
        await eventually(lambda: rec.attempts(2), timeout=30, what="claimed back")
    assert not warnings_with(logs, "cut to min_idle")


async def test_claiming_with_durable_zset_sends_delays_to_the_set(
    redis_url: str, redis: Client
) -> None:
    delay = 1.0
    first = (await redis.execute("XADD", "s", "*", "k", "v")).decode()
    rec = Recorder(once_then_ack(delay))
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", mode=Mode.CLAIMING, min_idle=0.2,
                                 delayed_retry=DelayedRetry.DURABLE_ZSET, block=0.05)
        await consumer.mount(sub, rec)
        await eventually(lambda: redis.execute("ZCARD", "{s}:delayed"), what="copy in the set")
        assert await pending(redis, "s", "g") == 0
        await eventually(lambda: rec.attempts(2), timeout=delay + 5, what="the copy")
        one, two = rec.calls
        assert two.at - one.at >= delay - 0.05  # not cut to min_idle
        assert two.delivery.id != first
        assert two.delivery.origin_id == first
        assert two.delivery.attempt == 2


# -- max_attempts ---------------------------------------------------------------------

STREAM_WAYS: dict[str, dict[str, Any]] = {
    "runtime": {},
    "durable": {"delayed_retry": DelayedRetry.DURABLE_ZSET},
    "claiming": {"mode": Mode.CLAIMING, "min_idle": 0.1},
}


@pytest.mark.parametrize("way", list(STREAM_WAYS))
async def test_max_attempts_stream_then_dead_letter(redis_url: str, redis: Client, way: str) -> None:
    first = (await redis.execute("XADD", "s", "*", "k", "v")).decode()
    rec = Recorder(lambda d: retry_after(0.05))
    async with open_consumer(redis_url) as consumer:
        sub = StreamSubscription("s", "g", max_attempts=3, dead_letter="dead", block=0.05,
                                 **STREAM_WAYS[way])
        await consumer.mount(sub, rec)
        await eventually(lambda: redis.execute("XLEN", "dead"), what="dead letter")
        await trio.sleep(0.5)  # no fourth call
        assert consumer.stats()[sub.name]["held"] == 0
        assert consumer.stats()[sub.name]["effects"]["dead_lettered"] == 1
    assert [c.delivery.attempt for c in rec.calls] == [1, 2, 3]
    assert {c.delivery.origin_id for c in rec.calls} == {first}
    [(_, fields)] = await stream_entries(redis, "dead")
    assert header(fields, ORIGIN_FIELD) == first.encode()
    assert header(fields, b"k") == b"v"
    assert await redis.execute("EXISTS", "{s}:delayed") == 0
    assert await pending(redis, "s", "g") == 0


@pytest.mark.parametrize("durable", [False, True], ids=["runtime", "durable"])
async def test_max_attempts_reliable_list_then_dead_letter(
    redis_url: str, redis: Client, durable: bool
) -> None:
    await redis.execute("LPUSH", "q", b"job")
    rec = Recorder(lambda d: retry_after(0.05))
    way = DelayedRetry.DURABLE_ZSET if durable else None
    async with open_consumer(redis_url, name="c1") as consumer:
        sub = ReliableListSubscription("q", max_attempts=3, dead_letter="dead", block=0.05,
                                       delayed_retry=way)
        await consumer.mount(sub, rec)
        await eventually(lambda: redis.execute("LLEN", "dead"), what="dead letter")
        await trio.sleep(0.5)
        assert consumer.stats()[sub.name]["held"] == 0
    assert [c.delivery.attempt for c in rec.calls] == [1, 2, 3]
    assert {c.delivery.data for c in rec.calls} == {b"job"}
    assert len({c.delivery.origin_id for c in rec.calls}) == 1
    assert await redis.execute("LLEN", "dead") == 1
    assert await redis.execute("EXISTS", "{q}:delayed") == 0
    assert await redis.execute("LLEN", "q") == 0
    assert await redis.execute("LLEN", "{q}:processing:c1") == 0


# -- runtime: lists and Pub/Sub ---------------------------------------------------------


async def test_runtime_reliable_list_keeps_the_original_while_waiting(
    redis_url: str, redis: Client
) -> None:
    delay = 1.0
    await redis.execute("LPUSH", "q", b"job")
    rec = Recorder(once_then_ack(delay))
    async with open_consumer(redis_url, name="c1") as consumer:
        sub = ReliableListSubscription("q", block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 1, what="held copy")
        # the original stays in the processing list, the queue has no copy yet
        assert await redis.execute("LRANGE", "{q}:processing:c1", 0, -1) == [b"job"]
        assert await redis.execute("LLEN", "q") == 0
        await eventually(lambda: rec.attempts(2), timeout=delay + 5, what="the copy")
        one, two = rec.calls
        assert two.at - one.at >= delay
        assert two.delivery.data == b"job"
        assert two.delivery.origin_id == one.delivery.origin_id == content_origin(b"job")
        await eventually(lambda: equals(redis.execute("LLEN", "{q}:processing:c1"), 0), what="removed")
    assert len(rec.calls) == 2
    assert await redis.execute("LLEN", "q") == 0


async def test_runtime_reliable_list_shutdown_writes_held_copies(
    redis_url: str, redis: Client
) -> None:
    for i in range(20):
        await redis.execute("LPUSH", "q", f"job{i}")
    rec = Recorder(once_then_ack(60.0))
    async with open_consumer(redis_url, name="c1") as consumer:
        sub = ReliableListSubscription("q", block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 20, what="20 held")
    # copied back to the queue (attempt 2 next time), removed from processing
    assert await redis.execute("LLEN", "q") == 20
    assert await redis.execute("LLEN", "{q}:processing:c1") == 0


async def test_runtime_simple_list_copy(redis_url: str, redis: Client) -> None:
    delay = 0.8
    await redis.execute("LPUSH", "l", b"x")
    rec = Recorder(once_then_ack(delay))
    async with open_consumer(redis_url) as consumer:
        sub = ListSubscription("l", block=0.1)
        await consumer.mount(sub, rec)
        await eventually(lambda: consumer.stats()[sub.name]["held"] == 1, what="held copy")
        assert await redis.execute("LLEN", "l") == 0
        await eventually(lambda: rec.attempts(2), timeout=delay + 5, what="the copy")
        one, two = rec.calls
        assert two.at - one.at >= delay
        assert two.delivery.data == b"x"
        assert two.delivery.attempt == 2
        assert two.delivery.origin_id == one.delivery.origin_id == content_origin(b"x")
    assert await redis.execute("LLEN", "l") == 0


async def test_runtime_channel_copy(redis_url: str, redis: Client) -> None:
    delay = 0.8
    rec = Recorder(once_then_ack(delay))
    async with open_consumer(redis_url) as consumer:
        sub = ChannelSubscription("ch")
        await consumer.mount(sub, rec)
        assert await redis.execute("PUBLISH", "ch", b"hello") == 1
        await eventually(lambda: rec.calls, what="first message")
        await eventually(lambda: rec.attempts(2), timeout=delay + 5, what="the copy")
        one, two = rec.calls
        assert two.at - one.at >= delay
        assert two.delivery.source == "ch"
        assert two.delivery.data == b"hello"
        assert two.delivery.origin_id == one.delivery.origin_id
        await trio.sleep(0.2)
    assert len(rec.calls) == 2


async def test_runtime_pattern_copy_goes_to_retry_channel(redis_url: str, redis: Client) -> None:
    delay = 0.8
    rec = Recorder(once_then_ack(delay))
    async with open_consumer(redis_url) as consumer:
        sub = PatternSubscription("ev.*", retry_channel="ev.retry")
        await consumer.mount(sub, rec)
        assert await redis.execute("PUBLISH", "ev.a", b"hello") == 1
        await eventually(lambda: rec.attempts(2), timeout=delay + 5, what="the copy")
        one, two = rec.calls
        assert two.at - one.at >= delay
        assert one.delivery.source == "ev.a"
        assert two.delivery.source == "ev.retry"
        assert two.delivery.data == b"hello"
        assert two.delivery.origin_id == one.delivery.origin_id
