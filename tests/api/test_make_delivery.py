"""``trio_redis_finalize.testing.make_delivery``: a handler unit-tested without
a server sees what a consumer would hand it (checked against one, on a real
server); bad arguments name the parameter."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from _procs import Recorder

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    Delivery,
    ListSubscription,
    Outcome,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import make_delivery


async def handle(d: Delivery) -> Outcome:
    """The kind of handler an application unit-tests."""
    if d.fields.get(b"n") == b"poison":
        return DROP
    if d.attempt < 3:
        return RETRY
    return ACK


async def test_a_handler_is_unit_tested_without_a_server() -> None:
    assert await handle(make_delivery({"n": "poison"})) is DROP
    assert await handle(make_delivery({b"n": b"1"})) is RETRY
    assert await handle(make_delivery({"n": 1}, attempt=3)) is ACK


def test_an_entry_as_the_consumer_shows_it() -> None:
    d = make_delivery([("a", "1"), (b"b", 2), ("a", 3.5)], id="5-1", attempt=2)
    assert isinstance(d, Delivery)
    assert (d.source, d.id, d.data, d.attempt, d.origin_id) == ("stream", "5-1", None, 2, "5-1")
    assert d.fields == {b"a": b"3.5", b"b": b"2"}  # a repeated name: its last value
    assert d.field_list == ((b"a", b"1"), (b"b", b"2"), (b"a", b"3.5"))
    e = make_delivery()
    assert (e.id, e.fields, e.field_list, e.attempt, e.origin_id) == ("1-0", {}, (), 1, "1-0")
    assert make_delivery({"x": "y"}, source="orders", origin_id="1-0").origin_id == "1-0"


def test_an_element_or_a_message() -> None:
    d = make_delivery(data="job", source="jobs")
    assert (d.source, d.id, d.fields, d.field_list, d.data, d.attempt) == (
        "jobs", None, {}, (), b"job", 1)
    assert d.origin_id == make_delivery(data=b"job").origin_id  # a digest of the bytes
    assert make_delivery(data=b"x", origin_id="abc").origin_id == "abc"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"attempt": 0}, "attempt"), ({"attempt": True}, "attempt"), ({"attempt": 1.5}, "attempt"),
        ({"id": "x"}, "id"), ({"id": "5"}, "id"), ({"data": b"x", "id": "1-0"}, "id"),
        ({"fields": {"a": "1"}, "data": b"x"}, "fields and data"),
        ({"fields": {"trf-retries": "1"}}, "fields"), ({"fields": {"traceparent": "00-"}}, "fields"),
        ({"fields": {"a": None}}, "fields"), ({"fields": [("a",)]}, "fields"),
        ({"data": [b"x"]}, "data"), ({"source": ""}, "source"), ({"origin_id": ""}, "origin_id"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(ValueError, match=rf"^{param}"):
        make_delivery(**kwargs)


async def test_what_a_real_consumer_hands_over_is_the_same(redis_url: str, client: Client) -> None:
    """The same entry and element read by a consumer from a real server:
    every attribute a handler sees equals make_delivery's."""
    eid = (await client.execute("XADD", "orders", "*", "n", "1", "k", "v", "n", "2")).decode()
    await client.execute("LPUSH", "jobs", "job")
    keep = Recorder()
    seen = keep.seen
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(StreamSubscription("orders", "g", block=0.05), keep)
        await consumer.mount(ListSubscription("jobs", block=0.05), keep)
        with trio.fail_after(10):
            while len(seen) < 2:
                await trio.sleep(0.01)
    real = {d.source: d for d in seen}
    made = {"orders": make_delivery([("n", "1"), ("k", "v"), ("n", "2")], source="orders", id=eid),
            "jobs": make_delivery(data=b"job", source="jobs")}
    for source, d in made.items():
        r = real[source]
        for attr in ("source", "id", "fields", "field_list", "data", "attempt", "origin_id"):
            assert getattr(r, attr) == getattr(d, attr), (source, attr)
