"""The publisher's output is consumed by every form, as written: fields and
payloads intact, attempt 1, one origin id per message kept across retries;
MAXLEN ~ caps the stream; bad arguments name the parameter."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from trio_redis_finalize import (
    ACK,
    RETRY,
    ChannelSubscription,
    Delivery,
    ListSubscription,
    Outcome,
    PatternSubscription,
    Publisher,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    open_publisher,
    retry_after,
)
from trio_redis_finalize._envelope import unwrap
from trio_redis_finalize._transport import Client


class Seen:
    def __init__(self, outcome: Any = ACK) -> None:
        self.got: list[Delivery] = []
        self.outcome = outcome

    async def __call__(self, d: Delivery) -> Outcome:
        self.got.append(d)
        return self.outcome(d) if callable(self.outcome) else self.outcome  # type: ignore[no-any-return]

    async def wait(self, n: int) -> None:
        with trio.fail_after(10):
            while len(self.got) < n:
                await trio.sleep(0.01)


async def test_every_form_consumes_what_the_publisher_writes(redis_url: str) -> None:
    stream, rel, lst, chan, pat = Seen(), Seen(), Seen(), Seen(), Seen()
    async with open_consumer(redis_url, name="c") as consumer, open_publisher(redis_url) as pub:
        assert isinstance(pub, Publisher)
        await consumer.mount(StreamSubscription("orders", "g", block=0.05), stream)
        await consumer.mount(ReliableListSubscription("jobs", block=0.05), rel)
        await consumer.mount(ListSubscription("tasks", block=0.05), lst)
        await consumer.mount(ChannelSubscription("news"), chan)
        await consumer.mount(PatternSubscription("events.*"), pat)
        entry_id = await pub.add("orders", {b"n": b"1", "s": "text", "i": 7})
        origins = {
            "jobs": await pub.push("jobs", b"job"),
            "tasks": await pub.push("tasks", b"task"),
        }
        assert await pub.publish("news", b"hello") == 1
        assert await pub.publish("events.sport", b"goal") == 1
        for s, n in ((stream, 1), (rel, 1), (lst, 1), (chan, 1), (pat, 1)):
            await s.wait(n)
    (d,) = stream.got
    assert (d.id, dict(d.fields), d.attempt, d.origin_id) == (
        entry_id, {b"n": b"1", b"s": b"text", b"i": b"7"}, 1, entry_id)
    for seen, key, body in ((rel, "jobs", b"job"), (lst, "tasks", b"task")):
        (d,) = seen.got
        assert (d.source, d.data, d.attempt, d.origin_id) == (key, body, 1, origins[key])
    assert [(d.source, d.data, d.attempt) for d in chan.got] == [("news", b"hello", 1)]
    assert [(d.source, d.data, d.attempt) for d in pat.got] == [("events.sport", b"goal", 1)]
    # every message its own idempotency key (a foreign element's is a digest of its bytes)
    assert len({origins["jobs"], origins["tasks"], chan.got[0].origin_id, pat.got[0].origin_id}) == 4


async def test_equal_payloads_get_distinct_origins_kept_by_retries(redis_url: str) -> None:
    rel = Seen(lambda d: RETRY if d.attempt == 1 else ACK)
    async with open_consumer(redis_url, name="c") as consumer, open_publisher(redis_url) as pub:
        await consumer.mount(ReliableListSubscription("jobs", block=0.05), rel)
        a = await pub.push("jobs", b"same")
        b = await pub.push("jobs", b"same")
        await rel.wait(4)
    assert a != b
    by_origin: dict[str, list[int]] = {}
    for d in rel.got:
        assert d.data == b"same"
        by_origin.setdefault(d.origin_id, []).append(d.attempt)
    assert by_origin == {a: [1, 2], b: [1, 2]}


async def test_stream_retry_after_copy_keeps_fields(redis_url: str) -> None:
    seen = Seen(lambda d: retry_after(0.05) if d.attempt == 1 else ACK)
    async with open_consumer(redis_url, name="c") as consumer, open_publisher(redis_url) as pub:
        await consumer.mount(StreamSubscription("orders", "g", block=0.05), seen)
        first = await pub.add("orders", {b"n": b"1"})
        await seen.wait(2)
    assert [d.attempt for d in seen.got] == [1, 2]
    assert {d.origin_id for d in seen.got} == {first}
    assert all(dict(d.fields) == {b"n": b"1"} for d in seen.got)


async def test_maxlen_caps_the_stream_approximately(redis_url: str, client: Client) -> None:
    async with open_publisher(client) as pub:  # a shared client, left open
        for i in range(500):
            await pub.add("capped", {b"n": str(i)}, maxlen=10)
        await pub.add("uncapped", {b"n": b"1"})
    length = int(await client.execute("XLEN", "capped"))
    assert 10 <= length < 500  # MAXLEN ~: whole macro nodes are trimmed
    assert await client.execute("PING") in (b"PONG", "PONG", True)


async def test_pushed_element_is_the_library_envelope(redis_url: str, client: Client) -> None:
    async with open_publisher(redis_url) as pub:
        origin = await pub.push("raw", b"payload")
    (element,) = await client.execute("LRANGE", "raw", 0, -1)
    assert unwrap(element) == (b"payload", 0, origin)


async def test_push_and_publish_take_str_like_add(redis_url: str, client: Client) -> None:
    """Before: ``push("k", "text")`` was a ValueError while ``add`` took str
    values.  A str is written UTF-8 encoded (an int or float as its repr)."""
    rel, chan = Seen(), Seen()
    async with open_consumer(redis_url, name="c") as consumer, open_publisher(redis_url) as pub:
        await consumer.mount(ReliableListSubscription("jobs", block=0.05), rel)
        await consumer.mount(ChannelSubscription("news"), chan)
        origin = await pub.push("jobs", "tâche")
        await pub.push("jobs", 42)
        await pub.push("jobs", bytearray(b"raw"))
        assert await pub.publish("news", "héllo") == 1
        await rel.wait(3)
        await chan.wait(1)
    assert [d.data for d in rel.got] == ["tâche".encode(), b"42", b"raw"]
    assert rel.got[0].origin_id == origin
    assert [d.data for d in chan.got] == ["héllo".encode()]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda p: p.add("", {b"a": b"1"}), "stream"),
        (lambda p: p.add("s", {}), "fields"),
        (lambda p: p.add("s", {b"trf-origin": b"x"}), "header field"),
        (lambda p: p.add("s", {b"a": object()}), "fields"),
        (lambda p: p.add("s", {b"a": b"1"}, maxlen=0), "maxlen"),
        (lambda p: p.push("", b"x"), "key"),
        (lambda p: p.push("k", None), "payload"),
        (lambda p: p.push("k", True), "payload"),
        (lambda p: p.publish("c", ["x"]), "payload"),
        (lambda p: p.publish("", b"x"), "channel"),
    ],
)
async def test_bad_arguments_name_the_parameter(redis_url: str, call: Any, match: str) -> None:
    async with open_publisher(redis_url) as pub:
        with pytest.raises(ValueError, match=match):
            await call(pub)


async def test_bad_url_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="scheme"):
        async with open_publisher("mysql://h/0"):
            pass
