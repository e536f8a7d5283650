"""What the reliable list's tests share: the queue, its names, a subscription, the counts,
a consumer stopped as a crash leaves it, the ``done`` hash of the handlers' writes and a
consumer B that takes over what a stalled process A read."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from trio_redis_finalize import (
    ACK,
    Consumer,
    Delivery,
    Outcome,
    ReliableListSubscription,
    open_consumer,
)
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


def text(d: Delivery) -> str:
    return (d.data or b"").decode()


async def _nothing() -> None:
    return None


def as_a_crash(monkeypatch: pytest.MonkeyPatch, consumer: Consumer) -> None:
    """``consumer``'s stop hands nothing back and leaves its name registered,
    as a crash leaves it (its mount's ``deregister`` does nothing)."""
    monkeypatch.setattr(consumer.mounts[0], "deregister", _nothing)


async def done_counts(client: Client) -> dict[str, int]:
    """The hash ``done`` the handlers' writes count in: element -> writes
    committed; each at most once."""
    done = await client.execute("HGETALL", "done")
    counts = {done[i].decode(): int(done[i + 1]) for i in range(0, len(done), 2)}
    assert set(counts.values()) <= {1}, counts  # each element's write once
    return counts


@asynccontextmanager
async def b_starts_all(url: str, names: list[str], pid: int, stopped: float) -> AsyncIterator[list[str]]:
    """Consumer B (heartbeat 1 s, concurrency 10; each handler runs 6 s, then
    ACKs with a write to ``done``) while process A (``pid``) is stopped
    (SIGSTOP, at ``stopped``): B's reaper moves A's processing list back and B
    starts every one of ``names``; A is resumed (SIGCONT) 3.5 s after its stop,
    longer than its heartbeat.  Yields what B started (text); B runs until the end."""
    started: list[str] = []

    async def slow(d: Delivery) -> Outcome:
        started.append(text(d))
        await trio.sleep(6.0)
        return ACK.with_writes(("HINCRBY", "done", text(d), 1))

    async with open_consumer(url, name="b", shutdown_grace=0.0) as consumer:
        await consumer.mount(sub(heartbeat=1.0), slow, concurrency=10)
        with trio.fail_after(15):  # a bound
            while len(set(started)) < len(names):
                await trio.sleep(0.02)
        await trio.sleep(max(0.0, 3.5 - (trio.current_time() - stopped)))
        os.kill(pid, signal.SIGCONT)
        yield started
