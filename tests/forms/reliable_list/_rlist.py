"""What the reliable list's tests share: the queue, its names, a subscription and the counts."""

from __future__ import annotations

from typing import Any

from trio_redis_finalize import Consumer, ReliableListSubscription
from trio_redis_finalize._transport import Client

Q = "jobs"
NAME = f"reliable list {Q!r}"


def proc(consumer: str) -> str:
    """The processing list of ``consumer`` on ``Q``."""
    return f"{{{Q}}}:processing:{consumer}"


def sub(**kw: Any) -> ReliableListSubscription:
    kw.setdefault("block", 0.1)
    return ReliableListSubscription(Q, **kw)


def stats(consumer: Consumer) -> dict[str, Any]:
    return consumer.stats()[NAME]  # type: ignore[no-any-return]


def effects(consumer: Consumer) -> dict[str, int]:
    return dict(stats(consumer)["effects"])


async def lrange(client: Client, key: str) -> list[bytes]:
    items: list[bytes] = await client.execute("LRANGE", key, 0, -1)
    return items
