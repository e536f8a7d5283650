"""Dead letters you can read: when each was dead-lettered, and ``inspect --entries N``.

* A stream dead letter carries ``trf-dead-time``: epoch milliseconds of the
  server's clock, written in the step that writes the dead letter -- every
  way a dead letter is written (the single gated script, its batched form,
  the retention variant, the writes script, the plain copy to another Redis
  Cluster slot).  Not the entry id's time: an id need not be the time (a
  stream whose last id is ahead of the clock, a copied entry).
* A reliable list's reason record (``{DEAD}:why``) has the server's time too
  (``time_ms``).
* ``inspect --entries N`` shows that time (ISO 8601) and lists N entries: the
  text names N of the stream's entry ids, no more.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import trio
from _procs import always

from trio_redis_finalize import (
    RETRY,
    Delivery,
    Outcome,
    ReliableListSubscription,
    Retention,
    StreamSubscription,
    _handlers,
    open_consumer,
)
from trio_redis_finalize._core import _finalize as _core_finalize
from trio_redis_finalize._core import _plan
from trio_redis_finalize._core._types import DEAD_TIME, Plan, Target
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize.pytest_plugin import sync_command
from trio_redis_finalize.testing import RedisServer

S, DEAD = "{o}orders", "{o}dead"
Q, QDEAD = "{o}jobs", "{o}jobs-dead"
CLI = [sys.executable, "-m", "trio_redis_finalize"]


@pytest.fixture
def url(redis_server: RedisServer) -> str:
    sync_command(redis_server, "FLUSHALL")
    return redis_server.url


async def _now_ms(c: Client) -> int:
    sec, usec = await c.execute("TIME")
    return int(sec) * 1000 + int(usec) // 1000


def _fields(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _cluster_split(t: Target, d: Delivery, o: Outcome) -> Plan:
    """The plan Redis Cluster gets when the dead letter is in another slot
    (here on one server): the copy, then the removal, as two commands."""
    return _plan.plan(dataclasses.replace(t, cluster=True), d, o)


def _retry_with_write(d: Delivery) -> Outcome:
    return RETRY.with_writes(("HINCRBY", "{o}totals", "n", 1))


WAYS: dict[str, tuple[dict[str, Any], int, Callable[[Delivery], Outcome]]] = {
    # name: (subscription keywords, messages at once, outcome)
    "single": ({}, 1, lambda d: RETRY),
    "batched": ({}, 3, lambda d: RETRY),
    "retention-capped": ({"retention": Retention.DELETE_ON_FINALIZE, "dead_letter_maxlen": 100},
                         1, lambda d: RETRY),
    "writes": ({}, 1, _retry_with_write),
    "cluster-split": ({}, 1, lambda d: RETRY),
}


@pytest.mark.parametrize("way", list(WAYS))
async def test_a_stream_dead_letter_carries_the_servers_time(
    url: str, way: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if way == "cluster-split":
        monkeypatch.setattr(_core_finalize, "plan", _cluster_split)
    if way == "batched":  # the n outcomes reach the finalizer together: one batched call
        monkeypatch.setattr(_handlers, "_SLOW_CALL", 60.0)
        monkeypatch.setattr(_handlers, "_FLUSH_EVERY", 60.0)
    kw, n, outcome = WAYS[way]
    sub = StreamSubscription(S, "g", block=0.05, max_attempts=1, dead_letter=DEAD, **kw)

    async def handle(d: Delivery) -> Outcome:
        return outcome(d)

    async with open_client(url) as c:
        # the dead letter's ids run ahead of the clock: an id's time is not when
        await c.execute("XADD", DEAD, "99999999999999-0", "old", "entry")
        for i in range(n):
            await c.execute("XADD", S, "*", "i", i)
        before = await _now_ms(c)
        async with open_consumer(url) as consumer:
            await consumer.mount(sub, handle, concurrency=n)
            with trio.fail_after(15):
                while await c.execute("XLEN", DEAD) < n + 1:
                    await trio.sleep(0.02)
        after = await _now_ms(c)
        rows = (await c.execute("XRANGE", DEAD, "-", "+"))[1:]
    assert len(rows) == n
    for eid, flat in rows:
        f = _fields(flat)
        assert eid.startswith(b"99999999999999-")  # its id says nothing of when
        assert before <= int(f[DEAD_TIME]) <= after, (before, f[DEAD_TIME], after)
        assert list(f)[-1] == DEAD_TIME  # one field more at the end, the entry's own kept


async def _dead_letter_all(url: str, c: Any, n: int) -> None:
    """A consumer (max_attempts=1, always RETRY) dead-letters what ``S`` holds,
    until ``DEAD`` has ``n`` entries (within 15 s)."""
    async with open_consumer(url) as consumer:
        await consumer.mount(StreamSubscription(S, "g", block=0.05, max_attempts=1,
                                                dead_letter=DEAD), always(RETRY))
        with trio.fail_after(15):
            while await c.execute("XLEN", DEAD) < n:
                await trio.sleep(0.02)


async def test_inspect_shows_the_dead_letter_time_not_the_id(url: str) -> None:
    async with open_client(url) as c:
        await c.execute("XADD", DEAD, "99999999999999-0", "old", "entry")
        await c.execute("XADD", S, "*", "n", 1)
        await _dead_letter_all(url, c, 2)
        now = await _now_ms(c)
    r = await _cli("inspect", DEAD, "--entries", "2", "--json", "--url", url)
    entries = json.loads(r)["entries"]
    old, dead = entries
    assert old["dead"] is None and old["time"].startswith("5138-")  # from its id: all there is
    assert dead["dead"]["time"] == dead["dead"]["time"].strip() and int(dead["dead"]["time"]) <= now
    year = str(datetime.datetime.now(datetime.UTC).year)
    assert dead["time"].startswith(year) and dead["time"].endswith("Z"), dead["time"]
    text = await _cli("inspect", DEAD, "--entries", "2", "--url", url)
    assert dead["time"] in text and "dead-lettered at" in text


async def test_inspect_entries_n_lists_n_entries(url: str) -> None:
    """A dead letter of 7 entries, ``--entries 5``: the text names 5 of its
    ids (before: 6 -- the header's last id too)."""
    async with open_client(url) as c:
        for i in range(7):
            await c.execute("XADD", S, "*", "n", i)
        await _dead_letter_all(url, c, 7)
        ids = {eid.decode() for eid, _ in await c.execute("XRANGE", DEAD, "-", "+")}
    text = await _cli("inspect", DEAD, "--entries", "5", "--url", url)
    shown = {i for i in re.findall(r"\b\d+-\d+\b", text) if i in ids}
    assert len(shown) == 5, text
    assert "the 5 oldest of 7" in text
    # all of them when N covers the stream: the last id is one of the entries then
    text = await _cli("inspect", DEAD, "--entries", "7", "--url", url)
    assert len({i for i in re.findall(r"\b\d+-\d+\b", text) if i in ids}) == 7


async def test_a_reliable_list_dead_letter_record_has_the_servers_time(url: str) -> None:
    async with open_client(url) as c:
        await c.execute("LPUSH", Q, "job")
        before = await _now_ms(c)
        async with open_consumer(url) as consumer:
            await consumer.mount(ReliableListSubscription(Q, block=0.05, max_attempts=1,
                                                          dead_letter=QDEAD), always(RETRY))
            with trio.fail_after(15):
                while not await c.execute("LLEN", QDEAD):
                    await trio.sleep(0.02)
        after = await _now_ms(c)
        (record,) = (await c.execute("HVALS", "{o}jobs-dead:why"))
    fields = json.loads(record.splitlines()[0])
    assert before <= fields["time_ms"] <= after
    text = await _cli("inspect", QDEAD, "--entries", "1", "--json", "--url", url)
    (entry,) = json.loads(text)["entries"]
    assert entry["time"].endswith("Z") and entry["dead"]["reason"].startswith("max_attempts=1")


async def _cli(*args: str) -> str:
    r = await trio.to_thread.run_sync(lambda: subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=60))
    assert r.returncode == 0, r.stderr
    return r.stdout
