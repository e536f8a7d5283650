"""Crash recovery of stream consumers with any names (issue: a crash with the
default settings stranded work): heartbeats, the reaper of dead consumers,
stranded work warned about, and the deregistration of a clean stop.

Against a real redis-server.  A "dead" consumer is seeded by hand where the
test needs no process: entries read under its name (``XREADGROUP``), made
idle (``XCLAIM ... IDLE``), and a registration in ``{S}:consumers:<group>``
without a heartbeat key -- what a SIGKILLed consumer of the library leaves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
import trio
from _procs import Hang, effects, eventually, stats
from _stream import NAME, G, S, pending_of

from trio_redis_finalize import (
    ACK,
    Delivery,
    Mode,
    Outcome,
    StreamSubscription,
    open_consumer,
)
from trio_redis_finalize._core._replies import BusyGroupError
from trio_redis_finalize._core.stream import liveness as presence
from trio_redis_finalize._transport import Client

REGISTRY = presence.registry_key(S, G)


def heartbeat_key(consumer: str) -> str:
    return presence.heartbeat_key(S, G, consumer)


def sub(**kw: Any) -> StreamSubscription:
    kw.setdefault("block", 0.05)
    return StreamSubscription(S, G, **kw)


async def consumers(client: Client, stream: str = S, group: str = G) -> list[str]:
    rows = await client.execute("XINFO", "CONSUMERS", stream, group)
    return sorted(dict(zip(r[::2], r[1::2], strict=False))[b"name"].decode() for r in rows)


async def registered(client: Client, key: str = REGISTRY) -> list[str]:
    return sorted(k.decode() for k in await client.execute("HKEYS", key))


async def seed(client: Client, owner: str, n: int, *, register: bool = True, count: int = 1,
               idle_ms: int = 600_000, heartbeat_ms: int = 200, mode: str = "plain") -> list[str]:
    """``n`` new entries pending for ``owner`` (delivery count ``count``, idle
    ``idle_ms``); registered as the library registers a consumer, with no
    heartbeat key (it died) unless ``register`` is false (a foreign client)."""
    ids = [(await client.execute("XADD", S, "*", "n", str(i), "by", owner)).decode()
           for i in range(n)]
    with contextlib.suppress(BusyGroupError):  # made by an earlier seed
        await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    await client.execute("XREADGROUP", "GROUP", G, owner, "COUNT", n, "STREAMS", S, ">")
    await client.execute("XCLAIM", S, G, owner, 0, *ids, "IDLE", idle_ms, "RETRYCOUNT", count,
                         "JUSTID")
    if register:
        await client.execute("HSET", REGISTRY, owner, f"{heartbeat_ms} {mode}")
    return ids


class Seen:
    """A handler that records (consumer, id, attempt) and acknowledges."""

    def __init__(self, who: str, seen: list[tuple[str, str, int]]) -> None:
        self.who = who
        self.seen = seen

    async def __call__(self, d: Delivery) -> Outcome:
        assert d.id is not None
        self.seen.append((self.who, d.id, d.attempt))
        return ACK


# -- the case: SIGKILL + restart, everything default ---------------------------

DEFAULT_WORKER = """
import os
import pathlib

import anyio

from trio_redis_finalize import ACK, StreamSubscription

HERE = pathlib.Path(__file__).parent
HANG = os.environ.get("WORKER_HANG") == "1"


async def handle(d):
    with (HERE / "handled.txt").open("a") as f:
        f.write(f"{os.getpid()} {d.id} {d.attempt}\\n")
    if HANG:
        await anyio.sleep_forever()
    return ACK


async def setup(consumer):
    await consumer.mount(StreamSubscription("jobs", "workers"), handle, concurrency=3)
"""


def _handled(tmp: Path) -> list[tuple[int, str, int]]:
    path = tmp / "handled.txt"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        pid, eid, attempt = line.split()
        out.append((int(pid), eid, int(attempt)))
    return out


def _wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def _run(tmp: Path, url: str, *, hang: bool) -> subprocess.Popen[str]:
    env = {**os.environ, "WORKER_HANG": "1" if hang else "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "trio_redis_finalize", "run", "default_worker:setup", "--url", url],
        cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(120)
def test_sigkill_then_a_restart_with_the_defaults_finishes_every_entry(
        tmp_path: Path, redis_url: str) -> None:
    """``run`` with the defaults (a random consumer name, ``Mode.PLAIN``, the
    default ``heartbeat`` of 30 s), 3 entries in flight, SIGKILL; a restart
    with the defaults finishes all 3 within the recovery bound (about one
    heartbeat after the kill), each at attempt 2 (the crash counts), and
    nothing is left pending, stranded or registered."""
    r = redis.Redis.from_url(redis_url)
    (tmp_path / "default_worker.py").write_text(DEFAULT_WORKER)
    ids = [r.xadd("jobs", {"n": str(i)}).decode() for i in range(3)]
    first = _run(tmp_path, redis_url, hang=True)
    try:
        _wait_for(lambda: len(_handled(tmp_path)) == 3, 20, "3 entries in flight")
    finally:
        first.kill()
        first.wait()
        first.communicate()
    killed = time.monotonic()
    assert r.xpending("jobs", "workers")["pending"] == 3  # held by the dead consumer's name
    second = _run(tmp_path, redis_url, hang=False)
    try:
        _wait_for(lambda: r.xpending("jobs", "workers")["pending"] == 0, 30 + 15,
                  "nothing pending after the restart's recovery bound")
        took = time.monotonic() - killed
        _wait_for(lambda: len(_handled(tmp_path)) == 6, 5, "3 handled again")
    finally:
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=30)
    again = [(eid, attempt) for pid, eid, attempt in _handled(tmp_path) if pid == second.pid]
    assert sorted(again) == sorted((eid, 2) for eid in ids), err
    assert took < 30 + 10, f"recovered {took:.1f} s after the kill"
    assert "stopped its heartbeat; took over 3 of its pending entries" in err, err
    [line] = [ln for ln in err.splitlines() if ln.startswith("trio-redis-finalize run: stopped")]
    assert "handed back 0 (pending in Redis" in line and "stranded" not in line
    # the dead consumer was deleted once its PEL was empty; the restart
    # deregistered as it stopped: no consumer names pile up
    assert r.xinfo_consumers("jobs", "workers") == []
    assert r.exists(presence.registry_key("jobs", "workers")) == 0


# -- the reaper ---------------------------------------------------------------------

async def test_racing_reapers_take_each_entry_once(redis_url: str, client: Client) -> None:
    """Three consumers mount at once beside a dead consumer's 30 entries: each
    entry is taken (and handled) by exactly one of them, at attempt 2, and the
    dead consumer is deleted from the group and the registry."""
    ids = await seed(client, "w0", 30)
    seen: list[tuple[str, str, int]] = []
    async with (open_consumer(redis_url, name="c1") as c1,
                open_consumer(redis_url, name="c2") as c2,
                open_consumer(redis_url, name="c3") as c3):
        async with trio.open_nursery() as n:
            for c in (c1, c2, c3):
                n.start_soon(functools.partial(c.mount, sub(heartbeat=0.3, count=5),
                                               Seen(c.name, seen), concurrency=4))
        await eventually(lambda: len(seen) >= 30, what="30 entries handled")
        await eventually(lambda: sum(effects(c).get("acked", 0) for c in (c1, c2, c3)) == 30,
                         what="30 acked")
        await trio.sleep(0.3)
        assert sum(effects(c).get("recovered", 0) for c in (c1, c2, c3)) == 30
        assert "w0" not in await consumers(client)
        assert "w0" not in await registered(client)
    assert Counter(eid for _, eid, _ in seen) == Counter(ids)
    assert {attempt for _, _, attempt in seen} == {2}
    assert await pending_of(client) == {}


async def test_a_live_consumers_entries_are_not_taken_when_its_heartbeat_key_vanishes(
        redis_url: str, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    """Consumer ``a`` handles 3 slow entries while its heartbeat key is deleted
    over and over (an eviction, a flush): ``b`` sees ``a`` dead, but the
    entries ``a`` has in hand keep their lease (``XCLAIM ... JUSTID`` every
    ``heartbeat / 3``, PLAIN mode too), so ``b`` never takes them."""
    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    release = trio.Event()
    started: list[str] = []

    async def slow(d: Delivery) -> Outcome:
        assert d.id is not None
        started.append(d.id)
        await release.wait()
        return ACK

    other: list[tuple[str, str, int]] = []
    ids = [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(3)]
    async with open_consumer(redis_url, name="a") as a, open_consumer(redis_url, name="b") as b:
        await a.mount(sub(heartbeat=0.3), slow, concurrency=3)
        await eventually(lambda: len(started) == 3, what="a handles 3")
        await b.mount(sub(heartbeat=0.3), Seen("b", other))
        with trio.move_on_after(2.0):  # more than 6 heartbeats
            while True:
                await client.execute("DEL", heartbeat_key("a"))
                assert await pending_of(client) == {"a": 3}
                await trio.sleep(0.005)
        release.set()
        await eventually(lambda: effects(a).get("acked") == 3, what="a acks its 3")
    assert other == [] and sorted(started) == sorted(ids)
    assert effects(b) == {}
    # b did see a without its heartbeat (so the lease is what kept the entries)
    assert any("3 entries of consumer 'a'" in r.getMessage()
               for r in caplog.records)


async def test_a_dead_consumer_with_nothing_pending_is_deleted(redis_url: str, client: Client) -> None:
    """Random default names must not pile up: a registered consumer whose
    heartbeat is gone and whose PEL is empty is deleted from the group
    (``XGROUP DELCONSUMER``) and from the registry."""
    [eid] = await seed(client, "w0", 1)
    await client.execute("XACK", S, G, eid)  # w0 is in the group, nothing pending
    await client.execute("HSET", REGISTRY, "ghost", "200 plain")  # registered, never read
    assert await consumers(client) == ["w0"]
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(heartbeat=0.2), Seen("c1", []))
        # the look at mount (before c1's first read: c1 is not in the group yet)
        assert "w0" not in await consumers(client)
        assert await registered(client) == ["c1"]
        assert stats(consumer)["stranded"] == 0


async def test_a_consumer_without_heartbeat_is_warned_about_and_not_taken(
        redis_url: str, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    """Entries pending for a consumer that never kept a heartbeat (another
    client, an older version) are stranded for PLAIN: ``mount()`` warns once,
    naming the consumer, the count and its idle time, and how to recover
    them; they are counted (``stats()["stranded"]``), never taken."""
    caplog.set_level(logging.INFO, logger="trio_redis_finalize")
    await seed(client, "foreign", 2, register=False, idle_ms=90_000)
    seen: list[tuple[str, str, int]] = []
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(heartbeat=0.1), Seen("c1", seen))
        warned = [r for r in caplog.records if "'foreign'" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelname == "WARNING"
        text = warned[0].getMessage()
        assert "2 entries pending for consumer 'foreign' (idle " in text
        assert "Mode.RECLAIM" in text and "XCLAIM" in text and "name=" in text
        assert getattr(warned[0], "subscription", None) == NAME
        assert stats(consumer)["stranded"] == 2
        await trio.sleep(0.5)  # several looks at the group
        assert seen == [] and await pending_of(client) == {"foreign": 2}
        assert len([r for r in caplog.records if "'foreign'" in r.getMessage()]) == 1
    assert await pending_of(client) == {"foreign": 2}


async def test_a_taken_over_entry_counts_the_crash_as_an_attempt(
        redis_url: str, client: Client) -> None:
    """A dead consumer's entry read once comes at attempt 2; one that crashed
    consumers 3 times (delivery count 3) arrives past ``max_attempts=3``: it
    is dead-lettered without calling the handler."""
    [once] = await seed(client, "w0", 1, count=1)
    [poison] = await seed(client, "w0", 1, count=3)
    seen: list[tuple[str, str, int]] = []
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(heartbeat=0.2, max_attempts=3, dead_letter="dead"),
                             Seen("c1", seen))
        await eventually(lambda: effects(consumer).get("dead_lettered") == 1
                         and effects(consumer).get("acked") == 1, what="both finalized")
    assert seen == [("c1", once, 2)]
    [(_, fields)] = await client.execute("XRANGE", "dead", "-", "+")
    flat = dict(zip(fields[::2], fields[1::2], strict=True))
    assert flat[b"trf-dead-id"].decode() == poison and flat[b"trf-dead-attempt"] == b"4"
    assert await pending_of(client) == {}


async def test_the_reaper_takes_an_entry_once_it_has_been_idle_a_heartbeat(
        redis_url: str, client: Client) -> None:
    """The recovery bound: an entry a consumer read just before it died is
    taken once idle the dead consumer's heartbeat (not before: the guard that
    keeps a live consumer's leased entries), without waiting for the next
    periodic look."""
    [eid] = await seed(client, "w0", 1, idle_ms=0, heartbeat_ms=1000)
    read_at = trio.current_time()
    seen: list[tuple[str, str, int]] = []
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(heartbeat=30.0), Seen("c1", seen))  # looks every 15 s itself
        await trio.sleep(0.6)
        if trio.current_time() - read_at < 0.9:  # (a loaded machine may sleep longer)
            assert seen == []  # idle < 1 s: not yet
        # the bound: long before the next periodic look (15 s)
        await eventually(lambda: bool(seen), timeout=12, what="taken over")
        took = trio.current_time() - read_at
    assert seen == [("c1", eid, 2)]
    assert 0.9 <= took < 12


async def test_claiming_leaves_a_dead_consumers_pel_to_xautoclaim_and_deletes_it_when_empty(
        redis_url: str, client: Client) -> None:
    """CLAIMING mode: a dead consumer's PEL may hold delayed retries, so the
    reaper does not take them early (XAUTOCLAIM claims them after
    ``min_idle``); once its PEL is empty, the dead consumer is deleted."""
    [eid] = await seed(client, "w0", 1, idle_ms=0, heartbeat_ms=100, mode="claiming")
    seeded = trio.current_time()
    seen: list[tuple[str, str, int]] = []
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(mode=Mode.CLAIMING, min_idle=1.0, heartbeat=0.1),
                             Seen("c1", seen))
        await trio.sleep(0.6)
        if trio.current_time() - seeded < 0.9:  # (a loaded machine may sleep longer)
            assert seen == [] and await pending_of(client) == {"w0": 1}
        await eventually(lambda: bool(seen), timeout=30, what="claimed by XAUTOCLAIM")
        await eventually(lambda: effects(consumer).get("acked") == 1, what="acked")

        async def w0_gone() -> bool:
            return "w0" not in await consumers(client) and "w0" not in await registered(client)
        await eventually(w0_gone, timeout=30, what="w0 deleted")
    assert seen == [("c1", eid, 2)]


async def test_a_registry_key_of_another_type_is_logged_and_reading_goes_on(
        redis_url: str, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    """An error reply that can never succeed at the look at the group (the
    registry key replaced by a string) is logged and the look tried again
    later: it never stops the reading."""
    caplog.set_level(logging.WARNING, logger="trio_redis_finalize")
    seen: list[tuple[str, str, int]] = []
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(heartbeat=0.2), Seen("c1", seen))
        await client.execute("SET", REGISTRY, "not a hash")
        await trio.sleep(0.3)  # looks at the group meet WRONGTYPE
        for i in range(3):
            await client.execute("XADD", S, "*", "n", str(i))
        await eventually(lambda: effects(consumer).get("acked") == 3, what="read and acked")
        assert stats(consumer)["read_errors"] >= 1
    assert any(r.levelname == "ERROR" and "looking for dead consumers of the group failed"
               in r.getMessage() and "WRONGTYPE" in r.getMessage() for r in caplog.records)


# -- a clean stop ---------------------------------------------------------------------

async def test_a_clean_stop_deregisters(redis_url: str, client: Client) -> None:
    """While it runs, a stream consumer keeps a heartbeat key (TTL
    ``heartbeat``) and a registration; a clean stop with nothing pending
    deletes both and the consumer in the group."""
    await client.execute("XADD", S, "*", "n", "1")
    async with open_consumer(redis_url, name="c1") as consumer:
        await consumer.mount(sub(heartbeat=2.0), Seen("c1", []))
        await eventually(lambda: effects(consumer).get("acked") == 1, what="acked")
        assert 0 < int(await client.execute("PTTL", heartbeat_key("c1"))) <= 2000
        assert (await client.execute("HGET", REGISTRY, "c1")).startswith(b"2000 plain ")
        assert await consumers(client) == ["c1"]
    assert await consumers(client) == []
    assert await client.execute("EXISTS", heartbeat_key("c1"), REGISTRY) == 0


async def test_a_stop_that_leaves_work_pending_hands_it_back_with_the_stopped_mark(
        redis_url: str, client: Client) -> None:
    """A handler cut at the grace leaves its entry pending: at the stop (after
    the finalizer ended) it is handed back -- idle at once, its heartbeat key
    deleted, the registration the stopped mark -- so the next consumer takes
    it over at once, at attempt 2 (the cut handler ran), and the mark goes."""
    eid = (await client.execute("XADD", S, "*", "n", "1")).decode()
    hang = Hang()
    async with open_consumer(redis_url, name="c1", shutdown_grace=0.1) as consumer:
        await consumer.mount(sub(heartbeat=0.5), hang)
        await hang.started.wait()
    assert await pending_of(client) == {"c1": 1}
    assert await registered(client) == ["c1"]
    assert (await client.execute("HGET", REGISTRY, "c1")).endswith(b" stopped")
    assert int(await client.execute("EXISTS", heartbeat_key("c1"))) == 0
    [[_, _, idle, _]] = await client.execute("XPENDING", S, G, "-", "+", 10, "c1")
    assert int(idle) > 10**11  # handed back: idle at once
    seen: list[tuple[str, str, int]] = []
    async with open_consumer(redis_url, name="c2") as c2:
        await c2.mount(sub(heartbeat=0.5), Seen("c2", seen))
        await eventually(lambda: effects(c2).get("acked") == 1, timeout=30, what="taken over")
    assert seen == [("c2", eid, 2)]
    assert await consumers(client) == [] and await registered(client) == []


def test_heartbeat_is_validated() -> None:
    for bad in (0, -1, 0.001, float("nan"), "30"):
        with pytest.raises(ValueError, match="heartbeat"):
            StreamSubscription(S, G, heartbeat=bad)  # type: ignore[arg-type]
    assert StreamSubscription(S, G).heartbeat == 30.0
