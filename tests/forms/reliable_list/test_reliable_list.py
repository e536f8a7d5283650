"""Reliable lists against a real redis-server: every cell of the table, the
MONITOR-checked order and connection, crash recovery (SIGKILL of a consumer
process, restart), dead consumers' processing lists, max_attempts and the
dead letter, foreign and corrupt elements, bad input."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
import trio
from _procs import (
    Hang,
    HoldFirst,
    Monitor,
    Recorder,
    addr_of,
    eventually,
    killed_mid_handler,
    logged_consumer,
    mount_on_a_stream_key,
)
from _rlist import NAME, Q, effects, lrange, proc, stats, sub

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    DelayedRetry,
    Delivery,
    ReliableListSubscription,
    _backoffs,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._types import content_origin
from trio_redis_finalize._core.reliable_list.liveness import bumped, heartbeat_key, registry_key
from trio_redis_finalize._envelope import MAGIC, unwrap, wrap
from trio_redis_finalize._forms.reliable_list import reader as _reader
from trio_redis_finalize._transport import Client, open_client

# -- the table, cell by cell ------------------------------------------------------

async def test_ack_and_drop_empty_the_processing_list(redis_url: str, client: Client) -> None:
    await client.execute("LPUSH", Q, b"a", b"b")
    h = Recorder(lambda d: ACK if d.data == b"a" else DROP)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await eventually(lambda: effects(consumer).get("acked") == 1
                         and effects(consumer).get("dropped") == 1, what="ack + drop")
        assert await lrange(client, proc("c1")) == []
        assert await lrange(client, Q) == []
    assert h.data == [b"a", b"b"]  # FIFO: producers LPUSH, the reader takes the right end
    d = h.seen[0]
    assert (d.source, d.id, dict(d.fields), d.attempt) == (Q, None, {}, 1)
    assert d.origin_id == content_origin(b"a")


async def test_retry_puts_one_copy_back_and_it_comes_again_at_attempt_two(
    redis_url: str, client: Client
) -> None:
    await client.execute("LPUSH", Q, b"job-1")
    h = Recorder(lambda d: RETRY if d.attempt == 1 else ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="copy acked")
        assert effects(consumer).get("copied") == 1
        assert await lrange(client, proc("c1")) == []
        assert await lrange(client, Q) == []
    assert [(d.data, d.attempt) for d in h.seen] == [(b"job-1", 1), (b"job-1", 2)]
    first, second = h.seen
    assert second.origin_id == first.origin_id
    assert second.raw is not None and unwrap(second.raw) == (b"job-1", 1, first.origin_id)


async def test_retry_copy_sits_on_the_queue_once(redis_url: str, client: Client) -> None:
    """However often it is retried, one copy is in Redis: on the queue, or (read
    but not handled at shutdown) in the processing list."""
    await client.execute("LPUSH", Q, b"x")
    h = Recorder(lambda d: RETRY)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(max_attempts=None), h)  # retried without end
        await eventually(lambda: effects(consumer).get("copied", 0) >= 3, what="retries")
        await consumer.aclose()
    left = await lrange(client, Q) + await lrange(client, proc("c1"))
    assert len(left) == 1
    body, retries, _ = unwrap(left[0])
    assert body == b"x" and retries == len(h.seen)
    assert [d.attempt for d in h.seen] == list(range(1, len(h.seen) + 1))


async def test_monitor_retry_lpushes_before_lrem_from_a_pool_connection(
    redis_url: str, client: Client
) -> None:
    await client.execute("LPUSH", Q, b"mon")
    mon = Monitor()
    h = Recorder(lambda d: RETRY if d.attempt == 1 else ACK)
    async with trio.open_nursery() as nursery:
        await nursery.start(mon.run, client)
        async with open_consumer(redis_url, name="mon1") as consumer:
            await consumer.mount(sub(), h)
            await eventually(lambda: effects(consumer).get("acked") == 1, what="copy acked")
            reader = await addr_of(client, "trf:mon1:reader")
        await trio.sleep(0.1)  # let the last MONITOR lines arrive
        nursery.cancel_scope.cancel()
    p = proc("mon1")
    blmove = mon.index(reader, "BLMOVE", f'"{Q}" "{p}" "RIGHT" "LEFT"')
    evalsha = next(i for i, (a, c, rest) in enumerate(mon.lines)
                   if c == "EVALSHA" and f'"{p}" "{Q}" "mon"' in rest)
    assert mon.lines[evalsha][0] not in (reader, "lua")  # a pool connection
    lpush = mon.index("lua", "LPUSH", f'"{Q}"')
    lrem = mon.index("lua", "LREM", f'"{p}" "-1" "mon"')  # from the tail, the oldest end
    assert blmove < evalsha < lpush < lrem
    # ACK of the copy: a plain LREM from a pool connection, never from the reader
    lrems = [(a, rest) for a, c, rest in mon.lines if c == "LREM" and a != "lua"]
    assert lrems and all(a != reader and rest.lstrip().startswith(f'"{p}" "-1" ') for a, rest in lrems)
    assert not any(a == reader for a, c, _ in mon.lines if c in ("LREM", "EVALSHA", "LPUSH"))


# -- crash recovery -------------------------------------------------------------------

async def test_sigkill_mid_handler_then_restart_handles_the_element(
    redis_url: str, client: Client
) -> None:
    line = await killed_mid_handler(client, redis_url, Q, "w1", 30, b"crash-me")
    assert line == "handling 1 crash-me"
    assert await lrange(client, proc("w1")) == [b"crash-me"]  # stranded, not lost
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="w1") as consumer:
        await consumer.mount(sub(), h)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="recovered + acked")
    assert [(d.data, d.attempt) for d in h.seen] == [(b"crash-me", 2)]
    assert await lrange(client, proc("w1")) == []
    assert await lrange(client, Q) == []


async def test_restart_counts_the_crash_so_poison_reaches_the_dead_letter(
    redis_url: str, client: Client
) -> None:
    """An element that crashed its consumer twice arrives past max_attempts=3:
    dead-lettered without calling the handler."""
    origin = "orig-1"
    await client.execute("LPUSH", proc("w2"), wrap(b"poison", 2, origin))  # attempt 3 crashed
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="w2") as consumer:
        await consumer.mount(sub(max_attempts=3, dead_letter="dead"), h)
        await eventually(lambda: effects(consumer).get("dead_lettered") == 1, what="dead letter")
    assert h.seen == []
    dead = await lrange(client, "dead")
    assert len(dead) == 1 and unwrap(dead[0]) == (b"poison", 3, origin)
    assert await lrange(client, proc("w2")) == []


async def test_read_but_never_handed_over_goes_back_to_the_queue_at_shutdown(
    redis_url: str, client: Client
) -> None:
    """The handler hangs on A past shutdown_grace while the reader holds B and C
    (moved into the processing list, waiting to be handed over): shutdown puts
    B and C back onto the queue, uncounted; A, unfinished, is handed back
    at the stop, counted, read first (oldest)."""
    await client.execute("LPUSH", Q, b"A", b"B", b"C")
    hang = Hang()
    async with open_consumer(redis_url, name="c1", shutdown_grace=0.2) as consumer:
        await consumer.mount(sub(), hang)
        await hang.started.wait()
        await eventually(lambda: _len(client, Q, 0), what="B and C read")
    assert await lrange(client, proc("c1")) == []
    assert await lrange(client, Q) == [b"C", b"B", bumped(b"A")]  # A is read next
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await eventually(lambda: effects(consumer).get("acked") == 3, what="all acked")
    assert [(d.data, d.attempt) for d in h.seen] == [(b"A", 2), (b"B", 1), (b"C", 1)]


async def test_unstarted_part_of_a_batch_goes_back_to_the_queue_at_shutdown(
    redis_url: str, client: Client
) -> None:
    """A batch [X2, X3] reached the handler; shutdown comes during X2, which
    finishes within the grace: X3, never started, goes back to the queue."""
    await client.execute("LPUSH", Q, b"X1", b"X2", b"X3")
    in_x2 = trio.Event()

    async def h(d: Delivery) -> Any:
        if d.data == b"X2":
            in_x2.set()
            await trio.sleep(0.3)
        return ACK

    async with open_consumer(redis_url, name="c1", shutdown_grace=2) as consumer:
        await consumer.mount(sub(), h)
        await in_x2.wait()
        assert await lrange(client, Q) == []
    assert effects(consumer).get("nothing") == 1  # the handler task gave it back
    assert await lrange(client, Q) == [b"X3"]
    assert await lrange(client, proc("c1")) == []


async def _len(client: Client, key: str, n: int) -> bool:
    return int(await client.execute("LLEN", key)) == n


async def test_lost_read_reply_is_found_in_the_processing_list(
    redis_url: str, client: Client
) -> None:
    """An element in the processing list that the reader never delivered (as
    after a lost BLMOVE reply) is delivered after the next read error."""
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await client.execute("LPUSH", proc("c1"), b"stranded")
        await trio.sleep(0.2)
        assert h.seen == []  # not this reader's own delivery: untouched so far
        killed = await client.execute("CLIENT", "KILL", "ADDR", await addr_of(client, "trf:c1:reader"))
        assert killed in (b"OK", "OK", 1)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="stranded element acked")
        await client.execute("LPUSH", Q, b"after")
        await eventually(lambda: effects(consumer).get("acked") == 2, what="reading again")
        assert stats(consumer)["read_errors"] >= 1
    # stranded by a (simulated) lost read of this process: no handler saw it,
    # so not an attempt (DESIGN §4 "Attempts")
    assert [(d.data, d.attempt) for d in h.seen] == [(b"stranded", 1), (b"after", 1)]
    assert await lrange(client, proc("c1")) == []


async def test_dead_consumers_processing_list_is_recovered_by_another(
    redis_url: str, client: Client
) -> None:
    await killed_mid_handler(client, redis_url, Q, "dies", 0.5, b"orphan")
    assert await lrange(client, proc("dies")) == [b"orphan"]
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="lives") as consumer:
        await consumer.mount(sub(heartbeat=0.5), h)
        # (the reaper counts what it moved once its last page is read: the
        # element may be handled and acked before that)
        await eventually(lambda: effects(consumer).get("acked") == 1
                         and effects(consumer).get("recovered") == 1, timeout=10,
                         what="orphan recovered and acked")
    assert [(d.data, d.attempt) for d in h.seen] == [(b"orphan", 2)]
    assert await lrange(client, proc("dies")) == []
    assert await client.execute("HEXISTS", registry_key(Q), "dies") == 0


async def test_slow_but_alive_consumer_keeps_its_element(redis_url: str, client: Client) -> None:
    release = trio.Event()
    slow_seen: list[Delivery] = []

    async def slow(d: Delivery) -> Any:
        slow_seen.append(d)
        await release.wait()
        return ACK

    other = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="slow") as c1:
        await c1.mount(sub(heartbeat=0.6), slow)
        await client.execute("LPUSH", Q, b"long-job")
        await eventually(lambda: len(slow_seen) == 1, what="slow handler started")
        async with open_consumer(redis_url, name="other") as c2:
            await c2.mount(sub(heartbeat=0.6), other)
            await trio.sleep(1.5)  # two and a half heartbeats
            assert other.seen == []
            assert await lrange(client, proc("slow")) == [b"long-job"]
            release.set()
            await eventually(lambda: effects(c1).get("acked") == 1, what="slow ack")
    assert await lrange(client, proc("slow")) == []
    assert await lrange(client, Q) == []


async def test_an_ack_that_removed_nothing_is_counted_gate_closed(
    redis_url: str, client: Client
) -> None:
    """The element leaves the processing list while its handler runs (moved back
    to the queue, as another consumer's takeover of a list whose heartbeat
    lapsed does): the ACK's ``LREM`` answers 0 -- counted ``gate_closed``, not
    ``acked`` (counts are what Redis answered) -- and the element, back on the
    queue, is delivered again and acknowledged then."""
    h = HoldFirst()
    seen = h.seen
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await client.execute("LPUSH", Q, b"job")
        await eventually(lambda: len(seen) == 1, what="handler started")
        assert await client.execute("LMOVE", proc("c1"), Q, "RIGHT", "RIGHT") == b"job"
        h.release.set()  # moved
        await eventually(lambda: effects(consumer).get("acked") == 1, what="the second delivery acked")
        assert effects(consumer).get("gate_closed") == 1
        assert effects(consumer).get("acked") == 1
    assert [(d.data, d.attempt) for d in seen] == [(b"job", 1), (b"job", 1)]
    assert await lrange(client, proc("c1")) == [] and await lrange(client, Q) == []


async def test_a_returning_consumer_is_not_reaped(redis_url: str, client: Client) -> None:
    """The reaper's script is gated on the heartbeat key: present -> untouched."""
    await client.execute("RPUSH", proc("back"), b"e")
    await client.execute("HSET", registry_key(Q), "back", proc("back"))
    await client.execute("SET", heartbeat_key(Q, "back"), "back", "PX", 5000)
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="reaper") as consumer:
        await consumer.mount(sub(heartbeat=0.2), h)
        await trio.sleep(0.5)
    assert h.seen == []
    assert await lrange(client, proc("back")) == [b"e"]


async def test_a_clean_stop_deregisters(redis_url: str, client: Client) -> None:
    """A consumer that stops cleanly with an empty processing list deletes its
    heartbeat key and its registration (they stayed in the registry before)."""
    await client.execute("LPUSH", Q, b"job")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(heartbeat=2), Recorder(lambda d: ACK))
        await eventually(lambda: effects(consumer).get("acked") == 1, what="acked")
        assert await client.execute("HGET", registry_key(Q), "c1") == proc("c1").encode()
        assert await client.execute("EXISTS", heartbeat_key(Q, "c1")) == 1
    assert await client.execute("HEXISTS", registry_key(Q), "c1") == 0
    assert await client.execute("EXISTS", heartbeat_key(Q, "c1")) == 0


async def test_a_stop_that_leaves_an_element_hands_it_back_and_deregisters(
    redis_url: str, client: Client
) -> None:
    """A handler cut at the grace leaves its element in the processing list
    until the stop, which hands it back onto the queue (counted: the handler
    ran) and deregisters (no heartbeat to wait out)."""
    await client.execute("LPUSH", Q, b"job")
    hang = Hang()
    async with open_consumer(redis_url, name="c1", shutdown_grace=0.1) as consumer:
        await consumer.mount(sub(heartbeat=0.5), hang)
        await hang.started.wait()
    assert await lrange(client, proc("c1")) == []
    assert await lrange(client, Q) == [bumped(b"job")]
    assert await client.execute("HEXISTS", registry_key(Q), "c1") == 0
    assert await client.execute("EXISTS", heartbeat_key(Q, "c1")) == 0


# -- max_attempts and the dead letter --------------------------------------------

async def test_max_attempts_three_ends_in_exactly_one_dead_letter(
    redis_url: str, client: Client
) -> None:
    await client.execute("LPUSH", Q, b"poison")
    h = Recorder(lambda d: RETRY)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(max_attempts=3, dead_letter="dead"), h)
        await eventually(lambda: effects(consumer).get("dead_lettered") == 1, what="dead letter")
        await trio.sleep(0.3)  # nothing more comes
    assert [d.attempt for d in h.seen] == [1, 2, 3]
    dead = await lrange(client, "dead")
    assert len(dead) == 1
    assert unwrap(dead[0]) == (b"poison", 2, content_origin(b"poison"))
    assert await lrange(client, Q) == []
    assert await lrange(client, proc("c1")) == []


async def test_max_attempts_without_dead_letter_removes_with_a_warning(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    await client.execute("LPUSH", Q, b"p")
    h = Recorder(lambda d: RETRY)
    async with logged_consumer(redis_url, caplog, sub(max_attempts=2, dead_letter=None), h) as consumer:
        await eventually(lambda: effects(consumer).get("exhausted") == 1, what="exhausted")
    assert [d.attempt for d in h.seen] == [1, 2]
    assert "max_attempts=2" in caplog.text
    assert await lrange(client, Q) == [] and await lrange(client, proc("c1")) == []


# -- delayed retry ------------------------------------------------------------------

@pytest.mark.parametrize("way", [DelayedRetry.RUNTIME, DelayedRetry.DURABLE_ZSET])
async def test_retry_after_comes_back_after_the_delay(
    redis_url: str, client: Client, way: DelayedRetry
) -> None:
    await client.execute("LPUSH", Q, b"later")
    at: list[float] = []

    async def h(d: Delivery) -> Any:
        at.append(trio.current_time())
        return retry_after(0.4) if d.attempt == 1 else ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(delayed_retry=way), h)
        await eventually(lambda: effects(consumer).get("acked") == 1, what="copy acked")
        key = "held" if way is DelayedRetry.RUNTIME else "delayed"
        assert effects(consumer).get(key) == 1
    assert len(at) == 2 and at[1] - at[0] >= 0.35
    assert await lrange(client, Q) == [] and await lrange(client, proc("c1")) == []
    assert await client.execute("ZCARD", f"{{{Q}}}:delayed") == 0


async def test_runtime_retry_after_keeps_the_original_in_the_processing_list(
    redis_url: str, client: Client
) -> None:
    await client.execute("LPUSH", Q, b"wait")
    h = Recorder(lambda d: retry_after(30))
    async with open_consumer(redis_url, name="c1", shutdown_grace=0.5) as consumer:
        await consumer.mount(sub(), h)
        await eventually(lambda: effects(consumer).get("held") == 1, what="held")
        assert await lrange(client, proc("c1")) == [b"wait"]
        # a read error makes the reader re-scan: the held element is not redelivered
        await client.execute("CLIENT", "KILL", "ADDR", await addr_of(client, "trf:c1:reader"))
        await eventually(lambda: stats(consumer)["read_errors"] >= 1, what="read error")
        await trio.sleep(0.3)
        assert len(h.seen) == 1
    # shutdown publishes the held copy at once (and removes the original)
    queue = await lrange(client, Q)
    assert len(queue) == 1 and unwrap(queue[0])[:2] == (b"wait", 1)
    assert await lrange(client, proc("c1")) == []


# -- foreign producers, corrupt envelopes -----------------------------------------

async def test_foreign_elements_arrive_unchanged(redis_url: str, client: Client) -> None:
    payloads = [b"\x00\x01\xfe\xffbinary", b"", b"x" * (1 << 20), "caf\u00e9".encode()]
    for p in payloads:
        await client.execute("LPUSH", Q, p)
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await eventually(lambda: effects(consumer).get("acked") == len(payloads), what="all acked")
    assert h.data == payloads
    assert all(d.attempt == 1 for d in h.seen)
    assert [d.origin_id for d in h.seen] == [content_origin(p) for p in payloads]
    assert await lrange(client, proc("c1")) == []


async def test_corrupt_envelope_is_dead_lettered_with_the_reason(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    bad = MAGIC + b"\x00garbage"
    await client.execute("LPUSH", Q, bad, b"fine")
    h = Recorder(lambda d: ACK)
    async with logged_consumer(redis_url, caplog, sub(max_attempts=3, dead_letter="dead"), h) as consumer:
        await eventually(lambda: effects(consumer).get("dead_lettered") == 1
                         and effects(consumer).get("acked") == 1, what="dead + ack")
    assert h.data == [b"fine"]
    assert await lrange(client, "dead") == [bad]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("corrupt envelope" in r.getMessage() and "dead-lettered" in r.getMessage()
               for r in errors)
    assert await lrange(client, proc("c1")) == []


async def test_corrupt_envelope_without_dead_letter_is_dropped_with_an_error_log(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    bad = MAGIC + b"\x00\x00"
    await client.execute("LPUSH", Q, bad)
    h = Recorder(lambda d: ACK)
    async with logged_consumer(redis_url, caplog, sub(max_attempts=None), h) as consumer:  # no dead letter
        await eventually(lambda: effects(consumer).get("exhausted") == 1, what="dropped")
    assert h.seen == []
    assert any(r.levelno == logging.ERROR and "corrupt envelope" in r.getMessage()
               and "dropped" in r.getMessage() for r in caplog.records)
    assert await lrange(client, proc("c1")) == [] and await lrange(client, Q) == []


# -- many elements, several handlers --------------------------------------------------

async def test_many_elements_each_handled_once(redis_url: str, client: Client) -> None:
    n = 2000
    for i in range(0, n, 500):
        await client.execute("LPUSH", Q, *[str(j).encode() for j in range(i, i + 500)])
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h, concurrency=4)
        await eventually(lambda: effects(consumer).get("acked") == n, timeout=20, what="all acked")
    assert sorted(int(x or b"") for x in h.data) == list(range(n))
    assert await lrange(client, proc("c1")) == [] and await lrange(client, Q) == []


# -- bad input ------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"queue": ""}, "queue"),
        ({"queue": Q, "processing": ""}, "processing"),
        ({"queue": Q, "block": 0}, "block"),
        ({"queue": Q, "heartbeat": -1}, "heartbeat"),
        ({"queue": Q, "max_attempts": None, "dead_letter": "d"}, "dead_letter"),
        ({"queue": Q, "max_attempts": 0}, "max_attempts"),
    ],
)
def test_bad_config_names_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(ValueError, match=param):
        ReliableListSubscription(**kwargs)


async def test_mount_on_a_stream_key_names_key_and_type(redis_url: str, client: Client) -> None:
    message = await mount_on_a_stream_key(client, redis_url, Q, sub(),
                                          then=ReliableListSubscription("other", block=0.1))
    assert repr(Q) in message and "stream" in message


# -- the asyncio backend ------------------------------------------------------------

def test_round_trip_under_asyncio(redis_url: str) -> None:
    async def main() -> list[tuple[bytes | None, int]]:
        seen: list[Delivery] = []

        async def handler(d: Delivery) -> Any:
            seen.append(d)
            return RETRY if d.attempt == 1 else ACK

        async with open_client(redis_url) as c:
            await c.execute("LPUSH", Q, b"aio")
            async with open_consumer(redis_url, name="aio") as consumer:
                await consumer.mount(sub(heartbeat=1), handler)
                with anyio.fail_after(5):
                    while consumer.stats()[NAME]["effects"].get("acked") != 1:
                        await anyio.sleep(0.02)
            assert await c.execute("LLEN", proc("aio")) == 0
        return [(d.data, d.attempt) for d in seen]

    assert anyio.run(main, backend="asyncio") == [(b"aio", 1), (b"aio", 2)]


async def test_an_element_left_unheld_is_delivered_again_by_the_periodic_rescan(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed element left in the processing list without a timer (the
    waiting set full: ``MAX_WAITING`` 0 here) is delivered again, as its next
    attempt, by the periodic rescan (``_RESCAN_EVERY``, 0.5 s here; a minute
    by default) while traffic keeps the reader reading: not only after a read
    error or a restart, as a stream's own PEL is looked at every minute."""
    monkeypatch.setattr(_reader, "_RESCAN_EVERY", 0.5)
    monkeypatch.setattr(_backoffs, "MAX_WAITING", 0)
    calls: list[int] = []

    async def handle(d: Delivery) -> Any:
        if d.data == b"p":
            calls.append(d.attempt)
            if d.attempt == 1:
                raise RuntimeError("fails once")
        return ACK

    async def traffic() -> None:
        while True:
            await client.execute("LPUSH", Q, b"n")
            await trio.sleep(0.01)

    await client.execute("LPUSH", Q, b"p")
    async with open_consumer(redis_url, name="c1", shutdown_grace=1.0) as consumer, \
            trio.open_nursery() as nursery:
        await consumer.mount(sub(block=1.0), handle)
        nursery.start_soon(traffic)
        await eventually(lambda: len(calls) >= 2, timeout=20, what="attempt 2 of 'p'")
        nursery.cancel_scope.cancel()
        assert effects(consumer).get("left_pending") == 1
    assert calls == [1, 2]
