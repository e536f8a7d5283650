"""Simple lists (BRPOP) against a real redis-server: nothing to acknowledge
(ACK/DROP are no-ops, RETRY refused and counted), retry_after copies, foreign
and corrupt elements, shutdown giving back what was never started, bad input."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from _procs import (
    Hang,
    Recorder,
    assert_unchanged,
    corrupt_envelope_logged,
    effects,
    eventually,
    logged_consumer,
    mount_on_a_stream_key,
    stats,
)

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    AckError,
    AckUnsupported,
    Delivery,
    ListSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._types import content_origin
from trio_redis_finalize._envelope import MAGIC, unwrap
from trio_redis_finalize._transport import Client

K = "inbox"
NAME = f"list {K!r}"


async def lrange(client: Client, key: str = K) -> list[bytes]:
    items: list[bytes] = await client.execute("LRANGE", key, 0, -1)
    return items


def sub(**kw: Any) -> ListSubscription:
    kw.setdefault("block", 0.1)
    return ListSubscription(K, **kw)


async def test_ack_and_drop_are_no_ops_and_the_next_message_comes(
    redis_url: str, client: Client
) -> None:
    h = Recorder(lambda d: ACK if d.data == b"a" else DROP)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await client.execute("LPUSH", K, b"a")
        await eventually(lambda: len(h.seen) == 1, what="first")
        await client.execute("LPUSH", K, b"b")
        await eventually(lambda: len(h.seen) == 2, what="second")
        await client.execute("LPUSH", K, b"c")
        await eventually(lambda: effects(consumer, NAME).get("nothing") == 3, what="three no-ops")
        assert stats(consumer, NAME)["refused"] == 0
        assert stats(consumer, NAME)["outcomes"] == {"ack": 1, "drop": 2}
    assert h.data == [b"a", b"b", b"c"]
    d = h.seen[0]
    assert (d.source, d.id, dict(d.fields), d.attempt, d.origin_id) == (
        K, None, {}, 1, content_origin(b"a"))
    assert await lrange(client) == []


async def test_retry_is_refused_logged_and_counted_and_the_consumer_goes_on(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    h = Recorder(lambda d: RETRY if d.data == b"r" else ACK)
    with caplog.at_level(logging.ERROR, logger="trio_redis_finalize"):
        async with open_consumer(redis_url, name="c1") as consumer:
            await consumer.mount(sub(), h)
            await client.execute("LPUSH", K, b"r")
            await eventually(lambda: stats(consumer, NAME)["refused"] == 1, what="refused")
            await client.execute("LPUSH", K, b"next")
            await eventually(lambda: h.data == [b"r", b"next"], what="next delivered")
            assert effects(consumer, NAME).get("refused") == 1
    refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(refusals) == 1
    msg = refusals[0]
    assert "a list has nothing to acknowledge" in msg and "RETRY" in msg
    assert "retry_after" in msg and "ReliableListSubscription" in msg
    assert await lrange(client) == []  # no copy


async def test_finalizing_directly_raises_ack_unsupported(redis_url: str, client: Client) -> None:
    got: list[Delivery] = []
    gate = trio.Event()

    async def h(d: Delivery) -> Any:
        got.append(d)
        await gate.wait()
        return ACK

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await client.execute("LPUSH", K, b"x")
        await eventually(lambda: len(got) == 1, what="delivery")
        for outcome in (RETRY, ACK, DROP):
            with pytest.raises(AckUnsupported) as info:
                await consumer.finalize(got[0], outcome)
            assert isinstance(info.value, AckError)
            assert "list" in str(info.value)
        gate.set()
        await client.execute("LPUSH", K, b"y")
        await eventually(lambda: len(got) == 2, what="still running")


async def test_retry_after_lpushes_a_copy_after_the_delay(redis_url: str, client: Client) -> None:
    at: list[float] = []
    h = Recorder(lambda d: retry_after(0.3) if d.attempt == 1 else ACK)

    async def timed(d: Delivery) -> Any:
        at.append(trio.current_time())
        return await h(d)

    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), timed)
        await client.execute("LPUSH", K, b"later")
        await eventually(lambda: len(h.seen) == 2, what="copy delivered")
        assert effects(consumer, NAME).get("held") == 1
    first, second = h.seen
    assert (second.data, second.attempt, second.origin_id) == (b"later", 2, first.origin_id)
    assert second.raw is not None and unwrap(second.raw) == (b"later", 1, first.origin_id)
    assert at[1] - at[0] >= 0.25


async def test_retry_after_at_max_attempts_is_dropped_with_a_warning(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    h = Recorder(lambda d: retry_after(0))
    async with logged_consumer(redis_url, caplog, sub(max_attempts=2), h) as consumer:
        await client.execute("LPUSH", K, b"p")
        await eventually(lambda: effects(consumer, NAME).get("exhausted") == 1, what="exhausted")
        await trio.sleep(0.2)
    assert [d.attempt for d in h.seen] == [1, 2]
    assert "max_attempts=2" in caplog.text
    assert await lrange(client) == []


async def test_foreign_elements_arrive_unchanged(redis_url: str, client: Client) -> None:
    payloads = [b"\x00\xff\xfebinary", b"", b"y" * (1 << 20), b"plain text"]
    for p in payloads:
        await client.execute("LPUSH", K, p)
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(), h)
        await eventually(lambda: len(h.seen) == len(payloads), what="all delivered")
    assert_unchanged(h, payloads)


async def test_corrupt_envelope_is_dropped_with_an_error_log(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    await client.execute("LPUSH", K, MAGIC + b"\x01", b"ok")
    h = Recorder(lambda d: ACK)
    async with logged_consumer(redis_url, caplog, sub(), h) as consumer:
        await eventually(lambda: effects(consumer, NAME).get("exhausted") == 1 and len(h.seen) == 1,
                         what="dropped + delivered")
    assert h.data == [b"ok"]
    assert corrupt_envelope_logged(caplog.records)


async def test_an_element_popped_but_never_started_is_pushed_back_at_shutdown(
    redis_url: str, client: Client
) -> None:
    """concurrency=1, the handler busy with A: the reader has popped B and waits
    to hand it over.  Shutdown gives B back to the list (A is lost: at-most-once
    when its handler does not finish within shutdown_grace)."""
    busy = Hang()
    await client.execute("LPUSH", K, b"A", b"B")
    async with open_consumer(redis_url, name="c1", shutdown_grace=0.2) as consumer:
        await consumer.mount(sub(), busy)
        await busy.started.wait()
        await eventually(lambda: is_empty(client), what="B popped by the reader")
    assert busy.data == [b"A"]
    assert await lrange(client) == [b"B"]


async def is_empty(client: Client) -> bool:
    return await lrange(client) == []


# -- bad input ----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"key": ""}, "key"), ({"key": K, "block": -1}, "block"), ({"key": K, "max_attempts": 0},
                                                                "max_attempts")],
)
def test_bad_config_names_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(ValueError, match=param):
        ListSubscription(**kwargs)


async def test_mount_on_a_stream_key_names_key_and_type(redis_url: str, client: Client) -> None:
    message = await mount_on_a_stream_key(client, redis_url, K, sub())
    assert repr(K) in message and "stream" in message
