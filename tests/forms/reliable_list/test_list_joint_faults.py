"""The reliable list's joints (``test_list_joints``) under faults: each
request those fixes added meets a lost reply, a silent link or an error reply
instead of running (the command proxy, ``faults.cmdproxy``), on a real server.

* the reaper's read of a dead consumer's Backoff schedule
  (``backoff_schedule_left``): nothing is moved back before it is due,
  nothing is lost, the reaper looks again;
* a consumer stalled past its heartbeat (SIGSTOP) renews its beat and reads
  its processing list before it starts more work: a fault on that renew or
  that read does not let it start what a live consumer's reaper moved back
  meanwhile;
* the take-over at mount of two processing lists a consumer name was
  registered with before (``reliable_list_adopt`` of each, and the note in
  ``list-moved`` written first);
* the counted give-back of what a stop read and did not start
  (``reliable_list_give_back``): each element back once, at most one attempt
  higher where the client cannot know.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from _paths import TESTS
from _procs import ChildLines, Hang, Recorder, child_lines, eventually
from _rlist import Q, as_a_crash, b_starts_all, done_counts, effects, lrange, proc, sub, text
from faults.cmdproxy import BLACKHOLE, LOST, CommandProxy, Fault, error, serving

from trio_redis_finalize import Backoff, Delivery, Outcome, _shutdown, open_consumer
from trio_redis_finalize._core._identity import CLAIM, RENEW
from trio_redis_finalize._core._recovery import SCHEDULE_LEFT
from trio_redis_finalize._core.reliable_list.liveness import (
    ADOPT,
    GIVE_BACK,
    heartbeat_key,
    moved_key,
    registry_key,
)
from trio_redis_finalize._envelope import unwrap
from trio_redis_finalize._forms.reliable_list import liveness as _list_liveness
from trio_redis_finalize._forms.reliable_list import recovery as _recovery
from trio_redis_finalize._transport import Client
from trio_redis_finalize.testing import RedisServer

pytestmark = pytest.mark.timeout(120)

FAULTS: dict[str, Fault] = {"lost": LOST, "blackhole": BLACKHOLE, "OOM": error("OOM"),
                            "READONLY": error("READONLY")}
WINDOW = 5.0


# -- 1. the reaper's read of a dead consumer's Backoff schedule ------------------------------

@pytest.mark.parametrize("fault", ["lost", "blackhole", "OOM", "READONLY"])
async def test_a_fault_at_the_reapers_schedule_read_moves_nothing_before_it_is_due(
    redis_server: RedisServer, flavour: str, client: Client, monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """Consumer ``a`` holds ``held`` (its handler runs) and ``wait`` (attempt 1
    failed, attempt 2 due 5 s later by its ``Backoff``) and dies (no
    hand-back).  Consumer ``b``'s reaper, once ``a``'s heartbeat lapsed,
    reads the schedule beside ``a``'s processing list; that read meets the
    fault (the script ran and its reply was lost, a silent link, or a refusal).
    The reaper moves nothing in that look, looks again, moves ``held`` back
    then and ``wait`` only once it is due: each handled once by ``b``, as
    attempt 2, ``wait`` no sooner than due."""
    monkeypatch.setattr(_shutdown, "FINALIZE_GRACE", 1.0)  # a's last heartbeat: 0.5 + 1 + 1 s
    monkeypatch.setattr(_recovery, "FINALIZE_TIMEOUT", 1.0)  # the silent link's read ends then
    failed: list[float] = []
    held = trio.Event()
    record = Recorder()

    async def first(d: Delivery) -> Outcome:
        if text(d) == "held":
            held.set()
            await trio.sleep_forever()
        failed.append(trio.current_time())
        raise RuntimeError("fails once")

    backoff = Backoff(base=0.01, cap=0.01, window=WINDOW)
    kind = f"EVALSHA:{SCHEDULE_LEFT.name}"
    with trio.fail_after(60):  # a bound
        async with open_consumer(redis_server.url, name="a", shutdown_grace=0.5) as a:
            await a.mount(sub(heartbeat=1.0, max_attempts=2), first, on_error=backoff,
                          concurrency=2)
            await client.execute("LPUSH", Q, b"held", b"wait")
            await held.wait()
            await eventually(lambda: client.execute("ZCARD", proc("a") + ":backoff"), 10,
                             "the due time written")
            as_a_crash(monkeypatch, a)
        assert sorted(await lrange(client, proc("a"))) == [b"held", b"wait"]
        async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy:
            proxy.arm(kind, FAULTS[fault])
            async with open_consumer(proxy.url, name="b") as b:
                await b.mount(sub(heartbeat=1.0, max_attempts=2), record, on_error=backoff)
                await eventually(lambda: proxy.fired, 15, "the schedule read met the fault")
                await eventually(lambda: len(record.seen) == 2, 20, "both handled by b")
                await eventually(lambda: effects(b).get("acked") == 2, 10, "acked")
            assert proxy.seen[kind] >= 2, proxy.seen  # the reaper looked again
    seen = sorted((text(d), d.attempt) for d in record.seen)
    assert seen == [("held", 2), ("wait", 2)], seen
    early = failed[0] + WINDOW - next(t for d, t in zip(record.seen, record.at, strict=True)
                                      if text(d) == "wait")
    assert early <= 0.05, f"attempt 2 came {early:.2f} s before its Backoff was due"
    assert await lrange(client, proc("a")) == [] and await lrange(client, Q) == []


# -- 2. a consumer stalled past its heartbeat ------------------------------------------------

LIST_PROC = str(TESTS / "_list_proc.py")
STALL_CASES = [(f"EVALSHA:{RENEW.name}", f) for f in ("lost", "blackhole", "OOM")]
STALL_CASES += [("LRANGE", f) for f in ("lost", "blackhole", "READONLY")]
NAMES = [f"e{i}" for i in range(6)]


@asynccontextmanager
async def _a_stopped(
    redis_server: RedisServer, flavour: str, client: Client, sleep: str,
) -> AsyncIterator[tuple[CommandProxy, ChildLines]]:
    """Consumer A (a process, through the proxy; concurrency 1, heartbeat 1 s,
    ``sleep`` seconds per element) reads all of ``NAMES`` and starts the
    first; then it is stopped (SIGSTOP).  Yields the proxy and A."""
    await client.execute("LPUSH", Q, *NAMES)
    async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
            child_lines(LIST_PROC, proxy.url, Q, "a", "1.0", sleep) as a:
        assert await a.read(lambda w: w[:1] == ["H"], 20), a.lines
        await eventually(lambda: _zero(client.execute("LLEN", Q)), 10, "A read all")
        os.kill(a.proc.pid, signal.SIGSTOP)
        yield proxy, a


@pytest.mark.parametrize(("kind", "fault"), STALL_CASES)
async def test_a_fault_at_a_stalled_consumers_look_does_not_start_what_was_moved_back(
    redis_server: RedisServer, flavour: str, client: Client, kind: str, fault: str,
) -> None:
    """Consumer A (a process, through the proxy; concurrency 1, 1 s per
    element, heartbeat 1 s) reads all six elements and starts the first; it
    is stopped (SIGSTOP) 3.5 s, longer than its heartbeat, and consumer B's
    reaper moves A's processing list back onto the queue: B starts all six.
    A's first heartbeat renewal once resumed (``heartbeat_renew``), or its
    first read of its processing list (``LRANGE``), meets the fault.  A
    starts none of those it had read and not begun (its handler task finds
    the heartbeat's lease lapsed before it takes the next one), and each
    element's write is committed at most once and none is lost."""
    async with _a_stopped(redis_server, flavour, client, "1.0") as (proxy, a):
        stopped = trio.current_time()
        await a.read(None, 0.2)  # what it wrote before the stop
        before = len(a.words("H"))
        proxy.arm(kind, FAULTS[fault])
        async with b_starts_all(redis_server.url, NAMES, a.proc.pid, stopped) as started_by_b:
            await eventually(lambda: proxy.fired, 10, "the fault fired")
            await a.read(None, 3.5)  # at 1 s per element: time to start 3 more
            after = [w[1] for w in a.words("H")[before:]]
            assert sorted(set(started_by_b)) == NAMES
            assert after == [], (after, a.lines)
    counts = await done_counts(client)  # each element's write once
    left = [unwrap(e)[0].decode() for key in (Q, proc("a"), proc("b"))
            for e in await lrange(client, key)]  # (handed back by B's stop: counted)
    lost = [n for n in NAMES if n not in counts and n not in left]
    assert not lost, (lost, counts, left)


@pytest.mark.parametrize(("kind", "fault"), STALL_CASES)
async def test_a_fault_at_a_stalled_consumers_look_loses_nothing_still_its_own(
    redis_server: RedisServer, flavour: str, client: Client, kind: str, fault: str,
) -> None:
    """As above, but no other consumer runs: nothing is moved back while A
    is stopped past its heartbeat.  Resumed, A's first renewal or read of its
    processing list meets the fault; A still handles each of the six once,
    as attempt 1 (what it dropped unstarted at the late beat comes back as
    it was), and commits each write once."""
    async with _a_stopped(redis_server, flavour, client, "0.3") as (proxy, a):
        proxy.arm(kind, FAULTS[fault])
        await eventually(lambda: _zero(client.execute("EXISTS", heartbeat_key(Q, "a"))), 10,
                         "A's heartbeat lapsed")
        os.kill(a.proc.pid, signal.SIGCONT)
        await eventually(lambda: proxy.fired, 10, "the fault fired")
        with trio.fail_after(30):  # a bound
            while len({w[1] for w in a.words("A")}) < 6:
                await a.read(lambda w: w[:1] == ["A"], 1.0)
        await eventually(lambda: _done(client, NAMES), 10, "every write committed")
        await a.read(None, 0.6)  # one more handled now would be a second time
    assert sorted(w[1] for w in a.words("H")) == NAMES, a.lines
    assert {w[2] for w in a.words("H")} == {"1"}, a.lines
    assert await lrange(client, Q) == [] and await lrange(client, proc("a")) == []


async def _done(client: Client, names: list[str]) -> bool:
    return sorted(await done_counts(client)) == names


async def _zero(n: Any) -> bool:
    return int(await n) == 0


# -- 3. the take-over of two noted processing lists at mount --------------------------------

P1, P2, P3 = "{jobs}:p1", "{jobs}:p2", "{jobs}:p3"
ADOPT_KIND = f"EVALSHA:{ADOPT.name}"
ADOPT_CASES = [(k, at, f) for k, at in ((ADOPT_KIND, 0), (ADOPT_KIND, 1), ("HSET", 0))
               for f in ("lost", "blackhole", "OOM")]
ADOPT_CASES += [(f"EVALSHA:{CLAIM.name}", 0, "lost")]  # the notes written, the name re-registered


@pytest.mark.parametrize(("kind", "at", "fault"), ADOPT_CASES)
async def test_a_fault_at_the_take_over_of_two_noted_lists_leaves_neither_behind(
    redis_server: RedisServer, flavour: str, client: Client, monkeypatch: pytest.MonkeyPatch,
    kind: str, at: int, fault: str,
) -> None:
    """Consumer ``a`` (processing list ``p1``) dies while its handler holds
    ``job``.  Started again with ``p2``, its take-over of ``p1`` meets a
    silent link: that mount fails, ``p1`` noted in ``list-moved``.  Started
    again with ``p3``, it notes ``p2`` (the name's registration) and takes
    over ``p2`` (empty) then ``p1``; the fault is now at the note (``HSET``),
    the claim that re-registers the name, the first take-over or the second:
    a lost reply (it ran), a silent link or a refusal (it did not).  That
    mount may fail (in time, with an error); mounted again, ``job`` is
    delivered once more, as attempt 2, and no list nor note is left behind."""
    first, record = Hang(), Recorder()

    async def mount_p(url: str, processing: str) -> None:
        async with open_consumer(url, name="a", takeover=True) as c:
            await c.mount(sub(heartbeat=0.5, processing=processing), record)
            await eventually(lambda: record.seen, 10, "job delivered again")
            await eventually(lambda: effects(c).get("acked", 0) == 1, 10, "acked")

    monkeypatch.setattr(_list_liveness, "FINALIZE_TIMEOUT", 0.5)
    with trio.fail_after(90):  # a bound
        async with open_consumer(redis_server.url, name="a", shutdown_grace=0.0) as a:
            await a.mount(sub(heartbeat=0.5, processing=P1), first)
            await client.execute("LPUSH", Q, b"job")
            await first.started.wait()
            as_a_crash(monkeypatch, a)
        async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy:
            proxy.arm(ADOPT_KIND, BLACKHOLE)
            with pytest.raises(Exception):  # noqa: B017 -- the silent link's timeout
                await mount_p(proxy.url, P2)
            assert await client.execute("HGETALL", moved_key(Q)) == [P1.encode(), b"a"]
            assert await client.execute("HGET", registry_key(Q), "a") == P2.encode()
            proxy.reset()
            proxy.arm(kind, FAULTS[fault], at=at)
            try:
                await mount_p(proxy.url, P3)
            except Exception:
                pass
            assert proxy.fired, proxy
        if not record.seen:
            await mount_p(redis_server.url, P3)
    assert [d.attempt for d in record.seen] == [2], record.seen
    for key in (P1, P2, P3, Q):
        assert await lrange(client, key) == [], key
    assert await client.execute("HGETALL", moved_key(Q)) == []
    assert await client.execute("HGETALL", registry_key(Q)) == []  # stopped clean: deregistered


# -- 4. the counted give-back at a stop ----------------------------------------------------

@pytest.mark.parametrize(("fault", "at"), [("lost", 0), ("lost", 1), ("blackhole", 0),
                                           ("blackhole", 1), ("OOM", 0), ("READONLY", 1)])
async def test_a_fault_at_the_give_back_of_a_stop_brings_each_element_back_once(
    redis_server: RedisServer, flavour: str, client: Client, fault: str, at: int,
) -> None:
    """Consumer ``a`` (concurrency 1) holds the first ``x`` in its handler and
    has read two more ``x`` and a ``y`` that no handler started when it stops
    (grace 0.3 s); their give-back onto the queue (the first call, or the
    second: the read waiting for room, then the work queue's) meets the fault.  Then
    consumer ``b`` handles what comes back: each of the four once, the held
    ``x`` as attempt 2 (its handler ran, cut by the grace), the others as
    attempt 1 -- 2 at most where the client cannot know whether the
    give-back ran."""
    await client.execute("LPUSH", Q, b"x", b"x", b"y", b"x")
    hold, record = Hang(), Recorder()
    kind = f"EVALSHA:{GIVE_BACK.name}"
    with trio.fail_after(60):  # a bound
        async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy:
            proxy.arm(kind, FAULTS[fault], at=at)
            async with open_consumer(proxy.url, name="a", shutdown_grace=0.3) as a:
                await a.mount(sub(heartbeat=1.0), hold, concurrency=1)
                await hold.started.wait()
                (m,) = a.mounts

                async def two_to_give_back() -> bool:
                    # a read waits for room (its elements are given back in one call)
                    # beside the work queue's (another): not only moved, handed to the
                    # put -- a reply still on its way when the stop cuts the read
                    # leaves its elements to the stop's hand-back, no give-back call
                    return m._queue.room is not None and bool(m._queue.items)

                await eventually(two_to_give_back, 10, "a read waiting beside the queue")
            assert proxy.fired, proxy
        assert await lrange(client, proc("a")) == []
        assert await client.execute("HGETALL", registry_key(Q)) == []
        async with open_consumer(redis_server.url, name="b") as b:
            await b.mount(sub(heartbeat=1.0), record, concurrency=4)
            await eventually(lambda: effects(b).get("acked", 0) >= 4, 15, "all four handled")
            await trio.sleep(0.5)  # a fifth would come now
    seen = [(text(d), d.attempt) for d in record.seen]
    assert sorted(e for e, _ in seen) == ["x", "x", "x", "y"], seen
    attempts = sorted(at for e, at in seen if e == "x")
    assert attempts[-1] == 2 and attempts[:2] in ([1, 1], [1, 2], [2, 2]), seen
    assert next(at for e, at in seen if e == "y") in (1, 2), seen
    assert await lrange(client, Q) == [] and await lrange(client, proc("b")) == []
