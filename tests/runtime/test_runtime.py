"""Runtime behaviour common to every form, shown on a stream subscription:
handler errors, mount() arguments, graceful shutdown and cancellation,
backpressure."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import trio
from _procs import Recorder, always, effects, eventually, stats

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    Backoff,
    Delivery,
    Outcome,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._transport import Client

S, G = "events", "rt"
NAME = f"stream {S!r} group {G!r}"


async def xadd(client: Client, **fields: str) -> str:
    args: list[str] = []
    for k, v in fields.items():
        args += [k, v]
    return str((await client.execute("XADD", S, "*", *args)).decode())


async def pending_ids(client: Client) -> set[str]:
    rows = await client.execute("XPENDING", S, G, "-", "+", 1000)
    return {r[0].decode() for r in rows}


async def stream_ids(client: Client) -> list[str]:
    return [r[0].decode() for r in await client.execute("XRANGE", S, "-", "+")]


# -- handler errors ---------------------------------------------------------------

class Boom(Exception):
    pass


@pytest.mark.parametrize(
    ("bad", "logged"),
    [
        (lambda: (_ for _ in ()).throw(Boom("handler failed")), "handler raised"),
        (lambda: "ACK", "not an Outcome"),
        (lambda: 42, "not an Outcome"),
    ],
    ids=["raises", "returns-str", "returns-int"],
)
@pytest.mark.parametrize("on_error", [RETRY, DROP, ACK], ids=["retry", "drop", "ack"])
async def test_handler_error_counts_as_on_error_and_is_logged(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture,
    bad: Callable[[], Any], logged: str, on_error: Outcome,
) -> None:
    orig = await xadd(client, n="bad")
    calls: list[Delivery] = []

    async def handler(d: Delivery) -> Outcome:
        calls.append(d)
        if d.fields[b"n"] == b"bad" and d.attempt == 1:
            result: Outcome = bad()
            return result
        return ACK

    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), handler, on_error=on_error)
        expected = {"acked": 2, "copied": 1} if on_error is RETRY else {
            "acked": 2 if on_error is ACK else 1, **({"dropped": 1} if on_error is DROP else {})}
        later = await xadd(client, n="good")  # the consumer lives on
        await eventually(lambda: effects(consumer, NAME) == expected, what=f"effects {expected}")
        assert stats(consumer, NAME)["handler_errors"] == 1
        assert stats(consumer, NAME)["outcomes"][on_error.kind.value] >= 1
    records = [r for r in caplog.records if logged in r.getMessage()]
    assert len(records) == 1
    msg = records[0].getMessage()
    assert records[0].levelno == logging.ERROR
    assert NAME in msg and orig in msg and "attempt 1" in msg
    assert records[0].exc_info is not None  # traceback (or the TypeError) attached
    ids = [d.id for d in calls]
    if on_error is RETRY:
        assert len(calls) == 3 and ids[0] == orig and later in ids
        copy = next(d for d in calls if d.id not in (orig, later))
        assert copy.attempt == 2 and copy.origin_id == orig
    else:
        assert ids == [orig, later]
        assert len(await stream_ids(client)) == 2  # no copy
    assert await pending_ids(client) == set()


async def test_handler_timing_out_in_its_own_scope_counts_as_an_error(
    redis_url: str, client: Client
) -> None:
    """A handler's own cancel scope does not disturb the runtime: its error
    counts like any other, on every attempt."""
    await xadd(client, n="1")

    async def handler(d: Delivery) -> Outcome:
        with trio.move_on_after(0.01):
            await trio.sleep(10)
        raise Boom("timed out")

    async with open_consumer(redis_url, name="c1") as consumer:
        # no window (the default spreads the two attempts over 30 s)
        await consumer.mount(StreamSubscription(S, G, block=0.05, max_attempts=2, dead_letter=None),
                             handler,
                             on_error=Backoff(base=0.01, cap=0.01, window=0))
        await eventually(lambda: effects(consumer, NAME).get("exhausted") == 1, what="two failed attempts")
        assert stats(consumer, NAME)["handler_errors"] == 2


# -- mount() arguments -------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency": -3}, "concurrency"),
        ({"concurrency": 1.5}, "concurrency"),
        ({"concurrency": True}, "concurrency"),
        ({"concurrency": "2"}, "concurrency"),
        ({"on_error": "RETRY"}, "on_error"),
        ({"on_error": None}, "on_error"),
        ({"on_error": retry_after}, "on_error"),
    ],
)
async def test_mount_bad_arguments_name_the_parameter(
    redis_url: str, client: Client, kwargs: dict[str, Any], param: str
) -> None:
    async with open_consumer(redis_url, name="c1") as consumer:
        with pytest.raises(ValueError, match=param):
            await consumer.mount(StreamSubscription(S, G, block=0.05), always(ACK), **kwargs)
        assert consumer.stats() == {}
        # nothing was started: no group, no stream
        assert await client.execute("EXISTS", S) == 0


async def test_open_consumer_bad_arguments(redis_url: str) -> None:
    with pytest.raises(ValueError, match="shutdown_grace"):
        async with open_consumer(redis_url, shutdown_grace=-1):
            pass
    with pytest.raises(ValueError, match="name"):
        async with open_consumer(redis_url, name=""):
            pass


# -- graceful shutdown and cancellation ----------------------------------------------------

@pytest.mark.parametrize("how", ["exit", "cancel"])
async def test_shutdown_finishes_in_flight_within_grace_and_leaves_the_rest_pending(
    redis_url: str, client: Client, how: str
) -> None:
    grace = 0.6
    fast, medium, slow = [await xadd(client, n=n) for n in ("fast", "medium", "slow")]
    sleeps = {b"fast": 0.2, b"medium": 0.4, b"slow": 30.0}  # all busy at the exit
    outcomes = {b"fast": ACK, b"medium": RETRY, b"slow": ACK}
    started: list[str] = []
    returned: list[str] = []

    async def handler(d: Delivery) -> Outcome:
        assert d.id is not None
        started.append(d.id)
        n = d.fields[b"n"]
        await trio.sleep(sleeps.get(n, 30.0))
        returned.append(d.id)
        return outcomes.get(n, ACK)

    unstarted: list[str] = []
    with trio.CancelScope() as outer:
        async with open_consumer(redis_url, name="c1", shutdown_grace=grace) as consumer:
            await consumer.mount(StreamSubscription(S, G, block=0.05), handler, concurrency=3)
            await eventually(lambda: len(started) == 3, what="three handlers running")
            # read (in one batch: one transaction) while every handler is busy:
            # these wait, read but not started
            unstarted = [i.decode() for i in await client.transaction(
                [("XADD", S, "*", "n", f"u{i}") for i in range(3)])]
            await eventually(lambda: stats(consumer, NAME)["received"] == 6, what="waiting entries read")
            t0 = trio.current_time()
            if how == "cancel":
                outer.cancel()
                await trio.sleep(5)  # cancelled here
                raise AssertionError("not cancelled")
    took = trio.current_time() - t0
    assert how == "exit" or outer.cancelled_caught
    assert grace * 0.8 <= took <= grace + 15  # far below the slow handler's 30 s (a bound)
    assert sorted(started) == sorted([fast, medium, slow])  # nothing new was started
    assert sorted(returned) == sorted([fast, medium])
    # returned outcomes finalized: fast acked, medium copied then acked ...
    assert await pending_ids(client) == {slow, *unstarted}  # ... the rest stays pending
    ids = await stream_ids(client)
    assert ids[:6] == [fast, medium, slow, *unstarted] and len(ids) == 7  # one copy of medium
    copy = await client.execute("XRANGE", S, ids[6], ids[6])
    assert dict(zip(copy[0][1][::2], copy[0][1][1::2], strict=True))[b"trf-origin"] == medium.encode()


async def test_shutdown_finalizes_outcomes_returned_just_before_exit(redis_url: str, client: Client) -> None:
    ids = [await xadd(client, n=str(i)) for i in range(50)]
    h = Recorder()
    async with open_consumer(redis_url, name="c1", shutdown_grace=2.0) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05, count=10), h)
        await eventually(lambda: len(h.seen) >= 5, what="some handled")
    handled = [d.id for d in h.seen]
    # whatever was handled is acknowledged; nothing unhandled is: it is pending, or
    # was never read (the stop may come before the reader has read all 50)
    groups = await client.execute("XINFO", "GROUPS", S)
    last = dict(zip(groups[0][::2], groups[0][1::2], strict=True))[b"last-delivered-id"].decode()
    unread = {i for i in ids if tuple(map(int, i.split("-"))) > tuple(map(int, last.split("-")))}
    assert await pending_ids(client) | unread == set(ids) - set(handled)


async def test_second_consumer_finishes_what_the_first_left_pending(redis_url: str, client: Client) -> None:
    ids = [await xadd(client, n=str(i)) for i in range(4)]
    first: list[str] = []

    async def stuck(d: Delivery) -> Outcome:
        assert d.id is not None
        first.append(d.id)
        await trio.sleep(30)
        return ACK

    async with open_consumer(redis_url, name="c1", shutdown_grace=0.1) as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), stuck)
        await eventually(lambda: len(first) == 1, what="stuck")
    assert await pending_ids(client) == set(ids)
    ok = Recorder()
    second = ok.seen
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05), ok)
        await eventually(lambda: effects(consumer, NAME).get("acked") == 4, what="all acked on restart")
    assert [d.id for d in second] == ids
    assert second[0].attempt == 2  # the one that was in a handler: read twice
    assert await pending_ids(client) == set()


# -- backpressure ---------------------------------------------------------------------------

@pytest.mark.parametrize("concurrency", [1, 3])
async def test_slow_handler_slows_reading(redis_url: str, client: Client, concurrency: int) -> None:
    count, total = 5, 200
    await client.pipeline([("XADD", S, "*", "n", str(i)) for i in range(total)])
    done: list[str] = []

    async def handler(d: Delivery) -> Outcome:
        await trio.sleep(0.004)
        assert d.id is not None
        done.append(d.id)
        return ACK

    # read but unfinished: the handlers' share of one batch, the batch the
    # reader holds while they are busy (count * (concurrency + 1) at most),
    # and one batch whose finalization is on the wire
    bound = count * (concurrency + 2)
    worst = 0
    samples = 0
    async with open_consumer(redis_url, name="bp") as consumer:
        await consumer.mount(StreamSubscription(S, G, block=0.05, count=count), handler,
                             concurrency=concurrency)
        with trio.fail_after(20):
            while effects(consumer, NAME).get("acked", 0) < total:
                unfinished = int((await client.execute("XPENDING", S, G))[0])
                worst = max(worst, unfinished)
                samples += 1
                assert stats(consumer, NAME)["received"] - effects(consumer, NAME).get("acked", 0) <= bound
                await trio.sleep(0.005)
    assert samples > 10
    print(f"concurrency {concurrency}: at most {worst} read-but-unfinished (bound {bound})")
    assert 0 < worst <= bound, (worst, bound)
    assert len(done) == total and len(set(done)) == total
    assert await pending_ids(client) == set()
