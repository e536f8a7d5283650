"""Pub/Sub channels and patterns against a real redis-server: nothing to
acknowledge, RETRY refused and counted, retry_after copies published,
concrete channels as source, foreign and corrupt payloads, reconnection with
the gap logged and counted, bad input."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
import pickle
from typing import Any

import anyio
import pytest
import trio
from _procs import (
    Recorder,
    assert_immutable,
    assert_unchanged,
    corrupt_envelope_logged,
    eventually,
    logged_consumer,
)
from hypothesis import given
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    AckUnsupported,
    ChannelSubscription,
    Consumer,
    Delivery,
    PatternSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._decode import list_delivery, payload_deliveries
from trio_redis_finalize._core._types import Target, content_origin
from trio_redis_finalize._delivery import record_error
from trio_redis_finalize._envelope import MAGIC, unwrap, wrap
from trio_redis_finalize._subscription import Form
from trio_redis_finalize._transport import Client, Message, open_client


def stats(consumer: Consumer, name: str) -> dict[str, Any]:
    return consumer.stats()[name]


def effects(consumer: Consumer, name: str) -> dict[str, int]:
    e: dict[str, int] = stats(consumer, name)["effects"]
    return e


async def publish(client: Client, channel: str, payload: bytes) -> int:
    return int(await client.execute("PUBLISH", channel, payload))


# -- channels -----------------------------------------------------------------------

async def test_mount_returns_subscribed_and_ack_drop_keep_it_running(
    redis_url: str, client: Client
) -> None:
    name = "channel news,alerts"
    h = Recorder(lambda d: ACK if d.data == b"1" else DROP)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(ChannelSubscription("news", "alerts"), h)
        # subscribed before mount() returned: the very first PUBLISH reaches it
        assert await publish(client, "news", b"1") == 1
        await eventually(lambda: len(h.seen) == 1, what="first")
        assert await publish(client, "alerts", b"2") == 1
        await eventually(lambda: len(h.seen) == 2, what="second")
        assert await publish(client, "news", b"3") == 1
        await eventually(lambda: effects(consumer, name).get("nothing") == 3, what="no-ops")
        assert stats(consumer, name)["refused"] == 0
    assert [(d.source, d.data) for d in h.seen] == [("news", b"1"), ("alerts", b"2"), ("news", b"3")]
    d = h.seen[0]
    assert (d.id, dict(d.fields), d.attempt, d.origin_id) == (None, {}, 1, content_origin(b"1"))


async def test_retry_is_refused_logged_and_counted_and_the_consumer_goes_on(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    name = "channel ch"
    h = Recorder(lambda d: RETRY if d.data == b"r" else ACK)
    async with logged_consumer(redis_url, caplog, ChannelSubscription("ch"), h, logging.ERROR) as consumer:
        await publish(client, "ch", b"r")
        await eventually(lambda: stats(consumer, name)["refused"] == 1, what="refused")
        await publish(client, "ch", b"next")
        await eventually(lambda: h.data == [b"r", b"next"], what="next delivered")
        assert effects(consumer, name).get("refused") == 1
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(msgs) == 1
    assert "a channel has nothing to acknowledge" in msgs[0] and "retry_after" in msgs[0]


async def test_finalizing_directly_raises_ack_unsupported(redis_url: str, client: Client) -> None:
    got: list[Delivery] = []
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(ChannelSubscription("ch"), Recorder(lambda d: ACK))
        await consumer.mount(PatternSubscription("p.*"), functools.partial(_keep, got))
        await publish(client, "p.1", b"x")
        await eventually(lambda: len(got) == 1, what="delivery")
        for outcome in (RETRY, ACK, DROP):
            with pytest.raises(AckUnsupported, match="nothing to acknowledge"):
                await consumer.finalize(got[0], outcome)
        with pytest.raises(AckUnsupported, match="retry_channel"):
            await consumer.finalize(got[0], retry_after(1))


async def _keep(into: list[Delivery], d: Delivery) -> Any:
    into.append(d)
    return ACK


async def test_retry_after_on_a_channel_publishes_a_copy(redis_url: str, client: Client) -> None:
    name = "channel ch"
    h = Recorder(lambda d: retry_after(0.2) if d.attempt == 1 else ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(ChannelSubscription("ch"), h)
        await publish(client, "ch", b"again")
        await eventually(lambda: len(h.seen) == 2, what="copy delivered")
        assert effects(consumer, name).get("held") == 1
    first, second = h.seen
    assert (second.source, second.data, second.attempt) == ("ch", b"again", 2)
    assert second.origin_id == first.origin_id
    assert second.raw is not None and unwrap(second.raw) == (b"again", 1, first.origin_id)


# -- patterns -----------------------------------------------------------------------

async def test_pattern_delivers_with_the_concrete_channel_as_source(
    redis_url: str, client: Client
) -> None:
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(PatternSubscription("orders.*"), h)
        await publish(client, "orders.eu", b"1")
        await publish(client, "other", b"no")
        await publish(client, "orders.us", b"2")
        await eventually(lambda: len(h.seen) == 2, what="two")
        await trio.sleep(0.1)
    assert [(d.source, d.data) for d in h.seen] == [("orders.eu", b"1"), ("orders.us", b"2")]


async def test_a_pattern_without_glob_characters_still_works(redis_url: str, client: Client) -> None:
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(PatternSubscription("exact"), h)
        await publish(client, "exact", b"hit")
        await publish(client, "exactly", b"miss")
        await eventually(lambda: len(h.seen) == 1, what="delivery")
        await trio.sleep(0.1)
    assert [(d.source, d.data) for d in h.seen] == [("exact", b"hit")]


async def test_pattern_retry_after_publishes_to_retry_channel(redis_url: str, client: Client) -> None:
    h = Recorder(lambda d: retry_after(0.1) if d.attempt == 1 else ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(PatternSubscription("ev.*", retry_channel="ev.retry"), h)
        await publish(client, "ev.created", b"e")
        await eventually(lambda: len(h.seen) == 2, what="copy delivered")
    assert [(d.source, d.attempt) for d in h.seen] == [("ev.created", 1), ("ev.retry", 2)]
    assert h.seen[1].data == b"e" and h.seen[1].origin_id == h.seen[0].origin_id


async def test_pattern_retry_after_without_retry_channel_is_refused(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    name = "pattern 'ev.*'"
    h = Recorder(lambda d: retry_after(0.1) if d.data == b"r" else ACK)
    async with logged_consumer(redis_url, caplog, PatternSubscription("ev.*"), h, logging.ERROR) as consumer:
        await publish(client, "ev.a", b"r")
        await eventually(lambda: stats(consumer, name)["refused"] == 1, what="refused")
        await publish(client, "ev.a", b"next")
        await eventually(lambda: len(h.seen) == 2, what="still running")
        await trio.sleep(0.3)
    assert h.data == [b"r", b"next"]  # no copy came
    assert any("retry_channel" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


# -- payloads -----------------------------------------------------------------------

async def test_foreign_payloads_arrive_unchanged(redis_url: str, client: Client) -> None:
    payloads = [b"\x00\xff\xfebinary", b"", b"z" * (1 << 20), b"text"]
    h = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(ChannelSubscription("raw"), h)
        for p in payloads:
            await publish(client, "raw", p)
        await eventually(lambda: len(h.seen) == len(payloads), what="all delivered")
    assert_unchanged(h, payloads)


async def test_corrupt_envelope_is_dropped_with_an_error_log(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    name = "channel ch"
    h = Recorder(lambda d: ACK)
    async with logged_consumer(redis_url, caplog, ChannelSubscription("ch"), h) as consumer:
        await publish(client, "ch", MAGIC + b"\xff\xff")
        await publish(client, "ch", b"ok")
        await eventually(lambda: effects(consumer, name).get("exhausted") == 1
                         and len(h.seen) == 1, what="dropped + delivered")
    assert h.data == [b"ok"]
    assert corrupt_envelope_logged(caplog.records)


# -- the reader's deliveries (sans-IO) ----------------------------------------------

def _fields(d: Delivery) -> list[object]:
    return [getattr(d, f.name, "<unset>") for f in dataclasses.fields(d)]


_TARGETS = [ChannelSubscription("ch").target("c"),
            ChannelSubscription("ch", max_attempts=2).target("c"),
            PatternSubscription("c*", retry_channel="r", max_attempts=1).target("c")]


@given(st.lists(st.tuples(st.sampled_from([b"ch", b"c\xff1"]), st.one_of(
    st.binary(max_size=40),
    st.builds(lambda b, r: wrap(b, r, "o-1"), st.binary(max_size=20), st.integers(0, 3)),
    st.builds(lambda b: MAGIC + b, st.binary(max_size=6)),  # corrupt (mostly)
)), max_size=12), st.sampled_from(_TARGETS))
def test_payload_deliveries_are_what_list_delivery_makes(
    messages: list[tuple[bytes, bytes]], target: Target
) -> None:
    """The reader's fast path for payloads without envelope builds what
    list_delivery builds (every field, the same repr and type name, origin_id
    computed when read); enveloped, corrupt and exhausted ones go through
    list_delivery: the same deliveries, the same plans, in order."""
    names: dict[bytes, str] = {}
    kind = b"pmessage" if target.form is Form.PATTERN else b"message"
    replies = [[kind, c, m] if kind == b"message" else [kind, b"c*", c, m] for c, m in messages]
    ready, direct, other = payload_deliveries(target, names, iter(replies),
                                              pattern=kind == b"pmessage")
    assert other is None
    expected = [list_delivery(target, c.decode("utf-8", "replace"), m) for c, m in messages]
    assert [_fields(d) for d in ready] == [_fields(d) for d, p in expected if p is None]
    assert [(_fields(d), p) for d, p in direct] == [(_fields(d), p) for d, p in expected
                                                     if p is not None]
    assert names == {c: c.decode("utf-8", "replace") for c, _ in messages}
    for d, (e, _) in zip(ready, [x for x in expected if x[1] is None], strict=True):
        assert isinstance(d, Delivery) and type(d).__name__ == "Delivery"
        assert repr(d) == repr(e) and d.origin_id == e.origin_id
        assert getattr(d, "error", None) is None


def test_a_payloads_origin_id_is_computed_when_read_and_kept() -> None:
    (d,), _, _ = payload_deliveries(_TARGETS[0], {}, [[b"message", b"ch", b"payload"]])
    with pytest.raises(AttributeError):
        object.__getattribute__(d, "origin_id")  # not computed yet: the slot is unset
    assert d.origin_id == content_origin(b"payload") == d.origin_id
    assert object.__getattribute__(d, "origin_id") == d.origin_id  # now an ordinary slot
    assert_immutable(d, ("origin_id", "data", "not_a_field"))
    for c in (copy.copy, copy.deepcopy, lambda d: pickle.loads(pickle.dumps(d))):
        (e,), _, _ = payload_deliveries(_TARGETS[0], {}, [[b"message", b"ch", b"p"]])
        other = c(e)  # error None (the handler did not raise), origin_id computed
        assert type(other) is Delivery and _fields(other) == _fields(e) and other.error is None
        record_error(e, ValueError("x"))
        other = c(e)
        assert type(other) is Delivery and _fields(other) == _fields(e)
        assert repr(other) == repr(e)


def test_a_payloads_shared_fields_are_set_when_read() -> None:
    """fields, retries, corrupt, error and flat: unset until read, then
    ordinary slots with the values every foreign delivery has (fields a map
    of its own); error set by record_error before any read."""
    (d,), _, _ = payload_deliveries(_TARGETS[0], {}, [[b"message", b"ch", b"p"]])
    for name in ("fields", "retries", "corrupt", "error", "flat"):
        with pytest.raises(AttributeError):
            object.__getattribute__(d, name)
    assert (d.fields, d.retries, d.corrupt, d.flat) == ({}, 0, None, None)
    assert d.fields is d.fields and d.field_list == ()
    (e,), _, _ = payload_deliveries(_TARGETS[0], {}, [[b"message", b"ch", b"p"]])
    assert e.fields is not d.fields
    record_error(e, ValueError("boom"))
    assert e.error == "ValueError: boom" and d.error is None
    for name in ("fields", "retries", "corrupt", "error", "flat"):
        object.__getattribute__(d, name)  # set now
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(d, name, "x")


async def test_received_gives_the_parsed_replies_without_io(
    redis_url: str, client: Client
) -> None:
    """PubSub.received: what is received, as the parser gives it (channel and
    data last, the concrete channel for a pattern), without reading the
    socket; kept messages first, in that shape."""
    async with client.pubsub(name="sub") as ps:
        await ps.subscribe("c")
        await ps.psubscribe("p.*")
        assert list(ps.received(10)) == []
        await client.pipeline([("PUBLISH", "c", f"m{i}") for i in range(3)]
                              + [("PUBLISH", "p.1", "pm"), ("PUBLISH", "c", "last")])
        first = await ps.get_message(timeout=5)
        assert first == Message(b"c", b"m0")
        got = [(first.channel, first.data)]
        kinds = []
        while len(got) < 5:
            more = list(ps.received(2))
            if not more:
                m = await ps.get_message(timeout=5)
                assert m is not None
                more = [[b"pmessage" if m.pattern else b"message", m.channel, m.data]]
            assert len(more) <= 2
            got += [(r[-2], r[-1]) for r in more]
            kinds += [r[0] for r in more]
        assert got == [(b"c", b"m0"), (b"c", b"m1"), (b"c", b"m2"), (b"p.1", b"pm"),
                       (b"c", b"last")]
        assert kinds == [b"message", b"message", b"pmessage", b"message"]
        # published while a confirmation is awaited: kept, handed out without I/O
        await client.execute("PUBLISH", "c", "during")
        await client.execute("PUBLISH", "p.2", "during")
        await ps.subscribe("d")
        assert list(ps.received(10)) == [[b"message", b"c", b"during"],
                                         [b"pmessage", b"p.*", b"p.2", b"during"]]
        assert list(ps.received(10)) == [] and not ps.conn.broken and ps.dropped == 0
        # a reply the caller does not take goes back: a message is kept for get_message
        ps.other([b"message", b"c", b"again"])
        assert await ps.get_message(timeout=0) == Message(b"c", b"again")
        with pytest.raises(ResponseError, match="boom"):
            ps.other(ResponseError("boom"))


def test_payload_deliveries_stop_at_a_reply_that_is_no_message_of_theirs() -> None:
    """The first reply that is not a message of the subscription's kind is
    handed back, and nothing after it is taken from the parser."""
    for target, kind in ((_TARGETS[0], b"message"), (_TARGETS[2], b"pmessage")):
        msg = [kind, b"c*", b"ch", b"p"] if kind == b"pmessage" else [kind, b"ch", b"p"]
        for odd in ([b"subscribe", b"d", 2], ResponseError("x"), b"PONG",
                    [b"pmessage" if kind == b"message" else b"message", b"ch", b"p"]):
            rest = iter([msg])
            ready, direct, other = payload_deliveries(
                target, {}, itertools.chain([msg, odd], rest), pattern=kind == b"pmessage")
            assert [d.data for d in ready] == [b"p"] and not direct and other is odd
            assert next(rest) is msg  # not taken


# -- connection loss ------------------------------------------------------------------

async def test_killed_connection_resubscribes_and_logs_the_gap(
    redis_url: str, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    name = "pattern 'g.*'"
    h = Recorder(lambda d: ACK)
    async with logged_consumer(redis_url, caplog, PatternSubscription("g.*"), h) as consumer:
        await publish(client, "g.1", b"before")
        await eventually(lambda: len(h.seen) == 1, what="before")
        assert await client.execute("CLIENT", "KILL", "TYPE", "pubsub") == 1
        await eventually(lambda: effects(consumer, name).get("gaps") == 1, what="resubscribed")

        async def delivered_after() -> bool:
            await publish(client, "g.2", b"after")
            await trio.sleep(0.05)
            return b"after" in h.data
        await eventually(delivered_after, what="after")
        assert stats(consumer, name)["read_errors"] >= 1
    assert h.data[0] == b"before" and b"after" in h.data
    assert any("messages published meanwhile are lost" in r.getMessage() for r in caplog.records)


# -- bad input ----------------------------------------------------------------------

def test_bad_config_names_the_parameter() -> None:
    with pytest.raises(ValueError, match="channels"):
        ChannelSubscription()
    with pytest.raises(ValueError, match="channels"):
        ChannelSubscription("ok", "")
    with pytest.raises(ValueError, match="pattern"):
        PatternSubscription("")
    with pytest.raises(ValueError, match="retry_channel"):
        PatternSubscription("a.*", retry_channel="")
    with pytest.raises(ValueError, match="max_attempts"):
        ChannelSubscription("a", max_attempts=0)


# -- the asyncio backend ------------------------------------------------------------

def test_round_trip_under_asyncio(redis_url: str) -> None:
    async def main() -> list[tuple[str, bytes | None, int]]:
        seen: list[Delivery] = []

        async def handler(d: Delivery) -> Any:
            seen.append(d)
            return retry_after(0.05) if d.attempt == 1 else ACK

        async with open_client(redis_url) as c, open_consumer(redis_url, name="aio") as consumer:
            await consumer.mount(PatternSubscription("a.*", retry_channel="a.retry"), handler)
            await c.execute("PUBLISH", "a.b", b"m1")
            for _ in range(3):  # several quickly: the drain path
                await c.execute("PUBLISH", "a.c", b"m2")
            with anyio.fail_after(5):
                while len(seen) < 8:  # the 4 messages and their 4 retry_after copies
                    await anyio.sleep(0.02)
        return sorted((d.source, d.data, d.attempt) for d in seen)

    assert anyio.run(main, backend="asyncio") == sorted(
        [("a.b", b"m1", 1), ("a.retry", b"m1", 2)]
        + [("a.c", b"m2", 1)] * 3 + [("a.retry", b"m2", 2)] * 3
    )
