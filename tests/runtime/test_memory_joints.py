"""Where a consumer's memory meets Redis, and two finalizations of one
delivery meet: the durable delay set, the Backoff schedule, the copy
markers and the dead letter, against real consumer processes stopped
(SIGSTOP) or killed (SIGKILL) at the joint.

Consumer A is ``tests/_delay_proc.py`` in its own process; consumer B runs
here.  Timeouts are bounds, never expectations; a wait that proves an
absence is a bound too (what would come, came by then).

Two tests here (five cases) fail on the code they were written against, each for a
fix in a module another developer holds (the branch's report has them):
``test_a_crash_during_a_copy_s_handler_counts_its_attempt`` (the stream's
attempt rule, ``_core/stream/decode``) and
``test_a_processing_list_another_live_consumer_registered_is_refused``
(``_forms/reliable_list/liveness``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable

import _delay_proc
import pytest
import trio
from _paths import TESTS
from _procs import HoldFirst, Recorder, child_lines, eventually

from trio_redis_finalize import (
    ACK,
    DelayedRetry,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(120)

HEARTBEAT = 1.0
"""The heartbeat of both consumers: B's reaper takes A's entries this long after A stopped."""


consumer_a = _delay_proc.started
"""``_delay_proc.py`` as consumer ``a``."""


async def calls(client: Client) -> list[str]:
    return [c.decode() for c in await client.execute("LRANGE", "calls", 0, -1)]


async def pending(client: Client) -> int:
    return int((await client.execute("XPENDING", "s", "g"))[0])


async def _done(client: Client) -> bool:
    """A's handler recorded ``done`` (it returns next)."""
    return any(c.startswith("done") for c in await calls(client))


async def equals(value: Awaitable[object], expected: object) -> bool:
    return bool(await value == expected)


async def assert_list_left_empty(client: Client, *consumers: str) -> None:
    """Nothing is left in the list ``q``, nor in the processing list of any of ``consumers``."""
    for key in ("q", *(f"{{q}}:processing:{name}" for name in consumers)):
        assert await client.execute("LLEN", key) == 0, key


async def _idle_at_least(client: Client, seconds: float) -> bool:
    """The one entry of ``s`` pending in ``g`` has been idle ``seconds`` (not leased)."""
    rows = await client.execute("XPENDING", "s", "g", "-", "+", 1)
    return bool(rows) and int(rows[0][2]) >= seconds * 1000


# -- 1. a durable copy planned by a stalled consumer, its entry settled by another -----------

async def test_a_stalled_consumer_s_durable_retry_after_for_an_entry_taken_over_and_acked(
    redis_url: str, client: Client,
) -> None:
    """A (a process) handles the entry and stalls (SIGSTOP) before its handler
    returns ``retry_after`` through the durable delay set.  B's reaper takes
    the entry over once A's heartbeat lapsed and ACKs it.  A, resumed, returns
    its ``retry_after``: the gate is closed, so no copy goes into the delay
    set, none comes back, nobody handles the message again."""
    eid = (await client.execute("XADD", "s", "*", "k", "v")).decode()
    rec = Recorder(lambda d: ACK)
    delay = 0.5
    async with consumer_a(redis_url, "durable", delay, hold=2.0, heartbeat=HEARTBEAT) as a:
        await eventually(lambda: client.execute("LLEN", "calls"), timeout=20, what="A's call")
        os.kill(a.pid, signal.SIGSTOP)
        sub = _delay_proc.subscription("durable", heartbeat=str(HEARTBEAT))
        async with open_consumer(redis_url, name="b", shutdown_grace=0.0) as b:
            await b.mount(sub, rec)
            await eventually(lambda: rec.seen, timeout=20, what="B's take-over")
            await eventually(lambda: equals(pending(client), 0), what="B's ACK")
            os.kill(a.pid, signal.SIGCONT)
            await eventually(lambda: _done(client), timeout=20, what="A's handler returned")
            # a copy A added would be in the set, then (due after `delay`) moved
            # back within a block and handled by B: all of it by then
            in_set = 0
            with trio.move_on_after(delay + 2.0):
                while len(rec.seen) == 1 and not in_set:
                    in_set = await client.execute("ZCARD", "{s}:delayed")
                    await trio.sleep(0.02)
    assert [d.id for d in rec.seen] == [eid], [(d.id, d.attempt) for d in rec.seen]
    assert in_set == 0
    assert await client.execute("XLEN", "s") == 1  # no copy written back
    assert await pending(client) == 0


# -- 3. the dead letter of a delivery finalized by two consumers at its last attempt ----------

@pytest.mark.parametrize("way", ["runtime", "claiming", "reliable"])
async def test_a_last_attempt_failed_by_a_stalled_consumer_and_its_taker_is_dead_lettered_once(
    redis_url: str, client: Client, way: str,
) -> None:
    """``max_attempts=1``: A (a process) handles the message and stalls
    (SIGSTOP) before its handler returns RETRY, which at the last attempt is
    a dead letter.  B takes the message over (the reaper once A's heartbeat
    lapsed; CLAIMING: its claim once idle ``min_idle``), one attempt past the
    limit: dead-lettered without calling B's handler.  A, resumed, dead-
    letters it too: its gate is closed.  One dead letter, the original gone."""
    stream = way != "reliable"
    if stream:
        await client.execute("XADD", "s", "*", "k", "v")
    else:
        await client.execute("LPUSH", "q", b"job")
    dead = "{s}:dead" if stream else "{q}:dead"
    rec = Recorder(lambda d: ACK)
    options = {"heartbeat": HEARTBEAT, "max_attempts": 1}

    async def dead_count() -> int:
        return int(await client.execute("XLEN" if stream else "LLEN", dead))

    async with consumer_a(redis_url, way, 0.1, hold=2.0, outcome="retry", **options) as a:
        await eventually(lambda: client.execute("LLEN", "calls"), timeout=20, what="A's call")
        os.kill(a.pid, signal.SIGSTOP)
        sub = _delay_proc.subscription(way, **{k: str(v) for k, v in options.items()})
        async with open_consumer(redis_url, name="b", shutdown_grace=0.0) as b:
            await b.mount(sub, rec)
            await eventually(dead_count, timeout=20, what="B's dead letter")
            os.kill(a.pid, signal.SIGCONT)
            await eventually(lambda: _done(client), timeout=20, what="A's handler returned")
            with trio.move_on_after(2.0):  # A's dead letter would be written by then
                while await dead_count() < 2:
                    await trio.sleep(0.02)
            n = await dead_count()
    assert rec.seen == []
    assert n == 1
    if stream:
        assert await pending(client) == 0
        assert await client.execute("XLEN", "s") == 1
    else:
        await assert_list_left_empty(client, "a", "b")


# -- 2. a crash while a delayed retry waits, and a restart under the same name ---------------

@pytest.mark.parametrize("way", ["claiming", "reliable"])
async def test_a_retry_after_waiting_through_a_crash_comes_back_once_at_its_next_attempt(
    redis_url: str, client: Client, way: str,
) -> None:
    """A (a process) returns ``retry_after`` at attempt 1 and is SIGKILLed
    while the retry waits (CLAIMING: in the PEL; reliable list: the original
    in the processing list, the copy in memory).  Started again under its
    name, the consumer delivers the message once, as attempt 2 (the handler's
    one run is counted once), and nothing is left pending.  (The delay, 2 s,
    is short: its due time outlives the process on a reliable list, so the
    restart waits it out; ``test_retry_after_restart`` checks that.)"""
    # CLAIMING: min_idle as long as the delay, so A (which claims the entry
    # back once idle min_idle) is killed well inside it on a busy machine
    claiming = {"min_idle": "2.0"} if way == "claiming" else {}
    if way == "claiming":
        first = (await client.execute("XADD", "s", "*", "k", "v")).decode()
    else:
        await client.execute("LPUSH", "q", b"job")
    async with consumer_a(redis_url, way, 2.0, hold=0.01, **claiming) as a:
        await eventually(lambda: _done(client), timeout=20, what="A's handler returning")
        if way == "claiming":  # the retry_after answered: left pending, not leased
            await eventually(lambda: _idle_at_least(client, 0.3), what="the entry left to wait")
        a.kill()  # (the reliable list: its copy held, or about to be: the same attempt)
    rec = Recorder(lambda d: ACK)
    async with open_consumer(redis_url, name="a", shutdown_grace=0.0) as again:
        await again.mount(_delay_proc.subscription(way, **claiming), rec)
        await eventually(lambda: rec.seen, timeout=20, what="the message after the restart")
        await trio.sleep(1.0)  # a second delivery would come by then
    assert [d.attempt for d in rec.seen] == [2], [(d.id, d.attempt) for d in rec.seen]
    if way == "claiming":
        assert rec.seen[0].id == first
        assert await pending(client) == 0
    else:
        await assert_list_left_empty(client, "a")


# -- the durable delay set belongs to one source ------------------------------------------------

@pytest.mark.parametrize("second", ["stream", "reliable list"])
async def test_a_delay_set_named_for_two_sources_is_refused_at_mount(
    redis_url: str, client: Client, second: str,
) -> None:
    """A delay-set member names no destination: every reader that moves due
    copies out of a ``delay_key`` writes them to its *own* source.  Two
    durable subscriptions of different sources sharing one ``delay_key``
    would hand one's delayed copies to the other (a stream's copy addressed
    to its group, read by another stream's group of another name, is
    acknowledged unhandled: lost).  The second mount is refused, naming the
    parameter and both sources; the first one's copies keep coming back to it."""
    for i in range(5):
        await client.execute("XADD", "s1", "*", "n", str(i))
    first = Recorder(lambda d: retry_after(0.2) if d.attempt == 1 else ACK)
    other = Recorder(lambda d: ACK)
    durable = DelayedRetry.DURABLE_ZSET
    sub = (StreamSubscription("s2", "g2", delayed_retry=durable, delay_key="delays", block=0.1)
           if second == "stream" else
           ReliableListSubscription("q2", delayed_retry=durable, delay_key="delays", block=0.1))
    async with open_consumer(redis_url, name="c", shutdown_grace=0.0) as c:
        await c.mount(StreamSubscription("s1", "g1", delayed_retry=durable, delay_key="delays",
                                         block=0.1), first)
        with pytest.raises(ValueError, match=r"delay_key.*'delays'.*'s1'") as info:
            await c.mount(sub, other)
        assert ("s2" if second == "stream" else "q2") in str(info.value)
        await eventually(lambda: len(first.seen) == 10, what="every copy back in s1")
    assert sorted(d.attempt for d in first.seen) == [1] * 5 + [2] * 5
    assert other.seen == []
    assert await client.execute("ZCARD", "delays") == 0


# -- a crash during the handler of a copy ---------------------------------------------------------

@pytest.mark.parametrize("who", ["restart", "reaper"])
@pytest.mark.parametrize("way", ["retry", "durable"])
async def test_a_crash_during_a_copy_s_handler_counts_its_attempt(
    redis_url: str, client: Client, way: str, who: str,
) -> None:
    """A (a process) answers attempt 1 with RETRY (or a durable ``retry_after``):
    a copy carrying ``retries 1`` comes back as attempt 2, and A is SIGKILLed
    while its handler runs.  Started again under its name (``restart``), or
    taken over by another consumer's reaper once A's heartbeat lapsed
    (``reaper``), the copy comes back as attempt 3: the crash counts that
    attempt, as it does for an original (a poison copy that kills its
    consumer reaches ``max_attempts`` in as many handler calls as an
    original would)."""
    await client.execute("XADD", "s", "*", "k", "v")
    opts: dict[str, object] = {"outcome": "retry"} if way == "retry" else {}
    opts["heartbeat"] = HEARTBEAT
    async with consumer_a(redis_url, "durable", 0.05, hang_at=2, **opts) as a:
        await eventually(lambda: equals(client.execute("LLEN", "calls"), 2), timeout=20,
                         what="A's attempt 2")
        a.kill()
    assert [c.split()[0] for c in await calls(client)] == ["1", "2"]
    rec = Recorder(lambda d: ACK)
    name = "a" if who == "restart" else "b"
    async with open_consumer(redis_url, name=name, shutdown_grace=0.0) as again:
        await again.mount(_delay_proc.subscription("durable", heartbeat=str(HEARTBEAT)), rec)
        await eventually(lambda: rec.seen, timeout=20, what=f"the copy after the {who}")
        await trio.sleep(0.5)  # a second delivery would come by then
    assert [d.attempt for d in rec.seen] == [3], [(d.id, d.attempt) for d in rec.seen]
    assert await pending(client) == 0


# -- one processing list, one consumer ------------------------------------------------------------

async def test_a_processing_list_another_live_consumer_registered_is_refused(
    redis_url: str, client: Client,
) -> None:
    """``processing=`` names *this consumer's* processing list.  A second
    consumer name mounting the same queue with the same explicit list (the
    same settings deployed in two processes) would take the first one's
    elements in hand for its own: its start's rescan delivers every one of
    them again (bumped), and each is handled twice without any fault.  The
    second mount is refused, naming the parameter and the consumer; the
    first consumer's messages are handled once."""
    slow = HoldFirst(n=3)  # c1's: the three stay in hand until released
    other = Recorder()  # c2's
    sub = ReliableListSubscription("q", processing="jobs:processing", block=0.1)
    async with open_consumer(redis_url, name="c1", shutdown_grace=5.0) as c1:
        await c1.mount(sub, slow, concurrency=3)
        for i in range(3):
            await client.execute("LPUSH", "q", f"m{i}")
        await eventually(lambda: len(slow.seen) == 3, what="c1 handling three")
        async with open_consumer(redis_url, name="c2", shutdown_grace=0.0) as c2:
            with pytest.raises(ValueError, match=r"processing.*'jobs:processing'.*'c1'"):
                await c2.mount(sub, other)
            await trio.sleep(0.5)  # a rescan of c2's would have delivered them by then
        slow.release.set()
        await eventually(lambda: equals(client.execute("LLEN", "jobs:processing"), 0),
                         what="c1's ACKs")
    handled = sorted((d.data, d.attempt) for d in slow.seen)
    assert handled == [(f"m{i}".encode(), 1) for i in range(3)], handled
    assert other.seen == [], other.data


# -- a runtime copy held in memory while its original is reaped ----------------------------------

async def test_a_held_copy_of_a_stalled_list_consumer_whose_original_was_reaped_is_not_pushed(
    redis_url: str, client: Client,
) -> None:
    """Reliable list, runtime ``retry_after(2)``: A (a process) holds the copy
    in memory, the original in its processing list.  A stalls (SIGSTOP) past
    its heartbeat; B's reaper moves the original back onto the queue (counted)
    and B handles it as attempt 2.  A, resumed after its timer's due time,
    sends its delayed copy: the gate (A's processing list holding the
    original) is closed, so no copy is pushed and the message is not handled
    a third time."""
    await client.execute("LPUSH", "q", b"job")
    rec = Recorder(lambda d: ACK)
    delay = 2.0
    async with consumer_a(redis_url, "reliable", delay, hold=0.01, heartbeat=HEARTBEAT) as a:
        await eventually(lambda: _done(client), timeout=20, what="A's handler returning")
        os.kill(a.pid, signal.SIGSTOP)
        stopped = trio.current_time()
        sub = _delay_proc.subscription("reliable", heartbeat=str(HEARTBEAT))
        async with open_consumer(redis_url, name="b", shutdown_grace=0.0) as b:
            await b.mount(sub, rec)
            await eventually(lambda: rec.seen, timeout=20, what="B's delivery of the reaped job")
            await eventually(lambda: equals(client.execute("LLEN", "{q}:processing:b"), 0),
                             what="B's ACK")
            await trio.sleep(max(0.0, delay + 0.5 - (trio.current_time() - stopped)))
            os.kill(a.pid, signal.SIGCONT)
            # A's timer is due: its copy, were it pushed, would be B's within a block
            with trio.move_on_after(3.0):
                while len(rec.seen) == 1:
                    await trio.sleep(0.02)
    assert [(d.data, d.attempt) for d in rec.seen] == [(b"job", 2)], rec.seen
    await assert_list_left_empty(client, "a")


# -- what a consumer that never comes back leaves in Redis ---------------------------------------

@pytest.mark.parametrize("form", ["stream", "reliable list"])
async def test_a_dead_consumer_s_waiting_failure_leaves_nothing_without_a_ttl(
    redis_url: str, client: Client, form: str,
) -> None:
    """A (a process) fails a message (``Backoff``, attempt 2 due 2 s later,
    its due time in the schedule) and is SIGKILLed while it waits; its name
    never comes back.  B's reaper lets the message wait out its Backoff,
    takes it over and B handles it as attempt 2.  Once B stopped cleanly,
    what A left is gone or expires (the Backoff schedule), and nothing of the
    library's stays in Redis without a TTL (A is out of the group and the
    registry; the stream itself is the user's)."""
    stream = form == "stream"
    if stream:
        await client.execute("XADD", "s", "*", "k", "v")
        args = [str(TESTS / "_stream_proc.py"), redis_url, "s", "g", "a", "plain", "60", "0",
                "2.0", str(HEARTBEAT)]
        schedule = "{s}:backoff:g"
        sub: StreamSubscription | ReliableListSubscription = StreamSubscription(
            "s", "g", heartbeat=HEARTBEAT, block=0.1)
    else:
        await client.execute("LPUSH", "q", b"job")
        args = [str(TESTS / "_list_proc.py"), redis_url, "q", "a", str(HEARTBEAT), "0", "2.0"]
        schedule = "{q}:processing:a:backoff"
        sub = ReliableListSubscription("q", heartbeat=HEARTBEAT, block=0.1)
    rec = Recorder(lambda d: ACK)
    async with child_lines(*args) as a:
        assert await a.read(lambda w: w[:1] == ["H"], 20), a.lines
        await eventually(lambda: client.execute("EXISTS", schedule), what="A's schedule written")
        os.kill(a.proc.pid, signal.SIGKILL)  # (reaped by child_lines at the end)
        async with open_consumer(redis_url, name="b", shutdown_grace=0.0) as b:
            await b.mount(sub, rec)
            await eventually(lambda: rec.seen, timeout=20, what="B's delivery of A's message")
            if stream:
                await eventually(lambda: equals(pending(client), 0), what="B's ACK")
                await eventually(lambda: _consumers(client, ["b"]), what="A out of the group")
            else:
                await eventually(lambda: equals(client.execute("LLEN", "{q}:processing:b"), 0),
                                 what="B's ACK")
    assert [d.attempt for d in rec.seen] == [2]
    left = {k.decode(): int(await client.execute("PTTL", k))
            for k in await client.execute("KEYS", "*")}
    forever = sorted(k for k, ttl in left.items() if ttl < 0 and k not in ("s", "done"))
    assert forever == [], left
    if stream:
        assert await _consumers(client, []), await client.execute("XINFO", "CONSUMERS", "s", "g")


async def _consumers(client: Client, names: list[str]) -> bool:
    """The consumers of ``s``'s group ``g`` are ``names``."""
    rows = await client.execute("XINFO", "CONSUMERS", "s", "g")
    return sorted(dict(zip(r[::2], r[1::2], strict=False))[b"name"].decode() for r in rows) == names
