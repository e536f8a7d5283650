"""A stream's joints against a real server: a consumer stalled past
``min_idle`` (SIGSTOP) while an entry it failed waits out its ``Backoff``,
and another consumer claims that entry meanwhile.

The stalled consumer's memory (its waiting set, its lease) meets what Redis
says now (the entry pending for another consumer, the schedule by the
server's clock): the entry's next attempt comes once, from its new owner, no
sooner than it is due; the stalled consumer, resumed, neither redelivers it
nor takes it back.  Timeouts are bounds, never expectations.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import trio
from _paths import TESTS
from _procs import child_lines

from trio_redis_finalize import ACK, Backoff, Delivery, Mode, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(90)

S, G = "s", "g"
WINDOW = 4.0
PROC = str(TESTS / "_stream_proc.py")


@pytest.mark.parametrize("resume", ["before-due", "after-due"])
@pytest.mark.parametrize("mode", [Mode.RECLAIM, Mode.CLAIMING], ids=["reclaim", "claiming"])
async def test_a_waiting_entry_claimed_from_a_stalled_consumer_comes_back_once_when_due(
    redis_url: str, client: Client, mode: Mode, resume: str,
) -> None:
    """Consumer A (a process) fails the entry's attempt 1; attempt 2 is due
    4 s later (``Backoff`` window, ``max_attempts=2``), its due time written
    to the schedule.  A is stopped (SIGSTOP) at once; its lease lapses
    (``min_idle`` 1 s) and consumer B claims the entry, finds it not due and
    lets it wait out the rest.  A is resumed before the entry is due, or
    after.  Attempt 2 is handled once, by B, no sooner than it was due; A
    handles nothing more, and nothing is left pending."""
    eid = (await client.execute("XADD", S, "*", "n", "1")).decode()
    await client.execute("XGROUP", "CREATE", S, G, "0")
    seen: list[tuple[str, int, float]] = []

    async def record(d: Delivery) -> Outcome:
        assert d.id is not None
        seen.append((d.id, d.attempt, time.monotonic()))
        return ACK

    schedule = f"{{{S}}}:backoff:{G}"
    async with child_lines(PROC, redis_url, S, G, "a", mode.value, "1.0", "0", str(WINDOW)) as a:
        assert await a.read(lambda w: w[:1] == ["H"], 20), a.lines
        failed_at = float(a.lines[-1][3])
        with trio.fail_after(10):  # a bound: the due time written, then A stopped
            while not await client.execute("ZCARD", schedule):
                await trio.sleep(0.01)
        os.kill(a.proc.pid, signal.SIGSTOP)
        stopped = trio.current_time()
        sub = StreamSubscription(S, G, mode=mode, min_idle=1.0, block=0.1, max_attempts=2)
        backoff = Backoff(base=0.01, cap=0.01, window=WINDOW)
        async with open_consumer(redis_url, name="b", shutdown_grace=0.0) as consumer:
            await consumer.mount(sub, record, on_error=backoff)
            with trio.fail_after(15):  # a bound: B claimed it (A's lease lapsed)
                while (rows := await client.execute("XPENDING", S, G, "-", "+", 1)) \
                        and rows[0][1] != b"b":
                    await trio.sleep(0.02)
            # A resumed 2.5 s after its stop (before the entry is due), or 5.5 s
            await trio.sleep(max(0.0, (2.5 if resume == "before-due" else 5.5)
                                 - (trio.current_time() - stopped)))
            os.kill(a.proc.pid, signal.SIGCONT)
            with trio.fail_after(20):  # a bound
                while not seen:
                    await trio.sleep(0.02)
            await a.read(None, 2.0)  # A runs on 2 s
            pending = await client.execute("XPENDING", S, G)
    assert [(i, at) for i, at, _ in seen] == [(eid, 2)], seen
    assert seen[0][2] >= failed_at + WINDOW - 0.05, (seen, failed_at)
    assert [w[:3] for w in a.words("H")] == [["H", eid, "1"]], a.lines
    assert int(pending[0]) == 0, pending


@pytest.mark.parametrize("stop", ["graceful", "lapsed"])
async def test_a_stopped_consumers_waiting_entry_taken_over_comes_back_only_when_due(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch, stop: str,
) -> None:
    """``Mode.PLAIN``: consumer A fails the entry's attempt 1 (attempt 2 due
    4 s later: ``Backoff`` window, ``max_attempts=2``) and stops while it
    waits: gracefully (the entry left pending with its schedule, not handed
    back) or without deregistering (as a crash leaves it).  Consumer B's
    reaper takes A's pending entries over once A is stopped (or its
    heartbeat, 1 s, lapsed) and they are idle that long: the waiting entry
    waits out the rest of its Backoff first, as a restart or a RECLAIM /
    CLAIMING claim lets it (the schedule outlives the process).  Attempt 2
    comes once, no sooner than due."""
    from trio_redis_finalize import _shutdown

    monkeypatch.setattr(_shutdown, "FINALIZE_GRACE", 1.0)
    eid = (await client.execute("XADD", S, "*", "n", "1")).decode()
    await client.execute("XGROUP", "CREATE", S, G, "0")
    failed: list[float] = []
    seen: list[tuple[str, int, float]] = []

    async def fail(d: Delivery) -> Outcome:
        failed.append(time.monotonic())
        raise RuntimeError("fails once")

    async def record(d: Delivery) -> Outcome:
        assert d.id is not None
        seen.append((d.id, d.attempt, time.monotonic()))
        return ACK

    sub = StreamSubscription(S, G, block=0.1, heartbeat=1.0, max_attempts=2)
    backoff = Backoff(base=0.01, cap=0.01, window=WINDOW)
    with trio.fail_after(40):  # a bound
        async with open_consumer(redis_url, name="a", shutdown_grace=0.5) as a:
            await a.mount(sub, fail, on_error=backoff)
            while not await client.execute("ZCARD", f"{{{S}}}:backoff:{G}"):
                await trio.sleep(0.01)
            if stop == "lapsed":  # no hand-back, no deregistration: as a crash leaves it

                async def nothing() -> None:
                    return None

                monkeypatch.setattr(a.mounts[0], "deregister", nothing)
        async with open_consumer(redis_url, name="b") as b:
            await b.mount(sub, record, on_error=backoff)
            while not seen:
                await trio.sleep(0.02)
            while int((await client.execute("XPENDING", S, G))[0]):
                await trio.sleep(0.02)
    assert [(i, at) for i, at, _ in seen] == [(eid, 2)], seen
    early = failed[0] + WINDOW - seen[0][2]
    assert early <= 0.05, f"attempt 2 came {early:.2f} s before its Backoff was due"
