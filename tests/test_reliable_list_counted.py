"""The counted gate of reliable-list removals (identical elements), against a
real server: ``LIST_REMOVE``, ``LIST_COPY_REMOVE``, ``LIST_ZADD_REMOVE`` and
the give-back with ``n``, and the sans-IO helpers that set ``n``
(``_plan.list_removal`` / ``list_counted`` / ``list_copies``).

The property: k identical copies are removed by k removals carrying
n = k, k-1, ..., 1 (in the order they are sent); whichever of them is sent a
second time right after (an unknown outcome resent), exactly k copies are
made and the processing list ends empty: a resend never takes a copy another
removal still needs.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from trio_redis_finalize import ACK, DROP, RETRY, DelayedRetry, retry_after
from trio_redis_finalize._core._plan import Target, list_copies, list_counted, list_removal, plan
from trio_redis_finalize._core._reliable import GIVE_BACK
from trio_redis_finalize._core._scripts import LIST_COPY_REMOVE, LIST_REMOVE, LIST_ZADD_REMOVE
from trio_redis_finalize._delivery import Delivery
from trio_redis_finalize._reliable_list import ReliableListSubscription
from trio_redis_finalize._transport import Client

P, DEST, ZSET = "{q}:processing:c", "{q}", "{q}:delayed"


async def lrange(client: Client, key: str) -> list[bytes]:
    items: list[bytes] = await client.execute("LRANGE", key, 0, -1)
    return items


async def test_list_remove_gate_counts_copies(client: Client) -> None:
    await client.execute("RPUSH", P, b"X", b"X", b"Y")
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 3)) == 0  # only 2 copies
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 2)) == 1
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 2)) == 0  # the resend: closed
    assert await lrange(client, P) == [b"X", b"Y"]
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 1)) == 1
    assert await lrange(client, P) == [b"Y"]


async def test_list_copy_remove_with_n(client: Client) -> None:
    await client.execute("RPUSH", P, b"X", b"X")
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c", 2)) == 1
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c", 2)) is None
    assert await lrange(client, P) == [b"X"] and await lrange(client, DEST) == [b"c"]
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c")) == 1  # n absent: 1
    assert await lrange(client, P) == [] and await lrange(client, DEST) == [b"c", b"c"]


async def test_list_zadd_remove_with_n(client: Client) -> None:
    await client.execute("RPUSH", P, b"X", b"X")
    assert await client.evalsha(LIST_ZADD_REMOVE, (P, ZSET), (b"X", 1000, b"m1", 2)) is not None
    assert await client.evalsha(LIST_ZADD_REMOVE, (P, ZSET), (b"X", 1000, b"m2", 2)) is None
    assert await lrange(client, P) == [b"X"]
    assert await client.execute("ZCARD", ZSET) == 1


async def test_give_back_with_n(client: Client) -> None:
    await client.execute("RPUSH", P, b"X", b"X")
    assert await client.evalsha(GIVE_BACK, (P, DEST), (b"X", 2)) == 1
    assert await client.evalsha(GIVE_BACK, (P, DEST), (b"X", 2)) == 0
    assert await lrange(client, P) == [b"X"] and await lrange(client, DEST) == [b"X"]


async def test_removals_take_the_copy_nearest_the_tail(client: Client) -> None:
    """The reader pushes onto the head, so the oldest elements (finalized first)
    are at the tail: every removal scans from there (``LREM … -1``, the gates'
    ``LPOS … RANK -n``) and takes the copy nearest it; the counted gates count
    the same copies from either end."""
    await client.execute("RPUSH", P, b"X", b"a", b"X", b"Y")  # head ... tail
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 3)) == 0
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 2)) == 1
    assert await lrange(client, P) == [b"X", b"a", b"Y"]
    await client.execute("RPUSH", P, b"X")
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c", 3)) is None
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c", 2)) == 1
    assert await lrange(client, P) == [b"X", b"a", b"Y"]
    await client.execute("RPUSH", P, b"X")
    assert await client.evalsha(LIST_ZADD_REMOVE, (P, ZSET), (b"X", 1000, b"m", 2)) is not None
    assert await lrange(client, P) == [b"X", b"a", b"Y"]
    await client.execute("RPUSH", P, b"X")
    t = _target()
    (ack,) = plan(t, _delivery(), ACK).commands
    assert ack == ("LREM", P, -1, b"X") and t.processing == P
    assert await client.execute(*ack) == 1
    assert await lrange(client, P) == [b"X", b"a", b"Y"]


def _target(**kw: Any) -> Target:
    return ReliableListSubscription("q", **kw).target("c")


def _delivery(raw: bytes = b"X", attempt: int = 1) -> Delivery:
    return Delivery("q", None, {}, raw, attempt, "o", raw=raw, retries=attempt - 1)


@pytest.mark.parametrize(
    ("kw", "outcome"),
    [
        ({}, ACK),
        ({}, DROP),
        ({}, RETRY),
        ({"delayed_retry": DelayedRetry.DURABLE_ZSET}, retry_after(1)),
        ({"max_attempts": 1, "dead_letter": "dead"}, RETRY),
        ({"max_attempts": 1}, RETRY),
    ],
)
def test_every_removal_of_a_plan_can_be_counted(kw: dict[str, Any], outcome: Any) -> None:
    t = _target(**kw)
    d = _delivery()
    (cmd,) = plan(t, d, outcome).commands
    assert list_removal(t, cmd) == b"X" and list_copies(cmd) == 1
    counted = list_counted(cmd, 3)
    assert list_removal(t, counted) == b"X" and list_copies(counted) == 3
    assert list_counted(counted, 2) != counted and list_copies(list_counted(counted, 2)) == 2


def test_runtime_retry_after_and_other_keys_are_not_removals() -> None:
    t = _target()
    p = plan(t, _delivery(), retry_after(5))
    assert p.commands == ()
    assert list_removal(t, ("LREM", "other", -1, b"X")) is None
    assert list_removal(t, ("LPUSH", P, b"X")) is None


@pytest.mark.parametrize("k", [2, 3, 4])
async def test_resending_any_subset_of_counted_retries_copies_each_once(client: Client, k: int) -> None:
    t = _target()
    for resent in itertools.product([False, True], repeat=k):
        await client.execute("DEL", t.processing, t.source)
        await client.execute("RPUSH", t.processing, *([b"X"] * k))
        (cmd,) = plan(t, _delivery(), RETRY).commands
        for i, again in enumerate(resent):
            c = list_counted(cmd, k - i)
            await client.pipeline([c])
            if again:
                await client.pipeline([c])
        assert await lrange(client, t.processing) == [], resent
        assert int(await client.execute("LLEN", t.source)) == k, resent
